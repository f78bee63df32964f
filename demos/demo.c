/* spindle-demo: a stand-in until the flagship demo exists. It exercises what is built today:
 * a virtual-memory reservation (huge pages requested), one locked central TLSF heap on it,
 * and a few threads hammering the heap with malloc/free/realloc/aligned allocations.
 *
 * Prints the heap's status figures once a second and at the end; exits non-zero if a block's
 * contents were damaged, sp_tlsf_check finds a broken invariant, or any block is still live.
 *
 *   spindle-demo [SECONDS] [THREADS]     defaults: 1 second, 4 threads
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
#define MAX_THREADS 16
#define SLOTS 512 /* live blocks per thread, at most */

/* One live block: where, how many bytes the test asked for, and the byte it is filled with. */
typedef struct slot {
    uint8_t *ptr;
    size_t size;
    uint8_t fill;
} slot;

typedef struct worker {
    sp_thread thread;
    sp_tlsf *heap;
    uint64_t rng;
    atomic_bool *stop;
    slot slots[SLOTS];
    /* Results, read by main after the join. */
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

static void *worker_main(void *arg) {
    worker *w = arg;
    while (!atomic_load_explicit(w->stop, memory_order_relaxed)) {
        for (int i = 0; i < 64; i++) {
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
    for (size_t i = 0; i < SLOTS; i++)
        if (w->slots[i].ptr) slot_release(w, &w->slots[i]);
    return NULL;
}

static const char *page_kind_name(sp_page_kind k) {
    switch (k) {
    case SP_PAGES_HUGE: return "explicit huge pages (MAP_HUGETLB)";
    case SP_PAGES_TRANSPARENT: return "base pages with transparent huge pages requested";
    default: return "base pages";
    }
}

static void status_print(sp_tlsf *heap, double seconds) {
    sp_tlsf_status st;
    sp_tlsf_status_get(heap, &st);
    printf("%5.1f s  used %9zu B in %6zu blocks  free %9zu B in %5zu blocks  largest free %9zu B"
           "  fragmentation %5.1f %%  high-water %9zu B\n",
           seconds, st.bytes_used, st.live_blocks, st.bytes_free, st.free_blocks, st.largest_free,
           100.0 * st.fragmentation, st.high_water);
    fflush(stdout);
}

/* Sleep until sp_time_ns() reaches `deadline` (futex timeouts may end early). */
static void sleep_until(uint64_t deadline) {
    uint32_t never = 0;
    for (uint64_t now = sp_time_ns(); now < deadline; now = sp_time_ns())
        sp_futex_wait(&never, 0, deadline - now);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    int nthreads = argc > 2 ? atoi(argv[2]) : 4;
    if (seconds <= 0 || seconds > 3600 || nthreads < 1 || nthreads > MAX_THREADS) {
        fprintf(stderr, "usage: %s [SECONDS (0-3600]] [THREADS 1-%d]\n", argv[0], MAX_THREADS);
        return 2;
    }

    int status = 1;
    uint8_t *memory = NULL;
    sp_tlsf *heap = NULL;
    worker *workers = NULL;
    int started = 0;
    atomic_bool stop = false;

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

    workers = calloc((size_t)nthreads, sizeof *workers);
    if (!workers) goto out;
    printf("%d threads doing random malloc/free/realloc/aligned_alloc on one locked TLSF heap "
           "for %.1f s (%" PRIu32 " CPUs)\n",
           nthreads, seconds, sp_cpu_count());

    uint64_t t0 = sp_time_ns();
    for (int i = 0; i < nthreads; i++) {
        workers[i].heap = heap;
        workers[i].rng = 0x5eed0000u + (uint64_t)i;
        workers[i].stop = &stop;
        char name[16];
        snprintf(name, sizeof name, "demo-worker-%d", i);
        if (sp_thread_start(&workers[i].thread, worker_main, &workers[i], name) != SP_OK) {
            fprintf(stderr, "sp_thread_start failed\n");
            break;
        }
        started++;
    }

    /* Status once a second while the threads run, then stop them. */
    const uint64_t end = t0 + (uint64_t)(seconds * 1e9);
    for (uint64_t next = t0 + 1000000000u; started == nthreads && next < end; next += 1000000000u) {
        sleep_until(next);
        status_print(heap, (double)(sp_time_ns() - t0) / 1e9);
    }
    if (started == nthreads) sleep_until(end);
    status_print(heap, (double)(sp_time_ns() - t0) / 1e9);
    atomic_store(&stop, true);

    uint64_t ops = 0, oom = 0, damaged = 0;
    for (int i = 0; i < started; i++) {
        sp_thread_join(workers[i].thread);
        ops += workers[i].ops;
        oom += workers[i].out_of_memory;
        damaged += workers[i].damaged;
    }
    double took = (double)(sp_time_ns() - t0) / 1e9;
    printf("after join (every thread freed its blocks):\n");
    status_print(heap, took);
    printf("%" PRIu64 " operations in %.2f s, %" PRIu64 " refused for lack of memory\n", ops, took,
           oom);

    sp_tlsf_status st;
    sp_tlsf_status_get(heap, &st);
    sp_result check = sp_tlsf_check(heap);
    bool ok = started == nthreads;
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
    if (heap) sp_tlsf_destroy(heap);
    free(workers);
    if (memory) sp_vm_release(memory, HEAP_BYTES);
    return status;
}
