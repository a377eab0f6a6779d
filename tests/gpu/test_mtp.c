/* test_mtp.c - the MTP layer's kernels (cuda/mtp.cu) against plain-C
 * references on random inputs (make gpu-test; needs a GPU).
 *
 *  - cuda_mtp_attention: sequences of random lengths over shuffled blocks of
 *    16, each token of their last few positions attending keys key0 .. pos
 *    (key0 0 and 1: the MTP layer leaves position 0 out), bf16 and fp8 e4m3
 *    KV, head_dim 64, 128 and 80 (not a multiple of 32), 4 query heads per KV
 *    head; against a double softmax over the same bf16 / e4m3 values, to
 *    1e-2 of the output's norm (bf16 output, __expf);
 *  - cuda_mtp_in: the two RMSNorms into one row, hidden rows from both
 *    sources (src >= 0 and < 0), to 1e-2;
 *  - cuda_mtp_rows: row copies, exact;
 *  - cuda_mtp_accept: the device's walk over a step's verified drafts and
 *    the drafts' inputs it writes, against the host's walk, exact; and
 *    cuda_mtp_fix_ids.
 * Outputs are poisoned (NaN) first, so an element never written fails.
 *  - the warm-up (tests/models/mtp/glm4moe, 3 drafts): after it the first
 *    speculative step (3 sequences verifying 3 drafts each) captures no
 *    graph, while with tuning.warmup off the same step captures its verify
 *    and MTP pass graphs; tokens and drafts the same either way (the
 *    warm-up's steps keep nothing).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/mtp.h"
#include "model/backend.h"
#include "model/model.h"
#include "tests/gpu/gpu_util.h"
#include "tests/test.h"

/* e4m3 (bias 7, no infinities; 0x7f / 0xff NaN) to float */
static float e4m3(uint8_t v)
{
    int s = v >> 7, e = (v >> 3) & 15, m = v & 7;
    float f = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
    return s ? -f : f;
}
static uint8_t rand_e4m3(void) /* a finite value of magnitude <= 2 */
{
    for (;;) {
        uint8_t v = (uint8_t)((frand() + 1.0f) * 128.0f);
        if ((v & 0x7f) != 0x7f && fabsf(e4m3(v)) <= 2.0f) return v;
    }
}

static void attn_case(int D, bool kv8, int key0)
{
    enum { S = 3, BS = 16, H = 8, KVH = 2, QN = 3 };
    int len[S] = {5, 37, 70}, nb[S], nblk = 0;
    for (int s = 0; s < S; s++) nb[s] = (len[s] + BS - 1) / BS, nblk += nb[s];
    int32_t *bt = malloc((size_t)nblk * 4);
    for (int i = 0; i < nblk; i++) bt[i] = i;
    for (int i = nblk - 1; i > 0; i--) { /* shuffled: block order is not position order */
        int j = (int)((frand() + 1.0f) * 0.5f * (i + 1)) % (i + 1), t = bt[i];
        bt[i] = bt[j], bt[j] = t;
    }
    size_t ne = (size_t)nblk * BS * KVH * D, es = kv8 ? 1 : 2;
    uint8_t *kc = malloc(ne * es), *vc = malloc(ne * es);
    float *kf = malloc(ne * 4), *vf = malloc(ne * 4);
    for (size_t i = 0; i < ne; i++) {
        if (kv8) {
            kc[i] = rand_e4m3(), vc[i] = rand_e4m3();
            kf[i] = e4m3(kc[i]), vf[i] = e4m3(vc[i]);
        } else {
            uint16_t a = bf(frand() * 2.0f), b = bf(frand());
            memcpy(kc + 2 * i, &a, 2), memcpy(vc + 2 * i, &b, 2);
            kf[i] = fb(a), vf[i] = fb(b);
        }
    }
    int T = S * QN;
    int32_t pos[S * QN], tbt[S * QN];
    uint16_t *q = malloc((size_t)T * H * D * 2);
    for (int s = 0, t = 0, off = 0; s < S; off += nb[s], s++)
        for (int i = 0; i < QN; i++, t++) pos[t] = len[s] - QN + i < key0 ? key0 : len[s] - QN + i, tbt[t] = off;
    for (size_t i = 0; i < (size_t)T * H * D; i++) q[i] = bf(frand());
    double *ref = calloc((size_t)T * H * D, sizeof *ref);
    float *got = malloc((size_t)T * H * D * 4);
    uint16_t *gb = malloc((size_t)T * H * D * 2);
    float scale = 1.0f / sqrtf((float)D);
    double *sc = malloc(128 * sizeof *sc);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            int g = h / (H / KVH);
            double mx = -INFINITY, sum = 0;
            for (int j = key0; j <= pos[t]; j++) {
                size_t o = ((size_t)(bt[tbt[t] + j / BS] * BS + j % BS) * KVH + g) * D;
                double d = 0;
                for (int c = 0; c < D; c++) d += (double)fb(q[((size_t)t * H + h) * D + c]) * kf[o + c];
                sc[j] = d * scale;
                mx = sc[j] > mx ? sc[j] : mx;
            }
            for (int j = key0; j <= pos[t]; j++) sum += sc[j] = exp(sc[j] - mx);
            for (int j = key0; j <= pos[t]; j++) {
                size_t o = ((size_t)(bt[tbt[t] + j / BS] * BS + j % BS) * KVH + g) * D;
                for (int c = 0; c < D; c++) ref[((size_t)t * H + h) * D + c] += sc[j] / sum * vf[o + c];
            }
        }
    uint16_t *dq = dup_dev(q, (size_t)T * H * D * 2), *dout = poisoned((size_t)T * H * D * 2);
    void *dk = dup_dev(kc, ne * es), *dv = dup_dev(vc, ne * es);
    int32_t *dpos = dup_dev(pos, sizeof pos), *dtbt = dup_dev(tbt, sizeof tbt), *dbt = dup_dev(bt, (size_t)nblk * 4);
    struct cuda_mtp_attn_args a = {.q = dq, .kc = dk, .vc = dv, .pos = dpos, .tok_bt = dtbt, .bt = dbt, .out = dout,
                                   .T = T, .H = H, .KVH = KVH, .D = D, .block_size = BS, .key0 = key0, .scale = scale,
                                   .kv8 = kv8};
    cudaError_t e = cuda_mtp_attention(&a, 0);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    get(gb, dout, (size_t)T * H * D * 2);
    for (size_t i = 0; i < (size_t)T * H * D; i++) got[i] = fb(gb[i]);
    double er = nerr(got, ref, (size_t)T * H * D);
    CHECKF(e == cudaSuccess && er < 1e-2, "attention D %d %s key0 %d: %s, error %.2e", D, kv8 ? "fp8" : "bf16", key0,
           cudaGetErrorString(e), er);
    printf("  %s attention D %d %s key0 %d: error %.2e\n", er < 1e-2 ? "ok  " : "FAIL", D, kv8 ? "fp8 " : "bf16", key0,
           er);
    cudaFree(dq), cudaFree(dout), cudaFree(dk), cudaFree(dv), cudaFree(dpos), cudaFree(dtbt), cudaFree(dbt);
    free(bt), free(kc), free(vc), free(kf), free(vf), free(q), free(ref), free(got), free(gb), free(sc);
}

static void test_attention(void)
{
    static const int dims[] = {64, 128, 80};
    for (int i = 0; i < 3; i++)
        for (int kv8 = 0; kv8 < 2; kv8++)
            for (int key0 = 0; key0 < 2; key0++) attn_case(dims[i], kv8, key0);
}

static void test_in_and_rows(void)
{
    enum { N = 6, E = 1024, NK = 4, NB = 5 };
    float eps = 1e-5f;
    float *e = malloc((size_t)N * E * 4), *en = malloc(E * 4), *hn = malloc(E * 4);
    uint16_t *hk = malloc((size_t)NK * E * 2), *hb = malloc((size_t)NB * E * 2), *out = malloc((size_t)N * 2 * E * 2);
    int32_t src[N] = {0, 3, -1, -5, 2, -3};
    for (size_t i = 0; i < (size_t)N * E; i++) e[i] = frand() * 3.0f;
    for (int i = 0; i < E; i++) en[i] = 1.0f + 0.5f * frand(), hn[i] = 1.0f + 0.5f * frand();
    for (size_t i = 0; i < (size_t)NK * E; i++) hk[i] = bf(frand());
    for (size_t i = 0; i < (size_t)NB * E; i++) hb[i] = bf(frand() * 0.1f);
    double *ref = malloc((size_t)N * 2 * E * sizeof *ref);
    for (int j = 0; j < N; j++) {
        const uint16_t *h = src[j] >= 0 ? hk + (size_t)src[j] * E : hb + (size_t)(-src[j] - 1) * E;
        double s1 = 0, s2 = 0;
        for (int i = 0; i < E; i++) s1 += (double)e[(size_t)j * E + i] * e[(size_t)j * E + i], s2 += (double)fb(h[i]) * fb(h[i]);
        double r1 = 1.0 / sqrt(s1 / E + eps), r2 = 1.0 / sqrt(s2 / E + eps);
        for (int i = 0; i < E; i++) {
            ref[(size_t)j * 2 * E + i] = en[i] * e[(size_t)j * E + i] * r1;
            ref[(size_t)j * 2 * E + E + i] = hn[i] * fb(h[i]) * r2;
        }
    }
    float *de = dup_dev(e, (size_t)N * E * 4), *den = dup_dev(en, E * 4), *dhn = dup_dev(hn, E * 4);
    uint16_t *dhk = dup_dev(hk, (size_t)NK * E * 2), *dhb = dup_dev(hb, (size_t)NB * E * 2);
    uint16_t *dout = poisoned((size_t)N * 2 * E * 2);
    int32_t *dsrc = dup_dev(src, sizeof src);
    cudaError_t rc = cuda_mtp_in(de, dhk, dhb, dsrc, den, dhn, N, E, eps, dout, 0);
    if (rc == cudaSuccess) rc = cudaDeviceSynchronize();
    get(out, dout, (size_t)N * 2 * E * 2);
    float *got = malloc((size_t)N * 2 * E * 4);
    for (size_t i = 0; i < (size_t)N * 2 * E; i++) got[i] = fb(out[i]);
    double er = nerr(got, ref, (size_t)N * 2 * E);
    CHECKF(rc == cudaSuccess && er < 1e-2, "mtp_in: %s, error %.2e", cudaGetErrorString(rc), er);
    printf("  %s mtp_in: error %.2e\n", er < 1e-2 ? "ok  " : "FAIL", er);

    /* rows: hk rows 3, 0 into hblk rows 4, 1 */
    int32_t dr[2] = {4, 1}, sr[2] = {3, 0};
    int32_t *ddr = dup_dev(dr, sizeof dr), *dsr = dup_dev(sr, sizeof sr);
    rc = cuda_mtp_rows(dhb, ddr, dhk, dsr, 2, E, 0);
    if (rc == cudaSuccess) rc = cudaDeviceSynchronize();
    uint16_t *hb2 = malloc((size_t)NB * E * 2);
    get(hb2, dhb, (size_t)NB * E * 2);
    bool same = !memcmp(hb2 + 4 * E, hk + 3 * E, E * 2) && !memcmp(hb2 + 1 * E, hk, E * 2) &&
                !memcmp(hb2, hb, E * 2) && !memcmp(hb2 + 2 * E, hb + 2 * E, 2 * E * 2);
    CHECKF(rc == cudaSuccess && same, "mtp_rows: %s, %s", cudaGetErrorString(rc), same ? "same" : "rows differ");
    printf("  %s mtp_rows\n", same ? "ok  " : "FAIL");
    cudaFree(de), cudaFree(den), cudaFree(dhn), cudaFree(dhk), cudaFree(dhb), cudaFree(dout), cudaFree(dsrc);
    cudaFree(ddr), cudaFree(dsr);
    free(e), free(en), free(hn), free(hk), free(hb), free(out), free(ref), free(got), free(hb2);
}

/* cuda_mtp_accept: sequences verifying 0 .. 4 drafts whose tokens match the
 * drafts to every depth (and a non-finite row's -1), block tables that cover
 * the drafts' positions or stop short of them, Sp past ns (padding rows);
 * against the host's walk (step.c's verify_greedy), exact. Then
 * cuda_mtp_fix_ids. */
static void test_accept(void)
{
    enum { NS = 6, SP = 8, K = 3, BS = 4, V = 500, NB = 8 };
    struct cuda_mtp_dseq sq[NS];
    int32_t tok[64], bt[NS * NB], ns = NS;
    int nd[NS] = {0, 2, 3, 3, 4, 1}, depth[NS] = {0, 1, 3, 0, 4, 1}, rows = 0;
    int nbk[NS] = {NB, NB, 4, NB, NB, 5}; /* blocks each table covers: sequence 2's and 5's stop short (2, 1 drafts) */
    for (int i = 0; i < NS * NB; i++) bt[i] = (i * 7) % (NS * NB);
    for (int j = 0; j < NS; j++) {
        struct cuda_mtp_dseq *d = &sq[j];
        memset(d, 0, sizeof *d);
        d->row0 = rows, d->nd = nd[j], d->a = j == 2 ? 10 : j == 5 ? 17 : 5 + 2 * j, d->q0 = 10 * j + 1;
        d->cover = nbk[j] * BS, d->tbt = j * NB;
        for (int i = 0; i < nd[j]; i++) d->vd[i] = 100 + 10 * j + i;
        for (int i = 0; i <= nd[j]; i++) /* rows match the drafts up to depth, then differ */
            tok[rows + i] = i < depth[j] && i < nd[j] ? d->vd[i] : 300 + i;
        if (j == 3) tok[rows] = -1; /* a row whose logits were not finite */
        rows += nd[j] + 1;
    }
    size_t rb = CUDA_MTP_R_BYTES(SP);
    struct cuda_mtp_dseq *dsq = dup_dev(sq, sizeof sq);
    int32_t *dtok = dup_dev(tok, sizeof tok), *dbt = dup_dev(bt, sizeof bt), *dns = dup_dev(&ns, 4);
    int32_t *dkd = poisoned(SP * 4), *dks = poisoned(SP * 4), *dout = poisoned(3 * NS * 4);
    uint8_t *dr = poisoned(K * rb);
    struct cuda_mtp_accept_args a = {.sq = dsq, .ns = dns, .tok = dtok, .bt = dbt, .Sp = SP, .K = K, .V = V,
                                     .block_size = BS, .pad_row = 999, .pad_slot = 4444, .g0 = 64, .kdst = dkd,
                                     .ksrc = dks, .r1 = dr, .out_p = dout, .out_k = dout + NS,
                                     .out_tok = dout + 2 * NS};
    cudaError_t e = cuda_mtp_accept(&a, 0);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    int32_t kd[SP], ks[SP], out[3 * NS];
    uint8_t *r = malloc(K * rb);
    get(kd, dkd, sizeof kd), get(ks, dks, sizeof ks), get(out, dout, sizeof out), get(r, dr, K * rb);
    int bad = 0;
    for (int j = 0; j < SP; j++) {
        int p = 0, t = 0, k = 0, src0 = 0, dst = 999, tb = 0;
        if (j < NS) {
            const struct cuda_mtp_dseq *d = &sq[j];
            int i = 0;
            for (;; i++) {
                t = tok[d->row0 + i];
                if (t < 0 || i >= d->nd || t != d->vd[i]) break;
            }
            p = d->a + i, src0 = d->q0 + i, tb = d->tbt, k = d->cover - 1 - p;
            k = k < 0 ? 0 : k > K ? K : k;
            dst = bt[tb + p / BS];
            bad += out[j] != p || out[NS + j] != k || out[2 * NS + j] != t;
            if (t < 0 || t >= V) t = 0;
        }
        bad += kd[j] != dst || ks[j] != src0;
        for (int it = 0; it < K; it++) {
            const uint8_t *ri = r + it * rb;
            bool on = j < NS && it < k;
            int ps = on ? p + 1 + it : 0;
            int64_t slot = on ? (int64_t)bt[tb + ps / BS] * BS + ps % BS : 4444;
            bad += ((const int64_t *)ri)[j] != slot;
            bad += ((const int32_t *)(ri + CUDA_MTP_R_POS(SP)))[j] != ps;
            bad += ((const int32_t *)(ri + CUDA_MTP_R_TBT(SP)))[j] != (on ? tb : 0);
            bad += ((const int32_t *)(ri + CUDA_MTP_R_SRC(SP)))[j] != (it == 0 ? src0 : 64 + j);
            if (it == 0) bad += ((const int32_t *)(ri + CUDA_MTP_R_IDS(SP)))[j] != t;
        }
    }
    CHECKF(e == cudaSuccess && bad == 0, "mtp_accept: %s, %d values differ", cudaGetErrorString(e), bad);
    printf("  %s mtp_accept: %d sequences in %d rows, %d values differ\n",
           bad == 0 && e == cudaSuccess ? "ok  " : "FAIL", NS, SP, bad);

    int32_t ids[5] = {-1, 0, V - 1, V, 7}, want[5] = {0, 0, V - 1, 0, 7}, got[5];
    int32_t *dids = dup_dev(ids, sizeof ids);
    e = cuda_mtp_fix_ids(dids, 5, V, 0);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    get(got, dids, sizeof got);
    bool same = !memcmp(got, want, sizeof want);
    CHECKF(e == cudaSuccess && same, "mtp_fix_ids: %s", cudaGetErrorString(e));
    printf("  %s mtp_fix_ids\n", same && e == cudaSuccess ? "ok  " : "FAIL");
    cudaFree(dsq), cudaFree(dtok), cudaFree(dbt), cudaFree(dns), cudaFree(dkd), cudaFree(dks), cudaFree(dout);
    cudaFree(dr), cudaFree(dids);
    free(r);
}

/* ---- the warm-up's captures --------------------------------------------------------------------------- */

#define WMODEL "tests/models/mtp/glm4moe"
#define WK 3   /* drafts a sequence */
#define WBS 16 /* block size */
#define WNS 3  /* sequences (batch bucket 4) */
#define WPL 12 /* prompt tokens (the prefill's pass bucket is not the verify step's) */

/* The CUDA graphs rank 0 holds: decode, verify and MTP pass graphs. */
static int graphs_held(const model_backend *be)
{
    const struct cuda_backend *b = (const struct cuda_backend *)be;
    const struct rank *k = &b->r[0];
    int n = 0;
    for (int i = 0; i < NBUCKET; i++) {
        n += k->gexec[i] != NULL;
        for (int v = 0; v < VGRAPH_K; v++) n += k->vexec[v][i] != NULL;
    }
    for (int i = 0; i < CUDA_MTP_GT; i++)
        for (int j = 0; j < CUDA_MTP_GS; j++) n += k->mtpx->gx[i][j] != NULL;
    return n;
}

/* A prefill of WNS sequences, then a step verifying WK drafts each (the
 * drafts the backend made after the prefill), then the drafts after it:
 * graphs[0] held after the warm-up, graphs[1] after the prefill, graphs[2]
 * after the verify step; out: each sequence's verified tokens (WK + 1 a
 * sequence, -1 past the accepted ones) and its next drafts. Returns 0, or -1
 * when something failed (checked here). */
static int warm_flow(const model *m, bool warmup, int graphs[3], int32_t out[WNS][2 * WK + 1])
{
    char err[512];
    struct cuda_tuning saved = cuda_tuning;
    cuda_tuning.warmup = warmup;
    struct model_backend_opts bo = {.device = "cuda", .n_threads = 2, .max_tokens_per_step = 64,
                                    .max_seqs_per_step = 8, .max_ctx = 256, .mtp = true, .max_draft_tokens = WK};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    cuda_tuning = saved;
    CHECKF(be != NULL, "backend: %s", err);
    if (!be) return -1;
    int rc = -1, V = model_get_config(m)->n_vocab;
    if (be->ops->kv_alloc(be, 64, WBS, err, sizeof err) != 0) {
        CHECKF(0, "kv_alloc: %s", err);
        goto out;
    }
    graphs[0] = graphs_held(be);
    /* sequence i over blocks 40 + 4 i .. (past what the warm-up writes) */
    int32_t bt[WNS][4], hist[WNS][WPL + 1 + WK], tid[WNS * WPL], pos[WNS * WPL], first[WNS]; /* WPL > WK */
    int64_t slots[WNS * WPL];
    struct model_sampling greedy;
    model_sampling_default(&greedy);
    uint64_t rng[WNS];
    struct step_seq sq[WNS];
    struct model_sample_out so[WNS][WK + 1];
    for (int i = 0; i < WNS; i++) {
        rng[i] = model_rng_seed((uint64_t)i);
        for (int j = 0; j < 4; j++) bt[i][j] = 40 + 4 * i + j;
        for (int j = 0; j < WPL; j++) hist[i][j] = (int32_t)((7 + 31 * i + 13 * j) % V);
    }
    /* the prefill */
    int T = 0;
    for (int i = 0; i < WNS; i++) {
        sq[i] = (struct step_seq){.query_start = T, .query_len = WPL, .context_len = WPL, .block_table = bt[i],
                                  .n_blocks = 4, .want_sample = true, .sampling = &greedy, .history = hist[i],
                                  .n_prompt = WPL, .n_history = WPL, .rng = &rng[i]};
        for (int j = 0; j < WPL; j++, T++)
            tid[T] = hist[i][j], pos[T] = j, slots[T] = (int64_t)bt[i][j / WBS] * WBS + j % WBS;
    }
    struct step st = {.n_tokens = T, .token_ids = tid, .positions = pos, .slots = slots, .n_seqs = WNS, .seqs = sq};
    if (be->ops->forward(be, &st, err, sizeof err) != 0) {
        CHECKF(0, "prefill: %s", err);
        goto out;
    }
    graphs[1] = graphs_held(be);
    /* the drafts after it, from each sequence's last prompt position */
    struct model_mtp_req rq[WNS];
    int32_t dr[WNS][WK];
    for (int i = 0; i < WNS; i++) {
        first[i] = sq[i].out.token;
        hist[i][WPL] = first[i];
        rq[i] = (struct model_mtp_req){.seq = i, .pos = WPL - 1, .token = first[i], .k = WK, .block_table = bt[i],
                                       .n_blocks = 4, .drafts = dr[i]};
    }
    if (be->ops->mtp_draft(be, rq, WNS, err, sizeof err) != 0) {
        CHECKF(0, "mtp_draft: %s", err);
        goto out;
    }
    /* the verify step: the sampled token and its WK drafts */
    T = 0;
    for (int i = 0; i < WNS; i++) {
        for (int d = 0; d < WK; d++) hist[i][WPL + 1 + d] = dr[i][d];
        sq[i] = (struct step_seq){.query_start = T, .query_len = WK + 1, .context_len = WPL + WK + 1,
                                  .block_table = bt[i], .n_blocks = 4, .want_sample = true, .sampling = &greedy,
                                  .history = hist[i], .n_prompt = WPL, .n_history = WPL + 1, .rng = &rng[i],
                                  .n_draft = WK, .spec_out = so[i]};
        for (int j = 0; j <= WK; j++, T++) {
            int p = WPL + j;
            tid[T] = hist[i][p], pos[T] = p, slots[T] = (int64_t)bt[i][p / WBS] * WBS + p % WBS;
        }
    }
    st = (struct step){.n_tokens = T, .token_ids = tid, .positions = pos, .slots = slots, .n_seqs = WNS, .seqs = sq};
    if (be->ops->forward(be, &st, err, sizeof err) != 0) {
        CHECKF(0, "verify: %s", err);
        goto out;
    }
    graphs[2] = graphs_held(be);
    /* the drafts after the verify step, from each sequence's last accepted position */
    for (int i = 0; i < WNS; i++) {
        int na = sq[i].n_spec_out; /* accepted drafts + 1 */
        for (int j = 0; j <= WK; j++) out[i][j] = j < na ? so[i][j].token : -1;
        rq[i] = (struct model_mtp_req){.seq = i, .pos = WPL + na - 1, .token = so[i][na - 1].token, .k = WK,
                                       .block_table = bt[i], .n_blocks = 4, .drafts = out[i] + WK + 1};
    }
    if (be->ops->mtp_draft(be, rq, WNS, err, sizeof err) != 0) {
        CHECKF(0, "mtp_draft after verify: %s", err);
        goto out;
    }
    rc = 0;
out:
    model_backend_destroy(be);
    return rc;
}

/* With the warm-up on, a speculative step (verifying WK drafts of WNS
 * sequences) captures no graph: the warm-up captured its verify graph and its
 * MTP pass graph; with it off, the same step captures them (so the count can
 * tell). Both give the same tokens and drafts (the warm-up kept nothing). */
static void test_warmup_capture(void)
{
    char err[512];
    struct model_load_opts lo = {0};
    model *m = model_load(WMODEL, &lo, err, sizeof err);
    CHECKF(m != NULL, "%s: %s", WMODEL, err);
    if (!m) return;
    int g[2][3];
    int32_t out[2][WNS][2 * WK + 1];
    if (warm_flow(m, true, g[0], out[0]) == 0 && warm_flow(m, false, g[1], out[1]) == 0) {
        printf("  graphs held (warm-up on): %d after it, %d after a prefill, %d after a verify step\n", g[0][0],
               g[0][1], g[0][2]);
        printf("  graphs held (warm-up off): %d, %d, %d\n", g[1][0], g[1][1], g[1][2]);
        CHECKF(g[0][2] == g[0][1], "the first verify step captured %d graphs after the warm-up", g[0][2] - g[0][1]);
        CHECKF(g[1][2] >= g[1][1] + 2, "without the warm-up the verify step captured %d graphs (want its verify "
               "and pass graphs)", g[1][2] - g[1][1]);
        CHECKF(g[1][0] == 0 && g[0][0] > 0, "graphs after kv_alloc: %d with the warm-up, %d without", g[0][0],
               g[1][0]);
        bool same = !memcmp(out[0], out[1], sizeof out[0]);
        for (int i = 0; i < WNS; i++) {
            printf("  seq %d: tokens", i);
            for (int j = 0; j < 2 * WK + 1; j++) printf(" %d%s", out[0][i][j], j == WK ? " | drafts" : "");
            printf("\n");
        }
        CHECKF(same, "tokens or drafts differ with and without the warm-up");
    }
    model_free(m);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU: skipped\n0 passed, 0 failed\n");
        return 0;
    }
    RUN(test_attention);
    RUN(test_in_and_rows);
    RUN(test_accept);
    RUN(test_warmup_capture);
    return test_summary();
}
