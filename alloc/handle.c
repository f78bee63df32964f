/* Handle heap calls: create/destroy, the handle table (growth, retire), alloc, free, pin,
 * unpin, size, status. Space management is in handle_space.c, compaction in
 * handle_compact.c. */
#include <stdlib.h>
#include <string.h>

#include "handle_internal.h"

#define DEFAULT_REGION ((size_t)1 << 30)
#define DEFAULT_HANDLES ((uint32_t)1 << 20)
#define FIRST_CAPACITY 64u
#define NO_SLOT UINT32_MAX

/* A free or retired slot holds an id whose index part is not its own: no handle for this
 * slot (index part == i modulo the capacity, capacity >= 2) can equal it. */
static uint32_t slot_free_id(const sp_handle_heap *h, uint32_t i) {
    return ~i & h->index_full;
}

static uint32_t id_gen(const sp_handle_heap *h, uint32_t id) {
    return id >> h->index_bits;
}

static _Thread_local char self_tag;

const char *handle_self(void) {
    return &self_tag;
}

bool heap_lock(sp_handle_heap *h) {
    if (heap_busy(h)) return false;
    sp_mutex_lock(&h->lock);
    return true;
}

void heap_unlock(sp_handle_heap *h, bool locked) {
    if (locked) sp_mutex_unlock(&h->lock);
}

static sp_handle_table *table_make(sp_handle_heap *h, uint32_t cap, const sp_handle_table *old) {
    sp_handle_table *t = malloc(sizeof *t + (size_t)cap * sizeof(sp_handle_slot));
    if (!t) return NULL;
    t->mask = cap - 1;
    t->capacity = cap;
    t->base = h->base;
    t->retired_next = NULL;
    uint32_t from = 0;
    if (old) {
        /* Slots change only under the lock we hold (or in compaction): plain copy. */
        memcpy(t->slots, old->slots, (size_t)old->capacity * sizeof(sp_handle_slot));
        from = old->capacity;
    }
    for (uint32_t i = from; i < cap; i++) {
        t->slots[i].word = slot_free_id(h, i);
    }
    return t;
}

/* Double the table: copy, publish with release, retire the old one. Lock held. */
static sp_result table_grow(sp_handle_heap *h) {
    sp_handle_table *old = h->head.table;
    if (old->capacity > h->index_full) return SP_ERR_LIMIT;
    uint32_t cap = old->capacity * 2;
    hcold *cold = realloc(h->cold, (size_t)cap * sizeof *cold);
    if (!cold) return SP_ERR_NOMEM;
    h->cold = cold;
    sp_handle_table *t = table_make(h, cap, old);
    if (!t) return SP_ERR_NOMEM;
    __atomic_store_n(&h->head.table, t, __ATOMIC_RELEASE);
    if (h->desc.retire) {
        h->desc.retire(h->desc.retire_user, old, free);
    } else {
        old->retired_next = h->retired;
        h->retired = old;
    }
    return SP_OK;
}

/* A slot for a new allocation: the oldest freed one, else a fresh one. Lock held. */
static sp_result slot_take(sp_handle_heap *h, uint32_t *out) {
    if (h->free_head != NO_SLOT) {
        uint32_t i = h->free_head;
        h->free_head = h->cold[i].next_free;
        if (h->free_head == NO_SLOT) h->free_tail = NO_SLOT;
        *out = i;
        return SP_OK;
    }
    if (h->slots_used >= h->max_handles) return SP_ERR_LIMIT;
    if (h->slots_used == h->head.table->capacity) {
        sp_result r = table_grow(h);
        if (r != SP_OK) return r;
    }
    uint32_t i = h->slots_used++;
    memset(&h->cold[i], 0, sizeof h->cold[i]);
    *out = i;
    return SP_OK;
}

/* Back to the FIFO of free slots (or retired when its generations ran out). Lock held. */
static void slot_put(sp_handle_heap *h, uint32_t i) {
    if (id_gen(h, h->cold[i].last_id) >= h->gen_max) {
        h->retired_slots++;
        return;
    }
    h->cold[i].next_free = NO_SLOT;
    if (h->free_tail == NO_SLOT)
        h->free_head = i;
    else
        h->cold[h->free_tail].next_free = i;
    h->free_tail = i;
}

/* A block of `units` whose payload is aligned to `align`: from a hole, else from the top.
 * Lock held. NULL when the region is full. */
TRACK_INTERNAL static hblk *block_take(sp_handle_heap *h, uint32_t units, size_t align) {
    uint32_t extra = align > HUNIT ? (uint32_t)(align / HUNIT) + HMIN_UNITS : 0;
    hblk *b = space_hole_find(h, units + extra);
    if (!b) {
        char *top = h->top;
        if (space_commit(h, top + units_bytes(units + extra)) != SP_OK) return NULL;
        b = (hblk *)top;
        h->top = top + units_bytes(units + extra);
        b->prev = h->top_prev;
        b->size = units + extra;
        h->top_prev = units + extra;
        space_note_change(h); /* a block above the holes that may fit one left */
    }
    b->id = UINT32_MAX; /* taken: the releases below must not merge into it */
    if (extra) {        /* split off a front pad (0 or >= HMIN_UNITS units) so the payload aligns */
        uintptr_t p = sp_align_up((uintptr_t)b + sizeof(hblk), align);
        if (p - sizeof(hblk) - (uintptr_t)b == HUNIT) p += align;
        uint32_t pad = (uint32_t)((p - sizeof(hblk) - (uintptr_t)b) / HUNIT);
        if (pad) {
            uint32_t total = b->size;
            hblk *a = (hblk *)(p - sizeof(hblk));
            b->size = pad;
            space_header(h, a, total - pad, pad);
            a->id = UINT32_MAX;
            b->id = 0;
            space_release(h, b, pad); /* b's predecessor is live: b stays a hole */
            b = a;
        }
    }
    /* Now b (size >= units) is out of every list: keep `units`, the rest goes back. */
    if (b->size - units >= HMIN_UNITS) {
        uint32_t total = b->size;
        b->size = units;
        hblk *r = blk_next(b);
        space_header(h, r, total - units, units);
        space_release(h, r, total - units);
    }
    return b;
}

TRACK_INTERNAL static sp_handle handle_alloc(sp_handle_heap *h, size_t size, size_t align,
                                             sp_handle_relocate_fn fn, void *user,
                                             const char *call) {
    sp_handle none = {0};
    if (!h) {
        sp_misuse(SP_ERR_INVALID_ARG, call, NULL, "NULL heap");
        return none;
    }
    if (align == 0) align = HUNIT;
    if (!sp_is_pow2(align) || align > HMAX_ALIGN) {
        sp_misuse(SP_ERR_BAD_ALIGNMENT, call, NULL, "alignment %zu is not a power of two <= %u",
                  align, HMAX_ALIGN);
        return none;
    }
    if (align < HUNIT) align = HUNIT;
    if (heap_busy(h)) {
        sp_misuse(SP_ERR_BUSY, call, h,
                  "allocation during compaction (from a relocation callback?)");
        return none;
    }
    uint32_t units = units_for(size);
    if (!units) {
        sp_log(SP_LOG_WARN, SP_ERR_NOMEM, call, h, "%zu bytes cannot be represented", size);
        return none;
    }
    track_enter();
    sp_mutex_lock(&h->lock);
    uint32_t i;
    sp_result r = slot_take(h, &i);
    hblk *b = NULL;
    if (r == SP_OK) {
        b = block_take(h, units, align);
        if (!b) {
            r = SP_ERR_NOMEM;
            /* never issued: back at the head of the FIFO */
            if (h->free_head == NO_SLOT) h->free_tail = i;
            h->cold[i].next_free = h->free_head;
            h->free_head = i;
        }
    }
    if (r != SP_OK) {
        sp_mutex_unlock(&h->lock);
        track_leave();
        sp_log(SP_LOG_WARN, r, call, h, "%s: no %s for %zu bytes",
               h->desc.name ? h->desc.name : "handle heap", r == SP_ERR_LIMIT ? "handle" : "memory",
               size);
        return none;
    }
    hcold *c = &h->cold[i];
    uint32_t id = (id_gen(h, c->last_id) + 1) << h->index_bits | i;
    b->id = id;
    b->pins = 0;
    c->size = size;
    c->fn = fn;
    c->user = user;
    c->align_log2 = (uint8_t)__builtin_ctzll(align);
    h->live_bytes += size;
    h->allocated_total += size;
    h->need_bytes += units_bytes(units);
    h->live_handles++;
    if (align <= HUNIT) space_live_insert(h, i, units);
    sp_handle_slot *s = slot_at(h, i);
    slot_set(h, s, id, blk_payload(b));
    track_malloc(blk_payload(b), size, 0);
    sp_mutex_unlock(&h->lock);
    track_leave();
    return (sp_handle){id};
}

sp_handle sp_handle_alloc(sp_handle_heap *h, size_t size, size_t align) {
    return handle_alloc(h, size, align, NULL, NULL, "sp_handle_alloc");
}

sp_handle sp_handle_alloc_ex(sp_handle_heap *h, size_t size, size_t align, sp_handle_relocate_fn fn,
                             void *user) {
    return handle_alloc(h, size, align, fn, user, "sp_handle_alloc_ex");
}

TRACK_INTERNAL sp_result sp_handle_free(sp_handle_heap *h, sp_handle x) {
    if (x.id == 0) return SP_OK;
    if (!h) return sp_misuse(SP_ERR_INVALID_ARG, "sp_handle_free", NULL, "NULL heap");
    if (heap_busy(h))
        return sp_misuse(SP_ERR_BUSY, "sp_handle_free", h,
                         "free of handle 0x%x during compaction (from a relocation callback?)",
                         x.id);
    track_enter();
    sp_mutex_lock(&h->lock);
    uint32_t i = id_index(h, x.id);
    sp_handle_slot *s = slot_live(h, x.id);
    if (!s) {
        bool twice = i < h->slots_used && h->cold[i].last_id == x.id;
        sp_mutex_unlock(&h->lock);
        track_leave();
        return sp_misuse(twice ? SP_ERR_DOUBLE_FREE : SP_ERR_STALE_HANDLE, "sp_handle_free",
                         (void *)(uintptr_t)x.id, "handle 0x%x %s", x.id,
                         twice ? "was freed already" : "is stale or forged");
    }
    void *p = slot_ptr(h, s);
    hblk *b = blk_of(p);
    uint32_t pins = b->pins;
    if (pins) {
        sp_mutex_unlock(&h->lock);
        track_leave();
        return sp_misuse(SP_ERR_PINNED, "sp_handle_free", p,
                         "handle 0x%x is pinned %u time(s): unpin before freeing", x.id, pins);
    }
    hcold *c = &h->cold[i];
    uint32_t need = units_for(c->size);
    track_free(p, c->size);
    h->live_bytes -= c->size;
    h->need_bytes -= units_bytes(need);
    h->live_handles--;
    if (c->align_log2 <= HUNIT_SHIFT) space_live_remove(h, i, need);
    b->id = 0;
    space_release(h, b, b->size);
    slot_set(h, s, slot_free_id(h, i), p);
    c->last_id = x.id;
    slot_put(h, i);
    sp_mutex_unlock(&h->lock);
    track_leave();
    return SP_OK;
}

/* A pin refused because the block's count is at UINT32_MAX: one more would wrap it to 0 and
 * let a free through. Off pin's path (called after the lock is dropped). */
static SP_COLD void *pin_refuse(sp_handle x, void *p) {
    sp_misuse(SP_ERR_LIMIT, "sp_handle_pin", p,
              "handle 0x%x is pinned %u times (an unpin missing?): not pinned again", x.id,
              UINT32_MAX);
    return NULL;
}

/* Pin and unpin take the lock: a free of the same handle (which checks the pin count under
 * it) then either sees the pin or happens first, and the pin sees the handle dead. Without
 * it a pin could land on a block being freed, or on whatever reuses its header. */
TRACK_INTERNAL void *sp_handle_pin(sp_handle_heap *h, sp_handle x) {
    if (SP_UNLIKELY(!h)) return NULL;
    track_enter();
    bool locked = heap_lock(h);
    void *p = sp_handle_resolve(h, x);
    bool full = false;
    if (p) {
        uint32_t n = blk_of(p)->pins;
        full = n == UINT32_MAX;
        blk_of(p)->pins = n + !full;
    }
    heap_unlock(h, locked);
    track_leave();
    if (SP_UNLIKELY(full)) return pin_refuse(x, p);
    return p;
}

TRACK_INTERNAL sp_result sp_handle_unpin(sp_handle_heap *h, sp_handle x) {
    if (!h) return sp_misuse(SP_ERR_INVALID_ARG, "sp_handle_unpin", NULL, "NULL heap");
    track_enter();
    bool locked = heap_lock(h);
    void *p = sp_handle_resolve(h, x);
    hblk *b = p ? blk_of(p) : NULL;
    uint32_t v = b ? b->pins : 0;
    if (v) b->pins = v - 1;
    if (v == 1) space_note_change(h); /* a hole left for this pin (or one it fits) may close */
    heap_unlock(h, locked);
    track_leave();
    if (!p)
        return sp_misuse(SP_ERR_STALE_HANDLE, "sp_handle_unpin", (void *)(uintptr_t)x.id,
                         "handle 0x%x is stale or forged", x.id);
    if (v == 0)
        return sp_misuse(SP_ERR_NOT_PINNED, "sp_handle_unpin", p, "handle 0x%x is not pinned",
                         x.id);
    return SP_OK;
}

size_t sp_handle_size(sp_handle_heap *h, sp_handle x) {
    if (!h) return 0;
    bool locked = heap_lock(h);
    size_t n = slot_live(h, x.id) ? h->cold[id_index(h, x.id)].size : 0;
    heap_unlock(h, locked);
    return n;
}

void sp_handle_heap_status_get(sp_handle_heap *h, sp_handle_heap_status *out) {
    if (!out) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_handle_heap_status_get", h, "NULL out");
        return;
    }
    memset(out, 0, sizeof *out);
    if (!h) return;
    track_enter();
    bool locked = heap_lock(h);
    out->live_bytes = h->live_bytes;
    out->live_handles = h->live_handles;
    out->needed_bytes = h->need_bytes;
    out->used_bytes = (size_t)(h->top - h->base);
    out->hole_bytes = h->hole_bytes;
    size_t tail = (size_t)(h->committed - h->top);
    out->free_bytes = h->hole_bytes + tail;
    size_t big = space_largest_hole(h);
    out->largest_free = big > tail ? big : tail;
    out->committed_bytes = (size_t)(h->committed - h->base);
    out->table_capacity = h->head.table->capacity;
    out->table_bytes = sizeof(sp_handle_table) +
                       (size_t)out->table_capacity * (sizeof(sp_handle_slot) + sizeof(hcold));
    out->fragmentation =
        out->free_bytes ? 1.0 - (double)out->largest_free / (double)out->free_bytes : 0.0;
    out->moved_last = h->moved_last;
    out->moved_total = h->moved_total;
    out->allocated_total = h->allocated_total;
    out->compact_ns_last = h->compact_ns_last;
    out->retired_slots = h->retired_slots;
    out->caught_up = h->caught_up;
    heap_unlock(h, locked);
    track_leave();
}

sp_handle_heap *sp_handle_heap_create(const sp_handle_heap_desc *desc, sp_result *err) {
    static const sp_handle_heap_desc none = {0};
    const sp_handle_heap_desc *d = desc ? desc : &none;
    sp_result r = SP_OK;
    size_t page = sp_page_size();
    size_t rsize = d->region_size ? d->region_size : DEFAULT_REGION;
    uint32_t maxh = d->max_handles ? d->max_handles : DEFAULT_HANDLES;
    if ((d->region && ((uintptr_t)d->region % page || !d->region_size)) ||
        rsize >= SP_HANDLE_REGION_LIMIT || rsize < HCOMMIT_STEP || maxh > ((uint32_t)1 << 24)) {
        r = sp_misuse(SP_ERR_INVALID_ARG, "sp_handle_heap_create", d->region,
                      "bad desc: region %p (%zu bytes), max_handles %u", d->region, rsize, maxh);
        goto fail;
    }
    sp_handle_heap *h = calloc(1, sizeof *h);
    if (!h) {
        r = SP_ERR_NOMEM;
        goto fail;
    }
    h->desc = *d;
    h->max_handles = maxh;
    uint32_t bits = 6;
    while (((uint32_t)1 << bits) < maxh) bits++;
    h->index_bits = bits;
    h->index_full = ((uint32_t)1 << bits) - 1;
    h->gen_max = (uint32_t)((((uint64_t)1) << (32 - bits)) - 1);
    h->free_head = h->free_tail = NO_SLOT;
    for (unsigned c = 0; c < HCLASSES; c++) h->live_lists[c] = HNONE;
    h->cold = malloc(FIRST_CAPACITY * sizeof *h->cold);
    sp_handle_table *t = h->cold ? table_make(h, FIRST_CAPACITY, NULL) : NULL;
    if (!t) {
        free(h->cold);
        free(h);
        r = SP_ERR_NOMEM;
        goto fail;
    }
    h->head.table = t;
    char *base = d->region;
    rsize = sp_align_down(rsize, page);
    if (!base) {
        base = sp_vm_reserve(rsize, HCOMMIT_STEP, false, NULL);
        if (!base) {
            free(t);
            free(h->cold);
            free(h);
            r = SP_ERR_OS;
            goto fail;
        }
        h->own_region = true;
    }
    h->base = h->top = h->committed = h->scan = base;
    t->base = base;
    h->end = base + rsize;
    h->caught_up = true;
    h->ns_per_tick = sp_ticks_to_ns(1u << 20) / (double)(1u << 20);
    h->bytes_per_tick = 4.0 * h->ns_per_tick; /* a first guess, 4 B/ns; measured later */
    if (err) *err = SP_OK;
    return h;
fail:
    if (err) *err = r;
    return NULL;
}

void handle_heap_keep(sp_handle_heap *h, bool keep) {
    h->kept = keep;
}

TRACK_INTERNAL void sp_handle_heap_destroy(sp_handle_heap *h) {
    if (!h) return;
    if (h->kept) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_handle_heap_destroy", h,
                  "the runtime's handle heap (sp_handles): sp_shutdown destroys it");
        return;
    }
    if (heap_busy(h)) { /* compaction would go on in freed memory */
        sp_misuse(SP_ERR_BUSY, "sp_handle_heap_destroy", h,
                  "destroy during compaction (from a relocation callback?)");
        return;
    }
    track_enter();
    if (TRACK_VALGRIND) /* memcheck keeps malloc-like blocks until told: forget live ones */
        for (hblk *b = (hblk *)h->base; (char *)b < h->top; b = blk_next(b))
            if (b->id) track_free(blk_payload(b), h->cold[id_index(h, b->id)].size);
    track_leave();
    track_release(h->base, (size_t)(h->committed - h->base));
    if (h->own_region)
        sp_vm_release(h->base, (size_t)(h->end - h->base));
    else if (h->committed > h->base)
        sp_vm_decommit(h->base, (size_t)(h->committed - h->base));
    for (sp_handle_table *t = h->retired, *n; t; t = n) {
        n = t->retired_next;
        free(t);
    }
    free(h->head.table);
    free(h->cold);
    free(h);
}
