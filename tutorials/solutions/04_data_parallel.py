"""Reference solutions to tutorial 04's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""

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
