"""ZB-V: zero bubble with two chunks per rank laid out in a V (Qi, Wan, Huang, Lin, "Zero Bubble
Pipeline Parallelism", arXiv 2401.10241, section 6; the handcrafted order that PyTorch's
ScheduleZBVZeroBubble also follows).

The model is cut into 2p stages. Rank r holds chunk 0 = stage r and chunk 1 = stage 2p-1-r, so a
micro-batch goes down the ranks 0 -> p-1 and comes back up p-1 -> 0: the first and the last stage
(the input and the loss) are both on rank 0, and the turn at rank p-1 is local. Backwards are
split into I (input gradient) and W (weight gradient). Rank r runs, with F0/I0/W0 acting on
chunk 0 and F1/I1/W1 on chunk 1, micro-batches in increasing order per chunk and kind:

    1. 2(p - r) - 1 x  F0                  fill the way down
    2. r x             F1, F0              the way back up reaches this rank
    3. p - r x         F1, I1, W1          the first gradients come back from the loss
    4. until all forwards are issued:      [F0], I0, W0, F1, I1, W1   (F0 while any is left)
    5. r x             I0, I1              drain: input gradients first ...
    6. p - r x         I0, W0
    7. the remaining W1's, then W0's       ... weight gradients fill the tail

The program is written for n = max(m, 2p - 1) micro-batches (the warm-up needs that many); for
m < 2p - 1 the actions of micro-batches m..n-1 are dropped and the pipeline runs partly empty.

Formulas (F, I, W per chunk, i.e. half a stage of a p-stage model; p = pp; m >= 2p - 1):

    steady-state idle per iteration   0 at F = I = W (the paper's "zero bubble"; simulated)
    single iteration                  (p - 1)F at F = I = W: the last rank's start-up, as ZB-H2
    activations                       2p chunk activations per rank = p micro-batches of a
                                      1F1B stage, the same memory as 1F1B (and half of ZB-H2)
    unequal costs                     the handcrafted order is tuned for F = I = W; the paper
                                      builds the order for measured costs with a greedy search
"""

from __future__ import annotations

from ..actions import Action, Schedule, make_schedule, v_placement
from .common import check_counts, fixed_chunks


def zbv(pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    check_counts("zbv", pp, micro_batches)
    fixed_chunks("zbv", chunks, 2)
    m = micro_batches
    n = max(m, 2 * pp - 1)
    ranks = []
    for r in range(pp):
        stage = (r, 2 * pp - 1 - r)  # chunk 0, chunk 1
        issued = {(kind, chunk): 0 for kind in "FIW" for chunk in (0, 1)}
        steps: list[Action] = []

        def add(kind: str, chunk: int) -> None:
            mb = issued[(kind, chunk)]
            issued[(kind, chunk)] += 1
            steps.append(Action(kind, stage[chunk], mb))

        for _ in range(2 * (pp - r) - 1):  # 1
            add("F", 0)
        for _ in range(r):  # 2
            add("F", 1)
            add("F", 0)
        for _ in range(pp - r):  # 3
            add("F", 1)
            add("I", 1)
            add("W", 1)
        while issued[("F", 1)] < issued[("F", 0)] or issued[("F", 0)] < n:  # 4
            if issued[("F", 0)] < n:
                add("F", 0)
            for kind, chunk in (("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1)):
                add(kind, chunk)
        for _ in range(r):  # 5
            add("I", 0)
            add("I", 1)
        for _ in range(pp - r):  # 6
            add("I", 0)
            add("W", 0)
        while issued[("W", 1)] < issued[("I", 1)]:  # 7
            add("W", 1)
        while issued[("W", 0)] < issued[("I", 0)]:
            add("W", 0)
        ranks.append([a for a in steps if a.mb < m])
    return make_schedule("zbv", pp, m, v_placement(pp), ranks, chunks=2)
