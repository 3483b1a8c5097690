"""The target's layer features, row by decoded row, for an EAGLE-3 head: one interface, two sources.

A head reads three features of every position the target decodes: id i < n (the target's layer
count) is the input of target layer i (0: the scaled token embedding), id n the final post-norm
state. :func:`layer_features` gives the drafter a :class:`LayerFeatures` either way:

- **exported** (:class:`ExportedFeatures`): llama.cpp's own export (``llama_set_embeddings_layer_inp``,
  ``t_layer_inp`` in the graph) for the architectures of :data:`EXPORT_ARCHITECTURES` (gemma4,
  llama, qwen3...). Asking any other target for it is a failed assertion inside llama_decode.
- **captured** (:class:`FeatureCapture`): llama.cpp's eval callback (``cb_eval``) for the
  architectures of :data:`CAPTURE_ARCHITECTURES` (gemma3), whose graph exports nothing. The
  scheduler asks the callback about each graph node before it computes it; the callback claims
  the nodes of the features the head reads (``inp_scaled`` for id 0, ``l_out-{i-1}``, layer i - 1's
  output, for id i) and copies their rows once computed (``ggml_backend_tensor_get``: host or
  device memory alike). Every other node is computed as without a callback, in one run per
  claimed node. The final post-norm state (id n) is not offered: gemma3 computes the last layer
  and the norm only for the rows asked for logits, and a head needs every position's features.

The eval callback is a context parameter, set once when the target's context is created: the engine
asks :func:`eval_callback_for` (a callback only for an EAGLE-3 head over a captured architecture) and
hands it to :class:`~.model.LlamaModel` (``eval_callback``). Without a head the target has no
callback at all, so other configurations pay nothing. With one, the callback returns at once while
the head may not draft (a few hundred Python calls a pass; docs/benchmarks.md) and copies only
while it may (:meth:`FeatureCapture.enable`, from the drafter's ``before_target_pass``).
"""
from __future__ import annotations

import ctypes
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config import ModelConfig
from ..errors import EngineError
from .gguf import GGUFHeaderError, architecture
from .model import BufferViews, LlamaModel, address_result
from .process import load_llama_cpp

#: Architectures whose llama.cpp graph exports layer inputs (``t_layer_inp``) at the llama.cpp
#: llama-cpp-python 0.3.36 vendors (src/models/*.cpp). Asking any other target for them is a
#: failed assertion inside llama_decode: the process aborts. Gemma 3 is not among them.
EXPORT_ARCHITECTURES: Tuple[str, ...] = (
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2",
    "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35",
    "qwen35moe", "qwen3moe", "qwen3next", "qwen4exp")
#: Architectures whose features the eval callback copies: their graph names the scaled token
#: embedding ``inp_scaled`` and each layer's output ``l_out-{i}`` for every row but in the last
#: layer (src/models/gemma3.cpp; the last layer keeps only the rows asked for logits).
CAPTURE_ARCHITECTURES: Tuple[str, ...] = ("gemma3",)
#: The GGUF architecture of an EAGLE-3 head (engine/drafters/eagle3.py).
HEAD_ARCHITECTURE = "eagle3"
#: The graph node of the input of layer 0 in the captured architectures.
EMBEDDING_NODE = "inp_scaled"
GGML_TYPE_F32 = 0


class _Tensor(ctypes.Structure):
    """``struct ggml_tensor`` of ggml/include/ggml.h at the llama.cpp llama-cpp-python 0.3.36 vendors
    (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64). The layout is
    checked against ``ggml_get_name`` at the first node a callback sees."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


NAME_OFFSET = _Tensor.name.offset


def node_name(layer: int) -> str:
    """The graph node holding the input of target layer ``layer`` (>= 0) in the captured
    architectures.

    >>> node_name(0), node_name(9)
    ('inp_scaled', 'l_out-8')
    """
    return EMBEDDING_NODE if layer == 0 else f"l_out-{layer - 1}"


class LayerFeatures:
    """What the EAGLE-3 drafter reads of the target: the feature rows of its last decoded chunk.

    ``enable(True)`` before a pass whose rows the head will read (False: stop; the source then costs
    nothing or next to nothing); ``rows()`` after the chunk (a ``LlamaModel`` chunk listener): one array of
    the chunk's rows x the target's width per feature, in the head's order, valid until the target's
    next decode."""

    enabled = False

    def enable(self, enabled: bool) -> None:
        raise NotImplementedError

    def rows(self) -> List[np.ndarray]:
        raise NotImplementedError


class ExportedFeatures(LayerFeatures):
    """llama.cpp's export of the features, and views of its buffers of them.

    A feature id below the target's layer count is that layer's input (``llama_set_embeddings_
    layer_inp``); the id equal to it is the final post-norm state (``llama_set_embeddings_nextn``,
    every row, not only those asked for logits). ``bindings`` has the two layer-input functions
    and ``nextn`` (engine/drafters/eagle3.py: Eagle3Bindings)."""

    def __init__(self, target: LlamaModel, layers: Sequence[int], n_layer: int, n_embd: int,
                 bindings: object) -> None:
        _, self._ctx = target.handles
        self._layers, self._n_layer, self._bindings = list(layers), n_layer, bindings
        self._shape = (target.n_batch, n_embd)
        self._views = BufferViews()
        # per feature, the function that returns the address of its rows
        final_state = address_result(bindings.nextn.llama_get_embeddings_nextn)
        self._addresses = [bindings.llama_get_embeddings_layer_inp if layer < n_layer else final_state
                           for layer in self._layers]
        self.enabled = False

    def enable(self, enabled: bool) -> None:
        """Export from the next decode on (or stop); llama.cpp re-reserves its graph on a change."""
        for layer in self._layers:
            if layer < self._n_layer:
                self._bindings.llama_set_embeddings_layer_inp(self._ctx, layer, enabled)
            else:
                self._bindings.nextn.llama_set_embeddings_nextn(self._ctx, enabled, False)
        self.enabled = enabled

    def rows(self) -> List[np.ndarray]:
        """One (n_batch, n_embd) view per feature (the chunk's rows first)."""
        views = []
        for layer, address in zip(self._layers, self._addresses):
            pointer = address(self._ctx, layer) if layer < self._n_layer else address(self._ctx)
            if not pointer:
                raise EngineError(f"the target exported no features of layer {layer}")
            views.append(self._views.at(pointer, self._shape))
        return views


class FeatureCapture(LayerFeatures):
    """llama.cpp's eval callback over a target's graph: copies the rows of the feature nodes asked
    for (:meth:`want`) while enabled, and claims no node otherwise.

    :attr:`function` is the ctypes callback for ``llama_context_params.cb_eval``; it carries this
    object as ``function.capture`` (:func:`capture_of` finds it through the target). Rows of a
    decode's ubatches are appended; :meth:`rows` hands them over and the next decode starts over.
    """

    def __init__(self) -> None:
        llama_cpp = load_llama_cpp()
        library = llama_cpp.llama_cpp._lib  # ggml's functions resolve through libllama's dependencies
        self._tensor_get = library.ggml_backend_tensor_get
        self._tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self._tensor_get.restype = None
        self._get_name = library.ggml_get_name
        self._get_name.argtypes, self._get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
        self.enabled = False
        self._wanted: Dict[bytes, int] = {}
        self._names: List[str] = []
        self._order: List[int] = []
        self._buffers: List[np.ndarray] = []
        self._counts: List[int] = []
        self._first = 0  # the node that comes first in the graph
        self._layout_checked = False
        self._fault: Optional[str] = None
        self.function = llama_cpp.ggml_backend_sched_eval_callback(self._make_callback())
        self.function.capture = self

    # -- what the head reads ------------------------------------------------------------------
    def want(self, layers: Sequence[int], n_embd: int, n_rows: int) -> None:
        """Copy the inputs of target layers ``layers`` (ids < the layer count; one node may serve
        several), ``n_embd`` floats a row, up to ``n_rows`` rows a decode (the target's n_batch)."""
        unique = sorted(set(int(layer) for layer in layers))
        self._names = [node_name(layer) for layer in unique]
        self._wanted = {name.encode(): k for k, name in enumerate(self._names)}
        self._order = [unique.index(int(layer)) for layer in layers]
        self._buffers = [np.zeros((n_rows, n_embd), dtype=np.float32) for _ in unique]
        self._counts = [0] * len(unique)
        self._first = 0  # the lowest layer's node comes first in the graph
        self._n_embd = n_embd

    def enable(self, enabled: bool) -> None:
        """Claim the feature nodes from the next decode on (or claim none)."""
        self.enabled = bool(enabled) and bool(self._wanted)
        self._counts = [0] * len(self._counts)

    def rows(self) -> List[np.ndarray]:
        """The rows each feature node had in the decode since the last call (its chunk), in the
        head's order; EngineError if a node was not computed (another graph) or could not be read."""
        fault, self._fault = self._fault, None
        if fault:
            raise EngineError(f"the target's layer features could not be copied: {fault}")
        counts = self._counts
        if min(counts) != max(counts):
            missing = [name for name, count in zip(self._names, counts) if count != max(counts)]
            raise EngineError(f"the target's graph computed no node named {', '.join(missing)} for "
                              "its last chunk: its layer features cannot be copied")
        rows = [self._buffers[k][:counts[0]] for k in self._order]
        self._counts = [0] * len(counts)  # the next decode's rows start over (these stay valid)
        return rows

    # -- the callback -----------------------------------------------------------------------------
    def _make_callback(self):  # noqa: ANN202  the Python function behind the ctypes callback
        string_at, name_offset = ctypes.string_at, NAME_OFFSET

        def callback(tensor: int, ask: bool, user_data: int) -> bool:
            if not self.enabled:
                return not ask  # (never observes: no node was claimed)
            if ask:
                return string_at(tensor + name_offset) in self._wanted
            try:
                self._observe(tensor)
            except Exception as exc:  # noqa: BLE001  never raised through llama.cpp
                self._fault = f"{type(exc).__name__}: {exc}"
            return True  # False would stop the graph's computation

        return callback

    def _observe(self, tensor: int) -> None:
        """Copy the rows of a claimed node, once computed."""
        node = _Tensor.from_address(tensor)
        if not self._layout_checked:
            if self._get_name(tensor) != node.name:
                raise EngineError("struct ggml_tensor is not laid out as engine/llama/features.py "
                                  "assumes (another ggml)")
            self._layout_checked = True
        k = self._wanted[node.name]
        width, rows = int(node.ne[0]), int(node.ne[1])
        if node.type != GGML_TYPE_F32 or width != self._n_embd or node.nb[1] != 4 * width or node.ne[2] != 1:
            raise EngineError(f"node {node.name.decode()} is no F32 matrix of rows of {self._n_embd} "
                              f"(type {node.type}, ne {list(node.ne)})")
        counts, buffer = self._counts, self._buffers[k]
        if k == self._first and counts[k] + rows > len(buffer):
            counts[:] = [0] * len(counts)  # rows nobody read
        start = counts[k]
        if start + rows > len(buffer):
            raise EngineError(f"node {node.name.decode()} has {start + rows} rows, more than the "
                              f"{len(buffer)} of a decode")
        self._tensor_get(tensor, buffer[start:].ctypes.data, 0, rows * width * 4)
        counts[k] = start + rows


def capture_of(target: LlamaModel) -> Optional[FeatureCapture]:
    """The feature capture installed in the target's context (None: none)."""
    return getattr(getattr(target, "eval_callback", None), "capture", None)


def eval_callback_for(target: ModelConfig, draft: Optional[ModelConfig]) -> Optional[object]:
    """The eval callback to create the target's context with: a :class:`FeatureCapture`'s
    function where ``draft`` names an EAGLE-3 head and the target is of a captured architecture,
    else None (no callback: the target pays nothing). Reads the two GGUFs' headers only."""
    if draft is None:
        return None
    try:
        if architecture(draft.resolved_path) != HEAD_ARCHITECTURE:
            return None
        kind = architecture(target.resolved_path)
    except (OSError, GGUFHeaderError):
        return None  # the loaders say what is wrong with the file
    return FeatureCapture().function if kind in CAPTURE_ARCHITECTURES else None


def _head_reads() -> str:
    return (f"an EAGLE-3 head reads the target's layer features, and llama.cpp exports them only for "
            f"targets of architecture {', '.join(EXPORT_ARCHITECTURES)}")


def target_problem(target: LlamaModel) -> str:
    """Why no head can read this target's features ('' if one can, for some layers)."""
    kind = target.architecture
    if kind in EXPORT_ARCHITECTURES:
        return ""
    if kind in CAPTURE_ARCHITECTURES:
        if capture_of(target) is not None:
            return ""
        return (f"{_head_reads()}: {target.path} is {kind}, whose features are copied during "
                "its passes by an eval callback set when its context is created, and this target was "
                "loaded without it (the engine sets it when draft.model_path names an EAGLE-3 head; "
                "LlamaModel(..., eval_callback=eval_callback_for(target, draft)))")
    return f"{_head_reads()}: {target.path} is {kind or 'of unknown architecture'}"


def layers_problem(target: LlamaModel, layers: Sequence[int], n_layer: int) -> str:
    """Why the target cannot give a head these feature ids ('' if it can)."""
    kind = target.architecture
    if kind in EXPORT_ARCHITECTURES or not any(layer >= n_layer for layer in layers):
        return ""
    return (f"{_head_reads()}: {target.path} is {kind}, whose features are copied from its graph "
            f"during each pass, where its final post-norm state (feature id {n_layer}) exists only for "
            f"the rows asked for logits, and the head reads target layers {list(layers)}: a head for "
            f"it reads layer inputs only (ids below {n_layer}; trainers' default [2, n/2, n-3])")


def layer_features(target: LlamaModel, layers: Sequence[int], n_layer: int, n_embd: int,
                   bindings: object) -> LayerFeatures:
    """The source of the target's features ``layers`` (see the module docstring); EngineError with
    the reason where the target cannot give them (:func:`target_problem`, :func:`layers_problem`).
    ``bindings``: the export's functions (used for an exporting target only)."""
    problem = target_problem(target) or layers_problem(target, layers, n_layer)
    if problem:
        raise EngineError(problem)
    if target.architecture in EXPORT_ARCHITECTURES:
        return ExportedFeatures(target, layers, n_layer, n_embd, bindings)
    capture = capture_of(target)
    capture.want(layers, n_embd, target.n_batch)
    return capture
