/* Fiber safety of the thread caches: a function running on a pooled fiber allocates on thread
 * A, is suspended, resumed on thread B in the middle of the same function, and allocates
 * again. Every allocation must come from the cache of the thread the fiber runs on at that
 * moment (the span's owner thread), never from a cache pointer kept across the switch; the
 * blocks allocated on A are then freed on B (remote frees). Repeated for several rounds and
 * size classes; runs under TSan and ASan. Also built as position-independent code in a shared
 * library (tcache_fiber_pic).
 *
 * What test 4 can catch where: sp_tcache_tls is an initial-exec thread-local, and gcc 12 on
 * x86-64 reloads %fs for every plain read of it, at -O0 and -O2, with and without -fPIC
 * (checked on the assembly), so a naive accessor (a plain read of sp_tcache_tls) passes test 4
 * here. What compilers do keep across a call is a thread-local's address: gcc 12 -O2 -fPIC
 * calls __tls_get_addr once for a global-dynamic thread-local and reuses the address after the
 * call, and folds &tls taken before and after a call into one; aarch64 clang 14 keeps the
 * address of an initial-exec thread-local too (recorded at SP_TLS_FRESH in sp_platform.h, not
 * checked here). Test 4 fails where sp_tcache_self() is compiled like that. Test 5 is its negative
 * control: an accessor that kept the TLS slot's address from before the switch, as such a compiler
 * would, must be caught by the same comparison on every round. */
#include <stdatomic.h>
#include <string.h>

#include "fiber.h"
#include "sp_tcache.h"
#include "test_support.h"

/* tests/meson.build also builds this file into a shared library with -Dmain=...: */
int main(void);

enum { ROUNDS = 50, SIZES = 6 };
static const size_t sizes[SIZES] = {16, 48, 200, 1000, 5000, 30000};

/* The calling thread's cache slot, read in a function of its own (no address from the caller's
 * frame can be reused): the control's reference value. */
__attribute__((noinline)) static sp_tcache *tls_now(void) {
    return sp_tcache_tls;
}

typedef struct ctx {
    sp_fiber *home; /* the thread fiber to switch back to (set by whoever resumes) */
    void *before[SIZES];
    uint64_t tid_before, tid_after;
    int wrong_before, wrong_after, same_thread, stale_cache, kept_stale;
    bool finished;
} ctx;

static void job(sp_fiber *self, void *arg) {
    ctx *x = arg;
    for (int round = 0; round < ROUNDS; round++) {
        /* The allocations before and after the switch sit in one function, so a compiler
         * could keep the thread-local address it computed first. */
        uint64_t a = sp_thread_os_id();
        for (int i = 0; i < SIZES; i++) {
            x->before[i] = sp_tcache_alloc(sizes[i]);
            x->wrong_before += sp_tcache_owner_thread(x->before[i]) != a;
        }
        x->tid_before = a;
#if SP_TCACHE_INLINE
        sp_tcache *cache_before = sp_tcache_self(); /* the accessor the inline paths use */
#endif
        /* The negative control's accessor: the address of this thread's slot, kept. */
        sp_tcache *kept_before = sp_tcache_tls;
        sp_tcache **kept_slot = &sp_tcache_tls;
        /* Opaque from here: clang would otherwise compute &sp_tcache_tls afresh after the call
         * (it knows what the pointer is), which is the fresh accessor, not a kept one. */
        __asm__ volatile("" : "+r"(kept_slot));
        sp_fiber_switch(self, x->home); /* resumed on the other thread */
        /* Through the kept address: the slot of the thread the fiber left, which still holds
         * that thread's cache - the same value as before (what test 4 counts as stale) and not
         * this thread's, so the comparison of test 4 tells a kept address from a fresh one. */
        x->kept_stale += *kept_slot == kept_before && *kept_slot != tls_now();
#if SP_TCACHE_INLINE
        /* Read again with nothing but the switch in between: a compiler that kept the TLS
         * address would hand back the other thread's cache here. */
        x->stale_cache += sp_tcache_self() == cache_before;
#endif
        uint64_t b = sp_thread_os_id();
        void *after[SIZES];
        for (int i = 0; i < SIZES; i++) {
            after[i] = sp_tcache_alloc(sizes[i]);
            x->wrong_after += sp_tcache_owner_thread(after[i]) != b;
        }
        x->tid_after = b;
        x->same_thread += a == b;
        for (int i = 0; i < SIZES; i++) {
            sp_tcache_free(after[i]);
            sp_tcache_free(x->before[i]); /* allocated on the other thread: a remote free */
        }
        sp_fiber_switch(self, x->home);
    }
    x->finished = true;
    for (;;) sp_fiber_switch(self, x->home);
}

typedef struct world {
    sp_fiber *fiber;
    ctx x;
    atomic_int turn; /* 0: thread A's turn to resume the fiber, 1: thread B's; 2: done */
} world;

static void *thread_run(void *arg) {
    world *w = arg;
    static atomic_int which;
    int me = atomic_fetch_add(&which, 1); /* 0 = A, 1 = B */
    sp_fiber *home = sp_fiber_thread_enter();
    for (;;) {
        int t = atomic_load(&w->turn);
        if (t == 2) break;
        if (t != me) {
            sp_thread_yield();
            continue;
        }
        w->x.home = home;
        sp_fiber_switch(home, w->fiber);
        atomic_store(&w->turn, w->x.finished ? 2 : 1 - me);
    }
    sp_fiber_thread_leave(home);
    return NULL;
}

int main(void) {
    plan(6);
    static world w;
    sp_fiber_pool *pool;
    /* One 128 KiB fiber: a failure is the library's, not a limit of this machine. */
    sp_result r = sp_fiber_pool_create(&pool, 1, 128 * 1024);
    if (r != SP_OK) {
        ok(0, "sp_fiber_pool_create of one 128 KiB fiber: %s", sp_result_name(r));
        return done();
    }
    w.fiber = sp_fiber_acquire(pool, job, &w.x);
    sp_thread a, b;
    sp_thread_start(&a, thread_run, &w, "sp-fiber-a");
    sp_thread_start(&b, thread_run, &w, "sp-fiber-b");
    sp_thread_join(a);
    sp_thread_join(b);
    ok(w.x.finished && w.x.same_thread == 0,
       "%d rounds, each resumed on the other thread mid-function (same thread %d times)", ROUNDS,
       w.x.same_thread);
    ok(w.x.wrong_before == 0,
       "before each switch, %d allocations came from the running thread's cache (wrong: %d)",
       ROUNDS * SIZES, w.x.wrong_before);
    ok(w.x.wrong_after == 0,
       "after each switch, %d allocations came from the new thread's cache (wrong: %d)",
       ROUNDS * SIZES, w.x.wrong_after);
    ok(w.x.stale_cache == 0,
       "the cache pointer read right after a switch is the new thread's (stale %d times%s)",
       w.x.stale_cache, SP_TCACHE_INLINE ? "" : "; no inline accessor in this build");
    ok(w.x.kept_stale == ROUNDS,
       "negative control: an accessor that kept the TLS slot's address across the switch reads "
       "the old thread's cache and is caught every round (%d of %d)",
       w.x.kept_stale, ROUNDS);
    sp_fiber_release(pool, w.fiber);
    sp_fiber_pool_destroy(pool);
    sp_tcache_trim();
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    ok(st.live_blocks == 0 && st.spans == 0 && st.caches == 0 && st.remote_pending == 0,
       "both threads exited, trim: nothing live, no spans, no caches (live %zu, spans %zu, "
       "caches %zu)",
       st.live_blocks, st.spans, st.caches);
    return done();
}
