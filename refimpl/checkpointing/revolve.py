"""Revolve: Griewank's binomial checkpointing, the fewest recomputations for a given number of slots.

Griewank, "Achieving logarithmic growth of temporal and spatial complexity in reverse automatic
differentiation" (Optimization Methods and Software, 1992), and Griewank & Walther, "Algorithm
799: revolve" (ACM TOMS 26(1), 2000). The problem: reverse a chain of l steps (here: layers),
keeping at most s states in snapshot slots, with as few forward steps as possible.

Counting convention (the one of the papers, fixed here and used everywhere in refimpl):

- s counts every snapshot slot, *including the one that holds the chain's input x_0* (x_0 has to
  be kept somewhere to be restarted from). So s >= 1, and s = 1 means: restart from x_0 each time.
- t(l, s) counts the forward steps run without grad ("advances"), *including the first sweep*
  from x_0 to x_(l-1). It does not count the one recorded forward that every layer gets right
  before its own backward (an engine needs the layer's graph to backpropagate through it). So an
  autograd engine runs t(l, s) + l layer forwards in all, and checkpoint_sequential's extra
  forwards beyond the unavoidable l are exactly t(l, s).
- Memory: at most s snapshots plus the state in hand, the input of the layer being recorded. For
  a layer that saves only its input (A bytes), the peak is (s + 1)·A.

The binomial result. With s slots and every step advanced at most r times, at most

    β(s, r) = C(s + r, s)                                    (e.g. β(7, 2) = C(9, 7) = 36)

steps can be reversed. The smallest r with β(s, r) >= l is the repetition number, and the
minimal number of advances is

    t(l, s) = r·l − β(s + 1, r − 1)    where β(s, r − 1) < l <= β(s, r), and β(s, −1) = 0.

Checks: l <= s + 1 gives r = 1 and t = l − 1 (keep every state once); s = 1 gives
t = l(l − 1)/2 (restart from x_0 for every layer); 36 steps with 7 slots need t = 2·36 − C(9, 8)
= 63 advances.

The schedule. `plan(n, slots)` builds it recursively: to reverse layers i+1..j with x_i kept and f
further free slots, advance d layers, keep x_(i+d), reverse i+d+1..j with f − 1 free slots, free
that slot, restore x_i and reverse i+1..i+d with f free slots. The cost of that choice is
d + t(j − i − d, f) + t(d, f + 1), and the planner takes the d that minimises it (using the closed
form for the two sub-costs). With no free slot, it restarts from x_i for every layer. The tests
check that executing the plan in the engine costs exactly t(n, slots) advances (counted inside
the layers), and that t equals a brute-force optimum: a shortest-path search over every sequence
of snapshot, free, restore and advance, written to be obviously correct rather than fast
(tests/test_checkpoint_revolve.py).

What production systems do differently. Revolve is the standard in adjoint codes (ADOL-C, dolfin-
adjoint, checkpointing libraries for PDE solvers); deep-learning frameworks mostly use uniform
segments (sqrt) or selective recomputation, because a transformer block's recorded activations R
are many times its input A, and layers are few (tens, not thousands).
"""

from __future__ import annotations

from functools import cache
from math import comb

from .actions import Advance, Backprop, Free, Record, Restore, Snapshot


def beta(s: int, r: int) -> int:
    """β(s, r) = C(s + r, s): the most steps reversible with s slots and r advances per step."""
    return 0 if r < 0 else comb(s + r, s)


def repetitions(l: int, s: int) -> int:
    """The repetition number: the smallest r with β(s, r) >= l."""
    _check(l, s)
    r = 0
    while beta(s, r) < l:
        r += 1
    return r


def min_advances(l: int, s: int) -> int:
    """t(l, s) = r·l − β(s + 1, r − 1): the fewest advances to reverse l steps with s slots."""
    r = repetitions(l, s)
    return r * l - beta(s + 1, r - 1)


def _check(l: int, s: int) -> None:
    if l < 1:
        raise ValueError(f"revolve needs at least one step, got {l}")
    if s < 1:
        raise ValueError(f"revolve needs at least one snapshot slot (it holds the chain's input), got {s}")


@cache
def _best_split(length: int, free: int) -> int:
    """The d in 1..length-1 minimising d + t(length − d, free) + t(d, free + 1) (the largest, on ties)."""
    best_d, best_cost = 0, None
    for d in range(1, length):
        cost = d + min_advances(length - d, free) + min_advances(d, free + 1)
        if best_cost is None or cost <= best_cost:
            best_d, best_cost = d, cost
    return best_d


def plan(n: int, slots: int) -> list:
    """The binomial schedule reversing n layers with `slots` snapshot slots (x_0's included)."""
    _check(n, slots)
    actions = [Snapshot(0)]
    hand = 0  # position of the state in hand, or None after a Backprop

    def take(i):
        nonlocal hand
        if hand != i:
            actions.append(Restore(i))
            hand = i

    def reverse(i, j, free):  # x_i is kept; reverse layers i+1..j
        nonlocal hand
        if j - i == 1:
            take(i)
            actions.extend([Record(i, j), Backprop(i, j)])
        elif free == 0:  # restart from x_i for each layer, last first
            for k in range(j, i, -1):
                take(i)
                if k - 1 > i:
                    actions.append(Advance(i, k - 1))
                actions.extend([Record(k - 1, k), Backprop(k - 1, k)])
                hand = None
        else:
            d = _best_split(j - i, free)
            take(i)
            actions.extend([Advance(i, i + d), Snapshot(i + d)])
            hand = i + d
            reverse(i + d, j, free - 1)
            actions.append(Free(i + d))
            reverse(i, i + d, free)
        hand = None

    reverse(0, n, slots - 1)
    actions.append(Free(0))
    return actions
