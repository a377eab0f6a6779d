/* tp.cu - the kernels tensor parallelism adds (kernels.h): the vocabulary-
 * sharded embedding gather, the f32 -> bf16 conversion after an NCCL
 * all-reduce, the one-shot all-reduce over peer memory that replaces both
 * for decode-sized sums, and the distributed argmax (each rank reduces its slice of the vocabulary
 * to (max, sum of exp, argmax); after an all-gather every rank combines the
 * same partials in the same order, so all ranks agree on the token). */
#include "cuda/bf16.cuh"
#include "cuda/kernels.h"
#include "cuda/pdl.cuh"

static __global__ void embed_shard_kernel(const uint16_t *tab, const int32_t *ids, int E, int v0, int vn, float *x)
{
    int t = blockIdx.x, id = ids[t] - v0;
    float *xr = x + (size_t)t * E;
    if (id < 0 || id >= vn) {
        for (int i = threadIdx.x; i < E; i += blockDim.x) xr[i] = 0.0f;
        return;
    }
    const uint16_t *row = tab + (size_t)id * E;
    for (int i = threadIdx.x; i < E; i += blockDim.x) xr[i] = bf2f(row[i]);
}

extern "C" cudaError_t cuda_embed_shard(const uint16_t *tab, const int32_t *ids, int T, int E, int v0, int vn,
                                        float *x, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    embed_shard_kernel<<<T, 256, 0, st>>>(tab, ids, E, v0, vn, x);
    return cudaGetLastError();
}

static __global__ void f32_to_bf16_kernel(const float *src, size_t n, uint16_t *dst)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = f2bf(src[i]);
}

extern "C" cudaError_t cuda_f32_to_bf16(const float *src, size_t n, uint16_t *dst, cudaStream_t st)
{
    if (!n) return cudaSuccess;
    size_t blocks = (n + 255) / 256;
    f32_to_bf16_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, st>>>(src, n, dst);
    return cudaGetLastError();
}

/* ---- the one-shot all-reduce over peer memory (kernels.h) ---- */

static __device__ __forceinline__ void st_release_sys(unsigned *p, unsigned v)
{
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ unsigned ld_acquire_sys(const unsigned *p)
{
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* Block b's thread 0 counts this call (epoch[b]), tells every peer that this
 * rank's src is complete (flags[p][b][rank] = e: the kernel before this one
 * wrote it), and waits until every peer's flags[rank][b][p] has reached e.
 * A peer is never more than one call ahead (it would need this rank's
 * next signal), so "reached" is a wrap-safe difference. Then the block sums
 * its share of the elements over the ranks in rank order, bypassing L1. */
static __global__ void peer_ar_kernel(const cuda_peer_ar a, size_t n, uint16_t *ob, float *of, bool add)
{
    __shared__ int quit;
    const int b = blockIdx.x;
    pdl_trigger(); /* with PDL on, the next GEMV may load weights while this waits */
    if (threadIdx.x == 0) {
        unsigned e = a.epoch[b] + 1;
        a.epoch[b] = e;
        for (int p = 0; p < a.n_ranks; p++)
            if (p != a.rank) st_release_sys(a.flags[p] + b * CUDA_PEER_MAX + a.rank, e);
        int q = 0;
        for (int p = 0; p < a.n_ranks && !q; p++)
            if (p != a.rank)
                for (unsigned spin = 1; (int)(ld_acquire_sys(a.flags[a.rank] + b * CUDA_PEER_MAX + p) - e) < 0; spin++)
                    if (!(spin & 1023) && *a.abort) { /* host memory: a bus round trip, so not every spin */
                        q = 1;
                        break;
                    }
        quit = q;
    }
    __syncthreads();
    if (quit) return;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if (n % 4 == 0) {
        for (size_t i = (size_t)b * blockDim.x + threadIdx.x; i < n / 4; i += stride) {
            float4 s = __ldcg((const float4 *)a.src[0] + i);
            for (int r = 1; r < a.n_ranks; r++) {
                float4 v = __ldcg((const float4 *)a.src[r] + i);
                s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
            }
            if (add) {
                float4 &x = ((float4 *)of)[i];
                x.x += bf2f(f2bf(s.x)), x.y += bf2f(f2bf(s.y)), x.z += bf2f(f2bf(s.z)), x.w += bf2f(f2bf(s.w));
            } else if (of) {
                ((float4 *)of)[i] = s;
            } else {
                uint2 o;
                o.x = (uint32_t)f2bf(s.x) | (uint32_t)f2bf(s.y) << 16;
                o.y = (uint32_t)f2bf(s.z) | (uint32_t)f2bf(s.w) << 16;
                ((uint2 *)ob)[i] = o;
            }
        }
        return;
    }
    for (size_t i = (size_t)b * blockDim.x + threadIdx.x; i < n; i += stride) {
        float s = __ldcg(a.src[0] + i);
        for (int r = 1; r < a.n_ranks; r++) s += __ldcg(a.src[r] + i);
        if (add)
            of[i] += bf2f(f2bf(s));
        else if (of)
            of[i] = s;
        else
            ob[i] = f2bf(s);
    }
}

extern "C" cudaError_t cuda_peer_allreduce(const struct cuda_peer_ar *a, size_t n, uint16_t *out_bf16,
                                           float *out_f32, bool add, cudaStream_t st)
{
    if (a->n_ranks < 1 || a->n_ranks > CUDA_PEER_MAX || a->rank < 0 || a->rank >= a->n_ranks ||
        !out_bf16 == !out_f32 || (add && !out_f32))
        return cudaErrorInvalidValue;
    if (!n) return cudaSuccess;
    size_t units = n % 4 == 0 ? n / 4 : n, blocks = (units + 255) / 256;
    if (blocks > CUDA_PEER_BLOCKS) blocks = CUDA_PEER_BLOCKS;
    peer_ar_kernel<<<(unsigned)blocks, 256, 0, st>>>(*a, n, out_bf16, out_f32, add);
    return cudaGetLastError();
}

/* One block per (row, slice of `chunk` logits): (value desc, id asc) argmax,
 * then the sum of exp below the slice's max. Ids are global (v0 + local);
 * part is slice-major ([slice][row]), so slices combine like ranks. */
static __global__ void argmax_part_kernel(const float *logits, int vn, int v0, int chunk,
                                          struct cuda_argmax_part *part)
{
    __shared__ float shv[32];
    __shared__ int shi[32];
    __shared__ float sh[32];
    const float *row = logits + (size_t)blockIdx.x * vn;
    int lo = blockIdx.y * chunk, hi = lo + chunk < vn ? lo + chunk : vn;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    bool nan = false;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = row[i];
        if (isnan(v)) nan = true;
        if (v > best) best = v, bi = i;
    }
    block_argmax(&best, &bi, shv, shi);
    float mx = best;
    int am = bi;
    float s = 0.0f;
    if (mx > -INFINITY)
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) s += __expf(row[i] - mx);
    s = block_sum(s, sh);
    int anynan = __syncthreads_or(nan);
    if (threadIdx.x == 0) {
        struct cuda_argmax_part p;
        p.max = mx;
        p.sum = s;
        p.id = anynan || mx == INFINITY ? -1 : mx == -INFINITY ? -2 : v0 + am;
        p.pad = 0;
        part[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = p;
    }
}

extern "C" cudaError_t cuda_argmax_part(const float *logits, int R, int vn, int v0, struct cuda_argmax_part *part,
                                        cudaStream_t st)
{
    return cuda_argmax_slices(logits, R, vn, v0, 1, part, st);
}

extern "C" cudaError_t cuda_argmax_slices(const float *logits, int R, int vn, int v0, int ns,
                                          struct cuda_argmax_part *part, cudaStream_t st)
{
    if (R <= 0) return cudaSuccess;
    if (ns < 1 || ns > vn) return cudaErrorInvalidValue;
    int chunk = (vn + ns - 1) / ns;
    argmax_part_kernel<<<dim3(R, ns), ns > 1 ? 512 : 1024, 0, st>>>(logits, vn, v0, chunk, part);
    return cudaGetLastError();
}

/* One thread per row; ranks are visited in vocabulary order, so the lowest
 * id wins a tie between ranks as it does inside one. */
static __global__ void argmax_combine_kernel(const struct cuda_argmax_part *parts, int N, int R, int32_t *tok,
                                             float *logprob)
{
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= R) return;
    float M = -INFINITY;
    int id = -2;
    bool bad = false;
    for (int k = 0; k < N; k++) {
        struct cuda_argmax_part p = parts[(size_t)k * R + r];
        if (p.id == -1) bad = true;
        if (p.id >= 0 && (id < 0 || p.max > M)) M = p.max, id = p.id;
    }
    float S = 0.0f;
    for (int k = 0; k < N; k++) {
        struct cuda_argmax_part p = parts[(size_t)k * R + r];
        if (p.id >= 0) S += p.sum * __expf(p.max - M);
    }
    bad = bad || id < 0;
    tok[r] = bad ? -1 : id;
    logprob[r] = bad ? NAN : -logf(S);
}

extern "C" cudaError_t cuda_argmax_combine(const struct cuda_argmax_part *parts, int N, int R, int32_t *tok,
                                           float *logprob, cudaStream_t st)
{
    if (R <= 0) return cudaSuccess;
    argmax_combine_kernel<<<(R + 127) / 128, 128, 0, st>>>(parts, N, R, tok, logprob);
    return cudaGetLastError();
}
