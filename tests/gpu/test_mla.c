/* test_mla.c - the MLA kernels (cuda/mla.h) against plain-C references on
 * random data (make gpu-test; needs a GPU): the latent RMSNorm; the paged
 * entry write (latent norm, RoPE on the rope key and the queries' rope parts,
 * q_nope rounded) over a scattered block table; the absorbed attention of
 * two sequences, a prefill chunk each (causal within the step) and then
 * decode steps, bf16 and fp8 e4m3 caches (long ones, whose decode steps
 * split their keys over blocks; 128 heads in groups; the indexer's choice
 * of keys; keys from position 1, as the MTP layer attends); the DSA indexer (keys, scores, the top-K choice with ties;
 * k-pools in one step and over prefill, decode and pool-completing steps, the cached pool keys; long contexts of
 * several sequences, one on another's prefix blocks, decode steps of T 1 whose scores split over many blocks);
 * the tensor-core prefill attention against a double reference and the
 * SIMT kernel (chunks at 0 and mid-context, several sequences a step, 1, 16
 * and 128 heads, bf16 and fp8, block sizes 16 and 64, the indexer's
 * choice, sm_89's configuration); the expanded form of prefill chunks
 * (gather, up-projections, the GQA tensor-core kernel over the scratch)
 * against a double reference and the absorbed form, with the absorbed
 * tokens' gather and scatter.
 * Each attention is checked against
 * a double reference over the entries the GPU stored (read back), and the
 * entries against the reference latent and key. Errors are ||out - ref|| /
 * ||ref||; outputs are poisoned (NaN) first, so an unwritten value fails.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/mla.h"
#include "cuda/tuning.h"
#include "tests/gpu/gpu_util.h"
#include "tests/test.h"

static float e4m3(uint8_t v)
{
    int s = v >> 7, e = (v >> 3) & 15, m = v & 7;
    if (e == 15 && m == 7) return NAN;
    float f = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
    return s ? -f : f;
}

static void test_rmsnorm(void)
{
    int shapes[][2] = {{1, 32}, {5, 512}, {17, 1536}, {3, 24}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int T = shapes[si][0], n = shapes[si][1], xs = n + 3, os = n + 5;
        float *x = malloc((size_t)T * xs * 4), *w = malloc((size_t)n * 4), *o = malloc((size_t)T * n * 4);
        double *ref = malloc((size_t)T * n * 8);
        uint16_t *ob = malloc((size_t)T * os * 2);
        for (int i = 0; i < T * xs; i++) x[i] = 3.0f * frand();
        for (int i = 0; i < n; i++) w[i] = 1.0f + 0.5f * frand();
        for (int t = 0; t < T; t++) {
            double ss = 0;
            for (int i = 0; i < n; i++) ss += (double)x[t * xs + i] * x[t * xs + i];
            double inv = 1.0 / sqrt(ss / n + 1e-6);
            for (int i = 0; i < n; i++) ref[t * n + i] = w[i] * x[t * xs + i] * inv;
        }
        float *dx = dup_dev(x, (size_t)T * xs * 4), *dw = dup_dev(w, (size_t)n * 4);
        uint16_t *dout = poisoned((size_t)T * os * 2);
        CHECK(cuda_mla_rmsnorm(dx, xs, dw, n, 1e-6f, T, dout, os, 0) == cudaSuccess);
        get(ob, dout, (size_t)T * os * 2);
        for (int t = 0; t < T; t++)
            for (int i = 0; i < n; i++) o[t * n + i] = fb(ob[t * os + i]);
        double e = nerr(o, ref, (size_t)T * n);
        printf("  rmsnorm T=%d n=%d: %.2e\n", T, n, e);
        CHECKF(e < 5e-3, "T=%d n=%d: %.3g", T, n, e);
        cudaFree(dx), cudaFree(dw), cudaFree(dout);
        free(x), free(w), free(o), free(ref), free(ob);
    }
}

static int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

/* A block table of nbt entries over a pool of NB > nbt blocks, out of order:
 * entry i is block (i + 1) mul mod NB, mul the first coprime with NB from
 * mul0 (block 0 unused) */
static int32_t *scrambled_bt(int nbt, int NB, int mul0)
{
    int mul = mul0;
    while (gcd(mul, NB) != 1) mul++;
    int32_t *bt = malloc((size_t)nbt * 4);
    for (int i = 0; i < nbt; i++) bt[i] = (int32_t)(((long long)(i + 1) * mul) % NB);
    return bt;
}

/* n random cache entries as the device holds them (*raw: fp8 e4m3 with kv8, else bf16) and their values
 * (*val). fp8: sign, exponent 3..8 (2^-4 .. 2^1), any mantissa: up to 3.75, never NaN */
static void random_cache(size_t n, bool kv8, uint8_t **raw, float **val)
{
    uint8_t *craw = malloc(n * (kv8 ? 1 : 2));
    float *cache = malloc(n * 4);
    for (size_t i = 0; i < n; i++) {
        if (kv8) {
            int r = (int)((frand() + 1.0f) * 4096.0f);
            uint8_t v = (uint8_t)((frand() < 0 ? 0x80 : 0) | (3 + r % 6) << 3 | (r / 6) % 8);
            craw[i] = v, cache[i] = e4m3(v);
        } else {
            uint16_t v = bf(frand());
            ((uint16_t *)craw)[i] = v, cache[i] = fb(v);
        }
    }
    *raw = craw, *val = cache;
}

/* the first key attended without the indexer's choice (1: the MTP layer's,
 * which has no entry at position 0; queries at positions below it are not
 * checked) */
static int g_key0;

/* Two sequences over a scattered block table: a prefill chunk of each in
 * one step (lengths P0, P1), then ND decode steps of one token each. Long
 * sequences make the decode steps split their keys over blocks (the
 * partial sums combined); with sel, every query but the first attends the
 * keys j % 3 == 0 and its own (the indexer's path). The attention of a long
 * prefill is checked on a sample of its tokens (the reference is slow). */
static void run_case_n(int H, int C, int R, int Dn, bool inter, bool kv8, int P0, int P1, bool use_sel)
{
    enum { BS = 16, ND = 3 };
    int P[2] = {P0, P1}, W = C + R, Dq = Dn + R, half = R / 2, X = (P0 > P1 ? P0 : P1) + ND + 1;
    int nb[2] = {(P0 + ND + BS - 1) / BS, (P1 + ND + BS - 1) / BS}, off[2] = {0, nb[0]}, NB = nb[0] + nb[1] + 1;
    int32_t *bt = scrambled_bt(nb[0] + nb[1], NB, 5); /* blocks of each sequence out of order */
#define BLK(s, b) bt[off[s] + (b)]
    float scale = 1.0f / sqrtf((float)(Dn + R)) * 1.3f, eps = 1e-6f;
    size_t es = kv8 ? 1 : 2, cache_n = (size_t)NB * BS * W;
    float *cs = malloc((size_t)X * (half ? half : 1) * 4), *sn = malloc((size_t)X * (half ? half : 1) * 4);
    for (int p = 0; p < X; p++)
        for (int i = 0; i < half; i++) {
            float ang = (float)p * powf(10000.0f, -2.0f * i / (float)R);
            cs[p * half + i] = cosf(ang) * 1.1f, sn[p * half + i] = sinf(ang) * 1.1f; /* an attention factor */
        }
    float *kvn = malloc((size_t)C * 4);
    for (int i = 0; i < C; i++) kvn[i] = 1.0f + 0.3f * frand();
    void *dcache = dup_dev(NULL, cache_n * es);
    cudaMemset(dcache, 0, cache_n * es);
    float *dcos = half ? dup_dev(cs, (size_t)X * half * 4) : NULL, *dsin = half ? dup_dev(sn, (size_t)X * half * 4) : NULL;
    float *dkvn = dup_dev(kvn, (size_t)C * 4);
    int32_t *dbt = dup_dev(bt, (size_t)(nb[0] + nb[1]) * 4);
    size_t pbytes = cuda_mla_attn_part_bytes(P0 + P1, H, C, R);
    float *dpart = pbytes ? poisoned(pbytes) : NULL;
    /* the host's copy of every entry written so far, in the reference's precision */
    double *lat_ref = calloc((size_t)2 * X * W, sizeof(double));
    double worst_w = 0, worst_a = 0, worst_q = 0;
    for (int stepi = 0; stepi <= ND; stepi++) {
        int n0 = stepi ? 1 : P[0], n1 = stepi ? 1 : P[1], T = n0 + n1;
        int start[2] = {stepi ? P[0] + stepi - 1 : 0, stepi ? P[1] + stepi - 1 : 0};
        int32_t *pos = malloc((size_t)T * 4), *tbt = malloc((size_t)T * 4);
        int64_t *slots = malloc((size_t)T * 8);
        int *seq = malloc((size_t)T * sizeof(int));
        for (int t = 0; t < T; t++) {
            int s = t < n0 ? 0 : 1, p = start[s] + (s ? t - n0 : t);
            seq[t] = s, pos[t] = p, tbt[t] = off[s];
            slots[t] = (int64_t)BLK(s, p / BS) * BS + p % BS;
        }
        /* the indexer's choice: keys j % 3 == 0 and pos, ascending; the first query every key (-1) */
        int32_t *sel = malloc((size_t)T * X * 4), *nsel = malloc((size_t)T * 4);
        for (int t = 0; t < T; t++) {
            int m = 0;
            for (int j = 0; j <= pos[t]; j++)
                if (j % 3 == 0 || j == pos[t]) sel[(size_t)t * X + m++] = j;
            nsel[t] = t ? m : -1;
        }
        float *kva = malloc((size_t)T * W * 4), *q = malloc((size_t)T * H * Dq * 4), *qlat = malloc((size_t)T * H * C * 4);
        for (int i = 0; i < T * W; i++) kva[i] = 2.0f * frand();
        for (int i = 0; i < T * H * Dq; i++) q[i] = frand();
        for (int i = 0; i < T * H * C; i++) qlat[i] = frand();
        /* reference entries and rotated queries */
        double *qref = malloc((size_t)T * H * Dq * 8);
        for (int t = 0; t < T; t++) {
            const float *kv = kva + (size_t)t * W;
            double ss = 0, *e = lat_ref + ((size_t)seq[t] * X + pos[t]) * W;
            for (int i = 0; i < C; i++) ss += (double)kv[i] * kv[i];
            double inv = 1.0 / sqrt(ss / C + eps);
            for (int i = 0; i < C; i++) e[i] = kvn[i] * kv[i] * inv;
            for (int i = 0; i < R; i++) e[C + i] = kv[C + i];
            for (int h = 0; h < H; h++)
                for (int i = 0; i < Dq; i++) qref[((size_t)t * H + h) * Dq + i] = q[((size_t)t * H + h) * Dq + i];
            const float *c = cs + (size_t)pos[t] * half, *s = sn + (size_t)pos[t] * half;
            for (int k = -1; k < H; k++) {
                double *x = k < 0 ? e + C : qref + ((size_t)t * H + k) * Dq + Dn;
                for (int i = 0; i < half; i++) {
                    int i0 = inter ? 2 * i : i, i1 = inter ? 2 * i + 1 : i + half;
                    double u = x[i0], v = x[i1];
                    x[i0] = u * c[i] - v * s[i];
                    x[i1] = v * c[i] + u * s[i];
                }
            }
        }
        float *dq = dup_dev(q, (size_t)T * H * Dq * 4), *dkva = dup_dev(kva, (size_t)T * W * 4);
        float *dqlat = dup_dev(qlat, (size_t)T * H * C * 4);
        uint16_t *dqn = poisoned((size_t)T * H * Dn * 2), *dolat = poisoned((size_t)T * H * C * 2);
        int32_t *dpos = dup_dev(pos, (size_t)T * 4), *dtbt = dup_dev(tbt, (size_t)T * 4);
        int64_t *dslots = dup_dev(slots, (size_t)T * 8);
        struct cuda_mla_kv_args ka = {.q = dq, .qn = dqn, .kva = dkva, .kv_norm = dkvn, .cos = dcos, .sin = dsin,
                                      .pos = dpos, .slots = dslots, .cache = dcache, .T = T, .H = H, .Dn = Dn,
                                      .R = R, .C = C, .W = W, .eps = eps, .interleave = inter, .kv8 = kv8};
        CHECK(cuda_mla_kv_write(&ka, 0) == cudaSuccess);
        int32_t *dsel = dup_dev(sel, (size_t)T * X * 4), *dnsel = dup_dev(nsel, (size_t)T * 4);
        struct cuda_mla_attn_args aa = {.qlat = dqlat, .q = dq, .cache = dcache, .pos = dpos, .tok_bt = dtbt,
                                        .bt = dbt, .sel = use_sel ? dsel : NULL, .nsel = use_sel ? dnsel : NULL,
                                        .olat = dolat, .part = dpart, .T = T, .H = H, .Dn = Dn, .R = R, .C = C,
                                        .W = W, .K = X, .block_size = BS, .scale = scale, .kv8 = kv8,
                                        .key0 = g_key0};
        CHECK(cuda_mla_attention(&aa, 0) == cudaSuccess);
        CHECK(cudaDeviceSynchronize() == cudaSuccess);
        /* the entries the GPU wrote, as f32 */
        uint8_t *craw = malloc(cache_n * es);
        float *cache = malloc(cache_n * 4);
        get(craw, dcache, cache_n * es);
        for (size_t i = 0; i < cache_n; i++) cache[i] = kv8 ? e4m3(craw[i]) : fb(((uint16_t *)craw)[i]);
        /* entries of this step vs the reference */
        {
            float *got = malloc((size_t)T * W * 4);
            double *want = malloc((size_t)T * W * 8);
            for (int t = 0; t < T; t++) {
                memcpy(got + (size_t)t * W, cache + (size_t)slots[t] * W, (size_t)W * 4);
                memcpy(want + (size_t)t * W, lat_ref + ((size_t)seq[t] * X + pos[t]) * W, (size_t)W * 8);
            }
            double e = nerr(got, want, (size_t)T * W);
            worst_w = e > worst_w ? e : worst_w;
            free(got), free(want);
        }
        /* rotated queries (f32 in place) and q_nope in bf16 */
        {
            float *qg = malloc((size_t)T * H * Dq * 4), *qn = malloc((size_t)T * H * Dn * 4);
            uint16_t *qnb = malloc((size_t)T * H * Dn * 2);
            double *qnr = malloc((size_t)T * H * Dn * 8);
            get(qg, dq, (size_t)T * H * Dq * 4);
            get(qnb, dqn, (size_t)T * H * Dn * 2);
            for (int j = 0; j < T * H * Dn; j++) {
                qn[j] = fb(qnb[j]);
                qnr[j] = qref[(size_t)(j / Dn) * Dq + j % Dn];
            }
            double e = nerr(qg, qref, (size_t)T * H * Dq), e2 = nerr(qn, qnr, (size_t)T * H * Dn);
            e = e2 > e ? e2 : e;
            worst_q = e > worst_q ? e : worst_q;
            free(qg), free(qn), free(qnb), free(qnr);
        }
        /* attention over the stored entries, keys 0..pos of the token's sequence (or the choice) */
        {
            uint16_t *ob = malloc((size_t)T * H * C * 2);
            int nc = 0, *ck = malloc((size_t)T * sizeof(int)), *kl = malloc((size_t)X * sizeof(int));
            for (int t = 0; t < T; t++)
                if ((T <= 64 || t % 61 == 0 || t == n0 - 1 || t >= T - 2) && pos[t] >= g_key0) ck[nc++] = t;
            float *o = malloc((size_t)nc * H * C * 4);
            double *ref = calloc((size_t)nc * H * C, sizeof(double)), *sc = malloc((size_t)X * 8);
            get(ob, dolat, (size_t)T * H * C * 2);
            for (int ci = 0; ci < nc; ci++) {
                int t = ck[ci], n = 0;
                if (use_sel && nsel[t] >= 0)
                    for (n = 0; n < nsel[t]; n++) kl[n] = sel[(size_t)t * X + n];
                else
                    for (n = 0; n <= pos[t] - g_key0; n++) kl[n] = g_key0 + n;
                for (int i = 0; i < H * C; i++) o[(size_t)ci * H * C + i] = fb(ob[(size_t)t * H * C + i]);
                for (int h = 0; h < H; h++) {
                    const float *ql = qlat + ((size_t)t * H + h) * C;
                    const double *qr = qref + ((size_t)t * H + h) * Dq + Dn;
                    double mx = -INFINITY, sum = 0;
                    for (int i = 0; i < n; i++) {
                        int j = kl[i];
                        const float *e = cache + ((size_t)BLK(seq[t], j / BS) * BS + j % BS) * W;
                        double d = 0;
                        for (int c = 0; c < C; c++) d += (double)ql[c] * e[c];
                        for (int c = 0; c < R; c++) d += qr[c] * e[C + c];
                        sc[i] = d * scale;
                        mx = sc[i] > mx ? sc[i] : mx;
                    }
                    for (int i = 0; i < n; i++) sum += sc[i] = exp(sc[i] - mx);
                    double *r = ref + ((size_t)ci * H + h) * C;
                    for (int i = 0; i < n; i++) {
                        int j = kl[i];
                        const float *e = cache + ((size_t)BLK(seq[t], j / BS) * BS + j % BS) * W;
                        for (int c = 0; c < C; c++) r[c] += sc[i] / sum * e[c];
                    }
                }
            }
            double e = nerr(o, ref, (size_t)nc * H * C);
            worst_a = e > worst_a ? e : worst_a;
            free(o), free(ob), free(ref), free(sc), free(ck), free(kl);
        }
        cudaFree(dq), cudaFree(dkva), cudaFree(dqlat), cudaFree(dqn), cudaFree(dolat), cudaFree(dpos);
        cudaFree(dtbt), cudaFree(dslots), cudaFree(dsel), cudaFree(dnsel);
        free(sel), free(nsel);
        free(pos), free(tbt), free(slots), free(seq), free(kva), free(q), free(qlat), free(qref), free(craw);
        free(cache);
    }
    /* e4m3 keeps 3 mantissa bits: ~2^-4 relative per value at worst, ~3% in the norm */
    double tw = kv8 ? 6e-2 : 5e-3;
    printf("  H=%d C=%d R=%d Dn=%d %s %s P=%d,%d%s%s: entries %.2e, queries %.2e, attention %.2e\n", H, C, R, Dn,
           inter ? "pairs" : "halves", kv8 ? "fp8" : "bf16", P0, P1, use_sel ? " sel" : "", g_key0 ? " key0 1" : "",
           worst_w, worst_q, worst_a);
    CHECKF(worst_w < tw, "entries %.3g", worst_w);
    CHECKF(worst_q < 5e-3, "queries %.3g", worst_q);
    CHECKF(worst_a < 1e-2, "attention %.3g", worst_a);
    cudaFree(dcache), cudaFree(dcos), cudaFree(dsin), cudaFree(dkvn), cudaFree(dbt), cudaFree(dpart);
    free(cs), free(sn), free(kvn), free(lat_ref), free(bt);
#undef BLK
}

static void run_case(int H, int C, int R, int Dn, bool inter, bool kv8)
{
    run_case_n(H, C, R, Dn, inter, kv8, 37, 20, false);
}

static void test_paged(void)
{
    run_case(4, 32, 8, 16, true, false);    /* the tiny checkpoints' shape */
    run_case(4, 32, 8, 16, false, false);   /* rope in halves */
    run_case(3, 32, 0, 16, true, false);    /* no RoPE (glm5_next's MLA) */
    run_case(8, 512, 64, 128, true, false); /* DeepSeek-V3's latent and rope dims */
    run_case(4, 300, 8, 16, true, false);   /* C not a multiple of the block's threads */
    /* DeepSeek-V2-Lite's 16 heads over long contexts: decode steps split
     * the keys over blocks (partial tiles at split ends), the prefill not */
    run_case_n(16, 512, 64, 128, true, false, 3000, 700, false);
    /* 128 heads (DeepSeek-V3 on one GPU): 8 groups of 16, decode splits of 34 keys */
    run_case_n(128, 512, 64, 128, true, false, 1100, 200, false);
    run_case_n(16, 512, 64, 128, true, false, 1500, 300, true); /* the indexer's choice, split */
    run_case_n(20, 300, 8, 16, false, false, 900, 40, true);    /* 2 groups of 10 heads, C/2 under the threads */
}

/* keys from position 1 (the MTP layer's attention): short, split and fp8 */
static void test_paged_key0(void)
{
    g_key0 = 1;
    run_case(4, 32, 8, 16, true, false);
    run_case_n(16, 512, 64, 128, true, false, 1500, 300, false);
    run_case(8, 512, 64, 128, true, true);
    g_key0 = 0;
}

static void test_paged_fp8(void)
{
    run_case(4, 32, 8, 16, true, true);
    run_case(8, 512, 64, 128, true, true);
    run_case_n(16, 512, 64, 128, true, true, 2000, 100, false);
}

/* The tensor-core prefill attention (cuda_mla_prefill) over one step of
 * nseq sequences: sequence s has st[s] keys cached before the step and n[s]
 * query tokens at positions st[s].. (a chunk at 0: st 0; in the middle of a
 * context; a decode token among them: n 1), over a scattered block table of
 * block size bs. The cache holds random entries (bf16, or e4m3 bytes of
 * moderate magnitude) written straight into it, which the references read
 * as stored. Checked against a double reference on a sample of the tokens
 * (every token when the step is small; each sequence's first and last
 * always) and against cuda_mla_attention (the SIMT kernel) on every row;
 * the output starts poisoned (NaN), so a row never written fails. With
 * use_sel, the indexer's choice: token t attends keys j % 3 == 0 and its own,
 * except every key where t % 5 == 0 (nsel -1) and none where t % 7 == 3
 * (nsel 0: output 0). One line per case. */
static void pf_case(const char *what, int H, int R, bool kv8, int bs, int nseq, const int *st, const int *n,
                    bool use_sel)
{
    int C = 512, Dn = 32, W = C + R, Dq = Dn + R, T = 0, nbt = 0;
    int *off = malloc((size_t)nseq * sizeof(int)), *first = malloc((size_t)nseq * sizeof(int));
    for (int s = 0; s < nseq; s++) {
        off[s] = nbt, first[s] = T;
        nbt += (st[s] + n[s] + bs - 1) / bs;
        T += n[s];
    }
    int NB = nbt + 1;
    int32_t *bt = scrambled_bt(nbt, NB, 5);
    size_t es = kv8 ? 1 : 2, cache_n = (size_t)NB * bs * W;
    uint8_t *craw;
    float *cache;
    random_cache(cache_n, kv8, &craw, &cache);
    int32_t *pos = malloc((size_t)T * 4), *tbt = malloc((size_t)T * 4);
    int *seq = malloc((size_t)T * sizeof(int));
    for (int s = 0, t = 0; s < nseq; s++)
        for (int i = 0; i < n[s]; i++, t++) pos[t] = st[s] + i, tbt[t] = off[s], seq[t] = s;
    int maxk = 0; /* keys of the longest sequence: sel's row stride */
    for (int s = 0; s < nseq; s++) maxk = st[s] + n[s] > maxk ? st[s] + n[s] : maxk;
    int32_t *sel = malloc((size_t)T * maxk * 4), *nsel = malloc((size_t)T * 4);
    for (int t = 0; t < T; t++) {
        int m = 0;
        for (int j = 0; j <= pos[t]; j++)
            if (j % 3 == 0 || j == pos[t]) sel[(size_t)t * maxk + m++] = j;
        nsel[t] = t % 5 == 0 ? -1 : t % 7 == 3 ? 0 : m;
    }
    float *qlat = malloc((size_t)T * H * C * 4), *q = malloc((size_t)T * H * Dq * 4);
    for (size_t i = 0; i < (size_t)T * H * C; i++) qlat[i] = frand();
    for (size_t i = 0; i < (size_t)T * H * Dq; i++) q[i] = frand();
    float scale = 0.3f;
    void *dcache = dup_dev(craw, cache_n * es);
    float *dqlat = dup_dev(qlat, (size_t)T * H * C * 4), *dq = dup_dev(q, (size_t)T * H * Dq * 4);
    int32_t *dpos = dup_dev(pos, (size_t)T * 4), *dtbt = dup_dev(tbt, (size_t)T * 4);
    int32_t *dbt = dup_dev(bt, (size_t)nbt * 4);
    int32_t *dsel = dup_dev(sel, (size_t)T * maxk * 4), *dnsel = dup_dev(nsel, (size_t)T * 4);
    uint16_t *dpf = poisoned((size_t)T * H * C * 2), *dsimt = poisoned((size_t)T * H * C * 2);
    size_t pbytes = cuda_mla_attn_part_bytes(T, H, C, R);
    float *dpart = pbytes ? poisoned(pbytes) : NULL;
    struct cuda_mla_attn_args aa = {.qlat = dqlat, .q = dq, .cache = dcache, .pos = dpos, .tok_bt = dtbt, .bt = dbt,
                                    .sel = use_sel ? dsel : NULL, .nsel = use_sel ? dnsel : NULL, .olat = dpf,
                                    .part = dpart, .T = T, .H = H, .Dn = Dn, .R = R, .C = C, .W = W, .K = maxk,
                                    .block_size = bs, .scale = scale, .kv8 = kv8};
    bool fits = cuda_mla_prefill_ok(&aa);
    cudaError_t e1 = cuda_mla_prefill(&aa, 0);
    aa.olat = dsimt;
    cudaError_t e2 = cuda_mla_attention(&aa, 0);
    cudaError_t e3 = cudaDeviceSynchronize();
    size_t no = (size_t)T * H * C;
    uint16_t *opf = malloc(no * 2), *osimt = malloc(no * 2);
    get(opf, dpf, no * 2);
    get(osimt, dsimt, no * 2);
    /* every row against the SIMT kernel */
    float *of = malloc(no * 4);
    double *od = malloc(no * 8);
    for (size_t i = 0; i < no; i++) of[i] = fb(opf[i]), od[i] = fb(osimt[i]);
    double e_simt = nerr(of, od, no);
    /* a sample of the tokens against the double reference, about 1e9 multiply-adds */
    double cost = 0;
    for (int t = 0; t < T; t++) cost += (double)H * (use_sel && nsel[t] >= 0 ? nsel[t] : pos[t] + 1) * (2 * C + R);
    int stride = cost > 1e9 ? (int)ceil(cost / 1e9) : 1, nc = 0;
    int *ck = malloc((size_t)T * sizeof(int));
    for (int t = 0; t < T; t++) {
        int s = seq[t];
        if (t % stride == 0 || t == first[s] || t == first[s] + n[s] - 1) ck[nc++] = t;
    }
    float *og = malloc((size_t)nc * H * C * 4);
    double *ref = calloc((size_t)nc * H * C, sizeof(double)), *sc = malloc((size_t)maxk * 8);
    int *kl = malloc((size_t)maxk * sizeof(int));
    for (int ci = 0; ci < nc; ci++) {
        int t = ck[ci], s = seq[t], nk = 0;
        if (use_sel && nsel[t] >= 0)
            for (nk = 0; nk < nsel[t]; nk++) kl[nk] = sel[(size_t)t * maxk + nk];
        else
            for (nk = 0; nk <= pos[t]; nk++) kl[nk] = nk;
        for (int i = 0; i < H * C; i++) og[(size_t)ci * H * C + i] = fb(opf[(size_t)t * H * C + i]);
        for (int h = 0; h < H && nk > 0; h++) { /* no key: 0 */
            const float *ql = qlat + ((size_t)t * H + h) * C, *qr = q + ((size_t)t * H + h) * Dq + Dn;
            double mx = -INFINITY, sum = 0;
            for (int i = 0; i < nk; i++) {
                int j = kl[i];
                const float *e = cache + ((size_t)bt[off[s] + j / bs] * bs + j % bs) * W;
                double d = 0;
                for (int c = 0; c < C; c++) d += (double)ql[c] * e[c];
                for (int c = 0; c < R; c++) d += (double)qr[c] * e[C + c];
                sc[i] = d * scale;
                mx = sc[i] > mx ? sc[i] : mx;
            }
            for (int i = 0; i < nk; i++) sum += sc[i] = exp(sc[i] - mx);
            double *r = ref + ((size_t)ci * H + h) * C;
            for (int i = 0; i < nk; i++) {
                int j = kl[i];
                const float *e = cache + ((size_t)bt[off[s] + j / bs] * bs + j % bs) * W;
                for (int c = 0; c < C; c++) r[c] += sc[i] / sum * e[c];
            }
        }
    }
    double e_ref = nerr(og, ref, (size_t)nc * H * C);
    bool ok = fits && e1 == cudaSuccess && e2 == cudaSuccess && e3 == cudaSuccess && e_ref < 1e-2 && e_simt < 1e-2;
    printf("  %s prefill %s: H=%d R=%d %s bs=%d T=%d, keys up to %d%s%s: vs reference %.2e (%d tokens), vs "
           "attn_kernel %.2e\n",
           ok ? "ok  " : "FAIL", what, H, R, kv8 ? "fp8" : "bf16", bs, T, maxk, use_sel ? ", the indexer's choice" : "",
           cuda_tuning.mla_prefill_rows == 32 ? ", 32 rows a block" : "", e_ref, nc, e_simt);
    CHECKF(fits, "%s: cuda_mla_prefill_ok refused the shape", what);
    CHECKF(e1 == cudaSuccess && e2 == cudaSuccess && e3 == cudaSuccess, "%s: %s / %s / %s", what,
           cudaGetErrorString(e1), cudaGetErrorString(e2), cudaGetErrorString(e3));
    CHECKF(e_ref < 1e-2, "%s: vs reference %.3g", what, e_ref);
    CHECKF(e_simt < 1e-2, "%s: vs attn_kernel %.3g", what, e_simt);
    cudaFree(dcache), cudaFree(dqlat), cudaFree(dq), cudaFree(dpos), cudaFree(dtbt), cudaFree(dbt), cudaFree(dpf);
    cudaFree(dsimt), cudaFree(dpart), cudaFree(dsel), cudaFree(dnsel);
    free(sel), free(nsel), free(kl);
    free(off), free(first), free(bt), free(craw), free(cache), free(pos), free(tbt), free(seq), free(qlat), free(q);
    free(opf), free(osimt), free(of), free(od), free(ck), free(og), free(ref), free(sc);
}

static void test_prefill(void)
{
    static const int s0[] = {0}, n0[] = {77};                       /* a chunk at 0, 77 tokens */
    static const int s1[] = {1000, 0, 500}, n1[] = {300, 45, 1};      /* mid-context, at 0, a decode token */
    static const int s2[] = {37, 0, 200, 64}, n2[] = {130, 5, 1, 3}; /* one head: a block spans many tokens */
    static const int s3[] = {300, 0}, n3[] = {20, 9};                /* 128 heads: a token over two blocks */
    static const int s4[] = {4000}, n4[] = {500};                    /* several thousand keys */
    cudaGetLastError();
    pf_case("chunk at 0", 16, 64, false, 16, 1, s0, n0, false);
    pf_case("three sequences", 16, 64, false, 64, 3, s1, n1, false);
    pf_case("three sequences", 16, 64, true, 16, 3, s1, n1, false);
    pf_case("one head", 1, 64, false, 16, 4, s2, n2, false);
    pf_case("one head", 1, 64, true, 64, 4, s2, n2, false);
    pf_case("128 heads", 128, 64, false, 64, 2, s3, n3, false);
    pf_case("128 heads", 128, 64, true, 16, 2, s3, n3, false);
    pf_case("no rope", 16, 0, false, 16, 3, s1, n1, false);
    pf_case("long context", 16, 64, false, 64, 1, s4, n4, false);
    pf_case("long context", 16, 64, true, 16, 1, s4, n4, false);
    pf_case("three sequences", 16, 64, false, 16, 3, s1, n1, true);
    pf_case("64 heads", 64, 64, true, 64, 2, s3, n3, true);
    /* sm_89's configuration (32 rows a block, one key stage) on any GPU */
    int rows = cuda_tuning.mla_prefill_rows;
    cuda_tuning.mla_prefill_rows = 32;
    pf_case("three sequences", 16, 64, false, 16, 3, s1, n1, false);
    pf_case("three sequences", 16, 64, true, 64, 3, s1, n1, false);
    pf_case("one head", 1, 64, false, 64, 4, s2, n2, false);
    pf_case("128 heads", 128, 64, true, 64, 2, s3, n3, false);
    pf_case("three sequences", 16, 64, true, 16, 3, s1, n1, true);
    cuda_tuning.mla_prefill_rows = rows;
}

/* The expanded form (cuda_mla_xplan, cuda_mla_xq, cuda_mla_xrun: the
 * gather, the up-projections, the GQA tensor-core kernel over the scratch)
 * over one step of nseq sequences: sequence s has st[s] keys cached, n[s]
 * query tokens at positions st[s].., and a prompt of np[s] tokens, so its
 * tokens at positions below np[s] take the expanded form and the rest the
 * absorbed one (a chunk wholly in the prompt, one that runs past it, a
 * token past it). The cache holds random entries (bf16, or e4m3 bytes of
 * moderate magnitude) over a scattered block table of block size bs;
 * kv_b and the queries are random. The expanded tokens' output is checked
 * against a double reference of the expanded form over the stored entries
 * and against the absorbed form (cuda_mla_attention's latent sums through
 * W_V in double); the absorbed tokens' rows must stay as poisoned (the
 * expanded form writes only its own). rows: the scratch's rows (0: the
 * longest context's), few enough to take several groups; qrows: tokens an
 * attention item (64 or 128). The plan's split of short chunks' keys over
 * blocks is taken where the items do not fill the GPU. Then the absorbed
 * tokens' gather (cuda_mla_compact) and the scatter of rows back
 * (cuda_mla_scatter), exactly. */
static void x_case(const char *what, int H, int C, int Dn, int R, int Dv, bool kv8, int bs, int nseq, const int *st,
                   const int *n, const int *np, int rows, int qrows)
{
    int W = C + R, Dq = Dn + R, WK = Dn + Dv, T = 0, nbt = 0, DK = 0, DV = 0;
    CHECKF(cuda_attention_tc_pair(Dq, Dv, &DK, &DV), "%s: no kernel for keys %d, values %d", what, Dq, Dv);
    if (!DK) return;
    int *off = malloc((size_t)nseq * sizeof(int)), *first = malloc((size_t)nseq * sizeof(int)), maxk = 0;
    for (int s = 0; s < nseq; s++) {
        off[s] = nbt, first[s] = T;
        nbt += (st[s] + n[s] + bs - 1) / bs;
        T += n[s];
        maxk = st[s] + n[s] > maxk ? st[s] + n[s] : maxk;
    }
    if (!rows) rows = (maxk + CUDA_MLA_XBS - 1) / CUDA_MLA_XBS * CUDA_MLA_XBS;
    int NB = nbt + 1;
    int32_t *bt = scrambled_bt(nbt, NB, 5);
    size_t es = kv8 ? 1 : 2, cache_n = (size_t)NB * bs * W;
    uint8_t *craw;
    float *cache;
    random_cache(cache_n, kv8, &craw, &cache);
    /* kv_b [H (Dn + Dv)][C] bf16, scaled so that K and V stay near 1 */
    size_t nw = (size_t)H * WK * C;
    uint16_t *kvb = malloc(nw * 2);
    float *kvbf = malloc(nw * 4), wsc = 2.0f / sqrtf((float)C);
    for (size_t i = 0; i < nw; i++) kvb[i] = bf(wsc * frand()), kvbf[i] = fb(kvb[i]);
    int32_t *pos = malloc((size_t)T * 4);
    int *seq = malloc((size_t)T * sizeof(int));
    struct cuda_mla_xin *in = malloc((size_t)nseq * sizeof *in);
    for (int s = 0, t = 0; s < nseq; s++) {
        in[s] = (struct cuda_mla_xin){.query_start = t, .query_len = n[s], .context_len = st[s] + n[s],
                                      .n_prompt = np[s], .bt0 = off[s]};
        for (int i = 0; i < n[s]; i++, t++) pos[t] = st[s] + i, seq[t] = s;
    }
    float *q = malloc((size_t)T * H * Dq * 4);
    for (size_t i = 0; i < (size_t)T * H * Dq; i++) q[i] = frand();
    float scale = 1.0f / sqrtf((float)Dq);
    /* the plan, as the backend makes it (its step buffer here a host copy of the device region) */
    int dev = 0, n_sm = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev);
    size_t pbytes = (size_t)T * H * CUDA_ATTN_MAXSPLIT * (DV + 2) * 4;
    struct cuda_mla_xplan p = {.rows = rows, .H = H, .DK = DK, .DV = DV, .Dn = Dn, .R = R, .Dv = Dv, .qrows = qrows,
                               .n_sm = n_sm, .max_tokens = T, .max_seqs = nseq,
                               .max_items = 2 * ((T + qrows - 1) / qrows + nseq) + 2 * n_sm + 64,
                               .part_bytes = pbytes, .comp_bytes = (size_t)rows * H * (DK + DV) * 2};
    p.g = malloc((size_t)nseq * sizeof *p.g), p.src = malloc((size_t)nseq * sizeof *p.src);
    size_t xb = cuda_mla_xbytes(T, nseq, p.max_items);
    uint8_t *hx = calloc(1, xb), *dx = dup_dev(NULL, xb);
    struct cuda_mla_xdev hd = cuda_mla_xdev_at(hx, T, nseq), dd = cuda_mla_xdev_at(dx, T, nseq);
    bool planned = cuda_mla_xplan(&p, in, nseq, pos, T, &hd);
    cudaMemcpy(dx, hx, xb, cudaMemcpyHostToDevice);
    bool *xt = calloc((size_t)T, 1); /* the tokens the expanded form takes */
    int te = 0, ns_max = 0;
    for (int t = 0; t < T; t++) {
        xt[t] = pos[t] < np[seq[t]];
        te += xt[t];
        ns_max = hd.tok_nsplit[t] > ns_max ? hd.tok_nsplit[t] : ns_max;
    }
    bool plan_ok = planned && p.Te == te && p.Ta == T - te;
    for (int i = 0, t = 0; i < p.Ta && plan_ok; i++, t++) {
        while (t < T && xt[t]) t++;
        plan_ok = hd.aidx[i] == t;
    }
    /* the device side */
    void *dcache = dup_dev(craw, cache_n * es);
    uint16_t *dkvb = dup_dev(kvb, nw * 2);
    float *dq = dup_dev(q, (size_t)T * H * Dq * 4), *dpart = poisoned(pbytes);
    int32_t *dpos = dup_dev(pos, (size_t)T * 4), *dbt = dup_dev(bt, (size_t)nbt * 4);
    int32_t *iota = malloc((size_t)rows / CUDA_MLA_XBS * 4);
    for (int i = 0; i < rows / CUDA_MLA_XBS; i++) iota[i] = i;
    int32_t *diota = dup_dev(iota, (size_t)rows / CUDA_MLA_XBS * 4);
    uint16_t *dlat = poisoned((size_t)rows * C * 2), *dk = poisoned((size_t)rows * H * DK * 2);
    uint16_t *dv = poisoned((size_t)rows * H * DV * 2), *dxq = poisoned((size_t)T * H * DK * 2);
    uint16_t *dout = poisoned((size_t)T * H * Dv * 2);
    cublasHandle_t blas = NULL;
    bool run_ok = cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS && cuda_attention_prepare_pair(DK, DV) == cudaSuccess &&
                  cuda_mla_xq(dq, T, H, Dq, DK, dxq, 0) == cudaSuccess;
    char err[256] = "";
    for (int gi = 0; gi < p.n_groups && run_ok && planned; gi++) {
        const struct cuda_mla_xgroup *g = &p.g[gi];
        struct cuda_mla_xrun_args xr = {
            .g = {.cache = dcache, .bt = dbt, .seqs = dd.seqs + g->seq0, .n_seqs = g->nseq, .max_n = g->max_n,
                  .C = C, .R = R, .W = W, .Dn = Dn, .H = H, .DK = DK, .block_size = bs, .kv8 = kv8, .lat = dlat,
                  .k = dk, .v = dv, .Dv = Dv, .DV = DV},
            .kv_b = dkvb, .rows = g->rows,
            .at = {.q = dxq, .kc = dk, .vc = dv, .pos = dpos, .bt = diota, .items = dd.items + g->item0,
                   .n_items = dd.n_items + gi, .max_items = g->nitem, .max_rows = qrows, .H = H, .KVH = H, .D = DK,
                   .block_size = CUDA_MLA_XBS, .scale = scale, .part = dpart, .pstride = p.pstride,
                   .tok_part = dd.tok_part, .tok_nsplit = dd.tok_nsplit, .T = T, .out = dout, .Dv = DV, .Do = Dv},
        };
        run_ok = !cuda_mla_xrun(blas, &xr, 0, err, sizeof err);
    }
    /* the absorbed form of the same tokens: q_lat = W_K^T q_nope (host), the latent sums (SIMT kernel), W_V */
    float *qlat = malloc((size_t)T * H * C * 4);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++)
            for (int c = 0; c < C; c++) {
                double d = 0;
                for (int e = 0; e < Dn; e++) d += (double)q[((size_t)t * H + h) * Dq + e] * kvbf[((size_t)h * WK + e) * C + c];
                qlat[((size_t)t * H + h) * C + c] = (float)d;
            }
    float *dqlat = dup_dev(qlat, (size_t)T * H * C * 4);
    int32_t *tbt = malloc((size_t)T * 4);
    for (int t = 0; t < T; t++) tbt[t] = off[seq[t]];
    int32_t *dtbt = dup_dev(tbt, (size_t)T * 4);
    uint16_t *dolat = poisoned((size_t)T * H * C * 2);
    size_t apb = cuda_mla_attn_part_bytes(T, H, C, R);
    float *dapart = apb ? poisoned(apb) : NULL;
    struct cuda_mla_attn_args aa = {.qlat = dqlat, .q = dq, .cache = dcache, .pos = dpos, .tok_bt = dtbt, .bt = dbt,
                                    .olat = dolat, .part = dapart, .T = T, .H = H, .Dn = Dn, .R = R, .C = C, .W = W,
                                    .block_size = bs, .scale = scale, .kv8 = kv8};
    cudaError_t e1 = cuda_mla_attention(&aa, 0), e2 = cudaDeviceSynchronize();
    uint16_t *out = malloc((size_t)T * H * Dv * 2), *olat = malloc((size_t)T * H * C * 2);
    get(out, dout, (size_t)T * H * Dv * 2);
    get(olat, dolat, (size_t)T * H * C * 2);
    /* the references over the expanded tokens; the others' rows untouched */
    size_t no = (size_t)te * H * Dv;
    float *og = malloc((no ? no : 1) * 4);
    double *ref = calloc(no ? no : 1, sizeof(double)), *rab = calloc(no ? no : 1, sizeof(double));
    double *kx = malloc((size_t)maxk * H * Dn * 8), *vx = malloc((size_t)maxk * H * Dv * 8), *sc = malloc((size_t)maxk * 8);
    bool untouched = true;
    for (int t = 0; t < T; t++)
        if (!xt[t])
            for (int i = 0; i < H * Dv; i++) untouched &= isnan(fb(out[(size_t)t * H * Dv + i]));
    for (int s = 0, ci = 0; s < nseq; s++) {
        int nk = 0; /* keys through the sequence's last expanded token */
        for (int t = first[s]; t < first[s] + n[s]; t++)
            if (xt[t]) nk = pos[t] + 1;
        for (int j = 0; j < nk; j++) {
            const float *e = cache + ((size_t)bt[off[s] + j / bs] * bs + j % bs) * W;
            for (int h = 0; h < H; h++) {
                for (int d = 0; d < Dn; d++) {
                    double a = 0;
                    for (int c = 0; c < C; c++) a += (double)e[c] * kvbf[((size_t)h * WK + d) * C + c];
                    kx[((size_t)j * H + h) * Dn + d] = a;
                }
                for (int d = 0; d < Dv; d++) {
                    double a = 0;
                    for (int c = 0; c < C; c++) a += (double)e[c] * kvbf[((size_t)h * WK + Dn + d) * C + c];
                    vx[((size_t)j * H + h) * Dv + d] = a;
                }
            }
        }
        for (int t = first[s]; t < first[s] + n[s]; t++) {
            if (!xt[t]) continue;
            for (int h = 0; h < H; h++, ci++) {
                const float *qh = q + ((size_t)t * H + h) * Dq;
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j <= pos[t]; j++) {
                    const float *e = cache + ((size_t)bt[off[s] + j / bs] * bs + j % bs) * W;
                    double d = 0;
                    for (int c = 0; c < Dn; c++) d += (double)qh[c] * kx[((size_t)j * H + h) * Dn + c];
                    for (int c = 0; c < R; c++) d += (double)qh[Dn + c] * e[C + c];
                    sc[j] = d * scale;
                    mx = sc[j] > mx ? sc[j] : mx;
                }
                for (int j = 0; j <= pos[t]; j++) sum += sc[j] = exp(sc[j] - mx);
                double *r = ref + (size_t)ci * Dv, *ra = rab + (size_t)ci * Dv;
                for (int j = 0; j <= pos[t]; j++)
                    for (int d = 0; d < Dv; d++) r[d] += sc[j] / sum * vx[((size_t)j * H + h) * Dv + d];
                const uint16_t *ol = olat + ((size_t)t * H + h) * C;
                for (int d = 0; d < Dv; d++) {
                    double a = 0;
                    for (int c = 0; c < C; c++) a += (double)fb(ol[c]) * kvbf[((size_t)h * WK + Dn + d) * C + c];
                    ra[d] = a;
                }
                for (int d = 0; d < Dv; d++) og[(size_t)ci * Dv + d] = fb(out[((size_t)t * H + h) * Dv + d]);
            }
        }
    }
    double e_ref = no ? nerr(og, ref, no) : 0, e_abs = no ? nerr(og, rab, no) : 0;
    /* the absorbed tokens' gather and the scatter back, exactly */
    bool comp_ok = true;
    if (p.Ta > 0) {
        size_t cb = cuda_mla_comp_bytes(p.Ta, H, Dq, Dn, Dv);
        void *dc = poisoned(cb);
        struct cuda_mla_comp cp = cuda_mla_comp_at(dc, p.Ta, H, Dq, Dn, Dv);
        uint16_t *qn = malloc((size_t)T * H * Dn * 2);
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++)
                for (int d = 0; d < Dn; d++) qn[((size_t)t * H + h) * Dn + d] = bf(q[((size_t)t * H + h) * Dq + d]);
        uint16_t *dqn = dup_dev(qn, (size_t)T * H * Dn * 2);
        uint16_t *rowsrc = malloc((size_t)p.Ta * H * Dv * 2);
        for (size_t i = 0; i < (size_t)p.Ta * H * Dv; i++) rowsrc[i] = bf(frand());
        uint16_t *drow = dup_dev(rowsrc, (size_t)p.Ta * H * Dv * 2);
        comp_ok = cuda_mla_compact(dd.aidx, p.Ta, dq, dqn, dpos, dtbt, H, Dq, Dn, &cp, 0) == cudaSuccess &&
                  cuda_mla_scatter(dd.aidx, p.Ta, drow, H * Dv, dout, 0) == cudaSuccess &&
                  cudaDeviceSynchronize() == cudaSuccess;
        float *cq = malloc((size_t)p.Ta * H * Dq * 4);
        uint16_t *cqn = malloc((size_t)p.Ta * H * Dn * 2);
        int32_t *cpos = malloc((size_t)p.Ta * 4), *ctbt = malloc((size_t)p.Ta * 4);
        get(cq, cp.q, (size_t)p.Ta * H * Dq * 4);
        get(cqn, cp.qn, (size_t)p.Ta * H * Dn * 2);
        get(cpos, cp.pos, (size_t)p.Ta * 4);
        get(ctbt, cp.tok_bt, (size_t)p.Ta * 4);
        get(out, dout, (size_t)T * H * Dv * 2);
        for (int i = 0; i < p.Ta && comp_ok; i++) {
            int t = hd.aidx[i];
            comp_ok = !memcmp(cq + (size_t)i * H * Dq, q + (size_t)t * H * Dq, (size_t)H * Dq * 4) &&
                      !memcmp(cqn + (size_t)i * H * Dn, qn + (size_t)t * H * Dn, (size_t)H * Dn * 2) &&
                      cpos[i] == pos[t] && ctbt[i] == tbt[t] &&
                      !memcmp(out + (size_t)t * H * Dv, rowsrc + (size_t)i * H * Dv, (size_t)H * Dv * 2);
        }
        cudaFree(dc), cudaFree(dqn), cudaFree(drow);
        free(qn), free(rowsrc), free(cq), free(cqn), free(cpos), free(ctbt);
    }
    double tol = 2e-2;
    bool ok = plan_ok && run_ok && e1 == cudaSuccess && e2 == cudaSuccess && untouched && comp_ok && e_ref < tol &&
              e_abs < tol;
    printf("  %s expanded %s: H=%d C=%d Dn=%d R=%d Dv=%d (kernel %d/%d) %s bs=%d T=%d (%d expanded), keys up to %d, "
           "%d group%s, %d-token items%s: vs reference %.2e, vs absorbed %.2e\n",
           ok ? "ok  " : "FAIL", what, H, C, Dn, R, Dv, DK, DV, kv8 ? "fp8" : "bf16", bs, T, te, maxk, p.n_groups,
           p.n_groups == 1 ? "" : "s", qrows, ns_max > 1 ? ", keys split" : "", e_ref, e_abs);
    CHECKF(plan_ok, "%s: the plan (%d expanded, %d absorbed; want %d, %d)", what, p.Te, p.Ta, te, T - te);
    CHECKF(run_ok, "%s: %s", what, err[0] ? err : "setup failed");
    CHECKF(e1 == cudaSuccess && e2 == cudaSuccess, "%s: %s / %s", what, cudaGetErrorString(e1), cudaGetErrorString(e2));
    CHECKF(untouched, "%s: an absorbed token's row was written", what);
    CHECKF(comp_ok, "%s: the absorbed tokens' gather or scatter", what);
    CHECKF(e_ref < tol, "%s: vs reference %.3g", what, e_ref);
    CHECKF(e_abs < tol, "%s: vs absorbed %.3g", what, e_abs);
    if (blas) cublasDestroy(blas);
    cudaFree(dx), cudaFree(dcache), cudaFree(dkvb), cudaFree(dq), cudaFree(dpart), cudaFree(dpos), cudaFree(dbt);
    cudaFree(diota), cudaFree(dlat), cudaFree(dk), cudaFree(dv), cudaFree(dxq), cudaFree(dout), cudaFree(dqlat);
    cudaFree(dtbt), cudaFree(dolat), cudaFree(dapart);
    free(off), free(first), free(bt), free(craw), free(cache), free(kvb), free(kvbf), free(pos), free(seq), free(in);
    free(q), free(p.g), free(p.src), free(hx), free(xt), free(iota), free(qlat), free(tbt), free(out), free(olat);
    free(og), free(ref), free(rab), free(kx), free(vx), free(sc);
}

static void test_expanded(void)
{
    /* a chunk mid-context wholly in its prompt, a first chunk, a decode token, a chunk past its prompt */
    static const int s1[] = {600, 0, 300, 200}, n1[] = {200, 45, 1, 100}, p1[] = {800, 45, 300, 250};
    static const int s2[] = {2000}, n2[] = {20}, p2[] = {2020}; /* a short chunk deep in: keys split */
    static const int s3[] = {100, 0, 37}, n3[] = {130, 77, 5}, p3[] = {230, 77, 42};
    cudaGetLastError();
    x_case("four sequences", 16, 512, 128, 64, 128, false, 16, 4, s1, n1, p1, 0, 128);
    x_case("four sequences", 16, 512, 128, 64, 128, true, 64, 4, s1, n1, p1, 0, 128);
    x_case("four sequences", 16, 512, 128, 64, 128, false, 64, 4, s1, n1, p1, 0, 64);
    x_case("two groups", 16, 512, 128, 64, 128, true, 16, 4, s1, n1, p1, 832, 128);
    x_case("deep short chunk", 2, 512, 128, 64, 128, false, 16, 1, s2, n2, p2, 0, 128);
    x_case("deep short chunk", 2, 512, 128, 64, 128, true, 16, 1, s2, n2, p2, 0, 64);
    x_case("small heads", 4, 32, 16, 8, 12, false, 16, 3, s3, n3, p3, 0, 128);
    x_case("small heads", 4, 32, 16, 8, 12, true, 16, 3, s3, n3, p3, 256, 64);
    x_case("no rope", 4, 32, 16, 0, 12, false, 16, 3, s3, n3, p3, 0, 128);
}

/* The DSA indexer over one sequence of n tokens, in one step or in the steps
 * of `steps` (token counts summing to n, 0-terminated: a prefill chunk,
 * decode steps at every offset inside a pool, steps that start inside a pool
 * and complete one or two; each step's keys written, then its queries score
 * keys 0..pos, so a pool completed later in the same step is no query's
 * before it): the entries' keys against a double LayerNorm + RoPE, the
 * scores against a double reference over the stored keys, and the choice
 * exactly against the K best of the GPU's own scores (ties to the earlier
 * position; tokens 3k+1 repeat token 3k's key, so ties are there to break).
 * The cache starts poisoned (NaN), so a pool read before its tokens are
 * written fails the scores. */
#define IX_KPMAX 64 /* the most keys a pool these tests take */

/* A pool key's dimension d, in double (cpu_mla.c's pool_keys): a softmax
 * over the pool's KP gate values plus ape, weighting its KP keys; gate[i]
 * and key[i] are the pool's token i's values in that dimension. */
static double ref_pool_dim(const double *gate, const double *key, const float *ape, int KP, int ID, int d)
{
    double mx = -INFINITY, sum = 0, v = 0;
    for (int i = 0; i < KP; i++) mx = fmax(mx, gate[i] + ape[i * ID + d]);
    for (int i = 0; i < KP; i++) sum += exp(gate[i] + ape[i * ID + d] - mx);
    for (int i = 0; i < KP; i++) v += exp(gate[i] + ape[i * ID + d] - mx) / sum * key[i];
    return v;
}

/* The same from a paged cache (bf16 or e4m3 entries of W values): the pool
 * of the KP tokens from position p0 of a sequence with block table bt,
 * their keys at offset k0 of an entry and their gates ID after. */
static double ix_pool_dim(const uint8_t *craw, bool kv8, const int32_t *bt, int bs, int p0, int W, int k0, int ID,
                          const float *ape, int KP, int d)
{
    double gv[IX_KPMAX], kv[IX_KPMAX];
    for (int i = 0; i < KP; i++) {
        int p = p0 + i;
        size_t e = ((size_t)bt[p / bs] * bs + p % bs) * W + k0 + d;
        kv[i] = kv8 ? e4m3(craw[e]) : fb(((const uint16_t *)craw)[e]);
        gv[i] = kv8 ? e4m3(craw[e + ID]) : fb(((const uint16_t *)craw)[e + ID]);
    }
    return ref_pool_dim(gv, kv, ape, KP, ID, d);
}

static void ix_case(int n, int K, int IH, int ID, int R, int KP, bool tail, bool kv8, const int *steps)
{
    enum { BS = 16 };
    int C = 32, W = C + R + ID * (KP ? 2 : 1), X = 64, half = R / 2, nb = (n + BS - 1) / BS, KS = K + KP;
    int want = KP ? K / KP : K;
    CHECK(KP <= IX_KPMAX);
    int32_t bt[8] = {6, 1, 4, 0, 7, 2, 5, 3};
    size_t es = kv8 ? 1 : 2, cache_n = (size_t)9 * BS * W;
    float *cs = malloc((size_t)X * half * 4 + 4), *sn = malloc((size_t)X * half * 4 + 4);
    for (int p = 0; p < X; p++)
        for (int i = 0; i < half; i++) {
            float ang = (float)p * powf(10000.0f, -2.0f * i / (float)R);
            cs[p * half + i] = cosf(ang), sn[p * half + i] = sinf(ang);
        }
    int32_t *pos = malloc((size_t)n * 4), *tbt = calloc((size_t)n, 4), *sel = malloc((size_t)n * KS * 4),
            *nsel = malloc((size_t)n * 4);
    int64_t *slots = malloc((size_t)n * 8);
    float *q = malloc((size_t)n * IH * ID * 4), *k = malloc((size_t)n * ID * 4), *w = malloc((size_t)n * IH * 4);
    float *kn = malloc((size_t)ID * 4), *kb = malloc((size_t)ID * 4), *g = malloc((size_t)n * ID * 4),
          *ape = malloc((size_t)(KP ? KP : 1) * ID * 4);
    for (int i = 0; i < n * ID; i++) g[i] = 2.0f * frand();
    for (int i = 0; i < (KP ? KP : 1) * ID; i++) ape[i] = frand();
    for (int t = 0; t < n; t++) pos[t] = t, slots[t] = (int64_t)bt[t / BS] * BS + t % BS;
    for (int i = 0; i < n * IH * ID; i++) q[i] = frand();
    for (int i = 0; i < n * ID; i++) k[i] = 2.0f * frand();
    for (int t = 1; t < n; t += 3) memcpy(k + (size_t)t * ID, k + (size_t)(t - 1) * ID, (size_t)ID * 4);
    for (int i = 0; i < n * IH; i++) w[i] = frand();
    for (int i = 0; i < ID; i++) kn[i] = 1.0f + 0.3f * frand(), kb[i] = 0.2f * frand();
    /* host copies of the inputs the kernel rewrites in place */
    float *q0 = malloc((size_t)n * IH * ID * 4), *w0 = malloc((size_t)n * IH * 4);
    memcpy(q0, q, (size_t)n * IH * ID * 4), memcpy(w0, w, (size_t)n * IH * 4);
    void *dcache = poisoned(cache_n * es);
    float *dq = dup_dev(q, (size_t)n * IH * ID * 4), *dk = dup_dev(k, (size_t)n * ID * 4),
          *dw = dup_dev(w, (size_t)n * IH * 4), *dkn = dup_dev(kn, (size_t)ID * 4), *dkb = dup_dev(kb, (size_t)ID * 4);
    float *dcos = dup_dev(cs, (size_t)X * half * 4 + 4), *dsin = dup_dev(sn, (size_t)X * half * 4 + 4);
    float *dsc = poisoned((size_t)n * X * 4), *dg = dup_dev(g, (size_t)n * ID * 4),
          *dape = dup_dev(ape, (size_t)(KP ? KP : 1) * ID * 4);
    int32_t *dpos = dup_dev(pos, (size_t)n * 4), *dtbt = dup_dev(tbt, (size_t)n * 4), *dbt = dup_dev(bt, sizeof bt);
    int32_t *dsel = poisoned((size_t)n * KS * 4), *dnsel = poisoned((size_t)n * 4);
    int64_t *dslots = dup_dev(slots, (size_t)n * 8);
    int PB = KP ? (BS + KP - 1) / KP : 0; /* the cached pool keys: [9 blocks][PB][ID], poisoned */
    float *dpk = poisoned((size_t)9 * (PB ? PB : 1) * ID * 4);
    struct cuda_mla_ix_args ia = {.q = dq, .k = dk, .g = KP ? dg : NULL, .ape = KP ? dape : NULL, .w = dw, .kn = dkn, .kb = dkb, .cos = dcos, .sin = dsin,
                                  .pos = dpos, .tok_bt = dtbt, .bt = dbt, .slots = dslots, .cache = dcache,
                                  .scores = dsc, .sel = dsel, .nsel = dnsel, .T = n, .IH = IH, .ID = ID, .R = R,
                                  .C = C, .W = W, .K = K, .KS = KS, .max_ctx = X, .block_size = BS, .KP = KP,
                                  .want = KP ? want : 0, .tail = tail, .kv8 = kv8, .pk = KP ? dpk : NULL,
                                  .PB = PB};
    int nsteps = 0;
    for (int t0 = 0, i = 0; t0 < n; i++, nsteps++) {
        /* step i: tokens t0..t0+m-1, every per-token array from row t0 */
        int m = steps ? steps[i] : n;
        if (m <= 0 || t0 + m > n) {
            CHECKF(0, "steps do not sum to %d", n);
            break;
        }
        struct cuda_mla_ix_args sa = ia;
        sa.q = dq + (size_t)t0 * IH * ID, sa.k = dk + (size_t)t0 * ID, sa.g = KP ? dg + (size_t)t0 * ID : NULL;
        sa.w = dw + (size_t)t0 * IH, sa.pos = dpos + t0, sa.tok_bt = dtbt + t0, sa.slots = dslots + t0;
        sa.scores = dsc + (size_t)t0 * X, sa.sel = dsel + (size_t)t0 * KS, sa.nsel = dnsel + t0, sa.T = m;
        CHECK(cuda_mla_indexer(&sa, 0) == cudaSuccess);
        t0 += m;
    }
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    uint8_t *craw = malloc(cache_n * es);
    float *sc = malloc((size_t)n * X * 4), *keys = malloc((size_t)n * ID * 4), *gates = malloc((size_t)n * ID * 4);
    get(craw, dcache, cache_n * es);
    get(sc, dsc, (size_t)n * X * 4);
    get(sel, dsel, (size_t)n * KS * 4);
    get(nsel, dnsel, (size_t)n * 4);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < ID; i++) {
            size_t o = (size_t)slots[t] * W + C + R + i;
            keys[t * ID + i] = kv8 ? e4m3(craw[o]) : fb(((uint16_t *)craw)[o]);
            gates[t * ID + i] = !KP ? 0.0f : kv8 ? e4m3(craw[o + ID]) : fb(((uint16_t *)craw)[o + ID]);
        }
    /* the gate scores as stored */
    double eg = 0;
    if (KP) {
        double *gr = malloc((size_t)n * ID * 8);
        for (int i = 0; i < n * ID; i++) gr[i] = g[i];
        eg = nerr(gates, gr, (size_t)n * ID);
        free(gr);
    }
    /* the candidates' keys from the stored values: each token's, or each whole pool's */
    int np = KP ? n / KP : n;
    float *cand = malloc((size_t)np * ID * 4);
    for (int p = 0; p < np; p++)
        for (int d = 0; d < ID; d++) {
            if (!KP) {
                cand[p * ID + d] = keys[p * ID + d];
                continue;
            }
            double gv[IX_KPMAX], kv[IX_KPMAX];
            for (int i = 0; i < KP; i++) gv[i] = gates[(p * KP + i) * ID + d], kv[i] = keys[(p * KP + i) * ID + d];
            cand[p * ID + d] = (float)ref_pool_dim(gv, kv, ape, KP, ID, d);
        }
    /* the pool keys the GPU cached, each at its last token's block and offset */
    double epk = 0;
    if (KP && np > 0) {
        float *pk = malloc((size_t)9 * PB * ID * 4), *gotk = malloc((size_t)np * ID * 4);
        double *wantk = malloc((size_t)np * ID * 8);
        get(pk, dpk, (size_t)9 * PB * ID * 4);
        for (int p = 0; p < np; p++) {
            int pl = p * KP + KP - 1;
            memcpy(gotk + (size_t)p * ID, pk + ((size_t)bt[pl / BS] * PB + (pl % BS) / KP) * ID, (size_t)ID * 4);
            for (int d = 0; d < ID; d++) wantk[(size_t)p * ID + d] = cand[p * ID + d];
        }
        epk = nerr(gotk, wantk, (size_t)np * ID);
        free(pk), free(gotk), free(wantk);
    }
    /* keys: LayerNorm (biased variance) and RoPE in pairs on the first R dims */
    double *kref = malloc((size_t)n * ID * 8), *qr = malloc((size_t)IH * ID * 8), *sref = malloc((size_t)n * X * 8);
    float *sgot = malloc((size_t)n * X * 4);
    for (int t = 0; t < n; t++) {
        double m = 0, v = 0, *o = kref + (size_t)t * ID;
        for (int i = 0; i < ID; i++) m += k[t * ID + i];
        m /= ID;
        for (int i = 0; i < ID; i++) v += (k[t * ID + i] - m) * (k[t * ID + i] - m);
        double r = 1.0 / sqrt(v / ID + 1e-6);
        for (int i = 0; i < ID; i++) o[i] = (k[t * ID + i] - m) * r * kn[i] + kb[i];
        for (int i = 0; i < half; i++) {
            double c = cs[t * half + i], s2 = sn[t * half + i], u = o[2 * i], x = o[2 * i + 1];
            o[2 * i] = u * c - x * s2, o[2 * i + 1] = x * c + u * s2;
        }
    }
    double ek = nerr(keys, kref, (size_t)n * ID);
    /* scores over the stored keys, from the unrotated queries */
    size_t ns = 0;
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < IH; h++) {
            double *o = qr + (size_t)h * ID;
            for (int i = 0; i < ID; i++) o[i] = q0[((size_t)t * IH + h) * ID + i];
            for (int i = 0; i < half; i++) {
                double c = cs[t * half + i], s2 = sn[t * half + i], u = o[2 * i], x = o[2 * i + 1];
                o[2 * i] = u * c - x * s2, o[2 * i + 1] = x * c + u * s2;
            }
        }
        for (int j = 0; j < (KP ? (t + 1) / KP : t + 1); j++) {
            double v = 0;
            for (int h = 0; h < IH; h++) {
                double d = 0;
                for (int i = 0; i < ID; i++) d += qr[(size_t)h * ID + i] * cand[j * ID + i];
                d /= sqrt((double)ID);
                v += w0[(size_t)t * IH + h] / sqrt((double)IH) * (d > 0 ? d : 0);
            }
            sref[ns] = v, sgot[ns++] = sc[(size_t)t * X + j];
        }
    }
    double es2 = nerr(sgot, sref, ns);
    /* the choice: exactly the want best of the GPU's scores, ties to the earlier candidate (with k-pools
     * their tokens, then the query's own pool with tail) */
    int bad = 0, *exp_sel = malloc((size_t)KS * sizeof(int));
    for (int t = 0; t < n; t++) {
        int nv = KP ? (t + 1) / KP : t + 1, m = 0, kp = KP ? KP : 1;
        if (nv <= want && (!KP || tail)) {
            bad += nsel[t] != -1;
            continue;
        }
        const float *s = sc + (size_t)t * X;
        for (int j = 0; j < nv; j++) {
            int better = 0;
            for (int i = 0; i < nv; i++) better += s[i] > s[j] || (s[i] == s[j] && i < j);
            if (better < want || nv <= want)
                for (int i = 0; i < kp; i++) exp_sel[m++] = j * kp + i;
        }
        for (int j = nv * kp; tail && j <= t; j++) exp_sel[m++] = j;
        bad += nsel[t] != m;
        for (int i = 0; i < m && nsel[t] == m; i++) bad += sel[(size_t)t * KS + i] != exp_sel[i];
    }
    free(exp_sel);
    printf("  n=%d K=%d IH=%d ID=%d R=%d KP=%d%s %s, %d step%s: keys %.2e, gates %.2e, pool keys %.2e, scores "
           "%.2e, wrong choices %d\n",
           n, K, IH, ID, R, KP, tail ? " tail" : "", kv8 ? "fp8" : "bf16", nsteps, nsteps > 1 ? "s" : "", ek, eg, epk,
           es2, bad);
    CHECKF(epk < 1e-5, "pool keys %.3g", epk);
    CHECKF(ek < (kv8 ? 6e-2 : 5e-3), "keys %.3g", ek);
    CHECKF(eg < (kv8 ? 6e-2 : 5e-3), "gates %.3g", eg);
    CHECKF(es2 < 1e-3, "scores %.3g", es2);
    CHECKF(bad == 0, "%d wrong choices", bad);
    (void)nb;
    cudaFree(dcache), cudaFree(dq), cudaFree(dk), cudaFree(dw), cudaFree(dkn), cudaFree(dkb), cudaFree(dcos);
    cudaFree(dsin), cudaFree(dsc), cudaFree(dpos), cudaFree(dtbt), cudaFree(dbt), cudaFree(dsel), cudaFree(dnsel);
    cudaFree(dslots);
    free(cs), free(sn), free(pos), free(tbt), free(sel), free(nsel), free(slots), free(q), free(k), free(w), free(kn);
    free(kb), free(q0), free(w0), free(craw), free(sc), free(keys), free(kref), free(qr), free(sref), free(sgot);
    free(g), free(ape), free(gates), free(cand);
    cudaFree(dg), cudaFree(dape), cudaFree(dpk);
}

/* the candidates' order for a choice: a higher score first, then the earlier one */
static const float *g_ixs;
static int ix_rank(const void *a, const void *b)
{
    int i = *(const int *)a, j = *(const int *)b;
    float x = g_ixs[i], y = g_ixs[j];
    return x > y ? -1 : x < y ? 1 : (i > j) - (i < j);
}

/* The indexer as the engine drives it, at long contexts: nseq sequences of
 * len[s] prompt tokens over a scattered block table of block size bs,
 * prefilled in chunks of about `chunk` tokens (every prefilling sequence's
 * next chunk in one step, the chunks' ends inside pools: pools completed
 * across steps), then ndec decode steps of one token per sequence (T nseq:
 * T 1 with one sequence, whose scores split over many blocks). With shared
 * > 0, sequence 1 starts on sequence 0's first `shared` blocks (a prefix
 * cache hit: the same tokens, its block table pointing at them, its first
 * step after sequence 0 wrote them) and writes only its tokens after them.
 * No RoPE where R is 0, so equal inputs store equal keys: every other pool
 * (k-pools) or every third key repeats the one before (ties at the choice's
 * edge). Each checked query (every decode token; a prefill chunk's first,
 * middle and last) against a double reference of its scores over the stored
 * keys (pool keys from the stored keys and gates), and its choice exactly
 * against the best of the GPU's own scores; at the end every cached pool
 * key against the reference. */
static void ix_multi(const char *what, int IH, int ID, int R, int KP, bool tail, int K, int bs, bool kv8, int nseq,
                     const int *len, int shared, int chunk, int ndec)
{
    int C = 16, W = C + R + ID * (KP ? 2 : 1), half = R / 2, KS = K + KP, want = KP ? K / KP : K;
    CHECK(KP <= IX_KPMAX);
    int X = 0, nbt = 0, *off = malloc((size_t)nseq * sizeof(int)), *n_all = malloc((size_t)nseq * sizeof(int));
    for (int s = 0; s < nseq; s++) {
        n_all[s] = len[s] + ndec;
        X = n_all[s] + 1 > X ? n_all[s] + 1 : X;
        off[s] = nbt;
        nbt += (n_all[s] + bs - 1) / bs;
    }
    /* physical blocks: i * mul mod NB (one unused); sequence 1's first `shared` entries are sequence 0's */
    int NB = nbt + 1;
    int32_t *bt = scrambled_bt(nbt, NB, 7);
    for (int i = 0; i < shared && nseq > 1; i++) bt[off[1] + i] = bt[off[0] + i];
    int PB = KP ? (bs + KP - 1) / KP : 0;
    size_t es = kv8 ? 1 : 2, cache_n = (size_t)NB * bs * W, pk_n = (size_t)NB * (PB ? PB : 1) * ID;
    /* per sequence and position: the key and gate inputs (repeats for the ties; the shared prefix sequence 0's) */
    float **kin = malloc((size_t)nseq * sizeof(float *)), **gin = malloc((size_t)nseq * sizeof(float *));
    for (int s = 0; s < nseq; s++) {
        kin[s] = malloc((size_t)n_all[s] * ID * 4), gin[s] = malloc((size_t)n_all[s] * ID * 4);
        for (int p = 0; p < n_all[s]; p++) {
            float *k = kin[s] + (size_t)p * ID, *g = gin[s] + (size_t)p * ID;
            int src = KP ? ((p / KP) % 2 && p >= KP ? p - KP : -1) : (p % 3 == 1 ? p - 1 : -1);
            if (s == 1 && p < shared * bs) {
                memcpy(k, kin[0] + (size_t)p * ID, (size_t)ID * 4), memcpy(g, gin[0] + (size_t)p * ID, (size_t)ID * 4);
            } else if (src >= 0) {
                memcpy(k, kin[s] + (size_t)src * ID, (size_t)ID * 4), memcpy(g, gin[s] + (size_t)src * ID, (size_t)ID * 4);
            } else {
                for (int i = 0; i < ID; i++) k[i] = 2.0f * frand(), g[i] = 2.0f * frand();
            }
        }
    }
    float *cs = malloc((size_t)X * (half ? half : 1) * 4), *sn = malloc((size_t)X * (half ? half : 1) * 4);
    for (int p = 0; p < X; p++)
        for (int i = 0; i < half; i++) {
            float ang = (float)p * powf(10000.0f, -2.0f * i / (float)R);
            cs[p * half + i] = cosf(ang), sn[p * half + i] = sinf(ang);
        }
    float *kn = malloc((size_t)ID * 4), *kb = malloc((size_t)ID * 4), *ape = malloc((size_t)(KP ? KP : 1) * ID * 4);
    for (int i = 0; i < ID; i++) kn[i] = 1.0f + 0.3f * frand(), kb[i] = 0.2f * frand();
    for (int i = 0; i < (KP ? KP : 1) * ID; i++) ape[i] = frand();
    void *dcache = poisoned(cache_n * es);
    float *dpk = poisoned(pk_n * 4), *dkn = dup_dev(kn, (size_t)ID * 4), *dkb = dup_dev(kb, (size_t)ID * 4);
    float *dape = dup_dev(ape, (size_t)(KP ? KP : 1) * ID * 4);
    float *dcos = dup_dev(cs, (size_t)X * (half ? half : 1) * 4), *dsin = dup_dev(sn, (size_t)X * (half ? half : 1) * 4);
    int32_t *dbt = dup_dev(bt, (size_t)nbt * 4);
    int *done = calloc((size_t)nseq, sizeof(int)); /* tokens of each sequence in the cache */
    if (nseq > 1 && shared > 0) done[1] = shared * bs;
    int Tmax = nseq * (chunk + 37 * nseq + 32);
    int32_t *pos = malloc((size_t)Tmax * 4), *tbt = malloc((size_t)Tmax * 4), *seq = malloc((size_t)Tmax * 4);
    int32_t *nsel = malloc((size_t)Tmax * 4), *sel = malloc((size_t)KS * 4), *exp_sel = malloc((size_t)KS * 4);
    int64_t *slots = malloc((size_t)Tmax * 8);
    float *q = malloc((size_t)Tmax * IH * ID * 4), *k = malloc((size_t)Tmax * ID * 4), *g = malloc((size_t)Tmax * ID * 4);
    float *w = malloc((size_t)Tmax * IH * 4), *sgot = malloc((size_t)X * 4);
    float *dsc = poisoned((size_t)Tmax * X * 4), *dq = dup_dev(NULL, (size_t)Tmax * IH * ID * 4);
    float *dk = dup_dev(NULL, (size_t)Tmax * ID * 4), *dg = dup_dev(NULL, (size_t)Tmax * ID * 4);
    float *dw = dup_dev(NULL, (size_t)Tmax * IH * 4);
    int32_t *dpos = dup_dev(NULL, (size_t)Tmax * 4), *dtbt = dup_dev(NULL, (size_t)Tmax * 4);
    int32_t *dsel = poisoned((size_t)Tmax * KS * 4), *dnsel = poisoned((size_t)Tmax * 4);
    int64_t *dslots = dup_dev(NULL, (size_t)Tmax * 8);
    uint8_t *craw = malloc(cache_n * es);
    double *cand = malloc((size_t)X * ID * 8), *qr = malloc((size_t)IH * ID * 8), *sref = malloc((size_t)X * 8);
    int *idx = malloc((size_t)X * sizeof(int));
    uint8_t *mark = malloc((size_t)X);
    double worst_s = 0;
    int bad = 0, nchk = 0, nsteps = 0, ndec_done = 0;
#define CV(o) (kv8 ? e4m3(craw[o]) : fb(((uint16_t *)craw)[o]))
#define SLOT(s, p) ((size_t)bt[off[s] + (p) / bs] * bs + (p) % bs)
    /* sequence s's pool c's key, dimension d, from the stored keys and gates */
#define POOL_DIM(s, c, d) ix_pool_dim(craw, kv8, bt + off[s], bs, (c) * KP, W, C + R, ID, ape, KP, d)
    for (;;) {
        /* the step: each prefilling sequence's next chunk (sequence 1 once sequence 0 wrote the shared blocks),
         * or, when none prefills, one token of each sequence */
        int T = 0, pre = 0;
        for (int s = 0; s < nseq; s++) pre += done[s] < len[s];
        if (!pre && ndec_done == ndec) break;
        for (int s = 0; s < nseq; s++) {
            if (pre && (done[s] >= len[s] || (s == 1 && shared > 0 && done[0] < shared * bs))) continue;
            int m = pre ? chunk + 37 * s + 13 * (nsteps % 3) : 1; /* chunk ends at varied offsets in a pool */
            m = m < n_all[s] - done[s] ? m : n_all[s] - done[s];
            if (pre && m > len[s] - done[s]) m = len[s] - done[s];
            for (int i = 0; i < m; i++, T++) {
                int p = done[s] + i;
                pos[T] = p, seq[T] = s, tbt[T] = off[s], slots[T] = (int64_t)SLOT(s, p);
                memcpy(k + (size_t)T * ID, kin[s] + (size_t)p * ID, (size_t)ID * 4);
                memcpy(g + (size_t)T * ID, gin[s] + (size_t)p * ID, (size_t)ID * 4);
                for (int j = 0; j < IH * ID; j++) q[(size_t)T * IH * ID + j] = frand();
                for (int h = 0; h < IH; h++) w[(size_t)T * IH + h] = frand();
            }
            done[s] += m;
        }
        if (!pre) ndec_done++;
        nsteps++;
        cudaMemcpy(dq, q, (size_t)T * IH * ID * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dk, k, (size_t)T * ID * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dg, g, (size_t)T * ID * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dw, w, (size_t)T * IH * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dpos, pos, (size_t)T * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dtbt, tbt, (size_t)T * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dslots, slots, (size_t)T * 8, cudaMemcpyHostToDevice);
        struct cuda_mla_ix_args ia = {.q = dq, .k = dk, .g = KP ? dg : NULL, .ape = KP ? dape : NULL, .w = dw,
                                      .kn = dkn, .kb = dkb, .cos = dcos, .sin = dsin, .pos = dpos, .tok_bt = dtbt,
                                      .bt = dbt, .slots = dslots, .cache = dcache, .scores = dsc, .sel = dsel,
                                      .nsel = dnsel, .T = T, .IH = IH, .ID = ID, .R = R, .C = C, .W = W, .K = K,
                                      .KS = KS, .max_ctx = X, .block_size = bs, .KP = KP, .want = KP ? want : 0,
                                      .tail = tail, .kv8 = kv8, .pk = KP ? dpk : NULL, .PB = PB};
        CHECK(cuda_mla_indexer(&ia, 0) == cudaSuccess);
        CHECK(cudaDeviceSynchronize() == cudaSuccess);
        get(craw, dcache, cache_n * es);
        get(nsel, dnsel, (size_t)T * 4);
        /* the checked queries: a decode step's all, a chunk's first, middle and last */
        for (int t = 0; t < T; t++) {
            int s = seq[t], p = pos[t];
            bool first = t == 0 || seq[t - 1] != s, last = t == T - 1 || seq[t + 1] != s;
            if (pre && !first && !last && p % 500) continue;
            nchk++;
            int nv = KP ? (p + 1) / KP : p + 1, kp = KP ? KP : 1;
            /* the candidates' keys from the stored values */
            for (int c = 0; c < nv; c++)
                for (int d = 0; d < ID; d++) {
                    if (!KP) {
                        cand[(size_t)c * ID + d] = CV(SLOT(s, c) * W + C + R + d);
                        continue;
                    }
                    cand[(size_t)c * ID + d] = POOL_DIM(s, c, d);
                }
            for (int h = 0; h < IH; h++) {
                double *o = qr + (size_t)h * ID;
                for (int i = 0; i < ID; i++) o[i] = q[((size_t)t * IH + h) * ID + i];
                for (int i = 0; i < half; i++) {
                    double c2 = cs[p * half + i], s2 = sn[p * half + i], u = o[2 * i], x = o[2 * i + 1];
                    o[2 * i] = u * c2 - x * s2, o[2 * i + 1] = x * c2 + u * s2;
                }
            }
            for (int c = 0; c < nv; c++) {
                double v = 0;
                for (int h = 0; h < IH; h++) {
                    double d = 0;
                    for (int i = 0; i < ID; i++) d += qr[(size_t)h * ID + i] * cand[(size_t)c * ID + i];
                    d /= sqrt((double)ID);
                    v += w[(size_t)t * IH + h] / sqrt((double)IH) * (d > 0 ? d : 0);
                }
                sref[c] = v;
            }
            get(sgot, dsc + (size_t)t * X, (size_t)nv * 4);
            double e = nerr(sgot, sref, (size_t)nv);
            worst_s = e > worst_s ? e : worst_s;
            /* the expected choice from the GPU's scores */
            int m = 0;
            if (nv <= want && (!KP || tail)) {
                bad += nsel[t] != -1;
                continue;
            }
            if (nv <= want) {
                for (int j = 0; j < nv * kp; j++) exp_sel[m++] = j;
            } else {
                for (int c = 0; c < nv; c++) idx[c] = c, mark[c] = 0;
                g_ixs = sgot;
                qsort(idx, (size_t)nv, sizeof(int), ix_rank);
                for (int i = 0; i < want; i++) mark[idx[i]] = 1;
                for (int c = 0; c < nv; c++)
                    for (int i = 0; mark[c] && i < kp; i++) exp_sel[m++] = c * kp + i;
            }
            for (int j = nv * kp; tail && j <= p; j++) exp_sel[m++] = j;
            get(sel, dsel + (size_t)t * KS, (size_t)KS * 4);
            int wrong = nsel[t] != m;
            for (int i = 0; i < m && !wrong; i++) wrong += sel[i] != exp_sel[i];
            if (wrong && bad < 3)
                printf("    step %d token %d (sequence %d, position %d): nsel %d, want %d\n", nsteps, t, s, p, nsel[t], m);
            bad += wrong;
        }
    }
    /* every whole pool's cached key against the reference from the stored values */
    double epk = 0;
    if (KP) {
        float *pk = malloc(pk_n * 4);
        get(pk, dpk, pk_n * 4);
        for (int s = 0; s < nseq; s++) {
            int np = n_all[s] / KP;
            float *gotk = malloc((size_t)np * ID * 4 + 4);
            double *wk = malloc((size_t)np * ID * 8 + 8);
            for (int c = 0; c < np; c++) {
                int pl = c * KP + KP - 1;
                memcpy(gotk + (size_t)c * ID, pk + ((size_t)bt[off[s] + pl / bs] * PB + (pl % bs) / KP) * ID,
                       (size_t)ID * 4);
                for (int d = 0; d < ID; d++) {
                    wk[(size_t)c * ID + d] = POOL_DIM(s, c, d);
                }
            }
            double e = nerr(gotk, wk, (size_t)np * ID);
            epk = e > epk ? e : epk;
            free(gotk), free(wk);
        }
        free(pk);
    }
#undef CV
#undef SLOT
#undef POOL_DIM
    printf("  %s: IH=%d ID=%d R=%d KP=%d%s K=%d bs=%d %s, %d sequences (", what, IH, ID, R, KP, tail ? " tail" : "",
           K, bs, kv8 ? "fp8" : "bf16", nseq);
    for (int s = 0; s < nseq; s++) printf("%s%d", s ? ", " : "", len[s]);
    printf(" + %d; %d blocks shared), %d steps, %d queries checked: scores %.2e, pool keys %.2e, wrong choices %d\n",
           ndec, nseq > 1 ? shared : 0, nsteps, nchk, worst_s, epk, bad);
    CHECKF(worst_s < 1e-3, "%s: scores %.3g", what, worst_s);
    CHECKF(epk < 1e-5, "%s: pool keys %.3g", what, epk);
    CHECKF(bad == 0, "%s: %d wrong choices", what, bad);
    cudaFree(dcache), cudaFree(dpk), cudaFree(dkn), cudaFree(dkb), cudaFree(dape), cudaFree(dcos), cudaFree(dsin);
    cudaFree(dbt), cudaFree(dsc), cudaFree(dq), cudaFree(dk), cudaFree(dg), cudaFree(dw), cudaFree(dpos);
    cudaFree(dtbt), cudaFree(dsel), cudaFree(dnsel), cudaFree(dslots);
    for (int s = 0; s < nseq; s++) free(kin[s]), free(gin[s]);
    free(kin), free(gin), free(off), free(n_all), free(bt), free(cs), free(sn), free(kn), free(kb), free(ape);
    free(done), free(pos), free(tbt), free(seq), free(nsel), free(sel), free(exp_sel), free(slots), free(q), free(k);
    free(g), free(w), free(sgot), free(craw), free(cand), free(qr), free(sref), free(idx), free(mark);
}

static void test_indexer(void)
{
    ix_case(40, 6, 8, 16, 8, 0, false, false, NULL);     /* the glm-dsa checkpoint's shape */
    ix_case(64, 20, 32, 128, 64, 0, false, false, NULL); /* GLM-5's indexer heads and dims */
    ix_case(40, 6, 8, 16, 8, 0, false, true, NULL);
    ix_case(50, 16, 32, 16, 0, 4, true, false, NULL);    /* glm5_next's k-pools (the glm5 checkpoints' shape) */
    ix_case(50, 12, 8, 16, 0, 4, false, false, NULL);    /* k-pools without the tail */
    ix_case(64, 16, 8, 32, 8, 8, true, true, NULL);
    /* k-pools of 4 over steps as the engine makes them: a 13-token prefill (ending at a pool's first token),
     * decodes at offsets 1 2 3 0 1, a step from offset 2 completing two pools (the first at its second token),
     * decodes at offsets 0..3, steps of 3, 7 (its first token completing a pool) and 5, then decodes again */
    static const int pool4[] = {13, 1, 1, 1, 1, 1, 6, 1, 1, 1, 1, 3, 7, 5, 1, 1, 1, 1, 1, 1, 1, 0};
    ix_case(50, 16, 32, 16, 0, 4, true, false, pool4);
    ix_case(50, 12, 8, 16, 0, 4, false, false, pool4);
    ix_case(50, 16, 8, 16, 8, 0, false, false, pool4); /* per-key scores over the same steps */
    /* pools of 8, fp8: a 5-token prefill, decodes through a pool, a 12-token step completing two pools */
    static const int pool8[] = {5, 1, 1, 1, 1, 1, 1, 1, 1, 12, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0};
    ix_case(64, 16, 8, 32, 8, 8, true, true, pool8);
    /* long contexts as the engine runs them: GLM-5.3-Flash's indexer (32 heads of 128, pools of 16 with the
     * tail, 2048 keys) over three sequences, one on another's cached prefix, decoding across pool ends */
    static const int l3[] = {20000, 5003, 2900}, l1[] = {16000}, l2[] = {6000, 2500}, l1b[] = {5000},
                     l2b[] = {4000, 700};
    ix_multi("glm5.3 sequences", 32, 128, 0, 16, true, 2048, 64, false, 3, l3, 40, 1500, 20);
    ix_multi("glm5.3 decode T 1", 32, 128, 0, 16, true, 2048, 16, true, 1, l1, 0, 4000, 18);
    ix_multi("k-pools without the tail", 32, 128, 0, 16, false, 2048, 16, false, 2, l2b, 30, 900, 17);
    ix_multi("per key", 32, 128, 0, 0, false, 2048, 16, false, 2, l2, 100, 1000, 4);
    ix_multi("per key, rope, fp8", 32, 128, 64, 0, false, 2048, 64, true, 1, l1b, 0, 2048, 3);
    ix_multi("pools of 12 over blocks of 16", 8, 32, 0, 12, true, 240, 16, false, 2, l2b, 20, 700, 25);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU: skipped\n0 passed, 0 failed\n");
        return 0;
    }
    RUN(test_rmsnorm);
    RUN(test_paged);
    RUN(test_paged_fp8);
    RUN(test_paged_key0);
    RUN(test_prefill);
    RUN(test_expanded);
    RUN(test_indexer);
    return test_summary();
}
