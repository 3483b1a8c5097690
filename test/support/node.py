"""The node under test, three ways: a GemmaSpecNode spun in this process with a client of it
(:class:`ServedNode`, made by :func:`node_factory`, on which conftest.py's ``node_client`` rests),
``gemma-spec-serve`` in a process of its own (:func:`serving`), and the parameter values of a
config file (:func:`config_values`). The client side is :class:`gemma_spec_ros.client.GenerateClient`."""
from __future__ import annotations

import contextlib
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping

import yaml
from gemma_spec_ros.executors import MultiThreadedExecutor
from rclpy.parameter import Parameter

from gemma_spec_ros.client import GenerateClient, wait_until
from gemma_spec_ros.node import spec_status_name
from gemma_spec_ros.node.parameters import defaults

#: What gemma-spec-serve prints once its node is configured and active.
READY = "ready: send goals"


def greedy_goal(prompt: str, max_tokens: int, **fields: Any) -> Dict[str, Any]:
    """The fields of a goal at temperature 0 (for ``GenerateClient.send``): its answer depends on the
    prompt and the model only, so a test can compare it across runs; ``fields`` add or override."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **fields}


def greedy_answer(client: GenerateClient, prompt: str, max_tokens: int, **fields: Any) -> Any:
    """The result of the greedy goal ``prompt`` sent through ``client``, which must accept it."""
    run = client.send(**greedy_goal(prompt, max_tokens, **fields))
    assert run.accepted, f"the goal {prompt!r} was rejected"
    return run.wait_result()


class ServedNode:
    """A GemmaSpecNode with parameter overrides, spun by a multi-threaded executor on a thread of
    its own, plus a client of it (named ``<name>_client``); rclpy must be initialised.
    ``close()`` closes the client, releases the engine and destroys the node."""

    def __init__(self, name: str, values: Mapping[str, Any]) -> None:
        from gemma_spec_ros.node.node import MIN_EXECUTOR_THREADS, GemmaSpecNode

        self.name = name
        self.status_name = spec_status_name(name)
        self.node = GemmaSpecNode(name, parameter_overrides=[Parameter(k, value=v) for k, v in values.items()])
        self.executor = MultiThreadedExecutor(num_threads=MIN_EXECUTOR_THREADS + 2)
        self.executor.add_node(self.node)
        threading.Thread(target=self.executor.spin, daemon=True).start()
        self.client = GenerateClient(f"/{name}", name=f"{name}_client")

    def close(self) -> None:
        self.client.close()
        self.node.release("test teardown")
        self.executor.shutdown(timeout_sec=5.0)
        self.node.destroy_node()


@contextlib.contextmanager
def node_factory() -> Iterator[Callable[..., ServedNode]]:
    """``serve(name, values, *, activate=True)`` makes a :class:`ServedNode` (configured and
    activated through its client unless ``activate=False``); all are closed when the block ends,
    the last made first. rclpy must be initialised for as long as the block runs."""
    with contextlib.ExitStack() as made:
        def serve(name: str, values: Mapping[str, Any], *, activate: bool = True) -> ServedNode:
            served = ServedNode(name, values)
            made.callback(served.close)
            if activate:
                assert served.client.transition("configure"), f"{name} did not configure"
                assert served.client.transition("activate"), f"{name} did not activate"
            return served
        yield serve


def bin_path(venv_python: Path, name: str) -> str:
    """The console script ``name`` of the venv that runs the tests."""
    return str(Path(venv_python).parent / name)


@contextlib.contextmanager
def serving(repo_root: Path, venv_python: Path, overrides: Dict[str, Any], log: Path,
            node: str) -> Iterator[subprocess.Popen]:
    """gemma-spec-serve on config/embedded.yaml as ``node``, configured and active, killed at exit
    if alive; its output goes to ``log``."""
    ros_args = []
    for name, value in overrides.items():
        ros_args += ["-p", f"{name}:={str(value).lower() if isinstance(value, bool) else value}"]
    with open(log, "w") as out:
        process = subprocess.Popen(
            [bin_path(venv_python, "gemma-spec-serve"), "--params-file", "gemma_spec_ros/config/embedded.yaml",
             "--node-name", node, "--ros-args", *ros_args],
            cwd=repo_root, stdout=out, stderr=subprocess.STDOUT)
    process.log = log  # type: ignore[attr-defined]
    try:
        wait_until(lambda: READY in log.read_text() or process.poll() is not None, 300, "the server")
        assert process.poll() is None, log.read_text()
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def yaml_parameters(path: Path) -> Dict[str, Any]:
    """The ``/**: ros__parameters:`` tree of a params file, flattened to dotted names."""
    def flatten(tree: Dict[str, Any], prefix: str = "") -> Iterator[tuple]:
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flatten(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value
    return dict(flatten(yaml.safe_load(path.read_text())["/**"]["ros__parameters"]))


def config_values(repo_root: Path, name: str) -> Dict[str, Any]:
    """Every parameter's value under config/``name``: the file's over the defaults (it may set
    only declared parameters)."""
    flat = yaml_parameters(repo_root / "gemma_spec_ros" / "config" / name)
    unknown = set(flat) - set(defaults())
    assert not unknown, f"{name} sets unknown parameters {sorted(unknown)}"
    return {**defaults(), **flat}
