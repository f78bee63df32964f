/* Bad input to the TLSF heap. First with misuse non-fatal (release behaviour): each bad call
 * is reported with its id, call and address, returns the documented value, and leaves the heap
 * exactly as it was. Then with misuse fatal (debug default), in forked children: the process
 * dies with a message naming the call and the address. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sp_tlsf.h"
#include "test_support.h"
#include "track.h"

static sp_tlsf *heap;

/* Status and check must be identical before and after a refused call. */
static bool unchanged(const sp_tlsf_status *before) {
    sp_tlsf_status now;
    sp_tlsf_status_get(heap, &now);
    return sp_tlsf_check(heap) == SP_OK && now.bytes_used == before->bytes_used &&
           now.bytes_free == before->bytes_free && now.live_blocks == before->live_blocks &&
           now.free_blocks == before->free_blocks;
}

/* check_ptr must give `want` and report nothing; free, realloc and usable_size with p must
 * each report `want` at p; none may change anything. */
static void refuse_all(void *p, sp_result want, const char *what) {
    sp_tlsf_status before;
    sp_tlsf_status_get(heap, &before);
    ts_log_reset();
    const char *why = NULL;
    sp_result verdict = sp_tlsf_check_ptr(heap, p, &why);
    ok(verdict == want && why != NULL && ts_logged.count == 0 && unchanged(&before),
       "check_ptr(%s): %s, nothing reported, heap unchanged", what, sp_result_name(verdict));
    ts_log_reset();
    sp_tlsf_free(heap, p);
    bool freed = ts_logged.count == 1 && ts_logged.last_id == want && ts_logged.last_addr == p &&
                 strcmp(ts_logged.last_call, "sp_tlsf_free") == 0;
    ok(freed && unchanged(&before), "free(%s): %s reported, heap unchanged", what,
       sp_result_name(want));
    if (!freed)
        diag("  logged %d, last %s from %s", ts_logged.count, sp_result_name(ts_logged.last_id),
             ts_logged.last_call);
    ts_log_reset();
    void *q = sp_tlsf_realloc(heap, p, 100);
    ok(q == NULL && ts_logged.last_id == want &&
           strcmp(ts_logged.last_call, "sp_tlsf_realloc") == 0 && unchanged(&before),
       "realloc(%s): NULL, reported, heap unchanged", what);
    ts_log_reset();
    size_t n = sp_tlsf_usable_size(heap, p);
    ok(n == 0 && ts_logged.last_id == want && unchanged(&before), "usable_size(%s): 0, reported",
       what);
}

/* Read allocator metadata the way a forging caller would, without tripping ASan. */
TRACK_INTERNAL static uint64_t peek(const void *addr) {
    track_enter();
    uint64_t v = *(const volatile uint64_t *)addr;
    track_leave();
    return v;
}

/* Write allocator metadata the way a corrupting caller would, without tripping ASan. */
TRACK_INTERNAL static void poke(void *addr, uint64_t v) {
    track_enter();
    *(volatile uint64_t *)addr = v;
    track_leave();
}

/* A live block whose header keeps its tag (right for its address) but says 128 bytes instead
 * of 256: the block that size points to is inside the payload, whose first word (zero) does
 * not link back. Every call must refuse it as SP_ERR_INVALID_POINTER; nothing is freed. */
static void test_neighbour_check(void) {
    char *victim = sp_tlsf_malloc(heap, 256);
    if (!ok(victim != NULL, "a 256-byte block for the neighbour check")) return;
    memset(victim, 0, 256);
    uint64_t real = peek(victim - 8); /* tag | size | flags */
    uint64_t forged = (real & ~(uint64_t)0xFFFFFFFFFFF0) | 128;
    ok((real & 0xFFFFFFFFFFF0) == 256 && forged != real,
       "the header's size word reads 256 (%#llx), forged to 128 with its tag kept",
       (unsigned long long)real);
    sp_tlsf_status before;
    sp_tlsf_status_get(heap, &before);
    poke(victim - 8, forged);
    ts_log_reset();
    const char *why = NULL;
    sp_result verdict = sp_tlsf_check_ptr(heap, victim, &why);
    bool caught = verdict == SP_ERR_INVALID_POINTER;
    ok(caught && ts_logged.count == 0, "check_ptr(right tag, neighbour not linking back): %s (%s)",
       sp_result_name(verdict), why ? why : "no reason");
    /* Freeing a header that passed would corrupt the heap: only when the check caught it. */
    if (caught) {
        sp_tlsf_free(heap, victim);
        ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_INVALID_POINTER &&
               ts_logged.last_addr == victim,
           "free of it: SP_ERR_INVALID_POINTER reported (\"%s\")", ts_logged.last_message);
    } else {
        ok(0, "free of it: not tried, the check let the forged header pass");
    }
    poke(victim - 8, real);
    ok(unchanged(&before), "header restored: heap consistent, nothing was freed");
    sp_tlsf_free(heap, victim);
}

/* A pool laid over the heap's own control structure (memory..memory + control size, just
 * below the first pool, overlapping no pool) is refused and changes nothing. */
static void test_pool_over_control(void) {
    sp_tlsf_status before;
    sp_tlsf_status_get(heap, &before);
    ts_log_reset();
    sp_result r = sp_tlsf_add_pool(heap, heap, sp_tlsf_control_size());
    ok(r == SP_ERR_INVALID_ARG && ts_logged.count == 1 && ts_logged.last_id == SP_ERR_INVALID_ARG &&
           unchanged(&before),
       "add_pool over the heap's control structure: %s, reported, heap unchanged",
       sp_result_name(r));
}

static void *mem;
static char *live, *big, *freed_alone, *freed_merged;

static void setup(void) {
    mem = aligned_alloc(64, 1 << 20);
    sp_tlsf_desc d = {.memory = mem, .size = 1 << 20, .name = "misuse"};
    heap = sp_tlsf_create(&d, NULL);
    live = sp_tlsf_malloc(heap, 64);
    big = sp_tlsf_malloc(heap, 4096);
    char *sep1 = sp_tlsf_malloc(heap, 64);
    freed_alone = sp_tlsf_malloc(heap, 64); /* freed between two live blocks: stays a block */
    char *sep2 = sp_tlsf_malloc(heap, 64);
    char *x = sp_tlsf_malloc(heap, 64), *y = sp_tlsf_malloc(heap, 64); /* neighbours */
    char *sep3 = sp_tlsf_malloc(heap, 64);
    (void)sep1, (void)sep2, (void)sep3;
    sp_tlsf_free(heap, freed_alone);
    /* Free the lower neighbour first: freeing the upper one then merges it into the lower
     * free block, and its header is gone (whichever way the heap carves blocks). */
    char *lower = x < y ? x : y, *upper = x < y ? y : x;
    sp_tlsf_free(heap, lower);
    sp_tlsf_free(heap, upper);
    freed_merged = upper;
}

static void test_reported(void) {
    ts_log_capture();
    int on_stack = 0;
    void *glibc = malloc(32);
    ok(sp_tlsf_check_ptr(heap, live, NULL) == SP_OK && ts_logged.count == 0,
       "check_ptr(live block): SP_OK");
    refuse_all(freed_alone, SP_ERR_DOUBLE_FREE, "already freed");
    refuse_all(freed_merged, SP_ERR_DOUBLE_FREE, "freed and merged");
    ok(strstr(ts_logged.last_message, "merged") != NULL,
       "a merged-away header is recognised as such (\"%s\")", ts_logged.last_message);
    refuse_all(&on_stack, SP_ERR_FOREIGN_POINTER, "stack address");
    refuse_all(glibc, SP_ERR_FOREIGN_POINTER, "glibc block");
    refuse_all(live + 1, SP_ERR_INVALID_POINTER, "misaligned");
    refuse_all(big + 16, SP_ERR_INVALID_POINTER, "interior +16");
    refuse_all(big + 1024, SP_ERR_INVALID_POINTER, "interior +1024");
    refuse_all((char *)mem + 8, SP_ERR_FOREIGN_POINTER, "control structure (before the pools)");
    free(glibc);

    /* Interior pointer into a block whose contents imitate a header: still refused. */
    memset(big, 0, 4096);
    uint64_t header = peek((char *)live - 8); /* a real header word, at the wrong address */
    memcpy(big + 512 - 8, &header, 8);
    refuse_all(big + 512, SP_ERR_INVALID_POINTER, "forged header");

    sp_tlsf_status before;
    sp_tlsf_status_get(heap, &before);
    ts_log_reset();
    ok(sp_tlsf_aligned_alloc(heap, 3, 10) == NULL && ts_logged.last_id == SP_ERR_BAD_ALIGNMENT &&
           unchanged(&before),
       "aligned_alloc(3): NULL, reported");
    ts_log_reset();
    ok(sp_tlsf_malloc(heap, SIZE_MAX) == NULL &&
           sp_tlsf_realloc(heap, live, SIZE_MAX - 15) == NULL &&
           sp_tlsf_aligned_alloc(heap, 4096, SIZE_MAX - 4096) == NULL && unchanged(&before),
       "sizes that overflow: NULL, heap unchanged");
    ok(ts_logged.count == 0, "running out is not misuse: nothing logged");
    ok(sp_tlsf_usable_size(heap, live) == 64, "the live block survived all of it");
    test_neighbour_check();
    test_pool_over_control();
    ts_log_release();
}

typedef struct death {
    void (*call)(void *p);
    void *p;
} death;

static void do_free(void *p) {
    sp_tlsf_free(heap, p);
}
static void do_realloc(void *p) {
    (void)sp_tlsf_realloc(heap, p, 10);
}
static void run_death(void *arg) {
    death *d = arg;
    d->call(d->p);
}

static void test_fatal(void) {
    struct {
        void (*call)(void *);
        void *p;
        const char *name, *what;
    } cases[] = {
        {do_free, NULL, "sp_tlsf_free", "double free"},
        {do_free, NULL, "sp_tlsf_free", "interior pointer"},
        {do_free, NULL, "sp_tlsf_free", "foreign pointer"},
        {do_realloc, NULL, "sp_tlsf_realloc", "realloc of a freed block"},
    };
    static int outside;
    cases[0].p = freed_alone;
    cases[1].p = big + 64;
    cases[2].p = &outside;
    cases[3].p = freed_merged;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char addr[32];
        snprintf(addr, sizeof addr, "%p", cases[i].p);
        death d = {cases[i].call, cases[i].p};
        ok(ts_dies(run_death, &d, cases[i].name, addr), "fatal misuse (%s) dies naming %s and %s",
           cases[i].what, cases[i].name, addr);
    }
}

/* A heap used after sp_tlsf_destroy (its memory left as destroy left it): every call refused
 * and reported; status gave 2^64 free bytes and check a false SP_ERR_CORRUPT. */
static void walk_count(void *user, void *p, size_t size, bool used) {
    (void)p, (void)size, (void)used;
    ++*(int *)user;
}

static void test_destroyed(void) {
    static char dead_mem[64 << 10] __attribute__((aligned(16)));
    sp_tlsf *t = sp_tlsf_create(&(sp_tlsf_desc){.memory = dead_mem, .size = sizeof dead_mem}, NULL);
    void *p = t ? sp_tlsf_malloc(t, 100) : NULL;
    if (!t || !p) {
        ok(0, "destroyed heap: create");
        return;
    }
    sp_tlsf_free(t, p);
    sp_tlsf_destroy(t);
    ts_log_capture();
    void *q = sp_tlsf_malloc(t, 100);
    sp_tlsf_status st;
    memset(&st, 0xff, sizeof st);
    sp_tlsf_status_get(t, &st);
    sp_result check = sp_tlsf_check(t);
    int walked = 0;
    sp_tlsf_walk(t, walk_count, &walked);
    sp_tlsf_free(t, p);
    ok(q == NULL && st.bytes_free == 0 && st.bytes_used == 0 && check == SP_ERR_INVALID_ARG &&
           walked == 0 && ts_logged.count == 5 && ts_logged.last_id == SP_ERR_FOREIGN_POINTER,
       "a destroyed heap: malloc NULL, status zeros, check SP_ERR_INVALID_ARG, walk nothing, free "
       "refused; each reported (%d reports)",
       ts_logged.count);
    /* add_pool used to bring the zeroed control back to life, with counters that check then
     * called corrupt; aligned_alloc and realloc(NULL, n) failed without a report. */
    static char more[16 << 10] __attribute__((aligned(16)));
    ts_log_reset();
    sp_result added = sp_tlsf_add_pool(t, more, sizeof more);
    int after_add = ts_logged.count;
    void *a = sp_tlsf_aligned_alloc(t, 64, 100), *r = sp_tlsf_realloc(t, NULL, 100);
    void *bad_align = sp_tlsf_aligned_alloc(t, 48, 100); /* one report: the alignment */
    ok(added == SP_ERR_INVALID_ARG && after_add == 1 && !a && !r && !bad_align &&
           ts_logged.count == 4 && sp_tlsf_check(t) == SP_ERR_INVALID_ARG,
       "... add_pool refused (%s), aligned_alloc and realloc(NULL, n) NULL, each reported once "
       "(%d of 4, an alignment of 48 among them); the heap stays dead",
       sp_result_name(added), ts_logged.count);
    ts_log_release();
}

/* A NULL heap, status out or walker: misuse, reported under the call, the failure value. */
static void test_null_args(void) {
    ts_log_capture();
    const char *why = NULL;
    sp_tlsf_status st;
    memset(&st, 0xff, sizeof st);
    static char pool[16 << 10] __attribute__((aligned(16)));
    int n = 0;
    bool answers =
        sp_tlsf_malloc(NULL, 16) == NULL && sp_tlsf_aligned_alloc(NULL, 64, 16) == NULL &&
        sp_tlsf_realloc(NULL, NULL, 16) == NULL && sp_tlsf_usable_size(NULL, pool) == 0 &&
        sp_tlsf_check_ptr(NULL, pool, &why) == SP_ERR_INVALID_ARG &&
        sp_tlsf_check(NULL) == SP_ERR_INVALID_ARG &&
        sp_tlsf_add_pool(NULL, pool, sizeof pool) == SP_ERR_INVALID_ARG;
    sp_tlsf_free(NULL, pool);
    sp_tlsf_status_get(NULL, &st);
    sp_tlsf_walk(NULL, walk_count, &n);
    ok(answers && st.bytes_used == 0 && st.bytes_free == 0 && n == 0 && ts_logged.count == 9 &&
           ts_logged.last_id == SP_ERR_INVALID_ARG &&
           !strcmp(ts_logged.last_call, "sp_tlsf_walk") && why != NULL,
       "a NULL heap: every call answers its failure value and is reported (%d of 9), but "
       "check_ptr, which reports nothing",
       ts_logged.count);
    ts_log_reset();
    sp_tlsf_status_get(heap, NULL);
    sp_tlsf_walk(heap, NULL, NULL);
    ok(ts_logged.count == 2 && sp_tlsf_check(heap) == SP_OK,
       "a NULL status out or walker: reported (%d), the heap untouched", ts_logged.count);
    /* A pool whose start rounds up past the end of the address space. */
    ts_log_reset();
    sp_result wrap = sp_tlsf_add_pool(heap, (void *)(UINTPTR_MAX - 5), 0);
    ok(wrap == SP_ERR_OVERFLOW && ts_logged.count == 1,
       "a pool at UINTPTR_MAX - 5: SP_ERR_OVERFLOW (%s), reported", sp_result_name(wrap));
    /* The same for create, with room for its control structure: it wrote it at the
     * rounded-up start (0). */
    ts_log_reset();
    sp_result created = SP_OK;
    sp_tlsf *top = sp_tlsf_create(
        &(sp_tlsf_desc){.memory = (void *)(UINTPTR_MAX - 5), .size = 6 + sp_tlsf_control_size()},
        &created);
    ok(!top && created == SP_ERR_OVERFLOW && ts_logged.count == 1,
       "create over memory at UINTPTR_MAX - 5: NULL, SP_ERR_OVERFLOW (%s), reported, nothing "
       "written",
       sp_result_name(created));
    /* A misaligned start with fewer bytes than its rounding takes wraps nothing: too small. */
    ts_log_reset();
    static _Alignas(16) char few[32];
    top = sp_tlsf_create(&(sp_tlsf_desc){.memory = few + 1, .size = 4}, &created);
    ok(!top && created == SP_ERR_TOO_SMALL && ts_logged.last_level == SP_LOG_WARN,
       "create over 4 bytes at a misaligned start: SP_ERR_TOO_SMALL (%s), a warning",
       sp_result_name(created));
    ts_log_release();
}

int main(void) {
    setup();
    test_reported();
    test_fatal();
    test_destroyed();
    test_null_args();
    sp_tlsf_free(heap, live);
    sp_tlsf_free(heap, big);
    return done();
}
