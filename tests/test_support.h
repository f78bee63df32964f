/* Support shared by every test: a capturing logger, misuse and death helpers, a seeded RNG,
 * and a scaled iteration count (fewer under sanitizers). Linked as one small static library. */
#ifndef SP_TEST_SUPPORT_H
#define SP_TEST_SUPPORT_H

#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_jobs.h"
#include "sp_log.h"
#include "sp_runtime.h"
#include "tap.h"

/* Capturing logger: records the last message and counts per id. */
typedef struct ts_log {
    int count; /* records seen since ts_log_capture / ts_log_reset */
    sp_log_level last_level;
    sp_result last_id;
    const void *last_addr;
    char last_call[64];
    char last_message[512];
} ts_log;

extern ts_log ts_logged;

/* Route the library logger into ts_logged and make misuse non-fatal (release behaviour). */
void ts_log_capture(void);
void ts_log_reset(void);
/* Back to stderr and the build's default misuse policy. */
void ts_log_release(void);

/* Read everything from fd into a NUL-terminated buffer of `cap` bytes; the excess is drained
 * and dropped so that the writer never blocks on a full pipe. */
void ts_pipe_drain(int fd, char *buf, size_t cap);

/* Whether fn(arg), run on a new thread (sp_thread_start: not attached to anything) while the
 * caller holds `lock`, returns within 10 s: the call takes no such lock. Joins the thread. */
bool ts_done_while_held(sp_mutex *lock, void (*fn)(void *), void *arg);

/* Run fn(arg) in a forked child (exit 0 when it returns; it may _exit itself) with misuse
 * fatal, the default logger and its stderr captured into text (cap bytes, NUL-terminated).
 * Returns the child's wait status, -1 if it could not be run (reported with diag). */
int ts_child(void (*fn)(void *), void *arg, char *text, size_t cap);

/* Run fn(arg) in a forked child with the build's default (fatal) misuse policy and stderr
 * captured. Returns true if the child died by a signal (abort) and its stderr contained
 * every non-NULL needle. */
bool ts_dies(void (*fn)(void *), void *arg, const char *needle1, const char *needle2);

/* Run bug() where a memory tool watches it: in a forked child under ASan, or in a child that
 * re-executes `self` with "--bug NAME" under valgrind (-Dvalgrind=true builds), stderr
 * captured. True if the child failed and the tool's report contains `kind`. */
bool ts_tool_reports(const char *self, void (*bug)(void), const char *name, const char *kind);

/* A memory-tool test's bug: a function that misuses memory and what each tool must report. */
typedef struct ts_bug {
    const char *name;
    void (*run)(void);
    const char *asan, *valgrind; /* e.g. "use-after-poison", "Invalid read" */
} ts_bug;

/* Whether a memory tool watches this build: ASan, or -Dvalgrind=true with valgrind installed;
 * whether that tool is ASan. */
bool ts_tool_watching(void);
bool ts_tool_asan(void);

/* The child side of ts_tool_reports under valgrind: with argv "--bug NAME", runs the bug of
 * that name and returns true (main then returns 0); false otherwise. */
bool ts_bug_child(int argc, char **argv, const ts_bug *bugs, size_t n);

/* One ok() per bug: ts_tool_reports finds its tool's expected report. Inline: the TAP counters
 * of tap.h belong to the test's own translation unit. */
static inline void ts_bugs_reported(const char *self, const ts_bug *bugs, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const char *kind = ts_tool_asan() ? bugs[i].asan : bugs[i].valgrind;
        ok(ts_tool_reports(self, bugs[i].run, bugs[i].name, kind), "%s is reported (%s)",
           bugs[i].name, kind);
    }
}

/* Fill n bytes at p with v / whether they all still hold v (fuzz targets' block checks). */
void ts_fill(uint8_t *p, size_t n, uint8_t v);
bool ts_filled(const uint8_t *p, size_t n, uint8_t v);

/* xoshiro256** seeded from a 64-bit seed (splitmix64). */
typedef struct ts_rng {
    uint64_t s[4];
} ts_rng;
void ts_rng_seed(ts_rng *r, uint64_t seed);
uint64_t ts_rng_next(ts_rng *r);
/* Uniform in [lo, hi]. */
uint64_t ts_rng_range(ts_rng *r, uint64_t lo, uint64_t hi);

/* True when built with ASan, TSan or UBSan, or run under Valgrind: scale work down. */
bool ts_sanitized(void);

/* Set RLIMIT_AS (soft and hard) to what the process maps now plus `room` bytes: for a forked
 * child (it cannot be raised again). False if the mapped size cannot be read or the limit set.
 * Not under sanitizers, whose shadow mappings such a limit breaks. */
bool ts_limit_address_room(size_t room);
/* n, divided by `div` when sanitized. */
uint64_t ts_scaled(uint64_t n, uint64_t div);

/* A runtime desc with small regions (central heap 64 MiB, frame buffers 2 MiB, handle heap
 * `handle_mib` MiB, persistent region 2 MiB) and `workers` background workers (0: none, every
 * job on the main thread). */
sp_desc ts_small_desc(uint32_t workers, size_t handle_mib);

/* Allocate blocks of `size` bytes (a class size) from the calling thread's cache into b[]
 * until `spans` spans were begun and the last holds one block, so the others are full (each
 * from a fresh cache's empty spans or new ones). first[i] is the index of span i's first block,
 * first[spans] the number taken, which is returned (at most max). */
int ts_fill_spans(size_t size, void **b, int max, int spans, int *first);

/* A range of memory; ts_overlaps sorts n of them by address and counts the neighbours that
 * overlap (0: no two share a byte). */
typedef struct ts_span {
    uintptr_t p;
    size_t n;
} ts_span;
int ts_overlaps(ts_span *s, size_t n);

/* Where the calling thread runs: its CPU (sched_getcpu) and affinity mask, count its CPUs
 * (-1 when the mask does not fit a cpu_set_t). */
typedef struct ts_cpu {
    int cpu, count;
    cpu_set_t mask;
} ts_cpu;
void ts_cpu_read(ts_cpu *r);
/* Whether r ran on cpu with a mask of that CPU alone. */
bool ts_cpu_only(const ts_cpu *r, int cpu);
/* ts_cpu_read(r); false, with `tests` planned tests skipped, when the mask does not fit. */
static inline bool ts_cpu_read_or_skip(ts_cpu *r, int tests) {
    ts_cpu_read(r);
    if (r->count >= 0) return true;
    skip_n(tests, "the affinity mask does not fit a cpu_set_t");
    return false;
}

/* Job migration harness: rounds of TS_PAIRS waiting jobs on scheduler s. Each round submits
 * waiter(ts_pair *) jobs, which do their work, sp_counter_wait(pair->go, 0) (the fiber parks and
 * may resume on another worker) and work again, and signal jobs that release them from wherever
 * they run. Rounds go on until at least min_rounds ran and *migrations (which the waiters count)
 * reached want: max_rounds at most, or more while under 60 s have passed (on a loaded machine
 * the other workers get little time, and jobs rarely resume elsewhere); between(user) runs
 * after each round when not NULL. Returns the rounds run, or -1 when a submit or wait failed. */
enum { TS_PAIRS = 8 };
typedef struct ts_pair {
    sp_counter *go;
} ts_pair;
int ts_migration_rounds(sp_jobs *s, void (*waiter)(void *), int min_rounds, int max_rounds,
                        const _Atomic int *migrations, int want, void (*between)(void *),
                        void *user);

#endif
