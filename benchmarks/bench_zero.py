"""The largest GPT that trains under a fixed per-rank memory budget, for DP and each ZeRO stage.

Launch: python benchmarks/bench_zero.py [--world 4] [--budget 16MB] [--d-model 128] [--json]
(it starts `mpiexec -n WORLD python -m refimpl train ...` itself, once per trial)

For each stage, at N = --world ranks, it searches the largest --n-layer (GPT of width --d-model,
float32 Adam) for which `train --zero STAGE --mem-budget BUDGET` runs a step without an
out-of-memory error from the ledger (refimpl/memory.py), and prints its Ψ next to the analytic
ratio of the ZeRO paper (arXiv 1910.02054): model states cost, per parameter,

    DP 16  :  ZeRO-1 8 + 8/N  :  ZeRO-2 4 + 12/N  :  ZeRO-3 16/N   bytes     (float32 Adam)

so the largest Ψ should grow as 16 / those. The measured growth is smaller: the budget also holds
what the formula leaves out -- saved activations (which grow with the depth), gradient buckets and
reduce-scatter outputs, and under ZeRO-3 the gathered parameters of one layer.

Then, at DP's largest size, it times --steps training steps of every stage and prints the time per
step relative to DP, measured in this one run (ranks may outnumber cores: only the ratios mean
something, and only on this machine).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from refimpl.memory import STAGE_NAMES, format_bytes, parse_bytes  # noqa: E402
from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher  # noqa: E402


def launch(args, world: int, stage: int, n_layer: int, steps: int, budget: int | None) -> dict | None:
    """One training run; its --json summary, or None if it ran out of its memory budget."""
    cmd = [find_mpiexec() or "mpiexec", "-n", str(world), sys.executable, "-m", "refimpl", "train", "--model", "gpt",
           "--n-layer", str(n_layer), "--d-model", str(args.d_model), "--n-head", str(args.n_head),
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(steps),
           "--dtype", "float32", "--zero", str(stage), "--json"]
    if budget is not None:
        cmd += ["--mem-budget", str(budget)]
    env = without_launcher()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    if "out of memory on rank" in done.stderr:
        return None
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")


def largest(args, stage: int, budget: int, start: int) -> tuple[int, dict | None]:
    """The largest n_layer that fits (0 if none), by doubling from `start` and then bisecting."""
    fits: dict[int, dict | None] = {}

    def trial(n: int) -> bool:
        if n not in fits:
            fits[n] = launch(args, args.world, stage, n, 1, budget)
        return fits[n] is not None

    if not trial(1):
        return 0, None
    lo, hi = 1, max(2, start)
    while hi <= args.max_layers and trial(hi):  # grow
        lo, hi = hi, 2 * hi
    hi = min(hi, args.max_layers + 1)
    while hi - lo > 1:  # bisect: lo fits, hi does not (or is past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if trial(mid) else (lo, mid)
    return lo, fits.get(lo)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--budget", type=parse_bytes, default=parse_bytes("16MB"))
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: 1 example per rank)")
    p.add_argument("--steps", type=int, default=6, help="timed steps at DP's largest size")
    p.add_argument("--max-layers", type=int, default=96)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.batch_size = args.batch_size or args.world
    n = args.world
    per_param = {0: 16, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}
    rows, start = [], 2
    for stage in STAGE_NAMES:
        layers, summary = largest(args, stage, args.budget, start)
        start = max(1, layers)
        psi = summary["n_params"] if summary else 0
        peak = summary["memory_peak_bytes"][0] if summary else {}
        rows.append({"stage": stage, "name": STAGE_NAMES[stage], "bytes_per_param": per_param[stage],
                     "analytic_ratio": 16 / per_param[stage], "n_layer": layers, "params": psi,
                     "model_state": sum(summary["model_state_bytes"][0].values()) if summary else 0, "peak": peak})
    dp = rows[0]
    for row in rows:
        row["measured_ratio"] = row["params"] / dp["params"] if dp["params"] else None
    timing_layers = max(1, dp["n_layer"])
    for row in rows:  # the same model for every stage: DP's largest, no budget
        launch(args, n, row["stage"], timing_layers, 1, None)  # warm the file cache
        summary = launch(args, n, row["stage"], timing_layers, args.steps, None)
        row["seconds_per_step"] = summary["seconds"] / args.steps
    for row in rows:
        row["time_vs_dp"] = row["seconds_per_step"] / dp["seconds_per_step"]
    print(f"ZeRO at N = {n}, budget {format_bytes(args.budget)} per rank, GPT d_model {args.d_model}, seq_len "
          f"{args.seq_len}, {args.batch_size // n} example(s) per rank, float32 Adam\n")
    print(f"{'stage':<7} {'bytes/Ψ':>7} {'analytic':>8} {'n_layer':>7} {'largest Ψ':>10} {'measured':>8} "
          f"{'model state':>11} {'activations':>11} {'buckets':>9} {'gathered':>9} {'time/step':>9}")
    print(f"{'':<7} {'':>7} {'Ψ ratio':>8} {'':>7} {'':>10} {'Ψ ratio':>8} {'at Ψ max':>11} {'peak':>11} "
          f"{'peak':>9} {'peak':>9} {'vs DP':>9}")
    for row in rows:
        peak = row["peak"]
        print(f"{row['name']:<7} {row['bytes_per_param']:>7.2f} {row['analytic_ratio']:>8.2f} {row['n_layer']:>7} "
              f"{row['params']:>10,} {row['measured_ratio']:>8.2f} {format_bytes(row['model_state']):>11} "
              f"{format_bytes(peak.get('activations', 0)):>11} {format_bytes(peak.get('gradient_buckets', 0)):>9} "
              f"{format_bytes(peak.get('gathered_parameters', 0)):>9} {row['time_vs_dp']:>9.2f}")
    print(f"\n(time per step at n_layer {timing_layers} for every stage, without a budget; {args.steps} steps each)")
    if args.json:
        print(json.dumps({"world": n, "budget": args.budget, "d_model": args.d_model, "rows": rows,
                          "timing_n_layer": timing_layers}))


if __name__ == "__main__":
    main()
