/* test_kvpool.c - the KV block pool and its exact prefix cache. */
#include <stdint.h>
#include <string.h>

#include "kvpool/kvpool.h"
#include "test.h"

static char err[256];

static void fill(int32_t *t, int n, int base)
{
    for (int i = 0; i < n; i++) t[i] = base + i;
}

static void test_create_errors(void)
{
    CHECK(kv_pool_create(0, 16, true, err, sizeof err) == NULL && err[0]);
    CHECK(kv_pool_create(10, 0, true, err, sizeof err) == NULL);
    CHECK(kv_blocks_for_bytes(1000, 100) == 10);
    CHECK(kv_blocks_for_bytes(1000, 0) == 0);
}

static void test_reserve_slots_release(void)
{
    kv_pool *p = kv_pool_create(8, 4, false, err, sizeof err);
    struct kv_seq s;
    kv_seq_init(&s, 0);
    CHECK(kv_seq_reserve(p, &s, 9) == 0);
    CHECK(s.n_blocks == 3);
    CHECK(kv_pool_available(p) == 5);
    /* slot of position 5 = block[1]*4 + 1 */
    CHECK(kv_seq_slot(&s, 5, 4) == (int64_t)s.blocks[1] * 4 + 1);
    CHECK(kv_seq_reserve(p, &s, 40) == KV_ENOSPC);
    CHECK(s.n_blocks == 3); /* nothing changed */
    CHECK(kv_seq_reserve(p, &s, 32) == 0);
    CHECK(kv_pool_available(p) == 0);
    kv_seq_deinit(p, &s);
    CHECK(kv_pool_available(p) == 8);
    CHECK(kv_debug_check(p, err, sizeof err) == 0);
    kv_pool_destroy(p);
}

static void test_prefix_reuse(void)
{
    kv_pool *p = kv_pool_create(16, 4, true, err, sizeof err);
    int32_t t[14];
    fill(t, 14, 100);
    struct kv_seq a, b;
    kv_seq_init(&a, 0);
    kv_seq_init(&b, 0);
    CHECK(kv_seq_match_prefix(p, &a, t, 14) == 0);
    CHECK(kv_seq_reserve(p, &a, 14) == 0);
    kv_seq_commit(p, &a, t, 14); /* 3 full blocks cached */
    CHECK(kv_debug_cached(p, a.blocks[2]) && !kv_debug_cached(p, a.blocks[3]));
    /* same prompt: 3 blocks hit (12 tokens), shared with a */
    CHECK(kv_seq_match_prefix(p, &b, t, 14) == 12);
    for (int i = 0; i < 3; i++) CHECK(b.blocks[i] == a.blocks[i] && kv_debug_ref(p, a.blocks[i]) == 2);
    kv_seq_deinit(p, &b);
    /* the whole prompt cached: the last token is never served from cache */
    kv_seq_init(&b, 0);
    CHECK(kv_seq_match_prefix(p, &b, t, 12) == 8);
    kv_seq_release(p, &b);
    /* a different token in block 1 stops the match after block 0 */
    int32_t u[14];
    memcpy(u, t, sizeof u);
    u[5] = 7;
    CHECK(kv_seq_match_prefix(p, &b, u, 14) == 4);
    kv_seq_deinit(p, &b);
    /* another salt never shares */
    struct kv_seq c;
    kv_seq_init(&c, 42);
    CHECK(kv_seq_match_prefix(p, &c, t, 14) == 0);
    kv_seq_deinit(p, &c);
    kv_seq_deinit(p, &a);
    struct kv_stats st;
    kv_pool_stats(p, &st);
    CHECK(st.blocks_cached == 3 && st.blocks_used == 0 && st.blocks_free == 13);
    CHECK(st.hit_tokens == 12 + 8 + 4 && st.query_tokens == 14 * 4 + 12);
    /* released cached blocks are still found */
    kv_seq_init(&a, 0);
    CHECK(kv_seq_match_prefix(p, &a, t, 14) == 12);
    kv_seq_deinit(p, &a);
    CHECK(kv_debug_check(p, err, sizeof err) == 0);
    kv_pool_destroy(p);
}

/* Freed cached blocks are evicted only when the free list is empty, leaves
 * first; a recycled parent's generation bump makes old children unreachable. */
static void test_eviction_order(void)
{
    kv_pool *p = kv_pool_create(4, 2, true, err, sizeof err);
    int32_t t[7] = {1, 2, 3, 4, 5, 6, 7};
    struct kv_seq a;
    kv_seq_init(&a, 0);
    CHECK(kv_seq_reserve(p, &a, 7) == 0); /* 4 blocks */
    kv_seq_commit(p, &a, t, 6);           /* 3 cached */
    int32_t b0 = a.blocks[0], b1 = a.blocks[1], b2 = a.blocks[2];
    kv_seq_deinit(p, &a);
    struct kv_stats st;
    kv_pool_stats(p, &st);
    CHECK(st.blocks_free == 1 && st.blocks_cached == 3);
    /* two blocks: the free one, then the deepest cached leaf (b2) */
    struct kv_seq x;
    kv_seq_init(&x, 9);
    CHECK(kv_seq_reserve(p, &x, 4) == 0);
    CHECK(x.blocks[1] == b2);
    CHECK(!kv_debug_cached(p, b2));
    /* b0, b1 still reachable: 4 tokens hit */
    struct kv_seq y;
    kv_seq_init(&y, 0);
    CHECK(kv_seq_match_prefix(p, &y, t, 7) == 4);
    kv_seq_deinit(p, &y);
    /* next eviction takes b1 (the leaf now), then b0 */
    struct kv_seq z;
    kv_seq_init(&z, 9);
    CHECK(kv_seq_reserve(p, &z, 2) == 0 && z.blocks[0] == b1);
    CHECK(kv_seq_reserve(p, &z, 4) == 0 && z.blocks[1] == b0);
    kv_pool_stats(p, &st);
    CHECK(st.evictions == 3);
    kv_seq_init(&y, 0);
    CHECK(kv_seq_match_prefix(p, &y, t, 7) == 0);
    kv_seq_deinit(p, &y);
    kv_seq_deinit(p, &x);
    kv_seq_deinit(p, &z);
    CHECK(kv_debug_check(p, err, sizeof err) == 0);
    kv_pool_destroy(p);
}

/* ---- randomized test against a simple model of the pool ---- */

enum { R_BLOCKS = 48, R_BS = 4, R_SEQS = 10, R_MAXTOK = 40 };

struct rseq {
    bool live;
    struct kv_seq s;
    int32_t tok[R_MAXTOK];
    int n_tok;       /* prompt length */
    int n_done;      /* positions whose K/V was "computed" (or came from the cache) */
    int n_matched;   /* blocks that came from the cache */
};

/* What the model believes each block holds: the full token prefix up to the
 * end of that block, as written by whoever computed it. */
static int32_t content[R_BLOCKS][R_MAXTOK];
static int content_len[R_BLOCKS];

static uint64_t rng = 88172645463325252ULL;
static uint32_t rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

static int check_model(kv_pool *p, struct rseq *q)
{
    if (kv_debug_check(p, err, sizeof err)) {
        printf("  invariant: %s\n", err);
        return -1;
    }
    int holders[R_BLOCKS] = {0};
    for (int k = 0; k < R_SEQS; k++)
        if (q[k].live)
            for (int i = 0; i < q[k].s.n_blocks; i++) holders[q[k].s.blocks[i]]++;
    for (int b = 0; b < R_BLOCKS; b++)
        if (holders[b] != kv_debug_ref(p, b)) {
            printf("  block %d: ref %d but %d holders\n", b, kv_debug_ref(p, b), holders[b]);
            return -1;
        }
    return 0;
}

static void test_randomized(void)
{
    kv_pool *p = kv_pool_create(R_BLOCKS, R_BS, true, err, sizeof err);
    struct rseq q[R_SEQS];
    memset(q, 0, sizeof q);
    int bad = 0, hits = 0, evictions_seen = 0;
    for (int op = 0; op < 20000 && !bad; op++) {
        int k = (int)rnd(R_SEQS);
        struct rseq *r = &q[k];
        if (!r->live) {
            /* new sequence: one of 3 shared document prefixes plus a random tail, 2 salts */
            kv_seq_init(&r->s, rnd(5) == 0 ? 7 : 0);
            r->n_tok = 1 + (int)rnd(R_MAXTOK);
            int doc = (int)rnd(3), shared = (int)rnd((uint32_t)r->n_tok + 1);
            for (int i = 0; i < r->n_tok; i++) r->tok[i] = i < shared ? doc * 1000 + i : (int32_t)rnd(4);
            int m = kv_seq_match_prefix(p, &r->s, r->tok, r->n_tok);
            if (m % R_BS || m >= r->n_tok || m != r->s.n_blocks * R_BS) {
                printf("  match returned %d for %d tokens (%d blocks)\n", m, r->n_tok, r->s.n_blocks);
                bad = 1;
            }
            /* exactness: every matched block holds exactly this prompt's prefix */
            for (int i = 0; i < r->s.n_blocks && !bad; i++) {
                int b = r->s.blocks[i], len = (i + 1) * R_BS;
                if (content_len[b] != len || memcmp(content[b], r->tok, sizeof(int32_t) * (size_t)len)) {
                    printf("  op %d: block %d served for a different prefix\n", op, b);
                    bad = 1;
                }
            }
            hits += m > 0;
            r->n_matched = r->s.n_blocks;
            r->n_done = m;
            r->live = true;
        } else if (rnd(4) == 0) {
            kv_seq_release(p, &r->s);
            kv_seq_deinit(p, &r->s);
            r->live = false;
        } else if (r->n_done < r->n_tok) {
            /* compute a chunk: reserve, write contents of newly owned blocks, commit */
            int upto = r->n_done + 1 + (int)rnd((uint32_t)(r->n_tok - r->n_done));
            struct kv_stats before;
            kv_pool_stats(p, &before);
            int nb = r->s.n_blocks;
            int rc = kv_seq_reserve(p, &r->s, upto);
            if (rc == KV_ENOSPC) {
                if (r->s.n_blocks != nb) bad = 1;
                continue;
            }
            struct kv_stats after;
            kv_pool_stats(p, &after);
            evictions_seen += after.evictions > before.evictions;
            for (int i = r->n_matched; i < r->s.n_blocks; i++) {
                int b = r->s.blocks[i];
                int len = (i + 1) * R_BS;
                content_len[b] = -1; /* partial: not a full block yet */
                if (len <= upto) {
                    memcpy(content[b], r->tok, sizeof(int32_t) * (size_t)len);
                    content_len[b] = len;
                }
            }
            r->n_done = upto;
            kv_seq_commit(p, &r->s, r->tok, r->n_done);
        }
        if (!bad && check_model(p, q)) {
            printf("  after op %d\n", op);
            bad = 1;
        }
    }
    for (int k = 0; k < R_SEQS; k++)
        if (q[k].live) kv_seq_deinit(p, &q[k].s);
    struct kv_stats st;
    kv_pool_stats(p, &st);
    CHECK(!bad);
    CHECKF(st.blocks_used == 0 && st.blocks_free + st.blocks_cached == R_BLOCKS, "leak: used %d", st.blocks_used);
    CHECKF(hits > 100 && evictions_seen > 10, "the test must exercise hits (%d) and evictions (%d)", hits,
           evictions_seen);
    CHECK(kv_debug_check(p, err, sizeof err) == 0);
    kv_pool_destroy(p);
}

/* Recurrent-state slots: one per running sequence, taken with its blocks,
 * given back on release (finish, abort, preemption). */
static void test_state_slots(void)
{
    kv_pool *p = kv_pool_create(8, 4, false, err, sizeof err);
    CHECK(kv_pool_set_states(p, 2, 0, 1, err, sizeof err) == 0);
    CHECK(kv_pool_set_states(p, 2, 0, 1, err, sizeof err) == KV_EINVAL); /* once */
    CHECK(kv_pool_state_slots(p) == 2);
    struct kv_seq a, b, c;
    kv_seq_init(&a, 0), kv_seq_init(&b, 0), kv_seq_init(&c, 0);
    CHECK(kv_seq_reserve(p, &a, 5) == 0 && a.has_state);
    CHECK(kv_seq_reserve(p, &a, 9) == 0 && a.has_state); /* growing keeps the slot */
    CHECK(kv_seq_reserve(p, &b, 1) == 0 && b.has_state && b.state != a.state);
    CHECK(kv_seq_reserve(p, &c, 1) == KV_ENOSPC && !c.has_state && c.n_blocks == 0); /* nothing changed */
    int32_t sa = a.state;
    kv_seq_release(p, &a);
    CHECK(!a.has_state && a.n_blocks == 0);
    kv_seq_release(p, &a); /* twice is fine */
    CHECK(kv_seq_reserve(p, &c, 1) == 0 && c.has_state && c.state == sa);
    struct kv_seq z;
    memset(&z, 0, sizeof z);
    kv_seq_release(p, &z); /* a zeroed sequence holds nothing */
    CHECK(kv_seq_reserve(p, &a, 1) == KV_ENOSPC);
    kv_seq_deinit(p, &b), kv_seq_deinit(p, &c), kv_seq_deinit(p, &a);
    CHECK(kv_seq_reserve(p, &a, 1) == 0);
    kv_seq_deinit(p, &a);
    CHECK(kv_debug_check(p, err, sizeof err) == 0);
    kv_pool_destroy(p);
}

/* Snapshots: planned every snap_every blocks and at a prompt's last
 * matchable block, attached at commit to the cached block ending there; a
 * hit stops at the deepest block with one and resumes from it; snapshots
 * leave with their block or, when slots run out, least recently used first. */
static void test_state_snapshots(void)
{
    kv_pool *p = kv_pool_create(12, 4, true, err, sizeof err);
    CHECK(kv_pool_set_states(p, 2, 6, 2, err, sizeof err) == 0);
    int32_t t[22], u[22];
    fill(t, 22, 100);
    memcpy(u, t, sizeof u);
    u[18] = 7; /* shares the first 18 tokens with t */
    struct kv_seq a, b;
    kv_seq_init(&a, 0), kv_seq_init(&b, 0);
    CHECK(kv_seq_match_prefix(p, &a, t, 22) == 0 && !a.has_restore);
    CHECK(kv_seq_reserve(p, &a, 10) == 0);
    /* first chunk [0, 10): the grid's 8 */
    CHECK(kv_seq_plan_snaps(p, &a, 0, 10, 22) == 1 && a.snap_pos[0] == 8 && a.snap_slot[0] >= 2);
    kv_seq_commit(p, &a, t, 10);
    CHECK(a.n_snaps == 0 && kv_debug_snap(p, a.blocks[1]) >= 2 && kv_debug_snap(p, a.blocks[0]) == -1);
    /* second chunk [10, 22): the grid's 16 and the prompt's last full block, 20 */
    CHECK(kv_seq_reserve(p, &a, 22) == 0);
    CHECK(kv_seq_plan_snaps(p, &a, 10, 22, 22) == 2 && a.snap_pos[0] == 16 && a.snap_pos[1] == 20);
    kv_seq_commit(p, &a, t, 22);
    CHECK(kv_debug_snap(p, a.blocks[3]) >= 2 && kv_debug_snap(p, a.blocks[4]) >= 2 &&
          kv_debug_snap(p, a.blocks[2]) == -1);
    struct kv_stats st;
    kv_pool_stats(p, &st);
    CHECK(st.snaps_held == 3 && st.snap_slots == 6 && st.state_slots == 2);
    /* the same prompt: a hit of 20 tokens resuming from block 4's snapshot */
    CHECK(kv_seq_match_prefix(p, &b, t, 22) == 20 && b.has_restore && b.restore == kv_debug_snap(p, a.blocks[4]));
    CHECK(b.n_blocks == 5 && b.blocks[4] == a.blocks[4]);
    kv_seq_release(p, &b);
    CHECK(!b.has_restore);
    /* u leaves t after 18 tokens: its blocks 0..3 match, block 3 (16) carries a snapshot */
    CHECK(kv_seq_match_prefix(p, &b, u, 22) == 16 && b.restore == kv_debug_snap(p, a.blocks[3]));
    kv_seq_release(p, &b);
    /* the junction: a prompt leaving t after 14 tokens matches 3 blocks but resumes at 8 (the grid); on the way
     * it snapshots 12, where it left t, so a third prompt sharing those 14 tokens resumes at 12 */
    int32_t j1[22], j2[22];
    memcpy(j1, t, sizeof j1);
    memcpy(j2, t, sizeof j2);
    j1[14] = 3, j2[14] = 4;
    CHECK(kv_seq_match_prefix(p, &b, j1, 22) == 8 && b.junction == 12);
    CHECK(kv_seq_reserve(p, &b, 22) == 0);
    CHECK(kv_seq_plan_snaps(p, &b, 8, 22, 22) == 3 && b.snap_pos[0] == 12 && b.snap_pos[1] == 16 &&
          b.snap_pos[2] == 20);
    kv_seq_commit(p, &b, j1, 22);
    struct kv_seq c3;
    kv_seq_init(&c3, 0);
    CHECK(kv_seq_match_prefix(p, &c3, j2, 22) == 12 && c3.junction == 0);
    kv_seq_deinit(p, &c3);
    kv_seq_release(p, &b);
    CHECK(b.junction == 0);
    /* a prompt matching only block 0 (no snapshot there): no hit at all */
    int32_t v[10];
    fill(v, 10, 100);
    v[5] = 1;
    CHECK(kv_seq_match_prefix(p, &b, v, 10) == 0 && b.n_blocks == 0 && kv_debug_ref(p, a.blocks[0]) == 1);
    CHECK(b.junction == 4); /* it leaves t after block 0: a snapshot there on its way */
    kv_seq_release(p, &b);
    /* snapshot slots run out: a's blocks released to the LRU, a new prompt's
     * snapshot takes the least recently released block's */
    kv_seq_release(p, &a);
    int held_before = 0;
    for (int i = 0; i < 12; i++) held_before += kv_debug_snap(p, i) >= 0;
    CHECK(held_before == 6); /* t's three, j1's three */
    int32_t w[10];
    fill(w, 10, 500);
    CHECK(kv_seq_reserve(p, &b, 10) == 0);
    CHECK(kv_seq_plan_snaps(p, &b, 0, 10, 10) == 1 && b.snap_pos[0] == 8);
    kv_seq_commit(p, &b, w, 10);
    kv_pool_stats(p, &st);
    CHECK(st.snaps_held == 6);
    kv_seq_release(p, &b);
    /* releasing a sequence with planned snapshots gives their slots back */
    CHECK(kv_seq_reserve(p, &b, 10) == 0 && kv_seq_plan_snaps(p, &b, 0, 10, 10) == 1);
    kv_seq_deinit(p, &b);
    CHECK(kv_debug_check(p, err, sizeof err) == 0);
    /* eviction takes snapshots along: fill the pool with fresh blocks */
    struct kv_seq big;
    kv_seq_init(&big, 9);
    CHECK(kv_seq_reserve(p, &big, 48) == 0);
    kv_pool_stats(p, &st);
    CHECK(st.snaps_held == 0);
    kv_seq_deinit(p, &big);
    /* every snapshot slot is free again: three can be planned at once */
    kv_seq_init(&big, 9);
    int32_t x[26];
    fill(x, 26, 900);
    CHECK(kv_seq_reserve(p, &big, 26) == 0 && kv_seq_plan_snaps(p, &big, 0, 26, 26) == 3);
    kv_seq_deinit(p, &big);
    kv_seq_deinit(p, &a);
    CHECK(kv_debug_check(p, err, sizeof err) == 0);
    kv_pool_destroy(p);
}

/* Randomized sequences with recurrent state: a snapshot slot's content (the
 * prefix it was "computed" after) is recorded when it is filled; a hit must
 * resume from a snapshot of exactly its matched prefix, no slot is ever held
 * by two blocks or by a block and a sequence, and every slot comes back. */
static uint64_t prefix_hash(const int32_t *t, int n)
{
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)t[i]) * 1099511628211ULL;
    return h ^ (uint64_t)n << 56;
}

/* A verify step's snapshot past its accepted tokens holds a rejected draft's
 * state: commit gives it back instead of attaching it, and a later step
 * over that position plans it again. */
static void test_state_snapshot_rollback(void)
{
    kv_pool *p = kv_pool_create(8, 4, true, err, sizeof err);
    CHECK(kv_pool_set_states(p, 1, 3, 1, err, sizeof err) == 0);
    int32_t t[16];
    fill(t, 16, 200);
    struct kv_seq a;
    kv_seq_init(&a, 0);
    CHECK(kv_seq_reserve(p, &a, 11) == 0);
    CHECK(kv_seq_plan_snaps(p, &a, 0, 6, 6) == 1 && a.snap_pos[0] == 4);
    kv_seq_commit(p, &a, t, 6);
    struct kv_stats st;
    kv_pool_stats(p, &st);
    CHECK(a.n_snaps == 0 && st.snaps_held == 1);
    /* a verify step over positions 6..10 (a decode and four drafts) plans 8; one draft is accepted: 8 tokens
     * computed, so 8 is kept; over 8..12 it plans 12 and accepts none (9 computed): 12 goes back */
    CHECK(kv_seq_plan_snaps(p, &a, 6, 11, 6) == 1 && a.snap_pos[0] == 8);
    kv_seq_commit(p, &a, t, 8);
    kv_pool_stats(p, &st);
    CHECK(a.n_snaps == 0 && st.snaps_held == 2 && kv_debug_snap(p, a.blocks[1]) >= 1);
    CHECK(kv_seq_reserve(p, &a, 13) == 0);
    CHECK(kv_seq_plan_snaps(p, &a, 8, 13, 6) == 1 && a.snap_pos[0] == 12);
    kv_seq_commit(p, &a, t, 9);
    kv_pool_stats(p, &st);
    CHECK(a.n_snaps == 0 && st.snaps_held == 2 && kv_debug_snap(p, a.blocks[2]) == -1);
    /* the next step reaches 12 again and takes it */
    CHECK(kv_seq_plan_snaps(p, &a, 9, 13, 6) == 1 && a.snap_pos[0] == 12);
    kv_seq_commit(p, &a, t, 13);
    kv_pool_stats(p, &st);
    CHECK(a.n_snaps == 0 && st.snaps_held == 3 && kv_debug_snap(p, a.blocks[2]) >= 1);
    CHECK(kv_debug_check(p, err, sizeof err) == 0);
    kv_seq_release(p, &a);
    kv_pool_destroy(p);
}

static void test_randomized_states(void)
{
    enum { NSEQ = 4, NSNAP = 6 };
    kv_pool *p = kv_pool_create(R_BLOCKS, R_BS, true, err, sizeof err);
    CHECK(kv_pool_set_states(p, NSEQ, NSNAP, 2, err, sizeof err) == 0);
    static uint64_t snap_content[NSEQ + NSNAP];
    struct rseq q[R_SEQS];
    memset(q, 0, sizeof q);
    int bad = 0, restores = 0, live = 0;
    for (int op = 0; op < 20000 && !bad; op++) {
        struct rseq *r = &q[rnd(R_SEQS)];
        if (!r->live) {
            if (live == NSEQ) continue; /* at most NSEQ running, as the scheduler keeps it */
            kv_seq_init(&r->s, rnd(5) == 0 ? 7 : 0);
            r->n_tok = 1 + (int)rnd(R_MAXTOK);
            int doc = (int)rnd(3), shared = (int)rnd((uint32_t)r->n_tok + 1);
            for (int i = 0; i < r->n_tok; i++) r->tok[i] = i < shared ? doc * 1000 + i : (int32_t)rnd(4);
            int m = kv_seq_match_prefix(p, &r->s, r->tok, r->n_tok);
            if (m > 0) {
                restores++;
                if (!r->s.has_restore || r->s.restore < NSEQ || snap_content[r->s.restore] != prefix_hash(r->tok, m)) {
                    printf("  op %d: a hit of %d tokens resumes from a wrong snapshot\n", op, m);
                    bad = 1;
                }
            } else if (r->s.has_restore) {
                bad = 1;
            }
            r->n_done = m;
            r->live = true;
            live++;
            if (kv_seq_reserve(p, &r->s, m + 1) != 0) { /* the scheduler gives up the admission */
                kv_seq_deinit(p, &r->s);
                r->live = false;
                live--;
            }
        } else if (rnd(4) == 0) {
            kv_seq_deinit(p, &r->s);
            r->live = false;
            live--;
        } else if (r->n_done < r->n_tok) {
            int upto = r->n_done + 1 + (int)rnd((uint32_t)(r->n_tok - r->n_done));
            if (kv_seq_reserve(p, &r->s, upto) != 0) continue;
            if (!r->s.has_state || r->s.state >= NSEQ) bad = 1;
            r->s.has_restore = false; /* the step copied it */
            kv_seq_plan_snaps(p, &r->s, r->n_done, upto, r->n_tok);
            for (int i = 0; i < r->s.n_snaps; i++) {
                int k = r->s.snap_slot[i];
                if (k < NSEQ || k >= NSEQ + NSNAP) bad = 1;
                else snap_content[k] = prefix_hash(r->tok, r->s.snap_pos[i]); /* the step writes it */
            }
            r->n_done = upto;
            kv_seq_commit(p, &r->s, r->tok, r->n_done);
            if (r->s.n_snaps != 0) bad = 1; /* all attached or freed */
        }
        /* every slot has at most one holder: a block, or a running sequence's state */
        int holder[NSEQ + NSNAP] = {0};
        for (int b = 0; b < R_BLOCKS; b++)
            if (kv_debug_snap(p, b) >= 0) holder[kv_debug_snap(p, b)]++;
        for (int k = 0; k < R_SEQS; k++)
            if (q[k].live && q[k].s.has_state) holder[q[k].s.state]++;
        for (int k = 0; k < NSEQ + NSNAP; k++)
            if (holder[k] > 1) {
                printf("  op %d: slot %d has %d holders\n", op, k, holder[k]);
                bad = 1;
            }
        if (kv_debug_check(p, err, sizeof err)) {
            printf("  op %d: %s\n", op, err);
            bad = 1;
        }
    }
    CHECK(!bad);
    CHECKF(restores > 100, "only %d restores", restores);
    for (int k = 0; k < R_SEQS; k++)
        if (q[k].live) kv_seq_deinit(p, &q[k].s);
    struct kv_seq t[NSEQ + 1];
    for (int i = 0; i <= NSEQ; i++) { /* every sequence slot is back */
        kv_seq_init(&t[i], 3);
        CHECK(kv_seq_reserve(p, &t[i], 1) == (i < NSEQ ? 0 : KV_ENOSPC));
    }
    for (int i = 0; i <= NSEQ; i++) kv_seq_deinit(p, &t[i]);
    kv_pool_destroy(p);
}

int main(void)
{
    RUN(test_create_errors);
    RUN(test_reserve_slots_release);
    RUN(test_prefix_reuse);
    RUN(test_eviction_order);
    RUN(test_randomized);
    RUN(test_state_slots);
    RUN(test_state_snapshots);
    RUN(test_state_snapshot_rollback);
    RUN(test_randomized_states);
    return test_summary();
}
