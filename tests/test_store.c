/* test_store.c - the SQLite job queue: schema and migrations, files, batch
 * validation, lifecycle, cancel, expiry, listing, crash recovery under
 * SIGKILL, a 50,000-line batch in bounded memory, limits. Runs in a temp dir. */
#include "store/store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/test.h"

/* Under AddressSanitizer (make asan) the crash test forks fewer times and
 * the large file is smaller: the same paths, in seconds; peak RSS, which
 * ASan's shadow memory and quarantine inflate, is not judged there. */
#ifdef __SANITIZE_ADDRESS__
#define CRASH_ROUNDS 25
#define LARGE_LINES 5000
#else
#define CRASH_ROUNDS 200
#define LARGE_LINES 50000
#endif

static char root[256];
static int dir_seq;
static char err[512];

/* ---- helpers ----------------------------------------------------------------- */

static void new_dir(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s-%d", root, name, dir_seq++);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f) abort();
    fputs(text, f);
    fclose(f);
}

/* Writes text to a fresh file beside the data dirs and hands it to the store. */
static int upload(store *s, const char *purpose, const char *text, char *id)
{
    (void)s;
    char path[512];
    snprintf(path, sizeof path, "%s/upload-XXXXXX", root);
    int fd = mkstemp(path);
    if (fd < 0) abort();
    close(fd);
    write_text(path, text);
    return store_file_create(s, path, purpose, "input.jsonl", id, err, sizeof err);
}

static int collect_cb(void *ctx, const char *p, size_t n)
{
    json_buf_add(ctx, p, n);
    return 0;
}

/* File content as a NUL-terminated string (caller frees), or NULL. */
static char *content(store *s, const char *id)
{
    struct json_buf b;
    json_buf_init(&b);
    json_buf_add(&b, "", 0);
    if (store_file_content(s, id, collect_cb, &b, err, sizeof err)) {
        json_buf_free(&b);
        return NULL;
    }
    return b.p;
}

static int64_t q1(const char *dir, const char *sql)
{
    char path[512];
    snprintf(path, sizeof path, "%s/sluice.db", dir);
    sqlite3 *db;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) return -999;
    sqlite3_stmt *st;
    int64_t v = -998;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) == SQLITE_OK) {
        if (sqlite3_step(st) == SQLITE_ROW) v = sqlite3_column_int64(st, 0);
        sqlite3_finalize(st);
    }
    sqlite3_close(db);
    return v;
}

static int write_abc(void *ctx, int fd, char *e, size_t elen)
{
    if (!ctx) { /* half written, then a failure */
        if (write(fd, "half", 4) != 4) abort();
        snprintf(e, elen, "the writer failed");
        return SL_EIO;
    }
    size_t n = strlen(ctx);
    return write(fd, ctx, n) == (ssize_t)n ? 0 : SL_EIO;
}

/* Entries in dir/sub (dot files aside). */
static int count_dir(const char *dir, const char *sub)
{
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, sub);
    int n = 0;
    DIR *d = opendir(p);
    for (struct dirent *e; d && (e = readdir(d));) n += e->d_name[0] != '.';
    if (d) closedir(d);
    return n;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; s && *s; s++) n += *s == '\n';
    return n;
}

/* Value of "key" (a string) at the JSON object text obj, copied into out. */
static bool jstr(const char *text, const char *key, char *out, size_t cap)
{
    json_doc d;
    char e[128];
    out[0] = '\0';
    if (json_parse(&d, text, strlen(text), e, sizeof e)) return false;
    int i = json_get(&d, 0, key);
    bool ok = i >= 0 && json_str(&d, i, out, cap) >= 0;
    json_free(&d);
    return ok;
}

static int64_t fake_now = 1700000000;
static int64_t fake_clock(void *ctx)
{
    (void)ctx;
    return fake_now;
}

static char *request_lines(int n, int first, const char *extra)
{
    struct json_buf b;
    json_buf_init(&b);
    for (int i = 0; i < n; i++)
        json_buf_addf(&b,
                      "{\"custom_id\":\"req-%d\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\","
                      "\"body\":{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi %d%s\"}]}}\n",
                      first + i, first + i, extra ? extra : "");
    return b.p;
}

static store *open_dir(const char *dir, const struct store_opts *o)
{
    store *s = store_open(dir, o, err, sizeof err);
    if (!s) printf("  store_open(%s): %s\n", dir, err);
    return s;
}

/* Creates a batch of n requests and returns its id in bid. */
static int make_batch(store *s, int n, char *bid)
{
    char fid[STORE_ID_MAX];
    char *t = request_lines(n, 0, NULL);
    int rc = upload(s, "batch", t, fid);
    free(t);
    if (rc) return rc;
    return store_batch_create(s, fid, "/v1/chat/completions", "24h", NULL, bid, err, sizeof err);
}

static void result_for(struct store_result *r, const struct store_row *row, char *buf, size_t cap)
{
    snprintf(buf, cap, "{\"object\":\"chat.completion\",\"echo\":\"%s\"}", row->custom_id);
    memset(r, 0, sizeof *r);
    r->row_id = row->row_id;
    r->status_code = 200;
    r->request_id = "req_x";
    r->body = buf;
}

/* ---- tests -------------------------------------------------------------------- */

static void test_schema_and_reopen(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "schema");
    for (int k = 0; k < 3; k++) {
        store *s = open_dir(dir, NULL);
        CHECK(s);
        store_close(s);
    }
    CHECK(q1(dir, "PRAGMA user_version") == 2);
    CHECK(q1(dir, "SELECT count(*) FROM sqlite_master WHERE type = 'table'") == 4);
    CHECK(q1(dir, "SELECT count(*) FROM sqlite_master WHERE name = 'batch_requests_pending'") == 1);
    char path[600];
    snprintf(path, sizeof path, "%s/sluice.db", dir);
    sqlite3 *db;
    sqlite3_open(path, &db);
    sqlite3_stmt *st;
    sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &st, NULL);
    CHECK(sqlite3_step(st) == SQLITE_ROW && strcmp((const char *)sqlite3_column_text(st, 0), "wal") == 0);
    sqlite3_finalize(st);

    /* a reader sees the schema and cannot write */
    store *w = open_dir(dir, NULL);
    store *r = store_open_reader(dir, err, sizeof err);
    CHECKF(r, "%s", err);
    struct json_buf b;
    json_buf_init(&b);
    CHECK(store_batch_list_json(r, NULL, 0, &b, err, sizeof err) == 0);
    CHECK(b.p && strstr(b.p, "\"data\":[]") && strstr(b.p, "\"has_more\":false"));
    json_buf_free(&b);
    CHECK(store_batch_cancel(r, "batch_x", err, sizeof err) == SL_EINVAL);
    CHECK(store_tick(r, err, sizeof err) == SL_EINVAL);
    store_close(r);
    store_close(w);

    /* a newer schema is refused, not "migrated" backwards */
    sqlite3_exec(db, "PRAGMA user_version = 99", NULL, NULL, NULL);
    sqlite3_close(db);
    store *s = store_open(dir, NULL, err, sizeof err);
    CHECK(!s && strstr(err, "newer"));
    store_close(s);
    CHECK(!store_open_reader("/nonexistent/sluice", err, sizeof err));
}

static void test_window_parse(void)
{
    CHECK(store_parse_window("24h", false, err, sizeof err) == 86400);
    CHECK(store_parse_window("2s", false, err, sizeof err) == SL_EINVAL);
    CHECK(store_parse_window("2s", true, err, sizeof err) == 2);
    CHECK(store_parse_window("5m", true, err, sizeof err) == 300);
    CHECK(store_parse_window("1h", true, err, sizeof err) == 3600);
    CHECK(store_parse_window("0s", true, err, sizeof err) == SL_EINVAL);
    CHECK(store_parse_window("-1s", true, err, sizeof err) == SL_EINVAL);
    CHECK(store_parse_window("2x", true, err, sizeof err) == SL_EINVAL);
    CHECK(store_parse_window("", true, err, sizeof err) == SL_EINVAL);
    CHECK(store_parse_window("200h", true, err, sizeof err) == SL_EINVAL);
}

static void test_files(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "files");
    store *s = open_dir(dir, NULL);
    store *r = store_open_reader(dir, err, sizeof err);
    char a[STORE_ID_MAX], b2[STORE_ID_MAX];
    const char *text = "{\"a\":1}\n\n{\"b\":2}\n";
    CHECKF(upload(s, "batch", text, a) == 0, "%s", err);
    CHECK(strncmp(a, "file-", 5) == 0);
    CHECKF(upload(s, "fine-tune", "x", b2) == 0, "%s", err);
    CHECK(q1(dir, "SELECT lines FROM files ORDER BY seq LIMIT 1") == 2);

    struct json_buf j;
    json_buf_init(&j);
    CHECK(store_file_get_json(r, a, &j, err, sizeof err) == 0);
    char v[128];
    CHECK(jstr(j.p, "id", v, sizeof v) && strcmp(v, a) == 0);
    CHECK(jstr(j.p, "purpose", v, sizeof v) && strcmp(v, "batch") == 0);
    CHECK(jstr(j.p, "filename", v, sizeof v) && strcmp(v, "input.jsonl") == 0);
    CHECK(jstr(j.p, "object", v, sizeof v) && strcmp(v, "file") == 0);
    CHECK(strstr(j.p, "\"bytes\":17,"));
    json_buf_free(&j);

    /* listing: newest first, purpose filter, pagination */
    json_buf_init(&j);
    CHECK(store_file_list_json(r, NULL, NULL, 1, &j, err, sizeof err) == 0);
    CHECK(strstr(j.p, b2) && !strstr(j.p, a) && strstr(j.p, "\"has_more\":true"));
    json_buf_free(&j);
    json_buf_init(&j);
    CHECK(store_file_list_json(r, NULL, b2, 1, &j, err, sizeof err) == 0);
    CHECK(strstr(j.p, a) && strstr(j.p, "\"has_more\":false"));
    json_buf_free(&j);
    json_buf_init(&j);
    CHECK(store_file_list_json(r, "batch", NULL, 0, &j, err, sizeof err) == 0);
    CHECK(strstr(j.p, a) && !strstr(j.p, b2));
    json_buf_free(&j);
    json_buf_init(&j);
    CHECK(store_file_list_json(r, NULL, "file-nope", 0, &j, err, sizeof err) == STORE_ENOTFOUND);
    json_buf_free(&j);

    /* content, streamed and as an fd */
    char *c = content(r, a);
    CHECK(c && strcmp(c, text) == 0);
    free(c);
    int fd = -1;
    int64_t size = 0;
    CHECK(store_file_open_content(r, a, &fd, &size, err, sizeof err) == 0 && size == 17);
    char buf[32] = {0};
    CHECK(fd >= 0 && read(fd, buf, sizeof buf) == 17 && strcmp(buf, text) == 0);
    if (fd >= 0) close(fd);

    /* the upload was moved, not copied, to a name the store gave it */
    CHECK(q1(dir, "SELECT count(*) FROM files") == 2);
    CHECK(q1(dir, "SELECT count(*) FROM owned_names") == 0);
    char tmpfile[600];
    snprintf(tmpfile, sizeof tmpfile, "%s/files/%s.sluice", dir, a);
    CHECK(access(tmpfile, F_OK) == 0);

    /* delete */
    json_buf_init(&j);
    CHECK(store_file_delete(r, a, &j, err, sizeof err) == SL_EINVAL); /* reader */
    CHECK(store_file_delete(s, a, &j, err, sizeof err) == 0);
    CHECK(j.p && strstr(j.p, "\"deleted\":true"));
    json_buf_free(&j);
    CHECK(access(tmpfile, F_OK) != 0);
    json_buf_init(&j);
    CHECK(store_file_get_json(r, a, &j, err, sizeof err) == STORE_ENOTFOUND);
    CHECK(store_file_delete(s, a, NULL, err, sizeof err) == STORE_ENOTFOUND);
    CHECK(store_file_content(r, a, collect_cb, &j, err, sizeof err) == STORE_ENOTFOUND);
    json_buf_free(&j);

    /* a missing upload is an I/O error, nothing recorded */
    char id[STORE_ID_MAX];
    CHECK(store_file_create(s, "/nonexistent/upload", "batch", "x", id, err, sizeof err) == SL_EIO);
    CHECK(q1(dir, "SELECT count(*) FROM files") == 1);

    /* content from a writer callback; a failing writer leaves nothing */
    CHECKF(store_file_write(s, write_abc, "abc\n", "batch", "cb.jsonl", id, err, sizeof err) == 0, "%s", err);
    c = content(r, id);
    CHECK(c && strcmp(c, "abc\n") == 0);
    free(c);
    CHECK(store_file_write(s, write_abc, NULL, "batch", "cb.jsonl", id, err, sizeof err) == SL_EIO);
    CHECK(strstr(err, "writer failed"));
    CHECK(q1(dir, "SELECT count(*) FROM files") == 2 && q1(dir, "SELECT count(*) FROM owned_names") == 0);
    CHECK(count_dir(dir, "files") == 2);
    store_close(r);
    store_close(s);
}

/* The store removes only what it recorded. Files it did not make
 * survive every start; a directory that is not a data directory, or one
 * whose database is gone, empty or another's, is refused with nothing
 * touched. */
static void test_foreign_files(void)
{
    char dir[512], p[700];
    /* the reproduction: user files in tmp/ and files/, no database */
    new_dir(dir, sizeof dir, "foreign");
    snprintf(p, sizeof p, "%s/tmp", dir);
    CHECK(mkdir(dir, 0755) == 0 && mkdir(p, 0755) == 0);
    snprintf(p, sizeof p, "%s/files", dir);
    CHECK(mkdir(p, 0755) == 0);
    snprintf(p, sizeof p, "%s/tmp/notes.txt", dir);
    write_text(p, "a\n");
    snprintf(p, sizeof p, "%s/files/thesis.docx", dir);
    write_text(p, "b\n");
    store *s = store_open(dir, NULL, err, sizeof err);
    CHECKF(!s && strstr(err, "not empty") && strstr(err, "refusing"), "%s", err);
    store_close(s);
    snprintf(p, sizeof p, "%s/sluice.db", dir);
    CHECK(access(p, F_OK) != 0); /* not even a database was made there */
    CHECK(count_dir(dir, "tmp") == 1 && count_dir(dir, "files") == 1);

    /* in a data directory of its own, the same files survive every start */
    char dir2[512];
    new_dir(dir2, sizeof dir2, "foreign2");
    s = open_dir(dir2, NULL);
    char fid[STORE_ID_MAX];
    CHECK(s && upload(s, "batch", "{}\n", fid) == 0);
    store_close(s);
    snprintf(p, sizeof p, "%s/tmp", dir2);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/tmp/notes.txt", dir2);
    write_text(p, "a\n");
    snprintf(p, sizeof p, "%s/files/thesis.docx", dir2);
    write_text(p, "b\n");
    snprintf(p, sizeof p, "%s/files/file-orphan", dir2); /* the old sweep's prey */
    write_text(p, "c\n");
    for (int k = 0; k < 2; k++) {
        s = open_dir(dir2, NULL);
        CHECK(s);
        store_close(s);
    }
    CHECK(count_dir(dir2, "tmp") == 1 && count_dir(dir2, "files") == 3);

    /* the database deleted, emptied, or another's: refused, nothing removed */
    char db[600];
    snprintf(db, sizeof db, "%s/sluice.db", dir2);
    char saved[600];
    snprintf(saved, sizeof saved, "%s/saved.db", root);
    CHECK(rename(db, saved) == 0);
    char wal[620];
    snprintf(wal, sizeof wal, "%s-wal", db);
    unlink(wal);
    snprintf(wal, sizeof wal, "%s-shm", db);
    unlink(wal);
    s = store_open(dir2, NULL, err, sizeof err);
    CHECKF(!s && strstr(err, "missing"), "%s", err);
    CHECK(access(db, F_OK) != 0);
    write_text(db, ""); /* truncated to 0 bytes */
    s = store_open(dir2, NULL, err, sizeof err);
    CHECKF(!s && strstr(err, "sluice.db is empty"), "%s", err);
    write_text(db, "this is not a database, it is a thesis");
    s = store_open(dir2, NULL, err, sizeof err);
    CHECKF(!s, "a text file opened as the database");
    store_close(s);
    unlink(db);
    /* another data directory's database: it does not list this one's file */
    char other[512], odb[600];
    new_dir(other, sizeof other, "other");
    s = open_dir(other, NULL);
    store_close(s);
    snprintf(odb, sizeof odb, "%s/sluice.db", other);
    CHECK(rename(odb, db) == 0);
    s = store_open(dir2, NULL, err, sizeof err);
    CHECKF(!s && strstr(err, "does not list it") && strstr(err, fid), "%s", err);
    CHECK(count_dir(dir2, "tmp") == 1 && count_dir(dir2, "files") == 3);
    /* the right database back: all is well */
    unlink(db);
    CHECK(rename(saved, db) == 0);
    s = open_dir(dir2, NULL);
    CHECK(s);
    char *c = s ? content(s, fid) : NULL;
    CHECK(c && strcmp(c, "{}\n") == 0);
    free(c);
    store_close(s);

    /* a directory like / or a home directory: refused before anything */
    char home[512];
    new_dir(home, sizeof home, "home");
    mkdir(home, 0755);
    snprintf(p, sizeof p, "%s/.bashrc", home);
    write_text(p, "x");
    s = store_open(home, NULL, err, sizeof err);
    CHECKF(!s && strstr(err, ".bashrc"), "%s", err);
    CHECK(count_dir(home, ".") == 0); /* only the dot file, nothing added */
    snprintf(p, sizeof p, "%s/sluice.db", home);
    CHECK(access(p, F_OK) != 0);
}

/* Names recorded before a crash: the file of a recorded name that never
 * became a row is removed at open; a recorded name not shaped as the store
 * names files, or one a row owns, is never removed. */
static void test_recorded_names(void)
{
    char dir[512], p[700];
    new_dir(dir, sizeof dir, "names");
    store *s = open_dir(dir, NULL);
    char fid[STORE_ID_MAX];
    CHECK(upload(s, "batch", "{}\n", fid) == 0);
    store_close(s);
    const char *half = "files/file-0123456789abcdef01234567.sluice";
    snprintf(p, sizeof p, "%s/%s", dir, half);
    write_text(p, "half written");
    snprintf(p, sizeof p, "%s/files/notes.txt", dir);
    write_text(p, "mine");
    char db[600];
    snprintf(db, sizeof db, "%s/sluice.db", dir);
    sqlite3 *h;
    sqlite3_open(db, &h);
    char sql[600];
    snprintf(sql, sizeof sql,
             "INSERT INTO owned_names VALUES ('%s', 1), ('files/notes.txt', 1), ('../../etc/x', 1),"
             " ('files/%s.sluice', 1)",
             half, fid);
    CHECK(sqlite3_exec(h, sql, NULL, NULL, NULL) == SQLITE_OK);
    sqlite3_close(h);
    s = open_dir(dir, NULL);
    CHECK(s);
    snprintf(p, sizeof p, "%s/%s", dir, half);
    CHECK(access(p, F_OK) != 0);
    snprintf(p, sizeof p, "%s/files/notes.txt", dir);
    CHECK(access(p, F_OK) == 0);
    char *c = s ? content(s, fid) : NULL;
    CHECK(c && strcmp(c, "{}\n") == 0);
    free(c);
    CHECK(q1(dir, "SELECT count(*) FROM owned_names") == 0);
    store_close(s);
}

static void test_validation(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "valid");
    store *s = open_dir(dir, NULL);
    char fid[STORE_ID_MAX], bid[STORE_ID_MAX];
    const char *text =
        "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{}}\n" /* 1 ok */
        "{\"custom_id\":\"b\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{}\n"  /* 2 bad json */
        "{\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{}}\n"                    /* 3 no custom_id */
        "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{}}\n" /* 4 duplicate */
        "\n"                                                                                      /* 5 blank */
        "{\"custom_id\":\"c\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{}}\n"     /* 6 url */
        "{\"custom_id\":\"d\",\"method\":\"GET\",\"url\":\"/v1/chat/completions\",\"body\":{}}\n" /* 7 method */
        "{\"custom_id\":\"e\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{\"stream\":true}}\n" /* 8 */
        "{\"custom_id\":\"f\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\"}\n"           /* 9 no body */
        "[1,2]\n"                                                                                  /* 10 not an object */
        "{\"custom_id\":\"g\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{\"stream\":false}}\n";
    CHECKF(upload(s, "batch", text, fid) == 0, "%s", err);
    CHECKF(store_batch_create(s, fid, "/v1/chat/completions", "24h", "{\"k\":\"v\"}", bid, err, sizeof err) == 0,
           "%s", err);
    struct store_batch_info info;
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0);
    CHECK(info.status == STORE_BATCH_FAILED);
    CHECK(q1(dir, "SELECT count(*) FROM batch_requests") == 0);
    struct json_buf j;
    json_buf_init(&j);
    CHECK(store_batch_get_json(s, bid, &j, err, sizeof err) == 0);
    json_doc d;
    char e[128];
    CHECKF(json_parse(&d, j.p, j.len, e, sizeof e) == 0, "%s: %s", e, j.p);
    static const struct { const char *code, *param; int line; } want[] = {
        {"invalid_json_line", NULL, 2},         {"missing_required_parameter", "custom_id", 3},
        {"duplicate_custom_id", "custom_id", 4}, {"invalid_url", "url", 6},
        {"invalid_method", "method", 7},        {"invalid_value", "body.stream", 8},
        {"missing_required_parameter", "body", 9}, {"invalid_json_line", NULL, 10},
    };
    int errs = json_get(&d, 0, "errors");
    int data = json_get(&d, errs, "data");
    CHECKF(json_size(&d, data) == 8, "%d errors: %s", json_size(&d, data), j.p);
    for (int k = 0; k < 8 && k < json_size(&d, data); k++) {
        int o = json_at(&d, data, k);
        int64_t line = 0;
        CHECKF(json_str_eq(&d, json_get(&d, o, "code"), want[k].code), "error %d code", k);
        CHECKF(json_i64(&d, json_get(&d, o, "line"), &line) == 0 && line == want[k].line, "error %d line", k);
        int p = json_get(&d, o, "param");
        CHECKF(want[k].param ? json_str_eq(&d, p, want[k].param) : json_is_null(&d, p), "error %d param", k);
        CHECK(json_is_str(&d, json_get(&d, o, "message")));
    }
    CHECK(json_str_eq(&d, json_get(&d, 0, "status"), "failed"));
    CHECK(!json_is_null(&d, json_get(&d, 0, "failed_at")));
    CHECK(json_is_null(&d, json_get(&d, 0, "in_progress_at")));
    CHECK(json_str_eq(&d, json_get(&d, json_get(&d, 0, "metadata"), "k"), "v"));
    json_free(&d);
    json_buf_free(&j);

    /* request errors (the batch is not created) */
    CHECK(store_batch_create(s, fid, "/v1/embeddings", "24h", NULL, bid, err, sizeof err) == SL_EINVAL);
    CHECK(store_batch_create(s, "file-nope", "/v1/chat/completions", "24h", NULL, bid, err, sizeof err) ==
          STORE_ENOTFOUND);
    CHECK(store_batch_create(s, fid, "/v1/chat/completions", "2s", NULL, bid, err, sizeof err) == SL_EINVAL);
    CHECK(store_batch_create(s, fid, "/v1/chat/completions", "24h", "[1]", bid, err, sizeof err) == SL_EINVAL);
    CHECK(store_batch_create(s, fid, "/v1/chat/completions", "24h", "{\"k\":1}", bid, err, sizeof err) == SL_EINVAL);
    char other[STORE_ID_MAX];
    CHECK(upload(s, "fine-tune", "{}\n", other) == 0);
    CHECK(store_batch_create(s, other, "/v1/chat/completions", "24h", NULL, bid, err, sizeof err) == SL_EINVAL);
    CHECK(q1(dir, "SELECT count(*) FROM batches") == 1);

    /* empty file */
    CHECK(upload(s, "batch", "\n\n", fid) == 0);
    CHECK(store_batch_create(s, fid, "/v1/chat/completions", "24h", NULL, bid, err, sizeof err) == 0);
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0 && info.status == STORE_BATCH_FAILED);
    store_close(s);
}

/* The line rules run-batch shares: each refusal's code and parameter, the
 * custom_id kept on failure, the url matched against the batch's endpoint
 * or (NULL) any of the three; and the output line's shape. */
static void test_line_rules(void)
{
    static const struct {
        const char *line, *endpoint, *code, *param, *cid, *url;
    } cases[] = {
        {"{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/responses\",\"body\":{\"input\":\"x\"}}", NULL, NULL,
         NULL, "a", "/v1/responses"},
        {"{\"custom_id\":\"b\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{}}", "/v1/completions",
         NULL, NULL, "b", "/v1/completions"},
        {"{\"custom_id\":\"c\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{}}",
         "/v1/chat/completions", "invalid_url", "url", "c", NULL},
        {"{\"custom_id\":\"d\",\"method\":\"POST\",\"url\":\"/v1/embeddings\",\"body\":{}}", NULL, "invalid_url",
         "url", "d", NULL},
        {"{\"custom_id\":\"e\",\"method\":\"GET\",\"url\":\"/v1/completions\",\"body\":{}}", NULL, "invalid_method",
         "method", "e", NULL},
        {"{\"custom_id\":\"f\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"stream\":true}}", NULL,
         "invalid_value", "body.stream", "f", NULL},
        {"{\"custom_id\":7,\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{}}", NULL,
         "missing_required_parameter", "custom_id", NULL, NULL},
        {"{\"custom_id\":\"g\",\"method\":\"POST\",\"url\":\"/v1/completions\"}", NULL, "missing_required_parameter",
         "body", "g", NULL},
        {"not json", NULL, "invalid_json_line", NULL, NULL, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *cid = NULL;
        const char *url = NULL, *body = NULL;
        size_t blen = 0;
        struct store_line_error e = {0};
        int rc = store_check_line(cases[i].line, strlen(cases[i].line), cases[i].endpoint, &cid, &url, &body, &blen, &e);
        if (cases[i].code) {
            CHECKF(rc == SL_EINVAL && !strcmp(e.code, cases[i].code), "case %zu: rc %d code %s", i, rc,
                   rc ? e.code : "-");
            CHECKF(cases[i].param ? e.param && !strcmp(e.param, cases[i].param) : !e.param, "case %zu: param", i);
            CHECKF(e.message[0] != 0, "case %zu: no message", i);
        } else {
            CHECKF(rc == 0 && url && !strcmp(url, cases[i].url), "case %zu: rc %d", i, rc);
            CHECKF(rc == 0 && blen >= 2 && body[0] == '{' && body[blen - 1] == '}', "case %zu: body", i);
        }
        CHECKF(cases[i].cid ? cid && !strcmp(cid, cases[i].cid) : !cid, "case %zu: custom_id %s", i, cid ? cid : "NULL");
        free(cid);
    }
    struct json_buf b;
    json_buf_init(&b);
    store_result_line(&b, "batch_req_1", "x\"y", 3, 200, "req_2", 5, "{\"k\":1}", 7, NULL, 0);
    json_buf_add(&b, "\n", 1);
    store_result_line(&b, "batch_req_3", NULL, 0, 0, NULL, 0, NULL, 0, "{\"code\":\"c\"}", 12);
    CHECKF(b.p && !strcmp(b.p, "{\"id\":\"batch_req_1\",\"custom_id\":\"x\\\"y\",\"response\":{\"status_code\":200,"
                               "\"request_id\":\"req_2\",\"body\":{\"k\":1}},\"error\":null}\n"
                               "{\"id\":\"batch_req_3\",\"custom_id\":null,\"response\":null,\"error\":{\"code\":\"c\"}}"),
           "%s", b.p ? b.p : "(none)");
    json_buf_free(&b);
}

static void test_lifecycle(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "life");
    store *s = open_dir(dir, NULL);
    store *r = store_open_reader(dir, err, sizeof err);
    char bid[STORE_ID_MAX];
    CHECKF(make_batch(s, 5, bid) == 0, "%s", err);
    struct store_batch_info info;
    CHECK(store_batch_get(r, bid, &info, err, sizeof err) == 0);
    CHECK(info.status == STORE_BATCH_IN_PROGRESS && info.total == 5 && info.completed == 0);

    struct store_row *rows = NULL, *more = NULL;
    int n = store_claim_pending(s, 2, &rows, err, sizeof err);
    CHECK(n == 2 && rows[0].line == 0 && rows[1].line == 1);
    CHECK(n == 2 && strcmp(rows[0].custom_id, "req-0") == 0 && strcmp(rows[0].url, "/v1/chat/completions") == 0);
    CHECK(n == 2 && strcmp(rows[0].batch_id, bid) == 0 && strstr(rows[0].body, "\"messages\"") &&
          rows[0].body[0] == '{' && rows[0].body_len == strlen(rows[0].body));
    int m = store_claim_pending(s, 10, &more, err, sizeof err);
    CHECK(m == 3 && more[0].line == 2 && more[2].line == 4);
    struct store_row *none;
    CHECK(store_claim_pending(s, 10, &none, err, sizeof err) == 0 && !none);
    if (n != 2 || m != 3) goto out;

    /* results arrive out of order, in two transactions; line 3 is an HTTP error */
    char bufs[5][128];
    struct store_result res[5];
    result_for(&res[0], &more[2], bufs[0], sizeof bufs[0]);
    result_for(&res[1], &more[1], bufs[1], sizeof bufs[1]);
    res[1].status_code = 400;
    res[1].body = "{\"error\":{\"message\":\"too long\",\"type\":\"invalid_request_error\"}}";
    result_for(&res[2], &rows[1], bufs[2], sizeof bufs[2]);
    CHECK(store_complete_rows(s, res, 3, err, sizeof err) == 3);
    CHECK(res[0].outcome == STORE_APPLIED && res[1].outcome == STORE_APPLIED);
    CHECK(store_batch_get(r, bid, &info, err, sizeof err) == 0);
    CHECK(info.status == STORE_BATCH_IN_PROGRESS && info.completed == 2 && info.failed == 1);

    /* the same result again: reported, not written */
    CHECK(store_complete_rows(s, res, 1, err, sizeof err) == 0 && res[0].outcome == STORE_DUPLICATE);
    CHECK(store_batch_get(r, bid, &info, err, sizeof err) == 0 && info.completed == 2);

    result_for(&res[0], &rows[0], bufs[0], sizeof bufs[0]);
    result_for(&res[1], &more[0], bufs[1], sizeof bufs[1]);
    res[1].body = "not json"; /* kept as a JSON string so the output stays valid */
    struct store_result bogus = {.row_id = 999999, .status_code = 200};
    res[2] = bogus;
    CHECK(store_complete_rows(s, res, 3, err, sizeof err) == 2 && res[2].outcome == STORE_DROPPED);

    CHECK(store_batch_get(r, bid, &info, err, sizeof err) == 0);
    CHECKF(info.status == STORE_BATCH_COMPLETED, "status %s", store_batch_status_name(info.status));
    CHECK(info.completed == 4 && info.failed == 1 && info.output_file_id[0] && info.error_file_id[0]);
    char *out = content(r, info.output_file_id);
    CHECK(out && count_lines(out) == 4);
    if (out) {
        const char *want[] = {"req-0", "req-1", "req-2", "req-4"};
        char *save, *line = strtok_r(out, "\n", &save);
        for (int k = 0; k < 4 && line; k++, line = strtok_r(NULL, "\n", &save)) {
            json_doc d;
            char e[128];
            CHECKF(json_parse(&d, line, strlen(line), e, sizeof e) == 0, "%s", line);
            CHECK(json_str_eq(&d, json_get(&d, 0, "custom_id"), want[k]));
            int resp = json_get(&d, 0, "response");
            int64_t sc = 0;
            CHECK(json_i64(&d, json_get(&d, resp, "status_code"), &sc) == 0 && sc == 200);
            CHECK(json_str_eq(&d, json_get(&d, resp, "request_id"), "req_x"));
            CHECK(json_is_null(&d, json_get(&d, 0, "error")));
            CHECK(json_str_eq(&d, json_get(&d, 0, "id"), "") == false);
            int body = json_get(&d, resp, "body");
            if (k == 2) CHECK(json_str_eq(&d, body, "not json"));
            else CHECK(json_str_eq(&d, json_get(&d, body, "echo"), want[k]));
            json_free(&d);
        }
    }
    free(out);
    char *bad = content(r, info.error_file_id);
    CHECK(bad && count_lines(bad) == 1 && strstr(bad, "\"custom_id\":\"req-3\"") &&
          strstr(bad, "\"status_code\":400") && strstr(bad, "too long"));
    free(bad);

    struct json_buf j;
    json_buf_init(&j);
    CHECK(store_batch_get_json(r, bid, &j, err, sizeof err) == 0);
    CHECK(strstr(j.p, "\"status\":\"completed\"") && strstr(j.p, "\"request_counts\":{\"total\":5,\"completed\":4,\"failed\":1}"));
    CHECK(!strstr(j.p, "\"in_progress_at\":null") && !strstr(j.p, "\"finalizing_at\":null") &&
          !strstr(j.p, "\"completed_at\":null") && strstr(j.p, "\"cancelled_at\":null"));
    CHECK(strstr(j.p, "\"object\":\"batch\"") && strstr(j.p, "\"errors\":null") && strstr(j.p, "\"metadata\":null"));
    json_buf_free(&j);
    json_buf_init(&j);
    CHECK(store_file_get_json(r, info.output_file_id, &j, err, sizeof err) == 0);
    CHECK(strstr(j.p, "\"purpose\":\"batch_output\""));
    json_buf_free(&j);
    CHECK(store_batch_cancel(s, bid, err, sizeof err) == STORE_ECONFLICT);
out:
    store_rows_free(rows, n);
    store_rows_free(more, m);
    store_close(r);
    store_close(s);
}

static void test_cancel(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "cancel");
    store *s = open_dir(dir, NULL);
    char bid[STORE_ID_MAX];
    CHECKF(make_batch(s, 6, bid) == 0, "%s", err);
    struct store_row *rows;
    int n = store_claim_pending(s, 2, &rows, err, sizeof err);
    CHECK(n == 2);
    CHECK(store_batch_cancel(s, bid, err, sizeof err) == 0);
    struct store_batch_info info;
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0 && info.status == STORE_BATCH_CANCELLING);
    struct store_row *none;
    CHECK(store_claim_pending(s, 10, &none, err, sizeof err) == 0);
    CHECK(store_batch_cancel(s, bid, err, sizeof err) == 0);
    if (n == 2) {
        char b0[128], b1[128];
        struct store_result res[2];
        result_for(&res[0], &rows[0], b0, sizeof b0);
        result_for(&res[1], &rows[1], b1, sizeof b1);
        CHECK(store_complete_rows(s, res, 1, err, sizeof err) == 1);
        CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0 && info.status == STORE_BATCH_CANCELLING);
        CHECK(store_tick(s, err, sizeof err) == 0);
        /* the other running row was stopped by the cancel: it is
         * cancelled, like the rows that never ran */
        res[1].cancelled = true;
        CHECK(store_complete_rows(s, res + 1, 1, err, sizeof err) == 1);
    }
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0);
    CHECKF(info.status == STORE_BATCH_CANCELLED, "status %s", store_batch_status_name(info.status));
    /* each error-file line is a failed request: completed + failed = total */
    CHECK(info.total == 6 && info.completed == 1 && info.failed == 5);
    CHECK(q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'cancelled'") == 5);
    char *out = content(s, info.output_file_id), *bad = content(s, info.error_file_id);
    CHECK(out && count_lines(out) == 1 && strstr(out, "req-0"));
    CHECK(bad && count_lines(bad) == 5 && strstr(bad, "batch_cancelled") && strstr(bad, "req-5") &&
          strstr(bad, "\"custom_id\":\"req-1\",\"response\":null"));
    free(out);
    free(bad);
    struct json_buf j;
    json_buf_init(&j);
    store_batch_get_json(s, bid, &j, err, sizeof err);
    CHECK(j.p && !strstr(j.p, "\"cancelling_at\":null") && !strstr(j.p, "\"cancelled_at\":null"));
    json_buf_free(&j);
    CHECK(store_batch_cancel(s, bid, err, sizeof err) == 0);
    CHECK(store_batch_cancel(s, "batch_nope", err, sizeof err) == STORE_ENOTFOUND);
    store_rows_free(rows, n);

    /* cancel with nothing running finishes at once; a crash while
     * cancelling resumes: the rows it put back to pending are cancelled */
    CHECK(make_batch(s, 3, bid) == 0);
    n = store_claim_pending(s, 1, &rows, err, sizeof err);
    CHECK(store_batch_cancel(s, bid, err, sizeof err) == 0);
    store_rows_free(rows, n);
    store_close(s); /* the claimed row is still running on disk */
    s = open_dir(dir, NULL);
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0 && info.status == STORE_BATCH_CANCELLED);
    CHECK(info.completed == 0 && !info.output_file_id[0] && info.error_file_id[0]);
    store_close(s);
}

static void test_expiry(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "expiry");
    struct store_opts o = {.allow_short_windows = true};
    store *s = open_dir(dir, &o);
    store_set_clock(s, fake_clock, NULL);
    fake_now = 1700000000;
    char fid[STORE_ID_MAX], bid[STORE_ID_MAX];
    char *t = request_lines(5, 0, NULL);
    CHECK(upload(s, "batch", t, fid) == 0);
    free(t);
    CHECKF(store_batch_create(s, fid, "/v1/chat/completions", "2s", NULL, bid, err, sizeof err) == 0, "%s", err);
    struct store_batch_info info;
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0);
    CHECK(info.created_at == 1700000000 && info.expires_at == 1700000002);
    struct store_row *rows;
    int n = store_claim_pending(s, 2, &rows, err, sizeof err);
    CHECK(n == 2);
    char b0[128], b1[128];
    struct store_result res[2];
    if (n == 2) {
        result_for(&res[0], &rows[0], b0, sizeof b0);
        result_for(&res[1], &rows[1], b1, sizeof b1);
        CHECK(store_complete_rows(s, res, 1, err, sizeof err) == 1);
    }
    fake_now += 1;
    CHECK(store_tick(s, err, sizeof err) == 0);
    fake_now += 1;
    CHECK(store_tick(s, err, sizeof err) == 1);
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0);
    CHECKF(info.status == STORE_BATCH_EXPIRED, "status %s", store_batch_status_name(info.status));
    CHECK(info.completed == 1 && info.failed == 4);
    if (n == 2) {
        /* the running row's late result is refused, not written */
        CHECK(store_complete_rows(s, res + 1, 1, err, sizeof err) == 0 && res[1].outcome == STORE_DROPPED);
    }
    char *out = content(s, info.output_file_id), *bad = content(s, info.error_file_id);
    CHECK(out && count_lines(out) == 1 && strstr(out, "req-0"));
    CHECK(bad && count_lines(bad) == 4 && strstr(bad, "\"code\":\"batch_expired\"") && !strstr(bad, "req-0"));
    free(out);
    free(bad);
    struct json_buf j;
    json_buf_init(&j);
    store_batch_get_json(s, bid, &j, err, sizeof err);
    CHECK(j.p && strstr(j.p, "\"expired_at\":1700000002") && strstr(j.p, "\"completion_window\":\"2s\""));
    json_buf_free(&j);
    store_rows_free(rows, n);
    store_close(s);

    /* without the option, short windows are refused */
    s = open_dir(dir, NULL);
    CHECK(store_batch_create(s, fid, "/v1/chat/completions", "2s", NULL, bid, err, sizeof err) == SL_EINVAL);
    store_close(s);
}

static void test_list_pagination(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "list");
    store *s = open_dir(dir, NULL);
    char ids[5][STORE_ID_MAX];
    for (int k = 0; k < 5; k++) CHECK(make_batch(s, 1, ids[k]) == 0);
    store *r = store_open_reader(dir, err, sizeof err);
    const char *after = NULL;
    char last[STORE_ID_MAX] = "";
    int seen = 0;
    for (int page = 0; page < 3; page++) {
        struct json_buf j;
        json_buf_init(&j);
        CHECK(store_batch_list_json(r, after, 2, &j, err, sizeof err) == 0);
        json_doc d;
        char e[128];
        if (json_parse(&d, j.p, j.len, e, sizeof e)) {
            CHECKF(0, "%s", e);
            json_buf_free(&j);
            break;
        }
        int data = json_get(&d, 0, "data");
        int want = page < 2 ? 2 : 1;
        CHECK(json_size(&d, data) == want);
        for (int k = 0; k < json_size(&d, data); k++)
            CHECK(json_str_eq(&d, json_get(&d, json_at(&d, data, k), "id"), ids[4 - seen++]));
        bool more;
        CHECK(json_bool(&d, json_get(&d, 0, "has_more"), &more) == 0 && more == (page < 2));
        CHECK(json_str_eq(&d, json_get(&d, 0, "first_id"), ids[4 - 2 * page]));
        json_str(&d, json_get(&d, 0, "last_id"), last, sizeof last);
        after = last;
        json_free(&d);
        json_buf_free(&j);
    }
    CHECK(seen == 5);
    struct json_buf j;
    json_buf_init(&j);
    CHECK(store_batch_list_json(r, ids[0], 2, &j, err, sizeof err) == 0);
    CHECK(strstr(j.p, "\"data\":[]") && strstr(j.p, "\"first_id\":null") && strstr(j.p, "\"has_more\":false"));
    json_buf_free(&j);
    json_buf_init(&j);
    CHECK(store_batch_list_json(r, "batch_nope", 2, &j, err, sizeof err) == STORE_ENOTFOUND);
    json_buf_free(&j);
    store_close(r);
    store_close(s);
}

/* The child of the crash test: claims and completes rows in batched
 * transactions until killed (or it decides to _exit on its own). */
static void crash_child(const char *dir, unsigned seed)
{
    srand(seed);
    store *s = store_open(dir, NULL, err, sizeof err);
    if (!s) _exit(3);
    for (;;) {
        struct store_row *rows;
        int n = store_claim_pending(s, 1 + rand() % 24, &rows, err, sizeof err);
        if (n < 0) _exit(4);
        if (n == 0) _exit(0);
        struct store_result *res = calloc((size_t)n, sizeof *res);
        char(*bufs)[128] = calloc((size_t)n, 128);
        for (int i = 0; i < n; i++) result_for(&res[i], &rows[i], bufs[i], 128);
        /* complete in a few transactions, in shuffled order */
        for (int i = n - 1; i > 0; i--) {
            int k = rand() % (i + 1);
            struct store_result t = res[i];
            res[i] = res[k];
            res[k] = t;
        }
        for (int done = 0; done < n;) {
            int k = 1 + rand() % (n - done);
            if (store_complete_rows(s, res + done, k, err, sizeof err) < 0) _exit(5);
            for (int i = done; i < done + k; i++)
                if (res[i].outcome != STORE_APPLIED) _exit(6);
            if (rand() % 4 == 0) { /* the feeder sending the same results again */
                if (store_complete_rows(s, res + done, k, err, sizeof err) != 0) _exit(7);
                for (int i = done; i < done + k; i++)
                    if (res[i].outcome != STORE_DUPLICATE) _exit(8);
            }
            done += k;
            if (rand() % 50 == 0) _exit(0); /* rows still running: left for recovery */
        }
        free(res);
        free(bufs);
        store_rows_free(rows, n);
    }
}

/* After a crash: every row is pending (nothing running survives a reopen) or
 * finished exactly once with its own result; the counts agree with the rows. */
static void check_consistent(const char *dir, const char *bid, int total)
{
    CHECK(q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'running'") == 0);
    int64_t done = q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'done'");
    int64_t pend = q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'pending'");
    CHECKF(done + pend == total, "done %lld pending %lld", (long long)done, (long long)pend);
    CHECK(q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'done' AND"
                  " result <> '{\"object\":\"chat.completion\",\"echo\":\"' || custom_id || '\"}'") == 0);
    CHECK(q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'pending' AND result IS NOT NULL") == 0);
    char sql[256];
    snprintf(sql, sizeof sql, "SELECT n_completed FROM batches WHERE id = '%s'", bid);
    CHECKF(q1(dir, sql) == done, "n_completed %lld, done rows %lld", (long long)q1(dir, sql), (long long)done);
}

static void test_crash_recovery(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "crash");
    const int total = 2000;
    store *s = open_dir(dir, NULL);
    char bid[STORE_ID_MAX];
    CHECKF(make_batch(s, total, bid) == 0, "%s", err);
    store_close(s);
    unsigned seed = (unsigned)time(NULL);
    printf("  crash test seed %u\n", seed);
    srand(seed);
    int kills = 0, rounds = 0;
    struct store_batch_info info = {0};
    for (; rounds < CRASH_ROUNDS; rounds++) {
        pid_t pid = fork();
        if (pid == 0) crash_child(dir, seed + (unsigned)rounds);
        CHECK(pid > 0);
        struct timespec ts = {0, (long)(rand() % 20) * 1000000L + 500000L};
        nanosleep(&ts, NULL);
        if (kill(pid, SIGKILL) == 0) kills++;
        int st = 0;
        waitpid(pid, &st, 0);
        CHECKF(!WIFEXITED(st) || WEXITSTATUS(st) == 0, "child exit %d", WEXITSTATUS(st));
        /* reopen = recovery */
        s = open_dir(dir, NULL);
        if (!s) break;
        store_batch_get(s, bid, &info, err, sizeof err);
        store_close(s);
        if (info.status == STORE_BATCH_COMPLETED) break;
        check_consistent(dir, bid, total);
    }
    printf("  %d rounds, %d kills\n", rounds + 1, kills);
    /* finish whatever is left in-process */
    s = open_dir(dir, NULL);
    for (;;) {
        struct store_row *rows;
        int n = store_claim_pending(s, 50, &rows, err, sizeof err);
        if (n <= 0) break;
        struct store_result res[50];
        char bufs[50][128];
        for (int i = 0; i < n; i++) result_for(&res[i], &rows[i], bufs[i], 128);
        CHECK(store_complete_rows(s, res, n, err, sizeof err) == n);
        store_rows_free(rows, n);
    }
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0);
    CHECKF(info.status == STORE_BATCH_COMPLETED, "status %s", store_batch_status_name(info.status));
    CHECK(info.completed == total && info.failed == 0);
    char *out = content(s, info.output_file_id);
    CHECK(out && count_lines(out) == total);
    if (out) {
        char *save, *line = strtok_r(out, "\n", &save);
        for (int k = 0; k < total && line; k++, line = strtok_r(NULL, "\n", &save)) {
            char want[64], cid[64];
            snprintf(want, sizeof want, "req-%d", k);
            CHECKF(jstr(line, "custom_id", cid, sizeof cid) && strcmp(cid, want) == 0, "line %d: %s", k, line);
            snprintf(want, sizeof want, "\"echo\":\"req-%d\"}", k);
            CHECK(strstr(line, want));
        }
    }
    free(out);
    /* exactly one output file for the batch, whatever the crashes did */
    CHECK(q1(dir, "SELECT count(*) FROM files WHERE purpose = 'batch_output'") == 1);
    store_close(s);
    char fdir[600];
    snprintf(fdir, sizeof fdir, "%s/files", dir);
    int nfiles = 0;
    DIR *d = opendir(fdir);
    for (struct dirent *e; d && (e = readdir(d));) nfiles += e->d_name[0] != '.';
    if (d) closedir(d);
    CHECKF(nfiles == 2, "%d content files (input + output expected)", nfiles);
}

/* Status polling from another thread on a reader handle while the writer
 * claims and completes: every poll succeeds (WAL: readers never wait) and
 * the counts it sees never go backwards. */
struct poller {
    const char *dir, *bid;
    volatile int stop;
    int polls, errors, regressions;
};

static void *poll_thread(void *arg)
{
    struct poller *p = arg;
    char e[256];
    store *r = store_open_reader(p->dir, e, sizeof e);
    if (!r) {
        p->errors++;
        return NULL;
    }
    int64_t last = 0;
    while (!p->stop) {
        struct json_buf j;
        json_buf_init(&j);
        struct store_batch_info info;
        if (store_batch_get_json(r, p->bid, &j, e, sizeof e) || store_batch_get(r, p->bid, &info, e, sizeof e))
            p->errors++;
        else if (info.completed < last)
            p->regressions++;
        else
            last = info.completed;
        json_buf_free(&j);
        p->polls++;
    }
    store_close(r);
    return NULL;
}

static void test_concurrent_readers(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "readers");
    store *s = open_dir(dir, NULL);
    char bid[STORE_ID_MAX];
    CHECK(make_batch(s, 2000, bid) == 0);
    struct poller p = {.dir = dir, .bid = bid};
    pthread_t th[2];
    for (int k = 0; k < 2; k++) pthread_create(&th[k], NULL, poll_thread, &p);
    for (;;) {
        struct store_row *rows;
        int n = store_claim_pending(s, 20, &rows, err, sizeof err);
        if (n <= 0) {
            CHECKF(n == 0, "%s", err);
            break;
        }
        struct store_result res[20];
        char bufs[20][128];
        for (int i = 0; i < n; i++) result_for(&res[i], &rows[i], bufs[i], 128);
        CHECKF(store_complete_rows(s, res, n, err, sizeof err) == n, "%s", err);
        store_rows_free(rows, n);
    }
    p.stop = 1;
    for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
    printf("  %d polls during the run\n", p.polls);
    CHECK(p.polls > 0 && p.errors == 0 && p.regressions == 0);
    struct store_batch_info info;
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0 && info.status == STORE_BATCH_COMPLETED);
    store_close(s);
}

static long maxrss_kb(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

static void test_large_file(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "large");
    store *s = open_dir(dir, NULL);
    const int total = LARGE_LINES;
    char pad[513];
    memset(pad, 'x', 512);
    pad[512] = '\0';
    char path[600];
    snprintf(path, sizeof path, "%s/big.jsonl", root);
    FILE *f = fopen(path, "w");
    for (int i = 0; i < total; i++)
        fprintf(f,
                "{\"custom_id\":\"req-%d\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\","
                "\"body\":{\"messages\":[{\"role\":\"user\",\"content\":\"%d %s\"}]}}\n",
                i, i, pad);
    fclose(f);
    long rss0 = maxrss_kb();
    char fid[STORE_ID_MAX], bid[STORE_ID_MAX];
    CHECKF(store_file_create(s, path, "batch", "big.jsonl", fid, err, sizeof err) == 0, "%s", err);
    CHECKF(store_batch_create(s, fid, "/v1/chat/completions", "24h", NULL, bid, err, sizeof err) == 0, "%s", err);
    struct store_batch_info info;
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0 && info.status == STORE_BATCH_IN_PROGRESS &&
          info.total == total);
    int64_t next = 0;
    bool order = true;
    for (;;) {
        struct store_row *rows;
        int n = store_claim_pending(s, 256, &rows, err, sizeof err);
        if (n <= 0) break;
        struct store_result res[256];
        char bufs[256][128];
        for (int i = 0; i < n; i++) {
            order &= rows[i].line == next++;
            result_for(&res[i], &rows[i], bufs[i], 128);
        }
        CHECK(store_complete_rows(s, res, n, err, sizeof err) == n);
        store_rows_free(rows, n);
    }
    CHECK(order && next == total);
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0 && info.status == STORE_BATCH_COMPLETED &&
          info.completed == total);
    long grown = maxrss_kb() - rss0;
    printf("  %d lines (%.0f MB): peak RSS grew by %ld KB\n", total, total * 600.0 / 1e6, grown);
#ifndef __SANITIZE_ADDRESS__
    CHECKF(grown < 24 * 1024, "peak RSS grew by %ld KB", grown); /* the file is ~30 MB */
#endif
    int fd;
    int64_t size = 0;
    CHECK(store_file_open_content(s, info.output_file_id, &fd, &size, err, sizeof err) == 0);
    CHECK(size > 0 && q1(dir, "SELECT lines FROM files WHERE purpose = 'batch_output'") == total);
    close(fd);
    store_close(s);
}

static void test_limits(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "limits");
    struct store_opts o = {.max_file_lines = 10, .max_file_bytes = 4000};
    store *s = open_dir(dir, &o);
    char fid[STORE_ID_MAX], bid[STORE_ID_MAX];
    char *t = request_lines(11, 0, NULL);
    char path[600];
    CHECK(upload(s, "batch", t, fid) == STORE_ELIMIT);
    CHECKF(strstr(err, "11 requests") && strstr(err, "at most 10"), "%s", err);
    free(t);
    t = request_lines(10, 0, "yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"
                                "yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"
                                "yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy");
    CHECK(upload(s, "batch", t, fid) == STORE_ELIMIT);
    CHECKF(strstr(err, "bytes") && strstr(err, "at most 4000"), "%s", err);
    free(t);
    CHECK(q1(dir, "SELECT count(*) FROM files") == 0);
    /* nothing of the refused uploads stays in the store */
    CHECK(count_dir(dir, "files") == 0 && q1(dir, "SELECT count(*) FROM owned_names") == 0);
    /* other purposes have no batch limits */
    t = request_lines(11, 0, NULL);
    CHECK(upload(s, "fine-tune", t, fid) == 0);
    store_close(s);

    /* a file within the limits at upload, past them at batch time (the
     * limit was lowered): the batch fails with a clear per-file error */
    struct store_opts big = {0};
    s = open_dir(dir, &big);
    CHECK(upload(s, "batch", t, fid) == 0);
    store_close(s);
    free(t);
    s = open_dir(dir, &o);
    CHECK(store_batch_create(s, fid, "/v1/chat/completions", "24h", NULL, bid, err, sizeof err) == 0);
    struct json_buf j;
    json_buf_init(&j);
    store_batch_get_json(s, bid, &j, err, sizeof err);
    CHECK(j.p && strstr(j.p, "\"status\":\"failed\"") && strstr(j.p, "too_many_requests_in_file") &&
          strstr(j.p, "\"line\":11"));
    json_buf_free(&j);
    CHECK(q1(dir, "SELECT count(*) FROM batch_requests") == 0);
    (void)path;
    store_close(s);
}

static void test_recovery_of_validating(void)
{
    /* a crash while validating leaves a `validating` batch; reopening
     * validates it again and the batch runs */
    char dir[512];
    new_dir(dir, sizeof dir, "revalid");
    store *s = open_dir(dir, NULL);
    char bid[STORE_ID_MAX];
    CHECK(make_batch(s, 4, bid) == 0);
    store_close(s);
    char path[600];
    snprintf(path, sizeof path, "%s/sluice.db", dir);
    sqlite3 *db;
    sqlite3_open(path, &db);
    sqlite3_exec(db, "UPDATE batches SET status = 'validating'; DELETE FROM batch_requests WHERE line > 1", NULL,
                 NULL, NULL);
    sqlite3_close(db);
    s = open_dir(dir, NULL);
    struct store_batch_info info;
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0);
    CHECK(info.status == STORE_BATCH_IN_PROGRESS && info.total == 4);
    CHECK(q1(dir, "SELECT count(*) FROM batch_requests") == 4);
    store_close(s);

    /* all rows finished but the crash came before finalizing: reopen finalizes */
    sqlite3_open(path, &db);
    sqlite3_exec(db,
                 "UPDATE batch_requests SET state = 'done', status_code = 200, result = '{}';"
                 "UPDATE batches SET n_completed = 4",
                 NULL, NULL, NULL);
    sqlite3_close(db);
    s = open_dir(dir, NULL);
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0 && info.status == STORE_BATCH_COMPLETED);
    store_close(s);
}

/* The child of the file crash test: uploads, deletes and finishes small
 * batches (output files) until killed. */
static void crash_files_child(const char *dir, unsigned seed)
{
    srand(seed);
    store *s = store_open(dir, NULL, err, sizeof err);
    if (!s) _exit(3);
    char ids[64][STORE_ID_MAX];
    int n = 0;
    for (;;) {
        char bid[STORE_ID_MAX];
        int r = rand() % 3;
        if (r == 0 && n < 64) {
            if (upload(s, "fine-tune", "{\"x\":1}\n", ids[n]) == 0) n++;
        } else if (r == 1 && n > 0) {
            int k = rand() % n;
            store_file_delete(s, ids[k], NULL, err, sizeof err);
            memcpy(ids[k], ids[--n], STORE_ID_MAX);
        } else if (make_batch(s, 3, bid) == 0) {
            struct store_row *rows;
            int m = store_claim_pending(s, 3, &rows, err, sizeof err);
            struct store_result res[3];
            char bufs[3][128];
            for (int i = 0; i < m; i++) result_for(&res[i], &rows[i], bufs[i], 128);
            if (m > 0) store_complete_rows(s, res, m, err, sizeof err);
            store_rows_free(rows, m);
        }
    }
}

/* kill -9 while files are created, deleted and batches finished: at the
 * next open every file row has its content, no file the store made is left
 * without a row (the open would refuse), and no name stays recorded. */
static void test_crash_files(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "crashfiles");
    store *s = open_dir(dir, NULL);
    store_close(s);
    unsigned seed = (unsigned)time(NULL);
    printf("  file crash test seed %u\n", seed);
    srand(seed);
    for (int round = 0; round < CRASH_ROUNDS / 4; round++) {
        pid_t pid = fork();
        if (pid == 0) crash_files_child(dir, seed + (unsigned)round);
        struct timespec ts = {0, (long)(rand() % 15) * 1000000L + 1000000L};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        s = open_dir(dir, NULL);
        CHECK(s);
        if (!s) break;
        store_close(s);
        CHECK(q1(dir, "SELECT count(*) FROM owned_names") == 0);
        CHECKF(q1(dir, "SELECT count(*) FROM files") == count_dir(dir, "files"), "round %d: %lld rows, %d files",
               round, (long long)q1(dir, "SELECT count(*) FROM files"), count_dir(dir, "files"));
    }
    printf("  %lld files, %lld batches after the kills\n", (long long)q1(dir, "SELECT count(*) FROM files"),
           (long long)q1(dir, "SELECT count(*) FROM batches"));
}

/* ---- fault injection: SQLite's own VFS layer, wrapped --------------------------- */

/* A VFS registered as the default that passes everything to the real one,
 * except that while fault_armed every write (database, WAL, journal) from
 * the fault_after-th on fails with SQLITE_FULL, as on a full disk. The
 * store opens its database with the default VFS, so it runs unchanged. */
static sqlite3_vfs fault_vfs, *real_vfs;
static bool fault_armed;
static int fault_after, fault_writes, fault_hits;

struct ffile {
    sqlite3_file base;
    sqlite3_file *real; /* follows this struct in the same allocation */
};

#define REAL(f) (((struct ffile *)(f))->real)
static int f_close(sqlite3_file *f) { return REAL(f)->pMethods->xClose(REAL(f)); }
static int f_read(sqlite3_file *f, void *b, int n, sqlite3_int64 o) { return REAL(f)->pMethods->xRead(REAL(f), b, n, o); }
static int f_write(sqlite3_file *f, const void *b, int n, sqlite3_int64 o)
{
    if (fault_armed && ++fault_writes >= fault_after) {
        fault_hits++;
        return SQLITE_FULL;
    }
    return REAL(f)->pMethods->xWrite(REAL(f), b, n, o);
}
static int f_truncate(sqlite3_file *f, sqlite3_int64 n) { return REAL(f)->pMethods->xTruncate(REAL(f), n); }
static int f_sync(sqlite3_file *f, int fl) { return REAL(f)->pMethods->xSync(REAL(f), fl); }
static int f_size(sqlite3_file *f, sqlite3_int64 *n) { return REAL(f)->pMethods->xFileSize(REAL(f), n); }
static int f_lock(sqlite3_file *f, int l) { return REAL(f)->pMethods->xLock(REAL(f), l); }
static int f_unlock(sqlite3_file *f, int l) { return REAL(f)->pMethods->xUnlock(REAL(f), l); }
static int f_reserved(sqlite3_file *f, int *r) { return REAL(f)->pMethods->xCheckReservedLock(REAL(f), r); }
static int f_fcntl(sqlite3_file *f, int op, void *a) { return REAL(f)->pMethods->xFileControl(REAL(f), op, a); }
static int f_sector(sqlite3_file *f) { return REAL(f)->pMethods->xSectorSize(REAL(f)); }
static int f_devchar(sqlite3_file *f) { return REAL(f)->pMethods->xDeviceCharacteristics(REAL(f)); }
static int f_shmmap(sqlite3_file *f, int i, int sz, int ext, void volatile **pp)
{
    return REAL(f)->pMethods->xShmMap(REAL(f), i, sz, ext, pp);
}
static int f_shmlock(sqlite3_file *f, int off, int n, int fl) { return REAL(f)->pMethods->xShmLock(REAL(f), off, n, fl); }
static void f_shmbarrier(sqlite3_file *f) { REAL(f)->pMethods->xShmBarrier(REAL(f)); }
static int f_shmunmap(sqlite3_file *f, int del) { return REAL(f)->pMethods->xShmUnmap(REAL(f), del); }
static int f_fetch(sqlite3_file *f, sqlite3_int64 o, int n, void **pp) { return REAL(f)->pMethods->xFetch(REAL(f), o, n, pp); }
static int f_unfetch(sqlite3_file *f, sqlite3_int64 o, void *p) { return REAL(f)->pMethods->xUnfetch(REAL(f), o, p); }

static const sqlite3_io_methods fault_io = {
    3, f_close, f_read, f_write, f_truncate, f_sync, f_size, f_lock, f_unlock, f_reserved, f_fcntl, f_sector,
    f_devchar, f_shmmap, f_shmlock, f_shmbarrier, f_shmunmap, f_fetch, f_unfetch,
};

static int f_open(sqlite3_vfs *v, const char *name, sqlite3_file *f, int flags, int *out)
{
    (void)v;
    struct ffile *ff = (struct ffile *)f;
    ff->real = (sqlite3_file *)(ff + 1);
    int rc = real_vfs->xOpen(real_vfs, name, ff->real, flags, out);
    /* no methods: the open failed and xClose must not be called */
    ff->base.pMethods = rc == SQLITE_OK && ff->real->pMethods ? &fault_io : NULL;
    return rc;
}

static void fault_vfs_install(void)
{
    real_vfs = sqlite3_vfs_find(NULL);
    fault_vfs = *real_vfs;
    fault_vfs.zName = "sluice-test-fault";
    fault_vfs.szOsFile = (int)sizeof(struct ffile) + real_vfs->szOsFile;
    fault_vfs.xOpen = f_open;
    fault_vfs.pNext = NULL;
    sqlite3_vfs_register(&fault_vfs, 1);
}

static void fault_arm(int after)
{
    fault_armed = true;
    fault_after = after;
    fault_writes = 0;
}

/* Store writes failing mid-batch (SQLITE_FULL at a random write of a
 * transaction, its commit included): a failed call writes nothing and says
 * so, the same results given again once writes work are written, and in the
 * end every row has exactly one result; names recorded by a failed
 * finalization are cleaned up at the next open. */
static void test_write_faults(void)
{
    char dir[512];
    new_dir(dir, sizeof dir, "faults");
    store *s = open_dir(dir, NULL);
    const int total = 300;
    char bid[STORE_ID_MAX];
    CHECKF(make_batch(s, total, bid) == 0, "%s", err);
    srand(46);
    int failed_calls = 0, rounds = 0;
    struct store_result res[40];
    char bufs[40][128];
    for (; rounds < 200; rounds++) {
        /* a claim that fails claims nothing */
        fault_arm(1 + rand() % 3);
        struct store_row *rows;
        int64_t running = q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'running'");
        int n = store_claim_pending(s, 40, &rows, err, sizeof err);
        fault_armed = false;
        if (n < 0) {
            CHECKF(strstr(err, "full"), "%s", err);
            CHECK(q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'running'") == running);
            failed_calls++;
            n = store_claim_pending(s, 40, &rows, err, sizeof err);
        }
        if (n <= 0) break;
        for (int i = 0; i < n; i++) result_for(&res[i], &rows[i], bufs[i], 128);
        /* results written while the disk is "full": refused whole, then retried */
        for (int tries = 0;; tries++) {
            int64_t done0 = q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'done'");
            if (tries < 3) fault_arm(1 + rand() % 8);
            int rc = store_complete_rows(s, res, n, err, sizeof err);
            fault_armed = false;
            if (rc >= 0) {
                CHECKF(rc == n, "applied %d of %d", rc, n);
                break;
            }
            failed_calls++;
            CHECK(q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'done'") == done0);
        }
        /* the feeder giving the same results again: nothing twice */
        CHECK(store_complete_rows(s, res, n, err, sizeof err) == 0 && res[0].outcome == STORE_DUPLICATE);
        store_rows_free(rows, n);
    }
    printf("  %d store calls failed on injected SQLITE_FULL (%d writes refused)\n", failed_calls, fault_hits);
    CHECK(failed_calls > 20);
    /* the finalization itself may have failed: a tick (or the next open) finishes it */
    struct store_batch_info info;
    for (int k = 0; k < 3; k++) {
        CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0);
        if (info.status == STORE_BATCH_COMPLETED) break;
        store_tick(s, err, sizeof err);
    }
    store_close(s);
    s = open_dir(dir, NULL);
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0);
    CHECKF(info.status == STORE_BATCH_COMPLETED, "status %s", store_batch_status_name(info.status));
    CHECK(info.completed == total && info.failed == 0);
    CHECK(q1(dir, "SELECT count(*) FROM batch_requests WHERE state = 'done'") == total);
    char *out = content(s, info.output_file_id);
    CHECK(out && count_lines(out) == total);
    for (int k = 0; out && k < total; k++) {
        char want[64];
        snprintf(want, sizeof want, "\"custom_id\":\"req-%d\"", k);
        char *at = strstr(out, want);
        CHECKF(at && !strstr(at + 1, want), "req-%d not exactly once", k);
    }
    free(out);

    /* a finalization that fails after writing its files leaves none behind */
    CHECK(make_batch(s, 3, bid) == 0);
    struct store_row *rows;
    int n = store_claim_pending(s, 3, &rows, err, sizeof err);
    CHECK(n == 3);
    for (int i = 0; i < n; i++) result_for(&res[i], &rows[i], bufs[i], 128);
    int files0 = count_dir(dir, "files");
    for (int after = 1; after < 40; after++) {
        /* the results commit; finalizing then fails at some later write */
        fault_arm(after);
        int rc = store_complete_rows(s, res, n, err, sizeof err);
        fault_armed = false;
        if (rc == n) break;
    }
    store_rows_free(rows, n);
    store_close(s);
    s = open_dir(dir, NULL); /* recovery: the batch is finished, stray files gone */
    CHECK(store_batch_get(s, bid, &info, err, sizeof err) == 0 && info.status == STORE_BATCH_COMPLETED);
    CHECK(count_dir(dir, "files") == files0 + 1 && q1(dir, "SELECT count(*) FROM owned_names") == 0);
    CHECK(q1(dir, "SELECT count(*) FROM files") == count_dir(dir, "files"));
    store_close(s);
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

int main(void)
{
    snprintf(root, sizeof root, "/tmp/sluice-test-store-XXXXXX");
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(test_schema_and_reopen);
    RUN(test_window_parse);
    RUN(test_files);
    RUN(test_foreign_files);
    RUN(test_recorded_names);
    RUN(test_validation);
    RUN(test_line_rules);
    RUN(test_lifecycle);
    RUN(test_cancel);
    RUN(test_expiry);
    RUN(test_list_pagination);
    RUN(test_recovery_of_validating);
    RUN(test_limits);
    RUN(test_crash_recovery);
    RUN(test_crash_files);
    fault_vfs_install(); /* after the fork()ing test: every later open goes through it */
    RUN(test_write_faults);
    RUN(test_concurrent_readers);
    RUN(test_large_file);
    if (!getenv("KEEP")) nftw(root, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
