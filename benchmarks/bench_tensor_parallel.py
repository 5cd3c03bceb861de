"""Tensor parallelism at 4 ranks: the widest GPT under a memory budget, and the cost of tp's all-reduces.

Launch:  python benchmarks/bench_tensor_parallel.py [--only memory|timing] [--no-extras] [--json]
(it starts every `mpiexec` itself, through refimpl.tools.runtime.launcher's find_mpiexec and
without_launcher; do not run it under mpiexec)

(1) Memory. At --world 4 ranks and --budget 16MB per rank (decimal, as --mem-budget reads it), the
    widest GPT (--n-layer 4, --n-head 8, d_model a multiple of the head count; sorting task,
    --seq-len 16, global --batch-size 4, float32 AdamW) for which

        mpiexec -n 4 python -m refimpl train --model gpt --d-model D ... --steps 2 --mem-budget 16MB FLAGS

    exits 0, for FLAGS = `--tp 4` (one model cut over 4 ranks, dp 1), none (plain data parallelism,
    dp 4) and `--zero 3` (dp 4, everything sharded); extra rows (unless --no-extras): tp 4 with
    --sequence-parallel, with --checkpoint selective, and with --checkpoint every:1
    --partition-activations. The global batch is the same for every row, so dp ranks each hold
    batch/4 examples' activations and tp ranks the whole batch's (cut by tp where Megatron cuts
    them). d_model is found by a galloping search from the model-state estimate (16 bytes per
    parameter for DP, 16/4 for ZeRO-3 and tp 4), then bisection, one training run per trial.
    Printed per row: the widest d_model, its whole-model Ψ (the unsharded GPT's parameters), the
    peak bytes per rank (train --json's memory_peak_bytes "total", the ledger's peak, max over
    ranks) with its activations, and the next width up with the first line of its out-of-memory
    error. These numbers depend on memory alone (refimpl/memory.py counts the bytes of the arrays
    held), not on speed or load: they are exact and reproducible.

(2) Time. bench_engine.py's model (CONFIG and BATCH there: d_model 256, 4 layers, 4 heads, context
    128, batch 8, float32, vocabulary 64, random tokens; AdamW, clip 1.0 as train) trained by
    refimpl.tools.run.make_trainer -- as `train` does -- with --timing-tp T ranks (default 2 and 4)
    under `mpiexec -n T` (this script in worker mode), and at tp 1 in one process (LocalTrainer,
    no MPI) for comparison. One BLAS thread per rank (OMP_NUM_THREADS=1 and threadpoolctl). In the
    worker the blocking collectives of trainer.mesh.tp_comm (allreduce, allgather, reduce_scatter:
    every tp collective the model runs) are wrapped with time.perf_counter accumulators (a
    monkeypatch on that one communicator object, in this process only). Reported per T: the
    median step time after warm-up, the time per step inside tp collectives (mean over the tp
    ranks) and its fraction of the step -- they are on the critical path: nothing overlaps them --
    and step time at T / step time at tp 1. tp 1, 2, 4 are run alternately --rounds times and the
    medians taken, so that a slow spell of the machine hits all of them (also shown: the best
    round's step time, the least disturbed). Then, unless --no-split, the same tp runs again with a
    tp_comm barrier before every tp collective: the time at the barrier is waiting for the slowest
    peer, the time after it the collective itself (these runs are slower by the barriers; they
    only split the time, the first table is the step).

    Caveats: time inside a collective includes waiting for the slower peer (load imbalance,
    scheduling), not only moving bytes; on a 2-core machine tp 4 runs 4 ranks on 2 cores
    (oversubscribed, and MPICH's waiting ranks poll), so its row measures the oversubscription
    more than tensor parallelism: read tp 2 for the timing. Only the ratios measured in one run
    mean anything, and only on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from refimpl.memory import format_bytes, parse_bytes  # noqa: E402
from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher  # noqa: E402

MEMORY_CONFIGS = {  # name: train flags
    "tp 4": ["--tp", "4"],
    "dp 4": [],
    "ZeRO-3 (dp 4)": ["--zero", "3"],
}
EXTRA_CONFIGS = {
    "tp 4 + sequence parallel": ["--tp", "4", "--sequence-parallel"],
    "tp 4 + selective": ["--tp", "4", "--checkpoint", "selective"],
    "tp 4 + every:1 + Pa": ["--tp", "4", "--checkpoint", "every:1", "--partition-activations"],
}
BLAS_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TP_COLLECTIVES = ("allreduce", "allgather", "reduce_scatter")


# ---------------------------------------------------------------------------------------------- (1)
def train_command(args, d_model: int, flags: list) -> list:
    return [find_mpiexec() or "mpiexec", "-n", str(args.world), sys.executable, "-m", "refimpl", "train",
            "--model", "gpt", "--n-layer", str(args.n_layer), "--d-model", str(d_model), "--n-head", str(args.n_head),
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--dtype", "float32", "--mem-budget", str(args.budget), *flags, "--json"]


def trial(args, d_model: int, flags: list) -> dict:
    """One training run: {"fits": True, "summary": train --json} or {"fits": False, "error": first line}."""
    cmd = train_command(args, d_model, flags)
    env = {**without_launcher(), **BLAS_ONE_THREAD}
    for _ in range(3):  # the CLI aborts on the first rank's error; under load its message can be lost
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
        if done.returncode == 0:
            return {"fits": True, "summary": json.loads(done.stdout.strip().splitlines()[-1])}
        line = next((x for x in done.stderr.splitlines() if "out of memory on rank" in x), None)
        if line is not None:
            return {"fits": False, "error": line.split("error: ", 1)[-1]}
    raise RuntimeError(f"{' '.join(cmd)} failed without an out-of-memory error:\n{done.stderr[-2000:]}")


def whole_params(args, d_model: int) -> int:
    """Ψ of the unsharded GPT (train --json's n_params under --tp counts one rank's shard)."""
    from refimpl.tools.run import TrainConfig, build_model, build_task  # noqa: PLC0415

    cfg = TrainConfig(model="gpt", n_layer=args.n_layer, d_model=d_model, n_head=args.n_head, seq_len=args.seq_len)
    return build_model(cfg, build_task(cfg)).num_parameters()


def widest(args, flags: list, guess: int) -> tuple[int, dict, dict, int]:
    """(widest d_model that fits, its trial, the next width's trial, runs): gallop from `guess`, then bisect.

    Widths are k · n_head; fits(k) is monotone (wider models hold more). Galloping: from k0, step
    1, 2, 4, ... units up while it fits (down while it does not), then bisect the last interval.
    """
    unit = args.n_head
    tried: dict[int, dict] = {}

    def fits(k: int) -> bool:
        if k not in tried:
            tried[k] = trial(args, k * unit, flags)
            state = "fits" if tried[k]["fits"] else "out of memory"
            print(f"    d_model {k * unit:5d}: {state}", file=sys.stderr, flush=True)
        return tried[k]["fits"]

    k0, kmax = max(1, guess // unit), args.max_d_model // unit
    if fits(k0):
        lo, step = k0, 1
        while lo + step <= kmax and fits(lo + step):
            lo, step = lo + step, 2 * step
        hi = lo + step
    else:
        hi, step = k0, 1
        while hi - step >= 1 and not fits(hi - step):
            hi, step = hi - step, 2 * step
        lo = hi - step
        if lo < 1:
            raise RuntimeError(f"{flags}: not even d_model {unit} fits in {format_bytes(args.budget)}")
    while hi - lo > 1:  # lo fits, hi does not (or is past --max-d-model)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if hi > kmax:
        raise RuntimeError(f"{flags}: d_model {lo * unit} still fits; raise --max-d-model")
    return lo * unit, tried[lo], tried[hi], len(tried)


def memory_part(args) -> list[dict]:
    configs = dict(MEMORY_CONFIGS, **({} if args.no_extras else EXTRA_CONFIGS))
    rows = []
    for name, flags in configs.items():
        # model states per rank ~ bytes_per_param · 12 · L · d²: 16 bytes (float32 Adam), / 4 when sharded
        per_param = 16 if flags == [] else 16 / args.world
        guess = int(0.9 * math.sqrt(args.budget / (per_param * 12 * args.n_layer)))
        print(f"  {name}: train {' '.join(flags) or '(data parallel)'}", file=sys.stderr, flush=True)
        d, ok, fail, runs = widest(args, flags, guess)
        summary = ok["summary"]
        peaks = summary["memory_peak_bytes"]
        top = max(range(len(peaks)), key=lambda r: peaks[r]["total"])
        rows.append({"config": name, "flags": flags, "d_model": d, "params": whole_params(args, d),
                     "params_per_rank": summary["model_state_bytes"][top]["parameters"] // 4,
                     "peak_bytes": peaks[top]["total"], "peak": peaks[top],
                     "model_state_bytes": sum(summary["model_state_bytes"][top].values()),
                     "next_d_model": d + args.n_head, "next_error": fail["error"], "runs": runs})
    return rows


def print_memory(args, rows: list[dict]) -> None:
    print(f"(1) Widest GPT that trains {args.steps} steps at {args.world} ranks, --mem-budget "
          f"{format_bytes(args.budget)} per rank: n_layer {args.n_layer}, n_head {args.n_head}, seq_len "
          f"{args.seq_len}, global batch {args.batch_size}, float32 AdamW (exact: bytes counted by the ledger)\n")
    print(f"{'configuration':<26} {'d_model':>7} {'Ψ (whole)':>10} {'Ψ/rank':>9} {'model state':>11} "
          f"{'activations':>11} {'peak/rank':>9} {'runs':>4}")
    for r in rows:
        print(f"{r['config']:<26} {r['d_model']:>7} {r['params']:>10,} {r['params_per_rank']:>9,} "
              f"{format_bytes(r['model_state_bytes']):>11} {format_bytes(r['peak']['activations']):>11} "
              f"{format_bytes(r['peak_bytes']):>9} {r['runs']:>4}")
    print("\nthe next width up, and the first line of its error:")
    for r in rows:
        print(f"  {r['config']:<26} d_model {r['next_d_model']}: {r['next_error']}")
    print()


# ---------------------------------------------------------------------------------------------- (2)
def worker(args) -> None:
    """Under `mpiexec -n T` (or alone for T = 1): time bench_engine's model; rank 0 prints one JSON line."""
    import numpy as np  # noqa: PLC0415
    from bench_engine import BATCH, CONFIG  # noqa: PLC0415
    from threadpoolctl import threadpool_limits  # noqa: PLC0415

    from refimpl.nn import GPT, GPTConfig  # noqa: PLC0415
    from refimpl.parallel.comm import get_world  # noqa: PLC0415
    from refimpl.tools.run import TrainConfig, make_trainer  # noqa: PLC0415
    from refimpl.tools.runtime import watchdog  # noqa: PLC0415

    with threadpool_limits(limits=1):
        world = get_world("mpi")
        tp = world.size
        cfg = TrainConfig(model="gpt", batch_size=BATCH, lr=1e-3, dtype=CONFIG["dtype"], n_layer=CONFIG["n_layer"],
                          d_model=CONFIG["d_model"], n_head=CONFIG["n_head"], seq_len=CONFIG["seq_len"], tp=tp)
        model = GPT(GPTConfig(**CONFIG), seed=0)
        trainer = make_trainer(cfg, model, world)
        spent = {"s": 0.0, "wait_s": 0.0, "calls": 0, "bytes": 0, "depth": 0}
        if tp > 1:
            comm = trainer.mesh.tp_comm

            def timed(method):
                def wrapper(*a, **k):
                    if spent["depth"]:  # a collective inside another: counted once, by the outer one
                        return method(*a, **k)
                    spent["depth"] += 1
                    start = time.perf_counter()
                    try:
                        if args.barrier:  # split: waiting for the slowest peer, then the collective itself
                            comm.barrier("bench_tensor_parallel")
                            spent["wait_s"] += time.perf_counter() - start
                        return method(*a, **k)
                    finally:
                        spent["s"] += time.perf_counter() - start
                        spent["depth"] -= 1
                        spent["calls"] += 1
                        spent["bytes"] += getattr(a[0], "nbytes", 0) if a else 0
                return wrapper

            for name in TP_COLLECTIVES:  # an instance attribute shadows the class's method: this object only
                setattr(comm, name, timed(getattr(comm, name)))
        idx = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (BATCH, CONFIG["seq_len"]))
        steps = []
        for i in range(args.warmup + args.timing_steps):
            before = dict(spent)
            start = time.perf_counter()
            trainer.step(idx, idx)
            elapsed = time.perf_counter() - start
            watchdog.progress()
            if i >= args.warmup:
                steps.append({"step_s": elapsed, "tp_s": spent["s"] - before["s"],
                              "wait_s": spent["wait_s"] - before["wait_s"],
                              "tp_calls": spent["calls"] - before["calls"],
                              "tp_bytes": spent["bytes"] - before["bytes"]})
        ranks = world.allgather_object(steps)
    if world.rank == 0:
        print(json.dumps({"tp": tp, "ranks": ranks}))


def timing_run(args, tp: int, barrier: bool = False) -> dict:
    """One worker job; per-rank medians of step time and time in tp collectives."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--warmup", str(args.warmup),
           "--timing-steps", str(args.timing_steps)] + (["--barrier"] if barrier else [])
    if tp > 1:
        cmd = [find_mpiexec() or "mpiexec", "-n", str(tp), *cmd]
    env = {**without_launcher(), **BLAS_ONE_THREAD}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    per_rank = [{"step_s": statistics.median(s["step_s"] for s in steps),
                 "tp_s": statistics.median(s["tp_s"] for s in steps),
                 "wait_s": statistics.median(s["wait_s"] for s in steps),
                 "fraction": sum(s["tp_s"] for s in steps) / sum(s["step_s"] for s in steps),
                 "tp_calls": steps[0]["tp_calls"], "tp_bytes": steps[0]["tp_bytes"]} for steps in result["ranks"]]
    return {"step_s": max(r["step_s"] for r in per_rank),  # the step ends when its slowest rank does
            "tp_s": statistics.mean(r["tp_s"] for r in per_rank),
            "wait_s": statistics.mean(r["wait_s"] for r in per_rank),
            "fraction": statistics.mean(r["fraction"] for r in per_rank),
            "tp_calls": per_rank[0]["tp_calls"], "tp_bytes": per_rank[0]["tp_bytes"], "per_rank": per_rank}


def timing_part(args) -> tuple[dict, dict]:
    """({tp: row}, {tp: row of the barrier-split runs}), medians over the rounds."""
    tps = [1] + [t for t in args.timing_tp if t > 1]
    jobs = [(t, False) for t in tps] + ([] if args.no_split else [(t, True) for t in tps if t > 1])
    runs: dict[tuple, list] = {job: [] for job in jobs}
    for r in range(args.rounds):
        for t, barrier in jobs:
            print(f"  round {r + 1}/{args.rounds}: tp {t}{' (barrier-split)' if barrier else ''}", file=sys.stderr,
                  flush=True)
            runs[t, barrier].append(timing_run(args, t, barrier))
    rows: dict[tuple, dict] = {}
    for job in jobs:
        rows[job] = {key: statistics.median(run[key] for run in runs[job])
                     for key in ("step_s", "tp_s", "wait_s", "fraction")}
        rows[job].update(tp_calls=runs[job][0]["tp_calls"], tp_bytes=runs[job][0]["tp_bytes"], runs=runs[job])
        rows[job]["vs_tp1"] = rows[job]["step_s"] / statistics.median(run["step_s"] for run in runs[1, False])
        best = min(runs[job], key=lambda run: run["step_s"])  # the least disturbed round
        rows[job].update(best_step_s=best["step_s"], best_tp_s=best["tp_s"], best_fraction=best["fraction"],
                         best_vs_tp1=best["step_s"] / min(run["step_s"] for run in runs[1, False]))
    return ({t: rows[t, False] for t in tps},
            {t: rows[t, True] for t in tps if (t, True) in rows})


def print_timing(args, rows: dict, split: dict) -> None:
    from bench_engine import BATCH, CONFIG  # noqa: PLC0415

    cores = os.cpu_count() or 1
    print(f"(2) Step time of bench_engine.py's model (d_model {CONFIG['d_model']}, {CONFIG['n_layer']} layers, "
          f"{CONFIG['n_head']} heads, context {CONFIG['seq_len']}, batch {BATCH}, {CONFIG['dtype']}), one BLAS "
          f"thread per rank, {cores} cores; medians of {args.rounds} alternating runs of "
          f"{args.timing_steps} steps after {args.warmup} warm-up\n")
    print(f"{'':>3} {'median over the rounds':^45} | {'best round':^38}")
    print(f"{'tp':>3} {'step':>9} {'in tp coll.':>11} {'fraction':>8} {'vs tp 1':>7} | {'step':>9} "
          f"{'in tp coll.':>11} {'fraction':>8} {'vs tp 1':>7} | {'calls/step':>10} {'bytes/step':>10}")

    def ms(x):
        return f"{x * 1e3:.1f} ms"

    for t, r in rows.items():
        tp1 = t == 1
        print(f"{t:>3} {ms(r['step_s']):>9} {'-' if tp1 else ms(r['tp_s']):>11} "
              f"{'-' if tp1 else format(r['fraction'], '.1%'):>8} {r['vs_tp1']:>7.2f} | {ms(r['best_step_s']):>9} "
              f"{'-' if tp1 else ms(r['best_tp_s']):>11} {'-' if tp1 else format(r['best_fraction'], '.1%'):>8} "
              f"{r['best_vs_tp1']:>7.2f} | {'-' if tp1 else r['tp_calls']:>10} "
              f"{'-' if tp1 else format_bytes(r['tp_bytes']):>10}{'  (oversubscribed)' if t > cores else ''}")
    print("\n(time in a collective includes waiting for the slower peer; bytes: the buffers handed to the tp "
          "collectives per step, per rank; step: the slowest rank's median step; best round: the round with the "
          "shortest step, the least disturbed)")
    if split:
        print("\nThe same with a tp_comm barrier before every tp collective, to split waiting from the collective:")
        print(f"{'tp':>3} {'step':>9} {'at the barrier':>15} {'collective itself':>18} {'its fraction':>12}")
        for t, r in split.items():
            own = r["tp_s"] - r["wait_s"]
            print(f"{t:>3} {r['step_s'] * 1e3:>6.1f} ms {r['wait_s'] * 1e3:>12.1f} ms {own * 1e3:>15.1f} ms "
                  f"{own / r['step_s']:>12.1%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("memory", "timing"), help="run one part (default: both)")
    p.add_argument("--json", action="store_true", help="also print one JSON line with every figure")
    g = p.add_argument_group("(1) memory")
    g.add_argument("--world", type=int, default=4)
    g.add_argument("--budget", type=parse_bytes, default=parse_bytes("16MB"), help="per rank (default 16MB)")
    g.add_argument("--n-layer", type=int, default=4)
    g.add_argument("--n-head", type=int, default=8, help="d_model moves in multiples of it (default 8)")
    g.add_argument("--seq-len", type=int, default=16)
    g.add_argument("--batch-size", type=int, default=4, help="global batch, the same for every row (default 4)")
    g.add_argument("--steps", type=int, default=2, help="training steps per trial (default 2)")
    g.add_argument("--max-d-model", type=int, default=4096)
    g.add_argument("--no-extras", action="store_true", help="only tp 4, dp 4 and ZeRO-3")
    g = p.add_argument_group("(2) timing")
    g.add_argument("--timing-tp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4],
                   help="tp sizes to time besides tp 1 (default 2,4)")
    g.add_argument("--rounds", type=int, default=5, help="alternating runs of every tp (default 5)")
    g.add_argument("--timing-steps", type=int, default=8, help="timed steps per run (default 8)")
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--no-split", action="store_true", help="skip the barrier-split runs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--barrier", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    result = {}
    if args.only in (None, "memory"):
        print("(1) searching the widest d_model ...", file=sys.stderr, flush=True)
        rows = memory_part(args)
        print_memory(args, rows)
        result["memory"] = {"world": args.world, "budget": args.budget, "n_layer": args.n_layer,
                            "n_head": args.n_head, "seq_len": args.seq_len, "batch_size": args.batch_size,
                            "steps": args.steps, "dtype": "float32", "rows": rows}
    if args.only in (None, "timing"):
        print("(2) timing ...", file=sys.stderr, flush=True)
        rows, split = timing_part(args)
        print_timing(args, rows, split)
        result["timing"] = {"cores": os.cpu_count(), "rounds": args.rounds, "timing_steps": args.timing_steps,
                            "rows": {str(t): r for t, r in rows.items()},
                            "barrier_split": {str(t): r for t, r in split.items()}}
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
