"""The kinds of drafter: each one's name, what builds it, and which model files it runs.

This is the table the mode table (``modes.py``) names kinds from, the config checks and the bench
read; it imports nothing of the drafters. A kind's builder is where its drafter is made: a function,
or ``"module:function"`` of one, imported only when the engine builds that kind
(``drafters/registry.py``), so that configs validate without numpy or llama.cpp. The built-in kinds
are registered below; another is one :func:`register` call (before the engine loads) and a row of
the mode table (:func:`~gemma_spec_ros.engine.modes.add_mode`): a new drafter is its own file, a
:class:`~gemma_spec_ros.engine.drafters.base.Drafter` subclass with its builder, and those two calls.

>>> [kind.name for kind in kinds()]
['draft', 'mtp', 'eagle3', 'lookup', 'suffix']
>>> get("mtp").model, get("lookup").model
('a Gemma 4 assistant (a gemma4-assistant GGUF)', '')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple, Union

if TYPE_CHECKING:  # annotations only
    from .config import EngineConfig
    from .drafters.base import Drafter
    from .llama.model import LlamaModel

#: A kind's builder: (the engine's config, the target model, the sequences the target holds, one
#: per request running at once) -> the drafter; None when the config asks for none of this kind.
Builder = Callable[["EngineConfig", "LlamaModel", int], Optional["Drafter"]]


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter."""

    name: str  # Drafter.name: what the mode table's chains say, and Draft.source
    #: the builder, or ``"package.module:function"`` naming it (imported when the kind is built)
    build: Union[Builder, str]
    #: a kind that runs the model of ``draft.model_path``: that model in a user's words ('' = the
    #: kind runs no model of its own); at most one such kind is built, the one the file is
    model: str = ""
    #: the GGUF architectures (``general.architecture``) of the files a model kind runs; () = any
    #: file no other kind claims (the standalone draft model)
    architectures: Tuple[str, ...] = ()
    #: it drafts for several requests at once (``Drafter.for_slot``); else ``max_running`` > 1 is
    #: refused with it loaded, saying why
    several_at_once: bool = True


_KINDS: Dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    """Add ``kind`` (ValueError if its name is taken, or a second model kind claims any file)."""
    if kind.name in _KINDS:
        raise ValueError(f"a drafter kind {kind.name!r} is registered already")
    if kind.architectures and not kind.model:
        raise ValueError(f"drafter kind {kind.name!r}: architectures are for a kind that runs "
                         "draft.model_path's model (give its model)")
    if kind.model and not kind.architectures and any(k.model and not k.architectures for k in _KINDS.values()):
        raise ValueError(f"drafter kind {kind.name!r}: another kind runs any draft model file already; "
                         "name the architectures of this one's files")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove the kind ``name`` (a test's toy kind); nothing if there is none."""
    _KINDS.pop(name, None)


def kinds() -> Tuple[DrafterKind, ...]:
    """The registered kinds, in registration order."""
    return tuple(_KINDS.values())


def get(name: str) -> DrafterKind:
    """The kind ``name``; ValueError naming the registered ones if there is none."""
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"no drafter kind {name!r}: registered are {', '.join(_KINDS)}")
    return kind


def is_model_kind(name: str) -> bool:
    """Whether ``name`` is a registered kind that runs ``draft.model_path``'s model."""
    kind = _KINDS.get(name)
    return kind is not None and bool(kind.model)


_DRAFTERS = "gemma_spec_ros.engine.drafters"
register(DrafterKind("draft", f"{_DRAFTERS}.draft_model:build",  # a standalone model of the target's vocabulary
                     model="a draft model"))
register(DrafterKind("mtp", f"{_DRAFTERS}.mtp:build", model="a Gemma 4 assistant (a gemma4-assistant GGUF)",
                     architectures=("gemma4-assistant",), several_at_once=False))
register(DrafterKind("eagle3", f"{_DRAFTERS}.eagle3:build", model="an EAGLE-3 head (an eagle3 GGUF)",
                     architectures=("eagle3",), several_at_once=False))
register(DrafterKind("lookup", f"{_DRAFTERS}.lookup:build"))  # n-gram lookup over three caches
register(DrafterKind("suffix", f"{_DRAFTERS}.suffix:build"))  # suffix decoding

__all__ = ["Builder", "DrafterKind", "get", "is_model_kind", "kinds", "register", "unregister"]
