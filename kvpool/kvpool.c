/* kvpool.c - block pool, block tables and the exact prefix cache (kvpool.h). */
#include "kvpool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum block_state { ST_FREE, ST_USED, ST_LRU };

struct kv_pool {
    int n, bs;
    bool cache;
    int32_t *ref;          /* [n] holders */
    uint32_t *gen;         /* [n] bumped on every recycle */
    uint8_t *state;        /* [n] enum block_state */
    int32_t *free_stack;   /* [n] */
    int n_free;
    int32_t *lru_prev, *lru_next; /* [n] doubly linked, head = least recently released */
    int32_t lru_head, lru_tail;
    int n_lru;
    /* prefix-cache keys, valid while hashed[b] */
    uint8_t *hashed;       /* [n] */
    int32_t *key_parent;   /* [n] -1 = root */
    uint32_t *key_parent_gen;
    uint64_t *key_salt;
    uint64_t *key_hash;
    int32_t *key_tokens;   /* [n][bs] */
    int32_t *n_children;   /* [n] hashed blocks keyed on this block at its current generation */
    int32_t *chain_next;   /* [n] bucket chains */
    int32_t *bucket;       /* [n_buckets] */
    uint64_t bucket_mask;
    /* recurrent-state slots (kv_pool_set_states) */
    int n_seq_slots, n_snap_slots, snap_every;
    int32_t *seq_free;     /* [n_seq_slots] stack */
    int n_seq_free;
    int32_t *snap_free;    /* [n_snap_slots] stack */
    int n_snap_free;
    int32_t *snap;         /* [n] a hashed block's snapshot slot, -1 none */
    int snaps_held;
    struct kv_stats st;
};

static uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ULL;
    return h;
}

static uint64_t key_hash(int32_t parent, uint32_t pgen, uint64_t salt, const int32_t *tok, int bs)
{
    uint64_t h = mix(0x51ce0001ULL, (uint64_t)(uint32_t)parent);
    h = mix(h, pgen);
    h = mix(h, salt);
    for (int i = 0; i < bs; i++) h = mix(h, (uint32_t)tok[i]);
    return h;
}

kv_pool *kv_pool_create(int n_blocks, int block_size, bool prefix_cache, char *err, size_t errlen)
{
    if (n_blocks <= 0 || block_size <= 0 || block_size > 4096) {
        snprintf(err, errlen, "invalid KV pool size: %d blocks of %d tokens", n_blocks, block_size);
        return NULL;
    }
    kv_pool *p = calloc(1, sizeof *p);
    if (!p) goto fail_oom;
    p->n = n_blocks;
    p->bs = block_size;
    p->cache = prefix_cache;
    size_t n = (size_t)n_blocks;
    uint64_t nb = 1;
    while (nb < n * 2) nb <<= 1;
    p->bucket_mask = nb - 1;
    p->ref = calloc(n, sizeof *p->ref);
    p->gen = calloc(n, sizeof *p->gen);
    p->state = calloc(n, 1);
    p->free_stack = malloc(n * sizeof *p->free_stack);
    p->lru_prev = malloc(n * sizeof *p->lru_prev);
    p->lru_next = malloc(n * sizeof *p->lru_next);
    p->hashed = calloc(n, 1);
    p->key_parent = malloc(n * sizeof *p->key_parent);
    p->key_parent_gen = malloc(n * sizeof *p->key_parent_gen);
    p->key_salt = malloc(n * sizeof *p->key_salt);
    p->key_hash = malloc(n * sizeof *p->key_hash);
    p->key_tokens = malloc(n * (size_t)block_size * sizeof *p->key_tokens);
    p->n_children = calloc(n, sizeof *p->n_children);
    p->chain_next = malloc(n * sizeof *p->chain_next);
    p->bucket = malloc(nb * sizeof *p->bucket);
    if (!p->ref || !p->gen || !p->state || !p->free_stack || !p->lru_prev || !p->lru_next || !p->hashed ||
        !p->key_parent || !p->key_parent_gen || !p->key_salt || !p->key_hash || !p->key_tokens ||
        !p->n_children || !p->chain_next || !p->bucket)
        goto fail_oom;
    for (uint64_t i = 0; i < nb; i++) p->bucket[i] = -1;
    /* pop order 0, 1, 2, ...: block 0 first */
    for (int i = 0; i < n_blocks; i++) p->free_stack[i] = n_blocks - 1 - i;
    p->n_free = n_blocks;
    p->lru_head = p->lru_tail = -1;
    p->st.blocks_total = n_blocks;
    return p;
fail_oom:
    kv_pool_destroy(p);
    snprintf(err, errlen, "out of memory creating a KV pool of %d blocks", n_blocks);
    return NULL;
}

void kv_pool_destroy(kv_pool *p)
{
    if (!p) return;
    free(p->ref);
    free(p->gen);
    free(p->state);
    free(p->free_stack);
    free(p->lru_prev);
    free(p->lru_next);
    free(p->hashed);
    free(p->key_parent);
    free(p->key_parent_gen);
    free(p->key_salt);
    free(p->key_hash);
    free(p->key_tokens);
    free(p->n_children);
    free(p->chain_next);
    free(p->bucket);
    free(p->seq_free);
    free(p->snap_free);
    free(p->snap);
    free(p);
}

int kv_pool_set_states(kv_pool *p, int n_seq, int n_snap, int snap_every, char *err, size_t errlen)
{
    if (p->n_seq_slots > 0 || n_seq <= 0 || n_snap < 0 || (n_snap > 0 && snap_every <= 0) ||
        n_seq > INT32_MAX - n_snap) {
        snprintf(err, errlen, "invalid state slots: %d for sequences, %d snapshots every %d blocks", n_seq, n_snap,
                 snap_every);
        return KV_EINVAL;
    }
    p->seq_free = malloc((size_t)n_seq * sizeof *p->seq_free);
    p->snap_free = malloc((size_t)(n_snap ? n_snap : 1) * sizeof *p->snap_free);
    p->snap = malloc((size_t)p->n * sizeof *p->snap);
    if (!p->seq_free || !p->snap_free || !p->snap) {
        free(p->seq_free), free(p->snap_free), free(p->snap);
        p->seq_free = p->snap_free = p->snap = NULL;
        snprintf(err, errlen, "out of memory for %d state slots", n_seq + n_snap);
        return KV_ENOMEM;
    }
    for (int i = 0; i < n_seq; i++) p->seq_free[i] = n_seq - 1 - i;
    for (int i = 0; i < n_snap; i++) p->snap_free[i] = n_seq + n_snap - 1 - i;
    for (int b = 0; b < p->n; b++) p->snap[b] = -1;
    p->n_seq_slots = p->n_seq_free = n_seq;
    p->n_snap_slots = p->n_snap_free = n_snap;
    p->snap_every = snap_every;
    return 0;
}

int kv_pool_state_slots(const kv_pool *p) { return p->n_seq_slots + p->n_snap_slots; }

int kv_blocks_for_bytes(size_t bytes, size_t block_bytes)
{
    if (block_bytes == 0) return 0;
    size_t n = bytes / block_bytes;
    return n > (size_t)INT32_MAX ? INT32_MAX : (int)n;
}

int kv_pool_block_size(const kv_pool *p) { return p->bs; }
int kv_pool_n_blocks(const kv_pool *p) { return p->n; }
bool kv_pool_prefix_cache(const kv_pool *p) { return p->cache; }
int kv_pool_available(const kv_pool *p) { return p->n_free + p->n_lru; }

void kv_pool_stats(const kv_pool *p, struct kv_stats *st)
{
    *st = p->st;
    st->blocks_free = p->n_free;
    st->blocks_cached = p->n_lru;
    st->blocks_used = p->n - p->n_free - p->n_lru;
    st->state_slots = p->n_seq_slots;
    st->snap_slots = p->n_snap_slots;
    st->snaps_held = p->snaps_held;
}

/* ---- LRU and hash table ---- */

static void lru_remove(kv_pool *p, int b)
{
    int pr = p->lru_prev[b], nx = p->lru_next[b];
    if (pr >= 0) p->lru_next[pr] = nx;
    else p->lru_head = nx;
    if (nx >= 0) p->lru_prev[nx] = pr;
    else p->lru_tail = pr;
    p->n_lru--;
}

static void lru_append(kv_pool *p, int b)
{
    p->lru_prev[b] = p->lru_tail;
    p->lru_next[b] = -1;
    if (p->lru_tail >= 0) p->lru_next[p->lru_tail] = b;
    else p->lru_head = b;
    p->lru_tail = b;
    p->n_lru++;
}

static int find_key(const kv_pool *p, int32_t parent, uint32_t pgen, uint64_t salt, const int32_t *tok)
{
    uint64_t h = key_hash(parent, pgen, salt, tok, p->bs);
    for (int b = p->bucket[h & p->bucket_mask]; b >= 0; b = p->chain_next[b]) {
        if (p->key_hash[b] == h && p->key_parent[b] == parent && p->key_parent_gen[b] == pgen &&
            p->key_salt[b] == salt && !memcmp(p->key_tokens + (size_t)b * p->bs, tok, sizeof *tok * (size_t)p->bs))
            return b;
    }
    return -1;
}

static void key_register(kv_pool *p, int b, int32_t parent, uint32_t pgen, uint64_t salt, const int32_t *tok)
{
    uint64_t h = key_hash(parent, pgen, salt, tok, p->bs);
    p->hashed[b] = 1;
    p->key_parent[b] = parent;
    p->key_parent_gen[b] = pgen;
    p->key_salt[b] = salt;
    p->key_hash[b] = h;
    memcpy(p->key_tokens + (size_t)b * p->bs, tok, sizeof *tok * (size_t)p->bs);
    uint64_t k = h & p->bucket_mask;
    p->chain_next[b] = p->bucket[k];
    p->bucket[k] = b;
    if (parent >= 0 && p->gen[parent] == pgen) p->n_children[parent]++;
}

static void key_unregister(kv_pool *p, int b)
{
    int32_t *link = &p->bucket[p->key_hash[b] & p->bucket_mask];
    while (*link != b) link = &p->chain_next[*link];
    *link = p->chain_next[b];
    int32_t parent = p->key_parent[b];
    if (parent >= 0 && p->gen[parent] == p->key_parent_gen[b]) p->n_children[parent]--;
    p->hashed[b] = 0;
    if (p->snap && p->snap[b] >= 0) { /* a snapshot goes with its block */
        p->snap_free[p->n_snap_free++] = p->snap[b];
        p->snap[b] = -1;
        p->snaps_held--;
    }
}

/* A snapshot slot: a free one, else the one of the least recently released
 * cached block that holds one (the block stays cached); -1 when none. */
static int32_t snap_take(kv_pool *p)
{
    if (p->n_snap_free > 0) return p->snap_free[--p->n_snap_free];
    for (int b = p->lru_head; b >= 0; b = p->lru_next[b])
        if (p->snap[b] >= 0) {
            int32_t k = p->snap[b];
            p->snap[b] = -1;
            p->snaps_held--;
            return k;
        }
    return -1;
}

/* ---- allocation ---- */

/* Takes a block for a new holder: free list first, else evicts the least
 * recently released cached leaf (any cached block if none is a leaf). */
static int alloc_block(kv_pool *p)
{
    int b;
    if (p->n_free > 0) {
        b = p->free_stack[--p->n_free];
    } else {
        if (p->n_lru == 0) return -1;
        b = p->lru_head;
        while (b >= 0 && p->n_children[b] > 0) b = p->lru_next[b];
        if (b < 0) b = p->lru_head;
        lru_remove(p, b);
        key_unregister(p, b);
        p->st.evictions++;
    }
    p->gen[b]++;          /* any key naming the old contents as parent is now dead */
    p->n_children[b] = 0; /* those children are unreachable orphans */
    p->ref[b] = 1;
    p->state[b] = ST_USED;
    return b;
}

static void take_ref(kv_pool *p, int b)
{
    if (p->state[b] == ST_LRU) {
        lru_remove(p, b);
        p->state[b] = ST_USED;
    }
    p->ref[b]++;
}

static void drop_ref(kv_pool *p, int b)
{
    if (--p->ref[b] > 0) return;
    if (p->hashed[b]) {
        p->state[b] = ST_LRU;
        lru_append(p, b);
    } else {
        p->state[b] = ST_FREE;
        p->free_stack[p->n_free++] = b;
    }
}

/* ---- sequences ---- */

void kv_seq_init(struct kv_seq *s, uint64_t salt)
{
    memset(s, 0, sizeof *s);
    s->key_parent = -1;
    s->salt = salt;
}

void kv_seq_release(kv_pool *p, struct kv_seq *s)
{
    if (s->has_state) p->seq_free[p->n_seq_free++] = s->state;
    for (int i = 0; i < s->n_snaps; i++) p->snap_free[p->n_snap_free++] = s->snap_slot[i];
    s->has_state = s->has_restore = false;
    s->n_snaps = 0;
    s->junction = 0;
    /* last block first, so a sequence's blocks enter the LRU leaves first */
    for (int i = s->n_blocks - 1; i >= 0; i--) drop_ref(p, s->blocks[i]);
    s->n_blocks = 0;
    s->n_committed = 0;
    s->key_parent = -1;
    s->key_parent_gen = 0;
}

void kv_seq_deinit(kv_pool *p, struct kv_seq *s)
{
    if (p) kv_seq_release(p, s);
    free(s->blocks);
    s->blocks = NULL;
    s->cap = 0;
}

/* The pending snapshot after `pos` tokens, if any, goes to cached block b
 * (unless b has one already: then it is freed). */
static void attach_snap(kv_pool *p, struct kv_seq *s, int b, int pos)
{
    for (int i = 0; i < s->n_snaps; i++) {
        if (s->snap_pos[i] != pos || s->snap_slot[i] < 0) continue;
        if (p->hashed[b] && p->snap[b] < 0) {
            p->snap[b] = s->snap_slot[i];
            p->snaps_held++;
        } else {
            p->snap_free[p->n_snap_free++] = s->snap_slot[i];
        }
        s->snap_slot[i] = -1;
    }
}

static int grow(struct kv_seq *s, int need)
{
    if (need <= s->cap) return 0;
    int cap = s->cap ? s->cap : 16;
    while (cap < need) cap *= 2;
    int32_t *nb = realloc(s->blocks, sizeof *nb * (size_t)cap);
    if (!nb) return KV_ENOMEM;
    s->blocks = nb;
    s->cap = cap;
    return 0;
}

int kv_seq_match_prefix(kv_pool *p, struct kv_seq *s, const int32_t *tokens, int n)
{
    if (n <= 0) return 0;
    p->st.query_tokens += (uint64_t)n;
    if (!p->cache || s->n_blocks > 0) return 0;
    int max_blocks = (n - 1) / p->bs;
    if (grow(s, max_blocks)) return 0;
    int32_t parent = -1;
    uint32_t pgen = 0;
    int found = 0;
    if (p->n_seq_slots > 0) {
        /* recurrent layers resume only from a snapshot: the deepest matched block with one */
        int deep = 0;
        while (found < max_blocks) {
            int b = find_key(p, parent, pgen, s->salt, tokens + (size_t)found * p->bs);
            if (b < 0) break;
            s->blocks[found++] = b;
            if (p->snap[b] >= 0) deep = found;
            parent = b;
            pgen = p->gen[b];
        }
        if (found > deep) s->junction = found * p->bs;
        found = deep;
        for (int i = 0; i < found; i++) take_ref(p, s->blocks[i]);
        s->n_blocks = found;
        parent = found ? s->blocks[found - 1] : -1;
        pgen = found ? p->gen[parent] : 0;
        if (found) {
            s->has_restore = true;
            s->restore = p->snap[parent];
        }
    }
    while (p->n_seq_slots == 0 && found < max_blocks) {
        int b = find_key(p, parent, pgen, s->salt, tokens + (size_t)found * p->bs);
        if (b < 0) break;
        take_ref(p, b);
        s->blocks[s->n_blocks++] = b;
        parent = b;
        pgen = p->gen[b];
        found++;
    }
    s->n_committed = found;
    s->key_parent = parent;
    s->key_parent_gen = pgen;
    p->st.hit_tokens += (uint64_t)found * (uint64_t)p->bs;
    return found * p->bs;
}

int kv_seq_reserve(kv_pool *p, struct kv_seq *s, int n_tokens)
{
    int need = (n_tokens + p->bs - 1) / p->bs;
    bool state = p->n_seq_slots > 0 && !s->has_state;
    if (state && p->n_seq_free == 0) return KV_ENOSPC;
    if (need > s->n_blocks && need - s->n_blocks > kv_pool_available(p)) return KV_ENOSPC;
    if (grow(s, need)) return KV_ENOMEM;
    if (state) {
        s->state = p->seq_free[--p->n_seq_free];
        s->has_state = true;
    }
    if (need <= s->n_blocks) return 0;
    if (grow(s, need)) return KV_ENOMEM;
    while (s->n_blocks < need) {
        int b = alloc_block(p);
        if (b < 0) return KV_ENOSPC; /* cannot happen: availability was checked */
        s->blocks[s->n_blocks++] = b;
    }
    return 0;
}

void kv_seq_commit(kv_pool *p, struct kv_seq *s, const int32_t *tokens, int n_computed)
{
    int full = n_computed / p->bs;
    if (full > s->n_blocks) full = s->n_blocks;
    if (!p->cache) {
        if (full > s->n_committed) s->n_committed = full;
        return;
    }
    for (int i = s->n_committed; i < full; i++) {
        int b = s->blocks[i];
        const int32_t *tok = tokens + (size_t)i * p->bs;
        /* the parent key may name a twin that was recycled since: then the
         * chain is broken and later blocks stay private */
        if (s->key_parent >= 0 && p->gen[s->key_parent] != s->key_parent_gen) break;
        int twin = find_key(p, s->key_parent, s->key_parent_gen, s->salt, tok);
        int canon = twin >= 0 ? twin : b;
        if (twin < 0 && !p->hashed[b]) key_register(p, b, s->key_parent, s->key_parent_gen, s->salt, tok);
        s->key_parent = canon;
        s->key_parent_gen = p->gen[canon];
        attach_snap(p, s, canon, (i + 1) * p->bs);
    }
    if (full > s->n_committed) s->n_committed = full;
    /* what was not attached (a chain broken above, or no cache) goes back, and so does a snapshot past
     * n_computed: its step verified drafts and rolled back to before it, so it holds a rejected draft's state */
    for (int i = 0; i < s->n_snaps; i++)
        if (s->snap_slot[i] >= 0 && (s->snap_pos[i] <= full * p->bs || s->snap_pos[i] > n_computed)) {
            p->snap_free[p->n_snap_free++] = s->snap_slot[i];
            s->snap_slot[i] = -1;
        }
    int j = 0;
    for (int i = 0; i < s->n_snaps; i++)
        if (s->snap_slot[i] >= 0) s->snap_pos[j] = s->snap_pos[i], s->snap_slot[j++] = s->snap_slot[i];
    s->n_snaps = j;
}

int kv_seq_plan_snaps(kv_pool *p, struct kv_seq *s, int from, int to, int n_prompt)
{
    if (p->n_snap_slots == 0 || !p->cache) return 0;
    int bs = p->bs, grid = p->snap_every * bs, last = (n_prompt - 1) / bs * bs;
    int32_t pos[KV_MAX_STEP_SNAPS];
    int n = 0;
    /* the deepest first: a chunk longer than KV_MAX_STEP_SNAPS grid cells keeps its last ones */
    for (int b = to / bs * bs; b > from && n < KV_MAX_STEP_SNAPS; b -= bs)
        if (b % grid == 0 || b == last || b == s->junction) pos[n++] = b;
    int k = 0;
    for (int i = n - 1; i >= 0; i--) { /* ascending */
        if (s->n_snaps + k >= KV_MAX_STEP_SNAPS) break;
        int32_t slot = snap_take(p);
        if (slot < 0) break;
        s->snap_pos[s->n_snaps + k] = pos[i];
        s->snap_slot[s->n_snaps + k] = slot;
        k++;
    }
    s->n_snaps += k;
    return s->n_snaps;
}

/* ---- test hooks ---- */

int kv_debug_ref(const kv_pool *p, int block) { return p->ref[block]; }
int kv_debug_snap(const kv_pool *p, int block) { return p->snap ? p->snap[block] : -1; }
uint32_t kv_debug_gen(const kv_pool *p, int block) { return p->gen[block]; }
bool kv_debug_cached(const kv_pool *p, int block) { return p->hashed[block]; }

int kv_debug_check(const kv_pool *p, char *err, size_t errlen)
{
    int n_free = 0, n_lru = 0;
    int32_t *children = calloc((size_t)p->n, sizeof *children);
    uint8_t *seen = calloc((size_t)p->n, 1);
    int rc = -1;
    if (!children || !seen) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    for (int i = 0; i < p->n_free; i++) {
        int b = p->free_stack[i];
        if (seen[b]++ || p->state[b] != ST_FREE || p->ref[b] != 0 || p->hashed[b]) {
            snprintf(err, errlen, "free list: block %d bad (dup/state/ref/hashed)", b);
            goto out;
        }
        n_free++;
    }
    for (int b = p->lru_head, prev = -1; b >= 0; prev = b, b = p->lru_next[b]) {
        if (p->lru_prev[b] != prev || seen[b]++ || p->state[b] != ST_LRU || p->ref[b] != 0 || !p->hashed[b]) {
            snprintf(err, errlen, "LRU: block %d bad (link/dup/state/ref/hashed)", b);
            goto out;
        }
        n_lru++;
    }
    if (n_lru != p->n_lru || n_free != p->n_free) {
        snprintf(err, errlen, "list counts: free %d/%d lru %d/%d", n_free, p->n_free, n_lru, p->n_lru);
        goto out;
    }
    for (int b = 0; b < p->n; b++) {
        if (!seen[b] && (p->state[b] != ST_USED || p->ref[b] <= 0)) {
            snprintf(err, errlen, "block %d on no list but state %d ref %d", b, p->state[b], p->ref[b]);
            goto out;
        }
        if (p->hashed[b]) {
            if (find_key(p, p->key_parent[b], p->key_parent_gen[b], p->key_salt[b],
                         p->key_tokens + (size_t)b * p->bs) != b) {
                snprintf(err, errlen, "hashed block %d not reachable by its own key (or a duplicate key)", b);
                goto out;
            }
            int32_t par = p->key_parent[b];
            if (par >= 0 && p->gen[par] == p->key_parent_gen[b]) children[par]++;
        }
    }
    for (int b = 0; b < p->n; b++)
        if (children[b] != p->n_children[b]) {
            snprintf(err, errlen, "block %d children %d, recorded %d", b, children[b], p->n_children[b]);
            goto out;
        }
    rc = 0;
out:
    free(children);
    free(seen);
    return rc;
}
