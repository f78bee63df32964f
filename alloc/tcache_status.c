/* Thread caches: status (per thread and aggregated), tidy and trim. Walks span lists under the
 * list locks; per-span counters are read with relaxed atomic loads (their owners store them
 * that way), so figures of running caches are a snapshot, exact when they are quiescent. */
#include <string.h>

#include "tcache_heap.h"
#include "track.h"

/* Add span s to the figures: held by a cache (on its empty list: empty_list), or detached (an
 * orphan or a spare). */
static void span_count(const span *s, sp_tcache_status *st, bool empty_list, bool detached) {
    uint32_t used = span_used(s);
    uint32_t bs = s->block_size;
    if (detached) {
        st->spans_orphaned++;
    } else {
        st->spans++;
        st->spans_empty += empty_list || used == 0;
    }
    st->live_blocks += used;
    st->class_live[s->cls] += used;
    st->bytes_used += (size_t)used * bs;
    st->free_blocks += s->capacity - used;
    st->bytes_free += (size_t)(s->capacity - used) * bs;
    st->bytes_overhead += SP_TCACHE_SPAN - (size_t)s->capacity * bs;
}

static void cache_count(cache *c, sp_tcache_status *st) {
    sp_mutex_lock(&c->lock);
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++) {
        span *cur = (span *)c->pub.cur[k];
        if (cur != &tcache_sentinel) span_count(cur, st, false, false);
        span *r = c->ring[k];
        if (r) {
            span *s = r;
            do {
                span_count(s, st, false, false);
                s = s->next;
            } while (s != r);
        }
    }
    for (span *s = c->empty; s; s = s->next) span_count(s, st, true, false);
    sp_mutex_unlock(&c->lock);
    st->remote_frees += __atomic_load_n(&c->remote_frees, __ATOMIC_RELAXED);
    st->remote_collected += __atomic_load_n(&c->remote_collected, __ATOMIC_RELAXED);
}

/* Zero st; false (nothing to count) before init. A NULL st is misuse under `call`. */
static bool status_begin(sp_tcache_status *st, const char *call) {
    if (SP_NULL_ARG(st, call, NULL, "out")) return false;
    memset(st, 0, sizeof *st);
    if (!atomic_load_explicit(&tc.ready, memory_order_acquire)) return false;
    st->class_count = tc.class_count;
    for (uint32_t k = 0; k < tc.class_count; k++) st->class_size[k] = tcache_class_size(k);
    return true;
}

void sp_tcache_status_local(sp_tcache_status *st) {
    cache *c = (cache *)sp_tcache_tls;
    if (!status_begin(st, "sp_tcache_status_local") || !c->registered) return;
    cache_count(c, st);
    st->caches = 1;
}

void sp_tcache_status_get(sp_tcache_status *st) {
    if (!status_begin(st, "sp_tcache_status_get")) return;
    sp_mutex_lock(&tc.reg_lock);
    for (cache *c = tc.registry; c; c = c->reg_next) cache_count(c, st);
    st->caches = tc.cache_count;
    st->remote_frees += tc.retired_remote_frees;
    st->remote_collected += tc.retired_collected;
    size_t caches = tc.cache_count;
    sp_mutex_unlock(&tc.reg_lock);
    sp_mutex_lock(&tc.fallback_lock);
    cache_count(&tc.fallback, st);
    sp_mutex_unlock(&tc.fallback_lock);
    sp_mutex_lock(&tc.orphan_lock);
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++) {
        for (span *s = tc.orphans[k]; s; s = s->next) span_count(s, st, false, true);
        for (span *s = tc.spares[k]; s; s = s->next) span_count(s, st, false, true);
    }
    sp_mutex_unlock(&tc.orphan_lock);
    st->remote_frees += atomic_load_explicit(&tc.unattached_remote_frees, memory_order_relaxed);
    st->remote_collected += atomic_load_explicit(&tc.orphan_collected, memory_order_relaxed);
    st->remote_pending =
        st->remote_frees > st->remote_collected ? st->remote_frees - st->remote_collected : 0;

    heap_status(&tc.spans, &st->span_heap);
    heap_status(&tc.large, &st->large_heap);
    /* Cache records take one span each from the span heap; the large heap is users' only. */
    st->large_blocks = st->large_heap.live_blocks;
    st->live_blocks += st->large_heap.live_blocks;
    st->bytes_used += st->large_heap.bytes_used;
    st->bytes_free += st->large_heap.bytes_free + st->span_heap.bytes_free;
    st->bytes_overhead +=
        st->large_heap.bytes_overhead + st->span_heap.bytes_overhead + caches * SP_TCACHE_SPAN;
    st->largest_free = st->large_heap.largest_free;
    st->high_water = st->large_heap.high_water + st->span_heap.high_water;
    st->fragmentation = st->large_heap.fragmentation;
}

size_t sp_tcache_allocated(void) {
    if (!atomic_load_explicit(&tc.ready, memory_order_acquire)) return 0;
    sp_mutex_lock(&tc.count_lock); /* not reg_lock: status walks hold it for long */
    size_t n = tc.retired_allocated;
    for (cache *c = tc.registry; c; c = c->reg_next)
        n += __atomic_load_n(&c->pub.allocated, __ATOMIC_RELAXED);
    sp_mutex_unlock(&tc.count_lock);
    return n + __atomic_load_n(&tc.fallback.pub.allocated, __ATOMIC_RELAXED) +
           atomic_load_explicit(&tc.large_allocated, memory_order_relaxed);
}

void sp_tcache_heap_status(sp_tlsf_status *spans, sp_tlsf_status *large) {
    bool ready = atomic_load_explicit(&tc.ready, memory_order_acquire);
    heap *from[2] = {&tc.spans, &tc.large};
    sp_tlsf_status *out[2] = {spans, large};
    for (int i = 0; i < 2; i++) {
        if (!out[i]) continue;
        if (ready)
            heap_status(from[i], out[i]);
        else
            memset(out[i], 0, sizeof *out[i]);
    }
}

/* ---- tidy and trim ------------------------------------------------------------------------ */

/* Take span s's inbox back (c its owner, or c's lock holder); if that left it empty, it goes
 * the way of a span its owner emptied (tcache_span_emptied: kept while c keeps fewer than
 * keep_empty). Returns the bytes returned. */
static size_t ring_span_tidy(cache *c, span *s) {
    return span_collect(s, c) && span_used(s) == 0 ? tcache_span_emptied(c, s) : 0;
}

/* Trim: take c's inboxes back and return every empty span, current and kept ones too. */
static size_t cache_sweep_all(cache *c) {
    size_t bytes = 0;
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++) {
        span *cur = (span *)c->pub.cur[k];
        if (cur != &tcache_sentinel) {
            span_collect(cur, c);
            if (span_used(cur) == 0) {
                sp_mutex_lock(&c->lock);
                tcache_set_cur(c, k, &tcache_sentinel);
                sp_mutex_unlock(&c->lock);
                span_release(cur);
                bytes += SP_TCACHE_SPAN;
            }
        }
        /* An emptied span leaves the ring: walk its length as it was, the next one saved. */
        span *s = c->ring[k];
        for (uint32_t n = c->ring_len[k]; n > 0; n--) {
            span *next = s->next;
            span_collect(s, c);
            if (span_used(s) == 0) {
                sp_mutex_lock(&c->lock);
                tcache_ring_remove(c, s);
                sp_mutex_unlock(&c->lock);
                span_release(s);
                bytes += SP_TCACHE_SPAN;
            }
            s = next;
        }
    }
    return bytes + tcache_empty_release(c);
}

/* Tidy: take back the inboxes of c's current spans and of up to TCACHE_TIDY_SPANS ring spans,
 * going on where the last tidy stopped: in class tidy_class, tidy_left spans of its ring
 * still to walk, from its head (a ring walked in part is rotated past what was walked, as
 * ring_scan rotates it). A class is done once its ring's length was walked, so a ring longer
 * than the budget does not hold the walk. Current and kept empty spans stay. */
static size_t cache_sweep_some(cache *c) {
    size_t bytes = 0;
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++) {
        span *cur = (span *)c->pub.cur[k];
        if (cur != &tcache_sentinel) span_collect(cur, c);
    }
    uint32_t budget = TCACHE_TIDY_SPANS, k = c->tidy_class;
    for (uint32_t i = 0; i < SP_TCACHE_CLASSES && budget > 0; i++) {
        uint32_t left = c->tidy_left ? c->tidy_left : c->ring_len[k];
        if (left > c->ring_len[k]) left = c->ring_len[k]; /* the ring shrank meanwhile */
        uint32_t n = left < budget ? left : budget;
        span *s = c->ring[k];
        for (uint32_t j = n; j > 0; j--) {
            span *next = s->next; /* s may leave the ring; next was not walked yet: it stays */
            bytes += ring_span_tidy(c, s);
            s = next;
        }
        budget -= n;
        c->tidy_left = left - n;
        if (c->tidy_left > 0) { /* the next tidy starts at s */
            sp_mutex_lock(&c->lock);
            c->ring[k] = s;
            sp_mutex_unlock(&c->lock);
            break;
        }
        k = (k + 1) % SP_TCACHE_CLASSES;
    }
    c->tidy_class = k;
    return bytes;
}

/* Orphan s's inbox collected; s returned if that left it empty (orphan lock held). */
static size_t orphan_visit(span *s) {
    span_collect(s, NULL);
    if (span_used(s) != 0) return 0;
    tcache_orphan_unlink(s);
    span_release(s);
    return SP_TCACHE_SPAN;
}

/* Trim: every orphan visited (orphan lock held); a tidy's pass under way ends with it. */
static size_t orphans_walk_all(void) {
    size_t bytes = 0;
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++)
        for (span *s = tc.orphans[k], *next; s; s = next) {
            next = s->next;
            bytes += orphan_visit(s);
        }
    tc.orphan_pass = false;
    return bytes;
}

/* Tidy: a pass over the orphans goes on for up to TCACHE_TIDY_SPANS of them (orphan lock held);
 * starts one when frees reached orphans since the last (frees: orphan_frees now). */
static size_t orphans_walk_some(size_t frees) {
    if (!tc.orphan_pass) {
        if (frees == atomic_load_explicit(&tc.orphan_frees_seen, memory_order_relaxed)) return 0;
        tc.orphan_pass = true;
        tc.orphan_pass_frees = frees;
        tc.orphan_walk_class = 0;
        tc.orphan_walk_at = tc.orphans[0];
    }
    size_t bytes = 0;
    for (uint32_t budget = TCACHE_TIDY_SPANS; budget > 0;) {
        span *s = tc.orphan_walk_at;
        if (!s) { /* that class is done */
            if (++tc.orphan_walk_class == SP_TCACHE_CLASSES) {
                tc.orphan_pass = false;
                atomic_store_explicit(&tc.orphan_frees_seen, tc.orphan_pass_frees,
                                      memory_order_relaxed);
                break;
            }
            tc.orphan_walk_at = tc.orphans[tc.orphan_walk_class];
            continue;
        }
        tc.orphan_walk_at = s->next;
        bytes += orphan_visit(s);
        budget--;
    }
    return bytes;
}

/* sp_tcache_tidy (all false) and sp_tcache_trim (all true): the caller's cache swept, and
 * (trim) the fallback cache's; the orphans walked when frees reached them since the last walk
 * (tidy: TCACHE_TIDY_SPANS of them a call, going on with its pass; trim: all of them, always);
 * (trim) the spares returned. */
static size_t give_back(bool all) {
    if (!atomic_load_explicit(&tc.ready, memory_order_acquire)) return 0;
    track_enter();
    size_t bytes = 0;
    cache *c = (cache *)sp_tcache_tls;
    if (c->registered) bytes += all ? cache_sweep_all(c) : cache_sweep_some(c);
    if (all) {
        sp_mutex_lock(&tc.fallback_lock);
        bytes += cache_sweep_all(&tc.fallback);
        sp_mutex_unlock(&tc.fallback_lock);
    }
    /* Seen moves only when a pass ends: a tidy takes the orphan lock while one is under way. */
    if (all || atomic_load_explicit(&tc.orphan_frees, memory_order_acquire) !=
                   atomic_load_explicit(&tc.orphan_frees_seen, memory_order_relaxed)) {
        sp_mutex_lock(&tc.orphan_lock);
        size_t frees = atomic_load_explicit(&tc.orphan_frees, memory_order_acquire);
        if (all) {
            atomic_store_explicit(&tc.orphan_frees_seen, frees, memory_order_relaxed);
            bytes += orphans_walk_all();
        } else {
            bytes += orphans_walk_some(frees);
        }
        for (uint32_t k = 0; all && k < SP_TCACHE_CLASSES; k++)
            for (span *s; (s = tcache_spare_pop(k)) != NULL; bytes += SP_TCACHE_SPAN)
                span_release(s);
        sp_mutex_unlock(&tc.orphan_lock);
    }
    track_leave();
    return bytes;
}

void tcache_orphans_tidy(uint32_t steps) {
    if (atomic_load_explicit(&tc.orphan_frees, memory_order_relaxed) ==
            atomic_load_explicit(&tc.orphan_frees_seen, memory_order_relaxed) ||
        !sp_mutex_trylock(&tc.orphan_lock))
        return;
    track_enter();
    do orphans_walk_some(atomic_load_explicit(&tc.orphan_frees, memory_order_acquire));
    while (--steps > 0 && tc.orphan_pass);
    track_leave();
    sp_mutex_unlock(&tc.orphan_lock);
}

size_t sp_tcache_tidy(void) {
    return give_back(false);
}

size_t sp_tcache_trim(void) {
    return give_back(true);
}
