"""ZeRO stage 1: partition the optimizer states (P_os; Rajbhandari et al., arXiv 1910.02054, §5.1).

Each of N ranks keeps the whole parameters and the whole gradients, but the master weights and
the optimizer state only for its shard (1/N of every flat group, flat.py):

    model-state bytes per rank   (P + G) Ψ + K Ψ / N            mixed Adam: 4Ψ + 12Ψ/N
    communication per step       reduce-scatter (Ψ(N−1)/N) + all-gather (Ψ(N−1)/N) = 2Ψ(N−1)/N

The step. Backward accumulates whole gradients into flat buckets, as in DP (stage0.py). On the
last micro-batch each bucket is *reduce-scattered* as soon as its last gradient is in: rank r
receives the sum over ranks of block r only -- the only block its optimizer needs. Each rank
updates its shard of the master weights and optimizer state, then the updated parameter blocks
are *all-gathered* so that every rank holds the whole model again. An all-reduce is exactly a
reduce-scatter followed by an all-gather, so ZeRO-1 costs DP's communication, split around the
optimizer step.

Gradient accumulation (g micro-batches): gradients are whole, so they accumulate locally and are
reduced once per step: 2Ψ(N−1)/N whatever g is.

Transient memory: the reduce-scatter output (G·L/N per bucket) is held from the reduction to the
end of the step ("gradient_buckets" in the ledger; not model state).

What DeepSpeed does differently: it also reduces during backward, but into fixed-size buckets
whose boundaries need not align with the partitions (so it reduces to each partition's owner), and
it all-gathers in chunks of allgather_bucket_size. PyTorch's ZeroRedundancyOptimizer all-reduces
and then broadcasts each shard: 3Ψ, not the paper's 2Ψ.

Legend: L a bucket's padded length, N ranks, L/N one rank's block.
"""

from __future__ import annotations

from .flat import bucket_groups
from .sharding import ZeroSharding


class ZeroStage1(ZeroSharding):
    """Whole parameters and gradients; optimizer state (and master weights) for one shard."""

    stage = 1
    sharded = True

    def _make_groups(self, named: list, first_index: int) -> list:
        return bucket_groups(named, self.bucket_bytes, self.world_size, self.rank, first_index)  # padded to N

    def _hold_parameters(self) -> list:
        self.param_flats, blocks = self._whole_parameter_buffers(self.groups)  # (L,) each; blocks (L/N,)
        return blocks

    def _hold_gradients(self) -> None:
        self.grad_flats = self._whole_gradient_buffers()  # (L,) each
        self.grad_blocks = [None] * len(self.groups)  # reduce-scatter outputs (L/N,), during a step

    def _needs_reduction(self, group) -> bool:
        return True  # whole gradients: every bucket is reduced after the last backward

    def _start_reduction(self, group):
        recv = self.ledger.register("gradient_buckets", group.empty(whole=False), "reduce-scatter output")  # (L/N,)
        self.grad_blocks[group.index] = recv
        return self.comm.ireduce_scatter(self.grad_flats[group.index], recv)

    def _reduction_done(self, group) -> None:
        pass

    def _gradient_blocks(self) -> list:
        return self.grad_blocks

    def _clear_gradients(self) -> None:
        for flat in self.grad_flats:
            flat[...] = 0
        for block in self.grad_blocks:
            self.ledger.release(block)
        self.grad_blocks = [None] * len(self.groups)

    def _publish(self) -> None:
        self._all_gather_parameters(self.param_flats)

    def _whole_parameters(self, group):
        return self.param_flats[group.index]
