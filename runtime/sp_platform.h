/* spindle platform layer: the only code that talks to the OS.
 *
 * Virtual memory (reserve / commit / decommit / release, huge pages, guard pages), threads and
 * their names, CPU count, a monotonic clock, a cheap tick counter, futex wait/wake and a small
 * futex mutex. Everything above this layer is portable C.
 *
 * Init/shutdown: nothing to initialise; every call may be made at any time.
 * Concurrency: every call may run concurrently with any other, from any thread. Calls that
 * change the same memory range (commit/decommit/release of overlapping ranges) need the
 * caller's own ordering, as with mmap.
 */
#ifndef SP_PLATFORM_H
#define SP_PLATFORM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_log.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- virtual memory ------------------------------------------------------------------- */

/* What backs a reservation. */
typedef enum sp_page_kind {
    SP_PAGES_NORMAL = 0,      /* base pages (4 KiB on x86-64) */
    SP_PAGES_TRANSPARENT = 1, /* base pages with transparent huge pages requested (madvise) */
    SP_PAGES_HUGE = 2,        /* explicit huge pages (MAP_HUGETLB), committed at reservation */
} sp_page_kind;

/* Size of a base page. Cost: one load after the first call. */
size_t sp_page_size(void);

/* Huge page size (2 MiB on x86-64), 0 when unknown. */
size_t sp_huge_page_size(void);

/* Reserve `size` bytes of address space, aligned to `align` (a power of two; 0 means page
 * size). Reserved memory is inaccessible until committed. With `huge`, tries MAP_HUGETLB
 * pages (which come committed), then transparent huge pages, then base pages; `granted`
 * (may be NULL) tells which. `size` is rounded up to the page (or huge page) size; callers
 * that need the rounded size round with sp_huge_page_size() themselves. With SP_PAGES_HUGE,
 * commit/decommit/guard/release work only on huge-page-aligned ranges (the kernel does not
 * split huge pages). size 0 and an align that is not a power of two are misuse
 * (SP_ERR_INVALID_ARG); a size that overflows when rounded returns NULL (SP_ERR_OVERFLOW,
 * logged at warn level). Returns NULL (and logs SP_ERR_OS at warn level) if the OS refuses. */
void *sp_vm_reserve(size_t size, size_t align, bool huge, sp_page_kind *granted);

/* Make [p, p+size) readable and writable; pages are faulted in on first touch and read as
 * zero the first time. `p` and `size` must be page-aligned. A range with any page not mapped
 * (commit, decommit, purge and guard alike): SP_ERR_OS, logged, nothing changed anywhere in it
 * (checked first: the OS calls change the part before a hole). */
sp_result sp_vm_commit(void *p, size_t size);

/* Return the physical pages of [p, p+size) to the OS and make the range inaccessible
 * again; the address range stays reserved, its mapping as it was (an SP_PAGES_TRANSPARENT
 * reservation keeps its transparent-huge-page advice, and committed again the range merges
 * back into one mapping with its neighbours). Contents are lost. On an SP_PAGES_HUGE
 * reservation (whose ranges must be aligned to the huge page size, see sp_vm_reserve) the
 * range is mapped afresh with base pages instead: a later commit gets base pages there.
 * Under strict overcommit (vm.overcommit_memory=2) the commit charge of a range dropped in
 * place stays until release. A range that is not all mapped (released, never reserved):
 * SP_ERR_OS, logged, nothing mapped there. */
sp_result sp_vm_decommit(void *p, size_t size);

/* Drop the pages of committed [p, p+size) (MADV_DONTNEED): the range stays readable and
 * writable, reads zero on its next touch, and its resident pages go back to the OS now. For
 * memory whose contents are garbage but whose range is reused soon (a free fiber's stack):
 * unlike decommit, the next use needs no commit. A range that is not all mapped: SP_ERR_OS,
 * logged. */
sp_result sp_vm_purge(void *p, size_t size);

/* Make [p, p+size) inaccessible (a guard): any access faults at once. */
sp_result sp_vm_guard(void *p, size_t size);

/* Give back a reservation made by sp_vm_reserve (same pointer and size). Not checked beyond
 * alignment: releasing twice, or with another size, unmaps whatever is mapped there now (a
 * later reservation at the same address) and says nothing: undefined, like a double free. */
void sp_vm_release(void *p, size_t size);

/* ---- CPU, clocks ----------------------------------------------------------------------- */

/* Number of CPUs this process may run on (sched_getaffinity), at least 1. Not cached (the
 * affinity may change): one system call per call. */
uint32_t sp_cpu_count(void);

/* CPU numbers: 0 .. SP_CPU_MAX - 1; SP_CPU_ANY for no CPU in particular. */
#define SP_CPU_MAX (1 << 20)
#define SP_CPU_ANY (-1)

/* The number of the CPU at index k mod sp_cpu_count() among those the calling thread may run
 * on (its affinity mask, ascending): k = 0 is the lowest. SP_CPU_ANY if the mask cannot be
 * read. One system call per call. */
int sp_cpu_nth(uint32_t k);

/* Bytes of physical memory (sysconf), 0 when unknown. One system call per call. */
uint64_t sp_memory_size(void);

/* The address space a default size may take under an RLIMIT_AS soft limit: half of what the
 * limit leaves after what the process maps now (/proc/self/statm), the rest for the threads
 * and the program; SIZE_MAX when no limit is set or the mapped size cannot be read. What the
 * runtime's default regions, the thread caches' own reservation and the scheduler's default
 * fibers_max follow. System calls only: it allocates nothing (safe inside malloc). */
size_t sp_address_budget(void);

/* Monotonic clock in nanoseconds (CLOCK_MONOTONIC). Cost: one vDSO call, no system call. */
uint64_t sp_time_ns(void);

/* A cheap, monotonic per-core tick counter (rdtsc on x86-64, cntvct_el0 on aarch64). Ticks are
 * only comparable on one machine; convert with sp_ticks_to_ns. Cost: a few ns. */
uint64_t sp_ticks(void);

/* Ticks -> nanoseconds. Calibrated against sp_time_ns once (~10 ms on first use). */
double sp_ticks_to_ns(uint64_t ticks);

/* ---- threads --------------------------------------------------------------------------- */

typedef struct sp_thread {
    uintptr_t os; /* pthread_t */
} sp_thread;

typedef void *(*sp_thread_fn)(void *arg);

/* Start a thread running fn(arg), named `name` (may be NULL; truncated to 15 chars).
 * The thread names itself before running fn. Returns SP_ERR_OS if the OS refuses,
 * SP_ERR_NOMEM if the small start record cannot be allocated; NULL out or fn is misuse
 * (SP_ERR_INVALID_ARG). */
sp_result sp_thread_start(sp_thread *out, sp_thread_fn fn, void *arg, const char *name);

/* As sp_thread_start (joined with sp_thread_join), the thread restricted to CPU `cpu` from
 * its first instruction (its affinity set in the creation attributes); SP_CPU_ANY: the
 * creating thread's mask, as sp_thread_start. A CPU the OS refuses (outside the process's
 * cpuset, not online) fails the start: SP_ERR_OS (logged), no thread started. Any other
 * negative cpu, or one at SP_CPU_MAX or above, is misuse (SP_ERR_INVALID_ARG). */
sp_result sp_thread_start_on(sp_thread *out, sp_thread_fn fn, void *arg, const char *name, int cpu);

/* Wait for a thread started by sp_thread_start; returns what its function returned (NULL,
 * and a logged SP_ERR_OS, if the join itself fails). A thread joined already, or an sp_thread
 * that sp_thread_start did not fill, is undefined (as for pthread_join). */
void *sp_thread_join(sp_thread t);

/* The calling thread, as an sp_thread (for sp_thread_pin; never to be joined). */
sp_thread sp_thread_self(void);

/* Restrict a running thread t (from sp_thread_start, sp_thread_start_on or sp_thread_self) to
 * CPU `cpu` (pthread_setaffinity_np: any thread may call it, one system call; a thread undoes
 * it for itself by setting its old mask back with sched_setaffinity). The calling thread moves
 * before this returns. SP_CPU_ANY (what sp_cpu_nth returns when the mask cannot be read)
 * changes nothing: SP_OK. SP_ERR_OS (logged) when the OS refuses, e.g. a CPU outside the
 * process's cpuset or not online; any other negative cpu, or one at SP_CPU_MAX or above, is
 * misuse (SP_ERR_INVALID_ARG). */
sp_result sp_thread_pin(sp_thread t, int cpu);

/* Name the calling thread (as seen by debuggers, top, perf). */
void sp_thread_set_name(const char *name);

/* The OS id of the calling thread (gettid). */
uint64_t sp_thread_os_id(void);

/* Give the rest of the time slice away. */
void sp_thread_yield(void);

/* ---- futex ----------------------------------------------------------------------------- */

/* Sleep while *addr == expected, at most timeout_ns (0 = no limit). May wake spuriously.
 * Process-private futex. *addr must be accessed atomically by everyone else. Both calls leave
 * errno as it was (sp_mutex and so free() of the malloc drop-in go through them). */
void sp_futex_wait(uint32_t *addr, uint32_t expected, uint64_t timeout_ns);

/* Wake up to `count` threads sleeping on addr (INT32_MAX for all). */
void sp_futex_wake(uint32_t *addr, int32_t count);

/* ---- mutex ----------------------------------------------------------------------------- */

/* A futex mutex (0 = unlocked; zero-initialise it). Uncontended lock/unlock: one atomic each.
 * Contended: spins briefly, then sleeps. Unlocking an unlocked mutex is misuse
 * (SP_ERR_INVALID_ARG); the mutex stays unlocked. It keeps no owner (one word): locking it
 * again on the thread that holds it deadlocks, and an unlock from another thread releases it
 * from its holder; neither is detected. */
typedef struct sp_mutex {
    uint32_t state;
} sp_mutex;

void sp_mutex_lock(sp_mutex *m);
bool sp_mutex_trylock(sp_mutex *m);
void sp_mutex_unlock(sp_mutex *m);

/* ---- thread pointer -------------------------------------------------------------------- */

/* SP_TLS_FRESH(var): the address of the calling thread's instance of `var`, a thread-local
 * declared with tls_model("initial-exec"), computed anew where it is written: an asm volatile
 * with a memory clobber, which compilers neither merge with another nor move across a call.
 * A thread-local's address that a compiler computes once is kept in a register across calls:
 * a general-dynamic thread-local (the model -fPIC code gets by default: one __tls_get_addr
 * call, its result reused) with gcc 12 and clang 14 on x86-64, any thread-local on aarch64
 * with clang 14, and an address taken before a call anywhere; that is wrong after a fiber
 * switch that resumed on another thread. (gcc 12 on x86-64 reloads %fs for each plain read of
 * an initial-exec thread-local, so there the asm is a guarantee rather than a fix.) Cost: one
 * instruction more than a plain thread-local read (x86-64: the %fs:0 load; aarch64: mrs + GOT
 * load). Undefined on other
 * CPUs: callers test `defined(SP_TLS_FRESH)` and use an out-of-line function instead. */
#if defined(__x86_64__)
#define SP_TLS_FRESH(var)                                                                          \
    __extension__({                                                                                \
        char *sp_tls_p_;                                                                           \
        __asm__ volatile("movq %%fs:0, %0\n\taddq " #var "@gottpoff(%%rip), %0"                    \
                         : "=r"(sp_tls_p_)                                                         \
                         :                                                                         \
                         : "memory");                                                              \
        (void *)sp_tls_p_;                                                                         \
    })
#elif defined(__aarch64__)
#define SP_TLS_FRESH(var)                                                                          \
    __extension__({                                                                                \
        char *sp_tls_p_, *sp_tls_o_;                                                               \
        __asm__ volatile("mrs %0, tpidr_el0\n\t"                                                   \
                         "adrp %1, :gottprel:" #var "\n\t"                                         \
                         "ldr %1, [%1, #:gottprel_lo12:" #var "]\n\t"                              \
                         "add %0, %0, %1"                                                          \
                         : "=&r"(sp_tls_p_), "=&r"(sp_tls_o_)                                      \
                         :                                                                         \
                         : "memory");                                                              \
        (void *)sp_tls_p_;                                                                         \
    })
#endif

/* SP_HAS_FEATURE(x): clang's __has_feature, 0 elsewhere (gcc says __SANITIZE_*__ instead). */
#if defined(__has_feature)
#define SP_HAS_FEATURE(x) __has_feature(x)
#else
#define SP_HAS_FEATURE(x) 0
#endif

/* SP_ASAN, SP_TSAN: 1 in builds under AddressSanitizer / ThreadSanitizer (gcc or clang). */
#if defined(__SANITIZE_ADDRESS__) || SP_HAS_FEATURE(address_sanitizer)
#define SP_ASAN 1
#else
#define SP_ASAN 0
#endif
#if defined(__SANITIZE_THREAD__) || SP_HAS_FEATURE(thread_sanitizer)
#define SP_TSAN 1
#else
#define SP_TSAN 0
#endif

/* SP_INLINE_FAST_PATHS: 1 where the allocators compile their inline fast paths (thread caches,
 * frame arenas): SP_TLS_FRESH exists and no memory tool needs every call to go through the
 * out-of-line path that tells it about each block (ASan, -Dvalgrind=true). */
#if SP_ASAN || (defined(SP_TRACK_VALGRIND) && SP_TRACK_VALGRIND) || !defined(SP_TLS_FRESH)
#define SP_INLINE_FAST_PATHS 0
#else
#define SP_INLINE_FAST_PATHS 1
#endif

#ifdef __cplusplus
}
#endif
#endif
