/* Jobs that park and resume on another worker see the right worker id. Many jobs each wait,
 * round after round, on children that other workers steal; around every wait a job reads
 * sp_jobs_worker_id() and checks it against the thread it actually runs on: the OS thread id
 * and a thread-local marker (read through a function that is not inlined, as the migration
 * rule in sp_jobs.h requires), both recorded per worker id by the hooks, which run on the
 * thread concerned. Migrations must actually happen (bounded retries). 2, 4 and 8 workers. */
#include <stdlib.h>

#include "jobs_support.h"

enum { MAX_WORKERS = 8, CHILDREN = 2 };

static sp_jobs *S;
static uint32_t NW;

/* Per worker id: the OS thread seen by the hooks (0 = not yet), and conflicts (one id seen on
 * two threads). */
static atomic_ullong tid_of[MAX_WORKERS + 1];
static atomic_int id_conflicts;

static _Thread_local uint32_t tls_marker; /* worker id + 1 on the scheduler's threads */

__attribute__((noinline)) static void marker_set(uint32_t v) {
    __asm__ volatile("" ::: "memory");
    tls_marker = v;
}

__attribute__((noinline)) static uint32_t marker_now(void) {
    __asm__ volatile("" ::: "memory");
    return tls_marker;
}

/* Claim worker id w for the calling thread. */
static void mark(uint32_t w) {
    if (w > MAX_WORKERS) {
        atomic_fetch_add(&id_conflicts, 1);
        return;
    }
    unsigned long long me = sp_thread_os_id(), none = 0;
    if (!atomic_compare_exchange_strong(&tid_of[w], &none, me) && none != me)
        atomic_fetch_add(&id_conflicts, 1);
    marker_set(w + 1);
}

static void on_job(void *u, uint32_t w, const char *name) {
    (void)u, (void)name;
    mark(w);
}
static void on_worker(void *u, uint32_t w) {
    (void)u;
    mark(w);
}

typedef struct mjob {
    atomic_uint waits, migrations, wrong_id, wrong_tls, checks;
} mjob;

static mjob stats;

/* Is the caller really worker `id`? */
static void check(uint32_t id) {
    atomic_fetch_add(&stats.checks, 1);
    if (id > NW) {
        atomic_fetch_add(&stats.wrong_id, 1);
        return;
    }
    if (atomic_load(&tid_of[id]) != sp_thread_os_id()) atomic_fetch_add(&stats.wrong_id, 1);
    if (marker_now() != id + 1) atomic_fetch_add(&stats.wrong_tls, 1);
}

static atomic_ullong sink; /* keeps the children's work alive */

static void child_fn(void *arg) {
    uint64_t x = (uintptr_t)arg;
    for (int i = 0; i < 2000; i++) x = x * 6364136223846793005u + 1442695040888963407u;
    atomic_store_explicit(&sink, x, memory_order_relaxed);
}

typedef struct parent_arg {
    int rounds;
    sp_result rc;
} parent_arg;

static void parent_fn(void *arg) {
    parent_arg *pa = arg;
    sp_counter *c = sp_counter_create(S, "migrate");
    if (!c) {
        pa->rc = SP_ERR_NOMEM;
        return;
    }
    sp_job_desc d[CHILDREN];
    for (int i = 0; i < CHILDREN; i++) d[i] = jt_job(child_fn, (void *)(uintptr_t)i, "child");
    for (int r = 0; r < pa->rounds; r++) {
        uint32_t before = sp_jobs_worker_id();
        check(before);
        sp_result rc = sp_jobs_submit(S, d, CHILDREN, c);
        if (rc == SP_OK) rc = sp_counter_wait(c, 0);
        if (rc != SP_OK) pa->rc = rc;
        uint32_t after = sp_jobs_worker_id();
        check(after);
        atomic_fetch_add(&stats.waits, 1);
        if (after != before) atomic_fetch_add(&stats.migrations, 1);
    }
    sp_counter_destroy(c);
}

static void sweep(uint32_t workers) {
    NW = workers;
    for (uint32_t i = 0; i <= MAX_WORKERS; i++) atomic_store(&tid_of[i], 0);
    atomic_store(&id_conflicts, 0);
    atomic_store(&stats.waits, 0);
    atomic_store(&stats.migrations, 0);
    atomic_store(&stats.wrong_id, 0);
    atomic_store(&stats.wrong_tls, 0);
    atomic_store(&stats.checks, 0);
    sp_jobs_desc desc = {.workers = workers,
                         .hooks = {.job_begin = on_job,
                                   .job_end = on_job,
                                   .job_park = on_job,
                                   .job_resume = on_job,
                                   .worker_sleep = on_worker,
                                   .worker_wake = on_worker,
                                   .fiber_switch = on_worker}};
    mark(0); /* the main thread is worker 0 once the scheduler exists */
    if (sp_jobs_create(&S, &desc) != SP_OK) {
        ok(0, "%u workers: create", workers);
        return;
    }
    const int jobs = SP_TSAN ? 16 : 64, rounds = SP_TSAN ? 10 : 40, max_tries = 50;
    parent_arg *pa = calloc((size_t)jobs, sizeof *pa);
    sp_job_desc *d = calloc((size_t)jobs, sizeof *d);
    sp_counter *all = sp_counter_create(S, "parents");
    bool good = pa && d && all;
    int tries = 0;
    while (good && tries < max_tries && atomic_load(&stats.migrations) == 0) {
        tries++;
        for (int i = 0; i < jobs; i++) {
            pa[i] = (parent_arg){.rounds = rounds, .rc = SP_OK};
            d[i] = jt_job(parent_fn, &pa[i], "parent");
        }
        good &= sp_jobs_submit(S, d, (uint32_t)jobs, all) == SP_OK;
        good &= sp_counter_wait(all, 0) == SP_OK;
        for (int i = 0; i < jobs; i++) good &= pa[i].rc == SP_OK;
    }
    unsigned waits = atomic_load(&stats.waits), migrations = atomic_load(&stats.migrations);
    ok(good && waits == (unsigned)(tries * jobs * rounds),
       "%u workers: %u waits in %d jobs x %d rounds (%d tries) completed", workers, waits, jobs,
       rounds, tries);
    ok(migrations > 0, "%u workers: jobs resumed on another worker (%u of %u waits)", workers,
       migrations, waits);
    ok(atomic_load(&stats.wrong_id) == 0 && atomic_load(&id_conflicts) == 0,
       "%u workers: before and after every wait the worker id named the thread running the job "
       "(%u wrong of %u checks, %d ids on two threads)",
       workers, atomic_load(&stats.wrong_id), atomic_load(&stats.checks),
       atomic_load(&id_conflicts));
    ok(atomic_load(&stats.wrong_tls) == 0,
       "%u workers: a fresh thread-local read after a wait sees the new thread's value (%u "
       "wrong)",
       workers, atomic_load(&stats.wrong_tls));
    bool distinct = true;
    for (uint32_t a = 0; a <= workers; a++)
        for (uint32_t b = 0; b < a; b++)
            distinct &=
                !(atomic_load(&tid_of[a]) && atomic_load(&tid_of[a]) == atomic_load(&tid_of[b]));
    ok(distinct, "%u workers: distinct worker ids are distinct threads", workers);
    sp_jobs_status st;
    bool settled = jt_settle(S, &st);
    ok(settled && st.jobs_run == st.jobs_submitted && sp_counter_value(all) == 0,
       "%u workers: every job ran (%llu), counter at 0", workers, (unsigned long long)st.jobs_run);
    sp_counter_destroy(all);
    ok(sp_jobs_shutdown(S) == SP_OK, "%u workers: shutdown", workers);
    sp_jobs_destroy(S);
    S = NULL;
    free(pa);
    free(d);
}

int main(void) {
    jt_log_capture();
    const uint32_t counts[] = {2, 4, 8};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
        jt_deadline("migration sweep", 60);
        sweep(counts[i]);
    }
    alarm(0);
    ok(jt_log_total() == 0, "nothing was logged (%d records)", jt_log_total());
    if (jt_log_total()) jt_log_diag();
    jt_log_release();
    return done();
}
