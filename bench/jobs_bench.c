/* The `jobs` benchmark area: the fiber job scheduler of jobs/sp_jobs.h (WHO spindle) against
 * `mutexpool`, a plain pthread pool written here (one mutex over a FIFO of jobs, workers blocked
 * on a condition variable, a batch counter with its own condition variable; the submitting
 * thread never runs jobs). Same number of worker threads for both (default 2); spindle's main
 * thread also runs jobs while it waits, so 3 threads run spindle's jobs against 2. Names:
 * jobs/CASE/WHO[/workers:N] (the suffix only when N is not the default 2).
 *
 *   empty      1024 rounds: submit 1024 empty jobs in one call with one counter, wait for it.
 *              Headline ns_per_job: wall time / (rounds * 1024).
 *   roundtrip  submit one empty job, wait for it; 65,536 times. Headline ns per round trip.
 *   switch     spindle only: the raw fiber switch (jobs/fiber.h, sp_fiber_switch) ping-pong on
 *              one thread between the thread's fiber and a pooled fiber, no scheduler involved.
 *              Headline ns one way.
 *   handoff    job A signals a counter job B waits on, then waits on a counter B signals, and
 *              so on (spindle: each wait parks the fiber, each signal resumes the other one).
 *              Both jobs pinned to worker 1, so this is park + resume on one worker, no
 *              cross-core traffic. mutexpool: two pool threads taking turns through one mutex
 *              and two condition variables (a cross-thread wake per handoff; it cannot do it on
 *              one thread). Headline ns per handoff (a round trip is two), timed inside job A.
 *   handoff_spread  spindle only: the same two jobs unpinned, wherever the scheduler runs them.
 *   pfor       compute-bound parallel-for: 2^24 elements, 64 dependent integer steps each,
 *              summed. Per run: the serial loop, the parallel loop, the serial loop again, the
 *              parallel loop again (same noinline range function). Headline speedup = serial
 *              time / parallel time (sums of both passes). spindle: sp_parallel_for, grain 0
 *              (the main thread works in it); mutexpool: fixed chunks of 2^16 elements.
 *   idle       wake every worker with a batch of 1024 empty jobs, then sleep 1 s on the main
 *              thread; headline cpu_pct = process CPU time (CLOCK_PROCESS_CPUTIME_ID) / wall
 *              time * 100, i.e. percent of one core. It includes the workers' spin-down after
 *              the batch.
 *
 * One scheduler per benchmark run, created before the timed loop on the benchmark's thread
 * (Google Benchmark runs a one-thread benchmark on the main thread, which thus becomes
 * spindle's worker 0: it runs jobs while it waits) and destroyed after it. All headline
 * figures are wall time from sp_time_ns around the work (not Google Benchmark's CPU time).
 * Extra counters for diagnosis (in the JSON, not the table): spindle's sp_jobs_status deltas.
 *
 * Own flags (removed before Google Benchmark parses argv): --smoke (or BENCH_SMOKE=1): tiny
 * workloads, every case once; the figures mean nothing. --workers=N (or BENCH_JOBS_WORKERS=N):
 * worker threads for both schedulers (default 2).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "fiber.h"
#include "sp_jobs.h"
#include "sp_platform.h"

#define BATCH 1024
#define PFOR_STEPS 64
#define PFOR_CHUNK (1u << 16)

static struct {
    uint32_t workers;
    int64_t empty_rounds;
    int64_t roundtrips;
    int64_t switches; /* one-way, even */
    int64_t switch_warmup;
    int64_t handoff_rounds; /* two handoffs each */
    uint64_t pfor_n;
    uint64_t idle_ns;
    bool smoke;
} cfg = {2, 1024, 1 << 16, 1 << 25, 1 << 22, 1 << 18, 1u << 24, 1000000000, false};

/* ---- the peer: a mutex + condition variable thread pool -------------------------------- */

typedef struct mp_counter {
    atomic_long value;
    pthread_mutex_t lock;
    pthread_cond_t zero;
} mp_counter;

typedef struct mp_job {
    sp_job_fn fn;
    void *arg;
    mp_counter *counter;
} mp_job;

typedef struct mutexpool {
    pthread_mutex_t lock;
    pthread_cond_t work;    /* idle workers wait here */
    mp_job *ring;           /* FIFO: jobs [head, tail) at index & (cap - 1) */
    size_t cap, head, tail; /* cap a power of two */
    uint32_t idle;          /* workers waiting on `work` */
    bool stop;
    uint32_t nthreads;
    pthread_t threads[64];
} mutexpool;

static void mp_counter_init(mp_counter *c) {
    atomic_init(&c->value, 0);
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->zero, NULL);
}

static void mp_counter_fini(mp_counter *c) {
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->zero);
}

/* One job done: the lock is taken only by the job that brings the counter to zero. */
static void mp_counter_done(mp_counter *c) {
    if (atomic_fetch_sub_explicit(&c->value, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_lock(&c->lock);
        pthread_cond_broadcast(&c->zero);
        pthread_mutex_unlock(&c->lock);
    }
}

static void mp_counter_wait(mp_counter *c) {
    if (atomic_load_explicit(&c->value, memory_order_acquire) <= 0) return;
    pthread_mutex_lock(&c->lock);
    while (atomic_load_explicit(&c->value, memory_order_acquire) > 0)
        pthread_cond_wait(&c->zero, &c->lock);
    pthread_mutex_unlock(&c->lock);
}

static void *mp_worker(void *arg) {
    mutexpool *p = arg;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (p->head == p->tail && !p->stop) {
            p->idle++;
            pthread_cond_wait(&p->work, &p->lock);
            p->idle--;
        }
        if (p->head == p->tail) break; /* stopping, nothing left */
        mp_job j = p->ring[p->head++ & (p->cap - 1)];
        pthread_mutex_unlock(&p->lock);
        j.fn(j.arg);
        if (j.counter) mp_counter_done(j.counter);
        pthread_mutex_lock(&p->lock);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

static mutexpool *mp_create(uint32_t workers) {
    mutexpool *p = calloc(1, sizeof *p);
    if (!p || workers > 64) goto fail;
    p->cap = 4096;
    p->ring = malloc(p->cap * sizeof *p->ring);
    if (!p->ring) goto fail;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->work, NULL);
    for (; p->nthreads < workers; p->nthreads++)
        if (pthread_create(&p->threads[p->nthreads], NULL, mp_worker, p) != 0) break;
    if (p->nthreads == workers) return p;
    pthread_mutex_lock(&p->lock);
    p->stop = true;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->lock);
    for (uint32_t i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
fail:
    if (p) free(p->ring);
    free(p);
    return NULL;
}

/* Runs every queued job, then joins the workers. */
static void mp_destroy(mutexpool *p) {
    pthread_mutex_lock(&p->lock);
    p->stop = true;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->lock);
    for (uint32_t i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->work);
    free(p->ring);
    free(p);
}

/* Room for n more jobs; the lock is held. */
static bool mp_reserve(mutexpool *p, size_t n) {
    size_t used = p->tail - p->head, cap = p->cap;
    if (used + n <= cap) return true;
    while (used + n > cap) cap *= 2;
    mp_job *r = malloc(cap * sizeof *r);
    if (!r) return false;
    for (size_t i = 0; i < used; i++) r[i] = p->ring[(p->head + i) & (p->cap - 1)];
    free(p->ring);
    p->ring = r;
    p->cap = cap;
    p->head = 0;
    p->tail = used;
    return true;
}

/* Queue n jobs under one lock; counter (may be NULL) is raised by n first. Wakes at most n idle
 * workers, after unlocking. */
static bool mp_submit(mutexpool *p, const sp_job_desc *jobs, uint32_t n, mp_counter *counter) {
    if (counter) atomic_fetch_add_explicit(&counter->value, n, memory_order_relaxed);
    pthread_mutex_lock(&p->lock);
    if (!mp_reserve(p, n)) {
        pthread_mutex_unlock(&p->lock);
        if (counter) atomic_fetch_sub_explicit(&counter->value, n, memory_order_relaxed);
        return false;
    }
    for (uint32_t i = 0; i < n; i++)
        p->ring[p->tail++ & (p->cap - 1)] = (mp_job){jobs[i].fn, jobs[i].arg, counter};
    uint32_t idle = p->idle, wake = idle < n ? idle : n;
    pthread_mutex_unlock(&p->lock);
    if (wake == idle && wake > 1)
        pthread_cond_broadcast(&p->work);
    else
        for (uint32_t i = 0; i < wake; i++) pthread_cond_signal(&p->work);
    return true;
}

/* ---- both schedulers behind one switch --------------------------------------------------- */

typedef enum who { WHO_SPINDLE, WHO_MUTEXPOOL } who;
static const char *const who_name[] = {"spindle", "mutexpool"};

typedef struct sched {
    who who;
    sp_jobs *s; /* spindle */
    sp_counter *c;
    mutexpool *p; /* mutexpool */
    mp_counter pc;
    sp_jobs_status before; /* spindle: status when the timed part began */
} sched;

static bool sched_open(sched *x, who w, bench_state *st) {
    *x = (sched){.who = w};
    if (w == WHO_SPINDLE) {
        sp_jobs_desc d = {.workers = cfg.workers};
        if (sp_jobs_create(&x->s, &d) != SP_OK) {
            bench_skip_with_error(st, "sp_jobs_create failed");
            return false;
        }
        x->c = sp_counter_create(x->s, "bench");
        if (!x->c) {
            sp_jobs_destroy(x->s);
            bench_skip_with_error(st, "sp_counter_create failed");
            return false;
        }
        sp_jobs_status_get(x->s, &x->before);
        return true;
    }
    x->p = mp_create(cfg.workers);
    if (!x->p) {
        bench_skip_with_error(st, "mutexpool: thread creation failed");
        return false;
    }
    mp_counter_init(&x->pc);
    return true;
}

static void sched_close(sched *x) {
    if (x->who == WHO_SPINDLE) {
        sp_counter_destroy(x->c);
        sp_jobs_destroy(x->s);
    } else {
        mp_destroy(x->p);
        mp_counter_fini(&x->pc);
    }
}

#define INLINE static inline __attribute__((always_inline))

INLINE bool sched_submit(sched *x, const sp_job_desc *jobs, uint32_t n) {
    if (x->who == WHO_SPINDLE) return sp_jobs_submit(x->s, jobs, n, x->c) == SP_OK;
    return mp_submit(x->p, jobs, n, &x->pc);
}

INLINE void sched_wait(sched *x) {
    if (x->who == WHO_SPINDLE)
        sp_counter_wait(x->c, 0);
    else
        mp_counter_wait(&x->pc);
}

/* spindle: restart the status deltas (after a warm-up). */
static void sched_mark(sched *x) {
    if (x->who == WHO_SPINDLE) sp_jobs_status_get(x->s, &x->before);
}

/* spindle: status deltas since sched_open / sched_mark as counters, per `per` units. */
static void sched_report(sched *x, bench_state *st, double per) {
    if (x->who != WHO_SPINDLE || per <= 0) return;
    sp_jobs_status now;
    sp_jobs_status_get(x->s, &now);
    bench_counter(st, "stolen_per", (double)(now.jobs_stolen - x->before.jobs_stolen) / per, 0);
    bench_counter(st, "parks_per", (double)(now.parks - x->before.parks) / per, 0);
    bench_counter(st, "sleeps_per", (double)(now.sleeps - x->before.sleeps) / per, 0);
    bench_counter(st, "jobs_run_per", (double)(now.jobs_run - x->before.jobs_run) / per, 0);
}

typedef struct bench_arg {
    who who;
    bool pinned; /* handoff */
} bench_arg;

static void empty_job(void *arg) {
    (void)arg;
}

static sp_job_desc empty_batch[BATCH];

/* ---- empty, roundtrip ------------------------------------------------------------------- */

/* `rounds` times: submit `n` empty jobs in one call, wait for them. False if a submit failed. */
static __attribute__((noinline)) bool batches(sched *x, int64_t rounds, uint32_t n) {
    for (int64_t r = 0; r < rounds; r++) {
        if (!sched_submit(x, empty_batch, n)) return false;
        sched_wait(x);
    }
    return true;
}

static void run_batches(bench_state *st, who w, int64_t rounds, uint32_t n, const char *name) {
    sched x;
    if (!sched_open(&x, w, st)) return;
    bool good = batches(&x, rounds / 16 + 1, n); /* warm-up: wakes workers, fills caches */
    sched_mark(&x);
    uint64_t ns = 0;
    int64_t done = 0;
    while (bench_keep_running_batch(st, rounds * n)) {
        uint64_t t0 = sp_time_ns();
        good &= batches(&x, rounds, n);
        ns += sp_time_ns() - t0;
        done += rounds * n;
    }
    if (!good) bench_skip_with_error(st, "a submit failed");
    if (done) {
        bench_counter(st, name, (double)ns / (double)done, BENCH_COUNTER_DEFAULT);
        sched_report(&x, st, (double)done);
    }
    sched_close(&x);
}

static void run_empty(bench_state *st, const void *arg) {
    run_batches(st, ((const bench_arg *)arg)->who, cfg.empty_rounds, BATCH, "ns_per_job");
}

static void run_roundtrip(bench_state *st, const void *arg) {
    run_batches(st, ((const bench_arg *)arg)->who, cfg.roundtrips, 1, "ns");
}

/* ---- switch: the raw fiber switch ------------------------------------------------------- */

static sp_fiber *main_fiber;

static void echo(sp_fiber *self, void *arg) {
    (void)arg;
    for (;;) sp_fiber_switch(self, main_fiber);
}

static __attribute__((noinline)) void trips(sp_fiber *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) sp_fiber_switch(main_fiber, f);
}

static void run_switch(bench_state *st, const void *arg) {
    (void)arg;
    sp_fiber_pool *pool = NULL;
    main_fiber = sp_fiber_thread_enter();
    if (!main_fiber || sp_fiber_pool_create(&pool, 1, 64 * 1024) != SP_OK) {
        bench_skip_with_error(st, "fiber setup failed");
        sp_fiber_thread_leave(main_fiber);
        return;
    }
    sp_fiber *f = sp_fiber_acquire(pool, echo, NULL);
    trips(f, cfg.switch_warmup / 2);
    uint64_t ns = 0;
    int64_t done = 0;
    while (bench_keep_running_batch(st, cfg.switches)) {
        uint64_t t0 = sp_time_ns();
        trips(f, cfg.switches / 2);
        ns += sp_time_ns() - t0;
        done += cfg.switches;
    }
    sp_fiber_release(pool, f); /* suspended in echo, never resumed again */
    sp_fiber_pool_destroy(pool);
    sp_fiber_thread_leave(main_fiber);
    if (done) bench_counter(st, "ns", (double)ns / (double)done, BENCH_COUNTER_DEFAULT);
}

/* ---- handoff ---------------------------------------------------------------------------- */

/* spindle: to_a and to_b start at `rounds`; round i (1-based) brings each to rounds - i. */
typedef struct handoff {
    int64_t rounds;
    sp_counter *to_a, *to_b;
    /* mutexpool: whose turn it is (0 = A, 1 = B), one condition variable per side */
    pthread_mutex_t lock;
    pthread_cond_t cond[2];
    int turn;
    uint64_t ns; /* measured by A */
} handoff;

static void handoff_a(void *arg) {
    handoff *h = arg;
    uint64_t t0 = sp_time_ns();
    for (int64_t i = 1; i <= h->rounds; i++) {
        sp_counter_sub(h->to_b, 1);
        sp_counter_wait(h->to_a, h->rounds - i);
    }
    h->ns = sp_time_ns() - t0;
}

static void handoff_b(void *arg) {
    handoff *h = arg;
    for (int64_t i = 1; i <= h->rounds; i++) {
        sp_counter_wait(h->to_b, h->rounds - i);
        sp_counter_sub(h->to_a, 1);
    }
}

/* mutexpool: side `me` waits for its turn, then gives the turn to the other side. */
static void handoff_turns(handoff *h, int me) {
    pthread_mutex_lock(&h->lock);
    for (int64_t i = 0; i < h->rounds; i++) {
        while (h->turn != me) pthread_cond_wait(&h->cond[me], &h->lock);
        h->turn = !me;
        pthread_cond_signal(&h->cond[!me]);
    }
    pthread_mutex_unlock(&h->lock);
}

static void mp_handoff_a(void *arg) {
    handoff *h = arg;
    uint64_t t0 = sp_time_ns();
    handoff_turns(h, 0);
    h->ns = sp_time_ns() - t0;
}

static void mp_handoff_b(void *arg) {
    handoff_turns(arg, 1);
}

/* One ping-pong of `rounds` rounds; returns false if it could not be started. */
static bool handoff_once(sched *x, handoff *h, int64_t rounds, bool pinned) {
    h->rounds = rounds;
    h->ns = 0;
    if (x->who == WHO_SPINDLE) {
        sp_counter_add(h->to_a, rounds);
        sp_counter_add(h->to_b, rounds);
        sp_job_desc j[2] = {{.fn = handoff_a, .arg = h, .pinned = pinned, .worker = 1},
                            {.fn = handoff_b, .arg = h, .pinned = pinned, .worker = 1}};
        if (!sched_submit(x, j, 2)) return false;
    } else {
        h->turn = 0;
        sp_job_desc j[2] = {{.fn = mp_handoff_a, .arg = h}, {.fn = mp_handoff_b, .arg = h}};
        if (!sched_submit(x, j, 2)) return false;
    }
    sched_wait(x);
    return true;
}

static void run_handoff(bench_state *st, const void *varg) {
    const bench_arg *a = varg;
    sched x;
    if (!sched_open(&x, a->who, st)) return;
    handoff h = {0};
    pthread_mutex_init(&h.lock, NULL);
    pthread_cond_init(&h.cond[0], NULL);
    pthread_cond_init(&h.cond[1], NULL);
    if (a->who == WHO_SPINDLE) {
        h.to_a = sp_counter_create(x.s, "handoff_a");
        h.to_b = sp_counter_create(x.s, "handoff_b");
    }
    bool good = a->who != WHO_SPINDLE || (h.to_a && h.to_b);
    if (good) good = handoff_once(&x, &h, cfg.handoff_rounds / 16 + 1, a->pinned); /* warm-up */
    sched_mark(&x);
    uint64_t ns = 0;
    int64_t done = 0;
    while (bench_keep_running_batch(st, 2 * cfg.handoff_rounds)) {
        if (good) good = handoff_once(&x, &h, cfg.handoff_rounds, a->pinned);
        ns += h.ns;
        done += 2 * cfg.handoff_rounds;
    }
    if (!good) bench_skip_with_error(st, "handoff: setup or submit failed");
    if (good && done) {
        bench_counter(st, "ns", (double)ns / (double)done, BENCH_COUNTER_DEFAULT);
        sched_report(&x, st, (double)done);
    }
    if (a->who == WHO_SPINDLE) {
        sp_counter_destroy(h.to_a);
        sp_counter_destroy(h.to_b);
    }
    sched_close(&x);
    pthread_mutex_destroy(&h.lock);
    pthread_cond_destroy(&h.cond[0]);
    pthread_cond_destroy(&h.cond[1]);
}

/* ---- pfor ------------------------------------------------------------------------------- */

/* 64 dependent steps per element (multiply, add, xor-shift: no closed form), summed. */
static __attribute__((noinline)) uint64_t pfor_sum(uint64_t begin, uint64_t end) {
    uint64_t sum = 0;
    for (uint64_t i = begin; i < end; i++) {
        uint32_t v = (uint32_t)i;
        for (int k = 0; k < PFOR_STEPS; k++) {
            v = v * 0x9E3779B1u + (uint32_t)k;
            v ^= v >> 15;
        }
        sum += v;
    }
    return sum;
}

typedef struct pfor_state {
    atomic_ullong sum;
    uint64_t begin; /* mutexpool chunks: next chunk start, assigned in submit order */
} pfor_state;

static void pfor_range(void *arg, uint64_t begin, uint64_t end) {
    pfor_state *p = arg;
    atomic_fetch_add_explicit(&p->sum, pfor_sum(begin, end), memory_order_relaxed);
}

typedef struct pfor_chunk {
    pfor_state *p;
    uint64_t begin, end;
} pfor_chunk;

static void pfor_chunk_job(void *arg) {
    pfor_chunk *c = arg;
    pfor_range(c->p, c->begin, c->end);
}

/* The parallel loop over [0, n); returns its sum, or ~0 if a submit failed. */
static uint64_t pfor_parallel(sched *x, uint64_t n, pfor_chunk *chunks, sp_job_desc *jobs) {
    pfor_state p;
    atomic_init(&p.sum, 0);
    if (x->who == WHO_SPINDLE) {
        if (sp_parallel_for(x->s, 0, n, 0, pfor_range, &p) != SP_OK) return ~0ull;
        return atomic_load(&p.sum);
    }
    uint32_t k = (uint32_t)((n + PFOR_CHUNK - 1) / PFOR_CHUNK);
    for (uint32_t i = 0; i < k; i++) {
        uint64_t b = (uint64_t)i * PFOR_CHUNK;
        chunks[i] = (pfor_chunk){&p, b, b + PFOR_CHUNK < n ? b + PFOR_CHUNK : n};
        jobs[i] = (sp_job_desc){.fn = pfor_chunk_job, .arg = &chunks[i]};
    }
    if (!sched_submit(x, jobs, k)) return ~0ull;
    sched_wait(x);
    return atomic_load(&p.sum);
}

static void run_pfor(bench_state *st, const void *varg) {
    const bench_arg *a = varg;
    sched x;
    if (!sched_open(&x, a->who, st)) return;
    uint64_t n = cfg.pfor_n;
    size_t k = (size_t)((n + PFOR_CHUNK - 1) / PFOR_CHUNK);
    pfor_chunk *chunks = malloc(k * sizeof *chunks);
    sp_job_desc *jobs = malloc(k * sizeof *jobs);
    bool good = chunks && jobs;
    uint64_t serial_ns = 0, parallel_ns = 0;
    int64_t done = 0;
    while (good && bench_keep_running_batch(st, 1)) {
        for (int pass = 0; pass < 2; pass++) {
            uint64_t t0 = sp_time_ns();
            uint64_t want = pfor_sum(0, n);
            uint64_t t1 = sp_time_ns();
            uint64_t got = pfor_parallel(&x, n, chunks, jobs);
            uint64_t t2 = sp_time_ns();
            serial_ns += t1 - t0;
            parallel_ns += t2 - t1;
            good &= got == want;
        }
        done++;
    }
    if (!good) bench_skip_with_error(st, "pfor: the parallel sum differs, or setup failed");
    if (good && done && parallel_ns) {
        bench_counter(st, "speedup", (double)serial_ns / (double)parallel_ns, 0);
        bench_counter(st, "serial_ms", (double)serial_ns / 1e6 / (2.0 * (double)done), 0);
        bench_counter(st, "parallel_ms", (double)parallel_ns / 1e6 / (2.0 * (double)done), 0);
    }
    free(chunks);
    free(jobs);
    sched_close(&x);
}

/* ---- idle ------------------------------------------------------------------------------- */

static uint64_t process_cpu_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void run_idle(bench_state *st, const void *varg) {
    const bench_arg *a = varg;
    sched x;
    if (!sched_open(&x, a->who, st)) return;
    bool good = true;
    uint64_t cpu = 0, wall = 0;
    while (bench_keep_running_batch(st, 1)) {
        good &= batches(&x, 1, BATCH); /* every worker awake: the spin-down is measured too */
        uint64_t c0 = process_cpu_ns(), t0 = sp_time_ns();
        struct timespec d = {(time_t)(cfg.idle_ns / 1000000000u),
                             (long)(cfg.idle_ns % 1000000000u)};
        while (nanosleep(&d, &d) != 0) {
        }
        cpu += process_cpu_ns() - c0;
        wall += sp_time_ns() - t0;
    }
    if (!good) bench_skip_with_error(st, "a submit failed");
    if (wall) {
        bench_counter(st, "cpu_pct", 100.0 * (double)cpu / (double)wall, 0);
        bench_counter(st, "cpu_us", (double)cpu / 1e3, 0);
    }
    sched_close(&x);
}

/* ---- registration ----------------------------------------------------------------------- */

static uint32_t parse_workers(int *argc, char **argv) {
    const char *v = getenv("BENCH_JOBS_WORKERS");
    int out = 1;
    for (int i = 1; i < *argc; i++) {
        if (strncmp(argv[i], "--workers=", 10) == 0)
            v = argv[i] + 10;
        else
            argv[out++] = argv[i];
    }
    if (*argc > 0) {
        argv[out] = NULL;
        *argc = out;
    }
    if (!v || !v[0]) return 2;
    long n = strtol(v, NULL, 10);
    if (n < 1 || n > 64) {
        fprintf(stderr, "bench_jobs: workers must be 1..64, not '%s'\n", v);
        exit(1);
    }
    return (uint32_t)n;
}

int main(int argc, char **argv) {
    const char *env = getenv("BENCH_SMOKE");
    cfg.smoke = bench_take_flag(&argc, argv, "--smoke") || (env && env[0] && env[0] != '0');
    cfg.workers = parse_workers(&argc, argv);
    if (cfg.smoke) {
        cfg.empty_rounds = 16;
        cfg.roundtrips = 256;
        cfg.switches = 1 << 12;
        cfg.switch_warmup = 1 << 12;
        cfg.handoff_rounds = 1 << 10;
        cfg.pfor_n = 1u << 18;
        cfg.idle_ns = 50000000;
    }
    for (int i = 0; i < BATCH; i++) empty_batch[i] = (sp_job_desc){.fn = empty_job};

    typedef struct reg {
        const char *name;
        bench_fn fn;
        bool mutexpool; /* has a mutexpool row */
        bool pinned;
    } reg;
    const reg cases[] = {
        {"empty", run_empty, true, false},
        {"roundtrip", run_roundtrip, true, false},
        {"switch", run_switch, false, false},
        {"handoff", run_handoff, cfg.workers >= 2, true}, /* mutexpool: needs two threads */
        {"handoff_spread", run_handoff, false, false},
        {"pfor", run_pfor, true, false},
        {"idle", run_idle, true, false},
    };
    enum { NCASES = sizeof cases / sizeof cases[0] };
    static bench_arg args[NCASES][2];
    static char names[NCASES][2][80];
    char suffix[32] = "";
    if (cfg.workers != 2) snprintf(suffix, sizeof suffix, "/workers:%u", cfg.workers);
    /* WHO interleaved per case, so the figures compared sit close together in time. */
    for (int c = 0; c < NCASES; c++)
        for (int w = 0; w < (cases[c].mutexpool ? 2 : 1); w++) {
            args[c][w] = (bench_arg){(who)w, cases[c].pinned};
            snprintf(names[c][w], sizeof names[c][w], "jobs/%s/%s%s", cases[c].name, who_name[w],
                     suffix);
            bench_register(names[c][w], cases[c].fn, &args[c][w], 1);
        }
    return bench_main(argc, argv);
}
