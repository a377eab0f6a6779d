/* store.h - the durable job queue behind the OpenAI Files and Batch APIs:
 * uploaded files, batches, one row per batch request, and their results, in
 * SQLite (WAL mode) under a data directory (--data-dir, default ./sluice-data).
 *
 * Ownership and threads. A `store` is a handle on one SQLite connection and
 * is used by one thread at a time. store_open() gives the *writer*: the one
 * handle that may change anything; it belongs to the store thread (DESIGN.md,
 * "Threads"), which runs every function marked [writer] below. Any other
 * thread that only reads (status polling, listings, file downloads from the
 * api thread) opens its own handle with store_open_reader(); functions marked
 * [any] work on either kind. WAL mode lets readers see the last committed
 * state without ever waiting for the writer. A [writer] function called on a
 * reader handle returns SL_EINVAL and changes nothing. Every pointer a
 * function returns is owned by the caller unless its contract says otherwise;
 * strings passed in are borrowed for the duration of the call.
 *
 * File contents live as plain files in DATA_DIR/files/, named by the store
 * (files/<file id>.sluice), and the `files` table records their path. The
 * store touches nothing else under the data directory: a name is recorded
 * in the database (committed) before its file is created, and the store
 * only ever removes a file whose name it recorded - a crash between the two
 * is finished at the next open from the recorded names, never by listing a
 * directory. A data directory that holds anything but a database that
 * belongs with it is refused at open (see store_open()), so `--data-dir /`
 * or a lost sluice.db cannot cost anyone a file. An upload is never held
 * twice in memory: the api layer hands the store a writer callback
 * (store_file_write()) that streams the request body straight into the
 * store's file, and GET .../content can be served with sendfile
 * (store_file_open_content()). SQLite blobs would force either a copy into
 * the database (doubling disk writes and the WAL) or incremental-blob
 * bookkeeping for no gain: files are immutable once created. Batch output
 * and error files are written the same way by the store itself.
 *
 * Durability. A request's result is written in the same transaction that
 * marks its row done (store_complete_rows(), many rows per transaction), so
 * a crash loses at most work in flight, never a finished result, and never
 * writes one twice. store_open() puts rows left `running` back to `pending`,
 * re-validates batches left `validating`, and finishes batches that were
 * being finalized or cancelled.
 *
 * How the api layer uses it (the whole contract in one place):
 *
 *   startup (main):   w = store_open(data_dir, &opts, err, n)     -> the store thread
 *                     r = store_open_reader(data_dir, err, n)     -> the api thread
 *   POST /v1/files    api thread: parse the multipart body (413 past
 *                     opts.max_file_bytes) and move the file part, without
 *                     copying, into a buffer handed to the store thread:
 *                       store_file_write(w, cb, buf, purpose, filename, id, ...)
 *                       store_file_get_json(w, id, &buf, ...)        -> 200 body
 *   GET /v1/files[/{id}]       store_file_list_json(r, ...) / store_file_get_json(r, ...)
 *   GET /v1/files/{id}/content store_file_open_content(r, id, &fd, &size, ...) and
 *                              evbuffer_add_file(fd, 0, size), or store_file_content()
 *   DELETE /v1/files/{id}      store thread: store_file_delete(w, id, &buf, ...)
 *   POST /v1/batches  store thread: store_batch_create(w, input_file_id, endpoint,
 *                     completion_window, metadata_json, id, ...), then
 *                     store_batch_get_json(w, id, &buf, ...)          -> 200 body.
 *                     Validation problems in the *file* are not an error here:
 *                     the batch is created with status "failed" and per-line
 *                     `errors`, as OpenAI does.
 *   GET /v1/batches[/{id}]     store_batch_list_json(r, after, limit, ...) / store_batch_get_json(r, ...)
 *   POST /v1/batches/{id}/cancel  store thread: store_batch_cancel(w, id, ...), then get_json
 *   store thread loop (the feeder):
 *       every ~1 s:  store_tick(w, ...)        (expiry, late finalization)
 *       while the scheduler's batch queue is under its low watermark:
 *           n = store_claim_pending(w, high - queued, &rows, ...)
 *           submit each rows[i] at batch priority; store_rows_free(rows, n)
 *       as results arrive from the engine, gather them and every ~100 ms or
 *       ~64 results call store_complete_rows(w, results, k, ...) once.
 *   HTTP status for a negative return: STORE_ENOTFOUND 404, SL_EINVAL and
 *   STORE_ELIMIT 400, STORE_ECONFLICT 400 (OpenAI answers "cannot cancel" so),
 *   anything else 500. The `err` text is meant for the client's error.message.
 */
#ifndef SLUICE_STORE_H
#define SLUICE_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/json.h"
#include "base/base.h"

/* Status codes of this module beyond the shared enum sl_status (which this
 * module also returns: SL_EINVAL, SL_ENOMEM, SL_EIO). */
enum store_status {
    STORE_ENOTFOUND = -20, /* no file / batch with that id */
    STORE_ECONFLICT = -21, /* not possible in the object's current state (cancel a completed batch) */
    STORE_ELIMIT = -22,    /* a configured limit (lines, bytes) was exceeded */
    STORE_EDB = -23,       /* SQLite failed (disk full, corrupt, busy past the timeout) */
};

#define STORE_ID_MAX 64 /* room for any id this module makes, NUL included */

typedef struct store store;

struct store_opts {
    int64_t max_file_lines;   /* requests per batch input file; 0: 50,000 */
    int64_t max_file_bytes;   /* bytes per batch input file; 0: 200 MB */
    bool allow_short_windows; /* accept completion windows like "2s", "5m" (tests); else only "24h" */
    int busy_timeout_ms;      /* 0: 5000 */
    int max_errors;           /* per-line errors kept in a failed batch's `errors`; 0: 1000 */
};

/* Batches by status, with the request counts they hold (for /metrics: a
 * scan of the batches table, not of the rows). */
#define STORE_N_BATCH_STATUS 8
extern const char *const store_batch_status_names[STORE_N_BATCH_STATUS];
struct store_queue_stats {
    long batches[STORE_N_BATCH_STATUS];   /* by store_batch_status_names */
    long rows_total[STORE_N_BATCH_STATUS], rows_completed[STORE_N_BATCH_STATUS], rows_failed[STORE_N_BATCH_STATUS];
};

/* ---- construction ---------------------------------------------------------- */

/* Opens (creating when needed) DATA_DIR with its database DATA_DIR/sluice.db
 * and the folder files/, applies every schema migration the database lacks
 * in one transaction, and recovers from a crash: files whose names were
 * recorded but never became rows are removed, rows left `running` become
 * `pending`, batches left `validating` are validated again, batches left
 * `finalizing`/`cancelling` are finished. Refused (NULL, SL_EINVAL, nothing
 * created or removed) when DATA_DIR holds anything but empty files/ and
 * tmp/ folders while its database is missing, empty or without a schema;
 * when sluice.db is not a sluice database; and when files/ holds a file
 * named as the store names them that the database does not list (the
 * database does not belong with the files). opts may be NULL (defaults).
 * Returns the writer handle, or NULL with a message in err. Only one writer
 * per data directory at a time (SQLite would serialize two, but crash
 * recovery assumes it is alone). */
store *store_open(const char *data_dir, const struct store_opts *opts, char *err, size_t errlen);

/* A read-only handle on a data directory that a writer has opened (and so
 * created and migrated). For the api thread (or any thread) to poll without
 * waiting for the writer. Returns NULL with a message in err. */
store *store_open_reader(const char *data_dir, char *err, size_t errlen);

/* Fills *out from the batches table. 0, or a negative status with err. */
int store_queue_stats(store *s, struct store_queue_stats *out, char *err, size_t errlen);

/* Closes the handle. Accepts NULL. Rows claimed and not completed stay
 * `running` on disk until the next store_open() puts them back. */
void store_close(store *s);

/* Replaces the clock (unix seconds) used for timestamps and expiry; NULL
 * restores time(). For tests. [any, before use] */
void store_set_clock(store *s, int64_t (*now)(void *ctx), void *ctx);

/* Parses a completion window: "24h" always; with allow_short Ns, Nm, Nh too
 * (1 <= N, at most 7 days). Returns seconds > 0, or SL_EINVAL with a message. */
int64_t store_parse_window(const char *w, bool allow_short, char *err, size_t errlen);

/* ---- files ------------------------------------------------------------------ */

/* Takes the file at src_path in (renamed into DATA_DIR/files/, or copied
 * when it is on another filesystem, the original then removed) and records
 * it with a new id "file-..." written into id_out[STORE_ID_MAX]. purpose is
 * one of the OpenAI purposes ("batch", "batch_output", "fine-tune", ...);
 * filename is what the client called it. For purpose "batch" the size limit
 * (opts.max_file_bytes) and the line limit (opts.max_file_lines) are checked
 * here (STORE_ELIMIT naming the limit); the content is validated as batch
 * input only by store_batch_create(). Returns 0, or a negative status with a
 * message; on error nothing is recorded and src_path is left where it was
 * (called on a reader handle: SL_EINVAL). [writer] */
int store_file_create(store *s, const char *src_path, const char *purpose, const char *filename,
                      char *id_out, char *err, size_t errlen);

/* Writes the whole content of a new file to fd (open for writing, at offset
 * 0; not to be closed). Returns 0, or a negative status with a message. */
typedef int (*store_write_fn)(void *ctx, int fd, char *err, size_t errlen);

/* As store_file_create(), the content coming from cb: the store names the
 * file, records the name, creates the file and calls cb once, then fsyncs,
 * checks the limits and records the file. On error (cb's included: its
 * status is returned) nothing is recorded and what was written is
 * removed. [writer] */
int store_file_write(store *s, store_write_fn cb, void *ctx, const char *purpose, const char *filename,
                     char *id_out, char *err, size_t errlen);

/* Appends the OpenAI file object {"id","object":"file","bytes","created_at",
 * "filename","purpose","status"} to out. Returns 0, STORE_ENOTFOUND, or
 * STORE_EDB. [any] */
int store_file_get_json(store *s, const char *id, struct json_buf *out, char *err, size_t errlen);

/* Appends {"object":"list","data":[file objects, newest first],"first_id",
 * "last_id","has_more"} to out. purpose (NULL: all) filters; after (NULL:
 * from the newest) is the id of the last file of the previous page; limit is
 * clamped to 1..10000 (0: 10000). An unknown `after` gives STORE_ENOTFOUND. [any] */
int store_file_list_json(store *s, const char *purpose, const char *after, int limit,
                         struct json_buf *out, char *err, size_t errlen);

/* Deletes the file's row and its content, and appends the OpenAI deletion
 * object {"id","object":"file","deleted":true} to out (out may be NULL).
 * Batches that used it keep their own copy of every request. Returns 0 or
 * STORE_ENOTFOUND / STORE_EDB. [writer] */
int store_file_delete(store *s, const char *id, struct json_buf *out, char *err, size_t errlen);

/* Streams the file's content to cb in chunks of at most 64 KiB, in order.
 * cb returns 0 to go on, anything else to stop (returned as is). Memory use
 * is one chunk. Returns 0, STORE_ENOTFOUND, SL_EIO, or cb's value. [any] */
int store_file_content(store *s, const char *id, int (*cb)(void *ctx, const char *p, size_t n),
                       void *ctx, char *err, size_t errlen);

/* Opens the file's content read-only for zero-copy sending: *fd_out (caller
 * closes it) and *size_out. The open fd stays valid even if the file is
 * deleted meanwhile. Returns 0, STORE_ENOTFOUND or SL_EIO. [any] */
int store_file_open_content(store *s, const char *id, int *fd_out, int64_t *size_out, char *err,
                            size_t errlen);

/* ---- batches ---------------------------------------------------------------- */

enum store_batch_status {
    STORE_BATCH_VALIDATING, STORE_BATCH_FAILED, STORE_BATCH_IN_PROGRESS, STORE_BATCH_FINALIZING,
    STORE_BATCH_COMPLETED, STORE_BATCH_EXPIRED, STORE_BATCH_CANCELLING, STORE_BATCH_CANCELLED,
};
const char *store_batch_status_name(enum store_batch_status st); /* "in_progress", ... */

/* A batch as plain values (for the feeder, the CLI and tests). */
struct store_batch_info {
    char id[STORE_ID_MAX];
    enum store_batch_status status;
    /* request_counts. Once the batch is over, completed + failed = total:
     * the rows cancelled (before they ran, or stopped while running) and the
     * expired ones count as failed, one line each in the error file. */
    int64_t total, completed, failed;
    int64_t created_at, expires_at;
    char output_file_id[STORE_ID_MAX]; /* "" when none */
    char error_file_id[STORE_ID_MAX];  /* "" when none */
};

/* Creates a batch over the "batch"-purpose file input_file_id. endpoint must
 * be "/v1/chat/completions" or "/v1/completions"; completion_window is parsed
 * by store_parse_window() with opts.allow_short_windows; metadata_json is a
 * JSON object (up to 16 string pairs, as OpenAI allows) or NULL. The batch
 * is recorded as `validating`; then every line of the file is checked and
 * turned into one pending row, all in one transaction, and the batch becomes
 * `in_progress` (expires_at = created_at + window, as OpenAI sets it). When lines are
 * invalid (bad JSON, missing custom_id/method/url/body, duplicate custom_id,
 * url not the batch endpoint, method not POST, body.stream true, over the
 * line limit) no row is kept and the batch becomes `failed` with `errors`
 * {"object":"list","data":[{"code","message","param","line"}]} (line is
 * 1-based): that is still a success (0) - the batch exists. The id is
 * written into id_out[STORE_ID_MAX]. Returns 0, or SL_EINVAL (bad endpoint,
 * window or metadata), STORE_ENOTFOUND (no such file), SL_EIO, STORE_EDB;
 * then no batch is created. Runs in time linear in the file, memory bounded
 * by the longest line. [writer] */
int store_batch_create(store *s, const char *input_file_id, const char *endpoint,
                       const char *completion_window, const char *metadata_json, char *id_out,
                       char *err, size_t errlen);

/* ---- batch lines: the rules and the output shape, shared with run-batch ---- */

/* Why a batch input line was refused: an OpenAI error code ("invalid_json_line",
 * "missing_required_parameter", "invalid_method", "invalid_url",
 * "invalid_value"), the parameter (NULL when none) and a message. */
struct store_line_error {
    const char *code;          /* static */
    const char *param;         /* static */
    char message[512];
};

/* Checks one input line as batch creation does: a JSON object with a string
 * custom_id, method "POST", a url that is endpoint (NULL: any of
 * "/v1/chat/completions", "/v1/completions", "/v1/responses") and an object
 * body without "stream": true. Returns 0 with *url (a static string: the
 * endpoint the line names) and *body, *body_len (the body's text inside
 * line), or SL_EINVAL with e filled. *custom_id is the line's custom_id
 * (malloc'ed; the caller frees it) whenever it is a string, on failure too,
 * else NULL. Reads line only; any thread. */
int store_check_line(const char *line, size_t len, const char *endpoint, char **custom_id, const char **url,
                     const char **body, size_t *body_len, struct store_line_error *e);

/* Appends one line of an output or error file, without its newline:
 * {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}.
 * status_code 0 makes "response" null; custom_id, request_id, body and error
 * (JSON text) may be NULL for null. Any thread. */
void store_result_line(struct json_buf *b, const char *id, const char *custom_id, size_t custom_id_len,
                       int status_code, const char *request_id, size_t request_id_len, const char *body,
                       size_t body_len, const char *error, size_t error_len);

/* Appends a row's error object: {"code", "message"}. Any thread. */
void store_error_json(struct json_buf *b, const char *code, const char *message);

/* Fills *out. Returns 0, STORE_ENOTFOUND or STORE_EDB. [any] */
int store_batch_get(store *s, const char *id, struct store_batch_info *out, char *err, size_t errlen);

/* Appends the OpenAI batch object to out: id, object "batch", endpoint,
 * errors, input_file_id, completion_window, status, output_file_id,
 * error_file_id, the nine timestamps (null when not reached),
 * request_counts {total, completed, failed}, metadata. [any] */
int store_batch_get_json(store *s, const char *id, struct json_buf *out, char *err, size_t errlen);

/* Appends {"object":"list","data":[batch objects, newest first],"first_id",
 * "last_id","has_more"}; after/limit as in store_file_list_json (limit 1..100,
 * 0: 20). [any] */
int store_batch_list_json(store *s, const char *after, int limit, struct json_buf *out, char *err,
                          size_t errlen);

/* Cancels a validating or in-progress batch: it becomes `cancelling`, rows
 * not yet claimed become cancelled, and once no row is running (now, or when
 * the last running one is completed) the output/error files are written
 * and it becomes `cancelled`. Cancelling a batch that is already cancelling
 * or cancelled returns 0 and changes nothing. Returns STORE_ECONFLICT for a
 * batch that is failed, finalizing, completed or expired. [writer] */
int store_batch_cancel(store *s, const char *id, char *err, size_t errlen);

/* Housekeeping for the store thread; call it every second or so. Expires
 * in-progress batches past expires_at (finished results are kept; pending and
 * running rows become `batch_expired` errors; output and error files are
 * written; status `expired`), and finishes batches whose finalization was
 * interrupted. Returns the number of batches that changed status, or a
 * negative status. [writer] */
int store_tick(store *s, char *err, size_t errlen);

/* ---- feeding the engine ------------------------------------------------------- */

/* One claimed request. All strings are owned by the row array. */
struct store_row {
    int64_t row_id;            /* what store_complete_rows() is given back */
    int64_t line;              /* 0-based position in the input file's requests */
    char batch_id[STORE_ID_MAX];
    char *custom_id;
    char *url;                 /* the batch endpoint, e.g. "/v1/chat/completions" */
    char *body;                /* the request body, JSON text, NUL-terminated */
    size_t body_len;
};

/* Marks up to max_n pending rows of in-progress batches `running` (oldest
 * batch first, input order within a batch) in one transaction and returns
 * them in *rows_out (free with store_rows_free). Returns the count (0 when
 * there is no work; *rows_out is then NULL), or a negative status with
 * nothing claimed. [writer] */
int store_claim_pending(store *s, int max_n, struct store_row **rows_out, char *err, size_t errlen);
void store_rows_free(struct store_row *rows, int n);

/* What became of one result given to store_complete_rows(). */
enum store_outcome {
    STORE_APPLIED = 0,   /* written; the row is now done or failed */
    STORE_DUPLICATE = 1, /* the row was already done/failed: nothing written */
    STORE_DROPPED = 2,   /* the row was cancelled or expired meanwhile, or does not exist */
};

/* The result of one row. Strings are borrowed. A row is `done` when error_code
 * is NULL and 200 <= status_code < 300 (it goes to the output file),
 * `failed` otherwise (error file): an HTTP error response has status_code
 * and body, an error with no response has status_code 0, body NULL and
 * error_code/error_message set. */
struct store_result {
    int64_t row_id;
    int status_code;
    const char *request_id;    /* may be NULL */
    const char *body;          /* response body, JSON text; NULL: null */
    const char *error_code;    /* NULL for a response */
    const char *error_message;
    bool cancelled;             /* the row was stopped by its batch's cancel: it becomes `cancelled`
                                 * (error batch_cancelled, error_message or a default), counted as
                                 * failed once the batch is cancelled; the other fields but row_id are ignored */
    enum store_outcome outcome; /* out */
};

/* Writes n results in ONE transaction: each row moves running (or pending)
 * -> done/failed/cancelled with its result, and its batch's counts move with
 * it. Idempotent: a row already finished is left alone and reported
 * STORE_DUPLICATE, so a result is never written twice. Batches whose rows are
 * then all finished are finalized (output file in input order, error file,
 * status `completed`, or `cancelled` for a cancelling batch) right after the
 * commit; a failure there does not concern the results (store_tick()
 * finishes the batch later). Returns the number of results applied, or a
 * negative status with nothing written (outcome fields are then
 * meaningless; the same results may be given again). The results' strings
 * are only read during the call. [writer] */
int store_complete_rows(store *s, struct store_result *results, int n, char *err, size_t errlen);

#endif
