// The only C++ in spindle: bench.h (a C API) over Google Benchmark. Each call forwards to
// one Google Benchmark member; nothing here measures or decides anything.
#include "bench.h"

#include <benchmark/benchmark.h>

#include <atomic>
#include <cstring>
#include <vector>

namespace {
std::atomic<int> g_errors{0};

benchmark::State &S(bench_state *st) {
    return *reinterpret_cast<benchmark::State *>(st);
}
const benchmark::State &S(const bench_state *st) {
    return *reinterpret_cast<const benchmark::State *>(st);
}
} // namespace

extern "C" {

bench_handle *bench_register(const char *name, bench_fn fn, const void *arg, int threads) {
    benchmark::internal::Benchmark *b = benchmark::RegisterBenchmark(
        name, [fn, arg](benchmark::State &st) { fn(reinterpret_cast<bench_state *>(&st), arg); });
    // Threads(1), Iterations() and UseRealTime() would append "/threads:1", "/iterations:n",
    // "/real_time" to the name; single-threaded runs need none of them (wall time is reported
    // anyway, and benchmarks fix their own work, see bench_main).
    if (threads > 1) b->Threads(threads)->UseRealTime();
    return reinterpret_cast<bench_handle *>(b);
}

bool bench_keep_running(bench_state *st) {
    return S(st).KeepRunning();
}
bool bench_keep_running_batch(bench_state *st, int64_t n) {
    return S(st).KeepRunningBatch(n);
}
void bench_pause_timing(bench_state *st) {
    S(st).PauseTiming();
}
void bench_resume_timing(bench_state *st) {
    S(st).ResumeTiming();
}

void bench_counter(bench_state *st, const char *name, double value, int flags) {
    benchmark::Counter::Flags f = (flags & BENCH_COUNTER_AVG_THREADS)
                                      ? benchmark::Counter::kAvgThreads
                                      : benchmark::Counter::kDefaults;
    S(st).counters[name] = benchmark::Counter(value, f);
}

int bench_thread_index(const bench_state *st) {
    return S(st).thread_index();
}
int bench_threads(const bench_state *st) {
    return S(st).threads();
}
int64_t bench_iterations(const bench_state *st) {
    return S(st).iterations();
}

void bench_skip_with_error(bench_state *st, const char *msg) {
    g_errors.fetch_add(1, std::memory_order_relaxed);
    S(st).SkipWithError(msg);
}

bool bench_take_flag(int *argc, char **argv, const char *flag) {
    bool found = false;
    int out = 1;
    for (int i = 1; i < *argc; i++) {
        if (std::strcmp(argv[i], flag) == 0)
            found = true;
        else
            argv[out++] = argv[i];
    }
    if (*argc > 0) {
        argv[out] = nullptr;
        *argc = out;
    }
    return found;
}

int bench_main(int argc, char **argv) {
    // Default --benchmark_min_time to 0: each benchmark fixes its own work per run (one
    // bench_keep_running_batch of n), so one run is enough. A flag given later in argv wins.
    std::vector<char *> args(argv, argv + argc);
    static char min_time[] = "--benchmark_min_time=0";
    args.insert(args.begin() + (argc > 0 ? 1 : 0), min_time);
    args.push_back(nullptr);
    argc = static_cast<int>(args.size()) - 1;
    argv = args.data();
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return g_errors.load() != 0 ? 1 : 0;
}

} // extern "C"
