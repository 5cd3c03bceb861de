"""ZeRO stage 1: partition the optimizer states (P_os; Rajbhandari et al. 2020, arXiv 1910.02054, §5.1).

Each of N ranks keeps the whole parameters and the whole gradients, but the master weights and the
optimizer state only for its shard (1/N of every flat group, flat.py):

    model-state bytes per rank   (P + G) Ψ + K Ψ / N             mixed-precision Adam: 4Ψ + 12Ψ/N
    elements sent per step       reduce-scatter Ψ(N−1)/N + all-gather Ψ(N−1)/N = 2Ψ(N−1)/N, whatever g

One step, in the order it runs (the methods below, top to bottom):

    forward, backward    backward accumulates whole gradients into flat buckets of about
                         --bucket-bytes, micro-batch after micro-batch: they are reduced once a step
    a bucket's last      in the last backward of the step, the bucket's reduce-scatter starts
    gradient             (overlapping the rest of backward; reductions.py): rank r receives the sum
                         over ranks of block r only -- the only block its optimizer needs
    the step             each rank updates its shard of the master weights and optimizer state
                         (optimizer.py); then the updated parameter blocks are all-gathered, so that
                         every rank holds the whole model again

An all-reduce is exactly a reduce-scatter followed by an all-gather, so ZeRO-1 costs DP's
communication, split around the optimizer step. Transient memory: the reduce-scatter outputs (G·L/N
per bucket) are held from the reduction to the end of the step ("gradient_buckets" in the ledger).

Stage 0, data parallelism in this framework (stage0.py), is this class with one shard: the buckets
are whole on every rank, summed in place by an all-reduce, and every rank takes the same whole
step, so there is nothing to all-gather. The lines marked "DP" are where it differs.

What DeepSpeed does differently: it also reduces during backward, but into fixed-size buckets whose
boundaries need not align with the partitions (so it reduces to each partition's owner), and it
all-gathers in chunks of allgather_bucket_size. PyTorch's ZeroRedundancyOptimizer all-reduces and
then broadcasts each shard: 3Ψ, not the paper's 2Ψ.

Legend: Ψ parameters, N ranks, g micro-batches per step (gradient accumulation); P, G, K bytes per
parameter of parameters, gradients and optimizer state; L a bucket's padded length, L/N one rank's
block of it.
"""

from __future__ import annotations

from contextlib import contextmanager

from .buffers import all_gather_blocks, whole_gradient_buffers, whole_parameter_buffers
from .flat import bucket_groups
from .reductions import IN_FLIGHT, Reductions
from .strategy import ZeroStrategy


class ZeroStage1(ZeroStrategy):
    """Whole parameters and gradients; optimizer state (and master weights) for one shard."""

    stage = 1
    sharded = True  # False: stage 0, data parallelism (stage0.py)

    def __init__(self, model, parts: dict, optimizer, comm, bucket_bytes: int = 1 << 20, **common) -> None:
        super().__init__(parts, comm, **common)  # the ledger, the loss scaler, the parameters by name
        shards, rank = (self.world_size, self.rank) if self.sharded else (1, 0)  # DP: one shard, no padding
        self._lay_out(lambda named, first: bucket_groups(named, bucket_bytes, shards, rank, first))
        self.param_flats, blocks = whole_parameter_buffers(self.groups, self.ledger)  # (L,) each; blocks (L/N,)
        self.optimizer = self._sharded_optimizer(optimizer, blocks, sharded=self.sharded)
        self.grad_flats = whole_gradient_buffers(self.groups, self.ledger)  # (L,) each
        self.grad_blocks = [None] * len(self.groups)  # this rank's summed block (L/N,) of each, during a step
        self.reductions = Reductions(self.groups)
        self.reducing = False  # whether the gradients accumulating now are reduced: in the last backward only
        for p in (p for group in self.groups for p in group.params):
            p.register_post_accumulate_grad_hook(self._gradient_in)

    # -- one step, in the order it runs ---------------------------------------------------------------
    @contextmanager
    def around(self, action, last: bool):
        """Around one action of the micro-batch loop: F, B, I or W of a pipeline stage."""
        if action.kind in ("B", "W"):  # the stage's parameter gradients accumulate in this action
            self.reducing = last  # before the last backward, whole gradients accumulate locally
        yield
        if action.kind == "F":
            self.ledger.check_activations()  # a budget check when saved activations peak
        if action.kind in ("B", "W"):
            self._after_backward(self.groups_of_stage[action.stage])

    def _gradient_in(self, param) -> None:
        """Post-accumulate hook: param's gradient was added into its bucket."""
        group = self.reductions.count(param)
        if group is not None and self.reducing:  # the bucket's last gradient of the step
            self._reduce(group)
        self.reductions.poll()

    def _reduce(self, group) -> None:
        """Start summing group's bucket over the ranks into this rank's block; wait for the one before it."""
        flat = self.grad_flats[group.index]  # (L,)
        if self.sharded:
            block = self.ledger.register("gradient_buckets", group.empty(group.grad_dtype, whole=False),
                                         "reduce-scatter output")
            request = self.comm.ireduce_scatter(flat, block)  # block (L/N,): Σ over ranks of block r of flat
        else:  # DP: the whole bucket, summed in place
            block, request = flat, self.comm.iallreduce(flat)
        self.grad_blocks[group.index] = block
        self.reductions.start(group, request)
        self.reductions.wait(keep=IN_FLIGHT)

    def _after_backward(self, mine: list) -> None:
        """After a backward of the pipeline stage whose groups are `mine`: in the last one, reduce the
        buckets that received no gradient too; wait for every reduction."""
        if self.reducing:
            for group in self.reductions.not_started(mine):
                self._reduce(group)
        self.reductions.wait()
        self.reductions.next_backward(mine)

    def finish(self) -> list:
        """After the micro-batch loop: this rank's block of every bucket's summed gradient."""
        self.reductions.wait()
        return self.grad_blocks

    def optimizer_step(self, blocks: list, total: float | None = None):
        """Each rank steps its shard (optimizer.py; DP: every rank the whole); returns the StepResult."""
        return self.optimizer.step(blocks, total)

    def end_step(self, result) -> None:
        """Zero the gradients and free the blocks; if the step was taken, all-gather the parameters."""
        for flat in self.grad_flats:
            flat[...] = 0
        if self.sharded:  # DP: the blocks are the whole buckets, and every rank took the same step
            for block in self.grad_blocks:
                self.ledger.release(block)
            if result.applied:
                all_gather_blocks(self.comm, self.param_flats)
        self.grad_blocks = [None] * len(self.groups)

    # -- records (strategy.py) --------------------------------------------------------------------------
    def whole_parameters(self) -> dict:
        """{name: NumPy array} (collective); the float32 master weights under mixed precision."""
        if self.optimizer.keeps_masters:
            return self.gather_by_name(self.optimizer.masters)
        return self._arrays_by_name(self.param_flats)

    def load_full_state(self, masters: dict, states: dict, step: int) -> None:
        """Set master weights, parameters and optimizer state from whole flattened arrays by name."""
        self._load_blocks(masters, states, step)  # this rank's blocks
        if self.sharded:  # DP: every rank loaded the whole arrays
            all_gather_blocks(self.comm, self.param_flats)
