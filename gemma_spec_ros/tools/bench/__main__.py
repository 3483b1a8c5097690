"""``python -m gemma_spec_ros.tools.bench``: the same as ``gemma-spec-bench``."""
import sys

from .cli import main

sys.exit(main())
