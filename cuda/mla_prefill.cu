/* mla_prefill.cu - MLA's absorbed attention on the tensor cores, for
 * prefill chunks (mla.h: cuda_mla_prefill; mla_kern.cu's attn_kernel is
 * the SIMT one for decode steps, and the reference this one is tested
 * against beside the plain-C one in tests/gpu/test_mla.c).
 *
 * The absorbed attention is multi-query attention: every head of a token
 * scores the same paged entries [latent C | rope key R] (a KD = C + R wide
 * key) and sums the same latents (a C wide value). So a block's query rows
 * are BM consecutive (token, head) pairs of the step (row = t H + h, as
 * qlat and olat lay them out), which read one tile of keys together:
 *
 *   - the block's queries, [qlat | rotated q_rope] rounded to bf16, stay in
 *     shared memory ([BM][KD + 8]: too wide for registers);
 *   - keys come PBN at a time through the token's block table by cp.async
 *     into [PBN][KD + 8] bf16 rows (fp8 e4m3 entries land as bytes and are
 *     widened to bf16, which holds every e4m3 value exactly), zeros past
 *     the sequence's last key; two stages where shared memory allows (the
 *     next tile's copy under this tile's math), one on sm_89;
 *   - warps form row groups of 16 rows; the PCG warps of a group split S =
 *     Q K^T by keys (16 each, mma.sync m16n8k16 bf16 -> f32, ldmatrix) and
 *     O += P V by the value's columns (C / PCG each, so the accumulators fit
 *     in registers), exchanging row maxima and P (bf16) through shared memory;
 *   - the causal mask by position (key j <= pos[t]), the softmax online in
 *     f32 (exp2 with the scale folded in), O / l to olat as bf16.
 *
 * Tokens of different sequences can share a block (a step's tokens come a
 * sequence at a time; a block holds BM / H of them): the block walks the
 * keys of each sequence among its tokens in turn, and a row takes keys only
 * while its own sequence's are loaded. With the DSA indexer's choice (sel)
 * the block walks each token's chosen keys in turn the same way (the keys
 * gathered through sel, so the attention is over exactly the chosen set;
 * at 64 heads a block is one token). Nothing depends on the host but T:
 * graph-safe. */
#include <math.h>
#include <stdint.h>

#include "cuda/bf16.cuh"
#include "cuda/mla.h"
#include "cuda/tile.cuh"
#include "cuda/tuning.h"

#define PC 512         /* the latent width the kernel takes (C) */
#define PBN 32         /* keys a tile */
#define PCG 2          /* warps of a row group: halves of a tile's keys in S, of the value's columns in O */
#define PP (PBN + 8)   /* P's row pitch in bf16: 80 bytes, 8 rows on distinct banks for ldmatrix */
#define PRMAX 64       /* the rope part the kernel takes at most (the shared memory sizes below) */

static __device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t r[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
static __device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t r[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
/* c += a (16x16 row-major bf16) * b (16x8 col-major bf16), f32 accumulate */
static __device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Dynamic shared memory of a block of BM rows with NST key stages, keys KD
 * wide: Q [BM][KD + 8] bf16, the stages [NST][PBN][KD + 8] bf16, P [BM][PP]
 * bf16, the row exchange [PCG][BM] f32, then (fp8) the stages' bytes
 * [NST][PBN][KD]. Every part a multiple of 16 bytes (KD % 16 == 0). */
static __host__ __device__ constexpr size_t pf_smem(int BM, int NST, int KD, bool kv8)
{
    return (size_t)BM * (KD + 8) * 2 + (size_t)NST * PBN * (KD + 8) * 2 + (size_t)BM * PP * 2 + (size_t)PCG * BM * 4 +
           (kv8 ? (size_t)NST * PBN * KD : 0);
}

/* Keys k0 .. k0 + PBN - 1 (key i at position keys[i], or i where keys is
 * NULL) of the sequence whose block table is bt, zeros past key kmax, by
 * cp.async: bf16 entries straight into the stage's rows ks, e4m3 bytes into
 * raw [PBN][KD]. Commits nothing. */
template <int NTHR>
static __device__ __forceinline__ void pf_load(const struct cuda_mla_attn_args &a, const int32_t *bt,
                                               const int32_t *keys, int k0, int kmax, int KD, uint16_t *ks,
                                               uint8_t *raw)
{
    const int bs = a.block_size, DP = KD + 8;
    if (a.kv8) {
        const int cpk = KD / 16; /* 16-byte chunks of a key */
        for (int i = threadIdx.x; i < PBN * cpk; i += NTHR) {
            int j = i / cpk, c = i - j * cpk, kp = k0 + j;
            bool ok = kp <= kmax;
            const uint8_t *src = (const uint8_t *)a.cache;
            if (ok) {
                if (keys) kp = keys[kp];
                src += ((size_t)bt[kp / bs] * bs + kp % bs) * a.W + (size_t)c * 16;
            }
            cp_async16(smem_u32(raw + j * KD + c * 16), src, ok);
        }
    } else {
        const int cpk = KD / 8;
        for (int i = threadIdx.x; i < PBN * cpk; i += NTHR) {
            int j = i / cpk, c = i - j * cpk, kp = k0 + j;
            bool ok = kp <= kmax;
            const uint16_t *src = (const uint16_t *)a.cache;
            if (ok) {
                if (keys) kp = keys[kp];
                src += ((size_t)bt[kp / bs] * bs + kp % bs) * a.W + (size_t)c * 8;
            }
            cp_async16(smem_u32(ks + j * DP + c * 8), src, ok);
        }
    }
}

/* The stage's e4m3 bytes raw widened into its bf16 rows ks (exact). */
template <int NTHR>
static __device__ __forceinline__ void pf_widen(const uint8_t *raw, uint16_t *ks, int KD)
{
    const int cpk = KD / 16, DP = KD + 8;
    for (int i = threadIdx.x; i < PBN * cpk; i += NTHR) {
        int j = i / cpk, c = i - j * cpk;
        uint4 v = *(const uint4 *)(raw + j * KD + c * 16);
        const uint16_t *h = (const uint16_t *)&v;
        uint4 lo = make_uint4(e4m3x2_to_bf2(h[0]), e4m3x2_to_bf2(h[1]), e4m3x2_to_bf2(h[2]), e4m3x2_to_bf2(h[3]));
        uint4 hi = make_uint4(e4m3x2_to_bf2(h[4]), e4m3x2_to_bf2(h[5]), e4m3x2_to_bf2(h[6]), e4m3x2_to_bf2(h[7]));
        *(uint4 *)(ks + j * DP + c * 16) = lo;
        *(uint4 *)(ks + j * DP + c * 16 + 8) = hi;
    }
}

/* Block b takes rows [r0, r0 + BM) of the step's T H rows, r0 = (the b-th
 * block from the last) BM: the last rows see the most keys, so they start
 * first. Warp w is row group w / PCG (16 rows), part w % PCG: keys
 * [16 part, 16 part + 16) of each tile in S, value columns [part C / PCG,
 * ...) in O. */
template <int RG, int NST>
static __global__ void __launch_bounds__(32 * RG * PCG, 1) prefill_kernel(struct cuda_mla_attn_args a)
{
    constexpr int BM = 16 * RG, NTHR = 32 * RG * PCG, DT = PC / 8 / PCG; /* DT: O's n-tiles a warp */
    static_assert(PBN == 16 * PCG, "a warp scores 16 keys of a tile (two n-tiles)");
    extern __shared__ uint4 pf_smem4[];
    const int H = a.H, KD = PC + a.R, DP = KD + 8, Dq = a.Dn + a.R, NR = a.T * H;
    const int r0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BM, nr = NR - r0 < BM ? NR - r0 : BM;
    uint16_t *qs = (uint16_t *)pf_smem4;
    uint16_t *ks0 = qs + BM * DP;
    uint16_t *ps = ks0 + NST * PBN * DP;
    float *red = (float *)(ps + BM * PP);
    uint8_t *raw0 = (uint8_t *)(red + PCG * BM);
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, rg = w / PCG, cg = w % PCG;

    /* the queries as bf16 rows [qlat | q_rope], zeros past the step's rows */
    for (int i = tid; i < BM * (KD / 2); i += NTHR) {
        int r = i / (KD / 2), c = 2 * (i - r * (KD / 2));
        float x0 = 0.0f, x1 = 0.0f;
        if (r < nr) {
            size_t row = (size_t)r0 + r;
            if (c < PC) {
                float2 v = *(const float2 *)(a.qlat + row * PC + c);
                x0 = v.x, x1 = v.y;
            } else {
                const float *qr = a.q + row * Dq + a.Dn + (c - PC);
                x0 = qr[0], x1 = qr[1];
            }
        }
        *(uint32_t *)(qs + r * DP + c) = pack_bf2(x0, x1);
    }

    /* this lane's two rows (of the C fragments) and their tokens (-1: past the step's rows) */
    const int rw0 = rg * 16 + (lane >> 2), rw1 = rw0 + 8;
    const int tk0 = rw0 < nr ? (r0 + rw0) / H : -1, tk1 = rw1 < nr ? (r0 + rw1) / H : -1;
    const int tA = r0 / H, tB = (r0 + nr - 1) / H;
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f; /* m in log2 units; l this warp's keys only */
    const float sl2 = a.scale * 1.4426950408889634f;
    /* per-lane ldmatrix addresses: Q's and P's A fragments (rows of the group), K's B fragments
     * (keys 0-7 / 8-15 at dims 0 / 8 of a chunk), V's (keys 0-15 at columns 0 / 8, transposed) */
    const uint32_t qb = smem_u32(qs + (rg * 16 + (lane & 15)) * DP + (lane >> 4) * 8);
    const uint32_t pb = smem_u32(ps + (rg * 16 + (lane & 15)) * PP + (lane >> 4) * 8);
    const int kofs = (cg * 16 + (lane & 7) + ((lane >> 4) << 3)) * DP + ((lane >> 3) & 1) * 8;
    const int vofs = (lane & 15) * DP + (lane >> 4) * 8 + cg * (PC / PCG);

    /* each sequence among the block's tokens in turn (a step's tokens come a sequence at a time), keys
     * 0..pos; with the indexer's choice each token in turn, its chosen keys (or 0..pos: nsel -1) */
    for (int ts = tA; ts <= tB;) {
        const int bt0 = a.tok_bt[ts];
        int te = ts, kmax = a.pos[ts]; /* the last key index of the tokens ts..te */
        const int32_t *keys = NULL;    /* key index i is position keys[i], or i */
        if (a.sel) {
            if (a.nsel[ts] >= 0) keys = a.sel + (size_t)ts * a.K, kmax = a.nsel[ts] - 1; /* -1: no key */
        } else {
            while (te < tB && a.tok_bt[te + 1] == bt0) {
                te++;
                kmax = a.pos[te] > kmax ? a.pos[te] : kmax;
            }
        }
        /* a row's last key index, or -1 while other tokens' keys are loaded */
        const int p0 = tk0 >= ts && tk0 <= te ? (keys ? kmax : a.pos[tk0]) : -1;
        const int p1 = tk1 >= ts && tk1 <= te ? (keys ? kmax : a.pos[tk1]) : -1;
        /* the warp's last key over its rows (the same for both warps of a row group): tiles past it add
         * nothing to its rows, so it skips their math (another sequence's or token's keys, a causal tail) */
        const int wmax = __reduce_max_sync(0xffffffffu, p0 > p1 ? p0 : p1);
        const int32_t *bt = a.bt + bt0;
        const int ntile = kmax < 0 ? 1 : kmax / PBN + 1; /* one tile of zeros where no key is chosen */
        if constexpr (NST > 1) pf_load<NTHR>(a, bt, keys, 0, kmax, KD, ks0, raw0);
        cp_async_commit();
        for (int ti = 0; ti < ntile; ti++) {
            const int k0 = ti * PBN, sg = NST > 1 ? (ti & 1) : 0;
            uint16_t *ks = ks0 + sg * PBN * DP;
            uint8_t *raw = raw0 + sg * PBN * KD;
            if constexpr (NST > 1) {
                /* the other stage was freed by the last tile's closing barrier */
                if (ti + 1 < ntile)
                    pf_load<NTHR>(a, bt, keys, k0 + PBN, kmax, KD, ks0 + (sg ^ 1) * PBN * DP,
                                  raw0 + (sg ^ 1) * PBN * KD);
                cp_async_commit(); /* maybe empty: "all but the newest group" is this tile's */
                cp_async_wait<1>();
            } else {
                pf_load<NTHR>(a, bt, keys, k0, kmax, KD, ks, raw);
                cp_async_commit();
                cp_async_wait<0>();
            }
            __syncthreads();
            if (a.kv8) {
                pf_widen<NTHR>(raw, ks, KD);
                __syncthreads();
            }
            /* S for the warp's 16 rows x 16 keys (masked whole where the tile is past the warp's rows) */
            const bool act = k0 <= wmax;
            float s[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const uint32_t kb = smem_u32(ks) + kofs * 2;
#pragma unroll 4
            for (int kc = 0; kc < (act ? KD / 16 : 0); kc++) {
                uint32_t af[4], b[4];
                ldsm_x4(qb + kc * 32, af);
                ldsm_x4(kb + kc * 32, b);
                mma_bf16(s[0], af, b[0], b[1]);
                mma_bf16(s[1], af, b[2], b[3]);
            }
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int kp = k0 + cg * 16 + nt * 8 + (lane & 3) * 2 + (e & 1);
                    if (kp > (e < 2 ? p0 : p1)) s[nt][e] = -INFINITY;
                }
            /* the rows' maxima over the whole tile: this warp's half, then the group's through red */
            float x0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
            float x1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
            if ((lane & 3) == 0) red[cg * BM + rw0] = x0, red[cg * BM + rw1] = x1;
            __syncthreads();
            x0 = red[rw0], x1 = red[rw1];
#pragma unroll
            for (int g = 1; g < PCG; g++) x0 = fmaxf(x0, red[g * BM + rw0]), x1 = fmaxf(x1, red[g * BM + rw1]);
            /* every warp of the group reads the same maxima in the same order: the same m, u and c */
            float u0, u1, c0, c1;
            softmax_step(x0, x1, sl2, m0, m1, l0, l1, u0, u1, c0, c1);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                s[nt][0] = ex2(fmaf(s[nt][0], sl2, -u0));
                s[nt][1] = ex2(fmaf(s[nt][1], sl2, -u0));
                s[nt][2] = ex2(fmaf(s[nt][2], sl2, -u1));
                s[nt][3] = ex2(fmaf(s[nt][3], sl2, -u1));
                l0 += s[nt][0] + s[nt][1];
                l1 += s[nt][2] + s[nt][3];
                int col = cg * 16 + nt * 8 + (lane & 3) * 2;
                *(uint32_t *)(ps + rw0 * PP + col) = pack_bf2(s[nt][0], s[nt][1]);
                *(uint32_t *)(ps + rw1 * PP + col) = pack_bf2(s[nt][2], s[nt][3]);
            }
#pragma unroll
            for (int dt = 0; dt < DT; dt++) o[dt][0] *= c0, o[dt][1] *= c0, o[dt][2] *= c1, o[dt][3] *= c1;
            __syncthreads();
            /* O += P V over the tile's 32 keys, the warp's columns; V is the keys' latent part (P is 0
             * where the warp skipped the tile: nothing to add) */
            const uint32_t vb = smem_u32(ks) + vofs * 2;
#pragma unroll
            for (int kc = 0; kc < (act ? PBN / 16 : 0); kc++) {
                uint32_t pa[4];
                ldsm_x4(pb + kc * 32, pa);
#pragma unroll
                for (int dp = 0; dp < DT / 2; dp++) {
                    uint32_t b[4];
                    ldsm_x4_t(vb + (kc * 16 * DP + dp * 16) * 2, b);
                    mma_bf16(o[2 * dp], pa, b[0], b[1]);
                    mma_bf16(o[2 * dp + 1], pa, b[2], b[3]);
                }
            }
            __syncthreads(); /* the stage, P and red are rewritten next */
        }
        ts = te + 1;
    }
    /* the rows' sums: the quad's lanes, then the group's warps */
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if ((lane & 3) == 0) red[cg * BM + rw0] = l0, red[cg * BM + rw1] = l1;
    __syncthreads();
    float L0 = 0.0f, L1 = 0.0f;
#pragma unroll
    for (int g = 0; g < PCG; g++) L0 += red[g * BM + rw0], L1 += red[g * BM + rw1];
    const float i0 = L0 > 0.0f ? 1.0f / L0 : 0.0f, i1 = L1 > 0.0f ? 1.0f / L1 : 0.0f;
    const int col = cg * (PC / PCG) + (lane & 3) * 2;
    if (rw0 < nr) {
        uint16_t *out = a.olat + (size_t)(r0 + rw0) * PC + col;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) *(uint32_t *)(out + dt * 8) = pack_bf2(o[dt][0] * i0, o[dt][1] * i0);
    }
    if (rw1 < nr) {
        uint16_t *out = a.olat + (size_t)(r0 + rw1) * PC + col;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) *(uint32_t *)(out + dt * 8) = pack_bf2(o[dt][2] * i1, o[dt][3] * i1);
    }
}

/* The configuration the current device takes for a's shape: 2 (64 rows,
 * two stages), 1 (32 rows, one stage: sm_89's 99 KB), 0 (none). */
static int pf_pick(const struct cuda_mla_attn_args *a)
{
    /* each device's opt-in shared memory, asked once (rank threads may race to store the same value) */
    static int optins[64];
    int dev = 0, optin = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (dev >= 0 && dev < 64 && optins[dev] > 0) optin = optins[dev];
    else if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
    else if (dev >= 0 && dev < 64) optins[dev] = optin;
    int KD = PC + a->R;
    if (cuda_tuning.mla_prefill_rows != 32 && pf_smem(64, 2, KD, a->kv8) <= (size_t)optin) return 2;
    if (pf_smem(32, 1, KD, a->kv8) <= (size_t)optin) return 1;
    return 0;
}

extern "C" bool cuda_mla_prefill_ok(const struct cuda_mla_attn_args *a)
{
    if (a->C != PC || a->R < 0 || a->R % 16 || a->R > PRMAX || a->W % 16 || a->W < a->C + a->R ||
        (a->sel && !a->nsel) || a->key0 != 0 || a->H <= 0 || a->T <= 0 || a->block_size <= 0 || ((uintptr_t)a->cache & 15))
        return false;
    return pf_pick(a) > 0;
}

template <int RG, int NST>
static cudaError_t pf_launch(const struct cuda_mla_attn_args *a, cudaStream_t st)
{
    size_t sm = pf_smem(16 * RG, NST, PC + a->R, a->kv8);
    cudaError_t e = cudaFuncSetAttribute(prefill_kernel<RG, NST>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm);
    if (e != cudaSuccess) return e;
    long long rows = (long long)a->T * a->H, nb = (rows + 16 * RG - 1) / (16 * RG);
    prefill_kernel<RG, NST><<<(unsigned)nb, 32 * RG * PCG, sm, st>>>(*a);
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_mla_prefill(const struct cuda_mla_attn_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (!cuda_mla_prefill_ok(a)) return cudaErrorInvalidValue;
    return pf_pick(a) == 2 ? pf_launch<4, 2>(a, st) : pf_launch<2, 1>(a, st);
}
