"""Causal attention one block of scores at a time: the online softmax, forward and backward.

Attention of a row of queries against all keys, y = softmax(s) v with s = q kᵀ/√D, does not need
the whole row of scores at once. Split the keys into blocks; for each block b keep, per query row,

    m_b = max_j s_j          l_b = Σ_j exp(s_j − m_b)          o_b = Σ_j exp(s_j − m_b) v_j

and merge two partial results (the online softmax: Milakov & Gimelshein 2018; FlashAttention,
Dao et al. 2022, arXiv 2205.14135, §3.1) by rescaling both to the larger maximum:

    m = max(m₁, m₂)    l = l₁·e^{m₁−m} + l₂·e^{m₂−m}    o = o₁·e^{m₁−m} + o₂·e^{m₂−m}

After the last block y = o / l, and the row's log-sum-exp L = m + log l is all backward needs of
the softmax: p_j = exp(s_j − L). Merging is exact in real arithmetic whatever the order of blocks.

Backward (FlashAttention's Algorithm 4, without the tiling of queries): with dy the output's
gradient and δ = rowsum(dy ⊙ y), each block recomputes its scores and probabilities from q, k and
L -- no block's probabilities are kept from forward -- and adds

    dv_j += Σ_rows p·dy        ds = p ⊙ (dy vᵀ − δ)        dq += ds k / √D        dk += dsᵀ q / √D

Causal mask at the granularity of chunks (layout.py): query chunk i against key chunk j is

    full       j < i   every score of the c×c block is used
    diagonal   j = i   the lower triangle with its diagonal: c(c + 1)/2 used, all c² computed
    empty      j > i   nothing used: skipped (with causal_skip; computed and masked without)

Grouped-query attention (Ainslie et al. 2023): H query heads share Hkv key/value heads, G = H/Hkv
each, query head g·G + i using key/value head g. Queries are viewed as (b, Hkv, G, c, D) and keys
and values as (b, Hkv, 1, c, D), so the products broadcast over the group axis without copying K
and V G times; backward sums the group's gradients into the shared head (multi-head: G = 1).

`Work` counts the score elements computed (entries of q kᵀ evaluated), forward and in backward's
recomputation, and the elements the mask keeps; accounting.py states them as formulas.
`CausalAttention` is one process's attention over a whole sequence cut into n chunks, built from
the same pieces (Ulysses runs it on whole sequences of its heads); ring_attention.py runs the
pieces over a ring of ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from refimpl import backend
from refimpl.autograd.function import Function

FULL, DIAGONAL, EMPTY = "full", "diagonal", "empty"


@dataclass
class Work:
    """Score elements (entries of q kᵀ) one rank evaluated, and how many the causal mask keeps."""

    forward_scores: int = 0  # computed in forward
    backward_scores: int = 0  # recomputed in backward
    unmasked_scores: int = 0  # of the forward's, those the causal mask keeps


def pair_kind(query_chunk: int, key_chunk: int) -> str:
    """What the causal mask leaves of query chunk i against key chunk j (global chunk indices)."""
    if key_chunk < query_chunk:
        return FULL
    return DIAGONAL if key_chunk == query_chunk else EMPTY


def check_heads(n_head: int, kv_heads: int) -> int:
    """G = n_head / kv_heads, or a one-line ValueError."""
    if kv_heads < 1 or n_head % kv_heads:
        raise ValueError(f"{n_head} query heads cannot share {kv_heads} key/value heads equally; "
                         "use a number of key/value heads that divides the number of query heads")
    return n_head // kv_heads


def _scores(q, k, kind: str, scale: float):
    """s = q kᵀ · scale with the causal mask of the pair: (b, Hkv, G, c, c)."""
    xp = backend.array_module(q)
    s = q @ k.swapaxes(-1, -2)  # (b, Hkv, G, c, D) @ (b, Hkv, 1, D, c) -> (b, Hkv, G, c, c)
    s *= s.dtype.type(scale)
    if kind == DIAGONAL:
        c = s.shape[-1]
        xp.copyto(s, s.dtype.type(-xp.inf), where=xp.triu(xp.ones((c, c), dtype=bool), k=1))
    elif kind == EMPTY:
        s.fill(-xp.inf)
    return s


def _count(work: Work | None, s, kind: str, backward: bool = False) -> None:
    if work is None:
        return
    if backward:
        work.backward_scores += s.size
        return
    work.forward_scores += s.size
    c = s.shape[-1]
    per_block = {FULL: c * c, DIAGONAL: c * (c + 1) // 2, EMPTY: 0}[kind]
    work.unmasked_scores += s.size // (c * c) * per_block


def forward_block(q, k, v, kind: str, scale: float, work: Work | None = None):
    """One block's partial result (m, l, o): (b, Hkv, G, c), (b, Hkv, G, c), (b, Hkv, G, c, D).

    A row the mask empties has m = −∞, l = 0, o = 0 (it merges as nothing)."""
    xp = backend.array_module(q)
    s = _scores(q, k, kind, scale)
    _count(work, s, kind)
    m = s.max(axis=-1)  # (b, Hkv, G, c)
    shift = xp.where(xp.isfinite(m), m, 0)  # a fully masked row: exp(−∞ − 0) = 0, not NaN
    s -= shift[..., None]
    p = xp.exp(s, out=s)  # (b, Hkv, G, c, c) unnormalised probabilities of this block only
    return m, p.sum(axis=-1), p @ v  # o_b: (b, Hkv, G, c, c) @ (b, Hkv, 1, c, D) -> (b, Hkv, G, c, D)


def merge(state, partial):
    """The online softmax: two partial results (m, l, o) of the same rows -> their merged result."""
    if state is None:
        return partial
    xp = backend.array_module(partial[0])
    (m1, l1, o1), (m2, l2, o2) = state, partial
    m = xp.maximum(m1, m2)
    top = xp.where(xp.isfinite(m), m, 0)  # both −∞: both weights are then exp(−∞) = 0
    w1, w2 = xp.exp(m1 - top), xp.exp(m2 - top)  # e^{m₁−m}, e^{m₂−m}
    return m, l1 * w1 + l2 * w2, o1 * w1[..., None] + o2 * w2[..., None]


def finish(state):
    """(y, L): the output o / l (b, Hkv, G, c, D) and the log-sum-exp m + log l (b, Hkv, G, c)."""
    xp = backend.array_module(state[0])
    m, l, o = state
    return o / l[..., None], m + xp.log(l)


def backward_block(q, k, v, dy, lse, delta, kind: str, scale: float, work: Work | None = None):
    """One block's gradient contributions (dq, dk, dv): (b, Hkv, G, c, D), (b, Hkv, 1, c, D) twice.

    Recomputes the block's probabilities p = exp(s − L) from the saved log-sum-exp L."""
    xp = backend.array_module(q)
    s = _scores(q, k, kind, scale)
    _count(work, s, kind, backward=True)
    s -= lse[..., None]
    p = xp.exp(s, out=s)  # (b, Hkv, G, c, c); masked entries exp(−∞) = 0
    dv = (p.swapaxes(-1, -2) @ dy).sum(axis=2, keepdims=True)  # (b, Hkv, 1, c, D): the group's sum
    ds = dy @ v.swapaxes(-1, -2)  # dp (b, Hkv, G, c, c)
    ds -= delta[..., None]
    ds *= p
    ds *= ds.dtype.type(scale)
    dq = ds @ k  # (b, Hkv, G, c, D)
    dk = (ds.swapaxes(-1, -2) @ q).sum(axis=2, keepdims=True)  # (b, Hkv, 1, c, D)
    return dq, dk, dv


def grouped(x, kv_heads: int):
    """(b, H, T, D) -> the view (b, Hkv, G, T, D); key/value heads (b, Hkv, T, D) -> (b, Hkv, 1, T, D)."""
    b, H, T, D = x.shape
    return x.reshape(b, kv_heads, H // kv_heads, T, D)


class CausalAttention(Function):
    """Causal attention over a whole sequence on one process, n chunks at a time.

    q (b, H, T, D), k and v (b, Hkv, T, D) -> y (b, H, T, D). Saves q, k, v, y and the log-sum-exp
    L (b, H, T) -- never a block's probabilities. With causal_skip the n(n − 1)/2 empty chunk pairs
    are not computed: n(n + 1)/2 of the n² blocks of (T/n)² scores per head.
    """

    def forward(self, q, k, v, chunks: int = 1, causal_skip: bool = True, work: Work | None = None):
        b, H, T, D = q.shape
        Hkv = k.shape[1]
        check_heads(H, Hkv)
        if T % chunks:
            raise ValueError(f"a sequence of {T} tokens cannot be cut into {chunks} equal chunks")
        self.chunks, self.causal_skip, self.work, self.scale = chunks, causal_skip, work, 1.0 / math.sqrt(D)
        c = T // chunks
        q5, k5, v5 = grouped(q, Hkv), grouped(k, Hkv), grouped(v, Hkv)
        xp = backend.array_module(q)
        y5 = xp.empty(q5.shape, dtype=q.dtype)  # (b, Hkv, G, T, D)
        lse = xp.empty(q5.shape[:-1], dtype=q.dtype)  # (b, Hkv, G, T)
        for i in range(chunks):
            rows = slice(i * c, (i + 1) * c)
            state = None
            for j in range(chunks):
                kind = pair_kind(i, j)
                if kind == EMPTY and causal_skip:
                    continue
                cols = slice(j * c, (j + 1) * c)
                state = merge(state, forward_block(q5[..., rows, :], k5[..., cols, :], v5[..., cols, :],
                                                   kind, self.scale, work))
            y5[..., rows, :], lse[..., rows] = finish(state)
        y, lse = y5.reshape(b, H, T, D), lse.reshape(b, H, T)
        self.save_for_backward(q, k, v, y, lse)
        return y

    def backward(self, dy, needs):
        q, k, v, y, lse = self.saved
        Hkv, c = k.shape[1], q.shape[2] // self.chunks
        xp = backend.array_module(q)
        delta = grouped((dy * y).sum(axis=-1)[..., None], Hkv)[..., 0]  # δ = rowsum(dy ⊙ y): (b, Hkv, G, T)
        q5, k5, v5, dy5, lse5 = grouped(q, Hkv), grouped(k, Hkv), grouped(v, Hkv), grouped(dy, Hkv), \
            grouped(lse[..., None], Hkv)[..., 0]
        dq, dk, dv = xp.zeros(q5.shape, q.dtype), xp.zeros(k5.shape, q.dtype), xp.zeros(v5.shape, q.dtype)
        for i in range(self.chunks):
            rows = slice(i * c, (i + 1) * c)
            for j in range(self.chunks):
                kind = pair_kind(i, j)
                if kind == EMPTY and self.causal_skip:
                    continue
                cols = slice(j * c, (j + 1) * c)
                dq_b, dk_b, dv_b = backward_block(q5[..., rows, :], k5[..., cols, :], v5[..., cols, :],
                                                  dy5[..., rows, :], lse5[..., rows], delta[..., rows],
                                                  kind, self.scale, self.work)
                dq[..., rows, :] += dq_b
                dk[..., cols, :] += dk_b
                dv[..., cols, :] += dv_b
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


def causal_attention(q, k, v, chunks: int = 1, causal_skip: bool = True, work: Work | None = None):
    """Tensors q (b, H, T, D), k, v (b, Hkv, T, D) -> y (b, H, T, D), one process, blockwise."""
    return CausalAttention.apply(q, k, v, chunks=chunks, causal_skip=causal_skip, work=work)


__all__ = ["Work", "pair_kind", "check_heads", "forward_block", "merge", "finish", "backward_block", "grouped",
           "CausalAttention", "causal_attention", "FULL", "DIAGONAL", "EMPTY"]
