#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md: llama-cpp-python built with CUDA on a machine that has no
# network access, then gemma-spec-bench on the embedded model (all layers on the GPU).
#
# Everything the machine needs is carried in beforehand, in folders given to `stage`:
#   llama_cpp_python-*.tar.gz  llama-cpp-python's sdist (trimmed of vendor/llama.cpp/models, docs and
#                              tests it is 4 MB)
#   diskcache-*.whl            its one runtime dependency missing from a CUDA image
#   model.sha256               sha256sum of the Q4_K_M model
#   part.1 part.2 ...          the Q4_K_M model split into parts (split -b) small enough to carry
# Subcommands, run from the repository root:
#   stage DIR...   copy carried folders into $STAGE (kept there between calls)
#   build          start the CUDA build of llama-cpp-python in the background (setsid), return at once
#   prepare        wait for the build, install it, assemble and check the model, make the F16 copy
#   bench OUT q4|pair  prepare, then gemma-spec-bench on the Q4_K_M model (off, lookup, auto and the
#                  llama-cpp-python baselines) or on the F16 copy with the Q4_K_M model as draft (all
#                  modes); results in OUT/gpu_<name>.tar.gz
# Environment: STAGE (default /root/gemma_gpu_stage), CUDA_ARCH (default 90 = Hopper),
#              GPU_BENCH_ARGS (extra gemma-spec-bench arguments, e.g. "--repeats 1").
set -euo pipefail
STAGE="${STAGE:-/root/gemma_gpu_stage}"
CUDA_ARCH="${CUDA_ARCH:-90}"
PY="${PYTHON:-python3}"
Q4="$STAGE/gemma-3-270m-q4_k_m.gguf"
F16="$STAGE/gemma-3-270m-f16.gguf"
export PYTHONPATH="$STAGE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$STAGE"

stage() {
  for dir in "$@"; do cp -r "$dir"/. "$STAGE"/; done
  ls -la "$STAGE"
}

build() {
  local src
  src="$(ls "$STAGE"/llama_cpp_python-*.tar.gz | head -1)"
  rm -rf "$STAGE/build" && mkdir -p "$STAGE/build"
  tar xzf "$src" -C "$STAGE/build"
  # FlashAttention kernels off (the engine does not enable flash attention by default): a much
  # shorter build. Only the machine's own architecture is compiled.
  local flags="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF"
  flags="$flags -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  flags="$flags -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
  rm -f "$STAGE/build.rc"
  setsid nohup bash -c "cd '$STAGE/build' && CMAKE_ARGS='$flags' CMAKE_BUILD_PARALLEL_LEVEL=\$(nproc) \
    $PY -m pip wheel --no-deps --no-build-isolation --no-index -v -w '$STAGE/wheel' ./llama_cpp_python-* \
    > '$STAGE/build.log' 2>&1; echo \$? > '$STAGE/build.rc'" > /dev/null 2>&1 < /dev/null &
  echo "build started; log: $STAGE/build.log"
}

params_file() {  # params_file PATH TARGET [DRAFT]: a node params file with every layer on the GPU
  cat > "$1" <<YAML
/**:
  ros__parameters:
    target: {model_path: "$2", n_gpu_layers: -1, n_ctx: 2048, n_batch: 512, n_threads: 0}
    draft: {model_path: "${3:-}", n_gpu_layers: -1}
    spec: {mode: lookup, draft_max: 4, draft_min: 0, adaptive: true, verification: exact}
    lookup: {ngram_min: 1, ngram_max: 4}
YAML
}

prepare() {  # wait for the build, install it, assemble + check the model, make the F16 copy (idempotent)
  local t0
  t0=$(date +%s)
  while [ ! -f "$STAGE/build.rc" ]; do sleep 5; done
  echo "build finished (waited $(( $(date +%s) - t0 )) s here), rc=$(cat "$STAGE/build.rc")"
  [ "$(cat "$STAGE/build.rc")" = 0 ] || { tail -40 "$STAGE/build.log"; exit 1; }
  if [ ! -d "$STAGE/site/llama_cpp" ]; then
    $PY -m pip install -q --no-deps --no-index --target "$STAGE/site" "$STAGE"/wheel/llama_cpp_python-*.whl \
      "$STAGE"/diskcache-*.whl
  fi
  if [ ! -f "$Q4" ]; then
    cat $(ls "$STAGE"/part.* | sort -V) > "$Q4"
    (cd "$STAGE" && sed "s#  .*#  $Q4#" model.sha256 | sha256sum -c -)
  fi
  if [ ! -f "$F16" ]; then
    $PY -c "
import ctypes, llama_cpp, sys
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16; p.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))" \
      "$Q4" "$F16" > /dev/null 2>&1
  fi
  params_file "$STAGE/gpu_q4.yaml" "$Q4"
  params_file "$STAGE/gpu_pair.yaml" "$F16" "$Q4"
}

bench() {  # bench OUT q4|pair
  local out="$1" name="$2" rc=0
  prepare
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" || true
  local modes="off,lookup,auto" baselines="on"
  if [ "$name" = pair ]; then modes="all"; baselines="plain"; fi
  # ${GPU_BENCH_ARGS} is split on purpose (several arguments)
  # shellcheck disable=SC2086
  timeout "${GPU_BENCH_TIMEOUT:-500}" $PY -m gemma_spec_dev.bench --config "$STAGE/gpu_$name.yaml" \
    --suites all --modes "$modes" --baselines "$baselines" --no-progress --out "$out/gpu_$name" \
    ${GPU_BENCH_ARGS:-} > "$out/gpu_$name.txt" 2>&1 || rc=$?
  echo "bench $name rc=$rc" | tee -a "$out/gpu_$name.txt"
  tail -40 "$out/gpu_$name.txt"
  tar czf "$out/gpu_$name.tar.gz" -C "$out" gpu.txt "gpu_$name.txt" "gpu_$name" 2>/dev/null || true
}

case "${1:-}" in
  stage) shift; stage "$@" ;;
  build) build ;;
  prepare) prepare ;;
  bench) bench "$2" "$3" ;;
  *) echo "usage: $0 stage DIR... | build | prepare | bench OUT q4|pair" >&2; exit 2 ;;
esac
