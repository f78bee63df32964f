/* spindle frame arenas: N-buffered per-frame bump allocation for data that lives a few frames.
 *
 * An arena owns one address range split into `buffers` equal buffers (2 by default, up to 4).
 * Frame i allocates from buffer i mod N; whatever frame i allocated stays valid through frame
 * i+N-1 and is reclaimed, all at once and in O(1), when sp_frame_arena_advance starts frame i+N
 * and that buffer comes round again. There is no per-block free.
 *
 * Allocation: each thread bump-allocates from a private chunk (chunk_size bytes, 256 KiB by
 * default) of the current buffer. Chunks are handed out from the bottom of the buffer: a thread
 * first gets back the chunks it had the last time the buffer came round (its first 8 claims of
 * that frame), in the same order, with no atomic operation and nothing shared written (each
 * thread lists its claims on a record of its own, from which a close keeps those chunks for
 * it), so in a steady frame loop each thread writes memory its own core wrote last
 * (why: bench/README.md, "Sticky chunks"); otherwise it takes a fresh chunk, one atomic add: a
 * chunk that nobody asked to keep, or the next one up. A kept chunk whose thread does not come
 * back for it is lost for that frame (and for the buffer's later frames while their closes keep
 * the reservation: see sp_frame_arena_advance); chunks are kept only in the lower half of a buffer
 * (when a thread kept one above, the buffer's next round keeps none and every claim is fresh). An
 * arena has records for 64 threads (a thread keeps its record for the arena's life, also when it
 * alternates with another arena of its slot); threads beyond claim fresh chunks only, each counted
 * by an atomic add. A request of any size that fits the rest of the thread's chunk comes from it;
 * one that does not and is above chunk_size / 4 (or aligned above it), and the last bytes of a full
 * buffer, take their own range from the top down (a compare-exchange loop). The calling thread's
 * chunk is found on every call through a fresh thread-pointer read (SP_TLS_FRESH, as the thread
 * caches do), never from an address kept across a call: a job that waits and resumes on another
 * worker allocates from that worker's chunk. A chunk is valid only while its generation matches the
 * arena's; every advance gives the arena a new generation, from blocks of SP_FRAME_GEN_BLOCK_ that
 * each arena takes from one process-wide counter (at create and when a block is used up), so a
 * thread's chunk of an older frame or of another (or a destroyed) arena is never used, and no
 * per-thread registry exists. Each thread keeps one chunk per arena slot (SP_FRAME_SLOTS; an
 * arena's slot is its creation number mod SP_FRAME_SLOTS): a thread alternating between two arenas
 * of one slot takes a new chunk at each switch (the old chunk's rest is lost until reclaim).
 *
 * Running out (a buffer has no room for a chunk or a request): with SP_FRAME_OVERFLOW_NULL
 * the call returns NULL; with SP_FRAME_OVERFLOW_HEAP the request goes to heap_alloc (default:
 * the C library), the block is kept on the buffer's list and freed at its reclaim (or at
 * destroy). Either way the request is counted in the buffer's `overflows`, and the first
 * overflow of each frame is logged at SP_LOG_WARN (SP_ERR_NOMEM, naming the call:
 * "sp_frame_alloc" or "sp_frame_aligned_alloc").
 *
 * Memory: the buffers are committed at create (sp_vm_commit: pages are faulted in as they are
 * first touched and stay resident afterwards: a buffer's resident size is its peak). A region
 * of explicit huge pages given by the caller comes committed; it must be a whole number of huge
 * pages. Destroy releases a reservation the arena made itself and decommits a given region.
 *
 * Debug: debug builds (SP_DEBUG >= 1) fill the used part of a buffer with 0xFD when it is
 * reclaimed; ASan builds, and Valgrind builds (-Dvalgrind=true), instead poison it through
 * track.h and make each allocation addressable one by one (their alloc calls are out of line),
 * so a pointer kept past its frame i+N-1 is reported at its first use (until its bytes are
 * handed out again: a thread gets its chunks of N frames ago back, so a stale write after the
 * new frame's first allocations there may land unreported in a new block). Reclaim then costs
 * O(bytes used); release builds (SP_DEBUG 0, no tool) reclaim in O(1) (plus one free per
 * heap-fallback block).
 *
 * Order: sp_frame_arena_create; any number of frames (allocations, then one advance); destroy.
 * Arenas are independent of each other and of the other spindle modules (no init needed).
 * A NULL arena is misuse (SP_ERR_INVALID_ARG, reported; alloc returns NULL, advance and frame
 * 0, buffer_of -1; destroy ignores it). Release builds' allocation fast paths do not check:
 * they read the arena first, and a NULL one is undefined there, as a destroyed one is
 * everywhere (where this header is compiled with SP_DEBUG >= 1, and in ASan and Valgrind
 * builds, they check).
 *
 * Concurrency:
 *   sp_frame_alloc, sp_frame_aligned_alloc      any number of threads and fibers at once
 *   sp_frame_arena_buffer_of, sp_frame_arena_frame  any thread (frame: not during advance)
 *   sp_frame_buffer_status_get                   the advancing thread between frames (exact);
 *                                                any thread while no advance runs (relaxed:
 *                                                figures of running allocations may lag)
 *   sp_frame_arena_advance, sp_frame_arena_destroy  one thread at a time, with no allocation
 *                                                from this arena in flight (the frame loop
 *                                                calls advance after the frame's jobs ended)
 *   sp_frame_arena_create                        any thread
 * None of these calls suspends the calling fiber.
 */
#ifndef SP_FRAME_H
#define SP_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_log.h"
#include "sp_platform.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SP_FRAME_MAX_BUFFERS 4
#define SP_FRAME_SLOTS 4                           /* chunks a thread keeps (one per slot) */
#define SP_FRAME_DEFAULT_BUFFER ((size_t)64 << 20) /* per buffer, when the arena reserves */
#define SP_FRAME_DEFAULT_CHUNK ((size_t)256 << 10)

typedef struct sp_frame_arena sp_frame_arena;

typedef enum sp_frame_overflow {
    SP_FRAME_OVERFLOW_NULL = 0, /* a request that does not fit returns NULL */
    SP_FRAME_OVERFLOW_HEAP = 1, /* ... is served by heap_alloc until the buffer's reclaim */
} sp_frame_overflow;

/* Zero means the default for every field. */
typedef struct sp_frame_desc {
    void *region;       /* reserved address range (sp_vm_reserve; PROT_NONE is fine, the arena
                           commits it), page-aligned; NULL: the arena reserves its own */
    size_t region_size; /* bytes of region, split into `buffers` equal page-aligned buffers
                           (0 with a NULL region: buffers * SP_FRAME_DEFAULT_BUFFER) */
    uint32_t buffers;   /* 0: 2; 1..SP_FRAME_MAX_BUFFERS */
    size_t chunk_size;  /* per-thread chunk (0: SP_FRAME_DEFAULT_CHUNK; rounded up to 16, at
                           least 1 KiB); requests above chunk_size / 4 that do not fit the
                           rest of the chunk go to the buffer directly */
    sp_frame_overflow overflow;
    /* Fallback for SP_FRAME_OVERFLOW_HEAP (both NULL: posix_memalign / free). align is a power
     * of two >= 16, size includes a header of max(16, align) bytes; the block returned must be
     * aligned to align (one that is not is freed again and the request refused: misuse
     * SP_ERR_BAD_ALIGNMENT, NULL). Called from the allocating thread, concurrently. */
    void *(*heap_alloc)(void *user, size_t align, size_t size);
    void (*heap_free)(void *user, void *p); /* from the thread calling advance or destroy */
    void *heap_user;
} sp_frame_desc;

typedef struct sp_frame_buffer_status {
    uint64_t frame;        /* frame number last (or currently) using this buffer */
    size_t bytes_used;     /* taken from the buffer this frame: chunks taken whole (their
                              unused tails included), plus the direct part (requests and
                              their alignment padding); heap-fallback blocks not included, nor
                              chunks skipped because their owner of N frames ago did not
                              come back for them. 0 after reclaim */
    size_t peak;           /* largest bytes_used over the buffer's frames so far */
    size_t chunks;         /* chunks taken this frame */
    size_t overflows;      /* requests this frame that did not fit (served by the heap or
                              refused) */
    size_t overflow_bytes; /* bytes requested by the overflows the heap fallback served */
    size_t capacity;       /* bytes of the buffer */
} sp_frame_buffer_status;

/* Create an arena (desc NULL: all defaults). Any thread. Cost: a small malloc'd record, a
 * reservation unless given, an mprotect of the buffers. Returns the arena, or NULL with *err
 * (if err is not NULL) set: SP_ERR_INVALID_ARG (misuse: more than 4 buffers, a region not
 * page-aligned or without a size, a chunk_size or buffer above 4 TiB, 2^19 chunks or more, an
 * unknown overflow mode, a heap_alloc without heap_free or the other way round), SP_ERR_TOO_SMALL
 * (misuse: a buffer smaller than one chunk), SP_ERR_NOMEM, SP_ERR_OS (reserve or commit). */
sp_frame_arena *sp_frame_arena_create(const sp_frame_desc *desc, sp_result *err);

/* Free every heap-fallback block, release the arena's own reservation or decommit the given
 * region (its address range stays the caller's), free the record. NULL is ignored; the
 * runtime's own arena, sp_frames(), is refused (misuse SP_ERR_INVALID_ARG: sp_shutdown
 * destroys it). See the concurrency table. Cost: O(heap-fallback blocks) + the munmap/mmap. */
void sp_frame_arena_destroy(sp_frame_arena *a);

/* void *sp_frame_alloc(sp_frame_arena *a, size_t size)
 *   size bytes aligned to 16 from the current frame's buffer. Size 0 gives a valid pointer to
 *   no bytes inside the buffer (it may equal the next allocation's). Any thread, any fiber.
 * void *sp_frame_aligned_alloc(sp_frame_arena *a, size_t align, size_t size)
 *   the same with any power-of-two alignment (the block's end is padded to 16).
 * Cost: inline, a thread-pointer read, two compares and a bump (bench `frame/alloc`:
 * bench/README.md has the figures, against tcache and mimalloc in the same run); the
 * out-of-line rest (sp_frame_alloc_generic) takes a chunk (a chunk kept for the thread: no
 * atomic; a fresh one: one atomic add) or a direct range (a CAS loop).
 * Returns NULL when the buffer is exhausted in SP_FRAME_OVERFLOW_NULL mode or the heap fallback
 * fails (both counted, see above; an alignment above the buffer's size cannot fit a buffer and
 * counts the same way); misuse (NULL + report, under the call made): align not a power of two
 * (SP_ERR_BAD_ALIGNMENT), size above PTRDIFF_MAX (SP_ERR_OVERFLOW), a NULL arena
 * (SP_ERR_INVALID_ARG) where the fast path checks it (see the top: not in release builds,
 * which read `a` before any check; a destroyed arena is undefined everywhere). */

/* Close the current frame, start the next one, reclaim its buffer. Closing reads the frame's
 * claim records (per thread that claimed in the arena, at most 64: a line with its chunk counts,
 * and for the closing buffer the list of chunks it keeps) and lists the chunks nobody kept below
 * the highest kept one, for fresh claims the next time round (O(threads + highest kept chunk / 64 +
 * those chunks)). A close with closed NULL skips that when no claim of the frame was fresh
 * (every thread that claimed got back chunks kept for it), no request of the frame overflowed,
 * the frame cannot have raised the buffer's peak, and the reservation and the frame's direct
 * part take at most a quarter of the buffer: the buffer keeps the reservation it had, which still
 * covers every chunk the next round may ask back, and the close reads no claim record (in a steady
 * frame loop with room to spare that does not ask for the status; the runtime's sp_frame_end
 * asks; bench/README.md, "The close without the records"). The chunks kept for a thread that did
 * not come back then stay lost, to chunks and direct ranges alike, until a close reads the
 * records: a request they hold out overflows, with every request of that frame that needed the
 * space, in one frame of the buffer, and that frame's close reads them.
 * Status and peak stay exact (sp_frame_buffer_status_get reads the records). The reclaim resets the
 * bump state and counts in O(1), frees the heap-fallback blocks of that buffer (O(their count)),
 * and in debug builds fills or poisons the used part (O(bytes used)). Fills *closed (if not NULL)
 * with the closing frame's buffer status. Returns the new frame number (frame 0 is the first). See
 * the concurrency table: no allocation from this arena may run during the call. */
uint64_t sp_frame_arena_advance(sp_frame_arena *a, sp_frame_buffer_status *closed);

/* The current frame number. O(1). */
uint64_t sp_frame_arena_frame(const sp_frame_arena *a);

/* The buffer holding p (0..buffers-1), -1 if p is outside the arena's buffers (heap-fallback
 * blocks included). O(1): a subtraction and a division. Any thread. */
int sp_frame_arena_buffer_of(const sp_frame_arena *a, const void *p);

/* Status of one buffer. A buffer index >= buffers is misuse (SP_ERR_INVALID_ARG; *out zeroed);
 * so are a NULL arena (*out zeroed) and a NULL out.
 * The chunks are counted on the claim records of the buffer's frame (a line per thread that
 * claimed in the arena, at most 64). See the concurrency table. */
void sp_frame_buffer_status_get(const sp_frame_arena *a, uint32_t buffer,
                                sp_frame_buffer_status *out);

/* ---- inline fast paths; their out-of-line rest in frame.c ------------------------------- */

/* Generations an arena takes at once (frame.c; a test crosses a block's end). */
#define SP_FRAME_GEN_BLOCK_ ((uint64_t)1 << 20)

/* A thread's chunk of one arena slot. gen 0 never matches an arena. */
typedef struct sp_frame_chunk {
    uint64_t gen;
    char *cur; /* next free byte, 16-aligned */
    char *end;
    char *pad_;
} sp_frame_chunk;

/* The first fields of every arena, read by the inline paths (frame.c checks the layout). */
typedef struct sp_frame_hot_ {
    uint64_t gen;  /* generation of the current frame (changes at every advance) */
    uint32_t slot; /* this arena's chunk slot */
    uint32_t pad_;
    size_t small_max; /* larger requests or alignments go to the buffer directly */
} sp_frame_hot_;

extern _Thread_local sp_frame_chunk sp_frame_tls[SP_FRAME_SLOTS]
    __attribute__((tls_model("initial-exec")));

/* Everything: validation, chunk refill, direct requests, overflow, tracking. */
void *sp_frame_alloc_generic(sp_frame_arena *a, size_t align, size_t size, const char *call);

#define SP_FRAME_INLINE SP_INLINE_FAST_PATHS

#if SP_FRAME_INLINE
/* Debug builds (SP_DEBUG >= 1, where this header is compiled) send a NULL arena out of line,
 * which reports it; release builds read through it (sp_frame.h, top). */
#if defined(SP_DEBUG) && SP_DEBUG >= 1
#define SP_FRAME_NULL_CHECK_(a) (__builtin_expect((a) == NULL, 0))
#else
#define SP_FRAME_NULL_CHECK_(a) 0
#endif

static inline __attribute__((always_inline)) void *sp_frame_alloc(sp_frame_arena *a, size_t size) {
    if (SP_FRAME_NULL_CHECK_(a)) return sp_frame_alloc_generic(a, 16, size, "sp_frame_alloc");
    const sp_frame_hot_ *h = (const sp_frame_hot_ *)(void *)a;
    sp_frame_chunk *c = (sp_frame_chunk *)SP_TLS_FRESH(sp_frame_tls) + h->slot;
    char *p = c->cur;
    /* cur and end are 16-aligned, so a size that fits the rest fits once rounded up to 16
     * (and a size near SIZE_MAX never passes: no overflow to guard against). A request of any
     * size below the chunk's rest is served from it; one that fills the rest exactly goes out
     * of line, and so does size 0 at a full chunk's end, which may be the buffer's end (the
     * next buffer's start): no pointer the inline path returns lies at the chunk's end. */
    if (__builtin_expect(c->gen == h->gen && size < (size_t)(c->end - p), 1)) {
        c->cur = p + ((size + 15) & ~(size_t)15);
        return p;
    }
    return sp_frame_alloc_generic(a, 16, size, "sp_frame_alloc");
}

static inline __attribute__((always_inline)) void *
sp_frame_aligned_alloc(sp_frame_arena *a, size_t align, size_t size) {
    if (SP_FRAME_NULL_CHECK_(a))
        return sp_frame_alloc_generic(a, align, size, "sp_frame_aligned_alloc");
    const sp_frame_hot_ *h = (const sp_frame_hot_ *)(void *)a;
    sp_frame_chunk *c = (sp_frame_chunk *)SP_TLS_FRESH(sp_frame_tls) + h->slot;
    uintptr_t p = ((uintptr_t)c->cur + align - 1) & ~(uintptr_t)(align - 1);
    uintptr_t e = (p + size + 15) & ~(uintptr_t)15;
    if (__builtin_expect(c->gen == h->gen && align - 1 < h->small_max &&
                             (align & (align - 1)) == 0 && size <= h->small_max &&
                             e < (uintptr_t)c->end, /* strictly: see sp_frame_alloc */
                         1)) {
        c->cur = (char *)e;
        return (void *)p;
    }
    return sp_frame_alloc_generic(a, align, size, "sp_frame_aligned_alloc");
}
#else
static inline void *sp_frame_alloc(sp_frame_arena *a, size_t size) {
    return sp_frame_alloc_generic(a, 16, size, "sp_frame_alloc");
}
static inline void *sp_frame_aligned_alloc(sp_frame_arena *a, size_t align, size_t size) {
    return sp_frame_alloc_generic(a, align, size, "sp_frame_aligned_alloc");
}
#endif

#ifdef __cplusplus
}
#endif
#endif
