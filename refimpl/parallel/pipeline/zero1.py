"""ZeRO-1 inside a pipeline: shard the optimizer state of a rank's stages over its gradient group.

In a dp x pp pipeline (trainer.py), the ranks that hold the same stages — the dp replicas of a
pipeline rank, and in DualPipe also the mirrored rank that holds the other copy — form a gradient
group of G ranks (G = dp, or 2·dp for DualPipe). Without ZeRO they all-reduce their gradients and
every one of them keeps the whole optimizer state of those stages. ZeRO stage 1 (Rajbhandari et
al., arXiv 1910.02054, section 5.1) keeps each rank's optimizer state for 1/G of them only:

    1. the stages' parameters and gradients live in flat buffers padded to a multiple of G
       (parallel/zero/flat.py, buckets of about --bucket-bytes), every parameter a view into them;
    2. after the pipeline schedule: reduce-scatter each gradient buffer over the group, so rank g
       gets block g of the summed gradient (Ψ_rank(G−1)/G elements sent);
    3. the sharded optimizer (parallel/zero/optimizer.py) updates block g of the parameters with
       optimizer state for that block only;
    4. all-gather the updated blocks into the whole parameter buffers (Ψ_rank(G−1)/G elements).

    model-state bytes per rank   (P + G)·Ψ_rank + K·Ψ_rank / G     (Ψ_rank: the rank's stages)
    communication per step       2·Ψ_rank(G−1)/G elements, the same as the all-reduce it replaces

Clipping by the global norm needs Σ over all stages of ‖g_s‖²: each rank's block gives its part,
a sum over the gradient group gives the norm of the group's stages, and a sum over the pipeline
— counting each group once — gives the whole model's (trainer.py).

Only stage 1 composes with the pipeline here. ZeRO-2 would reduce-scatter after every
micro-batch's backward — in a pipeline, after every B or W of the schedule, M times per step —
and ZeRO-3 would gather a stage's parameters before each of its F and B; both are natural next
steps that this module does not take.
"""

from __future__ import annotations

from refimpl.memory import MemoryLedger
from refimpl.optim.clip import squared_norm
from refimpl.parallel.zero.flat import bucket_groups
from refimpl.parallel.zero.optimizer import ShardedOptimizer


class StageZero1:
    """Flat buffers, sharded optimizer and the reduce-scatter / all-gather of one rank's stages."""

    def __init__(self, named_params: list, comm, optimizer, bucket_bytes: int, rank: int) -> None:
        self.comm = comm
        self.ledger = MemoryLedger(None, rank)
        self.groups = bucket_groups(named_params, bucket_bytes, comm.size, comm.rank)
        self.param_flats, self.grad_flats, blocks = [], [], []
        for group in self.groups:
            flat = self.ledger.register("parameters", group.flatten([p.data for p in group.params]),
                                        "whole parameters")  # (L,)
            grad = self.ledger.register("gradients", group.empty(), "whole gradients")  # (L,)
            for p, view, grad_view in zip(group.params, group.views(flat), group.views(grad)):
                p.grad = None
                p.set_flat_views(view, grad_view)
            self.param_flats.append(flat)
            self.grad_flats.append(grad)
            blocks.append(flat[group.start:group.stop])  # (L/G,) the block this rank updates
        self.optimizer = ShardedOptimizer(optimizer, self.groups, blocks, self.ledger, comm, clip=0.0)

    def reduce_scatter(self) -> list:
        """Block g of every summed gradient buffer, (L/G,) each."""
        blocks = []
        for group, grad in zip(self.groups, self.grad_flats):
            block = self.ledger.register("gradient_buckets", group.empty(whole=False), "reduce-scatter output")
            self.comm.reduce_scatter(grad, block)
            blocks.append(block)
        return blocks

    def group_squared_norm(self, blocks: list) -> float:
        """Σ ‖g‖² over the group's stages: the blocks' squared norms summed over the group."""
        return self.comm.allreduce_value(squared_norm(blocks))

    def write_whole_gradients(self, blocks: list) -> None:
        """Put the summed (and clipped) gradients back into the whole buffers, for records (verify)."""
        for block, grad in zip(blocks, self.grad_flats):
            self.comm.allgather(block, grad)

    def step(self, blocks: list) -> None:
        """Update this rank's blocks, all-gather the parameters, zero the gradients."""
        self.optimizer.step(blocks)
        for flat in self.param_flats:
            self.comm.allgather(None, flat)  # our block is already in place
        for grad in self.grad_flats:
            grad[...] = 0
        for block in blocks:
            self.ledger.release(block)

    def model_state_bytes(self) -> dict:
        """{"parameters", "gradients", "optimizer_states"}: bytes this rank holds."""
        current = self.ledger.current()
        return {k: int(current.get(k, 0)) for k in ("parameters", "gradients", "optimizer_states")}


__all__ = ["StageZero1"]
