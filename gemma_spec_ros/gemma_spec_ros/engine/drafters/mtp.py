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

import ctypes
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..llama.model import BufferViews, LlamaModel
from ..llama.process import init_backend, load_llama_cpp
from .draft_model import DraftModelDrafter, next_draft_token
from .eagle3 import Eagle3Drafter, is_eagle3_head
from ..llama.gguf import GGUFHeaderError, architecture
from ..sampling import Sampler
from .base import Draft, Drafter
from ..errors import EngineError, ModelLoadError
from ..config import ModelConfig, SamplingParams, SpecConfig

ASSISTANT_ARCHITECTURE = "gemma4-assistant"
#: Targets whose graph exports the hidden row an assistant reads and whose cache it can share.
TARGET_ARCHITECTURES = ("gemma4",)


class AssistantMismatchError(EngineError):
    """The assistant cannot draft for this target (architecture, hidden size, vocabulary, n_ctx)."""


def nextn_bindings():  # noqa: ANN201  the llama_cpp.llama_cpp_ext module
    """llama-cpp-python's bindings of llama.cpp's staging API (``llama_set_embeddings_nextn``,
    ``llama_get_embeddings_nextn_ith``, ``llama_get_ctx_other``). Upstream marks them experimental,
    so they are imported only where MTP drafting needs them, with a reason when they are missing."""
    try:
        from llama_cpp import llama_cpp_ext  # noqa: WPS433
    except ImportError as exc:
        raise EngineError("this llama-cpp-python has no llama_cpp_ext module: MTP drafting needs "
                          "llama-cpp-python 0.3.36 or later") from exc
    return llama_cpp_ext


def is_assistant(path: str) -> bool:
    """Whether the GGUF at ``path`` is a Gemma 4 MTP assistant (by its ``general.architecture``).
    A file that cannot be read or is no GGUF is not one: the standalone draft model's loader then
    reports what is wrong with it."""
    try:
        return architecture(path) == ASSISTANT_ARCHITECTURE
    except (OSError, GGUFHeaderError):
        return False


def model_drafter(config: ModelConfig, target: LlamaModel) -> Drafter:
    """The drafter ``draft.model_path`` names, by the GGUF's architecture: an :class:`MtpDrafter`
    for a Gemma 4 assistant, an :class:`~gemma_spec_ros.engine.drafters.eagle3.Eagle3Drafter` for
    an EAGLE-3 head, else a standalone draft model
    (:class:`~gemma_spec_ros.engine.drafters.draft_model.DraftModelDrafter`)."""
    path = config.resolved_path
    if is_assistant(path):
        return MtpDrafter(config, target)
    if is_eagle3_head(path):
        return Eagle3Drafter(config, target)
    return DraftModelDrafter(config, target)


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
        self._target.after_chunk = self._keep if enabled else None
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
        if self._target.after_chunk == self._keep:
            self._target.after_chunk = None


class GemmaAssistant:
    """The assistant model and its MTP context over the target's; one draft row per decode."""

    def __init__(self, config: ModelConfig, target: LlamaModel) -> None:
        init_backend()
        llama_cpp = self._llama_cpp = load_llama_cpp()
        self.config, self.path = config, config.resolved_path
        self._model = self._ctx = self._batch = None
        target_model, target_ctx = target.handles
        if target.architecture not in TARGET_ARCHITECTURES:
            raise AssistantMismatchError(
                f"{self.path} is a Gemma 4 assistant: it drafts only for a Gemma 4 target, and "
                f"{target.path} is {target.architecture or 'of unknown architecture'}")
        if config.n_ctx not in (target.config.n_ctx, target.n_ctx):
            raise AssistantMismatchError(
                f"the assistant attends to the target's KV cache: its n_ctx ({config.n_ctx}) must be "
                f"the target's ({target.n_ctx}); set draft.n_ctx to 0 (= the target's)")
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 999 if config.n_gpu_layers < 0 else config.n_gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(self.path.encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load the assistant {self.path} (corrupt file, "
                                 f"or not enough memory for n_gpu_layers={config.n_gpu_layers})")
        try:
            self._check_pair(target, target_model)
            self._create_context(target, target_ctx)
        except BaseException:
            self.close()
            raise

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

    def _create_context(self, target: LlamaModel, target_ctx: object) -> None:
        llama_cpp, config = self._llama_cpp, self.config
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = target.n_ctx
        cparams.n_batch = cparams.n_ubatch = 1  # one draft row per decode
        cparams.n_seq_max = 1
        threads = config.n_threads or (os.cpu_count() or 1)
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        cparams.ctx_other = target_ctx
        cparams.n_rs_seq = 0
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise ModelLoadError(f"llama.cpp could not create the MTP context of {self.path} over "
                                 f"the target's (n_ctx={target.n_ctx}; not enough memory?)")
        bindings = nextn_bindings()
        if bindings.llama_get_ctx_other(self._ctx) != target_ctx:
            raise AssistantMismatchError(f"llama.cpp did not link {self.path} to the target's context")
        bindings.llama_set_embeddings_nextn(self._ctx, True, True)  # its next hidden row
        self._next_hidden = bindings.llama_get_embeddings_nextn_ith
        self._views = BufferViews()
        self._logits_shape, self._hidden_shape = (self.n_vocab,), (self.n_embd,)
        # A one-row batch that carries a token and a hidden row. llama_batch_init with embd != 0
        # would allocate no token array; this one has its token array and points embd at a
        # buffer we own (reset before llama_batch_free, which would free it otherwise).
        self._batch = llama_cpp.llama_batch_init(1, 0, 1)
        self._hidden_in = np.zeros(self.n_embd, dtype=np.float32)
        self._batch.embd = self._hidden_in.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        self._batch.n_tokens = 1
        self._batch.n_seq_id[0] = 1
        self._batch.seq_id[0][0] = 0
        self._batch.logits[0] = 1

    def step(self, token: int, position: int, hidden: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(logits, next hidden row) after feeding ``token`` at ``position`` with ``hidden``; both
        are views that the next step overwrites."""
        llama_cpp, batch = self._llama_cpp, self._batch
        self._hidden_in[:] = hidden
        batch.token[0] = token
        batch.pos[0] = position
        rc = llama_cpp.llama_decode(self._ctx, batch)
        if rc != 0:
            raise EngineError(f"the assistant's llama_decode failed with code {rc} at position {position}")
        # views cached by address (BufferViews): np.ctypeslib.as_array costs ~5 us a call
        logits = self._views.get(llama_cpp.llama_get_logits_ith(self._ctx, 0), self._logits_shape)
        pointer = self._next_hidden(self._ctx, 0)
        if not pointer:
            raise EngineError(f"the assistant {self.path} exported no hidden row")
        return logits, self._views.get(pointer, self._hidden_shape)

    def model_info(self) -> dict:
        """What the node's ``models`` status shows of the assistant (no n_ctx: it has no cache)."""
        n_params = int(self._llama_cpp.llama_model_n_params(self._model))
        return dict(path=self.path, size_bytes=os.path.getsize(self.path), n_params=n_params,
                    architecture=ASSISTANT_ARCHITECTURE, n_gpu_layers=self.config.n_gpu_layers,
                    n_vocab=self.n_vocab, n_embd_target=self.n_embd)

    def close(self) -> None:
        """Free the context (before the target's: it reads the target's cache), then the model."""
        llama_cpp = self._llama_cpp
        if self._batch is not None:
            self._batch.embd = ctypes.POINTER(ctypes.c_float)()  # ours: llama_batch_free must skip it
            llama_cpp.llama_batch_free(self._batch)
        for handle, free in ((self._ctx, llama_cpp.llama_free), (self._model, llama_cpp.llama_model_free)):
            if handle:
                free(handle)
        self._batch = self._ctx = self._model = None


class MtpDrafter:
    """Drafts with a Gemma 4 MTP assistant. Implements :class:`~gemma_spec_ros.engine.drafters.base.Drafter`.

    Greedy drafting stops when the assistant's top probability falls below ``spec.p_min`` (as
    llama.cpp's draft-mtp does); for ``rejection`` verification of a sampled request the drafts are
    sampled from the request's sampler over the assistant's logits, q returned with them.
    """

    name = "mtp"
    #: a probe costs one assistant step: nothing to catch up on (the assistant reads the target's
    #: cache), unlike a standalone draft model
    cheap_to_probe = True
    cuts_drafts = False  # each draft token is an assistant decode
    warnings: List[str] = []  # nothing is recovered from at load: a mismatch refuses the assistant

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

    def end(self, tokens: Sequence[int]) -> None:
        """Nothing to learn, nothing to roll back: the assistant keeps no state between drafts."""

    def take_fault(self) -> Optional[str]:
        return None

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
