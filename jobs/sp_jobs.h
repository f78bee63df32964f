/* spindle job scheduler: workers, fibers, work stealing, priorities, counters, pinned jobs and
 * parallel-for.
 *
 * Jobs are small functions. A job that must wait for others parks its fiber on a counter and
 * its worker runs something else; the fiber resumes, possibly on another worker, once the
 * counter reaches the target. Each worker keeps a work-stealing deque per priority, a queue of
 * jobs pinned to it, and a cache of job records; threads that are not workers submit through
 * wait-free injection queues (liburcu wfcqueue).
 *
 * Threads. sp_jobs_create starts `workers` background threads (default: one per core). The
 * thread that called sp_jobs_create is the scheduler's main thread, worker 0: it runs jobs
 * only while it waits (sp_counter_wait, sp_parallel_for, sp_jobs_shutdown), and jobs pinned to
 * worker 0 run there. Background workers are 1..workers (workers = 0 means the default). With
 * no_workers set, no thread is started and every job runs on the main thread, in its waits,
 * in a deterministic order (a debugging mode). Other threads may submit, signal and wait (blocking,
 * without running jobs).
 *
 * Order: sp_jobs_create; any number of submits and waits; sp_jobs_shutdown (runs every pending
 * job to completion, joins the threads; later submits get SP_ERR_SHUTDOWN); sp_jobs_destroy.
 * A thread belongs to at most one scheduler at a time.
 *
 * Counters count down. Submitting a batch of n jobs with a counter adds n to it and each job
 * subtracts 1 once it has returned; sp_counter_sub signals by hand. A wait for `target`
 * completes once the value is <= target (usually 0). Counters can be reused for batch after
 * batch. A batch of jobs that share a priority and are not pinned runs as pieces that split
 * lazily (a few records and steals per batch, not one per job); a piece takes its finished
 * jobs off the counter when it ends or when one of its jobs waits, so the value may lag behind
 * jobs that have returned while their piece still runs. Between its jobs a piece gives way to
 * a higher-priority job that became ready on its worker (its rest is queued again). A piece
 * holds its jobs until its worker runs them (or another worker splits them off): while that
 * worker is descheduled, other workers take lower-priority jobs rather than wait. Wait with
 * sp_counter_wait, never by polling sp_counter_value in a job (a sibling the poll waits for may be
 * queued behind it).
 *
 * Jobs wait for each other only through counters. A job that blocks its thread on something
 * another job must do (a mutex, a condition variable, a spin on a flag) may deadlock.
 *
 * Where a resumed job runs: a parked job made ready by a job running on worker W runs next on
 * W (it is not stolen: a handoff stays on a warm cache), as soon as W's current job ends or
 * waits, after any job of a higher priority waiting for W; made ready from elsewhere, it is
 * queued like a new job.
 *
 * Concurrency:
 *   sp_jobs_submit, sp_jobs_submit_after, sp_parallel_for,
 *   sp_counter_add, sp_counter_sub, sp_counter_value, sp_counter_wait,
 *   sp_jobs_worker_id, sp_jobs_status_get,
 *   sp_jobs_trim                                  any thread, any time between create and
 *                                                 shutdown (submits after it: SP_ERR_SHUTDOWN)
 *   sp_counter_create / sp_counter_destroy        any thread; destroy only once nothing waits on
 *                                                 the counter and no job holds it
 *   sp_jobs_create, sp_jobs_shutdown,             the main thread, outside jobs
 *   sp_jobs_destroy
 *
 * Migration rule (a job may resume on another worker after any call that "may suspend"): a job
 * may keep in registers and locals anything that is its own (arguments, pointers to its data,
 * the scheduler, counters), but not the address of a thread-local variable, errno, a cached
 * worker id, or a thread-cache pointer taken before the suspending call: read them again
 * after it (sp_jobs_worker_id is safe to call again; it is never hoisted across a suspension).
 * Compilers keep TLS addresses in callee-saved registers across calls, so this applies to
 * plain `_Thread_local` accesses in the job's own function. Exceptions: a pinned job always
 * resumes on its own worker, and so does a job that was run on the main thread's own stack
 * (only when every fiber is in use, see sp_counter_wait).
 */
#ifndef SP_JOBS_H
#define SP_JOBS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_log.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sp_jobs sp_jobs;
typedef struct sp_counter sp_counter;

/* Returned by sp_jobs_worker_id on a thread that is not one of the scheduler's. */
#define SP_JOBS_NOT_A_WORKER UINT32_MAX

typedef enum sp_job_priority {
    SP_PRIORITY_NORMAL = 0, /* the default (zero) */
    SP_PRIORITY_HIGH = 1,   /* taken before any normal or low job, local or stolen */
    SP_PRIORITY_LOW = 2,    /* taken only when no high or normal job is to be found */
} sp_job_priority;

typedef void (*sp_job_fn)(void *arg);

typedef struct sp_job_desc {
    sp_job_fn fn;             /* required */
    void *arg;                /* passed to fn */
    const char *name;         /* optional, for hooks and messages; must outlive the job */
    sp_job_priority priority; /* 0 = normal */
    bool pinned;              /* run only on `worker` (0 = the main thread, 1..workers) */
    uint32_t worker;
} sp_job_desc;

/* Profiling hooks: each may be NULL; each is called on the thread concerned, with the worker
 * id, and must not submit, wait or block (a submit, a parallel_for with work in its range, a
 * counter wait that is not already satisfied, and a shutdown or destroy of the scheduler from
 * one are misuse: SP_ERR_INVALID_ARG, reported, nothing done; nor may a hook use another
 * scheduler or create one: not checked). The range sp_parallel_for runs on its
 * caller is not a job of its own (no job_begin): a wait in its body parks and resumes the
 * calling job (none for a thread outside jobs); the pieces split off are jobs named
 * "sp_parallel_for". `name` may be NULL; for a job of a batch it
 * is that job's own name (park and resume too). */
typedef struct sp_jobs_hooks {
    void *user;
    void (*job_begin)(void *user, uint32_t worker, const char *name);  /* first run */
    void (*job_end)(void *user, uint32_t worker, const char *name);    /* fn returned */
    void (*job_park)(void *user, uint32_t worker, const char *name);   /* waits, fiber parked */
    void (*job_resume)(void *user, uint32_t worker, const char *name); /* parked job runs again */
    void (*worker_sleep)(void *user, uint32_t worker);                 /* idle: futex sleep */
    void (*worker_wake)(void *user, uint32_t worker);
    void (*fiber_switch)(void *user, uint32_t worker); /* any scheduler fiber switch */
    /* On each background worker thread: before its first job, and after its last one (at
     * shutdown, before the thread exits). Not called for the main thread (worker 0). Unlike
     * the others, these two may block and allocate. */
    void (*thread_start)(void *user, uint32_t worker);
    void (*thread_stop)(void *user, uint32_t worker);
} sp_jobs_hooks;

/* Zero means the default for every field. */
typedef struct sp_jobs_desc {
    uint32_t workers;     /* background worker threads; 0 = default (CPU count), see no_workers */
    bool no_workers;      /* true: start no thread; every job runs on the main thread in its
                             waits (deterministic order) */
    bool pin_workers;     /* true: background worker k (1..workers) runs only on CPU
                             sp_cpu_nth(k), the k-th (mod their count, from 0) of the CPUs the
                             creating thread may run on, from its first instruction: one
                             worker per CPU, the lowest left to the main thread while workers
                             < CPUs (with as many workers as CPUs, the default, the last
                             shares it). The main thread is not pinned: to keep it there, pin
                             it after create (sp_thread_pin(sp_thread_self(), sp_cpu_nth(0));
                             where the mask cannot be read, sp_cpu_nth gives SP_CPU_ANY and the
                             pin changes nothing), not before, which would leave every worker
                             that one CPU. A pinned
                             start that fails (a CPU the OS refuses, or the mask unreadable) is
                             logged (warning) and the worker started unpinned; if that fails
                             too, create fails. sp_jobs_status.workers_pinned counts the
                             pinned */
    uint32_t fibers;      /* fibers made at create (default 128) */
    uint32_t fibers_max;  /* the pool doubles on demand up to this (default 32 * fibers; set it
                             to fibers for a fixed pool): bounds the jobs parked at once */
    size_t fiber_stack;   /* bytes per fiber stack (default 256 KiB, at least 16 KiB: the
                             library's own paths on it, such as a misuse report, need some
                             of it; committed as touched),
                             a guard page below each: job code with frames above a page must
                             be built with -fstack-clash-protection for an overflow to fault
                             there rather than write into the next stack */
    uint32_t max_jobs;    /* job records in flight (default 65536): a job submitted alone,
                             pinned or in a mixed-priority batch takes one until it returns;
                             a batch of unpinned same-priority jobs takes one per piece it is
                             split into; a parallel_for one per piece split off */
    uint32_t deque_size;  /* per worker and priority, a power of two (default 4096); more
                             spill into the injection queue. Committed at create: (workers + 1)
                             x 3 priorities x deque_size x 8 bytes (2^24 with 63 workers is
                             24 GiB) */
    uint32_t spin_ns;     /* idle spin before a futex sleep (default 50000) */
    uint32_t watchdog_ms; /* debug builds: report a wait that nothing can complete after this
                             long without progress (default 2000; UINT32_MAX disables) */
    sp_jobs_hooks hooks;
} sp_jobs_desc;

typedef struct sp_jobs_status {
    uint32_t workers;        /* background threads (not counting the main thread) */
    uint32_t workers_pinned; /* of them, pinned to a CPU (pin_workers) */
    uint64_t jobs_submitted; /* since create; parallel_for pieces split off count as jobs */
    uint64_t jobs_run;       /* finished (each with a job_begin and a job_end hook call) */
    uint64_t jobs_stolen;
    uint64_t parks;             /* jobs' waits that parked a fiber (not a thread's own waits
                                   outside jobs, nor a parallel_for body's there) */
    uint32_t fibers_in_use;     /* acquired from the pool (running, parked or cached by a worker) */
    uint32_t fibers_total;      /* made so far: fibers, more once the pool grew */
    uint32_t fibers_spare;      /* of fibers_in_use, suspended on the scheduler's spare list for
                                   the next wait (each worker keeps up to 4 more of its own) */
    uint32_t fiber_stacks_used; /* fibers whose stacks may hold pages: in use, or free and run
                                   since made or given back by sp_jobs_trim */
    uint32_t fiber_exhaustions; /* waits that found no free fiber and ran jobs on their stack */
    uint64_t sleeps;            /* futex sleeps of idle workers */
} sp_jobs_status;

/* Create a scheduler; the calling thread becomes its main thread (worker 0). Main thread only.
 * Cost: thread starts, fiber pool reservation, job records. Returns SP_OK with *out set;
 * SP_ERR_INVALID_ARG (misuse, logged: NULL out, deque_size not a power of two or above 2^24,
 * more than 63 workers, fewer fibers than workers + 2, fibers_max below fibers, fiber_stack
 * below 16 KiB or above 1 GiB), SP_ERR_LIMIT
 * (the thread already belongs to a scheduler), SP_ERR_NOMEM (also for a max_jobs too large to
 * allocate), SP_ERR_OS (a thread or the fiber pool could not be made; whatever started is
 * stopped again). Address space for fibers_max stacks is reserved at create (1 GiB with the
 * defaults: 4,096 of 256 KiB, nothing committed until the pool grows into them). Where
 * fibers_max was left 0 and an address-space limit (RLIMIT_AS) is set, create halves it until
 * the reservation takes at most half of the address space the limit leaves (the threads, the
 * caller and the stacks' own pages need the rest), and further while the OS refuses, down to a
 * fixed pool of `fibers` (each refusal logged). */
sp_result sp_jobs_create(sp_jobs **out, const sp_jobs_desc *desc);

/* Run every pending job to completion (waiting, helping as the main thread), stop and join
 * the workers. Afterwards submits return SP_ERR_SHUTDOWN; sp_jobs_status_get still works
 * until destroy. Jobs that can never run (a batch deferred on, or a fiber parked on, a counter
 * nothing will reach once all else is done, 100 ms without progress) are reported one by one
 * with SP_ERR_STALLED naming job and counter, and abandoned: shutdown then returns
 * SP_ERR_STALLED instead of SP_OK. (A job whose wait holds no fiber of its own - it waits on
 * a thread's own stack, or runs other jobs in its wait because every fiber is in use - cannot
 * be abandoned: its wait returns SP_ERR_STALLED and the job runs on; reported the same way.)
 * Threads blocked in sp_counter_wait outside the scheduler stay blocked. Main thread only, outside
 * jobs (else misuse, SP_ERR_INVALID_ARG; NULL s too, and the runtime's own scheduler,
 * sp_scheduler(): sp_shutdown stops it). A second call does nothing and returns
 * SP_ERR_SHUTDOWN. */
sp_result sp_jobs_shutdown(sp_jobs *s);

/* Shut down if not done (stalled jobs reported and abandoned as there), then free everything,
 * its counters included (a counter or scheduler used after this is undefined: the scheduler's
 * checks for destroyed counters need the scheduler); NULL is ignored. Main thread only, outside
 * jobs, not the runtime's own scheduler: else misuse (SP_ERR_INVALID_ARG, reported; nothing freed).
 */
void sp_jobs_destroy(sp_jobs *s);

/* Submit `count` jobs (the descs are copied; the array may be reused at once). If `counter`
 * is not NULL it is raised by count now and lowered as the jobs return (see the top).
 * All-or-nothing: on error no job was submitted and the counter is unchanged. Any thread,
 * jobs included; never suspends. Cost: jobs sharing a priority and not pinned: one malloc'd
 * copy of the descs and one record, pushed once (a worker's deque; other threads: the
 * wfcqueue); otherwise a record and a push per job. Then one fence, and a futex wake per
 * sleeping worker needed. Out of records, it first asks the workers for the ones they cache
 * and yields for up to 10 ms before SP_ERR_LIMIT (up to 1 s while enough records are free
 * but cached by workers that have not run yet). Errors: SP_ERR_SHUTDOWN (after shutdown
 * began, from a thread that is not running a job), SP_ERR_LIMIT (out of job records, logged),
 * SP_ERR_NOMEM (the copy, logged), SP_ERR_INVALID_ARG (misuse: NULL s, jobs with count > 0, NULL
 * fn, a pinned worker out of range, a destroyed counter or one of another scheduler, a counter
 * that count would raise past SP_COUNTER_MAX). count 0 is SP_OK and does nothing. */
sp_result sp_jobs_submit(sp_jobs *s, const sp_job_desc *jobs, uint32_t count, sp_counter *counter);

/* As sp_jobs_submit, but the jobs start only once `after` reaches `after_target` (at once if
 * it already has). `counter` is raised now. Graphs built this way cannot deadlock through
 * their edges: a batch can only wait on a counter that already exists. Misuse as for
 * sp_jobs_submit, and also a NULL or destroyed `after`, and `after` equal to `counter` (the
 * batch would wait on itself) (SP_ERR_INVALID_ARG, nothing submitted). */
sp_result sp_jobs_submit_after(sp_jobs *s, sp_counter *after, int64_t after_target,
                               const sp_job_desc *jobs, uint32_t count, sp_counter *counter);

/* Call fn(arg, b, e) over disjoint subranges covering [begin, end), in parallel, and return
 * when all are done. Splitting is adaptive (lazy binary splitting): a piece splits off half of
 * its remaining range only while no split-off work is waiting to be stolen, never below
 * `grain` elements (0 = automatic). May suspend the caller (see sp_counter_wait); nests inside
 * jobs and inside other parallel_for calls. begin >= end is an empty range (SP_OK, no call).
 * Out of job records, the caller runs what it cannot split off: the range is always covered.
 * Returns SP_OK; SP_ERR_SHUTDOWN (after shutdown began, outside jobs), SP_ERR_NOMEM (no
 * counter), SP_ERR_INVALID_ARG (misuse: NULL s or fn). */
typedef void (*sp_range_fn)(void *arg, uint64_t begin, uint64_t end);
sp_result sp_parallel_for(sp_jobs *s, uint64_t begin, uint64_t end, uint64_t grain, sp_range_fn fn,
                          void *arg);

/* The calling thread's worker id: 0 for the main thread, 1..workers for background workers,
 * SP_JOBS_NOT_A_WORKER elsewhere. Inside a job: the worker running it now (it changes across
 * suspensions; call again after them). Cost: a non-inlined thread-local read. */
uint32_t sp_jobs_worker_id(void);

/* Whether the calling thread is running a job now (in the job's function or anything it
 * calls; the main thread too while it runs jobs in a wait). For calls that must not come from
 * a job. Cost: a non-inlined thread-local read. */
bool sp_jobs_in_job(void);

/* Figures since create. Any thread; each field is read atomically, the set is not a snapshot. */
void sp_jobs_status_get(sp_jobs *s, sp_jobs_status *out);

/* Give back the memory of fibers no wait has needed lately: of the spare fibers the scheduler
 * keeps for the next job that parks (every job that parked left one behind once it resumed:
 * a burst of waits leaves as many), those the fewest present since the previous call never
 * used (none on the first call) go back to the pool, and the stack pages of at most `max`
 * free fibers go back to the OS (their stacks fault in afresh if the pool hands them out
 * again). Each worker's own few spares (at most 4) stay. Returns the stacks given back. The
 * runtime calls it between frames (sp_runtime.h); call it yourself after a burst of waits
 * (loading) when not using the runtime. Any thread. Cost: the spare list's lock for
 * O(spares given), then the pool's lock twice and one madvise per stack (at most max, with
 * the lock released: a worker that needs a fresh fiber meanwhile waits for those). A purge
 * the OS refuses (mlockall) is reported once and ends trimming. */
uint32_t sp_jobs_trim(sp_jobs *s, uint32_t max);

/* Jobs finished since create (sp_jobs_status.jobs_run alone). Any thread; cost: O(workers)
 * atomic loads, no lock. NULL s: misuse (SP_ERR_INVALID_ARG, reported), 0. */
uint64_t sp_jobs_run_count(sp_jobs *s);

/* Whether nothing was live at one moment during the call: no job, batch piece, parked job or
 * deferred batch submitted and not yet finished (job records taken and returned balance; the
 * counts are read in the order that makes a balance mean it). A job still running makes it
 * false. Any thread; cost: O(workers) atomic loads. Use it where jobs must not overlap a step
 * (the runtime's between-frames compaction), not to wait (poll nothing in a job). NULL s:
 * misuse (SP_ERR_INVALID_ARG, reported), false. */
bool sp_jobs_idle(sp_jobs *s);

/* A counter at 0, named for messages (the name must outlive the counter; NULL allowed).
 * Any thread. Returns NULL when out of memory or after shutdown. */
sp_counter *sp_counter_create(sp_jobs *s, const char *name);

/* Free a counter (its memory is recycled; sp_jobs_destroy frees it). Misuse, reported and
 * ignored (counter kept): a wait or a deferred batch on it, or a value above 0 before
 * shutdown (jobs may still lower it), or a counter the runtime owns (its frame counter)
 * (SP_ERR_INVALID_ARG); destroyed twice (SP_ERR_DOUBLE_FREE). After shutdown any counter
 * without waiters may be destroyed. NULL is ignored. Any thread; takes the scheduler's
 * counter lock.
 * Every call taking a counter reports a destroyed one as misuse and leaves it unchanged; this
 * is best-effort: freed counters are handed out again first-in first-out (a destroyed counter
 * after every counter that was free before it), and once its memory is reused a stale pointer
 * is a live counter again (the new one). */
void sp_counter_destroy(sp_counter *c);

/* The most a counter holds: a raise past it (sp_counter_add, or a submit's) is misuse. */
#define SP_COUNTER_MAX ((int64_t)1 << 62)

/* Raise by n (work the caller will signal later). Any thread, never suspends. Misuse: a
 * destroyed counter, a negative n, a raise past SP_COUNTER_MAX (SP_ERR_INVALID_ARG, reported;
 * no change). */
void sp_counter_add(sp_counter *c, int64_t n);

/* Lower by n and resume the waits and start the deferred batches this satisfies. Any thread,
 * never suspends. Cost: one atomic; when something waits, an exchange that takes the wait
 * list and one compare-exchange that puts back the waiters not yet satisfied. The value may go
 * below zero (a signal before its raise), not below -SP_COUNTER_MAX. Misuse: a destroyed
 * counter, a negative n or one above SP_COUNTER_MAX, a lowering past -SP_COUNTER_MAX
 * (SP_ERR_INVALID_ARG, reported; no change, nothing woken). */
void sp_counter_sub(sp_counter *c, int64_t n);

/* The current value (a snapshot). Any thread. NULL: 0. Misuse: a destroyed counter
 * (SP_ERR_INVALID_ARG, reported; returns 0). */
int64_t sp_counter_value(const sp_counter *c);

/* Return once the counter's value is <= target. Inside a job: parks the job's fiber and the
 * worker runs other jobs; the job may continue on another worker (see the migration rule).
 * If every fiber is in use the pool grows (doubling, up to sp_jobs_desc.fibers_max); when it
 * cannot, the wait instead runs other jobs on the waiting job's own stack until the counter
 * is reached (logged once per scheduler, counted in fiber_exhaustions); with
 * less than a quarter of that stack (or 32 KiB) left it starts no more jobs there, only
 * resumes parked ones and waits (SP_ERR_LIMIT, logged once): a tree of waits deeper than the
 * fibers can hold then waits for fibers to come free, and if no job finishes anywhere for a
 * second that is reported as SP_ERR_STALLED (once; the wait goes on).
 * On the main thread outside jobs: runs jobs until the counter is reached, then sleeps on a
 * futex. On other threads: sleeps on a futex. Returns SP_OK; SP_ERR_STALLED when shutdown
 * gave up on the wait (it can never complete, and with every fiber in use the job waited on a
 * thread's own stack or without a fiber, so it cannot be abandoned: it runs on instead);
 * misuse:
 * SP_ERR_INVALID_ARG
 * (NULL, or a destroyed counter: returns at once), SP_ERR_SHUTDOWN (the counter is not
 * reached and the scheduler is shut down: nothing can reach it any more).
 * Debug builds: a wait that nothing can complete (no job running or runnable, no progress for
 * watchdog_ms) is reported with SP_ERR_STALLED naming the counter; the wait goes on. */
sp_result sp_counter_wait(sp_counter *c, int64_t target);

#ifdef __cplusplus
}
#endif

#endif
