/* A bounded Chase-Lev work-stealing deque of `void *` items (internal to jobs/).
 *
 * One owner thread pushes and pops at the bottom (LIFO: the job it spawned last is hot in its
 * cache); any thread steals from the top (FIFO: the oldest, usually largest, piece of work).
 * The scheduler keeps one per worker and priority. Correctness reference: N. M. Lê, A. Pop,
 * A. Cohen, F. Zappa Nardelli, "Correct and Efficient Work-Stealing for Weak Memory Models"
 * (PPoPP 2013), with each seq_cst fence of the paper replaced by seq_cst operations on both
 * sides of it (ThreadSanitizer does not model standalone fences; see deque.c).
 *
 * Capacity is a power of two fixed at init. The deque never grows: growing needs a safe
 * reclamation scheme for the old ring (thieves may still read it). A push on a full deque
 * returns false and the caller (the scheduler) sends the item to its injection queue.
 *
 * Concurrency (yes = may run at the same time on the same deque):
 *
 *                          | push_local | pop_local | steal_remote | init, capacity
 *   sp_deque_push_local    |     -      |     -     |     yes      |      no / yes
 *   sp_deque_pop_local     |     -      |     -     |     yes      |      no / yes
 *   sp_deque_steal_remote  |    yes     |    yes    |     yes      |      no / yes
 *
 *   `-`: the owner is one thread, so its calls never overlap. _local calls come from the owner
 *   only (the thread that called init, or one it handed the deque to with a happens-before
 *   edge). _remote calls may come from any thread, the owner included. init must happen-before
 *   every other call (publish the deque with a release store or a thread start).
 *
 * Costs (x86-64; figures in bench/README.md, "deque"):
 *   push_local    one relaxed load, one acquire load (top), two plain stores. No barrier.
 *   pop_local     non-empty: one seq_cst store (xchg: a full barrier, the price of telling
 *                 the owner from the thieves) and a load of top; the last item also a CAS.
 *                 Empty: one load of top, no barrier.
 *   steal_remote  two loads (top, bottom: owner's line) and one CAS on top.
 *   Owner fields and the thieves' field live on separate cache lines, so a push or a pop
 *   only misses on top's line when thieves have just moved it.
 *
 * Invariants (indices are unsigned and wrap; differences are read as signed):
 *   - top only grows, by a CAS (thieves, or the owner taking the last item); only the owner
 *     writes bottom.
 *   - Between owner calls 0 <= bottom - top <= capacity, and the items are the slots of the
 *     indices [top, bottom), oldest at top. Inside pop_local bottom may be top - 1 for a moment.
 *   - A slot is written only by push at index bottom, only while bottom - top < capacity: every
 *     thief that read the previous item there has already lost its CAS (top moved past it).
 *   - Every pushed item is returned exactly once: to the thief whose CAS moved top past it, or
 *     to the owner's pop (without a CAS while other items remain, through the same CAS on top
 *     when it is the last one).
 */
#ifndef SP_DEQUE_H
#define SP_DEQUE_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#define SP_DEQUE_LINE 64 /* cache line (destructive interference) size assumed for padding */

typedef struct sp_deque {
    /* Owner's line: bottom is written only by the owner; mask is read-only after init.
     * Thieves read both from here on every steal. */
    alignas(SP_DEQUE_LINE) atomic_size_t bottom;
    size_t mask; /* capacity - 1 */
    /* Thieves' line: top, moved by CAS. */
    alignas(SP_DEQUE_LINE) atomic_size_t top;
    /* The ring, from the next line on. Atomic (accessed relaxed): a thief may read a slot the
     * owner is overwriting; it then loses its CAS and drops the value. */
    alignas(SP_DEQUE_LINE) _Atomic(void *) slots[];
} sp_deque;

/* What a steal found. */
typedef enum sp_steal {
    SP_STEAL_EMPTY = 0, /* nothing to take when the deque was looked at */
    SP_STEAL_ITEM = 1,  /* *item holds the stolen item */
    SP_STEAL_LOST = 2,  /* there was an item, but another thief or the owner took it first:
                           the deque may still hold items, try again (or elsewhere) */
} sp_steal;

/* Bytes of memory a deque of `capacity` items needs (sp_deque_init's `mem`), or 0 when
 * capacity is not a power of two or too large. Any thread. */
size_t sp_deque_bytes(size_t capacity);

/* Make an empty deque of `capacity` items (a power of two, >= 1) in `mem`: sp_deque_bytes(capacity)
 * bytes aligned to SP_DEQUE_LINE, owned by the caller (nothing to destroy: the deque holds no
 * other resource; free `mem` once no thread uses the deque). The calling thread becomes the
 * owner. Returns the deque (== mem), or NULL after reporting misuse: SP_ERR_INVALID_ARG for a
 * bad capacity or NULL mem, SP_ERR_BAD_ALIGNMENT for a misaligned mem. Cost: O(capacity). */
sp_deque *sp_deque_init(void *mem, size_t capacity);

/* Items the deque can hold. Any thread. */
size_t sp_deque_capacity(const sp_deque *d);

/* Owner only. Push `item` (non-NULL) at the bottom. Returns false, and leaves the deque as it
 * was, when the deque is full (send the item elsewhere) or item is NULL (misuse,
 * SP_ERR_INVALID_ARG: NULL is pop's "empty"). Never blocks. */
bool sp_deque_push_local(sp_deque *d, void *item);

/* Owner only. Pop the item pushed last, or NULL when the deque is empty or a thief took the
 * last item first. Never blocks. */
void *sp_deque_pop_local(sp_deque *d);

/* Any thread. Try once to steal the oldest item into *item (set to NULL unless
 * SP_STEAL_ITEM). Never blocks and never loops: on SP_STEAL_LOST the caller decides whether
 * to retry. */
sp_steal sp_deque_steal_remote(sp_deque *d, void **item);

#endif
