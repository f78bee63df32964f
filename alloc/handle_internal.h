/* Internal layout of the handle heap, shared by handle.c (calls, table), handle_space.c (blocks
 * and holes) and handle_compact.c (moving). Never included from a public header. */
#ifndef SP_HANDLE_INTERNAL_H
#define SP_HANDLE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_handle.h"
#include "sp_internal.h"
#include "sp_platform.h"
#include "track.h"

/* Sizes are counted in units of 16 bytes (the granule; every block starts on one). */
#define HUNIT 16u
#define HUNIT_SHIFT 4
#define HMIN_UNITS 2u                   /* a free block needs a header and two links */
#define HCOMMIT_STEP ((size_t)16 << 10) /* commit granularity */
#define HCLASSES 256                    /* free-list classes, see class_of */
#define HMAX_ALIGN 4096u

/* Every block, live or free, starts with this header. Invariants: size covers the header;
 * a block's successor starts size units later (the top ends the sequence); prev is the
 * predecessor's size (0 for the first block); no two free blocks are neighbours; the block
 * ending at the top is never free (it would have become part of the top). */
typedef struct hblk {
    uint32_t size; /* units, header included */
    uint32_t prev; /* units of the block below, 0 at the bottom */
    uint32_t id;   /* owning handle id; 0 = free */
    uint32_t pins; /* live blocks only; under the heap lock (compaction holds it); never wraps:
                      sp_handle_pin refuses a pin at UINT32_MAX */
} hblk;

/* A free block's payload: its links in the list of its size class. */
typedef struct hfree {
    hblk head;
    struct hfree *next, *prev_free;
} hfree;

/* Per slot data that only the lock holder (or compaction) reads: beside the table, never read
 * without the lock, so it can grow by realloc. */
typedef struct hcold {
    size_t size; /* bytes asked for */
    sp_handle_relocate_fn fn;
    void *user;
    uint32_t last_id;      /* the id last freed from this slot (tells double from stale frees) */
    uint32_t next_free;    /* FIFO of free slots; UINT32_MAX ends it */
    uint32_t lnext, lprev; /* live blocks of one size class (HNONE ends) */
    uint8_t align_log2;
} hcold;

#define HNONE UINT32_MAX

struct sp_handle_heap {
    sp_handle_heap_head head; /* first: sp_handle_resolve reads it */
    sp_mutex lock;
    uint32_t index_bits;
    uint32_t index_full; /* (1 << index_bits) - 1 */
    uint32_t gen_max;
    uint32_t max_handles;
    uint32_t slots_used; /* slots ever handed out: [0, slots_used) */
    uint32_t free_head, free_tail;
    uint32_t retired_slots;
    hcold *cold;
    sp_handle_table *retired; /* kept until destroy when desc.retire is NULL */
    /* space */
    char *base, *top, *committed, *end;
    uint32_t top_prev; /* size of the block ending at top (0: none) */
    bool own_region;
    bool kept; /* the runtime's (handle_heap_keep): destroy refuses */
    size_t live_bytes, live_handles, hole_bytes;
    size_t need_bytes;        /* live blocks' header + size rounded to 16 */
    uint64_t allocated_total; /* sizes asked for by every allocation made */
    uint64_t bitmap[HCLASSES / 64];
    hfree *lists[HCLASSES];
    /* live blocks aligned to at most 16, by size class of their needed units (slot lists):
     * where compaction finds a block that fits a hole */
    uint64_t live_bitmap[HCLASSES / 64];
    uint32_t live_lists[HCLASSES];
    /* compaction */
    /* atomic: the compacting thread's handle_self address while a compaction call runs
     * (callbacks included), NULL otherwise. Compaction holds `lock` meanwhile: other threads'
     * alloc, free, pin, unpin, size and status wait; the compacting thread's own calls (from
     * callbacks) must not take it. */
    const char *compactor;
    char *scan;          /* the current pass continues here (a block start, or >= top) */
    char *low;           /* lowest hole left behind the scan this pass, or NULL */
    uint32_t wraps;      /* times this pass went back to `low` (it ends at the top), across calls */
    uint64_t wrap_moved; /* moved_total (with the running call's) when it last did so */
    bool caught_up;      /* the last pass ended and nothing changed since that could close a hole
                            (holes appeared, left ones may fit something): nothing to do */
    double bytes_per_tick; /* measured move bandwidth, for the budget estimate */
    double ns_per_tick;
    uint64_t moved_last, moved_total, compact_ns_last;
    sp_handle_heap_desc desc;
};

/* ---- blocks (handle_space.c) ---- */
TRACK_INTERNAL SP_INLINE hblk *blk_next(const hblk *b) {
    return (hblk *)((char *)b + ((size_t)b->size << HUNIT_SHIFT));
}
TRACK_INTERNAL SP_INLINE hblk *blk_prev(const hblk *b) {
    return (hblk *)((char *)b - ((size_t)b->prev << HUNIT_SHIFT));
}
SP_INLINE void *blk_payload(const hblk *b) {
    return (char *)b + sizeof(hblk);
}
SP_INLINE hblk *blk_of(const void *p) {
    return (hblk *)((char *)p - sizeof(hblk));
}
SP_INLINE size_t units_bytes(uint32_t u) {
    return (size_t)u << HUNIT_SHIFT;
}
/* Units a block of `size` bytes needs (header included); 0 if it cannot be represented, with
 * room left for the largest alignment pad (block_take adds it in 32 bits). */
SP_INLINE uint32_t units_for(size_t size) {
    if (size > SP_HANDLE_REGION_LIMIT) return 0;
    uint64_t u = ((uint64_t)size + HUNIT - 1) / HUNIT + 1;
    if (u > UINT32_MAX - (HMAX_ALIGN / HUNIT + HMIN_UNITS)) return 0;
    return u < HMIN_UNITS ? HMIN_UNITS : (uint32_t)u;
}

/* The calling thread's identity for `compactor` (the address of a thread-local: read anew in
 * every call, which never suspends). */
SP_HIDDEN const char *handle_self(void);
/* The caller is the compacting thread (a relocation callback, or compaction itself). */
SP_INLINE bool heap_busy(const sp_handle_heap *h) {
    return __atomic_load_n(&h->compactor, __ATOMIC_RELAXED) == handle_self();
}
/* Lock h unless the caller is the compacting thread (which holds it already); returns
 * whether it locked, for heap_unlock. */
SP_HIDDEN bool heap_lock(sp_handle_heap *h);
SP_HIDDEN void heap_unlock(sp_handle_heap *h, bool locked);

/* Size class of u units (u >= 2): exact below 16, then 8 classes per doubling. */
SP_HIDDEN unsigned space_class(uint64_t u);
/* The live-block index (lock held, or compaction). */
SP_HIDDEN void space_live_insert(sp_handle_heap *h, uint32_t slot, uint32_t need);
SP_HIDDEN void space_live_remove(sp_handle_heap *h, uint32_t slot, uint32_t need);
SP_HIDDEN void space_hole_insert(sp_handle_heap *h, hblk *b);
SP_HIDDEN void space_hole_remove(sp_handle_heap *h, hblk *b);
/* A hole of at least `units`, removed from its list; NULL if none. O(1). */
SP_HIDDEN hblk *space_hole_find(sp_handle_heap *h, uint32_t units);
/* Make [b, b+units) a free block: coalesce with free neighbours or join the top. Returns the
 * resulting hole (NULL when it joined the top). Adjusts the compaction scan. */
SP_HIDDEN hblk *space_release(sp_handle_heap *h, hblk *b, uint32_t units);
/* Write a header at b for a block of `units` whose predecessor has `prev` units, and fix the
 * successor's prev (or top_prev). */
SP_HIDDEN void space_header(sp_handle_heap *h, hblk *b, uint32_t units, uint32_t prev);
/* Grow committed memory so that [.., need) is usable. SP_OK or SP_ERR_NOMEM/SP_ERR_OS. */
SP_HIDDEN sp_result space_commit(sp_handle_heap *h, char *need);
/* Decommit surplus above the top (hysteresis, see sp_handle_compact), at most max_bytes
 * (a multiple of HCOMMIT_STEP) from the end of the committed range. Returns the bytes given
 * back (0: nothing to give, or the decommit failed). */
SP_HIDDEN size_t space_trim(sp_handle_heap *h, size_t max_bytes);
/* Something that can let a hole compaction left close happened (a last unpin, a block taken at
 * the top, the top lowered): if any was left (`low`), the next call goes back for it. */
SP_HIDDEN void space_note_change(sp_handle_heap *h);
/* Bytes of the largest hole, from the highest class holding any: the largest of that class's
 * first LARGEST_WALK holes (on its list, the one put there last first: freed, merged or left by
 * a carve). Exact when the class
 * holds no more; else less than one class step below (the holes of a class of 16 units or
 * more differ by less than 1/8 of the smallest: the result is above 8/9 of the true one).
 * Bounded: sp_frame_end reads it every frame, and a freed level can leave thousands of holes
 * of one size, each a cache miss to read. */
#define LARGEST_WALK 64 /* sp_handle.h documents the number */
SP_HIDDEN size_t space_largest_hole(const sp_handle_heap *h);
/* Take `units` at the front of hole b (removed from its list), the rest becomes a hole again
 * (or slack of the block if under HMIN_UNITS). Returns the units the block got. */
SP_HIDDEN uint32_t space_carve(sp_handle_heap *h, hblk *b, uint32_t units);

/* ---- slots (handle.c) ---- */
SP_INLINE sp_handle_slot *slot_at(const sp_handle_heap *h, uint32_t i) {
    return &h->head.table->slots[i];
}
SP_INLINE uint32_t id_index(const sp_handle_heap *h, uint32_t id) {
    return id & h->index_full;
}
SP_INLINE uint32_t slot_id(const sp_handle_slot *s) {
    return (uint32_t)__atomic_load_n(&s->word, __ATOMIC_RELAXED);
}
SP_INLINE void *slot_ptr(const sp_handle_heap *h, const sp_handle_slot *s) {
    return h->base + ((__atomic_load_n(&s->word, __ATOMIC_RELAXED) >> 32) << HUNIT_SHIFT);
}
/* The live slot of handle id, or NULL (stale, forged or freed; id 0 too: a free slot holds
 * the complement of its index, a live one an id of generation >= 1). Heap lock held. */
SP_INLINE sp_handle_slot *slot_live(const sp_handle_heap *h, uint32_t id) {
    uint32_t i = id_index(h, id);
    if (i >= h->slots_used) return NULL;
    sp_handle_slot *s = slot_at(h, i);
    return slot_id(s) == id ? s : NULL;
}
/* Publish id and payload p in one store (release: the block's header is written before). */
SP_INLINE void slot_set(const sp_handle_heap *h, sp_handle_slot *s, uint32_t id, const void *p) {
    uint64_t off = (uint64_t)((const char *)p - h->base) >> HUNIT_SHIFT;
    __atomic_store_n(&s->word, (uint64_t)id | off << 32, __ATOMIC_RELEASE);
}

#endif
