"""gemma_spec_dev: the rigs that measure and stress gemma_spec_ros from outside (not run on a robot).

- ``bench``: ``gemma-spec-bench`` and ``gemma-spec-bench-constrained``, speed and acceptance of
  the speculative modes against same-run baselines;
- ``soak``: ``gemma-spec-soak``, the node served as a subprocess and driven like a busy robot.

Imports go one way: this package uses ``gemma_spec_ros`` (engine, node, client, tools), and nothing
in ``gemma_spec_ros`` imports it.
"""
