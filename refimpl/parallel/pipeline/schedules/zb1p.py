"""ZB-H1 ("ZB1P"): 1F1B with the backward split in two, weight gradients delayed to fill the
bubble (Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 3.1,
handcrafted schedule ZB-H1).

The backward of a stage is split into I (gradient with respect to the stage's input, which the
previous stage is waiting for) and W (gradient with respect to the stage's weights, which nobody
waits for). Rank r holds stage r of a pp-stage model and runs:

    warm-up     w = min(p - r - 1, m) forwards, as in 1F1B
    steady      for k = 0 .. m-w-1:  F(w + k), I(k), then W(k - r) once k >= r
    cool-down   for k = m-w .. m-1:  I(k), then W(k - r) once k >= r
    tail        W(m - r) .. W(m - 1), the r still deferred (all m when m < r)

So rank r starts issuing W only after r steady iterations and ends with r + 1 W's: the gradient
chain of I's runs down the pipeline without waiting for weight work, and the deferred W's fill
what would have been the end bubble. The last rank defers the most.

Formulas (F, I, W per stage, B = I + W, p = pp, m >= p micro-batches):

    idle per rank    (p - 1)(F + I - W) = (p - 1)(F + B - 2W)      [paper: 1F1B's (p-1)(F+B)]
                     exact when W <= F and W <= I. If W > I the last rank's start-up alone,
                     (p - 1)F, already exceeds it; if W > F the deferred W's overrun the end.
    activations      p on every rank if an activation is freed at its W (1F1B frees rank r's
                     p - r at B); p - r if freed at I

The paper's measured ZB-H1 also relies on the optimizer step being synchronised as usual; all
idle here is within one iteration.
"""

from __future__ import annotations

from ..actions import Action, Schedule, linear_placement, make_schedule
from .common import check_counts, fixed_chunks


def zb1p(pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    check_counts("zb1p", pp, micro_batches)
    fixed_chunks("zb1p", chunks, 1)
    m = micro_batches
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        steps = [Action("F", r, k) for k in range(warmup)]
        for k in range(m):
            if warmup + k < m:
                steps.append(Action("F", r, warmup + k))
            steps.append(Action("I", r, k))
            if k >= r:  # this rank keeps r weight gradients deferred
                steps.append(Action("W", r, k - r))
        steps += [Action("W", r, j) for j in range(max(m - r, 0), m)]
        ranks.append(steps)
    return make_schedule("zb1p", pp, m, linear_placement(pp), ranks)
