"""A drafter model whose llama.cpp context is linked to the target's (``ctx_other``).

Gemma 4's MTP assistant (engine/drafters/mtp.py) and an EAGLE-3 head (engine/drafters/eagle3.py) are such models:
llama.cpp builds their graph over the target's context (the assistant reads the target's KV cache,
an EAGLE-3 head borrows the target's token embedding and, without its own, its output head), so
their context must have the target's ``n_ctx`` and must be created after the target's and freed
before it. Both are driven one draft row at a time: a token at a position, with an embedding row
(the target's or the head's own hidden state), gives logits and the next hidden row.

What both need lives here: loading the model, the linked context, and the one-row step.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional, Tuple, Type

import numpy as np

from ..llama.model import BufferViews, LlamaModel, address_result
from ..llama.process import init_backend, load_llama_cpp
from ..errors import EngineError, ModelLoadError
from ..config import ModelConfig


class LinkedHead:
    """A model loaded beside the target, with a context linked to the target's and a one-row
    token + embedding-row batch. Subclasses check the pair (:meth:`_check_pair`) between the load
    and the context, and may add batches of their own (:meth:`_after_context`).

    ``what`` names the model in messages ("the assistant"); ``mismatch`` is the error raised when
    the model cannot draft for this target.
    """

    #: the error class of "this model cannot draft for this target"
    mismatch: Type[EngineError] = EngineError
    #: how messages name the model
    what = "the drafter model"
    #: why its n_ctx must be the target's (a clause for the refusal's message)
    shares_positions = "its context is positioned like the target's"

    def __init__(self, config: ModelConfig, target: LlamaModel, *, ctx_type: int,
                 n_batch: int = 1) -> None:
        init_backend()
        llama_cpp = self._llama_cpp = load_llama_cpp()
        self.config, self.path = config, config.resolved_path
        self._model = self._ctx = self._batch = None
        require_target_n_ctx(config, target, self.what, self.shares_positions, self.mismatch)
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 999 if config.n_gpu_layers < 0 else config.n_gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(self.path.encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {self.what} {self.path} (corrupt file, "
                                 f"or not enough memory for n_gpu_layers={config.n_gpu_layers})")
        try:
            target_model, target_ctx = target.handles
            self._check_pair(target, target_model)
            self._ctx = linked_context(self._model, config, target, ctx_type, n_batch)
            if not self._ctx:
                raise ModelLoadError(f"llama.cpp could not create the context of {self.path} over "
                                     f"the target's (n_ctx={target.n_ctx}; not enough memory?)")
            self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
            self._mem = llama_cpp.llama_get_memory(self._ctx)
            self._views = BufferViews()
            self._init_step_batch()
            self._after_context(target, target_ctx)
        except BaseException:
            self.close()
            raise

    # -- what subclasses provide ------------------------------------------------------------------
    def _check_pair(self, target: LlamaModel, target_model: object) -> None:
        """Refuse (``self.mismatch``) what llama.cpp would not check before it runs the graph; set
        ``n_embd`` (the width of the embedding rows a step takes) and ``n_vocab``."""
        raise NotImplementedError

    def _after_context(self, target: LlamaModel, target_ctx: object) -> None:
        """Set up what the model needs beyond the one-row step (its export, more batches)."""

    # -- the one-row step -------------------------------------------------------------------------
    def _init_step_batch(self) -> None:
        """A one-row batch that carries a token and an embedding row. llama_batch_init with embd
        != 0 would allocate no token array: this one has its token array and points embd at a
        buffer we own (reset before llama_batch_free, which would free it otherwise)."""
        self._batch = self._llama_cpp.llama_batch_init(1, 0, 1)
        self._row_in = np.zeros(self.n_embd, dtype=np.float32)
        self._batch.embd = self._row_in.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        self._batch.n_tokens = 1
        self._batch.n_seq_id[0] = 1
        self._batch.seq_id[0][0] = 0
        self._batch.logits[0] = 1
        self._step_token = np.ctypeslib.as_array(self._batch.token, shape=(1,))
        self._step_pos = np.ctypeslib.as_array(self._batch.pos, shape=(1,))
        self._logits_shape, self._row_shape = (self.n_vocab,), (self.n_embd,)
        self._llama_decode = self._llama_cpp.llama_decode
        self._logits_at = address_result(self._llama_cpp.llama_get_logits_ith)
        self._next_row_at = address_result(nextn_bindings().llama_get_embeddings_nextn_ith)
        self._last_outputs: Tuple[Optional[int], Optional[int], Tuple[np.ndarray, np.ndarray]] = (
            None, None, (np.empty(0, np.float32), np.empty(0, np.float32)))

    def step(self, token: int, position: int, row: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(logits, next hidden row) after feeding ``token`` at ``position`` with the embedding
        ``row``; both are views that the next step overwrites.

        A draft step of a small head costs ~0.1 ms in llama.cpp, so what Python adds around it
        weighs: the batch's arrays are bound once, and the outputs are found by address
        (:func:`~..llama.model.address_result`, :meth:`BufferViews.at`)."""
        self._row_in[:] = row
        self._step_token[0] = token
        self._step_pos[0] = position
        rc = self._llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise EngineError(f"{self.what}'s llama_decode failed with code {rc} at position {position}")
        return self._outputs(0)

    def _outputs(self, index: int) -> Tuple[np.ndarray, np.ndarray]:
        """(logits, next hidden row) of output row ``index`` of the last decode: views of
        llama.cpp's buffers, cached by address (the last pair of addresses first: llama.cpp moves
        its output buffers only when it reallocates them)."""
        ctx = self._ctx
        logits_at, hidden_at = self._logits_at(ctx, index), self._next_row_at(ctx, index)
        last = self._last_outputs
        if logits_at == last[0] and hidden_at == last[1]:
            return last[2]
        if not hidden_at:
            raise EngineError(f"{self.what} {self.path} exported no hidden row")
        views = (self._views.at(logits_at, self._logits_shape), self._views.at(hidden_at, self._row_shape))
        self._last_outputs = (logits_at, hidden_at, views)
        return views

    def base_info(self) -> dict:
        """The model_info fields every linked model has."""
        n_params = int(self._llama_cpp.llama_model_n_params(self._model))
        return dict(path=self.path, size_bytes=os.path.getsize(self.path), n_params=n_params,
                    n_gpu_layers=self.config.n_gpu_layers, n_vocab=self.n_vocab)

    def _free_extras(self) -> None:
        """Free the batches and contexts of subclasses (called by :meth:`close` before the
        context)."""

    def close(self) -> None:
        """Free the context (before the target's: it reads the target's model and context), then
        the model; idempotent."""
        llama_cpp = self._llama_cpp
        self._free_extras()
        if self._batch is not None:
            self._batch.embd = ctypes.POINTER(ctypes.c_float)()  # ours: llama_batch_free must skip it
            llama_cpp.llama_batch_free(self._batch)
        for handle, free in ((self._ctx, llama_cpp.llama_free), (self._model, llama_cpp.llama_model_free)):
            if handle:
                free(handle)
        self._batch = self._ctx = self._model = None


def pointer_field(struct: ctypes.Structure, name: str) -> ctypes.c_void_p:
    """A ``c_void_p`` over the pointer field ``name`` of ``struct``: setting its ``value`` (an
    address) costs ~0.1 us, an assignment of a ctypes pointer made from a numpy array ~10 us.
    The struct must outlive it, and what it points at must outlive each use."""
    offset = getattr(type(struct), name).offset
    return ctypes.c_void_p.from_address(ctypes.addressof(struct) + offset)


def nextn_bindings():  # noqa: ANN201  the llama_cpp.llama_cpp_ext module
    """llama-cpp-python's bindings of llama.cpp's staging API (``llama_set_embeddings_nextn``,
    ``llama_get_embeddings_nextn[_ith]``, ``llama_get_ctx_other``). Upstream marks them
    experimental, so they are imported only where a linked model needs them, with a reason when
    they are missing."""
    try:
        from llama_cpp import llama_cpp_ext  # noqa: WPS433
    except ImportError as exc:
        raise EngineError("this llama-cpp-python has no llama_cpp_ext module: drafting with a model "
                          "linked to the target (MTP, EAGLE-3) needs llama-cpp-python 0.3.36 or "
                          "later") from exc
    return llama_cpp_ext


def require_target_n_ctx(config: ModelConfig, target: LlamaModel, what: str, why: str,
                         error: Type[EngineError]) -> None:
    """Refuse a linked model configured for another context length than the target's."""
    if config.n_ctx not in (target.config.n_ctx, target.n_ctx):
        raise error(f"{what}'s n_ctx ({config.n_ctx}) must be the target's ({target.n_ctx}): {why}; "
                    "set draft.n_ctx to 0 (= the target's)")


def linked_context(model: object, config: ModelConfig, target: LlamaModel, ctx_type: int,
                   n_batch: int, n_ctx: int = 0) -> object:
    """A context of ``model`` over the target's (``ctx_other``), with ``n_ctx`` cells (0: the
    target's n_ctx) and ``n_batch`` rows a decode; NULL if llama.cpp could not create it."""
    llama_cpp = load_llama_cpp()
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_ctx or target.n_ctx
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_seq_max = 1
    threads = config.n_threads or (os.cpu_count() or 1)
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn
                               else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cparams.ctx_type = ctx_type
    cparams.ctx_other = target.handles[1]
    cparams.n_rs_seq = 0
    return llama_cpp.llama_init_from_model(model, cparams)
