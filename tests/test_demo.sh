#!/usr/bin/env bash
# The flagship demo under the test harness (TAP): a short run exits 0 (nothing damaged, nothing
# leaked: the demo checks both), malformed arguments get the usage and exit 2, --help exit 0, and
# a run whose output cannot be written exits 1.
# usage: test_demo.sh SPINDLE_DEMO
set -uo pipefail
demo=$1
echo "1..4"
out=$("$demo" 0.5 3000 2>&1)
rc=$?
if [[ $rc == 0 && $out == *" 0 damaged"* ]]; then
    echo "ok 1 - a 0.5 s run of 3,000 entities: exit 0, 0 damaged, no leak reported"
else
    echo "not ok 1 - a 0.5 s run of 3,000 entities: exit $rc"
    printf '%s\n' "$out" | tail -5 | sed 's/^/# /'
fi
bad=0
for args in "2x" "0.3 50k" "0.3 0" "0.2 100 extra" "nan"; do
    # shellcheck disable=SC2086
    err=$("$demo" $args 2>&1 >/dev/null)
    rc=$?
    if [[ $rc != 2 || $err != usage:* ]]; then
        echo "# '$args': exit $rc, stderr '$err'"
        bad=1
    fi
done
if [[ $bad == 0 ]]; then echo "ok 2 - malformed arguments: usage on stderr, exit 2"; else echo "not ok 2 - malformed arguments: usage on stderr, exit 2"; fi
out=$("$demo" --help 2>/dev/null)
rc=$?
if [[ $rc == 0 && $out == usage:* ]]; then echo "ok 3 - --help: usage on stdout, exit 0"; else echo "not ok 3 - --help: exit $rc"; fi
if [[ -w /dev/full ]]; then
    "$demo" 0.1 100 >/dev/full 2>/dev/null
    rc=$?
    if [[ $rc == 1 ]]; then echo "ok 4 - output to a full device: exit 1"; else echo "not ok 4 - output to a full device: exit $rc"; fi
else
    echo "ok 4 # SKIP no writable /dev/full"
fi
