# run_lib.sh - sourced by the device scripts (device_run, decode_run,
# profile_run, quick_run): the log folder L ($1 of the script), NCCL without
# NVLink SHARP, the GPU count ngpu, and
#   t NAME SECONDS CMD...   CMD under a timeout, its output in $L/NAME.log,
#                           one line: exit status, seconds, the result lines
set -u
L=${1:-/tmp/$(basename "$0" .sh)}
mkdir -p "$L"
export NCCL_NVLS_ENABLE=0
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
t() {
    local n=$1 s=$2
    shift 2
    local a=$(date +%s)
    timeout -k 5 "$s" "$@" >"$L/$n.log" 2>&1
    local rc=$?
    echo "$n rc=$rc $(($(date +%s) - a))s: $(grep -E 'passed, [0-9]+ failed|ERROR SUMMARY|RACECHECK SUMMARY|^FAIL' "$L/$n.log" | tail -3 | tr '\n' ' ')"
}
