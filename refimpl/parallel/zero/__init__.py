"""ZeRO: the Zero Redundancy Optimizer (Rajbhandari et al. 2020, arXiv 1910.02054), stages 1, 2 and 3.

Data parallelism keeps a whole copy of the model state on each of N ranks. ZeRO partitions it, one
more kind of state per stage. What each stage holds and how it reduces the gradients (the stage files
refer to this table; what each stage costs -- model-state bytes, elements sent per step -- is the
ZeRO table of refimpl/memory.py, the one source of those formulas; each stage's docstring states its
row):

    stage          parameters         gradients        optimizer   gradients reduced          then
    0  DP          whole              whole            whole       all-reduce, last backward  --
    1  P_os        whole              whole            shard       reduce-scatter, last B     all-gather
    2  P_os+g      whole              shard + bucket   shard       reduce-scatter, every B    all-gather
    3  P_os+g+p    shard + gathered   shard + bucket   shard       reduce-scatter, every B    --

"Last backward" is the last B (or W) of a pipeline stage in the step: stages 0 and 1 accumulate
whole gradients locally over the g micro-batches and reduce once; stages 2 and 3 keep only a shard,
so every backward reduces (through a transient bucket per flat group). "Then": what follows the
sharded optimizer step, all-gathering the updated parameter blocks. Stage 3 gathers a module's
whole parameters just before it runs, forward and backward, and frees them after.

Files, one idea each (mixed precision's loss scaler is refimpl/optim/precision.py, shared with
single-process training):

    flat.py        flat buffers padded to a multiple of N; shards; grouping into buckets / units
    buffers.py     the buffers a stage keeps: whole parameters and gradients, gradient shards filled
                   through buckets, the all-gather that publishes parameters
    reductions.py  each group's count of gradients in a backward, and its reduction in flight
    optimizer.py   the sharded optimizer step (unscale, overflow vote, clip, update, cast back)
    strategy.py    what every stage holds besides its step: ledger, loss scaler, groups, records
    stage1.py      ZeRO-1, read in order: forward, backward, a bucket's last gradient, the step
    stage0.py      DP in the same framework (for mixed precision): ZeRO-1 with one shard
    stage2.py      ZeRO-2, read in order: buckets reduce-scattered during every backward
    stage3.py      ZeRO-3, read in order: parameters gathered per module, prefetch

Sharded checkpoints, which every trainer writes (ZeRO's included, resumable at any N and stage), are
refimpl/tools/saved_runs/.

`python -m refimpl train --zero 3 ...` and `verify --zero 3 ...` select a stage (the one trainer,
parallel/trainer.py, composes it with the pipeline and precision); docs/zero.md walks through them
with measured tables.
"""

from __future__ import annotations

from .stage0 import ZeroStage0
from .stage1 import ZeroStage1
from .stage2 import ZeroStage2
from .stage3 import ZeroStage3

STAGES = {0: ZeroStage0, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}

__all__ = ["STAGES", "ZeroStage0", "ZeroStage1", "ZeroStage2", "ZeroStage3"]
