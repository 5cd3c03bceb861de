"""Reference solutions to tutorial 06's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""

import math

from refimpl.checkpointing.actions import Advance, Backprop, Free, Record, Restore, Snapshot


def sqrt_cost(n):
    k = math.isqrt(n - 1) + 1 if n > 1 else 1
    m = -(-n // k)
    return n - k, (m - 1) + k


def revolve_extra(n, C):
    def beta(s, r):
        return 0 if r < 0 else math.comb(s + r, s)

    r = 0
    while beta(C, r) < n:
        r += 1
    return r * n - beta(C + 1, r - 1)


def every_k_schedule(n, k):
    m = -(-n // k)
    first = n - (m - 1) * k
    bounds = [0] + [first + i * k for i in range(m)]
    segments = list(zip(bounds[:-1], bounds[1:]))
    actions = []
    for a, b in segments[:-1]:
        actions += [Snapshot(a), Advance(a, b)]
    a, b = segments[-1]
    if a == 0:
        actions.append(Snapshot(0))
    actions += [Record(a, b), Backprop(a, b)]
    for a, b in reversed(segments[:-1]):
        actions += [Restore(a), Record(a, b), Backprop(a, b), Free(a)]
    if segments[-1][0] == 0:
        actions.append(Free(0))
    return actions


def cheapest_every_k(n, budget):
    # every:K keeps ⌈n/K⌉ − 1 snapshots while it records a segment of K layers: peak ⌈n/K⌉ − 1 + K, for
    # n − K extra forwards. The peak is not monotone in K, so try every K, largest (cheapest) first.
    for k in range(n, 0, -1):
        peak = -(-n // k) - 1 + k
        if peak <= budget:
            return k, n - k, peak
    return None


ANSWER = """
Model answer to the question (measure and explain).

(a) every:K peaks at f(K) = ⌈n/K⌉ − 1 + K layer inputs (exercise 4). K + n/K ≥ 2√n, and since
K + ⌈n/K⌉ is an integer, min f = ⌈2√n⌉ − 1, reached at K = ⌈√n⌉ (for n ≤ 40 the measured
minimum over K always equals ⌈2√n⌉ − 1, and sqrt's K is always a minimiser). But f is flat
near its minimum, and sqrt's K is often not the largest minimiser: for 43 of n = 1 … 64 a larger K
peaks as low, and each extra layer in the recorded segment saves one recomputation. n = 7: sqrt (K = 3) and every:4
both peak at 5, with 4 and 3 extra forwards; n = 21: K = 5 and K = 7 both peak at 9, with 16 and 14. So the cheapest
plan at the lowest peak is the largest K with ⌈n/K⌉ + K = ⌈2√n⌉, which exercise 4 finds.
(b) Part 4's GPT, one step: none 6,418,432 bytes; every:1 1,128,448; every:2 1,785,856; sqrt
(every:3) 2,541,568; every:4 3,297,280; every:8 6,451,200. Each block input is A = 32,768 bytes, and
one more recorded block costs 657,408 ≈ 20A: a recorded block saves R ≈ 20 inputs' worth. So the
peak is about C + (⌈n/K⌉ − 1)A + K·R·A, minimised near K = √(n/R), below 1 for n = 8: every:1 is
best, and sqrt peaks 2.3 times higher. √n is optimal only when a recorded layer costs one input
(R = 1, the tanh chain); a transformer block saves far more than its input, so the optimum
checkpoints every block, paying one recomputed forward per block (15 block forwards instead of 8).
"""
