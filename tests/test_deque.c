/* sp_deque on one thread: LIFO for the owner, FIFO for thieves, full and empty behaviour,
 * indices wrapping around the ring and around SIZE_MAX, and a seeded random mix of
 * push/pop/steal checked against a model. Init and push misuse are reported. */
#include <stdlib.h>
#include <string.h>

#include "deque.h"
#include "test_support.h"

/* Items are small non-NULL integers cast to pointers. */
#define ITEM(i) ((void *)(uintptr_t)((i) + 1))
#define INDEX(p) ((long long)(uintptr_t)(p)-1)

static sp_deque *deque_new(size_t capacity) {
    size_t bytes = sp_deque_bytes(capacity);
    void *mem =
        aligned_alloc(SP_DEQUE_LINE, (bytes + SP_DEQUE_LINE - 1) / SP_DEQUE_LINE * SP_DEQUE_LINE);
    return mem ? sp_deque_init(mem, capacity) : NULL;
}

/* Start both indices at `start` (test only: lets the wrap of size_t be reached quickly). */
static void deque_rebase(sp_deque *d, size_t start) {
    atomic_store(&d->top, start);
    atomic_store(&d->bottom, start);
}

static void *steal1(sp_deque *d, sp_steal *r) {
    void *x = (void *)1;
    *r = sp_deque_steal_remote(d, &x);
    return x;
}

static void test_layout(void) {
    ok(offsetof(sp_deque, top) - offsetof(sp_deque, bottom) >= SP_DEQUE_LINE &&
           offsetof(sp_deque, slots) - offsetof(sp_deque, top) >= SP_DEQUE_LINE,
       "bottom, top and the ring sit on separate cache lines");
}

static void test_lifo_fifo(void) {
    sp_deque *d = deque_new(16);
    bool pushed = true;
    for (int i = 0; i < 10; i++) pushed &= sp_deque_push_local(d, ITEM(i));
    bool lifo = pushed;
    for (int i = 9; i >= 0; i--) lifo &= sp_deque_pop_local(d) == ITEM(i);
    ok(lifo && sp_deque_pop_local(d) == NULL, "owner pops in LIFO order, then NULL");

    for (int i = 0; i < 10; i++) sp_deque_push_local(d, ITEM(i));
    bool fifo = true;
    sp_steal r;
    for (int i = 0; i < 10; i++) fifo &= steal1(d, &r) == ITEM(i) && r == SP_STEAL_ITEM;
    void *x = steal1(d, &r);
    ok(fifo && r == SP_STEAL_EMPTY && x == NULL, "thieves steal in FIFO order, then EMPTY");

    /* Both ends at once: 0..5 in, steal takes 0, pop takes 5, steal 1, pop 4, ... */
    for (int i = 0; i < 6; i++) sp_deque_push_local(d, ITEM(i));
    bool ends = true;
    for (int i = 0; i < 3; i++) {
        ends &= steal1(d, &r) == ITEM(i);
        ends &= sp_deque_pop_local(d) == ITEM(5 - i);
    }
    ok(ends && sp_deque_pop_local(d) == NULL && steal1(d, &r) == NULL && r == SP_STEAL_EMPTY,
       "steal takes the oldest, pop the newest, until both see empty");
    free(d);
}

static void test_full_empty(void) {
    sp_deque *d = deque_new(8);
    is_int(sp_deque_capacity(d), 8, "capacity as given");
    bool all = true;
    for (int i = 0; i < 8; i++) all &= sp_deque_push_local(d, ITEM(i));
    ok(all && !sp_deque_push_local(d, ITEM(8)), "8 pushes fit, the 9th fails: full");
    sp_steal r;
    ok(steal1(d, &r) == ITEM(0) && sp_deque_push_local(d, ITEM(8)) &&
           !sp_deque_push_local(d, ITEM(9)),
       "a steal frees one slot, one push fits again");
    bool order = true;
    for (int i = 8; i >= 1; i--) order &= sp_deque_pop_local(d) == ITEM(i);
    ok(order && sp_deque_pop_local(d) == NULL, "the failed pushes left the contents intact");

    bool empty = true;
    for (int i = 0; i < 100; i++) {
        empty &= sp_deque_pop_local(d) == NULL;
        empty &= steal1(d, &r) == NULL && r == SP_STEAL_EMPTY;
    }
    ok(empty && sp_deque_push_local(d, ITEM(42)) && steal1(d, &r) == ITEM(42) &&
           sp_deque_push_local(d, ITEM(43)) && sp_deque_pop_local(d) == ITEM(43),
       "repeated pops and steals on empty change nothing");
    free(d);

    d = deque_new(1);
    ok(d && sp_deque_push_local(d, ITEM(0)) && !sp_deque_push_local(d, ITEM(1)) &&
           sp_deque_pop_local(d) == ITEM(0) && sp_deque_pop_local(d) == NULL,
       "capacity 1 works");
    free(d);
}

/* Many laps around a small ring, the indices starting just below SIZE_MAX so they wrap. */
static void test_wrap(void) {
    const size_t starts[] = {0, SIZE_MAX - 100};
    for (size_t s = 0; s < 2; s++) {
        sp_deque *d = deque_new(4);
        deque_rebase(d, starts[s]);
        bool good = true;
        long long next = 0, want_steal = 0;
        sp_steal r;
        for (int lap = 0; lap < 10000 && good; lap++) {
            /* push 3, steal 1, pop 1, steal 1: empty again; 3 slots used per lap */
            long long a = next;
            for (int i = 0; i < 3; i++) good &= sp_deque_push_local(d, ITEM(next++));
            want_steal = a;
            good &= steal1(d, &r) == ITEM(want_steal) && r == SP_STEAL_ITEM;
            good &= sp_deque_pop_local(d) == ITEM(a + 2);
            good &= steal1(d, &r) == ITEM(a + 1);
            good &= sp_deque_pop_local(d) == NULL && steal1(d, &r) == NULL;
        }
        ok(good, "10000 laps on a ring of 4, indices from %zu%s", starts[s],
           s ? " (past SIZE_MAX)" : "");
        free(d);
    }
}

/* Random push/pop/steal on one thread against a model array. */
static void test_model(void) {
    enum { CAP = 16, OPS = 200000 };
    sp_deque *d = deque_new(CAP);
    deque_rebase(d, SIZE_MAX - 5000);
    ts_rng rng;
    ts_rng_seed(&rng, 0xdec0de);
    long long model[CAP]; /* model[0] oldest */
    int n = 0;
    long long next = 0;
    int bad = -1;
    for (int op = 0; op < OPS && bad < 0; op++) {
        uint64_t k = ts_rng_range(&rng, 0, 9);
        if (k < 4) { /* push, a little more often than the others: the ring fills up */
            bool pushed = sp_deque_push_local(d, ITEM(next));
            if (pushed != (n < CAP)) bad = op;
            if (pushed) model[n++] = next++;
        } else if (k < 7) {
            void *x = sp_deque_pop_local(d);
            if (n == 0 ? x != NULL : INDEX(x) != model[--n]) bad = op;
        } else {
            sp_steal r;
            void *x = steal1(d, &r);
            if (n == 0) {
                if (r != SP_STEAL_EMPTY || x) bad = op;
            } else {
                if (r != SP_STEAL_ITEM || INDEX(x) != model[0]) bad = op;
                memmove(model, model + 1, (size_t)--n * sizeof model[0]);
            }
        }
    }
    ok(bad < 0, "%d random push/pop/steal agree with the model (first mismatch: op %d)", OPS, bad);
    free(d);
}

static void test_misuse(void) {
    ts_log_capture();
    void *mem = aligned_alloc(SP_DEQUE_LINE, sp_deque_bytes(8) + SP_DEQUE_LINE);
    ok(sp_deque_bytes(0) == 0 && sp_deque_bytes(12) == 0 && sp_deque_bytes(SIZE_MAX / 2 + 1) == 0,
       "sp_deque_bytes refuses 0, non-powers of two and huge capacities");
    ok(sp_deque_init(mem, 12) == NULL && ts_logged.last_id == SP_ERR_INVALID_ARG &&
           strcmp(ts_logged.last_call, "sp_deque_init") == 0,
       "init with capacity 12 is reported");
    ok(sp_deque_init((char *)mem + 8, 8) == NULL && ts_logged.last_id == SP_ERR_BAD_ALIGNMENT,
       "init with misaligned memory is reported");
    sp_deque *d = sp_deque_init(mem, 8);
    ts_log_reset();
    ok(d && !sp_deque_push_local(d, NULL) && ts_logged.count == 1 &&
           ts_logged.last_id == SP_ERR_INVALID_ARG && sp_deque_pop_local(d) == NULL,
       "pushing NULL is reported and leaves the deque empty");
    ts_log_release();
    free(mem);
}

int main(void) {
    plan(17);
    test_layout();     /* 1 */
    test_lifo_fifo();  /* 3 */
    test_full_empty(); /* 6 */
    test_wrap();       /* 2 */
    test_model();      /* 1 */
    test_misuse();     /* 4 */
    return done();
}
