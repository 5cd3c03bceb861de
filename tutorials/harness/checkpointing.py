"""Checks for tutorial 06 (activation checkpointing): the cost of sqrt, revolve's minimum, and a
schedule written as actions. Costs are measured on refimpl's test chain of TanhLayers (each
recorded layer saves exactly its input, R = A), with the layer counters and the saved-tensor
ledger, never taken from the plans' own arithmetic."""

from __future__ import annotations

import numpy as np

from refimpl.autograd import Tensor
from refimpl.checkpointing import measure_chain, revolve
from refimpl.checkpointing.actions import simulate_chain
from refimpl.checkpointing.executor import run_schedule
from refimpl.checkpointing.measure import tanh_chain
from refimpl.checkpointing.plans import segment_actions
from refimpl.checkpointing.state import generators_of, parameters_of

from . import Wrong, plain


def check_sqrt_cost(sqrt_cost) -> None:
    """Check: the cost of the sqrt plan."""
    for n in (10, 17, 30, 16, 9, 4, 2, 1):  # the general case first; n = 1 (one segment, nothing kept) last
        measured = measure_chain(tanh_chain(n), "sqrt")
        expected = (measured.extra_forwards, int(measured.peak_states))
        got = sqrt_cost(n)
        try:
            same = tuple(got) == expected
        except TypeError:
            same = False
        if not same:
            message = (f"n={n}: the sqrt plan measures {expected[0]} extra forwards and a peak of {expected[1]} "
                       f"layer inputs; you said {plain(got)}")
            if n == 1:
                message += (". With one layer K = 1 and there is one segment, the last, which is recorded: nothing "
                            "is recomputed and the peak is its one input")
            raise Wrong(message)


def check_revolve_extra(revolve_extra) -> None:
    """Check: revolve's fewest recomputations."""
    for slots in range(1, 6):
        for n in (1, 2, 3, 5, 8, 13, 21, 40):
            expected = revolve.min_advances(n, slots)
            got = revolve_extra(n, slots)
            if got != expected:
                raise Wrong(f"n={n}, C={slots}: revolve reverses the chain with {expected} advances "
                            f"(t(n, C) = r·n − β(C+1, r−1)); you said {plain(got)}")
    for n, slots in [(8, 2), (13, 3)]:  # and the engine agrees: t + n counted layer forwards
        measured = measure_chain(tanh_chain(n), f"revolve:{slots}")
        if measured.extra_forwards != revolve_extra(n, slots):
            raise Wrong(f"n={n}, C={slots}: the engine counts {measured.extra_forwards} extra forwards")


def check_every_k_schedule(every_k_schedule) -> None:
    """Check: the every:K schedule as actions."""
    for n, k in [(7, 3), (9, 3), (4, 2), (6, 4), (8, 1), (5, 5), (1, 1)]:  # general first; K >= n and n = 1 last
        actions = list(every_k_schedule(n, k))
        reference = simulate_chain(segment_actions(n, k), n)
        try:
            summary = simulate_chain(actions, n)
        except ValueError as exc:
            hint = (" (the segment that starts at layer 0 keeps its input like any other: Snapshot(0) before its "
                    "Record, Free(0) at the very end)" if "at=0" in str(exc) else "")
            raise Wrong(f"n={n}, K={k}: {exc}{hint}") from None
        if summary.advances != reference.advances:
            raise Wrong(f"n={n}, K={k}: every:K recomputes {reference.advances} layer forwards (n − K); "
                        f"your schedule advances {summary.advances}")
        if summary.peak_bytes != reference.peak_bytes:
            raise Wrong(f"n={n}, K={k}: every:K holds at most {reference.peak_bytes} layer inputs; "
                        f"yours {summary.peak_bytes}")
        expected = segment_actions(n, k)  # valid and as cheap is not enough: the actions the exercise describes
        if actions != expected:
            at = next((i for i, (a, b) in enumerate(zip(actions, expected)) if a != b),
                      min(len(actions), len(expected)))
            raise Wrong(f"n={n}, K={k}: the every:K schedule has {len(expected)} actions and action {at} is "
                        f"{expected[at] if at < len(expected) else 'absent'}; yours has {len(actions)} and action "
                        f"{at} is {actions[at] if at < len(actions) else 'absent'}"
                        + (" (the last segment starts at 0 here: Snapshot(0) before its Record, Free(0) at the very "
                           "end)" if k >= n else ""))
        # Run it in the autograd engine: the gradients must equal a plain backward, bit for bit.
        layers = tanh_chain(n, width=4, seed=n)
        x_data = np.random.default_rng(k).standard_normal((3, 4))
        x = Tensor(x_data, requires_grad=True)
        y = run_schedule(layers, x, actions, [parameters_of(layer) for layer in layers],
                         [generators_of(layer) for layer in layers], True)
        y.backward(np.ones_like(y.data))
        ours = [x.grad] + [layer.weight.grad for layer in layers]
        plain = Tensor(x_data, requires_grad=True)
        for layer in layers:
            layer.weight.grad = None
        h = plain
        for layer in layers:
            h = layer(h)
        h.backward(np.ones_like(h.data))
        reference_grads = [plain.grad] + [layer.weight.grad for layer in layers]
        if not all(np.array_equal(a, b) for a, b in zip(ours, reference_grads)):
            raise Wrong(f"n={n}, K={k}: run in the engine, your schedule's gradients differ from a plain backward")


def check_cheapest_every_k(cheapest_every_k) -> None:
    """Check: the every:K plan with the fewest recomputations under a memory budget."""
    for n in (1, 2, 3, 5, 7, 12, 16, 23, 30):
        measured = {}
        for k in range(1, n + 1):
            m = measure_chain(tanh_chain(n), f"every:{k}")
            measured[k] = (m.extra_forwards, int(m.peak_states))
        lowest = min(peak for _, peak in measured.values())
        for budget in range(0, n + 2):
            fits = [k for k in measured if measured[k][1] <= budget]
            best = min(fits, key=lambda k: (measured[k][0], -k)) if fits else None
            got = cheapest_every_k(n, budget)
            where = f"n={n}, a budget of {budget} layer inputs"
            if best is None:
                if got is not None:
                    raise Wrong(f"{where}: no every:K fits (the lowest peak is {lowest}, at K="
                                f"{min(k for k in measured if measured[k][1] == lowest)}); return None, you said "
                                f"{plain(got)}")
                continue
            if got is None:
                raise Wrong(f"{where}: every:{best} fits (it peaks at {measured[best][1]}); you said None"
                            + (f". every:1 does not fit (it keeps all {n} inputs), but a larger K does: the peak is "
                               "not monotone in K" if measured[1][1] > budget else ""))
            try:
                k, extra, peak = got
            except (TypeError, ValueError):
                raise Wrong(f"{where}: return (K, extra forwards, peak); you said {plain(got)}") from None
            if k not in measured:
                raise Wrong(f"{where}: K must be between 1 and n; you said K={plain(k)}")
            if measured[k][1] > budget:
                raise Wrong(f"{where}: every:{k} peaks at {measured[k][1]} layer inputs, over the budget (its peak is "
                            f"⌈n/K⌉ − 1 snapshots plus the K inputs of the segment being recorded)")
            if measured[k][0] > measured[best][0]:
                gap = [j for j in range(k + 1, best) if measured[j][1] > budget]
                why = (f"the peak is not monotone in K: every:{gap[0]} does not fit, but a larger K does again"
                       if gap else "every:K recomputes n − K layers, so the largest K that fits recomputes least")
                raise Wrong(f"{where}: every:{best} also fits (it peaks at {measured[best][1]}) and recomputes "
                            f"{measured[best][0]} layer forwards, fewer than every:{k}'s {measured[k][0]}; {why}")
            if (extra, peak) != measured[k]:
                raise Wrong(f"{where}: every:{k} measures {measured[k][0]} extra forwards and a peak of "
                            f"{measured[k][1]} layer inputs; you said {plain(extra)} and {plain(peak)}")
