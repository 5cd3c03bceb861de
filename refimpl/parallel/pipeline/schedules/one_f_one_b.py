"""1F1B (PipeDream-flush): one forward, one backward (Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473, section 2.2.1;
PipeDream-2BW/flush, arXiv 2006.09503).

Rank r holds stage r of a pp-stage model and runs three phases:

    warm-up     w = min(p - r - 1, m) forwards F(r, 0..w-1)
    steady      for k = 0 .. m-w-1:  F(r, w + k), B(r, k)
    cool-down   the remaining backwards B(r, m-w .. m-1)

Compared with GPipe the work and the makespan are the same, but a backward starts as soon as
possible, so rank r never holds more than p - r micro-batches' activations.

Formulas (F, B per stage, p = pp, m micro-batches):

    idle per rank    (p - 1)(F + B)          exact for any F, B, m with zero latency
    bubble fraction  (p - 1) / (m + p - 1)
    activations      p - r micro-batches on rank r (p on rank 0), independent of m
"""

from __future__ import annotations

from ..actions import Action, Schedule, linear_placement, make_schedule
from .common import check_counts, fixed_chunks


def one_f_one_b(pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    check_counts("1f1b", pp, micro_batches)
    fixed_chunks("1f1b", chunks, 1)
    m = micro_batches
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        steps = [Action("F", r, k) for k in range(warmup)]
        for k in range(m - warmup):
            steps += [Action("F", r, warmup + k), Action("B", r, k)]
        steps += [Action("B", r, k) for k in range(m - warmup, m)]
        ranks.append(steps)
    return make_schedule("1f1b", pp, m, linear_placement(pp), ranks)
