/* libFuzzer target: allocation and frame sequences on two small frame arenas, checked against
 * a model after every operation. One thread: what threads trade is checked by test_frame's
 * randomized closes and frame_stress; here the close's choices (read the claim records or keep
 * the reservation), replayed and lost chunks, holes, direct ranges, overflows in both modes and
 * a heap fallback that fails or misbehaves are driven by the input.
 *
 * Checked: every block lies in the current buffer (or is a heap-fallback block, counted as an
 * overflow), aligned as asked, and keeps its pattern until its buffer comes round (checked
 * then); no two live blocks overlap (checked at every advance); each close's status equals the
 * status read before it (and the buffer's status after it), counts at least the frame's blocks
 * in the buffer, and has the model's peak; a reclaimed buffer starts empty; the heap fallback
 * holds exactly the live frames' blocks, and one that returns a misaligned block is reported;
 * a request overflows only when it would not fit the half of the buffer that chunks kept for
 * claims that did not come back can never take (a bound set by the reservation's limit, not by
 * the close: when a close must read the claim records, the quarter and overflow rules, is
 * tested in test_frame); misuse is reported once and changes nothing.
 *
 * Input: 4 bytes of configuration, then 4-byte records  op | arg | size lo | size hi. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sp_frame.h"
#include "test_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { ARENAS = 2, MAX_BLOCKS = 1200 };

typedef struct block {
    uint8_t *p;
    size_t n;
    uint8_t fill;
    bool heap;
} block;

typedef struct model {
    sp_frame_arena *a;
    uint32_t buffers;
    size_t capacity, chunk;
    bool heap_mode; /* SP_FRAME_OVERFLOW_HEAP */
    bool own_heap;  /* through heap_alloc / heap_free below (else the C library's) */
    uint64_t frame;
    block *blocks[SP_FRAME_MAX_BUFFERS]; /* the live blocks of each buffer's frame */
    size_t count[SP_FRAME_MAX_BUFFERS];
    size_t peak[SP_FRAME_MAX_BUFFERS];
    size_t overflows, overflow_bytes; /* the open frame's */
} model;

/* The heap fallback: posix_memalign, or (by the input) a failure or a block off by 8 bytes,
 * which the arena must hand back. live counts the blocks it holds. */
static struct {
    enum { HEAP_GOOD, HEAP_FAIL, HEAP_MISALIGNED } mode;
    long live;
} fallback;

static void *heap_alloc(void *user, size_t align, size_t size) {
    (void)user;
    void *p;
    if (fallback.mode == HEAP_FAIL || posix_memalign(&p, align, size + 16) != 0) return NULL;
    fallback.live++;
    return (uint8_t *)p + (fallback.mode == HEAP_MISALIGNED ? 8 : 0);
}

static void heap_free(void *user, void *p) {
    (void)user;
    fallback.live--;
    free((uint8_t *)p - ((uintptr_t)p & 8));
}

static sp_frame_buffer_status status(const model *m, uint32_t i) {
    sp_frame_buffer_status st;
    sp_frame_buffer_status_get(m->a, i, &st);
    return st;
}

static bool status_equal(const sp_frame_buffer_status *x, const sp_frame_buffer_status *y) {
    return x->frame == y->frame && x->bytes_used == y->bytes_used && x->peak == y->peak &&
           x->chunks == y->chunks && x->overflows == y->overflows &&
           x->overflow_bytes == y->overflow_bytes && x->capacity == y->capacity;
}

static uint32_t current(const model *m) {
    return (uint32_t)(m->frame % m->buffers);
}

/* The blocks of buffer b of m keep their patterns. */
static void patterns_check(const model *m, uint32_t b) {
    for (size_t j = 0; j < m->count[b]; j++)
        if (!ts_filled(m->blocks[b][j].p, m->blocks[b][j].n, m->blocks[b][j].fill)) abort();
}

/* No two live blocks of the two arenas overlap. */
static void overlaps_check(const model *ms) {
    static ts_span spans[ARENAS * SP_FRAME_MAX_BUFFERS * MAX_BLOCKS];
    size_t n = 0;
    for (int k = 0; k < ARENAS; k++)
        for (uint32_t b = 0; b < ms[k].buffers; b++)
            for (size_t j = 0; j < ms[k].count[b]; j++)
                if (ms[k].blocks[b][j].n)
                    spans[n++] = (ts_span){(uintptr_t)ms[k].blocks[b][j].p, ms[k].blocks[b][j].n};
    if (ts_overlaps(spans, n)) abort();
}

static long heap_blocks_live(const model *ms) {
    long n = 0;
    for (int k = 0; k < ARENAS; k++)
        for (uint32_t b = 0; b < ms[k].buffers; b++)
            for (size_t j = 0; j < ms[k].count[b]; j++)
                n += ms[k].own_heap && ms[k].blocks[b][j].heap;
    return n;
}

static void alloc_one(model *m, size_t align, size_t n, uint8_t fill) {
    uint32_t cur = current(m);
    if (m->count[cur] == MAX_BLOCKS) return;
    int logged = ts_logged.count;
    uint8_t *p = align ? sp_frame_aligned_alloc(m->a, align, n) : sp_frame_alloc(m->a, n);
    size_t al = align > 16 ? align : 16;
    sp_frame_buffer_status st = status(m, cur);
    int in = p ? sp_frame_arena_buffer_of(m->a, p) : -1;
    if (in < 0) {
        /* An overflow: refused, or served by the heap fallback, which only fails when the
         * input makes ours fail or misbehave. The chunks kept for claims that did not come back
         * (the reservation) take at most half the buffer, so a request overflows only when the
         * other half cannot hold it next to the frame's chunks and direct ranges (bytes_used):
         * a small one needs a fresh chunk, any one its range (and padding) from the top. */
        m->overflows++;
        if (p) m->overflow_bytes += n;
        if (p ? !m->heap_mode : m->heap_mode && (!m->own_heap || fallback.mode == HEAP_GOOD))
            abort();
        if (!p && m->heap_mode && m->own_heap && fallback.mode == HEAP_MISALIGNED &&
            (ts_logged.count == logged || ts_logged.last_id != SP_ERR_BAD_ALIGNMENT))
            abort();
        size_t half = m->capacity / 2, need = (n ? n + 15 : 16) / 16 * 16 + al;
        if (st.bytes_used + need <= half ||
            (n <= m->chunk / 4 && al <= m->chunk / 4 && st.bytes_used + m->chunk <= half))
            abort();
    } else if ((uint32_t)in != cur || (n && sp_frame_arena_buffer_of(m->a, p + n - 1) != in)) {
        abort();
    }
    if (st.overflows != m->overflows || st.overflow_bytes != m->overflow_bytes) abort();
    if (!p) return;
    if ((uintptr_t)p % al) abort();
    ts_fill(p, n, fill);
    m->blocks[cur][m->count[cur]++] = (block){p, n, fill, in < 0};
}

static void advance(model *ms, model *m, bool ask) {
    overlaps_check(ms);
    uint32_t cur = current(m);
    patterns_check(m, (cur + 1) % m->buffers); /* each block once, at the end of its life */
    sp_frame_buffer_status before = status(m, cur), closed;
    size_t held = 0; /* the frame's blocks in the buffer, each in a counted chunk or range */
    for (size_t j = 0; j < m->count[cur]; j++)
        if (!m->blocks[cur][j].heap) held += (m->blocks[cur][j].n + 15) / 16 * 16;
    if (before.frame != m->frame || before.bytes_used > m->capacity || before.bytes_used < held)
        abort();
    if (before.bytes_used > m->peak[cur]) m->peak[cur] = before.bytes_used;
    if (before.peak != m->peak[cur]) abort();
    uint64_t f = sp_frame_arena_advance(m->a, ask ? &closed : NULL);
    if (f != ++m->frame || sp_frame_arena_frame(m->a) != f) abort();
    uint32_t next = current(m);
    sp_frame_buffer_status after = status(m, cur); /* one buffer: reclaimed already */
    if ((next != cur && !status_equal(&before, &after)) || (ask && !status_equal(&before, &closed)))
        abort();
    m->count[next] = 0; /* reclaimed */
    m->overflows = m->overflow_bytes = 0;
    sp_frame_buffer_status fresh = status(m, next);
    if (fresh.frame != f || fresh.bytes_used || fresh.chunks || fresh.overflows ||
        fresh.overflow_bytes || fresh.peak != m->peak[next] || fresh.capacity != m->capacity)
        abort();
    if (fallback.live != heap_blocks_live(ms)) abort();
}

/* Misuse: reported once, NULL or zeroed, nothing changed. */
static void misuse(model *m, unsigned kind) {
    uint32_t cur = current(m);
    sp_frame_buffer_status before = status(m, cur), st;
    int logged = ts_logged.count;
    switch (kind % 4) {
    case 0: /* an alignment that is not a power of two */
        if (sp_frame_aligned_alloc(m->a, 24 + 16 * (kind / 4 % 8), 16)) abort();
        break;
    case 1: /* a size that overflows */
        if (sp_frame_alloc(m->a, (size_t)PTRDIFF_MAX + 1 + kind)) abort();
        break;
    case 2: /* a buffer the arena does not have */
        sp_frame_buffer_status_get(m->a, m->buffers + kind / 4 % 3, &st);
        if (st.capacity || st.bytes_used || st.frame) abort();
        break;
    default: /* no arena */
        if (sp_frame_arena_advance(NULL, &st) != 0 || st.capacity) abort();
        break;
    }
    if (ts_logged.count != logged + 1) abort();
    sp_frame_buffer_status after = status(m, cur);
    if (!status_equal(&before, &after)) abort();
}

static bool model_make(model *m, uint8_t c0, uint8_t c1) {
    static block storage[ARENAS][SP_FRAME_MAX_BUFFERS][MAX_BLOCKS];
    static int made;
    size_t page = sp_page_size();
    *m = (model){.buffers = 1 + c0 % 4, .chunk = (size_t)1024 << (c0 >> 2 & 3)};
    m->capacity = page * (1 + c1 % 16) << (c1 & 0x40 ? 4 : 0); /* up to 1,024 chunks */
    m->heap_mode = c0 & 0x40;
    sp_frame_desc d = {.region_size = m->capacity * m->buffers,
                       .buffers = m->buffers,
                       .chunk_size = m->chunk,
                       .overflow = m->heap_mode ? SP_FRAME_OVERFLOW_HEAP : SP_FRAME_OVERFLOW_NULL,
                       .heap_alloc = c1 & 0x80 ? heap_alloc : NULL,
                       .heap_free = c1 & 0x80 ? heap_free : NULL};
    int logged = ts_logged.count;
    sp_result r;
    m->a = sp_frame_arena_create(&d, &r);
    if (m->capacity < m->chunk) { /* a buffer below one chunk: refused */
        if (m->a || r != SP_ERR_TOO_SMALL || ts_logged.count != logged + 1) abort();
        return false;
    }
    if (!m->a || r != SP_OK) abort();
    m->own_heap = c1 & 0x80;
    for (uint32_t b = 0; b < m->buffers; b++) m->blocks[b] = storage[made % ARENAS][b];
    made++;
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool quiet;
    if (!quiet) {
        ts_log_capture(); /* misuse and overflow warnings are part of the input */
        quiet = true;
    }
    if (size < 4) return 0;
    model ms[ARENAS];
    fallback.mode = HEAP_GOOD;
    fallback.live = 0;
    if (!model_make(&ms[0], data[0], data[1])) return 0;
    if (data[2] & 1) /* three arenas made and gone: the second shares the first's chunk slot */
        for (int k = 0; k < SP_FRAME_SLOTS - 1; k++)
            sp_frame_arena_destroy(sp_frame_arena_create(
                &(sp_frame_desc){.region_size = 2 * sp_page_size(), .chunk_size = 1024}, NULL));
    if (!model_make(&ms[1], data[2] >> 1, data[3])) {
        sp_frame_arena_destroy(ms[0].a);
        return 0;
    }
    model *m = &ms[0];
    uint8_t fill = 1;
    for (size_t i = 4; i + 4 <= size; i += 4) {
        unsigned op = data[i] % 12, arg = data[i + 1];
        size_t n = (size_t)data[i + 2] | (size_t)(data[i + 3] % 32) << 8; /* below 8 KiB */
        if (data[i] & 0x80) n %= 300;      /* the benchmark's sizes, often */
        if (data[i] & 0x40) n <<= arg % 5; /* past a buffer now and then */
        switch (op) {
        case 0:
        case 1:
        case 2:
        case 3: alloc_one(m, 0, n, fill++); break;
        case 4:
        case 5: /* any power of two; those above the buffer overflow */
            alloc_one(m, (size_t)1 << arg % 22, n, fill++);
            break;
        case 6:
        case 7: /* the status asked for now and then: the close then reads the records */
            advance(ms, m, arg % 4 == 0);
            break;
        case 8: m = &ms[arg & 1]; break;
        case 9: fallback.mode = arg % 3; break;
        case 10: misuse(m, arg); break;
        default: { /* a buffer's status at any time */
            sp_frame_buffer_status st = status(m, arg % m->buffers);
            if (st.capacity != m->capacity || st.bytes_used > m->capacity) abort();
            break;
        }
        }
    }
    overlaps_check(ms);
    for (int k = 0; k < ARENAS; k++) {
        for (uint32_t b = 0; b < ms[k].buffers; b++) patterns_check(&ms[k], b);
        sp_frame_arena_destroy(ms[k].a);
    }
    if (fallback.live != 0) abort(); /* destroy freed every heap-fallback block */
    return 0;
}
