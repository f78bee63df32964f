#!/usr/bin/env python3
"""Summarise meson test logs into the one closing line CI reads.

    summary.py [--step NAME:RC:LOG]... [LOG...]

Each LOG is a meson `testlog*.json` (or `--logbase` variant): one JSON object per line with a
`result` field. OK and EXPECTEDFAIL count as passed, SKIP as skipped, every other result
(FAIL, ERROR, TIMEOUT, UNEXPECTEDPASS, anything unknown, an unreadable line) as failed.

A --step names one step of a run (a build, or a `meson test` call), its exit status, and the
log it should have written (may be empty). A step that exited non-zero without a failing
result in its log (a broken configure or build, meson itself failing) counts as one failure,
so a broken build can never end in "0 failed"; so does a step whose log is missing or holds
no test result (a `meson test` call that selected nothing exits 0 and writes no log).

With neither steps nor logs, reads build-*/meson-logs/testlog*.json and benchlog*.json
under the current directory.

Prints per-step figures, the names of failed tests and the number skipped, then, as the last
line, exactly `N passed, N failed`. Exit status: 1 when anything failed, else 0. Python 3
standard library only.
"""

import glob
import json
import os
import sys

PASSED = {"OK", "EXPECTEDFAIL"}
SKIPPED = {"SKIP"}


def read_log(path):
    """Return (passed, failed, skipped, failed_names) for one JSON-lines log."""
    passed = failed = skipped = 0
    failed_names = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                result = str(rec.get("result", "")).upper()
                name = str(rec.get("name", "?"))
            except (ValueError, AttributeError):
                failed += 1
                failed_names.append("%s:%d: unreadable log line" % (path, lineno))
                continue
            if result in PASSED:
                passed += 1
            elif result in SKIPPED:
                skipped += 1
            else:
                failed += 1
                failed_names.append("%s (%s)" % (name, result or "no result"))
    return passed, failed, skipped, failed_names


def parse_args(argv):
    steps = []  # (name, rc, log or None)
    logs = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(__doc__.strip())
            sys.exit(0)
        if arg == "--step" or arg.startswith("--step="):
            if arg == "--step":
                i += 1
                if i >= len(argv):
                    sys.exit("summary.py: --step needs NAME:RC:LOG")
                spec = argv[i]
            else:
                spec = arg[len("--step="):]
            parts = spec.split(":", 2)
            if len(parts) < 2:
                sys.exit("summary.py: bad --step %r (want NAME:RC:LOG)" % spec)
            try:
                rc = int(parts[1])
            except ValueError:
                sys.exit("summary.py: bad exit status in --step %r" % spec)
            log = parts[2] if len(parts) == 3 and parts[2] else None
            steps.append((parts[0], rc, log))
        else:
            logs.append(arg)
        i += 1
    return steps, logs


def main(argv):
    steps, logs = parse_args(argv)
    if not steps and not logs:
        logs = sorted(glob.glob("build-*/meson-logs/testlog*.json") +
                      glob.glob("build-*/meson-logs/benchlog*.json"))
    steps += [(path, 0, path) for path in logs]

    total_p = total_f = total_s = 0
    lines = []
    failures = []
    for name, rc, log in steps:
        p = f = s = 0
        names = []
        note = ""
        if log and os.path.exists(log):
            try:
                p, f, s, names = read_log(log)
            except OSError as e:
                note = "cannot read %s: %s" % (log, e)
                f, names = 1, [note]
        elif log:
            note = "no log written"
        if rc != 0 and f == 0:
            # The step failed but no test result says so: count the step itself.
            f = 1
            names.append("step failed with exit status %d%s" %
                         (rc, " (" + note + ")" if note else ""))
        elif rc == 0 and log and p + f + s == 0:
            # It ran nothing that we can see: a missing suite or log is a failure too.
            note = note or "no test results"
            f = 1
            names.append(note)
        elif rc == 0 and not log:
            p = 1  # a check without a test log (a cross build) that succeeded
        total_p += p
        total_f += f
        total_s += s
        failures += ["%s: %s" % (name, n) for n in names]
        lines.append("  %-28s %4d passed %4d failed %4d skipped%s" %
                     (name, p, f, s, "   [" + note + "]" if note else ""))

    print("Summary:")
    for line in lines:
        print(line)
    for line in failures:
        print("  FAILED " + line)
    if total_s:
        print("%d skipped" % total_s)
    sys.stdout.flush()
    print("%d passed, %d failed" % (total_p, total_f))
    return 1 if total_f else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
