"""Partitioned activation checkpoints: ZeRO-R's Pa (Rajbhandari et al. 2019, arXiv 1910.02054, §6.1).

With tensor parallelism alone, the input of every transformer block is whole and the same on
every rank of the tensor-parallel group (it leaves the previous block's g all-reduce), so an
activation checkpoint of it is stored t times over. Pa keeps only rank r's 1/t of each kept block
input and all-gathers the whole again just before that block is recomputed:

    kept per checkpoint     N·C  ->  N·C/t elements            (N = b·T tokens, C width)
    traffic per restore     one all-gather of N·C elements (each rank sends N·C(t−1)/t)

With sequence parallelism the block input is already this rank's sequence shard, N·C/t: Pa has
nothing left to divide (the trainer refuses the combination instead of doing nothing silently).
ZeRO-R also offers to move the partitions to CPU memory (Pa+cpu); refimpl keeps them in place.

The object below is the `store` of refimpl/checkpointing/executor.py: the executor calls pack()
when the schedule takes a snapshot and unpack() when it restores one. A snapshot is cut as a flat
array into t blocks of the ring's layout (parallel/ring.py: lengths differ by at most one).
"""

from __future__ import annotations

import math

from refimpl import backend
from refimpl.parallel import ring


class PartitionedActivations:
    """pack: this rank's block of a flattened activation; unpack: all-gather the whole again."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def pack(self, array):
        flat = array.reshape(-1)  # (L,)
        start = ring.block_offset(flat.size, self.comm.size, self.comm.rank)
        return flat[start:start + ring.block_count(flat.size, self.comm.size, self.comm.rank)].copy()  # (≈L/t,)

    def unpack(self, kept, shape):
        whole = backend.xp().empty(math.prod(shape), dtype=kept.dtype)  # (L,)
        self.comm.allgather(kept, whole)
        return whole.reshape(shape)


__all__ = ["PartitionedActivations"]
