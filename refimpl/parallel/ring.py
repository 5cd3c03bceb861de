"""Ring collectives (and the pairwise all-to-all) built on point-to-point messages, and the byte
counts they imply.

The N ranks of a communicator sit on a ring: rank r sends only to its right neighbour
(r + 1) mod N and receives only from its left neighbour (r - 1) mod N (the all-to-all below is the
exception: every rank has something for every other). A buffer of L elements is cut into N
blocks, block b living at elements [offset_b, offset_b + count_b).

Block layout (lengths not divisible by N). refimpl uses *counts*, not padding: block b has
    count_b = L // N + (1 if b < L % N else 0)
elements (the layout of numpy.array_split), so blocks differ by at most one element, no copy is
made, and when L < N the last N - L blocks are empty. ZeRO pads its flat buffers to a multiple of
N itself, so its shards are equal; everything else works on any L.

Reduce-scatter (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 69(2), 2009, section 3). N - 1 steps. In step s = 0 .. N-2, rank r sends its
partial sum of block (r - s - 1) mod N to the right and receives the left neighbour's partial sum
of block (r - s - 2) mod N, to which it adds its own contribution. After the last step rank r holds
block r summed over all ranks. Rank r sends every block except block r:
    reduce-scatter bytes sent by rank r = (L - count_r) * itemsize           [= (N-1)/N * L * itemsize]

All-gather. N - 1 steps. Rank r starts with block r; in step s it sends block (r - s) mod N to the
right and receives block (r - s - 1) mod N from the left. It sends every block except block r + 1:
    all-gather bytes sent by rank r    = (L - count_{(r+1) mod N}) * itemsize [= (N-1)/N * L * itemsize]

All-reduce = reduce-scatter, then all-gather of the reduced blocks (Patarasuk & Yuan's
bandwidth-optimal all-reduce; the "2Ψ" of the ZeRO paper, arXiv 1910.02054, section 7.1):
    all-reduce bytes sent by rank r    = (2L - count_r - count_{(r+1) mod N}) * itemsize
                                                                             [= 2(N-1)/N * L * itemsize]
Summed over all ranks each phase sends exactly (N - 1) * L elements, whatever L is.

Broadcast is a chain along the ring: root -> root+1 -> ... -> root-1, each rank forwarding the
whole buffer once, so every rank except (root - 1) mod N sends L * itemsize bytes (the minimum
total, (N - 1) * L; unsegmented, so its latency grows with N).

All-to-all (pairwise exchange; Thakur, Rabenseifner & Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 19(1), 2005). Not a reduction and not a
ring: every rank has a block *for* every rank. Rank r's sendbuf holds block j (sendcounts[j]
elements) for rank j; its recvbuf receives block i (recvcounts[i] elements) from rank i, blocks
laid end to end (displacements are the exclusive prefix sums of the counts, as in a contiguous
MPI_Alltoallv; all-to-all is the case of equal counts). Rank r copies its own block locally, then
runs N - 1 steps: in step s = 1 .. N-1 it sends its block for rank (r + s) mod N to that rank and
receives rank (r - s) mod N's block for it, both at once (a sendrecv). In every step every rank
sends exactly one block and receives exactly one, so no rank sits idle and no link carries two.
Rank r sends every block except its own:
    all-to-all bytes sent by rank r    = (sum_j sendcounts_j - sendcounts_r) * itemsize
                                                           [= (N-1)/N * L * itemsize, equal blocks]
Summed over all ranks: every element of every sendbuf except the N diagonal blocks.

Summation order. Block b is summed along the ring starting after its owner and ending at it:
    result_b = (...((x_{b+1} + x_{b+2}) + x_{b+3}) + ...) + x_b          (rank indices mod N)
so the result is deterministic and the same on every rank, but in floating point it can differ by
rounding from MPI's built-in Allreduce, which picks its own algorithm (recursive doubling for short
messages, Rabenseifner's reduce-scatter + all-gather for long ones, in MPICH). Integer-valued data
give identical results.

How the steps are written. Each algorithm is a generator: it posts one step's messages, yields the
step's request handles, and continues (reducing what arrived) when the caller resumes it. The
blocking collectives drive the generator with wait-all; the non-blocking ones advance it one step
each time the request is tested. The `link` argument is the comm's view of the ring for one
collective call (`comm._RingLink`): `exchange(send, recv)` posts a send to the right and a
receive from the left, counting the bytes sent under the collective's name;
`exchange(send, recv, dest=j, source=i)` does the same with other peers (the all-to-all's).

Shapes in this module: L elements in the flat buffer, N ranks, count_b elements in block b,
ceil(L/N) the largest block; for all-to-all, sendcounts and recvcounts (N,), in elements.

What production libraries do differently: NCCL and MPI split each block into pipelined chunks,
use several rings or trees (double binary trees) across nodes, and pick the algorithm by message
size; the byte count per rank stays the bandwidth-optimal 2(N-1)/N * L for all-reduce. For
all-to-all, MPICH uses Bruck's algorithm for short blocks (log2 N steps, each forwarding about half
the buffer: fewer messages, more bytes) and posts every send and receive at once for medium ones;
NCCL does the latter (grouped point-to-point). The pairwise exchange here is MPICH's choice for
long blocks (with partner r XOR s when N is a power of two).
"""

from __future__ import annotations

import numpy as np

KINDS = ("allreduce", "reduce_scatter", "allgather", "bcast")  # bytes_sent's: a function of L
ALLTOALL_KINDS = ("alltoall", "alltoallv")  # alltoall_bytes_sent's: a function of the counts


# ------------------------------------------------------------------------------------------------
# Block layout and the byte formulas (the counters' rules for the built-in collectives)
# ------------------------------------------------------------------------------------------------


def block_count(length: int, size: int, block: int) -> int:
    """Elements in block `block` of a buffer of `length` elements cut into `size` blocks."""
    return length // size + (1 if block < length % size else 0)


def block_offset(length: int, size: int, block: int) -> int:
    """Index of the first element of block `block`."""
    return length // size * block + min(block, length % size)


def block_counts(length: int, size: int) -> np.ndarray:
    """All block lengths, shape (size,): the layout of numpy.array_split(range(length), size)."""
    counts = np.full(size, length // size, dtype=np.int64)
    counts[: length % size] += 1
    return counts


def block_offsets(counts: np.ndarray) -> np.ndarray:
    """Start of each block, shape (size,)."""
    offsets = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    return offsets


def bytes_sent(kind: str, length: int, size: int, rank: int, itemsize: int, root: int = 0) -> int:
    """Bytes rank `rank` sends in one ring `kind` collective on `length` elements.

    These are the counters' rules for MPI's built-in collectives, and exactly what the ring
    algorithms below send (tests check the two against each other).
    """
    if kind == "reduce_scatter":
        elements = length - block_count(length, size, rank)
    elif kind == "allgather":
        elements = length - block_count(length, size, (rank + 1) % size)
    elif kind == "allreduce":
        elements = 2 * length - block_count(length, size, rank) - block_count(length, size, (rank + 1) % size)
    elif kind == "bcast":
        elements = 0 if rank == (root - 1) % size else length
    elif kind in ALLTOALL_KINDS:
        raise ValueError(f"{kind} sends what the counts say, not a function of the length: "
                         "use alltoall_bytes_sent(sendcounts, rank, itemsize)")
    else:
        raise ValueError(f"no ring byte formula for {kind!r}; known: {', '.join(KINDS)}")
    return elements * itemsize


def alltoall_bytes_sent(sendcounts, rank: int, itemsize: int) -> int:
    """Bytes rank `rank` sends in one all-to-all (or all-to-allv) with these sendcounts (N,).

    Every block but its own: (sum_j sendcounts_j - sendcounts_rank) * itemsize. The counters' rule
    for MPI's built-in Alltoall(v), and what the pairwise exchange below sends.
    """
    counts = [int(c) for c in sendcounts]
    return (sum(counts) - counts[rank]) * itemsize


# ------------------------------------------------------------------------------------------------
# The algorithms, one generator per collective; each `yield` is one step's outstanding messages
# ------------------------------------------------------------------------------------------------


def _blocks(buf: np.ndarray, counts: np.ndarray, offsets: np.ndarray):
    """A function b -> view of block b of the flat buffer `buf`."""
    return lambda b: buf[offsets[b] : offsets[b] + counts[b]]


def reduce_scatter(link, sendbuf, recvbuf, reduce):
    """Ring reduce-scatter: recvbuf (count_r,) = block r of the sum over ranks of sendbuf (L,).

    `reduce` is a NumPy ufunc (np.add, np.maximum, np.minimum) applied as reduce(a, b, out=c).
    sendbuf is only read; recvbuf may be sendbuf's own block r (the all-reduce does that).
    """
    n, r = link.size, link.rank
    counts = block_counts(sendbuf.size, n)
    block = _blocks(sendbuf, counts, block_offsets(counts))
    if n == 1:
        if recvbuf is not sendbuf:
            recvbuf[...] = sendbuf
        return
    incoming = link.empty(int(counts.max()), sendbuf.dtype)  # (ceil(L/N),) the arriving block
    partial = link.empty(int(counts.max()), sendbuf.dtype)  # (ceil(L/N),) our running sum
    outgoing = block((r - 1) % n)  # step 0 sends our own contribution to block r-1
    for step in range(n - 1):
        b = (r - step - 2) % n  # the block arriving in this step
        arrived = incoming[: counts[b]]
        yield link.exchange(send=outgoing, recv=arrived)
        total = recvbuf if step == n - 2 else partial[: counts[b]]  # last step: b == r
        reduce(arrived, block(b), out=total)  # the left ranks' partial sum + our contribution
        outgoing = total  # forwarded in the next step


def allgather(link, buf):
    """Ring all-gather in place: buf (L,) holds this rank's block r; afterwards every block."""
    n, r = link.size, link.rank
    counts = block_counts(buf.size, n)
    block = _blocks(buf, counts, block_offsets(counts))
    for step in range(n - 1):
        yield link.exchange(send=block((r - step) % n), recv=block((r - step - 1) % n))


def allreduce(link, buf, reduce):
    """Ring all-reduce in place on buf (L,): reduce-scatter into our block, then all-gather."""
    if link.size == 1:
        return  # the reduction over one rank is the buffer itself
    counts = block_counts(buf.size, link.size)
    offset = int(block_offsets(counts)[link.rank])
    own = buf[offset : offset + counts[link.rank]]  # (count_r,) our block, reduced in place
    yield from reduce_scatter(link, buf, own, reduce)
    yield from allgather(link, buf)


def bcast(link, buf, root: int):
    """Chain broadcast of buf (L,) from `root` along the ring."""
    n, r = link.size, link.rank
    position = (r - root) % n  # distance from the root along the ring
    if position > 0:
        yield link.receive(buf)  # from the left neighbour
    if position < n - 1:
        yield link.send(buf)  # to the right neighbour


def alltoallv(link, sendbuf, sendcounts, recvbuf, recvcounts):
    """Pairwise all-to-all: block j of sendbuf (sendcounts[j],) to rank j; block i of recvbuf
    (recvcounts[i],) from rank i. Counts are (N,) int64 arrays; sendbuf and recvbuf do not overlap.

    Own block copied first, then N - 1 steps; step s sends to (r + s) mod N and receives from
    (r - s) mod N. An empty block is still sent (a zero-length message), so both sides of every
    pair always post their halves of the step.
    """
    n, r = link.size, link.rank
    outgoing = _blocks(sendbuf, sendcounts, block_offsets(sendcounts))
    incoming = _blocks(recvbuf, recvcounts, block_offsets(recvcounts))
    incoming(r)[...] = outgoing(r)  # our block for ourselves: a local copy, never sent
    for step in range(1, n):
        dest, source = (r + step) % n, (r - step) % n
        yield link.exchange(send=outgoing(dest), recv=incoming(source), dest=dest, source=source)


def run(steps, wait_all) -> None:
    """Drive a ring generator to the end, waiting for each step's messages (the blocking form)."""
    for requests in steps:
        wait_all(requests)
