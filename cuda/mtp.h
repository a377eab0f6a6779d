/* mtp.h - the MTP layer on the GPU backend (internal to cuda/): speculative
 * method "mtp" (model/backend.h's MTP paragraph says what is kept and when),
 * the same contract as the CPU backend's (model/cpu_backend.c, "MTP").
 *
 * The MTP layer is layer n_layer of the plan: its decoder block is uploaded
 * and run by the per-kind code (k->L[n_layer]: GQA or MLA mixer, dense or MoE
 * FFN); here are its own parts (enorm, hnorm, eh_proj, the head's norm; the
 * embedding and the LM head are the model's), the per-block hidden states
 * (in the KV allocation after the layers' regions, bf16 [n_blocks + 1][E],
 * their positions on the host), the last step's final-normed hidden states
 * and the two operations: the sub-step forward() runs after its sampling (the
 * step's MTP entries, FFN skipped) and ops->mtp_draft.
 *
 * The sub-step and, for the step's greedy sequences, the drafts run on the
 * rank's stream right after the step, without a host round trip between
 * them: forward() packs the sub-step's tokens with the step (cuda_mtp_pack;
 * they depend on the step's inputs only), and the drafts of a sequence whose
 * tokens the device picks start from the position the device's own
 * verification accepts (cuda_mtp_accept: the same walk as the host's), each
 * draft's embedding read from the argmax before it. The pass is a CUDA graph
 * per (sub-step tokens, draft rows) bucket, replayed after the step's own
 * work; its drafts come back in mapped host memory with the step's tokens,
 * and ops->mtp_draft hands them out when a request asks for what the
 * device drafted (position, token, at most its drafts, no logits); any other
 * request (logits wanted, a sampled sequence, another position) runs the
 * eager path (load_sub, run_layer, a wait per draft: a crew job per draft,
 * JOB_MTP_DRAFT).
 *
 * Tensor parallelism: every rank runs the pass and the eager path on its
 * share, the same code as one GPU with N = 1: the layer's heads and FFN
 * (or MoE) split as the decoder layers' are (k->L[n_layer], weights.c), its
 * KV and the blocks' hidden states in each rank's KV allocation; its own
 * parts (enorm, hnorm, eh_proj, head_norm) whole on every rank, as an MLA
 * layer's latent projections are, so the layer's input and the chained
 * hidden states are the same on every rank with no collective of their
 * own; the embedding and the LM head the model's (vocabulary-sharded: the
 * embedding's all-reduce and the distributed argmax, cuda_embed_rows and
 * cuda_head_argmax), so every rank draws the same drafts and keeps the same
 * rows. The host's state (tags, keeps, what is handed out) is one for all
 * ranks; rank 0's results come back in mapped memory, the others' stay on
 * their GPUs for their next draft's embedding. The MTP layer's attention
 * leaves position 0 out (it has no entry there): a GQA layer through this
 * file's own attention kernel (mtp.cu), an MLA layer through cuda_mla_mixer
 * with the rank's key0 set to 1. */
#ifndef SLUICE_CUDA_MTP_H
#define SLUICE_CUDA_MTP_H

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- kernels (mtp.cu) ---- */

/* The MTP layer's input of n tokens: out[j] = [bf16(enorm * e_j / rms(e_j)) |
 * bf16(hnorm * h_j / rms(h_j))], e [n][E] f32 (the tokens' embeddings), h_j
 * the bf16 row src[j] of hk when src[j] >= 0, else row -src[j] - 1 of hblk.
 * out [n][2E] bf16. */
cudaError_t cuda_mtp_in(const float *e, const uint16_t *hk, const uint16_t *hblk, const int32_t *src,
                        const float *enorm, const float *hnorm, int n, int E, float eps, uint16_t *out,
                        cudaStream_t st);
/* dst row dst_row[i] = src row src_row[i] for i < n; rows of E bf16. */
cudaError_t cuda_mtp_rows(uint16_t *dst, const int32_t *dst_row, const uint16_t *src, const int32_t *src_row, int n,
                          int E, cudaStream_t st);

/* Drafts the device makes after a step at most (the backend's K is
 * min(max_draft_tokens, this)), and drafts one of its sequences verifies at
 * most for the device to follow its verification. */
#define CUDA_MTP_MAXD 8

/* A pass region of n rows (the sub-step's, or one draft iteration's), laid
 * out as the layer code reads a step's inputs through struct inlay: slots
 * int64 [n], then ids, pos, tok_bt and src (cuda_mtp_in's) int32 [n] each. */
#define CUDA_MTP_R_IDS(n) ((size_t)(n) * 8)
#define CUDA_MTP_R_POS(n) ((size_t)(n) * 12)
#define CUDA_MTP_R_TBT(n) ((size_t)(n) * 16)
#define CUDA_MTP_R_SRC(n) ((size_t)(n) * 20)
#define CUDA_MTP_R_BYTES(n) (((size_t)(n) * 24 + 15) & ~(size_t)15)

/* One sequence the device drafts for (host-packed). */
struct cuda_mtp_dseq {
    int32_t row0;               /* its first verified logit row: the step's greedy tokens tok[row0 ..] */
    int32_t nd;                 /* drafts verified there (0: a plain sample) */
    int32_t a;                  /* the position whose token row0 samples after */
    int32_t q0;                 /* that position's hidden-state row (hk) */
    int32_t cover;              /* positions its block table covers (at tbt in bt) */
    int32_t tbt;
    int32_t vd[CUDA_MTP_MAXD];  /* the drafts verified */
};

struct cuda_mtp_accept_args {
    const struct cuda_mtp_dseq *sq; /* [*ns] */
    const int32_t *ns;          /* device: the drafted sequences (a graph's Sp is their bucket) */
    const int32_t *tok;         /* the step's greedy tokens by logit row */
    const int32_t *bt;
    int Sp, K, V, block_size;
    int32_t pad_row;            /* hblk's spare row (the pad block's) */
    int64_t pad_slot;
    int32_t g0;                 /* hk's first chained row (the drafts' hidden states) */
    int32_t *kdst, *ksrc;       /* [Sp] out: the accepted position's hidden state, hk row -> hblk row */
    uint8_t *r1;                /* K regions of Sp rows, CUDA_MTP_R_BYTES(Sp) apart: positions, slots, block
                                   tables, hidden rows of each draft iteration, iteration 0's tokens */
    int32_t *out_p, *out_k, *out_tok; /* [ns] out: position p, drafts made, the token at p + 1 */
};
/* Per sequence j < ns: the accepted position p (rows row0 + i while the
 * token is the next verified draft, as the host's verification walks),
 * its drafts' inputs (positions p + 1 .. p + k, k = min(K, cover - 1 - p));
 * the rows past k and j >= ns are padding (position 0, the pad slot). */
cudaError_t cuda_mtp_accept(const struct cuda_mtp_accept_args *a, cudaStream_t st);
/* ids[i] outside [0, V) (an argmax of logits that are not finite: -1) -> 0, for i < n: a draft's
 * token feeds the next draft's embedding lookup (the host reads 0 there as the eager path makes it). */
cudaError_t cuda_mtp_fix_ids(int32_t *ids, int n, int V, cudaStream_t st);

struct cuda_mtp_attn_args {
    const uint16_t *q;          /* [T][H][D] bf16, roped */
    const void *kc, *vc;        /* the layer's K and V: [slots][KVH][D] bf16, or fp8 e4m3 bytes when kv8 */
    const int32_t *pos;         /* [T] */
    const int32_t *tok_bt;      /* [T] where token t's block table starts in bt */
    const int32_t *bt;
    uint16_t *out;              /* [T][H][D] bf16 */
    int T, H, KVH, D, block_size, key0;
    float scale;
    bool kv8;
};
/* Causal GQA attention of each token's heads over its sequence's keys
 * key0 .. pos[t] (online softmax in f32; one block per token and head). */
cudaError_t cuda_mtp_attention(const struct cuda_mtp_attn_args *a, cudaStream_t st);

/* ---- the backend's side (mtp.c; C only) ---- */
#ifndef __CUDACC__
#include "cuda/cuda_internal.h" /* struct qproj */

struct rank;
struct cuda_backend;
struct model_config;
struct step;
struct model_mtp_req;
struct model_backend;

#define CUDA_MTP_GT 10 /* pass graphs for sub-steps of 1, 2, 4 .. 512 tokens */
#define CUDA_MTP_GS 12 /* and 0, 1, 2, 4 .. 1024 draft rows */

/* Per rank (k->mtpx): the MTP layer's own parts and the scratch its steps use, device. */
struct cuda_mtp_rank {
    float *enorm, *hnorm, *head_norm; /* [E] f32 */
    uint16_t *eh;               /* [E][2E] bf16 eh_proj, or NULL when packed (qeh) */
    struct qproj qeh;           /* packed eh_proj */
    uint16_t *in;               /* [max_tokens][2E] bf16: the layer's input */
    uint16_t *hk;               /* [max_tokens + max_seqs][E] bf16: the last step's final-normed hidden states,
                                   then each draft request's chained one (head_norm of the layer's output) */
    int32_t *didx;              /* [max_tokens + 2 cap] device mirror of the backend's hidx */
    uint8_t *mdin;              /* the pass's inputs (b->mtp->mhin's mirror; sized at kv_alloc) */
    float *dlp;                 /* [max_seqs] the drafts' argmax logprobs (unused) */
    uint16_t *hblk;             /* [kv_blocks + 1][E] bf16 in the rank's KV allocation: each block's kept hidden
                                   state (the same on every rank) */
    int32_t *res;               /* [K + 3][max_seqs] the pass's drafts and results (cuda_mtp.hres's layout):
                                   rank 0's is dres (mapped host memory), the others' their own */
    cudaGraphExec_t gx[CUDA_MTP_GT][CUDA_MTP_GS]; /* the pass by (sub-step tokens, draft rows) bucket */
};

/* Where a pass of Tn sub-step rows and Sp draft rows keeps its inputs in
 * mdin (byte offsets): the drafted sequences, the sub-step's hidden-state
 * keeps (hblk row <- hk row), the accepted positions' keeps, the sub-step's
 * region, K draft regions, then the block tables (bt_cap entries). */
struct cuda_mtp_lay {
    size_t ns, dseq, kdst, ksrc, ddst, dsrc, r0, r1, rs, bt, total;
};

/* Per backend (b->mtp): host state. */
struct cuda_mtp {
    int32_t *htag;              /* [kv_blocks] host: the position of each block's hidden state (-1: none) */
    int kv_blocks;
    int cap;                    /* sub-step tokens at most: max_tokens + max_seqs */
    int *last_q0, *last_pos0, *last_len; /* [max_seqs] the last step's sequences: first token, position, count */
    int last_n;                 /* sequences in the last step; -1 after a failed or no forward */
    int32_t *sub_tok, *sub_pos, *sub_src, *sub_seq; /* [cap] a sub-step's tokens, positions, hidden rows
                                   (cuda_mtp_in's src) and sequences */
    int64_t *sub_slot;          /* [cap] */
    const int32_t **sub_bt;     /* [max_seqs] each sub-step sequence's block table (borrowed) */
    int *sub_nb;                /* [max_seqs] its blocks to copy */
    int32_t *keep_dst, *keep_src; /* [cap] hblk rows and the hk rows they take */
    int *keep_pos;              /* [cap] the positions of those hidden states (the tags) */
    unsigned *stamp;            /* [kv_blocks] keep_rows' last writer of each block (gen) */
    unsigned gen;
    int *req_t;                 /* [max_seqs] each draft request's row in the last iteration */
    int *row_req;               /* [max_seqs] each sub-step row's draft request */
    int32_t *hidx;              /* pinned [max_tokens + 2 cap]: the sub-step's hidden rows, then keep_dst, keep_src */

    /* the pass after each step (cuda_mtp_pack, cuda_mtp_rank_pass) */
    int K;                      /* drafts the device makes a sequence: min(max_draft, CUDA_MTP_MAXD) */
    uint8_t *mhin;              /* pinned: the pass's inputs, copied to mdin */
    size_t mbytes;              /* mhin's size (the largest pass's layout) */
    bool run;                   /* this step has a pass */
    int Tn, Sp, ns, gt, gs;     /* its region rows, draft rows (ns real), graph bucket (gt -1: eager) */
    int nl, nw;                 /* eager: the sub-step's tokens and keeps (a graph runs Tn of each) */
    size_t nbytes;              /* bytes of mhin it fills */
    int *dev_j;                 /* [max_seqs] each step sequence's draft row, or -1 */
    int *dev_seq;               /* [max_seqs] each draft row's step sequence */
    int32_t *hres, *dres;       /* mapped [K + 3][max_seqs]: the drafts by iteration, then out_p, out_k, out_tok
                                   (cuda_mtp_accept_args); dres its device address */
    struct model_mtp_req *ereq; /* [max_seqs] the requests left to the eager path */
    /* an eager draft iteration (JOB_MTP_DRAFT, what each rank runs) */
    int e_it, e_n, e_nw;        /* the iteration, its rows, the keeps before it (hidx; the first only) */
    size_t e_bytes;             /* bytes of hin its rows fill */
    /* the warm-up's steps: the pass graphs to capture, over inputs that keep nothing (an all-zero pass) */
    int n_warm;
    int warm[CUDA_MTP_GT * CUDA_MTP_GS][4]; /* (gt, gs, Tn, Sp) */
};

/* Whether the GPU backend runs c's MTP layer with N ranks: 0, or SL_EUNSUP
 * with a message naming the reason. */
int cuda_mtp_check(const struct model_config *c, int N, char *err, size_t errlen);
/* Rank k's MTP parts and scratch (k->mtpx), after its layers (weights.c;
 * stage and tmp: cuda_upload_proj's). The MTP layer's decoder block is
 * k->L[n_layer], uploaded with the others. */
int cuda_mtp_upload(struct rank *k, uint16_t *stage, float *tmp, char *err, size_t errlen);
void cuda_mtp_free(struct rank *k);
/* The backend's host state (b->mtp), after the ranks' init. */
int cuda_mtp_create(struct cuda_backend *b, char *err, size_t errlen);
void cuda_mtp_destroy(struct cuda_backend *b);
/* After kv_alloc's ranks: the hidden states' place (k->kv_off[n_layer + 1]), every tag cleared. */
int cuda_mtp_kv_alloc(struct cuda_backend *b, int n_blocks, char *err, size_t errlen);
/* At the start of forward(): no step to draft from until this one succeeds. */
void cuda_mtp_forget(struct cuda_backend *b);
/* Before the step runs (after pack_step): the pass's inputs packed into
 * mhin, the sub-step's hidden-state tags set; b->mtp->run says whether the
 * step has a pass. During the warm-up the pass keeps nothing: it captures
 * the graphs of the buckets that steps of this one's shape (its batch
 * bucket, its tokens a sequence) take, over inputs that write only block 0
 * and the pad block. SL_EINVAL when the block tables do not fit. */
int cuda_mtp_pack(struct cuda_backend *b, const struct step *s, char *err, size_t errlen);
/* Rank k's pass, after its step's work on its stream (JOB_FORWARD): the
 * step's final-normed hidden states, the sub-step, the accepted positions'
 * keeps and the drafts; a graph where the bucket has one. */
int cuda_mtp_rank_pass(struct rank *k, char *err, size_t errlen);
/* Rank k's part of an eager draft iteration (JOB_MTP_DRAFT). */
int cuda_mtp_rank_draft(struct rank *k, char *err, size_t errlen);
/* At the end of a successful forward(): the accepted positions' tags, the
 * step recorded for mtp_draft. */
void cuda_mtp_after_step(struct cuda_backend *b, const struct step *s);
/* ops->mtp_draft (model/backend.h). */
int cuda_mtp_draft(struct model_backend *mb, struct model_mtp_req *r, int n, char *err, size_t errlen);
#endif

#ifdef __cplusplus
}
#endif

#endif
