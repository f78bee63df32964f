/* An attached thread (not a worker, not ordered with the frame loop) allocates, pins, fills,
 * checks and frees handle-heap blocks while the main thread runs frames whose sp_frame_end
 * compacts the heap. Its alloc, free, pin and unpin wait for a compaction step in progress
 * (the step holds the heap lock), so a pinned pointer stays valid and nothing is damaged;
 * nothing is reported as misuse. */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "spindle.h"
#include "test_support.h"

enum { M = 256 };

static atomic_bool stop;
static atomic_int damaged, ops, attach_result = -99;

static void *attached(void *arg) {
    (void)arg;
    atomic_store(&attach_result, sp_thread_attach());
    sp_handle_heap *hh = sp_handles();
    sp_handle hs[M] = {{0}};
    uint32_t x = 1;
    while (!atomic_load(&stop)) {
        for (int i = 0; i < M; i++) {
            x = x * 1103515245u + 12345u;
            if (hs[i].id && (x >> 16) % 3 == 0) {
                uint8_t *p = sp_handle_pin(hh, hs[i]);
                if (!p || !ts_filled(p, sp_handle_size(hh, hs[i]), (uint8_t)i))
                    atomic_fetch_add(&damaged, 1);
                sp_handle_unpin(hh, hs[i]);
                sp_handle_free(hh, hs[i]);
                hs[i].id = 0;
            } else if (!hs[i].id) {
                size_t n = 16 + (x >> 8) % 4000;
                hs[i] = sp_handle_alloc(hh, n, 0);
                uint8_t *p = sp_handle_pin(hh, hs[i]);
                if (p) {
                    memset(p, i, n);
                    sp_handle_unpin(hh, hs[i]);
                }
            }
            atomic_fetch_add(&ops, 1);
        }
        sp_thread_quiescent();
    }
    for (int i = 0; i < M; i++) sp_handle_free(hh, hs[i]);
    sp_thread_detach();
    return NULL;
}

/* Attaches racing sp_init / sp_shutdown: a thread attaches, allocates, detaches, again and
 * again, while the main thread starts and stops the runtime. Every attach either succeeds
 * (and its thread cache works) or fails with SP_ERR_SHUTDOWN; every shutdown either succeeds
 * or refuses because a thread is attached. */
static atomic_int race_ok, race_refused, race_bad;

static void *racer(void *arg) {
    (void)arg;
    while (!atomic_load(&stop)) {
        sp_result r = sp_thread_attach();
        if (r == SP_OK) {
            void *p = sp_tcache_alloc(64);
            if (!p) atomic_fetch_add(&race_bad, 1);
            sp_tcache_free(p);
            if (sp_thread_detach() != SP_OK) atomic_fetch_add(&race_bad, 1);
            atomic_fetch_add(&race_ok, 1);
        } else if (r == SP_ERR_SHUTDOWN) {
            atomic_fetch_add(&race_refused, 1);
            sp_thread_yield();
        } else {
            atomic_fetch_add(&race_bad, 1);
        }
    }
    return NULL;
}

static void test_attach_races_shutdown(void) {
    sp_desc d = ts_small_desc(1, 16);
    atomic_store(&stop, false);
    ts_log_capture(); /* the refused attaches and shutdowns are logged */
    pthread_t t;
    pthread_create(&t, NULL, racer, NULL);
    uint32_t cycles = (uint32_t)ts_scaled(200, 4);
    int inits = 0, shutdowns = 0, refusals = 0, other = 0;
    for (uint32_t c = 0; c < cycles; c++) {
        inits += sp_init(&d) == SP_OK;
        int before = atomic_load(&race_ok);
        uint64_t t0 = sp_time_ns(); /* up until the racer got in once (or 20 ms) */
        while (atomic_load(&race_ok) == before && sp_time_ns() - t0 < 20000000u) {
            sp_frame_begin();
            sp_frame_end();
        }
        uint64_t s0 = sp_time_ns();
        for (;;) {
            sp_result r = sp_shutdown();
            if (r == SP_OK) break;
            if (r == SP_ERR_INVALID_ARG && sp_time_ns() - s0 < 20000000000u) {
                refusals++;
                sp_thread_yield();
                continue;
            }
            other++;
            break;
        }
        shutdowns++;
    }
    atomic_store(&stop, true);
    pthread_join(t, NULL);
    ts_log_release();
    ok(inits == (int)cycles && shutdowns == (int)cycles && other == 0,
       "%u init/shutdown cycles against a thread attaching and detaching: all done", cycles);
    ok(atomic_load(&race_bad) == 0 && atomic_load(&race_ok) > 0,
       "every attach succeeded (%d, at least one; cache working) or failed with "
       "SP_ERR_SHUTDOWN (%d); %d shutdowns refused while it was attached",
       atomic_load(&race_ok), atomic_load(&race_refused), refusals);
}

/* A thread attaching a cache directly (sp_tcache_thread_attach, not sp_thread_attach) while
 * sp_shutdown drains the scheduler: either the attach is refused (SP_ERR_SHUTDOWN) and the
 * shutdown goes on, or (it came first) the shutdown refuses until the thread detaches; never
 * both succeed, which would leave the thread a cache in a heap about to be unmapped. */
static atomic_int drain_phase; /* 1: main is about to shut down; 2: the attach was made */
static atomic_int drain_attach = -99;

static void drain_job(void *arg) {
    (void)arg;
    while (atomic_load(&drain_phase) < 1) sp_thread_yield();
    nanosleep(&(struct timespec){.tv_nsec = 30000000}, NULL); /* shutdown is draining now */
    while (atomic_load(&drain_phase) < 2) sp_thread_yield();  /* until the thread tried */
}

static void *drain_attacher(void *arg) {
    (void)arg;
    while (atomic_load(&drain_phase) < 1) sp_thread_yield();
    nanosleep(&(struct timespec){.tv_nsec = 15000000}, NULL);
    atomic_store(&drain_attach, sp_tcache_thread_attach());
    atomic_store(&drain_phase, 2);
    while (atomic_load(&drain_phase) < 3) sp_thread_yield(); /* main: shutdown returned */
    sp_tcache_thread_detach();
    return NULL;
}

static void test_direct_attach_during_drain(void) {
    sp_desc d = ts_small_desc(1, 16);
    if (sp_init(&d) != SP_OK) {
        ok(0, "init");
        return;
    }
    sp_counter *c = sp_counter_create(sp_scheduler(), "drain");
    sp_job_desc j = {.fn = drain_job, .name = "drain"};
    sp_submit(&j, 1, c);
    pthread_t t;
    pthread_create(&t, NULL, drain_attacher, NULL);
    ts_log_capture();
    atomic_store(&drain_phase, 1);
    sp_result first = sp_shutdown();
    while (atomic_load(&drain_phase) < 2) sp_thread_yield(); /* the attach was made (either way) */
    int attach = atomic_load(&drain_attach);
    atomic_store(&drain_phase, 3);
    pthread_join(t, NULL);
    sp_result second = first == SP_OK ? SP_OK : sp_shutdown();
    ts_log_release();
    ok((first == SP_OK && attach == SP_ERR_SHUTDOWN) ||
           (first == SP_ERR_INVALID_ARG && attach == SP_OK && second == SP_OK),
       "a direct cache attach while sp_shutdown drains: attach %s, shutdown %s (then %s): never "
       "both succeed",
       sp_result_name((sp_result)attach), sp_result_name(first), sp_result_name(second));
    sp_status st;
    sp_status_get(&st);
    ok(!st.initialised, "the runtime is down");
}

/* Frame-counter jobs from an attached thread against the buffer flip: the thread submits jobs
 * that fill arena blocks with 0xAA at random moments while the main thread runs frames, each
 * filling blocks of its own with the frame's number and checking the last frame's (valid
 * through this one with 2 buffers). A job that ran while sp_frame_end flipped the buffers
 * would allocate from a buffer being reclaimed: TSan reports the race on the arena's state
 * (every run, in CI's concurrency suite); the contents check catches the damage it may do
 * to the main thread's blocks only now and then. */
enum { FLIP_BLOCKS = 64, FLIP_BYTES = 512 };
static atomic_long flip_submitted, flip_ran;

static void flip_job(void *arg) {
    (void)arg;
    for (int i = 0; i < 4; i++) {
        uint8_t *p = sp_arena_alloc(1024);
        if (p) memset(p, 0xAA, 1024);
    }
    atomic_fetch_add(&flip_ran, 1);
}

static void *flip_submitter(void *arg) {
    (void)arg;
    if (sp_thread_attach() != SP_OK) return NULL;
    uint32_t x = 1;
    while (!atomic_load(&stop)) {
        sp_job_desc j = {.fn = flip_job, .name = "attached"};
        if (sp_submit(&j, 1, NULL) == SP_OK) atomic_fetch_add(&flip_submitted, 1);
        x = x * 1103515245u + 12345u;
        nanosleep(&(struct timespec){.tv_nsec = (x >> 8) % 50000}, NULL);
    }
    sp_thread_detach();
    return NULL;
}

static void test_attached_frame_jobs(void) {
    sp_desc d = ts_small_desc(1, 16);
    d.frame_chunk = 4096; /* small chunks: many takes, each a chance to meet the flip */
    if (sp_init(&d) != SP_OK) {
        ok(0, "init");
        return;
    }
    atomic_store(&stop, false);
    pthread_t t;
    pthread_create(&t, NULL, flip_submitter, NULL);
    uint8_t *prev[FLIP_BLOCKS] = {0};
    uint32_t frames = 3000;
    long bad = 0;
    for (uint32_t f = 0; f < frames; f++) {
        sp_frame_begin();
        for (int i = 0; i < FLIP_BLOCKS && f > 0; i++)
            if (prev[i] && !ts_filled(prev[i], FLIP_BYTES, (uint8_t)(f - 1))) bad++;
        for (int i = 0; i < FLIP_BLOCKS; i++) {
            prev[i] = sp_arena_alloc(FLIP_BYTES);
            if (prev[i]) memset(prev[i], (uint8_t)f, FLIP_BYTES);
        }
        sp_frame_end();
    }
    atomic_store(&stop, true);
    pthread_join(t, NULL);
    sp_frame_begin(); /* the last submits' jobs */
    sp_frame_end();
    is_int((int)bad, 0,
           "%u frames against %ld frame-counter jobs of an attached thread allocating from the "
           "arena: no block of the main thread's written over",
           frames, atomic_load(&flip_submitted));
    ok(atomic_load(&flip_ran) == atomic_load(&flip_submitted) && atomic_load(&flip_ran) > 0,
       "every one of them ran within a frame (%ld)", atomic_load(&flip_ran));
    is_int(sp_shutdown(), SP_OK, "shutdown");
    atomic_store(&stop, false);
}

int main(void) {
    test_direct_attach_during_drain();
    test_attached_frame_jobs();
    sp_desc d = ts_small_desc(1, 64);
    if (sp_init(&d) != SP_OK) {
        ok(0, "init");
        return done();
    }
    ts_log_capture();
    pthread_t t;
    if (pthread_create(&t, NULL, attached, NULL) != 0) {
        ok(0, "pthread_create");
        return done();
    }
    /* Frames start once the thread has done its first M operations, one pass over its slots
     * (or has failed to attach; at most 60 s), and go on past `frames` (up to ten times as many)
     * until compaction has moved something: on a loaded machine the thread may get little time
     * during the first ones. */
    uint64_t deadline = sp_time_ns() + 60 * UINT64_C(1000000000);
    for (int r; atomic_load(&ops) < M && ((r = atomic_load(&attach_result)) == -99 || r == SP_OK) &&
                sp_time_ns() < deadline;)
        sp_thread_yield();
    uint32_t frames = (uint32_t)ts_scaled(20000, 10), f = 0;
    size_t moved = 0;
    for (; f < frames || (moved == 0 && f < 10 * frames); f++) {
        sp_frame_begin();
        sp_frame_end();
        sp_frame_stats st;
        sp_frame_stats_last(&st);
        moved += st.handle_moved;
    }
    atomic_store(&stop, true);
    pthread_join(t, NULL);
    int logged = ts_logged.count;
    ts_log_release();
    is_int(atomic_load(&attach_result), SP_OK, "the thread attached");
    is_int(atomic_load(&damaged), 0,
           "%u frames, %d handle operations on the attached thread, %zu bytes compacted: no "
           "pinned block damaged or moved",
           f, atomic_load(&ops), moved);
    is_int(logged, 0, "nothing reported");
    ok(moved > 0, "compaction ran meanwhile (%zu bytes moved): the pins were tested", moved);
    sp_handle_heap_status hs;
    sp_handle_heap_status_get(sp_handles(), &hs);
    ok(hs.live_handles == 0 && sp_handle_heap_check(sp_handles()) == SP_OK,
       "the heap is empty and consistent");
    is_int(sp_shutdown(), SP_OK, "shutdown");
    test_attach_races_shutdown();
    return done();
}
