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

static const struct {
    const char *name;
    void (*run)(void);
    bool write;
} bugs[] = {{"use_after_free", use_after_free, false},
            {"overflow", overflow, true},
            {"read_never_allocated", read_never_allocated, false},
            {"remote_use_after_free", remote_use_after_free, false}};

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--bug") == 0) { /* the child under valgrind */
        for (size_t i = 0; i < sizeof bugs / sizeof bugs[0]; i++)
            if (strcmp(argv[2], bugs[i].name) == 0) bugs[i].run();
        return 0;
    }
    if (!TRACK_ASAN && !TRACK_VALGRIND) skip_all("built without ASan or -Dvalgrind=true");
    if (TRACK_VALGRIND && system("valgrind --version >/dev/null 2>&1") != 0)
        skip_all("valgrind is not installed");
    plan(5);
    for (size_t i = 0; i < sizeof bugs / sizeof bugs[0]; i++) {
        const char *kind = TRACK_ASAN      ? "use-after-poison"
                           : bugs[i].write ? "Invalid write"
                                           : "Invalid read";
        ok(ts_tool_reports(argv[0], bugs[i].run, bugs[i].name, kind), "%s is reported",
           bugs[i].name);
    }
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
