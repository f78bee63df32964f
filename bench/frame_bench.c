/* The `frame` benchmark area: frame arenas (sp_frame.h) against the thread caches and the
 * process malloc (glibc here; bench_frame_mimalloc links mimalloc as the process malloc).
 * Names: frame/CASE/WHO/PARAM.
 *
 *   alloc     frame-style allocation from jobs: per frame, each worker thread runs one job
 *             (pinned to it) that makes N allocations of 16..256 bytes (a seeded table, the
 *             same every frame; N = 1,024 and 4,096, the PARAM allocs:N) and stores each
 *             pointer in its frame's slot array, writing one word into the block. WHO:
 *               arena     sp_frame_alloc; nothing is freed; after each frame the main thread
 *                         calls sp_frame_arena_advance (which reclaims the buffer of two
 *                         frames ago): its time is charged in full to every thread
 *               tcache    sp_tcache_alloc; the job first frees, with sp_tcache_free, the
 *                         blocks it allocated two frames ago (what the arena reclaims then)
 *               glibc / mimalloc   malloc, and free of the blocks of two frames ago likewise
 *               bump      no allocator: a pointer bumped over memory of the thread's own (one
 *                         buffer per live frame, [frame % 2], rounded to 16 as the arena),
 *                         nothing shared, nothing freed. The floor under the arena: its
 *                         2 / 1 throughput is what the machine gives this access pattern
 *                         (the blocks' first words, the slot array, the size table)
 *             Headline ns_per_alloc: per worker thread (averaged over threads), that thread's
 *             time inside its jobs (frees included) plus the advances, over its allocations.
 *             wall_ns_per_alloc: wall time from the first job's start to the last job's end
 *             per frame, over all threads' allocations (1 / throughput). advance_ns,
 *             main_job_ns, worker_job_ns (workers:2): per frame, the advance, the main
 *             thread's job, the worker's job: what the headline is made of. workers:1 = the
 *             scheduler with no worker threads (jobs run on the main thread in its waits);
 *             workers:2 = the main thread plus one worker thread, pinned to its CPU
 *             (pin_workers: one worker per CPU, as engines run them; the main thread is
 *             not pinned; workers_pinned in the JSON says whether the pin took), one job
 *             pinned to each worker; the two jobs meet at a spin barrier before their timed
 *             part so that wake-up latency is not timed. 2^20 allocations per thread per
 *             sample (1,024 or 256 frames) after 16 untimed warm-up frames. A frame's blocks
 *             take about 140 KB (N = 1,024) or 560 KB (4,096) per thread, so the two live
 *             frames stay in a 2 MiB L2 cache (the Intel machine's; on the AMD machine's 1 MiB
 *             L2, 4,096's do not: bench/README.md, `frame`). Each frame costs a few
 *             cross-core cache-line transfers whatever the allocator (the frame flip, the
 *             harness's own frame number): a fixed cost that N = 4,096 spreads over four
 *             times the allocations.
 *   reset     arena only: fill the current buffer with N allocations of 16..256 bytes from
 *             the main thread, advance once (reclaims the other, empty buffer), then time the
 *             advance that reclaims the full one (ordered clock reads around the one call:
 *             the fill's stores have drained when the clock starts; ticks_ordered). N =
 *             1,000, 100,000, 1,000,000. Headline ns: mean per reclaim (the clock reads'
 *             ordering included, the same at every N).
 *
 * Own flags: --smoke (or BENCH_SMOKE=1): tiny workloads, every case once.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "sp_frame.h"
#include "sp_jobs.h"
#include "sp_platform.h"
#include "sp_tcache.h"

#include "peer.h"
#if defined(BENCH_PEER_MIMALLOC)
#include <mimalloc.h>
#else
#include <malloc.h>
#endif

enum { MAX_WORKERS = 2 };

static struct {
    int64_t sample_allocs; /* per thread per sample: frames = sample_allocs / allocs per frame */
    int64_t warm_frames;
    int64_t resets_small, resets_large; /* reclaims timed per sample (N <= 100,000 / above) */
    int64_t tidies;                     /* give-back calls timed per sample */
    bool smoke;
} cfg = {1 << 20, 16, 2000, 20, 200, false};

typedef enum who { ARENA, TCACHE, PROCESS, BUMP } who;

typedef struct bench_arg {
    who w;
    uint32_t workers; /* alloc */
    uint32_t n;       /* allocations per thread per frame (alloc), per buffer (reset) */
} bench_arg;

/* ---- alloc ------------------------------------------------------------------------------ */

/* One per worker thread, each on cache lines of its own (128 bytes: the adjacent-line
 * prefetcher pairs lines), so that a thread's per-frame writes (t0, t1, ns) never take a line
 * the other thread's loop is reading. */
typedef struct worker_ctx {
    _Alignas(128) who w;
    sp_frame_arena *arena;
    const uint32_t *sizes;
    uint32_t n;
    void **slots[2]; /* the blocks of the last two frames: [frame % 2] */
    char *own;       /* bump: its two buffers, BUMP_BYTES each, frame % 2 the one in use */
    atomic_int *arrived;
    uint32_t threads;
    uint64_t frame;      /* frames this thread ran (the same on every thread) */
    uint64_t ns, t0, t1; /* time in jobs so far; this frame's start and end */
} worker_ctx;

/* A frame's blocks at most: 4,096 of at most 256 bytes. bump_alloc's check of the end never
 * fails here; it stands for the compare every bump allocator makes, the arena's included. */
#define BUMP_BYTES ((size_t)1 << 20)
_Static_assert(4096 * 256 <= BUMP_BYTES, "a frame's blocks fit a bump buffer");

static inline __attribute__((always_inline)) void *bump_alloc(char **cur, const char *end,
                                                              size_t size) {
    size = (size + 15) & ~(size_t)15;
    if (__builtin_expect(size > (size_t)(end - *cur), 0)) return NULL;
    void *p = *cur;
    *cur += size;
    return p;
}

static inline __attribute__((always_inline)) void frame_work(who w, worker_ctx *x) {
    /* Locals, not x->: the allocators' fresh thread-local reads clobber memory, so fields read
     * through x would be loaded again on every allocation. */
    void **slot = x->slots[x->frame % 2];
    const uint32_t *sizes = x->sizes;
    const uint32_t n = x->n;
    sp_frame_arena *arena = x->arena;
    char *cur = w == BUMP ? x->own + (x->frame % 2) * BUMP_BYTES : NULL;
    const char *end = w == BUMP ? cur + BUMP_BYTES : NULL;
    if (w == TCACHE)
        for (uint32_t i = 0; i < n; i++) sp_tcache_free(slot[i]);
    else if (w == PROCESS)
        for (uint32_t i = 0; i < n; i++) free(slot[i]);
    for (uint32_t i = 0; i < n; i++) {
        void *p = w == ARENA    ? sp_frame_alloc(arena, sizes[i])
                  : w == BUMP   ? bump_alloc(&cur, end, sizes[i])
                  : w == TCACHE ? sp_tcache_alloc(sizes[i])
                                : malloc(sizes[i]);
        *(uint32_t *)p = i;
        slot[i] = p;
    }
    bench_escape(slot);
}

static __attribute__((noinline)) void work_arena(worker_ctx *x) {
    frame_work(ARENA, x);
}
static __attribute__((noinline)) void work_tcache(worker_ctx *x) {
    frame_work(TCACHE, x);
}
static __attribute__((noinline)) void work_process(worker_ctx *x) {
    frame_work(PROCESS, x);
}
static __attribute__((noinline)) void work_bump(worker_ctx *x) {
    frame_work(BUMP, x);
}

static void alloc_job(void *arg) {
    worker_ctx *x = arg;
    /* Both jobs run at once on their own threads (pinned): meet before the timed part. */
    atomic_fetch_add(x->arrived, 1);
    while ((uint32_t)atomic_load_explicit(x->arrived, memory_order_acquire) < x->threads) {
    }
    x->t0 = sp_time_ns();
    static void (*const work[])(worker_ctx *) = {
        [ARENA] = work_arena, [TCACHE] = work_tcache, [PROCESS] = work_process, [BUMP] = work_bump};
    work[x->w](x);
    x->t1 = sp_time_ns();
    x->ns += x->t1 - x->t0;
    x->frame++; /* counted here, not set by the main thread: nothing it writes is read while
                   timed */
}

/* One frame: the jobs, then (arena) the advance. *wall: first job start to last job end;
 * *adv: the advance's time. False if the submit or the wait failed. */
static bool frame_run(sp_jobs *s, sp_counter *c, worker_ctx *x, sp_job_desc *jobs, uint32_t W,
                      sp_frame_arena *arena, uint64_t *wall, uint64_t *adv) {
    atomic_store(x[0].arrived, 0);
    bool good = sp_jobs_submit(s, jobs, W, c) == SP_OK && sp_counter_wait(c, 0) == SP_OK;
    uint64_t lo = x[0].t0, hi = x[0].t1;
    for (uint32_t t = 1; t < W; t++) {
        lo = x[t].t0 < lo ? x[t].t0 : lo;
        hi = x[t].t1 > hi ? x[t].t1 : hi;
    }
    *wall = hi - lo;
    *adv = 0;
    if (arena) {
        uint64_t a0 = sp_time_ns();
        sp_frame_arena_advance(arena, NULL);
        *adv = sp_time_ns() - a0;
    }
    return good;
}

static void run_alloc(bench_state *st, const void *varg) {
    const bench_arg *a = varg;
    uint32_t W = a->workers, n = a->n;
    int64_t frames = cfg.sample_allocs / n > 1 ? cfg.sample_allocs / n : 1;
    sp_jobs *s = NULL;
    sp_jobs_desc jd = W == 1 ? (sp_jobs_desc){.no_workers = true}
                             : (sp_jobs_desc){.workers = W - 1, .pin_workers = true};
    if (sp_jobs_create(&s, &jd) != SP_OK) {
        bench_skip_with_error(st, "sp_jobs_create failed");
        return;
    }
    sp_jobs_status js;
    sp_jobs_status_get(s, &js);
    sp_frame_arena *arena = NULL;
    region mem, own_mem = {0};
    uint32_t *sizes = region_get(&mem, (size_t)W * n * (sizeof(uint32_t) + 2 * sizeof(void *)));
    char *own = a->w == BUMP ? region_get(&own_mem, (size_t)W * 2 * BUMP_BYTES) : NULL;
    const char *why = NULL;
    if (!sizes || (a->w == BUMP && !own)) {
        why = "harness memory";
    } else if (a->w == ARENA) {
        arena = sp_frame_arena_create(NULL, NULL);
        if (!arena) why = "sp_frame_arena_create failed";
    }
    if (why) {
        region_put(&own_mem);
        region_put(&mem);
        sp_jobs_destroy(s);
        bench_skip_with_error(st, why);
        return;
    }
    void **slots = (void **)(void *)(sizes + (size_t)W * n + ((size_t)W * n & 1));
    atomic_int arrived;
    worker_ctx x[MAX_WORKERS];
    sp_job_desc jobs[MAX_WORKERS];
    uint64_t seed = 0xf4a3e;
    for (uint32_t t = 0; t < W; t++) {
        for (uint32_t i = 0; i < n; i++)
            sizes[(size_t)t * n + i] = 16 + (uint32_t)(rng_next(&seed) % 241);
        x[t] = (worker_ctx){.w = a->w,
                            .arena = arena,
                            .sizes = sizes + (size_t)t * n,
                            .n = n,
                            .slots = {slots + (size_t)t * 2 * n, slots + (size_t)t * 2 * n + n},
                            .arrived = &arrived,
                            .threads = W};
        if (own) x[t].own = own + (size_t)t * 2 * BUMP_BYTES;
        jobs[t] = (sp_job_desc){
            .fn = alloc_job, .arg = &x[t], .name = "alloc", .pinned = true, .worker = t};
    }
    sp_counter *c = sp_counter_create(s, "frame");
    uint64_t advance_ns = 0, wall_ns = 0, wall, adv;
    bool good = c != NULL;
    for (int64_t f = 0; good && f < cfg.warm_frames; f++)
        good &= frame_run(s, c, x, jobs, W, arena, &wall, &adv);
    for (uint32_t t = 0; t < W; t++) x[t].ns = 0;
    int64_t timed_frames = 0;
    while (bench_keep_running_batch(st, frames)) {
        for (int64_t f = 0; good && f < frames; f++) {
            good &= frame_run(s, c, x, jobs, W, arena, &wall, &adv);
            wall_ns += wall;
            advance_ns += adv;
        }
        timed_frames += frames;
    }
    double allocs = (double)timed_frames * n, per = 0;
    for (uint32_t t = 0; t < W; t++) per += (double)(x[t].ns + advance_ns) / allocs;
    if (good && timed_frames) {
        bench_counter(st, "ns_per_alloc", per / W, BENCH_COUNTER_AVG_THREADS);
        bench_counter(st, "wall_ns_per_alloc", (double)wall_ns / (allocs * W), 0);
        bench_counter(st, "advance_ns", (double)advance_ns / (double)timed_frames, 0);
        bench_counter(st, "main_job_ns", (double)x[0].ns / (double)timed_frames, 0);
        if (W > 1) {
            bench_counter(st, "worker_job_ns", (double)x[1].ns / (double)timed_frames, 0);
            bench_counter(st, "workers_pinned", js.workers_pinned, 0);
        }
    } else {
        bench_skip_with_error(st, "a submit or wait failed");
    }
    if (a->w == TCACHE || a->w == PROCESS) /* from the main thread: remote frees, untimed */
        for (size_t i = 0; i < (size_t)W * 2 * n; i++)
            a->w == TCACHE ? sp_tcache_free(slots[i]) : free(slots[i]);
    sp_counter_destroy(c);
    sp_jobs_destroy(s);
    sp_frame_arena_destroy(arena);
    region_put(&own_mem);
    region_put(&mem);
}

/* ---- reset ------------------------------------------------------------------------------ */

/* sp_ticks, read only once every earlier instruction has completed (lfence: x86-64's rdtsc may
 * run ahead of them; aarch64's sp_ticks orders itself with an isb) and, with drain, once their
 * stores have drained too (mfence first; dmb on aarch64). The reset is timed from a drained
 * start to an end that waits for the advance's instructions, not for an mfence: on the AMD
 * EPYC machine an mfence after a store stayed slow for milliseconds after a dense fill, an
 * empty timed region included, a cost of the machine, not of the reclaim (bench/README.md,
 * "The reset at 1,000,000 allocations on the AMD machine"). */
static inline uint64_t ticks_ordered(bool drain) {
#if defined(__x86_64__)
    if (drain) __asm__ volatile("mfence" : : : "memory");
    __asm__ volatile("lfence" : : : "memory");
#elif defined(__aarch64__)
    if (drain) __asm__ volatile("dmb ish" : : : "memory");
#endif
    return sp_ticks();
}

static void run_reset(bench_state *st, const void *varg) {
    const bench_arg *a = varg;
    /* Two buffers of 256 MiB: 1,000,000 blocks of at most 256 B fit with room to spare. */
    sp_frame_arena *arena =
        sp_frame_arena_create(&(sp_frame_desc){.region_size = (size_t)512 << 20}, NULL);
    if (!arena) {
        bench_skip_with_error(st, "sp_frame_arena_create failed");
        return;
    }
    int64_t resets = a->n <= 100000 ? cfg.resets_small : cfg.resets_large;
    uint64_t seed = 0x7e5e7, ticks = 0, bad = 0;
    int64_t done = 0;
    while (bench_keep_running_batch(st, resets)) {
        for (int64_t r = 0; r < resets; r++) {
            for (uint32_t i = 0; i < a->n; i++) {
                uint32_t *p = sp_frame_alloc(arena, 16 + (size_t)(rng_next(&seed) % 241));
                if (!p) {
                    bad++;
                    break;
                }
                *p = i;
            }
            sp_frame_arena_advance(arena, NULL); /* reclaims the other (empty) buffer */
            /* The fill's last stores (to lines not in any cache once N is large) drain before
             * the clock starts (ticks_ordered): else the advance's first atomic waits for
             * them, and the fill's cost is timed as the reclaim's. A fence before a bare
             * rdtsc is not enough: rdtsc is not ordered by it (both vendors' manuals; on the AMD
             * machine such reads timed part of the drain: bench/README.md). In a frame loop the
             * wait for the frame's jobs drains them. */
            uint64_t t0 = ticks_ordered(true);
            sp_frame_arena_advance(arena, NULL); /* reclaims the one just filled */
            ticks += ticks_ordered(false) - t0;
            done++;
        }
    }
    if (bad) bench_skip_with_error(st, "reset: the buffer ran out");
    if (done) bench_counter(st, "ns", sp_ticks_to_ns(ticks) / (double)done, 0);
    sp_frame_arena_destroy(arena);
}

/* ---- tidy ------------------------------------------------------------------------------- */

/* The allocator's call that hands back what it holds free, as a frame loop would make it every
 * frame: sp_tcache_tidy (bounded: the current spans and at most TCACHE_TIDY_SPANS others),
 * glibc's malloc_trim(0), mimalloc's mi_collect(false) - the peers' calls walk all they hold. */
static void give_back(who w) {
    if (w == TCACHE) {
        sp_tcache_tidy();
    } else {
#if defined(BENCH_PEER_MIMALLOC)
        mi_collect(false);
#else
        malloc_trim(0);
#endif
    }
}

static void run_tidy(bench_state *st, const void *varg) {
    const bench_arg *a = varg;
    region mem;
    void **blocks = region_get(&mem, (size_t)a->n * sizeof(void *));
    if (!blocks) {
        bench_skip_with_error(st, "harness memory");
        return;
    }
    uint64_t seed = 0x71d7;
    bool good = true;
    for (uint32_t i = 0; i < a->n; i++) {
        size_t size = 16 + (size_t)(rng_next(&seed) % 1009);
        blocks[i] = a->w == TCACHE ? sp_tcache_alloc(size) : malloc(size);
        good &= blocks[i] != NULL;
    }
    give_back(a->w); /* the first call may have something to hand back: untimed */
    uint64_t ticks = 0;
    int64_t calls = 0;
    while (good && bench_keep_running_batch(st, cfg.tidies)) {
        uint64_t t0 = sp_ticks();
        for (int64_t c = 0; c < cfg.tidies; c++) give_back(a->w);
        ticks += sp_ticks() - t0;
        calls += cfg.tidies;
    }
    for (uint32_t i = 0; i < a->n; i++)
        a->w == TCACHE ? sp_tcache_free(blocks[i]) : free(blocks[i]);
    region_put(&mem);
    if (!good) bench_skip_with_error(st, "tidy: an allocation failed");
    if (calls) bench_counter(st, "ns", sp_ticks_to_ns(ticks) / (double)calls, 0);
}

/* ---- registration ------------------------------------------------------------------------- */

static bool process_malloc_verify(void) {
    const char *lib = peer_malloc_lib("bench_frame");
    if (lib) fprintf(stderr, "# bench_frame: process malloc is %s (%s)\n", PEER_NAME, lib);
    return lib != NULL;
}

int main(int argc, char **argv) {
    const char *env = getenv("BENCH_SMOKE");
    cfg.smoke = bench_take_flag(&argc, argv, "--smoke") || (env && env[0] && env[0] != '0');
    if (cfg.smoke) {
        cfg.sample_allocs = 0; /* one frame */
        cfg.warm_frames = 1;
        cfg.resets_small = 2;
        cfg.resets_large = 1;
        cfg.tidies = 2;
    }
    if (!process_malloc_verify()) return 1;
    static const uint32_t frame_n[2] = {1024, 4096};
    static bench_arg args[2][4][MAX_WORKERS], resets[3], tidies[2][2];
    static char names[2][4][MAX_WORKERS][64], reset_names[3][64], tidy_names[2][2][64];
#if defined(BENCH_PEER_GLIBC)
    int first = ARENA, last = BUMP;
#else
    int first = PROCESS, last = PROCESS; /* peer binaries: the peer only */
#endif
    static const char *who_name[] = {"arena", "tcache", PEER_NAME, "bump"};
    for (int f = 0; f < 2; f++)
        for (uint32_t w = 1; w <= MAX_WORKERS; w++)
            for (int k = first; k <= last; k++) {
                bench_arg *arg = &args[f][k][w - 1];
                *arg = (bench_arg){
                    .w = (who)k, .workers = w, .n = cfg.smoke ? frame_n[f] / 4 : frame_n[f]};
                snprintf(names[f][k][w - 1], sizeof names[f][k][w - 1],
                         "frame/alloc/%s/workers:%u/allocs:%u", who_name[k], w, frame_n[f]);
                bench_register(names[f][k][w - 1], run_alloc, arg, 1);
            }
    static const uint32_t tidy_n[2] = {1000, 1000000};
    for (int i = 0; i < 2; i++)
        for (int k = first == ARENA ? TCACHE : PROCESS; k <= PROCESS; k++) {
            bench_arg *arg = &tidies[i][k - TCACHE];
            *arg = (bench_arg){.w = (who)k, .n = cfg.smoke ? tidy_n[0] : tidy_n[i]};
            snprintf(tidy_names[i][k - TCACHE], sizeof tidy_names[i][k - TCACHE],
                     "frame/tidy/%s/live:%u", who_name[k], tidy_n[i]);
            bench_register(tidy_names[i][k - TCACHE], run_tidy, arg, 1);
        }
#if defined(BENCH_PEER_GLIBC)
    static const uint32_t reset_n[3] = {1000, 100000, 1000000};
    for (int i = 0; i < 3; i++) {
        resets[i] = (bench_arg){.w = ARENA, .n = reset_n[i]};
        snprintf(reset_names[i], sizeof reset_names[i], "frame/reset/arena/allocs:%u", reset_n[i]);
        bench_register(reset_names[i], run_reset, &resets[i], 1);
    }
#else
    (void)resets;
    (void)reset_names;
    (void)run_reset;
#endif
    return bench_main(argc, argv);
}
