"""How fast `plan` answers, and the picture of its search.

Launch:  python benchmarks/bench_plan.py [--picture docs/images/plan_search.png]

Issue 18 asks that `plan` for a 1T-parameter model on 4096 GPUs answers in under 30 s on one core
of this kind of machine. This runs that search (and two smaller ones) in this process, with one
BLAS thread (the search is pure Python: NumPy is not used), prints the seconds, the candidates
searched and simulated, and with --picture draws the 1T search (memory per GPU against step time;
matplotlib). Timings are this machine's on this run: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refimpl.tools.cluster.hardware import PRESETS  # noqa: E402
from refimpl.tools.cluster.model import Run  # noqa: E402
from refimpl.tools.cluster.plan import plan, shape_for  # noqa: E402

CASES = (("1.3B", 64, "a100-80gb", 512), ("70B", 1024, "h100-80gb", 1024), ("1T", 4096, "h100-80gb", 3072))
LIMIT_SECONDS = 30.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--picture", help="draw the 1T search here (matplotlib)")
    args = p.parse_args(argv)
    print(f"{'model':>6} {'GPUs':>5} {'cluster':<10} {'searched':>8} {'fit':>6} {'seconds':>8}  best")
    worst = 0.0
    for params, gpus, cluster, batch in CASES:
        name, L, h, a = shape_for(float(params[:-1]) * {"B": 1e9, "T": 1e12}[params[-1]])
        base = Run(L, h, a, 2048, 51200, batch, tie_weights=True)
        began = time.process_time()  # CPU seconds of this process: one core
        result = plan(base, gpus, PRESETS[cluster])
        seconds = time.process_time() - began
        worst = max(worst, seconds) if params == "1T" else worst
        r = result.best[0].run
        print(f"{params:>6} {gpus:>5} {cluster:<10} {result.searched:>8} {result.fitting:>6} {seconds:8.2f}  "
              f"dp {r.dp} × tp {r.tp} × pp {r.pp}, ZeRO-{r.zero}, {r.checkpoint}, "
              f"{r.schedule if r.pp > 1 else 'no pipeline'}, micro-batch {r.micro_batch_size}, "
              f"MFU {100 * result.best[0].mfu:.1f}%")
        if args.picture and params == "1T":
            from refimpl.tools.commands.plan import draw
            draw(result, PRESETS[cluster], args.picture)
            print(f"wrote {args.picture}")
    verdict = "under" if worst < LIMIT_SECONDS else "OVER"
    print(f"1T on 4096 GPUs: {worst:.1f} CPU seconds, {verdict} the {LIMIT_SECONDS:.0f} s the issue asks for")
    return 0


if __name__ == "__main__":
    sys.exit(main())
