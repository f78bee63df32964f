#!/usr/bin/env bash
# Real programs under LD_PRELOAD=libspindle-malloc.so, each checked for correct output (the
# same as without the preload, or a known answer) and for the library having served it
# (SPINDLE_MALLOC_STATS=1 makes every process report its allocator's high water at exit).
# usage: test_malloc_preload.sh LIBSPINDLE_MALLOC_SO PRELOAD_FORK   (TAP on stdout)
#   PRELOAD_FORK: tests/preload_fork.c built without libspindle (test 6).
set -uo pipefail
LIB=$1
FORK_PROG=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
n=0
failed=0
ok() { # ok CONDITION_STATUS DESCRIPTION
    n=$((n + 1))
    if [[ $1 == 0 ]]; then echo "ok $n - $2"; else echo "not ok $n - $2"; failed=1; fi
}
under() { LD_PRELOAD=$LIB SPINDLE_MALLOC_STATS=1 "$@" 2>>"$TMP/stats"; }
served() { # the last report line of a process that allocated
    grep -q 'spindle-malloc: pid [0-9]* high_water [1-9]' "$TMP/stats"
}
fresh() { # start a test's stats; the ones before are kept in all_stats for the last test,
    # which also counts the tests whose processes the library served
    if [[ -f $TMP/stats ]]; then
        cat "$TMP/stats" >>"$TMP/all_stats"
        if served; then n_served=$((n_served + 1)); fi
        n_fresh=$((n_fresh + 1))
    fi
    : >"$TMP/stats"
}
n_served=0
n_fresh=0
echo "1..10"

# 1. A shell pipeline: sort and awk over 200,000 lines, the shell itself preloaded too.
fresh
got=$(under bash -c 'seq 1 200000 | sort -r | awk "{ s += \$1; n++ } END { printf \"%.0f %d\\n\", s, n }"')
ok $([[ $got == "20000100000 200000" ]] && served; echo $?) "shell pipeline (seq | sort -r | awk): '$got'"

# 2. Python, every object through malloc (PYTHONMALLOC=malloc), with threads.
cat >"$TMP/heavy.py" <<'PY'
import hashlib, threading
def work(seed, out):
    d = {}
    for i in range(60000):
        k = "k%d-%d" % (seed, i)
        d[k] = [i] * (i % 37) + [k * (i % 11)]
        if i % 3 == 0:
            d.pop("k%d-%d" % (seed, i // 2), None)
    h = hashlib.sha256()
    for k in sorted(d):
        h.update(k.encode()); h.update(repr(d[k]).encode())
    out[seed] = h.hexdigest()
out = {}
ts = [threading.Thread(target=work, args=(s, out)) for s in range(4)]
for t in ts: t.start()
for t in ts: t.join()
print(hashlib.sha256("".join(out[s] for s in range(4)).encode()).hexdigest())
PY
want=$(PYTHONMALLOC=malloc python3 "$TMP/heavy.py")
fresh
got=$(PYTHONMALLOC=malloc under python3 "$TMP/heavy.py")
ok $([[ -n $want && $got == "$want" ]] && served; echo $?) "python3, 4 threads, heavy dict/list churn: same digest as glibc"

# 3. git on a small repository made here.
git_run() {
    local dir=$1
    shift
    "$@" bash -c "cd '$dir' && git init -q . && git config user.email t@t && git config user.name t &&
        for i in \$(seq 1 40); do seq \$i 3000 > f\$i.txt; done && git add . &&
        git commit -qm one && sed -i s/5/five/ f7.txt && git commit -qam two &&
        git log --format=%s && git diff HEAD~1 --stat | tail -1 && git gc -q && git fsck --strict &&
        git cat-file -p HEAD^{tree} | wc -l"
}
mkdir "$TMP/plain" "$TMP/pre"
want=$(git_run "$TMP/plain" env)
fresh
got=$(git_run "$TMP/pre" under)
ok $([[ -n $want && $got == "$want" ]] && served; echo $?) "git init/add/commit/log/diff/gc/fsck: same output as glibc"

# 4. gcc compiles and links a program (cc1, as, collect2, ld all preloaded); it runs.
cat >"$TMP/hello.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(void) {
    unsigned long sum = 0;
    for (int i = 0; i < 100000; i++) {
        char *p = malloc(16 + i % 500);
        memset(p, i, 16);
        sum += (unsigned char)p[3];
        free(p);
    }
    printf("hello %lu\n", sum);
    return 0;
}
C
fresh
under gcc -O2 -o "$TMP/hello" "$TMP/hello.c"
rc=$?
got=$(under "$TMP/hello")
want=$("$TMP/hello")
ok $([[ $rc == 0 && -n $want && $got == "$want" ]] && served; echo $?) "gcc -O2 compile + link under the preload, program runs: '$got'"

# 5. fork and threads: a child allocates after fork while the parent's threads churn.
cat >"$TMP/forky.py" <<'PY'
import os, threading
stop = False
def churn():
    while not stop:
        [bytearray(i % 700) for i in range(2000)]
ts = [threading.Thread(target=churn) for _ in range(3)]
for t in ts: t.start()
codes = []
for i in range(20):
    pid = os.fork()
    if pid == 0:
        x = [bytes(range(i % 256)) * 50 for _ in range(1000)]
        os._exit(0 if len(x) == 1000 else 1)
    codes.append(os.waitpid(pid, 0)[1])
stop = True
for t in ts: t.join()
print("forks", len(codes), "failed", sum(1 for c in codes if c))
PY
fresh
got=$(PYTHONMALLOC=malloc under python3 "$TMP/forky.py")
ok $([[ $got == "forks 20 failed 0" ]] && served; echo $?) "fork while other threads allocate: '$got'"

# 6. The same in C, where nothing (like python's GIL) keeps the other threads out of malloc
#    at the fork: three threads churn small and large blocks while main forks 200 times, each
#    child allocating. Without the library's fork handlers a child inherits a lock held at the
#    fork and hangs (its alarm kills it). `timeout` bounds the whole run.
fresh
got=$(under timeout 300 "$FORK_PROG")
rc=$?
ok $([[ $rc == 0 && $got == "forks 200 failed 0" ]] && served; echo $?) "C: fork 200 times while 3 threads malloc/free in a loop, children allocate: '${got//$'\n'/; }' (rc $rc)"

# 7. The library exports the functions it replaces and the spindle API, no internal name
#    (an exported `tc` or `heap_alloc` would take a program's symbol of that name), and its
#    own calls bind to its own functions: a program exporting an sp_mutex_lock of its own
#    (-rdynamic) took over malloc's locks before (-Bsymbolic-functions).
names=$(nm -D --defined-only "$LIB" | awk '{ print $3 }')
extra=$(echo "$names" |
    grep -vxE 'sp_.*|malloc|free|calloc|realloc|reallocarray|posix_memalign|aligned_alloc|memalign|valloc|pvalloc|malloc_usable_size|_init|_fini' | tr '\n' ' ')
cat >"$TMP/interp.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
static int calls;
void sp_mutex_lock(void *m);
void sp_mutex_unlock(void *m);
void sp_mutex_lock(void *m) { (void)m; calls++; }
void sp_mutex_unlock(void *m) { (void)m; }
int main(void) {
    static void *v[20000];
    for (int i = 0; i < 20000; i++) v[i] = malloc(100 + i % 3000);
    for (int i = 0; i < 20000; i++) free(v[i]);
    printf("calls %d\n", calls);
    return 0;
}
C
gcc -O1 -rdynamic -o "$TMP/interp" "$TMP/interp.c" 2>"$TMP/interp.log"
got=$(under "$TMP/interp" 2>&1)
ok $([[ -z $extra && $got == "calls 0" ]] && grep -qx malloc <<<"$names"; echo $?) "exports only the malloc family and sp_* (others: '${extra}'); a program's own sp_mutex_lock is not called by malloc: '$got'"

# 8. The error conventions: errno and return values for requests that cannot be served and
#    alignments of a form the call refuses (answers of glibc's kind; the program, built
#    without the preload, prints what differs); and the alignments memalign, valloc and
#    pvalloc give (valloc, pvalloc: a page).
cat >"$TMP/errs.c" <<'C'
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static int bad;
static void want(const char *what, int got_null, int err, int want_err) {
    if (!got_null || err != want_err) {
        printf("%s: null %d errno %d, want null and %d\n", what, got_null, err, want_err);
        bad = 1;
    }
}
int main(void) {
    void *p = (void *)1;
    size_t big = (size_t)1 << 31, huge = ((size_t)1 << 63) + 1;
    int r = posix_memalign(&p, 24, 16); want("posix_memalign(24)", r != 0, r, EINVAL);
    r = posix_memalign(&p, 4, 16); want("posix_memalign(4)", r != 0, r, EINVAL);
    r = posix_memalign(&p, big, 16); want("posix_memalign(2^31)", r != 0, r, ENOMEM);
    if (p != (void *)1) { printf("posix_memalign wrote *out on failure\n"); bad = 1; }
    errno = 0; p = aligned_alloc(24, 16); want("aligned_alloc(24)", !p, errno, EINVAL);
    errno = 0; p = aligned_alloc(big, 16); want("aligned_alloc(2^31)", !p, errno, ENOMEM);
    errno = 0; p = memalign(big, 16); want("memalign(2^31)", !p, errno, ENOMEM);
    errno = 0; p = memalign(huge, 16); want("memalign(2^63 + 1)", !p, errno, EINVAL);
    errno = 0; p = malloc(SIZE_MAX); want("malloc(SIZE_MAX)", !p, errno, ENOMEM);
    errno = 0; p = calloc(SIZE_MAX / 2, 3); want("calloc overflow", !p, errno, ENOMEM);
    errno = 0; p = reallocarray(NULL, SIZE_MAX / 2, 3); want("reallocarray overflow", !p, errno, ENOMEM);
    errno = 0; p = pvalloc(SIZE_MAX - 10); want("pvalloc(SIZE_MAX - 10)", !p, errno, ENOMEM);
    p = memalign(48, 100); /* rounded up to 64 */
    if (!p || (uintptr_t)p % 64 || malloc_usable_size(p) < 100) { printf("memalign(48)\n"); bad = 1; }
    free(p);
    /* valloc and pvalloc: page-aligned, pvalloc's size rounded up to whole pages; eight of
     * each kept at once, so that no run of luck passes a smaller alignment. */
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void *v[8], *pv[8];
    for (int i = 0; i < 8; i++) {
        v[i] = valloc(100 + 16 * i);
        pv[i] = pvalloc(100 + 16 * i);
        if (!v[i] || (uintptr_t)v[i] % page) { printf("valloc(%d): %p\n", 100 + 16 * i, v[i]); bad = 1; }
        if (!pv[i] || (uintptr_t)pv[i] % page || malloc_usable_size(pv[i]) < page) {
            printf("pvalloc(%d): %p\n", 100 + 16 * i, pv[i]);
            bad = 1;
        }
    }
    for (int i = 0; i < 8; i++) { free(v[i]); free(pv[i]); }
    p = malloc(100);
    errno = 0;
    if (realloc(p, 0) != NULL || errno) { printf("realloc(p, 0): not NULL, or errno set\n"); bad = 1; }
    puts(bad ? "differs" : "conventions ok");
    return bad;
}
C
gcc -O1 -o "$TMP/errs" "$TMP/errs.c" 2>"$TMP/errs.log"
fresh
got=$(under "$TMP/errs")
ok $([[ $got == "conventions ok" ]] && served; echo $?) "error conventions (EINVAL, ENOMEM) and alignments (memalign, valloc, pvalloc) of the malloc family: '${got//$'\n'/; }'"

# 9. Nothing reported misuse along the way, in processes the library served: every test that
#    ran programs (all but 7) had one that reported its high water (without that, an absent
#    report could mean the library never ran).
fresh
ok $([[ $n_served == 7 && $n_fresh == 7 ]] && ! grep -q 'SP_ERR' "$TMP/all_stats"; echo $?) "no misuse reported by any of those processes, $n_served of $n_fresh tests served by the library"
grep 'SP_ERR' "$TMP/all_stats" | head -5 | sed 's/^/# /'

# 10. Under an address-space limit below the library's least reservation (1 GiB), a program
#     whose first allocation happens under glibc's locale lock (coreutils' textdomain) still
#     ends: the failure's log line translated errno through gettext, which waits for that lock,
#     and the process hung there.
got=$(ulimit -v 900000 && timeout 60 bash -c 'LD_PRELOAD=$1 exec /bin/echo ok' - "$LIB" 2>"$TMP/limited")
rc=$?
ok $([[ $rc == 0 && $got == ok ]] && grep -q 'SP_ERR_OS' "$TMP/limited"; echo $?) "echo under ulimit -v 900000: the reservation fails (logged), the program ends: '$got' (rc $rc; 124: hung)"
exit $failed
