/* libFuzzer target: operation sequences on two thread caches, bound in turn to this one
 * thread (an owner check compares caches, so a free with the other cache bound takes the
 * remote path). Blocks carry a pattern checked before every free and realloc; bad frees
 * (double, interior, foreign, stale) are part of the alphabet: each must be reported exactly
 * once and change nothing. Caches are destroyed and made anew mid-sequence (orphans, then
 * adoption), tidied and trimmed. Every input ends with the leak check: all status figures zero.
 *
 * Input: a stream of 4-byte records  op | slot (and cache bit) | size lo | size hi. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sp_tcache.h"
#include "tcache_internal.h"
#include "test_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { SLOTS = 32 };

static sp_tcache_status snapshot(void) {
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    return st;
}

/* A free that must be refused: exactly one report, no figure changed. */
static void bad_free(void *p) {
    sp_tcache_status a = snapshot();
    int before = ts_logged.count;
    sp_tcache_free(p);
    sp_tcache_status b = snapshot();
    if (ts_logged.count != before + 1) abort();
    if (a.live_blocks != b.live_blocks || a.remote_frees != b.remote_frees ||
        a.bytes_used != b.bytes_used)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool ready;
    if (!ready) {
        ts_log_capture(); /* misuse is part of the input: report, do not die */
        if (sp_tcache_init(&(sp_tcache_desc){.region_size = (size_t)1 << 30}) != SP_OK) abort();
        ready = true;
    }
    sp_tcache *caches[2] = {tcache_create(NULL), tcache_create(NULL)};
    if (!caches[0] || !caches[1]) abort();
    sp_tcache *outer = tcache_bind(caches[0]);
    uint8_t *slot[SLOTS] = {0}, *stale[SLOTS] = {0};
    size_t len[SLOTS] = {0};
    for (size_t i = 0; i + 4 <= size; i += 4) {
        unsigned op = data[i] % 10, s = data[i + 1] % SLOTS, who = (data[i + 1] >> 5) & 1;
        size_t n = (size_t)data[i + 2] | (size_t)data[i + 3] << 8;
        if (data[i] & 0x80) n <<= 2; /* past the largest class now and then */
        tcache_bind(caches[who]);
        switch (op) {
        case 0:
        case 1:
        case 2: /* alloc (or aligned) into an empty slot */
            if (slot[s]) break;
            slot[s] = op == 2 ? sp_tcache_aligned_alloc((size_t)16 << (data[i + 2] % 9), n)
                              : sp_tcache_alloc(n);
            if (!slot[s]) abort();
            ts_fill(slot[s], len[s] = n, (uint8_t)s);
            break;
        case 3: /* free, by whichever cache is bound */
            if (!slot[s]) break;
            if (!ts_filled(slot[s], len[s], (uint8_t)s)) abort();
            sp_tcache_free(slot[s]);
            stale[s] = slot[s];
            slot[s] = NULL;
            break;
        case 4: { /* realloc */
            if (!slot[s]) break;
            uint8_t *q = sp_tcache_realloc(slot[s], n);
            if (!q && n) abort();
            if (q && !ts_filled(q, len[s] < n ? len[s] : n, (uint8_t)s)) abort();
            stale[s] = n ? NULL : slot[s];
            slot[s] = q;
            if (q) ts_fill(q, len[s] = n, (uint8_t)s);
            break;
        }
        case 5: /* double free of a stale pointer: refused unless the address is live again */
            if (!stale[s]) break;
            for (int k = 0; k < SLOTS; k++)
                if (slot[k] == stale[s]) goto skip;
            bad_free(stale[s]);
        skip:
            break;
        case 6: /* interior pointer */
            if (slot[s] && len[s] > 64) bad_free(slot[s] + 16 * (1 + data[i + 2] % 4));
            break;
        case 7: /* foreign pointer */
            bad_free((void *)(uintptr_t)(data[i + 2] << 4 | 0x1000));
            break;
        case 8: /* the bound cache goes away (orphans); a fresh one takes its place */
            tcache_bind(NULL);
            tcache_destroy(caches[who]);
            caches[who] = tcache_create(NULL);
            if (!caches[who]) abort();
            break;
        default: /* the bound cache's tidy (the every-frame call) or a full trim */
            if (data[i + 2] & 1)
                sp_tcache_tidy();
            else
                sp_tcache_trim();
            break;
        }
    }
    tcache_bind(caches[0]); /* (an unbound thread would attach a cache of its own to free) */
    for (int s = 0; s < SLOTS; s++) {
        if (slot[s] && !ts_filled(slot[s], len[s], (uint8_t)s)) abort();
        sp_tcache_free(slot[s]);
    }
    tcache_bind(outer);
    tcache_destroy(caches[0]);
    tcache_destroy(caches[1]);
    sp_tcache_trim();
    sp_tcache_status st = snapshot();
    if (st.live_blocks || st.spans || st.spans_orphaned || st.caches || st.remote_pending ||
        st.span_heap.live_blocks || st.large_heap.live_blocks) {
        diag(
            "leak check: live %zu, spans %zu, orphaned %zu, caches %zu, pending %zu, heaps %zu/%zu",
            st.live_blocks, st.spans, st.spans_orphaned, st.caches, st.remote_pending,
            st.span_heap.live_blocks, st.large_heap.live_blocks);
        abort();
    }
    return 0;
}
