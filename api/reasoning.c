/* reasoning.c - --reasoning-parser: splits generated text into the model's
 * thinking (reasoning_content) and its answer (content), incrementally, so
 * the same code serves streamed deltas and whole responses. See openai.h.
 *
 *   deepseek_r1: the prompt already opened <think> (R1 templates end with
 *                "<think>\n"): text is reasoning until </think>; a leading
 *                <think> the model writes itself is dropped.
 *   qwen3, glm45 (glm47 is the same format): text is content;
 *                <think>...</think> is reasoning.
 *
 * A tag split across feeds is held back until it is complete or ruled out,
 * so the output never depends on where the text was cut.
 */
#include <string.h>

#include "openai.h"

static const char OPEN[] = "<think>", CLOSE[] = "</think>";

int api_reasoning_lookup(const char *name)
{
    if (!name) return API_REASONING_NONE;
    if (!strcmp(name, "deepseek_r1")) return API_REASONING_DEEPSEEK_R1;
    if (!strcmp(name, "qwen3")) return API_REASONING_QWEN3;
    if (!strcmp(name, "glm45") || !strcmp(name, "glm47")) return API_REASONING_GLM45;
    return -1;
}

void api_reasoning_init(struct api_reasoning *p, int kind)
{
    memset(p, 0, sizeof *p);
    p->kind = kind;
    p->in_think = kind == API_REASONING_DEEPSEEK_R1;
    p->fresh = true;
}

/* Length of the longest suffix of s[0..n) that is a proper prefix of tag. */
static size_t partial(const char *s, size_t n, const char *tag)
{
    size_t tl = strlen(tag);
    for (size_t k = tl - 1; k > 0; k--)
        if (k <= n && !memcmp(s + n - k, tag, k)) return k;
    return 0;
}

static void emit(struct api_reasoning *p, const char *s, size_t n, struct json_buf *reasoning, struct json_buf *content)
{
    if (!n) return;
    json_buf_add(p->in_think ? reasoning : content, s, n);
    p->fresh = false;
}

/* Processes s[0..n); returns how many bytes were consumed (the rest may be
 * the start of a tag). */
static size_t scan(struct api_reasoning *p, const char *s, size_t n, bool final, struct json_buf *reasoning,
                   struct json_buf *content)
{
    size_t i = 0;
    while (i < n) {
        const char *rest = s + i;
        size_t rn = n - i;
        /* in think: </think> ends it; a <think> before any reasoning is dropped */
        const char *want = p->in_think ? CLOSE : OPEN;
        const char *hit = memmem(rest, rn, want, strlen(want));
        const char *drop = p->in_think && p->fresh ? memmem(rest, rn, OPEN, strlen(OPEN)) : NULL;
        if (drop == rest) {
            i += strlen(OPEN);
            continue;
        }
        if (!hit) {
            size_t hold = final ? 0 : partial(rest, rn, want);
            if (!final && p->in_think && p->fresh) {
                size_t h2 = partial(rest, rn, OPEN);
                if (h2 > hold) hold = h2;
            }
            emit(p, rest, rn - hold, reasoning, content);
            return i + rn - hold;
        }
        emit(p, rest, (size_t)(hit - rest), reasoning, content);
        i += (size_t)(hit - rest) + strlen(want);
        p->in_think = !p->in_think;
        p->fresh = true;
    }
    return i;
}

void api_reasoning_feed(struct api_reasoning *p, const char *s, size_t n, struct json_buf *reasoning,
                        struct json_buf *content)
{
    if (p->kind == API_REASONING_NONE) {
        json_buf_add(content, s, n);
        return;
    }
    /* hold (at most a tag's length) + the new text, scanned as one */
    while (n) {
        char buf[256];
        size_t take = sizeof buf - p->nhold < n ? sizeof buf - p->nhold : n;
        memcpy(buf, p->hold, p->nhold);
        memcpy(buf + p->nhold, s, take);
        size_t len = p->nhold + take;
        size_t used = scan(p, buf, len, false, reasoning, content);
        p->nhold = len - used;
        memcpy(p->hold, buf + used, p->nhold);
        s += take;
        n -= take;
    }
}

void api_reasoning_flush(struct api_reasoning *p, struct json_buf *reasoning, struct json_buf *content)
{
    if (p->nhold) scan(p, p->hold, p->nhold, true, reasoning, content);
    p->nhold = 0;
}
