/* The logger, the misuse policy and the fatal path (see sp_log.h). */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "sp_internal.h"

typedef struct sink {
    sp_log_fn fn;
    void *user;
} sink;

static void log_stderr(void *user, const sp_log_record *rec);

static const sink default_log = {log_stderr, NULL};
static sink log_slots[2];
static _Atomic(const sink *) log_current = &default_log;
static atomic_uint log_slot_next;

static sink fatal_slots[2];
static _Atomic(const sink *) fatal_current;
static atomic_uint fatal_slot_next;

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
    }
    return "SP_ERR_UNKNOWN";
}

static const char *level_name(sp_log_level l) {
    static const char *names[] = {"debug", "info", "warn", "error", "fatal"};
    return (unsigned)l < SP_ARRAY_LEN(names) ? names[l] : "?";
}

static void log_stderr(void *user, const sp_log_record *rec) {
    (void)user;
    fprintf(stderr, "spindle %s: %s: %s%s%p: %s\n", level_name(rec->level), sp_result_name(rec->id),
            rec->call ? rec->call : "", rec->call ? " at " : "", rec->addr, rec->message);
}

/* Setters publish a fully written slot through one atomic pointer: a concurrent reader sees
 * either the old or the new (fn, user) pair, never a mix. Two slots alternate, so a reader
 * still holding the previous one keeps reading stable data unless setters race each other. */
static void sink_publish(_Atomic(const sink *) *cur, sink *slots, atomic_uint *next, sp_log_fn fn,
                         void *user, const sink *fallback) {
    if (!fn) {
        atomic_store_explicit(cur, fallback, memory_order_release);
        return;
    }
    sink *s = &slots[atomic_fetch_add(next, 1) & 1];
    s->fn = fn;
    s->user = user;
    atomic_store_explicit(cur, s, memory_order_release);
}

void sp_log_set(sp_log_fn fn, void *user) {
    sink_publish(&log_current, log_slots, &log_slot_next, fn, user, &default_log);
}

void sp_fatal_set(sp_fatal_fn fn, void *user) {
    sink_publish(&fatal_current, fatal_slots, &fatal_slot_next, (sp_log_fn)fn, user, NULL);
}

static void log_emit(sp_log_level level, sp_result id, const char *call, const void *addr,
                     const char *fmt, va_list ap, sp_log_record *out) {
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    sp_log_record rec = {level, id, call, addr, msg};
    const sink *s = atomic_load_explicit(&log_current, memory_order_acquire);
    s->fn(s->user, &rec);
    if (out) *out = rec;
}

void sp_log(sp_log_level level, sp_result id, const char *call, const void *addr, const char *fmt,
            ...) {
    va_list ap;
    va_start(ap, fmt);
    log_emit(level, id, call, addr, fmt, ap, NULL);
    va_end(ap);
}

static _Noreturn void die_with(sp_log_record *rec) {
    const sink *f = atomic_load_explicit(&fatal_current, memory_order_acquire);
    if (f) ((sp_fatal_fn)f->fn)(f->user, rec);
    abort();
}

_Noreturn void sp_die(sp_result id, const char *call, const void *addr, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sp_log(SP_LOG_FATAL, id, call, addr, "%s", msg);
    sp_log_record rec = {SP_LOG_FATAL, id, call, addr, msg};
    die_with(&rec);
}

sp_result sp_misuse(sp_result id, const char *call, const void *addr, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sp_log(SP_LOG_ERROR, id, call, addr, "%s", msg);
    if (atomic_load_explicit(&misuse_fatal_flag, memory_order_relaxed)) {
        sp_log_record rec = {SP_LOG_FATAL, id, call, addr, msg};
        die_with(&rec);
    }
    return id;
}

void sp_misuse_set_fatal(bool fatal) {
    atomic_store(&misuse_fatal_flag, fatal);
}
bool sp_misuse_fatal(void) {
    return atomic_load(&misuse_fatal_flag);
}
