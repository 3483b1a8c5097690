"""Tests of gemma_spec_ros.engine on real GGUF files and scripted logits: no ROS imported here."""
