/* Handle heap compaction: close holes from the bottom up by moving unpinned blocks down,
 * within a time budget, resuming where the previous call stopped. Runs alone (between
 * frames): takes no lock; alloc and free are refused while it runs (the `compacting` flag). */
#include <string.h>

#include "handle_internal.h"

#define RUN_CAP ((size_t)64 << 10) /* bytes per slide memmove: bounds one move's duration */
#define FILL_LOOKBACK 256          /* blocks below the top examined for a fit */
#define TRIM_NS 20000              /* budget kept for a decommit */

enum { HOLE_MOVED, HOLE_LEFT, HOLE_STOP, HOLE_NA };

typedef struct step {
    uint64_t t0, budget_ticks; /* 0: no budget */
    uint64_t moved, blocks;
} step;

TRACK_INTERNAL static hcold *cold_of(const sp_handle_heap *h, const hblk *b) {
    return &h->cold[id_index(h, b->id)];
}

/* Whether live block b may move down by `delta` bytes: unpinned, alignment kept. */
TRACK_INTERNAL static bool blk_movable(const sp_handle_heap *h, const hblk *b, size_t delta) {
    if (b->id == 0 || __atomic_load_n(&b->pins, __ATOMIC_ACQUIRE)) return false;
    return delta % ((size_t)1 << cold_of(h, b)->align_log2) == 0;
}

/* Whether moving `bytes` now still fits the budget (estimate from measured bandwidth). */
static bool step_afford(const sp_handle_heap *h, const step *st, size_t bytes) {
    if (!st->budget_ticks) return true;
    double spent = (double)(sp_ticks() - st->t0);
    return spent + (double)bytes / h->bytes_per_tick <= (double)st->budget_ticks;
}

static bool step_over(const step *st) {
    return st->budget_ticks && sp_ticks() - st->t0 >= st->budget_ticks;
}

/* Move the blocks [src, src+bytes) to dst (below src), with their headers; slots point at
 * the new payloads. Old bytes no block covers now end up poisoned (the caller's headers and
 * holes stay allocator-internal). */
TRACK_INTERNAL static void run_move(sp_handle_heap *h, step *st, char *src, size_t bytes,
                                    char *dst) {
    for (hblk *b = (hblk *)src; (char *)b < src + bytes; b = blk_next(b))
        track_free(blk_payload(b), cold_of(h, b)->size);
    bool overlap = dst + bytes > src;
    if (overlap) {
        track_release(dst, (size_t)(src - dst) + bytes);
    } else {
        track_release(dst, bytes);
        track_release(src, bytes);
    }
    uint64_t t = sp_ticks();
    memmove(dst, src, bytes);
    t = sp_ticks() - t;
    if (bytes >= 4096 && t > 0)
        h->bytes_per_tick = 0.75 * h->bytes_per_tick + 0.25 * ((double)bytes / (double)t);
    if (overlap) {
        track_pool(dst, (size_t)(src - dst) + bytes);
    } else {
        track_pool(dst, bytes);
        track_pool(src, bytes);
    }
    for (hblk *b = (hblk *)dst; (char *)b < dst + bytes; b = blk_next(b)) {
        hcold *c = cold_of(h, b);
        __atomic_store_n(&slot_at(h, id_index(h, b->id))->ptr, blk_payload(b), __ATOMIC_RELAXED);
        track_malloc(blk_payload(b), c->size, 1);
        st->blocks++;
    }
    st->moved += bytes;
}

/* Relocation callbacks of the blocks now at [dst, dst+bytes), which moved down by delta. */
TRACK_INTERNAL static void run_notify(sp_handle_heap *h, char *dst, size_t bytes, size_t delta) {
    for (hblk *b = (hblk *)dst; (char *)b < dst + bytes; b = blk_next(b)) {
        hcold *c = cold_of(h, b);
        if (c->fn)
            c->fn(c->user, (sp_handle){b->id}, blk_payload(b), (char *)blk_payload(b) + delta);
    }
}

TRACK_INTERNAL static hblk *run_last(char *dst, size_t bytes) {
    hblk *b = (hblk *)dst;
    while ((char *)blk_next(b) < dst + bytes) b = blk_next(b);
    return b;
}

/* The moved blocks [H, H+moved) sit at the front of what was hole H (hs units, followed by
 * live block n): the rest becomes a hole, slack of the last block, or nothing. */
TRACK_INTERNAL static void hole_rest(sp_handle_heap *h, hblk *H, uint32_t hs, size_t moved,
                                     hblk *n) {
    hblk *last = run_last((char *)H, moved);
    uint32_t rem = hs - (uint32_t)(moved >> HUNIT_SHIFT);
    if (rem >= HMIN_UNITS) {
        hblk *g = (hblk *)((char *)H + moved);
        space_header(h, g, rem, last->size);
        space_hole_insert(h, g);
    } else {
        last->size += rem;
        n->prev = last->size;
    }
}

/* Slide the `run` bytes of blocks above hole H down over it; the hole moves above them and
 * merges with what follows (a hole, or the top). */
TRACK_INTERNAL static int hole_slide(sp_handle_heap *h, step *st, hblk *H, size_t run) {
    if (!step_afford(h, st, run)) return HOLE_STOP;
    uint32_t hs = H->size, hp = H->prev;
    size_t hbytes = units_bytes(hs);
    space_hole_remove(h, H);
    run_move(h, st, (char *)H + hbytes, run, (char *)H);
    H->prev = hp;
    hblk *last = run_last((char *)H, run);
    char *g = (char *)H + run, *x = g + hbytes;
    if (x == h->top) {
        h->top = g;
        h->top_prev = last->size;
    } else {
        uint32_t n = hs;
        if (((hblk *)x)->id == 0) {
            space_hole_remove(h, (hblk *)x);
            n += ((hblk *)x)->size;
        }
        space_header(h, (hblk *)g, n, last->size);
        space_hole_insert(h, (hblk *)g);
    }
    h->scan = g;
    run_notify(h, (char *)H, run, hbytes);
    return HOLE_MOVED;
}

/* Units of the block ending at p (p a block start or the top); 0 at the bottom. */
TRACK_INTERNAL static uint32_t below_units(const sp_handle_heap *h, const char *p) {
    return p == h->top ? h->top_prev : ((const hblk *)p)->prev;
}

/* Move the longest run of blocks ending at the top that fits into hole H. */
TRACK_INTERNAL static int hole_fill_tail(sp_handle_heap *h, step *st, hblk *H) {
    hblk *n = blk_next(H);
    size_t hbytes = units_bytes(H->size), tot = 0;
    char *r0 = h->top;
    for (uint32_t u; (u = below_units(h, r0)) != 0;) {
        hblk *b = (hblk *)(r0 - units_bytes(u));
        if ((char *)b <= (char *)n || tot + units_bytes(u) > hbytes || !blk_movable(h, b, 0)) break;
        tot += units_bytes(u);
        r0 = (char *)b;
    }
    if (!tot) return HOLE_NA;
    size_t delta = (size_t)(r0 - (char *)H);
    for (hblk *b = (hblk *)r0; (char *)b < h->top; b = blk_next(b))
        if (!blk_movable(h, b, delta)) return HOLE_NA;
    if (!step_afford(h, st, tot)) return HOLE_STOP;
    uint32_t hs = H->size, hp = H->prev, r0prev = ((hblk *)r0)->prev;
    space_hole_remove(h, H);
    run_move(h, st, r0, tot, (char *)H);
    H->prev = hp;
    hole_rest(h, H, hs, tot, n);
    h->top = r0;
    h->top_prev = r0prev;
    hblk *b = (hblk *)(r0 - units_bytes(r0prev));
    if (r0prev && b->id == 0) { /* a hole right below the old run joins the top */
        space_hole_remove(h, b);
        h->top = (char *)b;
        h->top_prev = b->prev;
    }
    run_notify(h, (char *)H, tot, delta);
    return HOLE_MOVED;
}

/* Move into hole H one of the FILL_LOOKBACK blocks nearest the top that fits; its old place
 * becomes a hole near the top (closed cheaply later). */
TRACK_INTERNAL static int hole_fill_above(sp_handle_heap *h, step *st, hblk *H) {
    hblk *n = blk_next(H), *b = NULL;
    size_t hbytes = units_bytes(H->size);
    char *p = h->top;
    for (int k = 0; k < FILL_LOOKBACK; k++) {
        uint32_t u = below_units(h, p);
        if (!u) break;
        hblk *c = (hblk *)(p - units_bytes(u));
        if ((char *)c <= (char *)n) break;
        if (units_bytes(u) <= hbytes && blk_movable(h, c, (size_t)((char *)c - (char *)H))) {
            b = c;
            break;
        }
        p = (char *)c;
    }
    if (!b) return HOLE_NA;
    uint32_t need = units_for(cold_of(h, b)->size), bsize = b->size;
    size_t bytes = units_bytes(need); /* the block's slack stays behind */
    if (!step_afford(h, st, bytes)) return HOLE_STOP;
    uint32_t hs = H->size, hp = H->prev;
    space_hole_remove(h, H);
    b->size = need;
    run_move(h, st, (char *)b, bytes, (char *)H);
    b->size = bsize;
    H->prev = hp;
    hole_rest(h, H, hs, bytes, n);
    b->id = 0; /* the old header, still intact above */
    space_release(h, b, bsize);
    run_notify(h, (char *)H, bytes, (size_t)((char *)b - (char *)H));
    return HOLE_MOVED;
}

/* Block n above hole H is aligned above 16 and cannot move by the hole's size: give the
 * smallest pad after which it can to the live block below H (as slack, moved with it later).
 * The hole shrinks by the pad, or vanishes if under HMIN_UNITS remain. */
TRACK_INTERNAL static int hole_pad(sp_handle_heap *h, hblk *H, hblk *n) {
    size_t a = (size_t)1 << cold_of(h, n)->align_log2;
    uintptr_t pay = (uintptr_t)blk_payload(H);
    uint32_t pad = (uint32_t)((sp_align_up(pay, a) - pay) / HUNIT);
    if (!H->prev || pad == 0 || pad >= H->size) return HOLE_NA;
    hblk *below = blk_prev(H);
    uint32_t hs = H->size;
    space_hole_remove(h, H);
    if (hs - pad < HMIN_UNITS) pad = hs;
    below->size += pad;
    if (pad == hs) {
        n->prev = below->size;
        h->scan = (char *)n;
    } else {
        hblk *g = (hblk *)((char *)H + units_bytes(pad));
        space_header(h, g, hs - pad, below->size);
        space_hole_insert(h, g);
        h->scan = (char *)g;
    }
    return HOLE_MOVED;
}

/* Close (or shrink, or move up) hole H at the scan position. */
TRACK_INTERNAL static int hole_close(sp_handle_heap *h, step *st, hblk *H) {
    size_t hbytes = units_bytes(H->size), run = 0;
    hblk *x = blk_next(H); /* live: holes never touch each other or the top */
    if (!__atomic_load_n(&x->pins, __ATOMIC_ACQUIRE) && !blk_movable(h, x, hbytes) &&
        hole_pad(h, H, x) == HOLE_MOVED)
        return HOLE_MOVED;
    while ((char *)x < h->top && x->id != 0 && run < RUN_CAP && blk_movable(h, x, hbytes)) {
        run += units_bytes(x->size);
        x = blk_next(x);
    }
    bool open = (char *)x == h->top || x->id == 0;
    if (run && open && run <= 4 * hbytes + 4096) return hole_slide(h, st, H, run);
    int r = hole_fill_tail(h, st, H);
    if (r == HOLE_NA) r = hole_fill_above(h, st, H);
    if (r != HOLE_NA) return r;
    if (run) return hole_slide(h, st, H, run);
    return HOLE_LEFT; /* a pinned (or unmovably aligned) block right above, nothing fits */
}

TRACK_INTERNAL sp_result sp_handle_compact(sp_handle_heap *h, uint64_t budget_ns,
                                           sp_handle_compact_stats *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!h) return sp_misuse(SP_ERR_INVALID_ARG, "sp_handle_compact", NULL, "NULL heap");
    if (__atomic_load_n(&h->compacting, __ATOMIC_RELAXED))
        return sp_misuse(SP_ERR_BUSY, "sp_handle_compact", h,
                         "compaction called from a relocation callback");
    if (h->desc.may_compact && !h->desc.may_compact(h->desc.may_compact_user))
        return sp_misuse(SP_ERR_BUSY, "sp_handle_compact", h,
                         "compaction refused: jobs may be running (may_compact said no)");
    __atomic_store_n(&h->compacting, 1, __ATOMIC_RELAXED);
    track_enter();
    step st = {.t0 = sp_ticks()};
    if (budget_ns) {
        double t = (double)budget_ns / h->ns_per_tick;
        st.budget_ticks = t < 1.0 ? 1 : (uint64_t)t;
    }
    bool wrapped = false, finished = false;
    unsigned walked = 0;
    if (h->scan > h->top) h->scan = h->top;
    for (;;) {
        char *s = h->scan;
        if (s >= h->top) {
            if (h->low && h->low >= h->top) h->low = NULL;
            if (h->low && !wrapped) {
                h->scan = h->low;
                h->low = NULL;
                wrapped = true;
                continue;
            }
            finished = true;
            break;
        }
        hblk *b = (hblk *)s;
        if (b->id != 0) {
            h->scan = (char *)blk_next(b);
            if ((++walked & 63) == 0 && step_over(&st)) break;
            continue;
        }
        int r = hole_close(h, &st, b);
        if (r == HOLE_STOP) break;
        if (r == HOLE_LEFT) {
            if (!h->low || s < h->low) h->low = s;
            h->scan = (char *)blk_next(b);
        }
    }
    if (finished) h->caught_up = true;
    if (finished || !st.budget_ticks ||
        (double)(sp_ticks() - st.t0) + TRIM_NS / h->ns_per_tick < (double)st.budget_ticks)
        space_trim(h);
    uint64_t ns = (uint64_t)((double)(sp_ticks() - st.t0) * h->ns_per_tick);
    h->moved_last = st.moved;
    h->moved_total += st.moved;
    h->compact_ns_last = ns;
    track_leave();
    __atomic_store_n(&h->compacting, 0, __ATOMIC_RELAXED);
    if (out) {
        out->bytes_moved = st.moved;
        out->blocks_moved = st.blocks;
        out->ns = ns;
        out->caught_up = finished;
    }
    return SP_OK;
}
