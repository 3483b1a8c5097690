"""The Generate action's messages <-> the engine's types: pure mapping, no rclpy node, no state.

In: a goal -> :class:`~gemma_spec_ros.engine.request.GenerationRequest` (:func:`request_from_goal`,
after the cheap size checks of :func:`check_input_bounds`). Out: a ``Step`` -> feedback, the last
``Step`` -> the result, ``SpecStats`` -> ``gemma_spec_msgs/SpecStats``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from builtin_interfaces.msg import Time
from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import SpecStats as SpecStatsMsg

from ..engine.stats import SpecStats
from ..engine.modes import SPEC_MODES
from ..engine.request import GenerationRequest, Step
from ..engine.config import SamplingParams
from .parameters import PARAMETERS_BY_NAME

#: Characters of a client's string (or a reason quoting one) kept in logs and /diagnostics.
MAX_ECHO = 256
#: Seconds a goal's time_budget counts at most: the top of ``generation.time_budget``'s range (a
#: day). The goal's float32 field reaches 3.4e38 s; a deadline that far away overflows the
#: node's waits (threading.TIMEOUT_MAX is ~9.2e9 s), and no goal can use more than a day.
MAX_TIME_BUDGET = PARAMETERS_BY_NAME["generation.time_budget"].value_range[1]


class GoalRejected(ValueError):
    """A goal cannot be served; the message says why (it is logged and kept for diagnostics)."""


# -- in: goal -> request ---------------------------------------------------------------------------
def check_input_bounds(goal: Any, values: Mapping[str, Any]) -> None:
    """Raise GoalRejected if the goal's strings exceed the ``limits.*`` size bounds; cheap, and
    done before anything tokenizes or copies them (an unauthenticated client sets their size)."""
    max_bytes = values["limits.max_prompt_bytes"]
    size = len(goal.prompt.encode("utf-8", "replace")) + len(goal.system_prompt.encode("utf-8", "replace"))
    if size > max_bytes:
        raise GoalRejected(f"prompt + system prompt of {size} bytes exceed "
                           f"limits.max_prompt_bytes={max_bytes}")
    check_stop_and_grammar_bounds(goal, values)


def check_stop_and_grammar_bounds(goal: Any, values: Mapping[str, Any]) -> None:
    """GoalRejected if the goal's stop strings, grammar or json_schema exceed their ``limits.*``
    (the fields Generate and GenerateChat goals share)."""
    max_stops, max_length = values["limits.max_stop_strings"], values["limits.max_stop_length"]
    if len(goal.stop) > max_stops:
        raise GoalRejected(f"{len(goal.stop)} stop strings: more than limits.max_stop_strings={max_stops}")
    longest = max((len(stop) for stop in goal.stop), default=0)
    if longest > max_length:
        raise GoalRejected(f"a stop string of {longest} characters: longer than "
                           f"limits.max_stop_length={max_length}")
    max_grammar = values["limits.max_grammar_bytes"]
    for name in ("grammar", "json_schema"):
        size = len(getattr(goal, name).encode("utf-8", "replace"))
        if size > max_grammar:
            raise GoalRejected(f"{name} of {size} bytes exceeds limits.max_grammar_bytes={max_grammar}")


def request_from_goal(goal: Any, values: Mapping[str, Any]) -> GenerationRequest:
    """A Generate goal + the node's parameter values -> GenerationRequest, or GoalRejected.

    Goal conventions (see Generate.action): ``max_tokens`` 0 = ``generation.max_tokens``; ``top_p`` 0
    = ``generation.top_p``; ``temperature`` -1 = ``generation.temperature``; ``top_k`` -1 =
    ``generation.top_k``; ``seed`` -1 = ``generation.seed`` (whose default, -1, draws a random seed); empty
    ``spec_mode`` = the node's ``spec.mode``; ``time_budget`` 0 = ``generation.time_budget``, and
    a budget above :data:`MAX_TIME_BUDGET` counts as that;
    ``grammar`` and ``json_schema`` both empty = the node's ``generation.grammar`` /
    ``generation.json_schema`` (a goal that sets one replaces both defaults). A zero-initialised goal
    is greedy whatever the node's defaults: 0 is a real temperature, so "use the default" needs its
    own value.

    >>> from types import SimpleNamespace as G
    >>> v = {"generation.max_tokens": 64, "generation.top_p": 0.9, "generation.seed": -1,
    ...      "limits.max_tokens": 256, "generation.time_budget": 0.0, "generation.prompt_cache": True,
    ...      "generation.grammar": "", "generation.json_schema": ""}
    >>> goal = G(prompt="Hi", system_prompt="", use_chat_template=False, max_tokens=0,
    ...          temperature=0.0, top_p=0.0, top_k=0, seed=7, stop=[], spec_mode="", time_budget=0.0,
    ...          grammar="", json_schema="")
    >>> r = request_from_goal(goal, v); (r.max_tokens, r.sampling.top_p, r.spec_mode)
    (64, 0.9, None)
    """
    if not goal.prompt:
        raise GoalRejected("prompt is empty")
    grammar, json_schema = goal.grammar, goal.json_schema
    if not grammar and not json_schema:
        grammar, json_schema = values["generation.grammar"], values["generation.json_schema"]
    return request_with(goal, values, prompt=goal.prompt, system_prompt=goal.system_prompt,
                        use_chat_template=bool(goal.use_chat_template), grammar=grammar,
                        json_schema=json_schema)


def request_with(goal: Any, values: Mapping[str, Any], **content: Any) -> GenerationRequest:
    """The request of a goal's sampling, stop, spec_mode and budget fields (their conventions: see
    :func:`request_from_goal`) with ``content``, what the request generates from (a prompt, or a
    chat turn's conversation) and its constraint; GoalRejected with the reason."""
    if not math.isfinite(goal.temperature) or (goal.temperature < 0 and goal.temperature != -1):
        raise GoalRejected(f"temperature={goal.temperature}: must be finite and >= 0, "
                           "or -1 for the node's generation.temperature")
    if not math.isfinite(goal.top_p) or not 0.0 <= goal.top_p <= 1.0:
        raise GoalRejected(f"top_p={goal.top_p}: must be in (0, 1], or 0 for the node's default")
    if goal.top_k < -1:
        raise GoalRejected(f"top_k={goal.top_k}: must be >= 0 (0 = no limit), "
                           "or -1 for the node's generation.top_k")
    if goal.spec_mode and goal.spec_mode not in SPEC_MODES:
        raise GoalRejected(f"spec_mode {goal.spec_mode[:32]!r}: expected one of {', '.join(SPEC_MODES)} "
                           "or empty for the node's spec.mode")
    if goal.seed < -1:
        raise GoalRejected(f"seed={goal.seed}: must be >= 0, or -1 for the node's generation.seed")
    if not math.isfinite(goal.time_budget) or goal.time_budget < 0:
        raise GoalRejected(f"time_budget={goal.time_budget}: must be >= 0 seconds "
                           "(0 = the node's generation.time_budget)")
    max_tokens = goal.max_tokens or values["generation.max_tokens"]
    if max_tokens > values["limits.max_tokens"]:
        raise GoalRejected(f"max_tokens={max_tokens} exceeds limits.max_tokens={values['limits.max_tokens']}")
    try:
        temperature = values["generation.temperature"] if goal.temperature == -1 else goal.temperature
        top_k = values["generation.top_k"] if goal.top_k == -1 else goal.top_k
        sampling = SamplingParams(temperature=float(temperature), top_k=int(top_k),
                                  top_p=float(goal.top_p or values["generation.top_p"]),
                                  seed=int(values["generation.seed"] if goal.seed == -1 else goal.seed))
        return GenerationRequest(max_tokens=int(max_tokens), sampling=sampling,
                                 stop=tuple(goal.stop), spec_mode=goal.spec_mode or None,
                                 time_budget=min(float(goal.time_budget or values["generation.time_budget"]),
                                                 MAX_TIME_BUDGET),
                                 reuse_prompt=bool(values["generation.prompt_cache"]), **content)
    except ValueError as exc:
        raise GoalRejected(str(exc)) from exc


# -- out: steps -> feedback and result -------------------------------------------------------------
def step_feedback(step: Step, text: str) -> Generate.Feedback:
    """Feedback for one engine step with the text accumulated since the last feedback."""
    return Generate.Feedback(
        text=text, completion_tokens=step.stats.num_generated_tokens,
        mean_acceptance_length=step.stats.mean_acceptance_length,
        tokens_per_second=step.stats.tokens_per_second, spec_mode=step.spec_mode,
        draft_max=step.draft_max)


def result(text: str, finish_reason: str, error: str, last: Optional[Step], stamp: Time) -> Generate.Result:
    """The goal's result: its text, how it ended and, if a step was made, the last step's counts
    and stats (``last`` None: the goal ended before the engine made a step)."""
    msg = Generate.Result(text=text, finish_reason=finish_reason, error=error)
    if last is not None:
        msg.spec_mode = last.spec_mode
        msg.prompt_tokens = _fit("uint32", last.stats.num_prompt_tokens)
        msg.completion_tokens = _fit("uint32", last.stats.num_generated_tokens)
        msg.stats = spec_stats_msg(last.stats, stamp)
    return msg


def spec_stats_msg(stats: SpecStats, stamp: Time) -> SpecStatsMsg:
    """The one conversion SpecStats dataclass -> gemma_spec_msgs/SpecStats (from ``as_dict``)."""
    values = stats.as_dict()
    msg = SpecStatsMsg()
    msg.header.stamp = stamp
    for name, ros_type in msg.get_fields_and_field_types().items():
        if name == "header":
            continue
        value = values[name]
        if ros_type == "string":
            setattr(msg, name, str(value))
        elif ros_type.startswith("sequence<"):  # float64[] or uint64[] (the acceptance histogram)
            item = ros_type[len("sequence<"):-1]
            setattr(msg, name, [_fit(item, v) if item.startswith(("uint", "int")) else float(v)
                                for v in value])
        elif ros_type.startswith(("uint", "int")):
            setattr(msg, name, _fit(ros_type, value))
        else:
            setattr(msg, name, float(value))
    return msg


def _fit(ros_type: str, value: Any) -> int:
    """``value`` as an int within the range of the integer field type ``ros_type`` (a count out of
    range, e.g. from a broken server, must not fail the message's setter and lose the result).

    >>> _fit("uint32", -3), _fit("uint32", 2**40), _fit("int64", 7)
    (0, 4294967295, 7)
    """
    bits = int("".join(c for c in ros_type if c.isdigit()) or 64)
    low, high = (0, 2**bits - 1) if ros_type.startswith("uint") else (-2**(bits - 1), 2**(bits - 1) - 1)
    return min(max(int(value), low), high)


def clip(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` cut to ``limit`` characters (with a note of how many were cut).

    >>> clip("x" * 300, 10)
    'xxxxxxxxxx... (290 more characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"
