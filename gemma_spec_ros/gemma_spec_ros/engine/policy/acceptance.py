"""Measured acceptance: per draft position, and per evidence class of a drafted token."""
from __future__ import annotations

from typing import Dict, Hashable, List, Sequence, Tuple


class AcceptanceModel:
    """Conditional acceptance per draft position with a Beta prior, decayed over time.

    ``tried[i]``: drafts that reached position i with positions 0..i-1 accepted;
    ``accepted[i]``: those that also accepted position i.
    a_i = (accepted[i] + w * m_i) / (tried[i] + w) with prior weight w and prior mean m_0 =
    ``prior_acceptance``, m_i = a_{i-1} for deeper positions: a position never reached yet is assumed
    as good as the one before it, so a drafter that is always right at position 0 gets tried at
    position 1 (a fixed 0.5 there would keep the policy at one-token drafts forever).
    """

    def __init__(self, max_positions: int = 64, prior_acceptance: float = 0.5, prior_weight: float = 2.0,
                 decay: float = 0.98) -> None:
        self.tried: List[float] = [0.0] * max_positions
        self.accepted: List[float] = [0.0] * max_positions
        self.prior_mean = prior_acceptance
        self.prior_n = prior_weight
        self.decay = decay
        self._reached = 0  # positions past this one were never tried: zeros, nothing to decay

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        d, reached = self.decay, self._reached
        tried, accepted = self.tried, self.accepted
        for i in range(reached):
            tried[i] *= d
            accepted[i] *= d
        for i in range(min(num_accepted + 1, num_drafted)):
            tried[i] += 1.0
            if i < num_accepted:
                accepted[i] += 1.0
        self._reached = max(reached, min(num_accepted + 1, num_drafted, len(tried)))

    def conditional(self, k: int) -> List[float]:
        out: List[float] = []
        mean = self.prior_mean
        for i in range(k):
            mean = (self.accepted[i] + self.prior_n * mean) / (self.tried[i] + self.prior_n)
            out.append(mean)
        return out

    def expected_tokens(self, k: int) -> float:
        """E(k) = 1 + sum_j prod_{i<=j} a_i: tokens a pass over a k-token draft emits on average."""
        return self.expected_tokens_upto(k)[-1]

    def expected_tokens_upto(self, k: int) -> List[float]:
        """[E(0), E(1), ..., E(k)] in one pass (the policy compares every k each step)."""
        out, survive = [1.0], 1.0
        for a in self.conditional(k):
            survive *= a
            out.append(out[-1] + survive)
        return out


class EvidenceAcceptance:
    """Acceptance per (evidence class, position 0 / 1 / 2+) of draft tokens, decayed.

    a(class, i) = (accepted + w * prior) / (tried + w); a token counts as tried when every token
    before it in its draft was accepted. Tuned on the replay of 71 prompts (scripts/lookup_replay.py,
    docs/benchmarks.md): decay 0.95 per settled draft, prior 0.5 with weight 2.
    """

    POSITIONS = 3  # positions 2 and beyond share one estimate

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.95) -> None:
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.tried: Dict[Tuple[Hashable, int], float] = {}
        self.accepted: Dict[Tuple[Hashable, int], float] = {}

    def rate(self, evidence: Hashable, position: int) -> float:
        key = (evidence, min(position, self.POSITIONS - 1))
        return ((self.accepted.get(key, 0.0) + self.prior_weight * self.prior)
                / (self.tried.get(key, 0.0) + self.prior_weight))

    def expected_tokens_upto(self, evidence: Sequence[Hashable]) -> List[float]:
        """[E(0), E(1), ..., E(len(evidence))] of a draft whose tokens have this evidence."""
        out, survive = [1.0], 1.0
        for position, klass in enumerate(evidence):
            survive *= self.rate(klass, position)
            out.append(out[-1] + survive)
        return out

    def age(self) -> None:
        """One more draft: older evidence weighs ``decay`` times less."""
        d = self.decay
        for key in self.tried:
            self.tried[key] *= d
            self.accepted[key] *= d

    def observe_token(self, evidence: Hashable, position: int, accepted: bool) -> None:
        """Token ``position`` of a draft, every token before it right, was right or not. Told as
        soon as the emitted text shows it (engine/policy/hindsight.py): waiting for the whole draft to settle
        cost 3% of the replayed speed."""
        key = (evidence, min(position, self.POSITIONS - 1))
        self.tried[key] = self.tried.get(key, 0.0) + 1.0
        self.accepted[key] = self.accepted.get(key, 0.0) + accepted

    def observe(self, evidence: Sequence[Hashable], num_accepted: int) -> None:
        """A draft with this evidence had its first ``num_accepted`` tokens accepted."""
        self.age()
        for position, klass in enumerate(evidence[:num_accepted + 1]):
            self.observe_token(klass, position, position < num_accepted)


class PooledEvidenceAcceptance(EvidenceAcceptance):
    """:class:`EvidenceAcceptance` whose sparse classes lean on pooled estimates, not a fixed prior.

    a(class, i) = (accepted + w * a(class)) / (tried + w), where a(class) pools the class over all
    positions and leans the same way on a(all), the drafter's rate over every class, which leans on
    the fixed prior. A class seen a few times is then estimated as the drafter's tokens in general,
    not as a coin (0.5): with four evidence bits (the suffix drafter's, drafters/suffix.py) the fixed
    prior kept the many rarely seen classes near 0.5 and cut drafts short. Replayed on the planner
    trace (bench.trace_replay, pass costs fitted on its timed run), the suffix drafter's two bits:
    1.53x plain with the fixed prior at decay 0.95, 1.57x pooled at 0.99; four bits: 1.48x fixed,
    1.62x pooled at 0.99.
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.99) -> None:
        super().__init__(prior, prior_weight, decay)
        self.class_tried: Dict[Hashable, float] = {}
        self.class_accepted: Dict[Hashable, float] = {}
        self.all_tried = self.all_accepted = 0.0

    def rate(self, evidence: Hashable, position: int) -> float:
        w = self.prior_weight
        overall = (self.all_accepted + w * self.prior) / (self.all_tried + w)
        pooled = ((self.class_accepted.get(evidence, 0.0) + w * overall)
                  / (self.class_tried.get(evidence, 0.0) + w))
        key = (evidence, min(position, self.POSITIONS - 1))
        return (self.accepted.get(key, 0.0) + w * pooled) / (self.tried.get(key, 0.0) + w)

    def age(self) -> None:
        super().age()
        d = self.decay
        for key in self.class_tried:
            self.class_tried[key] *= d
            self.class_accepted[key] *= d
        self.all_tried *= d
        self.all_accepted *= d

    def observe_token(self, evidence: Hashable, position: int, accepted: bool) -> None:
        super().observe_token(evidence, position, accepted)
        self.class_tried[evidence] = self.class_tried.get(evidence, 0.0) + 1.0
        self.class_accepted[evidence] = self.class_accepted.get(evidence, 0.0) + accepted
        self.all_tried += 1.0
        self.all_accepted += accepted
