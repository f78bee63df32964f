/* Fibers migrating between threads: workers share one queue of suspended fibers, and a worker
 * never resumes a fiber that last ran on its own thread, so every resume is a migration. Each
 * fiber checks, after every resume, that it runs on the thread that resumed it (OS thread id
 * and a thread-local read through a function that is not inlined). Swept over 2, 3 and 4
 * workers; runs under TSan and ASan. */
#include <string.h>

#include "fiber.h"
#include "sp_platform.h"
#include "test_support.h"

enum { FIBERS = 8, MAX_WORKERS = 4 };

typedef struct job {
    sp_fiber *fiber;
    sp_fiber *home;       /* the thread fiber of the worker that resumed it; set by that worker */
    uint64_t resumer_tid; /* that worker's OS thread id */
    int resumer_marker;   /* that worker's thread-local marker */
    uint64_t last_tid;    /* where the fiber last ran (read by workers under the queue lock) */
    int resumes, left;
    int wrong_thread, wrong_tls, migrations;
    bool finished;
} job;

typedef struct world {
    sp_mutex lock; /* queue, queued, finished */
    job *queue[FIBERS];
    int queued;
    int finished;
    sp_fiber_pool *pool;
} world;

static _Thread_local int tls_marker;

/* A fresh read of the calling thread's marker: never inlined, so its TLS address is computed
 * on the thread it runs on (fiber.h, migration rule). */
__attribute__((noinline)) static int marker_now(void) {
    __asm__ volatile("" ::: "memory");
    return tls_marker;
}

static void job_fn(sp_fiber *self, void *arg) {
    job *j = arg;
    while (j->left > 0) {
        uint64_t before = sp_thread_os_id();
        j->last_tid = before;
        j->left--;
        sp_fiber_switch(self, j->home); /* suspend; resumed by some other worker */
        uint64_t now = sp_thread_os_id();
        j->resumes++;
        j->migrations += now != before;
        j->wrong_thread += now != j->resumer_tid;
        j->wrong_tls += marker_now() != j->resumer_marker;
    }
    j->finished = true;
    for (;;) sp_fiber_switch(self, j->home);
}

/* Take a queued fiber that last ran elsewhere; NULL if none (yet). */
static job *queue_take(world *w, uint64_t me) {
    job *j = NULL;
    sp_mutex_lock(&w->lock);
    for (int i = 0; i < w->queued; i++) {
        if (w->queue[i]->last_tid != me) {
            j = w->queue[i];
            w->queue[i] = w->queue[--w->queued];
            break;
        }
    }
    sp_mutex_unlock(&w->lock);
    return j;
}

static void *worker_run(void *arg) {
    world *w = arg;
    sp_fiber *home = sp_fiber_thread_enter();
    uint64_t me = sp_thread_os_id();
    tls_marker = (int)(me & 0x7fffffff) | 1;
    for (;;) {
        sp_mutex_lock(&w->lock);
        bool all_done = w->finished == FIBERS;
        sp_mutex_unlock(&w->lock);
        if (all_done) break;
        job *j = queue_take(w, me);
        if (!j) {
            sp_thread_yield();
            continue;
        }
        j->home = home;
        j->resumer_tid = me;
        j->resumer_marker = tls_marker;
        sp_fiber_switch(home, j->fiber);
        /* j is suspended now: only here may it be published again. */
        sp_mutex_lock(&w->lock);
        if (j->finished) {
            sp_fiber_release(w->pool, j->fiber);
            w->finished++;
        } else {
            w->queue[w->queued++] = j;
        }
        sp_mutex_unlock(&w->lock);
    }
    sp_fiber_thread_leave(home);
    return NULL;
}

static void sweep(int workers, int switches) {
    static world w;
    static job jobs[FIBERS];
    memset(&w, 0, sizeof w);
    memset(jobs, 0, sizeof jobs);
    if (sp_fiber_pool_create(&w.pool, FIBERS, 128 * 1024) != SP_OK) {
        ok(0, "%d workers: create the pool", workers);
        return;
    }
    for (int i = 0; i < FIBERS; i++) {
        jobs[i].left = switches;
        jobs[i].fiber = sp_fiber_acquire(w.pool, job_fn, &jobs[i]);
        w.queue[w.queued++] = &jobs[i];
    }
    sp_thread t[MAX_WORKERS];
    int started = 0;
    for (int i = 0; i < workers; i++)
        if (sp_thread_start(&t[started], worker_run, &w, "sp-fiber") == SP_OK) started++;
    for (int i = 0; i < started; i++) sp_thread_join(t[i]);

    int resumes = 0, migrations = 0, wrong_thread = 0, wrong_tls = 0, finished = 0;
    for (int i = 0; i < FIBERS; i++) {
        resumes += jobs[i].resumes;
        migrations += jobs[i].migrations;
        wrong_thread += jobs[i].wrong_thread;
        wrong_tls += jobs[i].wrong_tls;
        finished += jobs[i].finished;
    }
    ok(started == workers && finished == FIBERS && resumes == FIBERS * switches,
       "%d workers: %d fibers finished after %d resumes each", workers, FIBERS, switches);
    ok(migrations == resumes && wrong_thread == 0 && wrong_tls == 0,
       "%d workers: every resume moved the fiber (%d of %d), and it ran on its resumer's thread "
       "(wrong thread %d, wrong thread-local %d)",
       workers, migrations, resumes, wrong_thread, wrong_tls);
    is_int(sp_fiber_pool_in_use(w.pool), 0, "%d workers: every fiber released", workers);
    sp_fiber_pool_destroy(w.pool);
}

int main(void) {
    plan(9);
    int switches = (int)ts_scaled(2000, 10);
    const int counts[] = {2, 3, 4};
    for (size_t i = 0; i < 3; i++) sweep(counts[i], switches);
    return done();
}
