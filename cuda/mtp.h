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
 * Both run eagerly on the caller's thread after the step (outside the decode
 * CUDA graphs): correctness first; a captured sub-step is later work. One GPU
 * only (creation refuses --tensor-parallel-size > 1 with MTP). The MTP
 * layer's attention leaves position 0 out (it has no entry there): a GQA layer
 * through this file's own attention kernel (mtp.cu), an MLA layer through
 * cuda_mla_mixer with the rank's key0 set to 1. */
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

/* Per rank (k->mtpx): the MTP layer's own parts and the scratch its steps use, device. */
struct cuda_mtp_rank {
    float *enorm, *hnorm, *head_norm; /* [E] f32 */
    uint16_t *eh;               /* [E][2E] bf16 eh_proj, or NULL when packed (qeh) */
    struct qproj qeh;           /* packed eh_proj */
    uint16_t *in;               /* [max_tokens][2E] bf16: the layer's input */
    uint16_t *hk;               /* [max_tokens + max_seqs][E] bf16: the last step's final-normed hidden states,
                                   then each draft request's chained one (head_norm of the layer's output) */
    int32_t *didx;              /* [max_tokens + 2 cap] device mirror of the backend's hidx */
};

/* Per backend (b->mtp): host state. */
struct cuda_mtp {
    uint16_t *hblk;             /* borrowed: rank 0's [kv_blocks + 1][E] bf16 in its KV allocation */
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
/* At the end of a successful forward() (after sampling): the step's hidden
 * states kept and its MTP entries written. A CUDA failure sets base.fatal. */
int cuda_mtp_after_step(struct cuda_backend *b, const struct step *s, char *err, size_t errlen);
/* ops->mtp_draft (model/backend.h). */
int cuda_mtp_draft(struct model_backend *mb, struct model_mtp_req *r, int n, char *err, size_t errlen);
#endif

#ifdef __cplusplus
}
#endif

#endif
