"""Step time of the distributed trainers, this tree against another revision of refimpl.

Launch:  python benchmarks/bench_trainers.py --baseline REV [--this REV] [--only ddp,zero3] [--ranks 2] [--repeats 5]
                                             [--steps 10] [--json]

Trains bench_engine.py's model size (d_model 256, 4 layers, 4 heads, context 128, batch 8,
float32; the sorting task, so the vocabulary is 11, not 64) for --steps steps with each
configuration below, under `mpiexec -n RANKS`, once with this tree's refimpl (or revision --this)
and once with revision REV's (each revision checked out into a temporary git worktree), alternating
the two --repeats times so that a slow spell of the machine hits both. Reported: the median of
train --json's "seconds" (the training steps only, no startup) per configuration and tree, and the
ratio this / baseline. A refactoring must leave no configuration slower beyond the run-to-run noise.

    ddp       data parallelism, bucketed                zero1..3  --zero 1, 2, 3
    pp2       --pp 2 --schedule 1f1b --micro-batches 4  (with RANKS = 2: one pipeline, dp 1)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher  # noqa: E402

MODEL = ["--model", "gpt", "--d-model", "256", "--n-layer", "4", "--n-head", "4", "--seq-len", "128",
         "--batch-size", "8", "--dtype", "float32"]
CONFIGS = {"ddp": [], "zero1": ["--zero", "1"], "zero2": ["--zero", "2"], "zero3": ["--zero", "3"],
           "pp2": ["--pp", "2", "--schedule", "1f1b", "--micro-batches", "4"]}


def seconds(tree: Path, ranks: int, steps: int, flags: list) -> float:
    """train --json's "seconds" for one run with the refimpl of `tree`."""
    env = {**without_launcher(os.environ), "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([find_mpiexec(), "-n", str(ranks), sys.executable, "-m", "refimpl", "train", *MODEL,
                           "--steps", str(steps), *flags, "--json"], capture_output=True, text=True, env=env,
                          cwd=tree, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: train {' '.join(flags)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="a git revision of refimpl to compare with")
    parser.add_argument("--this", help="a git revision to measure instead of the working tree")
    parser.add_argument("--only", help="comma-separated configurations to run (default: all)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configs = {name: CONFIGS[name] for name in (args.only.split(",") if args.only else CONFIGS)}
    with tempfile.TemporaryDirectory(prefix="refimpl_baseline_") as scratch:
        trees = {"this": ROOT}
        for tree, revision in (("this", args.this), ("baseline", args.baseline)):
            if revision is not None:
                trees[tree] = Path(scratch) / tree
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[tree]), revision],
                               check=True, capture_output=True)
        try:
            runs = {name: {tree: [] for tree in trees} for name in configs}
            for _ in range(args.repeats):
                for name, flags in configs.items():
                    for tree, path in trees.items():
                        runs[name][tree].append(seconds(path, args.ranks, args.steps, flags))
        finally:
            for path in trees.values():
                if path != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)
    result = {"baseline": args.baseline, "ranks": args.ranks, "steps": args.steps, "repeats": args.repeats,
              "configs": {}}
    for name, by_tree in runs.items():
        medians = {tree: statistics.median(values) for tree, values in by_tree.items()}
        result["configs"][name] = {"median_s": medians, "ratio": medians["this"] / medians["baseline"],
                                   "runs": by_tree}
    if args.json:
        print(json.dumps(result))
        return
    print(f"train steps on {args.ranks} ranks, {args.steps} steps, medians of {args.repeats} runs; "
          f"this tree vs {args.baseline}:")
    for name, r in result["configs"].items():
        m = r["median_s"]
        print(f"  {name:6s} this {m['this']:.3f} s, baseline {m['baseline']:.3f} s: ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
