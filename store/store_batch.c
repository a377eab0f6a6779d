/* store_batch.c - batch creation (store.h): validating the input file line
 * by line into the OpenAI error list, creating the rows, and the batch
 * objects the API returns (get, list).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store/store_internal.h"

/* ---- batch validation and creation ---------------------------------------------------- */

struct verrs {
    struct json_buf buf; /* the `data` array's members, comma separated */
    int64_t n;           /* errors found (may exceed the kept ones) */
    int max;
};

static void verr(struct verrs *v, const char *code, const char *param, int64_t line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void verr(struct verrs *v, const char *code, const char *param, int64_t line, const char *fmt, ...)
{
    if (v->n++ >= v->max) return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (v->buf.len) json_buf_add(&v->buf, ",", 1);
    json_buf_add(&v->buf, "{\"code\":", 8);
    json_buf_add_str(&v->buf, code, strlen(code));
    json_buf_add(&v->buf, ",\"message\":", 11);
    json_buf_add_str(&v->buf, msg, strlen(msg));
    json_buf_add(&v->buf, ",\"param\":", 9);
    if (param) json_buf_add_str(&v->buf, param, strlen(param));
    else json_buf_add(&v->buf, "null", 4);
    if (line > 0) json_buf_addf(&v->buf, ",\"line\":%lld}", (long long)line);
    else json_buf_add(&v->buf, ",\"line\":null}", 13);
}

static const char *const endpoints[] = {"/v1/chat/completions", "/v1/completions", "/v1/responses"};

static int line_error(struct store_line_error *e, const char *code, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int line_error(struct store_line_error *e, const char *code, const char *param, const char *fmt, ...)
{
    e->code = code;
    e->param = param;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return SL_EINVAL;
}

int store_check_line(const char *line, size_t len, const char *endpoint, char **custom_id, const char **url,
                     const char **body, size_t *body_len, struct store_line_error *e)
{
    *custom_id = NULL;
    json_doc d;
    char je[128];
    if (json_parse(&d, line, len, je, sizeof je) || !json_is_obj(&d, 0)) {
        if (d.tok) json_free(&d);
        return line_error(e, "invalid_json_line", NULL,
                          "This line is not parseable as valid JSON (a JSON object per line is expected).");
    }
    int rc = SL_EINVAL;
    int i = json_get(&d, 0, "custom_id");
    int m = json_get(&d, 0, "method");
    int u = json_get(&d, 0, "url");
    int b = json_get(&d, 0, "body");
    if (i < 0 || !json_is_str(&d, i)) {
        line_error(e, "missing_required_parameter", "custom_id", "Missing required parameter: 'custom_id' (a string).");
        goto done;
    }
    *custom_id = json_strdup(&d, i, NULL);
    if (!*custom_id) {
        line_error(e, "invalid_json_line", "custom_id", "The custom_id is not a valid JSON string.");
        goto done;
    }
    if (m < 0 || !json_is_str(&d, m)) {
        line_error(e, "missing_required_parameter", "method", "Missing required parameter: 'method'.");
        goto done;
    }
    if (!json_str_eq(&d, m, "POST")) {
        line_error(e, "invalid_method", "method", "The method of a batch request must be POST.");
        goto done;
    }
    if (u < 0 || !json_is_str(&d, u)) {
        line_error(e, "missing_required_parameter", "url", "Missing required parameter: 'url'.");
        goto done;
    }
    *url = NULL;
    for (size_t k = 0; k < sizeof endpoints / sizeof endpoints[0]; k++)
        if ((!endpoint || !strcmp(endpoint, endpoints[k])) && json_str_eq(&d, u, endpoints[k])) *url = endpoints[k];
    if (!*url) {
        size_t ul;
        const char *us = json_raw(&d, u, &ul);
        if (endpoint)
            line_error(e, "invalid_url", "url",
                       "The url '%.*s' does not match the batch's endpoint '%s'; every request must use the batch's "
                       "endpoint.", (int)(ul > 200 ? 200 : ul), us, endpoint);
        else
            line_error(e, "invalid_url", "url",
                       "The url '%.*s' is not one a batch runs: '/v1/chat/completions', '/v1/completions' or "
                       "'/v1/responses'.", (int)(ul > 200 ? 200 : ul), us);
        goto done;
    }
    if (b < 0 || !json_is_obj(&d, b)) {
        line_error(e, "missing_required_parameter", "body", "Missing required parameter: 'body' (a JSON object).");
        goto done;
    }
    int st = json_get(&d, b, "stream");
    bool stream = false;
    if (st >= 0 && json_bool(&d, st, &stream) == 0 && stream) {
        line_error(e, "invalid_value", "body.stream", "Streaming is not supported in a batch: 'stream' must not be true.");
        goto done;
    }
    *body = json_raw(&d, b, body_len);
    rc = 0;
done:
    json_free(&d);
    return rc;
}

/* Validates the batch's input file and creates its rows (one transaction),
 * moving it from validating to in_progress or failed. Returns 0 (either
 * way) or a negative status for an I/O or database failure, leaving the
 * batch `validating` for a later retry. */
int store__validate_batch(store *s, const char *id, char *err, size_t errlen)
{
    sqlite3_stmt *st = db_prep(s,
                               "SELECT b.endpoint, f.path FROM batches b LEFT JOIN files f ON f.id = b.input_file_id"
                               " WHERE b.id = ? AND b.status = 'validating'",
                               err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    if (r != SQLITE_ROW) {
        sqlite3_finalize(st);
        return r == SQLITE_DONE ? 0 : db_fail(s, "validate", err, errlen);
    }
    char endpoint[64];
    snprintf(endpoint, sizeof endpoint, "%s", db_text(st, 0));
    char *path = db_text(st, 1) ? store__path_join(s->dir, db_text(st, 1)) : NULL;
    sqlite3_finalize(st);

    struct verrs v = {.max = s->opts.max_errors};
    json_buf_init(&v.buf);
    FILE *f = NULL;
    char *line = NULL;
    size_t cap = 0;
    sqlite3_stmt *ins = NULL;
    int rc = db_begin(s, err, errlen);
    if (rc) goto fail_begin;
    /* a batch re-validated after a crash may have rows from the first try */
    sqlite3_stmt *del = db_prep(s, "DELETE FROM batch_requests WHERE batch_id = ?", err, errlen);
    if (!del) goto fail_db;
    sqlite3_bind_text(del, 1, id, -1, SQLITE_STATIC);
    r = sqlite3_step(del);
    sqlite3_finalize(del);
    if (r != SQLITE_DONE) goto fail_db;

    ins = db_prep(s, "INSERT INTO batch_requests (batch_id, line, custom_id, url, body) VALUES (?, ?, ?, ?, ?)", err,
                  errlen);
    if (!ins) goto fail_db;
    f = path ? fopen(path, "re") : NULL;
    if (!f) {
        verr(&v, "file_not_found", "input_file_id", 0, "The input file no longer exists.");
    }
    int64_t lineno = 0, nreq = 0;
    while (f) {
        errno = 0;
        ssize_t len = getline(&line, &cap, f);
        if (len < 0) {
            if (ferror(f)) {
                sl_seterr(err, errlen, "reading the input file of %s: %s", id, strerror(errno));
                rc = SL_EIO;
                goto fail;
            }
            break;
        }
        lineno++;
        if (lineno == 1 && len >= 3 && memcmp(line, "\xef\xbb\xbf", 3) == 0) { /* UTF-8 BOM */
            memmove(line, line + 3, (size_t)len - 2);
            len -= 3;
        }
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
        ssize_t k = 0;
        while (k < len && (line[k] == ' ' || line[k] == '\t')) k++;
        if (k == len) continue; /* blank lines are not requests */
        if (++nreq > s->opts.max_file_lines) {
            verr(&v, "too_many_requests_in_file", NULL, lineno,
                 "The input file has more than %lld requests, the limit for one batch.",
                 (long long)s->opts.max_file_lines);
            break;
        }
        char *cid;
        const char *url, *body;
        size_t blen;
        struct store_line_error le;
        if (store_check_line(line, (size_t)len, endpoint, &cid, &url, &body, &blen, &le)) {
            verr(&v, le.code, le.param, lineno, "%s", le.message);
            free(cid);
            continue;
        }
        /* rows are inserted even once errors were found: the UNIQUE index
         * is what finds duplicate custom_ids, in bounded memory; the whole
         * transaction is rolled back at the end if anything was wrong */
        sqlite3_bind_text(ins, 1, id, -1, SQLITE_STATIC);
        sqlite3_bind_int64(ins, 2, nreq - 1);
        sqlite3_bind_text(ins, 3, cid, -1, SQLITE_STATIC);
        sqlite3_bind_text(ins, 4, endpoint, -1, SQLITE_STATIC);
        sqlite3_bind_text(ins, 5, body, (int)blen, SQLITE_STATIC);
        r = sqlite3_step(ins);
        sqlite3_reset(ins);
        if (r == SQLITE_CONSTRAINT) {
            verr(&v, "duplicate_custom_id", "custom_id", lineno,
                 "The custom_id '%.200s' is a duplicate of another request's; the custom_id parameter must be "
                 "unique for each request in a batch.",
                 cid);
        } else if (r != SQLITE_DONE) {
            free(cid);
            goto fail_db;
        }
        free(cid);
    }
    if (f && !v.n && nreq == 0) verr(&v, "empty_file", NULL, 0, "The input file contains no requests.");
    sqlite3_finalize(ins);
    ins = NULL;
    if (v.buf.oom) {
        sl_seterr(err, errlen, "out of memory");
        rc = SL_ENOMEM;
        goto fail;
    }

    int64_t now = store__now(s);
    if (v.n) {
        db_rollback(s); /* drops every row inserted above */
        struct json_buf e;
        json_buf_init(&e);
        json_buf_add(&e, "{\"object\":\"list\",\"data\":[", 25);
        json_buf_add(&e, v.buf.p ? v.buf.p : "", v.buf.len);
        json_buf_add(&e, "]}", 2);
        if (e.oom) {
            json_buf_free(&e);
            sl_seterr(err, errlen, "out of memory");
            rc = SL_ENOMEM;
            goto fail_begin;
        }
        st = db_prep(s, "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ?", err, errlen);
        if (st) {
            sqlite3_bind_int64(st, 1, now);
            sqlite3_bind_text(st, 2, e.p, (int)e.len, SQLITE_STATIC);
            sqlite3_bind_text(st, 3, id, -1, SQLITE_STATIC);
            rc = sqlite3_step(st) == SQLITE_DONE ? 0 : db_fail(s, "fail batch", err, errlen);
            sqlite3_finalize(st);
        } else {
            rc = STORE_EDB;
        }
        json_buf_free(&e);
        goto out;
    }
    st = db_prep(s, "UPDATE batches SET status = 'in_progress', in_progress_at = ?, n_total = ? WHERE id = ?", err,
                 errlen);
    if (!st) goto fail_db;
    sqlite3_bind_int64(st, 1, now);
    sqlite3_bind_int64(st, 2, nreq);
    sqlite3_bind_text(st, 3, id, -1, SQLITE_STATIC);
    r = sqlite3_step(st);
    sqlite3_finalize(st);
    if (r != SQLITE_DONE) goto fail_db;
    rc = db_commit(s, err, errlen);
    if (rc) goto fail;
out:
    if (f) fclose(f);
    free(line);
    free(path);
    json_buf_free(&v.buf);
    return rc;

fail_db:
    rc = db_fail(s, "validate", err, errlen);
fail:
    sqlite3_finalize(ins);
    db_rollback(s);
fail_begin:
    if (f) fclose(f);
    free(line);
    free(path);
    json_buf_free(&v.buf);
    return rc;
}

/* metadata: a JSON object of at most 16 string values (OpenAI's rule). */
static int check_metadata(const char *m, char *err, size_t errlen)
{
    if (!m) return 0;
    json_doc d;
    char e[128];
    if (json_parse(&d, m, strlen(m), e, sizeof e)) {
        sl_seterr(err, errlen, "metadata: %s", e);
        return SL_EINVAL;
    }
    int rc = 0;
    if (json_is_null(&d, 0)) goto out;
    if (!json_is_obj(&d, 0) || json_size(&d, 0) > 16) {
        sl_seterr(err, errlen, "metadata must be an object of at most 16 key-value pairs");
        rc = SL_EINVAL;
        goto out;
    }
    for (int k = 1, n = 0; n < json_size(&d, 0); n++) {
        size_t kl, vl;
        json_raw(&d, k, &kl);
        if (!json_is_str(&d, k + 1) || kl > 64 || (json_raw(&d, k + 1, &vl), vl > 512)) {
            sl_seterr(err, errlen, "metadata values must be strings (keys up to 64, values up to 512 characters)");
            rc = SL_EINVAL;
            goto out;
        }
        k = json_skip(&d, k + 1);
    }
out:
    json_free(&d);
    return rc;
}

int store_batch_create(store *s, const char *input_file_id, const char *endpoint, const char *completion_window,
                       const char *metadata_json, char *id_out, char *err, size_t errlen)
{
    int rc = store__need_writer(s, err, errlen);
    if (rc) return rc;
    if (!input_file_id || !*input_file_id) {
        sl_seterr(err, errlen, "input_file_id is required");
        return SL_EINVAL;
    }
    if (!endpoint ||
        (strcmp(endpoint, "/v1/chat/completions") && strcmp(endpoint, "/v1/completions") && strcmp(endpoint, "/v1/responses"))) {
        sl_seterr(err, errlen, "endpoint must be '/v1/chat/completions', '/v1/completions' or '/v1/responses', not '%s'",
                  endpoint ? endpoint : "");
        return SL_EINVAL;
    }
    int64_t window = store_parse_window(completion_window, s->opts.allow_short_windows, err, errlen);
    if (window < 0) return (int)window;
    if ((rc = check_metadata(metadata_json, err, errlen))) return rc;
    sqlite3_stmt *st = db_prep(s, "SELECT purpose FROM files WHERE id = ?", err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, input_file_id, -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    if (r == SQLITE_DONE) {
        sl_seterr(err, errlen, "No such File object: %s", input_file_id);
        rc = STORE_ENOTFOUND;
    } else if (r != SQLITE_ROW) {
        rc = db_fail(s, "batch input", err, errlen);
    } else if (strcmp(db_text(st, 0), "batch") != 0) {
        sl_seterr(err, errlen, "file %s has purpose '%s'; a batch needs a file uploaded with purpose 'batch'",
                  input_file_id, db_text(st, 0));
        rc = SL_EINVAL;
    }
    sqlite3_finalize(st);
    if (rc) return rc;

    char id[STORE_ID_MAX];
    if ((rc = store__new_id("batch_", id, err, errlen))) return rc;
    int64_t now = store__now(s);
    st = db_prep(s,
                 "INSERT INTO batches (id, input_file_id, endpoint, completion_window, window_s, metadata, status,"
                 " created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, 'validating', ?, ?)",
                 err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, input_file_id, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, endpoint, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 4, completion_window, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 5, window);
    sqlite3_bind_text(st, 6, metadata_json, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 7, now);
    sqlite3_bind_int64(st, 8, now + window);
    rc = sqlite3_step(st) == SQLITE_DONE ? 0 : db_fail(s, "insert batch", err, errlen);
    sqlite3_finalize(st);
    if (rc) return rc;
    /* committed as `validating` first: a crash during validation resumes it */
    rc = store__validate_batch(s, id, err, errlen);
    if (rc) {
        /* not the file's fault: take the batch back rather than leave a
         * validating batch the client never heard of */
        st = db_prep(s, "DELETE FROM batches WHERE id = ?", NULL, 0);
        if (st) {
            sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
            sqlite3_step(st);
            sqlite3_finalize(st);
        }
        return rc;
    }
    store__copy_id(id_out, id);
    return 0;
}

/* ---- batch objects ------------------------------------------------------------------------- */

#define BATCH_COLS                                                                                          \
    "id, endpoint, errors, input_file_id, completion_window, status, output_file_id, error_file_id,"        \
    " created_at, in_progress_at, expires_at, finalizing_at, completed_at, failed_at, expired_at,"          \
    " cancelling_at, cancelled_at, n_total, n_completed, n_failed, metadata"

static void add_text_or_null(struct json_buf *b, sqlite3_stmt *st, int i, bool raw)
{
    const char *t = db_text(st, i);
    if (!t) json_buf_add(b, "null", 4);
    else if (raw) json_buf_add(b, t, (size_t)sqlite3_column_bytes(st, i));
    else json_buf_add_str(b, t, (size_t)sqlite3_column_bytes(st, i));
}

static void batch_json(sqlite3_stmt *st, struct json_buf *b)
{
    /* BATCH_COLS in order: 8 text columns (errors holds JSON), then 9 times */
    static const char *const text[] = {"id",     "endpoint",       "errors",        "input_file_id", "completion_window",
                                       "status", "output_file_id", "error_file_id"};
    static const char *const ts[] = {"created_at",  "in_progress_at", "expires_at",    "finalizing_at",
                                     "completed_at", "failed_at",      "expired_at",    "cancelling_at",
                                     "cancelled_at"};
    for (int i = 0; i < 8; i++) {
        json_buf_addf(b, "%s\"%s\":", i ? "," : "{", text[i]);
        add_text_or_null(b, st, i, i == 2);
        if (i == 0) json_buf_lit(b, ",\"object\":\"batch\"");
    }
    for (int i = 0; i < 9; i++) {
        json_buf_addf(b, ",\"%s\":", ts[i]);
        if (sqlite3_column_type(st, 8 + i) == SQLITE_NULL) json_buf_add(b, "null", 4);
        else json_buf_addf(b, "%lld", (long long)sqlite3_column_int64(st, 8 + i));
    }
    json_buf_addf(b, ",\"request_counts\":{\"total\":%lld,\"completed\":%lld,\"failed\":%lld},\"metadata\":",
                  (long long)sqlite3_column_int64(st, 17), (long long)sqlite3_column_int64(st, 18),
                  (long long)sqlite3_column_int64(st, 19));
    add_text_or_null(b, st, 20, true);
    json_buf_add(b, "}", 1);
}

static sqlite3_stmt *batch_row(store *s, const char *id, int *rc, char *err, size_t errlen)
{
    sqlite3_stmt *st = db_prep(s, "SELECT " BATCH_COLS " FROM batches WHERE id = ?", err, errlen);
    *rc = STORE_EDB;
    if (!st) return NULL;
    sqlite3_bind_text(st, 1, id ? id : "", -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    if (r == SQLITE_ROW) {
        *rc = 0;
        return st;
    }
    if (r == SQLITE_DONE) {
        sl_seterr(err, errlen, "No such Batch object: %s", id ? id : "");
        *rc = STORE_ENOTFOUND;
    } else {
        db_fail(s, "get batch", err, errlen);
    }
    sqlite3_finalize(st);
    return NULL;
}

int store_batch_get(store *s, const char *id, struct store_batch_info *out, char *err, size_t errlen)
{
    int rc;
    sqlite3_stmt *st = batch_row(s, id, &rc, err, errlen);
    if (!st) return rc;
    memset(out, 0, sizeof *out);
    store__copy_id(out->id, db_text(st, 0));
    out->status = store__status_of(db_text(st, 5));
    store__copy_id(out->output_file_id, db_text(st, 6));
    store__copy_id(out->error_file_id, db_text(st, 7));
    out->created_at = sqlite3_column_int64(st, 8);
    out->expires_at = sqlite3_column_int64(st, 10);
    out->total = sqlite3_column_int64(st, 17);
    out->completed = sqlite3_column_int64(st, 18);
    out->failed = sqlite3_column_int64(st, 19);
    sqlite3_finalize(st);
    return 0;
}

int store_batch_get_json(store *s, const char *id, struct json_buf *out, char *err, size_t errlen)
{
    int rc;
    sqlite3_stmt *st = batch_row(s, id, &rc, err, errlen);
    if (!st) return rc;
    batch_json(st, out);
    sqlite3_finalize(st);
    if (out->oom) {
        sl_seterr(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    return 0;
}

int store_batch_list_json(store *s, const char *after, int limit, struct json_buf *out, char *err, size_t errlen)
{
    if (limit <= 0) limit = 20;
    if (limit > 100) limit = 100;
    int64_t seq;
    int rc = store__after_seq(s, "batches", after, &seq, err, errlen);
    if (rc) return rc;
    sqlite3_stmt *st = db_prep(s, "SELECT " BATCH_COLS " FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?", err,
                               errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_int64(st, 1, seq);
    sqlite3_bind_int(st, 2, limit + 1);
    return store__list_json(s, st, limit, batch_json, "list batches", out, err, errlen);
}
