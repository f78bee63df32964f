/* The `deque` benchmark area: sp_deque (WHO spindle) against a ring deque behind one sp_mutex
 * (WHO mutex), the simplest correct peer. Names: deque/CASE/WHO[/thieves:N].
 *
 *   owner       one thread, 8 items resident; push + pop pairs (pop takes the common path).
 *               Headline ns_per_op, one op = one push followed by one pop.
 *   owner_last  the same on an empty deque: every pop is the last-item race (spindle: CAS).
 *   steal       thread 0 (the owner) pushes ITEMS items, retrying while the deque is full;
 *               N thieves (1, 2, 4, 8) steal until the owner is done and the deque is empty.
 *               Headline ns_per_item: wall time from the start until every thief has
 *               finished, per item. The machine has 2 vCPUs: N >= 2 oversubscribes it.
 *
 * Own flags (removed before Google Benchmark parses argv): --smoke (or BENCH_SMOKE=1): tiny
 * workloads, every case once; the figures mean nothing.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "deque.h"
#include "sp_platform.h"

#define CAPACITY 1024
#define RESIDENT 8

static struct {
    int64_t pairs; /* owner cases: push + pop pairs per run */
    int64_t items; /* steal: items per run */
    bool smoke;
} cfg = {1 << 22, 1 << 20, false};

/* ---- the peer: a ring deque behind one mutex ------------------------------------------- */

typedef struct mutex_deque {
    sp_mutex lock;
    size_t top, bottom; /* items in [top, bottom), like sp_deque */
    void *slots[CAPACITY];
} mutex_deque;

static bool mutex_push(mutex_deque *q, void *x) {
    sp_mutex_lock(&q->lock);
    bool fits = q->bottom - q->top < CAPACITY;
    if (fits) q->slots[q->bottom++ % CAPACITY] = x;
    sp_mutex_unlock(&q->lock);
    return fits;
}

static void *mutex_pop(mutex_deque *q) {
    sp_mutex_lock(&q->lock);
    void *x = q->bottom != q->top ? q->slots[--q->bottom % CAPACITY] : NULL;
    sp_mutex_unlock(&q->lock);
    return x;
}

static void *mutex_steal(mutex_deque *q) {
    sp_mutex_lock(&q->lock);
    void *x = q->bottom != q->top ? q->slots[q->top++ % CAPACITY] : NULL;
    sp_mutex_unlock(&q->lock);
    return x;
}

/* ---- the deque under test: one branch on a constant, inlined away ---------------------- */

typedef struct queues {
    alignas(SP_DEQUE_LINE) unsigned char mem[sizeof(sp_deque) + CAPACITY * sizeof(void *)];
    sp_deque *d;
    alignas(SP_DEQUE_LINE) mutex_deque m;
} queues;

#define INLINE static inline __attribute__((always_inline))

INLINE bool who_push(bool spindle, queues *q, void *x) {
    return spindle ? sp_deque_push_local(q->d, x) : mutex_push(&q->m, x);
}
INLINE void *who_pop(bool spindle, queues *q) {
    return spindle ? sp_deque_pop_local(q->d) : mutex_pop(&q->m);
}
/* NULL when nothing was taken (spindle: empty or lost; both mean "look again"). */
INLINE void *who_steal(bool spindle, queues *q) {
    void *x = NULL;
    if (spindle) return sp_deque_steal_remote(q->d, &x) == SP_STEAL_ITEM ? x : NULL;
    return mutex_steal(&q->m);
}

static void queues_reset(queues *q) {
    q->d = sp_deque_init(q->mem, CAPACITY);
    q->m = (mutex_deque){0};
}

#define ITEM(i) ((void *)(uintptr_t)(((i)&0xffff) + 1))

/* Returns false if a pop did not give back what was just pushed. */
INLINE bool owner_pairs(bool spindle, queues *q, int64_t pairs) {
    bool good = true;
    for (int64_t i = 0; i < pairs; i++) {
        void *x = ITEM(i);
        good &= who_push(spindle, q, x);
        good &= who_pop(spindle, q) == x;
    }
    return good;
}
static __attribute__((noinline)) bool owner_pairs_spindle(queues *q, int64_t pairs) {
    return owner_pairs(true, q, pairs);
}
static __attribute__((noinline)) bool owner_pairs_mutex(queues *q, int64_t pairs) {
    return owner_pairs(false, q, pairs);
}

/* ---- cases ----------------------------------------------------------------------------- */

typedef struct bench_arg {
    bool spindle;
    int resident; /* owner cases */
    int thieves;  /* steal; 0 for the owner cases */
} bench_arg;

static queues q; /* one benchmark runs at a time; its threads share this */

static void run_owner(bench_state *st, const void *varg) {
    const bench_arg *a = varg;
    queues_reset(&q);
    bool good = true;
    for (int i = 0; i < a->resident; i++) good &= who_push(a->spindle, &q, ITEM(i));
    uint64_t ns = 0;
    int64_t done = 0;
    while (bench_keep_running_batch(st, cfg.pairs)) {
        uint64_t t0 = sp_time_ns();
        good &= a->spindle ? owner_pairs_spindle(&q, cfg.pairs) : owner_pairs_mutex(&q, cfg.pairs);
        ns += sp_time_ns() - t0;
        done += cfg.pairs;
    }
    for (int i = 0; i < a->resident; i++) good &= who_pop(a->spindle, &q) != NULL;
    good &= who_pop(a->spindle, &q) == NULL;
    if (!good) bench_skip_with_error(st, "a pop did not return the item just pushed");
    if (done) bench_counter(st, "ns_per_op", (double)ns / (double)done, BENCH_COUNTER_DEFAULT);
}

/* Shared by the threads of one steal benchmark. Google Benchmark starts and ends the timed
 * loop of all threads at a barrier, so thread 0 sets this up before any thief reads it. */
static struct {
    alignas(SP_DEQUE_LINE) atomic_int rounds_pushed; /* rounds whose items are all pushed */
    alignas(SP_DEQUE_LINE) atomic_int finished;      /* thieves done with their round */
    atomic_llong stolen;                             /* items the thieves took, all rounds */
} steal;

/* Steal until the owner has pushed this round's items and the deque is empty; returns the
 * number of items taken. */
static int64_t steal_thief(bool spindle, int round) {
    int64_t taken = 0;
    unsigned misses = 0;
    for (;;) {
        if (who_steal(spindle, &q)) {
            taken++;
            misses = 0;
            continue;
        }
        if (atomic_load_explicit(&steal.rounds_pushed, memory_order_acquire) > round) {
            /* the owner is done with this round: one more look, then finish */
            if (!who_steal(spindle, &q)) return taken;
            taken++;
            continue;
        }
        if (++misses % 16 == 0) sp_thread_yield(); /* no PAUSE: the hypervisor traps it */
    }
}

static void run_steal(bench_state *st, const void *varg) {
    const bench_arg *a = varg;
    int me = bench_thread_index(st), n = bench_threads(st);
    if (me == 0) {
        queues_reset(&q);
        atomic_store(&steal.rounds_pushed, 0);
        atomic_store(&steal.finished, 0);
        atomic_store(&steal.stolen, 0);
    }
    int round = 0;
    uint64_t ns = 0;
    while (bench_keep_running_batch(st, cfg.items)) {
        if (me == 0) {
            uint64_t t0 = sp_time_ns();
            for (int64_t i = 0; i < cfg.items; i++) {
                unsigned full = 0;
                while (!who_push(a->spindle, &q, ITEM(i)))
                    if (++full % 64 == 0) sp_thread_yield();
            }
            atomic_store_explicit(&steal.rounds_pushed, round + 1, memory_order_release);
            while (atomic_load_explicit(&steal.finished, memory_order_acquire) <
                   (n - 1) * (round + 1))
                sp_thread_yield();
            ns += sp_time_ns() - t0;
        } else {
            atomic_fetch_add_explicit(&steal.stolen, steal_thief(a->spindle, round),
                                      memory_order_relaxed);
            atomic_fetch_add_explicit(&steal.finished, 1, memory_order_release);
        }
        round++;
    }
    if (me == 0) {
        if (who_pop(a->spindle, &q) != NULL ||
            atomic_load(&steal.stolen) != (long long)round * cfg.items)
            bench_skip_with_error(st, "the thieves did not take every item exactly once");
        if (round)
            bench_counter(st, "ns_per_item", (double)ns / ((double)round * (double)cfg.items),
                          BENCH_COUNTER_DEFAULT);
    }
}

int main(int argc, char **argv) {
    const char *env = getenv("BENCH_SMOKE");
    cfg.smoke = bench_take_flag(&argc, argv, "--smoke") || (env && env[0] && env[0] != '0');
    if (cfg.smoke) {
        cfg.pairs = 1 << 12;
        cfg.items = 1 << 12;
    }
    static bench_arg args[6][2];
    static char names[6][2][64];
    const char *who[2] = {"spindle", "mutex"};
    /* WHO interleaved per case, so the figures compared sit close together in time. */
    for (int w = 0; w < 2; w++) {
        args[0][w] = (bench_arg){w == 0, RESIDENT, 0};
        args[1][w] = (bench_arg){w == 0, 0, 0};
        snprintf(names[0][w], sizeof names[0][w], "deque/owner/%s", who[w]);
        snprintf(names[1][w], sizeof names[1][w], "deque/owner_last/%s", who[w]);
    }
    for (int c = 0; c < 2; c++)
        for (int w = 0; w < 2; w++) bench_register(names[c][w], run_owner, &args[c][w], 1);
    const int thieves[4] = {1, 2, 4, 8};
    for (int c = 0; c < 4; c++)
        for (int w = 0; w < 2; w++) {
            args[2 + c][w] = (bench_arg){w == 0, 0, thieves[c]};
            snprintf(names[2 + c][w], sizeof names[2 + c][w], "deque/steal/%s/thieves:%d", who[w],
                     thieves[c]);
            bench_register(names[2 + c][w], run_steal, &args[2 + c][w], 1 + thieves[c]);
        }
    return bench_main(argc, argv);
}
