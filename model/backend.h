/* backend.h - the interface between the engine and whatever computes a step.
 *
 * A step is a flat batch of tokens from many sequences: decode tokens (one per
 * sequence) and prefill chunks. The scheduler fills `struct step`; the backend
 * writes each token's K/V into its slot, attends over the sequence's whole
 * context through its block table, and samples a token for the sequences that
 * want one. Logits stay inside the backend (a test may ask for them).
 *
 * KV layout: the backend owns the KV memory, sized in blocks by the caller
 * (kv_blocks); the KV pool (kvpool/) hands out block *indices*. A slot is
 * block_table[pos / block_size] * block_size + pos % block_size. The CPU
 * backend stores, per layer, its kind's entries (model_kv_token_elems): a GQA
 * layer K and V as [n_blocks][block_size][n_kv_heads][head_dim] f32, an MLA
 * layer [n_blocks][block_size][kv_lora_rank + qk_rope_head_dim (+ indexer key)].
 * A recurrent layer (KDA) keeps nothing per token but a fixed-size state per
 * sequence, in state slots the backend also owns (state_alloc), indexed by
 * the slot numbers the KV pool hands out (step_seq.state_slot).
 *
 * MTP (a model with MTP layers, a backend created with opts.mtp): the MTP
 * layer keeps its own entry per token in every block (position q's entry is
 * made from the token at q and the main model's hidden state at q - 1, so
 * position 0 has none and a block's entries depend on its own and earlier
 * tokens only: prefix reuse carries them), and each block keeps one
 * final-normed hidden state with its position: that of the block's last
 * position, or of the last position a step (or mtp_draft's p) computed in
 * it. For a sequence whose query covers positions a .. b, forward() writes
 * the MTP entries of a + 1 .. b, and of a when a - 1's block holds a - 1's
 * hidden state: after the sequence's previous step (decoding, chunked
 * prefill), after a prefix hit (a starts a block) and after mtp_draft from
 * a - 1. So only a verify step whose last accepted position p is not its
 * last query position leaves p + 1's entry to ops->mtp_draft (k = 0 when no
 * drafts are wanted), which must run before that sequence's next forward().
 * Entries past the accepted tokens need no rollback: each is rewritten before
 * any query reads it. Both backends run it: model/cpu_backend.c, and cuda/mtp.c
 * on one GPU (bf16 entries and hidden states there).
 *
 * Threads: one backend is driven by one thread (the engine thread); it may use
 * worker threads internally. Implementations: model/cpu_backend.c ("cpu"),
 * cuda/ ("cuda", when built with nvcc).
 */
#ifndef SLUICE_BACKEND_H
#define SLUICE_BACKEND_H

#include "model.h"

struct step_seq {
    /* in */
    int query_start;        /* first token of this sequence in the step's token arrays */
    int query_len;          /* tokens of this sequence in the step */
    int context_len;        /* tokens in the KV after this step: cached + query_len */
    const int32_t *block_table; /* [n_blocks] physical block indices, borrowed */
    int n_blocks;
    bool want_sample;       /* sample after the last query token (end of prefill, decode) */
    const struct model_sampling *sampling;
    const int32_t *history; /* prompt then generated ids, for penalties */
    int n_prompt, n_history;
    uint64_t *rng;          /* per-request RNG state, advanced by sampling */
    float *logits_out;      /* optional [n_vocab] host buffer: raw logits of the last
                               query token (tests); NULL in serving */
    struct model_sample_out *prompt_out; /* optional [n_prompt] (backends with has_prompt_logprobs):
                               for each query token at position p < n_prompt - 1, entry p + 1
                               gets history[p + 1] and its log-softmax under the raw logits at p,
                               with prompt_top alternatives (vLLM's prompt_logprobs) */
    int prompt_top;
    int n_draft;            /* speculative decoding (backends with max_draft_tokens >= n_draft): the last
                               n_draft query tokens are drafts, the token before them the last one
                               sampled, and history[n_history .. n_history + n_draft) holds the drafts
                               (want_sample set). The backend computes the logits after each of the
                               last n_draft + 1 query tokens and verifies them in order
                               (model_sample_verify) into spec_out. The KV of every query token is
                               written; the scheduler rolls back those after the last accepted draft
                               (their slots are written again later). A layer with a recurrent state
                               (backends with state_rollback only) leaves the sequence's state slot as
                               it was after the last accepted draft (query token n_spec_out - 1 of the
                               last n_draft + 1, i.e. after context_len - n_draft + n_spec_out - 1
                               tokens), not after the last query token, once forward() returns (the
                               CPU keeps the state after each verified position in scratch and copies
                               the accepted one into the slot; CUDA leaves the slot before the drafts
                               and replays the accepted ones: cuda/kda.h). Its snapshots (snap_pos) may lie past
                               the accepted tokens: those hold the rejected drafts' state and the
                               caller drops them (kv_seq_commit) */
    struct model_sample_out *spec_out; /* [n_draft + 1] out, borrowed: the emitted tokens */
    int n_spec_out;         /* out: how many (accepted drafts + 1) */
    /* Recurrent layers (model_state_bytes > 0; ignored otherwise). The
     * backend owns the state slots (state_alloc); the KV pool hands out their
     * indices. The step reads and advances slot state_slot: from zeros when
     * the sequence's first query position is 0, else from what the slot
     * holds, or, with state_restore, from a copy of slot state_from (a
     * prefix-cache snapshot: the state after the first context_len -
     * query_len tokens). During the step, the state after the first
     * snap_pos[i] tokens (ascending, inside this step's positions: first
     * query position < snap_pos[i] <= context_len) is copied into slot
     * snap_slot[i]. */
    int32_t state_slot;
    bool state_restore;
    int32_t state_from;
    int n_snaps;
    const int32_t *snap_pos, *snap_slot; /* [n_snaps], borrowed */
    /* out (valid when want_sample and no drafts): out.token is -1 when this
     * sequence alone could not be sampled (its logits are not finite, or its
     * allow mask left nothing); the step itself still succeeds */
    struct model_sample_out out;
};

struct step {
    int n_tokens;
    const int32_t *token_ids;   /* [n_tokens] */
    const int32_t *positions;   /* [n_tokens] */
    const int64_t *slots;       /* [n_tokens] KV slot of each token */
    int n_seqs;
    struct step_seq *seqs;      /* [n_seqs] */
};

typedef struct model_backend model_backend;

/* What a backend can take, for model_step_check. */
struct model_step_limits {
    int n_vocab, max_tokens, max_seqs, max_ctx, block_size, kv_blocks;
    int max_draft;          /* step_seq.n_draft at most (0: no speculative decoding) */
    int state_slots;            /* > 0: the model has recurrent layers and this many state slots */
    bool state_rollback;        /* drafts allowed with state_slots > 0 (the backend rolls the state back) */
};

/* Checks a step against lim and the contract above: token ids inside the
 * vocabulary, every token in exactly one sequence, positions inside their
 * sequence's context, each slot equal to what the block table says, block
 * indices inside the pool, history present where a sample is wanted.
 * tok_seq (scratch of max_tokens ints) gets each token's sequence index.
 * Returns 0, or SL_EINVAL with a message naming the token or sequence. Every
 * backend calls it first, so a bad plan never reaches a kernel. */
int model_step_check(const struct step *s, const struct model_step_limits *lim, int *tok_seq, char *err,
                     size_t errlen);

/* Checks n MTP draft requests (ops->mtp_draft) against lim (n_vocab,
 * max_seqs, max_ctx, block_size, kv_blocks) and the last step, whose
 * sequences (last_n of them; -1: none since kv_alloc or a failed forward)
 * had their query positions at last_pos0[i] .. last_pos0[i] + last_len[i] - 1.
 * *kmax gets the most entries a request writes past its position. Returns 0,
 * or SL_EINVAL with a message naming the request; every backend with MTP
 * calls it first, so each refuses alike. */
struct model_mtp_req;
int model_mtp_check(const struct model_mtp_req *r, int n, const struct model_step_limits *lim, int last_n,
                    const int *last_pos0, const int *last_len, int *kmax, char *err, size_t errlen);

struct model_backend_opts {
    const char *device;         /* "cpu" or "cuda"; NULL = cuda when available, else cpu */
    int n_threads;              /* cpu: worker threads, 0 = all cores */
    int max_tokens_per_step;    /* largest step.n_tokens (sizes scratch); 0 = 2048 */
    int max_seqs_per_step;      /* largest step.n_seqs; 0 = 256 */
    int max_ctx;                /* longest context a sequence may reach; 0 = n_ctx_train */
    int tensor_parallel_size;   /* cuda: GPUs the model is split across (devices 0 .. N-1); 0 = 1 */
    const char *kv_cache_dtype; /* vLLM's --kv-cache-dtype: NULL or "auto" = the compute dtype (bf16 on GPU, f32 on
                                 * CPU); "fp8" or "fp8_e4m3" (cuda only) = fp8 e4m3 with scale 1, half the bytes */
    bool enforce_eager;         /* cuda: no CUDA graphs, every step's kernels launched one by one (vLLM's
                                 * --enforce-eager); the CPU backend has none anyway */
    int max_draft_tokens;       /* largest step_seq.n_draft (speculative decoding; sizes the logits rows);
                                 * 0: none */
    bool mtp;                   /* run the model's MTP layer (speculative method "mtp"): its KV in every block,
                                 * kv_block_bytes counting it, ops->mtp_draft; creation fails naming the reason on
                                 * a model without MTP layers or a configuration the backend does not run it in
                                 * (cuda: more than one GPU, hyper-connections, the DSA indexer) */
};

/* One sequence's MTP drafts (ops->mtp_draft), asked after the forward()
 * whose step held the sequence and before the next one. */
struct model_mtp_req {
    /* in */
    int seq;                    /* the sequence's index in that step */
    int pos;                    /* p: its last accepted position, one of its query positions in that step (its
                                 * hidden state feeds the MTP layer) */
    int32_t token;              /* the token at p + 1: sampled after p, or the verifier's correction */
    int k;                      /* drafts wanted (0: only write p + 1's MTP entry) */
    const int32_t *block_table; /* [n_blocks], borrowed: must cover positions 0 .. p + max(k, 1) (the MTP
                                 * entries of p + 1 .. p + k are written) */
    int n_blocks;
    /* out */
    int32_t *drafts;            /* [k] caller-owned: greedy drafts for positions p + 2 .. p + k + 1, each
                                 * made from the one before (draft i + 1 takes draft i and the MTP layer's own
                                 * hidden state of draft i's position) */
    float *logits;              /* optional [k][n_vocab] caller-owned: the raw logits each draft is the argmax
                                 * of (ties to the lower id), for rejection sampling; NULL: not written */
};

/* Whether opts ask for an fp8 KV cache on device (NULL: the default device,
 * as model_backend_create picks it): 0 (*fp8 set), or SL_EINVAL / SL_EUNSUP
 * with a message for a dtype that is unknown, not supported (fp8_e5m2) or not
 * on this device. */
int model_kv_dtype(const struct model_backend_opts *opts, const char *device, bool *fp8, char *err, size_t errlen);

struct model_backend_ops {
    const char *name;
    /* Bytes of KV memory one block takes (all layers, each its kind's entry). */
    size_t (*kv_block_bytes)(model_backend *b, int block_size);
    /* (Re)allocates KV memory for n_blocks blocks of block_size tokens. */
    int (*kv_alloc)(model_backend *b, int n_blocks, int block_size, char *err, size_t errlen);
    /* Bytes of one state slot (every recurrent layer's state of one
     * sequence), 0 when the model has no recurrent layer. NULL: the backend
     * runs no recurrent layer (it refuses such a model at creation). */
    size_t (*state_slot_bytes)(model_backend *b);
    /* (Re)allocates n_slots state slots. */
    int (*state_alloc)(model_backend *b, int n_slots, char *err, size_t errlen);
    /* Runs one step. On error the KV contents of this step's slots are
     * undefined; SL_EDEVICE with b->fatal set means the backend cannot run
     * another step (a GPU or a tensor-parallel rank failed). */
    int (*forward)(model_backend *b, struct step *s, char *err, size_t errlen);
    void (*destroy)(model_backend *b);
    /* MTP drafts for n sequences of the step forward() just ran (NULL when the
     * backend has none; see the MTP paragraph above): writes the MTP entry of
     * p + 1 from the token there and the hidden state of p, then chains k
     * drafts. Returns 0, or SL_EINVAL naming the request (a sequence not in
     * the last step, a position outside its query, a token outside the
     * vocabulary, a block table too short) with nothing written, or
     * SL_EUNSUP when the backend was created without opts.mtp. */
    int (*mtp_draft)(model_backend *b, struct model_mtp_req *r, int n, char *err, size_t errlen);
};

struct model_backend {
    const struct model_backend_ops *ops;
    const model *m;             /* borrowed; must outlive the backend */
    const char *fatal;          /* NULL while healthy; set by the backend (owned by it) once
                                   forward() can never succeed again: the engine then stops */
    bool has_prompt_logprobs;   /* forward() fills step_seq.prompt_out */
    int max_draft_tokens;       /* forward() verifies up to this many drafts a sequence (step_seq.n_draft);
                                   0: none */
    bool has_mtp;               /* created with opts.mtp: forward() keeps the MTP layer current, mtp_draft works */
    bool state_rollback;        /* forward() verifies drafts on a model with recurrent layers too, each state
                                   slot left at its sequence's last accepted draft (step_seq.n_draft) */
    size_t spec_state_bytes;    /* device memory (per GPU) this backend set aside at creation for that rollback
                                   (cuda: the drafts' replay inputs, cuda/kda.h); 0: none, or grown on demand
                                   outside the memory plan (cpu) */
};

/* Creates the backend named by opts->device for m. Returns NULL with a
 * message in err on failure. */
model_backend *model_backend_create(const model *m, const struct model_backend_opts *opts, char *err,
                                    size_t errlen);
void model_backend_destroy(model_backend *b);

/* Whether c can be split over n tensor-parallel ranks: attention heads, KV
 * heads and FFN width must each divide by n (each rank holds whole heads and
 * the KV heads its query heads read). 0, or SL_EUNSUP/SL_EINVAL with a
 * message naming the counts. */
int model_tp_check(const struct model_config *c, int n, char *err, size_t errlen);

/* The CPU reference backend (model/cpu_backend.c). */
model_backend *model_cpu_backend_create(const model *m, const struct model_backend_opts *opts,
                                        char *err, size_t errlen);
/* Describes the GPUs this build can see ("2 x NVIDIA H200 (sm_90, 140 GiB)")
 * into buf; returns the device count, 0 when none, or -1 when the build has
 * no CUDA (model/util.c holds the weak stand-in that cuda/ overrides). */
int model_cuda_describe(char *buf, size_t cap);
/* Free and total memory of GPU `device` in bytes; 0, or -1 when this build
 * has no CUDA or that GPU does not answer (weak stand-in in model/util.c). */
int model_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes);
/* Whether this build has the CUDA backend and a GPU is present. */
bool model_cuda_available(void);
/* The CUDA backend (cuda/). model/backend.c holds weak stand-ins (false /
 * NULL with "this build has no CUDA backend") that cuda/ overrides. */
model_backend *model_cuda_backend_create(const model *m, const struct model_backend_opts *opts,
                                         char *err, size_t errlen);

#endif
