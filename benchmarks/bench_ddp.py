"""How much all-reduce time do DDP's buckets hide behind backward?

Launch:  mpiexec -n 2 python benchmarks/bench_ddp.py [--d-model 256 --n-layer 4 --bucket-bytes 1048576]

Three step times, measured in one run on the same model, batch and ranks (medians of repeats):

    T_local     forward + backward + optimizer step on this rank's slice, no communication
    T_naive     the same plus one blocking all-reduce per gradient after backward
    T_bucketed  the same with bucketed all-reduces started during backward (polling with test())

    exposed communication  = T_naive − T_local
    hidden fraction        = (T_naive − T_bucketed) / (T_naive − T_local)

On a machine with fewer cores than ranks × BLAS threads, compute and MPI progress compete for the
same cores, and MPI progresses a non-blocking all-reduce only inside MPI calls (our polls), so
expect only part of the communication to hide; the figure says how much.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from refimpl.local_trainer import LocalTrainer
from refimpl.parallel.comm import get_world
from refimpl.parallel.trainer import Trainer
from refimpl.tools.console import log
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task


def median_step_time(trainer, task, batch_size: int, repeats: int, world) -> float:
    times = []
    for step in range(repeats + 1):
        x, y = task.batch(step, batch_size)
        world.barrier()
        start = time.perf_counter()
        trainer.step(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first is warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="global batch (small: communication must weigh)")
    parser.add_argument("--bucket-bytes", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    world = get_world()
    cfg = TrainConfig(model="gpt", d_model=args.d_model, n_layer=args.n_layer, n_head=4, seq_len=args.seq_len,
                      batch_size=args.batch_size, dtype="float32")
    task = build_task(cfg)

    def trainer(kind: str):
        model = build_model(cfg, task)
        if kind == "local":
            return LocalTrainer(model, build_optimizer(cfg, model.parameters()))
        return Trainer(model, lambda params: build_optimizer(cfg, params), world, dp_mode=kind,
                       bucket_bytes=args.bucket_bytes)

    local_batch = args.batch_size // world.size  # the local run trains on one rank's slice
    t_local = median_step_time(trainer("local"), task, local_batch, args.repeats, world)
    t_naive = median_step_time(trainer("naive"), task, args.batch_size, args.repeats, world)
    bucketed = trainer("bucketed")
    t_bucketed = median_step_time(bucketed, task, args.batch_size, args.repeats, world)
    exposed = t_naive - t_local
    result = {"world_size": world.size, "n_params": build_model(cfg, task).num_parameters(),
              "buckets": sum(len(b.groups) for b in bucketed.sharding.buckets.values()),
              "t_local_s": t_local, "t_naive_s": t_naive, "t_bucketed_s": t_bucketed, "exposed_comm_s": exposed,
              "hidden_fraction": (t_naive - t_bucketed) / exposed if exposed > 0 else None}
    if world.rank == 0:
        hidden = result["hidden_fraction"]
        log(f"{world.size} ranks, {result['n_params']} parameters in {result['buckets']} buckets: "
            f"local {t_local * 1e3:.1f} ms, naive {t_naive * 1e3:.1f} ms, bucketed {t_bucketed * 1e3:.1f} ms; "
            f"communication exposed by naive {exposed * 1e3:.1f} ms, hidden by buckets "
            + ("n/a" if hidden is None else f"{100 * hidden:.0f}%"))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
