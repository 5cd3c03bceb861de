"""Reference solutions to tutorial 03's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""

from refimpl.parallel import ring


def _blocks(buf, size):
    counts = ring.block_counts(buf.size, size)
    offsets = ring.block_offsets(counts)
    return lambda b: buf[offsets[b]:offsets[b] + counts[b]]


def ring_allgather(link, buf):
    n, r = link.size, link.rank
    block = _blocks(buf, n)
    for step in range(n - 1):
        yield link.exchange(send=block((r - step) % n), recv=block((r - step - 1) % n))


def ring_reduce_scatter(link, buf):
    n, r = link.size, link.rank
    block = _blocks(buf, n)
    scratch = link.empty(max(1, -(-buf.size // n)), buf.dtype)  # the largest block
    for step in range(n - 1):
        b = (r - step - 2) % n  # the block arriving now; we send the one we finished last step
        arrived = scratch[:block(b).size]
        yield link.exchange(send=block((r - step - 1) % n), recv=arrived)
        block(b)[...] += arrived


def allreduce_bytes(length, size, rank, itemsize):
    count = lambda b: length // size + (1 if b < length % size else 0)  # noqa: E731
    if size == 1:
        return 0
    return (2 * length - count(rank) - count((rank + 1) % size)) * itemsize
