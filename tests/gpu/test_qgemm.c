/* test_qgemm.c - the packed int4/int8 GEMMs (cuda/qgemm.cu) against a plain-C
 * reference on random data (make gpu-test; needs a GPU).
 *
 * Each case is a random weight in the device layout (model/model.h, struct
 * model_qrepack): int4 and int8; groups of 32, 64, 128 and per-channel;
 * symmetric and with zero points; f16 and bf16 scales; act-order (a random
 * column permutation); odd shapes (out 4100, in 2112: a partial last group
 * of 128; in 100 and 99: rows that are not a whole number of 16-byte
 * chunks); the GEMV's tensor-core kernel (where it applies) and its SIMT
 * kernel (cuda_qgemv_select). The reference dequantizes each row with model_qrepack_row (the
 * CPU's exact values) and sums in double. cuda_qgemm runs for T = 1 .. 8
 * (the GEMV), 9 .. 64 (the tensor-core GEMV where it applies, else
 * dequantize + cuBLAS, in several row tiles) and 65, 200 (dequantize + cuBLAS),
 * into bf16 and f32 outputs with a row stride wider than the weight, whose
 * extra columns must stay untouched. Bounds per output: |y - ref| <= tol *
 * sum_k |w x| (+ bf16 rounding of y): tol 5e-5 for the GEMV (exact weights,
 * f32 sums), 1e-4 above 8 rows with bf16 scales, 2^-8 for
 * f16 weights rounded to bf16 tiles; the dequantized tiles themselves equal
 * the reference's values rounded to bf16, bit for bit (the GEMV shares their
 * arithmetic). The fused SwiGLU epilogue against the unfused pair; decode's
 * fused forms (the RMSNorm in the GEMV's prologue, the residual add in its
 * epilogue) against cuda_add_rmsnorm and the plain GEMV, bit for bit. One
 * case also runs inside a captured CUDA graph.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "cuda/qgemm.h"
#include "model/model.h"
#include "tests/gpu/gpu_util.h"
#include "tests/test.h"

static uint32_t urand(void)
{
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 32);
}


struct qcase {
    int bits, group; /* group 0: per-channel */
    bool asym, act, f16;
    int rows, cols;
};

/* a random weight in the device layout */
static void make_weight(const struct qcase *c, struct model_qrepack *p)
{
    memset(p, 0, sizeof *p);
    p->bits = c->bits, p->rows = c->rows, p->cols = c->cols;
    p->group = c->group ? c->group : c->cols;
    p->n_groups = (c->cols + p->group - 1) / p->group;
    p->row_bytes = ((int64_t)(c->cols * c->bits + 7) / 8 + 15) / 16 * 16;
    p->f16 = c->f16;
    size_t ng = (size_t)c->rows * p->n_groups;
    p->qw = calloc((size_t)(c->rows * p->row_bytes), 1);
    p->scales = malloc(ng * 2);
    for (int r = 0; r < c->rows; r++)
        for (int k = 0; k < c->cols; k++) {
            uint32_t u = urand() & ((1u << c->bits) - 1);
            uint8_t *row = p->qw + (size_t)r * p->row_bytes;
            if (c->bits == 8) row[k] = (uint8_t)u;
            else {
                int nib = k % 8 / 2 + 4 * (k % 2); /* the device layout's nibble of column k (model.h) */
                row[k / 8 * 4 + nib / 2] |= (uint8_t)(u << (4 * (nib % 2)));
            }
        }
    /* scales 2^-10 .. 2^-3 with random mantissas and signs, as raw bits */
    for (size_t i = 0; i < ng; i++) {
        uint32_t e = 5 + urand() % 8, s = urand() & 1;
        p->scales[i] = c->f16 ? (uint16_t)(s << 15 | e << 10 | (urand() & 0x3FF))
                              : (uint16_t)(s << 15 | (e + 112) << 7 | (urand() & 0x7F));
    }
    if (c->asym) {
        p->zeros = malloc(ng);
        for (size_t i = 0; i < ng; i++) p->zeros[i] = (uint8_t)(urand() & ((1u << c->bits) - 1));
    }
    if (c->act) {
        p->perm = malloc((size_t)c->cols * 4);
        for (int k = 0; k < c->cols; k++) p->perm[k] = k;
        for (int k = c->cols - 1; k > 0; k--) {
            int j = (int)(urand() % (uint32_t)(k + 1)), t = p->perm[k];
            p->perm[k] = p->perm[j], p->perm[j] = t;
        }
    }
}

static void run_case(const struct qcase *c, const int *Ts, int nT, cublasHandle_t blas, cudaStream_t st)
{
    struct model_qrepack p;
    make_weight(c, &p);
    int R = c->rows, K = c->cols, maxT = 0;
    for (int i = 0; i < nT; i++) maxT = Ts[i] > maxT ? Ts[i] : maxT;
    float *w = malloc((size_t)R * K * sizeof *w);
    for (int r = 0; r < R; r++) model_qrepack_row(&p, r, w + (size_t)r * K);
    uint16_t *x = malloc((size_t)maxT * K * 2);
    for (int i = 0; i < maxT * K; i++) x[i] = bf(frand());
    struct cuda_qmat q = {.bits = c->bits, .rows = R, .cols = K, .group = p.group, .n_groups = p.n_groups,
                          .row_bytes = (int)p.row_bytes, .f16 = c->f16};
    size_t ng = (size_t)R * p.n_groups;
    q.qw = dup_dev(p.qw, (size_t)(R * p.row_bytes));
    q.scales = dup_dev(p.scales, ng * 2);
    if (p.zeros) q.zeros = dup_dev(p.zeros, ng);
    if (p.perm) q.perm = dup_dev(p.perm, (size_t)K * 4);
    /* tiles of 37 rows (several tiles, the last one partial) */
    struct cuda_qgemm_ws ws = {.xperm_elems = (size_t)CUDA_QGEMV_MMA_MAX_T * K, .deq_bytes = (size_t)37 * K * 2};
    ws.xperm = dup_dev(NULL, ws.xperm_elems * 2);
    ws.deq = dup_dev(NULL, ws.deq_bytes);
    int ldy = R + 5;
    uint16_t *dx = dup_dev(x, (size_t)maxT * K * 2);
    void *dy = dup_dev(NULL, (size_t)maxT * ldy * 4);
    float *y = malloc((size_t)maxT * ldy * 4);
    double *ref = malloc((size_t)maxT * R * sizeof *ref), *mag = malloc((size_t)maxT * R * sizeof *mag);
    for (int t = 0; t < maxT; t++)
        for (int r = 0; r < R; r++) {
            double s = 0, a = 0;
            const float *wr = w + (size_t)r * K;
            for (int k = 0; k < K; k++) {
                double v = (double)wr[k] * fb(x[(size_t)t * K + k]);
                s += v, a += fabs(v);
            }
            ref[(size_t)t * R + r] = s, mag[(size_t)t * R + r] = a;
        }
    /* the dequantized tiles, bit for bit the reference's values rounded to bf16 */
    {
        uint16_t *dd = dup_dev(NULL, (size_t)R * K * 2), *hd = malloc((size_t)R * K * 2);
        int r0 = R > 3 ? 3 : 0;
        cudaError_t e = cuda_qdequant(&q, r0, R - r0, dd, st);
        if (e == cudaSuccess) e = cudaStreamSynchronize(st);
        cudaMemcpy(hd, dd, (size_t)(R - r0) * K * 2, cudaMemcpyDeviceToHost);
        int diff = 0;
        for (size_t i = 0; i < (size_t)(R - r0) * K; i++) diff += hd[i] != bf(w[(size_t)r0 * K + i]);
        CHECKF(e == cudaSuccess && diff == 0, "int%d g%d %dx%d: dequantized rows: %s, %d values differ", c->bits,
               c->group, R, K, cudaGetErrorString(e), diff);
        cudaFree(dd), free(hd);
    }
    for (int i = 0; i < nT; i++) {
        int T = Ts[i];
        for (int yf = 0; yf < 2; yf++) {
            cudaMemset(dy, 0xff, (size_t)T * ldy * 4); /* NaN in f32 and bf16 */
            cublasStatus_t s = cuda_qgemm(&q, dx, dy, yf, ldy, T, &ws, blas, st);
            cudaError_t e = cudaStreamSynchronize(st);
            cudaMemcpy(y, dy, (size_t)T * ldy * (yf ? 4 : 2), cudaMemcpyDeviceToHost);
            double tol = T <= CUDA_QGEMV_MAX_T ? 5e-5 : !c->f16 ? 1e-4 : 1.0 / 256, worst = 0;
            int bad = 0, touched = 0;
            for (int t = 0; t < T; t++) {
                for (int r = 0; r < ldy; r++) {
                    size_t o = (size_t)t * ldy + r;
                    float v = yf ? y[o] : fb(((uint16_t *)y)[o]);
                    if (r >= R) {
                        touched += !isnan(v);
                        continue;
                    }
                    double rf = ref[(size_t)t * R + r];
                    double bound = tol * mag[(size_t)t * R + r] + (yf ? 0 : fabs(rf) / 256) + 1e-30;
                    double d = fabs(v - rf) / bound;
                    if (!(d <= 1)) bad++;
                    if (!(d <= worst)) worst = d;
                }
            }
            CHECKF(s == CUBLAS_STATUS_SUCCESS && e == cudaSuccess && bad == 0 && touched == 0,
                   "int%d g%d %s%s %s %dx%d T=%d %s: status %d, %s; %d outside the bound (worst %.3g of it), %d "
                   "written past the weight's rows",
                   c->bits, c->group, c->asym ? "asym" : "sym", c->act ? " act-order" : "", c->f16 ? "f16" : "bf16",
                   R, K, T, yf ? "f32" : "bf16", (int)s, cudaGetErrorString(e), bad, worst, touched);
        }
    }
    free(w), free(x), free(y), free(ref), free(mag);
    cudaFree((void *)q.qw), cudaFree((void *)q.scales), cudaFree((void *)q.zeros), cudaFree((void *)q.perm);
    cudaFree(ws.xperm), cudaFree(ws.deq), cudaFree(dx), cudaFree(dy);
    model_qrepack_free(&p);
}

static cublasHandle_t g_blas;
static cudaStream_t g_st;

/* every format on a middling shape, every T */
static void test_formats(void)
{
    static const int Ts[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33, 64, 65, 200};
    static const int groups[] = {32, 64, 128, 0};
    int n = 0;
    for (int bits = 4; bits <= 8; bits += 4)
        for (int gi = 0; gi < 4; gi++)
            for (int asym = 0; asym < 2; asym++)
                for (int act = 0; act < 2; act++) {
                    if (act && !groups[gi]) continue;
                    struct qcase c = {.bits = bits, .group = groups[gi], .asym = asym, .act = act,
                                      .f16 = (n % 3) == 1, .rows = 300, .cols = 576};
                    run_case(&c, Ts, (int)(sizeof Ts / sizeof Ts[0]), g_blas, g_st);
                    n++;
                }
    printf("  %d formats\n", n);
}

/* odd shapes: a partial last group, rows that are not whole chunks */
static void test_shapes(void)
{
    static const int Ts[] = {1, 2, 3, 8, 9, 64, 65};
    static const struct qcase cs[] = {
        {.bits = 4, .group = 128, .asym = false, .rows = 4100, .cols = 2112},
        {.bits = 4, .group = 32, .asym = true, .act = true, .f16 = true, .rows = 4100, .cols = 2112},
        {.bits = 8, .group = 0, .asym = false, .rows = 4100, .cols = 2112},
        {.bits = 8, .group = 64, .asym = true, .f16 = true, .rows = 4100, .cols = 2112},
        {.bits = 4, .group = 0, .asym = true, .rows = 77, .cols = 100},
        {.bits = 4, .group = 0, .asym = false, .f16 = true, .rows = 33, .cols = 99},
        {.bits = 8, .group = 0, .asym = true, .rows = 65, .cols = 100},
        {.bits = 8, .group = 8, .asym = true, .act = true, .rows = 19, .cols = 40},
        {.bits = 4, .group = 16, .asym = false, .rows = 1, .cols = 48},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) run_case(&cs[i], Ts, 7, g_blas, g_st);
    static const int T200[] = {200};
    run_case(&cs[0], T200, 1, g_blas, g_st);
}

/* captured in a CUDA graph (as the backend's decode and prefill steps are):
 * the same outputs as the eager launches */
static void test_graph(void)
{
    struct qcase c = {.bits = 4, .group = 128, .asym = true, .act = true, .rows = 512, .cols = 1024};
    struct model_qrepack p;
    make_weight(&c, &p);
    struct cuda_qmat q = {.bits = 4, .rows = c.rows, .cols = c.cols, .group = p.group, .n_groups = p.n_groups,
                          .row_bytes = (int)p.row_bytes};
    size_t ng = (size_t)c.rows * p.n_groups;
    q.qw = dup_dev(p.qw, (size_t)(c.rows * p.row_bytes));
    q.scales = dup_dev(p.scales, ng * 2);
    q.zeros = dup_dev(p.zeros, ng);
    q.perm = dup_dev(p.perm, (size_t)c.cols * 4);
    struct cuda_qgemm_ws ws = {.xperm_elems = (size_t)8 * c.cols, .deq_bytes = (size_t)100 * c.cols * 2};
    ws.xperm = dup_dev(NULL, ws.xperm_elems * 2);
    ws.deq = dup_dev(NULL, ws.deq_bytes);
    int T[2] = {1, 40};
    uint16_t *x = malloc((size_t)40 * c.cols * 2);
    for (int i = 0; i < 40 * c.cols; i++) x[i] = bf(frand());
    uint16_t *dx = dup_dev(x, (size_t)40 * c.cols * 2);
    float *dy[2] = {dup_dev(NULL, (size_t)40 * c.rows * 4), dup_dev(NULL, (size_t)40 * c.rows * 4)};
    float *h[2] = {malloc((size_t)40 * c.rows * 4), malloc((size_t)40 * c.rows * 4)};
    for (int i = 0; i < 2; i++) {
        size_t n = (size_t)T[i] * c.rows * 4;
        CHECK(cuda_qgemm(&q, dx, dy[0], true, c.rows, T[i], &ws, g_blas, g_st) == CUBLAS_STATUS_SUCCESS);
        cudaStreamSynchronize(g_st);
        cudaGraph_t g = NULL;
        cudaGraphExec_t ge = NULL;
        cudaMemset(dy[1], 0xff, n);
        CHECK(cudaStreamBeginCapture(g_st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
        cublasStatus_t s = cuda_qgemm(&q, dx, dy[1], true, c.rows, T[i], &ws, g_blas, g_st);
        CHECK(cudaStreamEndCapture(g_st, &g) == cudaSuccess && s == CUBLAS_STATUS_SUCCESS);
        CHECK(g && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess);
        if (ge) {
            CHECK(cudaGraphLaunch(ge, g_st) == cudaSuccess && cudaStreamSynchronize(g_st) == cudaSuccess);
            cudaMemcpy(h[0], dy[0], n, cudaMemcpyDeviceToHost);
            cudaMemcpy(h[1], dy[1], n, cudaMemcpyDeviceToHost);
            CHECKF(memcmp(h[0], h[1], n) == 0, "T=%d: the graph's outputs differ from the eager launch's", T[i]);
            cudaGraphExecDestroy(ge);
        }
        if (g) cudaGraphDestroy(g);
    }
    free(x), free(h[0]), free(h[1]);
    cudaFree(dx), cudaFree(dy[0]), cudaFree(dy[1]);
    cudaFree((void *)q.qw), cudaFree((void *)q.scales), cudaFree((void *)q.zeros), cudaFree((void *)q.perm);
    cudaFree(ws.xperm), cudaFree(ws.deq);
    model_qrepack_free(&p);
}

/* SwiGLU in the GEMV's epilogue (cuda_qgemm_swiglu) against cuda_qgemm into
 * gate|up followed by cuda_swiglu: bit for bit where the gate rows sit in
 * the tiles the unfused kernel gives them (F a multiple of 16), within a
 * bf16 step of the SwiGLU elsewhere; every T up to past the fused kernel's
 * limit (where it is the unfused pair itself) */
static void test_swiglu(void)
{
    static const struct qcase cs[] = {
        {.bits = 4, .group = 128, .rows = 2 * 1024, .cols = 1024},
        {.bits = 4, .group = 32, .asym = true, .act = true, .rows = 2 * 512, .cols = 576},
        {.bits = 8, .group = 0, .rows = 2 * 256, .cols = 4096},
        {.bits = 8, .group = 64, .asym = true, .rows = 2 * 100, .cols = 320},
        {.bits = 4, .group = 64, .asym = true, .f16 = true, .rows = 2 * 64, .cols = 256}, /* the unfused pair */
    };
    static const int Ts[] = {1, 2, 5, 8, 9, 16, 17, 40};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const struct qcase *c = &cs[ci];
        struct model_qrepack p;
        make_weight(c, &p);
        int F = c->rows / 2, K = c->cols, maxT = 40;
        struct cuda_qmat q = {.bits = c->bits, .rows = c->rows, .cols = K, .group = p.group, .n_groups = p.n_groups,
                              .row_bytes = (int)p.row_bytes, .f16 = c->f16};
        size_t ng = (size_t)c->rows * p.n_groups;
        q.qw = dup_dev(p.qw, (size_t)(c->rows * p.row_bytes));
        q.scales = dup_dev(p.scales, ng * 2);
        if (p.zeros) q.zeros = dup_dev(p.zeros, ng);
        if (p.perm) q.perm = dup_dev(p.perm, (size_t)K * 4);
        struct cuda_qgemm_ws ws = {.xperm_elems = (size_t)CUDA_QGEMV_MMA_MAX_T * K, .deq_bytes = (size_t)64 * K * 2};
        ws.xperm = dup_dev(NULL, ws.xperm_elems * 2);
        ws.deq = dup_dev(NULL, ws.deq_bytes);
        uint16_t *x = malloc((size_t)maxT * K * 2);
        for (int i = 0; i < maxT * K; i++) x[i] = bf(frand() * 4);
        uint16_t *dx = dup_dev(x, (size_t)maxT * K * 2), *gu = dup_dev(NULL, (size_t)maxT * 2 * F * 2);
        uint16_t *h1 = dup_dev(NULL, (size_t)maxT * F * 2), *h2 = dup_dev(NULL, (size_t)maxT * F * 2);
        uint16_t *a = malloc((size_t)maxT * F * 2), *b = malloc((size_t)maxT * F * 2);
        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
            int T = Ts[ti];
            size_t n = (size_t)T * F * 2;
            cudaMemset(h1, 0xff, n), cudaMemset(h2, 0xff, n);
            cublasStatus_t s1 = cuda_qgemm_swiglu(&q, dx, h1, gu, T, &ws, g_blas, g_st);
            cublasStatus_t s2 = cuda_qgemm(&q, dx, gu, false, 2 * F, T, &ws, g_blas, g_st);
            cudaError_t e2 = cuda_swiglu(gu, T, F, h2, g_st);
            cudaError_t e = cudaStreamSynchronize(g_st);
            cudaMemcpy(a, h1, n, cudaMemcpyDeviceToHost);
            cudaMemcpy(b, h2, n, cudaMemcpyDeviceToHost);
            int diff = 0, far = 0;
            for (size_t i = 0; i < (size_t)T * F; i++) {
                float u = fb(a[i]), v = fb(b[i]);
                diff += a[i] != b[i];
                far += !(fabsf(u - v) <= fabsf(v) / 128 + 1e-30f); /* NaN: far */
            }
            bool exact = F % 16 == 0;
            CHECKF(s1 == CUBLAS_STATUS_SUCCESS && s2 == CUBLAS_STATUS_SUCCESS && e2 == cudaSuccess &&
                       e == cudaSuccess && far == 0 && (!exact || diff == 0),
                   "swiglu int%d g%d F=%d K=%d T=%d: status %d/%d, %s; %d differ, %d beyond a bf16 step", c->bits,
                   c->group, F, K, T, (int)s1, (int)s2, cudaGetErrorString(e), diff, far);
        }
        free(x), free(a), free(b);
        cudaFree(dx), cudaFree(gu), cudaFree(h1), cudaFree(h2), cudaFree(ws.xperm), cudaFree(ws.deq);
        cudaFree((void *)q.qw), cudaFree((void *)q.scales), cudaFree((void *)q.zeros), cudaFree((void *)q.perm);
        model_qrepack_free(&p);
    }
}

/* cuda_qgemv_rmsnorm against cuda_add_rmsnorm (no delta) then cuda_qgemv,
 * and cuda_qgemv_residual against cuda_qgemv into a bf16 delta then
 * cuda_add_rmsnorm's add: bit for bit, on hidden sizes whose norm takes
 * fewer threads than the GEMV's block (256: 96, 512), more (2048: 512, 4096:
 * 1024, 4 values each); x with values of many magnitudes, so a sum of
 * squares in another order would show. 5120 columns: past the prologue's
 * registers, the norm refused, the residual taken. Weights the fused forms
 * do not take are refused. */
static void test_fused(void)
{
    static const struct qcase cs[] = {
        {.bits = 4, .group = 128, .rows = 5120, .cols = 2048},
        {.bits = 4, .group = 32, .asym = true, .rows = 256, .cols = 512},
        {.bits = 8, .group = 0, .rows = 1000, .cols = 4096},
        {.bits = 4, .group = 64, .rows = 64, .cols = 96},
        {.bits = 8, .group = 32, .rows = 300, .cols = 5120},
    };
    static const int Ts[] = {1, 3, 8, 17};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const struct qcase *c = &cs[ci];
        struct model_qrepack p;
        make_weight(c, &p);
        const int N = c->rows, K = c->cols, maxT = 17;
        struct cuda_qmat q = {.bits = c->bits, .rows = N, .cols = K, .group = p.group, .n_groups = p.n_groups,
                              .row_bytes = (int)p.row_bytes, .f16 = c->f16};
        size_t ng = (size_t)N * p.n_groups;
        q.qw = dup_dev(p.qw, (size_t)N * p.row_bytes);
        q.scales = dup_dev(p.scales, ng * 2);
        if (p.zeros) q.zeros = dup_dev(p.zeros, ng);
        const bool nf = K <= 4096;
        CHECKF(cuda_qgemv_fuses(&q, false) && cuda_qgemv_fuses(&q, true) == nf, "int%d g%d %dx%d: fused forms %d/%d",
               c->bits, c->group, N, K, cuda_qgemv_fuses(&q, false), cuda_qgemv_fuses(&q, true));
        /* the norm: x f32 with magnitudes 2^-6 .. 2^6, its weights around 1 */
        float *xf = malloc((size_t)K * 4), *nw = malloc((size_t)K * 4);
        for (int i = 0; i < K; i++) xf[i] = frand() * ldexpf(1.0f, (int)(urand() % 13) - 6), nw[i] = 1 + frand() / 4;
        float *dxf = dup_dev(xf, (size_t)K * 4), *dnw = dup_dev(nw, (size_t)K * 4);
        uint16_t *dxn = dup_dev(NULL, (size_t)K * 2), *y1 = dup_dev(NULL, (size_t)N * 2), *y2 = dup_dev(NULL, (size_t)N * 2);
        cudaError_t e1 = cuda_add_rmsnorm(dxf, NULL, dnw, NULL, 1, K, 1e-6f, dxn, g_st);
        cudaError_t e2 = cuda_qgemv(&q, dxn, y1, false, N, 1, g_st);
        cudaError_t e3 = cuda_qgemv_rmsnorm(&q, dxf, dnw, 1e-6f, y2, g_st);
        cudaError_t e = cudaStreamSynchronize(g_st);
        if (!nf) { /* refused: the unfused output stands in for the fused one */
            CHECKF(e3 == cudaErrorInvalidValue, "%dx%d: the norm prologue past its registers: %s", N, K,
                   cudaGetErrorString(e3));
            e3 = cudaMemcpy(y2, y1, (size_t)N * 2, cudaMemcpyDeviceToDevice);
        }
        uint16_t *a = malloc((size_t)maxT * N * 4), *b = malloc((size_t)maxT * N * 4);
        cudaMemcpy(a, y1, (size_t)N * 2, cudaMemcpyDeviceToHost);
        cudaMemcpy(b, y2, (size_t)N * 2, cudaMemcpyDeviceToHost);
        CHECKF(e1 == cudaSuccess && e2 == cudaSuccess && e3 == cudaSuccess && e == cudaSuccess &&
                   memcmp(a, b, (size_t)N * 2) == 0,
               "int%d g%d %dx%d: norm in the prologue: %s / %s, outputs %s", c->bits, c->group, N, K,
               cudaGetErrorString(e3), cudaGetErrorString(e), memcmp(a, b, (size_t)N * 2) ? "differ" : "equal");
        /* the residual: x bf16 [T][K], the residual f32 [T][N] */
        uint16_t *x = malloc((size_t)maxT * K * 2);
        float *r = malloc((size_t)maxT * N * 4);
        for (int i = 0; i < maxT * K; i++) x[i] = bf(frand() * 4);
        for (int i = 0; i < maxT * N; i++) r[i] = frand() * 8;
        uint16_t *dx = dup_dev(x, (size_t)maxT * K * 2), *dd = dup_dev(NULL, (size_t)maxT * N * 2);
        uint16_t *dn = dup_dev(NULL, (size_t)maxT * N * 2);
        float *ones = malloc((size_t)N * 4);
        for (int i = 0; i < N; i++) ones[i] = 1.0f;
        float *dones = dup_dev(ones, (size_t)N * 4);
        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
            int T = Ts[ti];
            float *r1 = dup_dev(r, (size_t)T * N * 4), *r2 = dup_dev(r, (size_t)T * N * 4);
            e1 = cuda_qgemv(&q, dx, dd, false, N, T, g_st);
            e2 = cuda_add_rmsnorm(r1, dd, dones, NULL, T, N, 1e-6f, dn, g_st);
            e3 = cuda_qgemv_residual(&q, dx, r2, T, g_st);
            e = cudaStreamSynchronize(g_st);
            cudaMemcpy(a, r1, (size_t)T * N * 4, cudaMemcpyDeviceToHost);
            cudaMemcpy(b, r2, (size_t)T * N * 4, cudaMemcpyDeviceToHost);
            int diff = memcmp(a, b, (size_t)T * N * 4) != 0, moved = memcmp(a, r, (size_t)T * N * 4) != 0;
            CHECKF(e1 == cudaSuccess && e2 == cudaSuccess && e3 == cudaSuccess && e == cudaSuccess && !diff && moved,
                   "int%d g%d %dx%d T=%d: residual in the epilogue: %s / %s, %s", c->bits, c->group, N, K, T,
                   cudaGetErrorString(e3), cudaGetErrorString(e), diff ? "differs" : "unchanged");
            cudaFree(r1), cudaFree(r2);
        }
        free(xf), free(nw), free(a), free(b), free(x), free(r), free(ones);
        cudaFree(dxf), cudaFree(dnw), cudaFree(dxn), cudaFree(y1), cudaFree(y2), cudaFree(dx), cudaFree(dd);
        cudaFree(dn), cudaFree(dones);
        cudaFree((void *)q.qw), cudaFree((void *)q.scales), cudaFree((void *)q.zeros);
        model_qrepack_free(&p);
    }
    /* act order and f16 scales: not the tensor-core kernel's, so no fused forms */
    struct qcase na[] = {{.bits = 4, .group = 32, .act = true, .rows = 64, .cols = 256},
                         {.bits = 4, .group = 64, .f16 = true, .rows = 64, .cols = 256}};
    for (int i = 0; i < 2; i++) {
        struct model_qrepack p;
        make_weight(&na[i], &p);
        struct cuda_qmat q = {.bits = 4, .rows = 64, .cols = 256, .group = p.group, .n_groups = p.n_groups,
                              .row_bytes = (int)p.row_bytes, .f16 = na[i].f16, .perm = na[i].act ? (int32_t *)8 : NULL};
        CHECKF(!cuda_qgemv_fuses(&q, false) && cuda_qgemv_rmsnorm(&q, NULL, NULL, 0, NULL, g_st) == cudaErrorInvalidValue &&
                   cuda_qgemv_residual(&q, NULL, NULL, 1, g_st) == cudaErrorInvalidValue,
               "case %d: fused forms for a weight the tensor-core GEMV does not take", i);
        model_qrepack_free(&p);
    }
}

/* a workspace too small is an error, not a write out of bounds */
static void test_bad_ws(void)
{
    struct qcase c = {.bits = 8, .group = 32, .act = true, .rows = 64, .cols = 256};
    struct model_qrepack p;
    make_weight(&c, &p);
    struct cuda_qmat q = {.bits = 8, .rows = c.rows, .cols = c.cols, .group = 32, .n_groups = p.n_groups,
                          .row_bytes = (int)p.row_bytes};
    q.qw = dup_dev(p.qw, (size_t)(c.rows * p.row_bytes));
    q.scales = dup_dev(p.scales, (size_t)c.rows * p.n_groups * 2);
    q.perm = dup_dev(p.perm, (size_t)c.cols * 4);
    uint16_t *dx = dup_dev(NULL, (size_t)16 * c.cols * 2);
    cudaMemset(dx, 0, (size_t)16 * c.cols * 2);
    void *dy = dup_dev(NULL, (size_t)16 * c.rows * 4);
    struct cuda_qgemm_ws ws = {.xperm = dup_dev(NULL, 16), .xperm_elems = 8, .deq = dup_dev(NULL, 16),
                               .deq_bytes = 16};
    CHECK(cuda_qgemm(&q, dx, dy, true, c.rows, 2, &ws, g_blas, g_st) == CUBLAS_STATUS_INVALID_VALUE);
    CHECK(cuda_qgemm(&q, dx, dy, true, c.rows, 16, &ws, g_blas, g_st) == CUBLAS_STATUS_INVALID_VALUE);
    CHECK(cudaStreamSynchronize(g_st) == cudaSuccess);
    cudaFree(dx), cudaFree(dy), cudaFree(ws.xperm), cudaFree(ws.deq);
    cudaFree((void *)q.qw), cudaFree((void *)q.scales), cudaFree((void *)q.perm);
    model_qrepack_free(&p);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU: skipped\n0 passed, 0 failed\n");
        return 0;
    }
    cudaStreamCreateWithFlags(&g_st, cudaStreamNonBlocking);
    cublasCreate(&g_blas);
    cublasSetStream(g_blas, g_st);
    void *bws = dup_dev(NULL, (size_t)32 << 20); /* cuBLAS allocates nothing inside a graph capture then */
    cublasSetWorkspace(g_blas, bws, (size_t)32 << 20);
    /* the default GEMV choice (the tensor-core kernel where it applies), then the SIMT kernel for all */
    RUN(test_formats);
    RUN(test_shapes);
    cuda_qgemv_select(0);
    RUN(test_formats);
    RUN(test_shapes);
    cuda_qgemv_select(1);
    RUN(test_swiglu);
    RUN(test_fused);
    RUN(test_graph);
    RUN(test_bad_ws);
    cublasDestroy(g_blas);
    cudaFree(bws);
    cudaStreamDestroy(g_st);
    return test_summary();
}
