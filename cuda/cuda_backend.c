/* cuda_backend.c - the GPU backend (model/backend.h, device "cuda") for the
 * Llama family on one GPU or, tensor parallel, across N GPUs of one host.
 *
 * Numerics: every weight matrix is converted to bf16 at creation (GGUF
 * Q4_0/Q4_1/Q8_0/F16 dequantized on the host with model_tensor_to_f32, then
 * rounded to nearest even), but packed int4/int8 safetensors weights
 * (W4A16/W8A16: compressed-tensors, AWQ, GPTQ), which are converted to the
 * one packed device layout of qgemm.h and multiplied by its mixed-input
 * kernels (a layer with any of them takes the unfused kernels; q|k|v and
 * gate|up stay one packed matrix when their parts are packed alike, else run
 * part by part); norm weights and biases stay f32. Activations
 * between kernels are bf16, the residual stream is f32, every GEMM (cuBLAS,
 * bf16 in, f32 compute) and every reduction accumulates in f32. Fused Q|K|V
 * and gate|up matrices make one GEMM each.
 *
 * Tensor parallelism (opts->tensor_parallel_size = N > 1, Megatron style):
 * rank k runs on device k with its own stream, cuBLAS handle and NCCL
 * communicator (ncclCommInitAll). Q|K|V and gate|up are split by output rows
 * (rank k holds heads [k H/N, (k+1) H/N), KV heads likewise, FFN columns
 * [k F/N, (k+1) F/N)); the output and down projections are split by input
 * columns, each rank's f32 partial product is summed by an all-reduce and
 * rounded to bf16 once, as the one-GPU path rounds its GEMM output. Small
 * all-reduces (decode steps: up to 8 MiB / (N - 1)) run
 * as one kernel over peer memory (tp.cu, cuda_peer_allreduce: every rank
 * reads every rank's partial over NVLink/PCIe and sums in rank order, the
 * bf16 rounding in the same pass) when every pair of GPUs has peer access;
 * larger ones, and all of them with cuda_tuning.tp_peer_allreduce off, through NCCL. The
 * embedding and the LM head are split by vocabulary: a rank gathers the
 * embedding rows it holds (zeros elsewhere) and an all-reduce completes x; for
 * the LM head each rank reduces its slice of every logit row to (max, sum,
 * argmax), an all-gather shares those and every rank combines them in the
 * same order, so all ranks agree on the greedy token. Rows sampled on the
 * host copy each rank's slice into one pinned row. Head counts, KV heads and
 * FFN width must divide by N (checked at creation). The scheduler and KV pool
 * stay single: every rank receives the same step (one pinned input buffer)
 * and holds its KV heads of every block.
 *
 * Threads: forward() runs rank 0 on the caller's thread and ranks 1..N-1 on
 * their own threads (the crew), all executing the same plan; the caller
 * returns when every rank's stream is done. A rank that fails (CUDA, cuBLAS
 * or NCCL error) raises a flag; every rank waiting on its stream polls the
 * flag and its communicator's async error, aborts its communicator (which
 * ends collectives stuck waiting for the failed rank) and returns, so a
 * failure never hangs: forward() returns SL_EDEVICE and sets base.fatal.
 * The failing rank also sets the peer all-reduce's abort flag (pinned host
 * memory every GPU reads), which ends its kernels' waits.
 *
 * A step: the host packs the step's inputs (token ids, positions, slots,
 * block tables, attention work items, logit rows, sampling parameters) into
 * one pinned buffer at fixed offsets and each rank copies it in one
 * transfer; the layers run on the rank's stream; the LM head runs for the
 * rows that need logits only (f32 logits). Tokens are chosen on the device
 * and only they come back: greedy rows by argmax (cuda_argmax_lse, or the
 * distributed argmax with N > 1); rows with temperature, top-k/p, min-p,
 * penalties or top logprobs by the device sampler (cuda_sample, one GPU),
 * which does what model_sample() does with the uniform number the host drew
 * from the request's RNG where model_sample would draw it, so a seeded
 * request follows the CPU backend's RNG stream; a row whose candidate set is
 * too large to sort on the device is finished by model_sample on the host
 * (exact, rare). With N > 1 such rows, rows with a logit_bias or a JSON-mode
 * mask, and rows
 * whose raw logits a test asks for (logits_out), copy their logit row (each
 * rank its slice) to the host and model_sample() picks there.
 *
 * Prefill attention runs on the tensor cores (items of up to 128 query rows)
 * where the head shape allows, else on the SIMT kernel; decode-only steps take
 * the decode kernel (attn.cu: split-K whose last split merges the others, so
 * no combine launch; RoPE and the KV write folded in, so no RoPE launch
 * either) where it takes the head shape. With the GEMVs, SwiGLU rides in the
 * gate|up GEMV's epilogue.
 *
 * Decode-only steps (every sequence one token) run as a CUDA graph (per rank,
 * NCCL calls included) captured once per batch-size bucket (1, 2, 4, ...
 * max_seqs): the step is padded to the bucket with tokens that write the
 * backend's private pad block and are never read. --enforce-eager
 * (opts->enforce_eager) turns graphs off.
 *
 * KV memory, per rank: per layer K then V, each
 * [n_blocks + 1][block_size][n_kv_heads / N][head_dim] bf16, or fp8 e4m3
 * (--kv-cache-dtype fp8: half the bytes per token, so twice the tokens in the
 * same memory; written by RoPE's KV write, widened to bf16 exactly by every
 * attention kernel as it loads); the last block is the pad block.
 *
 * Memory: weights, KV, activations for max_tokens_per_step tokens, logits for
 * max_seqs_per_step rows and the pinned staging buffers are allocated at
 * creation and kv_alloc; forward() allocates nothing.
 *
 * Settings that are not flags come from cuda_tuning (tuning.h), copied at
 * creation. Testing aid: tp_fault_rank / tp_fault_step make a rank fail its
 * STEP-th forward (counted from 1) before enqueueing anything, as a dead GPU
 * would, while the other ranks wait in their collectives. Benchmark aids
 * (outputs wrong): tp_skip_comm leaves the collectives out, so the
 * difference in step time is what they cost; ablate leaves kernels out.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "cuda/qgemm.h"
#include "cuda/tuning.h"
#include "model/backend.h"

#define NBUCKET 10
#define MAX_TP 16

/* A projection whose weight is packed, in whole or in part (qgemm.h): its
 * parts in output order, each packed (w NULL: q) or bf16 (w [rows][in]),
 * writing output columns [off, off + rows). Parts packed alike are fused
 * into one packed matrix at upload; parts that differ run one by one. */
struct qpart {
    struct cuda_qmat q;
    uint16_t *w;
    int rows, off;
};
struct qproj {
    int n; /* 0: the projection is bf16 (clayer's pointer) */
    struct qpart p[3];
};

struct clayer {
    struct qproj qqkv, qo, qgu, qdown; /* packed weights: the bf16 pointer below is then NULL */
    uint16_t *wqkv;     /* [(H + 2 KVH) D / N][E] bf16, device: this rank's q, k, v rows */
    uint16_t *wo;       /* [E][H D / N]: this rank's columns */
    uint16_t *wgu;      /* [2F / N][E]: this rank's gate rows then its up rows */
    uint16_t *wdown;    /* [E][F / N] */
    float *attn_norm, *ffn_norm; /* [E] f32, device */
    float *bqkv;        /* [(H + 2 KVH) D / N] or NULL */
    float *q_norm, *k_norm; /* [D] or NULL */
};

/* Offsets (in bytes) of the per-step inputs inside hin/din; max_items:
 * the attention items the items region holds. */
struct inlay {
    size_t slots, ids, pos, tok_part, tok_nsplit, rows, n_items, items, bt, srows, pen, total;
    int max_items;
};

struct cuda_backend;

/* One GPU's share of the model and its working memory. */
struct rank {
    struct cuda_backend *b;
    int id, dev;
    int v0, vn;                     /* vocabulary rows [v0, v0 + vn) of tok_embd / lm_head */
    int H, KVH, F;                  /* this rank's heads, KV heads, FFN width */
    cudaStream_t st;
    cublasHandle_t blas;
    void *blas_ws;
    ncclComm_t comm;                /* NULL when N == 1 or after an abort */

    uint16_t *tok_embd, *lm_head;   /* [vn][E] bf16 (the same when tied); lm_head NULL when packed */
    struct qproj qhead;             /* a packed LM head */
    void **qmem;                    /* device allocations of packed weights and their bf16 parts */
    int n_qmem, cap_qmem;
    struct cuda_qgemm_ws qws;       /* cuda_qgemm's workspace (packed weights only) */
    float *out_norm;                /* [E] */
    struct clayer *L;               /* [n_layer] */
    float *rope_cos, *rope_sin;     /* [max_ctx][rope_dim/2] */
    uint16_t *kv;                   /* see the file comment (bf16, or fp8 e4m3 bytes when b->kv8) */
    size_t kv_layer;                /* elements of one layer's K (or V) */

    /* activations, [max_tokens] rows unless said otherwise, device */
    float *x;                       /* [E] f32 residual */
    uint16_t *xn, *qkv, *q, *att, *delta, *gu, *h; /* [E], [QKV/N], [Q/N], [Q/N], [E], [2F/N], [F/N] */
    float *deltaf;                  /* [E] f32 partial sums before the all-reduce (N > 1) */
    float *pbuf[3];                 /* the peer all-reduce's inputs, [peer_elems] f32 each (b->peer): the
                                       o projection's, the down projection's, the embedding's */
    unsigned *pflags, *pepoch;      /* its flags and call counters (kernels.h) */
    uint16_t *hfin;                 /* [max_seqs][E] */
    float *logits;                  /* [max_seqs][vn] */
    struct cuda_argmax_part *amp;   /* [CUDA_ARGMAX_SLICES][max_seqs]: the argmax's partial reductions */
    struct cuda_argmax_part *amp_all; /* [N][max_seqs] every rank's, after the all-gather */
    int32_t *tok;                   /* [max_seqs] greedy tokens */
    float *lp;                      /* [max_seqs] their logprobs */
    struct cuda_sample_out *sout;   /* [max_seqs] device sampler results (rank 0, N == 1) */
                                    /* (rank 0's three: b->hout, mapped host memory) */
    float *part;                    /* attention split partials */
    int32_t *cnt;                   /* [max_tokens][KVH] the decode attention's split tickets (zero at rest) */
    uint32_t *hw;                   /* [F] cuda_gemv_mlp's tagged h (one token) */
    uint8_t *din;                   /* device mirror of the backend's hin */
    cudaGraphExec_t gexec[NBUCKET];

    pthread_t th;                   /* ranks >= 1 */
    bool th_started;
    long steps;                     /* forwards run, for tuning.tp_fault_step */
    int rc;                         /* last job's result */
    char err[512];
};

enum job { JOB_INIT, JOB_KV, JOB_FORWARD, JOB_EXIT };
enum { ROW_GREEDY, ROW_SAMPLE, ROW_HOST }; /* who picks a logit row's token */

struct cuda_backend {
    struct model_backend base;
    struct model_config c;
    const struct model_weights *w;
    int tp;
    int max_tokens, max_seqs, max_ctx, n_sm;
    int kv_blocks, block_size;
    struct rank *r;                 /* [tp] */

    /* step inputs: one pinned (portable) host buffer every rank copies from */
    struct inlay lay;               /* the current step's (step_lay) */
    struct inlay lay_full;          /* for steps of up to max_tokens tokens */
    uint8_t *hin;
    int bt_cap, part_rows;
    /* a step's results: greedy tokens, their logprobs, the device sampler's
     * rows, in one block of mapped host memory that rank 0's kernels write
     * (a decode step ends with its last kernel, not with copies back) */
    uint8_t *hout, *dout;           /* the block; its device address */
    int32_t *hout_tok;              /* [max_seqs] in hout */
    float *hout_lp;                 /* [max_seqs] in hout */
    float *hlog;                    /* [max_seqs][V] pinned: rows sampled on the host */
    bool *row_host;                 /* [max_seqs] row r's raw logits go to hlog (logits_out, host sampling) */
    uint8_t *row_mode;              /* [max_seqs] ROW_GREEDY, ROW_SAMPLE (device sampler) or ROW_HOST */
    uint64_t *rng_before;           /* [max_seqs] a ROW_SAMPLE row's RNG state before its draw */
    struct cuda_sample_out *hsout;  /* [max_seqs] in hout */
    int32_t *pen_mark;              /* [n_vocab] zeroed scratch for cuda_sample_pen_build */
    int pen_cap;                    /* penalty entries the step buffer holds */
    bool dev_sample;                /* sampling on the device (N == 1) */
    bool kv8;                       /* fp8 e4m3 KV cache (--kv-cache-dtype fp8) */
    void *samp;                     /* model_sample scratch, samp_bytes per host thread */
    size_t samp_bytes;
    int nt;                         /* host threads sampling rows (OpenMP) */
    int *host_rows;                 /* [max_seqs] rows model_sample picks this step */
    int *row_seq, *tok_seq;         /* host scratch */

    struct cuda_tuning t;           /* cuda_tuning as it was at creation */
    bool graphs;                    /* decode steps as CUDA graphs (off with --enforce-eager) */
    bool fused;                     /* one-token decode steps through the fused norm+GEMV,
                                       GEMV+SwiGLU and GEMV+residual kernels (N > 1: the residual add in the
                                       peer all-reduce, when it is taken), where the shape allows: on the
                                       warp kernels they measured 217.5 -> 221.5 tok/s at batch 1; at 2-4
                                       tokens 5.56-6.64 ms a step against 4.73-4.78 unfused, so one token only */
    bool qlayers;                   /* some layer has a packed weight: its steps take the unfused kernels */
    bool warmup, warming;           /* warmup() still to run at the next kv_alloc (t.warmup); running */
    int tc_rows;                    /* rows per prefill attention item on the tensor cores (CUDA_ATTN_TC_ROWS),
                                       0 where the head shape does not allow them: the SIMT kernel */
    int bucket[NBUCKET], n_bucket;

    /* the current job's arguments (written by the caller before the crew starts) */
    struct {
        int kv_blocks, block_size;                  /* JOB_KV */
        int Tp, R, n_items, gi;                     /* JOB_FORWARD */
        bool decode;
        int max_rows;                               /* attention rows per item of this step */
        int pstride;                                /* its split partials' stride (0: MAXSPLIT) */
        int n_samp, n_pen;                          /* ROW_SAMPLE rows, their penalty entries */
        size_t nbytes;
    } job;

    /* the crew: ranks 1 .. tp-1 wait for gen to change, run job, count left down */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    atomic_uint gen;
    atomic_int left;
    enum job cur;
    bool crew;                      /* mu/go/done initialized */
    atomic_int failed;              /* a rank failed: the others abort their communicators */
    char dead[600];                 /* why the backend stopped (base.fatal points here) */
    bool skip_comm;                 /* t.tp_skip_comm with N > 1 (benchmarks only) */
    bool peer;                      /* all-reduces of up to peer_elems floats by cuda_peer_allreduce (N > 1,
                                       peer access between every pair, t.tp_peer_allreduce) */
    size_t peer_elems;              /* (8 MiB / (N - 1)) / 4, at most max_tokens x E */
    int *peer_abort;                /* pinned, mapped: set when a rank fails, ends the kernel's waits */
};

#define CK(call)                                                                                     \
    do {                                                                                             \
        cudaError_t e_ = (call);                                                                     \
        if (e_ != cudaSuccess) {                                                                     \
            sl_seterr(err, errlen, "%s failed: %s (%s, %s:%d)", #call, cudaGetErrorString(e_), __func__, \
                   __FILE__, __LINE__);                                                              \
            goto fail;                                                                               \
        }                                                                                            \
    } while (0)
#define CB(call)                                                                                     \
    do {                                                                                             \
        cublasStatus_t s_ = (call);                                                                  \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                           \
            sl_seterr(err, errlen, "%s failed: %s (%s, %s:%d)", #call, cublasGetStatusString(s_),       \
                   __func__, __FILE__, __LINE__);                                                    \
            goto fail;                                                                               \
        }                                                                                            \
    } while (0)
#define NC(call)                                                                                     \
    do {                                                                                             \
        ncclResult_t n_ = (call);                                                                    \
        if (n_ != ncclSuccess) {                                                                     \
            sl_seterr(err, errlen, "%s failed: %s (%s, %s:%d)", #call, ncclGetErrorString(n_), __func__, \
                   __FILE__, __LINE__);                                                              \
            goto fail;                                                                               \
        }                                                                                            \
    } while (0)

bool model_cuda_available(void)
{
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

/* ---- construction -------------------------------------------------------------- */

static size_t kv_block_bytes(model_backend *mb, int block_size);
static int kv_alloc(model_backend *mb, int n_blocks, int block_size, char *err, size_t errlen);
static int forward(model_backend *mb, struct step *s, char *err, size_t errlen);
static int warmup(struct cuda_backend *b, char *err, size_t errlen);
static void destroy(model_backend *mb);
static int crew_run(struct cuda_backend *b, enum job job, char *err, size_t errlen);
static int rank_wait(struct rank *k, char *err, size_t errlen);

static const struct model_backend_ops cuda_ops = {
    .name = "cuda",
    .kv_block_bytes = kv_block_bytes,
    .kv_alloc = kv_alloc,
    .forward = forward,
    .destroy = destroy,
};

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#define STAGE_ELEMS ((size_t)16 << 20) /* elements per staging transfer (32 MB of bf16) */

/* Copies rows [r0, r0 + nr) x columns [c0, c0 + nc) of t, a matrix of `cols`
 * columns, as bf16 [nr][nc] to dst (device). stage: pinned [STAGE_ELEMS]
 * bf16; tmp: host [STAGE_ELEMS] f32. Quantized rows are dequantized whole,
 * so blocks are never split. */
static int upload_bf16(const struct model_tensor *t, int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                       uint16_t *dst, uint16_t *stage, float *tmp, char *err, size_t errlen)
{
    int64_t rows_per = (int64_t)(STAGE_ELEMS / (size_t)cols);
    if (rows_per < 1) {
        sl_seterr(err, errlen, "tensor %s: rows too long to stage", t->name ? t->name : "?");
        return SL_EUNSUP;
    }
    for (int64_t a = 0; a < nr; a += rows_per) {
        int64_t n = nr - a < rows_per ? nr - a : rows_per;
        if (t->dtype == MODEL_DT_BF16) {
            const uint16_t *src = (const uint16_t *)t->data;
#pragma omp parallel for schedule(static)
            for (int64_t r = 0; r < n; r++)
                memcpy(stage + r * nc, src + (r0 + a + r) * cols + c0, (size_t)nc * 2);
        } else {
#pragma omp parallel for schedule(dynamic, 16)
            for (int64_t r = 0; r < n; r++) {
                float *row = tmp + r * cols;
                model_tensor_to_f32(t, (r0 + a + r) * cols, cols, row);
                for (int64_t i = 0; i < nc; i++) stage[r * nc + i] = to_bf16(row[c0 + i]);
            }
        }
        cudaError_t e = cudaMemcpy(dst + a * nc, stage, (size_t)(n * nc) * 2, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) {
            sl_seterr(err, errlen, "upload %s: %s", t->name ? t->name : "?", cudaGetErrorString(e));
            return SL_EDEVICE;
        }
    }
    return 0;
}

/* Copies elements [off, off + n) of t as f32 to dst (device). */
static int upload_f32(const struct model_tensor *t, int64_t off, int64_t n, float *dst, char *err, size_t errlen)
{
    float *h = malloc((size_t)(off + n) * sizeof *h);
    if (!h) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    model_tensor_to_f32(t, 0, off + n, h);
    cudaError_t e = cudaMemcpy(dst, h + off, (size_t)n * sizeof *h, cudaMemcpyHostToDevice);
    free(h);
    if (e != cudaSuccess) {
        sl_seterr(err, errlen, "upload %s: %s", t->name ? t->name : "?", cudaGetErrorString(e));
        return SL_EDEVICE;
    }
    return 0;
}

static int dmalloc(void **p, size_t n, char *err, size_t errlen)
{
    cudaError_t e = cudaMalloc(p, n ? n : 16);
    if (e != cudaSuccess) {
        *p = NULL;
        sl_seterr(err, errlen, "cudaMalloc(%.2f GB) failed: %s", n / 1e9, cudaGetErrorString(e));
        return SL_ENOMEM;
    }
    return 0;
}

/* ---- packed weights -------------------------------------------------------------- */

/* A device copy of src[0..n) recorded in k->qmem (rank_free frees it). */
static void *qdup(struct rank *k, const void *src, size_t n, char *err, size_t errlen)
{
    if (k->n_qmem == k->cap_qmem) {
        int cap = k->cap_qmem ? 2 * k->cap_qmem : 64;
        void **m = realloc(k->qmem, (size_t)cap * sizeof *m);
        if (!m) {
            sl_seterr(err, errlen, "out of host memory");
            return NULL;
        }
        k->qmem = m, k->cap_qmem = cap;
    }
    void *d;
    if (dmalloc(&d, n, err, errlen)) return NULL;
    k->qmem[k->n_qmem++] = d;
    if (src) {
        cudaError_t e = cudaMemcpy(d, src, n, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) {
            sl_seterr(err, errlen, "upload of a packed weight: %s", cudaGetErrorString(e));
            return NULL;
        }
    }
    return d;
}

/* Whether two repacked blocks can be stacked into one packed matrix. */
static bool qcompat(const struct model_qrepack *a, const struct model_qrepack *b)
{
    return a->bits == b->bits && a->cols == b->cols && a->group == b->group && a->n_groups == b->n_groups &&
           a->row_bytes == b->row_bytes && a->f16 == b->f16 && !a->perm && !b->perm;
}

/* rp[0..n) (compatible, or n == 1) stacked by rows into one packed matrix
 * on the device. A block without zero codes gets 2^(bits-1) where another
 * has them. */
static int qmat_upload(struct rank *k, const struct model_qrepack *rp, int n, struct cuda_qmat *out, char *err,
                       size_t errlen)
{
    int64_t rows = 0, ng = rp[0].n_groups, rb = rp[0].row_bytes;
    bool zeros = false;
    for (int i = 0; i < n; i++) rows += rp[i].rows, zeros |= rp[i].zeros != NULL;
    uint8_t *hq = malloc((size_t)(rows * rb)), *hz = zeros ? malloc((size_t)(rows * ng)) : NULL;
    uint16_t *hs = malloc((size_t)(rows * ng) * 2);
    int rc = SL_ENOMEM;
    if (!hq || !hs || (zeros && !hz)) {
        sl_seterr(err, errlen, "out of host memory");
        goto out;
    }
    for (int64_t i = 0, r = 0; i < n; r += rp[i].rows, i++) {
        memcpy(hq + r * rb, rp[i].qw, (size_t)(rp[i].rows * rb));
        memcpy(hs + r * ng, rp[i].scales, (size_t)(rp[i].rows * ng) * 2);
        if (!zeros) continue;
        if (rp[i].zeros) memcpy(hz + r * ng, rp[i].zeros, (size_t)(rp[i].rows * ng));
        else memset(hz + r * ng, 1 << (rp[i].bits - 1), (size_t)(rp[i].rows * ng));
    }
    *out = (struct cuda_qmat){.bits = rp[0].bits, .rows = (int)rows, .cols = (int)rp[0].cols, .group = rp[0].group,
                              .n_groups = (int)ng, .row_bytes = (int)rb, .f16 = rp[0].f16};
    rc = SL_EDEVICE;
    if (!(out->qw = qdup(k, hq, (size_t)(rows * rb), err, errlen)) ||
        !(out->scales = qdup(k, hs, (size_t)(rows * ng) * 2, err, errlen)) ||
        (zeros && !(out->zeros = qdup(k, hz, (size_t)(rows * ng), err, errlen))) ||
        (rp[0].perm && !(out->perm = qdup(k, rp[0].perm, (size_t)rp[0].cols * 4, err, errlen))))
        goto out;
    rc = 0;
out:
    free(hq), free(hs), free(hz);
    return rc;
}

/* One projection's weight on rank k: parts i < n are rows [r0[i], r0[i] +
 * nr[i]) x columns [c0, c0 + nc) of t[i] (a matrix of `cols` columns),
 * stacked in order. With every part bf16 (or another dense or GGUF dtype):
 * one bf16 matrix into *dense, as always. With any part packed: *dense
 * NULL and the parts in P, fused into one packed matrix when all are
 * packed alike (the same bits, group, scale dtype, no act-order), else
 * each on its own (a packed part the device layout cannot hold exactly is
 * dequantized to bf16, said on stderr). A column range that cuts a group
 * is an error naming the tensor. */
static int upload_proj(struct rank *k, const struct model_tensor *const *t, const int64_t *r0, const int64_t *nr,
                       int n, int64_t cols, int64_t c0, int64_t nc, uint16_t **dense, struct qproj *P,
                       uint16_t *stage, float *tmp, char *err, size_t errlen)
{
    struct model_qrepack rp[3];
    bool packed[3] = {false, false, false}, any = false, fuse = true;
    int64_t tot = 0;
    int rc = 0;
    memset(rp, 0, sizeof rp);
    memset(P, 0, sizeof *P);
    *dense = NULL;
    for (int i = 0; i < n; i++) {
        tot += nr[i];
        if (t[i]->dtype != MODEL_DT_QPACK) continue;
        char why[256];
        rc = model_quant_repack(t[i], r0[i], nr[i], c0, nc, &rp[i], why, sizeof why);
        if (rc == SL_EUNSUP) {
            if (k->id == 0) fprintf(stderr, "cuda: %s: dequantized to bf16 at upload\n", why);
            rc = 0;
            continue;
        }
        if (rc) {
            sl_seterr(err, errlen, "cuda: %s", why);
            goto out;
        }
        packed[i] = any = true;
    }
    if (!any) {
        if ((rc = dmalloc((void **)dense, (size_t)(tot * nc) * 2, err, errlen))) goto out;
        for (int64_t i = 0, off = 0; i < n; off += nr[i], i++)
            if ((rc = upload_bf16(t[i], cols, r0[i], nr[i], c0, nc, *dense + off * nc, stage, tmp, err, errlen)))
                goto out;
        goto out;
    }
    for (int i = 0; i < n; i++) fuse &= packed[i] && (n == 1 || qcompat(&rp[0], &rp[i]));
    if (fuse) {
        P->n = 1;
        P->p[0].rows = (int)tot;
        rc = qmat_upload(k, rp, n, &P->p[0].q, err, errlen);
        goto out;
    }
    P->n = n;
    for (int64_t i = 0, off = 0; i < n; off += nr[i], i++) {
        P->p[i].rows = (int)nr[i], P->p[i].off = (int)off;
        if (packed[i]) {
            rc = qmat_upload(k, &rp[i], 1, &P->p[i].q, err, errlen);
        } else {
            rc = SL_EDEVICE;
            if ((P->p[i].w = qdup(k, NULL, (size_t)(nr[i] * nc) * 2, err, errlen)))
                rc = upload_bf16(t[i], cols, r0[i], nr[i], c0, nc, P->p[i].w, stage, tmp, err, errlen);
        }
        if (rc) goto out;
    }
out:
    for (int i = 0; i < n; i++) model_qrepack_free(&rp[i]);
    return rc;
}

/* What cuda_qgemm's workspace must hold for P's packed parts: *deq bytes
 * of bf16 tiles (whole matrices up to 64 MB, else tiles of that size, at
 * least 16 rows; whole: the whole matrix, for the gate|up matrix that long
 * steps dequantize for the warpgroup GEMM), *xp act-order activations. */
static void qws_need(const struct qproj *P, bool whole, size_t *deq, size_t *xp)
{
    for (int i = 0; i < P->n; i++) {
        const struct cuda_qmat *q = &P->p[i].q;
        if (P->p[i].w) continue;
        size_t row = (size_t)q->cols * 2, rows = whole ? (size_t)q->rows : ((size_t)64 << 20) / row;
        if (rows < 16) rows = 16;
        if (rows > (size_t)q->rows) rows = (size_t)q->rows;
        if (rows * row > *deq) *deq = rows * row;
        if (q->perm && (size_t)CUDA_QGEMV_MMA_MAX_T * q->cols > *xp) *xp = (size_t)CUDA_QGEMV_MMA_MAX_T * q->cols;
    }
}

/* The RoPE tables, computed exactly as the CPU backend does (double, then f32). */
static int rope_tables(struct rank *k, char *err, size_t errlen)
{
    const struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    int half = c->rope_dim / 2;
    double *inv = malloc((size_t)half * sizeof *inv);
    float *cs = malloc((size_t)b->max_ctx * half * sizeof *cs), *sn = malloc((size_t)b->max_ctx * half * sizeof *sn);
    int rc = SL_ENOMEM;
    if (!inv || !cs || !sn) {
        sl_seterr(err, errlen, "out of host memory");
        goto out;
    }
    model_rope_inv_freq(c, b->w, inv);
#pragma omp parallel for schedule(static)
    for (int p = 0; p < b->max_ctx; p++)
        for (int i = 0; i < half; i++) {
            double a = (double)p * inv[i];
            cs[(size_t)p * half + i] = (float)cos(a);
            sn[(size_t)p * half + i] = (float)sin(a);
        }
    size_t bytes = (size_t)b->max_ctx * half * sizeof(float);
    if ((rc = dmalloc((void **)&k->rope_cos, bytes, err, errlen)) ||
        (rc = dmalloc((void **)&k->rope_sin, bytes, err, errlen)))
        goto out;
    rc = SL_EDEVICE;
    if (cudaMemcpy(k->rope_cos, cs, bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(k->rope_sin, sn, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        sl_seterr(err, errlen, "upload of the RoPE tables failed");
        goto out;
    }
    rc = 0;
out:
    free(inv);
    free(cs);
    free(sn);
    return rc;
}

struct cuda_tuning cuda_tuning = CUDA_TUNING_DEFAULTS;

/* cuda_tuning.ablate from a benchmark's option: kernels to leave out of
 * every step, to measure what each costs inside the decode graph (the step
 * time without it) */
int cuda_ablate_parse(const char *s)
{
    static const char *const names[] = {"attn", "norm", "qkv", "o", "gu", "down", "head"};
    int m = 0;
    while (s && *s) {
        size_t n = strcspn(s, ",");
        int bit = 0;
        for (int i = 0; i < 7; i++)
            if (strlen(names[i]) == n && !strncmp(s, names[i], n)) bit = 1 << i;
        if (!bit) return -1;
        m |= bit;
        s += n + (s[n] == ',');
    }
    return m;
}

/* Rank k's part of creation, on its own thread: stream, cuBLAS, its shard
 * of the weights, RoPE tables and activations. */
static int rank_init(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    const struct model_weights *w = b->w;
    uint16_t *stage = NULL;
    float *tmp = NULL;
    int N = b->tp, id = k->id;
    CK(cudaSetDevice(k->dev));
    CK(cudaStreamCreateWithFlags(&k->st, cudaStreamNonBlocking));
    CK(cuda_attention_prepare(c->head_dim));
    CK(cuda_gemm_wg_prepare());
    CB(cublasCreate(&k->blas));
    CB(cublasSetStream(k->blas, k->st));
    /* a fixed workspace: cuBLAS then never allocates, inside graph capture too */
    if (dmalloc(&k->blas_ws, (size_t)32 << 20, err, errlen)) goto fail;
    CB(cublasSetWorkspace(k->blas, k->blas_ws, (size_t)32 << 20));

    size_t E = c->n_embd, D = c->head_dim, H = c->n_head, KVH = c->n_head_kv, F = c->n_ff;
    size_t Q = H * D, KV = KVH * D;
    size_t Hl = H / N, KVl = KVH / N * D, Ql = Hl * D, Fl = F / N, QKVl = Ql + 2 * KVl;
    k->H = (int)Hl, k->KVH = (int)(KVH / N), k->F = (int)Fl;
    int64_t vper = (c->n_vocab + N - 1) / N;
    k->v0 = (int)(vper * id);
    k->vn = (int)(c->n_vocab - k->v0 < vper ? c->n_vocab - k->v0 : vper);
    CK(cudaMallocHost((void **)&stage, STAGE_ELEMS * 2));
    tmp = malloc(STAGE_ELEMS * sizeof *tmp);
    k->L = calloc((size_t)c->n_layer, sizeof *k->L);
    if (!tmp || !k->L) {
        sl_seterr(err, errlen, "out of host memory");
        goto fail;
    }
#define MAT(dst, t, cols, r0, nr, c0, nc)                                                           \
    do {                                                                                           \
        if (upload_bf16((t), (cols), (r0), (nr), (c0), (nc), (dst), stage, tmp, err, errlen)) goto fail; \
    } while (0)
#define VEC(dst, t, off, n)                                                                        \
    do {                                                                                           \
        if (dmalloc((void **)&(dst), (n) * sizeof(float), err, errlen) ||                          \
            upload_f32((t), (int64_t)(off), (int64_t)(n), (dst), err, errlen))                     \
            goto fail;                                                                             \
    } while (0)
    size_t vn = (size_t)k->vn, v0 = (size_t)k->v0;
    if (dmalloc((void **)&k->tok_embd, vn * E * 2, err, errlen)) goto fail;
    MAT(k->tok_embd, &w->tok_embd, E, v0, vn, 0, E);
    if (c->tie_embeddings) {
        k->lm_head = k->tok_embd;
    } else {
        const struct model_tensor *th[1] = {&w->lm_head};
        int64_t h0[1] = {(int64_t)v0}, hn[1] = {(int64_t)vn};
        if (upload_proj(k, th, h0, hn, 1, E, 0, E, &k->lm_head, &k->qhead, stage, tmp, err, errlen)) goto fail;
    }
    VEC(k->out_norm, &w->out_norm, 0, E);
    for (int l = 0; l < c->n_layer; l++) {
        const struct model_layer_weights *lw = &w->layers[l];
        struct clayer *L = &k->L[l];
        /* column-parallel q|k|v and gate|up (rows of each part), row-parallel o and down (columns) */
        const struct model_tensor *tqkv[3] = {&lw->wq, &lw->wk, &lw->wv}, *to[1] = {&lw->wo},
                                  *tgu[2] = {&lw->w_gate, &lw->w_up}, *td[1] = {&lw->w_down};
        int64_t qkv0[3] = {(int64_t)(id * Ql), (int64_t)(id * KVl), (int64_t)(id * KVl)},
                qkvn[3] = {(int64_t)Ql, (int64_t)KVl, (int64_t)KVl}, z0[1] = {0}, En[1] = {(int64_t)E},
                gu0[2] = {(int64_t)(id * Fl), (int64_t)(id * Fl)}, gun[2] = {(int64_t)Fl, (int64_t)Fl};
        if (upload_proj(k, tqkv, qkv0, qkvn, 3, E, 0, E, &L->wqkv, &L->qqkv, stage, tmp, err, errlen) ||
            upload_proj(k, to, z0, En, 1, Q, id * Ql, Ql, &L->wo, &L->qo, stage, tmp, err, errlen) ||
            upload_proj(k, tgu, gu0, gun, 2, E, 0, E, &L->wgu, &L->qgu, stage, tmp, err, errlen) ||
            upload_proj(k, td, z0, En, 1, F, id * Fl, Fl, &L->wdown, &L->qdown, stage, tmp, err, errlen))
            goto fail;
        VEC(L->attn_norm, &lw->attn_norm, 0, E);
        VEC(L->ffn_norm, &lw->ffn_norm, 0, E);
        if (c->qkv_bias) {
            if (dmalloc((void **)&L->bqkv, QKVl * sizeof(float), err, errlen) ||
                upload_f32(&lw->bq, (int64_t)(id * Ql), (int64_t)Ql, L->bqkv, err, errlen) ||
                upload_f32(&lw->bk, (int64_t)(id * KVl), (int64_t)KVl, L->bqkv + Ql, err, errlen) ||
                upload_f32(&lw->bv, (int64_t)(id * KVl), (int64_t)KVl, L->bqkv + Ql + KVl, err, errlen))
                goto fail;
        }
        if (c->qk_norm) {
            VEC(L->q_norm, &lw->q_norm, 0, D);
            VEC(L->k_norm, &lw->k_norm, 0, D);
        }
    }
#undef MAT
#undef VEC
    (void)KV;
    cudaFreeHost(stage);
    stage = NULL;
    free(tmp);
    tmp = NULL;
    if (rope_tables(k, err, errlen)) goto fail;
    {
        size_t deq = 0, xp = 0;
        /* sm_90 prefill steps dequantize a packed gate|up matrix whole for the
         * warpgroup GEMM with SwiGLU fused (as bf16 weights take it) */
        bool wg = b->max_tokens >= b->t.gemm_wg_min_t && cuda_gemm_wg_ok(b->max_tokens, (int)E, (int)(2 * Fl));
        qws_need(&k->qhead, false, &deq, &xp);
        for (int l = 0; l < c->n_layer; l++) {
            qws_need(&k->L[l].qqkv, false, &deq, &xp), qws_need(&k->L[l].qo, false, &deq, &xp);
            qws_need(&k->L[l].qgu, wg && k->L[l].qgu.n == 1, &deq, &xp), qws_need(&k->L[l].qdown, false, &deq, &xp);
        }
        if (deq && (dmalloc((void **)&k->qws.deq, deq, err, errlen) ||
                    (xp && dmalloc((void **)&k->qws.xperm, xp * 2, err, errlen))))
            goto fail;
        k->qws.deq_bytes = deq, k->qws.xperm_elems = xp;
    }

    size_t T = b->max_tokens, S = b->max_seqs;
    if (dmalloc((void **)&k->x, T * E * 4, err, errlen) || dmalloc((void **)&k->xn, T * E * 2, err, errlen) ||
        dmalloc((void **)&k->qkv, T * QKVl * 2, err, errlen) || dmalloc((void **)&k->q, T * Ql * 2, err, errlen) ||
        dmalloc((void **)&k->att, T * Ql * 2, err, errlen) || dmalloc((void **)&k->delta, T * E * 2, err, errlen) ||
        dmalloc((void **)&k->gu, T * 2 * Fl * 2, err, errlen) || dmalloc((void **)&k->h, T * Fl * 2, err, errlen) ||
        dmalloc((void **)&k->hfin, S * E * 2, err, errlen) || dmalloc((void **)&k->logits, S * vn * 4, err, errlen) ||
        dmalloc((void **)&k->part, (size_t)b->part_rows * k->KVH * CUDA_ATTN_MAXSPLIT * (D + 2) * 4, err, errlen))
        goto fail;
    if (k->id == 0) {
        k->tok = (int32_t *)b->dout, k->lp = (float *)(b->dout + S * 4);
        k->sout = (struct cuda_sample_out *)(b->dout + S * 8);
    } else if (dmalloc((void **)&k->tok, S * 4, err, errlen) || dmalloc((void **)&k->lp, S * 4, err, errlen) ||
               dmalloc((void **)&k->sout, S * sizeof *k->sout, err, errlen)) {
        goto fail;
    }
    if (dmalloc((void **)&k->amp, CUDA_ARGMAX_SLICES * S * sizeof *k->amp, err, errlen) ||
        dmalloc((void **)&k->cnt, T * k->KVH * 4, err, errlen) ||
        dmalloc((void **)&k->hw, Fl * sizeof *k->hw, err, errlen))
        goto fail;
    CK(cudaMemset(k->cnt, 0, T * k->KVH * 4));
    CK(cudaMemset(k->hw, 0, Fl * sizeof *k->hw));
    if (N > 1 && (dmalloc((void **)&k->deltaf, T * E * 4, err, errlen) ||
                  dmalloc((void **)&k->amp_all, (size_t)N * S * sizeof *k->amp_all, err, errlen)))
        goto fail;
    if (b->peer) {
        /* once per pair and process (a later backend finds it on) */
        static _Atomic uint32_t peer_on[MAX_TP];
        for (int p = 0; p < N; p++) {
            uint32_t bit = 1u << b->r[p].dev;
            if (p == k->id || (atomic_load(&peer_on[k->dev]) & bit)) continue;
            cudaError_t e = cudaDeviceEnablePeerAccess(b->r[p].dev, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
            else CK(e);
            atomic_fetch_or(&peer_on[k->dev], bit);
        }
        size_t fb = (size_t)CUDA_PEER_BLOCKS * CUDA_PEER_MAX * 4;
        for (int i = 0; i < 3; i++)
            if (dmalloc((void **)&k->pbuf[i], b->peer_elems * 4, err, errlen)) goto fail;
        if (dmalloc((void **)&k->pflags, fb, err, errlen) ||
            dmalloc((void **)&k->pepoch, CUDA_PEER_BLOCKS * 4, err, errlen))
            goto fail;
        CK(cudaMemset(k->pflags, 0, fb));
        CK(cudaMemset(k->pepoch, 0, CUDA_PEER_BLOCKS * 4));
    }
    if (N > 1) {
        /* NCCL connects its peers on the first collective, which cannot
         * happen inside a graph capture: one eager all-reduce and all-gather
         * now (all ranks initialize concurrently) */
        CK(cudaMemsetAsync(k->deltaf, 0, E * 4, k->st));
        NC(ncclAllReduce(k->deltaf, k->deltaf, E, ncclFloat, ncclSum, k->comm, k->st));
        NC(ncclAllGather(k->amp, k->amp_all, S * sizeof *k->amp / 4, ncclInt32, k->comm, k->st));
        if (rank_wait(k, err, errlen)) goto fail;
    }
    return 0;
fail:
    if (stage) cudaFreeHost(stage);
    free(tmp);
    return SL_EDEVICE;
}

/* Decides b->peer (before the ranks initialize: they enable peer access and
 * allocate the buffers): N <= CUDA_PEER_MAX ranks with peer access between
 * every pair, and t.tp_peer_allreduce. The abort flag lives in pinned
 * host memory mapped into every device. */
static int peer_setup(struct cuda_backend *b, char *err, size_t errlen)
{
    b->peer = b->tp <= CUDA_PEER_MAX && b->t.tp_peer_allreduce;
    for (int i = 0; i < b->tp && b->peer; i++)
        for (int j = 0; j < b->tp && b->peer; j++) {
            int ok = 0;
            if (i != j && (cudaDeviceCanAccessPeer(&ok, b->r[i].dev, b->r[j].dev) != cudaSuccess || !ok))
                b->peer = false;
        }
    if (!b->peer) return 0;
    /* each rank reads N - 1 peers' buffers, a ring all-reduce moves about
     * twice one buffer: the bound shrinks with N (8 MiB measured at N = 2
     * only: every decode step's all-reduces fit, and up to there the one
     * launch beat NCCL's) */
    size_t bytes = ((size_t)8 << 20) / (size_t)(b->tp - 1);
    b->peer_elems = bytes / 4;
    if (b->peer_elems > (size_t)b->max_tokens * b->c.n_embd) b->peer_elems = (size_t)b->max_tokens * b->c.n_embd;
    CK(cudaHostAlloc((void **)&b->peer_abort, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    *b->peer_abort = 0;
    return 0;
fail:
    return SL_EDEVICE;
}

model_backend *model_cuda_backend_create(const model *m, const struct model_backend_opts *opts, char *err,
                                         size_t errlen)
{
    if (!m) {
        sl_seterr(err, errlen, "no model");
        return NULL;
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev <= 0) {
        sl_seterr(err, errlen, "no CUDA device");
        return NULL;
    }
    const struct model_config *c = model_get_config(m);
    int N = opts && opts->tensor_parallel_size > 1 ? opts->tensor_parallel_size : 1;
    if (N > ndev || N > MAX_TP) {
        sl_seterr(err, errlen, "--tensor-parallel-size %d: this host has %d GPU%s%s", N, ndev, ndev == 1 ? "" : "s",
                  N > MAX_TP ? " (and at most 16 ranks are supported)" : "");
        return NULL;
    }
    /* the plan first: a kind it lacks is the reason, whatever its shapes */
    for (int l = 0; l < c->n_layer; l++) {
        struct model_layer_kind k = model_layer_kind_of(c, l);
        if (k.mixer != MODEL_MIXER_GQA || k.ffn != MODEL_FFN_DENSE || k.resid != MODEL_RESID_PLAIN) {
            sl_seterr(err, errlen,
                      "cuda: layer %d is %s + %s%s; the GPU backend runs gqa + dense layers only (use --device cpu)", l,
                      model_mixer_name(k.mixer), model_ffn_name(k.ffn),
                      k.resid == MODEL_RESID_HC ? " with hyper-connections" : "");
            return NULL;
        }
    }
    if (model_tp_check(c, N, err, errlen)) return NULL;
    if (c->head_dim % 8 || c->head_dim > 256 || c->n_head / c->n_head_kv > CUDA_ATTN_ROWS) {
        sl_seterr(err, errlen, "cuda: head_dim %d / %d heads per KV head unsupported (head_dim %% 8 == 0, <= 256; <= %d)",
               c->head_dim, c->n_head / c->n_head_kv, CUDA_ATTN_ROWS);
        return NULL;
    }
    struct cuda_backend *b = calloc(1, sizeof *b);
    if (!b) {
        sl_seterr(err, errlen, "out of memory");
        return NULL;
    }
    b->base.ops = &cuda_ops;
    b->base.m = m;
    b->c = *c;
    b->w = model_get_weights(m);
    b->tp = N;
    if (model_kv_dtype(opts, "cuda", &b->kv8, err, errlen)) {
        free(b);
        return NULL;
    }
    b->t = cuda_tuning;
    b->skip_comm = N > 1 && b->t.tp_skip_comm;
    if (b->skip_comm) fprintf(stderr, "cuda: tp_skip_comm: collectives left out, outputs are wrong\n");
    if (b->t.ablate) fprintf(stderr, "cuda: ablate 0x%x: kernels left out, outputs are wrong\n", b->t.ablate);
    b->max_tokens = opts && opts->max_tokens_per_step > 0 ? opts->max_tokens_per_step : 2048;
    b->max_seqs = opts && opts->max_seqs_per_step > 0 ? opts->max_seqs_per_step : 256;
    if (b->max_seqs > b->max_tokens) b->max_seqs = b->max_tokens;
    b->max_ctx = opts && opts->max_ctx > 0 ? opts->max_ctx : c->n_ctx_train;
    if (b->max_ctx <= 0) b->max_ctx = 4096;
    b->graphs = !(opts && opts->enforce_eager);
    for (int l = 0; l < c->n_layer; l++) {
        const struct model_layer_weights *lw = &b->w->layers[l];
        const struct model_tensor *ts[] = {&lw->wq, &lw->wk, &lw->wv, &lw->wo, &lw->w_gate, &lw->w_up, &lw->w_down};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) b->qlayers |= ts[i]->dtype == MODEL_DT_QPACK;
    }
    /* the fused decode kernels read bf16 weights only */
    b->fused = c->n_embd % 8 == 0 && c->n_ff % 8 == 0 && (c->n_head * c->head_dim) % 8 == 0 &&
               (size_t)CUDA_GEMV_MAX_T * c->n_embd * 2 <= CUDA_GEMV_NORM_SMEM && !b->qlayers;
    b->warmup = b->t.warmup;
    b->tc_rows = cuda_attention_tc_ok(c->head_dim, c->n_head / c->n_head_kv) ? CUDA_ATTN_TC_ROWS : 0;
    b->part_rows = (int)((b->max_tokens < 256 ? b->max_tokens : 256) * (c->n_head / c->n_head_kv));
    b->r = calloc((size_t)N, sizeof *b->r);
    if (!b->r) {
        sl_seterr(err, errlen, "out of memory");
        goto fail;
    }
    for (int i = 0; i < N; i++) b->r[i] = (struct rank){.b = b, .id = i, .dev = i};
    if (N > 1 && peer_setup(b, err, errlen)) goto fail;
    /* programmatic dependent launch: with N > 1 on only with the peer
     * all-reduce, which lets the GEMV after it start loading weights (TP=2
     * batch-1 decode 326 -> 339 tok/s; with NCCL's kernels between them it
     * was no faster, 288.3 vs 288.2) */
    if (N > 1 && !b->peer) cuda_gemv_select(-1, 0, -1);
    struct cudaDeviceProp prop;
    CK(cudaSetDevice(0));
    CK(cudaGetDeviceProperties(&prop, 0));
    b->n_sm = prop.multiProcessorCount;
    if (N > 1) {
        ncclComm_t comms[MAX_TP];
        int devs[MAX_TP];
        for (int i = 0; i < N; i++) devs[i] = i;
        NC(ncclCommInitAll(comms, N, devs));
        for (int i = 0; i < N; i++) b->r[i].comm = comms[i];
        CK(cudaSetDevice(0));
    }
    size_t S = b->max_seqs, T = b->max_tokens, V = c->n_vocab;
    CK(cudaHostAlloc((void **)&b->hout, S * (8 + sizeof *b->hsout), cudaHostAllocMapped | cudaHostAllocPortable));
    CK(cudaHostGetDevicePointer((void **)&b->dout, b->hout, 0));
    b->hout_tok = (int32_t *)b->hout, b->hout_lp = (float *)(b->hout + S * 4);
    b->hsout = (struct cuda_sample_out *)(b->hout + S * 8);
    if (crew_run(b, JOB_INIT, err, errlen)) goto fail;
    CK(cudaSetDevice(0));

    CK(cudaHostAlloc((void **)&b->hlog, S * V * 4, cudaHostAllocPortable));
    b->nt = omp_get_max_threads();
    b->samp_bytes = (model_sample_scratch_bytes(c->n_vocab) + 63) & ~(size_t)63;
    b->samp = malloc(b->samp_bytes * (size_t)b->nt);
    b->host_rows = malloc(S * sizeof *b->host_rows);
    b->row_seq = malloc(S * sizeof *b->row_seq);
    b->tok_seq = malloc(T * sizeof *b->tok_seq);
    b->row_host = calloc(S, sizeof *b->row_host);
    b->row_mode = calloc(S, 1);
    b->rng_before = calloc(S, sizeof *b->rng_before);
    b->pen_mark = calloc(V, sizeof *b->pen_mark);
    b->dev_sample = N == 1;
    if (!b->samp || !b->host_rows || !b->row_seq || !b->tok_seq || !b->row_host || !b->row_mode || !b->rng_before ||
        !b->pen_mark) {
        sl_seterr(err, errlen, "out of host memory");
        goto fail;
    }
    for (int bk = 1; bk <= b->max_seqs && b->n_bucket < NBUCKET; bk *= 2) b->bucket[b->n_bucket++] = bk;
    if (b->n_bucket < NBUCKET && b->bucket[b->n_bucket - 1] != b->max_seqs) b->bucket[b->n_bucket++] = b->max_seqs;
    return &b->base;
fail:
    destroy(&b->base);
    return NULL;
}

/* ---- KV ------------------------------------------------------------------------ */

/* Bytes of one block on each GPU (each rank holds n_kv_heads / N heads). */
static size_t kv_block_bytes(model_backend *mb, int block_size)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    return 2 * (size_t)b->c.n_layer * (size_t)block_size * (b->c.n_head_kv / b->tp) * b->c.head_dim * (b->kv8 ? 1 : 2);
}

static void drop_graphs(struct rank *k)
{
    for (int i = 0; i < NBUCKET; i++)
        if (k->gexec[i]) {
            cudaGraphExecDestroy(k->gexec[i]);
            k->gexec[i] = NULL;
        }
}

static size_t al(size_t o) { return (o + 15) & ~(size_t)15; }

static int rank_kv_alloc(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    int n_blocks = b->job.kv_blocks, block_size = b->job.block_size;
    CK(cudaSetDevice(k->dev));
    drop_graphs(k);
    cudaFree(k->kv);
    cudaFree(k->din);
    k->kv = NULL, k->din = NULL;
    size_t per_block = kv_block_bytes(&b->base, block_size);
    /* one more block: the pad block that padded graph tokens write */
    if (dmalloc((void **)&k->kv, (size_t)(n_blocks + 1) * per_block, err, errlen)) {
        sl_seterr(err, errlen, "kv_alloc: out of GPU memory on GPU %d for %d blocks (%.2f GB)", k->dev, n_blocks,
                  (double)(n_blocks + 1) * per_block / 1e9);
        return SL_ENOMEM;
    }
    k->kv_layer = (size_t)(n_blocks + 1) * block_size * k->KVH * b->c.head_dim;
    if (dmalloc((void **)&k->din, b->lay.total, err, errlen)) return SL_ENOMEM;
    return 0;
fail:
    return SL_EDEVICE;
}

/* The offsets of the regions a step fills, for steps of up to T tokens
 * and items attention items (y's srows, pen and total are left alone);
 * returns the end of the block tables (bt_cap entries). A step fills the
 * start of each region, so it copies the prefix of hin up to its last
 * block-table entry. */
static size_t lay_steps(struct inlay *y, size_t T, size_t S, size_t items, int bt_cap)
{
    size_t o = 0;
    y->slots = o, o = al(o + T * 8);
    y->ids = o, o = al(o + T * 4);
    y->pos = o, o = al(o + T * 4);
    y->tok_part = o, o = al(o + T * 4);
    y->tok_nsplit = o, o = al(o + T * 4);
    y->rows = o, o = al(o + S * 4);
    y->n_items = o, o = al(o + 4);
    y->items = o, o = al(o + items * sizeof(struct cuda_attn_item));
    y->max_items = (int)items;
    y->bt = o, o = al(o + (size_t)bt_cap * 4);
    return o;
}

/* The layout a step packs into: a decode graph's (Tp tokens, the Tp *
 * MAXSPLIT items its attention grid reads) has the regions sized for Tp, so
 * a batch-1 step copies a few KB, where the full layout (sized for
 * max_tokens) puts ~1 MB before the block tables at 16K tokens a step. Its
 * regions end before the full layout's block tables end, inside din. */
static struct inlay step_lay(const struct cuda_backend *b, int gi, int Tp)
{
    struct inlay y = b->lay_full;
    size_t items = (size_t)Tp * CUDA_ATTN_MAXSPLIT;
    if (gi >= 0 && items <= (size_t)y.max_items && Tp <= b->max_tokens)
        lay_steps(&y, (size_t)Tp, b->max_seqs, items, b->bt_cap);
    return y;
}

static int kv_alloc(model_backend *mb, int n_blocks, int block_size, char *err, size_t errlen)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (n_blocks <= 0 || block_size <= 0 || block_size > (1 << 20)) {
        sl_seterr(err, errlen, "kv_alloc: bad size (%d blocks of %d)", n_blocks, block_size);
        return SL_EINVAL;
    }
    if (b->base.fatal) {
        sl_seterr(err, errlen, "%s", b->base.fatal);
        return SL_EDEVICE;
    }
    cudaFreeHost(b->hin);
    b->hin = NULL, b->kv_blocks = 0;
    size_t T = b->max_tokens, S = b->max_seqs;
    /* items: a step's (splits only in steps of <= 256 tokens), and at least
     * the grid of every decode graph (Tp * MAXSPLIT, Tp <= S): the kernels
     * read a block's item before they know n_items */
    b->bt_cap = (int)(S * ((size_t)(b->max_ctx + block_size - 1) / block_size + 1));
    struct inlay *y = &b->lay_full;
    size_t o = lay_steps(y, T, S, T + S + (S > 256 ? S : 256) * CUDA_ATTN_MAXSPLIT, b->bt_cap);
    size_t pc = S * (size_t)b->max_ctx;
    b->pen_cap = (int)(pc < 65536 ? 65536 : pc > (1u << 20) ? (1u << 20) : pc);
    y->srows = o, o = al(o + S * sizeof(struct cuda_sample_row));
    y->pen = o, o = al(o + (size_t)b->pen_cap * sizeof(struct cuda_sample_pen));
    y->total = o;
    b->lay = *y;
    cudaError_t e = cudaHostAlloc((void **)&b->hin, o, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        sl_seterr(err, errlen, "kv_alloc: step buffers: %s", cudaGetErrorString(e));
        return SL_ENOMEM;
    }
    b->job.kv_blocks = n_blocks;
    b->job.block_size = block_size;
    int rc = crew_run(b, JOB_KV, err, errlen);
    if (rc && atomic_load(&b->failed)) {
        /* the ranks aborted their communicators: nothing can run any more */
        snprintf(b->dead, sizeof b->dead, "the GPU backend stopped: %s", err);
        b->base.fatal = b->dead;
    }
    if (rc) return rc;
    b->kv_blocks = n_blocks;
    b->block_size = block_size;
    if (b->warmup) {
        b->warmup = false;
        b->warming = true; /* tp_fault_step counts serving's steps only */
        rc = warmup(b, err, errlen);
        b->warming = false;
        if (rc) return rc;
    }
    return 0;
}

/* One step of ns sequences of len tokens each at positions start.., sequence
 * k over blocks k * nbk .. (k + 1) * nbk - 1; the last token of each
 * sampled with *sp (random token ids: what they are does not matter). */
static int warm_step(struct cuda_backend *b, int ns, int nbk, int start, int len, const struct model_sampling *sp,
                     char *err, size_t errlen)
{
    int T = ns * len, bs = b->block_size, rc = SL_ENOMEM;
    int32_t *ids = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4), *bt = malloc((size_t)ns * nbk * 4);
    int64_t *slots = malloc((size_t)T * 8);
    uint64_t *rng = calloc((size_t)ns, sizeof *rng);
    struct step_seq *sq = calloc((size_t)ns, sizeof *sq);
    if (ids && pos && bt && slots && rng && sq) {
        for (int k = 0, t = 0; k < ns; k++) {
            for (int j = 0; j < nbk; j++) bt[k * nbk + j] = k * nbk + j;
            rng[k] = 0x9E3779B97F4A7C15ull + (uint64_t)k;
            sq[k] = (struct step_seq){.query_start = t, .query_len = len, .context_len = start + len,
                                      .block_table = bt + (size_t)k * nbk, .n_blocks = nbk, .want_sample = true,
                                      .sampling = sp, .rng = &rng[k]};
            for (int i = 0; i < len; i++, t++) {
                int p = start + i;
                ids[t] = (int32_t)(((uint64_t)t * 2654435761u) % (uint64_t)b->c.n_vocab);
                pos[t] = p;
                slots[t] = (int64_t)bt[k * nbk + p / bs] * bs + p % bs;
            }
        }
        struct step st = {.n_tokens = T, .token_ids = ids, .positions = pos, .slots = slots, .n_seqs = ns, .seqs = sq};
        rc = forward(&b->base, &st, err, errlen);
    } else {
        sl_seterr(err, errlen, "warm-up: out of host memory");
    }
    free(ids), free(pos), free(bt), free(slots), free(rng), free(sq);
    return rc;
}

/* After the first kv_alloc: runs the kinds of step serving will, so that a
 * first request does not pay for what happens once (the kernels' lazy
 * loading, cuBLAS's first calls, each decode bucket's graph capture): a
 * prefill of up to 512 tokens, an 8-token chunk over it (split attention,
 * sampled), and a decode step at every graph bucket the pool's blocks can
 * hold. It writes only KV blocks the engine has not handed out yet. A
 * step the configuration refuses only ends it early (with a line on
 * stderr); a failed GPU fails kv_alloc.
 * tuning.warmup off skips it (the first prefix-cache hit after start took
 * 25-37 ms in the engine without it, 7.7 with it, 6.2 later). */
static int warmup(struct cuda_backend *b, char *err, size_t errlen)
{
    int bs = b->block_size, C = b->max_tokens < 8 ? b->max_tokens : 8; /* the chunk's tokens */
    int P = b->max_tokens < 512 ? b->max_tokens : 512;
    if (P > b->max_ctx - C) P = b->max_ctx - C;
    int nbk = (P + C + bs - 1) / bs;
    if (P < 1 || nbk > b->kv_blocks) return 0;
    struct model_sampling greedy, samp;
    model_sampling_default(&greedy);
    samp = greedy;
    samp.temperature = 1.0f, samp.top_p = 0.9f, samp.seed = 1;
    int rc = warm_step(b, 1, nbk, 0, P, &greedy, err, errlen);
    if (!rc) rc = warm_step(b, 1, nbk, P, C, &samp, err, errlen);
    for (int i = 0; !rc && i < b->n_bucket; i++)
        if (b->bucket[i] <= b->kv_blocks && b->bucket[i] <= b->max_tokens)
            rc = warm_step(b, b->bucket[i], 1, 0, 1, &greedy, err, errlen);
    if (rc && !b->base.fatal) { /* a step this configuration refuses: serving can still start */
        fprintf(stderr, "cuda: warm-up left unfinished: %s\n", err);
        return 0;
    }
    if (rc) {
        char why[256];
        snprintf(why, sizeof why, "%s", err);
        sl_seterr(err, errlen, "warm-up: %s", why);
    }
    return rc;
}

/* ---- forward ------------------------------------------------------------------- */

/* Greedy with nothing that needs the whole distribution: the device answers. */
static bool device_greedy(const struct step_seq *q)
{
    const struct model_sampling *s = q->sampling;
    return !q->logits_out && (s->temperature == 0.0f || s->top_k == 1) && s->repetition_penalty == 1.0f &&
           s->presence_penalty == 0.0f && s->frequency_penalty == 0.0f && s->top_logprobs == 0 &&
           s->n_logit_bias == 0 && !s->allow;
}

static int check_step(struct cuda_backend *b, const struct step *s, char *err, size_t errlen)
{
    if (!b->kv_blocks) {
        sl_seterr(err, errlen, "forward: KV memory not allocated (kv_alloc)");
        return SL_EINVAL;
    }
    struct model_step_limits lim = {.n_vocab = b->c.n_vocab, .max_tokens = b->max_tokens, .max_seqs = b->max_seqs,
                                    .max_ctx = b->max_ctx, .block_size = b->block_size, .kv_blocks = b->kv_blocks};
    /* sampling parameters included: the device sampler runs before the host could refuse them */
    return model_step_check(s, &lim, b->tok_seq, err, errlen);
}

#define HIN(b, f, type) ((type *)((b)->hin + (b)->lay.f))

/* The device sampler's inputs for the step's R logit rows (every row gets
 * one; greedy rows are temperature 0): parameters, the uniform each
 * ROW_SAMPLE row draws from its request's RNG exactly where model_sample
 * would, and the penalty entries. A row whose entries do not fit goes to the
 * host. Sets job.n_samp and job.n_pen. */
static void pack_sampling(struct cuda_backend *b, const struct step *s, int R)
{
    struct cuda_sample_row *sr = HIN(b, srows, struct cuda_sample_row);
    struct cuda_sample_pen *pen = HIN(b, pen, struct cuda_sample_pen);
    int ns = 0, np = 0;
    for (int r = 0; r < R; r++) {
        sr[r] = (struct cuda_sample_row){.temperature = 0.0f, .top_p = 1.0f, .repetition_penalty = 1.0f};
        if (b->row_mode[r] != ROW_SAMPLE) continue;
        struct step_seq *q = &s->seqs[b->row_seq[r]];
        const struct model_sampling *p = q->sampling;
        bool pens = p->repetition_penalty != 1.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
        if (pens && np + q->n_history > b->pen_cap) {
            b->row_mode[r] = ROW_HOST;
            b->row_host[r] = true;
            continue;
        }
        struct cuda_sample_row *w = &sr[r];
        *w = (struct cuda_sample_row){.temperature = p->temperature, .top_p = p->top_p, .min_p = p->min_p,
                                      .log_min_p = p->min_p > 0.0f ? logf(p->min_p) : 0.0f,
                                      .repetition_penalty = p->repetition_penalty,
                                      .presence_penalty = p->presence_penalty,
                                      .frequency_penalty = p->frequency_penalty, .top_k = p->top_k,
                                      .top_logprobs = p->top_logprobs, .pen_off = np};
        if (pens) {
            w->n_pen = cuda_sample_pen_build(q->history, q->n_prompt, q->n_history, b->pen_mark, pen + np);
            np += w->n_pen;
        }
        uint64_t dummy = 0, *rng = q->rng ? q->rng : &dummy;
        b->rng_before[r] = *rng;
        if (p->temperature > 0.0f && p->top_k != 1) w->u = model_rng_uniform(rng);
        ns++;
    }
    b->job.n_samp = ns;
    b->job.n_pen = np;
}
#define DIN(k, f, type) ((type *)((k)->din + (k)->b->lay.f))

/* Packs the step into hin. Tokens [n_tokens, Tp) and rows [R, Rp) are
 * padding (decode graphs). Returns the bytes of hin to copy, or 0 when the
 * step does not fit the buffers. *R gets the number of logit rows. */
/* Whether a step runs on the decode attention kernel (which also does RoPE
 * and the KV write): one answer for packing and launch. */
static bool dec_kernel(const struct cuda_backend *b, bool decode)
{
    return decode && cuda_attention_dec_ok(b->c.head_dim, b->c.n_head / b->c.n_head_kv);
}

/* blocks of a sequence's table that the step reads (its share of the flat bt) */
static int seq_blocks(const struct step_seq *q, int bs) { return (q->context_len + bs - 1) / bs; }

/* A prefill step's tiles that attend to at least t.long_split_keys keys ("long"
 * tiles: a chunk deep into a long document) take many times the others'
 * time, and when they are few they leave SMs idle in their last wave (a
 * chunk of 430 tokens at 100K context: 14 tiles x 8 KV heads = 112 blocks
 * on 132 SMs). long_splits picks how many parts (1-8) to split each long
 * tile's keys into: the count whose blocks fill their waves best, by at
 * least 3% over fewer, each part >= long_keys / 2 keys. */
static int long_splits(const struct cuda_backend *b, const struct step *s, int qt, int KVH)
{
    int n = 0, kmin = INT32_MAX, long_keys = b->t.long_split_keys;
    if (long_keys <= 0) return 1;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        int p0 = q->context_len - q->query_len; /* positions of the sequence's step tokens: p0 .. context_len - 1 */
        for (int t0 = 0; t0 < q->query_len; t0 += qt) {
            int hi = p0 + (t0 + qt < q->query_len ? t0 + qt : q->query_len); /* the tile's last key + 1 */
            if (hi >= long_keys) n++, kmin = hi < kmin ? hi : kmin;
        }
    }
    int u = n * KVH, best = 1;
    if (!u || u >= 3 * b->n_sm) return 1;
    double fill = (double)u / ((u + b->n_sm - 1) / b->n_sm * b->n_sm);
    for (int k = 2; k <= 8 && kmin / k >= long_keys / 2; k++) {
        double f = (double)u * k / ((u * k + b->n_sm - 1) / b->n_sm * b->n_sm);
        if (f > fill * 1.03) fill = f, best = k;
    }
    return best;
}

static size_t pack_step(struct cuda_backend *b, const struct step *s, int Tp, int *R)
{
    int T = s->n_tokens, bs = b->block_size, grp = b->c.n_head / b->c.n_head_kv, KVH = b->r[0].KVH;
    bool decode = s->n_tokens == s->n_seqs;
    /* prefill on the tensor cores: bigger tiles; decode-only steps (and their
     * graphs) keep the SIMT kernel with one token's heads per item */
    b->job.max_rows = decode ? grp : b->tc_rows ? b->tc_rows : CUDA_ATTN_ROWS;
    int qt = (decode || !b->tc_rows ? CUDA_ATTN_ROWS : b->tc_rows) / grp;
    int64_t *slots = HIN(b, slots, int64_t);
    int32_t *ids = HIN(b, ids, int32_t), *pos = HIN(b, pos, int32_t), *tpart = HIN(b, tok_part, int32_t),
            *tns = HIN(b, tok_nsplit, int32_t), *rows = HIN(b, rows, int32_t), *bt = HIN(b, bt, int32_t);
    struct cuda_attn_item *items = HIN(b, items, struct cuda_attn_item);
    int64_t pad_slot = (int64_t)b->kv_blocks * bs;
    for (int t = 0; t < Tp; t++) {
        bool real = t < T;
        slots[t] = real ? s->slots[t] : pad_slot;
        ids[t] = real ? s->token_ids[t] : 0;
        pos[t] = real ? s->positions[t] : 0;
        tpart[t] = -1;
        tns[t] = 0;
    }
    int nbt = 0, r = 0, tiles = 0;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        int nb = seq_blocks(q, bs);
        if (nbt + nb > b->bt_cap) return 0;
        memcpy(bt + nbt, q->block_table, (size_t)nb * 4);
        nbt += nb;
        tiles += (q->query_len + qt - 1) / qt;
        if (q->want_sample || q->logits_out) {
            b->row_seq[r] = i;
            b->row_mode[r] = !q->want_sample || device_greedy(q) ? ROW_GREEDY
                             : b->dev_sample && !q->logits_out && !q->sampling->n_logit_bias &&
                                       !q->sampling->allow
                                   ? ROW_SAMPLE
                                                                                             : ROW_HOST;
            b->row_host[r] = q->logits_out || b->row_mode[r] == ROW_HOST;
            rows[r++] = q->query_start + q->query_len - 1;
        }
    }
    *R = r;
    /* split-K only when the step is short (decode-like) and its tiles alone
     * would leave the GPU idle */
    bool split_ok = Tp <= 256;
    int units = tiles * KVH, want = units >= 2 * b->n_sm ? 1 : (2 * b->n_sm + units - 1) / units;
    /* longer prefill steps: split the tiles that reach far back (a chunk deep
     * into a long document) when that fills the SMs' waves better */
    int lns = !split_ok && !decode && b->tc_rows ? long_splits(b, s, qt, KVH) : 1, ps = lns > 1 ? lns : 0;
    b->job.pstride = ps;
    int part_cap = b->part_rows * (CUDA_ATTN_MAXSPLIT / (ps ? ps : CUDA_ATTN_MAXSPLIT)); /* rows at stride ps */
    /* keys per split at least: the decode kernel's 4 warps take 32 each, and
     * at least 128 keys a split measured fastest at batch 1 (223 tok/s
     * against 216-220 at 32-256; larger batches did not move), in multiples
     * of 128 */
    bool dk = dec_kernel(b, decode);
    int n = 0, part = 0, kmin = dk ? 128 : 64, kround = dk ? 128 : 32;
    for (int i = 0, bt0 = 0; i < s->n_seqs; bt0 += seq_blocks(&s->seqs[i], bs), i++) {
        const struct step_seq *q = &s->seqs[i];
        for (int t0 = q->query_start; t0 < q->query_start + q->query_len; t0 += qt) {
            int nq = q->query_start + q->query_len - t0 < qt ? q->query_start + q->query_len - t0 : qt;
            int kv_hi = 0;
            for (int t = t0; t < t0 + nq; t++)
                if (pos[t] + 1 > kv_hi) kv_hi = pos[t] + 1;
            int ns = 1;
            if (split_ok && want > 1) {
                /* short items: a block's latency is per 32-key tile (per warp in the decode kernel) */
                ns = (kv_hi + kmin - 1) / kmin;
                if (ns > want) ns = want;
                if (ns > CUDA_ATTN_MAXSPLIT) ns = CUDA_ATTN_MAXSPLIT;
                if (part + nq * grp > b->part_rows) ns = 1;
                if (ns < 1) ns = 1;
            }
            int kr = kround;
            if (lns > 1 && kv_hi >= b->t.long_split_keys && part + nq * grp <= part_cap)
                ns = lns, kr = 128; /* whole 128-key tiles of the warpgroup kernel */
            int chunk = ((kv_hi + ns - 1) / ns + kr - 1) / kr * kr;
            if (n + ns > b->lay.max_items) return 0;
            for (int k = 0; k < ns; k++) {
                int lo = k * chunk, hi = lo + chunk < kv_hi ? lo + chunk : kv_hi;
                items[n++] = (struct cuda_attn_item){.bt0 = bt0, .t0 = t0, .nq = nq, .kv_lo = lo, .kv_hi = hi,
                                                     .split = k, .nsplit = ns, .part = part};
            }
            if (ns > 1) {
                for (int t = t0; t < t0 + nq; t++) {
                    tpart[t] = part + (t - t0) * grp;
                    tns[t] = ns;
                }
                part += nq * grp;
            }
        }
    }
    *HIN(b, n_items, int32_t) = n;
    for (int k = r; k < (Tp < b->max_seqs ? Tp : b->max_seqs); k++) rows[k] = k; /* graph padding rows */
    pack_sampling(b, s, r);
    return b->lay.bt + (size_t)nbt * 4;
}

static cublasStatus_t gemm(struct rank *k, const uint16_t *x, const uint16_t *W, void *y, bool yf32, int T, int in,
                           int out)
{
    const float one = 1.0f, zero = 0.0f;
    if (T <= CUDA_GEMV_MMA_MAX_T && in % 8 == 0)
        return cuda_gemv(W, x, y, yf32, T, in, out, k->st) == cudaSuccess ? CUBLAS_STATUS_SUCCESS
                                                                             : CUBLAS_STATUS_EXECUTION_FAILED;
    return cublasGemmEx(k->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, T, in, &one, W, CUDA_R_16BF, in, x, CUDA_R_16BF, in,
                        &zero, y, yf32 ? CUDA_R_32F : CUDA_R_16BF, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

/* y = x W^T for a projection of `out` outputs: its bf16 matrix W (gemm) or,
 * P->n > 0, its parts, each into its columns of y (row stride out). */
static cublasStatus_t proj(struct rank *k, const struct qproj *P, const uint16_t *W, const uint16_t *x, void *y,
                           bool yf32, int T, int in, int out)
{
    if (!P->n) return gemm(k, x, W, y, yf32, T, in, out);
    const float one = 1.0f, zero = 0.0f;
    for (int i = 0; i < P->n; i++) {
        const struct qpart *q = &P->p[i];
        void *yi = yf32 ? (void *)((float *)y + q->off) : (void *)((uint16_t *)y + q->off);
        cublasStatus_t s =
            q->w ? cublasGemmEx(k->blas, CUBLAS_OP_T, CUBLAS_OP_N, q->rows, T, in, &one, q->w, CUDA_R_16BF, in, x,
                                CUDA_R_16BF, in, &zero, yi, yf32 ? CUDA_R_32F : CUDA_R_16BF, out, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT)
                 : cuda_qgemm(&q->q, x, yi, yf32, out, T, &k->qws, k->blas, k->st);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}

/* Whether an all-reduce of n floats goes through cuda_peer_allreduce. Every
 * all-reduce of a step has n = T E, so a step takes one path for all of
 * them. */
static bool use_peer(const struct cuda_backend *b, size_t n) { return b->peer && !b->skip_comm && n <= b->peer_elems; }

/* cuda_peer_allreduce's arguments for rank k's input buffer i. Buffers:
 * 0 for the o projection, 1 for down, 2 for the embedding, so consecutive
 * all-reduces (..., o, down, next step's embedding, o, ...) never share a
 * buffer, as the kernel's contract asks. */
static struct cuda_peer_ar peer_args(const struct rank *k, int i)
{
    const struct cuda_backend *b = k->b;
    struct cuda_peer_ar a = {.epoch = k->pepoch, .abort = b->peer_abort, .n_ranks = b->tp, .rank = k->id};
    for (int p = 0; p < b->tp; p++) a.src[p] = b->r[p].pbuf[i], a.flags[p] = b->r[p].pflags;
    return a;
}

/* A row-parallel projection: y = x W^T summed over the ranks, rounded to
 * bf16 once from the f32 sum, into delta, or with resid (the fused path)
 * added into the residual x: on one GPU in the GEMV's epilogue, with N > 1
 * in the peer all-reduce (the fused path runs only when use_peer). buf: its
 * peer all-reduce buffer. */
static int proj_rows(struct rank *k, const uint16_t *x, const struct qproj *P, const uint16_t *W, int T, int in,
                     int E, int buf, bool resid, char *err, size_t errlen)
{
    size_t n = (size_t)T * E;
    if (k->b->tp == 1) {
        if (resid) CK(cuda_gemv_residual(W, x, k->x, T, in, E, k->st));
        else CB(proj(k, P, W, x, k->delta, false, T, in, E));
        return 0;
    }
    if (use_peer(k->b, n)) {
        CB(proj(k, P, W, x, k->pbuf[buf], true, T, in, E));
        struct cuda_peer_ar a = peer_args(k, buf);
        CK(cuda_peer_allreduce(&a, n, resid ? NULL : k->delta, resid ? k->x : NULL, resid, k->st));
        return 0;
    }
    CB(proj(k, P, W, x, k->deltaf, true, T, in, E));
    if (!k->b->skip_comm) NC(ncclAllReduce(k->deltaf, k->deltaf, n, ncclFloat, ncclSum, k->comm, k->st));
    CK(cuda_f32_to_bf16(k->deltaf, n, k->delta, k->st));
    return 0;
fail:
    return SL_EDEVICE;
}

/* Enqueues rank k's whole forward pass for T tokens (some maybe padding), R
 * logit rows, and max_items attention items, up to the greedy tokens. */
static int enqueue(struct rank *k, int T, int R, int max_items, bool decode, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    int E = c->n_embd, F = k->F, H = k->H, KVH = k->KVH, D = c->head_dim;
    int Q = H * D, QKV = Q + 2 * KVH * D;
    cudaStream_t st = k->st;
    enum cudaStreamCaptureStatus cs;
    if (b->tp == 1) {
        CK(cuda_embed(k->tok_embd, DIN(k, ids, int32_t), T, E, k->x, st));
    } else {
        bool pr = use_peer(b, (size_t)T * E);
        CK(cuda_embed_shard(k->tok_embd, DIN(k, ids, int32_t), T, E, k->v0, k->vn, pr ? k->pbuf[2] : k->x, st));
        if (pr) {
            struct cuda_peer_ar a = peer_args(k, 2);
            CK(cuda_peer_allreduce(&a, (size_t)T * E, NULL, k->x, false, st));
        } else if (!b->skip_comm) {
            NC(ncclAllReduce(k->x, k->x, (size_t)T * E, ncclFloat, ncclSum, k->comm, st));
        }
    }
    /* decode of one token: the norms ride in the GEMV prologues,
     * SwiGLU and the residual adds in their epilogues (bit-identical to the
     * unfused kernels, but for the norm's scale, which the one-token GEMVs
     * apply to their sums: kernels.h, cuda_gemv_late); x then already
     * holds every layer's output. Only at
     * T = 1, where the GEMVs are warp kernels: at 2-4 tokens the fused
     * kernels measured slower than the unfused ones (block kernels 164.4 vs
     * 148.4 us per layer at T = 4; tensor-core kernels 603 vs 838 tok/s at
     * batch 4: each block normalizes all T rows before its first MMA).
     * With N > 1 only when the all-reduces go through the peer kernel: the
     * residual adds are then in it, after the sums */
    bool fz = b->fused && T == 1 && (b->tp == 1 || use_peer(b, (size_t)T * E));
    for (int l = 0; l < c->n_layer; l++) {
        const struct clayer *L = &k->L[l];
        /* the previous layer's MLP output joins the residual here */
        unsigned ab = b->t.ablate;
        if (fz) {
            if (!(ab & CUDA_ABLATE_QKV)) CK(cuda_gemv_rmsnorm(L->wqkv, k->x, L->attn_norm, c->norm_eps, k->qkv, T, E, QKV, st));
        } else {
            if (!(ab & CUDA_ABLATE_NORM))
                CK(cuda_add_rmsnorm(k->x, l ? k->delta : NULL, L->attn_norm, NULL, T, E, c->norm_eps, k->xn, st));
            if (!(ab & CUDA_ABLATE_QKV)) CB(proj(k, &L->qqkv, L->wqkv, k->xn, k->qkv, false, T, E, QKV));
        }
        size_t es = b->kv8 ? 1 : 2; /* bytes per KV element */
        char *kc = (char *)k->kv + (size_t)(2 * l) * k->kv_layer * es, *vc = kc + k->kv_layer * es;
        struct cuda_rope_args ra = {
            .qkv = k->qkv, .bias = L->bqkv, .q_norm = L->q_norm, .k_norm = L->k_norm, .cos = k->rope_cos,
            .sin = k->rope_sin, .pos = DIN(k, pos, int32_t), .slots = DIN(k, slots, int64_t), .T = T, .H = H,
            .KVH = KVH, .D = D, .rope_dim = c->rope_dim, .neox = c->rope_type == MODEL_ROPE_NEOX,
            .eps = c->norm_eps, .q = k->q, .kc = kc, .vc = vc, .kv8 = b->kv8,
        };
        /* decode steps on the decode kernel fold RoPE and the KV write in */
        bool dk = dec_kernel(b, decode);
        if (!dk && !(ab & CUDA_ABLATE_ATTN)) CK(cuda_rope_kv(&ra, st));
        struct cuda_attn_args aa = {
            .q = k->q, .kc = kc, .vc = vc, .kv8 = b->kv8, .pos = DIN(k, pos, int32_t), .bt = DIN(k, bt, int32_t),
            .items = DIN(k, items, struct cuda_attn_item),
            .n_items = DIN(k, n_items, int32_t), .max_items = max_items,
            .max_rows = decode ? H / KVH : b->job.max_rows, .H = H, .KVH = KVH, .D = D,
            .block_size = b->block_size, .scale = 1.0f / sqrtf((float)D), .part = k->part,
            .pstride = decode ? 0 : b->job.pstride,
            .tok_part = DIN(k, tok_part, int32_t), .tok_nsplit = DIN(k, tok_nsplit, int32_t), .T = T, .out = k->att,
            /* pack_step splits a decode step's items until they fill ~2 blocks
             * an SM, so from 32 token x KV head pairs (4 tokens of Llama-8B on
             * one GPU) at 1K context its blocks outnumber what 2 an SM hold:
             * there the decode kernel's 3-blocks-an-SM build */
            .cnt = dk ? k->cnt : NULL,
            .dec_wide = T * KVH >= 32,
            .rope = dk ? ra : (struct cuda_rope_args){0},
        };
        if (!(ab & CUDA_ABLATE_ATTN)) CK(cuda_attention(&aa, st));
        if (fz) {
            if (!(ab & CUDA_ABLATE_O) && proj_rows(k, k->att, &L->qo, L->wo, T, Q, E, 0, true, err, errlen)) goto fail;
            if (b->tp == 1 && c->n_layer >= 2 && !(ab & (CUDA_ABLATE_GU | CUDA_ABLATE_DOWN))) {
                /* one GPU: the down GEMV reads h as gate/up stores it, tagged
                 * with the layer (consecutive calls differ) */
                CK(cuda_gemv_mlp(L->wgu, L->wdown, k->x, L->ffn_norm, c->norm_eps, k->h, T, E, F, k->hw, l + 1, st));
                continue;
            }
            if (!(ab & CUDA_ABLATE_GU))
                CK(cuda_gemv_rmsnorm_swiglu(L->wgu, k->x, L->ffn_norm, c->norm_eps, k->h, T, E, F, st));
            if (!(ab & CUDA_ABLATE_DOWN) && proj_rows(k, k->h, &L->qdown, L->wdown, T, F, E, 1, true, err, errlen))
                goto fail;
            continue;
        }
        if (!(ab & CUDA_ABLATE_O) && proj_rows(k, k->att, &L->qo, L->wo, T, Q, E, 0, false, err, errlen)) goto fail;
        if (!(ab & CUDA_ABLATE_NORM))
            CK(cuda_add_rmsnorm(k->x, k->delta, L->ffn_norm, NULL, T, E, c->norm_eps, k->xn, st));
        bool gu_gemv = !L->qgu.n && T <= CUDA_GEMV_MMA_MAX_T && E % 8 == 0;
        if (!(ab & CUDA_ABLATE_GU) && gu_gemv) {
            /* SwiGLU in the GEMV's epilogue: bit for bit the two kernels below */
            CK(cuda_gemv_swiglu(L->wgu, k->xn, k->h, T, E, F, st));
        } else if (!(ab & CUDA_ABLATE_GU) && !L->qgu.n && T >= b->t.gemm_wg_min_t && cuda_gemm_wg_ok(T, E, 2 * F)) {
            /* sm_90: SwiGLU in the warpgroup GEMM's epilogue, gate|up never stored */
            CK(cuda_gemm_wg_swiglu(L->wgu, k->xn, k->h, T, E, F, st));
        } else if (!(ab & CUDA_ABLATE_GU) && L->qgu.n == 1 && !L->qgu.p[0].w && T > CUDA_QGEMV_MMA_MAX_T &&
                   T >= b->t.gemm_wg_min_t && cuda_gemm_wg_ok(T, E, 2 * F) &&
                   k->qws.deq_bytes >= (size_t)2 * F * E * 2) {
            /* a long step: gate|up dequantized whole, then the warpgroup GEMM with SwiGLU, as bf16 weights */
            CK(cuda_qdequant(&L->qgu.p[0].q, 0, 2 * F, k->qws.deq, st));
            CK(cuda_gemm_wg_swiglu(k->qws.deq, k->xn, k->h, T, E, F, st));
        } else if (!(ab & CUDA_ABLATE_GU) && L->qgu.n == 1 && !L->qgu.p[0].w) {
            /* one packed gate|up matrix: SwiGLU in the GEMV's epilogue where it can be */
            CB(cuda_qgemm_swiglu(&L->qgu.p[0].q, k->xn, k->h, k->gu, T, &k->qws, k->blas, st));
        } else if (!(ab & CUDA_ABLATE_GU)) {
            CB(proj(k, &L->qgu, L->wgu, k->xn, k->gu, false, T, E, 2 * F));
            CK(cuda_swiglu(k->gu, T, F, k->h, st));
        }
        if (!(ab & CUDA_ABLATE_DOWN) && proj_rows(k, k->h, &L->qdown, L->wdown, T, F, E, 1, false, err, errlen))
            goto fail;
    }
    if (R > 0) {
        CK(cuda_add_rmsnorm(k->x, fz ? NULL : k->delta, k->out_norm, DIN(k, rows, int32_t), R, E, c->norm_eps,
                            k->hfin, st));
        if (!(b->t.ablate & CUDA_ABLATE_HEAD))
            CB(proj(k, &k->qhead, k->lm_head, k->hfin, k->logits, true, R, E, k->vn));
        if (b->tp == 1) {
            CK(cuda_argmax_lse(k->logits, R, k->vn, k->amp, k->tok, k->lp, st));
        } else {
            CK(cuda_argmax_part(k->logits, R, k->vn, k->v0, k->amp, st));
            if (!b->skip_comm)
                NC(ncclAllGather(k->amp, k->amp_all, (size_t)R * sizeof *k->amp / 4, ncclInt32, k->comm, st));
            CK(cuda_argmax_combine(k->amp_all, b->tp, R, k->tok, k->lp, st));
        }
    }
    return 0;
fail:
    /* a step cut short may leave the tagged h with a tag the next step's
     * first layers use again (cuda_gemv_mlp): clear it (a captured step
     * ran nothing) */
    if (cudaStreamIsCapturing(st, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusNone)
        cudaMemsetAsync(k->hw, 0, (size_t)k->F * sizeof *k->hw, st);
    return SL_EDEVICE;
}

/* Waits for rank k's stream. With N > 1 it polls, so that a failure of
 * another rank (the flag) or of this rank's communicator (its async error)
 * aborts the communicator instead of waiting forever in a collective. */
static int rank_wait(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    if (b->tp == 1) {
        CK(cudaStreamSynchronize(k->st));
        return 0;
    }
    for (unsigned spin = 0;; spin++) {
        cudaError_t e = cudaStreamQuery(k->st);
        if (e == cudaSuccess) return 0;
        if (e != cudaErrorNotReady) {
            sl_seterr(err, errlen, "GPU %d: %s", k->dev, cudaGetErrorString(e));
            return SL_EDEVICE;
        }
        ncclResult_t ar = ncclSuccess;
        if (k->comm && ncclCommGetAsyncError(k->comm, &ar) == ncclSuccess && ar != ncclSuccess &&
            ar != ncclInProgress) {
            sl_seterr(err, errlen, "GPU %d: NCCL: %s", k->dev, ncclGetErrorString(ar));
            return SL_EDEVICE;
        }
        if (atomic_load(&b->failed)) {
            sl_seterr(err, errlen, "GPU %d: stopped because another rank failed", k->dev);
            return SL_EDEVICE;
        }
        if (spin > 64) sched_yield();
    }
fail:
    return SL_EDEVICE;
}

static int rank_forward(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    int Tp = b->job.Tp, R = b->job.R, gi = b->job.gi, V = b->c.n_vocab, rc;
    CK(cudaSetDevice(k->dev));
    if (!b->warming && ++k->steps == b->t.tp_fault_step && k->id == b->t.tp_fault_rank) {
        sl_seterr(err, errlen, "GPU %d: injected fault at step %ld (tuning.tp_fault_rank)", k->dev, k->steps);
        return SL_EDEVICE;
    }
    CK(cudaMemcpyAsync(k->din, b->hin, b->job.nbytes, cudaMemcpyHostToDevice, k->st));
    if (b->job.n_samp) {
        CK(cudaMemcpyAsync(k->din + b->lay.srows, b->hin + b->lay.srows, (size_t)R * sizeof(struct cuda_sample_row),
                           cudaMemcpyHostToDevice, k->st));
        if (b->job.n_pen)
            CK(cudaMemcpyAsync(k->din + b->lay.pen, b->hin + b->lay.pen,
                               (size_t)b->job.n_pen * sizeof(struct cuda_sample_pen), cudaMemcpyHostToDevice, k->st));
    }
    if (gi >= 0) {
        if (!k->gexec[gi]) {
            cudaGraph_t g = NULL;
            CK(cudaStreamBeginCapture(k->st, cudaStreamCaptureModeThreadLocal));
            rc = enqueue(k, Tp, Tp, Tp * CUDA_ATTN_MAXSPLIT, true, err, errlen);
            cudaError_t e = cudaStreamEndCapture(k->st, &g);
            if (rc) {
                if (g) cudaGraphDestroy(g);
                return rc;
            }
            CK(e);
            e = cudaGraphInstantiate(&k->gexec[gi], g, 0);
            cudaGraphDestroy(g);
            CK(e);
        }
        CK(cudaGraphLaunch(k->gexec[gi], k->st));
    } else {
        if ((rc = enqueue(k, Tp, R, b->job.n_items, b->job.decode, err, errlen))) return rc;
    }
    if (R > 0) {
        for (int r = 0; r < R; r++)
            if (b->row_host[r])
                CK(cudaMemcpyAsync(b->hlog + (size_t)r * V + k->v0, k->logits + (size_t)r * k->vn,
                                   (size_t)k->vn * 4, cudaMemcpyDeviceToHost, k->st));
        /* after the raw rows are copied: the sampler penalizes in place */
        if (b->job.n_samp) {
            CK(cuda_sample(k->logits, R, V, DIN(k, srows, struct cuda_sample_row),
                           b->job.n_pen ? DIN(k, pen, struct cuda_sample_pen) : NULL, k->sout, k->st));
        }
    }
    return rank_wait(k, err, errlen);
fail:
    return SL_EDEVICE;
}

static void *abort_comm(void *comm)
{
    ncclCommAbort((ncclComm_t)comm);
    return NULL;
}

/* Runs job on rank k (its device is made current). */
static int run_job(struct rank *k, enum job job)
{
    char *err = k->err;
    size_t errlen = sizeof k->err;
    int rc = 0;
    err[0] = 0;
    switch (job) {
    case JOB_INIT: rc = rank_init(k, err, errlen); break;
    case JOB_KV: rc = rank_kv_alloc(k, err, errlen); break;
    case JOB_FORWARD: rc = rank_forward(k, err, errlen); break;
    case JOB_EXIT: break;
    }
    if (rc && k->b->tp > 1) {
        atomic_store(&k->b->failed, 1);
        if (k->b->peer_abort) *(volatile int *)k->b->peer_abort = 1; /* ends the peer all-reduce's waits */
        fprintf(stderr, "cuda: GPU %d failed (%s); aborting its NCCL communicator\n", k->dev, err);
        /* ends this rank's collectives; peers stuck in theirs see the flag.
         * On its own thread: an abort that waits on a wedged GPU must not
         * hold up the error reaching the engine */
        pthread_t th;
        if (k->comm && pthread_create(&th, NULL, abort_comm, k->comm) == 0) pthread_detach(th);
        k->comm = NULL;
    }
    return rc;
}

/* ---- the crew ------------------------------------------------------------------ */

static void *rank_main(void *arg)
{
    struct rank *k = arg;
    struct cuda_backend *b = k->b;
    unsigned seen = 0;
    for (;;) {
        /* spin a little first: decode steps follow each other within milliseconds */
        for (int i = 0; i < 20000 && atomic_load(&b->gen) == seen; i++)
            if (i > 200) sched_yield();
        pthread_mutex_lock(&b->mu);
        while (atomic_load(&b->gen) == seen) pthread_cond_wait(&b->go, &b->mu);
        seen = atomic_load(&b->gen);
        enum job job = b->cur;
        pthread_mutex_unlock(&b->mu);
        if (job == JOB_EXIT) return NULL;
        k->rc = run_job(k, job);
        if (atomic_fetch_sub(&b->left, 1) == 1) {
            pthread_mutex_lock(&b->mu);
            pthread_cond_broadcast(&b->done);
            pthread_mutex_unlock(&b->mu);
        }
    }
}

static int crew_start(struct cuda_backend *b, char *err, size_t errlen)
{
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->go, NULL);
    pthread_cond_init(&b->done, NULL);
    b->crew = true;
    for (int i = 1; i < b->tp; i++) {
        if (pthread_create(&b->r[i].th, NULL, rank_main, &b->r[i])) {
            sl_seterr(err, errlen, "cannot start the thread of GPU %d", i);
            return SL_ENOMEM;
        }
        b->r[i].th_started = true;
    }
    return 0;
}

/* Runs job on every rank: rank 0 here, the others on their threads; returns
 * the first failing rank's error (by rank order). */
static int crew_run(struct cuda_backend *b, enum job job, char *err, size_t errlen)
{
    if (b->tp > 1 && !b->crew && crew_start(b, err, errlen)) return SL_ENOMEM;
    if (b->tp > 1) {
        pthread_mutex_lock(&b->mu);
        b->cur = job;
        atomic_store(&b->left, b->tp - 1);
        atomic_fetch_add(&b->gen, 1);
        pthread_cond_broadcast(&b->go);
        pthread_mutex_unlock(&b->mu);
    }
    b->r[0].rc = run_job(&b->r[0], job);
    if (b->tp > 1) {
        for (int i = 0; i < 20000 && atomic_load(&b->left) > 0; i++)
            if (i > 200) sched_yield();
        pthread_mutex_lock(&b->mu);
        while (atomic_load(&b->left) > 0) pthread_cond_wait(&b->done, &b->mu);
        pthread_mutex_unlock(&b->mu);
    }
    /* the first rank that failed for itself, not one that stopped for a peer */
    int first = -1;
    for (int i = 0; i < b->tp; i++)
        if (b->r[i].rc && (first < 0 || (strstr(b->r[first].err, "another rank") && !strstr(b->r[i].err, "another rank"))))
            first = i;
    if (first < 0) return 0;
    if (b->tp > 1)
        sl_seterr(err, errlen, "tensor-parallel rank %d: %s", first, b->r[first].err);
    else
        sl_seterr(err, errlen, "%s", b->r[first].err);
    return b->r[first].rc;
}

static int forward(model_backend *mb, struct step *s, char *err, size_t errlen)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (!s) {
        sl_seterr(err, errlen, "forward: no step");
        return SL_EINVAL;
    }
    if (b->base.fatal) {
        sl_seterr(err, errlen, "%s", b->base.fatal);
        return SL_EDEVICE;
    }
    int rc = check_step(b, s, err, errlen);
    if (rc) return rc;
    int V = b->c.n_vocab;
    bool decode = s->n_tokens == s->n_seqs;
    int gi = -1;
    if (decode && b->graphs)
        for (int i = 0; i < b->n_bucket; i++)
            if (b->bucket[i] >= s->n_tokens && b->bucket[i] <= b->max_tokens) {
                gi = i;
                break;
            }
    int Tp = gi >= 0 ? b->bucket[gi] : s->n_tokens, R = 0;
    b->lay = step_lay(b, gi, Tp);
    size_t nbytes = pack_step(b, s, Tp, &R);
    if (!nbytes) {
        sl_seterr(err, errlen, "forward: step exceeds the backend's buffers");
        return SL_EINVAL;
    }
    b->job.Tp = Tp, b->job.R = R, b->job.gi = gi, b->job.decode = decode, b->job.nbytes = nbytes;
    b->job.n_items = *HIN(b, n_items, int32_t);
    if ((rc = crew_run(b, JOB_FORWARD, err, errlen))) {
        /* a GPU that failed mid-step leaves its stream, its KV and (with N > 1)
         * its communicators unusable: no later step can run */
        snprintf(b->dead, sizeof b->dead, "the GPU backend stopped: %s", err);
        b->base.fatal = b->dead;
        return SL_EDEVICE;
    }
    int nh = 0; /* rows model_sample picks: after this loop, in parallel */
    for (int r = 0; r < R; r++) {
        struct step_seq *q = &s->seqs[b->row_seq[r]];
        float *lg = b->hlog + (size_t)r * V;
        if (q->logits_out) memcpy(q->logits_out, lg, (size_t)V * 4);
        if (!q->want_sample) continue;
        if (b->row_mode[r] == ROW_GREEDY) {
            q->out.token = b->hout_tok[r]; /* -1: this row's logits are not finite (backend.h) */
            q->out.logprob = b->hout_lp[r];
            q->out.n_top = 0;
            continue;
        }
        if (b->row_mode[r] == ROW_SAMPLE) {
            const struct cuda_sample_out *o = &b->hsout[r];
            if (o->status == 0) {
                q->out.token = o->token;
                q->out.logprob = o->logprob;
                q->out.n_top = o->n_top;
                memcpy(q->out.top_ids, o->top_ids, sizeof q->out.top_ids);
                memcpy(q->out.top_logprobs, o->top_logprobs, sizeof q->out.top_logprobs);
                continue;
            }
            if (o->status < 0) {
                q->out.token = -1, q->out.n_top = 0;
                continue;
            }
            /* more candidates than the device sorts: the host finishes from the
             * penalized row, with the RNG as it was before the draw */
            struct rank *k0 = &b->r[0];
            if (cudaMemcpy(lg, k0->logits + (size_t)r * k0->vn, (size_t)V * 4, cudaMemcpyDeviceToHost) !=
                cudaSuccess) {
                sl_seterr(err, errlen, "forward: copying a logit row back failed");
                return SL_EDEVICE;
            }
            if (q->rng) *q->rng = b->rng_before[r];
        }
        b->host_rows[nh++] = r;
    }
    /* sequences sample independently (each its own RNG): in parallel, as the
     * CPU backend does (JSON-mode rows are masked here) */
#pragma omp parallel for schedule(dynamic, 1) num_threads(b->nt) if (nh > 1)
    for (int i = 0; i < nh; i++) {
        int r = b->host_rows[i];
        struct step_seq *q = &s->seqs[b->row_seq[r]];
        void *scr = (char *)b->samp + (size_t)omp_get_thread_num() * b->samp_bytes;
        int rc;
        if (b->row_mode[r] == ROW_SAMPLE) { /* the device applied the penalties */
            struct model_sampling p = *q->sampling;
            p.repetition_penalty = 1.0f, p.presence_penalty = 0.0f, p.frequency_penalty = 0.0f;
            rc = model_sample(b->hlog + (size_t)r * V, V, &p, NULL, 0, 0, q->rng, scr, &q->out);
        } else {
            rc = model_sample(b->hlog + (size_t)r * V, V, q->sampling, q->history, q->n_prompt, q->n_history, q->rng,
                              scr, &q->out);
        }
        if (rc != 0) q->out.token = -1, q->out.n_top = 0;
    }
    return 0;
}

/* ---- teardown ------------------------------------------------------------------ */

static void rank_free(struct rank *k, const struct model_config *c)
{
    cudaSetDevice(k->dev);
    if (k->st) cudaStreamSynchronize(k->st);
    drop_graphs(k);
    if (k->L) {
        for (int l = 0; l < c->n_layer; l++) {
            struct clayer *L = &k->L[l];
            cudaFree(L->wqkv), cudaFree(L->wo), cudaFree(L->wgu), cudaFree(L->wdown);
            cudaFree(L->attn_norm), cudaFree(L->ffn_norm), cudaFree(L->bqkv), cudaFree(L->q_norm), cudaFree(L->k_norm);
        }
        free(k->L);
    }
    if (k->lm_head != k->tok_embd) cudaFree(k->lm_head);
    cudaFree(k->tok_embd), cudaFree(k->out_norm), cudaFree(k->rope_cos), cudaFree(k->rope_sin), cudaFree(k->kv);
    cudaFree(k->x), cudaFree(k->xn), cudaFree(k->qkv), cudaFree(k->q), cudaFree(k->att), cudaFree(k->delta);
    cudaFree(k->deltaf), cudaFree(k->gu), cudaFree(k->h), cudaFree(k->hfin), cudaFree(k->logits);
    if (k->id) cudaFree(k->tok), cudaFree(k->lp), cudaFree(k->sout);
    cudaFree(k->amp), cudaFree(k->amp_all), cudaFree(k->part);
    cudaFree(k->cnt), cudaFree(k->pbuf[0]), cudaFree(k->pbuf[1]), cudaFree(k->pbuf[2]), cudaFree(k->pflags);
    cudaFree(k->pepoch), cudaFree(k->hw);
    cudaFree(k->din), cudaFree(k->blas_ws);
    for (int i = 0; i < k->n_qmem; i++) cudaFree(k->qmem[i]);
    free(k->qmem);
    cudaFree(k->qws.deq), cudaFree(k->qws.xperm);
    if (k->blas) cublasDestroy(k->blas);
    if (k->comm) ncclCommDestroy(k->comm);
    if (k->st) cudaStreamDestroy(k->st);
}

static void destroy(model_backend *mb)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (!b) return;
    if (b->crew) {
        pthread_mutex_lock(&b->mu);
        b->cur = JOB_EXIT;
        atomic_fetch_add(&b->gen, 1);
        pthread_cond_broadcast(&b->go);
        pthread_mutex_unlock(&b->mu);
        for (int i = 1; i < b->tp; i++)
            if (b->r[i].th_started) pthread_join(b->r[i].th, NULL);
        pthread_mutex_destroy(&b->mu);
        pthread_cond_destroy(&b->go);
        pthread_cond_destroy(&b->done);
    }
    /* after a failure the streams may never finish: leave the GPUs to the
     * process exit rather than wait on them */
    if (b->r && !b->base.fatal)
        for (int i = 0; i < b->tp; i++) rank_free(&b->r[i], &b->c);
    free(b->r);
    cudaFreeHost(b->hin), cudaFreeHost(b->hout), cudaFreeHost(b->hlog), cudaFreeHost(b->peer_abort);
    free(b->samp), free(b->host_rows), free(b->row_seq), free(b->tok_seq), free(b->row_host), free(b->row_mode), free(b->rng_before);
    free(b->pen_mark);
    free(b);
}
