"""Adaptive draft length from measured acceptance and a measured cost model.

Speculation pays only when the tokens a verify pass emits outweigh what it costs. With

- ``a_i``: probability that draft position i is accepted given positions 0..i-1 were (measured per
  drafter, decayed so the estimate follows the text),
- ``E(k) = 1 + sum_{j<k} prod_{i<=j} a_i``: expected tokens emitted by a pass over a k-token draft,
- ``V(n)``: measured seconds of one target pass over n rows (``V(1)`` is plain decoding),
- ``D(k)``: measured seconds to draft k tokens,

the predicted speedup of drafting k tokens over plain decoding is

    S(k) = E(k) * V(1) / (D(k) + V(k + 1))

and the policy drafts ``k* = argmax_k S(k)`` for k in 1..K, or nothing when ``S(k*) < 1``.

Worked example (2-core CPU, Gemma 3 270M): V(1) = 26 ms, V(4) = 40 ms, n-gram drafting ~0.1 ms.
With a_i = (0.8, 0.7, 0.6): E(3) = 1 + 0.8 + 0.56 + 0.336 = 2.70, so S(3) = 2.70 * 26 / 40.1 = 1.75.
With a_i = (0.3, 0.2, 0.2): E(3) = 1.37 and S(3) = 0.89, but E(1) = 1.3 and V(2) = 31 ms give
S(1) = 1.09: draft one token. Below a_0 ~ 0.2 no k pays and the policy turns speculation off,
probing again after a growing number of plain steps (hysteresis: off below ``1 - margin``,
on again only above ``1 + margin``).

This is the break-even condition tau > 1 + K*c of the brief with c = draft cost / target cost,
generalised to a verify cost that grows with the batch (it does on a CPU; on a GPU V(k+1) ~ V(1)).

**Cutting each draft.** A drafter whose drafts are free and say what each token rests on
(``Draft.evidence``: n-gram lookup) is not given a length in advance. It drafts up to a longer cap
and :meth:`DraftLengthPolicy.cut` chooses the k of *this* draft: the same S(k), with ``a_i`` the
measured acceptance of token i's evidence class at its position (:class:`EvidenceAcceptance`), so a
draft of unanimous 4-gram matches of the request is verified whole and one of weak matches is cut
short or not verified at all. Every such draft, verified or not, is settled against the tokens the
request then emits (engine/uncut.py) and teaches its classes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple


class CostModel:
    """Measured costs on this device (seconds): target passes and drafting.

    A target pass over n rows is predicted as ``shape[n] * level``. Every observed pass, whatever its
    size, moves the common ``level`` (an exponential moving average of observed / predicted): a
    machine that gets busier or a context that grows longer raises the cost of every size alike.
    The ``shape`` of a size moves only with what the level does not explain, and slowly. So the
    ratios V(k+1) / V(1) the policy compares stay consistent: with one moving average per size (the
    earlier model) the sizes in use followed the load while the others kept older, cheaper
    figures, and the policy drifted to the sizes it had not used lately (short drafts on a busy CPU).
    """

    def __init__(self, smoothing: float = 0.1, shape_smoothing: float = 0.005) -> None:
        self.smoothing = smoothing
        self.shape_smoothing = shape_smoothing
        self._verify: Dict[int, float] = {}  # shape: seconds of an n-row pass at level 1
        self._level = 1.0
        self._draft_per_token: Dict[str, float] = {}

    def _ema(self, table: Dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.smoothing * (value - old)

    def observe_verify(self, n_rows: int, seconds: float) -> None:
        """One target pass over ``n_rows`` tokens (all rows asking for logits) took ``seconds``."""
        base = self._verify.get(n_rows)
        if base is None or base <= 0:
            self._verify[n_rows] = seconds / self._level  # a size seen first: its shape at this level
            return
        self._level *= 1.0 + self.smoothing * (seconds / (base * self._level) - 1.0)
        self._verify[n_rows] = base + self.shape_smoothing * (seconds / self._level - base)

    def observe_draft_time(self, source: str, n_tokens: int, seconds: float) -> None:
        """Drafting ``n_tokens`` (>= 1) with ``source`` took ``seconds`` (catch-up included)."""
        if n_tokens > 0:
            self._ema(self._draft_per_token, source, seconds / n_tokens)

    def verify_cost(self, n_rows: int) -> Optional[float]:
        """Predicted cost of an ``n_rows`` pass: the shape, interpolated linearly between measured
        sizes and extrapolated from the two largest beyond them, times the level; None before any
        measurement."""
        shape = self._shape_cost(n_rows)
        return None if shape is None else shape * self._level

    def _shape_cost(self, n_rows: int) -> Optional[float]:
        table = self._verify
        if not table:
            return None
        if n_rows in table:
            return table[n_rows]
        sizes = sorted(table)
        if len(sizes) == 1:
            return table[sizes[0]] * n_rows / sizes[0] if n_rows > sizes[0] else table[sizes[0]]
        lower = [s for s in sizes if s < n_rows]
        upper = [s for s in sizes if s > n_rows]
        if lower and upper:
            lo, hi = lower[-1], upper[0]
        elif upper:  # below the smallest measured size
            return table[sizes[0]]
        else:
            lo, hi = sizes[-2], sizes[-1]
        slope = max(0.0, (table[hi] - table[lo]) / (hi - lo))
        return table[lo] + slope * (n_rows - lo)

    def draft_cost(self, source: str, n_tokens: int) -> float:
        return self._draft_per_token.get(source, 0.0) * n_tokens

    @property
    def plain_token_time(self) -> float:
        cost = self.verify_cost(1)
        return math.nan if cost is None else cost


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
        soon as the emitted text shows it (engine/uncut.py): waiting for the whole draft to settle
        cost 3% of the replayed speed."""
        key = (evidence, min(position, self.POSITIONS - 1))
        self.tried[key] = self.tried.get(key, 0.0) + 1.0
        self.accepted[key] = self.accepted.get(key, 0.0) + accepted

    def observe(self, evidence: Sequence[Hashable], num_accepted: int) -> None:
        """A draft with this evidence had its first ``num_accepted`` tokens accepted."""
        self.age()
        for position, klass in enumerate(evidence[:num_accepted + 1]):
            self.observe_token(klass, position, position < num_accepted)


@dataclass(frozen=True)
class Decision:
    """What one drafter may do at the next step."""

    draft_len: int  # 0 = plain step
    predicted_speedup: float  # of the chosen length (1.0 for a plain step)


#: A plain step: no draft, plain decoding's speed.
PLAIN_STEP = Decision(0, 1.0)


class DraftLengthPolicy:
    """Chooses how many tokens one drafter may propose at the next step.

    ``adaptive=False`` always drafts ``draft_max`` (still measured, for the stats).

    While off it probes: after ``probe_min`` plain steps it asks for one draft, and the interval
    doubles (up to ``probe_max``) only when a probe was actually verified and did not turn it back
    on. A probe the drafter could not fill (no n-gram match) stays pending. With
    ``probe_new_requests`` (cheap probes: n-gram lookup), ``new_request()`` probes again at once: a new
    prompt is new text, the last one's bad luck says little about it. A draft model's probe is not
    cheap: after plain steps it must first catch up on every token it has not seen (at a new request,
    the whole prompt), so its interval keeps growing across requests.
    """

    def __init__(self, source: str, costs: CostModel, *, margin: float = 0.03,
                 probe_min: int = 8, probe_max: int = 128, probe_new_requests: bool = True) -> None:
        self.source = source
        self.probe_new_requests = probe_new_requests
        self.costs = costs
        self.acceptance = AcceptanceModel()
        self.evidence = EvidenceAcceptance()
        self.margin = margin
        self.probe_min, self.probe_max = probe_min, probe_max
        self.enabled = True
        self._probe_interval = probe_min
        self._steps_off = 0

    def predicted_speedup(self, k: int) -> float:
        """S(k) of the module docstring; NaN when costs are not measured yet."""
        return self._speedup(k, self.acceptance.expected_tokens(k))

    def _speedup(self, k: int, expected_tokens: float) -> float:
        plain = self.costs.verify_cost(1)
        verify = self.costs.verify_cost(k + 1)
        if plain is None or verify is None:
            return math.nan
        return expected_tokens * plain / (self.costs.draft_cost(self.source, k) + verify)

    def best(self, draft_max: int) -> Decision:
        best_k, best_s = 0, 1.0
        expected = self.acceptance.expected_tokens_upto(draft_max)
        for k in range(1, draft_max + 1):
            s = self._speedup(k, expected[k])
            if math.isnan(s):  # nothing measured yet: trust the drafter, draft the most
                return Decision(draft_max, math.nan)
            if s > best_s or best_k == 0:
                best_k, best_s = k, s
        return Decision(best_k, best_s)

    def cut(self, evidence: Sequence[Hashable]) -> Decision:
        """The length to verify of a draft whose tokens rest on ``evidence`` (module docstring):
        argmax S(k) over its prefixes, or 0 when none is predicted faster than plain decoding.
        Costs not measured yet: the whole draft."""
        expected = self.evidence.expected_tokens_upto(evidence)
        best_k, best_s = 0, 1.0
        for k in range(1, len(evidence) + 1):
            s = self._speedup(k, expected[k])
            if math.isnan(s):
                return Decision(len(evidence), math.nan)
            if s > best_s:
                best_k, best_s = k, s
        return Decision(best_k, best_s)

    def decide(self, draft_max: int, adaptive: bool) -> Decision:
        if not adaptive:
            return Decision(draft_max, self.predicted_speedup(draft_max))
        choice = self.best(draft_max)
        speedup = choice.predicted_speedup
        if self.enabled:
            if not math.isnan(speedup) and speedup < 1.0 - self.margin:
                self.enabled = False
                self._steps_off = 0
        elif math.isnan(speedup) or speedup > 1.0 + self.margin:
            self.enabled = True
            self._probe_interval = self.probe_min
        if self.enabled:
            return choice
        self._steps_off += 1
        if self._steps_off >= self._probe_interval:  # look again: the text may have changed
            return Decision(max(1, choice.draft_len), speedup)
        return PLAIN_STEP

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.observe(num_drafted, num_accepted)
        if not self.enabled and self._steps_off >= self._probe_interval:  # a probe was verified
            self._steps_off = 0
            self._probe_interval = min(self.probe_max, self._probe_interval * 2)

    def new_request(self) -> None:
        """A new prompt starts: if off, probe at its first draftable step, then every probe_min."""
        if not self.enabled and self.probe_new_requests:
            self._probe_interval = self.probe_min
            self._steps_off = self._probe_interval
