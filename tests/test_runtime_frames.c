/* 10,000 frames of jobs allocating from every allocator: the frame arena (checked within the
 * frame and the next), the thread caches (small and large blocks, freed by other jobs on
 * other workers a frame later), the handle heap (objects that live a few frames, resolved and
 * pinned by jobs, compacted between frames) and the persistent region. At the end, after the
 * last objects are freed, every status figure is back at its start value. Run under
 * ThreadSanitizer in CI (the concurrency suite). */
#include <stdatomic.h>
#include <string.h>

#include "spindle.h"
#include "test_support.h"

enum { JOBS = 4, PER_JOB = 8, LIVE = 3, BURST = 1500 }; /* handle objects live LIVE frames */

/* The allocators a frame's bytes are asked of: the thread caches, the handle heap, the
 * persistent region. */
enum { ASK_HEAP, ASK_HANDLE, ASK_PERSISTENT, ASKED };

typedef struct lane {
    ts_rng rng;
    uint8_t *arena_prev[PER_JOB]; /* last frame's arena blocks (still valid this frame) */
    size_t arena_prev_size[PER_JOB];
    void *heap[PER_JOB]; /* thread-cache blocks to be freed next frame */
    size_t heap_size[PER_JOB];
    sp_handle handles[LIVE][PER_JOB];
    sp_handle burst[BURST];
    uint64_t frame;
    size_t asked[ASKED]; /* this frame's bytes asked of each allocator */
    int bad;
} lane;

static lane lanes[JOBS];
static atomic_ullong persistent; /* bytes the jobs took from the persistent region */

static uint8_t pattern(uint64_t frame, int lane_i, int k) {
    return (uint8_t)(frame * 7 + (uint64_t)lane_i * 31 + (uint64_t)k + 1);
}

static void lane_job(void *arg) {
    lane *l = arg;
    int li = (int)(l - lanes);
    uint64_t f = l->frame;
    sp_handle_heap *hh = sp_handles();
    if (f % 1000 == (uint64_t)li) { /* the persistent region, from a job */
        uint8_t *p = sp_persistent_alloc(64, 16);
        if (p) {
            memset(p, 0x5A, 64);
            atomic_fetch_add(&persistent, 64);
            l->asked[ASK_PERSISTENT] += 64;
        } else {
            l->bad++;
        }
    }
    if (f % 2500 == 1) {
        for (int i = 0; i < BURST; i++) l->burst[i] = sp_handle_alloc(hh, 24, 16);
        l->asked[ASK_HANDLE] += 24 * BURST;
        for (int i = 0; i < BURST; i++) l->bad += sp_handle_free(hh, l->burst[i]) != SP_OK;
    }
    for (int k = 0; k < PER_JOB; k++) {
        /* Last frame's arena data is still valid. */
        if (l->arena_prev[k] &&
            !ts_filled(l->arena_prev[k], l->arena_prev_size[k], pattern(f - 1, li, k)))
            l->bad++;
        size_t n = (size_t)ts_rng_range(&l->rng, 16, 256);
        uint8_t *a = sp_arena_alloc(n);
        if (!a) {
            l->bad++;
        } else {
            memset(a, pattern(f, li, k), n);
        }
        l->arena_prev[k] = a;
        l->arena_prev_size[k] = n;

        /* Thread caches: free last frame's block (allocated on whichever worker ran this lane
         * then), allocate a new one (now and then a large one). */
        if (l->heap[k] && !ts_filled(l->heap[k], l->heap_size[k], pattern(f - 1, li, k))) l->bad++;
        sp_tcache_free(l->heap[k]);
        size_t m =
            ts_rng_range(&l->rng, 0, 15) == 0 ? 40000 : (size_t)ts_rng_range(&l->rng, 16, 512);
        l->heap[k] = sp_tcache_alloc(m);
        l->heap_size[k] = m;
        l->asked[ASK_HEAP] += m;
        if (l->heap[k])
            memset(l->heap[k], pattern(f, li, k), m);
        else
            l->bad++;

        /* Handle heap: the object made LIVE frames ago goes, a new one comes. Now and then a
         * burst of short-lived handles makes the table grow from jobs (the old tables are
         * retired through QSBR and freed by the runtime's reclaimer). */
        sp_handle *slot = &l->handles[f % LIVE][k];
        if (slot->id) {
            uint8_t *p = sp_handle_pin(hh, *slot);
            if (!p || !ts_filled(p, sp_handle_size(hh, *slot), pattern(f - LIVE, li, k))) l->bad++;
            sp_handle_unpin(hh, *slot);
            sp_handle_free(hh, *slot);
        }
        size_t hs = (size_t)ts_rng_range(&l->rng, 16, 4096);
        *slot = sp_handle_alloc(hh, hs, 16);
        l->asked[ASK_HANDLE] += hs;
        uint8_t *hp = sp_handle_resolve(hh, *slot);
        if (hp)
            memset(hp, pattern(f, li, k), hs);
        else
            l->bad++;
    }
}

static void trim_job(void *arg) {
    (void)arg;
    sp_tcache_trim();
}

int main(void) {
    uint32_t frames = ts_sanitized() ? 10000 : 10000;
    for (uint32_t workers = 1; workers <= 2; workers++) {
        sp_desc d = ts_small_desc(workers, 32);
        if (sp_init(&d) != SP_OK) {
            ok(0, "init");
            return done();
        }
        sp_tcache_status t0;
        sp_tcache_status_get(&t0);
        sp_handle_heap_status h0;
        sp_handle_heap_status_get(sp_handles(), &h0);
        sp_jobs_status j0;
        sp_jobs_status_get(sp_scheduler(), &j0);
        for (int i = 0; i < JOBS; i++) {
            memset(&lanes[i], 0, sizeof lanes[i]);
            ts_rng_seed(&lanes[i].rng, 1000 + (uint64_t)i);
        }
        atomic_store(&persistent, 0);
        size_t moved = 0, overflows = 0;
        sp_frame_stats first = {0};
        uint64_t retired = 0;
        uint32_t flows_off = 0; /* frames whose *_allocated differ from what the jobs asked */
        sp_job_desc jobs[JOBS];
        for (int i = 0; i < JOBS; i++) jobs[i] = (sp_job_desc){.fn = lane_job, .arg = &lanes[i]};
        for (uint32_t f = 0; f < frames; f++) {
            sp_frame_begin();
            for (int i = 0; i < JOBS; i++) {
                lanes[i].frame = f;
                memset(lanes[i].asked, 0, sizeof lanes[i].asked);
            }
            sp_submit(jobs, JOBS, NULL);
            sp_frame_end();
            sp_frame_stats st;
            sp_frame_stats_last(&st);
            if (f == 0) first = st;
            size_t asked[ASKED] = {0};
            for (int i = 0; i < JOBS; i++)
                for (int k = 0; k < ASKED; k++) asked[k] += lanes[i].asked[k];
            flows_off += st.heap_allocated != asked[ASK_HEAP] ||
                         st.handle_allocated != asked[ASK_HANDLE] ||
                         st.persistent_allocated != asked[ASK_PERSISTENT];
            moved += st.handle_moved;
            retired += st.retired;
            overflows += st.arena_overflows;
        }
        int bad = 0;
        for (int i = 0; i < JOBS; i++) bad += lanes[i].bad;
        is_int(bad, 0, "%u workers, %u frames: every block held its contents while valid", workers,
               frames);
        ok(moved > 0 && overflows == 0, "handle compaction moved %zu bytes; no arena overflow",
           moved);
        is_int(flows_off, 0,
               "every frame's heap, handle and persistent bytes allocated are what its jobs "
               "asked for");
        sp_handle_heap_status hg;
        sp_handle_heap_status_get(sp_handles(), &hg);
        ok(retired > 0 && hg.table_capacity >= BURST,
           "the handle table grew from jobs to %u slots; %llu old tables retired through QSBR",
           hg.table_capacity, (unsigned long long)retired);

        /* Free what is left, then two empty frames reclaim both arena buffers. */
        sp_handle_heap *hh = sp_handles();
        for (int i = 0; i < JOBS; i++)
            for (int k = 0; k < PER_JOB; k++) {
                sp_tcache_free(lanes[i].heap[k]);
                for (int s = 0; s < LIVE; s++)
                    if (lanes[i].handles[s][k].id) sp_handle_free(hh, lanes[i].handles[s][k]);
            }
        for (int i = 0; i < 2; i++) {
            sp_frame_begin();
            sp_frame_end();
        }
        /* Blocks freed into a worker's inbox count as live until that worker collects them:
         * each worker trims its cache (pinned job), the main thread its own. */
        sp_job_desc trims[3];
        for (uint32_t w = 1; w <= workers; w++)
            trims[w - 1] = (sp_job_desc){.fn = trim_job, .pinned = true, .worker = w};
        sp_frame_begin();
        sp_submit(trims, workers, NULL);
        sp_frame_end();
        sp_tcache_trim();
        sp_tcache_status t1;
        sp_tcache_status_get(&t1);
        sp_handle_heap_status h1;
        sp_handle_heap_status_get(hh, &h1);
        sp_jobs_status j1;
        sp_jobs_status_get(sp_scheduler(), &j1);
        ok(t1.bytes_used == t0.bytes_used && t1.live_blocks == t0.live_blocks &&
               t1.large_blocks == t0.large_blocks && t1.remote_pending == 0,
           "thread caches back to the start: %zu bytes, %zu blocks (start %zu, %zu)", t1.bytes_used,
           t1.live_blocks, t0.bytes_used, t0.live_blocks);
        ok(h1.live_bytes == h0.live_bytes && h1.live_handles == h0.live_handles &&
               h1.used_bytes == h0.used_bytes,
           "handle heap back to the start: %zu live bytes, %zu used", h1.live_bytes, h1.used_bytes);
        bool arenas_empty = true;
        for (uint32_t b = 0; b < 2; b++) {
            sp_frame_buffer_status bs;
            sp_frame_buffer_status_get(sp_frames(), b, &bs);
            arenas_empty = arenas_empty && bs.bytes_used == 0 && bs.overflows == 0;
        }
        ok(arenas_empty, "both arena buffers reclaimed");
        ok(j1.jobs_run == j1.jobs_submitted && j1.fibers_in_use <= j0.fibers_in_use + workers + 2,
           "scheduler: %llu jobs submitted, all run; %u fibers in use",
           (unsigned long long)j1.jobs_submitted, j1.fibers_in_use);
        sp_frame_stats last;
        sp_frame_stats_last(&last);
        ok(last.handle_bytes == h0.live_bytes && last.arena_overflows == 0 &&
               last.frame == frames + 2 && last.jobs_run == workers,
           "the last frame's record: handle bytes back to the start (%zu), frame %llu, its %llu "
           "jobs",
           last.handle_bytes, (unsigned long long)last.frame, (unsigned long long)last.jobs_run);
        uint64_t want = 64 * (uint64_t)JOBS * ((frames + 999) / 1000);
        ok(atomic_load(&persistent) == want &&
               last.persistent_bytes - first.persistent_bytes == want - 64, /* frame 0: lane 0 */
           "jobs took %llu bytes from the persistent region; the records grew by as much "
           "(%zu -> %zu)",
           (unsigned long long)atomic_load(&persistent), first.persistent_bytes,
           last.persistent_bytes);
        sp_status s;
        sp_status_get(&s);
        ok(s.initialised && !s.in_frame && s.frame == frames + 3 && s.attached_threads == 0,
           "runtime status: frame %llu next, none open, no thread attached",
           (unsigned long long)s.frame);
        is_int(sp_shutdown(), SP_OK, "shutdown");
    }
    return done();
}
