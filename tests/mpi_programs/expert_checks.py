"""Expert parallelism's bytes, in one MPI launch: the all-to-all traffic equals the routing histogram's.

    mpiexec -n N python tests/mpi_programs/expert_checks.py CONFIGS.json

For each train flag list (with --experts and --ep), the distributed Trainer takes two steps; in the
second, on every rank, the bytes sent on the expert-parallel group equal, by kind:

    alltoall    per MoE call: (E − E/P) counts of 8 bytes (the own E/P are not sent)
    alltoallv   per MoE call: C·itemsize·(Σ_(j≠me) send_j + Σ_(j≠me) recv_j), once more if a backward
                follows (the backward of a dispatch is a combine and vice versa): 4·C per remote
                (token, expert) assignment counted at both ends

where send_j / recv_j are the rows this rank sent to / received from rank j in that call (from the
routing: the tokens of rank j's experts). Rank 0 prints one JSON list of {"flags", "measured",
"expected", "calls"} (every rank's figures).
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


def check(world, flags: list) -> dict:
    cfg = config_from_flags(flags)
    task = build_task(cfg)
    trainer = make_trainer(cfg, build_model(cfg, task), world, distributed=True)
    x, y = task.batch(0, cfg.batch_size)
    trainer.step(x, y)  # (each step starts the runners' traffic records afresh)
    comm = trainer.mesh.ep_comm
    before = comm.counters.snapshot()
    trainer.step(x, y)
    spent = comm.counters.since(before)
    me, E, P = comm.rank, cfg.experts, comm.size
    itemsize = np.dtype(cfg.dtype).itemsize
    expected = {"alltoall": 0, "alltoallv": 0}
    calls = 0
    for runner in trainer.expert_runners:
        for send, recv, backward in runner.traffic:
            calls += 1
            expected["alltoall"] += (E - E // P) * 8
            remote = int(send.sum() - send[me] + recv.sum() - recv[me])
            expected["alltoallv"] += cfg.d_model * itemsize * remote * (2 if backward else 1)
    measured = {kind: spent.get(kind, {}).get("bytes", 0) for kind in expected}
    return {"flags": flags, "measured": world.allgather_object(measured), "expected": world.allgather_object(expected),
            "calls": world.allgather_object(calls)}


def collapse(world, ep: int) -> dict:
    """Every token routed to expert 0 (a zero router: all probabilities equal, ties to the lower
    index): the expert-parallel step still equals one process's, and every token travels to rank 0."""
    from refimpl.local_trainer import LocalTrainer
    from refimpl.nn.experts import MoE
    from refimpl.parallel.trainer import Trainer
    from refimpl.tools.run import TrainConfig, build_optimizer

    cfg = TrainConfig(model="gpt", experts=4, top_k=1, ep=ep, n_layer=2, d_model=8, n_head=2, seq_len=8, batch_size=8,
                      dtype="float64", clip=0.0)
    task = build_task(cfg)

    def collapsed():
        model = build_model(cfg, task)
        for module in model.modules():
            if isinstance(module, MoE):
                module.router.weight.data[...] = 0.0
        return model

    x, y = task.batch(0, cfg.batch_size)
    model = collapsed()
    reference = LocalTrainer(model, build_optimizer(cfg, model.parameters()))
    reference.record_grads = True
    trainer = Trainer(collapsed(), lambda ps: build_optimizer(cfg, ps), world, ep=ep)
    trainer.record_grads = True
    losses = (trainer.step(x, y), reference.step(x, y))
    grads = trainer.last_grads
    worst = max(float(np.max(np.abs(grads[name] - g) / (1e-12 + 1e-10 * np.abs(g))))
                for name, g in reference.last_grads.items())
    load = [runner.traffic[0][0].tolist() for runner in trainer.expert_runners]  # rows sent to each rank
    return {"losses": losses, "worst": worst, "sent_per_rank": world.allgather_object(load)}


def main() -> None:
    world = get_world()
    if sys.argv[1] == "collapse":
        result = collapse(world, int(sys.argv[2]))
        if world.rank == 0:
            emit_json(result)
        return
    with open(sys.argv[1]) as f:
        configs = json.load(f)
    results = [check(world, [str(flag) for flag in flags]) for flags in configs]
    if world.rank == 0:
        emit_json(results)


if __name__ == "__main__":
    main()
