/* store_file.c - the store's files (store.h): uploads adopted or copied into
 * the data directory and checked, file objects, listings (shared with
 * batches), deletion and content.
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

/* ---- files ------------------------------------------------------------------------ */

/* Reads fd to its end in STORE_CHUNK pieces, handing each to cb, which
 * stops the reading by returning non-zero (that status is returned). A read
 * error is SL_EIO, "reading WHAT: why". fd stays open. */
static int read_chunks(int fd, const char *what, int (*cb)(void *ctx, const char *p, size_t n), void *ctx, char *err,
                       size_t errlen)
{
    char *buf = malloc(STORE_CHUNK);
    if (!buf) {
        sl_seterr(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    int rc = 0;
    for (;;) {
        ssize_t k = read(fd, buf, STORE_CHUNK);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            sl_seterr(err, errlen, "reading %s: %s", what, strerror(errno));
            rc = SL_EIO;
            break;
        }
        if (k == 0) break;
        if ((rc = cb(ctx, buf, (size_t)k))) break;
    }
    free(buf);
    return rc;
}

struct line_count {
    int64_t n;
    bool content; /* the current line has had something but blanks */
};

static int count_chunk(void *ctx, const char *p, size_t n)
{
    struct line_count *lc = ctx;
    for (size_t i = 0; i < n; i++) {
        char c = p[i];
        if (c == '\n') {
            if (lc->content) lc->n++;
            lc->content = false;
        } else if (c != ' ' && c != '\t' && c != '\r') {
            lc->content = true;
        }
    }
    return 0;
}

/* Counts lines holding anything but blanks (the requests of a JSONL file),
 * reading in chunks. Returns the count or a negative status. */
static int64_t count_requests(const char *path, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        sl_seterr(err, errlen, "cannot read %s: %s", path, strerror(errno));
        return SL_EIO;
    }
    struct line_count lc = {0, false};
    int rc = read_chunks(fd, path, count_chunk, &lc, err, errlen);
    close(fd);
    if (rc) return rc;
    return lc.n + (lc.content ? 1 : 0); /* a last line without its newline */
}

struct copy_to {
    int fd;
    int errnum; /* write's errno when it failed */
};

static int write_chunk(void *ctx, const char *p, size_t n)
{
    struct copy_to *c = ctx;
    for (size_t off = 0; off < n;) {
        ssize_t w = write(c->fd, p + off, n - off);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) {
            c->errnum = errno;
            return SL_EIO;
        }
        off += (size_t)w;
    }
    return 0;
}

static int copy_file(const char *src, const char *dst, char *err, size_t errlen)
{
    int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0) {
        sl_seterr(err, errlen, "cannot read %s: %s", src, strerror(errno));
        return SL_EIO;
    }
    int out = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (out < 0) {
        sl_seterr(err, errlen, "cannot create %s: %s", dst, strerror(errno));
        close(in);
        return SL_EIO;
    }
    struct copy_to c = {out, 0};
    int rc = read_chunks(in, src, write_chunk, &c, err, errlen);
    if (rc && c.errnum) sl_seterr(err, errlen, "copying %s to %s: %s", src, dst, strerror(c.errnum));
    if (!rc && fsync(out) != 0) {
        sl_seterr(err, errlen, "fsync %s: %s", dst, strerror(errno));
        rc = SL_EIO;
    }
    close(out);
    close(in);
    if (rc) unlink(dst);
    return rc;
}

int store__insert_file_row(store *s, const char *id, const char *purpose, const char *filename, int64_t bytes,
                           int64_t lines, const char *rel, char *err, size_t errlen)
{
    sqlite3_stmt *st = db_prep(s,
                               "INSERT INTO files (id, purpose, filename, bytes, lines, created_at, path)"
                               " VALUES (?, ?, ?, ?, ?, ?, ?)",
                               err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, purpose, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, filename, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 4, bytes);
    sqlite3_bind_int64(st, 5, lines);
    sqlite3_bind_int64(st, 6, store__now(s));
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
    int rc = db_begin(s, err, errlen);
    if (rc) return rc;
    if (!(rc = store__insert_file_row(s, id, purpose, filename, bytes, lines, rel, err, errlen)) &&
        !(rc = store__forget_names(s, &rel, 1, err, errlen)))
        rc = db_commit(s, err, errlen);
    if (rc) db_rollback(s);
    return rc;
}

/* The checks of store_file_create() on a complete content file: its size
 * and request count (for purpose "batch", against the limits). */
static int check_content(store *s, const char *path, bool batch, int64_t *bytes, int64_t *lines, char *err,
                         size_t errlen)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        sl_seterr(err, errlen, "cannot read %s: %s", path, strerror(errno));
        return SL_EIO;
    }
    *bytes = (int64_t)sb.st_size;
    if (batch && *bytes > s->opts.max_file_bytes) {
        sl_seterr(err, errlen, "file is %lld bytes; a batch input file may be at most %lld bytes", (long long)*bytes,
                  (long long)s->opts.max_file_bytes);
        return STORE_ELIMIT;
    }
    *lines = count_requests(path, err, errlen);
    if (*lines < 0) return (int)*lines;
    if (batch && *lines > s->opts.max_file_lines) {
        sl_seterr(err, errlen, "file has %lld requests; a batch input file may have at most %lld",
                  (long long)*lines, (long long)s->opts.max_file_lines);
        return STORE_ELIMIT;
    }
    return 0;
}

/* Both ways in: src_path moved in, or cb writing the content. */
static int file_create(store *s, const char *src_path, store_write_fn cb, void *ctx, const char *purpose,
                       const char *filename, char *id_out, char *err, size_t errlen)
{
    int rc = store__need_writer(s, err, errlen);
    if (rc) return rc;
    if ((!src_path && !cb) || !purpose || !*purpose || !id_out) {
        sl_seterr(err, errlen, "file, purpose and id buffer are required");
        return SL_EINVAL;
    }
    if (!filename || !*filename) {
        const char *slash = src_path ? strrchr(src_path, '/') : NULL;
        filename = slash ? slash + 1 : src_path ? src_path : "upload";
    }
    struct stat sb;
    errno = 0;
    if (src_path && (stat(src_path, &sb) != 0 || !S_ISREG(sb.st_mode))) {
        sl_seterr(err, errlen, "cannot read uploaded file %s: %s", src_path,
                  errno ? strerror(errno) : "not a regular file");
        return SL_EIO;
    }
    char id[STORE_ID_MAX], rel[STORE_ID_MAX + 16];
    if ((rc = store__new_id("file-", id, err, errlen))) return rc;
    store__content_name(id, rel, sizeof rel);
    char *dst = store__path_join(s->dir, rel);
    if (!dst) {
        sl_seterr(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    const char *relp = rel;
    if ((rc = store__claim_names(s, &relp, 1, err, errlen))) { /* nothing created yet */
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
            sl_seterr(err, errlen, "cannot move %s into %s: %s", src_path, dst, strerror(errno));
            rc = SL_EIO;
        }
    } else {
        int fd = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0) {
            sl_seterr(err, errlen, "cannot create %s: %s", dst, strerror(errno));
            rc = SL_EIO;
        } else {
            rc = cb(ctx, fd, err, errlen);
            if (!rc && fsync(fd) != 0) {
                sl_seterr(err, errlen, "writing %s: %s", dst, strerror(errno));
                rc = SL_EIO;
            }
            if (close(fd) != 0 && !rc) {
                sl_seterr(err, errlen, "writing %s: %s", dst, strerror(errno));
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
        if (!moved) store__remove_owned(s, rel);
        store__forget_names(s, &relp, 1, NULL, 0);
        free(dst);
        return rc;
    }
    if (copied) unlink(src_path); /* the store has its copy: the caller handed this over */
    free(dst);
    store__copy_id(id_out, id);
    return 0;
}

int store_file_create(store *s, const char *src_path, const char *purpose, const char *filename, char *id_out,
                      char *err, size_t errlen)
{
    if (!src_path) {
        sl_seterr(err, errlen, "file, purpose and id buffer are required");
        return SL_EINVAL;
    }
    return file_create(s, src_path, NULL, NULL, purpose, filename, id_out, err, errlen);
}

int store_file_write(store *s, store_write_fn cb, void *ctx, const char *purpose, const char *filename,
                     char *id_out, char *err, size_t errlen)
{
    if (!cb) {
        sl_seterr(err, errlen, "no writer given");
        return SL_EINVAL;
    }
    return file_create(s, NULL, cb, ctx, purpose, filename, id_out, err, errlen);
}

static void file_json(sqlite3_stmt *st, struct json_buf *out)
{
    /* columns: id, bytes, created_at, filename, purpose, status */
    json_buf_add(out, "{\"id\":", 6);
    json_buf_add_str(out, db_text(st, 0), (size_t)sqlite3_column_bytes(st, 0));
    json_buf_addf(out, ",\"object\":\"file\",\"bytes\":%lld,\"created_at\":%lld,\"filename\":",
                  (long long)sqlite3_column_int64(st, 1), (long long)sqlite3_column_int64(st, 2));
    json_buf_add_str(out, db_text(st, 3), (size_t)sqlite3_column_bytes(st, 3));
    json_buf_add(out, ",\"purpose\":", 11);
    json_buf_add_str(out, db_text(st, 4), (size_t)sqlite3_column_bytes(st, 4));
    json_buf_add(out, ",\"status\":", 10);
    json_buf_add_str(out, db_text(st, 5), (size_t)sqlite3_column_bytes(st, 5));
    json_buf_add(out, ",\"status_details\":null}", 23);
}

#define FILE_COLS "id, bytes, created_at, filename, purpose, status"

int store_file_get_json(store *s, const char *id, struct json_buf *out, char *err, size_t errlen)
{
    sqlite3_stmt *st = db_prep(s, "SELECT " FILE_COLS " FROM files WHERE id = ?", err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, id ? id : "", -1, SQLITE_STATIC);
    int r = sqlite3_step(st), rc = 0;
    if (r == SQLITE_ROW) file_json(st, out);
    else if (r == SQLITE_DONE) {
        sl_seterr(err, errlen, "No such File object: %s", id ? id : "");
        rc = STORE_ENOTFOUND;
    } else rc = db_fail(s, "get file", err, errlen);
    sqlite3_finalize(st);
    if (!rc && out->oom) {
        sl_seterr(err, errlen, "out of memory");
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
int store__list_json(store *s, sqlite3_stmt *st, int limit, void (*row)(sqlite3_stmt *, struct json_buf *),
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
        if (!n) store__copy_id(first, db_text(st, 0));
        store__copy_id(last, db_text(st, 0));
        n++;
    }
    if (r != SQLITE_ROW && r != SQLITE_DONE) rc = db_fail(s, what, err, errlen);
    sqlite3_finalize(st);
    list_tail(out, n ? first : NULL, n ? last : NULL, more);
    if (!rc && out->oom) {
        sl_seterr(err, errlen, "out of memory");
        rc = SL_ENOMEM;
    }
    return rc;
}

/* The seq of `after` in table (files or batches), or INT64_MAX for none. */
int store__after_seq(store *s, const char *table, const char *after, int64_t *seq, char *err, size_t errlen)
{
    *seq = INT64_MAX;
    if (!after || !*after) return 0;
    char sql[96];
    snprintf(sql, sizeof sql, "SELECT seq FROM %s WHERE id = ?", table);
    sqlite3_stmt *st = db_prep(s, sql, err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_text(st, 1, after, -1, SQLITE_STATIC);
    int r = sqlite3_step(st), rc = 0;
    if (r == SQLITE_ROW) *seq = sqlite3_column_int64(st, 0);
    else if (r == SQLITE_DONE) {
        sl_seterr(err, errlen, "after: no such %s: %s", strcmp(table, "files") ? "batch" : "file", after);
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
    int rc = store__after_seq(s, "files", after, &seq, err, errlen);
    if (rc) return rc;
    sqlite3_stmt *st = db_prep(s,
                               "SELECT " FILE_COLS " FROM files WHERE seq < ?1 AND (?2 IS NULL OR purpose = ?2)"
                               " ORDER BY seq DESC LIMIT ?3",
                               err, errlen);
    if (!st) return STORE_EDB;
    sqlite3_bind_int64(st, 1, seq);
    sqlite3_bind_text(st, 2, purpose && *purpose ? purpose : NULL, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 3, limit + 1);
    return store__list_json(s, st, limit, file_json, "list files", out, err, errlen);
}

/* The absolute path of a file's content, malloc'ed, or NULL with an error. */
static char *file_path(store *s, const char *id, int64_t *bytes, int *rc, char *err, size_t errlen)
{
    sqlite3_stmt *st = db_prep(s, "SELECT path, bytes FROM files WHERE id = ?", err, errlen);
    *rc = STORE_EDB;
    if (!st) return NULL;
    sqlite3_bind_text(st, 1, id ? id : "", -1, SQLITE_STATIC);
    char *p = NULL;
    int r = sqlite3_step(st);
    if (r == SQLITE_ROW) {
        p = store__path_join(s->dir, db_text(st, 0));
        if (bytes) *bytes = sqlite3_column_int64(st, 1);
        *rc = p ? 0 : SL_ENOMEM;
    } else if (r == SQLITE_DONE) {
        sl_seterr(err, errlen, "No such File object: %s", id ? id : "");
        *rc = STORE_ENOTFOUND;
    } else {
        db_fail(s, "file path", err, errlen);
    }
    sqlite3_finalize(st);
    return p;
}

int store_file_delete(store *s, const char *id, struct json_buf *out, char *err, size_t errlen)
{
    int rc = store__need_writer(s, err, errlen);
    if (rc) return rc;
    if ((rc = db_begin(s, err, errlen))) return rc;
    char rel[300] = "";
    sqlite3_stmt *st = db_prep(s, "SELECT path FROM files WHERE id = ?", err, errlen);
    if (!st) {
        rc = STORE_EDB;
        goto fail;
    }
    sqlite3_bind_text(st, 1, id ? id : "", -1, SQLITE_STATIC);
    int r = sqlite3_step(st);
    if (r == SQLITE_ROW) snprintf(rel, sizeof rel, "%s", db_text(st, 0));
    sqlite3_finalize(st);
    if (r == SQLITE_DONE) {
        sl_seterr(err, errlen, "No such File object: %s", id ? id : "");
        rc = STORE_ENOTFOUND;
        goto fail;
    }
    if (r != SQLITE_ROW) {
        rc = db_fail(s, "delete file", err, errlen);
        goto fail;
    }
    st = db_prep(s, "DELETE FROM files WHERE id = ?", err, errlen);
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
    if (!rc) rc = store__claim_in_txn(s, relp, err, errlen);
    if (!rc) rc = db_commit(s, err, errlen);
    if (rc) goto fail;
    store__remove_owned(s, rel);
    store__forget_names(s, &relp, 1, NULL, 0);
    if (out) {
        json_buf_add(out, "{\"id\":", 6);
        json_buf_add_str(out, id, strlen(id));
        json_buf_add(out, ",\"object\":\"file\",\"deleted\":true}", 32);
    }
    return 0;
fail:
    db_rollback(s);
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
        sl_seterr(err, errlen, "cannot read the content of %s: %s", id, strerror(errno));
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
    rc = read_chunks(fd, id, cb, ctx, err, errlen);
    close(fd);
    return rc;
}
