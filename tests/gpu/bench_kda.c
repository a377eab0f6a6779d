/* bench_kda.c - the KDA recurrence (cuda_kda_recur: the column-split
 * recurrence kernel and the output-norm kernel) alone at GLM-5.3-Flash's
 * shape (64 heads of 128, conv 4; --heads=N for a tensor-parallel rank's
 * share), timed with CUDA events (median of 20 launches after warm-up):
 * decode steps of B 1-token sequences (each in its own state slot) and
 * one-sequence prefill steps, with one block a head (cols 128) and with
 * the value columns split over blocks (32, the default; 16). The states and
 * the outputs are the same bits at every split (test_kda). Then speculative
 * decoding (kda.h): verify steps of B sequences of 1 + 3 drafts (the drafts'
 * inputs saved, the slot left before them) beside the same step without
 * drafts, and the replay of 3 accepted drafts a sequence; per KDA layer
 * (GLM-5.3-Flash has 34). Last, prefill of one sequence of 1K, 4K and
 * 14.6K tokens by the recurrence and by the chunked kernels (cuda_kda_chunk,
 * kda_chunk.h: at its default chunk length, value columns as the mixer picks
 * them, then 32, 64 and 128 a block), in ms a layer (the mixer's
 * projections, the same on both paths, left out) and for the 34 KDA layers.
 * Not a test. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kda.h"
#include "cuda/kda_chunk.h"

#define REP 20

static int cmpf(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void *dalloc(size_t n, int byte)
{
    void *p;
    if (cudaMalloc(&p, n) != cudaSuccess) {
        printf("cudaMalloc %zu failed\n", n);
        exit(1);
    }
    cudaMemset(p, byte, n);
    return p;
}

/* cuda_kda_recur(a) timed: " median-us" (3 warm-up calls, REP timed), or the
 * launch's error in its place (cuda_kda_recur returns it: a later
 * cudaGetLastError no longer sees it) */
static void print_recur(const struct cuda_kda_args *a, cudaEvent_t e0, cudaEvent_t e1)
{
    float t[REP];
    cudaError_t e = cudaSuccess;
    for (int r = 0; r < 3 + REP; r++) {
        cudaEventRecord(e0, 0);
        cudaError_t le = cuda_kda_recur(a, 0);
        if (le != cudaSuccess) e = le;
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        if (r >= 3) cudaEventElapsedTime(&t[r - 3], e0, e1);
    }
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) {
        printf(" %12s", cudaGetErrorString(e));
        return;
    }
    qsort(t, REP, sizeof *t, cmpf);
    printf(" %12.1f", t[REP / 2] * 1000.0f);
}

int main(int argc, char **argv)
{
    int H = 64, D = 128, K = 4;
    for (int i = 1; i < argc; i++)
        if (!strncmp(argv[i], "--heads=", 8)) H = atoi(argv[i] + 8);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU\n");
        return 0;
    }
    if (cuda_kda_prepare() != cudaSuccess || cuda_kda_chunk_prepare() != cudaSuccess) {
        printf("cuda_kda_prepare failed\n");
        return 1;
    }
    const int maxT = 14600, maxS = 256, C = H * D;
    size_t slot = (size_t)C * D + (size_t)(K - 1) * 3 * C;
    /* 0x3c bytes: small positive floats (~0.011) everywhere: finite, the gates mid-range */
    float *qkv = dalloc((size_t)maxT * 3 * C * 4, 0x3c), *fg = dalloc((size_t)maxT * C * 4, 0x3c);
    float *beta = dalloc((size_t)maxT * H * 4, 0x3c), *gate = dalloc((size_t)maxT * C * 4, 0x3c);
    float *conv = dalloc((size_t)3 * C * K * 4, 0x3c), *dtb = dalloc((size_t)C * 4, 0x3c);
    float *A = dalloc((size_t)H * 4, 0x3c), *onorm = dalloc((size_t)D * 4, 0x3c);
    float *states = dalloc((size_t)maxS * slot * 4, 0), *o32 = dalloc((size_t)maxT * C * 4, 0);
    uint16_t *out = dalloc((size_t)maxT * C * 2, 0);
    float *work = dalloc((size_t)maxT * 3 * C * 4, 0);
    struct cuda_kda_seq *seqs = dalloc((size_t)maxS * sizeof *seqs, 0), hs[256];
    struct cuda_kda_snap *snaps = dalloc(16 * sizeof *snaps, 0);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    printf("KDA recurrence, %d heads of %d, conv %d (us a call, median of %d)\n", H, D, K, REP);
    static const int cols[] = {128, 32, 16};
    static const int shapes[][2] = {{1, 1}, {8, 1}, {64, 1}, {256, 1}, {1, 512}, {1, 4096}}; /* sequences, tokens */
    printf("%-34s %12s %12s %12s\n", "step", "cols 128", "cols 32", "cols 16");
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int B = shapes[s][0], L = shapes[s][1];
        for (int i = 0; i < B; i++)
            hs[i] = (struct cuda_kda_seq){.t0 = i * L, .n = L, .p0 = 100, .slot = i, .mode = CUDA_KDA_CONTINUE,
                                          .from = i};
        cudaMemcpy(seqs, hs, (size_t)B * sizeof *hs, cudaMemcpyHostToDevice);
        char label[64];
        snprintf(label, sizeof label, "%d sequence%s x %d token%s", B, B > 1 ? "s" : "", L, L > 1 ? "s" : "");
        printf("%-34s", label);
        for (size_t c = 0; c < sizeof cols / sizeof *cols; c++) {
            struct cuda_kda_args a = {.qkv = qkv, .fg = fg, .beta = beta, .gate = gate, .conv = conv, .dt_bias = dtb,
                                      .A = A, .o_norm = onorm, .states = states, .slot_floats = slot, .off = 0,
                                      .seqs = seqs, .snaps = snaps, .n_seqs = B, .H = H, .D = D, .K = K,
                                      .lower_bound = true, .lb = -5.0f, .eps = 1e-5f, .cols = cols[c], .o32 = o32,
                                      .out = out};
            print_recur(&a, e0, e1);
        }
        printf("\n");
    }
    /* speculative decoding: 3 drafts a sequence, cols 32 */
    enum { ND = 3 };
    float *sq = dalloc((size_t)maxS * ND * 3 * C * 4, 0x3c), *sf = dalloc((size_t)maxS * ND * C * 4, 0x3c);
    float *sb = dalloc((size_t)maxS * ND * H * 4, 0x3c);
    printf("%-34s %12s %12s %12s\n", "verify (1 + 3 drafts), cols 32", "no drafts", "verify", "replay 3");
    static const int batches[] = {1, 8, 64, 256};
    for (size_t s = 0; s < sizeof batches / sizeof *batches; s++) {
        int B = batches[s];
        char label[64];
        snprintf(label, sizeof label, "%d sequence%s x %d tokens", B, B > 1 ? "s" : "", ND + 1);
        printf("%-34s", label);
        for (int mode = 0; mode < 3; mode++) {
            for (int i = 0; i < B; i++)
                hs[i] = mode < 2 ? (struct cuda_kda_seq){.t0 = i * (ND + 1), .n = ND + 1, .p0 = 100, .slot = i,
                                                         .mode = CUDA_KDA_CONTINUE, .from = i, .nd = mode ? ND : 0,
                                                         .spec0 = i * ND}
                                 : (struct cuda_kda_seq){.t0 = i * ND, .n = ND, .p0 = 101, .slot = i,
                                                         .mode = CUDA_KDA_CONTINUE};
            cudaMemcpy(seqs, hs, (size_t)B * sizeof *hs, cudaMemcpyHostToDevice);
            struct cuda_kda_args a = {.qkv = qkv, .fg = fg, .beta = beta, .gate = gate, .conv = conv, .dt_bias = dtb,
                                      .A = A, .o_norm = onorm, .states = states, .slot_floats = slot, .off = 0,
                                      .seqs = seqs, .snaps = snaps, .n_seqs = B, .H = H, .D = D, .K = K,
                                      .lower_bound = true, .lb = -5.0f, .eps = 1e-5f, .o32 = o32, .out = out,
                                      .spec_qkv = sq, .spec_fg = sf, .spec_beta = sb};
            if (mode == 2) a.qkv = sq, a.fg = sf, a.beta = sb, a.gate = NULL, a.o32 = NULL, a.out = NULL,
                a.replay = true;
            print_recur(&a, e0, e1);
        }
        printf("\n");
    }

    /* prefill of one sequence: the recurrence against the chunked kernels */
    static const int lens[] = {1024, 4096, 14600};
    static const int ccols[] = {0, 32, 64, 128}; /* 0: the mixer's choice (kda_chunk.h) */
    printf("\nprefill, 1 sequence, ms a layer (x34: GLM-5.3-Flash's KDA layers); chunk %d tokens\n",
           cuda_kda_chunk_len(D, 0));
    printf("%-10s %14s %14s %14s %14s %14s\n", "tokens", "recurrence", "chunk (mixer)", "chunk cols 32", "chunk cols 64",
           "chunk cols 128");
    for (size_t s = 0; s < sizeof lens / sizeof *lens; s++) {
        int L = lens[s];
        hs[0] = (struct cuda_kda_seq){.t0 = 0, .n = L, .p0 = 0, .slot = 0, .mode = CUDA_KDA_CONTINUE, .from = 0};
        cudaMemcpy(seqs, hs, sizeof *hs, cudaMemcpyHostToDevice);
        printf("%-10d", L);
        for (int path = 0; path < 5; path++) {
            struct cuda_kda_args a = {.qkv = qkv, .fg = fg, .beta = beta, .gate = gate, .conv = conv, .dt_bias = dtb,
                                      .A = A, .o_norm = onorm, .states = states, .slot_floats = slot, .off = 0,
                                      .seqs = seqs, .snaps = snaps, .n_seqs = 1, .H = H, .D = D, .K = K,
                                      .lower_bound = true, .lb = -5.0f, .eps = 1e-5f,
                                      .cols = path ? ccols[path - 1] : 0, .o32 = o32, .out = out};
            int rep = L > 4096 ? 5 : REP;
            float t[REP];
            cudaError_t e = cudaSuccess;
            for (int r = 0; r < 2 + rep; r++) {
                cudaEventRecord(e0, 0);
                cudaError_t le = path ? cuda_kda_chunk(&a, 0, work, 0) : cuda_kda_recur(&a, 0);
                if (le != cudaSuccess) e = le;
                cudaEventRecord(e1, 0);
                cudaEventSynchronize(e1);
                if (r >= 2) cudaEventElapsedTime(&t[r - 2], e0, e1);
            }
            if (e == cudaSuccess) e = cudaGetLastError();
            if (e != cudaSuccess) {
                printf(" %14s", cudaGetErrorString(e));
                continue;
            }
            qsort(t, rep, sizeof *t, cmpf);
            char cell[32];
            snprintf(cell, sizeof cell, "%.3f (%.0f)", t[rep / 2], t[rep / 2] * 34.0f);
            printf(" %14s", cell);
        }
        printf("\n");
    }
    return 0;
}
