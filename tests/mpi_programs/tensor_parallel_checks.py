"""Tensor parallelism's exact accounting, in one MPI launch.

    mpiexec -n N python tests/mpi_programs/tensor_parallel_checks.py CONFIGS.json

CONFIGS.json: a list of train flag lists with --tp (and --pp, --sequence-parallel, --checkpoint,
--zero ...). For each, the distributed Trainer takes two steps; on every rank:

  * bytes sent on the tp group in the second step == formulas.bytes_per_step, by kind
    (allreduce, allgather, reduce_scatter), for this rank's stages;
  * the parameters held whole on every tp rank (layer norms, row-parallel biases, wpe) are equal,
    bit for bit, across the group after the steps (nothing drifts apart);
  * data parallel without a pipeline: the memory ledger's model state on every rank is
    (P + G + K)·Ψ_rank with Ψ_rank = memory.gpt_parameters (float32/64 AdamW: K = 2P).

Rank 0 prints one JSON list: {"flags", "measured", "expected", "whole_equal"} per configuration
(measured/expected: every rank's {kind: bytes}).
"""

import json
import sys

import numpy as np

from refimpl import backend
from refimpl.checkpointing.actions import Restore, simulate_chain
from refimpl.checkpointing.plans import actions_for
from refimpl.memory import gpt_parameters
from refimpl.parallel.comm import get_world
from refimpl.parallel.tensor_parallel.communication import StepShape, bytes_per_step
from refimpl.tools.console import emit_json
from refimpl.tools.flags import config_from_flags
from refimpl.tools.run import build_model, build_task, make_trainer
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)

KINDS = ("allreduce", "allgather", "reduce_scatter")


def recomputed_blocks(plan: str, blocks: int) -> int:
    """Block forwards recomputed per micro-batch by the plan's schedule (checkpointing/plans.py)."""
    actions = actions_for(plan, blocks)
    return 0 if actions is None else simulate_chain(actions, blocks).advances


def restores(plan: str, blocks: int) -> int:
    """Kept block inputs restored per micro-batch (each one all-gathered with partitioned activations)."""
    return sum(isinstance(a, Restore) for a in actions_for(plan, blocks) or [])


def check(world, flags: list) -> dict:
    cfg = config_from_flags(flags)
    task = build_task(cfg)
    model = build_model(cfg, task)
    trainer = make_trainer(cfg, model, world, distributed=True)
    x, y = task.batch(0, cfg.batch_size)
    trainer.step(x, y)
    tp_comm = trainer.mesh.tp_comm
    before = tp_comm.counters.snapshot()
    trainer.step(x, y)
    spent = tp_comm.counters.since(before)
    measured = {kind: spent.get(kind, {}).get("bytes", 0) for kind in KINDS}
    stages = trainer.stages.values()
    blocks = sum(len(s.layers) if hasattr(s, "layers") else cfg.n_layer for s in stages)
    shape = StepShape(tokens=len(x) // (trainer.dp * trainer.schedule.micro_batches) * x.shape[1],
                      width=cfg.d_model, blocks=blocks, micro_batches=trainer.schedule.micro_batches,
                      has_embedding=any(s.is_first for s in stages), has_head=any(s.is_last for s in stages),
                      max_positions=cfg.seq_len,
                      recomputed_blocks=recomputed_blocks(cfg.checkpoint, blocks),
                      restored_inputs=restores(cfg.checkpoint, blocks) if cfg.partition_activations else 0,
                      arch=cfg.arch, kv_replicas=max(1, cfg.tp // (cfg.kv_heads or cfg.n_head)),
                      head_width=cfg.d_model // cfg.n_head)
    expected = bytes_per_step(shape, cfg.sequence_parallel, cfg.tp, np.dtype(cfg.dtype).itemsize)
    ledger_ok = None  # data parallel, one stage: the ledger's model state = memory.gpt_parameters
    if cfg.zero == 0 and cfg.pp == 1:
        llama = {} if cfg.arch != "llama" else {"arch": "llama", "ffn": cfg.ffn_size or 4 * cfg.d_model,
                                                "kv_width": (cfg.kv_heads or cfg.n_head) * cfg.d_model // cfg.n_head,
                                                "kv_heads": cfg.kv_heads or cfg.n_head}
        psi = sum(gpt_parameters(11, cfg.seq_len, cfg.d_model, cfg.n_layer, tp=cfg.tp, **llama).values())
        itemsize = np.dtype(cfg.dtype).itemsize
        ledger_ok = trainer.model_state_bytes() == {"parameters": itemsize * psi, "gradients": itemsize * psi,
                                                    "optimizer_states": 2 * itemsize * psi}  # AdamW: m and v
    tp = trainer.tensor_parallel
    whole = {name: backend.to_host(a) for name, a in trainer.sharding.whole_parameters().items()
             if name not in tp.splits}  # whole over the data-parallel group (ZeRO-3 holds shards)
    gathered = tp_comm.allgather_object(whole)
    equal = all(np.array_equal(other[name], whole[name]) for other in gathered for name in whole)
    # replicated slices (key/value heads fewer than ranks) equal on the R ranks that hold them
    replicated = {name: backend.to_host(a) for name, a in trainer.sharding.whole_parameters().items()
                  if name in tp.splits and tp.splits[name].replicas > 1}
    peers = tp_comm.allgather_object(replicated)
    same_head = lambda k, name: k // tp.splits[name].replicas == tp.rank // tp.splits[name].replicas  # noqa: E731
    equal = equal and all(np.array_equal(peers[k][name], replicated[name]) for name in replicated
                          for k in range(tp.size) if same_head(k, name))
    return {"flags": flags, "measured": world.allgather_object(measured),
            "expected": world.allgather_object(expected), "whole_equal": all(world.allgather_object(equal)),
            "ledger_equals_formula": world.allgather_object(ledger_ok)}


def main() -> None:
    world = get_world()
    with open(sys.argv[1]) as f:
        configs = json.load(f)
    results = [check(world, [str(flag) for flag in flags]) for flags in configs]
    if world.rank == 0:
        emit_json(results)


if __name__ == "__main__":
    main()
