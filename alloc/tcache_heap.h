/* The thread caches' global state and their two central heaps (internal to alloc/tcache*.c).
 *
 * One reservation, split in halves: the span heap (only SP_TCACHE_SPAN-aligned spans) and the
 * large heap (requests above the largest class); a cache record takes a span of its own. Each half
 * is an sp_tlsf heap committed from its start in growing chunks (one TLSF pool each), so "is p
 * ours" is one subtraction and compare against the committed length. A heap's TLSF is unlocked and
 * guarded by the heap's own mutex, which fork handlers can take (a TLSF-internal lock they could
 * not).
 */
#ifndef SP_TCACHE_HEAP_H
#define SP_TCACHE_HEAP_H

#include <threads.h>

#include "sp_tlsf.h"
#include "tcache_internal.h"

typedef struct heap {
    sp_mutex lock; /* every TLSF call and growth */
    sp_tlsf *t;
    uintptr_t base;
    _Atomic size_t committed; /* grows only; readers need no lock */
    size_t limit;             /* bytes of the half */
    size_t next_chunk;
    const char *name;
} heap;

typedef struct tcache_state {
    _Atomic bool ready;
    sp_mutex init_lock;
    void *region;
    size_t region_size;
    bool own_region;
    heap spans, large;
    uint32_t max_class, class_count, keep_empty, keep_detached;
    bool explicit_attach, tidy_orphans;
    /* direct[] entries of class k: [direct_first[k], direct_end[k]) (end 0: none) */
    uint8_t direct_first[SP_TCACHE_CLASSES], direct_end[SP_TCACHE_CLASSES];

    sp_mutex reg_lock; /* registry, cache_count, retired_*, attach_closed */
    /* The registry's links and retired_allocated are written under both locks (reg_lock
     * first): sp_tcache_allocated walks the registry under count_lock alone, so the frame end
     * never waits for a status walk, which holds reg_lock for O(spans). */
    sp_mutex count_lock;
    cache *registry;
    size_t cache_count;
    bool attach_closed; /* new caches refused (tcache_attach_close: the runtime shuts down) */
    size_t retired_remote_frees, retired_collected, retired_allocated;
    _Atomic size_t large_allocated; /* bytes asked for by large blocks (sp_tcache_allocated) */
    _Atomic size_t unattached_remote_frees, orphan_collected;

    sp_mutex orphan_lock;             /* orphans and spares */
    span *orphans[SP_TCACHE_CLASSES]; /* spans of detached caches with live blocks (linked
                                         both ways: tcache_orphan_unlink) */
    _Atomic size_t orphan_count[SP_TCACHE_CLASSES];
    /* Empty spans of detached caches, still cut into blocks of their class (at most
     * keep_detached a class): taken before carving by a cache short of that class, and by
     * any cache, reformatted, before the span heap is asked for a new span. */
    span *spares[SP_TCACHE_CLASSES];
    _Atomic size_t spare_count[SP_TCACHE_CLASSES];
    _Atomic size_t spare_total;
    /* Remote frees that found their span orphaned (counted after the push, sequentially
     * consistent with span_detach's check); sp_tcache_tidy walks the orphans when this moved
     * past orphan_frees_seen (written under the orphan lock). */
    _Atomic size_t orphan_frees, orphan_frees_seen;
    /* sp_tcache_tidy's walk of the orphans (orphan lock), a bounded part a call: a pass visits
     * every orphan there was when it began (pass_frees: orphan_frees then, seen once the pass
     * ends); walk_at is the next orphan of class walk_class to visit, NULL when that class is
     * done (tcache_orphan_unlink moves it past an orphan taken meanwhile). */
    bool orphan_pass;
    uint32_t orphan_walk_class;
    span *orphan_walk_at;
    size_t orphan_pass_frees;

    sp_mutex fallback_lock; /* the fallback cache of exited threads */
    cache fallback;

    tss_t tss;
    bool tss_ok;
} tcache_state;

SP_HIDDEN extern tcache_state tc;
SP_HIDDEN extern span tcache_sentinel;

/* Ring spans one sp_tcache_tidy looks at, at most, and orphans: a tidy runs every frame, and
 * a walk of every ring (or orphan list) was a cache and TLB miss per span (spans lie 256 KiB
 * apart): its cost grew with the live heap. Longer lists are walked over several tidies; the
 * budget bounds what a frame pays for that (16 keeps it to a few microseconds when every span
 * misses; a larger one returns emptied spans sooner, for proportionally more). */
enum { TCACHE_TIDY_SPANS = 16 };

SP_HIDDEN uint32_t tcache_class_size(uint32_t k);
SP_HIDDEN uint32_t tcache_class_of(size_t n);
SP_HIDDEN bool tcache_init_default(void);
static inline bool tcache_ready(void) {
    return atomic_load_explicit(&tc.ready, memory_order_acquire) || tcache_init_default();
}

/* heap.c-like helpers (tcache_heap.c). */
SP_HIDDEN void heap_open(heap *h, const char *name, char *base, size_t limit);
SP_HIDDEN void heap_close(heap *h);
SP_HIDDEN void *heap_alloc(heap *h, size_t align, size_t size); /* grows the heap as needed */
/* A bad p is reported under `call` once the heap's lock is released, and nothing changes:
 * free frees nothing, usable returns 0, realloc NULL (as when there is no room). */
SP_HIDDEN void heap_free(heap *h, void *p, const char *call);
SP_HIDDEN size_t heap_usable(heap *h, const void *p, const char *call);
/* realloc: p grown or shrunk in place, or moved (TLSF's realloc); NULL when there is no room */
SP_HIDDEN void *heap_realloc(heap *h, void *p, size_t size, const char *call);
SP_HIDDEN void heap_status(heap *h, sp_tlsf_status *out);
SP_HIDDEN void heap_lock_all(bool lock);

SP_HIDDEN void tcache_cache_init(cache *c, uint64_t tid);
SP_HIDDEN void tcache_set_cur(cache *c, uint32_t k, span *s);
SP_HIDDEN void tcache_ring_remove(cache *c, span *s); /* c->lock held */
/* A spare of class k, NULL if none; orphan lock held. */
SP_HIDDEN span *tcache_spare_pop(uint32_t k);
SP_HIDDEN void tcache_orphan_unlink(span *s); /* off its orphan list; orphan lock held */
SP_HIDDEN void tcache_cache_drain(cache *c);
SP_HIDDEN size_t tcache_empty_release(cache *c);
SP_HIDDEN size_t tcache_span_emptied(cache *c, span *s); /* bytes returned: 0 if kept */
SP_HIDDEN uint32_t span_collect(span *s, cache *c);
SP_HIDDEN void span_release(span *s);
SP_HIDDEN bool tcache_block_check(span *s, const void *p, const char *call);
/* The orphans' upkeep without tidy calls (tidy_orphans): when frees reached orphans since the
 * last walk, the walk goes on for `steps` times TCACHE_TIDY_SPANS of them (1 in the alloc slow
 * path, 4 at a thread's detach) while its pass lasts, if the orphan lock is free (a try, never
 * a wait). Any lock but the orphan and heap locks may be held. */
SP_HIDDEN void tcache_orphans_tidy(uint32_t steps);

#endif
