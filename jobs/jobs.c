/* The scheduler's life: create (workers, fibers, records), shutdown (drain, stop, join),
 * destroy, status, and the debug watchdog. */
#include "jobs_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- workers --------------------------------------------------------------------------- */

static void *worker_thread(void *arg) {
    worker *w = arg;
    const sp_jobs_hooks *h = &w->s->desc.hooks;
    uint32_t id = w->id;
    if (h->thread_start) h->thread_start(h->user, id);
    jobs_set_current_worker(w);
    sp_fiber_thread_bind(w->thread_fiber); /* made by sp_jobs_create: nothing here can fail */
    w->current_fiber = w->thread_fiber;
    /* Park this stack as the thread job until shutdown makes it ready. */
    w->thread_job.fiber = w->thread_fiber;
    jobs_switch_to(w, w->spares[--w->spare_count]);
    /* Shutdown: every loop fiber of this worker is a spare now. */
    w = jobs_current_worker();
    while (w->spare_count) sp_fiber_release(w->s->pool, w->spares[--w->spare_count]);
    sp_fiber_thread_leave(w->thread_fiber);
    w->thread_fiber = w->current_fiber = NULL;
    jobs_set_current_worker(NULL);
    if (h->thread_stop) h->thread_stop(h->user, id);
    return NULL;
}

/* ---- shutdown -------------------------------------------------------------------------- */

/* Sum of one statistic over the workers (each read atomically, the sum is not a snapshot). */
static uint64_t sum_stat(sp_jobs *s, size_t offset) {
    uint64_t n = 0;
    for (uint32_t i = 0; i <= s->nworkers; i++)
        n += atomic_load((_Atomic uint64_t *)((char *)&s->workers[i] + offset));
    return n;
}
#define SUM(s, field) sum_stat((s), offsetof(worker, field))

/* Whether f is the own stack of one of s's threads. */
static bool thread_fiber(sp_jobs *s, const sp_fiber *f) {
    for (uint32_t i = 0; i <= s->nworkers; i++)
        if (s->workers[i].thread_fiber == f) return true;
    return false;
}

/* Abandon every parked job and deferred batch (they can never run), naming their counters.
 * A job parked on a thread's own stack (a wait that found every fiber in use runs jobs there,
 * and one of those waited) cannot be abandoned: below it on that stack lies the thread's own
 * wait (shutdown's, on the main thread). It is resumed instead, its wait returning
 * SP_ERR_STALLED, and runs on. */
static void abandon_waiters(sp_jobs *s) {
    sp_mutex_lock(&s->counter_lock);
    for (size_t k = 0; k < s->counter_chunk_count; k++) {
        sp_counter *chunk = s->counter_chunks[k];
        for (int i = 0; i < COUNTER_CHUNK; i++) {
            sp_counter *c = &chunk[i];
            /* Nothing runs any more: the list holds still. Threads blocked in waits stay, and
             * so does the main thread's own wait (on s->drain, while it shuts down). */
            waiter *list = NULL, *keep = NULL, *keep_tail = NULL;
            for (waiter *wt = atomic_exchange(&c->waiters, NULL), *next; wt; wt = next) {
                next = wt->next;
                if (wt->kind == WAIT_FLAG ||
                    (wt->kind == WAIT_FIBER && wt->job->kind == JOB_THREAD)) {
                    wt->next = keep;
                    keep = wt;
                    if (!keep_tail) keep_tail = wt;
                } else {
                    wt->next = list;
                    list = wt;
                }
            }
            if (keep) jobs_waiters_push(c, keep, keep_tail);
            for (waiter *wt = list, *next; wt; wt = next) {
                next = wt->next;
                bool fiber = wt->kind == WAIT_FIBER;
                job *jb = wt->job;
                const job *subject = fiber ? job_wait_subject(jb) : jb;
                const char *name = job_wait_name(subject ? subject : jb);
                if (fiber && thread_fiber(s, jb->fiber)) {
                    sp_log(SP_LOG_ERROR, SP_ERR_STALLED, "sp_jobs_shutdown", c,
                           "job '%s' waits on counter '%s' (value %lld, target %lld) that nothing "
                           "can reach, on a thread's own stack (every fiber was in use): its "
                           "wait returns SP_ERR_STALLED",
                           name ? name : "(unnamed)", c->name ? c->name : "(unnamed)",
                           (long long)atomic_load(&c->value), (long long)wt->target);
                    atomic_fetch_add(&s->stalled_waits, 1);
                    jb->stalled = true;
                    jobs_job_ready(s, jobs_current_worker(), jb); /* wt dies when it runs */
                    continue;
                }
                s->abandoned_jobs += fiber;
                s->abandoned_records += fiber ? 1 : wt->count;
                sp_log(SP_LOG_ERROR, SP_ERR_STALLED, "sp_jobs_shutdown", c,
                       "%s '%s' waits on counter '%s' (value %lld, target %lld) that nothing can "
                       "reach: abandoned",
                       fiber ? "job" : "deferred batch starting with job",
                       name ? name : "(unnamed)", c->name ? c->name : "(unnamed)",
                       (long long)atomic_load(&c->value), (long long)wt->target);
                if (fiber)
                    sp_fiber_release(s->pool, jb->fiber); /* wt lived on that stack */
                else
                    atomic_fetch_sub(&s->deferred, wt->count);
                /* A batch's piece (parked, or the deferred batch itself) will never run on:
                 * the copy of the descs goes with its last piece. jb is a record, not on the
                 * released stack. */
                if (jb->kind == JOB_BATCH && atomic_fetch_sub(&jb->batch->pieces, 1) == 1)
                    free(jb->batch);
            }
        }
    }
    sp_mutex_unlock(&s->counter_lock);
}

/* Job records taken and not yet returned; *done gets the returned count. Every live job,
 * piece or deferred batch holds a record, and a job takes the records of what it submits
 * before it returns its own; `returned` is read before `taken`, so 0 means that at the moment
 * between the two reads nothing was live. */
uint64_t jobs_records_outstanding(sp_jobs *s, uint64_t *done) {
    *done = SUM(s, returned);
    return SUM(s, taken) + atomic_load(&s->ext_taken) - *done;
}

uint64_t sp_jobs_run_count(sp_jobs *s) {
    if (SP_UNLIKELY(!s)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_run_count", s, "NULL scheduler");
        return 0;
    }
    return SUM(s, done);
}

bool sp_jobs_idle(sp_jobs *s) {
    if (SP_UNLIKELY(!s)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_idle", s, "NULL scheduler");
        return false;
    }
    uint64_t done;
    return jobs_records_outstanding(s, &done) == 0;
}

/* Records of live jobs, pieces and deferred batches, less those shutdown abandoned. */
static uint64_t drain_outstanding(sp_jobs *s, uint64_t *done) {
    return jobs_records_outstanding(s, done) - s->abandoned_records;
}

/* Main thread's loop, while shutdown drains and nothing is left to run here: finished when
 * every job record is back, or abandoned (nothing live means nothing can submit again: other
 * threads are refused by `closing`), or stuck when what is left only waits on counters and
 * nothing ran for a while. A job that another thread readied while the waiters were being
 * abandoned is queued, not abandoned: the drain goes on until it ran. */
void jobs_drain_check(sp_jobs *s) {
    if (atomic_load(&s->drained)) return;
    uint64_t done, outstanding = drain_outstanding(s, &done);
    bool finished = outstanding == 0;
    uint64_t parks = SUM(s, parks), resumes = SUM(s, resumes);
    int64_t parked_jobs = (int64_t)(parks - resumes - s->abandoned_jobs);
    uint64_t progress = done + parks + resumes;
    /* Stuck: every record left is a parked job, a deferred batch or a job waiting nested (no
     * fiber), and nothing moved for 100 ms. */
    uint32_t nested = atomic_load(&s->nested_waiting);
    if (!finished &&
        (int64_t)outstanding == parked_jobs + atomic_load(&s->deferred) + (int64_t)nested) {
        uint64_t now = sp_time_ns();
        if (progress != s->drain_last_done || s->drain_still_since == 0) {
            s->drain_last_done = progress;
            s->drain_still_since = now;
        } else if (now - s->drain_still_since > 100000000) { /* 100 ms, nothing ran */
            abandon_waiters(s);
            if (nested) atomic_store(&s->give_up_nested, 1); /* they cannot be abandoned */
            finished = drain_outstanding(s, &done) == 0;
            s->drain_still_since = 0;
        }
    } else {
        s->drain_still_since = 0; /* something can still run: the 100 ms start again */
    }
    if (finished && !atomic_exchange(&s->drained, 1)) counter_lower(s->drain, 1);
}

sp_result jobs_hook_misuse(worker *w, const char *call) {
    return sp_misuse(SP_ERR_INVALID_ARG, call, w->s,
                     "called from a profiling hook on worker %u: hooks must not submit or wait",
                     w->id);
}

/* The calls of the main thread outside jobs: SP_OK there, else misuse under `call`. */
static sp_result main_thread_only(sp_jobs *s, const char *call) {
    worker *w = jobs_current_worker();
    if (SP_UNLIKELY(!w || w != &s->workers[0] || w->current_job))
        return sp_misuse(SP_ERR_INVALID_ARG, call, s,
                         "called from a job or from a thread other than the main thread");
    /* A hook of the main thread's own wait (worker_sleep, fiber_switch...) runs outside any
     * job: a shutdown or destroy from there would pull the scheduler from under that wait. */
    if (SP_UNLIKELY(w->in_hook)) return jobs_hook_misuse(w, call);
    return SP_OK;
}

void jobs_keep(sp_jobs *s, bool keep) {
    s->kept = keep;
}

/* The shutdown itself, its caller's checks done (main thread, outside jobs and hooks). */
static sp_result shutdown_run(sp_jobs *s) {
    worker *w = &s->workers[0];
    if (atomic_exchange(&s->closing, 1)) return SP_ERR_SHUTDOWN;
    /* Drain: the main thread runs jobs until its loop sees nothing outstanding. */
    atomic_fetch_add(&s->drain->value, 1);
    for (uint32_t i = 0; i <= s->nworkers; i++) jobs_wake_if_idle(s, i);
    sp_counter_wait(s->drain, 0);
    /* Stop the workers: make each one's thread job ready; its loop switches back to it. */
    for (uint32_t i = 1; i <= s->started; i++) {
        worker *wk = &s->workers[i];
        wk->thread_job.next = NULL;
        jobs_chain_push(s, w, &wk->thread_job);
    }
    for (uint32_t i = 1; i <= s->started; i++) sp_thread_join(s->workers[i].thread);
    if (s->watchdog_started) {
        atomic_store(&s->watchdog_stop, 1);
        sp_futex_wake((uint32_t *)&s->watchdog_stop, 1);
        sp_thread_join(s->watchdog);
        s->watchdog_started = false;
    }
    while (w->spare_count) sp_fiber_release(s->pool, w->spares[--w->spare_count]);
    sp_mutex_lock(&s->spare_lock); /* a trim from another thread may still be in there */
    for (uint32_t i = atomic_load(&s->spare_count); i-- > 0;)
        sp_fiber_release(s->pool, s->spares[i]);
    atomic_store(&s->spare_count, 0);
    sp_mutex_unlock(&s->spare_lock);
    atomic_store(&s->stopped, 1);
    return s->abandoned_records || atomic_load(&s->stalled_waits) ? SP_ERR_STALLED : SP_OK;
}

sp_result sp_jobs_shutdown(sp_jobs *s) {
    if (SP_UNLIKELY(!s))
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_shutdown", s, "NULL scheduler");
    if (main_thread_only(s, "sp_jobs_shutdown") != SP_OK) return SP_ERR_INVALID_ARG;
    if (SP_UNLIKELY(s->kept)) /* read on the main thread, which alone writes it */
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_shutdown", s,
                         "the runtime's scheduler (sp_scheduler): sp_shutdown stops it");
    return shutdown_run(s);
}

sp_result jobs_shutdown(sp_jobs *s) {
    if (main_thread_only(s, "sp_jobs_shutdown") != SP_OK) return SP_ERR_INVALID_ARG;
    return shutdown_run(s);
}

/* ---- watchdog (debug builds) ----------------------------------------------------------- */

/* Every watchdog_ms: a counter that is waited on, whose value did not move, while no job ran
 * or runs anywhere, for two ticks in a row, is reported once (until it moves). */
static void *watchdog_thread(void *arg) {
    sp_jobs *s = arg;
    uint64_t last_done = UINT64_MAX;
    while (!atomic_load(&s->watchdog_stop)) {
        sp_futex_wait((uint32_t *)&s->watchdog_stop, 0, (uint64_t)s->desc.watchdog_ms * 1000000);
        if (atomic_load(&s->watchdog_stop)) break;
        uint64_t done = SUM(s, done);
        bool busy = done != last_done;
        last_done = done;
        for (uint32_t i = 0; i <= s->nworkers && !busy; i++)
            busy = atomic_load_explicit(&s->workers[i].busy, memory_order_relaxed) != 0;
        sp_mutex_lock(&s->counter_lock);
        for (size_t k = 0; k < s->counter_chunk_count; k++) {
            sp_counter *chunk = s->counter_chunks[k];
            for (int i = 0; i < COUNTER_CHUNK; i++) {
                sp_counter *c = &chunk[i];
                if (!c->live) continue;
                /* Only whether someone waits: the nodes belong to their waiters. */
                bool waited = atomic_load(&c->waiters) != NULL;
                int64_t v = atomic_load(&c->value);
                if (!waited || busy || v != c->wd_value) {
                    c->wd_value = v;
                    c->wd_reported = false;
                    continue;
                }
                if (!c->wd_reported) {
                    c->wd_reported = true;
                    sp_log(SP_LOG_ERROR, SP_ERR_STALLED, "sp_counter_wait", c,
                           "counter '%s' is waited on (value %lld, above the target) but no job "
                           "has run for %u ms and none is running: nothing can reach it",
                           c->name ? c->name : "(unnamed)", (long long)v, s->desc.watchdog_ms);
                }
            }
        }
        sp_mutex_unlock(&s->counter_lock);
    }
    return NULL;
}

/* ---- create and destroy ---------------------------------------------------------------- */

/* A fiber stack holds the job and whatever the library runs on it: a misuse report from a job
 * (formatting, the logger) needs about 5 KiB of it in a release build, more under ASan. */
enum { MIN_FIBER_STACK = 16 << 10, MAX_FIBER_STACK = 1 << 30 };

static sp_result desc_resolve(sp_jobs_desc *d) {
    if (d->no_workers) {
        d->workers = 0;
    } else if (d->workers == 0) {
        d->workers = sp_cpu_count();
        if (d->workers > MAX_WORKERS - 1) d->workers = MAX_WORKERS - 1;
    }
    /* Every default first, so that a refusal's message shows the values that were checked. */
    if (d->fibers == 0) d->fibers = 128;
    if (d->fibers_max == 0)
        d->fibers_max = d->fibers <= UINT32_MAX / 32 ? 32 * d->fibers : UINT32_MAX;
    if (d->fiber_stack == 0) d->fiber_stack = 256 * 1024;
    if (d->max_jobs == 0) d->max_jobs = 65536;
    if (d->deque_size == 0) d->deque_size = 4096;
    if (d->spin_ns == 0) d->spin_ns = 50000;
    if (d->watchdog_ms == 0) d->watchdog_ms = 2000;
    if (d->workers > MAX_WORKERS - 1 || d->fibers < d->workers + 2 || d->fibers_max < d->fibers ||
        d->fiber_stack < MIN_FIBER_STACK || d->fiber_stack > MAX_FIBER_STACK ||
        !sp_is_pow2(d->deque_size) || d->deque_size > (1u << 24))
        return SP_ERR_INVALID_ARG;
    return SP_OK;
}

/* Half of fibers_max `max`, not below `fibers`. */
static uint32_t max_halved(uint32_t max, uint32_t fibers) {
    return max / 2 > fibers ? max / 2 : fibers;
}

static void jobs_free(sp_jobs *s) {
    if (s->workers) {
        for (uint32_t i = 0; i <= s->nworkers; i++) {
            worker *w = &s->workers[i];
            for (int r = 0; r < RANKS; r++) free(w->deque[r]);
            /* A background worker's thread fiber, if its thread never ran (one that ran freed
             * its own); the main thread's is left by its caller. */
            if (i > 0) sp_fiber_thread_leave(w->thread_fiber);
        }
        free(s->workers);
    }
    for (size_t k = 0; k < s->counter_chunk_count; k++) free(s->counter_chunks[k]);
    free(s->counter_chunks);
    free(s->records);
    free(s->spares);
    sp_fiber_pool_destroy(s->pool);
    free(s);
}

sp_result sp_jobs_create(sp_jobs **out, const sp_jobs_desc *desc) {
    if (SP_UNLIKELY(!out)) return sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_create", NULL, "NULL out");
    *out = NULL;
    if (SP_UNLIKELY(jobs_current_worker())) {
        sp_log(SP_LOG_WARN, SP_ERR_LIMIT, "sp_jobs_create", NULL,
               "this thread already belongs to a scheduler");
        return SP_ERR_LIMIT;
    }
    sp_jobs_desc d = desc ? *desc : (sp_jobs_desc){0};
    if (SP_UNLIKELY(desc_resolve(&d) != SP_OK))
        return sp_misuse(
            SP_ERR_INVALID_ARG, "sp_jobs_create", desc,
            "bad desc: workers %u (at most %d), fibers %u (at least workers + 2), "
            "fibers_max %u (0, or at least fibers), fiber_stack %zu (16 KiB to 1 GiB), "
            "deque_size %u (a power of two up to 2^24)",
            d.workers, MAX_WORKERS - 1, d.fibers, d.fibers_max, d.fiber_stack, d.deque_size);
    sp_jobs *s = aligned_alloc(64, sp_align_up(sizeof *s, 64));
    if (!s) return SP_ERR_NOMEM;
    memset(s, 0, sizeof *s);
    s->desc = d;
    s->nworkers = d.workers;
    sp_result r = SP_ERR_NOMEM;
    size_t wbytes = sp_align_up((s->nworkers + 1) * sizeof(worker), 64);
    s->workers = aligned_alloc(64, wbytes);
    if (s->workers) memset(s->workers, 0, wbytes); /* before any goto fail: jobs_free reads it */
    s->records = calloc(d.max_jobs, sizeof(job));
    s->spares = calloc(d.fibers_max, sizeof(sp_fiber *));
    if (!s->workers || !s->records || !s->spares) goto fail;
    for (uint32_t i = d.max_jobs; i-- > 0;) {
        s->records[i].next = s->record_free;
        s->record_free = &s->records[i];
    }
    s->record_free_count = d.max_jobs;
    /* Worker caches hold at most a quarter of the records between them. */
    s->record_batch = d.max_jobs / (8 * (d.workers + 1));
    if (s->record_batch > RECORD_BATCH) s->record_batch = RECORD_BATCH;
    if (s->record_batch == 0) s->record_batch = 1;
    for (int rk = 0; rk < RANKS; rk++) jobs_mpsc_init(&s->inject[rk]);
    for (uint32_t i = 0; i <= s->nworkers; i++) {
        worker *w = &s->workers[i];
        w->s = s;
        w->id = i;
        w->rng = 0x9e3779b97f4a7c15ull * (i + 1);
        w->thread_job.resume_pin = i;
        w->thread_job.rank = RANK_HIGH;
        w->thread_job.kind = JOB_THREAD;
        w->thread_job.name = "thread";
        for (int rk = 0; rk < RANKS; rk++) {
            jobs_mpsc_init(&w->pinned[rk]);
            void *mem = aligned_alloc(SP_DEQUE_LINE, sp_deque_bytes(d.deque_size));
            if (!mem) goto fail;
            w->deque[rk] = sp_deque_init(mem, d.deque_size);
        }
    }
    /* The default fibers_max reserves 32 x the stacks' address space: under an address-space
     * limit, take at most half of what it leaves (the threads, the caller and the pool's own
     * growth need the rest), and settle for less where the OS still refuses, down to a fixed
     * pool (each refusal logged). */
    bool max_default = !desc || desc->fibers_max == 0;
    uint32_t *max = &s->desc.fibers_max;
    if (max_default) {
        size_t budget = sp_address_budget(), slot = d.fiber_stack + sp_page_size();
        while (*max > d.fibers && (size_t)*max * slot > budget) *max = max_halved(*max, d.fibers);
    }
    r = sp_fiber_pool_create_growing(&s->pool, d.fibers, *max, d.fiber_stack);
    while (r == SP_ERR_OS && max_default && *max > d.fibers) {
        *max = max_halved(*max, d.fibers);
        r = sp_fiber_pool_create_growing(&s->pool, d.fibers, *max, d.fiber_stack);
    }
    if (r != SP_OK) goto fail;
    s->drain = sp_counter_create(s, "sp_jobs_shutdown");
    if (!s->drain) {
        r = SP_ERR_NOMEM;
        goto fail;
    }
    /* Each background worker gets its first loop fiber now, so a burst of parked jobs before
     * it starts cannot leave it without one. */
    for (uint32_t i = 1; i <= s->nworkers; i++) {
        worker *w = &s->workers[i];
        w->spares[w->spare_count++] = sp_fiber_acquire(s->pool, jobs_loop_main, NULL);
    }
    /* The background workers' thread fibers too, here, where a failure unwinds (in the new
     * thread it could not). */
    for (uint32_t i = 1; i <= s->nworkers; i++)
        if (!(s->workers[i].thread_fiber = sp_fiber_thread_record())) goto fail_fibers;
    worker *main = &s->workers[0];
    main->thread_fiber = sp_fiber_thread_enter();
    if (!main->thread_fiber) goto fail_fibers;
    main->current_fiber = main->thread_fiber;
    jobs_set_current_worker(main);
    if (d.pin_workers && sp_cpu_nth(0) == SP_CPU_ANY) { /* asked once, not once per worker */
        sp_log(SP_LOG_WARN, SP_ERR_OS, "sp_jobs_create", s,
               "the CPU mask cannot be read: the workers start unpinned");
        d.pin_workers = false;
    }
    for (uint32_t i = 1; i <= s->nworkers; i++) {
        char name[16];
        snprintf(name, sizeof name, "spindle-w%u", i);
        /* pin_workers: the CPU is set when the thread is made, so the worker, its thread_start
         * hook and what they touch first are on it from the start. A pinned start that fails
         * (logged by sp_thread_start_on: a CPU the OS refuses now, the mask having changed
         * since sp_cpu_nth read it, or any other reason) is tried again unpinned: a worker on
         * any CPU rather than a failed create. */
        int cpu = d.pin_workers ? sp_cpu_nth(i) : SP_CPU_ANY;
        worker *wi = &s->workers[i];
        r = sp_thread_start_on(&wi->thread, worker_thread, wi, name, cpu);
        if (r != SP_OK && cpu != SP_CPU_ANY) {
            cpu = SP_CPU_ANY;
            r = sp_thread_start(&wi->thread, worker_thread, wi, name);
        }
        s->workers_pinned += r == SP_OK && cpu != SP_CPU_ANY;
        if (r != SP_OK) { /* shutdown stops the ones that started */
            shutdown_run(s);
            sp_fiber_thread_leave(main->thread_fiber);
            jobs_set_current_worker(NULL);
            for (uint32_t k = i; k <= d.workers; k++) {
                worker *w = &s->workers[k];
                while (w->spare_count) sp_fiber_release(s->pool, w->spares[--w->spare_count]);
            }
            jobs_free(s);
            return r;
        }
        s->started = i;
    }
    if (SP_DEBUG >= 1 && d.watchdog_ms != UINT32_MAX) {
        if (sp_thread_start(&s->watchdog, watchdog_thread, s, "spindle-watch") == SP_OK)
            s->watchdog_started = true;
    }
    *out = s;
    return SP_OK;
fail_fibers:
    for (uint32_t i = 1; i <= s->nworkers; i++) {
        worker *w = &s->workers[i];
        while (w->spare_count) sp_fiber_release(s->pool, w->spares[--w->spare_count]);
    }
    r = SP_ERR_NOMEM;
fail:
    jobs_free(s);
    return r;
}

void sp_jobs_destroy(sp_jobs *s) {
    if (!s) return;
    if (main_thread_only(s, "sp_jobs_destroy") != SP_OK) return; /* nothing freed */
    if (SP_UNLIKELY(s->kept)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_destroy", s,
                  "the runtime's scheduler (sp_scheduler): sp_shutdown destroys it");
        return;
    }
    if (!atomic_load(&s->stopped)) shutdown_run(s); /* stalled jobs: reported, abandoned */
    sp_fiber_thread_leave(s->workers[0].thread_fiber);
    jobs_set_current_worker(NULL);
    jobs_free(s);
}

void sp_jobs_status_get(sp_jobs *s, sp_jobs_status *out) {
    if (SP_UNLIKELY(!s || !out)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_status_get", s, "NULL argument");
        return;
    }
    memset(out, 0, sizeof *out);
    out->workers = s->nworkers;
    out->workers_pinned = s->workers_pinned;
    out->jobs_submitted = SUM(s, submitted) + atomic_load(&s->ext_submitted);
    out->jobs_run = sp_jobs_run_count(s);
    out->jobs_stolen = SUM(s, stolen);
    out->parks = SUM(s, parks);
    out->sleeps = SUM(s, sleeps);
    out->fiber_exhaustions = (uint32_t)SUM(s, exhaustions);
    out->fibers_in_use = sp_fiber_pool_in_use(s->pool);
    out->fibers_total = sp_fiber_pool_count(s->pool);
    out->fibers_spare = atomic_load(&s->spare_count);
    out->fiber_stacks_used = sp_fiber_pool_stacks_used(s->pool);
}

uint32_t sp_jobs_trim(sp_jobs *s, uint32_t max) {
    if (SP_UNLIKELY(!s)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_trim", s, "NULL scheduler");
        return 0;
    }
    sp_mutex_lock(&s->spare_lock);
    if (atomic_load(&s->closing)) { /* shutdown releases the spares itself, without the lock */
        sp_mutex_unlock(&s->spare_lock);
        return 0;
    }
    uint32_t n = atomic_load_explicit(&s->spare_count, memory_order_relaxed);
    uint32_t give = s->spare_low < n ? s->spare_low : n; /* spare_low <= n: defensive */
    for (uint32_t i = 0; i < give; i++) sp_fiber_release(s->pool, s->spares[--n]);
    atomic_store_explicit(&s->spare_count, n, memory_order_relaxed);
    s->spare_low = n;
    sp_mutex_unlock(&s->spare_lock);
    return sp_fiber_pool_trim(s->pool, max);
}
