"""ROS-free speculative decoding engine (numpy + llama_cpp + stdlib only)."""
