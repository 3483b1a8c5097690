"""Run the gemma_spec node.

``gemma-spec-serve --params-file config/embedded.yaml [--node-name N] [ROS args...]`` starts the
node and takes it through configure + activate itself (for machines without ``ros2 launch``). It
exits 1 with the reason when configure fails.

``gemma_spec_node`` (for ``ros2 run``, launch files and lifecycle managers) runs the same node
without the automatic transitions: a lifecycle manager (``ros2 lifecycle set``, nav2's
lifecycle_manager) drives it. ``gemma-spec-serve --no-autostart`` does the same.
``gemma_spec_node --autostart`` (what launch/orin.launch.py runs) configures + activates at every
process start, a respawned one too, with no request over DDS that a restart could lose; if configure
fails it stays up, unconfigured, with the reason on /diagnostics, for ``ros2 lifecycle set``.

Both shut the node down cleanly on Ctrl-C / SIGTERM: the lifecycle shutdown transition runs while
the executor still spins (the running goal ends as cancelled, the models are freed, the dynamic
n-gram cache is saved), then ROS shuts down, all within :data:`~gemma_spec_ros.node.SHUTDOWN_BOUND`
seconds: every wait on the way is bounded, and a process that is still there at the bound, or an
executor thread that outlives the shutdown (a step that never returned), ends the process at once
with status 1 rather than leave it hanging for ``ros2 launch`` to kill.
"""
from __future__ import annotations

import argparse
import concurrent.futures.thread
import os
import signal
import sys
import threading
import time
from typing import List, Optional, Sequence

# llama.cpp's CPU threads (OpenMP) spin while waiting; on a robot's shared CPU that stalls decoding
# badly (measured 0.4 vs 22 tokens/s with another process busy). Passive waiting unless the user
# chose otherwise; it must be set before llama_cpp loads the OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
from ..engine.llama.process import import_llama_cpp_first  # noqa: E402  (imports nothing else)

import_llama_cpp_first()

import rclpy  # noqa: E402
from ..executors import MultiThreadedExecutor
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from ..engine.llama.process import limit_malloc_arenas
from ..node import NODE_NAME, SHUTDOWN_BOUND
from ..node.goal_server import DISPATCHER_JOIN, RESULT_GRACE, SHUTDOWN_STOP_TIMEOUT
from ..node.node import MIN_EXECUTOR_THREADS, SHUTDOWN_CLOSE_TIMEOUT, GemmaSpecNode

#: Seconds the executor, its spinning thread and its idle pool threads get to end after the
#: shutdown transition.
EXECUTOR_JOIN = 2.0
#: The longest the shutdown's bounded waits add up to (the learned cache's save, which is bounded
#: by its size, comes on top): SHUTDOWN_BOUND leaves room for it.
SHUTDOWN_WAITS = SHUTDOWN_STOP_TIMEOUT + DISPATCHER_JOIN + RESULT_GRACE + SHUTDOWN_CLOSE_TIMEOUT + 2 * EXECUTOR_JOIN


def parse_args(argv: Sequence[str], autostart_default: bool) -> argparse.Namespace:
    """Our options; ROS arguments (``--ros-args ...``) are left for rclpy."""
    parser = argparse.ArgumentParser(
        prog="gemma-spec-serve" if autostart_default else "gemma_spec_node",
        description="Serve gemma_spec_msgs/action/Generate with speculative decoding.",
        epilog="Arguments after --ros-args go to ROS (e.g. -p spec.mode:=off, -r __ns:=/robot).")
    parser.add_argument("--params-file", action="append", default=[], metavar="YAML",
                        help="ROS parameters file (the /**: ros__parameters: layout); repeatable")
    parser.add_argument("--node-name", default=NODE_NAME, help="node name (default: %(default)s)")
    parser.add_argument("--no-autostart", dest="autostart", action="store_false",
                        default=autostart_default,
                        help="do not configure + activate; wait for lifecycle transitions")
    parser.add_argument("--autostart", dest="autostart", action="store_true",
                        help="configure + activate at start" + (
                            "" if autostart_default else "; if configure fails, stay unconfigured"))
    args = parser.parse_args(remove_ros_args(list(argv))[1:])
    for path in args.params_file:
        if not os.path.isfile(path):
            parser.error(f"--params-file {path}: no such file")
    return args


def ros_args(argv: Sequence[str], params_files: Sequence[str]) -> List[str]:
    """The argument list for ``rclpy.init``: a ROS section with our params files, then ``argv``.

    Later ROS arguments win, so the user's own ``--ros-args -p name:=value`` overrides the files.
    rcl ignores the non-ROS options.

    >>> ros_args(["serve", "--ros-args", "-p", "a:=1"], ["x.yaml"])
    ['serve', '--ros-args', '--params-file', 'x.yaml', '--', '--ros-args', '-p', 'a:=1']
    """
    if not params_files:
        return list(argv)
    files = [arg for path in params_files for arg in ("--params-file", path)]
    return [argv[0], "--ros-args", *files, "--", *argv[1:]]


def run(argv: Sequence[str], autostart_default: bool) -> int:
    """Run the node until Ctrl-C / SIGTERM; returns the process exit status."""
    args = parse_args(argv, autostart_default)
    limit_malloc_arenas()  # before rclpy and the executor start their threads (see the function)
    # rclpy's own handlers would shut the context down at once, before the shutdown transition
    # could end the running goal and save the dynamic cache; ours only ask the main loop to stop.
    rclpy.init(args=ros_args(argv, args.params_file),
               signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    node = GemmaSpecNode(args.node_name)
    executor = MultiThreadedExecutor(num_threads=MIN_EXECUTOR_THREADS + 2)
    executor.add_node(node)
    died: List[BaseException] = []

    def spin() -> None:
        try:
            executor.spin()
        except BaseException as exc:  # noqa: BLE001  reported by the main loop
            died.append(exc)

    spinner = threading.Thread(target=spin, name="executor", daemon=True)
    spinner.start()
    status = 0
    try:
        if args.autostart:
            status = _bring_up(node, "gemma-spec-serve" if autostart_default else "gemma_spec_node")
            if status and not autostart_default:  # under a launch file: stay up for ros2 lifecycle
                status = 0
        while status == 0 and not stop.wait(0.2) and spinner.is_alive():
            pass
        if status == 0 and not stop.is_set() and not spinner.is_alive():
            # Nothing answers goals, cancels, parameters or transitions any more: exit non-zero
            # so that respawn / systemd restarts the node.
            reason = repr(died[0]) if died else "it returned"
            node.get_logger().fatal(f"the executor stopped ({reason}): the node cannot serve; "
                                    "exiting with status 1")
            print(f"gemma-spec-serve: the executor stopped: {reason}", file=sys.stderr)
            status = 1
    finally:
        _shut_down(node, executor, spinner)
        # Shut down cleanly: a late Ctrl-C (ros2 launch forwards SIGINT after the terminal already
        # sent one to the whole process group) must not kill the interpreter while it finalizes
        # (CPython restores the default handler there, but leaves an ignored signal ignored): CI
        # saw the node exit "-2" right after it had saved its cache.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    return status


def _bring_up(node: GemmaSpecNode, prog: str) -> int:
    """configure + activate; 1 (with the reason on stderr) if either fails."""
    for name, trigger in (("configure", node.trigger_configure), ("activate", node.trigger_activate)):
        with node.transition_lock:
            outcome = trigger()
        if outcome != TransitionCallbackReturn.SUCCESS:
            reason = node.configure_error if name == "configure" else "see the log"
            print(f"{prog}: {name} failed: {reason}", file=sys.stderr)
            return 1
    node.get_logger().info("ready: send goals to ~/generate (Ctrl-C to stop)")
    return 0


def _shut_down(node: GemmaSpecNode, executor: MultiThreadedExecutor,
               spinner: threading.Thread) -> None:
    """Shutdown transition while the executor spins, then stop it and ROS, within SHUTDOWN_BOUND.

    A watchdog ends the process at the bound whatever still runs. A thread left at the end is an
    executor thread still in a callback (a step that never returned): the interpreter would wait
    for it at exit for ever, so the process exits at once instead.
    """
    watchdog = threading.Timer(SHUTDOWN_BOUND, _exit_now,
                               args=(f"the shutdown took more than {SHUTDOWN_BOUND:.0f} s",))
    watchdog.daemon = True
    watchdog.start()
    if node.lifecycle_state != "finalized":
        _shutdown_transition(node)
    executor.shutdown(timeout_sec=EXECUTOR_JOIN)
    spinner.join(timeout=EXECUTOR_JOIN)
    left = _threads_left(executor)
    node.destroy_node()
    rclpy.try_shutdown()
    watchdog.cancel()
    if left:
        _exit_now(f"thread(s) {', '.join(left)} still running after the shutdown (a generation "
                  "step that did not return)")


def _shutdown_transition(node: GemmaSpecNode) -> None:
    """The shutdown transition, after a transition in progress if it ends soon; else (a configure
    still loading the models, a transition that failed) the engine is released directly."""
    reason = "the node is shutting down"
    if not node.transition_lock.acquire(timeout=SHUTDOWN_STOP_TIMEOUT):
        node.get_logger().warning(f"{reason} while it is {node.lifecycle_state}: releasing directly")
    else:
        try:
            node.trigger_shutdown()
            return
        except Exception as exc:  # noqa: BLE001  e.g. from a state with no shutdown; still free the engine
            node.get_logger().warning(f"shutdown transition failed ({exc}); releasing directly")
        finally:
            node.transition_lock.release()
    node.release(reason, stop_timeout=SHUTDOWN_STOP_TIMEOUT, close_timeout=SHUTDOWN_CLOSE_TIMEOUT)


def _threads_left(executor: MultiThreadedExecutor) -> List[str]:
    """Names of the threads the interpreter would wait for at exit that are still alive after the
    pool's idle threads were told to end and given :data:`EXECUTOR_JOIN` seconds (Humble's rclpy
    never ends its executor's pool). Thread pools' workers count whatever their daemon flag (they
    inherit it from the spinning thread): concurrent.futures joins every one of them at exit."""
    executor.pool.shutdown(wait=False)
    pooled = set(getattr(concurrent.futures.thread, "_threads_queues", {}).keys())
    others = [t for t in threading.enumerate()
              if t is not threading.current_thread() and (not t.daemon or t in pooled)]
    deadline = time.monotonic() + EXECUTOR_JOIN
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in others if t.is_alive()]


def _exit_now(reason: str) -> None:
    """End the process at once with status 1 (no interpreter shutdown, which would wait for every
    non-daemon thread): the node could not shut down cleanly."""
    print(f"gemma-spec-serve: {reason}: exiting now with status 1", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``gemma-spec-serve``: configure + activate automatically."""
    return run(sys.argv if argv is None else argv, autostart_default=True)


def node_main(argv: Optional[Sequence[str]] = None) -> int:
    """``gemma_spec_node``: wait for lifecycle transitions (launch files, ros2 lifecycle)."""
    return run(sys.argv if argv is None else argv, autostart_default=False)


if __name__ == "__main__":
    sys.exit(main())
