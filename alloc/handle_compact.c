/* Handle heap compaction: close holes from the bottom up by moving unpinned blocks down,
 * within a time budget, resuming where the previous call stopped. Runs alone (between
 * frames): holds the heap lock for the whole call, so other threads' calls wait; the compacting
 * thread's own alloc and free (from relocation callbacks) are refused (`compactor`). */
#include <stddef.h>
#include <string.h>

#include "handle_internal.h"

#define RUN_CAP ((size_t)64 << 10)   /* bytes per slide memmove: bounds one move's duration */
#define FILL_LOOKBACK 256            /* blocks below the top examined for a fit */
#define TRIM_CHUNK ((size_t)2 << 20) /* bytes decommitted between looks at the clock */
#define TRIM_BYTES_PER_NS 25         /* decommit speed assumed (28-36 measured on touched pages) */
#define TRIM_CALL_NS 20000           /* and the system calls' own time, per decommit */
#define RUN_BLOCKS 256               /* blocks per move (callback bookkeeping on the stack) */
#define ABSORB_UNITS 4               /* holes up to 64 bytes that nothing fits become slack */
#define LIVE_TRIES 64                /* candidates examined per size class of the live index */
#define LIVE_TOTAL 256               /* and in all */
#define PASS_WRAPS 4                 /* walks back to the lowest hole left, at most, a pass */

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
    if (b->id == 0 || b->pins) return false;
    return delta % ((size_t)1 << cold_of(h, b)->align_log2) == 0;
}

/* Units block b needs (its slack dropped). */
TRACK_INTERNAL static uint32_t blk_need(const sp_handle_heap *h, const hblk *b) {
    return units_for(cold_of(h, b)->size);
}

/* Bytes that can still be moved within the budget (estimate from measured bandwidth);
 * SIZE_MAX without a budget. The first move of a call is always allowed (progress). */
static size_t step_room(const sp_handle_heap *h, const step *st) {
    if (!st->budget_ticks || !st->blocks) return SIZE_MAX;
    /* conservative: 5% of the budget kept for the search around each move, and the
     * bandwidth taken at 80% (cold caches, page faults at the top) */
    uint64_t spent = sp_ticks() - st->t0, keep = st->budget_ticks / 20;
    if (spent + keep >= st->budget_ticks) return 0;
    return (size_t)((double)(st->budget_ticks - spent - keep) * h->bytes_per_tick * 0.8);
}

static bool step_over(const step *st) {
    return st->budget_ticks && sp_ticks() - st->t0 >= st->budget_ticks;
}

/* Old payload offsets of the blocks one move placed, for the relocation callbacks. */
typedef struct moved {
    uint32_t n;
    ptrdiff_t delta[RUN_BLOCKS]; /* old - new address of each block */
} moved;

/* Move the blocks [src, src+bytes) (at most RUN_BLOCKS) down to dst, packed: each keeps the
 * units it needs, slack is dropped (memmove per stretch without slack). Slots point at the new
 * payloads; headers' sizes and prev links inside the run are right, the first block's prev is
 * the caller's. Old bytes no block covers now are poisoned. Returns the packed length. */
TRACK_INTERNAL static size_t run_move(sp_handle_heap *h, step *st, char *src, size_t bytes,
                                      char *dst, moved *mv) {
    char *end = src + bytes;
    size_t packed = 0;
    for (hblk *b = (hblk *)src; (char *)b < end; b = blk_next(b)) {
        track_free(blk_payload(b), cold_of(h, b)->size);
        packed += units_bytes(blk_need(h, b));
    }
    bool overlap = dst < src && dst + packed > src; /* moves go down, or to the top */
    if (overlap) {
        track_release(dst, (size_t)(end - dst));
    } else {
        track_release(dst, packed);
        track_release(src, bytes);
    }
    uint64_t t = sp_ticks();
    char *s = src, *d = dst, *seg_s = src, *seg_d = dst;
    mv->n = 0;
    while (s < end) {
        hblk *b = (hblk *)s;
        size_t size = units_bytes(b->size), need = units_bytes(blk_need(h, b));
        mv->delta[mv->n++] = s - d;
        b->size = (uint32_t)(need >> HUNIT_SHIFT); /* moves with the stretch below */
        s += size;
        d += need;
        if (need != size) { /* flush the stretch ending with this block's needed part */
            memmove(seg_d, seg_s, (size_t)(s - size + need - seg_s));
            seg_s = s;
            seg_d = d;
        }
    }
    if (seg_s < end) memmove(seg_d, seg_s, (size_t)(end - seg_s));
    t = sp_ticks() - t;
    if (bytes >= 4096 && t > 0)
        h->bytes_per_tick = 0.75 * h->bytes_per_tick + 0.25 * ((double)bytes / (double)t);
    if (overlap) {
        track_pool(dst, (size_t)(end - dst));
    } else {
        track_pool(dst, packed);
        track_pool(src, bytes);
    }
    uint32_t prev = 0;
    for (hblk *b = (hblk *)dst; (char *)b < d; b = blk_next(b)) {
        if ((char *)b != dst) b->prev = prev;
        prev = b->size;
        slot_set(h, slot_at(h, id_index(h, b->id)), b->id, blk_payload(b));
        track_malloc(blk_payload(b), cold_of(h, b)->size, 1);
        st->blocks++;
    }
    st->moved += bytes;
    return (size_t)(d - dst);
}

/* Relocation callbacks of the blocks now at [dst, dst+bytes). */
TRACK_INTERNAL static void run_notify(sp_handle_heap *h, char *dst, size_t bytes, const moved *mv) {
    uint32_t i = 0;
    for (hblk *b = (hblk *)dst; (char *)b < dst + bytes; b = blk_next(b), i++) {
        hcold *c = cold_of(h, b);
        if (c->fn)
            c->fn(c->user, (sp_handle){b->id}, blk_payload(b),
                  (char *)blk_payload(b) + mv->delta[i]);
    }
}

TRACK_INTERNAL static hblk *run_last(char *dst, size_t bytes) {
    hblk *b = (hblk *)dst;
    while ((char *)blk_next(b) < dst + bytes) b = blk_next(b);
    return b;
}

/* The moved blocks [H, H+moved) sit at the front of what was hole H (hs units, followed by
 * live block n): the rest becomes a hole, slack of the last block, or nothing. */
TRACK_INTERNAL static void hole_rest(sp_handle_heap *h, hblk *H, uint32_t hs, size_t moved_bytes,
                                     hblk *n) {
    hblk *last = run_last((char *)H, moved_bytes);
    uint32_t rem = hs - (uint32_t)(moved_bytes >> HUNIT_SHIFT);
    if (rem >= HMIN_UNITS) {
        hblk *g = (hblk *)((char *)H + moved_bytes);
        space_header(h, g, rem, last->size);
        space_hole_insert(h, g);
    } else {
        last->size += rem;
        n->prev = last->size;
    }
}

/* Slide the `run` bytes of blocks above hole H down over it (packed); the hole moves above
 * them and merges with what follows (a hole, or the top). */
TRACK_INTERNAL static int hole_slide(sp_handle_heap *h, step *st, hblk *H, size_t run) {
    uint32_t hs = H->size, hp = H->prev;
    size_t hbytes = units_bytes(hs);
    moved mv;
    space_hole_remove(h, H);
    size_t packed = run_move(h, st, (char *)H + hbytes, run, (char *)H, &mv);
    H->prev = hp;
    hblk *last = run_last((char *)H, packed);
    char *g = (char *)H + packed, *x = (char *)H + hbytes + run;
    if (x == h->top) {
        h->top = g;
        h->top_prev = last->size;
    } else {
        uint32_t n = (uint32_t)((size_t)(x - g) >> HUNIT_SHIFT);
        if (((hblk *)x)->id == 0) {
            space_hole_remove(h, (hblk *)x);
            n += ((hblk *)x)->size;
        }
        space_header(h, (hblk *)g, n, last->size);
        space_hole_insert(h, (hblk *)g);
    }
    h->scan = g;
    run_notify(h, (char *)H, packed, &mv);
    return HOLE_MOVED;
}

/* Units of the block ending at p (p a block start or the top); 0 at the bottom. */
TRACK_INTERNAL static uint32_t below_units(const sp_handle_heap *h, const char *p) {
    return p == h->top ? h->top_prev : ((const hblk *)p)->prev;
}

/* Move the longest run of blocks ending at the top that fits into hole H (blocks aligned to
 * at most 16: packing changes their offsets). */
TRACK_INTERNAL static int hole_fill_tail(sp_handle_heap *h, step *st, hblk *H) {
    hblk *n = blk_next(H);
    /* A call's first move has no estimate to stop it (progress): as a slide's, it takes at
     * most RUN_CAP bytes, or one larger block (it moved up to RUN_BLOCKS blocks of any size:
     * 8 MiB on a 50 us budget, 80x over). */
    const bool first = st->budget_ticks && !st->blocks;
    size_t hbytes = units_bytes(H->size), tot = 0, room = first ? RUN_CAP : step_room(h, st);
    char *r0 = h->top;
    uint32_t count = 0;
    bool no_room = false;
    for (uint32_t u; count < RUN_BLOCKS && (u = below_units(h, r0)) != 0; count++) {
        hblk *b = (hblk *)(r0 - units_bytes(u));
        if ((char *)b <= (char *)n || tot + units_bytes(u) > hbytes || !blk_movable(h, b, HUNIT))
            break;
        if (tot + units_bytes(u) > room && !(first && tot == 0)) {
            no_room = true;
            break;
        }
        tot += units_bytes(u);
        r0 = (char *)b;
    }
    if (!tot) return no_room ? HOLE_STOP : HOLE_NA;
    uint32_t hs = H->size, hp = H->prev, r0prev = ((hblk *)r0)->prev;
    moved mv;
    space_hole_remove(h, H);
    size_t packed = run_move(h, st, r0, tot, (char *)H, &mv);
    H->prev = hp;
    hole_rest(h, H, hs, packed, n);
    h->top = r0;
    h->top_prev = r0prev;
    hblk *b = (hblk *)(r0 - units_bytes(r0prev));
    if (r0prev && b->id == 0) { /* a hole right below the old run joins the top */
        space_hole_remove(h, b);
        h->top = (char *)b;
        h->top_prev = b->prev;
    }
    run_notify(h, (char *)H, packed, &mv);
    return HOLE_MOVED;
}

/* The live block that fits hole H best, from the size index: the largest class that fits, up
 * to LIVE_TRIES candidates per class, the highest one above the hole (so that the hole it
 * leaves is near the top). NULL if no live block above fits. */
TRACK_INTERNAL static hblk *live_best(const sp_handle_heap *h, const hblk *H, uint32_t hs,
                                      uint32_t *need_out) {
    const char *above = (const char *)H + units_bytes(hs);
    unsigned c = space_class(hs);
    uint32_t tries = 0;
    for (;;) {
        hblk *best = NULL;
        for (uint32_t i = h->live_lists[c], k = 0;
             i != HNONE && k < LIVE_TRIES && tries < LIVE_TOTAL;
             i = h->cold[i].lnext, k++, tries++) {
            hblk *b = blk_of(slot_ptr(h, slot_at(h, i)));
            uint32_t need = units_for(h->cold[i].size);
            if (need <= hs && (char *)b > above && (!best || b > best) && !b->pins) {
                best = b;
                *need_out = need;
            }
        }
        if (best) return best;
        if (c == 0 || tries >= LIVE_TOTAL) return NULL; /* on to the next lower class */
        unsigned w = (c - 1) / 64;
        uint64_t bits = h->live_bitmap[w] & (~(uint64_t)0 >> (63 - (c - 1) % 64));
        while (!bits && w > 0) bits = h->live_bitmap[--w];
        if (!bits) return NULL;
        c = w * 64 + 63u - (unsigned)__builtin_clzll(bits);
    }
}

/* Move live block b (above hole H, needing at most H's units) into H, packed; the rest of H
 * stays a hole (or slack), b's old place is released. */
TRACK_INTERNAL static void hole_put(sp_handle_heap *h, step *st, hblk *H, hblk *b) {
    hblk *n = blk_next(H);
    uint32_t hs = H->size, hp = H->prev, bsize = b->size;
    moved mv;
    space_hole_remove(h, H);
    size_t packed = run_move(h, st, (char *)b, units_bytes(bsize), (char *)H, &mv);
    H->prev = hp;
    hole_rest(h, H, hs, packed, n);
    b->size = bsize; /* the old header, still intact above (run_move set its packed size) */
    b->id = 0;
    space_release(h, b, bsize);
    run_notify(h, (char *)H, packed, &mv);
}

/* Hole H becomes slack of the live block below it (nothing moves; the slack goes when that
 * block moves, packed, or is freed). HOLE_NA at the bottom of the heap. */
TRACK_INTERNAL static int hole_absorb(sp_handle_heap *h, hblk *H) {
    if (!H->prev) return HOLE_NA;
    hblk *below = blk_prev(H), *n = blk_next(H); /* live: holes never touch */
    space_hole_remove(h, H);
    below->size += H->size;
    n->prev = below->size;
    h->scan = (char *)n;
    return HOLE_MOVED;
}

/* Move into hole H the largest of the FILL_LOOKBACK blocks nearest the top that fits (best
 * fit), else the best one the live-size index offers; its old place becomes a hole, closed
 * later (cheaply when near the top). If no live block above fits and the hole is at most
 * ABSORB_UNITS, it becomes slack of the live block below it (nothing moves; the slack goes
 * when that block moves, packed, or is freed); else HOLE_NA, and the caller slides. */
TRACK_INTERNAL static int hole_fill_above(sp_handle_heap *h, step *st, hblk *H) {
    hblk *n = blk_next(H), *b = NULL;
    uint32_t hs = H->size, best = 0;
    char *p = h->top;
    for (int k = 0; k < FILL_LOOKBACK; k++) {
        uint32_t u = below_units(h, p);
        hblk *c = (hblk *)(p - units_bytes(u));
        if (!u || (char *)c <= (char *)n) break;
        p = (char *)c;
        if (!blk_movable(h, c, (size_t)((char *)c - (char *)H))) continue;
        uint32_t need = blk_need(h, c);
        if (need <= hs && need > best) {
            best = need;
            b = c;
            if (need == hs) break;
        }
    }
    if (!b) b = live_best(h, H, hs, &best);
    if (!b) return hs <= ABSORB_UNITS ? hole_absorb(h, H) : HOLE_NA;
    if (units_bytes(best) > step_room(h, st)) return HOLE_STOP;
    hole_put(h, st, H, b);
    return HOLE_MOVED;
}

/* Every block above hole H is larger than it (sizes stratify as compaction pulls small blocks
 * down). Rather than slide everything up to the next hole, move the block n right above H to
 * the top, so that H and n's place form one hole, and move into it a block from above that
 * needs more than n (so the hole left over is smaller than H was). HOLE_NA if there is none,
 * or n cannot move. Cost: n's and that block's bytes. */
TRACK_INTERNAL static int hole_evacuate(sp_handle_heap *h, step *st, hblk *H) {
    hblk *n = blk_next(H);
    if ((char *)blk_next(n) >= h->top || !blk_movable(h, n, HUNIT) ||
        cold_of(h, n)->align_log2 > HUNIT_SHIFT)
        return HOLE_NA;
    uint32_t hs = H->size, nsize = n->size, nneed = blk_need(h, n), mneed = 0;
    uint64_t merged = (uint64_t)hs + nsize;
    hblk *m = live_best(h, (hblk *)H, (uint32_t)merged, &mneed); /* above n */
    if (!m || mneed <= nneed) return HOLE_NA;
    if (units_bytes(nneed) + units_bytes(mneed) > step_room(h, st)) return HOLE_STOP;
    char *t = h->top;
    if (space_commit(h, t + units_bytes(nneed)) != SP_OK) return HOLE_NA;
    moved mv;
    run_move(h, st, (char *)n, units_bytes(nsize), t, &mv);
    ((hblk *)t)->prev = h->top_prev;
    h->top = t + units_bytes(nneed);
    h->top_prev = nneed;
    run_notify(h, t, units_bytes(nneed), &mv);
    /* H and n's old place become one hole (the block after n is live or a hole) */
    hblk *x = (hblk *)((char *)n + units_bytes(nsize));
    space_hole_remove(h, H);
    if (x->id == 0) {
        space_hole_remove(h, x);
        merged += x->size;
    }
    space_header(h, H, (uint32_t)merged, H->prev);
    space_hole_insert(h, H);
    /* n's relocation callback may have pinned m: then m stays, the hole waits. */
    if (m->pins) return HOLE_MOVED;
    hole_put(h, st, H, m);
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
    size_t hbytes = units_bytes(H->size), run = 0, room = step_room(h, st);
    hblk *x = blk_next(H); /* live: holes never touch each other or the top */
    if (!x->pins && !blk_movable(h, x, hbytes) && hole_pad(h, H, x) == HOLE_MOVED)
        return HOLE_MOVED;
    /* the run above: the first block moves by the hole's size, the rest packed behind it */
    for (uint32_t count = 0; (char *)x < h->top && x->id != 0 && count < RUN_BLOCKS; count++) {
        size_t size = units_bytes(x->size);
        if (run && (run + size > RUN_CAP || run + size > room || !blk_movable(h, x, HUNIT))) break;
        if (!run && !blk_movable(h, x, hbytes)) break;
        run += size;
        x = blk_next(x);
    }
    bool open = (char *)x == h->top || x->id == 0;
    if (run && open && run <= 4 * hbytes + 4096) {
        if (run > room) return HOLE_STOP;
        return hole_slide(h, st, H, run);
    }
    int r = hole_fill_tail(h, st, H);
    if (r == HOLE_NA) r = hole_fill_above(h, st, H);
    if (r != HOLE_NA) return r;
    if (!run) {
        /* A pinned block right above, nothing fits: left (space_note_change reopens it). A
         * block aligned above what the hole can shift it by, nothing fits: it never will, so
         * the hole becomes slack of the block below, as hole_pad makes a pad. */
        if (x->pins) return HOLE_LEFT;
        r = hole_absorb(h, H);
        return r == HOLE_NA ? HOLE_LEFT : r;
    }
    r = hole_evacuate(h, st, H);
    if (r != HOLE_NA) return r;
    if (run > room) return HOLE_STOP;
    return hole_slide(h, st, H, run);
}

TRACK_INTERNAL sp_result sp_handle_compact(sp_handle_heap *h, uint64_t budget_ns,
                                           sp_handle_compact_stats *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!h) return sp_misuse(SP_ERR_INVALID_ARG, "sp_handle_compact", NULL, "NULL heap");
    if (heap_busy(h))
        return sp_misuse(SP_ERR_BUSY, "sp_handle_compact", h,
                         "compaction called from a relocation callback");
    if (h->desc.may_compact && !h->desc.may_compact(h->desc.may_compact_user))
        return sp_misuse(SP_ERR_BUSY, "sp_handle_compact", h,
                         "compaction refused: jobs may be running (may_compact said no)");
    /* The lock for the whole call: any other thread's alloc, free, pin or unpin waits (and
     * then sees the blocks where they are now) instead of racing the moves. */
    sp_mutex_lock(&h->lock);
    __atomic_store_n(&h->compactor, handle_self(), __ATOMIC_RELAXED);
    track_enter();
    step st = {.t0 = sp_ticks()};
    if (budget_ns) {
        double t = (double)budget_ns / h->ns_per_tick;
        /* A budget past 2^63 ticks (centuries) is none: the conversion would overflow. */
        st.budget_ticks = t < 1.0 ? 1 : t < 0x1p63 ? (uint64_t)t : 0;
    }
    /* Caught up: no hole appeared or opened up since the last pass ended, nothing to walk. */
    bool finished = h->caught_up;
    unsigned walked = 0;
    bool first_hole = true;
    if (h->scan > h->top) h->scan = h->top;
    while (!finished) {
        char *s = h->scan;
        if (s >= h->top) {
            if (h->low && h->low >= h->top) h->low = NULL;
            /* Back to the lowest hole left, whatever the calls it takes; again (up to
             * PASS_WRAPS times a pass, so that moves that only shuffle cannot keep a pass from
             * ending) while the last walk from there moved anything: it may have made a left
             * hole closable. */
            uint64_t moved_so_far = h->moved_total + st.moved;
            if (h->low && h->wraps < PASS_WRAPS && (!h->wraps || h->wrap_moved != moved_so_far)) {
                h->scan = h->low;
                h->low = NULL;
                h->wraps++;
                h->wrap_moved = moved_so_far;
                continue;
            }
            h->wraps = 0;
            finished = true;
            break;
        }
        hblk *b = (hblk *)s;
        if (b->id != 0) {
            h->scan = (char *)blk_next(b);
            if ((++walked & 63) == 0 && step_over(&st)) break;
            continue;
        }
        /* The first hole of the call always (every call makes progress), then the budget. */
        if (!first_hole && step_over(&st)) break;
        first_hole = false;
        int r = hole_close(h, &st, b);
        if (r == HOLE_STOP) break;
        if (r == HOLE_LEFT) {
            if (!h->low || s < h->low) h->low = s;
            h->scan = (char *)blk_next(b);
        }
    }
    if (finished) h->caught_up = true;
    if (!st.budget_ticks) {
        space_trim(h, SIZE_MAX);
    } else {
        /* Give back what the heap no longer needs, TRIM_CHUNK at a time while the budget's
         * rest covers one at TRIM_BYTES_PER_NS (plus the system calls' TRIM_CALL_NS). After a
         * finished pass also a last, smaller piece that the rest covers, or at least one
         * commit step (over the budget if need be: microseconds), so that budgets too short
         * for a whole chunk give memory back too. In the middle of a pass only whole chunks:
         * small decommits every frame cost more than the estimate (why was not measured;
         * handle/budget's p99 went from 0.98 to 1.05 of the budget with them). */
        for (bool first = true;; first = false) {
            double left_ns =
                ((double)st.budget_ticks - (double)(sp_ticks() - st.t0)) * h->ns_per_tick;
            double bytes =
                left_ns > TRIM_CALL_NS ? (left_ns - TRIM_CALL_NS) * TRIM_BYTES_PER_NS : 0;
            size_t chunk = bytes >= (double)TRIM_CHUNK ? TRIM_CHUNK
                                                       : sp_align_down((size_t)bytes, HCOMMIT_STEP);
            if (!finished && chunk < TRIM_CHUNK) break;
            if (chunk == 0 && first) chunk = HCOMMIT_STEP;
            if (chunk == 0 || space_trim(h, chunk) == 0) break;
        }
    }
    uint64_t ns = (uint64_t)((double)(sp_ticks() - st.t0) * h->ns_per_tick);
    h->moved_last = st.moved;
    h->moved_total += st.moved;
    h->compact_ns_last = ns;
    track_leave();
    __atomic_store_n(&h->compactor, NULL, __ATOMIC_RELAXED);
    sp_mutex_unlock(&h->lock);
    if (out) {
        out->bytes_moved = st.moved;
        out->blocks_moved = st.blocks;
        out->ns = ns;
        out->caught_up = finished;
    }
    return SP_OK;
}
