"""One thin class over llama-cpp-python's low-level API (0.3.36): what a draft-verify loop needs.

- load a GGUF into a model + context (never ``logits_all``: logits exist only for requested rows),
- tokenize, render tokens as bytes (a prompt in the chat template: :mod:`.chat_prompt`),
- decode a batch asking logits only for the rows that need them, and time it,
- roll the KV cache back to a position (checking llama.cpp's answer),
- report the vocabulary's identity (for the draft/target compatibility check).

One sequence (id 0) by default; with ``n_seq`` > 1 the context holds that many sequences in one
unified KV cache, each with its own tokens and rollback (:class:`SequenceView`), and
:meth:`LlamaModel.decode_parts` decodes rows of several sequences in one pass (several requests
served at once: engine/slots.py). Not thread-safe for decoding; tokenization is read-only on the
vocabulary and may run from another thread.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .process import init_backend, load_llama_cpp, exact_output_expected
from ..errors import KVCacheError, ModelLoadError
from ..config import ModelConfig
from .vocab import VocabIdentity, token_texts_digest

T = TypeVar("T")
#: A listener of decoded chunks (:meth:`LlamaModel.add_chunk_listener`): (position of the chunk's
#: first token, its rows asked for logits, whether it is the decode's last chunk).
ChunkListener = Callable[[int, List[int], bool], None]


class WindowLostError(KVCacheError):
    """A rollback went back past what a window-sized sliding cache still holds; the cache was
    cleared (see LlamaModel)."""


class DecodeInterrupted(Exception):
    """``LlamaModel.decode`` stopped between two chunks because its ``stop`` callback said so."""


#: Text bytes above which :meth:`LlamaModel.tokenize` runs on a thread with a deep stack, and
#: that stack: std::regex takes a few hundred bytes of stack per character of a run (8 MiB held
#: 20,000), so 1 GiB of address space (only the pages touched are memory) holds ~2 MB of text.
DEEP_STACK_FROM = 8 << 10
DEEP_STACK_BYTES = 1 << 30
_STACK_SIZE_LOCK = threading.Lock()


def with_deep_stack(work: Callable[[], T]) -> T:
    """``work()`` run on a new thread with a :data:`DEEP_STACK_BYTES` stack; its result or its
    exception (the caller waits: this is for work whose stack depth grows with its input)."""
    box: List[Any] = []

    def run() -> None:
        try:
            box.append((True, work()))
        except BaseException as exc:  # noqa: BLE001  handed to the caller
            box.append((False, exc))

    with _STACK_SIZE_LOCK:  # the stack size applies to the threads made while it is set
        previous = threading.stack_size(DEEP_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="gemma_spec_deep_stack", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


class BufferViews:
    """Numpy views of float buffers that llama.cpp owns, cached by (address, shape).

    ``np.ctypeslib.as_array`` builds a ctypes array type at every call (~5 us); a decode step of a
    small model costs ~100 us, so a verify pass that made a view per logits row spent a fifth of
    its time there. llama.cpp moves these buffers only when it reallocates them (a batch that asks
    for more output rows than any before): a new address is then a new entry.
    """

    def __init__(self, limit: int = 16) -> None:
        self._views: dict = {}
        self._limit = limit

    def get(self, pointer: "ctypes._Pointer", shape: Tuple[int, ...]) -> np.ndarray:
        """A view of ``shape`` float32s at ``pointer`` (non-NULL), valid while llama.cpp keeps the
        buffer; whoever holds it past the next decode must copy it."""
        key = (ctypes.cast(pointer, ctypes.c_void_p).value, shape)
        view = self._views.get(key)
        if view is None:
            if not key[0]:
                raise ValueError("a NULL buffer from llama.cpp")
            if len(self._views) >= self._limit:
                self._views.clear()
            view = self._views[key] = np.ctypeslib.as_array(pointer, shape=shape)
        return view

    def at(self, address: Optional[int], shape: Tuple[int, ...]) -> np.ndarray:
        """:meth:`get` by the buffer's address (an int, None for NULL), as a function bound with
        :func:`address_result` returns it: no ``ctypes.cast`` per call (~3 us), which weighs
        beside a ~0.1 ms step of a small head."""
        view = self._views.get((address, shape))
        if view is None:
            if not address:
                raise ValueError("a NULL buffer from llama.cpp")
            view = self.get(ctypes.cast(address, ctypes.POINTER(ctypes.c_float)), shape)
        return view


def address_result(function: Callable) -> Callable:
    """The C function behind a ctypes binding that returns a ``float *``, called so that it
    returns the address as a Python int (None for NULL): a view is then found by that int
    (:meth:`BufferViews.at`) without a ``ctypes.cast`` of the pointer (~3 us a call)."""
    address = ctypes.cast(function, ctypes.c_void_p).value
    return ctypes.CFUNCTYPE(ctypes.c_void_p, *function.argtypes)(address)


class LlamaModel:
    """A loaded GGUF model with one context and ``n_seq`` sequences (1 by default).

    ``n_past`` is the number of positions of sequence 0 in the KV cache; ``kv_tokens`` the tokens
    they hold (``past(seq)`` / ``tokens_of(seq)`` for the others). ``n_ctx`` is what one sequence may
    hold: with ``n_seq`` > 1 the context is made ``n_seq`` times as large, so that each sequence
    keeps the whole ``n_ctx`` whatever the others hold (a unified cache: llama.cpp's ``kv_unified``,
    with which rows of several sequences, each with its own row count, decode in one pass).

    Sliding-window attention (Gemma 3: 5 of 6 layers see the last 512 positions). With
    ``full_swa_cache`` those layers keep every position, so the sequence can be rolled back
    anywhere. Without it (llama.cpp's own default) they keep a window plus one batch (1,024 cells
    for Gemma 3 with n_batch 512) and overwrite positions that fell out of the window when the
    cache wraps: every pass attends over at most that many cells (a long prompt's passes cost
    less) and the cache takes less memory, but a position that fell out is gone. Rolling back
    the tokens of the last :meth:`decode` is always safe (llama.cpp overwrites only positions the
    first of them no longer sees); a deeper rollback is checked: :meth:`reuse_prefix` then starts
    over, :meth:`rollback` raises KVCacheError. A drafter that rolls back several one-token
    passes at once (the draft model) keeps the full cache.

    The window cache is a ring: a rollback moves llama.cpp's write head back to the lowest freed
    cell, so after rejected tokens (or a trimmed prompt) that crossed the ring's end, the next token
    lands in another cell than plain decoding would put it in. Attention sums the cells in cell
    order, so the same positions give other floats (up to ~0.05 of a logit with F16 weights,
    measured). ``full_swa_cache=None`` therefore decides by what is promised: the full cache (cell =
    position, whatever was rolled back) where output must be bit-identical, i.e. under the exact
    build or with F16/F32/BF16 weights (:func:`exact_output_expected`); the window cache otherwise
    (quantized weights on the fast build, where logits already depend on batch shapes).

    Several sequences: even the full cache loses positions. llama.cpp's sliding-window cache takes
    a cell held by one sequence whose position that sequence's window has passed as a free cell
    (``find_slot``, full size or not), and then drops that sequence's positions up to it, so that
    each sequence's positions stay contiguous. A sequence longer than the window (a chat turn with
    tools) thus loses its oldest sliding-window cells to another sequence's rows while its
    full-attention cells and its ``kv_tokens`` stay. Going on from its end is safe (those
    positions are outside its window); keeping a shorter prefix is not: the next request's
    tokens would attend without them (its BOS first) and write another model's text, silently,
    in every request the slot serves afterwards. So every rollback checks the window whatever
    the cache (:meth:`_window_intact`, one llama.cpp call), prompt reuse then starts over, and a
    prefix shared from another sequence (:meth:`share_prefix`) is kept only with its window.
    """

    #: the sequence the one-sequence API (decode, rollback, kv_tokens, ...) speaks of by default
    seq = 0

    #: Called after each decoded chunk, in the order added (:meth:`add_chunk_listener`), with
    #: (position of its first token, its rows asked for logits, whether it is the decode's last
    #: chunk), before the next chunk overwrites llama.cpp's outputs: a drafter that reads rows the
    #: target exports (MTP's hidden rows, EAGLE-3's features) copies them there, only while it may
    #: draft. Empty for the other drafters.
    _chunk_listeners: Tuple[ChunkListener, ...] = ()
    #: llama.cpp's eval callback of the context (``cb_eval``; a ctypes
    #: ``llama_cpp.ggml_backend_sched_eval_callback``), kept alive with it; None = none. Set only at
    #: creation: an EAGLE-3 head's feature capture for a gemma3 target (engine/llama/features.py).
    eval_callback: Optional[Any] = None

    def __init__(self, config: ModelConfig, *, max_batch_rows: int = 65,
                 full_swa_cache: Optional[bool] = True, n_seq: int = 1,
                 eval_callback: Optional[Any] = None) -> None:
        if n_seq < 1:
            raise ValueError(f"n_seq={n_seq}: a context holds at least one sequence")
        init_backend()
        llama_cpp = load_llama_cpp()
        self._llama_cpp = llama_cpp
        self._chunk_listeners = ()
        self.config = config
        self.path = config.resolved_path
        self._model = None
        self._ctx = None
        self._batch = None
        if not os.path.isfile(self.path):
            raise ModelLoadError(f"model file not found: {self.path}")
        with open(self.path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ModelLoadError(f"not a GGUF file (bad magic): {self.path}")
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 999 if config.n_gpu_layers < 0 else config.n_gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(self.path.encode(), mparams)
        if not self._model:
            raise ModelLoadError(
                f"llama.cpp could not load {self.path} (corrupt file, unsupported architecture, "
                f"or not enough memory for n_gpu_layers={config.n_gpu_layers})")
        try:
            if full_swa_cache is None:
                full_swa_cache = exact_output_expected(int(llama_cpp.llama_model_ftype(self._model)))
            self.full_swa_cache = full_swa_cache
            self._vocab = llama_cpp.llama_model_get_vocab(self._model)
            self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
            cparams = llama_cpp.llama_context_default_params()
            cparams.n_ctx = config.n_ctx * n_seq
            cparams.n_batch = config.n_batch
            cparams.n_ubatch = config.n_batch
            cparams.n_seq_max = n_seq
            # one cache for all sequences: any mix of rows per sequence decodes in one ubatch (split
            # per sequence streams, a batch must give each sequence as many rows as the others)
            cparams.kv_unified = n_seq > 1
            threads = config.n_threads or (os.cpu_count() or 1)
            cparams.n_threads = threads
            cparams.n_threads_batch = threads
            cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn
                                       else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            cparams.swa_full = full_swa_cache  # see the class docstring
            if eval_callback is not None:  # the EAGLE-3 feature capture (engine/llama/features.py)
                cparams.cb_eval, self.eval_callback = eval_callback, eval_callback
            self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
            if not self._ctx:
                raise ModelLoadError(
                    f"llama.cpp could not create a context for {self.path} with n_ctx={config.n_ctx} "
                    f"(not enough memory?)")
            self.n_seq = n_seq
            self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx)) // n_seq
            self._mem = llama_cpp.llama_get_memory(self._ctx)
            # llama.cpp may clamp n_batch (to n_ctx) and pad n_ctx: decode in chunks of what it took,
            # since a larger batch is a fatal assertion inside llama_decode, not an error code.
            self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
            self.max_batch_rows = max(1, min(max_batch_rows, self.n_batch))
            self._batch_capacity = self.n_batch
            self._batch = llama_cpp.llama_batch_init(self._batch_capacity, 0, 1)
            self._init_batch_views()
            self.bos = int(llama_cpp.llama_vocab_bos(self._vocab))
            self.eos = int(llama_cpp.llama_vocab_eos(self._vocab))
            self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
            self.add_eos = bool(llama_cpp.llama_vocab_get_add_eos(self._vocab))
            self.vocab_type = int(llama_cpp.llama_vocab_type(self._vocab))
            # positions a sliding-window layer sees (0: none): what a rollback must leave in place,
            # with the full cache too (see the class docstring, "Several sequences")
            self.n_swa = int(llama_cpp.llama_model_n_swa(self._model))
        except Exception:
            self.close()
            raise
        self._seq_tokens: List[List[int]] = [[] for _ in range(n_seq)]
        self._logits_views = BufferViews()
        self._piece_buf = ctypes.create_string_buffer(256)
        self._vocab_identity: Optional[VocabIdentity] = None
        self._eog_cache: dict = {}

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        llama_cpp = self._llama_cpp
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # -- vocabulary -----------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> List[int]:
        """Tokens of ``text``; BOS added when the model wants it and ``add_special``.

        A long text is tokenized on a thread with a deep stack (:func:`with_deep_stack`): the
        pre-tokenizers llama.cpp runs with ``std::regex`` recurse once per character of a run
        (``default``, ``falcon``, ``starcoder``...: 40,000 ``<`` in a row overflowed a thread's 8 MiB
        stack and ended the process); Gemma's SentencePiece vocabulary runs no regex."""
        data = text.encode("utf-8")
        if len(data) > DEEP_STACK_FROM:
            return with_deep_stack(lambda: self._tokenize(data, add_special, parse_special))
        return self._tokenize(data, add_special, parse_special)

    def _tokenize(self, data: bytes, add_special: bool, parse_special: bool) -> List[int]:
        llama_cpp = self._llama_cpp
        capacity = len(data) + 8
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special,
                                         parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (special tokens render as nothing)."""
        llama_cpp = self._llama_cpp
        n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece_buf, len(self._piece_buf), 0, False)
        if n < 0:
            self._piece_buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece_buf, -n, 0, False)
        return self._piece_buf.raw[:n]

    def token_text(self, token: int) -> bytes:
        text = self._llama_cpp.llama_vocab_get_text(self._vocab, token)
        return text or b""

    def is_eog(self, token: int) -> bool:
        cached = self._eog_cache.get(token)
        if cached is None:
            cached = bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, token))
            self._eog_cache[token] = cached
        return cached

    @property
    def vocab_identity(self) -> VocabIdentity:
        if self._vocab_identity is None:
            self._vocab_identity = VocabIdentity(self.vocab_type, self.n_vocab, self.bos, self.eos,
                                                 self.add_bos, token_texts_digest(self._vocab))
        return self._vocab_identity

    def vocab_tag(self) -> str:
        """The tag learned cache files of this vocabulary carry (:attr:`.vocab.VocabIdentity.tag`)."""
        return self.vocab_identity.tag

    @property
    def architecture(self) -> str:
        """GGUF ``general.architecture`` (e.g. ``gemma3``)."""
        buf = ctypes.create_string_buffer(64)
        n = self._llama_cpp.llama_model_meta_val_str(self._model, b"general.architecture", buf, len(buf))
        return buf.value.decode(errors="replace") if n > 0 else ""

    def model_info(self) -> dict:
        llama_cpp = self._llama_cpp
        desc = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self._model, desc, len(desc))
        return {
            "path": self.path,
            "size_bytes": os.path.getsize(self.path),
            "n_params": int(llama_cpp.llama_model_n_params(self._model)),
            "description": desc.value.decode(errors="replace"),
            "n_gpu_layers": self.config.n_gpu_layers,
            "n_ctx": self.n_ctx,
            "n_vocab": self.n_vocab,
            "vocab_type": self.vocab_type,
            # "window" (llama.cpp's default, less memory) or "full" (bit-identical output promised)
            "sliding_window_cache": "full" if self.full_swa_cache else "window",
        }

    # -- decoding -------------------------------------------------------------------------------
    def _init_batch_views(self) -> None:
        """Numpy views of the batch's token, position and logits-flag arrays (llama_batch_init's,
        ``_batch_capacity`` entries each); every row belongs to sequence 0 until a decode of another
        sequence sets its rows (:meth:`_set_row_seqs`)."""
        capacity, batch = self._batch_capacity, self._batch
        self._token_in = np.ctypeslib.as_array(batch.token, shape=(capacity,))
        self._pos_in = np.ctypeslib.as_array(batch.pos, shape=(capacity,))
        self._logits_flags = np.ctypeslib.as_array(batch.logits, shape=(capacity,))
        np.ctypeslib.as_array(batch.n_seq_id, shape=(capacity,))[:] = 1
        for i in range(capacity):
            batch.seq_id[i][0] = 0
        self._row_seq = np.zeros(capacity, dtype=np.int32)  # what batch.seq_id[i][0] holds
        # positions as a table: a slice of it is copied into the batch (cheaper than from a range)
        self._positions = np.arange(self.n_ctx + capacity, dtype=np.int32)
        self._logits_at = address_result(self._llama_cpp.llama_get_logits_ith)

    def _set_row_seqs(self, start: int, seqs: np.ndarray) -> None:
        """Rows ``start..start+len(seqs)`` of the batch belong to ``seqs``: a store per row that
        changes (a batch's seq_id is an array of pointers, not one numpy-viewable array)."""
        end = start + len(seqs)
        changed = np.flatnonzero(self._row_seq[start:end] != seqs)
        if len(changed):
            seq_id = self._batch.seq_id
            for i in changed.tolist():
                seq_id[start + i][0] = int(seqs[i])
            self._row_seq[start:end] = seqs

    @property
    def kv_tokens(self) -> List[int]:
        """The tokens of sequence 0 in the KV cache (its positions 0..n_past-1)."""
        return self._seq_tokens[0]

    @kv_tokens.setter
    def kv_tokens(self, tokens: List[int]) -> None:  # a restored snapshot (engine/conversations.py)
        self._seq_tokens[0] = tokens

    def set_tokens(self, seq: int, tokens: List[int]) -> None:
        """What sequence ``seq``'s cells now hold (a snapshot restored into it: engine/conversations.py)."""
        self._seq_tokens[seq] = list(tokens)

    @property
    def n_past(self) -> int:
        return len(self._seq_tokens[0])

    def past(self, seq: int) -> int:
        """Positions of sequence ``seq`` in the KV cache."""
        return len(self._seq_tokens[seq])

    def tokens_of(self, seq: int) -> List[int]:
        """The tokens of sequence ``seq`` in the KV cache (read-only by convention)."""
        return self._seq_tokens[seq]

    def sequence(self, seq: int) -> "SequenceView":
        """Sequence ``seq`` with the one-sequence API (decode, rollback, reuse_prefix, clear)."""
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq} of a context of {self.n_seq}")
        return SequenceView(self, seq)

    def decode(self, tokens: Sequence[int], logit_rows: Sequence[int],
               stop: Optional[Callable[[], bool]] = None, seq: int = 0) -> List[np.ndarray]:
        """Append ``tokens`` to sequence ``seq``; return logits for the requested row indices of this
        batch only: views valid until the next decode for rows of the last chunk, copies for rows
        of earlier chunks.

        Batches longer than ``n_batch`` are split in chunks of ``n_batch``; the next chunk's
        ``llama_decode`` overwrites llama.cpp's logits buffer, so rows of an earlier chunk are
        copied before it runs (a verify batch of K + 1 > n_batch rows needs every row).

        ``stop`` is asked before every chunk after the first: True raises DecodeInterrupted, with
        the chunks decoded so far kept (``kv_tokens`` says which), so a long prompt can be
        cancelled within one chunk.
        """
        if not tokens:
            raise ValueError("decode of an empty batch")
        kv = self._seq_tokens[seq]
        if len(kv) + len(tokens) > self.n_ctx:
            raise KVCacheError(f"context full: {len(kv)} + {len(tokens)} tokens > n_ctx {self.n_ctx}")
        llama_cpp = self._llama_cpp
        # a verify pass asks every row (a range): no set to build
        wanted = logit_rows if type(logit_rows) is range and logit_rows.step == 1 else sorted(set(logit_rows))
        if wanted and not 0 <= wanted[0] <= wanted[-1] < len(tokens):
            raise ValueError(f"logit rows {wanted[0]}..{wanted[-1]} outside a batch of {len(tokens)}")
        chunk = self._batch_capacity
        batch, ctx = self._batch, self._ctx
        token_in, pos_in, flags = self._token_in, self._pos_in, self._logits_flags
        start = 0
        out: List[np.ndarray] = []
        while start < len(tokens):
            if start and stop is not None and stop():
                raise DecodeInterrupted(f"stopped after {start} of {len(tokens)} tokens")
            part = tokens[start:start + chunk]
            n = len(part)
            base = len(kv)
            # the batch's arrays are numpy views (see _init_batch_views): a few array stores a
            # chunk instead of five ctypes stores per row
            token_in[:n] = part
            pos_in[:n] = self._positions[base:base + n]
            flags[:n] = 0
            if self.n_seq > 1:
                self._set_row_seqs(0, np.full(n, seq, dtype=np.int32))
            rows_here = [r - start for r in wanted if start <= r < start + n]
            if rows_here:
                if rows_here[-1] - rows_here[0] == len(rows_here) - 1:  # a run of rows
                    flags[rows_here[0]:rows_here[-1] + 1] = 1
                else:
                    flags[rows_here] = 1
            batch.n_tokens = n
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                # Failed decodes leave the KV in an unknown state past base: drop it.
                llama_cpp.llama_memory_seq_rm(self._mem, seq, base, -1)
                raise KVCacheError(f"llama_decode failed with code {rc} at position {base} "
                                   f"({n} tokens; 1 = no KV slot, <0 = error)")
            kv.extend(part)
            last_chunk = start + n >= len(tokens)
            if rows_here:
                # llama.cpp stores the rows asked for contiguously, in batch order (llama.h): one
                # address and one cached view cover them all
                first = self._logits_at(ctx, rows_here[0])
                if not first:
                    raise KVCacheError(f"llama.cpp returned no logits for row {rows_here[0]} ({self.path})")
                block = self._logits_views.at(first, (len(rows_here), self.n_vocab))
                out.extend(block if last_chunk else block.copy())
            for listener in self._chunk_listeners:
                listener(base, rows_here, last_chunk)
            start += n
        return out

    def decode_parts(self, parts: Sequence[Tuple[int, Sequence[int], Sequence[int]]]) -> List[np.ndarray]:
        """One ``llama_decode`` over rows of several sequences: ``parts`` are (sequence, tokens,
        logit rows), each sequence at most once, the logit rows being indices into the part's
        tokens, ascending (a verify pass wants them all, or all but those a grammar decides; a
        prompt chunk its last one or none). Each part's tokens are appended to its sequence.
        Returns one logits block per part (its logit rows x n_vocab, in order; 0 rows where none
        were asked), views valid until the next decode.

        All rows must fit one batch (``n_batch``); :meth:`decode` splits a longer one. On a failed
        decode every part's sequence is rolled back to where it stood and KVCacheError raised.
        """
        n_rows = sum(len(tokens) for _, tokens, _ in parts)
        if n_rows == 0:
            raise ValueError("decode of an empty batch")
        if n_rows > self._batch_capacity:
            raise ValueError(f"{n_rows} rows in one pass: more than n_batch {self._batch_capacity}")
        token_in, pos_in, flags = self._token_in, self._pos_in, self._logits_flags
        seqs = np.empty(n_rows, dtype=np.int32)
        flags[:n_rows] = 0
        at = 0
        bases = []
        for seq, tokens, logit_rows in parts:
            kv = self._seq_tokens[seq]
            n = len(tokens)
            if len(kv) + n > self.n_ctx:
                raise KVCacheError(f"context full: {len(kv)} + {n} tokens > n_ctx {self.n_ctx} "
                                   f"(sequence {seq})")
            if len(logit_rows) and not 0 <= logit_rows[0] <= logit_rows[-1] < n:
                raise ValueError(f"logit rows {logit_rows[0]}..{logit_rows[-1]} of a part of {n} tokens")
            token_in[at:at + n] = tokens
            pos_in[at:at + n] = range(len(kv), len(kv) + n)
            seqs[at:at + n] = seq
            if type(logit_rows) is range:  # a run of rows (a verify pass, a chunk's last row)
                flags[at + logit_rows.start:at + logit_rows.stop] = 1
            elif logit_rows:
                flags[[at + r for r in logit_rows]] = 1
            bases.append(len(kv))
            at += n
        self._set_row_seqs(0, seqs)
        self._batch.n_tokens = n_rows
        llama_cpp = self._llama_cpp
        rc = llama_cpp.llama_decode(self._ctx, self._batch)
        if rc != 0:
            for (seq, _, _), base in zip(parts, bases):
                llama_cpp.llama_memory_seq_rm(self._mem, seq, base, -1)
            raise KVCacheError(f"llama_decode failed with code {rc} over {n_rows} rows of "
                               f"{len(parts)} sequences (1 = no KV slot, <0 = error)")
        n_out = sum(len(logit_rows) for _, _, logit_rows in parts)
        block = None
        if n_out:
            first = llama_cpp.llama_get_logits_ith(self._ctx, int(np.flatnonzero(flags[:n_rows])[0]))
            if not first:
                raise KVCacheError(f"llama.cpp returned no logits for a pass of {n_rows} rows ({self.path})")
            block = self._logits_views.get(first, (n_out, self.n_vocab))
        out: List[np.ndarray] = []
        row = 0
        for seq, tokens, logit_rows in parts:
            self._seq_tokens[seq].extend(tokens)
            n_logits = len(logit_rows)
            out.append(block[row:row + n_logits] if block is not None else np.empty((0, self.n_vocab), np.float32))
            row += n_logits
        return out

    def rollback(self, n_keep: int, seq: int = 0) -> None:
        """Drop KV positions >= ``n_keep`` of sequence ``seq``; raise KVCacheError if llama.cpp
        refuses."""
        kv = self._seq_tokens[seq]
        if n_keep >= len(kv):
            return
        if n_keep < 0:
            raise ValueError(f"rollback to {n_keep}")
        ok = self._llama_cpp.llama_memory_seq_rm(self._mem, seq, n_keep, -1)
        if not ok:
            raise KVCacheError(f"llama.cpp refused to remove KV positions >= {n_keep} of {len(kv)} "
                               f"({self.path}); the sequence cannot be rolled back")
        del kv[n_keep:]
        if not self._window_intact(seq):
            self.clear(seq)
            raise WindowLostError(f"cannot roll back to position {n_keep}: the sliding-window layers "
                                  f"no longer hold the {self.n_swa} positions before it ({self.path}); "
                                  f"the cache was cleared")

    def window_start(self, seq: int = 0) -> int:
        """The lowest position sequence ``seq``'s sliding-window cells hold (llama.cpp keeps a
        sequence's positions contiguous from there on); -1 for an empty sequence."""
        return int(self._llama_cpp.llama_memory_seq_pos_min(self._mem, seq))

    def saved_window_start(self, seq: int = 0) -> int:
        """The lowest position whose sliding-window cells a copy of sequence ``seq``'s state holds
        (``llama_state_seq_get_data`` leaves out the cells the sequence's window has passed)."""
        first = self.window_start(seq)
        return max(first, len(self._seq_tokens[seq]) - self.n_swa) if self.n_swa else first

    def window_kept(self, first: int, n: int) -> bool:
        """Whether a sequence whose sliding-window cells start at position ``first`` holds the
        whole window of position ``n`` (True without sliding-window layers)."""
        return not self.n_swa or n == 0 or 0 <= first <= max(0, n - self.n_swa + 1)

    def _window_intact(self, seq: int = 0) -> bool:
        """Whether the next position's sliding window of sequence ``seq`` is all in the KV cache
        (True without a window limit)."""
        n = len(self._seq_tokens[seq])
        return not self.n_swa or n == 0 or self.window_kept(self.window_start(seq), n)

    def reusable_prefix(self, tokens: Sequence[int], *, keep_last: int = 0, seq: int = 0) -> int:
        """The prefix of ``tokens`` that :meth:`reuse_prefix` would keep, without changing anything:
        the common prefix with sequence ``seq`` (less ``keep_last``), or 0 where the sliding window
        before it is no longer in the cache."""
        kv = self._seq_tokens[seq]
        limit = min(len(kv), len(tokens) - keep_last)
        n = 0
        while n < limit and kv[n] == tokens[n]:
            n += 1
        if n < len(kv) and not self.window_kept(self.window_start(seq), n):
            return 0
        return n

    def reuse_prefix(self, tokens: Sequence[int], *, keep_last: int = 0, seq: int = 0) -> int:
        """Keep the longest common prefix of sequence ``seq``'s KV cache and ``tokens`` (minus
        ``keep_last`` tokens that must be re-decoded, e.g. to get their logits); return its length
        (0, the cache emptied, where the sliding window before it is no longer in the cache)."""
        kv = self._seq_tokens[seq]
        limit = min(len(kv), len(tokens) - keep_last)
        n = 0
        while n < limit and kv[n] == tokens[n]:
            n += 1
        try:
            self.rollback(n, seq)
        except WindowLostError:  # the window before the prefix was overwritten: start over
            return 0
        return n

    def share_prefix(self, source: int, seq: int, n: int) -> None:
        """Sequence ``seq`` becomes the first ``n`` positions of sequence ``source``, which keep
        their cells: in a unified cache a cell holds a set of sequences, so nothing is computed or
        copied (a planner's system prompt, decoded once, serves every slot)."""
        if not 0 <= n <= len(self._seq_tokens[source]):
            raise ValueError(f"share {n} positions of a sequence of {len(self._seq_tokens[source])}")
        llama_cpp = self._llama_cpp
        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._seq_tokens[seq] = []
        if n:
            llama_cpp.llama_memory_seq_cp(self._mem, source, seq, 0, n)
            self._seq_tokens[seq] = list(self._seq_tokens[source][:n])
            if not self._window_intact(seq):  # the source's oldest sliding-window cells are gone
                self.clear(seq)

    def clear(self, seq: Optional[int] = None) -> None:
        """Empty the KV cache: every sequence (None), or one. With a single sequence both are the
        same: the whole cache is reset, so cells are laid out again from the first."""
        if seq is None or self.n_seq == 1:
            self._llama_cpp.llama_memory_clear(self._mem, True)
            self._seq_tokens = [[] for _ in range(self.n_seq)]
            return
        self._llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._seq_tokens[seq] = []

    def timed_decode(self, tokens: Sequence[int], logit_rows: Sequence[int],
                     seq: int = 0) -> Tuple[List[np.ndarray], float]:
        """``decode`` plus its wall time in seconds (logits ready: llama_decode is synchronous on
        the CPU; on a GPU ``llama_get_logits_ith`` synchronises)."""
        t0 = time.perf_counter()
        rows = self.decode(tokens, logit_rows, seq=seq)
        return rows, time.perf_counter() - t0

    # -- listeners of decoded chunks ------------------------------------------------------------
    @property
    def chunk_listeners(self) -> Tuple[ChunkListener, ...]:
        """The functions called after each decoded chunk (see ``_chunk_listeners``)."""
        return self._chunk_listeners

    def add_chunk_listener(self, listener: ChunkListener) -> None:
        """Call ``listener`` after each decoded chunk from the next decode on (once, if added twice)."""
        if listener not in self._chunk_listeners:
            self._chunk_listeners = self._chunk_listeners + (listener,)

    def remove_chunk_listener(self, listener: ChunkListener) -> None:
        """Stop calling ``listener``; nothing if it was not added."""
        self._chunk_listeners = tuple(other for other in self._chunk_listeners if other != listener)

    # -- a sequence's KV state, the model's template, control tokens ----------------------------
    def state_size(self, seq: int = 0) -> int:
        """Bytes a copy of sequence ``seq``'s KV state takes (llama_state_seq_get_size)."""
        return int(self._llama_cpp.llama_state_seq_get_size(self._ctx, seq))

    def save_state(self, size: int, seq: int = 0) -> Tuple[Any, int]:
        """A copy of sequence ``seq``'s KV state into a new buffer of ``size`` bytes
        (:meth:`state_size`): (the buffer, bytes written; 0 = nothing copied). MemoryError / OSError
        when it cannot be made.

        The buffer is a mapping of its own, returned to the system whole when the last reference
        goes: snapshots are tens of MiB each, made and dropped at ever other sizes, and the C heap
        would keep the holes they leave (a soak's RSS grew 170 MiB over its last 500 goals with
        the snapshots held to 256 MiB; mapped, the resident bytes follow the snapshots kept)."""
        if size <= 0:
            return (ctypes.c_uint8 * 0)(), 0
        data = (ctypes.c_uint8 * size).from_buffer(mmap.mmap(-1, size))
        return data, int(self._llama_cpp.llama_state_seq_get_data(self._ctx, data, size, seq))

    def load_state(self, data: Any, size: int, seq: int = 0) -> bool:
        """Copy a state :meth:`save_state` made back into sequence ``seq``; False if llama.cpp
        refused it (the sequence then holds nothing trustworthy: the caller clears it)."""
        return int(self._llama_cpp.llama_state_seq_set_data(self._ctx, data, size, seq)) > 0

    def chat_template(self) -> str:
        """The chat template in the GGUF (``tokenizer.chat_template``); '' without one."""
        source = self._llama_cpp.llama_model_chat_template(self._model, None)
        return source.decode("utf-8", "replace") if source else ""

    def is_control(self, token: int) -> bool:
        """Whether ``token`` is a control token (a turn marker, Gemma 4's call markers)."""
        return bool(self._llama_cpp.llama_vocab_get_attr(self._vocab, token)
                    & self._llama_cpp.LLAMA_TOKEN_ATTR_CONTROL)

    @property
    def handles_vocab(self) -> object:
        """The llama_vocab pointer, for code that calls llama.cpp on this vocabulary itself (a
        grammar: engine/grammar/matcher.py)."""
        return self._vocab

    @property
    def handles(self) -> Tuple[object, object]:
        """(llama_model, llama_context) pointers, for code that calls llama.cpp on this model itself
        (an MTP assistant's context is created over the target's: engine/drafters/mtp.py)."""
        return self._model, self._ctx


class SequenceView:
    """One sequence of a :class:`LlamaModel` with the one-sequence API, for code written against a
    model's sequence 0 (the engine's loop, a draft model's drafter): decode, rollback,
    reuse_prefix, clear and the sequence's tokens. ``model`` is the model itself."""

    def __init__(self, model: LlamaModel, seq: int) -> None:
        self.model = model
        self.seq = seq

    @property
    def kv_tokens(self) -> List[int]:
        return self.model.tokens_of(self.seq)

    @kv_tokens.setter
    def kv_tokens(self, tokens: List[int]) -> None:
        self.model.set_tokens(self.seq, tokens)

    @property
    def handles(self) -> Tuple[object, object]:
        return self.model.handles

    @property
    def n_past(self) -> int:
        return self.model.past(self.seq)

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    def decode(self, tokens: Sequence[int], logit_rows: Sequence[int],
               stop: Optional[Callable[[], bool]] = None) -> List[np.ndarray]:
        return self.model.decode(tokens, logit_rows, stop, seq=self.seq)

    def timed_decode(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> Tuple[List[np.ndarray], float]:
        return self.model.timed_decode(tokens, logit_rows, seq=self.seq)

    def rollback(self, n_keep: int) -> None:
        self.model.rollback(n_keep, self.seq)

    def reuse_prefix(self, tokens: Sequence[int], *, keep_last: int = 0) -> int:
        return self.model.reuse_prefix(tokens, keep_last=keep_last, seq=self.seq)

    def reusable_prefix(self, tokens: Sequence[int], *, keep_last: int = 0) -> int:
        return self.model.reusable_prefix(tokens, keep_last=keep_last, seq=self.seq)

    def window_start(self) -> int:
        return self.model.window_start(self.seq)

    def saved_window_start(self) -> int:
        return self.model.saved_window_start(self.seq)

    def window_kept(self, first: int, n: int) -> bool:
        return self.model.window_kept(first, n)

    def clear(self) -> None:
        self.model.clear(self.seq)

    def state_size(self) -> int:
        return self.model.state_size(self.seq)

    def save_state(self, size: int) -> Tuple[Any, int]:
        return self.model.save_state(size, self.seq)

    def load_state(self, data: Any, size: int) -> bool:
        return self.model.load_state(data, size, self.seq)
