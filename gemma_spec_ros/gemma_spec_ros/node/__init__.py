"""rclpy layer: lifecycle node, Generate action server, parameters, diagnostics."""

#: Default name of the gemma_spec node (kept here so that clients need not import the engine).
NODE_NAME = "gemma_spec"


def action_name(node_path: str) -> str:
    """The Generate action of the node at ``node_path`` (e.g. "/gemma_spec" -> "/gemma_spec/generate")."""
    return f"{node_path.rstrip('/')}/generate"


def spec_status_name(node_name: str) -> str:
    """The name of the node's status on /diagnostics (what rqt_robot_monitor lists)."""
    return f"{node_name}: speculative decoding"
