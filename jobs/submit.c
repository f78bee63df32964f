/* Submitting: single jobs, batches (one record over a copy of the descs, split lazily by the
 * workers that run it), deferred batches, and parallel_for. */
#include "jobs_internal.h"

#include <stdlib.h>

/* sp_job_priority -> rank (0 is taken first). */
static const uint8_t priority_rank[3] = {RANK_NORMAL, RANK_HIGH, RANK_LOW};

/* ---- submitting ------------------------------------------------------------------------ */

static sp_result submit(sp_jobs *s, sp_counter *after, int64_t after_target, const sp_job_desc *d,
                        uint32_t n, sp_counter *counter, const char *call) {
    if (SP_UNLIKELY(!s || (n && !d)))
        return sp_misuse(SP_ERR_INVALID_ARG, call, s, "NULL %s", s ? "jobs" : "scheduler");
    if (SP_UNLIKELY(counter && !counter_live(counter)))
        return jobs_counter_dead(counter, call, "`counter`");
    if (SP_UNLIKELY(after && !counter_live(after)))
        return jobs_counter_dead(after, call, "`after`");
    if (SP_UNLIKELY(counter && counter->s != s))
        return sp_misuse(SP_ERR_INVALID_ARG, call, counter,
                         "`counter` belongs to another scheduler: nothing submitted");
    if (SP_UNLIKELY(after && after->s != s))
        return sp_misuse(SP_ERR_INVALID_ARG, call, after,
                         "`after` belongs to another scheduler: nothing submitted");
    if (SP_UNLIKELY(counter && jobs_counter_room(counter, n, call) != SP_OK))
        return SP_ERR_INVALID_ARG;
    if (SP_UNLIKELY(after && after == counter))
        return sp_misuse(SP_ERR_INVALID_ARG, call, after,
                         "`after` is the batch's own `counter`: the batch would wait on itself; "
                         "nothing submitted");
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
    worker *w = jobs_worker_of(s);
    if (SP_UNLIKELY(w && w->in_hook)) return jobs_hook_misuse(w, call);
    if (n == 0) return SP_OK;
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
    job *chain = jobs_records_take(s, w, records);
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
            jobs_waiter_publish(after, node); /* pushes the batch itself if reached meanwhile */
            return SP_OK;
        }
    }
    jobs_chain_push(s, w, chain);
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
    worker *w = jobs_worker_of(s);
    if (SP_UNLIKELY(w && w->in_hook)) return jobs_hook_misuse(w, "sp_parallel_for");
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
    if (w) {
        /* One of ours: run the range here, splitting pieces off for the others. The range is
         * the running job while it runs, so a wait in fn gives its rest back (and the piece
         * comes back where the caller may run). */
        job *outer = w->current_job;
        piece.resume_pin = outer ? outer->resume_pin : NO_PIN;
        piece.on_caller = true;
        piece.host = outer;
        w->current_job = &piece;
        jobs_piece_hide(s, &piece, end - begin > grain);
        jobs_piece_run(s, &piece);
        w = jobs_current_worker();
        w->current_job = outer;
    } else {
        /* Hand the whole range over as one piece and block. */
        job *j = jobs_records_take(s, NULL, 1);
        if (j) {
            *j = piece;
            atomic_fetch_add(&s->ext_submitted, 1);
            atomic_fetch_add(&c->value, 1);
            jobs_chain_push(s, NULL, j);
        } else { /* out of records: the caller does it all, serially */
            atomic_fetch_sub(&s->ext_taken, 1);
            fn(arg, begin, end);
        }
    }
    sp_counter_wait(c, 0);
    sp_counter_destroy(c);
    return SP_OK;
}
