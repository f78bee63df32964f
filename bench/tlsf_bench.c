/* The `tlsf` benchmark area: sp_tlsf against the process malloc (glibc, or a peer linked in as
 * the process malloc: build with -DBENCH_PEER_JEMALLOC, _TCMALLOC or _MIMALLOC).
 *
 * Every case replays one seeded, pre-generated stream of "pairs" (free the block in a random
 * slot, allocate a new random size into it, write one word into it) over a fixed number of live
 * blocks; every allocator sees the identical sequence. Names: tlsf/CASE/WHO. Headline counter:
 * ns_per_pair (timed by the case, averaged over threads); the latency case times each malloc and
 * each free with sp_ticks and reports percentiles in ns.
 *
 * Own flags (removed before Google Benchmark parses argv): --smoke (tiny streams, live blocks
 * capped at 10,000, one pass: every case runs once, quickly). BENCH_SMOKE=1 does the same.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "sp_platform.h"
#include "sp_tlsf.h"

#include "peer.h"

#if defined(BENCH_PEER_JEMALLOC)
#include <jemalloc/jemalloc.h>
#elif defined(BENCH_PEER_TCMALLOC)
#include <gperftools/malloc_extension_c.h>
#include <gperftools/tcmalloc.h>
#elif defined(BENCH_PEER_MIMALLOC)
#include <mimalloc.h>
#else
#include <gnu/libc-version.h>
#endif

#define SPINDLE_HEAP_BYTES ((size_t)2 << 30) /* reserved and committed, faulted on first touch */
#define SEED 0x5d1e7f5bu

typedef struct tlsf_case {
    const char *name;
    uint32_t min_size, max_size; /* request sizes, uniform, inclusive */
    uint32_t live;               /* live blocks kept throughout */
    bool latency;                /* time every operation with sp_ticks */
} tlsf_case;

static const tlsf_case cases[] = {
    {"small", 16, 256, 1000, false},
    {"medium", 16, 4096, 10000, false},
    {"large", 16, 65536, 10000, false},
    {"latency", 16, 4096, 10000, true},
    {"medium_live1000", 16, 4096, 1000, false},
    {"medium_live100000", 16, 4096, 100000, false},
};

/* Run configuration, fixed before registration. */
static struct {
    size_t pairs;   /* pairs in one pass over the stream */
    int64_t passes; /* timed passes per batch (one Google Benchmark iteration each); latency: 1 */
    uint32_t live_cap; /* smoke: fewer live blocks */
    bool smoke;
} cfg = {1u << 20, 4, UINT32_MAX, false};

typedef struct pair_op {
    uint32_t slot;
    uint32_t size;
} pair_op;

/* ---- the seeded stream (harness memory and rng_next: peer.h) --------------------------- */

static uint32_t rng_below(uint64_t *s, uint32_t n) /* [0, n), multiply-shift */
{
    return (uint32_t)(((rng_next(s) >> 32) * (uint64_t)n) >> 32);
}

/* Sizes of the initial live blocks, then `pairs` ops; identical for every allocator. */
static void stream_fill(const tlsf_case *c, uint32_t live, int thread, uint32_t *fill, pair_op *ops,
                        size_t pairs) {
    uint64_t s = SEED ^ ((uint64_t)(c - cases) << 32) ^ (uint64_t)thread << 48;
    uint32_t span = c->max_size - c->min_size + 1;
    for (uint32_t i = 0; i < live; i++) fill[i] = c->min_size + rng_below(&s, span);
    for (size_t i = 0; i < pairs; i++) {
        ops[i].slot = rng_below(&s, live);
        ops[i].size = c->min_size + rng_below(&s, span);
    }
}

/* ---- the allocator under test: one branch on a constant, inlined away ------------------ */

static inline __attribute__((always_inline)) void *who_malloc(bool spindle, sp_tlsf *h, size_t n) {
    return spindle ? sp_tlsf_malloc(h, n) : malloc(n);
}

static inline __attribute__((always_inline)) void who_free(bool spindle, sp_tlsf *h, void *p) {
    if (spindle)
        sp_tlsf_free(h, p);
    else
        free(p);
}

/* Allocate the initial live blocks. Returns false if an allocation failed. */
static inline __attribute__((always_inline)) bool prefill(bool spindle, sp_tlsf *h, void **slots,
                                                          const uint32_t *fill, uint32_t live) {
    for (uint32_t i = 0; i < live; i++) {
        void *p = who_malloc(spindle, h, fill[i]);
        if (!p) return false;
        *(volatile uint64_t *)p = fill[i];
        slots[i] = p;
    }
    return true;
}

/* One pass over the stream. Returns false if an allocation failed (slot left NULL). */
static inline __attribute__((always_inline)) bool pass_run(bool spindle, sp_tlsf *h, void **slots,
                                                           const pair_op *ops, size_t pairs) {
    for (size_t i = 0; i < pairs; i++) {
        void **s = &slots[ops[i].slot];
        who_free(spindle, h, *s);
        void *p = who_malloc(spindle, h, ops[i].size);
        *s = p;
        if (__builtin_expect(p == NULL, 0)) return false;
        *(uint64_t *)p = ops[i].size;
    }
    bench_escape(slots);
    return true;
}

/* One pass timing each free and each malloc: ticks[2i] = free, ticks[2i+1] = malloc. */
static inline __attribute__((always_inline)) bool pass_timed(bool spindle, sp_tlsf *h, void **slots,
                                                             const pair_op *ops, size_t pairs,
                                                             uint32_t *ticks) {
    for (size_t i = 0; i < pairs; i++) {
        void **s = &slots[ops[i].slot];
        uint64_t t0 = sp_ticks();
        who_free(spindle, h, *s);
        uint64_t t1 = sp_ticks();
        void *p = who_malloc(spindle, h, ops[i].size);
        uint64_t t2 = sp_ticks();
        *s = p;
        if (__builtin_expect(p == NULL, 0)) return false;
        *(uint64_t *)p = ops[i].size;
        ticks[2 * i] = t1 - t0 > UINT32_MAX ? UINT32_MAX : (uint32_t)(t1 - t0);
        ticks[2 * i + 1] = t2 - t1 > UINT32_MAX ? UINT32_MAX : (uint32_t)(t2 - t1);
    }
    bench_escape(slots);
    return true;
}

static inline __attribute__((always_inline)) void drain(bool spindle, sp_tlsf *h, void **slots,
                                                        uint32_t live) {
    for (uint32_t i = 0; i < live; i++) {
        who_free(spindle, h, slots[i]);
        slots[i] = NULL;
    }
}

/* The two instantiations: direct calls, no function pointers in the timed loops. */
#define WHO_FUNCS(tag, spindle)                                                                    \
    static __attribute__((noinline)) bool prefill_##tag(sp_tlsf *h, void **s, const uint32_t *f,   \
                                                        uint32_t n) {                              \
        return prefill(spindle, h, s, f, n);                                                       \
    }                                                                                              \
    static __attribute__((noinline)) bool pass_##tag(sp_tlsf *h, void **s, const pair_op *o,       \
                                                     size_t n) {                                   \
        return pass_run(spindle, h, s, o, n);                                                      \
    }                                                                                              \
    static __attribute__((noinline)) bool timed_##tag(sp_tlsf *h, void **s, const pair_op *o,      \
                                                      size_t n, uint32_t *t) {                     \
        return pass_timed(spindle, h, s, o, n, t);                                                 \
    }                                                                                              \
    static __attribute__((noinline)) void drain_##tag(sp_tlsf *h, void **s, uint32_t n) {          \
        drain(spindle, h, s, n);                                                                   \
    }
WHO_FUNCS(spindle, true)
WHO_FUNCS(process, false)

typedef struct who_ops {
    const char *name;
    bool spindle;
    bool (*prefill)(sp_tlsf *, void **, const uint32_t *, uint32_t);
    bool (*pass)(sp_tlsf *, void **, const pair_op *, size_t);
    bool (*timed)(sp_tlsf *, void **, const pair_op *, size_t, uint32_t *);
    void (*drain)(sp_tlsf *, void **, uint32_t);
} who_ops;

static const who_ops who_spindle = {"spindle",    true,          prefill_spindle,
                                    pass_spindle, timed_spindle, drain_spindle};
static const who_ops who_process = {PEER_NAME,    false,         prefill_process,
                                    pass_process, timed_process, drain_process};

/* ---- percentiles ----------------------------------------------------------------------- */

static void radix_sort_u32(uint32_t *a, uint32_t *tmp, size_t n) {
    for (int shift = 0; shift < 32; shift += 8) {
        size_t count[257] = {0};
        for (size_t i = 0; i < n; i++) count[((a[i] >> shift) & 0xff) + 1]++;
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (size_t i = 0; i < n; i++) tmp[count[(a[i] >> shift) & 0xff]++] = a[i];
        uint32_t *t = a;
        a = tmp;
        tmp = t;
    }
    /* four passes: the sorted data is back in the caller's `a` */
}

/* Nearest-rank percentile q (0 < q <= 1) of sorted[0..n). */
static uint32_t rank(const uint32_t *sorted, size_t n, double q) {
    size_t k = (size_t)(q * (double)n + 0.999999);
    return sorted[(k == 0 ? 1 : k > n ? n : k) - 1];
}

static void latency_counters(bench_state *st, uint32_t *ticks, uint32_t *tmp, size_t pairs) {
    static const struct {
        const char *name;
        double q;
    } qs[] = {{"p50", 0.50}, {"p99", 0.99}, {"p99_9", 0.999}, {"p99_99", 0.9999}, {"max", 1.0}};
    size_t n = 2 * pairs;
    /* Split into frees (even) and mallocs (odd) for two figures of their own. */
    for (size_t i = 0; i < pairs; i++) {
        tmp[i] = ticks[2 * i];
        tmp[pairs + i] = ticks[2 * i + 1];
    }
    memcpy(ticks, tmp, n * sizeof *ticks);
    radix_sort_u32(ticks, tmp, pairs);
    bench_counter(st, "free_p99", sp_ticks_to_ns(rank(ticks, pairs, 0.99)),
                  BENCH_COUNTER_AVG_THREADS);
    radix_sort_u32(ticks + pairs, tmp, pairs);
    bench_counter(st, "malloc_p99", sp_ticks_to_ns(rank(ticks + pairs, pairs, 0.99)),
                  BENCH_COUNTER_AVG_THREADS);
    radix_sort_u32(ticks, tmp, n);
    for (size_t i = 0; i < sizeof qs / sizeof qs[0]; i++)
        bench_counter(st, qs[i].name, sp_ticks_to_ns(rank(ticks, n, qs[i].q)),
                      BENCH_COUNTER_AVG_THREADS);

    /* Cost of the measurement itself: median of back-to-back sp_ticks pairs. */
    enum { CAL = 4096 };
    for (size_t i = 0; i < CAL; i++) {
        uint64_t a = sp_ticks();
        uint64_t b = sp_ticks();
        tmp[i] = (uint32_t)(b - a);
    }
    radix_sort_u32(tmp, ticks, CAL);
    bench_counter(st, "tick_overhead", sp_ticks_to_ns(rank(tmp, CAL, 0.5)),
                  BENCH_COUNTER_AVG_THREADS);
}

/* ---- one benchmark --------------------------------------------------------------------- */

typedef struct bench_arg {
    const tlsf_case *c;
    const who_ops *who;
} bench_arg;

static void run_case(bench_state *st, const void *varg) {
    const bench_arg *arg = varg;
    const tlsf_case *c = arg->c;
    const who_ops *who = arg->who;
    uint32_t live = c->live < cfg.live_cap ? c->live : cfg.live_cap;
    size_t pairs = cfg.pairs;
    const char *err = NULL;

    region mem = {0}, heap_mem = {0};
    size_t b_fill = (size_t)live * sizeof(uint32_t), b_slots = (size_t)live * sizeof(void *);
    size_t b_ops = pairs * sizeof(pair_op), b_ticks = c->latency ? 2 * pairs * sizeof(uint32_t) : 0;
    b_fill = (b_fill + 63) & ~(size_t)63;
    b_slots = (b_slots + 63) & ~(size_t)63;
    b_ops = (b_ops + 63) & ~(size_t)63;
    char *base = region_get(&mem, b_fill + b_slots + b_ops + 2 * b_ticks);
    if (!base) {
        bench_skip_with_error(st, "harness memory: sp_vm_reserve/commit failed");
        return;
    }
    uint32_t *fill = (uint32_t *)base;
    void **slots = (void **)(base + b_fill);
    pair_op *ops = (pair_op *)(base + b_fill + b_slots);
    uint32_t *ticks = (uint32_t *)(base + b_fill + b_slots + b_ops);
    uint32_t *tmp = (uint32_t *)(base + b_fill + b_slots + b_ops + b_ticks);
    stream_fill(c, live, bench_thread_index(st), fill, ops, pairs);

    sp_tlsf *h = NULL;
    if (who->spindle) {
        if (!region_get(&heap_mem, SPINDLE_HEAP_BYTES)) {
            err = "spindle heap: sp_vm_reserve/commit failed";
            goto out_mem;
        }
        sp_tlsf_desc d = {.memory = heap_mem.p, .size = heap_mem.size, .name = "bench"};
        h = sp_tlsf_create(&d, NULL);
        if (!h) {
            err = "sp_tlsf_create failed";
            goto out_heap;
        }
    }

    /* Untimed: the live set, then one warm-up pass (faults pages in, reaches steady state). */
    if (!who->prefill(h, slots, fill, live) || !who->pass(h, slots, ops, pairs)) {
        err = "allocation failed (out of memory?)";
        goto out_drain;
    }

    if (c->latency) {
        bool ok = true; /* one pass per batch; a later batch overwrites the samples */
        while (ok && bench_keep_running_batch(st, 1)) ok = who->timed(h, slots, ops, pairs, ticks);
        if (!ok) {
            err = "allocation failed (out of memory?)";
            goto out_drain;
        }
        latency_counters(st, ticks, tmp, pairs);
    } else {
        uint64_t ns = 0;
        int64_t done = 0;
        bool ok = true;
        while (ok && bench_keep_running_batch(st, cfg.passes)) {
            for (int64_t p = 0; ok && p < cfg.passes; p++) {
                uint64_t t0 = sp_time_ns();
                ok = who->pass(h, slots, ops, pairs);
                ns += sp_time_ns() - t0;
                done++;
            }
        }
        if (!ok) {
            err = "allocation failed (out of memory?)";
            goto out_drain;
        }
        if (done > 0)
            bench_counter(st, "ns_per_pair", (double)ns / ((double)done * (double)pairs),
                          BENCH_COUNTER_AVG_THREADS);
    }
    bench_counter(st, "live_blocks", live, BENCH_COUNTER_AVG_THREADS);
    bench_counter(st, "pairs_per_pass", (double)pairs, BENCH_COUNTER_AVG_THREADS);

    /* Smoke runs double as a correctness check of the heap after the workload. */
    if (h && cfg.smoke && sp_tlsf_check(h) != SP_OK)
        err = "sp_tlsf_check failed after the workload";

out_drain:
    who->drain(h, slots, live);
    if (h) {
        size_t leaked = sp_tlsf_destroy(h);
        if (leaked && !err) {
            static char msg[96];
            snprintf(msg, sizeof msg, "sp_tlsf_destroy: %zu blocks leaked", leaked);
            err = msg;
        }
    }
out_heap:
    region_put(&heap_mem);
out_mem:
    region_put(&mem);
    if (err) bench_skip_with_error(st, err);
}

/* ---- is the process malloc the one this binary claims? ---------------------------------- */

static bool process_malloc_verify(void) {
    const char *lib = peer_malloc_lib("bench_tlsf");
    if (!lib) return false;
    bool owned = true;
    const char *version = "";
    void *p = malloc(4096);
    bench_escape(p);
#if defined(BENCH_PEER_JEMALLOC)
    /* thread.allocated counts bytes this thread got from jemalloc's malloc. */
    uint64_t before = 0, after = 0;
    size_t len = sizeof before;
    free(p);
    owned = mallctl("thread.allocated", &before, &len, NULL, 0) == 0;
    p = malloc(4096);
    bench_escape(p);
    len = sizeof after;
    owned =
        owned && mallctl("thread.allocated", &after, &len, NULL, 0) == 0 && after >= before + 4096;
    len = sizeof version;
    if (mallctl("version", &version, &len, NULL, 0) != 0) version = "?";
#elif defined(BENCH_PEER_TCMALLOC)
    owned = MallocExtension_GetOwnership(p) == MallocExtension_kOwned;
    version = tc_version(NULL, NULL, NULL);
#elif defined(BENCH_PEER_MIMALLOC)
    char vbuf[32];
    owned = mi_is_in_heap_region(p);
    snprintf(vbuf, sizeof vbuf, "%d", mi_version());
    version = vbuf;
#else
    version = gnu_get_libc_version();
#endif
    free(p);
    if (!owned) {
        fprintf(stderr, "bench_tlsf: malloc is not served by %s\n", PEER_NAME);
        return false;
    }
    fprintf(stderr, "# bench_tlsf: process malloc is %s %s (%s)\n", PEER_NAME, version, lib);
    return true;
}

int main(int argc, char **argv) {
    const char *env = getenv("BENCH_SMOKE");
    cfg.smoke = bench_take_flag(&argc, argv, "--smoke") || (env && env[0] && env[0] != '0');
    if (cfg.smoke) {
        cfg.pairs = 1u << 14;
        cfg.passes = 1;
        cfg.live_cap = 10000;
    }
    if (!process_malloc_verify()) return 1;

    /* Cases interleaved by WHO so that the figures compared sit close together in time. */
    enum { NCASES = sizeof cases / sizeof cases[0] };
    static bench_arg args[NCASES][2];
    static char names[NCASES][2][64];
    for (int i = 0; i < NCASES; i++) {
        const who_ops *whos[2] = {&who_spindle, &who_process};
#if defined(BENCH_PEER_GLIBC)
        int first = 0;
#else
        int first = 1; /* peer binaries: the peer only; spindle runs in bench_tlsf */
#endif
        for (int w = first; w < 2; w++) {
            args[i][w] = (bench_arg){&cases[i], whos[w]};
            snprintf(names[i][w], sizeof names[i][w], "tlsf/%s/%s", cases[i].name, whos[w]->name);
            bench_register(names[i][w], run_case, &args[i][w], 1);
        }
    }
    return bench_main(argc, argv);
}
