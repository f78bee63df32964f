/* libspindle-malloc.so: the C allocation functions over the thread caches, for LD_PRELOAD.
 *
 * malloc, free, calloc, realloc, reallocarray, posix_memalign, aligned_alloc, memalign,
 * valloc, pvalloc and malloc_usable_size, with glibc's conventions (errno ENOMEM on failure,
 * realloc(p, 0) frees). Alignments: EINVAL for what the call does not accept at all (not a
 * power of two, or for posix_memalign not a multiple of sizeof(void *); memalign rounds up and
 * refuses only above SIZE_MAX / 2 + 1), ENOMEM for a valid alignment above the caches' 1 GiB
 * (SP_TCACHE_MAX_ALIGN): a request that cannot be served, as POSIX reserves EINVAL for the
 * alignment's form. Everything initialises on the first call
 * without allocating through malloc (mmap, a futex lock, a C11 tss key); threads attach on
 * their first allocation and detach at exit; frees that later thread-exit code makes (other
 * destructors, libc's own) go through a shared fallback cache. fork: pthread_atfork handlers
 * take every global lock across the fork. SPINDLE_MALLOC_STATS=1 prints the aggregated status
 * to stderr at exit (tests use it to prove the library served the process).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sp_internal.h"
#include "sp_tcache.h"

#define EXPORT __attribute__((visibility("default")))

/* The prototypes are glibc's (<malloc.h> would declare them too). */
EXPORT void *memalign(size_t align, size_t size);
EXPORT void *valloc(size_t size);
EXPORT void *pvalloc(size_t size);
EXPORT size_t malloc_usable_size(void *p);
EXPORT void *reallocarray(void *p, size_t n, size_t size);

EXPORT void *malloc(size_t size) {
    void *p = sp_tcache_alloc(size);
    if (SP_UNLIKELY(!p)) errno = ENOMEM;
    return p;
}

EXPORT void free(void *p) {
    sp_tcache_free(p);
}

EXPORT void *calloc(size_t n, size_t size) {
    void *p = sp_tcache_calloc(n, size);
    if (!p) errno = ENOMEM;
    return p;
}

EXPORT void *realloc(void *p, size_t size) {
    void *q = sp_tcache_realloc(p, size); /* size 0 with a block: freed, NULL */
    if (!q && (size || !p)) errno = ENOMEM;
    return q;
}

EXPORT void *reallocarray(void *p, size_t n, size_t size) {
    size_t bytes;
    if (__builtin_mul_overflow(n, size, &bytes)) {
        errno = ENOMEM;
        return NULL;
    }
    return realloc(p, bytes);
}

/* align: a power of two. */
static void *aligned(size_t align, size_t size) {
    if (align > SP_TCACHE_MAX_ALIGN) {
        errno = ENOMEM;
        return NULL;
    }
    void *p = sp_tcache_aligned_alloc(align, size);
    if (!p) errno = ENOMEM;
    return p;
}

EXPORT int posix_memalign(void **out, size_t align, size_t size) {
    if (!sp_is_pow2(align) || align % sizeof(void *)) return EINVAL;
    if (align > SP_TCACHE_MAX_ALIGN) return ENOMEM;
    void *p = sp_tcache_aligned_alloc(align, size);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

EXPORT void *aligned_alloc(size_t align, size_t size) {
    if (!sp_is_pow2(align)) {
        errno = EINVAL;
        return NULL;
    }
    return aligned(align, size);
}

/* glibc's memalign takes any alignment and rounds it up to a power of two. */
EXPORT void *memalign(size_t align, size_t size) {
    if (align > SIZE_MAX / 2 + 1) {
        errno = EINVAL;
        return NULL;
    }
    size_t a = 16;
    while (a < align) a <<= 1;
    return aligned(a, size);
}

EXPORT void *valloc(size_t size) {
    return aligned(sp_page_size(), size);
}

EXPORT void *pvalloc(size_t size) {
    size_t page = sp_page_size();
    if (size > SIZE_MAX - page) {
        errno = ENOMEM;
        return NULL;
    }
    return aligned(page, sp_align_up(size, page));
}

EXPORT size_t malloc_usable_size(void *p) {
    return p ? sp_tcache_usable_size(p) : 0;
}

/* ---- process hooks ------------------------------------------------------------------------ */

__attribute__((constructor)) static void preload_init(void) {
    pthread_atfork(sp_tcache_fork_prepare, sp_tcache_fork_parent, sp_tcache_fork_child);
}

__attribute__((destructor)) static void preload_report(void) {
    const char *env = getenv("SPINDLE_MALLOC_STATS");
    if (!env || env[0] != '1') return;
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    char line[256];
    int n = snprintf(line, sizeof line,
                     "spindle-malloc: pid %d high_water %zu live_blocks %zu caches %zu "
                     "remote_frees %zu\n",
                     (int)getpid(), st.high_water, st.live_blocks, st.caches, st.remote_frees);
    if (n > 0) (void)!write(STDERR_FILENO, line, (size_t)n);
}
