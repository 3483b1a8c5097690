"""Bring up gemma_spec on a robot (Jetson Orin): load the models, then serve Generate.

    ros2 launch gemma_spec_ros orin.launch.py models_dir:=/opt/models spec_mode:=draft

The lifecycle node configures (the models load) and activates itself at every start of its process,
a respawned one too. Arguments:
    params_file  parameter file            (default: <share>/gemma_spec_ros/config/orin.yaml)
    models_dir   folder with the GGUFs     (default: '' = the model paths written in params_file)
    spec_mode    a value of spec.mode (docs/parameters.md)  (default: '' = params_file's spec.mode)
    respawn      true | false: start the node again when its process dies (default: true)
    autostart    true | false: false leaves the transitions to a lifecycle manager (nav2's, or
                 ``ros2 lifecycle set``) (default: true)

Why the node starts itself rather than this file sending it ``configure`` when its process starts:
after a ``kill -9`` the launch's ChangeState client stays matched to the dead process's service
until DDS's lease on it runs out, so a request sent at the respawn goes to the dead process and is
lost, and the new node stayed unconfigured (tried with launch_ros's LifecycleNode + OnProcessStart).
``gemma_spec_node --autostart`` runs the transitions in its own process: nothing to lose.

Ctrl-C: the node ends within SHUTDOWN_BOUND seconds (gemma_spec_ros.node); launch sends SIGTERM only
after :data:`SIGTERM_TIMEOUT` and SIGKILL :data:`SIGKILL_TIMEOUT` seconds later (launch's defaults,
5 + 5, would kill a node that is still saving its learned cache).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

from ament_index_python.packages import get_package_share_directory
from launch import LaunchContext, LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode

from gemma_spec_ros.engine.modes import SPEC_MODES
from gemma_spec_ros.node import NODE_NAME, SHUTDOWN_BOUND

PACKAGE = "gemma_spec_ros"
TARGET_MODEL_FILE = "gemma-3-4b-it-q4_0.gguf"  # Gemma 3 4B-it, Google's QAT Q4_0 release
DRAFT_MODEL_FILE = "gemma-3-1b-it-q4_0.gguf"  # Gemma 3 1B-it, same tokenizer
#: Seconds from Ctrl-C to launch's SIGTERM: the node's own bound, and time for its process to end.
SIGTERM_TIMEOUT = SHUTDOWN_BOUND + 5.0
#: Seconds from SIGTERM to SIGKILL (the node treats SIGTERM as Ctrl-C; it is already ending).
SIGKILL_TIMEOUT = 5.0
#: Seconds before a dead node's process starts again (the models load again then).
RESPAWN_DELAY = 2.0


def parameter_overrides(models_dir: str, spec_mode: str) -> Dict[str, Any]:
    """Parameters that replace the file's values; an empty argument keeps the file's value."""
    overrides: Dict[str, Any] = {}
    if models_dir:
        overrides["target.model_path"] = os.path.join(models_dir, TARGET_MODEL_FILE)
        overrides["draft.model_path"] = os.path.join(models_dir, DRAFT_MODEL_FILE)
    if spec_mode:
        overrides["spec.mode"] = spec_mode
    return overrides


def flag(context: LaunchContext, name: str) -> bool:
    """A true/false launch argument (YAML's spellings, as ``ros2 launch`` users write them)."""
    value = LaunchConfiguration(name).perform(context).strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise ValueError(f"launch argument {name}:={value}: expected true or false")
    return value in ("true", "1", "yes", "on")


def launch_node(context: LaunchContext) -> List[Any]:
    """The lifecycle node; it runs its own configure + activate at each start unless autostart:=false."""
    params_file = LaunchConfiguration("params_file").perform(context)
    overrides = parameter_overrides(LaunchConfiguration("models_dir").perform(context),
                                    LaunchConfiguration("spec_mode").perform(context))
    enclave = LaunchConfiguration("enclave").perform(context).strip()
    # SROS2: the override wins over --enclave and over what the launch process itself inherited
    # (its own enclave), so the node runs in its enclave whatever the launching shell set.
    extra_env = {"ROS_SECURITY_ENCLAVE_OVERRIDE": enclave} if enclave else None
    return [LifecycleNode(
        package=PACKAGE,
        executable="gemma_spec_node",
        name=NODE_NAME,
        namespace="",
        output="screen",
        arguments=["--autostart"] if flag(context, "autostart") else [],
        parameters=[params_file, overrides] if overrides else [params_file],
        respawn=flag(context, "respawn"),
        respawn_delay=RESPAWN_DELAY,
        sigterm_timeout=str(SIGTERM_TIMEOUT),
        sigkill_timeout=str(SIGKILL_TIMEOUT),
        additional_env=extra_env,
    )]


def generate_launch_description() -> LaunchDescription:
    default_params = os.path.join(get_package_share_directory(PACKAGE), "config", "orin.yaml")
    return LaunchDescription([
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="ROS parameter file of the node"),
        DeclareLaunchArgument(
            "models_dir", default_value="",
            description=f"folder holding {TARGET_MODEL_FILE} (target) and {DRAFT_MODEL_FILE} "
                        "(draft); empty: the model paths of params_file"),
        DeclareLaunchArgument("spec_mode", default_value="",
                              description=" | ".join(SPEC_MODES) + "; empty: params_file's spec.mode"),
        DeclareLaunchArgument("respawn", default_value="true",
                              description="start the node again when its process dies"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="configure + activate at every process start; false: "
                                          "a lifecycle manager drives the transitions"),
        DeclareLaunchArgument("enclave", default_value="",
                              description="SROS2 enclave of the node (e.g. /robot/gemma_spec); empty: "
                                          "the launching shell's security settings"),
        OpaqueFunction(function=launch_node),
    ])
