/* The thread caches' central heaps (tcache_heap.h): TLSF over a half of the reservation,
 * committed in chunks that double (one TLSF pool per chunk, SP_TLSF_MAX_POOLS at most). */
#include <string.h>

#include "sp_internal.h"
#include "tcache_heap.h"

enum { FIRST_CHUNK = 16 << 20 };

void heap_open(heap *h, const char *name, char *base, size_t limit) {
    memset(h, 0, sizeof *h);
    h->base = (uintptr_t)base;
    h->limit = limit;
    h->name = name;
    h->next_chunk = FIRST_CHUNK;
}

void heap_close(heap *h) {
    if (h->t) sp_tlsf_destroy(h->t);
    h->t = NULL;
}

/* Commit the next chunk (big enough for `need` bytes) and add it as a pool. Lock held. */
static bool heap_grow(heap *h, size_t need) {
    size_t committed = atomic_load_explicit(&h->committed, memory_order_relaxed);
    size_t chunk = h->next_chunk;
    size_t want = (size_t)sp_align_up(need + need / 8 + (1 << 20), 2 << 20);
    if (chunk < want) chunk = want;
    if (chunk > h->limit - committed) chunk = h->limit - committed;
    if (chunk < need + 4096) return false;
    void *at = (void *)(h->base + committed);
    if (sp_vm_commit(at, chunk) != SP_OK) return false;
    if (!h->t) {
        sp_tlsf_desc d = {.memory = at, .size = chunk, .locked = false, .name = h->name};
        h->t = sp_tlsf_create(&d, NULL);
        if (!h->t) return false;
    } else if (sp_tlsf_add_pool(h->t, at, chunk) != SP_OK) {
        sp_vm_decommit(at, chunk);
        return false;
    }
    atomic_store_explicit(&h->committed, committed + chunk, memory_order_release);
    if (h == &tc.spans)
        __atomic_store_n(&sp_tcache_g.span_bytes, committed + chunk, __ATOMIC_RELEASE);
    h->next_chunk = chunk * 2;
    return true;
}

void *heap_alloc(heap *h, size_t align, size_t size) {
    sp_mutex_lock(&h->lock);
    void *p = NULL;
    for (int tries = 0; tries < 2 && !p; tries++) {
        if (h->t)
            p = align <= 16 ? sp_tlsf_malloc(h->t, size) : sp_tlsf_aligned_alloc(h->t, align, size);
        if (!p && (size > h->limit || !heap_grow(h, size + align))) break;
    }
    sp_mutex_unlock(&h->lock);
    return p;
}

/* Under h's lock: whether p is a live block of h (the TLSF call that follows then reports
 * nothing); else its verdict, for heap_report once the lock is released. */
static sp_result heap_check(heap *h, const void *p, const char **why) {
    if (h->t) return sp_tlsf_check_ptr(h->t, p, why);
    *why = "the heap holds no block yet";
    return SP_ERR_FOREIGN_POINTER;
}

/* After the unlock: a fatal handler may longjmp out of the report, and must leave no lock. */
SP_COLD static void heap_report(heap *h, const char *call, const void *p, sp_result r,
                                const char *why) {
    sp_misuse(r, call, p, "%p: %s (heap '%s')", p, why, h->name);
}

void heap_free(heap *h, void *p, const char *call) {
    const char *why = NULL;
    sp_mutex_lock(&h->lock);
    sp_result r = heap_check(h, p, &why);
    if (r == SP_OK) sp_tlsf_free(h->t, p);
    sp_mutex_unlock(&h->lock);
    if (r != SP_OK) heap_report(h, call, p, r, why);
}

size_t heap_usable(heap *h, const void *p, const char *call) {
    const char *why = NULL;
    sp_mutex_lock(&h->lock);
    sp_result r = heap_check(h, p, &why);
    size_t n = r == SP_OK ? sp_tlsf_usable_size(h->t, p) : 0;
    sp_mutex_unlock(&h->lock);
    if (r != SP_OK) heap_report(h, call, p, r, why);
    return n;
}

void *heap_realloc(heap *h, void *p, size_t size, const char *call) {
    const char *why = NULL;
    sp_mutex_lock(&h->lock);
    sp_result r = heap_check(h, p, &why);
    void *q = r == SP_OK ? sp_tlsf_realloc(h->t, p, size) : NULL;
    sp_mutex_unlock(&h->lock);
    if (r != SP_OK) heap_report(h, call, p, r, why);
    return q;
}

void heap_status(heap *h, sp_tlsf_status *out) {
    sp_mutex_lock(&h->lock);
    if (h->t)
        sp_tlsf_status_get(h->t, out);
    else
        memset(out, 0, sizeof *out);
    sp_mutex_unlock(&h->lock);
}

void heap_lock_all(bool lock) {
    if (lock) {
        sp_mutex_lock(&tc.spans.lock);
        sp_mutex_lock(&tc.large.lock);
    } else {
        sp_mutex_unlock(&tc.large.lock);
        sp_mutex_unlock(&tc.spans.lock);
    }
}
