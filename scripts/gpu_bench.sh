#!/usr/bin/env bash
# GPU benchmark on a machine with no network (how docs/benchmarks.md's GPU figures were made).
#
# The machine gets, in a folder GPU_IN (default .gpu/ of the repo, ignored by git):
#   llama_src.tar.gz   the llama-cpp-python 0.3.36 sdist, stripped of models/docs (see below)
#   diskcache-*.whl    llama-cpp-python's one runtime dependency missing there
#   model.partN        the embedded Gemma 3 270M Q4_K_M split in pieces (transfers are size-capped)
# Steps, each one command:
#   gpu_bench.sh build     unpack the source, build llama-cpp-python with CUDA in the background
#   gpu_bench.sh piece N   keep model.partN (call once per piece)
#   gpu_bench.sh run OUT   join + check the model, wait for the build, make an F16 copy, and run
#                          gemma-spec-bench on the GPU (off / lookup / draft, F16 target + Q4 draft)
# Make the inputs here with:
#   tar czf .gpu/llama_src.tar.gz --exclude=.git --exclude='vendor/llama.cpp/models' \
#     --exclude='vendor/llama.cpp/docs' --exclude='vendor/llama.cpp/examples' ... llama_cpp_python-0.3.36
#   split -b 52000000 -d -a 1 <model.gguf> .gpu/model.part
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IN="${GPU_IN:-$ROOT/.gpu}"
WORK="${GPU_WORK:-/tmp/gemma_gpu}"
MODEL_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
CUDA_FLAGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
mkdir -p "$WORK"

case "${1:-}" in
build)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  tar xzf "$IN/llama_src.tar.gz" -C "$WORK"
  cp "$IN"/diskcache-*.whl "$WORK/"
  # setsid: the build outlives this command while the model pieces travel
  setsid nohup bash -c "cd '$WORK' && CMAKE_ARGS='$CUDA_FLAGS' CMAKE_BUILD_PARALLEL_LEVEL=\$(nproc) \
    python3 -m pip wheel --no-deps --no-build-isolation --no-cache-dir -w '$WORK/wheel' \
    '$WORK/llama_cpp_python-0.3.36' > '$WORK/build.log' 2>&1; echo \$? > '$WORK/build.rc'" \
    < /dev/null > /dev/null 2>&1 &
  echo "build started"
  ;;
piece)
  cp "$IN/model.part$2" "$WORK/"
  ls -la "$WORK"; tail -n 2 "$WORK/build.log" 2>/dev/null || true
  ;;
run)
  out="${2:?output folder}"  # gets one archive: the device tool returns few files
  res="$WORK/results"
  mkdir -p "$out" "$res"
  cat "$WORK"/model.part? > "$WORK/q4.gguf"
  echo "$MODEL_SHA256  $WORK/q4.gguf" | sha256sum -c -
  while [ ! -f "$WORK/build.rc" ]; do sleep 5; done
  cp "$WORK/build.log" "$res/build.log"
  [ "$(cat "$WORK/build.rc")" = 0 ] || { tail -40 "$WORK/build.log"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --target "$WORK/site" "$WORK"/wheel/*.whl "$WORK"/diskcache-*.whl
  export PYTHONPATH="$WORK/site:$ROOT" PYTHONUNBUFFERED=1
  python3 - "$WORK/q4.gguf" "$WORK/f16.gguf" <<'PY'
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.allow_requantize = llama_cpp.LLAMA_FTYPE_MOSTLY_F16, True
assert llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p) == 0
PY
  for pair in "q4:$WORK/q4.gguf:none" "pair:$WORK/f16.gguf:$WORK/q4.gguf"; do
    IFS=: read -r name target draft <<< "$pair"
    cat > "$WORK/$name.yaml" <<YAML
/**:
  ros__parameters:
    target.model_path: "$target"
    target.n_gpu_layers: -1
    target.n_ctx: 2048
    target.flash_attn: true
    draft.model_path: "$( [ "$draft" = none ] || echo "$draft")"
    draft.n_gpu_layers: -1
    draft.n_ctx: 2048
    spec.mode: lookup
    spec.draft_max: 8
    spec.adaptive: true
YAML
    modes=off,lookup,auto; [ "$draft" = none ] || modes=off,lookup,draft,draft+lookup,auto
    python3 -m gemma_spec_ros.tools.bench --config "$WORK/$name.yaml" --suites code,qa \
      --modes "$modes" --k 4,adaptive --repeats 2 --max-tokens 128 --baselines plain,prompt-lookup \
      --no-progress --out "$res/gpu_$name" 2>&1 | tail -n 40 || true
    tar czf "$out/gpu_results.tgz" -C "$res" .
  done
  ;;
*)
  echo "usage: $0 build | piece N | run OUT" >&2; exit 2 ;;
esac
