/* The job scheduler (sp_jobs.h): workers running a loop on pooled fibers, per-priority
 * work-stealing deques, wfcqueue injection and pinned queues, counters with wait lists, and
 * lazy-splitting parallel_for.
 *
 * How a worker runs. Every pooled fiber the scheduler uses runs loop_main: find a job, call it,
 * repeat. A job runs on the stack of the loop fiber that picked it. When it waits on a counter
 * that is not reached, its fiber (holding the job's frames) is parked on the counter's wait
 * list and the worker switches to another loop fiber: a spare one (suspended in its loop) or a
 * fresh one from the pool. When the counter is reached the parked job is made ready like a new
 * job; the worker that picks it switches to its fiber and becomes a spare itself. So fibers are
 * never abandoned mid-stack, and a switch costs one sp_fiber_switch.
 *
 * Thread fibers (a worker thread's own stack) take part as "thread jobs": a background worker
 * parks its thread fiber for the scheduler's lifetime and is stopped by making that thread job
 * ready; the main thread parks its thread fiber while it waits outside jobs. A thread fiber
 * always resumes on its own thread (it is pinned to its worker).
 *
 * Handing over across a switch. A fiber that parks must not be resumable before it is
 * suspended, so it does not put itself on the counter's wait list: the fiber that runs next on
 * its thread does (worker.pending_park). Likewise a loop fiber that gives its worker to a
 * resumed job is put on the spare list by the resumed side (worker.pending_spare). after_switch
 * does both, first thing after every switch.
 *
 * Wait lists are lock-free stacks: a waiter pushes itself, then reads the value again; a
 * decrement that finds waiters takes the whole list, fires the ones it satisfies and pushes the
 * rest back (then looks again, for decrements that found the list empty meanwhile). Counters
 * need no lock, and a handoff (a job signals a counter another job waits on, then parks) costs
 * three atomic read-modify-writes: the decrement, taking the list, and the next push.
 *
 * A job resumed by a job running on worker W goes to W's next-job slot (not stealable, no
 * wake-up): W runs it as soon as its current job ends or waits, on a warm cache.
 */
#include "sp_jobs.h"

#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <urcu/wfcqueue.h>

#include "deque.h"
#include "fiber.h"
#include "sp_internal.h"
#include "sp_platform.h"

#ifndef __has_feature
#define __has_feature(x) 0
#endif

enum { RANK_HIGH = 0, RANK_NORMAL = 1, RANK_LOW = 2, RANKS = 3 };
enum { MAX_WORKERS = 64 };   /* main thread + 63: the idle set is one 64-bit mask */
enum { RECORD_BATCH = 64 };  /* job records moved between a worker cache and the pool */
enum { COUNTER_CHUNK = 64 }; /* counters allocated together (never freed before destroy) */
#define NO_PIN UINT32_MAX

/* sp_job_priority -> rank (0 is taken first). */
static const uint8_t priority_rank[3] = {RANK_NORMAL, RANK_HIGH, RANK_LOW};

typedef struct job job;
typedef struct worker worker;
typedef struct pfor pfor;

/* Something waiting on a counter. FIBER: a parked job (the node lives on its fiber's stack).
 * BATCH: a deferred batch (the node lives in its first record). FLAG: a thread that is not a
 * worker, blocked on a word (on its stack). A node is on a wait list until it is fired, and
 * dies as soon as it is: the firer reads what it needs first. */
enum waiter_kind { WAIT_FIBER, WAIT_BATCH, WAIT_FLAG };
typedef struct waiter {
    struct waiter *next;
    int64_t target;
    uint32_t kind;
    uint32_t count;         /* BATCH: records in the chain */
    job *job;               /* FIBER: the parked job; BATCH: the chain's first record */
    _Atomic uint32_t *flag; /* FLAG: set to 1 (and futex-woken) when the counter is reached */
} waiter;

/* What a record runs. A batch of jobs that share a priority and are not pinned is submitted
 * as one piece over a copy of their descs; pieces split lazily as workers go hungry (the same
 * lazy binary splitting as parallel_for), so a batch of N costs a few records and steals, not
 * N. Pinned or mixed-priority batches get a record per job. */
enum job_kind {
    JOB_SINGLE, /* fn(arg) */
    JOB_BATCH,  /* jobs [begin, end) of `batch` */
    JOB_PFOR,   /* pf->fn over [begin, end) */
    JOB_THREAD, /* a worker thread's own stack (worker.thread_job) */
};

typedef struct batch_job {
    sp_job_fn fn;
    void *arg;
    const char *name;
} batch_job;

typedef struct batch {
    _Atomic uint32_t pieces; /* live pieces; the piece that drops it to 0 frees the batch */
    batch_job jobs[];
} batch;

/* A job record. Owned by the submitter until pushed, by the queue while queued, by the worker
 * running it until it returns; while parked, by the counter's wait list. */
struct job {
    struct cds_wfcq_node qnode; /* injection and pinned queues */
    _Atomic uint32_t queued;    /* release-stored before a wfcqueue push, acquire-loaded after
                                   the pop: liburcu 0.13's own ordering is invisible to TSan */
    job *next;                  /* record free lists; a deferred chain of single jobs */
    sp_job_fn fn;               /* JOB_SINGLE */
    void *arg;
    const char *name;
    sp_counter *counter; /* JOB_SINGLE, JOB_BATCH: lowered per job run; JOB_PFOR: per piece */
    sp_fiber *fiber;     /* parked: the fiber to resume; NULL: not started yet */
    batch *batch;        /* JOB_BATCH */
    pfor *pf;            /* JOB_PFOR */
    uint64_t begin, end; /* pieces: what is left to run (begin moves before each step) */
    uint64_t completed;  /* JOB_BATCH: jobs run, not yet taken off the counter */
    uint32_t resume_pin; /* worker it must run on, or NO_PIN */
    uint8_t rank;
    uint8_t kind;
    waiter defer; /* first record of a deferred submit: its wait-list node */
};

struct sp_counter {
    alignas(64) _Atomic int64_t value; /* a line of its own: counters are hot and shared */
    _Atomic(waiter *) waiters;         /* lock-free stack (see the top of the file) */
    sp_jobs *s;
    const char *name;
    sp_counter *next_free; /* the scheduler's free list (under s->counter_lock) */
    bool live;             /* created and not destroyed (under s->counter_lock) */
    /* watchdog (its thread only) */
    int64_t wd_value;
    uint32_t wd_still; /* consecutive ticks without progress while waited on */
    bool wd_reported;
};
_Static_assert(sizeof(sp_counter) == 64, "a counter takes one cache line");

/* A queue that any thread pushes to: wfcqueue plus a size for cheap emptiness checks. */
typedef struct mpsc {
    struct __cds_wfcq_head head;
    struct cds_wfcq_tail tail;
    _Atomic uint32_t size;
    sp_mutex pop_lock; /* taken by consumers of multi-consumer queues (injection) */
} mpsc;

struct worker {
    sp_jobs *s;
    uint32_t id;
    uint64_t rng;
    sp_deque *deque[RANKS];
    sp_fiber *thread_fiber;
    sp_fiber *current_fiber; /* the fiber running on this worker's thread now */
    job *current_job;        /* the job running now, NULL in the loop */
    waiter *pending_park;    /* after_switch: publish on pending_counter's wait list */
    sp_counter *pending_counter;
    sp_fiber *pending_spare; /* after_switch: becomes a spare */
    job *next_job;           /* resumed by this worker's jobs: runs next (owner only) */
    job *local_head[RANKS];  /* pinned to this worker by itself (owner only, FIFO) */
    job *local_tail[RANKS];
    sp_fiber **spares; /* loop fibers suspended in their loop, owned by this worker */
    uint32_t spare_count;
    job *free_jobs; /* record cache (owner only) */
    uint32_t free_count;
    job thread_job; /* this thread's own stack, when parked (see the top of the file) */
    sp_thread thread;
    /* Shared with other threads. */
    alignas(64) mpsc pinned[RANKS];
    alignas(64) _Atomic uint32_t sleep; /* 1: asleep or about to be; stored 0 to wake */
    _Atomic uint32_t busy;              /* 0 while idle (watchdog) */
    /* Statistics: written by the owner only (release stores), read by anyone. `taken` and
     * `returned` count job records (shutdown's drain); `submitted` and `done` count jobs. */
    _Atomic uint64_t taken, returned, submitted, done, stolen, parks, resumes, sleeps, exhaustions;
};

struct pfor {
    sp_range_fn fn;
    void *arg;
    uint64_t grain;
};

struct sp_jobs {
    sp_jobs_desc desc; /* with defaults filled in */
    uint32_t nworkers; /* background workers; worker 0 is the main thread */
    worker *workers;   /* [0, nworkers] */
    sp_fiber_pool *pool;
    mpsc inject[RANKS];
    _Atomic uint64_t idle_mask;                /* bit i: worker i is asleep or about to sleep */
    _Atomic uint32_t spinning;                 /* workers spinning for work */
    _Atomic uint32_t closing;                  /* shutdown began: outside submits are refused */
    _Atomic uint32_t stopped;                  /* shutdown finished */
    _Atomic uint64_t ext_taken, ext_submitted; /* records and jobs of non-worker threads */
    _Atomic int64_t deferred;                  /* records of batches waiting to start */
    _Atomic uint32_t exhaustion_logged;
    sp_counter *drain; /* the main thread waits on it during shutdown */
    _Atomic uint32_t drained;
    uint64_t drain_last_done, drain_still_since; /* main thread only */
    /* job records */
    job *records;
    sp_mutex record_lock;
    job *record_free;
    uint32_t record_free_count;
    /* counters */
    sp_mutex counter_lock;
    sp_counter *counter_free;
    void **counter_chunks;
    size_t counter_chunk_count;
    /* watchdog */
    sp_thread watchdog;
    bool watchdog_started;
    _Atomic uint32_t watchdog_stop;
};

/* ---- the calling thread's worker ------------------------------------------------------- */

static _Thread_local worker *tls_worker;

/* Not inlined and not pure (the empty asm): the compiler must call it again after every
 * switch, since the fiber may have moved to another thread (migration rule, sp_jobs.h). */
SP_NOINLINE static worker *current_worker(void) {
    worker *w = tls_worker;
    __asm__ volatile("" : "+r"(w)::"memory");
    return w;
}

uint32_t sp_jobs_worker_id(void) {
    worker *w = current_worker();
    return w ? w->id : SP_JOBS_NOT_A_WORKER;
}

static void stat_add(_Atomic uint64_t *x, uint64_t n) { /* owner-only counter */
    atomic_store_explicit(x, atomic_load_explicit(x, memory_order_relaxed) + n,
                          memory_order_release);
}
#define stat_inc(x) stat_add((x), 1)

/* ---- queues ---------------------------------------------------------------------------- */

static void mpsc_init(mpsc *q) {
    __cds_wfcq_init(&q->head, &q->tail);
}

static void mpsc_push(mpsc *q, job *j) {
    atomic_store_explicit(&j->queued, 1, memory_order_release);
    cds_wfcq_node_init(&j->qnode);
    cds_wfcq_enqueue(&q->head, &q->tail, &j->qnode);
    atomic_fetch_add(&q->size, 1);
}

/* One consumer at a time (the caller provides exclusion). NULL when empty, or when a push is
 * half done (size then stays non-zero, so callers look again before sleeping). */
static job *mpsc_pop(mpsc *q) {
    if (atomic_load_explicit(&q->size, memory_order_relaxed) == 0) return NULL;
    struct cds_wfcq_node *n = __cds_wfcq_dequeue_nonblocking(&q->head, &q->tail);
    if (!n || n == CDS_WFCQ_WOULDBLOCK) return NULL;
    atomic_fetch_sub(&q->size, 1);
    job *j = (job *)((char *)n - offsetof(job, qnode));
    (void)atomic_load_explicit(&j->queued, memory_order_acquire);
    return j;
}

static job *inject_pop(mpsc *q) {
    if (atomic_load_explicit(&q->size, memory_order_relaxed) == 0) return NULL;
    if (!sp_mutex_trylock(&q->pop_lock)) return NULL; /* another consumer is at it */
    job *j = mpsc_pop(q);
    sp_mutex_unlock(&q->pop_lock);
    return j;
}

static bool deque_nonempty(sp_deque *d) {
    return (ptrdiff_t)(atomic_load(&d->bottom) - atomic_load(&d->top)) > 0;
}

/* ---- sleeping and waking --------------------------------------------------------------- */

static void wake_worker(worker *w) {
    atomic_store(&w->sleep, 0);
    sp_futex_wake((uint32_t *)&w->sleep, 1);
}

/* Take worker i out of the idle set and wake it, if it is in it. */
static bool wake_if_idle(sp_jobs *s, uint32_t i) {
    uint64_t bit = (uint64_t)1 << i;
    if (!(atomic_load(&s->idle_mask) & bit)) return false;
    if (!(atomic_fetch_and(&s->idle_mask, ~bit) & bit)) return false;
    wake_worker(&s->workers[i]);
    return true;
}

SP_NOINLINE static void wake_idle_slow(sp_jobs *s, uint64_t mask, uint32_t n) {
    uint32_t spinning = atomic_load(&s->spinning);
    n = n > spinning ? n - spinning : 0;
    while (n && mask) {
        uint32_t i = (uint32_t)__builtin_ctzll(mask);
        mask &= mask - 1;
        n -= wake_if_idle(s, i);
    }
}

/* After pushing n jobs anyone may run: wake up to n sleeping workers (fewer when some are
 * spinning). The fence orders the pushes before the idle-set load; a worker going to sleep
 * adds itself to the set before its last look at the queues (worker_idle). */
static void wake_idle(sp_jobs *s, uint32_t n) {
    atomic_thread_fence(memory_order_seq_cst);
    uint64_t mask = atomic_load_explicit(&s->idle_mask, memory_order_relaxed);
    if (SP_UNLIKELY(mask != 0)) wake_idle_slow(s, mask, n);
}

/* Whether w could find something to run (or to resume). seq_cst loads: see worker_idle. */
static bool has_work(sp_jobs *s, worker *w) {
    if (w->next_job) return true;
    for (int r = 0; r < RANKS; r++) {
        if (w->local_head[r] || atomic_load(&w->pinned[r].size) || deque_nonempty(w->deque[r]) ||
            atomic_load(&s->inject[r].size))
            return true;
        for (uint32_t i = 0; i <= s->nworkers; i++)
            if (i != w->id && deque_nonempty(s->workers[i].deque[r])) return true;
    }
    return false;
}

/* Nothing to run: spin for desc.spin_ns, then sleep on the worker's futex until a push wakes
 * it. With `c`, also return once c reaches target (a nested wait: it polls every 100 us, as
 * nothing wakes it for the counter). While shutdown drains, the main thread sleeps at most
 * 1 ms at a time so it can notice that everything finished. */
static void worker_idle(sp_jobs *s, worker *w, sp_counter *c, int64_t target) {
    atomic_store_explicit(&w->busy, 0, memory_order_relaxed);
    atomic_fetch_add(&s->spinning, 1);
    uint64_t t0 = sp_time_ns();
    bool found = false;
    for (uint32_t i = 1;; i++) {
        if (has_work(s, w) || (c && atomic_load(&c->value) <= target)) {
            found = true;
            break;
        }
        if ((i & 31) == 0 && sp_time_ns() - t0 >= s->desc.spin_ns) break;
    }
    atomic_fetch_sub(&s->spinning, 1);
    if (found) return;

    uint64_t bit = (uint64_t)1 << w->id;
    atomic_store(&w->sleep, 1);
    atomic_fetch_or(&s->idle_mask, bit);
    if (!has_work(s, w)) {
        const sp_jobs_hooks *h = &s->desc.hooks;
        stat_inc(&w->sleeps);
        if (h->worker_sleep) h->worker_sleep(h->user, w->id);
        uint64_t timeout = c ? 100000 : w->id == 0 && atomic_load(&s->closing) ? 1000000 : 0;
        while (atomic_load(&w->sleep) == 1) {
            sp_futex_wait((uint32_t *)&w->sleep, 1, timeout);
            if (timeout) break;
        }
        if (h->worker_wake) h->worker_wake(h->user, w->id);
    }
    atomic_fetch_and(&s->idle_mask, ~bit);
    atomic_store(&w->sleep, 0);
}

/* ---- job records ----------------------------------------------------------------------- */

/* Move up to n records from the pool to w's cache. */
static void records_refill(sp_jobs *s, worker *w, uint32_t n) {
    sp_mutex_lock(&s->record_lock);
    while (n-- && s->record_free) {
        job *j = s->record_free;
        s->record_free = j->next;
        s->record_free_count--;
        j->next = w->free_jobs;
        w->free_jobs = j;
        w->free_count++;
    }
    sp_mutex_unlock(&s->record_lock);
}

/* A chain of n records linked by next, or NULL when there are not that many free (the ones
 * found stay cached). w NULL: a thread that is not a worker takes them from the pool, and
 * counts them in ext_taken itself (before it looks at `closing`, see submit). */
static job *records_take(sp_jobs *s, worker *w, uint32_t n) {
    job *chain = NULL;
    if (w) {
        if (w->free_count < n) records_refill(s, w, n - w->free_count + RECORD_BATCH);
        if (w->free_count < n) return NULL;
        w->free_count -= n;
        stat_add(&w->taken, n);
        while (n--) {
            job *j = w->free_jobs;
            w->free_jobs = j->next;
            j->next = chain;
            chain = j;
        }
        return chain;
    }
    sp_mutex_lock(&s->record_lock);
    if (s->record_free_count >= n) {
        s->record_free_count -= n;
        while (n--) {
            job *j = s->record_free;
            s->record_free = j->next;
            j->next = chain;
            chain = j;
        }
    }
    sp_mutex_unlock(&s->record_lock);
    return chain;
}

static void record_put(sp_jobs *s, worker *w, job *j) {
    stat_inc(&w->returned);
    j->next = w->free_jobs;
    w->free_jobs = j;
    if (++w->free_count < 2 * RECORD_BATCH) return;
    sp_mutex_lock(&s->record_lock);
    for (int i = 0; i < RECORD_BATCH; i++) {
        job *k = w->free_jobs;
        w->free_jobs = k->next;
        k->next = s->record_free;
        s->record_free = k;
    }
    w->free_count -= RECORD_BATCH;
    s->record_free_count += RECORD_BATCH;
    sp_mutex_unlock(&s->record_lock);
}

/* ---- making jobs ready ------------------------------------------------------------------ */

/* Queue j where it can be found: pinned to the calling worker, its local list; pinned to
 * another, that worker's queue; else the calling worker's deque, or (not a worker, or the
 * deque is full) the injection queue. Does not wake anyone: returns the worker to wake for a
 * job pinned elsewhere, NO_PIN when any worker may run it, and the caller's id for its own. */
static uint32_t job_push(sp_jobs *s, worker *w, job *j) {
    uint32_t pin = j->resume_pin;
    if (pin == NO_PIN) {
        if (!w || !sp_deque_push_local(w->deque[j->rank], j)) mpsc_push(&s->inject[j->rank], j);
    } else if (w && pin == w->id) {
        j->next = NULL;
        if (w->local_head[j->rank]) {
            w->local_tail[j->rank]->next = j;
        } else {
            w->local_head[j->rank] = j;
        }
        w->local_tail[j->rank] = j;
    } else {
        mpsc_push(&s->workers[pin].pinned[j->rank], j);
    }
    return pin;
}

/* Push a chain of n jobs (linked by next) and wake the workers they need. */
static void chain_push(sp_jobs *s, worker *w, job *chain, uint32_t n) {
    uint32_t anyone = 0;
    uint64_t pinned = 0; /* workers other than w with new pinned jobs */
    for (job *j = chain, *next; j; j = next) {
        next = j->next;
        uint32_t pin = job_push(s, w, j);
        if (pin == NO_PIN) {
            anyone++;
        } else if (!w || pin != w->id) {
            pinned |= (uint64_t)1 << pin;
        }
    }
    (void)n;
    if (pinned) {
        atomic_thread_fence(memory_order_seq_cst); /* as in wake_idle */
        for (; pinned; pinned &= pinned - 1) wake_if_idle(s, (uint32_t)__builtin_ctzll(pinned));
    }
    if (anyone) wake_idle(s, anyone);
}

/* A parked job is ready again. Resumed by a job of this scheduler's worker w: it runs next on
 * w (unless w already has one, or it is pinned elsewhere); otherwise it is queued. */
static void job_ready(sp_jobs *s, worker *w, job *j) {
    if (w && !w->next_job && (j->resume_pin == NO_PIN || j->resume_pin == w->id)) {
        w->next_job = j;
        return;
    }
    j->next = NULL;
    chain_push(s, w, j, 1);
}

/* ---- counters -------------------------------------------------------------------------- */

static bool counter_reached(const sp_counter *c, int64_t target) {
    return atomic_load(&c->value) <= target;
}

static void waiter_fire(sp_jobs *s, waiter *wt) {
    worker *w = current_worker();
    if (w && w->s != s) w = NULL;
    switch (wt->kind) {
    case WAIT_FIBER:
        job_ready(s, w, wt->job); /* wt dies with the parked frame once the job runs */
        break;
    case WAIT_BATCH: {
        job *first = wt->job;
        uint32_t n = wt->count;
        atomic_fetch_sub(&s->deferred, n);
        chain_push(s, w, first, n);
        break;
    }
    case WAIT_FLAG: {
        _Atomic uint32_t *flag = wt->flag; /* wt dies once the flag is seen */
        atomic_store(flag, 1);
        sp_futex_wake((uint32_t *)flag, 1);
        break;
    }
    }
}

/* Something may wait for the value c has now: take the whole list, fire the waiters it
 * satisfies, push the others back, and look again if the value moved past one of those
 * meanwhile (a decrement that found the list empty while we held it woke no one). */
SP_NOINLINE static void counter_wake(sp_counter *c) {
    waiter *ready = NULL;
    for (;;) {
        waiter *list = atomic_exchange(&c->waiters, NULL);
        if (!list) break;
        int64_t v = atomic_load(&c->value), keep_max = INT64_MIN;
        waiter *keep = NULL, *keep_tail = NULL;
        for (waiter *wt = list, *next; wt; wt = next) {
            next = wt->next;
            if (v <= wt->target) {
                wt->next = ready;
                ready = wt;
            } else {
                wt->next = keep;
                keep = wt;
                if (!keep_tail) keep_tail = wt;
                if (wt->target > keep_max) keep_max = wt->target;
            }
        }
        if (!keep) break;
        waiter *head = atomic_load_explicit(&c->waiters, memory_order_relaxed);
        do {
            keep_tail->next = head;
        } while (!atomic_compare_exchange_weak(&c->waiters, &head, keep));
        if (atomic_load(&c->value) > keep_max) break;
    }
    while (ready) {
        waiter *wt = ready;
        ready = wt->next;
        waiter_fire(c->s, wt);
    }
}

/* Put wt on c's wait list, then read the value again: a decrement that came in between found
 * no waiter (both sides are seq_cst: one sees the other). */
static void waiter_publish(sp_counter *c, waiter *wt) {
    waiter *head = atomic_load_explicit(&c->waiters, memory_order_relaxed);
    do {
        wt->next = head;
    } while (!atomic_compare_exchange_weak(&c->waiters, &head, wt));
    if (counter_reached(c, wt->target)) counter_wake(c);
}

/* Counters are never freed before the scheduler (sp_counter_destroy recycles them), so a
 * decrementer that looks at the list after the last waiter has returned and destroyed the
 * counter reads valid memory; at worst it rescans a recycled counter's list for nothing. */
static void counter_lower(sp_counter *c, int64_t n) {
    atomic_fetch_sub(&c->value, n);
    if (SP_UNLIKELY(atomic_load(&c->waiters) != NULL)) counter_wake(c);
}

/* ---- fibers ---------------------------------------------------------------------------- */

static void loop_main(sp_fiber *self, void *arg);
static void drain_check(sp_jobs *s);
static bool piece_spawn(sp_jobs *s, worker *w, const job *j, uint64_t begin, uint64_t end);

static void after_switch(void) {
    worker *w = current_worker();
    if (w->pending_park) {
        waiter *wt = w->pending_park;
        w->pending_park = NULL;
        waiter_publish(w->pending_counter, wt);
    }
    if (w->pending_spare) {
        w->spares[w->spare_count++] = w->pending_spare;
        w->pending_spare = NULL;
    }
}

/* Switch this worker's thread to `to`. Returns when something switches back to the calling
 * fiber, possibly on another worker: re-read the worker after it. */
static void switch_to(worker *w, sp_fiber *to) {
    sp_fiber *from = w->current_fiber;
    w->current_fiber = to;
    const sp_jobs_hooks *h = &w->s->desc.hooks;
    if (h->fiber_switch) h->fiber_switch(h->user, w->id);
    sp_fiber_switch(from, to);
    after_switch();
}

/* A loop fiber for w to continue on: a spare, else a fresh one; NULL if the pool is empty. */
static sp_fiber *loop_fiber_get(sp_jobs *s, worker *w) {
    if (w->spare_count) return w->spares[--w->spare_count];
    return sp_fiber_acquire(s->pool, loop_main, NULL);
}

/* Bookkeeping for parked job j about to run again on w; returns its fiber. */
static sp_fiber *job_unpark(worker *w, job *j) {
    sp_fiber *f = j->fiber;
    j->fiber = NULL;
    if (j->kind == JOB_THREAD) {
        w->current_job = NULL;
        atomic_store_explicit(&w->busy, 0, memory_order_relaxed);
    } else {
        w->current_job = j;
        stat_inc(&w->resumes);
        const sp_jobs_hooks *h = &w->s->desc.hooks;
        if (h->job_resume) h->job_resume(h->user, w->id, j->name);
    }
    return f;
}

/* Resume parked job j on w, from loop fiber `self`, which becomes a spare. */
static void job_resume(worker *w, sp_fiber *self, job *j) {
    sp_fiber *f = job_unpark(w, j);
    w->pending_spare = self;
    switch_to(w, f);
}

/* Park `me`, running on w's current fiber, on c until `target`, and continue on `next` (which
 * runs `next_job` if that is a resumed job, else is a loop fiber). False, with nothing changed,
 * if the counter is already reached. On true, returns once resumed (maybe elsewhere). */
static bool job_park(sp_jobs *s, worker *w, job *me, sp_counter *c, int64_t target, sp_fiber *next,
                     job *next_job) {
    if (me->kind == JOB_BATCH || me->kind == JOB_PFOR) {
        /* The rest of a piece must not wait with it: it may be what the wait waits for. */
        if (me->begin < me->end && piece_spawn(s, w, me, me->begin, me->end)) me->end = me->begin;
        if (me->completed) {
            counter_lower(me->counter, (int64_t)me->completed);
            me->completed = 0;
        }
    }
    if (counter_reached(c, target)) return false;
    waiter node = {.target = target, .kind = WAIT_FIBER, .job = me};
    me->fiber = w->current_fiber;
    /* A thread's own stack must come back to its own thread. */
    if (w->current_fiber == w->thread_fiber && me->resume_pin != w->id) me->resume_pin = w->id;
    if (me->kind != JOB_THREAD) {
        stat_inc(&w->parks);
        const sp_jobs_hooks *h = &s->desc.hooks;
        if (h->job_park) h->job_park(h->user, w->id, me->name);
    }
    w->pending_park = &node; /* published by whoever runs next on this thread */
    w->pending_counter = c;
    if (next_job) {
        job_unpark(w, next_job);
    } else {
        w->current_job = NULL;
    }
    switch_to(w, next);
    return true;
}

/* ---- running jobs ---------------------------------------------------------------------- */

/* Steal a job of rank r from another worker, starting at a random one. */
static job *steal(sp_jobs *s, worker *w, int r) {
    uint32_t n = s->nworkers + 1;
    if (n == 1) return NULL;
    w->rng ^= w->rng << 13, w->rng ^= w->rng >> 7, w->rng ^= w->rng << 17;
    uint32_t start = (uint32_t)(w->rng % n);
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = start + k < n ? start + k : start + k - n;
        if (i == w->id) continue;
        sp_deque *d = s->workers[i].deque[r];
        for (int tries = 0; tries < 4 && deque_nonempty(d); tries++) {
            void *item;
            if (sp_deque_steal_remote(d, &item) == SP_STEAL_ITEM) {
                stat_inc(&w->stolen);
                return item;
            }
        }
    }
    return NULL;
}

/* The next-job slot first (a resumed job, on a warm cache); then highest rank first, and
 * within a rank: pinned here by this worker, pinned here by others, own deque, injection,
 * stolen. */
static job *find_work(sp_jobs *s, worker *w) {
    job *j = w->next_job;
    if (j) {
        w->next_job = NULL;
        return j;
    }
    for (int r = 0; r < RANKS; r++) {
        j = w->local_head[r];
        if (j) {
            w->local_head[r] = j->next;
            return j;
        }
        j = mpsc_pop(&w->pinned[r]);
        if (!j) j = sp_deque_pop_local(w->deque[r]);
        if (!j) j = inject_pop(&s->inject[r]);
        if (!j) j = steal(s, w, r);
        if (j) return j;
    }
    return NULL;
}

/* Split [begin, end) off piece j as a new piece and queue it. False when out of records. */
static bool piece_spawn(sp_jobs *s, worker *w, const job *j, uint64_t begin, uint64_t end) {
    job *k = records_take(s, w, 1);
    if (SP_UNLIKELY(!k)) return false;
    *k = (job){.name = j->name,
               .counter = j->counter,
               .batch = j->batch,
               .pf = j->pf,
               .begin = begin,
               .end = end,
               .resume_pin = NO_PIN,
               .rank = j->rank,
               .kind = j->kind};
    if (j->kind == JOB_BATCH) {
        atomic_fetch_add_explicit(&j->batch->pieces, 1, memory_order_relaxed);
    } else {
        atomic_fetch_add(&j->counter->value, 1); /* a parallel_for counts pieces */
    }
    chain_push(s, w, k, 1);
    return true;
}

/* Run what is left of piece j. Lazy binary splitting: before each step, if nothing split off
 * by this worker is still waiting in its deque (thieves took it, or there was none), split off
 * the upper half. A step is one job of a batch, or `grain` indices of a parallel_for. */
static void piece_run(sp_jobs *s, job *j) {
    const sp_jobs_hooks *h = &s->desc.hooks;
    const uint64_t grain = j->kind == JOB_BATCH ? 1 : j->pf->grain;
    while (j->begin < j->end) {
        worker *w = current_worker(); /* a step may wait and move us: read it every time */
        uint64_t b = j->begin, left = j->end - b;
        if (left > grain && !deque_nonempty(w->deque[j->rank]) &&
            piece_spawn(s, w, j, b + left / 2, j->end)) {
            j->end = b + left / 2;
            continue;
        }
        if (j->kind == JOB_BATCH) {
            const batch_job *bj = &j->batch->jobs[b];
            j->begin = b + 1;
            if (h->job_begin) h->job_begin(h->user, w->id, bj->name);
            bj->fn(bj->arg);
            w = current_worker();
            if (h->job_end) h->job_end(h->user, w->id, bj->name);
            j->completed++;
            stat_inc(&w->done);
        } else {
            uint64_t e = left > grain ? b + grain : j->end;
            j->begin = e;
            j->pf->fn(j->pf->arg, b, e);
        }
    }
}

/* Run a job that has not started, on the calling fiber. Returns on the worker the job ended
 * on (it may have waited and moved). The counter is lowered last: a waiter woken by it may
 * read the status at once. */
static void job_run(sp_jobs *s, worker *w, job *j) {
    const sp_jobs_hooks *h = &s->desc.hooks;
    w->current_job = j;
    int64_t n = 1;
    if (j->kind == JOB_SINGLE) {
        if (h->job_begin) h->job_begin(h->user, w->id, j->name);
        j->fn(j->arg);
        w = current_worker();
        if (h->job_end) h->job_end(h->user, w->id, j->name);
        stat_inc(&w->done);
    } else {
        if (j->kind == JOB_PFOR && h->job_begin) h->job_begin(h->user, w->id, j->name);
        piece_run(s, j);
        w = current_worker();
        if (j->kind == JOB_PFOR && h->job_end) h->job_end(h->user, w->id, j->name);
        if (j->kind == JOB_BATCH) {
            n = (int64_t)j->completed;
            if (atomic_fetch_sub_explicit(&j->batch->pieces, 1, memory_order_acq_rel) == 1)
                free(j->batch);
        }
    }
    w->current_job = NULL;
    sp_counter *c = j->counter;
    record_put(s, w, j);
    if (c && n) counter_lower(c, n);
}

/* Every scheduler fiber runs this loop (see the top of the file). */
static void loop_main(sp_fiber *self, void *arg) {
    (void)arg;
    after_switch();
    for (;;) {
        worker *w = current_worker();
        sp_jobs *s = w->s;
        job *j = find_work(s, w);
        if (!j) {
            if (w->id == 0 && atomic_load_explicit(&s->closing, memory_order_relaxed))
                drain_check(s);
            worker_idle(s, w, NULL, 0);
            continue;
        }
        atomic_store_explicit(&w->busy, 1, memory_order_relaxed);
        if (j->fiber) {
            job_resume(w, self, j);
        } else {
            job_run(s, w, j);
        }
    }
}

/* ---- waiting --------------------------------------------------------------------------- */

SP_COLD static void exhaustion_report(sp_jobs *s, worker *w, sp_counter *c) {
    stat_inc(&w->exhaustions);
    if (atomic_exchange(&s->exhaustion_logged, 1)) return;
    sp_log(SP_LOG_WARN, SP_ERR_LIMIT, "sp_counter_wait", c,
           "all %u fibers are in use (parked or running): a wait on counter '%s' runs other "
           "jobs on its own stack until the counter is reached; raise sp_jobs_desc.fibers "
           "(reported once)",
           s->desc.fibers, c->name ? c->name : "(unnamed)");
}

/* Block a thread that is not one of s's workers until c reaches target. */
static void wait_blocking(sp_counter *c, int64_t target) {
    _Atomic uint32_t flag = 0;
    waiter node = {.target = target, .kind = WAIT_FLAG, .flag = &flag};
    waiter_publish(c, &node); /* fired (flag set) once c reaches target, maybe at once */
    while (!atomic_load(&flag)) sp_futex_wait((uint32_t *)&flag, 0, 0);
}

/* No fiber to park on: run other jobs on this stack until c reaches target. */
static void wait_nested(sp_jobs *s, worker *w, job *me, sp_counter *c, int64_t target) {
    exhaustion_report(s, w, c);
    while (!counter_reached(c, target)) {
        job *k = find_work(s, w);
        if (k && k->fiber) {
            /* A parked job is ready: park ourselves and switch straight to it. */
            if (!job_park(s, w, me, c, target, k->fiber, k))
                chain_push(s, w, (k->next = NULL, k), 1);
        } else if (k) {
            job_run(s, w, k);
            w = current_worker();
            w->current_job = me == &w->thread_job ? NULL : me;
        } else {
            worker_idle(s, w, c, target);
        }
        w = current_worker();
    }
}

/* Wait on a worker's thread: park the running job (or the thread's own stack) and run the
 * worker's loop on another fiber until the counter is reached. */
static void wait_on_worker(sp_jobs *s, worker *w, sp_counter *c, int64_t target) {
    job *me = w->current_job ? w->current_job : &w->thread_job;
    job *ready = w->next_job;
    if (ready && ready->fiber) {
        /* A handoff: the job this worker resumed runs next anyway; switch straight to it. */
        w->next_job = NULL;
        if (!job_park(s, w, me, c, target, ready->fiber, ready)) w->next_job = ready;
        return;
    }
    sp_fiber *next = loop_fiber_get(s, w);
    if (SP_UNLIKELY(!next)) {
        wait_nested(s, w, me, c, target);
        return;
    }
    if (!job_park(s, w, me, c, target, next, NULL)) w->spares[w->spare_count++] = next;
}

sp_result sp_counter_wait(sp_counter *c, int64_t target) {
    if (SP_UNLIKELY(!c))
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_counter_wait", NULL, "NULL counter");
    if (counter_reached(c, target)) return SP_OK;
    if (SP_UNLIKELY(atomic_load(&c->s->stopped)))
        return sp_misuse(SP_ERR_SHUTDOWN, "sp_counter_wait", c,
                         "counter '%s' (value %lld) waited on after shutdown: nothing can reach it",
                         c->name ? c->name : "(unnamed)", (long long)atomic_load(&c->value));
    worker *w = current_worker();
    if (w && w->s == c->s) {
        wait_on_worker(c->s, w, c, target);
    } else {
        wait_blocking(c, target);
    }
    return SP_OK;
}

/* ---- counters, public ------------------------------------------------------------------ */

sp_counter *sp_counter_create(sp_jobs *s, const char *name) {
    if (SP_UNLIKELY(!s)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_counter_create", NULL, "NULL scheduler");
        return NULL;
    }
    if (atomic_load(&s->stopped)) return NULL;
    sp_mutex_lock(&s->counter_lock);
    if (!s->counter_free) {
        sp_counter *chunk = aligned_alloc(64, COUNTER_CHUNK * sizeof(sp_counter));
        void **chunks = realloc(s->counter_chunks, (s->counter_chunk_count + 1) * sizeof(void *));
        if (!chunk || !chunks) {
            free(chunk);
            if (chunks) s->counter_chunks = chunks;
            sp_mutex_unlock(&s->counter_lock);
            sp_log(SP_LOG_WARN, SP_ERR_NOMEM, "sp_counter_create", NULL, "no memory for counters");
            return NULL;
        }
        s->counter_chunks = chunks;
        s->counter_chunks[s->counter_chunk_count++] = chunk;
        memset(chunk, 0, COUNTER_CHUNK * sizeof(sp_counter));
        for (int i = COUNTER_CHUNK; i-- > 0;) {
            chunk[i].s = s;
            chunk[i].next_free = s->counter_free;
            s->counter_free = &chunk[i];
        }
    }
    sp_counter *c = s->counter_free;
    s->counter_free = c->next_free;
    c->name = name;
    c->live = true;
    c->wd_still = 0;
    c->wd_reported = false;
    sp_mutex_unlock(&s->counter_lock);
    return c;
}

void sp_counter_destroy(sp_counter *c) {
    if (!c) return;
    sp_jobs *s = c->s;
    bool waited = atomic_load(&c->waiters) != NULL;
    int64_t v = atomic_load(&c->value);
    if (SP_UNLIKELY(waited || v > 0)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_counter_destroy", c,
                  "counter '%s' is still in use (value %lld%s): not destroyed",
                  c->name ? c->name : "(unnamed)", (long long)v, waited ? ", waited on" : "");
        return;
    }
    sp_mutex_lock(&s->counter_lock);
    if (SP_UNLIKELY(!c->live)) {
        sp_mutex_unlock(&s->counter_lock);
        sp_misuse(SP_ERR_DOUBLE_FREE, "sp_counter_destroy", c, "counter already destroyed");
        return;
    }
    c->live = false;
    atomic_store(&c->value, 0);
    c->next_free = s->counter_free;
    s->counter_free = c;
    sp_mutex_unlock(&s->counter_lock);
}

void sp_counter_add(sp_counter *c, int64_t n) {
    if (SP_UNLIKELY(!c)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_counter_add", NULL, "NULL counter");
        return;
    }
    atomic_fetch_add(&c->value, n);
}

void sp_counter_sub(sp_counter *c, int64_t n) {
    if (SP_UNLIKELY(!c)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_counter_sub", NULL, "NULL counter");
        return;
    }
    counter_lower(c, n);
}

int64_t sp_counter_value(const sp_counter *c) {
    return c ? atomic_load(&c->value) : 0;
}

/* ---- submitting ------------------------------------------------------------------------ */

static sp_result submit(sp_jobs *s, sp_counter *after, int64_t after_target, const sp_job_desc *d,
                        uint32_t n, sp_counter *counter, const char *call) {
    if (SP_UNLIKELY(!s || (n && !d)))
        return sp_misuse(SP_ERR_INVALID_ARG, call, s, "NULL %s", s ? "jobs" : "scheduler");
    bool as_batch = n >= 2;
    for (uint32_t i = 0; i < n; i++) {
        if (SP_UNLIKELY(!d[i].fn || (unsigned)d[i].priority > SP_PRIORITY_LOW ||
                        (d[i].pinned && d[i].worker > s->nworkers)))
            return sp_misuse(SP_ERR_INVALID_ARG, call, &d[i], "job %u ('%s'): %s", i,
                             d[i].name ? d[i].name : "",
                             !d[i].fn ? "NULL fn"
                             : d[i].pinned && d[i].worker > s->nworkers
                                 ? "pinned to a worker that does not exist"
                                 : "bad priority");
        if (d[i].pinned || d[i].priority != d[0].priority) as_batch = false;
    }
    if (n == 0) return SP_OK;
    worker *w = current_worker();
    if (w && w->s != s) w = NULL;
    const uint32_t records = as_batch ? 1 : n;
    /* Jobs may submit while shutdown drains (they are pending work); others may not. A thread
     * that is not a worker counts its records before it reads `closing`; shutdown sets
     * `closing` before it reads the counts (seq_cst both): one of them sees the other. */
    if (!w) atomic_fetch_add(&s->ext_taken, records);
    if (SP_UNLIKELY((!w || !w->current_job) && atomic_load(&s->closing))) {
        if (!w) atomic_fetch_sub(&s->ext_taken, records);
        return SP_ERR_SHUTDOWN;
    }
    batch *b = NULL;
    if (as_batch) {
        b = malloc(sizeof(batch) + (size_t)n * sizeof(batch_job));
        if (SP_UNLIKELY(!b)) {
            if (!w) atomic_fetch_sub(&s->ext_taken, records);
            sp_log(SP_LOG_WARN, SP_ERR_NOMEM, call, s, "no memory for a batch of %u jobs", n);
            return SP_ERR_NOMEM;
        }
        atomic_init(&b->pieces, 1);
        for (uint32_t i = 0; i < n; i++) b->jobs[i] = (batch_job){d[i].fn, d[i].arg, d[i].name};
    }
    job *chain = records_take(s, w, records);
    if (SP_UNLIKELY(!chain)) {
        if (!w) atomic_fetch_sub(&s->ext_taken, records);
        free(b);
        sp_log(SP_LOG_WARN, SP_ERR_LIMIT, call, s,
               "out of job records (max_jobs %u): %u jobs not submitted", s->desc.max_jobs, n);
        return SP_ERR_LIMIT;
    }
    if (w) {
        stat_add(&w->submitted, n);
    } else {
        atomic_fetch_add(&s->ext_submitted, n);
    }
    if (as_batch) {
        *chain = (job){.name = d[0].name,
                       .counter = counter,
                       .batch = b,
                       .end = n,
                       .resume_pin = NO_PIN,
                       .rank = priority_rank[d[0].priority],
                       .kind = JOB_BATCH};
    } else {
        uint32_t i = 0;
        for (job *j = chain; j; j = j->next, i++) {
            j->fn = d[i].fn;
            j->arg = d[i].arg;
            j->name = d[i].name;
            j->counter = counter;
            j->fiber = NULL;
            j->rank = priority_rank[d[i].priority];
            j->resume_pin = d[i].pinned ? d[i].worker : NO_PIN;
            j->kind = JOB_SINGLE;
        }
    }
    if (counter) atomic_fetch_add(&counter->value, n);
    if (after) {
        waiter *node = &chain->defer;
        *node =
            (waiter){.target = after_target, .kind = WAIT_BATCH, .count = records, .job = chain};
        if (!counter_reached(after, after_target)) {
            atomic_fetch_add(&s->deferred, records);
            waiter_publish(after, node); /* pushes the batch itself if reached meanwhile */
            return SP_OK;
        }
    }
    chain_push(s, w, chain, records);
    return SP_OK;
}

sp_result sp_jobs_submit(sp_jobs *s, const sp_job_desc *jobs, uint32_t count, sp_counter *counter) {
    return submit(s, NULL, 0, jobs, count, counter, "sp_jobs_submit");
}

sp_result sp_jobs_submit_after(sp_jobs *s, sp_counter *after, int64_t after_target,
                               const sp_job_desc *jobs, uint32_t count, sp_counter *counter) {
    if (SP_UNLIKELY(!after))
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_submit_after", s, "NULL `after` counter");
    return submit(s, after, after_target, jobs, count, counter, "sp_jobs_submit_after");
}

/* ---- parallel_for ---------------------------------------------------------------------- */

sp_result sp_parallel_for(sp_jobs *s, uint64_t begin, uint64_t end, uint64_t grain, sp_range_fn fn,
                          void *arg) {
    if (SP_UNLIKELY(!s || !fn))
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_parallel_for", s, "NULL %s",
                         s ? "fn" : "scheduler");
    if (end <= begin) return SP_OK;
    if (grain == 0) grain = (end - begin) / (64 * (uint64_t)(s->nworkers + 1));
    if (grain == 0) grain = 1;
    worker *w = current_worker();
    if (w && w->s != s) w = NULL;
    if (!w) atomic_fetch_add(&s->ext_taken, 1);
    if (SP_UNLIKELY((!w || !w->current_job) && atomic_load(&s->closing))) {
        if (!w) atomic_fetch_sub(&s->ext_taken, 1);
        return SP_ERR_SHUTDOWN;
    }
    sp_counter *c = sp_counter_create(s, "sp_parallel_for");
    if (SP_UNLIKELY(!c)) {
        if (!w) atomic_fetch_sub(&s->ext_taken, 1);
        return SP_ERR_NOMEM;
    }
    pfor pf = {.fn = fn, .arg = arg, .grain = grain};
    job piece = {.name = "sp_parallel_for",
                 .counter = c,
                 .pf = &pf,
                 .begin = begin,
                 .end = end,
                 .resume_pin = NO_PIN,
                 .rank = RANK_NORMAL,
                 .kind = JOB_PFOR};
    sp_result r = SP_OK;
    if (w) {
        /* One of ours: run the range here, splitting pieces off for the others. */
        piece_run(s, &piece);
    } else {
        /* Hand the whole range over as one piece and block. */
        job *j = records_take(s, NULL, 1);
        if (j) {
            *j = piece;
            atomic_fetch_add(&c->value, 1);
            chain_push(s, NULL, j, 1);
        } else {
            atomic_fetch_sub(&s->ext_taken, 1);
            sp_log(SP_LOG_WARN, SP_ERR_LIMIT, "sp_parallel_for", s,
                   "out of job records (max_jobs %u)", s->desc.max_jobs);
            r = SP_ERR_LIMIT;
        }
    }
    sp_counter_wait(c, 0);
    sp_counter_destroy(c);
    return r;
}

/* ---- workers --------------------------------------------------------------------------- */

static void *worker_thread(void *arg) {
    worker *w = arg;
    tls_worker = w;
    w->thread_fiber = sp_fiber_thread_enter();
    if (!w->thread_fiber) sp_die(SP_ERR_NOMEM, "sp_jobs_create", w, "no memory for a thread fiber");
    w->current_fiber = w->thread_fiber;
    /* Park this stack as the thread job until shutdown makes it ready. */
    w->thread_job.fiber = w->thread_fiber;
    switch_to(w, w->spares[--w->spare_count]);
    /* Shutdown: every loop fiber of this worker is a spare now. */
    w = current_worker();
    while (w->spare_count) sp_fiber_release(w->s->pool, w->spares[--w->spare_count]);
    sp_fiber_thread_leave(w->thread_fiber);
    w->thread_fiber = w->current_fiber = NULL;
    tls_worker = NULL;
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

/* Abandon every parked job and deferred batch (they can never run), naming their counters. */
static void abandon_waiters(sp_jobs *s) {
    sp_mutex_lock(&s->counter_lock);
    for (size_t k = 0; k < s->counter_chunk_count; k++) {
        sp_counter *chunk = s->counter_chunks[k];
        for (int i = 0; i < COUNTER_CHUNK; i++) {
            sp_counter *c = &chunk[i];
            /* Nothing runs any more: the list holds still. Threads blocked in waits stay. */
            waiter *list = NULL, *keep = NULL;
            for (waiter *wt = atomic_exchange(&c->waiters, NULL), *next; wt; wt = next) {
                next = wt->next;
                if (wt->kind == WAIT_FLAG) {
                    wt->next = keep;
                    keep = wt;
                } else {
                    wt->next = list;
                    list = wt;
                }
            }
            atomic_store(&c->waiters, keep);
            for (waiter *wt = list, *next; wt; wt = next) {
                next = wt->next;
                bool fiber = wt->kind == WAIT_FIBER;
                sp_log(SP_LOG_ERROR, SP_ERR_STALLED, "sp_jobs_shutdown", c,
                       "%s '%s' waits on counter '%s' (value %lld, target %lld) that nothing can "
                       "reach: abandoned",
                       fiber ? "job" : "deferred batch starting with job",
                       wt->job->name ? wt->job->name : "(unnamed)", c->name ? c->name : "(unnamed)",
                       (long long)atomic_load(&c->value), (long long)wt->target);
                if (fiber) {
                    sp_fiber_release(s->pool, wt->job->fiber); /* wt lived on that stack */
                } else {
                    atomic_fetch_sub(&s->deferred, wt->count);
                }
            }
        }
    }
    sp_mutex_unlock(&s->counter_lock);
}

/* Main thread's loop, while shutdown drains and nothing is left to run here: finished when
 * every job record is back, or stuck when what is left only waits on counters and nothing ran
 * for a while. Every live job, piece or deferred batch holds a record, and a job takes the
 * records of what it submits before it returns its own; `returned` is read before `taken`, so
 * returned == taken means that at the moment between the two reads nothing was live, and
 * nothing live means nothing can submit again (other threads are refused by `closing`). */
static void drain_check(sp_jobs *s) {
    if (atomic_load(&s->drained)) return;
    uint64_t done = SUM(s, returned);
    uint64_t outstanding = SUM(s, taken) + atomic_load(&s->ext_taken) - done;
    bool finished = outstanding == 0;
    int64_t parked_jobs = (int64_t)(SUM(s, parks) - SUM(s, resumes));
    if (!finished && (int64_t)outstanding == parked_jobs + atomic_load(&s->deferred)) {
        uint64_t now = sp_time_ns();
        if (done != s->drain_last_done || s->drain_still_since == 0) {
            s->drain_last_done = done;
            s->drain_still_since = now;
        } else if (now - s->drain_still_since > 100000000) { /* 100 ms, nothing ran */
            abandon_waiters(s);
            finished = true;
        }
    }
    if (finished && !atomic_exchange(&s->drained, 1)) counter_lower(s->drain, 1);
}

sp_result sp_jobs_shutdown(sp_jobs *s) {
    if (!s) return SP_ERR_INVALID_ARG;
    worker *w = current_worker();
    if (SP_UNLIKELY(!w || w != &s->workers[0] || w->current_job))
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_shutdown", s,
                         "called from a job or from a thread other than the main thread");
    if (atomic_exchange(&s->closing, 1)) return SP_ERR_SHUTDOWN;
    /* Drain: the main thread runs jobs until its loop sees nothing outstanding. */
    atomic_fetch_add(&s->drain->value, 1);
    for (uint32_t i = 0; i <= s->nworkers; i++) wake_if_idle(s, i);
    sp_counter_wait(s->drain, 0);
    /* Stop the workers: make each one's thread job ready; its loop switches back to it. */
    for (uint32_t i = 1; i <= s->nworkers; i++) {
        worker *wk = &s->workers[i];
        wk->thread_job.next = NULL;
        chain_push(s, w, &wk->thread_job, 1);
    }
    for (uint32_t i = 1; i <= s->nworkers; i++) sp_thread_join(s->workers[i].thread);
    if (s->watchdog_started) {
        atomic_store(&s->watchdog_stop, 1);
        sp_futex_wake((uint32_t *)&s->watchdog_stop, 1);
        sp_thread_join(s->watchdog);
        s->watchdog_started = false;
    }
    while (w->spare_count) sp_fiber_release(s->pool, w->spares[--w->spare_count]);
    atomic_store(&s->stopped, 1);
    return SP_OK;
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
                    c->wd_still = 0;
                    c->wd_reported = false;
                    continue;
                }
                if (++c->wd_still >= 1 && !c->wd_reported) {
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

static sp_result desc_resolve(sp_jobs_desc *d) {
    if (d->no_workers) {
        d->workers = 0;
    } else if (d->workers == 0) {
        d->workers = sp_cpu_count();
        if (d->workers > MAX_WORKERS - 1) d->workers = MAX_WORKERS - 1;
    }
    if (d->workers > MAX_WORKERS - 1) return SP_ERR_INVALID_ARG;
    if (d->fibers == 0) d->fibers = 128;
    if (d->fibers < d->workers + 2) return SP_ERR_INVALID_ARG;
    if (d->fiber_stack == 0) d->fiber_stack = 256 * 1024;
    if (d->max_jobs == 0) d->max_jobs = 65536;
    if (d->deque_size == 0) d->deque_size = 4096;
    if (!sp_is_pow2(d->deque_size) || d->deque_size > (1u << 24)) return SP_ERR_INVALID_ARG;
    if (d->spin_ns == 0) d->spin_ns = 50000;
    if (d->watchdog_ms == 0) d->watchdog_ms = 2000;
    return SP_OK;
}

static void jobs_free(sp_jobs *s) {
    if (s->workers) {
        for (uint32_t i = 0; i <= s->nworkers; i++) {
            worker *w = &s->workers[i];
            for (int r = 0; r < RANKS; r++) free(w->deque[r]);
            free(w->spares);
        }
        free(s->workers);
    }
    for (size_t k = 0; k < s->counter_chunk_count; k++) free(s->counter_chunks[k]);
    free(s->counter_chunks);
    free(s->records);
    sp_fiber_pool_destroy(s->pool);
    free(s);
}

sp_result sp_jobs_create(sp_jobs **out, const sp_jobs_desc *desc) {
    if (SP_UNLIKELY(!out)) return sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_create", NULL, "NULL out");
    *out = NULL;
    if (SP_UNLIKELY(current_worker())) {
        sp_log(SP_LOG_WARN, SP_ERR_LIMIT, "sp_jobs_create", NULL,
               "this thread already belongs to a scheduler");
        return SP_ERR_LIMIT;
    }
    sp_jobs_desc d = desc ? *desc : (sp_jobs_desc){0};
    if (SP_UNLIKELY(desc_resolve(&d) != SP_OK))
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_create", desc,
                         "bad desc: workers %u (at most %d), fibers %u (at least workers + 2), "
                         "deque_size %u (a power of two up to 2^24)",
                         d.workers, MAX_WORKERS - 1, d.fibers, d.deque_size);
    sp_jobs *s = aligned_alloc(64, sp_align_up(sizeof *s, 64));
    if (!s) return SP_ERR_NOMEM;
    memset(s, 0, sizeof *s);
    s->desc = d;
    s->nworkers = d.workers;
    sp_result r = SP_ERR_NOMEM;
    size_t wbytes = sp_align_up((s->nworkers + 1) * sizeof(worker), 64);
    s->workers = aligned_alloc(64, wbytes);
    s->records = calloc(d.max_jobs, sizeof(job));
    if (!s->workers || !s->records) goto fail;
    memset(s->workers, 0, wbytes);
    for (uint32_t i = d.max_jobs; i-- > 0;) {
        s->records[i].next = s->record_free;
        s->record_free = &s->records[i];
    }
    s->record_free_count = d.max_jobs;
    for (int rk = 0; rk < RANKS; rk++) mpsc_init(&s->inject[rk]);
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
            mpsc_init(&w->pinned[rk]);
            void *mem = aligned_alloc(SP_DEQUE_LINE, sp_deque_bytes(d.deque_size));
            if (!mem) goto fail;
            w->deque[rk] = sp_deque_init(mem, d.deque_size);
        }
        w->spares = calloc(d.fibers, sizeof(sp_fiber *));
        if (!w->spares) goto fail;
    }
    r = sp_fiber_pool_create(&s->pool, d.fibers, d.fiber_stack);
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
        w->spares[w->spare_count++] = sp_fiber_acquire(s->pool, loop_main, NULL);
    }
    worker *main = &s->workers[0];
    main->thread_fiber = sp_fiber_thread_enter();
    if (!main->thread_fiber) goto fail_fibers;
    main->current_fiber = main->thread_fiber;
    tls_worker = main;
    for (uint32_t i = 1; i <= s->nworkers; i++) {
        char name[16];
        snprintf(name, sizeof name, "spindle-w%u", i);
        r = sp_thread_start(&s->workers[i].thread, worker_thread, &s->workers[i], name);
        if (r != SP_OK) {
            s->nworkers = i - 1; /* shutdown stops the ones that started */
            sp_jobs_shutdown(s);
            sp_fiber_thread_leave(main->thread_fiber);
            tls_worker = NULL;
            for (uint32_t k = i; k <= d.workers; k++) {
                worker *w = &s->workers[k];
                while (w->spare_count) sp_fiber_release(s->pool, w->spares[--w->spare_count]);
            }
            s->nworkers = d.workers;
            jobs_free(s);
            return r;
        }
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
    if (!atomic_load(&s->stopped)) {
        sp_result r = sp_jobs_shutdown(s);
        if (r != SP_OK && r != SP_ERR_SHUTDOWN) return; /* misuse, reported */
    }
    worker *main = &s->workers[0];
    sp_fiber_thread_leave(main->thread_fiber);
    if (tls_worker == main) tls_worker = NULL;
    jobs_free(s);
}

void sp_jobs_status_get(sp_jobs *s, sp_jobs_status *out) {
    if (SP_UNLIKELY(!s || !out)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_jobs_status_get", s, "NULL argument");
        return;
    }
    memset(out, 0, sizeof *out);
    out->workers = s->nworkers;
    out->jobs_submitted = SUM(s, submitted) + atomic_load(&s->ext_submitted);
    out->jobs_run = SUM(s, done);
    out->jobs_stolen = SUM(s, stolen);
    out->parks = SUM(s, parks);
    out->sleeps = SUM(s, sleeps);
    out->fiber_exhaustions = (uint32_t)SUM(s, exhaustions);
    out->fibers_in_use = sp_fiber_pool_in_use(s->pool);
    out->fibers_total = s->desc.fibers;
}
