#!/usr/bin/env bash
# Builds llama.cpp's own n-gram lookup tools, to cross-check gemma_spec_ros against them:
#   llama-lookup-create  llama-lookup  llama-lookup-stats  llama-speculative-simple  llama-server
# from the llama.cpp that llama-cpp-python vendors (the same version the engine links), with the
# CPU-safe flags of scripts/setup.sh. Optional: nothing in the package needs these binaries; the
# cross-check test skips without them. See docs/native_tools.md.
#
# Idempotent: a second run with the same version and flags only checks a stamp.
# Binaries: $GEMMA_SPEC_CACHE/native/bin (default ~/.cache/gemma_spec_ros/native/bin).
#
# Environment:
#   GEMMA_SPEC_CACHE  cache dir                        (default: ~/.cache/gemma_spec_ros)
#   PYTHON            interpreter whose pip downloads  (default: <repo>/.venv/bin/python, else python3)
#   JOBS              parallel compile jobs            (default: 2)
#   NATIVE_CMAKE_ARGS extra cmake flags (e.g. "-DGGML_CUDA=on" on a Jetson Orin)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${GEMMA_SPEC_CACHE:-$HOME/.cache/gemma_spec_ros}"
NATIVE="$CACHE/native"
. "$ROOT/scripts/versions.sh"  # LLAMA_VERSION
JOBS="${JOBS:-2}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
TARGETS=(llama-lookup-create llama-lookup llama-lookup-stats llama-speculative-simple llama-server)
# GGML_NATIVE=OFF: -march=native enables the AMX backend, which segfaults on these CPUs (docs/design.md).
# Static libraries, so the binaries copied to bin/ need no libllama.so beside them.
CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON
)
# shellcheck disable=SC2206  # word splitting of the user's extra flags is intended
CMAKE_FLAGS+=(${NATIVE_CMAKE_ARGS:-})

log() { printf '[native] %s\n' "$*"; }

key="$LLAMA_VERSION $(printf '%s ' "${CMAKE_FLAGS[@]}") ${TARGETS[*]}"
stamp="$NATIVE/bin/.stamp"
all_built() { for t in "${TARGETS[@]}"; do [ -x "$NATIVE/bin/$t" ] || return 1; done; }
if all_built && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
  log "up to date: $NATIVE/bin"
  exit 0
fi

mkdir -p "$NATIVE/sdist" "$NATIVE/bin"
sdist="$NATIVE/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
  log "downloading the llama-cpp-python $LLAMA_VERSION source distribution"
  "$PYTHON" -m pip --disable-pip-version-check -q download --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMA_VERSION" -d "$NATIVE/sdist"
fi

src="$NATIVE/src/llama_cpp_python-$LLAMA_VERSION"
if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
  log "unpacking $sdist"
  rm -rf "$src"
  mkdir -p "$NATIVE/src"
  tar -xzf "$sdist" -C "$NATIVE/src"
fi

build="$NATIVE/build"
log "configuring llama.cpp (vendored by llama-cpp-python $LLAMA_VERSION) in $build"
cmake -S "$src/vendor/llama.cpp" -B "$build" "${CMAKE_FLAGS[@]}" > "$NATIVE/cmake.log" 2>&1 ||
  { log "cmake configure failed, see $NATIVE/cmake.log"; tail -20 "$NATIVE/cmake.log"; exit 1; }
log "building ${TARGETS[*]} with -j$JOBS (several minutes on 2 cores)"
cmake --build "$build" --target "${TARGETS[@]}" -j "$JOBS" >> "$NATIVE/cmake.log" 2>&1 ||
  { log "build failed, see $NATIVE/cmake.log"; tail -30 "$NATIVE/cmake.log"; exit 1; }

for t in "${TARGETS[@]}"; do
  install -m 0755 "$build/bin/$t" "$NATIVE/bin/$t"
done
echo "$key" > "$stamp"
log "ready: $NATIVE/bin (${TARGETS[*]})"
