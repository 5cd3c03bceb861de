"""Overlapped F&B changes no number: DualPipe(V) with experts, overlap on and off, bit for bit.

    mpiexec -n N python tests/mpi_programs/overlap_checks.py CONFIGS.json

For each train flag list, two trainers from the same seed take two steps on the same batches, one
with DualPipe's F&B steps interleaved at their all-to-alls (pipeline/overlap.py), one without
(--no-overlap). Rank 0 prints one JSON list of {"flags", "identical", "switches"}: identical is
whether the losses, the last step's gradients and the parameters are equal bit for bit (on every
rank), switches every rank's number of task switches in the overlapped run's last step (> 0: the
interleaving really happened).
"""

import json
import sys

import numpy as np

from refimpl.parallel.comm import get_world
from refimpl.tools.console import emit_json
from refimpl.tools.flags import config_from_flags
from refimpl.tools.run import build_model, build_task, make_trainer
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)


def run(world, flags: list):
    cfg = config_from_flags(flags)
    task = build_task(cfg)
    trainer = make_trainer(cfg, build_model(cfg, task), world, distributed=True)
    trainer.record_grads = True
    losses = [trainer.step(*task.batch(step, cfg.batch_size)) for step in range(2)]
    return losses, trainer.last_grads, trainer.full_parameters(), trainer.executor.switches


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def main() -> None:
    world = get_world()
    with open(sys.argv[1]) as f:
        configs = json.load(f)
    results = []
    for flags in configs:
        flags = [str(flag) for flag in flags]
        on, off = run(world, flags), run(world, flags + ["--no-overlap"])
        identical = on[0] == off[0] and same(on[1], off[1]) and same(on[2], off[2])
        results.append({"flags": flags, "identical": all(world.allgather_object(identical)),
                        "switches": world.allgather_object(on[3]), "switches_without": world.allgather_object(off[3])})
    if world.rank == 0:
        emit_json(results)


if __name__ == "__main__":
    main()
