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

Communication (the executor's link-delay mode, and a mixture of experts' all-to-alls). Two more
costs: `P`, a pipeline message's link delay (it arrives `latency + P` after its send), and `A`, an
all-to-all's delay (it completes `A` after it starts). `exchanges` gives, per stage, the
all-to-alls of one forward (a backward, B or I, has as many: each dispatch and combine has its
transpose; W none). An action of cost c with k all-to-alls is k + 1 equal compute chunks with an
all-to-all after each but the last:

    c/(k+1) ─► start a2a₁ ─► [wait for a2a₁] ─► c/(k+1) ─► start a2a₂ ─► ... ─► c/(k+1)

One after the other (every step but an overlapped F&B) each all-to-all is waited for in full: the
action lasts c + k·A. An overlapped F&B (overlap=True) interleaves the F's and the B's chunks
exactly as overlap.Interleaver does: F first; a task runs one chunk, starts its all-to-all and
hands over to the other task (unless that one has finished); a task that resumes first waits
for its own all-to-all, if it is still in flight, and that wait is the exposed part: the rest
was hidden behind the other task's chunk. Steps without all-to-alls keep their costs (F&B: FB).
Per rank, every time is exact:

    exposed_pipeline[r]    Σ over r's steps of (start − end of the previous step): waiting for
                           a pipeline message (start-up and link delay included)
    exposed_all_to_all[r]  Σ of the waits for all-to-alls inside r's steps (part of busy[r])
    all_to_all[r]          exchanges of r's steps; hidden fraction = 1 − exposed / (count · A)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

from .actions import Action, Overlapped, Schedule, Step, format_action, make_schedule


def _frac(x) -> Fraction:
    return x if isinstance(x, Fraction) else Fraction(str(x)) if isinstance(x, float) else Fraction(x)


@dataclass(frozen=True)
class Costs:
    """Time of one action of each kind. B defaults to I + W and F&B to F + B.

    P and A are communication costs (default 0): a pipeline message's link delay and an
    all-to-all's delay (see the module docstring; the executor's link-delay mode)."""

    F: Fraction = Fraction(1)
    B: Fraction | None = None
    I: Fraction = Fraction(1)
    W: Fraction = Fraction(1)
    FB: Fraction | None = None
    P: Fraction = Fraction(0)
    A: Fraction = Fraction(0)

    def __post_init__(self):
        for name in ("F", "I", "W", "B", "FB", "P", "A"):
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
    def parse(text: str) -> Costs:
        """'F=1,B=2,I=1,W=1,FB=3' (any subset; F&B is accepted for FB), and the delays P=, A=."""
        values = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().upper().replace("&", "")
            if not sep or key not in ("F", "B", "I", "W", "FB", "P", "A"):
                raise ValueError(f"bad cost {item!r}: write costs as F=1,B=2,I=1,W=1,FB=3 (link delays: P=, A=)")
            try:
                values[key] = Fraction(value.strip())
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"bad cost {item!r}: the value must be a number such as 1, 0.5 or 1/3") from None
        return Costs(**values)

    def scaled(self, factor) -> Costs:
        """Compute costs times `factor` (a stage cut into smaller chunks); P and A are per message: kept."""
        factor = _frac(factor)
        return Costs(self.F * factor, self.B * factor, self.I * factor, self.W * factor, self.FB * factor,
                     self.P, self.A)

    def of(self, step: Step) -> Fraction:
        return self.FB if isinstance(step, Overlapped) else getattr(self, step.kind)

    def as_dict(self) -> dict:
        """The five compute costs, and P and A where they are not 0."""
        out = {"F": self.F, "B": self.B, "I": self.I, "W": self.W, "FB": self.FB}
        out.update({k: getattr(self, k) for k in ("P", "A") if getattr(self, k)})
        return out



def exchanges_of(action: Action, exchanges) -> int:
    """All-to-alls of one action: exchanges[stage] for F, B and I (W has none); 0 without experts."""
    if not exchanges or action.kind == "W":
        return 0
    return int(exchanges.get(action.stage, 0))


@dataclass(frozen=True)
class Segment:
    """A piece of a step: lane "compute" (a chunk of an action), "all_to_all" (an all-to-all in
    flight, from its start to its completion) or "wait" (a task blocked on its all-to-all: exposed)."""

    lane: str
    label: str
    start: Fraction  # from the step's start
    end: Fraction


@dataclass(frozen=True)
class StepRun:
    """How one step runs under the chunk model (module docstring)."""

    duration: Fraction
    exposed: Fraction  # time blocked on all-to-alls
    exchanges: int
    segments: tuple[Segment, ...]


def run_step(step: Step, costs: Costs, exchanges=None, overlap: bool = True) -> StepRun:
    """The chunks, all-to-alls and waits of one step, from its start (see the module docstring)."""
    parts = step.parts
    ks = [exchanges_of(a, exchanges) for a in parts]
    if not any(ks):  # no all-to-all: the step's own cost (F&B: FB)
        cost = costs.of(step)
        return StepRun(cost, Fraction(0), 0, (Segment("compute", format_action(step, short=True), Fraction(0), cost),))
    names = [format_action(a, short=True) for a in parts]
    chunk = [getattr(costs, a.kind) / (k + 1) for a, k in zip(parts, ks)]
    interleave = overlap and isinstance(step, Overlapped)
    t, exposed, turn = Fraction(0), Fraction(0), 0
    position, done, in_flight = [0] * len(parts), [False] * len(parts), [None] * len(parts)
    segments = []
    while not all(done):
        i = turn
        if in_flight[i] is not None:  # resumed: wait for this task's all-to-all if it is still in flight
            complete = in_flight[i]
            in_flight[i] = None
            if complete > t:
                segments.append(Segment("wait", f"{names[i]} a2a {position[i]}", t, complete))
                exposed += complete - t
                t = complete
        j = position[i]
        segments.append(Segment("compute", f"{names[i]} {j + 1}/{ks[i] + 1}", t, t + chunk[i]))
        t += chunk[i]
        position[i] += 1
        if position[i] == ks[i] + 1:  # the task is done; the other one (or the next action) goes on
            done[i] = True
            turn = (1 - i) if interleave else i + 1
            continue
        in_flight[i] = t + costs.A
        segments.append(Segment("all_to_all", f"{names[i]} a2a {position[i]}", t, t + costs.A))
        if interleave and not done[1 - i]:
            turn = 1 - i  # pause(): the other task computes while this all-to-all travels
    return StepRun(t, exposed, sum(ks), tuple(segments))


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
    exchanges: dict | None = None  # stage -> all-to-alls of one forward (the chunk model), or None
    overlap: bool = True  # F&B steps interleave their F and B at the all-to-alls
    exposed_pipeline: list[Fraction] = field(default_factory=list)  # per rank: waiting for messages
    exposed_all_to_all: list[Fraction] = field(default_factory=list)  # per rank: waiting for all-to-alls
    all_to_all: list[int] = field(default_factory=list)  # per rank: all-to-alls run

    def hidden_fraction(self) -> Fraction | None:
        """The share of all-to-all time (count · A over every rank) hidden behind computation."""
        total = sum(self.all_to_all) * self.costs.A
        return 1 - sum(self.exposed_all_to_all, Fraction(0)) / total if total else None

    def runs(self, rank: int):
        """(start, StepRun) of every step of `rank`: its chunks, all-to-alls and waits."""
        for start, _, step in self.intervals[rank]:
            yield start, run_step(step, self.costs, self.exchanges, self.overlap)


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
    ready = 0
    for when, where in needs:
        if when is None:
            return None
        ready = max(ready, when + (latency if where != here else 0))
    return ready


def step_times(schedule: Schedule, costs: Costs, latency=0, exchanges=None,
               overlap: bool = True) -> list[list[tuple[Fraction, Fraction, Step]]]:
    """Start and end of every step, rank by rank. Raises Deadlock if the lists cannot all finish.
    A message arrives latency + costs.P after its send; `exchanges` and `overlap`: the chunk model."""
    latency = _int_if_integral(_frac(latency) + costs.P)
    durations: dict = {}  # (kinds and stages of a step) -> its duration

    def duration(step: Step) -> Fraction:
        key = (step.kind, tuple((a.kind, a.stage) for a in step.parts))
        if key not in durations:
            durations[key] = _int_if_integral(run_step(step, costs, exchanges, overlap).duration)
        return durations[key]

    done: dict[tuple[str, int, int], Fraction] = {}  # (kind, stage, mb) -> end time
    position = [0] * schedule.pp
    free_at = [0] * schedule.pp
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
                end = start + duration(step)
                for action in step.parts:
                    done[(action.kind, action.stage, action.mb)] = end
                intervals[rank].append((start, end, step))
                free_at[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = ", ".join(
                f"rank {r} at {schedule.ranks[r][position[r]]}" for r in range(schedule.pp)
                if position[r] < len(schedule.ranks[r])
            )
            raise Deadlock(f"{schedule.name}: no rank can proceed ({waiting})")
    return [[(Fraction(start), Fraction(end), step) for start, end, step in iv] for iv in intervals]


def _int_if_integral(x: Fraction):
    """A whole number as an int: integer costs then run in int arithmetic, many times faster than
    Fraction's, and still exact (step_times hands back Fractions either way)."""
    return int(x) if x.denominator == 1 else x


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


def simulate(schedule: Schedule, costs: Costs | None = None, latency=0, steady_state: bool = True,
             exchanges=None, overlap: bool = True) -> Timeline:
    """Simulate `schedule` with `costs` (default unit costs) and point-to-point `latency` (plus
    costs.P); `exchanges` ({stage: all-to-alls of one forward}) and `overlap` add the chunk model."""
    costs = costs or Costs()
    latency = _frac(latency)
    exchanges = dict(exchanges) if exchanges else None
    intervals = step_times(schedule, costs, latency, exchanges, overlap)
    makespan = max((iv[-1][1] for iv in intervals if iv), default=Fraction(0))
    busy = [sum((end - start for start, end, _ in iv), Fraction(0)) for iv in intervals]
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
        exchanges=exchanges,
        overlap=overlap,
    )
    for r, iv in enumerate(intervals):
        previous_ends = [Fraction(0)] + [end for _, end, _ in iv[:-1]]
        timeline.exposed_pipeline.append(sum((start - prev for (start, _, _), prev in zip(iv, previous_ends)),
                                             Fraction(0)))
        runs = [run for _, run in timeline.runs(r)]
        timeline.exposed_all_to_all.append(sum((run.exposed for run in runs), Fraction(0)))
        timeline.all_to_all.append(sum(run.exchanges for run in runs))
    if steady_state:
        ends = []
        for iterations in (2, 3):
            ivs = step_times(repeat(schedule, iterations), costs, latency, exchanges, overlap)
            ends.append([iv[-1][1] if iv else Fraction(0) for iv in ivs])
        timeline.steady_state_idle = [ends[1][r] - ends[0][r] - busy[r] for r in range(schedule.pp)]
    return timeline
