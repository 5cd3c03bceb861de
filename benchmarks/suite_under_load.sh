#!/usr/bin/env bash
# The test suite beside CPU-bound load: no test may depend on the machine's speed.
#
#   bash benchmarks/suite_under_load.sh                     # the whole suite (python -m pytest -q)
#   bash benchmarks/suite_under_load.sh tests/test_faults.py -k watchdog   # any pytest arguments
#   LOAD=4 bash benchmarks/suite_under_load.sh              # four busy processes instead of two
#
# Starts LOAD (default 2) CPU-bound processes (`python -c "while True: pass"`), runs
# `python -m pytest -q [ARGS]` beside them, and prints the number of cores, the load, pytest's
# exit status and the wall time. The load processes are stopped on every way out (a failing
# suite, Ctrl-C, a kill of this script, which stops pytest too; an mpiexec that a test started runs
# in its own session and ends on its own): trap. The exit status is pytest's.
# On 2 cores, two busy loops leave the suite about half the machine: every timing margin is
# tested. Timing claims belong in benchmarks/ (bench_overlap.py and the like), not in tests.
set -u -m  # -m: each background job in its own process group (pytest's with the MPI runs it started)
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
LOAD=${LOAD:-2}
pids=()
suite=""

stop_load() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null
    done
    pids=()
}
on_signal() {  # stop the suite too, then exit: the EXIT trap stops the load
    if [ -n "$suite" ]; then
        kill -TERM -- "-$suite" 2>/dev/null  # pytest and every process it started
        wait "$suite" 2>/dev/null
    fi
    echo "suite_under_load: interrupted; load processes stopped" >&2
    exit "$1"
}
trap stop_load EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

for _ in $(seq "$LOAD"); do
    "$PYTHON" -c "while True: pass" &
    pids+=("$!")
done
echo "suite_under_load: $(nproc) cores, ${LOAD} CPU-bound processes beside the suite (pids ${pids[*]})"

start=$(date +%s.%N)
"$PYTHON" -m pytest -q "$@" &
suite=$!
wait "$suite"  # (a wait, not a foreground child: a signal's trap runs at once)
status=$?
suite=""
end=$(date +%s.%N)
stop_load

seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.0f", b - a }')
if [ "$status" -eq 0 ]; then result=passed; else result="FAILED (pytest exit status $status)"; fi
echo "suite_under_load: python -m pytest -q $* ${result} in ${seconds} s beside ${LOAD} CPU-bound processes" \
     "on $(nproc) cores"
exit "$status"
