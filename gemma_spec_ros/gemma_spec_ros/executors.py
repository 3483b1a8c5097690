"""A ``MultiThreadedExecutor`` that hands each task to its thread pool once.

rclpy's MultiThreadedExecutor (Jazzy, rclpy 7.1) yields every task that is "not executing and not
done" again at each turn of its loop, and submits it to the pool again. A task the pool has been
given but not yet started is such a task, so while the pool's threads wait (for the GIL, or for a
free thread) the spinning thread submits the same task hundreds of times, and the pool's threads
then spend the GIL running those no-op copies (ros2/rclpy#1452; changed upstream after Jazzy by
ros2/rclpy#1547). Measured here: a GenerateClient in the node's process submitted one feedback
task up to 1,173 times during one 40-token request, its spinning thread took a whole core, and the
engine's thread, starved of the GIL, drafted at 15 ms a token instead of 0.15 ms.

:class:`MultiThreadedExecutor` here keeps rclpy's executor and wraps only its pool: a task already
queued and not yet started is not queued again; the spinning thread instead waits (GIL released)
until a worker starts it, or :data:`REQUEUE_WAIT` seconds.

It also outlives an action server destroyed while it spins (the node's cleanup transition destroys
its action servers). rclpy's wait loop takes the node's waitables, skips one whose handle is
already destroyed when it takes hold of it, and then adds every one to the wait set all the same:
``RCLError: ... action server pointer is invalid`` leaves ``spin()`` and the spinning thread ends,
so the node answers nothing more (measured: a server made and destroyed every millisecond beside a
spinning executor ended its thread within 100 cycles). That error is taken as the end of one turn
of the loop; the next turn builds its wait set without the destroyed server. Nothing else of
rclpy's loop changes.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Set

from rclpy._rclpy_pybind11 import RCLError
from rclpy.context import Context
from rclpy.executors import MultiThreadedExecutor as RclpyMultiThreadedExecutor

#: What rclpy's error says when the wait loop met a waitable destroyed under it.
DESTROYED_UNDER_WAIT = "pointer is invalid"
#: The longest the spinning thread waits for a worker to start a task it was handed again.
REQUEUE_WAIT = 0.005


class OncePool:
    """A ThreadPoolExecutor facade whose ``submit(task)`` queues a task at most once at a time."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._queued: Set[int] = set()  # id() of tasks queued and not started
        self._changed = threading.Condition()

    def submit(self, task: Callable[[], Any]) -> Optional[Any]:
        key = id(task)
        with self._changed:
            if key in self._queued:
                self._changed.wait_for(lambda: key not in self._queued, REQUEUE_WAIT)
                return None
            self._queued.add(key)
        try:
            return self._pool.submit(self._run, task, key)
        except BaseException:
            self._started(key)
            raise

    def _run(self, task: Callable[[], Any], key: int) -> Any:
        self._started(key)
        return task()

    def _started(self, key: int) -> None:
        with self._changed:
            self._queued.discard(key)
            self._changed.notify_all()

    def __getattr__(self, name: str) -> Any:  # shutdown() and the rest: the pool's own
        return getattr(self._pool, name)


class MultiThreadedExecutor(RclpyMultiThreadedExecutor):
    """rclpy's MultiThreadedExecutor with a :class:`OncePool` (see the module docstring)."""

    def __init__(self, num_threads: Optional[int] = None, *, context: Optional[Context] = None) -> None:
        super().__init__(num_threads, context=context)
        if not isinstance(getattr(self, "_executor", None), ThreadPoolExecutor):
            raise RuntimeError("this rclpy's MultiThreadedExecutor has no ThreadPoolExecutor in "
                               "_executor: gemma_spec_ros.executors needs updating for it")
        self.pool = OncePool(self._executor)
        self._executor = self.pool

    def _spin_once_impl(self, timeout_sec: Any = None, wait_condition: Callable[[], bool] = lambda: False) -> None:
        try:
            super()._spin_once_impl(timeout_sec, wait_condition)
        except RCLError as error:  # a waitable destroyed while the wait set was built: one lost turn
            if DESTROYED_UNDER_WAIT not in str(error):
                raise
            self._cb_iter = None
