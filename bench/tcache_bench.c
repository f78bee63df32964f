/* The `tcache` benchmark area: the thread caches (sp_tcache_alloc/sp_tcache_free, inline)
 * against the process malloc (glibc, or a peer linked in as the process malloc: build with
 * -DBENCH_PEER_JEMALLOC, _TCMALLOC or _MIMALLOC; with -DBENCH_PEER_SPINDLE_MALLOC the peer is
 * spindle's own drop-in, libspindle-malloc.so, called through malloc/free as a program calls
 * it). Names: tcache/CASE/WHO[/workers:N].
 *
 *   local   each thread replays its own seeded stream of pairs (free the block in a random
 *           slot of a 64-slot working set, allocate 16..256 bytes into it, write a word) on
 *           1, 2, 4 and 8 threads; ns_per_pair is per thread (each thread's own time).
 *   remote  producer threads allocate 16..256 bytes and hand each block through a
 *           single-producer single-consumer ring to a consumer thread that frees it
 *           (workers:2 = one pair, workers:4 = two pairs); ns_per_pair = wall time / blocks.
 *   server  larson-style: threads replace random slots of one shared array of 8192 blocks
 *           with new blocks of 16..512 bytes and free what they took out (most frees are of
 *           another thread's block); ns_per_pair = wall time / replacements.
 * In every case thread t runs on CPU t % CPUs (a remote pair's threads on different CPUs).
 * Every case also reports peak_rss_kb: the growth of the process's peak resident set during
 * the case (the peak is reset through /proc/self/clear_refs just before it starts; 0 if the
 * kernel refuses). The ring and the shared array cost the same for every allocator; the local
 * streams (2 MiB a thread) are written before the reset, so they are not counted, and so is
 * the first page of each size class a case uses (warm_classes).
 *
 * Own flags: --smoke (tiny streams: every case runs once, quickly). BENCH_SMOKE=1 does the
 * same.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "sp_platform.h"
#include "sp_tcache.h"

#include "peer.h"

enum { LOCAL_SLOTS = 64, RING = 1024, SERVER_SLOTS = 8192, MAX_THREADS = 8 };
enum { LOCAL_MAX = 256, SERVER_MAX = 512 }; /* largest request: local and remote, server */

/* A request size of 16..max bytes from random bits r. */
static inline size_t size_upto(uint64_t r, size_t max) {
    return 16 + (size_t)(r % (max - 15));
}

static struct {
    size_t local_ops;    /* stream length per thread */
    int64_t passes;      /* passes over it per sample */
    size_t remote_pairs; /* blocks per producer */
    size_t server_ops;   /* replacements per thread */
    bool smoke;
} cfg = {1u << 18, 8, 1u << 21, 1u << 20, false};

typedef enum kind { LOCAL, REMOTE, SERVER } kind;

typedef struct bench_arg {
    kind k;
    bool spindle;
    int threads;
} bench_arg;

/* ---- the allocator under test: one branch on a constant, inlined away ------------------ */

static inline __attribute__((always_inline)) void *who_alloc(bool spindle, size_t n) {
    return spindle ? sp_tcache_alloc(n) : malloc(n);
}

static inline __attribute__((always_inline)) void who_free(bool spindle, void *p) {
    if (spindle)
        sp_tcache_free(p);
    else
        free(p);
}

/* ---- peak RSS ----------------------------------------------------------------------------- */

static long status_kb(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    long kb = 0;
    size_t n = strlen(field);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0) kb = strtol(line + n, NULL, 10);
    fclose(f);
    return kb;
}

/* Reset the peak to the current RSS; returns the current RSS in KiB (-1: no reset). */
static long rss_reset(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return -1;
    bool ok = fputs("5", f) >= 0;
    ok = fclose(f) == 0 && ok;
    return ok ? status_kb("VmRSS:") : -1;
}

/* ---- threads of one benchmark meet here ---------------------------------------------------- */

typedef struct shared {
    atomic_int arrived, generation;
    _Atomic(void *) server[SERVER_SLOTS];
    struct ring {
        _Alignas(64) atomic_size_t head;
        _Alignas(64) atomic_size_t tail;
        _Alignas(64) void *slot[RING];
    } ring[MAX_THREADS / 2];
    long rss_base;
    uint64_t t0;
} shared;

static shared sh;

/* All `n` threads wait here (a generation barrier: reusable at once, as Google Benchmark
 * calls a case again right away when it wants more iterations). */
static void meet(int n) {
    int gen = atomic_load(&sh.generation);
    if (atomic_fetch_add(&sh.arrived, 1) == n - 1) {
        atomic_store(&sh.arrived, 0);
        atomic_fetch_add(&sh.generation, 1);
        return;
    }
    while (atomic_load(&sh.generation) == gen) sp_thread_yield();
}

/* ---- cases -------------------------------------------------------------------------------- */

typedef struct op {
    uint32_t slot, size;
} op;

static inline __attribute__((always_inline)) bool local_pass(bool spindle, void **slots,
                                                             const op *ops, size_t n) {
    for (size_t i = 0; i < n; i++) {
        void **s = &slots[ops[i].slot];
        who_free(spindle, *s);
        void *p = who_alloc(spindle, ops[i].size);
        *s = p;
        if (__builtin_expect(p == NULL, 0)) return false;
        *(uint32_t *)p = ops[i].size;
    }
    bench_escape(slots);
    return true;
}

static __attribute__((noinline)) bool local_pass_spindle(void **s, const op *o, size_t n) {
    return local_pass(true, s, o, n);
}
static __attribute__((noinline)) bool local_pass_process(void **s, const op *o, size_t n) {
    return local_pass(false, s, o, n);
}

/* This thread's stream of pairs (in `mem`), written, so that its pages are resident before
 * the case resets the peak RSS: peak_rss_kb is the allocator's, not the 2 MiB stream's. */
static op *local_stream(bench_state *st, region *mem) {
    op *ops = region_get(mem, cfg.local_ops * sizeof(op));
    if (!ops) return NULL;
    uint64_t seed = 0x7c0ffee ^ (uint64_t)bench_thread_index(st) << 40;
    for (size_t i = 0; i < cfg.local_ops; i++) {
        uint64_t r = rng_next(&seed);
        ops[i] = (op){(uint32_t)(r % LOCAL_SLOTS), (uint32_t)size_upto(r >> 32, LOCAL_MAX)};
    }
    return ops;
}

/* Returns the ns of the timed loop over ops, and *pairs done by this thread; 0 on failure. */
static uint64_t run_local(bench_state *st, const bench_arg *a, const op *ops, size_t *pairs) {
    void *slots[LOCAL_SLOTS];
    for (int i = 0; i < LOCAL_SLOTS; i++) slots[i] = who_alloc(a->spindle, 16 + (size_t)i * 3);
    bool (*pass)(void **, const op *, size_t) =
        a->spindle ? local_pass_spindle : local_pass_process;
    bool ok = pass(slots, ops, cfg.local_ops); /* warm-up, untimed */
    uint64_t ns = 0;
    *pairs = 0;
    while (ok && bench_keep_running_batch(st, cfg.passes)) {
        uint64_t t0 = sp_time_ns();
        for (int64_t p = 0; ok && p < cfg.passes; p++) ok = pass(slots, ops, cfg.local_ops);
        ns += sp_time_ns() - t0;
        *pairs += (size_t)cfg.passes * cfg.local_ops;
    }
    for (int i = 0; i < LOCAL_SLOTS; i++) who_free(a->spindle, slots[i]);
    return ok ? ns : 0;
}

static inline __attribute__((always_inline)) void remote_produce(bool spindle, struct ring *r,
                                                                 size_t n) {
    uint64_t seed = 0xfeed ^ (uintptr_t)r;
    size_t head = atomic_load_explicit(&r->head, memory_order_relaxed); /* after earlier runs */
    for (size_t i = 0; i < n; i++) {
        size_t size = size_upto(rng_next(&seed), LOCAL_MAX);
        void *p = who_alloc(spindle, size);
        *(size_t *)p = size;
        while (head - atomic_load_explicit(&r->tail, memory_order_acquire) == RING)
            sp_thread_yield();
        r->slot[head % RING] = p;
        atomic_store_explicit(&r->head, ++head, memory_order_release);
    }
}

static inline __attribute__((always_inline)) size_t remote_consume(bool spindle, struct ring *r,
                                                                   size_t n) {
    size_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed), end = tail + n, bad = 0;
    while (tail < end) {
        size_t head = atomic_load_explicit(&r->head, memory_order_acquire);
        if (head == tail) {
            sp_thread_yield();
            continue;
        }
        for (; tail < head && tail < end; tail++) {
            void *p = r->slot[tail % RING];
            bad += *(size_t *)p - 16 > 240;
            who_free(spindle, p);
        }
        atomic_store_explicit(&r->tail, tail, memory_order_release);
    }
    return bad;
}

static __attribute__((noinline)) void produce_spindle(struct ring *r, size_t n) {
    remote_produce(true, r, n);
}
static __attribute__((noinline)) void produce_process(struct ring *r, size_t n) {
    remote_produce(false, r, n);
}
static __attribute__((noinline)) size_t consume_spindle(struct ring *r, size_t n) {
    return remote_consume(true, r, n);
}
static __attribute__((noinline)) size_t consume_process(struct ring *r, size_t n) {
    return remote_consume(false, r, n);
}

static inline __attribute__((always_inline)) void server_run(bool spindle, int thread, size_t n) {
    uint64_t seed = 0x5e4e4 ^ (uint64_t)thread << 32;
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rng_next(&seed);
        size_t size = size_upto(r >> 32, SERVER_MAX);
        void *p = who_alloc(spindle, size);
        *(size_t *)p = size;
        void *old = atomic_exchange_explicit(&sh.server[r % SERVER_SLOTS], p, memory_order_acq_rel);
        who_free(spindle, old);
    }
}

static __attribute__((noinline)) void server_spindle(int t, size_t n) {
    server_run(true, t, n);
}
static __attribute__((noinline)) void server_process(int t, size_t n) {
    server_run(false, t, n);
}

/* Thread t on CPU t % CPUs, in every case and for every allocator alike. Left to the
 * scheduler, a remote pair sometimes shares a CPU (taking turns through sched_yield) and
 * sometimes not, and the peers' times differ about 10x between the two (bench/README.md,
 * "Corrections from an audit"); two local threads sometimes shared a CPU for part of a sample
 * (bench/README.md, the tcache harness's description).
 * Returns the old mask to restore. */
static bool pin_thread(int t, cpu_set_t *old) {
    if (pthread_getaffinity_np(pthread_self(), sizeof *old, old) != 0) return false;
    int cpu = sp_cpu_nth((uint32_t)t);
    return cpu != SP_CPU_ANY && sp_thread_pin(sp_thread_self(), cpu) == SP_OK;
}

/* Before the peak is reset, each thread allocates one block of every 16-byte size step the case
 * uses, with the allocator under test, and frees them: the first page of each size class is
 * then resident for every allocator. The peers had theirs already, as the process malloc also
 * serves the harness (Google Benchmark's own allocations); spindle's thread caches serve
 * nothing else, and their first pages were counted as the case's growth (bench/README.md,
 * "Corrections from an audit"). */
static void warm_classes(bool spindle, size_t max) {
    void *p[SERVER_MAX / 16];
    size_t k = 0;
    for (size_t size = 16; size <= max; size += 16) p[k++] = who_alloc(spindle, size);
    while (k) who_free(spindle, p[--k]);
}

static void run_case(bench_state *st, const void *varg) {
    const bench_arg *a = varg;
    int t = bench_thread_index(st), n = bench_threads(st);
    cpu_set_t old_mask;
    bool pinned = pin_thread(t, &old_mask);
    region mem;
    op *ops = NULL;
    warm_classes(a->spindle, a->k == SERVER ? SERVER_MAX : LOCAL_MAX);
    if (a->k == LOCAL) ops = local_stream(st, &mem);
    meet(n); /* every stream and first page resident before the reset */
    if (t == 0) {
        if (a->k == SERVER)
            for (int i = 0; i < SERVER_SLOTS; i++)
                atomic_store(&sh.server[i], who_alloc(a->spindle, size_upto(i, SERVER_MAX)));
        for (int i = 0; i < MAX_THREADS / 2; i++) {
            atomic_store(&sh.ring[i].head, 0);
            atomic_store(&sh.ring[i].tail, 0);
        }
        sh.rss_base = rss_reset();
    }
    meet(n);
    const char *err = NULL;
    double ns_per_pair = 0;
    if (a->k == LOCAL) {
        size_t pairs = 0;
        uint64_t ns = ops ? run_local(st, a, ops, &pairs) : 0;
        if (ops) region_put(&mem);
        if (!ns)
            err = "local: allocation or harness memory failed";
        else
            ns_per_pair = (double)ns / (double)pairs;
    } else {
        size_t per = a->k == REMOTE ? cfg.remote_pairs / (size_t)(n / 2) : cfg.server_ops;
        uint64_t ns = 0, total = 0;
        size_t bad = 0;
        while (bench_keep_running_batch(st, 1)) {
            uint64_t t0 = sp_time_ns();
            if (a->k == SERVER) {
                (a->spindle ? server_spindle : server_process)(t, per);
                total = per * (size_t)n;
            } else if (t % 2 == 0) {
                (a->spindle ? produce_spindle : produce_process)(&sh.ring[t / 2], per);
                total = per * (size_t)(n / 2);
            } else {
                bad = (a->spindle ? consume_spindle : consume_process)(&sh.ring[t / 2], per);
                total = per * (size_t)(n / 2);
            }
            ns += sp_time_ns() - t0;
        }
        if (bad) err = "remote: a block arrived damaged";
        ns_per_pair = total ? (double)ns / (double)total : 0;
    }
    meet(n);
    if (t == 0) {
        long hwm = status_kb("VmHWM:");
        bench_counter(st, "peak_rss_kb",
                      sh.rss_base >= 0 && hwm > sh.rss_base ? (double)(hwm - sh.rss_base) : 0,
                      BENCH_COUNTER_DEFAULT);
        if (a->k == SERVER)
            for (int i = 0; i < SERVER_SLOTS; i++)
                who_free(a->spindle, atomic_exchange(&sh.server[i], NULL));
    }
    bench_counter(st, "ns_per_pair", ns_per_pair, BENCH_COUNTER_AVG_THREADS);
    if (err) bench_skip_with_error(st, err);
    if (pinned) pthread_setaffinity_np(pthread_self(), sizeof old_mask, &old_mask);
}

static bool process_malloc_verify(void) {
    const char *lib = peer_malloc_lib("bench_tcache");
    if (lib) fprintf(stderr, "# bench_tcache: process malloc is %s (%s)\n", PEER_NAME, lib);
    return lib != NULL;
}

int main(int argc, char **argv) {
    const char *env = getenv("BENCH_SMOKE");
    cfg.smoke = bench_take_flag(&argc, argv, "--smoke") || (env && env[0] && env[0] != '0');
    if (cfg.smoke) {
        cfg.local_ops = 1u << 12;
        cfg.passes = 1;
        cfg.remote_pairs = 1u << 12;
        cfg.server_ops = 1u << 12;
    }
    if (!process_malloc_verify()) return 1;
    static const struct {
        kind k;
        const char *name;
        int threads[4];
    } cases[] = {
        {LOCAL, "local", {1, 2, 4, 8}},
        {REMOTE, "remote", {2, 4, 0, 0}},
        {SERVER, "server", {2, 4, 0, 0}},
    };
    static bench_arg args[3][4][2];
    static char names[3][4][2][64];
#if defined(BENCH_PEER_GLIBC)
    int first = 0;
#else
    int first = 1; /* peer binaries: the peer only; spindle runs in bench_tcache */
#endif
    /* Cases interleaved by WHO so that the figures compared sit close together in time. */
    for (int c = 0; c < 3; c++)
        for (int i = 0; i < 4 && cases[c].threads[i]; i++)
            for (int w = first; w < 2; w++) {
                int n = cases[c].threads[i];
                args[c][i][w] = (bench_arg){cases[c].k, w == 0, n};
                if (cases[c].k == LOCAL && n == 1)
                    snprintf(names[c][i][w], sizeof names[c][i][w], "tcache/%s/%s", cases[c].name,
                             w == 0 ? "spindle" : PEER_NAME);
                else
                    snprintf(names[c][i][w], sizeof names[c][i][w], "tcache/%s/%s/workers:%d",
                             cases[c].name, w == 0 ? "spindle" : PEER_NAME, n);
                bench_register(names[c][i][w], run_case, &args[c][i][w], n);
            }
    return bench_main(argc, argv);
}
