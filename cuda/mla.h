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
 * then the absorbed form for every query token (decode and prefill chunks,
 * causal within the step): q_lat_h = W_K,h^T q_nope_h (one strided-batched
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

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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
    /* k-pools: each indexer layer's pool keys, f32 [n_blocks + 1][PB][ID] (cuda_mla_ix_args' pk), allocated
     * with the KV blocks (cuda_mla_kv_alloc) and counted in their bytes (cuda_mla_pool_block_bytes) */
    float *ixpool;
    size_t ixpool_n;             /* floats of one layer's array */
};

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
