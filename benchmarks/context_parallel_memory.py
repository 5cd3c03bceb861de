"""What context parallelism buys in memory: the longest sequence whose training step fits a budget.

Launch:  python benchmarks/context_parallel_memory.py [--budget 24MiB] [--json]
         (it launches `mpiexec -n C` itself for C = 1, 2, 4; memory only, so exact and fast)

One training step of a Llama-block GPT (d_model 64, 4 heads, 2 key/value heads, 2 blocks, SwiGLU
width 128, batch 1, float32, AdamW; no learned positions, so the parameters do not grow with T) is
run at sequence lengths T (multiples of 8, so that every cp divides T into 2·cp chunks) on C ranks
with --cp C. The memory ledger (refimpl/memory.py) measures each rank's peak: parameters,
gradients, optimizer states and the saved activations at their peak after the forward. The
longest T whose largest per-rank peak fits --budget is found by bisection over the measured peaks
(the peak grows with T).

What to expect. At cp 1 attention keeps its probabilities (b·H·T² elements per block) for the
backward; ring attention at cp ≥ 2 keeps q, k, v, the output and the per-row log-sum-exp of the
rank's T/C tokens and recomputes each block's scores in the backward (FlashAttention's trade), so
a rank's activations are linear in T/C: the longest T grows by about C between cp 2 and cp 4, and
jumps from cp 1 because the quadratic term is gone. The block scores the ring computes for one
pair of chunks are transient (freed before the next block) and are not saved, so the ledger does
not count them; the model state is the same on every rank (parameters replicated over cp).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
MODEL = ["--model", "gpt", "--arch", "llama", "--d-model", "64", "--n-head", "4", "--kv-heads", "2",
         "--ffn-size", "128", "--n-layer", "2", "--batch-size", "1", "--dtype", "float32", "--optimizer", "adamw"]


def peaks(lengths: list[int]) -> list[int]:
    """Under mpiexec -n C: for each T, the largest per-rank ledger peak of one step at --cp C (collective)."""
    from refimpl.parallel.comm import get_world  # noqa: PLC0415 - the measuring child imports refimpl alone
    from refimpl.tools.flags import config_from_flags  # noqa: PLC0415 - as above
    from refimpl.tools.run import build_model, build_task, make_trainer  # noqa: PLC0415 - as above

    world = get_world()
    out = []
    for T in lengths:
        cfg = config_from_flags([*MODEL, "--seq-len", T, "--cp", world.size, "--steps", 1])
        task = build_task(cfg)
        model = build_model(cfg, task)
        trainer = make_trainer(cfg, model, world, distributed=True)
        x, y = task.batch(0, cfg.batch_size)
        trainer.step(x, y)
        out.append(int(world.allreduce_value(float(trainer.ledger.peak_total), "max")))
    return out


def measured(cp: int, lengths: list[int]) -> list[int]:
    """The peaks at each T, measured by a child under mpiexec -n cp."""
    done = subprocess.run(["mpiexec", "-n", str(cp), sys.executable, str(HERE), "--child",
                           ",".join(map(str, lengths))], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the child at cp {cp} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def longest(cp: int, budget: int) -> tuple[int, int, int]:
    """(longest T that fits, its peak, the next T's peak): doubling, then bisection on multiples of 8."""
    low, high = 8, 16
    while measured(cp, [high])[0] <= budget:
        low, high = high, 2 * high
    while high - low > 8:
        mid = (low + high) // 16 * 8
        if measured(cp, [mid])[0] <= budget:
            low = mid
        else:
            high = mid
    fit, over = measured(cp, [low, low + 8])
    return low, fit, over


def parse_bytes(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * factor)
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=parse_bytes, default=parse_bytes("24MiB"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = peaks([int(t) for t in args.child.split(",")])
        from refimpl.parallel.comm import get_world  # noqa: PLC0415 - as in peaks()
        if get_world().rank == 0:
            print(json.dumps(result))
        return 0
    rows = []
    for cp in (1, 2, 4):
        T, fit, over = longest(cp, args.budget)
        rows.append({"cp": cp, "longest_seq_len": T, "peak_bytes": fit, "next_seq_len": T + 8, "next_peak_bytes": over})
    if args.json:
        print(json.dumps({"budget_bytes": args.budget, "rows": rows}))
        return 0
    print(f"Longest sequence whose training step fits {args.budget / 2**20:g} MiB per rank (ledger peak, exact):")
    print("| cp | longest T | peak per rank (bytes) | T + 8: peak (bytes) | vs cp 1 |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['cp']} | {row['longest_seq_len']} | {row['peak_bytes']:,} | {row['next_peak_bytes']:,} | "
              f"{row['longest_seq_len'] / rows[0]['longest_seq_len']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
