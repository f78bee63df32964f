/* Thread caches under ThreadSanitizer: threads allocate blocks of random sizes, fill them with
 * a pattern, swap them into random slots of a shared array, and verify and free whatever they
 * took out, so most frees happen on another thread than the allocation. Every thread detaches
 * now and then mid-run (its spans become orphans that others adopt; its blocks are still freed
 * by others). Swept over 1, 2, 4 and 8 threads; each sweep ends with the leak check: every
 * status figure back to zero after the last detach and a trim. */
#include <stdatomic.h>
#include <string.h>

#include "sp_tcache.h"
#include "test_support.h"

enum { SLOTS = 512, MAX_THREADS = 8 };

typedef struct world {
    _Atomic(unsigned char *) slot[SLOTS];
    atomic_int bad;
    atomic_int running; /* workers still running */
    int status_reads;
    int iterations;
} world;

typedef struct worker {
    world *w;
    uint64_t seed;
    int detaches;
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
    atomic_store(&w.running, threads);
    for (int i = 0; i < threads; i++) {
        wk[i] = (worker){&w, 0x1234u + (uint64_t)i * 77 + (uint64_t)threads, 0};
        if (sp_thread_start(&t[i], worker_run, &wk[i], "sp-stress") == SP_OK) started++;
    }
    sp_thread reader;
    bool reading = sp_thread_start(&reader, status_reader, &w, "sp-status") == SP_OK;
    for (int i = 0; i < started; i++) sp_thread_join(t[i]);
    atomic_store(&w.running, 0);
    if (reading) sp_thread_join(reader);
    int detaches = 0;
    for (int i = 0; i < started; i++) detaches += wk[i].detaches;
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

int main(void) {
    plan(12);
    int iterations = (int)ts_scaled(200000, 8);
    const int counts[] = {1, 2, 4, 8};
    for (int i = 0; i < 4; i++) sweep(counts[i], iterations / counts[i]);
    return done();
}
