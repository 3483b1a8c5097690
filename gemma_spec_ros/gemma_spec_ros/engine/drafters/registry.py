"""Building the drafters a config asks for, and which kind runs a model file.

The kinds themselves (names, builders, the model files they run) are the table in
``engine/drafter_kinds.py``; its names are re-exported here, so a new drafter registers with
``registry.register(DrafterKind(...))``. A kind's builder given as ``"module:function"`` is imported
here, when the engine builds that kind.

>>> model_kind("/nonexistent/file.gguf").name  # a file that cannot be read: its loader says why
'draft'
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Iterator

from ..drafter_kinds import Builder, DrafterKind, get, is_model_kind, kinds, register, unregister
from ..llama.gguf import GGUFHeaderError, architecture

if TYPE_CHECKING:  # annotations only
    from ..config import EngineConfig
    from ..llama.model import LlamaModel
    from .base import Drafter


def model_kind(path: str) -> DrafterKind:
    """The kind that runs the model file at ``path``: the one claiming its GGUF architecture, else
    the one that runs any file (a file that cannot be read goes there too: its loader says what is
    wrong with it)."""
    try:
        arch = architecture(path) or ""
    except (OSError, GGUFHeaderError):
        arch = ""
    models = [kind for kind in kinds() if kind.model]
    claimed = next((kind for kind in models if arch in kind.architectures), None)
    if claimed is not None:
        return claimed
    fallback = next((kind for kind in models if not kind.architectures), None)
    if fallback is None:
        raise ValueError(f"no drafter kind runs {path} (architecture {arch or 'unknown'})")
    return fallback


def build_drafters(config: "EngineConfig", target: "LlamaModel", n_seq: int) -> Iterator["Drafter"]:
    """The drafters ``config`` asks for, each yielded as soon as it is built (the caller owns it
    from then on, and closes it if a later one fails): the model kind of ``draft.model_path`` first
    (if it cannot draft for the target, no cache is loaded or saved), then every kind that runs no
    model, in registration order."""
    if config.draft is not None:
        kind = model_kind(config.draft.resolved_path)
        if n_seq > 1 and not kind.several_at_once:
            raise ValueError(
                f"{kind.model} drafts for one request at a time: it reads the target's rows of one "
                f"sequence (draft.model_path {config.draft.resolved_path}); serve one request at a time "
                "(max_running 1) or use a draft model or the n-gram modes")
        drafter = builder(kind)(config, target, n_seq)
        if drafter is not None:
            yield drafter
    for kind in kinds():
        if not kind.model:
            drafter = builder(kind)(config, target, n_seq)
            if drafter is not None:
                yield drafter


def builder(kind: DrafterKind) -> Builder:
    """``kind``'s builder, imported if it is named ``"module:function"``."""
    if callable(kind.build):
        return kind.build
    module, _, function = kind.build.partition(":")
    return getattr(importlib.import_module(module), function)


__all__ = ["Builder", "DrafterKind", "build_drafters", "builder", "get", "is_model_kind", "kinds", "model_kind",
           "register", "unregister"]
