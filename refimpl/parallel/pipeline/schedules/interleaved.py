"""Interleaved 1F1B: each rank holds v model chunks (Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473, section 2.2.2).

The model is cut into v * p stages and stage s lives on rank s mod p, so chunk c of rank r is
stage c*p + r: a micro-batch visits every rank v times. Each rank still runs 1F1B, but over
m * v "virtual" micro-batches, which are taken in groups of p micro-batches: the forward order of
rank r is

    group 0: chunk 0 for micro-batches 0..p-1, chunk 1 for 0..p-1, ..., chunk v-1 for 0..p-1,
    group 1: the same for micro-batches p..2p-1, and so on,

and the backward order is the same with the chunks reversed (chunk v-1 first). With
k = virtual index: chunk(k) = (k mod pv) div p (forward) or v-1 minus that (backward), and
micro-batch(k) = (k div pv) * p + k mod p. This grouping is why m must be a multiple of p.

    warm-up     (p - r - 1) * 2 + (v - 1) * p forwards (capped at m * v); all m * v of them when
                m == p, as Megatron-LM does
    steady      one forward, one backward
    cool-down   the remaining backwards

Formulas (F, B = time of one chunk's forward / backward, i.e. 1/v of a 1F1B stage's):

    idle per rank    (p - 1)(F + B), which is (p - 1)(F_stage + B_stage) / v: 1F1B's bubble / v
    bubble fraction  (p - 1) / (v m + p - 1)
    cost             v times as many point-to-point messages as 1F1B
    activations      rank r holds at most 2(p - r - 1) + (v - 1) p + 1 chunk activations (all
                     v m when m == p); rank 0: (v + 1) p - 1, i.e. p + (p - 1)/v in units of a
                     1F1B stage: a little more than 1F1B's p

Megatron-LM later relaxed m % p == 0; this reference keeps the original rule.
"""

from __future__ import annotations

from ..actions import Action, Schedule, looped_placement, make_schedule
from .common import check_counts


def interleaved(pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    check_counts("interleaved", pp, micro_batches)
    v = 2 if chunks is None else chunks
    if not isinstance(v, int) or v < 2:
        raise ValueError(f"interleaved needs --chunks >= 2 model chunks per rank; got {chunks!r} (use 1f1b for one)")
    m = micro_batches
    if m % pp != 0:
        raise ValueError(
            f"interleaved needs --micro-batches to be a multiple of --pp {pp}; got {m} "
            f"(try {max(pp, m - m % pp)} or {m + pp - m % pp})"
        )
    total = m * v
    group = pp * v

    def virtual(k: int, forward: bool) -> tuple[int, int]:
        """(chunk, micro-batch) of the k-th forward (or backward) of a rank."""
        chunk = (k % group) // pp
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (k // group) * pp + k % pp

    ranks = []
    for r in range(pp):
        warmup = total if m == pp else min((pp - r - 1) * 2 + (v - 1) * pp, total)

        def forward(k: int) -> Action:
            chunk, mb = virtual(k, True)
            return Action("F", chunk * pp + r, mb)

        def backward(k: int) -> Action:
            chunk, mb = virtual(k, False)
            return Action("B", chunk * pp + r, mb)

        steps = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            steps += [forward(warmup + k), backward(k)]
        steps += [backward(k) for k in range(total - warmup, total)]
        ranks.append(steps)
    return make_schedule("interleaved", pp, m, looped_placement(pp, v), ranks, chunks=v)
