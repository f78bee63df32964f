#!/usr/bin/env bash
# Real programs under LD_PRELOAD=libspindle-malloc.so, each checked for correct output (the
# same as without the preload, or a known answer) and for the library having served it
# (SPINDLE_MALLOC_STATS=1 makes every process report its allocator's high water at exit).
# usage: test_malloc_preload.sh LIBSPINDLE_MALLOC_SO   (TAP on stdout)
set -uo pipefail
LIB=$1
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
echo "1..7"

# 1. A shell pipeline: sort and awk over 200,000 lines, the shell itself preloaded too.
: >"$TMP/stats"
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
: >"$TMP/stats"
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
: >"$TMP/stats"
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
: >"$TMP/stats"
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
: >"$TMP/stats"
got=$(PYTHONMALLOC=malloc under python3 "$TMP/forky.py")
ok $([[ $got == "forks 20 failed 0" ]] && served; echo $?) "fork while other threads allocate: '$got'"

# 6. The library exports the functions it replaces and the spindle API, no internal name
#    (an exported `tc` or `heap_alloc` would take a program's symbol of that name).
extra=$(nm -D --defined-only "$LIB" | awk '{ print $3 }' |
    grep -vxE 'sp_.*|malloc|free|calloc|realloc|reallocarray|posix_memalign|aligned_alloc|memalign|valloc|pvalloc|malloc_usable_size|_init|_fini' | tr '\n' ' ')
ok $([[ -z $extra ]]; echo $?) "exports only the malloc family and sp_* (others: '${extra}')"

# 7. Nothing reported misuse along the way.
ok $(! grep -q 'SP_ERR' "$TMP/stats"; echo $?) "no misuse reported by any of those processes"
grep 'SP_ERR' "$TMP/stats" | head -5 | sed 's/^/# /'
exit $failed
