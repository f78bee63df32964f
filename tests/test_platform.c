/* The platform layer: virtual memory, clocks, threads and futexes against the real OS. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sp_platform.h"
#include "test_support.h"

static void sleep_ns(uint64_t ns) {
    struct timespec d = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    while (nanosleep(&d, &d) != 0) {
    }
}

/* True when every byte of [p, p+n) equals v. */
static bool bytes_all(const unsigned char *p, size_t n, unsigned char v) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) return false;
    return true;
}

static void test_page_size(void) {
    size_t ps = sp_page_size();
    ok(ps >= 4096 && (ps & (ps - 1)) == 0, "page size %zu is a power of two >= 4096", ps);
}

static void test_reserve_commit(void) {
    const size_t ps = sp_page_size(), size = 256 * ps;
    unsigned char *p = sp_vm_reserve(size, 0, false, NULL);
    ok(p != NULL, "reserve %zu bytes", size);
    if (!p) return;
    is_int(sp_vm_commit(p, size), SP_OK, "commit the whole reservation");
    for (size_t i = 0; i < size; i += 64) p[i] = (unsigned char)(i >> 6);
    bool same = true;
    for (size_t i = 0; i < size; i += 64) same &= p[i] == (unsigned char)(i >> 6);
    ok(same, "committed memory keeps what was written");
    sp_vm_release(p, size);
}

static void test_alignment(void) {
    const size_t aligns[] = {(size_t)2 << 20, (size_t)64 << 10};
    for (size_t i = 0; i < 2; i++) {
        size_t a = aligns[i], size = 3 * sp_page_size();
        unsigned char *p = sp_vm_reserve(size, a, false, NULL);
        bool usable = p && ((uintptr_t)p & (a - 1)) == 0 && sp_vm_commit(p, size) == SP_OK;
        if (usable) {
            p[0] = 1;
            p[size - 1] = 2;
            usable = p[0] == 1 && p[size - 1] == 2;
        }
        ok(usable, "reserve aligned to %zu KiB: %p, usable", a >> 10, (void *)p);
        if (p) sp_vm_release(p, size);
    }
}

static void test_decommit_zero(void) {
    const size_t ps = sp_page_size(), size = 16 * ps;
    unsigned char *p = sp_vm_reserve(size, 0, false, NULL);
    if (!p || sp_vm_commit(p, size) != SP_OK) {
        ok(0, "reserve+commit for decommit");
        ok(0, "recommit");
        ok(0, "reads zero");
        return;
    }
    memset(p, 0xA5, size);
    is_int(sp_vm_decommit(p + 4 * ps, 8 * ps), SP_OK, "decommit 8 pages in the middle");
    is_int(sp_vm_commit(p + 4 * ps, 8 * ps), SP_OK, "commit them again");
    ok(bytes_all(p + 4 * ps, 8 * ps, 0) && bytes_all(p, 4 * ps, 0xA5) &&
           bytes_all(p + 12 * ps, 4 * ps, 0xA5),
       "recommitted pages read zero, neighbours keep their contents");
    sp_vm_release(p, size);
}

/* Pages of [p, p + n pages) resident now (mincore). */
static size_t resident_pages(const unsigned char *p, size_t n) {
    unsigned char vec[64];
    if (n > sizeof vec || mincore((void *)p, n * sp_page_size(), vec) != 0) return SIZE_MAX;
    size_t r = 0;
    for (size_t i = 0; i < n; i++) r += vec[i] & 1;
    return r;
}

/* A range whose last page is not mapped: commit, decommit, purge and guard each fail
 * (SP_ERR_OS) and leave the mapped pages as they were (mprotect and madvise change the part
 * before a hole, then fail: a failed decommit took the caller's committed data away). */
static void test_partial_range(void) {
    const size_t ps = sp_page_size();
    unsigned char *p = sp_vm_reserve(4 * ps, 0, false, NULL);
    if (!p || sp_vm_commit(p, 3 * ps) != SP_OK) {
        ok(0, "reserve+commit for the partial range");
        return;
    }
    memset(p, 0xAB, 3 * ps);
    sp_vm_release(p + 3 * ps, ps); /* the last page unmapped */
    ts_log_capture();
    sp_result d = sp_vm_decommit(p, 4 * ps), u = sp_vm_purge(p, 4 * ps), g = sp_vm_guard(p, 4 * ps);
    bool kept = bytes_all(p, 3 * ps, 0xAB); /* still readable: no fault, contents kept */
    sp_result c = sp_vm_commit(p, 4 * ps);
    int logged = ts_logged.count;
    ts_log_release();
    ok(d == SP_ERR_OS && u == SP_ERR_OS && g == SP_ERR_OS && c == SP_ERR_OS && kept && logged == 4,
       "decommit, purge, guard and commit of a range with an unmapped page: SP_ERR_OS each, "
       "logged (%d), the mapped pages untouched (readable, contents kept: %d)",
       logged, kept);
    sp_vm_release(p, 3 * ps);
}

static void test_purge(void) {
    const size_t ps = sp_page_size(), pages = 16;
    unsigned char *p = sp_vm_reserve(pages * ps, 0, false, NULL);
    if (!p || sp_vm_commit(p, pages * ps) != SP_OK) {
        ok(0, "reserve+commit for purge");
        ok(0, "purged pages");
        ok(0, "reads zero");
        return;
    }
    memset(p, 0xA5, pages * ps);
    size_t before = resident_pages(p, pages);
    is_int(sp_vm_purge(p + 4 * ps, 8 * ps), SP_OK, "purge 8 pages in the middle");
    ok(before == pages && resident_pages(p, pages) == pages - 8,
       "their pages left the resident set (%zu of %zu resident before, %zu after)", before, pages,
       resident_pages(p, pages));
    bool zero = bytes_all(p + 4 * ps, 8 * ps, 0);
    p[5 * ps] = 7; /* still committed: no fault */
    ok(zero && p[5 * ps] == 7 && bytes_all(p, 4 * ps, 0xA5) && bytes_all(p + 12 * ps, 4 * ps, 0xA5),
       "purged pages read zero and stay writable; the others keep their contents");
    sp_vm_release(p, pages * ps);
}

static void test_guard(void) {
    const size_t ps = sp_page_size(), size = 3 * ps;
    unsigned char *p = sp_vm_reserve(size, 0, false, NULL);
    if (!p || sp_vm_commit(p, size) != SP_OK) {
        ok(0, "reserve+commit for guard");
        ok(0, "guard faults");
        ok(0, "neighbours usable");
        return;
    }
    is_int(sp_vm_guard(p + ps, ps), SP_OK, "guard the middle page");
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        signal(SIGSEGV, SIG_DFL); /* die by the signal even under a sanitizer's handler */
        ((volatile unsigned char *)p)[ps + 10] = 1;
        _exit(0);
    }
    int status = 0;
    bool segv = pid > 0 && waitpid(pid, &status, 0) == pid && WIFSIGNALED(status) &&
                WTERMSIG(status) == SIGSEGV;
    ok(segv, "touching the guard page dies by SIGSEGV (status 0x%x)", status);
    p[ps - 1] = 1;
    p[2 * ps] = 2;
    ok(p[ps - 1] == 1 && p[2 * ps] == 2, "pages either side of the guard stay usable");
    sp_vm_release(p, size);
}

static void test_huge(void) {
    const size_t hs = sp_huge_page_size(), size = (size_t)4 << 20;
    diag("huge page size: %zu", hs);
    sp_page_kind kind = (sp_page_kind)-1;
    unsigned char *p = sp_vm_reserve(size, 0, true, &kind);
    ok(p != NULL, "huge reservation of 4 MiB");
    if (!p) {
        ok(0, "granted kind");
        ok(0, "alignment");
        ok(0, "usable");
        return;
    }
    static const char *names[] = {"normal", "transparent", "huge"};
    bool known = kind == SP_PAGES_NORMAL || kind == SP_PAGES_TRANSPARENT || kind == SP_PAGES_HUGE;
    ok(known, "granted a known page kind: %s", known ? names[kind] : "?");
    ok(kind == SP_PAGES_NORMAL || (hs && ((uintptr_t)p & (hs - 1)) == 0),
       "huge kinds are aligned to the huge page size");
    bool usable = sp_vm_commit(p, size) == SP_OK;
    if (usable) {
        memset(p, 0x5A, size);
        usable = bytes_all(p, size, 0x5A);
    }
    ok(usable, "the whole 4 MiB is usable after commit");
    sp_vm_release(p, size);
}

/* The mappings (/proc/self/smaps) overlapping [p, p + size): how many, and how many carry
 * the MADV_HUGEPAGE advice (VmFlags "hg"). */
static void range_mappings(const void *p, size_t size, int *maps, int *advised) {
    *maps = *advised = 0;
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    bool in = false;
    const uintptr_t lo = (uintptr_t)p, hi = lo + size;
    while (f && fgets(line, sizeof line, f)) {
        uintptr_t a, b;
        char perms[5];
        if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %4s", &a, &b, perms) == 3) {
            in = a < hi && b > lo;
            *maps += in;
        } else if (in && !strncmp(line, "VmFlags:", 8)) {
            *advised += strstr(line, " hg") != NULL;
        }
    }
    if (f) fclose(f);
}

/* Decommit keeps the range's mapping: committed again, the range merges back with its
 * neighbours, and a transparent-huge-page reservation keeps its MADV_HUGEPAGE advice. (Mapping
 * fresh pages over the range lost the advice, so each decommitted range stayed a mapping of
 * its own, without huge pages.) */
static void test_decommit_keeps_mapping(void) {
    const size_t two = (size_t)2 << 20, size = 16 * two;
    sp_page_kind kind = SP_PAGES_NORMAL;
    unsigned char *p = sp_vm_reserve(size, 0, true, &kind);
    if (!p || sp_vm_commit(p, size) != SP_OK) {
        ok(0, "reserve+commit 32 MiB for the mapping check");
        ok(0, "advice kept");
        return;
    }
    int maps0, advised0, maps, advised;
    range_mappings(p, size, &maps0, &advised0);
    bool done = true;
    for (size_t i = 1; i < 16; i += 2) done &= sp_vm_decommit(p + i * two, two) == SP_OK;
    done &= sp_vm_commit(p, size) == SP_OK;
    range_mappings(p, size, &maps, &advised);
    ok(done && maps0 == 1 && maps == 1,
       "8 ranges decommitted and the whole committed again: one mapping, as before (%d, then "
       "%d)",
       maps0, maps);
    if (kind == SP_PAGES_TRANSPARENT)
        ok(advised0 == 1 && advised == maps,
           "... with the MADV_HUGEPAGE advice still on it (%d of %d mappings)", advised, maps);
    else
        skip("transparent huge pages not granted here");
    sp_vm_release(p, size);
}

static void touch(void *p) {
    signal(SIGSEGV, SIG_DFL); /* die by the signal even under a sanitizer's handler */
    *(volatile unsigned char *)p = 1;
}

/* Whether a touch of p faults, in a child (ts_dies: the child's output on a failure). */
static bool faults(void *p) {
    return ts_dies(touch, p, NULL, NULL);
}

/* A decommitted range is inaccessible (a touch faults) and reads zero once committed again,
 * also where its pages could not be dropped in place (a locked page: MADV_DONTNEED refuses it,
 * and the range is mapped afresh). */
static void test_decommit_inaccessible(void) {
    const size_t ps = sp_page_size(), size = 8 * ps;
    unsigned char *p = sp_vm_reserve(size, 0, false, NULL);
    if (!p || sp_vm_commit(p, size) != SP_OK) {
        ok(0, "reserve+commit for the access check");
        ok(0, "locked page");
        return;
    }
    memset(p, 0xA5, size);
    sp_vm_decommit(p + 2 * ps, 2 * ps);
    ok(faults(p + 3 * ps) && bytes_all(p + 4 * ps, 4 * ps, 0xA5),
       "a decommitted page faults when touched; its neighbours keep their contents");
    if (mlock(p + 5 * ps, ps) != 0) {
        skip("mlock refused here (RLIMIT_MEMLOCK)");
    } else {
        sp_result r = sp_vm_decommit(p + 4 * ps, 4 * ps);
        bool zero = sp_vm_commit(p + 4 * ps, 4 * ps) == SP_OK && bytes_all(p + 4 * ps, 4 * ps, 0);
        ok(r == SP_OK && zero && faults(p + 2 * ps),
           "a range with a locked page decommits too (mapped afresh), reads zero when committed "
           "again (%s)",
           sp_result_name(r));
    }
    sp_vm_release(p, size);
}

/* Explicit huge pages are mapped afresh by decommit, with base pages: a later commit may take
 * a part smaller than a huge page (the handle heap commits 16 KiB at a time). Dropped in place,
 * a hugetlb range stayed PROT_NONE hugetlb, and such a commit failed (EINVAL). */
static void test_decommit_hugetlb(void) {
    const size_t hs = sp_huge_page_size();
    sp_page_kind kind = SP_PAGES_NORMAL;
    unsigned char *p = hs ? sp_vm_reserve(2 * hs, 0, true, &kind) : NULL;
    if (!p || kind != SP_PAGES_HUGE) {
        skip("no explicit huge pages here (the hugetlb pool is empty)");
    } else {
        memset(p, 0x5A, 2 * hs);
        bool dec = sp_vm_decommit(p + hs, hs) == SP_OK;
        bool com = sp_vm_commit(p + hs, 16 << 10) == SP_OK;
        ok(dec && com && bytes_all(p + hs, 16 << 10, 0) && bytes_all(p, hs, 0x5A),
           "a huge page decommitted, then 16 KiB of it committed: it works, reads zero, the "
           "other huge page keeps its contents");
    }
    if (p) sp_vm_release(p, 2 * hs);
}

/* Checks a misuse or OS failure: the result and what the capturing logger saw. */
static void check_logged(int count_before, sp_result want, const char *call, const void *addr) {
    ok(ts_logged.count == count_before + 1 && ts_logged.last_id == want &&
           strcmp(ts_logged.last_call, call) == 0 && ts_logged.last_addr == addr,
       "%s reported %s at %p through the logger", call, sp_result_name(want), addr);
    if (ts_logged.count)
        diag("  logged %s from %s at %p: %s", sp_result_name(ts_logged.last_id),
             ts_logged.last_call, ts_logged.last_addr, ts_logged.last_message);
}

static void test_bad_args(void) {
    const size_t ps = sp_page_size();
    unsigned char *p = sp_vm_reserve(4 * ps, 0, false, NULL);
    ts_log_capture();
    int n = ts_logged.count;
    ok(sp_vm_reserve(ps, 3 * ps, false, NULL) == NULL, "reserve with align 3 pages fails");
    check_logged(n, SP_ERR_INVALID_ARG, "sp_vm_reserve", NULL);
    n = ts_logged.count;
    ok(sp_vm_reserve(SIZE_MAX, 0, false, NULL) == NULL, "reserve of SIZE_MAX bytes fails");
    check_logged(n, SP_ERR_OVERFLOW, "sp_vm_reserve", NULL);
    sp_thread th;
    n = ts_logged.count;
    ok(sp_thread_start(NULL, NULL, NULL, "x") == SP_ERR_INVALID_ARG &&
           sp_thread_start(&th, NULL, NULL, "x") == SP_ERR_INVALID_ARG && ts_logged.count == n + 2,
       "sp_thread_start with a NULL out or fn: SP_ERR_INVALID_ARG, reported");

    n = ts_logged.count;
    is_int(sp_vm_commit(p + 1, ps), SP_ERR_INVALID_ARG, "commit of an unaligned pointer");
    check_logged(n, SP_ERR_INVALID_ARG, "sp_vm_commit", p + 1);

    n = ts_logged.count;
    is_int(sp_vm_decommit(p, ps + 1), SP_ERR_INVALID_ARG, "decommit of an unaligned size");
    check_logged(n, SP_ERR_INVALID_ARG, "sp_vm_decommit", p);

    n = ts_logged.count;
    is_int(sp_vm_guard(p + 7, ps), SP_ERR_INVALID_ARG, "guard of an unaligned pointer");
    check_logged(n, SP_ERR_INVALID_ARG, "sp_vm_guard", p + 7);

    /* An OS refusal: committing address space that is no longer mapped. */
    sp_vm_release(p, 4 * ps);
    n = ts_logged.count;
    is_int(sp_vm_commit(p, ps), SP_ERR_OS, "commit of a released range fails");
    check_logged(n, SP_ERR_OS, "sp_vm_commit", p);
    n = ts_logged.count;
    is_int(sp_vm_decommit(p, ps), SP_ERR_OS, "decommit of a released range fails");
    check_logged(n, SP_ERR_OS, "sp_vm_decommit", p);
    n = ts_logged.count;
    is_int(sp_vm_purge(p, ps), SP_ERR_OS, "purge of a released range fails");
    check_logged(n, SP_ERR_OS, "sp_vm_purge", p);
    n = ts_logged.count;
    is_int(sp_vm_purge(p + 1, ps), SP_ERR_INVALID_ARG, "purge of an unaligned pointer");
    check_logged(n, SP_ERR_INVALID_ARG, "sp_vm_purge", p + 1);
    ok(msync(p, ps, MS_ASYNC) != 0 && errno == ENOMEM,
       "... and maps nothing there (msync: not mapped)");
    ts_log_release();
}

static void test_cpu_count(void) {
    uint32_t n = sp_cpu_count();
    ts_cpu self;
    ts_cpu_read(&self);
    int want = self.count;
    ok(n >= 1, "cpu count %u >= 1", n);
    is_int(n, want, "cpu count matches sched_getaffinity");
}

/* Where a thread started: its CPU and mask at its first instruction; then (pin_to >= 0) the
 * same after it pinned itself with sp_thread_pin. */
typedef struct cpu_probe {
    int pin_to, nth5;
    sp_result pin;
    ts_cpu start, pinned;
} cpu_probe;

static void *cpu_probe_run(void *arg) {
    cpu_probe *p = arg;
    ts_cpu_read(&p->start);
    if (p->pin_to >= 0) {
        p->pin = sp_thread_pin(sp_thread_self(), p->pin_to);
        ts_cpu_read(&p->pinned);
        p->nth5 = sp_cpu_nth(5);
    }
    return NULL;
}

/* Start a probe (on cpu, SP_CPU_ANY for none), wait for it; the start's result. */
static sp_result probe(cpu_probe *p, int cpu) {
    sp_thread t;
    sp_result r = sp_thread_start_on(&t, cpu_probe_run, p, "sp-cpu", cpu);
    if (r == SP_OK) sp_thread_join(t);
    return r;
}

/* sp_cpu_nth against the mask read by hand; threads started on a CPU, or pinned to one, run
 * there only (on threads of their own); the refusals, on this thread (the calls that must
 * fail, and SP_CPU_ANY, which changes nothing: its mask is checked after them). */
static void test_cpu_pin(void) {
    ts_cpu self0;
    if (!ts_cpu_read_or_skip(&self0, 6)) return;
    const cpu_set_t all = self0.mask;
    int cpus[CPU_SETSIZE], n = 0;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &all)) cpus[n++] = c;
    bool nth = true;
    for (int k = 0; nth && k < 2 * n + 1; k++) nth = sp_cpu_nth((uint32_t)k) == cpus[k % n];
    ok(nth, "sp_cpu_nth(k) is the (k mod %d)-th CPU of the affinity mask", n);

    int last = cpus[n - 1];
    cpu_probe on = {.pin_to = -1}, any = {.pin_to = -1};
    sp_result r = probe(&on, last), r_any = probe(&any, SP_CPU_ANY);
    ok(r == SP_OK && ts_cpu_only(&on.start, last) && r_any == SP_OK &&
           CPU_EQUAL(&any.start.mask, &all),
       "sp_thread_start_on(CPU %d): the thread runs there only from its start; SP_CPU_ANY: "
       "the creator's mask",
       last);

    cpu_probe self = {.pin_to = last};
    r = probe(&self, SP_CPU_ANY);
    ok(r == SP_OK && self.pin == SP_OK && ts_cpu_only(&self.pinned, last) && self.nth5 == last,
       "sp_thread_pin(sp_thread_self(), %d): the thread moves there before it returns, and "
       "sp_cpu_nth then sees one CPU",
       last);

    ts_log_capture();
    bool bad = sp_thread_pin(sp_thread_self(), -5) == SP_ERR_INVALID_ARG &&
               sp_thread_pin(sp_thread_self(), SP_CPU_MAX) == SP_ERR_INVALID_ARG &&
               probe(&on, -5) == SP_ERR_INVALID_ARG && probe(&on, SP_CPU_MAX) == SP_ERR_INVALID_ARG;
    bool any_ok = sp_thread_pin(sp_thread_self(), SP_CPU_ANY) == SP_OK;
    ok(bad && any_ok && ts_logged.count == 4 && ts_logged.last_id == SP_ERR_INVALID_ARG,
       "sp_thread_pin and sp_thread_start_on to CPU -5 or SP_CPU_MAX: SP_ERR_INVALID_ARG, each "
       "reported; sp_thread_pin to SP_CPU_ANY: SP_OK, nothing reported");
    ts_log_reset();
    ts_cpu now;
    r = sp_thread_pin(sp_thread_self(), SP_CPU_MAX - 1); /* no machine here has it */
    ts_cpu_read(&now);
    ok(r == SP_ERR_OS && ts_logged.count == 1 && ts_logged.last_id == SP_ERR_OS && now.count >= 0 &&
           CPU_EQUAL(&now.mask, &all),
       "sp_thread_pin to a CPU the machine lacks: SP_ERR_OS, logged; this thread's mask "
       "unchanged by it and the calls above");
    ts_log_reset();
    on = (cpu_probe){.pin_to = -1, .start.cpu = -2};
    r = probe(&on, SP_CPU_MAX - 1); /* joins it, had it started */
    ok(r == SP_ERR_OS && ts_logged.count == 1 && ts_logged.last_id == SP_ERR_OS &&
           on.start.cpu == -2,
       "sp_thread_start_on a CPU the machine lacks: SP_ERR_OS, logged, no thread started");
    ts_log_release();
}

static void test_clocks(void) {
    bool mono = true;
    uint64_t prev = sp_time_ns();
    for (int i = 0; i < 10000; i++) {
        uint64_t t = sp_time_ns();
        mono &= t >= prev;
        prev = t;
    }
    sleep_ns(1000000);
    mono &= sp_time_ns() >= prev + 1000000;
    ok(mono, "sp_time_ns never goes back and advances over a 1 ms sleep");

    bool tmono = true;
    uint64_t tp = sp_ticks();
    for (int i = 0; i < 10000; i++) {
        uint64_t t = sp_ticks();
        tmono &= t >= tp;
        tp = t;
    }
    ok(tmono, "sp_ticks never goes back on one thread");

    /* Ticks and the clock measure the same interval; a loaded machine stretches both. */
    uint64_t w0 = sp_time_ns(), k0 = sp_ticks();
    sleep_ns(20000000);
    uint64_t k1 = sp_ticks(), w1 = sp_time_ns();
    double ns = sp_ticks_to_ns(k1 - k0), wall = (double)(w1 - w0);
    ok(ns >= 0.9 * wall - 1e5 && ns <= 1.1 * wall + 1e5,
       "ticks over a 20 ms sleep convert to %.2f ms (clock: %.2f ms)", ns / 1e6, wall / 1e6);
}

typedef struct thread_probe {
    char name[32];
    uint64_t os_id;
} thread_probe;

static void *thread_probe_run(void *arg) {
    thread_probe *tp = arg;
    pthread_getname_np(pthread_self(), tp->name, sizeof tp->name);
    tp->os_id = sp_thread_os_id();
    sp_thread_yield();
    return (char *)arg + 1;
}

static void test_threads(void) {
    thread_probe a = {{0}, 0}, b = {{0}, 0};
    sp_thread ta, tb;
    is_int(sp_thread_start(&ta, thread_probe_run, &a, "sp-test"), SP_OK, "start a named thread");
    is_int(sp_thread_start(&tb, thread_probe_run, &b, "abcdefghijklmnopqrstuvwxyz"), SP_OK,
           "start a thread with a long name");
    ok(sp_thread_join(ta) == (char *)&a + 1, "join returns the function's value");
    ok(sp_thread_join(tb) == (char *)&b + 1, "join returns the second function's value");
    ok(strcmp(a.name, "sp-test") == 0, "the thread reads its name back: \"%s\"", a.name);
    ok(strcmp(b.name, "abcdefghijklmno") == 0, "a long name is cut to 15 chars: \"%s\"", b.name);
    uint64_t me = sp_thread_os_id();
    ok(me == (uint64_t)getpid() && a.os_id && b.os_id && a.os_id != me && b.os_id != me &&
           a.os_id != b.os_id,
       "OS thread ids are distinct (main %llu, %llu, %llu)", (unsigned long long)me,
       (unsigned long long)a.os_id, (unsigned long long)b.os_id);
}

typedef struct waker {
    uint32_t word;
} waker;

static void *waker_run(void *arg) {
    waker *w = arg;
    sleep_ns(20000000);
    __atomic_store_n(&w->word, 1, __ATOMIC_RELEASE);
    sp_futex_wake(&w->word, INT32_MAX);
    return NULL;
}

static void test_futex(void) {
    uint32_t word = 7;
    uint64_t t0 = sp_time_ns();
    sp_futex_wait(&word, 7, 20000000);
    uint64_t dt = sp_time_ns() - t0;
    ok(dt >= 15000000 && dt < 2000000000u, "wait on a matching value times out (%.2f ms)",
       (double)dt / 1e6);

    t0 = sp_time_ns();
    errno = 1234;
    sp_futex_wait(&word, 8, 2000000000u); /* EAGAIN from the kernel */
    int after_wait = errno;
    sp_futex_wake(&word, 1);
    dt = sp_time_ns() - t0;
    ok(dt < 500000000u, "wait on a different value returns at once (%.3f ms)", (double)dt / 1e6);
    ok(after_wait == 1234 && errno == 1234,
       "futex wait and wake leave errno as it was (%d, %d; a lock inside free() must not change "
       "it)",
       after_wait, errno);

    waker w = {0};
    sp_thread t;
    if (sp_thread_start(&t, waker_run, &w, "sp-waker") != SP_OK) {
        ok(0, "start the waker");
        return;
    }
    t0 = sp_time_ns();
    int sleeps = 0;
    while (__atomic_load_n(&w.word, __ATOMIC_ACQUIRE) == 0 && sp_time_ns() - t0 < 10000000000u) {
        sp_futex_wait(&w.word, 0, 10000000000u);
        sleeps++;
    }
    dt = sp_time_ns() - t0;
    sp_thread_join(t);
    ok(__atomic_load_n(&w.word, __ATOMIC_ACQUIRE) == 1 && dt < 5000000000u,
       "a sleeper is woken by another thread (%.2f ms, %d waits)", (double)dt / 1e6, sleeps);
    sp_futex_wake(&w.word, 1); /* no sleeper: harmless */
}

int main(void) {
    plan(67);
    test_page_size();              /* 1 */
    test_reserve_commit();         /* 3 */
    test_alignment();              /* 2 */
    test_decommit_zero();          /* 3 */
    test_purge();                  /* 3 */
    test_partial_range();          /* 1 */
    test_guard();                  /* 3 */
    test_huge();                   /* 4 */
    test_decommit_keeps_mapping(); /* 2 */
    test_decommit_inaccessible();  /* 2 */
    test_decommit_hugetlb();       /* 1 */
    test_bad_args();               /* 17 */
    test_cpu_count();              /* 2 */
    test_cpu_pin();                /* 6 */
    test_clocks();                 /* 3 */
    test_threads();                /* 7 */
    test_futex();                  /* 3 */
    return done();
}
