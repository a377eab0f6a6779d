/* store_feed.c - feeding the engine (store.h): claiming pending rows and
 * writing finished rows' results, each in the transaction that marks it done.
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

/* ---- feeding ---------------------------------------------------------------------------------- */

void store_rows_free(struct store_row *rows, int n)
{
    if (!rows) return;
    for (int i = 0; i < n; i++) {
        free(rows[i].custom_id);
        free(rows[i].url);
        free(rows[i].body);
    }
    free(rows);
}

int store_claim_pending(store *s, int max_n, struct store_row **rows_out, char *err, size_t errlen)
{
    *rows_out = NULL;
    int rc = store__need_writer(s, err, errlen);
    if (rc) return rc;
    if (max_n <= 0) return 0;
    if (max_n > 1 << 20) max_n = 1 << 20;
    char (*ids)[STORE_ID_MAX];
    int nb;
    if ((rc = store__collect_ids(s, "SELECT id FROM batches WHERE status = 'in_progress' ORDER BY seq", 0, &ids,
                                 &nb, err, errlen)))
        return rc;
    struct store_row *rows = NULL;
    int n = 0;
    sqlite3_stmt *sel = NULL, *upd = NULL;
    if (!nb) goto done;
    rows = calloc((size_t)max_n, sizeof *rows);
    if (!rows) {
        sl_seterr(err, errlen, "out of memory");
        rc = SL_ENOMEM;
        goto fail;
    }
    if ((rc = db_begin(s, err, errlen))) goto fail;
    sel = db_prep(s,
                  "SELECT id, line, custom_id, url, body FROM batch_requests"
                  " WHERE batch_id = ? AND state = 'pending' ORDER BY line LIMIT ?",
                  err, errlen);
    upd = db_prep(s, "UPDATE batch_requests SET state = 'running' WHERE id = ?", err, errlen);
    if (!sel || !upd) {
        rc = STORE_EDB;
        goto fail_txn;
    }
    for (int b = 0; b < nb && n < max_n; b++) {
        sqlite3_bind_text(sel, 1, ids[b], -1, SQLITE_STATIC);
        sqlite3_bind_int(sel, 2, max_n - n);
        int r, first = n;
        while ((r = sqlite3_step(sel)) == SQLITE_ROW) {
            struct store_row *w = &rows[n++];
            w->row_id = sqlite3_column_int64(sel, 0);
            w->line = sqlite3_column_int64(sel, 1);
            store__copy_id(w->batch_id, ids[b]);
            w->custom_id = store__strdup(db_text(sel, 2));
            w->url = store__strdup(db_text(sel, 3));
            w->body = store__strdup(db_text(sel, 4));
            w->body_len = (size_t)sqlite3_column_bytes(sel, 4);
            if (!w->custom_id || !w->url || !w->body) {
                sl_seterr(err, errlen, "out of memory");
                rc = SL_ENOMEM;
                sqlite3_reset(sel);
                goto fail_txn;
            }
        }
        sqlite3_reset(sel);
        if (r != SQLITE_DONE) {
            rc = db_fail(s, "claim", err, errlen);
            goto fail_txn;
        }
        /* mark after reading: the partial index being walked would change */
        for (int i = first; i < n; i++) {
            sqlite3_bind_int64(upd, 1, rows[i].row_id);
            r = sqlite3_step(upd);
            sqlite3_reset(upd);
            if (r != SQLITE_DONE) {
                rc = db_fail(s, "claim", err, errlen);
                goto fail_txn;
            }
        }
    }
    sqlite3_finalize(sel);
    sqlite3_finalize(upd);
    sel = upd = NULL;
    if ((rc = db_commit(s, err, errlen))) goto fail_txn;
done:
    free(ids);
    if (!n) {
        free(rows);
        rows = NULL;
    }
    *rows_out = rows;
    return n;

fail_txn:
    sqlite3_finalize(sel);
    sqlite3_finalize(upd);
    db_rollback(s);
fail:
    store_rows_free(rows, n);
    free(ids);
    return rc;
}

/* A result body as it is stored: valid JSON text kept as is, anything else
 * stored as a JSON string so the output file stays valid JSONL. */
static char *normalize_body(const char *body, bool *owned)
{
    *owned = false;
    if (!body) return NULL;
    json_doc d;
    char e[64];
    if (json_parse(&d, body, strlen(body), e, sizeof e) == 0) {
        json_free(&d);
        return (char *)body;
    }
    struct json_buf b;
    json_buf_init(&b);
    json_buf_add_str(&b, body, strlen(body));
    if (b.oom) {
        json_buf_free(&b);
        return NULL;
    }
    *owned = true;
    return b.p;
}

int store_complete_rows(store *s, struct store_result *results, int n, char *err, size_t errlen)
{
    int rc = store__need_writer(s, err, errlen);
    if (rc) return rc;
    if (n <= 0) return 0;
    char (*touched)[STORE_ID_MAX] = calloc((size_t)n, STORE_ID_MAX);
    if (!touched) {
        sl_seterr(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    int nt = 0, applied = 0;
    sqlite3_stmt *get = NULL, *upd = NULL, *cnt = NULL;
    if ((rc = db_begin(s, err, errlen))) goto fail;
    get = db_prep(s, "SELECT batch_id, state FROM batch_requests WHERE id = ?", err, errlen);
    upd = db_prep(s,
                  "UPDATE batch_requests SET state = ?, status_code = ?, result = ?, error = ?, request_id = ?,"
                  " finished_at = ? WHERE id = ? AND state IN ('pending', 'running')",
                  err, errlen);
    cnt = db_prep(s, "UPDATE batches SET n_completed = n_completed + ?, n_failed = n_failed + ? WHERE id = ?", err,
                  errlen);
    if (!get || !upd || !cnt) {
        rc = STORE_EDB;
        goto fail_txn;
    }
    int64_t now = store__now(s);
    for (int i = 0; i < n; i++) {
        struct store_result *res = &results[i];
        sqlite3_bind_int64(get, 1, res->row_id);
        int r = sqlite3_step(get);
        if (r == SQLITE_DONE) {
            sqlite3_reset(get);
            res->outcome = STORE_DROPPED;
            continue;
        }
        if (r != SQLITE_ROW) {
            sqlite3_reset(get);
            rc = db_fail(s, "complete", err, errlen);
            goto fail_txn;
        }
        char batch[STORE_ID_MAX], state[16];
        store__copy_id(batch, db_text(get, 0));
        snprintf(state, sizeof state, "%s", db_text(get, 1));
        sqlite3_reset(get);
        if (!strcmp(state, "done") || !strcmp(state, "failed")) {
            res->outcome = STORE_DUPLICATE;
            continue;
        }
        if (strcmp(state, "pending") && strcmp(state, "running")) {
            res->outcome = STORE_DROPPED;
            continue;
        }
        /* a row its batch's cancellation stopped did not run to a result:
         * it is `cancelled` like the rows never started (counted as failed
         * once the batch is cancelled) */
        bool cancelled = res->cancelled;
        bool ok = !cancelled && !res->error_code && res->status_code >= 200 && res->status_code < 300;
        bool owned;
        char *body = cancelled ? NULL : normalize_body(res->body, &owned);
        if (cancelled) owned = false;
        const char *code = cancelled ? "batch_cancelled" : res->error_code;
        struct json_buf e;
        json_buf_init(&e);
        if (code)
            store_error_json(&e, code, res->error_message ? res->error_message
                                       : cancelled        ? "The batch was cancelled while this request ran."
                                                          : "");
        if ((res->body && !body && !cancelled) || e.oom) {
            if (owned) free(body);
            json_buf_free(&e);
            sl_seterr(err, errlen, "out of memory");
            rc = SL_ENOMEM;
            goto fail_txn;
        }
        sqlite3_bind_text(upd, 1, cancelled ? "cancelled" : ok ? "done" : "failed", -1, SQLITE_STATIC);
        if (res->status_code && !cancelled) sqlite3_bind_int(upd, 2, res->status_code);
        else sqlite3_bind_null(upd, 2);
        sqlite3_bind_text(upd, 3, body, -1, SQLITE_STATIC);
        sqlite3_bind_text(upd, 4, e.p, (int)e.len, SQLITE_STATIC);
        sqlite3_bind_text(upd, 5, cancelled ? NULL : res->request_id, -1, SQLITE_STATIC);
        sqlite3_bind_int64(upd, 6, now);
        sqlite3_bind_int64(upd, 7, res->row_id);
        r = sqlite3_step(upd);
        sqlite3_reset(upd);
        sqlite3_clear_bindings(upd);
        if (owned) free(body);
        json_buf_free(&e);
        if (r != SQLITE_DONE) {
            rc = db_fail(s, "complete", err, errlen);
            goto fail_txn;
        }
        sqlite3_bind_int(cnt, 1, ok ? 1 : 0);
        sqlite3_bind_int(cnt, 2, ok || cancelled ? 0 : 1);
        sqlite3_bind_text(cnt, 3, batch, -1, SQLITE_TRANSIENT);
        r = sqlite3_step(cnt);
        sqlite3_reset(cnt);
        if (r != SQLITE_DONE) {
            rc = db_fail(s, "complete", err, errlen);
            goto fail_txn;
        }
        res->outcome = STORE_APPLIED;
        applied++;
        int t = 0;
        while (t < nt && strcmp(touched[t], batch)) t++;
        if (t == nt) store__copy_id(touched[nt++], batch);
    }
    sqlite3_finalize(get);
    sqlite3_finalize(upd);
    sqlite3_finalize(cnt);
    get = upd = cnt = NULL;
    if ((rc = db_commit(s, err, errlen))) goto fail_txn;
    /* the results are safe: a failure from here on (the output file on a
     * full disk) is not theirs, and store_tick() retries finalizing */
    for (int t = 0; t < nt; t++) {
        char e2[256];
        if (store__settle(s, touched[t], e2, sizeof e2) < 0) break;
    }
    free(touched);
    return applied;

fail_txn:
    sqlite3_finalize(get);
    sqlite3_finalize(upd);
    sqlite3_finalize(cnt);
    db_rollback(s);
fail:
    free(touched);
    return rc;
}
