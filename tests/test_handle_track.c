/* A pointer kept across compaction is caught by the memory tools at its first use (alloc/track.h):
 *   ASan builds:      each bug kills a forked child with AddressSanitizer's report;
 *   -Dvalgrind=true:  each bug runs in a child re-executed under valgrind, which must report it.
 * Other builds skip the test. */
#include <string.h>

#include "sp_handle.h"
#include "test_support.h"
#include "track.h"

static sp_handle_heap *heap;
static const char *self;
static volatile char sink;

/* b moves into the hole a left (the hole is larger than b, so none of b's old bytes is
 * covered by a live block afterwards); the pointer taken before compaction is stale. */
static void kept_across_compaction(void) {
    sp_handle a = sp_handle_alloc(heap, 4096, 0);
    sp_handle b = sp_handle_alloc(heap, 512, 0);
    char *old = sp_handle_resolve(heap, b);
    memset(old, 1, 512);
    sp_handle_free(heap, a);
    sp_handle_compact(heap, 0, NULL);
    sink = old[100];
}

/* Same, but the block slid down by less than its size within a run and a third block sits
 * where the end of the old range was: the part of the old range past the new end is poisoned. */
static void kept_across_fill(void) {
    sp_handle big = sp_handle_alloc(heap, 8192, 0);
    sp_handle keep = sp_handle_alloc(heap, 64, 0);
    sp_handle last = sp_handle_alloc(heap, 1024, 0);
    char *old = sp_handle_resolve(heap, last);
    sp_handle_free(heap, big);
    sp_handle_compact(heap, 0, NULL); /* last (1 KiB, at the top) moves into big's hole */
    (void)keep;
    sink = old[0];
}

static void use_after_free(void) {
    sp_handle a = sp_handle_alloc(heap, 100, 0);
    sp_handle guard = sp_handle_alloc(heap, 100, 0);
    (void)guard;
    char *p = sp_handle_resolve(heap, a);
    sp_handle_free(heap, a);
    sink = p[10];
}

static void overflow_into_header(void) {
    sp_handle a = sp_handle_alloc(heap, 64, 0);
    sp_handle b = sp_handle_alloc(heap, 64, 0);
    (void)b;
    char *p = sp_handle_resolve(heap, a);
    p[64] = 1; /* the next block's header */
}

static const ts_bug bugs[] = {
    {"kept_across_compaction", kept_across_compaction, "use-after-poison", "Invalid read"},
    {"kept_across_fill", kept_across_fill, "use-after-poison", "Invalid read"},
    {"use_after_free", use_after_free, "use-after-poison", "Invalid read"},
    {"overflow_into_header", overflow_into_header, "use-after-poison", "Invalid write"},
};

int main(int argc, char **argv) {
    self = argv[0];
    heap = sp_handle_heap_create(NULL, NULL);
    if (ts_bug_child(argc, argv, bugs, sizeof bugs / sizeof bugs[0])) return 0; /* under valgrind */
    if (!ts_tool_watching()) skip_all("built without ASan or -Dvalgrind=true (and valgrind)");
    plan(6);
    ts_bugs_reported(self, bugs, sizeof bugs / sizeof bugs[0]);
    /* the same moves without the bug run clean, and the moved data is intact */
    sp_handle a = sp_handle_alloc(heap, 4096, 0);
    sp_handle b = sp_handle_alloc(heap, 512, 0);
    memset(sp_handle_resolve(heap, b), 7, 512);
    sp_handle_free(heap, a);
    sp_handle_compact(heap, 0, NULL);
    ok(ts_filled(sp_handle_resolve(heap, b), 512, 7), "a moved block is readable at its new place");
    sp_handle_free(heap, b);
    sp_handle_heap_status st;
    sp_handle_heap_status_get(heap, &st);
    ok(st.live_handles == 0 && sp_handle_heap_check(heap) == SP_OK, "heap empty and sound");
    sp_handle_heap_destroy(heap);
    return done();
}
