/* moe.h - mixture-of-experts FFN layers (MODEL_FFN_MOE), internal to model/.
 *
 * Three parts, each usable alone:
 *  - configuration: the MoE keys of an HF config.json become struct
 *    model_moe_config plus the set of layers that are sparse (the loader's
 *    plan reads it);
 *  - weights: one layer's router, experts and shared experts bound from the
 *    checkpoint (one tensor per expert, or transformers' fused 3-D
 *    gate_up_proj / down_proj) through the loader's tensor lookup;
 *  - compute: model_moe_route(), the router of every architecture here (the
 *    reference a device backend checks against), and the CPU backend's MoE
 *    block (moe_cpu_*).
 * The loader and the CPU backend call these from their one thread.
 */
#ifndef SLUICE_MOE_H
#define SLUICE_MOE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/json.h"
#include "model.h"

/* ---- configuration ---------------------------------------------------------------- */

/* Reads the MoE keys of config.json object obj (already known to be of
 * architecture c->arch, with c->n_layer set) into c->moe and *sparse, a
 * malloc'ed [c->n_layer] mask of the MoE layers (the caller frees; NULL when
 * the architecture has none). Keys by architecture, as transformers reads
 * them:
 *   qwen3_moe: num_experts | num_local_experts, num_experts_per_tok,
 *     moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
 *     mlp_only_layers (qwen2_moe: the same, and shared_expert_intermediate_size);
 *   glm4_moe (and deepseek_v3's block): n_routed_experts, n_shared_experts,
 *     routed_scaling_factor, n_group, topk_group, first_k_dense_replace;
 *   any: mlp_layer_types ("dense"/"sparse") overrides the rule; swiglu_limit.
 * Returns 0, or SL_EFORMAT / SL_EUNSUP with a message naming the key. */
int moe_hf_config(const json_doc *d, int obj, struct model_config *c, bool **sparse, char *err, size_t errlen);

/* ---- weights ---------------------------------------------------------------------- */

/* The loader's lookups (model/loader.c), for binding: a matrix [rows][cols]
 * (rows 0: a vector of cols) in whatever format the file holds it, and a raw
 * tensor of any rank. model_loader_tensor returns 0, 1 when absent, or a
 * negative status. */
int model_loader_weight(model *m, const char *name, int64_t rows, int64_t cols, bool optional,
                        struct model_tensor *t, char *err, size_t errlen);
int model_loader_tensor(model *m, const char *name, struct model_tensor *t);

/* Binds layer l's MoE weights (HF names under prefix, e.g.
 * "model.layers.3.mlp") into *w. experts: [3 * n_expert] tensors the caller
 * owns, for w->gate/up/down. Returns 0, or a negative status with a message
 * naming the tensor. */
int moe_bind_layer(model *m, const struct model_config *c, const char *prefix, struct model_moe_weights *w,
                   struct model_tensor *experts, char *err, size_t errlen);

/* ---- compute ---------------------------------------------------------------------- */

/* Routes one token: logits[n_expert] are the router's outputs (x . router^T,
 * f32), bias the correction bias (or NULL). Writes the n_expert_used chosen
 * experts to idx[] in ascending expert order and their weights (scale and
 * normalisation applied) to wt[]. scratch: 2 * n_expert floats. Ties go to the
 * lower expert index. Pure: the same inputs give the same bits. */
void model_moe_route(const struct model_moe_config *mc, const float *logits, const float *bias, int32_t *idx,
                     float *wt, float *scratch);

/* How far token's routing is from a flip: the smallest change of the router
 * logits, each moving by that much (linearised), that reorders a chosen and
 * an unchosen candidate (the k-th / (k+1)-th boundary), or with n_group > 1
 * a kept and a dropped group; in router-logit units (softmax: half the logit
 * gap; sigmoid: the score gap over the two scores' slopes). Tests compare it
 * with the noise a device's bf16 activations put on the logits: a choice
 * under that margin may come out otherwise there. scratch: 2 * n_expert
 * floats. Not on the serving path. */
float model_moe_route_margin(const struct model_moe_config *mc, const float *logits, const float *bias,
                             float *scratch);

/* The CPU backend's MoE blocks (every MoE layer of the plan c, MTP layers
 * included). Weights stay in the checkpoint's encoding
 * (borrowed); scratch is sized for max_tokens at creation. */
struct moe_cpu;
struct moe_cpu *moe_cpu_create(const struct model_config *c, const struct model_weights *w, int max_tokens,
                               int n_threads, char *err, size_t errlen);
/* x[T][n_embd] += layer l's MoE block applied to xn[T][n_embd] (already
 * normed). Each token's result depends on its own row only: its experts are
 * summed in ascending expert order, then the shared experts, whatever other
 * tokens share the step. Only the chosen experts' rows are read. margin:
 * NULL, or [T] each token's model_moe_route_margin (tests). */
void moe_cpu_forward(struct moe_cpu *mc, int l, const float *xn, float *x, int T, float *margin);
void moe_cpu_destroy(struct moe_cpu *mc);

#endif
