"""``python -m gemma_spec_dev.bench``: the same as ``gemma-spec-bench``."""
import sys

from .cli import main

sys.exit(main())
