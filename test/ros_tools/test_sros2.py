"""The SROS2 policy (gemma_spec_ros/config/sros2/policy.xml) against the node as it runs.

1. Always: every topic, service and action that the running node (configured, active, after a goal
   and a chat turn) and a planner create, read from the live ROS graph, is granted to their enclave
   by the policy (the embedded model chats in the template file given as chat.template_path).
   A new entity without a policy line fails here (a test mutates the policy to show it).
2. Where sros2 and DDS-Security plugins are installed (scripts/install_sros2.sh: sros2 and Cyclone
   DDS's plugins; the Fast DDS of the Jazzy wheels has none): a keystore, enclaves and permissions
   made by sros2 from the policy, and the node run with ``ROS_SECURITY_STRATEGY=Enforce``: it
   configures and activates, serves a planner enclave's goal, answers an operator's
   ``ros2 param get`` and ``ros2 lifecycle get``, and DDS refuses what an enclave is not granted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator

import pytest
import rclpy
from action_msgs.msg import GoalStatus

from gemma_spec_ros.client import wait_until
from gemma_spec_ros.node import NODE_NAME
from support import action_planner
from support.chat import embedded_template_file
from support.node import READY, ServedNode
from support.sros2_policy import enclave_grants, flattened, settled_entities, ungranted

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "gemma_spec_ros" / "config" / "sros2" / "policy.xml"
NODE_ENCLAVE, PLANNER_ENCLAVE = "/robot/gemma_spec", "/robot/planner"
LAUNCH_ENCLAVE, OPERATOR_ENCLAVE = "/robot/launch", "/robot/operator"
ENCLAVES = (NODE_ENCLAVE, PLANNER_ENCLAVE, LAUNCH_ENCLAVE, OPERATOR_ENCLAVE)
PROMPT = "The inspection robot's hourly log.\nHour 1: corridor clear.\nHour 2:"
SECURITY_ENV = Path(sys.prefix) / "opt" / "sros2" / "env"
#: What a lifecycle node creates beyond a node (common/lifecycle_node.xml).
LIFECYCLE_NAMES = ("change_state", "get_state", "get_available_states", "get_available_transitions",
                   "get_transition_graph", "transition_event")


@pytest.fixture(scope="module")
def served(node_client: Callable[..., ServedNode], tmp_path_factory: pytest.TempPathFactory,
           embedded_model_path: Path) -> ServedNode:
    """The node under the launch file's name, configured and active, after it served a planner's goal."""
    folder = tmp_path_factory.mktemp("sros2")
    return node_client(NODE_NAME, {
        "target.model_path": str(embedded_model_path), "target.n_ctx": 512,
        "lookup.dynamic_path": str(folder / "dynamic.bin"), "lookup.cache_dir": str(folder),
        "chat.template_path": str(embedded_template_file(folder)),
    })


@pytest.fixture(scope="module")
def planner(served: ServedNode) -> Iterator[rclpy.node.Node]:
    """A planner node that has sent one goal and one chat turn, and got their results; it keeps
    both action clients, so the graph shows them."""
    node = rclpy.create_node(action_planner.NAME)
    status, text = action_planner.generate(node, f"/{NODE_NAME}", PROMPT, 8, keep=True)
    assert status == GoalStatus.STATUS_SUCCEEDED and text
    status, call = action_planner.chat(node, f"/{NODE_NAME}", "Go to the dock.", 48, keep=True)
    assert status == GoalStatus.STATUS_SUCCEEDED and call.startswith("navigate ")
    yield node
    node.destroy_node()


@pytest.fixture(scope="module")
def graph(served: ServedNode, planner: rclpy.node.Node) -> Dict[str, Dict[str, set]]:
    """What the node and the planner created, from the graph (the planner's node looks)."""
    return {name: settled_entities(planner, name) for name in (NODE_NAME, action_planner.NAME)}


def test_the_node_creates_what_it_serves(graph: Dict[str, Dict[str, set]]) -> None:
    node = graph[NODE_NAME]
    assert node["execute"] == {f"/{NODE_NAME}/generate", f"/{NODE_NAME}/generate_chat"}
    assert {f"/{NODE_NAME}/change_state", f"/{NODE_NAME}/set_parameters"} <= node["reply"]
    assert {"/diagnostics", "/rosout", f"/{NODE_NAME}/spec_stats", f"/{NODE_NAME}/transition_event"} <= node["publish"]


def test_the_policy_grants_the_node_every_entity_it_created(graph: Dict[str, Dict[str, set]]) -> None:
    assert ungranted(graph[NODE_NAME], enclave_grants(POLICY, NODE_ENCLAVE)) == []


def test_the_policy_grants_the_planner_every_entity_it_created(graph: Dict[str, Dict[str, set]]) -> None:
    planner = graph[action_planner.NAME]
    assert planner["call"] == {f"/{NODE_NAME}/generate", f"/{NODE_NAME}/generate_chat"}
    assert ungranted(planner, enclave_grants(POLICY, PLANNER_ENCLAVE)) == []


def test_the_planner_may_neither_reconfigure_nor_drive_the_node() -> None:
    grants = enclave_grants(POLICY, PLANNER_ENCLAVE)
    for service in ("change_state", "set_parameters", "get_parameters"):
        assert not grants.allows("request", f"/{NODE_NAME}/{service}")
    for action in ("generate", "generate_chat"):
        assert not grants.allows("execute", f"/{NODE_NAME}/{action}")


def test_the_operator_may_drive_the_node_but_sends_no_goals() -> None:
    """The operator's tools get the lifecycle and parameters, and neither action (as a planner's)."""
    grants = enclave_grants(POLICY, OPERATOR_ENCLAVE)
    assert grants.allows("request", f"/{NODE_NAME}/change_state")
    for action in ("generate", "generate_chat"):
        assert not grants.allows("call", f"/{NODE_NAME}/{action}")


def test_an_entity_without_its_policy_line_fails_the_check(graph: Dict[str, Dict[str, set]], tmp_path: Path) -> None:
    """A copy of the policy without the ~/spec_stats line: the check names that topic."""
    copy = tmp_path / "sros2"
    subprocess.run(["cp", "-r", str(POLICY.parent), str(copy)], check=True)
    text = (copy / "policy.xml").read_text()
    assert text.count("<topic>~/spec_stats</topic>") == 1
    (copy / "policy.xml").write_text(text.replace("<topic>~/spec_stats</topic>", ""))
    assert ungranted(graph[NODE_NAME], enclave_grants(copy / "policy.xml", NODE_ENCLAVE)) == \
        [f"publish /{NODE_NAME}/spec_stats"]


# ------------------------------------------------------------------ enforced, where it can be had
def security_tools() -> Dict[str, str]:
    """The variables of scripts/install_sros2.sh's install; skips the test where there is none."""
    if not SECURITY_ENV.is_file():
        pytest.skip(f"no sros2 + DDS-Security install at {SECURITY_ENV.parent}: run scripts/install_sros2.sh "
                    "with the sros2 and rmw_cyclonedds sources (the Jazzy Fast DDS wheel has no security plugins)")
    pytest.importorskip("ros2cli", reason="the ros2 CLI (../shared/ros2-tools/install.sh .venv) is not installed")
    return dict(line.split("=", 1) for line in SECURITY_ENV.read_text().splitlines() if "=" in line)


def run(args: list, env: Dict[str, str], timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check:
        assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done


@pytest.fixture(scope="module")
def secure_env(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    """A keystore made by sros2 with an enclave and permissions (from the policy) for each
    process; the environment that enforces it. A domain of its own (Cyclone DDS takes ids above
    Fast DDS's 101): the unsecured node of the tests above may still run on this session's."""
    tools = security_tools()
    from support.ros2_cli import ros_env
    env = {**ros_env(), **tools, "ROS_DOMAIN_ID": str(100 + int(os.environ["ROS_DOMAIN_ID"]))}
    ros2 = str(Path(sys.prefix) / "bin" / "ros2")
    folder = tmp_path_factory.mktemp("keystore")
    keystore, policy = folder / "keystore", flattened(POLICY, folder / "policy.xml")
    run([ros2, "security", "create_keystore", str(keystore)], env)
    for enclave in ENCLAVES:
        run([ros2, "security", "create_enclave", str(keystore), enclave], env)
        run([ros2, "security", "create_permission", str(keystore), enclave, str(policy)], env)
    return {**env, "ROS_SECURITY_KEYSTORE": str(keystore), "ROS_SECURITY_ENABLE": "true",
            "ROS_SECURITY_STRATEGY": "Enforce"}


def as_enclave(env: Dict[str, str], enclave: str) -> Dict[str, str]:
    return {**env, "ROS_SECURITY_ENCLAVE_OVERRIDE": enclave}


def chat_params(folder: Path, model: Path) -> Path:
    """The ros2 CLI tests' params file, with the chat template the embedded model chats in."""
    from support.ros2_cli import params_file
    return params_file(folder, model, **{"chat.template_path": str(embedded_template_file(folder))})


@pytest.fixture(scope="module")
def secure_node(secure_env: Dict[str, str], tmp_path_factory: pytest.TempPathFactory,
                embedded_model_path: Path) -> Iterator[subprocess.Popen]:
    """gemma-spec-serve in the node's enclave under Enforce, configured and active."""
    folder = tmp_path_factory.mktemp("secure_node")
    log = folder / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [str(Path(sys.prefix) / "bin" / "gemma-spec-serve"), "--params-file",
             str(chat_params(folder, embedded_model_path)), "--ros-args", "--enclave", NODE_ENCLAVE],
            env=secure_env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: READY in log.read_text() or process.poll() is not None, 300, "the secured node")
        assert process.poll() is None, log.read_text()
        assert "Found security directory" in log.read_text()
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.timeout(600)
def test_under_enforce_the_node_serves_a_planners_goal(secure_env: Dict[str, str], secure_node: subprocess.Popen) -> None:
    done = run([sys.executable, action_planner.__file__, f"/{NODE_NAME}", PROMPT, "8"],
               as_enclave(secure_env, PLANNER_ENCLAVE))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == GoalStatus.STATUS_SUCCEEDED and result["text"]
    done = run([sys.executable, action_planner.__file__, f"/{NODE_NAME}", "Go to the dock.", "48", "--chat"],
               as_enclave(secure_env, PLANNER_ENCLAVE))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == GoalStatus.STATUS_SUCCEEDED and result["text"].startswith("navigate ")


@pytest.mark.timeout(600)
def test_under_enforce_an_operator_reads_parameters_and_state(secure_env: Dict[str, str],
                                                              secure_node: subprocess.Popen) -> None:
    env, ros2 = as_enclave(secure_env, OPERATOR_ENCLAVE), str(Path(sys.prefix) / "bin" / "ros2")
    assert "String value is: lookup" in run([ros2, "param", "get", f"/{NODE_NAME}", "spec.mode", "--no-daemon"], env).stdout
    assert run([ros2, "lifecycle", "get", f"/{NODE_NAME}", "--no-daemon"], env).stdout.startswith("active [3]")


@pytest.mark.timeout(600)
def test_under_enforce_an_enclave_gets_only_what_it_is_granted(secure_env: Dict[str, str],
                                                                secure_node: subprocess.Popen) -> None:
    """The operator's enclave may not send goals: DDS refuses its action client's writers."""
    done = run([sys.executable, action_planner.__file__, f"/{NODE_NAME}", PROMPT, "8"],
               as_enclave(secure_env, OPERATOR_ENCLAVE), check=False)
    assert done.returncode != 0
    assert "send_goalRequest" in done.stderr and "Failed to create action client" in done.stderr


@pytest.mark.timeout(600)
def test_under_enforce_a_node_enclave_without_the_lifecycle_profile_stops_the_node(
        secure_env: Dict[str, str], tmp_path: Path, embedded_model_path: Path) -> None:
    """The node's profile with common/node.xml instead of common/lifecycle_node.xml, as enclave
    /robot/incomplete: DDS refuses the lifecycle services' writers and the node does not start."""
    from support.ros2_cli import params_file
    text = POLICY.read_text()
    for old, new in (('<enclave path="/robot/gemma_spec">', '<enclave path="/robot/incomplete">'),
                     ('href="common/lifecycle_node.xml"', 'href="common/node.xml"')):
        assert text.count(old) == 1
        text = text.replace(old, new)
    subprocess.run(["cp", "-r", str(POLICY.parent), str(tmp_path / "sros2")], check=True)
    (tmp_path / "sros2" / "policy.xml").write_text(text)
    policy = flattened(tmp_path / "sros2" / "policy.xml", tmp_path / "incomplete.xml")
    ros2, keystore = str(Path(sys.prefix) / "bin" / "ros2"), secure_env["ROS_SECURITY_KEYSTORE"]
    plain = {k: v for k, v in secure_env.items() if not k.startswith("ROS_SECURITY_")}
    run([ros2, "security", "create_enclave", keystore, "/robot/incomplete"], plain)
    run([ros2, "security", "create_permission", keystore, "/robot/incomplete", str(policy)], plain)
    done = run([str(Path(sys.prefix) / "bin" / "gemma-spec-serve"), "--params-file",
                str(params_file(tmp_path, embedded_model_path)), "--ros-args", "--enclave", "/robot/incomplete"],
               secure_env, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and READY not in out
    refused = [line for line in out.splitlines() if "failed to create" in line]
    assert refused and any(name in refused[0] for name in LIFECYCLE_NAMES), out[-3000:]


@pytest.mark.timeout(600)
def test_under_enforce_the_launch_file_runs_the_node_in_its_enclave(
        secure_env: Dict[str, str], secure_node: subprocess.Popen, tmp_path: Path, embedded_model_path: Path) -> None:
    """`ros2 launch ... enclave:=/robot/gemma_spec` from a shell in the launch enclave: launch_ros's
    own node runs as /robot/launch, the node it starts as /robot/gemma_spec (the launch file's
    ``ROS_SECURITY_ENCLAVE_OVERRIDE``), and the node serves a planner's goal. The module's secured
    node is stopped first: the launched one has the same name."""
    from support.ros2_cli import Background
    secure_node.kill()
    secure_node.wait()
    ros2 = str(Path(sys.prefix) / "bin" / "ros2")
    launched = Background([ros2, "launch", "gemma_spec_ros", "orin.launch.py",
                           f"params_file:={chat_params(tmp_path, embedded_model_path)}", "respawn:=false",
                           f"enclave:={NODE_ENCLAVE}"], tmp_path / "launch.log", env=as_enclave(secure_env, LAUNCH_ENCLAVE))
    try:
        launched.wait_for("active: accepting goals", 300)
        assert "failed to create" not in launched.output, launched.output[-3000:]
        test_under_enforce_the_node_serves_a_planners_goal(secure_env, secure_node)
        assert launched.interrupt() == 0, launched.output[-3000:]
    finally:
        launched.close()
