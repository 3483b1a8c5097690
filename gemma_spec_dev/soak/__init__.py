"""``gemma-spec-soak``: the node served as a subprocess and driven like a busy robot (see :mod:`.driver`)."""
