/* store.c - the SQLite job queue declared in store.h.
 *
 * Reading order: the handle and small helpers, the schema and its
 * migrations, open/close and crash recovery, files, batch validation and
 * creation, batch finishing (output files, terminal states), cancel/expiry,
 * feeding (claim and complete), JSON rendering and listings.
 *
 * Batch states and who moves them:
 *   validating  --store_batch_create/recovery--> in_progress | failed
 *   in_progress --last row finished (settle)--> finalizing --finish_batch--> completed
 *   in_progress --store_tick past expires_at--> finalizing(finish=expired) --> expired
 *   validating/in_progress --store_batch_cancel--> cancelling --no row running--> cancelled
 * While a batch is finalizing or cancelling, `finish` holds the terminal
 * status it is heading for, so a crash in the middle resumes to the same end.
 */
#include "store/store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

struct store {
    sqlite3 *db;          /* owned; one connection, one thread at a time */
    bool writer;
    char *dir;            /* owned: the data directory */
    struct store_opts opts;
    int64_t (*now)(void *ctx);
    void *now_ctx;
};

#define CHUNK (64 * 1024)

/* ---- helpers ------------------------------------------------------------------ */

static void set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static int db_fail(store *s, const char *what, char *err, size_t errlen)
{
    set_err(err, errlen, "database error (%s): %s", what, sqlite3_errmsg(s->db));
    return STORE_EDB;
}

static int64_t now_s(store *s)
{
    return s->now ? s->now(s->now_ctx) : (int64_t)time(NULL);
}

static int exec(store *s, const char *sql, char *err, size_t errlen)
{
    char *msg = NULL;
    if (sqlite3_exec(s->db, sql, NULL, NULL, &msg) != SQLITE_OK) {
        set_err(err, errlen, "database error: %s", msg ? msg : sqlite3_errmsg(s->db));
        sqlite3_free(msg);
        return STORE_EDB;
    }
    return 0;
}

static int begin(store *s, char *err, size_t errlen) { return exec(s, "BEGIN IMMEDIATE", err, errlen); }
static int commit(store *s, char *err, size_t errlen) { return exec(s, "COMMIT", err, errlen); }
static void rollback(store *s)
{
    if (!sqlite3_get_autocommit(s->db)) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
}

static sqlite3_stmt *prep(store *s, const char *sql, char *err, size_t errlen)
{
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(s->db, sql, -1, &st, NULL) != SQLITE_OK) {
        db_fail(s, "prepare", err, errlen);
        return NULL;
    }
    return st;
}

static const char *col_text(sqlite3_stmt *st, int i) { return (const char *)sqlite3_column_text(st, i); }

const char *const store_batch_status_names[STORE_N_BATCH_STATUS] = {
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"};

int store_queue_stats(store *s, struct store_queue_stats *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    sqlite3_stmt *st = prep(s, "SELECT status, count(*), sum(n_total), sum(n_completed), sum(n_failed) FROM batches "
                               "GROUP BY status", err, errlen);
    if (!st) return STORE_EDB;
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        const char *name = col_text(st, 0);
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

static void copy_id(char *dst, const char *src)
{
    snprintf(dst, STORE_ID_MAX, "%s", src ? src : "");
}

static char *xstrdup(const char *s)
{
    if (!s) return NULL;
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

/* prefix + 24 random hex digits */
static int new_id(const char *prefix, char *out, char *err, size_t errlen)
{
    unsigned char r[12];
    size_t got = 0;
    while (got < sizeof r) {
        ssize_t k = getrandom(r + got, sizeof r - got, 0);
        if (k < 0) {
            if (errno == EINTR) continue;
            set_err(err, errlen, "getrandom: %s", strerror(errno));
            return SL_EIO;
        }
        got += (size_t)k;
    }
    int n = snprintf(out, STORE_ID_MAX, "%s", prefix);
    for (size_t i = 0; i < sizeof r; i++) n += snprintf(out + n, STORE_ID_MAX - (size_t)n, "%02x", r[i]);
    return 0;
}

static char *path_join(const char *a, const char *b)
{
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", a, b);
    return p;
}

static int mkdir_p1(const char *path, char *err, size_t errlen)
{
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        set_err(err, errlen, "cannot create %s: %s", path, strerror(errno));
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
    sqlite3_stmt *st = prep(s, "PRAGMA user_version", err, errlen);
    if (!st) return STORE_EDB;
    int rc = sqlite3_step(st);
    *out = rc == SQLITE_ROW ? sqlite3_column_int(st, 0) : 0;
    sqlite3_finalize(st);
    return rc == SQLITE_ROW ? 0 : db_fail(s, "user_version", err, errlen);
}

static int migrate(store *s, char *err, size_t errlen)
{
    int rc = begin(s, err, errlen), v = 0;
    if (rc) return rc;
    if ((rc = user_version(s, &v, err, errlen))) goto fail;
    if (v > SCHEMA_VERSION) {
        set_err(err, errlen, "database schema version %d is newer than this sluice (%d)", v, SCHEMA_VERSION);
        rc = SL_EUNSUP;
        goto fail;
    }
    for (; v < SCHEMA_VERSION; v++) {
        char e2[256];
        if (exec(s, migrations[v], e2, sizeof e2)) {
            set_err(err, errlen, "schema migration %d -> %d failed: %s", v, v + 1, e2);
            rc = STORE_EDB;
            goto fail;
        }
    }
    char sql[64];
    snprintf(sql, sizeof sql, "PRAGMA user_version = %d", SCHEMA_VERSION);
    if ((rc = exec(s, sql, err, errlen))) goto fail;
    return commit(s, err, errlen);
fail:
    rollback(s);
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

static void content_name(const char *id, char *rel, size_t cap)
{
    snprintf(rel, cap, "files/%s" NAME_EXT, id);
}

/* Records one name in owned_names inside the caller's transaction. */
static int claim_in_txn(store *s, const char *rel, char *err, size_t errlen)
{
    sqlite3_stmt *st = prep(s, "INSERT INTO owned_names (path, since) VALUES (?, ?)", err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, rel, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 2, now_s(s));
    int rc = sqlite3_step(st) == SQLITE_DONE ? 0 : db_fail(s, "record a file name", err, errlen);
    sqlite3_finalize(st);
    return rc;
}

/* Records names in owned_names, committed, before their files exist. Runs
 * its own transaction: call it outside one. */
static int claim_names(store *s, const char *const *rels, int n, char *err, size_t errlen)
{
    int rc = begin(s, err, errlen);
    for (int i = 0; i < n && !rc; i++) rc = claim_in_txn(s, rels[i], err, errlen);
    if (!rc) rc = commit(s, err, errlen);
    if (rc) rollback(s);
    return rc;
}

/* Forgets names (inside the caller's transaction, or on their own). */
static int forget_names(store *s, const char *const *rels, int n, char *err, size_t errlen)
{
    sqlite3_stmt *st = prep(s, "DELETE FROM owned_names WHERE path = ?", err, errlen);
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
static void remove_owned(store *s, const char *rel)
{
    if (!is_store_name(rel, true)) return;
    char *p = path_join(s->dir, rel);
    if (p) unlink(p);
    free(p);
}

/* ---- construction ---------------------------------------------------------------- */

static int validate_batch(store *s, const char *id, char *err, size_t errlen);
static int settle(store *s, const char *id, char *err, size_t errlen);

static store *open_common(const char *data_dir, bool writer, const struct store_opts *opts, char *err,
                          size_t errlen)
{
    if (!data_dir || !*data_dir) {
        set_err(err, errlen, "no data directory given");
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
    s->dir = xstrdup(data_dir);
    if (!s->dir) goto fail_strings;

    char *dbpath = path_join(data_dir, "sluice.db");
    if (!dbpath) goto fail_strings;
    int flags = writer ? SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE : SQLITE_OPEN_READONLY;
    int rc = sqlite3_open_v2(dbpath, &s->db, flags, NULL);
    free(dbpath);
    if (rc != SQLITE_OK) {
        set_err(err, errlen, "cannot open %s/sluice.db: %s", data_dir,
                s->db ? sqlite3_errmsg(s->db) : sqlite3_errstr(rc));
        goto fail_db;
    }
    sqlite3_busy_timeout(s->db, s->opts.busy_timeout_ms);
    if (exec(s, "PRAGMA foreign_keys = ON", err, errlen)) goto fail_db;
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
    set_err(err, errlen, "out of memory");
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
        set_err(err, errlen, "cannot read %s: %s", data_dir, strerror(errno));
        return SL_EIO;
    }
    int rc = 0;
    struct dirent *e;
    while (!rc && (e = readdir(d))) {
        const char *n = e->d_name;
        if (!strcmp(n, ".") || !strcmp(n, "..")) continue;
        char *p = path_join(data_dir, n);
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
            set_err(err, errlen,
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
    sqlite3_stmt *st = prep(s,
                            "SELECT path FROM owned_names o WHERE NOT EXISTS (SELECT 1 FROM files f WHERE f.path = o.path)",
                            err, errlen);
    if (!st) return STORE_EDB;
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            void *q = realloc(names, (size_t)cap * sizeof *names);
            if (!q) {
                rc = SL_ENOMEM;
                set_err(err, errlen, "out of memory");
                break;
            }
            names = q;
        }
        snprintf(names[n++], sizeof names[0], "%s", col_text(st, 0));
    }
    if (!rc && r != SQLITE_DONE) rc = db_fail(s, "recover file names", err, errlen);
    sqlite3_finalize(st);
    for (int i = 0; i < n && !rc; i++) remove_owned(s, names[i]);
    /* every name is forgotten, a name some row owns included (its row is
     * what keeps its file now) */
    if (!rc) rc = exec(s, "DELETE FROM owned_names", err, errlen);
    free(names);
    return rc;
}

/* A database that does not belong to the files beside it (replaced,
 * restored from an older copy, another data directory's) must not be used:
 * a content file shaped as this store names them that neither a row nor a
 * recorded name accounts for is refused, naming the file. */
static int check_files_match(store *s, char *err, size_t errlen)
{
    char *files_dir = path_join(s->dir, "files");
    if (!files_dir) return SL_ENOMEM;
    DIR *d = opendir(files_dir);
    free(files_dir);
    if (!d) {
        set_err(err, errlen, "cannot read %s/files: %s", s->dir, strerror(errno));
        return SL_EIO;
    }
    sqlite3_stmt *st = prep(s,
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
            set_err(err, errlen,
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
        set_err(err, errlen, "no data directory given");
        return NULL;
    }
    char *files_dir = path_join(data_dir, "files");
    char *dbpath = path_join(data_dir, "sluice.db");
    int rc = !files_dir || !dbpath ? SL_ENOMEM : 0;
    if (rc) set_err(err, errlen, "out of memory");
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
        sqlite3_stmt *st = prep(s, "SELECT count(*) FROM sqlite_master", err, errlen);
        if (!st) goto fail;
        int64_t objs = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int64(st, 0) : -1;
        sqlite3_finalize(st);
        if (objs != 0) {
            set_err(err, errlen, "%s/sluice.db is not a sluice database (%s); refusing to use it", data_dir,
                    objs < 0 ? sqlite3_errmsg(s->db) : "it has tables of its own");
            goto fail;
        }
        if (check_fresh_dir(data_dir, true, err, errlen)) goto fail;
    }
    if (mkdir_p1(files_dir, err, errlen)) goto fail;
    free(files_dir);
    files_dir = NULL;
    sqlite3_stmt *st = prep(s, "PRAGMA journal_mode = WAL", err, errlen);
    if (!st) goto fail;
    rc = sqlite3_step(st);
    bool wal = rc == SQLITE_ROW && col_text(st, 0) && strcmp(col_text(st, 0), "wal") == 0;
    sqlite3_finalize(st);
    if (!wal) {
        set_err(err, errlen, "cannot switch %s/sluice.db to WAL mode: %s", data_dir, sqlite3_errmsg(s->db));
        goto fail;
    }
    /* FULL: a committed result survives power loss too, not just a crash;
     * the cost is one fsync per (batched) transaction. */
    if (exec(s, "PRAGMA synchronous = FULL", err, errlen)) goto fail;
    if (migrate(s, err, errlen)) goto fail;
    if (recover_names(s, err, errlen)) goto fail;
    if (check_files_match(s, err, errlen)) goto fail;

    /* crash recovery: work in flight is redone, never lost */
    if (exec(s, "UPDATE batch_requests SET state = 'pending' WHERE state = 'running'", err, errlen))
        goto fail;
    st = prep(s, "SELECT id FROM batches WHERE status = 'validating' ORDER BY seq", err, errlen);
    if (!st) goto fail;
    for (;;) {
        rc = sqlite3_step(st);
        if (rc != SQLITE_ROW) break;
        char id[STORE_ID_MAX];
        copy_id(id, col_text(st, 0));
        /* validate_batch() writes; a finished SELECT would be fine too, but
         * reset first so the read does not straddle the write */
        sqlite3_reset(st);
        if (validate_batch(s, id, err, errlen) < 0) {
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
        set_err(err, errlen, "%s/sluice.db has schema version %d, expected %d (open it with store_open first)",
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
        set_err(err, errlen, "completion_window is required");
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
    set_err(err, errlen, "invalid completion_window '%s': only \"24h\" is supported%s", w,
            allow_short ? " (or N followed by s, m or h, up to 7 days)" : "");
    return SL_EINVAL;
}

static int need_writer(store *s, char *err, size_t errlen)
{
    if (s->writer) return 0;
    set_err(err, errlen, "this store handle is read-only");
    return SL_EINVAL;
}

/* ---- files ------------------------------------------------------------------------ */

/* Counts lines holding anything but blanks (the requests of a JSONL file),
 * reading in chunks. Returns the count or SL_EIO. */
static int64_t count_requests(const char *path, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        set_err(err, errlen, "cannot read %s: %s", path, strerror(errno));
        return SL_EIO;
    }
    char *buf = malloc(CHUNK);
    if (!buf) {
        close(fd);
        set_err(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    int64_t n = 0;
    bool content = false;
    for (;;) {
        ssize_t k = read(fd, buf, CHUNK);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            set_err(err, errlen, "cannot read %s: %s", path, strerror(errno));
            n = SL_EIO;
            break;
        }
        if (k == 0) {
            if (content) n++;
            break;
        }
        for (ssize_t i = 0; i < k; i++) {
            char c = buf[i];
            if (c == '\n') {
                if (content) n++;
                content = false;
            } else if (c != ' ' && c != '\t' && c != '\r') {
                content = true;
            }
        }
    }
    free(buf);
    close(fd);
    return n;
}

static int copy_file(const char *src, const char *dst, char *err, size_t errlen)
{
    int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0) {
        set_err(err, errlen, "cannot read %s: %s", src, strerror(errno));
        return SL_EIO;
    }
    int out = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    char *buf = malloc(CHUNK);
    int rc = 0;
    if (out < 0 || !buf) {
        set_err(err, errlen, "cannot create %s: %s", dst, out < 0 ? strerror(errno) : "out of memory");
        rc = SL_EIO;
    }
    while (!rc) {
        ssize_t k = read(in, buf, CHUNK);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            if (k < 0) rc = SL_EIO;
            break;
        }
        for (ssize_t off = 0; off < k && !rc;) {
            ssize_t w = write(out, buf + off, (size_t)(k - off));
            if (w < 0 && errno == EINTR) continue;
            if (w < 0) rc = SL_EIO;
            else off += w;
        }
        if (rc) set_err(err, errlen, "copying %s to %s: %s", src, dst, strerror(errno));
    }
    if (!rc && fsync(out) != 0) {
        set_err(err, errlen, "fsync %s: %s", dst, strerror(errno));
        rc = SL_EIO;
    }
    free(buf);
    if (out >= 0) close(out);
    close(in);
    if (rc && out >= 0) unlink(dst);
    return rc;
}

static int insert_file_row(store *s, const char *id, const char *purpose, const char *filename, int64_t bytes,
                           int64_t lines, const char *rel, char *err, size_t errlen)
{
    sqlite3_stmt *st = prep(s,
                            "INSERT INTO files (id, purpose, filename, bytes, lines, created_at, path)"
                            " VALUES (?, ?, ?, ?, ?, ?, ?)",
                            err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, purpose, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, filename, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 4, bytes);
    sqlite3_bind_int64(st, 5, lines);
    sqlite3_bind_int64(st, 6, now_s(s));
    sqlite3_bind_text(st, 7, rel, -1, SQLITE_STATIC);
    int rc = sqlite3_step(st) == SQLITE_DONE ? 0 : db_fail(s, "insert file", err, errlen);
    sqlite3_finalize(st);
    return rc;
}

/* Records the content file at rel (complete on disk, its name owned) as a
 * new file row, and forgets the name in the same transaction. */
static int record_file(store *s, const char *id, const char *purpose, const char *filename, int64_t bytes,
                       int64_t lines, const char *rel, char *err, size_t errlen)
{
    int rc = begin(s, err, errlen);
    if (rc) return rc;
    if (!(rc = insert_file_row(s, id, purpose, filename, bytes, lines, rel, err, errlen)) &&
        !(rc = forget_names(s, &rel, 1, err, errlen)))
        rc = commit(s, err, errlen);
    if (rc) rollback(s);
    return rc;
}

/* The checks of store_file_create() on a complete content file: its size
 * and request count (for purpose "batch", against the limits). */
static int check_content(store *s, const char *path, bool batch, int64_t *bytes, int64_t *lines, char *err,
                         size_t errlen)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        set_err(err, errlen, "cannot read %s: %s", path, strerror(errno));
        return SL_EIO;
    }
    *bytes = (int64_t)sb.st_size;
    if (batch && *bytes > s->opts.max_file_bytes) {
        set_err(err, errlen, "file is %lld bytes; a batch input file may be at most %lld bytes", (long long)*bytes,
                (long long)s->opts.max_file_bytes);
        return STORE_ELIMIT;
    }
    *lines = count_requests(path, err, errlen);
    if (*lines < 0) return (int)*lines;
    if (batch && *lines > s->opts.max_file_lines) {
        set_err(err, errlen, "file has %lld requests; a batch input file may have at most %lld",
                (long long)*lines, (long long)s->opts.max_file_lines);
        return STORE_ELIMIT;
    }
    return 0;
}

/* Both ways in: src_path moved in, or cb writing the content. */
static int file_create(store *s, const char *src_path, store_write_fn cb, void *ctx, const char *purpose,
                       const char *filename, char *id_out, char *err, size_t errlen)
{
    int rc = need_writer(s, err, errlen);
    if (rc) return rc;
    if ((!src_path && !cb) || !purpose || !*purpose || !id_out) {
        set_err(err, errlen, "file, purpose and id buffer are required");
        return SL_EINVAL;
    }
    if (!filename || !*filename) {
        const char *slash = src_path ? strrchr(src_path, '/') : NULL;
        filename = slash ? slash + 1 : src_path ? src_path : "upload";
    }
    struct stat sb;
    errno = 0;
    if (src_path && (stat(src_path, &sb) != 0 || !S_ISREG(sb.st_mode))) {
        set_err(err, errlen, "cannot read uploaded file %s: %s", src_path,
                errno ? strerror(errno) : "not a regular file");
        return SL_EIO;
    }
    char id[STORE_ID_MAX], rel[STORE_ID_MAX + 16];
    if ((rc = new_id("file-", id, err, errlen))) return rc;
    content_name(id, rel, sizeof rel);
    char *dst = path_join(s->dir, rel);
    if (!dst) {
        set_err(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    const char *relp = rel;
    if ((rc = claim_names(s, &relp, 1, err, errlen))) { /* nothing created yet */
        free(dst);
        return rc;
    }
    bool moved = false, copied = false;
    if (src_path) {
        if (rename(src_path, dst) == 0) {
            moved = true;
        } else if (errno == EXDEV) {
            rc = copy_file(src_path, dst, err, errlen);
            copied = !rc;
        } else {
            set_err(err, errlen, "cannot move %s into %s: %s", src_path, dst, strerror(errno));
            rc = SL_EIO;
        }
    } else {
        int fd = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0) {
            set_err(err, errlen, "cannot create %s: %s", dst, strerror(errno));
            rc = SL_EIO;
        } else {
            rc = cb(ctx, fd, err, errlen);
            if (!rc && fsync(fd) != 0) {
                set_err(err, errlen, "writing %s: %s", dst, strerror(errno));
                rc = SL_EIO;
            }
            if (close(fd) != 0 && !rc) {
                set_err(err, errlen, "writing %s: %s", dst, strerror(errno));
                rc = SL_EIO;
            }
        }
    }
    int64_t bytes = 0, lines = 0;
    if (!rc) rc = check_content(s, dst, !strcmp(purpose, "batch"), &bytes, &lines, err, errlen);
    if (!rc) rc = record_file(s, id, purpose, filename, bytes, lines, rel, err, errlen);
    if (rc) {
        /* the caller's file goes back where it was; what the store made goes */
        if (moved && rename(dst, src_path) != 0) moved = false;
        if (!moved) remove_owned(s, rel);
        forget_names(s, &relp, 1, NULL, 0);
        free(dst);
        return rc;
    }
    if (copied) unlink(src_path); /* the store has its copy: the caller handed this over */
    free(dst);
    copy_id(id_out, id);
    return 0;
}

int store_file_create(store *s, const char *src_path, const char *purpose, const char *filename, char *id_out,
                      char *err, size_t errlen)
{
    if (!src_path) {
        set_err(err, errlen, "file, purpose and id buffer are required");
        return SL_EINVAL;
    }
    return file_create(s, src_path, NULL, NULL, purpose, filename, id_out, err, errlen);
}

int store_file_write(store *s, store_write_fn cb, void *ctx, const char *purpose, const char *filename,
                     char *id_out, char *err, size_t errlen)
{
    if (!cb) {
        set_err(err, errlen, "no writer given");
        return SL_EINVAL;
    }
    return file_create(s, NULL, cb, ctx, purpose, filename, id_out, err, errlen);
}

static void file_json(sqlite3_stmt *st, struct json_buf *out)
{
    /* columns: id, bytes, created_at, filename, purpose, status */
    json_buf_add(out, "{\"id\":", 6);
    json_buf_add_str(out, col_text(st, 0), (size_t)sqlite3_column_bytes(st, 0));
    json_buf_addf(out, ",\"object\":\"file\",\"bytes\":%lld,\"created_at\":%lld,\"filename\":",
                  (long long)sqlite3_column_int64(st, 1), (long long)sqlite3_column_int64(st, 2));
    json_buf_add_str(out, col_text(st, 3), (size_t)sqlite3_column_bytes(st, 3));
    json_buf_add(out, ",\"purpose\":", 11);
    json_buf_add_str(out, col_text(st, 4), (size_t)sqlite3_column_bytes(st, 4));
    json_buf_add(out, ",\"status\":", 10);
    json_buf_add_str(out, col_text(st, 5), (size_t)sqlite3_column_bytes(st, 5));
    json_buf_add(out, ",\"status_details\":null}", 23);
}

#define FILE_COLS "id, bytes, created_at, filename, purpose, status"

int store_file_get_json(store *s, const char *id, struct json_buf *out, char *err, size_t errlen)
{
    sqlite3_stmt *st = prep(s, "SELECT " FILE_COLS " FROM files WHERE id = ?", err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id ? id : "", -1, SQLITE_STATIC);
    int r = sqlite3_step(st), rc = 0;
    if (r == SQLITE_ROW) file_json(st, out);
    else if (r == SQLITE_DONE) {
        set_err(err, errlen, "No such File object: %s", id ? id : "");
        rc = STORE_ENOTFOUND;
    } else rc = db_fail(s, "get file", err, errlen);
    sqlite3_finalize(st);
    if (!rc && out->oom) {
        set_err(err, errlen, "out of memory");
        rc = SL_ENOMEM;
    }
    return rc;
}

/* Ends a {"object":"list","data":[ ... listing. */
static void list_tail(struct json_buf *out, const char *first, const char *last, bool more)
{
    json_buf_add(out, "],\"first_id\":", 13);
    if (first) json_buf_add_str(out, first, strlen(first));
    else json_buf_add(out, "null", 4);
    json_buf_add(out, ",\"last_id\":", 11);
    if (last) json_buf_add_str(out, last, strlen(last));
    else json_buf_add(out, "null", 4);
    json_buf_addf(out, ",\"has_more\":%s}", more ? "true" : "false");
}

/* Runs st (rows newest first, limit + 1 of them asked for) into an OpenAI
 * list object: row() writes each object; the extra row only sets has_more.
 * Finalizes st. Returns 0 or a negative status with err. */
static int list_json(store *s, sqlite3_stmt *st, int limit, void (*row)(sqlite3_stmt *, struct json_buf *),
                     const char *what, struct json_buf *out, char *err, size_t errlen)
{
    int rc = 0;
    json_buf_add(out, "{\"object\":\"list\",\"data\":[", 25);
    char first[STORE_ID_MAX] = "", last[STORE_ID_MAX] = "";
    int n = 0, r;
    bool more = false;
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        if (n == limit) {
            more = true;
            break;
        }
        if (n) json_buf_add(out, ",", 1);
        row(st, out);
        if (!n) copy_id(first, col_text(st, 0));
        copy_id(last, col_text(st, 0));
        n++;
    }
    if (r != SQLITE_ROW && r != SQLITE_DONE) rc = db_fail(s, what, err, errlen);
    sqlite3_finalize(st);
    list_tail(out, n ? first : NULL, n ? last : NULL, more);
    if (!rc && out->oom) {
        set_err(err, errlen, "out of memory");
        rc = SL_ENOMEM;
    }
    return rc;
}

/* The seq of `after` in table (files or batches), or INT64_MAX for none. */
static int after_seq(store *s, const char *table, const char *after, int64_t *seq, char *err, size_t errlen)
{
    *seq = INT64_MAX;
    if (!after || !*after) return 0;
    char sql[96];
    snprintf(sql, sizeof sql, "SELECT seq FROM %s WHERE id = ?", table);
    sqlite3_stmt *st = prep(s, sql, err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, after, -1, SQLITE_STATIC);
    int r = sqlite3_step(st), rc = 0;
    if (r == SQLITE_ROW) *seq = sqlite3_column_int64(st, 0);
    else if (r == SQLITE_DONE) {
        set_err(err, errlen, "after: no such %s: %s", strcmp(table, "files") ? "batch" : "file", after);
        rc = STORE_ENOTFOUND;
    } else rc = db_fail(s, "list", err, errlen);
    sqlite3_finalize(st);
    return rc;
}

int store_file_list_json(store *s, const char *purpose, const char *after, int limit, struct json_buf *out,
                         char *err, size_t errlen)
{
    if (limit <= 0 || limit > 10000) limit = 10000;
    int64_t seq;
    int rc = after_seq(s, "files", after, &seq, err, errlen);
    if (rc) return rc;
    sqlite3_stmt *st = prep(s,
                            "SELECT " FILE_COLS " FROM files WHERE seq < ?1 AND (?2 IS NULL OR purpose = ?2)"
                            " ORDER BY seq DESC LIMIT ?3",
                            err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_int64(st, 1, seq);
    sqlite3_bind_text(st, 2, purpose && *purpose ? purpose : NULL, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 3, limit + 1);
    return list_json(s, st, limit, file_json, "list files", out, err, errlen);
}

/* The absolute path of a file's content, malloc'ed, or NULL with an error. */
static char *file_path(store *s, const char *id, int64_t *bytes, int *rc, char *err, size_t errlen)
{
    sqlite3_stmt *st = prep(s, "SELECT path, bytes FROM files WHERE id = ?", err, errlen);
    *rc = STORE_EDB;
    if (!st) return NULL;
    sqlite3_bind_text(st, 1, id ? id : "", -1, SQLITE_STATIC);
    char *p = NULL;
    int r = sqlite3_step(st);
    if (r == SQLITE_ROW) {
        p = path_join(s->dir, col_text(st, 0));
        if (bytes) *bytes = sqlite3_column_int64(st, 1);
        *rc = p ? 0 : SL_ENOMEM;
    } else if (r == SQLITE_DONE) {
        set_err(err, errlen, "No such File object: %s", id ? id : "");
        *rc = STORE_ENOTFOUND;
    } else {
        db_fail(s, "file path", err, errlen);
    }
    sqlite3_finalize(st);
    return p;
}

int store_file_delete(store *s, const char *id, struct json_buf *out, char *err, size_t errlen)
{
    int rc = need_writer(s, err, errlen);
    if (rc) return rc;
    if ((rc = begin(s, err, errlen))) return rc;
    char rel[300] = "";
    sqlite3_stmt *st = prep(s, "SELECT path FROM files WHERE id = ?", err, errlen);
    if (!st) {
        rc = STORE_EDB;
        goto fail;
    }
    sqlite3_bind_text(st, 1, id ? id : "", -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    if (r == SQLITE_ROW) snprintf(rel, sizeof rel, "%s", col_text(st, 0));
    sqlite3_finalize(st);
    if (r == SQLITE_DONE) {
        set_err(err, errlen, "No such File object: %s", id ? id : "");
        rc = STORE_ENOTFOUND;
        goto fail;
    }
    if (r != SQLITE_ROW) {
        rc = db_fail(s, "delete file", err, errlen);
        goto fail;
    }
    st = prep(s, "DELETE FROM files WHERE id = ?", err, errlen);
    if (!st) {
        rc = STORE_EDB;
        goto fail;
    }
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    rc = sqlite3_step(st) == SQLITE_DONE ? 0 : db_fail(s, "delete file", err, errlen);
    sqlite3_finalize(st);
    /* the row's name becomes a recorded name in the same transaction: a
     * crash before the unlink below is finished at the next open */
    const char *relp = rel;
    if (!rc) rc = claim_in_txn(s, relp, err, errlen);
    if (!rc) rc = commit(s, err, errlen);
    if (rc) goto fail;
    remove_owned(s, rel);
    forget_names(s, &relp, 1, NULL, 0);
    if (out) {
        json_buf_add(out, "{\"id\":", 6);
        json_buf_add_str(out, id, strlen(id));
        json_buf_add(out, ",\"object\":\"file\",\"deleted\":true}", 32);
    }
    return 0;
fail:
    rollback(s);
    return rc;
}

int store_file_open_content(store *s, const char *id, int *fd_out, int64_t *size_out, char *err, size_t errlen)
{
    int rc;
    int64_t bytes = 0;
    char *p = file_path(s, id, &bytes, &rc, err, errlen);
    if (!p) return rc;
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        set_err(err, errlen, "cannot read the content of %s: %s", id, strerror(errno));
        free(p);
        return SL_EIO;
    }
    free(p);
    *fd_out = fd;
    if (size_out) *size_out = bytes;
    return 0;
}

int store_file_content(store *s, const char *id, int (*cb)(void *ctx, const char *p, size_t n), void *ctx,
                       char *err, size_t errlen)
{
    int fd, rc = store_file_open_content(s, id, &fd, NULL, err, errlen);
    if (rc) return rc;
    char *buf = malloc(CHUNK);
    if (!buf) {
        close(fd);
        set_err(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    for (;;) {
        ssize_t k = read(fd, buf, CHUNK);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            set_err(err, errlen, "reading %s: %s", id, strerror(errno));
            rc = SL_EIO;
            break;
        }
        if (k == 0) break;
        if ((rc = cb(ctx, buf, (size_t)k))) break;
    }
    free(buf);
    close(fd);
    return rc;
}

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

/* Checks one request line; on success sets *custom_id (malloc'ed) and the
 * body's span inside the line. Returns false after recording the error. */
static bool check_line(struct verrs *v, char *line, size_t len, int64_t lineno, const char *endpoint,
                       char **custom_id, const char **body, size_t *body_len)
{
    json_doc d;
    char e[128];
    if (json_parse(&d, line, len, e, sizeof e) || !json_is_obj(&d, 0)) {
        if (d.tok) json_free(&d);
        verr(v, "invalid_json_line", NULL, lineno,
             "This line is not parseable as valid JSON (a JSON object per line is expected).");
        return false;
    }
    bool ok = false;
    int i = json_get(&d, 0, "custom_id");
    int m = json_get(&d, 0, "method");
    int u = json_get(&d, 0, "url");
    int b = json_get(&d, 0, "body");
    if (i < 0 || !json_is_str(&d, i)) {
        verr(v, "missing_required_parameter", "custom_id", lineno,
             "Missing required parameter: 'custom_id' (a string).");
        goto done;
    }
    if (m < 0 || !json_is_str(&d, m)) {
        verr(v, "missing_required_parameter", "method", lineno, "Missing required parameter: 'method'.");
        goto done;
    }
    if (!json_str_eq(&d, m, "POST")) {
        verr(v, "invalid_method", "method", lineno, "The method of a batch request must be POST.");
        goto done;
    }
    if (u < 0 || !json_is_str(&d, u)) {
        verr(v, "missing_required_parameter", "url", lineno, "Missing required parameter: 'url'.");
        goto done;
    }
    if (!json_str_eq(&d, u, endpoint)) {
        size_t ul;
        const char *us = json_raw(&d, u, &ul);
        verr(v, "invalid_url", "url", lineno,
             "The url '%.*s' does not match the batch's endpoint '%s'; every request must use the batch's endpoint.",
             (int)(ul > 200 ? 200 : ul), us, endpoint);
        goto done;
    }
    if (b < 0 || !json_is_obj(&d, b)) {
        verr(v, "missing_required_parameter", "body", lineno,
             "Missing required parameter: 'body' (a JSON object).");
        goto done;
    }
    int st = json_get(&d, b, "stream");
    bool stream = false;
    if (st >= 0 && json_bool(&d, st, &stream) == 0 && stream) {
        verr(v, "invalid_value", "body.stream", lineno, "Streaming is not supported in a batch: 'stream' must not be true.");
        goto done;
    }
    *custom_id = json_strdup(&d, i, NULL);
    if (!*custom_id) {
        verr(v, "invalid_json_line", "custom_id", lineno, "The custom_id is not a valid JSON string.");
        goto done;
    }
    *body = json_raw(&d, b, body_len);
    ok = true;
done:
    json_free(&d);
    return ok;
}

/* Validates the batch's input file and creates its rows (one transaction),
 * moving it from validating to in_progress or failed. Returns 0 (either
 * way) or a negative status for an I/O or database failure, leaving the
 * batch `validating` for a later retry. */
static int validate_batch(store *s, const char *id, char *err, size_t errlen)
{
    sqlite3_stmt *st = prep(s,
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
    snprintf(endpoint, sizeof endpoint, "%s", col_text(st, 0));
    char *path = col_text(st, 1) ? path_join(s->dir, col_text(st, 1)) : NULL;
    sqlite3_finalize(st);

    struct verrs v = {.max = s->opts.max_errors};
    json_buf_init(&v.buf);
    FILE *f = NULL;
    char *line = NULL;
    size_t cap = 0;
    sqlite3_stmt *ins = NULL;
    int rc = begin(s, err, errlen);
    if (rc) goto fail_begin;
    /* a batch re-validated after a crash may have rows from the first try */
    sqlite3_stmt *del = prep(s, "DELETE FROM batch_requests WHERE batch_id = ?", err, errlen);
    if (!del) goto fail_db;
    sqlite3_bind_text(del, 1, id, -1, SQLITE_STATIC);
    r = sqlite3_step(del);
    sqlite3_finalize(del);
    if (r != SQLITE_DONE) goto fail_db;

    ins = prep(s, "INSERT INTO batch_requests (batch_id, line, custom_id, url, body) VALUES (?, ?, ?, ?, ?)", err,
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
                set_err(err, errlen, "reading the input file of %s: %s", id, strerror(errno));
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
        char *cid = NULL;
        const char *body;
        size_t blen;
        if (!check_line(&v, line, (size_t)len, lineno, endpoint, &cid, &body, &blen)) continue;
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
        set_err(err, errlen, "out of memory");
        rc = SL_ENOMEM;
        goto fail;
    }

    int64_t now = now_s(s);
    if (v.n) {
        rollback(s); /* drops every row inserted above */
        struct json_buf e;
        json_buf_init(&e);
        json_buf_add(&e, "{\"object\":\"list\",\"data\":[", 25);
        json_buf_add(&e, v.buf.p ? v.buf.p : "", v.buf.len);
        json_buf_add(&e, "]}", 2);
        if (e.oom) {
            json_buf_free(&e);
            set_err(err, errlen, "out of memory");
            rc = SL_ENOMEM;
            goto fail_begin;
        }
        st = prep(s, "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ?", err, errlen);
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
    st = prep(s, "UPDATE batches SET status = 'in_progress', in_progress_at = ?, n_total = ? WHERE id = ?", err,
              errlen);
    if (!st) goto fail_db;
    sqlite3_bind_int64(st, 1, now);
    sqlite3_bind_int64(st, 2, nreq);
    sqlite3_bind_text(st, 3, id, -1, SQLITE_STATIC);
    r = sqlite3_step(st);
    sqlite3_finalize(st);
    if (r != SQLITE_DONE) goto fail_db;
    rc = commit(s, err, errlen);
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
    rollback(s);
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
        set_err(err, errlen, "metadata: %s", e);
        return SL_EINVAL;
    }
    int rc = 0;
    if (json_is_null(&d, 0)) goto out;
    if (!json_is_obj(&d, 0) || json_size(&d, 0) > 16) {
        set_err(err, errlen, "metadata must be an object of at most 16 key-value pairs");
        rc = SL_EINVAL;
        goto out;
    }
    for (int k = 1, n = 0; n < json_size(&d, 0); n++) {
        size_t kl, vl;
        json_raw(&d, k, &kl);
        if (!json_is_str(&d, k + 1) || kl > 64 || (json_raw(&d, k + 1, &vl), vl > 512)) {
            set_err(err, errlen, "metadata values must be strings (keys up to 64, values up to 512 characters)");
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
    int rc = need_writer(s, err, errlen);
    if (rc) return rc;
    if (!input_file_id || !*input_file_id) {
        set_err(err, errlen, "input_file_id is required");
        return SL_EINVAL;
    }
    if (!endpoint ||
        (strcmp(endpoint, "/v1/chat/completions") && strcmp(endpoint, "/v1/completions") && strcmp(endpoint, "/v1/responses"))) {
        set_err(err, errlen, "endpoint must be '/v1/chat/completions', '/v1/completions' or '/v1/responses', not '%s'",
                endpoint ? endpoint : "");
        return SL_EINVAL;
    }
    int64_t window = store_parse_window(completion_window, s->opts.allow_short_windows, err, errlen);
    if (window < 0) return (int)window;
    if ((rc = check_metadata(metadata_json, err, errlen))) return rc;
    sqlite3_stmt *st = prep(s, "SELECT purpose FROM files WHERE id = ?", err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, input_file_id, -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    if (r == SQLITE_DONE) {
        set_err(err, errlen, "No such File object: %s", input_file_id);
        rc = STORE_ENOTFOUND;
    } else if (r != SQLITE_ROW) {
        rc = db_fail(s, "batch input", err, errlen);
    } else if (strcmp(col_text(st, 0), "batch") != 0) {
        set_err(err, errlen, "file %s has purpose '%s'; a batch needs a file uploaded with purpose 'batch'",
                input_file_id, col_text(st, 0));
        rc = SL_EINVAL;
    }
    sqlite3_finalize(st);
    if (rc) return rc;

    char id[STORE_ID_MAX];
    if ((rc = new_id("batch_", id, err, errlen))) return rc;
    int64_t now = now_s(s);
    st = prep(s,
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
    rc = validate_batch(s, id, err, errlen);
    if (rc) {
        /* not the file's fault: take the batch back rather than leave a
         * validating batch the client never heard of */
        st = prep(s, "DELETE FROM batches WHERE id = ?", NULL, 0);
        if (st) {
            sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
            sqlite3_step(st);
            sqlite3_finalize(st);
        }
        return rc;
    }
    copy_id(id_out, id);
    return 0;
}

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

static enum store_batch_status status_of(const char *name)
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
            set_err(err, errlen, "cannot create %s: %s", o->path, strerror(errno));
            return SL_EIO;
        }
    }
    if (fwrite(line->p, 1, line->len, o->f) != line->len) {
        set_err(err, errlen, "writing %s: %s", o->path, strerror(errno));
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
        set_err(err, errlen, "writing %s: %s", o->path, strerror(errno));
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

/* One output/error line for the row at the cursor (columns: line, custom_id,
 * state, status_code, result, error, request_id). */
static void result_line(struct json_buf *b, const char *batch_id, sqlite3_stmt *st)
{
    const char *hex = strchr(batch_id, '_');
    json_buf_addf(b, "{\"id\":\"batch_req_%s%08llx\",\"custom_id\":", hex ? hex + 1 : batch_id,
                  (unsigned long long)sqlite3_column_int64(st, 0));
    json_buf_add_str(b, col_text(st, 1), (size_t)sqlite3_column_bytes(st, 1));
    json_buf_add(b, ",\"response\":", 12);
    if (sqlite3_column_type(st, 3) == SQLITE_NULL || sqlite3_column_int(st, 3) == 0) {
        json_buf_add(b, "null", 4);
    } else {
        json_buf_addf(b, "{\"status_code\":%d,\"request_id\":", sqlite3_column_int(st, 3));
        if (col_text(st, 6)) json_buf_add_str(b, col_text(st, 6), (size_t)sqlite3_column_bytes(st, 6));
        else json_buf_add(b, "null", 4);
        json_buf_add(b, ",\"body\":", 8);
        add_raw_or_null(b, col_text(st, 4), (size_t)sqlite3_column_bytes(st, 4));
        json_buf_add(b, "}", 1);
    }
    json_buf_add(b, ",\"error\":", 9);
    add_raw_or_null(b, col_text(st, 5), (size_t)sqlite3_column_bytes(st, 5));
    json_buf_add(b, "}\n", 2);
}

/* Writes the output and error files of a batch whose rows are all finished,
 * records them, and moves the batch to `target`. Safe to repeat after a
 * crash or a failure (a full disk): both names are recorded before either
 * file is created, and only the final transaction makes the files (and the
 * new status) visible; a failure removes what was written. */
static int finish_batch(store *s, const char *id, enum store_batch_status target, char *err, size_t errlen)
{
    struct outfile out = {0}, bad = {0};
    struct outfile *of[2] = {&out, &bad};
    for (int k = 0; k < 2; k++) {
        int rc = new_id("file-", of[k]->id, err, errlen);
        if (rc) return rc;
        content_name(of[k]->id, of[k]->rel, sizeof of[k]->rel);
        snprintf(of[k]->path, sizeof of[k]->path, "%s/%s", s->dir, of[k]->rel);
    }
    const char *rels[2] = {out.rel, bad.rel};
    int rc = claim_names(s, rels, 2, err, errlen);
    if (rc) return rc;
    struct json_buf line;
    json_buf_init(&line);
    sqlite3_stmt *st = prep(s,
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
            set_err(err, errlen, "out of memory");
            rc = SL_ENOMEM;
            break;
        }
        rc = outfile_line(strcmp(col_text(st, 2), "done") == 0 ? &out : &bad, &line, err, errlen);
    }
    if (!rc && r != SQLITE_DONE) rc = db_fail(s, "finalize", err, errlen);
    sqlite3_finalize(st);
    json_buf_free(&line);
    if (!rc) rc = outfile_close(&out, err, errlen);
    if (!rc) rc = outfile_close(&bad, err, errlen);
    if (rc) goto fail_files;

    if ((rc = begin(s, err, errlen))) goto fail_files;
    char name[STORE_ID_MAX + 16];
    if (out.lines) {
        snprintf(name, sizeof name, "%s_output.jsonl", id);
        if ((rc = insert_file_row(s, out.id, "batch_output", name, out.bytes, out.lines, out.rel, err, errlen)))
            goto fail_txn;
    }
    if (bad.lines) {
        snprintf(name, sizeof name, "%s_error.jsonl", id);
        if ((rc = insert_file_row(s, bad.id, "batch_output", name, bad.bytes, bad.lines, bad.rel, err, errlen)))
            goto fail_txn;
    }
    if ((rc = forget_names(s, rels, 2, err, errlen))) goto fail_txn;
    char sql[256];
    const char *tname = store_batch_status_name(target);
    snprintf(sql, sizeof sql,
             "UPDATE batches SET status = '%s', %s_at = ?, output_file_id = ?, error_file_id = ?, finish = NULL"
             " WHERE id = ? AND status IN ('finalizing', 'cancelling')",
             tname, tname);
    st = prep(s, sql, err, errlen);
    if (!st) {
        rc = STORE_EDB;
        goto fail_txn;
    }
    sqlite3_bind_int64(st, 1, now_s(s));
    sqlite3_bind_text(st, 2, out.lines ? out.id : NULL, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, bad.lines ? bad.id : NULL, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 4, id, -1, SQLITE_STATIC);
    rc = sqlite3_step(st) == SQLITE_DONE ? 0 : db_fail(s, "finish batch", err, errlen);
    sqlite3_finalize(st);
    if (rc) goto fail_txn;
    if ((rc = commit(s, err, errlen))) goto fail_txn;
    return 1;

fail_txn:
    rollback(s);
fail_files:
    for (int k = 0; k < 2; k++) {
        if (of[k]->f) fclose(of[k]->f);
        remove_owned(s, of[k]->rel);
    }
    forget_names(s, rels, 2, NULL, 0);
    return rc;
}

/* 1 if the batch has a row in `state` (pending or running), 0 if not. */
static int has_rows(store *s, const char *id, const char *state, char *err, size_t errlen)
{
    /* literal states so that the partial indexes apply */
    sqlite3_stmt *st = prep(s,
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
    sqlite3_stmt *st = prep(s, sql, err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 2, t);
    int rc = sqlite3_step(st) == SQLITE_DONE ? sqlite3_changes(s->db) : db_fail(s, "update", err, errlen);
    sqlite3_finalize(st);
    return rc;
}

/* Moves a batch on when nothing is left to do for it (see the state chart at
 * the top). Returns 1 when its status changed, 0 when not, or an error. */
static int settle(store *s, const char *id, char *err, size_t errlen)
{
    sqlite3_stmt *st = prep(s, "SELECT status, finish FROM batches WHERE id = ?", err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    if (r != SQLITE_ROW) {
        sqlite3_finalize(st);
        return r == SQLITE_DONE ? 0 : db_fail(s, "settle", err, errlen);
    }
    enum store_batch_status cur = status_of(col_text(st, 0));
    enum store_batch_status target = col_text(st, 1) ? status_of(col_text(st, 1)) : STORE_BATCH_COMPLETED;
    sqlite3_finalize(st);
    int rc;
    switch (cur) {
    case STORE_BATCH_IN_PROGRESS:
        if ((rc = has_rows(s, id, "pending", err, errlen))) return rc < 0 ? rc : 0;
        if ((rc = has_rows(s, id, "running", err, errlen))) return rc < 0 ? rc : 0;
        rc = exec_bound(s,
                        "UPDATE batches SET status = 'finalizing', finalizing_at = ?2, finish = 'completed'"
                        " WHERE id = ?1 AND status = 'in_progress'",
                        id, now_s(s), err, errlen);
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
                        id, now_s(s), err, errlen);
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
    return finish_batch(s, id, target, err, errlen);
}

/* ---- cancel and expiry ------------------------------------------------------------------------ */

int store_batch_cancel(store *s, const char *id, char *err, size_t errlen)
{
    int rc = need_writer(s, err, errlen);
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
        set_err(err, errlen, "Cannot cancel a batch with status '%s'.", store_batch_status_name(b.status));
        return STORE_ECONFLICT;
    }
    int64_t now = now_s(s);
    if ((rc = begin(s, err, errlen))) return rc;
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
        rollback(s);
        return rc;
    }
    if ((rc = commit(s, err, errlen))) {
        rollback(s);
        return rc;
    }
    rc = settle(s, id, err, errlen);
    return rc < 0 ? rc : 0;
}

/* ids of batches matching a query with one int64 parameter, malloc'ed */
static int collect_ids(store *s, const char *sql, int64_t p, char (**ids)[STORE_ID_MAX], int *n, char *err,
                       size_t errlen)
{
    *ids = NULL;
    *n = 0;
    sqlite3_stmt *st = prep(s, sql, err, errlen);
    if (!st) return STORE_EDB;
    if (sqlite3_bind_parameter_count(st) > 0) sqlite3_bind_int64(st, 1, p);
    int cap = 0, r, rc = 0;
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            void *q = realloc(*ids, (size_t)cap * STORE_ID_MAX);
            if (!q) {
                set_err(err, errlen, "out of memory");
                rc = SL_ENOMEM;
                break;
            }
            *ids = q;
        }
        copy_id((*ids)[(*n)++], col_text(st, 0));
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
    int rc = begin(s, err, errlen);
    if (rc) return rc;
    int n = exec_bound(s,
                       "UPDATE batch_requests SET state = 'expired', finished_at = ?2,"
                       " error = '{\"code\":\"batch_expired\",\"message\":\"This request could not be executed"
                       " before the completion window expired.\"}'"
                       " WHERE batch_id = ?1 AND state IN ('pending', 'running')",
                       id, now, err, errlen);
    if (n < 0) goto fail;
    sqlite3_stmt *st = prep(s,
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
    if ((rc = commit(s, err, errlen))) goto fail;
    return finish_batch(s, id, STORE_BATCH_EXPIRED, err, errlen);
fail:
    rollback(s);
    return n < 0 ? n : rc;
}

int store_tick(store *s, char *err, size_t errlen)
{
    int rc = need_writer(s, err, errlen);
    if (rc) return rc;
    int64_t now = now_s(s);
    char (*ids)[STORE_ID_MAX];
    int n, changed = 0;
    rc = collect_ids(s, "SELECT id FROM batches WHERE status = 'in_progress' AND expires_at <= ? ORDER BY seq", now,
                     &ids, &n, err, errlen);
    if (rc) return rc;
    for (int i = 0; i < n && !rc; i++) {
        int r = expire_batch(s, ids[i], now, err, errlen);
        if (r < 0) rc = r;
        else changed += r;
    }
    free(ids);
    if (rc) return rc;
    rc = collect_ids(s,
                     "SELECT id FROM batches WHERE status IN ('in_progress', 'finalizing', 'cancelling')"
                     " ORDER BY seq",
                     0, &ids, &n, err, errlen);
    if (rc) return rc;
    for (int i = 0; i < n && !rc; i++) {
        int r = settle(s, ids[i], err, errlen);
        if (r < 0) rc = r;
        else changed += r;
    }
    free(ids);
    return rc ? rc : changed;
}

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
    int rc = need_writer(s, err, errlen);
    if (rc) return rc;
    if (max_n <= 0) return 0;
    if (max_n > 1 << 20) max_n = 1 << 20;
    char (*ids)[STORE_ID_MAX];
    int nb;
    if ((rc = collect_ids(s, "SELECT id FROM batches WHERE status = 'in_progress' ORDER BY seq", 0, &ids,
                          &nb, err, errlen)))
        return rc;
    struct store_row *rows = NULL;
    int n = 0;
    sqlite3_stmt *sel = NULL, *upd = NULL;
    if (!nb) goto done;
    rows = calloc((size_t)max_n, sizeof *rows);
    if (!rows) {
        set_err(err, errlen, "out of memory");
        rc = SL_ENOMEM;
        goto fail;
    }
    if ((rc = begin(s, err, errlen))) goto fail;
    sel = prep(s,
               "SELECT id, line, custom_id, url, body FROM batch_requests"
               " WHERE batch_id = ? AND state = 'pending' ORDER BY line LIMIT ?",
               err, errlen);
    upd = prep(s, "UPDATE batch_requests SET state = 'running' WHERE id = ?", err, errlen);
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
            copy_id(w->batch_id, ids[b]);
            w->custom_id = xstrdup(col_text(sel, 2));
            w->url = xstrdup(col_text(sel, 3));
            w->body = xstrdup(col_text(sel, 4));
            w->body_len = (size_t)sqlite3_column_bytes(sel, 4);
            if (!w->custom_id || !w->url || !w->body) {
                set_err(err, errlen, "out of memory");
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
    if ((rc = commit(s, err, errlen))) goto fail_txn;
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
    rollback(s);
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
    int rc = need_writer(s, err, errlen);
    if (rc) return rc;
    if (n <= 0) return 0;
    char (*touched)[STORE_ID_MAX] = calloc((size_t)n, STORE_ID_MAX);
    if (!touched) {
        set_err(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    int nt = 0, applied = 0;
    sqlite3_stmt *get = NULL, *upd = NULL, *cnt = NULL;
    if ((rc = begin(s, err, errlen))) goto fail;
    get = prep(s, "SELECT batch_id, state FROM batch_requests WHERE id = ?", err, errlen);
    upd = prep(s,
               "UPDATE batch_requests SET state = ?, status_code = ?, result = ?, error = ?, request_id = ?,"
               " finished_at = ? WHERE id = ? AND state IN ('pending', 'running')",
               err, errlen);
    cnt = prep(s, "UPDATE batches SET n_completed = n_completed + ?, n_failed = n_failed + ? WHERE id = ?", err,
               errlen);
    if (!get || !upd || !cnt) {
        rc = STORE_EDB;
        goto fail_txn;
    }
    int64_t now = now_s(s);
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
        copy_id(batch, col_text(get, 0));
        snprintf(state, sizeof state, "%s", col_text(get, 1));
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
        if (code) {
            json_buf_add(&e, "{\"code\":", 8);
            json_buf_add_str(&e, code, strlen(code));
            json_buf_add(&e, ",\"message\":", 11);
            const char *m = res->error_message ? res->error_message
                            : cancelled        ? "The batch was cancelled while this request ran."
                                               : "";
            json_buf_add_str(&e, m, strlen(m));
            json_buf_add(&e, "}", 1);
        }
        if ((res->body && !body && !cancelled) || e.oom) {
            if (owned) free(body);
            json_buf_free(&e);
            set_err(err, errlen, "out of memory");
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
        if (t == nt) copy_id(touched[nt++], batch);
    }
    sqlite3_finalize(get);
    sqlite3_finalize(upd);
    sqlite3_finalize(cnt);
    get = upd = cnt = NULL;
    if ((rc = commit(s, err, errlen))) goto fail_txn;
    /* the results are safe: a failure from here on (the output file on a
     * full disk) is not theirs, and store_tick() retries finalizing */
    for (int t = 0; t < nt; t++) {
        char e2[256];
        if (settle(s, touched[t], e2, sizeof e2) < 0) break;
    }
    free(touched);
    return applied;

fail_txn:
    sqlite3_finalize(get);
    sqlite3_finalize(upd);
    sqlite3_finalize(cnt);
    rollback(s);
fail:
    free(touched);
    return rc;
}

/* ---- batch objects ------------------------------------------------------------------------- */

#define BATCH_COLS                                                                                          \
    "id, endpoint, errors, input_file_id, completion_window, status, output_file_id, error_file_id,"        \
    " created_at, in_progress_at, expires_at, finalizing_at, completed_at, failed_at, expired_at,"          \
    " cancelling_at, cancelled_at, n_total, n_completed, n_failed, metadata"

static void add_text_or_null(struct json_buf *b, sqlite3_stmt *st, int i, bool raw)
{
    const char *t = col_text(st, i);
    if (!t) json_buf_add(b, "null", 4);
    else if (raw) json_buf_add(b, t, (size_t)sqlite3_column_bytes(st, i));
    else json_buf_add_str(b, t, (size_t)sqlite3_column_bytes(st, i));
}

static void batch_json(sqlite3_stmt *st, struct json_buf *b)
{
    static const char *const ts[] = {"created_at",  "in_progress_at", "expires_at",    "finalizing_at",
                                     "completed_at", "failed_at",      "expired_at",    "cancelling_at",
                                     "cancelled_at"};
    json_buf_add(b, "{\"id\":", 6);
    add_text_or_null(b, st, 0, false);
    json_buf_add(b, ",\"object\":\"batch\",\"endpoint\":", 29);
    add_text_or_null(b, st, 1, false);
    json_buf_add(b, ",\"errors\":", 10);
    add_text_or_null(b, st, 2, true);
    json_buf_add(b, ",\"input_file_id\":", 17);
    add_text_or_null(b, st, 3, false);
    json_buf_add(b, ",\"completion_window\":", 21);
    add_text_or_null(b, st, 4, false);
    json_buf_add(b, ",\"status\":", 10);
    add_text_or_null(b, st, 5, false);
    json_buf_add(b, ",\"output_file_id\":", 18);
    add_text_or_null(b, st, 6, false);
    json_buf_add(b, ",\"error_file_id\":", 17);
    add_text_or_null(b, st, 7, false);
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
    sqlite3_stmt *st = prep(s, "SELECT " BATCH_COLS " FROM batches WHERE id = ?", err, errlen);
    *rc = STORE_EDB;
    if (!st) return NULL;
    sqlite3_bind_text(st, 1, id ? id : "", -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    if (r == SQLITE_ROW) {
        *rc = 0;
        return st;
    }
    if (r == SQLITE_DONE) {
        set_err(err, errlen, "No such Batch object: %s", id ? id : "");
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
    copy_id(out->id, col_text(st, 0));
    out->status = status_of(col_text(st, 5));
    copy_id(out->output_file_id, col_text(st, 6));
    copy_id(out->error_file_id, col_text(st, 7));
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
        set_err(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    return 0;
}

int store_batch_list_json(store *s, const char *after, int limit, struct json_buf *out, char *err, size_t errlen)
{
    if (limit <= 0) limit = 20;
    if (limit > 100) limit = 100;
    int64_t seq;
    int rc = after_seq(s, "batches", after, &seq, err, errlen);
    if (rc) return rc;
    sqlite3_stmt *st = prep(s, "SELECT " BATCH_COLS " FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?", err,
                            errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_int64(st, 1, seq);
    sqlite3_bind_int(st, 2, limit + 1);
    return list_json(s, st, limit, batch_json, "list batches", out, err, errlen);
}
