/* The locked TLSF heap under concurrent use (run under ThreadSanitizer in CI).
 *
 * Threads allocate blocks (malloc, aligned_alloc, realloc), stamp them with a pattern, and
 * trade them through a shared array of atomic slots: a block is usually freed by a different
 * thread than the one that made it. Meanwhile they ask owns() and status, and one more thread
 * adds pools, so every call that may run concurrently does. Swept over 1, 2, 4 and 8 threads;
 * at the end every block is freed, check() passes and the heap reports nothing live. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "sp_platform.h"
#include "sp_tlsf.h"
#include "test_support.h"

enum { SLOTS = 256, HEAP = 16 << 20, EXTRA = 256 << 10 };

typedef struct shared {
    sp_tlsf *heap;
    _Atomic(uint64_t *) slots[SLOTS];
    void *extra[SP_TLSF_MAX_POOLS];
    long ops;
    atomic_int bad;
    atomic_long cross_frees;
} shared;

typedef struct worker {
    shared *sh;
    uint64_t seed;
    uint64_t id;
} worker;

/* A block records its owner id and size in its first two words, and a fill pattern after. */
static uint64_t *stamp(uint64_t *p, uint64_t owner, size_t words) {
    p[0] = owner;
    p[1] = words;
    for (size_t i = 2; i < words; i++) p[i] = owner ^ i;
    return p;
}

static bool stamped(const uint64_t *p) {
    for (size_t i = 2; i < p[1]; i++)
        if (p[i] != (p[0] ^ i)) return false;
    return true;
}

static void *work(void *arg) {
    worker *w = arg;
    shared *sh = w->sh;
    ts_rng r;
    ts_rng_seed(&r, w->seed);
    for (long op = 0; op < sh->ops; op++) {
        size_t words = 2 + ts_rng_range(&r, 0, ts_rng_next(&r) % 4 ? 30 : 2000);
        unsigned kind = (unsigned)(ts_rng_next(&r) % 8);
        uint64_t *mine = kind == 0 ? sp_tlsf_aligned_alloc(sh->heap, 256, words * 8)
                                   : sp_tlsf_malloc(sh->heap, words * 8);
        if (mine && kind == 1) { /* grow or shrink it once, keeping the stamp valid */
            stamp(mine, w->id, words);
            words = 2 + ts_rng_range(&r, 0, 500);
            uint64_t *moved = sp_tlsf_realloc(sh->heap, mine, words * 8);
            if (moved)
                mine = moved;
            else
                sp_tlsf_free(sh->heap, mine), mine = NULL;
        }
        if (!mine || !sp_tlsf_owns(sh->heap, mine)) {
            atomic_fetch_add(&sh->bad, 1);
            break;
        }
        stamp(mine, w->id, words);
        if (kind == 2) {
            sp_tlsf_status st;
            sp_tlsf_status_get(sh->heap, &st);
            if (st.live_blocks == 0 || st.bytes_used < words * 8) atomic_fetch_add(&sh->bad, 1);
        }
        uint64_t *theirs = atomic_exchange(&sh->slots[ts_rng_next(&r) % SLOTS], mine);
        if (theirs) {
            if (!stamped(theirs)) atomic_fetch_add(&sh->bad, 1);
            if (theirs[0] != w->id) atomic_fetch_add(&sh->cross_frees, 1);
            sp_tlsf_free(sh->heap, theirs);
        }
    }
    return NULL;
}

/* Adds every remaining pool while the workers run. */
static void *add_pools(void *arg) {
    shared *sh = arg;
    for (int i = 1; i < SP_TLSF_MAX_POOLS; i++) {
        if (sp_tlsf_add_pool(sh->heap, sh->extra[i], EXTRA) != SP_OK) atomic_fetch_add(&sh->bad, 1);
        sp_thread_yield();
    }
    return NULL;
}

static void sweep(int threads) {
    void *mem = aligned_alloc(64, HEAP);
    sp_tlsf_desc d = {.memory = mem, .size = HEAP, .locked = true, .name = "locked"};
    shared sh = {.heap = sp_tlsf_create(&d, NULL), .ops = (long)ts_scaled(200000, 20) / threads};
    worker w[8];
    sp_thread th[8], adder;
    for (int i = 1; i < SP_TLSF_MAX_POOLS; i++) sh.extra[i] = aligned_alloc(64, EXTRA);
    sp_thread_start(&adder, add_pools, &sh, "tlsf-pools");
    for (int i = 0; i < threads; i++) {
        w[i] = (worker){&sh, 1000 + (uint64_t)i, (uint64_t)i + 1};
        sp_thread_start(&th[i], work, &w[i], "tlsf-locked");
    }
    for (int i = 0; i < threads; i++) sp_thread_join(th[i]);
    sp_thread_join(adder);
    for (int i = 0; i < SLOTS; i++) {
        uint64_t *p = atomic_load(&sh.slots[i]);
        if (p && !stamped(p)) atomic_fetch_add(&sh.bad, 1);
        sp_tlsf_free(sh.heap, p);
    }
    ok(atomic_load(&sh.bad) == 0, "%d threads: every block intact when freed", threads);
    ok(threads == 1 || atomic_load(&sh.cross_frees) > 0,
       "%d threads: %ld blocks freed by another thread", threads,
       (long)atomic_load(&sh.cross_frees));
    is_int(sp_tlsf_check(sh.heap), SP_OK, "%d threads: heap passes check", threads);
    sp_tlsf_status s;
    sp_tlsf_status_get(sh.heap, &s);
    ok(s.live_blocks == 0 && s.bytes_used == 0 && s.free_blocks == SP_TLSF_MAX_POOLS,
       "%d threads: nothing live, every pool whole again", threads);
    sp_tlsf_destroy(sh.heap);
    free(mem);
    for (int i = 1; i < SP_TLSF_MAX_POOLS; i++) free(sh.extra[i]);
}

int main(void) {
    const int counts[] = {1, 2, 4, 8};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) sweep(counts[i]);
    return done();
}
