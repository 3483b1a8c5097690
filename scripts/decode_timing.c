// decode_timing: the time of one llama_decode pass of R rows, outside Python, with the engine's
// context parameters (n_ctx 2048, n_batch 512, swa_full, 2 threads). It tells a slow library build
// from slow code around it (docs/design.md, "Numerical facts"). Link it against the wheel's
// shared libraries or the static ones of scripts/build_native_tools.sh:
//
//   SRC=~/.cache/gemma_spec_ros/native/src/llama_cpp_python-0.3.36/vendor/llama.cpp
//   LIB=$(ls -d .venv/lib/python3*/site-packages/llama_cpp/lib)
//   gcc -O2 -I$SRC/include -I$SRC/ggml/include scripts/decode_timing.c -o /tmp/decode_timing
//       -L$LIB -lllama -lggml -lggml-base -Wl,-rpath,$LIB       (one command line)
//   /tmp/decode_timing MODEL.gguf PASSES ROWS FLASH_ATTN PROMPT_REPEATS   # e.g. ... 60 4 1 10
//
// Each pass decodes ROWS rows (all with logits) after a prompt, then removes all but the first
// from the KV cache, as a rejected verify batch is rolled back. Prints the median pass time.
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf PASSES ROWS [FLASH_ATTN 0|1] [PROMPT_REPEATS]\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    const int passes = atoi(argv[2]), rows = atoi(argv[3]);
    const int flash = argc > 4 ? atoi(argv[4]) : 0, repeats = argc > 5 ? atoi(argv[5]) : 1;
    if (passes < 1 || rows < 1 || rows > 64 || repeats < 1 || repeats > 50) {
        fprintf(stderr, "PASSES >= 1, ROWS 1..64, PROMPT_REPEATS 1..50\n");
        return 2;
    }
    llama_backend_init();
    struct llama_model *model = llama_model_load_from_file(path, llama_model_default_params());
    if (!model) return 1;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 2048; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = 1;
    cp.n_threads = 2; cp.n_threads_batch = 2; cp.swa_full = 1; cp.no_perf = 1;
    cp.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    llama_memory_t mem = llama_get_memory(ctx);

    const char *sentence = "The robot moved to the kitchen and picked up the red cup. Then it";
    char text[4096] = "";
    for (int i = 0; i < repeats; i++) strcat(text, sentence);
    llama_token prompt[1024];
    const int n_prompt = llama_tokenize(vocab, text, (int)strlen(text), prompt, 1024, 1, 0);
    struct llama_batch batch = llama_batch_init(512, 0, 1);
    batch.n_tokens = n_prompt;
    for (int i = 0; i < n_prompt; i++) {
        batch.token[i] = prompt[i]; batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0;
        batch.logits[i] = i == n_prompt - 1;
    }
    if (llama_decode(ctx, batch) != 0) return 1;

    double *times = malloc(sizeof(double) * passes);
    int pos = n_prompt;
    for (int it = 0; it < passes + 3; it++) {  // 3 warm-up passes
        const float *logits = llama_get_logits_ith(ctx, -1);
        int best = 0;
        for (int j = 1; j < n_vocab; j++) if (logits[j] > logits[best]) best = j;
        batch.n_tokens = rows;
        for (int r = 0; r < rows; r++) {
            batch.token[r] = best; batch.pos[r] = pos + r; batch.n_seq_id[r] = 1;
            batch.seq_id[r][0] = 0; batch.logits[r] = 1;
        }
        const double t0 = now_ms();
        if (llama_decode(ctx, batch) != 0) return 1;
        if (it >= 3) times[it - 3] = now_ms() - t0;
        if (rows > 1) llama_memory_seq_rm(mem, 0, pos + 1, -1);
        pos++;
    }
    qsort(times, passes, sizeof(double), by_value);
    printf("rows=%d flash_attn=%d prompt=%d tokens: median %.2f ms, p10 %.2f, p90 %.2f (%d passes)\n",
           rows, flash, n_prompt, times[passes / 2], times[passes / 10], times[passes * 9 / 10], passes);
    free(times);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
