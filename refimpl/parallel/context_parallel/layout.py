"""Which tokens of a sequence each context-parallel rank holds: 2C chunks, and their inverse.

A sequence of T tokens is cut into 2C chunks of c = T/(2C) tokens each (chunk k holds the global
positions [k·c, (k+1)·c)). Each of the C ranks holds two chunks, in this order:

    balanced     rank r holds chunks r and 2C − 1 − r     (Megatron-LM's context parallelism;
                                                            Llama 3, Dubey et al. 2024, §3.3.2)
    contiguous   rank r holds chunks 2r and 2r + 1        (the sequence cut into C blocks)

Why balanced: under a causal mask, query chunk i attends to key chunks 0 … i, so early chunks do
little work and late ones much. Pairing chunk r (early) with chunk 2C − 1 − r (late) gives every
rank (r + 1) + (2C − r) = 2C + 1 chunk-rows of work; the contiguous split gives rank r
(2r + 1) + (2r + 2) = 4r + 3, the last rank about twice the average (accounting.py states the exact
score counts).

A rank's shard of a tensor is its two chunks, concatenated along the sequence axis: (…, T/C, …).
`shard(x, C, r)` cuts one global array into rank r's shard, `unshard([x_0, …, x_{C−1}])` puts every
rank's shard back into the global order, so a test can build each rank's input from one global batch
and compare each rank's output with single-process attention.
"""

from __future__ import annotations

import numpy as np

from refimpl import backend

LAYOUTS = ("balanced", "contiguous")


def check_sequence(T: int, C: int) -> None:
    """One-line ValueError unless T tokens can be cut into 2C equal chunks."""
    if not (isinstance(C, (int, np.integer)) and C >= 1):
        raise ValueError(f"context parallelism needs a positive number of ranks, not {C!r}")
    if T % (2 * C):
        raise ValueError(f"a sequence of {T} tokens cannot be cut into 2·{C} = {2 * C} equal chunks for context "
                         f"parallelism over {C} ranks; use a sequence length divisible by {2 * C}")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


def rank_chunks(C: int, r: int, layout: str = "balanced") -> tuple[int, int]:
    """The two global chunk indices rank r holds, in the order its shard holds them."""
    check_layout(layout)
    return (r, 2 * C - 1 - r) if layout == "balanced" else (2 * r, 2 * r + 1)


def positions(T: int, C: int, r: int, layout: str = "balanced") -> np.ndarray:
    """(T/C,) the global positions of rank r's tokens, in the order its shard holds them."""
    check_sequence(T, C)
    c = T // (2 * C)
    return np.concatenate([np.arange(k * c, (k + 1) * c) for k in rank_chunks(C, r, layout)])


def shard(x, C: int, r: int, axis: int = -2, layout: str = "balanced"):
    """Rank r's shard of the global array x: its tokens along `axis` (a copy, contiguous, in x's memory)."""
    xp = backend.array_module(x)
    index = xp.asarray(positions(x.shape[axis], C, r, layout))  # the positions are host bookkeeping
    return xp.ascontiguousarray(xp.take(x, index, axis=axis))


def unshard(shards, axis: int = -2, layout: str = "balanced"):
    """The global array from every rank's shard (shards[r] is rank r's), tokens in global order."""
    xp = backend.array_module(shards[0])
    C = len(shards)
    T = shards[0].shape[axis] * C
    whole = xp.concatenate(shards, axis=axis)  # rank 0's tokens, then rank 1's, …
    order = np.concatenate([positions(T, C, r, layout) for r in range(C)])  # (T,) global position of each
    return xp.take(whole, xp.asarray(np.argsort(order)), axis=axis)


__all__ = ["LAYOUTS", "check_sequence", "check_layout", "rank_chunks", "positions", "shard", "unshard"]
