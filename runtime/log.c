/* The logger, the misuse policy and the fatal path (see sp_log.h). */
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "sp_internal.h"

/* A (function, user) pair under a seqlock: setters are rare and serialise on the odd
 * sequence; readers retry until they read both fields within one even sequence, so they get
 * either the old or the new pair, never a mix, however many setters run. Function pointers
 * are stored as integers (POSIX guarantees the round trip); 0 means "the default". */
typedef struct sink {
    atomic_uint seq;
    _Atomic(uintptr_t) fn;
    _Atomic(uintptr_t) user;
} sink;

static sink log_sink, fatal_sink;

static atomic_bool misuse_fatal_flag = SP_DEBUG >= 1;

const char *sp_result_name(sp_result r) {
    switch (r) {
    case SP_OK: return "SP_OK";
    case SP_ERR_NOMEM: return "SP_ERR_NOMEM";
    case SP_ERR_OS: return "SP_ERR_OS";
    case SP_ERR_INVALID_ARG: return "SP_ERR_INVALID_ARG";
    case SP_ERR_OVERFLOW: return "SP_ERR_OVERFLOW";
    case SP_ERR_BAD_ALIGNMENT: return "SP_ERR_BAD_ALIGNMENT";
    case SP_ERR_DOUBLE_FREE: return "SP_ERR_DOUBLE_FREE";
    case SP_ERR_FOREIGN_POINTER: return "SP_ERR_FOREIGN_POINTER";
    case SP_ERR_INVALID_POINTER: return "SP_ERR_INVALID_POINTER";
    case SP_ERR_TOO_SMALL: return "SP_ERR_TOO_SMALL";
    case SP_ERR_LIMIT: return "SP_ERR_LIMIT";
    case SP_ERR_CORRUPT: return "SP_ERR_CORRUPT";
    case SP_ERR_SHUTDOWN: return "SP_ERR_SHUTDOWN";
    case SP_ERR_STALLED: return "SP_ERR_STALLED";
    case SP_ERR_STALE_HANDLE: return "SP_ERR_STALE_HANDLE";
    case SP_ERR_PINNED: return "SP_ERR_PINNED";
    case SP_ERR_NOT_PINNED: return "SP_ERR_NOT_PINNED";
    case SP_ERR_BUSY: return "SP_ERR_BUSY";
    }
    return "SP_ERR_UNKNOWN";
}

static const char *level_name(sp_log_level l) {
    static const char *names[] = {"debug", "info", "warn", "error", "fatal"};
    return (unsigned)l < SP_ARRAY_LEN(names) ? names[l] : "?";
}

/* One line, formatted here and written with one write(2): no stdio lock, and little stack
 * (fprintf to the unbuffered stderr put an 8 KiB buffer on the stack, more than a small fiber
 * stack had left). A line longer than the buffer is cut. */
static void log_stderr(void *user, const sp_log_record *rec) {
    (void)user;
    int saved = errno; /* a report from inside free() leaves errno as it was */
    char line[768];
    int n = snprintf(line, sizeof line, "spindle %s: %s: %s%s%p: %s\n", level_name(rec->level),
                     sp_result_name(rec->id), rec->call ? rec->call : "", rec->call ? " at " : "",
                     rec->addr, rec->message);
    size_t len = n < 0 ? 0 : (size_t)n < sizeof line ? (size_t)n : sizeof line - 1;
    if (len == sizeof line - 1) line[len - 1] = '\n'; /* cut (or exactly full: ends so anyway) */
    for (size_t off = 0; off < len;) {
        ssize_t w = write(STDERR_FILENO, line + off, len - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        off += (size_t)w;
    }
    errno = saved;
}

static void sink_set(sink *s, uintptr_t fn, uintptr_t user) {
    unsigned seq = atomic_load_explicit(&s->seq, memory_order_relaxed);
    while ((seq & 1) || !atomic_compare_exchange_weak_explicit(
                            &s->seq, &seq, seq + 1, memory_order_relaxed, memory_order_relaxed))
        seq = atomic_load_explicit(&s->seq, memory_order_relaxed);
    atomic_thread_fence(memory_order_release); /* the odd sequence before the new fields */
    atomic_store_explicit(&s->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&s->user, user, memory_order_relaxed);
    atomic_store_explicit(&s->seq, seq + 2, memory_order_release);
}

static void sink_get(sink *s, uintptr_t *fn, uintptr_t *user) {
    for (;;) {
        unsigned seq = atomic_load_explicit(&s->seq, memory_order_acquire);
        if (seq & 1) continue;
        *fn = atomic_load_explicit(&s->fn, memory_order_relaxed);
        *user = atomic_load_explicit(&s->user, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire); /* the fields before the re-check */
        if (atomic_load_explicit(&s->seq, memory_order_relaxed) == seq) return;
    }
}

void sp_log_set(sp_log_fn fn, void *user) {
    sink_set(&log_sink, (uintptr_t)fn, (uintptr_t)user);
}

void sp_fatal_set(sp_fatal_fn fn, void *user) {
    sink_set(&fatal_sink, (uintptr_t)fn, (uintptr_t)user);
}

/* Set while this thread runs the installed logger: a record the logger itself causes (it logs
 * through spindle, or a call it makes fails and reports) goes to stderr, not back into it
 * (that recursed until the stack ran out). */
static _Thread_local bool in_logger;

/* A record whose message is formatted already, to the installed logger (or stderr). */
static void log_emit(sp_log_level level, sp_result id, const char *call, const void *addr,
                     const char *msg) {
    sp_log_record rec = {level, id, call, addr, msg};
    uintptr_t fn, user;
    sink_get(&log_sink, &fn, &user);
    if (fn && !in_logger) {
        in_logger = true;
        ((sp_log_fn)fn)((void *)user, &rec);
        in_logger = false;
    } else {
        log_stderr(NULL, &rec);
    }
}

void sp_log(sp_log_level level, sp_result id, const char *call, const void *addr, const char *fmt,
            ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    log_emit(level, id, call, addr, msg);
}

static _Noreturn void die_with(sp_log_record *rec) {
    uintptr_t fn, user;
    sink_get(&fatal_sink, &fn, &user);
    if (fn) ((sp_fatal_fn)fn)((void *)user, rec);
    abort();
}

/* Format once, log at `level`, and die (as a FATAL record) if `fatal`. */
static void report_v(sp_log_level level, sp_result id, const char *call, const void *addr,
                     bool fatal, const char *fmt, va_list ap) {
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    log_emit(level, id, call, addr, msg);
    if (fatal) {
        sp_log_record rec = {SP_LOG_FATAL, id, call, addr, msg};
        die_with(&rec);
    }
}

_Noreturn void sp_die(sp_result id, const char *call, const void *addr, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report_v(SP_LOG_FATAL, id, call, addr, true, fmt, ap);
    va_end(ap);
    abort(); /* not reached: report_v died */
}

sp_result sp_misuse(sp_result id, const char *call, const void *addr, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report_v(SP_LOG_ERROR, id, call, addr,
             atomic_load_explicit(&misuse_fatal_flag, memory_order_relaxed), fmt, ap);
    va_end(ap);
    return id;
}

bool sp_null_arg(const char *call, const void *addr, const char *what) {
    sp_misuse(SP_ERR_INVALID_ARG, call, addr, "NULL %s", what);
    return true;
}

void sp_misuse_set_fatal(bool fatal) {
    atomic_store(&misuse_fatal_flag, fatal);
}
bool sp_misuse_fatal(void) {
    return atomic_load(&misuse_fatal_flag);
}
