/* User bugs in TLSF memory are caught by AddressSanitizer: a use after free, and an overflow
 * into the next block's header, each kill a forked child with ASan's report. Without ASan
 * the test skips itself (Valgrind builds: -Dvalgrind=true, see track.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sp_tlsf.h"
#include "test_support.h"
#include "track.h"

static sp_tlsf *heap;

/* Run bug() in a child with stderr captured; true if ASan reported `kind`. */
static bool asan_reports(void (*bug)(void), const char *kind) {
    int fds[2];
    if (pipe(fds) != 0) return false;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        bug();
        _exit(0);
    }
    close(fds[1]);
    static char out[1 << 16];
    size_t len = 0;
    ssize_t n;
    while ((n = read(fds[0], out + len, sizeof out - 1 - len)) > 0) len += (size_t)n;
    out[len] = 0;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    bool died = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    return died && strstr(out, "AddressSanitizer") && strstr(out, kind);
}

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
    p[64] = 1; /* the first byte after p's 64 usable bytes is q's header */
}

static void read_free_block(void) {
    char *p = sp_tlsf_malloc(heap, 4096);
    char *guard = sp_tlsf_malloc(heap, 16);
    (void)guard;
    sp_tlsf_free(heap, p);
    sink = p[2000];
}

int main(void) {
    if (!TRACK_ASAN) skip_all("built without AddressSanitizer");
    static _Alignas(64) char mem[1 << 20];
    sp_tlsf_desc d = {.memory = mem, .size = sizeof mem, .name = "track"};
    heap = sp_tlsf_create(&d, NULL);
    ok(asan_reports(use_after_free, "use-after-poison"), "use after free is reported");
    ok(asan_reports(overflow_into_header, "use-after-poison"), "overflow into a header is reported");
    ok(asan_reports(read_free_block, "use-after-poison"), "reading a free block is reported");
    char *p = sp_tlsf_malloc(heap, 100);
    memset(p, 1, 100);
    ok(sp_tlsf_usable_size(heap, p) == 112, "a live block is fully usable");
    memset(p, 2, 112);
    sp_tlsf_free(heap, p);
    sp_tlsf_destroy(heap);
    return done();
}
