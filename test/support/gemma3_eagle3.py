"""An EAGLE-3 head for a Gemma 3 target (the embedded 270M model), fitted in seconds, and the
offline replay of its drafts.

    head = write_fitted_head(tmp_path, target_gguf, PROMPT)      # SpecForge layout -> converted GGUF
    tau = replay_tau(target_gguf, head, tokens, n_prompt, k=3)    # drafts replayed outside the engine

No head for any Gemma 3 size is published, and training one takes hours on a GPU (docs/deployment.md),
so this one is *fitted*: its weights are chosen so that on one text, the target's own greedy
continuation of a prompt, its first draft step is right at most positions and its second at some:
drafts are partly accepted, which is what the tests need (rollbacks of both caches, accepted runs
of every length). It is written as SpecForge saves a head (config.json + safetensors,
``midlayer.*``, ``eagle_config`` layer ids in SGLang's numbering) and converted by
``gemma-spec-eagle3-convert`` with the target's GGUF, as a trained head would be.

The head (one decoder layer, 640 wide as the target, 1 head x 128, a 2,048-token draft vocabulary,
F16: ~8 MB with the target's tokenizer) reads the inputs of target layers :data:`LAYERS`:

- ``fc`` is a random projection of the three features (each scaled by its typical size), so g
  depends on all three;
- attention reads the token half of its input: Q = 4 P x, K = P x for a random orthonormal P
  (128 x 640), so a position attends to itself (and to earlier copies of its token); V = [P, P]
  and the output projection P^T pass P^T P (x + g_norm) on: h = P^T P (x + g_norm) + g, with x the
  normed token embedding and g_norm the normed g;
- the FFN adds nothing (its down projection is zero);
- the output layer over the draft vocabulary is a ridge regression on rmsnorm(h), computed here from
  the captured features, of the first draft token (the seed pair (t[p+1], g[p]) -> t[p+2]) at 2
  positions p of 3 and of the second (t[p+2] and the first step's state -> t[p+3]) at 1 of 3.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from gemma_spec_ros.engine.config import ModelConfig
from gemma_spec_ros.engine.drafters.eagle3 import Eagle3Head, rows_address
from gemma_spec_ros.engine.llama.features import FeatureCapture, capture_of
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.tools.eagle3_convert import convert
from support.eagle3_layouts import hf_named, specforge_config, write_hf_head

#: The head's target layers (llama.cpp's numbering: the inputs of layers 2, 9 and 14 of 18; SpecForge
#: writes them as layer outputs [1, 8, 13], its own default for 18 layers)
LAYERS = (2, 9, 14)
HEAD_DIM = 128
N_FF = 64
N_DRAFT = 2048
SCORE_SCALE = 4.0  # Q = 4 P x: self-attention wins by a wide margin
LOGIT_SCALE = 20.0  # the fitted token's logit (others ~0): its probability is ~1
RIDGE = 1e-3  # of the mean squared row norm
EPS = 1e-6


def rms_norm(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    return rows / np.sqrt(np.mean(rows * rows, axis=-1, keepdims=True) + EPS)


def open_target(target: Path, n_ctx: int = 512, n_threads: int = 0) -> LlamaModel:
    """The target with a feature capture installed (what the engine does beside an EAGLE-3 head)."""
    return LlamaModel(ModelConfig(str(target), n_ctx=n_ctx, n_threads=n_threads),
                      eval_callback=FeatureCapture().function)


def capture(model: LlamaModel, tokens: Sequence[int], layers: Sequence[int]) -> List[np.ndarray]:
    """The inputs of target layers ``layers`` at every position of ``tokens``, from one decode of
    them all (the model's cache is emptied first)."""
    features = capture_of(model)
    features.want(layers, int(model._llama_cpp.llama_model_n_embd(model.handles[0])), model.n_batch)
    features.enable(True)
    model.clear()
    model.decode(list(tokens), [len(tokens) - 1])
    rows = [r.copy() for r in features.rows()]
    features.enable(False)
    return rows


def greedy_text(model: LlamaModel, prompt: Sequence[int], n: int) -> List[int]:
    """The target's greedy continuation of ``prompt``, ``n`` tokens, one-row decodes."""
    model.clear()
    rows = model.decode(list(prompt), [len(prompt) - 1])
    out: List[int] = []
    for _ in range(n):
        out.append(int(np.argmax(rows[-1])))
        rows = model.decode([out[-1]], [0])
    return out


def fitted_tensors(features: Sequence[np.ndarray], embeddings: np.ndarray, tokens: Sequence[int],
                   n_vocab: int, seed: int = 7) -> dict:
    """The head's tensors in GGUF names (see the module docstring), fitted on ``tokens``, whose
    target features are ``features`` and scaled token embeddings ``embeddings`` (feature id 0)."""
    rng = np.random.default_rng(seed)
    n_embd = embeddings.shape[1]
    tokens = np.asarray(tokens, dtype=np.int64)
    scales = [float(np.median(np.sqrt(np.mean(f.astype(np.float64) ** 2, axis=1)))) for f in features]
    fc = rng.standard_normal((n_embd, len(features) * n_embd)) / np.sqrt(len(features) * n_embd)
    for k, scale in enumerate(scales):
        fc[:, k * n_embd:(k + 1) * n_embd] /= scale
    g = np.concatenate(features, axis=1).astype(np.float64) @ fc.T
    projection = np.linalg.qr(rng.standard_normal((n_embd, HEAD_DIM)))[0].T  # orthonormal rows
    x = rms_norm(embeddings)
    mix = projection.T @ projection

    def layer(token_rows: np.ndarray, g_rows: np.ndarray) -> np.ndarray:  # the pre-norm state
        return (token_rows + rms_norm(g_rows)) @ mix + g_rows

    # step 1, the seed pair of position p: (token p + 1, g[p]) -> token p + 2, fitted at 2 positions
    # of 3; step 2: (token p + 2, step 1's state) -> token p + 3, at 1 of 3: drafts accept 0-3 tokens
    seeds = np.arange(len(tokens) - 3)
    first = layer(x[seeds + 1], g[seeds])
    second = layer(x[seeds + 2], first)
    fit1, fit2 = seeds[seeds % 3 != 2], seeds[seeds % 3 == 0]
    u = rms_norm(np.concatenate([first[fit1], second[fit2]]))
    labels = np.concatenate([tokens[fit1 + 2], tokens[fit2 + 3]])
    filler = np.setdiff1d(np.linspace(0, n_vocab - 1, 4 * N_DRAFT).astype(np.int64), tokens)
    d2t = np.union1d(tokens, filler[:max(0, N_DRAFT - len(np.unique(tokens)))])[:N_DRAFT]
    index = {int(t): i for i, t in enumerate(d2t)}
    gram = u.T @ u
    ridge = RIDGE * np.trace(gram) / n_embd
    solve = np.linalg.solve(gram + ridge * np.eye(n_embd), u.T)  # (n_embd, rows)
    output = np.zeros((len(d2t), n_embd))
    for row, label in enumerate(labels):
        output[index[int(label)]] += LOGIT_SCALE * solve[:, row]
    zero_pad = np.zeros((HEAD_DIM, n_embd))
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    return {
        "fc.weight": f32(fc), "output_norm.weight": f32(np.ones(n_embd)), "output.weight": f32(output),
        "d2t": d2t.astype(np.int64),
        "blk.0.attn_norm.weight": f32(np.ones(n_embd)), "blk.0.attn_norm_2.weight": f32(np.ones(n_embd)),
        "blk.0.ffn_norm.weight": f32(np.ones(n_embd)),
        "blk.0.attn_q.weight": f32(SCORE_SCALE * np.concatenate([projection, zero_pad], axis=1)),
        "blk.0.attn_k.weight": f32(np.concatenate([projection, zero_pad], axis=1)),
        "blk.0.attn_v.weight": f32(np.concatenate([projection, projection], axis=1)),
        "blk.0.attn_output.weight": f32(projection.T),
        "blk.0.ffn_gate.weight": f32(rng.standard_normal((N_FF, n_embd)) / np.sqrt(n_embd)),
        "blk.0.ffn_up.weight": f32(rng.standard_normal((N_FF, n_embd)) / np.sqrt(n_embd)),
        "blk.0.ffn_down.weight": f32(np.zeros((n_embd, N_FF))),
    }


def write_fitted_head(directory: Path, target: Path, prompt: str, n_tokens: int = 64,
                      n_threads: int = 0) -> Tuple[Path, List[int]]:
    """(the head's GGUF, the text it was fitted on: prompt + greedy tokens) in ``directory``."""
    model = open_target(target, n_threads=n_threads)
    try:
        prompt_tokens = model.tokenize(prompt)
        tokens = prompt_tokens + greedy_text(model, prompt_tokens, n_tokens)
        rows = capture(model, tokens, (0,) + LAYERS)
        n_vocab, n_embd = model.n_vocab, rows[0].shape[1]
    finally:
        model.close()
    tensors = fitted_tensors(rows[1:], rows[0], tokens, n_vocab)
    layer_config = dict(hidden_size=n_embd, num_attention_heads=1, num_key_value_heads=1, head_dim=HEAD_DIM,
                        intermediate_size=N_FF, rms_norm_eps=EPS, rope_theta=10000.0,
                        max_position_embeddings=32768, vocab_size=n_vocab)
    config = specforge_config(layer_config, LAYERS, len(tensors["d2t"]), "gemma3_text")
    head_dir = write_hf_head(directory / "specforge-head", hf_named(tensors, 1, 1, "specforge", n_vocab), config)
    out = directory / "gemma-3-270m-eagle3-fitted-F32.gguf"
    convert(head_dir, target, out, outtype="f32")  # F16 fc: the features overflow it (module docstring)
    return out, tokens


# -- the offline replay -------------------------------------------------------------------------------
def head_drafts(head: Eagle3Head, tokens: Sequence[int], g: np.ndarray, position: int, k: int,
                is_eog) -> List[int]:
    """The head's greedy draft of up to ``k`` tokens after ``tokens[:position + 1]`` (the target's
    cache holds ``position`` tokens, ``tokens[position]`` is pending), from an empty head cache:
    the pairs (token p + 1, g[p]) of p < position - 1, then the seed pair and the chain."""
    head.clear()
    if position > 1:
        head.decode_pairs(list(tokens[1:position]), 0, rows_address(g))
    logits, hidden = head.step(tokens[position], position - 1, g[position - 1])
    d2t, drafted, cell = head.d2t, [], position
    while True:
        row = logits if d2t is None else logits[d2t]
        best = int(np.argmax(row))
        drafted.append(best if d2t is None else int(d2t[best]))
        if len(drafted) >= k or is_eog(drafted[-1]):
            return drafted
        logits, hidden = head.step(drafted[-1], cell, hidden)
        cell += 1


def replay_tau(target: Path, head_path: Path, tokens: Sequence[int], n_prompt: int, k: int,
               n_ctx: int = 512, n_threads: int = 0) -> Tuple[float, int, int]:
    """(tau, drafts, accepted) of greedy EAGLE-3 drafting at a fixed ``k`` (no p_min, no adaptive
    policy) over the greedy text ``tokens`` (prompt: the first ``n_prompt``), replayed outside the
    engine: the features of all the tokens captured in one target decode, encoded at once, the
    head's cache rebuilt from nothing at each pass, each draft's accepted prefix read off the text.
    Every pass drafts ``min(k, tokens left - 1)`` tokens as the engine's loop does."""
    model = open_target(target, n_ctx=n_ctx, n_threads=n_threads)
    head = None
    try:
        head = Eagle3Head(ModelConfig(str(head_path), n_ctx=n_ctx, n_threads=n_threads), model)
        features = capture(model, tokens, head.layers)
        stacked = np.ascontiguousarray(np.concatenate(features, axis=1), dtype=np.float32)
        g = np.empty((len(tokens), head.n_embd), dtype=np.float32)
        head.encode(rows_address(stacked), len(tokens), g)
        max_tokens = len(tokens) - n_prompt
        position, emitted, drafts, accepted = n_prompt, 1, 0, 0
        while emitted < max_tokens:
            room = min(k, max_tokens - emitted - 1)
            gained = 1
            if room > 0:
                draft = head_drafts(head, tokens, g, position, room, model.is_eog)
                truth = list(tokens[position + 1:position + 1 + len(draft)])
                n_ok = next((i for i, (a, b) in enumerate(zip(draft, truth)) if a != b), len(draft))
                drafts, accepted, gained = drafts + 1, accepted + n_ok, n_ok + 1
            position, emitted = position + gained, emitted + gained
        return 1.0 + accepted / drafts if drafts else float("nan"), drafts, accepted
    finally:
        if head is not None:
            head.close()
        model.close()
