"""The pipeline executor: run one rank's list of steps over MPI, whatever the schedule.

A schedule (schedules/) gives every rank an ordered list of steps; a step is an action F, B, I or
W of one (stage, micro-batch), or an overlapped pair F&B. The executor is the same loop for all
eight schedules — a new schedule is a new generator, never executor code:

    post one receive on every incoming channel                       (the channel's first message)
    for step in schedule.ranks[rank]:
        for each message the step consumes:  wait for it; post the channel's next receive
        run the step's actions (F: stage forward; B: backward; I: backward with the weight half
            deferred; W: the deferred half of an earlier I; F&B: an F and a B, see overlap.py)
        isend what the step produces (activations forward, input gradients backward)
    wait for the last sends

What a step does to its data (x_in: a stage's input, a leaf Tensor with requires_grad=True;
y: its output; g_y: the gradient of y; S stages; mb a micro-batch):

    F(s, mb)   x_in = the micro-batch (s = 0) or the received activation; y = stage_s(x_in);
               s = S-1: loss_mb = Σ CE(y, targets_mb) / N_batch and y := loss_mb; else send y.
    B(s, mb)   backward(y, g_y) (g_y received; 1 for the loss): accumulates into the stage's
               parameters' .grad and leaves g_x = x_in.grad, sent to stage s-1.
    I(s, mb)   the same with defer_weight_grads=True (refimpl.autograd.engine): g_x only; the
               parameter half is kept as a WeightGradWork ...
    W(s, mb)   ... and run here. I then W equals B bit for bit, so every schedule accumulates
               exactly the gradients of single-process training (summed over micro-batches in a
               schedule-dependent order: equal up to floating-point round-off).

Messages. `messages_of(placement, action)` lists what an action receives and sends; transfers
between two stages on the same rank (the turn of a V, DualPipe's two stages) are handed over in
memory and are not messages. A message travels on a *channel*, one MPI tag per (kind, receiving
stage, direction):

    tag = (2 · direction + kind) · S + destination stage        kind: 0 activation, 1 gradient

Each stage runs its forwards (and its backwards) in micro-batch order in every schedule here, so
each channel carries its messages in the order the receiver consumes them, and MPI never lets two
messages of one (source, tag, communicator) overtake each other. The executor keeps exactly one
receive posted per channel, always the next message it will take from it; buffers are plain
arrays whose shape the stage knows in advance (`Stage.input_shape`): mpi4py's buffer API, no
pickling.

Why this cannot deadlock. Sends never block (isend); the only place a rank waits is for a
message its next step needs, and that receive is posted. With strict rendezvous semantics (a send
completes only once the matching receive is posted) a rank could still wait on a peer that waits
on it; the validator (validate.py, `per_channel=True`) runs every schedule's lists under exactly
this policy — one pre-posted receive per channel, sends posted after each step, a wait before
each step — and finds it completes for every schedule (the pipeline's `validate` report field
`per_channel_ok`); a finer channel than the validator's (source, kind) only posts more receives
earlier, which never blocks anything. Posting receives only just before each step is not enough:
DualPipe needs a look-ahead of up to 3 steps at pp = 6 and ZB-V far more (see
docs/pipeline_schedules.md). One more wait: before the backward of (s, mb) the executor completes
the send of y(s, mb), so that no backward touches an array MPI may still be reading; the
gradient that started that backward proves the receiver already has it, so this never blocks.

Overlapped F&B (overlap=True): the F and the B of a DualPipe / DualPipeV F&B step run as two
cooperative threads that hand over at every all-to-all of a mixture of experts (overlap.py), so one
micro-batch's expert-parallel communication is in flight while the other computes; without
all-to-alls (no experts), or with overlap=False, F&B runs F then B. The numbers are the same
either way, bit for bit. The experts reach the executor through their runners' hook
(ExpertParallel.all_to_all = `PipelineExecutor.all_to_all`, set by the trainer): start, give way
to the other task while the rows travel, wait.

Observers. Measuring a run, padding its steps to fixed costs (the sleep-cost mode), slowing its
links down on purpose (the link-delay mode) and drawing its trace are tools
(refimpl/tools/pacing.py and timeline.py). The executor only says *when* things happen, to the
`Observer` installed as `executor.observer` (the default one does nothing), and lets it wait for
messages and all-to-alls, so that it can measure the wait and make it last longer. One choice is
explicit here: a message can carry `observer.trailer` numbers after its array (link-delay mode:
the sender's send time), so that the receiver's observer knows when it was sent; the executor
posts receives that much longer, appends `observer.stamp(msg)` to what it sends and drops the
trailer once the message has arrived. Without an observer that asks for one, messages are the
stage's arrays exactly.

Production executors differ: F&B overlaps on separate CUDA streams (communication kernels run
while compute kernels do), messages go over NCCL on GPU streams rather than through host MPI, and a
stage's output is freed as soon as it is sent (Megatron-LM's deallocate_output_tensor).
"""

from __future__ import annotations

import math
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field

from refimpl import backend
from refimpl.autograd import engine
from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Tensor
from refimpl.parallel.comm import progress as report_progress

from .actions import Action, Message, Overlapped, Schedule, messages_of
from .overlap import Interleaver

KIND_INDEX = {"act": 0, "grad": 1}


def channel_tag(message: Message, num_stages: int) -> int:
    """The MPI tag of a message's channel: (2·direction + kind)·S + destination stage."""
    return (2 * (message.direction or 0) + KIND_INDEX[message.kind]) * num_stages + message.dst_stage


@dataclass
class RunRecord:
    """What one run of a rank's program leaves behind (cheap data; timing is an observer's)."""

    loss: float = 0.0  # Σ of this rank's micro-batch losses (last-stage ranks), in the global normalisation
    activation_bytes: dict = field(default_factory=dict)  # (stage, mb) -> bytes its F saved


class Observer:
    """What a tool may watch, and pace, in a run of the executor (this default does nothing).

    Installed as `executor.observer` (refimpl/tools/timeline.py installs one that times, paces and
    delays: tools/pacing.py). The hooks, in the order a run calls them:

        run_started(executor)             before the first receive is posted
        receive_wait(request, msg)        wait for the posted receive of pipeline message `msg` and
                                          return its buffer (trailer included)
        step(step)                        a context around one step (an Action, or an Overlapped
                                          F&B): entered once its messages have arrived, left before
                                          its sends start
        action(action)                    a context around one action of the step, inside step();
                                          in an overlapped F&B, on that action's own task thread
        all_to_all_starts()               an action is about to start a non-blocking all-to-all
        all_to_all_wait(request)          wait for it; return request.wait()'s result
        run_ended(record)                 after the last send has completed
        report()                          {field: value} the trainer adds to its pipeline report

    and, for messages: `trailer` numbers appended to every pipeline message, `stamp(msg)` their
    values at the send (see the module docstring)."""

    trailer = 0

    def run_started(self, executor: PipelineExecutor) -> None:
        pass

    def receive_wait(self, request, msg: Message):
        return request.wait()

    def step(self, step):
        return nullcontext()

    def action(self, action: Action):
        return nullcontext()

    def all_to_all_starts(self) -> None:
        pass

    def all_to_all_wait(self, request):
        return request.wait()

    def stamp(self, msg: Message) -> list:
        return []

    def run_ended(self, record: RunRecord) -> None:
        pass

    def report(self) -> dict:
        return {}


class _Channel:
    """The receives of one channel, in the order this rank consumes them; the head one is posted."""

    def __init__(self, source: int, tag: int) -> None:
        self.source, self.tag = source, tag
        self.queue: list[Message] = []  # every message of one run, in the order this rank takes them
        self.pending: deque[Message] = deque()  # during a run: those not yet taken (the head is posted)
        self.request = None  # the posted receive of pending[0]


class PipelineExecutor:
    """Runs `schedule.ranks[rank]` over `comm` (the pipeline's communicator) with the given stages.

    stages:   {stage index: Stage} for every stage this rank holds (placement.stages_of(rank)).
    overlap:  run the F&B steps' F and B interleaved at their all-to-alls (overlap.py).
    observer: what a tool installs to watch and pace the runs (Observer; the default does nothing).
    """

    def __init__(self, schedule: Schedule, rank: int, comm, stages: dict, overlap: bool = False) -> None:
        placement = schedule.placement
        missing = set(placement.stages_of(rank)) - set(stages)
        if missing:
            raise ValueError(f"rank {rank} runs stages {sorted(missing)} but was not given them")
        if comm.size != schedule.pp or comm.rank != rank:
            raise ValueError(f"the pipeline communicator has rank {comm.rank} of {comm.size}; "
                             f"the schedule needs rank {rank} of {schedule.pp}")
        self.schedule, self.rank, self.comm, self.stages = schedule, rank, comm, stages
        self.overlap = overlap
        self.observer = Observer()
        self.switches = 0  # task switches of overlapped steps in the last run
        self._interleaver = None  # that of the overlapped F&B step running now
        S = schedule.num_stages
        # Per stage: its last action that accumulates parameter gradients (B, or the W of a split one).
        last = {action.stage: action for action in schedule.actions(rank) if action.kind in ("B", "W")}
        self.last_backward = frozenset(last.values())
        # Per step: the messages it consumes and produces (local hand-overs are not messages).
        self.program = []
        self.channels: dict[tuple, _Channel] = {}
        self._channel_of: dict[Message, _Channel] = {}
        for step in schedule.ranks[rank]:
            recvs, sends = [], []
            for action in step.parts:
                r, s = messages_of(placement, action)
                recvs += r
                sends += s
            self.program.append((step, recvs, sends))
            for msg in recvs:
                key = (msg.src, channel_tag(msg, S))
                channel = self.channels.setdefault(key, _Channel(*key))
                channel.queue.append(msg)
                self._channel_of[msg] = channel

    # ------------------------------------------------------------------------------------------
    def run(self, inputs, loss_fn, x_shape: tuple, forward_context=None, loss_scale: float | None = None,
            around=None) -> RunRecord:
        """Run this rank's program once (one optimizer step's worth of micro-batches).

        inputs(mb)       the micro-batch input (token ids (b, T) or features (b, d)); asked only
                         by the rank that holds stage 0
        loss_fn(y, mb)   the micro-batch's loss Tensor (scalar) from the last stage's output
        x_shape          shape of one micro-batch input: fixes every message's shape
        forward_context  forward_context(mb) -> a context manager around every forward of mb (the
                         trainer says which rows of the global batch mb holds: dropout masks)
        loss_scale       mixed precision's S: the backward starts from loss_mb · S (the record keeps
                         the unscaled loss)
        around           around(action, last) -> a context manager around every action, or None;
                         `last` says that a B or W is its stage's last in this run: the stage's
                         gradients are then complete (the gradient sharding strategy reduces
                         them: parallel/trainer.py)
        """
        xp = backend.xp()
        record = RunRecord()
        self._inputs, self._loss_fn, self._x_shape, self._record = inputs, loss_fn, tuple(x_shape), record
        self._context = forward_context or (lambda mb: nullcontext())
        self._loss_scale = loss_scale
        self._around = around or (lambda action, last: nullcontext())
        self._inbox: dict[tuple, object] = {}  # (kind, stage, mb) -> array handed to that stage
        self._outbox: dict[tuple, object] = {}  # (kind, src stage, mb) -> array to send
        self._kept: dict[tuple, tuple] = {}  # (stage, mb) -> (x_in leaf or None, y or loss)
        self._work: dict[tuple, object] = {}  # (stage, mb) -> WeightGradWork of its I
        self._act_sends: dict[tuple, object] = {}  # (stage, mb) -> isend request of y
        self._grad_sends: list = []  # isend requests of input gradients, polled after every step
        self.switches = 0
        self.observer.run_started(self)
        for channel in self.channels.values():
            channel.pending = deque(channel.queue)
            self._post_head(channel, xp)

        for step, recvs, sends in self.program:
            for msg in recvs:
                self._take(msg, xp)
            with self.observer.step(step):
                if self.overlap and isinstance(step, Overlapped):  # F and B interleaved at their all-to-alls
                    self._interleaver = Interleaver()
                    try:
                        self._interleaver.run(lambda: self._act(step.f), lambda: self._act(step.b))
                    finally:
                        self.switches += self._interleaver.switches
                        self._interleaver = None
                else:
                    for action in step.parts:
                        self._act(action)
            report_progress()  # a step of the schedule done
            for msg in sends:
                self._send(msg)
            self._grad_sends = [r for r in self._grad_sends if not r.test()]  # let MPI progress
        for request in list(self._act_sends.values()) + self._grad_sends:
            request.wait()
        leftovers = [c for c in self.channels.values() if c.request is not None or c.pending]
        assert not leftovers and not self._kept and not self._work and not self._inbox, \
            "the program left messages, activations or weight work behind"
        self.observer.run_ended(record)
        return record

    def all_to_all(self, start):
        """A non-blocking collective inside one of this run's actions (the experts' all-to-alls,
        through ExpertParallel.all_to_all): start() starts it; inside an overlapped F&B step the
        other task runs while it travels (overlap.py); then wait for it. The observer hears it start
        and waits for it."""
        self.observer.all_to_all_starts()
        request = start()
        if self._interleaver is not None:
            self._interleaver.pause(request)
        return self.observer.all_to_all_wait(request)

    # --- messages ------------------------------------------------------------------------------
    def _shape_of(self, msg: Message) -> tuple:
        """An activation entering stage d, or the gradient of stage d's output; d is ours either way."""
        stage = self.stages[msg.dst_stage]
        return stage.input_shape(self._x_shape) if msg.kind == "act" else stage.output_shape(self._x_shape)

    def _post_head(self, channel: _Channel, xp) -> None:
        """Post the receive of the channel's next message (if any); with an observer's trailer: flat, longer."""
        channel.request = None
        if channel.pending:
            msg = channel.pending[0]
            shape = self._shape_of(msg)
            if self.observer.trailer:
                shape = (math.prod(shape) + self.observer.trailer,)
            buf = xp.empty(shape, dtype=self.stages[msg.dst_stage].dtype)
            channel.request = self.comm.irecv(buf, msg.src, channel.tag)

    def _take(self, msg: Message, xp) -> None:
        channel = self._channel_of[msg]
        assert channel.pending and channel.pending[0] == msg, f"channel order broken at {msg}"
        buf = self.observer.receive_wait(channel.request, msg)
        if self.observer.trailer:
            buf = buf[:-self.observer.trailer].reshape(self._shape_of(msg))
        channel.pending.popleft()
        self._post_head(channel, xp)  # keep one receive posted on this channel
        self._inbox[(msg.kind, msg.dst_stage, msg.mb)] = buf

    def _send(self, msg: Message) -> None:
        buf = self._outbox.pop((msg.kind, msg.src_stage, msg.mb))
        if self.observer.trailer:  # the observer's numbers travel after the array
            xp = backend.xp()
            buf = xp.concatenate([buf.reshape(-1), xp.asarray(self.observer.stamp(msg), dtype=buf.dtype)])
        request = self.comm.isend(buf, msg.dst, channel_tag(msg, self.schedule.num_stages))
        if msg.kind == "act":
            self._act_sends[(msg.src_stage, msg.mb)] = request
        else:
            self._grad_sends.append(request)

    def _hand_over(self, kind: str, src: int, dst: int, mb: int, array, direction) -> None:
        """Route an output to stage dst: in memory if this rank runs dst, else to the outbox."""
        if self.schedule.placement.rank_of(dst, direction) == self.rank:
            self._inbox[(kind, dst, mb)] = array
        else:
            self._outbox[(kind, src, mb)] = array

    # --- compute -------------------------------------------------------------------------------
    def _act(self, action: Action) -> None:
        """One action, inside the observer's context and the caller's `around` (the strategy's)."""
        with self.observer.action(action), self._around(action, action in self.last_backward):
            self._do(action)

    def _do(self, action: Action) -> None:
        if action.kind == "F":
            self._forward(action)
        elif action.kind in ("B", "I"):
            self._backward(action, split=action.kind == "I")
        else:  # W: the weight-gradient work that I deferred
            self._work.pop((action.stage, action.mb)).run()

    def _forward(self, action: Action) -> None:
        """F: run the stage on its input; hand the output on (the last stage: the loss)."""
        s, mb = action.stage, action.mb
        stage = self.stages[s]
        before = saved_tensors.live_bytes
        if stage.is_first:
            x_in = None
            with self._context(mb):
                y = stage(self._inputs(mb))
        else:
            x_in = Tensor(self._inbox.pop(("act", s, mb)), requires_grad=True)  # a leaf: its .grad goes back
            with self._context(mb):
                y = stage(x_in)
        if stage.is_last:
            loss = self._loss_fn(y, mb)
            self._record.loss += float(loss.item())
            y = loss if self._loss_scale is None else loss * self._loss_scale
        else:
            self._hand_over("act", s, s + 1, mb, y.data, action.direction)
        self._kept[(s, mb)] = (x_in, y)
        self._record.activation_bytes[(s, mb)] = saved_tensors.live_bytes - before

    def _backward(self, action: Action, split: bool) -> None:
        """B, or I with the weight gradients deferred to a later W; hand the input's gradient back."""
        s, mb = action.stage, action.mb
        x_in, y = self._kept.pop((s, mb))
        g_y = None if self.stages[s].is_last else self._inbox.pop(("grad", s, mb))  # None: d loss / d loss = 1
        sent = self._act_sends.pop((s, mb), None)
        if sent is not None:
            sent.wait()  # y's send is complete before its backward (see the module docstring)
        work = engine.backward([y], None if g_y is None else [g_y], defer_weight_grads=split)
        if work is not None:
            self._work[(s, mb)] = work
        if x_in is not None:
            if x_in.grad is None:
                raise RuntimeError(f"stage {s}: no gradient reached the stage's input for micro-batch {mb}")
            self._hand_over("grad", s, s - 1, mb, x_in.grad, action.direction)


__all__ = ["Observer", "PipelineExecutor", "RunRecord", "channel_tag"]
