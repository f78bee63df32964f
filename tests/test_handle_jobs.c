/* Handle heap under the job scheduler: jobs allocate, write, resolve, pin, unpin and free
 * concurrently (each its own handles), and all of them resolve and pin a set of shared
 * long-lived handles; the handle table grows while they run. Between rounds (the frame
 * boundary) the main thread compacts and verifies every block.
 *
 * Retiring old tables: the heap's retire callback defers each old table to this test's own
 * list, which the main thread frees at its quiescent point, after the round's counter reached
 * zero: no job of the round can still hold a table pointer then (a grace period by
 * construction, as QSBR's frame-end quiescent state gives the runtime). ThreadSanitizer sees
 * the free as a write: a reader still using a retired table after it would be reported.
 * Swept over 1, 2 and 4 workers. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "sp_handle.h"
#include "sp_jobs.h"
#include "test_support.h"

enum { SHARED = 64, JOBS = 16, ROUNDS = 5 };

static sp_handle_heap *heap;
static sp_handle shared[SHARED];
static atomic_int errors;
static uint32_t own_per_job;
static uint32_t ops_per_job;

typedef struct deferred {
    void *old;
    void (*free_fn)(void *);
} deferred;
static deferred retired[64];
static int n_retired, n_freed; /* under the heap lock (retire is called with it held) */

static void defer_retire(void *user, void *old, void (*free_fn)(void *)) {
    (void)user;
    if (n_retired < 64)
        retired[n_retired++] = (deferred){old, free_fn};
    else
        atomic_fetch_add(&errors, 1);
}

/* The quiescent point: every job of the round has returned. */
static void retired_free(void) {
    for (int i = n_freed; i < n_retired; i++) retired[i].free_fn(retired[i].old);
    n_freed = n_retired;
}

static uint8_t tag_of(sp_handle h) {
    return (uint8_t)(h.id * 2654435761u >> 24) | 1;
}

static bool block_ok(const uint8_t *p, size_t n, uint8_t tag) {
    return p && p[0] == tag && p[n / 2] == tag && p[n - 1] == tag;
}

static void worker_job(void *arg) {
    uintptr_t seed = (uintptr_t)arg;
    ts_rng r;
    ts_rng_seed(&r, seed);
    sp_handle *own = calloc(own_per_job, sizeof *own);
    size_t *size = calloc(own_per_job, sizeof *size);
    for (uint32_t op = 0; op < ops_per_job; op++) {
        uint32_t k = (uint32_t)ts_rng_range(&r, 0, own_per_job - 1);
        if (!own[k].id) {
            size[k] = ts_rng_range(&r, 1, 3000);
            own[k] = sp_handle_alloc(heap, size[k], 0);
            uint8_t *p = sp_handle_resolve(heap, own[k]);
            if (!p) {
                atomic_fetch_add(&errors, 1);
                continue;
            }
            memset(p, tag_of(own[k]), size[k]);
        } else if (ts_rng_range(&r, 0, 3) == 0) {
            if (sp_handle_free(heap, own[k]) != SP_OK) atomic_fetch_add(&errors, 1);
            own[k].id = 0;
        } else {
            uint8_t *p = sp_handle_pin(heap, own[k]);
            if (!block_ok(p, size[k], tag_of(own[k]))) atomic_fetch_add(&errors, 1);
            if (sp_handle_unpin(heap, own[k]) != SP_OK) atomic_fetch_add(&errors, 1);
        }
        sp_handle s = shared[ts_rng_range(&r, 0, SHARED - 1)];
        if (op & 1) {
            if (!block_ok(sp_handle_resolve(heap, s), 256, tag_of(s))) atomic_fetch_add(&errors, 1);
        } else {
            const uint8_t *p = sp_handle_pin(heap, s);
            if (!block_ok(p, 256, tag_of(s))) atomic_fetch_add(&errors, 1);
            if (sp_handle_unpin(heap, s) != SP_OK) atomic_fetch_add(&errors, 1);
        }
    }
    for (uint32_t k = 0; k < own_per_job; k++)
        if (own[k].id && ts_rng_range(&r, 0, 1)) sp_handle_free(heap, own[k]);
    /* the rest stays live across the frame: compaction moves them, nobody frees them here */
    free(own);
    free(size);
}

static void run(uint32_t workers) {
    atomic_store(&errors, 0);
    n_retired = n_freed = 0;
    heap = sp_handle_heap_create(&(sp_handle_heap_desc){.retire = defer_retire}, NULL);
    for (int i = 0; i < SHARED; i++) {
        shared[i] = sp_handle_alloc(heap, 256, 0);
        memset(sp_handle_resolve(heap, shared[i]), tag_of(shared[i]), 256);
    }
    sp_jobs *s = NULL;
    if (sp_jobs_create(&s, &(sp_jobs_desc){.workers = workers}) != SP_OK) {
        ok(false, "%u workers: scheduler", workers);
        return;
    }
    ops_per_job = (uint32_t)ts_scaled(4000, 4);
    bool compact_ok = true;
    uint64_t moved = 0;
    for (int round = 0; round < ROUNDS; round++) {
        own_per_job = 50u << round;
        sp_job_desc d[JOBS];
        for (int j = 0; j < JOBS; j++)
            d[j] = (sp_job_desc){.fn = worker_job,
                                 .arg = (void *)(uintptr_t)(round * 1000 + j + workers * 7)};
        sp_counter *c = sp_counter_create(s, "round");
        sp_jobs_submit(s, d, JOBS, c);
        sp_counter_wait(c, 0);
        sp_counter_destroy(c);
        retired_free(); /* frame end: the quiescent point */
        sp_handle_compact_stats cs;
        compact_ok &= sp_handle_compact(heap, 0, &cs) == SP_OK && cs.caught_up;
        moved += cs.bytes_moved;
        compact_ok &= sp_handle_heap_check(heap) == SP_OK;
        for (int i = 0; i < SHARED; i++)
            compact_ok &= block_ok(sp_handle_resolve(heap, shared[i]), 256, tag_of(shared[i]));
    }
    sp_jobs_destroy(s);
    sp_handle_heap_status st;
    sp_handle_heap_status_get(heap, &st);
    is_int(atomic_load(&errors), 0, "%u workers: every alloc/resolve/pin/unpin/free as expected",
           workers);
    ok(n_retired >= 3 && n_freed == n_retired,
       "%u workers: the table grew to %u while jobs ran (%d tables retired, freed at frame end)",
       workers, st.table_capacity, n_retired);
    ok(compact_ok && moved > 0,
       "%u workers: compaction between rounds (%llu bytes moved), every block intact", workers,
       (unsigned long long)moved);
    sp_handle_heap_destroy(heap);
}

int main(void) {
    static const uint32_t sweep[] = {1, 2, 4};
    plan(3 * 3);
    for (size_t i = 0; i < 3; i++) run(sweep[i]);
    return done();
}
