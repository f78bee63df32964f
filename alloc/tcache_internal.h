/* Internals of the thread caches shared by alloc/tcache*.c and white-box tests (not installed).
 *
 * A span (SP_TCACHE_SPAN bytes, aligned to its size) holds this header at its colour offset
 * (sp_tcache_span_of_: 0..15 x 256 bytes); its blocks follow from the first one (span_first:
 * past the header; the bytes before the header stay unused). Every span is, at
 * any time, exactly one of: the current span of its class in its owner's cache (the count
 * of its owner word `head` carries SPAN_CURRENT), on its owner's ring of that class, on its
 * owner's empty list (count 0), on the global orphan list of its class (owner NULL, live
 * blocks), on the global spare list of its class (owner NULL, count 0), or free in the
 * central span heap (magic and owner cleared). Only the owner (or, for orphans, the orphan lock
 * holder) touches `head`, `carved` and the list links; any thread pushes onto `inbox`.
 */
#ifndef SP_TCACHE_INTERNAL_H
#define SP_TCACHE_INTERNAL_H

#include <stdatomic.h>

#include "sp_internal.h"
#include "sp_platform.h"
#include "sp_tcache.h"

enum {
    SPAN_HEADER = 256, /* bytes of a span header, and the step between its colour offsets */
    SPAN_TAIL = 16,    /* the last 16 bytes hold the next TLSF block's header */
};

/* Added to the count of the owner word while a span is its class's current span, so that a
 * free emptying the current span (which stays current: nothing to do) does not reach zero;
 * only spans off duty take the inline free's rare branch to tcache_span_emptied. */
#define SPAN_CURRENT_COUNT 0x8000u
#define SPAN_CURRENT ((uintptr_t)SPAN_CURRENT_COUNT << SP_TCACHE_LIST_BITS)
_Static_assert(SP_TCACHE_SPAN / 16 < SPAN_CURRENT_COUNT, "a span's blocks count below the bias");

typedef struct span {
    sp_tcache_span pub; /* what the inline paths read */
    uintptr_t magic;    /* (uintptr_t)span ^ key ^ SPAN_MAGIC while the span is in use */
    uint64_t owner_tid; /* OS thread of the owner, 0 when orphaned (read for messages) */
    uint32_t cls, block_size;
    uint32_t capacity; /* blocks the span holds */
    uint32_t pad_;
    struct span *next, *prev; /* ring (circular), orphan list (both ways), empty or spare
                                 list (next; prev not kept) */
    /* Remote frees, on a cache line of their own: a list word (sp_tcache.h) of the blocks and
     * their number, so one CAS pushes and one exchange takes list and count together (no walk
     * to count; a span holds fewer than 2^16 blocks). */
    _Alignas(64) _Atomic uintptr_t inbox;
} span;

_Static_assert(sizeof(span) <= SPAN_HEADER, "span header must fit in front of the blocks");
_Static_assert(offsetof(sp_tcache_span, owner) == 16, "owner clear of TLSF's free-list links");
_Static_assert(SPAN_HEADER == 1 << SP_TCACHE_COLOUR_SHIFT, "colour offsets are headers apart");

/* Blocks of s handed out and not back with its owner (used without the current-span bias);
 * any thread, relaxed. */
SP_INLINE uint32_t span_used(const span *s) {
    return sp_tcache_count_(__atomic_load_n(&s->pub.head, __ATOMIC_RELAXED)) & ~SPAN_CURRENT_COUNT;
}

/* The owner's free list of s, and setting it (the count kept). Owner (or orphan-lock holder). */
SP_INLINE sp_tcache_block *span_free(const span *s) {
    return sp_tcache_list_(s->pub.head);
}
SP_INLINE void span_free_set(span *s, sp_tcache_block *list) {
    uintptr_t h = sp_tcache_count_bits_(s->pub.head) | (uintptr_t)list;
    __atomic_store_n(&s->pub.head, h, __ATOMIC_RELAXED);
}

/* The pointer check's constants (sp_tcache_block_start_), which frees on any thread read:
 * span_check_init sets the multiplier for blocks of bs bytes while no block of the span is
 * out (formatting), span_check_carved the limit whenever carving cuts more (owner, or orphan
 * lock holder; an atomic store, as other threads' frees read it). */
SP_INLINE void span_check_init(sp_tcache_span *s, uint32_t bs) {
    s->div_magic = UINT64_MAX / bs + 2;
    s->carved = 0;
    __atomic_store_n(&s->start_limit, 0, __ATOMIC_RELAXED);
}
SP_INLINE void span_check_carved(sp_tcache_span *s, uint32_t bs, uint32_t carved) {
    s->carved = carved;
    __atomic_store_n(&s->start_limit, carved * (bs * s->div_magic), __ATOMIC_RELAXED);
}

/* The start of the span holding p, its header, its first block and the bytes from there to the
 * span's tail. */
SP_INLINE char *span_base(const void *p) {
    return (char *)sp_align_down((uintptr_t)p, SP_TCACHE_SPAN);
}
SP_INLINE span *span_of(const void *p) {
    return (span *)sp_tcache_span_of_((uintptr_t)p);
}
SP_INLINE char *span_first(const span *s) {
    return span_base(s) + (s->pub.first32 & (SP_TCACHE_SPAN - 1));
}
SP_INLINE size_t span_area(const span *s) {
    return (size_t)(span_base(s) + SP_TCACHE_SPAN - SPAN_TAIL - span_first(s));
}

typedef struct cache {
    sp_tcache pub;                        /* cur[]: read by the inline alloc path */
    span *ring[SP_TCACHE_CLASSES];        /* other spans of each class, circular, NULL if none */
    uint32_t ring_len[SP_TCACHE_CLASSES]; /* spans on each ring */
    uint32_t tidy_class;                  /* where sp_tcache_tidy's walk of the rings resumes */
    uint32_t tidy_left;                   /* spans of that ring still to walk (0: all of it) */
    span *empty;                          /* empty spans kept for reuse */
    uint32_t empty_count;
    sp_mutex lock;       /* list structure (cur, ring, empty) against status readers */
    uint64_t tid;        /* OS thread id of the thread that attached it */
    size_t remote_frees; /* written by the owner with relaxed atomic stores */
    size_t remote_collected;
    struct cache *reg_next, *reg_prev;
    bool registered;
} cache;

/* Bind cache c (from tcache_create) to the calling thread instead of its own; returns the
 * previous binding. For single-threaded tests of two caches (the fuzz target): an owner
 * check compares caches, not threads. Not for production: the thread-exit hook still
 * detaches only caches created by sp_tcache_thread_attach. */
SP_HIDDEN sp_tcache *tcache_bind(sp_tcache *c);
/* A new registered cache not bound to any thread; NULL with *why (if not NULL) SP_ERR_NOMEM
 * when out of memory, SP_ERR_SHUTDOWN while attaches are closed. */
SP_HIDDEN sp_tcache *tcache_create(sp_result *why);
/* Close (or open again) the registry to new caches, atomically with counting those it holds:
 * returns that count. Once closed, tcache_create and sp_tcache_thread_attach refuse (the
 * runtime's sp_shutdown: no cache may appear between its check and the heap going away).
 * sp_tcache_init opens it. */
SP_HIDDEN size_t tcache_attach_close(bool closed);
/* Detach c as sp_tcache_thread_detach does (c must not be bound to any running thread). */
SP_HIDDEN void tcache_destroy(sp_tcache *c);

#endif
