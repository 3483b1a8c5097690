# Pinned versions that more than one script needs (sourced by setup.sh and build_native_tools.sh).
# llama-cpp-python's release also pins the llama.cpp it vendors (0.3.36: ggml-org/llama.cpp@0c1e57098);
# the wheel cache and the native tools' build are keyed on it.
LLAMA_VERSION="0.3.36"
