"""rclpy layer: lifecycle node, Generate and GenerateChat action servers, parameters, diagnostics."""

#: Default name of the gemma_spec node (kept here so that clients need not import the engine).
NODE_NAME = "gemma_spec"
#: Seconds the node's process takes at most from Ctrl-C / SIGTERM to its exit: the shutdown
#: transition (the running goal stops, the engine closes and saves the learned n-gram cache) and
#: ROS's shutdown fit in it with room to spare (tools/serve.py adds up its parts), and past it the
#: process exits anyway, so that a step that never returns cannot keep it alive. A launch file
#: waits longer than this before it escalates to SIGTERM (launch/orin.launch.py).
SHUTDOWN_BOUND = 20.0


def action_name(node_path: str) -> str:
    """The Generate action of the node at ``node_path`` (e.g. "/gemma_spec" -> "/gemma_spec/generate")."""
    return f"{node_path.rstrip('/')}/generate"


def chat_action_name(node_path: str) -> str:
    """The GenerateChat action of the node at ``node_path`` ("/gemma_spec" -> "/gemma_spec/generate_chat")."""
    return f"{node_path.rstrip('/')}/generate_chat"


def spec_status_name(node_name: str) -> str:
    """The name of the node's status on /diagnostics (what rqt_robot_monitor lists)."""
    return f"{node_name}: speculative decoding"
