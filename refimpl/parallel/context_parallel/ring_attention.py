"""Ring attention: causal attention over a sequence split across C ranks (Liu, Zaharia & Abbeel 2023,
arXiv 2310.01889; Megatron-LM's context parallelism), with load-balanced chunks.

Each rank holds its shard of the sequence (layout.py: two chunks of c = T/(2C) tokens; balanced,
rank r holds chunks r and 2C − 1 − r) for its queries, keys and values. Its queries stay; the key/
value blocks travel around the ring, rank r sending to r + 1 and receiving from r − 1:

    forward, step t = 0 … C − 1   rank r holds the K/V block of rank s = (r − t) mod C
        1. post the next transfer (non-blocking): send the block it holds to r + 1, receive
           rank (r − t − 1)'s block from r − 1                      (not at the last step)
        2. compute its queries' attention against the block it holds (blockwise.py: per chunk
           pair full, diagonal or empty) and merge it into the running (m, l, o) by the online
           softmax, testing the requests between chunk pairs (MPI progresses a transfer only inside
           an MPI call)
        3. wait for the transfer
    then y = o / l and L = m + log l. Saved for backward: q, k, v, y and L -- nothing per block.

    backward, step t = 0 … C − 1  the K/V blocks travel again, and with each block (from step 1)
    the gradient dK/dV of that block accumulated so far: rank r recomputes its queries' scores
    against the block it holds, adds its dq, adds its contribution to the block's dK/dV and passes
    both on; at step C − 1 it holds the block of rank r + 1, whose dK/dV are then complete but for
    the owner's own, and sends them home. The owner's contribution (step 0) never travels.
    Messages: K/V C − 1 times, dK/dV C − 1 times: backward sends twice the forward's bytes.

Which blocks are computed (balanced; derived in accounting.py): against its own block a rank
computes two diagonal triangles and one full c×c block (its late chunk against its early one); against
an earlier rank's block (s < r) both query chunks against the block's first chunk, a 2c×c product;
against a later rank's block (s > r) its second chunk against the whole block, a c×2c product. So
every rank computes (2C + 1)·c² scores per (batch row, head): the same on every rank. Contiguous
blocks give rank r (4r + 3)·c².

The causal skip also saves bytes (causal_skip=True): a chunk of K/V is sent only when a rank further
along the ring still needs it, and a chunk of dK/dV only once it is non-zero (some rank on the way
has contributed). Both ends derive each message's contents from (layout, sender, step), so no sizes
are exchanged. accounting.py states the resulting bytes per rank; tests compare them with comm's
counters. Without the skip every chunk pair is computed (empty ones masked) and every block sent whole.

Shapes: q (b, H, T/C, D) with H query heads; k, v (b, Hkv, T/C, D) with Hkv key/value heads
(grouped-query attention: query head g·G + i uses key/value head g, G = H/Hkv; Hkv = H is
multi-head attention). Positions are global: the layout's. What is not modelled: attention
dropout (it needs per-block masks from global indices) and the transfers of several layers at once.
"""

from __future__ import annotations

import math

from refimpl import backend
from refimpl.autograd.function import Function
from refimpl.parallel import comm as comm_module
from refimpl.parallel.context_parallel.blockwise import (
    EMPTY,
    Work,
    backward_block,
    check_heads,
    finish,
    forward_block,
    grouped,
    merge,
    pair_kind,
)
from refimpl.parallel.context_parallel.layout import check_layout, check_sequence, rank_chunks

KV_TAG = 7201  # messages carrying K/V blocks
GRAD_TAG = 7202  # messages carrying dK/dV accumulations


def needs_key_chunk(C: int, rank: int, key_chunk: int, layout: str) -> bool:
    """Whether some query chunk of `rank` attends to global key chunk `key_chunk` (causally)."""
    return any(i >= key_chunk for i in rank_chunks(C, rank, layout))


def chunks_sent(C: int, sender: int, step: int, layout: str, causal_skip: bool, gradient: bool) -> list[int]:
    """Which of its two chunks (0, 1) the block that `sender` holds at `step` carries to sender + 1.

    K/V (gradient=False, steps 0 … C − 2): a chunk some rank further along the ring still needs.
    dK/dV (gradient=True, steps 1 … C − 1): a chunk some rank on the way so far has contributed to.
    Without the causal skip: both, always."""
    if not causal_skip:
        return [0, 1]
    owner = (sender - step) % C
    if gradient:
        path = [(owner + d) % C for d in range(1, step + 1)]  # the ranks that have held it: owner+1 … sender
    else:
        path = [(sender + d) % C for d in range(1, C - step)]  # those still to hold it: sender+1 … owner−1
    keys = rank_chunks(C, owner, layout)
    return [a for a in (0, 1) if any(needs_key_chunk(C, rank, keys[a], layout) for rank in path)]


def _pack(xp, parts, chosen):
    """(len(chosen), 2, b, Hkv, 1, c, D): the chosen chunks' two arrays each, one contiguous message."""
    return xp.ascontiguousarray(xp.stack([xp.stack(parts[a]) for a in chosen]))


class RingAttention(Function):
    """Causal attention of this rank's queries against every rank's keys and values, over `comm`.

    forward(q, k, v, comm) on every rank of comm, each with its shard (layout.py); returns this
    rank's output shard y (b, H, T/C, D). Options: layout ("balanced" or "contiguous"), causal_skip,
    work (a blockwise.Work that counts the score elements this rank computes).
    """

    def forward(self, q, k, v, comm, layout: str = "balanced", causal_skip: bool = True, work: Work | None = None):
        C, r = comm.size, comm.rank
        b, H, Tl, D = q.shape
        Hkv = k.shape[1]
        check_ring_shapes(q.shape, k.shape, v.shape, C, layout)
        self.comm, self.layout, self.causal_skip, self.work = comm, layout, causal_skip, work
        self.scale = 1.0 / math.sqrt(D)
        xp = backend.array_module(q)
        c = Tl // 2
        q5 = grouped(q, Hkv)  # (b, Hkv, G, T/C, D)
        mine = rank_chunks(C, r, layout)
        held = _own_block(k, v, Hkv, c)  # [(k, v) of chunk 0, of chunk 1], each (b, Hkv, 1, c, D)
        states = [None, None]  # per query chunk: the running (m, l, o)
        for t in range(C):
            source = (r - t) % C  # whose block `held` is
            requests, arriving = self._post_kv(xp, held, t, k.dtype, (b, Hkv, 1, c, D))
            keys = rank_chunks(C, source, layout)
            for a in (0, 1):
                for j in (0, 1):
                    kind = pair_kind(mine[a], keys[j])
                    if kind == EMPTY and causal_skip:
                        continue
                    qa = q5[..., a * c:(a + 1) * c, :]
                    states[a] = merge(states[a], forward_block(qa, *held[j], kind, self.scale, work))
                    comm_module.test_all(requests)  # let the transfer progress while we compute
            comm_module.wait_all(requests)
            held = arriving
        (y0, lse0), (y1, lse1) = finish(states[0]), finish(states[1])  # y = o / l, L = m + log l per chunk
        y5 = xp.concatenate([y0, y1], axis=-2)  # (b, Hkv, G, T/C, D)
        lse = xp.concatenate([lse0, lse1], axis=-1)  # (b, Hkv, G, T/C)
        y, lse = y5.reshape(b, H, Tl, D), lse.reshape(b, H, Tl)
        self.save_for_backward(q, k, v, y, lse)
        return y

    def _post_kv(self, xp, held, step, dtype, chunk_shape):
        """Post step `step`'s K/V transfer: (requests, the block that will have arrived after them)."""
        C, r = self.comm.size, self.comm.rank
        if step == C - 1:
            return [], None
        requests, arriving = [], [None, None]
        out = chunks_sent(C, r, step, self.layout, self.causal_skip, gradient=False)
        inbound = chunks_sent(C, (r - 1) % C, step, self.layout, self.causal_skip, gradient=False)
        if inbound:
            buffer = xp.empty((len(inbound), 2) + chunk_shape, dtype=dtype)
            requests.append(self.comm.irecv(buffer, (r - 1) % C, KV_TAG))
            for n, a in enumerate(inbound):
                arriving[a] = (buffer[n, 0], buffer[n, 1])
        if out:
            requests.append(self.comm.isend(_pack(xp, held, out), (r + 1) % C, KV_TAG))
        return requests, arriving

    def backward(self, dy, needs):
        q, k, v, y, lse = self.saved
        C, r, layout, skip = self.comm.size, self.comm.rank, self.layout, self.causal_skip
        b, H, Tl, D = q.shape
        Hkv, c = k.shape[1], Tl // 2
        xp = backend.array_module(q)
        delta = grouped((dy * y).sum(axis=-1)[..., None], Hkv)[..., 0]  # δ = rowsum(dy ⊙ y): (b, Hkv, G, T/C)
        q5, dy5, lse5 = grouped(q, Hkv), grouped(dy, Hkv), grouped(lse[..., None], Hkv)[..., 0]
        dq = xp.zeros(q5.shape, dtype=q.dtype)  # (b, Hkv, G, T/C, D)
        chunk_shape = (b, Hkv, 1, c, D)
        home = _zero_block(xp, chunk_shape, q.dtype)  # [[dK, dV] of chunk 0, of chunk 1]: our own block's
        mine = rank_chunks(C, r, layout)
        held = _own_block(k, v, Hkv, c)
        travelling = None  # the dK/dV of the block we hold, accumulated by the ranks it has visited
        for t in range(C):
            source = (r - t) % C
            gradient = home if t == 0 else travelling  # step 0: our own contribution never travels
            requests, arriving = self._post_kv(xp, held, t, k.dtype, chunk_shape)
            keys = rank_chunks(C, source, layout)
            for a in (0, 1):
                rows = slice(a * c, (a + 1) * c)
                for j in (0, 1):
                    kind = pair_kind(mine[a], keys[j])
                    if kind == EMPTY and skip:
                        continue
                    dq_b, dk_b, dv_b = backward_block(q5[..., rows, :], *held[j], dy5[..., rows, :],
                                                      lse5[..., rows], delta[..., rows], kind, self.scale, self.work)
                    dq[..., rows, :] += dq_b
                    gradient[j][0] += dk_b
                    gradient[j][1] += dv_b
                    comm_module.test_all(requests)
            incoming = _zero_block(xp, chunk_shape, q.dtype)  # what r − 1 passes on: zeros unless sent
            if t >= 1:  # pass the block's dK/dV on (at the last step: home to its owner, r + 1)
                out = chunks_sent(C, r, t, layout, skip, gradient=True)
                inbound = chunks_sent(C, (r - 1) % C, t, layout, skip, gradient=True)
                if inbound:
                    buffer = xp.empty((len(inbound), 2) + chunk_shape, dtype=q.dtype)
                    requests.append(self.comm.irecv(buffer, (r - 1) % C, GRAD_TAG))
                    for n, a in enumerate(inbound):
                        incoming[a] = [buffer[n, 0], buffer[n, 1]]
                if out:
                    requests.append(self.comm.isend(_pack(xp, gradient, out), (r + 1) % C, GRAD_TAG))
            comm_module.wait_all(requests)
            held = arriving
            if t == C - 1 and t >= 1:  # our own block's dK/dV, complete, home from rank r − 1
                for a in (0, 1):
                    home[a][0] += incoming[a][0]
                    home[a][1] += incoming[a][1]
            travelling = incoming  # the block we hold next: its dK/dV so far (zeros after step 0)
        dk = xp.concatenate([home[0][0], home[1][0]], axis=-2).reshape(k.shape)  # (b, Hkv, T/C, D)
        dv = xp.concatenate([home[0][1], home[1][1]], axis=-2).reshape(v.shape)
        return (dq.reshape(q.shape) if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                None)


def _own_block(k, v, Hkv, c):
    """This rank's K/V as two chunks [(k, v), (k, v)], each (b, Hkv, 1, c, D) (views)."""
    k5, v5 = grouped(k, Hkv), grouped(v, Hkv)
    return [(k5[..., a * c:(a + 1) * c, :], v5[..., a * c:(a + 1) * c, :]) for a in (0, 1)]


def _zero_block(xp, chunk_shape, dtype):
    """[[dK, dV] of chunk 0, [dK, dV] of chunk 1], zeros, each (b, Hkv, 1, c, D)."""
    return [[xp.zeros(chunk_shape, dtype), xp.zeros(chunk_shape, dtype)] for _ in (0, 1)]


def check_ring_shapes(q_shape, k_shape, v_shape, C: int, layout: str = "balanced") -> None:
    """One-line ValueErrors for shards that ring attention cannot take."""
    check_layout(layout)
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(f"ring attention takes q (b, heads, T/C, d_head) and k, v (b, kv_heads, T/C, d_head), "
                         f"not q {tuple(q_shape)} and k {tuple(k_shape)}")
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"keys {tuple(k_shape)} and values {tuple(v_shape)} must have the same shape")
    b, H, Tl, D = q_shape
    if (k_shape[0], k_shape[2], k_shape[3]) != (b, Tl, D):
        raise ValueError(f"queries {tuple(q_shape)} and keys {tuple(k_shape)} differ in batch, tokens or d_head")
    check_heads(H, k_shape[1])
    check_sequence(Tl * C, C)


def ring_attention(q, k, v, comm, layout: str = "balanced", causal_skip: bool = True, work: Work | None = None):
    """Tensors q (b, H, T/C, D), k, v (b, Hkv, T/C, D): this rank's shard -> its output shard (b, H, T/C, D)."""
    check_ring_shapes(q.shape, k.shape, v.shape, comm.size, layout)
    return RingAttention.apply(q, k, v, comm, layout=layout, causal_skip=causal_skip, work=work)


__all__ = ["RingAttention", "ring_attention", "chunks_sent", "needs_key_chunk", "check_ring_shapes",
           "KV_TAG", "GRAD_TAG"]
