"""Flat buffers: parameters laid end to end, padded so that N ranks own equal shards.

ZeRO partitions *flat* buffers, not individual tensors (Rajbhandari et al., arXiv 1910.02054,
section 5; DeepSpeed flattens each parameter group the same way). A FlatGroup takes a list of
parameters and lays them out one after the other in a buffer of

    L = numel rounded up to a multiple of N          (numel = Σ parameter sizes; ≤ N − 1 padding)

elements. Rank r owns the block [r·L/N, (r+1)·L/N) -- its *shard* -- of that buffer and of every
buffer with the same layout (gradients, fp32 master weights, optimizer states). The padded tail is
zero and stays zero: its gradients are zero, so Adam and SGD never move it. Because every shard
has the same length, reduce-scatter and all-gather need no counts (comm.py's counts are for
lengths not divisible by N) and every rank sends exactly L(N−1)/N elements per collective.

    group = FlatGroup(0, [("w", w), ("b", b)], shards=4, rank=1)
    flat = group.flatten([w.data, b.data])      # (L,) with zero padding
    views = group.views(flat)                   # [view of w's shape, view of b's shape]
    flat[group.start:group.stop]                # (L/N,) rank 1's shard

A group is also the unit of communication: ZeRO-1/2 group parameters into buckets of about
`bucket_bytes` (in backward order, like DDP), ZeRO-3 into one group per module (the parameters
gathered together before that module runs). `pieces` maps a shard back to parameter names, which
is what sharded checkpoints store, so they can be loaded into any other layout.

Legend: L a group's padded length, N shards (ranks), L/N one rank's block.
"""

from __future__ import annotations

import numpy as np

from refimpl import backend
from refimpl.parallel.data_parallel import assign_buckets


def padded_length(numel: int, shards: int) -> int:
    """numel rounded up to a multiple of shards (at least `shards`, so no shard is empty)."""
    return max(1, -(-numel // shards)) * shards


class FlatGroup:
    """A list of named parameters flattened into one padded buffer, split into `shards` blocks."""

    def __init__(self, index: int, named_params: list, shards: int, rank: int) -> None:
        if not named_params:
            raise ValueError("a flat group needs at least one parameter")
        self.index = index
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(int).tolist()
        self.dtype = self.params[0].dtype
        if any(p.dtype != self.dtype for p in self.params):
            raise ValueError(f"flat group {index}: parameters of different dtypes cannot share a buffer")
        # Gradients are accumulated and reduced in float32 under bfloat16 storage (MPI has no bfloat16;
        # optim/precision.py); in the parameters' dtype otherwise.
        self.grad_dtype = np.dtype("float32") if self.dtype.name == "bfloat16" else self.dtype
        self.shards, self.rank = shards, rank
        self.numel = sum(self.sizes)
        self.length = padded_length(self.numel, shards)  # L
        self.block = self.length // shards  # L / N, this rank's shard length
        self.start, self.stop = rank * self.block, (rank + 1) * self.block
        self.padding = self.length - self.numel

    def __repr__(self) -> str:
        return (f"FlatGroup({self.index}, {len(self.params)} params, numel={self.numel}, L={self.length}, "
                f"N={self.shards})")

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (gathered) buffer in the parameters' dtype."""
        return self.length * self.dtype.itemsize

    def empty(self, dtype=None, whole: bool = True):
        """A new zero buffer: the whole (L,) or one shard (L/N,)."""
        return backend.xp().zeros(self.length if whole else self.block, dtype=dtype or self.dtype)

    def views(self, flat) -> list:
        """Views of each parameter's shape into the whole buffer flat (L,)."""
        return [flat[o:o + n].reshape(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def flatten(self, arrays, dtype=None):
        """A new whole buffer (L,) holding `arrays` (one per parameter, any float dtype), zero-padded."""
        flat = self.empty(dtype)
        for view, array in zip(self.views(flat), arrays):
            view[...] = backend.asarray(array).reshape(view.shape)  # whole or flattened parameters
        return flat

    def pieces(self, lo: int | None = None, hi: int | None = None) -> list[tuple[str, int, int, int]]:
        """(name, start, stop, position) for every parameter overlapping [lo, hi) of the buffer.

        start:stop is the range in the flattened parameter, position where it begins in [lo, hi);
        the default range is this rank's shard. Padding belongs to no parameter.
        """
        lo = self.start if lo is None else lo
        hi = self.stop if hi is None else hi
        found = []
        for name, offset, size in zip(self.names, self.offsets, self.sizes):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                found.append((name, a - offset, b - offset, a - lo))
        return found


def bucket_groups(named_params: list, bucket_bytes: int, shards: int, rank: int, first_index: int = 0) -> list:
    """Flat groups of about bucket_bytes, in the order backward produces gradients (reversed).

    A parameter larger than bucket_bytes gets a group of its own, as in DDP's buckets.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"--bucket-bytes must be positive, got {bucket_bytes}")
    buckets = assign_buckets([p.data.nbytes for _, p in named_params], bucket_bytes)
    return [FlatGroup(first_index + i, [named_params[j] for j in bucket], shards, rank)
            for i, bucket in enumerate(buckets)]


def module_units(model, threshold: int = 0, only: set | None = None) -> tuple[list, list]:
    """ZeRO-3's gather units and the parameters kept whole.

    A unit is a module that owns parameters directly (Linear, LayerNorm, Embedding, ...), with
    those of its parameters that have at least `threshold` elements; parameters with fewer stay
    whole on every rank ("persistent", DeepSpeed's stage3_param_persistence_threshold).
    only: the ids of the parameters to consider (a pipeline stage's), default all.
    Returns ([(module_name, module, [(name, param)])], [(name, param) kept whole]).
    """
    if threshold < 0:
        raise ValueError(f"--param-threshold must be >= 0, got {threshold}")
    units, persistent, seen = [], [], set()
    for module_name, module in model.named_modules():
        own = []
        for pname, p in module._parameters.items():
            if p is None or id(p) in seen or (only is not None and id(p) not in only):
                continue
            seen.add(id(p))
            name = f"{module_name}.{pname}" if module_name else pname
            (persistent if p.size < threshold else own).append((name, p))
        if own:
            units.append((module_name, module, own))
    return units, persistent
