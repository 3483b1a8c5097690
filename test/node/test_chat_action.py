"""The ``~/generate_chat`` action on the real node (rclpy over loopback, real llama.cpp): a turn's
typed tool calls and finish_reason tool_calls, streamed text, the goal-time refusals with their
reasons, cancel, the one queue it shares with ``~/generate`` (priorities, preemption, queue
positions), a follow-up turn that reuses its conversation's KV, every speculative mode.

Models: the tiny random-weight GGUF with a Gemma 3 style template (test/support/tiny_chat_gguf.py:
turns that must alternate, no tools, so the fallback's tagged-JSON calls), F32, with a copy of
itself as the draft model so that every draft mode can run; and, where a goal must run long enough
to be cancelled, preempted or timed out (the tiny model ends its text within milliseconds), the
embedded Gemma 3 270M with the agent suite's template given as chat.template_path (it has none).
Each node serves the module, active; each test leaves its queue idle.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import jsonschema
import pytest
from action_msgs.msg import GoalStatus

from gemma_spec_ros.client import GenerateClient, key_values, wait_until
from gemma_spec_ros.node import spec_status_name
from gemma_spec_ros.node.parameters import defaults
from support.chat import SKILLS, SKILLS_JSON, embedded_template_file
from support.node import ServedNode
from support.tiny_chat_gguf import GEMMA3_STYLE, write_tiny_chat_gguf

NODE = "gemma_spec_chat_action"
SLOW_NODE = "gemma_spec_chat_queue"
SPEC_STATUS = spec_status_name(NODE)
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in SKILLS}
SYSTEM = {"role": "system", "content": "You are the task planner of a mobile robot."}
ASK = {"role": "user", "content": "Bring the cup from the kitchen."}


@pytest.fixture(scope="module")
def served(node_client: Callable[..., ServedNode], tmp_path_factory: pytest.TempPathFactory) -> ServedNode:
    folder = tmp_path_factory.mktemp("chat_action")
    target = write_tiny_chat_gguf(folder / "gemma3-style.gguf", template=GEMMA3_STYLE, seed=1)
    draft = write_tiny_chat_gguf(folder / "gemma3-style-draft.gguf", template=GEMMA3_STYLE, seed=1)
    overrides = {"target.model_path": str(target), "target.n_ctx": 2048, "target.n_threads": 1,
                 "draft.model_path": str(draft), "draft.n_threads": 1, "spec.mode": "lookup",
                 "spec.draft_max": 4, "lookup.cache_dir": str(folder), "limits.max_prompt_tokens": 1800,
                 "limits.max_tokens": 600, "generation.max_tokens": 160, "queue.max_depth": 4,
                 "diagnostics.period": 0.2}
    return node_client(NODE, {k: v for k, v in overrides.items() if v != defaults()[k]})


@pytest.fixture(scope="module")
def slow_served(node_client: Callable[..., ServedNode], tmp_path_factory: pytest.TempPathFactory,
                embedded_model_path: Path) -> ServedNode:
    folder = tmp_path_factory.mktemp("chat_queue")
    overrides = {"target.model_path": str(embedded_model_path), "target.n_ctx": 2048, "spec.mode": "off",
                 "lookup.cache_dir": str(folder), "chat.template_path": str(embedded_template_file(folder)),
                 "limits.max_tokens": 900, "diagnostics.period": 0.2}
    return node_client(SLOW_NODE, {k: v for k, v in overrides.items() if v != defaults()[k]})


def idle_queue(served: ServedNode) -> Iterator[GenerateClient]:
    wait_until(lambda: not served.node._goals.busy(), 120, "an idle queue")
    yield served.client
    wait_until(lambda: not served.node._goals.busy(), 120, "an idle queue after the test")


@pytest.fixture
def idle(served: ServedNode) -> Iterator[GenerateClient]:
    yield from idle_queue(served)


@pytest.fixture
def slow(slow_served: ServedNode) -> Iterator[GenerateClient]:
    yield from idle_queue(slow_served)


def turn(*messages: Dict[str, Any], **fields: Any) -> Dict[str, Any]:
    """A chat goal's fields: the messages, the skills as tools, greedy."""
    return {"messages": list(messages), "tools": SKILLS_JSON, "temperature": 0.0, **fields}


def calls_of(result: Any) -> List[Dict[str, Any]]:
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in result.message.tool_calls]


def check_calls(result: Any) -> None:
    """Each call names a skill and its arguments follow that skill's schema."""
    for call in result.message.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.timeout(240)
def test_a_turn_returns_typed_tool_calls(idle: GenerateClient) -> None:
    run = idle.send_chat(**turn(SYSTEM, ASK, tool_choice="required"))
    assert run.accepted
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    assert result.finish_reason == "tool_calls" and result.error == ""
    assert result.message.role == "assistant" and len(result.message.tool_calls) == 1
    check_calls(result)
    assert result.message.tool_calls[0].id.startswith("call_")
    assert result.prompt_tokens > 0 and result.completion_tokens > 0 and result.spec_mode == "lookup"
    assert result.stats.num_grammar_masks > 0
    wait_until(lambda: run.streamed_text.strip() == result.message.content, 5.0, "all text streamed")


@pytest.mark.timeout(240)
def test_a_text_turn_streams_its_text(idle: GenerateClient) -> None:
    """tool_choice none: the reply is text, streamed as feedback, equal to the message's text."""
    run = idle.send_chat(**turn(SYSTEM, ASK, tool_choice="none", max_tokens=40))
    result = run.wait_result()
    assert result.finish_reason in ("stop", "length") and result.message.tool_calls == []
    wait_until(lambda: run.streamed_text.strip() == result.message.content != "", 5.0, "all text streamed")
    assert len([f.text for f in run.feedback if f.text]) >= 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["off", "lookup", "suffix", "suffix+lookup", "draft", "draft+lookup", "auto"])
def test_every_mode_serves_valid_calls(idle: GenerateClient, mode: str) -> None:
    result = idle.send_chat(**turn(SYSTEM, ASK, tool_choice="move_to", spec_mode=mode)).wait_result()
    assert result.finish_reason == "tool_calls" and result.error == "", (mode, result.error)
    assert [c.name for c in result.message.tool_calls] == ["move_to"] and result.spec_mode.split(":")[0] == mode
    check_calls(result)


@pytest.mark.timeout(300)
def test_a_follow_up_turn_reuses_its_conversation_after_another(idle: GenerateClient) -> None:
    """Conversation A's first turn, then B's, then A's second: A's second evaluates only what is
    new since its first turn (the conversation's KV kept by the node)."""
    first = idle.send_chat(**turn(SYSTEM, ASK, tool_choice="required")).wait_result()
    other = {"role": "user", "content": "Say hello to the guests, please."}
    idle.send_chat(**turn(SYSTEM, other, tool_choice="say")).wait_result()
    calls = calls_of(first)
    results = [{"role": "tool", "content": '{"ok": true}', "tool_call_id": c["id"]} for c in calls]
    follow = turn(SYSTEM, ASK, {"role": "assistant", "content": first.message.content, "tool_calls": calls},
                  *results, {"role": "user", "content": "Go on."}, tool_choice="required")
    second = idle.send_chat(**follow).wait_result()
    assert second.finish_reason == "tool_calls"
    assert second.stats.num_prompt_tokens_reused >= first.prompt_tokens
    status = idle.wait_status(SPEC_STATUS, lambda s: int(key_values(s)["conversations restored"]) >= 1)
    assert int(key_values(status)["conversations kept"]) >= 1


BAD_TURNS = [
    (lambda: turn({"role": "robot", "content": "hi"}), "messages[0]: unknown role 'robot'"),
    (lambda: turn(ASK, {"role": "tool", "content": "done", "tool_call_id": "c9"}),
     "tool_call_id 'c9', which no earlier assistant message called"),
    (lambda: turn(ASK, {"role": "tool", "content": "done"}), "messages[1]: a tool message without tool_call_id"),
    (lambda: turn(ASK, tools='[{"type": "function", "function": {"name": "go", "parameters": '
                              '{"type": "object", "properties": {"x": {"type": "vector"}}}}}]'),
     "the parameters of tool 'go' is not a valid JSON Schema"),
    (lambda: turn(ASK, tools="[{"), "tools is not valid JSON"),
    (lambda: turn(ASK, tool_choice="fly"), "tool_choice 'fly'"),
    (lambda: turn(ASK, {"role": "user", "content": "go on " * 400}), "more than limits.max_prompt_tokens=1800"),
    (lambda: turn(ASK, {"role": "user", "content": "x" * 70_000}), "more than limits.max_prompt_bytes="),
    (lambda: turn({"role": "assistant", "content": "I start."}, ASK), "roles must alternate"),
    (lambda: turn(ASK, json_schema='{"type": "object"}'), "grammar / json_schema constrain a reply without tools"),
    (lambda: turn(ASK, stop=["x" * 200]), "longer than limits.max_stop_length"),
    (lambda: turn(), "messages is empty"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("make, reason", BAD_TURNS, ids=[r for _, r in BAD_TURNS])
def test_bad_turns_are_rejected_with_the_reason(idle: GenerateClient, make: Callable[[], Dict[str, Any]],
                                               reason: str) -> None:
    """Goal-time refusals, as Generate's: rejected, the reason logged and on /diagnostics."""
    mark = idle.log_mark()
    run = idle.send_chat(**make())
    assert not run.accepted
    assert reason in idle.wait_log("goal rejected", since=mark).msg
    idle.wait_status(SPEC_STATUS, lambda s: reason[:40] in key_values(s)["last rejection"])


@pytest.mark.timeout(240)
def test_a_turn_is_cancelled_at_its_next_step(slow: GenerateClient) -> None:
    run = slow.send_chat(**turn(SYSTEM, ASK, tool_choice="none", max_tokens=500))
    wait_until(lambda: any(f.completion_tokens for f in run.feedback), 60, "the turn to run")
    slow.cancel(run)
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_CANCELED and result.finish_reason == "cancelled"
    assert 0 < result.completion_tokens < 500
    # the last feedback can arrive after the result (a topic message and a service response)
    wait_until(lambda: run.streamed_text.strip() == result.message.content, 5.0, "all text streamed")


@pytest.mark.timeout(300)
def test_chat_and_generate_goals_share_one_queue(slow: GenerateClient) -> None:
    """A long Generate goal runs; a chat turn waits behind it with its queue position, then an
    urgent chat turn preempts it and runs first; the waiting turn runs after."""
    long = slow.send(prompt="The inspection robot's hourly log.\nHour 1: corridor clear.\nHour 2:",
                     max_tokens=800, temperature=0.0)
    wait_until(lambda: any(f.completion_tokens for f in long.feedback), 60, "the Generate goal to run")
    waiting = slow.send_chat(**turn(SYSTEM, ASK, tool_choice="say", max_tokens=48))
    wait_until(lambda: any(f.queue_position == 1 for f in waiting.feedback), 30, "the turn's queue position")
    urgent = slow.send_chat(**turn(SYSTEM, ASK, tool_choice="pick", priority=5, preempt=True, max_tokens=48))
    stopped = long.wait_result()
    assert stopped.finish_reason == "preempted" and "priority 5" in stopped.error
    assert urgent.wait_result().finish_reason == "tool_calls"
    assert waiting.wait_result().finish_reason == "tool_calls"
    assert urgent.result_at < waiting.result_at


@pytest.mark.timeout(240)
def test_a_turn_over_its_time_budget_ends_with_timeout(slow: GenerateClient) -> None:
    run = slow.send_chat(**turn(SYSTEM, ASK, tool_choice="none", max_tokens=500, time_budget=0.3))
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_ABORTED and result.finish_reason == "timeout"
    assert "time_budget" in result.error
