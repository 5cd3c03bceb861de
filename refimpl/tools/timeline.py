"""The measured timeline of a pipeline step, set beside the simulator's prediction.

`install(trainer, action_costs, trace)` makes a `MeasuredTimeline` the observer of the trainer's pipeline
executor (parallel/pipeline/executor.py, Observer). Every rank records the start and end of each
of its steps on its own clock (pacing.py), counted from the moment it left a barrier with the
other ranks of its pipeline. From one step:

    makespan      T = max over ranks of the end of the rank's last step
    busy[r]       Σ (end − start) over r's steps            (computation, plus the cost sleep)
    idle[r]       T − busy[r]                                (waiting for messages, start-up,
                                                              drain, and the executor's own work)
    bubble        Σ_r idle[r] / (pp · T)

— the simulator's definitions (simulate.py), so the two can be compared number for number. The
prediction is `simulate(schedule, costs)` with the *measured* mean cost of each kind of step
(F, B, I, W, F&B averaged over all ranks and micro-batches), zero latency and no steady state:
the executor synchronises every step, so a measured step pays single-iteration idle.

Two timing modes, and every figure says which one it comes from:

    compute   the steps take what the NumPy computation takes. With more ranks than cores, ranks
              share cores and a step's time mostly shows contention: the same F can take twice
              as long when another rank computes at the same moment. Costs also differ between
              stages (the first stage embeds, the last computes the head and the loss), while
              the simulator assumes one cost per kind.
    sleep     every step is padded with a sleep to a fixed cost (--action-costs F=0.02,I=0.02,
              W=0.02 seconds, B = I + W and F&B = F + B unless given; pacing.py). Sleeping ranks
              leave the cores to the others, so the run shows the schedule's own bubble; what
              remains on top of the prediction is message latency, the barrier's skew and the
              executor's bookkeeping. A step whose computation alone exceeds its cost is an
              overrun (reported; raise the costs if there are any).

Exposed communication (pacing.py): per rank, the seconds blocked in the wait of a pipeline receive
and in the wait of an all-to-all, and the number of all-to-alls. In sleep-cost mode the simulator
predicts both exactly from the configured costs (with the link delays P and A of --action-costs,
the stages' all-to-alls and whether F&B overlaps: simulate's chunk model):
`simulated_exposed_*`. The hidden fraction is 1 − exposed all-to-all time / (all-to-alls · A).

Memory: the peak of saved activations during the step, beside `replay_peak` (the simulator's peak
activations weighted by the bytes each forward measurably saved).

Clock skew: the ranks' clocks are aligned only by the barrier (its exit differs by microseconds
to a millisecond between ranks), which is enough for idle fractions of steps that last many
milliseconds; it is not a precise global clock.

Each rank's figures travel once per step as one fixed-size float64 vector (`STAT_FIELDS`), a
buffer-based all-gather over the pipeline's ranks; the full list of steps (for `--trace`) is
gathered only when a trace is asked for.
"""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np

from refimpl.autograd.saved import saved_tensors
from refimpl.parallel.experts import stage_exchanges
from refimpl.parallel.pipeline.actions import Schedule, step_label
from refimpl.parallel.pipeline.simulate import Costs, simulate
from refimpl.tools.pacing import Pacing
from refimpl.tools.saved_runs import safe_files

KINDS = ("F", "B", "I", "W", "F&B")
MODEL_STATE = ("parameters", "gradients", "optimizer_states")
STAT_FIELDS = ("end", "busy", "overruns", "peak_bytes", "replay_peak_w", "replay_peak_i") + tuple(
    f"{what}_{kind}" for kind in KINDS for what in ("n", "sum")) + tuple(f"{k}_bytes" for k in MODEL_STATE) + (
    "exposed_pipeline", "exposed_all_to_all", "exchanges")


class MeasuredTimeline(Pacing):
    """The observer of a pipelined Trainer's executor: each run paced and timed (pacing.Pacing),
    then every pipeline rank's figures of the step gathered (stats: (pp, len(STAT_FIELDS))), and
    with `trace` the steps and events too (steps_by_rank, events_by_rank), written by rank 0 as a
    Chrome trace; report() is `summarize` of the last step (the trainer's pipeline report)."""

    def __init__(self, trainer, costs: Costs | None = None, trace: str | None = None) -> None:
        super().__init__(costs, {s: stage_exchanges(stage) for s, stage in trainer.all_stages.items()})
        self.trainer, self.trace, self.mode = trainer, trace, describe_costs(costs)
        self.stats = self.steps_by_rank = self.events_by_rank = None

    def run_started(self, executor) -> None:
        saved_tensors.reset_peak()  # the step's own peak
        executor.comm.barrier("the pipeline's start")  # the ranks' clocks start together
        super().run_started(executor)

    def run_ended(self, record) -> None:
        trainer, schedule, p = self.trainer, self.trainer.schedule, self.trainer.mesh.pp_index
        stats = rank_stats(self, saved_tensors.peak_bytes, replay_peak(schedule, p, record.activation_bytes, "W"),
                           replay_peak(schedule, p, record.activation_bytes, "I"), trainer.model_state_bytes())
        comm = trainer.mesh.pp_comm
        self.stats = comm.allgather(stats).reshape(trainer.pp, len(STAT_FIELDS))  # (pp · fields,) -> (pp, fields)
        if self.trace:  # a diagnostic, not the hot path
            gathered = comm.allgather_object((self.steps, self.events))
            self.steps_by_rank = [steps for steps, _ in gathered]
            self.events_by_rank = [events for _, events in gathered]
            if trainer.rank == 0:
                write_trace(self.trace, chrome_trace(schedule, self.steps_by_rank, self.mode, self.events_by_rank,
                                                     self.costs, self.stage_exchanges, trainer.executor.overlap))

    def report(self) -> dict:
        """Measured vs simulated idle and exposed communication of the last step ({} before one)."""
        if self.stats is None:
            return {}
        return summarize(self.trainer.schedule, self.stats, self.mode, self.costs, self.stage_exchanges,
                         self.trainer.executor.overlap)


def install(trainer, action_costs=None, trace: str | None = None) -> Pacing | None:
    """Watch a Trainer's pipeline runs (its executor's observer); returns the observer, or None.

    action_costs: --action-costs text or simulate.Costs (None: compute mode). A pipelined trainer
    gets a MeasuredTimeline (its report and trace); one without a pipeline, with costs, a Pacing (its
    steps padded to the costs, nothing reported)."""
    costs = parse_costs(action_costs) if action_costs is None or isinstance(action_costs, str) else action_costs
    if trainer.pipelined:
        trainer.executor.observer = MeasuredTimeline(trainer, costs, trace)
    elif costs is not None:
        trainer.executor.observer = Pacing(costs)
    else:
        return None
    return trainer.executor.observer


def rank_stats(run, peak_bytes: int, replay_w: int, replay_i: int, model_state: dict | None = None) -> np.ndarray:
    """This rank's figures of one step (run: a Pacing after the run) as a (len(STAT_FIELDS),) float64 vector."""
    values = {"end": run.steps[-1].end if run.steps else 0.0, "busy": sum(s.end - s.start for s in run.steps),
              "overruns": run.overruns, "peak_bytes": peak_bytes, "replay_peak_w": replay_w, "replay_peak_i": replay_i}
    values.update({f"{k}_bytes": (model_state or {}).get(k, 0) for k in MODEL_STATE})
    values.update(exposed_pipeline=run.exposed["pipeline"], exposed_all_to_all=run.exposed["all_to_all"],
                  exchanges=run.exchanges)
    for kind in KINDS:
        times = [s.end - s.start for s in run.steps if s.kind == kind]
        values[f"n_{kind}"], values[f"sum_{kind}"] = len(times), sum(times)
    return np.array([values[f] for f in STAT_FIELDS], dtype=np.float64)


def replay_peak(schedule: Schedule, rank: int, activation_bytes: dict, free_at: str = "W") -> int:
    """Peak bytes if (s, mb)'s activation of `activation_bytes[(s, mb)]` is held from its F to its
    B (or, split, to `free_at`: "W" holds everything until W, "I" frees everything at I) — the
    simulator's peak_activations, weighted by the measured bytes of each stage's forward."""
    live = peak = 0
    for action in schedule.actions(rank):
        key = (action.stage, action.mb)
        if action.kind == "F":
            live += activation_bytes[key]
            peak = max(peak, live)
        elif action.kind == "B" or action.kind == free_at:
            live -= activation_bytes[key]
    return peak


def measured_costs(stats: np.ndarray) -> dict:
    """Mean seconds per kind of step over every rank (kinds that did not occur are left out)."""
    col = {f: i for i, f in enumerate(STAT_FIELDS)}
    costs = {}
    for kind in KINDS:
        n, total = stats[:, col[f"n_{kind}"]].sum(), stats[:, col[f"sum_{kind}"]].sum()
        if n:
            costs[kind] = float(total / n)
    return costs


def costs_for_simulator(mean: dict) -> Costs:
    """simulate.Costs from measured means; an absent kind gets a value no step will use."""
    F = mean.get("F", 0.0)
    I = mean.get("I", mean.get("B", 0.0) / 2)
    W = mean.get("W", mean.get("B", 2 * I) - I)
    B = mean.get("B", I + W)
    FB = mean.get("F&B", F + B)

    def us(seconds: float) -> Fraction:  # whole microseconds: small exact fractions for the simulator
        return Fraction(round(seconds * 1e6), 10**6)

    return Costs(F=us(F), I=us(I), W=us(W), B=us(B), FB=us(FB))


def simulate_configured(schedule, costs: Costs, exchanges=None, overlap: bool = True):
    """The simulator's prediction for a sleep-cost run: its configured costs and link delays, the
    stages' all-to-alls (the chunk model), one iteration."""
    return simulate(schedule, costs, steady_state=False, exchanges=exchanges, overlap=overlap)


def exposed_summary(stats: np.ndarray, prediction=None, costs: Costs | None = None) -> dict:
    """Measured (and, given the configured prediction, simulated) exposed communication per rank."""
    col = {f: i for i, f in enumerate(STAT_FIELDS)}
    exchanges = [int(v) for v in stats[:, col["exchanges"]]]
    exposed_a2a = stats[:, col["exposed_all_to_all"]]
    A = float(costs.A) if costs is not None else 0.0
    total = sum(exchanges) * A
    out = {
        "link_delay_s": float(costs.P) if costs is not None else 0.0,
        "all_to_all_delay_s": A,
        "all_to_all_exchanges": exchanges,
        "measured_exposed_pipeline_s": [float(v) for v in stats[:, col["exposed_pipeline"]]],
        "measured_exposed_all_to_all_s": [float(v) for v in exposed_a2a],
        "measured_hidden_fraction": 1 - float(exposed_a2a.sum()) / total if total else None,
        "simulated_exposed_pipeline_s": None,
        "simulated_exposed_all_to_all_s": None,
        "simulated_hidden_fraction": None,
        "simulated_comm_makespan_s": None,
    }
    if prediction is not None:
        hidden = prediction.hidden_fraction()
        out.update(simulated_exposed_pipeline_s=[float(v) for v in prediction.exposed_pipeline],
                   simulated_exposed_all_to_all_s=[float(v) for v in prediction.exposed_all_to_all],
                   simulated_hidden_fraction=None if hidden is None else float(hidden),
                   simulated_comm_makespan_s=float(prediction.makespan))
    return out


def summarize(schedule, stats: np.ndarray, mode: str, costs: Costs | None = None, exchanges=None,
              overlap: bool = True) -> dict:
    """Measured and simulated idle per rank for one step; stats: (pp, len(STAT_FIELDS)). In
    sleep-cost mode (costs: the configured ones) also the simulated exposed communication."""
    col = {f: i for i, f in enumerate(STAT_FIELDS)}
    makespan = float(stats[:, col["end"]].max())
    busy = stats[:, col["busy"]]
    idle = makespan - busy
    mean = measured_costs(stats)
    timeline = simulate(schedule, costs_for_simulator(mean), steady_state=False)
    sim_makespan = float(timeline.makespan)
    sim_idle_fraction = [float(i / timeline.makespan) if timeline.makespan else 0.0 for i in timeline.idle]
    measured_bubble = float(idle.sum() / (schedule.pp * makespan)) if makespan else 0.0
    simulated_bubble = float(timeline.bubble_fraction)
    return {
        "timing": mode,
        "makespan_s": makespan,
        "simulated_makespan_s": sim_makespan,
        "measured_costs_s": mean,
        "measured_idle_fraction": [float(i / makespan) if makespan else 0.0 for i in idle],
        "simulated_idle_fraction": sim_idle_fraction,
        "measured_bubble": measured_bubble,
        "simulated_bubble": simulated_bubble,
        "bubble_ratio": measured_bubble / simulated_bubble if simulated_bubble else None,
        "overruns": int(stats[:, col["overruns"]].sum()),
        "peak_activation_bytes": [int(v) for v in stats[:, col["peak_bytes"]]],
        "replayed_peak_bytes_freed_at_w": [int(v) for v in stats[:, col["replay_peak_w"]]],
        "replayed_peak_bytes_freed_at_i": [int(v) for v in stats[:, col["replay_peak_i"]]],
        "simulated_peak_activations": list(timeline.peak_activations),
        "model_state_bytes": {k: [int(v) for v in stats[:, col[f"{k}_bytes"]]] for k in MODEL_STATE},
        **exposed_summary(stats, None if costs is None else simulate_configured(schedule, costs, exchanges, overlap),
                          costs),
    }


def _lanes(pid: int, pp: int) -> list:
    """Thread names and order of a process: rank r's steps (tid r), then its communication (tid pp + r)."""
    events = []
    for r in range(pp):
        for tid, name, order in ((r, f"rank {r}", 2 * r), (pp + r, f"rank {r} communication", 2 * r + 1)):
            events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}},
                       {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": order}}]
    return events


def _comm_event(lane: str, name: str, start: float, end: float, pid: int, tid: int, step_tid: int) -> dict:
    """A Pacing / Segment event: compute chunks nest inside their step, the rest on the communication lane."""
    return {"name": name, "cat": "chunk" if lane == "compute" else lane, "ph": "X", "pid": pid,
            "tid": step_tid if lane == "compute" else tid, "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6}


def chrome_trace(schedule, steps_by_rank: list, mode: str, comm_by_rank: list | None = None,
                 costs: Costs | None = None, exchanges=None, overlap: bool = True) -> dict:
    """Chrome trace-event JSON (Perfetto, chrome://tracing): process 0 the measured steps, one
    thread per rank (an F&B step with its F and B nested inside, and the chunks of actions with
    all-to-alls), and below each rank its communication (pacing.Pacing's events: all-to-alls in
    flight, waits on them, pipeline messages in flight and receive waits); process 1 the
    simulator's timeline for the measured mean costs; process 2 (sleep-cost mode, `costs` the
    configured ones) the simulator's prediction with its chunks, all-to-alls and waits."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"measured ({mode})"}},
              {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "simulated, measured mean costs"}}]
    pp = schedule.pp
    for pid in (0, 1):
        events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": r, "args": {"name": f"rank {r}"}}
                   for r in range(pp)]
    if comm_by_rank is not None:
        events += [e for e in _lanes(0, pp) if e["tid"] >= pp or e["name"] == "thread_sort_index"]
        for rank, comm in enumerate(comm_by_rank):
            events += [_comm_event(*event, pid=0, tid=pp + rank, step_tid=rank) for event in comm]
    for rank, steps in enumerate(steps_by_rank):
        for s in steps:
            events.append({"name": s.label, "cat": s.kind, "ph": "X", "pid": 0, "tid": rank,
                           "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
                           "args": {"compute_ms": s.compute * 1e3}})
            for label, start, end in s.parts:  # an F&B's two actions, nested inside the step
                events.append({"name": label, "cat": "part", "ph": "X", "pid": 0, "tid": rank,
                               "ts": start * 1e6, "dur": (end - start) * 1e6})
    stats = np.zeros((len(steps_by_rank), len(STAT_FIELDS)))
    col = {f: i for i, f in enumerate(STAT_FIELDS)}
    for rank, steps in enumerate(steps_by_rank):
        for s in steps:
            stats[rank, col[f"n_{s.kind}"]] += 1
            stats[rank, col[f"sum_{s.kind}"]] += s.end - s.start
    timeline = simulate(schedule, costs_for_simulator(measured_costs(stats)), steady_state=False)

    for rank, intervals in enumerate(timeline.intervals):
        for start, end, step in intervals:
            events.append({"name": step_label(schedule, step), "cat": step.kind, "ph": "X", "pid": 1, "tid": rank,
                           "ts": float(start) * 1e6, "dur": float(end - start) * 1e6})
    if costs is not None:
        prediction = simulate_configured(schedule, costs, exchanges, overlap)
        events += [{"name": "process_name", "ph": "M", "pid": 2,
                    "args": {"name": "simulated, configured costs and link delays"}}] + _lanes(2, pp)
        for rank, intervals in enumerate(prediction.intervals):
            previous = 0
            for (start, end, step), (_, run) in zip(intervals, prediction.runs(rank)):
                if start > previous:
                    events.append(_comm_event("pipeline", "wait", float(previous), float(start), 2, pp + rank, rank))
                events.append({"name": step_label(schedule, step), "cat": step.kind, "ph": "X", "pid": 2, "tid": rank,
                               "ts": float(start) * 1e6, "dur": float(end - start) * 1e6})
                if run.exchanges:
                    events += [_comm_event(seg.lane, seg.label, float(start + seg.start), float(start + seg.end), 2,
                                           pp + rank, rank) for seg in run.segments]
                previous = end
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, trace: dict) -> None:
    """Replace `path` by the trace atomically (a temporary file renamed over it: a reader never sees
    half a trace; safe_files.write_atomically, not flushed to disk: a diagnostic). The path was
    checked before the run (run.check_output_paths); a failure now is one line, not a traceback."""
    text = json.dumps(trace).encode()
    try:
        safe_files.write_atomically(path, lambda f: f.write(text), durable=False)
    except OSError as exc:
        raise ValueError(f"--trace {path} cannot be written: {exc.strerror or exc}") from None


def parse_costs(text: str | None) -> Costs | None:
    """--action-costs 'F=0.02,I=0.02,W=0.02' (seconds) as simulate.Costs, or None (compute mode).
    P=seconds and A=seconds add the link-delay mode: a pipeline message is delivered P after its
    send, an all-to-all completes A after its start (pacing.py)."""
    if text is None or text == "":
        return None
    costs = Costs.parse(text)
    if min(costs.F, costs.I, costs.W, costs.B, costs.FB) <= 0:
        raise ValueError(f"--action-costs must all be positive seconds, got {text!r}")
    if max(costs.FB, costs.P, costs.A) > 60:
        raise ValueError(f"--action-costs are seconds per step; {text!r} is more than a minute")
    return costs


def describe_costs(costs: Costs | None) -> str:
    if costs is None:
        return "compute"
    parts = ",".join(f"{k}={float(v):g}" for k, v in costs.as_dict().items())
    return f"sleep ({parts} s)"


__all__ = ["MeasuredTimeline", "install", "replay_peak", "STAT_FIELDS", "rank_stats", "measured_costs", "summarize",
           "chrome_trace", "write_trace", "parse_costs", "describe_costs", "exposed_summary", "simulate_configured"]
