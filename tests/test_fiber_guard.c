/* Death tests for fibers, each in a forked child: overflowing a fiber stack (of a fixed pool,
 * or one a growing pool made later) faults on the guard page below it (SIGSEGV with the fault
 * address inside that guard, so the neighbouring stack was never written), and a fiber function
 * that returns dies through sp_die. */
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "fiber.h"
#include "sp_platform.h"
#include "test_support.h"

static sp_fiber *main_fiber;
static char *guard_lo, *guard_hi;

/* Runs on the alternate signal stack. If the fault lies in the overflowing fiber's guard,
 * say so; then restore the default action and return: the access faults again and the
 * process dies by SIGSEGV. */
static void on_segv(int sig, siginfo_t *info, void *uctx) {
    (void)sig, (void)uctx;
    char *addr = info->si_addr;
    static const char hit[] = "fault in the fiber's guard page\n";
    static const char miss[] = "fault outside the fiber's guard page\n";
    if (addr >= guard_lo && addr < guard_hi)
        (void)!write(STDERR_FILENO, hit, sizeof hit - 1);
    else
        (void)!write(STDERR_FILENO, miss, sizeof miss - 1);
    signal(SIGSEGV, SIG_DFL);
}

/* ~256 bytes of frame per level, less than a page, so no level can step over the guard. The
 * depth check is never true in practice; it keeps the compiler from seeing endless recursion. */
static volatile uint64_t depth_limit = UINT64_MAX;
__attribute__((noinline)) static uint64_t bottomless(uint64_t n) {
    volatile uint8_t frame[200];
    frame[0] = (uint8_t)n;
    frame[199] = (uint8_t)(n >> 8);
    if (n == depth_limit) return 0;
    return bottomless(n + 1) + frame[0] + frame[199]; /* not a tail call */
}

static void overflow_fn(sp_fiber *self, void *arg) {
    (void)self, (void)arg;
    bottomless(0);
}

/* arg non-NULL: a growing pool of 1, where the overflowing fiber is one the pool made when it
 * grew (to 2, then 4). */
static void overflow_child(void *arg) {
    static char altstack[64 * 1024];
    stack_t ss = {.ss_sp = altstack, .ss_size = sizeof altstack};
    sigaltstack(&ss, NULL);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, NULL);

    sp_fiber_pool *pool = NULL;
    if ((arg ? sp_fiber_pool_create_growing(&pool, 1, 4, 64 * 1024)
             : sp_fiber_pool_create(&pool, 3, 64 * 1024)) != SP_OK)
        return;
    main_fiber = sp_fiber_thread_enter();
    sp_fiber *below = sp_fiber_acquire(pool, overflow_fn, NULL);
    if (arg) below = sp_fiber_acquire(pool, overflow_fn, NULL); /* the 2nd, made by growth */
    sp_fiber *f = sp_fiber_acquire(pool, overflow_fn, NULL);    /* arg: the 3rd, made then */
    if (arg && sp_fiber_pool_count(pool) != 4) return;
    void *lo;
    size_t size;
    sp_fiber_stack(f, &lo, &size);
    guard_hi = lo;
    guard_lo = guard_hi - sp_page_size();
    (void)below;
    sp_fiber_switch(main_fiber, f);
}

static void return_fn(sp_fiber *self, void *arg) {
    (void)self, (void)arg;
}

static void return_child(void *arg) {
    (void)arg;
    sp_fiber_pool *pool = NULL;
    if (sp_fiber_pool_create(&pool, 1, 64 * 1024) != SP_OK) return;
    main_fiber = sp_fiber_thread_enter();
    sp_fiber_switch(main_fiber, sp_fiber_acquire(pool, return_fn, NULL));
}

int main(void) {
    plan(3);
    ok(ts_dies(overflow_child, NULL, "fault in the fiber's guard page", NULL),
       "overflowing a fiber stack dies by SIGSEGV in its guard page");
    ok(ts_dies(overflow_child, "grown", "fault in the fiber's guard page", NULL),
       "... also a fiber made when the pool grew");
    ok(ts_dies(return_child, NULL, "must never return", "sp_fiber_acquire"),
       "a fiber function that returns dies through sp_die");
    return done();
}
