/* The logger may be replaced while other threads log (sp_log.h): a record must reach either
 * the old or the new logger with that logger's own user pointer, never a mix of the two.
 * Setters flip between two (fn, user) pairs while loggers run; each fn checks its user. */
#include <stdatomic.h>

#include "sp_platform.h"
#include "test_support.h"

static int tag_a, tag_b;
static atomic_long seen_a, seen_b, torn;
static atomic_bool stop;

static void log_a(void *user, const sp_log_record *rec) {
    (void)rec;
    if (user != &tag_a) atomic_fetch_add(&torn, 1);
    atomic_fetch_add(&seen_a, 1);
}

static void log_b(void *user, const sp_log_record *rec) {
    (void)rec;
    if (user != &tag_b) atomic_fetch_add(&torn, 1);
    atomic_fetch_add(&seen_b, 1);
}

static void *flip(void *arg) {
    (void)arg;
    for (long i = 0; !atomic_load(&stop); i++) {
        if (i & 1)
            sp_log_set(log_a, &tag_a);
        else
            sp_log_set(log_b, &tag_b);
    }
    return NULL;
}

/* Log at least `n` records, and on until both loggers have served a good number of them
 * (or 10 s pass), so the test does not depend on how the threads happen to be scheduled. */
static atomic_long spoken;

static void *speak(void *arg) {
    long n = *(long *)arg;
    uint64_t deadline = sp_time_ns() + 10000000000u;
    for (long i = 0;; i++) {
        if (i >= n && ((atomic_load(&seen_a) >= 1000 && atomic_load(&seen_b) >= 1000) ||
                       sp_time_ns() > deadline))
            break;
        sp_log(SP_LOG_INFO, SP_OK, "speak", NULL, "record %ld", i);
        atomic_fetch_add(&spoken, 1);
    }
    return NULL;
}

int main(void) {
    long per_thread = (long)ts_scaled(200000, 20);
    sp_log_set(log_a, &tag_a);
    sp_thread setters[2], loggers[2];
    for (int i = 0; i < 2; i++) sp_thread_start(&setters[i], flip, NULL, "log-flip");
    for (int i = 0; i < 2; i++) sp_thread_start(&loggers[i], speak, &per_thread, "log-speak");
    for (int i = 0; i < 2; i++) sp_thread_join(loggers[i]);
    atomic_store(&stop, true);
    for (int i = 0; i < 2; i++) sp_thread_join(setters[i]);
    sp_log_set(NULL, NULL);
    long a = atomic_load(&seen_a), b = atomic_load(&seen_b);
    is_int(a + b, atomic_load(&spoken), "every record reached exactly one logger");
    is_int(atomic_load(&torn), 0, "no logger saw another logger's user pointer");
    ok(a > 0 && b > 0, "both loggers were in use (%ld / %ld records)", a, b);
    return done();
}
