/* What the allocator areas (tlsf, tcache) share: which process malloc an executable measures
 * (built with -DBENCH_PEER_JEMALLOC, _TCMALLOC or _MIMALLOC, else glibc), harness memory from
 * the platform layer (never from the allocator under test), and the seeded generator. */
#ifndef BENCH_PEER_H
#define BENCH_PEER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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
#else
#define BENCH_PEER_GLIBC 1
#define PEER_NAME "glibc"
#define PEER_LIB "libc.so"
#endif

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
