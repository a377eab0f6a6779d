/* attn_wg.cu - prefill attention on Hopper's warpgroup MMA (wgmma, sm_90a),
 * for the tensor-core path's 128-row items at head_dim 128, with either KV
 * cache (attn.cu picks it; the other shapes and sm_89 keep attn_tc_kernel).
 * The same items, masks, online softmax and outputs as attn_tc_kernel
 * (attn.cu); the tile math and the gather differ.
 *
 * A block takes one item x one KV head group with three warpgroups
 * (FlashAttention-3's warp specialization). Warpgroup 0, the producer,
 * gathers K and V 128 keys at a time into three shared-memory stages and
 * gives most of its registers to the others (setmaxnreg). Where the cache
 * blocks hold a multiple of 16 keys, one of its warps does it with bulk
 * tensor copies (TMA: a 3-d tensor map per cache, [slots][KVH][128], boxes of
 * 16 slots x 64 dims, which land in the layout below), lane i copying the
 * tile's 16-key group i, so the block-table lookups run in parallel;
 * otherwise its 128 threads gather 16-byte chunks by cp.async (zeros past
 * kv_hi). Warpgroups 1 and 2, the consumers, own query rows 0..63 and
 * 64..127 (rows = tokens x the group's heads, as in attn.cu) with Q in
 * shared memory for the whole item. Per tile: S = Q K^T by eight
 * wgmma.m64n128k16 with both operands in shared memory (K-major), the online
 * softmax on S's accumulators, then O += P V by eight wgmma.m64n128k16 with
 * P from registers (S's accumulator layout is, per warp, mma.m16n8k16's A
 * fragment layout, so P needs no shuffle) and V read N-major (transposed). A
 * tile's S is issued with the previous tile's P V, so the softmax runs while
 * the tensor cores finish that, and the two consumers take turns issuing
 * (ping-pong), so one's softmax also runs under the other's MMAs. Stage s
 * has two mbarriers: full[s] (the copies have landed) and empty[s] (the
 * consumers' eight warps are done with its K and V), so the producer runs up
 * to two tiles ahead.
 *
 * Shared memory: every tile (Q [128 rows], K and V [128 keys], x D 128 bf16)
 * is stored as two 64-dim halves of 128-byte rows with the 128-byte swizzle
 * (16-byte chunk c of row r at chunk c ^ (r & 7)), from a 1024-byte aligned
 * base: wgmma's canonical layout, described by matrix descriptors (start
 * address, LBO, SBO in 16-byte units, swizzle mode 1 = 128B), and TMA's
 * SWIZZLE_128B. K-major (Q, K): 8-row groups 1024 bytes apart (SBO), the
 * k16 slice at +32 bytes within a row. N-major (V): 64-dim halves WG_HALF
 * bytes apart (LBO), 8-key groups 1024 bytes apart (SBO). 32 KB Q + 3
 * stages x 64 KB K/V + 1 KB of alignment slack (225 KB): one block an SM.
 *
 * The fp8 cache (KV8; e4m3, scale 1): the bulk copies bring a tile's e4m3
 * rows (boxes of 16 slots x 128 bytes, no swizzle) into the upper halves of
 * its K and V tiles, counted on a third barrier, loaded[s]; the producer's
 * three other warps widen them in place to f16 in the layout above
 * (wg_widen; every e4m3 value is an f16 value) and arrive on full[s]. The
 * MMAs then run in f16: Q is converted once per item (q is well inside
 * f16's range) and P packed to f16. Without bulk copies the producer's four
 * warps gather by cp.async, then widen. bench_attn (fp8): 16K in 8 chunks
 * 455 TFLOP/s, 8 prompts 327, one prompt 265, against 547 / 363 / 308 with
 * bf16 on the same host and 210 / 182 / 151 on attn_tc_kernel; without the
 * widening (cuda_tuning.attn_wg8_skip_widen, outputs wrong) it runs at 586 /
 * 381 / 325: the widening is what fp8 costs here.
 *
 * bench_attn on an H200: a 16K context in 8 chunks at
 * 537-574 TFLOP/s (attn_tc_kernel 212; 329 with the cp.async gather), a
 * 2048-token prompt at 311-313 (150), 8 such prompts in one step at 372-375. */
#include <stdlib.h>
#include <string.h>

#include "cuda/bf16.cuh"
#include "cuda/kernels.h"
#include "cuda/tuning.h"
#include "cuda/tile.cuh"
#include "cuda/wgmma.cuh"

#define WG_BM 128  /* query rows per block: two warpgroups of 64 */
#define WG_BN 128  /* keys per tile */
#define WG_THR 384 /* a producer warpgroup and two consumers */
#define WG_HALF (WG_BN * 128) /* bytes of one 64-dim half of a 128-row tile */
#define WG_TILE (2 * WG_HALF) /* one Q, K or V tile */
#define WG_SMEM (1024 + WG_TILE + 6 * WG_TILE)
static_assert(WG_BM == WG_BN, "Q and K/V tiles share one layout");

#ifdef WG_ARCH
/* byte offset of 16-byte chunk c (0..15 along D 128) of row r in a tile */
static __device__ __forceinline__ uint32_t sw128(int r, int c)
{
    return (uint32_t)((c >> 3) * WG_HALF + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/* the 64 f32 accumulators of a wgmma.m64n128k16 as asm operands %0..%63 */
#define WG_D64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define WG_ACC64(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
/* d = A B (ACC 0) or d += A B (ACC 1), A and B in shared memory, both K-major */
template <int ACC, bool F16>
static __device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t da, uint64_t db)
{
    if constexpr (F16)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " WG_D64
                     ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : WG_ACC64(d)
                     : "l"(da), "l"(db), "n"(ACC));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_D64
                     ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : WG_ACC64(d)
                     : "l"(da), "l"(db), "n"(ACC));
}
/* d += A B, A (4 registers: the mma.m16n8k16 A fragment of this warp's 16
 * rows) from registers, B in shared memory N-major */
template <bool F16>
static __device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db)
{
    if constexpr (F16)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " WG_D64
                     ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                     : WG_ACC64(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_D64
                     ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                     : WG_ACC64(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

/* keys [k0, k0 + WG_BN) of head group g into the K tile at ks and the V tile
 * at ks + WG_TILE, zeros past kv_hi, by the 128 threads of the producer
 * warpgroup (tp: 0..127): thread tp takes 16-byte chunk tp & 15 of keys
 * tp / 16, tp / 16 + 8, ... */
static __device__ __forceinline__ void wg_load_kv(const struct cuda_attn_args &a, const int32_t *bt, int g, int k0,
                                                  int kv_hi, uint32_t ks, int tp)
{
    const uint16_t *kc = (const uint16_t *)a.kc, *vc = (const uint16_t *)a.vc;
    int bs = a.block_size, sh = __ffs(bs) - 1, c = tp & 15;
    bool p2 = (bs & (bs - 1)) == 0; /* the usual block sizes: no division */
#pragma unroll 4
    for (int j = tp >> 4; j < WG_BN; j += 8) {
        int kp = k0 + j;
        bool ok = kp < kv_hi;
        size_t off = 0;
        if (ok) {
            int pg = p2 ? kp >> sh : kp / bs, in = p2 ? kp & (bs - 1) : kp % bs;
            off = (((size_t)bt[pg] * bs + in) * a.KVH + g) * 128 + c * 8;
        }
        cp_async16(ks + sw128(j, c), kc + off, ok);
        cp_async16(ks + WG_TILE + sw128(j, c), vc + off, ok);
    }
}

/* The fp8 cache (KV8): a tile's e4m3 rows are staged where the upper 64-dim
 * half of its tile goes (row r's 128 bytes at WG_HALF + 128 r: exactly
 * where row r's f16 dims 64..127 land) and widened in place to f16 in the
 * layout above. The cp.async gather of them (zeros past kv_hi), by the
 * producer warpgroup's 128 threads: thread tp takes 16-byte chunk tp & 7 of
 * keys tp / 8, tp / 8 + 16, ... */
static __device__ __forceinline__ void wg_load_kv8(const struct cuda_attn_args &a, const int32_t *bt, int g, int k0,
                                                   int kv_hi, uint32_t ks, int tp)
{
    const uint8_t *kc = (const uint8_t *)a.kc, *vc = (const uint8_t *)a.vc;
    int bs = a.block_size, c = tp & 7;
#pragma unroll 4
    for (int j = tp >> 3; j < WG_BN; j += 16) {
        int kp = k0 + j;
        bool ok = kp < kv_hi;
        size_t off = ok ? (((size_t)bt[kp / bs] * bs + kp % bs) * a.KVH + g) * 128 + c * 16 : 0;
        cp_async16(ks + WG_HALF + j * 128 + c * 16, kc + off, ok);
        cp_async16(ks + WG_TILE + WG_HALF + j * 128 + c * 16, vc + off, ok);
    }
}
/* the four e4m3 of w as two f16x2, through the register's 16-bit halves */
static __device__ __forceinline__ void e4m3x4_to_h4(uint32_t w, uint32_t &lo, uint32_t &hi)
{
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}
/* v's 16 e4m3 as f16 at d (chunk 2j) and d ^ 16 (chunk 2j + 1: the
 * swizzle puts it next to 2j's) */
static __device__ __forceinline__ void wg_widen_st(uint32_t d, uint4 v)
{
    uint32_t h[4];
    e4m3x4_to_h4(v.x, h[0], h[1]), e4m3x4_to_h4(v.y, h[2], h[3]);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(d), "r"(h[0]), "r"(h[1]), "r"(h[2]), "r"(h[3])
                 : "memory");
    e4m3x4_to_h4(v.z, h[0], h[1]), e4m3x4_to_h4(v.w, h[2], h[3]);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(d ^ 16u), "r"(h[0]), "r"(h[1]), "r"(h[2]), "r"(h[3])
                 : "memory");
}
/* The widening of a stage (K rows 0..127 at ks, V rows 128..255 at ks +
 * WG_TILE; a row of either at ks + 128 r, + 16 KB for V) by NW warps (t:
 * 0 .. 32 NW - 1). A warp takes two groups of 4 rows at a time, 8 lanes a
 * row, and reads all of them before it writes, so each row's staged bytes
 * are read before its upper half overwrites them; no two warps share a row.
 * A warp's groups q = w, w + 2 NW, ... and q + NW keep their parity, so a
 * lane's row keeps its residue mod 8 in either sequence and the swizzled
 * offsets of its output chunks are loop invariants. */
template <int NW>
static __device__ __forceinline__ void wg_widen(uint32_t ks, int t)
{
    constexpr int NG = 2 * WG_BN / 4; /* groups of 4 rows */
    static_assert(NW % 2 == 1 || NW == 4, "the second sequence's parity");
    const int lane = t & 31, j = lane & 7, w = t >> 5, ro = lane >> 3;
    /* chunk 2j's offset in a row of the first sequence; the second
     * sequence's rows differ by 4 mod 8 when NW is odd (offset ^ 64) */
    const uint32_t a0 = (uint32_t)((j >> 2) * WG_HALF + (((2 * j & 7) ^ ((4 * (w & 1) + ro) & 7)) << 4));
    const uint32_t b0 = NW % 2 ? a0 ^ 64u : a0;
    for (int q = w; q < NG; q += 2 * NW) {
        const int qb = q + NW, ra = 4 * q + ro, rb = 4 * qb + ro;
        const bool two = qb < NG;
        const uint32_t ba = ks + ra * 128 + (ra >= WG_BN ? WG_TILE - WG_BN * 128 : 0);
        const uint32_t bb = ks + rb * 128 + (rb >= WG_BN ? WG_TILE - WG_BN * 128 : 0);
        uint4 va, vb = make_uint4(0, 0, 0, 0);
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(va.x), "=r"(va.y), "=r"(va.z), "=r"(va.w)
                     : "r"(ba + WG_HALF + j * 16)
                     : "memory");
        if (two)
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(vb.x), "=r"(vb.y), "=r"(vb.z), "=r"(vb.w)
                         : "r"(bb + WG_HALF + j * 16)
                         : "memory");
        __syncwarp(); /* the warp's rows are read: their upper halves may be overwritten */
        wg_widen_st(ba + a0, va);
        if (two) wg_widen_st(bb + b0, vb);
    }
}

/* The consumers take turns at the tensor cores (FlashAttention-3's
 * ping-pong): a warpgroup issues a tile's MMAs only after the other has
 * issued its own, so one's softmax runs while the other's MMAs do (4% on
 * short prompts, even at 16K; the consumers issuing without turns lost). Named barrier 3 + c is consumer c's turn: it
 * waits there (bar.sync, its 128 threads) until the other has passed it the
 * turn (bar.arrive, the other's 128 threads). */
static __device__ __forceinline__ void turn_wait(int cw)
{
    asm volatile("bar.sync %0, 256;\n" ::"r"(3 + cw) : "memory");
}
static __device__ __forceinline__ void turn_pass(int cw)
{
    asm volatile("bar.arrive %0, 256;\n" ::"r"(4 - cw) : "memory");
}
#endif

/* The kernel (see the top of the file); tma: the bulk tensor copies with
 * the maps tk and tv, else the cp.async gather. */
template <bool KV8>
static __global__ void __launch_bounds__(WG_THR, 1)
    attn_wg_kernel(struct cuda_attn_args a, const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                   int tma, int a8_skip)
{
#ifdef WG_ARCH
    constexpr int D = 128, NT = WG_BN / 8, DT = D / 8;
    extern __shared__ __align__(16) uint8_t wsm[];
    __shared__ int gmin[8]; /* each consumer warp's smallest row position */
    __shared__ __align__(8) uint64_t bars[9]; /* full[3], empty[3], loaded[3] (KV8 with bulk copies) */
    struct cuda_attn_item wi;
    if (!attn_item(a, true, wi)) return;
    int g = blockIdx.y, grp = a.H / a.KVH;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, wg = w / 4 - 1; /* consumer warpgroup, -1: producer */
    int nrows = wi.nq * grp;
    if (nrows <= 0 || nrows > WG_BM) return; /* whole block: wi is uniform */
    const int32_t *bt = a.bt + wi.bt0;
    const uint32_t qs = (smem_u32(wsm) + 1023u) & ~1023u, kv0 = qs + WG_TILE; /* stage s: kv0 + 2 s WG_TILE */
    const uint32_t full = smem_u32(bars), empty = full + 24, loaded = full + 48;
    /* the bulk tensor copies take whole 16-key groups of the cache: with
     * blocks of a multiple of 16 keys and an item starting on one */
    tma = tma && (wi.kv_lo & 15) == 0;
    /* full[s]: the copies have landed (bf16), or the stage is widened
     * (KV8: by the producer's 3 other warps after the copies, or by all 4
     * after their cp.async) */
    if (threadIdx.x == 0)
        for (int i = 0; i < 3; i++)
            mbar_init(full + 8 * i, tma ? (KV8 ? 96 : 1) : 128), mbar_init(empty + 8 * i, 8), mbar_init(loaded + 8 * i, 1);
    __syncthreads(); /* the barriers are ready */
    int ntile = wi.kv_hi > wi.kv_lo ? (wi.kv_hi - wi.kv_lo + WG_BN - 1) / WG_BN : 0;

    if (wg < 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        int tp = threadIdx.x;
        if (KV8 && tma && tp >= 32) { /* warps 1-3 widen each stage once its copies land */
            for (int ti = 0; ti < ntile; ti++) {
                int st = ti % 3;
                mbar_wait(loaded + 8 * st, (ti / 3) & 1);
                if (!a8_skip) wg_widen<3>(kv0 + st * 2 * WG_TILE, tp - 32);
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* generic writes -> wgmma reads */
                mbar_arrive(full + 8 * st);
            }
            return;
        }
        if (tma && tp >= 32) return;
        for (int ti = 0; ti < ntile; ti++) {
            int st = ti % 3, k0 = wi.kv_lo + ti * WG_BN;
            uint32_t ks = kv0 + st * 2 * WG_TILE;
            if (ti >= 3) mbar_wait(empty + 8 * st, (ti / 3 - 1) & 1); /* the consumers are done with tile ti - 3 */
            if (!tma && KV8) { /* gather, wait for every thread's bytes, widen */
                wg_load_kv8(a, bt, g, k0, wi.kv_hi, ks, tp);
                cp_async_commit();
                cp_async_wait<0>();
                asm volatile("bar.sync 5, 128;\n" ::: "memory");
                wg_widen<4>(ks, tp);
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                mbar_arrive(full + 8 * st);
                continue;
            }
            if (!tma) {
                wg_load_kv(a, bt, g, k0, wi.kv_hi, ks, tp);
                mbar_arrive_cp_async(full + 8 * st);
                continue;
            }
            /* one warp: lane i copies the tile's 16-key group i if it holds
             * a key below kv_hi, as two 64-dim halves of K and of V (2 KB
             * each); the lanes look their blocks up in parallel */
            int ng = min(WG_BN / 16, (wi.kv_hi - k0 + 15) / 16), bs = a.block_size;
            if (tp == 0) mbar_expect_tx(KV8 ? loaded + 8 * st : full + 8 * st, ng * (KV8 ? 4096 : 8192));
            __syncwarp();
            if (KV8 && tp < ng) { /* the group's e4m3 rows of K and of V (2 KB each) into the staging halves */
                int kp = k0 + 16 * tp, slot = bt[kp / bs] * bs + kp % bs;
                uint32_t d = ks + WG_HALF + tp * 16 * 128;
                tma_load3(d, &tk, 0, g, slot, loaded + 8 * st);
                tma_load3(d + WG_TILE, &tv, 0, g, slot, loaded + 8 * st);
            } else if (tp < ng) {
                int kp = k0 + 16 * tp, slot = bt[kp / bs] * bs + kp % bs;
                uint32_t d = ks + tp * 16 * 128;
                tma_load3(d, &tk, 0, g, slot, full + 8 * st);
                tma_load3(d + WG_HALF, &tk, 64, g, slot, full + 8 * st);
                tma_load3(d + WG_TILE, &tv, 0, g, slot, full + 8 * st);
                tma_load3(d + WG_TILE + WG_HALF, &tv, 64, g, slot, full + 8 * st);
            }
        }
        return;
    }

    /* the consumers: Q (while the producer gathers the first tiles), then
     * this lane's two rows (the accumulator layout: warp w & 3 of the
     * warpgroup holds its rows 16 (w & 3) .. + 15); rows past nrows borrow
     * the last row's position (their results are dropped) */
    for (int i = threadIdx.x - 128; i < WG_BM * 16; i += 256) {
        int r = i >> 4, c = i & 15;
        bool ok = r < nrows;
        const uint16_t *src = a.q;
        if (ok) src = a.q + ((size_t)(wi.t0 + r / grp) * a.H + g * grp + r % grp) * D + c * 8;
        cp_async16(qs + sw128(r, c), src, ok);
    }
    cp_async_commit();
    int r0 = (w - 4) * 16 + (lane >> 2), r1 = r0 + 8;
    int p0 = a.pos[wi.t0 + min(r0, nrows - 1) / grp], p1 = a.pos[wi.t0 + min(r1, nrows - 1) / grp];
    int wmin = __reduce_min_sync(0xffffffffu, min(p0, p1));
    if (lane == 0) gmin[w - 4] = wmin;
    cp_async_wait<0>();
    if (KV8) /* the MMAs run in f16: each thread converts the Q chunks it copied (q is well inside f16's range) */
        for (int i = threadIdx.x - 128; i < WG_BM * 16; i += 256) {
            uint32_t ad = qs + sw128(i >> 4, i & 15), v[4];
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                         : "r"(ad)
                         : "memory");
#pragma unroll
            for (int k = 0; k < 4; k++) v[k] = pack_h2(__uint_as_float(v[k] << 16), __uint_as_float(v[k] & 0xffff0000u));
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(ad), "r"(v[0]), "r"(v[1]), "r"(v[2]),
                         "r"(v[3])
                         : "memory");
        }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* cp.async writes -> wgmma reads */
    asm volatile("bar.sync 1, 256;\n" ::: "memory");             /* the consumers: Q and gmin are ready */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

    /* ptxas keeps wgmma asynchronous only on paths it can prove uniform
     * across the warpgroup: control values pass through a warp broadcast,
     * and no branch decides whether a tile's MMAs run (a tile after all of
     * this warpgroup's rows is fully masked and adds nothing) */
    ntile = __shfl_sync(0xffffffffu, ntile, 0);
    const int cw = __shfl_sync(0xffffffffu, wg, 0);
    const bool live = __shfl_sync(0xffffffffu, cw * 64 < nrows ? 1 : 0, 0);
    int gn = 0x7fffffff; /* the warpgroup's smallest row position */
    for (int v = 4 * cw; v < 4 * cw + 4; v++) gn = min(gn, gmin[v]);
    if (cw == 0 && ntile > 0) turn_pass(1); /* warpgroup 0 has the first turn */
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f; /* m in log2 units */
    const float sl2 = a.scale * 1.4426950408889634f;
    uint32_t pa[NT / 2][4];
    float s[64];

    /* the MMAs, each group committed: S = Q K^T for the K tile at kb (the
     * first k16 slice overwrites s), O += P V for the V tile at vb; before
     * issuing, the operand registers others wrote are fenced */
    auto issue_s = [&](uint32_t kb) {
        wgmma_ss<0, KV8>(s, wg_desc(qs + cw * 64 * 128, 16, 1024), wg_desc(kb, 16, 1024));
#pragma unroll
        for (int kc = 1; kc < D / 16; kc++) {
            uint32_t off = (kc >> 2) * WG_HALF + (kc & 3) * 32;
            wgmma_ss<1, KV8>(s, wg_desc(qs + off + cw * 64 * 128, 16, 1024), wg_desc(kb + off, 16, 1024));
        }
        wg_commit();
    };
    auto issue_pv = [&](uint32_t vb) {
#pragma unroll
        for (int kk = 0; kk < NT / 2; kk++) wgmma_rs<KV8>(o, pa[kk], wg_desc(vb + kk * 16 * 128, WG_HALF, 1024));
        wg_commit();
    };
    auto fence_pv = [&]() {
        acc_fence(o);
#pragma unroll
        for (int kk = 0; kk < NT / 2; kk++)
#pragma unroll
            for (int j = 0; j < 4; j++) asm volatile("" : "+r"(pa[kk][j])::"memory");
    };

    /* S_t = Q K_t into s, then its mask and online softmax: s becomes the
     * unnormalized P_t, c0/c1 the factors the accumulators take */
    auto scores = [&](int ti, float &c0, float &c1, bool overlap) {
        const int k0 = wi.kv_lo + ti * WG_BN;
        const uint32_t kb = kv0 + (ti % 3) * 2 * WG_TILE;
        if (overlap) { /* O += P_{t-1} V_{t-1} too, committed after S_t */
            const uint32_t vprev = kv0 + ((ti + 2) % 3) * 2 * WG_TILE + WG_TILE;
            fence_pv();
            turn_wait(cw);
            wg_fence();
            issue_s(kb);
            issue_pv(vprev);
            turn_pass(cw);
            wg_wait<1>(); /* S_t */
        } else {
            turn_wait(cw);
            wg_fence();
            issue_s(kb);
            turn_pass(cw);
            wg_wait<0>();
        }
        acc_fence(s);
        if (k0 + WG_BN > wi.kv_hi || k0 + WG_BN - 1 > gn) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int kp = k0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                    if (kp >= wi.kv_hi || kp > (e < 2 ? p0 : p1)) s[nt * 4 + e] = -INFINITY;
                }
        }
        /* online softmax: a row lives in the 4 lanes of a quad */
        float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            x0 = fmaxf(x0, fmaxf(s[nt * 4], s[nt * 4 + 1]));
            x1 = fmaxf(x1, fmaxf(s[nt * 4 + 2], s[nt * 4 + 3]));
        }
        float u0, u1;
        softmax_step(x0, x1, sl2, m0, m1, l0, l1, u0, u1, c0, c1);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[nt * 4] = ex2(fmaf(s[nt * 4], sl2, -u0)), s[nt * 4 + 1] = ex2(fmaf(s[nt * 4 + 1], sl2, -u0));
            s[nt * 4 + 2] = ex2(fmaf(s[nt * 4 + 2], sl2, -u1)), s[nt * 4 + 3] = ex2(fmaf(s[nt * 4 + 3], sl2, -u1));
            l0 += s[nt * 4] + s[nt * 4 + 1], l1 += s[nt * 4 + 2] + s[nt * 4 + 3];
        }
    };
    /* o *= c, and s (P) packed into P V's A fragments: keys 16 kk + 2tq..
     * (nt = 2 kk) and 16 kk + 8 + 2tq.. (nt = 2 kk + 1) */
    auto rescale_pack = [&](float c0, float c1) {
        if (c0 != 1.0f || c1 != 1.0f) /* once the row maxima settle, most tiles leave o as it is */
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
                o[dt * 4] *= c0, o[dt * 4 + 1] *= c0, o[dt * 4 + 2] *= c1, o[dt * 4 + 3] *= c1;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            pa[nt / 2][(nt & 1) * 2] = KV8 ? pack_h2(s[nt * 4], s[nt * 4 + 1]) : pack_bf2(s[nt * 4], s[nt * 4 + 1]);
            pa[nt / 2][(nt & 1) * 2 + 1] =
                KV8 ? pack_h2(s[nt * 4 + 2], s[nt * 4 + 3]) : pack_bf2(s[nt * 4 + 2], s[nt * 4 + 3]);
        }
    };

    /* waits for tile t; the bulk copies bring whole 16-key groups and none
     * past the group that holds kv_hi, so the V rows from kv_hi on (stale
     * or never written: maybe not finite) are zeroed before P V reads them
     * (their P is 0, but 0 x NaN is not); K's are masked by assignment */
    auto ready = [&](int ti) {
        mbar_wait(full + 8 * (ti % 3), (ti / 3) & 1);
        int k0 = wi.kv_lo + ti * WG_BN;
        if (tma && k0 + WG_BN > wi.kv_hi) { /* block-uniform: both consumers are here */
            uint32_t vs = kv0 + (ti % 3) * 2 * WG_TILE + WG_TILE;
            for (int i = (wi.kv_hi - k0) * 16 + (int)threadIdx.x - 128; i < WG_BN * 16; i += 256)
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(vs + sw128(i >> 4, i & 15)), "r"(0)
                             : "memory");
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* generic writes -> wgmma reads */
            asm volatile("bar.sync 2, 256;\n" ::: "memory");
        } else if (!tma) {
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* cp.async writes -> wgmma reads */
        }
    };

    if (live && ntile > 0) {
        /* Tile t: S_t = Q K_t is issued together with O += P_{t-1} V_{t-1},
         * so the softmax of tile t runs while the tensor cores still work on
         * the previous tile's P V; P_t is packed once that has finished (its
         * registers are P V's operand until then), and the stage of tile
         * t - 1 is handed back. */
        float c0, c1;
        ready(0);
        scores(0, c0, c1, false);
        rescale_pack(c0, c1);
        for (int ti = 1; ti < ntile; ti++) {
            ready(ti);
            scores(ti, c0, c1, true);
            wg_wait<0>(); /* P_{t-1} V_{t-1}: o and pa are free */
            acc_fence(o);
            if (lane == 0) mbar_arrive(empty + 8 * ((ti + 2) % 3)); /* this warp is done with tile t - 1's stage */
            rescale_pack(c0, c1);
        }
        const uint32_t vlast = kv0 + ((ntile - 1) % 3) * 2 * WG_TILE + WG_TILE;
        fence_pv();
        turn_wait(cw);
        wg_fence();
        issue_pv(vlast);
        if (cw == 0) turn_pass(cw); /* the last turn: warpgroup 1's pass would have no taker */
        wg_wait<0>();
        acc_fence(o);
    } else {
        /* no row of this warpgroup is real: it only keeps the stages' count
         * (a wait for every tile, so it hands none back twice in a phase) */
        for (int ti = 0; ti < ntile; ti++) {
            ready(ti);
            turn_wait(cw), turn_pass(cw);
            if (ti > 0 && lane == 0) mbar_arrive(empty + 8 * ((ti + 2) % 3));
        }
        if (ntile > 0) { /* and the turn of the last P V */
            turn_wait(cw);
            if (cw == 0) turn_pass(cw);
        }
    }
    tc_store_rows<D>(a, wi, g, grp, nrows, r0, l0, l1, m0, m1, [&](int dt, int e) { return o[dt * 4 + e]; });
#endif
}

/* whether this device runs the kernel (compute capability 9.0: the sm_90a
 * code), unless cuda_attention_wg_select(0) turned it off */
static int wg_on = -1;
extern "C" void cuda_attention_wg_select(int on) { wg_on = on != 0 && wg_sm90(); }

extern "C" int cuda_attention_wg_ok(const struct cuda_attn_args *a)
{
    if (wg_on < 0) cuda_attention_wg_select(-1);
    return wg_on && a->D == 128 && (a->Dv <= 0 || a->Dv == 128) && a->max_rows > 64 && a->max_rows <= WG_BM;
}

extern "C" cudaError_t cuda_attention_wg_prepare(void)
{
    const void *k[] = {(const void *)attn_wg_kernel<false>, (const void *)attn_wg_kernel<true>};
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < 2 && e == cudaSuccess; i++)
        e = cudaFuncSetAttribute(k[i], cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM);
    return e == cudaErrorInvalidDeviceFunction ? cudaSuccess : e; /* no sm_90a code for this device */
}

/* The cache [slots][KVH][128] bf16 as a 3-d tensor for the bulk tensor
 * copies: boxes of 64 dims x 1 head x 16 slots (2 KB, 128-byte swizzle);
 * the fp8 cache (kv8) as bytes: boxes of 128 dims x 1 x 16 (2 KB, no
 * swizzle: 16 rows of 128 bytes, the staging layout).
 * The slot count is a bound the kernel never reaches (it reads only slots
 * of the block table). cuTensorMapEncodeTiled comes from the driver through
 * the runtime (no -lcuda). false where either is missing: the kernel then
 * gathers by cp.async (329 against 537-574 TFLOP/s at 16K context). */
static bool tm_make(CUtensorMap *m, const void *base, int KVH, bool kv8)
{
    PFN_cuTensorMapEncodeTiled_v12000 tm_encode = wg_tm_encoder();
    if (!tm_encode || ((uintptr_t)base & 15)) return false;
    cuuint64_t row = kv8 ? 128 : 256;
    cuuint64_t dims[3] = {128, (cuuint64_t)KVH, 1ull << 31}, strides[2] = {row, (cuuint64_t)KVH * row};
    cuuint32_t box[3] = {kv8 ? 128u : 64u, 1, 16}, es[3] = {1, 1, 1};
    return tm_encode(m, kv8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void *)base, dims,
                     strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     kv8 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

extern "C" cudaError_t cuda_attention_wg(const struct cuda_attn_args *a, cudaStream_t st)
{
    alignas(64) CUtensorMap tk, tv;
    memset(&tk, 0, sizeof tk), memset(&tv, 0, sizeof tv);
    int tma = a->block_size % 16 == 0 && tm_make(&tk, a->kc, a->KVH, a->kv8) && tm_make(&tv, a->vc, a->KVH, a->kv8);
    /* benchmarks only (outputs wrong): the fp8 stages the bulk copies bring
     * are not widened, to see what the widening costs */
    const int skip8 = cuda_tuning.attn_wg8_skip_widen;
    dim3 grid(a->max_items, a->KVH);
    if (a->kv8)
        attn_wg_kernel<true><<<grid, WG_THR, WG_SMEM, st>>>(*a, tk, tv, tma, skip8);
    else
        attn_wg_kernel<false><<<grid, WG_THR, WG_SMEM, st>>>(*a, tk, tv, tma, skip8);
    return cudaGetLastError();
}
