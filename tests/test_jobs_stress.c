/* The scheduler under a random mix, from a seeded RNG: external threads and the main thread
 * submit batches and wait, jobs submit nested batches and wait, parallel_for runs from every
 * kind of thread, counters are signalled by hand across threads, and deferred batches chain.
 *
 * Two nets: per-job run counts (each job exactly once), and plain (non-atomic) payloads a job
 * writes before it returns and the waiter reads after its wait (and the reverse, through a
 * hand-signalled counter): a missing happens-before edge is a ThreadSanitizer report even when
 * the values come out right. Job memory is freed right after the wait, so a job that ran or
 * touched its slot after its counter reached the target is an ASan report. Sizes are scaled
 * down under sanitizers. Inline, 2, 4 and 8 workers. */
#include <stdlib.h>
#include <string.h>

#include "jobs_support.h"

enum { EXTERNAL = 3, MAGIC = 0x5bd1e995 };

static sp_jobs *S;
static const jt_config *CFG;

typedef struct errors {
    atomic_uint payload, runs, rc, pfor, signal, order;
} errors;

static errors E;
static atomic_ullong ops_done, jobs_checked;

/* ---- leaf jobs ------------------------------------------------------------------------- */

typedef struct slot {
    atomic_int runs;
    uint64_t expect;  /* plain: set by the submitter before the submit */
    uint64_t payload; /* plain: set by the job */
} slot;

static void leaf_fn(void *arg) {
    slot *s = arg;
    s->payload = s->expect ^ MAGIC;
    atomic_fetch_add_explicit(&s->runs, 1, memory_order_relaxed);
}

/* After the wait: each slot's job ran once and its write is visible. */
static void slots_check(slot *s, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        if (atomic_load_explicit(&s[i].runs, memory_order_relaxed) != 1)
            atomic_fetch_add(&E.runs, 1);
        if (s[i].payload != (s[i].expect ^ MAGIC)) atomic_fetch_add(&E.payload, 1);
    }
    atomic_fetch_add(&jobs_checked, n);
}

static slot *slots_new(uint32_t n, uint64_t seed, sp_job_desc *d, int prio_mix) {
    slot *s = calloc(n, sizeof *s);
    if (!s) abort();
    for (uint32_t i = 0; i < n; i++) {
        s[i].expect = seed * 1000003u + i;
        d[i] = jt_job(leaf_fn, &s[i], "leaf");
        if (prio_mix) d[i].priority = (sp_job_priority)((seed + i) % 3);
    }
    return s;
}

/* ---- nested batches -------------------------------------------------------------------- */

typedef struct tree_arg {
    uint64_t seed;
    int depth;
    uint64_t payload; /* plain: written by the tree job before it returns */
} tree_arg;

static void tree_fn(void *arg) {
    tree_arg *t = arg;
    if (t->depth > 0) {
        uint32_t fan = (uint32_t)(t->seed % 5) + 1;
        tree_arg kids[5];
        sp_job_desc d[5];
        for (uint32_t i = 0; i < fan; i++) {
            kids[i] = (tree_arg){.seed = t->seed * 31 + i + 7, .depth = t->depth - 1};
            d[i] = jt_job(tree_fn, &kids[i], "tree");
        }
        sp_counter *c = sp_counter_create(S, "tree");
        if (!c || sp_jobs_submit(S, d, fan, c) != SP_OK || sp_counter_wait(c, 0) != SP_OK)
            atomic_fetch_add(&E.rc, 1);
        sp_counter_destroy(c);
        for (uint32_t i = 0; i < fan; i++)
            if (kids[i].payload != (kids[i].seed ^ MAGIC)) atomic_fetch_add(&E.payload, 1);
    }
    t->payload = t->seed ^ MAGIC;
}

/* ---- parallel_for ---------------------------------------------------------------------- */

typedef struct pfor_arg {
    uint64_t n;
    atomic_uchar *visits;
    uint64_t *plain; /* plain: each index written by the one call that owns it */
} pfor_arg;

static void pfor_body(void *arg, uint64_t b, uint64_t e) {
    pfor_arg *p = arg;
    if (b >= e || e > p->n) {
        atomic_fetch_add(&E.pfor, 1);
        return;
    }
    for (uint64_t i = b; i < e; i++) {
        atomic_fetch_add_explicit(&p->visits[i], 1, memory_order_relaxed);
        p->plain[i] = i ^ MAGIC;
    }
}

static void op_pfor(uint64_t n, uint64_t grain) {
    pfor_arg p = {.n = n, .visits = calloc(n + 1, 1), .plain = calloc(n + 1, sizeof(uint64_t))};
    if (!p.visits || !p.plain) abort();
    if (sp_parallel_for(S, 0, n, grain, pfor_body, &p) != SP_OK) atomic_fetch_add(&E.rc, 1);
    for (uint64_t i = 0; i < n; i++) {
        if (atomic_load_explicit(&p.visits[i], memory_order_relaxed) != 1)
            atomic_fetch_add(&E.pfor, 1);
        if (p.plain[i] != (i ^ MAGIC)) atomic_fetch_add(&E.payload, 1);
    }
    free(p.visits);
    free(p.plain);
}

static void pfor_job(void *arg) {
    uint64_t n = (uintptr_t)arg;
    op_pfor(n, n % 3 == 0 ? 0 : 16);
}

/* ---- hand signals across threads ------------------------------------------------------- */

typedef struct handoff {
    sp_counter *sig;
    uint64_t to_job;   /* plain: written by the signaller before sp_counter_sub */
    uint64_t from_job; /* plain: written by the job after its wait */
} handoff;

static void handoff_fn(void *arg) {
    handoff *h = arg;
    if (sp_counter_wait(h->sig, 0) != SP_OK) atomic_fetch_add(&E.rc, 1);
    h->from_job = h->to_job + 1;
}

/* ---- deferred stages ------------------------------------------------------------------- */

static atomic_uint stage_seq;

typedef struct staged {
    uint32_t at;    /* plain: sequence number when it ran */
    uint32_t stage; /* plain */
} staged;

static void staged_fn(void *arg) {
    staged *s = arg;
    s->at = atomic_fetch_add(&stage_seq, 1) + 1;
}

/* ---- one random operation -------------------------------------------------------------- */

static void op_random(ts_rng *r) {
    uint64_t kind = ts_rng_range(r, 0, 9);
    uint64_t seed = ts_rng_next(r);
    if (kind <= 3) { /* a batch of leaves, maybe with priorities, maybe pinned */
        uint32_t n = (uint32_t)ts_rng_range(r, 1, 96);
        sp_job_desc *d = malloc(n * sizeof *d);
        slot *s = slots_new(n, seed, d, kind == 1);
        if (kind == 2)
            for (uint32_t i = 0; i < n; i++) {
                d[i].pinned = true;
                d[i].worker = (uint32_t)((seed + i) % (CFG->workers + 1));
            }
        sp_counter *c = sp_counter_create(S, "batch");
        if (!c || sp_jobs_submit(S, d, n, c) != SP_OK || sp_counter_wait(c, 0) != SP_OK)
            atomic_fetch_add(&E.rc, 1);
        slots_check(s, n);
        sp_counter_destroy(c);
        free(s);
        free(d);
    } else if (kind <= 5) { /* a nested tree */
        tree_arg t = {.seed = seed, .depth = (int)ts_rng_range(r, 1, 3)};
        sp_job_desc d = jt_job(tree_fn, &t, "tree");
        sp_counter *c = sp_counter_create(S, "tree root");
        if (!c || sp_jobs_submit(S, &d, 1, c) != SP_OK || sp_counter_wait(c, 0) != SP_OK)
            atomic_fetch_add(&E.rc, 1);
        if (t.payload != (t.seed ^ MAGIC)) atomic_fetch_add(&E.payload, 1);
        sp_counter_destroy(c);
    } else if (kind == 6) { /* parallel_for here, and from inside jobs */
        uint64_t n = ts_rng_range(r, 0, SP_TSAN ? 2000 : 20000);
        op_pfor(n, ts_rng_range(r, 0, 1) ? 0 : ts_rng_range(r, 1, 300));
        sp_job_desc d[3];
        for (int i = 0; i < 3; i++)
            d[i] = jt_job(pfor_job, (void *)(uintptr_t)ts_rng_range(r, 1, 3000), "pfor");
        sp_counter *c = sp_counter_create(S, "pfor jobs");
        if (!c || sp_jobs_submit(S, d, 3, c) != SP_OK || sp_counter_wait(c, 0) != SP_OK)
            atomic_fetch_add(&E.rc, 1);
        sp_counter_destroy(c);
    } else if (kind <= 8) { /* hand signals: this thread -> jobs -> this thread */
        enum { H = 4 };
        handoff *h = calloc(H, sizeof *h);
        sp_counter *sig = sp_counter_create(S, "signal"), *c = sp_counter_create(S, "handoff");
        if (!h || !sig || !c) abort();
        sp_counter_add(sig, 1);
        sp_job_desc d[H];
        for (int i = 0; i < H; i++) {
            h[i].sig = sig;
            d[i] = jt_job(handoff_fn, &h[i], "handoff");
        }
        if (sp_jobs_submit(S, d, H, c) != SP_OK) atomic_fetch_add(&E.rc, 1);
        for (int i = 0; i < H; i++) h[i].to_job = seed + (uint64_t)i;
        if (sp_counter_value(sig) != 1) atomic_fetch_add(&E.signal, 1);
        sp_counter_sub(sig, 1);
        if (sp_counter_wait(c, 0) != SP_OK) atomic_fetch_add(&E.rc, 1);
        for (int i = 0; i < H; i++)
            if (h[i].from_job != seed + (uint64_t)i + 1) atomic_fetch_add(&E.payload, 1);
        sp_counter_destroy(sig);
        sp_counter_destroy(c);
        free(h);
    } else { /* three deferred stages behind a gate */
        enum { STAGES = 3, PER = 4 };
        staged *st = calloc(STAGES * PER, sizeof *st);
        sp_counter *gate = sp_counter_create(S, "gate"), *cs[STAGES];
        if (!st || !gate) abort();
        sp_counter_add(gate, 1);
        for (int k = 0; k < STAGES; k++) {
            cs[k] = sp_counter_create(S, "stage");
            if (!cs[k]) abort();
            sp_job_desc d[PER];
            for (int i = 0; i < PER; i++) {
                st[k * PER + i].stage = (uint32_t)k;
                d[i] = jt_job(staged_fn, &st[k * PER + i], "staged");
            }
            if (sp_jobs_submit_after(S, k ? cs[k - 1] : gate, 0, d, PER, cs[k]) != SP_OK)
                atomic_fetch_add(&E.rc, 1);
        }
        sp_counter_sub(gate, 1);
        if (sp_counter_wait(cs[STAGES - 1], 0) != SP_OK) atomic_fetch_add(&E.rc, 1);
        for (int k = 1; k < STAGES; k++)
            for (int i = 0; i < PER; i++)
                for (int j = 0; j < PER; j++)
                    if (!(st[(k - 1) * PER + j].at &&
                          st[(k - 1) * PER + j].at < st[k * PER + i].at))
                        atomic_fetch_add(&E.order, 1);
        for (int k = 0; k < STAGES; k++) sp_counter_destroy(cs[k]);
        sp_counter_destroy(gate);
        free(st);
    }
    atomic_fetch_add(&ops_done, 1);
}

/* ---- producers ------------------------------------------------------------------------- */

typedef struct producer {
    uint64_t seed;
    int ops;
    sp_counter *finished;
} producer;

static void *producer_thread(void *arg) {
    producer *p = arg;
    ts_rng r;
    ts_rng_seed(&r, p->seed);
    for (int i = 0; i < p->ops; i++) op_random(&r);
    sp_counter_sub(p->finished, 1);
    return NULL;
}

/* Jobs that are themselves producers: a few random operations each, from inside a job. */
static void producer_job(void *arg) {
    ts_rng r;
    ts_rng_seed(&r, (uintptr_t)arg);
    for (int i = 0; i < 3; i++) op_random(&r);
}

static void run(const jt_config *c, uint64_t seed) {
    CFG = c;
    memset(&E, 0, sizeof E);
    atomic_store(&ops_done, 0);
    atomic_store(&jobs_checked, 0);
    /* A small pool, so that waits also run out of fibers now and then (the exhaustion path:
     * jobs run on the waiting job's stack, hence the larger stacks). */
    sp_jobs_desc desc = {.workers = c->workers,
                         .no_workers = c->no_workers,
                         .fibers = 24,
                         .fibers_max = 24,
                         .fiber_stack = 1u << 20};
    jt_log_reset();
    if (sp_jobs_create(&S, &desc) != SP_OK) {
        ok(0, "%s: create", c->name);
        return;
    }
    const int ops = (int)ts_scaled(3000, SP_TSAN ? 10 : 3);
    const int job_producers = SP_TSAN ? 8 : 16;
    sp_counter *finished = sp_counter_create(S, "producers");
    if (!finished) abort();
    producer p[EXTERNAL];
    sp_thread t[EXTERNAL];
    int started = 0;
    sp_counter_add(finished, EXTERNAL);
    for (int i = 0; i < EXTERNAL; i++) {
        p[i] = (producer){.seed = seed * 100 + (uint64_t)i, .ops = ops, .finished = finished};
        if (sp_thread_start(&t[started], producer_thread, &p[i], "jt-producer") == SP_OK)
            started++;
        else
            sp_counter_sub(finished, 1);
    }
    /* Producer jobs, and the main thread's own share. */
    sp_job_desc pj[16];
    for (int i = 0; i < job_producers; i++)
        pj[i] = jt_job(producer_job, (void *)(uintptr_t)(seed * 1000 + (uint64_t)i), "producer");
    sp_counter *pjc = sp_counter_create(S, "producer jobs");
    bool good = pjc && sp_jobs_submit(S, pj, (uint32_t)job_producers, pjc) == SP_OK;
    ts_rng r;
    ts_rng_seed(&r, seed);
    for (int i = 0; i < ops; i++) op_random(&r);
    good &= sp_counter_wait(pjc, 0) == SP_OK;
    good &= sp_counter_wait(finished, 0) == SP_OK;
    for (int i = 0; i < started; i++) sp_thread_join(t[i]);

    unsigned long long want_ops = (unsigned long long)ops * (1 + started) + 3ull * job_producers;
    ok(good && started == EXTERNAL && atomic_load(&ops_done) == want_ops,
       "%s: %llu random operations from %d threads and %d producer jobs completed (%llu leaf "
       "jobs checked)",
       c->name, (unsigned long long)atomic_load(&ops_done), 1 + started, job_producers,
       (unsigned long long)atomic_load(&jobs_checked));
    ok(atomic_load(&E.runs) == 0 && atomic_load(&E.rc) == 0,
       "%s: every job ran exactly once, every call returned SP_OK (runs %u, rc %u)", c->name,
       atomic_load(&E.runs), atomic_load(&E.rc));
    ok(atomic_load(&E.payload) == 0 && atomic_load(&E.signal) == 0,
       "%s: plain data written before a job returned (or before a hand signal) was seen after "
       "the wait (%u wrong)",
       c->name, atomic_load(&E.payload));
    ok(atomic_load(&E.pfor) == 0 && atomic_load(&E.order) == 0,
       "%s: parallel_for covered every index once; deferred stages ran in order (%u, %u)", c->name,
       atomic_load(&E.pfor), atomic_load(&E.order));
    sp_jobs_status st;
    bool settled = jt_settle(S, &st);
    ok(settled && st.jobs_run == st.jobs_submitted && sp_counter_value(finished) == 0,
       "%s: status: %llu jobs submitted, all run; counters at 0", c->name,
       (unsigned long long)st.jobs_submitted);
    sp_counter_destroy(finished);
    sp_counter_destroy(pjc);
    ok(sp_jobs_shutdown(S) == SP_OK, "%s: shutdown", c->name);
    sp_jobs_destroy(S);
    S = NULL;
    /* The only message allowed: fiber exhaustion, once per scheduler, as a warning. */
    int limit = jt_log_count(SP_ERR_LIMIT, SP_LOG_WARN);
    ok(jt_log_total() == limit && limit <= 1,
       "%s: nothing logged but at most one fiber-exhaustion warning (%d records, exhaustions %u)",
       c->name, jt_log_total(), st.fiber_exhaustions);
    if (jt_log_total() != limit || limit > 1) jt_log_diag();
}

/* ---- shutdown racing submits from other threads ---------------------------------------- */

typedef struct racer {
    sp_counter *c;       /* created before shutdown: after it, sp_counter_create gives NULL */
    atomic_int *ok_subs; /* submits that returned SP_OK, all racers */
    uint64_t accepted;   /* jobs in batches that returned SP_OK */
    uint64_t bad;        /* a refused batch that changed the counter or ran, a failed wait */
    slot *s;
    uint32_t cap;
    ts_rng r;
} racer;

static void *racer_thread(void *arg) {
    racer *rc = arg;
    sp_job_desc d[8];
    for (;;) {
        uint32_t n = (uint32_t)ts_rng_range(&rc->r, 1, 8);
        if (rc->accepted + n > rc->cap) break;
        slot *s = rc->s + rc->accepted;
        for (uint32_t i = 0; i < n; i++) {
            s[i].expect = rc->accepted + i;
            d[i] = jt_job(leaf_fn, &s[i], "racer");
        }
        sp_result res = sp_jobs_submit(S, d, n, rc->c);
        if (res == SP_ERR_SHUTDOWN) {
            /* All-or-nothing: nothing of the refused batch ran, the counter did not move. */
            for (uint32_t i = 0; i < n; i++) rc->bad += atomic_load(&s[i].runs) != 0;
            rc->bad += sp_counter_value(rc->c) != 0;
            break;
        }
        if (res == SP_OK) atomic_fetch_add(rc->ok_subs, 1); /* inline: runs in main's waits */
        if (res != SP_OK || sp_counter_wait(rc->c, 0) != SP_OK) {
            rc->bad++;
            break;
        }
        rc->accepted += n;
    }
    return NULL;
}

/* Other threads submit and wait while the main thread shuts down: every submit either returns
 * SP_OK and its jobs run before shutdown returns, or returns SP_ERR_SHUTDOWN and changes
 * nothing. */
static void shutdown_race(const jt_config *c, uint64_t seed) {
    CFG = c;
    sp_jobs_desc desc = {.workers = c->workers, .no_workers = c->no_workers};
    if (sp_jobs_create(&S, &desc) != SP_OK) {
        ok(0, "%s: create", c->name);
        return;
    }
    enum { CAP = 1 << 16 };
    atomic_int ok_subs = 0;
    racer rc[EXTERNAL];
    sp_thread t[EXTERNAL];
    int started = 0;
    for (int i = 0; i < EXTERNAL; i++) {
        rc[i] = (racer){.c = sp_counter_create(S, "racer"), .ok_subs = &ok_subs, .cap = CAP};
        rc[i].s = calloc(CAP, sizeof(slot));
        if (!rc[i].c || !rc[i].s) abort();
        ts_rng_seed(&rc[i].r, seed + (uint64_t)i);
    }
    for (int i = 0; i < EXTERNAL; i++)
        if (sp_thread_start(&t[started], racer_thread, &rc[i], "jt-racer") == SP_OK) started++;
    bool some = jt_poll_int(&ok_subs, started); /* every racer got at least one batch in */
    sp_result res = sp_jobs_shutdown(S);
    for (int i = 0; i < started; i++) sp_thread_join(t[i]);
    uint64_t accepted = 0, bad = 0, ran = 0, wrong_payload = 0;
    for (int i = 0; i < EXTERNAL; i++) {
        accepted += rc[i].accepted;
        bad += rc[i].bad;
        for (uint32_t k = 0; k < CAP; k++) {
            int runs = atomic_load(&rc[i].s[k].runs);
            ran += (uint64_t)runs;
            if (k < rc[i].accepted && (runs != 1 || rc[i].s[k].payload != (k ^ MAGIC)))
                wrong_payload++;
        }
    }
    ok(some && res == SP_OK && started == EXTERNAL,
       "%s: shutdown while %d threads submit and wait returns SP_OK (%s)", c->name, started,
       sp_result_name(res));
    ok(bad == 0 && ran == accepted && wrong_payload == 0,
       "%s: each submit ran all its jobs once (%llu) or was refused with nothing run (bad %llu, "
       "ran %llu, wrong %llu)",
       c->name, (unsigned long long)accepted, (unsigned long long)bad, (unsigned long long)ran,
       (unsigned long long)wrong_payload);
    for (int i = 0; i < EXTERNAL; i++) {
        sp_counter_destroy(rc[i].c);
        free(rc[i].s);
    }
    sp_jobs_destroy(S);
    S = NULL;
}

int main(void) {
    jt_log_capture();
    for (int i = 0; i < JT_SWEEP; i++) {
        if (jt_sweep[i].workers == 1) continue; /* 0 (inline), 2, 4, 8 */
        jt_deadline(jt_sweep[i].name, 60);
        run(&jt_sweep[i], 0x5eed0000u + (uint64_t)i);
        jt_deadline("shutdown racing submits", 60);
        shutdown_race(&jt_sweep[i], 0x7ace0000u + (uint64_t)i);
    }
    alarm(0);
    jt_log_release();
    return done();
}
