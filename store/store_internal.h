/* store_internal.h - shared by the store's files, nothing outside store/
 * includes it: store.c (the handle, SQL helpers, schema, open/close, crash
 * recovery, the names the store owns), store_file.c (files and listings),
 * store_batch.c (batch validation, creation and batch objects),
 * store_finish.c (output files, terminal states, cancel and expiry) and
 * store_feed.c (claiming rows and writing results).
 *
 * Every function here runs on the thread that holds the handle, as the
 * public ones do (store.h). Those that can fail return 0 or a negative
 * status and write a message into err.
 */
#ifndef SLUICE_STORE_INTERNAL_H
#define SLUICE_STORE_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include <sqlite3.h>

#include "store/store.h"

struct store {
    sqlite3 *db;          /* owned; one connection, one thread at a time */
    bool writer;
    char *dir;            /* owned: the data directory */
    struct store_opts opts;
    int64_t (*now)(void *ctx);
    void *now_ctx;
};

#define STORE_CHUNK (64 * 1024)   /* read buffer for file contents */

/* ---- SQL helpers (store.c) --------------------------------------------------------- */

int db_fail(store *s, const char *what, char *err, size_t errlen);    /* always STORE_EDB */
int db_exec(store *s, const char *sql, char *err, size_t errlen);
int db_begin(store *s, char *err, size_t errlen);                     /* BEGIN IMMEDIATE */
int db_commit(store *s, char *err, size_t errlen);
void db_rollback(store *s);                                           /* a no-op outside a transaction */
sqlite3_stmt *db_prep(store *s, const char *sql, char *err, size_t errlen);  /* NULL on error */
const char *db_text(sqlite3_stmt *st, int i);

/* ---- small helpers (store.c) ------------------------------------------------------- */

int64_t store__now(store *s);                         /* the store's clock (store_set_clock) */
void store__copy_id(char *dst, const char *src);      /* into a STORE_ID_MAX buffer */
char *store__strdup(const char *s);                   /* NULL stays NULL */
int store__new_id(const char *prefix, char *out, char *err, size_t errlen);   /* prefix + 24 hex digits */
char *store__path_join(const char *a, const char *b); /* malloc'ed a/b */
int store__need_writer(store *s, char *err, size_t errlen);   /* SL_EINVAL on a reader handle */

/* ---- the names the store owns (store.c) -------------------------------------------- */

void store__content_name(const char *id, char *rel, size_t cap);   /* files/<id>.sluice */
/* Records one name in owned_names inside the caller's transaction. */
int store__claim_in_txn(store *s, const char *rel, char *err, size_t errlen);
/* Records names in owned_names, committed, before their files exist. Runs
 * its own transaction: call it outside one. */
int store__claim_names(store *s, const char *const *rels, int n, char *err, size_t errlen);
/* Forgets names (inside the caller's transaction, or on their own). */
int store__forget_names(store *s, const char *const *rels, int n, char *err, size_t errlen);
/* Removes the file of a name this store recorded: only a store-shaped name. */
void store__remove_owned(store *s, const char *rel);

/* ---- files and listings (store_file.c) --------------------------------------------- */

int store__insert_file_row(store *s, const char *id, const char *purpose, const char *filename, int64_t bytes,
                           int64_t lines, const char *rel, char *err, size_t errlen);
/* The seq of `after` in table (files or batches), or INT64_MAX for none. */
int store__after_seq(store *s, const char *table, const char *after, int64_t *seq, char *err, size_t errlen);
/* Runs st (rows newest first, limit + 1 of them asked for) into an OpenAI
 * list object: row() writes each object; the extra row only sets has_more.
 * Finalizes st. */
int store__list_json(store *s, sqlite3_stmt *st, int limit, void (*row)(sqlite3_stmt *, struct json_buf *),
                     const char *what, struct json_buf *out, char *err, size_t errlen);

/* ---- batches (store_batch.c) ------------------------------------------------------- */

/* Validates the batch's input file and creates its rows (one transaction),
 * moving it from validating to in_progress or failed. Returns 0 (either
 * way) or a negative status for an I/O or database failure, leaving the
 * batch `validating` for a later retry. */
int store__validate_batch(store *s, const char *id, char *err, size_t errlen);

/* ---- finishing (store_finish.c) ---------------------------------------------------- */

enum store_batch_status store__status_of(const char *name);   /* STORE_BATCH_FAILED for an unknown name */
/* Writes the output and error files, records them, and moves the batch to
 * target; safe to repeat after a crash or a failure. */
int store__finish_batch(store *s, const char *id, enum store_batch_status target, char *err, size_t errlen);
/* Moves a batch on when nothing is left to do for it. Returns 1 when its
 * status changed, 0 when not, or an error. */
int store__settle(store *s, const char *id, char *err, size_t errlen);
/* ids of batches matching a query with one int64 parameter, malloc'ed */
int store__collect_ids(store *s, const char *sql, int64_t p, char (**ids)[STORE_ID_MAX], int *n, char *err,
                       size_t errlen);

#endif
