/* bench: a minimal C API over Google Benchmark (bench/bridge.cpp is the only C++ in the tree).
 *
 * A benchmark is a C function run once per thread; it does its own setup, then loops
 * `while (bench_keep_running(st))` (or bench_keep_running_batch), then its teardown. Only the
 * loop is timed by Google Benchmark. Headline figures are user counters set with bench_counter.
 *
 * Order: bench_register* (any number), then bench_main once from main().
 * Concurrency: bench_register*, bench_main: main thread only, before/while nothing runs.
 * Every bench_state call: only by the thread that received that state (Google Benchmark gives
 * each thread of a Threads(n) benchmark its own state).
 */
#ifndef BENCH_H
#define BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bench_state bench_state;   /* a benchmark::State */
typedef struct bench_handle bench_handle; /* a registered benchmark::internal::Benchmark */

typedef void (*bench_fn)(bench_state *st, const void *arg);

/* Register `fn(st, arg)` under `name` (copied, reported as is), run on `threads` threads at once.
 * threads > 1 adds Threads(n)->UseRealTime() (name suffix "/threads:n/real_time"). */
bench_handle *bench_register(const char *name, bench_fn fn, const void *arg, int threads);

/* The loop condition. The timer starts on the first call and stops on the last (false). */
bool bench_keep_running(bench_state *st);
/* Same, counting `n` iterations per true result (the body then does n units of work). */
bool bench_keep_running_batch(bench_state *st, int64_t n);

/* Exclude a stretch inside the loop from Google Benchmark's own time (costly: two clock reads). */
void bench_pause_timing(bench_state *st);
void bench_resume_timing(bench_state *st);

enum bench_counter_flags {
    BENCH_COUNTER_DEFAULT = 0,     /* summed over the threads of the benchmark */
    BENCH_COUNTER_AVG_THREADS = 1, /* averaged over threads (benchmark::Counter::kAvgThreads) */
};

/* Set user counter `name` to `value` (this thread's share; see flags). */
void bench_counter(bench_state *st, const char *name, double value, int flags);

/* Index of the calling thread within a Threads(n) benchmark (0..n-1), and n. */
int bench_thread_index(const bench_state *st);
int bench_threads(const bench_state *st);

/* Iterations Google Benchmark asked this thread to run (valid inside and after the loop). */
int64_t bench_iterations(const bench_state *st);

/* Mark the benchmark failed with `msg`; the loop ends at the next bench_keep_running. Any
 * such call makes bench_main return 1. */
void bench_skip_with_error(bench_state *st, const char *msg);

/* Remove a flag of our own (exact match, e.g. "--smoke") from argv before bench_main sees it.
 * Returns true if it was present. */
bool bench_take_flag(int *argc, char **argv, const char *flag);

/* Initialise Google Benchmark with argv, run the benchmarks selected by the flags. Returns 0,
 * or 1 for unknown flags or if any benchmark called bench_skip_with_error.
 * --benchmark_min_time defaults to 0 here (a later flag overrides): a benchmark fixes its work
 * itself with one bench_keep_running_batch(st, n) and is then run exactly once per repetition.
 * With a larger min_time Google Benchmark calls it again with more iterations. */
int bench_main(int argc, char **argv);

/* Make the compiler assume `p` and everything reachable from it is read and written here. */
static inline void bench_escape(const void *p) {
    __asm__ volatile("" : : "r"(p) : "memory");
}

#ifdef __cplusplus
}
#endif
#endif
