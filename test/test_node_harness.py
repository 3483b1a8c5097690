"""Node bring-up for the node tests: a GemmaSpecNode spun in this process. The client side is
:class:`gemma_spec_ros.client.GenerateClient` (re-exported here as ``Client``)."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping

import rclpy
from rclpy.executors import MultiThreadedExecutor
from rclpy.parameter import Parameter

from gemma_spec_ros.client import (GenerateClient as Client, GoalRun, collect, key_values,  # noqa: F401
                                   wait_future, wait_until)


class Spinning:
    """A GemmaSpecNode with parameter overrides, spun by a multi-threaded executor on a thread of
    its own (rclpy must be initialised); ``close()`` releases the engine and destroys the node."""

    def __init__(self, name: str, values: Mapping[str, Any]) -> None:
        from gemma_spec_ros.node.node import MIN_EXECUTOR_THREADS, GemmaSpecNode

        self.node = GemmaSpecNode(name, parameter_overrides=[Parameter(k, value=v) for k, v in values.items()])
        self.executor = MultiThreadedExecutor(num_threads=MIN_EXECUTOR_THREADS + 2)
        self.executor.add_node(self.node)
        threading.Thread(target=self.executor.spin, daemon=True).start()

    def close(self) -> None:
        self.node.release("test teardown")
        self.executor.shutdown(timeout_sec=5.0)
        self.node.destroy_node()


@contextlib.contextmanager
def spun_node(name: str, values: Mapping[str, Any]) -> Iterator[Any]:
    """rclpy initialised, a :class:`Spinning` node named ``name`` with ``values``; all undone after."""
    rclpy.init()
    spinning = Spinning(name, values)
    try:
        yield spinning.node
    finally:
        spinning.close()
        rclpy.try_shutdown()
