/* compat.c - vLLM flags that sluice accepts but implements partly or not at
 * all. Each ignored part is reported at start-up in one line saying what and
 * why; a malformed JSON value is an error naming the flag. */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "api.h"
#include "base/json.h"

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

static int speculative_config(const char *v, char *err, size_t errlen)
{
    json_doc d;
    if (parse_json_flag("--speculative-config", v, &d, err, errlen)) return -1;
    char method[64] = "?";
    int m = json_get(&d, 0, "method");
    if (json_is_str(&d, m)) json_str(&d, m, method, sizeof method);
    char what[128];
    snprintf(what, sizeof what, "speculative decoding (method %s)", method);
    note("--speculative-config", what, "not implemented yet; every token is decoded by the model itself");
    json_free(&d);
    return 0;
}

int api_vllm_compat(const struct api_vllm_flags *f, bool *eager, char *err, size_t errlen)
{
    *eager = f->enforce_eager;
    if (f->compilation_config && compilation_config(f->compilation_config, eager, err, errlen)) return -1;
    if (f->speculative_config && speculative_config(f->speculative_config, err, errlen)) return -1;
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
