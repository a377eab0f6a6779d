/* chatml.c - the ChatML prompt format of the default model:
 *
 *   <|im_start|>role\ncontent<|im_end|>\n   per message, then, with
 *   add_generation_prompt, <|im_start|>assistant\n
 *
 * Contents are copied verbatim (no trimming). A full Jinja chat-template
 * engine is a later issue; this is what model_chat_template() falls back to.
 */
#include <string.h>

#include "model.h"

static void add(char *out, size_t cap, size_t *n, const char *s)
{
    size_t l = s ? strlen(s) : 0;
    if (*n < cap) memcpy(out + *n, s, l < cap - *n ? l : cap - *n);
    *n += l;
}

size_t model_chatml_render(const char *const *roles, const char *const *contents, int n,
                           bool add_generation_prompt, char *out, size_t cap)
{
    size_t w = 0;
    if (!out) cap = 0;
    for (int i = 0; i < n; i++) {
        add(out, cap, &w, "<|im_start|>");
        add(out, cap, &w, roles ? roles[i] : NULL);
        add(out, cap, &w, "\n");
        add(out, cap, &w, contents ? contents[i] : NULL);
        add(out, cap, &w, "<|im_end|>\n");
    }
    if (add_generation_prompt) add(out, cap, &w, "<|im_start|>assistant\n");
    if (w < cap) out[w] = 0;
    return w;
}
