/* bench_kernels.c - where a decode step's time goes: each cuda/ kernel and
 * the GEMMs at the Llama-3.1-8B decode shapes, timed alone with CUDA events
 * (median of 50 launches after warm-up; weights rotate over 8 copies so L2
 * never holds them): every GEMV variant (warp, block, persist; see gemv.cu)
 * and fusion per shape, then the GEMV part of a decode layer as a graph,
 * today's kernels against the fused ones, with and without PDL. Not a test. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"

#define REP 50
static int cmpf(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static cudaEvent_t e0, e1;
static float times[REP];
/* median time of stmt / div, and bytes / that time */
#define TIME_DIV(label, bytes, div, stmt)                                                          \
    do {                                                                                           \
        for (int w_ = 0; w_ < 3; w_++) { int rep = w_; (void)rep; stmt; }                          \
        for (int rep = 0; rep < REP; rep++) {                                                      \
            cudaEventRecord(e0, 0);                                                                \
            stmt;                                                                                  \
            cudaEventRecord(e1, 0);                                                                \
            cudaEventSynchronize(e1);                                                              \
            cudaEventElapsedTime(&times[rep], e0, e1);                                             \
        }                                                                                          \
        qsort(times, REP, sizeof(float), cmpf);                                                    \
        float us_ = times[REP / 2] * 1000 / (div);                                                 \
        printf("%-60s %9.1f us  %7.0f GB/s\n", label, us_, (bytes) / (us_ * 1e3));                \
        cudaError_t ce_ = cudaGetLastError();                                                      \
        if (ce_ != cudaSuccess) printf("  error: %s\n", cudaGetErrorString(ce_));                  \
    } while (0)
#define TIME(label, bytes, stmt) TIME_DIV(label, bytes, 1, stmt)

static void *dalloc(size_t n)
{
    void *p;
    if (cudaMalloc(&p, n) != cudaSuccess) {
        printf("cudaMalloc %zu failed\n", n);
        exit(1);
    }
    cudaMemset(p, 0x3c, n); /* small nonzero bf16 values */
    return p;
}

static const char *const vname[] = {"warp", "block", "persist"};

/* The GEMV part of one decode layer (no RoPE, no attention: qkv's first
 * values stand in for attention's output), 8 layers with their own weights
 * captured in one graph, as enqueue() runs it; prints us per layer.
 * mode 0: today's kernels (add_rmsnorm, gemv, swiglu, separate);
 * mode 1: the same sequence with the fused epilogue/prologue launchers. */
static void bench_layers(int mode, int variant, int pdl, int T, uint16_t *const *wl, float *x, float *nw,
                         uint16_t *xn, uint16_t *qkv, uint16_t *delta, uint16_t *gu, uint16_t *hh)
{
    const int E = 4096, F = 14336, QKV = 6144, NL = 8;
    const size_t sq = (size_t)QKV * E, so = (size_t)E * E, sg = (size_t)2 * F * E;
    cuda_gemv_select(variant, pdl, -1);
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    int bad = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess;
    for (int l = 0; l < NL && !bad; l++) {
        const uint16_t *wq = wl[l], *wo = wq + sq, *wgu = wo + so, *wd = wgu + sg;
        if (mode == 0) {
            bad |= cuda_add_rmsnorm(x, delta, nw, NULL, T, E, 1e-5f, xn, st) != cudaSuccess;
            bad |= cuda_gemv(wq, xn, qkv, false, T, E, QKV, st) != cudaSuccess;
            bad |= cuda_gemv(wo, qkv, delta, false, T, E, E, st) != cudaSuccess;
            bad |= cuda_add_rmsnorm(x, delta, nw, NULL, T, E, 1e-5f, xn, st) != cudaSuccess;
            bad |= cuda_gemv(wgu, xn, gu, false, T, E, 2 * F, st) != cudaSuccess;
            bad |= cuda_swiglu(gu, T, F, hh, st) != cudaSuccess;
            bad |= cuda_gemv(wd, hh, delta, false, T, F, E, st) != cudaSuccess;
        } else {
            bad |= cuda_gemv_rmsnorm(wq, x, nw, 1e-5f, qkv, T, E, QKV, st) != cudaSuccess;
            bad |= cuda_gemv_residual(wo, qkv, x, T, E, E, st) != cudaSuccess;
            bad |= cuda_gemv_rmsnorm_swiglu(wgu, x, nw, 1e-5f, hh, T, E, F, st) != cudaSuccess;
            bad |= cuda_gemv_residual(wd, hh, x, T, F, E, st) != cudaSuccess;
        }
    }
    cudaStreamEndCapture(st, &g);
    if (bad || !g || cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) {
        printf("layers %s: capture failed: %s\n", mode ? "fused" : "unfused", cudaGetErrorString(cudaGetLastError()));
    } else {
        char lab[96];
        snprintf(lab, sizeof lab, "layer T=%d %-7s %-7s %s (per layer)", T, mode ? "fused" : "unfused",
                 vname[variant], pdl ? "pdl" : "   ");
        double bytes = (double)(sq + so + sg + (size_t)F * E) * 2;
        TIME_DIV(lab, bytes, NL, cudaGraphLaunch(ge, 0));
    }
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(st);
    cuda_gemv_select(1, 1, -1);
}

int main(void)
{
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    cublasHandle_t h;
    cublasCreate(&h);
    const int E = 4096, F = 14336, H = 32, KVH = 8, D = 128, V = 128256;
    struct { const char *name; int in, out; } m[] = {
        {"qkv  4096 -> 6144", E, (H + 2 * KVH) * D}, {"o    4096 -> 4096", H * D, E},
        {"gate|up 4096 -> 28672", E, 2 * F}, {"down 14336 -> 4096", F, E}, {"lm_head 4096 -> 128256", E, V}};
    uint16_t *x = dalloc((size_t)4 * F * 2);
    float *y = dalloc((size_t)4 * V * 4), *xr = dalloc((size_t)4 * E * 4), *nw = dalloc((size_t)E * 4);
    cudaMemset(xr, 0, (size_t)4 * E * 4), cudaMemset(nw, 0, E * 4);
    for (int i = 0; i < 5; i++) {
        size_t wb = (size_t)m[i].in * m[i].out * 2;
        int nc = i == 4 ? 2 : 8;
        uint16_t *w[8];
        for (int c = 0; c < nc; c++) w[c] = dalloc(wb);
        char lab[96];
        for (int T = 1; T <= 4; T *= 4) {
            for (int v = 0; v < 3; v++) {
                cuda_gemv_select(v, 1, -1);
                snprintf(lab, sizeof lab, "gemv %-7s T=%d %s", vname[v], T, m[i].name);
                TIME(lab, wb, cuda_gemv(w[rep % nc], x, y, i == 4, T, m[i].in, m[i].out, 0));
            }
            snprintf(lab, sizeof lab, "cublas       T=%d %s", T, m[i].name);
            const float one = 1, zero = 0;
            TIME(lab, wb,
                 cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m[i].out, T, m[i].in, &one, w[rep % nc], CUDA_R_16BF,
                              m[i].in, x, CUDA_R_16BF, m[i].in, &zero, y, i == 4 ? CUDA_R_32F : CUDA_R_16BF, m[i].out,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            /* the fusions that apply to this shape, block and persistent */
            for (int v = 1; v < 3; v++) {
                cuda_gemv_select(v, 1, -1);
                if (i == 0) {
                    snprintf(lab, sizeof lab, "gemv_rmsnorm %-7s T=%d %s", vname[v], T, m[i].name);
                    TIME(lab, wb, cuda_gemv_rmsnorm(w[rep % nc], xr, nw, 1e-5f, (uint16_t *)y, T, E, m[i].out, 0));
                }
                if (i == 1 || i == 3) {
                    snprintf(lab, sizeof lab, "gemv_residual %-7s T=%d %s", vname[v], T, m[i].name);
                    TIME(lab, wb, cuda_gemv_residual(w[rep % nc], x, y, T, m[i].in, m[i].out, 0));
                }
                if (i == 2) {
                    snprintf(lab, sizeof lab, "gemv_swiglu %-7s T=%d %s", vname[v], T, m[i].name);
                    TIME(lab, wb, cuda_gemv_swiglu(w[rep % nc], x, (uint16_t *)y, T, E, F, 0));
                    snprintf(lab, sizeof lab, "gemv_rmsnorm_swiglu %-7s T=%d %s", vname[v], T, m[i].name);
                    TIME(lab, wb, cuda_gemv_rmsnorm_swiglu(w[rep % nc], xr, nw, 1e-5f, (uint16_t *)y, T, E, F, 0));
                }
            }
            cuda_gemv_select(1, 1, -1);
        }
        for (int c = 0; c < nc; c++) cudaFree(w[c]);
    }
    /* the GEMV part of a decode layer, graph-captured: today vs new */
    {
        const size_t lw = ((size_t)6144 * E + (size_t)E * E + (size_t)2 * F * E + (size_t)F * E);
        uint16_t *wl[8];
        for (int l = 0; l < 8; l++) wl[l] = dalloc(lw * 2);
        uint16_t *xn = dalloc((size_t)4 * E * 2), *qkv = dalloc((size_t)4 * 6144 * 2), *delta = dalloc((size_t)4 * E * 2),
                 *gu = dalloc((size_t)4 * 2 * F * 2), *hh = dalloc((size_t)4 * F * 2);
        float *lx = dalloc((size_t)4 * E * 4), *lnw = dalloc((size_t)E * 4);
        cudaDeviceSynchronize();
        printf("-- decode layer GEMV part (norm, qkv, o, norm, gate|up, swiglu, down), 8 layers in one graph --\n");
        for (int T = 1; T <= 4; T *= 4) {
            bench_layers(0, 0, 0, T, wl, lx, lnw, xn, qkv, delta, gu, hh); /* today */
            bench_layers(0, 0, 1, T, wl, lx, lnw, xn, qkv, delta, gu, hh);
            for (int v = 1; v < 3; v++)
                for (int pdl = 0; pdl < 2; pdl++) {
                    bench_layers(0, v, pdl, T, wl, lx, lnw, xn, qkv, delta, gu, hh);
                    bench_layers(1, v, pdl, T, wl, lx, lnw, xn, qkv, delta, gu, hh);
                }
        }
        for (int l = 0; l < 8; l++) cudaFree(wl[l]);
        cudaFree(xn), cudaFree(qkv), cudaFree(delta), cudaFree(gu), cudaFree(hh), cudaFree(lx), cudaFree(lnw);
    }
    /* the small kernels at T = 1 */
    uint16_t *xn = dalloc((size_t)E * 2), *gu = dalloc((size_t)2 * F * 2), *hh = dalloc((size_t)F * 2);
    TIME("add_rmsnorm T=1 E=4096", (double)E * 8, cuda_add_rmsnorm(xr, xn, nw, NULL, 1, E, 1e-5f, xn, 0));
    TIME("swiglu T=1 F=14336", (double)F * 6, cuda_swiglu(gu, 1, F, hh, 0));
    int32_t *tok = dalloc(64);
    float *logits = dalloc((size_t)V * 4);
    cudaMemset(logits, 0, (size_t)V * 4);
    struct cuda_argmax_part *scr = dalloc(CUDA_ARGMAX_SLICES * sizeof *scr);
    TIME("argmax_lse R=1 V=128256", (double)V * 4, cuda_argmax_lse(logits, 1, V, scr, tok, (float *)(tok + 4), 0));
    /* decode attention: 1 sequence, ctx 1024 and 32768, block 16 */
    for (int ctx = 1024; ctx <= 32768; ctx *= 32) {
        int bs = 16, nb = ctx / bs, ns = ctx / 64 < CUDA_ATTN_MAXSPLIT ? ctx / 64 : CUDA_ATTN_MAXSPLIT;
        size_t kvb = (size_t)ctx * KVH * D * 2;
        uint16_t *kc = dalloc(kvb), *vc = dalloc(kvb), *q = dalloc((size_t)H * D * 2), *out = dalloc((size_t)H * D * 2);
        cudaMemset(kc, 0, kvb), cudaMemset(vc, 0, kvb);
        int32_t *bt = malloc(nb * 4), pos = ctx - 1, tp = 0;
        for (int i = 0; i < nb; i++) bt[i] = i;
        struct cuda_attn_item it[CUDA_ATTN_MAXSPLIT];
        int chunk = (ctx / ns + 31) / 32 * 32;
        for (int k = 0; k < ns; k++)
            it[k] = (struct cuda_attn_item){0, 0, 1, k * chunk, (k + 1) * chunk < ctx ? (k + 1) * chunk : ctx, k, ns, 0};
        int32_t *dbt = dalloc(nb * 4), *dpos = dalloc(4), *dn = dalloc(4), *dtp = dalloc(4),
                *dns = dalloc(4);
        struct cuda_attn_item *dit = dalloc(sizeof it);
        cudaMemcpy(dbt, bt, nb * 4, cudaMemcpyHostToDevice), cudaMemcpy(dpos, &pos, 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dn, &ns, 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dtp, &tp, 4, cudaMemcpyHostToDevice), cudaMemcpy(dns, &ns, 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dit, it, sizeof it, cudaMemcpyHostToDevice);
        float *part = dalloc((size_t)4 * KVH * CUDA_ATTN_MAXSPLIT * (D + 2) * 4);
        struct cuda_attn_args a = {.q = q, .kc = kc, .vc = vc, .pos = dpos, .bt = dbt, .items = dit,
                                   .n_items = dn, .max_items = ns, .max_rows = 4, .H = H, .KVH = KVH, .D = D,
                                   .block_size = bs, .scale = 0.088f, .part = part, .tok_part = dtp,
                                   .tok_nsplit = dns, .T = 1, .out = out};
        cuda_attention_prepare(D);
        char lab[96];
        snprintf(lab, sizeof lab, "attention decode ctx %d (%d splits)", ctx, ns);
        TIME(lab, 2.0 * kvb, cuda_attention(&a, 0));
        /* the decode kernel: splits of at least 128 keys, merged by the last */
        int ns2 = ctx / 128 < CUDA_ATTN_MAXSPLIT ? ctx / 128 : CUDA_ATTN_MAXSPLIT, chunk2 = (ctx / ns2 + 127) / 128 * 128;
        for (int k = 0; k < ns2; k++)
            it[k] = (struct cuda_attn_item){0, 0, 1, k * chunk2, (k + 1) * chunk2 < ctx ? (k + 1) * chunk2 : ctx, k,
                                            ns2, 0};
        cudaMemcpy(dit, it, sizeof it, cudaMemcpyHostToDevice), cudaMemcpy(dn, &ns2, 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dns, &ns2, 4, cudaMemcpyHostToDevice);
        a.cnt = dalloc((size_t)KVH * 4), a.max_items = ns2;
        cudaMemset(a.cnt, 0, (size_t)KVH * 4);
        snprintf(lab, sizeof lab, "attention decode ctx %d, decode kernel (%d splits)", ctx, ns2);
        TIME(lab, 2.0 * kvb, cuda_attention(&a, 0));
        cudaFree(a.cnt);
        cudaFree(kc), cudaFree(vc), cudaFree(q), cudaFree(out), cudaFree(dbt), cudaFree(part);
        free(bt);
    }
    /* prefill attention: one 2048-token sequence, causal */
    {
        int ctx = 2048, bs = 16, nb = ctx / bs, qt = CUDA_ATTN_ROWS / (H / KVH), n = ctx / qt;
        size_t kvb = (size_t)ctx * KVH * D * 2;
        uint16_t *kc = dalloc(kvb), *vc = dalloc(kvb), *q = dalloc((size_t)ctx * H * D * 2),
                 *out = dalloc((size_t)ctx * H * D * 2);
        cudaMemset(kc, 0, kvb), cudaMemset(vc, 0, kvb), cudaMemset(q, 0, (size_t)ctx * H * D * 2);
        int32_t *bt = malloc(nb * 4), *pos = malloc(ctx * 4), *tp = malloc(ctx * 4);
        for (int i = 0; i < nb; i++) bt[i] = i;
        for (int i = 0; i < ctx; i++) pos[i] = i, tp[i] = -1;
        struct cuda_attn_item *it = malloc(n * sizeof *it);
        for (int k = 0; k < n; k++) it[k] = (struct cuda_attn_item){0, k * qt, qt, 0, (k + 1) * qt, 0, 1, 0};
        int32_t *dbt = dalloc(nb * 4), *dpos = dalloc(ctx * 4), *dn = dalloc(4),
                *dtp = dalloc(ctx * 4);
        struct cuda_attn_item *dit = dalloc(n * sizeof *it);
        cudaMemcpy(dbt, bt, nb * 4, cudaMemcpyHostToDevice), cudaMemcpy(dpos, pos, ctx * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dn, &n, 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dtp, tp, ctx * 4, cudaMemcpyHostToDevice), cudaMemcpy(dit, it, n * sizeof *it, cudaMemcpyHostToDevice);
        struct cuda_attn_args a = {.q = q, .kc = kc, .vc = vc, .pos = dpos, .bt = dbt, .items = dit,
                                   .n_items = dn, .max_items = n, .max_rows = CUDA_ATTN_ROWS, .H = H, .KVH = KVH,
                                   .D = D, .block_size = bs, .scale = 0.088f, .part = NULL, .tok_part = dtp,
                                   .tok_nsplit = dtp, .T = ctx, .out = out};
        double flops = 4.0 * H * D * (double)ctx * ctx / 2;
        TIME("attention prefill 2048 causal (GFLOP/s col)", flops, cuda_attention(&a, 0));
    }
    return 0;
}
