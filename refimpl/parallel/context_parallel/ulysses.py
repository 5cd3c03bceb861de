"""DeepSpeed-Ulysses: attention on whole sequences of a share of the heads (Jacobs et al. 2023,
arXiv 2309.14509).

Each of the C ranks holds a sequence shard (layout.py) of q (b, H, T/C, D) and k, v (b, Hkv, T/C, D).
Attention mixes tokens but never heads, so instead of moving keys around, move heads:

    1. all-to-all q, k, v: sequence shards -> head shards
           rank r sends to rank j the heads j·H/C … (j + 1)·H/C − 1 of its own tokens, and receives
           from every rank i its tokens of rank r's heads; the tokens are put in global order
           (b, H, T/C, D) -> (b, H/C, T, D)         and (b, Hkv, T/C, D) -> (b, Hkv/C, T, D)
    2. causal attention of whole sequences, H/C heads (blockwise.CausalAttention over 2C chunks)
    3. all-to-all the output back: head shards -> sequence shards (b, H/C, T, D) -> (b, H, T/C, D)

Backward runs the all-to-alls the other way: the output's gradient to head shards, then dq, dk,
dv back to sequence shards -- the same four all-to-alls of the same sizes.

Grouped-query attention: query head h uses key/value head ⌊h/G⌋ (G = H/Hkv), so rank r's query
heads r·H/C … need exactly the key/value heads r·Hkv/C …: both H and Hkv must divide by C.

Bytes per rank and layer (all-to-all sends all blocks but its own: (C − 1)/C of the buffer):
forward (C − 1)/C·b·(T/C)·D·(2H + 2Hkv)·itemsize (q, k, v there; y back), and the same in backward.
Constant in C when T grows with C; ring attention's grows with T (accounting.py).
"""

from __future__ import annotations

import numpy as np

from refimpl import backend
from refimpl.autograd.function import Function
from refimpl.parallel.context_parallel.blockwise import Work, causal_attention, check_heads
from refimpl.parallel.context_parallel.layout import check_layout, check_sequence, positions


def check_ulysses_shapes(q_shape, k_shape, C: int, layout: str = "balanced") -> None:
    """One-line ValueErrors for shards that Ulysses cannot take."""
    check_layout(layout)
    b, H, Tl, D = q_shape
    Hkv = k_shape[1]
    check_heads(H, Hkv)
    if H % C or Hkv % C:
        raise ValueError(f"Ulysses splits the heads over {C} ranks, but there are {H} query heads and {Hkv} "
                         f"key/value heads; use head counts divisible by {C}, or ring attention")
    check_sequence(Tl * C, C)


def _global_order(T: int, C: int, layout: str):
    """(T,) the global position of each token of rank 0's shard, then rank 1's, …"""
    return backend.asarray(np.concatenate([positions(T, C, r, layout) for r in range(C)]))


def sequence_to_heads(comm, x, layout: str):
    """(b, Hx, T/C, D) this rank's tokens of all heads -> (b, Hx/C, T, D) all tokens of its heads."""
    xp = backend.array_module(x)
    C = comm.size
    b, Hx, Tl, D = x.shape
    send = xp.ascontiguousarray(x.reshape(b, C, Hx // C, Tl, D).swapaxes(0, 1))  # (C, b, Hx/C, T/C, D): j's heads
    arrived = comm.alltoall(send)  # (C, b, Hx/C, T/C, D): block i = rank i's tokens of our heads
    out = xp.empty((b, Hx // C, C * Tl, D), dtype=x.dtype)
    out[:, :, _global_order(C * Tl, C, layout)] = arrived.transpose(1, 2, 0, 3, 4).reshape(b, Hx // C, C * Tl, D)
    return out


def heads_to_sequence(comm, y, layout: str):
    """(b, Hh, T, D) all tokens of this rank's heads -> (b, Hh·C, T/C, D) its tokens of all heads."""
    xp = backend.array_module(y)
    C = comm.size
    b, Hh, T, D = y.shape
    by_rank = y[:, :, _global_order(T, C, layout)].reshape(b, Hh, C, T // C, D)  # rank i's tokens at block i
    arrived = comm.alltoall(xp.ascontiguousarray(by_rank.transpose(2, 0, 1, 3, 4)))  # (C, b, Hh, T/C, D): j's heads
    return xp.ascontiguousarray(arrived.swapaxes(0, 1)).reshape(b, C * Hh, T // C, D)


class SequenceToHeads(Function):
    """The all-to-all before attention; its backward is the all-to-all after it, and vice versa."""

    def forward(self, x, comm, layout: str = "balanced"):
        self.comm, self.layout = comm, layout
        return sequence_to_heads(comm, x, layout)

    def backward(self, g, needs):
        return heads_to_sequence(self.comm, g, self.layout), None


class HeadsToSequence(Function):
    def forward(self, y, comm, layout: str = "balanced"):
        self.comm, self.layout = comm, layout
        return heads_to_sequence(comm, y, layout)

    def backward(self, g, needs):
        return sequence_to_heads(self.comm, g, self.layout), None


def ulysses_attention(q, k, v, comm, layout: str = "balanced", causal_skip: bool = True, work: Work | None = None):
    """Tensors q (b, H, T/C, D), k, v (b, Hkv, T/C, D): this rank's shard -> its output shard (b, H, T/C, D).

    The attention of step 2 runs over the sequence in 2C chunks, skipping the empty ones
    (causal_skip), so its score count compares with ring attention's."""
    check_ulysses_shapes(q.shape, k.shape, comm.size, layout)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} must have the same shape")
    qh, kh, vh = (SequenceToHeads.apply(x, comm, layout=layout) for x in (q, k, v))  # (b, ·/C, T, D)
    yh = causal_attention(qh, kh, vh, chunks=2 * comm.size, causal_skip=causal_skip, work=work)  # (b, H/C, T, D)
    return HeadsToSequence.apply(yh, comm, layout=layout)


__all__ = ["ulysses_attention", "check_ulysses_shapes", "sequence_to_heads", "heads_to_sequence",
           "SequenceToHeads", "HeadsToSequence"]
