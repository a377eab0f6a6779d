#!/usr/bin/env bash
# Runs each test binary (and tests/*.py integration tests, when present), sums
# the "N passed, N failed" line each prints, and prints the total as the last
# line. A test that crashes or prints no summary counts as one failure, and so
# does one whose summary disagrees with its own lines (FAIL lines, or more ok
# lines than it says passed: a test that wrote over the counters). A test may
# end "N passed, N failed, N skipped" (tests it could not run here, e.g. with
# no browser installed); skipped ones are counted apart, never as failures.
# --no-py: the binaries only (make asan). A binary built under the
# sanitizers (build-asan/) is named with "(asan)".
set -u
cd "$(dirname "$0")/.."
pass=0 fail=0 skip=0
py=1
if [ "${1:-}" = "--no-py" ]; then py=0; shift; fi
run_one() {
    local name=$1; shift
    local log out line p f k
    log=$(mktemp)
    "$@" >"$log" 2>&1
    local rc=$?
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$' "$log" | tail -n 1)
    k=0
    if [ -n "$line" ]; then
        p=${line%% passed*}; f=${line#*, }; f=${f%% failed*}
        case $line in *skipped) k=${line##*failed, }; k=${k%% skipped} ;; esac
    else
        p=0; f=1
    fi
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    local nfail nok
    nfail=$(grep -c '^FAIL ' "$log"); nok=$(grep -c '^ok ' "$log")
    if [ "$nfail" -gt "$f" ]; then f=$nfail; fi
    if [ "$nok" -gt "$p" ]; then p=$nok; [ "$f" -eq 0 ] && f=1; fi
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + k))
    if [ "$f" -ne 0 ]; then
        echo "== $name: FAILED (exit $rc)"; grep -v '^ok ' "$log" | tail -n 40
    elif [ "$k" -ne 0 ]; then
        echo "== $name: $p passed, $k skipped: $(grep -m1 '^skip' "$log")"
    else
        echo "== $name: $p passed"
    fi
    rm -f "$log"
}
for t in "$@"; do
    case $t in
    build-asan/*) run_one "$(basename "$t") (asan)" "$t" ;;
    *) run_one "$(basename "$t")" "$t" ;;
    esac
done
for t in tests/test_*.py; do
    [ "$py" = 1 ] && [ -e "$t" ] || continue
    run_one "$(basename "$t")" python3 "$t"
done
if [ "$skip" -ne 0 ]; then echo "$pass passed, $fail failed, $skip skipped"; else echo "$pass passed, $fail failed"; fi
[ "$fail" -eq 0 ]
