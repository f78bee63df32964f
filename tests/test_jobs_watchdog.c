/* The debug-build watchdog (sp_jobs_desc.watchdog_ms): a job parked on a counter that nothing
 * signals is reported with SP_ERR_STALLED naming the counter, the wait goes on, and once the
 * counter is signalled by hand everything completes. A wait on a job that is busy running is
 * not reported. With 2 workers (the main thread sleeps meanwhile) and inline (the main thread
 * is itself stuck in a wait; another thread signals). Debug builds only. */
#include <time.h>

#include "jobs_support.h"

enum { WATCHDOG_MS = 200, SEEN_WITHIN_MS = 5000 };

static sp_jobs *S;

static void sleep_ms(unsigned ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* Poll the logger for SP_ERR_STALLED, up to SEEN_WITHIN_MS (a bound, not a timing check). */
static bool stalled_seen(void) {
    for (unsigned waited = 0; waited < SEEN_WITHIN_MS; waited += 50) {
        if (jt_log_count(SP_ERR_STALLED, -1) > 0) return true;
        sleep_ms(50);
    }
    return jt_log_count(SP_ERR_STALLED, -1) > 0;
}

typedef struct stuck {
    sp_counter *gate;
    sp_result rc;
    atomic_bool returned;
} stuck;

static void stuck_fn(void *arg) {
    stuck *st = arg;
    st->rc = sp_counter_wait(st->gate, 0);
    atomic_store(&st->returned, true);
}

typedef struct signaller {
    stuck *st;
    bool seen;         /* SP_ERR_STALLED logged before the signal */
    bool still_parked; /* the waiting job had not returned when it was reported */
} signaller;

static void *signal_thread(void *arg) {
    signaller *sg = arg;
    sg->seen = stalled_seen();
    sg->still_parked = !atomic_load(&sg->st->returned);
    sp_counter_sub(sg->st->gate, 1);
    return NULL;
}

static void busy_fn(void *arg) {
    (void)arg;
    uint64_t t0 = sp_time_ns();
    while (sp_time_ns() - t0 < 3u * WATCHDOG_MS * 1000000u) {
    }
}

static void on_counter_fn(void *arg) {
    sp_counter *c = arg;
    sp_counter_wait(c, 0);
}

static void run(const jt_config *c) {
    sp_jobs_desc desc = {
        .workers = c->workers, .no_workers = c->no_workers, .watchdog_ms = WATCHDOG_MS};
    if (sp_jobs_create(&S, &desc) != SP_OK) {
        ok(0, "%s: create", c->name);
        return;
    }
    jt_log_reset();

    /* A job waits on a job that runs (busy) for 3 watchdog periods: progress, no report. */
    sp_counter *busy = sp_counter_create(S, "busy"), *all = sp_counter_create(S, "all");
    sp_job_desc bj = jt_job(busy_fn, NULL, "busy"), wj = jt_job(on_counter_fn, busy, "on busy");
    bool sub = sp_jobs_submit(S, &bj, 1, busy) == SP_OK && sp_jobs_submit(S, &wj, 1, all) == SP_OK;
    bool waited = sp_counter_wait(all, 0) == SP_OK && sp_counter_wait(busy, 0) == SP_OK;
    ok(sub && waited && jt_log_count(SP_ERR_STALLED, -1) == 0,
       "%s: a wait on a job that is running is not reported as stalled", c->name);

    stuck st = {.gate = sp_counter_create(S, "watchdog-gate")};
    atomic_init(&st.returned, false);
    sp_counter_add(st.gate, 1);
    sp_job_desc sj = jt_job(stuck_fn, &st, "stuck");
    sub = sp_jobs_submit(S, &sj, 1, all) == SP_OK;
    bool seen, parked;
    if (c->no_workers) {
        /* The main thread's own wait is stuck too: another thread signals the gate. */
        signaller sg = {.st = &st};
        sp_thread t;
        bool started = sp_thread_start(&t, signal_thread, &sg, "jt-signal") == SP_OK;
        if (!started) sp_counter_sub(st.gate, 1);
        waited = sp_counter_wait(all, 0) == SP_OK;
        if (started) sp_thread_join(t);
        seen = started && sg.seen;
        parked = sg.still_parked;
    } else {
        sleep_ms(1000);
        seen = stalled_seen();
        parked = !atomic_load(&st.returned);
        sp_counter_sub(st.gate, 1);
        waited = sp_counter_wait(all, 0) == SP_OK;
    }
    ok(sub && seen, "%s: a job parked on a counter nobody signals is reported: SP_ERR_STALLED",
       c->name);
    ok(jt_log_has(SP_ERR_STALLED, NULL, "watchdog-gate"),
       "%s: the SP_ERR_STALLED message names the counter \"watchdog-gate\"", c->name);
    if (!jt_log_has(SP_ERR_STALLED, NULL, "watchdog-gate")) jt_log_diag();
    ok(parked, "%s: the wait went on after the report", c->name);
    ok(waited && atomic_load(&st.returned) && st.rc == SP_OK && sp_counter_value(all) == 0,
       "%s: signalled by hand, the parked job and the main thread's wait complete", c->name);
    ok(jt_log_count(SP_ERR_STALLED, SP_LOG_FATAL) == 0 &&
           jt_log_count(SP_ERR_STALLED, SP_LOG_ERROR) + jt_log_count(SP_ERR_STALLED, SP_LOG_WARN) >
               0,
       "%s: reported as a warning or error, not fatal", c->name);

    sp_jobs_status stat;
    bool settled = jt_settle(S, &stat);
    ok(settled && stat.jobs_run == stat.jobs_submitted, "%s: status: every job ran (%llu of %llu)",
       c->name, (unsigned long long)stat.jobs_run, (unsigned long long)stat.jobs_submitted);
    sp_counter_destroy(st.gate);
    sp_counter_destroy(busy);
    sp_counter_destroy(all);
    ok(sp_jobs_shutdown(S) == SP_OK, "%s: shutdown", c->name);
    sp_jobs_destroy(S);
    S = NULL;
}

int main(void) {
#if SP_DEBUG < 1
    skip_all("the watchdog exists only in debug builds (SP_DEBUG >= 1)");
#endif
    jt_log_capture();
    jt_deadline("watchdog, 2 workers", 30);
    run(&jt_sweep[2]);
    jt_deadline("watchdog, inline", 30);
    run(&jt_sweep[0]);
    alarm(0);
    jt_log_release();
    return done();
}
