"""Many pipeline configurations in one launch, each checked against single-process training.

Launch:  mpiexec -n 4 python tests/mpi_programs/pipeline_verify.py '[{"schedule": "1f1b", "pp": 2, "m": 4}, ...]'

Each configuration (JSON object; defaults below) builds the pipelined Trainer (refimpl/parallel/trainer.py) on the
whole world (dp = world size / pp), runs `steps` optimizer steps in float64 and, on rank 0, the single-process
LocalTrainer on the same batches; it records the worst loss / gradient / parameter differences
(refimpl.tools.compare, rtol 1e-10, atol 1e-12), the executor's point-to-point counters, and the
trainer's report (peaks, measured timeline). Rank 0 prints one JSON list, one entry per
configuration, on the last stdout line.
"""

import json
import sys

from refimpl.local_trainer import LocalTrainer
from refimpl.parallel.comm import get_world
from refimpl.parallel.trainer import Trainer
from refimpl.tools import timeline
from refimpl.tools.compare import Comparison, compare_step
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)

DEFAULTS = dict(model="gpt", schedule="1f1b", pp=2, m=4, chunks=None, n_layer=4, d_model=8, n_head=2, seq_len=8,
                batch=None, steps=2, clip=1.0, checkpoint=None, optimizer="adamw", collectives="mpi",
                dropout=0.0, zero=0, bucket_bytes=1 << 20)


def run(world, spec: dict) -> dict:
    c = {**DEFAULTS, **spec}
    dp = world.size // c["pp"]
    batch = c["batch"] or dp * c["m"] * 2
    cfg = TrainConfig(model=c["model"], dtype="float64", n_layer=c["n_layer"], d_model=c["d_model"],
                      n_head=c["n_head"], seq_len=c["seq_len"], batch_size=batch, clip=c["clip"],
                      optimizer=c["optimizer"], collectives=c["collectives"], lr=1e-2, dropout=c["dropout"])
    task = build_task(cfg)
    comm = world.with_collectives(c["collectives"])
    trainer = Trainer(build_model(cfg, task), lambda ps: build_optimizer(cfg, ps), comm, pp=c["pp"],
                      schedule=c["schedule"], micro_batches=c["m"], chunks=c["chunks"], clip=cfg.clip,
                      checkpoint=c["checkpoint"], zero=c["zero"], bucket_bytes=c["bucket_bytes"], precision=cfg.dtype)
    timeline.install(trainer)  # the report's peaks and measured timeline
    trainer.record_grads = True
    before = world.counters.snapshot()
    recorded = []
    for step in range(c["steps"]):
        x, y = task.batch(step, batch)
        loss = trainer.step(x, y)
        recorded.append((loss, trainer.last_grads, trainer.full_parameters()))
    p2p = trainer.mesh.pp_comm.counters.snapshot()
    group = trainer.mesh.dp_comm.counters.snapshot()  # the data-parallel group: the strategy's collectives
    counters = world.allgather_object({"send": p2p.get("send", {"bytes": 0, "calls": 0}),
                                       "recv": p2p.get("recv", {"calls": 0}),
                                       "group": {k: group[k] for k in ("allreduce", "reduce_scatter", "allgather")
                                                 if k in group},
                                       "padded": [g.length for g in getattr(trainer.sharding, "groups", [])] or None})
    result = {"spec": c, "dp": dp, "counters": counters, "report": trainer.report()["pipeline"]}
    if world.rank == 0:
        model = build_model(cfg, task)
        reference = LocalTrainer(model, build_optimizer(cfg, model.parameters()), 1, cfg.clip)
        reference.record_grads = True
        total = Comparison()
        for step, (loss, grads, params) in enumerate(recorded):
            x, y = task.batch(step, batch)
            ref_loss = reference.step(x, y)
            total = total.merge(compare_step(step, {"loss": loss, "grads": grads, "params": params},
                                             {"loss": ref_loss, "grads": reference.last_grads,
                                              "params": reference.full_parameters()}, 1e-10, 1e-12))
        ok, worst = total.ok, {"max_abs_diff": total.max_abs_diff, "tolerance_used": total.tolerance_used,
                               "problems": total.problems[:5]}
        result.update(ok=bool(ok), worst=worst, n_params=model.num_parameters())
    del before
    return result


def main() -> None:
    world = get_world()
    specs = json.loads(sys.argv[1])
    results = [run(world, spec) for spec in specs]
    if world.rank == 0:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
