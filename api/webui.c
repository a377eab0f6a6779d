/* webui.c - the web page `sluice serve` serves at /: a chat, the batch jobs
 * at a glance and a small server status panel (api/webui/: plain HTML, CSS
 * and JavaScript that call only the server's own endpoints: /v1/models,
 * /v1/chat/completions, /v1/files, /v1/batches, /health, /metrics, /version).
 *
 * The files are built into the binary by the assembler's .incbin (the
 * Makefile makes webui.o depend on every file of api/webui/), so the page
 * needs no file on disk and nothing from the network. Every reply carries a
 * Content-Security-Policy that allows scripts from this origin only (no
 * inline script, no eval) and X-Content-Type-Options: nosniff. The page puts
 * model text into the DOM with textContent only; the policy is the second
 * wall should a bug ever let markup through. --no-web-ui leaves all of this
 * out (the paths are then 404 as any unknown path). Api thread only.
 */
#include <event2/buffer.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "server.h"

/* One file of api/webui/ as two symbols around its bytes, in read-only data.
 * Hidden: the names stay inside the binary. The path is relative to the
 * directory make runs the compiler in (the repository root). */
#define WEBUI_FILE(sym, path)                                                                                     \
    __asm__(".section .rodata.webui,\"a\"\n.balign 16\n.globl " #sym "\n.hidden " #sym "\n" #sym ":\n"           \
            ".incbin \"" path "\"\n.globl " #sym "_end\n.hidden " #sym "_end\n" #sym "_end:\n.byte 0\n"          \
            ".previous\n");                                                                                       \
    extern const char sym[], sym##_end[]

WEBUI_FILE(srv_webui_index_html, "api/webui/index.html");
WEBUI_FILE(srv_webui_app_js, "api/webui/app.js");
WEBUI_FILE(srv_webui_style_css, "api/webui/style.css");
WEBUI_FILE(srv_webui_favicon_svg, "api/webui/favicon.svg");

static const struct webui_file {
    const char *path, *type;
    const char *start, *end; /* the bytes: [start, end) */
} files[] = {
    {"/", "text/html; charset=utf-8", srv_webui_index_html, srv_webui_index_html_end},
    {"/index.html", "text/html; charset=utf-8", srv_webui_index_html, srv_webui_index_html_end},
    {"/webui/app.js", "text/javascript; charset=utf-8", srv_webui_app_js, srv_webui_app_js_end},
    {"/webui/style.css", "text/css; charset=utf-8", srv_webui_style_css, srv_webui_style_css_end},
    {"/webui/favicon.svg", "image/svg+xml", srv_webui_favicon_svg, srv_webui_favicon_svg_end},
};

/* Scripts and connections to this origin only; styles from its files (none
 * inline in the markup); images from here and data: URLs (the favicon link);
 * no plugins, no <base>, no framing, forms post nowhere. */
static const char CSP[] = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                          "connect-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'none'; "
                          "frame-ancestors 'none'";

/* FNV-1a of the bytes: the ETag, so a browser revalidates cheaply and a new
 * binary's page is never taken from its cache. */
static uint64_t fnv1a(const char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 0x100000001b3ull;
    return h;
}

bool srv_webui_route(struct evhttp_request *req, const char *path)
{
    const struct webui_file *f = NULL;
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
        if (!strcmp(path, files[i].path)) f = &files[i];
    if (!f) return false;
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    enum evhttp_cmd_type m = evhttp_request_get_command(req);
    if (m != EVHTTP_REQ_GET && m != EVHTTP_REQ_HEAD) {
        evhttp_add_header(h, "Allow", "GET, HEAD");
        srv_reply_error(req, 405, "invalid_request_error", NULL, "method not allowed on %s (use GET)", path);
        return true;
    }
    size_t len = (size_t)(f->end - f->start);
    char etag[24], n[24];
    snprintf(etag, sizeof etag, "\"%016llx\"", (unsigned long long)fnv1a(f->start, len));
    snprintf(n, sizeof n, "%zu", len);
    evhttp_add_header(h, "Content-Type", f->type);
    evhttp_add_header(h, "Content-Security-Policy", CSP);
    evhttp_add_header(h, "X-Content-Type-Options", "nosniff");
    evhttp_add_header(h, "Referrer-Policy", "no-referrer");
    evhttp_add_header(h, "Cache-Control", "no-cache");
    evhttp_add_header(h, "ETag", etag);
    const char *inm = evhttp_find_header(evhttp_request_get_input_headers(req), "If-None-Match");
    if (inm && strstr(inm, etag)) {
        evhttp_send_reply(req, 304, "Not Modified", NULL);
        return true;
    }
    struct evbuffer *out = evbuffer_new();
    if (!out) {
        srv_reply_error(req, 500, "server_error", NULL, "out of memory");
        return true;
    }
    /* a HEAD gets a GET's length and no body: libevent 2.1 would write it */
    if (m == EVHTTP_REQ_HEAD) evhttp_add_header(h, "Content-Length", n);
    else evbuffer_add_reference(out, f->start, len, NULL, NULL);
    evhttp_send_reply(req, 200, "OK", out);
    evbuffer_free(out);
    return true;
}
