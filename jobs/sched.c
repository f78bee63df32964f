/* The scheduler's core (sp_jobs.h; the files are listed in jobs_internal.h): workers running a loop
 * on pooled fibers, per-priority work-stealing deques, wfcqueue injection and pinned queues, job
 * records, parking and resuming, lazily split pieces.
 *
 * How a worker runs. Every pooled fiber the scheduler uses runs jobs_loop_main: find a job, call
 * it, repeat. A job runs on the stack of the loop fiber that picked it. When it waits on a counter
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
#include "jobs_internal.h"

#include <stdlib.h>

/* ---- the calling thread's worker ------------------------------------------------------- */

static _Thread_local worker *tls_worker;

/* The empty asm makes it impure (see jobs_internal.h). */
worker *jobs_current_worker(void) {
    worker *w = tls_worker;
    __asm__ volatile("" : "+r"(w)::"memory");
    return w;
}

void jobs_set_current_worker(worker *w) {
    tls_worker = w;
}

uint32_t sp_jobs_worker_id(void) {
    worker *w = jobs_current_worker();
    return w ? w->id : SP_JOBS_NOT_A_WORKER;
}

bool sp_jobs_in_job(void) {
    worker *w = jobs_current_worker();
    return w && w->current_job;
}

/* ---- queues ---------------------------------------------------------------------------- */

void jobs_mpsc_init(mpsc *q) {
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

/* NULL when empty, or when another consumer holds the queue (size stays non-zero). */
static job *inject_pop(mpsc *q) {
    if (atomic_load_explicit(&q->size, memory_order_relaxed) == 0) return NULL;
    if (!sp_mutex_trylock(&q->pop_lock)) return NULL;
    job *j = mpsc_pop(q);
    sp_mutex_unlock(&q->pop_lock);
    return j;
}

/* ---- sleeping and waking --------------------------------------------------------------- */

static void wake_worker(worker *w) {
    atomic_store(&w->sleep, 0);
    sp_futex_wake((uint32_t *)&w->sleep, 1);
}

/* Take worker i out of the idle set and wake it, if it is in it. */
bool jobs_wake_if_idle(sp_jobs *s, uint32_t i) {
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
        n -= jobs_wake_if_idle(s, i);
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
        if (w->local_head[r] || atomic_load(&w->pinned[r].size) || atomic_load(&s->inject[r].size))
            return true;
        for (uint32_t i = 0; i <= s->nworkers; i++) /* its own deque included */
            if (deque_nonempty(s->workers[i].deque[r])) return true;
    }
    return false;
}

static void records_flush(sp_jobs *s, worker *w, uint32_t keep);

/* Nothing to run: spin for desc.spin_ns, then sleep on the worker's futex until a push wakes
 * it. With `c`, also return once c reaches target (a nested wait: it polls every 100 us, as
 * nothing wakes it for the counter). While shutdown drains, the main thread sleeps at most
 * 1 ms at a time so it can notice that everything finished. */
/* An idle worker gives its cached job records back when a taker is short of them. */
static void idle_flush(sp_jobs *s, worker *w) {
    if (SP_UNLIKELY(atomic_load(&s->records_wanted)) && w->free_count) records_flush(s, w, 0);
}

void jobs_records_give_back(sp_jobs *s) {
    worker *w = jobs_worker_of(s);
    if (w) idle_flush(s, w);
}

static void worker_idle(sp_jobs *s, worker *w, sp_counter *c, int64_t target) {
    jobs_busy_set(w, 0);
    if (w->id == 0 && atomic_load_explicit(&s->closing, memory_order_relaxed)) jobs_drain_check(s);
    atomic_fetch_add(&s->spinning, 1);
    uint64_t t0 = sp_time_ns();
    bool found = false;
    for (uint32_t i = 1;; i++) {
        idle_flush(s, w);
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
    idle_flush(s, w); /* records_wait wakes only workers in the idle set */
    if (!has_work(s, w)) {
        const sp_jobs_hooks *h = &s->desc.hooks;
        stat_inc(&w->sleeps);
        /* After the hook, look again: it may have made a job ready here (a counter it signalled
         * resumes its parked job on this worker, where no push wakes anyone). */
        bool ready = false;
        if (h->worker_sleep) {
            JOBS_HOOK(w, h->worker_sleep, (h->user, w->id));
            ready = has_work(s, w);
        }
        uint64_t timeout = c ? 100000 : w->id == 0 && atomic_load(&s->closing) ? 1000000 : 0;
        while (!ready && atomic_load(&w->sleep) == 1) {
            sp_futex_wait((uint32_t *)&w->sleep, 1, timeout);
            if (timeout) break;
        }
        JOBS_HOOK(w, h->worker_wake, (h->user, w->id));
    }
    atomic_fetch_and(&s->idle_mask, ~bit);
    atomic_store(&w->sleep, 0);
}

/* ---- job records ----------------------------------------------------------------------- */

/* Records live in one pool (s->record_free, under record_lock) and in small per-worker caches
 * (owner only) that are refilled and flushed in batches of s->record_batch. A cache never
 * holds more than 2 * record_batch, which is scaled down for small max_jobs; when a take
 * finds too few records anywhere it asks the workers to flush their caches (records_wanted)
 * and gives them a moment, so max_jobs records are usable however they are spread. */

/* Move the cache's records beyond `keep` to the pool. */
static void records_flush(sp_jobs *s, worker *w, uint32_t keep) {
    if (w->free_count <= keep) return;
    sp_mutex_lock(&s->record_lock);
    while (w->free_count > keep) {
        job *k = w->free_jobs;
        w->free_jobs = k->next;
        k->next = s->record_free;
        s->record_free = k;
        w->free_count--;
        s->record_free_count++;
    }
    sp_mutex_unlock(&s->record_lock);
}

/* Move up to n records from the pool to w's cache; true if w now holds `need`. */
static bool records_refill(sp_jobs *s, worker *w, uint32_t n, uint32_t need) {
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
    return w->free_count >= need;
}

/* n records from the pool, or NULL if it has fewer. */
static job *records_take_pool(sp_jobs *s, uint32_t n) {
    job *chain = NULL;
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

/* Too few records: ask every worker to flush its cache, wake the sleeping ones (they flush on
 * their way back to sleep), and look again: for up to 10 ms, or up to 1 s while the records
 * it needs are free but cached by workers (the ones live jobs hold aside), which a loaded
 * machine can keep off a CPU for longer than 10 ms (a worker in a long job flushes only when
 * it returns). This is the way to SP_ERR_LIMIT, not a fast path. */
SP_COLD static bool records_wait(sp_jobs *s, worker *w, uint32_t n) {
    atomic_fetch_add(&s->records_wanted, 1);
    for (uint32_t i = 0; i <= s->nworkers; i++) jobs_wake_if_idle(s, i);
    /* A thread that is not a worker counted its n in ext_taken already (in `live`). */
    uint64_t done, live = jobs_records_outstanding(s, &done), need = w ? n : 0;
    uint64_t patience = live + need <= s->desc.max_jobs ? 1000000000 : 10000000;
    bool got = false;
    for (uint64_t t0 = sp_time_ns(); !got && sp_time_ns() - t0 < patience; sp_thread_yield()) {
        sp_mutex_lock(&s->record_lock);
        got = s->record_free_count + (w ? w->free_count : 0) >= n;
        sp_mutex_unlock(&s->record_lock);
    }
    atomic_fetch_sub(&s->records_wanted, 1);
    return got;
}

/* A chain of n records linked by next, or NULL when there are not that many free (the ones
 * found stay cached). w NULL: a thread that is not a worker takes them from the pool, and
 * counts them in ext_taken itself (before it looks at `closing`, see submit). */
job *jobs_records_take(sp_jobs *s, worker *w, uint32_t n) {
    job *chain = NULL;
    if (!w) {
        chain = records_take_pool(s, n);
        if (SP_UNLIKELY(!chain) && records_wait(s, NULL, n)) chain = records_take_pool(s, n);
        return chain;
    }
    if (w->free_count < n && !records_refill(s, w, n - w->free_count + s->record_batch, n) &&
        !(records_wait(s, w, n) && records_refill(s, w, n - w->free_count, n)))
        return NULL;
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

static void record_put(sp_jobs *s, worker *w, job *j) {
    j->next = w->free_jobs;
    w->free_jobs = j;
    w->free_count++;
    if (SP_UNLIKELY(atomic_load_explicit(&s->records_wanted, memory_order_relaxed)))
        records_flush(s, w, 0);
    else if (w->free_count >= 2 * s->record_batch)
        records_flush(s, w, s->record_batch);
    stat_inc(&w->returned); /* after the record is back: see jobs_drain_check */
}

/* ---- making jobs ready ------------------------------------------------------------------ */

/* Queue j where it can be found: pinned to the calling worker, its local list; pinned to
 * another, that worker's queue; else the calling worker's deque, or (not a worker, or the
 * deque is full) the injection queue. Does not wake anyone: returns the worker to wake for a
 * job pinned elsewhere, NO_PIN when any worker may run it, and the caller's id for its own. */
static uint32_t job_push(sp_jobs *s, worker *w, job *j) {
    if (j->kind == JOB_BATCH || j->kind == JOB_PFOR)
        jobs_piece_hide(s, j, j->end - j->begin > piece_grain(j));
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
void jobs_chain_push(sp_jobs *s, worker *w, job *chain) {
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
    if (pinned) {
        atomic_thread_fence(memory_order_seq_cst); /* as in wake_idle */
        for (; pinned; pinned &= pinned - 1)
            jobs_wake_if_idle(s, (uint32_t)__builtin_ctzll(pinned));
    }
    if (anyone) wake_idle(s, anyone);
}

/* A parked job is ready again. Resumed by a job of this scheduler's worker w: it runs next on
 * w (unless w already has one, or it is pinned elsewhere); otherwise it is queued. */
void jobs_job_ready(sp_jobs *s, worker *w, job *j) {
    /* The slot only when w's loop will look at it soon: not from a thread's own stack (the main
     * thread outside its waits may not run jobs for a long time). */
    if (w && !w->next_job && w->current_fiber != w->thread_fiber &&
        (j->resume_pin == NO_PIN || j->resume_pin == w->id)) {
        w->next_job = j;
        return;
    }
    j->next = NULL;
    jobs_chain_push(s, w, j);
}

/* ---- fibers ---------------------------------------------------------------------------- */

static bool piece_spawn(sp_jobs *s, worker *w, const job *j, uint64_t begin, uint64_t end);

static void after_switch(void) {
    worker *w = jobs_current_worker();
    if (w->pending_park) {
        waiter *wt = w->pending_park;
        w->pending_park = NULL;
        jobs_waiter_publish(w->pending_counter, wt);
    }
    if (w->pending_spare) {
        jobs_spare_put(w->s, w, w->pending_spare);
        w->pending_spare = NULL;
    }
}

/* Switch this worker's thread to `to`. Returns when something switches back to the calling
 * fiber, possibly on another worker: re-read the worker after it. */
SP_INLINE void switch_fiber(worker *w, sp_fiber *to) {
    sp_fiber *from = w->current_fiber;
    w->current_fiber = to;
    const sp_jobs_hooks *h = &w->s->desc.hooks;
    JOBS_HOOK(w, h->fiber_switch, (h->user, w->id));
    sp_fiber_switch(from, to);
    after_switch();
}

void jobs_switch_to(worker *w, sp_fiber *to) {
    switch_fiber(w, to);
}

/* A loop fiber suspended in its loop: kept by w (at most SPARES_LOCAL), else by the scheduler,
 * so that no worker keeps more than a few of the fibers another may need. */
void jobs_spare_put(sp_jobs *s, worker *w, sp_fiber *f) {
    if (w->spare_count < SPARES_LOCAL) {
        w->spares[w->spare_count++] = f;
        return;
    }
    sp_mutex_lock(&s->spare_lock);
    uint32_t n = atomic_load_explicit(&s->spare_count, memory_order_relaxed);
    s->spares[n] = f;
    atomic_store_explicit(&s->spare_count, n + 1, memory_order_relaxed);
    sp_mutex_unlock(&s->spare_lock);
}

/* A loop fiber for w to continue on: a spare (w's, else the scheduler's), else a fresh one;
 * NULL if every fiber is in use. */
static sp_fiber *loop_fiber_get(sp_jobs *s, worker *w) {
    if (w->spare_count) return w->spares[--w->spare_count];
    sp_fiber *f = NULL;
    if (atomic_load_explicit(&s->spare_count, memory_order_relaxed)) { /* the lock decides */
        sp_mutex_lock(&s->spare_lock);
        uint32_t n = atomic_load_explicit(&s->spare_count, memory_order_relaxed);
        if (n) {
            f = s->spares[n - 1];
            atomic_store_explicit(&s->spare_count, n - 1, memory_order_relaxed);
            if (n - 1 < s->spare_low) s->spare_low = n - 1;
        }
        sp_mutex_unlock(&s->spare_lock);
    }
    return f ? f : sp_fiber_acquire(s->pool, jobs_loop_main, NULL);
}

/* Whether a job any worker may run is queued in w's deques or the injection queues. */
static bool shared_work(sp_jobs *s, worker *w) {
    for (int r = 0; r < RANKS; r++)
        if (atomic_load_explicit(&s->inject[r].size, memory_order_relaxed) ||
            deque_nonempty(w->deque[r]))
            return true;
    return false;
}

/* Bookkeeping for parked job j about to run again on w; returns its fiber. */
static sp_fiber *job_unpark(worker *w, job *j) {
    sp_fiber *f = j->fiber;
    j->fiber = NULL;
    /* Back to the thread's own stack (its thread job, or a parallel_for piece the thread ran
     * outside its loop): it leaves the loop, so what waits in its slot goes where anyone may
     * run it, and work that anyone may run gets a worker, since a push may have woken (or
     * counted on the spinning of) this thread alone. */
    if (f == w->thread_fiber) {
        if (w->next_job) {
            job *k = w->next_job;
            w->next_job = NULL;
            k->next = NULL;
            jobs_chain_push(w->s, w, k);
        } else if (shared_work(w->s, w)) {
            wake_idle(w->s, 1);
        }
    }
    if (j->kind == JOB_THREAD) {
        w->current_job = NULL;
        jobs_busy_set(w, 0);
    } else {
        w->current_job = j;
        const job *subject = job_wait_subject(j);
        if (subject) {
            stat_inc(&w->resumes);
            const sp_jobs_hooks *h = &w->s->desc.hooks;
            JOBS_HOOK(w, h->job_resume, (h->user, w->id, job_wait_name(subject)));
        }
    }
    return f;
}

/* Resume parked job j on w, from loop fiber `self`, which becomes a spare. */
static void job_resume(worker *w, sp_fiber *self, job *j) {
    sp_fiber *f = job_unpark(w, j);
    w->pending_spare = self;
    switch_fiber(w, f);
}

/* Take a batch piece's finished jobs off its counter (which may be NULL). */
static void piece_settle(job *j) {
    if (j->completed && j->counter) counter_lower(j->counter, (int64_t)j->completed);
    j->completed = 0;
}

/* A piece about to wait: the rest of it must not wait with it (it may be what the wait waits
 * for), so it is queued as a piece of its own (if a record is free), and the jobs it ran are
 * taken off its counter now. */
static void piece_give_back(sp_jobs *s, worker *w, job *me) {
    if (me->kind != JOB_BATCH && me->kind != JOB_PFOR) return;
    if (me->begin < me->end && piece_spawn(s, w, me, me->begin, me->end)) me->end = me->begin;
    jobs_piece_hide(s, me, false); /* what it still holds waits with it: look elsewhere */
    piece_settle(me);
}

/* Park `me`, running on w's current fiber, on c until `target`, and continue on `next` (which
 * runs `next_job` if that is a resumed job, else is a loop fiber). False, with nothing changed,
 * if the counter is already reached. On true, returns once resumed (maybe elsewhere). */
SP_INLINE bool job_park(sp_jobs *s, worker *w, job *me, sp_counter *c, int64_t target,
                        sp_fiber *next, job *next_job) {
    piece_give_back(s, w, me);
    if (counter_reached(c, target)) return false;
    waiter node = {.target = target, .kind = WAIT_FIBER, .job = me};
    me->fiber = w->current_fiber;
    /* A thread's own stack must come back to its own thread. */
    if (w->current_fiber == w->thread_fiber) me->resume_pin = w->id;
    const job *subject = job_wait_subject(me);
    if (subject) {
        stat_inc(&w->parks);
        const sp_jobs_hooks *h = &s->desc.hooks;
        JOBS_HOOK(w, h->job_park, (h->user, w->id, job_wait_name(subject)));
    }
    w->pending_park = &node; /* published by whoever runs next on this thread */
    w->pending_counter = c;
    if (next_job) {
        job_unpark(w, next_job);
    } else {
        w->current_job = NULL;
    }
    switch_fiber(w, next);
    return true;
}

/* ---- running jobs ---------------------------------------------------------------------- */

/* Steal a job of rank r from another worker, starting at a random one. NULL with *seen set
 * when some deque held work but other thieves (or its owner) took it first. */
static job *steal(sp_jobs *s, worker *w, int r, bool *seen) {
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
            *seen = true;
            if (sp_deque_steal_remote(d, &item) == SP_STEAL_ITEM) {
                stat_inc(&w->stolen);
                return item;
            }
        }
    }
    return NULL;
}

/* Highest rank first, strictly: a rank is given up only once nothing of it is left anywhere
 * this worker may take from (lost steals and busy queues are tried again). Within a rank: the
 * next-job slot (a resumed job, on a warm cache), pinned here by this worker, pinned here by
 * others, own deque, injection, stolen. */
static job *find_work(sp_jobs *s, worker *w) {
    for (int r = 0; r < RANKS; r++) {
        job *j = w->next_job;
        if (j && j->rank == r) {
            w->next_job = NULL;
            return j;
        }
        j = w->local_head[r];
        if (j) {
            w->local_head[r] = j->next;
            return j;
        }
        for (uint32_t tries = 0;; tries++) {
            bool seen = false;
            j = mpsc_pop(&w->pinned[r]);
            if (!j) j = sp_deque_pop_local(w->deque[r]);
            if (!j) j = inject_pop(&s->inject[r]);
            if (!j) j = steal(s, w, r, &seen);
            if (j) return j;
            /* Nothing taken, but some of rank r may still be queued (a lost steal, a busy or
             * half-pushed queue: look again), or held by a running piece that splits again at
             * its next step (look again for a while: HIDDEN_PATIENCE). */
            if (!seen && !atomic_load_explicit(&w->pinned[r].size, memory_order_relaxed) &&
                !atomic_load_explicit(&s->inject[r].size, memory_order_relaxed) &&
                (tries >= HIDDEN_PATIENCE ||
                 !atomic_load_explicit(&s->hidden[r], memory_order_relaxed)))
                break;
        }
    }
    return NULL;
}

/* Split [begin, end) off piece j as a new piece and queue it. False when out of records. */
static bool piece_spawn(sp_jobs *s, worker *w, const job *j, uint64_t begin, uint64_t end) {
    job *k = jobs_records_take(s, w, 1);
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
    } else { /* a parallel_for piece is a job of its own (hooks, status, its counter) */
        atomic_fetch_add(&j->counter->value, 1);
        stat_inc(&w->submitted);
    }
    jobs_chain_push(s, w, k);
    return true;
}

/* Whether piece j (queued or running) holds jobs beyond the step it runs: while any does,
 * workers short of work of its rank look again rather than take lower-ranked work (a running
 * piece splits off half of what it holds at its next step once its deque is empty). Set when
 * a piece is queued (a deferred one is not counted while it waits) or starts running on its
 * caller, cleared when it starts its last step or hands its rest back. */
void jobs_piece_hide(sp_jobs *s, job *j, bool hides) {
    if (hides == j->hiding) return;
    j->hiding = hides;
    if (hides) {
        atomic_fetch_add(&s->hidden[j->rank], 1);
    } else {
        atomic_fetch_sub(&s->hidden[j->rank], 1);
    }
}

/* Whether a job of a rank above `rank` waits where w looks first: its next-job slot, its own
 * list and deque (what its own jobs made ready or resumed: every step), the queues other
 * threads push to (`shared`: every 16th step, as those lines are written by others). */
static bool higher_waiting(sp_jobs *s, worker *w, int rank, bool shared) {
    if (w->next_job && (int)w->next_job->rank < rank) return true;
    for (int r = 0; r < rank; r++) {
        if (w->local_head[r] || deque_nonempty(w->deque[r])) return true;
        if (shared && (atomic_load_explicit(&w->pinned[r].size, memory_order_relaxed) ||
                       atomic_load_explicit(&s->inject[r].size, memory_order_relaxed)))
            return true;
    }
    return false;
}

/* Run what is left of piece j. Lazy binary splitting: before each step, if nothing split off
 * by this worker is still waiting in its deque (thieves took it, or there was none), split off
 * the upper half. A step is one job of a batch, or `grain` indices of a parallel_for. When a
 * higher-ranked job is waiting for this worker, the piece gives its rest back (queued as a
 * piece of its own) and ends, so that the worker's loop takes that job first. */
void jobs_piece_run(sp_jobs *s, job *j) {
    const sp_jobs_hooks *h = &s->desc.hooks;
    const uint64_t grain = piece_grain(j);
    for (uint32_t step = 0; j->begin < j->end; step++) {
        worker *w = jobs_current_worker(); /* a step may wait and move us: read it every time */
        if (j->rank != RANK_HIGH && higher_waiting(s, w, j->rank, step % 16 == 0) &&
            piece_spawn(s, w, j, j->begin, j->end)) {
            j->end = j->begin;
            jobs_piece_hide(s, j, false);
            break;
        }
        uint64_t b = j->begin, left = j->end - b;
        if (left > grain && !deque_nonempty(w->deque[j->rank]) &&
            piece_spawn(s, w, j, b + left / 2, j->end)) {
            j->end = b + left / 2;
            continue;
        }
        uint64_t e = left > grain ? b + grain : j->end; /* a batch's grain is 1 */
        j->begin = e;
        jobs_piece_hide(s, j, e < j->end);
        if (j->kind == JOB_BATCH) {
            const batch_job *bj = &j->batch->jobs[b];
            JOBS_HOOK(w, h->job_begin, (h->user, w->id, bj->name));
            bj->fn(bj->arg);
            w = jobs_current_worker();
            JOBS_HOOK(w, h->job_end, (h->user, w->id, bj->name));
            j->completed++;
            stat_inc(&w->done);
        } else {
            j->pf->fn(j->pf->arg, b, e);
        }
    }
}

/* Run a job that has not started, on the calling fiber. Returns on the worker the job ended
 * on (it may have waited and moved). The counter is lowered last: a waiter woken by it may
 * read the status at once. */
static void job_run(sp_jobs *s, worker *w, job *j) {
    const sp_jobs_hooks *h = &s->desc.hooks;
    const bool whole = j->kind != JOB_BATCH; /* a batch piece reports each of its jobs itself */
    w->current_job = j;
    if (whole) JOBS_HOOK(w, h->job_begin, (h->user, w->id, j->name));
    if (j->kind == JOB_SINGLE) {
        j->fn(j->arg);
    } else {
        jobs_piece_run(s, j);
    }
    w = jobs_current_worker();
    if (whole) {
        JOBS_HOOK(w, h->job_end, (h->user, w->id, j->name));
        stat_inc(&w->done);
    }
    int64_t n = whole ? 1 : (int64_t)j->completed;
    if (!whole && atomic_fetch_sub_explicit(&j->batch->pieces, 1, memory_order_acq_rel) == 1)
        free(j->batch);
    w->current_job = NULL;
    sp_counter *c = j->counter;
    record_put(s, w, j);
    if (c && n) counter_lower(c, n);
}

/* Every scheduler fiber runs this loop (see the top of the file). */
void jobs_loop_main(sp_fiber *self, void *arg) {
    (void)arg;
    after_switch();
    for (;;) {
        worker *w = jobs_current_worker();
        sp_jobs *s = w->s;
        job *j = find_work(s, w);
        if (!j) {
            worker_idle(s, w, NULL, 0);
            continue;
        }
        jobs_busy_set(w, 1);
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
           "all %u fibers are in use (parked or running) and the pool cannot grow: a wait on "
           "counter '%s' runs other jobs on its own stack until the counter is reached; raise "
           "sp_jobs_desc.fibers_max (reported once)",
           sp_fiber_pool_count(s->pool), c->name ? c->name : "(unnamed)");
}

/* Whether the running fiber's stack has room for one more job on top of this frame: a
 * quarter of it left, and at least 32 KiB (a report through the logger alone takes about 10).
 * Thread stacks (no pooled fiber) are not measured. */
static bool stack_room(worker *w) {
    void *lo;
    size_t size;
    sp_fiber_stack(w->current_fiber, &lo, &size);
    size_t keep = size / 4 > 32768 ? size / 4 : 32768;
    char here;
    return !lo || (size_t)(&here - (char *)lo) > keep;
}

SP_COLD static void nest_report(sp_jobs *s, sp_counter *c) {
    if (atomic_exchange(&s->nest_logged, 1)) return;
    sp_log(SP_LOG_WARN, SP_ERR_LIMIT, "sp_counter_wait", c,
           "a wait on counter '%s' that runs jobs on its own stack (all %u fibers in use) has "
           "less than a quarter of the stack (or 32 KiB) left: it starts no more jobs there, "
           "only resumes parked ones and waits, which deadlocks if every worker is there; "
           "raise sp_jobs_desc.fibers_max or fiber_stack (reported once)",
           c->name ? c->name : "(unnamed)", sp_fiber_pool_count(s->pool));
}

/* A nested wait that may start no job: once no job has finished anywhere for a second, say
 * so (SP_ERR_STALLED, once per scheduler); the wait goes on. */
SP_COLD static void stall_check(sp_jobs *s, sp_counter *c, uint64_t *seen, uint64_t *since) {
    uint64_t run = sp_jobs_run_count(s), now = sp_time_ns();
    if (run != *seen) {
        *seen = run;
        *since = now;
    } else if (now - *since > 1000000000u && !atomic_exchange(&s->stall_logged, 1)) {
        sp_log(SP_LOG_ERROR, SP_ERR_STALLED, "sp_counter_wait", c,
               "no job has finished for a second while waits on full fiber stacks start none: "
               "counter '%s' (value %lld) waits for jobs that need a fiber; raise "
               "sp_jobs_desc.fibers_max (reported once)",
               c->name ? c->name : "(unnamed)", (long long)atomic_load(&c->value));
    }
}

/* No fiber to park on: run other jobs on this stack until c reaches target. With less than a
 * quarter of the stack left (decided once: this frame stays where it is), only resume parked
 * jobs (a switch, not a nesting): the new jobs a sweep finds (up to ASIDE_MAX) are set aside
 * and handed back to every worker in one push before a parked job runs or the wait naps. */
enum { ASIDE_MAX = 64 };
static void wait_nested(sp_jobs *s, worker *w, job *me, sp_counter *c, int64_t target) {
    exhaustion_report(s, w, c);
    piece_give_back(s, w, me);
    const bool room = stack_room(w);
    if (!room) nest_report(s, c);
    job *aside = NULL;
    uint32_t aside_n = 0;
    uint64_t seen = UINT64_MAX, since = 0; /* jobs run anywhere, and when that last changed */
    /* A job's nested wait counts for shutdown's drain, which gives it up once nothing moves
     * (a thread's own wait, shutdown's included, is never given up). */
    const bool job_wait = me->kind != JOB_THREAD;
    if (job_wait) atomic_fetch_add(&s->nested_waiting, 1);
    while (!counter_reached(c, target) && !me->stalled &&
           !(job_wait && atomic_load_explicit(&s->give_up_nested, memory_order_relaxed))) {
        job *k = find_work(s, w);
        if (k && !k->fiber && !room && aside_n < ASIDE_MAX) {
            k->next = aside;
            aside = k;
            aside_n++;
            continue;
        }
        if (aside) {
            jobs_chain_push(s, NULL, aside); /* queued for all workers */
            aside = NULL;
            aside_n = 0;
        }
        if (k && !k->fiber && !room) { /* the sweep's cap: this one goes back too */
            jobs_chain_push(s, NULL, (k->next = NULL, k));
            k = NULL;
        }
        if (!k && !room) { /* nothing to resume: nap 100 us, then sweep again */
            stall_check(s, c, &seen, &since);
            uint32_t nap = 0;
            sp_futex_wait(&nap, 0, 100000);
        } else if (k && k->fiber) {
            /* A parked job is ready: park ourselves and switch straight to it (parked, this
             * wait counts as a park, not as a nested wait). */
            if (job_wait) atomic_fetch_sub(&s->nested_waiting, 1);
            if (!job_park(s, w, me, c, target, k->fiber, k))
                jobs_chain_push(s, w, (k->next = NULL, k));
            if (job_wait) atomic_fetch_add(&s->nested_waiting, 1);
        } else if (k) {
            /* k runs on top of `me`: if k parks, `me` parks with it, so k must come back where
             * `me` may run. */
            if (k->resume_pin == NO_PIN) k->resume_pin = me->resume_pin;
            job_run(s, w, k);
            w = jobs_current_worker();
            w->current_job = me == &w->thread_job ? NULL : me;
        } else {
            worker_idle(s, w, c, target);
        }
        w = jobs_current_worker();
    }
    if (job_wait) {
        atomic_fetch_sub(&s->nested_waiting, 1);
        if (!counter_reached(c, target) && !me->stalled) { /* given up by shutdown */
            sp_log(SP_LOG_ERROR, SP_ERR_STALLED, "sp_counter_wait", c,
                   "job '%s' waits on counter '%s' (value %lld, target %lld) that nothing can "
                   "reach, in a wait that found no fiber: at shutdown its wait returns "
                   "SP_ERR_STALLED",
                   job_wait_name(me) ? job_wait_name(me) : "(unnamed)",
                   c->name ? c->name : "(unnamed)", (long long)atomic_load(&c->value),
                   (long long)target);
            atomic_fetch_add(&s->stalled_waits, 1);
            me->stalled = true; /* sp_counter_wait returns SP_ERR_STALLED */
        }
    }
    /* Leaving the wait, this thread goes back to its job: work anyone may run gets a worker,
     * since a push may have woken (or counted on the spinning of) this thread alone (as
     * job_unpark does for a thread's own stack). */
    if (shared_work(s, w)) wake_idle(s, 1);
}

/* Wait on a worker's thread: park the running job (or the thread's own stack) and run the
 * worker's loop on another fiber until the counter is reached. */
SP_INLINE void wait_on_worker(sp_jobs *s, worker *w, sp_counter *c, int64_t target) {
    job *me = w->current_job ? w->current_job : &w->thread_job;
    job *ready = w->next_job;
    if (ready && ready->fiber && !higher_waiting(s, w, ready->rank, true)) {
        /* A handoff: the job this worker resumed runs next anyway; switch straight to it.
         * Not past a job of a higher rank waiting for this worker: the loop then takes that
         * first, and `ready` in its turn. */
        w->next_job = NULL;
        /* Not parked: put `ready` back (the slot may have been filled meanwhile). */
        if (!job_park(s, w, me, c, target, ready->fiber, ready)) jobs_job_ready(s, w, ready);
        return;
    }
    sp_fiber *next = loop_fiber_get(s, w);
    if (SP_UNLIKELY(!next)) {
        wait_nested(s, w, me, c, target);
        return;
    }
    if (!job_park(s, w, me, c, target, next, NULL)) jobs_spare_put(s, w, next);
}

/* Block a thread that is not one of s's workers until c reaches target. */
static void wait_blocking(sp_counter *c, int64_t target) {
    _Atomic uint32_t flag = 0;
    waiter node = {.target = target, .kind = WAIT_FLAG, .flag = &flag};
    jobs_waiter_publish(c, &node); /* fired (flag set) once c reaches target, maybe at once */
    while (!atomic_load(&flag)) sp_futex_wait((uint32_t *)&flag, 0, 0);
}

sp_result sp_counter_wait(sp_counter *c, int64_t target) {
    sp_result r = counter_check(c, "sp_counter_wait");
    if (SP_UNLIKELY(r != SP_OK)) return r;
    if (counter_reached(c, target)) return SP_OK;
    if (SP_UNLIKELY(atomic_load(&c->s->stopped)))
        return sp_misuse(SP_ERR_SHUTDOWN, "sp_counter_wait", c,
                         "counter '%s' (value %lld) waited on after shutdown: nothing can reach it",
                         c->name ? c->name : "(unnamed)", (long long)atomic_load(&c->value));
    worker *w = jobs_worker_of(c->s);
    if (SP_UNLIKELY(w && w->in_hook)) return jobs_hook_misuse(w, "sp_counter_wait");
    if (!w) {
        wait_blocking(c, target);
        return SP_OK;
    }
    wait_on_worker(c->s, w, c, target);
    /* Resumed (maybe elsewhere): shutdown may have given up on this wait (abandon_waiters). */
    job *me = jobs_current_worker()->current_job;
    if (SP_UNLIKELY(me && me->stalled)) {
        me->stalled = false;
        return SP_ERR_STALLED;
    }
    return SP_OK;
}
