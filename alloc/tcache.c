/* Thread caches (sp_tcache.h): the out-of-line rest of alloc and free, spans, attach/detach,
 * orphans, the two central heaps and their growth. The inline fast paths live in the header;
 * everything here runs when they miss, or in sanitizer builds, where it does the whole job
 * and tells ASan/Valgrind about block state through track.h. Status and trim: tcache_status.c.
 */
#include <stdio.h>
#include <string.h>
#include <threads.h>

#include "tcache_heap.h"
#include "tcache_internal.h"
#include "track.h"

sp_tcache_globals sp_tcache_g;
tcache_state tc;

/* The sentinel stands in for "no current span": its free list is always empty. */
span tcache_sentinel;
#define S1 &tcache_sentinel.pub
#define S8 S1, S1, S1, S1, S1, S1, S1, S1
#define S80 S8, S8, S8, S8, S8, S8, S8, S8, S8, S8
_Static_assert(SP_TCACHE_CLASSES == 80, "S80 initialises every class");

/* What an unattached thread's pointer points at: every class misses into the slow path. */
#define S65 S8, S8, S8, S8, S8, S8, S8, S8, S1
_Static_assert(SP_TCACHE_LOOKUP_MAX / 16 + 1 == 65, "S65 initialises every direct entry");
static cache unattached = {.pub = {.direct = {S65}, .cur = {S80}}};

_Thread_local sp_tcache *sp_tcache_tls __attribute__((tls_model("initial-exec"))) = &unattached.pub;
/* Set once the thread-exit hook has run: later calls (other destructors, libc's own) use the
 * shared fallback cache under its lock instead of attaching again. */
static _Thread_local bool tls_exited;
/* Set once the thread was told that it allocates from the fallback cache (explicit_attach). */
static _Thread_local bool tls_fallback_told;

/* ---- size classes ------------------------------------------------------------------------ */

uint32_t tcache_class_size(uint32_t k) {
    if (k < 8) return 16 * (k + 1);
    uint32_t g = (k - 8) / 8, j = (k - 8) % 8;
    return (128u << g) + (j + 1) * (16u << g);
}

uint32_t tcache_class_of(size_t n) {
    if (n <= 128) return n ? (uint32_t)((n + 15) / 16 - 1) : 0;
    uint32_t m = 63 - (uint32_t)__builtin_clzll((unsigned long long)(n - 1)); /* floor log2 */
    uint32_t g = m - 7;
    return 8 + 8 * g + (uint32_t)((n - 1) >> (g + 4)) - 8;
}

/* The alignment of a class's first block, whatever the span's colour: pow2 classes from 512 B
 * on start aligned to min(size, 4 KiB), so that aligned_alloc can use them; the rest right
 * after the header (whose end is a multiple of SPAN_HEADER). */
static uint32_t class_align(uint32_t bs) {
    return sp_is_pow2(bs) && bs >= 512 ? (bs < 4096 ? bs : 4096) : SPAN_HEADER;
}

/* Offset of the first block of class size bs in a span whose header ends at header_end. */
static uint32_t class_start(uint32_t bs, uint32_t header_end) {
    return (uint32_t)sp_align_up(header_end, class_align(bs));
}

static void classes_init(uint32_t max_class) {
    tc.class_count = tcache_class_of(max_class) + 1;
    tc.max_class = tcache_class_size(tc.class_count - 1);
    memset(tc.direct_end, 0, sizeof tc.direct_end);
    for (uint32_t i = 0; i < SP_ARRAY_LEN(sp_tcache_g.class_of); i++) {
        size_t n = (size_t)i * 16;
        /* Too large for a class: a class index no cache ever fills (always the sentinel). */
        uint8_t k = (uint8_t)(n <= tc.max_class ? tcache_class_of(n) : SP_TCACHE_CLASSES - 1);
        sp_tcache_g.class_of[i] = k;
        /* class_of never decreases: each class's entries are one run */
        if (tc.direct_end[k] == 0) tc.direct_first[k] = (uint8_t)i;
        tc.direct_end[k] = (uint8_t)(i + 1);
    }
}

/* ---- spans ------------------------------------------------------------------------------- */

static uintptr_t span_magic(const span *s) {
    return (uintptr_t)s ^ sp_tcache_g.key ^ (uintptr_t)0x5350414e5350414eull;
}

/* Turn s (fresh from the heap, empty or adopted-empty) into an empty span of class k owned by
 * c. The block area becomes allocator-internal for the sanitizers. */
TRACK_INTERNAL static void span_format(span *s, cache *c, uint32_t k) {
    uint32_t bs = tcache_class_size(k);
    __atomic_store_n(&s->pub.head, 0, __ATOMIC_RELAXED);
    char *base = span_base(s);
    s->pub.first32 =
        (uint32_t)(uintptr_t)(base + class_start(bs, (uint32_t)((char *)s - base) + SPAN_HEADER));
    span_check_init(&s->pub, bs);
    s->cls = k;
    s->block_size = bs;
    s->capacity = (uint32_t)(span_area(s) / bs);
    s->next = s->prev = NULL;
    atomic_store_explicit(&s->inbox, 0, memory_order_relaxed);
    s->magic = span_magic(s);
    __atomic_store_n(&s->owner_tid, c ? c->tid : 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->pub.owner, c ? &c->pub : NULL, __ATOMIC_RELEASE);
    track_pool(span_first(s), span_area(s));
}

/* A page's worth of blocks of bs bytes, at least one (about what one carve cuts). */
static uint32_t carve_batch(uint32_t bs) {
    return bs < 4096 ? 4096 / bs : 1;
}

/* Cut the blocks that start in the 4 KiB page holding the next uncarved one (at least one)
 * onto the free list: each carve writes blocks into that page only, a later page than the
 * last carve's, and (for blocks under 4 KiB) the blocks it hands out reach at most into the
 * next page (a page's worth from wherever the last carve ended wrote into two, so a span
 * holding few blocks had a page more resident than it needed). Returns false when the span is
 * fully carved. */
TRACK_INTERNAL static bool span_carve(span *s) {
    uint32_t bs = s->block_size, done = s->pub.carved;
    uint32_t left = s->capacity - done;
    if (left == 0) return false;
    char *first = span_first(s) + (size_t)done * bs;
    uintptr_t page_end = sp_align_down((uintptr_t)first, 4096) + 4096;
    uint32_t n = (uint32_t)((page_end - (uintptr_t)first + bs - 1) / bs);
    if (n > left) n = left;
    sp_tcache_block *head = span_free(s);
    for (uint32_t i = n; i-- > 0;) {
        sp_tcache_block *b = (sp_tcache_block *)(first + (size_t)i * bs);
        b->next = head;
        b->tag = (uintptr_t)b ^ sp_tcache_g.key; /* carved blocks count as free */
        head = b;
    }
    span_free_set(s, head);
    span_check_carved(&s->pub, bs, done + n);
    return true;
}

/* Take the whole inbox onto the free list. Owner (or orphan-lock holder) only. Returns the
 * number of blocks taken; c (may be NULL) counts them. The list is walked only when the free
 * list is not empty (to append); the count comes with the list. */
TRACK_INTERNAL uint32_t span_collect(span *s, cache *c) {
    if (atomic_load_explicit(&s->inbox, memory_order_relaxed) == 0) return 0;
    uintptr_t v = atomic_exchange_explicit(&s->inbox, 0, memory_order_acquire);
    /* Non-zero (seen above), taken only here: it holds a list of count >= 1 blocks. */
    sp_tcache_block *list = sp_tcache_list_(v);
    uint32_t n = sp_tcache_count_(v);
    uintptr_t h = s->pub.head;
    if (sp_tcache_list_(h)) {
        sp_tcache_block *tail = list;
        while (tail->next) tail = tail->next;
        tail->next = sp_tcache_list_(h);
    }
    SP_INVARIANT(n <= span_used(s), "span_collect", s);
    h = sp_tcache_count_bits_(h) - n * SP_TCACHE_COUNT_ONE + (uintptr_t)list;
    __atomic_store_n(&s->pub.head, h, __ATOMIC_RELAXED);
    if (c)
        __atomic_store_n(&c->remote_collected, c->remote_collected + n, __ATOMIC_RELAXED);
    else
        atomic_fetch_add_explicit(&tc.orphan_collected, n, memory_order_relaxed);
    return n;
}

static bool span_has_room(span *s) {
    return span_free(s) != NULL || s->pub.carved < s->capacity ||
           atomic_load_explicit(&s->inbox, memory_order_relaxed) != 0;
}

/* Whether s (not current) holds at least half a page's worth of carved blocks, free or in its
 * inbox: worth switching to instead of carving. Owner only. */
static bool span_has_batch(span *s) {
    uint32_t ready = s->pub.carved - span_used(s) +
                     sp_tcache_count_(atomic_load_explicit(&s->inbox, memory_order_relaxed));
    return 2 * ready >= carve_batch(s->block_size);
}

static span *spare_take(cache *c, uint32_t k, bool any_class);

/* A new span formatted for class k: a spare of any class, else one from the central span
 * heap; NULL if the heap cannot grow. */
static span *span_new(cache *c, uint32_t k) {
    span *spare = spare_take(c, k, true);
    if (spare) return spare;
    char *base = heap_alloc(&tc.spans, SP_TCACHE_SPAN, SP_TCACHE_SPAN - SPAN_TAIL);
    if (!base) return NULL;
    track_subpool_begin(base, SP_TCACHE_SPAN - SPAN_TAIL);
    span *s = span_of(base);
    span_format(s, c, k);
    return s;
}

/* Give an empty span back to the central heap. */
TRACK_INTERNAL void span_release(span *s) {
    SP_INVARIANT(sp_tcache_count_(s->pub.head) == 0, "span_release", s); /* and not current */
    char *base = span_base(s);
    track_release(span_first(s), span_area(s));
    s->magic = 0;
    __atomic_store_n(&s->pub.owner, NULL, __ATOMIC_RELAXED);
    track_subpool_end(base, SP_TCACHE_SPAN - SPAN_TAIL);
    heap_free(&tc.spans, base, "span_release");
}

/* ---- a cache's lists (changes under c->lock: status readers walk them) ------------------- */

static void ring_insert(cache *c, span *s) {
    span **head = &c->ring[s->cls];
    c->ring_len[s->cls]++;
    if (!*head) {
        s->next = s->prev = s;
        *head = s;
        return;
    }
    s->next = *head;
    s->prev = (*head)->prev;
    s->prev->next = s;
    (*head)->prev = s;
}

void tcache_ring_remove(cache *c, span *s) {
    span **head = &c->ring[s->cls];
    c->ring_len[s->cls]--;
    if (s->next == s) {
        *head = NULL;
    } else {
        s->prev->next = s->next;
        s->next->prev = s->prev;
        if (*head == s) *head = s->next;
    }
    s->next = s->prev = NULL;
}

/* Set cur[k] and the direct entries of the sizes in class k (list lock held, or the cache
 * not yet visible); moves the current-span bias of `used` from the old span to s. */
void tcache_set_cur(cache *c, uint32_t k, span *s) {
    span *old = (span *)c->pub.cur[k];
    SP_INVARIANT(old == &tcache_sentinel || (old->pub.head & SPAN_CURRENT), "tcache_set_cur", old);
    SP_INVARIANT(s == &tcache_sentinel || !(s->pub.head & SPAN_CURRENT), "tcache_set_cur", s);
    if (old != &tcache_sentinel)
        __atomic_store_n(&old->pub.head, old->pub.head - SPAN_CURRENT, __ATOMIC_RELAXED);
    if (s != &tcache_sentinel)
        __atomic_store_n(&s->pub.head, s->pub.head + SPAN_CURRENT, __ATOMIC_RELAXED);
    c->pub.cur[k] = &s->pub;
    for (uint32_t i = tc.direct_first[k]; i < tc.direct_end[k]; i++) c->pub.direct[i] = &s->pub;
}

/* Make s the current span of its class; the old one (if any) joins the ring. */
static void make_current(cache *c, span *s, bool from_ring) {
    uint32_t k = s->cls;
    sp_mutex_lock(&c->lock);
    if (from_ring) tcache_ring_remove(c, s);
    span *old = (span *)c->pub.cur[k];
    if (old != &tcache_sentinel) ring_insert(c, old);
    tcache_set_cur(c, k, s);
    sp_mutex_unlock(&c->lock);
}

/* Ring spans a refill looks at. A ring no longer than this is searched for carved blocks
 * before the current span carves; a longer one holds mostly full spans, and looking at them on
 * every refill cost more than carving. */
enum { RING_SCAN = 8 };

/* Look at up to RING_SCAN spans of the ring (rotating it) for one that `room` accepts. */
static span *ring_scan(cache *c, uint32_t k, bool (*room)(span *)) {
    if (!c->ring[k]) return NULL;
    span *found = NULL;
    sp_mutex_lock(&c->lock);
    for (uint32_t i = 0; i < RING_SCAN && !found; i++) {
        span *s = c->ring[k];
        if (room(s))
            found = s;
        else
            c->ring[k] = s->next;
    }
    sp_mutex_unlock(&c->lock);
    return found;
}

/* c's kept empty spans, taken off its list whole (a chain through next). */
static span *empty_list_take(cache *c) {
    sp_mutex_lock(&c->lock);
    span *e = c->empty;
    c->empty = NULL;
    c->empty_count = 0;
    sp_mutex_unlock(&c->lock);
    return e;
}

static span *empty_take(cache *c, uint32_t k) {
    span *s = c->empty;
    if (!s) return NULL;
    sp_mutex_lock(&c->lock);
    c->empty = s->next;
    c->empty_count--;
    sp_mutex_unlock(&c->lock);
    if (s->cls != k) {
        span_format(s, c, k);
    } else {
        s->next = s->prev = NULL;
    }
    return s;
}

/* c takes the detached span s (an orphan or a spare of c's class) as its own. */
static void span_adopt(span *s, cache *c) {
    s->next = s->prev = NULL;
    __atomic_store_n(&s->owner_tid, c->tid, __ATOMIC_RELAXED);
    __atomic_store_n(&s->pub.owner, &c->pub, __ATOMIC_RELEASE);
}

/* Adopt an orphaned span of class k (collecting its inbox); NULL if there is none. */
static span *orphan_adopt(cache *c, uint32_t k) {
    if (atomic_load_explicit(&tc.orphan_count[k], memory_order_relaxed) == 0) return NULL;
    sp_mutex_lock(&tc.orphan_lock);
    span *s = tc.orphans[k];
    if (s) tcache_orphan_unlink(s);
    sp_mutex_unlock(&tc.orphan_lock);
    if (!s) return NULL;
    span_adopt(s, c);
    span_collect(s, c);
    return s;
}

/* Hand s (not current, inbox collected) to the orphan list (live blocks) or, while its class
 * has fewer than keep_detached, the spare list (empty) of its class; an empty s neither takes
 * goes back to the central heap. */
static void span_detach(span *s) {
    uint32_t k = s->cls;
    bool spare = span_used(s) == 0;
    sp_mutex_lock(&tc.orphan_lock);
    bool take =
        !spare || atomic_load_explicit(&tc.spare_count[k], memory_order_relaxed) < tc.keep_detached;
    if (take) {
        __atomic_store_n(&s->pub.owner, NULL, __ATOMIC_SEQ_CST);
        __atomic_store_n(&s->owner_tid, 0, __ATOMIC_RELAXED);
        /* A remote free that read the old owner after its push counted no orphan free. */
        if (!spare && atomic_load_explicit(&s->inbox, memory_order_seq_cst))
            atomic_fetch_add_explicit(&tc.orphan_frees, 1, memory_order_relaxed);
        span **list = spare ? &tc.spares[k] : &tc.orphans[k];
        s->prev = NULL;
        s->next = *list;
        if (*list) (*list)->prev = s;
        *list = s;
        atomic_fetch_add_explicit(spare ? &tc.spare_count[k] : &tc.orphan_count[k], 1,
                                  memory_order_relaxed);
        if (spare) atomic_fetch_add_explicit(&tc.spare_total, 1, memory_order_relaxed);
    }
    sp_mutex_unlock(&tc.orphan_lock);
    if (!take) span_release(s);
}

void tcache_orphan_unlink(span *s) {
    uint32_t k = s->cls;
    if (s->prev)
        s->prev->next = s->next;
    else
        tc.orphans[k] = s->next;
    if (s->next) s->next->prev = s->prev;
    if (tc.orphan_walk_at == s) tc.orphan_walk_at = s->next;
    s->next = s->prev = NULL;
    atomic_fetch_sub_explicit(&tc.orphan_count[k], 1, memory_order_relaxed);
}

span *tcache_spare_pop(uint32_t k) {
    span *s = tc.spares[k];
    if (s) {
        tc.spares[k] = s->next;
        atomic_fetch_sub_explicit(&tc.spare_count[k], 1, memory_order_relaxed);
        atomic_fetch_sub_explicit(&tc.spare_total, 1, memory_order_relaxed);
    }
    return s;
}

/* Take a spare of class k (any_class: of any class, k's first, reformatted for k) for c; NULL
 * if there is none. */
static span *spare_take(cache *c, uint32_t k, bool any_class) {
    if (atomic_load_explicit(any_class ? &tc.spare_total : &tc.spare_count[k],
                             memory_order_relaxed) == 0)
        return NULL;
    span *s = NULL;
    sp_mutex_lock(&tc.orphan_lock);
    for (uint32_t i = 0; i < (any_class ? SP_TCACHE_CLASSES : 1) && !s; i++)
        s = tcache_spare_pop((k + i) % SP_TCACHE_CLASSES);
    sp_mutex_unlock(&tc.orphan_lock);
    if (!s) return NULL;
    if (s->cls != k)
        span_format(s, c, k); /* its blocks were all free: cut anew */
    else
        span_adopt(s, c);
    return s;
}

/* ---- the slow path of alloc ------------------------------------------------------------- */

/* A block of class k from cache c when cur[k]'s free list is empty. NULL: out of memory.
 * Carved blocks before new ones where that is cheap: the current span's inbox; then, only
 * while the class has at most RING_SCAN spans on its ring, a ring span holding half a page's
 * worth of blocks (free or in its inbox); then a spare of the class (an exited thread's empty span:
 * resident pages). Only then new blocks: the current span's uncut tail, other ring spans,
 * kept empty spans, orphans, a spare of another class or a new span (RING_SCAN says why a
 * long ring is not searched first). */
TRACK_INTERNAL static sp_tcache_block *class_refill(cache *c, uint32_t k) {
    span *s = (span *)c->pub.cur[k];
    bool current = s != &tcache_sentinel;
    if (current && span_collect(s, c)) return span_free(s);
    /* Past the cheapest refill: orphans emptied by remote frees go back here too where nobody
     * calls sp_tcache_tidy (tidy_orphans); else they would pile up, threads coming and going. */
    if (tc.tidy_orphans) tcache_orphans_tidy(1);
    bool from_ring = true;
    span *t = c->ring_len[k] <= RING_SCAN ? ring_scan(c, k, span_has_batch) : NULL;
    if (!t) {
        from_ring = false;
        t = spare_take(c, k, false);
    }
    if (!t) {
        if (current && span_carve(s)) return span_free(s);
        from_ring = true;
        t = ring_scan(c, k, span_has_room);
    }
    if (t) {
        span_collect(t, c);
    } else {
        from_ring = false;
        t = empty_take(c, k);
        if (!t) {
            t = orphan_adopt(c, k);
            if (t && !span_free(t) && !span_carve(t)) {
                sp_mutex_lock(&c->lock); /* full: keep it on the ring, take a new one */
                ring_insert(c, t);
                sp_mutex_unlock(&c->lock);
                t = NULL;
            }
        }
        if (!t) t = span_new(c, k);
        if (!t) return NULL;
    }
    if (!span_free(t)) span_carve(t);
    make_current(c, t, from_ring);
    return span_free(t);
}

/* Pop a block of class k from c (refilling as needed). */
TRACK_INTERNAL static void *class_alloc(cache *c, uint32_t k) {
    span *s = (span *)c->pub.cur[k];
    sp_tcache_block *b = span_free(s);
    if (SP_UNLIKELY(!b)) {
        b = class_refill(c, k);
        if (!b) return NULL;
        s = (span *)c->pub.cur[k];
    }
    sp_tcache_pop_(&s->pub, s->pub.head, b);
    track_malloc(b, s->block_size, 0);
    return b;
}

/* ---- attach / detach --------------------------------------------------------------------- */

static bool registry_add(cache *c) {
    sp_mutex_lock(&tc.reg_lock);
    if (tc.attach_closed) {
        sp_mutex_unlock(&tc.reg_lock);
        return false;
    }
    sp_mutex_lock(&tc.count_lock);
    c->reg_prev = NULL;
    c->reg_next = tc.registry;
    if (tc.registry) tc.registry->reg_prev = c;
    tc.registry = c;
    sp_mutex_unlock(&tc.count_lock);
    tc.cache_count++;
    c->registered = true;
    sp_mutex_unlock(&tc.reg_lock);
    return true;
}

size_t tcache_attach_close(bool closed) {
    sp_mutex_lock(&tc.reg_lock);
    tc.attach_closed = closed;
    size_t n = tc.cache_count;
    sp_mutex_unlock(&tc.reg_lock);
    return n;
}

static void registry_remove(cache *c) {
    sp_mutex_lock(&tc.reg_lock);
    sp_mutex_lock(&tc.count_lock);
    if (c->reg_prev)
        c->reg_prev->reg_next = c->reg_next;
    else
        tc.registry = c->reg_next;
    if (c->reg_next) c->reg_next->reg_prev = c->reg_prev;
    tc.retired_allocated += c->pub.allocated;
    sp_mutex_unlock(&tc.count_lock);
    tc.cache_count--;
    c->registered = false;
    tc.retired_remote_frees += c->remote_frees;
    tc.retired_collected += c->remote_collected;
    sp_mutex_unlock(&tc.reg_lock);
}

void tcache_cache_init(cache *c, uint64_t tid) {
    memset(c, 0, sizeof *c);
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++) c->pub.cur[k] = &tcache_sentinel.pub;
    for (uint32_t i = 0; i < SP_ARRAY_LEN(c->pub.direct); i++)
        c->pub.direct[i] = &tcache_sentinel.pub;
    c->tid = tid;
}

sp_tcache *tcache_create(sp_result *why) {
    if (why) *why = SP_ERR_NOMEM;
    if (!tcache_ready()) return NULL;
    /* A cache record gets a span of its own (a page or two of it is touched), after a zeroed
     * header: a user's stale or forged free into it fails the magic check, where a record in
     * the large heap could be freed by a stale large pointer that happened to match it. */
    char *rec = heap_alloc(&tc.spans, SP_TCACHE_SPAN, SP_TCACHE_SPAN - SPAN_TAIL);
    if (!rec) return NULL;
    span *h = span_of(rec);
    /* The owner word atomically: a remote free that pushed into the span this was before may
     * still read it (block_free_remote). */
    const size_t at = offsetof(sp_tcache_span, owner), past = at + sizeof h->pub.owner;
    memset(h, 0, at);
    __atomic_store_n(&h->pub.owner, NULL, __ATOMIC_RELAXED);
    memset((char *)h + past, 0, SPAN_HEADER - past);
    cache *c = (cache *)((char *)h + SPAN_HEADER);
    tcache_cache_init(c, sp_thread_os_id());
    if (!registry_add(c)) {
        heap_free(&tc.spans, rec, "tcache_create");
        if (why) *why = SP_ERR_SHUTDOWN;
        return NULL;
    }
    return &c->pub;
}

/* Hand back every span of c: those with live blocks to the orphan lists, empty ones (still
 * cut into blocks) to the spare lists while a class has fewer than keep_detached spares, the
 * other empty ones to the central heap. */
void tcache_cache_drain(cache *c) {
    for (uint32_t k = 0; k < SP_TCACHE_CLASSES; k++) {
        span *cur = (span *)c->pub.cur[k];
        sp_mutex_lock(&c->lock);
        tcache_set_cur(c, k, &tcache_sentinel);
        span *ring = c->ring[k];
        c->ring[k] = NULL;
        c->ring_len[k] = 0;
        sp_mutex_unlock(&c->lock);
        if (ring) ring->prev->next = NULL; /* open the circle */
        if (cur != &tcache_sentinel) {
            cur->next = ring;
            ring = cur;
        }
        while (ring) {
            span *s = ring;
            ring = s->next;
            span_collect(s, c);
            span_detach(s);
        }
    }
    span *e = empty_list_take(c);
    while (e) {
        span *s = e;
        e = s->next;
        span_detach(s);
    }
}

/* Return c's kept empty spans to the central heap; returns their bytes. */
size_t tcache_empty_release(cache *c) {
    size_t bytes = 0;
    span *e = empty_list_take(c);
    while (e) {
        span *s = e;
        e = s->next;
        span_release(s);
        bytes += SP_TCACHE_SPAN;
    }
    return bytes;
}

void tcache_destroy(sp_tcache *pc) {
    cache *c = (cache *)pc;
    if (!c || c == &unattached || c == &tc.fallback) return;
    track_enter();
    tcache_cache_drain(c); /* still registered: its collections are counted */
    track_leave();
    registry_remove(c);
    heap_free(&tc.spans, span_base(c), "tcache_destroy");
}

sp_tcache *tcache_bind(sp_tcache *c) {
    sp_tcache *old = sp_tcache_tls;
    sp_tcache_tls = c ? c : &unattached.pub;
    return old;
}

/* Thread exit (C11 tss destructor): detach, and route later calls to the fallback cache. */
static void thread_exit(void *arg) {
    (void)arg;
    sp_tcache_thread_detach();
    tls_exited = true;
}

sp_result sp_tcache_thread_attach(void) {
    if (sp_tcache_tls != &unattached.pub) return SP_OK;
    if (!tcache_ready()) return SP_ERR_NOMEM;
    sp_result why;
    sp_tcache *c = tcache_create(&why);
    if (!c) {
        if (why == SP_ERR_SHUTDOWN)
            sp_log(SP_LOG_WARN, SP_ERR_SHUTDOWN, "sp_tcache_thread_attach", NULL,
                   "the runtime is shutting down: no new thread cache");
        return why;
    }
    sp_tcache_tls = c;
    tls_exited = false;
    if (tc.tss_ok) tss_set(tc.tss, c);
    return SP_OK;
}

void sp_tcache_thread_detach(void) {
    sp_tcache *c = sp_tcache_tls;
    if (c == &unattached.pub) return;
    sp_tcache_tls = &unattached.pub;
    if (tc.tss_ok) tss_set(tc.tss, NULL);
    tcache_destroy(c);
    if (tc.tidy_orphans) tcache_orphans_tidy(4); /* a thread's exit: 64 orphans at most */
}

/* Whether the calling thread, not attached, now has a cache of its own: not after its exit
 * hook ran, not when attaches must be explicit, not when there is no memory for one. */
static bool attach_implicitly(void) {
    return !tls_exited && tcache_ready() && !tc.explicit_attach &&
           sp_tcache_thread_attach() == SP_OK;
}

/* The cache to use on the calling thread, attaching it if it may; *locked: it is the shared
 * fallback (see attach_implicitly), whose lock is now held. */
static cache *cache_get(bool *locked) {
    *locked = false;
    cache *c = (cache *)sp_tcache_tls;
    if (SP_LIKELY(c != &unattached)) return c;
    if (attach_implicitly()) return (cache *)sp_tcache_tls;
    if (!tcache_ready()) return NULL;
    if (tc.explicit_attach && !tls_exited && !tls_fallback_told) {
        tls_fallback_told = true; /* once per thread: it works, only slower */
        sp_log(SP_LOG_WARN, SP_ERR_INVALID_ARG, "sp_tcache_alloc", NULL,
               "thread %llu is not attached: its allocations share the fallback cache under a "
               "lock; attach it (sp_thread_attach, or sp_tcache_thread_attach without the "
               "runtime) for a cache of its own",
               (unsigned long long)sp_thread_os_id());
    }
    sp_mutex_lock(&tc.fallback_lock);
    *locked = true;
    return &tc.fallback;
}

static void cache_put(bool locked) {
    if (locked) sp_mutex_unlock(&tc.fallback_lock);
}

/* ---- alloc ------------------------------------------------------------------------------ */

/* Count a large block of size bytes (sp_tcache_allocated). */
static void large_count(size_t size) {
    atomic_fetch_add_explicit(&tc.large_allocated, size, memory_order_relaxed);
}

/* A block of size bytes aligned to align (a power of two); NULL when out of memory. */
TRACK_INTERNAL static void *block_alloc(size_t size, size_t align) {
    if (!tcache_ready()) return NULL;
    uint32_t k = SP_TCACHE_CLASSES;
    size_t want = size > align ? size : align;
    if (want <= tc.max_class && align <= 4096) {
        k = tcache_class_of(want);
        if (align > 16) /* the first class whose blocks are all aligned */
            while (k < tc.class_count &&
                   (tcache_class_size(k) % align || class_align(tcache_class_size(k)) % align))
                k++;
        if (k >= tc.class_count) k = SP_TCACHE_CLASSES;
    }
    if (k == SP_TCACHE_CLASSES) {
        void *p = heap_alloc(&tc.large, align, size);
        if (p) large_count(size);
        return p;
    }
    bool locked;
    cache *c = cache_get(&locked);
    if (!c) return NULL;
    void *p = class_alloc(c, k);
    if (p) sp_tcache_add_allocated_(&c->pub, size);
    cache_put(locked);
    return p;
}

TRACK_INTERNAL void *sp_tcache_alloc_generic(size_t size) {
    track_enter();
    void *p = block_alloc(size, 16);
    track_leave();
    return p;
}

void *sp_tcache_calloc(size_t n, size_t size) {
    size_t bytes;
    if (__builtin_mul_overflow(n, size, &bytes)) return NULL;
    void *p = sp_tcache_alloc(bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

void *sp_tcache_aligned_alloc(size_t align, size_t size) {
    if (!sp_is_pow2(align) || align > SP_TCACHE_MAX_ALIGN) {
        sp_misuse(SP_ERR_BAD_ALIGNMENT, "sp_tcache_aligned_alloc", (void *)align,
                  "alignment %zu is not a power of two up to 1 GiB", align);
        return NULL;
    }
    if (align <= 16) return sp_tcache_alloc(size);
    track_enter();
    void *p = block_alloc(size, align);
    track_leave();
    return p;
}

/* ---- free ------------------------------------------------------------------------------- */

/* What is wrong with p as a live block of span s: SP_OK (nothing), SP_ERR_INVALID_POINTER
 * (no span in use there, or not the start of a carved block) or SP_ERR_DOUBLE_FREE. Reports
 * nothing. */
TRACK_INTERNAL static sp_result block_verdict(const span *s, const void *p) {
    uintptr_t a = (uintptr_t)p;
    if (s->magic != span_magic(s) || !sp_tcache_block_start_(&s->pub, a))
        return SP_ERR_INVALID_POINTER;
    uintptr_t tag = ((const sp_tcache_block *)p)->tag;
    track_value_defined(&tag, sizeof tag);
    return tag == (a ^ sp_tcache_g.key) ? SP_ERR_DOUBLE_FREE : SP_OK;
}

/* Report verdict r on p (span s) under `call`, naming the span's owner. */
TRACK_INTERNAL SP_COLD static void block_report(const span *s, const void *p, const char *call,
                                                sp_result r) {
    if (s->magic != span_magic(s)) {
        sp_misuse(r, call, p, "%p lies in the span heap but in no span in use", p);
        return;
    }
    uint64_t tid = __atomic_load_n(&s->owner_tid, __ATOMIC_RELAXED);
    char whose[64];
    if (tid)
        snprintf(whose, sizeof whose, "span of thread %llu", (unsigned long long)tid);
    else if (__atomic_load_n(&s->pub.owner, __ATOMIC_RELAXED) == &tc.fallback.pub)
        snprintf(whose, sizeof whose, "span of the shared fallback cache");
    else
        snprintf(whose, sizeof whose, "orphaned span");
    if (r == SP_ERR_DOUBLE_FREE)
        sp_misuse(r, call, p, "%p is already free (%u-byte block, %s)", p, s->block_size, whose);
    else
        sp_misuse(r, call, p, "%p is not the start of a block (class %u, %u-byte blocks, %s)", p,
                  s->cls, s->block_size, whose);
}

/* Whether p is a live block of s; if not, reported under `call`. */
TRACK_INTERNAL bool tcache_block_check(span *s, const void *p, const char *call) {
    sp_result r = block_verdict(s, p);
    if (SP_LIKELY(r == SP_OK)) return true;
    block_report(s, p, call, r);
    return false;
}

/* Owner-local free of a checked block. */
TRACK_INTERNAL static void block_free_owner(cache *c, span *s, sp_tcache_block *b) {
    track_free(b, s->block_size);
    if (sp_tcache_push_(&s->pub, b, (uintptr_t)b ^ sp_tcache_g.key)) tcache_span_emptied(c, s);
}

/* Any-thread free of a checked block: a push onto the span's inbox. */
TRACK_INTERNAL static void block_free_remote(cache *c, span *s, sp_tcache_block *b) {
    track_free(b, s->block_size);
    b->tag = (uintptr_t)b ^ sp_tcache_g.key;
    uintptr_t old = atomic_load_explicit(&s->inbox, memory_order_relaxed), next;
    do {
        b->next = sp_tcache_list_(old);
        next = (uintptr_t)b | (sp_tcache_count_bits_(old) + SP_TCACHE_COUNT_ONE);
    } while (!atomic_compare_exchange_weak_explicit(&s->inbox, &old, next, memory_order_seq_cst,
                                                    memory_order_relaxed));
    /* Into an orphan: tell sp_tcache_tidy (it may have left the orphan empty). Sequentially
     * consistent with span_detach's store of the owner and check of the inbox: of a push that
     * races with the orphaning, at least one side sees the other. By now the owner may have
     * taken the block back and released the span (the word read is then that of a free span or
     * a cache record, written atomically: at worst one needless orphan walk). */
    if (!__atomic_load_n(&s->pub.owner, __ATOMIC_SEQ_CST))
        atomic_fetch_add_explicit(&tc.orphan_frees, 1, memory_order_release);
    if (c)
        __atomic_store_n(&c->remote_frees, c->remote_frees + 1, __ATOMIC_RELAXED);
    else
        atomic_fetch_add_explicit(&tc.unattached_remote_frees, 1, memory_order_relaxed);
}

/* Where p lives. */
typedef enum where { IN_NONE, IN_SPANS, IN_LARGE } where;

static where tcache_where(const void *p) {
    uintptr_t a = (uintptr_t)p;
    if (a - tc.spans.base < atomic_load_explicit(&tc.spans.committed, memory_order_acquire))
        return IN_SPANS;
    if (a - tc.large.base < atomic_load_explicit(&tc.large.committed, memory_order_acquire))
        return IN_LARGE;
    return IN_NONE;
}

/* Free p (any kind) under `call`; a bad p is reported and nothing changes. */
TRACK_INTERNAL static void block_free(void *p, const char *call) {
    switch (tcache_where(p)) {
    case IN_SPANS: {
        span *s = span_of(p);
        if (!tcache_block_check(s, p, call)) return;
        cache *self = (cache *)sp_tcache_tls;
        if (self == &unattached) {
            if (!attach_implicitly()) {
                /* The thread uses the fallback: its lock only for a span the fallback owns
                 * (checked again under it); any other span takes a lock-free push (a span
                 * the fallback adopts later is collected with its inbox). */
                if (__atomic_load_n(&s->pub.owner, __ATOMIC_RELAXED) == &tc.fallback.pub) {
                    sp_mutex_lock(&tc.fallback_lock);
                    bool own = __atomic_load_n(&s->pub.owner, __ATOMIC_ACQUIRE) == &tc.fallback.pub;
                    if (own) block_free_owner(&tc.fallback, s, p);
                    sp_mutex_unlock(&tc.fallback_lock);
                    if (own) return;
                }
                block_free_remote(NULL, s, p);
                return;
            }
            self = (cache *)sp_tcache_tls; /* counts its remote frees from now on */
        }
        if (__atomic_load_n(&s->pub.owner, __ATOMIC_RELAXED) == &self->pub)
            block_free_owner(self, s, p);
        else
            block_free_remote(self, s, p);
        return;
    }
    case IN_LARGE: heap_free(&tc.large, p, call); return;
    default: /* not ours; and a free must not set the allocator up just to say so */
        if (atomic_load_explicit(&tc.ready, memory_order_acquire))
            sp_misuse(SP_ERR_FOREIGN_POINTER, call, p, "%p was not allocated by the thread caches",
                      p);
        else
            sp_misuse(SP_ERR_FOREIGN_POINTER, call, p, "%p: the thread caches are not initialised",
                      p);
    }
}

/* A public free's out-of-line path: NULL is a no-op, anything else block_free under `call`. */
TRACK_INTERNAL static void free_entry(void *p, const char *call) {
    if (!p) return;
    track_enter();
    block_free(p, call);
    track_leave();
}

TRACK_INTERNAL void sp_tcache_free_generic(void *p) {
    free_entry(p, "sp_tcache_free");
}

TRACK_INTERNAL void sp_tcache_free_local_generic(void *p) {
    free_entry(p, "sp_tcache_free_local");
}

/* Called by the owner when a free made its span empty (inline path or block_free_owner); never
 * for the current span (its bias keeps `used` above zero): that one stays, no ping-pong. */
size_t tcache_span_emptied(cache *c, span *s) {
    SP_INVARIANT((span *)c->pub.cur[s->cls] != s, "tcache_span_emptied", s);
    sp_mutex_lock(&c->lock);
    tcache_ring_remove(c, s);
    bool keep = c->empty_count < tc.keep_empty;
    if (keep) {
        s->next = c->empty;
        c->empty = s;
        c->empty_count++;
    }
    sp_mutex_unlock(&c->lock);
    if (keep) return 0;
    span_release(s);
    return SP_TCACHE_SPAN;
}

void sp_tcache_span_emptied(sp_tcache_span *s) {
    tcache_span_emptied((cache *)__atomic_load_n(&s->owner, __ATOMIC_RELAXED), (span *)s);
}

/* ---- queries, realloc -------------------------------------------------------------------- */

/* Usable size of p under `call`: 0 (reported) if p is not a live block. */
TRACK_INTERNAL static size_t block_usable(const void *p, const char *call) {
    switch (tcache_where(p)) {
    case IN_SPANS: {
        span *s = span_of(p);
        return tcache_block_check(s, p, call) ? s->block_size : 0;
    }
    case IN_LARGE: return heap_usable(&tc.large, p, call);
    default:
        sp_misuse(SP_ERR_FOREIGN_POINTER, call, p, "%p was not allocated by the thread caches", p);
        return 0;
    }
}

TRACK_INTERNAL size_t sp_tcache_usable_size(const void *p) {
    if (!p) return 0;
    track_enter();
    size_t n = block_usable(p, "sp_tcache_usable_size");
    track_leave();
    return n;
}

void sp_tcache_free_sized(void *p, size_t size) {
    if (!p) return;
    track_enter();
    size_t usable = block_usable(p, "sp_tcache_free_sized");
    track_leave();
    if (usable == 0) return; /* reported */
    if (size > usable) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_tcache_free_sized", p,
                  "%p freed with size %zu, but its block holds %zu bytes", p, size, usable);
        return;
    }
    sp_tcache_free(p);
}

TRACK_INTERNAL uint64_t sp_tcache_owner_thread(const void *p) {
    if (!p || tcache_where(p) != IN_SPANS) return 0;
    track_enter();
    span *s = span_of(p);
    uint64_t tid =
        block_verdict(s, p) == SP_OK ? __atomic_load_n(&s->owner_tid, __ATOMIC_RELAXED) : 0;
    track_leave();
    return tid;
}

void *sp_tcache_realloc(void *p, size_t size) {
    if (!p) return sp_tcache_alloc(size);
    if (size == 0) {
        free_entry(p, "sp_tcache_realloc");
        return NULL;
    }
    track_enter();
    size_t usable = block_usable(p, "sp_tcache_realloc");
    bool large = usable && tcache_where(p) == IN_LARGE;
    track_leave();
    if (!usable) return NULL;
    if (!large && size <= usable && size >= usable / 2) return p;
    if (large && size > tc.max_class) {
        void *q = heap_realloc(&tc.large, p, size, "sp_tcache_realloc");
        if (q && (q != p || size > usable)) large_count(size); /* moved, or grew in place */
        if (q) return q;
    }
    void *q = sp_tcache_alloc(size);
    if (!q) return NULL;
    memcpy(q, p, size < usable ? size : usable);
    sp_tcache_free(p);
    return q;
}

/* ---- init, shutdown --------------------------------------------------------------------- */

static uintptr_t key_make(void) {
    uint64_t x =
        sp_ticks() ^ (uint64_t)(uintptr_t)&x ^ ((uint64_t)(uintptr_t)&tc << 17) ^ sp_thread_os_id();
    x += 0x9e3779b97f4a7c15u;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9u;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebu;
    x ^= x >> 31;
    return (uintptr_t)(x | 1); /* never 0: a tag of 0 means "handed out" */
}

/* lazy: initialised by a first call without sp_tcache_init (the malloc drop-in): no frame loop
 * tidies, the caches do (tidy_orphans). */
static sp_result init_locked(const sp_tcache_desc *desc, bool lazy) {
    sp_tcache_desc d = desc ? *desc : (sp_tcache_desc){0};
    if (lazy) d.tidy_orphans = true;
    if (d.max_class == 0) d.max_class = 32 * 1024;
    if (d.max_class > SP_TCACHE_MAX_CLASS_LIMIT)
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_tcache_init", NULL, "max_class %zu is above %zu",
                         d.max_class, SP_TCACHE_MAX_CLASS_LIMIT);
    if (d.keep_empty == 0) d.keep_empty = 2;
    if (d.keep_detached == 0) d.keep_detached = 8;
    if (d.region && d.region_size < SP_TCACHE_MIN_REGION)
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_tcache_init", d.region,
                         "region of %zu bytes is below 64 MiB", d.region_size);
    if (!d.region && d.region_size == 0) {
        /* Under an address-space limit, start from the budget it leaves. */
        size_t budget = sp_address_budget();
        d.region_size = (size_t)64 << 30;
        while (d.region_size > ((size_t)1 << 30) && d.region_size > budget) d.region_size /= 2;
    }
    if (d.region_size < SP_TCACHE_MIN_REGION) d.region_size = SP_TCACHE_MIN_REGION;
    d.region_size &= ~(SP_TCACHE_SPAN * 2 - 1);
    void *region = d.region;
    if (!region) {
        /* Address space can be limited (ulimit -v, Valgrind): halve down to 1 GiB. The
         * refusals are logged by the platform layer at warn level. */
        region = sp_vm_reserve(d.region_size, SP_TCACHE_SPAN, false, NULL);
        while (!region && d.region_size > ((size_t)1 << 30)) {
            d.region_size /= 2;
            region = sp_vm_reserve(d.region_size, SP_TCACHE_SPAN, false, NULL);
        }
        if (!region) return SP_ERR_OS;
    } else if ((uintptr_t)region & (SP_TCACHE_SPAN - 1)) {
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_tcache_init", region,
                         "region %p is not aligned to %zu bytes", region, SP_TCACHE_SPAN);
    }
    if ((uintptr_t)region + d.region_size < (uintptr_t)region ||
        ((uintptr_t)region + d.region_size) >> SP_TCACHE_LIST_BITS) {
        if (!d.region) sp_vm_release(region, d.region_size);
        return sp_misuse(SP_ERR_INVALID_ARG, "sp_tcache_init", region,
                         "region %p + %zu wraps or ends above 2^%d (list words count in the "
                         "bits above)",
                         region, d.region_size, (int)SP_TCACHE_LIST_BITS);
    }
    tc.region = region;
    tc.region_size = d.region_size;
    tc.own_region = !d.region;
    tc.keep_empty = d.keep_empty;
    tc.keep_detached = d.keep_detached;
    tc.tidy_orphans = d.tidy_orphans;
    tc.explicit_attach = d.explicit_attach;
    tc.attach_closed = false;
    sp_tcache_g.key = key_make();
    classes_init((uint32_t)d.max_class);
    size_t half = d.region_size / 2;
    heap_open(&tc.spans, "tcache spans", (char *)region, half);
    heap_open(&tc.large, "tcache large", (char *)region + half, half);
    sp_tcache_g.span_base = tc.spans.base;
    tcache_cache_init(&tc.fallback, 0);
    tc.tss_ok = tss_create(&tc.tss, thread_exit) == thrd_success;
    atomic_store_explicit(&tc.ready, true, memory_order_release);
    return SP_OK;
}

sp_result sp_tcache_init(const sp_tcache_desc *desc) {
    sp_mutex_lock(&tc.init_lock);
    sp_result r;
    if (atomic_load_explicit(&tc.ready, memory_order_relaxed))
        r = sp_misuse(SP_ERR_INVALID_ARG, "sp_tcache_init", NULL, "already initialised");
    else
        r = init_locked(desc, false);
    sp_mutex_unlock(&tc.init_lock);
    return r;
}

/* Initialise with defaults on first use. */
SP_COLD bool tcache_init_default(void) {
    sp_mutex_lock(&tc.init_lock);
    bool ok =
        atomic_load_explicit(&tc.ready, memory_order_relaxed) || init_locked(NULL, true) == SP_OK;
    sp_mutex_unlock(&tc.init_lock);
    return ok;
}

size_t sp_tcache_shutdown(void) {
    if (!atomic_load_explicit(&tc.ready, memory_order_acquire)) return 0;
    sp_tcache_thread_detach();
    sp_tcache_trim();
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    if (st.caches) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_tcache_shutdown", NULL,
                  "%zu other threads are still attached: not shut down", st.caches);
        return SIZE_MAX;
    }
    size_t live = st.live_blocks;
    atomic_store_explicit(&tc.ready, false, memory_order_release);
    if (tc.tss_ok) tss_delete(tc.tss);
    heap_close(&tc.spans);
    heap_close(&tc.large);
    if (tc.own_region)
        sp_vm_release(tc.region, tc.region_size);
    else
        sp_vm_decommit(tc.region, tc.region_size);
    memset(&tc, 0, sizeof tc);
    memset(&sp_tcache_g, 0, sizeof sp_tcache_g);
    tls_exited = false;
    return live;
}

/* ---- fork ------------------------------------------------------------------------------- */

void sp_tcache_fork_prepare(void) {
    sp_mutex_lock(&tc.init_lock);
    sp_mutex_lock(&tc.reg_lock);
    sp_mutex_lock(&tc.count_lock);
    sp_mutex_lock(&tc.fallback_lock);
    sp_mutex_lock(&tc.orphan_lock);
    heap_lock_all(true);
    /* Every cache's list lock too (after reg_lock, as status takes them; nothing holding one
     * takes another lock): a cache's ring half-changed by another thread at the fork would be
     * the child's for good, and a walk of it (status) could loop forever. */
    for (cache *c = tc.registry; c; c = c->reg_next) sp_mutex_lock(&c->lock);
}

void sp_tcache_fork_parent(void) {
    for (cache *c = tc.registry; c; c = c->reg_next) sp_mutex_unlock(&c->lock);
    heap_lock_all(false);
    sp_mutex_unlock(&tc.orphan_lock);
    sp_mutex_unlock(&tc.fallback_lock);
    sp_mutex_unlock(&tc.count_lock);
    sp_mutex_unlock(&tc.reg_lock);
    sp_mutex_unlock(&tc.init_lock);
}

void sp_tcache_fork_child(void) {
    /* Only this thread exists now: the locks this thread took are simply reset. Caches of the
     * other threads stay registered; their spans are never reused (their blocks still free
     * correctly, into inboxes nobody collects). */
    memset(&tc.init_lock, 0, sizeof tc.init_lock);
    memset(&tc.reg_lock, 0, sizeof tc.reg_lock);
    memset(&tc.count_lock, 0, sizeof tc.count_lock);
    memset(&tc.fallback_lock, 0, sizeof tc.fallback_lock);
    memset(&tc.orphan_lock, 0, sizeof tc.orphan_lock);
    memset(&tc.spans.lock, 0, sizeof tc.spans.lock);
    memset(&tc.large.lock, 0, sizeof tc.large.lock);
    for (cache *c = tc.registry; c; c = c->reg_next) memset(&c->lock, 0, sizeof c->lock);
}
