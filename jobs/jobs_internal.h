/* Internal to jobs/: the scheduler's data structures and the calls its files share. Never
 * included outside jobs/. How the parts fit together: jobs/README.md and the top of sched.c.
 *
 *   sched.c    workers' loop, queues, idle and wake-up, job records, parking and resuming
 *   counter.c  counters and their wait lists
 *   submit.c   sp_jobs_submit, sp_jobs_submit_after, sp_parallel_for
 *   jobs.c     create, shutdown (drain), destroy, status, the debug watchdog
 */
#ifndef SP_JOBS_INTERNAL_H
#define SP_JOBS_INTERNAL_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <urcu/wfcqueue.h>

#include "deque.h"
#include "fiber.h"
#include "sp_internal.h"
#include "sp_jobs.h"
#include "sp_platform.h"

enum { RANK_HIGH = 0, RANK_NORMAL = 1, RANK_LOW = 2, RANKS = 3 };
enum { MAX_WORKERS = 64 };      /* main thread + 63: the idle set is one 64-bit mask */
enum { RECORD_BATCH = 64 };     /* records moved between a worker cache and the pool, at most */
enum { HIDDEN_PATIENCE = 256 }; /* looks (a few us) for work a running piece will split off */
enum { SPARES_LOCAL = 4 };      /* spare loop fibers a worker keeps for itself */
enum { COUNTER_CHUNK = 64 };    /* counters allocated together (never freed before destroy) */
#define NO_PIN UINT32_MAX

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
    bool hiding;    /* a running piece holding jobs beyond its current step (sp_jobs.hidden) */
    job *host;      /* on_caller: the job the range runs within (NULL: none) */
    bool on_caller; /* JOB_PFOR: the range sp_parallel_for runs on its caller, not a job of
                       its own (no job_begin): its waits are its host's */
    bool stalled;   /* parked on a thread's own stack, and shutdown gave up on its wait: it is
                       resumed, and that wait returns SP_ERR_STALLED (abandon_waiters) */
    waiter defer;   /* first record of a deferred submit: its wait-list node */
};

struct sp_counter {
    alignas(64) _Atomic int64_t value; /* a line of its own: counters are hot and shared */
    _Atomic(waiter *) waiters;         /* lock-free stack (see the top of the file) */
    sp_jobs *s;
    const char *name;
    sp_counter *next_free; /* the scheduler's free list (under s->counter_lock) */
    _Atomic bool live;     /* created and not destroyed: stored under s->counter_lock, loaded
                              without it by the public calls (counter_live) */
    bool kept;             /* the runtime's own: sp_counter_destroy refuses it (under the lock) */
    /* watchdog (its thread only) */
    int64_t wd_value;
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
    bool in_hook;            /* a profiling hook runs on this thread (JOBS_HOOK) */
    job *next_job;           /* resumed by this worker's jobs: runs next (owner only) */
    job *local_head[RANKS];  /* pinned to this worker by itself (owner only, FIFO) */
    job *local_tail[RANKS];
    sp_fiber *spares[SPARES_LOCAL]; /* loop fibers suspended in their loop (owner only);
                                       more go to the scheduler's list (sp_jobs.spares) */
    uint32_t spare_count;
    job *free_jobs; /* record cache (owner only) */
    uint32_t free_count;
    job thread_job; /* this thread's own stack, when parked (see the top of the file) */
    sp_thread thread;
    /* Shared with other threads. */
    alignas(64) mpsc pinned[RANKS];
    alignas(64) _Atomic uint32_t sleep; /* 1: asleep or about to be; stored 0 to wake */
    _Atomic uint32_t busy;              /* 0 while idle; written only where the watchdog runs
                                           (SP_DEBUG >= 1): see jobs_busy_set */
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
    sp_jobs_desc desc;       /* with defaults filled in */
    uint32_t nworkers;       /* background workers; worker 0 is the main thread */
    uint32_t started;        /* of them, threads started (shutdown stops and joins these); workers
                                read nworkers, so it never changes while they run */
    uint32_t workers_pinned; /* of them, pinned at create (pin_workers) */
    worker *workers;         /* [0, nworkers] */
    sp_fiber_pool *pool;
    sp_mutex spare_lock; /* spares, spare_count: loop fibers no worker keeps */
    sp_fiber **spares;
    _Atomic uint32_t spare_count; /* changed under spare_lock; peeked without it */
    uint32_t spare_low;           /* the fewest spares since the last sp_jobs_trim (spare_lock) */
    mpsc inject[RANKS];
    _Atomic uint64_t idle_mask;     /* bit i: worker i is asleep or about to sleep */
    _Atomic uint32_t hidden[RANKS]; /* running pieces that hold more jobs of each rank */
    _Atomic uint32_t spinning;      /* workers spinning for work */
    _Atomic uint32_t closing;       /* shutdown began: outside submits are refused */
    bool kept;                      /* the runtime's (jobs_keep): shutdown and destroy refuse */
    _Atomic uint32_t stopped;       /* shutdown finished */
    _Atomic uint64_t ext_taken, ext_submitted; /* records and jobs of non-worker threads */
    _Atomic int64_t deferred;                  /* records of batches waiting to start */
    _Atomic uint32_t exhaustion_logged;
    _Atomic uint32_t nest_logged;  /* a nested wait stopped starting jobs (stack low): told */
    _Atomic uint32_t stall_logged; /* ... and then nothing finished for a second: told */
    sp_counter *drain;             /* the main thread waits on it during shutdown */
    _Atomic uint32_t drained;
    uint64_t drain_last_done, drain_still_since; /* main thread only */
    /* Shutdown gave up on jobs that could never run (main thread only): parked jobs, and the
     * records they and abandoned deferred batches hold (non-zero: something was abandoned). */
    uint64_t abandoned_jobs, abandoned_records;
    /* Jobs whose wait shutdown gave up on instead of abandoning them (SP_ERR_STALLED from the
     * wait): parked on a thread's own stack, or waiting nested (no fiber). */
    _Atomic uint64_t stalled_waits;
    _Atomic uint32_t nested_waiting; /* jobs (not thread jobs) in wait_nested */
    _Atomic uint32_t give_up_nested; /* shutdown is stuck: nested waits of jobs give up */
    /* job records */
    job *records;
    sp_mutex record_lock;
    job *record_free;
    uint32_t record_free_count;
    uint32_t record_batch;           /* worker caches move records in batches of this */
    _Atomic uint32_t records_wanted; /* takers short of records: workers, flush your caches */
    /* counters */
    sp_mutex counter_lock;
    sp_counter *counter_free, *counter_free_tail; /* FIFO: a destroyed counter is reused last */
    void **counter_chunks;
    size_t counter_chunk_count;
    /* watchdog */
    sp_thread watchdog;
    bool watchdog_started;
    _Atomic uint32_t watchdog_stop;
};

/* ---- shared calls ---------------------------------------------------------------------- */

/* The calling thread's worker, or NULL. Not inlined and not pure: the compiler must call it
 * again after every switch, since a fiber may have moved to another thread (migration rule,
 * sp_jobs.h). */
SP_HIDDEN SP_NOINLINE worker *jobs_current_worker(void);
/* Make w the calling thread's worker (NULL: none). */
SP_HIDDEN void jobs_set_current_worker(worker *w);

static inline void stat_add(_Atomic uint64_t *x, uint64_t n) { /* owner-only statistic */
    atomic_store_explicit(x, atomic_load_explicit(x, memory_order_relaxed) + n,
                          memory_order_release);
}
#define stat_inc(x) stat_add((x), 1)

/* The name of the job that parked job j waits for: a batch piece's is the job it last began
 * (hooks, shutdown's reports). */
static inline const char *job_wait_name(const job *j) {
    return j->kind == JOB_BATCH && j->begin > 0 ? j->batch->jobs[j->begin - 1].name : j->name;
}

/* Whose wait a park of j is, for the hooks and the park counts: j's own, or for a
 * parallel_for range its caller runs (not a job of its own: no job_begin), the job it runs
 * within; NULL for a thread's own stack outside jobs (not a job's wait). */
static inline const job *job_wait_subject(const job *j) {
    while (j && j->on_caller) j = j->host;
    return j && j->kind != JOB_THREAD ? j : NULL;
}

static inline bool deque_nonempty(sp_deque *d) {
    return (ptrdiff_t)(atomic_load(&d->bottom) - atomic_load(&d->top)) > 0;
}

/* The calling thread's worker if it is one of s's, else NULL. */
static inline worker *jobs_worker_of(sp_jobs *s) {
    worker *w = jobs_current_worker();
    return w && w->s == s ? w : NULL;
}

/* Indices a piece runs per step: one job of a batch, `grain` of a parallel_for. */
static inline uint64_t piece_grain(const job *j) {
    return j->kind == JOB_BATCH ? 1 : j->pf->grain;
}

/* sched.c */
SP_HIDDEN void jobs_mpsc_init(mpsc *q);
SP_HIDDEN job *jobs_records_take(sp_jobs *s, worker *w, uint32_t n);
/* The calling thread, a worker of s not running its loop (the main thread waiting for something
 * else): give back the job records it caches if a taker is short of them. */
SP_HIDDEN void jobs_records_give_back(sp_jobs *s);
SP_HIDDEN void jobs_chain_push(sp_jobs *s, worker *w, job *chain);
SP_HIDDEN void jobs_job_ready(sp_jobs *s, worker *w, job *j);
SP_HIDDEN bool jobs_wake_if_idle(sp_jobs *s, uint32_t i);
SP_HIDDEN void jobs_switch_to(worker *w, sp_fiber *to);
SP_HIDDEN void jobs_spare_put(sp_jobs *s, worker *w, sp_fiber *f);
SP_HIDDEN void jobs_loop_main(sp_fiber *self, void *arg);
SP_HIDDEN void jobs_piece_run(sp_jobs *s, job *j);
SP_HIDDEN void jobs_piece_hide(sp_jobs *s, job *j, bool hides);
/* counter.c */
SP_HIDDEN SP_NOINLINE void jobs_counter_wake(sp_counter *c);
/* Call profiling hook `fn` (may be NULL) with the parenthesised `args` on worker w's thread,
 * marked as a hook call: sp_counter_wait and the submits refuse to run inside one (a wait
 * there parked the worker's own thread job under a loop fiber; shutdown later ran that record
 * as a fresh job). */
#define JOBS_HOOK(w, fn, args)                                                                     \
    do {                                                                                           \
        if (fn) {                                                                                  \
            (w)->in_hook = true;                                                                   \
            fn args;                                                                               \
            (w)->in_hook = false;                                                                  \
        }                                                                                          \
    } while (0)

/* Misuse under `call` (w: the calling thread's worker, or NULL) inside a profiling hook. */
SP_HIDDEN SP_COLD sp_result jobs_hook_misuse(worker *w, const char *call);

/* SP_OK if c may be raised by n without passing SP_COUNTER_MAX, else misuse under `call`
 * (reported). A check before a submit takes its records: concurrent raises could pass it
 * together, but only by 2^32 each, against the 2^63 - 2^62 left before the value wraps. */
SP_HIDDEN sp_result jobs_counter_room(sp_counter *c, uint32_t n, const char *call);
/* Report `call` on a destroyed counter c (`what` names the argument) as misuse; returns
 * SP_ERR_INVALID_ARG. */
SP_HIDDEN SP_COLD sp_result jobs_counter_dead(const sp_counter *c, const char *call,
                                              const char *what);
/* Mark a counter the runtime owns (keep true) so that sp_counter_destroy refuses it, or hand
 * it back (false) before the runtime destroys it. Any thread; takes s->counter_lock. */
SP_HIDDEN void jobs_counter_keep(sp_counter *c, bool keep);
/* sp_jobs_shutdown for the scheduler's owner: the same, a kept scheduler (jobs_keep) too. */
SP_HIDDEN sp_result jobs_shutdown(sp_jobs *s);
SP_HIDDEN void jobs_waiter_publish(sp_counter *c, waiter *wt);
SP_HIDDEN void jobs_waiters_push(sp_counter *c, waiter *head, waiter *tail);
/* jobs.c */
/* Job records taken and not yet returned (held by live jobs, pieces and deferred batches);
 * *done gets the returned count. */
SP_HIDDEN uint64_t jobs_records_outstanding(sp_jobs *s, uint64_t *done);
SP_HIDDEN void jobs_drain_check(sp_jobs *s);

/* Whether c is created and not destroyed: the public calls' check, before they touch c (a job
 * lowering its own counter, counter_lower, never checks). Relaxed is enough: a caller that got
 * c from its create, or from a thread that did, sees it set; and a destroy needs value 0 and
 * no waiters, so whoever saw that (and then destroyed) came after every add or sub that made
 * it so, and their loads came before the store. A stale pointer to memory handed out again
 * reads a live counter: the check is best-effort (free counters are reused first-in
 * first-out). */
static inline bool counter_live(const sp_counter *c) {
    return atomic_load_explicit(&c->live, memory_order_relaxed);
}

/* SP_OK when `call` may use c; a NULL or destroyed c is reported as misuse
 * (SP_ERR_INVALID_ARG). The public counter calls' one check. */
static inline sp_result counter_check(const sp_counter *c, const char *call) {
    if (SP_UNLIKELY(!c)) return sp_misuse(SP_ERR_INVALID_ARG, call, NULL, "NULL counter");
    if (SP_UNLIKELY(!counter_live(c))) return jobs_counter_dead(c, call, "counter");
    return SP_OK;
}

static inline bool counter_reached(const sp_counter *c, int64_t target) {
    return atomic_load(&c->value) <= target;
}

/* Counters are never freed before the scheduler (sp_counter_destroy recycles them), so a
 * decrementer that looks at the list after the last waiter has returned and destroyed the
 * counter reads valid memory; at worst it rescans a recycled counter's list for nothing. */
static inline void counter_lower(sp_counter *c, int64_t n) {
    atomic_fetch_sub(&c->value, n);
    if (SP_UNLIKELY(atomic_load(&c->waiters) != NULL)) jobs_counter_wake(c);
}

/* The watchdog's view of w (debug builds only: release builds never read it, and the store
 * would share a line with `sleep`, which waking threads write). */
SP_INLINE void jobs_busy_set(worker *w, uint32_t v) {
    if (SP_DEBUG >= 1) atomic_store_explicit(&w->busy, v, memory_order_relaxed);
}

#endif
