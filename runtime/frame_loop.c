/* The frame loop: sp_frame_begin / sp_frame_end on the main thread, the frame's jobs, the
 * between-frames works, and the per-frame statistics record. */
#include "runtime_internal.h"

#include "jobs_internal.h" /* jobs_records_give_back, jobs_worker_of */

#include <string.h>

sp_counter *sp_frame_counter(void) {
    return rt_up() ? sp_rt.frame_counter : NULL;
}

/* ---- the frame gate (see runtime.gate_closed) ------------------------------------------ */

/* Count the calling thread in as a frame-counter submitter; while sp_frame_end has the gate
 * closed, step back out and sleep until it opens. */
static void gate_enter(void) {
    for (;;) {
        atomic_fetch_add(&sp_rt.gate_submitters, 1);
        if (SP_LIKELY(!atomic_load(&sp_rt.gate_closed))) return;
        atomic_fetch_sub(&sp_rt.gate_submitters, 1);
        atomic_fetch_add(&sp_rt.gate_sleepers, 1);
        while (atomic_load(&sp_rt.gate_closed)) sp_futex_wait((uint32_t *)&sp_rt.gate_closed, 1, 0);
        atomic_fetch_sub(&sp_rt.gate_sleepers, 1);
    }
}

static void gate_leave(void) {
    atomic_fetch_sub(&sp_rt.gate_submitters, 1);
}

/* sp_frame_end, before its wait on the frame counter: from here no submit from outside the
 * frame loop's order raises it; those under way have raised it (or failed) once this returns.
 * They are short (sp_jobs_submit: a record take, a push), unless the scheduler is short of
 * job records: then the submit waits for the workers to give back the ones they cache, and
 * the main thread (worker 0) gives back its own here, or the submit would wait its full
 * second for them. */
static void gate_close(void) {
    atomic_store(&sp_rt.gate_closed, 1);
    while (atomic_load(&sp_rt.gate_submitters)) {
        jobs_records_give_back(sp_rt.jobs);
        sp_thread_yield();
    }
}

/* Once the buffers are flipped (or sp_frame_end gives up): the submits that waited go on,
 * their jobs in the next frame. */
static void gate_open(void) {
    atomic_store(&sp_rt.gate_closed, 0);
    if (atomic_load(&sp_rt.gate_sleepers)) sp_futex_wake((uint32_t *)&sp_rt.gate_closed, INT32_MAX);
}

sp_result sp_submit(const sp_job_desc *jobs, uint32_t count, sp_counter *counter) {
    if (!rt_is_up("sp_submit")) return SP_ERR_SHUTDOWN;
    if (!counter) counter = sp_rt.frame_counter;
    /* The main thread's submits are ordered with its own sp_frame_end, and a job's raise the
     * frame counter before the job itself ends (so a frame-counter job's children are waited
     * for with it). Other threads pass the gate. */
    if (counter != sp_rt.frame_counter || jobs_worker_of(sp_rt.jobs))
        return sp_jobs_submit(sp_rt.jobs, jobs, count, counter);
    gate_enter();
    sp_result r = sp_jobs_submit(sp_rt.jobs, jobs, count, counter);
    gate_leave();
    return r;
}

/* Between frames with no job live; its callers have checked for the main thread. Asked once
 * by between_frames, which then lets the heap's own call through (`compact_gate`); asked by
 * the heap for a direct sp_handle_compact call. */
static bool may_compact_now(void) {
    return rt_up() && !sp_rt.in_frame && sp_jobs_idle(sp_rt.jobs);
}

bool rt_may_compact(void *user) {
    (void)user;
    /* The main thread first: a call from another thread never gets through the gate. */
    return rt_main && (sp_rt.compact_gate || may_compact_now());
}

/* The frame counter counts the frame's jobs down to 0; below it, something lowered it by hand
 * (sp_counter_sub on sp_frame_counter()) and a frame end may have stopped waiting for jobs
 * still running. Reported as misuse under `call`, and set back to 0. */
static void frame_counter_check(const char *call) {
    int64_t v = sp_counter_value(sp_rt.frame_counter);
    if (SP_LIKELY(v >= 0)) return;
    sp_misuse(SP_ERR_INVALID_ARG, call, sp_rt.frame_counter,
              "the frame counter is at %lld: it was lowered below the jobs it counts "
              "(sp_counter_sub on sp_frame_counter()); set back to 0",
              (long long)v);
    sp_counter_add(sp_rt.frame_counter, -v);
}

sp_result sp_frame_begin(void) {
    sp_result r = rt_frame_loop_only("sp_frame_begin");
    if (r != SP_OK) return r;
    if (sp_rt.in_frame) {
        sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, "sp_frame_begin", NULL,
               "frame %llu is already open", (unsigned long long)sp_rt.frame);
        return SP_ERR_INVALID_ARG;
    }
    frame_counter_check("sp_frame_begin");
    __atomic_store_n(&sp_rt.in_frame, true, __ATOMIC_RELAXED); /* sp_status_get reads it */
    sp_rt.frame_t0 = sp_time_ns();
    return SP_OK;
}

/* Every FIBER_TRIM_FRAMES frames, sp_jobs_trim gives back the spare fibers that no wait used
 * over that many frames (a burst of waits, not a steady need) and at most FIBER_TRIM_MAX of
 * the stacks (one madvise each: a 4,096-fiber burst is given back over 64 such frames, about a
 * minute at 60 frames a second). */
enum { FIBER_TRIM_FRAMES = 64, FIBER_TRIM_MAX = 64 };

/* Between-frames work within the budget: the main thread's tidy (sp_tcache_tidy: surplus
 * spans back, the reused ones kept; workers tidy when they go idle), the fiber trim, the
 * registered works, then compaction. */
static void between_frames(sp_frame_stats *st) {
    uint64_t t0 = sp_time_ns(), budget = sp_rt.desc.between_budget_ns;
    sp_rt.in_between = true; /* the frame loop refuses to be entered from here */
    st->trimmed_bytes = sp_tcache_tidy();
    atomic_fetch_add_explicit(&sp_rt.tidy_epoch, 1, memory_order_relaxed);
    if (st->frame % FIBER_TRIM_FRAMES == FIBER_TRIM_FRAMES - 1)
        st->fiber_stacks_trimmed = sp_jobs_trim(sp_rt.jobs, FIBER_TRIM_MAX);
    /* A work may add or remove works (itself included) while it runs: the walk reads the
     * live list, and a removal before its position moves it back (sp_between_frames_remove). */
    while (sp_rt.between_next < sp_rt.between_count) {
        between_work w = sp_rt.between[sp_rt.between_next++];
        uint64_t spent = sp_time_ns() - t0;
        if (spent >= budget) {
            st->between_skipped++;
            continue;
        }
        w.fn(w.user, budget - spent);
    }
    sp_rt.between_next = 0;
    uint64_t spent = sp_time_ns() - t0;
    /* Jobs on counters of the caller's own may still run (background work across frames):
     * then compaction waits for a later frame instead of being refused as misuse. Asked once:
     * the heap's own may_compact then lets the call through. */
    if (spent < budget && may_compact_now()) {
        sp_handle_compact_stats cs;
        sp_rt.compact_gate = true;
        if (sp_handle_compact(sp_rt.handles, budget - spent, &cs) == SP_OK)
            st->handle_moved = cs.bytes_moved;
        sp_rt.compact_gate = false;
    } else {
        st->between_skipped++;
    }
    sp_rt.in_between = false;
    st->between_ns = sp_time_ns() - t0;
}

sp_result sp_frame_end(void) {
    sp_result r = rt_frame_loop_only("sp_frame_end");
    if (r != SP_OK) return r;
    if (!sp_rt.in_frame) {
        sp_log(SP_LOG_ERROR, SP_ERR_INVALID_ARG, "sp_frame_end", NULL,
               "no frame is open: call sp_frame_begin first");
        return SP_ERR_INVALID_ARG;
    }
    sp_frame_stats st = {.frame = sp_rt.frame};
    uint64_t t_wait = sp_time_ns();
    gate_close(); /* no frame-counter job from another thread starts past the wait below */
    r = sp_counter_wait(sp_rt.frame_counter, 0);
    if (r != SP_OK) {
        gate_open();
        return r; /* logged by the scheduler; the frame stays open */
    }
    frame_counter_check("sp_frame_end");
    st.wait_ns = sp_time_ns() - t_wait;
    __atomic_store_n(&sp_rt.in_frame, false, __ATOMIC_RELAXED);

    sp_frame_buffer_status closed;
    sp_frame_arena_advance(sp_rt.arena, &closed);
    gate_open();
    st.arena_bytes = closed.bytes_used;
    st.arena_peak = closed.peak;
    st.arena_chunks = closed.chunks;
    st.arena_overflows = closed.overflows;
    st.arena_overflow_bytes = closed.overflow_bytes;

    between_frames(&st);

    rt_quiescent();
    rt_reclaim_kick();

    /* The central heap's counters, not sp_tcache_status_get: that walks every span of every
     * cache, each under its lock - a cost that grew with the live heap, every frame. */
    sp_tlsf_status spans, large;
    sp_tcache_heap_status(&spans, &large);
    st.heap_bytes = spans.bytes_used + large.bytes_used;
    st.heap_high_water = spans.high_water + large.high_water;
    sp_handle_heap_status hs;
    sp_handle_heap_status_get(sp_rt.handles, &hs);
    st.handle_bytes = hs.live_bytes;
    st.handle_fragmentation = hs.fragmentation;
    /* The flows, all at this one point: a record counts from the end of the last frame's
     * sp_frame_end to the end of this one, this one's between-frames work included. */
    uint64_t now[FLOWS];
    rt_flows_read(now, hs.allocated_total);
    st.persistent_bytes = now[FLOW_PERSISTENT];
    uint64_t grew[FLOWS];
    for (int k = 0; k < FLOWS; k++) {
        grew[k] = now[k] - sp_rt.flows_t0[k];
        sp_rt.flows_t0[k] = now[k];
    }
    st.jobs_run = grew[FLOW_JOBS];
    st.retired = grew[FLOW_RETIRED];
    st.heap_allocated = grew[FLOW_HEAP];
    st.handle_allocated = grew[FLOW_HANDLE];
    st.persistent_allocated = grew[FLOW_PERSISTENT];
    st.frame_ns = sp_time_ns() - sp_rt.frame_t0;
    sp_rt.last = st;
    __atomic_store_n(&sp_rt.frame, sp_rt.frame + 1, __ATOMIC_RELAXED); /* read by sp_status_get */
    return SP_OK;
}

void rt_flows_read(uint64_t v[FLOWS], uint64_t handle_allocated) {
    v[FLOW_JOBS] = sp_jobs_run_count(sp_rt.jobs);
    v[FLOW_RETIRED] = atomic_load_explicit(&sp_rt.retire_count, memory_order_relaxed);
    v[FLOW_HEAP] = sp_tcache_allocated();
    v[FLOW_HANDLE] = handle_allocated;
    v[FLOW_PERSISTENT] = atomic_load_explicit(&sp_rt.persist_used, memory_order_relaxed);
}

sp_result sp_frame_stats_last(sp_frame_stats *out) {
    if (!out) return sp_misuse(SP_ERR_INVALID_ARG, "sp_frame_stats_last", out, "out is NULL");
    sp_result r = rt_main_only("sp_frame_stats_last"); /* sp_frame_end writes the record */
    if (r != SP_OK) return r;
    if (sp_rt.frame == 0) return SP_ERR_LIMIT; /* no frame closed yet */
    *out = sp_rt.last;
    return SP_OK;
}

/* The index of the registered work (fn, user), or between_count if there is none. */
static uint32_t between_find(sp_between_fn fn, void *user) {
    uint32_t i = 0;
    while (i < sp_rt.between_count && (sp_rt.between[i].fn != fn || sp_rt.between[i].user != user))
        i++;
    return i;
}

sp_result sp_between_frames_add(const char *name, sp_between_fn fn, void *user) {
    sp_result r = rt_main_only("sp_between_frames_add");
    if (r != SP_OK) return r;
    if (!fn) return sp_misuse(SP_ERR_INVALID_ARG, "sp_between_frames_add", NULL, "fn is NULL");
    if (between_find(fn, user) < sp_rt.between_count)
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_between_frames_add", user,
                         "'%s' is registered already", name ? name : "(unnamed)");
    if (sp_rt.between_count == BETWEEN_MAX) {
        sp_log(SP_LOG_ERROR, SP_ERR_LIMIT, "sp_between_frames_add", user,
               "%d between-frames works registered already", BETWEEN_MAX);
        return SP_ERR_LIMIT;
    }
    sp_rt.between[sp_rt.between_count++] = (between_work){name, fn, user};
    return SP_OK;
}

sp_result sp_between_frames_remove(sp_between_fn fn, void *user) {
    sp_result r = rt_main_only("sp_between_frames_remove");
    if (r != SP_OK) return r;
    uint32_t i = between_find(fn, user);
    if (i == sp_rt.between_count)
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_between_frames_remove", user,
                         "no such between-frames work");
    memmove(&sp_rt.between[i], &sp_rt.between[i + 1],
            (sp_rt.between_count - i - 1) * sizeof sp_rt.between[0]);
    sp_rt.between_count--;
    if (i < sp_rt.between_next) sp_rt.between_next--; /* removed during the walk, behind it */
    return SP_OK;
}
