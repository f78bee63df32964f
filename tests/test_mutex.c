/* sp_mutex under contention, swept over 1, 2, 4 and 8 threads; runs under TSan too, where
 * the plain counter below would be reported if the mutex did not order its accesses. */
#include <string.h>
#include <time.h>

#include "sp_platform.h"
#include "test_support.h"

typedef struct shared {
    sp_mutex lock;
    uint64_t counter; /* plain, deliberately: only the mutex protects it */
    uint64_t per_thread;
} shared;

static void *increment_run(void *arg) {
    shared *s = arg;
    for (uint64_t i = 0; i < s->per_thread; i++) {
        sp_mutex_lock(&s->lock);
        s->counter++;
        sp_mutex_unlock(&s->lock);
    }
    return NULL;
}

static void test_sweep(void) {
    const uint64_t total = ts_scaled(200000, 10);
    const int counts[] = {1, 2, 4, 8};
    for (size_t c = 0; c < 4; c++) {
        int n = counts[c];
        shared s = {{0}, 0, total / (uint64_t)n};
        sp_thread t[8];
        int started = 0;
        for (int i = 0; i < n; i++)
            if (sp_thread_start(&t[started], increment_run, &s, "sp-mutex") == SP_OK) started++;
        for (int i = 0; i < started; i++) sp_thread_join(t[i]);
        uint64_t want = s.per_thread * (uint64_t)n;
        ok(started == n && s.counter == want && s.lock.state == 0,
           "%d threads x %llu increments: counter %llu, lock free", n,
           (unsigned long long)s.per_thread, (unsigned long long)s.counter);
    }
}

static void *trylock_run(void *arg) {
    return sp_mutex_trylock(arg) ? (void *)1 : NULL;
}

static void test_trylock(void) {
    sp_mutex m = {0};
    sp_mutex_lock(&m);
    sp_thread t;
    bool got = true;
    if (sp_thread_start(&t, trylock_run, &m, "sp-try") == SP_OK) got = sp_thread_join(t) != NULL;
    ok(!got, "trylock fails while another thread holds the lock");
    sp_mutex_unlock(&m);
    got = false;
    if (sp_thread_start(&t, trylock_run, &m, "sp-try") == SP_OK) got = sp_thread_join(t) != NULL;
    ok(got, "trylock succeeds after unlock");
    ok(!sp_mutex_trylock(&m), "and the lock it took is still held");
    sp_mutex_unlock(&m);
    ok(sp_mutex_trylock(&m), "after that thread's lock is released, trylock succeeds here");
    sp_mutex_unlock(&m);
}

/* A sleeper in sp_mutex_lock must be woken by unlock (the futex path, state 2). */
typedef struct blocker {
    sp_mutex m;
    uint32_t acquired;
} blocker;

static void *blocker_run(void *arg) {
    blocker *b = arg;
    sp_mutex_lock(&b->m);
    __atomic_store_n(&b->acquired, 1, __ATOMIC_RELEASE);
    sp_mutex_unlock(&b->m);
    return NULL;
}

static void test_sleeper_woken(void) {
    blocker b = {{0}, 0};
    sp_mutex_lock(&b.m);
    sp_thread t;
    bool started = sp_thread_start(&t, blocker_run, &b, "sp-block") == SP_OK;
    /* Wait (up to 5 s) until the other thread has marked the mutex contended (state 2): only
     * then is it committed to the futex sleep this test is about. */
    uint32_t state = 0;
    uint64_t deadline = sp_time_ns() + 5000000000u;
    while (started && (state = __atomic_load_n(&b.m.state, __ATOMIC_ACQUIRE)) != 2 &&
           sp_time_ns() < deadline) {
        struct timespec d = {0, 1000 * 1000};
        nanosleep(&d, NULL);
    }
    bool early = __atomic_load_n(&b.acquired, __ATOMIC_ACQUIRE) != 0;
    sp_mutex_unlock(&b.m);
    if (started) sp_thread_join(t);
    ok(state == 2, "a second locker marks the mutex contended (state %u)", state);
    ok(started && !early && __atomic_load_n(&b.acquired, __ATOMIC_ACQUIRE) == 1,
       "the thread blocked in lock gets it after unlock");
}

static void test_unlock_misuse(void) {
    sp_mutex m = {0};
    ts_log_capture();
    sp_mutex_unlock(&m);
    ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_INVALID_ARG &&
           strcmp(ts_logged.last_call, "sp_mutex_unlock") == 0 && ts_logged.last_addr == &m &&
           m.state == 0,
       "unlock of an unlocked mutex is reported and leaves it unlocked");
    ts_log_release();
}

int main(void) {
    plan(11);
    if (ts_sanitized()) diag("sanitized build: fewer iterations");
    test_sweep();         /* 4 */
    test_trylock();       /* 4 */
    test_sleeper_woken(); /* 1 */
    test_unlock_misuse(); /* 1 */
    return done();
}
