/* flags.c - table-driven command-line flags for every subcommand, and the
 * sizes the flags give (bytes, the GPU KV budget) that serve and run-batch
 * share. */
#include <errno.h>
#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "model/backend.h"
#include "sched/sched.h"

static int set_value(const struct api_flag *f, const char *v, char *err, size_t errlen)
{
    char *end;
    errno = 0;
    switch (f->kind) {
    case API_FLAG_STR:
        *(const char **)f->dst = v;
        return 0;
    case API_FLAG_INT: {
        long x = strtol(v, &end, 10);
        if (!*v || *end || errno || x == API_FLAG_UNSET) break;
        *(long *)f->dst = x;
        return 0;
    }
    case API_FLAG_HUMAN_INT: {
        char why[200];
        if (api_parse_human_int(v, (long *)f->dst, why, sizeof why) == 0) return 0;
        snprintf(err, errlen, "invalid value '%s' for %s: %s", v, f->name, why);
        return -1;
    }
    case API_FLAG_FLOAT: {
        double x = strtod(v, &end);
        if (!*v || *end || errno || !isfinite(x)) break;
        *(double *)f->dst = x;
        return 0;
    }
    case API_FLAG_BOOL:
        if (!strcmp(v, "true") || !strcmp(v, "1")) *(bool *)f->dst = true;
        else if (!strcmp(v, "false") || !strcmp(v, "0")) *(bool *)f->dst = false;
        else break;
        return 0;
    case API_FLAG_STRS: /* api_parse_flags takes its values */
        break;
    }
    snprintf(err, errlen, "invalid value '%s' for %s (expected %s)", v, f->name,
             f->kind == API_FLAG_INT ? "an integer" : f->kind == API_FLAG_FLOAT ? "a number" : "true or false");
    return -1;
}

int api_parse_flags(int argc, char **argv, int first, const struct api_flag *flags,
                    const char **positional, int max_pos, char *err, size_t errlen)
{
    int npos = 0;
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return -2;
        if (strncmp(a, "--", 2) != 0 || !strcmp(a, "--")) {
            if (npos >= max_pos) {
                snprintf(err, errlen, "unexpected argument '%s'", a);
                return -1;
            }
            positional[npos++] = a;
            continue;
        }
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a) : strlen(a);
        const struct api_flag *f = NULL;
        bool negated = false;
        for (const struct api_flag *g = flags; g->name; g++) {
            if (strlen(g->name) == nlen && !strncmp(g->name, a, nlen)) { f = g; break; }
            if (g->neg && strlen(g->neg) == nlen && !strncmp(g->neg, a, nlen)) { f = g; negated = true; break; }
        }
        if (!f) {
            snprintf(err, errlen, "unknown flag '%.*s' (see --help)", (int)nlen, a);
            return -1;
        }
        if (f->kind == API_FLAG_BOOL && !eq) {
            *(bool *)f->dst = !negated;
            continue;
        }
        if (negated) {
            snprintf(err, errlen, "%s takes no value", f->neg);
            return -1;
        }
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!v) {
            snprintf(err, errlen, "%s needs a value", f->name);
            return -1;
        }
        if (f->kind == API_FLAG_STRS) {
            struct api_flag_strs *l = f->dst;
            l->n = 0;
            l->v[l->n++] = v;
            while (!eq && i + 1 < argc && argv[i + 1][0] != '-') {
                if (l->n == API_FLAG_MAX_STRS) {
                    snprintf(err, errlen, "%s takes at most %d values", f->name, API_FLAG_MAX_STRS);
                    return -1;
                }
                l->v[l->n++] = argv[++i];
            }
            l->v[l->n] = NULL;
            continue;
        }
        if (set_value(f, v, err, errlen)) return -1;
    }
    return npos;
}

void api_print_flags(const struct api_flag *flags)
{
    for (const struct api_flag *f = flags; f->name; f++) {
        char name[96];
        const char *arg = f->kind == API_FLAG_STR ? " S" : f->kind == API_FLAG_STRS ? " S [S ...]"
                        : f->kind == API_FLAG_INT || f->kind == API_FLAG_HUMAN_INT ? " N"
                        : f->kind == API_FLAG_FLOAT ? " X" : "";
        if (f->neg) snprintf(name, sizeof name, "%s, %s", f->name, f->neg);
        else snprintf(name, sizeof name, "%s%s", f->name, arg);
        fprintf(stderr, "  %-34s %s\n", name, f->help);
    }
}

int api_cmd_flags(const char *name, const char *usage, int argc, char **argv, int first, const struct api_flag *flags,
                  const char **positional, int max_pos, int *exit_code)
{
    char err[512];
    int np = api_parse_flags(argc, argv, first, flags, positional, max_pos, err, sizeof err);
    if (np == -2) {
        fputs(usage, stderr);
        api_print_flags(flags);
        *exit_code = 0;
        return -1;
    }
    if (np < 0) {
        fprintf(stderr, "sluice %s: %s\n", name, err);
        *exit_code = 2;
        return -1;
    }
    return np;
}

int api_parse_human_int(const char *s, long *out, char *err, size_t errlen)
{
    const char *p = s, *end = s + strlen(s), *q;
    while (p < end && isspace((unsigned char)*p)) p++;
    while (end > p && isspace((unsigned char)end[-1])) end--;
    if (p == end) goto malformed;
    long long x = 0;
    if (!strchr("kmgtKMGT", end[-1])) {
        /* a plain integer, as Python's int() reads it: a sign is allowed
         * here, and the range checks refuse what the flag cannot take */
        const char *digits = p + (*p == '+' || *p == '-');
        if (digits == end) goto malformed;
        for (q = digits; q < end; q++)
            if (!isdigit((unsigned char)*q)) goto malformed;
        for (q = digits; q < end; q++)
            if ((x = x * 10 + (*q - '0')) > INT_MAX + 1LL) goto range;
        if (*p == '-') x = -x;
        if (x > INT_MAX) goto range;
        *out = (long)x;
        return 0;
    }
    /* NUMBER[.DIGITS]SUFFIX: vLLM's (\d+(?:\.\d+)?)([kKmMgGtT]) */
    char suffix = *--end;
    const char *frac = NULL;
    for (q = p; q < end && isdigit((unsigned char)*q); q++)
        ;
    if (q == p) goto malformed;
    if (q < end && *q == '.') {
        frac = ++q;
        while (q < end && isdigit((unsigned char)*q)) q++;
        if (q == frac) goto malformed;
    }
    if (q != end) goto malformed;
    if (frac && isupper((unsigned char)suffix)) {
        snprintf(err, errlen,
                 "decimals are only allowed with the lowercase decimal suffixes k, m, g, t "
                 "(K, M, G, T are powers of 2): did you mean %.*s%c?",
                 (int)(end - p), p, tolower((unsigned char)suffix));
        return -1;
    }
    long long mult = 1;
    switch (suffix) {
    case 'k': mult = 1000LL; break;
    case 'm': mult = 1000000LL; break;
    case 'g': mult = 1000000000LL; break;
    case 't': mult = 1000000000000LL; break;
    case 'K': mult = 1LL << 10; break;
    case 'M': mult = 1LL << 20; break;
    case 'G': mult = 1LL << 30; break;
    case 'T': mult = 1LL << 40; break;
    }
    for (q = p; q < end && *q != '.'; q++)
        if ((x = x * 10 + (*q - '0')) > INT_MAX) goto range;
    if (x > INT_MAX / mult) goto range;
    x *= mult;
    /* the fraction in integers, to the suffix's digits: 1.005k is 1005 (a
     * double makes it 1004.99...); digits below 1 are dropped, as vLLM's
     * int() drops them */
    for (long long scale = mult; frac && frac < end && scale > 1; frac++) {
        scale /= 10;
        x += (*frac - '0') * scale;
    }
    if (x > INT_MAX) goto range;
    *out = (long)x;
    return 0;
malformed:
    snprintf(err, errlen, "expected an integer, e.g. 4096, 32k (= 32000) or 32K (= 32768)");
    return -1;
range:
    snprintf(err, errlen, "out of range (at most %d)", INT_MAX);
    return -1;
}

static int range_error(const char *flag, const char *value, const char *range, char *err, size_t errlen)
{
    snprintf(err, errlen, "%s %s is out of range (%s)", flag, value, range);
    return -1;
}

int api_flag_long_range(const char *flag, long v, long lo, long hi, char *err, size_t errlen)
{
    if (v == API_FLAG_UNSET || (v >= lo && v <= hi)) return 0;
    char value[32], range[64];
    snprintf(value, sizeof value, "%ld", v);
    if (hi == LONG_MAX) snprintf(range, sizeof range, "at least %ld", lo);
    else snprintf(range, sizeof range, "%ld..%ld", lo, hi);
    return range_error(flag, value, range, err, errlen);
}

int api_flag_double_range(const char *flag, double v, double lo, bool lo_open, double hi, char *err, size_t errlen)
{
    if (isnan(v) || ((lo_open ? v > lo : v >= lo) && v <= hi)) return 0;
    char value[32], range[64];
    snprintf(value, sizeof value, "%g", v);
    if (lo_open && isinf(hi)) snprintf(range, sizeof range, "above %g", lo);
    else if (lo_open) snprintf(range, sizeof range, "above %g, at most %g", lo, hi);
    else if (isinf(hi)) snprintf(range, sizeof range, "at least %g", lo);
    else snprintf(range, sizeof range, "%g..%g", lo, hi);
    return range_error(flag, value, range, err, errlen);
}

void api_gpu_util_note(const char *who, const char *device, double util, const char *kv_cache_memory)
{
    if (isnan(util)) return;
    bool cpu = device ? !strcmp(device, "cpu") : !model_cuda_available();
    if (cpu)
        fprintf(stderr, "sluice %s: --gpu-memory-utilization: %g ignored: the model runs on the CPU, "
                        "where --kv-cache-memory sets the KV cache size\n", who, util);
    else if (kv_cache_memory)
        fprintf(stderr, "sluice %s: --gpu-memory-utilization: %g ignored: --kv-cache-memory %s sets the KV cache size\n",
                who, util, kv_cache_memory);
}

long long api_parse_bytes(const char *s)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || v < 0) return -1;
    long long mul = 1;
    switch (toupper((unsigned char)*end)) {
    case 'K': mul = 1LL << 10; end++; break;
    case 'M': mul = 1LL << 20; end++; break;
    case 'G': mul = 1LL << 30; end++; break;
    case 'T': mul = 1LL << 40; end++; break;
    default: break;
    }
    if (mul > 1 && (*end == 'i' || *end == 'I')) end++;
    if (*end == 'B' || *end == 'b') end++;
    if (*end) return -1;
    return (long long)(v * (double)mul);
}

int api_gpu_kv_bytes(int tp, double util, const char *who, size_t *bytes, char *err, size_t errlen)
{
    /* vLLM's meaning: the KV pool takes what is left of util x the GPU after
     * weights and workspace (already allocated), less a margin for cuBLAS and
     * graph memory; with tensor parallelism every GPU holds its share of
     * every block, so the GPU with the least room sets the size */
    int ngpu = tp > 1 ? tp : 1, worst = -1;
    double budget = 0, used = 0, total = 0, margin = 512.0 * 1048576.0;
    for (int g = 0; g < ngpu; g++) {
        size_t fr, tot;
        if (model_cuda_mem_info(g, &fr, &tot)) continue;
        double b = util * (double)tot - (double)(tot - fr) - margin;
        if (worst < 0 || b < budget) worst = g, budget = b, used = (double)(tot - fr), total = (double)tot;
    }
    if (worst < 0) return 1;
    if (budget < 1048576.0) {
        snprintf(err, errlen,
                 "--gpu-memory-utilization %.2f leaves no room for the KV cache: GPU %d has %.1f GiB, "
                 "weights and workspace already use %.1f GiB",
                 util, worst, total / 1073741824.0, used / 1073741824.0);
        return -1;
    }
    *bytes = (size_t)budget;
    if (who)
        fprintf(stderr, "sluice %s: KV cache %.1f GiB%s (--gpu-memory-utilization %.2f of %.1f GiB; %.1f GiB in use)\n",
                who, budget / 1073741824.0, ngpu > 1 ? " per GPU" : "", util, total / 1073741824.0,
                used / 1073741824.0);
    return 0;
}

void api_engine_defaults(const char *device, long *max_num_seqs, long *max_num_batched_tokens,
                         double *ttft_target_s)
{
    bool gpu = device ? !strcmp(device, "cuda") : model_cuda_available();
    if (isnan(*ttft_target_s)) *ttft_target_s = gpu ? SCHED_DEFAULT_TTFT_TARGET_GPU_S : SCHED_DEFAULT_TTFT_TARGET_S;
    bool ds = *max_num_seqs == 0, db = *max_num_batched_tokens == 0;
    if (ds) *max_num_seqs = gpu ? 256 : 64;
    if (db) *max_num_batched_tokens = gpu ? 8192 : 1024;
    /* a default never contradicts what was given */
    if (ds && !db && *max_num_seqs > *max_num_batched_tokens) *max_num_seqs = *max_num_batched_tokens;
    if (db && !ds && *max_num_batched_tokens < *max_num_seqs) *max_num_batched_tokens = *max_num_seqs;
}

/* ---- the scheduler's policy flags (serve and run-batch) ---- */

void api_sched_flags_init(struct api_sched_flags *f)
{
    struct sched_config c = {0};
    sched_config_policy_defaults(&c);
    f->ttft_target_ms = NAN; /* not given: api_engine_defaults picks it for the device */
    f->itl_target = "auto";
    f->min_batch_share = c.min_batch_share;
}

int api_sched_flags_apply(const struct api_sched_flags *f, struct sched_config *c, char *err, size_t errlen)
{
    if ((!isnan(f->ttft_target_ms) &&
         api_flag_double_range("--interactive-ttft-target", f->ttft_target_ms, 0, false, 1e7, err, errlen)) ||
        api_flag_double_range("--min-batch-share", f->min_batch_share, 0, false, 1, err, errlen))
        return -1;
    c->min_batch_share = (float)f->min_batch_share;
    c->ttft_target_s = isnan(f->ttft_target_ms) ? NAN : f->ttft_target_ms / 1e3;
    c->itl_target_s = 0.0;
    c->itl_auto_factor = SCHED_DEFAULT_ITL_AUTO_FACTOR;
    if (f->itl_target && strcmp(f->itl_target, "auto") != 0) {
        char *end;
        errno = 0;
        double ms = strtod(f->itl_target, &end);
        if (end == f->itl_target || *end || errno || !(ms >= 0 && ms <= 1e7)) {
            sl_seterr(err, errlen, "--interactive-itl-target: '%s' is not auto or a number of milliseconds (0..1e7)",
                      f->itl_target);
            return -1;
        }
        c->itl_target_s = ms / 1e3;
        c->itl_auto_factor = 0.0;
    }
    return 0;
}

bool api_state_line(struct sched_engine *e, char *out, size_t cap)
{
    struct sched_engine_stats st;
    sched_engine_get_stats(e, &st);
    if (st.state_bytes == 0) return false;
    double mib = st.state_bytes / 1048576.0;
    int n;
    if (st.snap_slots == 0)
        n = snprintf(out, cap,
                     "recurrent state: %.2f MiB per sequence x %d slots (%.1f MiB); prefix caching off, so no "
                     "snapshots", mib, st.state_slots, mib * st.state_slots);
    else
        n = snprintf(out, cap,
                     "recurrent state: %.2f MiB per sequence x %d slots (%.1f MiB); prefix-cache snapshots every %d "
                     "tokens (--mamba-block-size %d) and at each prompt's end: %d slots (%.1f MiB)", mib,
                     st.state_slots, mib * st.state_slots, st.snap_every, st.snap_every, st.snap_slots,
                     mib * st.snap_slots);
    /* the GPU's scratch for rolling the state back after rejected drafts, set aside before the KV pool */
    if (st.spec_state_bytes > 0 && n >= 0 && (size_t)n < cap)
        snprintf(out + n, cap - (size_t)n, "; draft rollback scratch %.1f MiB", st.spec_state_bytes / 1048576.0);
    return true;
}
