/* store_finish.c - the end of a batch (store.h): writing the output and
 * error files in input order, the terminal states (settle, finish), cancel
 * and expiry (store_tick). The state chart is at the top of store.c.
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

/* ---- finishing a batch ------------------------------------------------------------------ */

static const char *const status_names[] = {
    [STORE_BATCH_VALIDATING] = "validating", [STORE_BATCH_FAILED] = "failed",
    [STORE_BATCH_IN_PROGRESS] = "in_progress", [STORE_BATCH_FINALIZING] = "finalizing",
    [STORE_BATCH_COMPLETED] = "completed", [STORE_BATCH_EXPIRED] = "expired",
    [STORE_BATCH_CANCELLING] = "cancelling", [STORE_BATCH_CANCELLED] = "cancelled",
};

const char *store_batch_status_name(enum store_batch_status st)
{
    return (unsigned)st < sizeof status_names / sizeof status_names[0] ? status_names[st] : "unknown";
}

enum store_batch_status store__status_of(const char *name)
{
    for (unsigned i = 0; i < sizeof status_names / sizeof status_names[0]; i++)
        if (name && strcmp(name, status_names[i]) == 0) return (enum store_batch_status)i;
    return STORE_BATCH_FAILED;
}

/* An output/error file under construction: created at its final name
 * (owned, recorded before) on its first line; a row makes it visible. */
struct outfile {
    char id[STORE_ID_MAX];
    char rel[STORE_ID_MAX + 16];
    char path[512];
    FILE *f;
    int64_t lines, bytes;
};

static int outfile_line(struct outfile *o, struct json_buf *line, char *err, size_t errlen)
{
    if (!o->f) {
        o->f = fopen(o->path, "wxe");
        if (!o->f) {
            sl_seterr(err, errlen, "cannot create %s: %s", o->path, strerror(errno));
            return SL_EIO;
        }
    }
    if (fwrite(line->p, 1, line->len, o->f) != line->len) {
        sl_seterr(err, errlen, "writing %s: %s", o->path, strerror(errno));
        return SL_EIO;
    }
    o->lines++;
    o->bytes += (int64_t)line->len;
    return 0;
}

static int outfile_close(struct outfile *o, char *err, size_t errlen)
{
    if (!o->f) return 0;
    int bad = fflush(o->f) != 0 || fsync(fileno(o->f)) != 0;
    bad |= fclose(o->f) != 0;
    o->f = NULL;
    if (bad) {
        sl_seterr(err, errlen, "writing %s: %s", o->path, strerror(errno));
        return SL_EIO;
    }
    return 0;
}

/* Stored JSON text (validated when it was written), or null. */
static void add_raw_or_null(struct json_buf *b, const char *txt, size_t n)
{
    if (!txt) {
        json_buf_add(b, "null", 4);
        return;
    }
    json_buf_add(b, txt, n);
}

void store_result_line(struct json_buf *b, const char *id, const char *custom_id, size_t custom_id_len,
                       int status_code, const char *request_id, size_t request_id_len, const char *body,
                       size_t body_len, const char *error, size_t error_len)
{
    json_buf_add(b, "{\"id\":", 6);
    json_buf_add_str(b, id, strlen(id));
    json_buf_add(b, ",\"custom_id\":", 13);
    if (custom_id) json_buf_add_str(b, custom_id, custom_id_len);
    else json_buf_add(b, "null", 4);
    json_buf_add(b, ",\"response\":", 12);
    if (!status_code) {
        json_buf_add(b, "null", 4);
    } else {
        json_buf_addf(b, "{\"status_code\":%d,\"request_id\":", status_code);
        if (request_id) json_buf_add_str(b, request_id, request_id_len);
        else json_buf_add(b, "null", 4);
        json_buf_add(b, ",\"body\":", 8);
        add_raw_or_null(b, body, body_len);
        json_buf_add(b, "}", 1);
    }
    json_buf_add(b, ",\"error\":", 9);
    add_raw_or_null(b, error, error_len);
    json_buf_add(b, "}", 1);
}

void store_error_json(struct json_buf *b, const char *code, const char *message)
{
    json_buf_add(b, "{\"code\":", 8);
    json_buf_add_str(b, code, strlen(code));
    json_buf_add(b, ",\"message\":", 11);
    json_buf_add_str(b, message, strlen(message));
    json_buf_add(b, "}", 1);
}

/* One output/error line for the row at the cursor (columns: line, custom_id,
 * state, status_code, result, error, request_id). */
static void result_line(struct json_buf *b, const char *batch_id, sqlite3_stmt *st)
{
    const char *hex = strchr(batch_id, '_');
    char id[STORE_ID_MAX + 32];
    snprintf(id, sizeof id, "batch_req_%s%08llx", hex ? hex + 1 : batch_id,
             (unsigned long long)sqlite3_column_int64(st, 0));
    int status = sqlite3_column_type(st, 3) == SQLITE_NULL ? 0 : sqlite3_column_int(st, 3);
    store_result_line(b, id, db_text(st, 1), (size_t)sqlite3_column_bytes(st, 1), status, db_text(st, 6),
                      (size_t)sqlite3_column_bytes(st, 6), db_text(st, 4), (size_t)sqlite3_column_bytes(st, 4),
                      db_text(st, 5), (size_t)sqlite3_column_bytes(st, 5));
    json_buf_add(b, "\n", 1);
}

/* Writes the output and error files of a batch whose rows are all finished,
 * records them, and moves the batch to `target`. Safe to repeat after a
 * crash or a failure (a full disk): both names are recorded before either
 * file is created, and only the final transaction makes the files (and the
 * new status) visible; a failure removes what was written. */
int store__finish_batch(store *s, const char *id, enum store_batch_status target, char *err, size_t errlen)
{
    struct outfile out = {0}, bad = {0};
    struct outfile *of[2] = {&out, &bad};
    for (int k = 0; k < 2; k++) {
        int rc = store__new_id("file-", of[k]->id, err, errlen);
        if (rc) return rc;
        store__content_name(of[k]->id, of[k]->rel, sizeof of[k]->rel);
        snprintf(of[k]->path, sizeof of[k]->path, "%s/%s", s->dir, of[k]->rel);
    }
    const char *rels[2] = {out.rel, bad.rel};
    int rc = store__claim_names(s, rels, 2, err, errlen);
    if (rc) return rc;
    struct json_buf line;
    json_buf_init(&line);
    sqlite3_stmt *st = db_prep(s,
                               "SELECT line, custom_id, state, status_code, result, error, request_id"
                               " FROM batch_requests WHERE batch_id = ? ORDER BY line",
                               err, errlen);
    if (!st) {
        rc = STORE_EDB;
        goto fail_files;
    }
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    int r = SQLITE_DONE;
    while (!rc && (r = sqlite3_step(st)) == SQLITE_ROW) {
        line.len = 0;
        result_line(&line, id, st);
        if (line.oom) {
            sl_seterr(err, errlen, "out of memory");
            rc = SL_ENOMEM;
            break;
        }
        rc = outfile_line(strcmp(db_text(st, 2), "done") == 0 ? &out : &bad, &line, err, errlen);
    }
    if (!rc && r != SQLITE_DONE) rc = db_fail(s, "finalize", err, errlen);
    sqlite3_finalize(st);
    json_buf_free(&line);
    if (!rc) rc = outfile_close(&out, err, errlen);
    if (!rc) rc = outfile_close(&bad, err, errlen);
    if (rc) goto fail_files;

    if ((rc = db_begin(s, err, errlen))) goto fail_files;
    char name[STORE_ID_MAX + 16];
    if (out.lines) {
        snprintf(name, sizeof name, "%s_output.jsonl", id);
        if ((rc = store__insert_file_row(s, out.id, "batch_output", name, out.bytes, out.lines, out.rel, err, errlen)))
            goto fail_txn;
    }
    if (bad.lines) {
        snprintf(name, sizeof name, "%s_error.jsonl", id);
        if ((rc = store__insert_file_row(s, bad.id, "batch_output", name, bad.bytes, bad.lines, bad.rel, err, errlen)))
            goto fail_txn;
    }
    if ((rc = store__forget_names(s, rels, 2, err, errlen))) goto fail_txn;
    char sql[256];
    const char *tname = store_batch_status_name(target);
    snprintf(sql, sizeof sql,
             "UPDATE batches SET status = '%s', %s_at = ?, output_file_id = ?, error_file_id = ?, finish = NULL"
             " WHERE id = ? AND status IN ('finalizing', 'cancelling')",
             tname, tname);
    st = db_prep(s, sql, err, errlen);
    if (!st) {
        rc = STORE_EDB;
        goto fail_txn;
    }
    sqlite3_bind_int64(st, 1, store__now(s));
    sqlite3_bind_text(st, 2, out.lines ? out.id : NULL, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, bad.lines ? bad.id : NULL, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 4, id, -1, SQLITE_STATIC);
    rc = sqlite3_step(st) == SQLITE_DONE ? 0 : db_fail(s, "finish batch", err, errlen);
    sqlite3_finalize(st);
    if (rc) goto fail_txn;
    if ((rc = db_commit(s, err, errlen))) goto fail_txn;
    return 1;

fail_txn:
    db_rollback(s);
fail_files:
    for (int k = 0; k < 2; k++) {
        if (of[k]->f) fclose(of[k]->f);
        store__remove_owned(s, of[k]->rel);
    }
    store__forget_names(s, rels, 2, NULL, 0);
    return rc;
}

/* 1 if the batch has a row in `state` (pending or running), 0 if not. */
static int has_rows(store *s, const char *id, const char *state, char *err, size_t errlen)
{
    /* literal states so that the partial indexes apply */
    sqlite3_stmt *st = db_prep(s,
                               strcmp(state, "pending") == 0
                                ? "SELECT 1 FROM batch_requests WHERE batch_id = ? AND state = 'pending' LIMIT 1"
                                : "SELECT 1 FROM batch_requests WHERE batch_id = ? AND state = 'running' LIMIT 1",
                            err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    sqlite3_finalize(st);
    if (r == SQLITE_ROW) return 1;
    if (r == SQLITE_DONE) return 0;
    return db_fail(s, "has rows", err, errlen);
}

static int exec_bound(store *s, const char *sql, const char *id, int64_t t, char *err, size_t errlen)
{
    sqlite3_stmt *st = db_prep(s, sql, err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 2, t);
    int rc = sqlite3_step(st) == SQLITE_DONE ? sqlite3_changes(s->db) : db_fail(s, "update", err, errlen);
    sqlite3_finalize(st);
    return rc;
}

/* Moves a batch on when nothing is left to do for it (see the state chart at
 * the top). Returns 1 when its status changed, 0 when not, or an error. */
int store__settle(store *s, const char *id, char *err, size_t errlen)
{
    sqlite3_stmt *st = db_prep(s, "SELECT status, finish FROM batches WHERE id = ?", err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    if (r != SQLITE_ROW) {
        sqlite3_finalize(st);
        return r == SQLITE_DONE ? 0 : db_fail(s, "settle", err, errlen);
    }
    enum store_batch_status cur = store__status_of(db_text(st, 0));
    enum store_batch_status target = db_text(st, 1) ? store__status_of(db_text(st, 1)) : STORE_BATCH_COMPLETED;
    sqlite3_finalize(st);
    int rc;
    switch (cur) {
    case STORE_BATCH_IN_PROGRESS:
        if ((rc = has_rows(s, id, "pending", err, errlen))) return rc < 0 ? rc : 0;
        if ((rc = has_rows(s, id, "running", err, errlen))) return rc < 0 ? rc : 0;
        rc = exec_bound(s,
                        "UPDATE batches SET status = 'finalizing', finalizing_at = ?2, finish = 'completed'"
                        " WHERE id = ?1 AND status = 'in_progress'",
                        id, store__now(s), err, errlen);
        if (rc < 0) return rc;
        target = STORE_BATCH_COMPLETED;
        break;
    case STORE_BATCH_CANCELLING:
        if ((rc = has_rows(s, id, "running", err, errlen))) return rc < 0 ? rc : 0;
        /* rows put back to pending by crash recovery are cancelled too */
        rc = exec_bound(s,
                        "UPDATE batch_requests SET state = 'cancelled', finished_at = ?2,"
                        " error = '{\"code\":\"batch_cancelled\",\"message\":\"The batch was cancelled before"
                        " this request ran.\"}' WHERE batch_id = ?1 AND state = 'pending'",
                        id, store__now(s), err, errlen);
        if (rc < 0) return rc;
        /* every line of the error file counts as failed, the cancelled ones too, so that completed +
         * failed = total = the lines of the two files (as expired rows count); set, not added: idempotent */
        rc = exec_bound(s,
                        "UPDATE batches SET n_failed = (SELECT count(*) FROM batch_requests WHERE batch_id = ?1"
                        " AND state IN ('failed', 'cancelled', 'expired')) WHERE id = ?1",
                        id, 0, err, errlen);
        if (rc < 0) return rc;
        target = STORE_BATCH_CANCELLED;
        break;
    case STORE_BATCH_FINALIZING:
        break;
    default:
        return 0;
    }
    return store__finish_batch(s, id, target, err, errlen);
}

/* ---- cancel and expiry ------------------------------------------------------------------------ */

int store_batch_cancel(store *s, const char *id, char *err, size_t errlen)
{
    int rc = store__need_writer(s, err, errlen);
    if (rc) return rc;
    struct store_batch_info b;
    if ((rc = store_batch_get(s, id, &b, err, errlen))) return rc;
    switch (b.status) {
    case STORE_BATCH_CANCELLING:
    case STORE_BATCH_CANCELLED:
        return 0;
    case STORE_BATCH_VALIDATING:
    case STORE_BATCH_IN_PROGRESS:
        break;
    default:
        sl_seterr(err, errlen, "Cannot cancel a batch with status '%s'.", store_batch_status_name(b.status));
        return STORE_ECONFLICT;
    }
    int64_t now = store__now(s);
    if ((rc = db_begin(s, err, errlen))) return rc;
    rc = exec_bound(s,
                    "UPDATE batches SET status = 'cancelling', cancelling_at = ?2, finish = 'cancelled'"
                    " WHERE id = ?1 AND status IN ('validating', 'in_progress')",
                    id, now, err, errlen);
    if (rc >= 0)
        rc = exec_bound(s,
                        "UPDATE batch_requests SET state = 'cancelled', finished_at = ?2,"
                        " error = '{\"code\":\"batch_cancelled\",\"message\":\"The batch was cancelled before"
                        " this request ran.\"}' WHERE batch_id = ?1 AND state = 'pending'",
                        id, now, err, errlen);
    if (rc < 0) {
        db_rollback(s);
        return rc;
    }
    if ((rc = db_commit(s, err, errlen))) {
        db_rollback(s);
        return rc;
    }
    rc = store__settle(s, id, err, errlen);
    return rc < 0 ? rc : 0;
}

/* ids of batches matching a query with one int64 parameter, malloc'ed */
int store__collect_ids(store *s, const char *sql, int64_t p, char (**ids)[STORE_ID_MAX], int *n, char *err,
                       size_t errlen)
{
    *ids = NULL;
    *n = 0;
    sqlite3_stmt *st = db_prep(s, sql, err, errlen);
    if (!st) return STORE_EDB;
    if (sqlite3_bind_parameter_count(st) > 0) sqlite3_bind_int64(st, 1, p);
    int cap = 0, r, rc = 0;
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            void *q = realloc(*ids, (size_t)cap * STORE_ID_MAX);
            if (!q) {
                sl_seterr(err, errlen, "out of memory");
                rc = SL_ENOMEM;
                break;
            }
            *ids = q;
        }
        store__copy_id((*ids)[(*n)++], db_text(st, 0));
    }
    if (!rc && r != SQLITE_DONE) rc = db_fail(s, "collect", err, errlen);
    sqlite3_finalize(st);
    if (rc) {
        free(*ids);
        *ids = NULL;
        *n = 0;
    }
    return rc;
}

static int expire_batch(store *s, const char *id, int64_t now, char *err, size_t errlen)
{
    int rc = db_begin(s, err, errlen);
    if (rc) return rc;
    int n = exec_bound(s,
                       "UPDATE batch_requests SET state = 'expired', finished_at = ?2,"
                       " error = '{\"code\":\"batch_expired\",\"message\":\"This request could not be executed"
                       " before the completion window expired.\"}'"
                       " WHERE batch_id = ?1 AND state IN ('pending', 'running')",
                       id, now, err, errlen);
    if (n < 0) goto fail;
    sqlite3_stmt *st = db_prep(s,
                               "UPDATE batches SET status = 'finalizing', finish = 'expired', n_failed = n_failed + ?"
                               " WHERE id = ? AND status = 'in_progress'",
                               err, errlen);
    if (!st) {
        n = STORE_EDB;
        goto fail;
    }
    sqlite3_bind_int(st, 1, n);
    sqlite3_bind_text(st, 2, id, -1, SQLITE_STATIC);
    n = sqlite3_step(st) == SQLITE_DONE ? 0 : db_fail(s, "expire", err, errlen);
    sqlite3_finalize(st);
    if (n < 0) goto fail;
    if ((rc = db_commit(s, err, errlen))) goto fail;
    return store__finish_batch(s, id, STORE_BATCH_EXPIRED, err, errlen);
fail:
    db_rollback(s);
    return n < 0 ? n : rc;
}

int store_tick(store *s, char *err, size_t errlen)
{
    int rc = store__need_writer(s, err, errlen);
    if (rc) return rc;
    int64_t now = store__now(s);
    char (*ids)[STORE_ID_MAX];
    int n, changed = 0;
    rc = store__collect_ids(s, "SELECT id FROM batches WHERE status = 'in_progress' AND expires_at <= ? ORDER BY seq", now,
                            &ids, &n, err, errlen);
    if (rc) return rc;
    for (int i = 0; i < n && !rc; i++) {
        int r = expire_batch(s, ids[i], now, err, errlen);
        if (r < 0) rc = r;
        else changed += r;
    }
    free(ids);
    if (rc) return rc;
    rc = store__collect_ids(s,
                            "SELECT id FROM batches WHERE status IN ('in_progress', 'finalizing', 'cancelling')"
                            " ORDER BY seq",
                            0, &ids, &n, err, errlen);
    if (rc) return rc;
    for (int i = 0; i < n && !rc; i++) {
        int r = store__settle(s, ids[i], err, errlen);
        if (r < 0) rc = r;
        else changed += r;
    }
    free(ids);
    return rc ? rc : changed;
}
