/* TLSF edge cases: split, merge, realloc in place and moving, alignment, pools, status,
 * walker, and check() catching planted corruption. */
#include <stdlib.h>
#include <string.h>

#include "sp_tlsf.h"
#include "test_support.h"
#include "track.h"

enum { MiB = 1 << 20 };

static void *mem_of_heap[8];
static int heaps_made;

static sp_tlsf *heap_new(size_t bytes, bool locked) {
    void *mem = aligned_alloc(64, bytes);
    mem_of_heap[heaps_made++ % 8] = mem;
    sp_tlsf_desc d = {.memory = mem, .size = bytes, .locked = locked, .name = "test"};
    return sp_tlsf_create(&d, NULL);
}

/* Destroy the newest heap and free its memory; returns the blocks it still had. */
static size_t heap_free(sp_tlsf *t) {
    size_t live = sp_tlsf_destroy(t);
    free(mem_of_heap[--heaps_made % 8]);
    return live;
}

static sp_tlsf_status status(sp_tlsf *t) {
    sp_tlsf_status s;
    sp_tlsf_status_get(t, &s);
    return s;
}

/* Write and read metadata the way a stray user write would, without tripping ASan. */
TRACK_INTERNAL static uint64_t peek(const void *addr) {
    track_enter();
    uint64_t v = *(const volatile uint64_t *)addr;
    track_leave();
    return v;
}
TRACK_INTERNAL static void poke(void *addr, uint64_t v) {
    track_enter();
    *(volatile uint64_t *)addr = v;
    track_leave();
}

static void test_create(void) {
    sp_result err = SP_OK;
    ts_log_capture();
    ok(sp_tlsf_create(NULL, &err) == NULL && err == SP_ERR_INVALID_ARG, "create(NULL) fails");
    is_int(ts_logged.last_id, SP_ERR_INVALID_ARG, "create(NULL) is reported");
    char small[64];
    sp_tlsf_desc d = {.memory = small, .size = sizeof small};
    ok(sp_tlsf_create(&d, &err) == NULL && err == SP_ERR_TOO_SMALL,
       "tiny memory: SP_ERR_TOO_SMALL");
    d.size = 0;
    ok(sp_tlsf_create(&d, &err) == NULL && err == SP_ERR_TOO_SMALL, "zero-size memory refused");
    ts_log_release();

    sp_tlsf *t = heap_new(MiB, false);
    sp_tlsf_status s = status(t);
    ok(t && s.bytes_used == 0 && s.live_blocks == 0 && s.free_blocks == 1,
       "fresh heap: one free block");
    ok(s.largest_free == s.bytes_free && s.fragmentation == 0.0, "fresh heap: no fragmentation");
    ok(s.largest_free > MiB - sp_tlsf_control_size() - 64, "fresh heap: nearly all memory free");
    is_int(sp_tlsf_check(t), SP_OK, "fresh heap passes check");
    heap_free(t);
}

static void test_malloc_basics(void) {
    sp_tlsf *t = heap_new(MiB, false);
    void *a = sp_tlsf_malloc(t, 1), *z = sp_tlsf_malloc(t, 0), *z2 = sp_tlsf_malloc(t, 0);
    ok(a && ((uintptr_t)a & 15) == 0, "malloc(1) is 16-aligned");
    ok(z && z2 && z != z2 && z != a, "malloc(0) gives distinct blocks");
    is_int(sp_tlsf_usable_size(t, z), 16, "malloc(0) has 16 usable bytes");
    ok(sp_tlsf_owns(t, a) && !sp_tlsf_owns(t, &t) && !sp_tlsf_owns(t, NULL), "owns");
    void *b = sp_tlsf_malloc(t, 1000);
    ok(sp_tlsf_usable_size(t, b) >= 1000 && sp_tlsf_usable_size(t, b) < 1000 + 16, "usable size");
    memset(b, 0xab, sp_tlsf_usable_size(t, b));
    sp_tlsf_status s = status(t);
    is_int(s.live_blocks, 4, "four live blocks");
    is_int(s.bytes_used, 16 + 16 + 16 + 1008, "bytes_used counts granted sizes");
    ok(sp_tlsf_malloc(t, SIZE_MAX) == NULL && sp_tlsf_malloc(t, SP_TLSF_MAX_BLOCK + 1) == NULL,
       "overflowing sizes give NULL");
    ok(sp_tlsf_malloc(t, 2 * MiB) == NULL, "more than the heap gives NULL");
    is_int(sp_tlsf_check(t), SP_OK, "heap intact after refusals");
    sp_tlsf_free(t, NULL);
    sp_tlsf_free(t, a), sp_tlsf_free(t, z), sp_tlsf_free(t, z2), sp_tlsf_free(t, b);
    s = status(t);
    ok(s.bytes_used == 0 && s.live_blocks == 0 && s.free_blocks == 1, "all freed: one block again");
    ok(s.high_water == 16 + 16 + 16 + 1008, "high-water mark kept");
    is_int(heap_free(t), 0, "destroy reports no leak");
}

static void test_merge(void) {
    sp_tlsf *t = heap_new(MiB, false);
    size_t full = status(t).largest_free;
    void *a = sp_tlsf_malloc(t, 100), *b = sp_tlsf_malloc(t, 100), *c = sp_tlsf_malloc(t, 100),
         *d = sp_tlsf_malloc(t, 100);
    is_int(status(t).free_blocks, 1, "four blocks carved from one free block, which stays free");
    sp_tlsf_free(t, b);
    is_int(status(t).free_blocks, 2, "free b: a hole");
    sp_tlsf_free(t, a);
    is_int(status(t).free_blocks, 2, "free a: merges with its free neighbour b");
    ok(sp_tlsf_usable_size(t, c) == 112, "c untouched");
    sp_tlsf_free(t, c);
    is_int(status(t).free_blocks, 2, "free c: merges with its free neighbour a+b");
    char *lowest = a;
    if ((char *)b < lowest) lowest = b;
    if ((char *)c < lowest) lowest = c;
    void *abc = sp_tlsf_malloc(t, 3 * 112 + 2 * 16);
    ok(abc == lowest, "the merged hole serves a request of its exact size");
    sp_tlsf_free(t, abc);
    sp_tlsf_free(t, d);
    sp_tlsf_status s = status(t);
    ok(s.free_blocks == 1 && s.largest_free == full, "free d: merges both sides, heap whole again");
    is_int(sp_tlsf_check(t), SP_OK, "check after merges");
    heap_free(t);
}

static void test_realloc(void) {
    sp_tlsf *t = heap_new(MiB, false);
    unsigned char *a = sp_tlsf_malloc(t, 200);
    for (int i = 0; i < 200; i++) a[i] = (unsigned char)i;
    unsigned char *guard = sp_tlsf_malloc(t, 16);
    unsigned char *r = sp_tlsf_realloc(t, a, 64);
    ok(r == a && sp_tlsf_usable_size(t, a) == 64, "shrink stays in place");
    ok(status(t).free_blocks == 2, "shrink left a free tail before the guard block");
    r = sp_tlsf_realloc(t, a, 200);
    ok(r == a && sp_tlsf_usable_size(t, a) == 208, "grow into the freed tail stays in place");
    int intact = 1;
    for (int i = 0; i < 64; i++) intact &= a[i] == (unsigned char)i;
    ok(intact, "contents kept across in-place resizes");
    for (int i = 0; i < 200; i++) a[i] = (unsigned char)(i ^ 0x5a);
    r = sp_tlsf_realloc(t, a, 5000);
    ok(r && r != a && sp_tlsf_usable_size(t, r) >= 5000, "grow past a used neighbour moves");
    intact = 1;
    for (int i = 0; i < 200; i++) intact &= r[i] == (unsigned char)(i ^ 0x5a);
    ok(intact, "contents kept across a move");
    is_int(status(t).live_blocks, 2, "the old block was freed by the move");
    ok(sp_tlsf_realloc(t, r, SIZE_MAX) == NULL && sp_tlsf_usable_size(t, r) >= 5000,
       "realloc to an impossible size fails and keeps the block");
    ok(sp_tlsf_realloc(t, r, 0) == NULL && status(t).live_blocks == 1, "realloc(p, 0) frees p");
    void *n = sp_tlsf_realloc(t, NULL, 40);
    ok(n && sp_tlsf_usable_size(t, n) == 48, "realloc(NULL, n) allocates");
    sp_tlsf_free(t, n);
    sp_tlsf_free(t, guard);
    is_int(sp_tlsf_check(t), SP_OK, "check after reallocs");
    is_int(status(t).free_blocks, 1, "heap whole after reallocs");
    heap_free(t);
}

static void test_aligned(void) {
    sp_tlsf *t = heap_new(8 * MiB, false);
    void *ps[32];
    int n = 0, aligned = 1;
    void *spacer = sp_tlsf_malloc(t, 48); /* so the first payload is not already aligned */
    for (size_t align = 1; align <= (1u << 20); align <<= 1) {
        void *p = sp_tlsf_aligned_alloc(t, align, 24 + align / 3);
        aligned &=
            p && ((uintptr_t)p & (align - 1)) == 0 && sp_tlsf_usable_size(t, p) >= 24 + align / 3;
        if (p) memset(p, 0x11, 24 + align / 3);
        ps[n++] = p;
    }
    ok(aligned, "aligned_alloc honours every power of two from 1 to 1 MiB");
    is_int(sp_tlsf_check(t), SP_OK, "check after aligned allocations");
    for (int i = 0; i < n; i++) sp_tlsf_free(t, ps[i]);
    sp_tlsf_free(t, spacer);
    is_int(status(t).free_blocks, 1, "aligned blocks and their gaps merge back");
    ts_log_capture();
    ok(sp_tlsf_aligned_alloc(t, 48, 10) == NULL, "alignment 48 refused");
    is_int(ts_logged.last_id, SP_ERR_BAD_ALIGNMENT, "bad alignment reported");
    ok(sp_tlsf_aligned_alloc(t, 0, 10) == NULL, "alignment 0 refused");
    ok(sp_tlsf_aligned_alloc(t, 64, SIZE_MAX - 8) == NULL, "overflowing aligned size gives NULL");
    ts_log_release();
    is_int(sp_tlsf_check(t), SP_OK, "heap intact after refused aligned requests");
    heap_free(t);
}

static void test_largest_and_fragmentation(void) {
    sp_tlsf *t = heap_new(MiB, false);
    void *ps[64];
    for (int i = 0; i < 64; i++) ps[i] = sp_tlsf_malloc(t, 4000);
    for (int i = 0; i < 64; i += 2) sp_tlsf_free(t, ps[i]);
    sp_tlsf_status s = status(t);
    ok(s.fragmentation > 0.0 && s.fragmentation < 1.0, "holes show as fragmentation (%.3f)",
       s.fragmentation);
    void *big = sp_tlsf_malloc(t, s.largest_free);
    ok(big != NULL, "a request of largest_free (%zu) succeeds", s.largest_free);
    sp_tlsf_free(t, big);
    for (int i = 1; i < 64; i += 2) sp_tlsf_free(t, ps[i]);
    s = status(t);
    ok(s.fragmentation == 0.0 && s.free_blocks == 1, "no fragmentation once everything is freed");
    heap_free(t);
}

typedef struct walk_tally {
    size_t used, free_count, used_bytes;
} walk_tally;

static void tally(void *user, void *ptr, size_t size, bool used) {
    walk_tally *w = user;
    (void)ptr;
    if (used)
        w->used++, w->used_bytes += size;
    else
        w->free_count++;
}

static void test_pools_and_walk(void) {
    sp_tlsf *t = heap_new(64 * 1024, false);
    void *second = aligned_alloc(64, MiB);
    ok(sp_tlsf_malloc(t, 200000) == NULL, "first pool too small for 200 KB");
    is_int(sp_tlsf_add_pool(t, second, MiB), SP_OK, "add a second pool");
    void *p = sp_tlsf_malloc(t, 200000), *q = sp_tlsf_malloc(t, 100);
    ok(p && sp_tlsf_owns(t, p) && sp_tlsf_owns(t, second), "allocation served from the new pool");
    ts_log_capture();
    is_int(sp_tlsf_add_pool(t, (char *)second + 4096, 8192), SP_ERR_INVALID_ARG, "overlap refused");
    is_int(sp_tlsf_add_pool(t, NULL, 8192), SP_ERR_INVALID_ARG, "NULL pool refused");
    char tiny[40];
    is_int(sp_tlsf_add_pool(t, tiny, sizeof tiny), SP_ERR_TOO_SMALL, "tiny pool refused");
    ts_log_release();
    walk_tally w = {0};
    sp_tlsf_walk(t, tally, &w);
    sp_tlsf_status s = status(t);
    ok(w.used == 2 && w.used_bytes == s.bytes_used && w.free_count == s.free_blocks,
       "walker sees what status counts");
    is_int(s.pool_count, 2, "two pools");
    sp_tlsf_free(t, p);
    sp_tlsf_free(t, q);
    is_int(sp_tlsf_check(t), SP_OK, "check over two pools");
    heap_free(t);
    free(second);

    /* the pool table has a fixed size */
    t = heap_new(64 * 1024, false);
    static char pools[SP_TLSF_MAX_POOLS][1024] __attribute__((aligned(16)));
    int added = 0;
    ts_log_capture();
    for (int i = 0; i < SP_TLSF_MAX_POOLS; i++)
        added += sp_tlsf_add_pool(t, pools[i], 1024) == SP_OK;
    is_int(added, SP_TLSF_MAX_POOLS - 1, "pool table holds SP_TLSF_MAX_POOLS pools");
    ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_LIMIT, "table full reported once");
    ts_log_release();
    is_int(heap_free(t), 0, "no leak over sixteen pools");
}

static void test_check_finds_corruption(void) {
    sp_tlsf *t = heap_new(MiB, false);
    char *a = sp_tlsf_malloc(t, 64), *b = sp_tlsf_malloc(t, 64), *c = sp_tlsf_malloc(t, 64);
    sp_tlsf_free(t, b);
    ts_log_capture();
    /* an overflow from a that runs into b's header */
    uint64_t saved = peek(b - 8);
    poke(b - 8, saved ^ 0x40);
    is_int(sp_tlsf_check(t), SP_ERR_CORRUPT, "a damaged size is found");
    ok(ts_logged.last_id == SP_ERR_CORRUPT && ts_logged.last_addr == b - 16,
       "the report names the damaged block");
    poke(b - 8, saved);
    /* a broken free-list link inside the free block b: it points at a live block */
    saved = peek(b);
    poke(b, (uint64_t)(uintptr_t)(c - 16));
    is_int(sp_tlsf_check(t), SP_ERR_CORRUPT, "a broken list link is found");
    poke(b, saved);
    /* a header whose prev pointer lies */
    saved = peek(c - 16);
    poke(c - 16, (uint64_t)(uintptr_t)(a - 16));
    is_int(sp_tlsf_check(t), SP_ERR_CORRUPT, "a wrong prev_link is found");
    /* c follows the free block b: its prev_link carries PREV_FREE in bit 0 */
    poke(c - 16, saved ^ 1);
    is_int(sp_tlsf_check(t), SP_ERR_CORRUPT, "a PREV_FREE flag that lies is found");
    poke(c - 16, saved | 2);
    is_int(sp_tlsf_check(t), SP_ERR_CORRUPT, "a stray bit in a prev_link is found");
    poke(c - 16, saved);
    ts_log_release();
    is_int(sp_tlsf_check(t), SP_OK, "repaired heap passes again");
    sp_tlsf_free(t, a), sp_tlsf_free(t, c);
    heap_free(t);
}

int main(void) {
    test_create();
    test_malloc_basics();
    test_merge();
    test_realloc();
    test_aligned();
    test_largest_and_fragmentation();
    test_pools_and_walk();
    test_check_finds_corruption();
    return done();
}
