"""Impossible pipeline configurations, one launch: each must raise ValueError on every rank, at once.

Launch:  mpiexec -n 4 python tests/mpi_programs/pipeline_errors.py '[{"pp": 3}, {"schedule": "dualpipe", "m": 6}, ...]'

Every configuration is tried on every rank; the ValueError each rank raised (or "no error") is
gathered, and rank 0 prints one JSON list: per configuration, the message of every rank. Ranks
that fail this way must fail *symmetrically*: the check happens before any message could make one
rank wait for another.
"""

import json
import sys

from refimpl.parallel.comm import get_world
from refimpl.parallel.trainer import Trainer
from refimpl.tools import timeline
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)

DEFAULTS = dict(model="gpt", schedule="1f1b", pp=4, m=8, chunks=None, n_layer=4, batch=16, grad_accum=1,
                action_costs=None, tie=False)


def attempt(world, spec: dict) -> str:
    c = {**DEFAULTS, **spec}
    cfg = TrainConfig(model=c["model"], dtype="float64", n_layer=c["n_layer"], d_model=8, n_head=2, seq_len=8,
                      batch_size=c["batch"])
    task = build_task(cfg)
    model = build_model(cfg, task)
    if c["tie"]:
        from dataclasses import replace

        from refimpl.nn import GPT

        model = GPT(replace(model.config, tie_weights=True))
    try:
        costs = timeline.parse_costs(c["action_costs"])
        trainer = Trainer(model, lambda ps: build_optimizer(cfg, ps), world, pp=c["pp"], schedule=c["schedule"],
                          micro_batches=c["m"], chunks=c["chunks"], grad_accum=c["grad_accum"])
        timeline.install(trainer, costs)
        x, y = task.batch(0, c["batch"])
        trainer.step(x, y)
    except ValueError as exc:
        return str(exc)
    return "no error"


def main() -> None:
    world = get_world()
    results = [world.allgather_object(attempt(world, spec)) for spec in json.loads(sys.argv[1])]
    if world.rank == 0:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
