"""Tests through the ROS tools a user runs: `ros2 launch`, the `ros2` CLI, rqt."""
