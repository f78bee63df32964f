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
 * suspended, so it keeps the counter's lock over the switch and the fiber that runs next
 * unlocks it (worker.pending_unlock); likewise a loop fiber that gives its worker to a resumed
 * job is put on the spare list by the resumed side (worker.pending_spare). after_switch runs
 * both, first thing after every switch.
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
#if defined(__SANITIZE_THREAD__) || __has_feature(thread_sanitizer)
#include <sanitizer/tsan_interface.h>
/* liburcu 0.13 is not instrumented: tell TSan that an enqueue publishes the job record. */
#define TSAN_RELEASE(p) __tsan_release(p)
#define TSAN_ACQUIRE(p) __tsan_acquire(p)
#else
#define TSAN_RELEASE(p) ((void)(p))
#define TSAN_ACQUIRE(p) ((void)(p))
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
 * BATCH: a deferred batch (the node lives in its first record). FLAG: a thread blocked on a
 * word (on its stack); the firer must read everything it needs before setting the flag. */
enum waiter_kind { WAIT_FIBER, WAIT_BATCH, WAIT_FLAG };
typedef struct waiter {
    struct waiter *next;
    int64_t target;
    uint32_t kind;
    uint32_t count;         /* BATCH: records in the chain */
    job *job;               /* FIBER: the parked job; BATCH: the chain's first record */
    _Atomic uint32_t *flag; /* FLAG: set to 1 when the counter is reached */
    worker *wake;           /* FLAG: worker to wake through its sleep word; NULL: futex on flag */
} waiter;

/* A job record. Owned by the submitter until pushed, by the queue while queued, by the worker
 * running it until it returns; while parked, by the counter's wait list. */
struct job {
    struct cds_wfcq_node qnode; /* injection and pinned queues */
    job *next;                  /* record free lists; a deferred batch's chain */
    sp_job_fn fn;               /* NULL for a parallel_for piece and for thread jobs */
    void *arg;
    const char *name;
    sp_counter *counter; /* lowered by one when the job returns; may be NULL */
    sp_fiber *fiber;     /* parked: the fiber to resume; NULL: not started yet */
    pfor *pf;            /* parallel_for piece: [begin, end) of pf */
    uint64_t begin, end;
    uint32_t resume_pin; /* worker it must run on, or NO_PIN */
    uint8_t rank;
    bool started;
    waiter defer; /* first record of a deferred batch: its wait-list node */
};

struct sp_counter {
    _Atomic int64_t value;
    _Atomic int64_t wake_at; /* largest target in the wait list; INT64_MIN when empty */
    sp_mutex lock;           /* the wait list, and wake_at's changes */
    waiter *waiters;
    sp_jobs *s;
    const char *name;
    sp_counter *next_free; /* the scheduler's free list (under s->counter_lock) */
    bool live;             /* created and not destroyed (under s->counter_lock) */
    /* watchdog (its thread only) */
    int64_t wd_value;
    uint32_t wd_still; /* consecutive ticks without progress while waited on */
    bool wd_reported;
};

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
    sp_mutex *pending_unlock;
    sp_fiber *pending_spare;
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
    /* Statistics: written by the owner only (release stores), read by anyone. */
    _Atomic uint64_t submitted, done, stolen, parks, sleeps, exhaustions;
};

struct pfor {
    sp_jobs *s;
    sp_range_fn fn;
    void *arg;
    uint64_t grain;
    sp_counter *counter;
};

struct sp_jobs {
    sp_jobs_desc desc; /* with defaults filled in */
    uint32_t nworkers; /* background workers; worker 0 is the main thread */
    worker *workers;   /* [0, nworkers] */
    sp_fiber_pool *pool;
    mpsc inject[RANKS];
    _Atomic uint64_t idle_mask;     /* bit i: worker i is asleep or about to sleep */
    _Atomic uint32_t spinning;      /* workers spinning for work */
    _Atomic uint32_t closing;       /* shutdown began: outside submits are refused */
    _Atomic uint32_t stopped;       /* shutdown finished */
    _Atomic uint64_t ext_submitted; /* jobs submitted from outside jobs */
    _Atomic int64_t parked, deferred;
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

static void stat_inc(_Atomic uint64_t *x) { /* owner-only counter */
    atomic_store_explicit(x, atomic_load_explicit(x, memory_order_relaxed) + 1,
                          memory_order_release);
}

/* ---- queues ---------------------------------------------------------------------------- */

static void mpsc_init(mpsc *q) {
    __cds_wfcq_init(&q->head, &q->tail);
}

static void mpsc_push(mpsc *q, job *j) {
    TSAN_RELEASE(j);
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
    TSAN_ACQUIRE(j);
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
    for (int r = 0; r < RANKS; r++) {
        if (atomic_load(&w->pinned[r].size) || deque_nonempty(w->deque[r]) ||
            atomic_load(&s->inject[r].size))
            return true;
        for (uint32_t i = 0; i <= s->nworkers; i++)
            if (i != w->id && deque_nonempty(s->workers[i].deque[r])) return true;
    }
    return false;
}

/* Nothing to run: spin for desc.spin_ns, then sleep on the worker's futex until a push wakes
 * it (or `flag` is set: a nested wait's counter was reached). While shutdown drains, the main
 * thread sleeps at most 1 ms at a time so it can notice that everything finished. */
static void worker_idle(sp_jobs *s, worker *w, _Atomic uint32_t *flag) {
    atomic_store_explicit(&w->busy, 0, memory_order_relaxed);
    atomic_fetch_add(&s->spinning, 1);
    uint64_t t0 = sp_time_ns();
    bool found = false;
    for (uint32_t i = 1;; i++) {
        if (has_work(s, w) || (flag && atomic_load(flag))) {
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
    if (!has_work(s, w) && !(flag && atomic_load(flag))) {
        const sp_jobs_hooks *h = &s->desc.hooks;
        stat_inc(&w->sleeps);
        if (h->worker_sleep) h->worker_sleep(h->user, w->id);
        uint64_t timeout = w->id == 0 && atomic_load(&s->closing) ? 1000000 : 0;
        while (atomic_load(&w->sleep) == 1 && !(flag && atomic_load(flag))) {
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
 * found stay cached). w NULL: a thread that is not a worker takes them from the pool. */
static job *records_take(sp_jobs *s, worker *w, uint32_t n) {
    job *chain = NULL;
    if (w) {
        if (w->free_count < n) records_refill(s, w, n - w->free_count + RECORD_BATCH);
        if (w->free_count < n) return NULL;
        w->free_count -= n;
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

/* Queue j where it can be found: its pinned worker's queue, else the calling worker's deque,
 * else (not a worker, or the deque is full) the injection queue. Does not wake anyone: returns
 * the pinned worker to wake, NO_PIN for "any". */
static uint32_t job_push(sp_jobs *s, worker *w, job *j) {
    if (j->resume_pin != NO_PIN) {
        mpsc_push(&s->workers[j->resume_pin].pinned[j->rank], j);
        return j->resume_pin;
    }
    if (!w || !sp_deque_push_local(w->deque[j->rank], j)) mpsc_push(&s->inject[j->rank], j);
    return NO_PIN;
}

/* Push a chain of n jobs (linked by next) and wake the workers they need. */
static void chain_push(sp_jobs *s, worker *w, job *chain, uint32_t n) {
    uint32_t anyone = 0, pin = NO_PIN;
    bool pins_differ = false;
    for (job *j = chain, *next; j; j = next) {
        next = j->next;
        uint32_t p = job_push(s, w, j);
        if (p == NO_PIN) {
            anyone++;
        } else if (pin == NO_PIN || pin == p) {
            pin = p;
        } else {
            pins_differ = true;
        }
    }
    (void)n;
    if (pin != NO_PIN) {
        atomic_thread_fence(memory_order_seq_cst);
        if (pins_differ) {
            for (uint32_t i = 0; i <= s->nworkers; i++) wake_if_idle(s, i);
        } else {
            wake_if_idle(s, pin);
        }
    }
    if (anyone) wake_idle(s, anyone);
}

/* ---- counters -------------------------------------------------------------------------- */

static bool counter_reached(const sp_counter *c, int64_t target) {
    return atomic_load(&c->value) <= target;
}

/* Under c->lock: add `wt` unless the counter is already at its target. Publishing wake_at and
 * then reading the value again pairs with counter_lower's decrement-then-read (both seq_cst):
 * either the waiter sees the new value or the decrementer sees the waiter. */
static bool waiter_add_locked(sp_counter *c, waiter *wt) {
    if (counter_reached(c, wt->target)) return false;
    wt->next = c->waiters;
    c->waiters = wt;
    if (wt->target > atomic_load_explicit(&c->wake_at, memory_order_relaxed))
        atomic_store(&c->wake_at, wt->target);
    if (counter_reached(c, wt->target)) {
        c->waiters = wt->next; /* wake_at may stay high: the next decrement rescans */
        return false;
    }
    return true;
}

/* Remove wt from c's list if it is still there; false if it was already taken (fired). */
static bool waiter_remove(sp_counter *c, waiter *wt) {
    bool found = false;
    sp_mutex_lock(&c->lock);
    for (waiter **pp = &c->waiters; *pp; pp = &(*pp)->next) {
        if (*pp == wt) {
            *pp = wt->next;
            found = true;
            break;
        }
    }
    sp_mutex_unlock(&c->lock);
    return found;
}

static void waiter_fire(sp_jobs *s, waiter *wt) {
    worker *w = current_worker();
    if (w && w->s != s) w = NULL;
    switch (wt->kind) {
    case WAIT_FIBER: {
        job *j = wt->job; /* wt dies with the parked frame once j runs: read it first */
        chain_push(s, w, (j->next = NULL, j), 1);
        break;
    }
    case WAIT_BATCH: {
        job *first = wt->job;
        uint32_t n = wt->count;
        atomic_fetch_sub(&s->deferred, n);
        chain_push(s, w, first, n);
        break;
    }
    case WAIT_FLAG: {
        worker *wake = wt->wake;
        _Atomic uint32_t *flag = wt->flag;
        atomic_store(flag, 1);
        if (wake) {
            wake_worker(wake);
        } else {
            sp_futex_wake((uint32_t *)flag, 1);
        }
        break;
    }
    }
}

/* The value reached what some waiter wants: fire every satisfied waiter (after unlocking). */
SP_NOINLINE static void counter_wake(sp_counter *c) {
    waiter *ready = NULL;
    sp_mutex_lock(&c->lock);
    int64_t v = atomic_load(&c->value), wake_at = INT64_MIN;
    for (waiter **pp = &c->waiters; *pp;) {
        waiter *wt = *pp;
        if (v <= wt->target) {
            *pp = wt->next;
            wt->next = ready;
            ready = wt;
        } else {
            if (wt->target > wake_at) wake_at = wt->target;
            pp = &wt->next;
        }
    }
    atomic_store(&c->wake_at, wake_at);
    sp_mutex_unlock(&c->lock);
    while (ready) {
        waiter *wt = ready;
        ready = wt->next;
        waiter_fire(c->s, wt);
    }
}

/* Counters are never freed before the scheduler (sp_counter_destroy recycles them), so a
 * decrementer that reads wake_at after the last waiter has returned and destroyed the counter
 * reads valid memory; at worst it rescans a recycled counter's list for nothing. */
static void counter_lower(sp_counter *c, int64_t n) {
    int64_t v = atomic_fetch_sub(&c->value, n) - n;
    if (SP_UNLIKELY(v <= atomic_load(&c->wake_at))) counter_wake(c);
}

/* ---- fibers ---------------------------------------------------------------------------- */

static void loop_main(sp_fiber *self, void *arg);
static void drain_check(sp_jobs *s);

static void after_switch(void) {
    worker *w = current_worker();
    if (w->pending_unlock) {
        sp_mutex *m = w->pending_unlock;
        w->pending_unlock = NULL;
        sp_mutex_unlock(m);
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

/* Resume parked job j on w, from loop fiber `self`, which becomes a spare. */
static void job_resume(worker *w, sp_fiber *self, job *j) {
    sp_fiber *f = j->fiber;
    j->fiber = NULL;
    atomic_fetch_sub(&w->s->parked, 1);
    const sp_jobs_hooks *h = &w->s->desc.hooks;
    if (h->job_resume && j != &w->thread_job) h->job_resume(h->user, w->id, j->name);
    w->current_job = j == &w->thread_job ? NULL : j;
    if (j == &w->thread_job) atomic_store_explicit(&w->busy, 0, memory_order_relaxed);
    w->pending_spare = self;
    switch_to(w, f);
}

/* Park `me`, running on w's current fiber, on c until `target`, and continue on `next` (which
 * runs `next_job` if that is a resumed job, else is a loop fiber). False, with nothing changed,
 * if the counter is already reached. On true, returns once resumed (maybe elsewhere). */
static bool job_park(sp_jobs *s, worker *w, job *me, sp_counter *c, int64_t target, sp_fiber *next,
                     job *next_job) {
    waiter node = {.target = target, .kind = WAIT_FIBER, .job = me};
    sp_mutex_lock(&c->lock);
    if (!waiter_add_locked(c, &node)) {
        sp_mutex_unlock(&c->lock);
        return false;
    }
    me->fiber = w->current_fiber;
    /* A thread's own stack must come back to its own thread. */
    if (w->current_fiber == w->thread_fiber) me->resume_pin = w->id;
    atomic_fetch_add(&s->parked, 1);
    stat_inc(&w->parks);
    const sp_jobs_hooks *h = &s->desc.hooks;
    if (h->job_park && me != &w->thread_job) h->job_park(h->user, w->id, me->name);
    w->pending_unlock = &c->lock; /* unlocked by whoever runs next on this thread */
    if (next_job) {
        sp_fiber *f = next_job->fiber;
        (void)f;
        next_job->fiber = NULL;
        atomic_fetch_sub(&s->parked, 1);
        if (h->job_resume && next_job != &w->thread_job)
            h->job_resume(h->user, w->id, next_job->name);
        w->current_job = next_job == &w->thread_job ? NULL : next_job;
    } else {
        w->current_job = NULL;
    }
    switch_to(w, next);
    return true;
}

/* ---- running jobs ---------------------------------------------------------------------- */

static void pfor_run(pfor *pf, uint64_t begin, uint64_t end);

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

/* Highest rank first; within a rank: pinned, own deque, injection, stolen. */
static job *find_work(sp_jobs *s, worker *w) {
    for (int r = 0; r < RANKS; r++) {
        job *j = mpsc_pop(&w->pinned[r]);
        if (!j) j = sp_deque_pop_local(w->deque[r]);
        if (!j) j = inject_pop(&s->inject[r]);
        if (!j) j = steal(s, w, r);
        if (j) return j;
    }
    return NULL;
}

/* Run a job that has not started, on the calling fiber. Returns on the worker the job ended
 * on (it may have waited and moved). */
static void job_run(sp_jobs *s, worker *w, job *j) {
    const sp_jobs_hooks *h = &s->desc.hooks;
    w->current_job = j;
    atomic_store_explicit(&w->busy, 1, memory_order_relaxed);
    if (h->job_begin) h->job_begin(h->user, w->id, j->name);
    if (j->pf) {
        pfor_run(j->pf, j->begin, j->end);
    } else {
        j->fn(j->arg);
    }
    w = current_worker();
    if (h->job_end) h->job_end(h->user, w->id, j->name);
    w->current_job = NULL;
    sp_counter *c = j->counter;
    record_put(s, w, j);
    stat_inc(&w->done); /* before the counter: a waiter may read the status at once */
    if (c) counter_lower(c, 1);
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
            worker_idle(s, w, NULL);
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
    sp_mutex_lock(&c->lock);
    bool added = waiter_add_locked(c, &node);
    sp_mutex_unlock(&c->lock);
    if (!added) return;
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
            _Atomic uint32_t flag = 0;
            waiter node = {.target = target, .kind = WAIT_FLAG, .flag = &flag, .wake = w};
            sp_mutex_lock(&c->lock);
            bool added = waiter_add_locked(c, &node);
            sp_mutex_unlock(&c->lock);
            if (!added) break;
            worker_idle(s, w, &flag);
            if (!waiter_remove(c, &node))
                while (!atomic_load(&flag)) sp_thread_yield(); /* its firer is finishing */
        }
        w = current_worker();
    }
}

/* Wait on a worker's thread: park the running job (or the thread's own stack) and run the
 * worker's loop on another fiber until the counter is reached. */
static void wait_on_worker(sp_jobs *s, worker *w, sp_counter *c, int64_t target) {
    job *me = w->current_job ? w->current_job : &w->thread_job;
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
            atomic_init(&chunk[i].wake_at, INT64_MIN);
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
    sp_mutex_lock(&c->lock);
    bool waited = c->waiters != NULL;
    sp_mutex_unlock(&c->lock);
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
    for (uint32_t i = 0; i < n; i++) {
        if (SP_UNLIKELY(!d[i].fn || (unsigned)d[i].priority > SP_PRIORITY_LOW ||
                        (d[i].pinned && d[i].worker > s->nworkers)))
            return sp_misuse(SP_ERR_INVALID_ARG, call, &d[i], "job %u ('%s'): %s", i,
                             d[i].name ? d[i].name : "",
                             !d[i].fn ? "NULL fn"
                             : d[i].pinned && d[i].worker > s->nworkers
                                 ? "pinned to a worker that does not exist"
                                 : "bad priority");
    }
    if (n == 0) return SP_OK;
    worker *w = current_worker();
    if (w && w->s != s) w = NULL;
    /* Jobs may submit while shutdown drains (they are pending work); others may not. The
     * count comes first: shutdown sets closing and then reads the counts (seq_cst both). */
    bool outside = !w || !w->current_job;
    if (outside) {
        atomic_fetch_add(&s->ext_submitted, n);
        if (SP_UNLIKELY(atomic_load(&s->closing))) {
            atomic_fetch_sub(&s->ext_submitted, n);
            return SP_ERR_SHUTDOWN;
        }
    }
    job *chain = records_take(s, w, n);
    if (SP_UNLIKELY(!chain)) {
        if (outside) atomic_fetch_sub(&s->ext_submitted, n);
        sp_log(SP_LOG_WARN, SP_ERR_LIMIT, call, s,
               "out of job records (max_jobs %u): %u jobs not submitted", s->desc.max_jobs, n);
        return SP_ERR_LIMIT;
    }
    if (!outside)
        atomic_store_explicit(&w->submitted,
                              atomic_load_explicit(&w->submitted, memory_order_relaxed) + n,
                              memory_order_release);
    uint32_t i = 0;
    for (job *j = chain; j; j = j->next, i++) {
        j->fn = d[i].fn;
        j->arg = d[i].arg;
        j->name = d[i].name;
        j->counter = counter;
        j->fiber = NULL;
        j->pf = NULL;
        j->rank = priority_rank[d[i].priority];
        j->resume_pin = d[i].pinned ? d[i].worker : NO_PIN;
    }
    if (counter) atomic_fetch_add(&counter->value, n);
    if (after) {
        waiter *node = &chain->defer;
        *node = (waiter){.target = after_target, .kind = WAIT_BATCH, .count = n, .job = chain};
        atomic_fetch_add(&s->deferred, n);
        sp_mutex_lock(&after->lock);
        bool added = waiter_add_locked(after, node);
        sp_mutex_unlock(&after->lock);
        if (added) return SP_OK;
        atomic_fetch_sub(&s->deferred, n);
    }
    chain_push(s, w, chain, n);
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

/* Split off [begin, end) as a job of pf. False when out of records. */
static bool pfor_spawn(pfor *pf, worker *w, uint64_t begin, uint64_t end) {
    job *j = records_take(pf->s, w, 1);
    if (!j) return false;
    atomic_store_explicit(&w->submitted,
                          atomic_load_explicit(&w->submitted, memory_order_relaxed) + 1,
                          memory_order_release);
    j->next = NULL;
    j->fn = NULL;
    j->arg = NULL;
    j->name = "sp_parallel_for";
    j->counter = pf->counter;
    j->fiber = NULL;
    j->pf = pf;
    j->begin = begin;
    j->end = end;
    j->rank = RANK_NORMAL;
    j->resume_pin = NO_PIN;
    atomic_fetch_add(&pf->counter->value, 1);
    chain_push(pf->s, w, j, 1);
    return true;
}

/* Lazy binary splitting: before each grain-sized step, if nothing this worker split off is
 * still waiting in its deque (thieves took it, or there was none), split off the upper half. */
static void pfor_run(pfor *pf, uint64_t begin, uint64_t end) {
    while (end - begin > pf->grain) {
        worker *w = current_worker(); /* fn may wait and move us: read it every step */
        if (!deque_nonempty(w->deque[RANK_NORMAL])) {
            uint64_t mid = begin + (end - begin) / 2;
            if (pfor_spawn(pf, w, mid, end)) {
                end = mid;
                continue;
            }
        }
        pf->fn(pf->arg, begin, begin + pf->grain);
        begin += pf->grain;
    }
    if (begin < end) pf->fn(pf->arg, begin, end);
}

sp_result sp_parallel_for(sp_jobs *s, uint64_t begin, uint64_t end, uint64_t grain, sp_range_fn fn,
                          void *arg) {
    if (SP_UNLIKELY(!s || !fn))
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_parallel_for", s, "NULL %s",
                         s ? "fn" : "scheduler");
    if (end <= begin) return SP_OK;
    uint64_t n = end - begin;
    if (grain == 0) grain = n / (64 * (uint64_t)(s->nworkers + 1));
    if (grain == 0) grain = 1;
    sp_counter *c = sp_counter_create(s, "sp_parallel_for");
    if (SP_UNLIKELY(!c)) return atomic_load(&s->stopped) ? SP_ERR_SHUTDOWN : SP_ERR_NOMEM;
    pfor pf = {.s = s, .fn = fn, .arg = arg, .grain = grain, .counter = c};
    worker *w = current_worker();
    sp_result r = SP_OK;
    if (w && w->s == s && !(atomic_load(&s->stopped))) {
        pfor_run(&pf, begin, end);
    } else {
        /* Not one of ours: hand the whole range over as one piece and block. */
        job *j = atomic_load(&s->closing) ? NULL : records_take(s, NULL, 1);
        if (!j) {
            r = atomic_load(&s->closing) ? SP_ERR_SHUTDOWN : SP_ERR_LIMIT;
        } else {
            atomic_fetch_add(&s->ext_submitted, 1);
            *j = (job){.name = "sp_parallel_for",
                       .counter = c,
                       .pf = &pf,
                       .begin = begin,
                       .end = end,
                       .rank = RANK_NORMAL,
                       .resume_pin = NO_PIN};
            atomic_fetch_add(&c->value, 1);
            chain_push(s, NULL, j, 1);
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
    atomic_fetch_add(&w->s->parked, 1);
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

static uint64_t sum_done(sp_jobs *s) {
    uint64_t n = 0;
    for (uint32_t i = 0; i <= s->nworkers; i++) n += atomic_load(&s->workers[i].done);
    return n;
}

static uint64_t sum_submitted(sp_jobs *s) {
    uint64_t n = atomic_load(&s->ext_submitted);
    for (uint32_t i = 0; i <= s->nworkers; i++) n += atomic_load(&s->workers[i].submitted);
    return n;
}

/* Abandon every parked job and deferred batch (they can never run), naming their counters. */
static void abandon_waiters(sp_jobs *s) {
    sp_mutex_lock(&s->counter_lock);
    for (size_t k = 0; k < s->counter_chunk_count; k++) {
        sp_counter *chunk = s->counter_chunks[k];
        for (int i = 0; i < COUNTER_CHUNK; i++) {
            sp_counter *c = &chunk[i];
            sp_mutex_lock(&c->lock);
            waiter *list = NULL, *keep = NULL;
            for (waiter *wt = c->waiters, *next; wt; wt = next) {
                next = wt->next;
                if (wt->kind == WAIT_FLAG) {
                    wt->next = keep;
                    keep = wt;
                } else {
                    wt->next = list;
                    list = wt;
                }
            }
            c->waiters = keep;
            sp_mutex_unlock(&c->lock);
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
                    atomic_fetch_sub(&s->parked, 1);
                } else {
                    atomic_fetch_sub(&s->deferred, wt->count);
                }
            }
        }
    }
    sp_mutex_unlock(&s->counter_lock);
}

/* Main thread's loop, while shutdown drains and nothing is left to run here: finished when
 * every submitted job has returned (done is read before submitted: see sp_jobs_shutdown), or
 * stuck when what is left only waits on counters and nothing ran for a while. */
static void drain_check(sp_jobs *s) {
    if (atomic_load(&s->drained)) return;
    uint64_t done = sum_done(s), submitted = sum_submitted(s);
    uint64_t outstanding = submitted - done;
    bool finished = outstanding == 0;
    /* Parked thread jobs: every background worker's, and the main thread's (it waits here). */
    int64_t parked_jobs = atomic_load(&s->parked) - (int64_t)s->nworkers - 1;
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
        uint64_t done = sum_done(s);
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
                sp_mutex_lock(&c->lock);
                int64_t target = INT64_MIN;
                for (waiter *wt = c->waiters; wt; wt = wt->next)
                    if (wt->target > target) target = wt->target;
                sp_mutex_unlock(&c->lock);
                int64_t v = atomic_load(&c->value);
                if (target == INT64_MIN || busy || v != c->wd_value) {
                    c->wd_value = v;
                    c->wd_still = 0;
                    c->wd_reported = false;
                    continue;
                }
                if (++c->wd_still >= 1 && !c->wd_reported) {
                    c->wd_reported = true;
                    sp_log(SP_LOG_ERROR, SP_ERR_STALLED, "sp_counter_wait", c,
                           "counter '%s' is waited on (value %lld, target %lld) but no job has "
                           "run for %u ms and none is running or runnable: nothing can reach it",
                           c->name ? c->name : "(unnamed)", (long long)v, (long long)target,
                           s->desc.watchdog_ms);
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
    out->jobs_submitted = sum_submitted(s);
    for (uint32_t i = 0; i <= s->nworkers; i++) {
        worker *w = &s->workers[i];
        out->jobs_run += atomic_load(&w->done);
        out->jobs_stolen += atomic_load(&w->stolen);
        out->parks += atomic_load(&w->parks);
        out->sleeps += atomic_load(&w->sleeps);
        out->fiber_exhaustions += (uint32_t)atomic_load(&w->exhaustions);
    }
    out->fibers_in_use = sp_fiber_pool_in_use(s->pool);
    out->fibers_total = s->desc.fibers;
}
