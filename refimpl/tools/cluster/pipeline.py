"""The pipeline part of a step: refimpl's schedule simulator run on the cost model's action times.

The cost model gives one action's time (F, I, W of one stage and micro-batch, P of one pipeline
message); the schedule and the simulator (parallel/pipeline/simulate.py) give the makespan of one
step and the peak of in-flight activations, exactly as `python -m refimpl schedule` does for a
schedule the executor runs. Times go in as whole nanoseconds so that the simulator's exact
arithmetic stays on integers.

A long run (thousands of micro-batches on 64 stages) would take seconds to simulate, and its
steady state repeats: after the first 2p micro-batches (4p for DualPipe, whose micro-batches
come in pairs of directions) every further p (2p) micro-batches add the same time. So for
m > m₂ the makespan is extrapolated from two simulations,

    m₁ = 2p·u + (m mod p·u),   m₂ = m₁ + p·u       (u = 2 for dualpipe, else 1)
    makespan(m) = makespan(m₁) + (m − m₁)/(p·u) · (makespan(m₂) − makespan(m₁)),

which equals the full simulation exactly on every schedule, stage count and cost tested
(tests/test_cluster.py draws them), except the interleaved schedule: with message delays its
periods' times need not repeat with period p (the drawn test found runs whose periods alternate,
and others that repeat every 3 or 7 periods), so it is always simulated whole (about 0.5 s for 16
stages and 1024 micro-batches). The peak of in-flight activations is reached within the first
m₁ micro-batches, except GPipe's, which is m.

`estimate_step` is the cheap version `plan` ranks thousands of candidates with: busy time plus
the published closed-form idle of parallel/pipeline/formulas.py (exact at zero latency under the
conditions it states), plus 2(p − 1) message delays for the fill and the drain, and the closed
forms' peaks. `plan` then simulates the best candidates with `simulate_step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from refimpl.parallel.pipeline import Costs, build, closed_form
from refimpl.parallel.pipeline.simulate import peak_in_flight, run_step, step_times

NS = 1e-9


@dataclass(frozen=True)
class PipelineTime:
    makespan: float  # seconds, one step's forwards and backwards on the busiest rank
    peak_in_flight: tuple[int, ...]  # per rank: (stage, micro-batch) activations held at once (freed at W)
    simulated_micro_batches: tuple[int, ...]  # the m of each simulation (one: not extrapolated)
    exposed_all_to_all: float = 0.0  # seconds the busiest rank waits for experts' all-to-alls


def visits(schedule: str, chunks: int | None) -> int:
    """How often a micro-batch passes each rank: the model is cut into pp · visits stages."""
    if schedule == "interleaved":
        return chunks or 2
    return 2 if schedule in ("zbv", "dualpipev") else 1


def parameter_copies(schedule: str) -> int:
    """DualPipe keeps every stage on two ranks (one per direction): twice the parameters."""
    return 2 if schedule == "dualpipe" else 1


def _unit(schedule: str) -> int:
    return 2 if schedule == "dualpipe" else 1


def _makespan(schedule: str, pp: int, m: int, chunks, costs: Costs,
              exchanges: int = 0) -> tuple[Fraction, list[int], Fraction]:
    """(makespan, peaks per rank, the most any rank waits for all-to-alls); `exchanges`: the
    all-to-alls of one stage's forward (experts; the simulator's chunk model, F&B overlapped)."""
    sched = build(schedule, pp, m, chunks)
    per_stage = {s: exchanges for s in range(sched.num_stages)} if exchanges else None
    intervals = step_times(sched, costs, exchanges=per_stage)
    makespan = max(iv[-1][1] for iv in intervals if iv)
    exposed = Fraction(0)
    if per_stage:
        waits: dict = {}  # a step's kinds -> its exposed wait (every stage has the same exchanges)
        for steps in sched.ranks:
            total = Fraction(0)
            for step in steps:
                key = (step.kind, tuple(a.kind for a in step.parts))
                if key not in waits:
                    waits[key] = run_step(step, costs, per_stage).exposed
                total += waits[key]
            exposed = max(exposed, total)
    return makespan, [peak_in_flight(sched, r, "W") for r in range(pp)], exposed


def extrapolated_makespan(schedule: str, pp: int, m: int, chunks: int | None, costs: Costs,
                          exchanges: int = 0) -> tuple[Fraction, list[int], tuple[int, ...], Fraction]:
    """(makespan, peaks per rank, the m of each simulation, exposed all-to-all time): simulated,
    or for m > m₂ extrapolated from m₁ and m₂ (module docstring)."""
    period = pp * _unit(schedule)
    m1 = 2 * period + m % period
    if m <= m1 + period or schedule == "interleaved":  # interleaved: no fixed period (module docstring)
        makespan, peaks, exposed = _makespan(schedule, pp, m, chunks, costs, exchanges)
        return makespan, peaks, (m,), exposed
    t1, peaks, e1 = _makespan(schedule, pp, m1, chunks, costs, exchanges)
    t2, _, e2 = _makespan(schedule, pp, m1 + period, chunks, costs, exchanges)
    if schedule == "gpipe":
        peaks = [m] * pp
    scale = Fraction(m - m1, period)
    return t1 + scale * (t2 - t1), peaks, (m1, m1 + period), e1 + scale * (e2 - e1)


@lru_cache(maxsize=256)
def simulate_step(schedule: str, pp: int, m: int, chunks: int | None, F: float, I: float, W: float,
                  P: float, A: float = 0.0, exchanges: int = 0) -> PipelineTime:
    """One step of `schedule` on pp ranks with m micro-batches; F, I, W (one action), P (one
    message's delay) and A (one all-to-all, `exchanges` of them per stage's forward and as many
    per backward) in seconds. B = I + W and F&B = F + B, as the executor runs them; an F&B step
    interleaves its halves at the all-to-alls (DualPipe's overlap), every other step waits for them."""
    costs = Costs(F=round(F / NS), I=round(I / NS), W=round(W / NS), P=round(P / NS), A=round(A / NS))
    makespan, peaks, simulated, exposed = extrapolated_makespan(schedule, pp, m, chunks, costs,
                                                                exchanges if A else 0)
    return PipelineTime(float(makespan) * NS, tuple(peaks), simulated, float(exposed) * NS)


@dataclass(frozen=True)
class _Shape:
    """What formulas.closed_form reads of a schedule, without building its lists."""

    name: str
    pp: int
    micro_batches: int
    chunks: int
    num_stages: int


def estimate_step(schedule: str, pp: int, m: int, chunks: int | None, F: float, I: float, W: float,
                  P: float, A: float = 0.0, exchanges: int = 0) -> PipelineTime:
    """busy + the closed-form idle + 2(pp − 1)·P, and the closed forms' peaks (module docstring);
    all-to-alls waited for in full (no overlap credited)."""
    v = visits(schedule, chunks)
    shape = _Shape(schedule, pp, m, v, pp * v)
    form = closed_form(shape, Costs(F=round(F / NS), I=round(I / NS), W=round(W / NS)))
    peaks = form.peak_activations or [min(m, pp) * v] * pp  # m < p: a bound (every micro-batch in flight)
    busy = m * v * (F + I + W)
    idle = float(form.idle) * NS + 2 * (pp - 1) * P
    waits = m * v * 2 * exchanges * A
    return PipelineTime(busy + idle + waits, tuple(peaks), (), waits)
