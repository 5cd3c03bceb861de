"""Trainers with deliberate faults, for `verify --trainer tests/trainers/broken.py:FUNCTION` (tests/test_verify.py).

nan_on_step_1      refimpl's data-parallel trainer, except that on rank 1 the gradient of the
                   last parameter becomes NaN during step 1 (the all-reduce spreads it to every rank)
no_step            lacks step(): not a trainer
replica_lr_doubled refimpl's trainer, except that the optimizer of the last data-parallel replica of
                   the last pipeline stage (rank 3 of --pp 2 on 4 ranks) takes twice the learning
                   rate: every other rank is right, and so is the whole model rank 0 gathers (from
                   replica 0's stages); only that rank's own copy of its stage is wrong
"""

import numpy as np

from refimpl.tools.run import make_trainer


def nan_on_step_1(cfg, model, world):
    trainer = make_trainer(cfg, model, world, distributed=True)
    step, steps = trainer.step, [0]

    def counted_step(x, y):
        loss = step(x, y)
        steps[0] += 1
        return loss

    def poison(grad):
        return grad * np.nan if steps[0] == 1 and world.rank == min(1, world.size - 1) else grad

    model.parameters()[-1].register_hook(poison)
    trainer.step = counted_step
    return trainer


class NoStep:
    world_size, rank, record_grads, last_grads, implements = 1, 0, False, {}, frozenset()

    def full_parameters(self):
        return {}

    def report(self):
        return {}


def no_step(cfg, model, world):
    return NoStep()


def replica_lr_doubled(cfg, model, world):
    trainer = make_trainer(cfg, model, world, distributed=True)
    mesh = trainer.mesh
    if mesh.dp > 1 and (mesh.dp_index, mesh.pp_index) == (mesh.dp - 1, mesh.pp - 1):
        trainer.sharding.optimizer.lr *= 2
    return trainer
