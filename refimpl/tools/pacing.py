"""Timing and pacing one rank's pipeline runs: the executor's observer (parallel/pipeline/executor.py).

The executor says when a step, an action, a wait or an all-to-all happens (`Observer`); `Pacing`
turns that into measurements, and on request makes the run slower on purpose so that what it
measures can be set beside the simulator's prediction (simulate.py):

    steps       each step's start and end in seconds since t0 (the run's start: the ranks of a
                pipeline leave a barrier together just before, timeline.py) and its computation;
                an F&B's two actions nested inside it (`StepTime`)
    exposed     the wall time blocked in the wait of a pipeline receive (`exposed["pipeline"]`,
                which also counts waiting for the sender's computation: start-up and bubbles) and
                in the wait of an all-to-all (`exposed["all_to_all"]`), and the all-to-alls waited for
    events      (lane, name, start, end): "compute" (a chunk of an action with all-to-alls),
                "all_to_all" (an exchange in flight), "wait" (blocked on an exchange: exposed),
                "message" (a pipeline message in flight, link-delay mode), "pipeline" (blocked on
                a receive) -- the trace's communication lanes (timeline.chrome_trace)

With `costs` (simulate.Costs, in seconds: --action-costs) two modes make the run follow the costs:

    sleep cost   each step is padded by a sleep to its fixed cost (F, B, I, W, F&B), so that the
                 run shows the schedule's own bubble rather than CPU contention; a step whose
                 computation alone exceeds its cost is an overrun. An action with k all-to-alls
                 (two per expert-parallel MoE layer in F, B and I; none in W) is k + 1 chunks of
                 cost/(k + 1), each padded when the next all-to-all starts and at the action's end,
                 and its step is not padded further (an F&B of such actions lasts what its F and B
                 chunks and waits make it). The padding is cumulative: chunk j ends at
                 (j+1)/(k+1) of the action's cost in its own compute time (waits and the other
                 task's chunks excluded), so an oversleep is taken back by the next chunk.
    link delay   costs.A > 0: an all-to-all completes no earlier than A after its start, so that
                 the other task's chunk of an overlapped F&B step hides part of it. costs.P > 0: a
                 pipeline message counts as delivered P after its send: it carries one extra
                 element (the observer's trailer: the sender's send time in seconds since its t0,
                 float32 or float64 like the message, exact to well under a microsecond for runs of
                 seconds), and the receiver's wait ends no earlier than its own t0 + send time + P.

Those are the simulator's chunk model (simulate.run_step), so simulate(schedule, costs,
exchanges=..., overlap=...) predicts every measured wait. On one node MPI delivers through shared
memory almost at once, so without the link delays there would be little to hide.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from refimpl.parallel.experts import stage_exchanges
from refimpl.parallel.pipeline.actions import format_action, step_label
from refimpl.parallel.pipeline.executor import Observer


@dataclass
class StepTime:
    """One executed step: its label (F3, B0, f5&B1, ...), kind (F, B, I, W, F&B), start, end in seconds."""

    label: str
    kind: str
    start: float
    end: float
    compute: float  # seconds of real computation inside [start, end] (the rest is the cost sleep)
    parts: tuple = ()  # F&B: ((label, start, end) of the F, of the B), run one after the other


class _Chunks:
    """One running action: its label, cost (None: not paced), all-to-alls expected, progress."""

    def __init__(self, label: str, cost: float | None, exchanges: int, now: float) -> None:
        self.label, self.cost, self.k = label, cost, exchanges
        self.j = 0  # chunks finished
        self.done = 0.0  # seconds of this action's own chunks so far (their sleeps included)
        self.compute = 0.0  # of which real computation
        self.start = now  # the current chunk's start
        self.overrun = False


class Pacing(Observer):
    """Times one executor's runs; with costs, paces them and delays their links (module docstring).

    stage_exchanges: {stage: all-to-alls per forward} (default: those of the executor's stages,
    experts.stage_exchanges). After a run: steps (StepTime list), exposed {"pipeline",
    "all_to_all"} seconds, exchanges (all-to-alls waited for), overruns, events. The running
    action's chunks are per thread (the two tasks of an overlapped F&B step each have theirs)."""

    def __init__(self, costs=None, stage_exchanges: dict | None = None, clock=time.perf_counter) -> None:
        self.costs, self.stage_exchanges, self.clock = costs, stage_exchanges, clock
        self.link_delay = float(costs.P) if costs is not None else 0.0  # P: pipeline messages
        self.a2a_delay = float(costs.A) if costs is not None else 0.0  # A: all-to-alls
        self.trailer = 1 if self.link_delay else 0  # the send time travels with each message
        self._local = threading.local()  # per task thread: the running action's _Chunks, its all-to-all's start
        self.schedule, self.t0 = None, clock()
        self._clear()

    def _clear(self) -> None:
        self.steps: list[StepTime] = []
        self.exposed = {"pipeline": 0.0, "all_to_all": 0.0}
        self.exchanges = 0
        self.overruns = 0
        self.events: list[tuple] = []
        self._chunked, self._parts, self._paced = False, {}, [0.0, False]  # the running step's (step())

    def run_started(self, executor) -> None:
        self.t0 = self.clock()
        self.schedule = executor.schedule
        if self.stage_exchanges is None:
            self.stage_exchanges = {s: stage_exchanges(stage) for s, stage in executor.stages.items()}
        self._clear()

    # --- steps and actions ----------------------------------------------------------------------
    @contextmanager
    def step(self, step):
        start = self.clock()
        self._chunked = self.costs is not None and any(self._exchanges_of(a) for a in step.parts)
        self._parts, self._paced = {}, [0.0, False]  # (label, begin, end) per action; paced compute, overrun
        yield
        compute = self.clock() - start
        if self._chunked:  # each chunk was padded; the step lasts what its chunks and waits made it
            compute = self._paced[0]
            self.overruns += int(self._paced[1])
        elif self.costs is not None:
            cost = float(self.costs.of(step))
            if compute > cost:
                self.overruns += 1
            else:
                time.sleep(cost - compute)
        end = self.clock()
        parts = tuple(self._parts[a] for a in step.parts) if len(step.parts) > 1 else ()
        self.steps.append(StepTime(step_label(self.schedule, step), step.kind, start - self.t0, end - self.t0,
                                   compute, parts))

    @contextmanager
    def action(self, action):
        """Around one action: with a cost and all-to-alls, its chunks are padded to cost/(k+1) each."""
        begin = self.clock()
        label = format_action(action, short=True)
        cost = float(getattr(self.costs, action.kind)) if self._chunked else None
        chunks = _Chunks(label, cost, self._exchanges_of(action), begin)
        previous, self._local.chunks = getattr(self._local, "chunks", None), chunks
        try:
            yield
            self._end_chunk(chunks, final=True)
        finally:
            self._local.chunks = previous
        self._paced[0] += chunks.compute
        self._paced[1] = self._paced[1] or chunks.overrun
        self._parts[action] = (label, begin - self.t0, self.clock() - self.t0)

    def _exchanges_of(self, action) -> int:
        return 0 if action.kind == "W" else self.stage_exchanges[action.stage]

    def _end_chunk(self, chunks: _Chunks, final: bool) -> None:
        now = self.clock()
        elapsed = now - chunks.start
        chunks.compute += elapsed
        if chunks.cost is not None:
            k = chunks.k
            expected = final or chunks.j < k  # (a chunk beyond the k + 1 expected gets no share)
            if expected and elapsed > chunks.cost / (k + 1):
                chunks.overrun = True
            target = chunks.cost if final else chunks.cost * min(chunks.j + 1, k) / (k + 1)
            if target - chunks.done - elapsed > 0:
                time.sleep(target - chunks.done - elapsed)
            now = self.clock()
        if chunks.k:  # the chunks of an action with all-to-alls are drawn in the compute lane
            self.events.append(("compute", f"{chunks.label} {chunks.j + 1}/{chunks.k + 1}", chunks.start - self.t0,
                                now - self.t0))
        chunks.done += now - chunks.start

    # --- waits ----------------------------------------------------------------------------------
    def all_to_all_starts(self) -> None:
        """The chunk before the all-to-all ends here (padded to its share); then it starts."""
        chunks = getattr(self._local, "chunks", None)
        if chunks is not None:
            self._end_chunk(chunks, final=False)
        self._local.started = self.clock()

    def all_to_all_wait(self, request):
        """Wait for the all-to-all, and until its start + A; the blocked time is exposed. The running
        action's next chunk starts when this returns."""
        chunks, started = getattr(self._local, "chunks", None), self._local.started
        waited = self.clock()
        result = request.wait()
        if self.a2a_delay:
            _sleep_until(started + self.a2a_delay, self.clock)
        end = self.clock()
        self.exposed["all_to_all"] += end - waited
        self.exchanges += 1
        label = f"{chunks.label} a2a {chunks.j + 1}" if chunks is not None else "a2a"
        delivered = started + self.a2a_delay if self.a2a_delay and waited >= started + self.a2a_delay else end
        self.events.append(("all_to_all", label, started - self.t0, delivered - self.t0))
        self.events.append(("wait", label, waited - self.t0, end - self.t0))
        if chunks is not None:
            chunks.j += 1
            chunks.start = end
        return result

    def stamp(self, msg) -> list:
        return [self.clock() - self.t0]  # the send time, in seconds since this rank's t0

    def receive_wait(self, request, msg):
        """Wait for a pipeline receive, then (link-delay mode) until the send time it carries last
        plus P; the blocked time is exposed."""
        label = f"{msg.kind} {msg.src_stage}->{msg.dst_stage} mb {msg.mb}"
        waited = self.clock()
        buf = request.wait()
        if self.link_delay:
            sent = float(buf[-1])
            _sleep_until(self.t0 + sent + self.link_delay, self.clock)
            self.events.append(("message", label, sent, sent + self.link_delay))
        end = self.clock()
        self.exposed["pipeline"] += end - waited
        self.events.append(("pipeline", label, waited - self.t0, end - self.t0))
        return buf


def _sleep_until(when: float, clock) -> None:
    remaining = when - clock()
    if remaining > 0:
        time.sleep(remaining)


__all__ = ["Pacing", "StepTime"]
