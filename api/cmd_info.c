/* cmd_info.c - `sluice info`: what this build can do and what a model is. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "model/backend.h"
#include "model/model.h"

/* Each family of weight matrices and its format, as the file holds it
 * (quantized or not, decided per tensor: model/quant.c). */
static void info_weight_formats(const model *m)
{
    size_t n = model_weight_formats(m, NULL, 0);
    char *buf = malloc(n + 1);
    if (!buf) return;
    model_weight_formats(m, buf, n + 1);
    printf("weights:\n");
    for (char *line = buf, *nl; *line; line = nl + 1) {
        nl = strchr(line, '\n');
        if (!nl) break;
        printf("  %.*s\n", (int)(nl - line), line);
    }
    free(buf);
}

/* The plan of layers (runs of equal kinds), the MLA shape where there is one,
 * the MTP modules, and what a token's KV takes in the pool. */
static void info_plan(const model *m)
{
    const struct model_config *c = model_get_config(m);
    char plan[8192];
    model_plan_describe(c, plan, sizeof plan);
    printf("layer plan: %s\n", plan);
    if (c->moe.n_expert > 0) {
        const struct model_moe_config *mc = &c->moe;
        printf("experts: %d routed, %d per token, intermediate %d; shared intermediate %d%s; %s router%s", mc->n_expert,
               mc->n_expert_used, mc->n_ff_expert, mc->n_ff_shared, mc->shared_gated ? " (gated)" : "",
               mc->router == MODEL_ROUTER_SOFTMAX ? "softmax" : "sigmoid", mc->norm_topk ? ", renormalised" : "");
        if (mc->n_group > 1) printf(", %d groups (best %d)", mc->n_group, mc->topk_group);
        if (mc->router == MODEL_ROUTER_SIGMOID) printf(", scaling %g", mc->scale);
        if (mc->swiglu_limit > 0) printf(", swiglu limit %g", mc->swiglu_limit);
        printf("\n");
    }
    const struct model_mla_config *a = &c->mla;
    if (a->kv_lora_rank > 0) {
        printf("mla: kv_lora_rank %d, q_lora_rank %d, qk nope %d + rope %d, v %d, softmax scale %.6g%s%s\n",
               a->kv_lora_rank, a->q_lora_rank, a->qk_nope_head_dim, a->qk_rope_head_dim, a->v_head_dim,
               a->softmax_scale, a->yarn_factor > 0 ? ", yarn" : "",
               a->rope_interleave && a->qk_rope_head_dim > 0 ? ", interleaved rope" : "");
        if (a->index_n_heads > 0) {
            if (a->index_topk > 0)
                printf("dsa indexer: top %d keys, %d heads of %d\n", a->index_topk, a->index_n_heads, a->index_head_dim);
            else
                printf("dsa indexer: off (index_topk null): dense MLA\n");
        }
        if (a->index_kpool > 0 && a->index_topk > 0) {
            /* the GPU keeps each pool's key (f32) beside the KV blocks of every layer that runs its own indexer
             * (cuda_mla_pool_block_bytes): bytes a token on top of the KV below */
            printf("dsa indexer k-pools: %d keys a pool, %d pools a query%s; the GPU caches each pool's key: %.0f "
                   "bytes a token\n",
                   a->index_kpool, a->index_topk / a->index_kpool,
                   a->index_kpool_tail ? " + its own incomplete pool" : "", (double)model_kpool_indexer_layers(c) * a->index_head_dim * 4 / a->index_kpool);
        }
        const struct model_weights *w = model_get_weights(m);
        if (a->n_mtp_layers > 0)
            printf("mtp: %d layer(s), %d tensors, %.2f MB (loaded, not run)\n", a->n_mtp_layers, w->mtp_tensors,
                   w->mtp_bytes / 1e6);
    }
    if (c->hc.mult > 0)
        printf("hyper-connections: %d residual streams, %d Sinkhorn iterations, eps %g\n", c->hc.mult,
               c->hc.sinkhorn_iters, c->hc.eps);
    printf("kv per token: %zu bytes f32 (cpu), %zu bf16, %zu fp8\n", model_kv_bytes_per_token(c, 4),
           model_kv_bytes_per_token(c, 2), model_kv_bytes_per_token(c, 1));
    if (c->n_mtp_layer > 0) {
        const struct model_weights *w = model_get_weights(m);
        struct model_layer_kind k = model_layer_kind_of(c, c->n_layer);
        printf("mtp: %d layer(s) (%s + %s), %d tensors, %.2f MB; when speculating (method mtp) its KV adds %zu bytes "
               "per token f32 (cpu) + %zu per block, %zu bf16 + %zu\n",
               c->n_mtp_layer, model_mixer_name(k.mixer), model_ffn_name(k.ffn), w->mtp_tensors, w->mtp_bytes / 1e6,
               model_mtp_kv_bytes_per_token(c, 4),
               model_mtp_kv_bytes_per_block(c, 4), model_mtp_kv_bytes_per_token(c, 2),
               model_mtp_kv_bytes_per_block(c, 2));
    }
    size_t sb = model_state_bytes(c);
    if (sb > 0) {
        const struct model_kda_config *k = &c->kda;
        size_t tok = model_kv_bytes_per_token(c, 2);
        printf("kda: %d heads x %d, conv %d, forget gate %s\n", k->n_head, k->head_dim, k->conv_kernel,
               k->has_lower_bound ? "lower-bounded" : "softplus");
        printf("recurrent state per sequence: %zu bytes f32 (%.2f MiB), the KV of %zu tokens at bf16: with prefix "
               "caching, one snapshot every that many tokens (--mamba-block-size auto) at most doubles the cache's "
               "bytes per token\n", sb, sb / 1048576.0, tok ? (sb + tok - 1) / tok : 0);
        size_t rb = model_state_replay_bytes(c);
        printf("speculative decoding on the GPU: %zu bytes (%.2f MiB) per draft token to roll the state back, set "
               "aside at start for --max-num-seqs x num_speculative_tokens drafts (divided by the tensor-parallel "
               "size)\n", rb, rb / 1048576.0);
    }
    const struct model_weights *w = model_get_weights(m);
    printf("weights in memory: %.4g GB (mtp %.4g GB)\n", model_weight_bytes(m) / 1e9, w->mtp_bytes / 1e9);
}

int api_cmd_info(int argc, char **argv)
{
    const char *model_path = NULL, *load_format = NULL, *hf_overrides = NULL, *tokenizer = NULL;
    const struct api_flag flags[] = {
        {"--model", API_FLAG_STR, &model_path, "GGUF file or HF checkpoint directory", NULL},
        {"--load-format", API_FLAG_STR, &load_format, "auto, or dummy: random weights from a config.json dir", NULL},
        {"--hf-overrides", API_FLAG_STR, &hf_overrides, "JSON object applied to the model's config (vLLM's)", NULL},
        {"--tokenizer", API_FLAG_STR, &tokenizer, "take the tokenizer from another model", NULL},
        {0},
    };
    char err[512];
    const char *pos[1];
    int flags_rc;
    int np = api_cmd_flags("info", "usage: sluice info [--model PATH] [--load-format dummy] [--hf-overrides JSON] [--tokenizer PATH]\n\n", argc, argv, 2, flags, pos, 1, &flags_rc);
    if (np < 0) return flags_rc;
    if (np == 1 && !model_path) model_path = pos[0];
    char gpus[1024];
    int n_gpu = model_cuda_describe(gpus, sizeof gpus);
    printf("gpus: %s%s\n", n_gpu > 0 ? "" : "none: ", gpus);
    printf("cuda backend: %s\n", model_cuda_available() ? "available" : "not available");
    if (!model_path) return 0;
    struct model_load_opts lo = {.load_format = load_format, .hf_overrides = hf_overrides, .tokenizer = tokenizer};
    bool dummy = load_format && !strcmp(load_format, "dummy");
    model *m = model_load(model_path, &lo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "sluice info: %s\n", err);
        return 1;
    }
    /* info is where one looks at a checkpoint before serving it: damaged
     * weights are named here, whatever the cost of reading them all */
    int wrc = dummy ? 0 : model_check_weights(m, err, sizeof err);
    const struct model_config *c = model_get_config(m);
    printf("arch: %s\nlayers: %d\nhidden: %d\nffn: %d\nheads: %d (kv %d, head_dim %d)\nvocab: %d\n"
           "context: %d\nrope: %s theta %g%s\ntied embeddings: %s\n",
           model_arch_name(c->arch), c->n_layer, c->n_embd, c->n_ff, c->n_head, c->n_head_kv, c->head_dim,
           c->n_vocab, c->n_ctx_train, c->rope_type == MODEL_ROPE_NEOX ? "neox" : "norm", c->rope_theta,
           c->rope_llama3_factor > 0 ? " (llama3 scaling)" : "", c->tie_embeddings ? "yes" : "no");
    info_plan(m);
    printf("tokenizer: %d tokens\nweight values: %s\n", model_tok_n_vocab(model_get_tok(m)),
           dummy ? "dummy (random)" : wrc ? "DAMAGED" : "all finite");
    info_weight_formats(m);
    model_free(m);
    if (wrc) fprintf(stderr, "sluice info: %s\n", err);
    return wrc ? 1 : 0;
}
