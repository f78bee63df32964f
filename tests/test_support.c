/* Test support (see test_support.h): the capturing logger, the fork-based death helper, a
 * seeded RNG and sanitizer detection. Linked into every test as a small static library. */
#include "test_support.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sp_tcache.h"
#include "track.h"

#ifndef SP_DEBUG
#define SP_DEBUG 0
#endif

ts_log ts_logged;

/* The logger may run on any thread; records are copied under this lock. Readers (the test's
 * main thread) look at ts_logged after the logging call has returned. */
static pthread_mutex_t logged_lock = PTHREAD_MUTEX_INITIALIZER;

static void log_capture(void *user, const sp_log_record *rec) {
    (void)user;
    pthread_mutex_lock(&logged_lock);
    ts_logged.count++;
    ts_logged.last_level = rec->level;
    ts_logged.last_id = rec->id;
    ts_logged.last_addr = rec->addr;
    snprintf(ts_logged.last_call, sizeof ts_logged.last_call, "%s", rec->call ? rec->call : "");
    snprintf(ts_logged.last_message, sizeof ts_logged.last_message, "%s",
             rec->message ? rec->message : "");
    pthread_mutex_unlock(&logged_lock);
}

void ts_log_reset(void) {
    pthread_mutex_lock(&logged_lock);
    memset(&ts_logged, 0, sizeof ts_logged);
    pthread_mutex_unlock(&logged_lock);
}

void ts_log_capture(void) {
    ts_log_reset();
    sp_log_set(log_capture, NULL);
    sp_misuse_set_fatal(false);
}

void ts_log_release(void) {
    sp_log_set(NULL, NULL);
    sp_misuse_set_fatal(SP_DEBUG >= 1);
}

/* ---- a call against a held lock ---------------------------------------------------------- */

typedef struct held_call {
    void (*fn)(void *);
    void *arg;
    atomic_int done;
} held_call;

static void *held_call_run(void *p) {
    held_call *h = p;
    h->fn(h->arg);
    atomic_store(&h->done, 1);
    return NULL;
}

bool ts_done_while_held(sp_mutex *lock, void (*fn)(void *), void *arg) {
    held_call h = {.fn = fn, .arg = arg};
    sp_mutex_lock(lock);
    sp_thread t;
    if (sp_thread_start(&t, held_call_run, &h, "ts-held") != SP_OK) {
        sp_mutex_unlock(lock);
        return false;
    }
    for (uint64_t t0 = sp_time_ns(); !atomic_load(&h.done) && sp_time_ns() - t0 < 10000000000u;)
        sp_thread_yield();
    bool done = atomic_load(&h.done);
    sp_mutex_unlock(lock);
    sp_thread_join(t);
    return done;
}

/* ---- death tests ----------------------------------------------------------------------- */

void ts_pipe_drain(int fd, char *buf, size_t cap) {
    size_t len = 0;
    char sink[4096];
    for (;;) {
        char *dst = len + 1 < cap ? buf + len : sink;
        size_t room = len + 1 < cap ? cap - 1 - len : sizeof sink;
        ssize_t n = read(fd, dst, room);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        if (dst == buf + len) len += (size_t)n;
    }
    buf[len] = 0;
}

/* Print captured child output as TAP diagnostics, one "# " line per line. */
static void text_diag(const char *text) {
    const char *line = text;
    while (*line) {
        const char *end = strchr(line, '\n');
        int n = end ? (int)(end - line) : (int)strlen(line);
        printf("#   | %.*s\n", n, line);
        line += n + (end ? 1 : 0);
    }
    fflush(stdout);
}

int ts_child(void (*fn)(void *), void *arg, char *text, size_t cap) {
    int fds[2];
    if (pipe(fds) != 0) {
        diag("ts_child: pipe failed");
        return -1;
    }
    fflush(NULL); /* the child must not repeat buffered output */
    pid_t pid = fork();
    if (pid < 0) {
        diag("ts_child: fork failed");
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core); /* an expected abort should not leave a core file */
        close(fds[0]);
        dup2(fds[1], STDERR_FILENO);
        close(fds[1]);
        sp_log_set(NULL, NULL); /* messages must reach the captured stderr */
        sp_fatal_set(NULL, NULL);
        sp_misuse_set_fatal(true);
        fn(arg);
        _exit(0);
    }
    close(fds[1]);
    ts_pipe_drain(fds[0], text, cap);
    close(fds[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) {
            diag("ts_child: waitpid failed");
            return -1;
        }
    }
    return status;
}

bool ts_dies(void (*fn)(void *), void *arg, const char *needle1, const char *needle2) {
    static char text[16384];
    int status = ts_child(fn, arg, text, sizeof text);
    if (status == -1) return false;
    bool died = WIFSIGNALED(status);
    bool found = (!needle1 || strstr(text, needle1)) && (!needle2 || strstr(text, needle2));
    if (!died || !found) {
        if (died)
            diag("ts_dies: child died by signal %d", WTERMSIG(status));
        else if (WIFEXITED(status))
            diag("ts_dies: child exited with %d", WEXITSTATUS(status));
        if (!found)
            diag("ts_dies: stderr lacks \"%s\" / \"%s\"", needle1 ? needle1 : "",
                 needle2 ? needle2 : "");
        diag("ts_dies: child stderr:");
        text_diag(text);
    }
    return died && found;
}

/* ---- memory tools ---------------------------------------------------------------------- */

bool ts_tool_reports(const char *self, void (*bug)(void), const char *name, const char *kind) {
    int fds[2];
    if (pipe(fds) != 0) return false;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        if (TRACK_ASAN) {
            bug();
            _exit(0);
        }
        execlp("valgrind", "valgrind", "-q", "--error-exitcode=42", self, "--bug", name,
               (char *)NULL);
        _exit(127);
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
    bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    bool seen = strstr(out, TRACK_ASAN ? "AddressSanitizer" : "Invalid") && strstr(out, kind);
    if (!(failed && seen)) diag("  child status %d, output: %.300s", status, out);
    return failed && seen;
}

void ts_fill(uint8_t *p, size_t n, uint8_t v) {
    memset(p, v, n);
}

bool ts_filled(const uint8_t *p, size_t n, uint8_t v) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) return false;
    return true;
}

/* ---- RNG ------------------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

void ts_rng_seed(ts_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

uint64_t ts_rng_next(ts_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint64_t ts_rng_range(ts_rng *r, uint64_t lo, uint64_t hi) {
    if (lo > hi) {
        uint64_t t = lo;
        lo = hi;
        hi = t;
    }
    uint64_t span = hi - lo + 1;
    if (span == 0) return ts_rng_next(r); /* the whole 64-bit range */
    /* Reject the 2^64 mod span lowest values: what is left is a whole number of spans. */
    uint64_t reject = -span % span;
    for (;;) {
        uint64_t x = ts_rng_next(r);
        if (x >= reject) return lo + x % span;
    }
}

/* ---- sanitizers ------------------------------------------------------------------------ */

#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define TS_HAVE_VALGRIND 1
#endif
#endif

/* UBSan defines no macro; its runtime does define this handler. Weak: NULL without UBSan. */
extern void __ubsan_handle_add_overflow(void) __attribute__((weak));

bool ts_sanitized(void) {
#if SP_ASAN || SP_TSAN || SP_HAS_FEATURE(memory_sanitizer)
    return true;
#else
    if (__ubsan_handle_add_overflow) return true;
#if defined(TS_HAVE_VALGRIND)
    if (RUNNING_ON_VALGRIND) return true;
#endif
    return false;
#endif
}

bool ts_limit_address_room(size_t room) {
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long pages = 0;
    bool read = f && fscanf(f, "%lu", &pages) == 1;
    if (f) fclose(f);
    rlim_t at = (rlim_t)(pages * sp_page_size() + room);
    struct rlimit lim = {at, at};
    return read && setrlimit(RLIMIT_AS, &lim) == 0;
}

uint64_t ts_scaled(uint64_t n, uint64_t div) {
    if (!ts_sanitized() || div <= 1) return n;
    uint64_t s = n / div;
    return s ? s : (n ? 1 : 0);
}

/* ---- memory-tool tests ----------------------------------------------------------------- */

bool ts_tool_watching(void) {
    if (TRACK_ASAN) return true;
    return TRACK_VALGRIND && system("valgrind --version >/dev/null 2>&1") == 0;
}

bool ts_tool_asan(void) {
    return TRACK_ASAN;
}

bool ts_bug_child(int argc, char **argv, const ts_bug *bugs, size_t n) {
    if (argc != 3 || strcmp(argv[1], "--bug") != 0) return false;
    for (size_t i = 0; i < n; i++)
        if (strcmp(argv[2], bugs[i].name) == 0) bugs[i].run();
    return true;
}

/* ---- runtime ----------------------------------------------------------------------------- */

/* Lets its partner go after a moment, from wherever it runs. */
static void ts_signal_job(void *arg) {
    ts_pair *p = arg;
    for (volatile int i = 0; i < 2000; i++) {
    }
    sp_counter_sub(p->go, 1);
}

int ts_migration_rounds(sp_jobs *s, void (*waiter)(void *), int min_rounds, int max_rounds,
                        const _Atomic int *migrations, int want, void (*between)(void *),
                        void *user) {
    sp_counter *round = sp_counter_create(s, "round");
    ts_pair pairs[TS_PAIRS];
    sp_job_desc waiters[TS_PAIRS], signals[TS_PAIRS];
    for (int i = 0; i < TS_PAIRS; i++) {
        pairs[i].go = sp_counter_create(s, "go");
        waiters[i] = (sp_job_desc){.fn = waiter, .arg = &pairs[i], .name = "waiter"};
        signals[i] = (sp_job_desc){.fn = ts_signal_job, .arg = &pairs[i], .name = "signal"};
    }
    int rounds = 0;
    bool good = round != NULL;
    uint64_t t0 = sp_time_ns(), patience = 60 * UINT64_C(1000000000);
    while (good &&
           (rounds < min_rounds || (atomic_load(migrations) < want &&
                                    (rounds < max_rounds || sp_time_ns() - t0 < patience)))) {
        for (int i = 0; i < TS_PAIRS; i++) sp_counter_add(pairs[i].go, 1);
        good &= sp_jobs_submit(s, waiters, TS_PAIRS, round) == SP_OK;
        good &= sp_jobs_submit(s, signals, TS_PAIRS, round) == SP_OK;
        good &= sp_counter_wait(round, 0) == SP_OK;
        if (between) between(user);
        rounds++;
    }
    for (int i = 0; i < TS_PAIRS; i++) sp_counter_destroy(pairs[i].go);
    sp_counter_destroy(round);
    return good ? rounds : -1;
}

sp_desc ts_small_desc(uint32_t workers, size_t handle_mib) {
    const size_t mib = (size_t)1 << 20;
    sp_desc d = {0};
    d.heap_size = 64 * mib;
    d.frame_size = 2 * mib;
    d.handle_size = handle_mib * mib;
    d.persistent_size = 2 * mib;
    d.jobs.workers = workers;
    d.jobs.no_workers = workers == 0;
    return d;
}

int ts_fill_spans(size_t size, void **b, int max, int spans, int *first) {
    int n = 0, begun = 0;
    for (uintptr_t cur = 0; n < max && begun < spans; n++) {
        b[n] = sp_tcache_alloc(size);
        uintptr_t base = (uintptr_t)b[n] & ~(uintptr_t)(SP_TCACHE_SPAN - 1);
        if (base != cur) first[begun++] = n;
        cur = base;
    }
    for (int i = begun; i <= spans; i++) first[i] = n; /* max ran out: the rest empty */
    return n;
}

void ts_cpu_read(ts_cpu *r) {
    CPU_ZERO(&r->mask);
    r->count = sched_getaffinity(0, sizeof r->mask, &r->mask) == 0 ? CPU_COUNT(&r->mask) : -1;
    r->cpu = sched_getcpu();
}

static int span_cmp(const void *x, const void *y) {
    const ts_span *a = x, *b = y;
    return a->p < b->p ? -1 : a->p > b->p;
}

int ts_overlaps(ts_span *s, size_t n) {
    qsort(s, n, sizeof s[0], span_cmp);
    int overlaps = 0;
    for (size_t i = 1; i < n; i++) overlaps += s[i - 1].p + s[i - 1].n > s[i].p;
    return overlaps;
}

bool ts_cpu_only(const ts_cpu *r, int cpu) {
    return r->count == 1 && CPU_ISSET(cpu, &r->mask) && r->cpu == cpu;
}
