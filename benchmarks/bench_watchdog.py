"""What the watchdog and the agreement checks cost: training with and without them.

Launch:  python benchmarks/bench_watchdog.py [--ranks 2] [--repeats 5] [--json] [-- TRAIN FLAGS]

Runs the same `train` command under `mpiexec -n RANKS`, alternating two variants, --repeats times
each:

  with     as every run is: the watchdog thread (refimpl/tools/runtime/watchdog.py; every blocking MPI call
           records what it waits for) and, before step 1, the agreement on flags, data and model
           (refimpl/tools/runtime/agreement.py);
  without  --timeout 0 (no watchdog thread, no call watched) and the agreement replaced by nothing.

Each run measures, on rank 0, the wall time of the whole command (startup, agreement, steps,
evaluation); reported: the medians per variant, per step, and the overhead (with / without − 1),
measured in one run. The issue's target: at most 2% of step time. The default command is the GPT
demo (40 steps on 2 ranks); pass others after `--`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from refimpl.tools.runtime.launcher import find_mpiexec, launcher_rank, without_launcher

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRAIN = ["--model", "gpt", "--steps", "40"]


def one_run() -> None:
    """Inside mpiexec: run `train` as the variant says, print rank 0's wall seconds."""
    variant, flags = sys.argv[2], sys.argv[3:]
    from refimpl.tools import cli
    from refimpl.tools import run as train
    from refimpl.tools.commands import train as train_command  # noqa: PLC0415
    from refimpl.tools.runtime import agreement

    if variant == "without":
        flags = flags + ["--timeout", "0"]
        train.check_same_run = agreement.check_same_run = lambda *args: None
    summaries = []
    original = train.train
    train_command.train = lambda *a, **k: summaries.append(original(*a, **k)) or summaries[-1]
    start = time.perf_counter()
    code = cli.main(["train", *flags])
    seconds = time.perf_counter() - start
    if launcher_rank() == 0:
        print(json.dumps({"seconds": seconds, "step_seconds": summaries[0]["seconds"]}), flush=True)
    sys.exit(code)


def measure(ranks: int, variant: str, flags: list[str]) -> dict:
    env = without_launcher()
    command = [find_mpiexec() or "mpiexec", "-n", str(ranks), sys.executable, __file__, "--one-run", variant, *flags]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{variant} run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one-run":
        return one_run()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("train", nargs=argparse.REMAINDER, help="train flags after --")
    args = parser.parse_args()
    flags = (args.train[1:] if args.train[:1] == ["--"] else args.train) or DEFAULT_TRAIN
    steps = int(flags[flags.index("--steps") + 1]) if "--steps" in flags else None
    runs = {"with": [], "without": []}
    for _ in range(args.repeats):  # alternate, so that a slow spell of the machine hits both
        for variant in runs:
            runs[variant].append(measure(args.ranks, variant, flags))
    result = {"ranks": args.ranks, "train": flags, "repeats": args.repeats, "runs": runs}
    for what in ("seconds", "step_seconds"):  # the whole command; the training steps alone
        medians = {variant: statistics.median(r[what] for r in values) for variant, values in runs.items()}
        result[what] = {"median": medians, "overhead": medians["with"] / medians["without"] - 1}
    if args.json:
        print(json.dumps(result))
        return
    print(f"train {' '.join(flags)} on {args.ranks} ranks, medians of {args.repeats} runs each:")
    for what, title in (("seconds", "whole command"), ("step_seconds", "training steps")):
        medians = result[what]["median"]
        print(f"  {title}: with {medians['with']:.3f} s, without {medians['without']:.3f} s"
              + (f" ({1000 * medians['with'] / steps:.1f} vs {1000 * medians['without'] / steps:.1f} ms per step)"
                 if steps else "")
              + f": overhead {100 * result[what]['overhead']:+.2f}% (target <= 2%)")


if __name__ == "__main__":
    main()
