"""Reference solutions to tutorial 14's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""

import numpy as np


def merge(a, b):
    # Rescale both partial results to the larger maximum. Where both maxima are −∞ (a row the mask
    # empties in both blocks) shift by 0 instead: both weights are then exp(−∞) = 0, not NaN.
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = np.maximum(m1, m2)
    shift = np.where(np.isfinite(m), m, 0.0)
    w1, w2 = np.exp(m1 - shift), np.exp(m2 - shift)
    return m, l1 * w1 + l2 * w2, o1 * w1[:, None] + o2 * w2[:, None]


def rank_chunks(C, r, layout):
    # Balanced: an early chunk and its mirror image from the end; contiguous: two neighbours.
    return (r, 2 * C - 1 - r) if layout == "balanced" else (2 * r, 2 * r + 1)


def causal_work(C, r, c, layout):
    # Over the whole ring, query chunk i meets every key chunk once and computes the non-empty
    # pairs: key chunks 0 … i, each a c×c block (the diagonal one computed whole, then masked).
    return sum((i + 1) * c * c for i in rank_chunks(C, r, layout))


def ring_bytes(C, b, kv_heads, T, d_head, itemsize):
    # Each of the C − 1 hops sends the block a rank holds: two chunks of c = T/(2C) tokens, keys
    # and values. Backward sends the blocks again and their gradients back: twice the forward.
    k = 2 * b * kv_heads * (T // (2 * C)) * d_head * itemsize  # one chunk's K and V
    forward = (C - 1) * 2 * k
    return forward, 2 * forward


def ring_bytes_skipped(C, r, b, kv_heads, T, d_head, itemsize):
    # Forward: every rank passes on both chunks of each block it holds at steps 0 … C − 2, except
    # one: rank 0's late chunk 2C − 1 is attended to by rank 0 alone, so rank 0 never sends it and
    # no rank that would have relayed it (ranks 0 … C − 2, which hold it at steps 0 … C − 2) does.
    # Backward: the K/V travel as in forward. Block s's early chunk s is attended to by every rank
    # r ≥ s, so its gradient is non-zero from its first hop and goes all C − 1 hops. Its late chunk
    # 2C − 1 − s gets gradient only from ranks r < s, reached after wrapping past rank C − 1, so
    # rank r sends late-chunk gradients at the steps t > r only: C − 1 − r of them.
    k = 2 * b * kv_heads * (T // (2 * C)) * d_head * itemsize
    kv_chunks = 2 * (C - 1) - (1 if r <= C - 2 else 0)
    gradient_chunks = (C - 1) + (C - 1 - r)
    return kv_chunks * k, (kv_chunks + gradient_chunks) * k


ANSWER = """
Model answer to the question (measure and explain).

(a) Per rank and attention call, forward, without the causal skip: the ring sends 2(C − 1) chunks of
k = 2·b·Hkv·c·D·i, that is 2(C − 1)·b·Hkv·(T/C)·D·i; Ulysses' four all-to-alls keep (1/C) of each buffer
home and send (C − 1)/C·b·(T/C)·D·(2H + 2Hkv)·i. The ratio ring / Ulysses is C·Hkv/(H + Hkv). Measured
(accounting.ring_bytes and ulysses_bytes, b = 1, T = 8192, D = 128, 2-byte numbers; forward, MB = 10⁶ B):
  H = Hkv = 32:      C = 2: 67.1 vs 67.1    C = 4: 100.7 vs 50.3   C = 8: 117.4 vs 29.4  (ratio C/2)
  H = 32, Hkv = 8:   C = 2: 16.8 vs 41.9    C = 4: 25.2 vs 31.5    C = 8: 29.4 vs 18.4   (ratio C/5)
With multi-head attention Ulysses sends less from C = 2 on (equal at 2 in forward; the ring's backward sends
twice its forward, Ulysses' backward the same as its forward, so per step Ulysses wins already at C = 2). With
grouped-query attention K and V are small and the ring carries only them: it sends less in forward for
C < H/Hkv + 1 (C < 5 here, C < 9 for H = 8·Hkv; per step, counting backward, C < 2(H + Hkv)/(3·Hkv)). The
ring's bytes per rank grow towards 2·b·Hkv·T·D·i as C grows with T fixed (every rank eventually sees every K
and V); Ulysses' shrink like 1/C, and stay constant when T and C grow together.
(b) Ulysses gives each rank whole heads: H/C query heads and Hkv/C key/value heads, so both must divide by C
(ulysses.py refuses otherwise), and C ≤ Hkv: with 8 key/value heads (Llama 3) at most 8-way, and fewer still
once tensor parallelism has already split the heads (H/t, Hkv/t per rank). For C = 16 one would use the ring,
or Ulysses inside a node (C₁ ≤ Hkv/t) times a ring across nodes, or replicate key/value heads (more bytes).
The ring has no such limit: only T divisible by 2C.
(c) Measured in part 4 (C = 4, c = 2, b·H = 4): balanced, every rank computes 144 score elements, 36 =
(2C + 1)·c² per (batch row, head); contiguous 48, 112, 176, 240, that is 12, 28, 44, 60 = (4r + 3)·c². Under
the causal mask query chunk i computes i + 1 chunk pairs over the whole ring (key chunks 0 … i); rank r holds
chunks r and 2C − 1 − r, so (r + 1) + (2C − r) = 2C + 1 whatever r is: an early chunk's short row and a late
chunk's long one always add up to the same. Contiguous, rank C − 1 holds the two last chunks and does
(4C − 1)·c², about twice the mean (2C + 1)·c²; every ring step waits for the slowest rank, so the attention
takes about twice as long as balanced (here the slowest over the mean is 60/36 = 1.67, and
(4C − 1)/(2C + 1) → 2 for large C).
(d) Bytes are not time. The ring posts the next block's transfer before computing the current block, so the
transfer is hidden when a block's compute outlasts it. Against another rank's block a rank computes two c×c chunk
pairs per (batch row, head), q kᵀ and p·v: 8·b·H·c²·D flops, while the block is 2k = 4·b·Hkv·c·D·i bytes. Compute
grows with c², bytes with c: hidden once c ≥ Hkv·i·F/(2·H·β) for F flop/s and β bytes/s, e.g. about 2,200 tokens
per chunk with H = Hkv, 2-byte numbers, F = 10¹⁵ and β = 450 GB/s. Ulysses' all-to-alls sit between the
projections and the attention, on the critical path, and involve every rank of the group at once. So the ring
suits long sequences, slow links and grouped-query attention; Ulysses many heads and fast all-to-all inside a node.
"""
