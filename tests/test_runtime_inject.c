/* sp_init's unwind under injected failures. Linked with -Wl,--wrap for mmap, mmap64, munmap
 * and pthread_create (tests/meson.build): the k-th such call made by spindle fails, for every
 * k until init gets through. After each failed init, every mapping spindle made is gone again,
 * every thread it started has been joined, the failing subsystem is named, and a later init
 * with nothing injected works. */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>

#include "spindle.h"
#include "test_support.h"

/* ---- the wraps ------------------------------------------------------------------------- */

void *__real_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off);
void *__real_mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off);
int __real_munmap(void *addr, size_t len);
int __real_pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*fn)(void *), void *arg);
void *__wrap_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off);
void *__wrap_mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off);
int __wrap_munmap(void *addr, size_t len);
int __wrap_pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*fn)(void *), void *arg);

static atomic_long calls;      /* mmap and pthread_create calls counted since arming */
static atomic_long fail_at;    /* fail the call with this number (0: none) */
static atomic_long mapped;     /* bytes spindle has mapped and not unmapped (fresh mappings) */
static atomic_int failed_kind; /* 1 mmap, 2 pthread_create: what the injection hit */

static bool inject(int kind) {
    long n = atomic_fetch_add(&calls, 1) + 1;
    if (n != atomic_load(&fail_at)) return false;
    atomic_store(&failed_kind, kind);
    return true;
}

static void *map(void *(*real)(void *, size_t, int, int, int, off_t), void *addr, size_t len,
                 int prot, int flags, int fd, off_t off) {
    if (inject(1)) {
        errno = ENOMEM;
        return MAP_FAILED;
    }
    void *p = real(addr, len, prot, flags, fd, off);
    /* MAP_FIXED over our own range changes protection, it adds no mapping. */
    if (p != MAP_FAILED && !(flags & MAP_FIXED)) atomic_fetch_add(&mapped, (long)len);
    return p;
}
void *__wrap_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    return map(__real_mmap, addr, len, prot, flags, fd, off);
}
void *__wrap_mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    return map(__real_mmap64, addr, len, prot, flags, fd, off);
}
int __wrap_munmap(void *addr, size_t len) {
    int r = __real_munmap(addr, len);
    if (r == 0) atomic_fetch_sub(&mapped, (long)len);
    return r;
}
int __wrap_pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*fn)(void *), void *arg) {
    if (inject(2)) return EAGAIN;
    return __real_pthread_create(t, a, fn, arg);
}

/* ---- checks ---------------------------------------------------------------------------- */

static int thread_count(void) {
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    if (d) closedir(d);
    return n;
}

int main(void) {
    sp_desc d = ts_small_desc(2, 16);
    /* Warm up (one-time set-up in the C library and the sanitizers), then count a clean init. */
    if (sp_init(&d) != SP_OK || sp_shutdown() != SP_OK) {
        ok(0, "a clean init and shutdown");
        return done();
    }
    int threads0 = thread_count();
    long mapped0 = atomic_load(&mapped);
    atomic_store(&calls, 0);
    sp_init(&d);
    long clean_calls = atomic_load(&calls);
    sp_frame_begin();
    sp_frame_end();
    sp_shutdown();
    ok(clean_calls > 4, "a clean init makes %ld mmap/pthread_create calls", clean_calls);
    is_int(atomic_load(&mapped), mapped0, "a clean init + shutdown unmaps everything it mapped");

    ts_log_capture();
    bool named = true, unmapped = true, joined = true, reinit = true, hit_map = false,
         hit_thread = false, hit_reservation = false;
    long k;
    for (k = 1; k <= clean_calls; k++) {
        atomic_store(&calls, 0);
        atomic_store(&failed_kind, 0);
        atomic_store(&fail_at, k);
        sp_result r = sp_init(&d);
        atomic_store(&fail_at, 0);
        if (r == SP_OK) { /* the k-th call was one whose failure spindle absorbs (none now) */
            sp_shutdown();
            continue;
        }
        const char *who = sp_init_failure();
        named = named && who != NULL && strstr(ts_logged.last_message, who) != NULL;
        if (atomic_load(&failed_kind) == 1) hit_map = true;
        if (atomic_load(&failed_kind) == 2) hit_thread = true;
        if (who && !strcmp(who, "platform")) hit_reservation = true;
        if (atomic_load(&mapped) != mapped0) {
            unmapped = false;
            diag("k=%ld (%s): %ld bytes still mapped", k, who ? who : "?",
                 atomic_load(&mapped) - mapped0);
        }
        /* A joined thread may linger in /proc for a moment after pthread_join returned. */
        uint64_t t0 = sp_time_ns();
        while (thread_count() != threads0 && sp_time_ns() - t0 < 2000000000u) sp_thread_yield();
        if (thread_count() != threads0) {
            joined = false;
            diag("k=%ld (%s): %d threads, %d before", k, who ? who : "?", thread_count(), threads0);
        }
        sp_status st;
        sp_status_get(&st);
        if (st.initialised || sp_init(&d) != SP_OK || sp_shutdown() != SP_OK) {
            reinit = false;
            diag("k=%ld: init after the failure did not work", k);
        }
    }
    ts_log_release();
    ok(named, "every failed init named its subsystem in the log and in sp_init_failure");
    ok(unmapped, "after every failed init, every mapping spindle made is gone");
    ok(joined, "after every failed init, every thread spindle started has been joined");
    ok(reinit, "after every failed init, a new init and shutdown work");
    ok(hit_map && hit_reservation, "the injections hit the reservation and other mappings");
    ok(hit_thread, "the injections hit thread starts");
    return done();
}
