/* Frame arenas (sp_frame.h): create/destroy, the out-of-line allocation path (chunk refill,
 * direct requests, overflow to the heap), advance and reclaim, status. The inline fast paths
 * live in the header; in ASan/Valgrind builds everything runs here and tells the tools about
 * each allocation through track.h. */
#include <stdlib.h>
#include <string.h>

#include "sp_frame.h"
#include "sp_internal.h"
#include "track.h"

/* A buffer is cut into `chunks` equal chunks, claimed bottom-up, and direct ranges taken
 * top-down. Its bump state is one 64-bit word: lo, the chunk index below which chunks may be
 * claimed, in the low LO_BITS; hi, the byte offset where the direct ranges begin, above. A
 * claimed chunk has its bit set in the buffer's bitmap: the bit decides who owns a chunk.
 * A thread first asks for the chunk it had at the same place in its claim order N frames ago
 * (memory its own core's cache last wrote: threads do not trade cache lines across frames),
 * which raises lo past it; otherwise the bump hands out lo and moves it up, skipping chunks
 * whose bit is set.
 * Invariants: lo * chunk_size <= hi, except for fresh claims racing past the end (refused,
 * and lo <= chunks + threads < 2^LO_BITS); every chunk handed out lies below lo; every direct
 * range lies at or above hi. So chunks and direct ranges never overlap, and a chunk below lo
 * that nobody claims this frame is lost until the reclaim (a thread that stopped using it). */
#define LO_BITS 20
#define LO_MASK ((UINT64_C(1) << LO_BITS) - 1)
#define MAX_CAPACITY ((size_t)1 << 42)
#define MAX_CHUNKS ((size_t)1 << 19)
#define STICKY 8 /* chunks a thread remembers per arena slot and buffer */
#define MIN_CHUNK ((size_t)1024)
#define POISON_BYTE 0xFD

/* In front of every heap-fallback block: the buffer's list link and what heap_alloc returned. */
typedef struct heap_block {
    struct heap_block *next;
    void *block;
} heap_block;

typedef struct frame_buffer {
    _Alignas(64) uint64_t word; /* atomic: lo | hi << LO_BITS (see above) */
    size_t claimed;             /* atomic: chunks claimed in the buffer's frame (kept after its
                                   close, when the bits are cleared) */
    /* Written atomically by allocating threads, only when the buffer ran out. */
    _Alignas(64) heap_block *heap; /* Treiber stack, pushed by overflows, walked by reclaim */
    size_t overflows, overflow_bytes;
    /* Owned by the advancing thread. */
    uint64_t frame;
    size_t peak;
    char *base;
    uint64_t *bits; /* atomic words, one bit per chunk: claimed in the open frame (cleared at
                       the buffer's close) */
} frame_buffer;

struct sp_frame_arena {
    sp_frame_hot_ hot; /* first: read by the inline paths */
    uint32_t buffers, current;
    uint64_t frame;
    size_t capacity; /* bytes per buffer, page-aligned */
    size_t chunk_size;
    size_t chunks;    /* per buffer: capacity / chunk_size */
    size_t bit_words; /* per buffer */
    uint64_t id;      /* unique across arenas: tags the threads' sticky lists */
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

/* The chunks a thread claimed in one buffer of one arena slot, in claim order: replayed first
 * when the buffer comes round (a steady frame loop gets its own memory back). */
typedef struct sticky_list {
    uint64_t arena; /* sp_frame_arena.id; another arena's list is dropped */
    uint64_t gen;   /* frame generation the replay cursor belongs to */
    uint32_t count, next;
    uint32_t index[STICKY];
} sticky_list;

static _Thread_local sticky_list sticky_tls[SP_FRAME_SLOTS][SP_FRAME_MAX_BUFFERS];

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

static size_t word_lo(uint64_t w) {
    return (size_t)(w & LO_MASK);
}
static size_t word_hi(uint64_t w) {
    return (size_t)(w >> LO_BITS);
}

/* Set chunk i's bit; true if it was clear (the chunk is ours, and counted). */
static bool bit_claim(frame_buffer *b, size_t i) {
    uint64_t m = UINT64_C(1) << (i & 63);
    if (__atomic_fetch_or(&b->bits[i >> 6], m, __ATOMIC_RELAXED) & m) return false;
    __atomic_fetch_add(&b->claimed, 1, __ATOMIC_RELAXED);
    return true;
}

/* Chunk i again, if nobody claimed it this frame and no direct range covers it: a CAS that
 * raises lo past it (a load when it is below lo already), then one atomic or (and the
 * count's atomic add, on the bump word's line). */
static bool chunk_sticky(sp_frame_arena *a, frame_buffer *b, size_t i) {
    if (SP_UNLIKELY(i >= a->chunks)) return false; /* lists hold this arena's claims only */
    uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
    /* The hi test applies below lo too: a fresh claim refused at the end leaves lo above
     * chunks a direct range covers (hi only comes down to lo * chunk_size). */
    for (;;) {
        if ((i + 1) * a->chunk_size > word_hi(w)) return false; /* a direct range took it */
        if (word_lo(w) > i) break;
        uint64_t nw = (w & ~LO_MASK) | (uint64_t)(i + 1);
        if (__atomic_compare_exchange_n(&b->word, &w, nw, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            break;
    }
    return bit_claim(b, i);
}

/* The next chunk of the bump that nobody claimed: one atomic add and one atomic or, plus the
 * count (more
 * when a sticky claim got there first). A load first refuses when there is no room, which
 * keeps lo bounded. */
static bool chunk_fresh(sp_frame_arena *a, frame_buffer *b, size_t *out) {
    for (;;) {
        uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
        if ((word_lo(w) + 1) * a->chunk_size > word_hi(w)) return false;
        w = __atomic_fetch_add(&b->word, 1, __ATOMIC_RELAXED);
        size_t i = word_lo(w);
        if ((i + 1) * a->chunk_size > word_hi(w)) return false; /* another thread took the rest */
        if (bit_claim(b, i)) {
            *out = i;
            return true;
        }
    }
}

/* Give the calling thread's chunk slot a chunk of b: the one it had at the same place in its
 * claim order N frames ago if still free, else a fresh one. False: b has no room left. */
static bool chunk_take(sp_frame_arena *a, frame_buffer *b, sp_frame_chunk *c) {
    sticky_list *l = &sticky_tls[a->hot.slot][a->current];
    if (l->arena != a->id) *l = (sticky_list){.arena = a->id};
    if (l->gen != a->hot.gen) {
        l->gen = a->hot.gen;
        l->next = 0;
    }
    size_t i = 0;
    bool again = l->next < l->count && chunk_sticky(a, b, i = l->index[l->next]);
    if (!again && !chunk_fresh(a, b, &i)) return false;
    if (l->next < STICKY) {
        l->index[l->next++] = (uint32_t)i;
        if (l->next > l->count) l->count = l->next;
    }
    c->gen = a->hot.gen;
    c->cur = b->base + i * a->chunk_size;
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

/* A range of its own in b for a request (large, or too large for a fresh chunk), taken from
 * the top down, never below lo: a CAS loop on hi, exact (no chunk tail is lost). NULL: it
 * does not fit. */
static void *direct_take(sp_frame_arena *a, frame_buffer *b, size_t align, size_t size) {
    if (size > a->capacity) return NULL; /* alloc_any sent alignments above it to overflow */
    size_t n = sp_align_up(size, 16);
    uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
    for (;;) {
        size_t lo = word_lo(w), hi = word_hi(w);
        if (n > hi) return NULL;
        uintptr_t p = sp_align_down((uintptr_t)b->base + hi - n, align);
        if (p < (uintptr_t)b->base + lo * a->chunk_size) return NULL;
        uint64_t nw = (uint64_t)lo | (uint64_t)(p - (uintptr_t)b->base) << LO_BITS;
        if (__atomic_compare_exchange_n(&b->word, &w, nw, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
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
    if (SP_UNLIKELY(align > a->capacity))
        return overflow_serve(a, &a->buf[a->current], align, size, call);
    frame_buffer *b = &a->buf[a->current];
    void *p = NULL;
    /* A plain thread-local access: this function does not suspend, so the address it
     * computes is the running thread's for the whole call. Any request that fits the rest of
     * the thread's chunk comes from it (as on the inline path); only small ones take a new
     * chunk. */
    sp_frame_chunk *c = &sp_frame_tls[a->hot.slot];
    if (c->gen == a->hot.gen) p = chunk_bump(c, align, size);
    /* size + align padding < 2 * small_max <= chunk_size: a fresh chunk always fits. */
    if (!p && size <= a->hot.small_max && align <= a->hot.small_max && chunk_take(a, b, c))
        p = chunk_bump(c, align, size);
    if (!p) p = direct_take(a, b, align, size); /* large, or the buffer's last bytes */
    if (SP_UNLIKELY(!p)) return overflow_serve(a, b, align, size, call);
    track_bump(p, size);
    return p;
}

/* noinline: alloc_any reads the thread's chunk through a plain thread-local address, right
 * only while no fiber switch can come between (this call never suspends; inlined into a
 * caller that does, the address could be kept across the switch). */
SP_NOINLINE void *sp_frame_alloc_generic(sp_frame_arena *a, size_t align, size_t size) {
    return alloc_any(a, align, size, align == 16 ? "sp_frame_alloc" : "sp_frame_aligned_alloc");
}

/* ---- frames ------------------------------------------------------------------------------ */

/* The bitmap words that can hold claims: every claimed chunk lies below lo (a fresh claim
 * raises lo first, a sticky one raises it past its chunk), so a frame that used a few chunks
 * costs its close a word or two to clear, not the whole map. */
static size_t bit_words_used(const sp_frame_arena *a, const frame_buffer *b) {
    size_t lo = word_lo(__atomic_load_n(&b->word, __ATOMIC_RELAXED));
    size_t n = (lo + 63) / 64;
    return n < a->bit_words ? n : a->bit_words;
}

static void heap_list_free(sp_frame_arena *a, frame_buffer *b) {
    heap_block *h = __atomic_exchange_n(&b->heap, NULL, __ATOMIC_ACQUIRE);
    while (h) {
        heap_block *next = h->next;
        a->heap_free(a->heap_user, h->block);
        h = next;
    }
}

#if TRACK_ASAN || TRACK_VALGRIND || SP_DEBUG >= 1
/* Fill (plain debug builds) or hand back to the tools as the allocator's (ASan, Valgrind) the
 * bytes [from, to) of b, so that a pointer kept past the reclaim is caught at its first use. */
static void range_poison(frame_buffer *b, size_t from, size_t to) {
    if (from >= to) return;
#if TRACK_ASAN || TRACK_VALGRIND
    track_pool(b->base + from, to - from);
#else
    memset(b->base + from, POISON_BYTE, to - from);
#endif
}
#endif

/* The chunk bitmap of b, which closes: nothing claims in b again before its reclaim, whose
 * cost then does not depend on how much the frame allocated (the words written during the
 * frame are still in cache now). */
static void bits_clear(const sp_frame_arena *a, frame_buffer *b) {
    for (size_t k = bit_words_used(a, b); k-- > 0;)
        __atomic_store_n(&b->bits[k], 0, __ATOMIC_RELAXED);
}

/* Everything b held goes: heap blocks freed (O(their count)), what the frame used poisoned in
 * debug and tool builds (the chunks below lo and the direct part from hi up: O(used)), the
 * bump state and the counts reset. */
static void buffer_reclaim(sp_frame_arena *a, frame_buffer *b) {
    heap_list_free(a, b);
#if TRACK_ASAN || TRACK_VALGRIND || SP_DEBUG >= 1
    uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
    size_t hi = word_hi(w), lo_bytes = word_lo(w) * a->chunk_size;
    range_poison(b, 0, lo_bytes < hi ? lo_bytes : hi);
    range_poison(b, hi, a->capacity);
#endif
    __atomic_store_n(&b->word, (uint64_t)a->capacity << LO_BITS, __ATOMIC_RELAXED);
    __atomic_store_n(&b->claimed, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&b->overflows, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&b->overflow_bytes, 0, __ATOMIC_RELAXED);
}

static void status_fill(const sp_frame_arena *a, uint32_t i, sp_frame_buffer_status *out) {
    const frame_buffer *b = &a->buf[i];
    /* In use: the claimed chunks and everything from hi up (the direct ranges). O(1). */
    size_t chunks = __atomic_load_n(&b->claimed, __ATOMIC_RELAXED);
    size_t used = chunks * a->chunk_size +
                  (a->capacity - word_hi(__atomic_load_n(&b->word, __ATOMIC_RELAXED)));
    *out = (sp_frame_buffer_status){
        .frame = b->frame,
        .bytes_used = used,
        .peak = used > b->peak ? used : b->peak,
        .chunks = chunks,
        .overflows = __atomic_load_n(&b->overflows, __ATOMIC_RELAXED),
        .overflow_bytes = __atomic_load_n(&b->overflow_bytes, __ATOMIC_RELAXED),
        .capacity = a->capacity,
    };
}

uint64_t sp_frame_arena_advance(sp_frame_arena *a, sp_frame_buffer_status *closed) {
    frame_buffer *b = &a->buf[a->current];
    sp_frame_buffer_status st;
    status_fill(a, a->current, &st);
    b->peak = st.peak;
    bits_clear(a, b);
    if (closed) *closed = st;
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
    size_t chunks = capacity / chunk, bit_words = (chunks + 63) / 64;
    sp_frame_arena *a = aligned_alloc(64, sizeof *a);
    uint64_t *bits = calloc((size_t)n * bit_words, sizeof *bits);
    if (!a || !bits) {
        free(a);
        free(bits);
        return create_fail(err, SP_ERR_NOMEM);
    }
    memset(a, 0, sizeof *a);
    a->own = d.region == NULL;
    a->committed = a->own ? capacity * n : sp_align_down(size, page);
    a->region = a->own ? sp_vm_reserve(a->committed, 0, false, NULL) : d.region;
    if (!a->region) {
        free(a);
        free(bits);
        return create_fail(err, SP_ERR_OS);
    }
    sp_result r = sp_vm_commit(a->region, a->committed);
    if (r != SP_OK) {
        if (a->own) sp_vm_release(a->region, a->committed);
        free(a);
        free(bits);
        return create_fail(err, r);
    }
    a->id = gen_take();
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
    a->chunks = chunks;
    a->bit_words = bit_words;
    for (uint32_t i = 0; i < n; i++) {
        a->buf[i].base = a->region + (size_t)i * capacity;
        a->buf[i].bits = bits + (size_t)i * bit_words;
        a->buf[i].word = (uint64_t)capacity << LO_BITS;
    }
    if (err) *err = SP_OK;
    return a;
}

void sp_frame_arena_destroy(sp_frame_arena *a) {
    if (!a) return;
    for (uint32_t i = 0; i < a->buffers; i++) {
        frame_buffer *b = &a->buf[i];
        heap_list_free(a, b);
        track_release(b->base, a->capacity); /* tool builds: plain memory again */
    }
    if (a->own)
        sp_vm_release(a->region, a->committed);
    else
        sp_vm_decommit(a->region, a->committed);
    free(a->buf[0].bits);
    free(a);
}
