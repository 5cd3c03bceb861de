"""The pipeline part of a step: refimpl's schedule simulator run on the cost model's action times.

The cost model gives one action's time (F, I, W of one stage and micro-batch, P of one pipeline
message); the schedule and the simulator (parallel/pipeline/simulate.py) give the makespan of one
step and the peak of in-flight activations, exactly as `python -m refimpl schedule` does for a
schedule the executor runs. Times go in as whole nanoseconds so that the simulator's exact
arithmetic stays on integers.

A long run (thousands of micro-batches on 64 stages) would take seconds to simulate, and its
steady state repeats: after a warm-up, every period of p·u micro-batches (u = 2 for DualPipe,
whose micro-batches come in pairs of directions, else 1) adds the same time, or, once message
delays exceed an action, the same sequence of a few periods' times (the drawn test found
interleaved runs whose periods alternate and ZB-H2 runs that repeat every 3 periods). So for a
long run the simulator runs PROBES = 10 probes a period apart, m₀ = 2p·u + (m mod p·u), ...,
m₉ = m₀ + 9p·u, finds the shortest cycle of c ≤ 3 periods that the last probes repeat three times,
and extends it to m:

    makespan(m) = makespan(m₉) + ⌊n / c⌋ · (the cycle's time) + (its first n mod c periods' times),
    n = (m − m₉) / (p·u);

where no such cycle shows, the whole run is simulated. The extension equals the full simulation
exactly on every schedule, stage count, cost and delay drawn (tests/test_cluster.py). The peak of
in-flight activations is reached within the first m₀ micro-batches, except GPipe's, which is m.

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


PROBES = 10  # simulations, a period apart, that look for the steady state's cycle
LONGEST_CYCLE = 3  # the longest cycle looked for, in periods of p·u micro-batches


def extrapolated_makespan(schedule: str, pp: int, m: int, chunks: int | None, costs: Costs,
                          exchanges: int = 0) -> tuple[Fraction, list[int], tuple[int, ...], Fraction]:
    """(makespan, peaks per rank, the m of each simulation, exposed all-to-all time): simulated,
    or, beyond the probes, extended from the cycle the probes repeat three times (module docstring)."""
    period = pp * _unit(schedule)
    start = 2 * period + m % period
    if m > start + (PROBES - 1) * period:
        probes = [start + k * period for k in range(PROBES)]
        runs = [_makespan(schedule, pp, n, chunks, costs, exchanges) for n in probes]
        steps = [(b[0] - a[0], b[2] - a[2]) for a, b in zip(runs, runs[1:])]  # (makespan, exposed) per period
        for c in range(1, LONGEST_CYCLE + 1):
            if steps[-c:] == steps[-2 * c:-c] == steps[-3 * c:-2 * c]:  # the steady state's cycle, three times
                repeats, rest = divmod((m - probes[-1]) // period, c)
                added = [sum(d[i] for d in steps[-c:]) * repeats + sum(d[i] for d in steps[-c:][:rest])
                         for i in (0, 1)]
                peaks = [m] * pp if schedule == "gpipe" else runs[0][1]
                return runs[-1][0] + added[0], peaks, tuple(probes), runs[-1][2] + added[1]
    makespan, peaks, exposed = _makespan(schedule, pp, m, chunks, costs, exchanges)  # short, or no cycle
    return makespan, peaks, (m,), exposed


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
