/* cmd_template.c - `sluice template`: renders a conversation with a chat
 * template and prints the prompt exactly (no newline added), the text
 * `sluice serve` would tokenize for the same chat request.
 *
 *   sluice template (--model M | --chat-template FILE) --messages FILE.json
 *                   [--tools FILE.json] [--add-generation-prompt] [--kwargs JSON]
 *
 * --messages holds a JSON array of messages, or a whole chat request body
 * (an object with "messages", "tools", "chat_template_kwargs", ...); the
 * other flags override what the body says.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "base/json.h"
#include "model/model.h"
#include "openai.h"

static char *slurp(const char *path, size_t *len)
{
    FILE *f = !strcmp(path, "-") ? stdin : fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *p = malloc(cap);
    while (p) {
        if (n + 4096 > cap) {
            char *q = realloc(p, cap *= 2);
            if (!q) {
                free(p);
                p = NULL;
                break;
            }
            p = q;
        }
        size_t r = fread(p + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0) break;
    }
    if (f != stdin) fclose(f);
    if (p) {
        p[n] = 0;
        *len = n;
    }
    return p;
}

/* Appends the members of the object at i (no braces) after a comma, skipping
 * keys in skip. */
static void add_members(struct json_buf *b, const json_doc *d, int i, const char *const *skip)
{
    int n = json_size(d, i);
    for (int k = 0, p = i + 1; k < n; k++, p = json_skip(d, p + 1)) {
        bool skipped = false;
        for (int s = 0; skip && skip[s]; s++) skipped |= json_str_eq(d, p, skip[s]);
        if (skipped) continue;
        size_t kl, vl;
        const char *key = json_raw(d, p, &kl), *val = json_raw(d, p + 1, &vl);
        json_buf_lit(b, ",\"");
        json_buf_add(b, key, kl);
        json_buf_lit(b, "\":");
        if (json_is_str(d, p + 1)) json_buf_lit(b, "\"");
        json_buf_add(b, val, vl);
        if (json_is_str(d, p + 1)) json_buf_lit(b, "\"");
    }
}

int api_cmd_template(int argc, char **argv)
{
    const char *model_path = NULL, *tmpl_path = NULL, *msgs_path = NULL, *tools_path = NULL, *kwargs = NULL;
    bool agp = false;
    const struct api_flag flags[] = {
        {"--model", API_FLAG_STR, &model_path, "GGUF file or HF checkpoint directory: its chat template", NULL},
        {"--chat-template", API_FLAG_STR, &tmpl_path, "Jinja template file (overrides the model's)", NULL},
        {"--messages", API_FLAG_STR, &msgs_path, "JSON file: an array of messages or a chat request body ('-': stdin)", NULL},
        {"--tools", API_FLAG_STR, &tools_path, "JSON file: an array of tool definitions", NULL},
        {"--add-generation-prompt", API_FLAG_BOOL, &agp, "end with the assistant turn's opening", NULL},
        {"--kwargs", API_FLAG_STR, &kwargs, "JSON object of extra template variables (chat_template_kwargs)", NULL},
        {0},
    };
    char err[512];
    const char *pos[1];
    int flags_rc;
    int np = api_cmd_flags("template", "usage: sluice template (--model M | --chat-template FILE) --messages FILE.json [flags]\n"
                      "  Prints the prompt a chat renders to, exactly as the model's chat template writes it.\n\n", argc, argv, 2, flags, pos, 1, &flags_rc);
    if (np < 0) return flags_rc;
    if (np == 1 && !model_path) model_path = pos[0];
    if ((!model_path && !tmpl_path) || !msgs_path) {
        fprintf(stderr, "sluice template: --messages and one of --model / --chat-template are required\n");
        return 2;
    }
    int rc = 1;
    model *m = NULL;
    char *msgs = NULL, *tools = NULL, *prompt = NULL;
    json_doc md = {0}, bd = {0}, kd = {0};
    struct json_buf body;
    json_buf_init(&body);
    if (model_path) {
        struct model_load_opts lo = {0};
        m = model_load(model_path, &lo, err, sizeof err);
        if (!m) {
            fprintf(stderr, "sluice template: cannot load %s: %s\n", model_path, err);
            goto out;
        }
    }
    if (api_chat_setup(m, tmpl_path, err, sizeof err)) {
        fprintf(stderr, "sluice template: %s\n", err);
        goto out;
    }
    size_t ml, tl = 0;
    msgs = slurp(msgs_path, &ml);
    if (!msgs) {
        fprintf(stderr, "sluice template: cannot read %s\n", msgs_path);
        goto out;
    }
    if (json_parse(&md, msgs, ml, err, sizeof err)) {
        fprintf(stderr, "sluice template: %s: %s\n", msgs_path, err);
        goto out;
    }
    /* the request body the server would get */
    static const char *const ours[] = {"messages", "tools", "add_generation_prompt", "chat_template_kwargs", NULL};
    json_buf_lit(&body, "{\"messages\":");
    int mi = json_is_obj(&md, 0) ? json_get(&md, 0, "messages") : 0;
    size_t rl;
    const char *raw = mi >= 0 ? json_raw(&md, mi, &rl) : "null";
    if (mi < 0) rl = 4;
    json_buf_add(&body, raw, rl);
    if (tools_path) {
        tools = slurp(tools_path, &tl);
        if (!tools) {
            fprintf(stderr, "sluice template: cannot read %s\n", tools_path);
            goto out;
        }
        json_buf_lit(&body, ",\"tools\":");
        json_buf_add(&body, tools, tl);
    } else if (json_is_obj(&md, 0) && json_get(&md, 0, "tools") >= 0) {
        raw = json_raw(&md, json_get(&md, 0, "tools"), &rl);
        json_buf_lit(&body, ",\"tools\":");
        json_buf_add(&body, raw, rl);
    }
    bool body_agp = false;
    if (json_is_obj(&md, 0) && json_get(&md, 0, "add_generation_prompt") >= 0)
        json_bool(&md, json_get(&md, 0, "add_generation_prompt"), &body_agp);
    json_buf_addf(&body, ",\"add_generation_prompt\":%s", agp || body_agp ? "true" : "false");
    if (json_is_obj(&md, 0)) add_members(&body, &md, 0, ours);
    if (kwargs) {
        if (json_parse(&kd, kwargs, strlen(kwargs), err, sizeof err) || !json_is_obj(&kd, 0)) {
            fprintf(stderr, "sluice template: --kwargs must be a JSON object%s%s\n", err[0] ? ": " : "", err);
            goto out;
        }
        json_buf_lit(&body, ",\"chat_template_kwargs\":");
        json_buf_add(&body, kwargs, strlen(kwargs));
    } else if (json_is_obj(&md, 0) && json_get(&md, 0, "chat_template_kwargs") >= 0) {
        raw = json_raw(&md, json_get(&md, 0, "chat_template_kwargs"), &rl);
        json_buf_lit(&body, ",\"chat_template_kwargs\":");
        json_buf_add(&body, raw, rl);
    }
    json_buf_lit(&body, "}");
    if (body.oom || json_parse(&bd, body.p, body.len, err, sizeof err)) {
        fprintf(stderr, "sluice template: bad input: %s\n", body.oom ? "out of memory" : err);
        goto out;
    }
    struct api_oai_error e = {0};
    size_t plen = 0;
    if (api_chat_render(&bd, 0, &prompt, &plen, &e)) {
        fprintf(stderr, "sluice template: %s\n", e.message);
        goto out;
    }
    fwrite(prompt, 1, plen, stdout);
    fflush(stdout);
    rc = 0;
out:
    free(prompt);
    if (bd.tok) json_free(&bd);
    if (kd.tok) json_free(&kd);
    if (md.tok) json_free(&md);
    json_buf_free(&body);
    free(tools);
    free(msgs);
    api_chat_teardown();
    model_free(m);
    return rc;
}
