"""EAGLE-3 heads (Li et al., 2025; an ``eagle3`` GGUF) driven from Python for a target whose layer
features llama.cpp exports (Gemma 4, Llama, Qwen 3...) or the target's eval callback copies (Gemma 3;
engine/llama/features.py).

A head is one decoder layer with its own small KV cache. It reads three of the target's layer
features (the inputs of three target layers, or the final post-norm state for the id ``n_layer``)
and drafts autoregressively. llama.cpp (as vendored by llama-cpp-python 0.3.36) runs it as an
encoder-decoder model over the target's context (``ctx_other``: the head borrows the target's token
embedding, and its output head when it has none); the loop is ours (llama.cpp's is C++ in
``common/speculative.cpp``, draft-eagle3, which the wheel does not ship):

- the target gives the three features of every row it decodes (:func:`~..llama.features.layer_features`:
  llama.cpp's export, or a copy by the eval callback), only while an EAGLE-3 drafter may draft
  (:meth:`Eagle3Drafter.before_target_pass`); the rows are copied after each chunk (a later pass
  would overwrite them, and a step the policy does not draft still extends the context);
- the **encoder** maps a position's features to g[p] = fc(features[p]) (an embedding-only batch,
  in a second context over the same weights, so that the decoder's context keeps its graph);
- the **decoder** at position p takes the pair (token at p + 1, g[p]) and writes the head's KV cell
  p: so after a target pass the head catches up on the pairs of the accepted positions and feeds
  the seed pair (the pending token, g at n_past - 1), in one decode that asks every row's logits
  (llama.cpp's eagle3 graph selects no output rows; see :data:`MERGED_EXTRA_LOGITS`); the seed's
  logits give draft token 1 and its pre-norm hidden row is the next step's g; every later step
  feeds (the token just drafted, the next position, that hidden row);
- the head's cells past the accepted positions (the draft chain's) are removed before the next
  catch-up, and cells whose pair changed (the target rolled back below them) too: the head's KV
  cache stays in step with every rollback of the target's;
- with a reduced draft vocabulary (``d2t``: absolute target ids) the head's logits outside it are
  -inf: drafting works on the ``d2t`` entries only, and a sampled draft's q is 0 outside it.

Each head step pays the head's output layer over its draft vocabulary (32k rows for public heads),
so the policy's measured draft cost includes it.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..llama.features import LayerFeatures, layer_features, layers_problem, target_problem
from ..llama.model import LlamaModel, address_result
from .draft_model import greedy_draft_token, next_draft_token
from ..llama.gguf import GGUFHeaderError, architecture
from .linked_head import LinkedHead, linked_context, nextn_bindings, pointer_field
from ..llama.process import load_llama_cpp
from ..sampling import Sampler
from .base import Draft, Drafter
from ..errors import EngineError, KVCacheError, ModelLoadError
from ..config import EngineConfig, ModelConfig, SamplingParams, SpecConfig

HEAD_ARCHITECTURE = "eagle3"
#: How many target features a head reads (llama.cpp refuses any other count at load).
N_FEATURES = 3
#: Rows of one head decode or encode: a verify pass's rows (pending + K <= 64). llama.cpp's eagle3
#: decoder computes logits for every row it is given (scattered over the whole vocabulary with a
#: reduced one), so the head's compute buffer grows with this.
HEAD_BATCH_ROWS = 65
#: The head catches up on a verify pass's pairs and its seed pair in one decode that copies out
#: every row's logits (llama.cpp computes them all anyway) when the rows before the seed's hold at
#: most this many floats (1 MiB: 2 rows of a 262k vocabulary, all 65 of the tests' 256), else in
#: a decode without logits and a one-row seed step (one llama_decode more).
MERGED_EXTRA_LOGITS = 1 << 18
#: Feature rows kept between passes before they are encoded anyway (twice a verify pass).
STASH_ROWS = 2 * HEAD_BATCH_ROWS
#: Rows of one encode, in the encoder's own context (Eagle3Head.encode): a pass brings K + 1 new
#: positions; more (a prompt's) are encoded in chunks. Its context reserves the head's decoder graph
#: for this many rows, logits included (16 rows of a 262k vocabulary: 16 MiB), so it stays small.
ENCODER_BATCH_ROWS = 16


class HeadMismatchError(EngineError):
    """The EAGLE-3 head cannot draft for this target (architecture, sizes, layers, n_ctx)."""


def is_eagle3_head(path: str) -> bool:
    """Whether the GGUF at ``path`` is an EAGLE-3 head (by its ``general.architecture``). A file
    that cannot be read or is no GGUF is not one: another loader reports what is wrong with it."""
    try:
        return architecture(path) == HEAD_ARCHITECTURE
    except (OSError, GGUFHeaderError):
        return False


class Eagle3Bindings:
    """llama.cpp's layer-feature API (``src/llama-ext.h``), bound by hand: its functions have C++
    linkage, so libllama exports them under mangled names, and llama-cpp-python binds none of them.
    Each is looked up under its plain name first (a later llama.cpp may export it as C), then its
    Itanium-mangled one; a missing symbol is an EngineError naming it, raised at load."""

    _SIGNATURES = {  # plain name: mangled name (g++ / clang, x86_64 and aarch64 alike)
        "llama_set_embeddings_layer_inp": "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
        "llama_get_embeddings_layer_inp": "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
        "llama_model_target_layer_ids": "_Z28llama_model_target_layer_idsPK11llama_model",
        "llama_model_target_layer_ids_n": "_Z30llama_model_target_layer_ids_nPK11llama_model",
        "llama_model_get_tok_embd": "_Z24llama_model_get_tok_embdPK11llama_modelPf",
    }

    def __init__(self) -> None:
        llama_cpp = load_llama_cpp()
        library = llama_cpp.llama_cpp._lib
        ctx, model = llama_cpp.llama_context_p_ctypes, llama_cpp.llama_model_p_ctypes
        floats = ctypes.POINTER(ctypes.c_float)
        types = {
            "llama_set_embeddings_layer_inp": ([ctx, ctypes.c_uint32, ctypes.c_bool], None),
            # an address (int), not a float pointer: views are found by it (BufferViews.at)
            "llama_get_embeddings_layer_inp": ([ctx, ctypes.c_uint32], ctypes.c_void_p),
            "llama_model_target_layer_ids": ([model], ctypes.POINTER(ctypes.c_int32)),
            "llama_model_target_layer_ids_n": ([model], ctypes.c_uint32),
            "llama_model_get_tok_embd": ([model, floats], ctypes.c_uint32),
        }
        for name, mangled in self._SIGNATURES.items():
            function = getattr(library, name, None) or getattr(library, mangled, None)
            if function is None:
                raise EngineError(f"this libllama exports no {name} ({mangled}): EAGLE-3 drafting "
                                  "needs the llama.cpp of llama-cpp-python 0.3.36")
            function.argtypes, function.restype = types[name]
            setattr(self, name, function)
        self.nextn = nextn_bindings()

    def target_layers(self, model: object) -> List[int]:
        """The target layer ids a head reads (its ``eagle3.target_layers``)."""
        count = int(self.llama_model_target_layer_ids_n(model))
        ids = self.llama_model_target_layer_ids(model)
        return [int(ids[i]) for i in range(count)] if ids else []


def _meta_int(model: object, key: str) -> Optional[int]:
    """An integer GGUF key of a loaded model (llama.cpp prints every value as text)."""
    buf = ctypes.create_string_buffer(32)
    n = load_llama_cpp().llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    try:
        return int(buf.value) if n > 0 else None
    except ValueError:
        return None


class Eagle3Head(LinkedHead):
    """An EAGLE-3 head and its context over the target's: encoder, decoder rows, one-row steps."""

    mismatch = HeadMismatchError
    what = "the EAGLE-3 head"
    shares_positions = "its KV cache holds the target's positions"

    def __init__(self, config: ModelConfig, target: LlamaModel) -> None:
        path = config.resolved_path
        kind = architecture_of(path)
        if kind != HEAD_ARCHITECTURE:
            raise HeadMismatchError(f"{path} is no EAGLE-3 head: its architecture is "
                                    f"{kind or 'unknown'}, not {HEAD_ARCHITECTURE}")
        problem = target_problem(target)
        if problem:
            raise HeadMismatchError(problem)
        self.bindings = Eagle3Bindings()
        self._encoder = self._pairs = self._encoder_ctx = None
        super().__init__(config, target, ctx_type=load_llama_cpp().LLAMA_CONTEXT_TYPE_DEFAULT,
                         n_batch=HEAD_BATCH_ROWS)

    def _check_pair(self, target: LlamaModel, target_model: object) -> None:
        llama_cpp = self._llama_cpp
        self.n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self.n_embd_target = int(llama_cpp.llama_model_n_embd(target_model))
        self.n_layer_target = int(llama_cpp.llama_model_n_layer(target_model))
        self.layers = self.bindings.target_layers(self._model)
        if len(self.layers) != N_FEATURES:
            raise HeadMismatchError(f"{self.path} reads {len(self.layers)} target layers; an EAGLE-3 "
                                    f"head reads {N_FEATURES}")
        deepest = max(self.layers)
        if deepest > self.n_layer_target or min(self.layers) < 0:
            raise HeadMismatchError(
                f"{self.path} reads target layers {self.layers}, and the target {target.path} has "
                f"{self.n_layer_target} layers (ids 0..{self.n_layer_target}): it is the head of "
                "another model")
        problem = layers_problem(target, self.layers, self.n_layer_target)
        if problem:
            raise HeadMismatchError(problem)
        hidden = _meta_int(self._model, f"{HEAD_ARCHITECTURE}.target_hidden_size")
        for size, name in ((hidden, "reads target features of size"), (self.n_embd, "has a hidden size of")):
            if size != self.n_embd_target:
                raise HeadMismatchError(
                    f"{self.path} {name} {size}, and the target {target.path} has {self.n_embd_target}: "
                    "it is the head of another model")
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model)))
        if self.n_vocab != target.n_vocab:
            raise HeadMismatchError(
                f"{self.path} has a vocabulary of {self.n_vocab} tokens and the target {target.path} "
                f"{target.n_vocab}: its drafts would be other tokens")
        self.own_token_embd = bool(self.bindings.llama_model_get_tok_embd(self._model, None))

    def _after_context(self, target: LlamaModel, target_ctx: object) -> None:
        llama_cpp, nextn = self._llama_cpp, self.bindings.nextn
        if not self.own_token_embd and nextn.llama_get_ctx_other(self._ctx) != target_ctx:
            raise HeadMismatchError(f"llama.cpp did not link {self.path} to the target's context")
        nextn.llama_set_embeddings_nextn(self._ctx, True, True)  # the pre-norm rows
        self._encoder_ctx = linked_context(self._model, self.config, target,  # see encode()
                                           llama_cpp.LLAMA_CONTEXT_TYPE_DEFAULT, ENCODER_BATCH_ROWS,
                                           n_ctx=ENCODER_BATCH_ROWS)
        if not self._encoder_ctx:
            raise ModelLoadError(f"llama.cpp could not create the encoder context of {self.path}")
        nextn.llama_set_embeddings_nextn(self._encoder_ctx, True, True)  # the encoder's output
        self._encoded_at = address_result(nextn.llama_get_embeddings_nextn)
        self.n_features = N_FEATURES * self.n_embd_target
        # encoder: embedding rows only (no token array: set to NULL, kept for llama_batch_free);
        # decoder rows: tokens, with embd pointing at the caller's rows (reset before the free)
        self._encoder = llama_cpp.llama_batch_init(ENCODER_BATCH_ROWS, 0, 1)
        self._encoder_embd = pointer_field(self._encoder, "embd")
        self._encoder_tokens, self._encoder.token = self._encoder.token, None
        self._pairs = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._pairs_embd = pointer_field(self._pairs, "embd")
        for batch, rows in ((self._encoder, ENCODER_BATCH_ROWS), (self._pairs, self.n_batch)):
            np.ctypeslib.as_array(batch.n_seq_id, shape=(rows,))[:] = 1
            for i in range(rows):
                batch.seq_id[i][0] = 0
        # the encoder is per row and checks no positions (llama.cpp skips their continuity
        # checks in llama_encode): placeholders, set once
        np.ctypeslib.as_array(self._encoder.pos, shape=(ENCODER_BATCH_ROWS,))[:] = range(ENCODER_BATCH_ROWS)
        np.ctypeslib.as_array(self._encoder.logits, shape=(ENCODER_BATCH_ROWS,))[:] = 1
        self._pair_tokens = np.ctypeslib.as_array(self._pairs.token, shape=(self.n_batch,))
        self._pair_pos = np.ctypeslib.as_array(self._pairs.pos, shape=(self.n_batch,))
        self._pair_flags = np.ctypeslib.as_array(self._pairs.logits, shape=(self.n_batch,))
        # positions as a table: a slice of it is copied into a batch (cheaper than from a range)
        self._positions = np.arange(target.n_ctx + self.n_batch, dtype=np.int32)
        self.d2t = self._draft_vocabulary()

    def _draft_vocabulary(self) -> Optional[np.ndarray]:
        """The target ids the head drafts (its ``d2t``), read off one probe row's logits: llama.cpp
        scatters the head's logits into the full vocabulary, -inf elsewhere. None: every id."""
        logits, _ = self.step(0, 0, np.zeros(self.n_embd, dtype=np.float32))
        self.clear()
        finite = np.flatnonzero(np.isfinite(logits))
        if finite.size == 0:
            raise ModelLoadError(f"{self.path} gave no finite logit on a probe row (broken weights?)")
        return None if finite.size == self.n_vocab else finite

    # -- the encoder and the decoder's catch-up rows ----------------------------------------------
    def encode(self, features_at: int, n: int, out: np.ndarray) -> None:
        """``out[i] = g`` of the feature row i of the ``n`` rows at address ``features_at``
        (C-contiguous float32 rows of ``n_features``, see :func:`rows_address`), in chunks of
        :data:`ENCODER_BATCH_ROWS` (llama.cpp's encoder takes one ubatch).

        The encoder runs in a context of its own (the same weights, no KV cell written): in the
        head's, every decode after an encode rebuilt its graph and re-planned its buffers, and
        every encode its own graph; here consecutive encodes of as many rows reuse theirs."""
        batch, row_bytes, ctx = self._encoder, self.n_features * 4, self._encoder_ctx
        for start in range(0, n, ENCODER_BATCH_ROWS):
            rows = min(ENCODER_BATCH_ROWS, n - start)
            self._encoder_embd.value = features_at + start * row_bytes
            batch.n_tokens = rows
            rc = self._llama_cpp.llama_encode(ctx, batch)
            if rc != 0:
                raise EngineError(f"{self.what}'s llama_encode failed with code {rc} ({rows} rows)")
            out[start:start + rows] = self._views.at(self._encoded_at(ctx), (rows, self.n_embd))

    def decode_pairs(self, tokens: Sequence[int], first: int, rows_at: int) -> None:
        """Write the head's KV cells ``first ..`` from the pairs (``tokens[i]``, row i at address
        ``rows_at``: C-contiguous float32 rows of ``n_embd``), no logits, in chunks of ``n_batch``."""
        row_bytes = self.n_embd * 4
        for start in range(0, len(tokens), self.n_batch):
            part = tokens[start:start + self.n_batch]
            self._decode_rows(part, first + start, rows_at + start * row_bytes, outputs=False)

    def decode_last(self, tokens: Sequence[int], first: int,
                    rows_at: int) -> Tuple[np.ndarray, np.ndarray]:
        """:meth:`decode_pairs` in one decode (at most ``n_batch`` pairs) that returns the last
        pair's (logits, next hidden row), views until the next decode. llama.cpp's eagle3 graph
        selects no output rows (a decode asking logits of some rows gets the first rows' values),
        so every row is asked for: it computes them all anyway, only their copy out is extra."""
        self._decode_rows(tokens, first, rows_at, outputs=True)
        return self._outputs(len(tokens) - 1)

    def _decode_rows(self, tokens: Sequence[int], first: int, rows_at: int, outputs: bool) -> None:
        batch, n = self._pairs, len(tokens)
        self._pairs_embd.value = rows_at
        self._pair_tokens[:n] = tokens
        self._pair_pos[:n] = self._positions[first:first + n]
        self._pair_flags[:n] = outputs
        batch.n_tokens = n
        rc = self._llama_decode(self._ctx, batch)
        if rc != 0:
            raise KVCacheError(f"{self.what}'s llama_decode failed with code {rc} at position "
                               f"{first} ({n} rows)")

    def rollback(self, position: int) -> None:
        """Remove the head's KV cells at positions >= ``position``."""
        if not self._llama_cpp.llama_memory_seq_rm(self._mem, 0, position, -1):
            raise KVCacheError(f"llama.cpp refused to remove {self.what}'s KV cells >= {position}")

    def clear(self) -> None:
        self._llama_cpp.llama_memory_clear(self._mem, True)

    def model_info(self) -> dict:
        info = self.base_info()
        info.update(architecture=HEAD_ARCHITECTURE, target_layers=list(self.layers),
                    n_embd=self.n_embd, n_draft_vocab=self.n_vocab if self.d2t is None else len(self.d2t))
        return info

    def _free_extras(self) -> None:
        llama_cpp = self._llama_cpp
        if self._encoder_ctx:
            llama_cpp.llama_free(self._encoder_ctx)
        self._encoder_ctx = None
        if self._encoder is not None:
            self._encoder.token, self._encoder_embd.value = self._encoder_tokens, None
            llama_cpp.llama_batch_free(self._encoder)
        if self._pairs is not None:
            self._pairs_embd.value = None  # the caller's rows: llama_batch_free must skip them
            llama_cpp.llama_batch_free(self._pairs)
        self._encoder = self._pairs = None


def architecture_of(path: str) -> str:
    """``general.architecture`` of a GGUF, '' when unreadable (the loader then says why)."""
    try:
        return architecture(path) or ""
    except (OSError, GGUFHeaderError):
        return ""


def rows_address(rows: np.ndarray) -> int:
    """The address of a C-contiguous float32 array, for the head's batches to point at (the
    caller keeps the array alive while the head reads it)."""
    if rows.dtype != np.float32 or not rows.flags.c_contiguous:
        raise ValueError("the head reads C-contiguous float32 rows")
    return int(rows.ctypes.data)


class Eagle3Drafter(Drafter):
    """Drafts with an EAGLE-3 head. Implements :class:`~gemma_spec_ros.engine.drafters.base.Drafter`.

    State by position (see the module docstring): g rows (encoder outputs) held for
    [``_start``, ``_g_end``), feature rows not yet encoded for [``_g_end``, ``_f_end``) (the
    stash), head KV cells holding the right pairs for [``_start``, ``_kv_end``); cells past
    ``_kv_end`` are the last draft chain's. Each target chunk decoded at ``base`` rewrote the
    target's positions >= base, so it cuts all three there (the pair at base - 1 read the token at
    base); a chunk past what is held (features missed while export was off) starts over at it.

    Greedy drafting stops when the head's top probability (over its draft vocabulary) falls below
    ``spec.p_min``; for ``rejection`` verification of a sampled request the drafts are sampled
    from the request's sampler over the head's logits, q returned with them (0 outside ``d2t``).
    The g rows of every position are kept (n_ctx x n_embd float32, paged in as written): a new
    request that shares a prefix with the last one rewrites only the head cells after it.
    """

    name = "eagle3"
    #: a probe costs the head's catch-up on the passes since its last draft, and one step
    cheap_to_probe = True

    def __init__(self, config: ModelConfig, target: LlamaModel) -> None:
        self.target = target
        self.head = Eagle3Head(config, target)
        head = self.head
        try:
            self.features: LayerFeatures = layer_features(target, head.layers, head.n_layer_target,
                                                          head.n_embd_target, head.bindings)
        except EngineError as exc:
            head.close()
            raise HeadMismatchError(str(exc)) from exc
        self._g = np.empty((target.n_ctx, head.n_embd), dtype=np.float32)
        self._stash = np.empty((STASH_ROWS, head.n_features), dtype=np.float32)
        # the head reads both by address (row i of g at _g_at + i * _g_row_bytes)
        self._g_at, self._g_row_bytes = rows_address(self._g), head.n_embd * 4
        self._stash_at = rows_address(self._stash)
        width = head.n_embd_target  # the stash's column block of each feature
        self._stash_blocks = [self._stash[:, k * width:(k + 1) * width] for k in range(N_FEATURES)]
        self._restart(0)
        self._sampler: Optional[Sampler] = None
        self._rng: Optional[np.random.Generator] = None
        self._unusable = ""  # why the head drafts no more (non-finite g rows), '' while it may
        self._fault: Optional[str] = None

    # -- the target's export --------------------------------------------------------------------
    def before_target_pass(self, drafting: bool) -> None:
        """The target exports features from its next decode on (or stops): only while this drafter
        may draft, so that other modes pay nothing. What the target decoded while it was off was
        not seen: the head starts over at the next decode."""
        if drafting == self.features.enabled:
            return
        self.features.enable(drafting)
        if drafting:
            self.target.add_chunk_listener(self._on_chunk)
        else:
            self.target.remove_chunk_listener(self._on_chunk)
        if drafting:
            self._restart(self.target.n_past)

    def _restart(self, position: int) -> None:
        """Nothing held: the head's cache empty, g and features from ``position`` on."""
        self._start = self._kv_end = self._g_end = self._f_end = position
        self.head.clear()

    def _on_chunk(self, base: int, rows_here: List[int], last_chunk: bool) -> None:
        """After each chunk the target decoded (its positions base .. n_past - 1): cut what the
        chunk rewrote, then keep its feature rows (encoded at once where the stash is full)."""
        n = self.target.n_past - base
        if base < self._start or base > self._f_end:
            self._restart(base)
        else:
            self._f_end = base
            self._g_end = min(self._g_end, base)
            self._kv_end = min(self._kv_end, max(self._start, base - 1))
        views, done = self.features.rows(), 0
        while done < n:
            held = self._f_end - self._g_end
            if held == STASH_ROWS:
                self._encode_stash(self._f_end)
                continue
            take = min(STASH_ROWS - held, n - done)
            for block, view in zip(self._stash_blocks, views):
                block[held:held + take] = view[done:done + take]
            self._f_end += take
            done += take

    def _give_up(self, position: int, largest: float) -> None:
        """Stop drafting for good: the head's encoder gave a non-finite g row (its KV cells would
        spread it to every later draft), reported once (:meth:`take_fault`)."""
        self._unusable = self._fault = (
            f"the EAGLE-3 head {self.head.path} computed non-finite features at position {position} "
            f"(the target's features reach |x| = {largest:.3g}): most likely its fc layer is stored "
            "in F16, which holds no value above 65,504 (Gemma 3's features exceed it; llama.cpp "
            "multiplies F16 weights in F16): convert the head with --outtype f32. It drafts no more.")

    def _encode_stash(self, upto: int) -> None:
        """g rows for the stashed positions below ``upto`` (<= ``_f_end``)."""
        count = upto - self._g_end
        if count <= 0:
            return
        encoded = self._g[self._g_end:upto]
        self.head.encode(self._stash_at, count, encoded)
        if not self._unusable and not np.isfinite(encoded).all():
            self._give_up(self._g_end + int(np.flatnonzero(~np.isfinite(encoded).all(axis=1))[0]),
                          float(np.abs(self._stash[:count]).max()))
        rest = self._f_end - upto
        if rest:
            self._stash[:rest] = self._stash[count:count + rest]
        self._g_end = upto

    # -- Drafter ---------------------------------------------------------------------------------
    def begin(self, prompt_tokens: Sequence[int], sampling: Optional[SamplingParams] = None,
              rng: Optional[np.random.Generator] = None) -> None:
        """Sample this request's drafts from ``sampling`` (rejection verification) or draft
        greedily; the head's cache of a shared prefix stays."""
        self._sampler = None if sampling is None or sampling.greedy else Sampler(sampling)
        self._rng = rng

    def propose(self, context: Sequence[int], max_tokens: int, spec: SpecConfig = SpecConfig()) -> Draft:
        """Up to ``max_tokens`` tokens after ``context`` = the target's cache + the pending token
        (+ tokens a grammar forces, drafted already: the head is fed them as its own draft chain,
        then drafts after them). Nothing while the target's features of its last position are
        missing (the mode just switched to eagle3: the next pass exports them)."""
        position = self.target.n_past
        if (not self.features.enabled or max_tokens <= 0 or len(context) <= position
                or self._f_end < position or self._start >= position):
            return Draft()
        self._encode_stash(position)
        if self._unusable:
            return Draft()
        logits, hidden = self._seed(context, position)
        for offset, forced in enumerate(context[position + 1:]):
            logits, hidden = self.head.step(forced, position + offset, hidden)
        position = len(context) - 1  # the head cell of the first drafted token
        tokens: List[int] = []
        probs: List[np.ndarray] = []
        draft_token = self._greedy_token if self._sampler is None else self._draft_token
        step, is_eog, p_min = self.head.step, self.target.is_eog, spec.p_min
        while True:
            token = draft_token(logits, p_min, probs)
            if token is None:
                break
            tokens.append(token)
            if len(tokens) >= max_tokens or is_eog(token):
                break
            logits, hidden = step(token, position, hidden)
            position += 1
        if len(tokens) < spec.draft_min or not tokens:
            return Draft()
        return Draft(tuple(tokens), tuple(probs) if self._sampler is not None else None, self.name)

    def _seed(self, context: Sequence[int], position: int) -> Tuple[np.ndarray, np.ndarray]:
        """Bring the head up to the target's ``position``: encode the new features, drop the cells
        of the last draft chain, write the accepted positions' pairs and the seed pair (the
        pending token, g at position - 1), whose logits give the first draft token. After a
        verify pass the pairs are a few: one decode where its logits are small
        (:data:`MERGED_EXTRA_LOGITS`)."""
        self._encode_stash(position)
        head, seed = self.head, min(self._kv_end, position - 1)
        head.rollback(seed)
        tokens, rows_at = context[seed + 1:position + 1], self._g_at + seed * self._g_row_bytes
        if len(tokens) <= head.n_batch and (len(tokens) - 1) * head.n_vocab <= MERGED_EXTRA_LOGITS:
            result = head.decode_last(tokens, seed, rows_at)
        else:
            head.decode_pairs(tokens[:-1], seed, rows_at)
            result = head.step(tokens[-1], position - 1, self._g[position - 1])
        self._kv_end = position
        return result

    def _greedy_token(self, logits: np.ndarray, p_min: float, probs: List[np.ndarray]) -> Optional[int]:
        """The next draft token of a greedy request: the head's argmax over its draft vocabulary,
        None below ``p_min`` (``probs`` unused: a greedy draft has no q)."""
        d2t = self.head.d2t
        if d2t is None:
            return greedy_draft_token(logits, p_min)
        row = logits[d2t]  # a copy: ours to overwrite
        index = greedy_draft_token(row, p_min, out=row)
        return None if index is None else int(d2t[index])

    def _draft_token(self, logits: np.ndarray, p_min: float, probs: List[np.ndarray]) -> Optional[int]:
        """The next draft token of a sampled request (rejection verification), drawn over the
        head's draft vocabulary only, its q appended to ``probs`` (:meth:`_greedy_token`: greedy)."""
        d2t = self.head.d2t
        if d2t is None:
            return next_draft_token(logits, self._sampler, self._rng, p_min, probs)
        drawn: List[np.ndarray] = []
        index = next_draft_token(logits[d2t], self._sampler, self._rng, p_min, drawn)
        if index is None:
            return None
        if drawn:  # q over the whole vocabulary, as verification reads it
            q = np.zeros(self.head.n_vocab, dtype=drawn[0].dtype)
            q[d2t] = drawn[0]
            probs.append(q)
        return int(d2t[index])

    def take_fault(self) -> Optional[str]:
        """Why the head stopped drafting (non-finite features), once; nothing is saved, so
        nothing else fails after a request."""
        fault, self._fault = self._fault, None
        return fault

    def warm_up(self, filler: Sequence[int], max_rows: int, passes: int) -> None:
        """Run the head's encoder, catch-up decodes and steps untimed, so that the first measured
        draft costs are steady-state ones; leaves the head's cache empty (the next draft catches
        up from the g rows held)."""
        head = self.head
        head.clear()
        n = max(1, min(max_rows, len(filler) - 1, head.n_batch))
        features = np.zeros((n, head.n_features), dtype=np.float32)
        rows = np.zeros((n, head.n_embd), dtype=np.float32)
        for _ in range(passes):
            head.encode(rows_address(features), n, rows)
            head.decode_pairs(list(filler[1:n]), 0, rows_address(rows))
            logits, hidden = head.step(filler[n], n - 1, rows[n - 1])
            head.step(filler[n], n, hidden)
            head.clear()
        self._kv_end = self._start

    def model_info(self) -> Optional[dict]:
        return {**self.head.model_info(), "drafter": self.name}

    def close(self) -> None:
        """Stop the target's export, then free the head (before the target)."""
        if self.head._ctx is not None and self.features.enabled:
            self.before_target_pass(False)
        self.head.close()


def build(config: EngineConfig, target: LlamaModel, n_seq: int) -> "Eagle3Drafter":
    """The kind's builder (``engine/drafter_kinds.py``): the head of ``draft.model_path``."""
    return Eagle3Drafter(config.draft, target)
