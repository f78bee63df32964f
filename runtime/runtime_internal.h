/* The runtime's state, shared by runtime.c (lifecycle, regions, threads, QSBR) and
 * frame_loop.c (the frame loop). One runtime per process: a zero-initialised static, no
 * constructors. */
#ifndef SP_RUNTIME_INTERNAL_H
#define SP_RUNTIME_INTERNAL_H

#include <stdatomic.h>

#include "sp_internal.h"
#include "sp_platform.h"
#include "sp_runtime.h"
#include "sp_tcache.h"

#define BETWEEN_MAX 16

typedef struct between_work {
    const char *name;
    sp_between_fn fn;
    void *user;
} between_work;

/* The counts that only grow, whose growth each frame record holds (sp_frame_stats). */
enum { FLOW_JOBS, FLOW_RETIRED, FLOW_HEAP, FLOW_HANDLE, FLOW_PERSISTENT, FLOWS };

/* A pointer waiting for a grace period (sp_retire). */
typedef struct retired {
    struct retired *next;
    void *p;
    void (*free_fn)(void *);
} retired;

typedef struct runtime {
    bool up;
    const char *failure; /* subsystem whose start failed in the last sp_init */
    sp_desc desc;        /* with the defaults filled in */

    /* The reservation and its regions ([SP_REGION_NONE] unused). */
    char *base;
    size_t size;
    sp_page_kind pages;
    sp_region_info region[SP_REGION_COUNT];

    /* Persistent region: bump pointer, committed in steps under a lock. */
    _Atomic size_t persist_used;
    _Atomic size_t persist_committed;
    sp_mutex persist_lock;

    sp_jobs *jobs;
    sp_frame_arena *arena; /* the frame arena (sp_runtime_g.arena: the inline path's copy) */
    sp_counter *frame_counter;
    sp_handle_heap *handles;
    sp_jobs_hooks user_hooks; /* the desc's hooks, called from ours */

    /* QSBR reclaimer: a thread that waits for grace periods and frees what was retired. */
    _Atomic(retired *) retire_list;
    _Atomic uint64_t retire_count;
    _Atomic uint32_t reclaim_seq; /* futex word: bumped to wake the reclaimer */
    _Atomic bool reclaim_stop;
    bool reclaimer_started;
    sp_thread reclaimer;

    /* Attach against shutdown, a Dekker handshake (sequentially consistent): an attach counts
     * itself in `attached`, then reads `stopping`; sp_shutdown sets `stopping`, then reads
     * `attached`. At least one of them sees the other: the attach backs off, or the shutdown
     * refuses (and clears `stopping` again). */
    _Atomic uint32_t attached;
    _Atomic bool stopping;
    /* Caches of the runtime's own threads (main, workers, reclaimer), counted before they
     * attach: the thread caches give a cache only to threads that ask (explicit_attach), so
     * sp_shutdown knows every cache there is. */
    _Atomic uint32_t own_caches;
    /* Runtime threads (main, reclaimer, workers) that have made their attach: sp_init returns
     * once all have, so sp_shutdown's count is never ahead of the caches. */
    _Atomic uint32_t own_attached;
    _Atomic uint64_t tidy_epoch; /* bumped by sp_frame_end: workers tidy when they go idle */

    /* The frame gate: frame-counter submits from threads outside the frame loop's order
     * (neither the main thread nor a worker) against sp_frame_end's buffer flip. A Dekker
     * handshake (sequentially consistent), like attach against shutdown: such a submit counts
     * itself in `gate_submitters`, then reads `gate_closed`; sp_frame_end sets `gate_closed`,
     * then waits for `gate_submitters` to drain before it waits on the frame counter. So
     * either the submit raised the frame counter before that wait began (its jobs belong to
     * the closing frame) or it saw the gate closed, stepped back out and sleeps on the
     * `gate_closed` futex (counted in `gate_sleepers`, so that opening wakes only when
     * someone sleeps) until the buffers are flipped (its jobs belong to the next frame). */
    _Atomic uint32_t gate_closed;
    _Atomic uint32_t gate_submitters;
    _Atomic uint32_t gate_sleepers;

    /* Frame loop: written by the main thread only (in_frame and frame atomically: sp_status_get
     * reads them from any thread). */
    bool in_frame;
    bool in_between; /* sp_frame_end's between-frames step runs (works, compaction) */
    uint64_t frame;
    uint64_t frame_t0;
    uint64_t flows_t0[FLOWS]; /* the flows at the last frame's close (sp_init's, for frame 0) */
    sp_frame_stats last;
    bool compact_gate; /* between_frames asked already: the heap's may_compact says yes */
    between_work between[BETWEEN_MAX];
    uint32_t between_count;
    uint32_t between_next; /* the next work between_frames runs; 0 outside its walk */
} runtime;

SP_HIDDEN extern runtime sp_rt;
/* True on the thread that called sp_init, until sp_shutdown (a thread-local: the main-thread
 * checks of every frame call cost no system call). */
SP_HIDDEN extern _Thread_local bool rt_main;

/* SP_OK on the main thread of a running runtime, outside jobs; otherwise logs `call` and
 * returns SP_ERR_SHUTDOWN (not running) or SP_ERR_INVALID_ARG (another thread, or a job
 * running on the main thread). */
SP_HIDDEN sp_result rt_main_only(const char *call);
/* rt_main_only, and SP_ERR_INVALID_ARG (logged) from inside sp_frame_end's between-frames step
 * (a work or a relocation callback): sp_frame_begin, sp_frame_end and sp_shutdown. */
SP_HIDDEN sp_result rt_frame_loop_only(const char *call);
/* Whether the runtime is up (any thread: `up` changes only in sp_init / sp_shutdown). */
static inline bool rt_up(void) {
    return __atomic_load_n(&sp_rt.up, __ATOMIC_ACQUIRE);
}

/* true if the runtime is up; otherwise logs `call` (SP_ERR_SHUTDOWN) and returns false. */
SP_HIDDEN bool rt_is_up(const char *call);

/* Report a quiescent state for the calling registered thread. */
SP_HIDDEN void rt_quiescent(void);
/* Wake the reclaimer if anything was retired. */
SP_HIDDEN void rt_reclaim_kick(void);

/* The flows now into v; handle_allocated: the handle heap's allocated_total, just read with
 * its status (which the caller needs anyway). */
SP_HIDDEN void rt_flows_read(uint64_t v[FLOWS], uint64_t handle_allocated);

/* Handle heap's compaction gate: the main thread, outside frames, no job in flight. */
SP_HIDDEN bool rt_may_compact(void *user);

#endif
