/* test_hc.c - the hyper-connection kernels (cuda/hc.cu) against the CPU
 * reference's functions (model/cpu_hc.c) on random inputs (make gpu-test;
 * needs a GPU).
 *
 * Per case (T tokens, 4 streams, hidden E; the Sinkhorn iteration count of
 * the tiny glm5 configs, 7, and transformers' default, 20; both sites of a
 * layer): the streams go into cpu_hc_pre and cuda_hc_collapse (the block's
 * input x), then a random block output y (bf16, what the GPU's blocks give,
 * handed to the CPU as its f32 values) into cpu_hc_post and
 * cuda_hc_writeback with each side's own post and comb weights (the
 * streams after the block), then the streams' mean into the head's input
 * (cuda_hc_mean against cpu_backend.c's final_hidden arithmetic). x and the
 * streams must agree to 1e-4 of their largest value (f32 rounding of the
 * mixing logits: the CPU normalises the streams before its dot products, the
 * GPU after, in another summation order); the mean, from identical streams,
 * to the bit. E = 4096 spreads a token's 16384 stream values over 16
 * chunks of the collapse's first pass. Outputs are poisoned (NaN) first, so
 * an unwritten element fails. Also glm5_next's clamped SwiGLU
 * (cuda_swiglu_limit) against the CPU backend's formula, to one bf16 ulp.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/hc.h"
#include "model/cpu_internal.h"
#include "model/model.h"
#include "tests/gpu/gpu_util.h"
#include "tests/test.h"

/* max |a - b| / max |b|; NaN anywhere -> inf */
static double rel(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i])) return INFINITY;
        double d = fabs((double)a[i] - b[i]);
        num = d > num ? d : num;
        den = fabs(b[i]) > den ? fabs(b[i]) : den;
    }
    return num / (den > 0 ? den : 1);
}
static struct model_tensor f32_tensor(const float *data, int64_t rows, int64_t cols)
{
    return (struct model_tensor){.name = "hc", .dtype = MODEL_DT_F32, .ndim = rows > 1 ? 2 : 1,
                                 .ne = {cols, rows, 1, 1}, .data = data, .nbytes = (size_t)(rows * cols) * 4};
}

static void hc_case(int T, int E, int iters)
{
    enum { N = 4 };
    const int M = (2 + N) * N, NE = N * E;
    char err[256];
    /* one layer with both sites; weights scaled so the mixing logits are O(1), as trained ones are */
    float *fn[2], *base[2], *scale[2];
    struct model_layer_kind kind = {MODEL_MIXER_GQA, MODEL_FFN_DENSE, MODEL_RESID_HC};
    struct model_config c = {.n_layer = 1, .n_embd = E, .norm_eps = 1e-5f, .layer_kind = &kind,
                             .hc = {.mult = N, .sinkhorn_iters = iters, .eps = 1e-6f}};
    struct model_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    struct model_weights w = {.layers = &lw};
    for (int s = 0; s < 2; s++) {
        fn[s] = malloc((size_t)M * NE * 4), base[s] = malloc(M * 4), scale[s] = malloc(3 * 4);
        for (size_t i = 0; i < (size_t)M * NE; i++) fn[s][i] = frand() * 2.0f / sqrtf((float)NE);
        for (int i = 0; i < M; i++) base[s][i] = 0.2f * frand();
        for (int i = 0; i < 3; i++) scale[s][i] = 1.0f + 0.3f * frand();
        struct model_hc_weights *hw = s ? &lw.hc_ffn : &lw.hc_attn;
        hw->fn = f32_tensor(fn[s], M, NE);
        hw->base = f32_tensor(base[s], 1, M);
        hw->scale = f32_tensor(scale[s], 1, 3);
    }
    struct cpu_backend *cb = cpu_kernels_create(2, NE);
    struct cpu_hc *h = cb ? cpu_hc_create(&c, &w, T, err, sizeof err) : NULL;
    CHECKF(h != NULL, "cpu_hc_create: %s", err);
    size_t nx = (size_t)T * E, ns = (size_t)T * NE;
    float *xs = malloc(ns * 4), *xc = malloc(nx * 4), *xg = malloc(nx * 4), *y = malloc(nx * 4), *sg = malloc(ns * 4);
    uint16_t *yb = malloc(nx * 2);
    for (size_t i = 0; i < ns; i++) xs[i] = 2.0f * frand();
    float *dxs = dup_dev(xs, ns * 4), *dx = poisoned(nx * 4), *dpart = poisoned(cuda_hc_part_elems(T, N, E) * 4);
    float *dpost = poisoned((size_t)T * N * 4), *dcomb = poisoned((size_t)T * N * N * 4);
    float *dfn[2], *dbase[2], *dscale[2];
    for (int s = 0; s < 2; s++)
        dfn[s] = dup_dev(fn[s], (size_t)M * NE * 4), dbase[s] = dup_dev(base[s], M * 4), dscale[s] = dup_dev(scale[s], 12);
    uint16_t *dy = poisoned(nx * 2);
    double ex[2] = {0, 0}, es[2] = {0, 0};
    for (int s = 0; h && s < 2; s++) {
        /* the block's input */
        cpu_hc_pre(h, cb, 0, s, xs, xc, T);
        cudaMemset(dx, 0xff, nx * 4);
        CHECK(cuda_hc_collapse(dxs, dfn[s], dbase[s], dscale[s], T, N, E, iters, c.hc.eps, c.norm_eps, dpart, dx,
                               dpost, dcomb, 0) == cudaSuccess);
        get(xg, dx, nx * 4);
        ex[s] = rel(xg, xc, nx);
        /* the block's output back into the streams */
        for (size_t i = 0; i < nx; i++) yb[i] = bf(3.0f * frand()), y[i] = fb(yb[i]);
        cudaMemcpy(dy, yb, nx * 2, cudaMemcpyHostToDevice);
        cpu_hc_post(h, xs, y, T);
        CHECK(cuda_hc_writeback(dxs, dy, dpost, dcomb, T, N, E, 0) == cudaSuccess);
        get(sg, dxs, ns * 4);
        es[s] = rel(sg, xs, ns);
        /* the next site starts from the same streams on both sides */
        cudaMemcpy(dxs, xs, ns * 4, cudaMemcpyHostToDevice);
    }
    /* the head's input: the streams' mean, as cpu_backend.c's final_hidden */
    for (size_t t = 0; t < (size_t)T; t++)
        for (int e = 0; e < E; e++) {
            const float *v = xs + t * NE + e;
            float acc = v[0];
            for (int i = 1; i < N; i++) acc += v[(size_t)i * E];
            xc[t * E + e] = acc / (float)N;
        }
    cudaMemset(dx, 0xff, nx * 4);
    CHECK(cuda_hc_mean(dxs, T, N, E, dx, 0) == cudaSuccess);
    get(xg, dx, nx * 4);
    double em = rel(xg, xc, nx);
    bool ok = ex[0] <= 1e-4 && ex[1] <= 1e-4 && es[0] <= 1e-4 && es[1] <= 1e-4 && em == 0;
    printf("%s T %2d E %4d iters %2d: collapse x %.2e / %.2e, streams after write-back %.2e / %.2e (sites 0 / 1), "
           "mean %.2e\n", ok ? "ok  " : "FAIL", T, E, iters, ex[0], ex[1], es[0], es[1], em);
    CHECKF(ok, "T %d E %d iters %d", T, E, iters);
    cpu_hc_destroy(h);
    cpu_kernels_destroy(cb);
    for (int s = 0; s < 2; s++) {
        free(fn[s]), free(base[s]), free(scale[s]);
        cudaFree(dfn[s]), cudaFree(dbase[s]), cudaFree(dscale[s]);
    }
    cudaFree(dxs), cudaFree(dx), cudaFree(dpart), cudaFree(dpost), cudaFree(dcomb), cudaFree(dy);
    free(xs), free(xc), free(xg), free(y), free(sg), free(yb);
}

static void test_sites(void)
{
    static const int cases[][3] = {{1, 64, 7}, {5, 64, 7}, {33, 64, 20}, {1, 4096, 7}, {3, 4096, 20}, {17, 1000, 7}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) hc_case(cases[i][0], cases[i][1], cases[i][2]);
}

/* The expansion of the embedding into every stream: a copy. */
static void test_expand(void)
{
    int T = 3, N = 4, E = 100;
    float *x = malloc((size_t)T * E * 4), *xs = malloc((size_t)T * N * E * 4);
    for (int i = 0; i < T * E; i++) x[i] = frand();
    float *dx = dup_dev(x, (size_t)T * E * 4), *dxs = poisoned((size_t)T * N * E * 4);
    CHECK(cuda_hc_expand(dx, T, N, E, dxs, 0) == cudaSuccess);
    get(xs, dxs, (size_t)T * N * E * 4);
    int bad = 0;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < N; i++) bad += memcmp(xs + ((size_t)t * N + i) * E, x + (size_t)t * E, (size_t)E * 4) != 0;
    printf("%s expand: %d of %d streams differ from the embedding\n", bad ? "FAIL" : "ok  ", bad, T * N);
    CHECK(bad == 0);
    cudaFree(dx), cudaFree(dxs), free(x), free(xs);
}

/* glm5_next's clamped SwiGLU: the CPU backend's dense FFN formula on the f32 gate and up. */
static void test_swiglu_limit(void)
{
    int T = 7, F = 200;
    float lim = 0.5f;
    float *gu = malloc((size_t)T * 2 * F * 4), *dgu;
    uint16_t *h = malloc((size_t)T * F * 2);
    for (int i = 0; i < T * 2 * F; i++) gu[i] = 2.0f * frand();
    dgu = dup_dev(gu, (size_t)T * 2 * F * 4);
    uint16_t *dh = poisoned((size_t)T * F * 2);
    CHECK(cuda_swiglu_limit(dgu, T, F, lim, dh, 0) == cudaSuccess);
    get(h, dh, (size_t)T * F * 2);
    int worst = 0;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < F; j++) {
            float g = gu[t * 2 * F + j], u = gu[t * 2 * F + F + j];
            g = g < lim ? g : lim;
            u = u < -lim ? -lim : u > lim ? lim : u;
            uint16_t r = bf(g / (1.0f + expf(-g)) * u), o = h[t * F + j];
            int d = abs((int)(int16_t)r - (int)(int16_t)o); /* ulps, for same-signed values */
            if ((r ^ o) & 0x8000) d = (r & 0x7fff) + (o & 0x7fff); /* across zero */
            if (d > worst) worst = d;
        }
    printf("%s swiglu_limit (limit %.1f, %d x %d): largest difference %d bf16 ulp\n", worst <= 1 ? "ok  " : "FAIL", lim,
           T, F, worst);
    CHECK(worst <= 1);
    cudaFree(dgu), cudaFree(dh), free(gu), free(h);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU: skipped\n0 passed, 0 failed\n");
        return 0;
    }
    RUN(test_expand);
    RUN(test_sites);
    RUN(test_swiglu_limit);
    return test_summary();
}
