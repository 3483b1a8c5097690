"""rclpy layer: lifecycle node, Generate action server, parameters, diagnostics."""

#: Default name of the gemma_spec node (kept here so that clients need not import the engine).
NODE_NAME = "gemma_spec"
