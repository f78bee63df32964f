/* The scheduler's failure paths (jobs/sp_jobs.h), in-process with misuse non-fatal (release
 * behaviour): bad arguments to create, submit, submit_after, parallel_for and wait are
 * reported through the logger with SP_ERR_INVALID_ARG and change nothing (all-or-nothing:
 * the counter and the status figures are untouched, no job of the batch runs); a second
 * scheduler on one thread is refused with SP_ERR_LIMIT while other threads may have their own;
 * running out of job records gives SP_ERR_LIMIT, all-or-nothing, and the records come back;
 * destroying a counter still in use is refused; shutdown abandons, and reports, work that can
 * never run. A destroyed counter is refused by every call that takes one (reported once, naming
 * the call; nothing changes), its memory is reused last (first-in first-out), counters signalled
 * and destroyed back to back are never taken for destroyed, and a counter the runtime keeps
 * cannot be destroyed (white-box: jobs_counter_keep, jobs_internal.h). Swept over the inline
 * mode and 2 workers. Then what an audit found (each fails with its fix undone): counters of
 * another scheduler, a batch waiting on its own counter, negative add/sub, destroy from another
 * thread or with stalled jobs, a sleep hook that signals, a deep fork-join tree. */
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "jobs_internal.h"
#include "jobs_support.h"

static sp_jobs *S;
static const jt_config *CFG;

static const char *cfg(void) {
    return CFG->name;
}

static atomic_int runs;

static void run_fn(void *arg) {
    (void)arg;
    atomic_fetch_add(&runs, 1);
}

static sp_counter *counter(const char *name) {
    return jt_counter(S, cfg(), name);
}

static sp_jobs_desc desc_for(const jt_config *c) {
    return (sp_jobs_desc){.workers = c->workers, .no_workers = c->no_workers};
}

/* A refused call: returned `want`, logged it once from `call`, and changed nothing. */
static bool refused(sp_result got, sp_result want, const char *call, int logged_before,
                    const sp_jobs_status *before, sp_counter *c, int64_t value_before) {
    sp_jobs_status now;
    sp_jobs_status_get(S, &now);
    bool logged = jt_log_total() == logged_before + 1 && jt_log_has(want, call, NULL);
    bool same =
        now.jobs_submitted == before->jobs_submitted && (!c || sp_counter_value(c) == value_before);
    if (got != want || !logged || !same) {
        diag("  got %s want %s; logged %d new record(s); submitted %llu -> %llu",
             sp_result_name(got), sp_result_name(want), jt_log_total() - logged_before,
             (unsigned long long)before->jobs_submitted, (unsigned long long)now.jobs_submitted);
        jt_log_diag();
    }
    return got == want && logged && same;
}

/* Start a test on configuration c with desc (desc_for(c), perhaps changed): S created, runs
 * at 0; false (a failed line) if create failed. scheduler_end shuts S down and destroys it. */
static bool scheduler_begin_desc(const jt_config *c, sp_jobs_desc desc) {
    CFG = c;
    if (sp_jobs_create(&S, &desc) != SP_OK) {
        ok(0, "%s: create", cfg());
        return false;
    }
    atomic_store(&runs, 0);
    return true;
}

static bool scheduler_begin(const jt_config *c) {
    return scheduler_begin_desc(c, desc_for(c));
}

/* S with one worker whose worker_sleep hook is `hook`; false (a failed line) if create failed. */
static bool begin_with_sleep_hook(void (*hook)(void *user, uint32_t worker)) {
    return scheduler_begin_desc(&jt_sweep[2],
                                (sp_jobs_desc){.workers = 1, .hooks = {.worker_sleep = hook}});
}

static void scheduler_end(void) {
    sp_jobs_shutdown(S);
    sp_jobs_destroy(S);
    S = NULL;
}

/* ---- create ---------------------------------------------------------------------------- */

typedef struct other {
    sp_result create_rc, submit_rc, wait_rc, shutdown_rc;
    uint32_t id_in_job;
    int ran;
} other;

static void other_job(void *arg) {
    other *o = arg;
    o->id_in_job = sp_jobs_worker_id();
    o->ran++;
}

/* A second thread runs a scheduler of its own while the main thread has one. */
static void *other_thread(void *arg) {
    other *o = arg;
    sp_jobs *mine = NULL;
    sp_jobs_desc d = {.no_workers = true};
    o->create_rc = sp_jobs_create(&mine, &d);
    if (o->create_rc != SP_OK) return NULL;
    sp_counter *c = sp_counter_create(mine, "other");
    sp_job_desc j = jt_job(other_job, o, "other");
    o->submit_rc = c ? sp_jobs_submit(mine, &j, 1, c) : SP_ERR_NOMEM;
    o->wait_rc = c ? sp_counter_wait(c, 0) : SP_ERR_NOMEM;
    sp_counter_destroy(c);
    o->shutdown_rc = sp_jobs_shutdown(mine);
    sp_jobs_destroy(mine);
    return NULL;
}

/* The report from `depth` frames of 1 KiB down: a job that has used some of its stack (with
 * the old fprintf logger, 6 KiB of it was enough to overflow 16 KiB). */
static SP_NOINLINE void report_deep(int depth) {
    volatile char pad[1024];
    pad[0] = (char)depth;
    if (depth > 0)
        report_deep(depth - 1);
    else
        sp_counter_add(NULL, 1);
    pad[1023] = pad[0];
}

static void null_add_job(void *arg) {
    (void)arg;
    report_deep(ts_sanitized() ? 0 : 6); /* sanitizers' frames are larger: no padding there */
}

/* A misuse report from jobs on the smallest fiber stack, with the default (stderr) logger: the
 * library's own path must fit (glibc's fprintf to stderr took 8 KiB of the stack, and an 8 KiB
 * stack, accepted then, overflowed into its guard page). */
static void small_stack_child(void *arg) {
    (void)arg;
    sp_misuse_set_fatal(false);
    sp_jobs *s = NULL;
    if (sp_jobs_create(&s, &(sp_jobs_desc){.workers = 1, .fiber_stack = 16 << 10}) != SP_OK)
        _exit(3);
    sp_counter *k = sp_counter_create(s, "k");
    sp_job_desc j[8];
    for (int i = 0; i < 8; i++) j[i] = (sp_job_desc){.fn = null_add_job, .name = "null add"};
    sp_jobs_submit(s, j, 8, k);
    sp_counter_wait(k, 0);
    sp_counter_destroy(k);
    sp_jobs_destroy(s);
}

static void test_create(void) {
    sp_jobs_desc d = {.no_workers = true};
    sp_jobs_desc tiny = {.no_workers = true, .fiber_stack = 8 << 10};
    sp_jobs *tiny_s = NULL;
    jt_log_reset();
    sp_result tiny_rc = sp_jobs_create(&tiny_s, &tiny);
    if (tiny_s) sp_jobs_destroy(tiny_s);
    ok(tiny_rc == SP_ERR_INVALID_ARG && tiny_s == NULL && jt_log_count(SP_ERR_INVALID_ARG, -1) == 1,
       "fiber_stack 8 KiB (below 16 KiB): SP_ERR_INVALID_ARG, logged (%s)",
       sp_result_name(tiny_rc));
    static char text[16384];
    int status = ts_child(small_stack_child, NULL, text, sizeof text);
    ok(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0 &&
           strstr(text, "sp_counter_add") != NULL,
       "16 KiB fiber stacks: misuse reports from 8 jobs 6 KiB down their stacks go to stderr, "
       "no crash (status %d)",
       status);
    jt_log_reset();
    ok(sp_jobs_create(NULL, &d) == SP_ERR_INVALID_ARG && jt_log_count(SP_ERR_INVALID_ARG, -1) == 1,
       "sp_jobs_create(NULL out): SP_ERR_INVALID_ARG, logged");
    sp_jobs *s = NULL;
    sp_jobs_desc big = {.no_workers = true, .fiber_stack = SIZE_MAX / 2};
    jt_log_reset();
    sp_result big_rc = sp_jobs_create(&s, &big);
    ok(big_rc == SP_ERR_INVALID_ARG && s == NULL && jt_log_count(SP_ERR_INVALID_ARG, -1) == 1,
       "fiber_stack SIZE_MAX / 2 (above 1 GiB): SP_ERR_INVALID_ARG, logged (%s; it was an "
       "undocumented SP_ERR_OVERFLOW)",
       sp_result_name(big_rc));
    jt_log_reset();
    uint64_t runs_null = sp_jobs_run_count(NULL);
    bool idle_null = sp_jobs_idle(NULL);
    sp_result shut_null = sp_jobs_shutdown(NULL);
    uint32_t trim_null = sp_jobs_trim(NULL, 1);
    ok(runs_null == 0 && !idle_null && shut_null == SP_ERR_INVALID_ARG && trim_null == 0 &&
           jt_log_count(SP_ERR_INVALID_ARG, -1) == 4 &&
           jt_log_has(SP_ERR_INVALID_ARG, "sp_jobs_run_count", NULL) &&
           jt_log_has(SP_ERR_INVALID_ARG, "sp_jobs_idle", NULL) &&
           jt_log_has(SP_ERR_INVALID_ARG, "sp_jobs_shutdown", NULL),
       "run_count, idle, shutdown and trim of a NULL scheduler: 0, false, SP_ERR_INVALID_ARG, 0, "
       "each reported (they crashed, or said nothing)");
    d.deque_size = 100;
    jt_log_reset();
    sp_result rc = sp_jobs_create(&s, &d);
    ok(rc == SP_ERR_INVALID_ARG && jt_log_count(SP_ERR_INVALID_ARG, -1) == 1,
       "deque_size 100 (not a power of two): SP_ERR_INVALID_ARG, logged (%s)", sp_result_name(rc));
    if (rc == SP_OK) sp_jobs_destroy(s);

    d.deque_size = 0;
    rc = sp_jobs_create(&S, &d);
    ok(rc == SP_OK, "a scheduler on the main thread");
    if (rc != SP_OK) return;
    sp_jobs *second = NULL;
    jt_log_reset();
    rc = sp_jobs_create(&second, &d);
    ok(rc == SP_ERR_LIMIT, "a second scheduler on the same thread: SP_ERR_LIMIT (%s)",
       sp_result_name(rc));
    if (rc == SP_OK) sp_jobs_destroy(second);

    static other o;
    sp_thread t;
    bool started = sp_thread_start(&t, other_thread, &o, "jt-other") == SP_OK;
    if (started) sp_thread_join(t);
    ok(started && o.create_rc == SP_OK && o.submit_rc == SP_OK && o.wait_rc == SP_OK &&
           o.shutdown_rc == SP_OK && o.ran == 1 && o.id_in_job == 0,
       "another thread runs a scheduler of its own meanwhile (its job saw worker id %u)",
       o.id_in_job);
    ok(sp_jobs_shutdown(S) == SP_OK, "shut down the first");
    sp_jobs_destroy(S);
    S = NULL;
    rc = sp_jobs_create(&S, &d);
    ok(rc == SP_OK, "after destroy, the main thread may create a scheduler again (%s)",
       sp_result_name(rc));
    if (rc == SP_OK) {
        sp_jobs_shutdown(S);
        sp_jobs_destroy(S);
        S = NULL;
    }
}

/* ---- misuse ---------------------------------------------------------------------------- */

typedef struct in_job {
    sp_result rc;
} in_job;

static void misuse_in_job(void *arg) {
    in_job *ij = arg;
    sp_job_desc bad = {.fn = NULL};
    ij->rc = sp_jobs_submit(S, &bad, 1, NULL);
}

static void test_misuse(const jt_config *c) {
    if (!scheduler_begin(c)) return;
    sp_counter *ctr = counter("misuse");
    sp_jobs_status st;
    sp_jobs_status_get(S, &st);
    int lb;

    sp_job_desc three[3] = {
        jt_job(run_fn, NULL, "good"), {.fn = NULL, .name = "no fn"}, jt_job(run_fn, NULL, "good")};
    lb = jt_log_total();
    ok(refused(sp_jobs_submit(S, three, 3, ctr), SP_ERR_INVALID_ARG, "sp_jobs_submit", lb, &st, ctr,
               0),
       "%s: a batch with a NULL fn: SP_ERR_INVALID_ARG, logged, counter and status unchanged",
       cfg());

    sp_job_desc pinned[2] = {jt_job(run_fn, NULL, "good"), jt_job(run_fn, NULL, "far")};
    pinned[1].pinned = true;
    pinned[1].worker = c->workers + 1;
    lb = jt_log_total();
    ok(refused(sp_jobs_submit(S, pinned, 2, ctr), SP_ERR_INVALID_ARG, "sp_jobs_submit", lb, &st,
               ctr, 0),
       "%s: a job pinned to worker %u (of 0..%u): SP_ERR_INVALID_ARG, logged, nothing submitted",
       cfg(), c->workers + 1, c->workers);

    lb = jt_log_total();
    ok(refused(sp_jobs_submit(S, NULL, 2, ctr), SP_ERR_INVALID_ARG, "sp_jobs_submit", lb, &st, ctr,
               0),
       "%s: NULL jobs with count 2: SP_ERR_INVALID_ARG, logged", cfg());
    lb = jt_log_total();
    ok(refused(sp_jobs_submit(NULL, three, 1, ctr), SP_ERR_INVALID_ARG, "sp_jobs_submit", lb, &st,
               ctr, 0),
       "%s: NULL scheduler: SP_ERR_INVALID_ARG, logged", cfg());

    sp_counter *gate = counter("misuse gate");
    lb = jt_log_total();
    ok(refused(sp_jobs_submit_after(S, gate, 0, three, 3, ctr), SP_ERR_INVALID_ARG,
               "sp_jobs_submit_after", lb, &st, ctr, 0),
       "%s: submit_after with a NULL fn: SP_ERR_INVALID_ARG, logged, counter unchanged", cfg());

    lb = jt_log_total();
    sp_result pf = sp_parallel_for(S, 0, 100, 0, NULL, NULL);
    ok(refused(pf, SP_ERR_INVALID_ARG, "sp_parallel_for", lb, &st, NULL, 0),
       "%s: parallel_for with a NULL fn: SP_ERR_INVALID_ARG, logged", cfg());

    lb = jt_log_total();
    sp_result w = sp_counter_wait(NULL, 0);
    ok(refused(w, SP_ERR_INVALID_ARG, "sp_counter_wait", lb, &st, NULL, 0),
       "%s: sp_counter_wait(NULL): SP_ERR_INVALID_ARG, logged", cfg());

    lb = jt_log_total();
    ok(sp_jobs_submit(S, NULL, 0, ctr) == SP_OK && sp_counter_value(ctr) == 0 &&
           jt_log_total() == lb,
       "%s: count 0 is SP_OK and does nothing", cfg());

    /* Misuse from inside a job is reported there too, and the job goes on. */
    in_job ij = {SP_OK};
    sp_job_desc j = jt_job(misuse_in_job, &ij, "misuser");
    lb = jt_log_total();
    bool sub = sp_jobs_submit(S, &j, 1, ctr) == SP_OK && sp_counter_wait(ctr, 0) == SP_OK;
    ok(sub && ij.rc == SP_ERR_INVALID_ARG && jt_log_has(SP_ERR_INVALID_ARG, "sp_jobs_submit", NULL),
       "%s: a NULL fn submitted from a job: SP_ERR_INVALID_ARG there, logged (%s)", cfg(),
       sp_result_name(ij.rc));

    /* State intact: the good jobs of refused batches never ran; a good batch runs. */
    ok(atomic_load(&runs) == 0, "%s: no job of a refused batch ran (%d)", cfg(),
       atomic_load(&runs));
    bool good = sp_jobs_submit(S, three, 1, ctr) == SP_OK && sp_counter_wait(ctr, 0) == SP_OK;
    ok(good && atomic_load(&runs) == 1, "%s: the scheduler still works", cfg());

    /* Destroying a counter that a deferred batch holds: reported, ignored, counter kept. */
    sp_counter_add(gate, 1);
    sub = sp_jobs_submit_after(S, gate, 0, three, 1, ctr) == SP_OK;
    lb = jt_log_total();
    sp_counter_destroy(gate);
    jt_record last;
    bool logged = jt_log_total() == lb + 1 && jt_log_last(&last) &&
                  strcmp(last.call, "sp_counter_destroy") == 0;
    sp_counter_sub(gate, 1);
    bool waited = sp_counter_wait(ctr, 0) == SP_OK;
    ok(sub && logged && waited && atomic_load(&runs) == 2 && sp_counter_value(gate) == 0,
       "%s: destroying a counter a deferred batch waits on is reported and ignored; the batch "
       "still runs once it is signalled",
       cfg());
    if (!logged) jt_log_diag();
    if (logged) diag("  sp_counter_destroy in use reported as %s", sp_result_name(last.id));

    sp_jobs_status end;
    bool settled = jt_settle(S, &end);
    ok(settled && end.jobs_run == end.jobs_submitted && end.jobs_submitted == st.jobs_submitted + 3,
       "%s: status: %llu submitted (the refused batches not counted), all run", cfg(),
       (unsigned long long)end.jobs_submitted);
    sp_counter_destroy(gate);
    sp_counter_destroy(ctr);
    scheduler_end();
}

/* ---- destroyed and kept counters ------------------------------------------------------- */

/* A call on a destroyed counter: reported once, from `call`, as a destroyed counter; and the
 * counter itself left as destroy left it (white-box: dead, value 0, no waiter). */
static bool dead_refused(const char *call, int logged_before, const sp_counter *dead) {
    bool logged =
        jt_log_total() == logged_before + 1 && jt_log_has(SP_ERR_INVALID_ARG, call, "destroyed");
    bool same = !atomic_load(&dead->live) && atomic_load(&dead->value) == 0 &&
                atomic_load(&dead->waiters) == NULL;
    if (!logged || !same) {
        diag("  %d new record(s); live %d value %lld", jt_log_total() - logged_before,
             (int)atomic_load(&dead->live), (long long)atomic_load(&dead->value));
        jt_log_diag();
    }
    return logged && same;
}

static size_t free_counters(void) { /* white-box: the scheduler's free list (nothing creates) */
    size_t n = 0;
    for (const sp_counter *f = S->counter_free; f; f = f->next_free) n++;
    return n;
}

/* Every call that takes a counter, given a destroyed one (`live` is another, at 0). */
enum {
    DEAD_ADD,
    DEAD_SUB,
    DEAD_VALUE,
    DEAD_WAIT,
    DEAD_SUBMIT,
    DEAD_AFTER,
    DEAD_AFTER_COUNTER,
    DEAD_N
};
static const struct {
    const char *call, *what;
} dead_calls[DEAD_N] = {
    {"sp_counter_add", "sp_counter_add on it"},
    {"sp_counter_sub", "sp_counter_sub on it"},
    {"sp_counter_value", "sp_counter_value on it (0)"},
    {"sp_counter_wait", "sp_counter_wait on it (returns at once, nothing waits)"},
    {"sp_jobs_submit", "sp_jobs_submit with it as `counter` (nothing submitted)"},
    {"sp_jobs_submit_after", "sp_jobs_submit_after with it as `after` (nothing submitted, "
                             "`counter` unchanged)"},
    {"sp_jobs_submit_after", "sp_jobs_submit_after with it as `counter` (nothing submitted)"},
};

/* What the call answered: its result; add and sub: SP_ERR_INVALID_ARG; value: that when 0. */
static sp_result dead_call(int op, sp_counter *dead, sp_counter *live) {
    sp_job_desc j = jt_job(run_fn, NULL, "never runs");
    switch (op) {
    case DEAD_ADD: sp_counter_add(dead, 5); return SP_ERR_INVALID_ARG;
    case DEAD_SUB: sp_counter_sub(dead, 1); return SP_ERR_INVALID_ARG;
    case DEAD_VALUE: return sp_counter_value(dead) == 0 ? SP_ERR_INVALID_ARG : SP_OK;
    case DEAD_WAIT: return sp_counter_wait(dead, 0);
    case DEAD_SUBMIT: return sp_jobs_submit(S, &j, 1, dead);
    case DEAD_AFTER: return sp_jobs_submit_after(S, dead, 0, &j, 1, live);
    default: return sp_jobs_submit_after(S, live, 0, &j, 1, dead);
    }
}

static void test_destroyed(const jt_config *c) {
    if (!scheduler_begin(c)) return;
    sp_counter *ctr = counter("destroyed: live"), *dead = counter("destroyed");
    sp_jobs_status st;
    sp_jobs_status_get(S, &st);
    int lb = jt_log_total();
    sp_counter_destroy(dead);
    ok(jt_log_total() == lb, "%s: a counter at 0 is destroyed silently", cfg());
    for (int op = 0; op < DEAD_N; op++) {
        lb = jt_log_total();
        sp_result rc = dead_call(op, dead, ctr);
        ok(refused(rc, SP_ERR_INVALID_ARG, dead_calls[op].call, lb, &st, ctr, 0) &&
               dead_refused(dead_calls[op].call, lb, dead),
           "%s: %s: SP_ERR_INVALID_ARG, reported once, nothing changed", cfg(),
           dead_calls[op].what);
    }
    lb = jt_log_total();
    sp_counter_destroy(dead);
    ok(jt_log_total() == lb + 1 && jt_log_has(SP_ERR_DOUBLE_FREE, "sp_counter_destroy", NULL),
       "%s: destroyed again: SP_ERR_DOUBLE_FREE, reported", cfg());

    /* The audit's hang: an add on the stale pointer used to raise the next counter made. */
    size_t free_before = free_counters();
    lb = jt_log_total();
    sp_counter *next = counter("destroyed: next");
    sp_counter_add(dead, 5);
    int64_t v = sp_counter_value(next);
    sp_result rc = sp_counter_wait(next, 0);
    ok(next != dead && v == 0 && rc == SP_OK && jt_log_total() == lb + 1,
       "%s: the counter made next is another one (%zu free before), starts at 0 (%lld) and its "
       "wait returns (%s)",
       cfg(), free_before, (long long)v, sp_result_name(rc));

    /* FIFO: the destroyed counter comes back only after every other free one. */
    sp_counter *made[2 * COUNTER_CHUNK];
    size_t n = 0, back = SIZE_MAX;
    while (n < SP_ARRAY_LEN(made) && back == SIZE_MAX) {
        made[n] = counter("destroyed: refill");
        if (made[n] == dead) back = n;
        n++;
    }
    size_t others = free_before - 1; /* free besides it: `next` and made[0, back) */
    ok(back != SIZE_MAX && 1 + back == others && sp_counter_value(dead) == 0 &&
           jt_log_total() == lb + 1,
       "%s: its memory is reused last (after %zu of the %zu other free counters): a live counter "
       "at 0 again",
       cfg(), back == SIZE_MAX ? 0 : 1 + back, others);
    for (size_t i = 0; i < n; i++) sp_counter_destroy(made[i]);
    sp_counter_destroy(next);

    ok(atomic_load(&runs) == 0 && jt_settle(S, &st) && st.jobs_submitted == 0,
       "%s: no job of the refused submits ran", cfg());
    sp_counter_destroy(ctr);
    scheduler_end();
}

/* Counters signalled from jobs and destroyed as soon as their wait returns, back to back (each
 * job adds, then lowers below what it added): no call is taken for one on a destroyed counter. */
enum { CHURN = 2000 };

static void churn_fn(void *arg) {
    sp_counter *c = arg;
    sp_counter_add(c, 1);
    (void)sp_counter_value(c);
    sp_counter_sub(c, 2);
}

static void test_destroy_churn(const jt_config *c) {
    if (!scheduler_begin(c)) return;
    int lb = jt_log_total();
    bool all = true;
    for (int i = 0; i < CHURN && all; i++) {
        sp_counter *k = counter("churn");
        sp_counter_add(k, 1);
        sp_job_desc j = jt_job(churn_fn, k, "churn");
        all = sp_jobs_submit(S, &j, 1, NULL) == SP_OK && sp_counter_wait(k, 0) == SP_OK;
        sp_counter_destroy(k);
    }
    ok(all && jt_log_total() == lb,
       "%s: %d counters signalled by a job and destroyed once reached: nothing reported", cfg(),
       CHURN);
    if (jt_log_total() != lb) jt_log_diag();
    scheduler_end();
}

static void test_kept(const jt_config *c) {
    if (!scheduler_begin(c)) return;
    sp_counter *k = counter("kept");
    jobs_counter_keep(k, true);
    int lb = jt_log_total();
    sp_counter_destroy(k);
    ok(jt_log_total() == lb + 1 &&
           jt_log_has(SP_ERR_INVALID_ARG, "sp_counter_destroy", "belongs to the runtime") &&
           atomic_load(&k->live),
       "%s: destroying a counter the runtime keeps: SP_ERR_INVALID_ARG, reported, kept", cfg());
    sp_job_desc j = jt_job(run_fn, NULL, "on kept");
    bool works = sp_jobs_submit(S, &j, 1, k) == SP_OK && sp_counter_wait(k, 0) == SP_OK;
    ok(works && atomic_load(&runs) == 1 && sp_counter_value(k) == 0 && jt_log_total() == lb + 1,
       "%s: the kept counter still works", cfg());
    jobs_counter_keep(k, false);
    lb = jt_log_total();
    sp_counter_destroy(k);
    ok(jt_log_total() == lb && !atomic_load(&k->live),
       "%s: handed back (keep false), it is destroyed silently", cfg());
    scheduler_end();
}

/* ---- running out of job records -------------------------------------------------------- */

enum { MAX_JOBS = 64 };

typedef struct starved {
    sp_result rc;
    int64_t counter_after;
    sp_counter *c;
} starved;

static void starved_fn(void *arg) {
    starved *sv = arg;
    sp_job_desc d = jt_job(run_fn, NULL, "child");
    sv->rc = sp_jobs_submit(S, &d, 1, sv->c);
    sv->counter_after = sp_counter_value(sv->c);
}

static atomic_uchar pf_visits[1000];

static void pf_mark(void *arg, uint64_t b, uint64_t e) {
    (void)arg;
    for (uint64_t i = b; i < e; i++) atomic_fetch_add(&pf_visits[i], 1);
}

static void test_limit(const jt_config *c) {
    sp_jobs_desc desc = desc_for(c);
    desc.max_jobs = MAX_JOBS;
    if (!scheduler_begin_desc(c, desc)) return;
    sp_counter *gate = counter("limit gate"), *ctr = counter("limit");
    sp_counter_add(gate, 1);
    /* Mixed priorities: such a batch takes a record per job (a same-priority batch shares one
     * record among its pieces, see max_jobs in sp_jobs.h). */
    sp_job_desc d[MAX_JOBS];
    for (int i = 0; i < MAX_JOBS; i++) {
        d[i] = jt_job(run_fn, NULL, "held");
        d[i].priority = i % 2 ? SP_PRIORITY_HIGH : SP_PRIORITY_NORMAL;
    }

    /* Deferred batches hold their records until they run. */
    bool sub = sp_jobs_submit_after(S, gate, 0, d, 40, ctr) == SP_OK;
    int lb = jt_log_total();
    sp_result over = sp_jobs_submit_after(S, gate, 0, d, 30, ctr);
    ok(sub && over == SP_ERR_LIMIT && sp_counter_value(ctr) == 40 &&
           jt_log_has(SP_ERR_LIMIT, NULL, NULL) && jt_log_total() > lb,
       "%s: 40 of %d records held, a batch of 30: SP_ERR_LIMIT, logged, counter unchanged (%lld)",
       cfg(), MAX_JOBS, (long long)sp_counter_value(ctr));
    sub = sp_jobs_submit_after(S, gate, 0, d, 23, ctr) == SP_OK;
    ok(sub && sp_counter_value(ctr) == 63, "%s: a batch of 23 fits (63 of %d held)", cfg(),
       MAX_JOBS);

    /* The last record goes to a job that tries to submit one more: refused there. */
    starved sv = {.rc = SP_OK, .c = ctr};
    sp_job_desc sj = jt_job(starved_fn, &sv, "starved");
    sp_counter *sc = counter("starved"), *g2 = counter("starved gate");
    sp_counter_add(g2, 1);
    sub = sp_jobs_submit_after(S, g2, 0, &sj, 1, sc) == SP_OK;
    sp_result full = sp_jobs_submit(S, d, 1, NULL);
    sp_counter_sub(g2, 1);
    bool waited = sp_counter_wait(sc, 0) == SP_OK;
    ok(sub && full == SP_ERR_LIMIT && waited && sv.rc == SP_ERR_LIMIT && sv.counter_after == 63,
       "%s: all %d records in use: SP_ERR_LIMIT from the main thread (%s) and from a job (%s), "
       "counter unchanged",
       cfg(), MAX_JOBS, sp_result_name(full), sp_result_name(sv.rc));

    /* parallel_for with every record held: the caller does the work. Once the starved job
     * has finished (status settled) its record is free again: a deferred job takes it. */
    memset(pf_visits, 0, sizeof pf_visits);
    sp_jobs_status st;
    bool settled = false; /* the starved job is the only one that can have run */
    for (uint64_t t0 = sp_time_ns(); !settled && sp_time_ns() - t0 < 20000000000u;
         sp_thread_yield()) {
        sp_jobs_status_get(S, &st);
        settled = st.jobs_run == 1;
    }
    sp_counter_add(sc, 1);
    sp_job_desc hold = jt_job(run_fn, NULL, "hold");
    sp_result hold_rc = sp_jobs_submit_after(S, sc, 0, &hold, 1, NULL);
    ok(settled && hold_rc == SP_OK,
       "%s: a finished job's record is free again: the 64th record taken by a deferred job (%s)",
       cfg(), sp_result_name(hold_rc));
    sp_result prc = sp_parallel_for(S, 0, 1000, 10, pf_mark, NULL);
    bool once = true;
    for (int i = 0; i < 1000; i++) once &= atomic_load(&pf_visits[i]) == 1;
    ok((prc == SP_OK || prc == SP_ERR_LIMIT) && once,
       "%s: parallel_for with every record held still covers its range once, on the caller (%s)",
       cfg(), sp_result_name(prc));

    sp_counter_sub(gate, 1);
    sp_counter_sub(sc, 1);
    waited = sp_counter_wait(ctr, 0) == SP_OK;
    sp_jobs_status_get(S, &st);
    jt_settle(S, &st);
    ok(waited && atomic_load(&runs) == 63 + (hold_rc == SP_OK),
       "%s: released, the 63 deferred jobs and the held one ran (%d runs)", cfg(),
       atomic_load(&runs));

    /* Records come back: a full max_jobs batch fits again. */
    sp_jobs_status end;
    jt_settle(S, &end);
    sp_result again = sp_jobs_submit(S, d, MAX_JOBS, ctr);
    waited = sp_counter_wait(ctr, 0) == SP_OK;
    ok(again == SP_OK && waited, "%s: once the jobs finished, %d records are free again (%s)",
       cfg(), MAX_JOBS, sp_result_name(again));
    settled = jt_settle(S, &end);
    ok(settled && end.jobs_run == end.jobs_submitted && sp_counter_value(ctr) == 0 &&
           sp_counter_value(gate) == 0,
       "%s: status: every submitted job ran (%llu), counters at 0", cfg(),
       (unsigned long long)end.jobs_run);
    sp_counter_destroy(sc);
    sp_counter_destroy(g2);
    sp_counter_destroy(gate);
    sp_counter_destroy(ctr);
    scheduler_end();
}

/* ---- shutdown with work that can never run --------------------------------------------- */

static sp_counter *never;
static atomic_int waiter_done;

static void never_waiter(void *arg) {
    (void)arg;
    sp_counter_wait(never, 0);
    atomic_fetch_add(&waiter_done, 1);
}

static void test_stalled_shutdown(const jt_config *c) {
    sp_jobs_desc desc = desc_for(c);
    desc.watchdog_ms = UINT32_MAX; /* only shutdown's own report is wanted here */
    if (!scheduler_begin_desc(c, desc)) return;
    atomic_store(&waiter_done, 0);
    never = counter("never-signalled");
    sp_counter_add(never, 1);
    sp_job_desc d = jt_job(run_fn, NULL, "deferred forever");
    sp_job_desc w = jt_job(never_waiter, NULL, "waits forever");
    bool sub = sp_jobs_submit_after(S, never, 0, &d, 1, NULL) == SP_OK &&
               sp_jobs_submit(S, &w, 1, NULL) == SP_OK;
    jt_log_reset();
    sp_result rc = sp_jobs_shutdown(S);
    int stalled = jt_log_count(SP_ERR_STALLED, -1);
    ok(sub && stalled >= 1,
       "%s: shutdown returns (%s) with a deferred batch and a parked wait nothing can complete, "
       "and reports SP_ERR_STALLED (%d records)",
       cfg(), sp_result_name(rc), stalled);
    ok(atomic_load(&runs) == 0 && atomic_load(&waiter_done) == 0,
       "%s: the abandoned jobs did not run on", cfg());
    if (!jt_log_has(SP_ERR_STALLED, NULL, "never-signalled"))
        diag("  note: no SP_ERR_STALLED message names the counter");
    int lb = jt_log_total();
    sp_counter_destroy(never);
    if (jt_log_total() != lb) {
        diag("  note: sp_counter_destroy after shutdown of a counter with abandoned work was "
             "reported:");
        jt_log_diag();
    }
    sp_jobs_destroy(S);
    S = NULL;
}

/* ---- a batch without a counter whose jobs wait ------------------------------------------ */

static sp_counter *nc_gate;
static atomic_int nc_done;

static void nc_fn(void *arg) {
    if ((intptr_t)arg & 1) sp_counter_wait(nc_gate, 0); /* the piece gives its rest back */
    atomic_fetch_add(&nc_done, 1);
}

static void test_no_counter_waits(const jt_config *c) {
    if (!scheduler_begin(c)) return;
    atomic_store(&nc_done, 0);
    nc_gate = counter("no-counter gate");
    sp_counter_add(nc_gate, 1);
    sp_job_desc d[8];
    for (intptr_t i = 0; i < 8; i++) d[i] = jt_job(nc_fn, (void *)i, "no counter");
    bool sub = sp_jobs_submit(S, d, 8, NULL) == SP_OK;
    sp_counter_sub(nc_gate, 1);
    sp_result r = sp_jobs_shutdown(S);
    ok(sub && r == SP_OK && atomic_load(&nc_done) == 8,
       "%s: a batch submitted without a counter, half its jobs waiting: all 8 ran (%d), shutdown "
       "%s",
       cfg(), atomic_load(&nc_done), sp_result_name(r));
    sp_counter_destroy(nc_gate);
    sp_jobs_destroy(S);
    S = NULL;
}

/* ---- found by an audit: foreign counters, self edges, negative n, destroy misuse, a sleep
 * hook that signals, the name of an abandoned batch job, deep fork-join without fibers ---- */

static atomic_int foreign_stage;
static sp_counter *foreign_c;

static void *foreign_owner(void *arg) { /* a thread with its own scheduler B and a counter */
    (void)arg;
    sp_jobs *b = NULL;
    sp_jobs_desc d = {.no_workers = true, .watchdog_ms = UINT32_MAX};
    if (sp_jobs_create(&b, &d) == SP_OK) foreign_c = sp_counter_create(b, "B's counter");
    atomic_store(&foreign_stage, 1);
    while (atomic_load(&foreign_stage) != 2) sp_thread_yield();
    if (b) {
        sp_counter_destroy(foreign_c);
        sp_jobs_destroy(b);
    }
    return NULL;
}

static void *destroy_elsewhere(void *arg) {
    sp_jobs_destroy(arg);
    return NULL;
}

static void test_audit_misuse(const jt_config *c) {
    if (!scheduler_begin(c)) return;
    sp_jobs_status before;
    sp_job_desc j = jt_job(run_fn, NULL, "misuse");
    /* a counter of another scheduler, as counter and as after */
    sp_thread t;
    atomic_store(&foreign_stage, 0);
    sp_thread_start(&t, foreign_owner, NULL, "sp-foreign");
    jt_poll_int(&foreign_stage, 1);
    sp_jobs_status_get(S, &before);
    int lb = jt_log_total();
    sp_result r = foreign_c ? sp_jobs_submit(S, &j, 1, foreign_c) : SP_ERR_NOMEM;
    ok(refused(r, SP_ERR_INVALID_ARG, "sp_jobs_submit", lb, &before, NULL, 0),
       "%s: submit with another scheduler's counter: refused, nothing submitted", cfg());
    lb = jt_log_total();
    r = foreign_c ? sp_jobs_submit_after(S, foreign_c, 0, &j, 1, NULL) : SP_ERR_NOMEM;
    ok(refused(r, SP_ERR_INVALID_ARG, "sp_jobs_submit_after", lb, &before, NULL, 0),
       "%s: submit_after on another scheduler's counter: refused, nothing submitted", cfg());
    atomic_store(&foreign_stage, 2);
    sp_thread_join(t);
    /* the batch's own counter as `after` */
    sp_counter *self = counter("self edge");
    lb = jt_log_total();
    r = sp_jobs_submit_after(S, self, 0, &j, 1, self);
    ok(refused(r, SP_ERR_INVALID_ARG, "sp_jobs_submit_after", lb, &before, self, 0),
       "%s: submit_after with `after` == `counter`: refused, counter unchanged", cfg());
    /* negative n */
    sp_counter_add(self, 2);
    lb = jt_log_total();
    sp_counter_add(self, -1);
    bool add_refused =
        jt_log_total() == lb + 1 && jt_log_has(SP_ERR_INVALID_ARG, "sp_counter_add", NULL);
    lb = jt_log_total();
    sp_counter_sub(self, -1);
    bool sub_refused =
        jt_log_total() == lb + 1 && jt_log_has(SP_ERR_INVALID_ARG, "sp_counter_sub", NULL);
    ok(add_refused && sub_refused && sp_counter_value(self) == 2,
       "%s: add and sub of a negative n: refused, reported, value unchanged (%lld)", cfg(),
       (long long)sp_counter_value(self));
    /* raises past SP_COUNTER_MAX (they wrapped the value negative: every wait satisfied) */
    lb = jt_log_total();
    sp_counter_add(self, INT64_MAX);          /* refused: n above the bound */
    sp_counter_add(self, SP_COUNTER_MAX - 2); /* 2 + this: exactly the bound */
    int64_t at_max = sp_counter_value(self);
    sp_counter_add(self, 1);         /* refused: past the bound */
    sp_counter_sub(self, INT64_MAX); /* refused: n above the bound */
    bool three = jt_log_total() == lb + 3;
    sp_jobs_status_get(S, &before);
    r = sp_jobs_submit(S, &j, 1, self); /* refused: its raise passes the bound */
    ok(at_max == SP_COUNTER_MAX && three &&
           refused(r, SP_ERR_INVALID_ARG, "sp_jobs_submit", lb + 3, &before, self, at_max),
       "%s: a raise past 2^62 (an add of INT64_MAX, an add at the bound, a submit's) and a sub "
       "above it: refused, reported, value kept (%lld)",
       cfg(), (long long)sp_counter_value(self));
    sp_counter_sub(self, at_max - 2);
    sp_counter_sub(self, 2);
    sp_counter_destroy(self);
    /* destroy from a thread other than the main thread */
    lb = jt_log_total();
    sp_thread_start(&t, destroy_elsewhere, S, "sp-destroyer");
    sp_thread_join(t);
    bool refused_destroy =
        jt_log_total() == lb + 1 && jt_log_has(SP_ERR_INVALID_ARG, "sp_jobs_destroy", NULL);
    sp_counter *after = counter("after a refused destroy");
    atomic_store(&runs, 0);
    bool works = sp_jobs_submit(S, &j, 1, after) == SP_OK && sp_counter_wait(after, 0) == SP_OK &&
                 atomic_load(&runs) == 1;
    sp_counter_destroy(after);
    ok(refused_destroy && works,
       "%s: sp_jobs_destroy from another thread: refused, reported; the scheduler still runs jobs",
       cfg());
    scheduler_end();
}

/* A batch of two jobs, the second waiting forever; destroy without shutdown. */
static sp_counter *forever;

static void waits_forever(void *arg) {
    (void)arg;
    sp_counter_wait(forever, 0);
}

static void test_audit_stalled_destroy(const jt_config *c) {
    sp_jobs_desc desc = desc_for(c);
    desc.watchdog_ms = UINT32_MAX;
    if (!scheduler_begin_desc(c, desc)) return;
    forever = counter("forever");
    sp_counter_add(forever, 1);
    sp_job_desc d[2] = {jt_job(run_fn, NULL, "returns"), jt_job(waits_forever, NULL, "waits")};
    bool sub = sp_jobs_submit(S, d, 2, NULL) == SP_OK;
    jt_log_reset();
    sp_jobs_destroy(S); /* no shutdown first: it shuts down, reports, abandons, frees */
    S = NULL;
    bool named = jt_log_has(SP_ERR_STALLED, NULL, "'waits'");
    sp_jobs *again = NULL;
    sp_jobs_desc fresh = desc_for(c);
    bool released = sp_jobs_create(&again, &fresh) == SP_OK;
    if (again) sp_jobs_destroy(again);
    ok(sub && named && released,
       "%s: destroy with a stalled batch job: the report names the job that waits ('waits'), and "
       "the thread is free for a new scheduler (%s)",
       cfg(), released ? "created" : "refused");
    if (!named) jt_log_diag();
}

/* A worker_sleep hook that signals the counter a job pinned to that worker waits on. */
static sp_counter *hook_gate;
static atomic_int hook_parked, hook_signalled, hook_resumed;

static void signalling_sleep_hook(void *user, uint32_t index) {
    (void)user;
    if (index == 1 && atomic_load(&hook_parked) && !atomic_exchange(&hook_signalled, 1))
        sp_counter_sub(hook_gate, 1);
}

static void hook_waiter(void *arg) {
    (void)arg;
    atomic_store(&hook_parked, 1);
    sp_counter_wait(hook_gate, 0);
    atomic_store(&hook_resumed, 1);
}

static void test_audit_sleep_hook(void) {
    if (!begin_with_sleep_hook(signalling_sleep_hook)) return;
    hook_gate = counter("hook gate");
    sp_counter_add(hook_gate, 1);
    sp_job_desc j = jt_job(hook_waiter, NULL, "pinned waiter");
    j.pinned = true;
    j.worker = 1;
    bool sub = sp_jobs_submit(S, &j, 1, NULL) == SP_OK;
    ok(sub && jt_poll_int(&hook_resumed, 1),
       "a worker_sleep hook that signals a counter: the job it readies on that worker resumes "
       "without waiting for another wake-up");
    sp_jobs_shutdown(S);
    sp_counter_destroy(hook_gate);
    sp_jobs_destroy(S);
    S = NULL;
}

/* Shutdown with a stalled job parked on the main thread's own stack: a fixed pool of 2 fibers,
 * both held by parked jobs, so shutdown's drain runs k on the main stack; k readies one parked
 * job and waits on a counter nothing reaches, parking on that stack. Abandoning k released the
 * main thread's own fiber (misuse) and shutdown never returned. Now k's wait returns
 * SP_ERR_STALLED and k runs on. */
static sp_counter *ts_x, *ts_y, *ts_started;
static sp_result ts_k_rc = SP_OK;
static atomic_int ts_k_done;

static void ts_parker(void *arg) {
    sp_counter_sub(ts_started, 1);
    sp_counter_wait((sp_counter *)arg, 0);
}

static void ts_k(void *arg) {
    (void)arg;
    sp_counter_sub(ts_y, 1);
    ts_k_rc = sp_counter_wait(ts_x, 0);
    atomic_store(&ts_k_done, 1);
}

/* A fixed pool of 2 fibers, both held by parked jobs (waiting on X and on Y, which nothing
 * reaches), then job k (kfn) submitted and shutdown called: its drain runs k on the main
 * stack. Returns shutdown's answer; *before: the status before k. */
static sp_result stalled_case(sp_job_fn kfn, sp_jobs_status *before, sp_jobs_status *after) {
    CFG = &jt_sweep[0];
    sp_jobs_desc desc = {.no_workers = true, .fibers = 2, .fibers_max = 2};
    if (sp_jobs_create(&S, &desc) != SP_OK) return SP_ERR_NOMEM;
    ts_x = counter("X");
    ts_y = counter("Y");
    ts_started = counter("started");
    sp_counter_add(ts_x, 1);
    sp_counter_add(ts_y, 1);
    sp_counter_add(ts_started, 2);
    sp_job_desc j[2] = {jt_job(ts_parker, ts_x, "parker x"), jt_job(ts_parker, ts_y, "parker y")};
    sp_jobs_submit(S, &j[0], 1, NULL);
    sp_jobs_submit(S, &j[1], 1, NULL);
    sp_counter_wait(ts_started, 0);
    sp_jobs_status_get(S, before);
    ts_k_rc = SP_OK;
    atomic_store(&ts_k_done, 0);
    sp_job_desc k = jt_job(kfn, NULL, "k");
    sp_jobs_submit(S, &k, 1, NULL);
    jt_log_reset();
    sp_result r = sp_jobs_shutdown(S);
    sp_jobs_status_get(S, after);
    return r;
}

static void stalled_case_end(void) {
    sp_jobs_destroy(S);
    S = NULL;
    jt_log_reset();
}

static void test_audit_stalled_on_thread_stack(void) {
    sp_jobs_status before, st;
    sp_result r = stalled_case(ts_k, &before, &st);
    ok(before.fibers_in_use == 2 && r == SP_ERR_STALLED && ts_k_rc == SP_ERR_STALLED &&
           atomic_load(&ts_k_done) &&
           jt_log_has(SP_ERR_STALLED, "sp_jobs_shutdown", "'parker x'") &&
           jt_log_has(SP_ERR_STALLED, "sp_jobs_shutdown", "'k'") &&
           jt_log_count(SP_ERR_FOREIGN_POINTER, -1) == 0 && st.fibers_in_use == 0,
       "shutdown, a stalled job parked on the main thread's own stack: shutdown returns (%s); "
       "that job's wait returns %s and it finishes; the other is abandoned; no fiber misuse, "
       "every fiber back (%u in use)",
       sp_result_name(r), sp_result_name(ts_k_rc), st.fibers_in_use);
    if (jt_log_count(SP_ERR_FOREIGN_POINTER, -1)) jt_log_diag();
    if (S) stalled_case_end();
}

/* The same with no parked job ready: k, run nested on the main stack by shutdown's drain (no
 * fiber free), waits on a counter nothing reaches and finds no fiber either, so its wait runs
 * nested too, never parking. The drain counted only parked jobs as stuck and never gave up:
 * shutdown hung. Now a stuck drain also gives up nested waits of jobs: k's returns
 * SP_ERR_STALLED. */
static void ts_k_nested(void *arg) {
    (void)arg;
    ts_k_rc = sp_counter_wait(ts_x, 0);
    atomic_store(&ts_k_done, 1);
}

static void test_audit_stalled_nested(void) {
    sp_jobs_status before, st;
    sp_result r = stalled_case(ts_k_nested, &before, &st);
    ok(before.fibers_in_use == 2 && r == SP_ERR_STALLED && ts_k_rc == SP_ERR_STALLED &&
           atomic_load(&ts_k_done) &&
           jt_log_has(SP_ERR_STALLED, "sp_jobs_shutdown", "'parker x'") &&
           jt_log_has(SP_ERR_STALLED, "sp_counter_wait", "'k'") && st.fibers_in_use == 0,
       "shutdown, a stalled job waiting nested (no fiber) on the main stack: shutdown returns "
       "(%s); that wait returns %s and the job finishes; every fiber back (%u in use)",
       sp_result_name(r), sp_result_name(ts_k_rc), st.fibers_in_use);
    if (!jt_log_has(SP_ERR_STALLED, "sp_counter_wait", "'k'")) jt_log_diag();
    if (S) stalled_case_end();
}

/* Hooks that submit, wait or run a parallel_for: refused as misuse (a wait from a
 * worker_sleep hook used to park the worker's thread job under a loop fiber; shutdown then
 * ran that record as a fresh job and crashed). */
static sp_counter *hook_c;
static atomic_int hook_tried, hook_c_ready;
static sp_result hook_wait_rc, hook_submit_rc, hook_pfor_rc;

static void hook_nop(void *arg) {
    (void)arg;
}
static void hook_range(void *arg, uint64_t b, uint64_t e) {
    (void)arg, (void)b, (void)e;
}

static void misusing_sleep_hook(void *user, uint32_t index) {
    (void)user;
    if (index != 1 || !atomic_load(&hook_c_ready) || atomic_exchange(&hook_tried, 1)) return;
    hook_wait_rc = sp_counter_wait(hook_c, 0);
    sp_job_desc j = {.fn = hook_nop, .name = "from a hook"};
    hook_submit_rc = sp_jobs_submit(S, &j, 1, NULL);
    hook_pfor_rc = sp_parallel_for(S, 0, 100, 1, hook_range, NULL);
    atomic_store(&hook_tried, 2);
}

static void test_audit_hook_misuse(void) {
    if (!begin_with_sleep_hook(misusing_sleep_hook)) return;
    hook_c = counter("hook c");
    sp_counter_add(hook_c, 1);
    jt_log_reset();
    atomic_store(&hook_c_ready, 1);
    /* Worker 1 may be asleep already: a job pinned there makes it go to sleep again. */
    sp_job_desc nudge = jt_job(hook_nop, NULL, "nudge");
    nudge.pinned = true;
    nudge.worker = 1;
    sp_jobs_submit(S, &nudge, 1, NULL);
    bool tried = jt_poll_int(&hook_tried, 2);
    atomic_store(&hook_c_ready, 0);
    sp_counter_sub(hook_c, 1);
    sp_counter *k = counter("after");
    sp_job_desc j = jt_job(hook_nop, NULL, "pinned");
    j.pinned = true;
    j.worker = 1;
    bool ran = sp_jobs_submit(S, &j, 1, k) == SP_OK && sp_counter_wait(k, 0) == SP_OK;
    sp_result shut = sp_jobs_shutdown(S);
    ok(tried && hook_wait_rc == SP_ERR_INVALID_ARG && hook_submit_rc == SP_ERR_INVALID_ARG &&
           hook_pfor_rc == SP_ERR_INVALID_ARG &&
           jt_log_has(SP_ERR_INVALID_ARG, "sp_counter_wait", "profiling hook") &&
           jt_log_has(SP_ERR_INVALID_ARG, "sp_jobs_submit", "profiling hook") &&
           jt_log_has(SP_ERR_INVALID_ARG, "sp_parallel_for", "profiling hook") && ran &&
           shut == SP_OK,
       "a worker_sleep hook's wait, submit and parallel_for: each SP_ERR_INVALID_ARG, reported "
       "(%s, %s, %s); the worker then runs a pinned job and shutdown is clean (%s)",
       sp_result_name(hook_wait_rc), sp_result_name(hook_submit_rc), sp_result_name(hook_pfor_rc),
       sp_result_name(shut));
    sp_counter_destroy(k);
    sp_counter_destroy(hook_c);
    sp_jobs_destroy(S);
    S = NULL;
    jt_log_reset();
}

/* A counter lowered by hand goes below zero, not below -SP_COUNTER_MAX (past it the value
 * would wrap to a large positive one). */
static void test_audit_counter_floor(void) {
    if (!scheduler_begin_desc(&jt_sweep[2], (sp_jobs_desc){.workers = 1})) return;
    sp_counter *c = counter("floor");
    jt_log_reset();
    sp_counter_sub(c, SP_COUNTER_MAX);
    int64_t at_floor = sp_counter_value(c);
    sp_counter_sub(c, 1);
    sp_counter_sub(c, SP_COUNTER_MAX);
    int64_t after = sp_counter_value(c);
    ok(at_floor == -SP_COUNTER_MAX && after == -SP_COUNTER_MAX &&
           jt_log_has(SP_ERR_INVALID_ARG, "sp_counter_sub", "below -2^62"),
       "sp_counter_sub to -2^62 works; below it is refused and reported, the value unchanged "
       "(%lld)",
       (long long)after);
    sp_counter_add(c, SP_COUNTER_MAX);
    is_int((int)sp_counter_value(c), 0, "and raised back to 0");
    sp_counter_destroy(c);
    scheduler_end();
    jt_log_reset();
}

/* The main thread's own wait runs hooks outside any job (worker_sleep here): a shutdown or
 * destroy of the scheduler from one is refused, not run under that wait. */
static atomic_int main_hook_tried;
static sp_result main_hook_shutdown_rc = SP_OK;

static void slow_pinned(void *arg) {
    (void)arg;
    nanosleep(&(struct timespec){.tv_nsec = 20000000}, NULL);
}

static void ending_sleep_hook(void *user, uint32_t index) {
    (void)user;
    if (index != 0 || atomic_exchange(&main_hook_tried, 1)) return;
    main_hook_shutdown_rc = sp_jobs_shutdown(S);
    sp_jobs_destroy(S); /* refused: reported, nothing freed */
    atomic_store(&main_hook_tried, 2);
}

static void test_audit_main_hook_ends(void) {
    if (!begin_with_sleep_hook(ending_sleep_hook)) return;
    jt_log_reset();
    sp_counter *k = counter("slow");
    sp_job_desc j = jt_job(slow_pinned, NULL, "slow");
    j.pinned = true;
    j.worker = 1;
    /* The main thread finds nothing to run while worker 1 sleeps 20 ms: it sleeps, its hook
     * runs. */
    bool waited = sp_jobs_submit(S, &j, 1, k) == SP_OK && sp_counter_wait(k, 0) == SP_OK;
    int tried = atomic_load(&main_hook_tried);
    sp_result shut = sp_jobs_shutdown(S);
    ok(waited &&
           (tried == 0 || (tried == 2 && main_hook_shutdown_rc == SP_ERR_INVALID_ARG &&
                           jt_log_has(SP_ERR_INVALID_ARG, "sp_jobs_shutdown", "profiling hook") &&
                           jt_log_has(SP_ERR_INVALID_ARG, "sp_jobs_destroy", "profiling hook"))) &&
           shut == SP_OK,
       "sp_jobs_shutdown and sp_jobs_destroy from the main thread's worker_sleep hook: refused "
       "and reported (%s; hook ran: %s), the wait and the real shutdown go on",
       sp_result_name(main_hook_shutdown_rc), tried ? "yes" : "no");
    sp_counter_destroy(k);
    sp_jobs_destroy(S);
    S = NULL;
    jt_log_reset();
}

/* Fork-join deeper than the fibers: a 3-ary tree of jobs, each
 * waiting on its children, 8 deep (9,841 jobs; on odd levels one child pinned to a worker). On a
 * fixed pool (8 fibers of 64 KiB) waits that find no fiber run jobs on their own stack; that
 * nesting used to run off the stack (SIGSEGV). It now stops starting jobs with a quarter of the
 * stack left: the tree completes, or the waits stall and say so (SP_ERR_STALLED) and the child is
 * stopped after a few seconds. Never a crash. On the default scheduler (128 fibers of 256 KiB,
 * growing to 4,096: more than the tree's 3,280 waiting jobs) the pool grows instead (to 1,024-2,048
 * here) and the tree completes with no wait out of fibers. Run in a child, whose stderr is read. */
static sp_jobs *tree_s;

static void tree_node(void *arg) {
    intptr_t depth = (intptr_t)arg;
    if (depth == 0) return;
    sp_counter *c = sp_counter_create(tree_s, "children");
    sp_job_desc d[3];
    for (int i = 0; i < 3; i++) {
        d[i] = jt_job(tree_node, (void *)(depth - 1), "node");
        d[i].pinned = i == 2 && depth % 2; /* on odd levels the third child runs where it must */
        d[i].worker = (uint32_t)(depth % 3);
    }
    if (!c || sp_jobs_submit(tree_s, d, 3, c) != SP_OK) _exit(3);
    sp_counter_wait(c, 0);
    sp_counter_destroy(c);
}

typedef struct tree_case {
    uint32_t fibers;
    size_t stack_kib;
    bool fixed;
    unsigned seconds;
} tree_case;

/* In the child: the tree, stopped by SIGALRM after the case's seconds; exit 0 when it
 * completed (with no wait out of fibers, unless the pool is fixed). */
static void tree_child(void *arg) {
    const tree_case *t = arg;
    signal(SIGALRM, SIG_DFL); /* not the parent's deadline handler */
    alarm(t->seconds);
    sp_jobs_desc d = {.workers = 2,
                      .fibers = t->fibers,
                      .fibers_max = t->fixed ? t->fibers : 0,
                      .fiber_stack = t->stack_kib << 10};
    if (sp_jobs_create(&tree_s, &d) != SP_OK) _exit(2);
    sp_counter *root = sp_counter_create(tree_s, "root");
    sp_job_desc j = jt_job(tree_node, (void *)8, "root");
    if (!root || sp_jobs_submit(tree_s, &j, 1, root) != SP_OK) _exit(2);
    sp_counter_wait(root, 0);
    sp_jobs_status st;
    sp_jobs_status_get(tree_s, &st);
    _exit(st.jobs_run != 9841 ? 4 : !t->fixed && st.fiber_exhaustions ? 5 : 0);
}

/* One tree 8 deep in a child on a scheduler of `fibers` fibers of `stack_kib` KiB (0:
 * defaults; fixed: a pool that does not grow), stopped after `seconds`: completed, or (fixed)
 * stalled and said so, never a crash. */
static void deep_tree_case(uint32_t fibers, size_t stack_kib, bool fixed, unsigned seconds) {
    static char text[1 << 16];
    tree_case t = {fibers, stack_kib, fixed, seconds};
    int status = ts_child(tree_child, &t, text, sizeof text);
    bool done = status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    bool told = fixed && status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM &&
                strstr(text, "SP_ERR_STALLED") != NULL;
    ok(done || told, "fork-join 8 deep on %s pool of %u fibers of %zu KiB: %s (exit %d, signal %d)",
       fixed ? "a fixed" : "a growing", fibers ? fibers : 128, stack_kib ? stack_kib : 256,
       done   ? "completed"
       : told ? "stalled, reported"
              : "failed",
       WIFEXITED(status) ? WEXITSTATUS(status) : -1, WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    if (!done && !told) diag("child stderr:\n%s", text);
}

/* Under an address-space limit that refuses the default pool's reservation (32 x 128 stacks
 * of 256 KiB, 1 GiB), create settles for a smaller fibers_max: it used to fail. In a child,
 * with RLIMIT_AS at what the process maps now plus 600 MiB (not under sanitizers, whose
 * shadow mappings such a limit breaks). */
static void limited_child(void *arg) {
    if (!ts_limit_address_room((size_t) * (long *)arg << 20)) _exit(3);
    sp_jobs *s = NULL;
    sp_jobs_desc d = {.workers = 1};
    if (sp_jobs_create(&s, &d) != SP_OK) _exit(4);
    sp_jobs_status st;
    sp_jobs_status_get(s, &st);
    /* Room left for the caller: the pool took at most half of what the limit left. */
    void *p = malloc((size_t)64 << 20);
    bool room = p != NULL;
    free(p);
    sp_jobs_destroy(s);
    _exit(st.fibers_total != 128 ? 5 : !room ? 6 : 0);
}

static void test_audit_address_limit(void) {
    if (ts_sanitized()) { /* no line: an address-space limit breaks the shadow mappings */
        diag("address-space limit case not run under a sanitizer or valgrind");
        return;
    }
    static char text[8192];
    static const long mib[] = {600, 540, 560};
    for (int i = 0; i < 3; i++) {
        long more = mib[i];
        int status = ts_child(limited_child, &more, text, sizeof text);
        int code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        ok(code == 0,
           "default desc under an address-space limit of %ld MiB more: created with a smaller "
           "fibers_max, 64 MiB left for the caller (exit %d; 6: no room left, 4: create failed)",
           more, code);
        if (code != 0) diag("child stderr:\n%s", text);
    }
}

/* The defaults (the pool grows: the tree completes, no wait ran out of fibers), and a fixed 8
 * fibers of 64 KiB, where a wait that nested without the stack check ran off the stack every
 * time. */
static void test_audit_deep_tree(void) {
    deep_tree_case(0, 0, false, 30);
    deep_tree_case(8, 64, true, 5);
}

int main(void) {
    jt_log_capture();
    sp_misuse_set_fatal(false);
    const jt_config *two = &jt_sweep[2], *inl = &jt_sweep[0];
    jt_deadline("create", 30);
    test_create();
    jt_deadline("misuse", 30);
    test_misuse(inl);
    test_misuse(two);
    jt_deadline("destroyed counters", 30);
    test_destroyed(inl);
    test_destroyed(two);
    test_destroy_churn(inl);
    test_destroy_churn(two);
    jt_deadline("kept counters", 30);
    test_kept(inl);
    test_kept(two);
    jt_deadline("limit", 30);
    test_limit(inl);
    test_limit(two);
    jt_deadline("shutdown with work that can never run (inline)", 30);
    test_stalled_shutdown(inl);
    jt_deadline("shutdown with work that can never run (2 workers)", 30);
    test_stalled_shutdown(two);
    jt_deadline("batch without a counter", 30);
    test_no_counter_waits(inl);
    test_no_counter_waits(two);
    jt_deadline("audit: misuse", 30);
    test_audit_misuse(inl);
    test_audit_misuse(two);
    jt_deadline("audit: destroy with a stalled batch", 30);
    test_audit_stalled_destroy(inl);
    test_audit_stalled_destroy(two);
    jt_deadline("audit: a sleep hook that signals", 30);
    test_audit_sleep_hook();
    jt_deadline("audit: a stalled job on the main thread's stack", 30);
    test_audit_stalled_on_thread_stack();
    jt_deadline("audit: a stalled nested wait", 30);
    test_audit_stalled_nested();
    jt_deadline("audit: hooks that wait or submit", 30);
    test_audit_hook_misuse();
    test_audit_main_hook_ends();
    test_audit_counter_floor();
    jt_deadline("audit: a deep fork-join tree", 60);
    test_audit_deep_tree();
    jt_deadline("audit: an address-space limit", 30);
    test_audit_address_limit();
    alarm(0);
    jt_log_release();
    return done();
}
