/* sample.cu - sampling on the device (kernels.h).
 *
 * cuda_argmax_lse: greedy token and its log-probability, nothing else (the
 * row split into slices, tp.cu's partial reductions, combined in order).
 * cuda_sample: model_sample() (model/sampler.c, the specification) for rows
 * whose uniform u the host drew from the request's RNG. One 1024-thread block
 * per row. The candidate sets are found without sorting the row: a bisection
 * over the monotone integer image of the float bits (ord) finds the threshold
 * of the k best (top_logprobs, top_k: ties at the threshold are filled in id
 * order, so exactly k are kept) or of a superset of the top_p nucleus (float
 * mass estimate with a margin, checked exactly afterwards). Those candidates
 * are gathered into shared memory, bitonic-sorted by (logit desc, id asc)
 * and finished by one thread in the CPU's order of summation. Without top_k
 * or top_p the CPU draws over the row in id order; so does the device, with a
 * block-wide scan. Where the candidates do not fit, the row gets status 1 and
 * the host samples it: exact, never approximate.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cuda/bf16.cuh"
#include "cuda/kernels.h"

extern "C" cudaError_t cuda_argmax_lse(const float *logits, int R, int V, struct cuda_argmax_part *scratch,
                                       int32_t *tok, float *logprob, cudaStream_t st)
{
    if (R <= 0) return cudaSuccess;
    /* slices of at least 4096 logits: one 512-thread block reads 8 each */
    int ns = (V + 4095) / 4096;
    if (ns > CUDA_ARGMAX_SLICES) ns = CUDA_ARGMAX_SLICES;
    cudaError_t e = cuda_argmax_slices(logits, R, V, 0, ns, scratch, st);
    return e != cudaSuccess ? e : cuda_argmax_combine(scratch, ns, R, tok, logprob, st);
}

/* ---- cuda_sample ----------------------------------------------------------- */

#define NT 1024 /* threads per block: the reductions below assume exactly 32 warps */
#define CAP CUDA_SAMPLE_CAP
static_assert((CAP & (CAP - 1)) == 0 && CAP >= NT, "CAP: a power of two, at least one per thread");

struct smem {
    uint64_t key[CAP]; /* candidates: (~ord(value) << 32) | id, ascending = (value desc, id asc) */
    double e[CAP];     /* exp(value - cmx) of key[i], then its share of z */
    double rd[32];
    float rf[32];
    int ri[2][32];
    int cnt, keep, tok;
    double z;
};

/* Monotone image of a float in uint32 (for non-NaN): a < b <=> ord(a) < ord(b),
 * with -0 == +0 as the CPU's comparisons have it. */
static __device__ __forceinline__ uint32_t ord(float v)
{
    uint32_t b = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
static __device__ __forceinline__ float unord(uint32_t k)
{
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
static __device__ __forceinline__ uint64_t mkkey(uint32_t k, int id) { return ((uint64_t)~k << 32) | (uint32_t)id; }
static __device__ __forceinline__ int key_id(uint64_t key) { return (int)(uint32_t)key; }
static __device__ __forceinline__ float key_val(uint64_t key) { return unord(~(uint32_t)(key >> 32)); }

/* The ordering key of element i: raw logit over the whole row (top
 * logprobs), or logit * inv_t over the sampling candidates (logit > -inf). */
static __device__ __forceinline__ bool elem(const float *lg, int i, bool scaled, float inv_t, uint32_t *k)
{
    float v = lg[i];
    if (!scaled) {
        *k = ord(v);
        return true;
    }
    if (!(v > -INFINITY)) return false;
    *k = ord(__fmul_rn(v, inv_t));
    return true;
}

/* Block reductions: every thread gets the result, the same in every thread
 * (a butterfly adds the same pairs in every lane, commutatively). Each starts
 * with __syncthreads(), so back-to-back calls may share the scratch. */
static __device__ void block_sum3(int *a, int *b, float *c, struct smem *sm)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int x = *a, y = *b;
    float z = *c;
    for (int o = 16; o; o >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, o);
        y += __shfl_xor_sync(0xffffffffu, y, o);
        z += __shfl_xor_sync(0xffffffffu, z, o);
    }
    __syncthreads();
    if (lane == 0) sm->ri[0][w] = x, sm->ri[1][w] = y, sm->rf[w] = z;
    __syncthreads();
    x = sm->ri[0][lane], y = sm->ri[1][lane], z = sm->rf[lane];
    for (int o = 16; o; o >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, o);
        y += __shfl_xor_sync(0xffffffffu, y, o);
        z += __shfl_xor_sync(0xffffffffu, z, o);
    }
    *a = x, *b = y, *c = z;
}
static __device__ int block_sum_i(int v, struct smem *sm)
{
    int u = 0;
    float f = 0.0f;
    block_sum3(&v, &u, &f, sm);
    return v;
}
static __device__ double block_sum_d(double v, struct smem *sm)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sm->rd[w] = v;
    __syncthreads();
    v = sm->rd[lane];
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
/* (value desc, id asc) maximum */
static __device__ void block_argmax(float *v, int *id, struct smem *sm)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    float b = *v;
    int bi = *id;
    for (int pass = 0; pass < 2; pass++) {
        for (int o = 16; o; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, b, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > b || (ov == b && oi < bi)) b = ov, bi = oi;
        }
        if (pass) break;
        __syncthreads();
        if (lane == 0) sm->rf[w] = b, sm->ri[0][w] = bi;
        __syncthreads();
        b = sm->rf[lane], bi = sm->ri[0][lane];
    }
    *v = b, *id = bi;
}
/* Exclusive prefix count of f over the threads in order; *total the count. */
static __device__ int block_excl_count(bool f, int *total, struct smem *sm)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    unsigned bits = __ballot_sync(0xffffffffu, f);
    int pre = __popc(bits & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) sm->ri[0][w] = __popc(bits);
    __syncthreads();
    int off = 0, tot = 0;
    for (int k = 0; k < NT / 32; k++) {
        if (k == w) off = tot;
        tot += sm->ri[0][k];
    }
    *total = tot;
    return off + pre;
}
/* Exclusive prefix sum of v over the threads in order; *total the sum. */
static __device__ double block_excl_sum_d(double v, double *total, struct smem *sm)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    double inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        double t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += t;
    }
    double ex = __shfl_up_sync(0xffffffffu, inc, 1);
    if (lane == 0) ex = 0.0;
    __syncthreads();
    if (lane == 31) sm->rd[w] = inc;
    __syncthreads();
    double off = 0.0, tot = 0.0;
    for (int k = 0; k < NT / 32; k++) {
        if (k == w) off = tot;
        tot += sm->rd[k];
    }
    *total = tot;
    return off + ex;
}

/* key[0..k) = the k best elements (k <= CAP), unsorted, given T, the ord of
 * the k-th best: every element above T, then the lowest ids equal to T. */
static __device__ void gather_top(const float *lg, int V, bool scaled, float inv_t, uint32_t T, int k,
                                  struct smem *sm)
{
    __syncthreads(); /* earlier readers of key and cnt are done */
    if (threadIdx.x == 0) sm->cnt = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += NT) {
        uint32_t q;
        if (elem(lg, i, scaled, inv_t, &q) && q > T) {
            int s = atomicAdd(&sm->cnt, 1);
            if (s < CAP) sm->key[s] = mkkey(q, i); /* s < k by the choice of T; guard anyway */
        }
    }
    __syncthreads();
    const int need = k - sm->cnt;
    int taken = 0;
    for (int base = 0; base < V && taken < need; base += NT) { /* uniform: taken, need */
        int i = base + threadIdx.x;
        uint32_t q = 0;
        bool f = i < V && elem(lg, i, scaled, inv_t, &q) && q == T;
        int total, pre = block_excl_count(f, &total, sm);
        if (f && taken + pre < need) sm->key[k - need + taken + pre] = mkkey(T, i);
        taken += total;
    }
    __syncthreads();
}

/* key[0..) = every sampling candidate with ord(logit * inv_t) >= T, unsorted;
 * returns their number, which may exceed CAP (then only CAP are stored). */
static __device__ int gather_ge(const float *lg, int V, float inv_t, uint32_t T, struct smem *sm)
{
    __syncthreads();
    if (threadIdx.x == 0) sm->cnt = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += NT) {
        uint32_t q;
        if (elem(lg, i, true, inv_t, &q) && q >= T) {
            int s = atomicAdd(&sm->cnt, 1);
            if (s < CAP) sm->key[s] = mkkey(q, i);
        }
    }
    __syncthreads();
    return sm->cnt;
}

/* Bitonic sort of key[0..n), n <= CAP, ascending. */
static __device__ void sort_keys(int n, struct smem *sm)
{
    int P = 1;
    while (P < n) P <<= 1;
    for (int i = n + threadIdx.x; i < P; i += NT) sm->key[i] = ~0ull;
    __syncthreads();
    for (int k = 2; k <= P; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < P; i += NT) {
                int l = i ^ j;
                if (l > i) {
                    uint64_t a = sm->key[i], b = sm->key[l];
                    if (((i & k) == 0) == (a > b)) sm->key[i] = b, sm->key[l] = a;
                }
            }
            __syncthreads();
        }
}

static __device__ void fill_e(int n, float cmx, struct smem *sm)
{
    for (int i = threadIdx.x; i < n; i += NT) sm->e[i] = exp((double)key_val(sm->key[i]) - (double)cmx);
    __syncthreads();
}

/* model_sample's steps 3 after the candidates are sorted: key[0..n) is a
 * prefix of the CPU's sorted candidates, holding at least what the CPU keeps.
 * z1: the CPU's top_p normalizer when have_z1 (else the sum over key[0..n)).
 * cut_ok: keeping all n is right when the top_p walk never reaches top_p.
 * Returns the token, or -1 when the row must go to the host. */
static __device__ int finish_sorted(int n, const struct cuda_sample_row *p, float cmx, float lim, double z1,
                                    bool have_z1, bool cut_ok, struct smem *sm)
{
    fill_e(n, cmx, sm);
    int m = n;
    if (p->top_p < 1.0f) {
        if (threadIdx.x == 0) {
            double z = z1;
            if (!have_z1) {
                z = 0.0;
                for (int i = 0; i < n; i++) z += sm->e[i];
            }
            sm->z = z;
        }
        __syncthreads();
        const double z = sm->z;
        for (int i = threadIdx.x; i < n; i += NT) sm->e[i] = sm->e[i] / z;
        __syncthreads();
        if (threadIdx.x == 0) {
            double cum = 0.0;
            int keep = -1;
            for (int i = 0; i < n; i++) {
                cum += sm->e[i];
                if (cum >= (double)p->top_p) {
                    keep = i + 1;
                    break;
                }
            }
            sm->keep = keep;
        }
        __syncthreads();
        m = sm->keep;
        if (m < 0) {
            if (!cut_ok) return -1;
            m = n;
        }
        fill_e(m, cmx, sm); /* back from shares to exp */
    }
    if (p->min_p > 0.0f) { /* sorted: those >= lim are a prefix, at least key[0] (= cmx >= lim) */
        int c = 0;
        for (int i = threadIdx.x; i < m; i += NT) c += key_val(sm->key[i]) >= lim;
        m = block_sum_i(c, sm);
    }
    if (threadIdx.x == 0) {
        double z = 0.0;
        for (int i = 0; i < m; i++) z += sm->e[i];
        double u = p->u * z, cum = 0.0;
        int tok = key_id(sm->key[m - 1]);
        for (int i = 0; i < m; i++) {
            cum += sm->e[i];
            if (u < cum) {
                tok = key_id(sm->key[i]);
                break;
            }
        }
        sm->tok = tok;
    }
    __syncthreads();
    return sm->tok;
}

/* No top_k and no top_p: the CPU draws over the candidates in id order; each
 * thread takes a contiguous run of ids, a block scan gives its offset. */
static __device__ int draw_in_id_order(const float *lg, int V, float inv_t, float cmx, bool has_min_p, float lim,
                                       double u, struct smem *sm)
{
    const int ch = (V + NT - 1) / NT, lo = min((int)threadIdx.x * ch, V), hi = min(lo + ch, V);
    double loc = 0.0;
    int first = -1, last = -1;
    for (int i = lo; i < hi; i++) {
        float v = lg[i];
        if (!(v > -INFINITY)) continue;
        float s = __fmul_rn(v, inv_t);
        if (has_min_p && !(s >= lim)) continue;
        loc += exp((double)s - (double)cmx);
        if (first < 0) first = i;
        last = i;
    }
    double z, cum = block_excl_sum_d(loc, &z, sm);
    const double uu = u * z;
    int found = INT_MAX;
    if (first >= 0) {
        if (cum > uu) {
            found = first; /* the crossing was before this run: its first candidate is the answer */
        } else {
            for (int i = first; i <= last; i++) {
                float v = lg[i];
                if (!(v > -INFINITY)) continue;
                float s = __fmul_rn(v, inv_t);
                if (has_min_p && !(s >= lim)) continue;
                cum += exp((double)s - (double)cmx);
                if (uu < cum) {
                    found = i;
                    break;
                }
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) sm->tok = INT_MAX, sm->keep = -1;
    __syncthreads();
    if (found != INT_MAX) atomicMin(&sm->tok, found);
    if (last >= 0) atomicMax(&sm->keep, last);
    __syncthreads();
    return sm->tok != INT_MAX ? sm->tok : sm->keep; /* none crossed (rounding): the last candidate */
}

static __global__ void __launch_bounds__(NT) sample_kernel(float *logits, int V, const struct cuda_sample_row *rows,
                                                           const struct cuda_sample_pen *pen,
                                                           struct cuda_sample_out *out)
{
    __shared__ struct smem sm;
    const int tid = threadIdx.x;
    float *lg = logits + (size_t)blockIdx.x * V;
    const struct cuda_sample_row p = rows[blockIdx.x];
    struct cuda_sample_out *o = out + blockIdx.x;

    /* 1. penalties, in place; ids are distinct, so one thread owns each */
    const bool rep = p.repetition_penalty != 1.0f;
    const bool pf = p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
    for (int j = tid; j < p.n_pen && (rep || pf); j += NT) {
        struct cuda_sample_pen e = pen[p.pen_off + j];
        if (e.id < 0 || e.id >= V) continue;
        float v = lg[e.id];
        if (rep) v = v > 0.0f ? __fdiv_rn(v, p.repetition_penalty) : __fmul_rn(v, p.repetition_penalty);
        if (pf && e.count > 0) /* no contraction: the CPU rounds the product, then the sum */
            v = __fsub_rn(v, __fadd_rn(__fmul_rn(p.frequency_penalty, (float)e.count), p.presence_penalty));
        lg[e.id] = v;
    }
    __syncthreads();

    /* 2. max (lowest id on ties), NaN, number of sampling candidates */
    float mx = -INFINITY;
    int am = INT_MAX, nc = 0;
    bool nan = false;
    for (int i = tid; i < V; i += NT) {
        float v = lg[i];
        if (v > mx) mx = v, am = i;
        nan |= isnan(v);
        nc += v > -INFINITY;
    }
    block_argmax(&mx, &am, &sm);
    nc = block_sum_i(nc, &sm);
    if (__syncthreads_or(nan) || !isfinite(mx)) {
        if (tid == 0) o->status = -1, o->token = -1, o->logprob = NAN, o->n_top = 0;
        return;
    }

    const bool greedy = !(p.temperature > 0.0f && p.top_k != 1);
    const float inv_t = greedy ? 1.0f : __fdiv_rn(1.0f, p.temperature);
    const float cmx = __fmul_rn(mx, inv_t);
    const bool has_min_p = p.min_p > 0.0f;
    const float lim = has_min_p ? __fadd_rn(cmx, p.log_min_p) : -INFINITY;
    const int ntl = min(p.top_logprobs, V);
    const bool by_k = !greedy && p.top_k > 0 && p.top_k < nc; /* the CPU sorts its top_k */
    const bool by_p = !greedy && !by_k && p.top_p < 1.0f;     /* the CPU sorts its nucleus */
    if (by_k && p.top_k > CAP) {
        if (tid == 0) o->status = 1, o->token = -1, o->logprob = NAN, o->n_top = 0;
        return;
    }

    /* 3. log-sum-exp in double; for top_p also its normalizer z1 (double) and
     * a float estimate zf for the bisection */
    double sum = 0.0, z1 = 0.0;
    float zf = 0.0f;
    for (int i = tid; i < V; i += NT) {
        float v = lg[i];
        sum += exp((double)v - (double)mx);
        if (by_p && v > -INFINITY) {
            float s = __fmul_rn(v, inv_t);
            z1 += exp((double)s - (double)cmx);
            zf += expf(s - cmx);
        }
    }
    sum = block_sum_d(sum, &sm);
    const double lse = (double)mx + log(sum);
    if (by_p) {
        z1 = block_sum_d(z1, &sm);
        int d0 = 0, d1 = 0;
        block_sum3(&d0, &d1, &zf, &sm);
    }

    /* 4. thresholds, both bisections in the same passes over the row.
     * A: ord of the ntl-th best raw logit (top logprobs).
     * B: ord of the top_k-th best scaled logit, or for top_p the highest
     *    threshold whose (estimated) mass reaches top_p with a margin (the
     *    exact walk later checks it), never below min_p's limit. */
    uint64_t alo = 0, ahi = (uint64_t)ord(mx) + 1, blo = 0, bhi = (uint64_t)ord(cmx) + 1;
    if (by_p && has_min_p) blo = ord(lim);
    const float tgt = by_p ? zf * (float)fmin((double)p.top_p + 1e-4, 0.5 * ((double)p.top_p + 1.0)) : 0.0f;
    const bool aon = ntl > 0, bon = by_k || by_p;
    for (;;) {
        const bool ra = aon && ahi - alo > 1, rb = bon && bhi - blo > 1;
        if (!ra && !rb) break;
        const uint32_t amid = (uint32_t)(alo + (ahi - alo) / 2), bmid = (uint32_t)(blo + (bhi - blo) / 2);
        int ca = 0, cb = 0;
        float mb = 0.0f;
        for (int i = tid; i < V; i += NT) {
            float v = lg[i];
            if (ra) ca += ord(v) >= amid;
            if (rb && v > -INFINITY) {
                float s = __fmul_rn(v, inv_t);
                if (ord(s) >= bmid) {
                    if (by_k) cb++;
                    else mb += expf(s - cmx);
                }
            }
        }
        block_sum3(&ca, &cb, &mb, &sm);
        if (ra) (ca >= ntl ? alo : ahi) = amid;
        if (rb) ((by_k ? cb >= p.top_k : mb >= tgt) ? blo : bhi) = bmid;
    }

    /* 5. top logprobs (before temperature) */
    if (ntl > 0) {
        gather_top(lg, V, false, 1.0f, (uint32_t)alo, ntl, &sm);
        sort_keys(ntl, &sm);
        if (tid < ntl) {
            o->top_ids[tid] = key_id(sm.key[tid]);
            o->top_logprobs[tid] = (float)((double)key_val(sm.key[tid]) - lse);
        }
    }

    /* 6. choose */
    int tok = am;
    if (by_k) {
        gather_top(lg, V, true, inv_t, (uint32_t)blo, p.top_k, &sm);
        sort_keys(p.top_k, &sm);
        tok = finish_sorted(p.top_k, &p, cmx, lim, 0.0, false, true, &sm);
    } else if (by_p) {
        int g = gather_ge(lg, V, inv_t, (uint32_t)blo, &sm);
        if (g > CAP) {
            tok = -1;
        } else {
            sort_keys(g, &sm);
            /* the walk may run off the end when g holds every candidate, or
             * when min_p's limit bounded the gather (it would cut there) */
            bool cut_ok = g == nc || (has_min_p && (uint32_t)blo == ord(lim));
            tok = finish_sorted(g, &p, cmx, lim, z1, true, cut_ok, &sm);
        }
    } else if (!greedy) {
        tok = draw_in_id_order(lg, V, inv_t, cmx, has_min_p, lim, p.u, &sm);
    }
    if (tid == 0) {
        o->status = tok < 0 ? 1 : 0;
        o->token = tok;
        o->logprob = tok < 0 ? NAN : (float)((double)lg[tok] - lse);
        o->n_top = tok < 0 ? 0 : ntl;
    }
}

extern "C" cudaError_t cuda_sample(float *logits, int R, int V, const struct cuda_sample_row *rows,
                                   const struct cuda_sample_pen *pen, struct cuda_sample_out *out, cudaStream_t st)
{
    if (R <= 0) return cudaSuccess;
    if (V <= 0 || !logits || !rows || !out) return cudaErrorInvalidValue;
    sample_kernel<<<R, NT, 0, st>>>(logits, V, rows, pen, out);
    return cudaGetLastError();
}

extern "C" int cuda_sample_pen_build(const int32_t *history, int n_prompt, int n_history, int32_t *mark,
                                     struct cuda_sample_pen *pen)
{
    int n = 0;
    for (int i = 0; i < n_history; i++) {
        int32_t id = history[i];
        if (!mark[id]) {
            mark[id] = ++n;
            pen[n - 1].id = id;
            pen[n - 1].count = 0;
        }
        if (i >= n_prompt) pen[mark[id] - 1].count++;
    }
    for (int j = 0; j < n; j++) mark[pen[j].id] = 0;
    return n;
}
