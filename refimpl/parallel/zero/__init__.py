"""ZeRO: the Zero Redundancy Optimizer (Rajbhandari et al., arXiv 1910.02054), stages 1, 2 and 3.

Data parallelism keeps a whole copy of the model state on each of N ranks. ZeRO partitions it:

    stage   partitioned                                   model-state bytes per rank   traffic/step
    DP      nothing                                       (P+G+K)Ψ                     2Ψ(N−1)/N
    1       optimizer states (P_os)                       (P+G)Ψ + KΨ/N                2Ψ(N−1)/N
    2       + gradients (P_os+g)                          PΨ + (G+K)Ψ/N                2Ψ(N−1)/N
    3       + parameters (P_os+g+p)                       (P+G+K)Ψ/N                   3Ψ(N−1)/N

(P, G, K bytes per parameter of parameters, gradients, optimizer state: mixed-precision Adam
2, 2, 12; float32 Adam 4, 4, 8. Traffic in elements per rank on a ring, one micro-batch.)

Files, one idea each (mixed precision's loss scaler is refimpl/optim/precision.py, shared with
single-process training):

    flat.py        flat buffers padded to a multiple of N; shards; grouping into buckets / units
    optimizer.py   the sharded optimizer step (unscale, overflow vote, clip, update, cast back)
    trainer.py     the training step and gradient hooks every stage shares
    stage0.py      DP in the same framework (for mixed precision)
    stage1.py      reduce-scatter gradients, step the shard, all-gather parameters
    stage2.py      gradients reduce-scattered bucket by bucket during backward, shard kept
    stage3.py      parameters gathered per module before forward and backward, prefetch
    checkpoint.py  sharded checkpoints: atomic, checksummed, resumable at any N and stage

`python -m refimpl train --zero 3 ...` and `verify --zero 3 ...` select a stage; docs/zero.md
walks through them with measured tables.
"""

from __future__ import annotations

from .stage0 import Stage0Trainer
from .stage1 import Stage1Trainer
from .stage2 import Stage2Trainer
from .stage3 import Stage3Trainer

TRAINERS = {0: Stage0Trainer, 1: Stage1Trainer, 2: Stage2Trainer, 3: Stage3Trainer}


def make_zero_trainer(stage: int, model, optimizer, comm=None, *, precision: str = "float32", grad_accum: int = 1,
                      clip: float = 0.0, bucket_bytes: int = 1 << 20, budget: int | None = None,
                      prefetch_bytes: int = 0, param_threshold: int = 0):
    """The trainer of ZeRO `stage` over `comm` (a one-process world if None).

    `optimizer` is an optimizer built with no parameters (its hyper-parameters and update rule):
    the trainer creates the state for this rank's shard only.
    """
    if stage not in TRAINERS:
        raise ValueError(f"unknown ZeRO stage {stage!r}; choose 0 (data parallel), 1, 2 or 3")
    if comm is None:
        from refimpl.parallel.comm import LocalComm  # noqa: PLC0415

        comm = LocalComm()
    options = dict(precision=precision, grad_accum=grad_accum, clip=clip, bucket_bytes=bucket_bytes, budget=budget)
    if stage == 3:
        options.update(prefetch_bytes=prefetch_bytes, param_threshold=param_threshold)
    return TRAINERS[stage](model, optimizer, comm, **options)


__all__ = ["TRAINERS", "make_zero_trainer", "Stage0Trainer", "Stage1Trainer", "Stage2Trainer", "Stage3Trainer"]
