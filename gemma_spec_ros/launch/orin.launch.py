"""Bring up gemma_spec on a robot (Jetson Orin): load the models, then serve Generate.

    ros2 launch gemma_spec_ros orin.launch.py models_dir:=/opt/models spec_mode:=draft

The lifecycle node is configured (models load) and then activated (goals accepted) automatically.
Arguments:
    params_file  parameter file            (default: <share>/gemma_spec_ros/config/orin.yaml)
    models_dir   folder with the GGUFs     (default: '' = the model paths written in params_file)
    spec_mode    off | draft | lookup | draft+lookup | auto | mtp  (default: '' = params_file's spec.mode)
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

from ament_index_python.packages import get_package_share_directory
from launch import LaunchContext, LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, OpaqueFunction, RegisterEventHandler
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from lifecycle_msgs.msg import Transition

PACKAGE = "gemma_spec_ros"
TARGET_MODEL_FILE = "gemma-3-4b-it-q4_0.gguf"  # Gemma 3 4B-it, Google's QAT Q4_0 release
DRAFT_MODEL_FILE = "gemma-3-1b-it-q4_0.gguf"  # Gemma 3 1B-it, same tokenizer


def parameter_overrides(models_dir: str, spec_mode: str) -> Dict[str, Any]:
    """Parameters that replace the file's values; an empty argument keeps the file's value."""
    overrides: Dict[str, Any] = {}
    if models_dir:
        overrides["target.model_path"] = os.path.join(models_dir, TARGET_MODEL_FILE)
        overrides["draft.model_path"] = os.path.join(models_dir, DRAFT_MODEL_FILE)
    if spec_mode:
        overrides["spec.mode"] = spec_mode
    return overrides


def launch_node(context: LaunchContext) -> List[Any]:
    """The node, plus the events that configure it at start and activate it once it is inactive."""
    params_file = LaunchConfiguration("params_file").perform(context)
    overrides = parameter_overrides(LaunchConfiguration("models_dir").perform(context),
                                    LaunchConfiguration("spec_mode").perform(context))
    node = LifecycleNode(
        package=PACKAGE,
        executable="gemma_spec_node",
        name="gemma_spec",
        namespace="",
        output="screen",
        parameters=[params_file, overrides] if overrides else [params_file],
    )
    # Only after configure (configuring -> inactive): a later manual deactivate must stay inactive.
    activate_after_configure = RegisterEventHandler(OnStateTransition(
        target_lifecycle_node=node,
        start_state="configuring",
        goal_state="inactive",
        entities=[EmitEvent(event=ChangeState(
            lifecycle_node_matcher=matches_action(node),
            transition_id=Transition.TRANSITION_ACTIVATE,
        ))],
    ))
    configure_at_start = EmitEvent(event=ChangeState(
        lifecycle_node_matcher=matches_action(node),
        transition_id=Transition.TRANSITION_CONFIGURE,
    ))
    return [activate_after_configure, node, configure_at_start]


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
                              description="off | draft | lookup | draft+lookup | auto | mtp; "
                                          "empty: params_file's spec.mode"),
        OpaqueFunction(function=launch_node),
    ])
