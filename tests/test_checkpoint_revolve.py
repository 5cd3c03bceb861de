"""Revolve: the binomial formulas, a brute-force optimum, a dynamic program, and the executed counts.

Convention (revolve.py): s slots including the one holding x_0; t counts advances (forwards
without grad) including the first sweep; each layer is also recorded once, so an engine runs
t + n layer forwards.
"""

import heapq
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.checkpointing import revolve, simulate_chain
from refimpl.checkpointing.measure import measure_chain, tanh_chain


def test_binomial_numbers():
    assert revolve.beta(7, 2) == 36
    assert revolve.beta(1, 5) == 6 and revolve.beta(3, 0) == 1 and revolve.beta(4, -1) == 0
    assert revolve.repetitions(36, 7) == 2 and revolve.repetitions(37, 7) == 3
    assert revolve.min_advances(36, 7) == 2 * 36 - revolve.beta(8, 1) == 63
    assert revolve.min_advances(1, 1) == 0


@pytest.mark.parametrize("s", [1, 2, 3, 5])
def test_closed_form_special_cases(s):
    for n in range(1, s + 2):  # enough slots: every state kept once
        assert revolve.min_advances(n, s) == n - 1
    for n in range(1, 30):  # one slot: restart from x_0 for every layer
        assert revolve.min_advances(n, 1) == n * (n - 1) // 2


@cache
def _dp(length, free):
    """Optimal advances by dynamic programming over the first split (x_i kept, `free` more slots)."""
    if length == 1:
        return 0
    if free == 0:
        return length * (length - 1) // 2
    return min(d + _dp(length - d, free - 1) + _dp(d, free) for d in range(1, length))


def brute_force_advances(n: int, slots: int) -> int:
    """The fewest advances over *all* schedules, by a shortest-path search (small n only).

    A state is (j, kept, p): layers j+1..n are reversed, `kept` is the set of snapshot positions,
    p is the position of the state in hand (−1: none). Moves: advance p → p+1 (cost 1, only up to
    x_(j-1)), snapshot p (if a slot is free), free or restore any snapshot (cost 0), and reverse
    layer j when p = j − 1 (cost 0: its recorded forward is not an advance). Start (n, ∅, 0), goal
    j = 0. Dijkstra's algorithm with costs 0 and 1.
    """
    start = (n, frozenset(), 0)
    dist = {start: 0}
    queue = [(0, 0, start)]
    tie = 0
    while queue:
        cost, _, state = heapq.heappop(queue)
        if dist[state] < cost:
            continue
        j, kept, p = state
        if j == 0:
            return cost
        moves = []
        if 0 <= p < j - 1:
            moves.append((1, (j, kept, p + 1)))
        if p >= 0 and p not in kept and len(kept) < slots:
            moves.append((0, (j, kept | {p}, p)))
        for q in kept:
            moves.append((0, (j, kept - {q}, p)))
            moves.append((0, (j, kept, q)))
        if p == j - 1:
            moves.append((0, (j - 1, frozenset(q for q in kept if q < j - 1), -1)))
        for step, nxt in moves:
            if cost + step < dist.get(nxt, cost + step + 1):
                dist[nxt] = cost + step
                tie += 1
                heapq.heappush(queue, (cost + step, tie, nxt))
    raise AssertionError("unreachable: every chain can be reversed with one slot")


def test_formula_equals_brute_force_optimum_for_small_chains():
    for s in range(1, 5):
        for n in range(1, 10):
            assert revolve.min_advances(n, s) == brute_force_advances(n, s), (n, s)


def test_formula_equals_dynamic_program():
    for s in range(1, 9):
        for n in range(1, 90):
            assert revolve.min_advances(n, s) == _dp(n, s - 1), (n, s)


@pytest.mark.parametrize("n,s", [(36, 7), (37, 7), (64, 3), (100, 4), (256, 8), (20, 1)])
def test_plan_is_valid_and_reaches_the_minimum(n, s):
    summary = simulate_chain(revolve.plan(n, s), n)
    assert summary.advances == revolve.min_advances(n, s)
    assert summary.max_snapshots <= s and summary.records == n


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), slots=st.integers(1, 8))
def test_executed_counts_are_the_binomial_minimum(n, slots):
    """Counted inside the layers and by the saved-tensor ledger: t(n, C) + n forwards, (C + 1)·A peak."""
    m = measure_chain(tanh_chain(n), f"revolve:{slots}")
    assert m.forward_calls == n + revolve.min_advances(n, slots)
    assert m.peak_bytes == min(slots + 1, n) * m.input_bytes


def test_peak_grows_with_the_slots():
    """resolve_budget bisects over C; that needs the predicted peak to be monotone in C."""
    for own, saves_input in ((0, True), (20, False), (7, True)):
        for n in range(1, 30):
            peaks = [simulate_chain(revolve.plan(n, c), n, own_bytes=own, saves_input=saves_input).peak_bytes
                     for c in range(1, n + 1)]
            assert peaks == sorted(peaks), (n, own)


def test_bad_slots_and_lengths():
    with pytest.raises(ValueError, match="at least one snapshot slot"):
        revolve.plan(5, 0)
    with pytest.raises(ValueError, match="at least one step"):
        revolve.min_advances(0, 3)
