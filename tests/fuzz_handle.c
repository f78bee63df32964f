/* libFuzzer target: operation sequences on one handle heap per input (handle limit, region size,
 * table retire and may_compact hook chosen by the first byte), against a model of what
 * sp_handle.h documents. Handle ids are predicted (oldest freed slot first, generations,
 * retirement, the handle limit); blocks carry a pattern checked before every free and after
 * every compaction, where pinned blocks must stay put, relocation callbacks must chain from the
 * old address to what resolve gives, and a full compaction with nothing pinned or aligned above
 * 16 must leave no hole. Callbacks pin, unpin, read and try the calls refused during compaction.
 * Bad input (stale, double, forged and {0} handles, a NULL heap, bad alignments and sizes,
 * unpinned unpins, pinned frees, refused compactions) must get exactly the documented answer,
 * one report where misuse is reported, and change no status figure. Every operation ends with
 * sp_handle_heap_check, the log count and every status figure against the model; every input
 * ends with pins dropped and a full compaction (no hole may be left), then everything freed: all
 * figures back to zero.
 *
 * Input: a config byte (bits 0-1 max_handles: default, 2^24 (slots retire after 255 uses), 7,
 * 100; bits 2-3 region: 1 GiB, 1 GiB, 64 KiB, 1 MiB; 4 a retire hook; 5 a may_compact hook; 6 the
 * caller's reservation), then 4-byte records  op (low 4 bits) + flags | slot | a | b. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sp_handle.h"
#include "sp_platform.h"
#include "test_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        diag(__VA_ARGS__);                                                                         \
        abort();                                                                                   \
    } while (0)
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            diag("line %d: %s", __LINE__, #cond);                                                  \
            FAIL(__VA_ARGS__);                                                                     \
        }                                                                                          \
    } while (0)

/* Records past MAX_RECORDS are ignored (a bound on one input's time). CB_ACTIVE: callbacks per
 * compaction call that act (pin, unpin, call) beyond their checks. */
enum { SLOTS = 128, MAX_RECORDS = 1024, CB_ACTIVE = 64, PENDING = 32 };

typedef struct fslot {
    sp_handle h;       /* live handle, {0}: empty */
    sp_handle stale;   /* the handle this slot freed last */
    size_t len, align; /* bytes and alignment asked (align 0: 16) */
    uint8_t *addr;     /* where the block was last seen (resolve, or its last relocation) */
    uint8_t *pin_addr; /* its address when pinned (pins > 0) */
    uint32_t pins;
    bool cb; /* allocated with a relocation callback */
    uint8_t fill;
} fslot;

/* The heap's own slot i as the model sees it. */
typedef struct hslot {
    uint32_t gen;        /* generation last issued (0: never issued) */
    uint32_t last_freed; /* id last freed from it (0: none) */
    bool live;
} hslot;

static struct {
    sp_handle_heap *heap;
    size_t region; /* region bytes */
    char *base;    /* the caller's reservation, or NULL (the heap's own) */
    uint32_t max_handles, index_bits, gen_max;
    fslot slot[SLOTS];
    hslot *hs; /* heap slots, hs_cap of them */
    uint32_t hs_cap;
    uint32_t *fifo; /* freed, unretired heap slots, oldest first (a ring of hs_cap) */
    uint32_t fifo_head, fifo_len;
    uint32_t issued, retired; /* distinct heap slots handed out; retired ones */
    size_t live, live_bytes, needed;
    uint64_t allocated_total, moved_total, moved_last, ns_last;
    int logs; /* reports expected so far */
    uint32_t cap0, capacity;
    /* hooks */
    bool use_retire, use_may, allow;
    int retires, asks, npending;
    void *pending[PENDING];
    void (*pending_free[PENDING])(void *);
    /* compaction */
    bool compacting, quiet;
    uint32_t cb_calls, cb_moves, cb_pins, cb_unpins;
    uint64_t cb_bytes;
    ts_rng rng;        /* the callbacks' choices, seeded per compaction call */
    bool caught_quiet; /* the last compaction caught up, and nothing since may open a hole */
} fz;

/* ---- model --------------------------------------------------------------------------------- */

static uint32_t idx_of(uint32_t id) {
    return id & (((uint32_t)1 << fz.index_bits) - 1);
}
static uint32_t gen_of(uint32_t id) {
    return id >> fz.index_bits;
}
/* A block's bytes at least: a 16-byte header and the size rounded up to 16, 32 at least. */
static size_t need_of(size_t n) {
    size_t r = 16 + ((n + 15) & ~(size_t)15);
    return r < 32 ? 32 : r;
}

static void model_reserve(uint32_t n) {
    if (n <= fz.hs_cap) return;
    uint32_t cap = fz.hs_cap ? fz.hs_cap : 64;
    while (cap < n) cap *= 2;
    hslot *hs = realloc(fz.hs, cap * sizeof *hs);
    uint32_t *fifo = malloc(cap * sizeof *fifo);
    if (!hs || !fifo) abort();
    memset(hs + fz.hs_cap, 0, (cap - fz.hs_cap) * sizeof *hs);
    for (uint32_t k = 0; k < fz.fifo_len; k++)
        fifo[k] = fz.fifo[(fz.fifo_head + k) & (fz.hs_cap - 1)];
    free(fz.fifo);
    fz.hs = hs;
    fz.fifo = fifo;
    fz.fifo_head = 0;
    fz.hs_cap = cap;
}

enum { FORGED, STALE_EARLIER, LAST_FREED, LIVE };
/* What an id is to the heap: live; the one its slot freed last (a free: double free); one its
 * slot freed before that; never issued. */
static int classify(uint32_t id) {
    uint32_t i = idx_of(id), g = gen_of(id);
    if (!id || i >= fz.hs_cap || !fz.hs[i].gen || !g || g > fz.hs[i].gen) return FORGED;
    if (fz.hs[i].live && g == fz.hs[i].gen) return LIVE;
    return fz.hs[i].last_freed == id ? LAST_FREED : STALE_EARLIER;
}

/* ---- status and log ---------------------------------------------------------------------- */

static sp_handle_heap_status status(void) {
    sp_handle_heap_status st;
    sp_handle_heap_status_get(fz.heap, &st);
    return st;
}

/* Whether no figure differs; the ones that do are listed. */
static bool same_status(const sp_handle_heap_status *a, const sp_handle_heap_status *b) {
    bool same = true;
#define SAME(field)                                                                                \
    do {                                                                                           \
        if (a->field != b->field) {                                                                \
            diag("%s: %.17g -> %.17g", #field, (double)a->field, (double)b->field);                \
            same = false;                                                                          \
        }                                                                                          \
    } while (0)
    SAME(live_bytes);
    SAME(live_handles);
    SAME(needed_bytes);
    SAME(used_bytes);
    SAME(hole_bytes);
    SAME(free_bytes);
    SAME(largest_free);
    SAME(committed_bytes);
    SAME(table_bytes);
    SAME(fragmentation);
    SAME(moved_last);
    SAME(moved_total);
    SAME(allocated_total);
    SAME(compact_ns_last);
    SAME(table_capacity);
    SAME(retired_slots);
    SAME(caught_up);
#undef SAME
    return same;
}

/* An allocation refused for want of memory or handles is a resource failure, not misuse: the
 * header does not say it changes nothing, and the table may have grown for it (not compared). */
static bool same_but_table(const sp_handle_heap_status *a, const sp_handle_heap_status *b) {
    sp_handle_heap_status t = *a;
    t.table_bytes = b->table_bytes;
    t.table_capacity = b->table_capacity;
    return same_status(&t, b);
}

/* Exactly one new report since the last: this id, from this call, at this level. */
static void reported(sp_result id, const char *call, sp_log_level level) {
    if (ts_logged.count != fz.logs + 1 || ts_logged.last_id != id ||
        ts_logged.last_level != level || strcmp(ts_logged.last_call, call) != 0)
        FAIL("want one report %s from %s at level %d; %d new, last %s from %s at %d (%s)",
             sp_result_name(id), call, (int)level, ts_logged.count - fz.logs,
             sp_result_name(ts_logged.last_id), ts_logged.last_call, (int)ts_logged.last_level,
             ts_logged.last_message);
    fz.logs++;
}

static void unreported(void) {
    if (ts_logged.count != fz.logs)
        FAIL("%d unexpected report(s), last %s from %s: %s", ts_logged.count - fz.logs,
             sp_result_name(ts_logged.last_id), ts_logged.last_call, ts_logged.last_message);
}

/* Every figure the model knows, and the relations sp_handle.h states between the others. */
static void status_ok(const sp_handle_heap_status *st) {
    CHECK(st->live_handles == fz.live && st->live_bytes == fz.live_bytes &&
              st->needed_bytes == fz.needed && st->allocated_total == fz.allocated_total,
          "live %zu/%zu, bytes %zu/%zu, needed %zu/%zu, allocated %llu/%llu", st->live_handles,
          fz.live, st->live_bytes, fz.live_bytes, st->needed_bytes, fz.needed,
          (unsigned long long)st->allocated_total, (unsigned long long)fz.allocated_total);
    CHECK(st->retired_slots == fz.retired, "retired %u, model %u", st->retired_slots, fz.retired);
    CHECK(st->moved_total == fz.moved_total && st->moved_last == fz.moved_last &&
              st->compact_ns_last == fz.ns_last,
          "moved %llu/%llu last %llu/%llu", (unsigned long long)st->moved_total,
          (unsigned long long)fz.moved_total, (unsigned long long)st->moved_last,
          (unsigned long long)fz.moved_last);
    CHECK(st->used_bytes >= st->needed_bytes + st->hole_bytes &&
              st->committed_bytes >= st->used_bytes && st->committed_bytes <= fz.region,
          "used %zu needed %zu holes %zu committed %zu", st->used_bytes, st->needed_bytes,
          st->hole_bytes, st->committed_bytes);
    size_t tail = st->committed_bytes - st->used_bytes;
    CHECK(st->free_bytes == st->hole_bytes + tail, "free %zu", st->free_bytes);
    CHECK(st->largest_free <= st->free_bytes && st->largest_free >= tail &&
              (st->largest_free > 0 || st->hole_bytes == 0),
          "largest %zu free %zu tail %zu", st->largest_free, st->free_bytes, tail);
    double frag = st->free_bytes ? 1.0 - (double)st->largest_free / (double)st->free_bytes : 0.0;
    CHECK(st->fragmentation == frag, "fragmentation %f, want %f", st->fragmentation, frag);
    uint32_t cap = st->table_capacity;
    CHECK(cap && (cap & (cap - 1)) == 0 && cap >= fz.issued &&
              st->table_bytes >= (size_t)cap * sizeof(sp_handle_slot),
          "table %u slots %zu bytes, %u issued", cap, st->table_bytes, fz.issued);
    if (!fz.compacting) {
        /* the table doubles; with a retire hook each old table is handed to it */
        CHECK(cap % fz.capacity == 0, "table %u after %u", cap, fz.capacity);
        fz.capacity = cap;
        int doublings = __builtin_ctz(cap) - __builtin_ctz(fz.cap0);
        CHECK(fz.retires == (fz.use_retire ? doublings : 0), "%d tables retired, %d doublings",
              fz.retires, doublings);
    }
}

/* After every operation: the heap check, no report unaccounted for, every figure. */
static void verify(void) {
    for (int k = 0; k < fz.npending; k++) fz.pending_free[k](fz.pending[k]);
    fz.npending = 0;
    CHECK(sp_handle_heap_check(fz.heap) == SP_OK, "heap check failed: %s", ts_logged.last_message);
    unreported();
    sp_handle_heap_status st = status();
    status_ok(&st);
}

/* ---- hooks ----------------------------------------------------------------------------------- */

static void retire(void *user, void *old, void (*free_fn)(void *)) {
    CHECK(user == &fz && old && free_fn && fz.npending < PENDING, "retire(%p, %p)", user, old);
    fz.pending[fz.npending] = old;
    fz.pending_free[fz.npending++] = free_fn;
    fz.retires++;
}

static bool may_compact(void *user) {
    CHECK(user == &fz, "may_compact user");
    fz.asks++;
    return fz.allow;
}

static bool aligned(const void *p, size_t align) {
    return ((uintptr_t)p & ((align ? align : 16) - 1)) == 0;
}

/* A live slot at or after slot k (wrapping) that satisfies want_pinned, or NULL. */
static fslot *live_from(uint32_t k, bool want_pinned) {
    for (int j = 0; j < SLOTS; j++) {
        fslot *g = &fz.slot[(k + (uint32_t)j) % SLOTS];
        if (g->h.id && (!want_pinned || g->pins)) return g;
    }
    return NULL;
}

static void pin_live(fslot *g) {
    uint8_t *now = sp_handle_resolve(fz.heap, g->h);
    uint8_t *p = sp_handle_pin(fz.heap, g->h);
    CHECK(p && p == now, "pin gave %p, resolve %p", (void *)p, (void *)now);
    CHECK(!g->pins || p == g->pin_addr, "pinned block at %p, pinned at %p", (void *)p,
          (void *)g->pin_addr);
    if (!g->pins) g->pin_addr = p;
    g->pins++;
}

static void unpin_live(fslot *g) {
    CHECK(sp_handle_unpin(fz.heap, g->h) == SP_OK, "unpin of a pinned block");
    g->pins--;
}

/* A call refused during compaction: SP_ERR_BUSY, one report, no figure changed. */
static void refused_in_callback(fslot *f, unsigned which) {
    static const char *const calls[] = {"sp_handle_alloc",      "sp_handle_alloc_ex",
                                        "sp_handle_free",       "sp_handle_compact",
                                        "sp_handle_heap_check", "sp_handle_heap_destroy"};
    sp_handle_heap_status a = status();
    int asks = fz.asks;
    switch (which) {
    case 0: CHECK(sp_handle_alloc(fz.heap, 16, 0).id == 0, "alloc during compaction"); break;
    case 1:
        CHECK(sp_handle_alloc_ex(fz.heap, 16, 0, NULL, NULL).id == 0, "alloc_ex in compaction");
        break;
    case 2: CHECK(sp_handle_free(fz.heap, f->h) == SP_ERR_BUSY, "free in compaction"); break;
    case 3: {
        sp_handle_compact_stats cs;
        CHECK(sp_handle_compact(fz.heap, 0, &cs) == SP_ERR_BUSY, "compact from a callback");
        fz.asks = asks; /* whether a refused nested call asks may_compact is not said */
        break;
    }
    case 4: CHECK(sp_handle_heap_check(fz.heap) == SP_ERR_BUSY, "check in compaction"); break;
    default: sp_handle_heap_destroy(fz.heap); break;
    }
    reported(SP_ERR_BUSY, calls[which], SP_LOG_ERROR);
    sp_handle_heap_status b = status();
    CHECK(same_status(&a, &b), "a call refused during compaction changed the status");
    CHECK(sp_handle_resolve(fz.heap, f->h) == f->addr, "block lost after a refused call");
}

/* The block of f moved: old must be where it was, new what resolve gives, its bytes there. */
static void relocate(void *user, sp_handle h, void *new_ptr, void *old_ptr) {
    fslot *f = user;
    CHECK(fz.compacting && f->h.id == h.id && f->cb, "relocation of 0x%x outside a compaction",
          h.id);
    CHECK(old_ptr == f->addr, "0x%x moved from %p, was at %p", h.id, old_ptr, (void *)f->addr);
    /* pinned since the move (by an earlier callback of the same move): it may not move again */
    CHECK(!f->pins || new_ptr == f->pin_addr, "pinned 0x%x moved to %p (pinned at %p)", h.id,
          new_ptr, (void *)f->pin_addr);
    CHECK(aligned(new_ptr, f->align) && sp_handle_resolve(fz.heap, h) == new_ptr,
          "0x%x moved to %p, resolve %p", h.id, new_ptr, sp_handle_resolve(fz.heap, h));
    CHECK(ts_filled(new_ptr, f->len, f->fill), "0x%x damaged by its move", h.id);
    f->addr = new_ptr;
    fz.cb_moves++;
    fz.cb_bytes += f->len;
    if (fz.quiet || fz.cb_calls++ >= CB_ACTIVE) return;
    uint32_t r = (uint32_t)ts_rng_next(&fz.rng);
    switch (r % 8) {
    case 0: /* pin the block that just moved: it must not move again this call */
        pin_live(f);
        fz.cb_pins++;
        break;
    case 1: { /* pin another block: it stays where it is now */
        fslot *g = live_from(r >> 8, false);
        pin_live(g);
        fz.cb_pins++;
        break;
    }
    case 2: { /* unpin a pinned block: it may move in the rest of this call */
        fslot *g = live_from(r >> 8, true);
        if (!g) break;
        unpin_live(g);
        fz.cb_unpins++;
        break;
    }
    case 3: { /* the calls a callback may make */
        sp_handle_heap_status st = status();
        CHECK(st.live_handles == fz.live && st.live_bytes == fz.live_bytes &&
                  st.needed_bytes == fz.needed,
              "live figures changed during compaction");
        CHECK(sp_handle_size(fz.heap, h) == f->len, "size in a callback");
        CHECK(!sp_handle_resolve(fz.heap, f->stale) && !sp_handle_size(fz.heap, f->stale),
              "stale handle in a callback");
        break;
    }
    case 4: refused_in_callback(f, (r >> 8) % 6); break;
    case 5: /* pin every block: nothing may move for the rest of the call, even a block the
             * compaction had picked before this callback */
        if (r & 0x100) break;
        for (int s = 0; s < SLOTS; s++)
            if (fz.slot[s].h.id) {
                pin_live(&fz.slot[s]);
                fz.cb_pins++;
            }
        break;
    default: break;
    }
    unreported();
}

/* ---- operations ---------------------------------------------------------------------------- */

/* Allocate into empty slot f, the id as predicted; false (checked) if refused. */
static bool alloc_checked(fslot *f, size_t n, size_t align, bool cb) {
    sp_handle_heap_status a = status();
    sp_handle h = cb ? sp_handle_alloc_ex(fz.heap, n, align, relocate, f)
                     : sp_handle_alloc(fz.heap, n, align);
    const char *call = cb ? "sp_handle_alloc_ex" : "sp_handle_alloc";
    bool no_handle = fz.fifo_len == 0 && fz.issued == fz.max_handles;
    /* The top can always grow by the block, a header and an alignment pad within the region. */
    bool no_room = a.used_bytes + need_of(n) + 2 * (align ? align : 16) + 64 > fz.region;
    if (!h.id) {
        sp_handle_heap_status b = status();
        CHECK(same_but_table(&a, &b), "a refused alloc changed the status");
        CHECK(no_handle || no_room, "alloc of %zu (align %zu) refused: used %zu of %zu, %u issued",
              n, align, a.used_bytes, fz.region, fz.issued);
        if (no_handle && no_room && ts_logged.last_id == SP_ERR_NOMEM)
            reported(SP_ERR_NOMEM, call, SP_LOG_WARN);
        else
            reported(no_handle ? SP_ERR_LIMIT : SP_ERR_NOMEM, call, SP_LOG_WARN);
        return false;
    }
    unreported();
    CHECK(!no_handle, "handle 0x%x past max_handles %u", h.id, fz.max_handles);
    uint8_t *p = sp_handle_resolve(fz.heap, h); /* (so the slot is within the table) */
    CHECK(p && aligned(p, align) && sp_handle_size(fz.heap, h) == n,
          "new 0x%x at %p (align %zu), size %zu of %zu", h.id, (void *)p, align,
          sp_handle_size(fz.heap, h), n);
    uint32_t i = idx_of(h.id), g = gen_of(h.id);
    model_reserve(i + 1);
    if (!fz.hs[i].gen) { /* a slot never used (the header orders only freed ones): generation 1 */
        CHECK(g == 1, "id 0x%x: a new slot's generation is not 1", h.id);
        fz.issued++;
    } else { /* a freed slot: the oldest one (first in, first out), its next generation */
        uint32_t want = fz.fifo_len ? fz.fifo[fz.fifo_head] : UINT32_MAX;
        CHECK(i == want && g == fz.hs[i].gen + 1, "id 0x%x (slot %u), want slot %u generation %u",
              h.id, i, want, fz.hs[i].gen + 1);
        fz.fifo_head = (fz.fifo_head + 1) & (fz.hs_cap - 1);
        fz.fifo_len--;
    }
    fz.hs[i].gen = g;
    fz.hs[i].live = true;
    *f = (fslot){.h = h,
                 .stale = f->stale,
                 .len = n,
                 .align = align,
                 .addr = p,
                 .cb = cb,
                 .fill = (uint8_t)(h.id * 151u + 7u)};
    ts_fill(p, n, f->fill);
    fz.live++;
    fz.live_bytes += n;
    fz.needed += need_of(n);
    fz.allocated_total += n;
    fz.caught_quiet = false;
    sp_handle_heap_status b = status();
    CHECK(b.used_bytes - b.hole_bytes >= a.used_bytes - a.hole_bytes + need_of(n),
          "live blocks %zu -> %zu bytes for %zu", a.used_bytes - a.hole_bytes,
          b.used_bytes - b.hole_bytes, n);
    return true;
}

/* Resolve, pin and size of a handle that is not live: NULL, NULL, 0, nothing reported. */
static void dead_reads(sp_handle x) {
    sp_handle_heap_status a = status();
    CHECK(!sp_handle_resolve(fz.heap, x) && !sp_handle_pin(fz.heap, x) &&
              !sp_handle_size(fz.heap, x),
          "dead handle 0x%x answers", x.id);
    unreported();
    sp_handle_heap_status b = status();
    CHECK(same_status(&a, &b), "reads of a dead handle changed the status");
}

/* Free the block of f (its bytes checked first); refused while pinned. */
static void free_checked(fslot *f) {
    sp_handle_heap_status a = status();
    uint8_t *p = sp_handle_resolve(fz.heap, f->h);
    CHECK(p == f->addr, "0x%x at %p, last seen at %p", f->h.id, (void *)p, (void *)f->addr);
    CHECK(ts_filled(p, f->len, f->fill), "0x%x damaged", f->h.id);
    if (f->pins) { /* refused: stays live and pinned */
        CHECK(sp_handle_free(fz.heap, f->h) == SP_ERR_PINNED, "free of a pinned block");
        reported(SP_ERR_PINNED, "sp_handle_free", SP_LOG_ERROR);
        sp_handle_heap_status b = status();
        CHECK(same_status(&a, &b) && sp_handle_resolve(fz.heap, f->h) == f->pin_addr,
              "a refused free changed something");
        return;
    }
    CHECK(sp_handle_free(fz.heap, f->h) == SP_OK, "free of 0x%x", f->h.id);
    unreported();
    uint32_t i = idx_of(f->h.id);
    fz.hs[i].live = false;
    fz.hs[i].last_freed = f->h.id;
    if (gen_of(f->h.id) == fz.gen_max) /* the next generation would wrap: retired for good */
        fz.retired++;
    else
        fz.fifo[(fz.fifo_head + fz.fifo_len++) & (fz.hs_cap - 1)] = i;
    fz.live--;
    fz.live_bytes -= f->len;
    fz.needed -= need_of(f->len);
    fz.caught_quiet = false;
    f->stale = f->h;
    f->h = (sp_handle){0};
    f->pins = 0;
    dead_reads(f->stale);
    sp_handle_heap_status b = status();
    CHECK(a.used_bytes - a.hole_bytes >= b.used_bytes - b.hole_bytes + need_of(f->len),
          "live blocks %zu -> %zu bytes for %zu", a.used_bytes - a.hole_bytes,
          b.used_bytes - b.hole_bytes, f->len);
    /* not at the top: a hole appeared, so compaction is not caught up */
    CHECK(b.used_bytes < a.used_bytes || !b.caught_up, "caught up with a new hole");
}

/* Free of a handle that is not live: the documented refusal, one report, nothing changed. */
static void bad_free(sp_handle x) {
    int c = classify(x.id);
    if (c == LIVE) return;
    sp_handle_heap_status a = status();
    sp_result r = sp_handle_free(fz.heap, x);
    if (!x.id) {
        CHECK(r == SP_OK, "free of {0}: %s", sp_result_name(r));
        unreported();
    } else {
        /* its slot's last freed id: a double free; freed before that: the header's "its own
         * generation freed once more" (double) or stale, it does not say which */
        bool ok = c == LAST_FREED ? r == SP_ERR_DOUBLE_FREE
                  : c == FORGED   ? r == SP_ERR_STALE_HANDLE
                                  : r == SP_ERR_DOUBLE_FREE || r == SP_ERR_STALE_HANDLE;
        CHECK(ok, "free of dead 0x%x (class %d): %s", x.id, c, sp_result_name(r));
        reported(r, "sp_handle_free", SP_LOG_ERROR);
    }
    sp_handle_heap_status b = status();
    CHECK(same_status(&a, &b), "a refused free changed the status");
}

/* Unpin of a handle that is not live: stale, one report, nothing changed. */
static void bad_unpin(sp_handle x) {
    if (classify(x.id) == LIVE) return;
    sp_handle_heap_status a = status();
    CHECK(sp_handle_unpin(fz.heap, x) == SP_ERR_STALE_HANDLE, "unpin of dead 0x%x", x.id);
    reported(SP_ERR_STALE_HANDLE, "sp_handle_unpin", SP_LOG_ERROR);
    sp_handle_heap_status b = status();
    CHECK(same_status(&a, &b), "a refused unpin changed the status");
}

/* Every live block where it was last seen (pinned ones where they were pinned), aligned, its
 * bytes intact when `bytes`, no two blocks sharing a byte. */
static void blocks_ok(bool bytes) {
    static ts_span spans[SLOTS];
    size_t n = 0;
    for (int s = 0; s < SLOTS; s++) {
        fslot *f = &fz.slot[s];
        if (!f->h.id) continue;
        uint8_t *p = sp_handle_resolve(fz.heap, f->h);
        CHECK(p == f->addr && aligned(p, f->align), "0x%x at %p, expected %p", f->h.id, (void *)p,
              (void *)f->addr);
        CHECK(!f->pins || p == f->pin_addr, "pinned 0x%x moved", f->h.id);
        CHECK(!bytes || ts_filled(p, f->len, f->fill), "0x%x damaged", f->h.id);
        CHECK(!fz.base || (p >= (uint8_t *)fz.base && p + f->len <= (uint8_t *)fz.base + fz.region),
              "0x%x outside the region", f->h.id);
        spans[n++] = (ts_span){(uintptr_t)p - 16, need_of(f->len)}; /* header and payload */
    }
    CHECK(ts_overlaps(spans, n) == 0, "blocks overlap");
}

/* One compaction call with every check: moves seen through callbacks and resolve, pinned blocks
 * unmoved, the figures. Returns whether it caught up (false: refused). */
static bool compact_checked(uint64_t budget, bool use_out, bool refuse, uint32_t seed, bool quiet,
                            bool bytes) {
    static uint8_t *before[SLOTS];
    sp_handle_heap_status a = status();
    int asks = fz.asks;
    if (refuse) { /* may_compact says no: refused, nothing changes */
        fz.allow = false;
        CHECK(sp_handle_compact(fz.heap, budget, NULL) == SP_ERR_BUSY, "compact not refused");
        fz.allow = true;
        reported(SP_ERR_BUSY, "sp_handle_compact", SP_LOG_ERROR);
        sp_handle_heap_status b = status();
        CHECK(same_status(&a, &b) && fz.asks == asks + 1, "a refused compaction changed things");
        return false;
    }
    bool pinned = false, wide = false;
    for (int s = 0; s < SLOTS; s++) {
        fslot *f = &fz.slot[s];
        before[s] = f->addr;
        pinned |= f->h.id && f->pins;
        wide |= f->h.id && f->align > 16;
    }
    fz.compacting = true;
    fz.quiet = quiet;
    ts_rng_seed(&fz.rng, seed);
    fz.cb_calls = fz.cb_moves = fz.cb_pins = fz.cb_unpins = 0;
    fz.cb_bytes = 0;
    sp_handle_compact_stats cs;
    memset(&cs, 0xa5, sizeof cs);
    sp_result r = sp_handle_compact(fz.heap, budget, use_out ? &cs : NULL);
    fz.compacting = false;
    CHECK(r == SP_OK, "compact: %s", sp_result_name(r));
    unreported();
    CHECK(fz.asks == asks + (fz.use_may ? 1 : 0), "may_compact asked %d times", fz.asks - asks);
    /* blocks without a callback: moved if their address changed (callback ones: seen moving) */
    uint64_t moves = fz.cb_moves, bytes_min = fz.cb_bytes;
    for (int s = 0; s < SLOTS; s++) {
        fslot *f = &fz.slot[s];
        if (!f->h.id) continue;
        uint8_t *p = sp_handle_resolve(fz.heap, f->h);
        if (f->cb) {
            CHECK(p == f->addr, "0x%x at %p, its last relocation said %p", f->h.id, (void *)p,
                  (void *)f->addr);
        } else if (p != before[s]) {
            CHECK(ts_filled(p, f->len, f->fill), "0x%x damaged by its move", f->h.id);
            moves++;
            bytes_min += f->len;
            f->addr = p;
        }
    }
    sp_handle_heap_status b = status();
    blocks_ok(bytes && b.moved_last); /* nothing moved: every block's bytes were not touched */
    fz.moved_last = b.moved_last;
    fz.moved_total += b.moved_last;
    fz.ns_last = b.compact_ns_last;
    bool caught_up = b.caught_up;
    CHECK(b.moved_last >= bytes_min, "moved %llu bytes, blocks seen moving hold %llu",
          (unsigned long long)b.moved_last, (unsigned long long)bytes_min);
    if (use_out) {
        CHECK(cs.bytes_moved == b.moved_last && cs.ns == b.compact_ns_last &&
                  cs.caught_up == b.caught_up && cs.blocks_moved >= moves,
              "stats: moved %llu (status %llu), blocks %llu (seen %llu), caught up %d (%d)",
              (unsigned long long)cs.bytes_moved, (unsigned long long)b.moved_last,
              (unsigned long long)cs.blocks_moved, (unsigned long long)moves, cs.caught_up,
              b.caught_up);
    }
    if (fz.caught_quiet) /* caught up before, nothing since that may open or close a hole */
        CHECK(b.moved_last == 0 && caught_up && (!use_out || cs.blocks_moved == 0),
              "a caught-up heap moved %llu bytes", (unsigned long long)b.moved_last);
    if (!budget) {
        CHECK(caught_up, "compaction without a budget did not catch up");
        CHECK(pinned || fz.cb_pins || wide || b.hole_bytes == 0,
              "%zu hole bytes left, nothing pinned or aligned above 16", b.hole_bytes);
        size_t used = b.used_bytes, hi = used / 64 > 16384 ? used / 64 : 16384;
        CHECK(b.committed_bytes - used <= hi + 16384, "%zu committed above a top of %zu",
              b.committed_bytes - used, used);
    }
    fz.caught_quiet = caught_up && !fz.cb_unpins;
    return caught_up;
}

static const size_t aligns[8] = {1, 8, 16, 32, 64, 256, 1024, 4096};
static const size_t bad_aligns[8] = {3, 24, 48, 100, 8192, (size_t)1 << 20, SIZE_MAX, 4097};

/* Mostly small; up to 16 KiB, 64 KiB (a slide's stretch), 256 KiB now and then. */
static size_t size_of(unsigned flags, uint8_t s, uint8_t a, uint8_t b) {
    size_t v = (size_t)a | (size_t)b << 8;
    switch (flags & 3) {
    case 0: return v % 33;
    case 1: return v % 513;
    case 2: return v % 4097;
    default: return !(flags & 4) ? v % 16385 : (s & 0x60) != 0x60 ? v : v << 2;
    }
}

/* A handle id made up from the record: random, a slot in use with another generation, a live
 * id one table capacity further (the same table slot), or an id's generation flipped. */
static sp_handle forge(unsigned flags, uint8_t s, uint8_t a, uint8_t b) {
    uint32_t raw = (uint32_t)s | (uint32_t)a << 8 | (uint32_t)b << 16 | (uint32_t)flags << 28;
    fslot *g = live_from(s, false);
    uint32_t gen_bits = 32 - fz.index_bits;
    switch (flags & 3) {
    case 0: return (sp_handle){raw};
    case 1:
        if (!g) return (sp_handle){raw};
        return (sp_handle){idx_of(g->h.id) | (uint32_t)a << fz.index_bits};
    case 2:
        if (!g) return (sp_handle){raw};
        return (sp_handle){g->h.id + fz.capacity}; /* index + capacity (may carry into gen) */
    default:
        if (!g) return (sp_handle){0};
        return (sp_handle){g->h.id ^ (uint32_t)1 << (fz.index_bits + b % gen_bits)};
    }
}

static void setup(uint8_t cfg) {
    static const uint32_t handles[4] = {0, (uint32_t)1 << 24, 7, 100};
    static const size_t regions[4] = {0, 0, (size_t)64 << 10, (size_t)1 << 20};
    memset(&fz, 0, sizeof fz);
    fz.use_retire = cfg >> 4 & 1;
    fz.use_may = cfg >> 5 & 1;
    fz.allow = true;
    size_t region = regions[cfg >> 2 & 3];
    if (cfg & 0x40) { /* the caller's reservation, PROT_NONE */
        if (!region) region = (size_t)1 << 30;
        fz.base = sp_vm_reserve(region, 0, false, NULL);
        CHECK(fz.base, "reserve");
    }
    sp_handle_heap_desc d = {
        .region = fz.base,
        .region_size = region,
        .max_handles = handles[cfg & 3],
        .retire = fz.use_retire ? retire : NULL,
        .retire_user = &fz,
        .may_compact = fz.use_may ? may_compact : NULL,
        .may_compact_user = &fz,
        .name = "fuzz",
    };
    sp_result err = SP_ERR_CORRUPT;
    fz.heap = sp_handle_heap_create(&d, &err);
    CHECK(fz.heap && err == SP_OK, "create: %s", sp_result_name(err));
    fz.region = d.region_size ? d.region_size : (size_t)1 << 30;
    fz.max_handles = d.max_handles ? d.max_handles : (uint32_t)1 << 20;
    fz.index_bits = 6; /* max(6, ceil(log2(max_handles))) */
    while (((uint32_t)1 << fz.index_bits) < fz.max_handles) fz.index_bits++;
    fz.gen_max = (uint32_t)(((uint64_t)1 << (32 - fz.index_bits)) - 1);
    model_reserve(64);
    sp_handle_heap_status st = status();
    fz.cap0 = fz.capacity = st.table_capacity;
    CHECK(st.used_bytes == 0 && st.hole_bytes == 0, "a new heap holds something");
    status_ok(&st);
}

/* Every pin dropped. */
static void unpin_all(void) {
    for (int s = 0; s < SLOTS; s++)
        while (fz.slot[s].h.id && fz.slot[s].pins) unpin_live(&fz.slot[s]);
    fz.caught_quiet = false;
}

/* Settle: pins dropped, blocks aligned above 16 freed, so that a compaction without a budget
 * must leave no hole. Then everything freed: every figure back to zero, memory given back. */
static void teardown(void) {
    unpin_all();
    for (int s = 0; s < SLOTS; s++)
        if (fz.slot[s].h.id && fz.slot[s].align > 16) free_checked(&fz.slot[s]);
    compact_checked(0, true, false, 0, true, true);
    verify();
    for (int s = 0; s < SLOTS; s++)
        if (fz.slot[s].h.id) free_checked(&fz.slot[s]);
    verify();
    compact_checked(0, true, false, 0, true, true);
    verify();
    sp_handle_heap_status st = status();
    CHECK(st.live_handles == 0 && st.live_bytes == 0 && st.needed_bytes == 0 &&
              st.used_bytes == 0 && st.hole_bytes == 0 && st.committed_bytes <= 32768,
          "leak check: live %zu (%zu bytes), used %zu, holes %zu, committed %zu", st.live_handles,
          st.live_bytes, st.used_bytes, st.hole_bytes, st.committed_bytes);
    sp_handle_heap_destroy(fz.heap);
    unreported();
    if (fz.base) sp_vm_release(fz.base, fz.region);
    for (int k = 0; k < fz.npending; k++) fz.pending_free[k](fz.pending[k]);
    free(fz.hs);
    free(fz.fifo);
    memset(&fz, 0, sizeof fz);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool quiet;
    if (!quiet) {
        ts_log_capture(); /* misuse is part of the input: report, do not die */
        quiet = true;
    }
    ts_log_reset();
    setup(size ? data[0] : 0);
    for (size_t i = 1, rec = 0; i + 4 <= size && rec < MAX_RECORDS; i += 4, rec++) {
        const uint8_t *r = data + i;
        unsigned op = r[0] & 15, flags = r[0] >> 4;
        fslot *f = &fz.slot[r[1] % SLOTS];
        size_t n = size_of(flags, r[1], r[2], r[3]);
        size_t align = aligns[(r[1] >> 7) | (flags >> 1 & 6)];
        switch (op) {
        case 0: /* alloc, default alignment */
            if (!f->h.id) alloc_checked(f, n, 0, false);
            break;
        case 1: /* alloc aligned */
            if (!f->h.id) alloc_checked(f, n, align, false);
            break;
        case 2: /* alloc with a relocation callback */
            if (!f->h.id) alloc_checked(f, n, flags & 8 ? align : 0, true);
            break;
        case 3: /* free (refused while pinned) */
            if (f->h.id) free_checked(f);
            break;
        case 4: /* pin (pins nest) */
            if (f->h.id) {
                sp_handle_heap_status a = status();
                pin_live(f);
                unreported();
                sp_handle_heap_status b = status();
                CHECK(same_status(&a, &b), "a pin changed the status");
            } else {
                dead_reads(f->stale);
            }
            break;
        case 5: /* unpin; of an unpinned block: refused */
            if (f->h.id && f->pins) {
                unpin_live(f);
                fz.caught_quiet = false; /* a last unpin may let a hole close */
            } else if (f->h.id) {
                sp_handle_heap_status a = status();
                CHECK(sp_handle_unpin(fz.heap, f->h) == SP_ERR_NOT_PINNED, "unpin unpinned");
                reported(SP_ERR_NOT_PINNED, "sp_handle_unpin", SP_LOG_ERROR);
                sp_handle_heap_status b = status();
                CHECK(same_status(&a, &b), "a refused unpin changed the status");
            } else {
                bad_unpin(f->stale);
            }
            break;
        case 6: /* reads: resolve, size, the bytes; the stale handle's reads */
            if (f->h.id) {
                uint8_t *p = sp_handle_resolve(fz.heap, f->h);
                CHECK(p == f->addr && sp_handle_size(fz.heap, f->h) == f->len &&
                          ts_filled(p, f->len, f->fill),
                      "0x%x reads wrong", f->h.id);
            }
            dead_reads(f->stale);
            break;
        case 7: /* compact: no budget, a tiny one, up to 256 us, up to 6.5 ms; maybe refused */
        case 15: {
            uint64_t v = (uint64_t)r[2] + 1;
            uint64_t budget = op == 15           ? 0
                              : !(flags & 3)     ? 0
                              : (flags & 3) == 1 ? v
                              : (flags & 3) == 2 ? v * 1000
                                                 : (v | (uint64_t)r[3] << 8) * 100;
            bool refuse = fz.use_may && (r[3] & 1) && op == 7;
            compact_checked(budget, !(r[3] & 2), refuse, (uint32_t)r[1] << 16 | r[2] << 8 | r[3],
                            false, true);
            break;
        }
        case 8: /* free of the slot's stale handle: a double free or stale */
            bad_free(f->stale);
            break;
        case 9: { /* a forged handle in every call */
            sp_handle x = forge(flags, r[1], r[2], r[3]);
            if (classify(x.id) == LIVE) break;
            bad_free(x);
            bad_unpin(x);
            dead_reads(x);
            break;
        }
        case 10: /* a burst into empty slots (the table grows past 64 slots), or churn: allocate
                  * and free at once, through the freed slots and their generations */
            if (flags & 8) {
                for (unsigned k = 0, j = r[1]; k <= r[2] % SLOTS; k++, j++) {
                    fslot *g = &fz.slot[j % SLOTS];
                    if (!g->h.id && !alloc_checked(g, (r[3] + j * 7) % 64, 0, j % 3 == 0)) break;
                }
            } else {
                fslot t = {0};
                unsigned cycles = (flags & 7) == 7 ? r[2] : r[2] % 16;
                for (unsigned c = 0; c < cycles; c++) {
                    if (!alloc_checked(&t, r[3] % 48, 0, false)) break;
                    free_checked(&t);
                }
            }
            break;
        case 11: { /* a bad alignment, or a size that cannot be had: refused, nothing changes */
            sp_handle_heap_status a = status();
            bool ex = flags & 1;
            const char *call = ex ? "sp_handle_alloc_ex" : "sp_handle_alloc";
            bool huge = flags & 2;
            size_t sz = huge ? (r[2] & 1 ? SIZE_MAX - r[3] : (size_t)1 << (31 + r[3] % 33)) : n;
            size_t al = huge ? 0 : bad_aligns[r[2] % 8];
            sp_handle h = ex ? sp_handle_alloc_ex(fz.heap, sz, al, relocate, f)
                             : sp_handle_alloc(fz.heap, sz, al);
            CHECK(h.id == 0, "alloc of %zu bytes aligned %zu succeeded", sz, al);
            if (!huge)
                reported(SP_ERR_BAD_ALIGNMENT, call, SP_LOG_ERROR);
            else if (fz.fifo_len == 0 && fz.issued == fz.max_handles &&
                     ts_logged.last_id == SP_ERR_LIMIT)
                reported(SP_ERR_LIMIT, call, SP_LOG_WARN);
            else
                reported(SP_ERR_NOMEM, call, SP_LOG_WARN);
            sp_handle_heap_status b = status();
            CHECK(huge ? same_but_table(&a, &b) : same_status(&a, &b),
                  "a refused alloc changed the status");
            break;
        }
        case 12: { /* a NULL heap; {0}; a NULL status out */
            sp_handle x = f->h.id ? f->h : f->stale;
            sp_handle_heap_status a = status(), z;
            CHECK(sp_handle_alloc(NULL, n, 0).id == 0, "alloc on a NULL heap");
            reported(SP_ERR_INVALID_ARG, "sp_handle_alloc", SP_LOG_ERROR);
            CHECK(sp_handle_alloc_ex(NULL, n, 0, relocate, f).id == 0, "alloc_ex on NULL");
            reported(SP_ERR_INVALID_ARG, "sp_handle_alloc_ex", SP_LOG_ERROR);
            CHECK(sp_handle_free(NULL, (sp_handle){0}) == SP_OK, "free of {0} on NULL");
            unreported();
            if (x.id) {
                CHECK(sp_handle_free(NULL, x) == SP_ERR_INVALID_ARG, "free on a NULL heap");
                reported(SP_ERR_INVALID_ARG, "sp_handle_free", SP_LOG_ERROR);
            }
            CHECK(sp_handle_unpin(NULL, x) == SP_ERR_INVALID_ARG, "unpin on a NULL heap");
            reported(SP_ERR_INVALID_ARG, "sp_handle_unpin", SP_LOG_ERROR);
            CHECK(sp_handle_compact(NULL, 0, NULL) == SP_ERR_INVALID_ARG, "compact on NULL");
            reported(SP_ERR_INVALID_ARG, "sp_handle_compact", SP_LOG_ERROR);
            CHECK(sp_handle_heap_check(NULL) == SP_ERR_INVALID_ARG, "check on a NULL heap");
            reported(SP_ERR_INVALID_ARG, "sp_handle_heap_check", SP_LOG_ERROR);
            CHECK(!sp_handle_resolve(NULL, x) && !sp_handle_pin(NULL, x) &&
                      !sp_handle_size(NULL, x),
                  "reads on a NULL heap");
            memset(&z, 0xa5, sizeof z);
            sp_handle_heap_status_get(NULL, &z);
            CHECK(!z.live_bytes && !z.live_handles && !z.used_bytes && !z.committed_bytes &&
                      !z.table_capacity && !z.moved_total && !z.fragmentation && !z.caught_up,
                  "status of a NULL heap");
            sp_handle_heap_destroy(NULL);
            unreported();
            sp_handle_heap_status_get(fz.heap, NULL);
            reported(SP_ERR_INVALID_ARG, "sp_handle_heap_status_get", SP_LOG_ERROR);
            /* bad descs: NULL, SP_ERR_INVALID_ARG reported */
            static const sp_handle_heap_desc bad[3] = {
                {.max_handles = ((uint32_t)1 << 24) + 1},
                {.region_size = SP_HANDLE_REGION_LIMIT},
                {.region = (void *)(uintptr_t)4097, .region_size = (size_t)1 << 20},
            };
            sp_result err = SP_OK;
            CHECK(!sp_handle_heap_create(&bad[r[2] % 3], &err) && err == SP_ERR_INVALID_ARG,
                  "bad desc %d accepted", r[2] % 3);
            reported(SP_ERR_INVALID_ARG, "sp_handle_heap_create", SP_LOG_ERROR);
            /* another heap destroyed with live handles: they die silently */
            sp_handle_heap *o = sp_handle_heap_create(
                &(sp_handle_heap_desc){.region_size = (size_t)64 << 10}, &err);
            CHECK(o && err == SP_OK, "second heap");
            for (int k = 0; k <= r[3] % 4; k++)
                CHECK(sp_handle_alloc(o, 100, 0).id, "alloc on the second heap");
            sp_handle_heap_destroy(o);
            unreported();
            /* {0}: free a no-op, reads dead, unpin stale */
            CHECK(sp_handle_free(fz.heap, (sp_handle){0}) == SP_OK, "free of {0}");
            unreported();
            dead_reads((sp_handle){0});
            bad_unpin((sp_handle){0});
            sp_handle_heap_status b = status();
            CHECK(same_status(&a, &b), "NULL-heap calls changed the status");
            break;
        }
        case 13: /* unpin of the stale handle */ bad_unpin(f->stale); break;
        case 14: /* every pin dropped, then no budget; or tiny budgets until caught up: every
                  * call makes progress, the pass ends */
            if (flags & 8) {
                unpin_all();
                compact_checked(0, true, false, 0, true, true);
            } else {
                sp_handle_heap_status st = status();
                uint64_t limit = 10000 + st.used_bytes / 16, calls = 0, moved = fz.moved_total;
                while (!compact_checked(1, calls & 1, false, 0, true, false))
                    CHECK(++calls < limit, "no catching up after %llu calls",
                          (unsigned long long)calls);
                blocks_ok(fz.moved_total != moved);
            }
            break;
        default: break;
        }
        verify();
    }
    teardown();
    return 0;
}
