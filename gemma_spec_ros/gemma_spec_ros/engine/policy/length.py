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

This is the break-even condition tau > 1 + K*c of speculative decoding with c = draft cost / target cost,
generalised to a verify cost that grows with the batch (it does on a CPU; on a GPU V(k+1) ~ V(1)).

**Sharing a pass.** When several requests run at once their rows go into one target pass
(engine/slots.py). A request then chooses k for the pass it joins: with ``R`` rows and ``E_o``
expected tokens of the other requests already in it (:class:`PassShare`), the pass emits
``E(k) + E_o`` tokens in ``D(k) + V(R + 1 + k)`` seconds, against ``1 + E_o`` in ``V(R + 1)`` without
a draft, so

    S(k) = (E(k) + E_o) * V(R + 1) / ((1 + E_o) * (D(k) + V(R + 1 + k)))

which is the S(k) above when the pass is the request's alone (R = 0, E_o = 0).

**Cutting each draft.** A drafter whose drafts are free and say what each token rests on
(``Draft.evidence``: n-gram lookup) is not given a length in advance. It drafts up to a longer cap
and :meth:`DraftLengthPolicy.cut` chooses the k of *this* draft: the same S(k), with ``a_i`` the
measured acceptance of token i's evidence class at its position (:class:`EvidenceAcceptance`), so a
draft of unanimous 4-gram matches of the request is verified whole and one of weak matches is cut
short or not verified at all. Every such draft, verified or not, is settled against the tokens the
request then emits (engine/policy/hindsight.py) and teaches its classes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, Sequence, Tuple

from .acceptance import AcceptanceModel, EvidenceAcceptance, PooledEvidenceAcceptance
from .costs import CostModel


@dataclass(frozen=True)
class Decision:
    """What one drafter may do at the next step."""

    draft_len: int  # 0 = plain step
    predicted_speedup: float  # of the chosen length (1.0 for a plain step)
    expected_tokens: float = 1.0  # the tokens the step is predicted to emit (E(draft_len))


#: A plain step: no draft, plain decoding's speed.
PLAIN_STEP = Decision(0, 1.0)

#: How a drafter's evidence classes are learned, by drafter name (Drafter.name); the others use
#: :class:`EvidenceAcceptance` (tuned on n-gram lookup). The suffix drafter's four evidence bits
#: make many sparse classes: they lean on pooled estimates, with a longer memory (its history
#: changes slowly).
EVIDENCE_MODELS: Dict[str, Callable[[], EvidenceAcceptance]] = {"suffix": PooledEvidenceAcceptance}


@dataclass(frozen=True)
class PassShare:
    """What else the target pass a step joins holds (module docstring, "Sharing a pass"): the rows
    of the other requests and the tokens they are expected to emit."""

    rows: int = 0
    expected_tokens: float = 0.0


#: A pass of one request alone.
SOLO = PassShare()


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
        self.evidence = EVIDENCE_MODELS.get(source, EvidenceAcceptance)()
        self.margin = margin
        self.probe_min, self.probe_max = probe_min, probe_max
        self.enabled = True
        self._probe_interval = probe_min
        self._steps_off = 0

    def best(self, draft_max: int, share: PassShare = SOLO) -> Decision:
        """argmax S(k) for k in 1 .. ``draft_max`` (``draft_max`` while costs are not measured)."""
        return self._choices(draft_max, share)[0]

    def _choices(self, draft_max: int, share: PassShare) -> Tuple[Decision, Decision]:
        """(the best length, ``draft_max`` itself) as decisions, from one pricing of every k."""
        expected = self.acceptance.expected_tokens_upto(draft_max)
        speedups = self.costs.speedups(self.source, expected, rows=share.rows, others=share.expected_tokens)
        whole = Decision(draft_max, speedups[draft_max], expected[draft_max])
        best_k, best_s = 0, 1.0
        for k in range(1, draft_max + 1):
            s = speedups[k]
            if math.isnan(s):  # nothing measured yet: trust the drafter, draft the most
                return whole, whole
            if s > best_s or best_k == 0:
                best_k, best_s = k, s
        return Decision(best_k, best_s, expected[best_k]), whole

    def cut(self, evidence: Sequence[Hashable], forced: int = 0, share: PassShare = SOLO) -> Decision:
        """The length to verify of a draft whose tokens rest on ``evidence`` (module docstring):
        argmax S(k) over its prefixes, or 0 when none is predicted faster than plain decoding (with
        ``forced`` tokens a grammar forces before the draft: than verifying those alone). Costs not
        measured yet: the whole draft."""
        expected = self.evidence.expected_tokens_upto(evidence)
        speedups = self.costs.speedups(self.source, expected, rows=share.rows, others=share.expected_tokens,
                                       forced=forced)
        best_k, best_s = 0, (speedups[0] if forced else 1.0)
        for k in range(1, len(evidence) + 1):
            s = speedups[k]
            if math.isnan(s):
                return Decision(len(evidence), math.nan, expected[len(evidence)])
            if s > best_s:
                best_k, best_s = k, s
        return Decision(best_k, best_s, expected[best_k])

    def decide(self, draft_max: int, adaptive: bool, share: PassShare = SOLO) -> Decision:
        """The next step's length: ``draft_max`` when not ``adaptive``, else :meth:`best`, with the
        hysteresis and the probes of the class docstring."""
        choice, whole = self._choices(draft_max, share)
        if not adaptive:
            return whole
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
