"""Overlapped F&B: one micro-batch's forward and another's backward, interleaved at their communication.

DualPipe (DeepSeek-V3, arXiv 2412.19437, §3.2.1, Figure 4) pairs the forward chunk of one
micro-batch with the backward chunk of another on the same rank, and cuts each into attention,
all-to-all dispatch, experts (MLP) and all-to-all combine, so that while one chunk's all-to-all
travels the other chunk computes. refimpl does the same with two cooperative threads, of which
exactly one runs at any time:

    F task:  ... attention ─► start dispatch ─► pause ┐          ┌► wait dispatch ─► experts ─► ...
    B task:                                           └► ... combineᵀ, expertsᵀ ─► start dispatchᵀ ─► pause ┘

A task runs until it has started a non-blocking all-to-all (experts.py) and then `pause()`s: the
other task resumes where it paused and computes while the first one's all-to-all is in flight,
until it starts its own and pauses in turn (or finishes). Only one thread runs, and always at the
same points, so both tasks issue their collectives in the same order on every rank (MPI needs it)
and compute exactly what they would compute one after the other: with overlap on or off the
numbers are bitwise identical (tested). MPI advances a non-blocking collective only inside MPI
calls, so each switch also test()s every request in flight (explicit progress, as DDP's buckets).

What a switch carries over. Three pieces of refimpl's state are global: whether operations are
recorded (autograd.grad_mode: the engine runs backward without recording, the forward records),
which rows of the global batch are running (nn.batch_rows: dropout masks), and the pause points'
own bookkeeping. Each task keeps its own values: a switch saves the outgoing task's and restores
the incoming one's.

Where it does not apply: steps that are not F&B, and ZeRO-3 (its gather-ahead follows one
micro-batch's module order); those run F then B. Production systems overlap on separate CUDA
streams (compute and communication kernels run at the same time); here the overlap is in the
order of operations: the hidden time is that of messages in flight while the other task computes.

Exposed communication, link delays and chunk costs (`Link`, one per executor run). On one node
MPI delivers through shared memory almost at once, so little can be hidden; the executor's
link-delay mode makes the wire slow on purpose, exactly:

    all-to-all  (costs.A)  an exchange counts as complete A after it was started: its wait
                           (experts.exchange) ends no earlier than start + A. The other task's
                           chunk in between hides that much of it.
    pipeline    (costs.P)  a message counts as delivered P after it was sent: the sender appends
                           its send time (seconds since its t0) to the message as one extra
                           element, and the receiver's wait ends no earlier than send time + P
                           (executor.py). The ranks' t0 are aligned by the barrier before the run.

Exposed communication is the wall time a rank is blocked: in the wait of a pipeline receive
(`exposed["pipeline"]`, which also counts waiting for the sender's computation: start-up and
bubbles) and in the wait of an all-to-all (`exposed["all_to_all"]`), with or without delays.

In sleep-cost mode the compute of an action with k all-to-alls is cut into k + 1 equal chunks,
each padded by a sleep before the next all-to-all starts (`boundary`) and at the action's end,
so that a delayed all-to-all overlaps the other task's chunk as in the simulator's chunk model
(simulate.py). The padding is cumulative: chunk j ends at (j+1)/(k+1) of the action's cost in its
own compute time (waits and the other task's chunks excluded), so an oversleep is taken back by
the next chunk. A chunk whose computation alone exceeds its share is an overrun.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from refimpl.autograd import grad_mode
from refimpl.nn import batch_rows

_active: "Interleaver | None" = None  # the interleaver of the F&B step running now, if any
_link: "Link | None" = None  # the Link of the executor run in progress, if any


def pause(request=None) -> None:
    """Give way to the other task of an overlapped F&B step, if one is running (else nothing):
    called right after starting a non-blocking collective whose result this task needs next."""
    if _active is not None:
        _active.pause(request)


class Interleaver:
    """Runs two callables as cooperative threads: one at a time, switching at pause()."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.turn = 0  # which task may run
        self.done = [False, False]
        self.errors: list = [None, None]
        self.requests: list = []  # requests in flight (polled at every switch)
        self.switches = 0
        self._state = [None, None]  # each task's (grad mode, batch rows) while it is paused
        self._local = threading.local()

    def run(self, first, second) -> None:
        """first() and second(), interleaved; first starts. Exceptions are re-raised here."""
        global _active
        previous, _active = _active, self
        state = (grad_mode._enabled, batch_rows.current())
        self._state = [state, state]
        threads = [threading.Thread(target=self._task, args=(i, fn), daemon=True) for i, fn in enumerate((first, second))]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            _active = previous
            grad_mode._enabled, batch_rows._current = state
        for error in self.errors:
            if error is not None:
                raise error

    def _task(self, i: int, fn) -> None:
        self._local.index = i
        with self.condition:
            self.condition.wait_for(lambda: self.turn == i)
            self._restore(i)
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - handed to run(), which re-raises it
            self.errors[i] = error
        finally:
            with self.condition:
                self.done[i] = True
                self.turn = 1 - i
                self.condition.notify_all()

    def pause(self, request=None) -> None:
        i = self._local.index
        if request is not None:
            self.requests.append(request)
        self.requests = [r for r in self.requests if not r.test()]  # explicit MPI progress
        if self.done[1 - i]:
            return  # the other task has finished: nothing to overlap with
        with self.condition:
            self._state[i] = (grad_mode._enabled, batch_rows.current())
            self.turn = 1 - i
            self.switches += 1
            self.condition.notify_all()
            self.condition.wait_for(lambda: self.turn == i)
            self._restore(i)

    def _restore(self, i: int) -> None:
        grad_mode._enabled, batch_rows._current = self._state[i]


class _Pacing:
    """One action's chunks: its label, cost (None: not paced), all-to-alls expected, progress."""

    def __init__(self, label: str, cost: float | None, exchanges: int, now: float) -> None:
        self.label, self.cost, self.k = label, cost, exchanges
        self.j = 0  # chunks finished
        self.done = 0.0  # seconds of this action's own chunks so far (their sleeps included)
        self.compute = 0.0  # of which real computation
        self.start = now  # the current chunk's start
        self.overrun = False


class Link:
    """The communication of one executor run: delays, chunk pacing, exposed waits, events.

    t0: the run's time 0 (perf_counter); a2a_delay: costs.A in seconds (0: none). Events are
    (lane, name, start, end) in seconds since t0; lanes: "compute" (a chunk of an action with
    all-to-alls), "all_to_all" (an exchange in flight), "wait" (blocked on an exchange: exposed),
    "message" (a pipeline message in flight, link-delay mode), "pipeline" (blocked on a receive)."""

    def __init__(self, t0: float, a2a_delay: float = 0.0, clock=time.perf_counter) -> None:
        self.t0, self.a2a_delay, self.clock = t0, float(a2a_delay), clock
        self.exposed = {"pipeline": 0.0, "all_to_all": 0.0}
        self.exchanges = 0  # all-to-alls waited for
        self.events: list[tuple] = []
        self._local = threading.local()  # the running task's _Pacing

    # --- the running action ---------------------------------------------------------------------
    @contextmanager
    def action(self, label: str, cost: float | None = None, exchanges: int = 0):
        """Around one action: with a cost, its chunks are padded to cost/(k+1) each (k = exchanges).
        Yields the _Pacing, whose .compute and .overrun the caller reads afterwards."""
        pacing = _Pacing(label, cost, exchanges, self.clock())
        previous, self._local.pacing = getattr(self._local, "pacing", None), pacing
        try:
            yield pacing
            self._end_chunk(pacing, final=True)
        finally:
            self._local.pacing = previous

    def boundary(self) -> None:
        """An all-to-all is about to start: the chunk before it ends (padded to its share)."""
        pacing = getattr(self._local, "pacing", None)
        if pacing is not None:
            self._end_chunk(pacing, final=False)

    def _end_chunk(self, pacing: _Pacing, final: bool) -> None:
        now = self.clock()
        elapsed = now - pacing.start
        pacing.compute += elapsed
        if pacing.cost is not None:
            k = pacing.k
            expected = final or pacing.j < k  # (a chunk beyond the k + 1 expected gets no share)
            if expected and elapsed > pacing.cost / (k + 1):
                pacing.overrun = True
            target = pacing.cost if final else pacing.cost * min(pacing.j + 1, k) / (k + 1)
            if target - pacing.done - elapsed > 0:
                time.sleep(target - pacing.done - elapsed)
            now = self.clock()
        if pacing.k:  # the chunks of an action with all-to-alls are drawn in the compute lane
            self.events.append(("compute", f"{pacing.label} {pacing.j + 1}/{pacing.k + 1}", pacing.start - self.t0,
                                now - self.t0))
        pacing.done += now - pacing.start

    # --- waits ----------------------------------------------------------------------------------
    def complete(self, request, started: float):
        """Wait for an all-to-all started at `started`, and until started + A; the blocked time is
        exposed. The running action's next chunk starts when this returns."""
        waited = self.clock()
        result = request.wait()
        if self.a2a_delay:
            _sleep_until(started + self.a2a_delay, self.clock)
        end = self.clock()
        self.exposed["all_to_all"] += end - waited
        self.exchanges += 1
        pacing = getattr(self._local, "pacing", None)
        label = f"{pacing.label} a2a {pacing.j + 1}" if pacing is not None else "a2a"
        delivered = started + self.a2a_delay if self.a2a_delay and waited >= started + self.a2a_delay else end
        self.events.append(("all_to_all", label, started - self.t0, delivered - self.t0))
        self.events.append(("wait", label, waited - self.t0, end - self.t0))
        if pacing is not None:
            pacing.j += 1
            pacing.start = end
        return result

    def receive(self, request, label: str, delivery=None):
        """Wait for a pipeline receive, then (link-delay mode) until delivery(buffer) seconds after
        t0 — the message's send time plus P; the blocked time is exposed."""
        waited = self.clock()
        buf = request.wait()
        if delivery is not None:
            sent, due = delivery(buf)
            _sleep_until(self.t0 + due, self.clock)
            self.events.append(("message", label, sent, due))
        end = self.clock()
        self.exposed["pipeline"] += end - waited
        self.events.append(("pipeline", label, waited - self.t0, end - self.t0))
        return buf


def _sleep_until(when: float, clock) -> None:
    remaining = when - clock()
    if remaining > 0:
        time.sleep(remaining)


def link() -> "Link | None":
    """The Link of the executor run in progress (None outside one)."""
    return _link


@contextmanager
def running(link_: Link):
    """Make `link_` the current Link for the duration of an executor run."""
    global _link
    previous, _link = _link, link_
    try:
        yield link_
    finally:
        _link = previous


__all__ = ["Interleaver", "Link", "link", "pause", "running"]
