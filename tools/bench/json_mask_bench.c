/* json_mask_bench.c - what JSON mode's vocabulary mask costs per sampled
 * token (sched/guide.c), on the default model's 49,152-token vocabulary:
 * 100 masks per state, after the first (cached) one. Not a test.
 *   make bench    (or: make build/json_mask_bench && build/json_mask_bench)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "model/model.h"
#include "sched/sched.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void)
{
    char err[256];
    struct model_load_opts lo = {0};
    model *m = model_load("models/SmolLM2-135M-Instruct.Q4_1.gguf", &lo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "json_mask_bench: %s\n", err);
        return 1;
    }
    const model_tok *tok = model_get_tok(m);
    int V = model_tok_n_vocab(tok);
    uint8_t *allow = malloc((size_t)V);
    struct sched_guide_vocab *gv = sched_guide_vocab_create(tok);
    if (!allow || !gv) {
        fprintf(stderr, "json_mask_bench: out of memory\n");
        return 1;
    }
    static const char *const states[] = {"", "{\"a\":\"some text", "{\"a\":1", "{\"a\":"};
    printf("JSON mode mask, %d-token vocabulary, 100 masks per state (cached after the first)\n", V);
    for (int k = 0; k < 4; k++) {
        struct sched_guide g;
        sched_guide_init(&g);
        for (const char *p = states[k]; *p; p++) sched_guide_step(&g, (uint8_t)*p);
        double t0 = now_s();
        sched_guide_mask(&g, gv, NULL, 0, allow);
        double t1 = now_s();
        for (int r = 0; r < 99; r++) sched_guide_mask(&g, gv, NULL, 0, allow);
        double dt = (now_s() - t0) / 100;
        int n = 0;
        for (int i = 0; i < V; i++) n += allow[i];
        printf("  after '%s': %.4f ms per mask (the first, computed: %.3f ms), %d of %d tokens allowed\n", states[k],
               dt * 1e3, (t1 - t0) * 1e3, n, V);
    }
    sched_guide_vocab_destroy(gv);
    free(allow);
    model_free(m);
    return 0;
}
