"""Overlapped F&B: one micro-batch's forward and another's backward, interleaved at their communication.

DualPipe (DeepSeek-V3, arXiv 2412.19437, §3.2.1, Figure 4) pairs the forward chunk of one
micro-batch with the backward chunk of another on the same rank, and cuts each into attention,
all-to-all dispatch, experts (MLP) and all-to-all combine, so that while one chunk's all-to-all
travels the other chunk computes. refimpl does the same with two cooperative threads, of which
exactly one runs at any time:

    F task:  ... attention ─► start dispatch ─► pause ┐          ┌► wait dispatch ─► experts ─► ...
    B task:                                           └► ... combineᵀ, expertsᵀ ─► start dispatchᵀ ─► pause ┘

A task runs until it has started a non-blocking all-to-all and then `pause()`s: the other task
resumes where it paused and computes while the first one's all-to-all is in flight, until it
starts its own and pauses in turn (or finishes). Only one thread runs, and always at the same
points, so both tasks issue their collectives in the same order on every rank (MPI needs it) and
compute exactly what they would compute one after the other: with overlap on or off the numbers
are bitwise identical (tested). MPI advances a non-blocking collective only inside MPI calls, so
each switch also test()s every request in flight (explicit progress, as DDP's buckets).

Who pauses: the experts' all-to-alls (parallel/experts.py) go through their runner's
`all_to_all(start)` hook; the trainer points it at its executor's, which pauses the Interleaver of
the F&B step running now (executor.py). Without an executor, `Interleaver.all_to_all` is that hook
(tutorial 11 runs a layer's F and B so).

What a switch carries over. Two pieces of refimpl's state are global: whether operations are
recorded (autograd.grad_mode: the engine runs backward without recording, the forward records)
and which rows of the global batch are running (nn.batch_rows: dropout masks). Each task keeps
its own values: a switch saves the outgoing task's and restores the incoming one's.

Where it does not apply: steps that are not F&B, and ZeRO-3 (its gather-ahead follows one
micro-batch's module order); those run F then B. Production systems overlap on separate CUDA
streams (compute and communication kernels run at the same time); here the overlap is in the
order of operations: the hidden time is that of messages in flight while the other task computes.
Measuring that hidden time, and slowing the links down on purpose so that there is some to hide,
is a tool's job (refimpl/tools/pacing.py, through the executor's Observer).
"""

from __future__ import annotations

import threading

from refimpl.autograd import grad_mode, recording
from refimpl.nn import batch_rows


class Interleaver:
    """Runs two callables as cooperative threads: one at a time, switching at pause()."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.turn = 0  # which task may run
        self.done = [False, False]
        self.errors: list = [None, None]
        self.requests: list = []  # requests in flight (polled at every switch)
        self.switches = 0
        self._state = [None, None]  # each task's (grad mode, batch rows, recording state) while it is paused
        self._local = threading.local()

    def run(self, first, second) -> None:
        """first() and second(), interleaved; first starts. Exceptions are re-raised here."""
        state = (grad_mode.is_enabled(), batch_rows.current(), recording.state())
        self._state = [state, state]
        threads = [threading.Thread(target=self._task, args=(i, fn), daemon=True)
                   for i, fn in enumerate((first, second))]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            self._restore_state(state)
        for error in self.errors:
            if error is not None:
                raise error

    def pause(self, request=None) -> None:
        """Give way to the other task, if it has not finished: called by a task right after it
        started a non-blocking collective (`request`) whose result it needs next."""
        i = self._local.index
        if request is not None:
            self.requests.append(request)
        self.requests = [r for r in self.requests if not r.test()]  # explicit MPI progress
        if self.done[1 - i]:
            return  # the other task has finished: nothing to overlap with
        with self.condition:
            self._state[i] = (grad_mode.is_enabled(), batch_rows.current(), recording.state())
            self.turn = 1 - i
            self.switches += 1
            self.condition.notify_all()
            self.condition.wait_for(lambda: self.turn == i)
            self._restore_state(self._state[i])

    def all_to_all(self, start):
        """Start a non-blocking collective (start() -> request), give way while it travels, wait for
        it: an ExpertParallel runner's hook when this Interleaver runs its layer without an executor."""
        request = start()
        self.pause(request)
        return request.wait()

    def _task(self, i: int, fn) -> None:
        self._local.index = i
        with self.condition:
            self.condition.wait_for(lambda: self.turn == i)
            self._restore_state(self._state[i])
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - handed to run(), which re-raises it
            self.errors[i] = error
        finally:
            with self.condition:
                self.done[i] = True
                self.turn = 1 - i
                self.condition.notify_all()

    @staticmethod
    def _restore_state(state: tuple) -> None:
        grad_enabled, rows, interception = state  # (auto checkpointing intercepts a task's operations)
        grad_mode.set_enabled(grad_enabled)
        batch_rows.set_current(rows)
        recording.set_state(interception)


__all__ = ["Interleaver"]
