/* Counters and their wait lists (see sp_jobs.h for the contract, sched.c's top for the
 * hand-over with parking fibers). Wait lists are lock-free stacks: a waiter pushes itself, then
 * reads the value again; a decrement that finds waiters takes the whole list, fires the ones it
 * satisfies and pushes the rest back (then looks again, for decrements that found the list
 * empty meanwhile). Counters need no lock, and a handoff (a job signals a counter another job
 * waits on, then parks) costs three atomic read-modify-writes: the decrement, taking the list,
 * and the parked job's push.
 */
#include "jobs_internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- wait lists -------------------------------------------------------------------------- */

/* w: the calling thread's worker of s, or NULL (jobs_worker_of). */
static void waiter_fire(sp_jobs *s, worker *w, waiter *wt) {
    switch (wt->kind) {
    case WAIT_FIBER:
        jobs_job_ready(s, w, wt->job); /* wt dies with the parked frame once the job runs */
        break;
    case WAIT_BATCH: {
        job *first = wt->job;
        uint32_t n = wt->count;
        atomic_fetch_sub(&s->deferred, n);
        jobs_chain_push(s, w, first);
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

/* Push the waiters head..tail (linked by next) onto c's wait list; anyone may push meanwhile. */
void jobs_waiters_push(sp_counter *c, waiter *head, waiter *tail) {
    waiter *old = atomic_load_explicit(&c->waiters, memory_order_relaxed);
    do {
        tail->next = old;
    } while (!atomic_compare_exchange_weak(&c->waiters, &old, head));
}

/* Something may wait for the value c has now: take the whole list, fire the waiters it
 * satisfies, push the others back, and look again if the value moved past one of those
 * meanwhile (a decrement that found the list empty while we held it woke no one). */
SP_NOINLINE void jobs_counter_wake(sp_counter *c) {
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
        jobs_waiters_push(c, keep, keep_tail);
        if (atomic_load(&c->value) > keep_max) break;
    }
    worker *w = ready ? jobs_worker_of(c->s) : NULL; /* this call never suspends */
    while (ready) {
        waiter *wt = ready;
        ready = wt->next;
        waiter_fire(c->s, w, wt);
    }
}

/* Put wt on c's wait list, then read the value again: a decrement that came in between found
 * no waiter (both sides are seq_cst: one sees the other). */
void jobs_waiter_publish(sp_counter *c, waiter *wt) {
    const int64_t target = wt->target; /* once pushed, wt may be fired and gone at any moment */
    jobs_waiters_push(c, wt, wt);
    if (counter_reached(c, target)) jobs_counter_wake(c);
}

/* ---- counters, public ------------------------------------------------------------------ */

/* Append c to s's free list (under s->counter_lock). FIFO: a destroyed counter is handed out
 * again only after every other free one, so a stale pointer to it stays detectably dead for
 * as long as possible. */
static void counter_free_put(sp_jobs *s, sp_counter *c) {
    c->next_free = NULL;
    if (s->counter_free_tail) {
        s->counter_free_tail->next_free = c;
    } else {
        s->counter_free = c;
    }
    s->counter_free_tail = c;
}

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
        for (int i = 0; i < COUNTER_CHUNK; i++) {
            chunk[i].s = s;
            counter_free_put(s, &chunk[i]);
        }
    }
    sp_counter *c = s->counter_free;
    s->counter_free = c->next_free;
    if (!s->counter_free) s->counter_free_tail = NULL;
    c->name = name;
    c->kept = false;
    c->wd_reported = false;
    atomic_store_explicit(&c->live, true, memory_order_relaxed); /* see counter_live */
    sp_mutex_unlock(&s->counter_lock);
    return c;
}

void sp_counter_destroy(sp_counter *c) {
    if (!c) return;
    sp_jobs *s = c->s;
    sp_mutex_lock(&s->counter_lock);
    const bool live = atomic_load_explicit(&c->live, memory_order_relaxed), kept = c->kept;
    const bool waited = atomic_load(&c->waiters) != NULL;
    const int64_t v = atomic_load(&c->value);
    /* A positive value may still be lowered by a job that holds the counter. After shutdown no
     * job runs: what is left was abandoned. */
    const bool used = waited || (v > 0 && !atomic_load(&s->stopped));
    if (SP_LIKELY(live && !kept && !used)) {
        atomic_store_explicit(&c->live, false, memory_order_relaxed);
        atomic_store(&c->value, 0);
        counter_free_put(s, c);
        sp_mutex_unlock(&s->counter_lock);
        return;
    }
    const char *name = c->name ? c->name : "(unnamed)"; /* under the lock: a create renames */
    sp_mutex_unlock(&s->counter_lock);
    if (!live) {
        sp_misuse(SP_ERR_DOUBLE_FREE, "sp_counter_destroy", c, "counter already destroyed");
    } else if (kept) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_counter_destroy", c,
                  "counter '%s' belongs to the runtime: not destroyed", name);
    } else {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_counter_destroy", c,
                  "counter '%s' is still in use (value %lld%s): not destroyed", name, (long long)v,
                  waited ? ", waited on" : "");
    }
}

sp_result jobs_counter_dead(const sp_counter *c, const char *call, const char *what) {
    return sp_misuse(SP_ERR_INVALID_ARG, call, c, "%s was destroyed: ignored", what);
}

void jobs_counter_keep(sp_counter *c, bool keep) {
    sp_mutex_lock(&c->s->counter_lock);
    SP_INVARIANT(atomic_load_explicit(&c->live, memory_order_relaxed), "jobs_counter_keep", c);
    c->kept = keep;
    sp_mutex_unlock(&c->s->counter_lock);
}

/* A negative n would move the counter the other way without the wake-ups (add) or raise it
 * under the name of signalling (sub). */
static sp_result counter_n_check(sp_counter *c, int64_t n, const char *call) {
    sp_result r = counter_check(c, call);
    if (r == SP_OK && SP_UNLIKELY(n < 0))
        r = sp_misuse(SP_ERR_INVALID_ARG, call, c, "negative n (%lld): counter '%s' unchanged",
                      (long long)n, c->name ? c->name : "(unnamed)");
    return r;
}

/* A raise that would take the counter above SP_COUNTER_MAX (far from int64's wrap, which
 * would make it negative: every wait on it satisfied): misuse under `call`, nothing changed. */
static sp_result counter_too_high(sp_counter *c, int64_t v, int64_t n, const char *call) {
    return sp_misuse(SP_ERR_INVALID_ARG, call, c,
                     "counter '%s' at %lld raised by %lld would pass 2^62: unchanged",
                     c->name ? c->name : "(unnamed)", (long long)v, (long long)n);
}

void sp_counter_add(sp_counter *c, int64_t n) {
    if (counter_n_check(c, n, "sp_counter_add") != SP_OK) return;
    int64_t v = atomic_load(&c->value);
    do {
        if (SP_UNLIKELY(n > SP_COUNTER_MAX || v > SP_COUNTER_MAX - n)) {
            counter_too_high(c, v, n, "sp_counter_add");
            return;
        }
    } while (!atomic_compare_exchange_weak(&c->value, &v, v + n));
}

void sp_counter_sub(sp_counter *c, int64_t n) {
    if (counter_n_check(c, n, "sp_counter_sub") != SP_OK) return;
    if (SP_UNLIKELY(n > SP_COUNTER_MAX)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_counter_sub", c,
                  "n %lld is above 2^62: counter '%s' unchanged", (long long)n,
                  c->name ? c->name : "(unnamed)");
        return;
    }
    /* A hand lowering may take the counter below zero (a signal before its raise), not below
     * -SP_COUNTER_MAX: past it the value would wrap (and later arithmetic on it overflow). The
     * jobs' own lowering (counter_lower) pairs with their raise and needs no check. */
    int64_t v = atomic_load(&c->value);
    do {
        if (SP_UNLIKELY(v < n - SP_COUNTER_MAX)) {
            sp_misuse(SP_ERR_INVALID_ARG, "sp_counter_sub", c,
                      "counter '%s' at %lld: lowering it by %lld goes below -2^62; unchanged",
                      c->name ? c->name : "(unnamed)", (long long)v, (long long)n);
            return;
        }
    } while (!atomic_compare_exchange_weak(&c->value, &v, v - n));
    if (SP_UNLIKELY(atomic_load(&c->waiters) != NULL)) jobs_counter_wake(c);
}

sp_result jobs_counter_room(sp_counter *c, uint32_t n, const char *call) {
    int64_t v = atomic_load_explicit(&c->value, memory_order_relaxed);
    return SP_UNLIKELY(v > SP_COUNTER_MAX - (int64_t)n) ? counter_too_high(c, v, n, call) : SP_OK;
}

int64_t sp_counter_value(const sp_counter *c) {
    if (!c) return 0;
    if (SP_UNLIKELY(!counter_live(c))) {
        jobs_counter_dead(c, "sp_counter_value", "counter");
        return 0;
    }
    return atomic_load(&c->value);
}
