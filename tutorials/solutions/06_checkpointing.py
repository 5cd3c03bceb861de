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
