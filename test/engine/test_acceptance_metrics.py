"""vLLM's per-request acceptance metrics (docs/interfaces.md, SpecStats) computed by the engine agree
with the same figures counted from a scripted run's steps.

A tiny random GGUF pair (test/support/tiny_gguf.py), greedy, ``draft+lookup`` with K fixed. Both
drafters are scripted: at each step the lookup drafter, the draft model or neither drafts, a draft
of a planned length whose first ``a`` tokens are the target's own greedy continuation (known from a
plain run) and whose next token is wrong, so exact verification accepts exactly ``a``. The test
counts from what the drafters returned and what each Step emitted, never from SpecStats:
acceptance histogram, drafted / accepted tokens by source, tau, acceptance rate. A constrained run
(the grammar forces most of the text) checks the same invariants with the grammar's tokens and the
rows verified without logits.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Iterator, List, Tuple

import pytest

from gemma_spec_ros.engine.config import SpecConfig
from gemma_spec_ros.engine.drafters.base import EMPTY_DRAFT, Draft
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.request import GenerationRequest, Step
from gemma_spec_ros.engine.stats import FORCED_SOURCE, SpecStats
from support.engine import build_engine, collect
from support.tiny_gguf import write_tiny_pair

PROMPT = "the robot"
MAX_TOKENS = 60
K = 4
#: (draft length, tokens of it the target accepts), one per draft in turn
PATTERNS = ((4, 4), (4, 1), (4, 0), (2, 2), (3, 1), (1, 0), (4, 3), (2, 0), (4, 2))
#: per step, in turn: who drafts ('' = nobody: a plain step)
TURNS = ("lookup", "draft", "", "draft", "lookup")
#: short forced spans between the target's choices: the drafter continues after most of them
CHOICES_GRAMMAR = 'root ::= (("go" | "stop") " " ("left" | "right") ". ")+'


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    target, draft = write_tiny_pair(tmp_path_factory.mktemp("acceptance"))
    with build_engine(target, draft, n_ctx=256, n_threads=1,
                      spec=SpecConfig(mode="draft+lookup", draft_max=K, adaptive=False, p_min=0.0)) as engine:
        yield engine


def reference(engine: Engine) -> Tuple[List[int], int]:
    """The target's own greedy tokens (mode off: nothing drafted) and the prompt's length."""
    done = collect(engine, GenerationRequest(PROMPT, max_tokens=MAX_TOKENS, spec_mode="off"))
    assert len(done.tokens) == MAX_TOKENS, "the reference ended early: the script needs every token"
    return done.tokens, done.stats.num_prompt_tokens


class Script:
    """Both drafters of the engine, scripted (see the module docstring); what each returned is kept
    by context length: ``drafts[len(context)] = (source, tokens)``."""

    def __init__(self, engine: Engine, ref: List[int], n_prompt: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ref, self.n_prompt, self.turn, self.n_drafts = ref, n_prompt, -1, 0
        self.drafts: Dict[int, Tuple[str, Tuple[int, ...]]] = {}  # context = prompt + emitted tokens
        for name in ("lookup", "draft"):
            monkeypatch.setattr(engine.drafters[name].drafter, "propose", self._proposer(name))

    def _proposer(self, name: str):
        def propose(context, max_tokens, spec=None) -> Draft:
            if name == "lookup":  # asked first at every step
                self.turn += 1
            if TURNS[self.turn % len(TURNS)] != name:
                return EMPTY_DRAFT
            length, accepted = PATTERNS[self.n_drafts % len(PATTERNS)]
            length = min(length, max_tokens)
            accepted = min(accepted, length)
            n = len(context) - self.n_prompt  # tokens emitted before this step
            right = self.ref[n:n + accepted]
            wrong = [] if accepted == length else [5 if self.ref[n + accepted] == 4 else 4] * (length - accepted)
            tokens = tuple(right + wrong)
            self.n_drafts += 1
            self.drafts[len(context)] = (name, tokens)
            return Draft(tokens, None, name)
        return propose


def run_scripted(engine: Engine, ref: Tuple[List[int], int],
                 monkeypatch: pytest.MonkeyPatch) -> Tuple[List[Step], Script]:
    script = Script(engine, *ref, monkeypatch)
    steps = collect(engine, GenerationRequest(PROMPT, max_tokens=MAX_TOKENS)).steps
    monkeypatch.undo()
    return steps, script


def counted_from_steps(steps: List[Step], script: Script) -> Dict[str, object]:
    """The acceptance figures from the drafts the script returned and the tokens each step emitted."""
    n_prompt = steps[-1].stats.num_prompt_tokens
    assert script.n_prompt == n_prompt
    drafts = {length - n_prompt: draft for length, draft in script.drafts.items()}
    histogram: List[int] = []
    drafted: Dict[str, int] = {}
    accepted_by: Dict[str, int] = {}
    per_step: List[int] = []  # accepted tokens of each step with a draft, -1 for the others
    emitted_per_drafted_step: List[int] = []
    emitted = 0
    for index, step in enumerate(steps):
        draft = drafts.get(emitted) if index > 0 else None  # step 0: the prompt pass's token
        if draft is None:
            per_step.append(-1)
        else:
            source, tokens = draft
            accepted = 0
            while accepted < len(tokens) and tokens[accepted] == step.tokens[accepted]:
                accepted += 1
            assert len(step.tokens) == accepted + 1, (index, tokens, step.tokens)  # + recovered / bonus
            histogram.extend([0] * (len(tokens) + 1 - len(histogram)))
            histogram[accepted] += 1
            drafted[source] = drafted.get(source, 0) + len(tokens)
            accepted_by[source] = accepted_by.get(source, 0) + accepted
            per_step.append(accepted)
            emitted_per_drafted_step.append(len(step.tokens))
        emitted += len(step.tokens)
    assert len(drafts) == len(emitted_per_drafted_step), "a scripted draft was never verified"
    return {"histogram": histogram, "drafted": drafted, "accepted": accepted_by, "per_step": per_step,
            "emitted_per_drafted_step": emitted_per_drafted_step}


def check_invariants(stats: SpecStats) -> None:
    """vLLM's identities between the histogram, the counts by source and the totals."""
    h = stats.acceptance_histogram
    assert sum(h) == stats.num_drafts
    assert sum(i * n for i, n in enumerate(h)) == stats.num_accepted_tokens
    assert len(h) == (len(stats.drafted_at) + 1 if stats.num_drafts else 0)  # 0..the longest draft
    kinds = stats.tokens_by_kind()
    assert sum(d for d, _ in kinds.values()) == stats.num_draft_tokens
    assert sum(a for _, a in kinds.values()) == stats.num_accepted_tokens
    assert kinds[FORCED_SOURCE] == (stats.num_grammar_draft_tokens, stats.num_grammar_accepted_tokens)
    assert sum(stats.draft_tokens_by_source.values()) == stats.num_draft_tokens
    if stats.num_drafts:
        assert stats.mean_acceptance_length == pytest.approx(
            sum(i * n for i, n in enumerate(h)) / sum(h) + 1)


def test_histogram_sources_and_tau_agree_with_the_steps(engine: Engine,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    ref = reference(engine)
    steps, script = run_scripted(engine, ref, monkeypatch)
    assert [t for s in steps for t in s.tokens] == ref[0]  # lossless, whatever the drafts
    stats = steps[-1].stats
    counted = counted_from_steps(steps, script)

    assert stats.acceptance_histogram == counted["histogram"]
    assert stats.draft_tokens_by_source == counted["drafted"]
    assert stats.accepted_tokens_by_source == counted["accepted"]
    kinds = stats.tokens_by_kind()
    assert kinds["lookup"] == (counted["drafted"]["lookup"], counted["accepted"]["lookup"])
    assert kinds["model"] == (counted["drafted"]["draft"], counted["accepted"]["draft"])
    assert kinds["suffix"] == kinds[FORCED_SOURCE] == (0, 0)
    # tau: the tokens a step with a draft emitted, on average (vLLM's mean acceptance length)
    per_drafted_step = counted["emitted_per_drafted_step"]
    assert stats.mean_acceptance_length == pytest.approx(sum(per_drafted_step) / len(per_drafted_step))
    n_accepted = sum(a for a in counted["per_step"] if a >= 0)
    assert stats.num_drafts == len(per_drafted_step) and stats.num_accepted_tokens == n_accepted
    assert stats.acceptance_rate == pytest.approx(n_accepted / sum(counted["drafted"].values()))
    check_invariants(stats)
    # every pattern of the script was verified: 0..K accepted all seen, plain steps too
    assert len(stats.acceptance_histogram) == K + 1 and all(stats.acceptance_histogram)
    assert -1 in counted["per_step"][1:]

    # step by step: each snapshot's histogram moved by one at the step's accepted count, or not at all
    for before, after, accepted in zip(steps, steps[1:], counted["per_step"][1:]):
        h0, h1 = before.stats.acceptance_histogram, after.stats.acceptance_histogram
        delta = [b - (h0[i] if i < len(h0) else 0) for i, b in enumerate(h1)]
        assert delta == [int(i == accepted) for i in range(len(h1))], (accepted, h0, h1)
        check_invariants(after.stats)


def test_rolling_stats_add_histograms_of_different_lengths(engine: Engine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests, K 4 then K 2 (a histogram of 3 cells): the engine's lifetime stats hold their
    element-wise sum, and the counts by source add up."""
    ref = reference(engine)
    before = engine.rolling_stats()
    first = run_scripted(engine, ref, monkeypatch)[0][-1].stats
    spec = engine.spec
    engine.update_spec(SpecConfig(mode="draft+lookup", draft_max=2, adaptive=False, p_min=0.0))
    try:
        second = run_scripted(engine, ref, monkeypatch)[0][-1].stats
    finally:
        engine.update_spec(spec)
    rolling = engine.rolling_stats()
    assert len(first.acceptance_histogram) == K + 1 and len(second.acceptance_histogram) == 3
    expected = list(before.acceptance_histogram) + [0] * (K + 1 - len(before.acceptance_histogram))
    for part in (first, second):
        for i, n in enumerate(part.acceptance_histogram):
            expected[i] += n
    assert rolling.acceptance_histogram == expected
    for source in ("lookup", "draft"):
        assert rolling.draft_tokens_by_source[source] == (before.draft_tokens_by_source.get(source, 0)
                                                          + first.draft_tokens_by_source[source]
                                                          + second.draft_tokens_by_source[source])
    check_invariants(rolling)


def test_a_constrained_run_counts_the_grammars_tokens_and_the_drafters_apart(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a grammar that forces most of the text, the lookup drafter scripted to continue after the
    forced text with the constrained output's next two tokens and then a wrong one: a verified
    draft is the forced tokens (counted under the grammar: num_grammar_draft_tokens) and then the
    drafter's (under lookup), its refused tokens cut before verification (num_grammar_cut_tokens,
    in neither). Per step, the histogram cell and the tokens by source move as the emitted tokens
    say; some rows were verified without logits."""
    request = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS, grammar=CHOICES_GRAMMAR)
    plain = collect(engine, replace(request, spec_mode="off"))
    cref, n_prompt = plain.tokens, plain.stats.num_prompt_tokens
    returned: List[int] = []

    def propose(context, max_tokens, spec=None) -> Draft:
        n = len(context) - n_prompt  # emitted + forced tokens
        right = cref[n:n + min(2, max_tokens)]
        tokens = right + [4 if cref[n + len(right)] != 4 else 5]  # then a wrong one (refused or rejected)
        tokens = tokens[:max_tokens]
        returned.append(len(tokens))
        return Draft(tuple(tokens), None, "lookup")

    monkeypatch.setattr(engine.drafters["lookup"].drafter, "propose", propose)
    steps = collect(engine, replace(request, spec_mode="lookup")).steps
    monkeypatch.undo()
    assert [t for s in steps for t in s.tokens] == cref
    stats = steps[-1].stats
    assert stats.num_grammar_draft_tokens > 0 and stats.num_grammar_sole_rows > 0
    kinds = stats.tokens_by_kind()
    assert kinds[FORCED_SOURCE] == (stats.num_grammar_draft_tokens, stats.num_grammar_accepted_tokens)
    assert kinds["lookup"][0] > 0 and kinds["model"] == kinds["suffix"] == (0, 0)
    assert sum(returned) == kinds["lookup"][0] + stats.num_grammar_cut_tokens  # verified + cut
    check_invariants(stats)
    mixed = 0
    for before, after in zip(steps, steps[1:]):
        b, a = before.stats, after.stats
        if a.num_drafts == b.num_drafts:
            assert a.acceptance_histogram == b.acceptance_histogram
            continue
        accepted = len(after.tokens) - 1  # + the recovered or bonus token
        h0, h1 = b.acceptance_histogram, a.acceptance_histogram
        delta = [n - (h0[i] if i < len(h0) else 0) for i, n in enumerate(h1)]
        assert delta == [int(i == accepted) for i in range(len(h1))], (after.tokens, h0, h1)
        forced = a.num_grammar_draft_tokens - b.num_grammar_draft_tokens
        own = (a.num_draft_tokens - b.num_draft_tokens) - forced
        moved = {kind: (d - db, n - nb) for (kind, (d, n)), (db, nb)
                 in zip(a.tokens_by_kind().items(), b.tokens_by_kind().values())}
        assert moved[FORCED_SOURCE] == (forced, min(forced, accepted))
        assert moved["lookup"] == (own, max(0, accepted - forced))
        mixed += forced > 0 and own > 0
    assert mixed > 0, "no draft had both forced and drafted tokens: the split went untested"
