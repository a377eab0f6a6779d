#!/usr/bin/env bash
# backend_check.sh NAME LOG... - whether every server log given (globs the
# shell left unexpanded are skipped) says its servers ran on backend NAME:
# each "ready" line names the backend, and none names another. Prints one
# "ok"/"FAIL" line a log and "N passed, N failed".
set -u
want=$1
shift
p=0 f=0
for l in "$@"; do
    [ -f "$l" ] || continue
    n=$(grep -c "(backend $want," "$l")
    other=$(grep -E "ready on .*\(backend " "$l" | grep -vc "(backend $want,")
    if [ "$n" -gt 0 ] && [ "$other" -eq 0 ]; then
        echo "ok   $l: $n servers on $want"
        p=$((p + 1))
    else
        echo "FAIL $l: $n servers on $want, $other on another backend"
        f=$((f + 1))
    fi
done
[ $((p + f)) -gt 0 ] || { echo "FAIL no server log found"; f=1; }
echo "$p passed, $f failed"
[ $f -eq 0 ]
