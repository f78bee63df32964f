/* Thread caches under the job scheduler: jobs allocate, wait on a counter (the job's fiber parks
 * and may resume on another worker), and allocate again in the same function. Every block must
 * come from the cache of the thread the job runs on at that moment, never from a cache kept
 * across the wait. Runs rounds until jobs were seen to move between workers (bounded), then
 * frees everything (many frees are remote) and checks that nothing is left. */
#include <stdatomic.h>

#include "sp_jobs.h"
#include "sp_tcache.h"
#include "test_support.h"

enum { SIZES = 4, MIN_ROUNDS = 20, MAX_ROUNDS = 4000, WANT_MIGRATIONS = 16 };
static const size_t sizes[SIZES] = {24, 200, 3000, 30000};

static atomic_int wrong_before, wrong_after, wrong_worker, migrations, waits;

/* Allocates, waits for its partner's signal, allocates again: both halves checked against the
 * thread running them. */
static void waiter_job(void *arg) {
    ts_pair *p = arg;
    void *before[SIZES], *after[SIZES];
    uint64_t a = sp_thread_os_id();
    for (int i = 0; i < SIZES; i++) {
        before[i] = sp_tcache_alloc(sizes[i]);
        if (!before[i] || sp_tcache_owner_thread(before[i]) != a)
            atomic_fetch_add(&wrong_before, 1);
    }
    uint32_t wa = sp_jobs_worker_id();
    sp_counter_wait(p->go, 0);
    uint64_t b = sp_thread_os_id();
    for (int i = 0; i < SIZES; i++) {
        after[i] = sp_tcache_alloc(sizes[i]);
        if (!after[i] || sp_tcache_owner_thread(after[i]) != b) atomic_fetch_add(&wrong_after, 1);
    }
    uint32_t wb = sp_jobs_worker_id();
    if ((a == b) != (wa == wb)) atomic_fetch_add(&wrong_worker, 1); /* id follows the thread */
    if (a != b) atomic_fetch_add(&migrations, 1);
    atomic_fetch_add(&waits, 1);
    for (int i = 0; i < SIZES; i++) {
        sp_tcache_free(before[i]); /* allocated on the first thread: remote if we moved */
        sp_tcache_free(after[i]);
    }
}

int main(void) {
    plan(6);
    sp_jobs *s = NULL;
    /* A scheduler that cannot be made is the library failing, not a limit of this machine. */
    sp_result r = sp_jobs_create(&s, &(sp_jobs_desc){.workers = 4});
    if (r != SP_OK) {
        ok(0, "sp_jobs_create with 4 workers: %s", sp_result_name(r));
        return done();
    }
    int rounds = ts_migration_rounds(s, waiter_job, MIN_ROUNDS, MAX_ROUNDS, &migrations,
                                     WANT_MIGRATIONS, NULL, NULL);
    bool submitted = rounds >= 0;
    ok(submitted && atomic_load(&waits) == rounds * TS_PAIRS,
       "%d rounds of %d waiting jobs ran (%d)", rounds, TS_PAIRS, atomic_load(&waits));
    ok(atomic_load(&migrations) >= WANT_MIGRATIONS,
       "jobs resumed on another worker after their wait: %d times (at least %d wanted)",
       atomic_load(&migrations), WANT_MIGRATIONS);
    ok(atomic_load(&wrong_before) == 0,
       "before the wait, every block came from the running thread's cache (wrong %d)",
       atomic_load(&wrong_before));
    ok(atomic_load(&wrong_after) == 0,
       "after the wait, every block came from the cache of the thread the job resumed on "
       "(wrong %d)",
       atomic_load(&wrong_after));
    ok(atomic_load(&wrong_worker) == 0,
       "sp_jobs_worker_id changed exactly when the thread did (wrong %d)",
       atomic_load(&wrong_worker));
    sp_jobs_destroy(s); /* the workers exit: their caches detach */
    sp_tcache_thread_detach();
    sp_tcache_trim();
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    ok(st.live_blocks == 0 && st.spans == 0 && st.caches == 0 && st.remote_pending == 0,
       "workers gone, trim: nothing live, no spans, no caches (live %zu, spans %zu, caches %zu, "
       "remote pending %zu)",
       st.live_blocks, st.spans, st.caches, st.remote_pending);
    return done();
}
