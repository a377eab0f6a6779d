/* json_mask_bench.c - what a guide's vocabulary mask costs per sampled token
 * (sched/guide.c, schema.c, regex.c): JSON mode, a JSON schema as pydantic
 * writes it, a regex and a GBNF grammar, each in a few states, on the
 * default model's 49,152-token vocabulary and on one of ~150K tokens (the
 * size of Qwen's, 151,936): the distinct tokens of the byte-level BPE
 * vocabularies in tests/data (deepseek-llm, starcoder, falcon, gpt-2, mpt)
 * and the default model's, 146,418 of them. For each state: the first mask (computed: what a state never seen before costs; the least of
 * 7) and the mean of 100 lookups once it is cached; beside the regex, what
 * pcre2's partial matching per token would cost instead. Not a test.
 *   make bench    (or: make build/json_mask_bench && build/json_mask_bench)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "base/json.h"
#include "model/gguf.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "sched/sched.h"

#define BIG_VOCAB 151936

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void w_u32(FILE *f, uint32_t v) { fwrite(&v, 4, 1, f); }
static void w_u64(FILE *f, uint64_t v) { fwrite(&v, 8, 1, f); }
static void w_str(FILE *f, const char *s, size_t n)
{
    w_u64(f, n);
    fwrite(s, 1, n, f);
}

/* A tokenizer-only GGUF at path holding the distinct tokens of the given
 * vocabularies, up to BIG_VOCAB (no merges: only the pieces matter here). */
static int write_big_vocab(const char *path, const char *const *srcs, int n_src)
{
    char err[256];
    size_t cap = BIG_VOCAB, n = 0;
    struct gguf_str *tok = malloc(cap * sizeof *tok);
    gguf_file *g[8] = {0};
    /* a simple open-addressing set of the pieces taken */
    size_t hcap = 1 << 19;
    int32_t *set = malloc(hcap * sizeof *set);
    if (!tok || !set) return -1;
    memset(set, -1, hcap * sizeof *set);
    for (int s = 0; s < n_src && n < cap; s++) {
        if (!(g[s] = gguf_open(srcs[s], err, sizeof err))) {
            fprintf(stderr, "json_mask_bench: %s: %s\n", srcs[s], err);
            continue;
        }
        struct gguf_array a;
        if (gguf_get_arr(g[s], "tokenizer.ggml.tokens", &a)) continue;
        for (uint64_t i = 0; i < a.n && n < cap; i++) {
            struct gguf_str t = gguf_array_str(g[s], &a, i);
            uint64_t h = 1469598103934665603ULL;
            for (size_t k = 0; k < t.len; k++) h = (h ^ (uint8_t)t.p[k]) * 1099511628211ULL;
            size_t slot = h & (hcap - 1);
            bool dup = false;
            while (set[slot] >= 0) {
                struct gguf_str *o = &tok[set[slot]];
                if (o->len == t.len && !memcmp(o->p, t.p, t.len)) {
                    dup = true;
                    break;
                }
                slot = (slot + 1) & (hcap - 1);
            }
            if (dup || !t.len) continue;
            set[slot] = (int32_t)n;
            tok[n++] = t;
        }
    }
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    fwrite("GGUF", 1, 4, f);
    w_u32(f, 3);
    w_u64(f, 0);
    w_u64(f, 5);
    static const char *const kv[][2] = {{"general.architecture", "llama"}, {"tokenizer.ggml.model", "gpt2"},
                                       {"tokenizer.ggml.pre", "gpt-2"}};
    for (int i = 0; i < 3; i++) {
        w_str(f, kv[i][0], strlen(kv[i][0]));
        w_u32(f, 8);
        w_str(f, kv[i][1], strlen(kv[i][1]));
    }
    w_str(f, "tokenizer.ggml.tokens", 21);
    w_u32(f, 9), w_u32(f, 8), w_u64(f, n);
    for (size_t i = 0; i < n; i++) w_str(f, tok[i].p, tok[i].len);
    w_str(f, "tokenizer.ggml.merges", 21);
    w_u32(f, 9), w_u32(f, 8), w_u64(f, 0);
    fclose(f);
    for (int s = 0; s < n_src; s++) gguf_close(g[s]);
    free(tok);
    free(set);
    return 0;
}

/* One state: the guide g after feeding prefix. The computed figure is the
 * least of 7 masks each made in a fresh cache (a busy machine's stalls land
 * in single samples); the cached one is the mean of 100 lookups after. */
static void bench_state(const char *what, struct sched_guide *g, const char *prefix, const model_tok *tok,
                        uint8_t *allow, int V)
{
    for (const char *p = prefix; *p; p++)
        if (!sched_guide_step(g, (uint8_t)*p)) {
            printf("  %-44s the prefix is refused at '%s'\n", what, p);
            return;
        }
    int32_t stop = 0;
    double best = 1e9, cached = 0;
    for (int rep = 0; rep < 7; rep++) {
        struct sched_guide_vocab *gv = sched_guide_vocab_create(tok);
        if (!gv) exit(1);
        double t0 = now_s();
        sched_guide_mask(g, gv, &stop, 1, allow);
        double t1 = now_s();
        if (t1 - t0 < best) best = t1 - t0;
        if (rep == 6) {
            for (int r = 0; r < 100; r++) sched_guide_mask(g, gv, &stop, 1, allow);
            cached = (now_s() - t1) / 100;
        }
        sched_guide_vocab_destroy(gv);
    }
    int n = 0;
    for (int i = 0; i < V; i++) n += allow[i];
    printf("  %-44s computed %7.3f ms, cached %.4f ms, %6d tokens allowed\n", what, best * 1e3, cached * 1e3, n);
}

/* The alternative regex.c replaced: pcre2 (JIT) partial matching of the
 * output so far plus each token, for every token of the vocabulary. */
static void bench_pcre2(const char *re, const char *prefix, const model_tok *tok)
{
    char anchored[256];
    int ec;
    PCRE2_SIZE eo;
    snprintf(anchored, sizeof anchored, "\\A(?:%s)\\z", re);
    pcre2_code *code = pcre2_compile((PCRE2_SPTR)anchored, PCRE2_ZERO_TERMINATED, 0, &ec, &eo, NULL);
    if (!code) return;
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE | PCRE2_JIT_PARTIAL_HARD);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(code, NULL);
    int V = model_tok_n_vocab(tok), n = 0;
    size_t pl = strlen(prefix);
    char buf[1024];
    memcpy(buf, prefix, pl);
    double t0 = now_s();
    for (int t = 0; t < V; t++) {
        size_t len = 0;
        const char *b = model_tok_bytes(tok, t, &len);
        if (!b || !len || len > sizeof buf - pl || model_tok_attr(tok, t) != MODEL_TOK_NORMAL) continue;
        memcpy(buf + pl, b, len);
        int rc = pcre2_match(code, (PCRE2_SPTR)buf, pl + len, 0, PCRE2_PARTIAL_HARD, md, NULL);
        n += rc >= 0 || rc == PCRE2_ERROR_PARTIAL;
    }
    printf("  %-44s computed %7.3f ms, %6d tokens allowed\n", "regex: in the suffix, pcre2 JIT partial", (now_s() - t0) * 1e3,
           n);
    pcre2_match_data_free(md);
    pcre2_code_free(code);
}

static struct sched_schema *schema_of(const char *text)
{
    json_doc d;
    char err[256];
    struct sched_schema *sc = NULL;
    if (!json_parse(&d, text, strlen(text), err, sizeof err)) {
        sc = sched_schema_compile(&d, 0, false, err, sizeof err);
        json_free(&d);
    }
    if (!sc) fprintf(stderr, "json_mask_bench: schema: %s\n", err);
    return sc;
}

static void bench_vocab(const char *name, const model_tok *tok)
{
    int V = model_tok_n_vocab(tok);
    uint8_t *allow = malloc((size_t)V);
    if (!allow) {
        fprintf(stderr, "json_mask_bench: out of memory\n");
        exit(1);
    }
    printf("%s: %d-token vocabulary\n", name, V);
    static const char *const json_states[] = {"", "{\"a\":\"some text", "{\"a\":1", "{\"a\":"};
    for (int k = 0; k < 4; k++) {
        struct sched_guide g;
        char what[64];
        sched_guide_init(&g);
        snprintf(what, sizeof what, "json_object after '%s'", json_states[k]);
        bench_state(what, &g, json_states[k], tok, allow, V);
    }
    /* a pydantic model: $defs/$ref, Optional, bounds, lengths, formats */
    struct sched_schema *sc = schema_of(
        "{\"$defs\":{\"Pet\":{\"properties\":{\"kind\":{\"enum\":[\"cat\",\"dog\"]},\"name\":{\"type\":\"string\","
        "\"maxLength\":12}},\"required\":[\"kind\",\"name\"],\"type\":\"object\"}},\"properties\":{\"name\":{\"type\":"
        "\"string\",\"maxLength\":16},\"age\":{\"type\":\"integer\",\"minimum\":18,\"maximum\":99},\"id\":{\"type\":"
        "\"string\",\"format\":\"uuid\"},\"nick\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]},\"pets\":"
        "{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/Pet\"}}},\"required\":[\"name\",\"age\",\"id\",\"nick\",\"pets\"],"
        "\"type\":\"object\"}");
    static const char *const schema_states[][2] = {
        {"schema: first key", "{"},
        {"schema: in a maxLength string", "{\"name\":\"Al"},
        {"schema: in a bounded integer", "{\"name\":\"Al\",\"age\":4"},
        {"schema: in a uuid", "{\"name\":\"Al\",\"age\":42,\"id\":\"12ab"},
        {"schema: Optional (anyOf string, null)", "{\"name\":\"Al\",\"age\":42,\"id\":\"123e4567-e89b-12d3-a456-"
                                                  "426614174000\",\"nick\":"},
        {"schema: in an unbounded string", "{\"name\":\"Al\",\"age\":42,\"id\":\"123e4567-e89b-12d3-a456-"
                                           "426614174000\",\"nick\":\"some"},
    };
    for (int k = 0; sc && k < 6; k++) {
        struct sched_guide g;
        sched_guide_init_schema(&g, sc);
        bench_state(schema_states[k][0], &g, schema_states[k][1], tok, allow, V);
    }
    sched_schema_free(sc);
    char err[256];
    const char *re = "[A-Z]{3}-\\d{2,4}(-[a-z]+)?";
    struct sched_schema *rx = sched_schema_from_regex(re, strlen(re), err, sizeof err);
    static const char *const rx_states[][2] = {{"regex: start", ""}, {"regex: after ABC-12", "ABC-12"},
                                                {"regex: in the suffix", "ABC-12-ab"}};
    for (int k = 0; rx && k < 3; k++) {
        struct sched_guide g;
        sched_guide_init_schema(&g, rx);
        bench_state(rx_states[k][0], &g, rx_states[k][1], tok, allow, V);
    }
    sched_schema_free(rx);
    bench_pcre2(re, "ABC-12-ab", tok);
    const char *gb = "root ::= \"(\" num (\",\" ws num)* \")\"\nnum ::= \"-\"? [1-9] [0-9]{0,2}\nws ::= \" \"?\n";
    struct sched_schema *gr = sched_schema_from_grammar(gb, strlen(gb), err, sizeof err);
    static const char *const gr_states[][2] = {{"grammar: start", ""}, {"grammar: after (12, 3", "(12, 3"}};
    for (int k = 0; gr && k < 2; k++) {
        struct sched_guide g;
        sched_guide_init_schema(&g, gr);
        bench_state(gr_states[k][0], &g, gr_states[k][1], tok, allow, V);
    }
    sched_schema_free(gr);
    free(allow);
}

int main(void)
{
    char err[256];
    struct model_load_opts lo = {0};
    const char *smol = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    model *m = model_load(smol, &lo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "json_mask_bench: %s\n", err);
        return 1;
    }
    bench_vocab("default model", model_get_tok(m));
    model_free(m);

    char path[] = "/tmp/sluice_mask_bench_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return 1;
    close(fd);
    const char *srcs[] = {TEST_VOCAB_DIR "/ggml-vocab-deepseek-llm.gguf", smol,
                          TEST_VOCAB_DIR "/ggml-vocab-starcoder.gguf", TEST_VOCAB_DIR "/ggml-vocab-falcon.gguf",
                          TEST_VOCAB_DIR "/ggml-vocab-gpt-2.gguf", TEST_VOCAB_DIR "/ggml-vocab-mpt.gguf"};
    if (write_big_vocab(path, srcs, 6) == 0) {
        gguf_file *f = gguf_open(path, err, sizeof err);
        model_tok *t = f ? model_tok_from_gguf(f, err, sizeof err) : NULL;
        if (t) bench_vocab("merged BPE vocabularies", t);
        else fprintf(stderr, "json_mask_bench: the merged vocabulary: %s\n", err);
        model_tok_free(t);
        gguf_close(f);
    }
    unlink(path);
    return 0;
}
