/* kvpool.h - the paged KV block pool: block indices, ref counts, per-sequence
 * block tables, and the exact prefix cache.
 *
 * The pool hands out block *indices*; the backend owns the memory they index
 * (model/backend.h: per layer K and V as [n_blocks][block_size][n_kv_heads][head_dim];
 * elements f32 on the CPU, bf16 on the GPU, or fp8 e4m3 with --kv-cache-dtype
 * fp8: the backend's kv_block_bytes says how many bytes a block takes).
 * A token at position p of a sequence lives in slot
 *     table[p / block_size] * block_size + p % block_size.
 *
 * Prefix cache: a full block whose K/V has been computed is registered under
 * the key (parent block, parent generation, salt, its block_size token ids).
 * A lookup walks a prompt block by block and compares token ids exactly; the
 * hash only picks the bucket, so a collision can never hand out another
 * prompt's KV. A block's generation is bumped whenever it is recycled, so a
 * child key naming a recycled parent can never match again. Blocks whose ref
 * count drops to zero stay cached in an LRU list and are evicted only when
 * the free list is empty, leaves (blocks with no cached children) first, so
 * descendants go before their ancestors.
 *
 * Recurrent state (models with linear-attention layers, kv_pool_set_states):
 * beside the blocks the pool hands out state *slots* (the backend owns their
 * memory too): one per running sequence, taken by kv_seq_reserve and
 * released with the sequence's blocks (finish, abort, preemption: a
 * preempted sequence is recomputed, its state dropped), and snapshot slots:
 * the state after the first k block-size multiples of tokens, taken every
 * snap_every blocks, at the last full block of a prompt and at the junction
 * where a prompt leaves a cached one past its deepest snapshot (so a third
 * prompt sharing that prefix resumes there: a shared document followed by
 * different questions), attached at
 * commit to the cached block that ends there and evicted with it (or alone,
 * least recently used first, when the snapshot slots run out). With states,
 * a prefix hit stops at the deepest matched block that carries a snapshot
 * and the sequence resumes from it (kv_seq.restore), so a hit is a hit for
 * every layer.
 *
 * Threads: a pool and its sequences belong to one thread (the engine thread).
 * Nothing here allocates memory after kv_pool_create() except kv_seq tables,
 * which grow geometrically.
 */
#ifndef SLUICE_KVPOOL_H
#define SLUICE_KVPOOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { KV_OK = 0, KV_EINVAL = -1, KV_ENOMEM = -2, KV_ENOSPC = -6 };

typedef struct kv_pool kv_pool;

/* Snapshots one sequence takes in one step at most (a longer chunk takes the
 * deepest of them). */
#define KV_MAX_STEP_SNAPS 8

/* A sequence's block table. Embedded in the caller's request; init/deinit. */
struct kv_seq {
    int32_t *blocks;   /* [n_blocks] physical block indices, owned */
    int n_blocks, cap;
    int n_committed;   /* leading full blocks already offered to the prefix cache */
    int32_t key_parent;     /* the cached block that keys the next committed block's parent:
                               the sequence's own block, or the cached twin it duplicated; -1 at root */
    uint32_t key_parent_gen;
    uint64_t salt;     /* extra key: sequences with different salts never share blocks */
    /* pools with states only */
    bool has_state;    /* state: the sequence's state slot */
    int32_t state;
    bool has_restore;  /* restore: the snapshot slot its next step starts from (a prefix hit) */
    int32_t restore;
    int junction;      /* tokens of the cached prefix it matched, where that passes its deepest snapshot: the
                          point where its prompt leaves an earlier one's, snapshotted on the way (0: none) */
    int n_snaps;       /* snapshots of the step being run: after snap_pos[i] tokens into snap_slot[i] */
    int32_t snap_pos[KV_MAX_STEP_SNAPS], snap_slot[KV_MAX_STEP_SNAPS];
};

struct kv_stats {
    int blocks_total;
    int blocks_free;       /* on the free list */
    int blocks_cached;     /* ref count 0, still in the prefix cache (evictable) */
    int blocks_used;       /* ref count > 0 */
    uint64_t hit_tokens;   /* prompt tokens served from the cache */
    uint64_t query_tokens; /* prompt tokens looked up */
    uint64_t evictions;
    int state_slots;       /* running sequences' state slots (0: no recurrent layers) */
    int snap_slots;        /* snapshot slots */
    int snaps_held;        /* snapshots attached to cached blocks */
};

/* Creates a pool of n_blocks blocks of block_size tokens. prefix_cache: keep
 * and share full blocks. NULL with a message on bad sizes or no memory. */
kv_pool *kv_pool_create(int n_blocks, int block_size, bool prefix_cache, char *err, size_t errlen);
void kv_pool_destroy(kv_pool *p);

/* How many blocks fit in `bytes` when one block takes block_bytes (>= 0). */
int kv_blocks_for_bytes(size_t bytes, size_t block_bytes);

/* Gives the pool state slots: n_seq for running sequences (slots 0 ..
 * n_seq - 1) and n_snap snapshot slots (n_seq .. n_seq + n_snap - 1; 0: no
 * snapshots, then no prefix hit either), a grid snapshot every snap_every
 * blocks. Call once, before any sequence. 0, or KV_EINVAL / KV_ENOMEM with
 * a message. */
int kv_pool_set_states(kv_pool *p, int n_seq, int n_snap, int snap_every, char *err, size_t errlen);
/* Total state slots (n_seq + n_snap), 0 without states. */
int kv_pool_state_slots(const kv_pool *p);

int kv_pool_block_size(const kv_pool *p);
int kv_pool_n_blocks(const kv_pool *p);
bool kv_pool_prefix_cache(const kv_pool *p);
/* Blocks that an allocation could get now: free plus evictable. */
int kv_pool_available(const kv_pool *p);
void kv_pool_stats(const kv_pool *p, struct kv_stats *st);

void kv_seq_init(struct kv_seq *s, uint64_t salt);
/* Releases every block the sequence holds (cached ones stay cached) and
 * frees the table. Safe on a zeroed or already released sequence. */
void kv_seq_release(kv_pool *p, struct kv_seq *s);
void kv_seq_deinit(kv_pool *p, struct kv_seq *s);

/* For an empty sequence: finds the longest cached prefix of tokens[0..n) in
 * whole blocks, never the last token (its logits must be computed), takes a
 * reference on each block and appends it. Returns the cached token count
 * (a multiple of the block size; 0 with the cache off). Counts hit/query. */
int kv_seq_match_prefix(kv_pool *p, struct kv_seq *s, const int32_t *tokens, int n);

/* Makes the table cover n_tokens positions, allocating blocks (free list
 * first, then evicting), and with states gives the sequence a state slot
 * when it has none. Returns 0, or KV_ENOSPC with nothing changed. */
int kv_seq_reserve(kv_pool *p, struct kv_seq *s, int n_tokens);

/* With snapshots: plans the snapshots of a step that computes positions
 * [from, to) of a sequence whose prompt has n_prompt tokens: at every
 * multiple of snap_every blocks, at the prompt's last full block that a
 * later identical prompt can match ((n_prompt - 1) / block_size blocks) and
 * at s->junction, inside (from, to]; each gets a snapshot slot (a free one, else the least
 * recently used cached block's snapshot is dropped; none left: skipped).
 * Fills s->n_snaps, snap_pos, snap_slot (the deepest KV_MAX_STEP_SNAPS);
 * kv_seq_commit attaches them, kv_seq_release frees what is left. Returns
 * the count. */
int kv_seq_plan_snaps(kv_pool *p, struct kv_seq *s, int from, int to, int n_prompt);

/* Slot of position pos (which must be covered by the table). */
static inline int64_t kv_seq_slot(const struct kv_seq *s, int pos, int block_size)
{
    return (int64_t)s->blocks[pos / block_size] * block_size + pos % block_size;
}

/* Offers the sequence's full blocks whose K/V is computed (positions
 * [0, n_computed)) to the prefix cache; tokens are the sequence's ids. A block
 * whose key is already cached under another block stays private. The step's
 * snapshots are attached or given back; one past n_computed (a verify step
 * whose drafts were rejected computed it from them) is given back too. */
void kv_seq_commit(kv_pool *p, struct kv_seq *s, const int32_t *tokens, int n_computed);

/* ---- for tests: the pool's internal state, read-only ---- */
int kv_debug_ref(const kv_pool *p, int block);
int kv_debug_snap(const kv_pool *p, int block); /* its snapshot slot, -1 none */
uint32_t kv_debug_gen(const kv_pool *p, int block);
bool kv_debug_cached(const kv_pool *p, int block); /* registered in the prefix cache */
/* Checks every internal invariant (lists disjoint and complete, counts,
 * children counts, hash chains); returns 0 or -1 with a message. */
int kv_debug_check(const kv_pool *p, char *err, size_t errlen);

#endif
