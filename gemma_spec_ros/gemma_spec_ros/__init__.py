"""gemma_spec_ros: lossless speculative decoding LLM node for ROS 2."""
