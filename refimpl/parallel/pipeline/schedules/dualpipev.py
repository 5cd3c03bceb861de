"""DualPipeV: DualPipe "cut in half" onto a V (the deepseek-ai/DualPipe repository; the schedule
from DeepSeek-V3, arXiv 2412.19437, section 3.2.1, without the second copy of the model).

Layout. pp ranks and a model of 2*pp stages in a V: stage s runs on rank s for s < pp and on
rank 2pp-1-s otherwise, so rank r holds chunk 0 = stage r and chunk 1 = stage 2pp-1-r. There is
one direction and no parameter duplication; only rank 0 sees the inputs, the labels and the loss;
the last rank hands activations and gradients between its two stages locally.

Per-rank program: DualPipe's eight steps with the two directions replaced by the two chunks
(phase 0 = chunk 0, on the way down; phase 1 = chunk 1, on the way back up), the rank's
distance from the end h replaced by r, half the ranks H by pp, micro-batches per direction by m,
and "the two middle ranks" by the last rank:

    1. 2(pp-r-1) x  F0
    2. r+1 x        F0, F1
    3. pp-r-1 x     I1, W, F1
    4. m-2pp+r+1 x  F0&B1, F1&B0      (on the last rank the very first F0&B1 runs as F0, B1)
    5. pp-r-1 x     B1, F1&B0
    6. r+1 x        B1, B0            split into I + deferred W from iteration (r+1)//2 on
                                      (before its B1 when r is odd, before its B0 when even)
    7. pp-r-1 x     W, I0
    8. r+1 x        W

Deferred W's run first-in first-out. By construction DualPipeV on R ranks with m micro-batches
runs, rank by rank, the same sequence as ranks 0..R-1 of DualPipe on 2R ranks with 2m
micro-batches (direction-1 micro-batch m + k there is micro-batch k here; the stage numbers
coincide). The tests check this against an independent DualPipe generator.

Constraint: m >= 2 pp (step 4 runs at least once on rank 0).

Formulas (F, B, W per stage = half of a rank's share of the model; PP = 2pp stages):

    bubble        (PP/2 - 1)(F&B + B - 3W) = (pp - 1)(F&B + B - 3W); exact at F = I = W
    parameters    1x per rank (two stages of size 1/(2pp) each, no copies)
    activations   PP + 1 = 2pp + 1 stage activations at most per rank
"""

from __future__ import annotations

from collections import deque

from ..actions import Action, Overlapped, Schedule, make_schedule, v_placement
from .common import check_counts, fixed_chunks


def check_dualpipev(pp: int, micro_batches: int) -> None:
    check_counts("dualpipev", pp, micro_batches)
    if micro_batches < 2 * pp:
        raise ValueError(f"dualpipev needs --micro-batches >= 2*pp = {2 * pp}; got {micro_batches}, try {2 * pp}")


def rank_program(pp: int, micro_batches: int, rank: int) -> list:
    m, r = micro_batches, rank
    stage = (r, 2 * pp - 1 - r)  # chunk 0, chunk 1
    next_f = [0, 0]
    next_b = [0, 0]
    deferred: deque[Action] = deque()
    steps: list = []

    def forward(chunk: int) -> Action:
        next_f[chunk] += 1
        return Action("F", stage[chunk], next_f[chunk] - 1)

    def backward(chunk: int, split: bool = False) -> Action:
        next_b[chunk] += 1
        k = next_b[chunk] - 1
        if not split:
            return Action("B", stage[chunk], k)
        deferred.append(Action("W", stage[chunk], k))
        return Action("I", stage[chunk], k)

    for _ in range(2 * (pp - r - 1)):  # 1
        steps.append(forward(0))
    for _ in range(r + 1):  # 2
        steps += [forward(0), forward(1)]
    for _ in range(pp - r - 1):  # 3
        steps.append(backward(1, split=True))
        steps += [deferred.popleft(), forward(1)]
    for i in range(m - 2 * pp + r + 1):  # 4
        if i == 0 and r == pp - 1:
            steps += [forward(0), backward(1)]
        else:
            steps.append(Overlapped(forward(0), backward(1)))
        steps.append(Overlapped(forward(1), backward(0)))
    for _ in range(pp - r - 1):  # 5
        steps.append(backward(1))
        steps.append(Overlapped(forward(1), backward(0)))
    split = False
    for i in range(r + 1):  # 6
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        steps.append(backward(1, split))
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        steps.append(backward(0, split))
    for _ in range(pp - r - 1):  # 7
        steps.append(deferred.popleft())
        steps.append(backward(0, split=True))
    for _ in range(r + 1):  # 8
        steps.append(deferred.popleft())
    assert not deferred, "every deferred weight gradient has run"
    return steps


def dualpipev(pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    check_dualpipev(pp, micro_batches)
    fixed_chunks("dualpipev", chunks, 2)
    ranks = [rank_program(pp, micro_batches, r) for r in range(pp)]
    return make_schedule("dualpipev", pp, micro_batches, v_placement(pp), ranks, chunks=2)
