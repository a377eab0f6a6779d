/* store.c - the SQLite job queue declared in store.h.
 *
 * This file: the small helpers, the schema and its migrations, the names
 * the store owns, open/close and crash recovery. Files and listings are in
 * store_file.c, batch validation, creation and batch objects in
 * store_batch.c, finishing, cancel and expiry in store_finish.c, claiming
 * and completing rows in store_feed.c; the handle and what they share is in
 * store_internal.h.
 *
 * Batch states and who moves them:
 *   validating  --store_batch_create/recovery--> in_progress | failed
 *   in_progress --last row finished (store__settle)--> finalizing --store__finish_batch--> completed
 *   in_progress --store_tick past expires_at--> finalizing(finish=expired) --> expired
 *   validating/in_progress --store_batch_cancel--> cancelling --no row running--> cancelled
 * While a batch is finalizing or cancelling, `finish` holds the terminal
 * status it is heading for, so a crash in the middle resumes to the same end.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store/store_internal.h"

/* ---- helpers ------------------------------------------------------------------ */

int db_fail(store *s, const char *what, char *err, size_t errlen)
{
    sl_seterr(err, errlen, "database error (%s): %s", what, sqlite3_errmsg(s->db));
    return STORE_EDB;
}

int64_t store__now(store *s)
{
    return s->now ? s->now(s->now_ctx) : (int64_t)time(NULL);
}

int db_exec(store *s, const char *sql, char *err, size_t errlen)
{
    char *msg = NULL;
    if (sqlite3_exec(s->db, sql, NULL, NULL, &msg) != SQLITE_OK) {
        sl_seterr(err, errlen, "database error: %s", msg ? msg : sqlite3_errmsg(s->db));
        sqlite3_free(msg);
        return STORE_EDB;
    }
    return 0;
}

int db_begin(store *s, char *err, size_t errlen) { return db_exec(s, "BEGIN IMMEDIATE", err, errlen); }
int db_commit(store *s, char *err, size_t errlen) { return db_exec(s, "COMMIT", err, errlen); }
void db_rollback(store *s)
{
    if (!sqlite3_get_autocommit(s->db)) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
}

sqlite3_stmt *db_prep(store *s, const char *sql, char *err, size_t errlen)
{
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(s->db, sql, -1, &st, NULL) != SQLITE_OK) {
        db_fail(s, "prepare", err, errlen);
        return NULL;
    }
    return st;
}

const char *db_text(sqlite3_stmt *st, int i) { return (const char *)sqlite3_column_text(st, i); }

const char *const store_batch_status_names[STORE_N_BATCH_STATUS] = {
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"};

int store_queue_stats(store *s, struct store_queue_stats *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    sqlite3_stmt *st = db_prep(s, "SELECT status, count(*), sum(n_total), sum(n_completed), sum(n_failed) FROM batches "
                                  "GROUP BY status", err, errlen);
    if (!st) return STORE_EDB;
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        const char *name = db_text(st, 0);
        for (int i = 0; name && i < STORE_N_BATCH_STATUS; i++)
            if (!strcmp(name, store_batch_status_names[i])) {
                out->batches[i] = sqlite3_column_int64(st, 1);
                out->rows_total[i] = sqlite3_column_int64(st, 2);
                out->rows_completed[i] = sqlite3_column_int64(st, 3);
                out->rows_failed[i] = sqlite3_column_int64(st, 4);
            }
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) {
        db_fail(s, "queue stats", err, errlen);
        return STORE_EDB;
    }
    return 0;
}

void store__copy_id(char *dst, const char *src)
{
    snprintf(dst, STORE_ID_MAX, "%s", src ? src : "");
}

char *store__strdup(const char *s)
{
    if (!s) return NULL;
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

/* prefix + 24 random hex digits */
int store__new_id(const char *prefix, char *out, char *err, size_t errlen)
{
    unsigned char r[12];
    size_t got = 0;
    while (got < sizeof r) {
        ssize_t k = getrandom(r + got, sizeof r - got, 0);
        if (k < 0) {
            if (errno == EINTR) continue;
            sl_seterr(err, errlen, "getrandom: %s", strerror(errno));
            return SL_EIO;
        }
        got += (size_t)k;
    }
    int n = snprintf(out, STORE_ID_MAX, "%s", prefix);
    for (size_t i = 0; i < sizeof r; i++) n += snprintf(out + n, STORE_ID_MAX - (size_t)n, "%02x", r[i]);
    return 0;
}

char *store__path_join(const char *a, const char *b)
{
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", a, b);
    return p;
}

static int mkdir_p1(const char *path, char *err, size_t errlen)
{
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        sl_seterr(err, errlen, "cannot create %s: %s", path, strerror(errno));
        return SL_EIO;
    }
    return 0;
}

/* ---- schema --------------------------------------------------------------------- */

/* migrations[v] takes the schema from user_version v to v + 1. Append only:
 * never edit a step that has shipped. */
static const char *const migrations[] = {
    /* 0 -> 1: the first schema */
    "CREATE TABLE files ("
    "  seq INTEGER PRIMARY KEY,"
    "  id TEXT NOT NULL UNIQUE,"
    "  purpose TEXT NOT NULL,"
    "  filename TEXT NOT NULL,"
    "  bytes INTEGER NOT NULL,"
    "  lines INTEGER NOT NULL,"
    "  created_at INTEGER NOT NULL,"
    "  status TEXT NOT NULL DEFAULT 'processed',"
    "  path TEXT NOT NULL UNIQUE" /* relative to the data directory */
    ");"
    "CREATE INDEX files_by_purpose ON files(purpose, seq);"
    "CREATE TABLE batches ("
    "  seq INTEGER PRIMARY KEY,"
    "  id TEXT NOT NULL UNIQUE,"
    "  input_file_id TEXT NOT NULL,"
    "  endpoint TEXT NOT NULL,"
    "  completion_window TEXT NOT NULL,"
    "  window_s INTEGER NOT NULL,"
    "  metadata TEXT,"
    "  status TEXT NOT NULL CHECK (status IN ('validating','failed','in_progress','finalizing',"
    "                                         'completed','expired','cancelling','cancelled')),"
    "  finish TEXT," /* terminal status a finalizing/cancelling batch is heading for */
    "  created_at INTEGER NOT NULL,"
    "  in_progress_at INTEGER, expires_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,"
    "  failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,"
    "  output_file_id TEXT, error_file_id TEXT,"
    "  errors TEXT,"
    "  n_total INTEGER NOT NULL DEFAULT 0,"
    "  n_completed INTEGER NOT NULL DEFAULT 0,"
    "  n_failed INTEGER NOT NULL DEFAULT 0"
    ");"
    "CREATE INDEX batches_by_status ON batches(status, seq);"
    "CREATE TABLE batch_requests ("
    "  id INTEGER PRIMARY KEY,"
    "  batch_id TEXT NOT NULL REFERENCES batches(id) ON DELETE CASCADE,"
    "  line INTEGER NOT NULL," /* 0-based request index in input order */
    "  custom_id TEXT NOT NULL,"
    "  url TEXT NOT NULL,"
    "  body TEXT NOT NULL,"
    "  state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending','running','done','failed',"
    "                                                          'cancelled','expired')),"
    "  status_code INTEGER,"
    "  result TEXT,"     /* the response body, JSON */
    "  error TEXT,"      /* {\"code\",\"message\"} when there is no response */
    "  request_id TEXT,"
    "  finished_at INTEGER,"
    "  UNIQUE (batch_id, line),"
    "  UNIQUE (batch_id, custom_id)"
    ");"
    /* the feeder's queue and crash recovery read only these few rows */
    "CREATE INDEX batch_requests_pending ON batch_requests(batch_id, line) WHERE state = 'pending';"
    "CREATE INDEX batch_requests_running ON batch_requests(batch_id) WHERE state = 'running';",
    /* 1 -> 2: the names of content files the store is creating or removing
     * and that no `files` row owns (yet, or any more). A name is recorded
     * here, committed, before its file is created, and forgotten in the
     * transaction that records the file (or after its removal), so the
     * store only ever removes a file whose name it recorded itself. */
    "CREATE TABLE owned_names ("
    "  path TEXT PRIMARY KEY," /* relative to the data directory: files/file-<24 hex>.sluice */
    "  since INTEGER NOT NULL"
    ");",
};
#define SCHEMA_VERSION ((int)(sizeof migrations / sizeof migrations[0]))

static int user_version(store *s, int *out, char *err, size_t errlen)
{
    sqlite3_stmt *st = db_prep(s, "PRAGMA user_version", err, errlen);
    if (!st) return STORE_EDB;
    int rc = sqlite3_step(st);
    *out = rc == SQLITE_ROW ? sqlite3_column_int(st, 0) : 0;
    sqlite3_finalize(st);
    return rc == SQLITE_ROW ? 0 : db_fail(s, "user_version", err, errlen);
}

static int migrate(store *s, char *err, size_t errlen)
{
    int rc = db_begin(s, err, errlen), v = 0;
    if (rc) return rc;
    if ((rc = user_version(s, &v, err, errlen))) goto fail;
    if (v > SCHEMA_VERSION) {
        sl_seterr(err, errlen, "database schema version %d is newer than this sluice (%d)", v, SCHEMA_VERSION);
        rc = SL_EUNSUP;
        goto fail;
    }
    for (; v < SCHEMA_VERSION; v++) {
        char e2[256];
        if (db_exec(s, migrations[v], e2, sizeof e2)) {
            sl_seterr(err, errlen, "schema migration %d -> %d failed: %s", v, v + 1, e2);
            rc = STORE_EDB;
            goto fail;
        }
    }
    char sql[64];
    snprintf(sql, sizeof sql, "PRAGMA user_version = %d", SCHEMA_VERSION);
    if ((rc = db_exec(s, sql, err, errlen))) goto fail;
    return db_commit(s, err, errlen);
fail:
    db_rollback(s);
    return rc;
}

/* ---- names the store owns ------------------------------------------------------------------- */

/* Content files are named files/<file id>.sluice, a file id being "file-"
 * and 24 lowercase hex digits; schema 1 named them files/<file id>
 * (legacy: accepted only where a row of this database names them). Nothing
 * else under the data directory is ever created or removed by the store. */
#define NAME_EXT ".sluice"

static bool is_hex24(const char *h)
{
    for (int i = 0; i < 24; i++)
        if (!((h[i] >= '0' && h[i] <= '9') || (h[i] >= 'a' && h[i] <= 'f'))) return false;
    return true;
}

/* Whether rel (relative to the data directory) has the shape of a content
 * file the store names; legacy_ok admits schema 1's extensionless names. */
static bool is_store_name(const char *rel, bool legacy_ok)
{
    if (strncmp(rel, "files/file-", 11) || strlen(rel) < 11 + 24 || !is_hex24(rel + 11)) return false;
    return !strcmp(rel + 11 + 24, NAME_EXT) || (legacy_ok && rel[11 + 24] == '\0');
}

void store__content_name(const char *id, char *rel, size_t cap)
{
    snprintf(rel, cap, "files/%s" NAME_EXT, id);
}

/* Records one name in owned_names inside the caller's transaction. */
int store__claim_in_txn(store *s, const char *rel, char *err, size_t errlen)
{
    sqlite3_stmt *st = db_prep(s, "INSERT INTO owned_names (path, since) VALUES (?, ?)", err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, rel, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 2, store__now(s));
    int rc = sqlite3_step(st) == SQLITE_DONE ? 0 : db_fail(s, "record a file name", err, errlen);
    sqlite3_finalize(st);
    return rc;
}

/* Records names in owned_names, committed, before their files exist. Runs
 * its own transaction: call it outside one. */
int store__claim_names(store *s, const char *const *rels, int n, char *err, size_t errlen)
{
    int rc = db_begin(s, err, errlen);
    for (int i = 0; i < n && !rc; i++) rc = store__claim_in_txn(s, rels[i], err, errlen);
    if (!rc) rc = db_commit(s, err, errlen);
    if (rc) db_rollback(s);
    return rc;
}

/* Forgets names (inside the caller's transaction, or on their own). */
int store__forget_names(store *s, const char *const *rels, int n, char *err, size_t errlen)
{
    sqlite3_stmt *st = db_prep(s, "DELETE FROM owned_names WHERE path = ?", err, errlen);
    if (!st) return STORE_EDB;
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        if (!rels[i] || !rels[i][0]) continue;
        sqlite3_bind_text(st, 1, rels[i], -1, SQLITE_STATIC);
        if (sqlite3_step(st) != SQLITE_DONE) rc = db_fail(s, "forget a file name", err, errlen);
        sqlite3_reset(st);
    }
    sqlite3_finalize(st);
    return rc;
}

/* Removes the file of a name this store recorded (a failed or crashed
 * creation, a deleted file): only a store-shaped name, never a directory. */
void store__remove_owned(store *s, const char *rel)
{
    if (!is_store_name(rel, true)) return;
    char *p = store__path_join(s->dir, rel);
    if (p) unlink(p);
    free(p);
}

/* ---- construction ---------------------------------------------------------------- */

static store *open_common(const char *data_dir, bool writer, const struct store_opts *opts, char *err,
                          size_t errlen)
{
    if (!data_dir || !*data_dir) {
        sl_seterr(err, errlen, "no data directory given");
        return NULL;
    }
    store *s = calloc(1, sizeof *s);
    if (!s) goto fail_alloc;
    s->writer = writer;
    if (opts) s->opts = *opts;
    if (s->opts.max_file_lines <= 0) s->opts.max_file_lines = 50000;
    if (s->opts.max_file_bytes <= 0) s->opts.max_file_bytes = 200 * 1024 * 1024;
    if (s->opts.busy_timeout_ms <= 0) s->opts.busy_timeout_ms = 5000;
    if (s->opts.max_errors <= 0) s->opts.max_errors = 1000;
    s->dir = store__strdup(data_dir);
    if (!s->dir) goto fail_strings;

    char *dbpath = store__path_join(data_dir, "sluice.db");
    if (!dbpath) goto fail_strings;
    int flags = writer ? SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE : SQLITE_OPEN_READONLY;
    int rc = sqlite3_open_v2(dbpath, &s->db, flags, NULL);
    free(dbpath);
    if (rc != SQLITE_OK) {
        sl_seterr(err, errlen, "cannot open %s/sluice.db: %s", data_dir,
                  s->db ? sqlite3_errmsg(s->db) : sqlite3_errstr(rc));
        goto fail_db;
    }
    sqlite3_busy_timeout(s->db, s->opts.busy_timeout_ms);
    if (db_exec(s, "PRAGMA foreign_keys = ON", err, errlen)) goto fail_db;
    return s;

fail_db:
    sqlite3_close(s->db);
    free(s->dir);
    free(s);
    return NULL;
fail_strings:
    free(s->dir);
    free(s);
fail_alloc:
    sl_seterr(err, errlen, "out of memory");
    return NULL;
}

/* A data directory without a sluice database may hold only what a first
 * start makes: the (empty) database and its journals, and the empty folders
 * files/ and tmp/ (tmp/ from older versions). Anything else means the
 * directory is someone's (`--data-dir /`, a home directory) or the database
 * beside these files was lost: refuse, so that nothing in it is touched.
 * Returns 0 or SL_EINVAL with a message naming what was found. */
static int check_fresh_dir(const char *data_dir, bool db_present, char *err, size_t errlen)
{
    DIR *d = opendir(data_dir);
    if (!d) {
        sl_seterr(err, errlen, "cannot read %s: %s", data_dir, strerror(errno));
        return SL_EIO;
    }
    int rc = 0;
    struct dirent *e;
    while (!rc && (e = readdir(d))) {
        const char *n = e->d_name;
        if (!strcmp(n, ".") || !strcmp(n, "..")) continue;
        char *p = store__path_join(data_dir, n);
        struct stat sb;
        bool ok = false;
        if (p && lstat(p, &sb) == 0) {
            if (S_ISDIR(sb.st_mode) && (!strcmp(n, "files") || !strcmp(n, "tmp"))) {
                DIR *sub = opendir(p);
                ok = sub != NULL;
                for (struct dirent *f; ok && (f = readdir(sub));)
                    ok = !strcmp(f->d_name, ".") || !strcmp(f->d_name, "..");
                if (sub) closedir(sub);
            } else if (db_present && S_ISREG(sb.st_mode) &&
                       (!strcmp(n, "sluice.db") || !strcmp(n, "sluice.db-wal") || !strcmp(n, "sluice.db-shm") ||
                        !strcmp(n, "sluice.db-journal"))) {
                ok = true;
            }
        }
        free(p);
        if (!ok) {
            sl_seterr(err, errlen,
                      "%s is not empty (it holds '%s') but has no sluice database (sluice.db is %s): refusing to "
                      "use it as a data directory, so that nothing in it is touched; give --data-dir a new or "
                      "empty directory, or restore the sluice.db that belongs with these files",
                      data_dir, n, db_present ? "empty" : "missing");
            rc = SL_EINVAL;
        }
    }
    closedir(d);
    return rc;
}

/* Crash recovery of names: a file whose name was recorded but never made
 * into a row (a crash while creating it) or whose row was deleted (a crash
 * before its removal) is removed, and the name forgotten. Only recorded
 * names are looked at; nothing is listed from a directory. */
static int recover_names(store *s, char *err, size_t errlen)
{
    char(*names)[128] = NULL;
    int n = 0, cap = 0, rc = 0, r;
    sqlite3_stmt *st = db_prep(s,
                               "SELECT path FROM owned_names o WHERE NOT EXISTS (SELECT 1 FROM files f WHERE f.path = o.path)",
                               err, errlen);
    if (!st) return STORE_EDB;
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            void *q = realloc(names, (size_t)cap * sizeof *names);
            if (!q) {
                rc = SL_ENOMEM;
                sl_seterr(err, errlen, "out of memory");
                break;
            }
            names = q;
        }
        snprintf(names[n++], sizeof names[0], "%s", db_text(st, 0));
    }
    if (!rc && r != SQLITE_DONE) rc = db_fail(s, "recover file names", err, errlen);
    sqlite3_finalize(st);
    for (int i = 0; i < n && !rc; i++) store__remove_owned(s, names[i]);
    /* every name is forgotten, a name some row owns included (its row is
     * what keeps its file now) */
    if (!rc) rc = db_exec(s, "DELETE FROM owned_names", err, errlen);
    free(names);
    return rc;
}

/* A database that does not belong to the files beside it (replaced,
 * restored from an older copy, another data directory's) must not be used:
 * a content file shaped as this store names them that neither a row nor a
 * recorded name accounts for is refused, naming the file. */
static int check_files_match(store *s, char *err, size_t errlen)
{
    char *files_dir = store__path_join(s->dir, "files");
    if (!files_dir) return SL_ENOMEM;
    DIR *d = opendir(files_dir);
    free(files_dir);
    if (!d) {
        sl_seterr(err, errlen, "cannot read %s/files: %s", s->dir, strerror(errno));
        return SL_EIO;
    }
    sqlite3_stmt *st = db_prep(s,
                               "SELECT 1 FROM files WHERE path = ?1 UNION ALL SELECT 1 FROM owned_names WHERE path = ?1",
                               err, errlen);
    int rc = st ? 0 : STORE_EDB;
    struct dirent *e;
    while (!rc && (e = readdir(d))) {
        char rel[300];
        snprintf(rel, sizeof rel, "files/%s", e->d_name);
        if (!is_store_name(rel, false)) continue;
        sqlite3_bind_text(st, 1, rel, -1, SQLITE_TRANSIENT);
        int r = sqlite3_step(st);
        sqlite3_reset(st);
        if (r == SQLITE_DONE) {
            sl_seterr(err, errlen,
                      "%s/%s was made by sluice but %s/sluice.db does not list it: this database does not belong "
                      "with these files (replaced, truncated or restored from another copy?); refusing to start so "
                      "that nothing is lost - restore the matching sluice.db, or move the files away",
                      s->dir, rel, s->dir);
            rc = SL_EINVAL;
        } else if (r != SQLITE_ROW) {
            rc = db_fail(s, "check files", err, errlen);
        }
    }
    sqlite3_finalize(st);
    closedir(d);
    return rc;
}

store *store_open(const char *data_dir, const struct store_opts *opts, char *err, size_t errlen)
{
    if (!data_dir || !*data_dir) {
        sl_seterr(err, errlen, "no data directory given");
        return NULL;
    }
    char *files_dir = store__path_join(data_dir, "files");
    char *dbpath = store__path_join(data_dir, "sluice.db");
    int rc = !files_dir || !dbpath ? SL_ENOMEM : 0;
    if (rc) sl_seterr(err, errlen, "out of memory");
    if (!rc) rc = mkdir_p1(data_dir, err, errlen);
    struct stat sb;
    /* checked before SQLite creates sluice.db in a directory that is not ours */
    if (!rc && stat(dbpath, &sb) != 0) rc = check_fresh_dir(data_dir, false, err, errlen);
    free(dbpath);
    if (rc) {
        free(files_dir);
        return NULL;
    }

    store *s = open_common(data_dir, true, opts, err, errlen);
    if (!s) {
        free(files_dir);
        return NULL;
    }
    int v = 0;
    if (user_version(s, &v, err, errlen)) goto fail;
    if (v == 0) {
        sqlite3_stmt *st = db_prep(s, "SELECT count(*) FROM sqlite_master", err, errlen);
        if (!st) goto fail;
        int64_t objs = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int64(st, 0) : -1;
        sqlite3_finalize(st);
        if (objs != 0) {
            sl_seterr(err, errlen, "%s/sluice.db is not a sluice database (%s); refusing to use it", data_dir,
                      objs < 0 ? sqlite3_errmsg(s->db) : "it has tables of its own");
            goto fail;
        }
        if (check_fresh_dir(data_dir, true, err, errlen)) goto fail;
    }
    if (mkdir_p1(files_dir, err, errlen)) goto fail;
    free(files_dir);
    files_dir = NULL;
    sqlite3_stmt *st = db_prep(s, "PRAGMA journal_mode = WAL", err, errlen);
    if (!st) goto fail;
    rc = sqlite3_step(st);
    bool wal = rc == SQLITE_ROW && db_text(st, 0) && strcmp(db_text(st, 0), "wal") == 0;
    sqlite3_finalize(st);
    if (!wal) {
        sl_seterr(err, errlen, "cannot switch %s/sluice.db to WAL mode: %s", data_dir, sqlite3_errmsg(s->db));
        goto fail;
    }
    /* FULL: a committed result survives power loss too, not just a crash;
     * the cost is one fsync per (batched) transaction. */
    if (db_exec(s, "PRAGMA synchronous = FULL", err, errlen)) goto fail;
    if (migrate(s, err, errlen)) goto fail;
    if (recover_names(s, err, errlen)) goto fail;
    if (check_files_match(s, err, errlen)) goto fail;

    /* crash recovery: work in flight is redone, never lost */
    if (db_exec(s, "UPDATE batch_requests SET state = 'pending' WHERE state = 'running'", err, errlen))
        goto fail;
    st = db_prep(s, "SELECT id FROM batches WHERE status = 'validating' ORDER BY seq", err, errlen);
    if (!st) goto fail;
    for (;;) {
        rc = sqlite3_step(st);
        if (rc != SQLITE_ROW) break;
        char id[STORE_ID_MAX];
        store__copy_id(id, db_text(st, 0));
        /* validate_batch() writes; a finished SELECT would be fine too, but
         * reset first so the read does not straddle the write */
        sqlite3_reset(st);
        if (store__validate_batch(s, id, err, errlen) < 0) {
            sqlite3_finalize(st);
            goto fail;
        }
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) {
        db_fail(s, "recovery", err, errlen);
        goto fail;
    }
    if (store_tick(s, err, errlen) < 0) goto fail;
    return s;
fail:
    free(files_dir);
    store_close(s);
    return NULL;
}

store *store_open_reader(const char *data_dir, char *err, size_t errlen)
{
    store *s = open_common(data_dir, false, NULL, err, errlen);
    if (!s) return NULL;
    int v = 0;
    if (user_version(s, &v, err, errlen)) goto fail;
    if (v != SCHEMA_VERSION) {
        sl_seterr(err, errlen, "%s/sluice.db has schema version %d, expected %d (open it with store_open first)",
                  data_dir, v, SCHEMA_VERSION);
        goto fail;
    }
    return s;
fail:
    store_close(s);
    return NULL;
}

void store_close(store *s)
{
    if (!s) return;
    sqlite3_close(s->db);
    free(s->dir);
    free(s);
}

void store_set_clock(store *s, int64_t (*now)(void *ctx), void *ctx)
{
    s->now = now;
    s->now_ctx = ctx;
}

int64_t store_parse_window(const char *w, bool allow_short, char *err, size_t errlen)
{
    if (!w || !*w) {
        sl_seterr(err, errlen, "completion_window is required");
        return SL_EINVAL;
    }
    if (strcmp(w, "24h") == 0) return 24 * 3600;
    if (allow_short) {
        char *end;
        errno = 0;
        long long n = strtoll(w, &end, 10);
        int64_t unit = 0;
        if (end != w && end[0] && !end[1])
            unit = end[0] == 's' ? 1 : end[0] == 'm' ? 60 : end[0] == 'h' ? 3600 : 0;
        if (unit && !errno && n >= 1 && n <= 7 * 24 * 3600 / unit && w[0] >= '0' && w[0] <= '9')
            return (int64_t)n * unit;
    }
    sl_seterr(err, errlen, "invalid completion_window '%s': only \"24h\" is supported%s", w,
              allow_short ? " (or N followed by s, m or h, up to 7 days)" : "");
    return SL_EINVAL;
}

int store__need_writer(store *s, char *err, size_t errlen)
{
    if (s->writer) return 0;
    sl_seterr(err, errlen, "this store handle is read-only");
    return SL_EINVAL;
}
