/* Frame arenas (sp_frame.h): create/destroy, the out-of-line allocation path (chunk refill,
 * direct requests, overflow to the heap), advance and reclaim, status. The inline fast paths
 * live in the header; in ASan/Valgrind builds everything runs here and tells the tools about
 * each allocation through track.h. */
#include <stdlib.h>
#include <string.h>

#include "sp_frame.h"
#include "sp_internal.h"
#include "track.h"

/* A buffer's bump state is one 64-bit word, so that a chunk costs one atomic add that both
 * moves the offset and counts the chunk: offset in the low OFF_BITS, chunks taken above.
 * Invariants: offset <= capacity + (threads racing past the end) * chunk_size (a load checks
 * for room before every add), capacity <= MAX_CAPACITY and capacity / chunk_size < MAX_CHUNKS,
 * so neither field overflows into the other. */
#define OFF_BITS 44
#define OFF_MASK ((UINT64_C(1) << OFF_BITS) - 1)
#define CHUNK_ONE (UINT64_C(1) << OFF_BITS)
#define MAX_CAPACITY ((size_t)1 << 42)
#define MAX_CHUNKS ((size_t)1 << 19)
#define MIN_CHUNK ((size_t)1024)
#define POISON_BYTE 0xFD

/* In front of every heap-fallback block: the buffer's list link and what heap_alloc returned. */
typedef struct heap_block {
    struct heap_block *next;
    void *block;
} heap_block;

typedef struct frame_buffer {
    _Alignas(64) uint64_t word; /* atomic: offset | chunks << OFF_BITS (see above) */
    /* Written atomically by allocating threads, only when the buffer ran out. */
    _Alignas(64) heap_block *heap; /* Treiber stack, pushed by overflows, walked by reclaim */
    size_t overflows, overflow_bytes;
    size_t lost_chunks; /* adds that went past the end: counted in word, never handed out */
    /* Owned by the advancing thread. */
    uint64_t frame;
    size_t peak;
    size_t touched; /* largest offset ever used: what destroy hands back to the tools */
    char *base;
} frame_buffer;

struct sp_frame_arena {
    sp_frame_hot_ hot; /* first: read by the inline paths */
    uint32_t buffers, current;
    uint64_t frame;
    size_t capacity; /* bytes per buffer, page-aligned */
    size_t chunk_size;
    sp_frame_overflow overflow;
    void *(*heap_alloc)(void *user, size_t align, size_t size);
    void (*heap_free)(void *user, void *p);
    void *heap_user;
    char *region;
    size_t committed; /* bytes of region committed at create (decommitted/released at destroy) */
    bool own;         /* we reserved the region */
    frame_buffer buf[SP_FRAME_MAX_BUFFERS];
};
_Static_assert(offsetof(struct sp_frame_arena, hot) == 0, "the inline paths read hot at a");

_Thread_local sp_frame_chunk sp_frame_tls[SP_FRAME_SLOTS]
    __attribute__((tls_model("initial-exec")));

static uint64_t gen_last;    /* atomic: generations handed out (0 is never one) */
static uint32_t arenas_made; /* atomic: slot of the next arena */

static uint64_t gen_take(void) {
    return __atomic_add_fetch(&gen_last, 1, __ATOMIC_RELAXED);
}

static void *libc_alloc(void *user, size_t align, size_t size) {
    (void)user;
    void *p;
    return posix_memalign(&p, align, size) == 0 ? p : NULL;
}

static void libc_free(void *user, void *p) {
    (void)user;
    free(p);
}

/* ---- allocation ------------------------------------------------------------------------ */

static size_t word_offset(uint64_t w) {
    return (size_t)(w & OFF_MASK);
}

/* Give the calling thread's chunk slot a fresh chunk of b. One atomic add (after a load that
 * refuses when there is no room, keeping the offset bounded). False: b has no room left. */
static bool chunk_take(sp_frame_arena *a, frame_buffer *b, sp_frame_chunk *c) {
    uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
    if (word_offset(w) + a->chunk_size > a->capacity) return false;
    w = __atomic_fetch_add(&b->word, a->chunk_size + CHUNK_ONE, __ATOMIC_RELAXED);
    size_t off = word_offset(w);
    if (SP_UNLIKELY(off + a->chunk_size > a->capacity)) { /* another thread took the rest */
        __atomic_fetch_add(&b->lost_chunks, 1, __ATOMIC_RELAXED);
        return false;
    }
    c->gen = a->hot.gen;
    c->cur = b->base + off;
    c->end = c->cur + a->chunk_size;
    return true;
}

/* Bump size bytes aligned to align (<= small_max, a power of two >= 16) from c, or NULL. */
static void *chunk_bump(sp_frame_chunk *c, size_t align, size_t size) {
    uintptr_t p = sp_align_up((uintptr_t)c->cur, align);
    uintptr_t e = sp_align_up(p + size, 16);
    if (e > (uintptr_t)c->end) return NULL;
    c->cur = (char *)e;
    return (void *)p;
}

/* A range of its own in b for a request (large, or too large for a fresh chunk): a CAS loop
 * on the offset, exact (no chunk tail is lost). NULL: it does not fit. */
static void *direct_take(sp_frame_arena *a, frame_buffer *b, size_t align, size_t size) {
    if (align > a->capacity || size > a->capacity) return NULL;
    size_t n = sp_align_up(size, 16);
    uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
    for (;;) {
        size_t off = word_offset(w);
        if (off >= a->capacity) return NULL;
        uintptr_t p = sp_align_up((uintptr_t)b->base + off, align);
        size_t end = (size_t)(p - (uintptr_t)b->base) + n;
        if (end > a->capacity) return NULL;
        if (__atomic_compare_exchange_n(&b->word, &w, (w & ~OFF_MASK) | end, true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            return (void *)p;
    }
}

/* The request did not fit: count it (the first of the frame is logged), then refuse or take
 * a block from the heap fallback and keep it on b's list until reclaim. */
static SP_COLD void *overflow_serve(sp_frame_arena *a, frame_buffer *b, size_t align, size_t size,
                                    const char *call) {
    if (__atomic_fetch_add(&b->overflows, 1, __ATOMIC_RELAXED) == 0)
        sp_log(SP_LOG_WARN, SP_ERR_NOMEM, call, a,
               "frame %llu: buffer %u (%zu bytes) has no room for %zu bytes; %s",
               (unsigned long long)a->frame, a->current, a->capacity, size,
               a->overflow == SP_FRAME_OVERFLOW_HEAP ? "heap fallback until its reclaim"
                                                     : "returning NULL");
    if (a->overflow != SP_FRAME_OVERFLOW_HEAP) return NULL;
    size_t hdr = sp_align_up(sizeof(heap_block), align); /* p = block + hdr stays aligned */
    if (size > SIZE_MAX - hdr) return NULL;
    char *block = a->heap_alloc(a->heap_user, align, hdr + size);
    if (!block) return NULL;
    heap_block *h = (heap_block *)(void *)(block + hdr) - 1;
    h->block = block;
    h->next = __atomic_load_n(&b->heap, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(&b->heap, &h->next, h, true, __ATOMIC_RELEASE,
                                        __ATOMIC_RELAXED)) {
    }
    __atomic_fetch_add(&b->overflow_bytes, size, __ATOMIC_RELAXED);
    return block + hdr;
}

static void *alloc_any(sp_frame_arena *a, size_t align, size_t size, const char *call) {
    if (SP_UNLIKELY(!sp_is_pow2(align))) {
        sp_misuse(SP_ERR_BAD_ALIGNMENT, call, a, "alignment %zu is not a power of two", align);
        return NULL;
    }
    if (SP_UNLIKELY(size > PTRDIFF_MAX)) {
        sp_misuse(SP_ERR_OVERFLOW, call, a, "size %zu overflows", size);
        return NULL;
    }
    if (align < 16) align = 16;
    frame_buffer *b = &a->buf[a->current];
    void *p = NULL;
    if (size <= a->hot.small_max && align <= a->hot.small_max) {
        /* A plain thread-local access: this function does not suspend, so the address it
         * computes is the running thread's for the whole call. */
        sp_frame_chunk *c = &sp_frame_tls[a->hot.slot];
        if (c->gen == a->hot.gen) p = chunk_bump(c, align, size);
        /* size + align padding < 2 * small_max <= chunk_size: a fresh chunk always fits. */
        if (!p && chunk_take(a, b, c)) p = chunk_bump(c, align, size);
    }
    if (!p) p = direct_take(a, b, align, size); /* large, or the buffer's last bytes */
    if (SP_UNLIKELY(!p)) return overflow_serve(a, b, align, size, call);
    track_bump(p, size);
    return p;
}

void *sp_frame_alloc_generic(sp_frame_arena *a, size_t align, size_t size) {
    return alloc_any(a, align, size, align == 16 ? "sp_frame_alloc" : "sp_frame_aligned_alloc");
}

/* ---- frames ------------------------------------------------------------------------------ */

static size_t buffer_used(const sp_frame_arena *a, const frame_buffer *b) {
    size_t off = word_offset(__atomic_load_n(&b->word, __ATOMIC_RELAXED));
    return off < a->capacity ? off : a->capacity;
}

static void heap_list_free(sp_frame_arena *a, frame_buffer *b) {
    heap_block *h = __atomic_exchange_n(&b->heap, NULL, __ATOMIC_ACQUIRE);
    while (h) {
        heap_block *next = h->next;
        a->heap_free(a->heap_user, h->block);
        h = next;
    }
}

/* Everything b held goes: heap blocks freed, debug fill or tool poisoning of the used part
 * (O(used), debug and tool builds only), offset and counters back to 0 (O(1)). */
static void buffer_reclaim(sp_frame_arena *a, frame_buffer *b) {
    size_t used = buffer_used(a, b);
    heap_list_free(a, b);
#if TRACK_ASAN || TRACK_VALGRIND
    track_pool(b->base, used);
#elif SP_DEBUG >= 1
    memset(b->base, POISON_BYTE, used);
#endif
    if (used > b->touched) b->touched = used;
    __atomic_store_n(&b->word, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&b->overflows, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&b->overflow_bytes, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&b->lost_chunks, 0, __ATOMIC_RELAXED);
}

static void status_fill(const sp_frame_arena *a, uint32_t i, sp_frame_buffer_status *out) {
    const frame_buffer *b = &a->buf[i];
    uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
    size_t off = word_offset(w), used = off < a->capacity ? off : a->capacity;
    size_t lost = __atomic_load_n(&b->lost_chunks, __ATOMIC_RELAXED);
    *out = (sp_frame_buffer_status){
        .frame = b->frame,
        .bytes_used = used,
        .peak = used > b->peak ? used : b->peak,
        .chunks = (size_t)(w >> OFF_BITS) - lost,
        .overflows = __atomic_load_n(&b->overflows, __ATOMIC_RELAXED),
        .overflow_bytes = __atomic_load_n(&b->overflow_bytes, __ATOMIC_RELAXED),
        .capacity = a->capacity,
    };
}

uint64_t sp_frame_arena_advance(sp_frame_arena *a, sp_frame_buffer_status *closed) {
    frame_buffer *b = &a->buf[a->current];
    size_t used = buffer_used(a, b);
    if (used > b->peak) b->peak = used;
    if (closed) status_fill(a, a->current, closed);
    a->frame++;
    a->current = (uint32_t)(a->frame % a->buffers);
    b = &a->buf[a->current];
    buffer_reclaim(a, b);
    b->frame = a->frame;
    a->hot.gen = gen_take(); /* every thread's chunk of the old frame is stale now */
    return a->frame;
}

uint64_t sp_frame_arena_frame(const sp_frame_arena *a) {
    return a->frame;
}

int sp_frame_arena_buffer_of(const sp_frame_arena *a, const void *p) {
    uintptr_t off = (uintptr_t)p - (uintptr_t)a->region;
    if (off >= (uintptr_t)a->capacity * a->buffers) return -1;
    return (int)(off / a->capacity);
}

void sp_frame_buffer_status_get(const sp_frame_arena *a, uint32_t buffer,
                                sp_frame_buffer_status *out) {
    if (SP_UNLIKELY(buffer >= a->buffers)) {
        *out = (sp_frame_buffer_status){0};
        sp_misuse(SP_ERR_INVALID_ARG, "sp_frame_buffer_status_get", a,
                  "buffer %u of an arena of %u buffers", buffer, a->buffers);
        return;
    }
    status_fill(a, buffer, out);
}

/* ---- create / destroy -------------------------------------------------------------------- */

static sp_frame_arena *create_fail(sp_result *err, sp_result r) {
    if (err) *err = r;
    return NULL;
}

sp_frame_arena *sp_frame_arena_create(const sp_frame_desc *desc, sp_result *err) {
    static const char call[] = "sp_frame_arena_create";
    const sp_frame_desc d = desc ? *desc : (sp_frame_desc){0};
    const size_t page = sp_page_size();
    uint32_t n = d.buffers ? d.buffers : 2;
    if (n > SP_FRAME_MAX_BUFFERS)
        return create_fail(err, sp_misuse(SP_ERR_INVALID_ARG, call, NULL, "%u buffers (at most %d)",
                                          n, SP_FRAME_MAX_BUFFERS));
    if (d.chunk_size > MAX_CAPACITY)
        return create_fail(
            err, sp_misuse(SP_ERR_INVALID_ARG, call, NULL, "chunk size %zu", d.chunk_size));
    size_t chunk = d.chunk_size ? sp_align_up(d.chunk_size, 16) : SP_FRAME_DEFAULT_CHUNK;
    if (chunk < MIN_CHUNK) chunk = MIN_CHUNK;
    if ((unsigned)d.overflow > SP_FRAME_OVERFLOW_HEAP || !d.heap_alloc != !d.heap_free)
        return create_fail(err, sp_misuse(SP_ERR_INVALID_ARG, call, NULL,
                                          "overflow mode %d, heap_alloc %s, heap_free %s",
                                          (int)d.overflow, d.heap_alloc ? "set" : "NULL",
                                          d.heap_free ? "set" : "NULL"));
    if (d.region && (((uintptr_t)d.region & (page - 1)) != 0 || d.region_size == 0))
        return create_fail(err, sp_misuse(SP_ERR_INVALID_ARG, call, d.region,
                                          "region %p + %zu: not page-aligned or empty", d.region,
                                          d.region_size));
    size_t size = d.region_size;
    if (!d.region && size == 0) size = (size_t)n * SP_FRAME_DEFAULT_BUFFER;
    size_t capacity = sp_align_down(size / n, page);
    if (capacity > MAX_CAPACITY || capacity / chunk >= MAX_CHUNKS)
        return create_fail(err, sp_misuse(SP_ERR_INVALID_ARG, call, d.region,
                                          "buffers of %zu bytes: above 4 TiB or 2^19 chunks of %zu",
                                          capacity, chunk));
    if (capacity < chunk)
        return create_fail(err, sp_misuse(SP_ERR_TOO_SMALL, call, d.region,
                                          "%zu bytes make %u buffers of %zu bytes, below one "
                                          "chunk of %zu",
                                          size, n, capacity, chunk));
    sp_frame_arena *a = aligned_alloc(64, sizeof *a);
    if (!a) return create_fail(err, SP_ERR_NOMEM);
    memset(a, 0, sizeof *a);
    a->own = d.region == NULL;
    a->committed = a->own ? capacity * n : sp_align_down(size, page);
    a->region = a->own ? sp_vm_reserve(a->committed, 0, false, NULL) : d.region;
    if (!a->region) {
        free(a);
        return create_fail(err, SP_ERR_OS);
    }
    sp_result r = sp_vm_commit(a->region, a->committed);
    if (r != SP_OK) {
        if (a->own) sp_vm_release(a->region, a->committed);
        free(a);
        return create_fail(err, r);
    }
    a->hot.gen = gen_take();
    a->hot.slot = __atomic_fetch_add(&arenas_made, 1, __ATOMIC_RELAXED) % SP_FRAME_SLOTS;
    a->hot.small_max = chunk / 4;
    a->buffers = n;
    a->capacity = capacity;
    a->chunk_size = chunk;
    a->overflow = d.overflow;
    a->heap_alloc = d.heap_alloc ? d.heap_alloc : libc_alloc;
    a->heap_free = d.heap_free ? d.heap_free : libc_free;
    a->heap_user = d.heap_user;
    for (uint32_t i = 0; i < n; i++) a->buf[i].base = a->region + (size_t)i * capacity;
    if (err) *err = SP_OK;
    return a;
}

void sp_frame_arena_destroy(sp_frame_arena *a) {
    if (!a) return;
    for (uint32_t i = 0; i < a->buffers; i++) {
        frame_buffer *b = &a->buf[i];
        heap_list_free(a, b);
        size_t used = buffer_used(a, b);
        track_release(b->base, used > b->touched ? used : b->touched);
    }
    if (a->own)
        sp_vm_release(a->region, a->committed);
    else
        sp_vm_decommit(a->region, a->committed);
    free(a);
}
