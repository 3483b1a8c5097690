"""``python -m gemma_spec_dev.soak``: the same as ``gemma-spec-soak``."""
import sys

from .cli import main

sys.exit(main())
