"""Timing simulator: when every step of a schedule runs, and what that costs in idle time and memory.

Model. Each rank runs its list of steps in order, one at a time, each step as early as possible:
a step starts when the rank has finished its previous step and every input the step depends on
is ready; it then lasts its cost. The dependencies (the same ones the validator checks):

    F(s, m)       after F(s-1, m)                      (the activation it consumes)
    B/I(s, m)     after F(s, m) and B/I(s+1, m)        (its own activation, the incoming gradient)
    W(s, m)       after I(s, m)
    F&B pair      after the dependencies of both halves; both halves end when the pair ends

A dependency produced on another rank arrives `latency` later (one point-to-point message);
one produced on the same rank (the turn of a V, DualPipeV's last rank) arrives at once. Sends are
buffered here (a sender never waits for its receiver): this measures compute and dependency
waiting only. Whether the same lists can also run with rendezvous sends is the validator's job.

Costs are per action, i.e. per stage or chunk of the model: when a schedule cuts the model into
more stages than ranks (interleaved, ZB-V, DualPipeV) each action is proportionally cheaper, and
the caller scales the costs (the `schedule` command does, see `Costs.scaled`). All arithmetic is
exact (`fractions.Fraction`), so simulated idle times can be compared with the closed forms for
equality.

Reported, per rank r:

    busy[r]   = sum of the costs of r's steps
    idle[r]   = makespan - busy[r]     (start-up and drain count as idle)
    bubble fraction = sum(idle) / (ranks * makespan)
    peak activations: the largest number of (stage, micro-batch) activations held at once. An
      activation is allocated by its F and freed by its backward; with a split backward it is
      freed either at I (`peak_freed_at_i`, optimistic: only what W needs survives, here
      counted as nothing) or at W (`peak_activations`, the conservative convention used in the
      papers' tables: W still reads the layer inputs). Depends only on each rank's order.
    steady-state idle: the schedule repeated back to back (iteration j+1's micro-batches are
      queued behind iteration j's on every rank, as when the optimizer step needs no global
      synchronisation, the zero-bubble paper's post-update validation) adds
      end[r](3 iterations) - end[r](2 iterations) per iteration; minus busy[r] it is the idle that
      one iteration costs in steady state.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

from .actions import Action, Overlapped, Schedule, Step, make_schedule


def _frac(x) -> Fraction:
    return x if isinstance(x, Fraction) else Fraction(str(x)) if isinstance(x, float) else Fraction(x)


@dataclass(frozen=True)
class Costs:
    """Time of one action of each kind. B defaults to I + W and F&B to F + B."""

    F: Fraction = Fraction(1)
    B: Fraction | None = None
    I: Fraction = Fraction(1)
    W: Fraction = Fraction(1)
    FB: Fraction | None = None

    def __post_init__(self):
        for name in ("F", "I", "W", "B", "FB"):
            value = getattr(self, name)
            if value is None:
                continue
            value = _frac(value)
            if value < 0:
                raise ValueError(f"cost {name} must be >= 0; got {value}")
            object.__setattr__(self, name, value)
        if self.B is None:
            object.__setattr__(self, "B", self.I + self.W)
        if self.FB is None:
            object.__setattr__(self, "FB", self.F + self.B)

    @staticmethod
    def parse(text: str) -> "Costs":
        """'F=1,B=2,I=1,W=1,FB=3' (any subset; F&B is accepted for FB)."""
        values = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().upper().replace("&", "")
            if not sep or key not in ("F", "B", "I", "W", "FB"):
                raise ValueError(f"bad cost {item!r}: write costs as F=1,B=2,I=1,W=1,FB=3")
            try:
                values[key] = Fraction(value.strip())
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"bad cost {item!r}: the value must be a number such as 1, 0.5 or 1/3") from None
        return Costs(**values)

    def scaled(self, factor) -> "Costs":
        factor = _frac(factor)
        return Costs(self.F * factor, self.B * factor, self.I * factor, self.W * factor, self.FB * factor)

    def of(self, step: Step) -> Fraction:
        return self.FB if isinstance(step, Overlapped) else getattr(self, step.kind)

    def as_dict(self) -> dict:
        return {"F": self.F, "B": self.B, "I": self.I, "W": self.W, "FB": self.FB}


@dataclass
class Timeline:
    """What `simulate` returns. Times are Fractions; `intervals[r]` is [(start, end, step)]."""

    schedule: Schedule
    costs: Costs
    latency: Fraction
    intervals: list[list[tuple[Fraction, Fraction, Step]]]
    makespan: Fraction
    busy: list[Fraction]
    idle: list[Fraction]
    bubble_fraction: Fraction
    peak_activations: list[int]
    peak_freed_at_i: list[int]
    steady_state_idle: list[Fraction] | None = field(default=None)


class Deadlock(RuntimeError):
    """No rank can start its next step: the schedule waits on something that never happens."""


def _backward_done(done: dict, stage: int, mb: int):
    """When the gradient of (stage, mb)'s input became available: its I, or else its B."""
    return done.get(("I", stage, mb), done.get(("B", stage, mb)))


def _ready_time(action: Action, here: int, schedule: Schedule, done: dict, latency: Fraction):
    """When `action`'s inputs are ready on rank `here`, or None if one is not produced yet."""
    placement, s, m = schedule.placement, action.stage, action.mb
    needs: list[tuple[Fraction | None, int]] = []  # (time produced, producing rank)
    if action.kind == "F":
        if s > 0:
            needs.append((done.get(("F", s - 1, m)), placement.rank_of(s - 1, action.direction)))
    elif action.kind in ("B", "I"):
        needs.append((done.get(("F", s, m)), here))
        if s + 1 < schedule.num_stages:
            needs.append((_backward_done(done, s + 1, m), placement.rank_of(s + 1, action.direction)))
    else:  # W
        needs.append((done.get(("I", s, m)), here))
    ready = Fraction(0)
    for when, where in needs:
        if when is None:
            return None
        ready = max(ready, when + (latency if where != here else 0))
    return ready


def step_times(schedule: Schedule, costs: Costs, latency=0) -> list[list[tuple[Fraction, Fraction, Step]]]:
    """Start and end of every step, rank by rank. Raises Deadlock if the lists cannot all finish."""
    latency = _frac(latency)
    done: dict[tuple[str, int, int], Fraction] = {}  # (kind, stage, mb) -> end time
    position = [0] * schedule.pp
    free_at = [Fraction(0)] * schedule.pp
    intervals: list[list] = [[] for _ in range(schedule.pp)]
    remaining = sum(len(r) for r in schedule.ranks)
    while remaining:
        progressed = False
        for rank in range(schedule.pp):
            # Run this rank as far as its inputs allow before moving on to the next rank.
            while position[rank] < len(schedule.ranks[rank]):
                step = schedule.ranks[rank][position[rank]]
                readies = [_ready_time(a, rank, schedule, done, latency) for a in step.parts]
                if any(r is None for r in readies):
                    break
                start = max([free_at[rank], *readies])
                end = start + costs.of(step)
                for action in step.parts:
                    done[(action.kind, action.stage, action.mb)] = end
                intervals[rank].append((start, end, step))
                free_at[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = ", ".join(
                f"rank {r} at {schedule.ranks[r][position[r]]}" for r in range(schedule.pp) if position[r] < len(schedule.ranks[r])
            )
            raise Deadlock(f"{schedule.name}: no rank can proceed ({waiting})")
    return intervals


def peak_in_flight(schedule: Schedule, rank: int, free_at: str = "W") -> int:
    """Most activations held at once on `rank`; freed at B, and at `free_at` ('I' or 'W') if split."""
    live = peak = 0
    for action in schedule.actions(rank):
        if action.kind == "F":
            live += 1
            peak = max(peak, live)
        elif action.kind == "B" or action.kind == free_at:
            live -= 1
    return peak


def repeat(schedule: Schedule, iterations: int) -> Schedule:
    """The schedule run `iterations` times back to back, micro-batches renumbered per iteration."""
    m = schedule.micro_batches

    def shift(action: Action, k: int) -> Action:
        return replace(action, mb=action.mb + k * m)

    ranks = []
    for steps in schedule.ranks:
        seq = []
        for k in range(iterations):
            for step in steps:
                if isinstance(step, Overlapped):
                    seq.append(Overlapped(shift(step.f, k), shift(step.b, k)))
                else:
                    seq.append(shift(step, k))
        ranks.append(seq)
    return make_schedule(schedule.name, schedule.pp, m * iterations, schedule.placement, ranks, schedule.chunks)


def simulate(schedule: Schedule, costs: Costs | None = None, latency=0, steady_state: bool = True) -> Timeline:
    """Simulate `schedule` with `costs` (default unit costs) and point-to-point `latency`."""
    costs = costs or Costs()
    latency = _frac(latency)
    intervals = step_times(schedule, costs, latency)
    makespan = max((iv[-1][1] for iv in intervals if iv), default=Fraction(0))
    busy = [sum((costs.of(step) for _, _, step in iv), Fraction(0)) for iv in intervals]
    idle = [makespan - b for b in busy]
    total = makespan * schedule.pp
    bubble_fraction = sum(idle, Fraction(0)) / total if total else Fraction(0)
    timeline = Timeline(
        schedule=schedule,
        costs=costs,
        latency=latency,
        intervals=intervals,
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_fraction=bubble_fraction,
        peak_activations=[peak_in_flight(schedule, r, "W") for r in range(schedule.pp)],
        peak_freed_at_i=[peak_in_flight(schedule, r, "I") for r in range(schedule.pp)],
    )
    if steady_state:
        ends = []
        for iterations in (2, 3):
            ivs = step_times(repeat(schedule, iterations), costs, latency)
            ends.append([iv[-1][1] if iv else Fraction(0) for iv in ivs])
        timeline.steady_state_idle = [ends[1][r] - ends[0][r] - busy[r] for r in range(schedule.pp)]
    return timeline
