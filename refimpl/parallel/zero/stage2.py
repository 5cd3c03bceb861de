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

from .stage1 import ZeroStage1


class ZeroStage2(ZeroStage1):
    """Whole parameters; a gradient shard, filled bucket by bucket during backward."""

    stage = 2
    reduce_every_micro_batch = True

    def _hold_gradients(self) -> None:
        self.grad_shards = [self.ledger.register("gradients", group.empty(whole=False), "gradient shard")  # (L/N,)
                            for group in self.groups]
        self.grad_buckets = [None] * len(self.groups)  # (L,) while being filled and reduced
        self.received = [None] * len(self.groups)  # (L/N,) reduce-scatter outputs in flight

    def _before_accumulate(self, param, grad):
        """The first gradient of a group in this backward: allocate the group's bucket."""
        g = self._group_of[id(param)]
        if self.grad_buckets[g] is None:
            group = self.groups[g]
            bucket = self.ledger.register("gradient_buckets", group.empty(), "gradient bucket")  # (L,)
            for p, view in zip(group.params, group.views(bucket)):
                p.grad = view  # backward now adds (+=) into the bucket
            self.grad_buckets[g] = bucket
        return None

    def _needs_reduction(self, group) -> bool:
        return self.grad_buckets[group.index] is not None  # no gradient arrived: nothing to add

    def _start_reduction(self, group):
        g = group.index
        self.received[g] = self.ledger.register("gradient_buckets", group.empty(whole=False), "reduce-scatter output")
        return self.comm.ireduce_scatter(self.grad_buckets[g], self.received[g])

    def _reduction_done(self, group) -> None:
        g = group.index
        self.grad_shards[g] += self.received[g]  # accumulate this micro-batch's summed block
        for p in group.params:
            p.grad = None
        self.ledger.release(self.received[g])
        self.ledger.release(self.grad_buckets[g])
        self.received[g] = self.grad_buckets[g] = None

    def _gradient_blocks(self) -> list:
        return self.grad_shards

    def _clear_gradients(self) -> None:
        for shard in self.grad_shards:
            shard[...] = 0
