/* Handle heap validation (sp_handle_heap_check): a walk over blocks, hole lists and slots. */
#include "handle_internal.h"

#define CHECK(cond, addr, ...)                                                                     \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            sp_log(SP_LOG_ERROR, SP_ERR_CORRUPT, "sp_handle_heap_check", (addr), __VA_ARGS__);     \
            r = SP_ERR_CORRUPT;                                                                    \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

TRACK_INTERNAL sp_result sp_handle_heap_check(sp_handle_heap *h) {
    if (!h) return sp_misuse(SP_ERR_INVALID_ARG, "sp_handle_heap_check", NULL, "NULL heap");
    if (heap_busy(h)) /* callbacks may run mid-step (hole_evacuate): a sound heap looks broken */
        return sp_misuse(SP_ERR_BUSY, "sp_handle_heap_check", h,
                         "check during compaction (from a relocation callback?)");
    sp_result r = SP_OK;
    track_enter();
    bool locked = heap_lock(h);
    size_t need = 0, holes = 0, live = 0, nlive = 0, nholes = 0;
    uint32_t prev = 0;
    bool prev_free = false;
    for (hblk *b = (hblk *)h->base; (char *)b < h->top; b = blk_next(b)) {
        CHECK(b->size >= HMIN_UNITS && b->prev == prev, b, "block size %u prev %u (want %u)",
              b->size, b->prev, prev);
        CHECK((char *)blk_next(b) <= h->top, b, "block runs past the top");
        if (b->id == 0) {
            CHECK(!prev_free, b, "two holes touch");
            CHECK((char *)blk_next(b) < h->top, b, "a hole touches the top");
            holes += units_bytes(b->size);
            nholes++;
        } else {
            uint32_t i = id_index(h, b->id);
            const sp_handle_slot *s = slot_live(h, b->id);
            CHECK(s && slot_ptr(h, s) == blk_payload(b), b, "live block 0x%x and its slot disagree",
                  b->id);
            CHECK(units_bytes(b->size) >= h->cold[i].size + sizeof(hblk), b, "block too small");
            CHECK(((uintptr_t)blk_payload(b) & (((uintptr_t)1 << h->cold[i].align_log2) - 1)) == 0,
                  b, "payload misaligned");
            live += h->cold[i].size;
            need += units_bytes(units_for(h->cold[i].size));
            nlive++;
        }
        prev_free = b->id == 0;
        prev = b->size;
    }
    CHECK(prev == h->top_prev, h->top, "top_prev %u, last block %u", h->top_prev, prev);
    CHECK(need == h->need_bytes, h, "needed bytes %zu, counted %zu", need, h->need_bytes);
    CHECK(holes == h->hole_bytes && live == h->live_bytes && nlive == h->live_handles, h,
          "counters: holes %zu/%zu live %zu/%zu handles %zu/%zu", holes, h->hole_bytes, live,
          h->live_bytes, nlive, h->live_handles);
    size_t listed = 0;
    for (unsigned c = 0; c < HCLASSES; c++) {
        bool bit = (h->bitmap[c / 64] >> (c % 64)) & 1;
        CHECK(bit == (h->lists[c] != NULL), h, "class %u bitmap disagrees with its list", c);
        for (hfree *f = h->lists[c]; f; f = f->next) {
            CHECK(f->head.id == 0 && (char *)f >= h->base && (char *)f < h->top, f,
                  "listed hole is not a hole");
            CHECK(!f->next || f->next->prev_free == f, f, "hole links broken");
            CHECK(space_class(f->head.size) == c, f, "hole of %u units on the list of class %u",
                  (unsigned)f->head.size, c);
            listed++;
        }
    }
    CHECK(listed == nholes, h, "%zu holes listed, %zu in the heap", listed, nholes);
    size_t slots_live = 0;
    for (uint32_t i = 0; i < h->slots_used; i++) {
        const sp_handle_slot *s = slot_at(h, i);
        if (id_index(h, slot_id(s)) != i) continue;
        const hblk *b = blk_of(slot_ptr(h, s));
        CHECK((char *)b >= h->base && (char *)b < h->top && b->id == slot_id(s), b,
              "slot %u points at a block that is not its own", i);
        slots_live++;
    }
    CHECK(slots_live == nlive, h, "%zu live slots, %zu live blocks", slots_live, nlive);
out:
    heap_unlock(h, locked);
    track_leave();
    return r;
}
