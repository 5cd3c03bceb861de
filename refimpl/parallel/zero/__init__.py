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
    sharding.py    what every stage shares: groups per pipeline stage, gradient hooks, the step
    stage0.py      DP in the same framework (for mixed precision)
    stage1.py      reduce-scatter gradients, step the shard, all-gather parameters
    stage2.py      gradients reduce-scattered bucket by bucket during backward, shard kept
    stage3.py      parameters gathered per module before forward and backward, prefetch

Sharded checkpoints, which every trainer writes (ZeRO's included, resumable at any N and stage), are
refimpl/saved_runs/.

`python -m refimpl train --zero 3 ...` and `verify --zero 3 ...` select a stage (the one trainer,
parallel/trainer.py, composes it with the pipeline and precision); docs/zero.md
walks through them with measured tables.
"""

from __future__ import annotations

from .stage0 import ZeroStage0
from .stage1 import ZeroStage1
from .stage2 import ZeroStage2
from .stage3 import ZeroStage3

STAGES = {0: ZeroStage0, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}

__all__ = ["STAGES", "ZeroStage0", "ZeroStage1", "ZeroStage2", "ZeroStage3"]
