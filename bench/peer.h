/* What the allocator areas (tlsf, tcache) share: which process malloc an executable measures
 * (built with -DBENCH_PEER_JEMALLOC, _TCMALLOC, _MIMALLOC or _SPINDLE_MALLOC, else glibc),
 * harness memory from
 * the platform layer (never from the allocator under test), and the seeded generator. */
#ifndef BENCH_PEER_H
#define BENCH_PEER_H

#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "sp_platform.h"

#if defined(BENCH_PEER_JEMALLOC)
#define PEER_NAME "jemalloc"
#define PEER_LIB "libjemalloc"
#elif defined(BENCH_PEER_TCMALLOC)
#define PEER_NAME "tcmalloc"
#define PEER_LIB "libtcmalloc"
#elif defined(BENCH_PEER_MIMALLOC)
#define PEER_NAME "mimalloc"
#define PEER_LIB "libmimalloc"
#elif defined(BENCH_PEER_SPINDLE_MALLOC)
#define PEER_NAME "spindle-malloc" /* spindle's own drop-in, libspindle-malloc.so */
#define PEER_LIB "libspindle-malloc"
#else
#define BENCH_PEER_GLIBC 1
#define PEER_NAME "glibc"
#define PEER_LIB "libc.so"
#endif

/* The file the process malloc comes from, if it is PEER_LIB's; else NULL after saying so on
 * stderr (`exe` names the executable in the message). */
static inline const char *peer_malloc_lib(const char *exe) {
    Dl_info info = {0};
    void *sym = dlsym(RTLD_DEFAULT, "malloc");
    if (!sym || !dladdr(sym, &info) || !info.dli_fname || !strstr(info.dli_fname, PEER_LIB)) {
        fprintf(stderr, "%s: malloc resolves to %s, expected %s\n", exe,
                sym && info.dli_fname ? info.dli_fname : "(unknown)", PEER_LIB);
        return NULL;
    }
    return info.dli_fname;
}

typedef struct region {
    void *p;
    size_t size;
} region;

/* Reserve and commit `bytes` (rounded to pages; faulted on first touch). NULL on failure. */
static inline void *region_get(region *r, size_t bytes) {
    size_t page = sp_page_size();
    r->size = (bytes + page - 1) / page * page;
    r->p = sp_vm_reserve(r->size, 0, false, NULL);
    if (r->p && sp_vm_commit(r->p, r->size) != SP_OK) {
        sp_vm_release(r->p, r->size);
        r->p = NULL;
    }
    return r->p;
}

static inline void region_put(region *r) {
    if (r->p) sp_vm_release(r->p, r->size);
    r->p = NULL;
}

static inline uint64_t rng_next(uint64_t *s) /* splitmix64 */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

#endif
