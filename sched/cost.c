/* cost.c - the step cost model the planner sizes steps by, calibrated online
 * from the step times the engine measures (sched.h, struct sched_cost), and
 * the latency histograms the scheduler keeps.
 *
 * The fit is a ridge regression on relative error with exponential
 * forgetting: each measured step adds its shape x / t against 1 to the
 * normal equations (so a 10 ms step weighs as much as a 2 s one), the sums
 * decay by SCHED_COST_FORGET a step, and a prior that never decays keeps
 * the terms the recent steps do not separate where they were. Six unknowns:
 * solved afresh after every step (a few microseconds), with the
 * coefficients that come out negative pinned to 0 and the rest refitted.
 */
#include <math.h>
#include <string.h>

#include "sched.h"

#define N SCHED_COST_N

const double sched_hist_bounds[SCHED_HIST_BUCKETS] = {0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                                                      0.5,   0.75, 1.0,  2.5,  5.0,  10.0, 20.0, 40.0, 80.0};

void sched_hist_add(struct sched_hist *h, double v)
{
    h->sum += v;
    h->count++;
    for (int i = 0; i < SCHED_HIST_BUCKETS; i++)
        if (v <= sched_hist_bounds[i]) h->le[i]++;
}

/* The fit's basis: tokens of either kind, pairs and keys of either kind,
 * then what a decode token and a decode key cost beyond a prefill token and
 * pair, and samples. In this basis "a decode costs what a prefill token
 * does" is the prior, so the steps of one shape (decodes and prefill always
 * together) leave that split where it was rather than anywhere. */
static void basis(const struct sched_step_shape *x, double *z)
{
    const double *v = x->x;
    z[0] = v[SCHED_COST_STEP];
    z[1] = v[SCHED_COST_PREFILL] + v[SCHED_COST_DECODE];
    z[2] = v[SCHED_COST_PAIR] + v[SCHED_COST_DECODE_KEY];
    z[3] = v[SCHED_COST_DECODE];
    z[4] = v[SCHED_COST_DECODE_KEY];
    z[5] = v[SCHED_COST_SAMPLE];
}

void sched_cost_init(struct sched_cost *c, double token_s, double pair_ratio)
{
    memset(c, 0, sizeof *c);
    if (!(token_s > 0.0)) token_s = 1e-3;
    if (!(pair_ratio >= 0.0)) pair_ratio = 0.0;
    double pair_s = token_s * pair_ratio, pair_scale = pair_s > 0 ? pair_s : token_s * 1e-4;
    c->prior[1] = token_s;
    c->prior[2] = pair_s;
    /* how loosely each term is known (a standard deviation): the step, the
     * token and the pair hardly at all (a thousand times their scale; the
     * first steps decide: a device may be 100 times faster or slower than
     * the prior), what a decode costs beyond a prefill token and what a
     * sample costs to about a token (the steps rarely tell these apart from
     * the others: decodes, samples and steps come together; left loose, the
     * fixed cost of a step drifts into the samples and a step of many
     * decodes looks dear) */
    double sd[N] = {1000.0 * 256.0 * token_s, 1000.0 * token_s, 1000.0 * pair_scale, token_s, pair_scale, token_s};
    for (int i = 0; i < N; i++) c->prior_prec[i] = 1.0 / (sd[i] * sd[i]);
    c->theta_ok = false;
    for (int i = 0; i < N; i++) c->theta[i] = c->prior[i];
    c->coef[SCHED_COST_STEP] = 0.0;
    c->coef[SCHED_COST_PREFILL] = c->coef[SCHED_COST_DECODE] = token_s;
    c->coef[SCHED_COST_PAIR] = c->coef[SCHED_COST_DECODE_KEY] = pair_s;
    c->coef[SCHED_COST_SAMPLE] = 0.0;
}

double sched_cost_time(const struct sched_cost *c, const struct sched_step_shape *x)
{
    double t = 0.0;
    for (int i = 0; i < N; i++) t += c->coef[i] * x->x[i];
    return t;
}

/* Solves the n x n system m y = r in place (partial pivoting). Returns -1
 * when it is singular. */
static int solve(double m[N][N], double *r, int n)
{
    for (int k = 0; k < n; k++) {
        int p = k;
        for (int i = k + 1; i < n; i++)
            if (fabs(m[i][k]) > fabs(m[p][k])) p = i;
        if (!(fabs(m[p][k]) > 1e-300)) return -1;
        if (p != k) {
            for (int j = 0; j < n; j++) {
                double t = m[k][j];
                m[k][j] = m[p][j];
                m[p][j] = t;
            }
            double t = r[k];
            r[k] = r[p];
            r[p] = t;
        }
        for (int i = k + 1; i < n; i++) {
            double f = m[i][k] / m[k][k];
            for (int j = k; j < n; j++) m[i][j] -= f * m[k][j];
            r[i] -= f * r[k];
        }
    }
    for (int k = n - 1; k >= 0; k--) {
        double v = r[k];
        for (int j = k + 1; j < n; j++) v -= m[k][j] * r[j];
        r[k] = v / m[k][k];
    }
    return 0;
}

/* The posterior mean, with the step, token, pair and sample terms >= 0:
 * solve over the free terms (the others pinned to 0), pin the most
 * negative, repeat; a decode's extra may be negative (a decode is then
 * cheaper than a prefill token) down to a decode costing nothing. The system
 * is scaled to a unit diagonal first: the terms' units differ by ten orders
 * of magnitude (pairs against steps). */
static void refit(struct sched_cost *c)
{
    static const bool signed_term[N] = {false, false, false, true, true, false};
    bool pinned[N] = {false};
    double th[N];
    for (int round = 0; round < N; round++) {
        int idx[N], n = 0;
        for (int i = 0; i < N; i++)
            if (!pinned[i]) idx[n++] = i;
        double m[N][N], r[N], d[N];
        for (int i = 0; i < n; i++) {
            int a = idx[i];
            d[i] = sqrt(c->a[a][a] + c->prior_prec[a]);
        }
        for (int i = 0; i < n; i++) {
            int a = idx[i];
            for (int j = 0; j < n; j++) {
                int b = idx[j];
                m[i][j] = (c->a[a][b] + (a == b ? c->prior_prec[a] : 0.0)) / (d[i] * d[j]);
            }
            r[i] = (c->b[a] + c->prior_prec[a] * c->prior[a]) / d[i];
        }
        if (solve(m, r, n)) return; /* keep the last coefficients */
        int worst = -1;
        for (int i = 0; i < n; i++) {
            r[i] /= d[i];
            if (!signed_term[idx[i]] && r[i] < 0 && (worst < 0 || r[i] < r[worst])) worst = i;
        }
        if (worst < 0 || n == 1) {
            for (int i = 0; i < N; i++) th[i] = 0.0;
            for (int i = 0; i < n; i++) th[idx[i]] = r[i];
            break;
        }
        pinned[idx[worst]] = true;
        if (round == N - 1) return;
    }
    memcpy(c->theta, th, sizeof th);
    c->theta_ok = true;
    double *k = c->coef;
    k[SCHED_COST_STEP] = th[0] > 0 ? th[0] : 0.0;
    k[SCHED_COST_PREFILL] = th[1] > 0 ? th[1] : 0.0;
    k[SCHED_COST_PAIR] = th[2] > 0 ? th[2] : 0.0;
    k[SCHED_COST_DECODE] = th[1] + th[3] > 0 ? th[1] + th[3] : 0.0;
    k[SCHED_COST_DECODE_KEY] = th[2] + th[4] > 0 ? th[2] + th[4] : 0.0;
    k[SCHED_COST_SAMPLE] = th[5] > 0 ? th[5] : 0.0;
}

void sched_cost_observe(struct sched_cost *c, const struct sched_step_shape *x, double seconds)
{
    if (!(seconds > 0.0) || !isfinite(seconds)) return;
    double z[N];
    basis(x, z);
    for (int i = 0; i < N; i++) z[i] /= seconds;
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < N; j++) c->a[i][j] = SCHED_COST_FORGET * c->a[i][j] + z[i] * z[j];
        c->b[i] = SCHED_COST_FORGET * c->b[i] + z[i];
    }
    c->n_obs++;
    refit(c);
}
