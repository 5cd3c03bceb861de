"""ZeRO stage 2: partition the gradients too (P_os+g; Rajbhandari et al., arXiv 1910.02054, §5.2).

Each rank keeps the whole parameters, but gradients, master weights and optimizer state only for
its shard:

    model-state bytes per rank   P Ψ + (G + K) Ψ / N            mixed Adam: 2Ψ + 14Ψ/N
    communication per step       reduce-scatter + all-gather = 2Ψ(N−1)/N (g = 1)

Gradients are reduced bucket by bucket *during* backward. A bucket (a flat group of about
--bucket-bytes, in backward order) is allocated when the first of its gradients arrives; backward
accumulates into it; when its last gradient is in, its reduce-scatter starts (non-blocking,
overlapping the rest of backward) into a block of L/N elements, and when that completes the block
is added into this rank's persistent gradient shard and the bucket is freed. When a bucket's
reduction starts, the trainer waits for the one before it (sharding.py, double buffering as
DeepSpeed's overlap_comm): at most two buckets exist at once -- one being reduced, the next one
being filled -- plus their L/N outputs ("gradient_buckets" in the ledger). The whole gradient never
does, and the bytes held at every allocation are the same on every rank.

Gradient accumulation (g micro-batches): the whole gradient is never kept, so every micro-batch's
buckets are reduce-scattered and accumulated into the shard: g reduce-scatters and one all-gather
per step, (g + 1)Ψ(N−1)/N elements. (DeepSpeed does the same: ZeRO-2 communicates every
micro-batch; keeping whole gradients across micro-batches would be ZeRO-1.)

After the sharded optimizer step the updated parameter blocks are all-gathered, as in stage 1.

Legend: L a bucket's padded length, N ranks, L/N one rank's block.
"""

from __future__ import annotations

from .flat import bucket_groups
from .sharding import ZeroSharding


class ZeroStage2(ZeroSharding):
    """Whole parameters; a gradient shard, filled bucket by bucket during backward."""

    stage = 2
    sharded = True
    reduce_every_micro_batch = True

    def _make_groups(self, named: list, first_index: int) -> list:
        return bucket_groups(named, self.bucket_bytes, self.world_size, self.rank, first_index)  # padded to N

    def _hold_parameters(self) -> list:
        self.param_flats, blocks = self._whole_parameter_buffers(self.groups)  # (L,) each; blocks (L/N,)
        return blocks

    def _hold_gradients(self) -> None:
        self._hold_gradient_shards()  # (L/N,) each, persistent; buckets (L,) only while reduced

    def _before_accumulate(self, param, grad):
        self._open_bucket(self._group_of[id(param)])  # the group's first gradient: allocate its bucket
        return None

    def _needs_reduction(self, group) -> bool:
        return self.grad_buckets[group.index] is not None  # no gradient arrived: nothing to add

    def _start_reduction(self, group):
        return self._reduce_scatter_bucket(group)

    def _reduction_done(self, group) -> None:
        self._add_bucket_into_shard(group)

    def _gradient_blocks(self) -> list:
        return self.grad_shards

    def _clear_gradients(self) -> None:
        for shard in self.grad_shards:
            shard[...] = 0

    def _publish(self) -> None:
        self._all_gather_parameters(self.param_flats)

    def _whole_parameters(self, group):
        return self.param_flats[group.index]
