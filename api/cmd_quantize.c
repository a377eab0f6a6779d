/* cmd_quantize.c - `sluice quantize`: a checkpoint (GGUF or HF directory)
 * becomes a W4A16/W8A16 compressed-tensors checkpoint (pack-quantized,
 * symmetric round-to-nearest, no calibration data), the layout llmcompressor
 * writes for a "W4A16" recipe with its min-max observer.
 *
 * Every linear projection of the decoder layers is quantized from its weight
 * rounded to bf16 (the model dtype; model/quant.c: quant_rtn_row is the
 * library's arithmetic); the embedding, a separate lm_head (in the ignore
 * list, as the recipes leave it) and the norms are written as they are (bf16
 * matrices, f32 vectors). GGUF llama Q/K rows are stored permuted for its
 * RoPE layout: they are written back in Hugging Face order, since the output
 * is an HF checkpoint. The tokenizer files come from --tokenizer (an HF
 * directory) or from the input when it is one.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "api.h"
#include "base/json.h"
#include "model/model.h"
#include "model/quant.h"

enum okind { O_PACKED, O_SCALE, O_SHAPE, O_BF16, O_F32 };

struct otensor {
    char name[160];
    enum okind kind;
    const struct model_tensor *src;
    int64_t rows, cols;   /* matrix shape (vectors: rows = 1) */
    int perm_heads;       /* > 0: rows are GGUF-permuted Q/K rows of this many heads */
    size_t nbytes;
};

struct qjob {
    int bits, group;
    struct otensor *t;
    int n, cap;
};

static int add(struct qjob *j, const char *name, enum okind k, const struct model_tensor *src, int64_t rows,
               int64_t cols, int perm)
{
    if (j->n == j->cap) {
        int cap = j->cap ? 2 * j->cap : 64;
        struct otensor *p = realloc(j->t, (size_t)cap * sizeof *p);
        if (!p) return -1;
        j->t = p;
        j->cap = cap;
    }
    struct otensor *o = &j->t[j->n++];
    memset(o, 0, sizeof *o);
    snprintf(o->name, sizeof o->name, "%s", name);
    o->kind = k;
    o->src = src;
    o->rows = rows;
    o->cols = cols;
    o->perm_heads = perm;
    int64_t ng = (cols + j->group - 1) / j->group;
    o->nbytes = k == O_PACKED  ? (size_t)(rows * cols * j->bits / 32) * 4
                : k == O_SCALE ? (size_t)(rows * ng) * 2
                : k == O_SHAPE ? 16
                : k == O_BF16  ? (size_t)(rows * cols) * 2
                               : (size_t)(rows * cols) * 4;
    return 0;
}

static int add_linear(struct qjob *j, const char *module, const struct model_tensor *t, int perm)
{
    char n[160];
    int64_t rows = t->ne[1], cols = t->ne[0];
    snprintf(n, sizeof n, "%s.weight_packed", module);
    if (add(j, n, O_PACKED, t, rows, cols, perm)) return -1;
    snprintf(n, sizeof n, "%s.weight_scale", module);
    if (add(j, n, O_SCALE, t, rows, cols, perm)) return -1;
    snprintf(n, sizeof n, "%s.weight_shape", module);
    return add(j, n, O_SHAPE, t, rows, cols, perm);
}

/* Source row of output row r (undoing GGUF's Q/K permutation). */
static int64_t src_row(const struct otensor *o, int64_t r)
{
    if (o->perm_heads <= 0) return r;
    int64_t hd = o->rows / o->perm_heads, h = r / hd, rem = r % hd, p = rem / (hd / 2), i = rem % (hd / 2);
    return h * hd + 2 * i + p;
}

/* Writes one tensor's bytes. For O_PACKED, the scales are computed too and
 * kept in *scales for the O_SCALE entry that follows. */
static int write_tensor(FILE *f, const struct qjob *j, const struct otensor *o, uint16_t **scales)
{
    int64_t cols = o->cols, ng = (cols + j->group - 1) / j->group;
    float *row = malloc((size_t)cols * sizeof *row);
    void *buf = malloc(o->nbytes ? o->nbytes : 1);
    int rc = 0;
    if (!row || !buf) {
        rc = -1;
        goto out;
    }
    switch (o->kind) {
    case O_PACKED: {
        uint16_t *s = malloc((size_t)(o->rows * ng) * 2);
        if (!s) {
            rc = -1;
            goto out;
        }
        free(*scales);
        *scales = s;
        uint32_t *pk = buf;
        for (int64_t r = 0; r < o->rows; r++) {
            model_tensor_to_f32(o->src, src_row(o, r) * cols, cols, row);
            for (int64_t k = 0; k < cols; k++) row[k] = quant_round_bf16(row[k]);
            quant_rtn_row(row, cols, j->bits, j->group, pk + r * (cols * j->bits / 32), s + r * ng);
        }
        break;
    }
    case O_SCALE:
        memcpy(buf, *scales, o->nbytes);
        break;
    case O_SHAPE: {
        int64_t sh[2] = {o->rows, o->cols};
        memcpy(buf, sh, 16);
        break;
    }
    case O_BF16: {
        uint16_t *b = buf;
        for (int64_t r = 0; r < o->rows; r++) {
            model_tensor_to_f32(o->src, r * cols, cols, row);
            for (int64_t k = 0; k < cols; k++) {
                float x = quant_round_bf16(row[k]);
                uint32_t u;
                memcpy(&u, &x, 4);
                b[r * cols + k] = (uint16_t)(u >> 16);
            }
        }
        break;
    }
    case O_F32:
        model_tensor_to_f32(o->src, 0, cols, buf);
        break;
    }
    if (fwrite(buf, 1, o->nbytes, f) != o->nbytes) rc = -1;
out:
    free(row);
    free(buf);
    return rc;
}

static int write_config(const char *out, const model *m, const struct qjob *j, const char *scheme)
{
    const struct model_config *c = model_get_config(m);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", out);
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    char gs[16] = "null";
    if (j->group < (1 << 30)) snprintf(gs, sizeof gs, "%d", j->group);
    static const char *arch_class[] = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                       "MistralForCausalLM"};
    fprintf(f, "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n", arch_class[c->arch],
            model_arch_name(c->arch));
    fprintf(f, "  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n  \"num_hidden_layers\": %d,\n"
               "  \"num_attention_heads\": %d,\n  \"num_key_value_heads\": %d,\n  \"head_dim\": %d,\n"
               "  \"vocab_size\": %d,\n  \"max_position_embeddings\": %d,\n  \"rms_norm_eps\": %.9g,\n"
               "  \"rope_theta\": %.9g,\n  \"tie_word_embeddings\": %s,\n  \"hidden_act\": \"silu\",\n"
               "  \"torch_dtype\": \"bfloat16\",\n",
            c->n_embd, c->n_ff, c->n_layer, c->n_head, c->n_head_kv, c->head_dim, c->n_vocab, c->n_ctx_train,
            c->norm_eps, c->rope_theta, c->tie_embeddings ? "true" : "false");
    if (c->rope_llama3_factor > 0)
        fprintf(f, "  \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": %.9g, \"low_freq_factor\": %.9g, "
                   "\"high_freq_factor\": %.9g, \"original_max_position_embeddings\": %d},\n",
                c->rope_llama3_factor, c->rope_llama3_low_freq, c->rope_llama3_high_freq, c->rope_llama3_orig_ctx);
    fprintf(f, "  \"quantization_config\": {\n    \"quant_method\": \"compressed-tensors\",\n"
               "    \"format\": \"pack-quantized\",\n    \"quantization_status\": \"compressed\",\n"
               "    \"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], \"format\": \"pack-quantized\",\n"
               "      \"weights\": {\"num_bits\": %d, \"type\": \"int\", \"symmetric\": true, \"strategy\": \"%s\", "
               "\"group_size\": %s, \"dynamic\": false, \"actorder\": null, \"observer\": \"minmax\"},\n"
               "      \"input_activations\": null, \"output_activations\": null}},\n"
               "    \"ignore\": [\"lm_head\"],\n    \"sluice_scheme\": \"%s\"\n  }\n}\n",
            j->bits, j->group < (1 << 30) ? "group" : "channel", gs, scheme);
    return fclose(f);
}

static int copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb");
    if (!a) return 1; /* absent: nothing to copy */
    FILE *b = fopen(to, "wb");
    int rc = b ? 0 : -1;
    char buf[65536];
    size_t n;
    while (b && (n = fread(buf, 1, sizeof buf, a)) > 0)
        if (fwrite(buf, 1, n, b) != n) rc = -1;
    fclose(a);
    if (b && fclose(b)) rc = -1;
    return rc;
}

int api_cmd_quantize(int argc, char **argv)
{
    const char *model_path = NULL, *scheme = "w4a16-g32", *out = NULL, *tok_dir = NULL;
    const struct api_flag flags[] = {
        {"--model", API_FLAG_STR, &model_path, "GGUF file or HF checkpoint directory to quantize", NULL},
        {"--scheme", API_FLAG_STR, &scheme, "w4a16-gN / w8a16-gN (group N), w4a16 / w8a16 (per channel) (w4a16-g32)",
         NULL},
        {"--out", API_FLAG_STR, &out, "output directory (created)", NULL},
        {"--tokenizer", API_FLAG_STR, &tok_dir, "HF directory whose tokenizer files are copied (default: the input's)",
         NULL},
        {0},
    };
    int flags_rc;
    const char *pos[1];
    int np = api_cmd_flags("quantize", "usage: sluice quantize --model IN --scheme w4a16-g32 --out DIR\n\n", argc,
                           argv, 2, flags, pos, 1, &flags_rc);
    if (np < 0) return flags_rc;
    if (np == 1 && !model_path) model_path = pos[0];
    struct qjob j = {0};
    int g = 0;
    char tail[8] = "";
    if (!model_path || !out) {
        fprintf(stderr, "sluice quantize: --model and --out are required\n");
        return 2;
    }
    if ((sscanf(scheme, "w%da16-g%d%7s", &j.bits, &g, tail) == 2 && g > 0) ||
        (sscanf(scheme, "w%da16%7s", &j.bits, tail) == 1 && (g = 0) == 0)) {
        if (j.bits != 4 && j.bits != 8) j.bits = 0;
    } else {
        j.bits = 0;
    }
    if (!j.bits) {
        fprintf(stderr, "sluice quantize: unknown scheme '%s' (w4a16-gN, w8a16-gN, w4a16, w8a16)\n", scheme);
        return 2;
    }
    char err[512];
    struct model_load_opts lo = {0};
    model *m = model_load(model_path, &lo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "sluice quantize: %s\n", err);
        return 1;
    }
    const struct model_config *c = model_get_config(m);
    const struct model_weights *w = model_get_weights(m);
    j.group = g > 0 ? g : (1 << 30);
    int rc = 1;
    FILE *f = NULL;
    uint16_t *scales = NULL;
    /* every quantized matrix must split into whole groups of whole 32-bit words */
    int64_t ins[2] = {c->n_embd, c->n_ff};
    if ((int64_t)c->n_head * c->head_dim % (g > 0 ? g : 1) || ins[0] % (g > 0 ? g : 1) || ins[1] % (g > 0 ? g : 1) ||
        ins[0] * j.bits % 32 || ins[1] * j.bits % 32) {
        fprintf(stderr, "sluice quantize: group %d does not divide the input dimensions (%d, %d, %d)\n", g, c->n_embd,
                c->n_ff, c->n_head * c->head_dim);
        goto done;
    }
    bool gguf_perm = c->rope_type == MODEL_ROPE_NORM;
    if (add(&j, "model.embed_tokens.weight", O_BF16, &w->tok_embd, c->n_vocab, c->n_embd, 0) ||
        add(&j, "model.norm.weight", O_F32, &w->out_norm, 1, c->n_embd, 0) ||
        (!c->tie_embeddings && add(&j, "lm_head.weight", O_BF16, &w->lm_head, c->n_vocab, c->n_embd, 0)))
        goto oom;
    for (int l = 0; l < c->n_layer; l++) {
        const struct model_layer_weights *L = &w->layers[l];
        char p[128], n[160];
        snprintf(p, sizeof p, "model.layers.%d", l);
#define LIN(t, sub, perm)                                                                                    \
    do {                                                                                                     \
        snprintf(n, sizeof n, "%s.%s", p, sub);                                                              \
        if (add_linear(&j, n, &L->t, perm)) goto oom;                                                        \
    } while (0)
#define VEC(t, sub)                                                                                          \
    do {                                                                                                     \
        snprintf(n, sizeof n, "%s.%s", p, sub);                                                              \
        if (L->t.data && add(&j, n, O_F32, &L->t, 1, model_tensor_nelem(&L->t), 0)) goto oom;               \
    } while (0)
        VEC(attn_norm, "input_layernorm.weight");
        VEC(ffn_norm, "post_attention_layernorm.weight");
        VEC(bq, "self_attn.q_proj.bias");
        VEC(bk, "self_attn.k_proj.bias");
        VEC(bv, "self_attn.v_proj.bias");
        VEC(q_norm, "self_attn.q_norm.weight");
        VEC(k_norm, "self_attn.k_norm.weight");
        LIN(wq, "self_attn.q_proj", gguf_perm ? c->n_head : 0);
        LIN(wk, "self_attn.k_proj", gguf_perm ? c->n_head_kv : 0);
        LIN(wv, "self_attn.v_proj", 0);
        LIN(wo, "self_attn.o_proj", 0);
        LIN(w_gate, "mlp.gate_proj", 0);
        LIN(w_up, "mlp.up_proj", 0);
        LIN(w_down, "mlp.down_proj", 0);
#undef LIN
#undef VEC
    }
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "sluice quantize: %s: %s\n", out, strerror(errno));
        goto done;
    }
    /* the safetensors header */
    struct json_buf h;
    json_buf_init(&h);
    json_buf_lit(&h, "{\"__metadata__\":{\"format\":\"pt\"}");
    size_t off = 0;
    for (int i = 0; i < j.n; i++) {
        const struct otensor *o = &j.t[i];
        int64_t ng = (o->cols + j.group - 1) / j.group;
        json_buf_lit(&h, ",");
        json_buf_add_str(&h, o->name, strlen(o->name));
        switch (o->kind) {
        case O_PACKED:
            json_buf_addf(&h, ":{\"dtype\":\"I32\",\"shape\":[%lld,%lld]", (long long)o->rows,
                          (long long)(o->cols * j.bits / 32));
            break;
        case O_SCALE:
            json_buf_addf(&h, ":{\"dtype\":\"BF16\",\"shape\":[%lld,%lld]", (long long)o->rows, (long long)ng);
            break;
        case O_SHAPE: json_buf_addf(&h, ":{\"dtype\":\"I64\",\"shape\":[2]"); break;
        case O_BF16:
            json_buf_addf(&h, ":{\"dtype\":\"BF16\",\"shape\":[%lld,%lld]", (long long)o->rows, (long long)o->cols);
            break;
        case O_F32: json_buf_addf(&h, ":{\"dtype\":\"F32\",\"shape\":[%lld]", (long long)o->cols); break;
        }
        json_buf_addf(&h, ",\"data_offsets\":[%zu,%zu]}", off, off + o->nbytes);
        off += o->nbytes;
    }
    json_buf_lit(&h, "}");
    while (h.len % 8) json_buf_lit(&h, " ");
    if (h.oom) {
        json_buf_free(&h);
        goto oom;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    f = fopen(path, "wb");
    uint64_t hl = h.len;
    if (!f || fwrite(&hl, 8, 1, f) != 1 || fwrite(h.p, 1, h.len, f) != h.len) {
        fprintf(stderr, "sluice quantize: cannot write %s\n", path);
        json_buf_free(&h);
        goto done;
    }
    json_buf_free(&h);
    for (int i = 0; i < j.n; i++)
        if (write_tensor(f, &j, &j.t[i], &scales)) {
            fprintf(stderr, "sluice quantize: writing %s failed\n", j.t[i].name);
            goto done;
        }
    if (fclose(f)) {
        f = NULL;
        fprintf(stderr, "sluice quantize: cannot write %s\n", path);
        goto done;
    }
    f = NULL;
    if (write_config(out, m, &j, scheme)) {
        fprintf(stderr, "sluice quantize: cannot write %s/config.json\n", out);
        goto done;
    }
    struct stat st;
    const char *td = tok_dir ? tok_dir : (stat(model_path, &st) == 0 && S_ISDIR(st.st_mode) ? model_path : NULL);
    bool have_tok = false;
    if (td) {
        const char *files[] = {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                               "chat_template.jinja", "special_tokens_map.json"};
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
            char a[4096], b[4096];
            snprintf(a, sizeof a, "%s/%s", td, files[i]);
            snprintf(b, sizeof b, "%s/%s", out, files[i]);
            int cr = copy_file(a, b);
            if (cr < 0) {
                fprintf(stderr, "sluice quantize: cannot copy %s\n", a);
                goto done;
            }
            if (cr == 0 && i == 0) have_tok = true;
        }
    }
    printf("%s: %d tensors, %.1f MB, scheme %s%s\n", out, j.n, off / 1e6, scheme,
           have_tok ? "" : " (no tokenizer.json: load it with --tokenizer pointing at the input)");
    rc = 0;
    goto done;
oom:
    fprintf(stderr, "sluice quantize: out of memory\n");
done:
    if (f) fclose(f);
    free(scales);
    free(j.t);
    model_free(m);
    return rc;
}
