"""ZB-H2: zero bubble in steady state, at the price of 2p - 1 micro-batches of activations
(Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 3.1,
handcrafted schedule ZB-H2).

Like ZB-H1, the backward is split into I (input gradient) and W (weight gradient). Two changes:

1. More warm-up forwards. Rank r starts at time r*F and its first gradient arrives after
   p*F + (p - 1 - r)*I; at F = I that leaves room for 2(p - 1 - r) + 1 forwards, so the start
   bubble of 1F1B is filled with forwards instead of waiting.
2. A parallelogram tail. Rank r defers 2r weight gradients, so it ends with 2r + 1 W's: rank 0
   finishes first and rank r finishes r*F later. In steady state (iterations back to back, the
   paper's optimizer post-validation replacing the global synchronisation) rank 0 starts the
   next iteration's forwards exactly when it is done, and they reach rank r exactly when rank r
   is done: the tail of one iteration interlocks with the start of the next.

Rank r:

    warm-up     w = min(2(p - 1 - r) + 1, m) forwards
    steady      for k = 0 .. m-1: I(k), then W(k - 2r) once k >= 2r, then the next F if any
    tail        the deferred W's

Formulas (F, I, W per stage, p = pp):

    steady-state idle per iteration   (p - 1)(F + I - 2W), clipped at 0; 0 at F = I = W
                                      (the paper's figure; simulated, see tests)
    single iteration                  at least (p - 1)F on every rank (the last rank cannot
                                      start earlier and every rank does the same work); at
                                      F = I = W it is exactly (p - 1)F
    activations                       2p - 1 micro-batches on every rank (freed at W)
"""

from __future__ import annotations

from ..actions import Action, Schedule, linear_placement, make_schedule
from .common import check_counts, fixed_chunks


def zbh2(pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    check_counts("zbh2", pp, micro_batches)
    fixed_chunks("zbh2", chunks, 1)
    m = micro_batches
    ranks = []
    for r in range(pp):
        warmup = min(2 * (pp - 1 - r) + 1, m)
        steps = [Action("F", r, k) for k in range(warmup)]
        next_f, next_w = warmup, 0
        for k in range(m):
            steps.append(Action("I", r, k))
            if k >= 2 * r:  # W(k - 2r): this rank keeps 2r weight gradients deferred
                steps.append(Action("W", r, next_w))
                next_w += 1
            if next_f < m:
                steps.append(Action("F", r, next_f))
                next_f += 1
        steps += [Action("W", r, j) for j in range(next_w, m)]
        ranks.append(steps)
    return make_schedule("zbh2", pp, m, linear_placement(pp), ranks)
