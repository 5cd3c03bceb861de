"""DualPipe: two pipelines in opposite directions over the same ranks (DeepSeek-V3 technical
report, arXiv 2412.19437, section 3.2.1 and figure 5; the deepseek-ai/DualPipe repository).

Layout. pp ranks (pp even) and a model of pp stages. Rank r holds stage r *and* stage pp-1-r, so
every stage has two copies (2x parameters per rank). The m micro-batches are split in halves:

    direction 0: micro-batches 0 .. m/2-1 enter at rank 0 and run stage s on rank s
                 (loss on rank pp-1);
    direction 1: micro-batches m/2 .. m-1 enter at rank pp-1 and run stage s on rank pp-1-s
                 (loss on rank 0).

The two copies of a stage see different micro-batches; their gradients are summed across the
mirrored pair (r, pp-1-r) before the optimizer step, so the update is that of one model trained
on all m micro-batches. Micro-batch numbers here are global (0..m-1); `direction` is carried in
every action as well.

Per-rank program. With H = pp/2, h = min(r, pp-1-r) (distance from the nearer end), M2 = m/2,
"phase 0" = the direction that enters at this rank's end (direction 0 on ranks < H, direction 1
on the others) and "phase 1" the other one, rank r runs eight steps:

    1. 2(H-h-1) x  F0                     fill the pipeline from this rank's own end
    2. h+1 x       F0, F1                 the other direction's first micro-batches arrive
    3. H-h-1 x     I1, W, F1              zero-bubble: the weight half of B1 fills the wait
    4. M2-pp+h+1 x F0&B1, F1&B0           steady state: every step overlaps a forward of one
                                          direction with a backward of the other; on the two
                                          middle ranks the very first F0&B1 runs as F0 then B1
    5. H-h-1 x     B1, F1&B0              forwards of phase 0 are used up
    6. h+1 x       B1, B0                 from iteration (h+1)//2 on, backwards are split:
                                          I now, W deferred (the switch comes before that
                                          iteration's B1 when h is odd, between B1 and B0 when
                                          h is even)
    7. H-h-1 x     W, I0                  deferred weight work fills the drain
    8. h+1 x       W                      the queue of deferred W's is empty at the end

Deferred W's form a FIFO queue (first deferred, first run). Each phase's forwards and backwards
take micro-batches in increasing order. Rank r's program mirrors rank pp-1-r's with the
directions swapped.

Constraints: pp even; m even; m >= 2 pp (step 4 runs at least once on the end ranks).

Formulas (DualPipe README; F, B, W per stage, F&B = one overlapped pair):

    bubble           (pp/2 - 1)(F&B + B - 3W)     exact at balanced costs (F = I = W, B = 2F,
                                                  F&B = F + B); otherwise ranks differ and the
                                                  simulated idle can be above or below it
    parameters       2x per rank (two stages, each a copy of a stage that another rank holds)
    activations      pp + 1 (stage, micro-batch) activations at most per rank

Production DualPipe overlaps the forward's all-to-all with the backward's computation inside an
F&B (the point of the design); here F&B is one step of cost F&B.
"""

from __future__ import annotations

from collections import deque

from ..actions import Action, Overlapped, Schedule, dual_placement, make_schedule
from .common import check_counts, fixed_chunks


def check_dualpipe(pp: int, micro_batches: int) -> None:
    check_counts("dualpipe", pp, micro_batches)
    if pp % 2:
        raise ValueError(f"dualpipe needs an even --pp (ranks pair up as r and pp-1-r); got {pp}, try "
                         + (f"{pp - 1} or {pp + 1}" if pp > 1 else "2"))
    if micro_batches % 2 or micro_batches < 2 * pp:
        least = 2 * pp
        suggestion = max(least, micro_batches + micro_batches % 2)
        raise ValueError(
            f"dualpipe needs --micro-batches even and >= 2*pp = {least} (half per direction); "
            f"got {micro_batches}, try {suggestion}"
        )


def rank_program(pp: int, micro_batches: int, rank: int) -> list:
    """The eight steps of one rank (see the module docstring)."""
    H, M2 = pp // 2, micro_batches // 2
    h = min(rank, pp - 1 - rank)
    middle = h == H - 1
    # phase -> direction: phase 0 is the direction that enters at this rank's end of the line.
    direction_of = (0, 1) if rank < H else (1, 0)
    next_f = [0, 0]  # next micro-batch (within its direction) to run forward, per phase
    next_b = [0, 0]  # next micro-batch to run backward (B or I), per phase
    deferred: deque[Action] = deque()  # weight halves waiting to run (FIFO)
    steps: list = []

    def action(kind: str, phase: int, k: int) -> Action:
        d = direction_of[phase]
        stage = rank if d == 0 else pp - 1 - rank
        return Action(kind, stage, d * M2 + k, d)

    def forward(phase: int) -> Action:
        next_f[phase] += 1
        return action("F", phase, next_f[phase] - 1)

    def backward(phase: int, split: bool = False) -> Action:
        next_b[phase] += 1
        if not split:
            return action("B", phase, next_b[phase] - 1)
        deferred.append(action("W", phase, next_b[phase] - 1))
        return action("I", phase, next_b[phase] - 1)

    def weight() -> Action:
        return deferred.popleft()

    for _ in range(2 * (H - h - 1)):  # step 1
        steps.append(forward(0))
    for _ in range(h + 1):  # step 2
        steps += [forward(0), forward(1)]
    for _ in range(H - h - 1):  # step 3
        steps.append(backward(1, split=True))
        steps += [weight(), forward(1)]
    for i in range(M2 - pp + h + 1):  # step 4
        if i == 0 and middle:
            steps += [forward(0), backward(1)]
        else:
            steps.append(Overlapped(forward(0), backward(1)))
        steps.append(Overlapped(forward(1), backward(0)))
    for _ in range(H - h - 1):  # step 5
        steps.append(backward(1))
        steps.append(Overlapped(forward(1), backward(0)))
    split = False
    for i in range(h + 1):  # step 6
        if i == (h + 1) // 2 and h % 2 == 1:
            split = True
        steps.append(backward(1, split))
        if i == (h + 1) // 2 and h % 2 == 0:
            split = True
        steps.append(backward(0, split))
    for _ in range(H - h - 1):  # step 7
        steps.append(weight())
        steps.append(backward(0, split=True))
    for _ in range(h + 1):  # step 8
        steps.append(weight())
    assert not deferred, "every deferred weight gradient has run"
    return steps


def dualpipe(pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    check_dualpipe(pp, micro_batches)
    fixed_chunks("dualpipe", chunks, 2)
    ranks = [rank_program(pp, micro_batches, r) for r in range(pp)]
    return make_schedule("dualpipe", pp, micro_batches, dual_placement(pp), ranks, chunks=2)
