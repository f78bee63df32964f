/* Fibers on one thread: ping-pong with arguments, a ring of fibers, per-fiber floating-point
 * control state, callee-saved registers across switches, deep recursion, reuse, pool
 * exhaustion, and misuse reported through the logger. */
#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fiber.h"
#include "test_support.h"

#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif
#endif
#ifndef RUNNING_ON_VALGRIND
#define RUNNING_ON_VALGRIND 0
#endif

#define STACK (256 * 1024)

static sp_fiber *main_fiber;

/* ---- ping-pong ------------------------------------------------------------------------- */

typedef struct pingpong {
    sp_fiber *self_seen;
    uint64_t value; /* main -> fiber: a number; fiber -> main: the number * 3 + 1 */
    int rounds;
} pingpong;

static void pingpong_fn(sp_fiber *self, void *arg) {
    pingpong *pp = arg;
    pp->self_seen = self;
    for (;;) {
        pp->value = pp->value * 3 + 1;
        pp->rounds++;
        sp_fiber_switch(self, main_fiber);
    }
}

static void test_pingpong(sp_fiber_pool *pool) {
    pingpong pp = {NULL, 0, 0};
    sp_fiber *f = sp_fiber_acquire(pool, pingpong_fn, &pp);
    ok(f != NULL, "acquire a fiber");
    if (!f) return;
    bool all = true;
    const int n = 1000;
    for (int i = 0; i < n; i++) {
        pp.value = (uint64_t)i;
        sp_fiber_switch(main_fiber, f);
        if (pp.value != (uint64_t)i * 3 + 1 || pp.rounds != i + 1) all = false;
    }
    ok(pp.self_seen == f, "the fiber function gets its own fiber and its argument");
    ok(all, "%d round trips, each answered with the value it was sent", n);
    sp_fiber_release(pool, f);
}

/* ---- ring ------------------------------------------------------------------------------ */

enum { RING = 16, RING_ROUNDS = 50 };

typedef struct ring {
    sp_fiber *fibers[RING];
    int order[RING * RING_ROUNDS]; /* which fiber ran, in sequence */
    int steps;
} ring;

typedef struct ring_member {
    ring *r;
    int index;
} ring_member;

static void ring_fn(sp_fiber *self, void *arg) {
    ring_member *m = arg;
    ring *r = m->r;
    for (int round = 0;; round++) {
        r->order[r->steps++] = m->index;
        bool last = m->index == RING - 1 && round == RING_ROUNDS - 1;
        sp_fiber *next = last ? main_fiber : r->fibers[(m->index + 1) % RING];
        sp_fiber_switch(self, next);
    }
}

static void test_ring(sp_fiber_pool *pool) {
    /* Twice: the second pass reuses released fibers (fresh contexts on used stacks). */
    for (int pass = 0; pass < 2; pass++) {
        static ring r;
        ring_member m[RING];
        memset(&r, 0, sizeof r);
        int got = 0;
        for (int i = 0; i < RING; i++) {
            m[i] = (ring_member){&r, i};
            r.fibers[i] = sp_fiber_acquire(pool, ring_fn, &m[i]);
            got += r.fibers[i] != NULL;
        }
        if (got == RING) sp_fiber_switch(main_fiber, r.fibers[0]);
        bool in_order = r.steps == RING * RING_ROUNDS;
        for (int i = 0; in_order && i < r.steps; i++) in_order = r.order[i] == i % RING;
        ok(got == RING && in_order, "pass %d: %d fibers round-robin %d times, in order", pass, RING,
           RING_ROUNDS);
        for (int i = 0; i < RING; i++)
            if (r.fibers[i]) sp_fiber_release(pool, r.fibers[i]);
    }
    is_int(sp_fiber_pool_in_use(pool), 0, "every ring fiber released");
}

/* ---- floating-point control state ------------------------------------------------------ */

#if defined(__x86_64__)
#define HAVE_FP_MODE 1
/* MXCSR rounding (bits 13-14) and x87 control word rounding (bits 10-11), "toward zero" = 3;
 * plus MXCSR flush-to-zero (bit 15). */
typedef struct fp_mode {
    uint32_t mxcsr;
    uint16_t x87cw;
} fp_mode;
static fp_mode fp_get(void) {
    fp_mode m;
    __asm__ volatile("stmxcsr %0" : "=m"(m.mxcsr));
    __asm__ volatile("fnstcw %0" : "=m"(m.x87cw));
    return m;
}
static void fp_set(fp_mode m) {
    __asm__ volatile("ldmxcsr %0" ::"m"(m.mxcsr));
    __asm__ volatile("fldcw %0" ::"m"(m.x87cw));
}
static fp_mode fp_changed(fp_mode m) {
    m.mxcsr |= 3u << 13 | 1u << 15;
    m.x87cw |= 3u << 10;
    return m;
}
/* MXCSR control bits only: its status flags (0-5) are caller-saved, not per fiber (fiber.h). */
static bool fp_equal(fp_mode a, fp_mode b) {
    return ((a.mxcsr ^ b.mxcsr) & 0xffc0u) == 0 && a.x87cw == b.x87cw;
}
#elif defined(__aarch64__)
#define HAVE_FP_MODE 1
/* FPCR RMode (bits 22-23), "toward zero" = 3, and FZ (bit 24). */
typedef struct fp_mode {
    uint64_t fpcr;
} fp_mode;
static fp_mode fp_get(void) {
    fp_mode m;
    __asm__ volatile("mrs %0, fpcr" : "=r"(m.fpcr));
    return m;
}
static void fp_set(fp_mode m) {
    __asm__ volatile("msr fpcr, %0" ::"r"(m.fpcr));
}
static fp_mode fp_changed(fp_mode m) {
    m.fpcr |= 3u << 22 | 1u << 24;
    return m;
}
static bool fp_equal(fp_mode a, fp_mode b) {
    return a.fpcr == b.fpcr;
}
#else
#define HAVE_FP_MODE 0
#endif

#if HAVE_FP_MODE
typedef struct fp_probe {
    fp_mode start;         /* the mode the fiber found when it started */
    fp_mode resumed;       /* the mode it found after being switched back to */
    volatile double tenth; /* 1/10 computed in the fiber after the switch back */
    bool change;           /* whether this fiber changes its mode */
} fp_probe;

static void fp_fn(sp_fiber *self, void *arg) {
    fp_probe *p = arg;
    p->start = fp_get();
    if (p->change) fp_set(fp_changed(p->start));
    sp_fiber_switch(self, main_fiber);
    p->resumed = fp_get();
    volatile double one = 1.0, ten = 10.0;
    p->tenth = one / ten;
    sp_fiber_switch(self, main_fiber);
    for (;;) sp_fiber_switch(self, main_fiber);
}

static void test_fp_state(sp_fiber_pool *pool) {
    if (RUNNING_ON_VALGRIND) { /* it emulates neither rounding modes nor flush-to-zero */
        for (int i = 0; i < 7; i++) ok(1, "# SKIP valgrind ignores FP control state");
        return;
    }
    fp_mode thread_mode = fp_get();
    fp_probe a = {.change = true}, b = {.change = false};
    sp_fiber *fa = sp_fiber_acquire(pool, fp_fn, &a);
    sp_fiber *fb = sp_fiber_acquire(pool, fp_fn, &b);
    if (!fa || !fb) {
        ok(0, "acquire two fibers for the FP test");
        return;
    }
    sp_fiber_switch(main_fiber, fa); /* a changes its rounding and flush-to-zero */
    ok(fp_equal(a.start, thread_mode), "a fresh fiber starts with the thread's FP mode");
    ok(fp_equal(fp_get(), thread_mode), "the thread's FP mode is untouched by fiber a's change");
    sp_fiber_switch(main_fiber, fb);
    ok(fp_equal(b.start, thread_mode), "fiber b does not see fiber a's FP mode");
    sp_fiber_switch(main_fiber, fa);
    ok(fp_equal(a.resumed, fp_changed(thread_mode)),
       "fiber a keeps its own FP mode across switches");
    sp_fiber_switch(main_fiber, fb);
    ok(fp_equal(b.resumed, thread_mode), "fiber b still has the thread's FP mode");
    /* Behaviour, not just bits: 1/10 rounds up to nearest, so toward zero gives less. */
    ok(a.tenth < b.tenth, "1/10 rounds toward zero in fiber a (%a) and to nearest in b (%a)",
       a.tenth, b.tenth);
    ok(fp_equal(fp_get(), thread_mode), "the thread's FP mode at the end");
    fp_set(thread_mode);
    sp_fiber_release(pool, fa);
    sp_fiber_release(pool, fb);
}
#else
static void test_fp_state(sp_fiber_pool *pool) {
    (void)pool;
    for (int i = 0; i < 7; i++) ok(1, "# SKIP no FP mode test for this architecture");
}
#endif

/* ---- callee-saved registers ------------------------------------------------------------ */

typedef void (*yield_fn)(void *ctx);

/* Many values live across each yield: at -O2 they sit in callee-saved registers (integer and,
 * on aarch64, d8-d15), so a switch that loses one changes the result. */
__attribute__((noinline)) static uint64_t churn(uint64_t seed, int rounds, yield_fn yield,
                                                void *ctx) {
    uint64_t a = seed, b = seed * 3 + 1, c = seed ^ 0x5555, d = seed + 77, e = seed * seed,
             f = ~seed, g = seed >> 3, h = seed * 0x9e3779b97f4a7c15u;
    double x = (double)(seed & 0xffff), y = x * 0.5 + 1, z = y * 1.25, w = z - 3;
    for (int i = 0; i < rounds; i++) {
        a += b ^ h;
        b = (b << 7 | b >> 57) + c;
        c ^= d * 5;
        d += e >> 11;
        e = e * 6364136223846793005u + f;
        f -= g | 1;
        g += a >> 5;
        h ^= h << 13;
        x = x * 1.0000001 + y;
        y = y * 0.999999 + z;
        z = z + w * 0.5;
        w = w * 0.75 + x * 1e-9;
        yield(ctx);
    }
    return a ^ b ^ c ^ d ^ e ^ f ^ g ^ h ^ (uint64_t)(x + y + z + w);
}

static void no_yield(void *ctx) {
    (void)ctx;
}

typedef struct churn_pair {
    sp_fiber *fiber;
    uint64_t result;
} churn_pair;

static void yield_to_fiber(void *ctx) {
    sp_fiber_switch(main_fiber, ((churn_pair *)ctx)->fiber);
}

static void yield_to_main(void *ctx) {
    sp_fiber_switch(((churn_pair *)ctx)->fiber, main_fiber);
}

static void churn_fn(sp_fiber *self, void *arg) {
    churn_pair *cp = arg;
    cp->result = churn(0xfeedu, 1000, yield_to_main, cp);
    for (;;) sp_fiber_switch(self, main_fiber);
}

static void test_registers(sp_fiber_pool *pool) {
    uint64_t want_main = churn(0xbeefu, 1000, no_yield, NULL);
    uint64_t want_fiber = churn(0xfeedu, 1000, no_yield, NULL);
    churn_pair cp = {NULL, 0};
    cp.fiber = sp_fiber_acquire(pool, churn_fn, &cp);
    if (!cp.fiber) {
        ok(0, "acquire a fiber for the register test");
        return;
    }
    /* Both sides churn at once, switching every round; the fiber's last round returns to a
     * main that has one more round to go, hence the extra switch. */
    uint64_t got_main = churn(0xbeefu, 1000, yield_to_fiber, &cp);
    sp_fiber_switch(main_fiber, cp.fiber);
    ok(got_main == want_main, "thread: values live across 1000 switches survive");
    ok(cp.result == want_fiber, "fiber: values live across 1000 switches survive");
    sp_fiber_release(pool, cp.fiber);
}

/* ---- deep recursion -------------------------------------------------------------------- */

/* About 1 KiB of frame per level, touched so it cannot be optimised away. */
__attribute__((noinline)) static uint64_t recurse(int depth) {
    volatile uint8_t frame[1000];
    for (size_t i = 0; i < sizeof frame; i += 64) frame[i] = (uint8_t)(depth + i);
    uint64_t below = depth > 0 ? recurse(depth - 1) : 0;
    return below + frame[(size_t)depth % 16 * 64] + 1;
}

typedef struct deep {
    int depth;
    uint64_t result;
    uint64_t expected;
} deep;

static void deep_fn(sp_fiber *self, void *arg) {
    deep *d = arg;
    d->result = recurse(d->depth);
    for (;;) sp_fiber_switch(self, main_fiber);
}

static void test_deep(sp_fiber_pool *pool) {
    /* ~150 KiB of a 256 KiB stack (ASan's redzones make frames larger, still well inside). */
    deep d = {150, 0, 0};
    d.expected = recurse(d.depth);
    sp_fiber *f = sp_fiber_acquire(pool, deep_fn, &d);
    if (f) sp_fiber_switch(main_fiber, f);
    ok(f && d.result == d.expected, "recursion %d levels deep (~%d KiB) on a fiber stack", d.depth,
       d.depth);
    if (f) sp_fiber_release(pool, f);
}

/* ---- exhaustion and reuse -------------------------------------------------------------- */

static void idle_fn(sp_fiber *self, void *arg) {
    (void)arg;
    for (;;) sp_fiber_switch(self, main_fiber);
}

static void test_exhaustion(void) {
    sp_fiber_pool *pool = NULL;
    is_int(sp_fiber_pool_create(&pool, 2, 16 * 1024), SP_OK, "create a pool of 2");
    if (!pool) return;
    sp_fiber *a = sp_fiber_acquire(pool, idle_fn, NULL);
    sp_fiber *b = sp_fiber_acquire(pool, idle_fn, NULL);
    ok(a && b && a != b, "two fibers acquired");
    ok(sp_fiber_acquire(pool, idle_fn, NULL) == NULL, "a third acquire returns NULL");
    is_int(sp_fiber_pool_in_use(pool), 2, "two in use");
    sp_fiber_release(pool, a);
    sp_fiber *c = sp_fiber_acquire(pool, idle_fn, NULL);
    ok(c == a, "after a release, acquire succeeds again (with the released fiber)");
    void *lo_a, *lo_b;
    size_t size_a, size_b;
    sp_fiber_stack(a, &lo_a, &size_a);
    sp_fiber_stack(b, &lo_b, &size_b);
    ok(size_a == 16 * 1024 && size_b == size_a &&
           (lo_a > lo_b ? (char *)lo_a - (char *)lo_b : (char *)lo_b - (char *)lo_a) >
               (ptrdiff_t)size_a,
       "stacks of the requested size, a guard between them");
    /* Run, abandon, release and re-acquire many times: each life starts clean. */
    int runs = 0;
    for (int i = 0; i < 500; i++) {
        sp_fiber_switch(main_fiber, c);
        sp_fiber_switch(main_fiber, b);
        sp_fiber_release(pool, c);
        sp_fiber_release(pool, b);
        c = sp_fiber_acquire(pool, idle_fn, NULL);
        b = sp_fiber_acquire(pool, idle_fn, NULL);
        runs += c && b;
        if (!c || !b) break;
    }
    is_int(runs, 500, "500 lives of each fiber: run, abandon, release, acquire");
    sp_fiber_release(pool, b);
    sp_fiber_release(pool, c);
    is_int(sp_fiber_pool_in_use(pool), 0, "none in use at the end");
    sp_fiber_pool_destroy(pool);
}

/* A growing pool: 2 fibers, doubling to at most 5 when an acquire finds none free. Every
 * fiber made runs, has its own stack with a gap (the guard) to the others, goes back to the
 * pool and is acquired again; beyond 5, NULL. */
static void test_growth(void) {
    enum { START = 2, MAX = 5 };
    sp_fiber_pool *pool = NULL;
    is_int(sp_fiber_pool_create_growing(&pool, START, MAX, 16 * 1024), SP_OK,
           "create a pool of 2 that grows to 5");
    if (!pool) return;
    is_int(sp_fiber_pool_count(pool), START, "2 fibers made at create");
    sp_fiber *f[MAX];
    uint32_t counts[MAX];
    int got = 0;
    for (int i = 0; i < MAX; i++) {
        f[i] = sp_fiber_acquire(pool, idle_fn, NULL);
        counts[i] = sp_fiber_pool_count(pool);
        got += f[i] != NULL;
    }
    ok(got == MAX && counts[1] == 2 && counts[2] == 4 && counts[3] == 4 && counts[4] == 5,
       "5 acquired; the pool made 2, then 4 (doubled), then 5 (its max): %u %u %u %u %u", counts[0],
       counts[1], counts[2], counts[3], counts[4]);
    ok(sp_fiber_acquire(pool, idle_fn, NULL) == NULL && sp_fiber_pool_count(pool) == MAX,
       "a sixth acquire returns NULL, nothing more made");
    bool apart = true;
    for (int i = 0; i < MAX && got == MAX; i++) {
        void *lo_i, *lo_j;
        size_t size, size_j;
        sp_fiber_stack(f[i], &lo_i, &size);
        for (int j = 0; j < i; j++) {
            sp_fiber_stack(f[j], &lo_j, &size_j);
            ptrdiff_t d = (char *)lo_i - (char *)lo_j;
            apart &= size == 16 * 1024 && (d < 0 ? -d : d) > (ptrdiff_t)size;
        }
    }
    ok(apart, "every stack of the requested size, a gap (the guard page) between any two");
    int ran = 0;
    for (int i = 0; i < MAX && got == MAX; i++) {
        sp_fiber_switch(main_fiber, f[i]); /* runs to its first switch back */
        ran++;
    }
    ts_log_capture();
    for (int i = 0; i < MAX && got == MAX; i++) sp_fiber_release(pool, f[i]);
    ok(ran == MAX && ts_logged.count == 0 && sp_fiber_pool_in_use(pool) == 0,
       "each ran; the grown fibers are the pool's own: released without a report");
    ts_log_release();
    got = 0;
    for (int i = 0; i < MAX; i++) got += (f[i] = sp_fiber_acquire(pool, idle_fn, NULL)) != NULL;
    ok(got == MAX && sp_fiber_pool_count(pool) == MAX, "all 5 acquired again, none made");
    for (int i = 0; i < MAX; i++) sp_fiber_release(pool, f[i]);
    sp_fiber_pool_destroy(pool);

    ts_log_capture();
    sp_fiber_pool *none = (sp_fiber_pool *)1;
    ok(sp_fiber_pool_create_growing(&none, 4, 3, 4096) == SP_ERR_INVALID_ARG && none == NULL &&
           ts_logged.count == 1 && ts_logged.last_id == SP_ERR_INVALID_ARG,
       "a growing pool with max below count: SP_ERR_INVALID_ARG, reported");
    /* A stack size whose slot (stack + guard page) wraps: refused, not a pool of empty slots. */
    none = (sp_fiber_pool *)1;
    sp_result wrap = sp_fiber_pool_create(&none, 4, SIZE_MAX - sp_page_size() + 1);
    ok(wrap == SP_ERR_OVERFLOW && none == NULL,
       "a stack size whose slot wraps the address space: SP_ERR_OVERFLOW (%s)",
       sp_result_name(wrap));
    ts_log_release();
}

/* ---- trim ------------------------------------------------------------------------------ */

/* Writes 24 KiB of its stack, then goes back to the main fiber for good. */
static void touch_fn(sp_fiber *self, void *arg) {
    volatile unsigned char buf[24 * 1024];
    for (size_t i = 0; i < sizeof buf; i += 512) buf[i] = (unsigned char)(i / 512 + 1);
    *(int *)arg = buf[512];
    for (;;) sp_fiber_switch(self, main_fiber);
}

/* Pages of f's stack resident now (mincore); SIZE_MAX if mincore failed. */
static size_t stack_resident(const sp_fiber *f) {
    void *lo;
    size_t size, n = 0;
    sp_fiber_stack(f, &lo, &size);
    size_t ps = (size_t)sysconf(_SC_PAGESIZE), pages = size / ps;
    unsigned char vec[64];
    if (pages > sizeof vec || mincore(lo, size, vec) != 0) return SIZE_MAX;
    for (size_t i = 0; i < pages; i++) n += vec[i] & 1;
    return n;
}

/* Fibers that ran and were released keep their stack pages until a trim gives them back, at
 * most `max` a call; the pool hands such a fiber out again as usual. */
static void test_trim(void) {
    enum { N = 3 };
    sp_fiber_pool *pool = NULL;
    if (sp_fiber_pool_create(&pool, N + 1, 64 * 1024) != SP_OK) {
        ok(0, "pool for the trim test");
        return;
    }
    sp_fiber *f[N];
    int seen[N] = {0};
    size_t before = 0;
    for (int i = 0; i < N; i++) {
        f[i] = sp_fiber_acquire(pool, touch_fn, &seen[i]);
        if (f[i]) sp_fiber_switch(main_fiber, f[i]);
    }
    is_int(sp_fiber_pool_stacks_used(pool), N, "3 fibers ran: 3 stacks used (the 4th never ran)");
    for (int i = 0; i < N; i++) {
        before += f[i] && stack_resident(f[i]) >= 6 ? 1 : 0;
        if (f[i]) sp_fiber_release(pool, f[i]);
    }
    is_int(sp_fiber_pool_stacks_used(pool), N, "released, their stacks still count as used");
    uint32_t t1 = sp_fiber_pool_trim(pool, 2), used1 = sp_fiber_pool_stacks_used(pool);
    uint32_t t2 = sp_fiber_pool_trim(pool, 5), t3 = sp_fiber_pool_trim(pool, 5);
    size_t after = 0;
    for (int i = 0; i < N; i++) after += f[i] ? stack_resident(f[i]) : 1;
    ok(before == N && t1 == 2 && used1 == 1 && t2 == 1 && t3 == 0 && after == 0 &&
           sp_fiber_pool_stacks_used(pool) == 0,
       "trims give back 2 (their max), then 1, then none; no stack page left resident "
       "(%zu of %d stacks had 6+ pages resident; trims %u %u %u, %zu pages after)",
       before, N, t1, t2, t3, after);
    int again = 0;
    sp_fiber *g = sp_fiber_acquire(pool, touch_fn, &again);
    if (g) sp_fiber_switch(main_fiber, g);
    ok(g && again == 2 && sp_fiber_pool_stacks_used(pool) == 1,
       "a trimmed fiber runs again on a fresh stack (and counts as used)");
    if (g) sp_fiber_release(pool, g);
    sp_fiber_pool_destroy(pool);
}

/* Under mlockall a purge fails (madvise refuses locked pages): the trim reports it once, with
 * the pool's lock released (a logger that asks the pool used to deadlock), gives back nothing,
 * and later trims do nothing and say nothing. In a child (locking all memory is not for the
 * test process; not under sanitizers, whose shadow mappings it would lock). */
static sp_fiber_pool *locked_pool;
static int locked_logs, locked_asked;
static void locked_logger(void *user, const sp_log_record *rec) {
    (void)user, (void)rec;
    locked_logs++;
    locked_asked += sp_fiber_pool_stacks_used(locked_pool) >= 1;
}

static void locked_child(void *arg) {
    (void)arg;
    alarm(10); /* a deadlock fails the line instead of hanging it */
    if (sp_fiber_pool_create(&locked_pool, 4, 64 * 1024) != SP_OK) _exit(3);
    main_fiber = sp_fiber_thread_enter();
    int seen = 0;
    sp_fiber *f[3];
    for (int i = 0; i < 3; i++) {
        f[i] = sp_fiber_acquire(locked_pool, touch_fn, &seen);
        if (!f[i]) _exit(3);
        sp_fiber_switch(main_fiber, f[i]);
    }
    for (int i = 0; i < 3; i++) sp_fiber_release(locked_pool, f[i]);
    if (mlockall(MCL_CURRENT | MCL_FUTURE) != 0) _exit(77); /* not allowed here: no line */
    sp_log_set(locked_logger, NULL);
    uint32_t t1 = sp_fiber_pool_trim(locked_pool, 64), t2 = sp_fiber_pool_trim(locked_pool, 64);
    uint32_t used = sp_fiber_pool_stacks_used(locked_pool);
    munlockall();
    _exit(t1 == 0 && t2 == 0 && locked_logs == 1 && locked_asked == 1 && used == 3 ? 0 : 4);
}

static void test_trim_locked(void) {
    if (ts_sanitized()) {
        skip("trim under mlockall: not under a sanitizer or valgrind");
        return;
    }
    static char text[4096];
    int status = ts_child(locked_child, NULL, text, sizeof text);
    int code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (code == 77) {
        skip("trim under mlockall: mlockall refused here");
        return;
    }
    ok(code == 0,
       "trim under mlockall: nothing given back, the failure logged once (with a logger that "
       "asks the pool), later trims quiet (exit %d; 4: wrong result, other: hung or crashed)",
       code);
    if (code != 0) diag("child stderr:\n%s", text);
}

/* A growth that fails (mprotect refused, through the link-time wrap below): the acquire
 * returns NULL, the failure is logged by a logger that asks the pool how many fibers are in
 * use (it deadlocked when the pool's lock was held across the growth), and the pool stays as
 * it was without trying again. */
int __real_mprotect(void *p, size_t n, int prot);
int __wrap_mprotect(void *p, size_t n, int prot);
static atomic_int refuse_mprotect;
int __wrap_mprotect(void *p, size_t n, int prot) {
    if (atomic_load(&refuse_mprotect)) {
        errno = ENOMEM;
        return -1;
    }
    return __real_mprotect(p, n, prot);
}

static sp_fiber_pool *asked_pool;
static int asked;
static void asking_logger(void *user, const sp_log_record *rec) {
    (void)user, (void)rec;
    asked += sp_fiber_pool_in_use(asked_pool) == 1;
}

static void test_growth_failure(void) {
    sp_fiber_pool *pool = NULL;
    if (sp_fiber_pool_create_growing(&pool, 1, 4, 16 * 1024) != SP_OK) {
        ok(0, "create a pool of 1 that grows to 4");
        return;
    }
    sp_fiber *a = sp_fiber_acquire(pool, idle_fn, NULL);
    asked_pool = pool;
    asked = 0;
    sp_log_set(asking_logger, NULL);
    atomic_store(&refuse_mprotect, 1);
    sp_fiber *b = sp_fiber_acquire(pool, idle_fn, NULL);
    int asked_first = asked;
    sp_fiber *c = sp_fiber_acquire(pool, idle_fn, NULL);
    atomic_store(&refuse_mprotect, 0);
    ts_log_capture();
    ok(a && !b && !c && asked_first >= 1 && asked == asked_first &&
           sp_fiber_pool_count(pool) == 1 && sp_fiber_pool_in_use(pool) == 1,
       "a growth that fails: NULL, logged (%d records; the logger could ask the pool), the "
       "pool stays at %u fiber(s), not tried again",
       asked_first, sp_fiber_pool_count(pool));
    ts_log_release();
    if (a) sp_fiber_release(pool, a);
    sp_fiber_pool_destroy(pool);
}

/* ---- misuse ---------------------------------------------------------------------------- */

static bool reported(sp_result id, const char *call, const void *addr) {
    bool r = ts_logged.count == 1 && ts_logged.last_id == id &&
             strcmp(ts_logged.last_call, call) == 0 && ts_logged.last_addr == addr;
    if (!r)
        diag("  logged %d, last %s from %s at %p: %s", ts_logged.count,
             sp_result_name(ts_logged.last_id), ts_logged.last_call, ts_logged.last_addr,
             ts_logged.last_message);
    ts_log_reset();
    return r;
}

static void test_misuse(sp_fiber_pool *pool) {
    sp_fiber_pool *other = NULL;
    sp_fiber_pool_create(&other, 1, 4096);
    ts_log_capture();

    sp_fiber_pool *none = (sp_fiber_pool *)1;
    ok(sp_fiber_pool_create(&none, 0, 4096) == SP_ERR_INVALID_ARG && none == NULL &&
           reported(SP_ERR_INVALID_ARG, "sp_fiber_pool_create", &none),
       "create with count 0: SP_ERR_INVALID_ARG, reported");
    ok(sp_fiber_pool_create(&none, 4, 0) == SP_ERR_INVALID_ARG &&
           reported(SP_ERR_INVALID_ARG, "sp_fiber_pool_create", &none),
       "create with stack size 0: SP_ERR_INVALID_ARG, reported");
    ok(sp_fiber_acquire(pool, NULL, NULL) == NULL &&
           reported(SP_ERR_INVALID_ARG, "sp_fiber_acquire", pool),
       "acquire with a NULL function: NULL, reported");

    sp_fiber *f = sp_fiber_acquire(pool, idle_fn, NULL);
    sp_fiber *g = other ? sp_fiber_acquire(other, idle_fn, NULL) : NULL;
    uint32_t in_use = sp_fiber_pool_in_use(pool);
    sp_fiber_release(pool, g);
    ok(g && reported(SP_ERR_FOREIGN_POINTER, "sp_fiber_release", g) &&
           sp_fiber_pool_in_use(pool) == in_use && sp_fiber_pool_in_use(other) == 1,
       "release of another pool's fiber: SP_ERR_FOREIGN_POINTER, both pools unchanged");
    sp_fiber_release(pool, (sp_fiber *)((char *)f + 8));
    ok(reported(SP_ERR_FOREIGN_POINTER, "sp_fiber_release", (char *)f + 8),
       "release of a pointer inside a fiber record: SP_ERR_FOREIGN_POINTER");
    sp_fiber_release(pool, main_fiber);
    ok(reported(SP_ERR_FOREIGN_POINTER, "sp_fiber_release", main_fiber),
       "release of a thread fiber: SP_ERR_FOREIGN_POINTER");
    sp_fiber_release(pool, f);
    ts_log_reset();
    sp_fiber_release(pool, f);
    ok(reported(SP_ERR_DOUBLE_FREE, "sp_fiber_release", f) &&
           sp_fiber_pool_in_use(pool) == in_use - 1,
       "double release: SP_ERR_DOUBLE_FREE, count unchanged");

    sp_fiber_switch(main_fiber, f);
    ok(reported(SP_ERR_INVALID_ARG, "sp_fiber_switch", f), "switch to a released fiber: refused");
    sp_fiber_switch(main_fiber, main_fiber);
    ok(reported(SP_ERR_INVALID_ARG, "sp_fiber_switch", main_fiber), "switch to itself: refused");
    sp_fiber_switch(main_fiber, NULL);
    ok(reported(SP_ERR_INVALID_ARG, "sp_fiber_switch", NULL), "switch to NULL: refused");
    sp_fiber_thread_leave(g);
    ok(reported(SP_ERR_FOREIGN_POINTER, "sp_fiber_thread_leave", g),
       "thread_leave of a pooled fiber: SP_ERR_FOREIGN_POINTER");

    sp_fiber_pool_destroy(other);
    ok(reported(SP_ERR_INVALID_ARG, "sp_fiber_pool_destroy", other) &&
           sp_fiber_pool_in_use(other) == 1,
       "destroy with a fiber still acquired: refused, pool intact");
    ts_log_release();
    sp_fiber_release(other, g);
    sp_fiber_pool_destroy(other);
}

int main(void) {
    plan(54);
    sp_fiber_pool *pool = NULL;
    is_int(sp_fiber_pool_create(&pool, 32, STACK), SP_OK, "create a pool of 32 fibers");
    main_fiber = sp_fiber_thread_enter();
    ok(pool && main_fiber, "the main thread has a fiber");
    if (!pool || !main_fiber) return done();

    test_pingpong(pool);
    test_ring(pool);
    test_fp_state(pool);
    test_registers(pool);
    test_deep(pool);
    test_exhaustion();
    test_growth();
    test_growth_failure();
    test_trim();
    test_trim_locked();
    test_misuse(pool);

    is_int(sp_fiber_pool_in_use(pool), 0, "nothing left acquired");
    sp_fiber_pool_destroy(pool);
    sp_fiber_thread_leave(main_fiber);
    return done();
}
