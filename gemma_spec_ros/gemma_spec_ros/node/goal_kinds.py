"""The kinds of goal the node serves: ``~/generate`` (Generate) and ``~/generate_chat`` (GenerateChat).

One :class:`~gemma_spec_ros.node.goal_server.GoalServer` serves both, through one queue, dispatcher,
priority order, preemption, time budgets, cancel and lifecycle. A kind is only what differs between
the two actions: the action type and name, the goal -> checked request mapping (its refusals), a
step -> feedback, and the end of a goal -> its result. Nothing here holds state or touches rclpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple

from builtin_interfaces.msg import Time
from gemma_spec_msgs.action import Generate, GenerateChat

from ..engine.request import GenerationRequest, Step
from . import chat_messages, messages

#: goal + the node's parameter values -> the checked request (GoalRejected with the reason)
RequestOf = Callable[[Any, Mapping[str, Any]], GenerationRequest]
#: (text streamed, finish_reason, error, last step or None, stamp) -> the action's Result
ResultOf = Callable[[str, str, str, Optional[Step], Time], Any]


@dataclass(frozen=True)
class GoalKind:
    """What one action of the node is made of (see the module docstring)."""

    action: Any  # the action type (gemma_spec_msgs.action.Generate, ...)
    name: str  # the action's name under the node: ~/<name>
    request: RequestOf
    feedback: Callable[[Step, str], Any]  # a step and the text since the last feedback -> Feedback
    result: ResultOf

    def queue_feedback(self, position: int) -> Any:
        """Feedback to a waiting goal: its place in the queue (1 = starts next)."""
        return self.action.Feedback(queue_position=position)

    def unstarted(self, finish_reason: str, error: str) -> Any:
        """The result of a goal that ends before the engine made a step."""
        return self.result("", finish_reason, error, None, Time())


def _generate_request(goal: Generate.Goal, values: Mapping[str, Any]) -> GenerationRequest:
    messages.check_input_bounds(goal, values)
    return messages.request_from_goal(goal, values)


GENERATE = GoalKind(Generate, "generate", _generate_request, messages.step_feedback, messages.result)
GENERATE_CHAT = GoalKind(GenerateChat, "generate_chat", chat_messages.chat_request_from_goal,
                         chat_messages.chat_feedback, chat_messages.chat_result_of)
#: Every kind, in the order their action servers are created.
GOAL_KINDS: Tuple[GoalKind, ...] = (GENERATE, GENERATE_CHAT)

__all__ = ["GENERATE", "GENERATE_CHAT", "GOAL_KINDS", "GoalKind"]
