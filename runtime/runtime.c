/* The runtime's life: sp_init starts the subsystems in a fixed order over one reservation,
 * sp_shutdown stops them in reverse; regions, the persistent region, thread attach/detach,
 * and the QSBR plumbing (worker hooks, sp_retire, the reclaimer thread). */
#include "handle_internal.h" /* heap_busy: the caller is compacting the handle heap */
#include "jobs_internal.h"
#include "runtime_internal.h"
#include "tcache_heap.h" /* tc.ready: whether the thread caches are up */

#include <stdlib.h>
#include <string.h>
#include <threads.h>
#include <urcu/urcu-qsbr.h>

#if SP_TSAN
#include <sanitizer/tsan_interface.h>
/* liburcu 0.13 is not instrumented: tell TSan that a grace period orders every access a
 * thread made before its quiescent state before the reclaimer's frees. */
#define QSBR_RELEASE() __tsan_release(&sp_rt.reclaim_seq)
#define QSBR_ACQUIRE() __tsan_acquire(&sp_rt.reclaim_seq)
#else
#define QSBR_RELEASE() ((void)0)
#define QSBR_ACQUIRE() ((void)0)
#endif

runtime sp_rt;
sp_runtime_globals sp_runtime_g;

/* Registered with QSBR (workers, the main thread, attached threads). Read only by hooks and
 * calls that run on the thread itself and never across a fiber switch. */
static _Thread_local bool tls_qsbr;
static _Thread_local bool tls_attached;
_Thread_local bool rt_main;
static _Thread_local bool tls_offline; /* an attached thread between sp_thread_offline/_online */
static _Thread_local uint64_t tls_tidy_epoch; /* the last frame end this thread tidied after */
static _Thread_local bool tls_own_cache;      /* a runtime thread with a cache of its own */

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)
#define REGION_ALIGN (2 * MiB) /* regions start on huge-page boundaries */

static const char *const region_names[SP_REGION_COUNT] = {"none", "heap", "frame", "handle",
                                                          "persistent"};

bool rt_is_up(const char *call) {
    if (SP_LIKELY(rt_up())) return true;
    sp_log(SP_LOG_ERROR, SP_ERR_SHUTDOWN, call, NULL, "the runtime is not initialised");
    return false;
}

sp_result rt_main_only(const char *call) {
    if (!rt_is_up(call)) return SP_ERR_SHUTDOWN;
    if (SP_LIKELY(rt_main && !sp_jobs_in_job())) return SP_OK;
    sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, call, NULL, "%s",
           rt_main ? "called from a job: the main thread's frame calls come from outside jobs"
                   : "must be called on the main thread (the one that called sp_init)");
    return SP_ERR_INVALID_ARG;
}

sp_result rt_frame_loop_only(const char *call) {
    sp_result r = rt_main_only(call);
    if (r != SP_OK) return r;
    /* A relocation callback of the main thread's own sp_handle_compact call between frames is
     * not in_between, but blocks are moving under it all the same. */
    bool compacting = sp_rt.handles && heap_busy(sp_rt.handles);
    if (SP_LIKELY(!sp_rt.in_between && !compacting)) return SP_OK;
    sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, call, NULL, "%s",
           sp_rt.in_between
               ? "called from sp_frame_end's between-frames step (a work or a relocation callback)"
               : "called from a relocation callback of a handle-heap compaction");
    return SP_ERR_INVALID_ARG;
}

/* ---- the runtime threads' own caches --------------------------------------------------- */

/* A cache for the calling runtime thread, counted in own_caches before it exists (see
 * runtime.own_caches), then the attempt in own_attached. Without memory for one the thread
 * shares the fallback cache. */
static sp_result own_cache_attach(void) {
    atomic_fetch_add(&sp_rt.own_caches, 1);
    sp_result r = sp_tcache_thread_attach();
    if (r == SP_OK)
        tls_own_cache = true;
    else
        atomic_fetch_sub(&sp_rt.own_caches, 1);
    atomic_fetch_add(&sp_rt.own_attached, 1);
    return r;
}

static void own_cache_detach(void) {
    if (!tls_own_cache) return;
    sp_tcache_thread_detach();
    tls_own_cache = false;
    atomic_fetch_sub(&sp_rt.own_caches, 1);
}

/* ---- QSBR ------------------------------------------------------------------------------ */

void rt_quiescent(void) {
    if (!tls_qsbr) return;
    QSBR_RELEASE();
    urcu_qsbr_quiescent_state();
}

static void qsbr_offline(void) {
    if (!tls_qsbr) return;
    QSBR_RELEASE();
    urcu_qsbr_thread_offline();
}

static void qsbr_online(void) {
    if (tls_qsbr) urcu_qsbr_thread_online();
}

static void qsbr_register(void) {
    urcu_qsbr_register_thread();
    tls_qsbr = true;
}

static void qsbr_unregister(void) {
    if (!tls_qsbr) return;
    QSBR_RELEASE();
    urcu_qsbr_unregister_thread();
    tls_qsbr = false;
}

/* Free everything retired before the grace period that just ended. */
static void reclaim_batch(void) {
    retired *list = atomic_exchange(&sp_rt.retire_list, NULL);
    if (!list) return;
    urcu_qsbr_synchronize_rcu();
    QSBR_ACQUIRE();
    for (retired *r = list, *next; r; r = next) {
        next = r->next;
        r->free_fn(r->p);
        free(r);
    }
}

static void *reclaimer_main(void *arg) {
    (void)arg;
    own_cache_attach(); /* what it frees may have been retired from any thread's cache */
    for (;;) {
        uint32_t seq = atomic_load(&sp_rt.reclaim_seq);
        bool stop = atomic_load(&sp_rt.reclaim_stop);
        reclaim_batch();
        if (stop) break; /* the last batch ran after stop was seen */
        if (!atomic_load(&sp_rt.retire_list)) sp_futex_wait((uint32_t *)&sp_rt.reclaim_seq, seq, 0);
    }
    own_cache_detach();
    return NULL;
}

static void reclaimer_wake(void) {
    atomic_fetch_add(&sp_rt.reclaim_seq, 1);
    sp_futex_wake((uint32_t *)&sp_rt.reclaim_seq, 1);
}

void rt_reclaim_kick(void) {
    if (atomic_load(&sp_rt.retire_list)) reclaimer_wake();
}

sp_result sp_retire(void *p, void (*free_fn)(void *)) {
    if (!rt_is_up("sp_retire")) return SP_ERR_SHUTDOWN;
    if (!free_fn) return sp_misuse(SP_ERR_INVALID_ARG, "sp_retire", p, "free_fn is NULL");
    retired *r = malloc(sizeof *r);
    if (!r) return SP_ERR_NOMEM;
    r->p = p;
    r->free_fn = free_fn;
    r->next = atomic_load(&sp_rt.retire_list);
    while (!atomic_compare_exchange_weak(&sp_rt.retire_list, &r->next, r)) {
    }
    atomic_fetch_add_explicit(&sp_rt.retire_count, 1, memory_order_relaxed);
    return SP_OK;
}

/* The handle heap's retire hook; it runs under the heap's lock, so it must never wait for a
 * grace period (an online thread blocked on that lock would never pass a quiescent state).
 * Without memory for the record, the old table is kept for good (logged): tables grow by
 * doubling, so what is kept stays below the live table's size. */
static void handle_retire(void *user, void *old, void (*free_fn)(void *)) {
    (void)user;
    if (sp_retire(old, free_fn) != SP_OK)
        sp_log(SP_LOG_WARN, SP_ERR_NOMEM, "sp_retire", old,
               "no memory to retire an old handle table: kept until the process ends");
}

/* ---- scheduler hooks: the desc's own, plus the runtime's QSBR duties --------------------- */

#define USER_HOOK(name, ...)                                                                       \
    do {                                                                                           \
        if (sp_rt.user_hooks.name) sp_rt.user_hooks.name(sp_rt.user_hooks.user, __VA_ARGS__);      \
    } while (0)

static void hook_thread_start(void *user, uint32_t index) {
    (void)user;
    own_cache_attach();
    qsbr_register();
    USER_HOOK(thread_start, index);
}
static void hook_thread_stop(void *user, uint32_t index) {
    (void)user;
    USER_HOOK(thread_stop, index);
    own_cache_detach();
    qsbr_unregister();
}
static void hook_job_begin(void *user, uint32_t index, const char *name) {
    (void)user;
    USER_HOOK(job_begin, index, name);
}
/* The main thread (worker 0) reports its quiescent states in sp_frame_end only, not after the
 * jobs it runs in a wait nor while it sleeps there: it may hold an RCU-protected pointer
 * across its own waits within a frame. Staying online in a wait only delays reclamation
 * (the reclaimer's grace period), which nothing in a frame waits for. */
static void hook_job_end(void *user, uint32_t index, const char *name) {
    (void)user;
    USER_HOOK(job_end, index, name);
    if (!rt_main) rt_quiescent();
}
static void hook_job_park(void *user, uint32_t index, const char *name) {
    (void)user;
    USER_HOOK(job_park, index, name);
    if (!rt_main) rt_quiescent();
}
static void hook_job_resume(void *user, uint32_t index, const char *name) {
    (void)user;
    USER_HOOK(job_resume, index, name);
}
static void hook_worker_sleep(void *user, uint32_t index) {
    (void)user;
    USER_HOOK(worker_sleep, index);
    /* Going idle after a frame ended: a good moment to collect this cache's inboxes and give
     * surplus spans back (sp_tcache_tidy, once per frame at most; the main thread does it in
     * sp_frame_end, not when it sleeps in a wait, so its frame's trimmed_bytes is all it gave). */
    uint64_t epoch = atomic_load_explicit(&sp_rt.tidy_epoch, memory_order_relaxed);
    if (!rt_main && tls_tidy_epoch != epoch) {
        tls_tidy_epoch = epoch;
        sp_tcache_tidy();
    }
    if (!rt_main) qsbr_offline(); /* the main thread stays online (see hook_job_end) */
}
static void hook_worker_wake(void *user, uint32_t index) {
    (void)user;
    if (!rt_main) qsbr_online();
    USER_HOOK(worker_wake, index);
}
static void hook_fiber_switch(void *user, uint32_t index) {
    (void)user;
    USER_HOOK(fiber_switch, index);
}

/* ---- the desc -------------------------------------------------------------------------- */

static size_t clamp_size(uint64_t v, size_t lo, size_t hi) {
    return v < lo ? lo : v > hi ? hi : (size_t)v;
}

static sp_result desc_fill(const sp_desc *in, sp_desc *d) {
    static const sp_desc zero;
    *d = in ? *in : zero;
    if (d->canary_begin || d->canary_end)
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_init", in,
                         "sp_desc canaries are not zero: zero-initialise the desc "
                         "(sp_desc d = {0}; or a designated initialiser)");
    if (d->frame_buffers > SP_FRAME_MAX_BUFFERS)
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_init", in, "frame_buffers %u is above %d",
                         d->frame_buffers, SP_FRAME_MAX_BUFFERS);
    /* With one buffer a frame's data would be reclaimed at its own sp_frame_end: the frame
     * loop promises it lives through the next frame at least. */
    if (d->frame_buffers == 1)
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_init", in,
                         "frame_buffers 1: at least 2 (one buffer is reclaimed at the end of "
                         "its own frame)");
    const size_t max = (size_t)1 << 46; /* 64 TiB a region: sums and roundings cannot wrap */
    if (d->heap_size > max || d->frame_size > max || d->handle_size > max ||
        d->persistent_size > max)
        return sp_misuse(SP_ERR_OVERFLOW, "sp_init", in, "a region size is above 64 TiB");
    if (d->heap_size && d->heap_size < SP_TCACHE_MIN_REGION)
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_init", in,
                         "heap_size %zu is below 64 MiB (the thread caches' least)", d->heap_size);
    if (d->handle_size > SP_HANDLE_REGION_LIMIT - REGION_ALIGN)
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_init", in,
                         "handle_size %zu is 64 GiB or more once rounded up to 2 MiB (the "
                         "handle heap's limit)",
                         d->handle_size);
    /* Sizes left 0 follow the machine's memory, or under an address-space limit (RLIMIT_AS)
     * half the room the limit leaves if that is less (sp_address_budget): the scheduler's fiber
     * stacks and the program need the rest (sp_jobs_create then sizes its stacks from what is
     * left). */
    uint64_t mem = sp_memory_size();
    if (!mem) mem = 4 * (uint64_t)GiB;
    size_t budget = sp_address_budget();
    if (mem > budget) mem = budget;
    if (!d->heap_size) d->heap_size = clamp_size(mem / 2, 256 * MiB, 64 * GiB);
    if (!d->frame_size) d->frame_size = clamp_size(mem / 64, 16 * MiB, 256 * MiB);
    if (!d->frame_buffers) d->frame_buffers = 2;
    if (!d->handle_size) d->handle_size = clamp_size(mem / 8, 64 * MiB, 4 * GiB);
    if (!d->persistent_size) d->persistent_size = 64 * MiB;
    if (!d->between_budget_ns) d->between_budget_ns = 1000000;
    d->heap_size = sp_align_up(d->heap_size, REGION_ALIGN);
    d->frame_size = sp_align_up(d->frame_size, REGION_ALIGN);
    d->handle_size = sp_align_up(d->handle_size, REGION_ALIGN);
    d->persistent_size = sp_align_up(d->persistent_size, REGION_ALIGN);
    /* frame_size is per buffer: the frame region is N of them (a division, so that the check
     * cannot wrap where size_t is narrow). */
    if (d->frame_size > max / d->frame_buffers)
        return sp_misuse(SP_ERR_OVERFLOW, "sp_init", in,
                         "the frame region, frame_size x frame_buffers (%zu x %u), is above "
                         "64 TiB",
                         d->frame_size, d->frame_buffers);
    return SP_OK;
}

/* ---- subsystems, in start order -------------------------------------------------------- */

static sp_result platform_start(void) {
    const sp_desc *d = &sp_rt.desc;
    size_t sizes[SP_REGION_COUNT] = {0, d->heap_size, d->frame_size * d->frame_buffers,
                                     d->handle_size, d->persistent_size};
    size_t total = 0;
    for (int r = 1; r < SP_REGION_COUNT; r++) {
        if (sizes[r] > SIZE_MAX / 2 - total) return SP_ERR_OVERFLOW;
        total += sizes[r];
    }
    sp_rt.base = sp_vm_reserve(total, REGION_ALIGN, d->huge_pages, &sp_rt.pages);
    if (!sp_rt.base) return SP_ERR_OS;
    sp_rt.size = total;
    char *at = sp_rt.base;
    for (int r = 1; r < SP_REGION_COUNT; r++) {
        sp_rt.region[r] = (sp_region_info){region_names[r], at, sizes[r]};
        at += sizes[r];
    }
    sp_rt.region[0] = (sp_region_info){region_names[0], NULL, 0};
    return SP_OK;
}
static void platform_stop(void) {
    sp_vm_release(sp_rt.base, sp_rt.size);
    sp_rt.base = NULL;
    sp_rt.size = 0;
    memset(sp_rt.region, 0, sizeof sp_rt.region);
    atomic_store(&sp_rt.persist_used, 0);
    atomic_store(&sp_rt.persist_committed, 0);
}

static sp_result heap_start(void) {
    /* The caches set themselves up at their first use: one before sp_init (or after
     * sp_shutdown), or a direct sp_tcache_init, leaves them up on memory of their own. */
    if (atomic_load_explicit(&tc.ready, memory_order_acquire)) {
        sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, "sp_init", NULL,
               "the thread caches are already up before sp_init (sp_tcache_init, or set up "
               "on their own by a first allocation through them): allocate only after "
               "sp_init, or call sp_tcache_shutdown first");
        return SP_ERR_INVALID_ARG;
    }
    sp_tcache_desc td = {.region = sp_rt.region[SP_REGION_HEAP].base,
                         .region_size = sp_rt.region[SP_REGION_HEAP].size,
                         .explicit_attach = true};
    return sp_tcache_init(&td);
}
static void heap_stop(void) {
    size_t live = sp_tcache_shutdown();
    if (live == SIZE_MAX) { /* a cache sp_shutdown did not count: not expected (see there) */
        tcache_attach_close(false);
        sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, "sp_shutdown", NULL,
               "the thread caches refused to shut down (a cache attached that sp_shutdown did "
               "not count): their memory goes with the reservation, under that thread");
    } else if (live)
        sp_log(SP_LOG_WARN, SP_ERR_INVALID_ARG, "sp_shutdown", NULL,
               "%zu blocks still live in the thread caches or the central heap (leaked)", live);
}

static sp_result caches_start(void) {
    return own_cache_attach();
}
static void caches_stop(void) {
    own_cache_detach();
}

static void *arena_heap_alloc(void *user, size_t align, size_t size) {
    (void)user;
    if (align > SP_TCACHE_MAX_ALIGN) return NULL; /* above the caches' limit: an overflow */
    return sp_tcache_aligned_alloc(align, size);
}
static void arena_heap_free(void *user, void *p) {
    (void)user;
    sp_tcache_free(p);
}

static sp_result frames_start(void) {
    const sp_desc *d = &sp_rt.desc;
    sp_frame_desc fd = {.region = sp_rt.region[SP_REGION_FRAME].base,
                        .region_size = sp_rt.region[SP_REGION_FRAME].size,
                        .buffers = d->frame_buffers,
                        .chunk_size = d->frame_chunk,
                        .overflow = d->frame_overflow,
                        .heap_alloc = arena_heap_alloc,
                        .heap_free = arena_heap_free};
    sp_result err = SP_OK;
    sp_rt.arena = sp_frame_arena_create(&fd, &err);
    /* Debug builds leave the inline path's copy NULL: every sp_arena_alloc then comes through
     * arena_for_caller, which reports calls from threads the arena is not for. */
    sp_runtime_g.arena = SP_DEBUG ? NULL : sp_rt.arena;
    if (sp_rt.arena) frame_arena_keep(sp_rt.arena, true); /* sp_frame_arena_destroy refuses */
    return sp_rt.arena ? SP_OK : err;
}
static void frames_stop(void) {
    sp_runtime_g.arena = NULL;
    frame_arena_keep(sp_rt.arena, false);
    sp_frame_arena_destroy(sp_rt.arena);
    sp_rt.arena = NULL;
}

static sp_result handles_start(void) {
    sp_handle_heap_desc hd = {.region = sp_rt.region[SP_REGION_HANDLE].base,
                              .region_size = sp_rt.region[SP_REGION_HANDLE].size,
                              .max_handles = sp_rt.desc.max_handles,
                              .retire = handle_retire,
                              .may_compact = rt_may_compact};
    sp_result err = SP_OK;
    sp_rt.handles = sp_handle_heap_create(&hd, &err);
    if (sp_rt.handles) handle_heap_keep(sp_rt.handles, true); /* its destroy refuses */
    return sp_rt.handles ? SP_OK : err;
}
static void handles_stop(void) {
    sp_handle_heap_status st;
    sp_handle_heap_status_get(sp_rt.handles, &st);
    if (st.live_handles)
        sp_log(SP_LOG_WARN, SP_ERR_INVALID_ARG, "sp_shutdown", sp_rt.handles,
               "%zu handles still live in the handle heap (leaked)", (size_t)st.live_handles);
    handle_heap_keep(sp_rt.handles, false);
    sp_handle_heap_destroy(sp_rt.handles);
    sp_rt.handles = NULL;
}

static void jobs_stop(void);

static sp_result jobs_start(void) {
    qsbr_register();
    sp_result started = sp_thread_start(&sp_rt.reclaimer, reclaimer_main, NULL, "spindle-reclaim");
    if (started != SP_OK) {
        qsbr_unregister();
        return started; /* SP_ERR_OS, or SP_ERR_NOMEM for the start record */
    }
    sp_rt.reclaimer_started = true;
    sp_jobs_desc jd = sp_rt.desc.jobs;
    sp_rt.user_hooks = jd.hooks;
    /* Ours where the runtime has a duty; the pure pass-throughs only when the desc set them. */
    const sp_jobs_hooks *u = &sp_rt.user_hooks;
    jd.hooks = (sp_jobs_hooks){.job_begin = u->job_begin ? hook_job_begin : NULL,
                               .job_end = hook_job_end,
                               .job_park = hook_job_park,
                               .job_resume = u->job_resume ? hook_job_resume : NULL,
                               .worker_sleep = hook_worker_sleep,
                               .worker_wake = hook_worker_wake,
                               .fiber_switch = u->fiber_switch ? hook_fiber_switch : NULL,
                               .thread_start = hook_thread_start,
                               .thread_stop = hook_thread_stop};
    sp_result r = sp_jobs_create(&sp_rt.jobs, &jd);
    if (r == SP_OK) {
        sp_rt.frame_counter = sp_counter_create(sp_rt.jobs, "frame");
        if (sp_rt.frame_counter) {
            jobs_counter_keep(sp_rt.frame_counter, true); /* sp_counter_destroy refuses it */
            jobs_keep(sp_rt.jobs, true); /* so do sp_jobs_shutdown and sp_jobs_destroy */
            /* The reclaimer and the workers attach as they start: wait for them all (and
             * the main thread, which attached in caches_start). */
            sp_jobs_status js;
            sp_jobs_status_get(sp_rt.jobs, &js);
            while (atomic_load(&sp_rt.own_attached) < js.workers + 2) sp_thread_yield();
            return SP_OK;
        }
        sp_jobs_shutdown(sp_rt.jobs);
        sp_jobs_destroy(sp_rt.jobs);
        r = SP_ERR_NOMEM;
    }
    sp_rt.jobs = NULL;
    jobs_stop(); /* the reclaimer and the registration */
    return r;
}
static void jobs_stop(void) {
    if (sp_rt.jobs) {
        jobs_shutdown(sp_rt.jobs); /* SP_ERR_SHUTDOWN when sp_shutdown did it already */
        jobs_counter_keep(sp_rt.frame_counter, false);
        sp_counter_destroy(sp_rt.frame_counter);
        sp_rt.frame_counter = NULL;
        jobs_keep(sp_rt.jobs, false);
        sp_jobs_destroy(sp_rt.jobs);
        sp_rt.jobs = NULL;
    }
    /* Every worker has unregistered; the main thread goes too, so the last grace period
     * waits for nobody. */
    qsbr_unregister();
    if (sp_rt.reclaimer_started) {
        atomic_store(&sp_rt.reclaim_stop, true);
        reclaimer_wake();
        sp_thread_join(sp_rt.reclaimer);
        sp_rt.reclaimer_started = false;
        atomic_store(&sp_rt.reclaim_stop, false);
    }
}

static const struct subsystem {
    const char *name;
    sp_result (*start)(void);
    void (*stop)(void);
} subsystems[] = {
    {"platform", platform_start, platform_stop},  {"central heap", heap_start, heap_stop},
    {"thread caches", caches_start, caches_stop}, {"frame arenas", frames_start, frames_stop},
    {"handle heap", handles_start, handles_stop}, {"jobs", jobs_start, jobs_stop},
};
#define SUBSYSTEMS ((int)SP_ARRAY_LEN(subsystems))

static void stop_from(int n) {
    while (n-- > 0) subsystems[n].stop();
}

sp_result sp_init(const sp_desc *desc) {
    if (rt_up()) {
        sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, "sp_init", NULL, "already initialised");
        return SP_ERR_INVALID_ARG;
    }
    sp_rt.failure = NULL;
    atomic_store(&sp_rt.own_attached, 0);
    sp_result r = desc_fill(desc, &sp_rt.desc);
    if (r != SP_OK) return r;
    rt_main = true;
    for (int i = 0; i < SUBSYSTEMS; i++) {
        r = subsystems[i].start();
        if (r != SP_OK) {
            sp_rt.failure = subsystems[i].name;
            /* A resource failure is a warning, as everywhere (sp_log.h); a refusal of the
             * desc by the subsystem's own checks is misuse, reported there already. */
            bool resource = r == SP_ERR_NOMEM || r == SP_ERR_OS;
            sp_log(resource ? SP_LOG_WARN : SP_LOG_ERROR, r, "sp_init", NULL,
                   "%s failed to start (%s); stopping the %d "
                   "started before it",
                   subsystems[i].name, sp_result_name(r), i);
            stop_from(i); /* a subsystem that failed part-way has cleaned up after itself */
            rt_main = false;
            return r;
        }
    }
    sp_rt.frame = 0;
    sp_rt.in_frame = false;
    sp_rt.between_count = 0;
    atomic_store(&sp_rt.retire_count, 0);
    sp_handle_heap_status hs;
    sp_handle_heap_status_get(sp_rt.handles, &hs);
    rt_flows_read(sp_rt.flows_t0, hs.allocated_total); /* frame 0's record counts from here */
    atomic_store(&sp_rt.stopping, false);
    __atomic_store_n(&sp_rt.up, true, __ATOMIC_RELEASE);
    return SP_OK;
}

const char *sp_init_failure(void) {
    return sp_rt.failure;
}

sp_result sp_shutdown(void) {
    sp_result r = rt_frame_loop_only("sp_shutdown"); /* not initialised or shut down already */
    if (r != SP_OK) return r;
    if (sp_rt.in_frame) {
        sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, "sp_shutdown", NULL,
               "frame %llu is open: call sp_frame_end first", (unsigned long long)sp_rt.frame);
        return SP_ERR_INVALID_ARG;
    }
    atomic_store(&sp_rt.stopping, true); /* from here an attach backs off (see runtime) */
    uint32_t attached = atomic_load(&sp_rt.attached);
    if (attached) {
        atomic_store(&sp_rt.stopping, false);
        sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, "sp_shutdown", NULL,
               "%u threads are still attached: sp_thread_detach them first", attached);
        return SP_ERR_INVALID_ARG;
    }
    /* Any other cache came from sp_tcache_thread_attach called directly: its thread would
     * use it after the heap is gone. Counted as the caches close to new attaches, so that none
     * appears while the scheduler drains below (the runtime's threads have theirs already). */
    size_t caches = tcache_attach_close(true);
    uint32_t own = atomic_load(&sp_rt.own_caches);
    if (caches > own) {
        tcache_attach_close(false);
        atomic_store(&sp_rt.stopping, false);
        sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, "sp_shutdown", NULL,
               "%zu threads attached with sp_tcache_thread_attach: sp_tcache_thread_detach them "
               "first",
               caches - own);
        return SP_ERR_INVALID_ARG;
    }
    /* The scheduler first: it runs every pending job (frame jobs included) and gives the
     * result (SP_ERR_STALLED: jobs abandoned). Called from a job it refuses (logged) and
     * nothing is stopped; jobs_stop later finds it shut down and destroys it. */
    r = jobs_shutdown(sp_rt.jobs);
    if (r == SP_ERR_INVALID_ARG) {
        tcache_attach_close(false);
        atomic_store(&sp_rt.stopping, false);
        return r;
    }
    __atomic_store_n(&sp_rt.up, false, __ATOMIC_RELEASE);
    stop_from(SUBSYSTEMS);
    rt_main = false;
    return r == SP_ERR_STALLED ? r : SP_OK;
}

/* ---- threads ----------------------------------------------------------------------------- */

/* An attached thread that ends without sp_thread_detach would stay registered with QSBR for
 * good (reclamation waits for it forever) and keep sp_shutdown refusing: this key's
 * destructor detaches it at its exit, reported as misuse. Made once per process. */
static once_flag exit_key_once = ONCE_FLAG_INIT;
static tss_t exit_key;
static bool exit_key_ok;

static void attached_thread_exit(void *v) {
    (void)v;
    if (!tls_attached) return;
    sp_misuse(SP_ERR_INVALID_ARG, "sp_thread_detach", NULL,
              "an attached thread ended without sp_thread_detach: detached at its exit");
    sp_thread_detach();
}

static void exit_key_make(void) {
    exit_key_ok = tss_create(&exit_key, attached_thread_exit) == thrd_success;
}

sp_result sp_thread_attach(void) {
    if (!rt_is_up("sp_thread_attach")) return SP_ERR_SHUTDOWN;
    if (tls_attached || rt_main || sp_jobs_worker_id() != SP_JOBS_NOT_A_WORKER) {
        sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, "sp_thread_attach", NULL, "%s",
               tls_attached ? "the thread is already attached"
                            : "workers and the main thread are attached by the runtime");
        return SP_ERR_INVALID_ARG;
    }
    /* Counted first, then `stopping` read (see runtime.stopping): past this, sp_shutdown
     * refuses, so the runtime's state (the caches) stays put under us. */
    atomic_fetch_add(&sp_rt.attached, 1);
    sp_result r = SP_ERR_SHUTDOWN;
    if (atomic_load(&sp_rt.stopping))
        sp_log(SP_LOG_ERROR, r, "sp_thread_attach", NULL, "sp_shutdown is running");
    else
        r = sp_tcache_thread_attach();
    if (r != SP_OK) {
        atomic_fetch_sub(&sp_rt.attached, 1);
        return r;
    }
    qsbr_register();
    tls_attached = true;
    call_once(&exit_key_once, exit_key_make);
    if (exit_key_ok) tss_set(exit_key, &tls_attached); /* any non-NULL value arms it */
    return SP_OK;
}

sp_result sp_thread_detach(void) {
    if (!tls_attached) {
        sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, "sp_thread_detach", NULL,
               "the thread is not attached");
        return SP_ERR_INVALID_ARG;
    }
    tls_offline = false; /* liburcu's unregister takes an offline thread as it is */
    qsbr_unregister();
    sp_tcache_thread_detach();
    tls_attached = false;
    if (exit_key_ok) tss_set(exit_key, NULL);
    atomic_fetch_sub(&sp_rt.attached, 1); /* last: a shutdown waits for the whole detach */
    return SP_OK;
}

void sp_thread_quiescent(void) {
    if (tls_attached && !tls_offline) rt_quiescent();
}

void sp_thread_offline(void) {
    if (!tls_attached || tls_offline) return;
    qsbr_offline();
    tls_offline = true;
}

void sp_thread_online(void) {
    if (!tls_attached || !tls_offline) return;
    qsbr_online();
    tls_offline = false;
}

/* ---- memory ------------------------------------------------------------------------------ */

sp_region sp_region_of(const void *p) {
    uintptr_t off = (uintptr_t)p - (uintptr_t)sp_rt.base;
    if (off >= sp_rt.size) return SP_REGION_NONE;
    uintptr_t end = sp_rt.region[SP_REGION_HEAP].size;
    if (off < end) return SP_REGION_HEAP;
    if (off < (end += sp_rt.region[SP_REGION_FRAME].size)) return SP_REGION_FRAME;
    if (off < (end += sp_rt.region[SP_REGION_HANDLE].size)) return SP_REGION_HANDLE;
    return SP_REGION_PERSISTENT;
}

void *sp_persistent_alloc(size_t size, size_t align) {
    if (!rt_is_up("sp_persistent_alloc")) return NULL;
    if (!align) align = 16;
    if (!sp_is_pow2(align) || align > 4096) {
        sp_misuse(SP_ERR_BAD_ALIGNMENT, "sp_persistent_alloc", NULL,
                  "alignment %zu is not a power of two up to 4096", align);
        return NULL;
    }
    const sp_region_info *reg = &sp_rt.region[SP_REGION_PERSISTENT];
    /* Size 0 takes a byte, so that its pointer too lies inside the region (sp_region_of). */
    size_t n = size ? size : 1;
    size_t used = atomic_load_explicit(&sp_rt.persist_used, memory_order_relaxed), start, end;
    do {
        start = sp_align_up(used, align);
        if (n > reg->size || start > reg->size - n) {
            sp_log(SP_LOG_WARN, SP_ERR_NOMEM, "sp_persistent_alloc", NULL,
                   "%zu bytes do not fit: the persistent region (%zu bytes) holds %zu", n,
                   reg->size, used);
            return NULL;
        }
        end = start + n;
    } while (!atomic_compare_exchange_weak_explicit(&sp_rt.persist_used, &used, end,
                                                    memory_order_relaxed, memory_order_relaxed));
    if (end > atomic_load_explicit(&sp_rt.persist_committed, memory_order_acquire)) {
        sp_mutex_lock(&sp_rt.persist_lock);
        size_t committed = atomic_load_explicit(&sp_rt.persist_committed, memory_order_relaxed);
        if (end > committed) {
            size_t to = sp_align_up(end, REGION_ALIGN);
            if (sp_vm_commit((char *)reg->base + committed, to - committed) != SP_OK) {
                sp_mutex_unlock(&sp_rt.persist_lock);
                return NULL; /* logged by the platform layer; the bytes stay taken */
            }
            atomic_store_explicit(&sp_rt.persist_committed, to, memory_order_release);
        }
        sp_mutex_unlock(&sp_rt.persist_lock);
    }
    return (char *)reg->base + start;
}

/* The arena for the calling thread's sp_arena_alloc: NULL (logged) before init, and (misuse)
 * on a thread that is neither the main thread nor one of the runtime's workers, whose
 * allocations are not ordered with sp_frame_end's buffer flip. */
static sp_frame_arena *arena_for_caller(const char *call) {
    if (!rt_is_up(call)) return NULL;
    if (SP_UNLIKELY(!rt_main && !jobs_worker_of(sp_rt.jobs))) {
        sp_misuse(SP_ERR_INVALID_ARG, call, sp_rt.arena,
                  "called from %s: the frame arena is for jobs and the main thread (a buffer "
                  "may be reclaimed under other threads); use the thread caches",
                  tls_attached ? "an attached thread" : "a thread that is not the runtime's");
        return NULL;
    }
    return sp_rt.arena;
}

/* The inline paths' way out: before init and, in debug builds, every call. */
void *sp_arena_alloc_slow(size_t size) {
    sp_frame_arena *a = arena_for_caller("sp_arena_alloc");
    return a ? sp_frame_alloc(a, size) : NULL;
}

void *sp_arena_aligned_alloc_slow(size_t align, size_t size) {
    sp_frame_arena *a = arena_for_caller("sp_arena_aligned_alloc");
    return a ? sp_frame_aligned_alloc(a, align, size) : NULL;
}

sp_jobs *sp_scheduler(void) {
    return rt_up() ? sp_rt.jobs : NULL;
}
sp_frame_arena *sp_frames(void) {
    return sp_rt.arena;
}
sp_handle_heap *sp_handles(void) {
    return rt_up() ? sp_rt.handles : NULL;
}

void sp_status_get(sp_status *out) {
    if (!out) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_status_get", out, "out is NULL");
        return;
    }
    memset(out, 0, sizeof *out);
    out->initialised = rt_up();
    if (!out->initialised) return;
    out->pages = sp_rt.pages;
    out->reserved = sp_rt.size;
    out->frame = __atomic_load_n(&sp_rt.frame, __ATOMIC_RELAXED);
    out->in_frame = __atomic_load_n(&sp_rt.in_frame, __ATOMIC_RELAXED);
    out->attached_threads = atomic_load(&sp_rt.attached);
    memcpy(out->regions, sp_rt.region, sizeof out->regions);
}
