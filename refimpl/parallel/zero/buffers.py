"""The flat buffers a stage keeps, counted in the memory ledger: whole (L,), one shard (L/N,), buckets.

    whole_parameter_buffers   every group's parameters in one whole buffer, each parameter's data a
                              view into it; the block this rank updates (stages 0-2; ZeRO-3's small
                              parameters)
    whole_gradient_buffers    every group's gradients the same way: backward accumulates into them
                              (stages 0 and 1)
    GradientShards            a persistent gradient shard per group, filled through a transient
                              bucket per group and backward, reduce-scattered (stages 2 and 3)
    all_gather_blocks         publish: every rank's updated block into the whole buffers, in place

Legend: L a group's padded length (flat.py), N ranks, L/N one rank's block.
"""

from __future__ import annotations

from refimpl.parallel.comm import wait_all

from .reductions import IN_FLIGHT, Reductions


def whole_parameter_buffers(groups: list, ledger, what: str = "whole parameters") -> tuple[list, list]:
    """(flats, blocks): every group's parameters in a whole flat buffer (L,), each parameter's data a
    view into it, and the block (L/N,) of it that this rank's optimizer updates."""
    flats, blocks = [], []
    for group in groups:
        flat = ledger.register("parameters", group.flatten([p.data for p in group.params]), what)  # (L,)
        for p, view in zip(group.params, group.views(flat)):
            p.set_flat_views(view)
        flats.append(flat)
        blocks.append(flat[group.start:group.stop])  # (L/N,)
    return flats, blocks


def whole_gradient_buffers(groups: list, ledger) -> list:
    """Every group's gradients in a whole flat buffer (L,), allocated once; each parameter's .grad is a
    view into it, so backward accumulates straight into it."""
    flats = []
    for group in groups:
        flat = ledger.register("gradients", group.empty(group.grad_dtype), "whole gradients")  # (L,)
        for p, view in zip(group.params, group.views(flat)):
            p.grad = view
        flats.append(flat)
    return flats


def all_gather_blocks(comm, flats: list) -> None:
    """Every rank's block of each whole buffer (L,) gathered into it, in place (the block is its own)."""
    wait_all([comm.iallgather(None, flat) for flat in flats])


class GradientShards:
    """A persistent gradient shard (L/N,) per group, filled through transient buckets (L,) (stages 2, 3).

    In every backward: a group's bucket is allocated when its first gradient arrives, and backward
    adds into it; when its last gradient is in, the stage calls reduce_scatter(group), which starts
    the bucket's reduce-scatter into a block (L/N,) and waits for the one before it (reductions.py):
    that block is added into the shard, and block and bucket are freed ("gradient_buckets" in the
    ledger). At most two buckets exist at once: one being reduced, the next one being filled.
    """

    def __init__(self, groups: list, ledger, comm) -> None:
        self.groups, self.ledger, self.comm = groups, ledger, comm
        self.shards = [ledger.register("gradients", group.empty(group.grad_dtype, whole=False), "gradient shard")
                       for group in groups]
        self.buckets = [None] * len(groups)  # (L,) while being filled and reduced
        self.received = [None] * len(groups)  # (L/N,) reduce-scatter outputs in flight
        self.reductions = Reductions(groups)

    def open_bucket(self, param) -> None:
        """Before param's gradient is accumulated: the first of its group in this backward allocates the
        group's bucket and points the group's .grads into it."""
        group = self.reductions.group_of[id(param)]
        if self.buckets[group.index] is None:
            bucket = self.ledger.register("gradient_buckets", group.empty(group.grad_dtype), "gradient bucket")  # (L,)
            for p, view in zip(group.params, group.views(bucket)):
                p.grad = view  # backward now adds (+=) into the bucket
            self.buckets[group.index] = bucket

    def count(self, param):
        """param's gradient is in its bucket: its group if that was the group's last gradient, else None."""
        return self.reductions.count(param)

    def reduce_scatter(self, group) -> None:
        """Start the reduce-scatter of group's bucket into a fresh block (L/N,); finish the one before it."""
        g = group.index
        self.received[g] = self.ledger.register("gradient_buckets", group.empty(group.grad_dtype, whole=False),
                                                "reduce-scatter output")
        self.reductions.start(group, self.comm.ireduce_scatter(self.buckets[g], self.received[g]))
        self.wait(keep=IN_FLIGHT)

    def wait(self, keep: int = 0) -> None:
        """Wait for the oldest reduce-scatters until `keep` are in flight; add each block into the shard."""
        for group in self.reductions.completed(keep):
            g = group.index
            self.shards[g] += self.received[g]  # accumulate this backward's summed block
            for p in group.params:
                p.grad = None
            self.ledger.release(self.received[g])
            self.ledger.release(self.buckets[g])
            self.received[g] = self.buckets[g] = None

    def poll(self) -> None:
        self.reductions.poll()

    def still_open(self, indices: list) -> list:
        """The groups among `indices` (a pipeline stage's) that received some gradients in this backward,
        but not all (a parameter this micro-batch did not use): their reduce-scatter has not started."""
        return [group for group in self.reductions.not_started(indices) if self.buckets[group.index] is not None]

    def end_backward(self, indices: list) -> None:
        """After a backward of the groups among `indices`: wait for every reduce-scatter; count afresh."""
        self.wait()
        self.reductions.next_backward(indices)

    def zero(self) -> None:
        for shard in self.shards:
            shard[...] = 0
