/* The central heap: two-level segregated fit over caller-provided pools (see sp_tlsf.h).
 *
 * Every block starts with a 16-byte header; the payload follows. Physical neighbours are
 * found through the size (next) and the always-valid predecessor pointer (previous); free
 * blocks also sit on a doubly linked list per size class, the links stored in their payload.
 * Two bitmaps say which lists are non-empty, so finding a fitting block is two bit scans.
 *
 *   pool:  [hdr|payload][hdr|payload] ... [hdr|payload][sentinel hdr]
 *   hdr:   prev_phys | PREV_FREE,   tag:24 size:36 | NEXT_FREE FREE
 *
 * Each header mirrors whether its two physical neighbours are free, so free() decides both
 * merges from the one header it must read anyway. Telling a neighbour about a change is a
 * blind store: the successor's first word is (our address | PREV_FREE), and a used
 * predecessor's second word is fully determined by its address and ours. So free() and
 * malloc() load a neighbour's header only when they merge with it: no dependent cache miss
 * and no branch on one in the common case.
 *
 * malloc carves from the tail of the free block it finds, so that block keeps its header and,
 * unless its size class changes, its place in its list. Lists are LIFO; only non-head entries
 * keep a valid back link, so popping a head never touches its successor.
 */
#include "sp_tlsf.h"

#include <stdio.h>
#include <string.h>

#include "sp_internal.h"
#include "sp_platform.h"
#include "track.h"

/* ---- geometry ------------------------------------------------------------------------------
 * Sizes below SMALL_LIMIT map linearly (fl 0, one class per 16 bytes). Above, fl is the bit
 * length and sl splits each power of two into SL_COUNT classes: at most 1/32 slack. */
enum {
    ALIGN_LOG2 = 4,
    ALIGN = 1 << ALIGN_LOG2,
    SL_LOG2 = 5,
    SL_COUNT = 1 << SL_LOG2,
    FL_SHIFT = SL_LOG2 + ALIGN_LOG2,
    SMALL_LIMIT = 1 << FL_SHIFT,
    FL_COUNT = 40 - FL_SHIFT + 1, /* block sizes below 2^40 */
    HEADER = 16,
    MIN_PAYLOAD = 16, /* room for the two free-list links */
    MIN_BLOCK = HEADER + MIN_PAYLOAD,
};

#define FLAG_FREE ((uint64_t)1)       /* in size_flags */
#define FLAG_NEXT_FREE ((uint64_t)2)  /* in size_flags */
#define FLAG_PREV_FREE ((uintptr_t)1) /* in prev_word */
#define SIZE_MASK ((((uint64_t)1 << 40) - 1) & ~(uint64_t)(ALIGN - 1))
#define TAG_MASK (~(((uint64_t)1 << 40) - 1))
#define DEAD_MARK ((uint64_t)0xDEAD << 48)
#define MAX_ALIGN ((size_t)1 << 30)
#ifndef TLSF_CHECK_BACKLINK
#define TLSF_CHECK_BACKLINK (SP_DEBUG >= 1)
#endif

_Static_assert(FL_COUNT <= 32, "fl bitmap is 32 bits");
_Static_assert(SP_TLSF_MAX_BLOCK < ((size_t)1 << 40), "largest block must map below FL_COUNT");

typedef struct block block;
struct block {
    uintptr_t prev_word; /* physical predecessor | FLAG_PREV_FREE; 0 for a pool's first block */
    uint64_t size_flags; /* tag | payload size | FLAG_NEXT_FREE | FLAG_FREE */
    /* payload; while the block is free it starts with: */
    block *next_free;
    block *prev_free;
};

typedef struct pool_range {
    uintptr_t lo, hi;          /* first header .. end of the sentinel header */
    uintptr_t first, last_off; /* payload addresses a: first <= a <= first + last_off */
} pool_range;

struct sp_tlsf {
    uint32_t fl_bitmap;
    uint32_t sl_bitmap[FL_COUNT];
    block *heads[FL_COUNT][SL_COUNT];

    /* status, kept exact on every operation. Free figures are derived: every byte of a pool is
     * a header, used payload or free payload, so only splits and merges touch `headers`. */
    size_t bytes_used, live_blocks, high_water, headers, pool_bytes, bytes_total;

    uint64_t secret; /* per-heap salt of the header tags */
    size_t pool_count;
    pool_range pools[SP_TLSF_MAX_POOLS];
    sp_mutex lock;
    bool locked;
    const char *name;
};

/* ---- headers ------------------------------------------------------------------------------
 * Invariants: a header's tag is tag_of(its address); the predecessor pointer is valid for
 * every block; FLAG_PREV_FREE mirrors the predecessor's FLAG_FREE and FLAG_NEXT_FREE the
 * successor's (a pool's first block has none: flag clear); no two free blocks are neighbours. */

/* 24 bits mixed from every bit of the header's address and a per-heap secret: user data, or
 * a header copied to another address, passes for a header with probability 2^-24. */
TRACK_INTERNAL SP_INLINE uint64_t tag_of(const sp_tlsf *t, const block *b) {
    return (((uint64_t)(uintptr_t)b ^ t->secret) * 0x9E3779B97F4A7C15ull) & TAG_MASK;
}
TRACK_INTERNAL SP_INLINE size_t block_size(const block *b) {
    return b->size_flags & SIZE_MASK;
}
TRACK_INTERNAL SP_INLINE bool block_is_free(const block *b) {
    return b->size_flags & FLAG_FREE;
}
TRACK_INTERNAL SP_INLINE bool block_prev_is_free(const block *b) {
    return b->prev_word & FLAG_PREV_FREE;
}
TRACK_INTERNAL SP_INLINE block *block_prev(const block *b) {
    return (block *)(b->prev_word & ~(uintptr_t)(ALIGN - 1));
}
TRACK_INTERNAL SP_INLINE bool block_next_is_free(const block *b) {
    return b->size_flags & FLAG_NEXT_FREE;
}
TRACK_INTERNAL SP_INLINE void *block_payload(const block *b) {
    return (char *)b + HEADER;
}
TRACK_INTERNAL SP_INLINE block *block_of(const void *p) {
    return (block *)((char *)p - HEADER);
}
TRACK_INTERNAL SP_INLINE block *block_next(const block *b) {
    return (block *)((char *)b + HEADER + block_size(b));
}
TRACK_INTERNAL SP_INLINE void block_set_size(block *b, size_t size) {
    b->size_flags = (b->size_flags & ~SIZE_MASK) | size;
}
TRACK_INTERNAL SP_INLINE void block_init(sp_tlsf *t, block *b, block *prev, bool prev_free,
                                         size_t size, uint64_t flags) {
    b->prev_word = (uintptr_t)prev | (prev_free ? FLAG_PREV_FREE : 0);
    b->size_flags = tag_of(t, b) | size | flags;
    t->headers++;
}
/* A header swallowed by a merge: marked so a later free of its payload reads as double free. */
TRACK_INTERNAL SP_INLINE void block_kill(sp_tlsf *t, block *b) {
    b->size_flags = tag_of(t, b) ^ DEAD_MARK;
    t->headers--;
}
/* Derived status: a pool is headers, used payload and free payload (and one sentinel). */
TRACK_INTERNAL SP_INLINE size_t heap_bytes_free(const sp_tlsf *t) {
    return t->pool_bytes - t->headers * HEADER - t->bytes_used;
}
TRACK_INTERNAL SP_INLINE size_t heap_free_blocks(const sp_tlsf *t) {
    return t->headers - t->pool_count - t->live_blocks;
}
/* Tell the successor of b who its predecessor is and whether it is free: one blind store. */
TRACK_INTERNAL SP_INLINE void block_link_next(block *b, bool b_free) {
    block_next(b)->prev_word = (uintptr_t)b | (b_free ? FLAG_PREV_FREE : 0);
}
/* Tell b's predecessor, which must be in use, whether b is free: one blind store, since a used
 * block's size_flags follow from its address and b's. */
TRACK_INTERNAL SP_INLINE void block_tell_prev(const sp_tlsf *t, block *b, bool b_free) {
    block *prev = block_prev(b);
    if (prev)
        prev->size_flags = tag_of(t, prev) | ((uintptr_t)b - (uintptr_t)prev - HEADER) |
                           (b_free ? FLAG_NEXT_FREE : 0);
}

/* ---- size classes ------------------------------------------------------------------------ */

TRACK_INTERNAL SP_INLINE unsigned bit_high(uint64_t x) {
    return 63u - (unsigned)__builtin_clzll(x);
}

TRACK_INTERNAL SP_INLINE void mapping_insert(size_t size, unsigned *fl, unsigned *sl) {
    if (size < SMALL_LIMIT) {
        *fl = 0;
        *sl = (unsigned)(size >> ALIGN_LOG2);
    } else {
        unsigned f = bit_high(size);
        *sl = (unsigned)(size >> (f - SL_LOG2)) ^ SL_COUNT;
        *fl = f - (FL_SHIFT - 1);
    }
}

/* The class whose every block is at least `size`: round up to the next class boundary. */
TRACK_INTERNAL SP_INLINE void mapping_search(size_t size, unsigned *fl, unsigned *sl) {
    if (size >= SMALL_LIMIT) size += ((size_t)1 << (bit_high(size) - SL_LOG2)) - 1;
    mapping_insert(size, fl, sl);
}

/* Bytes of payload for a request: at least MIN_PAYLOAD, a multiple of ALIGN. The caller has
 * checked size <= SP_TLSF_MAX_BLOCK, so this cannot overflow. */
TRACK_INTERNAL SP_INLINE size_t adjust_size(size_t size) {
    return size <= MIN_PAYLOAD ? MIN_PAYLOAD : sp_align_up(size, ALIGN);
}

/* ---- free lists ----------------------------------------------------------------------------
 * LIFO lists. Only non-head entries keep a valid prev_free: popping the head (the common
 * case, in malloc) then never touches its successor's cache line. A block is the head of
 * its list iff heads[fl][sl] points at it. */

TRACK_INTERNAL SP_INLINE void list_insert(sp_tlsf *t, block *b) {
    unsigned fl, sl;
    mapping_insert(block_size(b), &fl, &sl);
    block *head = t->heads[fl][sl];
    b->next_free = head;
    if (head) head->prev_free = b;
    t->heads[fl][sl] = b;
    t->fl_bitmap |= 1u << fl;
    t->sl_bitmap[fl] |= 1u << sl;
}

/* Unlink b from list (fl, sl), the list of its size class. */
TRACK_INTERNAL SP_INLINE void list_remove_at(sp_tlsf *t, block *b, unsigned fl, unsigned sl) {
    block *next = b->next_free;
    if (t->heads[fl][sl] == b) {
        t->heads[fl][sl] = next;
        if (!next) {
            t->sl_bitmap[fl] &= ~(1u << sl);
            if (!t->sl_bitmap[fl]) t->fl_bitmap &= ~(1u << fl);
        }
    } else {
        block *prev = b->prev_free;
        prev->next_free = next;
        if (next) next->prev_free = prev;
    }
}

TRACK_INTERNAL SP_INLINE void list_remove(sp_tlsf *t, block *b) {
    unsigned fl, sl;
    mapping_insert(block_size(b), &fl, &sl);
    list_remove_at(t, b, fl, sl);
}

/* The free block b, on list (fl, sl), takes a new size. It changes lists only if its class
 * changes: growing a large free block by a merge, or carving an allocation off its end,
 * often touches no list at all. */
TRACK_INTERNAL SP_INLINE void list_resize_at(sp_tlsf *t, block *b, unsigned fl, unsigned sl,
                                             size_t size) {
    unsigned nfl, nsl;
    mapping_insert(size, &nfl, &nsl);
    if (fl == nfl && sl == nsl) {
        block_set_size(b, size);
        return;
    }
    list_remove_at(t, b, fl, sl);
    block_set_size(b, size);
    list_insert(t, b);
}

/* A free block with payload >= size, or NULL; (*fl, *sl) is the list it heads. Two bit scans
 * and, if the rounded class is empty, one look at the head of the exact class (so a request
 * as large as the largest free block still succeeds). */
TRACK_INTERNAL SP_INLINE block *list_find(sp_tlsf *t, size_t size, unsigned *fl, unsigned *sl) {
    mapping_search(size, fl, sl);
    if (SP_LIKELY(*fl < FL_COUNT)) {
        uint32_t sl_map = t->sl_bitmap[*fl] & (~0u << *sl);
        if (!sl_map) {
            uint32_t fl_map = *fl + 1 < 32 ? t->fl_bitmap & (~0u << (*fl + 1)) : 0;
            if (fl_map) {
                *fl = (unsigned)__builtin_ctz(fl_map);
                sl_map = t->sl_bitmap[*fl];
            }
        }
        if (sl_map) {
            *sl = (unsigned)__builtin_ctz(sl_map);
            return t->heads[*fl][*sl];
        }
    }
    mapping_insert(size, fl, sl);
    block *b = *fl < FL_COUNT ? t->heads[*fl][*sl] : NULL;
    return b && block_size(b) >= size ? b : NULL;
}

/* ---- block surgery ------------------------------------------------------------------------- */

/* b is in use (or becoming so) with payload >= want. Cut what lies beyond `want` into a free
 * block if it can hold one, merging it with a free successor, and leave b's successor
 * correctly linked and flagged either way. */
TRACK_INTERNAL static void block_trim_tail(sp_tlsf *t, block *b, size_t want) {
    size_t size = block_size(b);
    if (size - want < MIN_BLOCK) { /* b's FLAG_NEXT_FREE is already right */
        block_link_next(b, false);
        return;
    }
    block *next = block_next(b);
    bool next_free = block_next_is_free(b);
    block_set_size(b, want);
    b->size_flags |= FLAG_NEXT_FREE;
    block *rest = block_next(b);
    size_t rest_size = size - want - HEADER;
    if (next_free) {
        list_remove(t, next);
        rest_size += HEADER + block_size(next);
        block_kill(t, next);
    }
    block_init(t, rest, b, false, rest_size, FLAG_FREE);
    block_link_next(rest, true);
    list_insert(t, rest);
}

/* Hand the free, unlisted block b to the user with `want` payload bytes. */
TRACK_INTERNAL SP_INLINE void *block_use(sp_tlsf *t, block *b, size_t want) {
    b->size_flags &= ~FLAG_FREE;
    if (!block_prev_is_free(b)) block_tell_prev(t, b, false);
    block_trim_tail(t, b, want);
    size_t size = block_size(b);
    t->bytes_used += size;
    t->live_blocks++;
    if (t->bytes_used > t->high_water) t->high_water = t->bytes_used;
    track_malloc(block_payload(b), size, 0);
    return block_payload(b);
}

/* Return the live block b to the free lists, merging with free neighbours. */
TRACK_INTERNAL static void block_release(sp_tlsf *t, block *b) {
    size_t size = block_size(b);
    t->bytes_used -= size;
    t->live_blocks--;
    track_free(block_payload(b), size);
    block *next = block_next(b);
    if (block_next_is_free(b)) {
        block *after = block_next(next);
        list_remove(t, next);
        size += HEADER + block_size(next);
        block_kill(t, next);
        next = after;
    }
    if (block_prev_is_free(b)) {
        block *prev = block_prev(b);
        unsigned fl, sl;
        mapping_insert(block_size(prev), &fl, &sl);
        block_kill(t, b);
        b = prev;
        b->size_flags &= ~FLAG_NEXT_FREE;
        list_resize_at(t, b, fl, sl, block_size(b) + HEADER + size);
    } else {
        b->size_flags = (b->size_flags & TAG_MASK) | size | FLAG_FREE;
        block_tell_prev(t, b, true);
        list_insert(t, b);
    }
    next->prev_word = (uintptr_t)b | FLAG_PREV_FREE;
}

/* ---- validation of caller pointers ----------------------------------------------------------
 * O(pools) + one header read, in every build: the pointer must lie in a pool, be aligned, and
 * its header must carry this heap's 24-bit tag for that address, a plausible size and no
 * FLAG_FREE (a merged-away header carries a dead mark: double free). Arbitrary user data, or
 * a header copied to another address, passes with probability 2^-24. Debug builds also
 * require the successor to point back (TLSF_CHECK_BACKLINK), which makes a forged header
 * pass only with an exact pointer match too, at the price of a dependent cache miss per free. */

typedef struct verdict {
    sp_result id;
    const char *why;
    block *b;
} verdict;

/* Lock-free: a pool entry is written before pool_count is raised (release), and never changes
 * afterwards, so a reader that sees the count (acquire) sees complete entries. */
TRACK_INTERNAL static const pool_range *pool_of(const sp_tlsf *t, const void *p) {
    uintptr_t a = (uintptr_t)p;
    size_t n = __atomic_load_n(&t->pool_count, __ATOMIC_ACQUIRE);
    for (size_t i = 0; i < n; i++)
        if (a - t->pools[i].lo < t->pools[i].hi - t->pools[i].lo) return &t->pools[i];
    return NULL;
}

/* Why p is not a payload address of any pool (slow path of block_check_live). */
TRACK_INTERNAL SP_COLD static verdict pointer_classify(const sp_tlsf *t, const void *p,
                                                       const pool_range **out) {
    uintptr_t a = (uintptr_t)p;
    const pool_range *pool = pool_of(t, p);
    *out = NULL;
    if (!pool) return (verdict){SP_ERR_FOREIGN_POINTER, "pointer is not inside this heap", NULL};
    uintptr_t off = a - pool->first;
    if (off > pool->last_off || (off & (ALIGN - 1)))
        return (verdict){SP_ERR_INVALID_POINTER, "misaligned pointer: not a block start", NULL};
    *out = pool;
    return (verdict){SP_OK, NULL, NULL};
}

TRACK_INTERNAL SP_INLINE verdict block_check_live(const sp_tlsf *t, const void *p) {
    uintptr_t a = (uintptr_t)p;
    const pool_range *pool = &t->pools[0];
    uintptr_t off = a - pool->first; /* pool->first is aligned: off carries a's misalignment */
    if (SP_UNLIKELY(off > pool->last_off || (off & (ALIGN - 1)))) {
        verdict v = pointer_classify(t, p, &pool);
        if (!pool) return v;
        off = a - pool->first;
    }
    block *b = block_of(p);
    uint64_t sf = b->size_flags, tag = tag_of(t, b);
    track_value_defined(&sf, sizeof sf); /* for a bad pointer this is user data */
    if (SP_UNLIKELY((sf & (TAG_MASK | FLAG_FREE)) != tag)) {
        if (sf == (tag ^ DEAD_MARK))
            return (verdict){SP_ERR_DOUBLE_FREE, "block was already freed (and merged)", NULL};
        if ((sf & TAG_MASK) == tag)
            return (verdict){SP_ERR_DOUBLE_FREE, "block is already free", NULL};
        return (verdict){SP_ERR_INVALID_POINTER, "not the start of a block (interior pointer?)",
                         NULL};
    }
    if (SP_UNLIKELY((sf & SIZE_MASK) > pool->last_off - off + HEADER)) /* next header in pool */
        return (verdict){SP_ERR_INVALID_POINTER, "header size runs off the pool", NULL};
#if TLSF_CHECK_BACKLINK
    if (block_prev(block_next(b)) != b)
        return (verdict){SP_ERR_INVALID_POINTER, "header does not match its neighbour", NULL};
#endif
    return (verdict){SP_OK, NULL, b};
}

/* ---- locking ------------------------------------------------------------------------------- */

/* Returns whether the lock was taken; pass that to heap_unlock (one read of t->locked). */
TRACK_INTERNAL SP_INLINE bool heap_lock(sp_tlsf *t) {
    bool locked = t->locked;
    if (locked) sp_mutex_lock(&t->lock);
    track_enter();
    return locked;
}
TRACK_INTERNAL SP_INLINE void heap_unlock(sp_tlsf *t, bool locked) {
    track_leave();
    if (locked) sp_mutex_unlock(&t->lock);
}

SP_COLD static void report(const sp_tlsf *t, const char *call, const void *p, verdict v) {
    sp_misuse(v.id, call, p, "%s (heap '%s')", v.why, t->name ? t->name : "tlsf");
}

/* ---- pools --------------------------------------------------------------------------------- */

size_t sp_tlsf_control_size(void) {
    return sp_align_up(sizeof(sp_tlsf), ALIGN);
}

/* Why a pool was refused: reported by the caller once the heap is unlocked. */
typedef struct pool_verdict {
    sp_result id;
    const char *why;
} pool_verdict;

TRACK_INTERNAL static pool_verdict pool_add(sp_tlsf *t, void *memory, size_t size) {
    if (!memory) return (pool_verdict){SP_ERR_INVALID_ARG, "NULL pool memory"};
    uintptr_t lo = sp_align_up((uintptr_t)memory, ALIGN);
    uintptr_t end = (uintptr_t)memory + size;
    if (end < (uintptr_t)memory) return (pool_verdict){SP_ERR_OVERFLOW, "pool wraps around"};
    uintptr_t hi = sp_align_down(end, ALIGN);
    if (hi <= lo || hi - lo < 2 * HEADER + MIN_PAYLOAD)
        return (pool_verdict){SP_ERR_TOO_SMALL, "pool too small for one block"};
    size_t payload = hi - lo - 2 * HEADER;
    if (payload > SP_TLSF_MAX_BLOCK)
        return (pool_verdict){SP_ERR_INVALID_ARG, "pool larger than SP_TLSF_MAX_BLOCK"};
    uintptr_t ctl = (uintptr_t)t;
    if (lo < ctl + sp_tlsf_control_size() && ctl < hi)
        return (pool_verdict){SP_ERR_INVALID_ARG, "pool overlaps the heap's control structure"};
    for (size_t i = 0; i < t->pool_count; i++)
        if (lo < t->pools[i].hi && t->pools[i].lo < hi)
            return (pool_verdict){SP_ERR_INVALID_ARG, "pool overlaps an existing pool"};
    if (t->pool_count == SP_TLSF_MAX_POOLS)
        return (pool_verdict){SP_ERR_LIMIT, "pool table full (SP_TLSF_MAX_POOLS)"};
    track_pool((void *)lo, hi - lo);
    block *first = (block *)lo;
    block_init(t, first, NULL, false, payload, FLAG_FREE);
    block *sentinel = block_next(first);
    block_init(t, sentinel, first, true, 0, 0);
    list_insert(t, first);
    t->pools[t->pool_count] = (pool_range){lo, hi, lo + HEADER, hi - 3 * HEADER - lo};
    __atomic_store_n(&t->pool_count, t->pool_count + 1, __ATOMIC_RELEASE);
    t->bytes_total += hi - lo;
    t->pool_bytes += hi - lo;
    return (pool_verdict){SP_OK, NULL};
}

/* Resource-like refusals (too small, table full) are warnings; the rest is misuse. */
SP_COLD static sp_result pool_report(pool_verdict v, const char *call, const void *memory,
                                     size_t size) {
    if (v.id == SP_ERR_TOO_SMALL || v.id == SP_ERR_LIMIT) {
        sp_log(SP_LOG_WARN, v.id, call, memory, "%s (%zu bytes)", v.why, size);
        return v.id;
    }
    return sp_misuse(v.id, call, memory, "%s (%zu bytes)", v.why, size);
}

sp_tlsf *sp_tlsf_create(const sp_tlsf_desc *desc, sp_result *err) {
    sp_result r = SP_OK;
    sp_tlsf *t = NULL;
    if (!desc || !desc->memory) {
        r = sp_misuse(SP_ERR_INVALID_ARG, "sp_tlsf_create", desc, "NULL desc or desc->memory");
        goto out;
    }
    uintptr_t base = sp_align_up((uintptr_t)desc->memory, ALIGN);
    size_t skew = base - (uintptr_t)desc->memory, control = sp_tlsf_control_size();
    if (desc->size < skew + control) {
        sp_log(SP_LOG_WARN, SP_ERR_TOO_SMALL, "sp_tlsf_create", desc->memory,
               "%zu bytes cannot hold the control structure (%zu)", desc->size, control);
        r = SP_ERR_TOO_SMALL;
        goto out;
    }
    t = (sp_tlsf *)base;
    memset(t, 0, sizeof *t);
    t->locked = desc->locked;
    t->name = desc->name;
    t->secret = ((uint64_t)base * 0xD6E8FEB86659FD93ull) ^ sp_ticks();
    t->bytes_total = control;
    track_enter();
    pool_verdict v = pool_add(t, (char *)base + control, desc->size - skew - control);
    track_leave();
    if (v.id != SP_OK) {
        r = pool_report(v, "sp_tlsf_create", desc->memory, desc->size);
        t = NULL;
    }
out:
    if (err) *err = r;
    return t;
}

size_t sp_tlsf_destroy(sp_tlsf *t) {
    if (!t) return 0;
    size_t live = t->live_blocks;
    /* The memory goes back to the caller: make it plainly accessible again. */
    for (size_t i = 0; i < t->pool_count; i++)
        track_release((void *)t->pools[i].lo, t->pools[i].hi - t->pools[i].lo);
    memset(t, 0, sizeof *t);
    return live;
}

sp_result sp_tlsf_add_pool(sp_tlsf *t, void *memory, size_t size) {
    bool locked = heap_lock(t);
    pool_verdict v = pool_add(t, memory, size);
    heap_unlock(t, locked);
    return v.id == SP_OK ? SP_OK : pool_report(v, "sp_tlsf_add_pool", memory, size);
}

/* ---- allocation ---------------------------------------------------------------------------- */

/* Carve `want` bytes off the end of the listed free block b. b keeps its header and, if its
 * class does not change, its place in its list; the new block's successor learns its new
 * predecessor. */
TRACK_INTERNAL SP_INLINE void *block_carve_tail(sp_tlsf *t, block *b, unsigned fl, unsigned sl,
                                                size_t want) {
    size_t rest = block_size(b) - want - HEADER;
    list_resize_at(t, b, fl, sl, rest);
    block *a = block_next(b);
    block_init(t, a, b, true, want, 0);
    block_link_next(a, false);
    t->bytes_used += want;
    t->live_blocks++;
    if (t->bytes_used > t->high_water) t->high_water = t->bytes_used;
    track_malloc(block_payload(a), want, 0);
    return block_payload(a);
}

TRACK_INTERNAL static void *heap_malloc(sp_tlsf *t, size_t size) {
    if (SP_UNLIKELY(size > SP_TLSF_MAX_BLOCK)) return NULL;
    size_t want = adjust_size(size);
    bool locked = heap_lock(t);
    void *p = NULL;
    unsigned fl, sl;
    block *b = list_find(t, want, &fl, &sl);
    if (SP_LIKELY(b)) {
        if (block_size(b) - want >= MIN_BLOCK) {
            p = block_carve_tail(t, b, fl, sl, want);
        } else {
            list_remove_at(t, b, fl, sl);
            p = block_use(t, b, want);
        }
    }
    heap_unlock(t, locked);
    return p;
}

void *sp_tlsf_malloc(sp_tlsf *t, size_t size) {
    return heap_malloc(t, size);
}

TRACK_INTERNAL void *sp_tlsf_aligned_alloc(sp_tlsf *t, size_t align, size_t size) {
    if (!sp_is_pow2(align) || align > MAX_ALIGN) {
        sp_misuse(SP_ERR_BAD_ALIGNMENT, "sp_tlsf_aligned_alloc", (void *)align,
                  "alignment %zu is not a power of two up to %zu", align, MAX_ALIGN);
        return NULL;
    }
    if (align <= ALIGN) return heap_malloc(t, size);
    if (size > SP_TLSF_MAX_BLOCK - align - MIN_BLOCK) return NULL;
    size_t want = adjust_size(size);
    /* Room for the worst gap in front: a gap is either 0 or a whole free block (>= MIN_BLOCK). */
    size_t search = want + align + MIN_BLOCK;
    bool locked = heap_lock(t);
    void *p = NULL;
    unsigned fl, sl;
    block *b = list_find(t, search, &fl, &sl);
    if (b) {
        list_remove_at(t, b, fl, sl);
        uintptr_t start = (uintptr_t)block_payload(b);
        uintptr_t at = sp_align_up(start, align);
        if (at != start && at - start < MIN_BLOCK) at = sp_align_up(start + MIN_BLOCK, align);
        if (at != start) {
            /* Split the gap off as a free block; b's predecessor is in use (b was free). */
            size_t gap = at - start, total = block_size(b);
            block *aligned = block_of((void *)at);
            block_set_size(b, gap - HEADER);
            block_init(t, aligned, b, true, total - gap, 0);
            list_insert(t, b);
            b = aligned;
        }
        p = block_use(t, b, want);
    }
    heap_unlock(t, locked);
    return p;
}

TRACK_INTERNAL void sp_tlsf_free(sp_tlsf *t, void *p) {
    if (!p) return;
    bool locked = heap_lock(t);
    verdict v = block_check_live(t, p);
    if (SP_LIKELY(v.b)) block_release(t, v.b);
    heap_unlock(t, locked);
    if (SP_UNLIKELY(!v.b)) report(t, "sp_tlsf_free", p, v);
}

/* Resize b in place to `want` payload bytes if it can be done without moving. */
TRACK_INTERNAL static bool block_resize_in_place(sp_tlsf *t, block *b, size_t want) {
    size_t old = block_size(b);
    if (want > old) {
        block *next = block_next(b);
        if (!block_next_is_free(b) || old + HEADER + block_size(next) < want) return false;
        list_remove(t, next);
        block_set_size(b, old + HEADER + block_size(next));
        block_kill(t, next);
        b->size_flags &= ~FLAG_NEXT_FREE;
    }
    block_trim_tail(t, b, want);
    size_t now = block_size(b);
    t->bytes_used = t->bytes_used - old + now;
    if (t->bytes_used > t->high_water) t->high_water = t->bytes_used;
    track_resize(block_payload(b), old, now);
    return true;
}

TRACK_INTERNAL void *sp_tlsf_realloc(sp_tlsf *t, void *p, size_t size) {
    if (!p) return heap_malloc(t, size);
    bool locked = heap_lock(t);
    verdict v = block_check_live(t, p);
    size_t old = v.b ? block_size(v.b) : 0;
    bool done = false;
    if (v.b && size == 0)
        block_release(t, v.b); /* realloc(p, 0) frees p, returns NULL */
    else if (v.b && size <= SP_TLSF_MAX_BLOCK)
        done = block_resize_in_place(t, v.b, adjust_size(size));
    heap_unlock(t, locked);
    if (SP_UNLIKELY(!v.b)) {
        report(t, "sp_tlsf_realloc", p, v);
        return NULL;
    }
    if (done) return p;
    if (size == 0) return NULL;
    /* Move. p stays the caller's until the copy is made, so no lock is needed across it. */
    void *q = heap_malloc(t, size);
    if (!q) return NULL;
    memcpy(q, p, old < size ? old : size);
    sp_tlsf_free(t, p);
    return q;
}

TRACK_INTERNAL size_t sp_tlsf_usable_size(sp_tlsf *t, const void *p) {
    if (!p) return 0;
    bool locked = heap_lock(t);
    verdict v = block_check_live(t, p);
    size_t size = v.b ? block_size(v.b) : 0;
    heap_unlock(t, locked);
    if (!v.b) report(t, "sp_tlsf_usable_size", p, v);
    return size;
}

bool sp_tlsf_owns(const sp_tlsf *t, const void *p) {
    return t && pool_of(t, p) != NULL;
}

/* ---- status, walk, check ------------------------------------------------------------------- */

TRACK_INTERNAL void sp_tlsf_status_get(sp_tlsf *t, sp_tlsf_status *out) {
    bool locked = heap_lock(t);
    size_t largest = 0, bytes_free = heap_bytes_free(t);
    if (t->fl_bitmap) {
        unsigned fl = bit_high(t->fl_bitmap);
        largest = block_size(t->heads[fl][bit_high(t->sl_bitmap[fl])]);
    }
    *out = (sp_tlsf_status){
        .bytes_used = t->bytes_used,
        .bytes_free = bytes_free,
        .bytes_overhead = t->bytes_total - t->bytes_used - bytes_free,
        .largest_free = largest,
        .live_blocks = t->live_blocks,
        .free_blocks = heap_free_blocks(t),
        .high_water = t->high_water,
        .fragmentation = bytes_free ? 1.0 - (double)largest / (double)bytes_free : 0.0,
        .pool_count = t->pool_count,
    };
    heap_unlock(t, locked);
}

TRACK_INTERNAL void sp_tlsf_walk(sp_tlsf *t, sp_tlsf_walker fn, void *user) {
    bool locked = heap_lock(t);
    for (size_t i = 0; i < t->pool_count; i++) {
        block *end = (block *)(t->pools[i].hi - HEADER);
        for (block *b = (block *)t->pools[i].lo; b < end; b = block_next(b)) {
            void *payload = block_payload(b);
            size_t size = block_size(b);
            bool used = !block_is_free(b);
            track_leave();
            fn(user, payload, size, used);
            track_enter();
        }
    }
    heap_unlock(t, locked);
}

#define CHECK(cond, addr, ...)                                                                     \
    do {                                                                                           \
        if (SP_UNLIKELY(!(cond))) {                                                                \
            bad = (addr);                                                                          \
            snprintf(why, sizeof why, __VA_ARGS__);                                                \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

TRACK_INTERNAL sp_result sp_tlsf_check(sp_tlsf *t) {
    char why[160];
    const void *bad = NULL;
    size_t used = 0, free_bytes = 0, live = 0, free_count = 0;
    bool locked = heap_lock(t);
    for (size_t i = 0; i < t->pool_count; i++) {
        block *end = (block *)(t->pools[i].hi - HEADER), *prev = NULL, *b;
        bool prev_free = false;
        for (b = (block *)t->pools[i].lo; b < end; b = block_next(b)) {
            CHECK((b->size_flags & TAG_MASK) == tag_of(t, b), b, "header tag is wrong");
            CHECK(block_prev(b) == prev, b, "prev_phys does not point at the previous block");
            CHECK(block_prev_is_free(b) == prev_free, b, "FLAG_PREV_FREE disagrees with neighbour");
            CHECK(!(b->size_flags & (ALIGN - 1) & ~(FLAG_FREE | FLAG_NEXT_FREE)) &&
                      !(b->prev_word & (ALIGN - 1) & ~FLAG_PREV_FREE),
                  b, "stray flag");
            CHECK(!prev || block_next_is_free(prev) == block_is_free(b), prev,
                  "FLAG_NEXT_FREE disagrees with neighbour");
            size_t size = block_size(b);
            CHECK(size >= MIN_PAYLOAD, b, "block smaller than the minimum");
            CHECK(size <= (uintptr_t)end - (uintptr_t)block_payload(b), b, "block runs off pool");
            bool is_free = block_is_free(b);
            CHECK(!(is_free && prev_free), b, "two neighbouring free blocks were not merged");
            if (is_free)
                free_bytes += size, free_count++;
            else
                used += size, live++;
            prev = b;
            prev_free = is_free;
        }
        CHECK(b == end, b, "last block does not end at the sentinel");
        CHECK((b->size_flags & TAG_MASK) == tag_of(t, b) && block_size(b) == 0 && !block_is_free(b),
              b, "sentinel header damaged");
        CHECK(block_prev(b) == prev && block_prev_is_free(b) == prev_free, b, "sentinel links");
        CHECK(!block_next_is_free(prev), prev, "FLAG_NEXT_FREE set before the sentinel");
    }
    size_t listed = 0;
    for (unsigned fl = 0; fl < FL_COUNT; fl++) {
        CHECK(!!(t->fl_bitmap & (1u << fl)) == !!t->sl_bitmap[fl], &t->sl_bitmap[fl],
              "first-level bitmap bit %u disagrees with second level", fl);
        for (unsigned sl = 0; sl < SL_COUNT; sl++) {
            block *head = t->heads[fl][sl];
            CHECK(!!(t->sl_bitmap[fl] & (1u << sl)) == !!head, &t->heads[fl][sl],
                  "bitmap bit (%u,%u) disagrees with its list", fl, sl);
            for (block *b = head, *prev = NULL; b; prev = b, b = b->next_free) {
                CHECK(++listed <= free_count, b, "free lists hold more blocks than the pools");
                CHECK(pool_of(t, b), b, "free-list entry outside every pool");
                CHECK((b->size_flags & TAG_MASK) == tag_of(t, b) && block_is_free(b), b,
                      "free-list entry is not a free block");
                CHECK(!prev || b->prev_free == prev, b, "prev_free link broken");
                unsigned f, s;
                mapping_insert(block_size(b), &f, &s);
                CHECK(f == fl && s == sl, b, "block of size %zu on list (%u,%u)", block_size(b), fl,
                      sl);
            }
        }
    }
    CHECK(listed == free_count, t, "%zu free blocks but %zu on lists", free_count, listed);
    CHECK(used == t->bytes_used && live == t->live_blocks, t, "used counters drifted");
    CHECK(free_bytes == heap_bytes_free(t) && free_count == heap_free_blocks(t), t,
          "free counters drifted");
    heap_unlock(t, locked);
    return SP_OK;
fail:
    heap_unlock(t, locked);
    sp_log(SP_LOG_ERROR, SP_ERR_CORRUPT, "sp_tlsf_check", bad, "%s", why);
    return SP_ERR_CORRUPT;
}
