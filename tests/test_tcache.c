/* Thread caches, one layer at a time: size classes (waste bound, lookup table), alloc/free of
 * every class and of large blocks, calloc/realloc/aligned_alloc/usable_size/free_sized,
 * hysteresis at a span boundary, remote frees, orphaned spans of an exited thread (freed
 * from here, then adopted), tidy against trim, and the leak check: every status figure back
 * to zero after trim. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "sp_tcache.h"
#include "tcache_heap.h"
#include "test_support.h"

static void test_classes(void) {
    bool monotonic = true, exact = true, aligned = true;
    double waste_sum = 0, waste_max = 0;
    size_t counted = 0;
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++) {
        uint32_t s = tcache_class_size(k);
        if (k && s <= tcache_class_size(k - 1)) monotonic = false;
        if (tcache_class_of(s) != k || (k && tcache_class_of(tcache_class_size(k - 1) + 1) != k))
            exact = false;
        if (s % 16) aligned = false;
    }
    for (size_t n = 129; n <= 65536; n++) {
        double w = (double)(tcache_class_size(tcache_class_of(n)) - n) / (double)n;
        waste_sum += w;
        counted++;
        if (w > waste_max) waste_max = w;
    }
    ok(monotonic && aligned, "80 classes, increasing, multiples of 16 (last %u)",
       tcache_class_size(SP_TCACHE_CLASSES - 1));
    ok(exact, "class_of maps each class size to its class and the next byte to the next");
    ok(waste_max < 0.125 && waste_sum / (double)counted < 0.07,
       "internal waste above 128 B: max %.1f%% (< 12.5%%), average %.1f%%", waste_max * 100,
       waste_sum / (double)counted * 100);
    bool table = true;
    for (size_t n = 0; n <= SP_TCACHE_LOOKUP_MAX; n++)
        if (sp_tcache_g.class_of[(n + 15) >> 4] != tcache_class_of(n)) table = false;
    ok(table, "the inline lookup table agrees with class_of for 0..1024");
}

static bool pattern_ok(const unsigned char *p, size_t n, unsigned char v) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) return false;
    return true;
}

static void test_alloc_free(void) {
    enum { N = 2000 };
    static void *p[N];
    static size_t len[N];
    ts_rng r;
    ts_rng_seed(&r, 1);
    bool ok_all = true, usable = true, align16 = true, owner = true;
    uint64_t me = sp_thread_os_id();
    for (int i = 0; i < N; i++) {
        len[i] = (size_t)ts_rng_range(&r, 0, i % 10 == 0 ? 200000 : 4096);
        p[i] = sp_tcache_alloc(len[i]);
        if (!p[i])
            ok_all = false;
        else
            memset(p[i], i & 0xff, len[i]);
        if (p[i] && sp_tcache_usable_size(p[i]) < len[i]) usable = false;
        if ((uintptr_t)p[i] & 15) align16 = false;
        if (p[i] && len[i] <= 32768 && sp_tcache_owner_thread(p[i]) != me) owner = false;
    }
    bool intact = true;
    for (int i = 0; i < N; i++)
        if (p[i] && !pattern_ok(p[i], len[i], (unsigned char)(i & 0xff))) intact = false;
    ok(ok_all && intact, "%d blocks of 0..200000 bytes allocated, written, intact", N);
    ok(usable && align16, "usable_size covers every request; every block 16-aligned");
    ok(owner, "every small block is owned by this thread's cache");
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    ok(st.live_blocks == N && st.caches == 1, "status: %zu live blocks (want %d), %zu caches",
       st.live_blocks, N, st.caches);
    for (int i = 0; i < N; i += 2) sp_tcache_free(p[i]);
    for (int i = 1; i < N; i += 2) sp_tcache_free_sized(p[i], len[i]);
    sp_tcache_status_get(&st);
    is_int(st.live_blocks, 0, "all freed (free and free_sized): no live blocks");
}

static void *status_elsewhere(void *arg) {
    sp_tcache_status *st = arg;
    void *p = sp_tcache_alloc(100);
    sp_tcache_status_local(st);
    sp_tcache_free(p);
    return NULL;
}

/* Per-thread figures, and free_local. */
static void test_local(void) {
    enum { N = 300 };
    void *p[N];
    sp_tcache_status before, st, other;
    sp_tcache_status_local(&before);
    for (int i = 0; i < N; i++) p[i] = sp_tcache_alloc(24);
    sp_tcache_status_local(&st);
    uint32_t k = tcache_class_of(24);
    ok(st.caches == 1 && st.live_blocks == before.live_blocks + N &&
           st.class_live[k] == before.class_live[k] + N && st.class_size[k] == 32,
       "status_local: this cache's %zu live blocks, %zu in the 32-byte class", st.live_blocks,
       st.class_live[k]);
    sp_thread t;
    sp_thread_start(&t, status_elsewhere, &other, "sp-status");
    sp_thread_join(t);
    ok(other.caches == 1 && other.live_blocks == 1,
       "status_local on another thread sees only that thread's cache (%zu live)",
       other.live_blocks);
    for (int i = 0; i < N; i++) sp_tcache_free_local(p[i]);
    sp_tcache_status_local(&st);
    ok(st.live_blocks == before.live_blocks, "free_local returned all %d blocks", N);
}

static void test_calloc_realloc(void) {
    unsigned char *a = sp_tcache_alloc(100);
    memset(a, 0xab, 100);
    sp_tcache_free(a);
    unsigned char *z = sp_tcache_calloc(25, 4); /* likely the same block, dirty */
    ok(z && pattern_ok(z, 100, 0), "calloc zeroes a reused block");
    ok(sp_tcache_calloc(SIZE_MAX / 2, 3) == NULL, "calloc overflow: NULL");
    unsigned char *q = z;
    bool kept = true;
    size_t sizes[] = {120, 60, 1000, 40000, 300000, 5000, 16, 0};
    size_t have = 100;
    memset(q, 7, have);
    for (size_t i = 0; sizes[i]; i++) {
        q = sp_tcache_realloc(q, sizes[i]);
        size_t keep = have < sizes[i] ? have : sizes[i];
        if (!q || !pattern_ok(q, keep, 7)) kept = false;
        if (q) memset(q, 7, sizes[i]);
        have = sizes[i];
    }
    ok(kept, "realloc through classes and the large heap keeps the contents");
    ok(sp_tcache_realloc(q, 0) == NULL, "realloc(p, 0) frees and returns NULL");
    void *n = sp_tcache_realloc(NULL, 50);
    ok(n && sp_tcache_usable_size(n) >= 50, "realloc(NULL, n) allocates");
    sp_tcache_free(n);
}

static void test_aligned(void) {
    bool good = true;
    void *keep[64];
    int kept = 0;
    for (size_t align = 1; align <= ((size_t)1 << 20); align <<= 1) {
        size_t sizes[] = {1, align, 3 * align + 5, 40000};
        for (int i = 0; i < 4; i++) {
            void *p = sp_tcache_aligned_alloc(align, sizes[i]);
            if (!p || ((uintptr_t)p & (align - 1)) || sp_tcache_usable_size(p) < sizes[i]) {
                good = false;
                diag("aligned_alloc(%zu, %zu) = %p", align, sizes[i], p);
            }
            if (p) memset(p, 1, sizes[i]);
            if (kept < 64)
                keep[kept++] = p;
            else
                sp_tcache_free(p);
        }
    }
    for (int i = 0; i < kept; i++) sp_tcache_free(keep[i]);
    ok(good, "aligned_alloc: alignments 1 B .. 1 MiB, sizes small to large, all aligned");
}

/* A loop that allocates and frees one block right at a span boundary must not hand a span to
 * the central heap and take it back each time. */
static void test_hysteresis(void) {
    size_t bs = 1024;
    uint32_t k = tcache_class_of(bs);
    void *blocks[400];
    int first[3];
    int n = ts_fill_spans(bs, blocks, 400, 2, first); /* the last block starts the second span */
    sp_tcache_free(blocks[--n]); /* the first block of the second span: that span now empty */
    sp_tlsf_status before, after;
    heap_status(&tc.spans, &before);
    for (int i = 0; i < 10000; i++) {
        void *p = sp_tcache_alloc(bs);
        sp_tcache_free(p);
    }
    heap_status(&tc.spans, &after);
    ok(after.live_blocks == before.live_blocks,
       "alloc/free at a span boundary (class %u): central spans %zu before, %zu after", k,
       before.live_blocks, after.live_blocks);
    for (int i = 0; i < n; i++) sp_tcache_free(blocks[i]);
}

/* A refill takes blocks that are carved already (here: freed blocks of a full span on the
 * ring) before it cuts new ones from the current span's untouched tail. */
static void test_refill_reuses(void) {
    enum { MAX = 400 };
    const size_t bs = 1024;
    static void *blocks[MAX];
    sp_tcache_thread_detach();
    sp_tcache_trim(); /* no orphans: the spans below are new, cut a page at a time */
    sp_tcache_thread_attach();
    int first[3];
    int n = ts_fill_spans(bs, blocks, MAX, 2, first); /* span A full; the last starts span B */
    char *span_a = span_base(blocks[0]), *span_b = span_base(blocks[n - 1]);
    /* B is carved a page at a time: take what is left of its first carve, so its free list
     * is empty and its tail uncarved. */
    span *b = span_of(span_b);
    while (n < MAX && span_free(b)) blocks[n++] = sp_tcache_alloc(bs);
    bool in_b = span_base(blocks[n - 1]) == span_b && b->pub.carved < b->capacity;
    for (int i = 0; i < 8; i++) sp_tcache_free(blocks[i]); /* 8 free blocks in A (on the ring) */
    void *next = sp_tcache_alloc(bs);
    ok(n < MAX && in_b && span_b != span_a && span_base(next) == span_a,
       "refill: a ring span's freed blocks before carving the current span (%s)",
       span_base(next) == span_a ? "span A" : "span B");
    sp_tcache_free(next);
    for (int i = 8; i < n; i++) sp_tcache_free(blocks[i]);
}

/* Span headers sit at their colour offset: blocks of every class lie past the header and
 * inside the span, and the spans of one class spread over the colours. */
static void test_colours(void) {
    enum { N = 200 };
    static const size_t sizes[] = {16, 48, 1000, 4096, 24000};
    bool inside = true;
    unsigned seen = 0; /* bit per colour */
    for (size_t i = 0; i < SP_ARRAY_LEN(sizes); i++) {
        void *blocks[N];
        for (int j = 0; j < N; j++) {
            char *p = blocks[j] = sp_tcache_alloc(sizes[i]);
            char *base = span_base(p);
            char *h = (char *)sp_tcache_span_of_((uintptr_t)p);
            size_t colour = (size_t)(h - base) / SPAN_HEADER;
            seen |= 1u << colour;
            inside = inside && colour < SP_TCACHE_COLOURS && p >= h + SPAN_HEADER &&
                     p + sp_tcache_usable_size(p) <= base + SP_TCACHE_SPAN - SPAN_TAIL;
        }
        for (int j = 0; j < N; j++) sp_tcache_free(blocks[j]);
    }
    ok(inside, "blocks lie between their span's coloured header and its end");
    ok(__builtin_popcount(seen) >= 8, "spans take different colours (%d of %d seen)",
       __builtin_popcount(seen), SP_TCACHE_COLOURS);
}

/* The free's pointer check (sp_tcache_block_start_) against its definition, for every class:
 * accepted exactly at the starts of the carved blocks, for offsets up to past the span's end
 * and for addresses below the first block (offsets that wrapped in 32 bits). */
static void test_block_start(void) {
    bool exact = true;
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES && exact; k++) {
        uint32_t d = tcache_class_size(k), cap = (uint32_t)(SP_TCACHE_SPAN / d);
        uint32_t counts[] = {0, 1, 2, cap / 2, cap};
        for (size_t i = 0; i < SP_ARRAY_LEN(counts) && exact; i++) {
            sp_tcache_span s = {.first32 = 0};
            span_check_init(&s, d);
            span_check_carved(&s, d, counts[i]);
            for (uint32_t off = 0; off < (cap + 2) * d && exact; off++)
                exact = sp_tcache_block_start_(&s, off) == (off % d == 0 && off / d < counts[i]);
            for (uint32_t back = 1; back <= 4 * d && exact; back++)
                exact = !sp_tcache_block_start_(&s, (uint32_t)0 - back);
            if (!exact) diag("  class %u (%u B), %u carved", k, d, counts[i]);
        }
    }
    ok(exact, "pointer check: exactly the carved block starts, in every class");
}

typedef struct exiting {
    void *blocks[3000];
    int n;
} exiting;

static void *thread_allocates_and_exits(void *arg) {
    exiting *e = arg;
    for (int i = 0; i < e->n; i++) e->blocks[i] = sp_tcache_alloc(48);
    return NULL; /* exits holding live blocks: its spans become orphans */
}

static void test_orphans(void) {
    static exiting e = {.n = 3000};
    sp_tcache_thread_detach(); /* our next cache starts empty: it must adopt, not reuse */
    sp_thread t;
    sp_thread_start(&t, thread_allocates_and_exits, &e, "sp-orphan");
    sp_thread_join(t);
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    ok(st.spans_orphaned > 0 && st.caches == 0,
       "an exited thread's spans with live blocks are orphaned (%zu), its cache gone",
       st.spans_orphaned);
    for (int i = 0; i < e.n; i += 2) sp_tcache_free(e.blocks[i]); /* remote frees to orphans */
    sp_tcache_status_get(&st);
    ok(st.remote_pending >= (size_t)e.n / 2,
       "frees of an exited thread's blocks work (%zu pending)", st.remote_pending);
    /* Our cache adopts the orphans of that class before taking new spans. */
    size_t orphaned = st.spans_orphaned;
    void *mine[600];
    for (int i = 0; i < 600; i++) mine[i] = sp_tcache_alloc(48);
    sp_tcache_status_get(&st);
    ok(st.spans_orphaned < orphaned && sp_tcache_owner_thread(e.blocks[1]) == sp_thread_os_id(),
       "orphans adopted by the next cache that needs the class (%zu -> %zu)", orphaned,
       st.spans_orphaned);
    for (int i = 1; i < e.n; i += 2) sp_tcache_free(e.blocks[i]);
    for (int i = 0; i < 600; i++) sp_tcache_free(mine[i]);
}

enum { SPREAD = 16000 }; /* 48-byte blocks: three spans' worth */

static void *thread_fills_frees_exits(void *arg) {
    void **blocks = arg;
    for (int i = 0; i < SPREAD; i++) blocks[i] = sp_tcache_alloc(48);
    for (int i = 0; i < SPREAD; i++) sp_tcache_free(blocks[i]);
    return NULL; /* exits with three empty spans: keep_detached (2) of them stay as spares */
}

/* Whether p lies in one of the first three spans of theirs[]. */
static bool in_spans(const uintptr_t *theirs, const void *p) {
    uintptr_t b = (uintptr_t)span_base(p);
    return b == theirs[0] || b == theirs[1] || b == theirs[2];
}

/* An exited thread's empty spans stay cut into blocks as spares (up to keep_detached a class,
 * the rest go back to the heap); the next cache that needs the class takes their blocks
 * before it carves or takes a span of its own, and another class takes a spare, cut anew,
 * before a new span. */
static void test_detached_reuse(void) {
    static void *blocks[SPREAD];
    sp_tcache_trim();
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    size_t orphaned0 = st.spans_orphaned;
    sp_thread t;
    sp_thread_start(&t, thread_fills_frees_exits, blocks, "sp-spread");
    sp_thread_join(t);
    uintptr_t theirs[8];
    int spans = 0;
    for (int i = 0; i < SPREAD; i++) {
        uintptr_t b = (uintptr_t)span_base(blocks[i]);
        if (spans == 0 || theirs[spans - 1] != b) theirs[spans < 8 ? spans++ : 7] = b;
    }
    sp_tcache_status_get(&st);
    ok(spans == 3 && st.spans_orphaned - orphaned0 == 2,
       "an exited thread's empty spans: %zu of its %d kept as spares (keep_detached 2)",
       st.spans_orphaned - orphaned0, spans);
    sp_tcache_thread_detach();
    sp_tcache_thread_attach(); /* a fresh cache: no spans of its own */
    sp_tlsf_status before, after;
    heap_status(&tc.spans, &before);
    bool reused = true;
    for (int i = 0; i < 4000; i++) {
        blocks[i] = sp_tcache_alloc(48);
        reused = reused && in_spans(theirs, blocks[i]);
    }
    heap_status(&tc.spans, &after);
    sp_tcache_status_get(&st);
    ok(reused && after.live_blocks == before.live_blocks && st.spans_orphaned == orphaned0 + 1,
       "the next cache takes the spares' carved blocks first (no new span: %zu -> %zu; "
       "spares left %zu)",
       before.live_blocks, after.live_blocks, st.spans_orphaned - orphaned0);
    ok(st.spans_empty <= st.spans, "spares are not counted as the caches' empty spans (%zu of %zu)",
       st.spans_empty, st.spans);
    /* A class with no spares of its own takes the last one, cut anew, before a new span. */
    void *big = sp_tcache_alloc(2048);
    heap_status(&tc.spans, &after);
    sp_tcache_status_get(&st);
    ok(in_spans(theirs, big) && after.live_blocks == before.live_blocks &&
           st.spans_orphaned == orphaned0,
       "another class takes a spare before the heap (spans %zu -> %zu, spares left %zu)",
       before.live_blocks, after.live_blocks, st.spans_orphaned - orphaned0);
    sp_tcache_free(big);
    for (int i = 0; i < 4000; i++) sp_tcache_free(blocks[i]);
}

static void *remote_worker(void *arg) {
    void **blocks = arg;
    for (int i = 0; i < 1000; i++) sp_tcache_free(blocks[i]);
    return NULL;
}

static void test_remote(void) {
    static void *blocks[1000];
    sp_tcache_trim();
    for (int i = 0; i < 1000; i++) blocks[i] = sp_tcache_alloc(16 + (size_t)i % 200);
    sp_tcache_status before, st;
    sp_tcache_status_get(&before);
    sp_thread t;
    sp_thread_start(&t, remote_worker, blocks, "sp-remote");
    sp_thread_join(t);
    sp_tcache_status_get(&st);
    ok(st.remote_frees - before.remote_frees == 1000 && st.live_blocks == before.live_blocks,
       "1000 frees on another thread went to inboxes (%zu), still live until collected",
       st.remote_frees - before.remote_frees);
    sp_tcache_trim();
    sp_tcache_status_get(&st);
    ok(st.remote_pending == 0 && st.live_blocks == before.live_blocks - 1000,
       "trim collected every inbox (pending %zu, live %zu)", st.remote_pending, st.live_blocks);
}

typedef struct blocks {
    void **b;
    int n;
} blocks;

static void *free_all(void *arg) {
    blocks *l = arg;
    for (int i = 0; i < l->n; i++) sp_tcache_free(l->b[i]);
    return NULL;
}

static void *alloc_and_exit(void *arg) {
    blocks *l = arg;
    for (int i = 0; i < l->n; i++) l->b[i] = sp_tcache_alloc(3000);
    return NULL; /* exits holding them: its spans become orphans */
}

static void tidy_call(void *arg) {
    (void)arg;
    sp_tcache_tidy();
}

/* Free l's blocks on another thread (remote frees, into inboxes). */
static void free_elsewhere(blocks *l) {
    sp_thread t;
    sp_thread_start(&t, free_all, l, "sp-free");
    sp_thread_join(t);
}

/* sp_tcache_tidy, the every-frame call: inboxes come back and a span they empty is kept or
 * returned as if its owner had emptied it, orphans that frees emptied go back; kept empty
 * spans and spares stay (sp_tcache_trim returns those). */
static void test_tidy(void) {
    enum { MAX = 1200 };
    static void *b[MAX];
    sp_tcache_thread_detach();
    sp_tcache_trim();
    sp_tcache_thread_attach();
    /* Four spans of 1024-byte blocks: A, B and C full, D current. */
    int first[5], n[4];
    int total = ts_fill_spans(1024, b, MAX, 4, first);
    for (int i = 0; i < 4; i++) n[i] = first[i + 1] - first[i];
    /* A and B emptied by their owner: kept (keep_empty 2). */
    for (int i = 0; i < n[0] + n[1]; i++) sp_tcache_free(b[i]);
    sp_tcache_status st0, st;
    sp_tcache_status_local(&st0);
    size_t got = sp_tcache_tidy();
    sp_tcache_status_local(&st);
    ok(got == 0 && st0.spans_empty == 2 && st.spans_empty == 2 && st.spans == st0.spans,
       "tidy keeps the kept empty spans (%zu of %zu spans; %zu bytes returned)", st.spans_empty,
       st.spans, got);
    /* C emptied by another thread: its blocks wait in its inbox until tidy takes them; the
     * empty list is full, so C goes back to the heap. */
    blocks c = {b + n[0] + n[1], n[2]};
    free_elsewhere(&c);
    sp_tlsf_status h0, h1;
    heap_status(&tc.spans, &h0);
    sp_tcache_status_local(&st0);
    got = sp_tcache_tidy();
    heap_status(&tc.spans, &h1);
    sp_tcache_status_local(&st);
    ok(st0.live_blocks == (size_t)(n[2] + n[3]) && st.live_blocks == (size_t)n[3] &&
           got == SP_TCACHE_SPAN && h1.live_blocks == h0.live_blocks - 1 && st.spans_empty == 2,
       "tidy takes the inboxes back; the span they emptied is returned past keep_empty (live "
       "%zu -> %zu, %zu bytes)",
       st0.live_blocks, st.live_blocks, got);
    for (int i = first[3]; i < total; i++) sp_tcache_free(b[i]);
    got = sp_tcache_trim();
    ok(got >= 2 * SP_TCACHE_SPAN, "trim returns the kept empty spans tidy kept (%zu bytes)", got);

    /* Orphans that remote frees emptied go back at the next tidy, once; spares stay. */
    sp_tcache_status_get(&st0);
    blocks o = {b, 200};
    sp_thread t;
    sp_thread_start(&t, alloc_and_exit, &o, "sp-orphan");
    sp_thread_join(t);
    free_elsewhere(&o);
    sp_tcache_status_get(&st);
    size_t orphans = st.spans_orphaned - st0.spans_orphaned;
    static void *spread[SPREAD];
    sp_thread_start(&t, thread_fills_frees_exits, spread, "sp-spread");
    sp_thread_join(t);
    sp_tcache_status_get(&st);
    size_t spares = st.spans_orphaned - st0.spans_orphaned - orphans;
    got = sp_tcache_tidy();
    size_t again = sp_tcache_tidy();
    sp_tcache_status_get(&st);
    ok(orphans >= 3 && got == orphans * SP_TCACHE_SPAN && again == 0,
       "tidy returns the orphans frees emptied (%zu of %zu; the next tidy %zu bytes)",
       got / SP_TCACHE_SPAN, orphans, again);
    ok(spares == 2 && st.spans_orphaned - st0.spans_orphaned == spares,
       "tidy keeps an exited thread's spares (%zu of %zu)", st.spans_orphaned - st0.spans_orphaned,
       spares);
    /* No orphan freed into since: a tidy does not take the orphan lock (held here). */
    ok(ts_done_while_held(&tc.orphan_lock, tidy_call, NULL),
       "tidy walks the orphans only when they were freed into (no lock taken)");
    sp_tcache_trim();
}

/* The walk's budget, T spans a call (TCACHE_TIDY_SPANS); the counts below follow from it. */
enum { T = TCACHE_TIDY_SPANS };
_Static_assert(T >= 12 && T % 4 == 0, "the tidy tests' shapes need a budget of 12 or more");

/* A tidy walks at most T ring spans, going on where the last stopped, and a ring longer than
 * that does not hold the walk: a new cache with 3 ring spans of 1 KiB blocks (B) and 3T/2 of
 * 16,000-byte blocks (A, a later class), one block of each A span freed on another thread.
 * The first tidy walks B's 3 and T - 3 of A; B's ring is then emptied elsewhere; the second
 * walks the rest of A and goes on to B. */
static void test_tidy_bounded(void) {
    enum { A_RING = T + T / 2, A_SPANS = A_RING + 1, B_SPANS = 4 };
    enum { MAX_A = A_SPANS * 20, MAX_B = B_SPANS * 300 };
    static void *a[MAX_A], *b[MAX_B], *one[A_SPANS];
    sp_tcache_thread_detach();
    sp_tcache_trim();
    sp_tcache_thread_attach(); /* a new cache: its walk starts at the first class */
    int fa[A_SPANS + 1], fb[B_SPANS + 1];
    int nb = ts_fill_spans(1024, b, MAX_B, B_SPANS, fb);
    int na = ts_fill_spans(16000, a, MAX_A, A_SPANS, fa);
    for (int i = 0; i < A_RING; i++) {
        one[i] = a[fa[i]];
        a[fa[i]] = NULL; /* freed below, on another thread */
    }
    blocks ones = {one, A_RING};
    free_elsewhere(&ones);
    sp_tcache_status s0, s1, s2;
    sp_tcache_status_local(&s0);
    size_t got1 = sp_tcache_tidy();
    sp_tcache_status_local(&s1);
    blocks ring_b = {b, fb[B_SPANS - 1]};
    free_elsewhere(&ring_b);
    size_t got2 = sp_tcache_tidy();
    sp_tcache_status_local(&s2);
    size_t c1 = s1.remote_collected - s0.remote_collected;
    size_t c2 = s2.remote_collected - s1.remote_collected;
    size_t want2 = A_RING - (T - 3) + (size_t)fb[B_SPANS - 1];
    ok(got1 == 0 && c1 == T - 3 && c2 == want2 &&
           got2 == (B_SPANS - 1 - tc.keep_empty) * SP_TCACHE_SPAN,
       "tidy walks %d ring spans a call, goes on where it stopped and past a long ring (blocks "
       "taken back: %zu of %d, then %zu of %zu; spans returned: %zu, then %zu)",
       T, c1, T - 3, c2, want2, got1 / SP_TCACHE_SPAN, got2 / SP_TCACHE_SPAN);
    /* The walk parked in A's ring, which then shrinks to nothing (its owner frees every
     * block): the next tidy walks what is left of it, not the spans it expected. */
    for (int i = 0; i < 10 && ((cache *)sp_tcache_tls)->tidy_left == 0; i++) sp_tcache_tidy();
    uint32_t left = ((cache *)sp_tcache_tls)->tidy_left;
    for (int i = 0; i < na; i++) sp_tcache_free(a[i]);
    size_t got3 = sp_tcache_tidy();
    ok(left > 0 && got3 == 0 && ((cache *)sp_tcache_tls)->tidy_left == 0,
       "... and past a ring that shrank under it (%u spans of it left to walk, none there)", left);
    for (int i = fb[B_SPANS - 1]; i < nb; i++) sp_tcache_free(b[i]);
    sp_tcache_trim();
}

/* The blocks of test_tidy_orphans_bounded's exiting thread: L_SPANS spans of 8,000-byte blocks
 * (class L), then H_SPANS of 16,000-byte blocks (class H, a later one). */
enum { L_SPANS = T + T / 2, H_SPANS = T + T / 4 };
static struct {
    void *l[L_SPANS * 40], *h[H_SPANS * 20];
    int fl[L_SPANS + 1], fh[H_SPANS + 1], nl, nh;
} orph;

static void *alloc_orphans_and_exit(void *arg) {
    (void)arg;
    orph.nl = ts_fill_spans(8000, orph.l, L_SPANS * 40, L_SPANS, orph.fl);
    orph.nh = ts_fill_spans(16000, orph.h, H_SPANS * 20, H_SPANS, orph.fh);
    return NULL; /* exits holding them: all orphans */
}

/* The orphans made; the first block of each L span but the last moved to one[] (the last L
 * span holds one block: it stays whole). */
static void orphans_make(void **one) {
    sp_thread t;
    sp_thread_start(&t, alloc_orphans_and_exit, NULL, "sp-orphans");
    sp_thread_join(t);
    for (int i = 0; i < L_SPANS - 1; i++) {
        one[i] = orph.l[orph.fl[i]];
        orph.l[orph.fl[i]] = NULL;
    }
}

/* The orphans too: a tidy walks at most T a call, its pass going on where the last call
 * stopped, past a class whose orphans stay (they do not hold the walk), past an orphan
 * adopted meanwhile (the walk's next one); orphans emptied behind the walk come back in the
 * next pass. 3T/2 L orphans with one block freed each, 5T/4 H orphans emptied: */
static void test_tidy_orphans_bounded(void) {
    static void *one[L_SPANS];
    sp_tcache_trim();
    sp_tcache_status st0, st;
    sp_tcache_status_get(&st0);
    orphans_make(one);
    sp_tcache_status_get(&st);
    size_t orphans = st.spans_orphaned - st0.spans_orphaned;
    blocks ones = {one, L_SPANS - 1}, hs = {orph.h, orph.nh}, ls = {orph.l, orph.nl};
    free_elsewhere(&ones);
    free_elsewhere(&hs);
    /* Spans returned per call: T of L, none empty; every L orphan then emptied (T of them
     * behind the walk); the rest of L and T/2 of H; H's next one adopted; the rest of H, the
     * pass ends; the next pass finds the T behind it; nothing. */
    const size_t want[5] = {0, T, H_SPANS - T / 2 - 1, T, 0};
    size_t got[5];
    got[0] = sp_tcache_tidy() / SP_TCACHE_SPAN;
    free_elsewhere(&ls); /* NULLs: freed above */
    got[1] = sp_tcache_tidy() / SP_TCACHE_SPAN;
    void *adopted = sp_tcache_alloc(16000);
    for (int i = 2; i < 5; i++) got[i] = sp_tcache_tidy() / SP_TCACHE_SPAN;
    sp_tcache_status_get(&st);
    bool as_planned = true;
    for (int i = 0; i < 5; i++) as_planned = as_planned && got[i] == want[i];
    ok(st0.spans_orphaned == 0 && orphans == L_SPANS + H_SPANS && as_planned &&
           sp_tcache_owner_thread(adopted) == sp_thread_os_id() && st.spans_orphaned == 0,
       "tidy walks at most %d orphans a call, its pass going on past a class that stays and an "
       "adopted orphan, and the next pass finds the ones emptied behind it (orphans returned: "
       "%zu, %zu, %zu, %zu, %zu of %zu, %zu, %zu, %zu, %zu; %zu of %zu orphans left)",
       T, got[0], got[1], got[2], got[3], got[4], want[0], want[1], want[2], want[3], want[4],
       st.spans_orphaned, orphans);
    sp_tcache_free(adopted);
    /* A trim in the middle of a pass walks every orphan and ends the pass: the orphan the walk
     * would have gone on with may be gone. */
    orphans_make(one);
    hs = (blocks){orph.h, orph.nh};
    ls = (blocks){orph.l, orph.nl};
    free_elsewhere(&ones);
    size_t parked = sp_tcache_tidy();
    bool in_pass = tc.orphan_pass;
    free_elsewhere(&ls);
    free_elsewhere(&hs);
    size_t trimmed = sp_tcache_trim();
    size_t after = sp_tcache_tidy();
    sp_tcache_status_get(&st);
    ok(parked == 0 && in_pass && trimmed >= (L_SPANS + H_SPANS) * SP_TCACHE_SPAN && after == 0 &&
           !tc.orphan_pass && st.spans_orphaned == 0,
       "a trim in the middle of a pass returns every empty orphan and ends the pass (%zu "
       "bytes, then %zu)",
       trimmed, after);
}

/* Orphans that remote frees emptied, with tidy_orphans and without: a thread allocates one
 * block in each of ORPHAN_CLASSES classes and exits (that many orphans), the main thread frees
 * the blocks (into the orphans' inboxes); then a thread that only attaches and exits, and the
 * main thread's first allocation in a class it has not used (its slow path). */
enum { ORPHAN_CLASSES = 20 };
static void *orphan_blocks[ORPHAN_CLASSES];

static void *one_per_class(void *arg) {
    (void)arg;
    for (int i = 0; i < ORPHAN_CLASSES; i++)
        orphan_blocks[i] = sp_tcache_alloc(16 + 48 * (size_t)i);
    return NULL;
}

static void *attach_and_exit(void *arg) {
    (void)arg;
    sp_tcache_thread_attach();
    return NULL;
}

static size_t orphans_now(void) {
    size_t n = 0;
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++)
        n += atomic_load_explicit(&tc.orphan_count[k], memory_order_relaxed);
    return n;
}

/* Orphans added: by the thread, after the attach-and-exit thread, after one slow path. */
static void orphans_emptied(size_t n[3], size_t slow_size) {
    sp_thread t;
    size_t before = orphans_now();
    sp_thread_start(&t, one_per_class, NULL, "sp-orphans");
    sp_thread_join(t);
    for (int i = 0; i < ORPHAN_CLASSES; i++) sp_tcache_free(orphan_blocks[i]);
    n[0] = orphans_now() - before;
    sp_thread_start(&t, attach_and_exit, NULL, "sp-attach");
    sp_thread_join(t);
    n[1] = orphans_now() - before;
    void *p = sp_tcache_alloc(slow_size);
    n[2] = orphans_now() - before;
    sp_tcache_free(p);
}

/* Initialised by sp_tcache_init (tidy_orphans not set): they wait for a tidy (the control). */
static void test_orphans_wait(void) {
    size_t n[3];
    orphans_emptied(n, 30000);
    ok(!tc.tidy_orphans && n[0] > 16 && n[1] == n[0] && n[2] == n[0],
       "without tidy_orphans, orphans that remote frees emptied stay through a thread's exit and "
       "a slow path (%zu, then %zu, %zu)",
       n[0], n[1], n[2]);
    sp_tcache_trim();
}

/* Initialised lazily (as in the malloc drop-in): with no tidy call, the slow path walks 16 of
 * them and a thread's exit the rest of the pass (an audit's program, threads coming and going,
 * grew without bound before). */
static void test_orphans_tidied(void) {
    size_t n[3], m[1];
    orphans_emptied(n, 30000); /* the exit returns them all */
    sp_thread t;
    sp_thread_start(&t, one_per_class, NULL, "sp-orphans");
    sp_thread_join(t);
    size_t before = orphans_now();
    for (int i = 0; i < ORPHAN_CLASSES; i++) sp_tcache_free(orphan_blocks[i]);
    void *p = sp_tcache_alloc(20000); /* a class the main thread has not used: a slow path */
    m[0] = before - orphans_now();
    sp_tcache_free(p);
    ok(tc.tidy_orphans && n[0] > 16 && n[1] == 0 && n[2] == 0 && m[0] == 16,
       "initialised lazily, a thread's exit returns every orphan remote frees emptied (%zu of "
       "%zu left) and a slow path 16 of them (%zu)",
       n[1], n[0], m[0]);
}

static sp_mutex attached_lock; /* held by main while the attached thread must stay */

static void *stays_attached(void *arg) {
    int *r = arg;
    r[0] = sp_tcache_thread_attach();
    atomic_store((atomic_int *)&r[1], 1);
    sp_mutex_lock(&attached_lock); /* until main has tried to shut down */
    void *p = sp_tcache_alloc(64);
    r[2] = p != NULL && sp_tcache_owner_thread(p) == sp_thread_os_id();
    sp_tcache_free(p);
    sp_mutex_unlock(&attached_lock);
    return NULL; /* detached at exit */
}

/* A shutdown while another thread is attached would pull its cache from under it: refused,
 * nothing torn down. */
static void test_shutdown_refused(void) {
    int r[3] = {-99, 0, 0};
    sp_mutex_lock(&attached_lock);
    sp_thread t;
    sp_thread_start(&t, stays_attached, r, "sp-attached");
    while (!atomic_load((atomic_int *)&r[1])) sp_thread_yield();
    ts_log_capture();
    size_t got = sp_tcache_shutdown();
    ok(r[0] == SP_OK && got == SIZE_MAX && ts_logged.last_id == SP_ERR_INVALID_ARG,
       "shutdown with another thread attached: refused (SIZE_MAX, logged)");
    ts_log_release();
    sp_mutex_unlock(&attached_lock);
    sp_thread_join(t);
    ok(r[2], "... and that thread's cache still works");
}

/* sp_tcache_heap_status: the central heaps' figures sp_tcache_status_get reports, without
 * walking the caches. */
static void test_heap_status(void) {
    sp_tlsf_status s0, l0, s1, l1;
    sp_tcache_thread_attach(); /* its record taken before s0 */
    sp_tcache_trim();          /* no spares: the blocks below take new spans */
    sp_tcache_heap_status(&s0, &l0);
    void *big = sp_tcache_alloc((size_t)1 << 20);
    void *small[64];
    for (int i = 0; i < 64; i++) small[i] = sp_tcache_alloc(4000); /* two spans' worth */
    sp_tcache_heap_status(&s1, NULL);
    sp_tcache_heap_status(NULL, &l1);
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    ok(l1.bytes_used >= l0.bytes_used + ((size_t)1 << 20) && l1.live_blocks == l0.live_blocks + 1 &&
           s1.live_blocks >= s0.live_blocks + 2 && s1.bytes_used > s0.bytes_used &&
           l1.bytes_used == st.large_heap.bytes_used &&
           l1.live_blocks == st.large_heap.live_blocks &&
           s1.bytes_used == st.span_heap.bytes_used && s1.high_water == st.span_heap.high_water,
       "heap_status: a large block and new spans show, as in status_get (large %zu -> %zu, "
       "spans %zu -> %zu)",
       l0.bytes_used, l1.bytes_used, s0.live_blocks, s1.live_blocks);
    sp_tcache_free(big);
    for (int i = 0; i < 64; i++) sp_tcache_free(small[i]);
    sp_tcache_heap_status(NULL, &l1);
    is_int(l1.bytes_used, l0.bytes_used, "... the large block's bytes go back with it");
}

/* sp_tcache_allocated: the bytes asked for, whichever path served them, detached caches
 * included; a realloc that keeps its block adds nothing. */
static void *allocates_and_exits(void *arg) {
    *(void **)arg = sp_tcache_alloc(300); /* the thread's cache retires with its count */
    return NULL;
}

static void test_allocated(void) {
    size_t a0 = sp_tcache_allocated();
    void *p[6];
    p[0] = sp_tcache_alloc(40);                        /* 40 */
    p[1] = sp_tcache_alloc(40);                        /* 40: the inline path, surely */
    p[2] = sp_tcache_aligned_alloc(256, 100);          /* 100 */
    p[3] = sp_tcache_calloc(3, 50);                    /* 150 */
    p[4] = sp_tcache_alloc((size_t)1 << 20);           /* 1 MiB: the large heap */
    p[5] = sp_tcache_realloc(sp_tcache_alloc(60), 62); /* 60; 62 fits the 64-byte block */
    size_t want = 40 + 40 + 100 + 150 + ((size_t)1 << 20) + 60;
    size_t got = sp_tcache_allocated() - a0;
    ok(got == want,
       "allocated counts the sizes asked for: inline, aligned, calloc, large, a "
       "realloc in place adds nothing (%zu, want %zu)",
       got, want);
    a0 = sp_tcache_allocated();
    p[5] = sp_tcache_realloc(p[5], 5000); /* another class: moves, 5000 */
    void *big = p[4];
    p[4] = sp_tcache_realloc(p[4], (size_t)64 << 20); /* 64 MiB, moved or grown in place */
    void *q = NULL;
    sp_thread t;
    sp_thread_start(&t, allocates_and_exits, &q, "sp-allocated");
    sp_thread_join(t);
    want = 5000 + 300 + ((size_t)64 << 20);
    got = sp_tcache_allocated() - a0;
    ok(got == want,
       "... a realloc that moves or grows adds its new size (the large one %s), an exited "
       "thread's cache keeps its count (%zu, want %zu)",
       p[4] != big ? "moved" : "grew in place", got, want);
    for (int i = 0; i < 6; i++) sp_tcache_free(p[i]);
    sp_tcache_free(q);
    got = sp_tcache_allocated() - a0;
    ok(got == want, "... frees take nothing off (%zu)", got);
    /* A large block that grows into the free block right above it stays where it is, and
     * is counted (the three blocks lie back to back with today's layout; were they not, the
     * block could move, which counts the same: the line says which). */
    void *l[3];
    for (int i = 0; i < 3; i++) l[i] = sp_tcache_alloc((size_t)1 << 20);
    for (int i = 0; i < 3; i++) /* sort by address */
        for (int j = i + 1; j < 3; j++)
            if ((uintptr_t)l[j] < (uintptr_t)l[i]) {
                void *x = l[i];
                l[i] = l[j];
                l[j] = x;
            }
    /* Back to back: the gap between the two starts is the first block and a header. */
    bool adjacent = (uintptr_t)l[1] - (uintptr_t)l[0] <= ((size_t)1 << 20) + 256;
    sp_tcache_free(l[1]);
    a0 = sp_tcache_allocated();
    void *g = sp_tcache_realloc(l[0], (size_t)3 << 19);
    got = sp_tcache_allocated() - a0;
    ok(got == (size_t)3 << 19 && (g == l[0] || !adjacent),
       "... a large realloc that grows (%s; the freed block %s above it) adds its new size "
       "(%zu)",
       g == l[0] ? "in place" : "moved", adjacent ? "right" : "not right", got);
    sp_tcache_free(g);
    sp_tcache_free(l[2]);
}

static void test_leak_check(void) {
    sp_tcache_thread_detach();
    sp_tcache_trim();
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    size_t classes = 0;
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++) classes += st.class_live[k];
    ok(st.live_blocks == 0 && st.bytes_used == 0 && st.spans == 0 && st.spans_empty == 0 &&
           st.spans_orphaned == 0 && st.caches == 0 && st.large_blocks == 0 && classes == 0 &&
           st.remote_pending == 0 && st.span_heap.live_blocks == 0 &&
           st.large_heap.live_blocks == 0 && st.span_heap.bytes_used == 0 &&
           st.large_heap.bytes_used == 0,
       "after detach + trim every figure is zero (live %zu, used %zu, spans %zu/%zu/%zu, "
       "heaps %zu/%zu)",
       st.live_blocks, st.bytes_used, st.spans, st.spans_empty, st.spans_orphaned,
       st.span_heap.live_blocks, st.large_heap.live_blocks);
    is_int(sp_tcache_shutdown(), 0, "shutdown: nothing leaked");
}

/* Fork safety: sp_tcache_fork_prepare takes every cache's list lock as well, so it waits for a
 * thread that is changing its cache's span lists (white box: the lock held by hand here), and
 * the child never inherits a list half-changed. */
static atomic_int fork_stage, fork_released;

static void *hold_own_cache_lock(void *arg) {
    (void)arg;
    sp_tcache_free(sp_tcache_alloc(64)); /* this thread's cache exists and is registered */
    cache *c = (cache *)sp_tcache_tls;
    sp_mutex_lock(&c->lock);
    atomic_store(&fork_stage, 1);
    usleep(200000); /* 200 ms: prepare must wait out all of it */
    atomic_store(&fork_released, 1);
    sp_mutex_unlock(&c->lock);
    while (atomic_load(&fork_stage) != 2) sp_thread_yield();
    return NULL;
}

static void test_fork_locks(void) {
    sp_thread t;
    atomic_store(&fork_stage, 0);
    atomic_store(&fork_released, 0);
    sp_thread_start(&t, hold_own_cache_lock, NULL, "sp-holder");
    while (atomic_load(&fork_stage) != 1) sp_thread_yield();
    sp_tcache_fork_prepare();
    bool waited = atomic_load(&fork_released) == 1;
    sp_tcache_fork_parent();
    atomic_store(&fork_stage, 2);
    sp_thread_join(t);
    ok(waited, "fork_prepare waits for a thread that holds its cache's list lock");
}

/* The shared fallback cache's blocks count in sp_tcache_status_get: under explicit_attach a
 * thread that never attached allocates from it, and its blocks are as live as any. */
enum { FALLBACK_BLOCKS = 10 };
static void *fallback_block[FALLBACK_BLOCKS];

static void *fallback_allocates(void *arg) {
    (void)arg;
    for (int i = 0; i < FALLBACK_BLOCKS; i++) fallback_block[i] = sp_tcache_alloc(64);
    return NULL;
}

static void test_fallback_counted(void) {
    sp_tcache_desc desc = {.region_size = (size_t)1 << 30, .explicit_attach = true};
    if (!ok(sp_tcache_init(&desc) == SP_OK, "init with explicit_attach")) return;
    ts_log_capture(); /* the thread is told once that it uses the fallback cache */
    sp_tcache_status st0, st;
    sp_tcache_status_get(&st0);
    size_t a0 = sp_tcache_allocated();
    sp_thread t;
    sp_thread_start(&t, fallback_allocates, NULL, "sp-fallback");
    sp_thread_join(t);
    sp_tcache_status_get(&st);
    is_int(sp_tcache_allocated() - a0, FALLBACK_BLOCKS * 64,
           "allocated counts what the fallback cache served");
    int got = 0, fallback = 0;
    for (int i = 0; i < FALLBACK_BLOCKS; i++) {
        got += fallback_block[i] != NULL;
        fallback += fallback_block[i] && sp_tcache_owner_thread(fallback_block[i]) == 0;
    }
    ok(got == FALLBACK_BLOCKS && fallback == FALLBACK_BLOCKS && st.caches == 0 &&
           ts_logged.last_id == SP_ERR_INVALID_ARG,
       "an unattached thread under explicit_attach: %d blocks from the shared fallback cache "
       "(no owner thread: %d; caches %zu)",
       got, fallback, st.caches);
    ok(st.live_blocks == st0.live_blocks + FALLBACK_BLOCKS &&
           st.bytes_used == st0.bytes_used + FALLBACK_BLOCKS * 64,
       "status_get counts the fallback cache's blocks: live %zu -> %zu, used %zu -> %zu",
       st0.live_blocks, st.live_blocks, st0.bytes_used, st.bytes_used);
    for (int i = 0; i < FALLBACK_BLOCKS; i++) sp_tcache_free(fallback_block[i]);
    sp_tcache_trim();
    sp_tcache_status_get(&st);
    ok(st.live_blocks == st0.live_blocks, "freed: live blocks back to %zu (%zu)", st0.live_blocks,
       st.live_blocks);
    ts_log_release();
    is_int(sp_tcache_shutdown(), 0, "shutdown after the fallback test: nothing leaked");
}

int main(void) {
    plan(64);
    sp_tcache_desc desc = {.region_size = (size_t)1 << 30, .keep_detached = 2};
    ok(sp_tcache_init(&desc) == SP_OK, "init");
    test_classes();
    test_alloc_free();
    test_local();
    test_calloc_realloc();
    test_aligned();
    test_hysteresis();
    test_refill_reuses();
    test_colours();
    test_block_start();
    test_orphans();
    test_detached_reuse();
    test_remote();
    test_tidy();
    test_tidy_bounded();
    test_tidy_orphans_bounded();
    test_orphans_wait();
    test_shutdown_refused();
    test_heap_status();
    test_allocated();
    test_fork_locks();
    test_leak_check();
    sp_tlsf_status none[2];
    memset(none, 0xAB, sizeof none);
    sp_tcache_heap_status(&none[0], &none[1]);
    ok(none[0].bytes_used == 0 && none[0].pool_count == 0 && none[1].bytes_used == 0 &&
           none[1].high_water == 0,
       "heap_status after shutdown: all zero");
    test_fallback_counted();
    /* Lazy initialisation with defaults, after a shutdown. */
    void *p = sp_tcache_alloc(10);
    ok(p != NULL && sp_tcache_allocated() == 10,
       "first alloc after shutdown initialises again (defaults), its count from 0 (%zu)",
       sp_tcache_allocated());
    sp_tcache_free(p);
    test_orphans_tidied();
    return done();
}
