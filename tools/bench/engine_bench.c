/* engine_bench.c - what the engine costs on the host per step, with a backend
 * that computes nothing (not a test).
 *
 *   build/engine_bench [model] [requests] [prompt] [output] [max_seqs] [budget] [json]
 *   (defaults: the default model's tokenizer and config, 256 requests of ~992
 *   prompt and 1000 output tokens, --max-num-seqs 256,
 *   --max-num-batched-tokens 8192: `tests/gpu/run.sh bench run-batch`'s offline run)
 *
 * The null backend answers every sample with a token id at once, so the wall
 * time is the scheduler, the KV pool, the prefix cache, step packing and the
 * event traffic alone: what a GPU step has to hide. Prints steps, tokens and
 * microseconds per step.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/backend.h"
#include "sched/sched.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct null_backend {
    model_backend base;
    long steps, tokens, seqs;
    double busy; /* seconds inside forward (picking allowed tokens), left out of the engine's time */
};

static size_t null_block_bytes(model_backend *b, int block_size)
{
    (void)b;
    return (size_t)block_size * 64;
}
static int null_kv_alloc(model_backend *b, int n, int bs, char *err, size_t errlen)
{
    (void)b, (void)n, (void)bs, (void)err, (void)errlen;
    return 0;
}
static int null_forward(model_backend *b, struct step *s, char *err, size_t errlen)
{
    (void)err, (void)errlen;
    struct null_backend *nb = (struct null_backend *)b;
    double t0 = now();
    nb->steps++, nb->tokens += s->n_tokens, nb->seqs += s->n_seqs;
    for (int i = 0; i < s->n_seqs; i++) {
        struct step_seq *q = &s->seqs[i];
        if (!q->want_sample) continue;
        memset(&q->out, 0, sizeof q->out);
        q->out.token = 1000 + q->context_len % 5000; /* ordinary text tokens */
        const struct model_sampling *sp = q->sampling;
        if (sp->allow) {
            /* a token the mask allows, from a start that differs per sequence and step */
            int n = sp->n_allow, at = (int)(((uint32_t)q->context_len * 2654435761u + (uint32_t)i * 40503u) % n);
            q->out.token = -1;
            for (int k = 0; k < n && q->out.token < 0; k++)
                if (sp->allow[(at + k) % n]) q->out.token = (at + k) % n;
        }
    }
    nb->busy += now() - t0;
    return 0;
}
static void null_destroy(model_backend *b) { (void)b; }
static const struct model_backend_ops null_ops = {"null", null_block_bytes, null_kv_alloc, null_forward,
                                                  null_destroy};

int main(int argc, char **argv)
{
    const char *path = argc > 1 ? argv[1] : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    int n = argc > 2 ? atoi(argv[2]) : 256, np = argc > 3 ? atoi(argv[3]) : 992, no = argc > 4 ? atoi(argv[4]) : 1000;
    int seqs = argc > 5 ? atoi(argv[5]) : 256, budget = argc > 6 ? atoi(argv[6]) : 8192;
    bool json = argc > 7 && !strcmp(argv[7], "json");
    char err[512];
    model *m = model_load(path, NULL, err, sizeof err);
    if (!m) {
        fprintf(stderr, "engine_bench: %s\n", err);
        return 1;
    }
    struct null_backend nb = {.base = {.ops = &null_ops, .m = m}};
    struct sched_engine_opts o;
    memset(&o, 0, sizeof o);
    o.sched.block_size = 16;
    o.sched.max_num_seqs = seqs;
    o.sched.max_num_batched_tokens = budget;
    o.sched.max_model_len = np + no + 16;
    o.kv_blocks = seqs * ((np + no + 15) / 16 + 1) + 64;
    o.enable_prefix_caching = true;
    sched_engine *e = sched_engine_create(&nb.base, &o, err, sizeof err);
    if (!e) {
        fprintf(stderr, "engine_bench: %s\n", err);
        return 1;
    }
    int32_t *prompts = malloc((size_t)n * np * 4);
    uint64_t r = 7;
    for (size_t i = 0; i < (size_t)n * np; i++) {
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        prompts[i] = 1000 + (int32_t)((r >> 33) % 20000);
    }
    double t0 = now();
    for (int i = 0; i < n; i++) {
        struct sched_request q;
        memset(&q, 0, sizeof q);
        q.prompt = prompts + (size_t)i * np;
        q.n_prompt = np;
        q.max_tokens = no;
        q.ignore_eos = true;
        q.priority = SCHED_PRIO_BATCH;
        q.json_object = json;
        model_sampling_default(&q.sampling);
        if (sched_engine_submit(e, &q, NULL, err, sizeof err)) {
            fprintf(stderr, "engine_bench: submit: %s\n", err);
            return 1;
        }
    }
    struct sched_evbuf b;
    sched_evbuf_init(&b);
    long events = 0, done = 0;
    while (done < n) {
        int k = sched_engine_wait(e, &b, 60.0);
        if (k <= 0) {
            fprintf(stderr, "engine_bench: no events for 60 s\n");
            return 1;
        }
        for (int i = 0; i < k; i++) done += b.ev[i].kind != SCHED_EV_TOKEN;
        events += k;
    }
    double dt = now() - t0;
    printf("engine_bench: %d requests x (%d prompt, %d output)%s, max_num_seqs %d, budget %d\n", n, np, no,
           json ? " in JSON mode" : "", seqs, budget);
    double eng = dt - nb.busy;
    printf("  %ld steps, %ld tokens (%ld sequence slots), %ld events in %.2f s (%.2f s of it the null backend): "
           "engine %.1f us per step, %.2f us per sequence in a step\n",
           nb.steps, nb.tokens, nb.seqs, events, dt, nb.busy, eng * 1e6 / nb.steps, eng * 1e6 / nb.seqs);
    sched_evbuf_deinit(&b);
    sched_engine_destroy(e);
    free(prompts);
    model_free(m);
    return 0;
}
