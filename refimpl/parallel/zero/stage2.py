"""ZeRO stage 2: partition the gradients too (P_os+g; Rajbhandari et al. 2020, arXiv 1910.02054, §5.2).

Each rank keeps the whole parameters, but gradients, master weights and optimizer state only for its
shard:

    model-state bytes per rank   P Ψ + (G + K) Ψ / N             mixed-precision Adam: 2Ψ + 14Ψ/N
    elements sent per step       g reduce-scatters + one all-gather = (g + 1) Ψ(N−1)/N

One step, in the order it runs (the methods below, top to bottom):

    forward             nothing to do: the parameters are whole
    a bucket's first    (a bucket: a flat group of about --bucket-bytes, in backward order) its buffer
    gradient            of L elements is allocated, and backward accumulates into it
    a bucket's last     its reduce-scatter starts, overlapping the rest of backward, into a block of
    gradient            L/N elements; the one started before it is waited for (reductions.py): its
                        block is added into this rank's persistent gradient shard and its bucket freed
    after a backward    a bucket some of whose gradients did not arrive is reduce-scattered too (one
                        that received none is skipped); every reduce-scatter is waited for and added
    the step            each rank updates its shard (optimizer.py); the updated parameter blocks are
                        all-gathered, as in stage 1

So at most two buckets exist at once -- one being reduced, the next one being filled -- plus their
L/N outputs ("gradient_buckets" in the ledger); the whole gradient never does, and every rank holds
the same bytes at every allocation. Since only a shard is kept, every backward's buckets are
reduce-scattered and accumulated into the shard: g reduce-scatters per step. (DeepSpeed does the
same: ZeRO-2 communicates every micro-batch; keeping whole gradients across micro-batches would be
ZeRO-1.)

Legend: Ψ parameters, N ranks, g micro-batches per step (gradient accumulation); P, G, K bytes per
parameter of parameters, gradients and optimizer state; L a bucket's padded length, L/N one rank's
block of it.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

from .buffers import GradientShards, all_gather_blocks, whole_parameter_buffers
from .flat import bucket_groups
from .strategy import ZeroStrategy


class ZeroStage2(ZeroStrategy):
    """Whole parameters; a gradient shard, filled bucket by bucket during backward."""

    stage = 2

    def __init__(self, model, parts: dict, optimizer, comm, bucket_bytes: int = 1 << 20, **common) -> None:
        super().__init__(parts, comm, **common)  # the ledger, the loss scaler, the parameters by name
        self._lay_out(lambda named, first: bucket_groups(named, bucket_bytes, self.world_size, self.rank, first))
        self.param_flats, blocks = whole_parameter_buffers(self.groups, self.ledger)  # (L,) each; blocks (L/N,)
        self.optimizer = self._sharded_optimizer(optimizer, blocks)  # master weights and state: blocks only
        self.gradients = GradientShards(self.groups, self.ledger, comm)  # shards (L/N,); buckets (L,) while reduced
        for p in (p for group in self.groups for p in group.params):
            p.register_hook(partial(self._gradient_arriving, p))
            p.register_post_accumulate_grad_hook(self._gradient_in)

    # -- one step, in the order it runs ---------------------------------------------------------------
    @contextmanager
    def around(self, action, last: bool):
        """Around one action of the micro-batch loop: F, B, I or W of a pipeline stage (every backward
        reduces its gradients, the last one as the others)."""
        yield
        if action.kind == "F":
            self.ledger.check_activations()  # a budget check when saved activations peak
        if action.kind in ("B", "W"):  # the stage's parameter gradients accumulated in this action
            self._after_backward(self.groups_of_stage[action.stage])

    def _gradient_arriving(self, param, grad) -> None:
        """Leaf hook, before backward adds grad into param.grad: the group's first gradient opens its bucket."""
        self.gradients.open_bucket(param)

    def _gradient_in(self, param) -> None:
        """Post-accumulate hook: param's gradient was added into its group's bucket."""
        group = self.gradients.count(param)
        if group is not None:  # the bucket's last gradient: reduce-scatter it, add the one before into the shard
            self.gradients.reduce_scatter(group)
        self.gradients.poll()

    def _after_backward(self, mine: list) -> None:
        """After a backward of the pipeline stage whose groups are `mine`: reduce the buckets still open;
        wait for every reduce-scatter and add it into the shard."""
        for group in self.gradients.still_open(mine):
            self.gradients.reduce_scatter(group)
        self.gradients.end_backward(mine)

    def finish(self) -> list:
        """After the micro-batch loop: this rank's gradient shard (L/N,) of every bucket, summed."""
        self.gradients.wait()
        return self.gradients.shards

    def optimizer_step(self, blocks: list, total: float | None = None):
        """Each rank steps its shard (optimizer.py); returns the StepResult."""
        return self.optimizer.step(blocks, total)

    def end_step(self, result) -> None:
        """Zero the gradient shards; if the step was taken, all-gather the updated parameters."""
        self.gradients.zero()
        if result.applied:
            all_gather_blocks(self.comm, self.param_flats)

    # -- records (strategy.py) --------------------------------------------------------------------------
    def whole_parameters(self) -> dict:
        """{name: NumPy array} (collective); the float32 master weights under mixed precision."""
        if self.optimizer.keeps_masters:
            return self.gather_by_name(self.optimizer.masters)
        return self._arrays_by_name(self.param_flats)

    def load_full_state(self, masters: dict, states: dict, step: int) -> None:
        """Set master weights, parameters and optimizer state from whole flattened arrays by name."""
        self._load_blocks(masters, states, step)  # this rank's blocks
        all_gather_blocks(self.comm, self.param_flats)
