/* Frame-arena bugs that must not pass silently. A pointer kept past its frame (frame i's data
 * used in frame i+N) is reported by the memory tool at its first use: under ASan in a forked
 * child, with -Dvalgrind=true in a child re-executed under valgrind (ts_tool_reports); the
 * same use one frame earlier (i+N-1, still valid) must not be. Debug builds: fatal misuse dies
 * with a message naming the call and the arena. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sp_frame.h"
#include "test_support.h"
#include "track.h"

#ifndef SP_DEBUG
#define SP_DEBUG 0
#endif

static volatile char sink;

static sp_frame_arena *arena(uint32_t buffers, sp_frame_overflow mode, size_t region) {
    return sp_frame_arena_create(
        &(sp_frame_desc){
            .buffers = buffers, .region_size = region, .chunk_size = 16 << 10, .overflow = mode},
        NULL);
}

/* Frame 0's block read in frame 2 (N = 2): its buffer was reclaimed at the start of frame 2. */
static void stale_read(void) {
    sp_frame_arena *a = arena(2, SP_FRAME_OVERFLOW_NULL, 0);
    char *p = sp_frame_alloc(a, 100);
    memset(p, 1, 100);
    sp_frame_arena_advance(a, NULL);
    sp_frame_alloc(a, 100);
    sp_frame_arena_advance(a, NULL);
    sink = p[10];
}

/* N = 3, a large (direct) block written in frame 3, after a new frame-3 block was carved from
 * the same buffer (the new block is addressable; the stale one beyond it is not). */
static void stale_write(void) {
    sp_frame_arena *a = arena(3, SP_FRAME_OVERFLOW_NULL, 0);
    char *p = sp_frame_alloc(a, 64 * 1024);
    for (int i = 0; i < 3; i++) sp_frame_arena_advance(a, NULL);
    char *q = sp_frame_alloc(a, 32);
    q[0] = 1;
    p[40000] = 1;
}

/* A heap-fallback block of frame 0 (HEAP mode, buffers of one chunk) used in frame 2: the
 * block was freed to the C library at the reclaim. */
static void stale_heap_block(void) {
    sp_frame_arena *a = arena(2, SP_FRAME_OVERFLOW_HEAP, 128 * 1024);
    char *p = sp_frame_alloc(a, 40000);
    char *q = sp_frame_alloc(a, 40000); /* no room left: the heap */
    memset(q, 1, 40000);
    sink = (char)(sp_frame_arena_buffer_of(a, p) + 1);
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL);
    sink = q[5];
}

/* A block in a later chunk of frame 0 (the thread's seventh 16 KiB chunk) read in frame 2: the
 * whole used part of the buffer is poisoned, not only its first chunk. */
static void stale_read_later_chunk(void) {
    sp_frame_arena *a = arena(2, SP_FRAME_OVERFLOW_NULL, 0);
    char *last = NULL;
    for (int i = 0; i < 100; i++) last = sp_frame_alloc(a, 1000);
    memset(last, 1, 1000);
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL);
    sink = last[500];
}

static void *alloc_on_thread(void *a) {
    char *p = sp_frame_alloc(a, 100);
    memset(p, 1, 100);
    return p;
}

/* Another thread's block (its own chunk) of frame 0, read by this thread in frame 2. */
static void stale_read_other_thread(void) {
    sp_frame_arena *a = arena(2, SP_FRAME_OVERFLOW_NULL, 0);
    sp_frame_alloc(a, 100); /* this thread's chunk first: the other's lies above it */
    pthread_t t;
    void *p = NULL;
    if (pthread_create(&t, NULL, alloc_on_thread, a) != 0 || pthread_join(t, &p) != 0 || !p)
        return; /* no report: the bug is counted as missed */
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL);
    sink = ((char *)p)[50];
}

/* Control: frame 0's block read in frame 1 (N = 2) is valid and must not be reported. */
static void valid_read(void) {
    sp_frame_arena *a = arena(2, SP_FRAME_OVERFLOW_NULL, 0);
    char *p = sp_frame_alloc(a, 100);
    memset(p, 1, 100);
    sp_frame_arena_advance(a, NULL);
    sp_frame_alloc(a, 100);
    sink = p[99];
    sp_frame_arena_destroy(a);
}

/* The bugs, then the control (last: a tool must report nothing, so any output of its tool's
 * kind, "" for ASan, fails it). */
static const ts_bug bugs[] = {
    {"stale_read", stale_read, "use-after-poison", "Invalid read"},
    {"stale_write", stale_write, "use-after-poison", "Invalid write"},
    {"stale_heap_block", stale_heap_block, "heap-use-after-free", "Invalid read"},
    {"stale_read_later_chunk", stale_read_later_chunk, "use-after-poison", "Invalid read"},
    {"stale_read_other_thread", stale_read_other_thread, "use-after-poison", "Invalid read"},
    {"valid_read", valid_read, "", "Invalid"},
};
enum { BUGS = sizeof bugs / sizeof bugs[0] - 1 };

static void bad_alignment(void *arg) {
    sp_frame_aligned_alloc(arg, 24, 8);
}

static void bad_size(void *arg) {
    sp_frame_alloc(arg, SIZE_MAX / 2 + 1);
}

static void null_arena(void *arg) {
    (void)arg;
    sp_frame_alloc(NULL, 16);
}

int main(int argc, char **argv) {
    if (ts_bug_child(argc, argv, bugs, BUGS + 1)) return 0; /* the child under valgrind */
    bool tool = ts_tool_watching();
    if (!tool && SP_DEBUG < 1) skip_all("release build without ASan or -Dvalgrind=true");
    plan(9);
    if (tool) {
        ts_bugs_reported(argv[0], bugs, BUGS);
    } else {
        for (size_t i = 0; i < BUGS; i++)
            ok(1, "# SKIP %s: built without ASan or -Dvalgrind=true", bugs[i].name);
    }
    if (tool) {
        /* Reported-or-not is decided by the tool's output: a valid read must give none. */
        const ts_bug *c = &bugs[BUGS];
        ok(!ts_tool_reports(argv[0], c->run, c->name, ts_tool_asan() ? c->asan : c->valgrind),
           "frame 0's block read in frame 1 of 2 is not reported");
    } else {
        ok(1, "# SKIP control: built without ASan or -Dvalgrind=true");
    }
    if (SP_DEBUG < 1) {
        skip_n(3, "fatal misuse: SP_DEBUG 0");
        return done();
    }
    sp_frame_arena *a = arena(2, SP_FRAME_OVERFLOW_NULL, 0);
    char addr[32];
    snprintf(addr, sizeof addr, "%p", (void *)a);
    ok(ts_dies(bad_alignment, a, "sp_frame_aligned_alloc", addr),
       "debug: alignment 24 dies naming sp_frame_aligned_alloc and the arena");
    ok(ts_dies(bad_size, a, "sp_frame_alloc", "SP_ERR_OVERFLOW"),
       "debug: a size above PTRDIFF_MAX dies naming sp_frame_alloc and SP_ERR_OVERFLOW");
    ok(ts_dies(null_arena, NULL, "sp_frame_alloc", "NULL arena"),
       "debug: a NULL arena dies naming sp_frame_alloc");
    sp_frame_arena_destroy(a);
    return done();
}
