"""Gemma 4's own drafter: an MTP "assistant" (a ``gemma4-assistant`` GGUF) driven from Python.

An assistant is a few Q-only layers that read the target's last post-norm hidden state and attend
to the *target's* KV cache; it has no KV cache of its own. llama.cpp (as vendored by
llama-cpp-python 0.3.36) builds its graph when its context is created with ``ctx_type = MTP`` and
``ctx_other = <the target's context>``; the draft loop is ours (llama.cpp's is C++ in
``common/speculative.cpp``, which the wheel does not ship):

- the target exports the hidden row of every row it is asked logits for (only while an MTP drafter
  may draft: :class:`TargetHiddenRows`);
- draft step 0 feeds (the pending token, position n_past, the target's hidden row at n_past - 1,
  which produced the pending token); every later step feeds (the token just drafted, the *same*
  position, the assistant's own next hidden row). The assistant writes no KV, so there is nothing to
  roll back on its side; the engine rolls the target back to the accepted prefix after each verify
  pass, before the next draft (the assistant reads the target's cells, rejected ones included);
- after verification the hidden row of the last accepted position carries over, which is the
  target's row at (new n_past - 1): the verify pass asked logits for every row, so it is exported.

Each draft step is one assistant decode that pays the full-vocabulary head (262,144 rows for Gemma
4): llama.cpp does not implement the E-series' sparse centroid head (``masked_embd_centroids`` is
loaded and ignored), so the policy's measured draft cost includes it.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from ..llama.model import BufferViews, LlamaModel
from ..llama.process import load_llama_cpp
from .draft_model import next_draft_token
from .linked_head import LinkedHead, nextn_bindings
from ..llama.gguf import GGUFHeaderError, architecture
from ..sampling import Sampler
from .base import Draft, Drafter
from ..errors import EngineError
from ..config import EngineConfig, ModelConfig, SamplingParams, SpecConfig

ASSISTANT_ARCHITECTURE = "gemma4-assistant"
#: Targets whose graph exports the hidden row an assistant reads and whose cache it can share.
TARGET_ARCHITECTURES = ("gemma4",)


class AssistantMismatchError(EngineError):
    """The assistant cannot draft for this target (architecture, hidden size, vocabulary, n_ctx)."""


def is_assistant(path: str) -> bool:
    """Whether the GGUF at ``path`` is a Gemma 4 MTP assistant (by its ``general.architecture``).
    A file that cannot be read or is no GGUF is not one: the standalone draft model's loader then
    reports what is wrong with it."""
    try:
        return architecture(path) == ASSISTANT_ARCHITECTURE
    except (OSError, GGUFHeaderError):
        return False


class TargetHiddenRows:
    """The hidden rows the target's last decode exported, by position.

    A draft needs one row, and which one is known only after verification: the rows of a decode's
    last chunk stay in llama.cpp's buffer (valid until the target's next decode; the assistant
    decodes in its own context) and only the row asked for is copied. Rows of earlier chunks
    (a verify pass longer than n_batch) are copied before the next chunk overwrites them.
    """

    def __init__(self, target: LlamaModel) -> None:
        self._target = target
        model, self._ctx = target.handles
        self._bindings = nextn_bindings()
        self.n_embd = int(load_llama_cpp().llama_model_n_embd_out(model))
        self._shape = (self.n_embd,)
        self._views = BufferViews()
        self._rows: Dict[int, np.ndarray] = {}  # copied rows, by position
        self._in_buffer: Dict[int, int] = {}  # position -> row index in llama.cpp's output buffer
        self._decoding = False  # a chunk came that was not its decode's last
        self.enabled = False

    def enable(self, enabled: bool) -> None:
        """Export from the next decode on (or stop). ``masked``: only rows asked for logits;
        llama.cpp's own driver asks for every row, which runs the last layer on every prompt token."""
        if enabled == self.enabled:
            return
        self._bindings.llama_set_embeddings_nextn(self._ctx, enabled, True)
        if enabled:
            self._target.add_chunk_listener(self._keep)
        else:
            self._target.remove_chunk_listener(self._keep)
        self._rows, self._in_buffer, self._decoding = {}, {}, False
        self.enabled = enabled

    def row(self, position: int) -> Optional[np.ndarray]:
        """The hidden row at ``position`` (< the target's n_past), None if it was not exported."""
        if not 0 <= position < self._target.n_past:
            return None
        row = self._rows.get(position)
        if row is None and position in self._in_buffer:
            row = self._copy(self._in_buffer.pop(position))
            if row is not None:
                self._rows[position] = row
        return row

    def _keep(self, base: int, rows_here: List[int], last_chunk: bool) -> None:
        """After each chunk of a target decode: forget what the previous decode left; copy now
        the rows of a chunk that the next chunk will overwrite."""
        if self._decoding:  # the next chunk of one decode: keep the rows before it
            self._rows = {p: r for p, r in self._rows.items() if p < base}
        else:
            self._rows = {}
        self._in_buffer = {}
        self._decoding = not last_chunk
        for i in rows_here:
            if last_chunk:
                self._in_buffer[base + i] = i
            else:
                row = self._copy(i)
                if row is not None:
                    self._rows[base + i] = row

    def _copy(self, index: int) -> Optional[np.ndarray]:
        pointer = self._bindings.llama_get_embeddings_nextn_ith(self._ctx, index)
        if not pointer:  # NULL: llama.cpp did not export this row (it logs why)
            return None
        return self._views.get(pointer, self._shape).copy()

    def close(self) -> None:
        self._target.remove_chunk_listener(self._keep)


class GemmaAssistant(LinkedHead):
    """The assistant model and its MTP context over the target's (:class:`~.linked_head.LinkedHead`:
    the load, the linked context and the one-row step); one draft row per decode."""

    mismatch = AssistantMismatchError
    what = "the assistant"
    shares_positions = "it attends to the target's KV cache"

    def __init__(self, config: ModelConfig, target: LlamaModel) -> None:
        if target.architecture not in TARGET_ARCHITECTURES:
            raise AssistantMismatchError(
                f"{config.resolved_path} is a Gemma 4 assistant: it drafts only for a Gemma 4 target, "
                f"and {target.path} is {target.architecture or 'of unknown architecture'}")
        super().__init__(config, target, ctx_type=load_llama_cpp().LLAMA_CONTEXT_TYPE_MTP)

    def _check_pair(self, target: LlamaModel, target_model: object) -> None:
        """Refuse what llama.cpp would not check before it runs the graph (it would read the wrong
        rows, or assert)."""
        llama_cpp = self._llama_cpp
        self.n_embd = int(llama_cpp.llama_model_n_embd_inp(self._model))  # the hidden rows it reads
        target_embd = int(llama_cpp.llama_model_n_embd_out(target_model))
        if self.n_embd != target_embd:
            raise AssistantMismatchError(
                f"the assistant {self.path} reads hidden states of size {self.n_embd}, and the target "
                f"{target.path} has {target_embd}: it is the assistant of another Gemma 4 model")
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model)))
        if self.n_vocab != target.n_vocab:
            raise AssistantMismatchError(
                f"the assistant {self.path} has a vocabulary of {self.n_vocab} tokens and the target "
                f"{target.path} {target.n_vocab}: its drafts would be other tokens")

    def _after_context(self, target: LlamaModel, target_ctx: object) -> None:
        bindings = nextn_bindings()
        if bindings.llama_get_ctx_other(self._ctx) != target_ctx:
            raise AssistantMismatchError(f"llama.cpp did not link {self.path} to the target's context")
        bindings.llama_set_embeddings_nextn(self._ctx, True, True)  # its next hidden row

    def model_info(self) -> dict:
        """What the node's ``models`` status shows of the assistant (no n_ctx: it has no cache)."""
        info = self.base_info()
        info.update(architecture=ASSISTANT_ARCHITECTURE, n_embd_target=self.n_embd)
        return info


class MtpDrafter(Drafter):
    """Drafts with a Gemma 4 MTP assistant. Implements :class:`~gemma_spec_ros.engine.drafters.base.Drafter`.

    Greedy drafting stops when the assistant's top probability falls below ``spec.p_min`` (as
    llama.cpp's draft-mtp does); for ``rejection`` verification of a sampled request the drafts are
    sampled from the request's sampler over the assistant's logits, q returned with them.
    """

    name = "mtp"
    #: a probe costs one assistant step: nothing to catch up on (the assistant reads the target's
    #: cache), unlike a standalone draft model
    cheap_to_probe = True

    def __init__(self, config: ModelConfig, target: LlamaModel) -> None:
        self.target = target
        self.hidden = TargetHiddenRows(target)
        try:
            self.assistant = GemmaAssistant(config, target)
        except BaseException:
            self.hidden.close()
            raise
        self._sampler: Optional[Sampler] = None
        self._rng: Optional[np.random.Generator] = None

    def begin(self, prompt_tokens: Sequence[int], sampling: Optional[SamplingParams] = None,
              rng: Optional[np.random.Generator] = None) -> None:
        self._sampler = None if sampling is None or sampling.greedy else Sampler(sampling)
        self._rng = rng

    def propose(self, context: Sequence[int], max_tokens: int, spec: SpecConfig = SpecConfig()) -> Draft:
        """Up to ``max_tokens`` tokens after ``context`` = the target's cache + the pending token.
        Nothing when the target's last pass exported no hidden row for the last cached position
        (the mode just switched to mtp: the next pass exports it)."""
        position = self.target.n_past
        hidden = self.hidden.row(position - 1)
        if hidden is None or len(context) != position + 1 or max_tokens <= 0:
            return Draft()
        token = context[-1]
        tokens: List[int] = []
        probs: List[np.ndarray] = []
        while len(tokens) < max_tokens:
            logits, hidden = self.assistant.step(token, position, hidden)
            token = next_draft_token(logits, self._sampler, self._rng, spec.p_min, probs)
            if token is None:
                break
            tokens.append(token)
            if self.target.is_eog(token):
                break
        if len(tokens) < spec.draft_min or not tokens:
            return Draft()
        return Draft(tuple(tokens), tuple(probs) if self._sampler is not None else None, self.name)

    def before_target_pass(self, drafting: bool) -> None:
        """The target exports its hidden rows only for passes whose step may draft with the
        assistant (off, lookup and draft pay nothing for MTP)."""
        self.hidden.enable(drafting)

    def warm_up(self, filler: Sequence[int], max_rows: int, passes: int) -> None:
        """Run assistant steps untimed over the filler in the target's cache, so that the first
        measured draft costs are steady-state ones; leaves the target's cache empty."""
        target = self.target
        target.clear()
        target.decode(list(filler), [])
        zeros = np.zeros(self.assistant.n_embd, dtype=np.float32)
        for _ in range(passes):
            self.assistant.step(filler[-1], len(filler), zeros)
        target.clear()

    def model_info(self) -> Optional[dict]:
        return {**self.assistant.model_info(), "drafter": self.name}

    def close(self) -> None:
        self.hidden.close()
        self.assistant.close()


def build(config: EngineConfig, target: LlamaModel, n_seq: int) -> "MtpDrafter":
    """The kind's builder (``engine/drafter_kinds.py``): the assistant of ``draft.model_path``."""
    return MtpDrafter(config.draft, target)
