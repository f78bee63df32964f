/* Thread caches under ThreadSanitizer: threads allocate blocks of random sizes, fill them with
 * a pattern, swap them into random slots of a shared array, and verify and free whatever they
 * took out, so most frees happen on another thread than the allocation. Every thread detaches
 * now and then mid-run (its spans become orphans that others adopt; its blocks are still freed
 * by others). Swept over 1, 2, 4 and 8 threads; each sweep ends with the leak check: every
 * status figure back to zero after the last detach and a trim. Then frees racing their
 * owner's exit, each orphan they empty returned by the next tidy. */
#include <stdatomic.h>
#include <string.h>

#include "sp_tcache.h"
#include "tcache_heap.h"
#include "test_support.h"

enum { SLOTS = 512, MAX_THREADS = 8 };

typedef struct world {
    _Atomic(unsigned char *) slot[SLOTS];
    atomic_int bad;
    atomic_int running; /* workers still running */
    int status_reads;
    int iterations;
    size_t allocated_seen; /* sp_tcache_allocated as the reader last saw it */
    int went_back;         /* readings below the one before */
} world;

typedef struct worker {
    world *w;
    uint64_t seed;
    int detaches;
    size_t asked; /* bytes of its allocations that succeeded */
} worker;

/* Block layout: 8 bytes of size, then bytes derived from the size and the address. */
static void fill(unsigned char *p, size_t n) {
    memcpy(p, &n, sizeof n);
    for (size_t i = sizeof n; i < n; i++) p[i] = (unsigned char)(n * 7 + i + ((uintptr_t)p >> 4));
}

static bool check(const unsigned char *p) {
    size_t n;
    memcpy(&n, p, sizeof n);
    if (n < sizeof n || n > 70000) return false;
    for (size_t i = sizeof n; i < n; i++)
        if (p[i] != (unsigned char)(n * 7 + i + ((uintptr_t)p >> 4))) return false;
    return true;
}

static void *worker_run(void *arg) {
    worker *me = arg;
    world *w = me->w;
    ts_rng r;
    ts_rng_seed(&r, me->seed);
    for (int i = 0; i < w->iterations; i++) {
        size_t n = ts_rng_range(&r, 8, ts_rng_range(&r, 0, 63) == 0 ? 66000 : 600);
        unsigned char *p = ts_rng_range(&r, 0, 15) == 0
                               ? sp_tcache_aligned_alloc((size_t)16 << ts_rng_range(&r, 0, 8), n)
                               : sp_tcache_alloc(n);
        if (!p) {
            atomic_fetch_add(&w->bad, 1);
            continue;
        }
        me->asked += n;
        fill(p, n);
        unsigned char *old = atomic_exchange(&w->slot[ts_rng_range(&r, 0, SLOTS - 1)], p);
        if (old) {
            if (!check(old)) atomic_fetch_add(&w->bad, 1);
            sp_tcache_free(old);
        }
        if (ts_rng_range(&r, 0, 1999) == 0) {
            sp_tcache_thread_detach(); /* mid-run: the next alloc attaches a fresh cache */
            me->detaches++;
        }
    }
    atomic_fetch_sub(&w->running, 1);
    return NULL; /* thread exit detaches the cache */
}

/* Aggregated status while the workers run: any thread may ask (figures are a snapshot). */
static void *status_reader(void *arg) {
    world *w = arg;
    while (atomic_load(&w->running) > 0) {
        sp_tcache_status st;
        sp_tcache_status_get(&st);
        size_t seen = sp_tcache_allocated();          /* the running caches' counts, relaxed */
        if (seen < w->allocated_seen) w->went_back++; /* detaches must not lose counts */
        w->allocated_seen = seen;
        w->status_reads++;
        sp_thread_yield();
    }
    return NULL;
}

static void sweep(int threads, int iterations) {
    static world w;
    memset(&w, 0, sizeof w);
    w.iterations = iterations;
    worker wk[MAX_THREADS];
    sp_thread t[MAX_THREADS];
    int started = 0;
    size_t allocated0 = sp_tcache_allocated();
    w.allocated_seen = allocated0;
    atomic_store(&w.running, threads);
    for (int i = 0; i < threads; i++) {
        wk[i] = (worker){.w = &w, .seed = 0x1234u + (uint64_t)i * 77 + (uint64_t)threads};
        if (sp_thread_start(&t[i], worker_run, &wk[i], "sp-stress") == SP_OK) started++;
    }
    sp_thread reader;
    bool reading = sp_thread_start(&reader, status_reader, &w, "sp-status") == SP_OK;
    for (int i = 0; i < started; i++) sp_thread_join(t[i]);
    atomic_store(&w.running, 0);
    if (reading) sp_thread_join(reader);
    int detaches = 0;
    size_t asked = 0;
    for (int i = 0; i < started; i++) {
        detaches += wk[i].detaches;
        asked += wk[i].asked;
    }
    size_t allocated = sp_tcache_allocated() - allocated0;
    sp_tcache_status mid;
    sp_tcache_status_get(&mid);
    for (int i = 0; i < SLOTS; i++) {
        unsigned char *p = atomic_load(&w.slot[i]);
        if (p && !check(p)) atomic_fetch_add(&w.bad, 1);
        sp_tcache_free(p);
    }
    ok(started == threads && atomic_load(&w.bad) == 0,
       "%d threads x %d blocks: every block intact when freed (%d bad), %d detaches mid-run",
       threads, iterations, atomic_load(&w.bad), detaches);
    ok(allocated == asked && w.allocated_seen - allocated0 <= asked && w.went_back == 0,
       "%d threads: sp_tcache_allocated grew by the %zu bytes they asked for, detached caches "
       "included (%zu; read %d times while they ran, never lower than the time before)",
       threads, asked, allocated, w.status_reads);
    ok(threads == 1 || mid.remote_frees > 0,
       "%d threads: %zu remote frees, %zu orphaned spans, status read %d times meanwhile", threads,
       mid.remote_frees, mid.spans_orphaned, w.status_reads);
    sp_tcache_thread_detach();
    sp_tcache_trim();
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    ok(st.live_blocks == 0 && st.bytes_used == 0 && st.spans == 0 && st.spans_orphaned == 0 &&
           st.caches == 0 && st.remote_pending == 0 && st.span_heap.live_blocks == 0 &&
           st.large_heap.live_blocks == 0,
       "%d threads: after trim every figure is zero (live %zu, spans %zu, orphans %zu, caches "
       "%zu, pending %zu, heaps %zu/%zu)",
       threads, st.live_blocks, st.spans, st.spans_orphaned, st.caches, st.remote_pending,
       st.span_heap.live_blocks, st.large_heap.live_blocks);
}

/* A block freed on another thread while its owner exits: the free's push either reaches the
 * owner's drain or lands in an orphan (its span was orphaned with the block live), and then
 * sp_tcache_tidy must see that an orphan was freed into and return the empty orphan. */
typedef struct handoff {
    void *block;
    atomic_int published, leave;
} handoff;

static void *owner_exits(void *arg) {
    handoff *h = arg;
    h->block = sp_tcache_alloc(3000);
    atomic_store(&h->published, 1);
    while (!atomic_load(&h->leave)) sp_thread_yield();
    return NULL; /* exit: the cache drains, a span with the block still live is orphaned */
}

static void *frees_while_owner_exits(void *arg) {
    handoff *h = arg;
    while (!atomic_load(&h->published)) sp_thread_yield();
    atomic_store(&h->leave, 1);
    sp_tcache_free(h->block);
    return NULL;
}

static size_t orphans(void) {
    size_t n = 0;
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++) n += atomic_load(&tc.orphan_count[k]);
    return n;
}

static void race_orphaning(int rounds) {
    int left = 0;
    for (int r = 0; r < rounds; r++) {
        handoff h = {0};
        sp_thread a, b;
        sp_thread_start(&a, owner_exits, &h, "sp-owner");
        sp_thread_start(&b, frees_while_owner_exits, &h, "sp-freer");
        sp_thread_join(a);
        sp_thread_join(b);
        sp_tcache_tidy();
        if (orphans()) {
            left++;
            sp_tcache_trim();
        }
    }
    ok(left == 0,
       "%d frees racing their owner's exit: tidy returned every orphan they emptied "
       "(%d left)",
       rounds, left);
    sp_tcache_trim();
}

int main(void) {
    plan(17);
    int iterations = (int)ts_scaled(200000, 8);
    const int counts[] = {1, 2, 4, 8};
    for (int i = 0; i < 4; i++) sweep(counts[i], iterations / counts[i]);
    race_orphaning((int)ts_scaled(2000, 8));
    return done();
}
