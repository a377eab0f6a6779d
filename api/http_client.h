/* http_client.h - the small blocking HTTP/1.1 client of `sluice batch` and
 * `sluice bench` (used inside api/ only).
 *
 * One request per connection (Connection: close) over a plain socket: both
 * commands send one request at a time per thread, so an event loop would buy
 * nothing. The connect gives up after 10 s; a read or write after
 * target.timeout seconds without a byte. Replies may be Content-Length,
 * chunked or close-delimited; the body goes to a sink as it arrives, so a
 * download never sits whole in memory and a stream is timed chunk by chunk.
 * Request bodies are bytes in memory, optionally with a file streamed after
 * them (a multipart upload of a large JSONL file).
 *
 * A parsed target is read-only, so threads may share it (bench's load
 * workers); each request uses only its own memory.
 */
#ifndef SLUICE_API_HTTP_CLIENT_H
#define SLUICE_API_HTTP_CLIENT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/json.h"

struct hc_target {
    char host[256];
    char port[16];
    char prefix[256];      /* path before /v1 ("" for most servers) */
    const char *api_key;   /* borrowed, may be NULL: sent as Authorization: Bearer */
    const char *agent;     /* User-Agent, borrowed */
    double timeout;        /* seconds without a byte before a request fails */
};

/* Fills host, port and prefix from http://HOST[:PORT][/PREFIX] (a trailing
 * /v1, as OpenAI clients take it, is dropped: paths name it). Returns 0, or
 * -1 with a message naming the URL (https is refused). */
int hc_parse_url(struct hc_target *t, const char *url, char *err, size_t errlen);

/* Takes the reply body as it arrives: returns 0 to go on, 1 to stop (the
 * request ends well), -1 when it cannot take the bytes (errno says why). */
typedef int (*hc_sink)(void *ctx, const char *p, size_t n);

/* A sink that appends to the struct json_buf at ctx (at most 64 MiB: past it,
 * it stops). */
int hc_sink_buf(void *ctx, const char *p, size_t n);

/* A request body: n bytes at p, then (when file is set) file_size bytes read
 * from file, then tail_n bytes at tail. */
struct hc_body {
    const char *ctype;     /* NULL: application/json */
    const char *p;
    size_t n;
    FILE *file;            /* borrowed; NULL: none */
    int64_t file_size;
    const char *tail;
    size_t tail_n;
};

/* One request over a fresh connection; body may be NULL (a POST without one
 * says Content-Length: 0). The reply body, whatever its status, goes to sink.
 * *status is the HTTP status (0 when no status line came). When the server
 * answers before taking the whole request body (a 413), that answer is the
 * result. Returns 0 when the whole body arrived or the sink stopped it, -1 on
 * a connection, protocol or sink error, -2 when the server closed the
 * connection before the end of the body; err says why. */
int hc_request(const struct hc_target *t, const char *method, const char *path, const struct hc_body *body,
               hc_sink sink, void *ctx, int *status, char *err, size_t errlen);

/* A request with an optional JSON body whose reply is collected into out
 * (initialized here; the caller frees it, whatever the result). Returns the
 * HTTP status, or -1 with err set. */
int hc_json(const struct hc_target *t, const char *method, const char *path, const char *json, size_t len,
            struct json_buf *out, char *err, size_t errlen);

/* The "message" of an OpenAI-shaped error body, else the body's start (on one
 * line), into out. */
void hc_error_text(const char *body, size_t len, char *out, size_t cap);

/* Uploads a batch input file (POST /v1/files, multipart, purpose=batch):
 * its content is the n bytes at mem, or file_size bytes streamed from file.
 * The new file's id goes to id. Returns 0, or -1 with err set (a non-2xx
 * answer is reported as "the server answered N: message"). */
int hc_upload_batch_file(const struct hc_target *t, const char *filename, const char *mem, size_t n, FILE *file,
                         int64_t file_size, char *id, size_t idcap, char *err, size_t errlen);

#endif
