"""SuffixDrafter: drafts from the longest earlier occurrence of the context's end, in the request and
in a bounded, persisted history of earlier outputs (scripted tokens, then the embedded model's)."""
from __future__ import annotations

import doctest
from pathlib import Path
from typing import Sequence

import pytest

from gemma_spec_ros.engine.drafters import suffix, suffix_history
from gemma_spec_ros.engine.drafters.suffix import SuffixConfig, SuffixDrafter
from gemma_spec_ros.engine.drafters.base import EMPTY_DRAFT
from gemma_spec_ros.engine.errors import CacheFormatError
from gemma_spec_ros.tools import lookup_create

TAG = "vocab-1-262144-" + "ab" * 20
PLAN = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]  # an earlier answer


def run_request(drafter: SuffixDrafter, prompt: Sequence[int], output: Sequence[int]) -> None:
    """One request whose output is ``output`` (drafts asked at every token, as the engine would)."""
    drafter.begin(prompt)
    for i in range(len(output)):
        drafter.propose(list(prompt) + list(output[:i + 1]), 8)
    drafter.end(list(prompt) + list(output))


def test_module_doctests() -> None:
    result = doctest.testmod(suffix)
    assert result.attempted > 0 and result.failed == 0


def test_an_earlier_output_is_drafted_from_a_long_match() -> None:
    drafter = SuffixDrafter(SuffixConfig(match_factor=0))
    run_request(drafter, [1, 2, 3], PLAN)
    drafter.begin([1, 2, 9])  # a new request that starts the same answer
    draft = drafter.propose([1, 2, 9, 40, 41, 42, 43], 5)
    assert draft.tokens == (44, 45, 46, 47, 48) and draft.source == "suffix"
    assert draft.evidence == (("history", True, False, True),) * 5  # one occurrence, nothing else after 2 tokens


def test_the_prompt_is_drafted_from_and_marked_as_the_request() -> None:
    drafter = SuffixDrafter(SuffixConfig(match_factor=0))
    prompt = [7, 8, 9, 10, 11, 7, 8]
    drafter.begin(prompt)
    draft = drafter.propose(prompt, 3)
    assert draft.tokens == (9, 10, 11) and {e[0] for e in draft.evidence} == {"request"}


def test_the_draft_grows_with_the_match_length() -> None:
    drafter = SuffixDrafter(SuffixConfig(match_factor=1.0))
    run_request(drafter, [1], PLAN)
    drafter.begin([2])
    assert len(drafter.propose([2, 40], 12)) == 1
    assert len(drafter.propose([2, 40, 41, 42, 43], 12)) == 4
    assert len(drafter.propose([2] + PLAN[:8], 12)) == 2  # the answer ends: nothing follows 49


def test_a_split_vote_lowers_the_probability_and_stops_the_draft() -> None:
    drafter = SuffixDrafter(SuffixConfig(match_factor=0, min_token_probability=0.4))
    for tail in ([5, 6, 7], [5, 6, 8], [5, 9, 9]):
        run_request(drafter, [1], [30, 31] + tail)
    drafter.begin([2])
    draft = drafter.propose([2, 30, 31], 8)
    assert draft.tokens == (5, 6)  # 5: 3 of 3; 6: 2 of 3 (p 0.67); then 8 or 7: p 0.33 < 0.4
    assert [unanimous for _, unanimous, _, _ in draft.evidence] == [True, False]
    assert [supported for _, _, supported, _ in draft.evidence] == [True, True]  # 3 and 2 occurrences
    assert drafter.propose([2, 30, 31, 5, 6], 8).tokens == (8,)  # a tie: the newest answer wins


def test_the_last_evidence_bit_says_whether_the_short_context_was_always_followed_so() -> None:
    """Two answers share the structure "1 2 <value> 3 4" with different values: after a long match
    the value is unanimous (one occurrence), but "1 2" was followed by both values; "3 4" after
    either value only by 5."""
    drafter = SuffixDrafter(SuffixConfig(match_factor=0))
    run_request(drafter, [9], [20, 1, 2, 30, 3, 4, 5])
    run_request(drafter, [9], [21, 1, 2, 31, 3, 4, 5])
    drafter.begin([8])
    draft = drafter.propose([8, 21, 1, 2], 4)
    assert draft.tokens == (31, 3, 4, 5)
    assert [agrees for _, _, _, agrees in draft.evidence] == [False, True, True, True]
    assert all(unanimous for _, unanimous, _, _ in draft.evidence)


def test_nothing_to_draft_without_any_match() -> None:
    drafter = SuffixDrafter(SuffixConfig())
    drafter.begin([1, 2, 3])
    assert drafter.propose([1, 2, 3], 8) == EMPTY_DRAFT
    assert drafter.propose([1, 2, 3, 4], 0) == EMPTY_DRAFT


def test_tokens_taken_back_are_taken_out_of_the_index() -> None:
    """Under a grammar the context of a step ends with forced text drafted ahead; if the request
    went another way, the next context is not an extension of it."""
    taken_back = SuffixDrafter(SuffixConfig(match_factor=0))
    fresh = SuffixDrafter(SuffixConfig(match_factor=0))
    for drafter in (taken_back, fresh):
        run_request(drafter, [1], PLAN)
    prompt = [2, 40, 41]
    taken_back.begin(prompt)
    taken_back.propose(prompt + [42, 43, 44, 60, 61], 4)  # drafted ahead, then refused
    fresh.begin(prompt)
    assert taken_back.propose(prompt + [42, 70], 4) == EMPTY_DRAFT  # "70" was never seen
    assert taken_back.propose(prompt + [42, 43], 4).tokens == (44, 45, 46, 47)  # not "60 61"
    fresh.propose(prompt + [42, 70], 4)
    for tail in ([42, 43, 44], [42, 43, 44, 45, 46, 47, 48]):
        assert taken_back.propose(prompt + tail, 4) == fresh.propose(prompt + tail, 4)
    assert taken_back.request_index.sequences() == fresh.request_index.sequences() == [prompt + tail]
    assert taken_back.index.sequences() == fresh.index.sequences() == [PLAN]


def test_the_next_request_keeps_the_prompt_it_shares_and_drafts_as_a_fresh_drafter() -> None:
    """A planner resends one long system prompt: the request's index keeps the tokens the new
    context shares with the last request's text and takes back the rest (the old instruction and
    output, which are in the history now), so its drafts are those of a drafter that never saw
    the earlier request's text as its own."""
    system = list(range(100, 140))
    kept, fresh = SuffixDrafter(SuffixConfig(match_factor=0)), SuffixDrafter(SuffixConfig(match_factor=0))
    run_request(kept, system + [1, 2], PLAN)
    fresh.end([])  # nothing learned
    run_request(fresh, [9], PLAN)  # the same history
    for drafter in (kept, fresh):
        drafter.begin(system + [3])
    assert kept.propose(system + [3, 40, 41], 4) == fresh.propose(system + [3, 40, 41], 4)
    assert kept.request_index.sequences() == [system + [3, 40, 41]]
    assert kept.request_index.end == len(system) + 3
    assert kept.index.sequences() == fresh.index.sequences() == [PLAN]


def test_only_outputs_join_the_history_unless_prompts_are_kept() -> None:
    outputs_only = SuffixDrafter(SuffixConfig())
    with_prompts = SuffixDrafter(SuffixConfig(keep_prompts=True))
    for drafter in (outputs_only, with_prompts):
        run_request(drafter, [1, 2, 3], [4, 5])
    assert outputs_only.index.sequences() == [[4, 5]]
    assert with_prompts.index.sequences() == [[1, 2, 3, 4, 5]]
    assert outputs_only.history_tokens == 2


def test_a_request_that_ended_before_its_prompt_pass_teaches_nothing() -> None:
    """The engine ends every drafter's request, also one stopped before the prompt pass began them
    (cancelled between two prompt chunks): no part of that prompt joins the history."""
    drafter = SuffixDrafter(SuffixConfig())
    run_request(drafter, [1, 2, 3], [4, 5])
    drafter.end([7, 8, 9, 10, 11])  # no begin()
    assert drafter.index.sequences() == [[4, 5]]


def test_the_history_cap_evicts_the_oldest_outputs_first() -> None:
    drafter = SuffixDrafter(SuffixConfig(history_max_tokens=25, match_factor=0))
    for first in range(10, 60, 10):  # five answers of 5 tokens: 5 x 5 + 4 separators > 25
        run_request(drafter, [1], list(range(first, first + 5)))
    assert drafter.history_tokens <= 25
    assert drafter.index.sequences()[-1] == [50, 51, 52, 53, 54]
    assert [10, 11, 12, 13, 14] not in drafter.index.sequences()
    drafter.begin([2])
    assert drafter.propose([2, 10, 11], 3) == EMPTY_DRAFT  # the oldest answer is gone
    assert drafter.propose([2, 50, 51], 3).tokens == (52, 53, 54)


def test_a_request_longer_than_its_room_keeps_its_newest_tokens_and_evicts_no_history() -> None:
    drafter = SuffixDrafter(SuffixConfig(history_max_tokens=10, match_factor=0), request_room=4)
    run_request(drafter, [1], [5, 6, 7])
    run_request(drafter, list(range(100, 130)), [8, 9])  # 32 tokens in a request ring of 4
    assert drafter.index.sequences() == [[5, 6, 7], [8, 9]]
    assert drafter.request_index.sequences() == [[128, 129, 8, 9]]  # the last context's newest tokens
    drafter.begin([2])  # shares nothing with what the ring still holds: indexed anew
    assert drafter.propose([2, 5], 2).tokens == (6, 7)
    assert drafter.request_index.sequences() == [[2, 5]]


# ------------------------------------------------------------------------------------ the file
def test_the_history_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "suffix.bin"
    config = SuffixConfig(history_path=str(path), cache_dir=str(tmp_path / "cache"), match_factor=0)
    first = SuffixDrafter(config, vocab_tag=TAG)
    run_request(first, [1], PLAN)
    first.close()
    assert suffix_history.load(path, TAG) == [PLAN]
    second = SuffixDrafter(config, vocab_tag=TAG)
    second.begin([2])
    assert second.propose([2, 40, 41, 42], 3).tokens == (43, 44, 45)
    stamp = path.stat().st_mtime_ns, path.stat().st_ino
    second.end([2])  # an empty output: nothing learned
    second.close()
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == stamp  # not rewritten for nothing


def test_a_slot_drafter_has_its_own_request_and_shares_the_history(tmp_path: Path) -> None:
    """Two requests at once (Drafter.for_slot): each drafts its own prompt as the request, not the
    other's; what either leaves joins the one history at once, and the owner saves it at close
    (the slot's drafter saves nothing)."""
    path = tmp_path / "history.bin"
    owner = SuffixDrafter(SuffixConfig(match_factor=0, history_path=str(path), cache_dir=str(tmp_path)),
                          vocab_tag=TAG)
    slot = owner.for_slot(1)
    owner.begin([7, 8, 9, 10, 7, 8])
    slot.begin([20, 21, 22, 23, 20, 21])
    assert owner.propose([7, 8, 9, 10, 7, 8], 2).tokens == (9, 10)
    assert slot.propose([20, 21, 22, 23, 20, 21], 2).tokens == (22, 23)
    assert slot.propose([20, 21, 22, 23, 20, 21, 7, 8], 2) is EMPTY_DRAFT  # the owner's request is not its
    slot.end([20, 21, 22, 23, 20, 21] + PLAN)
    assert owner.history_tokens > 0 and slot.history_tokens == owner.history_tokens
    assert owner.propose([7, 8, 9, 10, 7, 8, 40, 41, 42], 3).tokens == (43, 44, 45)  # the slot's answer
    slot.close()
    assert not path.exists()
    owner.end([7, 8, 9, 10, 7, 8, 40, 41, 42])
    owner.close()
    again = SuffixDrafter(SuffixConfig(match_factor=0, history_path=str(path), cache_dir=str(tmp_path)),
                          vocab_tag=TAG)
    again.begin([1])
    assert again.propose([1, 40, 41, 42, 43], 3).tokens == (44, 45, 46)


def test_a_damaged_history_is_moved_aside_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "suffix.bin"
    suffix_history.save([PLAN], path, TAG)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    drafter = SuffixDrafter(SuffixConfig(history_path=str(path)), vocab_tag=TAG)
    assert drafter.history_tokens == 0 and len(drafter.warnings) == 1
    assert "checksum" in drafter.warnings[0] and "moved it to" in drafter.warnings[0]
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(data) and not path.exists()


def test_a_foreign_or_other_vocabulary_file_fails_construction_and_is_left_untouched(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"not a history\n")
    other = tmp_path / "other.bin"
    suffix_history.save([PLAN], other, "vocab-1-49152-" + "cd" * 20)
    for path in (notes, other):
        before = path.read_bytes()
        with pytest.raises(CacheFormatError):
            SuffixDrafter(SuffixConfig(history_path=str(path)), vocab_tag=TAG)
        assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "other.bin"]


def test_a_failed_periodic_save_is_kept_for_the_owner_and_fails_no_request(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    drafter = SuffixDrafter(SuffixConfig(history_path=str(folder / "suffix.bin"), save_period=1e-9),
                            vocab_tag=TAG)
    folder.rmdir()
    run_request(drafter, [1], [2, 3])  # the save after it fails: the folder is gone
    fault = drafter.take_fault()
    assert fault is not None and "saving the suffix history failed" in fault and drafter.take_fault() is None


def test_the_history_folder_is_created_only_inside_the_cache_folder(tmp_path: Path) -> None:
    inside = tmp_path / "home" / ".cache" / "gemma" / "suffix.bin"
    SuffixDrafter(SuffixConfig(history_path=str(inside), cache_dir=str(tmp_path / "home" / ".cache")))
    assert inside.parent.is_dir() and oct(inside.parent.stat().st_mode & 0o777) == "0o700"
    with pytest.raises(ValueError, match="outside the cache folder"):
        SuffixConfig(history_path=str(tmp_path / "elsewhere" / "s.bin"), cache_dir=str(tmp_path / "home"))
    with pytest.raises(CacheFormatError, match="does not exist"):
        SuffixDrafter(SuffixConfig(history_path=str(tmp_path / "missing" / "s.bin")))


@pytest.mark.parametrize("field,value", [("history_max_tokens", -1), ("max_match", 0), ("max_occurrences", 0),
                                         ("min_token_probability", 1.5), ("match_factor", -1.0),
                                         ("save_period", float("nan"))])
def test_bad_settings_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SuffixConfig(**{field: value})


# ------------------------------------------------------------------- the embedded model's tokens
def test_drafts_an_earlier_plan_in_the_embedded_models_tokens(embedded_model_path: Path) -> None:
    """Two plans share ``{"skill": "pick", "args": {"object_id": "`` and go on differently. A request
    that follows the older plan is drafted that plan's object: its match reaches back to the place
    the plans differ in, where a 4-token n-gram would follow the newer plan (the newest wins a tie)."""
    system = "You are Rover's planner. Answer with the JSON plan only.\n\nInstruction: "
    head = ' {"steps": [{"skill": "navigate", "args": {"place": "'
    milk = head + 'fridge"}}, {"skill": "pick", "args": {"object_id": "'
    cup = head + 'sink"}}, {"skill": "pick", "args": {"object_id": "'
    texts = [system + "get the milk\nPlan:", system + "wash the cup\nPlan:", system + "milk again\nPlan:"]
    answers = [milk + 'milk_1", "grasp": "side"}}]}', cup + 'cup_1", "grasp": "handle"}}]}']
    tokens = lookup_create.tokenize_texts(str(embedded_model_path), [t.encode() for t in (
        *texts, texts[0] + answers[0], texts[1] + answers[1], texts[2] + milk)])
    prompts, whole, started = tokens[:3], tokens[3:5], tokens[5]
    drafter = SuffixDrafter(SuffixConfig(match_factor=0))
    for prompt, request in zip(prompts, whole):  # the milk plan first: the cup plan is the newest
        assert request[:len(prompt)] == prompt
        run_request(drafter, prompt, request[len(prompt):])
    milk_answer = whole[0][len(prompts[0]):]
    done = len(started) - len(prompts[2])
    assert started[:len(prompts[2])] == prompts[2] and milk_answer[:done] == started[len(prompts[2]):]
    drafter.begin(prompts[2])
    draft = drafter.propose(started, 8)
    assert list(draft.tokens) == milk_answer[done:done + 8]
    # the one occurrence of the long match; the two tokens before the object were followed by both
    # plans' objects: the history's object is a value, not structure
    assert draft.evidence[0] == ("history", True, False, False)
    assert ("history", True, False, True) in draft.evidence  # the structure after the object


def test_a_history_with_ids_outside_the_vocabulary_is_moved_aside_with_a_warning(tmp_path: Path) -> None:
    """Q7: ids 262149 and 2**31 - 1 after a common context, in a file with a valid header and
    checksum: the drafter loaded them and drafted them, and llama.cpp refused every such batch.
    The file is damaged for the vocabulary its tag names (262144 tokens): moved aside, as a broken
    checksum is, and the history starts empty."""
    path = tmp_path / "suffix.bin"
    suffix_history.save([PLAN + [262149, 2147483647]], path, TAG)
    data = path.read_bytes()
    drafter = SuffixDrafter(SuffixConfig(history_path=str(path), match_factor=0), vocab_tag=TAG)
    assert drafter.n_vocab == 262144
    assert drafter.history_tokens == 0 and len(drafter.warnings) == 1, drafter.warnings
    assert "outside the vocabulary of 262144 tokens" in drafter.warnings[0] and "moved it to" in drafter.warnings[0]
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == data and not path.exists()
    drafter.begin([1])
    assert drafter.propose([1] + PLAN, 4) is EMPTY_DRAFT


def test_no_draft_holds_an_id_outside_the_vocabulary() -> None:
    """Defence in depth (Q7): whatever the history and the request hold, a draft ends before the
    first id outside [0, n_vocab), given or named by the vocabulary tag; a slot's drafter too."""
    output = PLAN[:5] + [50, 2147483647, 7]  # 40..44, then two ids a 50-token vocabulary lacks
    for drafter in (SuffixDrafter(SuffixConfig(match_factor=0), n_vocab=50),
                    SuffixDrafter(SuffixConfig(match_factor=0), vocab_tag="vocab-1-50-" + "ab" * 20)):
        assert drafter.n_vocab == 50
        run_request(drafter, [1], output)
        for one in (drafter, drafter.for_slot(1)):
            one.begin([2])
            draft = one.propose([2, 40, 41, 42], 5)
            assert draft.tokens == (43, 44) and len(draft.evidence) == 2
            assert one.propose([2, 40, 41, 42, 43, 44], 5) is EMPTY_DRAFT
            one.end([2])
    unbounded = SuffixDrafter(SuffixConfig(match_factor=0))  # no vocabulary known: drafted as found
    run_request(unbounded, [1], output)
    unbounded.begin([2])
    assert unbounded.propose([2, 40, 41, 42], 5).tokens == (43, 44, 50, 2147483647, 7)
