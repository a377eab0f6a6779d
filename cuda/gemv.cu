/* gemv.cu - y = x W^T for a few rows of x (decode), bandwidth-bound, and its
 * decode fusions (kernels.h): the residual add in the epilogue, SwiGLU in the
 * epilogue of the gate|up projection, RMSNorm in the prologue.
 *
 * Three kernels, each with every epilogue and the norm prologue. The "warp"
 * kernel streams one weight row per warp (two for SwiGLU: gate and up); it
 * is the one-token decode kernel and the one for short rows. The "block"
 * kernel gives a
 * block of 256 threads RB rows at once and splits K over all 256 threads:
 * thread i takes 16-byte chunks i, i + 256, i + 512, ... of every row, so
 * for in = 4096 the whole group (RB rows x 8 KB) is one batch of RB*2 loads
 * per thread, all issued before the first use, and for in = 14336 (RB = 2)
 * one batch of 7; the K split costs one cheap in-block reduction (a
 * transposing butterfly, then 8 warp partials through shared memory). A
 * block walks groups of rows g, g + grid, ...; the next group's loads are
 * issued before the current one is reduced and written. The "mma" kernel
 * (below) runs 16 rows at a time through the tensor cores, with the rows
 * of x as the MMA's columns; it is the one for 2-8 rows of x.
 *
 * Summation order: per output, thread i sums its chunks in K order (f32
 * fma), the 32 lanes combine by the xor butterfly 16, 8, 4, 2, 1, then the 8
 * warps in warp order. The order depends on nothing but `in`, so every block
 * kernel variant and fusion gives bit-identical sums for the same W and x;
 * in the warp kernel lane l sums chunks l, l + 32, ... in K order and the
 * lanes combine by the same butterfly, whatever the epilogue. Every
 * launcher picks between the two kernels by the same rule (use_warp), so a
 * fusion is bit for bit the unfused kernels it replaces: the tests rely on
 * that.
 *
 * Programmatic dependent launch (sm_90, pdl.cuh): every kernel here lets the
 * next kernel launch as soon as all of its blocks are running
 * (griddepcontrol.launch_dependents) and, when it was itself launched with
 * the PDL attribute, issues its first weight loads before waiting for its
 * predecessor (griddepcontrol.wait), reading nothing the predecessor may
 * write before the wait. Every block waits, so completion of a kernel here
 * still implies completion of everything before it in the stream.
 *
 * The decode MLP (cuda_gemv_mlp, one token): the down GEMV need not wait for
 * the whole gate/up GEMV. That one stores h[j] as a 32-bit word, tag << 16
 * | bf16, with the call's tag; the down GEMV (the tensor-core kernel, its
 * weights requested first as always) is launched early by PDL and reads
 * the words of each step's 1024 columns until they carry the tag. It waits
 * for its predecessor only before its epilogue. A word is stored and read
 * whole, so no counter and no fence are needed (a counter with a fence
 * per warp cost 12 us a layer). The
 * down GEMV's blocks become resident as the gate/up GEMV's last wave
 * drains, so they fill its tail. The sums are those of the two plain
 * launches, bit for bit.
 *
 * Which kernel (use_mma, use_warp): the tensor-core kernel for 2-8 rows and
 * for one row of in >= 12288 (the down projection), the warp kernel for
 * other single rows, which measured fastest on the H200 (Llama-8B decode at
 * batch 1 223.3 tok/s on the warp kernel against 204.6 on mma, 222.6 vs
 * 225.0 with the down projection on mma; at batch 4 711 on the block
 * kernel against 838 on mma). The block kernel is reached only through
 * cuda_gemv_select, for tests and benchmarks (variant 0 warp, 1 block, 2
 * block on one wave of blocks, 3 the rule above, 4 mma).
 *
 * What the default kernels do beyond that, each measured against its
 * absence (batch-1 decode of the Llama-8B shape on the H200):
 *   - PDL on sm_90 (pdl.cuh), here and in cuda_add_rmsnorm and the decode
 *     attention: 202.1 -> 207.0 tok/s.
 *   - 4 chunks per lane in flight in the warp kernels; 8 and 16 measured
 *     slower (fewer resident warps).
 *   - the one-token norm GEMV (qkv) two rows a warp (rows j and out/2 + j,
 *     each summed as a lone row, so the bits are the same), 3 blocks an
 *     SM, so Llama-8B's 6144 rows run in one wave: 225.7-226.0 ->
 *     227.8-228.3 tok/s; its norm weights staged in shared memory before
 *     the wait (norm_stage): 229.3-229.7 -> 231.2-232.6 tok/s.
 *   - cuda_gemv_mlp's overlap of its two GEMVs (above).
 *   - the warp kernels without the norm prologue (o, the LM head) copy x
 *     (T x in <= 16K elements) into shared memory first, in one round
 *     trip, instead of reading it chunk by chunk: +0.3%.
 *   - the one-row norm GEMVs (qkv, gate/up) scale the sums by the norm's
 *     inverse (norm_rows_late), one barrier and the reduction off the
 *     prologue; cuda_gemv_late(0), for tests, scales x first, bit for bit
 *     the unfused chain.
 *   - cuda_gemv_mlp's tagged gate/up GEMV on one wave of blocks whose
 *     warps take rows j, j + S, ... (the next row's first chunks requested
 *     with the current row's last), x normalized once a block: +1.1%;
 *     cuda_gemv_persist(0), for tests, gives one block per 8 rows.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/bf16.cuh"
#include "cuda/kernels.h"
#include "cuda/norm.cuh"
#include "cuda/pdl.cuh"
#include "cuda/tile.cuh"

#define BT 256 /* threads of the block kernel */
#define GEMV_WARPS 8
#define MW 16 /* warps of the tensor-core kernel (below) */
#define UU 2  /* its groups of 32 columns in flight per row */

/* weights: read once, never again in this kernel: keep them out of L1 */
static __device__ __forceinline__ uint4 ld_stream(const uint4 *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

static __device__ __forceinline__ void unpack8(uint4 v, float *f)
{
    f[0] = __uint_as_float(v.x << 16), f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16), f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16), f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16), f[7] = __uint_as_float(v.w & 0xffff0000u);
}

enum { EPI_BF16, EPI_F32, EPI_RESID, EPI_SWIGLU };

struct gemv_params {
    const uint16_t *W; /* [out][in], or [2F][in] for EPI_SWIGLU (gate rows, then up rows) */
    const uint16_t *x; /* [NT][in] bf16 (NORM false) */
    const float *xf;   /* [NT][in] f32 residual to normalize (NORM true) */
    const float *nw;   /* [in] norm weight (NORM true) */
    float eps;
    void *y;           /* [NT][out]: bf16, f32, f32 to add to (EPI_RESID), bf16 h (EPI_SWIGLU) */
    int in, out;       /* out: outputs per row of x (F for EPI_SWIGLU) */
    int ngroups;       /* groups of RB rows (RB/2 gate/up pairs for EPI_SWIGLU) */
    uint32_t *hw;      /* cuda_gemv_mlp (TAGGED kernels): [F] h as tag << 16 | bf16 */
    uint32_t tag;      /* this call's tag (1 ... 65535) */
    bool nwsm;         /* NORM, the pair kernel: nw staged in shared memory after xs (norm_stage) */
};

/* Output o of a GEMV from its sum a (and, for EPI_SWIGLU, the up row's sum
 * u): every kernel's epilogue */
template <int EPI>
static __device__ __forceinline__ void gemv_store(const gemv_params &p, size_t o, float a, float u)
{
    if (EPI == EPI_BF16) ((uint16_t *)p.y)[o] = f2bf(a);
    if (EPI == EPI_F32) ((float *)p.y)[o] = a;
    if (EPI == EPI_RESID) ((float *)p.y)[o] += bf2f(f2bf(a)); /* as x += delta of bf16(s) */
    if (EPI == EPI_SWIGLU) ((uint16_t *)p.y)[o] = swiglu1(f2bf(a), f2bf(u));
}

static __host__ __device__ constexpr int pow2ceil(int n) { return n <= 1 ? 1 : 2 * pow2ceil((n + 1) / 2); }
static __host__ __device__ constexpr int log2i(int n) { return n <= 1 ? 0 : 1 + log2i(n / 2); }

/* NORM with p.nwsm: the norm weights ([in] f32) into shared memory after
 * xs ([NT][in] bf16), requested before pdl_wait (weights: no kernel of the
 * step writes them), so that norm_rows' second pass finds them there. In
 * the one-wave qkv pair kernel every block otherwise waits in that pass on
 * L2 round trips for them, all its blocks at once, on the step's critical
 * path: its prologue took 4.2-4.3 us, now 2.9-3.3 (in an nsys trace).
 * Not in the many-wave gate/up GEMV, whose later blocks find the
 * weights in L1 (staging slowed it there) */
template <int NT>
static __device__ __forceinline__ void norm_stage(const gemv_params &p, uint4 *xs4)
{
    if (!p.nwsm || threadIdx.x >= BT) return;
    float *dst = (float *)((uint16_t *)xs4 + (size_t)NT * p.in);
    for (int i = threadIdx.x * 4; i < p.in; i += BT * 4)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst + i)), "l"(p.nw + i) : "memory");
    cp_async_commit();
}

/* The rows of x through cuda_add_rmsnorm's arithmetic (norm.cuh) into xs
 * [NT][in] bf16 (shared memory), by the first 256 threads of the block (the
 * others only pass its barriers): nv <= 1024 virtual threads; virtual warp
 * warp + 8k is this warp's k-th, its sum in ss[k]. The loops run over i0
 * outside and k inside so that a thread's loads (L2 hits) are independent
 * of each other. STG: the norm weights may come from norm_stage (p.nwsm).
 * Ends with a barrier. */
template <int NT, bool STG = false>
static __device__ __forceinline__ void norm_rows(const gemv_params &p, uint16_t *xs, float *nsh)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nv = rms_threads(p.in), nvw = nv / 32;
    const bool act = tid < BT;
    for (int t = 0; t < NT; t++) {
        const float *xr = p.xf + (size_t)t * p.in;
        float v[4][4]; /* this thread's values of the row's last (with in <= 4 nv: only) four steps */
        if (act) {
            float ss[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            /* four steps of nv at a time, every load issued before the first
             * use: from the plain loop ptxas issued the loads one or two at
             * a time, each waited for, ~8 L2 round trips in every block's
             * prologue (batch-1 decode 233 -> 238 tok/s with this). 0 past
             * the row, and fma(0, 0, s) == s, so the sums are the same */
            for (int i0 = 0; i0 < p.in; i0 += 4 * nv) {
#pragma unroll
                for (int q = 0; q < 4; q++)
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        int vw = warp + 8 * k, i = i0 + q * nv + vw * 32 + lane;
                        v[q][k] = vw < nvw && i < p.in ? xr[i] : 0.0f;
                    }
#pragma unroll
                for (int q = 0; q < 4; q++)
#pragma unroll
                    for (int k = 0; k < 4; k++) ss[k] = rms_acc(ss[k], v[q][k]);
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float s = warp_sum(ss[k]);
                if (lane == 0 && warp + 8 * k < nvw) nsh[warp + 8 * k] = s;
            }
        }
        const bool stg = STG && p.nwsm;
        if (stg && t == 0) cp_async_wait<0>(); /* norm_stage's weights, shared by the barrier */
        __syncthreads();
        if (act) {
            float inv = rms_inv(warp_sum(lane < nvw ? nsh[lane] : 0.0f), p.in, p.eps);
            const float *nw = stg ? (const float *)(xs + (size_t)NT * p.in) : p.nw;
            if (p.in <= 4 * nv) { /* the row's values are still in v: only the weights are read (+0.6%) */
                float wv[4][4];
#pragma unroll
                for (int q = 0; q < 4; q++)
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        int vw = warp + 8 * k, i = q * nv + vw * 32 + lane;
                        wv[q][k] = vw < nvw && i < p.in ? nw[i] : 0.0f;
                    }
#pragma unroll
                for (int q = 0; q < 4; q++)
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        int vw = warp + 8 * k, i = q * nv + vw * 32 + lane;
                        if (vw < nvw && i < p.in) xs[(size_t)t * p.in + i] = rms_out(wv[q][k], v[q][k], inv);
                    }
            } else {
#pragma unroll 4
                for (int i = tid; i < p.in; i += BT) xs[(size_t)t * p.in + i] = rms_out(nw[i], xr[i], inv);
            }
        }
        __syncthreads(); /* xs complete; nsh free for the next row */
    }
}

/* LATE (one row of x, G.late): the prologue without its second
 * barrier. xs = bf16(w * x), not bf16(w * (x * inv)); the kernel scales its
 * sums by inv at the end (norm_late_inv), so the GEMV loop starts as soon as
 * xs is in shared memory and the sum of squares' reduction runs after it.
 * The sum of squares is norm_rows' (same order, same inv bits); the outputs
 * differ from the unfused chain by where one bf16 rounding falls (HF's
 * RMSNorm rounds x * inv, then multiplies by w). STG: the weights of this
 * thread's own values staged by norm_stage_late (4-byte copies, visible to
 * the thread after its own wait: no barrier). Ends with a barrier; nsh then
 * holds the virtual warps' sums. */
static __device__ __forceinline__ bool late_stageable(int in) { return in <= 4 * rms_threads(in); }

static __device__ __forceinline__ void norm_stage_late(const gemv_params &p, uint16_t *xs)
{
    if (!p.nwsm || threadIdx.x >= BT || !late_stageable(p.in)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nv = rms_threads(p.in), nvw = nv / 32;
    float *dst = (float *)(xs + p.in);
#pragma unroll
    for (int q = 0; q < 4; q++)
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int vw = warp + 8 * k, i = q * nv + vw * 32 + lane;
            if (vw < nvw && i < p.in)
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst + i)), "l"(p.nw + i)
                             : "memory");
        }
    cp_async_commit();
}

template <bool STG>
static __device__ __forceinline__ void norm_rows_late(const gemv_params &p, uint16_t *xs, float *nsh)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nv = rms_threads(p.in), nvw = nv / 32;
    if (tid < BT) {
        const float *xr = p.xf;
        float ss[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (late_stageable(p.in)) { /* one round of loads: x, and w beside it */
            const bool stg = STG && p.nwsm;
            const float *nw = stg ? (const float *)(xs + p.in) : p.nw;
            if (stg) cp_async_wait<0>();
            float v[4][4], wv[4][4];
#pragma unroll
            for (int q = 0; q < 4; q++)
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    int vw = warp + 8 * k, i = q * nv + vw * 32 + lane;
                    bool ok = vw < nvw && i < p.in;
                    v[q][k] = ok ? xr[i] : 0.0f;
                    wv[q][k] = ok ? nw[i] : 0.0f;
                }
#pragma unroll
            for (int q = 0; q < 4; q++)
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    ss[k] = rms_acc(ss[k], v[q][k]);
                    int vw = warp + 8 * k, i = q * nv + vw * 32 + lane;
                    if (vw < nvw && i < p.in) xs[i] = f2bf(wv[q][k] * v[q][k]);
                }
        } else { /* norm_rows' loop for the sums, then w * x */
            for (int i0 = 0; i0 < p.in; i0 += 4 * nv) {
                float v[4][4];
#pragma unroll
                for (int q = 0; q < 4; q++)
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        int vw = warp + 8 * k, i = i0 + q * nv + vw * 32 + lane;
                        v[q][k] = vw < nvw && i < p.in ? xr[i] : 0.0f;
                    }
#pragma unroll
                for (int q = 0; q < 4; q++)
#pragma unroll
                    for (int k = 0; k < 4; k++) ss[k] = rms_acc(ss[k], v[q][k]);
            }
#pragma unroll 4
            for (int i = tid; i < p.in; i += BT) xs[i] = f2bf(p.nw[i] * xr[i]);
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float s = warp_sum(ss[k]);
            if (lane == 0 && warp + 8 * k < nvw) nsh[warp + 8 * k] = s;
        }
    }
    __syncthreads(); /* xs and nsh complete */
}

/* LATE: inv from norm_rows_late's sums, as norm_rows computes it (any warp) */
static __device__ __forceinline__ float norm_late_inv(const gemv_params &p, const float *nsh)
{
    const int lane = threadIdx.x & 31, nvw = rms_threads(p.in) / 32;
    return rms_inv(warp_sum(lane < nvw ? nsh[lane] : 0.0f), p.in, p.eps);
}

/* ---- the warp kernel: one row per warp ---- */

/* cuda_gemv_mlp (TAGGED): the gate/up GEMV stores each h[j] as one 32-bit
 * word, the call's tag in the high half and the bf16 in the low half, and
 * the down GEMV, started early, reads each word until it carries the tag.
 * One word is stored and loaded whole (single-copy atomic), so a word with
 * the tag carries this call's value: no counter, no fence. */
static __device__ __forceinline__ void st_relaxed(uint32_t *p, uint32_t v)
{
    asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ uint32_t ld_relaxed(const uint32_t *p)
{
    uint32_t v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
/* The tensor-core kernel's B fragment for one group of 32 columns of x (h)
 * from the tagged words: lane l loaded word c0 + l earlier (w). Lanes load
 * again where the tag is missing until the whole warp has it; then lane q
 * < 4 gets columns 8q ... 8q + 7 as 8 bf16 (two from each even lane) */
static __device__ __forceinline__ uint4 tagged_group(uint32_t w, const uint32_t *hw, int c0, int in, uint32_t tag)
{
    const int lane = threadIdx.x & 31, c = c0 + lane;
    bool ok = c >= in || w >> 16 == tag;
    while (!__all_sync(0xffffffffu, ok))
        if (!ok) {
            __nanosleep(32);
            w = ld_relaxed(hw + c);
            ok = w >> 16 == tag;
        }
    uint32_t v = c < in ? w & 0xffffu : 0u;
    uint32_t pair = v | __shfl_down_sync(0xffffffffu, v, 1) << 16; /* even lanes: columns lane, lane + 1 */
    const int src = 8 * (lane & 3);
    uint4 x;
    x.x = __shfl_sync(0xffffffffu, pair, src), x.y = __shfl_sync(0xffffffffu, pair, src + 2);
    x.z = __shfl_sync(0xffffffffu, pair, src + 4), x.w = __shfl_sync(0xffffffffu, pair, src + 6);
    return x;
}

/* Lane l of a warp takes 16-byte chunks l, l + 32, l + 64, ... of its row(s)
 * and sums them in that order, CH chunks per row requested at a time (the
 * first CH before waiting for the previous kernel: weights only), the next
 * CH requested before the current ones are used. Any CH sums in the same
 * order, so every CH gives the same bits. */
template <int CH, int NR>
struct wchunks {
    uint4 v[NR][CH];
    __device__ __forceinline__ void load(const uint4 *const *w, int i0, int lane, int n4)
    {
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int u = 0; u < CH; u++) {
                int i = i0 + u * 32 + lane;
                v[r][u] = i < n4 ? __ldcs(w[r] + i) : make_uint4(0, 0, 0, 0);
            }
    }
};

/* acc[r][t] += the CH chunks from i0 of rows r times x[t] (x4: [NT][n4]
 * chunks, in shared memory when SMEM) */
template <int CH, int NR, int NT, bool SMEM>
static __device__ __forceinline__ void wdot(const wchunks<CH, NR> &c, const uint4 *x4, int n4, int i0, int lane,
                                            float (&acc)[NR][NT])
{
#pragma unroll
    for (int u = 0; u < CH; u++) {
        int i = i0 + u * 32 + lane;
        if (i >= n4) break;
        float wf[NR][8];
#pragma unroll
        for (int r = 0; r < NR; r++) unpack8(c.v[r][u], wf[r]);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float xf[8];
            unpack8(SMEM ? x4[(size_t)t * n4 + i] : __ldg(x4 + (size_t)t * n4 + i), xf);
#pragma unroll
            for (int r = 0; r < NR; r++)
#pragma unroll
                for (int e = 0; e < 8; e++) acc[r][t] += wf[r][e] * xf[e];
        }
    }
}

/* Warp j of the grid: output row j (EPI_SWIGLU: gate row j and up row
 * out + j side by side, each summed exactly as a lone row, and h[j] =
 * silu(g) * u from the two sums rounded to bf16, as cuda_swiglu over
 * cuda_gemv's output). NORM: x normalized by the whole block first
 * (norm_rows, cuda_add_rmsnorm's bits) into shared memory; XS: x copied
 * into shared memory as it is. Epilogues as in the block kernel. */
template <int NT, int EPI, bool NORM, int CH, bool PAIR = false, bool TAGGED = false, bool XS = false,
          bool LATE = false, bool PERSIST = false>
static __global__ void __launch_bounds__(32 * GEMV_WARPS, PAIR ? 3 : 1) gemv_warp_kernel(const gemv_params p)
{
    /* PERSIST: warp j takes rows j, j + S, j + 2S, ... (S the grid's warps), the
     * next row's first chunks requested with the last ones of the current */
    static_assert(!LATE || (NORM && NT == 1), "LATE: the one-row norm prologue");
    /* PAIR: rows j and p.out + j per warp (outputs 2 p.out), each summed as a lone row */
    constexpr int NR = EPI == EPI_SWIGLU || PAIR ? 2 : 1;
    extern __shared__ uint4 xs4[]; /* NORM: the normalized x, [NT][in] bf16 */
    __shared__ float nsh[32];
    pdl_trigger();
    const int lane = threadIdx.x & 31, j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5), n4 = p.in / 8;
    const bool live = j < p.out;
    const uint4 *w[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) w[r] = (const uint4 *)(p.W + (size_t)(r * p.out + (live ? j : 0)) * p.in);
    wchunks<CH, NR> cur, nxt;
    if (live) cur.load(w, 0, lane, n4);
    if constexpr (NORM && PAIR && LATE) norm_stage_late(p, (uint16_t *)xs4);
    else if constexpr (NORM && PAIR) norm_stage<NT>(p, xs4);
    pdl_wait(); /* from here on, x may be read */
    if constexpr (LATE) norm_rows_late<PAIR>(p, (uint16_t *)xs4, nsh);
    else if constexpr (NORM) norm_rows<NT, PAIR>(p, (uint16_t *)xs4, nsh);
    if constexpr (XS && !NORM) { /* x into shared memory, all of it in one round trip */
        for (int i = threadIdx.x; i < NT * n4; i += 32 * GEMV_WARPS) cp_async16(smem_u32(xs4 + i), (const uint4 *)p.x + i, true);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
    }
    if (!live) return;
    const uint4 *x4 = NORM || XS ? xs4 : (const uint4 *)p.x;
    float inv = 1.0f;
    for (int jr = j;;) {
        const int jn = PERSIST ? jr + (int)gridDim.x * GEMV_WARPS : p.out;
        const bool next = PERSIST && jn < p.out;
        const uint4 *wn[NR];
#pragma unroll
        for (int r = 0; r < NR; r++) wn[r] = (const uint4 *)(p.W + (size_t)(r * p.out + (next ? jn : jr)) * p.in);
        float acc[NR][NT];
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;
        for (int i0 = 0;; i0 += 32 * CH) {
            bool more = i0 + 32 * CH < n4;
            if (more) nxt.load(w, i0 + 32 * CH, lane, n4);
            else if (next) nxt.load(wn, 0, lane, n4);
            wdot<CH, NR, NT, NORM || XS>(cur, x4, n4, i0, lane, acc);
            if (!more) break;
            cur = nxt;
        }
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) acc[r][t] = warp_sum(acc[r][t]);
        if constexpr (LATE) {
            if (jr == j) inv = norm_late_inv(p, nsh);
#pragma unroll
            for (int r = 0; r < NR; r++) acc[r][0] *= inv;
        }
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if constexpr (TAGGED) { /* cuda_gemv_mlp: one token, EPI_SWIGLU */
                    st_relaxed(p.hw + jr, p.tag << 16 | swiglu1(f2bf(acc[0][t]), f2bf(acc[NR - 1][t])));
                } else if constexpr (PAIR) {
                    gemv_store<EPI>(p, (size_t)t * 2 * p.out + jr, acc[0][t], 0.0f);
                    gemv_store<EPI>(p, (size_t)t * 2 * p.out + p.out + jr, acc[1][t], 0.0f);
                } else {
                    gemv_store<EPI>(p, (size_t)t * p.out + jr, acc[0][t], acc[NR - 1][t]);
                }
            }
        }
        if (!next) return;
        jr = jn;
        cur = nxt;
#pragma unroll
        for (int r = 0; r < NR; r++) w[r] = wn[r];
    }
}

/* ---- the block kernel ---- */

/* W row of slot r of group g, or -1 past the end */
template <int RB, int EPI>
static __device__ __forceinline__ int group_row(const gemv_params &p, int g, int r)
{
    if (EPI == EPI_SWIGLU) {
        int j = g * (RB / 2) + (r % (RB / 2));
        return j < p.out ? (r < RB / 2 ? j : p.out + j) : -1;
    }
    int row = g * RB + r;
    return row < p.out ? row : -1;
}

template <int NT, int RB, int UK, int EPI, bool NORM>
static __global__ void __launch_bounds__(BT, 2) gemv_block_kernel(const gemv_params p)
{
    constexpr int C = RB * NT, CP = pow2ceil(C), LOGC = log2i(CP);
    static_assert(CP <= 32 && (EPI != EPI_SWIGLU || RB % 2 == 0), "bad block-kernel shape");
    extern __shared__ uint4 xs4[]; /* NORM: the normalized x, [NT][in] bf16 */
    __shared__ float red[2][BT / 32][CP];
    __shared__ float nsh[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n4 = p.in >> 3;
    const uint4 *W4 = (const uint4 *)p.W;

    pdl_trigger();
    int g = blockIdx.x, kb = 0, par = 0;
    uint4 wv[RB][UK];
    int rows[RB];
    auto load = [&]() {
#pragma unroll
        for (int r = 0; r < RB; r++) {
            rows[r] = group_row<RB, EPI>(p, g, r);
#pragma unroll
            for (int u = 0; u < UK; u++) {
                int idx = kb + u * BT + tid;
                wv[r][u] = rows[r] >= 0 && idx < n4 ? ld_stream(W4 + (size_t)rows[r] * n4 + idx) : make_uint4(0, 0, 0, 0);
            }
        }
    };
    load();
    pdl_wait(); /* from here on, x may be read */

    if (NORM) norm_rows<NT>(p, (uint16_t *)xs4, nsh);

    float acc[RB][NT];
#pragma unroll
    for (int r = 0; r < RB; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;

    for (;;) {
#pragma unroll
        for (int u = 0; u < UK; u++) {
            int idx = kb + u * BT + tid;
            if (idx < n4) {
                float xf[NT][8];
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    uint4 xv = NORM ? xs4[(size_t)t * n4 + idx] : __ldg((const uint4 *)p.x + (size_t)t * n4 + idx);
                    unpack8(xv, xf[t]);
                }
#pragma unroll
                for (int r = 0; r < RB; r++) {
                    float wf[8];
                    unpack8(wv[r][u], wf);
#pragma unroll
                    for (int t = 0; t < NT; t++)
#pragma unroll
                        for (int e = 0; e < 8; e++) acc[r][t] = __fmaf_rn(wf[e], xf[t][e], acc[r][t]);
                }
            }
        }
        const int gd = g;
        kb += BT * UK;
        const bool done = kb >= n4;
        if (done) kb = 0, g += gridDim.x;
        if (g < p.ngroups) load(); /* in flight while this group is reduced */
        if (!done) continue;

        /* reduce group gd: transposing butterfly, so each lane ends with one
         * of the CP values summed over the warp (value lane >> (5 - LOGC)) */
        float v[CP];
#pragma unroll
        for (int c = 0; c < CP; c++) v[c] = c < C ? acc[c / NT][c % NT] : 0.0f;
#pragma unroll
        for (int k = 0; k < LOGC; k++) {
            const int s = CP >> (k + 1), o = 16 >> k;
            const bool upper = lane & o;
#pragma unroll
            for (int i = 0; i < s; i++) {
                float send = upper ? v[i] : v[i + s], keep = upper ? v[i + s] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        }
#pragma unroll
        for (int o = 16 >> LOGC; o; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
        if ((lane & ((32 >> LOGC) - 1)) == 0) red[par][warp][lane >> (5 - LOGC)] = v[0];
        __syncthreads(); /* red[par] is next written two groups on, after another barrier */
        if (EPI == EPI_SWIGLU) {
            if (tid < C / 2) {
                float sg = 0.0f, su = 0.0f;
#pragma unroll
                for (int w = 0; w < BT / 32; w++) sg += red[par][w][tid], su += red[par][w][tid + C / 2];
                int j = gd * (RB / 2) + tid / NT, t = tid % NT;
                if (j < p.out) gemv_store<EPI>(p, (size_t)t * p.out + j, sg, su); /* as cuda_swiglu over gate|up */
            }
        } else if (tid < C) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < BT / 32; w++) s += red[par][w][tid];
            int row = gd * RB + tid / NT, t = tid % NT;
            if (row < p.out) gemv_store<EPI>(p, (size_t)t * p.out + row, s, s);
        }
        par ^= 1;
        if (g >= p.ngroups) break;
#pragma unroll
        for (int r = 0; r < RB; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;
    }
}

/* ---- the tensor-core kernel (variant "mma") ---- */

/* A block of MW warps takes 16 rows (16 gate and 16 up rows for SwiGLU)
 * and every row of x (up to 8), and its warps split K: warp w
 * takes the groups of 32 columns w, w + MW, ... One group is two
 * mma.m16n8k16 (bf16 in, f32 accumulate) with no unpacking: lane l (rows
 * r = l / 4 and r + 8, quad position q = l % 4) loads the 16 bytes of
 * columns 8q .. 8q + 7 of each of its two rows, and the MMAs' k slots are a
 * fixed permutation of those columns: the first MMA takes columns 8q .. 8q
 * + 3 (slots 2q, 2q + 1 and 2q + 8, 2q + 9: A registers .x and .y of the
 * two rows), the second 8q + 4 .. 8q + 7 (.z and .w). The lanes of column
 * (token) t = l / 4 < NT load x's same 16 bytes for B; the other columns
 * are zero. U groups are requested at a time, the next U before the
 * current ones are used; the first U before waiting for the previous
 * kernel (weights only). The warps' accumulators are summed in warp order
 * through shared memory. So the sums' order depends only on in, and not on
 * T or the other rows: every fusion is bit for bit the unfused kernels.
 * MW = 16 warps a block, UU = 2 groups in flight for a row (SwiGLU's two
 * rows share them): with 64 registers, 2048 threads an SM (8 warps, or 4
 * groups, measured slower). The norm
 * prologue runs on the first 256 threads. Against the persistent block
 * kernel at 2-4 rows of x, this does no unpacking and no shuffles, and its
 * cost hardly grows with T: it takes up to 8 rows (the B operand's 8
 * columns), where the other kernels take 4. */
static __device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                       uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int U, int NR>
struct mchunks {
    uint4 v[U][NR][2];
};

template <int NT, int EPI, bool NORM, bool TAGGED = false>
static __global__ void __launch_bounds__(32 * MW, 1024 / (32 * MW)) gemv_mma_kernel(const gemv_params p)
{
    constexpr int NR = EPI == EPI_SWIGLU ? 2 : 1, U = UU / NR;
    static_assert(MW >= 8 && U >= 1 && NT <= 8, "norm_rows needs 256 threads; B has 8 columns");
    extern __shared__ uint4 xs4[]; /* NORM: the normalized x, [NT][in] bf16 */
    __shared__ float nsh[32];
    __shared__ float4 red[MW][NR][32];
    pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rq = lane >> 2, q = lane & 3;
    const int n4 = p.in / 8, ng = (n4 + 3) / 4, row0 = blockIdx.x * 16;
    const int K = ((ng + MW - 1) / MW + U - 1) / U; /* steps of U groups, the same for every warp */
    const uint4 *w[NR][2];
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int row = min(row0 + rq + 8 * h, p.out - 1);
            w[r][h] = (const uint4 *)(p.W + (size_t)(r * p.out + row) * p.in) + q;
        }
    auto load = [&](mchunks<U, NR> &b, int s) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int g = warp + MW * (s * U + u);
            bool ok = g * 4 + q < n4;
#pragma unroll
            for (int r = 0; r < NR; r++)
#pragma unroll
                for (int h = 0; h < 2; h++) b.v[u][r][h] = ok ? __ldcs(w[r][h] + g * 4) : make_uint4(0, 0, 0, 0);
        }
    };
    mchunks<U, NR> cur, nxt;
    load(cur, 0);
    if (!TAGGED) pdl_wait(); /* from here on, x may be read (TAGGED: each word once it carries the tag) */
    if (NORM) norm_rows<NT>(p, (uint16_t *)xs4, nsh);
    const uint4 *x4 = NORM ? xs4 : (const uint4 *)p.x;
    float acc[NR][4];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.0f;
    /* TAGGED (one token): the words of x (h) a step ahead, like the weights */
    uint32_t xc[U], xn[U]; /* lane l: word 32 g + l of group g */
    auto xload = [&](uint32_t (&b)[U], int s) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = 32 * (warp + MW * (s * U + u)) + lane;
            if (c < p.in) b[u] = ld_relaxed(p.hw + c);
        }
    };
    if constexpr (TAGGED) xload(xc, 0);
    for (int s = 0; s < K; s++) {
        if (s + 1 < K) load(nxt, s + 1);
        if constexpr (TAGGED)
            if (s + 1 < K) xload(xn, s + 1);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = (warp + MW * (s * U + u)) * 4 + q;
            uint4 xv = make_uint4(0, 0, 0, 0);
            if constexpr (TAGGED) { /* one token: lanes 0-3 */
                uint4 g = tagged_group(xc[u], p.hw, 32 * (warp + MW * (s * U + u)), p.in, p.tag);
                if (rq == 0) xv = g;
            } else if (rq < NT && i < n4) {
                xv = NORM ? x4[(size_t)rq * n4 + i] : __ldg(x4 + (size_t)rq * n4 + i);
            }
#pragma unroll
            for (int r = 0; r < NR; r++) {
                const uint4 &a = cur.v[u][r][0], &b = cur.v[u][r][1];
                mma_bf16_16816(acc[r], a.x, b.x, a.y, b.y, xv.x, xv.y);
                mma_bf16_16816(acc[r], a.z, b.z, a.w, b.w, xv.z, xv.w);
            }
        }
        cur = nxt;
        if constexpr (TAGGED)
#pragma unroll
            for (int u = 0; u < U; u++) xc[u] = xn[u];
    }
#pragma unroll
    for (int r = 0; r < NR; r++) red[warp][r][lane] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    __syncthreads();
    if (warp) return;
    if constexpr (TAGGED) pdl_wait(); /* a kernel's completion still implies its predecessors' */
    /* lane: rows row0 + rq (.x, .y) and row0 + rq + 8 (.z, .w), tokens 2q and 2q + 1 */
    float4 sm[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) {
        sm[r] = red[0][r][lane];
#pragma unroll
        for (int v = 1; v < MW; v++) {
            float4 o = red[v][r][lane];
            sm[r].x += o.x, sm[r].y += o.y, sm[r].z += o.z, sm[r].w += o.w;
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int j = row0 + rq + 8 * h, t = 2 * q + e;
            if (j >= p.out || t >= NT) continue;
            float a0 = h ? (e ? sm[0].w : sm[0].z) : (e ? sm[0].y : sm[0].x);
            float a1 = h ? (e ? sm[NR - 1].w : sm[NR - 1].z) : (e ? sm[NR - 1].y : sm[NR - 1].x);
            gemv_store<EPI>(p, (size_t)t * p.out + j, a0, a1);
        }
}

/* ---- launch ---- */

static struct gemv_state {
    int variant, nsm, ch;
    bool pdl, late, persist;
} G;

static int sm_major(void)
{
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    return major;
}

/* the defaults (the top of the file), set at the first call */
static const gemv_state &state(void)
{
    static bool once = [] {
        G.variant = 3;
        G.ch = 4;
        int dev = 0;
        G.nsm = 132;
        if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&G.nsm, cudaDevAttrMultiProcessorCount, dev);
        G.pdl = sm_major() >= 9;
        G.late = true;
        G.persist = true;
        return true;
    }();
    (void)once;
    return G;
}

bool cuda_pdl_on(void) { return state().pdl; }

extern "C" void cuda_gemv_select(int variant, int pdl, int ch)
{
    state();
    if (variant >= 0 && variant <= 4) G.variant = variant;
    if (pdl >= 0) G.pdl = pdl && sm_major() >= 9;
    if (ch == 4 || ch == 8 || ch == 16) G.ch = ch;
}

extern "C" void cuda_gemv_late(int on)
{
    state();
    G.late = on != 0;
}

extern "C" void cuda_gemv_persist(int on)
{
    state();
    G.persist = on != 0;
}

/* blocks of a kernel resident per SM, asked once per kernel */
template <typename K>
static int resident(K k, int threads, size_t smem)
{
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, threads, smem) == cudaSuccess && n > 0 ? n : 1;
}

template <typename... A>
static cudaError_t launch_k(void (*k)(A...), int grid, int threads, size_t smem, cudaStream_t st, A... args)
{
    return pdl_launch(k, dim3(grid), dim3(threads), smem, st, args...);
}

/* chunks per lane in flight in the warp kernels: G.ch for rows of <= 4096
 * (4, or what cuda_gemv_select set), 4 for longer ones */
static int warp_ch(int in) { return in <= 4096 ? state().ch : 4; }

/* the warp kernel at T rows */
template <int EPI, bool NORM, int CH, bool XS>
static cudaError_t launch_warp_t(const gemv_params &p, int T, int grid, size_t smem, cudaStream_t st)
{
    const int th = 32 * GEMV_WARPS;
    if constexpr (NORM)
        if (T == 1 && state().late) /* the norm's scale on the sums (norm_rows_late) */
            return launch_k(gemv_warp_kernel<1, EPI, NORM, CH, false, false, XS, true>, grid, th, smem, st, p);
    switch (T) {
    case 1: return launch_k(gemv_warp_kernel<1, EPI, NORM, CH, false, false, XS>, grid, th, smem, st, p);
    case 2: return launch_k(gemv_warp_kernel<2, EPI, NORM, CH, false, false, XS>, grid, th, smem, st, p);
    case 3: return launch_k(gemv_warp_kernel<3, EPI, NORM, CH, false, false, XS>, grid, th, smem, st, p);
    case 4: return launch_k(gemv_warp_kernel<4, EPI, NORM, CH, false, false, XS>, grid, th, smem, st, p);
    default: return cudaErrorInvalidValue;
    }
}

template <int EPI, bool NORM, int CH>
static cudaError_t launch_warp1(const gemv_params &p, int T, cudaStream_t st)
{
    int grid = (p.out + GEMV_WARPS - 1) / GEMV_WARPS, th = 32 * GEMV_WARPS;
    size_t smem = NORM ? (size_t)T * p.in * 2 : 0;
    /* the one-token norm GEMV (qkv) two rows a warp, 3 blocks an SM: its
     * 6144 rows (Llama-8B) in one wave instead of 1.45 */
    if constexpr (EPI == EPI_BF16 && NORM && CH == 4)
        if (T == 1 && p.out % 2 == 0) {
            gemv_params q = p;
            q.out = p.out / 2;
            /* its norm weights staged in shared memory (norm_stage) where they fit */
            q.nwsm = (uintptr_t)p.nw % 16 == 0 && (size_t)p.in * 6 + 1024 <= CUDA_GEMV_NORM_SMEM;
            const int g = (q.out + GEMV_WARPS - 1) / GEMV_WARPS;
            const size_t sm = smem + (q.nwsm ? (size_t)p.in * 4 : 0);
            if (state().late) return launch_k(gemv_warp_kernel<1, EPI, NORM, CH, true, false, false, true>, g, th, sm, st, q);
            return launch_k(gemv_warp_kernel<1, EPI, NORM, CH, true>, g, th, sm, st, q);
        }
    if constexpr (!NORM)
        if ((size_t)T * p.in * 2 <= 32768) /* x into shared memory (XS) */
            return launch_warp_t<EPI, NORM, CH, true>(p, T, grid, (size_t)T * p.in * 2, st);
    return launch_warp_t<EPI, NORM, CH, false>(p, T, grid, smem, st);
}

/* chunks in flight: warp_ch(in) per row (two rows per warp for SwiGLU: at
 * most 8 of each) */
template <int EPI, bool NORM>
static cudaError_t launch_warp(const gemv_params &p, int T, cudaStream_t st)
{
    int ch = warp_ch(p.in);
    if constexpr (EPI != EPI_SWIGLU)
        if (ch == 16) return launch_warp1<EPI, NORM, 16>(p, T, st);
    return ch >= 8 ? launch_warp1<EPI, NORM, 8>(p, T, st) : launch_warp1<EPI, NORM, 4>(p, T, st);
}

/* the kernel at T rows, its dynamic shared memory allowed up to
 * CUDA_GEMV_NORM_SMEM on top of its static reduction buffer (once) */
template <int NT, int EPI, bool NORM>
static cudaError_t launch_mma_t(const gemv_params &p, int grid, size_t smem, cudaStream_t st)
{
    static const cudaError_t set =
        NORM ? cudaFuncSetAttribute(gemv_mma_kernel<NT, EPI, NORM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    CUDA_GEMV_NORM_SMEM)
             : cudaSuccess;
    if (set != cudaSuccess) return set;
    return launch_k(gemv_mma_kernel<NT, EPI, NORM>, grid, 32 * MW, smem, st, p);
}
template <int EPI, bool NORM>
static cudaError_t launch_mma(const gemv_params &p, int T, cudaStream_t st)
{
    int grid = (p.out + 15) / 16;
    size_t smem = NORM ? (size_t)T * p.in * 2 : 0;
    switch (T) {
    case 1: return launch_mma_t<1, EPI, NORM>(p, grid, smem, st);
    case 2: return launch_mma_t<2, EPI, NORM>(p, grid, smem, st);
    case 3: return launch_mma_t<3, EPI, NORM>(p, grid, smem, st);
    case 4: return launch_mma_t<4, EPI, NORM>(p, grid, smem, st);
    case 5: return launch_mma_t<5, EPI, NORM>(p, grid, smem, st);
    case 6: return launch_mma_t<6, EPI, NORM>(p, grid, smem, st);
    case 7: return launch_mma_t<7, EPI, NORM>(p, grid, smem, st);
    case 8: return launch_mma_t<8, EPI, NORM>(p, grid, smem, st);
    default: return cudaErrorInvalidValue;
    }
}

/* blocks resident per SM for one instantiation, asked once */
template <int NT, int RB, int UK, int EPI, bool NORM>
static int occupancy(size_t smem)
{
    static int occ = [&] {
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, gemv_block_kernel<NT, RB, UK, EPI, NORM>, BT, smem) !=
                cudaSuccess ||
            n < 1)
            n = 1;
        return n;
    }();
    return occ;
}

template <int NT, int RB, int UK, int EPI, bool NORM>
static cudaError_t launch_block1(gemv_params p, cudaStream_t st)
{
    int per = EPI == EPI_SWIGLU ? RB / 2 : RB;
    p.ngroups = (p.out + per - 1) / per;
    if (p.ngroups == 0) return cudaSuccess;
    size_t smem = NORM ? (size_t)NT * p.in * 2 : 0;
    int wave = occupancy<NT, RB, UK, EPI, NORM>(smem) * state().nsm, grid = p.ngroups;
    if ((state().variant == 2 || (state().variant == 3 && NT >= 2)) && grid > wave) grid = wave;
    if (NORM && grid > 4 * wave) grid = 4 * wave;
    return launch_k(gemv_block_kernel<NT, RB, UK, EPI, NORM>, grid, BT, smem, st, p);
}

/* The shape of a group: in <= 4096 (512 chunks, 2 per thread): RB = 8 rows
 * (4 at T >= 3, for registers); longer rows: RB = 2, up to 8 chunks per
 * thread per batch (in = 14336: 7). */
template <int EPI, bool NORM>
static cudaError_t launch_block(const gemv_params &p, int T, cudaStream_t st)
{
    bool shortk = p.in <= 8 * 2 * BT;
    switch (T * 2 + shortk) {
    case 2: return launch_block1<1, 2, 8, EPI, NORM>(p, st);
    case 3: return launch_block1<1, 8, 2, EPI, NORM>(p, st);
    case 4: return launch_block1<2, 2, 8, EPI, NORM>(p, st);
    case 5: return launch_block1<2, 8, 2, EPI, NORM>(p, st);
    case 6: return launch_block1<3, 2, 8, EPI, NORM>(p, st);
    case 7: return launch_block1<3, 4, 2, EPI, NORM>(p, st);
    case 8: return launch_block1<4, 2, 8, EPI, NORM>(p, st);
    case 9: return launch_block1<4, 4, 2, EPI, NORM>(p, st);
    default: return cudaErrorInvalidValue;
    }
}

static bool bad_shape(const void *W, const void *x, int T, int in, int out)
{
    return T < 1 || T > CUDA_GEMV_MMA_MAX_T || in <= 0 || in % 8 || out < 0 || ((uintptr_t)W | (uintptr_t)x) % 16;
}

/* the warp kernels: variant "warp", "auto" for one row, and rows shorter
 * than one chunk per thread of a block (they would leave most of it idle) */
static bool use_warp(int T, int in) { return state().variant == 0 || (state().variant == 3 && T == 1) || in < 8 * BT; }
/* the tensor-core kernel: variant "mma", "auto" for 2 rows and more (any
 * in) and for one row of 12288 columns or more, and every variant past
 * CUDA_GEMV_MAX_T rows */
static bool use_mma(int T, int in)
{
    const int min_in = 12288; /* "auto" takes it at one row from here (the down projection) */
    return state().variant == 4 || (state().variant == 3 && (T >= 2 || in >= min_in)) || T > CUDA_GEMV_MAX_T;
}

/* every launcher: the tensor-core, warp or block kernel by use_mma and
 * use_warp, so that for the
 * same T and in all of them sum each output in the same order */
template <int EPI, bool NORM>
static cudaError_t launch(const gemv_params &p, int T, cudaStream_t st)
{
    if (p.out == 0) return cudaSuccess;
    if (use_mma(T, p.in)) return launch_mma<EPI, NORM>(p, T, st);
    return use_warp(T, p.in) ? launch_warp<EPI, NORM>(p, T, st) : launch_block<EPI, NORM>(p, T, st);
}

extern "C" cudaError_t cuda_gemv(const uint16_t *W, const uint16_t *x, void *y, bool y_f32, int T, int in, int out,
                                 cudaStream_t st)
{
    if (bad_shape(W, x, T, in, out)) return cudaErrorInvalidValue;
    gemv_params p = {W, x, NULL, NULL, 0.0f, y, in, out, 0, NULL, 0, false};
    return y_f32 ? launch<EPI_F32, false>(p, T, st) : launch<EPI_BF16, false>(p, T, st);
}

extern "C" cudaError_t cuda_gemv_residual(const uint16_t *W, const uint16_t *x, float *xres, int T, int in, int out,
                                          cudaStream_t st)
{
    if (bad_shape(W, x, T, in, out)) return cudaErrorInvalidValue;
    gemv_params p = {W, x, NULL, NULL, 0.0f, xres, in, out, 0, NULL, 0, false};
    return launch<EPI_RESID, false>(p, T, st);
}

extern "C" cudaError_t cuda_gemv_swiglu(const uint16_t *Wgu, const uint16_t *x, uint16_t *h, int T, int in, int F,
                                        cudaStream_t st)
{
    if (bad_shape(Wgu, x, T, in, F)) return cudaErrorInvalidValue;
    gemv_params p = {Wgu, x, NULL, NULL, 0.0f, h, in, F, 0, NULL, 0, false};
    return launch<EPI_SWIGLU, false>(p, T, st);
}

static bool bad_norm(const void *W, const float *x, int T, int in)
{
    return bad_shape(W, NULL, T, in, 0) || (uintptr_t)x % 4 || (size_t)T * in * 2 > CUDA_GEMV_NORM_SMEM;
}

extern "C" cudaError_t cuda_gemv_rmsnorm(const uint16_t *W, const float *x, const float *nw, float eps, uint16_t *y,
                                         int T, int in, int out, cudaStream_t st)
{
    if (bad_norm(W, x, T, in) || out < 0) return cudaErrorInvalidValue;
    gemv_params p = {W, NULL, x, nw, eps, y, in, out, 0, NULL, 0, false};
    return launch<EPI_BF16, true>(p, T, st);
}

extern "C" cudaError_t cuda_gemv_rmsnorm_swiglu(const uint16_t *Wgu, const float *x, const float *nw, float eps,
                                                uint16_t *h, int T, int in, int F, cudaStream_t st)
{
    if (bad_norm(Wgu, x, T, in) || F < 0) return cudaErrorInvalidValue;
    gemv_params p = {Wgu, NULL, x, nw, eps, h, in, F, 0, NULL, 0, false};
    return launch<EPI_SWIGLU, true>(p, T, st);
}

/* the gate/up GEMV storing tagged words, then the down GEMV reading them
 * as they come (cuda_gemv_mlp) */
static cudaError_t launch_mlp_tagged(const uint16_t *Wgu, const uint16_t *Wd, float *x, const float *nw, float eps,
                                     int E, int F, uint32_t *hw, int tag, cudaStream_t st)
{
    gemv_params gu = {Wgu, NULL, x, nw, eps, NULL, E, F, 0, hw, (uint32_t)tag, false};
    gemv_params dn = {Wd, NULL, NULL, NULL, 0.0f, x, F, E, 0, hw, (uint32_t)tag, false};
    /* the gate/up GEMV on one wave of blocks (G.persist): each block
     * normalizes x once, not once per 8 rows, and its warps go from row to
     * row without a gap (batch-1 decode +1.1%) */
    static const auto kp = gemv_warp_kernel<1, EPI_SWIGLU, true, 4, false, true, false, true, true>;
    /* asked once, at the first call's E: registers bind it (2 an SM on sm_89
     * and sm_90) for any E the prologue takes (E * 2 <= CUDA_GEMV_NORM_SMEM);
     * a smaller grid would still be right, only slower. (Asked at the 48 KB
     * bound the query fails, the static shared memory on top, and 1 an SM
     * ran batch-1 decode at 221 tok/s) */
    static const int per_sm = resident(kp, 32 * GEMV_WARPS, (size_t)E * 2);
    const int th = 32 * GEMV_WARPS, rows = F / GEMV_WARPS, pg = per_sm * state().nsm;
    const size_t sm = (size_t)E * 2;
    cudaError_t e;
    if (state().late && state().persist && pg < rows)
        e = launch_k(kp, pg, th, sm, st, gu);
    else if (state().late)
        e = launch_k(gemv_warp_kernel<1, EPI_SWIGLU, true, 4, false, true, false, true>, rows, th, sm, st, gu);
    else
        e = launch_k(gemv_warp_kernel<1, EPI_SWIGLU, true, 4, false, true>, rows, th, sm, st, gu);
    return e != cudaSuccess ? e : launch_k(gemv_mma_kernel<1, EPI_RESID, false, true>, (E + 15) / 16, 32 * MW, 0, st, dn);
}

/* whether cuda_gemv_mlp overlaps the two GEMVs: one token, the warp kernel
 * (4 chunks in flight) for gate/up, the tensor-core kernel for down */
extern "C" bool cuda_gemv_mlp_tagged(int T, int E, int F)
{
    return T == 1 && state().variant == 3 && use_warp(1, E) && !use_mma(1, E) && warp_ch(E) == 4 &&
           use_mma(1, F) && F % GEMV_WARPS == 0;
}

extern "C" cudaError_t cuda_gemv_mlp(const uint16_t *Wgu, const uint16_t *Wd, float *x, const float *nw, float eps,
                                     uint16_t *h, int T, int E, int F, uint32_t *hw, int tag, cudaStream_t st)
{
    if (bad_norm(Wgu, x, T, E) || bad_shape(Wd, h, T, F, E) || F < 0) return cudaErrorInvalidValue;
    if (hw && tag > 0 && tag < 65536 && (uintptr_t)hw % 4 == 0 && cuda_gemv_mlp_tagged(T, E, F))
        return launch_mlp_tagged(Wgu, Wd, x, nw, eps, E, F, hw, tag, st);
    cudaError_t e = cuda_gemv_rmsnorm_swiglu(Wgu, x, nw, eps, h, T, E, F, st);
    return e != cudaSuccess ? e : cuda_gemv_residual(Wd, h, x, T, F, E, st);
}
