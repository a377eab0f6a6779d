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
 * outputs (bf16 Q and P on the tensor cores: ~1e-2 at most). Then the
 * expanded form at the same shapes (qk_nope 128, v_head 128): the queries
 * to bf16 (cuda_mla_xq), the context's latents gathered and up-projected
 * through a random kv_b into per-head K and V, and the GQA tensor-core
 * kernel over them (cuda_mla_xrun, as the backend plans one prompt chunk:
 * cuda_mla_xplan), whole and its attention alone; TFLOP/s of the attention
 * count 2 H (Dn + R + Dv) a key, of the whole the same work (so the two
 * forms' numbers compare as times). Not a test.
 *
 * With --indexer, the DSA indexer alone (cuda_mla_indexer: the keys'
 * entry write, the pools' keys, the scores and the choice) instead, at
 * GLM-5.3-Flash's shape (32 heads of 128 dims, pools of 16 with the tail,
 * 2048 keys chosen, kv_lora_rank 512, no rope, block 64) and per key at
 * GLM-5's (rope 64, no pools): one query at contexts of 16K, 64K and 256K
 * (a decode step), and a chunk of 8192 queries ending at 14.6K (the last
 * chunk of a 14.6K prompt). Random entries, pool keys cached before the
 * step; each call captured in a CUDA graph, the mean of 10 replays, in us.
 *
 *   build/tests/gpu/bench_mla [--kv-cache-dtype=fp8] [--rows=32] [--form=F] [--xrows=64] [--indexer]
 *   --rows=32   sm_89's configuration (32 rows a block, one key stage) on
 *               any GPU (cuda_tuning.mla_prefill_rows)
 *   --form=F    absorbed, expanded, or both (the default)
 *   --xrows=64  the expanded form's attention items of 64 tokens (4 warps a
 *               block) instead of 128 (8 warps; cuda_tuning.mla_expand_rows)
 *   --indexer   the indexer's timings instead of the attention's */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/mla.h"
#include "cuda/tuning.h"
#include "tests/gpu/gpu_util.h"

enum { C = 512, R = 64, DN = 128, DV = 128, W = C + R, BS = 16 };

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

static int g_xrows = 128;

/* median of runs of fn(arg) (after one untimed), ms; NAN when a run fails */
static float time_fn(int (*fn)(void *), void *arg, int runs)
{
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    float t[8];
    int rc = fn(arg);
    for (int i = 0; i < runs && !rc; i++) {
        cudaEventRecord(e0, 0);
        rc = fn(arg);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&t[i], e0, e1);
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    if (rc || cudaGetLastError() != cudaSuccess) return NAN;
    for (int i = 1; i < runs; i++)
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            float x = t[j];
            t[j] = t[j - 1], t[j - 1] = x;
        }
    return t[runs / 2];
}

struct xbench {
    cublasHandle_t blas;
    const float *q;
    int T, H, DK;
    uint16_t *xq;
    struct cuda_mla_xrun_args xr;
};
static int x_whole(void *p)
{
    struct xbench *x = p;
    char err[256] = "the queries' kernel";
    if (cuda_mla_xq(x->q, x->T, x->H, DN + R, x->DK, x->xq, 0) != cudaSuccess ||
        cuda_mla_xrun(x->blas, &x->xr, 0, err, sizeof err)) {
        printf("  expanded form failed: %s\n", err);
        return 1;
    }
    return 0;
}
static int x_attn(void *p)
{
    struct xbench *x = p;
    return cuda_attention(&x->xr.at, 0) != cudaSuccess;
}

/* The expanded form of the same chunk: the cache, block table, positions and queries (dq f32 [T][H][DN + R]) of
 * bench's. */
static void bench_x(const char *what, int H, int start, int T, bool kv8, const void *dcache, const int32_t *dbt,
                    const int32_t *dpos, const int32_t *pos, const float *dq)
{
    int DK = 0, DVP = 0, n = start + T;
    if (!cuda_attention_tc_pair(DN + R, DV, &DK, &DVP)) {
        printf("%s: no tensor-core kernel for the expanded heads\n", what);
        return;
    }
    int dev = 0, n_sm = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev);
    int rows = (n + CUDA_MLA_XBS - 1) / CUDA_MLA_XBS * CUDA_MLA_XBS;
    size_t pbytes = cuda_mla_attn_part_bytes(T, H, C, R);
    struct cuda_mla_xplan p = {.rows = rows, .H = H, .DK = DK, .DV = DVP, .Dn = DN, .R = R, .Dv = DV,
                               .qrows = g_xrows, .n_sm = n_sm, .max_tokens = T, .max_seqs = 1,
                               .max_items = 2 * ((T + g_xrows - 1) / g_xrows + 1) + 2 * n_sm + 64,
                               .part_bytes = pbytes, .comp_bytes = (size_t)rows * H * (DK + DVP) * 2};
    struct cuda_mla_xgroup g = {0};
    int src = 0;
    p.g = &g, p.src = &src;
    struct cuda_mla_xin in = {.query_start = 0, .query_len = T, .context_len = n, .n_prompt = n, .bt0 = 0};
    size_t xb = cuda_mla_xbytes(T, 1, p.max_items);
    uint8_t *hx = calloc(1, xb), *dx = dup_dev(NULL, xb);
    struct cuda_mla_xdev hd = cuda_mla_xdev_at(hx, T, 1), dd = cuda_mla_xdev_at(dx, T, 1);
    if (!cuda_mla_xplan(&p, &in, 1, pos, T, &hd) || p.n_groups != 1) {
        printf("%s: the expanded form's plan failed\n", what);
        free(hx), cudaFree(dx);
        return;
    }
    cudaMemcpy(dx, hx, xb, cudaMemcpyHostToDevice);
    size_t nw = (size_t)H * (DN + DV) * C;
    uint16_t *kvb = malloc(nw * 2);
    float wsc = 2.0f / sqrtf((float)C);
    for (size_t i = 0; i < nw; i++) kvb[i] = bf(wsc * frand());
    int32_t *iota = malloc((size_t)rows / CUDA_MLA_XBS * 4);
    for (int i = 0; i < rows / CUDA_MLA_XBS; i++) iota[i] = i;
    uint16_t *dkvb = dup_dev(kvb, nw * 2), *dlat = poisoned((size_t)rows * C * 2);
    uint16_t *dk = poisoned((size_t)rows * H * DK * 2), *dv = poisoned((size_t)rows * H * DVP * 2);
    uint16_t *dxq = poisoned((size_t)T * H * DK * 2), *dout = poisoned((size_t)T * H * DV * 2);
    int32_t *diota = dup_dev(iota, (size_t)rows / CUDA_MLA_XBS * 4);
    float *dpart = pbytes ? poisoned(pbytes) : NULL;
    struct xbench x = {.q = dq, .T = T, .H = H, .DK = DK, .xq = dxq};
    x.xr = (struct cuda_mla_xrun_args){
        .g = {.cache = dcache, .bt = dbt, .seqs = dd.seqs, .n_seqs = 1, .max_n = g.max_n, .C = C, .R = R, .W = W,
              .Dn = DN, .H = H, .DK = DK, .block_size = BS, .kv8 = kv8, .lat = dlat, .k = dk, .v = dv, .Dv = DV,
              .DV = DVP},
        .kv_b = dkvb, .rows = g.rows,
        .at = {.q = dxq, .kc = dk, .vc = dv, .pos = dpos, .bt = diota, .items = dd.items, .n_items = dd.n_items,
               .max_items = g.nitem, .max_rows = g_xrows, .H = H, .KVH = H, .D = DK, .block_size = CUDA_MLA_XBS,
               .scale = 1.0f / sqrtf((float)(DN + R)), .part = dpart, .pstride = p.pstride,
               .tok_part = dd.tok_part, .tok_nsplit = dd.tok_nsplit, .T = T, .out = dout, .Dv = DVP, .Do = DV},
    };
    if (cublasCreate(&x.blas) != CUBLAS_STATUS_SUCCESS || cuda_attention_prepare_pair(DK, DVP) != cudaSuccess) {
        printf("%s: cuBLAS or the kernel's set-up failed\n", what);
    } else {
        float tw = time_fn(x_whole, &x, 5), ta = time_fn(x_attn, &x, 5);
        double keys = (double)T * start + (double)T * (T + 1) / 2, flop = 2.0 * H * (DN + R + DV) * keys;
        uint16_t *ho = malloc((size_t)T * H * DV * 2);
        get(ho, dout, (size_t)T * H * DV * 2);
        size_t bad = 0;
        for (size_t i = 0; i < (size_t)T * H * DV; i++) bad += !isfinite(fb(ho[i]));
        printf("%s (%s, H %d, %d tokens over %d cached): expanded form %.2f ms (attention %.2f ms = %.0f TFLOP/s, "
               "%d-token items%s; gather, up-projections and queries %.2f ms)%s\n",
               what, kv8 ? "fp8" : "bf16", H, T, start, tw, ta, flop / ta / 1e9, g_xrows,
               p.pstride ? ", keys split" : "", tw - ta, bad ? ", NON-FINITE OUTPUTS" : "");
        free(ho);
    }
    if (x.blas) cublasDestroy(x.blas);
    cudaFree(dx), cudaFree(dkvb), cudaFree(dlat), cudaFree(dk), cudaFree(dv), cudaFree(dxq), cudaFree(dout);
    cudaFree(diota), cudaFree(dpart);
    free(hx), free(kvb), free(iota);
}

static bool g_absorbed = true, g_expanded = true;

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
    if (!g_absorbed) {
    } else if (!cuda_mla_prefill_ok(&a)) {
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
    if (g_expanded) bench_x(what, H, start, T, kv8, dcache, dbt, dpos, pos, dq);
    cudaFree(dcache), cudaFree(dqlat), cudaFree(dq), cudaFree(dbt), cudaFree(dpos), cudaFree(dtbt), cudaFree(o1);
    cudaFree(o2), cudaFree(part);
    free(craw), free(bt), free(pos), free(tbt), free(qlat), free(q);
}

/* The indexer over T queries at positions start .. start + T - 1 of one sequence (KP 0: per key, rope R). */
static void bench_ix(int start, int T, int KP, int R, bool kv8)
{
    enum { IH = 32, ID = 128, K = 2048, IBS = 64, IC = 512 };
    int n = start + T, nb = (n + IBS - 1) / IBS, W = IC + R + ID * (KP ? 2 : 1), X = n + 1;
    int PB = KP ? (IBS + KP - 1) / KP : 0, KS = K + KP;
    size_t es = kv8 ? 1 : 2, cache_n = (size_t)nb * IBS * W, pk_n = (size_t)nb * (PB ? PB : 1) * ID;
    uint8_t *craw = malloc(cache_n * es);
    for (size_t i = 0; i < cache_n; i++) {
        if (kv8) craw[i] = (uint8_t)((frand() < 0 ? 0x80 : 0) | (4 + (int)((frand() + 1.0f) * 2.0f)) << 3);
        else ((uint16_t *)craw)[i] = bf(frand());
    }
    float *pk = malloc(pk_n * 4), *q = malloc((size_t)T * IH * ID * 4), *k = malloc((size_t)T * ID * 4);
    float *w = malloc((size_t)T * IH * 4), *vec = malloc((size_t)(KP ? KP : 1) * ID * 4);
    for (size_t i = 0; i < pk_n; i++) pk[i] = frand();
    for (size_t i = 0; i < (size_t)T * IH * ID; i++) q[i] = frand();
    for (size_t i = 0; i < (size_t)T * ID; i++) k[i] = frand();
    for (size_t i = 0; i < (size_t)T * IH; i++) w[i] = frand();
    for (int i = 0; i < (KP ? KP : 1) * ID; i++) vec[i] = 1.0f + 0.1f * frand();
    int32_t *bt = malloc((size_t)nb * 4), *pos = malloc((size_t)T * 4), *tbt = calloc((size_t)T, 4);
    int64_t *slots = malloc((size_t)T * 8);
    for (int i = 0; i < nb; i++) bt[i] = (int32_t)(((long long)i * 7919) % nb);
    for (int t = 0; t < T; t++) {
        int p = start + t;
        pos[t] = p, slots[t] = (int64_t)bt[p / IBS] * IBS + p % IBS;
    }
    float *cs = malloc((size_t)X * (R ? R / 2 : 1) * 4);
    for (size_t i = 0; i < (size_t)X * (R ? R / 2 : 1); i++) cs[i] = frand();
    void *dcache = dup_dev(craw, cache_n * es);
    float *dpk = dup_dev(pk, pk_n * 4), *dq = dup_dev(q, (size_t)T * IH * ID * 4), *dk = dup_dev(k, (size_t)T * ID * 4);
    float *dg = dup_dev(k, (size_t)T * ID * 4), *dw = dup_dev(w, (size_t)T * IH * 4);
    float *dvec = dup_dev(vec, (size_t)(KP ? KP : 1) * ID * 4), *dcs = dup_dev(cs, (size_t)X * (R ? R / 2 : 1) * 4);
    int32_t *dbt = dup_dev(bt, (size_t)nb * 4), *dpos = dup_dev(pos, (size_t)T * 4), *dtbt = dup_dev(tbt, (size_t)T * 4);
    int64_t *dslots = dup_dev(slots, (size_t)T * 8);
    float *dsc = dup_dev(NULL, (size_t)T * X * 4);
    int32_t *dsel = dup_dev(NULL, (size_t)T * KS * 4), *dnsel = dup_dev(NULL, (size_t)T * 4);
    struct cuda_mla_ix_args a = {.q = dq, .k = dk, .g = KP ? dg : NULL, .ape = KP ? dvec : NULL, .w = dw, .kn = dvec,
                                 .kb = dvec, .cos = R ? dcs : NULL, .sin = R ? dcs : NULL, .pos = dpos,
                                 .tok_bt = dtbt, .bt = dbt, .slots = dslots, .cache = dcache, .scores = dsc,
                                 .sel = dsel, .nsel = dnsel, .T = T, .IH = IH, .ID = ID, .R = R, .C = IC, .W = W,
                                 .K = K, .KS = KS, .max_ctx = X, .block_size = IBS, .KP = KP,
                                 .want = KP ? K / KP : 0, .tail = KP > 0, .kv8 = kv8, .pk = KP ? dpk : NULL,
                                 .PB = PB};
    cudaStream_t st;
    cudaGraph_t gr = NULL;
    cudaGraphExec_t ge = NULL;
    cudaEvent_t e0, e1;
    cudaStreamCreate(&st);
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    cudaError_t e = cuda_mla_indexer(&a, st); /* a warm-up outside the graph */
    if (e == cudaSuccess) e = cudaStreamSynchronize(st);
    if (e == cudaSuccess) e = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess) {
        cudaError_t ec = cuda_mla_indexer(&a, st);
        e = cudaStreamEndCapture(st, &gr);
        e = ec != cudaSuccess ? ec : e;
    }
    if (e == cudaSuccess) e = cudaGraphInstantiate(&ge, gr, 0);
    float ms = NAN;
    if (e == cudaSuccess) {
        enum { RUNS = 10 };
        cudaGraphLaunch(ge, st);
        cudaEventRecord(e0, st);
        for (int i = 0; i < RUNS; i++) cudaGraphLaunch(ge, st);
        cudaEventRecord(e1, st);
        e = cudaEventSynchronize(e1);
        cudaEventElapsedTime(&ms, e0, e1);
        ms /= RUNS;
    }
    if (e != cudaSuccess) printf("  failed: %s\n", cudaGetErrorString(e));
    else
        printf("indexer, %s, %s: %d quer%s at %d..%d (%d candidates at the end): %.1f us\n",
               KP ? "pools of 16 (GLM-5.3-Flash)" : "per key, rope 64 (GLM-5)", kv8 ? "fp8" : "bf16", T,
               T > 1 ? "ies" : "y", start, n - 1, KP ? n / KP : n, ms * 1e3);
    if (ge) cudaGraphExecDestroy(ge);
    if (gr) cudaGraphDestroy(gr);
    cudaEventDestroy(e0), cudaEventDestroy(e1), cudaStreamDestroy(st);
    cudaFree(dcache), cudaFree(dpk), cudaFree(dq), cudaFree(dk), cudaFree(dg), cudaFree(dw), cudaFree(dvec);
    cudaFree(dcs), cudaFree(dbt), cudaFree(dpos), cudaFree(dtbt), cudaFree(dslots), cudaFree(dsc), cudaFree(dsel);
    cudaFree(dnsel);
    free(craw), free(pk), free(q), free(k), free(w), free(vec), free(bt), free(pos), free(tbt), free(slots), free(cs);
}

int main(int argc, char **argv)
{
    bool kv8 = false, ix = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--kv-cache-dtype=fp8")) kv8 = true;
        else if (!strcmp(argv[i], "--rows=32")) cuda_tuning.mla_prefill_rows = 32;
        else if (!strcmp(argv[i], "--form=absorbed")) g_expanded = false;
        else if (!strcmp(argv[i], "--form=expanded")) g_absorbed = false;
        else if (!strcmp(argv[i], "--form=both")) g_absorbed = g_expanded = true;
        else if (!strcmp(argv[i], "--xrows=64")) g_xrows = 64;
        else if (!strcmp(argv[i], "--xrows=128")) g_xrows = 128;
        else if (!strcmp(argv[i], "--indexer")) ix = true;
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
    printf("%s%s\n", p.name, cuda_tuning.mla_prefill_rows == 32 && !ix ? ", 32 rows a block" : "");
    if (ix) {
        static const int ctx[] = {16384, 65536, 262144};
        for (int KP = 16; KP >= 0; KP -= 16) {
            for (int i = 0; i < 3; i++) bench_ix(ctx[i] - 1, 1, KP, KP ? 0 : 64, kv8);
            bench_ix(14600 - 8192, 8192, KP, KP ? 0 : 64, kv8);
        }
        return 0;
    }
    bench("first chunk of a prompt", 16, 0, 8192, kv8);
    bench("last chunk of a 32K prompt", 16, 24576, 8192, kv8);
    bench("128 heads", 128, 0, 2048, kv8);
    return 0;
}
