/* spindle central heap: a two-level segregated fit (TLSF) allocator.
 *
 * O(1) malloc, free, realloc, aligned allocation and status over memory the caller provides
 * (a buffer, or a reservation from sp_vm_reserve), with immediate coalescing. No operation
 * has a loop whose length depends on heap size or block count. Default alignment 16 bytes;
 * every block carries a 16-byte header.
 *
 * Lifecycle: sp_tlsf_create places the control structure at the start of the memory it is
 * given and turns the rest into the first pool; sp_tlsf_add_pool adds more (up to
 * SP_TLSF_MAX_POOLS). sp_tlsf_destroy forgets the heap; the memory stays the caller's. While the
 * caller leaves that memory as destroy left it, calls through the dead handle are refused:
 * malloc, aligned_alloc and realloc(NULL, n) NULL, status zeros, add_pool, check and walk
 * SP_ERR_INVALID_ARG (each reported as misuse), free and the other pointer calls
 * SP_ERR_FOREIGN_POINTER; once the memory is reused, undefined. A NULL heap, status out or
 * walker is misuse (SP_ERR_INVALID_ARG, reported): allocations NULL, status zeros, add_pool
 * and check SP_ERR_INVALID_ARG, free and walk do nothing, usable_size 0; check_ptr returns
 * SP_ERR_INVALID_ARG and reports nothing; sp_tlsf_destroy(NULL) returns 0 and
 * sp_tlsf_owns(NULL, p) false.
 *
 * Concurrency:
 *   heap created with desc.locked = false:  one thread at a time (caller provides exclusion).
 *   heap created with desc.locked = true:   every call may run concurrently with any other;
 *                                           one internal lock, held only inside these calls.
 *   sp_tlsf_walk / sp_tlsf_check take the lock of a locked heap for the whole walk.
 *
 * Bad input (every build; O(pools), at most 16, plus two header reads): free/realloc/
 * usable_size of a pointer outside the heap (SP_ERR_FOREIGN_POINTER), of an interior or
 * misaligned pointer (SP_ERR_INVALID_POINTER), or of a block already free
 * (SP_ERR_DOUBLE_FREE) is reported through the logger with the call
 * and address and leaves the heap untouched; if misuse is fatal (debug builds by default,
 * see sp_log.h) the process then dies. Sizes that overflow return NULL. free(NULL) is a no-op.
 */
#ifndef SP_TLSF_H
#define SP_TLSF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_log.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SP_TLSF_MAX_POOLS 16
#define SP_TLSF_ALIGN 16
/* Largest block the heap can hold (payload bytes). */
#define SP_TLSF_MAX_BLOCK (((size_t)1 << 40) - 4096)

typedef struct sp_tlsf sp_tlsf;

typedef struct sp_tlsf_desc {
    void *memory;     /* start of the memory; the control structure goes here */
    size_t size;      /* bytes of memory (at least sp_tlsf_control_size() + a few KiB) */
    bool locked;      /* true: every call takes one internal lock (central-heap use) */
    const char *name; /* for messages; may be NULL */
} sp_tlsf_desc;

typedef struct sp_tlsf_status {
    size_t bytes_used;     /* payload bytes of live blocks (granted sizes) */
    size_t bytes_free;     /* payload bytes of free blocks */
    size_t bytes_overhead; /* headers, control structure, pool ends */
    size_t largest_free;   /* payload of the largest free block: exact when free space is in
                              one block per size class at the top; otherwise at most 1/64
                              (one second-level class) below the true largest. A request of
                              this size succeeds. */
    size_t live_blocks;
    size_t free_blocks;
    size_t high_water;    /* peak of bytes_used since creation */
    double fragmentation; /* 1 - largest_free / bytes_free; 0 when nothing is free */
    size_t pool_count;
} sp_tlsf_status;

/* Bytes the control structure takes at the start of desc.memory. */
size_t sp_tlsf_control_size(void);

/* Create a heap over desc->memory. Returns NULL (and logs) if the memory is NULL, too small,
 * larger than one pool may be (SP_TLSF_MAX_BLOCK), or wraps around the address space
 * (SP_ERR_OVERFLOW, nothing written); with SP_ERR_* in *err if non-NULL. */
sp_tlsf *sp_tlsf_create(const sp_tlsf_desc *desc, sp_result *err);

/* Forget the heap. Returns the number of blocks still live (0 = no leak). */
size_t sp_tlsf_destroy(sp_tlsf *t);

/* Add a pool of memory. Errors: SP_ERR_TOO_SMALL, SP_ERR_LIMIT (pool table full),
 * SP_ERR_INVALID_ARG (overlaps a pool, NULL, larger than SP_TLSF_MAX_BLOCK), SP_ERR_OVERFLOW
 * (memory + size wraps the address space; sp_tlsf_create answers the same in *err). */
sp_result sp_tlsf_add_pool(sp_tlsf *t, void *memory, size_t size);

/* Allocate `size` bytes (16-aligned). size 0 gives a minimal unique block. Returns NULL when
 * out of memory or when the size cannot be represented. O(1). */
void *sp_tlsf_malloc(sp_tlsf *t, size_t size);

/* Allocate `size` bytes aligned to `align` (any power of two up to 1 GiB). Returns NULL for
 * a non-power-of-two alignment (reported as SP_ERR_BAD_ALIGNMENT misuse) or when out of
 * memory. O(1). */
void *sp_tlsf_aligned_alloc(sp_tlsf *t, size_t align, size_t size);

/* Free a block. NULL is a no-op. Misuse is detected as described above. O(1). */
void sp_tlsf_free(sp_tlsf *t, void *p);

/* Resize: in place when the block shrinks or its physical successor is free and large
 * enough, else allocate-copy-free. realloc(NULL, n) = malloc(n); realloc(p, 0) frees p and
 * returns NULL. On failure returns NULL and p is untouched. O(1) apart from the copy. */
void *sp_tlsf_realloc(sp_tlsf *t, void *p, size_t size);

/* Usable bytes of a live block (>= the size asked for); 0 for NULL or bad pointers. */
size_t sp_tlsf_usable_size(sp_tlsf *t, const void *p);

/* The check the calls above make of p, without reporting it: SP_OK for a live block of t,
 * else the id they would report (SP_ERR_DOUBLE_FREE, SP_ERR_INVALID_POINTER,
 * SP_ERR_FOREIGN_POINTER) and, if why is not NULL, the reason in words. For a caller that
 * guards an unlocked heap with a lock of its own and reports once it has released it (a fatal
 * handler may longjmp out of a report). Locking as for usable_size. O(1) (plus the pool
 * search for a pointer outside the first pool). NULL p: SP_ERR_FOREIGN_POINTER (free(NULL) is
 * a no-op, but NULL is no block); a NULL heap: SP_ERR_INVALID_ARG, also not reported. */
sp_result sp_tlsf_check_ptr(sp_tlsf *t, const void *p, const char **why);

/* Whether p lies inside one of the heap's pools. O(number of pools), no lock. */
bool sp_tlsf_owns(const sp_tlsf *t, const void *p);

/* Status in O(1). */
void sp_tlsf_status_get(sp_tlsf *t, sp_tlsf_status *out);

/* Visit every block of every pool in address order. O(blocks). */
typedef void (*sp_tlsf_walker)(void *user, void *ptr, size_t size, bool used);
void sp_tlsf_walk(sp_tlsf *t, sp_tlsf_walker fn, void *user);

/* Validate every invariant: headers, physical neighbours, coalescing, free lists vs bitmaps,
 * list membership, status counters. Reports the first violation through the logger
 * (SP_ERR_CORRUPT, with its address) and returns it; SP_OK when the heap is sound.
 * O(blocks). */
sp_result sp_tlsf_check(sp_tlsf *t);

#ifdef __cplusplus
}
#endif
#endif
