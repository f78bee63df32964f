/* Handle heap space: block headers, holes in size-segregated lists, the top, commit and trim.
 * Callers hold the heap lock (alloc/free) or run alone (compaction). Every function touching
 * headers or links is TRACK_INTERNAL: headers and holes are poisoned for the user. */
#include "handle_internal.h"

/* Class of a hole of u units (u >= 2): exact below 16 units, then 8 classes per doubling.
 * Largest: u < 2^32 gives 16 + 27 * 8 + 7 = 239 < HCLASSES. */
unsigned space_class(uint64_t u) {
    if (u < 16) return (unsigned)u;
    unsigned fl = 63u - (unsigned)__builtin_clzll(u);
    unsigned sl = (unsigned)(u >> (fl - 3)) & 7u;
    return 16u + (fl - 4u) * 8u + sl;
}

/* The first class whose every hole holds u units. */
static unsigned class_up(uint64_t u) {
    if (u < 16) return (unsigned)u;
    unsigned fl = 63u - (unsigned)__builtin_clzll(u);
    return space_class(u + ((uint64_t)1 << (fl - 3)) - 1);
}

void space_live_insert(sp_handle_heap *h, uint32_t slot, uint32_t need) {
    unsigned c = space_class(need);
    hcold *k = &h->cold[slot];
    k->lprev = HNONE;
    k->lnext = h->live_lists[c];
    if (k->lnext != HNONE) h->cold[k->lnext].lprev = slot;
    h->live_lists[c] = slot;
    h->live_bitmap[c / 64] |= (uint64_t)1 << (c % 64);
}

void space_live_remove(sp_handle_heap *h, uint32_t slot, uint32_t need) {
    unsigned c = space_class(need);
    hcold *k = &h->cold[slot];
    if (k->lprev != HNONE)
        h->cold[k->lprev].lnext = k->lnext;
    else
        h->live_lists[c] = k->lnext;
    if (k->lnext != HNONE) h->cold[k->lnext].lprev = k->lprev;
    if (h->live_lists[c] == HNONE) h->live_bitmap[c / 64] &= ~((uint64_t)1 << (c % 64));
}

TRACK_INTERNAL void space_hole_insert(sp_handle_heap *h, hblk *b) {
    hfree *f = (hfree *)b;
    unsigned c = space_class(b->size);
    f->head.id = 0;
    f->prev_free = NULL;
    f->next = h->lists[c];
    if (f->next) f->next->prev_free = f;
    h->lists[c] = f;
    h->bitmap[c / 64] |= (uint64_t)1 << (c % 64);
    h->hole_bytes += units_bytes(b->size);
}

TRACK_INTERNAL void space_hole_remove(sp_handle_heap *h, hblk *b) {
    hfree *f = (hfree *)b;
    unsigned c = space_class(b->size);
    if (f->prev_free)
        f->prev_free->next = f->next;
    else
        h->lists[c] = f->next;
    if (f->next) f->next->prev_free = f->prev_free;
    if (!h->lists[c]) h->bitmap[c / 64] &= ~((uint64_t)1 << (c % 64));
    h->hole_bytes -= units_bytes(b->size);
}

TRACK_INTERNAL hblk *space_hole_find(sp_handle_heap *h, uint32_t units) {
    unsigned c = class_up(units);
    for (unsigned w = c / 64; w < HCLASSES / 64; w++) {
        uint64_t bits = h->bitmap[w];
        if (w == c / 64) bits &= ~(uint64_t)0 << (c % 64);
        if (!bits) continue;
        hblk *b = &h->lists[w * 64 + (unsigned)__builtin_ctzll(bits)]->head;
        space_hole_remove(h, b);
        return b;
    }
    return NULL;
}

TRACK_INTERNAL size_t space_largest_hole(const sp_handle_heap *h) {
    for (unsigned w = HCLASSES / 64; w-- > 0;) {
        if (!h->bitmap[w]) continue;
        unsigned c = w * 64 + 63u - (unsigned)__builtin_clzll(h->bitmap[w]);
        size_t best = 0;
        unsigned n = 0;
        for (const hfree *f = h->lists[c]; f && n < LARGEST_WALK; f = f->next, n++)
            if (units_bytes(f->head.size) > best) best = units_bytes(f->head.size);
        return best;
    }
    return 0;
}

TRACK_INTERNAL void space_header(sp_handle_heap *h, hblk *b, uint32_t units, uint32_t prev) {
    b->size = units;
    b->prev = prev;
    b->id = 0;
    b->pins = 0;
    hblk *n = blk_next(b);
    if ((char *)n == h->top)
        h->top_prev = units;
    else
        n->prev = units;
}

void space_note_change(sp_handle_heap *h) {
    if (!h->low) return;
    h->caught_up = false;
    h->wraps = 0;
}

/* A hole at start (n units) appeared: keep the compaction scan on block starts and remember
 * holes left behind it (the pass goes back for them once it reaches the top); compaction is
 * not caught up. */
static void space_note_hole(sp_handle_heap *h, char *start, uint32_t n) {
    h->caught_up = false;
    if (start >= h->scan) return;
    if (h->scan < start + units_bytes(n)) {
        h->scan = start; /* the block the scan stood on was merged into this hole */
        /* A hole remembered at or above start is this one (or merged into it): the scan
         * reaches it anyway, and a later pad or move could leave `low` inside a block. */
        if (h->low && h->low >= start) h->low = NULL;
    } else {
        if (!h->low || start < h->low) h->low = start;
        h->wraps = 0; /* behind the scan: this pass must go back (again) */
    }
}

TRACK_INTERNAL hblk *space_release(sp_handle_heap *h, hblk *b, uint32_t units) {
    hblk *start = b;
    uint64_t n = units;
    if (b->prev) {
        hblk *p = blk_prev(b);
        if (p->id == 0) {
            space_hole_remove(h, p);
            start = p;
            n += p->size;
        }
    }
    char *end = (char *)b + units_bytes(units);
    if (end == h->top) { /* joins the top */
        h->top = (char *)start;
        h->top_prev = start->prev;
        if (h->scan > h->top) h->scan = h->top;
        if (h->low && h->low >= h->top) h->low = NULL;
        space_note_change(h); /* blocks nearest the top are others now */
        return NULL;
    }
    hblk *nb = (hblk *)end;
    if (nb->id == 0) {
        space_hole_remove(h, nb);
        n += nb->size;
    }
    if (n > UINT32_MAX)
        sp_die(SP_ERR_CORRUPT, "sp_handle_free", b, "hole of %llu units", (unsigned long long)n);
    space_header(h, start, (uint32_t)n, start->prev);
    space_hole_insert(h, start);
    space_note_hole(h, (char *)start, (uint32_t)n);
    return start;
}

TRACK_INTERNAL uint32_t space_carve(sp_handle_heap *h, hblk *b, uint32_t units) {
    uint32_t total = b->size;
    if (total - units < HMIN_UNITS) return total;
    b->size = units;
    hblk *r = blk_next(b);
    space_header(h, r, total - units, units);
    space_hole_insert(h, r);
    space_note_hole(h, (char *)r, total - units);
    return units;
}

sp_result space_commit(sp_handle_heap *h, char *need) {
    if (need <= h->committed) return SP_OK;
    if (need > h->end) return SP_ERR_NOMEM;
    char *c = (char *)sp_align_up((uintptr_t)need, HCOMMIT_STEP);
    if (c > h->end) c = h->end;
    sp_result r = sp_vm_commit(h->committed, (size_t)(c - h->committed));
    if (r != SP_OK) return r;
    track_pool(h->committed, (size_t)(c - h->committed));
    h->committed = c;
    return SP_OK;
}

size_t space_trim(sp_handle_heap *h, size_t max_bytes) {
    size_t used = (size_t)(h->top - h->base);
    size_t slack = (size_t)(h->committed - h->top);
    /* Trim when the slack passes 1/64 of the used part (at least one commit step), down to
     * 1/128 (the commit step above the top at least): at rest, at most 1/64 of the heap or
     * one step above the top, and a band between the two against commit/decommit ping-pong. */
    size_t hi = used / 64 > HCOMMIT_STEP ? used / 64 : HCOMMIT_STEP;
    if (slack <= hi) return 0;
    size_t lo = used / 128;
    char *c = (char *)sp_align_up((uintptr_t)(h->top + lo), HCOMMIT_STEP);
    if (c >= h->committed) return 0;
    if ((size_t)(h->committed - c) > max_bytes) c = h->committed - max_bytes;
    size_t n = (size_t)(h->committed - c);
    if (sp_vm_decommit(c, n) != SP_OK) return 0;
    h->committed = c;
    return n;
}
