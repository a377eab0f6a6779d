/* gemm_wg.cu - prefill GEMMs on Hopper's warpgroup MMA (wgmma, sm_90a) with
 * SwiGLU in the epilogue: h[t][j] = bf16(silu(g) u), g and u the bf16 of
 * rows j and F + j of x Wgu^T, so the gate|up product never goes to memory
 * (cuBLAS writes it, 2F values a token, and cuda_swiglu reads it back: 1.4
 * GB a layer at 16384 tokens of the Llama-8B shape). The plain product
 * y = bf16(x W^T) runs on the same kernel, for comparing it with cuBLAS.
 *
 * A persistent kernel, one block per SM, three warpgroups:
 * - one thread of warpgroup 0 (the producer) streams tiles by bulk tensor
 *   copies (TMA, the 128-byte swizzle) into GM_ST stages, each a 128-row
 *   slice of x and a 256-row slice of W, 64 of `in` wide, with full / empty
 *   mbarriers;
 * - warpgroups 1 and 2 (the consumers, 232 registers by setmaxnreg) each
 *   multiply 64 rows of x by the 256 rows of W, four wgmma.m64n256k16 a
 *   stage, accumulating in f32 registers (128 a thread). With SwiGLU, a
 *   tile's 256 W rows are 128 gate rows and the 128 up rows that pair with
 *   them. At the end of a tile they only round the accumulators to bf16
 *   into four staging boxes (128 rows x 64 columns each) and go on to the
 *   next tile;
 * - warps 1-3 of warpgroup 0 (the epilogue, 40 registers) apply SwiGLU to
 *   the boxes in place and one of them stores the outputs by bulk tensor
 *   copies, all under the consumers' MMAs of the next tile. Two named
 *   barriers hand the boxes back and forth (GM_STAGED, GM_SFREE).
 * Every output sums over `in` in one fixed order whatever T and the tile
 * position, so a row's result does not depend on the batch it is in. Tiles
 * go in groups of GM_GROUP row slices: the 132 tiles in flight share about
 * 16 MB of x and 16 MB of W, which stay in L2.
 *
 * On an H200, sustained at the power cap, gate|up with SwiGLU runs as fast
 * as cuBLAS's product alone, so the SwiGLU kernel's pass is saved: a
 * 16K-token prefill step gains 2-3%.
 * Tried and dropped: CTA pairs sharing W by TMA multicast (no faster);
 * four stages with the consumers applying SwiGLU (their epilogue cost ~11%
 * of the tile); four stages with three of the boxes in the tile's last
 * stage (the producer stalls on it); qkv, o and down on this kernel, also
 * with the residual added in its epilogue (no faster than cuBLAS there);
 * the MLP's RMSNorm split between o's epilogue (x += o, x w, sums of
 * squares) and gate|up's (the row scale), with no norm kernel (the
 * epilogue's f32 traffic cost what the norm kernel did).
 *
 * Shared memory: a stage is x's 128 rows then W's 256 rows, 128 bytes each
 * (64 bf16 of `in`), the 16-byte chunk c of row r at c ^ (r & 7), from a
 * 1024-byte aligned base: the layout TMA's SWIZZLE_128B writes and a
 * K-major wgmma descriptor (SBO 1024) reads; the k16 slice kk at +32 kk.
 * The boxes after the stages use the same layout (as TMA's stores read it).
 * 1 KB + 3 x 48 KB + 64 KB: one block an SM. */
#include <stdlib.h>
#include <string.h>

#include "cuda/bf16.cuh"
#include "cuda/kernels.h"
#include "cuda/tuning.h"
#include "cuda/tile.cuh"
#include "cuda/wgmma.cuh"

#define GM_BM 128 /* rows of x per tile: two consumer warpgroups of 64 */
#define GM_BN 256 /* rows of W per tile */
#define GM_BK 64  /* `in` per stage: one 128-byte swizzled row */
#define GM_ST 3   /* stages */
#define GM_A (GM_BM * 128)
#define GM_STAGE (GM_A + GM_BN * 128)
#define GM_BOX (128 * 128) /* a 128 x 64 box of bf16 outputs: four a tile */
#define GM_SMEM (1024 + GM_ST * GM_STAGE + 4 * GM_BOX)
#define GM_THR 384
#define GM_GROUP 16 /* row slices of x per group of tiles */

#ifdef WG_ARCH
static __device__ __forceinline__ void wgmma256(float (&d)[128], uint64_t da, uint64_t db, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "l"(da), "l"(db), "r"(acc));
}

/* shared memory at src into the tensor map's box at (c0, c1); the parts
 * outside the tensor are not written */
static __device__ __forceinline__ void tma_store2(const CUtensorMap *m, int c0, int c1, uint32_t src)
{
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"((uint64_t)m),
                 "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
#endif

/* Named barriers between the consumers (256 threads) and the epilogue
 * warps (96): GM_STAGED, a tile's outputs are in shared memory (the
 * consumers arrive, the epilogue waits); GM_SFREE, the epilogue is done
 * with them (it arrives, the consumers wait). GM_EPI syncs the epilogue. */
#define GM_EPI 2
#define GM_STAGED 3
#define GM_SFREE 4
#ifdef WG_ARCH
static __device__ __forceinline__ void gm_bar(int id, bool wait)
{
    if (wait)
        asm volatile("bar.sync %0, 352;\n" ::"r"(id) : "memory");
    else
        asm volatile("bar.arrive %0, 352;\n" ::"r"(id) : "memory");
}
#endif

struct gm_args {
    int T, in, out, F; /* out: the plain product's columns; F: SwiGLU's (0: plain) */
    int nm, nn;        /* tiles along T and along the output */
    uint16_t *y;
    int abl; /* benchmarks only (cuda_tuning.gemm_wg_ablate, outputs wrong): 1 no epilogue, 2 loads only the
                first stages and the MMAs reuse them, 3 both */
};

#ifdef WG_ARCH
/* tile t -> (row slice m, column slice n): groups of GM_GROUP row slices,
 * row slices fastest within a group */
static __device__ __forceinline__ void gm_tile(const gm_args &a, int t, int &m, int &n)
{
    int per = GM_GROUP * a.nn, g = t / per, in = t % per, gm = min(GM_GROUP, a.nm - g * GM_GROUP);
    m = g * GM_GROUP + in % gm, n = in / gm;
}
#endif

template <bool SWIGLU>
static __global__ void __launch_bounds__(GM_THR, 1)
    gemm_wg_kernel(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw,
                   const __grid_constant__ CUtensorMap ty, gm_args a)
{
#ifdef WG_ARCH
    extern __shared__ __align__(16) uint8_t gsm[];
    __shared__ __align__(8) uint64_t bars[2 * GM_ST]; /* full[GM_ST], empty[GM_ST] */
    const uint32_t s0 = (smem_u32(gsm) + 1023u) & ~1023u, full = smem_u32(bars), empty = full + 8 * GM_ST;
    const uint32_t so = s0 + GM_ST * GM_STAGE; /* the four output boxes */
    const int ntile = a.nm * a.nn, nk = (a.in + GM_BK - 1) / GM_BK;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0)
        for (int i = 0; i < GM_ST; i++) mbar_init(full + 8 * i, 1), mbar_init(empty + 8 * i, 8);
    __syncthreads();

    if (w < 4) {
        /* 168 registers a thread at launch: what the consumers take (232)
         * must come out of what warpgroup 0 gives back, 256 (232 - 168) <=
         * 128 (168 - 40), or their setmaxnreg.inc waits for ever */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (w == 0) { /* the producer */
            if (lane != 0) return;
            int it = 0;
            for (int t = blockIdx.x; t < ntile; t += gridDim.x) {
                int m, n;
                gm_tile(a, t, m, n);
                /* W's two 128-row halves: rows n 256.. or gate rows n 128.. and their up rows */
                int r0 = SWIGLU ? n * 128 : n * GM_BN, r1 = SWIGLU ? a.F + n * 128 : r0 + 128;
                for (int kb = 0; kb < nk; kb++, it++) {
                    int s = it % GM_ST;
                    uint32_t st = s0 + s * GM_STAGE, fb = full + 8 * s;
                    if ((a.abl & 2) && it >= GM_ST) return;
                    if (it >= GM_ST) mbar_wait(empty + 8 * s, (it / GM_ST - 1) & 1);
                    mbar_expect_tx(fb, GM_STAGE);
                    tma_load2(st, &tx, kb * GM_BK, m * GM_BM, fb);
                    tma_load2(st + GM_A, &tw, kb * GM_BK, r0, fb);
                    tma_load2(st + GM_A + 128 * 128, &tw, kb * GM_BK, r1, fb);
                }
            }
            return;
        }
        /* the epilogue: warps 1-3 take each tile's outputs from the four
         * boxes (with SwiGLU, of the gate and up halves, in place into the
         * gate half), one thread stores them by bulk tensor copies and hands
         * the boxes back to the consumers once the copies have read them;
         * all of this runs under the consumers' MMAs of the next tile */
        if (a.abl & 1) return;
        const int te = threadIdx.x - 32; /* 0..95 */
        int ti = 0;
        for (int t = blockIdx.x; t < ntile; t += gridDim.x, ti++) {
            int m, n;
            gm_tile(a, t, m, n);
            gm_bar(GM_STAGED, true);
            if (SWIGLU) {
                /* the four boxes share one layout: chunk i of the gate half
                 * (boxes 0, 1) pairs with chunk i of the up half (2, 3) */
                for (int i = te; i < 2 * GM_BOX / 16; i += 96) {
                    uint32_t ga = so + i * 16, ua = ga + 2 * GM_BOX;
                    uint32_t v[4], u[4];
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                                 : "r"(ga));
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(u[0]), "=r"(u[1]), "=r"(u[2]), "=r"(u[3])
                                 : "r"(ua));
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        v[j] = (uint32_t)swiglu1((uint16_t)v[j], (uint16_t)u[j]) |
                               (uint32_t)swiglu1((uint16_t)(v[j] >> 16), (uint16_t)(u[j] >> 16)) << 16;
                    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(ga), "r"(v[0]), "r"(v[1]),
                                 "r"(v[2]), "r"(v[3])
                                 : "memory");
                }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* generic writes -> the bulk copy */
            }
            asm volatile("bar.sync %0, 96;\n" ::"n"(GM_EPI) : "memory");
            if (te == 0) {
                if (SWIGLU) {
                    tma_store2(&ty, n * 128, m * GM_BM, so);
                    tma_store2(&ty, n * 128 + 64, m * GM_BM, so + GM_BOX);
                } else {
                    for (int q = 0; q < 4; q++)
                        tma_store2(&ty, n * GM_BN + 64 * q, m * GM_BM, so + q * GM_BOX);
                }
                asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
            }
            gm_bar(GM_SFREE, false);
        }
        if (te == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int cw = __shfl_sync(0xffffffffu, w / 4 - 1, 0); /* consumer warpgroup 0 or 1 */
    const int row_in = (w & 3) * 16 + (lane >> 2), col_in = (lane & 3) * 4; /* bytes */
    auto release = [&](int s) { /* this warp is done with stage s */
        if (lane == 0) mbar_arrive(empty + 8 * s);
    };
    float d[128];
    int it = 0, ti = 0;
    for (int t = blockIdx.x; t < ntile; t += gridDim.x, ti++) {
        for (int kb = 0; kb < nk; kb++, it++) {
            int s = it % GM_ST;
            uint32_t st = s0 + s * GM_STAGE;
            if (!(a.abl & 2) || it < GM_ST) mbar_wait(full + 8 * s, (it / GM_ST) & 1);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < GM_BK / 16; kk++)
                wgmma256(d, wg_desc(st + cw * 64 * 128 + kk * 32, 16, 1024), wg_desc(st + GM_A + kk * 32, 16, 1024),
                         kb > 0 || kk > 0);
            wg_commit();
            wg_wait<1>(); /* the previous stage's MMAs are done: hand it back */
            acc_fence(d);
            if (kb > 0 && !(a.abl & 2)) release((it + GM_ST - 1) % GM_ST);
        }
        wg_wait<0>();
        acc_fence(d);
        if (!(a.abl & 2)) release((it + GM_ST - 1) % GM_ST);
        if (a.abl & 1) continue;

        /* the outputs, rounded to bf16, into the four boxes once the
         * previous tile's stores have read them: accumulator j * 4 + e holds
         * row row_in + 8 (e >> 1), column 8 j + 2 (lane & 3) + (e & 1) of
         * this warpgroup's 64 x 256; column c goes to box c / 64 (128-byte
         * rows, swizzled as the bulk copies read them: no bank conflicts).
         * With SwiGLU, columns 0..127 are the gate half, 128.. the up half. */
        if (ti > 0) gm_bar(GM_SFREE, true);
        const int ro = cw * 64 + row_in;
#pragma unroll
        for (int j = 0; j < 32; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int r = ro + 8 * h;
                uint32_t v = (uint32_t)f2bf(d[4 * j + 2 * h]) | (uint32_t)f2bf(d[4 * j + 2 * h + 1]) << 16;
                uint32_t at = so + (j >> 3) * GM_BOX + r * 128 + (((j & 7) ^ (r & 7)) << 4) + col_in;
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at), "r"(v) : "memory");
            }
        if (!SWIGLU) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* -> the bulk store */
        gm_bar(GM_STAGED, false);
    }
    if (ti > 0 && !(a.abl & 1)) gm_bar(GM_SFREE, true); /* the last tile's, so no barrier is left half done */
#endif
}

/* whether this device runs the kernel (compute capability 9.0: the sm_90a
 * code and the tensor-map encoder), unless cuda_gemm_wg_select(0) turned it
 * off */
static int gm_on = -1;
extern "C" void cuda_gemm_wg_select(int on) { gm_on = wg_sm90() && on != 0 && wg_tm_encoder(); }

extern "C" int cuda_gemm_wg_ok(int T, int in, int out)
{
    if (gm_on < 0) cuda_gemm_wg_select(-1);
    return gm_on && T > 0 && in > 0 && in % 8 == 0 && out > 0 && out % 16 == 0;
}

/* SMs per device (prepare fills it in on each rank's device) */
#define GM_MAXDEV 64
static int gm_nsm[GM_MAXDEV];

extern "C" cudaError_t cuda_gemm_wg_prepare(void)
{
    cudaError_t e = cudaFuncSetAttribute(gemm_wg_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, GM_SMEM);
    if (e == cudaErrorInvalidDeviceFunction) return cudaSuccess; /* no sm_90a code for this device */
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(gemm_wg_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, GM_SMEM);
    int dev = 0;
    if (e == cudaSuccess) e = cudaGetDevice(&dev);
    if (e == cudaSuccess && dev < GM_MAXDEV) e = cudaDeviceGetAttribute(&gm_nsm[dev], cudaDevAttrMultiProcessorCount, dev);
    return e;
}

/* a row-major [rows][in] bf16 matrix as a 2-d tensor, boxes of 64 x 128
 * rows (16 KB, the 128-byte swizzle); rows past the end and `in` past the
 * row read as zeros */
static bool gm_map(CUtensorMap *m, const uint16_t *base, int rows, int in)
{
    PFN_cuTensorMapEncodeTiled_v12000 enc = wg_tm_encoder();
    if (!enc || ((uintptr_t)base & 15)) return false;
    cuuint64_t dims[2] = {(cuuint64_t)in, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)in * 2};
    cuuint32_t box[2] = {GM_BK, 128}, es[2] = {1, 1};
    return enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)base, dims, strides, box, es,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

static cudaError_t gm_launch(const uint16_t *W, int wrows, const uint16_t *x, uint16_t *y, int T, int in, int out,
                             int F, cudaStream_t st)
{
    int dev = 0;
    if (!cuda_gemm_wg_ok(T, in, F ? 2 * F : out) || ((uintptr_t)y & 15) || cudaGetDevice(&dev) ||
        dev >= GM_MAXDEV || !gm_nsm[dev])
        return cudaErrorInvalidValue;
    alignas(64) CUtensorMap tx, tw, th;
    memset(&tx, 0, sizeof tx), memset(&tw, 0, sizeof tw), memset(&th, 0, sizeof th);
    if (!gm_map(&tx, x, T, in) || !gm_map(&tw, W, wrows, in) || !gm_map(&th, y, T, F ? F : out))
        return cudaErrorInvalidValue;
    const int abl = cuda_tuning.gemm_wg_ablate & 3;
    gm_args a = {T, in, out, F, (T + GM_BM - 1) / GM_BM, F ? (F + 127) / 128 : (out + GM_BN - 1) / GM_BN, y, abl};
    int ntile = a.nm * a.nn, grid = ntile < gm_nsm[dev] ? ntile : gm_nsm[dev];
    if (F)
        gemm_wg_kernel<true><<<grid, GM_THR, GM_SMEM, st>>>(tx, tw, th, a);
    else
        gemm_wg_kernel<false><<<grid, GM_THR, GM_SMEM, st>>>(tx, tw, th, a);
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_gemm_wg_swiglu(const uint16_t *Wgu, const uint16_t *x, uint16_t *h, int T, int in, int F,
                                           cudaStream_t st)
{
    return gm_launch(Wgu, 2 * F, x, h, T, in, 0, F, st);
}

extern "C" cudaError_t cuda_gemm_wg(const uint16_t *W, const uint16_t *x, uint16_t *y, int T, int in, int out,
                                    cudaStream_t st)
{
    return gm_launch(W, out, x, y, T, in, out, 0, st);
}
