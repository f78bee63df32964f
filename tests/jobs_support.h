/* Helpers shared by the scheduler tests (test_jobs*.c): a logger that counts records per id and
 * level and keeps recent messages (any thread), the worker-count sweep, a bounded "settle" that
 * waits for the status figures to catch up with finished jobs, and small polling helpers.
 * Header-only (static inline) so it needs no change to the shared test_support library. */
#ifndef SP_JOBS_SUPPORT_H
#define SP_JOBS_SUPPORT_H

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sp_jobs.h"
#include "sp_platform.h"
#include "test_support.h"

#ifndef SP_DEBUG
#define SP_DEBUG 0
#endif

/* ---- counting logger ------------------------------------------------------------------- */

enum { JT_IDS = 16, JT_KEEP = 64 };

typedef struct jt_record {
    sp_log_level level;
    sp_result id;
    char call[48];
    char message[208];
} jt_record;

typedef struct jt_log {
    pthread_mutex_t lock;
    int total;
    int by_id[JT_IDS][SP_LOG_FATAL + 1]; /* [-id][level] */
    jt_record keep[JT_KEEP];             /* the first JT_KEEP records since the last reset */
    int kept;
} jt_log;

static jt_log jt_logged = {.lock = PTHREAD_MUTEX_INITIALIZER};

static inline void jt_log_fn(void *user, const sp_log_record *rec) {
    (void)user;
    pthread_mutex_lock(&jt_logged.lock);
    jt_logged.total++;
    int id = -(int)rec->id;
    if (id >= 0 && id < JT_IDS && rec->level <= SP_LOG_FATAL) jt_logged.by_id[id][rec->level]++;
    if (jt_logged.kept < JT_KEEP) {
        jt_record *k = &jt_logged.keep[jt_logged.kept++];
        k->level = rec->level;
        k->id = rec->id;
        snprintf(k->call, sizeof k->call, "%s", rec->call ? rec->call : "");
        snprintf(k->message, sizeof k->message, "%s", rec->message ? rec->message : "");
    }
    pthread_mutex_unlock(&jt_logged.lock);
}

static inline void jt_log_reset(void) {
    pthread_mutex_lock(&jt_logged.lock);
    jt_logged.total = 0;
    jt_logged.kept = 0;
    memset(jt_logged.by_id, 0, sizeof jt_logged.by_id);
    pthread_mutex_unlock(&jt_logged.lock);
}

/* Route the library's messages here. The misuse policy is left as the build has it; tests
 * that provoke misuse in-process switch it off themselves (sp_misuse_set_fatal(false)). */
static inline void jt_log_capture(void) {
    jt_log_reset();
    sp_log_set(jt_log_fn, NULL);
}

static inline void jt_log_release(void) {
    sp_log_set(NULL, NULL);
    sp_misuse_set_fatal(SP_DEBUG >= 1);
}

/* Records with `id` at any level (level < 0) or at exactly `level`. */
static inline int jt_log_count(sp_result id, int level) {
    int n = 0, i = -(int)id;
    pthread_mutex_lock(&jt_logged.lock);
    if (i >= 0 && i < JT_IDS)
        for (int l = 0; l <= SP_LOG_FATAL; l++)
            if (level < 0 || level == l) n += jt_logged.by_id[i][l];
    pthread_mutex_unlock(&jt_logged.lock);
    return n;
}

static inline int jt_log_total(void) {
    pthread_mutex_lock(&jt_logged.lock);
    int n = jt_logged.total;
    pthread_mutex_unlock(&jt_logged.lock);
    return n;
}

/* Whether a kept record has `id` and, if given, `call` equal and `needle` in its message. */
static inline bool jt_log_has(sp_result id, const char *call, const char *needle) {
    bool found = false;
    pthread_mutex_lock(&jt_logged.lock);
    for (int i = 0; i < jt_logged.kept && !found; i++) {
        jt_record *k = &jt_logged.keep[i];
        found = k->id == id && (!call || strcmp(k->call, call) == 0) &&
                (!needle || strstr(k->message, needle) != NULL);
    }
    pthread_mutex_unlock(&jt_logged.lock);
    return found;
}

/* The newest kept record; false if none. */
static inline bool jt_log_last(jt_record *out) {
    pthread_mutex_lock(&jt_logged.lock);
    bool any = jt_logged.kept > 0;
    if (any) *out = jt_logged.keep[jt_logged.kept - 1];
    pthread_mutex_unlock(&jt_logged.lock);
    return any;
}

/* Print the kept records as TAP diagnostics. */
static inline void jt_log_diag(void) {
    pthread_mutex_lock(&jt_logged.lock);
    for (int i = 0; i < jt_logged.kept; i++)
        diag("  logged: level %d %s from %s: %s", (int)jt_logged.keep[i].level,
             sp_result_name(jt_logged.keep[i].id), jt_logged.keep[i].call,
             jt_logged.keep[i].message);
    pthread_mutex_unlock(&jt_logged.lock);
}

/* ---- a hang is a failure, not a timeout -------------------------------------------------- */

static const char *volatile jt_phase = "start";

static inline void jt_on_alarm(int sig) {
    (void)sig;
    static const char head[] = "not ok - hung (no progress before the deadline) in: ";
    (void)!write(STDOUT_FILENO, head, sizeof head - 1);
    const char *p = jt_phase;
    (void)!write(STDOUT_FILENO, p, strlen(p));
    (void)!write(STDOUT_FILENO, "\n", 1);
    _exit(1);
}

/* Name the phase about to run and give it `seconds` (3x under ASan/UBSan, 8x under TSan)
 * before the process reports a hang and exits 1. */
static inline void jt_deadline(const char *phase, unsigned seconds) {
    jt_phase = phase;
    signal(SIGALRM, jt_on_alarm);
    alarm(SP_TSAN ? seconds * 8 : ts_sanitized() ? seconds * 3 : seconds);
}

/* ---- sweep ----------------------------------------------------------------------------- */

typedef struct jt_config {
    const char *name;
    bool no_workers;
    uint32_t workers;
} jt_config;

static const jt_config jt_sweep[] = {
    {"inline", true, 0},     {"1 worker", false, 1},  {"2 workers", false, 2},
    {"4 workers", false, 4}, {"8 workers", false, 8},
};
enum { JT_SWEEP = sizeof jt_sweep / sizeof jt_sweep[0] };

/* ---- waiting without running jobs ------------------------------------------------------ */

enum { JT_PATIENCE_MS = 20000 }; /* a bound for things that must happen, never a timing check */

/* Poll (yielding) until *flag reaches want; false after JT_PATIENCE_MS. */
static inline bool jt_poll_int(atomic_int *v, int want) {
    uint64_t t0 = sp_time_ns();
    while (atomic_load(v) < want) {
        if (sp_time_ns() - t0 > (uint64_t)JT_PATIENCE_MS * 1000000u) return false;
        sp_thread_yield();
    }
    return true;
}

/* Poll until the counter is <= target, without running jobs; false after JT_PATIENCE_MS. */
static inline bool jt_poll_counter(const sp_counter *c, int64_t target) {
    uint64_t t0 = sp_time_ns();
    while (sp_counter_value(c) > target) {
        if (sp_time_ns() - t0 > (uint64_t)JT_PATIENCE_MS * 1000000u) return false;
        sp_thread_yield();
    }
    return true;
}

/* The status figures are atomics updated around a job's end, not necessarily before its
 * counter is signalled: poll until jobs_run catches up with jobs_submitted (bounded). */
static inline bool jt_settle(sp_jobs *s, sp_jobs_status *st) {
    uint64_t t0 = sp_time_ns();
    for (;;) {
        sp_jobs_status_get(s, st);
        if (st->jobs_run == st->jobs_submitted) return true;
        if (sp_time_ns() - t0 > (uint64_t)JT_PATIENCE_MS * 1000000u) return false;
        sp_thread_yield();
    }
}

/* A counter of s, or a failed TAP line naming the configuration and exit(1). */
static inline sp_counter *jt_counter(sp_jobs *s, const char *cfg, const char *name) {
    sp_counter *c = sp_counter_create(s, name);
    if (!c) {
        ok(0, "%s: sp_counter_create(%s)", cfg, name);
        exit(1);
    }
    return c;
}

static inline sp_job_desc jt_job(sp_job_fn fn, void *arg, const char *name) {
    return (sp_job_desc){.fn = fn, .arg = arg, .name = name};
}

#endif
