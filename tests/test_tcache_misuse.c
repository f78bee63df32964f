/* Bad input to the thread caches. With misuse non-fatal (release behaviour) each bad call is
 * reported with its id, call and address (and the owning thread where known), returns the
 * documented value and changes no status figure; the caches keep working. Then, fatal (debug
 * default), in forked children: the process dies naming the call and the address. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sp_tcache.h"
#include "tcache_heap.h" /* white box: the large heap's lock */
#include "test_support.h"

static bool same(const sp_tcache_status *a, const sp_tcache_status *b) {
    return a->live_blocks == b->live_blocks && a->bytes_used == b->bytes_used &&
           a->spans == b->spans && a->free_blocks == b->free_blocks &&
           a->remote_frees == b->remote_frees &&
           a->span_heap.live_blocks == b->span_heap.live_blocks &&
           a->large_heap.live_blocks == b->large_heap.live_blocks;
}

/* free, realloc, usable_size of p: each reports `want` at p and changes nothing. */
static void refuse_all(void *p, sp_result want, const char *free_call, const char *what) {
    sp_tcache_status before, after;
    sp_tcache_status_get(&before);
    ts_log_reset();
    sp_tcache_free(p);
    sp_tcache_status_get(&after);
    bool freed = ts_logged.count == 1 && ts_logged.last_id == want && ts_logged.last_addr == p &&
                 strcmp(ts_logged.last_call, free_call) == 0;
    ok(freed && same(&before, &after), "free(%s): %s from %s, nothing changed", what,
       sp_result_name(want), free_call);
    if (!freed)
        diag("  logged %d, last %s from %s: %s", ts_logged.count, sp_result_name(ts_logged.last_id),
             ts_logged.last_call, ts_logged.last_message);
    ts_log_reset();
    void *q = sp_tcache_realloc(p, 100);
    sp_tcache_status_get(&after);
    ok(q == NULL && ts_logged.count == 1 && ts_logged.last_id == want && same(&before, &after),
       "realloc(%s): NULL, reported, nothing changed", what);
    ts_log_reset();
    size_t n = sp_tcache_usable_size(p);
    ok(n == 0 && ts_logged.count == 1 && ts_logged.last_id == want, "usable_size(%s): 0, reported",
       what);
}

static void *remote_free(void *p) {
    sp_tcache_free(p);
    return NULL;
}

/* The freeing thread's OS id, for the check that a report names the owner, not the caller. */
static uint64_t remote_double_free_tid;

static void *remote_double_free(void *p) {
    remote_double_free_tid = sp_thread_os_id();
    ts_log_reset();
    sp_tcache_free(p);
    return NULL;
}

static char *live, *freed, *remote_freed;

static void test_reported(void) {
    ts_log_capture();
    live = sp_tcache_alloc(64);
    freed = sp_tcache_alloc(64);
    remote_freed = sp_tcache_alloc(64);
    char *keep = sp_tcache_alloc(64); /* keeps the span in use */
    sp_tcache_free(freed);
    sp_thread t;
    sp_thread_start(&t, remote_free, remote_freed, "sp-remote");
    sp_thread_join(t);
    int on_stack = 0;
    void *glibc = malloc(64);

    refuse_all(freed, SP_ERR_DOUBLE_FREE, "sp_tcache_free", "already freed");
    char me[32];
    snprintf(me, sizeof me, "thread %llu", (unsigned long long)sp_thread_os_id());
    ok(strstr(ts_logged.last_message, me) != NULL, "the report names the owning %s (\"%s\")", me,
       ts_logged.last_message);
    refuse_all(remote_freed, SP_ERR_DOUBLE_FREE, "sp_tcache_free", "freed by another thread");
    sp_thread_start(&t, remote_double_free, remote_freed, "sp-remote");
    sp_thread_join(t);
    ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_DOUBLE_FREE,
       "a second free on another thread is refused too");
    /* The block was allocated here and double-freed there: the report must name this (the
     * owning) thread, not the one that made the bad call. The check above, on one thread,
     * cannot tell the two apart. The ")" that ends the report's "span of thread N" keeps one
     * id from matching as a prefix of the other. */
    char owner[40], them[40];
    snprintf(owner, sizeof owner, "thread %llu)", (unsigned long long)sp_thread_os_id());
    snprintf(them, sizeof them, "thread %llu)", (unsigned long long)remote_double_free_tid);
    ok(remote_double_free_tid != sp_thread_os_id() && strstr(ts_logged.last_message, owner) &&
           !strstr(ts_logged.last_message, them),
       "a double free on another thread names the owning thread %llu, not the freeing thread %llu "
       "(\"%s\")",
       (unsigned long long)sp_thread_os_id(), (unsigned long long)remote_double_free_tid,
       ts_logged.last_message);
    refuse_all(live + 16, SP_ERR_INVALID_POINTER, "sp_tcache_free", "interior +16");
    refuse_all(live + 1, SP_ERR_INVALID_POINTER, "sp_tcache_free", "misaligned +1");
    uintptr_t span0 = (uintptr_t)live & ~(SP_TCACHE_SPAN - 1);
    refuse_all((char *)sp_tcache_span_of_((uintptr_t)live) + 64, SP_ERR_INVALID_POINTER,
               "sp_tcache_free", "span header");
    refuse_all((void *)(span0 + 16), SP_ERR_INVALID_POINTER, "sp_tcache_free", "the span's start");
    /* The first block not carved yet: a block start (of live's 64-byte class) at the bound. */
    const sp_tcache_span *hs = sp_tcache_span_of_((uintptr_t)live);
    uintptr_t uncarved = span0 + (hs->first32 & (SP_TCACHE_SPAN - 1)) + (uintptr_t)hs->carved * 64;
    refuse_all((void *)uncarved, SP_ERR_INVALID_POINTER, "sp_tcache_free",
               "the first block not carved yet");
    refuse_all(&on_stack, SP_ERR_FOREIGN_POINTER, "sp_tcache_free", "stack address");
    refuse_all(glibc, SP_ERR_FOREIGN_POINTER, "sp_tcache_free", "glibc block");

    /* A pointer into a span that went back to the central heap. */
    char *lone = sp_tcache_alloc(20000);
    uintptr_t lone_span = (uintptr_t)lone & ~(SP_TCACHE_SPAN - 1);
    void *others[16];
    int n = 0;
    for (; n < 16; n++) { /* fill that span so the next one becomes current */
        others[n] = sp_tcache_alloc(20000);
        if (((uintptr_t)others[n] & ~(SP_TCACHE_SPAN - 1)) != lone_span) break;
    }
    sp_tcache_free(lone);
    for (int i = 0; i < n; i++) sp_tcache_free(others[i]); /* span empty, not current */
    sp_tcache_trim();
    refuse_all(lone, SP_ERR_INVALID_POINTER, "sp_tcache_free", "block of a returned span");
    if (n < 16) sp_tcache_free(others[n]);

    char *big = sp_tcache_alloc(100000);
    sp_tcache_free(big);
    refuse_all(big, SP_ERR_DOUBLE_FREE, "sp_tcache_free", "large block already freed");

    sp_tcache_status before, after;
    sp_tcache_status_get(&before);
    ts_log_reset();
    ok(sp_tcache_aligned_alloc(3, 10) == NULL && ts_logged.last_id == SP_ERR_BAD_ALIGNMENT,
       "aligned_alloc(3): NULL, SP_ERR_BAD_ALIGNMENT");
    ts_log_reset();
    sp_tcache_free_sized(live, 65);
    sp_tcache_status_get(&after);
    ok(ts_logged.last_id == SP_ERR_INVALID_ARG && same(&before, &after),
       "free_sized with a size beyond the block: SP_ERR_INVALID_ARG, not freed");
    ts_log_reset();
    sp_tcache_free_sized(live + 16, 16);
    sp_tcache_status_get(&after);
    ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_INVALID_POINTER &&
           !strcmp(ts_logged.last_call, "sp_tcache_free_sized") && same(&before, &after),
       "free_sized of an interior pointer: reported under its own name, not freed");
    ts_log_reset();
    ok(sp_tcache_alloc(SIZE_MAX) == NULL && sp_tcache_alloc(SIZE_MAX / 2) == NULL &&
           ts_logged.count == 0,
       "requests that cannot be met: NULL, not misuse");
    /* free_sized below the request: not detectable (the request is not stored), documented:
     * the block is freed, nothing reported. */
    char *sized = sp_tcache_alloc(100);
    sp_tcache_status mid, gone;
    sp_tcache_status_get(&mid);
    ts_log_reset();
    sp_tcache_free_sized(sized, 1);
    sp_tcache_status_get(&gone);
    ok(ts_logged.count == 0 && gone.live_blocks + 1 == mid.live_blocks,
       "free_sized with a size below the request: freed, nothing reported (as documented)");
    /* free_local reports under its own name; debug builds keep its range check. */
    char *twice = sp_tcache_alloc(48);
    sp_tcache_free_local(twice);
    ts_log_reset();
    sp_tcache_free_local(twice);
    bool named = ts_logged.count == 1 && ts_logged.last_id == SP_ERR_DOUBLE_FREE &&
                 !strcmp(ts_logged.last_call, "sp_tcache_free_local");
    ok(named, "free_local of a freed block: SP_ERR_DOUBLE_FREE under sp_tcache_free_local (%s)",
       ts_logged.count ? ts_logged.last_call : "nothing reported");
#if SP_DEBUG >= 1
    static char outside[64] __attribute__((aligned(16)));
    ts_log_reset();
    sp_tcache_free_local(outside);
    ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_FOREIGN_POINTER &&
           !strcmp(ts_logged.last_call, "sp_tcache_free_local"),
       "debug build: free_local of a pointer outside the heaps is refused, not read "
       "(SP_ERR_FOREIGN_POINTER under its own name)");
#else
    skip("free_local of a foreign pointer: undefined in release builds (documented)");
#endif

    uint64_t me_id = sp_thread_os_id();
    ok(sp_tcache_owner_thread(live) == me_id && sp_tcache_owner_thread(live + 16) == 0 &&
           sp_tcache_owner_thread(freed) == 0 && sp_tcache_owner_thread(big) == 0,
       "owner_thread: the caller's id for its live block, 0 for an interior pointer, a freed "
       "block and a large block");

    /* Still intact: the double-freed block is handed out once only. */
    char *a = sp_tcache_alloc(64), *b = sp_tcache_alloc(64), *c = sp_tcache_alloc(64);
    ok(a && b && c && a != b && b != c && a != c && sp_tcache_usable_size(live) == 64,
       "after all that, fresh blocks are distinct and the live block is untouched");
    sp_tcache_free(a);
    sp_tcache_free(b);
    sp_tcache_free(c);
    sp_tcache_free(keep);
    free(glibc);
    ts_log_release();
}

static void do_free(void *p) {
    sp_tcache_free(p);
}

/* Misuse of a large block is reported with the large heap's lock released (a fatal handler
 * may longjmp out of the report: sp_log.h), under the call the user made. */
static int probe_reports, probe_locked;
static char probe_calls[160];

static void lock_probe(void *user, const sp_log_record *rec) {
    (void)user;
    if (rec->id == SP_OK) return;
    if (sp_mutex_trylock(&tc.large.lock))
        sp_mutex_unlock(&tc.large.lock);
    else
        probe_locked++;
    probe_reports++;
    size_t n = strlen(probe_calls);
    snprintf(probe_calls + n, sizeof probe_calls - n, "%s ", rec->call);
}

static void test_large_unlocked(void) {
    char *big = sp_tcache_alloc(100000);
    sp_tcache_free(big);
    sp_log_set(lock_probe, NULL);
    sp_misuse_set_fatal(false);
    sp_tcache_free(big);
    void *q = sp_tcache_realloc(big, 200000);
    size_t n = sp_tcache_usable_size(big);
    sp_tcache_free_sized(big, 1);
    ts_log_release();
    ok(probe_reports == 4 && probe_locked == 0 && q == NULL && n == 0 &&
           !strcmp(probe_calls,
                   "sp_tcache_free sp_tcache_realloc sp_tcache_usable_size sp_tcache_free_sized "),
       "large-block misuse is reported with the heap's lock released, under the user's call "
       "(%d reports, %d under the lock: %s)",
       probe_reports, probe_locked, probe_calls);
}

static void test_fatal(void) {
    static int outside;
    void *cases[] = {freed, live + 16, &outside};
    const char *what[] = {"double free", "interior pointer", "foreign pointer"};
    for (int i = 0; i < 3; i++) {
        char addr[32];
        snprintf(addr, sizeof addr, "%p", cases[i]);
        ok(ts_dies(do_free, cases[i], "sp_tcache_free", addr),
           "fatal misuse (%s) dies naming sp_tcache_free and %s", what[i], addr);
    }
}

/* With the caches down: each desc sp_tcache_init documents as misuse is refused, reported
 * under sp_tcache_init, and leaves them down (a region that wraps round the address space
 * passed the check of its end before, and init took it); a NULL status out is reported. */
static void test_init_refusals(void) {
    const size_t mib = (size_t)1 << 20;
    char *r = sp_vm_reserve(128 * mib, SP_TCACHE_SPAN, false, NULL);
    if (!r) {
        ok(0, "reserve 128 MiB for the init refusals");
        ok(0, "already initialised");
        ok(0, "aligned_alloc refusals");
        ok(0, "status out");
        ok(0, "shutdown");
        return;
    }
    struct {
        sp_tcache_desc d;
        const char *what;
    } bad[] = {
        {{.region = r, .region_size = 32 * mib}, "a region below 64 MiB"},
        {{.region = r + 4096, .region_size = 64 * mib}, "a region not aligned to SP_TCACHE_SPAN"},
        {{.region = r, .region_size = SIZE_MAX}, "a region that wraps round the address space"},
        {{.max_class = (size_t)128 << 10}, "max_class above 64 KiB"},
    };
    ts_log_capture();
    bool all = true;
    for (size_t i = 0; i < SP_ARRAY_LEN(bad); i++) {
        ts_log_reset();
        sp_result res = sp_tcache_init(&bad[i].d);
        bool refused = res == SP_ERR_INVALID_ARG && ts_logged.count == 1 &&
                       !strcmp(ts_logged.last_call, "sp_tcache_init");
        if (!refused)
            diag("  %s: %s, %d reports", bad[i].what, sp_result_name(res), ts_logged.count);
        all &= refused;
    }
    ok(all, "init with a region below 64 MiB, unaligned, wrapping, or max_class above 64 KiB: "
            "SP_ERR_INVALID_ARG, reported under sp_tcache_init");
    sp_tcache_desc good = {.region = r, .region_size = 64 * mib};
    ts_log_reset();
    sp_result first = sp_tcache_init(&good), second = sp_tcache_init(&good);
    ok(first == SP_OK && second == SP_ERR_INVALID_ARG && ts_logged.count == 1,
       "then a good init: SP_OK (the refusals left the caches down); a second one "
       "SP_ERR_INVALID_ARG, reported");
    ts_log_reset();
    void *a0 = sp_tcache_aligned_alloc(0, 16), *a31 = sp_tcache_aligned_alloc((size_t)1 << 31, 16);
    ok(!a0 && !a31 && ts_logged.count == 2 && ts_logged.last_id == SP_ERR_BAD_ALIGNMENT,
       "aligned_alloc with alignment 0 or 2^31 (above 1 GiB): NULL, SP_ERR_BAD_ALIGNMENT");
    ts_log_reset();
    sp_tcache_status_get(NULL);
    sp_tcache_status_local(NULL);
    ok(ts_logged.count == 2 && ts_logged.last_id == SP_ERR_INVALID_ARG,
       "status_get(NULL) and status_local(NULL): reported (%d)", ts_logged.count);
    ts_log_release();
    sp_tcache_thread_detach();
    is_int(sp_tcache_shutdown(), 0, "shutdown after the init refusals: nothing leaked");
    sp_vm_release(r, 128 * mib);
}

int main(void) {
    plan(55);
    test_reported();
    test_large_unlocked();
    test_fatal();
    sp_tcache_free(live);
    sp_tcache_thread_detach();
    is_int(sp_tcache_shutdown(), 0, "nothing leaked");
    test_init_refusals();
    return done();
}
