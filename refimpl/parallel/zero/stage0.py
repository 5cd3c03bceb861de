"""Data parallelism inside the ZeRO framework: the paper's baseline (Rajbhandari et al. 2020, §3).

Every rank holds everything -- parameters, gradients, master weights, optimizer states -- whole:

    model-state bytes per rank   (P + G + K) Ψ                   mixed-precision Adam: 16Ψ
    elements sent per step       all-reduce of the gradients: 2Ψ(N−1)/N, whatever g

This is ZeRO-1 (stage1.py, read there in order) with one shard: the same flat buckets of about
--bucket-bytes, whole and unpadded; in the last backward of the step each bucket is all-reduced in
place as soon as its last gradient is in (instead of reduce-scattered), and every rank then takes
the same optimizer step on the same whole arrays, so there is nothing to all-gather.

refimpl runs float32/float64 `--zero 0` with parallel/data_parallel.py (DDP's strategy); this class
is what `--zero 0 --dtype mixed` runs, since mixed precision needs the master weights and loss
scaling of ZeRO's sharded optimizer (optimizer.py).

Legend: Ψ parameters, N ranks, g micro-batches per step (gradient accumulation); P, G, K bytes per
parameter of parameters, gradients and optimizer state.
"""

from __future__ import annotations

from .stage1 import ZeroStage1


class ZeroStage0(ZeroStage1):
    """Whole parameters, whole gradients (all-reduced), whole optimizer state on every rank."""

    stage = 0
    sharded = False
