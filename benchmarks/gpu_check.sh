#!/usr/bin/env bash
# Launch: bash benchmarks/gpu_check.sh        (OUT=DIR to keep the figures; PYTHON=... for another Python;
#                                             BENCH_ARGS="--configs small --repeats 1" for a shorter step 4)
#
# The GPU check of refimpl's CuPy backend, from the source tree (PYTHONPATH=., no install step), on a
# machine with a GPU and CuPy but possibly no MPI library and no network:
#
#   1. gpu_tests     the `gpu` tests (tests/test_gpu.py): every op, GPT steps, host staging, a
#                    pipeline, mixed precision and the memory ledger on the GPU, against NumPy
#   2. verify_dp     python -m refimpl verify --backend cupy            (data parallel, one process)
#   3. verify_zero3  python -m refimpl verify --backend cupy --zero 3   (ZeRO-3, one process)
#   4. bench         GPT training-step time, CPU (NumPy) vs GPU (CuPy)  (benchmarks/bench_gpu.py)
#
# Needs Python with numpy, cupy (reaching a GPU), pytest and hypothesis. Each step has a time
# limit, a safety net against a hang only, far above the step's normal time (through the CPU
# stand-in the whole check takes about 12 s on an idle 2-core machine and 70 s on a loaded one), so
# that a slow machine does not fail it. Exit status 0 when every step passed, 1 otherwise,
# 2 when a prerequisite is missing. The figures -- one JSON object: each step's exit status and
# seconds, the verify results, the benchmark -- are printed last and, when OUT is set, written to
# $OUT/gpu_check.json, with every step's output in $OUT/gpu_check.log.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export REFIMPL_REQUIRE_GPU=1  # tests/test_gpu.py fails, rather than skips, without a GPU
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; LOG="$OUT/gpu_check.log"; else LOG="$WORK/gpu_check.log"; fi
: > "$LOG"
START=$SECONDS

# -- prerequisites --------------------------------------------------------------------------------
if ! "$PY" - > "$WORK/prerequisites.out" 2>&1 <<'EOF'
import importlib.util, sys
missing = [m for m in ("numpy", "pytest", "hypothesis") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {', '.join(missing)} (pip install {' '.join(missing)})")
from refimpl import backend
why = backend.cupy_unavailable()
if why:
    sys.exit(why)
import cupy
name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
print(f"CuPy {cupy.__version__} on {name.decode() if isinstance(name, bytes) else name}")
EOF
then
    cat "$WORK/prerequisites.out" >&2
    echo "gpu_check: cannot run here (above)" >&2
    exit 2
fi
cat "$WORK/prerequisites.out" | tee -a "$LOG" >&2

# -- the steps ------------------------------------------------------------------------------------
# step NAME LIMIT_SECONDS COMMAND...: run it, keep stdout in $WORK/NAME.out, log both streams.
step() {
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $*" | tee -a "$LOG" >&2
    local began=$SECONDS
    timeout "$limit" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err"
    local status=$?
    cat "$WORK/$name.err" "$WORK/$name.out" >> "$LOG"
    tail -n 3 "$WORK/$name.err" >&2
    [ "$status" -eq 124 ] && echo "   (stopped at its limit of $limit s)" | tee -a "$LOG" >&2
    echo "$status $((SECONDS - began))" > "$WORK/$name.status"
    echo "== $name: exit $status after $((SECONDS - began)) s" | tee -a "$LOG" >&2
}

# The two verify runs that step 1 would repeat are steps 2 and 3.
# Limits: through the stand-in on an idle 2-core machine the steps take about 6, 1, 1 and 4 s (the
# default benchmark about 40 s), up to 6 times that under load; on a GPU, CuPy also compiles each
# kernel on its first use.
step gpu_tests 600 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "not verify-dp and not verify-zero3"
step verify_dp 240 "$PY" -m refimpl verify --backend cupy --json
step verify_zero3 240 "$PY" -m refimpl verify --backend cupy --zero 3 --json
step bench 600 "$PY" benchmarks/bench_gpu.py ${BENCH_ARGS:-}

# -- the figures ----------------------------------------------------------------------------------
"$PY" - "$WORK" "$((SECONDS - START))" > "$WORK/figures.json" <<'EOF'
import json, sys
from pathlib import Path
work, seconds = Path(sys.argv[1]), int(sys.argv[2])

def last_json(name):
    lines = [line for line in (work / f"{name}.out").read_text().splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return None

steps = {}
for name in ("gpu_tests", "verify_dp", "verify_zero3", "bench"):
    status, took = (work / f"{name}.status").read_text().split()
    steps[name] = {"exit": int(status), "seconds": int(took)}
tests = [line for line in (work / "gpu_tests.out").read_text().splitlines() if line.strip()]
keys = ("ok", "backend", "trainer", "world_size", "steps", "max_abs_diff", "max_rel_diff", "tolerance_used")
verify = {name: {**{k: v for k, v in (last_json(name) or {}).items() if k in keys},
                 "strategy": ((last_json(name) or {}).get("trainer_report") or {}).get("strategy")}
          for name in ("verify_dp", "verify_zero3")}  # the strategy: from the trainer's own report
ok = all(s["exit"] == 0 for s in steps.values())
print(json.dumps({"ok": ok, "seconds": seconds, "steps": steps, "gpu_tests": tests[-1] if tests else None, **verify,
                  "bench": last_json("bench")}))
sys.exit(0 if ok else 1)
EOF
passed=$?
cat "$WORK/figures.json" >> "$LOG"
[ -n "${OUT:-}" ] && cp "$WORK/figures.json" "$OUT/gpu_check.json"
cat "$WORK/figures.json"
if [ "$passed" -ne 0 ]; then
    echo "gpu_check: FAILED after $((SECONDS - START)) s: a step above exited non-zero${OUT:+ (log: $LOG)}" >&2
    exit 1
fi
echo "gpu_check: passed in $((SECONDS - START)) s" >&2
