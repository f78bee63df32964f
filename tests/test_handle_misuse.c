/* Handle heap misuse: each SP_ERR_* is reported through the logger naming the call, and the
 * heap is unchanged (release behaviour, ts_log_capture); with the build's default policy
 * (debug builds: fatal) the same misuse kills the process with a message naming the call and
 * the handle (ts_dies). White box where the real thing takes too long: the pin limit sets a
 * block's pin count through handle_internal.h (as fuzz_tcache.c reads tcache_internal.h). */
#include <stdio.h>
#include <string.h>

#include "handle_internal.h"
#include "sp_handle.h"
#include "test_support.h"

static sp_handle_heap *heap;

static bool reported(sp_result id, const char *call) {
    bool r =
        ts_logged.count == 1 && ts_logged.last_id == id && strcmp(ts_logged.last_call, call) == 0;
    if (!r)
        diag("  logged %d, last %s from %s", ts_logged.count, sp_result_name(ts_logged.last_id),
             ts_logged.last_call);
    ts_log_reset();
    return r;
}

/* Set the pin count of x's block (its header is the allocator's: not instrumented). */
TRACK_INTERNAL static void pins_set(sp_handle x, uint32_t n) {
    track_enter();
    blk_of(sp_handle_resolve(heap, x))->pins = n;
    track_leave();
}

/* File hole hb on the list of the 2-unit class, its counters kept, and return its size (back:
 * file it from there to where it belongs, `real` the size returned): a hole on the wrong class
 * list, which space_hole_find would hand out too small. */
TRACK_INTERNAL static uint32_t misfile(hblk *hb, uint32_t real, bool back) {
    track_enter();
    if (!back) real = hb->size;
    hb->size = back ? 2 : real;
    space_hole_remove(heap, hb);
    hb->size = back ? real : 2;
    space_hole_insert(heap, hb);
    hb->size = real;
    /* remove and insert counted the size they saw: put the difference right */
    if (back)
        heap->hole_bytes -= units_bytes(real) - units_bytes(2);
    else
        heap->hole_bytes += units_bytes(real) - units_bytes(2);
    track_leave();
    return real;
}

/* sp_handle_heap_check says it validates that each hole is on the list of its class; it did
 * not look. */
static void test_check_misfiled(void) {
    sp_handle a = sp_handle_alloc(heap, 100, 0), b = sp_handle_alloc(heap, 5000, 0),
              c = sp_handle_alloc(heap, 100, 0);
    hblk *hb = blk_of(sp_handle_resolve(heap, b));
    sp_handle_free(heap, b);
    uint32_t real = misfile(hb, 0, false);
    ts_log_capture();
    sp_result bad = sp_handle_heap_check(heap);
    ts_log_release();
    misfile(hb, real, true);
    ok(bad == SP_ERR_CORRUPT && sp_handle_heap_check(heap) == SP_OK,
       "heap check: a hole on the wrong class list is corruption (%s); filed back, sound",
       sp_result_name(bad));
    sp_handle_free(heap, a);
    sp_handle_free(heap, c);
}

static bool same(const sp_handle_heap_status *a) {
    sp_handle_heap_status b;
    sp_handle_heap_status_get(heap, &b);
    return a->live_bytes == b.live_bytes && a->live_handles == b.live_handles &&
           a->used_bytes == b.used_bytes && a->hole_bytes == b.hole_bytes &&
           sp_handle_heap_check(heap) == SP_OK;
}

static bool allow;
static bool may_compact(void *user) {
    (void)user;
    return allow;
}

/* A relocation callback that tries what is not allowed from inside compaction. */
static sp_result from_cb_compact, from_cb_free, from_cb_check;
static sp_handle from_cb_alloc = {1}, victim;
static int cb_calls;
static void bad_callback(void *user, sp_handle h, void *new_ptr, void *old_ptr) {
    (void)user, (void)h, (void)new_ptr, (void)old_ptr;
    if (cb_calls++) return;
    from_cb_compact = sp_handle_compact(heap, 0, NULL);
    from_cb_free = sp_handle_free(heap, victim);
    from_cb_alloc = sp_handle_alloc(heap, 10, 0);
    from_cb_check = sp_handle_heap_check(heap);
    sp_handle_heap_destroy(heap); /* refused: compaction goes on */
}

static void test_reported(void) {
    ts_log_capture();
    sp_handle_heap_status st;
    sp_handle a = sp_handle_alloc(heap, 100, 0), b = sp_handle_alloc(heap, 200, 0);
    sp_handle gone = sp_handle_alloc(heap, 50, 0);
    sp_handle c = sp_handle_alloc_ex(heap, 64, 0, bad_callback, NULL); /* at the top */
    sp_handle_free(heap, gone);
    sp_handle_heap_status_get(heap, &st);

    ok(sp_handle_free(heap, gone) == SP_ERR_DOUBLE_FREE &&
           reported(SP_ERR_DOUBLE_FREE, "sp_handle_free") && same(&st),
       "double free: SP_ERR_DOUBLE_FREE, nothing changes");
    ok(sp_handle_free(heap, (sp_handle){gone.id + (1u << 20)}) == SP_ERR_STALE_HANDLE &&
           reported(SP_ERR_STALE_HANDLE, "sp_handle_free") && same(&st),
       "free of a forged handle: SP_ERR_STALE_HANDLE");
    sp_handle reused = sp_handle_alloc(heap, 50, 0); /* takes gone's slot (FIFO) */
    sp_handle_heap_status_get(heap, &st);
    ok((reused.id & 0xfffff) == (gone.id & 0xfffff) &&
           sp_handle_free(heap, gone) == SP_ERR_DOUBLE_FREE &&
           reported(SP_ERR_DOUBLE_FREE, "sp_handle_free") && same(&st) &&
           sp_handle_resolve(heap, reused),
       "double free after the slot was reused: refused, the new block lives on");
    ok(sp_handle_resolve(heap, gone) == NULL && sp_handle_pin(heap, gone) == NULL &&
           sp_handle_size(heap, gone) == 0 && ts_logged.count == 0,
       "resolve/pin/size of a stale handle: NULL/NULL/0, not logged");

    void *p = sp_handle_pin(heap, a);
    ok(sp_handle_free(heap, a) == SP_ERR_PINNED && reported(SP_ERR_PINNED, "sp_handle_free") &&
           same(&st) && sp_handle_resolve(heap, a) == p,
       "free of a pinned block: SP_ERR_PINNED, block stays live");
    ok(sp_handle_unpin(heap, a) == SP_OK && sp_handle_unpin(heap, a) == SP_ERR_NOT_PINNED &&
           reported(SP_ERR_NOT_PINNED, "sp_handle_unpin"),
       "unpin without pin: SP_ERR_NOT_PINNED");
    ok(sp_handle_unpin(heap, gone) == SP_ERR_STALE_HANDLE &&
           reported(SP_ERR_STALE_HANDLE, "sp_handle_unpin"),
       "unpin of a stale handle: SP_ERR_STALE_HANDLE");
    ok(sp_handle_alloc(heap, 10, 24).id == 0 && reported(SP_ERR_BAD_ALIGNMENT, "sp_handle_alloc") &&
           same(&st),
       "alignment not a power of two: {0}, SP_ERR_BAD_ALIGNMENT");

    /* compaction refused while may_compact says no: nothing moves */
    sp_handle_free(heap, a);
    sp_handle_heap_status_get(heap, &st);
    allow = false;
    ok(sp_handle_compact(heap, 0, NULL) == SP_ERR_BUSY &&
           reported(SP_ERR_BUSY, "sp_handle_compact") && same(&st) && st.hole_bytes > 0,
       "compact while may_compact says no: SP_ERR_BUSY, the hole stays");
    allow = true;

    /* from inside a relocation callback */
    victim = b;
    sp_handle_free(heap, reused); /* a hole below c: c moves */
    ok(sp_handle_compact(heap, 0, NULL) == SP_OK && cb_calls >= 1, "compact calls the callback");
    ok(from_cb_compact == SP_ERR_BUSY && from_cb_free == SP_ERR_BUSY && from_cb_alloc.id == 0 &&
           from_cb_check == SP_ERR_BUSY && ts_logged.count == 5 &&
           ts_logged.last_id == SP_ERR_BUSY &&
           strcmp(ts_logged.last_call, "sp_handle_heap_destroy") == 0,
       "compact, free, alloc, check and destroy from a relocation callback: SP_ERR_BUSY each");
    ts_log_reset();
    ok(sp_handle_resolve(heap, b) != NULL && sp_handle_heap_check(heap) == SP_OK,
       "the block the callback tried to free is live");

    sp_result err = SP_OK;
    ok(sp_handle_heap_create(&(sp_handle_heap_desc){.max_handles = (1u << 24) + 1}, &err) == NULL &&
           err == SP_ERR_INVALID_ARG && reported(SP_ERR_INVALID_ARG, "sp_handle_heap_create"),
       "create with too many handles: NULL, SP_ERR_INVALID_ARG");
    sp_handle_heap_status_get(heap, &st);
    sp_handle_heap_status_get(heap, NULL);
    ok(reported(SP_ERR_INVALID_ARG, "sp_handle_heap_status_get") && same(&st),
       "status into NULL: SP_ERR_INVALID_ARG, nothing written");
    sp_handle_free(heap, b);
    sp_handle_free(heap, c);
    ts_log_release();
}

/* A NULL heap (sp_handles() before sp_init): no call crashes. The queries answer as for a
 * stale handle, unlogged; the calls that report misuse report SP_ERR_INVALID_ARG. */
static void test_null_heap(void) {
    ts_log_capture();
    sp_handle x = sp_handle_alloc(heap, 10, 0);
    sp_handle_heap_status st;
    memset(&st, 0xff, sizeof st);
    sp_handle_heap_status_get(NULL, &st);
    ok(sp_handle_resolve(NULL, x) == NULL && sp_handle_pin(NULL, x) == NULL &&
           sp_handle_size(NULL, x) == 0 && st.live_handles == 0 && st.used_bytes == 0 &&
           st.table_capacity == 0 && !st.caught_up && ts_logged.count == 0,
       "NULL heap: resolve, pin, size NULL/NULL/0, status zeros, not logged");
    sp_handle_heap_destroy(NULL);
    ok(sp_handle_free(NULL, (sp_handle){0}) == SP_OK && ts_logged.count == 0,
       "NULL heap: destroy ignored, free of {0} a no-op");
    ok(sp_handle_alloc(NULL, 10, 0).id == 0 && reported(SP_ERR_INVALID_ARG, "sp_handle_alloc") &&
           sp_handle_alloc_ex(NULL, 10, 0, bad_callback, NULL).id == 0 &&
           reported(SP_ERR_INVALID_ARG, "sp_handle_alloc_ex"),
       "NULL heap: alloc, alloc_ex {0}, SP_ERR_INVALID_ARG");
    ok(sp_handle_free(NULL, x) == SP_ERR_INVALID_ARG &&
           reported(SP_ERR_INVALID_ARG, "sp_handle_free") &&
           sp_handle_unpin(NULL, x) == SP_ERR_INVALID_ARG &&
           reported(SP_ERR_INVALID_ARG, "sp_handle_unpin"),
       "NULL heap: free, unpin SP_ERR_INVALID_ARG");
    sp_handle_compact_stats cs;
    memset(&cs, 0xff, sizeof cs);
    ok(sp_handle_compact(NULL, 0, &cs) == SP_ERR_INVALID_ARG &&
           reported(SP_ERR_INVALID_ARG, "sp_handle_compact") && cs.bytes_moved == 0 &&
           sp_handle_heap_check(NULL) == SP_ERR_INVALID_ARG &&
           reported(SP_ERR_INVALID_ARG, "sp_handle_heap_check"),
       "NULL heap: compact (stats zeroed), check SP_ERR_INVALID_ARG");
    ok(sp_handle_resolve(heap, x) != NULL && sp_handle_free(heap, x) == SP_OK &&
           ts_logged.count == 0,
       "the handle of the real heap is untouched");
    ts_log_release();
}

/* The pin count is 32 bits: a pin at UINT32_MAX is refused (it would wrap to 0 and let a
 * free through). The count is set next to the limit: 2^32 pins take too long. */
static void test_pin_limit(void) {
    ts_log_capture();
    sp_handle x = sp_handle_alloc(heap, 100, 0);
    void *p = sp_handle_resolve(heap, x);
    pins_set(x, UINT32_MAX - 1);
    ok(sp_handle_pin(heap, x) == p && ts_logged.count == 0, "the pin up to UINT32_MAX is taken");
    char id[16];
    snprintf(id, sizeof id, "0x%x", x.id);
    ok(sp_handle_pin(heap, x) == NULL && strstr(ts_logged.last_message, id) &&
           reported(SP_ERR_LIMIT, "sp_handle_pin"),
       "the pin past UINT32_MAX: NULL, SP_ERR_LIMIT naming the handle");
    ok(sp_handle_free(heap, x) == SP_ERR_PINNED && reported(SP_ERR_PINNED, "sp_handle_free") &&
           sp_handle_resolve(heap, x) == p,
       "the count did not wrap: free still SP_ERR_PINNED");
    ok(sp_handle_unpin(heap, x) == SP_OK && sp_handle_pin(heap, x) == p && ts_logged.count == 0,
       "after an unpin, a pin is taken again");
    pins_set(x, 1);
    ok(sp_handle_unpin(heap, x) == SP_OK && sp_handle_free(heap, x) == SP_OK &&
           ts_logged.count == 0 && sp_handle_heap_check(heap) == SP_OK,
       "unpinned, the block frees");
    ts_log_release();
}

/* Running out of handles is a resource failure: {0}, logged at warn, not fatal. */
static void test_limit(void) {
    ts_log_capture();
    sp_handle_heap *hp = sp_handle_heap_create(&(sp_handle_heap_desc){.max_handles = 64}, NULL);
    int got = 0;
    for (int i = 0; i < 64; i++) got += sp_handle_alloc(hp, 8, 0).id != 0;
    ok(got == 64 && sp_handle_alloc(hp, 8, 0).id == 0 && reported(SP_ERR_LIMIT, "sp_handle_alloc"),
       "the 65th handle of 64: {0}, SP_ERR_LIMIT");
    sp_handle_heap_destroy(hp);
    ts_log_release();
}

typedef struct death {
    int what;
    sp_handle x;
} death;

static void run_death(void *arg) {
    death *d = arg;
    switch (d->what) {
    case 0: sp_handle_free(heap, d->x); break;
    case 1: sp_handle_unpin(heap, d->x); break;
    case 2: sp_handle_free(heap, d->x); break;
    case 3:
        allow = false;
        sp_handle_compact(heap, 0, NULL);
        break;
    case 4:
        pins_set(d->x, UINT32_MAX);
        sp_handle_pin(heap, d->x);
        break;
    }
}

static void test_fatal(void) {
    sp_handle live = sp_handle_alloc(heap, 100, 0);
    sp_handle gone = sp_handle_alloc(heap, 100, 0);
    sp_handle_free(heap, gone);
    sp_handle pinned = sp_handle_alloc(heap, 100, 0);
    sp_handle_pin(heap, pinned);
    struct {
        death d;
        const char *call, *what;
        sp_result id;
    } cases[] = {
        {{0, gone}, "sp_handle_free", "double free", SP_ERR_DOUBLE_FREE},
        {{1, live}, "sp_handle_unpin", "unpin without pin", SP_ERR_NOT_PINNED},
        {{2, pinned}, "sp_handle_free", "free of a pinned block", SP_ERR_PINNED},
        {{3, live}, "sp_handle_compact", "compaction refused", SP_ERR_BUSY},
        {{4, pinned}, "sp_handle_pin", "a pin past UINT32_MAX", SP_ERR_LIMIT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *err = sp_result_name(cases[i].id);
#if SP_DEBUG >= 1
        bool died = ts_dies(run_death, &cases[i].d, cases[i].call, err);
        ok(died, "debug build: %s dies naming %s and %s", cases[i].what, cases[i].call, err);
#else
        /* The default policy of release builds: in this process, reported and survived. */
        bool release_policy = !sp_misuse_fatal(); /* before the capture, which sets it */
        ts_log_capture();
        run_death(&cases[i].d);
        allow = true;
        bool logged = ts_logged.count == 1 && strcmp(ts_logged.last_call, cases[i].call) == 0 &&
                      ts_logged.last_id == cases[i].id;
        ts_log_release();
        ok(release_policy && logged,
           "release build (misuse not fatal by default): %s reports %s and returns (%s)",
           cases[i].what, err, cases[i].call);
#endif
    }
    pins_set(pinned, 1); /* release builds: case 4 left it at UINT32_MAX */
    sp_handle_unpin(heap, pinned);
    sp_handle_free(heap, pinned);
    sp_handle_free(heap, live);
}

int main(void) {
    plan(33);
    heap = sp_handle_heap_create(&(sp_handle_heap_desc){.may_compact = may_compact}, NULL);
    allow = true;
    test_reported();
    test_null_heap();
    test_pin_limit();
    test_limit();
    test_fatal();
    test_check_misfiled();
    sp_handle_heap_status st;
    sp_handle_heap_status_get(heap, &st);
    ok(st.live_handles == 0 && sp_handle_heap_check(heap) == SP_OK, "nothing left, heap sound");
    sp_handle_heap_destroy(heap);
    return done();
}
