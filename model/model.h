/* model.h - what a model is: its configuration, its weights, its tokenizer,
 * its chat prompt, and the sampler.
 *
 * model_load() reads a GGUF file or a Hugging Face checkpoint directory
 * (config.json + safetensors + tokenizer.json) into a `model`. Weights are
 * *views* (struct model_tensor) borrowed from the mmapped files: a backend
 * (model/backend.h) turns them into whatever it computes with. A loaded model
 * is immutable, so any thread may read it; the tokenizer is also read-only
 * after load and thread-safe. The detokenizer and sampler state are per
 * request and owned by the caller.
 *
 * This is the public header of the model module: other modules include this
 * and model/backend.h only.
 */
#ifndef SLUICE_MODEL_H
#define SLUICE_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/base.h"

/* ---- tensors --------------------------------------------------------------- */

enum model_dtype {
    MODEL_DT_F32, MODEL_DT_F16, MODEL_DT_BF16, MODEL_DT_Q8_0, MODEL_DT_Q4_0, MODEL_DT_Q4_1,
    MODEL_DT_QPACK, /* int4/int8 with group scales: the layout is in model_tensor.quant */
    MODEL_DT_I8, MODEL_DT_I32, MODEL_DT_I64, /* integer parts of packed weights (never a weight itself) */
};

/* Where a packed (MODEL_DT_QPACK) weight's values come from. */
enum model_qlayout {
    MODEL_QL_CT,   /* compressed-tensors pack-quantized: weight_packed [out][in*bits/32] int32, low bits
                      first, stored q + 2^(bits-1); weight_scale [out][groups]; weight_zero_point
                      [out*bits/32][groups] packed along the output; weight_g_idx [in] */
    MODEL_QL_CT_INT, /* compressed-tensors int-quantized (int8): weight int8 [out][in] holding q itself;
                      weight_scale [out][groups]; weight_zero_point int8 [out][groups] */
    MODEL_QL_AWQ,  /* AutoAWQ GEMM: qweight [in][out/8] with nibble order 0,2,4,6,1,3,5,7; qzeros
                      [groups][out/8] the same; scales [groups][out] */
    MODEL_QL_GPTQ, /* GPTQ: qweight [in*bits/32][out] packed along the input; qzeros
                      [groups][out*bits/32]; scales [groups][out]; g_idx [in] */
};

/* A packed weight matrix [out][in]: w[o][i] = (q - zero) * scale, where the
 * group of column i is g_idx[i] (act-order) or i / group. The product is
 * rounded to the scale's dtype, as the reference dequantizers compute it in
 * that dtype. Pointers are borrowed from the mapping (unaligned: read with
 * memcpy); owned by the model. */
struct model_quant {
    enum model_qlayout layout;
    int64_t rows, cols;         /* out, in */
    int bits;                   /* 4 or 8 */
    int group;                  /* columns per group; == in for per-channel */
    int64_t n_groups;
    bool sym;                   /* no zero point stored: the zero is 2^(bits-1) in stored (unsigned) form */
    bool act_order;             /* g_idx is not simply column / group */
    int zero_add;               /* added to stored zeros: 1 for GPTQ v1 (stores zero - 1), else 0 */
    enum model_dtype scale_dt;  /* F16, BF16 or F32 */
    const void *qweight, *scales, *zeros; /* zeros NULL when sym */
    const void *g_idx;          /* int32 [in], or NULL */
};

/* "int4 g32 sym", "int8 channel", "int4 g128 asym act-order (gptq v1)"... */
void model_quant_describe(const struct model_quant *q, char *out, size_t cap);

/* A borrowed view of one weight tensor. A matrix is stored row-major with
 * ne[0] the contiguous dimension: a linear layer y = W x has ne[0] = in,
 * ne[1] = out (the GGUF and HF safetensors layouts agree on this). */
struct model_tensor {
    const char *name;     /* borrowed; NUL-terminated */
    enum model_dtype dtype;
    int ndim;
    int64_t ne[4];        /* unused dims are 1 */
    const void *data;     /* NULL when the tensor is absent; borrowed from the mapping */
    size_t nbytes;
    const struct model_quant *quant; /* MODEL_DT_QPACK only: the layout (data is its qweight) */
};

/* Dequantizes/converts `n` elements starting at element `first` (which must
 * be block aligned for quantized types, row aligned for MODEL_DT_QPACK) into
 * out[]. Exact for every dtype: the values are what the format defines. */
void model_tensor_to_f32(const struct model_tensor *t, int64_t first, int64_t n, float *out);
int64_t model_tensor_nelem(const struct model_tensor *t);
const char *model_dtype_name(enum model_dtype dt);

/* A block of a packed weight rearranged into the one layout the GPU
 * kernels read, whatever the checkpoint's: per output row, the codes along
 * the input dimension, unsigned (int8: byte k; int4: 32-bit little-endian
 * word k/8 holds columns 8(k/8) .. +7, column 8w + 2i + h in nibble i + 4h,
 * so that one mask of a word shifted by 4i yields the adjacent columns 2i,
 * 2i + 1 as the two halves of a 32-bit register), the row padded with zero
 * codes to a multiple of 16 bytes; scales [rows][n_groups] in their own dtype (f16 or
 * bf16, raw bits); zero codes [rows][n_groups] (NULL when every zero is
 * 2^(bits-1)); for act-order the columns are sorted by group, so that each
 * group's columns are consecutive, and perm[k] says which column of the
 * block sits at position k (the kernels gather the activations through it).
 * w[r][perm[k]] = (code - zero) * scale, rounded to the scale's dtype,
 * equals quant_deq_row's value exactly. Malloc'd arrays; model_qrepack_free. */
struct model_qrepack {
    int bits;
    int64_t rows, cols;         /* the block's */
    int group, n_groups;        /* group >= cols when n_groups == 1 */
    int64_t row_bytes;          /* (cols * bits / 8) rounded up to 16 */
    bool f16;                   /* scales are f16 (else bf16) */
    uint8_t *qw;                /* [rows][row_bytes] */
    uint16_t *scales;           /* [rows][n_groups] */
    uint8_t *zeros;             /* [rows][n_groups] or NULL */
    int32_t *perm;              /* [cols] or NULL */
};
/* Rows [r0, r0 + nr) x columns [c0, c0 + nc) of t (MODEL_DT_QPACK) into
 * *out. Returns 0; SL_EINVAL when the column range cuts a quantization group
 * (a tensor-parallel shard that does not align: the message names the
 * tensor, the group size and the range); SL_EUNSUP when the layout cannot
 * hold the weight exactly (f32 scales, a zero code outside 0..255, groups not
 * a multiple of 8 columns, act-order groups of uneven size): the caller may
 * dequantize instead. */
int model_quant_repack(const struct model_tensor *t, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                       struct model_qrepack *out, char *err, size_t errlen);
void model_qrepack_free(struct model_qrepack *p);
/* Row r of a repacked block as f32, each weight at its column of the
 * block (dst[cols], as quant_deq_row places them): the reference the GPU
 * kernels are checked against. */
void model_qrepack_row(const struct model_qrepack *p, int64_t r, float *dst);

/* ---- configuration --------------------------------------------------------- */

enum model_arch {
    MODEL_ARCH_LLAMA, MODEL_ARCH_QWEN2, MODEL_ARCH_QWEN3, MODEL_ARCH_MISTRAL,
    MODEL_ARCH_DEEPSEEK_V3, MODEL_ARCH_GLM_MOE_DSA, /* MLA layers (struct model_mla_config) */
    MODEL_ARCH_QWEN3_MOE, MODEL_ARCH_GLM4_MOE, MODEL_ARCH_QWEN2_MOE,
    MODEL_ARCH_GLM5_NEXT, /* GLM-5.3-Flash: KDA + MLA layers, hyper-connections (model/glm5.c) */
};

enum model_rope {
    MODEL_ROPE_NORM, /* rotate adjacent pairs (x[2i], x[2i+1]): GGUF llama, whose Q/K rows are stored permuted */
    MODEL_ROPE_NEOX, /* rotate halves (x[i], x[i + d/2]): HF checkpoints, qwen2/qwen3 in GGUF */
};

/* Multi-head latent attention (deepseek_v3, glm_moe_dsa; model/mla.c). Per
 * token a layer keeps one normalised latent (kv_lora_rank) and one shared
 * rope key (qk_rope_head_dim), no heads and no V: kv_b_proj expands the
 * latent into per-head K (qk_nope_head_dim) and V (v_head_dim). The model's
 * head_dim is qk_nope + qk_rope (a query head), rope_dim qk_rope_head_dim
 * (0: no RoPE, GLM-5.3's case). */
struct model_mla_config {
    int kv_lora_rank;           /* 0: the model has no MLA layers */
    int q_lora_rank;            /* 0: q_proj straight from the hidden state */
    int qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    bool rope_interleave;       /* rotate adjacent pairs (DeepSeek's layout), else halves */
    float softmax_scale;        /* (nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN */
    float rope_attn_factor;     /* YaRN attention_factor, multiplying cos and sin; 1 without YaRN */
    float latent_norm_eps;      /* q_a_layernorm, kv_a_layernorm: their default 1e-6, not rms_norm_eps */
    /* YaRN rope scaling (rope_type "yarn"), applied by model_rope_inv_freq; factor 0 = off */
    float yarn_factor, yarn_beta_fast, yarn_beta_slow;
    int yarn_orig_ctx;
    bool yarn_truncate;
    int n_dense_layers;         /* leading layers with a dense FFN; the rest are the MoE kind's */
    int n_mtp_layers;           /* glm5_next's num_nextn_predict_layers, stored after the last layer: loaded
                                   and counted, not run (its drafts are not wired); 0 = none/off. The other
                                   MTP models' layers are model_config.n_mtp_layer, in the plan */
    /* DSA indexer (glm_moe_dsa): each query attends to its index_topk best-scored keys */
    int index_topk;             /* 0: off (index_topk null): dense MLA, the indexer's tensors skipped */
    int index_n_heads, index_head_dim;
    const uint8_t *index_full;  /* [n_layer]: 1 runs its own indexer, 0 reuses the previous full layer's
                                   choice (indexer_types "shared"); owned by the model */
    /* glm5_next's indexer scores pools of index_kpool consecutive keys (each pool's key a softmax-weighted
     * mean of its tokens' keys), picks index_topk / index_kpool pools and, with index_kpool_tail, the
     * query's own incomplete pool; 0: every key scored alone (glm_moe_dsa) */
    int index_kpool;
    bool index_kpool_tail;
};

/* Manifold-constrained hyper-connections (mHC, glm5_next): the residual is
 * `mult` streams per token; before each block a site collapses them (sigmoid
 * pre weights), after it writes the block's output back (2 sigmoid post
 * weights) mixed with the streams through a Sinkhorn-normalised softmax comb
 * (transformers' Glm5NextTextHyperConnection); the head takes their mean. */
struct model_hc_config {
    int mult;                   /* hc_mult streams; 0: a plain residual */
    int sinkhorn_iters;         /* hc_sinkhorn_iters */
    float eps;                  /* hc_eps */
};

/* How an MoE layer routes a token (model/moe.c; the reference is transformers'
 * Qwen3MoeTopKRouter and Glm4MoeTopkRouter / DeepseekV3TopkRouter). */
enum model_router {
    MODEL_ROUTER_SOFTMAX, /* softmax over all experts, the top-k probabilities (qwen3_moe) */
    MODEL_ROUTER_SIGMOID, /* sigmoid scores; experts chosen by score + correction bias inside the
                             topk_group best groups (a group's score: its two best), weighed by the
                             score alone (glm4_moe, deepseek_v3) */
};

struct model_moe_config {
    int n_expert;          /* routed experts (num_experts / n_routed_experts); 0: no MoE layer */
    int n_expert_used;     /* experts per token, top-k (num_experts_per_tok) */
    int n_ff_expert;       /* each routed expert's intermediate size (moe_intermediate_size) */
    int n_ff_shared;       /* the shared experts' intermediate size, all of them as one MLP
                              (n_shared_experts * moe_intermediate_size, or
                              shared_expert_intermediate_size); 0: none */
    bool shared_gated;     /* the shared output is weighed by sigmoid(x . shared_expert_gate) (qwen2_moe) */
    enum model_router router;
    bool norm_topk;        /* the chosen weights renormalised to sum 1 (norm_topk_prob) */
    float scale;           /* routed_scaling_factor: the routed sum is weighed by it (1 for softmax) */
    int n_group, topk_group; /* group-limited choice (1, 1: off) */
    float swiglu_limit;    /* every SwiGLU of the model clamps gate <= limit, |up| <= limit; 0: off */
};

/* Kimi delta attention, KDA (glm5_next's linear_attention layers; model/kda.c,
 * the CPU step model/cpu_kda.c; the reference is transformers'
 * Glm5NextTextLinearAttention). Per token: q, k, v projections through a short
 * causal depthwise convolution over q|k|v with SiLU, q and k L2-normalised
 * per head; a per-channel forget gate from f_b(f_a(x)) + dt_bias and A_log;
 * beta = sigmoid(b(x)); the delta rule on a head_dim x head_dim state per
 * head; the output RMS-normed per head and gated by sigmoid(g_b(g_a(x))).
 * Nothing is kept per token: a sequence keeps a fixed-size state per layer
 * (model_state_layer_elems) in a state slot. */
struct model_kda_config {
    int n_head;            /* linear_num_heads; 0: the model has no KDA layers */
    int head_dim;          /* linear_head_dim (keys and values alike) */
    int conv_kernel;       /* linear_conv_kernel_dim: taps of the causal conv (>= 1) */
    bool has_lower_bound;  /* linear_lower_bound not null: the log-decay is lower_bound * sigmoid(exp(A_log) g);
                              else -exp(A_log) softplus(g) */
    float lower_bound;
};

struct model_config {
    enum model_arch arch;
    int n_layer, n_embd, n_ff;
    int n_head, n_head_kv, head_dim;
    int n_vocab;
    int n_ctx_train;            /* max_position_embeddings / context_length */
    float norm_eps;
    float rope_theta;
    enum model_rope rope_type;
    int rope_dim;               /* rotated dims per head (== head_dim for these archs) */
    /* llama3 rope scaling (rope_scaling.rope_type == "llama3"); factor 0 = off */
    float rope_llama3_factor, rope_llama3_low_freq, rope_llama3_high_freq;
    int rope_llama3_orig_ctx;
    bool tie_embeddings;        /* lm_head is tok_embd */
    bool qkv_bias;              /* qwen2 */
    bool qk_norm;               /* qwen3: RMSNorm over head_dim of q and k before RoPE */
    struct model_moe_config moe; /* MODEL_FFN_MOE layers (n_expert 0 when the model has none) */
    /* The plan of layers: each layer's kinds, [n_layer], owned by the model.
     * NULL (configs built by hand) means every layer is GQA + dense. */
    const struct model_layer_kind *layer_kind;
    struct model_mla_config mla; /* MODEL_MIXER_MLA layers; zero otherwise */
    /* MTP modules (num_nextn_predict_layers, glm4_moe and deepseek_v3 checkpoints): stored after the
     * decoder layers, they are layers n_layer .. n_layer + n_mtp_layer - 1 of the plan (layer_kind) and of
     * model_weights.layers, with their own parts in model_weights.mtp. 0: none, or switched off
     * (--hf-overrides '{"num_nextn_predict_layers": 0}': nothing of them is loaded). */
    int n_mtp_layer;
    struct model_kda_config kda; /* MODEL_MIXER_KDA layers; zero otherwise */
    struct model_hc_config hc;   /* MODEL_RESID_HC layers; zero otherwise */
};

/* The decoder layers and the MTP layers after them: the length of the plan
 * (layer_kind) and of model_weights.layers. */
static inline int model_n_layer_all(const struct model_config *c) { return c->n_layer + c->n_mtp_layer; }

/* A model is a plan of layers (docs/DESIGN.md, "Beyond dense Llama"): each
 * layer's token mixer and FFN, decided by the loader from the config. A
 * backend implements each kind's step and refuses at creation, naming the
 * layer, a kind it lacks; a new kind is a new enum value and a new file, not
 * an architecture test in every function. */
enum model_mixer {
    MODEL_MIXER_GQA, /* grouped-query attention: K and V per KV head in the paged pool */
    MODEL_MIXER_MLA, /* multi-head latent attention: one latent + rope key per token (model_mla_config) */
    MODEL_MIXER_KDA, /* KDA linear attention: nothing per token, a recurrent state per sequence (model_kda_config) */
};
enum model_ffn {
    MODEL_FFN_DENSE, /* down(silu(gate(x)) * up(x)) */
    MODEL_FFN_MOE,   /* routed experts (+ shared experts): model/moe.c, config in model_config.moe */
};
enum model_resid {
    MODEL_RESID_PLAIN, /* x += block(norm(x)) */
    MODEL_RESID_HC,    /* hyper-connection streams around each block (model_hc_config) */
};
struct model_layer_kind {
    enum model_mixer mixer;
    enum model_ffn ffn;
    enum model_resid resid;
};
static inline struct model_layer_kind model_layer_kind_of(const struct model_config *c, int layer)
{
    if (c->layer_kind) return c->layer_kind[layer];
    return (struct model_layer_kind){MODEL_MIXER_GQA, MODEL_FFN_DENSE, MODEL_RESID_PLAIN};
}
const char *model_mixer_name(enum model_mixer k);
/* Values one token keeps in layer l's paged KV entry: GQA 2 n_kv_heads
 * head_dim (K and V), MLA kv_lora_rank + qk_rope_head_dim (+ index_head_dim
 * where the layer runs a DSA indexer). A backend's bytes per token are the
 * sum over layers times its element size, so the pool sizing follows the
 * plan of layers. l may be an MTP layer (n_layer <= l < model_n_layer_all). */
int64_t model_kv_token_elems(const struct model_config *c, int layer);
/* f32 values one sequence keeps in layer l's recurrent state: KDA n_head
 * head_dim^2 (a state matrix per head) + (conv_kernel - 1) 3 n_head head_dim
 * (the conv's last inputs); 0 for a layer without one. */
int64_t model_state_layer_elems(const struct model_config *c, int layer);
/* Bytes of one sequence's recurrent state over every layer (f32): the size
 * of a state slot; 0 when the model has no recurrent layer. */
size_t model_state_bytes(const struct model_config *c);
/* Bytes of one token's recurrence inputs over every KDA layer (f32: the
 * conv's q|k|v inputs, the forget gate, beta: 4 n_head head_dim + n_head a
 * layer): what the GPU backend keeps per draft token to replay the accepted
 * ones (cuda/kda.h); 0 without recurrent layers. */
size_t model_state_replay_bytes(const struct model_config *c);
const char *model_ffn_name(enum model_ffn k);
/* The plan in words, runs of equal layers folded: "0: gqa + dense; 1-3: gqa +
 * moe 16 experts top-4 (+1 shared)". Returns the length needed (NUL written
 * when it fits). */
size_t model_plan_describe(const struct model_config *c, char *out, size_t cap);

/* One MoE layer's weights. Every expert matrix is a 2-D view, whether the file
 * stores one tensor per expert or a fused 3-D one (then a slice of it); each
 * decides its own format (a quantized expert is a MODEL_DT_QPACK tensor). */
struct model_moe_weights {
    struct model_tensor router;        /* [n_expert][n_embd] (mlp.gate) */
    struct model_tensor router_bias;   /* [n_expert] e_score_correction_bias; data NULL when absent */
    struct model_tensor *gate, *up, *down; /* [n_expert] each: [F][n_embd] x2, [n_embd][F]; owned by
                                              the model */
    struct model_tensor sh_gate, sh_up, sh_down; /* the shared experts as one MLP, n_ff_shared wide;
                                                    data NULL without */
    struct model_tensor sh_weigh;      /* shared_gated: [1][n_embd] (mlp.shared_expert_gate) */
};

/* An MLA layer's attention weights (rows x cols as [out][in]); H = n_head,
 * Dq = nope + rope. */
struct model_mla_weights {
    struct model_tensor q_a, q_a_norm, q_b;  /* [q_lora][E], [q_lora], [H*Dq][q_lora] (q_lora_rank > 0) */
    struct model_tensor q;                    /* [H*Dq][E] (q_lora_rank == 0) */
    struct model_tensor kv_a, kv_a_norm;      /* [kv_lora + rope][E], [kv_lora] */
    struct model_tensor kv_b;                 /* [H*(nope + v)][kv_lora]: per head nope K rows, then v V rows */
    struct model_tensor o;                    /* [E][H*v] */
    /* DSA indexer (index_topk > 0 and the layer runs its own) */
    struct model_tensor ix_wq_b;              /* [ixH*ixD][q_lora] */
    struct model_tensor ix_wk;                /* [ixD][E] */
    struct model_tensor ix_k_norm, ix_k_norm_b; /* LayerNorm [ixD] weight and bias */
    struct model_tensor ix_weights;           /* [ixH][E] */
    struct model_tensor ix_kpool_ape, ix_kpool_gate; /* index_kpool > 0: [kpool][ixD], [ixD][E] */
};

/* One hyper-connection site (mHC): fn [(2 + hc) hc][hc E], base [(2 + hc) hc], scale [3]. */
struct model_hc_weights {
    struct model_tensor fn, base, scale;
};

/* A KDA layer's weights (rows x cols as [out][in]); C = n_head head_dim,
 * D = head_dim, H = n_head, K = conv_kernel. Each matrix decides its own
 * format (dense or packed). */
struct model_kda_weights {
    struct model_tensor q, k, v;              /* [C][E] each */
    struct model_tensor conv[3];              /* the q, k, v parts of the depthwise conv, [C][K] each: the
                                                 file's q/k/v_conv1d [C][1][K], or thirds of a fused
                                                 conv1d [3C][1][K] */
    struct model_tensor f_a, f_b;             /* [D][E], [C][D]: the forget gate */
    struct model_tensor dt_bias;              /* [C] */
    struct model_tensor A_log;                /* [H] */
    struct model_tensor b;                    /* [H][E]: beta */
    struct model_tensor g_a, g_b;             /* [D][E], [C][D]: the output gate */
    struct model_tensor o_norm;               /* [D], shared by every head */
    struct model_tensor o;                    /* [E][C] */
};

struct model_layer_weights {
    struct model_tensor attn_norm;            /* [n_embd] */
    struct model_tensor wq, wk, wv, wo;       /* [n_head*hd][n_embd], [n_kv*hd][n_embd] x2, [n_embd][n_head*hd] */
    struct model_tensor bq, bk, bv;           /* qkv_bias only */
    struct model_tensor q_norm, k_norm;       /* qk_norm only: [head_dim] */
    struct model_tensor ffn_norm;             /* [n_embd] */
    struct model_tensor w_gate, w_up, w_down; /* [n_ff][n_embd] x2, [n_embd][n_ff] */
    struct model_mla_weights mla;             /* MODEL_MIXER_MLA layers (wq..bv unused there) */
    struct model_kda_weights kda;             /* MODEL_MIXER_KDA layers (wq..bv unused there) */
    struct model_moe_weights moe;             /* MODEL_FFN_MOE layers only (then no w_gate/up/down) */
    struct model_hc_weights hc_attn, hc_ffn;  /* MODEL_RESID_HC layers: the sites before the mixer and the FFN */
};

/* One MTP module's own parts (transformers' MtpLayer): for the token t at
 * position q and the main model's final-normed hidden state h of q - 1,
 *   x = eh_proj([enorm(embed(t)) | hnorm(h)]),  x = its decoder layer (x)
 *   g = head_norm(x): lm_head(g) predicts the token at q + 1, and a chained
 *       draft takes g as the next h.
 * Its decoder layer is model_weights.layers[n_layer + i] (the model's mixer;
 * MoE where the model has experts, as transformers' get_mtp_config sets
 * first_k_dense_replace 0). The checkpoint's copies of the embedding and the
 * head under the module (embed_tokens, shared_head.head) are not read:
 * transformers ties both to the main model's. */
struct model_mtp_weights {
    struct model_tensor enorm, hnorm;         /* [n_embd] */
    struct model_tensor eh_proj;              /* [n_embd][2 n_embd]: the embedding's half first */
    struct model_tensor head_norm;            /* [n_embd] shared_head.norm */
};

struct model_weights {
    struct model_tensor tok_embd;             /* [n_vocab][n_embd] */
    struct model_tensor out_norm;             /* [n_embd] */
    struct model_tensor lm_head;              /* [n_vocab][n_embd]; == tok_embd when tied */
    struct model_layer_weights *layers;       /* [model_n_layer_all]: decoder layers, then MTP layers */
    struct model_tensor rope_freqs;           /* optional [rope_dim/2]: per-frequency divisors of
                                                 the RoPE inverse frequencies (GGUF llama3
                                                 rope_freqs.weight); data NULL when absent */
    struct model_mtp_weights *mtp;            /* [n_mtp_layer], owned by the model; NULL without */
    int mtp_tensors;                          /* tensors under the MTP layers' prefixes in the file */
    size_t mtp_bytes;                         /* their bytes */
};

/* ---- tokenizer ------------------------------------------------------------- */

typedef struct model_tok model_tok;

enum model_tok_attr {
    MODEL_TOK_NORMAL = 1, MODEL_TOK_UNKNOWN = 2, MODEL_TOK_CONTROL = 3,
    MODEL_TOK_USER_DEFINED = 4, MODEL_TOK_UNUSED = 5, MODEL_TOK_BYTE = 6,
};

/* Encodes len bytes of text. add_bos: prepend BOS when the model's metadata
 * says so (tokenizer.ggml.add_bos_token / tokenizer_config add_bos_token).
 * parse_special: split out special/added tokens written literally in text.
 * Writes at most cap ids; returns the total number of ids (which may exceed
 * cap: call again with a bigger buffer), or a negative sl_status. */
int model_tok_encode(const model_tok *t, const char *text, size_t len, bool add_bos,
                     bool parse_special, int32_t *ids, int cap);

/* Decodes ids to bytes (byte-level BPE pieces mapped back to raw bytes).
 * skip_special: drop control tokens. Writes at most cap bytes (no NUL added);
 * returns the total byte count (may exceed cap) or a negative sl_status. */
long model_tok_decode(const model_tok *t, const int32_t *ids, int n, bool skip_special, char *out,
                      size_t cap);

int model_tok_n_vocab(const model_tok *t);
/* The most bytes of text one token stands for: a text of len bytes encodes
 * to at least len / model_tok_max_bytes() tokens (no normalizer here
 * shortens text), a bound known before tokenizing. */
int model_tok_max_bytes(const model_tok *t);
int32_t model_tok_bos(const model_tok *t);       /* -1 if none */
int32_t model_tok_eos(const model_tok *t);       /* -1 if none */
/* Token ids that end generation: eos plus eot/eom and generation_config eos ids. */
int model_tok_stop_ids(const model_tok *t, const int32_t **ids);
enum model_tok_attr model_tok_attr(const model_tok *t, int32_t id);
/* The raw bytes a token decodes to (borrowed; not NUL-terminated). */
const char *model_tok_bytes(const model_tok *t, int32_t id, size_t *len);
/* Exact-match lookup of a token's text form (as in the vocab), -1 if absent. */
int32_t model_tok_find(const model_tok *t, const char *text, size_t len);

/* Incremental detokenizer: feed ids one at a time; each call returns the bytes
 * that are now complete UTF-8 (never a partial sequence). Invalid sequences
 * are emitted as U+FFFD once known to be invalid. Embedded in the caller. */
struct model_detok {
    const model_tok *tok;
    bool skip_special;
    unsigned char pending[8]; /* bytes of an incomplete UTF-8 sequence */
    int n_pending;
};
void model_detok_init(struct model_detok *d, const model_tok *tok, bool skip_special);
/* Appends the newly complete text to out (at most cap bytes; a token decodes
 * to well under 256 bytes). Returns the number of bytes written. */
size_t model_detok_push(struct model_detok *d, int32_t id, char *out, size_t cap);
/* Emits what is left (an incomplete tail becomes U+FFFD). */
size_t model_detok_flush(struct model_detok *d, char *out, size_t cap);

/* ---- the model --------------------------------------------------------------- */

typedef struct model model;

struct model_load_opts {
    bool progress;            /* print tensors/bytes loaded on stderr */
    const char *tokenizer;    /* NULL: the model's own; else a GGUF file or HF dir */
    const char *load_format;  /* NULL or "auto": weights from the checkpoint; "dummy": random bf16
                                 weights from an HF directory's config.json alone (benchmarks;
                                 model/loader_dummy.c) */
    const char *hf_overrides; /* NULL, or a JSON object applied to the config (vLLM's
                                 --hf-overrides; model/overrides.h says which keys apply) */
    bool check_weights;       /* read every weight once and refuse a non-finite one
                                 (model_check_weights; --check-weights) */
};

/* Loads a GGUF file or an HF checkpoint directory. Returns NULL with a
 * message in err on failure (a missing tensor, an unsupported architecture or
 * dtype, a config value of the wrong type or out of range are named; a
 * tokenizer with more tokens than the model's vocabulary is refused with
 * both sizes). The model owns its mappings, config and tokenizer. */
model *model_load(const char *path, const struct model_load_opts *opts, char *err, size_t errlen);
void model_free(model *m);
/* Reads every weight (dequantized) and returns SL_EFORMAT with a message
 * naming the first tensor that holds a NaN or an infinity (and where), or 0.
 * Costs one pass over the weights' bytes (OpenMP threads); thread-safe. */
int model_check_weights(const model *m, char *err, size_t errlen);

const struct model_config *model_get_config(const model *m);
/* One line per family of weight matrices and its format, layer numbers as
 * '*' ("layers.*.mlp.*: int4 g32 sym", "lm_head: bf16"); a family whose
 * layers differ is listed per layer. Writes at most cap bytes (NUL when it
 * fits); returns the length needed. */
size_t model_weight_formats(const model *m, char *out, size_t cap);
/* The first packed (MODEL_DT_QPACK) weight, or NULL: for backends that
 * cannot run them yet. */
const struct model_tensor *model_first_packed(const model *m);
const struct model_weights *model_get_weights(const model *m);
/* Bytes of every weight the model holds (MTP modules included), as
 * stored: what the weights take in memory. */
size_t model_weight_bytes(const model *m);
const model_tok *model_get_tok(const model *m);
/* The chat template text from the checkpoint, or NULL. Borrowed. */
const char *model_chat_template(const model *m);
const char *model_arch_name(enum model_arch a);
/* What one (query, key) pair of attention costs, in tokens of the layer's
 * projections (GEMM multiply-adds): 2 n_head head_dim / (per-token weights of
 * Q|K|V, O and the MLP). Llama-3.1-8B: 3.8e-5, so a token attending to 100K
 * keys costs 4.8 tokens. The scheduler weighs prefill chunks by it. */
double model_attn_pair_cost(const struct model_config *c);
/* RoPE inverse frequencies, inv[rope_dim/2]: rope_theta, llama3 scaling and
 * GGUF rope_freqs divisors applied (w may be NULL), as transformers computes
 * them. Every backend builds its sin/cos tables from these. */
void model_rope_inv_freq(const struct model_config *c, const struct model_weights *w, double *inv);
/* Bytes one token's KV takes over all layers at elem_bytes per value (sum of
 * model_kv_token_elems): what `sluice info` prints. */
size_t model_kv_bytes_per_token(const struct model_config *c, size_t elem_bytes);
/* The decoder layers that run their own DSA indexer with k-pools (0 without
 * them): each keeps its pools' keys, which the CUDA backend caches beside the
 * KV blocks and `sluice info` counts. */
int model_kpool_indexer_layers(const struct model_config *c);
/* What the MTP layers add per token when a backend runs them (their KV
 * entries, model_kv_token_elems of layers n_layer ..), and per block (the
 * hidden state a block keeps: n_embd values and its position, an int32), at
 * elem_bytes per value; 0 without MTP layers. */
size_t model_mtp_kv_bytes_per_token(const struct model_config *c, size_t elem_bytes);
size_t model_mtp_kv_bytes_per_block(const struct model_config *c, size_t elem_bytes);

/* Renders messages as ChatML (<|im_start|>role\ncontent<|im_end|>\n ... and,
 * with add_generation_prompt, "<|im_start|>assistant\n"), the format of the
 * default model. roles/contents: n entries. Returns bytes needed (may exceed
 * cap), writes a NUL when it fits. A full Jinja engine is a later issue. */
size_t model_chatml_render(const char *const *roles, const char *const *contents, int n,
                           bool add_generation_prompt, char *out, size_t cap);

/* ---- chat templates (model/template.c, model/tmpl_parse.c) --------------------
 *
 * A Jinja engine for chat templates, rendering exactly as HF transformers
 * does (jinja2 sandbox, trim_blocks + lstrip_blocks, loop controls, tojson =
 * json.dumps(ensure_ascii=False), raise_exception, strftime_now). A parsed
 * template is immutable: any thread may render it concurrently. Templates
 * and contexts come from users: bad input is an error, never a crash, and a
 * render is bounded in memory and steps. */

typedef struct model_tmpl model_tmpl;

/* Parses template source src[0..len). Returns NULL with a message naming the
 * line and the construct in err (unsupported tags, filters and tests are
 * refused here, not at render time). */
model_tmpl *model_tmpl_create(const char *src, size_t len, char *err, size_t errlen);
void model_tmpl_destroy(model_tmpl *t); /* NULL is fine */

struct model_tmpl_opts {
    int64_t now;       /* strftime_now's instant (seconds since the epoch, shown in UTC); 0: the current local time */
    size_t max_bytes;  /* memory a render may use; 0: 1 GiB */
};

/* Renders t with the members of the JSON object ctx_json[0..ctx_len) as
 * template variables (messages, tools, add_generation_prompt, bos_token, ...;
 * a later duplicate key wins). opts may be NULL. On success returns 0 and
 * *out is a new malloc'ed NUL-terminated string (caller frees) of *out_len
 * bytes. On failure returns a negative sl_status, *out is NULL, and err holds
 * the message: the template's own raise_exception text, or "chat template
 * line N: ..." naming the construct that failed. */
int model_tmpl_render(const model_tmpl *t, const char *ctx_json, size_t ctx_len, const struct model_tmpl_opts *opts,
                      char **out, size_t *out_len, char *err, size_t errlen);

/* The ChatML template used when a model ships none (the default model's format). */
extern const char model_chatml_template[];

/* ---- sampler ---------------------------------------------------------------- */

struct model_sampling {
    float temperature;        /* 0 = greedy */
    float top_p;              /* 1 = off */
    int top_k;                /* <= 0 = off */
    float min_p;              /* 0 = off */
    float repetition_penalty; /* 1 = off; applies to prompt + generated tokens (HF/vLLM) */
    float presence_penalty;   /* 0 = off; generated tokens only (OpenAI/vLLM) */
    float frequency_penalty;  /* 0 = off; generated tokens only */
    uint64_t seed;            /* initial RNG state comes from this */
    int top_logprobs;         /* number of top alternatives to return, 0..MODEL_MAX_TOP_LOGPROBS */
    const struct model_logit_bias *logit_bias; /* [n_logit_bias] borrowed (OpenAI logit_bias), or NULL */
    int n_logit_bias;
    const uint8_t *allow;     /* [n_allow] borrowed: 0 = this id may not be sampled (JSON mode; ids >=
                                 n_allow neither), or NULL: every id may */
    int n_allow;
};
#define MODEL_MAX_TOP_LOGPROBS 20
#define MODEL_MAX_LOGIT_BIAS 1024
/* Added to token id's logit before anything else (penalties, logprobs,
 * choice): -100 bans a token in practice, +100 forces it. */
struct model_logit_bias {
    int32_t id;
    float bias;
};

void model_sampling_default(struct model_sampling *s); /* greedy, everything off */
/* Per-request RNG state; seeded once from sampling.seed. */
uint64_t model_rng_seed(uint64_t seed);
/* Advances *rng and returns a uniform in [0, 1) with 53 random bits: the one
 * draw model_sample makes when temperature > 0 and top_k != 1 (a device
 * sampler draws it on the host the same way). */
double model_rng_uniform(uint64_t *rng);

struct model_sample_out {
    int32_t token;
    float logprob;                                   /* of token, under the processed distribution
                                                        before temperature (vLLM's default) */
    int n_top;
    int rank;                                        /* model_logprob_row: token's 1-based rank by logit */
    int32_t top_ids[MODEL_MAX_TOP_LOGPROBS];
    float top_logprobs[MODEL_MAX_TOP_LOGPROBS];
};

/* Samples one token from logits[n_vocab] (modified in place: penalties,
 * temperature). history holds the prompt (n_prompt ids) followed by the
 * generated ids (n_history - n_prompt). scratch holds 2*n_vocab floats plus
 * n_vocab ints' worth of bytes (see model_sample_scratch_bytes). Advances *rng.
 * Deterministic: same logits, params, history and rng -> same token. */
size_t model_sample_scratch_bytes(int n_vocab);
/* The log-softmax of raw logits[n_vocab] at token (out->token, out->logprob)
 * and the n_top most likely tokens (out->top_*), as vLLM's prompt_logprobs
 * report them. logits is left unchanged. */
void model_logprob_row(const float *logits, int n_vocab, int32_t token, int n_top, struct model_sample_out *out);
int model_sample(float *logits, int n_vocab, const struct model_sampling *s, const int32_t *history,
                 int n_prompt, int n_history, uint64_t *rng, void *scratch,
                 struct model_sample_out *out);

/* Speculative decoding's verification of n_draft draft tokens (sampler.c).
 * logits holds n_draft + 1 rows [n_draft + 1][n_vocab] (modified in place):
 * row i is the target model's after the i-th draft's predecessor, and is
 * sampled exactly as model_sample samples it with history[0 .. n_history + i),
 * where history[n_history .. n_history + n_draft) are the drafts. Rows are
 * taken in order and the walk stops after the first row whose token is not
 * its draft (that token is the correction), or after the last row (the bonus
 * token): out[0 .. *n_out) are the tokens to emit, the accepted drafts then
 * one more, so *n_out - 1 drafts were accepted. A row that cannot be sampled
 * (model_sample fails) ends the walk with out token -1.
 *
 * This is rejection sampling for a deterministic (one-hot) draft: a draft d
 * is accepted with probability p(d) (= min(1, p(d)/q(d)) with q(d) = 1), and
 * on rejection the token comes from p without d, renormalized (= max(0, p -
 * q) normalized): the draw that model_sample makes falls on d with
 * probability p(d), and elsewhere it is distributed as p restricted to the
 * other tokens. So the emitted tokens follow the target distribution, and
 * with the same RNG state they are the very tokens decoding without drafts
 * would give (one draw per emitted token; none at temperature 0). Returns 0,
 * or SL_EINVAL for bad arguments. */
int model_sample_verify(float *logits, int n_draft, int n_vocab, const struct model_sampling *s,
                        const int32_t *history, int n_prompt, int n_history, uint64_t *rng, void *scratch,
                        struct model_sample_out *out, int *n_out);
/* The general rejection step, for a draft d drawn from a distribution q
 * (q[n_vocab], summing to 1; NULL: one-hot at d, as model_sample_verify).
 * p is the target distribution model_sample draws from (bias, mask,
 * penalties, temperature, top_k, top_p, min_p; temperature 0: one-hot at the
 * argmax). d is accepted with probability min(1, p(d) / q(d)); otherwise the
 * token is drawn from max(0, p - q), normalized. Returns 1 (accepted: out
 * token d) or 0 (rejected: out token the residual draw), out->logprob as
 * model_sample reports it; a negative status when logits cannot be sampled. */
int model_spec_accept(float *logits, int n_vocab, const struct model_sampling *s, const int32_t *history,
                      int n_prompt, int n_history, int32_t d, const float *q, uint64_t *rng, void *scratch,
                      struct model_sample_out *out);

#endif
