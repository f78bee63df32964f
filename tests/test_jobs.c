/* The scheduler's contract (jobs/sp_jobs.h), swept over the inline mode (no_workers) and 1, 2,
 * 4 and 8 background workers: every job runs exactly once (rounds on one reused counter, and
 * batches larger than a deque, from the main thread and from a job), nested batches, deferred
 * batches (a diamond and a chain, ordered by sequence numbers), waits from jobs, from the main
 * thread and from a thread that is not a worker, hand-signalled counters, parallel_for (sums,
 * exactly-once coverage, nesting), priorities, pinned jobs, hooks, status figures, shutdown
 * with pending work, and wait chains deeper than the fiber pool. Once, outside the sweep:
 * pin_workers (each worker on its own CPU, the creating thread untouched). */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "jobs_support.h"

/* DEQUE: small, so batches spill from the deques into the injection queue. FIBERS: more than
 * the waits the nested-batch tree can park at once (259), so the sweep never runs out. */
enum { DEQUE = 256, FIBERS = 512 };

static sp_jobs *S;
static const jt_config *CFG;

static const char *cfg(void) {
    return CFG->name;
}

/* ---- hooks ----------------------------------------------------------------------------- */

typedef struct hook_counts {
    atomic_ullong begin, end, park, resume, sleep, wake, fiber_switch;
    atomic_ullong wrong_worker; /* a hook's worker argument differed from sp_jobs_worker_id() */
} hook_counts;

static hook_counts H;

static void count_worker(uint32_t worker) {
    if (worker != sp_jobs_worker_id()) atomic_fetch_add(&H.wrong_worker, 1);
}
static void on_begin(void *u, uint32_t w, const char *name) {
    (void)u, (void)name;
    atomic_fetch_add(&H.begin, 1);
    count_worker(w);
}
static void on_end(void *u, uint32_t w, const char *name) {
    (void)u, (void)name;
    atomic_fetch_add(&H.end, 1);
    count_worker(w);
}
static void on_park(void *u, uint32_t w, const char *name) {
    (void)u, (void)name;
    atomic_fetch_add(&H.park, 1);
    count_worker(w);
}
static void on_resume(void *u, uint32_t w, const char *name) {
    (void)u, (void)name;
    atomic_fetch_add(&H.resume, 1);
    count_worker(w);
}
static void on_sleep(void *u, uint32_t w) {
    (void)u;
    atomic_fetch_add(&H.sleep, 1);
    count_worker(w);
}
static void on_wake(void *u, uint32_t w) {
    (void)u;
    atomic_fetch_add(&H.wake, 1);
    count_worker(w);
}
static void on_switch(void *u, uint32_t w) {
    (void)u;
    atomic_fetch_add(&H.fiber_switch, 1);
    count_worker(w);
}

static void hooks_reset(void) {
    atomic_ullong *all[] = {&H.begin, &H.end,  &H.park,         &H.resume,
                            &H.sleep, &H.wake, &H.fiber_switch, &H.wrong_worker};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) atomic_store(all[i], 0);
}

static sp_counter *counter(const char *name) {
    return jt_counter(S, cfg(), name);
}

/* ---- every job exactly once ------------------------------------------------------------ */

static atomic_uchar *hits;

static void hit_fn(void *arg) {
    atomic_fetch_add_explicit(&hits[(uintptr_t)arg], 1, memory_order_relaxed);
}

typedef struct spill {
    uint32_t first, n;
    sp_result submit_rc, wait_rc;
    bool all_seen; /* the job saw each child's mark after its wait */
} spill;

static void fill_hits(sp_job_desc *d, uint32_t first, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) d[i] = jt_job(hit_fn, (void *)(uintptr_t)(first + i), "hit");
}

static void spill_fn(void *arg) {
    spill *sp = arg;
    sp_job_desc *d = malloc(sp->n * sizeof *d);
    sp_counter *c = sp_counter_create(S, "spill");
    if (!d || !c) {
        sp->submit_rc = SP_ERR_NOMEM;
        free(d);
        sp_counter_destroy(c);
        return;
    }
    fill_hits(d, sp->first, sp->n);
    sp->submit_rc = sp_jobs_submit(S, d, sp->n, c);
    sp->wait_rc = sp_counter_wait(c, 0);
    bool all = true;
    for (uint32_t i = 0; i < sp->n; i++) all &= atomic_load(&hits[sp->first + i]) == 1;
    sp->all_seen = all;
    sp_counter_destroy(c);
    free(d);
}

static void test_exactly_once(void) {
    const uint32_t total = (uint32_t)ts_scaled(200000, 8), round = 20000;
    const uint32_t spill_n = 4 * DEQUE + 3;
    const uint32_t n_all = total + 2 * spill_n;
    hits = calloc(n_all, 1);
    sp_job_desc *d = malloc((round > spill_n ? round : spill_n) * sizeof *d);
    if (!hits || !d) exit(1);
    sp_counter *c = counter("once");
    sp_jobs_status st0, st1;
    jt_settle(S, &st0);

    bool submit_ok = true, wait_ok = true, reused_ok = true, raised_ok = true;
    for (uint32_t first = 0; first < total; first += round) {
        uint32_t n = total - first < round ? total - first : round;
        fill_hits(d, first, n);
        submit_ok &= sp_jobs_submit(S, d, n, c) == SP_OK;
        /* Raised by n at the submit; inline, nothing runs before the wait. */
        if (CFG->no_workers) raised_ok &= sp_counter_value(c) == (int64_t)n;
        wait_ok &= sp_counter_wait(c, 0) == SP_OK;
        reused_ok &= sp_counter_value(c) == 0;
    }
    ok(submit_ok && wait_ok, "%s: %u jobs in rounds of %u: submits and waits return SP_OK", cfg(),
       total, round);
    ok(reused_ok && raised_ok,
       "%s: one counter reused for every round: raised by the batch, 0 "
       "after each wait",
       cfg());

    /* A batch four times the deque size, from the main thread, then one from inside a job. */
    fill_hits(d, total, spill_n);
    sp_result big_rc = sp_jobs_submit(S, d, spill_n, c);
    sp_result big_wait = sp_counter_wait(c, 0);
    spill sp = {.first = total + spill_n, .n = spill_n};
    sp_job_desc pj = jt_job(spill_fn, &sp, "spill");
    sp_result sp_rc = sp_jobs_submit(S, &pj, 1, c);
    sp_result sp_wait = sp_counter_wait(c, 0);
    ok(big_rc == SP_OK && big_wait == SP_OK && sp_counter_value(c) == 0,
       "%s: a batch of %u (deque %u) from the main thread", cfg(), spill_n, DEQUE);
    ok(sp_rc == SP_OK && sp_wait == SP_OK && sp.submit_rc == SP_OK && sp.wait_rc == SP_OK &&
           sp.all_seen,
       "%s: a batch of %u from inside a job; the job's wait saw every child done", cfg(), spill_n);

    uint32_t zero = 0, twice = 0;
    for (uint32_t i = 0; i < n_all; i++) {
        unsigned h = atomic_load(&hits[i]);
        zero += h == 0;
        twice += h > 1;
    }
    ok(zero == 0 && twice == 0, "%s: each of %u jobs ran exactly once (never: %u, more: %u)", cfg(),
       n_all, zero, twice);
    bool settled = jt_settle(S, &st1);
    uint64_t want = (uint64_t)total + spill_n + 1 + spill_n;
    ok(settled && st1.jobs_submitted - st0.jobs_submitted == want &&
           st1.jobs_run - st0.jobs_run == want,
       "%s: status counts %llu submitted and %llu run, want %llu", cfg(),
       (unsigned long long)(st1.jobs_submitted - st0.jobs_submitted),
       (unsigned long long)(st1.jobs_run - st0.jobs_run), (unsigned long long)want);
    sp_counter_destroy(c);
    free(d);
    free(hits);
    hits = NULL;
}

/* ---- nested batches -------------------------------------------------------------------- */

enum { FAN = 6, LEVELS = 4 }; /* a 6-ary tree of 5 levels: 259 inner nodes, 1296 leaves */

typedef struct node {
    atomic_int runs;
    bool done;          /* plain: written by the node's job, read by its parent after a wait */
    bool children_done; /* every child's `done` seen after the wait */
    sp_result rc;
} node;

static node *nodes;
static uint32_t inner_nodes;

static void node_fn(void *arg) {
    uint32_t i = (uint32_t)(uintptr_t)arg;
    node *nd = &nodes[i];
    atomic_fetch_add(&nd->runs, 1);
    nd->children_done = true;
    if (i < inner_nodes) {
        sp_job_desc d[FAN];
        for (uint32_t k = 0; k < FAN; k++)
            d[k] = jt_job(node_fn, (void *)(uintptr_t)(i * FAN + 1 + k), "tree");
        sp_counter *c = sp_counter_create(S, "tree");
        nd->rc = c ? sp_jobs_submit(S, d, FAN, c) : SP_ERR_NOMEM;
        if (nd->rc == SP_OK) nd->rc = sp_counter_wait(c, 0);
        for (uint32_t k = 0; k < FAN; k++) nd->children_done &= nodes[i * FAN + 1 + k].done;
        sp_counter_destroy(c);
    }
    nd->done = true;
}

static void test_nested(void) {
    uint32_t n = 1, level = 1;
    inner_nodes = 0;
    for (int l = 0; l < LEVELS; l++) {
        inner_nodes += level;
        level *= FAN;
    }
    n = inner_nodes + level;
    nodes = calloc(n, sizeof *nodes);
    if (!nodes) exit(1);
    sp_counter *c = counter("tree root");
    sp_job_desc root = jt_job(node_fn, (void *)(uintptr_t)0, "tree");
    sp_result rc = sp_jobs_submit(S, &root, 1, c);
    sp_result wrc = sp_counter_wait(c, 0);
    uint32_t once = 0, children_seen = 0, rc_ok = 0;
    for (uint32_t i = 0; i < n; i++) {
        once += atomic_load(&nodes[i].runs) == 1;
        children_seen += nodes[i].children_done;
        rc_ok += nodes[i].rc == SP_OK;
    }
    ok(rc == SP_OK && wrc == SP_OK && once == n,
       "%s: nested batches (%u jobs, %d levels of waits): each ran once (%u)", cfg(), n, LEVELS,
       once);
    ok(children_seen == n && rc_ok == n,
       "%s: every waiting job saw its children's writes after its wait", cfg());
    sp_counter_destroy(c);
    free(nodes);
}

/* ---- deferred batches: order by sequence numbers --------------------------------------- */

static atomic_uint seq;

typedef struct stamp {
    atomic_uint at; /* sequence number when it ran, 0 = not yet */
    atomic_int runs;
} stamp;

static void stamp_fn(void *arg) {
    stamp *st = arg;
    atomic_store(&st->at, atomic_fetch_add(&seq, 1) + 1);
    atomic_fetch_add(&st->runs, 1);
}

static sp_job_desc stamp_job(stamp *st) {
    return jt_job(stamp_fn, st, "stamp");
}

static void test_after(void) {
    /* Diamond A -> {B, C} -> D, all behind a gate held by hand. */
    stamp a = {0}, b = {0}, cc = {0}, dd = {0};
    sp_counter *gate = counter("gate"), *ca = counter("A"), *cbc = counter("BC"),
               *cd = counter("D");
    sp_counter_add(gate, 1);
    sp_job_desc ja = stamp_job(&a), jbc[2] = {stamp_job(&b), stamp_job(&cc)}, jd = stamp_job(&dd);
    bool sub_ok = sp_jobs_submit_after(S, gate, 0, &ja, 1, ca) == SP_OK &&
                  sp_jobs_submit_after(S, ca, 0, jbc, 2, cbc) == SP_OK &&
                  sp_jobs_submit_after(S, cbc, 0, &jd, 1, cd) == SP_OK;
    bool raised =
        sp_counter_value(ca) == 1 && sp_counter_value(cbc) == 2 && sp_counter_value(cd) == 1;
    bool held = atomic_load(&a.runs) + atomic_load(&b.runs) + atomic_load(&cc.runs) +
                    atomic_load(&dd.runs) ==
                0;
    sp_counter_sub(gate, 1);
    bool wait_ok = sp_counter_wait(cd, 0) == SP_OK;
    ok(sub_ok && raised, "%s: diamond: submit_after returns SP_OK and raises its counters now",
       cfg());
    ok(held, "%s: diamond: nothing ran while the gate was held", cfg());
    unsigned A = atomic_load(&a.at), B = atomic_load(&b.at), C = atomic_load(&cc.at),
             D = atomic_load(&dd.at);
    ok(wait_ok && A && B && C && D && A < B && A < C && B < D && C < D,
       "%s: diamond ran in order (A %u, B %u, C %u, D %u)", cfg(), A, B, C, D);
    ok(atomic_load(&a.runs) == 1 && atomic_load(&b.runs) == 1 && atomic_load(&cc.runs) == 1 &&
           atomic_load(&dd.runs) == 1 && sp_counter_value(ca) == 0 && sp_counter_value(cbc) == 0 &&
           sp_counter_value(cd) == 0,
       "%s: diamond: each job once, every counter back to 0", cfg());

    /* Already reached: runs without anything else happening. */
    stamp now = {0};
    sp_job_desc jn = stamp_job(&now);
    ok(sp_jobs_submit_after(S, ca, 0, &jn, 1, cd) == SP_OK && sp_counter_wait(cd, 0) == SP_OK &&
           atomic_load(&now.runs) == 1,
       "%s: submit_after on a counter already at its target runs the batch", cfg());

    /* A target above 0: starts once the counter is <= 2. */
    stamp mid = {0};
    sp_job_desc jm = stamp_job(&mid);
    sp_counter_add(gate, 5);
    bool mid_ok = sp_jobs_submit_after(S, gate, 2, &jm, 1, cd) == SP_OK;
    sp_counter_sub(gate, 2);
    bool mid_held = atomic_load(&mid.runs) == 0; /* gate at 3 */
    sp_counter_sub(gate, 1);
    mid_ok &= sp_counter_wait(cd, 0) == SP_OK;
    ok(mid_ok && mid_held && atomic_load(&mid.runs) == 1,
       "%s: submit_after with target 2 waits for the counter to reach 2", cfg());
    sp_counter_sub(gate, 2);

    /* A chain of stages, 3 jobs each, each stage after the previous one's counter. */
    enum { STAGES = 50, PER = 3 };
    stamp *st = calloc(STAGES * PER, sizeof *st);
    sp_counter *cs[STAGES] = {NULL};
    sp_counter_add(gate, 1);
    bool chain_ok = st != NULL;
    for (int k = 0; k < STAGES && chain_ok; k++) {
        cs[k] = counter("stage");
        sp_job_desc j[PER];
        for (int i = 0; i < PER; i++) j[i] = stamp_job(&st[k * PER + i]);
        chain_ok &= sp_jobs_submit_after(S, k ? cs[k - 1] : gate, 0, j, PER, cs[k]) == SP_OK;
    }
    sp_counter_sub(gate, 1);
    chain_ok &= sp_counter_wait(cs[STAGES - 1], 0) == SP_OK;
    bool ordered = true, once = true;
    unsigned prev_max = 0;
    for (int k = 0; k < STAGES && chain_ok; k++) {
        unsigned lo = UINT32_MAX, hi = 0;
        for (int i = 0; i < PER; i++) {
            unsigned at = atomic_load(&st[k * PER + i].at);
            once &= atomic_load(&st[k * PER + i].runs) == 1;
            lo = at < lo ? at : lo;
            hi = at > hi ? at : hi;
        }
        ordered &= lo > prev_max;
        prev_max = hi;
    }
    ok(chain_ok && ordered && once,
       "%s: a chain of %d deferred stages ran stage after stage, each job once", cfg(), STAGES);
    for (int k = 0; k < STAGES; k++) sp_counter_destroy(cs[k]);
    free(st);
    sp_counter_destroy(gate);
    sp_counter_destroy(ca);
    sp_counter_destroy(cbc);
    sp_counter_destroy(cd);
}

/* ---- hand-signalled counters, waits from everywhere ------------------------------------ */

typedef struct handoff {
    sp_counter *signal;
    int payload;   /* plain: written by the producer before it signals */
    int seen;      /* plain: what the waiter read after its wait */
    int64_t after; /* the counter's value when the waiter's wait returned */
    int64_t target;
    sp_result rc;
} handoff;

static void handoff_wait_fn(void *arg) {
    handoff *h = arg;
    h->rc = sp_counter_wait(h->signal, h->target);
    h->after = sp_counter_value(h->signal);
    h->seen = h->payload;
}

static void handoff_give_fn(void *arg) {
    handoff *h = arg;
    h->payload = 42;
    sp_counter_sub(h->signal, 1);
}

static void handoff_tick_fn(void *arg) {
    handoff *h = arg;
    sp_counter_sub(h->signal, 1);
}

static void test_signal(void) {
    sp_counter *done = counter("handoff done");
    handoff h = {.signal = counter("handoff"), .target = 0};
    sp_counter_add(h.signal, 1);
    sp_job_desc w = jt_job(handoff_wait_fn, &h, "waiter"), g = jt_job(handoff_give_fn, &h, "give");
    /* The waiter is submitted first: inline it runs first, parks, and the giver wakes it. */
    bool sub = sp_jobs_submit(S, &w, 1, done) == SP_OK && sp_jobs_submit(S, &g, 1, done) == SP_OK;
    bool waited = sp_counter_wait(done, 0) == SP_OK;
    ok(sub && waited && h.rc == SP_OK && h.seen == 42 && sp_counter_value(h.signal) == 0,
       "%s: sp_counter_add/sub as a signal between two jobs; the waiter saw the payload (%d)",
       cfg(), h.seen);

    /* Target above zero: five ticks of a counter raised by 5; the waiter wants <= 2. */
    handoff t = {.signal = counter("ticks"), .target = 2};
    sp_counter_add(t.signal, 5);
    sp_job_desc tw = jt_job(handoff_wait_fn, &t, "tick waiter"), ticks[3];
    for (int i = 0; i < 3; i++) ticks[i] = jt_job(handoff_tick_fn, &t, "tick");
    sub = sp_jobs_submit(S, &tw, 1, done) == SP_OK && sp_jobs_submit(S, ticks, 3, done) == SP_OK;
    waited = sp_counter_wait(done, 0) == SP_OK;
    ok(sub && waited && t.rc == SP_OK && t.after <= 2 && sp_counter_value(t.signal) == 2,
       "%s: a wait for target 2 returns once the value is <= 2 (saw %lld)", cfg(),
       (long long)t.after);
    /* The main thread waits on a counter a job signals. */
    sp_counter_sub(t.signal, 1);
    sp_job_desc tick = jt_job(handoff_tick_fn, &t, "tick");
    sub = sp_jobs_submit(S, &tick, 1, NULL) == SP_OK;
    ok(sub && sp_counter_wait(t.signal, 0) == SP_OK && sp_counter_value(t.signal) == 0,
       "%s: the main thread waits for a job's hand signal (job submitted without a counter)",
       cfg());
    sp_counter_destroy(t.signal);
    sp_counter_destroy(h.signal);
    sp_counter_destroy(done);
}

/* A thread that is not a worker submits a batch and waits for it (blocking). */
enum { EXT_JOBS = 500 };

typedef struct external {
    sp_counter *finished; /* the main thread waits on it (and runs the jobs, inline) */
    uint32_t id_seen;
    sp_result submit_rc, wait_rc;
    int payload[EXT_JOBS]; /* plain: written by the jobs, read by the thread after its wait */
    bool all_seen;
} external;

static void ext_job(void *arg) {
    int *p = arg;
    *p = 7;
}

static void *ext_thread(void *arg) {
    external *e = arg;
    e->id_seen = sp_jobs_worker_id();
    sp_counter *c = sp_counter_create(S, "external");
    sp_job_desc d[EXT_JOBS];
    for (int i = 0; i < EXT_JOBS; i++) d[i] = jt_job(ext_job, &e->payload[i], "external");
    e->submit_rc = c ? sp_jobs_submit(S, d, EXT_JOBS, c) : SP_ERR_NOMEM;
    e->wait_rc = c ? sp_counter_wait(c, 0) : SP_ERR_NOMEM;
    bool all = true;
    for (int i = 0; i < EXT_JOBS; i++) all &= e->payload[i] == 7;
    e->all_seen = all;
    sp_counter_destroy(c);
    sp_counter_sub(e->finished, 1);
    return NULL;
}

static void test_external_wait(void) {
    static external e;
    memset(&e, 0, sizeof e);
    e.finished = counter("external finished");
    sp_counter_add(e.finished, 1);
    sp_thread t;
    bool started = sp_thread_start(&t, ext_thread, &e, "jt-external") == SP_OK;
    if (!started) sp_counter_sub(e.finished, 1);
    bool waited = sp_counter_wait(e.finished, 0) == SP_OK;
    if (started) sp_thread_join(t);
    ok(started && waited && e.submit_rc == SP_OK && e.wait_rc == SP_OK && e.all_seen,
       "%s: a thread that is not a worker submits %d jobs, waits (blocking) and sees their "
       "writes",
       cfg(), EXT_JOBS);
    ok(e.id_seen == SP_JOBS_NOT_A_WORKER && sp_jobs_worker_id() == 0,
       "%s: worker id is SP_JOBS_NOT_A_WORKER there and 0 on the main thread", cfg());
    sp_counter_destroy(e.finished);
}

/* ---- parallel_for ---------------------------------------------------------------------- */

typedef struct pf {
    uint64_t begin, end;
    atomic_uchar *visits; /* per index, relative to begin */
    atomic_ullong sum, calls, bad;
} pf;

static void pf_body(void *arg, uint64_t b, uint64_t e) {
    pf *p = arg;
    atomic_fetch_add(&p->calls, 1);
    if (b >= e || b < p->begin || e > p->end) {
        atomic_fetch_add(&p->bad, 1);
        return;
    }
    uint64_t s = 0;
    for (uint64_t i = b; i < e; i++) {
        atomic_fetch_add_explicit(&p->visits[i - p->begin], 1, memory_order_relaxed);
        s += i;
    }
    atomic_fetch_add(&p->sum, s);
}

/* Run one parallel_for over [b, e) with `grain` and check it. */
static bool pf_check(uint64_t b, uint64_t e, uint64_t grain, const char *where, uint64_t *calls) {
    pf p = {.begin = b, .end = e};
    uint64_t n = e - b;
    p.visits = calloc(n ? n : 1, 1);
    if (!p.visits) exit(1);
    sp_result rc = sp_parallel_for(S, b, e, grain, pf_body, &p);
    uint64_t missed = 0, twice = 0;
    for (uint64_t i = 0; i < n; i++) {
        unsigned v = atomic_load_explicit(&p.visits[i], memory_order_relaxed);
        missed += v == 0;
        twice += v > 1;
    }
    uint64_t want = n ? (b + e - 1) * n / 2 : 0;
    bool good = rc == SP_OK && missed == 0 && twice == 0 && atomic_load(&p.bad) == 0 &&
                atomic_load(&p.sum) == want;
    if (!good)
        diag("  %s [%llu, %llu) grain %llu: rc %s, missed %llu, twice %llu, bad calls %llu, sum "
             "%llu want %llu",
             where, (unsigned long long)b, (unsigned long long)e, (unsigned long long)grain,
             sp_result_name(rc), (unsigned long long)missed, (unsigned long long)twice,
             (unsigned long long)atomic_load(&p.bad), (unsigned long long)atomic_load(&p.sum),
             (unsigned long long)want);
    *calls = atomic_load(&p.calls);
    free(p.visits);
    return good;
}

static void test_parallel_for(void) {
    uint64_t calls;
    bool good = pf_check(0, 0, 0, "empty", &calls);
    ok(good && calls == 0, "%s: parallel_for over an empty range: SP_OK, fn never called (%llu)",
       cfg(), (unsigned long long)calls);
    good = pf_check(5, 6, 0, "one", &calls);
    ok(good && calls == 1, "%s: parallel_for over 1 element: one call [5, 6) (%llu)", cfg(),
       (unsigned long long)calls);
    const struct {
        uint64_t b, e, grain;
    } cases[] = {{0, 1000, 0}, {0, 1000, 1}, {17, 1017, 7}, {0, 100000, 64}, {0, 100000, 0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        good = pf_check(cases[i].b, cases[i].e, cases[i].grain, "case", &calls);
        ok(good,
           "%s: parallel_for [%llu, %llu) grain %llu: each index once, sum right (%llu calls)",
           cfg(), (unsigned long long)cases[i].b, (unsigned long long)cases[i].e,
           (unsigned long long)cases[i].grain, (unsigned long long)calls);
    }
    /* A range no larger than the grain cannot split (pieces never go below the grain). */
    good = pf_check(100, 1100, 1000, "grain = range", &calls);
    ok(good && calls == 1, "%s: grain equal to the range: one call (%llu)", cfg(),
       (unsigned long long)calls);
    good = pf_check(100, 1100, 5000, "grain > range", &calls);
    ok(good && calls == 1, "%s: grain above the range: one call (%llu)", cfg(),
       (unsigned long long)calls);
    uint64_t big = ts_scaled(16u << 20, 8);
    good = pf_check(3, 3 + big, 0, "big", &calls);
    ok(good,
       "%s: parallel_for over %llu elements, automatic grain: each once, sum right (%llu calls)",
       cfg(), (unsigned long long)big, (unsigned long long)calls);
}

/* Nested: a parallel_for whose body runs a parallel_for, and jobs that run parallel_for. */
enum { OUTER = 32, INNER = 3000 };

static atomic_uchar nest_visits[OUTER * INNER];
static atomic_ullong nest_bad;

static void nest_inner(void *arg, uint64_t b, uint64_t e) {
    (void)arg;
    for (uint64_t i = b; i < e; i++)
        if (i < OUTER * INNER)
            atomic_fetch_add_explicit(&nest_visits[i], 1, memory_order_relaxed);
        else
            atomic_fetch_add(&nest_bad, 1);
}

static void nest_outer(void *arg, uint64_t b, uint64_t e) {
    (void)arg;
    for (uint64_t i = b; i < e; i++)
        if (sp_parallel_for(S, i * INNER, (i + 1) * INNER, i % 3 == 0 ? 0 : 100, nest_inner,
                            NULL) != SP_OK)
            atomic_fetch_add(&nest_bad, 1);
}

static void nest_job(void *arg) {
    uint64_t i = (uintptr_t)arg;
    if (sp_parallel_for(S, i * INNER, (i + 1) * INNER, 50, nest_inner, NULL) != SP_OK)
        atomic_fetch_add(&nest_bad, 1);
}

static bool nest_once(void) {
    bool all = true;
    for (uint64_t i = 0; i < OUTER * INNER; i++) {
        all &= atomic_load_explicit(&nest_visits[i], memory_order_relaxed) == 1;
        atomic_store_explicit(&nest_visits[i], 0, memory_order_relaxed);
    }
    return all && atomic_exchange(&nest_bad, 0) == 0;
}

static void test_nested_parallel_for(void) {
    nest_once();
    sp_result rc = sp_parallel_for(S, 0, OUTER, 1, nest_outer, NULL);
    ok(rc == SP_OK && nest_once(),
       "%s: parallel_for inside a parallel_for body: every inner index once", cfg());
    sp_job_desc d[OUTER];
    for (uint64_t i = 0; i < OUTER; i++) d[i] = jt_job(nest_job, (void *)(uintptr_t)i, "pfor job");
    sp_counter *c = counter("pfor jobs");
    rc = sp_jobs_submit(S, d, OUTER, c);
    sp_result wrc = sp_counter_wait(c, 0);
    ok(rc == SP_OK && wrc == SP_OK && nest_once(),
       "%s: parallel_for from inside %d jobs: every index once", cfg(), OUTER);
    sp_counter_destroy(c);
}

/* ---- priorities ------------------------------------------------------------------------ */

enum { PER_PRIO = 64 };

static stamp prio_stamps[3][PER_PRIO]; /* [priority][i] */

static sp_job_desc prio_job(int prio, int i) {
    sp_job_desc d = stamp_job(&prio_stamps[prio][i]);
    d.priority = (sp_job_priority)prio;
    return d;
}

/* Submit low, normal, high (in that order, in several small batches, or one job at a time:
 * `single`) with counter c. */
static bool prio_submit(sp_counter *c, bool single) {
    memset(prio_stamps, 0, sizeof prio_stamps);
    const int order[3] = {SP_PRIORITY_LOW, SP_PRIORITY_NORMAL, SP_PRIORITY_HIGH};
    bool good = true;
    for (int part = 0; part < 4; part++)
        for (int o = 0; o < 3; o++) {
            sp_job_desc d[PER_PRIO / 4];
            for (int i = 0; i < PER_PRIO / 4; i++)
                d[i] = prio_job(order[o], part * (PER_PRIO / 4) + i);
            if (single)
                for (int i = 0; i < PER_PRIO / 4; i++)
                    good &= sp_jobs_submit(S, &d[i], 1, c) == SP_OK;
            else
                good &= sp_jobs_submit(S, d, PER_PRIO / 4, c) == SP_OK;
        }
    return good;
}

/* How many jobs of a higher priority started after some job of priority `prio` (the most over
 * the jobs of `prio`). Taking is priority-ordered; starting is recorded a moment after taking,
 * so with w runners at most w - 1 higher jobs can be seen after a lower one. */
static unsigned prio_inversions(int prio) {
    const int higher[3][2] = {
        {SP_PRIORITY_HIGH, -1}, {-1, -1}, {SP_PRIORITY_HIGH, SP_PRIORITY_NORMAL}};
    unsigned worst = 0;
    for (int i = 0; i < PER_PRIO; i++) {
        unsigned at = atomic_load(&prio_stamps[prio][i].at), later = 0;
        for (int h = 0; h < 2; h++) {
            if (higher[prio][h] < 0) continue;
            for (int j = 0; j < PER_PRIO; j++)
                later += atomic_load(&prio_stamps[higher[prio][h]][j].at) > at;
        }
        worst = later > worst ? later : worst;
    }
    return worst;
}

static bool prio_all_once(void) {
    for (int p = 0; p < 3; p++)
        for (int i = 0; i < PER_PRIO; i++)
            if (atomic_load(&prio_stamps[p][i].runs) != 1) return false;
    return true;
}

typedef struct prio_parent {
    sp_result rc;
    bool submitted;
} prio_parent;

static void prio_parent_fn(void *arg) {
    prio_parent *pp = arg;
    sp_counter *c = sp_counter_create(S, "prio children");
    pp->submitted = c && prio_submit(c, false);
    pp->rc = c ? sp_counter_wait(c, 0) : SP_ERR_NOMEM;
    sp_counter_destroy(c);
}

static atomic_int blockers_in;
static atomic_bool gate_open;

static void blocker_fn(void *arg) {
    (void)arg;
    atomic_fetch_add(&blockers_in, 1);
    while (!atomic_load(&gate_open)) sp_thread_yield();
}

static void test_priority(void) {
    sp_counter *c = counter("priority");
    if (CFG->no_workers) {
        bool sub = prio_submit(c, false);
        bool waited = sp_counter_wait(c, 0) == SP_OK;
        ok(sub && waited && prio_all_once(), "%s: 3 x %d prioritised jobs ran once each", cfg(),
           PER_PRIO);
        unsigned n_inv = prio_inversions(SP_PRIORITY_NORMAL),
                 l_inv = prio_inversions(SP_PRIORITY_LOW);
        ok(n_inv == 0 && l_inv == 0,
           "%s: submitted low, normal, high from the main thread: every high ran before every "
           "normal, every normal before every low (inversions %u, %u)",
           cfg(), n_inv, l_inv);
        prio_parent pp = {0};
        sp_job_desc pj = jt_job(prio_parent_fn, &pp, "prio parent");
        sub = sp_jobs_submit(S, &pj, 1, c) == SP_OK;
        waited = sp_counter_wait(c, 0) == SP_OK;
        n_inv = prio_inversions(SP_PRIORITY_NORMAL);
        l_inv = prio_inversions(SP_PRIORITY_LOW);
        ok(sub && waited && pp.submitted && pp.rc == SP_OK && prio_all_once() && n_inv == 0 &&
               l_inv == 0,
           "%s: the same, submitted from inside a job that waits (inversions %u, %u)", cfg(), n_inv,
           l_inv);
    } else {
        /* Occupy every background worker with a pinned job that spins, queue all three
         * priorities from the main thread (which runs nothing: it never waits), then let the
         * workers go. The main thread polls instead of waiting, so exactly NW runners. One
         * job at a time: a batch piece holds its jobs until its worker runs them, and while
         * that worker is descheduled (more workers than CPUs here) the others rightly take
         * lower work; the bound below is for jobs taken one by one (it failed now and then
         * with batches: 16 high jobs seen after a normal one). */
        atomic_store(&blockers_in, 0);
        atomic_store(&gate_open, false);
        sp_counter *cb = counter("blockers");
        bool sub = true;
        for (uint32_t w = 1; w <= CFG->workers; w++) {
            sp_job_desc b = jt_job(blocker_fn, NULL, "blocker");
            b.pinned = true;
            b.worker = w;
            sub &= sp_jobs_submit(S, &b, 1, cb) == SP_OK;
        }
        bool all_in = jt_poll_int(&blockers_in, (int)CFG->workers);
        sub &= prio_submit(c, true);
        atomic_store(&gate_open, true);
        bool drained = jt_poll_counter(c, 0) && jt_poll_counter(cb, 0);
        sub &= sp_counter_wait(c, 0) == SP_OK && sp_counter_wait(cb, 0) == SP_OK;
        ok(sub && all_in && drained && prio_all_once(),
           "%s: every worker held by a pinned blocker, then 3 x %d prioritised jobs ran once",
           cfg(), PER_PRIO);
        unsigned n_inv = prio_inversions(SP_PRIORITY_NORMAL),
                 l_inv = prio_inversions(SP_PRIORITY_LOW);
        ok(n_inv <= CFG->workers - 1 && l_inv <= CFG->workers - 1,
           "%s: high taken before normal before low: at most %u higher jobs started after a "
           "lower one (saw %u, %u)",
           cfg(), CFG->workers - 1, n_inv, l_inv);
        sp_counter_destroy(cb);
    }
    sp_counter_destroy(c);
}

/* ---- pinned jobs ----------------------------------------------------------------------- */

enum { PIN_PER = 24, PIN_MAX = 9 };

typedef struct pin_rec {
    uint32_t want, before, after; /* worker ids: pinned to, at the start, after a wait */
    pthread_t thread;
    sp_result rc;
    atomic_int runs;
} pin_rec;

static pin_rec pins[PIN_MAX][PIN_PER];

static void pin_child(void *arg) {
    (void)arg;
}

static void pin_fn(void *arg) {
    pin_rec *p = arg;
    atomic_fetch_add(&p->runs, 1);
    p->before = sp_jobs_worker_id();
    p->thread = pthread_self();
    /* Wait on a child: the job parks (unless inline exhaustion) and resumes; pinned, it must
     * still be on its worker. */
    sp_counter *c = sp_counter_create(S, "pin child");
    sp_job_desc d = jt_job(pin_child, NULL, "pin child");
    p->rc = c ? sp_jobs_submit(S, &d, 1, c) : SP_ERR_NOMEM;
    if (p->rc == SP_OK) p->rc = sp_counter_wait(c, 0);
    sp_counter_destroy(c);
    p->after = sp_jobs_worker_id();
}

typedef struct pin_spawner {
    sp_counter *c;
    sp_result rc;
} pin_spawner;

/* From inside a job: pin the second half of each worker's jobs. */
static void pin_spawn_fn(void *arg) {
    pin_spawner *ps = arg;
    ps->rc = SP_OK;
    for (uint32_t w = 0; w <= CFG->workers; w++)
        for (int i = PIN_PER / 2; i < PIN_PER; i++) {
            sp_job_desc d = jt_job(pin_fn, &pins[w][i], "pinned");
            d.pinned = true;
            d.worker = w;
            if (sp_jobs_submit(S, &d, 1, ps->c) != SP_OK) ps->rc = SP_ERR_INVALID_ARG;
        }
}

static void test_pinned(void) {
    memset(pins, 0, sizeof pins);
    sp_counter *c = counter("pinned");
    uint32_t nw = CFG->workers; /* inline: only worker 0 exists */
    bool sub = true;
    for (uint32_t w = 0; w <= nw; w++)
        for (int i = 0; i < PIN_PER / 2; i++) {
            pins[w][i].want = w;
            pins[w][i + PIN_PER / 2].want = w;
            sp_job_desc d = jt_job(pin_fn, &pins[w][i], "pinned");
            d.pinned = true;
            d.worker = w;
            d.priority = (sp_job_priority)(i % 3);
            sub &= sp_jobs_submit(S, &d, 1, c) == SP_OK;
        }
    pin_spawner ps = {.c = c};
    sp_job_desc sd = jt_job(pin_spawn_fn, &ps, "pin spawner");
    sub &= sp_jobs_submit(S, &sd, 1, c) == SP_OK;
    bool waited = sp_counter_wait(c, 0) == SP_OK;
    uint32_t right = 0, stayed = 0, once = 0, total = (nw + 1) * PIN_PER;
    bool same_thread = true, main_thread = true, distinct = true;
    pthread_t self = pthread_self();
    for (uint32_t w = 0; w <= nw; w++) {
        for (int i = 0; i < PIN_PER; i++) {
            pin_rec *p = &pins[w][i];
            once += atomic_load(&p->runs) == 1 && p->rc == SP_OK;
            right += p->before == w;
            stayed += p->after == w;
            same_thread &= pthread_equal(p->thread, pins[w][0].thread);
        }
        if (w == 0) main_thread = pthread_equal(pins[0][0].thread, self);
        for (uint32_t v = 0; v < w; v++)
            distinct &= !pthread_equal(pins[w][0].thread, pins[v][0].thread);
    }
    ok(sub && waited && ps.rc == SP_OK && once == total,
       "%s: %u pinned jobs (from the main thread and from a job) ran once each", cfg(), total);
    ok(right == total && same_thread && distinct,
       "%s: each pinned job started on its worker (%u of %u), one thread per worker id", cfg(),
       right, total);
    ok(main_thread, "%s: jobs pinned to worker 0 ran on the main thread during its wait", cfg());
    ok(stayed == total, "%s: a pinned job that waited resumed on its own worker (%u of %u)", cfg(),
       stayed, total);
    sp_counter_destroy(c);
}

/* ---- shutdown with pending work -------------------------------------------------------- */

enum { PENDING = 300, PENDING_CHILDREN = 4 };

static atomic_int pending_runs, child_runs, deferred_runs;
static sp_counter *pending_gate;

static void pending_child(void *arg) {
    (void)arg;
    atomic_fetch_add(&child_runs, 1);
}

static void pending_fn(void *arg) {
    uintptr_t i = (uintptr_t)arg;
    atomic_fetch_add(&pending_runs, 1);
    if (i % 10 == 0) {
        /* Jobs may still submit while shutdown runs the pending work. */
        sp_job_desc d[PENDING_CHILDREN];
        for (int k = 0; k < PENDING_CHILDREN; k++) d[k] = jt_job(pending_child, NULL, "child");
        if (sp_jobs_submit(S, d, PENDING_CHILDREN, NULL) != SP_OK)
            atomic_fetch_sub(&child_runs, 1000);
    }
    if (i == PENDING - 1) sp_counter_sub(pending_gate, 1);
}

static void deferred_fn(void *arg) {
    (void)arg;
    atomic_fetch_add(&deferred_runs, 1);
}

/* Ends the sweep: everything pending runs in sp_jobs_shutdown; later calls are refused. */
static void test_shutdown(void) {
    atomic_store(&pending_runs, 0);
    atomic_store(&child_runs, 0);
    atomic_store(&deferred_runs, 0);
    pending_gate = counter("pending gate");
    sp_counter_add(pending_gate, 1);
    sp_job_desc dd[3];
    for (int i = 0; i < 3; i++) dd[i] = jt_job(deferred_fn, NULL, "deferred");
    bool sub = sp_jobs_submit_after(S, pending_gate, 0, dd, 3, NULL) == SP_OK;
    for (uintptr_t i = 0; i < PENDING; i++) {
        sp_job_desc d = jt_job(pending_fn, (void *)i, "pending");
        d.priority = (sp_job_priority)(i % 3);
        if (i % 7 == 0) {
            d.pinned = true;
            d.worker = (uint32_t)(i % (CFG->workers + 1));
        }
        sub &= sp_jobs_submit(S, &d, 1, NULL) == SP_OK;
    }
    sp_result rc = sp_jobs_shutdown(S);
    int want_children = (PENDING + 9) / 10 * PENDING_CHILDREN;
    ok(sub && rc == SP_OK, "%s: sp_jobs_shutdown with %d pending jobs returns SP_OK", cfg(),
       PENDING);
    ok(atomic_load(&pending_runs) == PENDING && atomic_load(&child_runs) == want_children &&
           atomic_load(&deferred_runs) == 3,
       "%s: shutdown ran every pending job (%d of %d), their children (%d of %d) and a deferred "
       "batch they released (%d of 3)",
       cfg(), atomic_load(&pending_runs), PENDING, atomic_load(&child_runs), want_children,
       atomic_load(&deferred_runs));
    sp_job_desc d = jt_job(deferred_fn, NULL, "late");
    sp_result late = sp_jobs_submit(S, &d, 1, NULL);
    sp_result late_after = sp_jobs_submit_after(S, pending_gate, 0, &d, 1, NULL);
    uint64_t calls = 0;
    static atomic_uchar late_visits[10];
    pf p = {.begin = 0, .end = 10, .visits = late_visits};
    sp_result late_pf = sp_parallel_for(S, 0, 10, 0, pf_body, &p);
    calls = atomic_load(&p.calls);
    ok(late == SP_ERR_SHUTDOWN && late_after == SP_ERR_SHUTDOWN && late_pf == SP_ERR_SHUTDOWN &&
           atomic_load(&deferred_runs) == 3 && calls == 0,
       "%s: after shutdown submit, submit_after and parallel_for return SP_ERR_SHUTDOWN (%s, %s, "
       "%s) and run nothing",
       cfg(), sp_result_name(late), sp_result_name(late_after), sp_result_name(late_pf));
    sp_counter *none = sp_counter_create(S, "late");
    ok(none == NULL, "%s: sp_counter_create after shutdown returns NULL", cfg());
    sp_counter_destroy(none);
    rc = sp_jobs_shutdown(S);
    ok(rc == SP_ERR_SHUTDOWN, "%s: a second sp_jobs_shutdown returns SP_ERR_SHUTDOWN (%s)", cfg(),
       sp_result_name(rc));
    sp_counter_destroy(pending_gate);
}

/* ---- one sweep ------------------------------------------------------------------------- */

/* Make one wait park for certain. Inline, a job that waits on its own child must park (the
 * child can only run once the job gives the main thread back). With workers, a job waits on a
 * gate the main thread opens only once the park hook has fired. */
static sp_counter *park_gate;
static void park_child(void *arg) {
    (void)arg;
}
static void park_fn(void *arg) {
    sp_result *rc = arg;
    if (CFG->no_workers) {
        sp_counter *c = sp_counter_create(S, "park child");
        sp_job_desc d = jt_job(park_child, NULL, "park child");
        *rc = c ? sp_jobs_submit(S, &d, 1, c) : SP_ERR_NOMEM;
        if (*rc == SP_OK) *rc = sp_counter_wait(c, 0);
        sp_counter_destroy(c);
    } else {
        *rc = sp_counter_wait(park_gate, 0);
    }
}

static void force_park(void) {
    unsigned long long before = atomic_load(&H.park);
    sp_counter *c = counter("park");
    park_gate = counter("park gate");
    sp_counter_add(park_gate, 1);
    sp_result rc = SP_ERR_CORRUPT;
    sp_job_desc d = jt_job(park_fn, &rc, "parker");
    bool sub = sp_jobs_submit(S, &d, 1, c) == SP_OK;
    bool parked = true;
    if (!CFG->no_workers) {
        uint64_t t0 = sp_time_ns();
        while (atomic_load(&H.park) == before &&
               sp_time_ns() - t0 < (uint64_t)JT_PATIENCE_MS * 1000000u)
            sp_thread_yield();
        parked = atomic_load(&H.park) > before;
    }
    sp_counter_sub(park_gate, 1);
    bool waited = sp_counter_wait(c, 0) == SP_OK;
    ok(sub && waited && rc == SP_OK && parked && atomic_load(&H.park) > before,
       "%s: a job whose wait cannot be satisfied yet parks (job_park hook fired)", cfg());
    sp_counter_destroy(park_gate);
    sp_counter_destroy(c);
}

static void status_check(void) {
    sp_jobs_status st;
    bool settled = jt_settle(S, &st);
    ok(settled && st.jobs_run == st.jobs_submitted,
       "%s: status: jobs_run == jobs_submitted (%llu, %llu)", cfg(),
       (unsigned long long)st.jobs_run, (unsigned long long)st.jobs_submitted);
    ok(st.workers == CFG->workers && st.fibers_total == FIBERS &&
           st.fibers_in_use <= st.fibers_total && st.jobs_stolen <= st.jobs_run,
       "%s: status: %u workers, fibers %u of %u in use, %llu stolen, %llu sleeps", cfg(),
       st.workers, st.fibers_in_use, st.fibers_total, (unsigned long long)st.jobs_stolen,
       (unsigned long long)st.sleeps);
    /* Hooks: begin and end once per job; park and resume once per parked wait. The hooks run
     * around the job, possibly after its counter was signalled: let them settle too. */
    uint64_t t0 = sp_time_ns();
    while ((atomic_load(&H.begin) != st.jobs_run || atomic_load(&H.end) != st.jobs_run ||
            atomic_load(&H.resume) != atomic_load(&H.park)) &&
           sp_time_ns() - t0 < (uint64_t)JT_PATIENCE_MS * 1000000u)
        sp_thread_yield();
    sp_jobs_status_get(S, &st);
    ok(atomic_load(&H.begin) == st.jobs_run && atomic_load(&H.end) == st.jobs_run,
       "%s: hooks: job_begin %llu and job_end %llu, once per job run (%llu)", cfg(),
       (unsigned long long)atomic_load(&H.begin), (unsigned long long)atomic_load(&H.end),
       (unsigned long long)st.jobs_run);
    /* status.parks also counts the main thread's waits outside jobs (its thread fiber parks
     * too), which fire no job hook: the job hooks can only be bounded by it. */
    ok(atomic_load(&H.park) > 0 && atomic_load(&H.park) == atomic_load(&H.resume) &&
           atomic_load(&H.park) <= st.parks && atomic_load(&H.fiber_switch) > 0,
       "%s: hooks: job_park %llu == job_resume %llu, at most status.parks %llu (fiber switches "
       "%llu)",
       cfg(), (unsigned long long)atomic_load(&H.park), (unsigned long long)atomic_load(&H.resume),
       (unsigned long long)st.parks, (unsigned long long)atomic_load(&H.fiber_switch));
    ok(atomic_load(&H.wrong_worker) == 0,
       "%s: hooks: every hook's worker argument is the calling thread's worker id (%llu wrong)",
       cfg(), (unsigned long long)atomic_load(&H.wrong_worker));
}

static void sweep(const jt_config *c) {
    CFG = c;
    hooks_reset();
    sp_jobs_desc desc = {
        .workers = c->workers,
        .no_workers = c->no_workers,
        .deque_size = DEQUE,
        .fibers = FIBERS,
        .hooks = {.job_begin = on_begin,
                  .job_end = on_end,
                  .job_park = on_park,
                  .job_resume = on_resume,
                  .worker_sleep = on_sleep,
                  .worker_wake = on_wake,
                  .fiber_switch = on_switch},
    };
    sp_result rc = sp_jobs_create(&S, &desc);
    ok(rc == SP_OK && S != NULL, "%s: sp_jobs_create (%s)", cfg(), sp_result_name(rc));
    if (rc != SP_OK) return;
    test_exactly_once();
    test_nested();
    test_after();
    test_signal();
    test_external_wait();
    test_parallel_for();
    test_nested_parallel_for();
    test_priority();
    test_pinned();
    force_park();
    status_check();
    test_shutdown();
    sp_jobs_destroy(S);
    S = NULL;
    ok(atomic_load(&H.sleep) == atomic_load(&H.wake),
       "%s: after shutdown every worker_sleep was followed by a worker_wake (%llu, %llu)", cfg(),
       (unsigned long long)atomic_load(&H.sleep), (unsigned long long)atomic_load(&H.wake));
    ok(jt_log_total() == 0, "%s: nothing was logged (%d records)", cfg(), jt_log_total());
    if (jt_log_total()) jt_log_diag();
    jt_log_reset();
}

/* ---- wait chains deeper than the fiber pool -------------------------------------------- */

enum { CHAIN = 200, CHAIN_FIBERS = 16 };

typedef struct chain_link {
    atomic_int runs;
    bool finished;   /* plain: written at the end of the job */
    bool child_seen; /* the child's `finished` seen after the wait */
    sp_result rc;
} chain_link;

static chain_link links[CHAIN];

static void link_fn(void *arg) {
    chain_link *l = arg;
    size_t i = (size_t)(l - links);
    atomic_fetch_add(&l->runs, 1);
    l->child_seen = true;
    if (i + 1 < CHAIN) {
        sp_counter *c = sp_counter_create(S, "chain");
        sp_job_desc d = jt_job(link_fn, &links[i + 1], "chain");
        l->rc = c ? sp_jobs_submit(S, &d, 1, c) : SP_ERR_NOMEM;
        if (l->rc == SP_OK) l->rc = sp_counter_wait(c, 0);
        l->child_seen = links[i + 1].finished;
        sp_counter_destroy(c);
    }
    l->finished = true;
}

/* After a wait chain (st: settled status), the loop fibers its waits left behind are spares:
 * the first sp_jobs_trim keeps them (none went unused over a whole interval yet), the second
 * gives them and their stacks back; a chain run again afterwards works, and the trim after it
 * keeps what that chain used. */
static void trim_check(sp_counter *done, sp_jobs_status st) {
    uint32_t t0 = sp_jobs_trim(S, 1000);
    sp_jobs_status a, b, c;
    sp_jobs_status_get(S, &a);
    uint32_t t1 = sp_jobs_trim(S, 1000);
    sp_jobs_status_get(S, &b);
    ok(st.fibers_spare >= CHAIN / 2 && t0 == 0 && a.fibers_spare == st.fibers_spare &&
           t1 == st.fibers_spare && b.fibers_spare == 0 &&
           b.fiber_stacks_used == a.fiber_stacks_used - t1 &&
           b.fibers_in_use == a.fibers_in_use - t1,
       "%s: trim: %u spares kept by the first call (%u given), given back by the second "
       "(%u; stacks used %u -> %u, in use %u -> %u)",
       cfg(), st.fibers_spare, t0, t1, a.fiber_stacks_used, b.fiber_stacks_used, a.fibers_in_use,
       b.fibers_in_use);
    memset(links, 0, sizeof links);
    sp_job_desc d = jt_job(link_fn, &links[0], "chain");
    bool again = sp_jobs_submit(S, &d, 1, done) == SP_OK && sp_counter_wait(done, 0) == SP_OK;
    int finished = 0;
    for (int i = 0; i < CHAIN; i++) finished += links[i].finished && links[i].rc == SP_OK;
    jt_settle(S, &c);
    uint32_t t2 = sp_jobs_trim(S, 1000);
    ok(again && finished == CHAIN && c.fiber_exhaustions == 0 && t2 == 0,
       "%s: trim: the chain runs again on the trimmed fibers (%d of %d links), and the trim "
       "after it keeps the %u spares it left (%u given)",
       cfg(), finished, CHAIN, c.fibers_spare, t2);
}

/* grow false: a fixed pool of CHAIN_FIBERS, the waits beyond it run jobs on their own stack;
 * true: the pool starts at CHAIN_FIBERS and doubles as waits need fibers, up to CHAIN_GROWN. */
enum { CHAIN_GROWN = 256 };
static void test_chain(const jt_config *c, bool grow) {
    CFG = c;
    memset(links, 0, sizeof links);
    jt_log_reset();
    /* The waits beyond a fixed pool run jobs on the waiting job's own stack, nested ~180
     * deep: give the stacks room for that (committed as touched). */
    sp_jobs_desc desc = {.workers = c->workers,
                         .no_workers = c->no_workers,
                         .fibers = CHAIN_FIBERS,
                         .fibers_max = grow ? CHAIN_GROWN : CHAIN_FIBERS,
                         .fiber_stack = grow ? 64u << 10 : 4u << 20};
    sp_result rc = sp_jobs_create(&S, &desc);
    if (rc != SP_OK) {
        ok(0, "%s: create with %d fibers (%s)", cfg(), CHAIN_FIBERS, sp_result_name(rc));
        return;
    }
    sp_counter *done = counter("chain root");
    sp_job_desc d = jt_job(link_fn, &links[0], "chain");
    bool sub = sp_jobs_submit(S, &d, 1, done) == SP_OK;
    bool waited = sp_counter_wait(done, 0) == SP_OK;
    int once = 0, seen = 0, rc_ok = 0;
    for (int i = 0; i < CHAIN; i++) {
        once += atomic_load(&links[i].runs) == 1;
        seen += links[i].child_seen;
        rc_ok += links[i].rc == SP_OK;
    }
    ok(sub && waited && once == CHAIN && seen == CHAIN && rc_ok == CHAIN,
       "%s: a wait chain %d deep on %s pool of %d fibers completes; each waiter saw its child "
       "finish",
       cfg(), CHAIN, grow ? "a growing" : "a fixed", CHAIN_FIBERS);
    sp_jobs_status st;
    bool settled = jt_settle(S, &st);
    int limit = jt_log_count(SP_ERR_LIMIT, -1), warn = jt_log_count(SP_ERR_LIMIT, SP_LOG_WARN);
    if (grow) {
        /* 200 waits parked at once: 16 -> 32 -> 64 -> 128 -> 256 fibers, never exhausted */
        ok(settled && st.fiber_exhaustions == 0 && st.fibers_total == CHAIN_GROWN &&
               jt_log_total() == 0,
           "%s: the pool grew to %u fibers (of at most %d), no wait ran out of them (%u), "
           "nothing logged (%d)",
           cfg(), st.fibers_total, CHAIN_GROWN, st.fiber_exhaustions, jt_log_total());
    } else {
        ok(settled && st.fiber_exhaustions > 0 && st.fibers_total == CHAIN_FIBERS,
           "%s: status.fiber_exhaustions %u > 0 (fibers_total %u)", cfg(), st.fiber_exhaustions,
           st.fibers_total);
        ok(limit == 1 && warn == 1,
           "%s: fiber exhaustion logged once, as a SP_ERR_LIMIT warning "
           "(%d records, %d warnings)",
           cfg(), limit, warn);
    }
    ok(st.jobs_run == st.jobs_submitted && st.jobs_run == CHAIN && sp_counter_value(done) == 0,
       "%s: chain: %llu of %llu jobs run, counter back to 0", cfg(),
       (unsigned long long)st.jobs_run, (unsigned long long)st.jobs_submitted);
    if (jt_log_total() != (grow ? 0 : 1)) jt_log_diag();
    if (grow) trim_check(done, st);
    sp_counter_destroy(done);
    ok(sp_jobs_shutdown(S) == SP_OK, "%s: chain scheduler shuts down", cfg());
    sp_jobs_destroy(S);
    S = NULL;
    jt_log_reset();
}

/* ---- pin_workers ------------------------------------------------------------------------- */

enum { PIN_WORKERS = 3 };

static void cpu_fn(void *arg) {
    ts_cpu_read(arg);
}

/* One scheduler of PIN_WORKERS workers (pin_workers: pin), made on a thread of its own whose
 * mask is `creator` (so the test's main thread keeps its mask whatever happens): where each
 * worker's thread_start hook ran (hooked[k]), and a job pinned to each worker and to the
 * creating thread (recs[k]). */
typedef struct pin_run {
    bool pin, ran;
    uint32_t pinned;
    cpu_set_t creator;
    ts_cpu hooked[PIN_WORKERS + 1], recs[PIN_WORKERS + 1];
} pin_run;

/* Whether every thread of run p (the creator and each worker) had mask m. */
static bool recs_all(const pin_run *p, const cpu_set_t *m) {
    bool all = p->ran;
    for (uint32_t k = 0; k <= PIN_WORKERS; k++) all &= CPU_EQUAL(&p->recs[k].mask, m);
    return all;
}

static void pin_hook(void *user, uint32_t worker) {
    pin_run *p = user;
    if (worker <= PIN_WORKERS) ts_cpu_read(&p->hooked[worker]);
}

static void *pin_thread(void *arg) {
    pin_run *p = arg;
    sp_jobs *s = NULL;
    sp_jobs_desc d = {.workers = PIN_WORKERS,
                      .pin_workers = p->pin,
                      .hooks = {.user = p, .thread_start = pin_hook}};
    if (sched_setaffinity(0, sizeof p->creator, &p->creator) != 0 ||
        sp_jobs_create(&s, &d) != SP_OK)
        return NULL;
    sp_jobs_status st;
    sp_jobs_status_get(s, &st);
    p->pinned = st.workers_pinned;
    sp_counter *c = sp_counter_create(s, "cpus");
    sp_job_desc jobs[PIN_WORKERS + 1];
    for (uint32_t k = 0; k <= PIN_WORKERS; k++) {
        jobs[k] = jt_job(cpu_fn, &p->recs[k], "cpu");
        jobs[k].pinned = true;
        jobs[k].worker = k;
    }
    p->ran =
        c && sp_jobs_submit(s, jobs, PIN_WORKERS + 1, c) == SP_OK && sp_counter_wait(c, 0) == SP_OK;
    sp_counter_destroy(c);
    sp_jobs_destroy(s);
    return NULL;
}

static void run_pinned(pin_run *p) {
    for (uint32_t k = 0; k <= PIN_WORKERS; k++)
        p->hooked[k] = p->recs[k] = (ts_cpu){.cpu = -1, .count = -1};
    pthread_t t;
    if (pthread_create(&t, NULL, pin_thread, p) == 0) pthread_join(t, NULL);
}

/* Linked with -Wl,--wrap=pthread_attr_setaffinity_np (tests/meson.build): while refuse_cpu
 * is set, every CPU is refused as the OS refuses one outside the process's cpuset. */
int __real_pthread_attr_setaffinity_np(pthread_attr_t *a, size_t bytes, const cpu_set_t *set);
int __wrap_pthread_attr_setaffinity_np(pthread_attr_t *a, size_t bytes, const cpu_set_t *set);
static atomic_int refuse_cpu;
int __wrap_pthread_attr_setaffinity_np(pthread_attr_t *a, size_t bytes, const cpu_set_t *set) {
    return atomic_load(&refuse_cpu) ? EINVAL : __real_pthread_attr_setaffinity_np(a, bytes, set);
}

/* Worker k runs only on sp_cpu_nth(k), its thread_start hook included, and the creating thread
 * stays as it was; without the flag nothing is pinned; a creating thread restricted to one CPU
 * puts every worker there; a CPU the OS refuses leaves the worker unpinned, logged, and create
 * succeeds. */
static void test_pin_workers(void) {
    ts_cpu self;
    if (!ts_cpu_read_or_skip(&self, 4)) return;
    const cpu_set_t all = self.mask;
    int n = self.count;
    pin_run p = {.pin = true, .creator = all};
    run_pinned(&p);
    bool right = true;
    for (uint32_t k = 1; k <= PIN_WORKERS; k++) {
        int want = sp_cpu_nth(k);
        for (int i = 0; i < 2; i++) {
            ts_cpu *r = i ? &p.recs[k] : &p.hooked[k];
            right &= ts_cpu_only(r, want);
            if (!ts_cpu_only(r, want))
                diag("  worker %u (%s): %d CPUs in its mask, ran on %d, want %d", k,
                     i ? "job" : "thread_start hook", r->count, r->cpu, want);
        }
    }
    ok(p.ran && p.pinned == PIN_WORKERS && right && CPU_EQUAL(&p.recs[0].mask, &all),
       "pin_workers: worker k runs only on sp_cpu_nth(k), from its thread_start hook on (%u "
       "workers, %d CPUs), all counted pinned; the creating thread's mask is left as it was",
       PIN_WORKERS, n);

    p = (pin_run){.pin = false, .creator = all};
    run_pinned(&p);
    ok(recs_all(&p, &all) && p.pinned == 0,
       "without pin_workers no thread is pinned (status: 0 pinned)");

    int last = sp_cpu_nth((uint32_t)n - 1);
    p = (pin_run){.pin = true};
    CPU_ZERO(&p.creator);
    CPU_SET(last, &p.creator);
    run_pinned(&p);
    ok(recs_all(&p, &p.creator) && p.pinned == PIN_WORKERS,
       "pin_workers from a thread allowed on CPU %d only: every worker pinned there", last);

    jt_log_reset();
    atomic_store(&refuse_cpu, 1);
    p = (pin_run){.pin = true, .creator = all};
    run_pinned(&p);
    atomic_store(&refuse_cpu, 0);
    int warned = jt_logged.by_id[-SP_ERR_OS][SP_LOG_WARN];
    ts_cpu now;
    ts_cpu_read(&now);
    ok(recs_all(&p, &all) && p.pinned == 0 && warned == PIN_WORKERS && now.count >= 0 &&
           CPU_EQUAL(&now.mask, &all),
       "pin_workers with every CPU refused: create succeeds, the workers run unpinned (status: "
       "%u pinned), one warning each (%d); the test's main thread's mask unchanged by the runs",
       p.pinned, warned);
    jt_log_reset();
}

int main(void) {
    jt_log_capture();
    jt_deadline("pin_workers", 30);
    test_pin_workers();
    for (int i = 0; i < JT_SWEEP; i++) {
        jt_deadline(jt_sweep[i].name, 60);
        sweep(&jt_sweep[i]);
    }
    for (int i = 0; i < JT_SWEEP; i++) {
        jt_deadline("wait chain deeper than the fiber pool", 60);
        test_chain(&jt_sweep[i], false);
        jt_deadline("wait chain on a pool that grows", 60);
        test_chain(&jt_sweep[i], true);
    }
    alarm(0);
    jt_log_release();
    return done();
}
