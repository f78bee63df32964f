/* User bugs in thread-cache blocks are caught by the tools users already run (track.h):
 * under ASan each bug kills a forked child with AddressSanitizer's report; with
 * -Dvalgrind=true each runs in a child re-executed under valgrind, which must report it.
 * Other builds skip the test. */
#include <stdlib.h>
#include <string.h>

#include "sp_tcache.h"
#include "test_support.h"
#include "track.h"

static volatile char sink;

static void use_after_free(void) {
    char *p = sp_tcache_alloc(100);
    char *keep = sp_tcache_alloc(100);
    (void)keep;
    sp_tcache_free(p);
    sink = p[10];
}

static void overflow(void) {
    char *p = sp_tcache_alloc(64); /* blocks of a class are carved in address order */
    char *q = sp_tcache_alloc(64);
    sp_tcache_free(q);
    p[64 + 16] = 1; /* past p's 64 usable bytes: into the free block after it */
}

static void read_never_allocated(void) {
    char *p = sp_tcache_alloc(48);
    sink = p[48 * 20];
}

static void remote_use_after_free(void) {
    char *p = sp_tcache_alloc(2000);
    sp_tcache_thread_detach(); /* p's span is orphaned; the free is a remote one */
    sp_tcache_free(p);
    sink = p[5];
}

static const ts_bug bugs[] = {
    {"use_after_free", use_after_free, "use-after-poison", "Invalid read"},
    {"overflow", overflow, "use-after-poison", "Invalid write"},
    {"read_never_allocated", read_never_allocated, "use-after-poison", "Invalid read"},
    {"remote_use_after_free", remote_use_after_free, "use-after-poison", "Invalid read"},
};

int main(int argc, char **argv) {
    if (ts_bug_child(argc, argv, bugs, sizeof bugs / sizeof bugs[0])) return 0; /* under valgrind */
    if (!ts_tool_watching()) skip_all("built without ASan or -Dvalgrind=true (and valgrind)");
    plan(5);
    ts_bugs_reported(argv[0], bugs, sizeof bugs / sizeof bugs[0]);
    char *p = sp_tcache_alloc(100);
    memset(p, 1, sp_tcache_usable_size(p));
    sp_tcache_free(p);
    sp_tcache_thread_detach();
    sp_tcache_trim();
    sp_tcache_status st;
    sp_tcache_status_get(&st);
    ok(st.live_blocks == 0 && st.spans == 0,
       "a live block is usable to its usable size; nothing live at the end");
    return done();
}
