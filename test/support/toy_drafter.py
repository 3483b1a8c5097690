"""A toy drafter registered from outside the package, as a new kind of drafter would be: it replays
what the target wrote for the last request whose tokens the context continues (a cache of one
answer). Lossless like any drafter (the target verifies every token); a repeated greedy request is
drafted in full."""
from __future__ import annotations

from typing import Any, Sequence, Tuple

from gemma_spec_ros.engine.drafters.base import Draft, Drafter
from gemma_spec_ros.engine.config import SpecConfig


class ReplayDrafter(Drafter):
    """Drafts the continuation of the last finished request, while the context follows it."""

    name = "replay"

    def __init__(self) -> None:
        self.last: Tuple[int, ...] = ()
        self.proposed = 0

    def propose(self, context: Sequence[int], max_tokens: int, spec: SpecConfig = SpecConfig()) -> Draft:
        n = len(context)
        if n >= len(self.last) or tuple(context) != self.last[:n]:
            return Draft()
        self.proposed += 1
        return Draft(self.last[n:n + max_tokens], source=self.name)

    def end(self, tokens: Sequence[int]) -> None:
        self.last = tuple(int(t) for t in tokens)


def build_replay(config: Any, target: Any, n_seq: int) -> ReplayDrafter:
    """The registry's builder: one drafter, whatever the config."""
    return ReplayDrafter()
