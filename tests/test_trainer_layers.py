"""A new parallel dimension is a new layer of the one trainer, not a new trainer (docs/design.md).

The toy layer below stands for tensor or expert parallelism: it joins the mesh with a
sub-communicator of its own (here: the ranks of one pipeline rank's data-parallel group, split in
halves), and wraps every action of the micro-batch loop, where it communicates (an all-reduce of
a count over its sub-communicator) without touching the numbers. Plugged into every kind of run,
the trainer must train exactly as without it: the same losses, gradients and parameters, bit for
bit, while the layer saw every action and its sub-communicator carried its traffic.
"""

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
from mpi_util import last_json, run_mpi

PROGRAM = Path(__file__).parent / "mpi_programs" / "trainer_layers.py"
CASES = [dict(), dict(zero=2, grad_accum=2), dict(zero=3, dtype="mixed"), dict(pp=2, schedule="zb1p", zero=1),
         dict(pp=2, schedule="dualpipe", zero=3)]


class CountingLayer:
    """Counts the actions it wraps; its own communicator is the ranks holding the same stages."""

    def __init__(self) -> None:
        self.actions, self.comm = [], None

    def join(self, mesh) -> None:
        self.comm = mesh.world.split(color=mesh.world.rank % 2)

    @contextmanager
    def around(self, action, last):
        self.actions.append((action.kind, action.stage, action.mb, last))
        yield


def test_a_layer_in_one_process_sees_every_action_and_changes_nothing():
    import numpy as np

    from refimpl.parallel.comm import LocalComm
    from refimpl.parallel.trainer import Trainer
    from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task

    cfg = TrainConfig(model="gpt", dtype="float64", n_layer=2, d_model=16, n_head=2, seq_len=8, batch_size=8,
                      grad_accum=2)
    task = build_task(cfg)
    runs = []
    for layers in ((), (CountingLayer(),)):
        trainer = Trainer(build_model(cfg, task), lambda ps: build_optimizer(cfg, ps), LocalComm(), grad_accum=2,
                          precision="float64", layers=layers)
        losses = [trainer.step(*task.batch(step, 8)) for step in range(2)]
        runs.append((losses, trainer.full_parameters(), layers))
    (plain, plain_params, _), (layered, layered_params, (layer,)) = runs
    assert layered == plain
    assert all(np.array_equal(plain_params[k], layered_params[k]) for k in plain_params)
    # 2 steps x (F, B) of 2 micro-batches; the second B of each step is the stage's last
    assert layer.actions == [("F", 0, 0, False), ("B", 0, 0, False), ("F", 0, 1, False), ("B", 0, 1, True)] * 2
    assert layer.comm is not None and layer.comm.size == 1


@pytest.mark.mpi
def test_a_layer_with_its_own_communicator_changes_no_number_on_four_ranks():
    done = run_mpi(4, [PROGRAM, json.dumps(CASES)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = last_json(done)
    assert len(results) == len(CASES)
    for case, r in zip(CASES, results):
        assert r["identical"], case  # losses, last gradients and parameters equal bit for bit
        assert r["layer_allreduces"] == r["actions"] > 0, case  # one all-reduce per wrapped action
        assert r["layer_comm_size"] == 4 // case.get("pp", 1), case  # the replicas of its stages
