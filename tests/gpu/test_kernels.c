/* test_kernels.c - every cuda/ kernel against a plain-C reference on random
 * data (make gpu-test; needs a GPU). Errors are normalized: ||out - ref|| /
 * ||ref|| over the whole output, against bf16-level bounds; outputs are
 * poisoned (NaN) before each launch so an unwritten element fails.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "tests/gpu/gpu_util.h"
#include "tests/test.h"


static void test_embed_rmsnorm(void)
{
    /* E a multiple of 1024 and T > CUDA_GEMV_MAX_T: the wide kernel */
    int shapes[][2] = {{1, 64}, {7, 576}, {33, 4096}, {5, 1000}, {3, 10000}, {6, 3072}, {4, 2048}, {40, 8192}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int T = shapes[si][0], E = shapes[si][1], V = 50;
        uint16_t *tab = malloc((size_t)V * E * 2), *delta = malloc((size_t)T * E * 2);
        int32_t ids[64];
        float *w = malloc(E * 4), *x = malloc((size_t)T * E * 4);
        for (int i = 0; i < V * E; i++) tab[i] = bf(frand());
        for (int i = 0; i < T * E; i++) delta[i] = bf(frand());
        for (int i = 0; i < E; i++) w[i] = 1.0f + 0.5f * frand();
        for (int t = 0; t < T; t++) ids[t] = (t * 7 + 3) % V;
        uint16_t *dtab = dup_dev(tab, (size_t)V * E * 2), *ddelta = dup_dev(delta, (size_t)T * E * 2);
        int32_t *dids = dup_dev(ids, sizeof ids);
        float *dw = dup_dev(w, E * 4), *dx = poisoned((size_t)T * E * 4);
        uint16_t *dout = poisoned((size_t)T * E * 2);
        CHECK(cuda_embed(dtab, dids, T, E, dx, 0) == cudaSuccess);
        CHECK(cuda_add_rmsnorm(dx, ddelta, dw, NULL, T, E, 1e-5f, dout, 0) == cudaSuccess);
        uint16_t *out = malloc((size_t)T * E * 2);
        get(out, dout, (size_t)T * E * 2);
        get(x, dx, (size_t)T * E * 4);
        double *ref = malloc((size_t)T * E * 8), *refx = malloc((size_t)T * E * 8);
        float *o = malloc((size_t)T * E * 4);
        for (int t = 0; t < T; t++) {
            double ss = 0;
            for (int i = 0; i < E; i++) {
                double v = (double)fb(tab[(size_t)ids[t] * E + i]) + fb(delta[(size_t)t * E + i]);
                refx[(size_t)t * E + i] = v;
                ss += v * v;
            }
            double r = 1.0 / sqrt(ss / E + 1e-5);
            for (int i = 0; i < E; i++) ref[(size_t)t * E + i] = w[i] * refx[(size_t)t * E + i] * r;
        }
        for (int i = 0; i < T * E; i++) o[i] = fb(out[i]);
        double e1 = nerr(o, ref, (size_t)T * E), e2 = nerr(x, refx, (size_t)T * E);
        CHECKF(e1 < 4e-3 && e2 < 1e-6, "T=%d E=%d: norm err %.3g, residual err %.3g", T, E, e1, e2);
        /* the gathered form (final norm): rows reversed, x untouched */
        int32_t rows[64];
        for (int r = 0; r < T; r++) rows[r] = T - 1 - r;
        int32_t *drows = dup_dev(rows, sizeof rows);
        cudaMemcpy(dx, x, (size_t)T * E * 4, cudaMemcpyHostToDevice); /* x already holds tab + delta */
        CHECK(cuda_add_rmsnorm(dx, NULL, dw, drows, T, E, 1e-5f, dout, 0) == cudaSuccess);
        get(out, dout, (size_t)T * E * 2);
        for (int r = 0; r < T; r++)
            for (int i = 0; i < E; i++) o[(size_t)r * E + i] = fb(out[(size_t)r * E + i]);
        double *ref2 = malloc((size_t)T * E * 8);
        for (int r = 0; r < T; r++) memcpy(ref2 + (size_t)r * E, ref + (size_t)rows[r] * E, (size_t)E * 8);
        e1 = nerr(o, ref2, (size_t)T * E);
        CHECKF(e1 < 4e-3, "T=%d E=%d: gathered norm err %.3g", T, E, e1);
        printf("  embed+add_rmsnorm T=%d E=%d: err %.2e\n", T, E, e1);
        free(tab), free(delta), free(w), free(x), free(out), free(ref), free(refx), free(o), free(ref2);
        cudaFree(dtab), cudaFree(ddelta), cudaFree(dids), cudaFree(dw), cudaFree(dx), cudaFree(dout), cudaFree(drows);
    }
}

/* F % 8 == 0 takes the 16-byte kernel, any other F the one-element kernel */
static void test_swiglu(void)
{
    for (int F = 1111, T = 13; F <= 1112; F++, T += 4) {
        uint16_t *gu = malloc((size_t)T * 2 * F * 2), *h = malloc((size_t)T * F * 2);
        for (int i = 0; i < T * 2 * F; i++) gu[i] = bf(4 * frand());
        uint16_t *dgu = dup_dev(gu, (size_t)T * 2 * F * 2), *dh = poisoned((size_t)T * F * 2);
        CHECK(cuda_swiglu(dgu, T, F, dh, 0) == cudaSuccess);
        get(h, dh, (size_t)T * F * 2);
        double *ref = malloc((size_t)T * F * 8);
        float *o = malloc((size_t)T * F * 4);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < F; j++) {
                double g = fb(gu[(size_t)t * 2 * F + j]), u = fb(gu[(size_t)t * 2 * F + F + j]);
                ref[(size_t)t * F + j] = g / (1 + exp(-g)) * u;
                o[(size_t)t * F + j] = fb(h[(size_t)t * F + j]);
            }
        double e = nerr(o, ref, (size_t)T * F);
        CHECKF(e < 4e-3, "swiglu err %.3g", e);
        printf("  swiglu T=%d F=%d: err %.2e\n", T, F, e);
        free(gu), free(h), free(ref), free(o), cudaFree(dgu), cudaFree(dh);
    }
}

/* double-precision x W^T over bf16 inputs: ref [T][out] */
static void ref_gemv(const uint16_t *w, const uint16_t *x, int T, int in, int out, double *ref)
{
    for (int t = 0; t < T; t++)
        for (int r = 0; r < out; r++) {
            double s = 0;
            for (int i = 0; i < in; i++) s += (double)fb(w[(size_t)r * in + i]) * fb(x[(size_t)t * in + i]);
            ref[(size_t)t * out + r] = s;
        }
}
static uint16_t *rand_bf(size_t n, float scale)
{
    uint16_t *p = malloc(n * 2);
    for (size_t i = 0; i < n; i++) p[i] = bf(scale * frand());
    return p;
}
static const char *const gemv_variant_name[] = {"warp", "block", "persist", "auto", "mma"};

/* every variant (warp, block, persistent; with and without PDL) against the
 * double reference; the block variants against each other bit for bit */
static void test_gemv(void)
{
    int shapes[][3] = {{1, 576, 1536}, {2, 4096, 1000}, {3, 8, 7},      {4, 14336, 64}, {1, 4096, 777},
                       {3, 14336, 129}, {4, 2048, 33},  {2, 20000, 17}, {1, 8192, 50},  {5, 4096, 300},
                       {8, 14336, 40},  {7, 576, 100},  {6, 2048, 33},  {8, 4096, 1000}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int T = shapes[si][0], in = shapes[si][1], out = shapes[si][2];
        size_t ny = (size_t)T * out;
        uint16_t *w = rand_bf((size_t)out * in, 1), *x = rand_bf((size_t)T * in, 1), *y = malloc(ny * 2);
        uint16_t *dw = dup_dev(w, (size_t)out * in * 2), *dx = dup_dev(x, (size_t)T * in * 2);
        uint16_t *dy = poisoned(ny * 2), *y1 = malloc(ny * 2), *y0 = malloc(ny * 2);
        float *dyf = poisoned(ny * 4), *yf = malloc(ny * 4), *o = malloc(ny * 4), *yf1 = malloc(ny * 4);
        float *yf0 = malloc(ny * 4);
        double *ref = malloc(ny * 8);
        ref_gemv(w, x, T, in, out, ref);
        for (int v = 0; v < 5; v++) {
            int variant = v < 3 ? v : v == 3 ? 1 : 4, pdl = v != 3; /* pass 3: block without PDL */
            cuda_gemv_select(variant, pdl, -1);
            cudaMemset(dy, 0xff, ny * 2), cudaMemset(dyf, 0xff, ny * 4);
            CHECK(cuda_gemv(dw, dx, dy, false, T, in, out, 0) == cudaSuccess);
            CHECK(cuda_gemv(dw, dx, dyf, true, T, in, out, 0) == cudaSuccess);
            get(y, dy, ny * 2), get(yf, dyf, ny * 4);
            for (size_t i = 0; i < ny; i++) o[i] = fb(y[i]);
            double e1 = nerr(o, ref, ny), e2 = nerr(yf, ref, ny);
            CHECKF(e1 < 4e-3 && e2 < 1e-5, "gemv %s%s T=%d in=%d out=%d: err %.3g (bf16 out), %.3g (f32 out)",
                   gemv_variant_name[variant], pdl ? "" : " no-pdl", T, in, out, e1, e2);
            if (v == 1) memcpy(y1, y, ny * 2), memcpy(yf1, yf, ny * 4);
            if (v >= 2 && v <= 3 && in >= 2048)
                CHECKF(!memcmp(y, y1, ny * 2) && !memcmp(yf, yf1, ny * 4),
                       "gemv %s%s T=%d in=%d out=%d: not bit-identical to block", gemv_variant_name[variant],
                       pdl ? "" : " no-pdl", T, in, out);
            if (v != 3)
                printf("  gemv %-7s T=%d in=%d out=%d: err %.2e (bf16 out), %.2e (f32 out)\n",
                       gemv_variant_name[variant], T, in, out, e1, e2);
            if (v == 0) memcpy(y0, y, ny * 2), memcpy(yf0, yf, ny * 4);
        }
        /* the warp kernel with 8 and 16 chunks per lane in flight: the sums
         * of 4, bit for bit */
        for (int ch = 8; ch <= 16; ch *= 2) {
            cuda_gemv_select(0, 1, ch);
            cudaMemset(dy, 0xff, ny * 2), cudaMemset(dyf, 0xff, ny * 4);
            CHECK(cuda_gemv(dw, dx, dy, false, T, in, out, 0) == cudaSuccess);
            CHECK(cuda_gemv(dw, dx, dyf, true, T, in, out, 0) == cudaSuccess);
            get(y, dy, ny * 2), get(yf, dyf, ny * 4);
            CHECKF(!memcmp(y, y0, ny * 2) && !memcmp(yf, yf0, ny * 4),
                   "gemv warp, %d chunks in flight, T=%d in=%d out=%d: not bit-identical to 4", ch, T, in, out);
        }
        cuda_gemv_select(1, 1, 4);
        free(w), free(x), free(y), free(yf), free(o), free(ref), free(y1), free(yf1), free(y0), free(yf0);
        cudaFree(dw), cudaFree(dx), cudaFree(dy), cudaFree(dyf);
    }
    /* bad shapes launch nothing */
    CHECK(cuda_gemv(NULL, NULL, NULL, false, CUDA_GEMV_MMA_MAX_T + 1, 4096, 8, 0) == cudaErrorInvalidValue);
    CHECK(cuda_gemv(NULL, NULL, NULL, false, 1, 4092, 8, 0) == cudaErrorInvalidValue);
    CHECK(cuda_gemv_rmsnorm(NULL, NULL, NULL, 1e-5f, NULL, 4, 8192, 8, 0) == cudaErrorInvalidValue);
}

/* The warpgroup GEMMs (sm_90 only) against the double reference, at sizes
 * that leave partial tiles along T, `in` and the output, and with more tiles
 * than SMs (the persistent loop, a partial group of row slices). SwiGLU in
 * the epilogue: bit for bit the plain kernel's product followed by
 * cuda_swiglu. A row's output: bit for bit the same in a 5-row call. */
static void test_gemm_wg(void)
{
    cudaError_t pe = cuda_gemm_wg_prepare();
    if (!cuda_gemm_wg_ok(1, 16, 16)) {
        printf("  no sm_90 device: skipped\n");
        CHECK(pe == cudaSuccess);
        return;
    }
    CHECK(pe == cudaSuccess);
    /* T, in, out; out = 2F for the SwiGLU pass */
    int shapes[][3] = {{1, 64, 16}, {200, 200, 528}, {77, 136, 400}, {1100, 256, 4096}, {2100, 128, 2048},
                       {130, 4096, 768}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int T = shapes[si][0], in = shapes[si][1], out = shapes[si][2], F = out / 2;
        size_t ny = (size_t)T * out, nh = (size_t)T * F;
        uint16_t *w = rand_bf((size_t)out * in, 1), *x = rand_bf((size_t)T * in, 1), *y = malloc(ny * 2);
        uint16_t *h = malloc(nh * 2), *h2 = malloc(nh * 2), *y5 = malloc((size_t)5 * out * 2);
        uint16_t *dw = dup_dev(w, (size_t)out * in * 2), *dx = dup_dev(x, (size_t)T * in * 2);
        uint16_t *dy = poisoned(ny * 2), *dh = poisoned(nh * 2), *dh2 = poisoned(nh * 2);
        float *o = malloc(ny * 4);
        double *ref = malloc(ny * 8), *href = malloc(nh * 8);
        ref_gemv(w, x, T, in, out, ref);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < F; j++) {
                double g = ref[(size_t)t * out + j], u = ref[(size_t)t * out + F + j];
                href[(size_t)t * F + j] = g / (1 + exp(-g)) * u;
            }
        CHECK(cuda_gemm_wg(dw, dx, dy, T, in, out, 0) == cudaSuccess);
        CHECK(cuda_gemm_wg_swiglu(dw, dx, dh, T, in, F, 0) == cudaSuccess);
        CHECK(cuda_swiglu(dy, T, F, dh2, 0) == cudaSuccess);
        get(y, dy, ny * 2), get(h, dh, nh * 2), get(h2, dh2, nh * 2);
        for (size_t i = 0; i < ny; i++) o[i] = fb(y[i]);
        double e1 = nerr(o, ref, ny);
        for (size_t i = 0; i < nh; i++) o[i] = fb(h[i]);
        double e2 = nerr(o, href, nh);
        CHECKF(e1 < 4e-3 && e2 < 6e-3, "gemm_wg T=%d in=%d out=%d: err %.3g, swiglu err %.3g", T, in, out, e1,
               e2);
        CHECKF(!memcmp(h, h2, nh * 2), "gemm_wg T=%d in=%d F=%d: SwiGLU epilogue not bit-identical to the kernels",
               T, in, F);
        /* rows T - 5 .. T - 1 alone */
        int r0 = T >= 5 ? T - 5 : 0, n5 = T - r0;
        cudaMemset(dy, 0xff, ny * 2);
        CHECK(cuda_gemm_wg(dw, dx + (size_t)r0 * in, dy, n5, in, out, 0) == cudaSuccess);
        get(y5, dy, (size_t)n5 * out * 2);
        CHECKF(!memcmp(y5, y + (size_t)r0 * out, (size_t)n5 * out * 2),
               "gemm_wg T=%d in=%d out=%d: rows differ in a %d-row call", T, in, out, n5);
        printf("  gemm_wg T=%d in=%d out=%d: err %.2e, swiglu err %.2e\n", T, in, out, e1, e2);
        free(w), free(x), free(y), free(h), free(h2), free(y5), free(o), free(ref), free(href);
        cudaFree(dw), cudaFree(dx), cudaFree(dy), cudaFree(dh), cudaFree(dh2);
    }
    /* bad shapes launch nothing */
    CHECK(cuda_gemm_wg(NULL, NULL, NULL, 4, 100, 64, 0) == cudaErrorInvalidValue);
    CHECK(cuda_gemm_wg_swiglu(NULL, NULL, NULL, 4, 64, 13, 0) == cudaErrorInvalidValue);
}

/* The decode fusions against the double reference (the rmsnorm ones through
 * a double-precision norm of x), and bit for bit against the unfused kernels
 * they replace (add_rmsnorm, gemv, swiglu, x += delta) in every variant:
 * warp and block kernels, for the same T and in, sum in the same order. */
static void test_gemv_fused(void)
{
    int shapes[][3] = {{1, 4096, 300}, {2, 2048, 1000}, {3, 4096, 77}, {4, 4096, 130}, {1, 14336, 40},
                       {2, 576, 100},  {4, 64, 9},      {1, 6144, 5},  {8, 2048, 100}, {6, 4096, 77},
                       {5, 576, 300},  {7, 1000, 50}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int T = shapes[si][0], in = shapes[si][1], out = shapes[si][2], F = out;
        /* past CUDA_GEMV_MAX_T rows (the tensor-core kernel alone) the
         * unfused norm of E % 1024 == 0 sums in another order (kernels.h) */
        const bool exact = true, nexact = T <= CUDA_GEMV_MAX_T || in % 1024;
        size_t nx = (size_t)T * in, ny = (size_t)T * out;
        uint16_t *w = rand_bf((size_t)2 * F * in, 1), *x = rand_bf(nx, 1);
        float *xr = malloc(nx * 4), *nw = malloc(in * 4), *xres = malloc(ny * 4);
        for (size_t i = 0; i < nx; i++) xr[i] = 3 * frand();
        for (int i = 0; i < in; i++) nw[i] = 1 + 0.5f * frand();
        for (size_t i = 0; i < ny; i++) xres[i] = 2 * frand();
        /* references: xn = rmsnorm(xr) in double, rounded to bf16 as the kernels do */
        uint16_t *xn = malloc(nx * 2);
        for (int t = 0; t < T; t++) {
            double ss = 0;
            for (int i = 0; i < in; i++) ss += (double)xr[(size_t)t * in + i] * xr[(size_t)t * in + i];
            double r = 1 / sqrt(ss / in + 1e-5);
            for (int i = 0; i < in; i++) xn[(size_t)t * in + i] = bf((float)(nw[i] * xr[(size_t)t * in + i] * r));
        }
        double *rgu = malloc((size_t)T * 2 * F * 8), *rnu = malloc((size_t)T * 2 * F * 8);
        double *rres = malloc(ny * 8), *rsw = malloc(ny * 8), *rnsw = malloc(ny * 8), *rn = malloc(ny * 8);
        ref_gemv(w, x, T, in, 2 * F, rgu);
        ref_gemv(w, xn, T, in, 2 * F, rnu);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < F; j++) {
                size_t k = (size_t)t * F + j, kg = (size_t)t * 2 * F + j;
                rres[k] = xres[k] + rgu[kg]; /* W's first `out` rows as the residual projection */
                double g = rgu[kg], u = rgu[kg + F];
                rsw[k] = g / (1 + exp(-g)) * u;
                g = rnu[kg], u = rnu[kg + F];
                rnsw[k] = g / (1 + exp(-g)) * u;
                rn[k] = rnu[kg];
            }
        uint16_t *dw = dup_dev(w, (size_t)2 * F * in * 2), *dx = dup_dev(x, nx * 2);
        float *dxr = dup_dev(xr, nx * 4), *dnw = dup_dev(nw, in * 4), *dres = dup_dev(NULL, ny * 4);
        uint16_t *dy = poisoned(ny * 2), *dxn = poisoned(nx * 2), *dgu = poisoned((size_t)T * 2 * F * 2);
        uint16_t *dh = poisoned(ny * 2);
        float *dscr = dup_dev(xr, nx * 4); /* add_rmsnorm's x: it writes back x + 0 */
        uint16_t *y = malloc(ny * 2), *u1 = malloc(ny * 2);
        float *o = malloc(ny * 4), *res = malloc(ny * 4), *res1 = malloc(ny * 4);
        static const int variants[] = {1, 2, 0, 3, 4};
        for (int vi = 0; vi < 5; vi++) {
            int variant = variants[vi];
            cuda_gemv_select(variant, variant != 0, variant == 3 ? 16 : 4); /* "auto": 8 chunks in flight */
            cuda_gemv_late(0); /* the norm's scale on x: bit for bit the unfused chain (late: below) */
            const char *vn = gemv_variant_name[variant];
            double e;
            /* swiglu */
            cudaMemset(dh, 0xff, ny * 2);
            CHECK(cuda_gemv_swiglu(dw, dx, dh, T, in, F, 0) == cudaSuccess);
            get(y, dh, ny * 2);
            for (size_t i = 0; i < ny; i++) o[i] = fb(y[i]);
            e = nerr(o, rsw, ny);
            CHECKF(e < 6e-3, "gemv_swiglu %s T=%d in=%d F=%d: err %.3g", vn, T, in, F, e);
            if (exact) {
                CHECK(cuda_gemv(dw, dx, dgu, false, T, in, 2 * F, 0) == cudaSuccess);
                CHECK(cuda_swiglu(dgu, T, F, dh, 0) == cudaSuccess);
                get(u1, dh, ny * 2);
                CHECKF(!memcmp(y, u1, ny * 2), "gemv_swiglu %s T=%d in=%d: not swiglu(gemv)", vn, T, in);
            }
            printf("  gemv_swiglu   %-7s T=%d in=%d F=%d: err %.2e%s\n", vn, T, in, F, e, exact ? ", exact" : "");
            /* residual */
            cudaMemcpy(dres, xres, ny * 4, cudaMemcpyHostToDevice);
            CHECK(cuda_gemv_residual(dw, dx, dres, T, in, out, 0) == cudaSuccess);
            get(res, dres, ny * 4);
            e = nerr(res, rres, ny);
            CHECKF(e < 4e-3, "gemv_residual %s T=%d in=%d out=%d: err %.3g", vn, T, in, out, e);
            if (exact) {
                CHECK(cuda_gemv(dw, dx, dy, false, T, in, out, 0) == cudaSuccess);
                get(y, dy, ny * 2);
                for (size_t i = 0; i < ny; i++) res1[i] = xres[i] + fb(y[i]);
                CHECKF(!memcmp(res, res1, ny * 4), "gemv_residual %s T=%d in=%d: not x + bf16(gemv)", vn, T, in);
            }
            printf("  gemv_residual %-7s T=%d in=%d out=%d: err %.2e%s\n", vn, T, in, out, e, exact ? ", exact" : "");
            /* rmsnorm prologue */
            cudaMemset(dy, 0xff, ny * 2);
            CHECK(cuda_gemv_rmsnorm(dw, dxr, dnw, 1e-5f, dy, T, in, out, 0) == cudaSuccess);
            get(y, dy, ny * 2);
            for (size_t i = 0; i < ny; i++) o[i] = fb(y[i]);
            e = nerr(o, rn, ny);
            CHECKF(e < 6e-3, "gemv_rmsnorm %s T=%d in=%d out=%d: err %.3g", vn, T, in, out, e);
            if (nexact) {
                CHECK(cuda_add_rmsnorm(dscr, NULL, dnw, NULL, T, in, 1e-5f, dxn, 0) == cudaSuccess);
                CHECK(cuda_gemv(dw, dxn, dy, false, T, in, out, 0) == cudaSuccess);
                get(u1, dy, ny * 2);
                CHECKF(!memcmp(y, u1, ny * 2), "gemv_rmsnorm %s T=%d in=%d: not gemv(add_rmsnorm)", vn, T, in);
            }
            printf("  gemv_rmsnorm  %-7s T=%d in=%d out=%d: err %.2e%s\n", vn, T, in, out, e, nexact ? ", exact" : "");
            /* both */
            cudaMemset(dh, 0xff, ny * 2);
            CHECK(cuda_gemv_rmsnorm_swiglu(dw, dxr, dnw, 1e-5f, dh, T, in, F, 0) == cudaSuccess);
            get(y, dh, ny * 2);
            for (size_t i = 0; i < ny; i++) o[i] = fb(y[i]);
            e = nerr(o, rnsw, ny);
            CHECKF(e < 8e-3, "gemv_rmsnorm_swiglu %s T=%d in=%d F=%d: err %.3g", vn, T, in, F, e);
            if (nexact) {
                CHECK(cuda_add_rmsnorm(dscr, NULL, dnw, NULL, T, in, 1e-5f, dxn, 0) == cudaSuccess);
                CHECK(cuda_gemv(dw, dxn, dgu, false, T, in, 2 * F, 0) == cudaSuccess);
                CHECK(cuda_swiglu(dgu, T, F, dh, 0) == cudaSuccess);
                get(u1, dh, ny * 2);
                CHECKF(!memcmp(y, u1, ny * 2), "gemv_rmsnorm_swiglu %s T=%d in=%d: not the unfused chain", vn, T, in);
            }
            printf("  gemv_rmsnorm_swiglu %-7s T=%d in=%d F=%d: err %.2e%s\n", vn, T, in, F, e, nexact ? ", exact" : "");
            if (T == 1) {
                /* the late scale (gemv.cu, norm_rows_late): y = inv * (bf16(nw * x) W^T). Against its own
                 * reference (x rounded where the kernel rounds it, the rest in double) with the chain's
                 * tolerances, and against the chain, which rounds x * inv instead (a looser bound: the
                 * two round the inputs independently) */
                cuda_gemv_late(1);
                double ss = 0, *rl = malloc((size_t)2 * F * 8), *rc = malloc((size_t)2 * F * 8);
                for (int i = 0; i < in; i++) ss += (double)xr[i] * xr[i];
                double r = 1 / sqrt(ss / in + 1e-5);
                uint16_t *xl = malloc((size_t)in * 2);
                for (int i = 0; i < in; i++) xl[i] = bf(nw[i] * xr[i]);
                ref_gemv(w, xl, 1, in, 2 * F, rl);
                for (int j = 0; j < 2 * F; j++) rl[j] *= r;
                cudaMemset(dy, 0xff, ny * 2);
                CHECK(cuda_gemv_rmsnorm(dw, dxr, dnw, 1e-5f, dy, T, in, out, 0) == cudaSuccess);
                get(y, dy, ny * 2);
                for (size_t i = 0; i < ny; i++) o[i] = fb(y[i]);
                double el = nerr(o, rl, ny);
                CHECK(cuda_add_rmsnorm(dscr, NULL, dnw, NULL, T, in, 1e-5f, dxn, 0) == cudaSuccess);
                CHECK(cuda_gemv(dw, dxn, dy, false, T, in, out, 0) == cudaSuccess);
                get(u1, dy, ny * 2);
                for (size_t i = 0; i < ny; i++) rc[i] = fb(u1[i]);
                double ec = nerr(o, rc, ny);
                CHECKF(el < 6e-3 && ec < 2e-2, "gemv_rmsnorm late %s in=%d out=%d: err %.3g, vs the chain %.3g", vn, in,
                       out, el, ec);
                for (int j = 0; j < F; j++) rl[j] = rl[j] / (1 + exp(-rl[j])) * rl[F + j];
                cudaMemset(dh, 0xff, ny * 2);
                CHECK(cuda_gemv_rmsnorm_swiglu(dw, dxr, dnw, 1e-5f, dh, T, in, F, 0) == cudaSuccess);
                get(y, dh, ny * 2);
                for (size_t i = 0; i < ny; i++) o[i] = fb(y[i]);
                double sl = nerr(o, rl, ny);
                CHECK(cuda_gemv(dw, dxn, dgu, false, T, in, 2 * F, 0) == cudaSuccess);
                CHECK(cuda_swiglu(dgu, T, F, dh, 0) == cudaSuccess);
                get(u1, dh, ny * 2);
                for (size_t i = 0; i < ny; i++) rc[i] = fb(u1[i]);
                double sc = nerr(o, rc, ny);
                CHECKF(sl < 8e-3 && sc < 3e-2, "gemv_rmsnorm_swiglu late %s in=%d F=%d: err %.3g, vs the chain %.3g", vn,
                       in, F, sl, sc);
                printf("  late scale    %-7s T=1 in=%d out=%d: norm err %.2e (vs the chain %.2e), swiglu %.2e (%.2e)\n",
                       vn, in, out, el, ec, sl, sc);
                free(rl), free(rc), free(xl);
            }
        }
        cuda_gemv_late(-1);
        cuda_gemv_select(1, 1, -1);
        free(w), free(x), free(xr), free(nw), free(xres), free(xn), free(rgu), free(rnu), free(rres), free(rsw);
        free(rnsw), free(rn), free(y), free(u1), free(o), free(res), free(res1);
        cudaFree(dw), cudaFree(dx), cudaFree(dxr), cudaFree(dnw), cudaFree(dres), cudaFree(dy), cudaFree(dxn);
        cudaFree(dgu), cudaFree(dh), cudaFree(dscr);
    }
}

/* Four fused decode layers at a small Llama-like shape, as enqueue() would
 * run them: eagerly without PDL, then captured in a graph with PDL and
 * replayed; the residual must come out bit-identical (a PDL kernel that read
 * its input before its predecessor finished would show here). */
static void test_gemv_layers_graph(void)
{
    const int T = 2, E = 2048, F = 5632, QKV = 3072, L = 4;
    size_t wl = (size_t)QKV * E + (size_t)E * E + (size_t)2 * F * E + (size_t)E * F;
    uint16_t *w = rand_bf(wl * L, 0.05f);
    float *x0 = malloc((size_t)T * E * 4), *nw = malloc(E * 4), *xa = malloc((size_t)T * E * 4),
          *xb = malloc((size_t)T * E * 4);
    for (int i = 0; i < T * E; i++) x0[i] = frand();
    for (int i = 0; i < E; i++) nw[i] = 1 + 0.2f * frand();
    uint16_t *dw = dup_dev(w, wl * L * 2), *dqkv = poisoned((size_t)T * QKV * 2), *dh = poisoned((size_t)T * F * 2);
    float *dx = dup_dev(x0, (size_t)T * E * 4), *dnw = dup_dev(nw, E * 4);
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    cudaDeviceSynchronize(); /* the set-up above ran on the legacy stream */
    for (int pass = 0; pass < 6; pass++) {
        /* block kernels, warp kernels, tensor-core kernels: eager without PDL, graph with */
        cuda_gemv_select(pass < 2 ? 1 : pass < 4 ? 0 : 4, pass & 1, -1);
        cudaMemcpyAsync(dx, x0, (size_t)T * E * 4, cudaMemcpyHostToDevice, st);
        cudaGraph_t g = NULL;
        cudaGraphExec_t ge = NULL;
        if (pass & 1) CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
        for (int l = 0; l < L; l++) {
            const uint16_t *wq = dw + wl * l, *wo = wq + (size_t)QKV * E, *wgu = wo + (size_t)E * E,
                           *wd = wgu + (size_t)2 * F * E;
            CHECK(cuda_gemv_rmsnorm(wq, dx, dnw, 1e-5f, dqkv, T, E, QKV, st) == cudaSuccess);
            /* the first T * E values of qkv stand in for attention's output */
            CHECK(cuda_gemv_residual(wo, dqkv, dx, T, E, E, st) == cudaSuccess);
            CHECK(cuda_gemv_rmsnorm_swiglu(wgu, dx, dnw, 1e-5f, dh, T, E, F, st) == cudaSuccess);
            CHECK(cuda_gemv_residual(wd, dh, dx, T, F, E, st) == cudaSuccess);
        }
        if (pass & 1) {
            CHECK(cudaStreamEndCapture(st, &g) == cudaSuccess);
            CHECK(g && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess);
            for (int rep = 0; rep < 3 && ge; rep++) { /* replays start from the same x */
                cudaMemcpyAsync(dx, x0, (size_t)T * E * 4, cudaMemcpyHostToDevice, st);
                CHECK(cudaGraphLaunch(ge, st) == cudaSuccess);
            }
        }
        CHECK(cudaStreamSynchronize(st) == cudaSuccess);
        get(pass & 1 ? xb : xa, dx, (size_t)T * E * 4);
        if (ge) cudaGraphExecDestroy(ge);
        if (g) cudaGraphDestroy(g);
        if (!(pass & 1)) continue;
        double d = 0, n = 0;
        for (int i = 0; i < T * E; i++) d += fabs(xa[i] - xb[i]), n += fabs(xa[i] - x0[i]);
        const char *vn = pass < 2 ? "block" : pass < 4 ? "warp" : "mma";
        CHECKF(!memcmp(xa, xb, (size_t)T * E * 4) && n > 0,
               "%s: graph+PDL layers differ from eager: |diff| %.3g, |update| %.3g", vn, d, n);
        printf("  %d fused layers (%s kernels), graph + PDL vs eager: %s\n", L, vn,
               memcmp(xa, xb, (size_t)T * E * 4) ? "differ" : "identical");
    }
    cuda_gemv_select(1, 1, -1);
    cudaStreamDestroy(st);
    free(w), free(x0), free(nw), free(xa), free(xb);
    cudaFree(dw), cudaFree(dqkv), cudaFree(dh), cudaFree(dx), cudaFree(dnw);
}

/* cuda_gemv_mlp: the down GEMV reads h as the gate/up GEMV stores it (tagged
 * words). Against the two plain launches (eager, PDL off): a few layers
 * (tags 1, 2, ...) eagerly with PDL, then captured in a graph with PDL and
 * replayed, must give x and h bit for bit. Shapes: Llama-8B's (E 4096, F
 * 14336), a narrow one, and one the tagged path does not take (F 1536:
 * below the tensor-core kernel's 12288). */
static void test_gemv_mlp(void)
{
    static const struct { int E, F, L; bool tagged; } cases[] = {
        {4096, 14336, 2, true}, {512, 12288, 4, true}, {256, 1536, 2, false}};
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const int E = cases[ci].E, F = cases[ci].F, L = cases[ci].L;
        size_t wl = (size_t)2 * F * E + (size_t)E * F; /* one layer: gate|up, then down */
        uint16_t *w = rand_bf(wl * 2, 0.05f);   /* two layers' weights, taken in turn */
        float *x0 = malloc((size_t)E * 4), *nw = malloc(E * 4), *xr = malloc((size_t)E * 4), *xo = malloc(E * 4);
        uint16_t *hr = malloc((size_t)F * 2), *ho = malloc((size_t)F * 2);
        uint32_t *hwo = malloc((size_t)F * 4);
        for (int i = 0; i < E; i++) x0[i] = frand(), nw[i] = 1 + 0.2f * frand();
        uint16_t *dw = dup_dev(w, wl * 2 * 2), *dh = poisoned((size_t)F * 2);
        float *dx = dup_dev(x0, (size_t)E * 4), *dnw = dup_dev(nw, E * 4);
        uint32_t *dhw = dup_dev(NULL, (size_t)F * 4);
        cudaMemset(dhw, 0, (size_t)F * 4);
        cudaDeviceSynchronize(); /* the set-up above ran on the legacy stream */
        for (int pass = 0; pass < 5; pass++) {
            /* 0: the plain launches without PDL; 1: cuda_gemv_mlp eager with PDL; 2: graph with PDL;
             * 3, 4: the same with the gate/up GEMV one block per 8 rows instead of one wave of blocks */
            cuda_gemv_select(3, pass > 0, 4);
            cuda_gemv_persist(pass < 3);
            bool tagged = cuda_gemv_mlp_tagged(1, E, F);
            if (pass == 1 || pass == 3)
                CHECKF(tagged == cases[ci].tagged, "E=%d F=%d: tagged %d, expected %d", E, F, tagged,
                       cases[ci].tagged);
            cudaMemcpyAsync(dx, x0, (size_t)E * 4, cudaMemcpyHostToDevice, st);
            cudaGraph_t g = NULL;
            cudaGraphExec_t ge = NULL;
            if (pass % 2 == 0 && pass) CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
            for (int l = 0; l < L; l++) {
                const uint16_t *wgu = dw + wl * (l % 2), *wd = wgu + (size_t)2 * F * E;
                if (pass == 0) {
                    CHECK(cuda_gemv_rmsnorm_swiglu(wgu, dx, dnw, 1e-5f, dh, 1, E, F, st) == cudaSuccess);
                    CHECK(cuda_gemv_residual(wd, dh, dx, 1, F, E, st) == cudaSuccess);
                } else {
                    CHECK(cuda_gemv_mlp(wgu, wd, dx, dnw, 1e-5f, dh, 1, E, F, dhw, l + 1, st) == cudaSuccess);
                }
            }
            if (pass % 2 == 0 && pass) {
                CHECK(cudaStreamEndCapture(st, &g) == cudaSuccess);
                CHECK(g && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess);
                for (int rep = 0; rep < 3 && ge; rep++) { /* replays start from the same x */
                    cudaMemcpyAsync(dx, x0, (size_t)E * 4, cudaMemcpyHostToDevice, st);
                    CHECK(cudaGraphLaunch(ge, st) == cudaSuccess);
                }
            }
            CHECK(cudaStreamSynchronize(st) == cudaSuccess);
            get(pass ? xo : xr, dx, (size_t)E * 4);
            get(pass ? ho : hr, dh, (size_t)F * 2);
            if (ge) cudaGraphExecDestroy(ge);
            if (g) cudaGraphDestroy(g);
            if (!pass) continue;
            bool tag_ok = true;
            if (tagged) { /* h is in the tagged words, with the last layer's tag */
                get(hwo, dhw, (size_t)F * 4);
                for (int i = 0; i < F; i++) tag_ok &= hwo[i] >> 16 == (uint32_t)L, ho[i] = hwo[i] & 0xffff;
            }
            double d = 0, n = 0;
            for (int i = 0; i < E; i++) d += fabs(xo[i] - xr[i]), n += fabs(xr[i] - x0[i]);
            bool same = !memcmp(xo, xr, (size_t)E * 4) && !memcmp(ho, hr, (size_t)F * 2);
            const char *how = pass % 2 ? "eager" : "graph", *grid = pass < 3 ? "one wave" : "a block per 8 rows";
            CHECKF(same && tag_ok && n > 0, "E=%d F=%d %s, %s: not the two plain launches: |diff| %.3g, |update| %.3g%s",
                   E, F, how, grid, d, n, tag_ok ? "" : ", tags wrong");
            printf("  mlp E=%d F=%d x%d (%s) %s + PDL, %s, vs the plain launches: %s\n", E, F, L,
                   tagged ? "tagged" : "plain", how, grid, same ? "identical" : "differ");
        }
        free(w), free(x0), free(nw), free(xr), free(xo), free(hr), free(ho), free(hwo);
        cudaFree(dw), cudaFree(dh), cudaFree(dx), cudaFree(dnw), cudaFree(dhw);
    }
    cuda_gemv_persist(-1);
    cuda_gemv_select(1, 1, -1);
    cudaStreamDestroy(st);
}

static void test_argmax(void)
{
    int R = 5, V = 49157;
    float *lg = malloc((size_t)R * V * 4);
    for (int i = 0; i < R * V; i++) lg[i] = 10 * frand();
    lg[2 * V + 100] = 50, lg[2 * V + 7] = 50; /* a tie: the lower id wins */
    lg[4 * V + V - 1] = 60;                    /* the last id */
    lg[3 * V + 40000] = 55, lg[3 * V + 5000] = 55; /* a tie across slices: the lower id wins */
    float *dl = dup_dev(lg, (size_t)R * V * 4), *dlp = poisoned(R * 4);
    int32_t *dt = poisoned(R * 4), tok[8];
    float lp[8];
    struct cuda_argmax_part *scr = NULL;
    CHECK(cudaMalloc((void **)&scr, (size_t)CUDA_ARGMAX_SLICES * R * sizeof *scr) == cudaSuccess);
    CHECK(cuda_argmax_lse(dl, R, V, scr, dt, dlp, 0) == cudaSuccess);
    get(tok, dt, R * 4), get(lp, dlp, R * 4);
    for (int r = 0; r < R; r++) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (lg[(size_t)r * V + i] > lg[(size_t)r * V + best]) best = i;
        double mx = lg[(size_t)r * V + best], s = 0;
        for (int i = 0; i < V; i++) s += exp(lg[(size_t)r * V + i] - mx);
        CHECKF(tok[r] == best, "row %d: argmax %d, ref %d", r, tok[r], best);
        CHECKF(fabs(lp[r] + log(s)) < 1e-4 * (1 + log(s)), "row %d: logprob %g, ref %g", r, lp[r], -log(s));
    }
    CHECK(tok[2] == 7 && tok[3] == 5000 && tok[4] == V - 1);
    free(lg), cudaFree(dl), cudaFree(dlp), cudaFree(dt), cudaFree(scr);
}

/* The fp8 KV cache (args.kv8): g_kv8 runs the attention and RoPE tests
 * below on it. kvs: bytes per KV element. e4m3: the value of an fp8 e4m3
 * byte (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; exponent 0:
 * subnormal, 2^-6 * m / 8; 0x7f, 0xff: NaN). rand_kv: n random KV elements,
 * bf16 in [-1, 1], or e4m3 of every exponent up to 2^0 (subnormals, zeros,
 * both signs). kv_val: element i of a host KV array as f32. */
static bool g_kv8;
static size_t kvs(void) { return g_kv8 ? 1 : 2; }
static float e4m3(uint8_t b)
{
    int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
    return b & 0x80 ? -v : v;
}
static void *rand_kv(size_t n)
{
    if (!g_kv8) return rand_bf(n, 1);
    uint8_t *p = malloc(n);
    for (size_t i = 0; i < n; i++) {
        unsigned r = (unsigned)((frand() * 0.5f + 0.5f) * 65535);
        p[i] = (uint8_t)((r & 0x80) | (((r >> 8) % 8) << 3) | (r & 7));
    }
    return p;
}
static float kv_val(const void *kv, size_t i) { return g_kv8 ? e4m3(((const uint8_t *)kv)[i]) : fb(((const uint16_t *)kv)[i]); }

/* RoPE + qk-norm + bias + KV write, both layouts, partial rotary; bf16 and
 * fp8 KV caches (fp8: every K and V value within half an e4m3 step of the
 * reference, 2^-4 relative or 2^-10 for subnormals). */
static void test_rope_kv(void)
{
    /* v 0: norm D 64; 1: neox + qk-norm, partial rotary (the general path);
     * 2: neox + bias D 128; 3: norm + qk-norm + bias D 128 */
    for (int variant = 0; variant < 8; variant++) {
        int v = variant % 4;
        g_kv8 = variant >= 4;
        int T = 9, H = 6, KVH = 2, D = v >= 2 ? 128 : 64, rd = v == 1 ? 32 : D, half = rd / 2;
        bool neox = v == 1 || v == 2, qkn = v == 1 || v == 3, bias = v >= 2;
        int NH = H + 2 * KVH, maxctx = 4096, nslots = 64;
        uint16_t *qkv = malloc((size_t)T * NH * D * 2);
        for (int i = 0; i < T * NH * D; i++) qkv[i] = bf(frand());
        float *b = malloc(NH * D * 4), *qn = malloc(D * 4), *kn = malloc(D * 4);
        for (int i = 0; i < NH * D; i++) b[i] = frand();
        for (int i = 0; i < D; i++) qn[i] = 1 + 0.3f * frand(), kn[i] = 1 + 0.3f * frand();
        float *cs = malloc((size_t)maxctx * half * 4), *sn = malloc((size_t)maxctx * half * 4);
        for (int p = 0; p < maxctx; p++)
            for (int i = 0; i < half; i++) {
                double a = p * pow(10000.0, -2.0 * i / rd);
                cs[(size_t)p * half + i] = (float)cos(a), sn[(size_t)p * half + i] = (float)sin(a);
            }
        int32_t pos[16];
        int64_t slots[16];
        for (int t = 0; t < T; t++) pos[t] = (t * 397) % maxctx, slots[t] = (t * 5 + 3) % nslots;
        struct cuda_rope_args a = {
            .qkv = dup_dev(qkv, (size_t)T * NH * D * 2), .bias = bias ? dup_dev(b, NH * D * 4) : NULL,
            .q_norm = qkn ? dup_dev(qn, D * 4) : NULL, .k_norm = qkn ? dup_dev(kn, D * 4) : NULL,
            .cos = dup_dev(cs, (size_t)maxctx * half * 4), .sin = dup_dev(sn, (size_t)maxctx * half * 4),
            .pos = dup_dev(pos, sizeof pos), .slots = dup_dev(slots, sizeof slots), .T = T, .H = H, .KVH = KVH,
            .D = D, .rope_dim = rd, .neox = neox, .eps = 1e-6f, .q = poisoned((size_t)T * H * D * 2),
            .kc = poisoned((size_t)nslots * KVH * D * kvs()), .vc = poisoned((size_t)nslots * KVH * D * kvs()),
            .kv8 = g_kv8,
        };
        CHECK(cuda_rope_kv(&a, 0) == cudaSuccess);
        uint16_t *q = malloc((size_t)T * H * D * 2);
        void *kc = malloc((size_t)nslots * KVH * D * kvs()), *vc = malloc((size_t)nslots * KVH * D * kvs());
        get(q, a.q, (size_t)T * H * D * 2), get(kc, a.kc, (size_t)nslots * KVH * D * kvs()),
            get(vc, a.vc, (size_t)nslots * KVH * D * kvs());
        int far = 0; /* fp8 values more than half a step from the reference */
        size_t n = (size_t)T * NH * D, k = 0;
        double *ref = malloc(n * 8);
        float *o = malloc(n * 4);
        for (int t = 0; t < T; t++)
            for (int h = 0; h < NH; h++) {
                double v[256];
                for (int d = 0; d < D; d++) v[d] = fb(qkv[((size_t)t * NH + h) * D + d]) + (bias ? b[h * D + d] : 0);
                int kind = h < H ? 0 : h < H + KVH ? 1 : 2;
                if (qkn && kind < 2) {
                    double ss = 0;
                    for (int d = 0; d < D; d++) ss += v[d] * v[d];
                    double r = 1 / sqrt(ss / D + 1e-6);
                    for (int d = 0; d < D; d++) v[d] = (kind ? kn : qn)[d] * v[d] * r;
                }
                if (kind < 2)
                    for (int i = 0; i < half; i++) {
                        int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
                        double c = cs[(size_t)pos[t] * half + i], s = sn[(size_t)pos[t] * half + i];
                        double x0 = v[i0], x1 = v[i1];
                        v[i0] = x0 * c - x1 * s, v[i1] = x0 * s + x1 * c;
                    }
                for (int d = 0; d < D; d++, k++) {
                    ref[k] = v[d];
                    if (kind == 0) {
                        o[k] = fb(q[((size_t)t * H + h) * D + d]);
                        continue;
                    }
                    size_t at = ((size_t)slots[t] * KVH + h - H - (kind == 2 ? KVH : 0)) * D + d;
                    o[k] = kv_val(kind == 1 ? kc : vc, at);
                    far += g_kv8 && !(fabs(o[k] - v[d]) <= fmax(fabs(v[d]) / 16, 1.0 / 1024));
                }
            }
        double e = nerr(o, ref, n);
        CHECKF(e < (g_kv8 ? 4e-2 : 4e-3) && !far, "rope variant %d%s: err %.3g, %d fp8 values off", v,
               g_kv8 ? " (fp8 KV)" : "", e, far);
        printf("  rope_kv %s%s%s D=%d rope_dim=%d%s: err %.2e\n", neox ? "neox" : "norm", qkn ? "+qknorm" : "",
               bias ? "+bias" : "", D, rd, g_kv8 ? ", fp8 KV" : "", e);
        free(qkv), free(b), free(qn), free(kn), free(cs), free(sn), free(q), free(kc), free(vc), free(ref), free(o);
        cudaFree((void *)a.qkv), cudaFree((void *)a.bias), cudaFree((void *)a.q_norm), cudaFree((void *)a.k_norm);
        cudaFree((void *)a.cos), cudaFree((void *)a.sin), cudaFree((void *)a.pos), cudaFree((void *)a.slots);
        cudaFree(a.q), cudaFree(a.kc), cudaFree(a.vc);
    }
    g_kv8 = false;
}

/* Paged attention over a shuffled block pool: mixed steps of decode tokens,
 * prefill chunks over cached prefixes and long contexts, with and without
 * split-K, head_dim 64/128, GQA 1..8. Items are built the way pack_step
 * builds them: `rows` query rows per item (CUDA_ATTN_ROWS for the SIMT
 * kernel; 64 or 128 with max_rows = rows for the tensor-core kernel), split
 * items over 32-aligned key chunks. scale_mul != 1 runs the kernel with a
 * wrong softmax scale (to show the bounds catch it). Returns ||out - ref|| /
 * ||ref|| and, in *rowmax, the worst |out - ref| of any element over the RMS
 * of its (token, head) reference row; inf on a launch error or an unwritten
 * (NaN) element. */
struct aseq { int ctx, qlen; };
/* n items on the device in a buffer of max (the grid size; the kernels
 * read a block's item before they know n): the rest zero */
static struct cuda_attn_item *items_dev(const struct cuda_attn_item *it, int n, int max)
{
    struct cuda_attn_item *d = dup_dev(NULL, sizeof *it * max);
    cudaMemset(d, 0, sizeof *it * max);
    cudaMemcpy(d, it, sizeof *it * n, cudaMemcpyHostToDevice);
    return d;
}
static bool g_dec; /* give attn_run's args split tickets: decode-only steps take the decode kernel */
static bool g_wide; /* rope_fold_case: args.dec_wide */
static int g_kround = 32; /* attn_run: split points on multiples of this many keys */
static bool g_pstride; /* attn_run: partials strided by nsplit (the buffer sized to it), not MAXSPLIT */

static double attn_run(const char *name, int H, int KVH, int D, int bs, const struct aseq *sq, int ns, int nsplit,
                       int rows, float scale_mul, double *rowmax)
{
    int grp = H / KVH, qt = rows / grp;
    int T = 0, nblk = 1, maxrows = 0;
    for (int i = 0; i < ns; i++) {
        T += sq[i].qlen, nblk += (sq[i].ctx + bs - 1) / bs;
        int r = (sq[i].qlen < qt ? sq[i].qlen : qt) * grp;
        if (r > maxrows) maxrows = r;
    }
    if (rows > CUDA_ATTN_ROWS) maxrows = rows; /* the host's rule for tensor-core steps */
    int nslots = nblk * bs;
    /* a shuffled pool of blocks; block 0 unused */
    int32_t *perm = malloc(nblk * 4), *bt = malloc(nblk * 4), *bt_off = malloc(ns * 4);
    for (int i = 0; i < nblk; i++) perm[i] = i;
    for (int i = nblk - 1; i > 1; i--) {
        int j = 1 + (int)((frand() * 0.5f + 0.5f) * i) % i;
        int t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    size_t nkv = (size_t)nslots * KVH * D;
    void *kc = rand_kv(nkv), *vc = rand_kv(nkv);
    uint16_t *q = malloc((size_t)T * H * D * 2);
    for (size_t i = 0; i < (size_t)T * H * D; i++) q[i] = bf(2 * frand());
    int32_t *pos = malloc(T * 4), *tok_part = malloc(T * 4), *tok_ns = malloc(T * 4);
    int nb = 0, u = 1, t = 0, nitems = 0, part = 0;
    struct cuda_attn_item *items = malloc(sizeof *items * (T + ns) * CUDA_ATTN_MAXSPLIT);
    int *tok_seq = malloc(T * 4);
    for (int i = 0; i < ns; i++) {
        bt_off[i] = nb;
        int blocks = (sq[i].ctx + bs - 1) / bs;
        for (int j = 0; j < blocks; j++) bt[nb++] = perm[u++];
        int t0s = t;
        for (int k = 0; k < sq[i].qlen; k++, t++) pos[t] = sq[i].ctx - sq[i].qlen + k, tok_part[t] = -1, tok_ns[t] = 0, tok_seq[t] = i;
        for (int t0 = t0s; t0 < t; t0 += qt) {
            int nq = t - t0 < qt ? t - t0 : qt, hi = pos[t0 + nq - 1] + 1;
            int nsp = nsplit < 1 ? 1 : nsplit;
            int chunk = ((hi + nsp - 1) / nsp + g_kround - 1) / g_kround * g_kround;
            for (int k = 0; k < nsp; k++) {
                int lo = k * chunk, h2 = lo + chunk < hi ? lo + chunk : hi;
                items[nitems++] = (struct cuda_attn_item){bt_off[i], t0, nq, lo, h2, k, nsp, part};
            }
            if (nsp > 1) {
                for (int tt = t0; tt < t0 + nq; tt++) tok_part[tt] = part + (tt - t0) * grp, tok_ns[tt] = nsp;
                part += nq * grp;
            }
        }
    }
    /* the slots of each sequence's last block past its context hold NaN:
     * no kernel may let them into an output (0 x NaN is NaN) */
    for (int i = 0; i < ns; i++)
        for (int p = sq[i].ctx; p < (sq[i].ctx + bs - 1) / bs * bs; p++) {
            size_t o = ((size_t)bt[bt_off[i] + p / bs] * bs + p % bs) * KVH * D;
            for (size_t e = 0; e < (size_t)KVH * D; e++) {
                if (g_kv8)
                    ((uint8_t *)kc)[o + e] = ((uint8_t *)vc)[o + e] = 0x7f;
                else
                    ((uint16_t *)kc)[o + e] = ((uint16_t *)vc)[o + e] = 0x7fc0;
            }
        }
    struct cuda_attn_args a = {
        .q = dup_dev(q, (size_t)T * H * D * 2), .kc = dup_dev(kc, nkv * kvs()), .vc = dup_dev(vc, nkv * kvs()),
        .kv8 = g_kv8, .pos = dup_dev(pos, T * 4), .bt = dup_dev(bt, nblk * 4),
        .items = items_dev(items, nitems, nitems + 7), .n_items = dup_dev(&nitems, 4), .max_items = nitems + 7,
        .max_rows = maxrows, .H = H, .KVH = KVH, .D = D, .block_size = bs,
        .scale = scale_mul / sqrtf((float)D),
        .part = poisoned((size_t)(part > 0 ? part : 1) * KVH * (g_pstride ? nsplit : CUDA_ATTN_MAXSPLIT) * (D + 2) * 4),
        .pstride = g_pstride ? nsplit : 0,
        .tok_part = dup_dev(tok_part, T * 4), .tok_nsplit = dup_dev(tok_ns, T * 4), .T = T,
        .out = poisoned((size_t)T * H * D * 2),
    };
    if (g_dec) {
        CHECK(cudaMalloc((void **)&a.cnt, (size_t)T * KVH * 4) == cudaSuccess);
        CHECK(cudaMemset(a.cnt, 0, (size_t)T * KVH * 4) == cudaSuccess);
    }
    CHECK(cuda_attention_prepare(D) == cudaSuccess);
    cudaError_t e = cuda_attention(&a, 0);
    if (e == cudaSuccess && a.cnt) {
        /* again over a poisoned output: the first launch must have left its
         * split tickets ready for the next */
        cudaMemsetAsync(a.out, 0xff, (size_t)T * H * D * 2, 0);
        e = cuda_attention(&a, 0);
    }
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    CHECKF(e == cudaSuccess, "%s: %s", name, cudaGetErrorString(e));
    uint16_t *out = malloc((size_t)T * H * D * 2);
    get(out, a.out, (size_t)T * H * D * 2);
    if (a.cnt && e == cudaSuccess) {
        /* the decode kernel's build at 3 blocks an SM: the same bits */
        struct cuda_attn_args w = a;
        w.dec_wide = true;
        size_t no = (size_t)T * H * D, bad = 0;
        uint16_t *o2 = malloc(no * 2);
        cudaMemsetAsync(w.out, 0xff, no * 2, 0);
        e = cuda_attention(&w, 0);
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
        CHECKF(e == cudaSuccess, "%s, dec_wide: %s", name, cudaGetErrorString(e));
        get(o2, w.out, no * 2);
        for (size_t i = 0; i < no; i++) bad += o2[i] != out[i];
        CHECKF(!bad, "%s: %zu of %zu outputs differ with dec_wide", name, bad, no);
        free(o2);
    }
    if (a.cnt) {
        /* the last split of each token resets its ticket for the next launch */
        int32_t *cnt = malloc((size_t)T * KVH * 4), bad = 0;
        get(cnt, a.cnt, (size_t)T * KVH * 4);
        for (int i = 0; i < T * KVH; i++) bad += cnt[i] != 0;
        CHECKF(!bad, "%s: %d split tickets left non-zero", name, bad);
        free(cnt), cudaFree(a.cnt);
    }
    size_t n = (size_t)T * H * D;
    double *ref = malloc(n * 8);
    float *o = malloc(n * 4), *kf = malloc((size_t)nslots * KVH * D * 4), *vf = malloc((size_t)nslots * KVH * D * 4);
    for (size_t i = 0; i < nkv; i++) kf[i] = kv_val(kc, i), vf[i] = kv_val(vc, i);
    for (size_t i = 0; i < n; i++) o[i] = fb(out[i]);
    double worst = 0;
#pragma omp parallel reduction(max : worst)
    {
        double *sc = malloc(sizeof(double) * 200000), acc[256];
#pragma omp for schedule(dynamic, 1)
        for (int tt = 0; tt < T; tt++) {
            const int32_t *tb = bt + bt_off[tok_seq[tt]];
            for (int h = 0; h < H; h++) {
                int g = h / grp, np = pos[tt] + 1;
                const uint16_t *qr = q + ((size_t)tt * H + h) * D;
                double mx = -1e300, sum = 0;
                for (int p = 0; p < np; p++) {
                    const float *kr = kf + (((size_t)tb[p / bs] * bs + p % bs) * KVH + g) * D;
                    double s = 0;
                    for (int d = 0; d < D; d++) s += (double)fb(qr[d]) * kr[d];
                    sc[p] = s / sqrt((double)D);
                    if (sc[p] > mx) mx = sc[p];
                }
                for (int d = 0; d < D; d++) acc[d] = 0;
                for (int p = 0; p < np; p++) {
                    double w = exp(sc[p] - mx);
                    sum += w;
                    const float *vr = vf + (((size_t)tb[p / bs] * bs + p % bs) * KVH + g) * D;
                    for (int d = 0; d < D; d++) acc[d] += w * vr[d];
                }
                double *rr = ref + ((size_t)tt * H + h) * D, rms = 0, mxe = 0;
                const float *orow = o + ((size_t)tt * H + h) * D;
                for (int d = 0; d < D; d++) {
                    rr[d] = acc[d] / sum;
                    rms += rr[d] * rr[d];
                    double ed = isnan(orow[d]) ? INFINITY : fabs(orow[d] - rr[d]);
                    if (ed > mxe) mxe = ed;
                }
                rms = sqrt(rms / D);
                mxe /= rms > 1e-3 ? rms : 1e-3;
                if (mxe > worst) worst = mxe;
            }
        }
        free(sc);
    }
    double err = nerr(o, ref, n);
    *rowmax = worst;
    printf("  attention %-36s T=%4d H=%d/%d D=%d bs=%d split=%d rows %d (max %d)%s%s%s: err %.2e, row max %.2e\n", name,
           T, H, KVH, D, bs, nsplit, rows, maxrows, scale_mul != 1.0f ? " bad scale" : "", g_kv8 ? " fp8 KV" : "",
           !a.cnt && cuda_attention_wg_ok(&a) ? " wgmma" : "", err, worst);
    free(perm), free(bt), free(bt_off), free(kc), free(vc), free(q), free(pos), free(tok_part), free(tok_ns);
    free(items), free(tok_seq), free(out), free(ref), free(o), free(kf), free(vf);
    cudaFree((void *)a.q), cudaFree((void *)a.kc), cudaFree((void *)a.vc), cudaFree((void *)a.pos);
    cudaFree((void *)a.bt), cudaFree((void *)a.items), cudaFree((void *)a.n_items);
    cudaFree(a.part), cudaFree((void *)a.tok_part), cudaFree((void *)a.tok_nsplit), cudaFree(a.out);
    return e == cudaSuccess ? err : INFINITY;
}

/* The SIMT kernel (f32 throughout, bf16 output): normalized error < 6e-3. */
static void attn_case(const char *name, int H, int KVH, int D, int bs, const struct aseq *sq, int ns, int nsplit)
{
    double rowmax, err = attn_run(name, H, KVH, D, bs, sq, ns, nsplit, CUDA_ATTN_ROWS, 1.0f, &rowmax);
    CHECKF(err < 6e-3, "%s: err %.3g", name, err);
}

/* The tensor-core kernel: Q, K, V are exact bf16 inputs (as in the
 * reference), S and O accumulate in f32, but P is rounded to bf16 (relative
 * error <= 2^-9 per weight) before P V, and O is rounded to bf16. Expected:
 * normalized error ~2e-3 (about twice the SIMT kernel's); bounds: normalized
 * error < 1e-2 and every element within 5e-2 of its row's RMS (outputs here
 * are averages of V in [-1, 1], RMS ~0.02..0.6, so a row-relative bound holds
 * short and long contexts to the same standard; a wrong key in a short row or
 * a lost row fails it, and so does a softmax scale off by 25%: see below). */
#define TC_ERR 1e-2
#define TC_ROWMAX 5e-2
static void attn_tc_case(const char *name, int H, int KVH, int D, int bs, const struct aseq *sq, int ns, int nsplit,
                         int rows)
{
    double rowmax, err = attn_run(name, H, KVH, D, bs, sq, ns, nsplit, rows, 1.0f, &rowmax);
    CHECKF(err < TC_ERR && rowmax < TC_ROWMAX, "%s (rows %d): err %.3g, row max %.3g", name, rows, err, rowmax);
}

static void test_attention(void)
{
    struct aseq mixed[] = {{1, 1}, {17, 5}, {1000, 1}, {300, 40}, {33, 33}, {16, 1}, {2049, 3}};
    attn_case("mixed, llama shape", 32, 8, 128, 16, mixed, 7, 1);
    attn_case("mixed, smollm2 shape", 9, 3, 64, 16, mixed, 7, 1);
    attn_case("mixed, MHA, block 1", 4, 4, 64, 1, mixed, 7, 1);
    attn_case("mixed, split 5", 32, 8, 128, 16, mixed, 7, 5);
    struct aseq decode[] = {{1025, 1}, {7, 1}, {100000, 1}};
    attn_case("decode, long ctx, split 16", 32, 8, 128, 16, decode, 3, 16);
    attn_case("decode, long ctx, no split", 32, 8, 128, 32, decode, 3, 1);
    struct aseq one[] = {{1, 1}};
    attn_case("one token, split 3 (empty splits)", 16, 2, 64, 16, one, 1, 3);
    struct aseq gqa8[] = {{500, 77}, {64, 1}};
    attn_case("GQA 8, head_dim 256", 16, 2, 256, 16, gqa8, 2, 1);
    attn_case("GQA 8, tiny head_dim 16", 4, 2, 16, 16, gqa8, 2, 2);
}

/* The decode kernel (args with split tickets, every item one token): the
 * shapes it takes (D 64/128, 1..8 heads per KV head), splits of every size
 * (one key, empty ones, 32 over a long context), batches of sequences, block
 * sizes 1/16/32; a step launched twice (tickets reset by the first launch).
 * Shapes it does not take (D 256, mixed steps) still run, on the SIMT kernel. */
static void attention_decode_cases(void)
{
    struct aseq decode[] = {{1025, 1}, {7, 1}, {100000, 1}, {129, 1}, {128, 1}, {1, 1}};
    attn_case("dec: llama shape, split 16", 32, 8, 128, 16, decode, 6, 16);
    attn_case("dec: llama shape, split 32", 32, 8, 128, 16, decode, 6, 32);
    attn_case("dec: llama shape, no split", 32, 8, 128, 32, decode, 6, 1);
    attn_case("dec: smollm2 shape, split 5", 9, 3, 64, 16, decode, 6, 5);
    attn_case("dec: MHA, block 1, split 3", 4, 4, 64, 1, decode, 6, 3);
    attn_case("dec: GQA 8, split 2", 16, 2, 128, 16, decode, 6, 2);
    attn_case("dec: GQA 5, head_dim 64, split 7", 10, 2, 64, 32, decode, 6, 7);
    struct aseq batch[64];
    for (int i = 0; i < 64; i++) batch[i] = (struct aseq){1 + (i * 977) % 3000, 1};
    attn_case("dec: 64 sequences, split 4", 32, 8, 128, 16, batch, 64, 4);
    attn_case("dec: 64 sequences, no split", 8, 8, 64, 16, batch, 64, 1);
    struct aseq one[] = {{1, 1}};
    attn_case("dec: one token, split 3 (empty splits)", 16, 2, 64, 16, one, 1, 3);
    struct aseq gqa8[] = {{500, 77}, {64, 1}};
    attn_case("dec: mixed step (SIMT kernel)", 16, 2, 128, 16, gqa8, 2, 2);
    attn_case("dec: head_dim 256 (SIMT kernel)", 16, 2, 256, 16, decode, 6, 4);
}

static void test_attention_decode(void)
{
    g_dec = true;
    attention_decode_cases();
    g_dec = false;
}

/* RoPE folded into the decode kernel (args.rope) against the unfused chain,
 * cuda_rope_kv then the same kernel reading q: the attention output and the
 * whole KV cache afterwards bit for bit equal. Llama (adjacent pairs), qwen2
 * (QKV bias, halves), qwen3 (q/k RMSNorm), a partial rotary dimension; split
 * and unsplit; a 100-token batch. */
static void rope_fold_case(const char *name, int H, int KVH, int D, int bs, int rope_dim, bool neox, bool bias,
                           bool qkn, int ns, int nsplit)
{
    int grp = H / KVH, nh = H + 2 * KVH, half = rope_dim / 2, T = ns, maxctx = 0;
    int *ctx = malloc(ns * sizeof *ctx), nblk = 1;
    CHECK(cuda_attention_prepare(D) == cudaSuccess); /* as the backend does at load */
    for (int i = 0; i < ns; i++) {
        ctx[i] = 1 + (i * 1543 + 77) % 2500;
        if (i == 0) ctx[i] = 1;
        nblk += (ctx[i] + bs - 1) / bs;
        if (ctx[i] > maxctx) maxctx = ctx[i];
    }
    int nslots = nblk * bs;
    int32_t *bt = malloc(nblk * 4), *bt_off = malloc(ns * 4), *pos = malloc(T * 4), *tok_part = malloc(T * 4),
            *tok_ns = malloc(T * 4);
    int64_t *slots = malloc(T * 8);
    struct cuda_attn_item *items = malloc(sizeof *items * T * CUDA_ATTN_MAXSPLIT);
    int nb = 0, nitems = 0, part = 0;
    for (int i = 0; i < ns; i++) {
        bt_off[i] = nb;
        for (int j = 0; j < (ctx[i] + bs - 1) / bs; j++) bt[nb + j] = 1 + nb + j; /* block 0 unused */
        pos[i] = ctx[i] - 1;
        slots[i] = (int64_t)bt[nb + pos[i] / bs] * bs + pos[i] % bs;
        nb += (ctx[i] + bs - 1) / bs;
        int chunk = ((ctx[i] + nsplit - 1) / nsplit + 127) / 128 * 128;
        tok_part[i] = nsplit > 1 ? part : -1, tok_ns[i] = nsplit > 1 ? nsplit : 0;
        for (int k = 0; k < nsplit; k++) {
            int lo = k * chunk, hi = lo + chunk < ctx[i] ? lo + chunk : ctx[i];
            items[nitems++] = (struct cuda_attn_item){bt_off[i], i, 1, lo, hi, k, nsplit, part};
        }
        if (nsplit > 1) part += grp;
    }
    size_t nkv = (size_t)nslots * KVH * D, nq = (size_t)T * nh * D;
    void *kc = rand_kv(nkv), *vc = rand_kv(nkv);
    uint16_t *qkv = rand_bf(nq, 2);
    float *bsv = malloc((size_t)nh * D * 4), *qn = malloc(D * 4), *kn = malloc(D * 4);
    float *cs = malloc((size_t)maxctx * half * 4), *sn = malloc((size_t)maxctx * half * 4);
    for (int i = 0; i < nh * D; i++) bsv[i] = 0.3f * frand();
    for (int i = 0; i < D; i++) qn[i] = 1 + 0.3f * frand(), kn[i] = 1 + 0.3f * frand();
    for (int p = 0; p < maxctx; p++)
        for (int i = 0; i < half; i++) {
            double f = p * pow(10000.0, -2.0 * i / rope_dim);
            cs[(size_t)p * half + i] = (float)cos(f), sn[(size_t)p * half + i] = (float)sin(f);
        }
    struct cuda_rope_args ra = {
        .qkv = dup_dev(qkv, nq * 2), .bias = bias ? dup_dev(bsv, (size_t)nh * D * 4) : NULL,
        .q_norm = qkn ? dup_dev(qn, D * 4) : NULL, .k_norm = qkn ? dup_dev(kn, D * 4) : NULL,
        .cos = dup_dev(cs, (size_t)maxctx * half * 4), .sin = dup_dev(sn, (size_t)maxctx * half * 4),
        .pos = dup_dev(pos, T * 4), .slots = dup_dev(slots, T * 8), .T = T, .H = H, .KVH = KVH, .D = D,
        .rope_dim = rope_dim, .neox = neox, .eps = 1e-6f, .q = poisoned((size_t)T * H * D * 2), .kv8 = g_kv8,
    };
    uint16_t *out[2];
    void *kv[2][2];
    struct cuda_attn_args a = {
        .q = ra.q, .pos = ra.pos, .bt = dup_dev(bt, nb * 4), .items = items_dev(items, nitems, nitems + 3),
        .n_items = dup_dev(&nitems, 4), .max_items = nitems + 3,
        .max_rows = grp, .H = H, .KVH = KVH, .D = D, .block_size = bs, .scale = 1.0f / sqrtf((float)D),
        .part = poisoned((size_t)(part > 0 ? part : 1) * KVH * CUDA_ATTN_MAXSPLIT * (D + 2) * 4),
        .tok_part = dup_dev(tok_part, T * 4), .tok_nsplit = dup_dev(tok_ns, T * 4), .T = T, .kv8 = g_kv8,
    };
    CHECK(cudaMalloc((void **)&a.cnt, (size_t)T * KVH * 4) == cudaSuccess);
    cudaMemset(a.cnt, 0, (size_t)T * KVH * 4);
    for (int f = 0; f < 2; f++) {
        kv[f][0] = dup_dev(kc, nkv * kvs()), kv[f][1] = dup_dev(vc, nkv * kvs());
        out[f] = poisoned((size_t)T * H * D * 2);
        struct cuda_rope_args r = ra;
        r.kc = kv[f][0], r.vc = kv[f][1];
        struct cuda_attn_args b = a;
        b.kc = kv[f][0], b.vc = kv[f][1], b.out = out[f], b.dec_wide = g_wide;
        if (f == 0)
            CHECK(cuda_rope_kv(&r, 0) == cudaSuccess);
        else
            b.rope = r;
        CHECK(cuda_attention(&b, 0) == cudaSuccess);
    }
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    size_t no = (size_t)T * H * D;
    uint16_t *o0 = malloc(no * 2), *o1 = malloc(no * 2);
    void *k0 = malloc(nkv * kvs()), *k1 = malloc(nkv * kvs());
    get(o0, out[0], no * 2), get(o1, out[1], no * 2);
    int nan = 0;
    for (size_t i = 0; i < no; i++) nan += (o0[i] & 0x7f80) == 0x7f80;
    CHECKF(!nan, "%s: %d outputs not finite", name, nan);
    CHECKF(!memcmp(o0, o1, no * 2), "%s: attention output differs from rope_kv + attention", name);
    for (int c = 0; c < 2; c++) {
        get(k0, kv[0][c], nkv * kvs()), get(k1, kv[1][c], nkv * kvs());
        CHECKF(!memcmp(k0, k1, nkv * kvs()), "%s: %s cache differs from rope_kv's", name, c ? "V" : "K");
        CHECKF(memcmp(k0, c ? vc : kc, nkv * kvs()), "%s: rope_kv wrote nothing to the %s cache", name, c ? "V" : "K");
    }
    printf("  rope folded %-30s T=%3d H=%d/%d D=%d rope %d%s%s%s%s split %d: identical\n", name, T, H, KVH, D,
           rope_dim, neox ? " neox" : "", bias ? " bias" : "", qkn ? " qk-norm" : "", g_kv8 ? " fp8 KV" : "", nsplit);
    free(ctx), free(bt), free(bt_off), free(pos), free(tok_part), free(tok_ns), free(slots), free(items), free(kc);
    free(vc), free(qkv), free(bsv), free(qn), free(kn), free(cs), free(sn), free(o0), free(o1), free(k0), free(k1);
    cudaFree((void *)ra.qkv), cudaFree((void *)ra.bias), cudaFree((void *)ra.q_norm), cudaFree((void *)ra.k_norm);
    cudaFree((void *)ra.cos), cudaFree((void *)ra.sin), cudaFree((void *)ra.pos), cudaFree((void *)ra.slots);
    cudaFree(ra.q), cudaFree((void *)a.bt), cudaFree((void *)a.items);
    cudaFree((void *)a.n_items), cudaFree(a.part), cudaFree((void *)a.tok_part), cudaFree((void *)a.tok_nsplit);
    cudaFree(a.cnt);
    for (int f = 0; f < 2; f++) cudaFree(out[f]), cudaFree(kv[f][0]), cudaFree(kv[f][1]);
}

static void rope_fold_cases(void)
{
    rope_fold_case("llama", 32, 8, 128, 16, 128, false, false, false, 3, 1);
    rope_fold_case("llama, split 8", 32, 8, 128, 16, 128, false, false, false, 3, 8);
    rope_fold_case("qwen2 (bias, neox)", 14, 2, 64, 16, 64, true, true, false, 5, 3);
    rope_fold_case("qwen3 (q/k norm)", 16, 8, 128, 32, 128, true, false, true, 4, 5);
    rope_fold_case("smollm2 shape", 9, 3, 64, 16, 64, false, false, false, 100, 2);
    rope_fold_case("partial rotary", 8, 2, 128, 1, 64, true, true, true, 6, 4);
    /* shapes the decode kernel does not take are refused, not run unfused */
    struct cuda_attn_args bad = {.max_items = 1, .T = 1, .H = 8, .KVH = 2, .D = 256, .max_rows = 4};
    int32_t one = 1;
    bad.cnt = &one, bad.rope.qkv = (const uint16_t *)&one;
    CHECK(cuda_attention(&bad, 0) == cudaErrorInvalidValue);
}

static void test_attention_rope_fold(void)
{
    rope_fold_cases();
    g_wide = true; /* the decode kernel's build at 3 blocks an SM */
    printf("  decode kernel at 3 blocks an SM (dec_wide)\n");
    rope_fold_cases();
    g_wide = false;
}

/* The tensor-core kernel on prefill-shaped steps: whole prompts, chunks over
 * a cached prefix (a chunk starting at a non-zero position), odd lengths,
 * decode tokens riding along in a mixed step, block sizes 1/16/32, GQA 1, 3,
 * 4, 8 at head_dim 64 and 128, both block shapes (64 and 128 rows), split-K. */
static void test_attention_tc(void)
{
    CHECK(cuda_attention_tc_ok(64, 3) && cuda_attention_tc_ok(128, 8) && cuda_attention_tc_ok(128, 1));
    CHECK(!cuda_attention_tc_ok(96, 4) && !cuda_attention_tc_ok(256, 8) && !cuda_attention_tc_ok(128, 0));
    {
        /* shapes it cannot take are refused before any launch */
        struct cuda_attn_args bad = {.max_items = 1, .T = 1, .H = 8, .KVH = 2, .D = 96, .max_rows = 64};
        CHECK(cuda_attention(&bad, 0) == cudaErrorInvalidValue);
        bad.D = 128, bad.max_rows = CUDA_ATTN_TC_ROWS + 1;
        CHECK(cuda_attention(&bad, 0) == cudaErrorInvalidValue);
    }
    struct aseq p2048[] = {{2048, 2048}};
    attn_tc_case("prompt 2048, GQA 8", 8, 1, 128, 16, p2048, 1, 1, 128);
    attn_tc_case("prompt 2048, smollm2 shape", 9, 3, 64, 16, p2048, 1, 1, 64);
    /* chunks over cached prefixes, odd lengths, a decode token and a
     * one-token chunk in the same step */
    struct aseq chunks[] = {{1000, 300}, {77, 77}, {513, 1}, {4099, 129}, {64, 64}, {33, 17}, {200, 1}};
    int rows[] = {64, 128};
    for (int ri = 0; ri < 2; ri++) {
        int R = rows[ri];
        attn_tc_case("chunks, llama shape (GQA 4... 8)", 32, 8, 128, 16, chunks, 7, 1, R);
        attn_tc_case("chunks, smollm2 shape (GQA 3)", 9, 3, 64, 32, chunks, 7, 1, R);
        attn_tc_case("chunks, MHA, block 1", 4, 4, 64, 1, chunks, 7, 1, R);
        attn_tc_case("chunks, MHA, head_dim 128, block 32", 2, 2, 128, 32, chunks, 7, 1, R);
        attn_tc_case("chunks, GQA 4, block 32", 16, 4, 128, 32, chunks, 7, 1, R);
        attn_tc_case("chunks, GQA 3, head_dim 128, block 1", 6, 2, 128, 1, chunks, 7, 1, R);
        attn_tc_case("chunks, GQA 8, head_dim 64", 16, 2, 64, 16, chunks, 7, 1, R);
        attn_tc_case("chunks, GQA 4, head_dim 64, block 1", 8, 2, 64, 1, chunks, 7, 1, R);
    }
    /* split-K over a long prefix (and empty splits for the short ones) */
    struct aseq longp[] = {{5000, 100}, {300, 40}, {1, 1}};
    attn_tc_case("chunks over a long prefix, split 3", 32, 8, 128, 16, longp, 3, 3, 128);
    attn_tc_case("chunks over a long prefix, split 5", 9, 3, 64, 16, longp, 3, 5, 64);
    attn_tc_case("chunks over a long prefix, split 32", 8, 8, 64, 32, longp, 3, 32, 128);
    /* the bounds catch a wrong softmax scale */
    double rowmax, err = attn_run("chunks, GQA 4 (must fail)", 16, 4, 128, 32, chunks, 7, 1, 128, 1.25f, &rowmax);
    CHECKF(err > TC_ERR && rowmax > TC_ROWMAX, "a 25%% scale error passed: err %.3g, row max %.3g", err, rowmax);
}

/* The fp8 KV cache through every attention kernel: the SIMT kernel (head_dim
 * 256, and the mixed cases), the decode kernel (tensor-core math whichever is
 * selected: the fp8 cache always takes it), RoPE folded into it (bit for bit
 * as rope_kv then attention, both writing fp8), and the tensor-core prefill
 * kernel. The reference reads the same fp8 values, which every kernel widens
 * exactly, so the bounds are the bf16 cache's. */
static void test_attention_kv8(void)
{
    g_kv8 = true;
    test_attention();
    test_attention_decode();
    g_kv8 = false;
}
static void test_rope_fold_kv8(void)
{
    g_kv8 = true;
    test_attention_rope_fold();
    g_kv8 = false;
}
/* split points on multiples of 8 keys, not of 32 as the backend packs
 * them: the warpgroup kernel's bulk tensor copies take whole 16-key groups,
 * so its items that start off a 16-key boundary gather by cp.async */
static void test_attention_tc_kround8(void)
{
    g_kround = 8;
    struct aseq longp[] = {{5000, 100}, {300, 40}, {1, 1}, {700, 33}};
    attn_tc_case("split 3 on 8-key bounds", 32, 8, 128, 16, longp, 4, 3, 128);
    attn_tc_case("split 5 on 8-key bounds, block 32", 16, 4, 128, 32, longp, 4, 5, 128);
    attn_tc_case("split 5 on 8-key bounds, head_dim 64", 16, 4, 64, 16, longp, 4, 5, 128);
    g_kround = 32;
}
/* where the warpgroup-MMA kernel (attn_wg.cu) takes the 128-row items, the
 * same cases on attn.cu's tensor-core kernel */
static void test_attention_tc_nowg(void)
{
    cuda_attention_wg_select(0);
    test_attention_tc();
    cuda_attention_wg_select(-1);
}
/* the fp8 cache on the prefill kernels: on compute capability 9.0 the
 * warpgroup kernel's 128-row items (bulk copies of e4m3 rows widened to f16
 * in shared memory, f16 MMAs), its cp.async gather (items off a 16-key
 * boundary), and attn.cu's tensor-core kernel for all of them, as sm_89 runs */
static void test_attention_tc_kv8(void)
{
    g_kv8 = true;
    test_attention_tc();
    test_attention_tc_kround8();
    test_attention_tc_nowg();
    g_kv8 = false;
}

/* split partials at a stride of nsplit, not MAXSPLIT (prefill steps' long
 * tiles, cuda/step.c long_splits), in a buffer of exactly that size: the
 * SIMT kernel, the warpgroup kernel and attn.cu's tensor-core kernel (64
 * and 128 rows), both caches; the decode kernel refuses any stride but
 * MAXSPLIT */
static void test_attention_pstride(void)
{
    g_pstride = true;
    struct aseq longp[] = {{5000, 100}, {300, 40}, {1, 1}, {6000, 60}};
    for (int kv8 = 0; kv8 < 2; kv8++) {
        g_kv8 = kv8;
        printf("  %s cache\n", kv8 ? "fp8" : "bf16");
        attn_case("pstride 5, SIMT", 32, 8, 128, 16, longp, 4, 5);
        attn_tc_case("pstride 3", 32, 8, 128, 16, longp, 4, 3, 128);
        attn_tc_case("pstride 8, GQA 4, block 32", 16, 4, 128, 32, longp, 4, 8, 128);
        attn_tc_case("pstride 2, head_dim 64", 9, 3, 64, 16, longp, 4, 2, 64);
        cuda_attention_wg_select(0);
        attn_tc_case("pstride 3, attn.cu's kernel", 32, 8, 128, 16, longp, 4, 3, 128);
        cuda_attention_wg_select(-1);
    }
    g_kv8 = false;
    g_pstride = false;
    struct cuda_attn_args dec = {.max_items = 1, .T = 1, .H = 8, .KVH = 2, .D = 128, .max_rows = 4, .pstride = 4,
                                 .cnt = (int32_t *)16};
    CHECK(cuda_attention(&dec, 0) == cudaErrorInvalidValue);
}

/* a few small fp8 cases on the warpgroup kernel, for racecheck (the
 * in-place widening): bulk copies at blocks 16 and 32, the cp.async gather
 * at block 1 and off 16-key bounds */
static void test_attention_wg8_small(void)
{
    g_kv8 = true;
    struct aseq chunks[] = {{300, 130}, {77, 77}, {33, 17}, {200, 1}};
    attn_tc_case("fp8, chunks, GQA 4", 16, 4, 128, 16, chunks, 4, 1, 128);
    attn_tc_case("fp8, chunks, MHA, block 32", 2, 2, 128, 32, chunks, 4, 1, 128);
    attn_tc_case("fp8, chunks, GQA 3, block 1", 6, 2, 128, 1, chunks, 4, 1, 128);
    g_kround = 8;
    attn_tc_case("fp8, split 3 on 8-key bounds", 16, 4, 128, 16, chunks, 4, 3, 128);
    g_kround = 32;
    g_kv8 = false;
}

/* The peer all-reduce (tp.cu), its ranks on streams of their own: on
 * different GPUs when there are enough (peer access), else all on GPU 0,
 * where the ranks' kernels run side by side and wait for each other. Every
 * rank's output must be bit for bit the host's f32 sum in rank order (bf16:
 * that sum rounded), for the vector and the scalar path and more elements
 * than a call's blocks cover, and the residual add (f32 += the rounded
 * sum), over 12 calls through 3 rotating buffers (the
 * per-block counters advance alike on every rank). Then a kernel whose peer
 * never comes must still be waiting, and end when the abort flag is set. */
static void test_peer_allreduce(void)
{
    int ngpu = 0;
    cudaGetDeviceCount(&ngpu);
    int *abort_flag = NULL;
    CHECK(cudaHostAlloc((void **)&abort_flag, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable) ==
          cudaSuccess);
    *abort_flag = 0;
    /* once: the ranks below use GPUs 0..N-1 when there are N with peer
     * access between them all (ngpu is cut to that count), else GPU 0 */
    int np = ngpu < 3 ? ngpu : 3;
    for (int r = 0; r < np; r++)
        for (int p = 0; p < np; p++) {
            int ok = 0;
            if (p == r) continue;
            if (cudaDeviceCanAccessPeer(&ok, r, p) != cudaSuccess || !ok) {
                np = r > p ? r : p; /* GPUs 0 .. max(r, p) - 1 at most */
                break;
            }
        }
    for (int r = 0; r < np; r++)
        for (int p = 0; p < np; p++) {
            cudaSetDevice(r);
            if (p != r) CHECK(cudaDeviceEnablePeerAccess(p, 0) == cudaSuccess);
        }
    ngpu = np;
    cudaSetDevice(0);
    const size_t sizes[] = {4096, 4099, 70000, 1};
    for (int N = 1; N <= 3; N++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            size_t n = sizes[si];
            int dev[3];
            cudaStream_t st[3];
            float *buf[3][3], *of[3], *h[3], *got = malloc(n * 4), *ref = malloc(n * 4);
            uint16_t *ob[3], *gotb = malloc(n * 2);
            unsigned *flags[3], *epoch[3];
            for (int r = 0; r < N; r++) {
                dev[r] = ngpu >= N ? r : 0;
                cudaSetDevice(dev[r]);
                CHECK(cudaStreamCreateWithFlags(&st[r], cudaStreamNonBlocking) == cudaSuccess);
                for (int i = 0; i < 3; i++) buf[r][i] = dup_dev(NULL, n * 4);
                of[r] = poisoned(n * 4), ob[r] = poisoned(n * 2);
                flags[r] = dup_dev(NULL, CUDA_PEER_BLOCKS * CUDA_PEER_MAX * 4);
                epoch[r] = dup_dev(NULL, CUDA_PEER_BLOCKS * 4);
                cudaMemset(flags[r], 0, CUDA_PEER_BLOCKS * CUDA_PEER_MAX * 4), cudaMemset(epoch[r], 0, CUDA_PEER_BLOCKS * 4);
                h[r] = malloc(n * 4);
            }
            int bad = 0;
            float *x0 = malloc(n * 4);
            for (int c = 0; c < 12 && !bad; c++) {
                int i = c * 2 % 3, mode = c % 3; /* buffers 0 2 1 0 ...; outputs f32, bf16, f32 += bf16 */
                bool f32 = mode != 1, add = mode == 2;
                for (int r = 0; r < N; r++) {
                    for (size_t j = 0; j < n; j++) h[r][j] = frand() * (j % 7 == 0 ? 1000.0f : 1.0f);
                    cudaSetDevice(dev[r]);
                    cudaMemcpy(buf[r][i], h[r], n * 4, cudaMemcpyHostToDevice);
                    cudaDeviceSynchronize();
                }
                for (size_t j = 0; j < n; j++) {
                    float s = h[0][j];
                    for (int r = 1; r < N; r++) s += h[r][j];
                    ref[j] = s;
                    if (add) x0[j] = 10 * frand(), ref[j] = x0[j] + fb(bf(s));
                }
                for (int r = 0; r < N && add; r++) {
                    cudaSetDevice(dev[r]);
                    cudaMemcpy(of[r], x0, n * 4, cudaMemcpyHostToDevice);
                    /* a pageable copy may return before its DMA lands, and st[r] does not wait for the legacy
                     * stream (non-blocking): the all-reduce would race the copy it adds to */
                    cudaDeviceSynchronize();
                }
                for (int r = 0; r < N; r++) {
                    struct cuda_peer_ar a = {.epoch = epoch[r], .abort = abort_flag, .n_ranks = N, .rank = r};
                    for (int p = 0; p < N; p++) a.src[p] = buf[p][i], a.flags[p] = flags[p];
                    cudaSetDevice(dev[r]);
                    CHECK(cuda_peer_allreduce(&a, n, f32 ? NULL : ob[r], f32 ? of[r] : NULL, add, st[r]) ==
                          cudaSuccess);
                }
                for (int r = 0; r < N; r++) {
                    cudaSetDevice(dev[r]);
                    CHECK(cudaStreamSynchronize(st[r]) == cudaSuccess);
                    if (f32) {
                        get(got, of[r], n * 4);
                        bad += memcmp(got, ref, n * 4) != 0;
                    } else {
                        get(gotb, ob[r], n * 2);
                        for (size_t j = 0; j < n; j++) bad += gotb[j] != bf(ref[j]);
                    }
                }
                CHECKF(!bad, "peer all-reduce N=%d n=%zu call %d (%s): %d outputs differ from the rank-order sum", N,
                       n, c, add ? "f32 +=" : f32 ? "f32" : "bf16", bad);
            }
            free(x0);
            printf("  peer all-reduce N=%d (%s) n=%zu: 12 calls, %s\n", N, ngpu >= N && N > 1 ? "GPUs" : "one GPU", n,
                   bad ? "FAILED" : "exact");
            /* a lone rank waits until the abort flag ends it */
            if (N == 2 && si == 0) {
                struct cuda_peer_ar a = {.epoch = epoch[0], .abort = abort_flag, .n_ranks = N, .rank = 0};
                for (int p = 0; p < N; p++) a.src[p] = buf[p][0], a.flags[p] = flags[p];
                cudaSetDevice(dev[0]);
                CHECK(cuda_peer_allreduce(&a, n, NULL, of[0], false, st[0]) == cudaSuccess);
                struct timespec ts = {0, 50 * 1000 * 1000};
                nanosleep(&ts, NULL);
                CHECKF(cudaStreamQuery(st[0]) == cudaErrorNotReady, "peer all-reduce: a lone rank did not wait");
                *(volatile int *)abort_flag = 1;
                double t0 = now_s();
                CHECK(cudaStreamSynchronize(st[0]) == cudaSuccess);
                printf("  peer all-reduce: a lone rank waited, ended %.1f ms after the abort flag\n",
                       (now_s() - t0) * 1e3);
                *abort_flag = 0;
            }
            for (int r = 0; r < N; r++) {
                cudaSetDevice(dev[r]);
                cudaStreamDestroy(st[r]);
                for (int i = 0; i < 3; i++) cudaFree(buf[r][i]);
                cudaFree(of[r]), cudaFree(ob[r]), cudaFree(flags[r]), cudaFree(epoch[r]), free(h[r]);
            }
            free(got), free(ref), free(gotb);
            cudaSetDevice(0);
        }
    /* bad arguments launch nothing */
    struct cuda_peer_ar a = {.n_ranks = CUDA_PEER_MAX + 1};
    CHECK(cuda_peer_allreduce(&a, 4, NULL, (float *)abort_flag, false, 0) == cudaErrorInvalidValue);
    a.n_ranks = 1;
    CHECK(cuda_peer_allreduce(&a, 4, NULL, NULL, false, 0) == cudaErrorInvalidValue);
    CHECK(cuda_peer_allreduce(&a, 4, (uint16_t *)abort_flag, NULL, true, 0) == cudaErrorInvalidValue);
    cudaFreeHost(abort_flag);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU: skipped\n0 passed, 0 failed\n");
        return 0;
    }
    RUN(test_embed_rmsnorm);
    RUN(test_swiglu);
    RUN(test_gemv);
    RUN(test_gemv_fused);
    RUN(test_gemm_wg);
    RUN(test_gemv_layers_graph);
    RUN(test_gemv_mlp);
    RUN(test_argmax);
    RUN(test_peer_allreduce);
    RUN(test_rope_kv);
    RUN(test_attention);
    RUN(test_attention_decode);
    RUN(test_attention_rope_fold);
    RUN(test_attention_tc);
    RUN(test_attention_tc_nowg);
    RUN(test_attention_tc_kround8);
    RUN(test_attention_kv8);
    RUN(test_rope_fold_kv8);
    RUN(test_attention_tc_kv8);
    RUN(test_attention_wg8_small);
    RUN(test_attention_pstride);
    return test_summary();
}
