/* kda_chunk.h - the KDA delta rule in chunks on the GPU (cuda/kda_chunk.cu),
 * for prefill: the same recurrence as cuda_kda_recur (kda.h), the same
 * arguments and the same results (the outputs before and after the gated
 * norm, the final state, the conv tails, the snapshots), reassociated so
 * that a chunk of tokens is a few matrix products instead of a walk token by
 * token (the reference's chunk_kda). The arithmetic, step by step, is
 * recur_chunked's in model/cpu_kda.c (cpu_kda_set_chunk), the CPU form that
 * tests/test_kda.c checks against the recurrence, but for the decays between
 * tokens of one 16-token sub-chunk (products of the tokens' decays, as the
 * recurrence has them, not an exp a pair); the matrix products run on the
 * tensor cores in split-precision tf32 (3xTF32: ~f32 accuracy).
 *
 * Chunks lie on the absolute position grid (multiples of the chunk length)
 * and end at the step's snapshots, so a prompt split across steps at grid
 * points, or restored from a snapshot, gives the bits of one pass; other
 * splits agree with it to f32 rounding, as they do with the recurrence. */
#ifndef SLUICE_CUDA_KDA_CHUNK_H
#define SLUICE_CUDA_KDA_CHUNK_H

#include "cuda/kda.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CUDA_KDA_CHUNK_MAX 64 /* tokens a chunk at most */

#ifdef __CUDACC__
#define CUDA_KDA_HD __host__ __device__
#else
#define CUDA_KDA_HD
#endif
/* The fragments of mma.sync m16n8k8 .tf32 as the chunk kernel's products
 * load and store them: lane 0..31's register i holds A's element (row,
 * column) (i 0..3), B's (k, n) (i 0..1), C's and D's (i 0..3). Here so that
 * tests/gpu/test_kda.c checks them on the host against the PTX ISA's tables
 * ("Matrix Fragments for mma.m16n8k8") through an emulated warp. */
static inline CUDA_KDA_HD int cuda_kda_frag_arow(int lane, int i) { return (lane >> 2) + (i & 1) * 8; }
static inline CUDA_KDA_HD int cuda_kda_frag_acol(int lane, int i) { return (lane & 3) + (i >> 1) * 4; }
static inline CUDA_KDA_HD int cuda_kda_frag_brow(int lane, int i) { return (lane & 3) + i * 4; }
static inline CUDA_KDA_HD int cuda_kda_frag_bcol(int lane) { return lane >> 2; }
static inline CUDA_KDA_HD int cuda_kda_frag_crow(int lane, int i) { return (lane >> 2) + (i >> 1) * 8; }
static inline CUDA_KDA_HD int cuda_kda_frag_ccol(int lane, int i) { return 2 * (lane & 3) + (i & 1); }

/* Lets cuda_kda_chunk use the shared memory its chunks need (the most the
 * device allows a block): once per device, before the first launch, outside
 * graph capture. */
cudaError_t cuda_kda_chunk_prepare(void);
/* The chunk length cuda_kda_chunk takes for chunk 0 at head_dim D and
 * `cols` value columns a block (0: CUDA_KDA_COLS) on the current device: the
 * longest of 64, 32, 16, 8 whose shared memory fits (64 on an H100 at D 128
 * and 32 or 64 columns: 202 or 226.5 KB of its 227; 16 on sm_89's 99 KB at
 * 32 columns, 32 at 16), 0 when none does. */
int cuda_kda_chunk_len(int D, int cols);
/* The layer's delta rule over every sequence of the step in chunks of
 * `chunk` tokens (1 .. CUDA_KDA_CHUNK_MAX; 0: cuda_kda_chunk_len), then the
 * gated output norm and the conv tails: what cuda_kda_recur writes, from the
 * same arguments (a->cols: value columns a block, as there; 0: CUDA_KDA_COLS,
 * or wider while the heads' blocks would outnumber the SMs). work: [T][3C]
 * f32 scratch, T the step's rows (the convolved, normed q|k|v). Three
 * launches; not for graph capture (a prefill path). cudaErrorInvalidValue for
 * a shape it cannot take. */
cudaError_t cuda_kda_chunk(const struct cuda_kda_args *a, int chunk, float *work, cudaStream_t st);

#ifdef __cplusplus
}
#endif

#endif
