#!/usr/bin/env bash
# spin: the one entry point for building, testing and benchmarking spindle on Debian 12.
# Installs missing Debian packages (as root) or says how, configures the build-* directories
# it needs, and runs what CI runs. `./spin help` for the subcommands.
#
# The *_ENV/*_OPTS arrays are used by name (local -n), their commas are meson syntax, and
# some functions run only through `timed`:
# shellcheck disable=SC2034,SC2054,SC2317
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$ROOT" || exit 1

PACKAGES=(meson ninja-build pkg-config gcc g++ clang-14 libclang-rt-14-dev liburcu-dev
          libbenchmark-dev valgrind libjemalloc-dev libgoogle-perftools-dev libmimalloc-dev
          gcc-aarch64-linux-gnu python3 git liburcu-dev:arm64)
# liburcu-dev:arm64 (for the aarch64 cross build) is a Debian multiarch package: the arm64
# architecture is added to dpkg first if it is missing.
# `demo` needs only the library's own build: a release build finds no Google Benchmark or C++
# compiler then and leaves the benchmarks out.
DEMO_PACKAGES=(meson ninja-build pkg-config gcc liburcu-dev)

# Build directories: compiler environment and meson options. Changing these lines makes the
# next run re-create the directory (see setup_dir).
RELEASE_ENV=(CC=gcc CXX=g++)
RELEASE_OPTS=(--buildtype=release -Ddebug_level=0)
DEBUG_ENV=(CC=gcc CXX=g++)
# float-cast-overflow: gcc's -fsanitize=undefined leaves it out (a double converted past
# UINT64_MAX would pass unseen).
UB_ARGS=("-Dc_args=-fno-sanitize-recover=all -fsanitize=float-cast-overflow"
         -Dcpp_args=-fno-sanitize-recover=all)
DEBUG_OPTS=(--buildtype=debug -Ddebug_level=1 -Db_sanitize=address,undefined "${UB_ARGS[@]}"
            -Dbench=disabled)
# UBSan alone: glibc's allocator hands out memory aligned as asked, where ASan's over-aligns
# and so hides a misaligned object (an arena allocated 64-aligned for a 128-aligned type).
UBSAN_ENV=(CC=gcc CXX=g++)
UBSAN_OPTS=(--buildtype=debug -Ddebug_level=1 -Db_sanitize=undefined "${UB_ARGS[@]}"
            -Dbench=disabled -Ddemos=false)
TSAN_ENV=(CC=clang-14 CXX=clang++-14)
TSAN_OPTS=(--buildtype=debugoptimized -Db_sanitize=thread -Db_lundef=false -Dbench=disabled)
VALGRIND_ENV=(CC=gcc CXX=g++)
VALGRIND_OPTS=(--buildtype=debugoptimized -Ddebug_level=1 -Dvalgrind=true -Dbench=disabled
               -Ddemos=false)
AARCH64_ENV=()
AARCH64_OPTS=(--cross-file "$ROOT/.ci/cross-aarch64.ini" -Dbench=disabled)
FUZZ_ENV=(CC=clang-14 CXX=clang++-14)
FUZZ_OPTS=(--buildtype=debugoptimized -Dfuzzing=true -Db_sanitize=address,undefined
           -Db_lundef=false -Dbench=disabled -Ddemos=false)

MESON_TEST_ARGS=(--print-errorlogs --num-processes 2)

usage() {
    cat <<'EOF'
usage: ./spin COMMAND [ARGS]

  demo                 release build, then run build-release/demos/spindle-demo [ARGS]
  test                 what CI runs: ASan+UBSan (unit, death, concurrency), UBSan alone
                       (unit), TSan (concurrency), release (unit, soak, benchmark smoke),
                       Valgrind, the aarch64 cross build (compiled, not run), libFuzzer
                       (fuzz); ends with the line "N passed, N failed"; exit status non-zero
                       if anything failed; configure, build and test commands stop after
                       SPIN_BUDGET seconds (default 1380) in all; with CI set, also the
                       platform test with explicit huge pages where the pool can be sized
  bench [AREA...] [FLAGS]
                       release build, then bench/run build-release AREA [FLAGS] for each
                       AREA (default: every bench_AREA executable built); FLAGS such as
                       --smoke or --repetitions N are passed to bench/run; results go to
                       build-release/bench/AREA.json
  help                 this text

test and bench first make sure these Debian packages are installed (installing them when run
as root or with password-less sudo, printing the apt-get line otherwise):
EOF
    printf '  %s\n' "${PACKAGES[*]}"
    printf 'demo only these:\n  %s\n' "${DEMO_PACKAGES[*]}"
}

say() { printf '%s\n' "$*"; }
heading() { printf '\n==== %s\n' "$*"; }
die() {
    printf 'spin: %s\n' "$*" >&2
    exit 1
}

# Seconds since the epoch with milliseconds, and a difference in seconds with one decimal.
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# ---- packages ----------------------------------------------------------------------------

# Whether Debian package $1 is installed: a name without an architecture for the machine's own
# (or for all: meson is one), not only another architecture's copy (dpkg-query lists every
# installed one, such as the arm64 liburcu-dev of the cross build).
NATIVE_ARCH=
installed() {
    local want='[a-z0-9]+' # NAME:ARCH: dpkg-query lists that architecture's copy only
    if [[ $1 != *:* ]]; then
        [[ -n $NATIVE_ARCH ]] || NATIVE_ARCH=$(dpkg --print-architecture 2>/dev/null)
        want=$NATIVE_ARCH
    fi
    dpkg-query -W -f='${Status} ${Architecture}\n' "$1" 2>/dev/null |
        grep -qxE "install ok installed ($want|all)"
}

# ensure_packages [ARRAY_NAME]: the packages of that array (default PACKAGES).
ensure_packages() {
    command -v dpkg-query >/dev/null 2>&1 ||
        die "dpkg-query not found: spin expects Debian 12; see README.md for plain meson commands"
    local -n wanted=${1:-PACKAGES}
    local missing=() p
    for p in "${wanted[@]}"; do
        installed "$p" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    local add_arch=
    if [[ " ${missing[*]}" == *:arm64* ]] && ! dpkg --print-foreign-architectures | grep -qx arm64; then
        add_arch="dpkg --add-architecture arm64"
    fi

    # Root installs; another user through sudo when it needs no password (CI runners), else
    # the command is printed.
    local sudo=()
    if ((EUID != 0)); then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            {
                say "spin: missing Debian packages: ${missing[*]}"
                say "spin: install them as root with:"
                say "${add_arch:+$add_arch && }apt-get update && apt-get install -y ${missing[*]}"
            } >&2
            exit 1
        fi
    fi
    heading "installing missing packages: ${missing[*]}"
    INSTALLED= # the build directories' stamps see the new set
    if [[ -n $add_arch ]]; then
        "${sudo[@]}" dpkg --add-architecture arm64 || die "$add_arch failed"
    fi
    # Wait for another apt (unattended upgrades) rather than fail on its lock.
    local apt=(apt-get -o DPkg::Lock::Timeout=300)
    "${sudo[@]}" "${apt[@]}" update </dev/null || die "apt-get update failed"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y "${missing[@]}" \
        </dev/null || die "apt-get install failed"
    for p in "${missing[@]}"; do
        installed "$p" || die "package $p still not installed"
    done
}

# ---- build directories -------------------------------------------------------------------

# setup_dir DIR ENV_ARRAY_NAME OPTS_ARRAY_NAME
# Configures DIR if it is missing. A stamp inside DIR records the environment and options it
# was configured with, and every build option meson then held; if either changed since (DIR
# configured by hand, or changed with `meson configure`), DIR is removed and configured
# afresh (not `meson setup --wipe`, which keeps the options the new command line does not
# name), since a changed compiler or sanitizer cannot be applied in place. A directory whose
# configuration meson can no longer load is removed too.
# The stamp also lists which of PACKAGES are installed: meson looks for optional dependencies
# (Google Benchmark, the peers, a C++ compiler) only when it configures, so a directory
# configured before they were installed (`./spin demo` installs only DEMO_PACKAGES) is
# configured again once they are.
INSTALLED=
installed_packages() {
    if [[ -z $INSTALLED ]]; then
        local p
        INSTALLED=packages:
        for p in "${PACKAGES[@]}"; do
            if installed "$p"; then INSTALLED+=" $p"; fi
        done
    fi
    printf '%s\n' "$INSTALLED"
}

# Every build option meson holds for DIR, one name=value line each (empty if it cannot say).
build_options() {
    meson introspect --buildoptions "$1" 2>/dev/null | python3 -c '
import json, sys
try:
    opts = json.load(sys.stdin)
except ValueError:
    sys.exit(0)
print("\n".join(sorted("%s=%s" % (o["name"], o["value"]) for o in opts)))'
}

setup_dir() {
    local dir=$1
    local -n env_ref=$2 opts_ref=$3
    local stamp="$dir/.spin-setup"
    local want
    [[ -n $INSTALLED ]] || installed_packages >/dev/null # cached here, not in the $(...) below
    want=$(printf '%s\n' "meson $(meson --version 2>/dev/null)" "${env_ref[@]}" "${opts_ref[@]}" \
        "$(installed_packages)")

    if [[ -f $dir/meson-private/coredata.dat ]]; then
        if [[ -f $stamp && $(<"$stamp") == "$want"$'\n'"$(build_options "$dir")" ]]; then
            return 0
        fi
        say "spin: $dir was configured differently: removing it and configuring again"
    fi
    rm -rf "$dir"
    bounded env "${env_ref[@]}" meson setup "$dir" "${opts_ref[@]}" || return 1
    printf '%s\n%s\n' "$want" "$(build_options "$dir")" >"$stamp"
}

# ---- steps of `spin test` ----------------------------------------------------------------

STEPS=()    # --step arguments for .ci/summary.py
STATUS=0    # non-zero when any step failed
TIMINGS=()  # "label  seconds"

# record NAME RC [LOG]
record() {
    STEPS+=(--step "$1:$2:${3:-}")
    if (($2 != 0)); then
        STATUS=1
        say "spin: step '$1' FAILED (exit status $2)"
    fi
}

# `spin test` starts no meson command after this time (seconds since the epoch; empty: no
# limit) and stops one still running then, so that a hang still ends with the closing line.
DEADLINE=

# bounded CMD...: run an external command, stopped at the end of the time budget (exit status
# 124, said once, naming STEP, the running step's label) when DEADLINE is set.
STEP=
bounded() {
    [[ -z $DEADLINE ]] && { "$@" </dev/null; return; }
    local left rc
    left=$(awk -v d="$DEADLINE" -v n="$(now)" 'BEGIN { printf "%d", d - n }')
    if ((left <= 0)); then
        say "spin: the time budget (SPIN_BUDGET) is spent: '${STEP:-$1}' not run"
        return 124
    fi
    # On a terminal, --foreground keeps the command in the terminal's process group, so that
    # Ctrl-C still stops it (its own child processes are then not killed at the end of the
    # budget); CI has no terminal.
    local fg=()
    [[ -t 0 ]] && fg=(--foreground)
    timeout "${fg[@]}" --kill-after=30 "$left" "$@" </dev/null
    rc=$?
    ((rc == 124)) && say "spin: '${STEP:-$1}' stopped at the end of the time budget (SPIN_BUDGET)"
    return "$rc"
}

# timed LABEL CMD...: run CMD (an external command goes through `bounded`; a function bounds
# its own commands), print and keep its wall time, return its status (124: stopped or not
# started for the time budget).
timed() {
    local label=$1 t0 rc
    shift
    t0=$(now)
    STEP=$label
    if [[ $(type -t "$1") == file ]]; then
        bounded "$@"
    else
        "$@" </dev/null
    fi
    rc=$?
    local secs
    secs=$(elapsed "$t0")
    say "---- $label: ${secs} s (exit status $rc)"
    TIMINGS+=("$(printf '%-26s %7s s' "$label" "$secs")")
    return "$rc"
}

# build_step NAME DIR ENV OPTS: configure and compile; records a failure and returns 1 when
# either fails, so the caller skips the tests of a broken build (they still count as failed).
build_step() {
    local name=$1 dir=$2 rc
    timed "$name: configure" setup_dir "$dir" "$3" "$4"
    rc=$?
    if ((rc != 0)); then
        record "$name-configure" "$rc"
        return 1
    fi
    timed "$name: build" meson compile -C "$dir"
    rc=$?
    if ((rc != 0)); then
        record "$name-build" "$rc"
        return 1
    fi
    return 0
}

# test_step NAME DIR LOGBASE MESON_TEST_ARGS...: run meson test (no rebuild: the build step
# has just built everything) and record its log. Stale logs from earlier runs are removed
# first so they can never be counted.
test_step() {
    local name=$1 dir=$2 logbase=$3 rc
    shift 3
    rm -f "$dir/meson-logs/$logbase.json" "$dir/meson-logs/$logbase.txt"
    timed "$name" meson test -C "$dir" --no-rebuild --logbase "$logbase" \
        "${MESON_TEST_ARGS[@]}" "$@"
    rc=$?
    record "$name" "$rc" "$dir/meson-logs/$logbase.json"
}

# hugetlb_step DIR: the platform test once more with a pool of at least 8 explicit huge pages
# (the old size if larger), whose decommit case (a bug of 2026-11-23, 3d71943) skips without
# one, and no machine has one by default. Only where the pool can be sized (root, a writable
# /proc/sys); the old size is put back, also when the run exits during the step (an EXIT trap:
# not after SIGKILL).
hugetlb_step() {
    local pool=/proc/sys/vm/nr_hugepages old
    old=$(cat "$pool" 2>/dev/null) || old=
    if [[ ! $old =~ ^[0-9]+$ ]] || ! { echo $((old < 8 ? 8 : old)) >"$pool"; } 2>/dev/null ||
        (($(cat "$pool") == 0)); then
        say "spin: no hugetlb pool could be set up ($pool): the hugetlb case stays skipped"
        return 0
    fi
    # shellcheck disable=SC2064 # expanded now: old is a number, pool a fixed path
    trap "{ echo $old >$pool; } 2>/dev/null" EXIT
    test_step release-hugetlb "$1" testlog-hugetlb platform
    { echo "$old" >"$pool"; } 2>/dev/null || say "spin: $pool could not be put back to $old"
    trap - EXIT
}

# Whether DIR has any benchmark() registered.
has_benchmarks() {
    local json
    json=$(meson introspect --benchmarks "$1" 2>/dev/null) || return 1
    python3 -c 'import json, sys; sys.exit(0 if json.loads(sys.stdin.read()) else 1)' \
        <<<"$json"
}

# clang-14 must be able to link libFuzzer (it lives in libclang-rt-14-dev).
check_libfuzzer() {
    local tmp rc
    tmp=$(mktemp -d) || return 1
    printf '%s\n' '#include <stddef.h>' '#include <stdint.h>' \
        'int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);' \
        'int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }' \
        >"$tmp/f.c"
    bounded clang-14 -fsanitize=fuzzer,address "$tmp/f.c" -o "$tmp/f" >"$tmp/log" 2>&1
    rc=$?
    if ((rc != 0)); then
        cat "$tmp/log"
        say "spin: clang-14 cannot link -fsanitize=fuzzer (is libclang-rt-14-dev installed?)"
    fi
    rm -rf "$tmp"
    return "$rc"
}

cmd_test() {
    # A failure before the steps still ends with the closing line CI reads.
    if ! (ensure_packages); then
        python3 "$ROOT/.ci/summary.py" --step "packages:1:"
        return 1
    fi
    INSTALLED=
    local t_all
    t_all=$(now)
    # The whole run within SPIN_BUDGET seconds (default 23 minutes: CI allows 25).
    local budget=${SPIN_BUDGET:-1380}
    [[ $budget =~ ^[0-9]+$ ]] || budget=1380
    DEADLINE=$(awk -v t="$t_all" -v b="$budget" 'BEGIN { printf "%d", t + b }')
    # Stale logs of every build dir this command uses are removed up front.
    rm -f build-{debug,ubsan,tsan,release,valgrind,aarch64,fuzz}/meson-logs/{testlog,benchlog}*.json

    heading "debug: gcc, ASan + UBSan, SP_DEBUG=1 -> suites unit, death, concurrency"
    if build_step debug build-debug DEBUG_ENV DEBUG_OPTS; then
        test_step debug-tests build-debug testlog --suite unit --suite death --suite concurrency
    fi

    heading "ubsan: gcc, UBSan alone (glibc's allocator), SP_DEBUG=1 -> suite unit"
    if build_step ubsan build-ubsan UBSAN_ENV UBSAN_OPTS; then
        test_step ubsan-tests build-ubsan testlog --suite unit
    fi

    heading "tsan: clang-14, ThreadSanitizer -> suite concurrency"
    if build_step tsan build-tsan TSAN_ENV TSAN_OPTS; then
        test_step tsan-tests build-tsan testlog --suite concurrency
    fi

    heading "release: gcc -O3, SP_DEBUG=0 -> suites unit, soak, benchmark smoke"
    if build_step release build-release RELEASE_ENV RELEASE_OPTS; then
        test_step release-tests build-release testlog --suite unit --suite soak
        [[ -n ${CI:-} ]] && hugetlb_step build-release
        if has_benchmarks build-release; then
            test_step release-bench-smoke build-release benchlog --benchmark
        else
            # libbenchmark-dev and g++ are installed by now: no benchmarks means a broken setup.
            say "spin: no benchmarks registered in build-release: smoke not run"
            record release-bench-smoke 1
        fi
    fi

    heading "valgrind: gcc, -Dvalgrind=true client requests -> suite valgrind"
    if build_step valgrind build-valgrind VALGRIND_ENV VALGRIND_OPTS; then
        test_step valgrind-tests build-valgrind testlog --suite valgrind
    fi

    heading "aarch64: cross-compile library, tests and demo (built, not run)"
    if build_step aarch64 build-aarch64 AARCH64_ENV AARCH64_OPTS; then
        record aarch64-cross-build 0
    fi

    heading "fuzz: clang-14 libFuzzer, ASan + UBSan -> suite fuzz"
    local rc
    timed "fuzz: libFuzzer link check" check_libfuzzer
    rc=$?
    if ((rc != 0)); then
        record fuzz-libfuzzer-check "$rc"
    elif build_step fuzz build-fuzz FUZZ_ENV FUZZ_OPTS; then
        test_step fuzz-tests build-fuzz testlog --suite fuzz
    fi

    heading "timings"
    printf '  %s\n' "${TIMINGS[@]}"
    printf '  %-26s %7s s\n' "total" "$(elapsed "$t_all")"
    echo
    python3 "$ROOT/.ci/summary.py" "${STEPS[@]}"
    rc=$?
    # summary.py prints the closing line last; nothing may be printed after it.
    if ((rc != 0 || STATUS != 0)); then
        return 1
    fi
    return 0
}

# ---- demo, bench -------------------------------------------------------------------------

cmd_demo() {
    ensure_packages DEMO_PACKAGES
    setup_dir build-release RELEASE_ENV RELEASE_OPTS || die "configuring build-release failed"
    meson compile -C build-release spindle-demo </dev/null || die "building the demo failed"
    exec build-release/demos/spindle-demo "$@"
}

# Areas with a built bench_AREA executable in build-release/bench. bench/run AREA runs
# bench_AREA and every bench_AREA_* (the same benchmark with a peer allocator as the process
# malloc), so a name that extends another one with "_..." is not an area of its own.
bench_areas() {
    [[ -d build-release/bench ]] || return 0
    local names=() name other keep
    mapfile -t names < <(find build-release/bench -maxdepth 1 -type f -perm -u+x \
        -name 'bench_*' ! -name '*.*' -printf '%f\n' | sed 's/^bench_//' | sort -u)
    for name in "${names[@]}"; do
        keep=1
        for other in "${names[@]}"; do
            [[ $name == "$other"_* ]] && keep=0
        done
        ((keep)) && printf '%s\n' "$name"
    done
}

cmd_bench() {
    local areas=() flags=() arg
    while (($#)); do
        arg=$1
        shift
        case $arg in
        --)
            flags+=(-- "$@") # Google Benchmark flags, for bench/run to pass on
            break
            ;;
        --repetitions)
            (($#)) || die "--repetitions needs a number"
            flags+=("$arg" "$1")
            shift
            ;;
        -*) flags+=("$arg") ;;
        *) areas+=("$arg") ;;
        esac
    done

    local known=() src
    for src in bench/*_bench.c; do
        src=${src#bench/}
        known+=("${src%_bench.c}")
    done
    for arg in "${areas[@]}"; do # known from the sources, before a build of several minutes
        [[ " ${known[*]} " == *" $arg "* ]] || die "unknown bench area '$arg' (areas: ${known[*]})"
    done
    ensure_packages
    setup_dir build-release RELEASE_ENV RELEASE_OPTS || die "configuring build-release failed"
    meson compile -C build-release </dev/null || die "building build-release failed"
    [[ -f bench/run ]] || die "bench/run does not exist yet"
    local runner=(bench/run) first=
    if [[ ! -x bench/run ]]; then
        read -r first <bench/run
        case $first in
        *python*) runner=(python3 bench/run) ;;
        *) runner=(bash bench/run) ;;
        esac
    fi

    if ((${#areas[@]} == 0)); then
        mapfile -t areas < <(bench_areas)
        ((${#areas[@]} > 0)) ||
            die "no bench_* executables in build-release/bench (is libbenchmark-dev installed?)"
    fi

    local area failed=()
    for area in "${areas[@]}"; do
        heading "bench: $area"
        "${runner[@]}" build-release "$area" "${flags[@]}" </dev/null || failed+=("$area")
    done
    if ((${#failed[@]} > 0)); then
        die "benchmarks failed: ${failed[*]}"
    fi
    for area in "${areas[@]}"; do
        say "results: build-release/bench/$area.json"
    done
}

# ---- main --------------------------------------------------------------------------------

# Everything runs from main, and the last line exits: bash reads a script as it goes, so this
# keeps an edit of this file during a long run from being executed by that run.
main() {
    local cmd=${1:-help}
    (($#)) && shift
    case $cmd in
    demo) cmd_demo "$@" ;;
    test)
        if (($# != 0)); then
            printf 'spin: test takes no arguments\n' >&2
            python3 "$ROOT/.ci/summary.py" --step "arguments:1:"
            return 1
        fi
        cmd_test
        ;;
    bench) cmd_bench "$@" ;;
    help | -h | --help) usage ;;
    *)
        printf 'spin: unknown command: %s\n\n' "$cmd" >&2
        usage >&2
        return 2
        ;;
    esac
}

main "$@"; exit $?
