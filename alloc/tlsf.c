/* The central heap: two-level segregated fit over caller-provided pools (see sp_tlsf.h).
 *
 * Every block starts with a 16-byte header; the payload follows. Physical neighbours are
 * found through the size (next) and the always-valid prev_link pointer (previous); free
 * blocks also sit on a doubly linked list per size class, the links stored in their payload.
 * Two bitmaps say which lists are non-empty, so finding a fitting block is two bit scans.
 *
 *   pool:  [hdr|payload][hdr|payload] ... [hdr|payload][sentinel hdr]
 *   hdr:   prev_link (predecessor | PREV_FREE) | tag:16 size:44 flags:4 (FREE)
 *
 * malloc carves from the tail of the free block it finds, so that block keeps its header and,
 * unless its size class changes, its place in its list. Lists are LIFO; only non-head entries
 * keep a valid back link, so popping a head never touches its successor. (A variant that
 * mirrored each neighbour's state in every header, trading the successor's header load for
 * blind stores, measured 8-10% slower on the tlsf benchmarks: see bench/README.md.)
 *
 * A block's PREV_FREE flag lives in the low bit of its prev_link, not in its size word, so a
 * block that changes state tells its successor with one blind store of the whole link: malloc
 * never loads the successor's header, and free does not load the header after a merged one.
 */
#include "sp_tlsf.h"

#include <stdio.h>
#include <string.h>

#include "sp_internal.h"
#include "sp_platform.h"
#include "track.h"

/* ---- geometry ------------------------------------------------------------------------------
 * Sizes below SMALL_LIMIT map linearly (fl 0, one class per 16 bytes). Above, fl is the bit
 * length and sl splits each power of two into SL_COUNT classes: at most 1/64 slack. */
enum {
    ALIGN_LOG2 = 4,
    ALIGN = 1 << ALIGN_LOG2,
    SL_LOG2 = 6,
    SL_COUNT = 1 << SL_LOG2,
    FL_SHIFT = SL_LOG2 + ALIGN_LOG2,
    SMALL_LIMIT = 1 << FL_SHIFT,
    FL_COUNT = 40 - FL_SHIFT + 1, /* block sizes below 2^40 */
    HEADER = 16,
    MIN_PAYLOAD = 16, /* room for the two free-list links */
    MIN_BLOCK = HEADER + MIN_PAYLOAD,
};

#define FLAG_FREE ((uint64_t)1)
#define FLAG_PREV_FREE ((uintptr_t)1) /* in prev_link */
#define SIZE_MASK ((((uint64_t)1 << 48) - 1) & ~(uint64_t)(ALIGN - 1))
#define TAG_MASK (~(((uint64_t)1 << 48) - 1))
#define DEAD_MARK ((uint64_t)0xDEAD << 48)
#define MAX_ALIGN ((size_t)1 << 30)

_Static_assert(FL_COUNT <= 32, "fl bitmap is 32 bits");
_Static_assert(SP_TLSF_MAX_BLOCK < ((size_t)1 << 40), "largest block must map below FL_COUNT");

typedef struct block block;
struct block {
    uintptr_t prev_link; /* physical predecessor (NULL for a pool's first block) | PREV_FREE */
    uint64_t size_flags; /* tag | payload size | FLAG_* */
    /* payload; while the block is free it starts with: */
    block *next_free;
    block *prev_free;
};

typedef struct pool_range {
    uintptr_t lo, hi; /* first header .. end of the sentinel header */
} pool_range;

struct sp_tlsf {
    uint32_t fl_bitmap;
    uint64_t sl_bitmap[FL_COUNT];
    block *heads[FL_COUNT][SL_COUNT];
    block scratch; /* takes the back link pushed onto an empty list */

    /* status, kept exact on every operation; bytes_free is derived (heap_bytes_free). The
     * peak is max(high_water, bytes_used): high_water is raised only where bytes_used is about
     * to fall, so malloc's count waits for nothing. `blocks` counts all blocks, live and free
     * (sentinels aside): it changes only where blocks split or merge, and free blocks are
     * blocks - live_blocks, so no list operation keeps a count. Counters written together sit
     * apart, so that the compiler does not pair them into one wide access. */
    size_t bytes_used, high_water, live_blocks, bytes_total, blocks;

    uint64_t secret; /* per-heap salt of the header tags */
    size_t pool_count;
    pool_range pools[SP_TLSF_MAX_POOLS];
    sp_mutex lock;
    bool locked;
    const char *name;
};

/* ---- headers ------------------------------------------------------------------------------
 * Invariants: a header's tag is tag_of(its address); prev_link is valid for every block;
 * its FLAG_PREV_FREE mirrors the predecessor's FLAG_FREE; no two free blocks are neighbours. */

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
    return b->prev_link & FLAG_PREV_FREE;
}
TRACK_INTERNAL SP_INLINE block *block_prev(const block *b) {
    return (block *)(b->prev_link & ~FLAG_PREV_FREE);
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
/* The prev_link of a block whose predecessor is prev. */
TRACK_INTERNAL SP_INLINE uintptr_t link_to(const block *prev, bool prev_free) {
    return (uintptr_t)prev | (prev_free ? FLAG_PREV_FREE : 0);
}
TRACK_INTERNAL SP_INLINE void block_init(const sp_tlsf *t, block *b, uintptr_t prev_link,
                                         size_t size, uint64_t flags) {
    b->prev_link = prev_link;
    b->size_flags = tag_of(t, b) | size | flags;
}
/* A header swallowed by a merge: marked so a later free of its payload reads as double free. */
TRACK_INTERNAL SP_INLINE void block_kill(const sp_tlsf *t, block *b) {
    b->size_flags = tag_of(t, b) ^ DEAD_MARK;
}
/* Tell the successor of b that b is now free (or not), and who its predecessor is. */
TRACK_INTERNAL SP_INLINE void block_link_next(block *b, bool b_free) {
    block_next(b)->prev_link = link_to(b, b_free);
}

/* ---- size classes ------------------------------------------------------------------------ */

/* Index of the highest set bit of x (non-zero). Without LZCNT (baseline x86-64) this is bsr,
 * whose destination is also an input (it is left unchanged for x = 0): as the compiler emits
 * it, a bsr waits for whatever last wrote the register it happens to get, which can be a
 * cold header load of the operation before. Zeroing the register first (a dependency-breaking
 * idiom) cuts that false dependency. */
TRACK_INTERNAL SP_INLINE unsigned bit_high(uint64_t x) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    uint64_t r;
    __asm__("xorl %k0, %k0\n\tbsrq %1, %0" : "=&r"(r) : "rm"(x) : "cc");
    return (unsigned)r;
#else
    return 63u - (unsigned)__builtin_clzll(x);
#endif
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
 * its list iff heads[fl][sl] points at it. The lists keep no counts: the number of free
 * blocks and bytes_free are derived (see sp_tlsf.blocks, heap_bytes_free). */

/* Push the free block b onto list (fl, sl), its class. Branch-free: whether the list was
 * empty is a coin toss, so the old head's back link goes to t->scratch when there is none and
 * the bitmap bits are set whether or not they were. */
TRACK_INTERNAL SP_INLINE void list_push(sp_tlsf *t, block *b, unsigned fl, unsigned sl) {
    block *head = t->heads[fl][sl];
    b->next_free = head;
    (head ? head : &t->scratch)->prev_free = b;
    t->heads[fl][sl] = b;
    t->fl_bitmap |= 1u << fl;
    t->sl_bitmap[fl] |= (uint64_t)1 << sl;
}

/* Pop b, the head of list (fl, sl). Reads only b's own links. */
TRACK_INTERNAL SP_INLINE void list_pop(sp_tlsf *t, block *b, unsigned fl, unsigned sl) {
    block *next = b->next_free;
    t->heads[fl][sl] = next;
    /* Branch-free: whether the list empties is a coin toss. */
    uint64_t sl_map = t->sl_bitmap[fl] & ~((uint64_t)(next == NULL) << sl);
    t->sl_bitmap[fl] = sl_map;
    t->fl_bitmap &= ~((uint32_t)(sl_map == 0) << fl);
}

TRACK_INTERNAL SP_INLINE void list_insert(sp_tlsf *t, block *b) {
    unsigned fl, sl;
    mapping_insert(block_size(b), &fl, &sl);
    list_push(t, b, fl, sl);
}

/* Unlink b from list (fl, sl), its class. */
TRACK_INTERNAL SP_INLINE void list_unlink(sp_tlsf *t, block *b, unsigned fl, unsigned sl) {
    if (t->heads[fl][sl] == b) {
        list_pop(t, b, fl, sl);
        return;
    }
    block *prev = b->prev_free, *next = b->next_free;
    prev->next_free = next;
    if (next) next->prev_free = prev;
}

TRACK_INTERNAL SP_INLINE void list_remove(sp_tlsf *t, block *b) {
    unsigned fl, sl;
    mapping_insert(block_size(b), &fl, &sl);
    list_unlink(t, b, fl, sl);
}

/* The listed free block b takes a new size. It changes lists only if its class changes:
 * growing a large free block by a merge often touches no list at all. */
TRACK_INTERNAL SP_INLINE void list_resize(sp_tlsf *t, block *b, size_t size) {
    unsigned fl, sl, nfl, nsl;
    mapping_insert(block_size(b), &fl, &sl);
    mapping_insert(size, &nfl, &nsl);
    if (fl != nfl || sl != nsl) {
        list_unlink(t, b, fl, sl);
        list_push(t, b, nfl, nsl);
    }
    block_set_size(b, size);
}

/* A free block with payload >= size, or NULL; it is the head of list (*fl, *sl). Two bit
 * scans and, if the rounded class is empty, one look at the head of the exact class (so a
 * request as large as the largest free block still succeeds). */
TRACK_INTERNAL SP_INLINE block *list_find(sp_tlsf *t, size_t size, unsigned *fl_out,
                                          unsigned *sl_out) {
    unsigned fl, sl;
    mapping_search(size, &fl, &sl);
    if (SP_LIKELY(fl < FL_COUNT)) {
        uint64_t sl_map = t->sl_bitmap[fl] & (~(uint64_t)0 << sl);
        if (!sl_map) {
            uint32_t fl_map = fl + 1 < 32 ? t->fl_bitmap & (~0u << (fl + 1)) : 0;
            if (fl_map) {
                fl = (unsigned)__builtin_ctz(fl_map);
                sl_map = t->sl_bitmap[fl];
            }
        }
        if (sl_map) {
            *fl_out = fl;
            *sl_out = (unsigned)__builtin_ctzll(sl_map);
            return t->heads[fl][*sl_out];
        }
    }
    mapping_insert(size, &fl, &sl);
    block *b = fl < FL_COUNT ? t->heads[fl][sl] : NULL;
    *fl_out = fl;
    *sl_out = sl;
    return b && block_size(b) >= size ? b : NULL;
}

/* ---- block surgery ------------------------------------------------------------------------- */

/* b is in use (or becoming so) with payload >= want. Cut what lies beyond `want` into a free
 * block if it can hold one, merging it with a free successor, and leave b's successor
 * correctly linked and flagged either way. */
TRACK_INTERNAL static void block_trim_tail(sp_tlsf *t, block *b, size_t want) {
    size_t size = block_size(b);
    if (size - want < MIN_BLOCK) {
        block_link_next(b, false);
        return;
    }
    block *next = block_next(b);
    block_set_size(b, want);
    block *rest = block_next(b);
    size_t rest_size = size - want - HEADER;
    if (block_is_free(next)) {
        list_remove(t, next);
        rest_size += HEADER + block_size(next);
        block_kill(t, next);
    } else {
        t->blocks++;
    }
    block_init(t, rest, link_to(b, false), rest_size, FLAG_FREE);
    block_link_next(rest, true);
    list_insert(t, rest);
}

/* A block of `want` payload bytes has gone to the user. */
TRACK_INTERNAL SP_INLINE void *block_hand_out(sp_tlsf *t, block *a, size_t want) {
    t->bytes_used += want;
    t->live_blocks++;
    track_malloc(block_payload(a), want, 0);
    return block_payload(a);
}

/* Hand the free, unlisted block b to the user with `want` payload bytes. */
TRACK_INTERNAL SP_INLINE void *block_use(sp_tlsf *t, block *b, size_t want) {
    b->size_flags &= ~FLAG_FREE;
    block_trim_tail(t, b, want);
    return block_hand_out(t, b, block_size(b));
}

/* Return the live block b to the free lists, merging with free neighbours. The caller has
 * validated b (block_check_live), which read both headers this starts from. */
TRACK_INTERNAL SP_INLINE void block_release(sp_tlsf *t, block *b) {
    uint64_t sf = b->size_flags;
    size_t size = sf & SIZE_MASK;
    /* The predecessor's header is needed when it is free (a coin toss), and then only after
     * the successor's: ask for its line now, so that the two misses overlap. */
    __builtin_prefetch(block_prev(b), 1);
    block *next = block_next(b);
    uint64_t next_sf = next->size_flags;
    if (t->bytes_used > t->high_water) t->high_water = t->bytes_used;
    t->bytes_used -= size;
    t->live_blocks--;
    track_free(block_payload(b), size);
    if (next_sf & FLAG_FREE) {
        size_t next_size = next_sf & SIZE_MASK;
        list_remove(t, next);
        block_kill(t, next);
        t->blocks--;
        size += HEADER + next_size;
        next = (block *)((char *)next + HEADER + next_size);
    }
    if (block_prev_is_free(b)) {
        block *prev = block_prev(b);
        block_kill(t, b);
        t->blocks--;
        b = prev;
        list_resize(t, b, block_size(b) + HEADER + size);
    } else {
        b->size_flags = (sf & ~SIZE_MASK) | size | FLAG_FREE;
        list_insert(t, b);
    }
    next->prev_link = link_to(b, true);
}

/* ---- validation of caller pointers ----------------------------------------------------------
 * O(pools) + two header reads, in every build. The header must carry this heap's tag for its
 * address and its successor must point back at it: an interior pointer into user data passes
 * both only by a 2^-16 chance times an exact pointer match. */

typedef struct verdict {
    sp_result id;
    const char *why;
    block *b;
} verdict;

/* Lock-free: a pool entry is written before pool_count is raised (release), and never changes
 * afterwards, so a reader that sees the count (acquire) sees complete entries. */
TRACK_INTERNAL static const pool_range *pool_search(const sp_tlsf *t, uintptr_t a) {
    size_t n = __atomic_load_n(&t->pool_count, __ATOMIC_ACQUIRE);
    for (size_t i = 0; i < n; i++)
        if (a >= t->pools[i].lo && a < t->pools[i].hi) return &t->pools[i];
    return NULL;
}

/* The pool holding p, or NULL. The first pool is tried inline: it is written by
 * sp_tlsf_create, before anyone can see the heap, and is empty ({0, 0}) only for a heap
 * that was never created. */
TRACK_INTERNAL SP_INLINE const pool_range *pool_of(const sp_tlsf *t, const void *p) {
    uintptr_t a = (uintptr_t)p;
    if (SP_LIKELY(a - t->pools[0].lo < t->pools[0].hi - t->pools[0].lo)) return &t->pools[0];
    return pool_search(t, a);
}

TRACK_INTERNAL SP_INLINE verdict block_check_live(const sp_tlsf *t, const void *p) {
    verdict v = {SP_OK, NULL, NULL};
    const pool_range *pool = pool_of(t, p);
    uintptr_t a = (uintptr_t)p;
    if (!pool) return (verdict){SP_ERR_FOREIGN_POINTER, "pointer is not inside this heap", NULL};
    if ((a & (ALIGN - 1)) || a < pool->lo + HEADER || a + HEADER > pool->hi)
        return (verdict){SP_ERR_INVALID_POINTER, "misaligned pointer: not a block start", NULL};
    block *b = block_of(p);
    uint64_t sf = b->size_flags, tag = tag_of(t, b);
    track_value_defined(&sf, sizeof sf); /* for a bad pointer this is user data */
    if ((sf & TAG_MASK) != tag) {
        if (sf == (tag ^ DEAD_MARK))
            return (verdict){SP_ERR_DOUBLE_FREE, "block was already freed (and merged)", NULL};
        return (verdict){SP_ERR_INVALID_POINTER, "not the start of a block (interior pointer?)",
                         NULL};
    }
    if (sf & FLAG_FREE) return (verdict){SP_ERR_DOUBLE_FREE, "block is already free", NULL};
    size_t size = sf & SIZE_MASK;
    if (size > pool->hi - a - HEADER || block_next(b)->prev_link != link_to(b, false))
        return (verdict){SP_ERR_INVALID_POINTER, "header does not match its neighbour", NULL};
    v.b = b;
    return v;
}

/* ---- locking ------------------------------------------------------------------------------- */

TRACK_INTERNAL SP_INLINE void heap_lock(sp_tlsf *t) {
    if (t->locked) sp_mutex_lock(&t->lock);
    track_enter();
}
TRACK_INTERNAL SP_INLINE void heap_unlock(sp_tlsf *t) {
    track_leave();
    if (t->locked) sp_mutex_unlock(&t->lock);
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

/* Whether [memory, memory + size), or memory rounded up to ALIGN, wraps around the address
 * space (a range that is merely too small for its rounding does not: the callers refuse that
 * as too small). */
static bool range_wraps(const void *memory, size_t size) {
    uintptr_t m = (uintptr_t)memory;
    return m + size < m || sp_align_up(m, ALIGN) < m;
}

TRACK_INTERNAL static pool_verdict pool_add(sp_tlsf *t, void *memory, size_t size) {
    if (!memory) return (pool_verdict){SP_ERR_INVALID_ARG, "NULL pool memory"};
    if (range_wraps(memory, size)) return (pool_verdict){SP_ERR_OVERFLOW, "pool wraps around"};
    uintptr_t lo = sp_align_up((uintptr_t)memory, ALIGN);
    uintptr_t hi = sp_align_down((uintptr_t)memory + size, ALIGN);
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
    block_init(t, first, link_to(NULL, false), payload, FLAG_FREE);
    block *sentinel = block_next(first);
    block_init(t, sentinel, link_to(first, true), 0, 0);
    list_insert(t, first);
    t->blocks++;
    t->pools[t->pool_count] = (pool_range){lo, hi};
    __atomic_store_n(&t->pool_count, t->pool_count + 1, __ATOMIC_RELEASE);
    t->bytes_total += hi - lo;
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
    if (range_wraps(desc->memory, desc->size)) {
        /* Checked before the control structure is written there. */
        r = sp_misuse(SP_ERR_OVERFLOW, "sp_tlsf_create", desc->memory,
                      "memory + %zu wraps around the address space", desc->size);
        goto out;
    }
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

/* ---- allocation ---------------------------------------------------------------------------- */

/* Carve `want` bytes off the end of b, the head of list (fl, sl), which has room for them and
 * a minimal free block. b keeps its header and, if its class does not change, its place in its
 * list; the new block's successor learns its new predecessor. */
TRACK_INTERNAL SP_INLINE void *block_carve_tail(sp_tlsf *t, block *b, unsigned fl, unsigned sl,
                                                size_t want) {
    size_t rest = block_size(b) - want - HEADER;
    unsigned rfl, rsl;
    mapping_insert(rest, &rfl, &rsl);
    if (rfl != fl || rsl != sl) {
        list_pop(t, b, fl, sl);
        list_push(t, b, rfl, rsl);
    }
    block_set_size(b, rest);
    block *a = block_next(b);
    t->blocks++;
    block_init(t, a, link_to(b, true), want, 0);
    block_link_next(a, false);
    return block_hand_out(t, a, want);
}

/* Hand out all of b, the head of list (fl, sl), which is too small to split. Its successor
 * already points back at it. */
TRACK_INTERNAL SP_INLINE void *block_take(sp_tlsf *t, block *b, unsigned fl, unsigned sl) {
    list_pop(t, b, fl, sl);
    b->size_flags &= ~FLAG_FREE;
    size_t size = block_size(b);
    block_link_next(b, false);
    return block_hand_out(t, b, size);
}

TRACK_INTERNAL SP_INLINE void *heap_malloc(sp_tlsf *t, size_t size) {
    if (SP_UNLIKELY(size > SP_TLSF_MAX_BLOCK)) return NULL;
    size_t want = adjust_size(size);
    heap_lock(t);
    void *p = NULL;
    unsigned fl, sl;
    block *b = list_find(t, want, &fl, &sl);
    if (SP_LIKELY(b)) {
        if (block_size(b) - want >= MIN_BLOCK)
            p = block_carve_tail(t, b, fl, sl, want);
        else
            p = block_take(t, b, fl, sl);
    }
    heap_unlock(t);
    return p;
}

/* Lock t if it is live. A NULL t, and a heap sp_tlsf_destroy left behind (its control
 * structure zeroed; a live heap always has bytes_total >= the control's size) while the caller
 * has not reused that memory, are refused under `call`, reported with the lock released, and
 * false is returned with t unlocked. */
static bool heap_lock_live(sp_tlsf *t, const char *call) {
    if (SP_NULL_ARG(t, call, NULL, "heap")) return false;
    heap_lock(t); /* bytes_total grows with add_pool, under the lock */
    if (SP_LIKELY(t->bytes_total != 0)) return true;
    heap_unlock(t);
    sp_misuse(SP_ERR_INVALID_ARG, call, t, "heap %p was destroyed", (const void *)t);
    return false;
}

/* An allocation of `call` failed: a destroyed heap is reported (checked on this path only). */
static SP_COLD void alloc_failed(sp_tlsf *t, const char *call) {
    if (heap_lock_live(t, call)) heap_unlock(t);
}

/* malloc under `call` (sp_tlsf_malloc, realloc(NULL, n)): a NULL or destroyed heap reported. */
TRACK_INTERNAL static void *malloc_reported(sp_tlsf *t, size_t size, const char *call) {
    if (SP_NULL_ARG(t, call, NULL, "heap")) return NULL;
    void *p = heap_malloc(t, size);
    if (SP_UNLIKELY(!p)) alloc_failed(t, call);
    return p;
}

sp_result sp_tlsf_add_pool(sp_tlsf *t, void *memory, size_t size) {
    if (!heap_lock_live(t, "sp_tlsf_add_pool")) return SP_ERR_INVALID_ARG;
    pool_verdict v = pool_add(t, memory, size);
    heap_unlock(t);
    return v.id == SP_OK ? SP_OK : pool_report(v, "sp_tlsf_add_pool", memory, size);
}

TRACK_INTERNAL void *sp_tlsf_malloc(sp_tlsf *t, size_t size) {
    return malloc_reported(t, size, "sp_tlsf_malloc");
}

/* align: a power of two up to MAX_ALIGN. */
TRACK_INTERNAL static void *aligned_alloc_any(sp_tlsf *t, size_t align, size_t size) {
    if (align <= ALIGN) return heap_malloc(t, size);
    if (size > SP_TLSF_MAX_BLOCK - align - MIN_BLOCK) return NULL;
    size_t want = adjust_size(size);
    /* Room for the worst gap in front: a gap is either 0 or a whole free block (>= MIN_BLOCK). */
    size_t search = want + align + MIN_BLOCK;
    heap_lock(t);
    void *p = NULL;
    unsigned fl, sl;
    block *b = list_find(t, search, &fl, &sl);
    if (b) {
        list_pop(t, b, fl, sl);
        uintptr_t start = (uintptr_t)block_payload(b);
        uintptr_t at = sp_align_up(start, align);
        if (at != start && at - start < MIN_BLOCK) at = sp_align_up(start + MIN_BLOCK, align);
        if (at != start) {
            /* Split the gap off as a free block; b's predecessor is in use (b was free). */
            size_t gap = at - start, total = block_size(b);
            block *aligned = block_of((void *)at);
            block_set_size(b, gap - HEADER);
            block_init(t, aligned, link_to(b, true), total - gap, 0);
            list_insert(t, b);
            t->blocks++;
            block_link_next(b, true);
            b = aligned;
        }
        p = block_use(t, b, want);
    }
    heap_unlock(t);
    return p;
}

TRACK_INTERNAL void *sp_tlsf_aligned_alloc(sp_tlsf *t, size_t align, size_t size) {
    if (SP_NULL_ARG(t, "sp_tlsf_aligned_alloc", NULL, "heap")) return NULL;
    if (!sp_is_pow2(align) || align > MAX_ALIGN) { /* one report, not also a failed alloc's */
        sp_misuse(SP_ERR_BAD_ALIGNMENT, "sp_tlsf_aligned_alloc", (void *)align,
                  "alignment %zu is not a power of two up to %zu", align, MAX_ALIGN);
        return NULL;
    }
    void *p = aligned_alloc_any(t, align, size);
    if (SP_UNLIKELY(!p)) alloc_failed(t, "sp_tlsf_aligned_alloc");
    return p;
}

TRACK_INTERNAL void sp_tlsf_free(sp_tlsf *t, void *p) {
    if (!p || SP_NULL_ARG(t, "sp_tlsf_free", NULL, "heap")) return;
    heap_lock(t);
    verdict v = block_check_live(t, p);
    if (SP_LIKELY(v.b)) block_release(t, v.b);
    heap_unlock(t);
    if (SP_UNLIKELY(!v.b)) report(t, "sp_tlsf_free", p, v);
}

/* Resize b in place to `want` payload bytes if it can be done without moving. */
TRACK_INTERNAL static bool block_resize_in_place(sp_tlsf *t, block *b, size_t want) {
    size_t old = block_size(b);
    if (want > old) {
        block *next = block_next(b);
        if (!block_is_free(next) || old + HEADER + block_size(next) < want) return false;
        list_remove(t, next);
        block_set_size(b, old + HEADER + block_size(next));
        block_kill(t, next);
        t->blocks--;
    }
    block_trim_tail(t, b, want);
    size_t now = block_size(b);
    if (t->bytes_used > t->high_water) t->high_water = t->bytes_used;
    t->bytes_used = t->bytes_used - old + now;
    track_resize(block_payload(b), old, now);
    return true;
}

TRACK_INTERNAL void *sp_tlsf_realloc(sp_tlsf *t, void *p, size_t size) {
    if (!p) return malloc_reported(t, size, "sp_tlsf_realloc");
    if (SP_NULL_ARG(t, "sp_tlsf_realloc", NULL, "heap")) return NULL;
    heap_lock(t);
    verdict v = block_check_live(t, p);
    size_t old = v.b ? block_size(v.b) : 0;
    bool done = false;
    if (v.b && size == 0)
        block_release(t, v.b); /* realloc(p, 0) frees p, returns NULL */
    else if (v.b && size <= SP_TLSF_MAX_BLOCK)
        done = block_resize_in_place(t, v.b, adjust_size(size));
    heap_unlock(t);
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
    if (!p || SP_NULL_ARG(t, "sp_tlsf_usable_size", NULL, "heap")) return 0;
    heap_lock(t);
    verdict v = block_check_live(t, p);
    size_t size = v.b ? block_size(v.b) : 0;
    heap_unlock(t);
    if (!v.b) report(t, "sp_tlsf_usable_size", p, v);
    return size;
}

TRACK_INTERNAL sp_result sp_tlsf_check_ptr(sp_tlsf *t, const void *p, const char **why) {
    if (SP_UNLIKELY(!t)) { /* not reported, as nothing here is */
        if (why) *why = "NULL heap";
        return SP_ERR_INVALID_ARG;
    }
    heap_lock(t);
    verdict v = block_check_live(t, p);
    heap_unlock(t);
    if (why) *why = v.why;
    return v.id;
}

bool sp_tlsf_owns(const sp_tlsf *t, const void *p) {
    return t && pool_of(t, p) != NULL;
}

/* ---- status, walk, check ------------------------------------------------------------------- */

/* Payload bytes of free blocks. The pools hold nothing but blocks (a header and a payload
 * each) and one sentinel header each, so this is what the headers and live payloads leave. */
TRACK_INTERNAL static size_t heap_bytes_free(const sp_tlsf *t) {
    size_t pooled = t->bytes_total - sp_tlsf_control_size();
    size_t headers = HEADER * (t->blocks + t->pool_count);
    return pooled - headers - t->bytes_used;
}

TRACK_INTERNAL void sp_tlsf_status_get(sp_tlsf *t, sp_tlsf_status *out) {
    if (SP_NULL_ARG(out, "sp_tlsf_status_get", NULL, "out")) return;
    memset(out, 0, sizeof *out); /* zeros stand for a NULL or destroyed heap */
    if (SP_UNLIKELY(!heap_lock_live(t, "sp_tlsf_status_get"))) return;
    size_t bytes_free = heap_bytes_free(t);
    size_t largest = 0;
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
        .free_blocks = t->blocks - t->live_blocks,
        .high_water = t->bytes_used > t->high_water ? t->bytes_used : t->high_water,
        .fragmentation = bytes_free ? 1.0 - (double)largest / (double)bytes_free : 0.0,
        .pool_count = t->pool_count,
    };
    heap_unlock(t);
}

TRACK_INTERNAL void sp_tlsf_walk(sp_tlsf *t, sp_tlsf_walker fn, void *user) {
    if (SP_NULL_ARG(fn, "sp_tlsf_walk", NULL, "walker") ||
        SP_UNLIKELY(!heap_lock_live(t, "sp_tlsf_walk")))
        return;
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
    heap_unlock(t);
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
    if (SP_UNLIKELY(!heap_lock_live(t, "sp_tlsf_check"))) return SP_ERR_INVALID_ARG;
    for (size_t i = 0; i < t->pool_count; i++) {
        block *end = (block *)(t->pools[i].hi - HEADER), *prev = NULL, *b;
        bool prev_free = false;
        for (b = (block *)t->pools[i].lo; b < end; b = block_next(b)) {
            CHECK((b->size_flags & TAG_MASK) == tag_of(t, b), b, "header tag is wrong");
            CHECK(block_prev(b) == prev, b, "prev_link does not point at the previous block");
            CHECK(block_prev_is_free(b) == prev_free, b, "FLAG_PREV_FREE disagrees with neighbour");
            CHECK(!(b->size_flags & (ALIGN - 1) & ~FLAG_FREE), b, "stray flag in the size word");
            CHECK(!(b->prev_link & (ALIGN - 1) & ~FLAG_PREV_FREE), b, "stray flag in prev_link");
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
    }
    size_t listed = 0;
    for (unsigned fl = 0; fl < FL_COUNT; fl++) {
        CHECK(!!(t->fl_bitmap & (1u << fl)) == !!t->sl_bitmap[fl], &t->sl_bitmap[fl],
              "first-level bitmap bit %u disagrees with second level", fl);
        for (unsigned sl = 0; sl < SL_COUNT; sl++) {
            block *head = t->heads[fl][sl];
            CHECK(!!(t->sl_bitmap[fl] & ((uint64_t)1 << sl)) == !!head, &t->heads[fl][sl],
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
    CHECK(free_bytes == heap_bytes_free(t) && free_count == t->blocks - t->live_blocks, t,
          "free counters drifted");
    heap_unlock(t);
    return SP_OK;
fail:
    heap_unlock(t);
    sp_log(SP_LOG_ERROR, SP_ERR_CORRUPT, "sp_tlsf_check", bad, "%s", why);
    return SP_ERR_CORRUPT;
}
