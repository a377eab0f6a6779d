/* moe.h - the GPU backend's mixture-of-experts FFN (MODEL_FFN_MOE; internal
 * to cuda/): the device kernels (moe.cu) and the layer's upload and step
 * (moe_layer.c: a name of its own, as build/cuda/moe.o is moe.cu's).
 *
 * A step of an MoE layer, all on the device (nothing the host decides from
 * data, so decode steps stay inside their CUDA graph):
 *  1. route: the router's logits (a block of 8 warps per router row, f32
 *     sums in a fixed order whatever the step, or for big steps of a bf16 router on tensor cores:
 *     cuda_moe_router_gemm; the router weight kept as the file stores it,
 *     bf16 or f32), then per token what model_moe_route does (softmax
 *     top-k with or without renormalisation; sigmoid scores, the correction
 *     bias used only to choose, group-limited choice, renormalised weights
 *     times routed_scaling_factor; ties to the lower expert), experts in
 *     ascending order. Slot K of each token is the shared experts (expert
 *     NE), weighed 1 or by sigmoid(x . shared_expert_gate) (qwen2_moe);
 *  2. group: the token-slot assignments counted per expert, an exclusive
 *     prefix sum, and a scatter into per-expert lists (a counting sort), plus
 *     the list of experts that have any;
 *  3. experts: one launch for gate|up with the (clamped) SwiGLU, one for
 *     down, each over every active expert's gathered rows, the shared
 *     experts among them (no launch of their own), reading only the chosen
 *     experts' weights (bf16, or packed int4/int8 in qgemm.h's layout,
 *     expert by expert): SIMT GEMVs (moe.cu) for steps of few rows per
 *     expert, a grouped GEMM on tensor cores (moe_gemm.cu) for the others
 *     (cuda_moe_gemm_takes: cuda_tuning.moe_gemm_min_rows, or
 *     moe_gemm_min_rows_packed for a layer with packed experts);
 *  4. combine: each token's expert outputs weighed and summed in ascending
 *     expert order, then the shared experts, as the CPU does.
 * Small steps (decode: cuda_moe_small, T S <= CUDA_MOE_SMALL_SLOTS) take
 * three launches instead of six: the logits, routing and grouping in one
 * (cuda_moe_route_group: a block per router row computes the logits, the
 * last block to finish, found with a counter, routes and groups), gate|up
 * (cuda_moe_gate_up_small: a few rows a warp, all of a pass's weights
 * requested at once), and down fused with the combine
 * (cuda_moe_down_combine: a token's output rows sum its slots' down
 * products in the same order, no atomics), chained by programmatic
 * dependent launch where it is on (pdl.cuh: each requests the weights it
 * already knows before it waits for its predecessor); a layer whose shared
 * experts are of another kind than its routed ones runs gate|up and down
 * of each in kernels of that kind (five launches). Every stage computes
 * each value with the general path's sequence of operations, so the two
 * paths give the same bits (small steps never take the tensor cores).
 * Tensor parallel (N ranks): every rank routes alike (the same input, the
 * same kernels) and holds rows [k F/N, (k+1) F/N) of every expert's gate
 * and up and those columns of its down, so its combine is a partial sum
 * (f32) that one all-reduce per layer completes, as for a dense MLP.
 * Within each path (expert GEMVs or GEMM; SIMT or tensor-core logits) every
 * dot product is one fixed f32 chain over the input whatever the tiling,
 * so a token's output does not depend on which other tokens share the step
 * (batch invariance); the paths sum in different orders, and which one a
 * step takes depends on its size (T K against NE; T for the router), as
 * the dense layers' GEMV and GEMM do.
 */
#ifndef SLUICE_CUDA_MOE_H
#define SLUICE_CUDA_MOE_H

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One expert matrix [rows][cols] on the device: bf16 w, or (w NULL) packed
 * as qgemm.h's struct cuda_qmat lays it out, with the inverse of an
 * act-order permutation (iperm[c]: the packed position of column c). */
struct cuda_moe_mat {
    const uint16_t *w;      /* [rows][cols] bf16, or NULL */
    const uint8_t *qw;      /* [rows][row_bytes] */
    const uint16_t *scales; /* [rows][n_groups] f16 or bf16 */
    const uint8_t *zeros;   /* [rows][n_groups] or NULL (2^(bits-1)) */
    const int32_t *iperm;   /* [cols] or NULL */
    int bits, group, n_groups, row_bytes;
    int f16;                /* scales are f16, else bf16 */
};

/* Expert e of a layer: gate, up [F][E] and down [E][F]. */
struct cuda_moe_expert {
    struct cuda_moe_mat gate, up, down;
    int F;
};

/* One MoE layer's step on the device. Pointers are device memory. */
struct cuda_moe_args {
    int T, E;                 /* tokens, hidden size */
    int NE, K, S;             /* routed experts, experts per token, slots per token (K + 1 with shared experts) */
    int Fmax;                 /* the widest expert intermediate (routed or shared): h's row stride */
    int sigmoid;              /* the router: 0 softmax (qwen3_moe, qwen2_moe), 1 sigmoid (glm4_moe, deepseek_v3) */
    int norm_topk;            /* the chosen weights renormalised */
    int n_group, topk_group;  /* group-limited choice (1, 1: off) */
    int shared_gated;         /* the shared slot's weight is sigmoid(x . router row NE) */
    float scale;              /* routed_scaling_factor (sigmoid router) */
    float swiglu_limit;       /* 0: no clamp */
    const uint16_t *xn;       /* [T][E] bf16: the normalised input */
    const void *router;       /* [NE + shared_gated][E], f32 when router_f32, else bf16 */
    int router_f32;
    const float *bias;        /* [NE] e_score_correction_bias, or NULL */
    const struct cuda_moe_expert *ex; /* [NE + 1]: routed experts, then the shared experts (F 0: none) */
    int streamed;             /* every routed expert matrix is of one kind the small path has kernels of its
                               * own for (cuda_moe_streamed: CUDA_MOE_STREAM_INT4, _INT8 or _BF16; 0: any,
                               * found expert by expert, in kernels that hold the registers of every kind's
                               * decoding) */
    int streamed_shared;      /* the same for the shared experts' matrices (cuda_moe_streamed's *shared);
                               * where it differs from streamed (both nonzero) the small path runs the routed
                               * slots and the shared one in kernels of each kind's own; 0 with shared
                               * experts: the kernels for any kind */
    int packed;               /* any expert is packed: the GEMM threshold for packed experts applies, and
                               * the GEMM keeps shared memory for streaming codes (without it a packed expert
                               * loads element by element) */
    /* scratch, sized for T tokens */
    float *logits;            /* [T][NE + 1] */
    int32_t *idx;             /* [T][S] expert of each slot (ascending, then NE) */
    float *wt;                /* [T][S] its weight */
    int32_t *count;           /* [NE + 1] assignments per expert (the general grouping's); zero between steps
                               * (allocate it zeroed): the small path's routing counts its blocks on count[0] */
    int32_t *start;           /* [NE + 2] their offsets in list */
    int32_t *list;            /* [T S] assignments (t S + slot) grouped by expert */
    int32_t *act;             /* [NE + 2]: the experts with assignments, ascending; their number at act[NE + 1] */
    uint16_t *h;              /* [T S][Fmax] bf16: each assignment's SwiGLU output */
    float *y;                 /* [T S][E] f32: each assignment's expert output */
    uint16_t *out;            /* [T][E] bf16: the block's output */
    float *outf;              /* or, non-NULL, [T][E] f32 instead (a rank's partial sum, N > 1) */
    /* decode's fused forms (one token, cuda_moe_fuses), each bit for bit the unfused kernels': */
    const float *xf;          /* non-NULL: xn = RMSNorm(xf) by nw, eps, made in the routing kernel's prologue
                               * (cuda_add_rmsnorm's bits, no delta) and stored into xn for the experts */
    const float *nw;
    float eps;
    float *resid;             /* non-NULL: out not written, resid += its bf16 values (cuda_add_rmsnorm's add) */
};

/* The four stages (see the file comment), enqueued on st; each returns the
 * launch's error. cuda_moe_experts is the grouped GEMM where
 * cuda_moe_gemm_takes, else the GEMVs cuda_moe_gate_up then cuda_moe_down
 * (into y). cuda_moe_forward runs them all, or for a small step
 * cuda_moe_route_group, cuda_moe_gate_up_small and cuda_moe_down_combine
 * (which refuse a step that is not small; cuda_moe_gate_up_small reads the
 * grouping cuda_moe_group leaves too). Graph-capture safe: grids depend on
 * T and the shapes only. */
cudaError_t cuda_moe_route(const struct cuda_moe_args *a, cudaStream_t st);
cudaError_t cuda_moe_group(const struct cuda_moe_args *a, cudaStream_t st);
cudaError_t cuda_moe_experts(const struct cuda_moe_args *a, cudaStream_t st);
cudaError_t cuda_moe_gate_up(const struct cuda_moe_args *a, cudaStream_t st);
cudaError_t cuda_moe_down(const struct cuda_moe_args *a, cudaStream_t st);
cudaError_t cuda_moe_combine(const struct cuda_moe_args *a, cudaStream_t st);
cudaError_t cuda_moe_route_group(const struct cuda_moe_args *a, cudaStream_t st);
cudaError_t cuda_moe_gate_up_small(const struct cuda_moe_args *a, cudaStream_t st);
cudaError_t cuda_moe_down_combine(const struct cuda_moe_args *a, cudaStream_t st);
cudaError_t cuda_moe_forward(const struct cuda_moe_args *a, cudaStream_t st);
/* Whether a's step may take the fused forms (xf, resid): one token, a small
 * step, no outf, the norm's row fits the routing kernel's shared memory.
 * The stages refuse xf or resid elsewhere (cudaErrorInvalidValue). */
int cuda_moe_fuses(const struct cuda_moe_args *a);

/* What cuda_moe_args.streamed should be for these experts (hex: the host
 * copy of the [NE + 1] descriptors, shared experts last, F 0: none; E the
 * hidden size), the routed experts' kind: CUDA_MOE_STREAM_INT4 where every
 * routed gate, up and down matrix is int4 in natural column order with
 * groups of a multiple of 8 columns and 16-byte rows, CUDA_MOE_STREAM_INT8
 * the same of int8, CUDA_MOE_STREAM_BF16 where every one is bf16 of a
 * multiple of 8 columns, else 0; *shared (cuda_moe_args.streamed_shared)
 * the shared experts' kind alike (the routed one where there are none).
 * Checkpoints often quantize the shared expert otherwise than the routed
 * ones (GLM-5.3-Flash: int4 g32 routed, int8 per-channel shared; W4A16
 * exports that leave it bf16): such a layer keeps kernels of its own kinds. */
#define CUDA_MOE_STREAM_INT4 1
#define CUDA_MOE_STREAM_BF16 2
#define CUDA_MOE_STREAM_INT8 3
int cuda_moe_streamed(const struct cuda_moe_expert *hex, int NE, int E, int *shared);

/* Whether a's step is small (nonzero: cuda_moe_forward takes the fused
 * kernels): at most CUDA_MOE_SMALL_SLOTS assignments (T S), at most 32
 * slots a token, and the routing scratch of the one routing block fits
 * its shared memory (experts up to about 600). */
int cuda_moe_small(const struct cuda_moe_args *a);
#define CUDA_MOE_SMALL_SLOTS 128

/* ---- the grouped GEMM (moe_gemm.cu) ---- */
/* Whether cuda_moe_experts runs this step on the grouped GEMM: T K >=
 * cuda_tuning.moe_gemm_min_rows NE (moe_gemm_min_rows_packed when a.packed;
 * an average of that many rows per routed expert; a negative setting:
 * never). Reads the global cuda_tuning: set it outside graph capture. */
int cuda_moe_gemm_takes(const struct cuda_moe_args *a);
/* Stage 3 on tensor cores, cuda_moe_experts' contract (h, then y, for
 * every assignment a.list holds), whatever cuda_moe_gemm_takes says: two
 * launches whose grids depend on T and the shapes only. */
cudaError_t cuda_moe_gemm(const struct cuda_moe_args *a, cudaStream_t st);
/* The router's logits on tensor cores: a.logits[t][e] = xn[t] . router[e]
 * for e < NE + shared_gated, f32, each element one fixed chain of MMAs over
 * E in ascending k (so batch invariant; it differs from stage 1's SIMT
 * logits in the last bits). bf16 routers only (cudaErrorInvalidValue for
 * an f32 one). cuda_moe_route takes it from cuda_tuning.moe_router_gemm_min_t
 * tokens a step. Graph-capture safe. */
cudaError_t cuda_moe_router_gemm(const struct cuda_moe_args *a, cudaStream_t st);

/* The largest routed-expert count the routing kernel takes (its scratch
 * lives in shared memory). */
#define CUDA_MOE_MAX_EXPERTS 4096

#ifdef __cplusplus
}
#endif

/* ---- the backend's side (moe_layer.c; C only) ---- */
#ifndef __CUDACC__
struct rank;
struct model_config;

/* Whether the GPU backend takes layer l, an MoE layer of c, at tp ranks
 * (each rank holds 1/tp of every expert's intermediate rows, so they must
 * divide): 0, or SL_EUNSUP with a message naming the layer and the reason. */
int cuda_moe_check(const struct model_config *c, int tp, int l, char *err, size_t errlen);

/* A layer's MoE weights and step scratch on one rank (clayer.moe). */
struct cuda_moe_layer {
    struct cuda_moe_expert *hex;   /* [NE + 1] host copy of the descriptors */
    struct cuda_moe_expert *dex;   /* [NE + 1] device */
    void **mem;                    /* device allocations (experts, router, bias) */
    int n_mem, cap_mem;
    void *router;                  /* [NE + shared_gated][E] bf16 or f32 */
    bool router_f32;
    float *bias;                   /* [NE] or NULL */
    bool packed;                   /* any expert packed (cuda_moe_args.packed) */
    int streamed, streamed_shared; /* cuda_moe_args.streamed, .streamed_shared */
};

/* The per-rank step scratch every MoE layer shares (rank.moex), sized for
 * max_tokens. */
struct cuda_moe_rank {
    float *logits, *wt, *y;
    int32_t *idx, *count, *start, *list, *act;
    uint16_t *h;
    int Fmax;
};

/* Uploads layer l's MoE weights to rank k (and, at the first MoE layer, the
 * rank's scratch). Returns 0, or a negative status with a message naming
 * the tensor. */
int cuda_moe_upload(struct rank *k, int l, char *err, size_t errlen);
/* Frees what cuda_moe_upload made for layer l (the rank's scratch with
 * the last layer's); accepts a layer without any. */
void cuda_moe_free(struct rank *k, int l);
/* Whether layer l's MoE block at T tokens may take the fused forms (one
 * GPU, cuda_moe_fuses). */
bool cuda_moe_ffn_fuses(struct rank *k, int l, int T);
/* Layer l's MoE block over k->xn [T][E] into k->delta, enqueued on k->st;
 * with nw (where cuda_moe_ffn_fuses) over RMSNorm(k->x) by nw instead, made
 * in the routing kernel (and left in k->xn), its output added into k->x:
 * the bits of cuda_add_rmsnorm before and after the unfused block. */
int cuda_moe_ffn(struct rank *k, int l, int T, bool decode, const float *nw, char *err, size_t errlen);
#endif

#endif
