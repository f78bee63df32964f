/* The platform layer on Linux (x86-64, aarch64, others through the clock fallback): virtual
 * memory over mmap, threads over pthread, futexes over the raw syscall, and a futex mutex.
 * This is the only file in spindle allowed OS or CPU #ifdefs. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "sp_internal.h"
#include "sp_platform.h"
#include "track.h" /* track_enter / track_leave: Valgrind reports held back */

_Static_assert(sizeof(pthread_t) <= sizeof(uintptr_t), "sp_thread.os must hold a pthread_t");

/* ---- errors ---------------------------------------------------------------------------- */

/* Text for an errno value, safe inside malloc: strerrordesc_np takes no lock and allocates
 * nothing. (strerror_r translates through gettext, which takes glibc's locale lock: a malloc
 * that failed inside textdomain, under that lock, left the process hung in it.) `buf` is used
 * only when the libc has no such call. */
static const char *errno_text(int err, char *buf, size_t n) {
#if defined(__GLIBC__) && __GLIBC_PREREQ(2, 32)
    const char *text = strerrordesc_np(err);
    if (text) return text;
#endif
    snprintf(buf, n, "errno %d", err);
    return buf;
}

/* Log an OS refusal (resource class: warn, SP_ERR_OS) with the call, address and errno;
 * `size` 0 leaves the size out of the message. */
static sp_result os_fail(const char *call, const void *addr, const char *what, size_t size,
                         int err) {
    char buf[128];
    const char *text = errno_text(err, buf, sizeof buf);
    if (size)
        sp_log(SP_LOG_WARN, SP_ERR_OS, call, addr, "%s of %zu bytes failed: %s", what, size, text);
    else
        sp_log(SP_LOG_WARN, SP_ERR_OS, call, addr, "%s failed: %s", what, text);
    return SP_ERR_OS;
}

/* ---- virtual memory -------------------------------------------------------------------- */

/* Cached sizes: 0 = not yet read. Racing first calls compute the same value, so relaxed
 * loads and stores suffice. */
static size_t page_size_cached;
static size_t huge_size_cached; /* SIZE_MAX = read, but unknown */

size_t sp_page_size(void) {
    size_t s = __atomic_load_n(&page_size_cached, __ATOMIC_RELAXED);
    if (SP_UNLIKELY(s == 0)) {
        long v = sysconf(_SC_PAGESIZE);
        s = v > 0 ? (size_t)v : 4096;
        __atomic_store_n(&page_size_cached, s, __ATOMIC_RELAXED);
    }
    return s;
}

/* "Hugepagesize:    2048 kB" from /proc/meminfo; 0 when absent. Cost: a file read. */
static size_t meminfo_huge_size(void) {
    FILE *f = fopen("/proc/meminfo", "re");
    if (!f) return 0;
    char line[256];
    size_t kib = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long v;
        if (sscanf(line, "Hugepagesize: %lu kB", &v) == 1) {
            kib = v;
            break;
        }
    }
    fclose(f);
    size_t s = kib * 1024;
    return sp_is_pow2(s) ? s : 0;
}

size_t sp_huge_page_size(void) {
    size_t s = __atomic_load_n(&huge_size_cached, __ATOMIC_RELAXED);
    if (SP_UNLIKELY(s == 0)) {
        s = meminfo_huge_size();
        if (s == 0) s = SIZE_MAX;
        __atomic_store_n(&huge_size_cached, s, __ATOMIC_RELAXED);
    }
    return s == SIZE_MAX ? 0 : s;
}

/* True unless /sys/kernel/mm/transparent_hugepage/enabled is missing or selects [never].
 * Read on every huge reservation (the setting can change at run time). */
static bool thp_enabled(void) {
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "re");
    if (!f) return false;
    char line[128] = {0};
    bool on = fgets(line, sizeof line, f) && !strstr(line, "[never]");
    fclose(f);
    return on;
}

/* mmap `size` bytes at an `align`-aligned address. `granule` is the alignment mmap already
 * guarantees for these flags (base or huge page); size is a multiple of it. When align >
 * granule, over-reserves by align - granule and unmaps the unaligned head and tail, so the
 * cost is address space only. Returns NULL with errno set on failure. */
static void *region_map(size_t size, size_t align, size_t granule, int prot, int flags) {
    if (align <= granule) {
        void *p = mmap(NULL, size, prot, flags, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    size_t span = size + (align - granule);
    if (span < size) {
        errno = ENOMEM;
        return NULL;
    }
    void *raw = mmap(NULL, span, prot, flags, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    uintptr_t base = (uintptr_t)raw;
    uintptr_t aligned = sp_align_up(base, align);
    size_t head = aligned - base;
    size_t tail = span - head - size;
    /* Trimming cannot fail for whole granules of a mapping we own; a failure only leaks
     * address space, so it is not worth failing the reservation for. */
    if (head) munmap(raw, head);
    if (tail) munmap((void *)(aligned + size), tail);
    return (void *)aligned;
}

/* Round x up to a power of two `a`; 0 on overflow. */
static size_t size_round(size_t x, size_t a) {
    size_t r = (x + (a - 1)) & ~(a - 1);
    return r < x ? 0 : r;
}

/* The explicit huge-page (MAP_HUGETLB) reservations, for sp_vm_decommit: it maps such ranges
 * afresh with base pages, where other ranges are dropped in place. (A hugetlb range made
 * PROT_NONE in place could not be committed again in steps smaller than its pages, as the
 * handle heap commits.) A fixed table: a reservation that finds no free entry is not made of
 * explicit huge pages. Entries: base 0 is free; base is set before size, and size cleared
 * before base (a range is looked up only while its owner holds it: after its add, before its
 * remove). */
enum { HUGE_MAPS = 16 };
static struct { uintptr_t base, size; /* atomic */ } huge_maps[HUGE_MAPS];

static bool huge_map_add(void *p, size_t size) {
    for (int i = 0; i < HUGE_MAPS; i++) {
        uintptr_t free_base = 0;
        if (__atomic_compare_exchange_n(&huge_maps[i].base, &free_base, (uintptr_t)p, false,
                                        __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            __atomic_store_n(&huge_maps[i].size, size, __ATOMIC_RELEASE);
            return true;
        }
    }
    return false;
}

/* Whether p lies in an explicit huge-page reservation. */
static bool huge_map_has(const void *p) {
    for (int i = 0; i < HUGE_MAPS; i++) {
        uintptr_t base = __atomic_load_n(&huge_maps[i].base, __ATOMIC_ACQUIRE);
        uintptr_t size = __atomic_load_n(&huge_maps[i].size, __ATOMIC_ACQUIRE);
        if (base && (uintptr_t)p - base < size) return true;
    }
    return false;
}

/* A release of [p, p + size) ends the reservations that begin inside it. Returns the recorded
 * length of the one at p (rounded to its huge pages, as munmap needs it), 0 if there is none. */
static size_t huge_map_remove(const void *p, size_t size) {
    size_t at_p = 0;
    for (int i = 0; i < HUGE_MAPS; i++) {
        uintptr_t base = __atomic_load_n(&huge_maps[i].base, __ATOMIC_ACQUIRE);
        if (base && base - (uintptr_t)p < size) {
            if (base == (uintptr_t)p) at_p = __atomic_load_n(&huge_maps[i].size, __ATOMIC_ACQUIRE);
            __atomic_store_n(&huge_maps[i].size, 0, __ATOMIC_RELEASE);
            __atomic_store_n(&huge_maps[i].base, 0, __ATOMIC_RELEASE);
        }
    }
    return at_p;
}

void *sp_vm_reserve(size_t size, size_t align, bool huge, sp_page_kind *granted) {
    const size_t page = sp_page_size();
    if (align == 0) align = page;
    if (SP_UNLIKELY(!sp_is_pow2(align) || size == 0)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_vm_reserve", NULL,
                  "size %zu, align %zu: size must be non-zero and align a power of two", size,
                  align);
        return NULL;
    }
    if (align < page) align = page;
    size_t rounded = size_round(size, page);
    if (SP_UNLIKELY(rounded == 0)) {
        sp_log(SP_LOG_WARN, SP_ERR_OVERFLOW, "sp_vm_reserve", NULL, "size %zu overflows", size);
        return NULL;
    }
    const int reserve_flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    const size_t hsize = huge ? sp_huge_page_size() : 0;
    if (hsize) {
        /* 1. Explicit huge pages: come readable/writable, backed by the hugetlb pool (no
         *    MAP_NORESERVE, so the pool is charged now and touching never SIGBUSes). */
        size_t hrounded = size_round(size, hsize);
        if (hrounded) {
            void *p = region_map(hrounded, align, hsize, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB);
            if (p && huge_map_add(p, hrounded)) {
                if (granted) *granted = SP_PAGES_HUGE;
                return p;
            }
            if (p) munmap(p, hrounded); /* the table is full: base pages instead */
        }
        /* 2. Base pages, huge-aligned so THP can back whole 2 MiB extents. */
        void *p =
            region_map(rounded, align > hsize ? align : hsize, page, PROT_NONE, reserve_flags);
        if (p) {
            bool thp = madvise(p, rounded, MADV_HUGEPAGE) == 0 && thp_enabled();
            if (granted) *granted = thp ? SP_PAGES_TRANSPARENT : SP_PAGES_NORMAL;
            return p;
        }
        /* 3. Fall through: the huge alignment may be what the OS refused. */
    }
    void *p = region_map(rounded, align, page, PROT_NONE, reserve_flags);
    if (SP_UNLIKELY(!p)) {
        os_fail("sp_vm_reserve", NULL, "mmap", rounded, errno);
        return NULL;
    }
    if (granted) *granted = SP_PAGES_NORMAL;
    return p;
}

/* Misuse check shared by commit/decommit/guard: non-NULL, page-aligned pointer and size. */
static bool range_valid(const char *call, const void *p, size_t size) {
    const size_t mask = sp_page_size() - 1;
    if (SP_LIKELY(p && ((uintptr_t)p & mask) == 0 && (size & mask) == 0)) return true;
    sp_misuse(SP_ERR_INVALID_ARG, call, p, "range %p + %zu is not page-aligned (page %zu)", p, size,
              mask + 1);
    return false;
}

/* Whether every page of [p, p+size) is mapped, without changing any: msync(MS_ASYNC) fails
 * (ENOMEM) on a hole and does nothing to anonymous memory. mprotect and madvise change the
 * mapped part in front of a hole before they fail: checked first, a call on a range with a
 * hole fails having changed nothing. Reported under `call` (SP_ERR_OS). */
static sp_result range_mapped(const char *call, void *p, size_t size) {
    if (size == 0) return SP_OK;
    track_enter(); /* Valgrind takes msync for a read of the range: not here */
    int r = msync(p, size, MS_ASYNC), err = errno;
    track_leave();
    return SP_LIKELY(r == 0) ? SP_OK : os_fail(call, p, "msync (not all mapped)", size, err);
}

sp_result sp_vm_commit(void *p, size_t size) {
    if (SP_UNLIKELY(!range_valid("sp_vm_commit", p, size))) return SP_ERR_INVALID_ARG;
    sp_result m = range_mapped("sp_vm_commit", p, size);
    if (SP_UNLIKELY(m != SP_OK)) return m;
    if (SP_UNLIKELY(mprotect(p, size, PROT_READ | PROT_WRITE) != 0))
        return os_fail("sp_vm_commit", p, "mprotect(RW)", size, errno);
    return SP_OK;
}

sp_result sp_vm_decommit(void *p, size_t size) {
    if (SP_UNLIKELY(!range_valid("sp_vm_decommit", p, size))) return SP_ERR_INVALID_ARG;
    if (size == 0) return SP_OK;
    /* First make sure every page of the range is mapped (mprotect and madvise would change
     * the pages in front of a hole before failing). MADV_DONTNEED drops the pages (no RSS left
     * behind, unlike MADV_FREE) and mprotect makes the range inaccessible again; both keep the
     * mapping's flags (MAP_NORESERVE, the MADV_HUGEPAGE advice), so the range merges back with
     * its neighbours. Mapping fresh pages over it (MAP_FIXED) dropped the advice and left one
     * more mapping per decommitted range: that is kept for explicit huge pages (see
     * huge_maps), and for a range whose mprotect failed after its pages were dropped. */
    sp_result m = range_mapped("sp_vm_decommit", p, size);
    if (SP_UNLIKELY(m != SP_OK)) return m;
    if (!huge_map_has(p) && madvise(p, size, MADV_DONTNEED) == 0 &&
        mprotect(p, size, PROT_NONE) == 0) {
        track_fresh(p, size);
        return SP_OK;
    }
    void *r =
        mmap(p, size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (SP_UNLIKELY(r == MAP_FAILED))
        return os_fail("sp_vm_decommit", p, "mmap(FIXED)", size, errno);
    return SP_OK;
}

sp_result sp_vm_purge(void *p, size_t size) {
    if (SP_UNLIKELY(!range_valid("sp_vm_purge", p, size))) return SP_ERR_INVALID_ARG;
    sp_result m = range_mapped("sp_vm_purge", p, size);
    if (SP_UNLIKELY(m != SP_OK)) return m;
    if (size && SP_UNLIKELY(madvise(p, size, MADV_DONTNEED) != 0))
        return os_fail("sp_vm_purge", p, "madvise(DONTNEED)", size, errno);
    return SP_OK;
}

sp_result sp_vm_guard(void *p, size_t size) {
    if (SP_UNLIKELY(!range_valid("sp_vm_guard", p, size))) return SP_ERR_INVALID_ARG;
    sp_result m = range_mapped("sp_vm_guard", p, size);
    if (SP_UNLIKELY(m != SP_OK)) return m;
    if (SP_UNLIKELY(mprotect(p, size, PROT_NONE) != 0))
        return os_fail("sp_vm_guard", p, "mprotect(NONE)", size, errno);
    return SP_OK;
}

void sp_vm_release(void *p, size_t size) {
    if (!p) return;
    const size_t page = sp_page_size();
    if (SP_UNLIKELY(((uintptr_t)p & (page - 1)) != 0 || size == 0)) {
        sp_misuse(SP_ERR_INVALID_ARG, "sp_vm_release", p, "release of %p + %zu: not a reservation",
                  p, size);
        return;
    }
    size_t rounded = size_round(size, page), huge = huge_map_remove(p, rounded);
    size_t len = huge ? huge : rounded; /* a MAP_HUGETLB reservation: its recorded length */
    if (munmap(p, len) != 0) os_fail("sp_vm_release", p, "munmap", len, errno);
}

/* ---- CPU, clocks ----------------------------------------------------------------------- */

/* The calling thread's affinity mask (CPU_FREE it), its size in *bytes; NULL if it cannot be
 * read. Affinity can change at run time, so this is not cached. Cost: one system call (more
 * only on machines with over 1024 CPUs). */
static cpu_set_t *affinity_get(size_t *bytes) {
    for (size_t ncpu = 1024; ncpu <= (1u << 20); ncpu *= 2) {
        cpu_set_t *set = CPU_ALLOC(ncpu);
        if (!set) break;
        *bytes = CPU_ALLOC_SIZE(ncpu);
        CPU_ZERO_S(*bytes, set);
        if (sched_getaffinity(0, *bytes, set) == 0) return set;
        CPU_FREE(set);
        if (errno != EINVAL) break;
    }
    return NULL;
}

uint32_t sp_cpu_count(void) {
    size_t bytes;
    cpu_set_t *set = affinity_get(&bytes);
    if (set) {
        int n = CPU_COUNT_S(bytes, set);
        CPU_FREE(set);
        return n > 0 ? (uint32_t)n : 1;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (uint32_t)n : 1;
}

int sp_cpu_nth(uint32_t k) {
    size_t bytes;
    cpu_set_t *set = affinity_get(&bytes);
    if (!set) return SP_CPU_ANY;
    int n = CPU_COUNT_S(bytes, set), cpu = SP_CPU_ANY;
    if (n > 0)
        for (int c = 0, seen = 0; cpu == SP_CPU_ANY && (size_t)c < bytes * 8; c++)
            if (CPU_ISSET_S((size_t)c, bytes, set) && seen++ == (int)(k % (uint32_t)n)) cpu = c;
    CPU_FREE(set);
    return cpu;
}

uint64_t sp_memory_size(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
}

size_t sp_address_budget(void) {
    struct rlimit lim;
    if (getrlimit(RLIMIT_AS, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return SIZE_MAX;
    /* System calls only, no stdio: the thread caches ask from inside malloc's first call. */
    char text[64];
    int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, text, sizeof text - 1) : -1;
    if (fd >= 0) close(fd);
    size_t pages = 0;
    ssize_t i = 0;
    for (; i < n && text[i] >= '0' && text[i] <= '9'; i++)
        pages = pages * 10 + (size_t)(text[i] - '0');
    if (i == 0) return SIZE_MAX; /* unreadable */
    size_t used = pages * sp_page_size();
    return lim.rlim_cur > used ? (size_t)(lim.rlim_cur - used) / 2 : 0;
}

uint64_t sp_time_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#if defined(__x86_64__)
#define TICKS_ARE_CLOCK 0
uint64_t sp_ticks(void) {
    return __builtin_ia32_rdtsc();
}
#elif defined(__aarch64__)
#define TICKS_ARE_CLOCK 0
uint64_t sp_ticks(void) {
    uint64_t v;
    __asm__ __volatile__("isb\n\tmrs %0, cntvct_el0" : "=r"(v)::"memory");
    return v;
}
#else
#define TICKS_ARE_CLOCK 1
uint64_t sp_ticks(void) {
    return sp_time_ns();
}
#endif

/* Nanoseconds per tick, written once under pthread_once and read-only afterwards. */
static double ns_per_tick;
static pthread_once_t ns_per_tick_once = PTHREAD_ONCE_INIT;

/* Measure the tick rate against CLOCK_MONOTONIC over ~10 ms (one sleep). */
static void ticks_calibrate(void) {
    if (TICKS_ARE_CLOCK) {
        ns_per_tick = 1.0;
        return;
    }
    uint64_t t0 = sp_time_ns(), k0 = sp_ticks();
    struct timespec d = {0, 10 * 1000 * 1000};
    while (nanosleep(&d, &d) != 0 && errno == EINTR) {
    }
    uint64_t t1 = sp_time_ns(), k1 = sp_ticks();
    ns_per_tick = k1 > k0 ? (double)(t1 - t0) / (double)(k1 - k0) : 1.0;
}

double sp_ticks_to_ns(uint64_t ticks) {
    pthread_once(&ns_per_tick_once, ticks_calibrate);
    return (double)ticks * ns_per_tick;
}

/* ---- threads --------------------------------------------------------------------------- */

/* What a new thread needs before it runs the caller's function; freed by the thread. */
typedef struct thread_start {
    sp_thread_fn fn;
    void *arg;
    char name[16]; /* 15 chars + NUL: the kernel's limit */
} thread_start;

/* Names itself first, so fn (and anything it calls) already sees the name. */
static void *thread_main(void *raw) {
    thread_start st = *(thread_start *)raw;
    free(raw);
    if (st.name[0]) sp_thread_set_name(st.name);
    return st.fn(st.arg);
}

/* *out: a mask of the one CPU cpu (CPU_FREE it), *bytes its size. A CPU out of range is
 * misuse, reported under call. */
static sp_result cpu_mask_one(int cpu, cpu_set_t **out, size_t *bytes, const char *call,
                              const void *addr) {
    if (SP_UNLIKELY(cpu < 0 || cpu >= SP_CPU_MAX))
        return sp_misuse(SP_ERR_INVALID_ARG, call, addr, "CPU %d (0 .. %d)", cpu, SP_CPU_MAX - 1);
    if (SP_UNLIKELY(!(*out = CPU_ALLOC((size_t)cpu + 1)))) {
        sp_log(SP_LOG_WARN, SP_ERR_NOMEM, call, addr, "no memory for a CPU mask");
        return SP_ERR_NOMEM;
    }
    *bytes = CPU_ALLOC_SIZE((size_t)cpu + 1);
    CPU_ZERO_S(*bytes, *out);
    CPU_SET_S((size_t)cpu, *bytes, *out);
    return SP_OK;
}

/* os_fail for `what` done for CPU cpu (SP_CPU_ANY: none named). */
static sp_result cpu_fail(const char *call, const void *addr, const char *what, int cpu, int err) {
    if (cpu == SP_CPU_ANY) return os_fail(call, addr, what, 0, err);
    char on[64];
    snprintf(on, sizeof on, "%s (CPU %d)", what, cpu);
    return os_fail(call, addr, on, 0, err);
}

static sp_result thread_start_on(sp_thread *out, sp_thread_fn fn, void *arg, const char *name,
                                 int cpu, const char *call) {
    if (SP_UNLIKELY(!out || !fn))
        return sp_misuse(SP_ERR_INVALID_ARG, call, out, "NULL %s", out ? "function" : "output");
    size_t bytes = 0;
    cpu_set_t *mask = NULL;
    sp_result r = cpu == SP_CPU_ANY ? SP_OK : cpu_mask_one(cpu, &mask, &bytes, call, NULL);
    if (SP_UNLIKELY(r != SP_OK)) return r;
    thread_start *st = malloc(sizeof *st);
    if (SP_UNLIKELY(!st)) {
        CPU_FREE(mask);
        sp_log(SP_LOG_WARN, SP_ERR_NOMEM, call, NULL, "no memory for a start record");
        return SP_ERR_NOMEM;
    }
    st->fn = fn;
    st->arg = arg;
    st->name[0] = 0;
    if (name) snprintf(st->name, sizeof st->name, "%s", name);
    /* The mask goes in the attributes: the thread runs its first instruction on that CPU (a
     * pin after the start would leave its first steps, and whatever it touches then, on any
     * CPU). */
    pthread_attr_t attr;
    const char *what = "pthread_attr_init";
    int err = pthread_attr_init(&attr);
    pthread_t t;
    if (!err) {
        if (mask) {
            what = "pthread_attr_setaffinity_np";
            err = pthread_attr_setaffinity_np(&attr, bytes, mask);
        }
        if (!err) {
            what = "pthread_create";
            err = pthread_create(&t, &attr, thread_main, st);
        }
        pthread_attr_destroy(&attr);
    }
    CPU_FREE(mask);
    if (SP_UNLIKELY(err != 0)) {
        free(st);
        return cpu_fail(call, NULL, what, cpu, err);
    }
    out->os = (uintptr_t)t;
    return SP_OK;
}

sp_result sp_thread_start(sp_thread *out, sp_thread_fn fn, void *arg, const char *name) {
    return thread_start_on(out, fn, arg, name, SP_CPU_ANY, "sp_thread_start");
}

sp_result sp_thread_start_on(sp_thread *out, sp_thread_fn fn, void *arg, const char *name,
                             int cpu) {
    return thread_start_on(out, fn, arg, name, cpu, "sp_thread_start_on");
}

void *sp_thread_join(sp_thread t) {
    void *ret = NULL;
    int err = pthread_join((pthread_t)t.os, &ret);
    if (SP_UNLIKELY(err != 0)) {
        char buf[128];
        sp_log(SP_LOG_WARN, SP_ERR_OS, "sp_thread_join", (const void *)t.os,
               "pthread_join failed: %s", errno_text(err, buf, sizeof buf));
        return NULL;
    }
    return ret;
}

sp_result sp_thread_pin(sp_thread t, int cpu) {
    if (cpu == SP_CPU_ANY) return SP_OK; /* as sp_thread_start_on: no CPU in particular */
    size_t bytes = 0;
    cpu_set_t *set = NULL;
    sp_result r = cpu_mask_one(cpu, &set, &bytes, "sp_thread_pin", (const void *)t.os);
    if (SP_UNLIKELY(r != SP_OK)) return r;
    int err = pthread_setaffinity_np((pthread_t)t.os, bytes, set);
    CPU_FREE(set);
    return SP_UNLIKELY(err != 0)
               ? cpu_fail("sp_thread_pin", (const void *)t.os, "pthread_setaffinity_np", cpu, err)
               : SP_OK;
}

sp_thread sp_thread_self(void) {
    return (sp_thread){(uintptr_t)pthread_self()};
}

void sp_thread_set_name(const char *name) {
    if (!name) return;
    char buf[16];
    snprintf(buf, sizeof buf, "%s", name);
    pthread_setname_np(pthread_self(), buf); /* best effort: a name is only a debugging aid */
}

uint64_t sp_thread_os_id(void) {
    return (uint64_t)syscall(SYS_gettid);
}

void sp_thread_yield(void) {
    sched_yield();
}

/* ---- futex ----------------------------------------------------------------------------- */

void sp_futex_wait(uint32_t *addr, uint32_t expected, uint64_t timeout_ns) {
    struct timespec ts, *tsp = NULL;
    if (timeout_ns) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000u);
        ts.tv_nsec = (long)(timeout_ns % 1000000000u);
        tsp = &ts;
    }
    /* EAGAIN (value differs), EINTR and ETIMEDOUT all mean "return": callers re-check. errno
     * is left as it was: a lock taken inside free() must not change it (POSIX). */
    int saved = errno;
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, expected, tsp, NULL, 0);
    errno = saved;
}

void sp_futex_wake(uint32_t *addr, int32_t count) {
    int saved = errno;
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
    errno = saved;
}

/* ---- mutex ----------------------------------------------------------------------------- */

/* state: 0 unlocked, 1 locked with no sleeper, 2 locked and someone may sleep in the futex.
 * Invariant: a thread only sleeps after writing 2, so an unlock that reads 2 must wake one.
 * Acquire on every transition into "locked by me", release on unlock. */
enum { MUTEX_FREE = 0, MUTEX_LOCKED = 1, MUTEX_CONTENDED = 2 };

/* Plain-load spins before sleeping: ~100-200 ns on these machines, about one cross-core
 * handoff. No PAUSE: the hypervisor traps it (a PAUSE spin measured 450-1,100 ns per
 * cross-core handoff on these VMs against 130-180 ns for a plain one). */
enum { MUTEX_SPINS = 128 };

SP_NOINLINE static void mutex_lock_slow(sp_mutex *m) {
    for (int i = 0; i < MUTEX_SPINS; i++) {
        uint32_t s = __atomic_load_n(&m->state, __ATOMIC_RELAXED);
        if (s == MUTEX_FREE) {
            uint32_t expect = MUTEX_FREE;
            if (__atomic_compare_exchange_n(&m->state, &expect, MUTEX_LOCKED, false,
                                            __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
                return;
        } else if (s == MUTEX_CONTENDED) {
            break; /* others already sleep: queue behind them rather than burn cycles */
        }
    }
    /* Taking the lock with 2 (not 1) is conservative: we cannot know no one else sleeps. */
    while (__atomic_exchange_n(&m->state, MUTEX_CONTENDED, __ATOMIC_ACQUIRE) != MUTEX_FREE)
        sp_futex_wait(&m->state, MUTEX_CONTENDED, 0);
}

void sp_mutex_lock(sp_mutex *m) {
    uint32_t expect = MUTEX_FREE;
    if (SP_LIKELY(__atomic_compare_exchange_n(&m->state, &expect, MUTEX_LOCKED, false,
                                              __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)))
        return;
    mutex_lock_slow(m);
}

bool sp_mutex_trylock(sp_mutex *m) {
    uint32_t expect = MUTEX_FREE;
    return __atomic_compare_exchange_n(&m->state, &expect, MUTEX_LOCKED, false, __ATOMIC_ACQUIRE,
                                       __ATOMIC_RELAXED);
}

void sp_mutex_unlock(sp_mutex *m) {
    uint32_t prev = __atomic_exchange_n(&m->state, MUTEX_FREE, __ATOMIC_RELEASE);
    if (SP_UNLIKELY(prev != MUTEX_LOCKED)) {
        if (prev == MUTEX_CONTENDED)
            sp_futex_wake(&m->state, 1);
        else
            sp_misuse(SP_ERR_INVALID_ARG, "sp_mutex_unlock", m, "unlock of an unlocked mutex");
    }
}
