/* tuning.h - the CUDA backend's settings that are not command-line flags:
 * one struct, its defaults in one place (CUDA_TUNING_DEFAULTS, below), and
 * nothing read from the environment. The server never changes it; tests
 * and benchmarks set fields of cuda_tuning before they create a backend
 * (model_backend_create reads it then; attn_wg.cu, gemm_wg.cu, moe.cu,
 * moe_gemm.cu and mla_prefill.cu read their fields at each launch, so set
 * them outside graph capture).
 * The flags that reach the backend (--enforce-eager for CUDA graphs off,
 * --kv-cache-dtype, --tensor-parallel-size, ...) come through
 * struct model_backend_opts instead. docs/configuration.md lists both.
 */
#ifndef SLUICE_CUDA_TUNING_H
#define SLUICE_CUDA_TUNING_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* kernels a benchmark may leave out of every step (cuda_tuning.ablate) */
enum {
    CUDA_ABLATE_ATTN = 1, /* RoPE + KV write and the attention */
    CUDA_ABLATE_NORM = 2, /* the RMSNorms (outside the fused GEMVs) */
    CUDA_ABLATE_QKV = 4,  /* the qkv projection */
    CUDA_ABLATE_O = 8,    /* the o projection */
    CUDA_ABLATE_GU = 16,  /* the gate|up projection and SwiGLU */
    CUDA_ABLATE_DOWN = 32, /* the down projection */
    CUDA_ABLATE_HEAD = 64, /* the LM head */
    CUDA_ABLATE_MOE = 128, /* the MoE FFNs (routing, experts, shared experts) */
};

struct cuda_tuning {
    /* ---- operational ---- */
    bool warmup;          /* warm up when the KV cache is allocated: load every kernel and capture the decode
                           * graphs before the first request, which otherwise pays for them (true) */
    bool tp_peer_allreduce; /* tensor parallelism: all-reduces of up to 8 MiB / (N - 1) on the peer-memory
                           * kernel where every pair of GPUs has peer access; false: NCCL for all of them
                           * (true: at TP=2 it halves a small all-reduce's latency) */
    /* ---- for tests: reach paths the defaults take only on other shapes ---- */
    int gemm_wg_min_t;    /* the gate|up GEMM with SwiGLU fused (warpgroup MMA, sm_90) from this many tokens
                           * a step (CUDA_GEMM_WG_MIN_T, 128: below it cuBLAS + SwiGLU measured faster);
                           * tests set 1 so that every step of 5+ tokens takes it */
    float moe_gemm_min_rows; /* bf16 experts on the grouped GEMM (tensor cores, moe_gemm.cu) from T K >= this NE
                           * routed rows a step (0.5; bench_moe at the Qwen3-30B-A3B shape on an H100: at T 32,
                           * T K = 2 NE, the GEMM 606 us against the SIMT GEMVs' 830); tests set 0 (always) or -1
                           * (never) */
    float moe_gemm_min_rows_packed; /* the same for packed (int4/int8) experts (3: bench_moe, int4 g128 on an H100:
                           * at T K = 2 NE the GEMVs 1,544 us against the GEMM's 1,772, at 4 NE the GEMM 2,088
                           * against 3,492; a layer counts as packed when any expert is: cuda_moe_args.packed).
                           * Small steps (cuda_moe_small: T S <= 128) take the fused GEMV path whatever these say */
    int moe_router_gemm_min_t; /* a bf16 router's logits on tensor cores (cuda_moe_router_gemm) from this many
                           * tokens a step (1024), below it the SIMT kernel (other last bits); -1: never;
                           * test_moe sets -1 so that a token alone routes from the bits it has in a batch */
    int long_split_keys;  /* a prefill tile attending to this many keys or more may be split over blocks
                           * (4096); tests set 64 to split short prompts; 0: never */
    int mla_prefill_min_t; /* an MLA step of this many query tokens or more, not all of them decodes,
                           * attends on the tensor cores (cuda_mla_prefill, 128); below it the SIMT kernel,
                           * which splits a token's keys over blocks and so fills the GPU with few tokens,
                           * where the tensor-core kernel (one block per 64 (token, head) rows, no split)
                           * would leave most SMs idle at 16 heads; tests set 1 */
    int mla_prefill_rows; /* the tensor-core MLA attention's rows a block: 0 by the GPU's shared memory (64,
                           * or 32 where a block has under ~190 KB, sm_89); tests set 32 to run sm_89's
                           * configuration on an H100 */
    bool mla_expand;      /* dense MLA's query tokens at prompt positions in prefill steps attend in the expanded
                           * form (the context's latents up-projected per head, then the GQA tensor-core
                           * kernel: 320 multiply-adds a key and head at DeepSeek's shape, against the absorbed
                           * form's 1088), where the rank's scratch was allocated (true); false: the absorbed
                           * form everywhere, for tests and for benchmarks that compare the two */
    int mla_expand_rows;  /* the expanded form's query rows (tokens) an attention block: 64 or 128 (0: 128) */
    int kda_chunk_min_t;  /* a KDA step of this many tokens or more, not a decode step, runs the delta rule in
                           * chunks (cuda_kda_chunk: matrix products within a chunk, the state carried between
                           * chunks) instead of token by token (cuda_kda_recur) (64: one chunk); tests set 1
                           * (every non-decode step) or 0 (never) */
    int kda_chunk_len;    /* the chunked KDA's tokens a chunk: 0 by the GPU's shared memory (64 at head_dim
                           * 128 on an H100, 202 KB a block at 32 columns; 16 on sm_89's 99 KB); tests set
                           * others (1 to 64) */
    int tp_fault_rank;    /* tensor parallelism: this rank fails its forward number tp_fault_step with an
                           * injected error, to test that the others stop (-1: none) */
    long tp_fault_step;
    /* ---- benchmarks only: the outputs are wrong, the backend says so on stderr ---- */
    unsigned ablate;      /* CUDA_ABLATE_* kernels left out of every step, to see what each costs (0) */
    bool tp_skip_comm;    /* tensor parallelism without its collectives (false) */
    bool attn_wg8_skip_widen; /* the warpgroup prefill attention leaves the fp8 cache's stages unwidened */
    int gemm_wg_ablate;   /* the warpgroup GEMM: 1 without its epilogue, 2 without the loads after the
                           * first stages, 3 neither (0) */
};

#define CUDA_TUNING_DEFAULTS                                                                          \
    {                                                                                                 \
        .warmup = true, .tp_peer_allreduce = true, .gemm_wg_min_t = 128, .moe_gemm_min_rows = 0.5f,   \
        .moe_gemm_min_rows_packed = 3.0f, .moe_router_gemm_min_t = 1024, .long_split_keys = 4096,     \
        .mla_prefill_min_t = 128, .mla_prefill_rows = 0, .mla_expand = true, .mla_expand_rows = 0,    \
        .kda_chunk_min_t = 64, .kda_chunk_len = 0,                                                    \
        .tp_fault_rank = -1, .tp_fault_step = 0,                                                      \
        .ablate = 0, .tp_skip_comm = false,                                                           \
        .attn_wg8_skip_widen = false, .gemm_wg_ablate = 0,                                            \
    }

/* The settings every backend created from now on takes (cuda_backend.c
 * holds it, initialized to CUDA_TUNING_DEFAULTS). Not thread-safe: set it
 * before creating a backend, with none running. */
extern struct cuda_tuning cuda_tuning;

/* "attn,norm,qkv,o,gu,down,head" (any subset, comma-separated) as
 * CUDA_ABLATE_* bits; -1 for an unknown name. For benchmarks' options. */
int cuda_ablate_parse(const char *list);

#ifdef __cplusplus
}
#endif
#endif
