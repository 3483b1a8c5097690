"""Run the gemma_spec node.

``gemma-spec-serve --params-file config/embedded.yaml [--node-name N] [ROS args...]`` starts the
node and takes it through configure + activate itself (for machines without ``ros2 launch``). It
exits 1 with the reason when configure fails.

``gemma_spec_node`` (for ``ros2 run`` and the launch file) runs the same node without the automatic
transitions: a lifecycle manager (the launch file's events, ``ros2 lifecycle set``) drives it.
``gemma-spec-serve --no-autostart`` does the same.

Both shut the node down cleanly on Ctrl-C / SIGTERM: the lifecycle shutdown transition runs while
the executor still spins (the running goal ends as cancelled, the models are freed, the dynamic
n-gram cache is saved), then ROS shuts down.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import List, Optional, Sequence

# llama.cpp's CPU threads (OpenMP) spin while waiting; on a robot's shared CPU that stalls decoding
# badly (measured 0.4 vs 22 tokens/s with another process busy). Passive waiting unless the user
# chose otherwise; it must be set before llama_cpp loads the OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
from .llama_first import import_llama_cpp_first  # noqa: E402  (imports nothing else)

import_llama_cpp_first()

import rclpy  # noqa: E402
from ..executors import MultiThreadedExecutor
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from ..engine.llama_process import limit_malloc_arenas
from ..node import NODE_NAME
from ..node.node import MIN_EXECUTOR_THREADS, GemmaSpecNode


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
            status = _bring_up(node)
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


def _bring_up(node: GemmaSpecNode) -> int:
    """configure + activate; 1 (with the reason on stderr) if either fails."""
    for name, trigger in (("configure", node.trigger_configure), ("activate", node.trigger_activate)):
        if trigger() != TransitionCallbackReturn.SUCCESS:
            reason = node.configure_error if name == "configure" else "see the log"
            print(f"gemma-spec-serve: {name} failed: {reason}", file=sys.stderr)
            return 1
    node.get_logger().info("ready: send goals to ~/generate (Ctrl-C to stop)")
    return 0


def _shut_down(node: GemmaSpecNode, executor: MultiThreadedExecutor,
               spinner: threading.Thread) -> None:
    """Shutdown transition while the executor spins, then stop it and ROS."""
    if node.lifecycle_state != "finalized":
        try:
            node.trigger_shutdown()
        except Exception as exc:  # noqa: BLE001  e.g. a transition in progress; still free the engine
            node.get_logger().warning(f"shutdown transition failed ({exc}); releasing directly")
            node.release("the node is shutting down")
    executor.shutdown(timeout_sec=5.0)
    spinner.join(timeout=5.0)
    node.destroy_node()
    rclpy.try_shutdown()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``gemma-spec-serve``: configure + activate automatically."""
    return run(sys.argv if argv is None else argv, autostart_default=True)


def node_main(argv: Optional[Sequence[str]] = None) -> int:
    """``gemma_spec_node``: wait for lifecycle transitions (launch files, ros2 lifecycle)."""
    return run(sys.argv if argv is None else argv, autostart_default=False)


if __name__ == "__main__":
    sys.exit(main())
