/* Where and when the scheduler runs what is ready (jobs/sp_jobs.h), from a second audit; each
 * test fails with its fix undone:
 *   - a batch (or parallel_for) piece gives way to a higher-priority job that became ready on
 *     its worker (submitted, or resumed), instead of running its remaining lower-priority jobs
 *     first; to one submitted by another thread within 16 steps;
 *   - the park and resume hooks name the batch job that waits, not the batch's first job;
 *   - a job submitted from another thread while the main thread and a worker sleep runs on the
 *     worker, even when the main thread's wait ends at the same moment (the wake went to the
 *     main thread, which left its wait: the job stayed queued until the next wait; a thread
 *     leaving its wait now wakes a worker for work that anyone may run);
 *   - a job resumed into the main thread's next-job slot is handed on when the main thread's
 *     own stack resumes in a parallel_for body (it stayed there, unstealable);
 *   - a parked job that another thread readies while shutdown abandons the stuck ones runs,
 *     and its fiber comes back (it was neither run nor reported, and the pool leaked).
 * "Runs" is polled with a generous bound, never timed. */
#include <string.h>

#include "jobs_support.h"

static sp_jobs *S;

/* S made from d, or a failed line (false). */
static bool create(sp_jobs_desc d) {
    if (sp_jobs_create(&S, &d) == SP_OK) return true;
    ok(0, "sp_jobs_create");
    return false;
}

/* Poll until *v is set: false after 5 s (it takes microseconds; the bound only keeps a
 * failure from waiting for the shutdown that would run it at last). */
static bool soon(atomic_int *v) {
    uint64_t t0 = sp_time_ns();
    while (!atomic_load(v)) {
        if (sp_time_ns() - t0 > 5000000000u) return false;
        sp_thread_yield();
    }
    return true;
}

/* ---- priority inside a batch ------------------------------------------------------------ */

static sp_counter *prio_c;
static char order[16];
static int order_n;

static void high_fn(void *arg) {
    (void)arg;
    order[order_n++] = 'H';
}

static void low_fn(void *arg) {
    order[order_n++] = (char)('0' + (intptr_t)arg);
    if (order_n == 1) { /* the first to run makes a high-priority job ready on this worker */
        sp_job_desc h = {.fn = high_fn, .name = "high", .priority = SP_PRIORITY_HIGH};
        sp_jobs_submit(S, &h, 1, prio_c);
    }
}

/* Inline (deterministic): 6 low jobs, as single submits and as one batch. */
static void test_batch_priority(void) {
    for (int batch = 0; batch < 2; batch++) {
        if (!create((sp_jobs_desc){.no_workers = true})) return;
        prio_c = jt_counter(S, "inline", "prio");
        memset(order, 0, sizeof order);
        order_n = 0;
        sp_job_desc jobs[6];
        for (intptr_t i = 0; i < 6; i++)
            jobs[i] = (sp_job_desc){
                .fn = low_fn, .arg = (void *)i, .name = "low", .priority = SP_PRIORITY_LOW};
        bool sub = true;
        if (batch)
            sub = sp_jobs_submit(S, jobs, 6, prio_c) == SP_OK;
        else
            for (int i = 0; i < 6; i++) sub &= sp_jobs_submit(S, &jobs[i], 1, prio_c) == SP_OK;
        sp_counter_wait(prio_c, 0);
        const char *want = batch ? "0H12345" : "5H43210";
        ok(sub && strcmp(order, want) == 0,
           "inline, %s: the high job runs right after the job that made it ready (%s, want %s)",
           batch ? "one batch of 6 low jobs" : "6 low jobs submitted one by one", order, want);
        sp_counter_destroy(prio_c);
        sp_jobs_destroy(S);
    }
}

/* A high job that waits, resumed by the first job of a low batch: it runs right after it. */
static sp_counter *h_gate;

static void parked_high_fn(void *arg) {
    (void)arg;
    order[order_n++] = 'h';
    sp_counter_wait(h_gate, 0);
    order[order_n++] = 'H';
}

static void low_opens_fn(void *arg) {
    order[order_n++] = (char)('0' + (intptr_t)arg);
    if (arg == 0) sp_counter_sub(h_gate, 1);
}

/* A parallel_for on the main thread whose first step has another thread submit a high job:
 * it runs before the range ends (the piece looks at the queues other threads push to every
 * 16th step). */
static atomic_int pf_steps, high_after;

static void foreign_high_fn(void *arg) {
    (void)arg;
    atomic_store(&high_after, atomic_load(&pf_steps));
}

static void *submit_high(void *arg) {
    (void)arg;
    sp_job_desc h = {.fn = foreign_high_fn, .name = "foreign high", .priority = SP_PRIORITY_HIGH};
    sp_jobs_submit(S, &h, 1, NULL);
    return NULL;
}

static void pf_body(void *arg, uint64_t begin, uint64_t end) {
    (void)arg, (void)begin, (void)end;
    if (atomic_fetch_add(&pf_steps, 1) == 0) {
        pthread_t t;
        pthread_create(&t, NULL, submit_high, NULL);
        pthread_join(t, NULL);
    }
}

static void test_resumed_and_foreign_priority(void) {
    if (!create((sp_jobs_desc){.no_workers = true})) return;
    h_gate = jt_counter(S, "inline", "h gate");
    sp_counter *c = jt_counter(S, "inline", "batch");
    sp_counter_add(h_gate, 1);
    memset(order, 0, sizeof order);
    order_n = 0;
    sp_job_desc h = {.fn = parked_high_fn, .name = "high", .priority = SP_PRIORITY_HIGH};
    sp_job_desc jobs[6];
    for (intptr_t i = 0; i < 6; i++)
        jobs[i] = (sp_job_desc){
            .fn = low_opens_fn, .arg = (void *)i, .name = "low", .priority = SP_PRIORITY_LOW};
    bool sub = sp_jobs_submit(S, &h, 1, c) == SP_OK && sp_jobs_submit(S, jobs, 6, c) == SP_OK;
    sp_counter_wait(c, 0);
    ok(sub && strcmp(order, "h0H12345") == 0,
       "inline: a parked high job resumed by the first job of a low batch runs right after it "
       "(%s, want h0H12345)",
       order);
    for (uint64_t begin = 0; begin < 2; begin++) { /* the step count, not the index, decides */
        atomic_store(&pf_steps, 0);
        atomic_store(&high_after, -1);
        sp_parallel_for(S, begin, begin + 16 * 64, 16, pf_body, NULL);
        int after = atomic_load(&high_after);
        ok(after >= 1 && after <= 17,
           "inline: a high job another thread submits during a parallel_for of 64 steps from "
           "index %llu runs within 16 steps (after step %d)",
           (unsigned long long)begin, after);
    }
    sp_counter_destroy(h_gate);
    sp_counter_destroy(c);
    sp_jobs_destroy(S);
}

/* ---- hook names of a waiting batch job ---------------------------------------------------- */

static sp_counter *gate;
static char parked_as[16], resumed_as[16];

static void on_park(void *user, uint32_t worker, const char *name) {
    (void)user, (void)worker;
    snprintf(parked_as, sizeof parked_as, "%s", name ? name : "(null)");
}
static void on_resume(void *user, uint32_t worker, const char *name) {
    (void)user, (void)worker;
    snprintf(resumed_as, sizeof resumed_as, "%s", name ? name : "(null)");
}
static void nop_fn(void *arg) {
    (void)arg;
}
/* Waits on the counter it is given. */
static void wait_fn(void *counter) {
    sp_counter_wait(counter, 0);
}
static void gate_open_fn(void *arg) {
    (void)arg;
    sp_counter_sub(gate, 1);
}

/* A parallel_for of one index whose body waits on the gate. */
static void pfor_wait_body(void *arg, uint64_t b, uint64_t e) {
    (void)arg, (void)b, (void)e;
    sp_counter_wait(gate, 0);
}
static void pfor_caller_fn(void *arg) {
    (void)arg;
    sp_parallel_for(S, 0, 1, 1, pfor_wait_body, NULL);
}

static void test_hook_names(void) {
    if (!create((sp_jobs_desc){.no_workers = true,
                               .hooks = {.job_park = on_park, .job_resume = on_resume}}))
        return;
    gate = jt_counter(S, "inline", "gate");
    sp_counter *c = jt_counter(S, "inline", "batch");
    sp_counter_add(gate, 1);
    sp_job_desc jobs[3] = {jt_job(nop_fn, NULL, "A"), jt_job(wait_fn, gate, "B"),
                           jt_job(gate_open_fn, NULL, "C")};
    bool sub = sp_jobs_submit(S, jobs, 3, c) == SP_OK;
    sp_counter_wait(c, 0);
    ok(sub && strcmp(parked_as, "B") == 0 && strcmp(resumed_as, "B") == 0,
       "a batch job that waits: job_park and job_resume name it ('%s', '%s', want 'B')", parked_as,
       resumed_as);
    /* A parallel_for body that waits: the range runs on its caller, not as a job of its own
     * (no job_begin names it), so its park and resume are the caller's: those of job D, and
     * none at all for the main thread outside jobs (they named "sp_parallel_for"). */
    parked_as[0] = resumed_as[0] = 0;
    sp_counter_add(gate, 1);
    sp_job_desc d = jt_job(pfor_caller_fn, NULL, "D"), o = jt_job(gate_open_fn, NULL, "open");
    o.priority = SP_PRIORITY_LOW;
    sub = sp_jobs_submit(S, &d, 1, c) == SP_OK && sp_jobs_submit(S, &o, 1, c) == SP_OK;
    sp_counter_wait(c, 0);
    bool in_job = strcmp(parked_as, "D") == 0 && strcmp(resumed_as, "D") == 0;
    char in_job_park[16], in_job_resume[16];
    memcpy(in_job_park, parked_as, sizeof parked_as);
    memcpy(in_job_resume, resumed_as, sizeof resumed_as);
    parked_as[0] = resumed_as[0] = 0;
    sp_counter_add(gate, 1);
    sp_jobs_status st0, st1;
    sp_jobs_status_get(S, &st0);
    sp_jobs_submit(S, &o, 1, c); /* runs when the body's wait lets the main thread run jobs */
    sp_parallel_for(S, 0, 1, 1, pfor_wait_body, NULL);
    sp_counter_wait(c, 0);
    sp_jobs_status_get(S, &st1);
    ok(sub && in_job && parked_as[0] == 0 && resumed_as[0] == 0 && st1.parks == st0.parks,
       "a parallel_for body that waits: park and resume name its caller, job D ('%s', '%s'); "
       "from the main thread outside jobs, none ('%s', '%s'; parks %llu -> %llu)",
       in_job_park, in_job_resume, parked_as, resumed_as, (unsigned long long)st0.parks,
       (unsigned long long)st1.parks);
    sp_counter_destroy(gate);
    sp_counter_destroy(c);
    sp_jobs_destroy(S);
}

/* ---- a job submitted while everyone sleeps, as the main thread's wait ends ---------------- */

static sp_counter *main_waits;
static atomic_int j_ran;

static void j_fn(void *arg) {
    (void)arg;
    atomic_store(&j_ran, 1);
}

static void *submit_then_signal(void *arg) {
    (void)arg;
    usleep(20000); /* the main thread and the worker are asleep by now (mostly) */
    sp_job_desc j = jt_job(j_fn, NULL, "J");
    sp_jobs_submit(S, &j, 1, NULL);
    sp_counter_sub(main_waits, 1);
    return NULL;
}

static void test_wake_order(void) {
    int ran = 0, rounds = 3;
    for (int r = 0; r < rounds; r++) {
        if (!create((sp_jobs_desc){.workers = 1})) return;
        main_waits = jt_counter(S, "1 worker", "main waits");
        atomic_store(&j_ran, 0);
        sp_counter_add(main_waits, 1);
        pthread_t t;
        pthread_create(&t, NULL, submit_then_signal, NULL);
        sp_counter_wait(main_waits, 0);
        pthread_join(t, NULL);
        ran += soon(&j_ran); /* the main thread waits no more: the worker must run J */
        sp_counter_destroy(main_waits);
        sp_jobs_destroy(S);
    }
    ok(ran == rounds,
       "1 worker: a job another thread submits while both sleep, as the main thread's wait "
       "ends, runs on the worker (%d of %d rounds)",
       ran, rounds);
}

/* ---- a parallel_for body that waits on the main thread ------------------------------------ */

static sp_counter *body_c, *p_go, *p_started;
static atomic_int p_done;

static void p_fn(void *arg) { /* low, unpinned: parks on the worker */
    (void)arg;
    sp_counter_sub(p_started, 1);
    sp_counter_wait(p_go, 0);
    atomic_store(&p_done, 1);
}

static void s_fn(void *arg) { /* pinned to the main thread */
    (void)arg;
    sp_counter_wait(p_started, 0);
    usleep(10000);             /* P parks meanwhile (mostly) */
    sp_counter_sub(p_go, 1);   /* P ready: into this thread's next-job slot */
    sp_counter_sub(body_c, 1); /* the body's wait ends: the main thread's own stack resumes */
}

static void body_fn(void *arg, uint64_t begin, uint64_t end) {
    (void)arg, (void)begin, (void)end;
    sp_counter_add(body_c, 1);
    sp_counter_add(p_go, 1);
    sp_counter_add(p_started, 1);
    sp_job_desc p = {.fn = p_fn, .name = "P", .priority = SP_PRIORITY_LOW};
    sp_job_desc s = {.fn = s_fn, .name = "S", .pinned = true, .worker = 0};
    sp_jobs_submit(S, &p, 1, NULL);
    sp_jobs_submit(S, &s, 1, NULL);
    sp_counter_wait(body_c, 0);
}

static void test_pfor_resume(void) {
    int done_rounds = 0, rounds = 3;
    for (int r = 0; r < rounds; r++) {
        if (!create((sp_jobs_desc){.workers = 1})) return;
        body_c = jt_counter(S, "1 worker", "body");
        p_go = jt_counter(S, "1 worker", "p go");
        p_started = jt_counter(S, "1 worker", "p started");
        atomic_store(&p_done, 0);
        sp_parallel_for(S, 0, 1, 1, body_fn, NULL);
        done_rounds += soon(&p_done); /* no wait here: the worker must resume P */
        sp_jobs_destroy(S);
    }
    ok(done_rounds == rounds,
       "1 worker: a job resumed while the main thread's parallel_for body waits is not kept "
       "in the main thread's slot (%d of %d rounds)",
       done_rounds, rounds);
}

/* ---- a parked job readied while shutdown abandons ----------------------------------------- */

static sp_counter *never, *late;
static atomic_int go_signal, signalled, b_resumed;

static void late_fn(void *arg) {
    (void)arg;
    sp_counter_wait(late, 0);
    atomic_store(&b_resumed, 1);
}

/* The first "abandoned" report lets the other thread ready B before the abandon pass reaches
 * B's counter: the window that is otherwise a narrow race. */
static void abandon_log(void *user, const sp_log_record *rec) {
    jt_log_fn(user, rec);
    if (rec->id == SP_ERR_STALLED && !atomic_exchange(&go_signal, 1)) jt_poll_int(&signalled, 1);
}

static void *ready_late(void *arg) {
    (void)arg;
    jt_poll_int(&go_signal, 1);
    sp_counter_sub(late, 1);
    atomic_store(&signalled, 1);
    return NULL;
}

static void test_readied_during_abandon(void) {
    if (!create((sp_jobs_desc){.workers = 1})) return;
    never = jt_counter(S, "1 worker", "never");
    late = jt_counter(S, "1 worker", "late");
    sp_counter_add(never, 1);
    sp_counter_add(late, 1);
    sp_job_desc a = jt_job(wait_fn, never, "A");
    sp_job_desc b = {.fn = late_fn, .name = "B", .pinned = true, .worker = 0};
    sp_jobs_submit(S, &a, 1, NULL);
    sp_jobs_submit(S, &b, 1, NULL);
    pthread_t t;
    pthread_create(&t, NULL, ready_late, NULL);
    jt_log_reset();
    sp_log_set(abandon_log, NULL);
    sp_result r = sp_jobs_shutdown(S);
    pthread_join(t, NULL);
    sp_log_set(jt_log_fn, NULL);
    sp_jobs_status st;
    sp_jobs_status_get(S, &st);
    bool a_told = jt_log_has(SP_ERR_STALLED, "sp_jobs_shutdown", "'A'");
    bool b_told = jt_log_has(SP_ERR_STALLED, "sp_jobs_shutdown", "'B'");
    ok(r == SP_ERR_STALLED && a_told && !b_told && atomic_load(&b_resumed) && st.jobs_run == 1 &&
           st.fibers_in_use == 0,
       "shutdown: A abandoned and reported; B, readied meanwhile, ran (%d) and was not reported "
       "(%d); its fiber came back (%u in use)",
       atomic_load(&b_resumed), b_told, st.fibers_in_use);
    sp_jobs_destroy(S);
    jt_log_reset();
}

/* ---- a handoff gives way to a higher priority ------------------------------------------ */

static sp_counter *ho_gate, *ho_started, *ho_high;
static char ho_order[8];
static int ho_n;

static void ho_low(void *arg) {
    (void)arg;
    sp_counter_sub(ho_started, 1);
    sp_counter_wait(ho_gate, 0);
    ho_order[ho_n++] = 'L';
}

static void ho_high_fn(void *arg) {
    (void)arg;
    ho_order[ho_n++] = 'H';
}

/* A makes a high job ready on its worker and resumes a parked low job into the worker's
 * next-job slot; then A waits (or ends). */
static void ho_a(void *arg) {
    sp_job_desc h = {.fn = ho_high_fn, .name = "high", .priority = SP_PRIORITY_HIGH};
    sp_jobs_submit(S, &h, 1, ho_high);
    sp_counter_sub(ho_gate, 1);
    if (arg) sp_counter_wait(ho_high, 0);
    ho_order[ho_n++] = 'A';
}

/* Inline (deterministic): the resumed low job used to run first when A waited (the handoff
 * switched straight to it), though not when A ended. */
static void test_handoff_priority(void) {
    for (int waits = 0; waits < 2; waits++) {
        if (!create((sp_jobs_desc){.no_workers = true})) return;
        ho_gate = jt_counter(S, "inline", "gate");
        ho_started = jt_counter(S, "inline", "started");
        ho_high = jt_counter(S, "inline", "high");
        sp_counter *done = jt_counter(S, "inline", "done");
        memset(ho_order, 0, sizeof ho_order);
        ho_n = 0;
        sp_counter_add(ho_gate, 1);
        sp_counter_add(ho_started, 1);
        sp_job_desc l = {.fn = ho_low, .name = "low", .priority = SP_PRIORITY_LOW};
        sp_jobs_submit(S, &l, 1, done);
        sp_counter_wait(ho_started, 0); /* the low job is parked on the gate */
        sp_job_desc a = {.fn = ho_a, .arg = waits ? S : NULL, .name = "A"};
        sp_jobs_submit(S, &a, 1, done);
        sp_counter_wait(done, 0);
        const char *h = strchr(ho_order, 'H'), *lo = strchr(ho_order, 'L');
        ok(h && lo && h < lo,
           "inline: a job that %s after readying a high job and resuming a low one: the high "
           "job runs first (%s)",
           waits ? "waits" : "ends", ho_order);
        sp_counter_destroy(ho_gate);
        sp_counter_destroy(ho_started);
        sp_counter_destroy(ho_high);
        sp_counter_destroy(done);
        sp_jobs_shutdown(S);
        sp_jobs_destroy(S);
    }
}

/* ---- leaving a wait that ran out of fibers --------------------------------------------- */

static sp_counter *nw_hold, *nw_c, *nw_jc;
static atomic_int nw_go, nw_stop;

static void nw_parker(void *arg) {
    (void)arg;
    sp_counter_wait(nw_hold, 0);
}

static void nw_job(void *arg) {
    (void)arg;
}

/* Another thread: on each go, submit J, then reach the counter the main thread waits on. */
static void *nw_foreign(void *arg) {
    (void)arg;
    unsigned seed = 1;
    while (!atomic_load(&nw_stop)) {
        if (!atomic_exchange(&nw_go, 0)) {
            sp_thread_yield();
            continue;
        }
        seed = seed * 1103515245u + 12345u;
        uint64_t t0 = sp_time_ns(), pause = 50000 + (seed >> 16) % 400000;
        while (sp_time_ns() - t0 < pause) sp_thread_yield();
        sp_job_desc j = {.fn = nw_job, .name = "J"};
        sp_jobs_submit(S, &j, 1, nw_jc);
        sp_counter_sub(nw_c, 1);
    }
    return NULL;
}

/* 1 worker, 3 fibers, two of them parked: the main thread's wait has no fiber and runs
 * nested. A job another thread submits just before reaching that wait's counter used to stay
 * queued, the worker asleep, once the main thread left its wait (the wake went to the main
 * thread, or was skipped while it spun): in about 8 of 10 rounds. */
static void test_nested_wait_wake(void) {
    enum { ROUNDS = 10 };
    if (!create(
            (sp_jobs_desc){.workers = 1, .fibers = 3, .fibers_max = 3, .watchdog_ms = UINT32_MAX}))
        return;
    nw_hold = jt_counter(S, "1 worker", "hold");
    nw_c = jt_counter(S, "1 worker", "c");
    nw_jc = jt_counter(S, "1 worker", "jc");
    sp_counter_add(nw_hold, 1);
    sp_job_desc p = {.fn = nw_parker, .name = "parker", .pinned = true, .worker = 1};
    sp_jobs_submit(S, &p, 1, NULL);
    sp_jobs_submit(S, &p, 1, NULL);
    sp_jobs_status st = {0};
    for (uint64_t t0 = sp_time_ns(); st.parks < 2 && sp_time_ns() - t0 < 5000000000u;) {
        sp_thread_yield();
        sp_jobs_status_get(S, &st);
    }
    atomic_store(&nw_stop, 0);
    pthread_t t;
    pthread_create(&t, NULL, nw_foreign, NULL);
    int stranded = 0;
    for (int r = 0; r < ROUNDS; r++) {
        sp_counter_add(nw_c, 1);
        atomic_store(&nw_go, 1);
        sp_counter_wait(nw_c, 0); /* nested: no fiber free */
        /* 2 s, generous: J takes microseconds once a worker is awake (a stranded J waited for
         * the next push, which here never comes). */
        uint64_t t0 = sp_time_ns();
        while (sp_counter_value(nw_jc) > 0 && sp_time_ns() - t0 < 2000000000u) sp_thread_yield();
        if (sp_counter_value(nw_jc) > 0) {
            stranded++;
            sp_counter_wait(nw_jc, 0); /* the main thread runs it */
        }
    }
    atomic_store(&nw_stop, 1);
    pthread_join(t, NULL);
    sp_jobs_status_get(S, &st);
    ok(st.parks >= 2 && st.fiber_exhaustions >= ROUNDS && stranded == 0,
       "1 worker, no fiber free: a job submitted just before a nested wait ends runs on the "
       "worker (stranded in %d of %d rounds; %u waits ran out of fibers)",
       stranded, ROUNDS, st.fiber_exhaustions);
    sp_counter_sub(nw_hold, 1);
    jt_log_reset();
    sp_jobs_shutdown(S);
    sp_jobs_destroy(S);
    jt_log_reset();
}

int main(void) {
    jt_log_capture();
    sp_misuse_set_fatal(false);
    jt_deadline("priority inside a batch", 30);
    test_batch_priority();
    test_resumed_and_foreign_priority();
    jt_deadline("hook names", 30);
    test_hook_names();
    jt_deadline("wake order", 60);
    test_wake_order();
    jt_deadline("parallel_for resume", 60);
    test_pfor_resume();
    jt_deadline("readied during abandon", 60);
    test_readied_during_abandon();
    jt_deadline("handoff priority", 30);
    test_handoff_priority();
    jt_deadline("nested wait wake", 120);
    test_nested_wait_wake();
    alarm(0);
    jt_log_release();
    return done();
}
