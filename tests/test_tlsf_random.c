/* Randomized differential test: TLSF against a shadow model of live blocks.
 *
 * Every block is filled with a pattern derived from its slot and generation; the pattern is
 * verified before the block is freed or resized, so overlapping blocks or a heap that writes
 * into live memory are caught. After every operation sp_tlsf_check() validates the whole heap
 * and the status counters are compared with the model. Seeded: a failure names its seed and
 * operation number, and rerunning reproduces it. */
#include <stdlib.h>
#include <string.h>

#include "sp_tlsf.h"
#include "test_support.h"

enum { SLOTS = 192, HEAP = 4 << 20 };

typedef struct slot {
    unsigned char *p;
    size_t size;   /* bytes asked for */
    size_t usable; /* what the heap granted */
    uint8_t seed;  /* pattern */
} slot;

static void fill(slot *s) {
    for (size_t i = 0; i < s->size; i++) s->p[i] = (uint8_t)(s->seed + i * 7);
}

static bool intact(const slot *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s->p[i] != (uint8_t)(s->seed + i * 7)) return false;
    return true;
}

/* A size mix skewed small with a long tail, like engine traffic. */
static size_t pick_size(ts_rng *r) {
    switch (ts_rng_next(r) % 8) {
    case 0: return ts_rng_range(r, 0, 16);
    case 1:
    case 2:
    case 3: return ts_rng_range(r, 1, 256);
    case 4:
    case 5: return ts_rng_range(r, 257, 4096);
    case 6: return ts_rng_range(r, 4097, 65536);
    default: return ts_rng_range(r, 65537, 300000);
    }
}

/* Run `ops` operations; returns the index of the first failing one, or -1. */
static long run(uint64_t seed, long ops, const char **why) {
    /* Three pools, so blocks in pools other than the first (and their validation) are hit. */
    void *mem = aligned_alloc(64, HEAP / 2), *extra[2];
    sp_tlsf_desc d = {.memory = mem, .size = HEAP / 2, .name = "random"};
    sp_tlsf *t = sp_tlsf_create(&d, NULL);
    for (int i = 0; i < 2; i++) {
        extra[i] = aligned_alloc(64, HEAP / 4);
        sp_tlsf_add_pool(t, (char *)extra[i] + 8 * i, HEAP / 4 - 8 * i); /* one unaligned */
    }
    slot slots[SLOTS] = {{0}};
    size_t live = 0, used = 0, peak = 0;
    ts_rng r;
    ts_rng_seed(&r, seed);
    long failed = -1;
    for (long op = 0; op < ops && failed < 0; op++) {
        slot *s = &slots[ts_rng_next(&r) % SLOTS];
        unsigned kind = (unsigned)(ts_rng_next(&r) % 10);
        *why = NULL;
        if (!s->p) {
            size_t size = pick_size(&r);
            size_t align = kind < 2 ? (size_t)1 << ts_rng_range(&r, 5, 16) : 0;
            s->p = align ? sp_tlsf_aligned_alloc(t, align, size) : sp_tlsf_malloc(t, size);
            if (s->p) {
                s->size = size;
                s->seed = (uint8_t)ts_rng_next(&r);
                s->usable = sp_tlsf_usable_size(t, s->p);
                if (align && ((uintptr_t)s->p & (align - 1)))
                    *why = "misaligned block";
                else if (s->usable < size)
                    *why = "usable size too small";
                fill(s);
                live++;
                used += s->usable;
            }
        } else if (kind < 3) {
            size_t size = pick_size(&r), keep = size < s->size ? size : s->size;
            if (!intact(s, s->size)) *why = "block damaged before realloc";
            unsigned char *old = s->p;
            unsigned char *q = sp_tlsf_realloc(t, s->p, size);
            /* A move holds both blocks for a moment: the peak sees them together. */
            if (q && q != old && used + sp_tlsf_usable_size(t, q) > peak)
                peak = used + sp_tlsf_usable_size(t, q);
            if (q || size == 0) {
                s->p = q;
                s->size = size;
                used -= s->usable;
                s->usable = q ? sp_tlsf_usable_size(t, q) : 0;
                used += s->usable;
                if (q && !intact(s, keep)) *why = "realloc lost contents";
                if (q)
                    fill(s);
                else
                    live--;
            }
        } else {
            if (!intact(s, s->size)) *why = "block damaged before free";
            sp_tlsf_free(t, s->p);
            s->p = NULL;
            live--;
            used -= s->usable;
        }
        if (used > peak) peak = used;
        sp_tlsf_status st;
        sp_tlsf_status_get(t, &st);
        if (!*why && sp_tlsf_check(t) != SP_OK) *why = "sp_tlsf_check failed";
        if (!*why && st.live_blocks != live) *why = "live_blocks disagrees with the model";
        if (!*why && st.bytes_used != used) *why = "bytes_used disagrees with the model";
        if (!*why && st.high_water != peak) *why = "high_water disagrees with the model";
        if (*why) failed = op;
    }
    for (int i = 0; i < SLOTS; i++)
        if (slots[i].p) {
            if (failed < 0 && !intact(&slots[i], slots[i].size))
                failed = ops, *why = "damaged at end";
            sp_tlsf_free(t, slots[i].p);
        }
    if (failed < 0 && sp_tlsf_destroy(t) != 0) failed = ops, *why = "leak at destroy";
    free(mem);
    free(extra[0]);
    free(extra[1]);
    return failed;
}

int main(void) {
    const uint64_t seeds[] = {1, 2, 3, 0x5eed, 20261121};
    long ops = (long)ts_scaled(400000, 40);
    long total = 0;
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
        const char *why = NULL;
        long bad = run(seeds[i], ops, &why);
        total += ops;
        ok(bad < 0, "seed %llu: %ld operations agree with the model", (unsigned long long)seeds[i],
           ops);
        if (bad >= 0) diag("  first failure at operation %ld: %s", bad, why);
    }
    diag("%ld operations in all, each followed by a full sp_tlsf_check", total);
    return done();
}
