"""A task planner as a robot has one: a plain rclpy node named ``planner`` with ActionClients of
Generate and GenerateChat, and nothing else (GenerateClient also watches /diagnostics, /rosout and
the stats and holds lifecycle and parameter clients: more than a planner's SROS2 enclave grants).

As a program (run from its file: the ROS wheels re-execute the interpreter):
``python action_planner.py /gemma_spec PROMPT MAX_TOKENS`` prints the result as one JSON line;
with ``--chat`` a chat turn of PROMPT as the user's message, with one tool it must call, whose
call it prints as the text.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Tuple

import rclpy
from rclpy.action import ActionClient
from rclpy.node import Node

from gemma_spec_msgs.action import Generate, GenerateChat
from gemma_spec_msgs.msg import ChatMessage

NAME = "planner"
#: The one tool of the planner's chat turns (an enum argument: any model completes it quickly).
TOOL = {"type": "function", "function": {"name": "navigate", "description": "Drive to a place.", "parameters": {
    "type": "object", "properties": {"place": {"enum": ["dock", "sink"]}}, "required": ["place"]}}}


def _send(node: Node, action: Any, name: str, goal: Any, timeout: float, keep: bool) -> Tuple[int, Any]:
    """Send ``goal`` to the action ``name`` from ``node`` (not spun elsewhere); its final status
    and result. ``keep``: the action client stays with the node (the graph then shows it)."""
    client = ActionClient(node, action, name)
    try:
        assert client.wait_for_server(timeout_sec=timeout), f"no action server {name}"
        sent = client.send_goal_async(goal)
        rclpy.spin_until_future_complete(node, sent, timeout_sec=timeout)
        handle = sent.result()
        assert handle is not None and handle.accepted, "the goal was not accepted"
        done = handle.get_result_async()
        rclpy.spin_until_future_complete(node, done, timeout_sec=timeout)
        response = done.result()
        assert response is not None, f"no result within {timeout:.0f} s"
        return response.status, response.result
    finally:
        if not keep:
            client.destroy()


def generate(node: Node, node_path: str, prompt: str, max_tokens: int, timeout: float = 120.0,
             keep: bool = False) -> Tuple[int, str]:
    """One greedy Generate goal to ``node_path``'s ~/generate: its final status and text."""
    goal = Generate.Goal(prompt=prompt, max_tokens=max_tokens, temperature=0.0, seed=1)
    status, result = _send(node, Generate, f"{node_path.rstrip('/')}/generate", goal, timeout, keep)
    return status, result.text


def chat(node: Node, node_path: str, prompt: str, max_tokens: int, timeout: float = 120.0,
         keep: bool = False) -> Tuple[int, str]:
    """One greedy chat turn to ``node_path``'s ~/generate_chat (``prompt`` the user's message,
    :data:`TOOL` required): its final status and the call, as ``name arguments``."""
    goal = GenerateChat.Goal(messages=[ChatMessage(role="user", content=prompt)], tools=json.dumps([TOOL]),
                             tool_choice="required", max_tokens=max_tokens, temperature=0.0, seed=1)
    status, result = _send(node, GenerateChat, f"{node_path.rstrip('/')}/generate_chat", goal, timeout, keep)
    return status, " ".join(f"{c.name} {c.arguments}" for c in result.message.tool_calls)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--chat"]
    node_path, prompt, max_tokens = args[0], args[1], int(args[2])
    rclpy.init()
    node = rclpy.create_node(NAME)
    try:
        status, text = (chat if "--chat" in sys.argv else generate)(node, node_path, prompt, max_tokens)
        print(json.dumps({"status": status, "text": text}))
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
