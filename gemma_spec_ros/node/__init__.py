"""rclpy layer: lifecycle node, Generate action server, parameters, diagnostics."""
