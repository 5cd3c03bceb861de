"""Closed forms: the published bubble and memory of each schedule, and when they are exact.

Notation: p = pp ranks, m micro-batches, v chunks per rank (interleaved); F, B, I, W, F&B are the
costs of one *action* (one stage or chunk), which is how the papers state them. B = I + W.

    schedule     idle per rank (bubble)            accounting      exact here when
    gpipe        (p-1)(F+B)                        one iteration   always (zero latency)
    1f1b         (p-1)(F+B)                        one iteration   always
    interleaved  (p-1)(F+B)   [chunk costs: 1F1B/v] one iteration   always
    zb1p         (p-1)(F+I-W) = (p-1)(F+B-2W)      one iteration   m >= p, W <= F, W <= I
    zbh2         (p-1)(F+I-2W) = (p-1)(F+B-3W)     steady state    m >= 2p-1, W <= F, W <= I
                 one iteration: max((p-1)F, that)                  same conditions
    zbv          0 at F = I = W                    steady state    m >= 2p-1, F = I = W
                 one iteration: (p-1)F                              same conditions
    dualpipe     (p/2-1)(F&B+B-3W)                 one iteration   F = I = W, F&B = F+B
    dualpipev    (p-1)(F&B+B-3W)  [PP = 2p stages]  one iteration   F = I = W, F&B = F+B

"Steady state" is the idle one iteration adds when iterations run back to back without a global
synchronisation between them (see simulate.py); the zero-bubble paper's ZB-H2 and ZB-V figures
count that way. Within one iteration the last rank cannot start before (p-1)F, so no schedule
on a line of p ranks has less idle than that in single-iteration accounting.

Peak activations per rank ((stage, micro-batch) activations, freed at W):
gpipe m; 1f1b min(p-r, m); interleaved min(2(p-r-1) + (v-1)p + 1, vm) (vm when m = p);
zb1p p (m >= p); zbh2 2p-1 (m >= 2p-1); zbv 2p (m >= 2p-1); dualpipe p+1; dualpipev 2p+1.
A positive point-to-point latency only adds idle time, so an exact closed form becomes a lower
bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from .actions import Schedule
from .simulate import Costs


@dataclass(frozen=True)
class ClosedForm:
    formula: str  # the bubble formula, as text
    idle: Fraction  # its value: idle per rank
    accounting: str  # "iteration" (single iteration) or "steady-state"
    exact: bool  # the simulator must reproduce `idle` on every rank, exactly
    note: str  # where it is exact and where not
    iteration_idle: Fraction | None  # single-iteration idle, where a closed form is known
    bubble_fraction: Fraction | None  # the published bubble fraction, where there is one
    peak_activations: list[int] | None  # per rank, freed at W


def closed_form(schedule: Schedule, costs: Costs, latency=0) -> ClosedForm:
    p, m, v = schedule.pp, schedule.micro_batches, schedule.chunks
    F, B, I, W, FB = costs.F, costs.B, costs.I, costs.W, costs.FB
    zero_latency = Fraction(latency) == 0
    balanced = F == I == W and B == I + W and FB == F + B
    w_small = W <= F and W <= I
    name = schedule.name
    if name in ("gpipe", "1f1b", "interleaved"):
        idle = (p - 1) * (F + B)
        fraction = Fraction(p - 1, v * m + p - 1)
        if name == "gpipe":
            peak = [m] * p
        elif name == "1f1b":
            peak = [min(p - r, m) for r in range(p)]
        else:
            peak = [v * m if m == p else min(2 * (p - r - 1) + (v - 1) * p + 1, v * m) for r in range(p)]
        note = "exact for any F, B" + ("" if name != "interleaved" else "; F, B are chunk costs (1/v of a stage)")
        return ClosedForm("(p-1)(F+B)", idle, "iteration", zero_latency, note, idle, fraction, peak)
    if name == "zb1p":
        idle = (p - 1) * (F + I - W)
        exact = zero_latency and m >= p and w_small
        note = "exact when m >= p, W <= F and W <= I; if W > I the start-up (p-1)F alone is larger"
        peak = [min(p, m)] * p if m >= p else None
        return ClosedForm("(p-1)(F+I-W)", idle, "iteration", exact, note, idle if exact else None, None, peak)
    if name == "zbh2":
        idle = max(Fraction(0), (p - 1) * (F + I - 2 * W))
        exact = zero_latency and m >= 2 * p - 1 and w_small
        note = (
            "steady state (iterations back to back); one iteration costs max((p-1)F, (p-1)(F+I-2W)); "
            "both exact when m >= 2p-1, W <= F and W <= I"
        )
        single = max((p - 1) * F, idle)
        peak = [2 * p - 1] * p if m >= 2 * p - 1 else None
        return ClosedForm("(p-1)(F+I-2W)", idle, "steady-state", exact, note, single if exact else None, None, peak)
    if name == "zbv":
        exact = zero_latency and m >= 2 * p - 1 and F == I == W
        note = (
            "the paper's zero bubble at F = I = W, steady state; one iteration costs (p-1)F there; "
            "other costs: no closed form (the handcrafted order is tuned for F = I = W)"
        )
        peak = [2 * p] * p if m >= 2 * p - 1 else None
        single = (p - 1) * F if exact else None
        return ClosedForm("0 when F=I=W", Fraction(0), "steady-state", exact, note, single, None, peak)
    if name in ("dualpipe", "dualpipev"):
        stages = schedule.num_stages
        idle = (Fraction(stages, 2) - 1) * (FB + B - 3 * W)
        exact = zero_latency and balanced
        note = (
            f"PP = {stages} stages; exact at F = I = W, B = 2F, F&B = F+B; with other costs the ranks "
            "can differ and the formula is only indicative"
        )
        peak = [stages + 1] * p
        formula = "(PP/2-1)(F&B+B-3W)"
        return ClosedForm(formula, idle, "iteration", exact, note, idle if exact else None, None, peak)
    raise ValueError(f"no closed form for schedule {name!r}")
