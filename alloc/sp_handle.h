/* spindle handle heap: movable blocks named by handles, compacted between frames.
 *
 * Objects that live across frames but may move (level data, streaming assets, components).
 * Callers keep a 32-bit handle (slot index + generation), never a raw pointer across a frame:
 * resolve gives a pointer valid until the next compaction step, pin one valid until the
 * matching unpin. sp_handle_compact slides and packs unpinned blocks toward the start of the
 * heap within a time budget and resumes where it stopped on the next call; pinned blocks stay
 * where they are and compaction flows around them.
 *
 * Handles. id = generation << index_bits | slot index,
 * index_bits = max(6, ceil(log2(max_handles)));
 * the generation takes the remaining bits and starts at 1, so id 0 is never valid. Freeing
 * bumps the slot's generation; a slot whose generation would wrap is retired for good (never
 * reused), so every stale handle is detected forever. Freed slots are reused first in, first
 * out, which spreads generations over all slots: with the default 2^20 handles (12 generation
 * bits) a slot is retired after 4,095 uses. 32 bits suffice: the table is the bound.
 *
 * Layout. One contiguous committed range growing at the top: every block (live or free) has a
 * 16-byte header (size, predecessor's size, owning handle id, pin count); free holes sit in
 * size-segregated lists (exact below 256 B, then 8 lists per doubling; a bitmap finds a good
 * fit in O(1)); allocation takes a hole first, else extends the top (committing 16 KiB
 * steps). Live blocks aligned to at most 16 are also indexed by size (slot-linked lists):
 * compaction's source of blocks that fit a hole. Freeing coalesces with free neighbours at once; a
 * hole reaching the top lowers it. Compaction (see sp_handle_compact) moves blocks down; afterwards
 * surplus committed memory above the top is decommitted with hysteresis, so memory tracks live
 * bytes.
 *
 * Lifecycle: sp_handle_heap_create, then any calls, then sp_handle_heap_destroy. Independent
 * of sp_init (alloc/ never calls the runtime); the runtime registers compaction as work
 * between frames and supplies the QSBR retire.
 *
 * Concurrency:
 *   sp_handle_resolve                      any thread, concurrently with everything but
 *                                          compaction (which moves blocks); no lock, loads only
 *   sp_handle_alloc, alloc_ex, free, pin,  any thread, concurrently with each other and with
 *   unpin, size                            resolve; one internal lock (sp_mutex) held for the
 *                                          free-list and slot update (and table growth), and
 *                                          by pin/unpin for the pin count (so a pin and a free
 *                                          of the same handle are ordered: the pin sees the
 *                                          handle dead, or the free sees the pin)
 *   sp_handle_heap_status_get, _check      any thread; take the lock; exact (but
 *                                          largest_free: see sp_handle_heap_status)
 *   sp_handle_compact                      one call at a time, between frames (the caller
 *                                          guarantees no resolve or resolved pointer is in
 *                                          use elsewhere); holds the lock for the whole call,
 *                                          so other threads' alloc, free, pin, unpin, size and
 *                                          status wait for it. desc.may_compact is asked
 *                                          first and a "no" refuses the call (SP_ERR_BUSY)
 *   sp_handle_heap_create / destroy        alone
 * Handle-table growth (alloc, under the lock) copies the table, publishes the copy with a
 * release store and hands the old one to desc.retire: a reader that loaded the old table
 * pointer may use it until it passes a quiescent state (liburcu QSBR: job boundaries, frame
 * end). Pin counts live in block headers, not in the table, so no pin is lost to a copy.
 *
 * A handle names a slot and a generation of the heap that issued it, not the heap: another
 * heap (or this one, destroyed and made again) may have a live block with the same id, and a
 * handle used with the wrong heap reaches that block (every heap's first handles have the same
 * ids). Keep a handle with its heap.
 *
 * Bad input (every build): a stale or forged handle gives NULL from resolve/pin/size 0, and
 * free/unpin report it through the logger (sp_misuse) with SP_ERR_STALE_HANDLE (the handle's
 * own generation freed once more: SP_ERR_DOUBLE_FREE). Unpin of an unpinned handle:
 * SP_ERR_NOT_PINNED. Free of a pinned block: refused with SP_ERR_PINNED, the block stays live
 * and pinned. A pin of a block already pinned 2^32 - 1 times (the count would wrap, and a free
 * would then see it unpinned): refused with SP_ERR_LIMIT. Compaction while desc.may_compact
 * says no, from a relocation callback, or any alloc/free/check/destroy during compaction:
 * SP_ERR_BUSY. In debug builds (misuse fatal) each of these aborts naming the call and the
 * handle; in release the call returns the failure value and changes nothing. Resolve itself
 * never logs (it is the hot path): it just returns NULL.
 *
 * A NULL heap (sp_handles() before sp_init, say), every build: alloc, alloc_ex, free, unpin,
 * compact and check report SP_ERR_INVALID_ARG (misuse, as above) and return {0} /
 * SP_ERR_INVALID_ARG; resolve, pin and size answer as for a stale handle (NULL, NULL, 0; not
 * logged); status_get fills zeros; destroy ignores it; free of {0} stays a no-op (SP_OK).
 *
 * Sanitizers (alloc/track.h): headers and holes are poisoned; a moved block's old bytes that
 * no live block now covers are poisoned, so a pointer kept across compaction faults under
 * ASan/Valgrind at its first use (old bytes that another block moved onto cannot be told).
 */
#ifndef SP_HANDLE_H
#define SP_HANDLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_log.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sp_handle {
    uint32_t id; /* slot index | generation << index_bits; 0 is never valid */
} sp_handle;

typedef struct sp_handle_heap sp_handle_heap;

/* Called by compaction after the block of `h` moved from old_ptr to new_ptr (its bytes are
 * already at new_ptr; old_ptr must not be dereferenced). Runs on the compacting thread. May
 * call resolve, pin, unpin, size and status_get; alloc, free, compact, check and destroy are
 * refused (SP_ERR_BUSY). */
typedef void (*sp_handle_relocate_fn)(void *user, sp_handle h, void *new_ptr, void *old_ptr);

/* A handle heap's region is below this (a slot keeps the payload's offset in 32 bits of
 * 16-byte units). */
#define SP_HANDLE_REGION_LIMIT ((size_t)64 << 30)

/* Zero means the default for every field. */
typedef struct sp_handle_heap_desc {
    void *region;         /* reserved address range (PROT_NONE is fine: the heap commits as it
                             grows), page-aligned; NULL: the heap reserves its own */
    size_t region_size;   /* bytes of region (below SP_HANDLE_REGION_LIMIT, 64 GiB); 0 with
                             region NULL: 1 GiB */
    uint32_t max_handles; /* live + retired slots, at most 2^24 (8 generation bits remain);
                             0: 2^20 */
    /* Retiring an old handle table after growth: retire(user, old, free_fn) must call
     * free_fn(old) once no reader can still hold it (the runtime passes sp_retire: a liburcu
     * QSBR grace period). NULL: old tables are kept until destroy; the table doubles, so they
     * add up to less than the final table. Called under the heap lock: must neither call the
     * heap nor wait (for a grace period, say). */
    void (*retire)(void *user, void *old, void (*free_fn)(void *));
    void *retire_user;
    /* Asked at the start of every compaction call; false refuses it with SP_ERR_BUSY (the
     * runtime answers false while a frame's jobs may run). NULL: always allowed (the caller
     * guarantees no concurrent call). */
    bool (*may_compact)(void *user);
    void *may_compact_user;
    const char *name; /* for messages; may be NULL */
} sp_handle_heap_desc;

typedef struct sp_handle_compact_stats {
    uint64_t bytes_moved;  /* this call */
    uint64_t blocks_moved; /* this call */
    uint64_t ns;           /* time spent in this call */
    bool caught_up;        /* the pass ended: no hole left below the top that it could close
                              (holes kept by pinned blocks, and at the very bottom below an
                              aligned block, do not count) */
} sp_handle_compact_stats;

typedef struct sp_handle_heap_status {
    size_t live_bytes;        /* sum of the sizes asked for by live allocations */
    size_t live_handles;      /* live allocations */
    size_t needed_bytes;      /* what live blocks need here: a 16-byte header each plus the
                                 size rounded up to 16, at least 32 bytes a block (the floor
                                 for used_bytes) */
    size_t used_bytes;        /* start of heap to top: live blocks, headers, holes */
    size_t hole_bytes;        /* free blocks below the top (headers included) */
    size_t free_bytes;        /* hole_bytes + committed bytes above the top */
    size_t largest_free;      /* largest hole or the committed space above the top; where
                                 more than 64 holes share the largest hole's size class (8
                                 per doubling), the largest of the 64 put in that class
                                 last, above 8/9 of the largest hole (status stays
                                 bounded) */
    size_t committed_bytes;   /* memory the heap holds from the OS (the region's committed part) */
    size_t table_bytes;       /* the handle table and its side array (retired tables excluded) */
    double fragmentation;     /* 1 - largest_free / free_bytes; 0 when nothing is free */
    uint64_t moved_last;      /* bytes moved by the last compaction call */
    uint64_t moved_total;     /* bytes moved by compaction since create */
    uint64_t allocated_total; /* bytes asked for by the allocations made since create (a flow:
                                 frees take nothing off) */
    uint64_t compact_ns_last; /* time spent in the last compaction call */
    uint32_t table_capacity;  /* slots in the current table */
    uint32_t retired_slots;   /* slots whose generations ran out */
    bool caught_up;           /* as the last compaction call reported, and nothing freed since */
} sp_handle_heap_status;

/* Create a heap. Main thread (or any single thread). Cost: a reservation (if region is NULL),
 * a small table. Returns NULL and *err (if non-NULL): SP_ERR_INVALID_ARG (misuse, logged:
 * region not page-aligned, region_size too small or >= 64 GiB, max_handles above 2^24),
 * SP_ERR_OS (reservation refused), SP_ERR_NOMEM. */
sp_handle_heap *sp_handle_heap_create(const sp_handle_heap_desc *desc, sp_result *err);

/* Free everything: tables (retired ones kept here too), committed memory, and the reservation
 * if the heap made it. Live handles die silently (status first if you want to check). NULL is
 * ignored. Alone; from a relocation callback it is refused (misuse SP_ERR_BUSY, nothing
 * freed), and so is the runtime's own heap, sp_handles() (misuse SP_ERR_INVALID_ARG:
 * sp_shutdown destroys it). */
void sp_handle_heap_destroy(sp_handle_heap *h);

/* Allocate `size` bytes aligned to `align` (a power of two; 0 means 16). Any thread; takes the
 * heap lock. Cost: O(1) (free-list bitmaps) plus a commit system call when the top grows past
 * committed memory, plus a table copy when the table doubles. Returns {0} when out of memory or
 * handles (SP_ERR_NOMEM/SP_ERR_LIMIT, logged at warn), for an alignment that is not a power of
 * two or above 4096 (misuse SP_ERR_BAD_ALIGNMENT), or during compaction (misuse SP_ERR_BUSY).
 * size 0 allocates a minimal block. */
sp_handle sp_handle_alloc(sp_handle_heap *h, size_t size, size_t align);

/* As sp_handle_alloc, and `fn(user, handle, new, old)` is called after each move of the block. */
sp_handle sp_handle_alloc_ex(sp_handle_heap *h, size_t size, size_t align, sp_handle_relocate_fn fn,
                             void *user);

/* Free the block. Any thread; takes the heap lock. O(1). Returns SP_OK; SP_ERR_STALE_HANDLE /
 * SP_ERR_DOUBLE_FREE / SP_ERR_PINNED / SP_ERR_BUSY (misuse, see the top; nothing changes).
 * The null handle {0} is a no-op (SP_OK). */
sp_result sp_handle_free(sp_handle_heap *h, sp_handle x);

/* Pin: the pointer stays valid until the matching unpin (pins nest: n pins need n unpins).
 * Any thread; takes the heap lock (it waits for a compaction step in progress). NULL for a
 * stale or forged handle, or one freed meanwhile, or a NULL heap (not logged); NULL and misuse
 * SP_ERR_LIMIT when the block holds 2^32 - 1 pins already (the count stays; an unpin missing,
 * surely). From a relocation callback it does not lock (the compacting thread holds the
 * lock). */
void *sp_handle_pin(sp_handle_heap *h, sp_handle x);

/* Drop one pin. Any thread; takes the heap lock (as pin). SP_OK; SP_ERR_STALE_HANDLE or
 * SP_ERR_NOT_PINNED (misuse; nothing changes). */
sp_result sp_handle_unpin(sp_handle_heap *h, sp_handle x);

/* Bytes asked for at allocation; 0 for a stale or forged handle or a NULL heap. Any thread;
 * takes the lock (the size lives beside the table, which only the lock holder may read while
 * it grows). */
size_t sp_handle_size(sp_handle_heap *h, sp_handle x);

/* Compact for at most about budget_ns (0: until caught up). Between frames only (see the
 * concurrency table). Each call resumes where the previous one stopped: it walks from the
 * lowest hole upward and closes each hole by, in this order:
 *   1. sliding the run of blocks above it down over it, when that run is short (at most 4x
 *      the hole + 4 KiB) and ends at another hole or the top (the holes merge);
 *   2. moving the run of blocks at the top of the heap into it, when that run fits;
 *   3. moving into it the block that fits best among the 256 nearest the top, else the best
 *      one of a size index of all live blocks above it (up to 64 candidates per size class,
 *      256 in all); its old place becomes a hole that the pass reaches later;
 *   4. a hole of at most 64 bytes that no block above fits becomes slack of the block below
 *      it (nothing moves; the slack is dropped when that block moves or is freed);
 *   5. when every block above is larger (sizes stratify as small blocks get pulled down):
 *      moving the block right above it to the top, so that the hole and that block's place
 *      merge, and moving into the merged hole a block from above that needs more (the hole
 *      left over is smaller than before);
 *   6. else sliding the run above it (up to 64 KiB or 256 blocks per memmove stretch), which
 *      moves the hole up until it merges with the next hole or the top.
 * Moved blocks are packed (their slack dropped). Pinned blocks never move: a hole right below
 * a pinned block that nothing fits is left (alloc reuses it). Blocks aligned above 16 move
 * only by multiples of their alignment: the pad before them, or a whole hole smaller than that
 * pad that nothing fits, becomes slack of the block below (a hole at the very bottom is left).
 * A pass ends at the top, whatever the calls it took, after going back to the lowest hole it
 * left (again while that walk moved anything, at most 4 times a pass); a call after it walks
 * nothing until a hole appears (a free) or something may let a left hole close (a block's last
 * unpin, a block taken at the top, the top lowered): caught up. With pins, a fresh walk may
 * still find a little to move that the pass did not. Relocation callbacks run after each move.
 * Budget: the clock (sp_ticks) is read before every hole and every move; a move whose
 * estimated duration (the bandwidth measured so far, taken at 80%, with 5% of the budget
 * kept for the searches) would overrun the budget is not started, except the first move of a
 * call (every call makes progress: that move is at most 64 KiB or one larger block, and in
 * step 5 its two blocks).
 * Afterwards committed memory more than max(16 KiB, used/64) above the top is decommitted
 * down to used/128: 2 MiB at a time while the budget's rest covers that at 25 bytes per ns
 * plus 20 us of system calls (28-36 bytes per ns were measured for pages in use); after a
 * finished pass also a last smaller piece the rest covers, or at least 16 KiB (over the budget
 * if need be); all of it at once without a budget.
 * Cost: step 1 moves at most 4x the hole + 4 KiB, steps 2-4 at most the hole's size, step 5
 * two blocks larger than the hole; step 6 moves everything up to the
 * next hole, up to the heap's size per call when small holes sit below only larger blocks.
 * Returns SP_OK (out, if non-NULL, filled); SP_ERR_BUSY (misuse: may_compact said no, or
 * called from a relocation callback; nothing changes). */
sp_result sp_handle_compact(sp_handle_heap *h, uint64_t budget_ns, sp_handle_compact_stats *out);

/* Figures (see sp_handle_heap_status). Any thread; takes the lock. O(1): at most 64 holes
 * read (largest_free). A NULL heap: zeros. A NULL out: misuse SP_ERR_INVALID_ARG, nothing written.
 */
void sp_handle_heap_status_get(sp_handle_heap *h, sp_handle_heap_status *out);

/* Validate every invariant: headers chain from the bottom to the top with matching sizes, no
 * two holes touch, the top block is live, each hole is in the list of its class, hole and live
 * totals match the counters, every live block's slot points at it and every live slot at a
 * live block. Reports the first violation through the logger (SP_ERR_CORRUPT, with its
 * address) and returns it; SP_OK when sound. Takes the lock; not during compaction (from a
 * relocation callback: misuse SP_ERR_BUSY). A NULL heap: misuse SP_ERR_INVALID_ARG. O(blocks +
 * slots). */
sp_result sp_handle_heap_check(sp_handle_heap *h);

/* ---- inline fast path; the layout below is internal, read only by sp_handle_resolve ---- */

typedef struct sp_handle_slot {
    /* low 32 bits: the live handle's id (a free or retired slot holds an id whose index part
     * differs from the slot's own, which no handle for this slot can equal); high 32 bits:
     * the payload's offset from the table's base in 16-byte units (regions are < 64 GiB) */
    uint64_t word;
} sp_handle_slot;

typedef struct sp_handle_table {
    uint32_t mask;                        /* capacity - 1 (capacity is a power of two) */
    uint32_t capacity;                    /* slots */
    char *base;                           /* the heap's region */
    struct sp_handle_table *retired_next; /* retired tables kept until destroy (retire NULL) */
    sp_handle_slot slots[];
} sp_handle_table;

typedef struct sp_handle_heap_head {
    sp_handle_table *table; /* published with a release store on growth */
} sp_handle_heap_head;

/* The block's current address, or NULL for a stale or forged handle (or {0}) or a NULL heap.
 * Valid until the next compaction step. Any thread, concurrently with everything but
 * compaction. Cost: a NULL test (predicted not taken), four loads (table pointer with acquire,
 * mask and base on one line, the 8-byte slot), a compare, a shift and an add; no lock, no
 * read-modify-write, no logging. A slot index beyond the table maps to a slot whose id cannot
 * match. */
static inline void *sp_handle_resolve(sp_handle_heap *h, sp_handle x) {
    if (__builtin_expect(h == NULL, 0)) return NULL;
    const sp_handle_table *t =
        __atomic_load_n(&((const sp_handle_heap_head *)(const void *)h)->table, __ATOMIC_ACQUIRE);
    uint64_t w = __atomic_load_n(&t->slots[x.id & t->mask].word, __ATOMIC_RELAXED);
    if (__builtin_expect((uint32_t)w != x.id, 0)) return NULL;
    return t->base + ((w >> 32) << 4);
}

#ifdef __cplusplus
}
#endif
#endif
