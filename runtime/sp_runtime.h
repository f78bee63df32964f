/* spindle runtime: one init, one up-front reservation, and the frame loop.
 *
 * A game calls sp_init once on its main thread, runs frames (sp_frame_begin ... submit jobs ...
 * sp_frame_end), and calls sp_shutdown. In between, jobs allocate from the right place:
 *   this frame's arena     sp_arena_alloc          gone when the buffer comes round (N frames)
 *   the thread caches      sp_tcache_alloc/free    (sp_tcache.h) general purpose, any thread
 *   the handle heap        sp_handle_* on sp_handles()  movable objects, compacted between frames
 *   the persistent region  sp_persistent_alloc     lives until sp_shutdown
 *
 * Init reserves one virtual range and carves it into named regions (central heap, frame
 * buffers, handle heap, persistent region); sp_region_of attributes any address to its region
 * in O(1). Subsystems start in this order and stop in the reverse one:
 *   1 platform (the reservation)  2 central heap  3 thread caches  4 frame arenas
 *   5 handle heap  6 jobs (the scheduler; workers register with liburcu QSBR)
 * A failure part-way stops what started, releases the reservation, logs the subsystem's name
 * (also returned by sp_init_failure) and returns its error.
 *
 * Quiescent states (liburcu QSBR, for structures retired with sp_retire, e.g. the handle
 * table after it grew): worker threads report one after every job and whenever a job parks,
 * go offline while they sleep, and the main thread reports one in every sp_frame_end and
 * nowhere else: not after the jobs it runs in a wait, and it stays online while it sleeps
 * in one, so it may hold an RCU-protected pointer from one sp_frame_end to the next, across
 * its own waits (sp_counter_wait, sp_parallel_for). A long wait on the main thread (a
 * loading screen outside frames, say) therefore holds reclamation back until the next
 * sp_frame_end (or sp_shutdown); only memory waits for it. A runtime thread (the reclaimer,
 * started by sp_init) frees what was retired once every registered thread has passed one;
 * nothing waits for it in a frame.
 *
 * Threads that are not workers: sp_thread_attach gives one a thread cache and registers it for
 * QSBR; it reports quiescent states with sp_thread_quiescent now and then (a thread that never
 * does delays reclamation, never a frame), goes offline with sp_thread_offline before it blocks
 * for long (I/O, a wait: reclamation then does not wait for it) and comes back with
 * sp_thread_online, and must sp_thread_detach before it exits and before sp_shutdown (one that
 * exits attached is detached at its exit, reported as misuse). Such a thread is not ordered
 * with the frame loop, so: the frame arena is not for it (a buffer is reclaimed under it), and
 * in the handle heap it uses alloc, free, pin and unpin, not bare resolve (a compaction step
 * may move a resolved block at any time; it holds the heap lock, so alloc, free, pin and unpin
 * wait for it, and a pinned block never moves). The jobs it submits follow the same handle
 * rule: compaction checks once, before it starts, that no job is live, and a job submitted
 * after that check runs beside it. A thread that never attached still may use the thread
 * caches: it shares their fallback cache, under a lock (the runtime's caches are
 * explicit_attach: no cache it does not know of outlives sp_shutdown).
 *
 * Concurrency:
 *   sp_init, sp_shutdown, sp_frame_begin, sp_frame_end,      the main thread (the one that
 *   sp_frame_stats_last, sp_between_frames_add/_remove        called sp_init), outside jobs
 *   sp_arena_alloc, sp_arena_aligned_alloc                   jobs that finish before the
 *                                                            frame's sp_frame_end returns
 *                                                            (the frame counter's, and jobs
 *                                                            they wait for), and the main
 *                                                            thread (between frames: for
 *                                                            the next frame); no other
 *                                                            thread (debug builds: misuse)
 *   sp_submit, sp_persistent_alloc, sp_retire,               any job, the main thread or an
 *   sp_region_of, sp_scheduler, sp_handles, sp_frames,       attached thread, any time
 *   sp_frame_counter                                         between init and shutdown (an
 *                                                            attached thread's sp_submit on
 *                                                            the frame counter may wait
 *                                                            while a frame closes: see it)
 *   sp_thread_attach, sp_thread_detach,                      a thread that is not a worker;
 *   sp_thread_quiescent, sp_thread_offline,                  attach/detach in pairs; an
 *   sp_thread_online                                         attach racing sp_shutdown
 *                                                            fails (SP_ERR_SHUTDOWN) or
 *                                                            makes it refuse, or both
 *   sp_status_get                                            any thread, not concurrently
 *                                                            with sp_init or sp_shutdown
 *                                                            (it would read the runtime's
 *                                                            figures while they are set
 *                                                            or cleared); the frame
 *                                                            figures of another thread's
 *                                                            call may lag by a frame
 * Frame arena memory must not be allocated while sp_frame_end flips the buffers: jobs on
 * counters of your own that outlive a frame may use the thread caches and the handle heap,
 * not the arena, and neither may the frame-counter jobs they submit (such a submit is not
 * held back while a frame closes, see sp_submit: only the frame counter's own jobs' submits
 * are ordered with the flip; the scheduler's hooks may not submit at all, sp_jobs.h). Handle-heap
 * compaction in sp_frame_end waits for a later frame if a job is live when it would start
 * (sp_jobs_idle, checked once: see attached threads above).
 *
 * Errors: calls before sp_init or after sp_shutdown, sp_init twice and sp_shutdown twice are
 * logged (SP_ERR_SHUTDOWN / SP_ERR_INVALID_ARG) and return an error or NULL; they never abort.
 * The thread caches set themselves up, standalone, at their first use: an allocation through
 * them before sp_init (or after sp_shutdown, before the next sp_init), like a direct
 * sp_tcache_init, makes sp_init fail (SP_ERR_INVALID_ARG, the central heap named, logged)
 * until sp_tcache_shutdown.
 * sp_frame_begin, sp_frame_end and sp_shutdown called from sp_frame_end's between-frames step,
 * or from a relocation callback of the main thread's own sp_handle_compact call, are refused
 * the same way (SP_ERR_INVALID_ARG). The runtime's handle heap, frame arena and scheduler end
 * with sp_shutdown only: sp_handle_heap_destroy(sp_handles()), sp_frame_arena_destroy(sp_frames()),
 * sp_jobs_shutdown / sp_jobs_destroy(sp_scheduler()) are misuse (SP_ERR_INVALID_ARG, nothing
 * done).
 */
#ifndef SP_RUNTIME_H
#define SP_RUNTIME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_frame.h"
#include "sp_handle.h"
#include "sp_jobs.h"
#include "sp_log.h"
#include "sp_platform.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Zero means the default for every field; the defaults are scaled to the machine: "physical
 * memory" below means the smaller of it and half the address space an RLIMIT_AS limit leaves
 * (under `ulimit -v 4194304`, sp_init(NULL) reserves about 1.4 GiB instead of 15.3 on a 24 GiB
 * machine). Threads take address space beyond the reservation: each worker its stack (8 MiB
 * by default) and, once it calls malloc, glibc's arena for it (64 MiB); under a tight limit
 * on a machine with many cores, set jobs.workers. */
typedef struct sp_desc {
    uint32_t canary_begin;  /* must be 0: a desc that was not zero-initialised is refused */
    bool huge_pages;        /* ask for huge pages for the reservation (granted: sp_status) */
    size_t heap_size;       /* central heap region: thread caches and large blocks
                               (0: half the physical memory, 256 MiB .. 64 GiB; at least
                               64 MiB, less is refused: SP_ERR_INVALID_ARG) */
    size_t frame_size;      /* bytes per frame buffer (0: physical memory / 64, 16 .. 256 MiB);
                               the frame region is frame_buffers of them */
    uint32_t frame_buffers; /* 0: 2; else 2..4 (1 and above 4 are refused:
                               SP_ERR_INVALID_ARG). Frame i uses buffer i mod N; its data
                               lives through frame i + N - 1 */
    size_t frame_chunk;     /* per-thread chunk of a buffer (0: the arena's default; above
                               4 TiB is misuse, SP_ERR_INVALID_ARG) */
    sp_frame_overflow frame_overflow; /* a full buffer: NULL (default) or the central heap */
    size_t handle_size;         /* handle heap region (0: physical memory / 8, 64 MiB .. 4 GiB;
                                   sizes are rounded up to 2 MiB: above 64 GiB - 2 MiB is
                                   refused, SP_ERR_INVALID_ARG) */
    uint32_t max_handles;       /* 0: the handle heap's default */
    size_t persistent_size;     /* persistent region (0: 64 MiB) */
    uint64_t between_budget_ns; /* time sp_frame_end may spend on between-frames work
                                   (tidy, registered work, compaction); 0: 1 ms */
    sp_jobs_desc jobs;          /* the scheduler (workers, fibers, hooks...; zeroes: defaults) */
    uint32_t canary_end;        /* must be 0 */
} sp_desc;

/* Regions of the reservation. */
typedef enum sp_region {
    SP_REGION_NONE = 0, /* not inside the reservation (or no runtime) */
    SP_REGION_HEAP = 1, /* the central heap: thread-cache spans and large blocks */
    SP_REGION_FRAME = 2,
    SP_REGION_HANDLE = 3,
    SP_REGION_PERSISTENT = 4,
    SP_REGION_COUNT = 5,
} sp_region;

typedef struct sp_region_info {
    const char *name; /* "heap", "frame", "handle", "persistent" */
    void *base;
    size_t size;
} sp_region_info;

/* One closed frame. Each allocator has two figures: what it holds at the frame's close (a
 * level: *_bytes, as jemalloc's "allocated"; the central heap's in spans) and the bytes asked of
 * it during the frame (a flow: *_allocated; frees are not counted). The flows (jobs_run,
 * retired and the *_allocated) count from the end of the last sp_frame_end (sp_init, for frame
 * 0) to the end of this one: what the program did between the two frames counts in this one,
 * and so does the between-frames work of this sp_frame_end (registered works, compaction);
 * everything up to the last sp_frame_end counts in exactly one record (what follows it,
 * before sp_shutdown, in none). The arena's one figure is both a level and a
 * flow: its buffer holds only this frame's data, counted in whole chunks (a frame that
 * allocated 16 bytes shows one chunk). */
typedef struct sp_frame_stats {
    uint64_t frame;      /* its number (the first frame is 0) */
    uint64_t frame_ns;   /* sp_frame_begin to the end of sp_frame_end */
    uint64_t wait_ns;    /* sp_frame_end's wait for the frame's jobs */
    uint64_t between_ns; /* between-frames work (tidy, fiber trim, registered work,
                            compaction) */
    uint64_t jobs_run;   /* jobs that finished (all of them, between frames included; each
                            piece of a parallel-for counts) */
    size_t arena_bytes;  /* taken from the frame's buffer (sp_frame_buffer_status) */
    size_t arena_peak;   /* that buffer's peak over all its frames */
    size_t arena_chunks;
    size_t arena_overflows;      /* requests the buffer could not serve (never silent) */
    size_t arena_overflow_bytes; /* of them, bytes the central heap served instead */
    size_t heap_bytes;           /* central heap in use (sp_tcache_heap_status): spans (of the
                                    caches, free blocks included; orphans, spares, the caches'
                                    records) and large blocks. Bytes in live blocks:
                                    sp_tcache_status_get, O(spans) */
    size_t heap_high_water;      /* the peaks of its span and large-block parts, added */
    size_t heap_allocated;       /* bytes asked of the thread caches and the large heap
                                    (sp_tcache_allocated's growth), the blocks of arena
                                    overflows the heap served included (with their headers) */
    size_t trimmed_bytes;        /* bytes of spans the main thread's sp_tcache_tidy gave back */
    size_t handle_bytes;         /* handle heap: live bytes */
    size_t handle_allocated;     /* bytes asked for by handle allocations */
    size_t handle_moved;         /* bytes compaction moved this frame */
    double handle_fragmentation;
    size_t persistent_bytes;       /* taken from the persistent region since sp_init */
    size_t persistent_allocated;   /* of them, this frame's: what requests took (alignment
                                      padding, 1 byte for size 0, and requests whose commit
                                      failed included) */
    uint64_t retired;              /* sp_retire calls */
    uint32_t between_skipped;      /* works not run: the budget was spent (compaction also when
                                      jobs of the caller's own counters were still running) */
    uint32_t fiber_stacks_trimmed; /* fiber stacks sp_jobs_trim gave back (every 64th frame) */
} sp_frame_stats;

/* Figures of the runtime as a whole. */
typedef struct sp_status {
    bool initialised;
    sp_page_kind pages;        /* what backs the reservation */
    size_t reserved;           /* bytes of the reservation */
    uint64_t frame;            /* the current (or next) frame's number */
    bool in_frame;             /* between sp_frame_begin and sp_frame_end */
    uint32_t attached_threads; /* non-worker threads attached now */
    sp_region_info regions[SP_REGION_COUNT];
} sp_status;

/* ---- lifecycle ------------------------------------------------------------------------- */

/* Start the runtime; the calling thread becomes its main thread (and the scheduler's worker
 * 0). desc may be NULL (all defaults). Cost: a reservation, thread starts, the scheduler's
 * fiber pool. Returns SP_OK; SP_ERR_INVALID_ARG for a desc that is misuse (a canary not zero,
 * frame_buffers 1 or above 4, heap_size below 64 MiB, handle_size above 64 GiB - 2 MiB; and the
 * subsystems' own desc checks, e.g. a jobs desc sp_jobs_create refuses) and SP_ERR_OVERFLOW (a
 * region above 64 TiB: heap_size, frame_size x frame_buffers, handle_size or persistent_size):
 * reported as misuse, so debug builds abort (sp_log.h; sp_misuse_set_fatal(false) makes them
 * return); SP_ERR_INVALID_ARG, logged and never fatal, when already initialised; or the failing
 * subsystem's error (e.g. SP_ERR_NOMEM, SP_ERR_OS, or SP_ERR_TOO_SMALL from the frame arenas
 * for a frame_chunk larger than a frame buffer), everything started so far stopped again
 * (sp_init_failure names the subsystem). */
sp_result sp_init(const sp_desc *desc);

/* The subsystem whose start failed in the last sp_init ("platform", "central heap", "thread
 * caches", "frame arenas", "handle heap", "jobs"), or NULL if it succeeded. Main thread. */
const char *sp_init_failure(void);

/* Run every pending job, stop the subsystems in reverse order, release the reservation.
 * Returns SP_OK; SP_ERR_SHUTDOWN (logged) if not initialised; SP_ERR_INVALID_ARG (logged,
 * nothing stopped) inside a frame, from a job, from sp_frame_end's between-frames step (a
 * work or a relocation callback) or a relocation callback of the main thread's own
 * sp_handle_compact, with threads still attached, or with a thread that attached
 * to the thread caches directly (sp_tcache_thread_attach); or the scheduler's SP_ERR_STALLED
 * when jobs had to be abandoned (the rest is still stopped). Leaks are reported through the
 * logger (blocks still live in the heap or handle heap). */
sp_result sp_shutdown(void);

/* Attach a thread that is not a worker: a thread cache now and a QSBR registration (so that
 * reclamation knows about the thread). Returns SP_OK; SP_ERR_SHUTDOWN before init, after
 * shutdown, or when it ran into an sp_shutdown in progress (which may then still have
 * refused: SP_ERR_SHUTDOWN does not say the runtime is going down; try again later);
 * SP_ERR_INVALID_ARG on a worker, the main thread or an already attached thread; SP_ERR_NOMEM
 * without memory for the thread's cache. An attach that gets past sp_shutdown's check makes it
 * refuse. */
sp_result sp_thread_attach(void);

/* Detach: the cache is handed back, the QSBR registration ends. Before the thread exits and
 * before sp_shutdown. Returns SP_OK or SP_ERR_INVALID_ARG (not attached). */
sp_result sp_thread_detach(void);

/* An attached thread reports that it holds no pointer into RCU-protected structures (cost:
 * liburcu's quiescent-state store and a load). Workers need not call it. No-op on a thread that is
 * not attached. */
void sp_thread_quiescent(void);

/* An attached thread about to block goes offline: until sp_thread_online it holds no pointer
 * into RCU-protected data (anything it or others hand to sp_retire, and sp_handle_resolve's
 * table, which an attached thread does not use anyway) and reclamation does not wait for it.
 * Offline it may use the thread caches, the handle heap's alloc/free/pin/unpin (they read the
 * table under the heap lock) and submit jobs (sp_parallel_for may run the function
 * inline on the calling thread: it must then not read RCU-protected data either). Online
 * again, it counts as quiescent at once; reclamation waits for it from the next grace period.
 * Offline twice, online while online, and both on a thread that is not attached are no-ops;
 * sp_thread_quiescent while offline is a no-op; detaching while offline is fine. Cost:
 * liburcu's thread_offline (two fences, a store, maybe a futex wake) / thread_online (a
 * store and a fence). */
void sp_thread_offline(void);
void sp_thread_online(void);

/* The runtime's figures into *out (initialised false, the rest zero, when it is not up). Any
 * thread, but not while another thread runs sp_init or sp_shutdown (see the table above). A
 * NULL out is misuse (SP_ERR_INVALID_ARG reported, nothing written; debug builds
 * abort). */
void sp_status_get(sp_status *out);

/* ---- memory ---------------------------------------------------------------------------- */

/* The region p lies in, O(1) (four compares); SP_REGION_NONE outside the reservation. */
sp_region sp_region_of(const void *p);

/* size bytes (0: one byte, so that the pointer lies in the region), aligned to align (a power
 * of two up to 4096; 0: 16), living until sp_shutdown.
 * A CAS loop; growing past the committed part takes a mutex and commits 2 MiB steps. NULL
 * (logged) when the region is full or before init; a bad alignment is misuse (NULL; debug
 * builds abort). */
void *sp_persistent_alloc(size_t size, size_t align);

/* Call free_fn(p) once no registered thread can still hold p (after a QSBR grace period),
 * on the runtime's reclaimer thread. Any thread. Cost: one small allocation and a lock-free
 * push (a CAS loop). Returns SP_OK, SP_ERR_NOMEM or SP_ERR_SHUTDOWN; a NULL free_fn is misuse
 * (SP_ERR_INVALID_ARG; debug builds abort). */
sp_result sp_retire(void *p, void (*free_fn)(void *));

/* The subsystems, for their own APIs (stable between sp_init and sp_shutdown; NULL outside).
 * sp_shutdown frees them: a call through a pointer saved from before is undefined (only the
 * sp_* runtime entry points answer SP_ERR_SHUTDOWN), as are counters of the scheduler. */
sp_jobs *sp_scheduler(void);
sp_frame_arena *sp_frames(void);
sp_handle_heap *sp_handles(void);

/* Runtime globals the inline calls below read (not API). arena is the frame arena while the
 * runtime is up in release builds (SP_DEBUG 0); NULL otherwise: debug builds of the library
 * keep it NULL so that every call takes the out-of-line path, which checks the caller. */
typedef struct sp_runtime_globals {
    sp_frame_arena *arena;
} sp_runtime_globals;
extern sp_runtime_globals sp_runtime_g;

/* From the current frame's arena buffer: valid until the buffer comes round again (frame +
 * N). For jobs (see the concurrency table: those of the frame counter, or that finish before
 * the frame's sp_frame_end returns) and the main thread (between frames, outside sp_frame_end,
 * it allocates for the next frame: the buffers were flipped at the last one). Not for other
 * threads, attached or not: a buffer may be reclaimed under them; debug builds report such a
 * call as misuse (SP_ERR_INVALID_ARG, NULL; abort unless sp_misuse_set_fatal(false)), release
 * builds do not check. NULL when the buffer is full in SP_FRAME_OVERFLOW_NULL mode (counted
 * in the frame's statistics), on misuse (see sp_frame_alloc), and before init (logged,
 * SP_ERR_SHUTDOWN). Cost: release builds sp_frame_alloc's plus one predictable branch; debug
 * builds add a call and the caller check (two thread-local reads). */
void *sp_arena_alloc_slow(size_t size);
void *sp_arena_aligned_alloc_slow(size_t align, size_t size);
static inline void *sp_arena_alloc(size_t size) {
    sp_frame_arena *a = sp_runtime_g.arena;
    return __builtin_expect(a != NULL, 1) ? sp_frame_alloc(a, size) : sp_arena_alloc_slow(size);
}
static inline void *sp_arena_aligned_alloc(size_t align, size_t size) {
    sp_frame_arena *a = sp_runtime_g.arena;
    return __builtin_expect(a != NULL, 1) ? sp_frame_aligned_alloc(a, align, size)
                                          : sp_arena_aligned_alloc_slow(align, size);
}

/* ---- jobs and frames ------------------------------------------------------------------- */

/* The counter of the current frame's jobs: sp_frame_end waits until it is back to 0. The
 * runtime's: sp_counter_destroy refuses it (misuse SP_ERR_INVALID_ARG). Raise it for work you
 * signal later; lowering it below the jobs it counts is misuse, found when sp_frame_begin or
 * sp_frame_end sees it below 0 (SP_ERR_INVALID_ARG, the counter set back to 0; a frame end
 * may already have stopped waiting for jobs still running). */
sp_counter *sp_frame_counter(void);

/* sp_jobs_submit on the runtime's scheduler; a NULL counter means the frame counter, so
 * sp_frame_end waits for these jobs. A frame-counter submit from a thread that is not one of
 * the runtime's (an attached thread, or one that never attached) may wait while a frame
 * closes: from the start of sp_frame_end's wait for the frame's jobs until the arena has
 * moved to the next buffer it sleeps, and its jobs then belong to the next frame (one made
 * before that wait began belongs to the closing frame, which waits for it). So that the jobs
 * may use the arena: without the wait they could run while sp_frame_end flips its buffers.
 * A frame's jobs must therefore not wait for something such a thread does only after a
 * frame-counter submit (the frame would never close). The main thread and the runtime's
 * workers never wait here (a job's submit raises the counter before the job ends), nor do other
 * counters' submits, nor is the frame counter raised by other means (sp_jobs_submit,
 * sp_counter_add) held back: from other threads those are not ordered with the flip. Cost from such
 * a thread: two atomic adds and a load more. Returns what sp_jobs_submit returns, SP_ERR_SHUTDOWN
 * before init. */
sp_result sp_submit(const sp_job_desc *jobs, uint32_t count, sp_counter *counter);

/* Open a frame (main thread, outside jobs). Returns SP_OK, SP_ERR_SHUTDOWN before init,
 * SP_ERR_INVALID_ARG (logged) if a frame is already open, from a job, from sp_frame_end's
 * between-frames step, or from a relocation callback (see the top of this file). */
sp_result sp_frame_begin(void);

/* Close the frame (main thread, outside jobs): wait for the frame counter (the main thread
 * runs jobs meanwhile), move the arena to the next buffer and reclaim the one that comes
 * round, let the thread caches give back surplus spans (every 64th frame also the scheduler
 * the spare fibers no wait used over those 64 frames: sp_jobs_trim, at most 64 stacks, one
 * madvise each), run the between-frames works in registration order and then handle-heap
 * compaction within desc.between_budget_ns, report the main thread's quiescent state (its
 * only one: see the top of this file), and close the frame's statistics record. Returns SP_OK,
 * SP_ERR_SHUTDOWN before init, SP_ERR_INVALID_ARG (logged) without an open frame, from a job,
 * from its own between-frames step, or from a relocation callback. */
sp_result sp_frame_end(void);

/* The record of the last closed frame into *out. Returns SP_OK, SP_ERR_LIMIT if no frame was
 * closed yet, SP_ERR_SHUTDOWN (logged) when the runtime is not up, SP_ERR_INVALID_ARG (logged)
 * from another thread than the main thread or from a job (sp_frame_end writes the record); a
 * NULL out is misuse (SP_ERR_INVALID_ARG; debug builds abort). */
sp_result sp_frame_stats_last(sp_frame_stats *out);

/* Between-frames work: fn(user, budget_ns) runs in sp_frame_end on the main thread with the
 * time left of the budget (never called when none is left: counted in between_skipped). It
 * should return within that time. At most 16 works. A work may add and remove works, itself
 * included: a removed work is not called again, not even later in the same frame; an added
 * one runs in that frame's turn after the works before it. Returns SP_OK, SP_ERR_LIMIT (full),
 * SP_ERR_INVALID_ARG (NULL fn, or the same fn and user twice), SP_ERR_SHUTDOWN. */
typedef void (*sp_between_fn)(void *user, uint64_t budget_ns);
sp_result sp_between_frames_add(const char *name, sp_between_fn fn, void *user);
sp_result sp_between_frames_remove(sp_between_fn fn, void *user);

#ifdef __cplusplus
}
#endif

#endif
