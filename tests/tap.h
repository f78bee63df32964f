/* A tiny TAP producer for spindle's tests (meson runs them with protocol: 'tap').
 *
 *   plan(n);  ok(cond, "what");  is_int(a, b, "what");  diag("fmt", ...);  return done();
 *   skip_all("reason")  prints "1..0 # SKIP reason" (meson 1.0 counts exit 77 as an error).
 *   skip("reason")      one planned test not run here: "ok N # SKIP reason".
 *   skip_n(n, "reason") n of them.
 *
 * Diagnostics go to stdout as "# ..." lines. Not thread-safe: call ok() from one thread.
 */
#ifndef SP_TAP_H
#define SP_TAP_H

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

static int tap_planned, tap_run, tap_failed;

static inline void plan(int n) {
    tap_planned = n;
    printf("1..%d\n", n);
    fflush(stdout);
}

static inline void diag(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void diag(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("# ", stdout);
    vprintf(fmt, ap);
    fputc('\n', stdout);
    va_end(ap);
    fflush(stdout);
}

static inline int ok_at(int cond, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static inline int ok_at(int cond, const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    tap_run++;
    if (!cond) tap_failed++;
    printf("%sok %d - ", cond ? "" : "not ", tap_run);
    vprintf(fmt, ap);
    putchar('\n');
    if (!cond) printf("#   failed at %s:%d\n", file, line);
    va_end(ap);
    fflush(stdout);
    return cond;
}

#define ok(cond, ...) ok_at(!!(cond), __FILE__, __LINE__, __VA_ARGS__)
#define is_int(got, want, ...)                                                                     \
    do {                                                                                           \
        long long tap_g_ = (long long)(got), tap_w_ = (long long)(want);                           \
        if (!ok(tap_g_ == tap_w_, __VA_ARGS__)) diag("  got %lld, want %lld", tap_g_, tap_w_);     \
    } while (0)

static inline void skip(const char *reason) {
    printf("ok %d # SKIP %s\n", ++tap_run, reason);
    fflush(stdout);
}

/* n planned tests not run here, for one reason. */
static inline void skip_n(int n, const char *reason) {
    while (n-- > 0) skip(reason);
}

static inline void skip_all(const char *reason) {
    printf("1..0 # SKIP %s\n", reason);
    fflush(stdout);
    exit(0);
}

/* Exit status: 0 when every planned test ran and passed. */
static inline int done(void) {
    if (tap_planned == 0)
        printf("1..%d\n", tap_run);
    else if (tap_run != tap_planned)
        diag("planned %d tests but ran %d", tap_planned, tap_run);
    fflush(stdout);
    return tap_failed || (tap_planned && tap_run != tap_planned) ? 1 : 0;
}

#endif
