"""The gradient reductions of a backward: each flat group's count of gradients, and its reduction in flight.

Backward produces the gradients of a group's parameters one after the other; every parameter's
post-accumulate hook counts its gradient in, and the group's last gradient is the moment its
reduction can start: a non-blocking collective (all-reduce or reduce-scatter, flat.py's group
being the unit of communication) overlapping the rest of backward. Double buffering, as
DeepSpeed's overlap_comm: when a reduction starts, the stage waits for the ones before it until
one is left in flight, and finishes each (stages 2 and 3 add its block into the gradient shard and
free its bucket) at the same point of backward on every rank -- not whenever MPI happens to complete
it -- so every rank holds the same bytes at every allocation.

Every rank of the group runs the same actions on equally shaped data, so the groups complete -- and
their collectives start -- in the same order on every rank, as MPI requires. Groups never span two
pipeline stages, so a stage's groups are complete when its backward is; the ones that received no
gradient (a parameter unused by this micro-batch) are started by the stage after its backward.

MPI advances a non-blocking collective only inside MPI calls: every hook polls the ones in flight.
"""

from __future__ import annotations

IN_FLIGHT = 1  # reductions left running when the next one starts


class Reductions:
    """Per flat group: the gradients still to arrive in this backward, and its reduction in flight."""

    def __init__(self, groups: list) -> None:
        self.groups = groups  # groups[g].index == g
        self.group_of = {id(p): group for group in groups for p in group.params}
        self.pending = [len(group.params) for group in groups]  # gradients still to arrive, per group
        self.started: set[int] = set()  # groups whose reduction started in this backward
        self.in_flight: dict[int, object] = {}  # group index -> request, oldest first

    def count(self, param):
        """param's gradient is in: its group if that was the group's last gradient, else None."""
        group = self.group_of[id(param)]
        if group.index in self.started:  # its reduction may already have read the buffer
            raise RuntimeError(f"ZeRO: a gradient was accumulated into flat group {group.index} after its "
                               "reduction had started (the group's count of pending gradients is wrong)")
        self.pending[group.index] -= 1
        return group if self.pending[group.index] == 0 else None

    def start(self, group, request) -> None:
        """group's reduction has started (request: the non-blocking collective)."""
        self.in_flight[group.index] = request
        self.started.add(group.index)

    def completed(self, keep: int):
        """Wait for the oldest reductions until at most `keep` are in flight, yielding each group once done."""
        while len(self.in_flight) > keep:
            g = next(iter(self.in_flight))
            self.in_flight.pop(g).wait()
            yield self.groups[g]

    def wait(self, keep: int = 0) -> None:
        """completed(keep), with nothing to do after each: the reduced gradient is already in place."""
        for _ in self.completed(keep):
            pass

    def poll(self) -> None:
        for request in self.in_flight.values():
            request.test()

    def not_started(self, indices: list) -> list:
        """The groups among `indices` whose reduction did not start in this backward."""
        return [self.groups[g] for g in indices if g not in self.started]

    def next_backward(self, indices: list) -> None:
        """Count the gradients of the groups among `indices` (a pipeline stage's) afresh."""
        for g in indices:
            self.started.discard(g)
            self.pending[g] = len(self.groups[g].params)
