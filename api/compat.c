/* compat.c - vLLM flags that sluice accepts but implements partly or not at
 * all. Each ignored part is reported at start-up in one line saying what and
 * why; a malformed JSON value is an error naming the flag. */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "api.h"
#include "base/json.h"
#include "model/model.h"
#include "sched/sched.h"

static void note(const char *flag, const char *what, const char *why)
{
    fprintf(stderr, "sluice serve: %s: %s ignored: %s\n", flag, what, why);
}

/* Parses a JSON-valued flag; NULL value = not given. Returns 0 or -1 with err. */
static int parse_json_flag(const char *flag, const char *v, json_doc *d, char *err, size_t errlen)
{
    char perr[200];
    if (json_parse(d, v, strlen(v), perr, sizeof perr)) {
        snprintf(err, errlen, "%s is not valid JSON: %s", flag, perr);
        return -1;
    }
    if (!json_is_obj(d, 0)) {
        json_free(d);
        snprintf(err, errlen, "%s must be a JSON object", flag);
        return -1;
    }
    return 0;
}

/* *none: cudagraph_mode is "NONE" */
static int compilation_config(const char *v, bool *none, char *err, size_t errlen)
{
    json_doc d;
    if (parse_json_flag("--compilation-config", v, &d, err, errlen)) return -1;
    int n = json_size(&d, 0);
    for (int k = 0, i = 1; k < n; k++, i = json_skip(&d, i + 1)) {
        char key[96], val[96] = "";
        json_str(&d, i, key, sizeof key);
        if (json_is_str(&d, i + 1)) json_str(&d, i + 1, val, sizeof val);
        if (!strcmp(key, "cudagraph_mode")) {
            if (!strcmp(val, "NONE")) *none = true;
            if (!strcmp(val, "FULL_DECODE_ONLY") || !strcmp(val, "NONE")) continue;
            char what[160];
            snprintf(what, sizeof what, "cudagraph_mode %s", val);
            note("--compilation-config", what,
                 "sluice captures CUDA graphs for decode-only steps (FULL_DECODE_ONLY); mixed steps run eagerly");
        } else if (!strcmp(key, "cudagraph_capture_sizes")) {
            note("--compilation-config", "cudagraph_capture_sizes",
                 "sluice picks its own decode batch-size buckets for graphs");
        } else {
            char what[160];
            snprintf(what, sizeof what, "'%s'", key);
            note("--compilation-config", what, "sluice has no torch.compile stage; kernels are fixed CUDA code");
        }
    }
    json_free(&d);
    return 0;
}

/* An integer member of the speculative config: 0 (*v set, or left when absent) or -1 with err. */
static int spec_int(const json_doc *d, const char *key, int lo, int hi, int *v, char *err, size_t errlen)
{
    int i = json_get(d, 0, key);
    if (i < 0 || json_is_null(d, i)) return 0;
    int64_t x;
    if (!json_is_num(d, i) || json_i64(d, i, &x) || x < lo || x > hi) {
        snprintf(err, errlen, "--speculative-config: %s must be an integer from %d to %d", key, lo, hi);
        return -1;
    }
    *v = (int)x;
    return 0;
}

int api_speculative_config(const char *v, const char *who, struct sched_spec_config *c, char *err, size_t errlen)
{
    memset(c, 0, sizeof *c);
    json_doc d;
    if (parse_json_flag("--speculative-config", v, &d, err, errlen)) return -1;
    char method[64] = "";
    int m = json_get(&d, 0, "method");
    if (m >= 0 && json_is_str(&d, m)) json_str(&d, m, method, sizeof method);
    size_t ml = strlen(method);
    bool ngram = !strcmp(method, "ngram") || !strcmp(method, "[ngram]");
    /* vLLM's per-architecture MTP names (deepseek_mtp, glm4_moe_mtp, ...) are the same drafter here */
    bool mtp = !strcmp(method, "mtp") || (ml > 4 && !strcmp(method + ml - 4, "_mtp"));
    int k = 0, lmin = 0, lmax = 0;
    int rc = -1;
    if (spec_int(&d, "num_speculative_tokens", 1, SCHED_MAX_SPEC_TOKENS, &k, err, errlen) ||
        spec_int(&d, "prompt_lookup_min", 1, 1 << 20, &lmin, err, errlen) ||
        spec_int(&d, "prompt_lookup_max", 1, 1 << 20, &lmax, err, errlen))
        goto out;
    if (!ngram && !mtp) {
        fprintf(stderr, "sluice %s: --speculative-config: method '%s' ignored: sluice drafts with ngram or mtp; "
                        "every token is decoded by the model itself\n", who, method[0] ? method : "(none)");
        rc = 0;
        goto out;
    }
    if (ngram) {
        if (k == 0) {
            snprintf(err, errlen, "--speculative-config: method ngram needs num_speculative_tokens (1 to %d)",
                     SCHED_MAX_SPEC_TOKENS);
            goto out;
        }
        /* vLLM's defaults: 5 and 5, or the one given for both */
        if (!lmin && !lmax) lmin = lmax = 5;
        else if (!lmin) lmin = lmax;
        else if (!lmax) lmax = lmin;
        if (lmin > lmax) {
            snprintf(err, errlen, "--speculative-config: prompt_lookup_min %d is more than prompt_lookup_max %d", lmin,
                     lmax);
            goto out;
        }
    }
    c->method = ngram ? SCHED_SPEC_NGRAM : SCHED_SPEC_MTP;
    c->num_speculative_tokens = k ? k : 1; /* mtp: vLLM takes the model's MTP layers, 1 in GLM and DeepSeek */
    c->prompt_lookup_min = lmin;
    c->prompt_lookup_max = lmax;
    int n = json_size(&d, 0);
    for (int j = 0, i = 1; j < n; j++, i = json_skip(&d, i + 1)) {
        char key[96], val[96] = "";
        json_str(&d, i, key, sizeof key);
        if (json_is_str(&d, i + 1)) json_str(&d, i + 1, val, sizeof val);
        if (!strcmp(key, "method") || !strcmp(key, "num_speculative_tokens") ||
            (ngram && (!strcmp(key, "prompt_lookup_min") || !strcmp(key, "prompt_lookup_max"))) ||
            (!strcmp(key, "draft_sample_method") && !strcmp(val, "greedy")))
            continue;
        char what[160];
        snprintf(what, sizeof what, "'%s'%s%s", key, val[0] ? " " : "", val);
        fprintf(stderr, "sluice %s: --speculative-config: %s ignored: %s\n", who, what,
                !strcmp(key, "disable_by_batch_size")
                    ? "drafts are turned down by the step cost model when verifying costs more than it saves"
                : !strcmp(key, "draft_sample_method") ? "drafts are greedy"
                                                      : "not implemented");
    }
    rc = 0;
out:
    json_free(&d);
    return rc;
}

void api_speculative_fit(const model *m, const char *who, struct sched_spec_config *c)
{
    const struct model_config *mc = m ? model_get_config(m) : NULL;
    if (c->method == SCHED_SPEC_MTP && mc && model_state_bytes(mc) > 0) {
        fprintf(stderr, "sluice %s: --speculative-config: method mtp ignored: this model has linear-attention (KDA) "
                        "layers, whose MTP layer no reference models, so sluice does not run it; every token is "
                        "decoded by the model itself (method ngram drafts on this model)\n", who);
        memset(c, 0, sizeof *c);
    }
}

int api_vllm_compat(const struct api_vllm_flags *f, bool *eager, struct sched_spec_config *spec, char *err,
                    size_t errlen)
{
    *eager = f->enforce_eager;
    if (spec) memset(spec, 0, sizeof *spec);
    if (f->compilation_config && compilation_config(f->compilation_config, eager, err, errlen)) return -1;
    if (f->speculative_config && api_speculative_config(f->speculative_config, "serve", spec, err, errlen)) return -1;
    if (f->hf_overrides) {
        json_doc d;
        if (parse_json_flag("--hf-overrides", f->hf_overrides, &d, err, errlen)) return -1;
        json_free(&d); /* applied by the loader, which reports keys it cannot apply */
    }
    if (f->dtype && strcmp(f->dtype, "auto") && strcmp(f->dtype, "bfloat16"))
        note("--dtype", f->dtype, "weights and activations are bf16 on GPU and f32 on CPU");
    if (f->swap_space) note("--swap-space", f->swap_space, "preempted sequences are recomputed, never swapped to host memory");
    if (f->seed) note("--seed", f->seed, "each request samples from its own seed (the request's 'seed', else a random one)");
    if (f->scheduling_policy && strcmp(f->scheduling_policy, "fcfs") && strcmp(f->scheduling_policy, "priority")) {
        snprintf(err, errlen, "--scheduling-policy '%s' is not one of fcfs, priority", f->scheduling_policy);
        return -1;
    }
    if (f->scheduling_policy && !strcmp(f->scheduling_policy, "priority"))
        note("--scheduling-policy", "priority",
             "sluice has two classes either way: a request's priority > 0 (and Batch API work) yields to the rest, "
             "first come first served within each");
    if (!f->enable_chunked_prefill)
        note("--no-enable-chunked-prefill", "off", "sluice always splits prompts longer than a step's budget");
    return 0;
}

int api_partial_prefill_flags(long n, long m, char *err, size_t errlen)
{
    if (api_flag_long_range("--max-num-partial-prefills", n, 1, INT_MAX, err, errlen) ||
        api_flag_long_range("--max-long-partial-prefills", m, 1, INT_MAX, err, errlen))
        return -1;
    if (m > n) {
        snprintf(err, errlen, "--max-long-partial-prefills %ld is more than --max-num-partial-prefills %ld", m, n);
        return -1;
    }
    return 0;
}
