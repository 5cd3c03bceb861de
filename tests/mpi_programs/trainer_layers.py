"""A toy layer plugged into the one trainer changes no number (tests/test_trainer_layers.py).

    mpiexec -n 4 python tests/mpi_programs/trainer_layers.py '[{"zero": 2}, ...]'

For each case (TrainConfig fields), trains 2 steps without and with a layer that joins the mesh
with a sub-communicator of its own (the ranks that hold the same pipeline stages: they run the
same list of actions, so their collectives match one for one) and, around every action
of the loop, all-reduces a count over it. Prints one JSON list: per case, whether losses, last
gradients and parameters are identical, the actions the layer wrapped, its all-reduces.
"""

import json
import sys
from contextlib import contextmanager

import numpy as np

from refimpl.parallel.comm import get_world
from refimpl.tools.run import TrainConfig, build_model, build_task, make_trainer
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)


class ToyLayer:
    def __init__(self) -> None:
        self.comm, self.actions = None, 0

    def join(self, mesh) -> None:
        self.comm = mesh.world.split(color=mesh.pp_index)  # its own sub-communicator: same stages

    @contextmanager
    def around(self, action, last):
        yield
        self.actions += 1
        self.comm.allreduce(np.ones(1))  # communicates; touches no number of the model


def train(world, cfg, layers):
    task = build_task(cfg)
    model = build_model(cfg, task)
    trainer = make_trainer(cfg, model, world, distributed=True)
    if layers:  # the same trainer, built with the layer (make_trainer's arguments, plus layers)
        from refimpl.parallel.trainer import Trainer
        from refimpl.tools.run import build_optimizer

        model = build_model(cfg, task)
        trainer = Trainer(model, lambda ps: build_optimizer(cfg, ps), world, pp=cfg.pp, schedule=cfg.schedule,
                          grad_accum=cfg.grad_accum, zero=cfg.zero, precision=cfg.dtype, clip=cfg.clip, layers=layers)
    trainer.record_grads = True
    losses = [trainer.step(*task.batch(step, cfg.batch_size)) for step in range(2)]
    return losses, trainer.last_grads, trainer.full_parameters()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def main() -> None:
    world = get_world()
    results = []
    for case in json.loads(sys.argv[1]):
        cfg = TrainConfig(**{"model": "gpt", "dtype": "float64", "n_layer": 4, "d_model": 16, "n_head": 2,
                             "seq_len": 8, "batch_size": 16, "steps": 2, **case})
        layer = ToyLayer()
        plain, layered = train(world, cfg, ()), train(world, cfg, (layer,))
        identical = plain[0] == layered[0] and same(plain[1], layered[1]) and same(plain[2], layered[2])
        calls = layer.comm.counters.snapshot().get("allreduce", {}).get("calls", 0)
        results.append({"identical": identical, "actions": layer.actions, "layer_allreduces": calls,
                        "layer_comm_size": layer.comm.size})
    if world.rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
