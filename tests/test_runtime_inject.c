/* sp_init's unwind under injected failures. Linked with -Wl,--wrap for mmap, mmap64, munmap
 * and pthread_create (tests/meson.build): the k-th such call made by spindle fails, for every
 * k until init gets through. Also wrapped, to see the order in which subsystems stop: the call
 * each subsystem's stop makes (sp_jobs_destroy, sp_handle_heap_destroy, sp_frame_arena_destroy,
 * sp_tcache_thread_detach, sp_tcache_shutdown, and the munmap of the reservation). After each
 * failed init, every mapping spindle made is gone again, every thread it started has been joined,
 * no thread cache is left, the failing subsystem is named, and a later init with nothing injected
 * works. A second pass does the same with the k-th heap allocation (malloc, calloc, realloc,
 * aligned_alloc, posix_memalign: also wrapped) that sp_init makes on the calling thread; what a
 * failed init leaked of them LeakSanitizer reports in the ASan build. The allocations the workers'
 * threads make as they start are not failed (their cache records; the scheduler makes their thread
 * fibers on this thread). */
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
void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);
int __real_posix_memalign(void **out, size_t align, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t n);
void *__wrap_aligned_alloc(size_t align, size_t n);
int __wrap_posix_memalign(void **out, size_t align, size_t n);

static atomic_long calls;      /* mmap and pthread_create calls counted since arming */
static atomic_long fail_at;    /* fail the call with this number (0: none) */
static atomic_long mapped;     /* bytes spindle has mapped and not unmapped (fresh mappings) */
static atomic_int failed_kind; /* 1 mmap, 2 pthread_create, 3 heap: what the injection hit */
/* The heap pass: allocations counted and failed only on this thread, while armed. */
static pthread_t main_thread;
static atomic_bool heap_armed;
static atomic_long heap_calls, heap_fail_at;

static bool heap_inject(void) {
    if (!atomic_load(&heap_armed) || !pthread_equal(pthread_self(), main_thread)) return false;
    long n = atomic_fetch_add(&heap_calls, 1) + 1;
    if (n != atomic_load(&heap_fail_at)) return false;
    atomic_store(&failed_kind, 3);
    return true;
}
void *__wrap_malloc(size_t n) {
    return heap_inject() ? NULL : __real_malloc(n);
}
void *__wrap_calloc(size_t n, size_t size) {
    return heap_inject() ? NULL : __real_calloc(n, size);
}
void *__wrap_realloc(void *p, size_t n) {
    return heap_inject() ? NULL : __real_realloc(p, n);
}
void *__wrap_aligned_alloc(size_t align, size_t n) {
    return heap_inject() ? NULL : __real_aligned_alloc(align, n);
}
int __wrap_posix_memalign(void **out, size_t align, size_t n) {
    return heap_inject() ? ENOMEM : __real_posix_memalign(out, align, n);
}

/* ---- the stop order -------------------------------------------------------------------- */

/* What the main thread's stops called, in order: subsystem names joined by ','. */
static char stops[256];
static _Atomic size_t reservation; /* bytes of the runtime's reservation (sp_status) */

static void stop_seen(const char *who) {
    if (!pthread_equal(pthread_self(), main_thread) ||
        strlen(stops) + strlen(who) + 2 > sizeof stops)
        return;
    if (stops[0]) strcat(stops, ",");
    strcat(stops, who);
}

void __real_sp_jobs_destroy(sp_jobs *s);
void __real_sp_handle_heap_destroy(sp_handle_heap *h);
void __real_sp_frame_arena_destroy(sp_frame_arena *a);
void __real_sp_tcache_thread_detach(void);
size_t __real_sp_tcache_shutdown(void);
void __wrap_sp_jobs_destroy(sp_jobs *s);
void __wrap_sp_handle_heap_destroy(sp_handle_heap *h);
void __wrap_sp_frame_arena_destroy(sp_frame_arena *a);
void __wrap_sp_tcache_thread_detach(void);
size_t __wrap_sp_tcache_shutdown(void);
void __wrap_sp_jobs_destroy(sp_jobs *s) {
    stop_seen("jobs");
    __real_sp_jobs_destroy(s);
}
void __wrap_sp_handle_heap_destroy(sp_handle_heap *h) {
    stop_seen("handle heap");
    __real_sp_handle_heap_destroy(h);
}
void __wrap_sp_frame_arena_destroy(sp_frame_arena *a) {
    stop_seen("frame arenas");
    __real_sp_frame_arena_destroy(a);
}
void __wrap_sp_tcache_thread_detach(void) {
    stop_seen("thread caches");
    __real_sp_tcache_thread_detach();
}
size_t __wrap_sp_tcache_shutdown(void) {
    stop_seen("central heap");
    return __real_sp_tcache_shutdown();
}

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
    /* The reservation by its length: with this test's desc no other munmap spindle makes has
     * it (the fiber pool's is about 1 GiB, the reservation's trimmed ends under 2 MiB). */
    if (len == atomic_load(&reservation)) stop_seen("platform");
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

/* The documented start order (sp_runtime.h). An injected failure stops init in the subsystem
 * starting then: as k grows, the failing subsystem never goes back in this order. */
static const char *const start_order[] = {"platform",     "central heap", "thread caches",
                                          "frame arenas", "handle heap",  "jobs"};
enum { STARTS = sizeof start_order / sizeof start_order[0] };

static int order_of(const char *who) {
    for (int i = 0; i < STARTS; i++)
        if (who && !strcmp(who, start_order[i])) return i;
    return -1;
}

/* Whether the stops seen since `stops` was cleared are those of the first n subsystems in
 * reverse start order (who: the failing subsystem, or NULL). Of the subsystems, only jobs
 * calls a wrapped stop in its own cleanup (sp_jobs_destroy, when its frame counter could not be
 * made): one "jobs" first is set aside after a jobs failure, nothing else. */
static bool stopped_in_reverse(int n, const char *who) {
    char want[256] = "";
    for (int i = n; i-- > 0;) {
        if (want[0]) strcat(want, ",");
        strcat(want, start_order[i]);
    }
    const char *seen = stops;
    if (who && !strcmp(who, "jobs") && !strncmp(seen, "jobs", 4) && (seen[4] == ',' || !seen[4]))
        seen += 4 + (seen[4] == ',');
    if (!strcmp(seen, want)) return true;
    diag("stops: '%s', want '%s' (after %s's own)", stops, want, who ? who : "none");
    return false;
}

/* After a failed init: nothing of it left (mappings, threads, thread caches), and a new init
 * works. False, with a diag, otherwise. */
static bool unwound(long k, const char *who, long mapped0, int threads0, const sp_desc *d) {
    bool good = true;
    if (atomic_load(&mapped) != mapped0) {
        good = false;
        diag("k=%ld (%s): %ld bytes still mapped", k, who ? who : "?",
             atomic_load(&mapped) - mapped0);
    }
    /* A joined thread may linger in /proc for a moment after pthread_join returned. */
    uint64_t t0 = sp_time_ns();
    while (thread_count() != threads0 && sp_time_ns() - t0 < 2000000000u) sp_thread_yield();
    if (thread_count() != threads0) {
        good = false;
        diag("k=%ld (%s): %d threads, %d before", k, who ? who : "?", thread_count(), threads0);
    }
    sp_tcache_status ts;
    sp_tcache_status_get(&ts);
    if (ts.caches != 0) {
        good = false;
        diag("k=%ld (%s): %zu thread caches left", k, who ? who : "?", ts.caches);
    }
    sp_status st;
    sp_status_get(&st);
    if (st.initialised || sp_init(d) != SP_OK || sp_shutdown() != SP_OK) {
        good = false;
        diag("k=%ld: init after the failure did not work", k);
    }
    return good;
}

int main(void) {
    main_thread = pthread_self();
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
    sp_init(&d);
    sp_status rs;
    sp_status_get(&rs);
    atomic_store(&reservation, rs.reserved);
    stops[0] = 0;
    sp_shutdown();
    ok(stopped_in_reverse(STARTS, NULL),
       "sp_shutdown stops the subsystems in reverse start order (%s)", stops);
    is_int(atomic_load(&mapped), mapped0, "a clean init + shutdown unmaps everything it mapped");

    ts_log_capture();
    bool named = true, clean = true, hit_map = false, hit_thread = false, hit_reservation = false,
         ordered = true;
    int last_order = -1;
    long k;
    bool reversed = true;
    for (k = 1; k <= clean_calls; k++) {
        atomic_store(&calls, 0);
        atomic_store(&failed_kind, 0);
        atomic_store(&fail_at, k);
        stops[0] = 0;
        sp_result r = sp_init(&d);
        atomic_store(&fail_at, 0);
        if (r == SP_OK) { /* the k-th call was one whose failure spindle absorbs (none now) */
            sp_shutdown();
            continue;
        }
        const char *who = sp_init_failure();
        named = named && who != NULL && strstr(ts_logged.last_message, who) != NULL &&
                ts_logged.last_level == SP_LOG_WARN;
        if (atomic_load(&failed_kind) == 1) hit_map = true;
        if (atomic_load(&failed_kind) == 2) hit_thread = true;
        if (who && !strcmp(who, "platform")) hit_reservation = true;
        int o = order_of(who);
        ordered = ordered && o >= last_order;
        last_order = o > last_order ? o : last_order;
        reversed = stopped_in_reverse(o, who) && reversed;
        clean = unwound(k, who, mapped0, threads0, &d) && clean;
    }
    ts_log_release();
    ok(named, "every failed init named its subsystem in the log (at warning level: a resource "
              "failure) and in sp_init_failure");
    ok(clean, "after every failed init: every mapping spindle made gone, every thread it started "
              "joined, no thread cache left, and a new init and shutdown work");
    ok(hit_map && hit_reservation, "the injections hit the reservation and other mappings");
    ok(hit_thread, "the injections hit thread starts");

    /* The heap pass. */
    atomic_store(&heap_calls, 0);
    atomic_store(&heap_armed, true);
    sp_init(&d);
    atomic_store(&heap_armed, false);
    long clean_heap = atomic_load(&heap_calls);
    sp_shutdown();
    ok(clean_heap > 4, "a clean init makes %ld heap allocations on its thread", clean_heap);
    ts_log_capture();
    bool heap_named = true, heap_clean = true;
    last_order = -1;
    int failures = 0, absorbed = 0;
    char subsystems[256] = "";
    for (k = 1; k <= clean_heap; k++) {
        atomic_store(&heap_calls, 0);
        atomic_store(&failed_kind, 0);
        atomic_store(&heap_fail_at, k);
        atomic_store(&heap_armed, true);
        stops[0] = 0;
        sp_result r = sp_init(&d);
        atomic_store(&heap_armed, false);
        atomic_store(&heap_fail_at, 0);
        if (r == SP_OK) { /* absorbed (the debug watchdog's thread start: the scheduler goes on) */
            absorbed++;
            sp_shutdown();
            continue;
        }
        failures++;
        const char *who = sp_init_failure();
        heap_named = heap_named && who != NULL && strstr(ts_logged.last_message, who) != NULL &&
                     ts_logged.last_level == SP_LOG_WARN;
        int o = order_of(who);
        ordered = ordered && o >= last_order;
        last_order = o > last_order ? o : last_order;
        reversed = stopped_in_reverse(o, who) && reversed;
        if (who && !strstr(subsystems, who) && strlen(subsystems) + strlen(who) + 3 < 256) {
            strcat(subsystems, subsystems[0] ? ", " : "");
            strcat(subsystems, who);
        }
        heap_clean = unwound(k, who, mapped0, threads0, &d) && heap_clean;
    }
    ts_log_release();
    ok(failures > 0 && heap_named,
       "%d of %ld failed allocations failed init, each naming its subsystem (%s); %d absorbed",
       failures, clean_heap, subsystems, absorbed);
    ok(heap_clean, "after each: nothing mapped, no thread, no thread cache left; a new init works");
    ok(ordered, "in both passes the failing subsystem follows the documented start order "
                "(platform, central heap, thread caches, frame arenas, handle heap, jobs)");
    ok(reversed, "in both passes a failed init stops the subsystems started before the failing "
                 "one in reverse order");
    return done();
}
