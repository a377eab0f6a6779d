/* mla.h - multi-head latent attention on the GPU backend (internal to cuda/):
 * a layer's weights and scratch (struct cuda_mla_layer, filled by
 * cuda_mla_upload), the rank's RoPE tables (struct cuda_mla_rank), the
 * mixer enqueue() dispatches to, and the kernels' host functions (mla_kern.cu: mla.o is mla.c's object;
 * mla_prefill.cu: the tensor-core attention for prefill chunks).
 *
 * The step, as model/cpu_mla.c computes it (transformers' DeepseekV3Attention):
 *   q      = q_b(rmsnorm(q_a(xn))) or q_proj(xn)        per head [nope | rope]
 *   latent = rmsnorm(kv_a(xn)[:C]), k_rope = kv_a(xn)[C:]
 *   RoPE (cos and sin times YaRN's attention factor) on q's rope part and k_rope
 * then, for query tokens at prompt positions in prefill steps of dense MLA
 * (no indexer), the expanded form, as cpu_mla.c computes them: each such
 * sequence's context (cached latents and this step's, through the last of
 * its prompt tokens here) gathered from the paged cache and up-projected
 * through kv_b into per-head K [nope | the shared rope key] and V in a
 * scratch, then the GQA tensor-core kernel (attn.cu, H KV heads, an
 * identity block table over the scratch, keys and values of their own
 * widths) straight into the per-head output, which o_proj takes (no W_V
 * after it). Per key and head that is Dn + R + Dv multiply-adds (320 at
 * DeepSeek's shape) against the absorbed form's 2C + R (1088). The rest
 * (decode steps, tokens past the prompt, the MTP layer, layers with the
 * indexer's choice, and all of them where the scratch was not allocated)
 * take the absorbed form (causal within the step): q_lat_h = W_K,h^T q_nope_h (one strided-batched
 * GEMM over the heads), scores (q_lat . latent_j + q_rope . k_rope_j) *
 * softmax_scale over the paged entries 0..pos (steps of cuda_tuning's
 * mla_prefill_min_t tokens or more on the tensor cores, cuda_mla_prefill,
 * the indexer's choice too; decode steps on the SIMT kernel,
 * cuda_mla_attention), the weighted latent sum, W_V,h
 * times it (a second batched GEMM), then o_proj into k->delta.
 *
 * The paged entry of a token in an MLA layer is [latent C | k_rope R], bf16
 * (or fp8 e4m3 with --kv-cache-dtype fp8), at the layer's region of k->kv
 * (k->kv_off[l]), and with the DSA indexer the layer's LayerNormed, rotated
 * indexer key after them. Tensor parallel (N ranks): the latent projections (q_a,
 * kv_a) and so the cache entries whole on every rank, the heads split after
 * them (rows of q_b or q_proj and kv_b, columns of o_proj, whose partial sums
 * the o projection's all-reduce adds); the indexer whole on every rank. Not
 * here: the MTP layer's own parts (cuda/mtp.h; its decoder block is an
 * ordinary layer here, with key0 1). */
#ifndef SLUICE_CUDA_MLA_H
#define SLUICE_CUDA_MLA_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

struct rank;
struct model_config;

/* One MLA layer on one rank: weights bf16 [out][in] (packed weights are
 * dequantized to bf16 at upload), norms f32, all device. */
struct cuda_mla_layer {
    uint16_t *q_a, *q_b, *q;     /* [QL][E], [H Dq][QL] (q_lora_rank > 0); else q [H Dq][E] */
    uint16_t *kv_a;              /* [C + R][E] */
    uint16_t *kv_b;              /* [H (Dn + Dv)][C]: per head Dn K rows then Dv V rows */
    uint16_t *o;                 /* [E][H Dv] */
    float *q_a_norm, *kv_a_norm; /* [QL], [C] */
    int W;                       /* values of a paged entry: C + R (+ ID where it runs the indexer) */
    /* the DSA indexer (glm_moe_dsa, index_topk > 0, the layers that run their own), whole on every rank */
    bool ix;
    uint16_t *ix_wq_b, *ix_wk, *ix_w; /* [IH ID][QL], [ID][E], [IH][E] */
    uint16_t *ix_gate;           /* [ID][E] k-pools' gate (index_kpool > 0), else NULL */
    float *ix_kn, *ix_kb;        /* [ID] the key's LayerNorm weight and bias */
    float *ix_ape;               /* [KP][ID] k-pools' position bias, else NULL */
    int ix_i;                    /* with k-pools: which of the rank's pool-key arrays (x->ixpool) is its own */
};

/* Per rank: the RoPE tables (cos and sin times the YaRN attention factor,
 * as cpu_mla.c builds them) and the step's scratch, [max_tokens] rows. */
struct cuda_mla_rank {
    float *rcos, *rsin;          /* [max_ctx][R/2], NULL when R == 0 */
    float *qa;                   /* [QL] f32: q_a's output */
    uint16_t *qan;               /* [QL] bf16: normed */
    float *q;                    /* [H][Dn + R] f32 */
    uint16_t *qn;                /* [H][Dn] bf16: q_nope for the absorption GEMM */
    float *kva;                  /* [C + R] f32 */
    float *qlat;                 /* [H][C] f32 */
    uint16_t *olat;              /* [H][C] bf16: the weighted latent sums */
    uint16_t *att;               /* [H][Dv] bf16 */
    float *apart;                /* the attention's split partial sums (cuda_mla_attn_part_bytes), or NULL */
    /* the indexer (index_topk > 0): K keys a query attends at most; a shared layer reuses the
     * choice of the last layer that ran its own (sel and nsel stay from it) */
    int K, KS;                   /* KS: a query's room in sel, K (+ KP with k-pools) */
    float *ixq, *ixk, *ixw, *ixg; /* [IH][ID], [ID], [IH], [ID] (k-pools' gate scores) f32 */
    float *ixs;                  /* [ixT][max_ctx] f32: a query's key (or pool) scores */
    int ixT;                     /* queries the indexer scores at a time (a step's in chunks of ixT:
                                  * ixs stays small at long contexts) */
    int32_t *sel;                /* [KS]: each query's chosen keys, ascending */
    int32_t *nsel;               /* their count, or -1: every key 0..pos */
    int key0;                    /* the mixer attends keys key0..pos: 0, or 1 while cuda/mtp.c runs the MTP layer */
    /* the expanded form (NULL where not allocated: the absorbed form only); rows: b->xplan's */
    uint16_t *xlat;              /* [rows][C] bf16: the gathered latents */
    uint16_t *xk, *xv;           /* [rows][H][DK], [rows][H][DV] bf16 (one allocation; the padding columns zero) */
    uint16_t *xq;                /* [max_tokens][H][DK] bf16: the queries [q_nope | rotated q_rope | 0] */
    int32_t *xiota;              /* [rows / CUDA_MLA_XBS]: the identity block table over the scratch */
    /* k-pools: each indexer layer's pool keys, f32 [n_blocks + 1][PB][ID] (cuda_mla_ix_args' pk), allocated
     * with the KV blocks (cuda_mla_kv_alloc) and counted in their bytes (cuda_mla_pool_block_bytes) */
    float *ixpool;
    size_t ixpool_n;             /* floats of one layer's array */
};

/* ---- the expanded form's plan (mla.c) and kernels (mla_expand.cu) ---- */

#define CUDA_MLA_XBS 64          /* a sequence's context starts at a multiple of this many scratch rows */

struct cuda_mla_xseq {           /* one sequence's context in the scratch (device) */
    int32_t row0;                /* its first row, a multiple of CUDA_MLA_XBS */
    int32_t n;                   /* its keys: positions 0 .. n - 1 at rows row0 .. row0 + n - 1 */
    int32_t bt0;                 /* where its paged block table starts in bt */
    int32_t pad;
};
/* One sequence of a step as the planner reads it (host). */
struct cuda_mla_xin {
    int query_start, query_len, context_len, n_prompt, bt0;
};
/* The sequences that fit the scratch together: one gather, two GEMMs, one attention launch. */
struct cuda_mla_xgroup {
    int seq0, nseq;              /* their entries in the step's cuda_mla_xseq */
    int item0, nitem;            /* their attention items */
    int rows, max_n;             /* scratch rows they take; most keys of one */
};
/* The step's device-side plan: pointers into the step buffer (host) or its mirror (device). */
struct cuda_mla_xdev {
    struct cuda_mla_xseq *seqs;  /* [max_seqs] */
    int32_t *n_items;            /* [max_seqs]: each group's item count (the attention reads it) */
    int32_t *tok_part, *tok_nsplit; /* [max_tokens]: the expanded attention's split partials (attn.cu) */
    int32_t *aidx;               /* [max_tokens]: the tokens in the absorbed form, ascending */
    struct cuda_attn_item *items; /* [max_items] */
};
/* The expanded form's geometry (set at creation) and one step's plan (cuda_mla_xplan). */
struct cuda_mla_xplan {
    int rows;                    /* scratch rows: max_ctx rounded up to CUDA_MLA_XBS */
    int H, DK, DV;               /* a rank's heads; the attention's key and value widths (padded) */
    int Dn, R, Dv;               /* the model's */
    int qrows;                   /* query tokens an attention item (cuda_tuning.mla_expand_rows) */
    int n_sm, max_tokens, max_seqs, max_items;
    size_t part_bytes;           /* the split partials' room (the rank's apart) */
    size_t comp_bytes;           /* the scratch's bytes (K and V), where the absorbed tokens may gather */
    /* the step's */
    int n_seq, n_groups;         /* expanded sequences, their groups */
    int Te, Ta;                  /* tokens in the expanded and in the absorbed form */
    int pstride;                 /* the expanded attention's split stride (0: no splits) */
    bool compact;                /* the absorbed tokens gathered into the scratch first (else the absorbed form
                                  * runs over every token, and the expanded form overwrites its tokens' rows) */
    struct cuda_mla_xgroup *g;   /* [max_seqs] */
    int *src;                    /* [max_seqs]: each expanded sequence's index in the step */
    struct cuda_mla_xin *in;     /* [max_seqs]: the step's sequences (cuda_mla_step_plan's) */
};
struct cuda_backend;
struct step;
/* After the ranks' creation: b->xplan with its geometry where every rank
 * holds the scratch, else NULL (the absorbed form only). 0 or SL_ENOMEM. */
int cuda_mla_xsetup(struct cuda_backend *b, char *err, size_t errlen);
void cuda_mla_xfree(struct cuda_backend *b);
/* The step's plan (cuda_mla_xplan) into b->xplan and the step buffer's
 * region at b->lay.mla; false: every token in the absorbed form. A step
 * not a decode step, packed in the full layout (not a graph's). */
bool cuda_mla_step_plan(struct cuda_backend *b, const struct step *s);
/* Bytes of the step buffer's region the plan takes, and its arrays at base. */
size_t cuda_mla_xbytes(int max_tokens, int max_seqs, int max_items);
struct cuda_mla_xdev cuda_mla_xdev_at(uint8_t *base, int max_tokens, int max_seqs);
/* Plans a step of T tokens at positions pos (host) over its n sequences
 * (in step order): the tokens at prompt positions of each sequence take the
 * expanded form, keys 0 .. through its last such token; the others the
 * absorbed form. Fills p's step fields and d's arrays (host); false where
 * no token takes the expanded form (then d is not touched but for nothing). */
bool cuda_mla_xplan(struct cuda_mla_xplan *p, const struct cuda_mla_xin *in, int n, const int32_t *pos, int T,
                    const struct cuda_mla_xdev *d);
/* The absorbed tokens gathered in the scratch (base: xk): q [n][H][Dn + R] f32,
 * qn [n][H][Dn], att [n][H][Dv] bf16, pos and tok_bt [n]. */
struct cuda_mla_comp {
    float *q;
    uint16_t *qn, *att;
    int32_t *pos, *tok_bt;
};
struct cuda_mla_comp cuda_mla_comp_at(void *base, int n, int H, int Dq, int Dn, int Dv);
size_t cuda_mla_comp_bytes(int n, int H, int Dq, int Dn, int Dv);

/* xq[t][h] = bf16 of q[t][h] (Dq values), zero to DK, for t < T. */
cudaError_t cuda_mla_xq(const float *q, int T, int H, int Dq, int DK, uint16_t *xq, cudaStream_t st);
struct cuda_mla_xg_args {
    const void *cache;           /* the layer's [slots][W], bf16 or e4m3 */
    const int32_t *bt;
    const struct cuda_mla_xseq *seqs; /* [n_seqs] device */
    int n_seqs, max_n;           /* max_n: the most keys of one (host: the grid) */
    int C, R, W, Dn, H, DK, block_size;
    bool kv8;
    uint16_t *lat;               /* [rows][C] out */
    uint16_t *k;                 /* [rows][H][DK]: columns Dn .. DK of every head written (the rope key, zeros) */
    uint16_t *v;                 /* [rows][H][DV]: columns Dv .. DV of every head written (zeros) */
    int Dv, DV;
};
/* Each sequence's entries 0 .. n - 1 to its scratch rows: the latent to lat, the rope key to every head's K,
 * and K's and V's padding columns zeroed (the columns the up-projections write are left alone). */
cudaError_t cuda_mla_xgather(const struct cuda_mla_xg_args *a, cudaStream_t st);
/* The absorbed tokens idx[0 .. n) (device) gathered: c.q[i] = q[idx[i]] ([H][Dq] f32), c.qn[i] = qn[idx[i]]
 * ([H][Dn]), c.pos[i] = pos[idx[i]], c.tok_bt[i] = tok_bt[idx[i]]. */
cudaError_t cuda_mla_compact(const int32_t *idx, int n, const float *q, const uint16_t *qn, const int32_t *pos,
                             const int32_t *tok_bt, int H, int Dq, int Dn, const struct cuda_mla_comp *c,
                             cudaStream_t st);
/* dst[idx[i]][0 .. w) = src[i][0 .. w) for i < n (bf16 rows; w even). */
cudaError_t cuda_mla_scatter(const int32_t *idx, int n, const uint16_t *src, int w, uint16_t *dst, cudaStream_t st);

/* One group of the expanded form (mla.c): the gather, K's nope columns and
 * V through kv_b (per head: [rows][C] x W_K,h^T, x W_V,h^T, cuBLAS on blas,
 * whose stream is st), then the attention, whose output (at.out, [T][H][Dv])
 * o_proj takes. */
struct cuda_mla_xrun_args {
    struct cuda_mla_xg_args g;   /* the group's sequences and the scratch (g.lat, g.k, g.v) */
    const uint16_t *kv_b;        /* [H (Dn + Dv)][C] bf16 */
    int rows;                    /* scratch rows the group takes */
    struct cuda_attn_args at;    /* q the cuda_mla_xq rows, kc g.k, vc g.v, bt the identity table
                                  * (block_size CUDA_MLA_XBS), KVH H, D DK, Dv DV, Do the model's Dv */
};
int cuda_mla_xrun(cublasHandle_t blas, const struct cuda_mla_xrun_args *a, cudaStream_t st, char *err,
                  size_t errlen);

/* Whether the GPU backend can run c's MLA layers with N ranks and the KV
 * dtype (kv8: fp8 e4m3); 0, or SL_EUNSUP with a message naming what is
 * missing (the DSA indexer, heads N does not divide, shapes the kernels do not take). */
int cuda_mla_check(const struct model_config *c, int N, char *err, size_t errlen);
/* Uploads layer l's MLA weights to rank k (k->L[l].mla, owned) and, at the
 * first MLA layer, the rank's tables and scratch (k->mlax). 0 or an error. */
int cuda_mla_upload(struct rank *k, int l, char *err, size_t errlen);
/* Frees what cuda_mla_upload allocated for layer l (the rank's part with
 * the last layer of the model). Accepts a layer never uploaded. */
void cuda_mla_free(struct rank *k, int l);
/* Layer l's mixer over T tokens of the step: reads k->xn, writes the
 * entries at the step's slots, attends over the paged cache, leaves the
 * output in k->delta ([T][E] bf16); enqueued on k->st (graph-safe). */
int cuda_mla_mixer(struct rank *k, int l, int T, bool decode, char *err, size_t errlen);
/* Bytes a KV block of block_size tokens adds on each GPU for the indexer's cached pool keys (k-pools: PB
 * f32 keys of ID values per block and indexer layer; 0 without k-pools). */
size_t cuda_mla_pool_block_bytes(const struct model_config *c, int block_size);
/* With the KV blocks (cuda_rank_kv_alloc): rank k's pool-key arrays for n_blocks + 1 blocks (the pad
 * block's too), replacing earlier ones. 0 or SL_ENOMEM. */
int cuda_mla_kv_alloc(struct rank *k, int n_blocks, int block_size, char *err, size_t errlen);

/* ---- kernels (mla_kern.cu: mla.o is mla.c's object) ---- */

/* out[t][i] = bf16(w[i] * x[t][i] / rms(x[t])) for n values, rows at strides xs and os. */
cudaError_t cuda_mla_rmsnorm(const float *x, int xs, const float *w, int n, float eps, int T, uint16_t *out, int os,
                             cudaStream_t st);

struct cuda_mla_kv_args {
    float *q;                    /* [T][H][Dn + R] f32: its rope parts rotated in place */
    uint16_t *qn;                /* [T][H][Dn] bf16: q_nope out */
    const float *kva;            /* [T][C + R] f32 (kv_a's output) */
    const float *kv_norm;        /* [C] */
    const float *cos, *sin;      /* [max_ctx][R/2] (NULL when R == 0) */
    const int32_t *pos;          /* [T] */
    const int64_t *slots;        /* [T] */
    void *cache;                 /* the layer's [slots][W], bf16 or e4m3 bytes */
    int T, H, Dn, R, C, W;       /* W: values of an entry (C + R, + ID with the indexer) */
    float eps;
    bool interleave, kv8;
};
/* Per token: the latent normed and the rope key rotated into the cache
 * entry at its slot, the query's rope parts rotated, q_nope rounded to qn. */
cudaError_t cuda_mla_kv_write(const struct cuda_mla_kv_args *a, cudaStream_t st);

struct cuda_mla_attn_args {
    const float *qlat;           /* [T][H][C] */
    const float *q;              /* [T][H][Dn + R]: the rope parts read */
    const void *cache;           /* the layer's [slots][W] */
    const int32_t *pos;          /* [T] */
    const int32_t *tok_bt;       /* [T] where token t's block table starts in bt */
    const int32_t *bt;
    const int32_t *sel, *nsel;   /* the indexer's choice ([T][K], [T]: -1 every key), or NULL: keys 0..pos */
    uint16_t *olat;              /* [T][H][C] out */
    float *part;                 /* cuda_mla_attn_part_bytes of scratch for split keys, or NULL: no splits */
    int T, H, Dn, R, C, W, K, block_size; /* K: sel's row stride */
    int key0;                    /* without sel: keys key0..pos (1 in the MTP layer, which has no entry at 0) */
    float scale;
    bool kv8;
};
/* Keys key0..pos[t] of the token's sequence (or the indexer's choice), online
 * softmax in f32: one block per (token, group of up to 16 heads, split of
 * the keys), every head of the group scoring each latent tile loaded once;
 * the splits (their count from T and the shape only: graph-safe for any
 * context) merged by a second kernel. */
cudaError_t cuda_mla_attention(const struct cuda_mla_attn_args *a, cudaStream_t st);
/* The same attention on the tensor cores, for prefill chunks
 * (mla_prefill.cu; cuda_mla_mixer takes it from cuda_tuning's
 * mla_prefill_min_t tokens a step): the query rows of a block are (token,
 * head) pairs, 64 of them (32 where the GPU has under ~190 KB of shared
 * memory a block, sm_89), which read the same keys; per tile of 32 keys S =
 * Q K^T and O += P V on mma.sync (bf16 in, f32 accumulators; queries and P
 * rounded to bf16, fp8 entries widened to bf16 in shared memory), the
 * softmax online in f32, the 512 output columns split over two warps of a
 * row group. Tokens of several sequences in one block each attend only
 * their own keys (the block walks each sequence's keys in turn); with the
 * indexer's choice (sel, nsel) each token attends exactly its chosen keys
 * (the block walks each token's in turn). a.part is not used. Only the
 * shapes cuda_mla_prefill_ok takes; cudaErrorInvalidValue for others. */
cudaError_t cuda_mla_prefill(const struct cuda_mla_attn_args *a, cudaStream_t st);
/* Whether cuda_mla_prefill takes a's shape on the current device: C 512,
 * R a multiple of 16 up to 64, W a multiple of 16, the cache 16-byte
 * aligned, shared memory enough, keys from 0 (key0 0: the MTP layer
 * takes the SIMT kernel). */
bool cuda_mla_prefill_ok(const struct cuda_mla_attn_args *a);
/* Bytes of part cuda_mla_attention needs for any step of up to max_tokens
 * tokens with H heads (0: no step splits its keys). */
size_t cuda_mla_attn_part_bytes(int max_tokens, int H, int C, int R);
struct cuda_mla_ix_args {
    float *q;                    /* [T][IH][ID] f32: rope on the first R dims of each head, in place */
    const float *k;              /* [T][ID] f32: wk's output */
    const float *g;              /* [T][ID] f32: k-pools' gate scores, into the entry after the key; else NULL */
    const float *ape;            /* [KP][ID] k-pools' position bias */
    float *w;                    /* [T][IH] f32: weights_proj's output, scaled by IH^-1/2 in place */
    const float *kn, *kb;        /* [ID] LayerNorm weight and bias */
    const float *cos, *sin;      /* [max_ctx][R/2] */
    const int32_t *pos, *tok_bt, *bt;
    const int64_t *slots;
    void *cache;                 /* the layer's [slots][W]: the key at C + R */
    float *scores;               /* [T][max_ctx] scratch */
    int32_t *sel, *nsel;         /* [T][KS], [T] out */
    int T, IH, ID, R, C, W, K, KS, max_ctx, block_size;
    int KP, want;                /* k-pools (glm5_next): pool size, pools chosen (index_topk / KP); KP 0: keys */
    bool tail, kv8;              /* tail: the query's own incomplete pool joins its choice */
    /* k-pools: the layer's pool keys, f32 [blocks][PB][ID], PB = ceil(block_size / KP): pool j's at its
     * last token's block b and offset o, index b PB + o / KP. A pool's key depends only on its tokens'
     * entries, so it is computed once, in the step that writes its last token (after every key of the
     * step is in the cache), and stays valid while those entries do (a block shared by prefix caching
     * holds the same tokens; a rewritten pool is rewritten up to its last token, which recomputes it) */
    float *pk;
    int PB;
};
/* The DSA indexer (GlmMoeDsaIndexer as cpu_mla.c computes it): each token's
 * key LayerNormed and rotated into its entry; then per query the score of
 * key j <= pos, sum_h w_h relu(q_h . k_j / sqrt(ID)), and the K best keys
 * (ties to the earlier position) in ascending order, or nsel -1 where pos
 * + 1 <= K. With k-pools (KP > 0, Glm5NextTextIndexer) the scored keys are
 * the whole pools ending at or before pos (a pool's key per channel the
 * softmax over its tokens of gate + ape weighing their keys; computed into
 * pk by the step that completes the pool), the want best pools' tokens
 * chosen, then (tail) the query's own incomplete pool. The scores run on a
 * grid of (key splits, tokens), the splits from T alone (graph-safe for any
 * context); the choice by a radix select, one block per token. */
cudaError_t cuda_mla_indexer(const struct cuda_mla_ix_args *a, cudaStream_t st);
/* Whether cuda_mla_indexer takes IH heads of ID dims (its score kernel's shared memory). */
bool cuda_mla_indexer_fits(int IH, int ID);

/* The attention's latent width at most (a thread keeps 2 values of every
 * head of its group; C even). */
#define CUDA_MLA_MAX_C 512

#ifdef __cplusplus
}
#endif

#endif
