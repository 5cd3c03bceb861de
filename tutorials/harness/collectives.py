"""A ring of N ranks simulated in one process, and the checks of tutorial 03 (collectives by hand).

refimpl's ring algorithms (refimpl/parallel/ring.py) are generators over a `link`: each step they
post messages with `link.exchange(send=..., recv=...)` (send to the right neighbour, receive from
the left one), `link.send(buf)` or `link.receive(buf)`, and yield the handles; they continue once
the step's messages have arrived. Under MPI the link is comm.py's `_RingLink`. Here `SimLink`
plays that role for N ranks held in one process, so the same generator code (refimpl's, or a
student's) runs on a simulated ring:

    buffers = [np.arange(6.0) * (r + 1) for r in range(3)]             # rank r's buffer
    sent = run_ring(ring.allreduce, buffers, np.add)                   # ring.allreduce(link, buf, np.add) per rank
    # buffers[r] now holds the sum on every rank; sent[r] = bytes rank r sent

Messages are buffered (a send copies its data when it is posted) and matched first in, first out;
a rank resumes once every receive it posted has arrived. If no rank can resume, the simulation
stops with a RingDeadlock that says who waits for what.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from refimpl.parallel import ring

from . import Wrong, plain


class RingDeadlock(RuntimeError):
    pass


class SimLink:
    """Rank `rank`'s view of a simulated ring of `size` ranks (the interface of comm._RingLink)."""

    def __init__(self, rank: int, size: int, mailboxes: list, trace: list | None) -> None:
        self.rank, self.size = rank, size
        self.right, self.left = (rank + 1) % size, (rank - 1) % size
        self._mailboxes = mailboxes  # mailboxes[r]: messages waiting for rank r, in order
        self._trace = trace
        self.step = 0
        self.bytes_sent = 0

    def send(self, buf) -> list:
        self._mailboxes[self.right].append(np.array(buf, copy=True))
        self.bytes_sent += buf.nbytes
        if self._trace is not None:
            self._trace.append((self.step, self.rank, np.array(buf, copy=True)))
        return []

    def receive(self, buf) -> list:
        return [buf]  # a pending receive: filled by the simulation when a message arrives

    def exchange(self, send, recv) -> list:
        return self.receive(recv) + self.send(send)

    @staticmethod
    def empty(n: int, dtype):
        return np.empty(n, dtype=dtype)


def run_ring(algorithm, buffers: list, *args, trace: list | None = None) -> list[int]:
    """Run `algorithm(link, buffers[r], *args)` on every rank of a simulated ring.

    Returns the bytes each rank sent. With `trace` (a list), appends (step, rank, data sent).
    """
    size = len(buffers)
    mailboxes = [deque() for _ in range(size)]
    links = [SimLink(r, size, mailboxes, trace) for r in range(size)]
    programs = [algorithm(links[r], buffers[r], *args) for r in range(size)]
    waiting: list[list | None] = [[] for _ in range(size)]  # receives posted and not yet filled
    if not all(hasattr(p, "__next__") for p in programs):
        raise Wrong(f"{getattr(algorithm, '__name__', 'the algorithm')} must be a generator: post each step's "
                    "messages with `yield link.exchange(send=..., recv=...)`")
    finished = [False] * size
    while not all(finished):
        progressed = False
        for r in range(size):
            if finished[r]:
                continue
            while waiting[r] and mailboxes[r]:  # deliver arrived messages in order
                message, target = mailboxes[r].popleft(), waiting[r].pop(0)
                if message.size != target.size:
                    raise Wrong(f"rank {r - 1 if r else size - 1} sent {message.size} elements but rank {r} "
                                f"posted a receive for {target.size}")
                target[...] = message.reshape(target.shape)
            if waiting[r]:
                continue
            try:
                handles = next(programs[r])
            except StopIteration:
                finished[r] = True
                progressed = True
                continue
            links[r].step += 1
            waiting[r] = [h for h in (handles or []) if h is not None]
            progressed = True
        if not progressed:
            stuck = [r for r in range(size) if not finished[r]]
            raise RingDeadlock(f"deadlock: ranks {stuck} wait for messages their left neighbours never send")
    leftover = [r for r in range(size) if mailboxes[r]]
    if leftover:
        raise Wrong(f"rank(s) {leftover} were sent messages they never received")
    return [link.bytes_sent for link in links]


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------

CASES = [(1, 5), (2, 6), (3, 7), (4, 4), (4, 2), (5, 13)]  # (ranks N, elements L): N divides L or not


def _inputs(size: int, length: int) -> list[np.ndarray]:
    """Rank r's buffer: distinct small integers, so every sum is exact in float64."""
    return [(np.arange(length) + 1.0) * 10.0**r for r in range(size)]


def _run(algorithm, buffers: list, length: int) -> list[int]:
    """run_ring, with the ring's size and the buffer's length added to any complaint."""
    try:
        return run_ring(algorithm, buffers)
    except (RingDeadlock, Wrong) as exc:
        raise Wrong(f"with {len(buffers)} ranks and {length} elements: {exc}") from None


def _blocks(length: int, size: int):
    counts = ring.block_counts(length, size)
    offsets = ring.block_offsets(counts)
    return [slice(int(o), int(o + c)) for o, c in zip(offsets, counts)]


def check_ring_allgather(ring_allgather) -> None:
    """Check: ring all-gather."""
    for size, length in CASES:
        full = _inputs(1, length)[0]
        blocks = _blocks(length, size)
        buffers = [np.full(length, np.nan) for _ in range(size)]
        for r in range(size):
            buffers[r][blocks[r]] = full[blocks[r]]  # rank r holds only its own block
        sent = _run(ring_allgather, buffers, length)
        for r in range(size):
            if not np.array_equal(buffers[r], full):
                raise Wrong(f"with {size} ranks and {length} elements, rank {r} ends with {buffers[r]} "
                            f"but should hold every block: {full}")
            expected = ring.bytes_sent("allgather", length, size, r, 8)
            if sent[r] != expected:
                raise Wrong(f"with {size} ranks and {length} elements, rank {r} sent {sent[r]} bytes; the ring "
                            f"all-gather sends {expected} (every block once, except the one its right neighbour has)")


def check_ring_reduce_scatter(ring_reduce_scatter) -> None:
    """Check: ring reduce-scatter."""
    for size, length in CASES:
        buffers = _inputs(size, length)
        total = np.sum(buffers, axis=0)
        blocks = _blocks(length, size)
        sent = _run(ring_reduce_scatter, buffers, length)
        for r in range(size):
            if not np.array_equal(buffers[r][blocks[r]], total[blocks[r]]):
                raise Wrong(f"with {size} ranks and {length} elements, rank {r}'s block {r} is "
                            f"{buffers[r][blocks[r]]} but should be the sum over ranks, {total[blocks[r]]}")
            expected = ring.bytes_sent("reduce_scatter", length, size, r, 8)
            if sent[r] != expected:
                raise Wrong(f"with {size} ranks and {length} elements, rank {r} sent {sent[r]} bytes; the ring "
                            f"reduce-scatter sends {expected} (every block once, except its own)")


def check_allreduce_bytes(allreduce_bytes) -> None:
    """Check: bytes a rank sends in a ring all-reduce."""
    general = [(size, length) for size in (4, 3, 5, 6, 2) for length in (1000, 2 * size + 1, size, size - 1)]
    degenerate = [(size, length) for size in (4, 3, 5, 6, 2) for length in (1, 0)] + [(1, n) for n in (1000, 5, 0)]
    for size, length in general + degenerate:  # the general case first: its message teaches most
        for rank in range(size):
            expected = ring.bytes_sent("allreduce", length, size, rank, 4)
            got = allreduce_bytes(length, size, rank, 4)
            if got == expected:
                continue
            message = (f"an all-reduce of {length} float32 elements over {size} ranks: rank {rank} sends "
                       f"{expected} bytes, you said {plain(got)}")
            if size == 1:
                message += ". One rank has no neighbour: it sends nothing, whatever the length"
            elif length < size:
                message += (". With fewer elements than ranks some blocks are empty (block b has L // N + (1 if "
                            "b < L % N) elements): rank r sends 2L − c_r − c_(r+1) elements")
            elif got == 2 * (size - 1) * length * 4 / size or got == 2 * (size - 1) * (length // size) * 4:
                message += (". 2(N − 1)/N · L holds only when N divides L: the blocks differ by one element, and "
                            "rank r sends every block but its own and its right neighbour's in the reduce-scatter "
                            "and the all-gather, 2L − c_r − c_(r+1) elements")
            raise Wrong(message)


def _most_bytes(length: int, size: int, itemsize: int) -> int:
    """The most bytes one rank sends in a ring all-reduce: (2L − the smallest c_r + c_{r+1}) · itemsize."""
    if size == 1:
        return 0
    counts = np.full(size, length // size, dtype=np.int64)
    counts[:length % size] += 1
    return int((2 * length - (counts + np.roll(counts, -1)).min()) * itemsize)


def check_bottleneck_bytes(bottleneck_bytes) -> None:
    """Check: the busiest rank of a ring all-reduce."""
    cases = [(size, length) for size in range(2, 7) for length in range(14, -1, -1)]  # measured on the simulated ring
    cases += [(1, length) for length in (14, 1, 0)]  # one rank, the degenerate case, after the general ones
    cases += [(size, length) for size in (7, 8, 12, 16) for length in (size - 1, size + 1, 3 * size - 1, 1000, 1001)]
    cases += [(1_000_000, 10**9 + 999_999), (1_000_000, 10**9 + 999_998), (1_000_000, 10**12)]
    for size, length in cases:
        if size <= 6:
            measured = run_ring(ring.allreduce, [np.ones(length, dtype=np.float32) for _ in range(size)], np.add)
            expected, how = max(measured), "measured on the simulated ring"
        else:
            expected, how = _most_bytes(length, size, 4), "the largest of ring.bytes_sent over the ranks"
        got = bottleneck_bytes(length, size, 4)
        if got == expected:
            continue
        message = (f"an all-reduce of {length} float32 elements over {size} ranks: the busiest rank sends "
                   f"{expected} bytes ({how}); you said {plain(got)}")
        if size == 1:
            message += ". One rank has no neighbour: it sends nothing"
        mistake = _bottleneck_mistake(bottleneck_bytes)
        if mistake:
            message += ". " + mistake
        raise Wrong(message)


_PROBES = [(10, 4), (11, 4), (7, 4), (3, 4), (1000, 7), (1001, 7), (6, 3), (5, 3)]  # L mod N of every kind

_MISTAKES = [
    (lambda L, N, e: 2 * (N - 1) * -(-L // N) * e,
     "You charged every one of the 2(N − 1) steps a largest block, but a rank sends each block at most once per "
     "phase: all but its own in the reduce-scatter, all but its right neighbour's in the all-gather"),
    (lambda L, N, e: 2 * (N - 1) * L * e // N,
     "That is 2(N − 1)/N · L, the average over ranks; when N does not divide L the ranks differ, and the busiest "
     "is the one whose own block and right neighbour's block are smallest"),
    (lambda L, N, e: -(-2 * (N - 1) * L * e // N),
     "That is 2(N − 1)/N · L rounded up, the average over ranks; when N does not divide L the ranks differ, and "
     "the busiest is the one whose own block and right neighbour's block are smallest"),
    (lambda L, N, e: (2 * L - 2 * (L // N)) * e,
     "When L mod N = N − 1 only one block is small, so no rank owns a small block next to another small one: "
     "then the smallest c_r + c_(r+1) is 2·(L // N) + 1"),
]


def _bottleneck_mistake(bottleneck_bytes) -> str:
    """The known mistake that `bottleneck_bytes` makes on every probe, or ''."""
    for formula, says in _MISTAKES:
        try:
            if all(bottleneck_bytes(L, N, 4) == formula(L, N, 4) for L, N in _PROBES):
                return says
        except Exception:  # noqa: BLE001 - the diagnosis is best effort
            return ""
    return ""
