"""Tests of the tools and the package: the benches, the soak, the tiny GGUF writer, packaging."""
