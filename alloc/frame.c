/* Frame arenas (sp_frame.h): create/destroy, the out-of-line allocation path (chunk refill,
 * direct requests, overflow to the heap), advance and reclaim, status. The inline fast paths
 * live in the header; in ASan/Valgrind builds everything runs here and tells the tools about
 * each allocation through track.h. */
#include <stdlib.h>
#include <string.h>

#include "sp_frame.h"
#include "sp_internal.h"
#include "track.h"

/* A buffer is cut into `chunks` equal chunks for the threads' bump allocation; direct ranges
 * are taken from its top down.
 *
 * A thread first asks for the chunks it had in the buffer's previous frame, in the same order
 * (memory its own core wrote last: threads do not trade cache lines across frames), and gets
 * them without touching anything shared. What makes that safe: each thread keeps the list of
 * its claims in a claim record of its own (see claim_record); when the buffer closes,
 * `reserved` becomes one past the highest chunk on the records of that frame, and the chunks
 * below it that no record kept become the buffer's holes. When the buffer comes round, a chunk
 * below reserved goes only to the thread whose record asks for it: those records, written in
 * the buffer's previous frame, are disjoint (each chunk had one owner then). Every other claim
 * is fresh: one atomic add on the bump word, whose lo counts fresh claims: the first
 * hole_count of them take the holes, the rest the chunks from reserved up. A record entry at
 * or above reserved, a record older than the buffer's previous frame, or a thread without a
 * record (RECORDS per arena, one per thread) takes a fresh chunk too. A frame without a fresh
 * claim changes no list but to shorten it, so its close may keep the reservation it had
 * instead of reading the records (sp_frame_arena_advance).
 *
 * The bump word: lo in the low LO_BITS; hi, the byte offset where the direct ranges begin,
 * above. The chunks that may be in use lie below floor = reserved + max(0, lo - hole_count).
 * Invariants: floor * chunk_size <= hi, except for fresh claims racing past the end (refused,
 * and lo <= chunks + threads < 2^LO_BITS); every direct range lies at or above hi. So chunks
 * and direct ranges never overlap; a reserved chunk whose thread does not come back for it is
 * lost to chunks and direct ranges until a close reads the records (then it is a hole the next
 * time round).
 * More than MAX_HOLES holes, or a kept chunk in the upper half of the buffer: the next round
 * reserves nothing (every claim fresh; the records' lists then refill), so that the upper half
 * of a buffer is never held for threads that may not come back. A thread holds one record
 * index per arena for the arena's life: the first RECORDS threads to claim get one. */
#define LO_BITS 20
#define LO_MASK ((UINT64_C(1) << LO_BITS) - 1)
#define MAX_CAPACITY ((size_t)1 << 42)
#define MAX_CHUNKS ((size_t)1 << 19)
#define STICKY 8      /* chunks a record keeps (asked for again) */
#define RECORDS 64    /* claim records per arena; threads beyond count on the bump word's line */
#define MAX_HOLES 512 /* per buffer */
#define MIN_CHUNK ((size_t)1024)
#define POISON_BYTE 0xFD

/* In front of every heap-fallback block: the buffer's list link and what heap_alloc returned. */
typedef struct heap_block {
    struct heap_block *next;
    void *block;
} heap_block;

/* A buffer's shared state, one line: the fresh claims' bump word, the overflows' list and
 * counts (written by allocating threads, the overflows only when the buffer ran out), and what
 * the close decided for the next round. The reclaim of a buffer touches only this line of it,
 * and the close of the other buffer only this line of that one: after a large frame neither
 * waits for memory (each is a line the frame or the advance before it touched). */
typedef struct frame_buffer {
    _Alignas(64) uint64_t word; /* atomic: lo | hi << LO_BITS (see above) */
    size_t unrecorded;          /* atomic: chunks claimed by threads without a claim record */
    heap_block *heap;           /* atomic: Treiber stack, pushed by overflows, walked by reclaim */
    size_t overflows, overflow_bytes; /* atomic */
    uint32_t *holes;                  /* MAX_HOLES */
    uint32_t reserved, hole_count;
    uint32_t floor;   /* chunk_floor at its close: the chunks its frame may have used */
    uint32_t counted; /* chunks claimed in its frame of the last close that read the records */
} frame_buffer;

/* One thread's claims in every buffer of an arena, on a line of its own: written by that
 * thread at its first claim of a frame and at each claim (atomically: status may read it
 * meanwhile), read by every close that reads the records (sp_frame_arena_advance), which looks
 * at the record of each thread that ever claimed.
 * One line per thread, not one per thread and buffer: the close of a buffer a thread did not
 * claim in then reads a line that thread wrote in the frame before, not one untouched for a
 * round (which a large frame evicts: bench frame/reset after 1,000,000 allocations waited
 * for memory; bench/README.md, "The reset at 1,000,000 allocations on the AMD machine"). */
typedef struct claim_record {
    _Alignas(64) uint64_t frame[SP_FRAME_MAX_BUFFERS]; /* per buffer: the frame of the claims */
    uint32_t claimed[SP_FRAME_MAX_BUFFERS];            /* chunks claimed in it, kept or not */
    uint8_t kept[SP_FRAME_MAX_BUFFERS];   /* entries of the list: the first claims, in order */
    uint8_t replay[SP_FRAME_MAX_BUFFERS]; /* entries of the buffer's previous frame to ask for */
} claim_record;

/* The chunks of a thread's first claims in each buffer, in order. An entry is written only
 * when a claim takes another chunk than the one it holds: a thread that gets its chunks of
 * last time back writes nothing here, so a frame costs it one written line (its record). The
 * close reads the closing buffer's entries of the threads that claimed in its frame (lines
 * those threads read at their first claims of that frame: after a very large frame these may
 * have left the cache, unlike the records the close reads of every thread). */
typedef struct claim_list {
    _Alignas(64) uint32_t index[SP_FRAME_MAX_BUFFERS][STICKY];
} claim_list;

/* A thread's record and list, on lines of their own that no other thread's share a 128-byte
 * pair with (CPUs fetch lines in such pairs). */
typedef struct claim_slot {
    _Alignas(128) claim_record record;
    claim_list list;
} claim_slot;
_Static_assert(sizeof(claim_record) == 64, "a claim record is one line");
_Static_assert(STICKY <= UINT8_MAX, "kept and replay count list entries in a byte");
_Static_assert(sizeof(frame_buffer) == 64, "a buffer's shared state is one line");

struct sp_frame_arena {
    /* One line, written only by advance: everything a chunk claim reads of the arena that ever
     * changes (the rest it reads is read-only after create). */
    sp_frame_hot_ hot;     /* first: read by the inline paths */
    uint32_t current;      /* buffer of the open frame */
    uint32_t cur_reserved; /* its reserved */
    uint64_t frame;
    size_t chunk_size;
    char *cur_base; /* its base */
    uint32_t buffers;
    /* Read-only after create. */
    _Alignas(64) size_t capacity; /* bytes per buffer, page-aligned */
    uint64_t id;                  /* unique across arenas: tags the threads' record indices */
    sp_frame_overflow overflow;
    void *(*heap_alloc)(void *user, size_t align, size_t size);
    void (*heap_free)(void *user, void *p);
    void *heap_user;
    char *region;
    size_t committed; /* bytes of region committed at create (decommitted/released at destroy) */
    bool own;         /* we reserved the region */
    bool kept;        /* the runtime's (frame_arena_keep): destroy refuses */
    uint64_t *marks;  /* chunks bits: scratch of the close */
    /* Per buffer, written only by advance (status reads them): a line every advance touches. */
    _Alignas(64) uint64_t buf_frame[SP_FRAME_MAX_BUFFERS]; /* the frame last (or now) using it */
    size_t buf_peak[SP_FRAME_MAX_BUFFERS];
    /* Written when a thread takes a record index (its first claim in the arena). */
    _Alignas(64) uint32_t records_used; /* atomic: indices taken, at most RECORDS */
    uint64_t record_owner[RECORDS];     /* atomic: the thread token holding each index */
    frame_buffer buf[SP_FRAME_MAX_BUFFERS];
    claim_slot claims[RECORDS]; /* by thread record index */
};
_Static_assert(offsetof(struct sp_frame_arena, hot) == 0, "the inline paths read hot at a");
_Static_assert(offsetof(struct sp_frame_arena, buffers) + sizeof(uint32_t) <= 64,
               "what a claim reads of the arena's changing fields fits one line");

_Thread_local sp_frame_chunk sp_frame_tls[SP_FRAME_SLOTS]
    __attribute__((tls_model("initial-exec")));

/* The calling thread's claim-record index in the arena of each slot (RECORDS: none left), and
 * the token that marks its indices in every arena (0: none yet). */
static _Thread_local struct {
    uint64_t arena; /* sp_frame_arena.id */
    uint32_t index;
} record_tls[SP_FRAME_SLOTS];
static _Thread_local uint64_t thread_token;

static uint64_t ids_last;    /* atomic: arena ids and thread tokens handed out (0 is never one) */
static uint64_t gens_last;   /* atomic: start of the last block of generations handed out */
static uint32_t arenas_made; /* atomic: slot of the next arena */

static uint64_t id_take(void) {
    return __atomic_add_fetch(&ids_last, 1, __ATOMIC_RELAXED);
}

/* A frame's generation is unique across arenas (a thread's chunk slot serves every arena of
 * that slot in turn). An arena takes them from blocks of GEN_BLOCK of its own (aligned; the
 * first block starts at GEN_BLOCK, so 0 is never one): one atomic add per GEN_BLOCK frames,
 * not per advance, which then holds no locked instruction that would wait for its stores. */
#define GEN_BLOCK SP_FRAME_GEN_BLOCK_
static uint64_t gen_next(uint64_t gen) {
    gen++;
    return gen % GEN_BLOCK ? gen : __atomic_add_fetch(&gens_last, GEN_BLOCK, __ATOMIC_RELAXED);
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

/* The calling thread's record index in a: the one it holds (a thread switching between
 * arenas of one slot finds its own again: O(RECORDS)), else a new one, else RECORDS. */
static uint32_t record_index(sp_frame_arena *a) {
    if (!thread_token) thread_token = id_take();
    /* Relaxed: a thread looks only for its own token, which only it stores. */
    uint32_t n = __atomic_load_n(&a->records_used, __ATOMIC_RELAXED);
    for (uint32_t i = 0; i < n; i++)
        if (__atomic_load_n(&a->record_owner[i], __ATOMIC_RELAXED) == thread_token) return i;
    while (n < RECORDS)
        if (__atomic_compare_exchange_n(&a->records_used, &n, n + 1, true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
            __atomic_store_n(&a->record_owner[n], thread_token, __ATOMIC_RELAXED);
            return n;
        }
    return RECORDS;
}

/* The calling thread's claim-record index in a, its record set to this frame in the open
 * buffer (its entries of the buffer's previous frame left to replay); RECORDS if the arena has
 * no record left for it. */
static uint32_t record_get(sp_frame_arena *a) {
    if (record_tls[a->hot.slot].arena != a->id) {
        record_tls[a->hot.slot].arena = a->id;
        record_tls[a->hot.slot].index = record_index(a);
    }
    uint32_t i = record_tls[a->hot.slot].index, b = a->current;
    if (i == RECORDS) return RECORDS;
    claim_record *r = &a->claims[i].record;
    uint64_t f = __atomic_load_n(&r->frame[b], __ATOMIC_RELAXED);
    if (f != a->frame) {
        r->replay[b] = f + a->buffers == a->frame ? r->kept[b] : 0;
        __atomic_store_n(&r->claimed[b], 0, __ATOMIC_RELAXED);
        __atomic_store_n(&r->kept[b], 0, __ATOMIC_RELAXED);
        __atomic_store_n(&r->frame[b], a->frame, __ATOMIC_RELEASE); /* after the resets: status */
    }
    return i;
}

/* The first byte of b. */
static char *buffer_base(const sp_frame_arena *a, const frame_buffer *b) {
    return a->region + (size_t)(b - a->buf) * a->capacity;
}

/* Chunks below which claims may lie, for the bump word w of b. */
static size_t chunk_floor(const frame_buffer *b, uint64_t w) {
    size_t lo = word_lo(w);
    return b->reserved + (lo > b->hole_count ? lo - b->hole_count : 0);
}

/* A fresh chunk: one atomic add (the next hole, else the next chunk from reserved up). A load
 * first refuses when there is no room, which keeps lo bounded. */
static bool chunk_fresh(sp_frame_arena *a, frame_buffer *b, size_t *out) {
    uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
    if (word_lo(w) >= b->hole_count && (chunk_floor(b, w) + 1) * a->chunk_size > word_hi(w))
        return false;
    w = __atomic_fetch_add(&b->word, 1, __ATOMIC_RELAXED);
    size_t lo = word_lo(w);
    if (lo < b->hole_count) {
        *out = b->holes[lo];
        return true;
    }
    *out = chunk_floor(b, w);
    return (*out + 1) * a->chunk_size <= word_hi(w); /* else another thread took the rest */
}

/* Give the calling thread's chunk slot a chunk of b: the one it had at the same place in its
 * claim order in b's previous frame (see above), else a fresh one. False: b has no room. */
static bool chunk_take(sp_frame_arena *a, frame_buffer *b, sp_frame_chunk *c) {
    uint32_t k = record_get(a), bi = a->current;
    claim_record *r = k < RECORDS ? &a->claims[k].record : NULL;
    size_t i = SIZE_MAX;
    if (r && r->kept[bi] < r->replay[bi]) i = a->claims[k].list.index[bi][r->kept[bi]];
    if (i >= a->cur_reserved && !chunk_fresh(a, b, &i)) return false;
    if (r) {
        uint8_t kept = r->kept[bi];
        __atomic_store_n(&r->claimed[bi], r->claimed[bi] + 1, __ATOMIC_RELAXED);
        if (kept < STICKY) {
            uint32_t *e = &a->claims[k].list.index[bi][kept];
            if (*e != i) __atomic_store_n(e, (uint32_t)i, __ATOMIC_RELAXED);
            __atomic_store_n(&r->kept[bi], (uint8_t)(kept + 1), __ATOMIC_RELAXED);
        }
    } else {
        __atomic_fetch_add(&b->unrecorded, 1, __ATOMIC_RELAXED);
    }
    c->gen = a->hot.gen;
    c->cur = a->cur_base + i * a->chunk_size;
    c->end = c->cur + a->chunk_size;
    return true;
}

/* Bump size bytes aligned to align (<= small_max, a power of two >= 16) from c, or NULL. The
 * block starts inside the chunk, also for size 0 (the end of the buffer's last chunk is the
 * next buffer's start). */
static void *chunk_bump(sp_frame_chunk *c, size_t align, size_t size) {
    uintptr_t p = sp_align_up((uintptr_t)c->cur, align);
    uintptr_t e = sp_align_up(p + size, 16);
    if (p >= (uintptr_t)c->end || e > (uintptr_t)c->end) return NULL;
    c->cur = (char *)e;
    return (void *)p;
}

/* A range of its own in b for a request (large, or too large for a fresh chunk), taken from
 * the top down, never below the chunk floor: a CAS loop on hi, exact (no chunk tail is lost).
 * NULL: it does not fit. */
static void *direct_take(sp_frame_arena *a, frame_buffer *b, size_t align, size_t size) {
    if (size > a->capacity) return NULL; /* alloc_any sent alignments above it to overflow */
    size_t n = sp_align_up(size ? size : 1, 16); /* size 0 too gets a block inside the buffer */
    char *base = buffer_base(a, b);
    uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
    for (;;) {
        size_t lo = word_lo(w), hi = word_hi(w);
        if (n > hi) return NULL;
        uintptr_t p = sp_align_down((uintptr_t)base + hi - n, align);
        if (p < (uintptr_t)base + chunk_floor(b, w) * a->chunk_size) return NULL;
        uint64_t nw = (uint64_t)lo | (uint64_t)(p - (uintptr_t)base) << LO_BITS;
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
    if (SP_UNLIKELY((uintptr_t)block & (align - 1))) { /* its header and the block would be too */
        a->heap_free(a->heap_user, block);
        sp_misuse(SP_ERR_BAD_ALIGNMENT, call, block,
                  "heap_alloc returned %p for alignment %zu: freed, returning NULL", (void *)block,
                  align);
        return NULL;
    }
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
    if (SP_NULL_ARG(a, call, NULL, "arena")) return NULL;
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
SP_NOINLINE void *sp_frame_alloc_generic(sp_frame_arena *a, size_t align, size_t size,
                                         const char *call) {
    return alloc_any(a, align, size, call);
}

/* ---- frames ------------------------------------------------------------------------------ */

/* Chunks claimed in buffer i's frame (the open one, or its last until its reclaim): the records
 * of that frame and the unrecorded count. O(records used). With marks (the buffer closes), the
 * chunks the records kept are also marked there, and *top is one past the highest. */
static size_t claims_count(const sp_frame_arena *a, uint32_t i, uint64_t *marks, size_t *top) {
    const frame_buffer *b = &a->buf[i];
    size_t n = __atomic_load_n(&b->unrecorded, __ATOMIC_RELAXED);
    uint32_t used = __atomic_load_n(&a->records_used, __ATOMIC_RELAXED);
    for (uint32_t k = 0; k < used && k < RECORDS; k++) {
        const claim_record *r = &a->claims[k].record;
        if (__atomic_load_n(&r->frame[i], __ATOMIC_ACQUIRE) != a->buf_frame[i]) continue;
        n += __atomic_load_n(&r->claimed[i], __ATOMIC_RELAXED);
        uint32_t kept = marks ? __atomic_load_n(&r->kept[i], __ATOMIC_RELAXED) : 0;
        for (uint32_t j = 0; j < kept; j++) {
            size_t c = __atomic_load_n(&a->claims[k].list.index[i][j], __ATOMIC_RELAXED);
            marks[c / 64] |= UINT64_C(1) << (c % 64);
            if (c + 1 > *top) *top = c + 1;
        }
    }
    return n;
}

/* The open buffer b closes, its kept chunks marked below top (claims_count): what its next
 * round reserves (top) and its holes (the chunks below top that no record kept). More than
 * MAX_HOLES holes, or a kept chunk in the upper half of the buffer: it reserves nothing. O(top / 64
 * + holes); the marks are cleared again. */
static void reserve_next(sp_frame_arena *a, frame_buffer *b, size_t top) {
    size_t holes = 0;
    for (size_t w = 0; w * 64 < top; w++) {
        size_t n = top - w * 64 < 64 ? top - w * 64 : 64;
        uint64_t unkept = ~a->marks[w] & (n == 64 ? ~UINT64_C(0) : (UINT64_C(1) << n) - 1);
        a->marks[w] = 0;
        if (holes + (size_t)__builtin_popcountll(unkept) > MAX_HOLES)
            holes = MAX_HOLES + 1;
        else
            for (; unkept; unkept &= unkept - 1)
                b->holes[holes++] = (uint32_t)(w * 64 + (size_t)__builtin_ctzll(unkept));
    }
    /* A kept chunk whose thread does not come back is lost for the round, and direct ranges
     * stay above the highest kept one: chunks are kept only while that one lies in the lower
     * half of the buffer, so that fresh claims and direct ranges always have the upper half
     * (one thread that kept every chunk of a small buffer and ran no job the next time round
     * left that round nothing). */
    bool reserve = holes <= MAX_HOLES && top <= a->capacity / a->chunk_size / 2;
    b->reserved = reserve ? (uint32_t)top : 0;
    b->hole_count = reserve ? (uint32_t)holes : 0;
}

static void heap_list_free(sp_frame_arena *a, frame_buffer *b) {
    /* No allocation runs meanwhile (the frames' jobs are done): a load first, so that an
     * advance without heap blocks holds no locked instruction (see gen_next). */
    if (!__atomic_load_n(&b->heap, __ATOMIC_ACQUIRE)) return;
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
static void range_poison(const sp_frame_arena *a, const frame_buffer *b, size_t from, size_t to) {
    if (from >= to) return;
#if TRACK_ASAN || TRACK_VALGRIND
    track_pool(buffer_base(a, b) + from, to - from);
#else
    memset(buffer_base(a, b) + from, POISON_BYTE, to - from);
#endif
}
#endif

/* Everything b held goes: heap blocks freed (O(their count)), what the frame used poisoned in
 * debug and tool builds (the chunks below its floor and the direct part from hi up: O(used)), the
 * bump state and the counts reset. */
static void buffer_reclaim(sp_frame_arena *a, frame_buffer *b) {
    heap_list_free(a, b);
#if TRACK_ASAN || TRACK_VALGRIND || SP_DEBUG >= 1
    uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
    size_t hi = word_hi(w), lo_bytes = (size_t)b->floor * a->chunk_size;
    range_poison(a, b, 0, lo_bytes < hi ? lo_bytes : hi);
    range_poison(a, b, hi, a->capacity);
#endif
    __atomic_store_n(&b->word, (uint64_t)a->capacity << LO_BITS, __ATOMIC_RELAXED);
    __atomic_store_n(&b->unrecorded, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&b->overflows, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&b->overflow_bytes, 0, __ATOMIC_RELAXED);
}

/* Status of buffer i, which has `chunks` chunks claimed. */
static void status_fill(const sp_frame_arena *a, uint32_t i, size_t chunks,
                        sp_frame_buffer_status *out) {
    const frame_buffer *b = &a->buf[i];
    /* In use: the claimed chunks and everything from hi up (the direct ranges). */
    size_t used = chunks * a->chunk_size +
                  (a->capacity - word_hi(__atomic_load_n(&b->word, __ATOMIC_RELAXED)));
    *out = (sp_frame_buffer_status){
        .frame = a->buf_frame[i],
        .bytes_used = used,
        .peak = used > a->buf_peak[i] ? used : a->buf_peak[i],
        .chunks = chunks,
        .overflows = __atomic_load_n(&b->overflows, __ATOMIC_RELAXED),
        .overflow_bytes = __atomic_load_n(&b->overflow_bytes, __ATOMIC_RELAXED),
        .capacity = a->capacity,
    };
}

uint64_t sp_frame_arena_advance(sp_frame_arena *a, sp_frame_buffer_status *closed) {
    if (SP_UNLIKELY(!a)) {
        if (closed)
            *closed = (sp_frame_buffer_status){0}; /* before the report, which may not return */
        sp_null_arg("sp_frame_arena_advance", NULL, "arena");
        return 0;
    }
    uint32_t i = a->current;
    frame_buffer *b = &a->buf[i];
    uint64_t w = __atomic_load_n(&b->word, __ATOMIC_RELAXED);
    b->floor = (uint32_t)chunk_floor(b, w); /* from the reservation this frame had */
    /* A frame without a fresh claim (lo 0) had every claim get back a chunk kept for its
     * thread, in the order of its thread's last frame in the buffer: each thread kept a prefix
     * of what it kept then, and claimed at most as many chunks. So the reservation in force
     * still covers every chunk the next round may ask back (it keeps more only when a thread
     * claimed less or not at all: those chunks stay lost, to chunks and direct ranges alike,
     * until a close reads the records), and the frame's chunks are at most `counted`: with its
     * direct part, at most the peak, which then stands. Such a close keeps the reservation
     * unless the caller asks for the status, a request of the frame overflowed (lost chunks may
     * be what it lacked), the peak may have risen, or the reservation and the direct part take
     * more than a quarter of the buffer (lost chunks, at most the reservation, would then crowd
     * what is left; with half, small full buffers refused a fifth to a third more requests than
     * a close that always reads: bench/README.md). In a steady frame loop with room to spare,
     * it reads no line another thread wrote in the frame (each record would cost a cache-line
     * transfer from its thread and back; bench/README.md, "The close without the records"). */
    size_t direct = a->capacity - word_hi(w), cs = a->chunk_size;
    if (closed || word_lo(w) != 0 || __atomic_load_n(&b->overflows, __ATOMIC_RELAXED) != 0 ||
        (size_t)b->counted * cs + direct > a->buf_peak[i] ||
        ((size_t)b->reserved * cs + direct) * 4 > a->capacity) {
        size_t top = 0, chunks = claims_count(a, i, a->marks, &top);
        sp_frame_buffer_status st;
        status_fill(a, i, chunks, &st);
        a->buf_peak[i] = st.peak;
        b->counted = (uint32_t)chunks;
        if (closed) *closed = st;
        reserve_next(a, b, top);
    }
    a->frame++;
    a->current = (uint32_t)(a->frame % a->buffers);
    b = &a->buf[a->current];
    buffer_reclaim(a, b);
    a->buf_frame[a->current] = a->frame;
    a->cur_reserved = b->reserved;
    a->cur_base = buffer_base(a, b);
    a->hot.gen = gen_next(a->hot.gen); /* every thread's chunk of the old frame is stale now */
    return a->frame;
}

uint64_t sp_frame_arena_frame(const sp_frame_arena *a) {
    return SP_NULL_ARG(a, "sp_frame_arena_frame", NULL, "arena") ? 0 : a->frame;
}

int sp_frame_arena_buffer_of(const sp_frame_arena *a, const void *p) {
    if (SP_NULL_ARG(a, "sp_frame_arena_buffer_of", NULL, "arena")) return -1;
    uintptr_t off = (uintptr_t)p - (uintptr_t)a->region;
    if (off >= (uintptr_t)a->capacity * a->buffers) return -1;
    return (int)(off / a->capacity);
}

void sp_frame_buffer_status_get(const sp_frame_arena *a, uint32_t buffer,
                                sp_frame_buffer_status *out) {
    if (SP_NULL_ARG(out, "sp_frame_buffer_status_get", a, "out")) return;
    *out = (sp_frame_buffer_status){0}; /* what misuse below answers, zeroed before its report */
    if (SP_NULL_ARG(a, "sp_frame_buffer_status_get", NULL, "arena")) return;
    if (SP_UNLIKELY(buffer >= a->buffers)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_frame_buffer_status_get", a,
                  "buffer %u of an arena of %u buffers", buffer, a->buffers);
        return;
    }
    status_fill(a, buffer, claims_count(a, buffer, NULL, NULL), out);
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
    size_t chunks = capacity / chunk;
    sp_frame_arena *a = aligned_alloc(_Alignof(sp_frame_arena), sizeof *a); /* claim_slot: 128 */
    /* The close's marks, then every buffer's holes. */
    size_t mark_words = (chunks + 63) / 64;
    uint64_t *extra = calloc(mark_words + ((size_t)n * MAX_HOLES + 1) / 2, sizeof(uint64_t));
    if (!a || !extra) {
        free(a);
        free(extra);
        return create_fail(err, SP_ERR_NOMEM);
    }
    memset(a, 0, sizeof *a);
    a->marks = extra;
    a->own = d.region == NULL;
    a->committed = a->own ? capacity * n : sp_align_down(size, page);
    a->region = a->own ? sp_vm_reserve(a->committed, 0, false, NULL) : d.region;
    if (!a->region) {
        free(a);
        free(extra);
        return create_fail(err, SP_ERR_OS);
    }
    sp_result r = sp_vm_commit(a->region, a->committed);
    if (r != SP_OK) {
        if (a->own) sp_vm_release(a->region, a->committed);
        free(a);
        free(extra);
        return create_fail(err, r);
    }
    a->id = id_take();
    a->hot.gen = gen_next(GEN_BLOCK - 1); /* a block of its own */
    a->hot.slot = __atomic_fetch_add(&arenas_made, 1, __ATOMIC_RELAXED) % SP_FRAME_SLOTS;
    a->hot.small_max = chunk / 4;
    a->buffers = n;
    a->capacity = capacity;
    a->chunk_size = chunk;
    a->overflow = d.overflow;
    a->heap_alloc = d.heap_alloc ? d.heap_alloc : libc_alloc;
    a->heap_free = d.heap_free ? d.heap_free : libc_free;
    a->heap_user = d.heap_user;
    for (uint32_t i = 0; i < n; i++) {
        a->buf[i].holes = (uint32_t *)(void *)(extra + mark_words) + (size_t)i * MAX_HOLES;
        a->buf[i].word = (uint64_t)capacity << LO_BITS;
    }
    a->cur_base = a->region;
    if (err) *err = SP_OK;
    return a;
}

void frame_arena_keep(sp_frame_arena *a, bool keep) {
    a->kept = keep;
}

void sp_frame_arena_destroy(sp_frame_arena *a) {
    if (!a) return;
    if (a->kept) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_frame_arena_destroy", a,
                  "the runtime's frame arena (sp_frames): sp_shutdown destroys it");
        return;
    }
    for (uint32_t i = 0; i < a->buffers; i++) {
        frame_buffer *b = &a->buf[i];
        heap_list_free(a, b);
        track_release(buffer_base(a, b), a->capacity); /* tool builds: plain memory again */
    }
    if (a->own)
        sp_vm_release(a->region, a->committed);
    else
        sp_vm_decommit(a->region, a->committed);
    free(a->marks);
    free(a);
}
