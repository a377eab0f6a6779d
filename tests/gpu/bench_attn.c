/* bench_attn.c - prefill attention at the Llama-3.1-8B shape (H 32, KVH 8,
 * head_dim 128, block 16): the SIMT kernel (32-row items) against the
 * tensor-core kernel (64- and 128-row items), on one 2048-token prompt and on
 * a 16K-token context prefilled in 8 chunks of 2048 (each chunk attends to
 * its cached prefix plus its causal part; the 8 steps' attention is timed
 * together), and on 8 prompts of 2048 in one step (a prefill step of
 * bench_gpu), also with the step's RoPE + KV write before it. Items are built as pack_step
 * builds them (no split: the steps are long). Median of 20 runs (5 for the slow SIMT 16K case) after two
 * warm-ups, CUDA events; TFLOP/s counts causal work only: 4 * H * D * sum
 * over queries of the keys each sees.
 * Also prints the largest difference between the two kernels' outputs on
 * the prompt (bf16 P: expect ~1e-2 at most). Not a test.
 *
 *   build/tests/gpu/bench_attn [--kv-cache-dtype=fp8] [--no-wg] [--wg8-skip-widen]
 *   --kv-cache-dtype=fp8  the fp8 e4m3 cache (random finite values), not bf16
 *   --no-wg               the 128-row items on attn.cu's kernel, not the
 *                         warpgroup one (sm_90)
 *   --wg8-skip-widen      benchmarks only, wrong outputs: the warpgroup
 *                         kernel leaves the fp8 stages unwidened, to see what
 *                         the widening costs (cuda_tuning.attn_wg8_skip_widen) */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "cuda/tuning.h"
#include "tests/gpu/gpu_util.h"

enum { NH = 32, NKVH = 8, HD = 128, BS = 16, CHUNK = 2048 };

static int cmpf(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}
static void *dalloc(size_t n)
{
    void *p;
    if (cudaMalloc(&p, n) != cudaSuccess) {
        printf("cudaMalloc %zu failed\n", n);
        exit(1);
    }
    return p;
}
static bool g_kv8; /* --kv-cache-dtype=fp8 */
/* n random e4m3 bytes of magnitude below 1 (exponent field 0..6), as the
 * bf16 cache's values */
static void *rand_dev8(size_t n)
{
    uint8_t *h = malloc(n);
    for (size_t i = 0; i < n; i++) {
        unsigned r = (unsigned)((frand() * 0.5f + 0.5f) * 65535.0f);
        h[i] = (uint8_t)((r & 0x80) | (r >> 8) % 7 << 3 | (r & 7));
    }
    void *d = dup_dev(h, n);
    free(h);
    return d;
}
static uint16_t *rand_dev(size_t n, float amp)
{
    uint16_t *h = malloc(n * 2);
    for (size_t i = 0; i < n; i++) h[i] = bf(amp * frand());
    uint16_t *d = dup_dev(h, n * 2);
    free(h);
    return d;
}

/* The attention args of one step: the chunk of one sequence whose last
 * query sits at position ctx - 1, qlen queries, `rows` rows per item. */
static struct cuda_attn_args step_args(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *dbt,
                                       int ctx, int qlen, int rows, uint16_t *out, double *keys)
{
    int grp = NH / NKVH, qt = rows / grp, n = (qlen + qt - 1) / qt;
    int32_t *pos = malloc(qlen * 4), *tp = malloc(qlen * 4);
    struct cuda_attn_item *it = malloc(n * sizeof *it);
    *keys = 0;
    for (int t = 0; t < qlen; t++) pos[t] = ctx - qlen + t, tp[t] = -1, *keys += pos[t] + 1;
    for (int k = 0; k < n; k++) {
        int t0 = k * qt, nq = qlen - t0 < qt ? qlen - t0 : qt;
        it[k] = (struct cuda_attn_item){0, t0, nq, 0, pos[t0 + nq - 1] + 1, 0, 1, 0};
    }
    struct cuda_attn_args a = {.q = q, .kc = kc, .vc = vc, .kv8 = g_kv8, .pos = dup_dev(pos, qlen * 4), .bt = dbt,
                               .items = dup_dev(it, n * sizeof *it),
                               .n_items = dup_dev(&n, 4), .max_items = n, .max_rows = rows, .H = NH, .KVH = NKVH,
                               .D = HD, .block_size = BS, .scale = 1.0f / sqrtf((float)HD), .part = NULL,
                               .tok_part = dup_dev(tp, qlen * 4), .tok_nsplit = NULL, .T = qlen, .out = out};
    a.tok_nsplit = a.tok_part; /* all -1: nothing is split */
    free(pos), free(tp), free(it);
    return a;
}

/* The attention args of a prefill step of nseq prompts of CHUNK tokens
 * each (sequence s on blocks s * CHUNK / BS ..), `rows` rows per item. */
static struct cuda_attn_args batch_args(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *dbt,
                                        int nseq, int rows, uint16_t *out, double *keys)
{
    int grp = NH / NKVH, qt = rows / grp, per = (CHUNK + qt - 1) / qt, n = nseq * per, T = nseq * CHUNK;
    int32_t *pos = malloc(T * 4), *tp = malloc(T * 4);
    struct cuda_attn_item *it = malloc(n * sizeof *it);
    *keys = 0;
    for (int t = 0; t < T; t++) pos[t] = t % CHUNK, tp[t] = -1, *keys += pos[t] + 1;
    for (int s = 0; s < nseq; s++) {
        for (int k = 0; k < per; k++) {
            int t0 = k * qt, nq = CHUNK - t0 < qt ? CHUNK - t0 : qt;
            it[s * per + k] = (struct cuda_attn_item){s * (CHUNK / BS), s * CHUNK + t0, nq, 0, t0 + nq, 0, 1, 0};
        }
    }
    struct cuda_attn_args a = {.q = q, .kc = kc, .vc = vc, .kv8 = g_kv8, .pos = dup_dev(pos, T * 4), .bt = dbt,
                               .items = dup_dev(it, n * sizeof *it),
                               .n_items = dup_dev(&n, 4), .max_items = n, .max_rows = rows, .H = NH, .KVH = NKVH,
                               .D = HD, .block_size = BS, .scale = 1.0f / sqrtf((float)HD), .part = NULL,
                               .tok_part = dup_dev(tp, T * 4), .tok_nsplit = NULL, .T = T, .out = out};
    a.tok_nsplit = a.tok_part;
    free(pos), free(tp), free(it);
    return a;
}

/* Median ms of reps runs of the RoPE + KV write r (when not NULL), then the
 * n steps' attention back to back */
static float time_steps(const struct cuda_rope_args *r, const struct cuda_attn_args *a, int n, int reps)
{
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    float t[64];
    cudaError_t err = cudaSuccess;
    for (int i = -2; i < reps; i++) {
        cudaEventRecord(e0, 0);
        if (r && cuda_rope_kv(r, 0) != cudaSuccess) err = cudaGetLastError();
        for (int k = 0; k < n; k++)
            if (cuda_attention(&a[k], 0) != cudaSuccess) err = cudaGetLastError();
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        if (i >= 0) cudaEventElapsedTime(&t[i], e0, e1);
    }
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err != cudaSuccess) printf("  error: %s\n", cudaGetErrorString(err));
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    qsort(t, reps, sizeof(float), cmpf);
    return t[reps / 2];
}

static void free_args(struct cuda_attn_args *a)
{
    cudaFree((void *)a->pos), cudaFree((void *)a->items), cudaFree((void *)a->n_items);
    cudaFree((void *)a->tok_part);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--kv-cache-dtype=fp8")) g_kv8 = true;
        else if (!strcmp(argv[i], "--no-wg")) cuda_attention_wg_select(0);
        else if (!strcmp(argv[i], "--wg8-skip-widen")) cuda_tuning.attn_wg8_skip_widen = true;
        else {
            fprintf(stderr, "usage: %s [--kv-cache-dtype=fp8] [--no-wg] [--wg8-skip-widen]\n", argv[0]);
            return 2;
        }
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("no GPU: skipped\n");
        return 0;
    }
    if (!cuda_attention_tc_ok(HD, NH / NKVH)) printf("tensor-core kernel refuses the shape\n");
    if (cuda_attention_prepare(HD) != cudaSuccess) printf("prepare failed\n");
    const int nchunk = 8, ctx_max = nchunk * CHUNK, nb = ctx_max / BS;
    /* the blocks of the context in shuffled order, as a pool hands them out */
    int32_t *bt = malloc(nb * 4);
    for (int i = 0; i < nb; i++) bt[i] = i;
    for (int i = nb - 1; i > 0; i--) {
        int j = (int)((frand() * 0.5f + 0.5f) * (i + 1)) % (i + 1), x = bt[i];
        bt[i] = bt[j], bt[j] = x;
    }
    int32_t *dbt = dup_dev(bt, nb * 4);
    size_t kvn = (size_t)ctx_max * NKVH * HD;
    uint16_t *kc = g_kv8 ? rand_dev8(kvn) : rand_dev(kvn, 1.0f), *vc = g_kv8 ? rand_dev8(kvn) : rand_dev(kvn, 1.0f);
    uint16_t *q = rand_dev((size_t)ctx_max * NH * HD, 2.0f);
    uint16_t *out[3];
    for (int v = 0; v < 3; v++) out[v] = dalloc((size_t)ctx_max * NH * HD * 2);
    const char *vname[3] = {"SIMT, 32-row items", "tensor cores, 64-row items", "tensor cores, 128-row items"};
    int vrows[3] = {CUDA_ATTN_ROWS, 64, 128};

    printf("prefill attention, H=%d KVH=%d D=%d block %d, %s cache\n", NH, NKVH, HD, BS, g_kv8 ? "fp8" : "bf16");
    for (int v = 0; v < 3; v++) {
        double keys;
        struct cuda_attn_args a = step_args(q, kc, vc, dbt, CHUNK, CHUNK, vrows[v], out[v], &keys);
        float ms = time_steps(NULL, &a, 1, 20);
        printf("  prompt 2048            %-30s %8.3f ms  %7.1f TFLOP/s\n", vname[v], ms,
               4.0 * NH * HD * keys / (ms * 1e9));
        free_args(&a);
    }
    {
        size_t n = (size_t)CHUNK * NH * HD;
        uint16_t *h[3];
        for (int v = 0; v < 3; v++) h[v] = malloc(n * 2), cudaMemcpy(h[v], out[v], n * 2, cudaMemcpyDeviceToHost);
        for (int v = 1; v < 3; v++) {
            double mx = 0;
            for (size_t i = 0; i < n; i++) {
                double d = fabs((double)fb(h[v][i]) - fb(h[0][i]));
                if (!(d <= mx)) mx = d; /* NaN sticks */
            }
            printf("  prompt 2048: max |%s - SIMT| = %.3g\n", vname[v], mx);
        }
        for (int v = 0; v < 3; v++) free(h[v]);
    }
    for (int v = 0; v < 3; v++) {
        struct cuda_attn_args a[8];
        double keys = 0, k;
        for (int c = 0; c < nchunk; c++) {
            a[c] = step_args(q, kc, vc, dbt, (c + 1) * CHUNK, CHUNK, vrows[v], out[v], &k);
            keys += k;
        }
        float ms = time_steps(NULL, a, nchunk, v == 0 ? 5 : 20);
        printf("  16K context, 8 chunks  %-30s %8.3f ms  %7.1f TFLOP/s\n", vname[v], ms,
               4.0 * NH * HD * keys / (ms * 1e9));
        for (int c = 0; c < nchunk; c++) free_args(&a[c]);
    }
    for (int v = 1; v < 3; v++) { /* SIMT is too slow to matter here */
        double keys;
        struct cuda_attn_args a = batch_args(q, kc, vc, dbt, nchunk, vrows[v], out[v], &keys);
        float ms = time_steps(NULL, &a, 1, 20);
        printf("  8 prompts of 2048      %-30s %8.3f ms  %7.1f TFLOP/s\n", vname[v], ms,
               4.0 * NH * HD * keys / (ms * 1e9));
        free_args(&a);
    }
    {
        /* a prefill step's RoPE + KV write, then its attention, 8 prompts
         * of 2048 (Llama-3 RoPE tables, the tokens' slots in the shuffled
         * blocks); bytes: q and k read and written, v read and written */
        double keys;
        int T = nchunk * CHUNK, half = HD / 2;
        struct cuda_attn_args a = batch_args(q, kc, vc, dbt, nchunk, 128, out[2], &keys);
        float *cs = malloc((size_t)CHUNK * half * 4), *sn = malloc((size_t)CHUNK * half * 4);
        for (int p = 0; p < CHUNK; p++)
            for (int i = 0; i < half; i++) {
                double f = p * pow(500000.0, -2.0 * i / HD);
                cs[p * half + i] = (float)cos(f), sn[p * half + i] = (float)sin(f);
            }
        int64_t *slots = malloc((size_t)T * 8);
        for (int t = 0; t < T; t++) {
            int s = t / CHUNK, p = t % CHUNK;
            slots[t] = (int64_t)bt[s * (CHUNK / BS) + p / BS] * BS + p % BS;
        }
        uint16_t *qkv = rand_dev((size_t)T * (NH + 2 * NKVH) * HD, 2.0f);
        struct cuda_rope_args r = {.qkv = qkv, .cos = dup_dev(cs, (size_t)CHUNK * half * 4),
                                   .sin = dup_dev(sn, (size_t)CHUNK * half * 4), .pos = a.pos,
                                   .slots = dup_dev(slots, (size_t)T * 8), .T = T, .H = NH, .KVH = NKVH, .D = HD,
                                   .rope_dim = HD, .eps = 1e-5f, .q = q, .kc = kc, .vc = vc, .kv8 = g_kv8};
        float ms = time_steps(&r, &a, 1, 20), rms = time_steps(&r, &a, 0, 20);
        printf("  8 prompts of 2048      RoPE + KV write, then attention    %8.3f ms (RoPE + KV write %.3f ms, %.0f GB/s)\n",
               ms, rms, (double)T * (2 * NH + 4 * NKVH) * HD * 2 / (rms * 1e6));
        free(cs), free(sn), free(slots);
        cudaFree(qkv), cudaFree((void *)r.cos), cudaFree((void *)r.sin), cudaFree((void *)r.slots);
        free_args(&a);
    }
    cudaFree(dbt), cudaFree(kc), cudaFree(vc), cudaFree(q);
    for (int v = 0; v < 3; v++) cudaFree(out[v]);
    free(bt);
    return 0;
}
