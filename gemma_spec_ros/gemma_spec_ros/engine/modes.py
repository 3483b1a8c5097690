"""The speculative modes: which drafters each mode may use, in which order, and what it needs loaded.

This is the one table of modes: the engine (which drafters a step tries, whether a mode can run),
the configs and requests (which names are modes), the node's parameters and the bench all read it.
Adding a mode is one row here (or :func:`add_mode` at run time) and, for a new kind of drafter, one
file in :mod:`.drafters` registered in :mod:`.drafter_kinds`.

>>> MODES["draft+lookup"].chain
('lookup', 'draft')
>>> mode_problem("draft", loaded=["lookup"])
"spec mode 'draft' needs a draft model, and none is loaded (draft.model_path)"
>>> mode_problem("lookup", loaded=["lookup"])
''
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Dict, Iterator, Optional, Sequence, Tuple, overload

from . import drafter_kinds


@dataclass(frozen=True)
class Mode:
    """One speculative mode."""

    name: str
    #: the drafters (by ``Drafter.name``, a registered kind) a step tries, in this order: the first
    #: non-empty draft is verified; a drafter that is not loaded is passed over
    chain: Tuple[str, ...]
    #: the chain is reordered at every step by each policy's predicted speedup, and the policies
    #: decide whatever ``spec.adaptive`` says (:func:`~.propose.drafting_order`)
    ranked: bool = False
    #: the drafter that must be loaded for the mode to run ('' = none); a kind that runs the model
    #: named by ``draft.model_path`` (what it is, in a user's words: its registry entry)
    needs: str = ""


MODES: Dict[str, Mode] = {mode.name: mode for mode in (
    Mode("off", ()),
    Mode("draft", ("draft",), needs="draft"),  # a standalone model of the target's vocabulary
    Mode("lookup", ("lookup",)),  # n-gram lookup: the request, the learned cache, a static cache
    Mode("draft+lookup", ("lookup", "draft"), needs="draft"),
    Mode("auto", ("suffix", "lookup", "draft", "mtp", "eagle3"), ranked=True),  # the policy picks, or none
    Mode("mtp", ("mtp",), needs="mtp"),  # Gemma 4's assistant (drafters/mtp.py)
    Mode("eagle3", ("eagle3",), needs="eagle3"),  # an EAGLE-3 head (drafters/eagle3.py)
    # suffix decoding (drafters/suffix.py): the longest earlier occurrence, in the request and the
    # history of earlier outputs. Replayed (bench.trace_replay, modelled speedup over plain, median
    # after the first five requests), planner / planner with its schema / agent loop / the
    # single-prompt suites in order (64 tokens): lookup 2.32 / 2.48 / 3.06 / 1.80, suffix 2.98 /
    # 3.06 / 3.85 / 1.91, suffix+lookup 2.98 / 3.05 / 3.85 / 1.89 (lookup+suffix, at the drafter's
    # earlier 0.3 stop: 2.43 / 2.56 / 3.23 / 1.85); auto with suffix 2.97 / 3.05 / 3.85 / 1.85,
    # without it as lookup. The lookup row keeps today's drafts (a static cache is lookup's alone).
    Mode("suffix", ("suffix",)),
    Mode("suffix+lookup", ("suffix", "lookup")),  # suffix first; where it has no match, n-gram lookup
)}


class ModeNames(Sequence[str]):
    """The names of the modes, in table order: a view of :data:`MODES` that shows the modes added
    at run time too (configs and goals validate against it)."""

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(MODES))

    def __len__(self) -> int:
        return len(MODES)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Tuple[str, ...]: ...

    def __getitem__(self, index):  # noqa: ANN001, ANN204
        return tuple(MODES)[index]

    def __contains__(self, name: object) -> bool:
        return name in MODES

    def __repr__(self) -> str:
        return repr(tuple(MODES))


#: The names of the modes, in table order (a live view: see :class:`ModeNames`).
SPEC_MODES = ModeNames()


def add_mode(mode: Mode) -> Mode:
    """Add a row to the table at run time (a new drafter's mode); ValueError if the name is taken,
    the chain names a kind that is not registered, or ``needs`` is no model-running kind."""
    if mode.name in MODES:
        raise ValueError(f"spec mode {mode.name!r} exists already")
    for name in mode.chain:
        drafter_kinds.get(name)
    if mode.needs and not drafter_kinds.is_model_kind(mode.needs):
        raise ValueError(f"spec mode {mode.name!r} needs {mode.needs!r}, which is no registered kind that "
                         "runs draft.model_path's model")
    MODES[mode.name] = mode
    return mode


def remove_mode(name: str) -> None:
    """Remove a row added by :func:`add_mode` (a test's); nothing if there is none."""
    MODES.pop(name, None)


def check_mode_name(mode: str) -> None:
    """ValueError unless ``mode`` is a row of the table."""
    if mode not in MODES:
        raise ValueError(f"spec mode {mode!r}: expected one of {', '.join(MODES)}")


def _model(kind: str) -> str:
    """What the kind ``kind`` runs, in a user's words."""
    return drafter_kinds.get(kind).model


def needs_draft_slot(mode: str) -> str:
    """What ``mode`` needs in ``draft.model_path`` ('' = nothing), before any model is loaded."""
    needs = MODES[mode].needs
    return _model(needs) if needs else ""


def mode_problem(mode: str, loaded: Collection[str]) -> str:
    """Why ``mode`` cannot run with these drafters (by name) loaded; '' if it can."""
    row: Optional[Mode] = MODES.get(mode)
    if row is None:
        return f"spec mode {mode!r}: expected one of {', '.join(MODES)}"
    if not row.needs or row.needs in loaded:
        return ""
    held = next((name for name in loaded if drafter_kinds.is_model_kind(name) and name != row.needs), "")
    if held:
        users = [m.name for m in MODES.values() if m.needs == held]
        return (f"spec mode {mode!r} needs {_model(row.needs)}; draft.model_path names "
                f"{_model(held)}, which drafts in spec mode {' / '.join(map(repr, users))} "
                "(or 'auto')")
    return f"spec mode {mode!r} needs {_model(row.needs)}, and none is loaded (draft.model_path)"
