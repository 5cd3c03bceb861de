"""Context parallelism's accounting: score elements, bytes sent and saved bytes per rank, as formulas.

The formulas that comm's counters, the saved-tensor ledger (autograd/saved.py) and blockwise.Work
must match exactly (tests/test_context_parallel*.py), for one attention call (one layer, one
micro-batch) on rank r of C. Shapes: b sequences, H query heads, Hkv key/value heads (grouped-query
attention; Hkv = H without it), T tokens, D = d_head, itemsize i; the sequence is cut into 2C chunks
of c = T/(2C) tokens (layout.py).

Score elements (entries of q kᵀ evaluated; backward recomputes exactly as many again), per forward:

                                  computed                 kept by the causal mask
    ring, balanced, causal skip   b·H·(2C + 1)·c²          b·H·(2C·c² + c)           every rank alike
    ring, contiguous, skip        b·H·(4r + 3)·c²          b·H·((4r + 2)·c² + c)     rank C − 1: ≈ 2× the mean
    ring, no skip                 b·H·4C·c² = b·H·T²/C     as above
    Ulysses (2C chunks), skip     b·H·(2C + 1)·c²          b·H·(2C·c² + c)           (H/C heads, whole T)
    Ulysses, no skip              b·H·4C·c²                as above

Derivation (balanced). Rank r holds chunks (r, 2C − 1 − r). Against its own block: both diagonal
triangles (c² computed each) and its late chunk against its early one (full): 3c². Against rank
s < r's block (s, 2C − 1 − s): chunk s precedes both of r's chunks (full), chunk 2C − 1 − s follows
both (empty): 2·c². Against s > r: r's chunk r precedes both of s's (empty) and 2C − 1 − r follows
both (full): 2·c². Total 3c² + (C − 1)·2c² = (2C + 1)·c². Kept: each triangle keeps c(c + 1)/2.
Contiguous (chunks 2r, 2r + 1): r earlier blocks of 4c², its own 3c², later ones empty.
Summed over ranks, the kept elements are b·H·T(T + 1)/2 in every row of the table: the causal mask.

Bytes sent per rank (ring: comm's "send" kind, one message per transfer; Ulysses: "alltoall").
A chunk's K and V (or dK and dV) are k = 2·b·Hkv·c·D·i bytes; [x] is 1 when x holds, else 0:

                                forward (K/V)                backward: K/V again   + dK/dV
    ring, no skip               2(C − 1)·k                   2(C − 1)·k            2(C − 1)·k
    ring, balanced, skip        (2(C − 1) − [r ≤ C − 2])·k   as forward            (2C − 2 − r)·k
    ring, contiguous, skip      2(r + 1)·[r ≤ C − 2]·k       as forward            2(C − 1 − [r ≤ C − 2])·k
    Ulysses                     (C − 1)/C · b·(T/C)·D·(2H + 2Hkv)·i                the same

Why the skip saves those bytes (ring_attention.chunks_sent): a K/V chunk travels on only while a
rank further along still attends to it, a dK/dV chunk only once a rank has contributed to it.
Balanced: rank 0's late chunk 2C − 1 is attended to by rank 0 alone, so it never leaves (one chunk
fewer on every rank that would have passed it on: r ≤ C − 2); block s's late chunk 2C − 1 − s gets
gradient only from ranks r < s, which the ring reaches after wrapping past rank C − 1 -- before
that its dK/dV are zeros and stay home: rank r sends it at the C − 1 − r steps t > r. Contiguous:
block s is attended to by ranks s … C − 1 only, so it stops at rank C − 1; its gradient then goes
round the rest of the ring to its owner, except block C − 1's, which no other rank touches.

Saved for backward per rank (both implementations; the ledger's bytes): q and y (b·H·(T/C)·D each),
k and v (b·Hkv·(T/C)·D each) and the log-sum-exp (b·H·(T/C)):

    saved = (2·b·H + 2·b·Hkv)·(T/C)·D·i + b·H·(T/C)·i

(Ulysses saves the same numbers of elements, as H/C heads of whole sequences.) No block's
probabilities are kept: the b·H·T²-sized term of plain attention is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from refimpl.parallel.context_parallel.layout import check_layout, check_sequence


@dataclass(frozen=True)
class AttentionShape:
    """One attention call, context-parallel over C ranks."""

    batch: int  # b
    heads: int  # H
    kv_heads: int  # Hkv
    seq_len: int  # T, the whole sequence
    d_head: int  # D
    ranks: int  # C
    itemsize: int = 8

    @property
    def chunk(self) -> int:
        """c = T / (2C)."""
        check_sequence(self.seq_len, self.ranks)
        return self.seq_len // (2 * self.ranks)

    @property
    def chunk_kv_bytes(self) -> int:
        """k: one chunk's keys and values (or their gradients), 2·b·Hkv·c·D·i."""
        return 2 * self.batch * self.kv_heads * self.chunk * self.d_head * self.itemsize


def score_elements(shape: AttentionShape, rank: int, impl: str = "ring", layout: str = "balanced",
                   causal_skip: bool = True) -> dict:
    """{"computed", "unmasked"}: score elements one forward evaluates and the mask keeps (per rank)."""
    check_layout(layout)
    C, c, bH = shape.ranks, shape.chunk, shape.batch * shape.heads
    if impl == "ulysses" or layout == "balanced":
        computed, unmasked = (2 * C + 1) * c * c, 2 * C * c * c + c
    else:
        computed, unmasked = (4 * rank + 3) * c * c, (4 * rank + 2) * c * c + c
    if not causal_skip:
        computed = 4 * C * c * c
    return {"computed": bH * computed, "unmasked": bH * unmasked}


def ring_bytes(shape: AttentionShape, rank: int, layout: str = "balanced", causal_skip: bool = True) -> dict:
    """{"forward", "backward"}: bytes rank r sends (comm's "send" kind) in one ring attention call."""
    check_layout(layout)
    C, r, k = shape.ranks, rank, shape.chunk_kv_bytes
    passes = int(r <= C - 2)  # 1 on a rank that passes blocks on to another rank before the ring ends
    if not causal_skip:
        kv, grad = 2 * (C - 1), 2 * (C - 1)
    elif layout == "balanced":
        kv, grad = 2 * (C - 1) - passes, 2 * C - 2 - r if C > 1 else 0
    else:
        kv, grad = 2 * (r + 1) * passes, 2 * (C - 1 - passes)
    return {"forward": kv * k, "backward": (kv + grad) * k}


def ulysses_bytes(shape: AttentionShape) -> dict:
    """{"forward", "backward"}: bytes each rank sends (comm's "alltoall" kind) in one Ulysses call."""
    C = shape.ranks
    tokens = shape.seq_len // C
    buffers = shape.batch * tokens * shape.d_head * (2 * shape.heads + 2 * shape.kv_heads)  # q, k, v, y
    each = buffers * (C - 1) // C * shape.itemsize
    return {"forward": each, "backward": each}


def saved_bytes(shape: AttentionShape) -> int:
    """Bytes one rank saves for backward (the saved-tensor ledger), ring or Ulysses."""
    tokens = shape.seq_len // shape.ranks
    b, H, Hkv, D = shape.batch, shape.heads, shape.kv_heads, shape.d_head
    return ((2 * b * H + 2 * b * Hkv) * tokens * D + b * H * tokens) * shape.itemsize


__all__ = ["AttentionShape", "score_elements", "ring_bytes", "ulysses_bytes", "saved_bytes"]
