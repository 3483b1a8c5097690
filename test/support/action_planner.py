"""A task planner as a robot has one: a plain rclpy node named ``planner`` with an ActionClient of
Generate, and nothing else (GenerateClient also watches /diagnostics, /rosout and the stats and
holds lifecycle and parameter clients: more than a planner's SROS2 enclave grants).

As a program (run from its file: the ROS wheels re-execute the interpreter):
``python action_planner.py /gemma_spec PROMPT MAX_TOKENS`` prints the result as one JSON line.
"""
from __future__ import annotations

import json
import sys
from typing import Tuple

import rclpy
from rclpy.action import ActionClient
from rclpy.node import Node

from gemma_spec_msgs.action import Generate

NAME = "planner"


def generate(node: Node, node_path: str, prompt: str, max_tokens: int, timeout: float = 120.0) -> Tuple[int, str]:
    """Send one greedy goal to ``node_path``'s ~/generate from ``node`` (not spun elsewhere);
    the goal's final status and text."""
    client = ActionClient(node, Generate, f"{node_path.rstrip('/')}/generate")
    try:
        assert client.wait_for_server(timeout_sec=timeout), f"no action server {node_path}/generate"
        goal = Generate.Goal(prompt=prompt, max_tokens=max_tokens, temperature=0.0, seed=1)
        sent = client.send_goal_async(goal)
        rclpy.spin_until_future_complete(node, sent, timeout_sec=timeout)
        handle = sent.result()
        assert handle is not None and handle.accepted, "the goal was not accepted"
        done = handle.get_result_async()
        rclpy.spin_until_future_complete(node, done, timeout_sec=timeout)
        response = done.result()
        assert response is not None, f"no result within {timeout:.0f} s"
        return response.status, response.result.text
    finally:
        client.destroy()


def main() -> None:
    node_path, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rclpy.init()
    node = rclpy.create_node(NAME)
    try:
        status, text = generate(node, node_path, prompt, max_tokens)
        print(json.dumps({"status": status, "text": text}))
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
