/* Frame arenas (sp_frame.h), single-threaded rules plus one migration check under the job
 * scheduler: lifetime (frame i's data intact through frame i+N-1, its buffer reused at i+N),
 * buffer_of, an alignment sweep, chunk boundaries, large requests, overflow in both modes
 * (heap blocks freed exactly once, at reclaim), status figures, given regions, chunk slots,
 * misuse reports, the debug fill, jobs that wait and resume on another worker, sticky chunks,
 * threads that come and go, and closes that keep the reservation without reading the claim
 * records (with a randomized check of 4 threads whose claims change from frame to frame; an
 * overflow that makes the close read them; the reclaim after a close that reserved less). */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "sp_frame.h"
#include "sp_jobs.h"
#include "test_support.h"
#include "track.h"

#ifndef SP_DEBUG
#define SP_DEBUG 0
#endif

static sp_frame_arena *make(uint32_t buffers, size_t region_size, size_t chunk,
                            sp_frame_overflow mode) {
    sp_result r = SP_ERR_CORRUPT;
    sp_frame_desc d = {
        .region_size = region_size, .buffers = buffers, .chunk_size = chunk, .overflow = mode};
    sp_frame_arena *a = sp_frame_arena_create(&d, &r);
    if (!a || r != SP_OK) diag("create failed: %s", sp_result_name(r));
    return a;
}

/* A byte pattern per (frame, block) that any overlap or early reuse would break. */
static uint8_t pattern(uint64_t frame, size_t i) {
    return (uint8_t)(frame * 31 + i * 7 + 1);
}

/* ---- lifetime ------------------------------------------------------------------------- */

enum { LIFE_BLOCKS = 300, LIFE_FRAMES = 13 };
typedef struct life_block {
    uint8_t *p;
    size_t n;
} life_block;

static void test_lifetime(uint32_t nbuf) {
    sp_frame_arena *a = make(nbuf, (size_t)nbuf << 20, 4096, SP_FRAME_OVERFLOW_NULL);
    if (!a) {
        ok(0, "lifetime N=%u: arena", nbuf);
        return;
    }
    static life_block kept[LIFE_FRAMES][LIFE_BLOCKS];
    void *first[LIFE_FRAMES] = {0};
    int bad_fill = 0, bad_buffer = 0, bad_reuse = 0, bad_frame = 0;
    ts_rng rng;
    ts_rng_seed(&rng, nbuf);
    for (uint64_t f = 0; f < LIFE_FRAMES; f++) {
        bad_frame += sp_frame_arena_frame(a) != f;
        for (size_t i = 0; i < LIFE_BLOCKS; i++) {
            size_t n = (size_t)ts_rng_range(&rng, 1, i % 50 == 49 ? 3000 : 200);
            uint8_t *p = sp_frame_alloc(a, n);
            if (!p) {
                bad_fill++;
                continue;
            }
            if (i == 0) first[f] = p;
            ts_fill(p, n, pattern(f, i));
            kept[f][i] = (life_block){p, n};
            bad_buffer += sp_frame_arena_buffer_of(a, p) != (int)(f % nbuf);
        }
        /* Same buffer, and the same chunk: the thread gets its chunk of N frames ago back. */
        if (f >= nbuf) bad_reuse += first[f] != first[f - nbuf];
        /* Every frame still alive (f-N+1 .. f) holds its data. */
        for (uint64_t g = f + 1 > nbuf ? f + 1 - nbuf : 0; g <= f; g++)
            for (size_t i = 0; i < LIFE_BLOCKS; i++)
                if (kept[g][i].p && !ts_filled(kept[g][i].p, kept[g][i].n, pattern(g, i)))
                    bad_fill++;
        uint64_t next = sp_frame_arena_advance(a, NULL);
        bad_frame += next != f + 1;
    }
    ok(bad_fill == 0 && bad_buffer == 0 && bad_frame == 0,
       "N=%u: frame i allocates from buffer i mod N, its data intact through frame i+N-1 "
       "(%d frames; bad fill %d, buffer %d, frame numbers %d)",
       nbuf, LIFE_FRAMES, bad_fill, bad_buffer, bad_frame);
    ok(bad_reuse == 0, "N=%u: frame i+N reuses frame i's memory, the same chunk first (bad %d)",
       nbuf, bad_reuse);
    sp_frame_arena_destroy(a);
}

/* ---- alignment, chunks, large requests, status --------------------------------------------- */

static void test_alignment(void) {
    sp_frame_arena *a = make(2, 64u << 20, 4096, SP_FRAME_OVERFLOW_NULL);
    int bad = 0, total = 0;
    uint8_t *ptrs[21 * 4];
    size_t sizes[21 * 4];
    int k = 0;
    for (int s = 0; s <= 20; s++) { /* 1 B .. 1 MiB: beyond small_max (1 KiB) goes direct */
        size_t align = (size_t)1 << s;
        for (int j = 0; j < 4; j++, k++) {
            size_t n = (size_t)j * 40 + (j == 3 ? 2000 : 1);
            uint8_t *p = sp_frame_aligned_alloc(a, align, n);
            total++;
            bad += !p || ((uintptr_t)p & (align - 1)) != 0 || ((uintptr_t)p & 15) != 0 ||
                   sp_frame_arena_buffer_of(a, p) != 0;
            ptrs[k] = p;
            sizes[k] = n;
            if (p) ts_fill(p, n, (uint8_t)k);
        }
    }
    for (int i = 0; i < k; i++) bad += ptrs[i] && !ts_filled(ptrs[i], sizes[i], (uint8_t)i);
    ok(bad == 0,
       "aligned_alloc: alignments 1 B .. 1 MiB x 4 sizes: aligned (and to 16), in "
       "buffer 0, no overlap (%d of %d bad)",
       bad, total);
    sp_frame_arena_destroy(a);
}

static void test_chunks(void) {
    /* chunk 1 KiB: small_max 256. */
    sp_frame_arena *a = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL);
    sp_frame_buffer_status st;
    char *p[65];
    for (int i = 0; i < 65; i++) p[i] = sp_frame_alloc(a, 16);
    sp_frame_buffer_status_get(a, 0, &st);
    int contiguous = 0;
    for (int i = 1; i < 64; i++) contiguous += p[i] == p[i - 1] + 16;
    ok(contiguous == 63 && p[64] == p[0] + 1024 && st.chunks == 2 && st.bytes_used == 2048,
       "64 blocks of 16 B fill a 1 KiB chunk back to back, the 65th takes the next chunk "
       "(chunks %zu, bytes_used %zu)",
       st.chunks, st.bytes_used);
    /* 1008 B left in chunk 2: 256 (small_max) fits, and so does 600 (above small_max, but
     * within the rest); 500 then does not fit the 144 left: direct, from the top down. */
    const size_t cap = (size_t)1 << 19;
    char *q = sp_frame_alloc(a, 256);
    char *q2 = sp_frame_alloc(a, 600);
    char *r = sp_frame_alloc(a, 500);
    sp_frame_buffer_status_get(a, 0, &st);
    ok(q == p[64] + 16 && q2 == q + 256 && r == p[0] + cap - 512 && st.chunks == 2 &&
           st.bytes_used == 2048 + 512,
       "256 B and 600 B come from the chunk's rest, 500 B that does not fit it is direct at the "
       "buffer's top, padded to 16 (chunks %zu, bytes_used %zu)",
       st.chunks, st.bytes_used);
    /* A small request that does not fit the rest of the chunk takes a new one. */
    for (int i = 0; i < 5; i++) sp_frame_alloc(a, 16); /* chunk 2: 16 + 256 + 608 + 80 used */
    char *t = sp_frame_alloc(a, 200);                  /* 64 left: new chunk */
    sp_frame_buffer_status_get(a, 0, &st);
    ok(t == p[0] + 2048 && st.chunks == 3 && st.bytes_used == 3 * 1024 + 512,
       "a request larger than the chunk's rest takes the next chunk (chunks %zu, bytes_used "
       "%zu)",
       st.chunks, st.bytes_used);
    /* Large requests: direct, exact, aligned. */
    char *big = sp_frame_aligned_alloc(a, 4096, 100000);
    sp_frame_buffer_status_get(a, 0, &st);
    size_t off = (size_t)(big - p[0]);
    ok(big && ((uintptr_t)big & 4095) == 0 && off + 100000 <= cap - 512 &&
           off + 100000 + 4096 > cap - 512 && st.bytes_used == 3 * 1024 + (cap - off),
       "100000 B aligned to 4 KiB is direct, just below the first direct block at a 4 KiB "
       "boundary (bytes_used %zu)",
       st.bytes_used);
    memset(big, 7, 100000);
    sp_frame_buffer_status closed;
    size_t used0 = st.bytes_used;
    sp_frame_arena_advance(a, &closed);
    ok(closed.frame == 0 && closed.bytes_used == used0 && closed.chunks == 3 &&
           closed.capacity == (1u << 19) && closed.overflows == 0,
       "advance reports the closed frame: frame %llu, bytes_used %zu, chunks %zu, capacity %zu",
       (unsigned long long)closed.frame, closed.bytes_used, closed.chunks, closed.capacity);
    sp_frame_alloc(a, 100);
    sp_frame_arena_advance(a, NULL); /* frame 2 reclaims buffer 0 */
    sp_frame_buffer_status_get(a, 0, &st);
    sp_frame_buffer_status b1;
    sp_frame_buffer_status_get(a, 1, &b1);
    ok(st.frame == 2 && st.bytes_used == 0 && st.chunks == 0 && st.peak == used0 && b1.frame == 1 &&
           b1.bytes_used == 1024 && b1.chunks == 1,
       "after reclaim: buffer 0 frame 2, used 0, peak %zu kept; buffer 1 frame 1 used %zu", st.peak,
       b1.bytes_used);
    sp_frame_arena_destroy(a);
}

static void test_size_zero_and_buffer_of(void) {
    sp_frame_arena *a = make(3, 3u << 20, 0, SP_FRAME_OVERFLOW_NULL);
    char *z = sp_frame_alloc(a, 0);
    char *y = sp_frame_alloc(a, 1);
    int b[3];
    char *p[3];
    for (int i = 0; i < 3; i++) {
        p[i] = sp_frame_alloc(a, 64);
        b[i] = sp_frame_arena_buffer_of(a, p[i]);
        sp_frame_arena_advance(a, NULL);
    }
    sp_frame_buffer_status st;
    sp_frame_buffer_status_get(a, 0, &st);
    int stack;
    ok(z != NULL && y == z && b[0] == 0 && b[1] == 1 && b[2] == 2 &&
           sp_frame_arena_buffer_of(a, &stack) == -1 && sp_frame_arena_buffer_of(a, NULL) == -1 &&
           sp_frame_arena_buffer_of(a, z + st.capacity * 3) == -1 &&
           sp_frame_arena_buffer_of(a, z + st.capacity * 3 - 1) == 2 &&
           sp_frame_arena_buffer_of(a, z - 1) == -1,
       "size 0 gives a pointer to no bytes; buffer_of: 0, 1, 2 per frame, -1 outside (got %d "
       "%d %d)",
       b[0], b[1], b[2]);
    sp_frame_arena_destroy(a);

    /* A buffer filled to its last byte: size 0 (plain and aligned) gets NULL (counted) or a
     * pointer inside the current buffer, never the buffer's end (the next buffer's start, or
     * past the region for the last buffer). Both buffers, both modes. */
    int bad = 0;
    for (int mode = 0; mode < 2; mode++) {
        a = make(2, 2u << 20, 1024, mode ? SP_FRAME_OVERFLOW_HEAP : SP_FRAME_OVERFLOW_NULL);
        for (int f = 0; a && f < 2; f++) {
            int cur = (int)(sp_frame_arena_frame(a) % 2);
            size_t n = 0;
            sp_frame_buffer_status_get(a, (uint32_t)cur, &st);
            while (n < st.capacity / 256) n += sp_frame_alloc(a, 256) != NULL;
            char *q[2] = {sp_frame_alloc(a, 0), sp_frame_aligned_alloc(a, 64, 0)};
            for (int i = 0; i < 2; i++) {
                int in = q[i] ? sp_frame_arena_buffer_of(a, q[i]) : cur;
                if (in != cur && !(mode && in == -1)) {
                    diag("mode %d frame %d: size-0 block %p in buffer %d, current %d", mode, f,
                         (void *)q[i], in, cur);
                    bad++;
                }
            }
            sp_frame_arena_advance(a, NULL);
        }
        sp_frame_arena_destroy(a);
    }
    ok(bad == 0, "size 0 from a full buffer: NULL, a heap block or inside the buffer (bad %d)",
       bad);
}

/* ---- overflow ------------------------------------------------------------------------------ */

enum { HEAP_MAX = 4096 };
static struct counting_heap {
    void *block[HEAP_MAX];
    int freed[HEAP_MAX];
    int allocs, frees, bad_free;
} heap;

static void *heap_alloc_counting(void *user, size_t align, size_t size) {
    if (user != &heap || heap.allocs >= HEAP_MAX) return NULL;
    void *p = NULL;
    if (posix_memalign(&p, align, size) != 0) return NULL;
    heap.block[heap.allocs++] = p;
    return p;
}

/* Addresses come back after a free: a free matches the live entry of its address (one at a
 * time); a free of an address with no live entry counts against its last entry (twice). */
static void heap_free_counting(void *user, void *p) {
    int last = -1;
    for (int i = 0; i < heap.allocs; i++)
        if (heap.block[i] == p) {
            last = i;
            if (heap.freed[i] == 0) break;
        }
    if (user != &heap || last < 0) {
        heap.bad_free++;
        return;
    }
    if (heap.freed[last]++ == 0) free(p);
    heap.frees++;
}

static void test_overflow_null(void) {
    ts_log_capture();
    /* 2 buffers of 64 KiB, chunks of 4 KiB. */
    sp_frame_arena *a = make(2, 128u << 10, 4096, SP_FRAME_OVERFLOW_NULL);
    size_t got = 0, refused = 0;
    for (int i = 0; i < 1000; i++) {
        void *p = sp_frame_alloc(a, 200);
        if (p)
            got++;
        else
            refused++;
    }
    sp_frame_buffer_status st;
    sp_frame_buffer_status_get(a, 0, &st);
    int logs = ts_logged.count;
    sp_result id = ts_logged.last_id;
    ok(refused > 0 && st.overflows == refused && st.bytes_used <= st.capacity &&
           st.bytes_used >= st.capacity - 4096 && st.overflow_bytes == 0 && got * 208 <= 65536,
       "NULL mode: %zu served, %zu refused and counted (overflows %zu), bytes_used %zu of %zu", got,
       refused, st.overflows, st.bytes_used, st.capacity);
    ok(logs == 1 && id == SP_ERR_NOMEM, "the frame's first overflow is logged once (%d records)",
       logs);
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL); /* buffer 0 again */
    void *p = sp_frame_alloc(a, 200);
    sp_frame_buffer_status_get(a, 0, &st);
    ok(p && sp_frame_arena_buffer_of(a, p) == 0 && st.overflows == 0,
       "after its reclaim the buffer serves again, overflows back to 0");
    sp_frame_arena_destroy(a);
    ts_log_release();
}

/* A full buffer refuses 2^21 small requests without its bump word's claim count carrying
 * into the direct part (chunk_fresh looks before it adds): afterwards the status and the next
 * rounds' blocks are sane. */
static void test_refusals_bounded(void) {
    sp_frame_arena *a = make(2, 2 * 65536, 1024, SP_FRAME_OVERFLOW_NULL);
    ts_log_capture(); /* the first refusal is logged */
    while (sp_frame_alloc(a, 200)) {
    }
    for (long i = 0; i < (1L << 21); i++) sp_frame_alloc(a, 200);
    ts_log_release();
    sp_frame_buffer_status st;
    sp_frame_buffer_status_get(a, 0, &st);
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL);
    int bad = 0;
    for (int i = 0; i < 200; i++) {
        char *p = sp_frame_alloc(a, 300 + (size_t)i);
        if (p && sp_frame_arena_buffer_of(a, p) != 0) bad++;
    }
    ok(st.bytes_used <= st.capacity && bad == 0,
       "2^21 refused requests on a full buffer: bytes_used %zu of %zu, the next round's blocks "
       "in their buffer (bad %d)",
       st.bytes_used, st.capacity, bad);
    sp_frame_arena_destroy(a);
}

/* A heap_alloc that returns a block 8 bytes past the alignment asked for. */
static int misaligned_frees;
static void *heap_alloc_misaligned(void *user, size_t align, size_t size) {
    (void)user;
    void *p = NULL;
    if (posix_memalign(&p, align, size + align) != 0) return NULL;
    return (char *)p + 8;
}
static void heap_free_misaligned(void *user, void *p) {
    (void)user;
    misaligned_frees++;
    free((char *)p - 8);
}

/* The fallback's blocks are checked: one not aligned as asked is freed again and the request
 * refused (misuse), never handed out misaligned. */
static void test_overflow_heap_misaligned(void) {
    sp_frame_desc d = {.region_size = 128u << 10,
                       .buffers = 2,
                       .chunk_size = 4096,
                       .overflow = SP_FRAME_OVERFLOW_HEAP,
                       .heap_alloc = heap_alloc_misaligned,
                       .heap_free = heap_free_misaligned};
    sp_frame_arena *a = sp_frame_arena_create(&d, NULL);
    ts_log_capture();
    void *p = sp_frame_aligned_alloc(a, 64, 100000); /* above the 64 KiB buffer: the heap */
    int logged = ts_logged.count, id = ts_logged.last_id;
    ts_log_release();
    ok(p == NULL && misaligned_frees == 1 && id == SP_ERR_BAD_ALIGNMENT && logged == 2,
       "a misaligned heap_alloc block is freed and the request refused (misuse logged: %d)",
       logged);
    sp_frame_arena_destroy(a);
    ok(misaligned_frees == 1, "nothing of it is kept for the reclaim");
}

static void test_overflow_heap(void) {
    ts_log_capture();
    memset(&heap, 0, sizeof heap);
    sp_frame_desc d = {.region_size = 128u << 10,
                       .buffers = 2,
                       .chunk_size = 4096,
                       .overflow = SP_FRAME_OVERFLOW_HEAP,
                       .heap_alloc = heap_alloc_counting,
                       .heap_free = heap_free_counting,
                       .heap_user = &heap};
    sp_frame_arena *a = sp_frame_arena_create(&d, NULL);
    int bad = 0;
    size_t from_heap = 0, heap_bytes = 0;
    for (int f = 0; f < 4; f++) {
        for (int i = 0; i < 500; i++) {
            size_t n = 100 + (size_t)i % 150, al = i % 7 == 0 ? 256 : 16;
            uint8_t *p = sp_frame_aligned_alloc(a, al, n);
            if (!p || ((uintptr_t)p & (al - 1))) {
                bad++;
                continue;
            }
            ts_fill(p, n, (uint8_t)i);
            if (sp_frame_arena_buffer_of(a, p) < 0) {
                from_heap++;
                heap_bytes += n;
            }
        }
        if (f == 1) {
            /* Frame 1 is still open: frame 0's blocks are alive, none freed yet. */
            bad += heap.frees != 0;
        }
        sp_frame_buffer_status closed;
        sp_frame_arena_advance(a, &closed);
        bad += closed.overflow_bytes != heap_bytes || closed.overflows != from_heap;
        from_heap = heap_bytes = 0;
    }
    int allocs = heap.allocs, frees_before = heap.frees;
    sp_frame_arena_destroy(a);
    int twice = 0, never = 0;
    for (int i = 0; i < heap.allocs; i++) {
        twice += heap.freed[i] > 1;
        never += heap.freed[i] == 0;
    }
    ok(bad == 0 && allocs > 0,
       "HEAP mode: every request served and aligned, overflow count and bytes per frame match "
       "the heap blocks (%d heap blocks, bad %d)",
       allocs, bad);
    ok(frees_before > 0 && frees_before < allocs,
       "heap blocks are freed when their buffer is reclaimed (%d of %d before destroy)",
       frees_before, allocs);
    ok(twice == 0 && never == 0 && heap.bad_free == 0 && heap.frees == allocs,
       "each heap block freed exactly once by the end (twice %d, never %d, foreign %d)", twice,
       never, heap.bad_free);
    ts_log_release();
}

/* ---- regions and slots ------------------------------------------------------------------------
 */

static void test_given_region(bool huge) {
    size_t size = 8u << 20;
    sp_page_kind kind = SP_PAGES_NORMAL;
    void *r = sp_vm_reserve(size, 0, huge, &kind);
    if (!r) {
        ok(0, "reserve");
        return;
    }
    sp_result err = SP_ERR_CORRUPT;
    sp_frame_arena *a = sp_frame_arena_create(
        &(sp_frame_desc){.region = r, .region_size = size, .buffers = 4}, &err);
    int bad = !a;
    for (int f = 0; a && f < 8; f++) {
        uint8_t *p = sp_frame_alloc(a, 1000);
        uint8_t *q = sp_frame_aligned_alloc(a, 65536, 300000);
        bad += !p || !q || (uint8_t *)p < (uint8_t *)r || q + 300000 > (uint8_t *)r + size;
        if (p && q) {
            memset(p, 1, 1000);
            memset(q, 2, 300000);
        }
        bad += sp_frame_arena_buffer_of(a, q) != f % 4;
        sp_frame_arena_advance(a, NULL);
    }
    sp_frame_arena_destroy(a);
    ok(bad == 0 && err == SP_OK,
       "a given region (%s pages) split into 4 buffers of 2 MiB serves and reclaims (bad %d)",
       kind == SP_PAGES_HUGE          ? "huge"
       : kind == SP_PAGES_TRANSPARENT ? "transparent huge"
                                      : "base",
       bad);
    sp_vm_release(r, size);
}

static void test_slots(void) {
    /* A destroyed arena's chunk left in this thread's slot is never used by a later one. */
    sp_frame_arena *old = make(2, 0, 0, SP_FRAME_OVERFLOW_NULL);
    sp_frame_alloc(old, 32);
    sp_frame_arena_destroy(old);
    sp_frame_arena *as[SP_FRAME_SLOTS + 1];
    int bad = 0;
    for (int i = 0; i <= SP_FRAME_SLOTS; i++) as[i] = make(2, 1u << 20, 4096, 0);
    for (int round = 0; round < 100; round++)
        for (int i = 0; i < SP_FRAME_SLOTS; i++) {
            void *p = sp_frame_alloc(as[i], 16);
            bad += sp_frame_arena_buffer_of(as[i], p) != 0;
        }
    int chunks = 0;
    for (int i = 0; i < SP_FRAME_SLOTS; i++) {
        sp_frame_buffer_status st;
        sp_frame_buffer_status_get(as[i], 0, &st);
        chunks += (int)st.chunks;
    }
    ok(bad == 0 && chunks == SP_FRAME_SLOTS,
       "%d arenas used in turn keep one chunk each (chunks %d), no block from a dead arena's "
       "chunk (bad %d)",
       SP_FRAME_SLOTS, chunks, bad);
    /* Two arenas sharing a slot alternate: each switch takes a new chunk, blocks stay right. */
    for (int i = 0; i < 10; i++) {
        bad += sp_frame_arena_buffer_of(as[0], sp_frame_alloc(as[0], 16)) != 0;
        bad += sp_frame_arena_buffer_of(as[SP_FRAME_SLOTS],
                                        sp_frame_alloc(as[SP_FRAME_SLOTS], 16)) != 0;
    }
    ok(bad == 0, "arenas sharing a slot never serve from each other's chunk");
    for (int i = 0; i <= SP_FRAME_SLOTS; i++) sp_frame_arena_destroy(as[i]);
}

/* An arena takes its frames' generations in blocks of SP_FRAME_GEN_BLOCK_ (2^20): past the
 * end of its first block, every advance still makes the thread's chunk stale, and an arena of
 * the same slot still never matches it. */
static void test_generation_blocks(void) {
    sp_frame_arena *x = make(2, 1u << 20, 4096, SP_FRAME_OVERFLOW_NULL), *others[SP_FRAME_SLOTS];
    for (int i = 0; i < SP_FRAME_SLOTS; i++) others[i] = make(2, 1u << 20, 4096, 0);
    sp_frame_arena *y = others[SP_FRAME_SLOTS - 1]; /* x's slot */
    long bad = 0, frames = (long)SP_FRAME_GEN_BLOCK_ + 64;
    for (long f = 0; f < frames; f++) {
        char *p = sp_frame_alloc(x, 16);
        bad += sp_frame_arena_buffer_of(x, p) != (int)(f % 2);
        if (f % 65536 == 0 || f > frames - 32) { /* y takes a chunk each time: 48 in all */
            bad += sp_frame_arena_buffer_of(y, sp_frame_alloc(y, 16)) != 0;
            bad += sp_frame_arena_buffer_of(x, sp_frame_alloc(x, 16)) != (int)(f % 2);
        }
        sp_frame_arena_advance(x, NULL);
    }
    ok(bad == 0 && sp_frame_arena_frame(x) == (uint64_t)frames,
       "%ld frames (past the first block of generations): each frame's blocks from its own "
       "buffer, none from an arena of the same slot (bad %ld)",
       frames, bad);
    sp_frame_arena_destroy(x);
    for (int i = 0; i < SP_FRAME_SLOTS; i++) sp_frame_arena_destroy(others[i]);
}

/* ---- misuse ------------------------------------------------------------------------------- */

static void test_misuse(void) {
    {
        /* An alignment larger than a buffer cannot be served: an overflow, and the thread's
         * chunk is left as it was. */
        sp_frame_arena *x = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL);
        char *c0 = sp_frame_alloc(x, 16);
        ts_log_capture();
        void *huge = sp_frame_aligned_alloc(x, (size_t)1 << 63, PTRDIFF_MAX);
        ts_log_release();
        char *c1 = sp_frame_alloc(x, 16);
        ok(huge == NULL && c1 == c0 + 16,
           "aligned_alloc(2^63, PTRDIFF_MAX): NULL, the chunk untouched");
        sp_frame_arena_destroy(x);
    }
    ts_log_capture();
    sp_frame_arena *a = make(2, 1u << 20, 4096, SP_FRAME_OVERFLOW_NULL);
    void *p = sp_frame_aligned_alloc(a, 48, 10);
    ok(p == NULL && ts_logged.last_id == SP_ERR_BAD_ALIGNMENT &&
           strcmp(ts_logged.last_call, "sp_frame_aligned_alloc") == 0 && ts_logged.last_addr == a,
       "alignment 48: NULL, SP_ERR_BAD_ALIGNMENT from sp_frame_aligned_alloc naming the arena");
    ts_log_reset();
    p = sp_frame_aligned_alloc(a, 0, 10);
    ok(p == NULL && ts_logged.last_id == SP_ERR_BAD_ALIGNMENT, "alignment 0: refused");
    ts_log_reset();
    p = sp_frame_alloc(a, SIZE_MAX - 8);
    ok(p == NULL && ts_logged.last_id == SP_ERR_OVERFLOW &&
           strcmp(ts_logged.last_call, "sp_frame_alloc") == 0,
       "size SIZE_MAX - 8: NULL, SP_ERR_OVERFLOW from sp_frame_alloc");
    ts_log_reset();
    p = sp_frame_aligned_alloc(a, 16, SIZE_MAX - 8);
    ok(p == NULL && ts_logged.last_id == SP_ERR_OVERFLOW &&
           strcmp(ts_logged.last_call, "sp_frame_aligned_alloc") == 0,
       "aligned_alloc(16, SIZE_MAX - 8): reported under sp_frame_aligned_alloc (it said "
       "sp_frame_alloc for alignment 16)");
    sp_frame_buffer_status st;
    sp_frame_buffer_status_get(a, 0, &st);
    ok(st.bytes_used == 0 && st.overflows == 0, "refused misuse changes nothing");
    ts_log_reset();
    sp_frame_buffer_status_get(a, 2, &st);
    ok(ts_logged.last_id == SP_ERR_INVALID_ARG && st.capacity == 0,
       "status of buffer 2 of 2: SP_ERR_INVALID_ARG, zeroed");
    /* A NULL arena (outside the allocation fast paths) and a NULL out. */
    ts_log_reset();
    sp_frame_buffer_status closed;
    memset(&closed, 0xff, sizeof closed);
    memset(&st, 0xff, sizeof st);
    bool answers = sp_frame_arena_advance(NULL, &closed) == 0 && closed.capacity == 0 &&
                   sp_frame_arena_frame(NULL) == 0 && sp_frame_arena_buffer_of(NULL, a) == -1;
    sp_frame_buffer_status_get(NULL, 0, &st);
    sp_frame_buffer_status_get(a, 0, NULL);
    ok(answers && st.capacity == 0 && ts_logged.count == 5 &&
           ts_logged.last_id == SP_ERR_INVALID_ARG,
       "a NULL arena (advance 0, frame 0, buffer_of -1, status zeroed) and a NULL status out: "
       "each reported (%d of 5)",
       ts_logged.count);
    /* The allocation fast paths check for a NULL arena where they are compiled with
     * SP_DEBUG >= 1 or not inline (ASan, Valgrind); release builds read through it. */
    if (SP_DEBUG >= 1 || !SP_FRAME_INLINE) {
        ts_log_reset();
        void *n1 = sp_frame_alloc(NULL, 16);
        bool first = ts_logged.last_id == SP_ERR_INVALID_ARG &&
                     strcmp(ts_logged.last_call, "sp_frame_alloc") == 0;
        void *n2 = sp_frame_aligned_alloc(NULL, 64, 16);
        ok(!n1 && !n2 && first && ts_logged.count == 2 &&
               strcmp(ts_logged.last_call, "sp_frame_aligned_alloc") == 0,
           "debug: alloc and aligned_alloc from a NULL arena: NULL, each reported under its "
           "name (%d reports)",
           ts_logged.count);
    } else {
        skip("a NULL arena on the fast paths: release build (undefined there)");
    }
    sp_frame_arena_destroy(a);

    sp_result r = SP_OK;
    ts_log_reset();
    ok(!sp_frame_arena_create(&(sp_frame_desc){.buffers = 5}, &r) && r == SP_ERR_INVALID_ARG &&
           ts_logged.last_id == SP_ERR_INVALID_ARG,
       "5 buffers: create fails, SP_ERR_INVALID_ARG");
    ts_log_reset();
    ok(!sp_frame_arena_create(&(sp_frame_desc){.region_size = 64u << 10, .buffers = 2}, &r) &&
           r == SP_ERR_TOO_SMALL && ts_logged.last_id == SP_ERR_TOO_SMALL,
       "64 KiB for 2 buffers with 256 KiB chunks: SP_ERR_TOO_SMALL");
    void *reg = sp_vm_reserve(1u << 20, 0, false, NULL);
    ts_log_reset();
    ok(!sp_frame_arena_create(&(sp_frame_desc){.region = (char *)reg + 16, .region_size = 1u << 19},
                              &r) &&
           r == SP_ERR_INVALID_ARG && ts_logged.count == 1,
       "a region that is not page-aligned: SP_ERR_INVALID_ARG");
    ts_log_reset();
    ok(!sp_frame_arena_create(&(sp_frame_desc){.region = reg}, &r) && r == SP_ERR_INVALID_ARG,
       "a region without a size: SP_ERR_INVALID_ARG");
    sp_vm_release(reg, 1u << 20);
    ts_log_reset();
    ok(!sp_frame_arena_create(&(sp_frame_desc){.heap_alloc = heap_alloc_counting}, &r) &&
           r == SP_ERR_INVALID_ARG,
       "heap_alloc without heap_free: SP_ERR_INVALID_ARG");
    ts_log_reset();
    ok(!sp_frame_arena_create(&(sp_frame_desc){.overflow = (sp_frame_overflow)7}, &r) &&
           r == SP_ERR_INVALID_ARG,
       "unknown overflow mode: SP_ERR_INVALID_ARG");
    ts_log_release();
}

/* Debug builds without a memory tool fill a reclaimed buffer's used part with 0xFD. */
static void test_debug_fill(void) {
    if (SP_DEBUG < 1 || TRACK_ASAN || TRACK_VALGRIND) {
        skip("the 0xFD fill is for debug builds without ASan/Valgrind");
        skip("the 0xFD fill of direct blocks, likewise");
        return;
    }
    sp_frame_arena *a = make(2, 1u << 20, 4096, SP_FRAME_OVERFLOW_NULL);
    volatile uint8_t *p = sp_frame_alloc(a, 100);
    memset((void *)p, 0x11, 100);
    /* 64 KiB, far above chunk_size / 4: taken from the buffer directly, not from a chunk (the
     * reclaim fills that part separately, from the buffer's direct mark up). */
    enum { BIG = 64 * 1024 };
    volatile uint8_t *big = sp_frame_alloc(a, BIG);
    if (big) memset((void *)big, 0x22, BIG);
    sp_frame_arena_advance(a, NULL);
    bool intact = p[0] == 0x11 && p[99] == 0x11;
    bool big_intact = big && big[0] == 0x22 && big[BIG - 1] == 0x22;
    sp_frame_arena_advance(a, NULL);
    bool filled = p[0] == 0xFD && p[99] == 0xFD && p[4095] == 0xFD;
    size_t big_filled = 0; /* bytes of the large block that read 0xFD */
    for (size_t i = 0; big && i < BIG; i++) big_filled += big[i] == 0xFD;
    ok(intact && filled, "debug build: frame 0's data intact in frame 1, 0xFD from frame 2 on");
    ok(big_intact && big_filled == BIG,
       "debug build: a 64 KiB direct block too (intact in frame 1, %zu of %d bytes 0xFD in "
       "frame 2)",
       big_filled, BIG);
    sp_frame_arena_destroy(a);
}

/* ---- migration ------------------------------------------------------------------------- */

enum { PER = 6, MIN_ROUNDS = 10, MAX_ROUNDS = 3000, WANT_MIGRATIONS = 16 };
static atomic_int wrong_before, wrong_after, migrations, waits;
static sp_frame_arena *mig_arena;

/* Whether [p, p+n) was just bumped from the running thread's current chunk of arena a: the
 * thread's chunk (read here, in a call of its own after any suspension) is this frame's and
 * ends right after p's block or later. */
static __attribute__((noinline)) bool from_running_chunk(sp_frame_arena *a, const void *p,
                                                         size_t n) {
    const sp_frame_hot_ *h = (const sp_frame_hot_ *)(void *)a;
    const sp_frame_chunk *c = &sp_frame_tls[h->slot];
    const char *q = p;
    return c->gen == h->gen && q >= c->end - SP_FRAME_DEFAULT_CHUNK && q + n <= c->cur;
}

static void waiter_job(void *arg) {
    ts_pair *pr = arg;
    uint64_t a = sp_thread_os_id();
    for (int i = 0; i < PER; i++) {
        size_t n = 24 + (size_t)i * 40;
        void *p = sp_frame_alloc(mig_arena, n);
        if (!p || !from_running_chunk(mig_arena, p, n)) atomic_fetch_add(&wrong_before, 1);
    }
    sp_counter_wait(pr->go, 0);
    uint64_t b = sp_thread_os_id();
    for (int i = 0; i < PER; i++) {
        size_t n = 24 + (size_t)i * 40;
        void *p = sp_frame_alloc(mig_arena, n);
        if (!p || !from_running_chunk(mig_arena, p, n)) atomic_fetch_add(&wrong_after, 1);
    }
    if (a != b) atomic_fetch_add(&migrations, 1);
    atomic_fetch_add(&waits, 1);
}

/* Between frames: no allocation in flight. */
static void advance(void *arena) {
    sp_frame_arena_advance(arena, NULL);
}

static void test_migration(void) {
    sp_jobs *s = NULL;
    mig_arena = make(2, 0, 0, SP_FRAME_OVERFLOW_NULL);
    if (sp_jobs_create(&s, &(sp_jobs_desc){.workers = 4}) != SP_OK || !mig_arena) {
        ok(0, "scheduler and arena");
        ok(0, "migration");
        return;
    }
    int rounds = ts_migration_rounds(s, waiter_job, MIN_ROUNDS, MAX_ROUNDS, &migrations,
                                     WANT_MIGRATIONS, advance, mig_arena);
    sp_jobs_destroy(s);
    ok(rounds >= 0 && atomic_load(&waits) == rounds * TS_PAIRS &&
           atomic_load(&migrations) >= WANT_MIGRATIONS,
       "%d rounds of %d waiting jobs; %d resumed on another worker", rounds, TS_PAIRS,
       atomic_load(&migrations));
    ok(atomic_load(&wrong_before) == 0 && atomic_load(&wrong_after) == 0,
       "every block came from the chunk of the thread running the job, before and after its "
       "wait (wrong %d / %d)",
       atomic_load(&wrong_before), atomic_load(&wrong_after));
    sp_frame_arena_destroy(mig_arena);
}

/* ---- sticky chunks ------------------------------------------------------------------------ */

/* Chunks come back to the thread that had them N frames ago, whichever thread asks first;
 * direct ranges and sticky chunks never overlap, whichever comes first. */
static sp_frame_arena *sticky_arena;
static pthread_barrier_t sticky_bar;
static char *sticky_got[2][2]; /* [thread][frame 0 / frame 2] */

static void *sticky_thread(void *arg) {
    int me = (int)(intptr_t)arg;
    for (int round = 0; round < 2; round++) {
        /* Frame 0: thread 0 first; frame 2: thread 1 first. */
        int first = round == 0 ? 0 : 1;
        if (me != first) pthread_barrier_wait(&sticky_bar);
        sticky_got[me][round] = sp_frame_alloc(sticky_arena, 16);
        if (me == first) pthread_barrier_wait(&sticky_bar);
        pthread_barrier_wait(&sticky_bar); /* main advances twice */
        pthread_barrier_wait(&sticky_bar);
    }
    return NULL;
}

static void test_sticky(void) {
    sticky_arena = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL);
    pthread_barrier_init(&sticky_bar, NULL, 3);
    pthread_t t[2];
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, sticky_thread, (void *)(intptr_t)i);
    for (int round = 0; round < 2; round++) {
        pthread_barrier_wait(&sticky_bar);
        pthread_barrier_wait(&sticky_bar);
        sp_frame_arena_advance(sticky_arena, NULL);
        sp_frame_arena_advance(sticky_arena, NULL);
        pthread_barrier_wait(&sticky_bar);
    }
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    pthread_barrier_destroy(&sticky_bar);
    ok(sticky_got[0][0] && sticky_got[1][0] && sticky_got[0][0] != sticky_got[1][0] &&
           sticky_got[0][1] == sticky_got[0][0] && sticky_got[1][1] == sticky_got[1][0],
       "two threads get their own chunks back N frames later, in the other order");
    sp_frame_arena_destroy(sticky_arena);

    sp_frame_arena *a = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL);
    const size_t cap = (size_t)1 << 19;
    char *c0 = sp_frame_alloc(a, 16); /* chunk 0 */
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL);
    ts_log_capture();
    char *d = sp_frame_alloc(a, cap - 512);   /* would cover chunk 0 */
    char *d0 = sp_frame_alloc(a, cap - 1024); /* right above it */
    char *x = sp_frame_alloc(a, 16);          /* its owner asks for it again */
    sp_frame_buffer_status st;
    sp_frame_buffer_status_get(a, 0, &st);
    ok(d == NULL && d0 == c0 + 1024 && x == c0 && st.chunks == 1 && st.overflows == 1,
       "a direct range first: it stays above the chunk kept for its owner of N frames ago (one "
       "that would cover it overflows), and the owner gets the chunk back");
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL);
    x = sp_frame_alloc(a, 16); /* the old chunk first */
    char *d1 = sp_frame_alloc(a, cap - 512);
    char *d2 = sp_frame_alloc(a, cap - 1024);
    ts_log_release();
    ok(x == c0 && d1 == NULL && d2 == c0 + 1024,
       "the old chunk first: a direct range stays above it (%p %p %p)", (void *)x, (void *)d1,
       (void *)d2);
    sp_frame_arena_destroy(a);
}

/* Threads that come and go: a chunk kept for a thread that does not come back is lost for one
 * round, then a hole that the next fresh claim takes; threads past the arena's claim records
 * still claim and are counted. */
static sp_frame_arena *churn_arena;
static char *churn_got;
static int churn_n = 1; /* 16-byte allocations per thread; churn_got: the first */

static void *churn_thread(void *arg) {
    (void)arg;
    churn_got = sp_frame_alloc(churn_arena, 16);
    for (int i = 1; i < churn_n; i++) sp_frame_alloc(churn_arena, 16);
    return NULL;
}

static char *churn_alloc_on_new_thread(void) {
    pthread_t t;
    pthread_create(&t, NULL, churn_thread, NULL);
    pthread_join(t, NULL);
    return churn_got;
}

static void test_churn(void) {
    churn_arena = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL);
    char *base = churn_alloc_on_new_thread(); /* frame 0: thread A, chunk 0 */
    char *a1 = churn_alloc_on_new_thread();   /* thread B, chunk 1 */
    sp_frame_arena_advance(churn_arena, NULL);
    sp_frame_arena_advance(churn_arena, NULL);
    char *c = churn_alloc_on_new_thread(); /* frame 2: A and B gone; C past their chunks */
    sp_frame_arena_advance(churn_arena, NULL);
    sp_frame_arena_advance(churn_arena, NULL);
    char *d = churn_alloc_on_new_thread(); /* frame 4: D takes a hole */
    char *e = churn_alloc_on_new_thread(); /* E the other */
    char *f = churn_alloc_on_new_thread(); /* F past C's chunk */
    ok(a1 == base + 1024 && c == base + 2048 && d == base && e == base + 1024 && f == base + 3072,
       "kept chunks of threads that did not come back are holes the next round, fresh claims "
       "take them first (%td %td %td %td %td)",
       a1 - base, c - base, d - base, e - base, f - base);
    sp_frame_arena_destroy(churn_arena);

    /* More than 512 holes (the most a buffer keeps): the next round reserves nothing. */
    churn_arena = make(2, 4u << 20, 1024, SP_FRAME_OVERFLOW_NULL); /* 2,048 chunks a buffer */
    churn_n = 600 * 64; /* 600 chunks, the first 8 kept */
    base = churn_alloc_on_new_thread();
    churn_n = 1;
    char *last = churn_alloc_on_new_thread(); /* chunk 600: 592 holes below it */
    sp_frame_arena_advance(churn_arena, NULL);
    sp_frame_arena_advance(churn_arena, NULL);
    char *again = churn_alloc_on_new_thread();
    ok(last == base + 600 * 1024 && again == base,
       "more holes than a buffer keeps: the next round reserves nothing (fresh claims from chunk "
       "0: %td)",
       again - base);
    sp_frame_arena_destroy(churn_arena);

    /* A thread back after skipping a round does not ask for its old chunk, which the round it
     * skipped made a hole: the main thread claims in frames 0 and 4, new threads in 2 and 4. */
    churn_arena = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL);
    char *m0 = sp_frame_alloc(churn_arena, 16); /* frame 0: chunk 0, kept */
    sp_frame_arena_advance(churn_arena, NULL);
    sp_frame_arena_advance(churn_arena, NULL);
    char *b2 = churn_alloc_on_new_thread(); /* frame 2: chunk 0 reserved, so chunk 1 */
    sp_frame_arena_advance(churn_arena, NULL);
    sp_frame_arena_advance(churn_arena, NULL);
    char *c4 = churn_alloc_on_new_thread(); /* frame 4: chunk 0 is a hole, the first fresh claim */
    char *m4 = sp_frame_alloc(churn_arena, 16);
    ok(b2 == m0 + 1024 && c4 == m0 && m4 == m0 + 2048,
       "a thread that skipped a round claims fresh: its old chunk went to another thread as a "
       "hole (%td %td %td)",
       b2 - m0, c4 - m0, m4 - m0);
    sp_frame_arena_destroy(churn_arena);

    /* A buffer of 8 chunks: a thread that kept all 8 and does not come back would leave the
     * next round nothing; chunks are kept only in the lower half, so all 8 are fresh instead.
     * Chunks 0-3 kept: reserved, a new thread's fresh claim above them; 0-4 kept: none
     * reserved. */
    ptrdiff_t at[3] = {-1, -1, -1}; /* offsets from the first chunk; -1: NULL */
    for (int kept = 8; kept >= 4; kept -= 4) {
        churn_arena = make(2, 16u << 10, 1024, SP_FRAME_OVERFLOW_NULL);
        churn_n = kept * 64; /* kept chunks of 64 blocks */
        base = churn_alloc_on_new_thread();
        churn_n = 1;
        sp_frame_arena_advance(churn_arena, NULL);
        sp_frame_arena_advance(churn_arena, NULL);
        char *q = churn_alloc_on_new_thread();
        if (q) at[kept / 4 - 1] = q - base;
        sp_frame_arena_destroy(churn_arena);
    }
    churn_arena = make(2, 16u << 10, 1024, SP_FRAME_OVERFLOW_NULL);
    char *h0 = sp_frame_alloc(churn_arena, 16);
    for (int i = 1; i < 5 * 64; i++) sp_frame_alloc(churn_arena, 16);
    sp_frame_arena_advance(churn_arena, NULL);
    sp_frame_arena_advance(churn_arena, NULL);
    char *late = churn_alloc_on_new_thread();
    if (late) at[2] = late - h0;
    ok(at[1] == 0 && at[0] == 4096 && at[2] == 0,
       "a buffer's 8 chunks all kept by a thread that does not come back: the next round keeps "
       "none (a new thread's first chunk: %td); chunks 0-3 kept: reserved, fresh above (%td); "
       "0-4 kept by the main thread: none reserved (%td)",
       at[1], at[0], at[2]);
    sp_frame_arena_destroy(churn_arena);

    /* A thread keeps chunks 0-3 and does not come back; the next round's thread takes 4-7
     * (0-3 reserved) and does not come back either: a direct range (a request above
     * chunk_size / 4) stays above the highest kept chunk, so keeping 4-7 would refuse it
     * although 0-3 lie free (holes); nothing is kept instead. */
    churn_arena = make(2, 16u << 10, 1024, SP_FRAME_OVERFLOW_NULL);
    churn_n = 4 * 64;
    base = churn_alloc_on_new_thread();
    sp_frame_arena_advance(churn_arena, NULL);
    sp_frame_arena_advance(churn_arena, NULL);
    char *upper = churn_alloc_on_new_thread();
    churn_n = 1;
    sp_frame_arena_advance(churn_arena, NULL);
    sp_frame_arena_advance(churn_arena, NULL);
    char *direct = sp_frame_alloc(churn_arena, 2048);
    ok(upper == base + 4096 && direct != NULL,
       "kept chunks in the upper half (4-7, their thread gone): the next round keeps none, and a "
       "2 KiB direct range is served (%p)",
       (void *)direct);
    sp_frame_arena_destroy(churn_arena);

    /* More threads than claim records (64 per arena): every claim counted. */
    enum { THREADS = 70 };
    churn_arena = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL);
    bool distinct = true;
    char *got[THREADS];
    for (int i = 0; i < THREADS; i++) {
        got[i] = churn_alloc_on_new_thread();
        for (int j = 0; j < i; j++) distinct &= got[i] != got[j];
    }
    sp_frame_buffer_status open, closed;
    sp_frame_buffer_status_get(churn_arena, 0, &open);
    sp_frame_arena_advance(churn_arena, &closed);
    ok(distinct && open.chunks == THREADS && closed.chunks == THREADS &&
           closed.bytes_used == THREADS * 1024,
       "%d threads, one chunk each: all distinct, all counted (open %zu, closed %zu)", THREADS,
       open.chunks, closed.chunks);
    sp_frame_arena_destroy(churn_arena);

    /* A thread alternating between two arenas of one slot (a new chunk at every switch) keeps
     * its one record in each: 200 switches later it still gets its first chunk back. */
    sp_frame_arena *x = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL), *other[3];
    for (int i = 0; i < 3; i++) other[i] = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL);
    sp_frame_arena *y = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL); /* x's slot */
    char *x0 = NULL;
    for (int i = 0; i < 200; i++) {
        char *p = sp_frame_alloc(x, 16);
        if (!x0) x0 = p;
        sp_frame_alloc(y, 16);
    }
    sp_frame_arena_advance(x, NULL);
    sp_frame_arena_advance(x, NULL);
    churn_arena = x;
    char *n2 = churn_alloc_on_new_thread(); /* frame 2: a fresh claim first, above the 8 kept */
    char *x2 = sp_frame_alloc(x, 16);
    ok(x2 == x0 && n2 == x0 + 8 * 1024,
       "200 switches between two arenas of one slot: the thread still has its record (its first "
       "chunk back: %td; a new thread's fresh chunk: %td)",
       x2 - x0, n2 - x0);
    for (int i = 0; i < 3; i++) sp_frame_arena_destroy(other[i]);
    sp_frame_arena_destroy(x);
    sp_frame_arena_destroy(y);
}

/* ---- closes that do not read the records --------------------------------------------- */

/* Threads that allocate on command: at each rand_frame, thread i makes rand_count[i] (0: it
 * sits the frame out) allocations of RAND_SIZE bytes from rand_arena into rand_got[i], each
 * filled with i + 1. */
enum { RAND_THREADS = 4, RAND_FRAMES = 400, RAND_MAX_BLOCKS = 256, RAND_SIZE = 64 };
static pthread_barrier_t rand_bar;
static pthread_t rand_tids[RAND_THREADS];
static sp_frame_arena *rand_arena;
static uint32_t rand_count[RAND_THREADS];
static char *rand_got[RAND_THREADS][RAND_MAX_BLOCKS];
static bool rand_quit;

static void *rand_thread(void *arg) {
    int me = (int)(intptr_t)arg;
    for (;;) {
        pthread_barrier_wait(&rand_bar);
        if (rand_quit) return NULL;
        for (uint32_t i = 0; i < rand_count[me]; i++) {
            char *p = sp_frame_alloc(rand_arena, RAND_SIZE);
            if (p) memset(p, me + 1, RAND_SIZE);
            rand_got[me][i] = p;
        }
        pthread_barrier_wait(&rand_bar);
    }
}

static void rand_start(void) {
    memset(rand_count, 0, sizeof rand_count);
    pthread_barrier_init(&rand_bar, NULL, RAND_THREADS + 1);
    for (int i = 0; i < RAND_THREADS; i++)
        pthread_create(&rand_tids[i], NULL, rand_thread, (void *)(intptr_t)i);
}

/* The threads' allocations of one frame, all done when this returns. */
static void rand_frame(void) {
    pthread_barrier_wait(&rand_bar);
    pthread_barrier_wait(&rand_bar);
}

static void rand_stop(void) {
    rand_quit = true;
    pthread_barrier_wait(&rand_bar);
    for (int i = 0; i < RAND_THREADS; i++) pthread_join(rand_tids[i], NULL);
    pthread_barrier_destroy(&rand_bar);
    rand_quit = false;
}

/* Thread 0's one allocation from a, the others sitting the frame out. */
static char *rand_alloc_one(sp_frame_arena *a) {
    rand_arena = a;
    rand_count[0] = 1;
    rand_frame();
    rand_count[0] = 0;
    return rand_got[0][0];
}

/* A close without a fresh claim and without a status asked for keeps the reservation it had:
 * the main thread and a helper claim in frame 0; in frame 2 only the main thread comes back
 * (its kept chunk: no fresh claim), and the helper's chunk stays kept, so its fresh claim in
 * frame 4 lies above it; the close of frame 4 reads the records and a new thread takes the
 * chunk in frame 6. With the status asked for at frame 2's close, the helper's chunk is free at
 * once. The status of a buffer so closed is exact all the same, and so is its peak. */
static void test_close_unread(void) {
    rand_start();
    char *got[2][5];
    sp_frame_buffer_status st[2];
    for (int ask = 0; ask < 2; ask++) {
        sp_frame_arena *a = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL);
        sp_frame_buffer_status closed;
        got[ask][0] = sp_frame_alloc(a, 16); /* frame 0: chunk 0 */
        got[ask][1] = rand_alloc_one(a);     /* chunk 1 */
        sp_frame_arena_advance(a, NULL);
        sp_frame_arena_advance(a, NULL);
        got[ask][2] = sp_frame_alloc(a, 16); /* frame 2: chunk 0 again */
        sp_frame_arena_advance(a, ask ? &closed : NULL);
        sp_frame_buffer_status_get(a, 0, &st[ask]);
        sp_frame_arena_advance(a, NULL);
        got[ask][3] = rand_alloc_one(a); /* frame 4: the helper claims fresh */
        sp_frame_alloc(a, 16);
        sp_frame_arena_advance(a, NULL);
        sp_frame_arena_advance(a, NULL);
        churn_arena = a;
        got[ask][4] = churn_alloc_on_new_thread(); /* frame 6: a new thread, fresh */
        sp_frame_arena_destroy(a);
    }
    rand_stop();
    ptrdiff_t off[2][4];
    for (int ask = 0; ask < 2; ask++)
        for (int k = 1; k < 5; k++) off[ask][k - 1] = got[ask][k] - got[ask][0];
    ok(off[0][0] == 1024 && off[0][1] == 0 && off[0][2] == 2048 && off[0][3] == 1024,
       "a close with no fresh claim and no status asked for keeps a chunk whose thread did not "
       "come back: its fresh claim lies above it, and the next close frees it (%td %td %td %td)",
       off[0][0], off[0][1], off[0][2], off[0][3]);
    ok(off[1][0] == 1024 && off[1][1] == 0 && off[1][2] == 1024 && off[1][3] == 2048,
       "the same close with its status asked for frees the chunk at once (%td %td %td %td)",
       off[1][0], off[1][1], off[1][2], off[1][3]);
    ok(st[0].frame == 2 && st[0].chunks == 1 && st[0].bytes_used == 1024 && st[0].peak == 2048 &&
           memcmp(&st[0], &st[1], sizeof st[0]) == 0,
       "the status of a buffer so closed is exact (frame %llu, chunks %zu, used %zu, peak %zu)",
       (unsigned long long)st[0].frame, st[0].chunks, st[0].bytes_used, st[0].peak);

    /* A frame with no fresh claim whose direct part may raise the peak reads the records;
     * one whose chunks and direct part cannot does not, and the peak stands. */
    sp_frame_arena *a = make(2, 1u << 20, 1024, SP_FRAME_OVERFLOW_NULL);
    sp_frame_alloc(a, 16); /* frame 0: chunk 0, peak 1024 */
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL);
    sp_frame_alloc(a, 16);   /* frame 2: chunk 0 again */
    sp_frame_alloc(a, 2000); /* direct: 1024 + 2000 */
    sp_frame_arena_advance(a, NULL);
    sp_frame_buffer_status s2, s4;
    sp_frame_buffer_status_get(a, 0, &s2);
    sp_frame_arena_advance(a, NULL);
    sp_frame_alloc(a, 16);   /* frame 4: chunk 0 again */
    sp_frame_alloc(a, 1010); /* above the chunk's rest: direct, 1024 */
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL);
    sp_frame_alloc(a, 16); /* frame 6: chunk 0 again */
    sp_frame_arena_advance(a, NULL);
    sp_frame_buffer_status_get(a, 0, &s4);
    ok(s2.bytes_used == 3024 && s2.peak == 3024 && s4.frame == 6 && s4.bytes_used == 1024 &&
           s4.peak == 3024,
       "peaks: a direct part that may raise it is counted (%zu, peak %zu); later frames below it "
       "leave it (used %zu, peak %zu)",
       s2.bytes_used, s2.peak, s4.bytes_used, s4.peak);
    sp_frame_arena_destroy(a);
}

/* A request that overflowed because chunks kept for a thread that did not come back held the
 * space makes its close read the records: the main thread claims chunk 0 in frame 0, a helper
 * chunks 1-3 and goes; from frame 2 on the main thread takes chunk 0 back (no fresh claim) and
 * asks for 29,000 B, which fits above chunk 0 but not above chunk 3 of a 32 KiB buffer (where the
 * reservation is an eighth: the quarter rule leaves the close to the overflow): it fails once,
 * not in every frame. */
static void claim_three(sp_frame_arena *a) { /* on a new thread: 3 chunks of 1 KiB */
    churn_arena = a;
    churn_n = 3 * 64;
    churn_alloc_on_new_thread();
    churn_n = 1;
}

static void test_close_after_overflow(void) {
    sp_frame_arena *a = make(2, 2 * 32768, 1024, SP_FRAME_OVERFLOW_NULL);
    sp_frame_alloc(a, 16);
    claim_three(a);
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL);
    int failed = 0;
    ts_log_capture();
    for (int f = 2; f < 40; f += 2) {
        sp_frame_alloc(a, 16);
        failed += sp_frame_alloc(a, 29000) == NULL;
        sp_frame_arena_advance(a, NULL);
        sp_frame_arena_advance(a, NULL);
    }
    ts_log_release();
    ok(failed == 1,
       "chunks kept for a thread that did not come back hold a request out once: its overflow "
       "makes the close read the records (%d of 19 frames failed)",
       failed);
    sp_frame_arena_destroy(a);

    /* The same four chunks and a frame-2 direct range of 1 KiB: with the reservation (4 KiB)
     * they take more than a quarter of a 16 KiB buffer (not half), so frame 2's close reads the
     * records (the peak, 6 KiB from frame 0, cannot have risen), and a new thread's fresh claim
     * in frame 4 takes chunk 1, which the helper left. In a 32 KiB buffer they take less than a
     * quarter: the close keeps the reservation, the helper's chunks stay kept, and the new
     * thread's claim goes above them, to chunk 4. */
    for (int big = 0; big <= 1; big++) {
        a = make(2, 2 * (big ? 32768 : 16384), 1024, SP_FRAME_OVERFLOW_NULL);
        char *m0 = sp_frame_alloc(a, 16);
        claim_three(a);
        char *d0 = sp_frame_alloc(a, 2048); /* direct: peak 4 KiB + 2 KiB */
        sp_frame_arena_advance(a, NULL);
        sp_frame_arena_advance(a, NULL);
        char *m2 = sp_frame_alloc(a, 16);
        char *d2 = sp_frame_alloc(a, 1010); /* above the chunk's rest: direct, 1 KiB */
        sp_frame_arena_advance(a, NULL);
        sp_frame_arena_advance(a, NULL);
        churn_arena = a;
        char *n4 = churn_alloc_on_new_thread();
        ok(d0 && d2 && m2 == m0 && n4 == m0 + (big ? 4096 : 1024),
           big ? "a reservation and direct part below a quarter of the buffer leave the close to "
                 "keep the reservation: the departed thread's chunks stay kept the next round (%td)"
               : "a reservation and direct part above a quarter of the buffer make the close read "
                 "the records: the departed thread's chunk is free the next round (%td)",
           n4 - m0);
        sp_frame_arena_destroy(a);
    }
}

/* The reclaim fills (debug) or poisons (ASan) every chunk its frame used, also after a close
 * that read the records and reserved less for the next round: one thread, 8 chunks of 1 KiB;
 * frame 0 takes chunks 0-3, frame 2 takes them back and a fresh chunk 4 (in the upper half: the
 * next round reserves nothing); frame 4's reclaim covers all 5. */
static void test_reclaim_after_shrink(void) {
    if ((SP_DEBUG < 1 && !TRACK_ASAN) || TRACK_VALGRIND) {
        skip("the reclaim's fill (debug) and poisoning (ASan) are checked in those builds");
        return;
    }
    sp_frame_arena *a = make(2, 2 * 8192, 1024, SP_FRAME_OVERFLOW_NULL);
    for (int i = 0; i < 16; i++) sp_frame_alloc(a, 256);
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL);
    volatile uint8_t *p[20];
    for (int i = 0; i < 20; i++) {
        p[i] = sp_frame_alloc(a, 256);
        memset((void *)p[i], 0x11, 256);
    }
    sp_frame_arena_advance(a, NULL);
    sp_frame_arena_advance(a, NULL); /* frame 4: buffer 0 reclaimed */
    int missed = 0;
    for (int i = 0; i < 20; i++)
#if TRACK_ASAN
        missed += !__asan_address_is_poisoned((const void *)p[i]);
#else
        missed += !ts_filled((const uint8_t *)p[i], 256, 0xFD);
#endif
    ok(missed == 0,
       "the reclaim covers every chunk of its frame after a close that reserved less (%d of 20 "
       "blocks missed)",
       missed);
    sp_frame_arena_destroy(a);
}

/* Threads that come and go and claim more or fewer chunks from frame to frame, on 2 and 3
 * buffers, the closes mostly without the status: no two blocks of a frame ever overlap, and
 * every block lies in its frame's buffer. Runs under ThreadSanitizer (frame_tsan). */
static void test_close_unread_random(void) {
    rand_start();
    static ts_span blocks[RAND_THREADS * RAND_MAX_BLOCKS];
    ts_rng rng;
    ts_rng_seed(&rng, 0xc105e);
    int overlaps = 0, misplaced = 0, missing = 0, damaged = 0;
    for (uint32_t nbuf = 2; nbuf <= 3; nbuf++) {
        /* 1 KiB chunks, 128 a buffer: a thread takes 1 to 4 chunks a frame. */
        rand_arena = make(nbuf, (size_t)nbuf << 17, 1024, SP_FRAME_OVERFLOW_NULL);
        uint32_t usual[RAND_THREADS];
        for (int i = 0; i < RAND_THREADS; i++) usual[i] = (uint32_t)ts_rng_range(&rng, 1, 4);
        for (uint32_t f = 0; f < RAND_FRAMES; f++) {
            for (int i = 0; i < RAND_THREADS; i++) {
                /* Mostly the same frame as the last (every claim gets its chunk back),
                 * sometimes another number of chunks, sometimes none. */
                uint64_t k = ts_rng_range(&rng, 0, 15);
                uint32_t chunks = k < 12   ? usual[i]
                                  : k < 14 ? (uint32_t)ts_rng_range(&rng, 1, 4)
                                           : 0;
                if (k == 12) usual[i] = chunks;
                rand_count[i] = chunks * 16 - (uint32_t)ts_rng_range(&rng, 0, 8) * (chunks > 0);
            }
            rand_frame();
            size_t n = 0;
            for (int i = 0; i < RAND_THREADS; i++)
                for (uint32_t j = 0; j < rand_count[i]; j++) {
                    char *p = rand_got[i][j];
                    if (!p) {
                        missing++;
                        continue;
                    }
                    misplaced += sp_frame_arena_buffer_of(rand_arena, p) != (int)(f % nbuf);
                    damaged += !ts_filled((const uint8_t *)p, RAND_SIZE, (uint8_t)(i + 1));
                    blocks[n++] = (ts_span){(uintptr_t)p, RAND_SIZE};
                }
            overlaps += ts_overlaps(blocks, n);
            sp_frame_buffer_status closed;
            sp_frame_arena_advance(rand_arena, ts_rng_range(&rng, 0, 7) == 0 ? &closed : NULL);
        }
        sp_frame_arena_destroy(rand_arena);
    }
    rand_stop();
    ok(overlaps == 0 && misplaced == 0 && missing == 0 && damaged == 0,
       "%d threads, %d frames on 2 and 3 buffers, claims changing from frame to frame: no "
       "overlap (%d), none outside its buffer (%d), none refused (%d), none damaged (%d)",
       RAND_THREADS, RAND_FRAMES, overlaps, misplaced, missing, damaged);
}

int main(void) {
    plan(69);
    for (uint32_t n = 1; n <= 4; n++) test_lifetime(n);
    test_alignment();
    test_chunks();
    test_size_zero_and_buffer_of();
    test_overflow_null();
    test_overflow_heap();
    test_overflow_heap_misaligned();
    test_refusals_bounded();
    test_given_region(false);
    test_given_region(true);
    test_slots();
    test_generation_blocks();
    test_sticky();
    test_churn();
    test_close_unread();
    test_close_unread_random();
    test_close_after_overflow();
    test_reclaim_after_shrink();
    test_misuse();
    test_debug_fill();
    test_migration();
    return done();
}
