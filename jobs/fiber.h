/* Fibers: the execution contexts the job scheduler runs jobs on (internal, not installed).
 *
 * A pool owns `count` fibers, each with an mmap'd stack of `stack_size` bytes (rounded up to
 * pages) and an inaccessible guard page below it, so an overflow faults at once instead of
 * corrupting the neighbouring stack - provided the code running on it probes frames larger
 * than a page (gcc and clang: -fstack-clash-protection, which spindle is built with and
 * Debian's compilers do not turn on by default): a larger frame compiled without it can step
 * over the guard page into the next fiber's stack. A thread that wants to run fibers first gets a
 * fiber handle for its own stack (sp_fiber_thread_enter), switches to pooled fibers, and is
 * switched back to. Switching is cooperative: sp_fiber_switch(from, to) suspends `from`, the
 * running fiber, and resumes `to`. Context switch: a few instructions of assembly per architecture;
 * -Dfiber_backend=ucontext: glibc swapcontext, which takes 62-63x the assembly switch's time in
 * the same process (bench/README.md, area `fiber`: one system call per switch). The switch
 * keeps the FP control state per fiber; an ldmxcsr that changes MXCSR's status flags is an
 * order of magnitude slower than the whole switch (bench/README.md, "The MXCSR slowdown"), so
 * the switch restores only the control bits (the ABI's callee-saved part) and keeps the
 * current flags: see the asm file. The ucontext backend differs there: swapcontext restores
 * the whole MXCSR (status flags included) and the signal mask per fiber, so a resumed fiber
 * gets its own old flags and mask, also on another thread.
 *
 * Order: sp_fiber_pool_create, then acquire/switch/release any number of times, then
 * sp_fiber_pool_destroy once every fiber is released. Per thread: sp_fiber_thread_enter
 * before its first switch, sp_fiber_thread_leave after its last, both on that thread while it
 * runs on its own stack.
 *
 * Concurrency:
 *   sp_fiber_acquire, sp_fiber_release, sp_fiber_pool_in_use   any thread, concurrently with
 *                                                               each other (one pool mutex)
 *   sp_fiber_switch                                             any thread, concurrently with
 *                                                               everything, on distinct fibers
 *   sp_fiber_pool_create / _destroy                             not concurrently with anything
 *                                                               on that pool
 *   sp_fiber_thread_enter / _leave                              the thread concerned
 * One fiber runs on at most one thread at a time. A suspended fiber may be resumed by any
 * thread, but only after the switch away from it has completed: publish a suspended fiber (to
 * a queue, a wait list) from the fiber it switched to, never before switching away from it.
 * A thread fiber is resumed only on its own thread.
 *
 * Migration rule: a pooled fiber may resume on another thread than the one it suspended on.
 * Code running on a fiber must not keep the address of a thread-local variable across a switch
 * (nor anything derived from the thread: errno, a cached thread id, a thread cache pointer).
 * sp_fiber_switch is an out-of-line call the compiler cannot see through, but compilers still
 * keep a thread-local's address in a callee-saved register across such calls where they
 * computed it once (a general-dynamic thread-local under -fPIC with gcc 12 and clang 14 on
 * x86-64; any thread-local with clang 14 on aarch64; an address taken before the call): read
 * thread-locals after a switch through a function that is not inlined into the switching one,
 * or through SP_TLS_FRESH (sp_platform.h).
 *
 * Floating-point control state (x86-64 MXCSR control bits and x87 control word, aarch64 FPCR) is
 * per fiber: a fresh fiber starts with the acquiring thread's, and a mode set on a fiber stays
 * with it. x86-64 MXCSR status flags (sticky exception bits 0-5) are caller-saved in the ABI and
 * not per fiber: a resumed fiber finds them as the thread left them.
 *
 * Sanitizers: switches are annotated for ThreadSanitizer and AddressSanitizer, and stacks are
 * registered with Valgrind when built with -Dvalgrind=true. Under TSan each pooled fiber keeps
 * one TSan fiber for its life (destroying and re-creating handles can reuse an address and
 * hide real races); a fiber abandoned mid-stack leaves its frames on that TSan fiber's shadow
 * stack (64K entries), so a scheduler should loop inside long-lived fiber functions rather
 * than acquire a fresh fiber for every job. (The job scheduler abandons a fiber only when
 * sp_jobs_trim gives back a spare: one loop's frames, a few thousand trims of one fiber before
 * its shadow stack would fill.)
 */
#ifndef SP_FIBER_H
#define SP_FIBER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_log.h"

typedef struct sp_fiber sp_fiber;
typedef struct sp_fiber_pool sp_fiber_pool;

/* A fiber's function. It runs on the fiber's stack and must never return: when its work is
 * done it switches away for the last time, and the fiber is then released (by another fiber).
 * Returning is reported with sp_die. */
typedef void (*sp_fiber_fn)(sp_fiber *self, void *arg);

/* Create a pool of `count` fibers with stacks of at least `stack_size` bytes. Cost: one
 * reservation of count * (stack + page) + page bytes of address space (physical pages are
 * faulted in as stacks are used), count + 1 mprotect calls, and one heap block for the
 * fiber records; each stack and its guard are separate kernel mappings (vm.max_map_count).
 * Returns SP_OK with *out set; SP_ERR_INVALID_ARG (misuse: NULL out, count or stack_size 0),
 * SP_ERR_OVERFLOW, SP_ERR_NOMEM or SP_ERR_OS with *out NULL. */
sp_result sp_fiber_pool_create(sp_fiber_pool **out, uint32_t count, size_t stack_size);

/* The same, for a pool that grows: it starts with `count` fibers and, when an acquire finds
 * every fiber in use, doubles (up to `max`). That acquire makes the new fibers with the pool's
 * lock released (a commit, an mprotect per new fiber, their records set up: 2-40 us per new
 * fiber measured, so up to tens of milliseconds for a doubling to thousands); releases go on
 * meanwhile, and other acquires that find no fiber free wait for it (yielding). The address
 * space and records for max fibers are reserved at create; fibers are never unmade before
 * destroy. A growth that fails (logged: SP_LOG_WARN, the system call's id) stops the growing;
 * the acquire then returns NULL as for a full pool. max < count is misuse
 * (SP_ERR_INVALID_ARG). */
sp_result sp_fiber_pool_create_growing(sp_fiber_pool **out, uint32_t count, uint32_t max,
                                       size_t stack_size);

/* Destroy a pool and unmap its stacks. Every fiber must have been released: otherwise that is
 * misuse (SP_ERR_INVALID_ARG) and the pool is left as it was. NULL is ignored. */
void sp_fiber_pool_destroy(sp_fiber_pool *pool);

/* Take a free fiber from the pool and make it start fn(fiber, arg) on its first switch to it.
 * Any thread; does not switch. Cost: an uncontended mutex lock/unlock (two atomics) and a
 * 200-byte context reset; under ASan also unpoisoning the stack's shadow (plus a growth, for a
 * growing pool that is full). Returns NULL when every fiber is in use and the pool cannot grow
 * (not logged: the caller decides), or on misuse (NULL pool or fn, SP_ERR_INVALID_ARG). */
sp_fiber *sp_fiber_acquire(sp_fiber_pool *pool, sp_fiber_fn fn, void *arg);

/* Give a fiber back to its pool. Its stack is abandoned as it is: the fiber must be suspended
 * and never resumed again (release it from the fiber it last switched to, or later). Any
 * thread. Cost: as sp_fiber_acquire without the reset. Misuse, reported and ignored: a fiber
 * not from this pool or a thread fiber (SP_ERR_FOREIGN_POINTER), a fiber already free
 * (SP_ERR_DOUBLE_FREE). */
void sp_fiber_release(sp_fiber_pool *pool, sp_fiber *fiber);

/* Fibers of the pool currently acquired (for statistics and leak checks). Any thread. */
uint32_t sp_fiber_pool_in_use(sp_fiber_pool *pool);

/* Fibers the pool has made so far (count, and more once it grew). Any thread, no lock. */
uint32_t sp_fiber_pool_count(sp_fiber_pool *pool);

/* Give back the stack pages of free fibers that ran since they were made or last trimmed
 * (sp_vm_purge: their stacks stay usable, and fault in afresh when a fiber runs again), at
 * most `max` of them; returns how many. The fibers are off the free list while their stacks
 * are purged (an acquire that finds no other fiber waits for them, neither growing the pool
 * nor counting as exhausted). A purge that fails (the pages are locked: mlockall) is logged
 * once and ends trimming for the pool's life. Any thread. Cost: the pool's lock twice, a walk
 * of the free list up to the last fiber taken, one madvise per stack (lock released). */
uint32_t sp_fiber_pool_trim(sp_fiber_pool *pool, uint32_t max);

/* Fibers whose stacks may hold pages: acquired, or free and run since made or trimmed. Any
 * thread. */
uint32_t sp_fiber_pool_stacks_used(sp_fiber_pool *pool);

/* A fiber handle for the calling thread's own stack, so it can switch to pooled fibers and be
 * switched back to. Cost: one small heap allocation. Returns NULL if out of memory. */
sp_fiber *sp_fiber_thread_enter(void);

/* sp_fiber_thread_enter in two steps, for a thread that must not fail once it runs: the handle
 * made on any thread (NULL if out of memory), then bound, on the thread concerned, before its
 * first switch. A handle never bound may be freed with sp_fiber_thread_leave from any thread. */
sp_fiber *sp_fiber_thread_record(void);
void sp_fiber_thread_bind(sp_fiber *f);

/* Free a handle from sp_fiber_thread_enter. The calling thread must be running on its own
 * stack (switched back from every pooled fiber). Misuse, reported and ignored: a pooled
 * fiber (SP_ERR_FOREIGN_POINTER). NULL is ignored. */
void sp_fiber_thread_leave(sp_fiber *self);

/* Suspend `from`, which must be the fiber running on the calling thread, and resume `to` on
 * this thread; returns when another switch resumes `from`, possibly on another thread (see the
 * migration rule above). A fresh fiber starts its function. Cost: callee-saved registers and
 * FP control words out and in, an indirect jump (figures at the top); more under sanitizers.
 * Misuse, reported and ignored (the switch does not happen): NULL, from == to, or `to` a
 * pooled fiber that is not acquired (SP_ERR_INVALID_ARG). Not checked (undefined): `from` not
 * the running fiber, `to` running or abandoned. */
void sp_fiber_switch(sp_fiber *from, sp_fiber *to);

/* The usable stack of a pooled fiber: [*lo, *lo + *size); the guard page lies just below *lo.
 * A thread fiber reports 0 and NULL. */
void sp_fiber_stack(const sp_fiber *fiber, void **lo, size_t *size);

#endif
