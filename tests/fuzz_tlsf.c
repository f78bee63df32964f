/* libFuzzer target: replay an operation sequence on a small TLSF heap, checking every
 * invariant after each operation. Bad frees (double, interior, foreign) are part of the
 * alphabet: each must be reported exactly once and leave the heap intact.
 *
 * Input: a stream of 4-byte records  op | slot | size lo | size hi. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sp_tlsf.h"
#include "test_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { SLOTS = 32, HEAP = 256 * 1024 };

/* A free that must be refused: exactly one report, and (checked by the caller) no damage. */
static void bad_free(sp_tlsf *t, void *p) {
    int before = ts_logged.count;
    sp_tlsf_free(t, p);
    if (ts_logged.count != before + 1) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static _Alignas(64) uint8_t mem[HEAP];
    static bool quiet;
    if (!quiet) {
        ts_log_capture(); /* misuse is part of the input: report, do not die */
        quiet = true;
    }
    sp_tlsf_desc d = {.memory = mem, .size = HEAP, .name = "fuzz"};
    sp_tlsf *t = sp_tlsf_create(&d, NULL);
    uint8_t *slot[SLOTS] = {0}, *stale[SLOTS] = {0};
    size_t len[SLOTS] = {0};
    for (size_t i = 0; i + 4 <= size; i += 4) {
        unsigned op = data[i] % 8, s = data[i + 1] % SLOTS;
        size_t n = (size_t)data[i + 2] | (size_t)data[i + 3] << 8;
        if (data[i] & 0x80) n <<= 3; /* reach past 64 KiB now and then */
        switch (op) {
        case 0:
        case 1:
        case 2: /* malloc (or aligned) into an empty slot */
            if (slot[s]) break;
            slot[s] = op == 2 ? sp_tlsf_aligned_alloc(t, (size_t)16 << (data[i + 2] % 10), n)
                              : sp_tlsf_malloc(t, n);
            if (slot[s]) ts_fill(slot[s], len[s] = n, (uint8_t)s);
            break;
        case 3: /* free */
            if (!slot[s]) break;
            if (!ts_filled(slot[s], len[s], (uint8_t)s)) abort();
            sp_tlsf_free(t, slot[s]);
            stale[s] = slot[s];
            slot[s] = NULL;
            break;
        case 4: { /* realloc */
            if (!slot[s]) break;
            uint8_t *q = sp_tlsf_realloc(t, slot[s], n);
            if (!q && n) break;
            if (q && !ts_filled(q, len[s] < n ? len[s] : n, (uint8_t)s)) abort();
            slot[s] = q;
            if (q) ts_fill(q, len[s] = n, (uint8_t)s);
            break;
        }
        case 5: /* double free of a stale pointer: refused unless the address is live again */
            if (!stale[s]) break;
            for (int k = 0; k < SLOTS; k++)
                if (slot[k] == stale[s]) goto skip;
            bad_free(t, stale[s]);
        skip:
            break;
        case 6: /* interior pointer */
            if (slot[s] && len[s] > 64) bad_free(t, slot[s] + 16 * (1 + data[i + 2] % 4));
            break;
        default: /* foreign pointer */
            bad_free(t, (void *)(uintptr_t)(data[i + 2] << 4 | 0x1000));
            break;
        }
        if (sp_tlsf_check(t) != SP_OK) abort();
    }
    for (int s = 0; s < SLOTS; s++) {
        if (slot[s] && !ts_filled(slot[s], len[s], (uint8_t)s)) abort();
        sp_tlsf_free(t, slot[s]);
    }
    if (sp_tlsf_destroy(t) != 0) abort();
    return 0;
}
