/* spindle-demo: a stand-in until the flagship demo exists. It exercises what is built today:
 * a virtual-memory reservation (huge pages requested), one locked central TLSF heap on it, and
 * the job scheduler running "frames": each frame a batch of jobs (one per lane) churns the
 * heap with malloc/free/realloc/aligned allocations, then a parallel_for checks every live
 * block's contents.
 *
 * Prints the heap's and the scheduler's figures once a second and at the end; exits non-zero
 * if a block's contents were damaged, sp_tlsf_check finds a broken invariant, or any block is
 * still live.
 *
 *   spindle-demo [SECONDS] [LANES]     defaults: 1 second, 16 lanes
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spindle.h"

#define HEAP_BYTES ((size_t)32 << 20) /* a multiple of the 2 MiB huge page */
#define MAX_LANES 256
#define SLOTS 512 /* live blocks per lane, at most */
#define OPS_PER_JOB 256

/* One live block: where, how many bytes the test asked for, and the byte it is filled with. */
typedef struct slot {
    uint8_t *ptr;
    size_t size;
    uint8_t fill;
} slot;

/* A lane: the blocks one job of each frame works on. Frames run one after another and each
 * lane has one job per frame, so a lane is never touched by two jobs at once. */
typedef struct worker {
    sp_tlsf *heap;
    uint64_t rng;
    slot slots[SLOTS];
    uint64_t ops;
    uint64_t out_of_memory; /* NULL from a full heap: expected now and then, not an error */
    uint64_t damaged;       /* blocks whose contents changed while they were live */
} worker;

/* splitmix64: small and good enough to pick sizes and operations. */
static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

/* Mostly small blocks, some medium, a few large: the mix a game's central heap sees. */
static size_t size_pick(uint64_t *rng) {
    uint64_t r = rng_next(rng);
    switch (r % 16) {
    case 0: return (size_t)(r >> 8) % (256 * 1024) + 1; /* up to 256 KiB */
    case 1:
    case 2: return (size_t)(r >> 8) % 16384 + 1; /* up to 16 KiB */
    default: return (size_t)(r >> 8) % 512;      /* 0..511 bytes */
    }
}

/* Whether all `size` bytes of a block still hold `fill`. */
static bool block_intact(const uint8_t *p, size_t size, uint8_t fill) {
    for (size_t i = 0; i < size; i++)
        if (p[i] != fill) return false;
    return true;
}

static void slot_release(worker *w, slot *s) {
    if (!block_intact(s->ptr, s->size, s->fill)) w->damaged++;
    sp_tlsf_free(w->heap, s->ptr);
    s->ptr = NULL;
}

/* Fill an empty slot with a new block: plain or over-aligned. */
static void slot_fill(worker *w, slot *s) {
    size_t size = size_pick(&w->rng);
    uint64_t r = rng_next(&w->rng);
    uint8_t *p;
    if (r % 8 == 0) {
        size_t align = (size_t)16 << (r >> 8) % 9; /* 16 B .. 4 KiB */
        p = sp_tlsf_aligned_alloc(w->heap, align, size);
        if (p && ((uintptr_t)p & (align - 1)) != 0) w->damaged++;
    } else {
        p = sp_tlsf_malloc(w->heap, size);
    }
    if (!p) {
        w->out_of_memory++;
        return;
    }
    s->ptr = p;
    s->size = size;
    s->fill = (uint8_t)(r >> 32);
    memset(p, s->fill, size);
}

/* Grow or shrink a live block; the kept prefix must survive, the rest is refilled. */
static void slot_resize(worker *w, slot *s) {
    size_t size = size_pick(&w->rng);
    if (size == 0) size = 1; /* realloc(p, 0) frees: keep this a resize */
    uint8_t *p = sp_tlsf_realloc(w->heap, s->ptr, size);
    if (!p) {
        w->out_of_memory++; /* the old block is untouched and still ours */
        return;
    }
    size_t kept = size < s->size ? size : s->size;
    if (!block_intact(p, kept, s->fill)) w->damaged++;
    memset(p, s->fill, size);
    s->ptr = p;
    s->size = size;
}

/* One frame's job for a lane. */
static void lane_churn(void *arg) {
    worker *w = arg;
    for (int i = 0; i < OPS_PER_JOB; i++) {
        uint64_t r = rng_next(&w->rng);
        slot *s = &w->slots[r % SLOTS];
        if (!s->ptr)
            slot_fill(w, s);
        else if ((r >> 32) % 4 == 0)
            slot_resize(w, s);
        else
            slot_release(w, s);
        w->ops++;
    }
}

/* The last frame's job for a lane: free everything. */
static void lane_drain(void *arg) {
    worker *w = arg;
    for (size_t i = 0; i < SLOTS; i++)
        if (w->slots[i].ptr) slot_release(w, &w->slots[i]);
}

/* parallel_for body: check the contents of lanes [begin, end). */
static atomic_uint_fast64_t check_damaged;
static void lanes_check(void *arg, uint64_t begin, uint64_t end) {
    worker *lanes = arg;
    for (uint64_t l = begin; l < end; l++)
        for (size_t i = 0; i < SLOTS; i++) {
            const slot *s = &lanes[l].slots[i];
            if (s->ptr && !block_intact(s->ptr, s->size, s->fill))
                atomic_fetch_add(&check_damaged, 1);
        }
}

/* Submit one job per lane and wait for them. */
static bool frame_run(sp_jobs *jobs, sp_counter *done, worker *lanes, int nlanes, sp_job_fn fn,
                      sp_job_desc *descs) {
    for (int i = 0; i < nlanes; i++)
        descs[i] = (sp_job_desc){.fn = fn, .arg = &lanes[i], .name = "lane"};
    if (sp_jobs_submit(jobs, descs, (uint32_t)nlanes, done) != SP_OK) return false;
    return sp_counter_wait(done, 0) == SP_OK;
}

static const char *page_kind_name(sp_page_kind k) {
    switch (k) {
    case SP_PAGES_HUGE: return "explicit huge pages (MAP_HUGETLB)";
    case SP_PAGES_TRANSPARENT: return "base pages with transparent huge pages requested";
    default: return "base pages";
    }
}

static void status_print(sp_tlsf *heap, sp_jobs *jobs, uint64_t frames, double seconds) {
    sp_tlsf_status st;
    sp_tlsf_status_get(heap, &st);
    sp_jobs_status js;
    sp_jobs_status_get(jobs, &js);
    printf("%5.1f s  frame %6" PRIu64 "  jobs %8" PRIu64 " (%" PRIu64 " stolen)  heap: used %9zu B"
           " in %6zu blocks, free %9zu B in %5zu blocks, fragmentation %5.1f %%\n",
           seconds, frames, js.jobs_run, js.jobs_stolen, st.bytes_used, st.live_blocks,
           st.bytes_free, st.free_blocks, 100.0 * st.fragmentation);
    fflush(stdout);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    int nlanes = argc > 2 ? atoi(argv[2]) : 16;
    if (seconds <= 0 || seconds > 3600 || nlanes < 1 || nlanes > MAX_LANES) {
        fprintf(stderr, "usage: %s [SECONDS (0-3600]] [LANES 1-%d]\n", argv[0], MAX_LANES);
        return 2;
    }

    int status = 1;
    uint8_t *memory = NULL;
    sp_tlsf *heap = NULL;
    worker *lanes = NULL;
    sp_job_desc *descs = NULL;
    sp_jobs *jobs = NULL;
    sp_counter *done = NULL;

    sp_page_kind granted = SP_PAGES_NORMAL;
    memory = sp_vm_reserve(HEAP_BYTES, 0, true, &granted);
    if (!memory) {
        fprintf(stderr, "sp_vm_reserve(%zu) failed\n", HEAP_BYTES);
        goto out;
    }
    printf("reserved %zu MiB, huge pages requested: got %s\n", HEAP_BYTES >> 20,
           page_kind_name(granted));
    if (sp_vm_commit(memory, HEAP_BYTES) != SP_OK) {
        fprintf(stderr, "sp_vm_commit failed\n");
        goto out;
    }

    sp_result err = SP_OK;
    heap = sp_tlsf_create(
        &(sp_tlsf_desc){.memory = memory, .size = HEAP_BYTES, .locked = true, .name = "demo"},
        &err);
    if (!heap) {
        fprintf(stderr, "sp_tlsf_create failed: %s\n", sp_result_name(err));
        goto out;
    }
    err = sp_jobs_create(&jobs, NULL); /* defaults: one worker per core */
    if (err != SP_OK) {
        fprintf(stderr, "sp_jobs_create failed: %s\n", sp_result_name(err));
        goto out;
    }
    done = sp_counter_create(jobs, "frame");
    lanes = calloc((size_t)nlanes, sizeof *lanes);
    descs = calloc((size_t)nlanes, sizeof *descs);
    if (!done || !lanes || !descs) goto out;
    sp_jobs_status js;
    sp_jobs_status_get(jobs, &js);
    printf("%d lanes of random malloc/free/realloc/aligned_alloc on one locked TLSF heap, one "
           "job per lane per frame, for %.1f s (%" PRIu32 " CPUs, %u workers + the main "
           "thread)\n",
           nlanes, seconds, sp_cpu_count(), js.workers);
    for (int i = 0; i < nlanes; i++) {
        lanes[i].heap = heap;
        lanes[i].rng = 0x5eed0000u + (uint64_t)i;
    }

    /* Frames until the time is up: churn, then check every live block in parallel. */
    uint64_t t0 = sp_time_ns(), frames = 0, damaged = 0;
    const uint64_t end = t0 + (uint64_t)(seconds * 1e9);
    bool ran = true;
    for (uint64_t next = t0 + 1000000000u, now = t0; ran && now < end; now = sp_time_ns()) {
        ran = frame_run(jobs, done, lanes, nlanes, lane_churn, descs) &&
              sp_parallel_for(jobs, 0, (uint64_t)nlanes, 1, lanes_check, lanes) == SP_OK;
        frames++;
        if (now >= next) {
            status_print(heap, jobs, frames, (double)(now - t0) / 1e9);
            next += 1000000000u;
        }
    }
    status_print(heap, jobs, frames, (double)(sp_time_ns() - t0) / 1e9);
    ran = ran && frame_run(jobs, done, lanes, nlanes, lane_drain, descs);

    uint64_t ops = 0, oom = 0;
    for (int i = 0; i < nlanes; i++) {
        ops += lanes[i].ops;
        oom += lanes[i].out_of_memory;
        damaged += lanes[i].damaged;
    }
    damaged += atomic_load(&check_damaged);
    double took = (double)(sp_time_ns() - t0) / 1e9;
    printf("after the last frame (every lane freed its blocks):\n");
    status_print(heap, jobs, frames, took);
    printf("%" PRIu64 " heap operations in %" PRIu64 " frames in %.2f s, %" PRIu64
           " refused for lack of memory\n",
           ops, frames, took, oom);

    sp_tlsf_status st;
    sp_tlsf_status_get(heap, &st);
    sp_result check = sp_tlsf_check(heap);
    bool ok = ran;
    if (!ran) printf("FAIL: a frame could not be submitted or waited for\n");
    if (damaged) {
        printf("FAIL: %" PRIu64 " blocks were damaged or misaligned\n", damaged);
        ok = false;
    }
    if (check != SP_OK) {
        printf("FAIL: sp_tlsf_check: %s\n", sp_result_name(check));
        ok = false;
    }
    if (st.live_blocks != 0 || st.bytes_used != 0) {
        printf("FAIL: %zu blocks (%zu bytes) still live\n", st.live_blocks, st.bytes_used);
        ok = false;
    }
    size_t leaked = sp_tlsf_destroy(heap);
    heap = NULL;
    if (leaked) {
        printf("FAIL: sp_tlsf_destroy reports %zu live blocks\n", leaked);
        ok = false;
    }
    if (ok) printf("ok: heap check passed, every block freed\n");
    status = ok ? 0 : 1;

out:
    sp_counter_destroy(done);
    sp_jobs_destroy(jobs);
    if (heap) sp_tlsf_destroy(heap);
    free(descs);
    free(lanes);
    if (memory) sp_vm_release(memory, HEAP_BYTES);
    return status;
}
