/* spindle logging, error ids and the fatal path.
 *
 * Every message the library emits goes through one logger (default: stderr) as an
 * enumerated id, so tests and tools can check exactly what was reported. The library never
 * prints by itself and keeps no errno-style last error (a fiber may resume on another thread).
 *
 * Three classes of trouble:
 *   misuse    a bug in the caller (double free, foreign pointer, bad alignment). Reported with
 *             the call and the address. If sp_misuse_fatal() is true (default: SP_DEBUG >= 1)
 *             the process then dies through the fatal handler; otherwise the call returns its
 *             documented failure value and leaves state intact.
 *   resource  out of memory, OS refusals: a failure value, logged at SP_LOG_WARN at most.
 *   corrupt   internal invariants broken: sp_die(), which never returns.
 *
 * Concurrency: sp_log/sp_die/sp_misuse may be called from any thread. The setters may be
 * called at any time; a message racing a setter goes to either the old or the new logger.
 */
#ifndef SP_LOG_H
#define SP_LOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Results: 0 is success, failures are negative. The same ids name logged messages. */
typedef enum sp_result {
    SP_OK = 0,
    SP_ERR_NOMEM = -1,           /* resource: out of memory */
    SP_ERR_OS = -2,              /* resource: the OS refused (mmap, thread creation, ...) */
    SP_ERR_INVALID_ARG = -3,     /* misuse: an argument out of its documented range */
    SP_ERR_OVERFLOW = -4,        /* a size computation would overflow */
    SP_ERR_BAD_ALIGNMENT = -5,   /* misuse: alignment not a power of two, or too large */
    SP_ERR_DOUBLE_FREE = -6,     /* misuse: block already free */
    SP_ERR_FOREIGN_POINTER = -7, /* misuse: pointer not inside any memory this allocator owns */
    SP_ERR_INVALID_POINTER = -8, /* misuse: inside owned memory but not a live block start
                                    (interior or misaligned pointer) */
    SP_ERR_TOO_SMALL = -9,       /* a pool or buffer too small to be used */
    SP_ERR_LIMIT = -10,          /* a fixed table is full (pools, handles, ...) */
    SP_ERR_CORRUPT = -11,        /* internal: metadata check failed */
    SP_ERR_SHUTDOWN = -12,       /* the subsystem is shut down or not initialised */
    SP_ERR_STALLED = -13,        /* a wait or deferred job that nothing can complete */
    SP_ERR_STALE_HANDLE = -14,   /* misuse: a handle whose object was freed, or forged */
    SP_ERR_PINNED = -15,         /* misuse: freeing a block that is still pinned */
    SP_ERR_NOT_PINNED = -16,     /* misuse: unpin without a matching pin */
    SP_ERR_BUSY = -17,           /* misuse: a call not allowed now (compaction while jobs run,
                                    or from inside a compaction callback) */
} sp_result;

/* A stable name for a result ("SP_ERR_DOUBLE_FREE"), never NULL. */
const char *sp_result_name(sp_result r);

typedef enum sp_log_level {
    SP_LOG_DEBUG,
    SP_LOG_INFO,
    SP_LOG_WARN,
    SP_LOG_ERROR,
    SP_LOG_FATAL,
} sp_log_level;

/* One record. `call` is the public function that reported (e.g. "sp_tlsf_free"), `addr` the
 * address concerned or NULL, `message` a human-readable sentence (valid only during the call). */
typedef struct sp_log_record {
    sp_log_level level;
    sp_result id;
    const char *call;
    const void *addr;
    const char *message;
} sp_log_record;

typedef void (*sp_log_fn)(void *user, const sp_log_record *rec);

/* Install a logger; NULL restores the default (stderr). The logger may be called from any
 * thread, concurrently, and must not call back into spindle allocators; it must return (not
 * longjmp). A record that the logger itself causes on its thread (it logs through sp_log, or
 * a spindle call it makes reports) goes to stderr instead of back into it. Records already
 * being logged when sp_log_set returns may still reach the old logger: keep its `user` alive
 * until no thread can still be logging (e.g. until the threads that log are joined). */
void sp_log_set(sp_log_fn fn, void *user);

/* Emit a record through the current logger (printf-style message). */
void sp_log(sp_log_level level, sp_result id, const char *call, const void *addr, const char *fmt,
            ...) __attribute__((format(printf, 5, 6)));

/* Fatal handler: called by sp_die after logging. The default aborts. A handler may longjmp
 * out (in-process death tests) or exit; if it returns, the process aborts anyway. */
typedef void (*sp_fatal_fn)(void *user, const sp_log_record *rec);
void sp_fatal_set(sp_fatal_fn fn, void *user);

/* Log at SP_LOG_FATAL, call the fatal handler, abort. */
_Noreturn void sp_die(sp_result id, const char *call, const void *addr, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Report API misuse: logs at SP_LOG_ERROR, then dies if sp_misuse_fatal() is true.
 * Returns `id` so callers can write `return sp_misuse(...)`. */
sp_result sp_misuse(sp_result id, const char *call, const void *addr, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Whether misuse is fatal. Default: true when built with SP_DEBUG >= 1. Tests switch it off
 * to check that release behaviour (report, return, state intact) holds. */
void sp_misuse_set_fatal(bool fatal);
bool sp_misuse_fatal(void);

#ifdef __cplusplus
}
#endif
#endif
