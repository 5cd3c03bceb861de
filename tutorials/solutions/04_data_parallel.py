"""Reference solutions to tutorial 04's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them), and a
model answer to its question (at the end)."""

from refimpl.nn import functional as F


def rank_micro_batches(x, y, world_size, rank, grad_accum):
    n = len(x) // world_size
    xr, yr = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    m = n // grad_accum
    return [(xr[i * m:(i + 1) * m], yr[i * m:(i + 1) * m]) for i in range(grad_accum)]


def local_loss(model, x, y, global_count):
    return F.cross_entropy(model(x), y, reduction="sum") * (1.0 / global_count)


def assign_buckets(param_bytes, bucket_bytes):
    buckets, size = [], 0
    for i in reversed(range(len(param_bytes))):  # backward produces the last parameters' gradients first
        if not buckets or size + param_bytes[i] > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += param_bytes[i]
    return buckets


def bucketed_bytes(param_numels, itemsize, world_size, rank, bucket_bytes):
    # Each bucket is one ring all-reduce of its own length L: rank r sends 2L − c_r − c_(r+1)
    # elements, with c_b = L // N + (1 if b < L % N else 0) (tutorial 03).
    n, r = world_size, rank
    if n == 1:
        return 0
    count = lambda length, b: length // n + (1 if b < length % n else 0)  # noqa: E731
    total = 0
    for bucket in assign_buckets([k * itemsize for k in param_numels], bucket_bytes):
        length = sum(param_numels[i] for i in bucket)
        total += 2 * length - count(length, r) - count(length, (r + 1) % n)
    return total * itemsize


ANSWER = """
Model answer to the question (measure and explain).

Measured (2 steps, 3 ranks, --collectives ring; bytes of rank 0, 1, 2):
naive 80,816 / 81,072 / 80,864 in 36 calls each; bucketed (4096 bytes, 7 buckets)
80,880 / 80,976 / 80,896 in 16 calls; bucketed with --grad-accum 2 exactly the same.
Summed over the ranks both modes send 242,752 bytes.

The sum is fixed: in one ring all-reduce of L elements rank r sends 2L − c_r − c_(r+1), and
summing over r gives 2NL − 2L = 2(N − 1)L, whatever the blocks. Per step the buffers hold the Ψ =
3792 gradients and the one-element loss, so the ranks send 2·2·(3792 + 1)·8 = 121,376 bytes per
step together, however the gradients are cut into buffers.

Per rank it is not fixed: a buffer whose length L is not a multiple of 3 has unequal blocks, and
with L mod 3 = 1 rank 1 sends one element more than ranks 0 and 2 (it owns a small block and so
does its right neighbour); with L mod 3 = 2 rank 0 sends one fewer. The naive mode all-reduces
each of the 17 parameters separately, so these one-element imbalances add up over more buffers
(rank 1 sends 256 bytes more than rank 0) than over the 7 buckets (96 bytes); the loss's
one-element all-reduce (blocks 1, 0, 0) always charges rank 1 two elements and ranks 0 and 2 one.

Gradient accumulation changes nothing, because the all-reduces run once per step, after the
last micro-batch. What buckets change is the number of calls, 17 + 1 against 7 + 1 per step,
and so the per-message latency, and when the all-reduces can start (overlapped with backward).
"""
