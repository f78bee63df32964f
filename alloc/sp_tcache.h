/* spindle thread caches: per-thread size-class slabs over the central TLSF heaps.
 *
 * Requests up to a configurable maximum (default 32 KiB) are served from size classes (16 B
 * steps up to 128 B, then 8 classes per doubling: internal waste at most 12.5% above 128 B).
 * Each thread owns a cache; a cache holds, per class, spans of SP_TCACHE_SPAN bytes carved
 * from a central TLSF heap, aligned to their size so that any block finds its span header from
 * its address alone (masked, plus the span's colour offset: sp_tcache_span_of_). A span is cut
 * into equal blocks with an intrusive free list.
 *   alloc on the owner:  thread-local cache pointer, class lookup, pop, and an add to the
 *                        cache's count of bytes allocated. No atomic read-modify-writes, no
 *                        locks.
 *   free on the owner:   range check, span header, checks, push. No atomics, no locks.
 *   free on any other thread: a lock-free push onto the span's inbox (a Treiber stack that is
 *                        only ever emptied whole, so it has no ABA problem); the owner takes
 *                        the whole inbox at once on its slow path.
 * Larger requests go to a second central TLSF heap directly. Both heaps live in one address
 * reservation (committed as it grows), which is how a pointer is told to be foreign in O(1).
 *
 * Order: sp_tcache_init (optional: the first call of any function below initialises with
 * defaults), then threads attach (explicitly, or implicitly on their first allocation) and
 * detach (explicitly, or at thread exit), then sp_tcache_shutdown when no other thread is
 * attached. A detaching cache hands its spans with live blocks to the orphan list of their
 * class (other caches adopt them; their blocks may still be freed from anywhere) and its
 * empty spans, still cut into blocks, to the spare list of their class while that list holds
 * fewer than keep_detached (one cap per class for the process; the rest go back to the
 * central heap): a cache short of that class takes a spare before it cuts new blocks, and any
 * cache takes one, cut anew, before it asks the heap for a span, so a thread that takes over
 * an exited one's work reuses pages that are resident already. sp_tcache_trim returns the
 * caller's and the shared fallback cache's empty spans, the empty orphans and the spares. A
 * thread that frees before it ever allocated attaches too (its remote frees are counted in its
 * cache); after its exit hook ran, a thread's calls go through the fallback cache under a lock,
 * and so do an unattached thread's when the desc asks for explicit_attach.
 * sp_tcache_tls is an initial-exec thread-local: a shared library holding it must be loaded
 * with the program (or preloaded), not dlopen'ed into a running process.
 *
 * Concurrency:
 *   sp_tcache_init / _shutdown                  not concurrently with anything else
 *   alloc, calloc, realloc, aligned_alloc,      any thread, concurrently with everything; a
 *   free, free_sized, usable_size, trim, tidy,  block may be freed (or realloc'd) by any
 *   thread_attach / _detach, status_local       thread, once
 *   free_local                                  only by the thread whose cache allocated it
 *   status                                      any thread; exact only while no other thread
 *                                               allocates or frees (figures are read, not
 *                                               locked, from caches that are running)
 *   heap_status                                 any thread; exact (under the heap locks)
 *   allocated                                   any thread; the running caches' counts as
 *                                               their threads last stored them (relaxed),
 *                                               under a lock that attach and detach take
 *                                               briefly (not the one status holds)
 *
 * Fibers: the calling thread's cache is read afresh on every call through SP_TLS_FRESH (an
 * asm volatile read of the thread pointer with a memory clobber), never from an address a
 * compiler kept across a call: a job that resumes on another worker uses that worker's cache.
 *
 * Bad input (every build, O(1)): free/realloc/usable_size of a pointer outside the heaps
 * (SP_ERR_FOREIGN_POINTER), of an interior, misaligned or never-allocated pointer
 * (SP_ERR_INVALID_POINTER), of a block already free (SP_ERR_DOUBLE_FREE) are reported through
 * the logger with the call, the address and the owning thread when known, and change nothing.
 * Large blocks are checked by the TLSF heap (sp_tlsf_check_ptr) and reported under the call
 * made, with no lock held (a fatal handler may longjmp out of the report).
 * Double frees are recognised by a tag (address ^ a per-process random key) written into the
 * second word of a freed small block; a live block whose second word a user set to exactly
 * that value would be refused as a double free.
 *
 * Where SP_INLINE_FAST_PATHS is 0 (sp_platform.h: AddressSanitizer, Valgrind tracking, or no
 * SP_TLS_FRESH for the CPU) the inline fast paths below are replaced by calls, so that block
 * state goes through alloc/track.h.
 */
#ifndef SP_TCACHE_H
#define SP_TCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_log.h"
#include "sp_platform.h"
#include "sp_tlsf.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SP_TCACHE_SPAN_SHIFT 18
#define SP_TCACHE_SPAN ((size_t)1 << SP_TCACHE_SPAN_SHIFT) /* span size and alignment: 256 KiB */
#define SP_TCACHE_COLOUR_SHIFT 8 /* span headers sit at one of 16 offsets, 256 bytes apart */
#define SP_TCACHE_COLOURS 16
#define SP_TCACHE_MAX_CLASS_LIMIT ((size_t)64 * 1024)
#define SP_TCACHE_MIN_REGION ((size_t)64 << 20) /* the least region sp_tcache_init takes */
#define SP_TCACHE_MAX_ALIGN ((size_t)1 << 30)   /* the largest alignment aligned_alloc serves */
#define SP_TCACHE_CLASSES 80      /* 16..128 by 16 (8), then 8 per doubling up to 64 KiB (72) */
#define SP_TCACHE_LOOKUP_MAX 1024 /* sizes up to this use the inline class table */

typedef struct sp_tcache_desc {
    void *region;           /* address space reserved by the caller (sp_vm_reserve, PROT_NONE,
                               aligned to SP_TCACHE_SPAN; its end below 2^48), committed as the
                               heaps grow; NULL: reserve our own */
    size_t region_size;     /* bytes of region (0: 64 GiB when we reserve, halved down to 1 GiB
                               to half the room an RLIMIT_AS limit leaves, and further while
                               the OS refuses; at least 64 MiB; with a region of the
                               caller's, no more than it reserved: the heaps commit into it
                               unchecked) */
    size_t max_class;       /* largest size served by classes (0: 32 KiB; at most 64 KiB;
                               rounded up to a class size) */
    uint32_t keep_empty;    /* empty spans a cache keeps for reuse (0: 2) */
    uint32_t keep_detached; /* spares per class: empty spans of detached caches kept, still
                               cut into blocks, for other caches (0: 8); a detaching cache's
                               empty spans beyond that go back to the central heap */
    bool tidy_orphans;      /* for programs that never call sp_tcache_tidy: the alloc slow
                               path (at most 16 orphans) and each thread's detach (at most 64)
                               go on with the walk over the orphans, only when blocks were
                               freed into orphans since the last walk and only if no other
                               thread holds the orphan lock, and return those remote frees
                               emptied; without it they wait for a tidy or a trim, or for a
                               cache to adopt them. Set when the caches initialise lazily (a
                               first call without sp_tcache_init, as in the malloc drop-in;
                               sp_tcache_init(NULL) takes the desc's default, false) */
    bool explicit_attach;   /* threads get a cache of their own only from
                               sp_tcache_thread_attach; the others share the fallback cache
                               under its lock, each told once in its life (SP_LOG_WARN,
                               SP_ERR_INVALID_ARG, naming it); the runtime sets it, so that no
                               cache it does not know of outlives sp_shutdown */
} sp_tcache_desc;

typedef struct sp_tcache_status {
    /* Same figures as sp_tlsf_status, over everything the thread caches hand out. A block
     * freed by another thread counts as live (in bytes_used, live_blocks, class_live) until
     * its owner takes it back from the inbox (remote_pending counts those). */
    size_t bytes_used;     /* granted bytes of live blocks (class sizes; TLSF usable sizes) */
    size_t bytes_free;     /* free bytes in spans of caches, orphans and spares, plus the
                              heaps' */
    size_t bytes_overhead; /* span headers and tails, TLSF overhead */
    size_t largest_free;   /* largest request that surely succeeds without growing */
    size_t live_blocks;
    size_t free_blocks;   /* free small blocks in spans of caches, orphans and spares */
    size_t high_water;    /* peak bytes the caches and large blocks took from the heaps */
    double fragmentation; /* as sp_tlsf_status, of the large heap */
    /* Thread caches. */
    size_t caches;           /* attached caches (status_local: 1 if attached) */
    size_t spans;            /* spans held by caches (in use or kept empty) */
    size_t spans_empty;      /* of which empty, kept for reuse */
    size_t spans_orphaned;   /* spans of detached caches: orphans and spares (not in spans) */
    size_t large_blocks;     /* live blocks from the large heap */
    size_t remote_frees;     /* blocks pushed to another cache's inbox (cumulative) */
    size_t remote_collected; /* blocks taken back from inboxes (cumulative) */
    size_t remote_pending;   /* pushed, not yet taken back */
    uint32_t class_count;    /* classes in use (max_class decides) */
    uint32_t class_size[SP_TCACHE_CLASSES];
    size_t class_live[SP_TCACHE_CLASSES]; /* live blocks per class */
    sp_tlsf_status span_heap, large_heap; /* the two central heaps (status: only) */
} sp_tcache_status;

/* ---- lifecycle -------------------------------------------------------------------------- */

/* Initialise with desc (NULL or zeroes: defaults). Reserves the region unless given, commits
 * the first chunk of both heaps. Returns SP_OK, SP_ERR_INVALID_ARG (misuse: already
 * initialised, region too small, not aligned to SP_TCACHE_SPAN or ending above 2^48,
 * max_class too large), SP_ERR_OS or SP_ERR_NOMEM. */
sp_result sp_tcache_init(const sp_tcache_desc *desc);

/* Detach the calling thread, return everything to the OS (release our reservation; a given
 * region is decommitted), forget all state. Returns the number of blocks still live (0: no
 * leak); their memory is gone. Misuse: another thread still attached (its next call would
 * use a cache that is gone): reported (SP_ERR_INVALID_ARG), nothing torn down (the caller is
 * detached and trimmed), SIZE_MAX returned. */
size_t sp_tcache_shutdown(void);

/* Give the calling thread a cache now (it gets one on its first allocation otherwise, unless
 * the desc asked for explicit_attach).
 * Cost: a span of the span heap for the cache record (a page or two of it touched), the heap
 * lock and the registry lock. SP_OK, SP_ERR_NOMEM, or SP_ERR_SHUTDOWN (logged) while the
 * runtime's sp_shutdown drains its scheduler (from its check for such caches on: none may
 * appear after it); not concurrently with the rest of sp_shutdown, which ends the caches. */
sp_result sp_tcache_thread_attach(void);

/* Hand the calling thread's cache back: inboxes collected, spans with live blocks orphaned
 * for adoption, empty spans kept as spares while their class has fewer than keep_detached,
 * the rest returned.
 * Runs by itself at thread exit. No-op if not attached. The thread may allocate again
 * afterwards (it attaches again; under explicit_attach it uses the fallback cache). Cost:
 * O(spans held). */
void sp_tcache_thread_detach(void);

/* Return the calling thread's empty spans (its inboxes collected first), the shared fallback
 * cache's, empty orphaned spans (theirs collected) and the spares; other attached caches keep
 * theirs. Returns the bytes returned to the central heap. Any thread; takes the fallback,
 * orphan and heap locks. Cost: O(spans). */
size_t sp_tcache_trim(void);

/* Give back what the calling thread's cache no longer needs without giving up what it reuses:
 * the every-frame call (sp_frame_end and workers going idle make it). The cache takes its
 * inboxes back, and a span they leave empty goes the way of one its owner emptied (kept while
 * the cache keeps fewer than keep_empty, else returned); current spans (even empty), kept empty
 * spans, spares and the shared fallback cache stay (sp_tcache_trim returns those). If blocks
 * were freed into orphaned spans since the orphans were last walked (by any thread's tidy or
 * trim, or with tidy_orphans its slow path or detach), the orphans are walked and those left
 * empty returned too. Returns the bytes returned to the central heap. Any thread. Cost:
 * bounded whatever the heap holds - the inbox of each class's current span, and of at most 16
 * of the other spans, going on where the last call stopped (a cache holding more is walked
 * over several calls: a span remote frees emptied may wait that many calls to be returned);
 * the cache's lock per span emptied, the heap lock per span returned; only when orphans were
 * freed into, the orphan lock and at most 16 orphans a call (a pass over all of them takes as
 * many calls as it needs, and an orphan emptied behind it waits for the next pass). */
size_t sp_tcache_tidy(void);

/* ---- allocation: inline fast paths below, their out-of-line rest in tcache.c ------------- */

/* void *sp_tcache_alloc(size_t size)              16-aligned; size 0 gives a unique block
 * void  sp_tcache_free(void *p)                   NULL is a no-op; any thread
 * void  sp_tcache_free_local(void *p)             p a small block (<= max_class) allocated
 *                                                 by this thread's cache: skips the range
 *                                                 check; the owner, interior and double-free
 *                                                 checks stay (reported under its own name).
 *                                                 A pointer outside the thread caches' heaps
 *                                                 is undefined (its span header is read: it
 *                                                 may fault), except where the header is
 *                                                 compiled with SP_DEBUG >= 1: there the
 *                                                 range check stays and it is refused as for
 *                                                 sp_tcache_free. A block of
 *                                                 another thread's cache is not refused: it
 *                                                 is freed as sp_tcache_free would (remote)
 * Cost: alloc is a table lookup, a pop and an add (sp_tcache_allocated's count); free is the
 * pointer checks and a push (bench `tcache local`: bench/README.md has the ratios to the peers);
 * the slow path (with tidy_orphans, first a try at the orphans' walk: sp_tcache_desc) takes the
 * span's inbox, then (only while the class has at most 8 other spans) another span's free blocks if
 * they are half a page's worth, then a spare of the class; then, in order, the span's unused tail,
 * another span, a kept empty span, an orphan, a spare of another class or a new span from the
 * central heap (one lock); a span without free blocks cuts new ones, those that start in the
 * 4 KiB page holding its next uncut block.
 * alloc returns NULL when the heaps cannot grow. */

/* Zeroed array of n * size bytes; NULL on overflow or out of memory. */
void *sp_tcache_calloc(size_t n, size_t size);

/* Resize: in place while the class fits (or the TLSF block can), else alloc-copy-free.
 * realloc(NULL, n) = alloc(n); realloc(p, 0) frees p and returns NULL. On failure NULL and
 * p untouched; misuse as for free (reported under "sp_tcache_realloc"). */
void *sp_tcache_realloc(void *p, size_t size);

/* size bytes aligned to align (a power of two; up to 1 GiB). Up to 4 KiB served by classes
 * whose blocks are aligned; more by the large heap. Not a power of two (0 included) or above
 * 1 GiB: SP_ERR_BAD_ALIGNMENT misuse, NULL. */
void *sp_tcache_aligned_alloc(size_t align, size_t size);

/* Usable bytes of a live block (>= what was asked for); 0 for NULL or bad pointers. */
size_t sp_tcache_usable_size(const void *p);

/* Free a block of known size (what was asked for, or up to its usable size). A size larger
 * than the block is misuse (SP_ERR_INVALID_ARG; nothing freed). A size smaller than what was
 * asked for is not detected (the request is not stored): the block is freed, as C23's
 * free_sized leaves it undefined. */
void sp_tcache_free_sized(void *p, size_t size);

/* The OS thread id (sp_thread_os_id) of the cache that owns p's span, 0 for large blocks,
 * orphaned spans and pointers that are not live small blocks. For tests and diagnostics. */
uint64_t sp_tcache_owner_thread(const void *p);

/* Figures of the calling thread's cache (TLSF members zero). Cost: O(spans held). A NULL out
 * (here and in sp_tcache_status_get) is misuse: SP_ERR_INVALID_ARG, reported. */
void sp_tcache_status_local(sp_tcache_status *out);

/* Figures of every cache, the orphans and both central heaps. Cost: O(spans); takes the
 * registry lock, each cache's list lock, the orphan lock, the heap locks in turn. */
void sp_tcache_status_get(sp_tcache_status *out);

/* The two central heaps' figures alone (span_heap and large_heap of sp_tcache_status_get),
 * walking no cache: O(1), each heap's lock in turn. Any thread. What the caches and large blocks
 * hold from the central heap is spans->bytes_used + large->bytes_used (free blocks in the spans
 * included). Either pointer may be NULL. All zero before init. */
void sp_tcache_heap_status(sp_tlsf_status *spans, sp_tlsf_status *large);

/* Bytes asked for by the allocations the thread caches and the large heap served since
 * sp_tcache_init, over all threads, detached ones included: alloc, calloc and aligned_alloc
 * count their size, realloc its new size when it moved the block or grew it past its usable
 * size (not when the block already held that many bytes). A flow, not a level: frees take
 * nothing off (sp_frame_stats takes its per-frame difference). Any thread; each running
 * cache's count as its thread last stored it (exact for threads whose allocations
 * happen-before the call, as a frame's jobs do before sp_frame_end's wait returns). Cost:
 * O(attached caches), under a lock of its own that attach and detach take for a few stores
 * (never waiting for a status walk). 0 before init. */
size_t sp_tcache_allocated(void);

/* For the malloc drop-in (fork safety): take every global lock and every cache's own / release
 * them in the parent /
 * re-initialise them in the child. The child keeps only the forking thread's cache; spans of
 * the other threads stay owned by caches that no longer run. */
void sp_tcache_fork_prepare(void);
void sp_tcache_fork_parent(void);
void sp_tcache_fork_child(void);

/* ---- layout the inline paths read (not API: may change with any release) ---------------- */

typedef struct sp_tcache_block {
    struct sp_tcache_block *next;
    uintptr_t tag; /* address ^ key while free; 0 when handed out */
} sp_tcache_block;

/* The first part of every span header. The span starts at an SP_TCACHE_SPAN boundary; its
 * header at sp_tcache_span_of_ (its colour offset), its blocks after the header. The
 * first cache line is read by every free (any thread) and written only when the span changes
 * hands or carves; the second is the owner's, written by every alloc and owner free: a remote
 * free never pulls the owner's hot line away from it. */
typedef struct sp_tcache_span {
    uint32_t first32; /* low 32 bits of the first block's address: (uint32_t)p - first32
                         is p's offset from it (the span is aligned to 256 KiB) */
    uint32_t carved;  /* blocks cut from the span so far (the rest not handed out yet) */
    uint32_t pad_[2];
    struct sp_tcache *owner; /* read by any thread (atomically); written by the owner. At
                                offset 16: clear of the links TLSF writes into a freed span */
    uint64_t div_magic;      /* UINT64_MAX / block size + 2 */
    uint64_t start_limit;    /* carved * (block size * div_magic mod 2^64); read atomically */
    /* The owner's word: its free list (a list word, below) and, as the count, `used`: blocks
     * handed out and not yet back with the owner, plus 2^15 while the span is current (a free
     * that brings the count to 0 hands the span to the slow path). One word, so that an alloc
     * and a free each store it once. Written by the owner only; read atomically by status. */
    _Alignas(64) uintptr_t head;
} sp_tcache_span;

typedef struct sp_tcache {
    /* Bytes asked for by the allocations this cache served (sp_tcache_allocated): one add on
     * the inline path. Written by its thread alone (the shared fallback's: under its lock),
     * relaxed atomic stores; read by any thread. */
    size_t allocated;
    /* cur[class_of[(size + 15) / 16]] for sizes up to SP_TCACHE_LOOKUP_MAX: the inline alloc
     * goes from size to span without the class table. */
    sp_tcache_span *direct[SP_TCACHE_LOOKUP_MAX / 16 + 1];
    sp_tcache_span *cur[SP_TCACHE_CLASSES]; /* current span per class (a sentinel if none) */
} sp_tcache;

typedef struct sp_tcache_globals {
    uintptr_t span_base;  /* the span heap's region */
    uintptr_t span_bytes; /* committed bytes of it (grows; read atomically) */
    uintptr_t key;        /* random: tags of free blocks */
    uint8_t class_of[SP_TCACHE_LOOKUP_MAX / 16 + 1]; /* (size + 15) / 16 -> class */
} sp_tcache_globals;

extern sp_tcache_globals sp_tcache_g;
extern _Thread_local sp_tcache *sp_tcache_tls __attribute__((tls_model("initial-exec")));

void *sp_tcache_alloc_generic(size_t size);
void sp_tcache_free_generic(void *p);
void sp_tcache_free_local_generic(void *p); /* as sp_tcache_free_generic, reporting under
                                               sp_tcache_free_local */
void sp_tcache_span_emptied(sp_tcache_span *s);

#define SP_TCACHE_INLINE SP_INLINE_FAST_PATHS

/* A list word: a block list in the low SP_TCACHE_LIST_BITS bits (user addresses stay below
 * 2^48, checked at init), a count above them. The span's owner word and its remote inbox. */
#define SP_TCACHE_LIST_BITS 48
#define SP_TCACHE_COUNT_ONE ((uintptr_t)1 << SP_TCACHE_LIST_BITS)

static inline __attribute__((always_inline)) sp_tcache_block *sp_tcache_list_(uintptr_t w) {
    return (sp_tcache_block *)(w & (SP_TCACHE_COUNT_ONE - 1));
}
static inline __attribute__((always_inline)) uint32_t sp_tcache_count_(uintptr_t w) {
    return (uint32_t)(w >> SP_TCACHE_LIST_BITS);
}
/* The count part of w in place (its list bits zero): a new word is this, plus or minus
 * SP_TCACHE_COUNT_ONEs, plus a list. */
static inline __attribute__((always_inline)) uintptr_t sp_tcache_count_bits_(uintptr_t w) {
    return w & ~(SP_TCACHE_COUNT_ONE - 1);
}

/* The owner's pop of b, the head of s's free list (h = s->head): the list moves on, the
 * count goes up, the block is marked handed out. */
static inline __attribute__((always_inline)) void sp_tcache_pop_(sp_tcache_span *s, uintptr_t h,
                                                                 sp_tcache_block *b) {
    __atomic_store_n(&s->head, h - (uintptr_t)b + (uintptr_t)b->next + SP_TCACHE_COUNT_ONE,
                     __ATOMIC_RELAXED);
    b->tag = 0;
}

/* The owner's push of the checked block b (tag: its free mark). True when the count reached
 * 0: the span, not current, is empty. */
static inline __attribute__((always_inline)) bool
sp_tcache_push_(sp_tcache_span *s, sp_tcache_block *b, uintptr_t tag) {
    uintptr_t h = s->head;
    b->next = sp_tcache_list_(h);
    b->tag = tag;
    h = sp_tcache_count_bits_(h) - SP_TCACHE_COUNT_ONE + (uintptr_t)b;
    __atomic_store_n(&s->head, h, __ATOMIC_RELAXED);
    return h < SP_TCACHE_COUNT_ONE;
}

/* Count size bytes allocated from c (its thread, or the fallback's lock holder). */
static inline __attribute__((always_inline)) void sp_tcache_add_allocated_(sp_tcache *c,
                                                                           size_t size) {
    __atomic_store_n(&c->allocated, c->allocated + size, __ATOMIC_RELAXED);
}

/* The header of the span holding address a. Spans are aligned to their size, so every span
 * header at the span's start would share one set of the L1 and L2 caches (sets are chosen by
 * the low address bits), and a thread's spans of 16 classes would evict each other's headers
 * on every free; the header sits instead at one of SP_TCACHE_COLOURS offsets, picked by the
 * span's address bits just above its size: spans next to each other differ. */
static inline __attribute__((always_inline)) sp_tcache_span *sp_tcache_span_of_(uintptr_t a) {
    uintptr_t colour = (a >> (SP_TCACHE_SPAN_SHIFT - SP_TCACHE_COLOUR_SHIFT)) &
                       ((uintptr_t)(SP_TCACHE_COLOURS - 1) << SP_TCACHE_COLOUR_SHIFT);
    return (sp_tcache_span *)((a & ~(uintptr_t)(SP_TCACHE_SPAN - 1)) + colour);
}

/* Whether address a in span s is the start of a carved block (not below the first block,
 * between two, or past the carved ones): one multiply and one compare, every free's pointer
 * check (inline and out of line). With d the block size (16 B .. 64 KiB), c = div_magic =
 * floor((2^64 - 1) / d) + 2 and e = d * c mod 2^64, which lies in [d, 2d): write the offset
 * (below 2^32 after the 32-bit subtraction) as q * d + r. Then off * c = q * e + r * c
 * (mod 2^64): for r = 0 that is q * e < 2^33; for 0 < r < d it lies in [c, 2^64) without
 * wrapping (r * c <= 2^64 + e - c, and c >= 2^48). So off * c is below start_limit =
 * carved * e (< 2^19 < c) exactly when r = 0 and q < carved: Lemire, Kaser and Kurz's
 * divisibility test ("Faster remainder by direct computation", 2019) with the index bound
 * folded into its compare. */
static inline __attribute__((always_inline)) bool sp_tcache_block_start_(const sp_tcache_span *s,
                                                                         uintptr_t a) {
    uint32_t off = (uint32_t)a - s->first32;
    return (uint64_t)off * s->div_magic < __atomic_load_n(&s->start_limit, __ATOMIC_RELAXED);
}

#if SP_TCACHE_INLINE
/* The calling thread's cache, read afresh (see Fibers above). x86-64: the load itself is in
 * the asm volatile (the initial-exec sequence: GOT offset, then a %fs-relative load; the
 * linker turns the first into an immediate in executables), one instruction less than
 * SP_TLS_FRESH's address plus a load, with the same guarantees (memory clobber). */
static inline __attribute__((always_inline)) sp_tcache *sp_tcache_self(void) {
#if defined(__x86_64__)
    sp_tcache *c;
    __asm__ volatile("movq sp_tcache_tls@gottpoff(%%rip), %0\n\tmovq %%fs:(%0), %0"
                     : "=r"(c)
                     :
                     : "memory");
    return c;
#else
    return *(sp_tcache **)SP_TLS_FRESH(sp_tcache_tls);
#endif
}

static inline __attribute__((always_inline)) void *sp_tcache_alloc(size_t size) {
    sp_tcache *c = sp_tcache_self();
    if (__builtin_expect(size <= SP_TCACHE_LOOKUP_MAX, 1)) {
        sp_tcache_span *s = c->direct[(size + 15) >> 4];
        uintptr_t h = s->head;
        sp_tcache_block *b = sp_tcache_list_(h);
        if (__builtin_expect(b != NULL, 1)) {
            sp_tcache_pop_(s, h, b);
            sp_tcache_add_allocated_(c, size);
            return b;
        }
    }
    return sp_tcache_alloc_generic(size);
}

/* slow: where what the inline checks refuse goes (and is reported under its caller's name). */
static inline __attribute__((always_inline)) void sp_tcache_free_in_span_(sp_tcache *c, void *p,
                                                                          void (*slow)(void *)) {
    uintptr_t a = (uintptr_t)p;
    sp_tcache_span *s = sp_tcache_span_of_(a);
    sp_tcache_block *b = (sp_tcache_block *)p;
    uintptr_t tag = a ^ sp_tcache_g.key;
    if (__builtin_expect(__atomic_load_n(&s->owner, __ATOMIC_RELAXED) == c &&
                             sp_tcache_block_start_(s, a) && b->tag != tag,
                         1)) {
        if (__builtin_expect(sp_tcache_push_(s, b, tag), 0)) sp_tcache_span_emptied(s);
        return;
    }
    slow(p);
}

static inline __attribute__((always_inline)) void sp_tcache_free(void *p) {
    uintptr_t a = (uintptr_t)p;
    if (__builtin_expect(a - sp_tcache_g.span_base <
                             __atomic_load_n(&sp_tcache_g.span_bytes, __ATOMIC_RELAXED),
                         1)) {
        sp_tcache_free_in_span_(sp_tcache_self(), p, sp_tcache_free_generic);
        return;
    }
    sp_tcache_free_generic(p);
}

static inline __attribute__((always_inline)) void sp_tcache_free_local(void *p) {
#if defined(SP_DEBUG) && SP_DEBUG >= 1
    uintptr_t a = (uintptr_t)p; /* debug: the range check stays (a foreign pointer is refused) */
    if (__builtin_expect(a - sp_tcache_g.span_base <
                             __atomic_load_n(&sp_tcache_g.span_bytes, __ATOMIC_RELAXED),
                         1)) {
#else
    if (__builtin_expect(p != NULL, 1)) {
#endif
        sp_tcache_free_in_span_(sp_tcache_self(), p, sp_tcache_free_local_generic);
        return;
    }
    sp_tcache_free_local_generic(p);
}
#else
static inline void *sp_tcache_alloc(size_t size) {
    return sp_tcache_alloc_generic(size);
}
static inline void sp_tcache_free(void *p) {
    sp_tcache_free_generic(p);
}
static inline void sp_tcache_free_local(void *p) {
    sp_tcache_free_local_generic(p);
}
#endif

#ifdef __cplusplus
}
#endif
#endif
