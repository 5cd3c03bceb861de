"""Measured pipeline bubbles against the simulator, and throughput relative to 1F1B.

Launch:  mpiexec -n 4 python benchmarks/bench_pipeline.py [--costs F=0.02,I=0.02,W=0.02 --micro-batches 8
                                                          --schedules 1f1b,zb1p,dualpipe --steps 4]

Mode: sleep-cost (the executor pads every step with a sleep to a fixed cost; see
refimpl/tools/timeline.py), so that four ranks on a laptop with two cores show the
schedules' own bubbles instead of CPU contention. Every schedule runs on pp = 4 ranks (dp = world
size / 4) on the same tiny GPT with the same global batch, for `--steps` optimizer steps after one
warm-up step; per step:

    measured bubble    Σ_r idle_r / (pp · T)          T: the pipeline's measured makespan
    simulated bubble   the same figure from simulate(schedule, measured mean step costs)
    ratio              measured / simulated           (> 1: latency, barrier skew, bookkeeping)
    throughput         examples / step time           (the whole step: pipeline, gradient
                                                       all-reduce and optimizer), relative to 1F1B

Costs are per stage of a pp-stage model; schedules that cut the model into more stages (interleaved,
ZB-V, DualPipeV) get them scaled by pp / stages, so every schedule does the same work per rank.
Figures are medians over the steps; one JSON object is printed last on stdout (rank 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from fractions import Fraction

from refimpl.parallel.comm import get_world
from refimpl.parallel.pipeline import Costs, build
from refimpl.parallel.trainer import Trainer
from refimpl.tools.console import log
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task
from refimpl.tools.timeline import install


def run_schedule(name: str, world, args, costs: Costs) -> dict:
    cfg = TrainConfig(model="gpt", n_layer=args.n_layer, d_model=args.d_model, n_head=2, seq_len=args.seq_len,
                      batch_size=args.batch_size, dtype="float32")
    task = build_task(cfg)
    stages = build(name, args.pp, args.micro_batches).num_stages
    scaled = costs.scaled(Fraction(args.pp, stages))
    trainer = Trainer(build_model(cfg, task), lambda ps: build_optimizer(cfg, ps), world, pp=args.pp, schedule=name,
                      micro_batches=args.micro_batches)
    timeline = install(trainer, scaled)
    rows = []
    for step in range(args.steps + 1):
        x, y = task.batch(step, args.batch_size)
        world.barrier()
        start = time.perf_counter()
        trainer.step(x, y)
        elapsed = world.allreduce_value(time.perf_counter() - start, op="max")
        timing = timeline.report()
        if step > 0:  # the first step warms up allocations and MPI connections
            rows.append((elapsed, timing))
    median = lambda values: statistics.median(values)  # noqa: E731
    return {
        "schedule": name,
        "stages": stages,
        "step_s": median([e for e, _ in rows]),
        "makespan_s": median([t["makespan_s"] for _, t in rows]),
        "simulated_makespan_s": median([t["simulated_makespan_s"] for _, t in rows]),
        "measured_bubble": median([t["measured_bubble"] for _, t in rows]),
        "simulated_bubble": median([t["simulated_bubble"] for _, t in rows]),
        "measured_idle_fraction": rows[-1][1]["measured_idle_fraction"],
        "simulated_idle_fraction": rows[-1][1]["simulated_idle_fraction"],
        "overruns": sum(t["overruns"] for _, t in rows),
        "peak_activation_bytes": rows[-1][1]["peak_activation_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", default="F=0.02,I=0.02,W=0.02", help="seconds per step kind (B=I+W, FB=F+B)")
    parser.add_argument("--schedules", default="1f1b,zb1p,dualpipe")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=None, help="global batch (default 2 per micro-batch)")
    args = parser.parse_args()
    world = get_world()
    args.batch_size = args.batch_size or 2 * args.micro_batches * (world.size // args.pp)
    costs = Costs.parse(args.costs)
    results = [run_schedule(name, world, args, costs) for name in args.schedules.split(",")]
    baseline = next((r for r in results if r["schedule"] == "1f1b"), results[0])
    for r in results:
        r["bubble_ratio"] = r["measured_bubble"] / r["simulated_bubble"] if r["simulated_bubble"] else None
        r["throughput_vs_1f1b"] = baseline["step_s"] / r["step_s"]
        r["simulated_throughput_vs_1f1b"] = baseline["simulated_makespan_s"] / r["simulated_makespan_s"]
    if world.rank == 0:
        log(f"sleep-cost mode, costs {args.costs} s per stage of a {args.pp}-stage model; {world.size} processes, "
            f"pp {args.pp}, {args.micro_batches} micro-batches; medians of {args.steps} steps")
        log(f"{'schedule':<12}{'bubble':>9}{'simulated':>11}{'ratio':>7}{'makespan':>10}{'simulated':>11}"
            f"{'step':>8}{'thru/1f1b':>11}{'sim':>7}{'overruns':>10}")
        for r in results:
            ratio = f"{r['bubble_ratio']:.2f}" if r["bubble_ratio"] is not None else "-"
            log(f"{r['schedule']:<12}{r['measured_bubble']:>9.3f}{r['simulated_bubble']:>11.3f}{ratio:>7}"
                f"{r['makespan_s']:>10.3f}{r['simulated_makespan_s']:>11.3f}{r['step_s']:>8.3f}"
                f"{r['throughput_vs_1f1b']:>11.2f}{r['simulated_throughput_vs_1f1b']:>7.2f}{r['overruns']:>10}")
        print(json.dumps({"mode": "sleep", "costs": args.costs, "world_size": world.size, "pp": args.pp,
                          "micro_batches": args.micro_batches, "results": results}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
