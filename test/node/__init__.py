"""Tests of the node on real rclpy: lifecycle, goals, parameters, diagnostics, gemma-spec-serve."""
