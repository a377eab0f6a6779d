/* backend.c - picking a backend by name (model/backend.h), and the weak
 * stand-ins for the CUDA backend that cuda/ overrides when built with nvcc. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"

__attribute__((weak)) bool model_cuda_available(void) { return false; }

__attribute__((weak)) model_backend *model_cuda_backend_create(const model *m,
                                                                const struct model_backend_opts *opts,
                                                                char *err, size_t errlen)
{
    (void)m;
    (void)opts;
    if (err && errlen) snprintf(err, errlen, "this build has no CUDA backend");
    return NULL;
}

model_backend *model_backend_create(const model *m, const struct model_backend_opts *opts, char *err,
                                    size_t errlen)
{
    const char *dev = opts ? opts->device : NULL;
    if (!m) {
        if (err && errlen) snprintf(err, errlen, "no model");
        return NULL;
    }
    if (!dev) dev = model_cuda_available() ? "cuda" : "cpu";
    bool fp8;
    if (model_kv_dtype(opts, dev, &fp8, err, errlen)) return NULL;
    if (strcmp(dev, "cpu") == 0 && opts && opts->tensor_parallel_size > 1) {
        if (err && errlen)
            snprintf(err, errlen, "tensor parallelism (%d GPUs) needs the cuda device, not cpu%s",
                     opts->tensor_parallel_size, model_cuda_available() ? "" : " (no GPU found)");
        return NULL;
    }
    if (opts && opts->mtp && model_state_bytes(model_get_config(m)) > 0) {
        /* n-gram drafts run on such a model (backends with state_rollback); its MTP layer has no reference to
         * check ours against: no transformers or vLLM model runs glm5_next's */
        if (err && errlen)
            snprintf(err, errlen, "--speculative-config: method mtp is not supported for models with "
                     "linear-attention (KDA) layers (no reference models their MTP layer); method ngram is");
        return NULL;
    }
    if (opts && opts->mtp && model_get_config(m)->n_mtp_layer == 0) {
        if (err && errlen)
            snprintf(err, errlen, "speculative method mtp: this %s model has no MTP layers (num_nextn_predict_layers "
                     "is 0, the checkpoint has none, or --hf-overrides switched them off)",
                     model_arch_name(model_get_config(m)->arch));
        return NULL;
    }
    model_backend *b = NULL;
    if (strcmp(dev, "cpu") == 0) b = model_cpu_backend_create(m, opts, err, errlen);
    else if (strcmp(dev, "cuda") == 0) b = model_cuda_backend_create(m, opts, err, errlen);
    else if (err && errlen) snprintf(err, errlen, "unknown device '%s' (expected cpu or cuda)", dev);
    if (b && opts && opts->mtp && !b->has_mtp) {
        if (err && errlen) snprintf(err, errlen, "speculative method mtp: the %s backend has no MTP layer yet", dev);
        model_backend_destroy(b);
        return NULL;
    }
    return b;
}

int model_kv_dtype(const struct model_backend_opts *opts, const char *device, bool *fp8, char *err, size_t errlen)
{
    const char *d = opts ? opts->kv_cache_dtype : NULL;
    *fp8 = false;
    if (!d || !strcmp(d, "auto")) return 0;
    if (!device) device = model_cuda_available() ? "cuda" : "cpu";
    if (!strcmp(d, "fp8") || !strcmp(d, "fp8_e4m3")) {
        if (strcmp(device, "cuda")) {
            if (err && errlen)
                snprintf(err, errlen, "--kv-cache-dtype %s needs the cuda device (the CPU backend keeps its KV cache in f32)",
                         d);
            return SL_EUNSUP;
        }
        *fp8 = true;
        return 0;
    }
    if (err && errlen)
        snprintf(err, errlen, "--kv-cache-dtype %s: %s", d,
                 !strcmp(d, "fp8_e5m2") ? "not supported (use fp8 or fp8_e4m3)"
                                        : "unknown (expected auto, fp8 or fp8_e4m3)");
    return !strcmp(d, "fp8_e5m2") ? SL_EUNSUP : SL_EINVAL;
}

int model_tp_check(const struct model_config *c, int n, char *err, size_t errlen)
{
    if (n < 1) {
        if (err && errlen) snprintf(err, errlen, "--tensor-parallel-size %d: must be at least 1", n);
        return SL_EINVAL;
    }
    if (c->n_head % n || c->n_head_kv % n || c->n_ff % n) {
        if (err && errlen)
            snprintf(err, errlen,
                     "--tensor-parallel-size %d does not divide the model: %d attention heads, %d KV heads and "
                     "FFN width %d must each be a multiple of %d",
                     n, c->n_head, c->n_head_kv, c->n_ff, n);
        return SL_EUNSUP;
    }
    return 0;
}

void model_backend_destroy(model_backend *b)
{
    if (b && b->ops && b->ops->destroy) b->ops->destroy(b);
}

/* A recurrent state advances token by token: sequence i's query tokens must
 * be its next positions in order, its slots inside the pool and its own. */
static int state_check(const struct step *s, int i, int n_slots, char *err, size_t errlen)
{
    const struct step_seq *q = &s->seqs[i];
    int p0 = q->context_len - q->query_len;
    for (int k = 0; k < q->query_len; k++)
        if (s->positions[q->query_start + k] != p0 + k) {
            sl_seterr(err, errlen, "forward: seq %d: a model with recurrent layers needs positions %d..%d in order",
                      i, p0, q->context_len - 1);
            return SL_EINVAL;
        }
    if (q->state_slot < 0 || q->state_slot >= n_slots ||
        (q->state_restore && (q->state_from < 0 || q->state_from >= n_slots || q->state_from == q->state_slot))) {
        sl_seterr(err, errlen, "forward: seq %d: state slot %d (from %d) outside the %d slots", i, q->state_slot,
                  q->state_restore ? q->state_from : -1, n_slots);
        return SL_EINVAL;
    }
    for (int j = 0; j < i; j++)
        if (s->seqs[j].state_slot == q->state_slot) {
            sl_seterr(err, errlen, "forward: seqs %d and %d share state slot %d", j, i, q->state_slot);
            return SL_EINVAL;
        }
    if (q->n_snaps < 0 || (q->n_snaps > 0 && (!q->snap_pos || !q->snap_slot))) {
        sl_seterr(err, errlen, "forward: seq %d: bad snapshot list", i);
        return SL_EINVAL;
    }
    for (int k = 0; k < q->n_snaps; k++)
        if (q->snap_pos[k] <= (k ? q->snap_pos[k - 1] : p0) || q->snap_pos[k] > q->context_len ||
            q->snap_slot[k] < 0 || q->snap_slot[k] >= n_slots || q->snap_slot[k] == q->state_slot) {
            sl_seterr(err, errlen, "forward: seq %d: snapshot %d (after %d tokens into slot %d) outside the step "
                      "(positions %d..%d) or the %d slots", i, k, q->snap_pos[k], q->snap_slot[k], p0,
                      q->context_len - 1, n_slots);
            return SL_EINVAL;
        }
    return 0;
}

int model_step_check(const struct step *s, const struct model_step_limits *lim, int *tok_seq, char *err,
                     size_t errlen)
{
    if (s->n_tokens <= 0 || s->n_tokens > lim->max_tokens || s->n_seqs <= 0 ||
        s->n_seqs > lim->max_seqs || !s->token_ids || !s->positions || !s->slots || !s->seqs) {
        sl_seterr(err, errlen, "forward: bad step (%d tokens of max %d, %d seqs of max %d)",
               s->n_tokens, lim->max_tokens, s->n_seqs, lim->max_seqs);
        return SL_EINVAL;
    }
    for (int t = 0; t < s->n_tokens; t++) {
        if (s->token_ids[t] < 0 || s->token_ids[t] >= lim->n_vocab) {
            sl_seterr(err, errlen, "forward: token %d: id %d out of range", t, s->token_ids[t]);
            return SL_EINVAL;
        }
        tok_seq[t] = -1;
    }
    int bs = lim->block_size;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        if (q->query_len <= 0 || q->query_start < 0 || q->query_start > s->n_tokens - q->query_len ||
            q->context_len < q->query_len || q->context_len > lim->max_ctx || !q->block_table ||
            q->n_blocks < 0 || (int64_t)q->n_blocks * bs < q->context_len) {
            sl_seterr(err, errlen, "forward: seq %d: bad query/context/block table", i);
            return SL_EINVAL;
        }
        int nb = (q->context_len + bs - 1) / bs;
        for (int j = 0; j < nb; j++)
            if (q->block_table[j] < 0 || q->block_table[j] >= lim->kv_blocks) {
                sl_seterr(err, errlen, "forward: seq %d: block %d out of range", i, q->block_table[j]);
                return SL_EINVAL;
            }
        for (int t = q->query_start; t < q->query_start + q->query_len; t++) {
            int pos = s->positions[t];
            if (tok_seq[t] != -1) {
                sl_seterr(err, errlen, "forward: token %d belongs to two sequences", t);
                return SL_EINVAL;
            }
            tok_seq[t] = i;
            if (pos < 0 || pos >= q->context_len) {
                sl_seterr(err, errlen, "forward: seq %d: position %d outside context %d", i, pos,
                       q->context_len);
                return SL_EINVAL;
            }
            int64_t slot = (int64_t)q->block_table[pos / bs] * bs + pos % bs;
            if (s->slots[t] != slot) {
                sl_seterr(err, errlen, "forward: token %d: slot %lld, block table says %lld", t,
                       (long long)s->slots[t], (long long)slot);
                return SL_EINVAL;
            }
        }
        if (q->want_sample && (!q->sampling || q->n_history < q->n_prompt || q->n_prompt < 0 ||
                               (q->n_history > 0 && !q->history))) {
            sl_seterr(err, errlen, "forward: seq %d: want_sample without sampling parameters or history", i);
            return SL_EINVAL;
        }
        const struct model_sampling *sp = q->sampling;
        if (q->want_sample &&
            !(sp->temperature >= 0.0f && sp->top_p > 0.0f && sp->top_p <= 1.0f && sp->min_p >= 0.0f &&
              sp->min_p <= 1.0f && sp->repetition_penalty > 0.0f && isfinite(sp->presence_penalty) &&
              isfinite(sp->frequency_penalty) && sp->top_logprobs >= 0 && sp->top_logprobs <= MODEL_MAX_TOP_LOGPROBS &&
              sp->n_logit_bias >= 0 && (sp->n_logit_bias == 0 || sp->logit_bias))) {
            sl_seterr(err, errlen, "forward: seq %d: bad sampling parameters", i);
            return SL_EINVAL;
        }
        if (q->n_draft != 0 && (q->n_draft < 0 || q->n_draft > lim->max_draft || !q->want_sample || !q->spec_out ||
                                q->query_len < q->n_draft + 1 || q->n_history + q->n_draft > q->context_len)) {
            sl_seterr(err, errlen, "forward: seq %d: %d drafts (this backend verifies at most %d a sequence, after "
                      "one sampled token, with the drafts in its history)", i, q->n_draft, lim->max_draft);
            return SL_EINVAL;
        }
        if (lim->state_slots > 0 && state_check(s, i, lim->state_slots, err, errlen)) return SL_EINVAL;
        if (lim->state_slots > 0 && q->n_draft > 0 && !lim->state_rollback) {
            sl_seterr(err, errlen, "forward: seq %d: drafts on a model with recurrent layers (this backend does not roll "
                      "their state back to the last accepted draft)", i);
            return SL_EINVAL;
        }
    }
    for (int t = 0; t < s->n_tokens; t++)
        if (tok_seq[t] < 0) {
            sl_seterr(err, errlen, "forward: token %d belongs to no sequence", t);
            return SL_EINVAL;
        }
    return 0;
}

int model_mtp_check(const struct model_mtp_req *r, int n, const struct model_step_limits *lim, int last_n,
                    const int *last_pos0, const int *last_len, int *kmax, char *err, size_t errlen)
{
    int bs = lim->block_size;
    *kmax = 0;
    if (n < 0 || n > lim->max_seqs || (n > 0 && !r)) {
        sl_seterr(err, errlen, "mtp_draft: %d requests (at most %d)", n, lim->max_seqs);
        return SL_EINVAL;
    }
    if (n > 0 && last_n < 0) {
        sl_seterr(err, errlen, "mtp_draft: no step to draft from (forward() failed or has not run since kv_alloc)");
        return SL_EINVAL;
    }
    for (int j = 0; j < n; j++) {
        const struct model_mtp_req *q = &r[j];
        int last = q->pos + (q->k > 1 ? q->k : 1); /* the last entry written */
        if (q->seq < 0 || q->seq >= last_n) {
            sl_seterr(err, errlen, "mtp_draft: request %d names sequence %d, the last step had %d", j, q->seq,
                      last_n);
            return SL_EINVAL;
        }
        int p0 = last_pos0[q->seq], len = last_len[q->seq];
        if (q->pos < p0 || q->pos >= p0 + len) {
            sl_seterr(err, errlen, "mtp_draft: request %d: position %d is not one of its sequence's query positions "
                      "in the last step (%d .. %d)", j, q->pos, p0, p0 + len - 1);
            return SL_EINVAL;
        }
        if (q->token < 0 || q->token >= lim->n_vocab || q->k < 0 || (q->k > 0 && !q->drafts) ||
            last >= lim->max_ctx) {
            sl_seterr(err, errlen, "mtp_draft: request %d: token %d (vocabulary %d), k %d%s, last position %d "
                      "(context %d)", j, q->token, lim->n_vocab, q->k, q->k > 0 && !q->drafts ? " without drafts[]" : "",
                      last, lim->max_ctx);
            return SL_EINVAL;
        }
        if (!q->block_table || q->n_blocks <= last / bs) {
            sl_seterr(err, errlen, "mtp_draft: request %d: %d blocks do not cover position %d", j, q->n_blocks, last);
            return SL_EINVAL;
        }
        for (int i = 0; i <= last / bs; i++)
            if (q->block_table[i] < 0 || q->block_table[i] >= lim->kv_blocks) {
                sl_seterr(err, errlen, "mtp_draft: request %d: block %d is outside the pool (%d blocks)", j,
                          q->block_table[i], lim->kv_blocks);
                return SL_EINVAL;
            }
        if (last - q->pos > *kmax) *kmax = last - q->pos;
    }
    return 0;
}
