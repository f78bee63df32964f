/* The Chase-Lev work-stealing deque (see deque.h for the contract, costs and invariants).
 *
 * Memory orderings, against Lê et al. (PPoPP 2013, figure 1):
 *   - The paper's seq_cst fences (in take, between the store of bottom and the load of top;
 *     in steal, between the load of top and the load of bottom) become seq_cst accesses on
 *     both sides. This is the store->load (Dekker) ordering the algorithm needs: if the owner
 *     reads an old top, its store of bottom precedes that read in the single order S of
 *     seq_cst operations, so a thief whose later seq_cst loads see a newer top must also see
 *     the new bottom, and both cannot take the same item. ThreadSanitizer understands seq_cst
 *     accesses but not standalone fences, so this form runs clean without suppressions; on
 *     x86-64 it is also cheaper (xchg instead of mov + mfence in pop, plain loads in steal).
 *   - push publishes the slot with a release store of bottom (the paper: release fence +
 *     relaxed store); every store of bottom is release or stronger, so a thief that reads any
 *     value of bottom with its (acquire) load sees every slot written before it.
 *   - Both CASes on top are seq_cst on success (they are in S, which the argument above
 *     uses), relaxed on failure (the value is thrown away).
 *   - push reads top with acquire: it pairs with the thieves' CAS, so a thief's read of a slot
 *     happens before the owner overwrites that slot one lap later.
 *   - Slots are accessed relaxed: ordering comes from top and bottom; they are atomics only
 *     because a thief that is about to lose its CAS may read a slot being overwritten.
 * Index differences are taken as ptrdiff_t, so the size_t indices may wrap around.
 *
 * Everything is out of line here: pop's cost is its full barrier (a few ns), a call adds about
 * one; one copy of the orderings is easier to audit. bench/README.md has the figures.
 */
#include "deque.h"

#include <stdint.h>

#include "sp_internal.h"

size_t sp_deque_bytes(size_t capacity) {
    if (!sp_is_pow2(capacity) ||
        capacity > (SIZE_MAX / 2 - sizeof(sp_deque)) / sizeof(_Atomic(void *)))
        return 0;
    return sizeof(sp_deque) + capacity * sizeof(_Atomic(void *));
}

sp_deque *sp_deque_init(void *mem, size_t capacity) {
    if (!mem || !sp_deque_bytes(capacity)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_deque_init", mem,
                  "capacity %zu is not a power of two in range, or memory is NULL", capacity);
        return NULL;
    }
    if ((uintptr_t)mem % SP_DEQUE_LINE != 0) {
        sp_misuse(SP_ERR_BAD_ALIGNMENT, "sp_deque_init", mem,
                  "deque memory must be aligned to %d bytes", SP_DEQUE_LINE);
        return NULL;
    }
    sp_deque *d = mem;
    atomic_init(&d->bottom, 0);
    atomic_init(&d->top, 0);
    d->mask = capacity - 1;
    for (size_t i = 0; i < capacity; i++) atomic_init(&d->slots[i], NULL);
    return d;
}

size_t sp_deque_capacity(const sp_deque *d) {
    return d->mask + 1;
}

static SP_COLD bool push_null(sp_deque *d) {
    sp_misuse(SP_ERR_INVALID_ARG, "sp_deque_push_local", d, "NULL item (NULL means empty)");
    return false;
}

bool sp_deque_push_local(sp_deque *d, void *item) {
    if (SP_UNLIKELY(!item)) return push_null(d);
    size_t b = atomic_load_explicit(&d->bottom, memory_order_relaxed);
    size_t t = atomic_load_explicit(&d->top, memory_order_acquire);
    SP_INVARIANT((ptrdiff_t)(b - t) >= 0 && b - t <= d->mask + 1, "sp_deque_push_local", d);
    if (SP_UNLIKELY(b - t > d->mask)) return false; /* full: b - t == capacity */
    atomic_store_explicit(&d->slots[b & d->mask], item, memory_order_relaxed);
    atomic_store_explicit(&d->bottom, b + 1, memory_order_release);
    return true;
}

void *sp_deque_pop_local(sp_deque *d) {
    size_t b = atomic_load_explicit(&d->bottom, memory_order_relaxed);
    /* Empty without the barrier: only we add items and top only grows, so top >= bottom
     * now means empty until our next push. */
    if ((ptrdiff_t)(b - atomic_load_explicit(&d->top, memory_order_relaxed)) <= 0) return NULL;

    /* Claim slot b - 1 before looking at top (seq_cst store, then seq_cst load: Dekker). */
    b--;
    atomic_store_explicit(&d->bottom, b, memory_order_seq_cst);
    size_t t = atomic_load_explicit(&d->top, memory_order_seq_cst);
    ptrdiff_t left = (ptrdiff_t)(b - t); /* items left below ours; -1: thieves emptied it */
    if (left < 0) {
        atomic_store_explicit(&d->bottom, b + 1, memory_order_release);
        return NULL;
    }
    void *item = atomic_load_explicit(&d->slots[b & d->mask], memory_order_relaxed);
    if (left > 0) return item; /* thieves stop at top < b: slot b is ours alone */

    /* The last item: thieves may be after it too; whoever moves top from t wins it. */
    if (!atomic_compare_exchange_strong_explicit(&d->top, &t, t + 1, memory_order_seq_cst,
                                                 memory_order_relaxed))
        item = NULL;
    atomic_store_explicit(&d->bottom, b + 1, memory_order_release); /* == top: empty */
    return item;
}

sp_steal sp_deque_steal_remote(sp_deque *d, void **item) {
    *item = NULL;
    size_t t = atomic_load_explicit(&d->top, memory_order_seq_cst);
    size_t b = atomic_load_explicit(&d->bottom, memory_order_seq_cst);
    if ((ptrdiff_t)(b - t) <= 0) return SP_STEAL_EMPTY;
    /* May be a value the owner is overwriting one lap later: kept only if the CAS proves
     * that top was still t, i.e. slot t was not yet reusable. */
    void *x = atomic_load_explicit(&d->slots[t & d->mask], memory_order_relaxed);
    if (!atomic_compare_exchange_strong_explicit(&d->top, &t, t + 1, memory_order_seq_cst,
                                                 memory_order_relaxed))
        return SP_STEAL_LOST;
    *item = x;
    return SP_STEAL_ITEM;
}
