/* api.h - the front doors of sluice: the CLI subcommands (and, later, the
 * HTTP server). main.c dispatches argv[1] to one of the api_cmd_* functions.
 *
 * Flags are parsed by a table (struct api_flag) so every subcommand accepts
 * --name value and --name=value, reports an unknown flag by name, and prints
 * the same kind of --help. Everything here runs on the main thread.
 */
#ifndef SLUICE_API_H
#define SLUICE_API_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>

/* API_FLAG_HUMAN_INT is vLLM's human_readable_int (api_parse_human_int),
 * for token counts such as --max-model-len 32k. */
/* API_FLAG_STRS takes one or more values (argparse's nargs="+"): the
 * arguments after the flag up to the next one that starts with '-', at most
 * API_FLAG_MAX_STRS (vLLM's --served-model-name a b). */
enum api_flag_kind { API_FLAG_STR, API_FLAG_INT, API_FLAG_FLOAT, API_FLAG_BOOL, API_FLAG_HUMAN_INT, API_FLAG_STRS };

#define API_FLAG_MAX_STRS 8
struct api_flag_strs {
    int n;
    const char *v[API_FLAG_MAX_STRS + 1]; /* v[n] is NULL */
};

struct api_flag {
    const char *name;          /* "--max-tokens" */
    enum api_flag_kind kind;
    void *dst;                 /* const char **, long * (INT, HUMAN_INT), double *, bool *, or struct api_flag_strs * */
    const char *help;
    const char *neg;           /* optional "--no-..." name that sets a bool false */
};

/* No integer flag ever parses to this value, so a long preset to it before
 * parsing tells "not given" from any value given, 0 included. (A double
 * preset to NAN does the same: a FLOAT flag is always finite.) */
#define API_FLAG_UNSET LONG_MIN

/* Parses argv[first..argc) against flags (terminated by a zeroed entry).
 * Non-flag arguments go to positional[] (at most max_pos; more is an error).
 * Returns the number of positionals, or -1 with a message in err naming the
 * unknown flag / bad value. "--help"/"-h" returns -2. */
int api_parse_flags(int argc, char **argv, int first, const struct api_flag *flags,
                    const char **positional, int max_pos, char *err, size_t errlen);
void api_print_flags(const struct api_flag *flags);
/* api_parse_flags for a subcommand: on --help prints usage then the flag
 * table, on a bad flag "sluice NAME: message", both to stderr. Returns the
 * number of positionals, or -1 when the command should end now with
 * *exit_code (0 after --help, 2 after an error). */
int api_cmd_flags(const char *name, const char *usage, int argc, char **argv, int first, const struct api_flag *flags,
                  const char **positional, int max_pos, int *exit_code);
/* vLLM's human_readable_int: a plain integer, or a number with one suffix:
 * k m g t are powers of 10 and take decimals ("25.6k" = 25600; a fraction
 * left below 1 is dropped, as vLLM's int() does), K M G T powers of 2 and
 * take none ("32K" = 32768). 0 with *out set; -1 with the reason in err (not
 * naming a flag) when malformed or outside the range of an int. */
int api_parse_human_int(const char *s, long *out, char *err, size_t errlen);
/* Range checks after parsing, naming the flag as the user gave it: 0 when
 * lo <= v <= hi (or v is API_FLAG_UNSET / NAN: not given), else -1 with
 * "--port 99999 is out of range (1..65535)" in err. hi LONG_MAX or INFINITY:
 * no upper bound; lo_open: lo itself is out of range too. */
int api_flag_long_range(const char *flag, long v, long lo, long hi, char *err, size_t errlen);
int api_flag_double_range(const char *flag, double v, double lo, bool lo_open, double hi, char *err, size_t errlen);
/* The one-line notice (as api_vllm_compat's) that --gpu-memory-utilization
 * has no effect: given (util not NAN) while the model runs on the CPU
 * (device "cpu", or NULL without a GPU), or with --kv-cache-memory (which
 * sets the KV cache size instead). WHO: "serve", "run-batch". */
void api_gpu_util_note(const char *who, const char *device, double util, const char *kv_cache_memory);
/* A size such as 2G, 512M, 64KiB or 1073741824 in bytes; -1 when malformed. */
long long api_parse_bytes(const char *s);
/* The KV cache budget of the GPU backend from --gpu-memory-utilization util
 * (vLLM's meaning): util x the memory of the GPU with the least room (of
 * GPUs 0 .. tp-1), less what weights and workspace already use, less a 512
 * MiB margin. Call after the backend exists. 0: *bytes set and, unless who
 * is NULL, one line on stderr ("sluice WHO: KV cache ..."); -1: nothing left
 * (message in err);
 * 1: no GPU answered (the caller keeps its default). */
int api_gpu_kv_bytes(int tp, double util, const char *who, size_t *bytes, char *err, size_t errlen);
/* The start-up line of a model with recurrent (linear-attention) layers: the
 * state per sequence, its slots, and the prefix cache's snapshots (their
 * spacing and memory), or that there are none. Returns false (nothing
 * written) for a model without such layers. */
struct sched_engine;
bool api_state_line(struct sched_engine *e, char *out, size_t cap);
/* vLLM's engine sizes for where the model will run, filling only values left
 * 0: on GPUs (device "cuda", or NULL with a GPU present) 256 sequences and
 * 8192 tokens per step, on the CPU 64 and 1024; a default is lowered or
 * raised so that it never contradicts the other value when that was given.
 * The TTFT target, where --interactive-ttft-target was not given (NaN): 50
 * ms on GPUs, 200 ms on the CPU (sched.h says why). */
void api_engine_defaults(const char *device, long *max_num_seqs, long *max_num_batched_tokens,
                         double *ttft_target_s);

/* The scheduler's policy flags, the same in serve and run-batch
 * (flags.c). Start from api_sched_flags_init (sched_config_policy_defaults'
 * values), put API_SCHED_FLAGS(&f) into the command's flag table, then
 * api_sched_flags_apply: -1 with a message naming the flag when a value is
 * out of range, else 0 with the targets written into *c. */
struct sched_config;
struct api_sched_flags {
    double ttft_target_ms, min_batch_share;
    const char *itl_target; /* "auto" or milliseconds */
};
void api_sched_flags_init(struct api_sched_flags *f);
int api_sched_flags_apply(const struct api_sched_flags *f, struct sched_config *c, char *err, size_t errlen);
#define API_SCHED_FLAGS(f)                                                                                          \
    {"--interactive-ttft-target", API_FLAG_FLOAT, &(f)->ttft_target_ms,                                         \
     "ms: a chat's first token within this beside batch work; steps leave it room (50 on a GPU, 200 on "     \
     "the CPU; 0: off)", NULL},      \
    {"--interactive-itl-target", API_FLAG_STR, &(f)->itl_target,                                                \
     "ms, or auto: twice a step of the chats alone; while chats stream a step is planned within it, batch "     \
     "fills the rest (auto; 0: off)", NULL},                                                                   \
    {"--min-batch-share", API_FLAG_FLOAT, &(f)->min_batch_share,                                                \
     "share of each step (tokens, and time under the targets) kept for batch work when it waits (0.1)", NULL}

/* vLLM flags accepted for compatibility (api/compat.c); NULL/false = not given. */
struct api_vllm_flags {
    const char *compilation_config, *speculative_config, *hf_overrides;
    const char *dtype, *swap_space, *seed;
    const char *uvicorn_log_level, *max_logprobs;
    const char *scheduling_policy;
    bool enforce_eager, disable_log_requests, disable_log_stats, disable_uvicorn_access_log;
    bool enable_chunked_prefill; /* set it true before parsing: false = --no-enable-chunked-prefill */
};
/* Validates the JSON-valued flags (-1 with a message naming the flag when
 * malformed) and prints one line per part sluice ignores, saying why.
 * *eager: whether CUDA graphs are off (--enforce-eager, or
 * --compilation-config's cudagraph_mode NONE). */
struct sched_spec_config;
int api_vllm_compat(const struct api_vllm_flags *f, bool *eager, struct sched_spec_config *spec, char *err,
                    size_t errlen);
/* vLLM's --speculative-config JSON into *c: method "ngram" (num_speculative_tokens
 * required, prompt_lookup_min/max default 5, either one the other when only one
 * is given) or "mtp" (num_speculative_tokens default 1, the MTP layers' count
 * in the models that have them; draft_sample_method greedy). Keys and methods
 * sluice does not implement are reported on stderr in one line each ("sluice
 * WHO: ..."); a method it does not implement leaves c->method SCHED_SPEC_NONE.
 * -1 with a message naming the flag when malformed or out of range. */
int api_speculative_config(const char *json, const char *who, struct sched_spec_config *c, char *err, size_t errlen);
/* What of c the loaded model m cannot take, reported on stderr ("sluice
 * WHO: ...") and turned off, so a command line written for vLLM still
 * serves: method mtp on a model with linear-attention (KDA) layers (no
 * reference models their MTP layer; method ngram drafts there) leaves
 * c->method SCHED_SPEC_NONE. Anything else stays for the engine to check. */
struct model;
void api_speculative_fit(const struct model *m, const char *who, struct sched_spec_config *c);
/* --max-num-partial-prefills N (>= 1) and --max-long-partial-prefills M (1..N),
 * as vLLM checks them: 0, or -1 with a message naming the flag. */
int api_partial_prefill_flags(long n, long m, char *err, size_t errlen);

int api_cmd_serve(int argc, char **argv);
/* api_cmd_serve's status after the backend failed for good (store closed):
 * main exits at once, without an orderly GPU teardown that could hang. */
#define SLUICE_VERSION "0.1.0"
#define API_EXIT_NOW 3
int api_cmd_generate(int argc, char **argv);
int api_cmd_tokenize(int argc, char **argv);
int api_cmd_info(int argc, char **argv);
/* `sluice quantize`: a W4A16/W8A16 compressed-tensors copy of a model (api/cmd_quantize.c). */
int api_cmd_quantize(int argc, char **argv);
int api_cmd_run_batch(int argc, char **argv);
int api_cmd_template(int argc, char **argv);
/* `sluice batch submit|status|list|cancel|results`: the Batch API client. */
int api_cmd_batch(int argc, char **argv);
/* `sluice bench`: cache-bust / cache-hit (and --concurrency load) benchmark of
 * any OpenAI-compatible server. Returns the process exit status: 0, 1 when
 * the benchmark failed (message on stderr), 2 on bad flags. */
int api_cmd_bench(int argc, char **argv);

#endif
