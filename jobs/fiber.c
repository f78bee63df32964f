/* Fiber pools, thread fibers and the annotated switch (see fiber.h). The register switch
 * itself is the backend's (fiber_ctx.h): assembly per architecture, or ucontext. */
#include "fiber.h"

#include <stdlib.h>
#include <string.h>

#include "fiber_ctx.h"
#include "sp_internal.h"
#include "sp_platform.h"
#include "track.h" /* TRACK_ASAN, TRACK_VALGRIND: the same detection as the allocators */

#if SP_TSAN
#include <sanitizer/tsan_interface.h>
#define FIBER_TSAN 1
#else
#define FIBER_TSAN 0
#endif
#if TRACK_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

enum fiber_state { FIBER_FREE = 0, FIBER_ACQUIRED = 1, FIBER_THREAD = 2 };

struct sp_fiber {
    sp_fiber_ctx ctx;    /* first: the backend's entry hands back &ctx */
    sp_fiber_pool *pool; /* NULL for a thread fiber */
    sp_fiber_fn fn;
    void *arg;
    sp_fiber *resumer;   /* the fiber that last switched to this one; set by that switcher */
    sp_fiber *next_free; /* pool free list, under pool->lock */
    uint32_t state;      /* enum fiber_state; changed under pool->lock, read relaxed */
    bool ran;            /* pooled: acquired since made or last trimmed (its stack may hold
                            pages); under pool->lock */
    char *stack_lo;      /* pooled fibers: fixed at pool creation */
    size_t stack_size;
    /* Sanitizer bookkeeping, compiled in always so the layout does not depend on the build. */
    void *asan_fake_stack; /* ASan's fake stack of this fiber while it is suspended */
    const void *asan_lo;   /* thread fibers: the stack bounds, learnt from ASan when the thread */
    size_t asan_size;      /* first switches away (pooled fibers: stack_lo / stack_size) */
    void *tsan;            /* TSan fiber: created with a pooled fiber, the thread's own for it */
    unsigned valgrind_id;  /* VALGRIND_STACK_REGISTER id */
};

/* Invariants: fibers[i].stack_lo = region + page + i * (stack_size + page) for i < count; the
 * region is reserved for max fibers (inaccessible), the first count slots are made, each a
 * guard page and a committed stack, and the page above the last made stack is still
 * inaccessible. A made fiber is on the free list iff its state is FIBER_FREE; in_use counts
 * the others. count only grows (under lock; read without it by pool_owns: a fiber that is
 * passed in was acquired after its slot was made). */
struct sp_fiber_pool {
    sp_mutex lock; /* free, in_use, ran_free, count, max, growing, every fiber's state, ran
                      and next_free */
    sp_fiber *free;
    uint32_t in_use;
    uint32_t ran_free; /* free fibers that ran: what a trim gives back */
    uint32_t trimming; /* free fibers a trim holds off the list while it purges their stacks */
    bool trim_off;     /* a purge failed (pages locked: mlockall): trims do nothing from then */
    uint32_t count;    /* fibers made so far */
    uint32_t max;      /* the most it may make */
    bool growing;      /* an acquire makes more fibers (with the lock released) */
    size_t stack_size;
    char *region;
    size_t region_size;
    sp_fiber fibers[];
};

/* ---- sanitizer annotations ------------------------------------------------------------- */

/* Right before the register switch: tell ASan which stack comes next (and let it stash our
 * fake stack, never a NULL slot: NULL would mean "this fiber is gone" and free it), and tell
 * TSan which fiber runs next (flags 0: the switch synchronises from -> to; no_sync gave
 * false races inside the switch). */
static inline void switch_begin(sp_fiber *from, sp_fiber *to) {
#if TRACK_ASAN
    __sanitizer_start_switch_fiber(&from->asan_fake_stack, to->asan_lo, to->asan_size);
#endif
#if FIBER_TSAN
    __tsan_switch_to_fiber(to->tsan, 0);
#endif
    (void)from, (void)to;
}

/* First thing on `self` after a switch to it: ASan restores self's fake stack (NULL for a
 * fresh fiber: it gets a new one) and reports the stack we came from, which is how a thread
 * fiber's bounds become known before anyone can switch back to it. */
static inline void switch_end(sp_fiber *self) {
#if TRACK_ASAN
    sp_fiber *prev = self->resumer;
    const void *lo;
    size_t size;
    __sanitizer_finish_switch_fiber(self->asan_fake_stack, &lo, &size);
    if (!prev->pool) {
        prev->asan_lo = lo;
        prev->asan_size = size;
    }
#endif
    (void)self;
}

/* ---- switching ------------------------------------------------------------------------- */

static sp_fiber *fiber_of(sp_fiber_ctx *ctx) {
    return (sp_fiber *)((char *)ctx - offsetof(sp_fiber, ctx));
}

/* Where every fresh fiber starts (jumped to by the backend, on the fiber's stack). */
static _Noreturn void fiber_entry(sp_fiber_ctx *ctx) {
    sp_fiber *self = fiber_of(ctx);
    switch_end(self);
    self->fn(self, self->arg);
    sp_die(SP_ERR_INVALID_ARG, "sp_fiber_acquire", self,
           "the function of fiber %p returned: a fiber function must never return (switch to "
           "another fiber when done, and release this one from there)",
           (void *)self);
}

SP_COLD static bool switch_misuse(sp_fiber *from, sp_fiber *to) {
    sp_misuse(SP_ERR_INVALID_ARG, "sp_fiber_switch", to,
              !from || !to ? "NULL fiber"
              : from == to ? "switch from a fiber to itself"
                           : "switch to a fiber that is not acquired from its pool");
    return false;
}

/* Hot path: one predictable branch of checks, the annotations (empty without sanitizers), the
 * backend switch. noinline keeps it one real call in every caller. */
SP_NOINLINE void sp_fiber_switch(sp_fiber *from, sp_fiber *to) {
    if (SP_UNLIKELY(!from || !to || from == to ||
                    __atomic_load_n(&to->state, __ATOMIC_RELAXED) == FIBER_FREE)) {
        switch_misuse(from, to);
        return;
    }
    to->resumer = from;
    switch_begin(from, to);
    sp_fiber_ctx_switch(&from->ctx, &to->ctx);
    switch_end(from); /* resumed: possibly on another thread, nothing thread-local held here */
}

/* ---- pools ----------------------------------------------------------------------------- */

/* a * b + c, false on overflow. */
static bool size_mul_add(size_t a, size_t b, size_t c, size_t *out) {
    size_t m;
    if (__builtin_mul_overflow(a, b, &m) || __builtin_add_overflow(m, c, out)) return false;
    return true;
}

/* Make fibers [from, to): commit their stacks, guard the page below each, set up their records
 * and chain them (*first .. *last, by next_free). Touches those slots only, which nobody else
 * sees until they are linked into the free list: no lock needed. Failures are logged. */
static sp_result pool_make(sp_fiber_pool *pool, uint32_t from, uint32_t to, sp_fiber **first,
                           sp_fiber **last) {
    const size_t page = sp_page_size(), stack = pool->stack_size, slot = stack + page;
    char *lo = pool->region + from * slot;
    sp_result r = sp_vm_commit(lo, (to - from) * slot);
    for (uint32_t i = from; r == SP_OK && i < to; i++)
        r = sp_vm_guard(pool->region + i * slot, page);
    if (SP_UNLIKELY(r != SP_OK)) { /* back to inaccessible: the slots stay unmade */
        sp_vm_guard(lo, (to - from) * slot);
        return r;
    }
    *first = NULL;
    *last = &pool->fibers[to - 1];
    for (uint32_t i = to; i-- > from;) {
        sp_fiber *f = &pool->fibers[i];
        f->pool = pool;
        f->stack_lo = pool->region + page + i * slot;
        f->stack_size = stack;
        f->asan_lo = f->stack_lo;
        f->asan_size = stack;
#if FIBER_TSAN
        f->tsan = __tsan_create_fiber(0);
#endif
#if TRACK_VALGRIND
        f->valgrind_id = VALGRIND_STACK_REGISTER(f->stack_lo, f->stack_lo + stack);
#endif
        f->next_free = *first;
        *first = f;
    }
    return SP_OK;
}

/* Link fibers *first .. *last (just made, up to index `to`) into the free list. Lock held (or
 * the pool not yet shared). */
static void pool_link(sp_fiber_pool *pool, sp_fiber *first, sp_fiber *last, uint32_t to) {
    last->next_free = pool->free;
    pool->free = first;
    __atomic_store_n(&pool->count, to, __ATOMIC_RELEASE);
}

/* Double the pool, up to max. Called and returns with the lock held; releases it while the
 * stacks are made (a commit and an mprotect per fiber), so that releases go on and a logger
 * that asks the pool anything does not deadlock. A failure stops the growing for good. */
static void pool_grow(sp_fiber_pool *pool) {
    uint32_t from = pool->count, to = from <= pool->max - from ? 2 * from : pool->max;
    pool->growing = true;
    sp_mutex_unlock(&pool->lock);
    sp_fiber *first, *last;
    sp_result r = pool_make(pool, from, to, &first, &last);
    if (SP_UNLIKELY(r != SP_OK)) /* pool_make logged the system call's failure */
        sp_log(SP_LOG_WARN, r, "sp_fiber_acquire", pool,
               "the fiber pool could not grow beyond %u fibers (it stays at that size)", from);
    sp_mutex_lock(&pool->lock);
    pool->growing = false;
    if (SP_LIKELY(r == SP_OK))
        pool_link(pool, first, last, to);
    else
        pool->max = from;
}

sp_result sp_fiber_pool_create(sp_fiber_pool **out, uint32_t count, size_t stack_size) {
    return sp_fiber_pool_create_growing(out, count, count, stack_size);
}

sp_result sp_fiber_pool_create_growing(sp_fiber_pool **out, uint32_t count, uint32_t max,
                                       size_t stack_size) {
    if (out) *out = NULL;
    if (SP_UNLIKELY(!out || count == 0 || stack_size == 0 || max < count))
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_fiber_pool_create", out,
                         "out %p, count %u, max %u, stack_size %zu: none may be NULL or 0, and "
                         "max may not be below count",
                         (void *)out, count, max, stack_size);
    const size_t page = sp_page_size();
    size_t stack = sp_align_up(stack_size, page), region_size, bytes;
    if (SP_UNLIKELY(stack < stack_size || stack + page < stack ||
                    !size_mul_add(max, stack + page, page, &region_size) ||
                    !size_mul_add(max, sizeof(sp_fiber), sizeof(sp_fiber_pool), &bytes))) {
        sp_log(SP_LOG_WARN, SP_ERR_OVERFLOW, "sp_fiber_pool_create", NULL,
               "%u fibers of %zu bytes overflow the address space", max, stack_size);
        return SP_ERR_OVERFLOW;
    }
    sp_fiber_pool *pool = calloc(1, bytes);
    if (SP_UNLIKELY(!pool)) {
        sp_log(SP_LOG_WARN, SP_ERR_NOMEM, "sp_fiber_pool_create", NULL,
               "no memory for %u fiber records", max);
        return SP_ERR_NOMEM;
    }
    pool->max = max;
    pool->stack_size = stack;
    pool->region_size = region_size;
    pool->region = sp_vm_reserve(region_size, 0, false, NULL);
    sp_fiber *first = NULL, *last = NULL;
    sp_result r = pool->region ? pool_make(pool, 0, count, &first, &last) : SP_ERR_OS;
    if (SP_UNLIKELY(r != SP_OK)) { /* each failing call has logged why */
        if (pool->region) sp_vm_release(pool->region, region_size);
        free(pool);
        return r;
    }
    pool_link(pool, first, last, count);
    *out = pool;
    return SP_OK;
}

void sp_fiber_pool_destroy(sp_fiber_pool *pool) {
    if (!pool) return;
    uint32_t in_use = sp_fiber_pool_in_use(pool);
    if (SP_UNLIKELY(in_use != 0)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_fiber_pool_destroy", pool,
                  "%u of %u fibers still acquired: release them first", in_use, pool->count);
        return;
    }
    for (uint32_t i = 0; i < pool->count; i++) {
        sp_fiber *f = &pool->fibers[i];
#if FIBER_TSAN
        __tsan_destroy_fiber(f->tsan);
#endif
#if TRACK_VALGRIND
        VALGRIND_STACK_DEREGISTER(f->valgrind_id);
#endif
#if TRACK_ASAN
        __asan_unpoison_memory_region(f->stack_lo, f->stack_size); /* abandoned frames */
#endif
        (void)f;
    }
    sp_vm_release(pool->region, pool->region_size);
    free(pool);
}

sp_fiber *sp_fiber_acquire(sp_fiber_pool *pool, sp_fiber_fn fn, void *arg) {
    if (SP_UNLIKELY(!pool || !fn)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_fiber_acquire", pool, "NULL %s", pool ? "fn" : "pool");
        return NULL;
    }
    sp_mutex_lock(&pool->lock);
    /* None free: grow (a tree of waits deeper than the pool gets the fibers it needs), or wait
     * for the acquire that is growing it (or for a release). */
    while (SP_UNLIKELY(!pool->free && (pool->count < pool->max || pool->trimming))) {
        if (!pool->growing && !pool->trimming) {
            pool_grow(pool);
        } else { /* a trim puts its fibers back soon: no growth, no exhaustion for them */
            sp_mutex_unlock(&pool->lock);
            sp_thread_yield();
            sp_mutex_lock(&pool->lock);
        }
    }
    sp_fiber *f = pool->free;
    if (SP_LIKELY(f)) {
        pool->free = f->next_free;
        pool->in_use++;
        pool->ran_free -= f->ran;
        f->ran = true;
        __atomic_store_n(&f->state, FIBER_ACQUIRED, __ATOMIC_RELAXED);
    }
    sp_mutex_unlock(&pool->lock);
    if (SP_UNLIKELY(!f)) return NULL;
        /* The previous life's frames were abandoned mid-stack: their ASan redzones are still
         * poisoned, and their fake stack (if any) is dropped with them. */
#if TRACK_ASAN
    __asan_unpoison_memory_region(f->stack_lo, f->stack_size);
#endif
    f->fn = fn;
    f->arg = arg;
    f->resumer = NULL;
    f->asan_fake_stack = NULL;
    sp_fiber_ctx_init(&f->ctx, f->stack_lo, f->stack_size, fiber_entry);
    return f;
}

/* Whether f points at one of pool's fiber records. */
static bool pool_owns(const sp_fiber_pool *pool, const sp_fiber *f) {
    uintptr_t p = (uintptr_t)f, lo = (uintptr_t)pool->fibers;
    uint32_t count = __atomic_load_n(&pool->count, __ATOMIC_ACQUIRE);
    return p >= lo && p < lo + (uintptr_t)count * sizeof(sp_fiber) &&
           (p - lo) % sizeof(sp_fiber) == 0;
}

void sp_fiber_release(sp_fiber_pool *pool, sp_fiber *fiber) {
    if (SP_UNLIKELY(!pool || !pool_owns(pool, fiber))) {
        sp_misuse(SP_ERR_FOREIGN_POINTER, "sp_fiber_release", fiber,
                  "fiber %p is not from fiber pool %p", (void *)fiber, (void *)pool);
        return;
    }
    sp_mutex_lock(&pool->lock);
    bool acquired = fiber->state == FIBER_ACQUIRED;
    if (SP_LIKELY(acquired)) {
        __atomic_store_n(&fiber->state, FIBER_FREE, __ATOMIC_RELAXED);
        fiber->next_free = pool->free;
        pool->free = fiber;
        pool->in_use--;
        pool->ran_free++;
    }
    sp_mutex_unlock(&pool->lock);
    if (SP_UNLIKELY(!acquired)) /* reported after unlocking: the logger may take its time */
        sp_misuse(SP_ERR_DOUBLE_FREE, "sp_fiber_release", fiber, "fiber %p is already free",
                  (void *)fiber);
}

uint32_t sp_fiber_pool_in_use(sp_fiber_pool *pool) {
    sp_mutex_lock(&pool->lock);
    uint32_t n = pool->in_use;
    sp_mutex_unlock(&pool->lock);
    return n;
}

uint32_t sp_fiber_pool_count(sp_fiber_pool *pool) {
    return __atomic_load_n(&pool->count, __ATOMIC_ACQUIRE);
}

uint32_t sp_fiber_pool_trim(sp_fiber_pool *pool, uint32_t max) {
    /* Take up to max free fibers that ran off the list (acquires wait for them rather than
     * grow the pool), purge their stacks with the lock released (a madvise each, and a
     * failure is logged: a logger may ask the pool anything), put them back. */
    sp_fiber *taken = NULL;
    uint32_t n = 0;
    sp_mutex_lock(&pool->lock);
    for (sp_fiber **link = &pool->free; *link && !pool->trim_off && n < max && pool->ran_free;) {
        sp_fiber *f = *link;
        if (!f->ran) {
            link = &f->next_free;
            continue;
        }
        *link = f->next_free;
        f->next_free = taken;
        taken = f;
        pool->ran_free--;
        n++;
    }
    pool->trimming += n;
    sp_mutex_unlock(&pool->lock);
    uint32_t done = 0;
    bool failed = false;
    for (sp_fiber *f = taken; f && !failed; f = f->next_free) {
        failed = sp_vm_purge(f->stack_lo, f->stack_size) != SP_OK;
        f->ran = failed;
        done += !failed;
    }
    if (!n) return 0;
    sp_mutex_lock(&pool->lock);
    sp_fiber *last = taken;
    for (sp_fiber *f = taken; f; last = f, f = f->next_free) pool->ran_free += f->ran;
    last->next_free = pool->free;
    pool->free = taken;
    pool->trimming -= n;
    pool->trim_off |= failed;
    sp_mutex_unlock(&pool->lock);
    return done;
}

uint32_t sp_fiber_pool_stacks_used(sp_fiber_pool *pool) {
    sp_mutex_lock(&pool->lock);
    uint32_t n = pool->in_use + pool->ran_free + pool->trimming;
    sp_mutex_unlock(&pool->lock);
    return n;
}

void sp_fiber_stack(const sp_fiber *fiber, void **lo, size_t *size) {
    *lo = fiber->stack_lo;
    *size = fiber->stack_size;
}

/* ---- thread fibers --------------------------------------------------------------------- */

sp_fiber *sp_fiber_thread_record(void) {
    sp_fiber *f = calloc(1, sizeof *f);
    if (SP_UNLIKELY(!f)) {
        sp_log(SP_LOG_WARN, SP_ERR_NOMEM, "sp_fiber_thread_enter", NULL,
               "no memory for a thread fiber");
        return NULL;
    }
    f->state = FIBER_THREAD;
    return f;
}

void sp_fiber_thread_bind(sp_fiber *f) {
#if FIBER_TSAN
    f->tsan = __tsan_get_current_fiber();
#else
    (void)f;
#endif
}

sp_fiber *sp_fiber_thread_enter(void) {
    sp_fiber *f = sp_fiber_thread_record();
    if (f) sp_fiber_thread_bind(f);
    return f;
}

void sp_fiber_thread_leave(sp_fiber *self) {
    if (!self) return;
    if (SP_UNLIKELY(self->pool || self->state != FIBER_THREAD)) {
        sp_misuse(SP_ERR_FOREIGN_POINTER, "sp_fiber_thread_leave", self,
                  "fiber %p is not a thread fiber", (void *)self);
        return;
    }
    free(self);
}
