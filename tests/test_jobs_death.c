/* Scheduler death tests, each in a forked child: a job whose recursion never ends faults at
 * once at the edge of its fiber stack (SIGSEGV within a few frames of the deepest frame
 * reached, so nothing past the stack was written), inline and on a worker thread; and misuse
 * with the fatal policy dies with a message naming the call. */
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "jobs_support.h"

enum { STACK = 64 * 1024, EDGE = 16 * 1024, ALTSTACK = 64 * 1024 };

/* The deepest frame the recursion reached, written at every level. */
static char *volatile deepest;

static void on_segv(int sig, siginfo_t *info, void *uctx) {
    (void)sig, (void)uctx;
    char *addr = info->si_addr, *low = deepest;
    static const char hit[] = "fault at the edge of the job's stack\n";
    static const char miss[] = "fault away from the job's stack edge\n";
    if (low && addr < low && (size_t)(low - addr) <= EDGE)
        (void)!write(STDERR_FILENO, hit, sizeof hit - 1);
    else
        (void)!write(STDERR_FILENO, miss, sizeof miss - 1);
    signal(SIGSEGV, SIG_DFL); /* returning re-runs the access: the child dies by SIGSEGV */
}

/* ~256 bytes per level, under a page, so no level steps over a guard page. The depth check is
 * never true; it keeps the compiler from proving the recursion endless. */
static volatile uint64_t depth_limit = UINT64_MAX;
__attribute__((noinline)) static uint64_t bottomless(uint64_t n) {
    volatile uint8_t frame[200];
    frame[0] = (uint8_t)n;
    frame[199] = (uint8_t)(n >> 8);
    char *here = __builtin_frame_address(0);
    if (!deepest || here < deepest) deepest = here;
    if (n == depth_limit) return 0;
    return bottomless(n + 1) + frame[0] + frame[199]; /* not a tail call */
}

static char altstacks[16][ALTSTACK];

/* The signal handler needs an alternate stack on whichever thread runs the job. */
static void overflow_job(void *arg) {
    (void)arg;
    uint32_t w = sp_jobs_worker_id();
    stack_t ss = {.ss_sp = altstacks[w < 16 ? w : 15], .ss_size = ALTSTACK};
    sigaltstack(&ss, NULL);
    bottomless(0);
}

static void overflow_child(void *arg) {
    const jt_config *c = arg;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, NULL);
    sp_jobs *s = NULL;
    sp_jobs_desc d = {.workers = c->workers, .no_workers = c->no_workers, .fiber_stack = STACK};
    if (sp_jobs_create(&s, &d) != SP_OK) return;
    sp_counter *ctr = sp_counter_create(s, "overflow");
    sp_job_desc j = jt_job(overflow_job, NULL, "overflow");
    if (!ctr || sp_jobs_submit(s, &j, 1, ctr) != SP_OK) return;
    sp_counter_wait(ctr, 0);
}

/* ---- fatal misuse ---------------------------------------------------------------------- */

static void noop(void *arg) {
    (void)arg;
}

enum { NULL_FN, PIN_RANGE, NULL_WAIT };

static void misuse_child(void *arg) {
    int what = (int)(uintptr_t)arg;
    sp_jobs *s = NULL;
    sp_jobs_desc d = {.no_workers = true};
    if (sp_jobs_create(&s, &d) != SP_OK) return;
    sp_job_desc j = jt_job(noop, NULL, "misuse");
    if (what == NULL_FN) j.fn = NULL;
    if (what == PIN_RANGE) j.pinned = true, j.worker = 1;
    if (what == NULL_WAIT)
        sp_counter_wait(NULL, 0);
    else
        sp_jobs_submit(s, &j, 1, NULL);
    /* Not dead: say so, and exit normally (the parent sees no signal). */
    sp_jobs_shutdown(s);
    sp_jobs_destroy(s);
}

int main(void) {
    plan(5);
    ok(ts_dies(overflow_child, (void *)&jt_sweep[0], "fault at the edge of the job's stack", NULL),
       "inline: a job's endless recursion dies by SIGSEGV at its stack's edge");
    ok(ts_dies(overflow_child, (void *)&jt_sweep[2], "fault at the edge of the job's stack", NULL),
       "2 workers: the same on a worker thread");
    ok(ts_dies(misuse_child, (void *)(uintptr_t)NULL_FN, "sp_jobs_submit", NULL),
       "fatal misuse: a NULL fn dies naming sp_jobs_submit");
    ok(ts_dies(misuse_child, (void *)(uintptr_t)PIN_RANGE, "sp_jobs_submit", NULL),
       "fatal misuse: a pinned worker out of range dies naming sp_jobs_submit");
    ok(ts_dies(misuse_child, (void *)(uintptr_t)NULL_WAIT, "sp_counter_wait", NULL),
       "fatal misuse: sp_counter_wait(NULL) dies naming sp_counter_wait");
    return done();
}
