/* bench_report.c - what `sluice bench` prints and writes: the table (or
 * CSV) with the averages per cache kind, the JSON results, the PNG plot
 * (gnuplot), and the quantiles of the load and beside-batch modes.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "api/bench.h"

/* ---- results ---- */

static double pp_rate(const struct run_result *r) { return r->ttft > 0 ? r->p_tok / r->ttft : NAN; }
static double tg_rate(const struct run_result *r)
{
    return r->c_tok > 1 && r->total > r->ttft ? (r->c_tok - 1) / (r->total - r->ttft) : NAN;
}
static double e2e_rate(const struct run_result *r) { return r->total > 0 ? r->c_tok / r->total : NAN; }

void bench_put_num(FILE *f, double v, int prec)
{
    if (isnan(v)) fputs("-", f);
    else if (prec < 0) fprintf(f, v == floor(v) ? "%.0f" : "%.1f", v); /* token counts */
    else fprintf(f, "%.*f", prec, v);
}

/* The values of one table line, in column order. */
static void line_vals(const struct run_result *r, double v[7])
{
    v[0] = pp_rate(r);
    v[1] = tg_rate(r);
    v[2] = e2e_rate(r);
    v[3] = r->ttft;
    v[4] = r->total;
    v[5] = r->p_tok;
    v[6] = r->c_tok;
}

void bench_avg_vals(const struct row *rows, int n, const char *cache, double v[7])
{
    double sum[7] = {0};
    int cnt[7] = {0};
    for (int i = 0; i < n; i++) {
        if (strcmp(rows[i].cache, cache)) continue;
        double x[7];
        line_vals(&rows[i].r, x);
        for (int k = 0; k < 7; k++)
            if (!isnan(x[k])) { sum[k] += x[k]; cnt[k]++; }
    }
    for (int k = 0; k < 7; k++) v[k] = cnt[k] ? sum[k] / cnt[k] : NAN;
}

static const int col_prec[7] = {1, 1, 1, 3, 3, -1, -1};

static void put_line(FILE *f, char sep, const char *run, const char *cache, const double v[7])
{
    fprintf(f, "%s%c%s", run, sep, cache);
    for (int k = 0; k < 7; k++) {
        fputc(sep, f);
        bench_put_num(f, v[k], col_prec[k]);
    }
    fputc('\n', f);
}

void bench_print_table(FILE *f, char sep, const struct row *rows, int n)
{
    static const char *cols[] = {"run", "cache", "pp tok/s", "tg tok/s", "e2e tok/s", "TTFT s", "total s", "p_tok", "c_tok"};
    for (int k = 0; k < 9; k++) fprintf(f, "%s%s", k ? (sep == '\t' ? "\t" : ",") : "", cols[k]);
    fputc('\n', f);
    for (int i = 0; i < n; i++) {
        char run[16];
        double v[7];
        snprintf(run, sizeof run, "%d", rows[i].run);
        line_vals(&rows[i].r, v);
        put_line(f, sep, run, rows[i].cache, v);
    }
    static const char *kinds[] = {"bust", "hit"};
    for (int k = 0; k < 2; k++) {
        double v[7];
        bench_avg_vals(rows, n, kinds[k], v);
        if (!isnan(v[4])) put_line(f, sep, "avg", kinds[k], v);
    }
}

/* v with 3 more decimals than the table's column, and at least 7
 * significant digits (a cache hit's TTFT of 1.76 ms keeps 0.001760xyz, so
 * the rates still follow from the seconds) */
void bench_json_num(struct json_buf *b, const char *key, double v, int prec)
{
    if (isnan(v)) {
        json_buf_addf(b, "\"%s\":null", key);
    } else if (prec < 0 && v == floor(v)) {
        json_buf_addf(b, "\"%s\":%.0f", key, v);
    } else {
        int d = prec < 0 ? 2 : prec + 3;
        if (v != 0 && isfinite(v)) {
            int sig = 6 - (int)floor(log10(fabs(v)));
            if (sig > d) d = sig < 12 ? sig : 12;
        }
        json_buf_addf(b, "\"%s\":%.*f", key, d, v);
    }
}

void bench_json_vals(struct json_buf *b, const double v[7])
{
    static const char *keys[] = {"pp_tok_s", "tg_tok_s", "e2e_tok_s", "ttft_s", "total_s", "p_tok", "c_tok"};
    for (int k = 0; k < 7; k++) {
        if (k) json_buf_lit(b, ",");
        bench_json_num(b, keys[k], v[k], col_prec[k]);
    }
}

void bench_json_rows(struct json_buf *b, const struct row *rows, int n)
{
    json_buf_lit(b, "\"rows\":[");
    for (int i = 0; i < n; i++) {
        double v[7];
        line_vals(&rows[i].r, v);
        json_buf_addf(b, "%s{\"run\":%d,\"cache\":\"%s\",", i ? "," : "", rows[i].run, rows[i].cache);
        bench_json_vals(b, v);
        json_buf_addf(b, ",\"cached_tokens\":%d}", rows[i].r.cached);
    }
    json_buf_lit(b, "]");
}

void bench_json_head(struct json_buf *b, const struct bench_opts *o, const char *model, const struct sizer *sz,
                     const char *mode)
{
    json_buf_addf(b, "{\"mode\":\"%s\",\"url\":", mode);
    char url[600];
    snprintf(url, sizeof url, "http://%s:%s%s", o->t.host, o->t.port, o->t.prefix);
    json_buf_add_str(b, url, strlen(url));
    json_buf_lit(b, ",\"model\":");
    json_buf_add_str(b, model, strlen(model));
    json_buf_addf(b, ",\"prompt_tokens\":%ld,\"max_tokens\":%ld,\"runs\":%ld,\"ignore_eos\":%s,\"sized_with\":\"%s\",",
                  o->prompt_tokens, o->max_tokens, o->runs, o->ignore_eos ? "true" : "false",
                  sz->have_tokenize ? "tokenize" : "usage");
}

int bench_write_text(const char *path, const char *text, size_t len, char *err, size_t errlen)
{
    FILE *f = fopen(path, "w");
    if (!f || fwrite(text, 1, len, f) != len || fclose(f)) {
        snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
        if (f) fclose(f);
        return -1;
    }
    return 0;
}

bool bench_have_gnuplot(void)
{
    const char *path = getenv("PATH");
    if (!path) path = "/usr/bin:/bin";
    while (*path) {
        const char *e = strchr(path, ':');
        size_t n = e ? (size_t)(e - path) : strlen(path);
        char p[4096];
        snprintf(p, sizeof p, "%.*s/gnuplot", (int)n, path);
        if (n && !access(p, X_OK)) return true;
        path += n + (e ? 1 : 0);
    }
    return false;
}

/* Draws TTFT and tg tok/s per run into a PNG with gnuplot. */
int bench_plot_png(const char *png, const char *title, const struct row *rows, int n, char *err, size_t errlen)
{
    char dat[] = "/tmp/sluice-bench-XXXXXX";
    int fd = mkstemp(dat);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        snprintf(err, errlen, "cannot create a temporary file: %s", strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        double tg = tg_rate(&rows[i].r);
        fprintf(f, "%d %d %.6f %.6f\n", i + 1, !strcmp(rows[i].cache, "hit") ? 1 : !strcmp(rows[i].cache, "load") ? 2 : 0,
                rows[i].r.ttft, isnan(tg) ? 0.0 : tg);
    }
    fclose(f);
    FILE *g = popen("gnuplot", "w");
    if (!g) {
        unlink(dat);
        snprintf(err, errlen, "cannot run gnuplot: %s", strerror(errno));
        return -1;
    }
    /* one series per cache kind present, so the legend names only those */
    static const char *kind_title[] = {"cache bust", "cache hit", "load"}, *kind_color[] = {"#d95f02", "#1b9e77", "#7570b3"};
    bool present[3] = {false, false, false};
    for (int i = 0; i < n; i++)
        present[!strcmp(rows[i].cache, "hit") ? 1 : !strcmp(rows[i].cache, "load") ? 2 : 0] = true;
    fprintf(g,
            "set terminal pngcairo size 1000,700 noenhanced font ',10'\n"
            "set output '%s'\n"
            "set multiplot layout 2,1 title '%s'\n"
            "set style fill solid 0.8 border -1\nset boxwidth 0.7\nset grid ytics\nset key top right\n"
            "set xrange [0.3:%d.7]\nset xtics %d\nset yrange [0:*]\nset xlabel '%s'\n",
            png, title, n, n > 40 ? n / 20 : 1, present[2] ? "request" : "run");
    for (int panel = 0; panel < 2; panel++) {
        fprintf(g, "set ylabel '%s'\nplot ", panel ? "tg tok/s" : "TTFT (s)");
        bool first = true;
        for (int k = 0; k < 3; k++) {
            if (!present[k]) continue;
            fprintf(g, "%s'%s' using 1:($2==%d?$%d:1/0) with boxes lc rgb '%s' title '%s'", first ? "" : ", ", dat, k,
                    panel ? 4 : 3, kind_color[k], kind_title[k]);
            first = false;
        }
        fputc('\n', g);
    }
    fprintf(g, "unset multiplot\n");
    int st = pclose(g);
    unlink(dat);
    struct stat sb;
    if (st != 0 || stat(png, &sb) || !sb.st_size) {
        snprintf(err, errlen, "gnuplot failed to draw %s (exit status %d)", png, st);
        return -1;
    }
    return 0;
}

/* ---- statistics ---- */

int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* q-quantile of sorted v[0..n) with linear interpolation (numpy's default). */
double bench_quantile(const double *v, int n, double q)
{
    if (n <= 0) return NAN;
    double pos = q * (n - 1);
    int i = (int)pos;
    if (i + 1 >= n) return v[n - 1];
    return v[i] + (pos - i) * (v[i + 1] - v[i]);
}

/* ---- speculative decoding's counters ---- */

void bench_spec_read(const struct hc_target *t, struct bench_spec *s)
{
    memset(s, 0, sizeof *s);
    struct json_buf b;
    char err[256];
    int st = bench_http_json(t, "GET", "/metrics", NULL, &b, err, sizeof err);
    if (st == 200 && b.p) {
        static const char *const names[3] = {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                                             "vllm:spec_decode_num_accepted_tokens_total"};
        double *dst[3] = {&s->drafts, &s->draft_tokens, &s->accepted};
        const char *pos_name = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
        for (const char *l = b.p; l && *l; l = strchr(l, '\n'), l = l ? l + 1 : NULL) {
            if (*l == '#') continue;
            const char *sp = strchr(l, ' '), *nl = strchr(l, '\n');
            if (!sp || (nl && sp > nl)) continue;
            double v = atof(sp + 1);
            for (int k = 0; k < 3; k++) {
                size_t n = strlen(names[k]);
                if (!strncmp(l, names[k], n) && (l[n] == '{' || l[n] == ' ')) *dst[k] += v, s->have = true;
            }
            size_t n = strlen(pos_name);
            const char *pp = !strncmp(l, pos_name, n) ? strstr(l, "position=\"") : NULL;
            if (pp && pp < sp) {
                int i = atoi(pp + 10);
                if (i >= 0 && i < BENCH_SPEC_POS) {
                    s->per_pos[i] += v;
                    if (i + 1 > s->n_pos) s->n_pos = i + 1;
                }
            }
        }
    }
    json_buf_free(&b);
}

void bench_spec_report(const struct bench_spec *a, const struct bench_spec *b, struct json_buf *js)
{
    if (!a->have || !b->have) return;
    double d = b->drafts - a->drafts, dt = b->draft_tokens - a->draft_tokens, acc = b->accepted - a->accepted;
    printf("spec decode\tdrafts %.0f, draft tokens %.0f, accepted %.0f, mean accepted length %.3f, acceptance %.3f, "
           "per position",
           d, dt, acc, d > 0 ? 1.0 + acc / d : NAN, dt > 0 ? acc / dt : NAN);
    for (int i = 0; i < b->n_pos; i++) printf(" %.3f", d > 0 ? (b->per_pos[i] - a->per_pos[i]) / d : NAN);
    putchar('\n');
    fflush(stdout);
    if (!js) return;
    json_buf_lit(js, ",\"spec_decode\":{");
    bench_json_num(js, "drafts", d, 0);
    json_buf_lit(js, ",");
    bench_json_num(js, "draft_tokens", dt, 0);
    json_buf_lit(js, ",");
    bench_json_num(js, "accepted_tokens", acc, 0);
    json_buf_lit(js, ",");
    bench_json_num(js, "mean_accepted_length", d > 0 ? 1.0 + acc / d : NAN, 4);
    json_buf_lit(js, ",\"acceptance_per_position\":[");
    for (int i = 0; i < b->n_pos; i++)
        json_buf_addf(js, "%s%.4f", i ? "," : "", d > 0 ? (b->per_pos[i] - a->per_pos[i]) / d : 0.0);
    json_buf_lit(js, "]}");
}
