/* cuda_internal.h - what the GPU backend's files share (internal to cuda/):
 * the backend and rank structs, the checking macros, and the functions one
 * file calls in another. cuda_backend.c: creation, KV memory, warm-up,
 * teardown; weights.c: a rank's share of the model (upload, packing,
 * sharding) and its working memory; step.c: the per-step plan, the layers'
 * launches, graphs and forward(); crew.c: the rank threads (one per GPU),
 * failure propagation. cuda_backend.c's opening comment says how they work
 * together. */
#ifndef SLUICE_CUDA_INTERNAL_H
#define SLUICE_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "cuda/kernels.h"
#include "cuda/qgemm.h"
#include "cuda/tuning.h"
#include "model/backend.h"

#define NBUCKET 10
#define VGRAPH_K 4 /* verify steps of up to this many drafts a sequence run as graphs */
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

struct cuda_moe_layer; /* cuda/moe.h */
struct cuda_moe_rank;

struct clayer {
    struct qproj qqkv, qo, qgu, qdown; /* packed weights: the bf16 pointer below is then NULL */
    uint16_t *wqkv;     /* [(H + 2 KVH) D / N][E] bf16, device: this rank's q, k, v rows */
    uint16_t *wo;       /* [E][H D / N]: this rank's columns */
    uint16_t *wgu;      /* [2F / N][E]: this rank's gate rows then its up rows */
    uint16_t *wdown;    /* [E][F / N] */
    float *attn_norm, *ffn_norm; /* [E] f32, device */
    float *bqkv;        /* [(H + 2 KVH) D / N] or NULL */
    float *q_norm, *k_norm; /* [D] or NULL */
    struct cuda_hc_layer *hc; /* MODEL_RESID_HC layers: the two sites (cuda/hc.h); else NULL */
    struct cuda_moe_layer *moe; /* MODEL_FFN_MOE layers (cuda/moe.h); then no wgu/wdown */
    struct cuda_mla_layer *mla; /* MLA layers (cuda/mla.h; the GQA fields above unused), else NULL */
    struct cuda_kda_layer *kda; /* a KDA layer's (kda.h), else NULL */
};

/* Offsets (in bytes) of the per-step inputs inside hin/din; max_items:
 * the attention items the items region holds; kda_seqs / kda_snaps: the
 * KDA layers' per-sequence entries and snapshots (kda.h; empty without KDA
 * layers), max_kda_snaps of them; mla: MLA's expanded-form plan
 * (cuda_mla_xdev_at, for max_tokens and max_seqs; empty without it and in
 * graphs' layouts). */
struct inlay {
    size_t slots, ids, pos, tok_part, tok_nsplit, tok_bt, rows, n_items, items, kda_seqs, kda_snaps, mla, bt, srows,
        pen, total;
    int max_items, max_kda_snaps;
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
    size_t kv_layer;                /* elements of one GQA layer's K (or V) */
    size_t *kv_off;                 /* [n_layer + n_mtp_layer + 1] byte offset of each layer's region in kv (host);
                                       the last: their end (with MTP the blocks' hidden states, cuda/mtp.h) */
    struct cuda_mla_rank *mlax;     /* MLA's tables and scratch (cuda/mla.h), NULL without MLA layers */

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
    struct inlay lay;               /* where the layer code finds its inputs in din: b->lay during a step (set
                                       by the rank's job), the MTP pass's region during its pass (per rank:
                                       the ranks' passes run while others still enqueue their steps) */
    struct cuda_hc_rank *hcx;       /* hyper-connection streams and scratch (cuda/hc.h), or NULL */
    struct cuda_moe_rank *moex;     /* the MoE layers' step scratch (cuda/moe.h), or NULL */
    struct cuda_kda_rank *kdax;     /* the KDA layers' state slots and scratch (kda.h), or NULL */
    struct cuda_mtp_rank *mtpx;     /* the MTP layer's own parts and scratch (cuda/mtp.h), or NULL */
    cudaGraphExec_t gexec[NBUCKET];
    cudaGraphExec_t vexec[VGRAPH_K][NBUCKET]; /* verify steps of K + 1 tokens a sequence (step.c), by K - 1 */

    pthread_t th;                   /* ranks >= 1 */
    bool th_started;
    long steps;                     /* forwards run, for tuning.tp_fault_step */
    int rc;                         /* last job's result */
    char err[512];
};

enum job { JOB_INIT, JOB_KV, JOB_FORWARD, JOB_KDA_ROLLBACK, JOB_MTP_DRAFT, JOB_EXIT };
enum { ROW_GREEDY, ROW_SAMPLE, ROW_HOST }; /* who picks a logit row's token */

struct cuda_backend {
    struct model_backend base;
    struct model_config c;
    const struct model_weights *w;
    int tp;
    int max_tokens, max_seqs, max_ctx, n_sm;
    int max_draft;                  /* drafts a sequence verifies at most (step_seq.n_draft; 0: none) */
    int max_rows;                   /* logit rows a step: each sequence 1 + max_draft, at most max_tokens */
    int kv_blocks, block_size;
    struct rank *r;                 /* [tp] */

    /* step inputs: one pinned (portable) host buffer every rank copies from */
    struct inlay lay;               /* the current step's (cuda_step_lay) */
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
    size_t state_bytes;             /* one state slot (model_state_bytes; 0: no recurrent layers) */
    int state_slots;                /* state slots allocated (state_alloc) */
    void *samp;                     /* model_sample scratch, samp_bytes per host thread */
    size_t samp_bytes;
    int nt;                         /* host threads sampling rows (OpenMP) */
    int *host_rows;                 /* [max_seqs] rows model_sample picks this step */
    int *row_seq, *tok_seq;         /* host scratch */
    struct cuda_mtp *mtp;           /* opts.mtp: the MTP layer's host state (cuda/mtp.h), else NULL */
    struct cuda_mla_xplan *xplan;   /* MLA's expanded form: its geometry and the step's plan (cuda/mla.h), or
                                       NULL (no MLA, or the absorbed form only) */
    bool xplan_on;                  /* this step's plan holds tokens in the expanded form */

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
        int vk;                                     /* gi >= 0: a verify step's drafts a sequence (0: decode) */
        bool decode;
        int max_rows;                               /* attention rows per item of this step */
        int pstride;                                /* its split partials' stride (0: MAXSPLIT) */
        int n_samp, n_pen;                          /* ROW_SAMPLE rows, their penalty entries */
        size_t nbytes;
        int kda_roll;                               /* JOB_KDA_ROLLBACK: its kda_seqs entries (cuda/kda.h) */
        bool kda_drafts;                            /* JOB_FORWARD: some sequence verifies drafts (cuda_kda_pack) */
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

/* cuda_check.h's macro for each API, into err/errlen, on to the label fail */
#define CK(call) CUDA_TRY(call, #call, cudaError_t, cudaSuccess, cudaGetErrorString, err, errlen, fail)
#define CB(call) \
    CUDA_TRY(call, #call, cublasStatus_t, CUBLAS_STATUS_SUCCESS, cublasGetStatusString, err, errlen, fail)
#define NC(call) CUDA_TRY(call, #call, ncclResult_t, ncclSuccess, ncclGetErrorString, err, errlen, fail)

/* ---- crew.c ---- */

/* Runs job on every rank: rank 0 on the caller's thread, the others on
 * their threads; returns the first failing rank's error (by rank order). */
int cuda_crew_run(struct cuda_backend *b, enum job job, char *err, size_t errlen);
/* Waits for rank k's stream; with N > 1 a failure elsewhere ends the wait. */
int cuda_rank_wait(struct rank *k, char *err, size_t errlen);

/* ---- weights.c ---- */

/* cudaMalloc of n bytes (16 when n is 0) into *p; SL_ENOMEM with a message. */
int cuda_dmalloc(void **p, size_t n, char *err, size_t errlen);
/* Elements [first, first + n) of t (any float dtype) as f32, each through
 * map when not NULL, into a new device buffer *dst (cuda_dmalloc'd);
 * SL_EFORMAT when t is absent or shorter. */
int cuda_upload_vec(const struct model_tensor *t, size_t first, size_t n, float (*map)(float), float **dst, char *err,
                    size_t errlen);
/* Rank k's part of creation (JOB_INIT, on its own thread). */
int cuda_rank_init(struct rank *k, char *err, size_t errlen);
/* One projection's weight on rank k (rows r0[i] .. r0[i] + nr[i] of t[i],
 * columns c0 .. c0 + nc of `cols`), bf16 into *dense or packed into *P;
 * stage: pinned [16M] bf16, tmp: host [16M] f32 (weights.c's upload_proj). */
int cuda_upload_proj(struct rank *k, const struct model_tensor *const *t, const int64_t *r0, const int64_t *nr, int n,
                     int64_t cols, int64_t c0, int64_t nc, uint16_t **dense, struct qproj *P, uint16_t *stage,
                     float *tmp, char *err, size_t errlen);
/* Raises *deq / *xp to what cuda_qgemm's workspace needs for P (weights.c's qws_need). */
void cuda_qws_need(const struct qproj *P, bool whole, size_t *deq, size_t *xp);

/* ---- step.c ---- */

/* The backend's forward (model_backend_ops). */
int cuda_forward(model_backend *mb, struct step *s, char *err, size_t errlen);
/* Rank k's part of a step (JOB_FORWARD). */
int cuda_rank_forward(struct rank *k, char *err, size_t errlen);
/* y = x W^T on rank k's stream: the bf16 matrix W, or P's packed parts
 * (step.c's proj). */
cublasStatus_t cuda_proj(struct rank *k, const struct qproj *P, const uint16_t *W, const uint16_t *x, void *y,
                         bool yf32, int T, int in, int out);
/* A row-parallel projection into k->delta, summed over the ranks (step.c's proj_rows). */
int cuda_proj_rows(struct rank *k, const uint16_t *x, const struct qproj *P, const uint16_t *W, int T, int in, int E,
                   int buf, bool resid, char *err, size_t errlen);
/* x [T][E] f32 = the embeddings of ids (device) on rank k's stream: with
 * N > 1 each rank's vocabulary rows, completed by an all-reduce (step.c's
 * first launches). */
int cuda_embed_rows(struct rank *k, const int32_t *ids, int T, char *err, size_t errlen);
/* tok[r], lp[r] for r < R: the greedy token (lowest id on ties) and its
 * logprob of rank k's logits [R][vn], with N > 1 over every rank's slice
 * (the distributed argmax), so that every rank gets the same tokens. */
int cuda_head_argmax(struct rank *k, int R, int32_t *tok, float *lp, char *err, size_t errlen);
/* Launches *ge on k's stream, first capturing what fn(k, arg) enqueues there
 * into it when *ge is NULL (left NULL when fn or the capture fails). */
int cuda_graph_run(struct rank *k, cudaGraphExec_t *ge, int (*fn)(struct rank *k, void *arg, char *err, size_t errlen),
                   void *arg, char *err, size_t errlen);

/* ---- cuda_backend.c ---- */

/* Rank k's KV memory and step-input mirror (JOB_KV). */
int cuda_rank_kv_alloc(struct rank *k, char *err, size_t errlen);
/* The step-input layout for a step of Tp tokens (graph gi, or -1). */
struct inlay cuda_step_lay(const struct cuda_backend *b, int gi, int Tp);

#endif
