/* kda.h - KDA linear attention on the GPU backend (internal to cuda/): the
 * kernels of kda.cu and the host side of kda_step.c (upload, state slots, the
 * step's inputs, the mixer). The CPU reference is model/cpu_kda.c; a state
 * slot has its layout (per KDA layer at its offset: [H][D][D] f32 S, S[k][v],
 * then the conv tail [K-1][3C] f32, the last K-1 projected q|k|v inputs,
 * oldest first), so a slot means the same on both backends (on one GPU;
 * tensor parallel, each rank holds its heads' share: kda_step.c).
 *
 * A step: q|k|v, f_a, b and g_a projections of xn (cuda_proj, packed or
 * bf16; f_a and g_a to bf16, then f_b and g_b). The q|k|v projection takes
 * xn in two parts, its bf16 rows and below them their low part (the f32
 * RMS norm of the residual minus the bf16 value, cuda_kda_xsplit), as 2T
 * rows of one GEMM whose two halves the kernels add: the recurrence is
 * sensitive to q, k and v (L2-normed over a head, then summed over the
 * whole sequence in S), and on glm5-kda rounding xn to bf16 for q|k|v alone
 * moved the logits 5e-2 on the CPU, while doing so for f_a, b or g_a, or
 * rounding f_a's output, moved them 6e-3 at most each. Then the recurrence
 * (kda.cu, cuda_kda_recur): one block per (sequence, head, block of `cols`
 * value columns) walks the sequence's tokens in order: the short causal
 * conv over the head's q, k channels and its v columns (windows in
 * registers, starting from the slot's tail) with SiLU, the L2 norms, the
 * forget gate and beta, the delta rule on its columns of the head's S in
 * registers (four threads a column, each a quarter of its rows, their
 * partial sums added in a fixed order), the snapshots' S after their
 * tokens; no bit depends on the split. A second kernel, one block per
 * (sequence, head), does the gated RMS norm of the output and writes the
 * conv tails (the slot's and the snapshots'). Then o_proj into k->delta
 * (cuda_proj_rows). Token by token, so a prompt split across steps
 * anywhere gives the state of one pass.
 * Which slots a sequence reads and writes, and its snapshots, come from the
 * step-input buffer (struct inlay's kda_seqs and kda_snaps, filled by
 * cuda_kda_pack), so decode steps are captured as graphs like the rest.
 *
 * Speculative decoding (backend.h, step_seq.n_draft; b->max_draft > 0): a
 * verify step walks all of a sequence's query tokens (its outputs and
 * snapshots as usual) but leaves in the slot the state after its last
 * non-draft token (always accepted: n - nd tokens of the step), and saves
 * each draft token's recurrence inputs (q|k|v as the conv reads them, the
 * forget gate's f_b output, beta's logit: 4C + H f32 per KDA layer) in the
 * replay scratch. Once the host knows how many drafts each sequence kept
 * (the verification after the step), cuda_kda_rollback replays the accepted
 * ones from the scratch through the same kernels (replay mode: no outputs),
 * which leaves the slot bit for bit as a walk of the accepted tokens would:
 * the same inputs through the same arithmetic. Rejected drafts cost
 * nothing; a sequence that accepted a drafts costs one more read and write
 * of its state and a tokens of the recurrence (the replay: the two kernels
 * once a KDA layer, over every sequence that accepted some).
 * Why this and not the CPU's state after every verified position, at
 * GLM-5.3-Flash's shape (34 KDA layers of 64 heads of 128, conv 4: a
 * state of 145.6 MiB a sequence; a draft token's inputs 34 x (4 x 8192 + 64)
 * x 4 B = 4.26 MiB), per sequence with 3 / 4 drafts, on one GPU:
 *  - a state per draft position: 437 / 582 MiB (109 / 146 GiB for 256
 *    sequences), and the copy of the accepted one;
 *  - the start state and the inputs, recomputing up to the accepted
 *    position: 146 + 17 / 21 MiB (41 / 42 GiB for 256), a copy of every
 *    speculating state each step;
 *  - this: the drafts' inputs only, 12.8 / 17 MiB (3.2 / 4.3 GiB for 256),
 *    no copy; the slot is the start state. Each rank keeps and replays its
 *    own heads, so at TP=2 half of that a GPU.
 * The scratch is allocated at creation, sized for max_seqs x max_draft
 * draft tokens (only with max_draft > 0), so the memory plan counts it
 * before the KV pool (base.spec_state_bytes; the start-up line prints it). Decode steps never carry drafts, so their
 * graphs are unchanged; a verify step is not decode-only and runs eagerly.
 * The replay is a second, small job on every rank (JOB_KDA_ROLLBACK: one
 * copy of its entries, then its two launches a KDA layer, 68 at
 * GLM-5.3-Flash's shape), captured as a CUDA graph per batch bucket (its
 * entries padded to the bucket) unless --enforce-eager.
 */
#ifndef SLUICE_CUDA_KDA_H
#define SLUICE_CUDA_KDA_H

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUDA_KDA_MAX_K 8     /* conv taps a kernel keeps in registers */
#define CUDA_KDA_MAX_D 128   /* head_dim: a recurrence thread holds D / 4 rows of a column of S in registers */
#define CUDA_KDA_COLS 32     /* value columns a recurrence block takes by default (cuda_kda_args.cols) */

enum { CUDA_KDA_CONTINUE, CUDA_KDA_ZERO, CUDA_KDA_RESTORE };

/* One sequence of the step (n 0: a padding entry, nothing read or written). */
struct cuda_kda_seq {
    int32_t t0, n;          /* its first row in the step, its tokens */
    int32_t p0;             /* the position of its first token */
    int32_t slot, mode, from; /* state slot; CUDA_KDA_*; the slot restored from (mode RESTORE) */
    int32_t snap0, n_snaps; /* its snapshots: kda_snaps[snap0 .. snap0 + n_snaps), ascending positions */
    int32_t nd, spec0;      /* drafts: the slot keeps the state after the first n - nd tokens, and the last nd
                               tokens' inputs go to rows spec0 .. spec0 + nd - 1 of the replay scratch (0: none) */
};
/* After the sequence's first `pos` tokens, copy its state into slot `slot`. */
struct cuda_kda_snap {
    int32_t pos, slot;
};

/* Before a step's first KDA layer: for sequences [0, n_seqs) of seqs, slot
 * `slot` (slot_floats floats at states + slot * slot_floats) zeroed (mode
 * ZERO) or copied from slot `from` (mode RESTORE); CONTINUE: untouched. */
cudaError_t cuda_kda_begin(float *states, size_t slot_floats, const struct cuda_kda_seq *seqs, int n_seqs,
                           cudaStream_t st);

struct cuda_kda_args {
    const float *qkv;       /* [T][3C] q|k|v projections, f32 */
    const float *qkv_lo;    /* [T][3C] added to qkv (the projection of xn's low part), or NULL */
    const float *fg;        /* [T][C] f_b(f_a(xn)), f32 (dt_bias not added) */
    const float *beta;      /* [T][H] b_proj(xn), f32 (before the sigmoid) */
    const float *gate;      /* [T][C] g_b(g_a(xn)), f32 (before the sigmoid) */
    const float *conv;      /* [3][C][K] taps: q, k, v */
    const float *dt_bias;   /* [C] */
    const float *A;         /* [H] exp(A_log) */
    const float *o_norm;    /* [D] */
    float *states;          /* [n_slots][slot_floats] */
    size_t slot_floats, off; /* floats a slot; this layer's first float in a slot */
    const struct cuda_kda_seq *seqs; /* [n_seqs] */
    const struct cuda_kda_snap *snaps;
    int n_seqs, H, D, K;    /* D <= CUDA_KDA_MAX_D, K <= CUDA_KDA_MAX_K */
    bool lower_bound;       /* log-decay lower_bound sigmoid(A g), else -A softplus(g) */
    float lb, eps;          /* the bound; the output norm's epsilon */
    int cols;               /* value columns a block of the recurrence (0: CUDA_KDA_COLS); no result depends on it */
    float *o32;             /* [T][C] f32 scratch: the outputs before the norm */
    uint16_t *out;          /* [T][C] bf16: the gated, normed output before o_proj */
    /* this layer's replay scratch (drafts: cuda_kda_seq.nd), [rows][3C] q|k|v (qkv + qkv_lo), [rows][C] fg,
     * [rows][H] beta; NULL without drafts */
    float *spec_qkv, *spec_fg, *spec_beta;
    /* the replay: qkv (qkv_lo NULL), fg and beta are the scratch above, each sequence's rows t0 .. t0 + n - 1
     * its accepted drafts, its slot advanced over them (S and the conv tail); no outputs (gate, o32, out,
     * o_norm unused), no snapshots */
    bool replay;
};
/* Lets cuda_kda_recur use the shared memory D = CUDA_KDA_MAX_D needs (over
 * 48 KB): once per device, before the first launch, outside graph capture. */
cudaError_t cuda_kda_prepare(void);
/* The layer's recurrence over every sequence of the step (see the file
 * comment; two launches); rows of out for tokens of no sequence are left
 * alone. */
cudaError_t cuda_kda_recur(const struct cuda_kda_args *a, cudaStream_t st);
/* hl [2T][E] bf16: rows [0, T) a copy of xn, rows [T, 2T) bf16(y - xn) with
 * y[t] = w * x[t] / rms(x[t]) in f32, the value xn rounds (x [T][E] f32 the
 * residual, w [E] the block's norm weight), so hi + lo carries y to ~2^-17. */
cudaError_t cuda_kda_xsplit(const float *x, const float *w, const uint16_t *xn, int T, int E, float eps,
                            uint16_t *hl, cudaStream_t st);

#ifdef __cplusplus
}
#endif

/* ---- kda_step.c (host side; C only; not kda.c: its object would be kda.cu's) ---- */
#ifndef __CUDACC__
struct rank;
struct cuda_backend;
struct step;
struct qproj;

/* A KDA layer's weights on one rank (struct clayer's kda). */
struct cuda_kda_layer;
/* Per rank: state slots, scratch, shapes (struct rank's kdax). */
struct cuda_kda_rank;

/* Uploads layer l (a KDA layer) to rank k and, at the first, allocates the
 * rank's scratch for b->max_tokens rows. 0, or an error with a message. */
int cuda_kda_upload(struct rank *k, int l, char *err, size_t errlen);
/* Frees layer l's share (and, at the last KDA layer, the rank's). */
void cuda_kda_free(struct rank *k, int l);
/* The packed workspace layer l's projections need (weights.c's qws sizing). */
void cuda_kda_qws_need(const struct rank *k, int l, size_t *deq, size_t *xp);
/* (Re)allocates n_slots state slots of b->state_bytes on every rank (zeroed). */
int cuda_kda_state_alloc(struct cuda_backend *b, int n_slots, char *err, size_t errlen);
/* Fills the step's kda_seqs / kda_snaps regions of b->hin (b->lay) for a
 * step padded to Tp tokens; false when its snapshots do not fit. */
bool cuda_kda_pack(struct cuda_backend *b, const struct step *s, int Tp);
/* Layer l's mixer for T rows (decode: a decode-only step, maybe a graph):
 * reads k->xn, leaves the output in k->delta. */
int cuda_kda_mixer(struct rank *k, int l, int T, bool decode, char *err, size_t errlen);
/* After a verified step (its spec_out known): every sequence that accepted
 * a > 0 drafts gets its slot advanced over them by the replay (on every
 * rank: JOB_KDA_ROLLBACK), so each slot holds the state after its last
 * accepted token. 0, or the failing rank's error. */
int cuda_kda_rollback(struct cuda_backend *b, const struct step *s, char *err, size_t errlen);
/* Rank k's part of it (JOB_KDA_ROLLBACK): b->job.kda_roll entries of the kda_seqs region. */
int cuda_kda_rank_rollback(struct rank *k, char *err, size_t errlen);
#endif

#endif
