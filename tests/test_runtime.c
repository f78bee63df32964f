/* The runtime (sp_runtime.h): lifecycle errors, regions, the persistent region, the frame
 * loop (frame counter, lifetime of arena data over N buffers, overflow in both modes,
 * statistics), between-frames works, handle-heap compaction between frames, sp_retire,
 * thread attach/detach, and the thread caches' tidy at frame end. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "jobs_internal.h"    /* white box: a taker short of job records */
#include "runtime_internal.h" /* white box: the frame gate */
#include "spindle.h"
#include "tcache_heap.h" /* white box: the fallback cache's lock */
#include "test_support.h"

#define MiB ((size_t)1 << 20)

static sp_desc small_desc(uint32_t workers) {
    return ts_small_desc(workers, 16);
}

/* sp_init with small_desc(workers); false, with a failed line, if it fails. */
static bool init_small(uint32_t workers) {
    sp_desc d = small_desc(workers);
    if (sp_init(&d) == SP_OK) return true;
    ok(0, "init");
    return false;
}

static void test_before_init(void) {
    ts_log_capture();
    is_int(sp_frame_begin(), SP_ERR_SHUTDOWN, "frame_begin before init: SP_ERR_SHUTDOWN");
    ok(ts_logged.last_id == SP_ERR_SHUTDOWN && !strcmp(ts_logged.last_call, "sp_frame_begin"),
       "... logged, naming the call");
    is_int(sp_frame_end(), SP_ERR_SHUTDOWN, "frame_end before init");
    is_int(sp_shutdown(), SP_ERR_SHUTDOWN, "shutdown before init");
    ok(sp_persistent_alloc(16, 0) == NULL, "persistent_alloc before init: NULL");
    ok(sp_arena_alloc(16) == NULL, "arena_alloc before init: NULL");
    sp_job_desc j = {.fn = (sp_job_fn)abort};
    is_int(sp_submit(&j, 1, NULL), SP_ERR_SHUTDOWN, "submit before init");
    is_int(sp_thread_attach(), SP_ERR_SHUTDOWN, "thread_attach before init");
    ok(sp_scheduler() == NULL && sp_handles() == NULL && sp_frames() == NULL,
       "subsystem getters before init: NULL");
    ok(sp_region_of(&j) == SP_REGION_NONE, "region_of before init: NONE");
    sp_status st;
    sp_status_get(&st);
    ok(!st.initialised, "status: not initialised");

    sp_desc d = small_desc(1);
    d.canary_begin = 0xdeadbeef;
    is_int(sp_init(&d), SP_ERR_INVALID_ARG, "a non-zero canary_begin is refused");
    ok(strstr(ts_logged.last_message, "canar") != NULL, "... the message says why");
    d = small_desc(1);
    d.canary_end = 1;
    is_int(sp_init(&d), SP_ERR_INVALID_ARG, "a non-zero canary_end is refused");
    d = small_desc(1);
    d.frame_buffers = 5;
    is_int(sp_init(&d), SP_ERR_INVALID_ARG, "frame_buffers 5 is refused");
    sp_status_get(&st);
    ok(!st.initialised && sp_init_failure() == NULL, "... nothing started");
    /* One buffer: a frame's data would go at its own sp_frame_end. */
    d = small_desc(1);
    d.frame_buffers = 1;
    ts_log_reset();
    is_int(sp_init(&d), SP_ERR_INVALID_ARG, "frame_buffers 1 is refused");
    sp_status_get(&st);
    ok(!st.initialised && sp_init_failure() == NULL && ts_logged.count == 1 &&
           !strcmp(ts_logged.last_call, "sp_init") &&
           strstr(ts_logged.last_message, "frame_buffers 1") != NULL,
       "... reported under sp_init, naming frame_buffers; nothing started");
    if (st.initialised) sp_shutdown();
    ts_log_release();
}

static void test_regions(void) {
    sp_desc d = small_desc(2);
    is_int(sp_init(&d), SP_OK, "init with 2 workers");
    ts_log_capture();
    is_int(sp_init(&d), SP_ERR_INVALID_ARG, "init twice: SP_ERR_INVALID_ARG");
    ts_log_release();

    sp_status st;
    sp_status_get(&st);
    ok(st.initialised && st.reserved >= 64 * MiB + 2 * 2 * MiB + 16 * MiB + 2 * MiB,
       "status: initialised, %zu bytes reserved", st.reserved);
    const char *names[] = {"none", "heap", "frame", "handle", "persistent"};
    bool named = true, ordered = true;
    for (int r = 1; r < SP_REGION_COUNT; r++) {
        named = named && !strcmp(st.regions[r].name, names[r]);
        if (r > 1)
            ordered = ordered && (char *)st.regions[r].base ==
                                     (char *)st.regions[r - 1].base + st.regions[r - 1].size;
    }
    ok(named && ordered, "regions named and carved back to back from one range");
    for (int r = 1; r < SP_REGION_COUNT; r++) {
        char *b = st.regions[r].base;
        ok(sp_region_of(b) == (sp_region)r &&
               sp_region_of(b + st.regions[r].size - 1) == (sp_region)r,
           "region_of: first and last byte of '%s'", names[r]);
    }
    ok(sp_region_of((char *)st.regions[1].base - 1) == SP_REGION_NONE &&
           sp_region_of((char *)st.regions[4].base + st.regions[4].size) == SP_REGION_NONE,
       "region_of: the bytes just outside the reservation are NONE");

    void *small = sp_tcache_alloc(100), *large = sp_tcache_alloc(1 * MiB);
    ok(sp_region_of(small) == SP_REGION_HEAP && sp_region_of(large) == SP_REGION_HEAP,
       "thread-cache blocks, small and large, are in the heap region");
    sp_tcache_free(small);
    sp_tcache_free(large);
    sp_frame_begin();
    void *f = sp_arena_alloc(64);
    ok(f && sp_region_of(f) == SP_REGION_FRAME, "an arena block is in the frame region");
    sp_frame_end();
    sp_handle h = sp_handle_alloc(sp_handles(), 100, 16);
    ok(h.id && sp_region_of(sp_handle_resolve(sp_handles(), h)) == SP_REGION_HANDLE,
       "a handle's block is in the handle region");
    sp_handle_free(sp_handles(), h);
    void *m = malloc(16);
    ok(sp_region_of(m) == SP_REGION_NONE && sp_region_of(&st) == SP_REGION_NONE,
       "malloc and stack memory are NONE");
    free(m);

    /* Persistent region: alignment, contents, full, misuse. */
    bool aligned = true;
    for (size_t a = 1; a <= 4096; a *= 2) {
        uint8_t *p = sp_persistent_alloc(40, a);
        aligned = aligned && p && ((uintptr_t)p & (a - 1)) == 0 &&
                  sp_region_of(p) == SP_REGION_PERSISTENT;
        if (p) memset(p, 0x5a, 40);
    }
    ok(aligned, "persistent_alloc: alignments 1..4096 honoured, in the persistent region");
    uint8_t *big = sp_persistent_alloc(MiB, 64);
    ok(big != NULL, "persistent_alloc of 1 MiB");
    if (big) memset(big, 1, MiB); /* committed: touching it all must not fault */
    ts_log_capture();
    ok(sp_persistent_alloc(2 * MiB, 16) == NULL && ts_logged.last_id == SP_ERR_NOMEM,
       "persistent_alloc past the region: NULL, SP_ERR_NOMEM logged");
    ts_log_reset();
    sp_handle big_align = sp_handle_alloc(sp_handles(), 16, 8192);
    sp_counter *no_counter = sp_counter_create(NULL, "x");
    sp_result no_fn = sp_retire(&big_align, NULL);
    void *huge = sp_persistent_alloc(SIZE_MAX, 16);
    ok(big_align.id == 0 && !no_counter && no_fn == SP_ERR_INVALID_ARG && !huge &&
           ts_logged.count == 4,
       "handle alignment 8192 {0}, sp_counter_create(NULL) NULL, sp_retire without free_fn "
       "SP_ERR_INVALID_ARG, persistent SIZE_MAX NULL: each reported (%d of 4)",
       ts_logged.count);
    ok(sp_persistent_alloc(16, 24) == NULL && ts_logged.last_id == SP_ERR_BAD_ALIGNMENT,
       "persistent_alloc with alignment 24: NULL, SP_ERR_BAD_ALIGNMENT");
    ts_log_release();
    ok(sp_persistent_alloc(16, 16) != NULL, "... and the region still serves what fits");

    is_int(sp_shutdown(), SP_OK, "shutdown");
    ts_log_capture();
    is_int(sp_shutdown(), SP_ERR_SHUTDOWN, "shutdown twice: SP_ERR_SHUTDOWN");
    ts_log_release();
    ok(sp_region_of(big) == SP_REGION_NONE, "after shutdown nothing is attributed");
}

/* ---- the frame loop -------------------------------------------------------------------- */

static atomic_int jobs_done;

static void slow_job(void *arg) {
    (void)arg;
    static _Atomic uint64_t sink;
    uint64_t x = 0;
    for (int i = 0; i < 20000; i++) x = x * 31 + (uint64_t)i;
    atomic_fetch_add_explicit(&sink, x, memory_order_relaxed);
    uint8_t *p = sp_arena_alloc(48);
    if (p) memset(p, 7, 48);
    atomic_fetch_add(&jobs_done, 1);
}

static void test_frame_jobs(uint32_t workers) {
    sp_desc d = small_desc(workers);
    if (sp_init(&d) != SP_OK) {
        ok(0, "init (%u workers)", workers);
        return;
    }
    sp_frame_stats none;
    is_int(sp_frame_stats_last(&none), SP_ERR_LIMIT, "no statistics before the first frame");
    enum { N = 64 };
    sp_job_desc jobs[N];
    for (int i = 0; i < N; i++) jobs[i] = (sp_job_desc){.fn = slow_job, .name = "slow"};
    bool all = true;
    for (int f = 0; f < 5; f++) {
        atomic_store(&jobs_done, 0);
        sp_frame_begin();
        if (sp_submit(jobs, N, NULL) != SP_OK) all = false;
        sp_frame_end();
        all = all && atomic_load(&jobs_done) == N;
    }
    ok(all, "%u workers: sp_frame_end waits for every job submitted on the frame counter", workers);
    sp_frame_stats st;
    is_int(sp_frame_stats_last(&st), SP_OK, "stats of the last frame");
    ok(st.frame == 4 && st.jobs_run >= N && st.arena_bytes >= N * 48 && st.frame_ns >= st.wait_ns,
       "... frame 4, %llu jobs run, %zu arena bytes, frame %llu ns >= wait %llu ns",
       (unsigned long long)st.jobs_run, st.arena_bytes, (unsigned long long)st.frame_ns,
       (unsigned long long)st.wait_ns);
    /* heap_bytes: the central heap's bytes in use (spans and large blocks), read without
     * walking the caches. */
    const size_t big_size = (size_t)4 << 20;
    void *big = sp_tcache_alloc(big_size);
    sp_frame_stats with, without;
    sp_frame_begin();
    sp_frame_end();
    sp_frame_stats_last(&with);
    sp_tcache_free(big);
    sp_frame_begin();
    sp_frame_end();
    sp_frame_stats_last(&without);
    ok(big && with.heap_bytes >= without.heap_bytes + big_size &&
           with.heap_high_water >= with.heap_bytes,
       "... heap_bytes counts a 4 MiB block while it lives (%zu, then %zu; high water %zu)",
       with.heap_bytes, without.heap_bytes, with.heap_high_water);
    ts_log_capture();
    is_int(sp_frame_end(), SP_ERR_INVALID_ARG, "frame_end without begin: SP_ERR_INVALID_ARG");
    sp_frame_begin();
    is_int(sp_frame_begin(), SP_ERR_INVALID_ARG, "frame_begin twice: SP_ERR_INVALID_ARG");
    is_int(sp_shutdown(), SP_ERR_INVALID_ARG, "shutdown inside a frame is refused");
    ts_log_release();
    sp_frame_end();
    /* Jobs on the frame counter still pending at shutdown run first, quietly. */
    atomic_store(&jobs_done, 0);
    sp_submit(jobs, N, NULL);
    ts_log_capture();
    is_int(sp_shutdown(), SP_OK, "shutdown with frame jobs pending");
    ok(ts_logged.count == 0 && atomic_load(&jobs_done) == N,
       "... they ran first (%d of %d), nothing reported", atomic_load(&jobs_done), N);
    ts_log_release();
}

/* Data of frame i lives through frame i + N - 1; at frame i + N the buffer is reused. */
static void test_lifetime(uint32_t buffers) {
    sp_desc d = small_desc(1);
    d.frame_buffers = buffers;
    if (sp_init(&d) != SP_OK) {
        ok(0, "init (%u buffers)", buffers);
        return;
    }
    enum { FRAMES = 12, BYTES = 4096 };
    uint8_t *blocks[FRAMES];
    bool intact = true, parity = true, reused = true;
    for (int f = 0; f < FRAMES; f++) {
        sp_frame_begin();
        blocks[f] = sp_arena_alloc(BYTES);
        memset(blocks[f], f + 1, BYTES);
        parity = parity && sp_frame_arena_buffer_of(sp_frames(), blocks[f]) == f % (int)buffers;
        if (f >= (int)buffers) reused = reused && blocks[f] == blocks[f - buffers];
        /* Every block of the frames still alive holds its pattern. */
        for (int g = f - (int)buffers + 1; g <= f; g++)
            if (g >= 0) intact = intact && ts_filled(blocks[g], BYTES, (uint8_t)(g + 1));
        sp_frame_end();
    }
    ok(parity, "%u buffers: frame i allocates from buffer i mod %u", buffers, buffers);
    ok(intact, "%u buffers: data of frame i intact through frame i+%u", buffers, buffers - 1);
    ok(reused, "%u buffers: frame i+%u reuses frame i's memory", buffers, buffers);
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

static void test_overflow(sp_frame_overflow mode) {
    sp_desc d = small_desc(1);
    d.frame_overflow = mode;
    sp_init(&d);
    sp_tcache_status before;
    sp_tcache_status_get(&before);
    sp_frame_begin();
    ts_log_capture();
    size_t got = 0, nulls = 0;
    for (int i = 0; i < 80; i++) { /* 80 x 64 KiB into a 2 MiB buffer */
        void *p = sp_arena_alloc(64 * 1024);
        if (p) {
            memset(p, 3, 64 * 1024);
            got++;
        } else {
            nulls++;
        }
    }
    sp_frame_end();
    const char *name = mode == SP_FRAME_OVERFLOW_NULL ? "NULL mode" : "heap mode";
    ok(ts_logged.count >= 1 && ts_logged.last_id == SP_ERR_NOMEM,
       "%s: the overflow is reported through the logger", name);
    ts_log_release();
    sp_frame_stats st;
    sp_frame_stats_last(&st);
    if (mode == SP_FRAME_OVERFLOW_NULL) {
        ok(got >= 25 && got < 80 && nulls == 80 - got,
           "%s: the buffer serves what fits (%zu), then NULL (%zu)", name, got, nulls);
        ok(st.arena_overflows == nulls && st.arena_overflow_bytes == 0,
           "%s: every refusal counted (%zu overflows)", name, st.arena_overflows);
    } else {
        ok(got == 80 && nulls == 0, "%s: every request served", name);
        ok(st.arena_overflows > 0 && st.arena_overflow_bytes == st.arena_overflows * 64 * 1024,
           "%s: overflows counted (%zu, %zu bytes from the central heap)", name, st.arena_overflows,
           st.arena_overflow_bytes);
        is_int(st.heap_allocated, st.arena_overflow_bytes + st.arena_overflows * 16,
               "%s: the frame's heap_allocated holds the overflow blocks, a 16-byte header each",
               name);
        sp_frame_begin(); /* frame 1; frame 2 reclaims frame 0's buffer */
        sp_frame_end();
        sp_tcache_status after;
        sp_tcache_status_get(&after);
        ok(after.large_blocks == before.large_blocks && after.bytes_used == before.bytes_used,
           "%s: the heap blocks are freed when the buffer comes round", name);
        /* An alignment past what the central heap serves (1 GiB): an overflow like any. */
        sp_frame_begin();
        ts_log_capture();
        void *p = sp_arena_aligned_alloc((size_t)1 << 31, 16);
        ok(p == NULL && ts_logged.count == 1 &&
               !strcmp(ts_logged.last_call, "sp_frame_aligned_alloc"),
           "%s: a 2 GiB alignment is an overflow, reported once by the arena (%s)", name,
           ts_logged.last_call);
        ts_log_release();
        sp_frame_end();
    }
    is_int(sp_shutdown(), SP_OK, "shutdown (%s)", name);
}

/* ---- between frames, compaction, retire -------------------------------------------------- */

static int order[8], order_n;
static uint64_t budget_seen;

static void work_a(void *user, uint64_t budget) {
    (void)user;
    order[order_n++] = 1;
    budget_seen = budget;
}
static void work_b(void *user, uint64_t budget) {
    (void)budget;
    order[order_n++] = *(int *)user;
}

static void work_once(void *user, uint64_t budget) {
    (void)budget;
    order[order_n++] = 9;
    sp_between_frames_remove(work_once, user);
}

/* Removes the work (work_b, user) registered after it. */
static void work_remove_b(void *user, uint64_t budget) {
    (void)budget;
    order[order_n++] = 7;
    sp_between_frames_remove(work_b, user);
}

/* Spends the whole budget it is given, and a little more. */
static void work_hog(void *user, uint64_t budget) {
    (void)user;
    order[order_n++] = 8;
    for (uint64_t t0 = sp_time_ns(); sp_time_ns() - t0 <= budget + 100000;) {
    }
}

/* One frame, the works' order record cleared first. */
static void works_frame(void) {
    order_n = 0;
    sp_frame_begin();
    sp_frame_end();
}

static atomic_int freed;
static void count_free(void *p) {
    free(p);
    atomic_fetch_add(&freed, 1);
}

/* Frames until `want` retired objects were freed, or `ns` passed. */
static int frames_until_freed(int want, uint64_t ns) {
    uint64_t t0 = sp_time_ns();
    while (atomic_load(&freed) < want && sp_time_ns() - t0 < ns) {
        sp_frame_begin();
        sp_frame_end();
    }
    return atomic_load(&freed);
}

static void background_job(void *arg) {
    sp_counter_wait(arg, 0);
}

enum { GROW = 5000 };
static sp_handle grown[GROW];
static bool grow_ok;

static void grow_job(void *arg) {
    grow_ok = true;
    for (int i = 0; i < GROW; i++) {
        grown[i] = sp_handle_alloc(arg, 32, 16);
        grow_ok = grow_ok && grown[i].id != 0;
    }
}
static void shrink_job(void *arg) {
    for (int i = 0; i < GROW; i++) sp_handle_free(arg, grown[i]);
}

static void test_between(void) {
    sp_desc d = small_desc(2);
    /* The budget is wall time: on a loaded machine a preemption of the tidy can spend a budget
     * of a few ms before the works run (they are skipped), one of the compaction stops it early
     * (seen: the compaction below left holes). The checks below need every work and the whole
     * compaction to run; that the budget is enforced is test_between_budget's. */
    d.between_budget_ns = 1000000000;
    sp_init(&d);
    static int two = 2;
    is_int(sp_between_frames_add("a", work_a, NULL), SP_OK, "register work a");
    is_int(sp_between_frames_add("b", work_b, &two), SP_OK, "register work b");
    ts_log_capture();
    is_int(sp_between_frames_add("a", work_a, NULL), SP_ERR_INVALID_ARG,
           "the same work twice is refused");
    ts_log_release();
    sp_frame_begin();
    sp_frame_end();
    ok(order_n == 2 && order[0] == 1 && order[1] == 2, "works run in registration order");
    ok(budget_seen > 0 && budget_seen <= 1000000000, "work a got the budget left (%llu ns)",
       (unsigned long long)budget_seen);
    is_int(sp_between_frames_remove(work_a, NULL), SP_OK, "remove work a");
    works_frame();
    ok(order_n == 1 && order[0] == 2, "a removed work no longer runs");
    sp_between_frames_remove(work_b, &two);
    /* A work that removes itself: the one after it still runs that frame. */
    static int three = 3;
    sp_between_frames_add("once", work_once, NULL);
    sp_between_frames_add("b", work_b, &three);
    works_frame();
    ok(order_n == 2 && order[0] == 9 && order[1] == 3,
       "a work that removes itself does not make the next one skip the frame");
    sp_between_frames_remove(work_b, &three);
    /* A work that removes a later one (whose user it may then free): that one does not run. */
    static int four = 4;
    sp_between_frames_add("remove b", work_remove_b, &four);
    sp_between_frames_add("b", work_b, &four);
    works_frame();
    ok(order_n == 1 && order[0] == 7, "a work removed by an earlier one is not called that frame");
    sp_between_frames_remove(work_remove_b, &four);

    /* Compaction between frames: holes left by frees are closed. */
    sp_handle_heap *hh = sp_handles();
    enum { H = 256 };
    sp_handle hs[H];
    for (int i = 0; i < H; i++) {
        hs[i] = sp_handle_alloc(hh, 1000, 16);
        memset(sp_handle_resolve(hh, hs[i]), i & 0xff, 1000);
    }
    for (int i = 0; i < H; i += 2) sp_handle_free(hh, hs[i]);
    sp_frame_begin();
    ts_log_capture();
    sp_handle_compact_stats cs;
    ok(sp_handle_compact(hh, 1000000, &cs) != SP_OK, "compaction inside a frame is refused");
    ts_log_release();
    sp_frame_end();
    sp_frame_stats st;
    sp_frame_stats_last(&st);
    bool kept = true;
    for (int i = 1; i < H; i += 2)
        kept = kept && ts_filled(sp_handle_resolve(hh, hs[i]), 1000, (uint8_t)(i & 0xff));
    sp_handle_heap_status hst;
    sp_handle_heap_status_get(hh, &hst);
    ok(st.handle_moved > 0 && hst.hole_bytes == 0 && kept,
       "sp_frame_end compacted the handle heap: %zu bytes moved, no hole left, contents kept",
       st.handle_moved);
    for (int i = 1; i < H; i += 2) sp_handle_free(hh, hs[i]);

    /* A background job on a counter of the test's own still runs at sp_frame_end: compaction
     * waits for a later frame (skipped and counted), it is not refused as misuse. */
    sp_counter *go = sp_counter_create(sp_scheduler(), "go");
    sp_counter *bg = sp_counter_create(sp_scheduler(), "background");
    sp_counter_add(go, 1);
    sp_job_desc bj = {.fn = background_job, .arg = go};
    sp_submit(&bj, 1, bg);
    sp_frame_begin();
    ts_log_capture();
    sp_frame_end();
    int logged = ts_logged.count;
    ts_log_release();
    sp_frame_stats_last(&st);
    ok(logged == 0 && st.between_skipped == 1 && st.handle_moved == 0,
       "a job still running at sp_frame_end: compaction skipped (counted), nothing reported");
    sp_counter_sub(go, 1);
    sp_counter_wait(bg, 0);
    sp_counter_destroy(go);
    sp_counter_destroy(bg);

    /* sp_retire: freed after a grace period, found at a later frame. */
    atomic_store(&freed, 0);
    sp_frame_begin();
    for (int i = 0; i < 3; i++) sp_retire(malloc(32), count_free);
    sp_frame_end();
    sp_frame_stats_last(&st);
    ok(st.retired == 3, "the frame counts 3 retired objects");
    is_int(frames_until_freed(3, 5000000000u), 3,
           "every retired object freed once after a grace period");

    /* The handle table grows from jobs during a frame: the old tables go through sp_retire. */
    sp_handle_heap_status_get(hh, &hst);
    uint32_t cap0 = hst.table_capacity;
    sp_frame_begin();
    sp_job_desc grow = {.fn = grow_job, .arg = hh};
    sp_submit(&grow, 1, NULL);
    sp_frame_end();
    sp_frame_stats_last(&st);
    sp_handle_heap_status_get(hh, &hst);
    ok(hst.table_capacity > cap0 && st.retired >= 1 && grow_ok,
       "the table grew from %u to %u slots in a job; %llu old tables retired", cap0,
       hst.table_capacity, (unsigned long long)st.retired);
    sp_frame_begin();
    grow.fn = shrink_job;
    sp_submit(&grow, 1, NULL);
    sp_frame_end();
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

static pthread_barrier_t attach_bar;

static void *attach_thread(void *arg) {
    int *r = arg;
    r[0] = sp_thread_attach();
    ts_log_capture();
    r[1] = sp_thread_attach();
    ts_log_release();
    void *p = sp_tcache_alloc(64);
    r[2] = p != NULL && sp_tcache_owner_thread(p) == sp_thread_os_id();
    sp_tcache_free(p);
    sp_thread_quiescent();
    pthread_barrier_wait(&attach_bar); /* main: status, refused shutdown */
    pthread_barrier_wait(&attach_bar);
    r[3] = sp_thread_detach();
    ts_log_capture();
    r[4] = sp_thread_detach();
    ts_log_release();
    r[5] = sp_thread_attach(); /* the refused shutdown left nothing behind */
    r[6] = sp_thread_detach();
    return NULL;
}

static void test_attach(void) {
    sp_desc d = small_desc(1);
    sp_init(&d);
    ts_log_capture();
    is_int(sp_thread_attach(), SP_ERR_INVALID_ARG, "the main thread cannot attach");
    ts_log_release();
    int r[7] = {-99, -99, -99, -99, -99, -99, -99};
    pthread_barrier_init(&attach_bar, NULL, 2);
    pthread_t t;
    pthread_create(&t, NULL, attach_thread, r);
    pthread_barrier_wait(&attach_bar);
    ok(r[0] == SP_OK && r[1] == SP_ERR_INVALID_ARG && r[2],
       "a thread attaches once (twice: SP_ERR_INVALID_ARG) and allocates from its own cache");
    sp_status st;
    sp_status_get(&st);
    is_int(st.attached_threads, 1, "status counts the attached thread");
    ts_log_capture();
    is_int(sp_shutdown(), SP_ERR_INVALID_ARG, "shutdown with a thread still attached is refused");
    ok(strstr(ts_logged.last_message, "attached") != NULL, "... saying why");
    ts_log_release();
    sp_frame_begin(); /* the runtime still works after the refusal */
    sp_frame_end();
    pthread_barrier_wait(&attach_bar);
    pthread_join(t, NULL);
    pthread_barrier_destroy(&attach_bar);
    ok(r[3] == SP_OK && r[4] == SP_ERR_INVALID_ARG, "detach once (twice: SP_ERR_INVALID_ARG)");
    ok(r[5] == SP_OK && r[6] == SP_OK, "after a refused shutdown a thread attaches again");
    sp_status_get(&st);
    is_int(st.attached_threads, 0, "no thread attached");
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

/* One object retired in a frame of its own. */
static void retire_one(void) {
    sp_frame_begin();
    sp_retire(malloc(32), count_free);
    sp_frame_end();
}

static void *offline_thread(void *arg) {
    int *r = arg;
    r[0] = sp_thread_attach();
    sp_thread_quiescent();
    pthread_barrier_wait(&attach_bar); /* A: main retires; this thread is online and silent */
    pthread_barrier_wait(&attach_bar); /* B: main saw nothing freed */
    sp_thread_offline();
    sp_thread_offline();            /* twice: a no-op */
    sp_thread_quiescent();          /* offline: a no-op, the thread stays offline */
    void *p = sp_tcache_alloc(100); /* the thread caches work offline */
    r[1] = p != NULL;
    sp_tcache_free(p);
    pthread_barrier_wait(&attach_bar); /* C: main reclaims while this thread is offline */
    pthread_barrier_wait(&attach_bar); /* D */
    sp_thread_online();
    sp_thread_online();                /* twice: a no-op */
    pthread_barrier_wait(&attach_bar); /* E: main retires; this thread is online and silent */
    pthread_barrier_wait(&attach_bar); /* F */
    sp_thread_quiescent();
    sp_thread_offline(); /* and detach while offline */
    r[2] = sp_thread_detach();
    return NULL;
}

/* An attached thread that blocks online holds reclamation back; offline, it does not. */
static void test_attach_offline(void) {
    sp_desc d = small_desc(1);
    sp_init(&d);
    int r[3] = {-99, -99, -99};
    pthread_barrier_init(&attach_bar, NULL, 2);
    pthread_t t;
    pthread_create(&t, NULL, offline_thread, r);
    atomic_store(&freed, 0);
    pthread_barrier_wait(&attach_bar); /* A */
    retire_one();
    is_int(frames_until_freed(1, 300000000u), 0,
           "a retired object waits for an attached thread that is online and silent");
    pthread_barrier_wait(&attach_bar); /* B */
    pthread_barrier_wait(&attach_bar); /* C: the thread is offline now */
    is_int(frames_until_freed(1, 5000000000u), 1, "... and is freed once that thread is offline");
    retire_one();
    is_int(frames_until_freed(2, 5000000000u), 2,
           "objects retired while it stays offline are freed too");
    pthread_barrier_wait(&attach_bar); /* D */
    pthread_barrier_wait(&attach_bar); /* E: the thread is online again, and silent */
    retire_one();
    is_int(frames_until_freed(3, 300000000u), 2,
           "online again, the silent thread holds reclamation back again");
    pthread_barrier_wait(&attach_bar); /* F */
    is_int(frames_until_freed(3, 5000000000u), 3, "... until it reports a quiescent state");
    pthread_join(t, NULL);
    pthread_barrier_destroy(&attach_bar);
    ok(r[0] == SP_OK && r[1] && r[2] == SP_OK,
       "attach, allocate while offline, online, offline again and detach: all fine");
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

/* The between-frames budget is enforced: after a work that spent it, the works after it and
 * the compaction are skipped, and counted in the frame's statistics. A frame whose tidy was
 * preempted for the whole 2 ms skips the spending work too: such frames are run again (at
 * most 100). */
static void test_between_budget(void) {
    sp_desc d = small_desc(0);
    d.between_budget_ns = 2000000;
    sp_init(&d);
    static int six = 6;
    sp_between_frames_add("hog", work_hog, NULL);
    sp_between_frames_add("b", work_b, &six);
    sp_frame_stats st = {0};
    for (int f = 0; f < 100 && (order_n == 0 || f == 0); f++) {
        works_frame();
        sp_frame_stats_last(&st);
    }
    ok(order_n == 1 && order[0] == 8 && st.between_skipped == 2 && st.between_ns >= 2000000,
       "a work spent the 2 ms budget: the next work and the compaction skipped (%u counted, "
       "%llu ns between frames)",
       st.between_skipped, (unsigned long long)st.between_ns);
    sp_between_frames_remove(work_hog, NULL);
    for (int f = 0; f < 100 && (order_n == 0 || f == 0); f++) works_frame();
    ok(order_n == 1 && order[0] == 6, "a later frame runs the work the budget skipped");
    sp_between_frames_remove(work_b, &six);
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

typedef struct span_blocks {
    void **b;
    int n;
} span_blocks;

static void free_job(void *arg) {
    span_blocks *l = arg;
    for (int i = 0; i < l->n; i++) sp_tcache_free(l->b[i]);
}

/* A frame that frees l's blocks from a job pinned to worker 1 (remote frees into the main
 * thread's spans); its statistics in *st. */
static void remote_free_frame(span_blocks *l, sp_frame_stats *st) {
    sp_job_desc j = {.fn = free_job, .arg = l, .pinned = true, .worker = 1, .name = "free"};
    sp_frame_begin();
    sp_submit(&j, 1, NULL);
    sp_frame_end();
    sp_frame_stats_last(st);
}

/* sp_frame_end tidies the main thread's cache (sp_tcache_tidy): spans that remote frees
 * emptied are kept up to keep_empty (2) and returned past it, and kept empty spans stay from
 * frame to frame (a full trim every frame would hand them back and take them again). */
static void test_frame_tidy(void) {
    if (!init_small(1)) return;
    enum { MAX = 1200 };
    static void *b[MAX];
    int first[5];
    int total = ts_fill_spans(1024, b, MAX, 4, first);              /* A, B, C full; D current */
    for (int i = first[0]; i < first[1]; i++) sp_tcache_free(b[i]); /* A: kept empty */
    sp_tcache_status st0, st1, st2, st3;
    sp_tcache_status_local(&st0);
    sp_frame_stats f1, f2;
    span_blocks span_b = {b + first[1], first[2] - first[1]};
    remote_free_frame(&span_b, &f1);
    sp_tcache_status_local(&st1);
    span_blocks span_c = {b + first[2], first[3] - first[2]};
    remote_free_frame(&span_c, &f2);
    sp_tcache_status_local(&st2);
    for (int f = 0; f < 3; f++) {
        sp_frame_begin();
        sp_frame_end();
    }
    sp_tcache_status_local(&st3);
    ok(st0.spans_empty == 1 && st1.spans_empty == 2 && f1.trimmed_bytes == 0 &&
           st1.live_blocks == (size_t)(total - first[2]),
       "frame end takes back the inbox a job filled; the span it emptied is kept (%zu kept, "
       "%zu bytes returned)",
       st1.spans_empty, f1.trimmed_bytes);
    ok(f2.trimmed_bytes == SP_TCACHE_SPAN && st2.spans_empty == 2 &&
           st2.live_blocks == (size_t)(total - first[3]),
       "... the next one is returned past keep_empty (%zu bytes)", f2.trimmed_bytes);
    ok(st3.spans_empty == 2 && st3.spans == st2.spans,
       "kept empty spans stay over empty frames (%zu of %zu spans)", st3.spans_empty, st3.spans);
    for (int i = first[3]; i < total; i++) sp_tcache_free(b[i]);
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

static sp_counter *gate;
static atomic_int gate_arrived;
static void gated_job(void *arg) {
    (void)arg;
    atomic_fetch_add(&gate_arrived, 1);
    sp_counter_wait(gate, 0);
}

/* A frame in which 100 jobs wait at once leaves their loop fibers behind as spare fibers; the
 * frame loop gives them back after 64 frames in which no wait used them: 64 stacks at the
 * 128th frame end, the rest at the 192nd (none at the 64th: those spares were in use within
 * its interval). */
static void test_frame_fiber_trim(void) {
    if (!init_small(1)) return;
    enum { WAITERS = 100 };
    gate = sp_counter_create(sp_scheduler(), "gate");
    sp_counter_add(gate, 1);
    sp_job_desc j[WAITERS];
    for (int i = 0; i < WAITERS; i++) j[i] = (sp_job_desc){.fn = gated_job, .name = "gated"};
    atomic_store(&gate_arrived, 0);
    sp_frame_begin();
    sp_submit(j, WAITERS, NULL);
    /* The worker runs them (the main thread waits for nothing yet): each parks in turn. */
    uint64_t t0 = sp_time_ns();
    while (atomic_load(&gate_arrived) < WAITERS && sp_time_ns() - t0 < 10000000000u)
        sp_thread_yield();
    sp_counter_sub(gate, 1);
    sp_frame_end();
    sp_jobs_status before, after;
    sp_jobs_status_get(sp_scheduler(), &before);
    uint32_t trimmed[3] = {0, 0, 0}, elsewhere = 0;
    for (uint64_t f = 1; f < 3 * 64; f++) {
        sp_frame_begin();
        sp_frame_end();
        sp_frame_stats fs;
        sp_frame_stats_last(&fs);
        if (fs.frame % 64 == 63)
            trimmed[fs.frame / 64] = fs.fiber_stacks_trimmed;
        else
            elsewhere += fs.fiber_stacks_trimmed;
    }
    sp_jobs_status_get(sp_scheduler(), &after);
    ok(before.parks >= WAITERS - 2 && before.fibers_spare >= WAITERS - 8 && trimmed[0] == 0 &&
           trimmed[1] == 64 && trimmed[2] == before.fibers_spare - 64 && elsewhere == 0 &&
           after.fibers_spare == 0 &&
           after.fiber_stacks_used == before.fiber_stacks_used - before.fibers_spare,
       "the frame loop gives back the %u spare fibers 100 waits left: %u, %u, %u stacks at "
       "frames 63, 127, 191 (%u at others); stacks used %u -> %u",
       before.fibers_spare, trimmed[0], trimmed[1], trimmed[2], elsewhere, before.fiber_stacks_used,
       after.fiber_stacks_used);
    sp_counter_destroy(gate);
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

static void alloc_job(void *arg) {
    span_blocks *l = arg;
    for (int i = 0; i < l->n; i++) l->b[i] = sp_tcache_alloc(1024);
}

static void nop_job(void *arg) {
    (void)arg;
}

/* A worker tidies its own cache when it goes idle after a frame ended: the inbox of blocks
 * the main thread freed is taken back although the worker never allocates that class again. */
static void test_worker_tidy(void) {
    if (!init_small(1)) return;
    static void *b[300];
    span_blocks l = {b, 300};
    sp_job_desc j = {.fn = alloc_job, .arg = &l, .pinned = true, .worker = 1, .name = "alloc"};
    sp_frame_begin();
    sp_submit(&j, 1, NULL);
    sp_frame_end();
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    size_t frees0 = st.remote_frees;
    for (int i = 0; i < l.n; i++) sp_tcache_free(b[i]); /* remote: into the worker's inboxes */
    sp_tcache_status_get(&st);
    size_t frees = st.remote_frees - frees0;
    /* The worker tidies once per frame end, when it next goes idle (the tidy of the frame
     * end above may already be under way, taking part of the inbox while the frees go on):
     * frames with a job for it until the inbox is empty. Nothing else collects it. */
    j = (sp_job_desc){.fn = nop_job, .pinned = true, .worker = 1, .name = "nop"};
    int frames = 0;
    for (uint64_t t0 = sp_time_ns(); st.remote_pending > 0 && sp_time_ns() - t0 < 10000000000u;
         frames++) {
        sp_frame_begin();
        sp_submit(&j, 1, NULL);
        sp_frame_end();
        nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
        sp_tcache_status_get(&st);
    }
    ok(frees == 300 && st.remote_pending == 0,
       "an idle worker took its inbox back (%zu remote frees, %zu pending after %d frames)", frees,
       st.remote_pending, frames);
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

/* A thread the runtime does not know of: allocates and frees through the thread caches
 * (the shared fallback cache: the runtime's caches are given only on request), waits while
 * the main thread shuts the runtime down, then allocates again. */
static pthread_barrier_t stray_bar;

static void *stray_thread(void *arg) {
    int *r = arg;
    /* The log capture is the process's: the checks look for this thread's id in the message. */
    char me[32];
    snprintf(me, sizeof me, "thread %llu ", (unsigned long long)sp_thread_os_id());
    ts_log_capture();
    void *p = sp_tcache_alloc(100);
    bool told = ts_logged.count >= 1 && ts_logged.last_id == SP_ERR_INVALID_ARG &&
                strstr(ts_logged.last_message, me) != NULL &&
                strstr(ts_logged.last_message, "not attached") != NULL;
    int count = ts_logged.count;
    void *p2 = sp_tcache_alloc(100);
    bool again = ts_logged.count != count && strstr(ts_logged.last_message, me) != NULL;
    r[0] = p != NULL && sp_tcache_owner_thread(p) == 0 && p2 != NULL; /* the fallback's */
    r[2] = told && !again;
    ts_log_release();
    sp_tcache_free(p);
    sp_tcache_free(p2);
    ts_log_capture();
    sp_tcache_free(p); /* a double free in the fallback's span: the report says whose */
    r[3] = ts_logged.last_id == SP_ERR_DOUBLE_FREE &&
           strstr(ts_logged.last_message, "shared fallback cache") != NULL;
    ts_log_release();
    pthread_barrier_wait(&stray_bar); /* A: main checks, shuts down */
    pthread_barrier_wait(&stray_bar); /* B */
    void *q = sp_tcache_alloc(100);   /* a standalone thread cache now (defaults) */
    r[1] = q != NULL;
    sp_tcache_free(q);
    return NULL;
}

static void *direct_attach_thread(void *arg) {
    int *r = arg;
    r[0] = sp_tcache_thread_attach();
    pthread_barrier_wait(&stray_bar); /* A: main tries to shut down */
    pthread_barrier_wait(&stray_bar); /* B */
    sp_tcache_thread_detach();
    pthread_barrier_wait(&stray_bar); /* C: main shuts down */
    return NULL;
}

/* A thread that never attached frees a block of another thread's cache: a lock-free push onto
 * the span's inbox, not a call through the fallback cache (whose lock is held here
 * meanwhile). */
static void stray_free(void *p) {
    sp_tcache_free(p);
}

static void test_stray_free_lock_free(void) {
    sp_desc d = small_desc(1);
    sp_init(&d);
    void *blk = sp_tcache_alloc(100); /* the main thread's cache */
    sp_tcache_status st0, st;
    sp_tcache_status_get(&st0);
    bool quick = ts_done_while_held(&tc.fallback_lock, stray_free, blk);
    sp_tcache_status_get(&st);
    ok(blk && quick && st.remote_frees >= st0.remote_frees + 1,
       "an unattached thread's free into another cache's span takes no fallback lock (%s; "
       "remote frees %zu -> %zu)",
       quick ? "done while it was held" : "it waited", st0.remote_frees, st.remote_frees);
    is_int(sp_shutdown(), SP_OK, "... shutdown");
}

/* No thread cache outlives sp_shutdown: a thread that never attached shares the fallback
 * cache (and after the shutdown gets a standalone one), and a thread that attached to the
 * thread caches directly makes sp_shutdown refuse. */
static void test_stray_threads(void) {
    sp_desc d = small_desc(1);
    sp_init(&d);
    int r[4] = {0, 0, 0, 0};
    pthread_barrier_init(&stray_bar, NULL, 2);
    pthread_t t;
    pthread_create(&t, NULL, stray_thread, r);
    pthread_barrier_wait(&stray_bar);
    ok(r[0], "a thread that did not attach allocates from the shared fallback cache");
    ok(r[2], "... told once (a warning naming the thread), not at every allocation");
    ok(r[3], "a double free there is reported as in the shared fallback cache's span");
    is_int(sp_shutdown(), SP_OK, "shutdown with such a thread running");
    pthread_barrier_wait(&stray_bar);
    pthread_join(t, NULL);
    ok(r[1], "after the shutdown it allocates again (a standalone thread cache)");
    ts_log_capture();
    is_int((int)sp_tcache_shutdown(), 0, "... which shuts down with nothing leaked");
    ts_log_release();

    sp_init(&d);
    int a[1] = {-99};
    pthread_create(&t, NULL, direct_attach_thread, a);
    pthread_barrier_wait(&stray_bar);
    ts_log_capture();
    sp_result refused = sp_shutdown();
    ok(a[0] == SP_OK && refused == SP_ERR_INVALID_ARG &&
           strstr(ts_logged.last_message, "sp_tcache_thread_attach") != NULL,
       "a thread attached with sp_tcache_thread_attach makes shutdown refuse, saying why");
    ts_log_release();
    sp_frame_begin(); /* the runtime still works after the refusal */
    sp_frame_end();
    pthread_barrier_wait(&stray_bar);
    pthread_barrier_wait(&stray_bar);
    is_int(sp_shutdown(), SP_OK, "shutdown once it detached");
    pthread_join(t, NULL);
    pthread_barrier_destroy(&stray_bar);
}

static sp_result reentry[3];

static void work_reenters(void *user, uint64_t budget_ns) {
    (void)user;
    (void)budget_ns;
    reentry[0] = sp_frame_begin();
    reentry[1] = sp_frame_end();
    reentry[2] = sp_shutdown();
}

/* The frame loop is not re-entered from its own between-frames step. */
static void test_reentry(void) {
    sp_desc d = small_desc(0);
    sp_init(&d);
    sp_between_frames_add("reenters", work_reenters, NULL);
    ts_log_capture();
    sp_frame_begin();
    sp_result end = sp_frame_end();
    int logged = ts_logged.count;
    ts_log_release();
    ok(reentry[0] == SP_ERR_INVALID_ARG && reentry[1] == SP_ERR_INVALID_ARG &&
           reentry[2] == SP_ERR_INVALID_ARG && end == SP_OK && logged == 3,
       "frame_begin, frame_end and shutdown from a between-frames work: refused and logged (%d)",
       logged);
    sp_between_frames_remove(work_reenters, NULL);
    is_int(sp_frame_begin(), SP_OK, "the next frame opens");
    sp_frame_end();
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

static sp_result from_reloc[3];
static int relocations;

static void reloc_reenters(void *user, sp_handle h, void *new_ptr, void *old_ptr) {
    (void)user, (void)h, (void)new_ptr, (void)old_ptr;
    relocations++;
    from_reloc[0] = sp_frame_begin();
    from_reloc[1] = sp_frame_end();
    from_reloc[2] = sp_shutdown();
}

/* Nor from a relocation callback of the main thread's own sp_handle_compact call between
 * frames (not the between-frames step, but blocks move under it all the same). */
static void test_reentry_from_direct_compaction(void) {
    if (!init_small(0)) return;
    sp_handle_heap *hh = sp_handles();
    sp_handle a = sp_handle_alloc(hh, 4096, 16);
    sp_handle b = sp_handle_alloc_ex(hh, 4096, 16, reloc_reenters, NULL);
    sp_handle_free(hh, a); /* b slides down into a's place */
    ts_log_capture();
    sp_result c = sp_handle_compact(hh, UINT64_MAX, NULL);
    int logged = ts_logged.count;
    ts_log_release();
    ok(c == SP_OK && relocations == 1 && from_reloc[0] == SP_ERR_INVALID_ARG &&
           from_reloc[1] == SP_ERR_INVALID_ARG && from_reloc[2] == SP_ERR_INVALID_ARG &&
           logged == 3,
       "frame_begin, frame_end and shutdown from a relocation callback of a direct compaction: "
       "refused and logged (moves %d, logged %d)",
       relocations, logged);
    sp_status st;
    sp_status_get(&st);
    ok(st.initialised && sp_handle_resolve(hh, b) != NULL,
       "the runtime is still up, the moved block resolves");
    sp_handle_free(hh, b);
    is_int(sp_frame_begin(), SP_OK, "the next frame opens");
    sp_frame_end();
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

static sp_result from_job[4];

static void job_calls_frame_loop(void *arg) {
    (void)arg;
    from_job[0] = sp_frame_end();
    from_job[1] = sp_frame_begin();
    from_job[2] = sp_shutdown();
    from_job[3] = sp_between_frames_add("x", work_reenters, NULL);
}

/* A job that runs on the main thread (in its wait) cannot call the frame loop: refused, where
 * a frame end inside the frame's own wait would wait for itself forever. */
static void test_frame_calls_from_job(void) {
    sp_desc d = small_desc(0);
    sp_init(&d);
    sp_job_desc j = {.fn = job_calls_frame_loop, .name = "calls the frame loop"};
    ts_log_capture();
    sp_frame_begin();
    sp_submit(&j, 1, NULL);
    sp_result end = sp_frame_end();
    int logged = ts_logged.count;
    ts_log_release();
    ok(end == SP_OK && logged == 4 && from_job[0] == SP_ERR_INVALID_ARG &&
           from_job[1] == SP_ERR_INVALID_ARG && from_job[2] == SP_ERR_INVALID_ARG &&
           from_job[3] == SP_ERR_INVALID_ARG,
       "frame_end, frame_begin, shutdown, between_frames_add from a job on the main thread: "
       "refused and logged (%d)",
       logged);
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

static void sleepy_job(void *arg) {
    (void)arg;
    nanosleep(&(struct timespec){.tv_nsec = 20000000}, NULL);
}

static void free_retired(void *p) {
    free(p);
}

/* Takes 1,000 bytes from the thread caches and 2,000 from the handle heap each time it runs
 * (freed by the test). */
static void *work_block;
static sp_handle work_handle;
static void work_allocates(void *user, uint64_t budget) {
    (void)user;
    (void)budget;
    work_block = sp_tcache_alloc(1000);
    work_handle = sp_handle_alloc(sp_handles(), 2000, 0);
}

/* The frame record counts jobs run, retires and bytes allocated from the end of the last
 * sp_frame_end: a frame's own, and those made between frames (and by the next frame end's
 * between-frames work), in the next frame (none lost, none counted twice). */
static void test_frame_stats_counts(void) {
    if (!init_small(1)) return;
    sp_job_desc j[3] = {
        {.fn = nop_job, .name = "a"}, {.fn = nop_job, .name = "b"}, {.fn = nop_job, .name = "c"}};
    sp_frame_stats a, b, c;
    void *blocks[2];
    sp_handle handles[2];
    sp_frame_begin();
    sp_submit(j, 3, NULL);
    sp_retire(malloc(16), free_retired);
    blocks[0] = sp_tcache_alloc(100);
    handles[0] = sp_handle_alloc(sp_handles(), 200, 0);
    sp_persistent_alloc(48, 16);
    sp_frame_end();
    sp_frame_stats_last(&a);
    sp_counter *own = sp_counter_create(sp_scheduler(), "between");
    sp_submit(j, 2, own); /* between frames, on a counter of our own */
    sp_counter_wait(own, 0);
    sp_retire(malloc(16), free_retired);
    sp_retire(malloc(16), free_retired);
    blocks[1] = sp_tcache_alloc(10);
    handles[1] = sp_handle_alloc(sp_handles(), 20, 0);
    sp_persistent_alloc(16, 16);
    sp_between_frames_add("allocates", work_allocates, NULL); /* runs in b's sp_frame_end */
    sp_frame_begin();
    sp_frame_end();
    sp_frame_stats_last(&b);
    sp_between_frames_remove(work_allocates, NULL);
    sp_frame_begin();
    sp_frame_end();
    sp_frame_stats_last(&c);
    ok(a.heap_allocated == 100 && a.handle_allocated == 200 && a.persistent_allocated == 48 &&
           b.heap_allocated == 10 + 1000 && b.handle_allocated == 20 + 2000 &&
           b.persistent_allocated == 16 && c.heap_allocated == 0 && c.handle_allocated == 0 &&
           c.persistent_allocated == 0,
       "bytes allocated (heap / handle / persistent): 100 / 200 / 48 in a frame; 10 / 20 / 16 "
       "between frames and 1,000 / 2,000 / 0 from the next frame end's between-frames work, "
       "counted in the next; then none (got %zu / %zu / %zu, %zu / %zu / %zu, %zu / %zu / %zu)",
       a.heap_allocated, a.handle_allocated, a.persistent_allocated, b.heap_allocated,
       b.handle_allocated, b.persistent_allocated, c.heap_allocated, c.handle_allocated,
       c.persistent_allocated);
    for (int i = 0; i < 2; i++) {
        sp_tcache_free(blocks[i]);
        sp_handle_free(sp_handles(), handles[i]);
    }
    sp_tcache_free(work_block);
    sp_handle_free(sp_handles(), work_handle);
    ok(a.jobs_run == 3 && a.retired == 1 && b.jobs_run == 2 && b.retired == 2 && c.jobs_run == 0 &&
           c.retired == 0,
       "jobs run / retires: 3 / 1 in a frame, 2 / 2 between frames counted in the next, then "
       "0 / 0 (got %llu / %llu, %llu / %llu, %llu / %llu)",
       (unsigned long long)a.jobs_run, (unsigned long long)a.retired,
       (unsigned long long)b.jobs_run, (unsigned long long)b.retired,
       (unsigned long long)c.jobs_run, (unsigned long long)c.retired);
    sp_counter_destroy(own);
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

/* A full persistent region: size 0 is refused too, never a pointer past the region's end. */
static void test_persistent_full_zero(void) {
    if (!init_small(0)) return;
    ts_log_capture(); /* every refusal is logged */
    size_t taken = 0;
    for (size_t n = (size_t)1 << 30; n; n >>= 1)
        while (sp_persistent_alloc(n, 1)) taken += n;
    void *z = sp_persistent_alloc(0, 1);
    ts_log_release();
    ok(taken > 0 && z == NULL, "a full persistent region (%zu bytes taken): size 0 gives NULL",
       taken);
    is_int(sp_shutdown(), SP_OK, "shutdown");
    ts_log_capture();
    void *after = sp_arena_alloc(16);
    ts_log_release();
    ok(after == NULL, "sp_arena_alloc after sp_shutdown: NULL (the arena is gone)");
}

/* The runtime's handle heap, frame arena and scheduler end with sp_shutdown only: their own
 * destroy (and the scheduler's shutdown) called by a user is refused and changes nothing. */
static void test_owned_not_destroyed(void) {
    if (!init_small(1)) return;
    ts_log_capture();
    sp_handle_heap_destroy(sp_handles());
    sp_frame_arena_destroy(sp_frames());
    sp_result js = sp_jobs_shutdown(sp_scheduler());
    sp_jobs_destroy(sp_scheduler());
    int logged = ts_logged.count, id = ts_logged.last_id;
    ts_log_release();
    ok(logged == 4 && id == SP_ERR_INVALID_ARG && js == SP_ERR_INVALID_ARG,
       "destroying the runtime's handle heap, arena or scheduler, or shutting the scheduler "
       "down: refused and logged (%d)",
       logged);
    sp_handle h = sp_handle_alloc(sp_handles(), 64, 16);
    sp_frame_begin();
    void *p = sp_arena_alloc(64);
    sp_job_desc j = {.fn = nop_job, .name = "nop"};
    sp_result sub = sp_submit(&j, 1, NULL);
    sp_frame_end();
    sp_frame_stats fs;
    sp_frame_stats_last(&fs);
    ok(sp_handle_resolve(sp_handles(), h) != NULL && p != NULL && sub == SP_OK && fs.jobs_run >= 1,
       "the heap, the arena and the scheduler still serve (jobs run %llu)",
       (unsigned long long)fs.jobs_run);
    sp_handle_free(sp_handles(), h);
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

/* The frame counter is the runtime's: not destroyed by a user, and lowered below its jobs it
 * is reported (a frame end may have stopped waiting for a job still running) and set back. */
static void test_frame_counter_misuse(void) {
    sp_desc d = small_desc(1);
    sp_init(&d);
    sp_counter *fc = sp_frame_counter();
    ts_log_capture();
    sp_counter_destroy(fc);
    ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_INVALID_ARG && sp_counter_value(fc) == 0,
       "destroying the frame counter: refused (%s)", ts_logged.last_message);
    sp_frame_begin();
    sp_counter_sub(fc, 1);
    sp_job_desc j = {.fn = sleepy_job, .name = "sleepy"};
    sp_submit(&j, 1, NULL);
    ts_log_reset();
    sp_frame_end(); /* the counter may be 0 with the job still running: not waited for */
    /* The job ends: the counter goes to -1 (or the frame end saw it there and reported it). */
    for (uint64_t t0 = sp_time_ns();
         sp_counter_value(fc) >= 0 && ts_logged.count == 0 && sp_time_ns() - t0 < 10000000000u;)
        sp_thread_yield();
    sp_result begin = sp_frame_begin();
    int64_t after = sp_counter_value(fc);
    /* Seen by the next sp_frame_begin, or by that sp_frame_end if the job was done by then. */
    bool named = !strcmp(ts_logged.last_call, "sp_frame_begin") ||
                 !strcmp(ts_logged.last_call, "sp_frame_end");
    ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_INVALID_ARG && named && begin == SP_OK &&
           after == 0,
       "a frame counter lowered below its jobs: reported once (%s), set back to 0",
       ts_logged.last_call);
    ts_log_release();
    sp_frame_end();
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

static void *exits_attached(void *arg) {
    int *r = arg;
    r[0] = sp_thread_attach();
    void *p = sp_tcache_alloc(64);
    sp_tcache_free(p);
    return NULL; /* no sp_thread_detach */
}

/* A thread that ends attached is detached at its exit (reported): reclamation goes on and
 * sp_shutdown does not refuse for good. */
static void test_exit_attached(void) {
    sp_desc d = small_desc(1);
    sp_init(&d);
    int r[1] = {-99};
    ts_log_capture();
    pthread_t t;
    pthread_create(&t, NULL, exits_attached, r);
    pthread_join(t, NULL);
    int logged = ts_logged.count;
    bool named = !strcmp(ts_logged.last_call, "sp_thread_detach");
    ts_log_release();
    sp_status st;
    sp_status_get(&st);
    ok(r[0] == SP_OK && logged == 1 && named && st.attached_threads == 0,
       "a thread that ends attached: detached at its exit, reported under sp_thread_detach");
    int before = atomic_load(&freed);
    retire_one();
    ok(frames_until_freed(before + 1, 5000000000u) > before, "reclamation does not wait for it");
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

/* Desc sizes the subsystems cannot take are refused by sp_init itself. */
static void test_desc_sizes(void) {
    sp_desc d = small_desc(0);
    d.heap_size = 1 << 20;
    ts_log_capture();
    sp_result r = sp_init(&d);
    ok(r == SP_ERR_INVALID_ARG && !strcmp(ts_logged.last_call, "sp_init") &&
           strstr(ts_logged.last_message, "heap_size") != NULL,
       "a 1 MiB central heap: sp_init answers SP_ERR_INVALID_ARG naming heap_size");
    /* frame_size is per buffer: the frame region is frame_size x frame_buffers, and that is
     * what must stay within 64 TiB (beyond, the reservation would fail as SP_ERR_OS). */
    const size_t tib = (size_t)1 << 40;
    struct {
        size_t size;
        uint32_t buffers;
    } big[] = {{64 * tib, 0}, {64 * tib, 2}, {32 * tib, 4}, {24 * tib, 3}};
    for (size_t i = 0; i < SP_ARRAY_LEN(big); i++) {
        d = small_desc(0);
        d.frame_size = big[i].size;
        d.frame_buffers = big[i].buffers;
        ts_log_reset();
        r = sp_init(&d);
        ok(r == SP_ERR_OVERFLOW && !strcmp(ts_logged.last_call, "sp_init") &&
               strstr(ts_logged.last_message, "frame_size x frame_buffers") != NULL &&
               sp_init_failure() == NULL,
           "frame_size %zu TiB x %u buffers: SP_ERR_OVERFLOW (%s), nothing started",
           big[i].size / tib, big[i].buffers ? big[i].buffers : 2, sp_result_name(r));
        if (r == SP_OK) sp_shutdown();
    }
    /* The handle heap's region limit, checked before anything starts, on the size rounded up
     * to 2 MiB as the region will be. */
    static const size_t too_big[] = {SP_HANDLE_REGION_LIMIT, SP_HANDLE_REGION_LIMIT - 4096};
    for (size_t i = 0; i < SP_ARRAY_LEN(too_big); i++) {
        d = small_desc(0);
        d.handle_size = too_big[i];
        ts_log_reset();
        r = sp_init(&d);
        ok(r == SP_ERR_INVALID_ARG && strstr(ts_logged.last_message, "handle_size") != NULL &&
               sp_init_failure() == NULL,
           "handle_size 64 GiB - %zu: SP_ERR_INVALID_ARG naming handle_size (%s), nothing "
           "started",
           SP_HANDLE_REGION_LIMIT - too_big[i], sp_result_name(r));
        if (r == SP_OK) sp_shutdown();
    }
    ts_log_release();
}

/* A desc of zeroes but one worker, under an address-space limit: the sizes left 0 follow the
 * room the limit leaves (on a 24 GiB machine the defaults reserved 15.3 GiB, and init failed
 * under `ulimit -v 4G`). One worker, not one per CPU: each thread takes address space of its
 * own (its stack, glibc's malloc arena), which on a machine with many CPUs would use up the
 * room whatever the regions took. In a child, with RLIMIT_AS at what it maps now plus `room`
 * MiB. */
static void limited_init_child(void *arg) {
    const size_t room = *(const size_t *)arg * MiB;
    if (!ts_limit_address_room(room)) _exit(3);
    sp_desc d = {0};
    d.jobs.workers = 1;
    if (sp_init(&d) != SP_OK) _exit(4);
    sp_status st;
    sp_status_get(&st);
    enum { N = 16 };
    sp_job_desc jobs[N];
    for (int i = 0; i < N; i++) jobs[i] = (sp_job_desc){.fn = slow_job, .name = "slow"};
    bool ran = true;
    for (int frame = 0; frame < 4; frame++) {
        atomic_store(&jobs_done, 0);
        ran &= sp_frame_begin() == SP_OK && sp_submit(jobs, N, NULL) == SP_OK;
        ran &= sp_frame_end() == SP_OK && atomic_load(&jobs_done) == N;
    }
    void *big = sp_tcache_alloc(64 * MiB);
    ran &= big != NULL;
    sp_tcache_free(big);
    void *p = malloc(256 * MiB); /* the program keeps room of its own while the runtime runs */
    free(p);
    if (sp_shutdown() != SP_OK || !ran) _exit(5);
    _exit(st.reserved > room / 2 ? 6 : !p ? 7 : 0);
}

static void test_desc_address_limit(void) {
    if (ts_sanitized()) { /* no line: such a limit breaks the sanitizers' shadow mappings */
        diag("address-space limit cases not run under a sanitizer or Valgrind");
        return;
    }
    static char text[8192];
    static const size_t rooms[] = {4096, 2048};
    for (size_t i = 0; i < SP_ARRAY_LEN(rooms); i++) {
        int status = ts_child(limited_init_child, (void *)&rooms[i], text, sizeof text);
        int code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        ok(code == 0,
           "default sizes under an address-space limit of %zu MiB more than mapped: init starts, "
           "reserving at most half of that, frames run, 256 MiB are left for the program "
           "(exit %d; 4: init failed, 5: a frame or shutdown failed, 6: reserved more, 7: no "
           "room left)",
           rooms[i], code);
        if (code != 0) diag("child stderr:\n%s", text);
    }
}

static atomic_int before_init_told;

static void note_before_init(void *user, const sp_log_record *rec) {
    (void)user;
    if (rec->id == SP_ERR_INVALID_ARG && strstr(rec->message, "before sp_init"))
        atomic_fetch_add(&before_init_told, 1);
}

/* The thread caches used before sp_init (they set themselves up, standalone): sp_init refuses,
 * naming the cause, until sp_tcache_shutdown; then it starts. */
static void test_caches_before_init(void) {
    sp_tcache_free(sp_tcache_alloc(100));
    sp_desc d = small_desc(1);
    sp_log_set(note_before_init, NULL);
    sp_result r = sp_init(&d);
    sp_log_set(NULL, NULL);
    bool told = atomic_load(&before_init_told) == 1;
    ok(r == SP_ERR_INVALID_ARG && told,
       "sp_init after the thread caches were used on their own: refused (%s), saying why",
       sp_result_name(r));
    size_t live = sp_tcache_shutdown();
    r = sp_init(&d);
    ok(live == 0 && r == SP_OK, "after sp_tcache_shutdown it starts (%s)", sp_result_name(r));
    if (r == SP_OK) sp_shutdown();
}

/* ---- NULL out pointers ------------------------------------------------------------------ */

static void status_null(void *arg) {
    (void)arg;
    sp_status_get(NULL);
}

static void stats_null(void *arg) {
    (void)arg;
    sp_frame_stats_last(NULL);
}

/* sp_status_get and sp_frame_stats_last with a NULL out: misuse, reported naming the call,
 * nothing written; debug builds abort with that report. */
static void test_null_out(void) {
    if (!init_small(0)) return;
    sp_frame_begin();
    sp_frame_end();
    ts_log_capture();
    sp_status_get(NULL);
    ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_INVALID_ARG &&
           !strcmp(ts_logged.last_call, "sp_status_get"),
       "sp_status_get(NULL): reported as misuse (%s)", ts_logged.last_message);
    ts_log_reset();
    sp_result r = sp_frame_stats_last(NULL);
    ok(r == SP_ERR_INVALID_ARG && ts_logged.count == 1 &&
           !strcmp(ts_logged.last_call, "sp_frame_stats_last"),
       "sp_frame_stats_last(NULL): SP_ERR_INVALID_ARG, reported as misuse");
    ts_log_release();
    sp_frame_stats st;
    ok(sp_frame_stats_last(&st) == SP_OK && st.frame == 0, "... the record is still there");
    if (SP_DEBUG >= 1) {
        ok(ts_dies(status_null, NULL, "sp_status_get", "out is NULL"),
           "debug build: sp_status_get(NULL) aborts, naming the call");
        ok(ts_dies(stats_null, NULL, "sp_frame_stats_last", "out is NULL"),
           "debug build: sp_frame_stats_last(NULL) aborts, naming the call");
    } else {
        ok(1, "# SKIP fatal misuse: SP_DEBUG 0");
        ok(1, "# SKIP fatal misuse: SP_DEBUG 0");
    }
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

/* ---- who may use the frame arena -------------------------------------------------------- */

typedef struct arena_try {
    sp_result attach;
    void *plain, *aligned;
    int logged_plain, logged_aligned;
    char call_plain[64];
} arena_try;

static void *arena_attached(void *arg) {
    arena_try *t = arg;
    t->attach = sp_thread_attach();
    t->plain = sp_arena_alloc(100);
    t->logged_plain = ts_logged.count;
    snprintf(t->call_plain, sizeof t->call_plain, "%s", ts_logged.last_call);
    t->aligned = sp_arena_aligned_alloc(64, 100);
    t->logged_aligned = ts_logged.count;
    sp_thread_detach();
    return NULL;
}

static void arena_call(void *arg) {
    (void)arg;
    sp_arena_alloc(16);
}

/* On a thread that never attached: the forked child's one thread is this one (a child under
 * TSan may start no thread). */
static void *arena_dies(void *arg) {
    *(bool *)arg = ts_dies(arena_call, NULL, "sp_arena_alloc", "frame arena is for jobs");
    return NULL;
}

/* The frame arena is for jobs and the main thread. The main thread between frames allocates
 * for the next frame (the buffers were flipped at the last sp_frame_end); an attached thread
 * is not ordered with the flip: debug builds report its call as misuse (NULL), and abort on
 * it with the misuse policy fatal (here from a thread that never attached). */
static void test_arena_callers(void) {
    if (!init_small(1)) return;
    sp_frame_begin();
    sp_frame_end();
    ts_log_capture();
    uint8_t *between = sp_arena_alloc(64);
    int logged = ts_logged.count;
    sp_status st;
    sp_status_get(&st);
    ok(between && logged == 0 &&
           sp_frame_arena_buffer_of(sp_frames(), between) == (int)(st.frame % 2),
       "the main thread between frames: served from the next frame's buffer, nothing reported");
    if (between) memset(between, 0x5c, 64);
    sp_frame_begin();
    arena_try t = {.attach = -99};
    pthread_t th;
    pthread_create(&th, NULL, arena_attached, &t);
    pthread_join(th, NULL);
    sp_frame_end();
    ts_log_release();
    ok(between && ts_filled(between, 64, 0x5c), "... and lives through that frame");
    if (SP_DEBUG >= 1) {
        ok(t.attach == SP_OK && t.plain == NULL && t.logged_plain == 1 &&
               !strcmp(t.call_plain, "sp_arena_alloc"),
           "debug build: sp_arena_alloc on an attached thread is misuse: NULL, reported");
        ok(t.aligned == NULL && t.logged_aligned == 2 &&
               !strcmp(ts_logged.last_call, "sp_arena_aligned_alloc") &&
               ts_logged.last_id == SP_ERR_INVALID_ARG,
           "debug build: sp_arena_aligned_alloc too (%s)", ts_logged.last_message);
        bool died = false;
        pthread_create(&th, NULL, arena_dies, &died);
        pthread_join(th, NULL);
        ok(died, "debug build: from a thread that never attached it aborts, naming the call");
    } else {
        ok(1, "# SKIP caller check: SP_DEBUG 0");
        ok(1, "# SKIP caller check: SP_DEBUG 0");
        ok(1, "# SKIP caller check: SP_DEBUG 0");
    }
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

/* ---- the main thread's quiescent states ----------------------------------------------- */

static atomic_bool held_freed, blocker_entered, blocker_release;
static void *held;

static void mark_freed(void *p) {
    free(p);
    atomic_store(&held_freed, true);
}

/* Keeps the reclaimer busy (inside a free) until the test lets it go. */
static void blocking_free(void *p) {
    atomic_store(&blocker_entered, true);
    for (uint64_t t0 = sp_time_ns();
         !atomic_load(&blocker_release) && sp_time_ns() - t0 < 10000000000u;)
        nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
    free(p);
}

static void retire_held_job(void *arg) {
    (void)arg;
    sp_retire(held, mark_freed);
}

static void nap_job(void *arg) {
    (void)arg;
    nanosleep(&(struct timespec){.tv_nsec = 30000000}, NULL);
}

/* The main thread holds an object it read within a frame while a job retires it, and then
 * waits on a counter: with no worker it runs jobs in that wait (each job's end was once a
 * quiescent state), with one it sleeps there while the worker runs a 30 ms job (it once went
 * offline). The reclaimer is in a grace period for the object meanwhile. The object must stay
 * until the frame's sp_frame_end, and be freed after it. */
static void test_main_quiescent(uint32_t workers) {
    if (!init_small(workers)) return;
    atomic_store(&held_freed, false);
    atomic_store(&blocker_entered, false);
    atomic_store(&blocker_release, false);
    sp_frame_begin();
    sp_retire(malloc(16), blocking_free);
    sp_frame_end();
    for (uint64_t t0 = sp_time_ns();
         !atomic_load(&blocker_entered) && sp_time_ns() - t0 < 5000000000u;) {
        sp_frame_begin();
        sp_frame_end();
    }
    sp_frame_begin();
    held = malloc(64); /* published somewhere; the main thread reads it */
    sp_counter *c = sp_counter_create(sp_scheduler(), "mine");
    sp_job_desc retire = {.fn = retire_held_job, .name = "retire"};
    sp_submit(&retire, 1, c);
    sp_counter_wait(c, 0);
    /* The reclaimer finishes the blocking free, finds the object and waits for a grace
     * period for it. */
    atomic_store(&blocker_release, true);
    nanosleep(&(struct timespec){.tv_nsec = 50000000}, NULL);
    sp_job_desc naps[4];
    for (int i = 0; i < 4; i++)
        naps[i] = (sp_job_desc){.fn = nap_job, .name = "nap", .pinned = workers > 0, .worker = 1};
    sp_submit(naps, workers ? 1 : 4, c);
    sp_counter_wait(c, 0);
    nanosleep(&(struct timespec){.tv_nsec = 50000000}, NULL);
    bool early = atomic_load(&held_freed);
    sp_frame_end();
    for (uint64_t t0 = sp_time_ns();
         !atomic_load(&held_freed) && sp_time_ns() - t0 < 5000000000u;) {
        sp_frame_begin();
        sp_frame_end();
    }
    ok(atomic_load(&blocker_entered) && !early,
       "%u workers: an object the main thread holds within a frame is not freed while it %s a "
       "wait",
       workers, workers ? "sleeps in" : "runs jobs in");
    ok(atomic_load(&held_freed), "... and is freed after the frame's sp_frame_end");
    sp_counter_destroy(c);
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

/* ---- an attached thread's frame-counter submit while a frame closes ---------------------- */

static atomic_int late_buffer = -1, late_result = -99;
static atomic_bool late_saw_closed;

static void late_job(void *arg) {
    (void)arg;
    uint8_t *p = sp_arena_alloc(64);
    atomic_store(&late_buffer, p ? (int)sp_frame_arena_buffer_of(sp_frames(), p) : -2);
}

/* A frame job that keeps sp_frame_end waiting (the gate closed) until the attached thread has
 * seen the gate closed, and 50 ms more, in which its submit is under way. */
static void holder_job(void *arg) {
    (void)arg;
    for (uint64_t t0 = sp_time_ns();
         !atomic_load(&late_saw_closed) && sp_time_ns() - t0 < 5000000000u;)
        sp_thread_yield();
    nanosleep(&(struct timespec){.tv_nsec = 50000000}, NULL);
}

static void *late_submitter(void *arg) {
    (void)arg;
    sp_thread_attach();
    for (uint64_t t0 = sp_time_ns();
         !atomic_load(&sp_rt.gate_closed) && sp_time_ns() - t0 < 5000000000u;)
        sp_thread_yield();
    atomic_store(&late_saw_closed, true);
    sp_job_desc j = {.fn = late_job, .name = "late"};
    atomic_store(&late_result, sp_submit(&j, 1, NULL));
    sp_thread_detach();
    return NULL;
}

/* A frame-counter submit an attached thread makes once sp_frame_end has begun to close the
 * frame waits until the arena has moved on: its job belongs to the next frame (allocates from
 * that frame's buffer), never to the one whose buffers are being flipped. */
static void test_attached_submit_next_frame(void) {
    if (!init_small(1)) return;
    for (int f = 0; f < 3; f++) { /* frame 3 is the one closed under the attached submit */
        sp_frame_begin();
        sp_frame_end();
    }
    sp_status st;
    sp_status_get(&st);
    uint64_t closing = st.frame;
    pthread_t t;
    pthread_create(&t, NULL, late_submitter, NULL);
    sp_job_desc holder = {.fn = holder_job, .name = "holder"};
    sp_frame_begin();
    sp_submit(&holder, 1, NULL);
    sp_frame_end();
    pthread_join(t, NULL); /* its submit returned */
    sp_frame_begin();
    sp_frame_end(); /* waits for the late job */
    int want = (int)((closing + 1) % 2), got = atomic_load(&late_buffer);
    ok(atomic_load(&late_saw_closed) && atomic_load(&late_result) == SP_OK && got == want,
       "an attached thread's frame-counter job submitted while frame %llu closed ran in frame "
       "%llu (arena buffer %d; the closing frame's is %d)",
       (unsigned long long)closing, (unsigned long long)closing + 1, got, 1 - want);
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

/* An attached thread's frame-counter submit that is short of job records while sp_frame_end
 * closes the gate: the main thread, waiting at the gate for that submit, gives back the
 * records it caches. It spun there instead, so the frame end waited the submit's full second
 * and the submit failed (SP_ERR_LIMIT) with the records it needed cached by the main thread. */
static atomic_int rec_go;
static sp_result rec_result = SP_ERR_INVALID_ARG;
static void rec_nop(void *arg) {
    (void)arg;
}
static void *rec_submitter(void *arg) {
    (void)arg;
    sp_thread_attach();
    while (!atomic_load(&rec_go)) sp_thread_yield();
    sp_job_desc d[3];
    for (int i = 0; i < 3; i++)
        d[i] = (sp_job_desc){.fn = rec_nop, .name = "ext", .pinned = true, .worker = 1};
    rec_result = sp_submit(d, 3, NULL);
    sp_thread_detach();
    return NULL;
}

static void test_gate_records(void) {
    sp_desc d = small_desc(1);
    d.jobs.max_jobs = 64;
    if (sp_init(&d) != SP_OK) {
        ok(0, "init");
        return;
    }
    pthread_t t;
    pthread_create(&t, NULL, rec_submitter, NULL);
    sp_frame_begin();
    /* 58 records held by jobs deferred on a counter of ours; the main thread caches a few. */
    sp_counter *held_on = sp_counter_create(sp_scheduler(), "held on");
    sp_counter_add(held_on, 1);
    sp_job_desc deferred_jobs[58];
    for (int i = 0; i < 58; i++)
        deferred_jobs[i] =
            (sp_job_desc){.fn = rec_nop, .name = "held", .pinned = true, .worker = 1};
    bool sub = sp_jobs_submit_after(sp_scheduler(), held_on, 0, deferred_jobs, 58, NULL) == SP_OK;
    atomic_store(&rec_go, 1);
    /* Until the submit is inside the gate, short of records. */
    for (uint64_t t0 = sp_time_ns();
         !atomic_load(&sp_rt.jobs->records_wanted) && sp_time_ns() - t0 < 5000000000u;)
        sp_thread_yield();
    bool short_of = atomic_load(&sp_rt.jobs->records_wanted) != 0;
    sp_frame_end();
    pthread_join(t, NULL);
    ok(sub && short_of && rec_result == SP_OK,
       "a gated frame-counter submit short of job records gets those the main thread cached "
       "while sp_frame_end waits for it (%s; it was SP_ERR_LIMIT after a 1 s frame end)",
       sp_result_name(rec_result));
    sp_counter_sub(held_on, 1);
    sp_counter_wait(held_on, 0);
    sp_counter_destroy(held_on);
    for (int f = 0; f < 2; f++) {
        sp_frame_begin();
        sp_frame_end();
    }
    is_int(sp_shutdown(), SP_OK, "shutdown");
}

int main(void) {
    test_before_init();
    test_regions();
    for (uint32_t w = 0; w <= 2; w++) test_frame_jobs(w);
    for (uint32_t b = 2; b <= 4; b++) test_lifetime(b);
    test_overflow(SP_FRAME_OVERFLOW_NULL);
    test_overflow(SP_FRAME_OVERFLOW_HEAP);
    test_between();
    test_between_budget();
    test_attach();
    test_attach_offline();
    test_frame_tidy();
    test_worker_tidy();
    test_frame_fiber_trim();
    test_stray_threads();
    test_stray_free_lock_free();
    test_reentry();
    test_reentry_from_direct_compaction();
    test_owned_not_destroyed();
    test_persistent_full_zero();
    test_frame_stats_counts();
    test_frame_calls_from_job();
    test_frame_counter_misuse();
    test_exit_attached();
    test_desc_sizes();
    test_desc_address_limit();
    test_caches_before_init();
    test_attached_submit_next_frame();
    test_gate_records();
    test_main_quiescent(0);
    test_main_quiescent(1);
    test_null_out();
    test_arena_callers();
    return done();
}
