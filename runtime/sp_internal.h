/* Internal helpers shared by every module: branch hints, attributes, alignment arithmetic,
 * debug-tier assertions. Never included from a public header, never reaches demos/ or bench/. */
#ifndef SP_INTERNAL_H
#define SP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "sp_log.h"

#ifndef SP_DEBUG
#define SP_DEBUG 0
#endif

#define SP_LIKELY(x) __builtin_expect(!!(x), 1)
#define SP_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define SP_NOINLINE __attribute__((noinline))
#define SP_COLD __attribute__((cold, noinline))
#define SP_INLINE static inline __attribute__((always_inline))
/* Shared between files of one module, not exported from libspindle.so. */
#define SP_HIDDEN __attribute__((visibility("hidden")))
#define SP_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

static inline int sp_is_pow2(size_t x) {
    return x != 0 && (x & (x - 1)) == 0;
}
static inline uintptr_t sp_align_up(uintptr_t x, size_t a) {
    return (x + (a - 1)) & ~(uintptr_t)(a - 1);
}
static inline uintptr_t sp_align_down(uintptr_t x, size_t a) {
    return x & ~(uintptr_t)(a - 1);
}

/* Tiered checks (SP_DEBUG, meson option debug_level): level 2 internal invariants, level 3
 * expensive walks. The condition is evaluated only when the tier is enabled: no side effects
 * allowed. */
#define SP_CHECK_TIER(tier, cond, call, addr)                                                      \
    do {                                                                                           \
        if (SP_DEBUG >= (tier) && SP_UNLIKELY(!(cond)))                                            \
            sp_die(SP_ERR_CORRUPT, (call), (addr), "invariant failed: %s (%s:%d)", #cond,          \
                   __FILE__, __LINE__);                                                            \
    } while (0)
#define SP_INVARIANT(cond, call, addr) SP_CHECK_TIER(2, cond, call, addr)

/* A NULL argument `what` of `call` (addr: the object it came with, if any): reported as misuse
 * (SP_ERR_INVALID_ARG); returns true. SP_NULL_ARG(x, ...) is true, after the report, when x
 * is NULL: `if (SP_NULL_ARG(t, "sp_tlsf_malloc", NULL, "heap")) return NULL;`. */
SP_HIDDEN SP_COLD bool sp_null_arg(const char *call, const void *addr, const char *what);
#define SP_NULL_ARG(x, call, addr, what) (SP_UNLIKELY(!(x)) && sp_null_arg(call, addr, what))

/* Objects the runtime owns (sp_handles, sp_frames, sp_scheduler): while kept, the public calls
 * that would end them refuse (misuse, SP_ERR_INVALID_ARG: sp_shutdown ends them); the runtime
 * lets go (false) before it ends them itself. Main thread, between frames. */
typedef struct sp_handle_heap sp_handle_heap;
typedef struct sp_frame_arena sp_frame_arena;
typedef struct sp_jobs sp_jobs;
SP_HIDDEN void handle_heap_keep(sp_handle_heap *h, bool keep);
SP_HIDDEN void frame_arena_keep(sp_frame_arena *a, bool keep);
SP_HIDDEN void jobs_keep(sp_jobs *s, bool keep);

#endif
