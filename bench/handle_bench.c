/* The `handle` benchmark area: the handle heap (alloc/sp_handle.h) against in-process peers.
 * Names: handle/CASE/WHO.
 *
 *   resolve  4,096 live handles resolved in a random order (a precomputed index stream), one
 *            byte of each block read. WHO spindle: sp_handle_resolve (inline); WHO pointer: the
 *            same blocks through an array of raw pointers (the floor). Headline `ns` per
 *            resolve + load.
 *   compact  a 64 MiB heap of blocks of 256 B..16 KiB (uniform), every other block freed,
 *            then one unbudgeted sp_handle_compact. WHO spindle: bytes moved / compaction
 *            time; WHO memmove: the same blocks of an identical layout packed down with one
 *            memmove each (what any mover must at least do). Headline `mb_per_s`.
 *   budget   a 32 MiB heap (blocks 256 B..16 KiB); 1,000 frames, each frees 2% of the blocks
 *            at random and allocates as many new ones, then sp_handle_compact(500 us). Ratio
 *            time spent (the call's own wall-clock figure) / budget per frame; headlines
 *            `p99_over_budget` and `p50_over_budget` (nearest rank over the 1,000 frames),
 *            `frames_caught_up`, and the same ratios in thread CPU time
 *            (`p99_cpu_over_budget`, `p50_cpu_over_budget`: preemption excluded).
 *   churn    10,000 live blocks of 16..4096 B; pairs of (free a random slot, allocate a new
 *            random size there, write 8 bytes). WHO spindle: sp_handle_free + sp_handle_alloc
 *            + resolve; WHO tlsf: sp_tlsf_free + sp_tlsf_malloc on a locked TLSF heap (both
 *            take one lock per call). Headline `ns_per_pair`.
 *
 * Own flags (removed before Google Benchmark parses argv): --smoke (or BENCH_SMOKE=1): tiny
 * workloads, every case once; the figures mean nothing. Harness memory comes from malloc or
 * sp_vm_reserve, never from the heap under test.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "sp_handle.h"
#include "sp_platform.h"
#include "sp_tlsf.h"

static struct {
    uint32_t resolve_handles;
    int64_t resolves;
    size_t compact_bytes;
    size_t budget_bytes;
    uint32_t budget_frames;
    uint64_t budget_ns;
    uint32_t churn_live;
    int64_t churn_pairs;
    bool smoke;
} cfg = {4096, 1 << 24, (size_t)64 << 20, (size_t)32 << 20, 1000, 500000, 10000, 1 << 21, false};

/* splitmix64: the harness's own seeded stream */
static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}
static uint64_t rng_range(uint64_t *s, uint64_t lo, uint64_t hi) {
    return lo + rng_next(s) % (hi - lo + 1);
}

static void fail(bench_state *st, const char *msg) {
    bench_skip_with_error(st, msg);
}

/* ---- resolve ---------------------------------------------------------------------------- */

typedef struct resolve_set {
    sp_handle_heap *heap;
    sp_handle *handles;
    char **ptrs;
    uint32_t *order; /* resolves entries of indices */
} resolve_set;

static bool resolve_setup(resolve_set *r) {
    uint32_t n = cfg.resolve_handles;
    r->heap = sp_handle_heap_create(NULL, NULL);
    r->handles = malloc(n * sizeof *r->handles);
    r->ptrs = malloc(n * sizeof *r->ptrs);
    r->order = malloc((size_t)cfg.resolves * sizeof *r->order);
    if (!r->heap || !r->handles || !r->ptrs || !r->order) return false;
    uint64_t s = 1;
    for (uint32_t i = 0; i < n; i++) {
        r->handles[i] = sp_handle_alloc(r->heap, 64, 0);
        r->ptrs[i] = sp_handle_resolve(r->heap, r->handles[i]);
        if (!r->ptrs[i]) return false;
        memset(r->ptrs[i], (int)i, 64);
    }
    for (int64_t i = 0; i < cfg.resolves; i++) r->order[i] = (uint32_t)rng_range(&s, 0, n - 1);
    return true;
}

static void resolve_teardown(resolve_set *r) {
    sp_handle_heap_destroy(r->heap);
    free(r->handles);
    free(r->ptrs);
    free(r->order);
}

/* Both loops keep the arrays in locals (as game code would): the resolve's acquire load would
 * otherwise make the compiler reload r's fields on every iteration. */
static __attribute__((noinline)) uint64_t resolve_loop(resolve_set *r) {
    sp_handle_heap *heap = r->heap;
    const sp_handle *handles = r->handles;
    const uint32_t *order = r->order;
    int64_t n = cfg.resolves;
    uint64_t sum = 0;
    for (int64_t i = 0; i < n; i++)
        sum += *(const char *)sp_handle_resolve(heap, handles[order[i]]);
    return sum;
}

static __attribute__((noinline)) uint64_t pointer_loop(resolve_set *r) {
    char *const *ptrs = r->ptrs;
    const uint32_t *order = r->order;
    int64_t n = cfg.resolves;
    uint64_t sum = 0;
    for (int64_t i = 0; i < n; i++) sum += *(const char *)ptrs[order[i]];
    return sum;
}

static void run_resolve(bench_state *st, const void *arg) {
    bool spindle = arg != NULL;
    resolve_set r = {0};
    if (!resolve_setup(&r)) {
        fail(st, "resolve setup failed");
        resolve_teardown(&r);
        return;
    }
    volatile uint64_t sink = spindle ? resolve_loop(&r) : pointer_loop(&r); /* warm-up */
    uint64_t ns = 0, done = 0;
    while (bench_keep_running_batch(st, cfg.resolves)) {
        uint64_t t0 = sp_time_ns();
        sink = spindle ? resolve_loop(&r) : pointer_loop(&r);
        ns += sp_time_ns() - t0;
        done += (uint64_t)cfg.resolves;
    }
    (void)sink;
    if (done) bench_counter(st, "ns", (double)ns / (double)done, BENCH_COUNTER_DEFAULT);
    resolve_teardown(&r);
}

/* ---- compact ---------------------------------------------------------------------------- */

static void run_compact_spindle(bench_state *st, const void *arg) {
    (void)arg;
    sp_handle_heap *h = sp_handle_heap_create(NULL, NULL);
    size_t cap = cfg.compact_bytes / 256 + 1, n = 0, total = 0;
    sp_handle *hs = malloc(cap * sizeof *hs);
    uint64_t s = 2;
    while (h && hs && total < cfg.compact_bytes && n < cap) {
        size_t size = rng_range(&s, 256, 16384);
        hs[n] = sp_handle_alloc(h, size, 0);
        if (!hs[n].id) break;
        memset(sp_handle_resolve(h, hs[n]), 1, size);
        total += size;
        n++;
    }
    for (size_t i = 0; i < n; i += 2) sp_handle_free(h, hs[i]);
    /* the first call does the work; later calls (a min_time above 0) find nothing to do */
    sp_handle_compact_stats cs = {0};
    uint64_t ns = 0, moved = 0;
    while (bench_keep_running_batch(st, 1)) {
        uint64_t t0 = sp_time_ns();
        sp_handle_compact(h, 0, &cs);
        ns += sp_time_ns() - t0;
        moved += cs.bytes_moved;
    }
    if (!cs.caught_up || !moved) fail(st, "compaction did not finish");
    if (cfg.smoke && sp_handle_heap_check(h) != SP_OK) fail(st, "heap check failed");
    bench_counter(st, "mb_per_s", (double)moved / 1e6 / ((double)ns / 1e9), BENCH_COUNTER_DEFAULT);
    bench_counter(st, "bytes_moved", (double)moved, BENCH_COUNTER_DEFAULT);
    free(hs);
    sp_handle_heap_destroy(h);
}

/* The same layout (16-byte header + payload rounded to 16, like the heap), every other block
 * gone, the rest packed down with one memmove each. */
static void run_compact_memmove(bench_state *st, const void *arg) {
    (void)arg;
    size_t span = cfg.compact_bytes + cfg.compact_bytes / 8 + (1 << 20);
    char *buf = sp_vm_reserve(span, 0, false, NULL);
    if (!buf || sp_vm_commit(buf, span) != SP_OK) {
        fail(st, "memmove setup failed");
        return;
    }
    size_t cap = cfg.compact_bytes / 256 + 1, n = 0, total = 0, at = 0;
    size_t *off = malloc(cap * sizeof *off), *len = malloc(cap * sizeof *len);
    uint64_t s = 2;
    while (off && len && total < cfg.compact_bytes && n < cap) {
        size_t size = rng_range(&s, 256, 16384);
        off[n] = at;
        len[n] = 16 + (size + 15) / 16 * 16;
        at += len[n];
        total += size;
        n++;
    }
    memset(buf, 1, at);
    uint64_t ns = 0, moved = 0;
    while (bench_keep_running_batch(st, 1)) {
        uint64_t t0 = sp_time_ns();
        size_t dst = 0;
        for (size_t i = 0; i < n; i++) {
            if (i % 2 == 0) continue; /* freed */
            if (dst != off[i]) {
                memmove(buf + dst, buf + off[i], len[i]);
                moved += len[i];
            }
            dst += len[i];
        }
        ns += sp_time_ns() - t0;
    }
    bench_escape(buf);
    bench_counter(st, "mb_per_s", (double)moved / 1e6 / ((double)ns / 1e9), BENCH_COUNTER_DEFAULT);
    bench_counter(st, "bytes_moved", (double)moved, BENCH_COUNTER_DEFAULT);
    free(off);
    free(len);
    sp_vm_release(buf, span);
}

/* ---- budget ----------------------------------------------------------------------------- */

/* CPU time of the calling thread: time the thread was preempted (the VM is shared) is not in
 * it, wall time (what the budget bounds) is. */
static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void run_budget(bench_state *st, const void *arg) {
    (void)arg;
    sp_handle_heap *h = sp_handle_heap_create(NULL, NULL);
    size_t cap = cfg.budget_bytes / 256 + 1, n = 0, total = 0;
    sp_handle *hs = malloc(cap * sizeof *hs);
    double *ratio = malloc(cfg.budget_frames * sizeof *ratio);
    double *cpu = malloc(cfg.budget_frames * sizeof *cpu);
    uint64_t s = 3;
    while (h && hs && total < cfg.budget_bytes && n < cap) {
        size_t size = rng_range(&s, 256, 16384);
        hs[n] = sp_handle_alloc(h, size, 0);
        if (!hs[n].id) break;
        total += size;
        n++;
    }
    sp_handle_compact(h, 0, NULL);
    uint32_t caught_up = 0;
    bool ok = hs && ratio && cpu && n > 0;
    while (bench_keep_running_batch(st, 1)) {
        for (uint32_t f = 0; ok && f < cfg.budget_frames; f++) {
            for (size_t k = 0; k < n / 50; k++) {
                size_t i = rng_range(&s, 0, n - 1);
                sp_handle_free(h, hs[i]);
                hs[i] = sp_handle_alloc(h, rng_range(&s, 256, 16384), 0);
                ok &= hs[i].id != 0;
            }
            sp_handle_compact_stats cs;
            uint64_t c0 = cpu_ns();
            sp_handle_compact(h, cfg.budget_ns, &cs);
            cpu[f] = (double)(cpu_ns() - c0) / (double)cfg.budget_ns;
            ratio[f] = (double)cs.ns / (double)cfg.budget_ns;
            caught_up += cs.caught_up;
        }
    }
    if (!ok) {
        fail(st, "budget setup or churn failed");
    } else {
        qsort(ratio, cfg.budget_frames, sizeof *ratio, cmp_double);
        uint32_t m = cfg.budget_frames;
        bench_counter(st, "p99_over_budget", ratio[(m * 99 + 99) / 100 - 1], BENCH_COUNTER_DEFAULT);
        bench_counter(st, "p50_over_budget", ratio[(m + 1) / 2 - 1], BENCH_COUNTER_DEFAULT);
        bench_counter(st, "max_over_budget", ratio[m - 1], BENCH_COUNTER_DEFAULT);
        bench_counter(st, "frames_caught_up", caught_up, BENCH_COUNTER_DEFAULT);
        qsort(cpu, cfg.budget_frames, sizeof *cpu, cmp_double);
        bench_counter(st, "p99_cpu_over_budget", cpu[(m * 99 + 99) / 100 - 1],
                      BENCH_COUNTER_DEFAULT);
        bench_counter(st, "p50_cpu_over_budget", cpu[(m + 1) / 2 - 1], BENCH_COUNTER_DEFAULT);
    }
    free(hs);
    free(ratio);
    free(cpu);
    sp_handle_heap_destroy(h);
}

/* ---- churn ------------------------------------------------------------------------------ */

typedef struct churn_stream {
    uint32_t *slot;
    uint32_t *size;
} churn_stream;

static bool stream_make(churn_stream *c) {
    c->slot = malloc((size_t)cfg.churn_pairs * sizeof *c->slot);
    c->size = malloc((size_t)cfg.churn_pairs * sizeof *c->size);
    if (!c->slot || !c->size) return false;
    uint64_t s = 4;
    for (int64_t i = 0; i < cfg.churn_pairs; i++) {
        c->slot[i] = (uint32_t)rng_range(&s, 0, cfg.churn_live - 1);
        c->size[i] = (uint32_t)rng_range(&s, 16, 4096);
    }
    return true;
}

static __attribute__((noinline)) bool churn_spindle(sp_handle_heap *h, sp_handle *live,
                                                    const churn_stream *c) {
    for (int64_t i = 0; i < cfg.churn_pairs; i++) {
        uint32_t k = c->slot[i];
        sp_handle_free(h, live[k]);
        live[k] = sp_handle_alloc(h, c->size[i], 0);
        uint64_t *p = sp_handle_resolve(h, live[k]);
        if (!p) return false;
        *p = (uint64_t)i;
    }
    return true;
}

static __attribute__((noinline)) bool churn_tlsf(sp_tlsf *t, void **live, const churn_stream *c) {
    for (int64_t i = 0; i < cfg.churn_pairs; i++) {
        uint32_t k = c->slot[i];
        sp_tlsf_free(t, live[k]);
        uint64_t *p = live[k] = sp_tlsf_malloc(t, c->size[i]);
        if (!p) return false;
        *p = (uint64_t)i;
    }
    return true;
}

static void run_churn(bench_state *st, const void *arg) {
    bool spindle = arg != NULL;
    churn_stream c = {0};
    size_t region = (size_t)1 << 30;
    char *mem = spindle ? NULL : sp_vm_reserve(region, 0, false, NULL);
    sp_handle_heap *h = spindle ? sp_handle_heap_create(NULL, NULL) : NULL;
    sp_tlsf *t = NULL;
    if (!spindle && mem && sp_vm_commit(mem, region) == SP_OK)
        t = sp_tlsf_create(
            &(sp_tlsf_desc){.memory = mem, .size = region, .locked = true, .name = "churn"}, NULL);
    sp_handle *hl = calloc(cfg.churn_live, sizeof *hl);
    void **pl = calloc(cfg.churn_live, sizeof *pl);
    bool ok = stream_make(&c) && hl && pl && (spindle ? h != NULL : t != NULL);
    uint64_t s = 5;
    for (uint32_t i = 0; ok && i < cfg.churn_live; i++) {
        size_t size = rng_range(&s, 16, 4096);
        if (spindle)
            ok = (hl[i] = sp_handle_alloc(h, size, 0)).id != 0;
        else
            ok = (pl[i] = sp_tlsf_malloc(t, size)) != NULL;
    }
    if (ok) ok = spindle ? churn_spindle(h, hl, &c) : churn_tlsf(t, pl, &c); /* warm-up */
    uint64_t ns = 0, done = 0;
    while (bench_keep_running_batch(st, cfg.churn_pairs)) {
        uint64_t t0 = sp_time_ns();
        if (ok) ok = spindle ? churn_spindle(h, hl, &c) : churn_tlsf(t, pl, &c);
        ns += sp_time_ns() - t0;
        done += (uint64_t)cfg.churn_pairs;
    }
    if (!ok) fail(st, "churn failed");
    if (done) bench_counter(st, "ns_per_pair", (double)ns / (double)done, BENCH_COUNTER_DEFAULT);
    if (spindle) {
        sp_handle_heap_destroy(h);
    } else if (t) {
        for (uint32_t i = 0; i < cfg.churn_live; i++) sp_tlsf_free(t, pl[i]);
        if (sp_tlsf_destroy(t) != 0) fail(st, "tlsf leaked");
    }
    if (mem) sp_vm_release(mem, region);
    free(hl);
    free(pl);
    free(c.slot);
    free(c.size);
}

int main(int argc, char **argv) {
    const char *env = getenv("BENCH_SMOKE");
    cfg.smoke = bench_take_flag(&argc, argv, "--smoke") || (env && env[0] && env[0] != '0');
    if (cfg.smoke) {
        cfg.resolves = 1 << 12;
        cfg.compact_bytes = (size_t)1 << 20;
        cfg.budget_bytes = (size_t)1 << 20;
        cfg.budget_frames = 20;
        cfg.churn_pairs = 1 << 12;
        cfg.churn_live = 1000;
    }
    static const int spindle = 1;
    bench_register("handle/resolve/spindle", run_resolve, &spindle, 1);
    bench_register("handle/resolve/pointer", run_resolve, NULL, 1);
    bench_register("handle/compact/spindle", run_compact_spindle, NULL, 1);
    bench_register("handle/compact/memmove", run_compact_memmove, NULL, 1);
    bench_register("handle/budget/spindle", run_budget, NULL, 1);
    bench_register("handle/churn/spindle", run_churn, &spindle, 1);
    bench_register("handle/churn/tlsf", run_churn, NULL, 1);
    return bench_main(argc, argv);
}
