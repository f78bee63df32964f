/* The logger, result names, the misuse policy and the fatal path (sp_log.h). */
#include <setjmp.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "sp_log.h"
#include "test_support.h"

static void test_result_names(void) {
    static const struct {
        sp_result id;
        const char *name;
    } all[] = {
        {SP_OK, "SP_OK"},
        {SP_ERR_NOMEM, "SP_ERR_NOMEM"},
        {SP_ERR_OS, "SP_ERR_OS"},
        {SP_ERR_INVALID_ARG, "SP_ERR_INVALID_ARG"},
        {SP_ERR_OVERFLOW, "SP_ERR_OVERFLOW"},
        {SP_ERR_BAD_ALIGNMENT, "SP_ERR_BAD_ALIGNMENT"},
        {SP_ERR_DOUBLE_FREE, "SP_ERR_DOUBLE_FREE"},
        {SP_ERR_FOREIGN_POINTER, "SP_ERR_FOREIGN_POINTER"},
        {SP_ERR_INVALID_POINTER, "SP_ERR_INVALID_POINTER"},
        {SP_ERR_TOO_SMALL, "SP_ERR_TOO_SMALL"},
        {SP_ERR_LIMIT, "SP_ERR_LIMIT"},
        {SP_ERR_CORRUPT, "SP_ERR_CORRUPT"},
        {SP_ERR_SHUTDOWN, "SP_ERR_SHUTDOWN"},
        {SP_ERR_STALLED, "SP_ERR_STALLED"},
        {SP_ERR_STALE_HANDLE, "SP_ERR_STALE_HANDLE"},
        {SP_ERR_PINNED, "SP_ERR_PINNED"},
        {SP_ERR_NOT_PINNED, "SP_ERR_NOT_PINNED"},
        {SP_ERR_BUSY, "SP_ERR_BUSY"},
    };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        const char *got = sp_result_name(all[i].id);
        ok(got && strcmp(got, all[i].name) == 0, "sp_result_name(%d) is %s", (int)all[i].id,
           all[i].name);
    }
    ok(sp_result_name((sp_result)-99) != NULL, "an unknown id still has a name: %s",
       sp_result_name((sp_result)-99));
}

/* A logger that also keeps the level, which ts_log does not record. */
static sp_log_level level_seen;
static int level_count;
static void log_level(void *user, const sp_log_record *rec) {
    (void)user;
    level_seen = rec->level;
    level_count++;
}

static void test_capture(void) {
    int x = 0;
    ts_log_capture();
    ok(ts_logged.count == 0, "capture starts with nothing logged");
    sp_log(SP_LOG_WARN, SP_ERR_OS, "sp_test_call", &x, "value %d %s", 42, "abc");
    ok(ts_logged.count == 1, "the logger saw one record");
    ok(ts_logged.last_id == SP_ERR_OS, "with its id");
    ok(strcmp(ts_logged.last_call, "sp_test_call") == 0, "with its call");
    ok(ts_logged.last_addr == &x, "with its address");
    ok(strcmp(ts_logged.last_message, "value 42 abc") == 0, "with the formatted message \"%s\"",
       ts_logged.last_message);
    ts_log_reset();
    ok(ts_logged.count == 0 && ts_logged.last_call[0] == 0, "ts_log_reset clears the record");

    sp_log_set(log_level, NULL);
    sp_log(SP_LOG_INFO, SP_OK, NULL, NULL, "info");
    ok(level_count == 1 && level_seen == SP_LOG_INFO, "a custom logger receives the level");
    ts_log_release();
}

static void test_misuse_nonfatal(void) {
    int y = 0;
    ts_log_capture();
    ok(!sp_misuse_fatal(), "capture makes misuse non-fatal");
    sp_result r =
        sp_misuse(SP_ERR_DOUBLE_FREE, "sp_test_free", &y, "block %p freed twice", (void *)&y);
    is_int(r, SP_ERR_DOUBLE_FREE, "sp_misuse returns its id");
    ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_DOUBLE_FREE &&
           strcmp(ts_logged.last_call, "sp_test_free") == 0 && ts_logged.last_addr == &y,
       "and reported it through the logger; the process keeps running");
    ts_log_release();
}

static void misuse_fatal(void *arg) {
    (void)arg;
    sp_misuse(SP_ERR_FOREIGN_POINTER, "sp_test_free", (void *)0x1234, "pointer not ours");
}
static void misuse_quiet(void *arg) {
    (void)arg;
}

static void test_misuse_fatal(void) {
    ok(ts_dies(misuse_fatal, NULL, "sp_test_free", "0x1234"),
       "fatal misuse dies and prints the call and the address");
    ok(ts_dies(misuse_fatal, NULL, "SP_ERR_FOREIGN_POINTER", NULL), "and the id by name");
    diag("two negative checks of ts_dies follow: their child output below is expected");
    ok(!ts_dies(misuse_quiet, NULL, NULL, NULL), "ts_dies is false when the child survives");
    ok(!ts_dies(misuse_fatal, NULL, "no-such-text", NULL),
       "ts_dies is false when a needle is missing");
}

/* In-process death test: the fatal handler longjmps back into the test. */
static jmp_buf die_env;
static sp_log_record die_rec;
static char die_call[64], die_message[128];
static int die_calls;

static void fatal_jump(void *user, const sp_log_record *rec) {
    (void)user;
    die_calls++;
    die_rec = *rec;
    snprintf(die_call, sizeof die_call, "%s", rec->call ? rec->call : "");
    snprintf(die_message, sizeof die_message, "%s", rec->message ? rec->message : "");
    longjmp(die_env, 1);
}

static void test_die_handler(void) {
    static int z;
    ts_log_capture();
    sp_fatal_set(fatal_jump, NULL);
    if (setjmp(die_env) == 0) sp_die(SP_ERR_CORRUPT, "sp_test_check", &z, "bad %d", 7);
    sp_fatal_set(NULL, NULL);
    ok(die_calls == 1, "sp_die called the fatal handler once");
    ok(die_rec.level == SP_LOG_FATAL && die_rec.id == SP_ERR_CORRUPT, "with level fatal and id");
    ok(strcmp(die_call, "sp_test_check") == 0 && die_rec.addr == &z, "with the call and address");
    ok(strcmp(die_message, "bad 7") == 0, "with the formatted message \"%s\"", die_message);
    ok(ts_logged.count == 1 && ts_logged.last_id == SP_ERR_CORRUPT &&
           strcmp(ts_logged.last_message, "bad 7") == 0,
       "the logger saw the record first");
    ts_log_release();
}

static void test_restore_stderr(void) {
    FILE *tmp = tmpfile();
    int saved = dup(STDERR_FILENO);
    if (!tmp || saved < 0) {
        ok(0, "tmpfile for stderr");
        ok(0, "custom logger untouched");
        return;
    }
    fflush(stderr);
    dup2(fileno(tmp), STDERR_FILENO);
    level_count = 0;
    sp_log_set(log_level, NULL);
    sp_log_set(NULL, NULL);
    sp_log(SP_LOG_WARN, SP_ERR_LIMIT, "sp_test_restore", NULL, "restored-marker %d", 5);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);

    char text[1024] = {0};
    rewind(tmp);
    size_t n = fread(text, 1, sizeof text - 1, tmp);
    text[n] = 0;
    fclose(tmp);
    ok(strstr(text, "restored-marker 5") && strstr(text, "sp_test_restore") &&
           strstr(text, "SP_ERR_LIMIT"),
       "sp_log_set(NULL) restores the stderr logger");
    ok(level_count == 0, "the replaced logger no longer sees records");
    if (!strstr(text, "restored-marker")) diag("stderr held: %s", text);
}

/* A logger that reports through spindle: the record it causes goes to stderr, not back into
 * it (it recursed until the stack overflowed). */
static int forwarding_depth, forwarding_max, forwarding_calls;
static void forwarding_logger(void *user, const sp_log_record *rec) {
    (void)user;
    forwarding_calls++;
    if (++forwarding_depth > forwarding_max) forwarding_max = forwarding_depth;
    if (forwarding_depth < 100) /* the bound only keeps a broken build from crashing */
        sp_log(SP_LOG_INFO, SP_OK, "forwarded", NULL, "forwarded: %s", rec->message);
    forwarding_depth--;
}

static void test_logger_reentry(void) {
    fflush(stderr);
    sp_log_set(forwarding_logger, NULL);
    sp_log(SP_LOG_WARN, SP_OK, "sp_test_call", NULL, "original");
    sp_log_set(NULL, NULL);
    ok(forwarding_calls == 1 && forwarding_max == 1,
       "a logger that logs: its own record goes to stderr, not back into it (%d calls, depth "
       "%d)",
       forwarding_calls, forwarding_max);
}

int main(void) {
    plan(42);
    test_result_names();    /* 14 */
    test_capture();         /* 8 */
    test_misuse_nonfatal(); /* 3 */
    test_misuse_fatal();    /* 4 */
    test_die_handler();     /* 5 */
    test_restore_stderr();  /* 2 */
    test_logger_reentry();  /* 1 */
    return done();
}
