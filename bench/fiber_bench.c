/* The `fiber` benchmark area: the fiber switch (jobs/fiber.h, WHO spindle: the assembly backend
 * through sp_fiber_switch) against glibc's swapcontext/makecontext used directly (WHO
 * ucontext). Names: fiber/CASE/WHO.
 *
 *   switch   ping-pong between the thread's own fiber and one other fiber on one thread.
 *            Headline ns_per_switch: one-way switch (a round trip is two switches).
 *
 * Before the timed loop each WHO runs a warm-up of its own (spindle 2*10^7 switches, ucontext
 * 2*10^5: at ~230 ns a switch more would only cost time). The two fibers' MXCSR status flags
 * differ, as between fibers doing different FP work: the echoing fiber clears them, the
 * thread's fiber sets the precision flag (an ldmxcsr that changes those flags costs 35-60 ns
 * here; the FP modes, the control bits, are the same: jobs/fiber_switch_x86_64.S).
 *
 * Own flags (removed before Google Benchmark parses argv): --smoke (or BENCH_SMOKE=1): tiny
 * workloads, every case once; the figures mean nothing.
 */
#include <fenv.h>
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>

#include "bench.h"
#include "fiber.h"
#include "sp_platform.h"

#define STACK_SIZE (64 * 1024)

typedef struct who_cfg {
    int64_t warmup;   /* switches before the timed loop */
    int64_t switches; /* switches per repetition (even: whole round trips) */
} who_cfg;

static struct {
    who_cfg spindle, ucontext;
    bool smoke;
} cfg = {{20000000, 1 << 25}, {200000, 1 << 21}, false};

/* The calling fiber's FP status flags: an inexact division sets the precision flag. */
static void fp_touch(void) {
    volatile double one = 1.0, three = 3.0, r = one / three;
    (void)r;
}
static void fp_clear(void) {
    feclearexcept(FE_ALL_EXCEPT);
}

/* ---- spindle: sp_fiber_switch ---------------------------------------------------------- */

static sp_fiber *main_fiber;

static void spindle_echo(sp_fiber *self, void *arg) {
    (void)arg;
    fp_clear();
    for (;;) sp_fiber_switch(self, main_fiber);
}

/* `trips` round trips main -> fiber -> main. */
static __attribute__((noinline)) void spindle_trips(sp_fiber *f, int64_t trips) {
    for (int64_t i = 0; i < trips; i++) sp_fiber_switch(main_fiber, f);
}

static void run_spindle(bench_state *st, const void *arg) {
    (void)arg;
    sp_fiber_pool *pool = NULL;
    main_fiber = sp_fiber_thread_enter();
    if (!main_fiber || sp_fiber_pool_create(&pool, 1, STACK_SIZE) != SP_OK) {
        bench_skip_with_error(st, "fiber setup failed");
        sp_fiber_thread_leave(main_fiber);
        return;
    }
    sp_fiber *f = sp_fiber_acquire(pool, spindle_echo, NULL);
    fp_touch();
    spindle_trips(f, cfg.spindle.warmup / 2);
    uint64_t ns = 0;
    int64_t done = 0;
    while (bench_keep_running_batch(st, cfg.spindle.switches)) {
        uint64_t t0 = sp_time_ns();
        spindle_trips(f, cfg.spindle.switches / 2);
        ns += sp_time_ns() - t0;
        done += cfg.spindle.switches;
    }
    sp_fiber_release(pool, f); /* suspended in spindle_echo, never resumed again */
    sp_fiber_pool_destroy(pool);
    sp_fiber_thread_leave(main_fiber);
    if (done) bench_counter(st, "ns_per_switch", (double)ns / (double)done, BENCH_COUNTER_DEFAULT);
}

/* ---- ucontext: glibc swapcontext ------------------------------------------------------- */

static ucontext_t uc_main, uc_echo;

static void ucontext_echo(void) {
    fp_clear();
    for (;;) swapcontext(&uc_echo, &uc_main);
}

static __attribute__((noinline)) void ucontext_trips(int64_t trips) {
    for (int64_t i = 0; i < trips; i++) swapcontext(&uc_main, &uc_echo);
}

static void run_ucontext(bench_state *st, const void *arg) {
    (void)arg;
    void *stack = malloc(STACK_SIZE);
    if (!stack || getcontext(&uc_echo) != 0) {
        bench_skip_with_error(st, "ucontext setup failed");
        free(stack);
        return;
    }
    uc_echo.uc_stack.ss_sp = stack;
    uc_echo.uc_stack.ss_size = STACK_SIZE;
    uc_echo.uc_link = NULL;
    makecontext(&uc_echo, ucontext_echo, 0);
    fp_touch();
    ucontext_trips(cfg.ucontext.warmup / 2);
    uint64_t ns = 0;
    int64_t done = 0;
    while (bench_keep_running_batch(st, cfg.ucontext.switches)) {
        uint64_t t0 = sp_time_ns();
        ucontext_trips(cfg.ucontext.switches / 2);
        ns += sp_time_ns() - t0;
        done += cfg.ucontext.switches;
    }
    free(stack); /* uc_echo is suspended in ucontext_echo and never resumed again */
    if (done) bench_counter(st, "ns_per_switch", (double)ns / (double)done, BENCH_COUNTER_DEFAULT);
}

int main(int argc, char **argv) {
    const char *env = getenv("BENCH_SMOKE");
    cfg.smoke = bench_take_flag(&argc, argv, "--smoke") || (env && env[0] && env[0] != '0');
    if (cfg.smoke) {
        cfg.spindle = (who_cfg){1 << 12, 1 << 12};
        cfg.ucontext = (who_cfg){1 << 12, 1 << 12};
    }
    bench_register("fiber/switch/spindle", run_spindle, NULL, 1);
    bench_register("fiber/switch/ucontext", run_ucontext, NULL, 1);
    return bench_main(argc, argv);
}
