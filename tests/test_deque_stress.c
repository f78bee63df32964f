/* sp_deque under contention: one owner pushes and pops a known set of items while 1, 2, 4 and
 * 8 thieves steal; every item must be taken exactly once. The owner keeps the deque near
 * empty (half of its rounds push one item and pop it straight back: the last-item race with
 * the thieves) and now and then fills it to the brim (full pushes, laps around the ring).
 *
 * Two nets: a per-item atomic count (catches a lost or doubled item whenever it happens), and
 * plain (non-atomic) payload and taker fields, so ThreadSanitizer reports a race if a taker
 * is not ordered after the push or two takers get the same item, even in a run where the
 * counts come out right. */
#include <stdatomic.h>
#include <stdlib.h>

#include "deque.h"
#include "sp_platform.h"
#include "test_support.h"

enum { CAPACITY = 64, MAX_THIEVES = 8 };

typedef struct item {
    atomic_uint taken; /* times taken: 1 at the end */
    size_t payload;    /* plain: written by the owner before the push, read by the taker */
    int taker;         /* plain: written by the taker (0 owner, 1.. thieves) */
} item;

typedef struct shared {
    sp_deque *d;
    item *items;
    size_t n;
    atomic_int ready; /* thieves running: the owner starts when all are */
    atomic_bool done; /* the owner is finished and the deque is empty for good */
    atomic_size_t bad_payload;
} shared;

typedef struct thief {
    shared *s;
    int id;
    size_t stolen, lost;
} thief;

static void take(shared *s, item *it, int who) {
    if (it->payload != (size_t)(it - s->items)) atomic_fetch_add(&s->bad_payload, 1);
    it->taker = who;
    atomic_fetch_add_explicit(&it->taken, 1, memory_order_relaxed);
}

static void *thief_run(void *arg) {
    thief *t = arg;
    shared *s = t->s;
    unsigned misses = 0;
    atomic_fetch_add(&s->ready, 1);
    for (;;) {
        void *x;
        sp_steal r = sp_deque_steal_remote(s->d, &x);
        if (r == SP_STEAL_ITEM) {
            take(s, x, t->id);
            t->stolen++;
            misses = 0;
            continue;
        }
        if (r == SP_STEAL_LOST)
            t->lost++;
        else if (atomic_load_explicit(&s->done, memory_order_acquire))
            break; /* EMPTY after done: nothing will ever come */
        /* 2 vCPUs and up to 9 threads: let the owner run now and then (no PAUSE: the
         * hypervisor traps it). */
        if (++misses % 16 == 0) sp_thread_yield();
    }
    return NULL;
}

typedef struct owner_stats {
    size_t pushed, popped, full, last_lost; /* last_lost: pushed one, popped NULL right after */
    bool stalled; /* no push fitted for STALL_ROUNDS rounds: the deque is broken, gave up */
} owner_stats;

/* A sound deque with CAPACITY slots can't refuse pushes for this long: half the rounds pop. */
enum { STALL_ROUNDS = 1000000 };

static void owner_run(shared *s, uint64_t seed, owner_stats *o) {
    ts_rng rng;
    ts_rng_seed(&rng, seed);
    size_t next = 0, idle = 0;
    while (next < s->n) {
        if (++idle > STALL_ROUNDS) {
            o->stalled = true;
            break;
        }
        uint64_t kind = ts_rng_range(&rng, 0, 15);
        if (kind < 8) { /* the last-item race: one in, straight back out */
            s->items[next].payload = next;
            if (sp_deque_push_local(s->d, &s->items[next])) {
                o->pushed++;
                next++;
                idle = 0;
            }
            void *x = sp_deque_pop_local(s->d);
            if (x) {
                take(s, x, 0);
                o->popped++;
            } else {
                o->last_lost++;
            }
            continue;
        }
        /* a burst in, some back out; kind 15 overfills the ring */
        size_t k = kind == 15 ? CAPACITY + 8 : (size_t)ts_rng_range(&rng, 1, 8);
        for (size_t i = 0; i < k && next < s->n; i++) {
            s->items[next].payload = next;
            if (!sp_deque_push_local(s->d, &s->items[next])) {
                o->full++;
                break;
            }
            o->pushed++;
            next++;
            idle = 0;
        }
        for (uint64_t m = ts_rng_range(&rng, 0, k + 1); m > 0; m--) {
            void *x = sp_deque_pop_local(s->d);
            if (!x) break;
            take(s, x, 0);
            o->popped++;
        }
    }
    void *x;
    while ((x = sp_deque_pop_local(s->d)) != NULL) {
        take(s, x, 0);
        o->popped++;
    }
    atomic_store_explicit(&s->done, true, memory_order_release);
}

static void sweep(int nthieves, size_t n) {
    void *mem = aligned_alloc(SP_DEQUE_LINE, sp_deque_bytes(CAPACITY));
    item *items = calloc(n, sizeof *items);
    shared s = {.d = mem ? sp_deque_init(mem, CAPACITY) : NULL, .items = items, .n = n};
    atomic_init(&s.ready, 0);
    atomic_init(&s.done, false);
    atomic_init(&s.bad_payload, 0);
    for (size_t i = 0; i < n && items; i++) atomic_init(&items[i].taken, 0);

    thief th[MAX_THIEVES];
    sp_thread t[MAX_THIEVES];
    int started = 0;
    owner_stats o = {0};
    if (s.d && items) {
        for (int i = 0; i < nthieves; i++) {
            th[i] = (thief){&s, i + 1, 0, 0};
            if (sp_thread_start(&t[started], thief_run, &th[i], "sp-thief") == SP_OK) started++;
        }
        while (atomic_load(&s.ready) < started) sp_thread_yield();
        owner_run(&s, 0x5eed0000u + (uint64_t)nthieves, &o);
        for (int i = 0; i < started; i++) sp_thread_join(t[i]);
    }

    size_t once = 0, twice = 0, never = 0, stolen = 0, lost = 0;
    for (size_t i = 0; i < n && items; i++) {
        unsigned c = atomic_load(&items[i].taken);
        once += c == 1;
        twice += c > 1;
        never += c == 0;
    }
    for (int i = 0; i < started; i++) {
        stolen += th[i].stolen;
        lost += th[i].lost;
    }
    ok(started == nthieves && items && !o.stalled && once == n && o.popped + stolen == n &&
           atomic_load(&s.bad_payload) == 0,
       "%d thieves, %zu items: each taken once (never %zu, twice+ %zu, bad payload %zu%s)",
       nthieves, n, never, twice, (size_t)atomic_load(&s.bad_payload),
       o.stalled ? ", owner stalled" : "");
    diag("  owner popped %zu, thieves stole %zu (lost %zu races), full pushes %zu, "
         "owner lost the last item %zu times",
         o.popped, stolen, lost, o.full, o.last_lost);
    free(items);
    free(mem);
}

int main(void) {
    plan(4);
    size_t n = ts_scaled(1000000, 4);
    if (ts_sanitized()) diag("sanitized build: %zu items per sweep", n);
    const int thieves[] = {1, 2, 4, 8};
    for (int i = 0; i < 4; i++) sweep(thieves[i], n);
    return done();
}
