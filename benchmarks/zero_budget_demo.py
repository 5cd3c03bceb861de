"""The budget demo: the same GPT on the same 4 ranks, one per-rank memory budget, every stage.

Launch: python benchmarks/zero_budget_demo.py [--world 4] [--budget 1.2MB]
(it starts `mpiexec -n WORLD python -m refimpl train --mem-budget BUDGET --zero STAGE ...` itself)

Prints, for DP and each ZeRO stage, whether two training steps fit in the budget and, if not, the
out-of-memory error the ledger raised (the category that overflowed, what was held). Everything it
prints is exact (bytes counted by refimpl/memory.py), so docs/zero.md shows it verbatim.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from refimpl.memory import STAGE_NAMES, format_bytes, parse_bytes  # noqa: E402
from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--budget", default="1.2MB")
    args = p.parse_args()
    parse_bytes(args.budget)
    mpiexec = find_mpiexec() or "mpiexec"
    env = without_launcher()
    flags = ["-m", "refimpl", "train", "--model", "gpt", "--steps", "2", "--batch-size", str(2 * args.world),
             "--mem-budget", args.budget, "--json"]
    print(f"mpiexec -n {args.world} python {' '.join(flags[:-1])} --zero STAGE\n")
    for stage, name in STAGE_NAMES.items():
        for _ in range(3):  # the CLI aborts on the first rank's error; under load its message can be lost
            done = subprocess.run([mpiexec, "-n", str(args.world), sys.executable, *flags, "--zero", str(stage)],
                                  capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
            if done.returncode == 0 or "out of memory" in done.stderr:
                break
        if done.returncode == 0:
            summary = json.loads(done.stdout.strip().splitlines()[-1])
            state = summary["model_state_bytes"][0]
            peak = summary["memory_peak_bytes"][0]
            print(f"{name:<7} trains: model state {format_bytes(sum(state.values()))} "
                  f"({', '.join(f'{k.replace(chr(95), chr(32))} {format_bytes(v)}' for k, v in state.items() if v)}); "
                  f"peak {format_bytes(peak['total'])} with activations {format_bytes(peak['activations'])}, "
                  f"gradient buckets {format_bytes(peak['gradient_buckets'])}, "
                  f"gathered parameters {format_bytes(peak['gathered_parameters'])}")
            continue
        line = next((x for x in done.stderr.splitlines() if "out of memory" in x), None)
        if line is None:
            raise RuntimeError(f"stage {stage} failed without an out-of-memory error:\n{done.stderr[-2000:]}")
        message = re.sub(r"rank \d+", "rank r", line.split("error: ", 1)[1])  # whichever rank printed first
        print(f"{name:<7} fails: {message}")


if __name__ == "__main__":
    main()
