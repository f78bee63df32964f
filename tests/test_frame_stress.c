/* Frame arenas under the job scheduler: on 1, 2, 4 and 8 workers, each frame's jobs allocate
 * concurrently (sizes 1..300 B from chunks, some 2..6 KiB direct, some aligned), fill every
 * block with a pattern of (frame, job, block), and the main thread checks after the frame that
 * no two blocks overlap and every block of this frame and the previous one still holds its
 * pattern, then advances. Three arena setups per worker count: roomy buffers; small buffers
 * that overflow to a counting heap (blocks pushed concurrently, each freed exactly once); small
 * buffers that refuse (NULL mode: every refusal counted). Runs under ThreadSanitizer. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "sp_frame.h"
#include "sp_jobs.h"
#include "test_support.h"

enum { FRAMES = 8, JOBS = 32, MAX_ALLOCS = 1024 };

typedef struct block {
    uint8_t *p;
    uint32_t n;
    bool heap;
} block;

typedef struct job_rec {
    sp_frame_arena *a;
    uint64_t frame;
    uint32_t job, allocs;
    block b[MAX_ALLOCS];
    uint32_t refused;
} job_rec;

static job_rec recs[2][JOBS]; /* [frame % 2]: this frame's and the previous one's */
static uint32_t allocs_per_job;
static atomic_long heap_allocs, heap_frees;

static void *heap_alloc_counting(void *user, size_t align, size_t size) {
    (void)user;
    void *p = NULL;
    if (posix_memalign(&p, align, size) != 0) return NULL;
    atomic_fetch_add(&heap_allocs, 1);
    return p;
}

static void heap_free_counting(void *user, void *p) {
    (void)user;
    atomic_fetch_add(&heap_frees, 1);
    free(p);
}

static uint8_t pattern(uint64_t frame, uint32_t job, uint32_t i) {
    return (uint8_t)(frame * 131 + job * 17 + i * 3 + 1);
}

static void alloc_job(void *arg) {
    job_rec *r = arg;
    ts_rng rng;
    ts_rng_seed(&rng, r->frame * 1000 + r->job);
    r->refused = 0;
    for (uint32_t i = 0; i < r->allocs; i++) {
        uint64_t k = ts_rng_next(&rng);
        uint32_t n = k % 16 == 0 ? (uint32_t)ts_rng_range(&rng, 2000, 6000)
                                 : (uint32_t)ts_rng_range(&rng, 1, 300);
        size_t align = k % 5 == 0 ? (size_t)1 << ts_rng_range(&rng, 4, 9) : 16;
        uint8_t *p = align == 16 ? sp_frame_alloc(r->a, n) : sp_frame_aligned_alloc(r->a, align, n);
        r->b[i] = (block){p, n, p && sp_frame_arena_buffer_of(r->a, p) < 0};
        if (!p || ((uintptr_t)p & (align - 1))) {
            r->refused += !p;
            r->b[i].p = NULL;
            continue;
        }
        memset(p, pattern(r->frame, r->job, i), n);
    }
}

typedef struct run_result {
    int overlaps, damaged, misplaced, bad_counts;
    uint64_t heap_blocks, refused, blocks;
} run_result;

static void check_frame(sp_frame_arena *a, uint64_t f, run_result *out) {
    static ts_span all[JOBS * MAX_ALLOCS];
    size_t n = 0;
    uint64_t heap = 0, refused = 0;
    for (uint32_t j = 0; j < JOBS; j++) {
        job_rec *r = &recs[f % 2][j];
        refused += r->refused;
        for (uint32_t i = 0; i < r->allocs; i++) {
            block *b = &r->b[i];
            if (!b->p) continue;
            out->blocks++;
            if (b->heap) {
                heap++;
                continue;
            }
            out->misplaced += sp_frame_arena_buffer_of(a, b->p) != (int)(f % 2);
            all[n++] = (ts_span){(uintptr_t)b->p, b->n};
        }
    }
    out->overlaps += ts_overlaps(all, n);
    sp_frame_buffer_status st;
    sp_frame_buffer_status_get(a, (uint32_t)(f % 2), &st);
    /* Every overflow was either served by the heap or refused; nothing else overflows. */
    out->bad_counts += st.overflows != heap + refused || st.frame != f;
    out->heap_blocks += heap;
    out->refused += refused;
}

/* The blocks of frame f (still alive) hold their patterns. */
static void check_patterns(uint64_t f, run_result *out) {
    for (uint32_t j = 0; j < JOBS; j++) {
        job_rec *r = &recs[f % 2][j];
        for (uint32_t i = 0; i < r->allocs; i++)
            if (r->b[i].p && !ts_filled(r->b[i].p, r->b[i].n, pattern(f, j, i))) out->damaged++;
    }
}

static void run(uint32_t workers, int setup) {
    static const char *names[] = {"roomy", "small, heap fallback", "small, NULL"};
    sp_frame_desc d = {.buffers = 2, .chunk_size = 4096};
    if (setup == 0) {
        d.region_size = 2 * ((size_t)JOBS * MAX_ALLOCS * 6100 + 64 * 4096 * 2);
    } else {
        d.region_size = 2 * ((size_t)1 << 20);
        d.overflow = setup == 1 ? SP_FRAME_OVERFLOW_HEAP : SP_FRAME_OVERFLOW_NULL;
        d.heap_alloc = heap_alloc_counting;
        d.heap_free = heap_free_counting;
    }
    if (setup != 0) ts_log_capture(); /* the first overflow of each frame is logged */
    atomic_store(&heap_allocs, 0);
    atomic_store(&heap_frees, 0);
    sp_frame_arena *a = sp_frame_arena_create(&d, NULL);
    sp_jobs *s = NULL;
    if (!a || sp_jobs_create(&s, &(sp_jobs_desc){.workers = workers}) != SP_OK) {
        ok(0, "%u workers, %s: setup", workers, names[setup]);
        sp_frame_arena_destroy(a);
        return;
    }
    sp_counter *c = sp_counter_create(s, "frame");
    run_result res = {0};
    for (uint64_t f = 0; f < FRAMES; f++) {
        sp_job_desc jobs[JOBS];
        for (uint32_t j = 0; j < JOBS; j++) {
            recs[f % 2][j] = (job_rec){.a = a, .frame = f, .job = j, .allocs = allocs_per_job};
            jobs[j] = (sp_job_desc){.fn = alloc_job, .arg = &recs[f % 2][j], .name = "alloc"};
        }
        sp_jobs_submit(s, jobs, JOBS, c);
        sp_counter_wait(c, 0);
        check_frame(a, f, &res);
        check_patterns(f, &res);
        if (f > 0) check_patterns(f - 1, &res); /* still valid in frame f with N = 2 */
        sp_frame_arena_advance(a, NULL);
    }
    sp_counter_destroy(c);
    sp_jobs_destroy(s);
    long heap_before = atomic_load(&heap_allocs);
    ts_log_release();
    sp_frame_arena_destroy(a);
    bool heap_ok = atomic_load(&heap_frees) == heap_before &&
                   (uint64_t)heap_before == (setup == 1 ? res.heap_blocks : 0);
    bool overflowed = setup == 0   ? res.heap_blocks + res.refused == 0
                      : setup == 1 ? res.heap_blocks > 0 && res.refused == 0
                                   : res.refused > 0 && res.heap_blocks == 0;
    ok(res.overlaps == 0 && res.damaged == 0 && res.misplaced == 0 && res.bad_counts == 0 &&
           heap_ok && overflowed,
       "%u workers, %s: %llu blocks over %d frames, %llu from the heap, %llu refused; overlaps "
       "%d, damaged %d, wrong buffer %d, counts off %d, heap blocks freed %ld of %ld",
       workers, names[setup], (unsigned long long)res.blocks, FRAMES,
       (unsigned long long)res.heap_blocks, (unsigned long long)res.refused, res.overlaps,
       res.damaged, res.misplaced, res.bad_counts, atomic_load(&heap_frees), heap_before);
}

int main(void) {
    allocs_per_job = (uint32_t)ts_scaled(MAX_ALLOCS, 2);
    static const uint32_t workers[] = {1, 2, 4, 8};
    plan(12);
    for (int w = 0; w < 4; w++)
        for (int setup = 0; setup < 3; setup++) run(workers[w], setup);
    return done();
}
