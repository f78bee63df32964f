/* User bugs in TLSF memory are caught by the tools users already run (track.h):
 *   ASan builds:      each bug kills a forked child with AddressSanitizer's report;
 *   -Dvalgrind=true:  each bug runs in a child re-executed under valgrind, which must report
 *                     it (the allocator's client requests told memcheck the block states).
 * Other builds skip the test. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sp_tlsf.h"
#include "test_support.h"
#include "track.h"

static sp_tlsf *heap;

static const char *self;

static volatile char sink;

static void use_after_free(void) {
    char *p = sp_tlsf_malloc(heap, 100);
    sp_tlsf_free(heap, p);
    sink = p[10];
}

static void overflow_into_header(void) {
    char *p = sp_tlsf_malloc(heap, 64);
    char *q = sp_tlsf_malloc(heap, 64);
    (void)q;
    p[64] = 1; /* the first byte after p's 64 usable bytes is the next block's header */
}

static void read_free_block(void) {
    char *p = sp_tlsf_malloc(heap, 4096);
    char *guard = sp_tlsf_malloc(heap, 16);
    (void)guard;
    sp_tlsf_free(heap, p);
    sink = p[2000];
}

static const ts_bug bugs[] = {
    {"use_after_free", use_after_free, "use-after-poison", "Invalid read"},
    {"overflow_into_header", overflow_into_header, "use-after-poison", "Invalid write"},
    {"read_free_block", read_free_block, "use-after-poison", "Invalid read"},
};

static void heap_make(void) {
    static _Alignas(64) char mem[1 << 20];
    sp_tlsf_desc d = {.memory = mem, .size = sizeof mem, .name = "track"};
    heap = sp_tlsf_create(&d, NULL);
}

int main(int argc, char **argv) {
    self = argv[0];
    heap_make();
    if (ts_bug_child(argc, argv, bugs, sizeof bugs / sizeof bugs[0])) return 0; /* valgrind */
    if (!ts_tool_watching()) skip_all("built without ASan or -Dvalgrind=true (and valgrind)");
    ts_bugs_reported(self, bugs, sizeof bugs / sizeof bugs[0]);
    char *p = sp_tlsf_malloc(heap, 100);
    memset(p, 1, 100);
    ok(sp_tlsf_usable_size(heap, p) == 112, "a live block is fully usable");
    memset(p, 2, 112);
    sp_tlsf_free(heap, p);
    sp_tlsf_destroy(heap);
    return done();
}
