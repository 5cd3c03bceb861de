"""Runs refused before anything is allocated (refimpl/tools/runtime/preflight.py): the estimate,
and what a refusal says.

Launch: python benchmarks/preflight_demo.py [--limit 64GB]
(it starts `python -m refimpl train ...` and `mpiexec -n 2 python -m refimpl train ...` itself,
with REFIMPL_MEMORY_LIMIT set, so that what it prints does not depend on this machine's memory)

Prints the estimate of the demo run, part by part, then each command with the one line it is
refused with: the issue's three huge flags, and a run on 2 ranks each of which fits the limit
while their sum on one host does not. Everything it prints is computed from the flags, so
docs/zero.md shows it verbatim.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from refimpl.memory import parse_bytes  # noqa: E402
from refimpl.tools.flags import add_run_arguments as add_arguments  # noqa: E402
from refimpl.tools.flags import config_from_args  # noqa: E402
from refimpl.tools.run import TrainConfig, build_task  # noqa: E402
from refimpl.tools.runtime import preflight  # noqa: E402
from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher  # noqa: E402

HUGE = (["--n-layer", "1000000"], ["--seq-len", "10000000"], ["--batch-size", str(10**12)])
TWO_RANKS = ["--steps", "2", "--batch-size", "8", "--zero", "1"]


def estimates(flags: list[str], world: int) -> list[preflight.Estimate]:
    """Every rank's estimate for `train FLAGS` on `world` ranks."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg: TrainConfig = config_from_args(parser.parse_args(flags))
    task = build_task(cfg)
    sizes = (task.vocab_size, task.seq_len)
    return [preflight.estimate(cfg, *sizes, world, rank, preflight._task_bytes(task)) for rank in range(world)]


def refusal(argv: list[str], limit: str) -> str:
    env = without_launcher()
    env[preflight.LIMIT_VARIABLE] = limit
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    if done.returncode != 2 or len(lines) != 1:
        raise RuntimeError(f"{' '.join(argv)} was not refused in one line (exit {done.returncode}):\n"
                           f"{done.stderr[-2000:]}")
    return lines[0]


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first sentence
    p.add_argument("--limit", default="64GB", help="REFIMPL_MEMORY_LIMIT for the single-process runs")
    args = p.parse_args()
    parse_bytes(args.limit)
    demo = estimates([], 1)[0]
    print(f"python -m refimpl train: about {preflight._size(demo.total)} per rank ({demo.describe()})\n")
    for flags in HUGE:
        print(f"$ {preflight.LIMIT_VARIABLE}={args.limit} python -m refimpl train {' '.join(flags)}")
        print(refusal([sys.executable, "-m", "refimpl", "train", *flags], args.limit) + "\n")
    each = [e.total for e in estimates(TWO_RANKS, 2)]
    limit = f"{(max(each) + sum(each)) // 2 // 10**6}MB"  # one rank fits, two do not
    mpiexec = find_mpiexec() or "mpiexec"
    print(f"each rank: {', '.join(preflight._size(t) for t in each)}")
    print(f"$ {preflight.LIMIT_VARIABLE}={limit} mpiexec -n 2 python -m refimpl train {' '.join(TWO_RANKS)}")
    print(refusal([mpiexec, "-n", "2", sys.executable, "-m", "refimpl", "train", *TWO_RANKS], limit))


if __name__ == "__main__":
    main()
