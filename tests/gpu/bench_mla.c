/* bench_mla.c - MLA's absorbed attention at the DeepSeek-V2-Lite shape (16
 * heads, kv_lora_rank 512, rope 64, block 16, scattered blocks): the
 * tensor-core prefill kernel (cuda_mla_prefill) against the SIMT one
 * (cuda_mla_attention) on prefill chunks of 8192 tokens, at the start of a
 * prompt and as the last chunk of a 32K one (24576 keys cached before it),
 * and on a 2048-token chunk at 128 heads (DeepSeek-V3 on one GPU). Random
 * finite entries (bf16, or e4m3 with --kv-cache-dtype=fp8). Median of 5 runs
 * (the SIMT kernel: 3) after a warm-up, CUDA events; TFLOP/s counts causal
 * work only: 2 H (2 C + R) times the sum over queries of the keys each
 * sees. Also the largest relative difference between the two kernels'
 * outputs (bf16 Q and P on the tensor cores: ~1e-2 at most). Not a test.
 *
 *   build/tests/gpu/bench_mla [--kv-cache-dtype=fp8] [--rows=32]
 *   --rows=32   sm_89's configuration (32 rows a block, one key stage) on
 *               any GPU (cuda_tuning.mla_prefill_rows) */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/mla.h"
#include "cuda/tuning.h"
#include "tests/gpu/gpu_util.h"

enum { C = 512, R = 64, DN = 128, W = C + R, BS = 16 };

static float time_ms(const struct cuda_mla_attn_args *a, bool tc, int runs)
{
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    float t[8];
    if (tc) cuda_mla_prefill(a, 0);
    else cuda_mla_attention(a, 0);
    for (int i = 0; i < runs; i++) {
        cudaEventRecord(e0, 0);
        cudaError_t e = tc ? cuda_mla_prefill(a, 0) : cuda_mla_attention(a, 0);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        if (e != cudaSuccess || cudaGetLastError() != cudaSuccess) {
            printf("  launch failed: %s\n", cudaGetErrorString(e));
            return NAN;
        }
        cudaEventElapsedTime(&t[i], e0, e1);
    }
    for (int i = 1; i < runs; i++) /* insertion sort: a handful of runs */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            float x = t[j];
            t[j] = t[j - 1], t[j - 1] = x;
        }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return t[runs / 2];
}

/* One chunk of T tokens of one sequence at positions start .. start + T - 1, H heads. */
static void bench(const char *what, int H, int start, int T, bool kv8)
{
    int n = start + T, nb = (n + BS - 1) / BS;
    size_t es = kv8 ? 1 : 2, cache_n = (size_t)nb * BS * W;
    uint8_t *craw = malloc(cache_n * es);
    for (size_t i = 0; i < cache_n; i++) {
        if (kv8) {
            int r = (int)((frand() + 1.0f) * 4096.0f);
            craw[i] = (uint8_t)((frand() < 0 ? 0x80 : 0) | (3 + r % 6) << 3 | (r / 6) % 8);
        } else {
            ((uint16_t *)craw)[i] = bf(frand());
        }
    }
    int32_t *bt = malloc((size_t)nb * 4), *pos = malloc((size_t)T * 4), *tbt = calloc((size_t)T, 4);
    for (int i = 0; i < nb; i++) bt[i] = (int32_t)(((long long)i * 7919) % nb);
    for (int t = 0; t < T; t++) pos[t] = start + t;
    size_t nq = (size_t)T * H;
    float *qlat = malloc(nq * C * 4), *q = malloc(nq * (DN + R) * 4);
    for (size_t i = 0; i < nq * C; i++) qlat[i] = frand();
    for (size_t i = 0; i < nq * (DN + R); i++) q[i] = frand();
    void *dcache = dup_dev(craw, cache_n * es);
    float *dqlat = dup_dev(qlat, nq * C * 4), *dq = dup_dev(q, nq * (DN + R) * 4);
    int32_t *dbt = dup_dev(bt, (size_t)nb * 4), *dpos = dup_dev(pos, (size_t)T * 4);
    int32_t *dtbt = dup_dev(tbt, (size_t)T * 4);
    uint16_t *o1 = poisoned(nq * C * 2), *o2 = poisoned(nq * C * 2);
    size_t pb = cuda_mla_attn_part_bytes(T, H, C, R);
    float *part = pb ? poisoned(pb) : NULL;
    struct cuda_mla_attn_args a = {.qlat = dqlat, .q = dq, .cache = dcache, .pos = dpos, .tok_bt = dtbt, .bt = dbt,
                                   .olat = o1, .part = part, .T = T, .H = H, .Dn = DN, .R = R, .C = C, .W = W,
                                   .block_size = BS, .scale = 1.0f / sqrtf((float)(DN + R)), .kv8 = kv8};
    double keys = (double)T * start + (double)T * (T + 1) / 2, flop = 2.0 * H * (2 * C + R) * keys;
    if (!cuda_mla_prefill_ok(&a)) {
        printf("%s: the tensor-core kernel does not take this shape here\n", what);
    } else {
        float ttc = time_ms(&a, true, 5);
        a.olat = o2;
        float tsimt = time_ms(&a, false, 3);
        uint16_t *h1 = malloc(nq * C * 2), *h2 = malloc(nq * C * 2);
        get(h1, o1, nq * C * 2), get(h2, o2, nq * C * 2);
        double num = 0, den = 0;
        for (size_t i = 0; i < nq * C; i++) {
            double d = (double)fb(h1[i]) - fb(h2[i]);
            num += d * d, den += (double)fb(h2[i]) * fb(h2[i]);
        }
        printf("%s (%s, H %d, %d tokens over %d cached): tensor cores %.2f ms = %.0f TFLOP/s; SIMT %.2f ms = %.1f "
               "TFLOP/s (%.1fx); outputs differ by %.2e\n",
               what, kv8 ? "fp8" : "bf16", H, T, start, ttc, flop / ttc / 1e9, tsimt, flop / tsimt / 1e9, tsimt / ttc,
               sqrt(num / (den > 0 ? den : 1)));
        free(h1), free(h2);
    }
    cudaFree(dcache), cudaFree(dqlat), cudaFree(dq), cudaFree(dbt), cudaFree(dpos), cudaFree(dtbt), cudaFree(o1);
    cudaFree(o2), cudaFree(part);
    free(craw), free(bt), free(pos), free(tbt), free(qlat), free(q);
}

int main(int argc, char **argv)
{
    bool kv8 = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--kv-cache-dtype=fp8")) kv8 = true;
        else if (!strcmp(argv[i], "--rows=32")) cuda_tuning.mla_prefill_rows = 32;
        else {
            fprintf(stderr, "bench_mla: unknown argument %s (options: tests/gpu/bench_mla.c)\n", argv[i]);
            return 2;
        }
    }
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU: skipped\n");
        return 0;
    }
    struct cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    printf("%s%s\n", p.name, cuda_tuning.mla_prefill_rows == 32 ? ", 32 rows a block" : "");
    bench("first chunk of a prompt", 16, 0, 8192, kv8);
    bench("last chunk of a 32K prompt", 16, 24576, 8192, kv8);
    bench("128 heads", 128, 0, 2048, kv8);
    return 0;
}
