"""The pipeline executor: run one rank's list of steps over MPI, whatever the schedule.

A schedule (schedules/) gives every rank an ordered list of steps; a step is an action F, B, I or
W of one (stage, micro-batch), or an overlapped pair F&B. The executor is the same loop for all
eight schedules — a new schedule is a new generator, never executor code:

    post one receive on every incoming channel                       (the channel's first message)
    for step in schedule.ranks[rank]:
        for each message the step consumes:  wait for it; post the channel's next receive
        run the step's actions (F: stage forward; B: backward; I: backward with the weight half
            deferred; W: the deferred half of an earlier I), then sleep to a fixed cost if asked
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

Timing. Each step's start and end (after its inputs arrived, before its sends) are recorded
against the clock `t0` of the caller (a barrier just before the run), so that measured idle time —
makespan minus the sum of the rank's step times — can be set beside the simulator's. With `costs`
(the sleep-cost mode), each step is padded by a sleep to its fixed cost (F, B, I, W, F&B of
`simulate.Costs`, in seconds): the run then shows the schedule's own bubble rather than CPU
contention; a step whose computation alone exceeds its cost is counted in `overruns`.

Overlapped F&B (overlap=True): the F and the B of a DualPipe / DualPipeV F&B step run as two
cooperative threads that hand over at every all-to-all of a mixture of experts (overlap.py), so one
micro-batch's expert-parallel communication is in flight while the other computes; without
all-to-alls (no experts), or with overlap=False, F&B runs F then B. The numbers are the same
either way, bit for bit.

Exposed communication and the link-delay mode (overlap.Link). Every run measures the time this
rank is blocked waiting for messages: pipeline receives (`record.exposed["pipeline"]`: start-up,
bubbles and link delay) and all-to-alls (`record.exposed["all_to_all"]`). With costs.P > 0 a
pipeline message counts as delivered P seconds after its send: each message carries one extra
element, the sender's send time in seconds since its t0 (float32 or float64 like the message:
exact to well under a microsecond for runs of seconds), and the receiver's wait lasts until its own
t0 + send time + P. With costs.A > 0 an all-to-all completes no earlier than A after its start.
In sleep-cost mode an action with k all-to-alls (`stage_exchanges`: two per expert-parallel MoE
layer, in F, B and I; none in W) is k + 1 chunks of cost/(k + 1), padded at its all-to-alls, and
its step is not padded further (an F&B of such actions lasts what its F and B chunks and waits
make it: FB is not used); a step without all-to-alls is padded to its cost as before. Those are
the simulator's chunk model (simulate.run_step), so simulate(schedule, costs, exchanges=...,
overlap=...) predicts every measured wait.

Production executors differ: F&B overlaps on separate CUDA streams (communication kernels run
while compute kernels do), messages go over NCCL on GPU streams rather than through host MPI, and a
stage's output is freed as soon as it is sent (Megatron-LM's deallocate_output_tensor).
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field

from refimpl import backend
from refimpl.autograd import engine
from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Tensor
from refimpl.parallel.comm import progress as report_progress

from . import overlap as overlapping
from .actions import Action, Message, Overlapped, Schedule, format_action, messages_of, step_label
from .overlap import Interleaver, Link

KIND_INDEX = {"act": 0, "grad": 1}


def channel_tag(message: Message, num_stages: int) -> int:
    """The MPI tag of a message's channel: (2·direction + kind)·S + destination stage."""
    return (2 * (message.direction or 0) + KIND_INDEX[message.kind]) * num_stages + message.dst_stage


@dataclass
class StepTime:
    """One executed step: its label (F3, B0, f5&B1, ...), kind (F, B, I, W, F&B), start, end in seconds."""

    label: str
    kind: str
    start: float
    end: float
    compute: float  # seconds of real computation inside [start, end] (the rest is the cost sleep)
    parts: tuple = ()  # F&B: ((label, start, end) of the F, of the B), run one after the other


@dataclass
class RunRecord:
    """What one run of a rank's program measured."""

    steps: list[StepTime] = field(default_factory=list)
    loss: float = 0.0  # Σ of this rank's micro-batch losses (last-stage ranks), in the global normalisation
    activation_bytes: dict = field(default_factory=dict)  # (stage, mb) -> bytes its F saved
    overruns: int = 0  # steps (or chunks of actions with all-to-alls) whose computation exceeded their cost
    exposed: dict = field(default_factory=lambda: {"pipeline": 0.0, "all_to_all": 0.0})  # seconds blocked
    exchanges: int = 0  # all-to-alls waited for
    comm: list = field(default_factory=list)  # overlap.Link events: (lane, name, start, end)

    @property
    def busy(self) -> float:
        return sum(s.end - s.start for s in self.steps)

    @property
    def end(self) -> float:
        return self.steps[-1].end if self.steps else 0.0


def stage_exchanges(stage) -> int:
    """All-to-alls in one forward of `stage` (a backward has as many): those of its expert-parallel
    MoE layers (ExpertParallel.exchanges each: dispatch and combine)."""
    layers = getattr(stage, "layers", None)
    roots = list(layers) if layers is not None else [getattr(stage, "model", None)]
    return sum(getattr(getattr(module, "experts_runner", None), "exchanges", 0)
               for root in roots if hasattr(root, "modules") for module in root.modules())


class _Channel:
    """The receives of one channel, in the order this rank consumes them; the head one is posted."""

    def __init__(self, source: int, tag: int) -> None:
        self.source, self.tag = source, tag
        self.queue: list[Message] = []  # every message of one run, in the order this rank takes them
        self.pending: deque[Message] = deque()  # during a run: those not yet taken (the head is posted)
        self.request = None  # the posted receive of pending[0]


class PipelineExecutor:
    """Runs `schedule.ranks[rank]` over `comm` (the pipeline's communicator) with the given stages.

    stages: {stage index: Stage} for every stage this rank holds (placement.stages_of(rank)).
    costs:  None (measure the real computation) or a simulate.Costs in seconds (sleep-cost mode).
    """

    def __init__(self, schedule: Schedule, rank: int, comm, stages: dict, costs=None, overlap: bool = False) -> None:
        placement = schedule.placement
        missing = set(placement.stages_of(rank)) - set(stages)
        if missing:
            raise ValueError(f"rank {rank} runs stages {sorted(missing)} but was not given them")
        if comm.size != schedule.pp or comm.rank != rank:
            raise ValueError(f"the pipeline communicator has rank {comm.rank} of {comm.size}; "
                             f"the schedule needs rank {rank} of {schedule.pp}")
        self.schedule, self.rank, self.comm, self.stages = schedule, rank, comm, stages
        self.costs = costs
        self.link_delay = float(costs.P) if costs is not None else 0.0  # link-delay mode: see the docstring
        self.a2a_delay = float(costs.A) if costs is not None else 0.0
        self.exchanges = {s: stage_exchanges(stage) for s, stage in stages.items()}  # all-to-alls per forward
        self.overlap = overlap  # F&B steps: interleave F and B at their all-to-alls (overlap.py)
        self.switches = 0  # task switches of overlapped steps in the last run
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
            kind = "F&B" if isinstance(step, Overlapped) else step.kind
            self.program.append((step, recvs, sends, step_label(schedule, step), kind))
            for msg in recvs:
                key = (msg.src, channel_tag(msg, S))
                channel = self.channels.setdefault(key, _Channel(*key))
                channel.queue.append(msg)
                self._channel_of[msg] = channel

    # ------------------------------------------------------------------------------------------
    def run(self, inputs, loss_fn, x_shape: tuple, t0: float | None = None, forward_context=None,
            loss_scale: float | None = None, around=None) -> RunRecord:
        """Run this rank's program once (one optimizer step's worth of micro-batches).

        inputs(mb)       the micro-batch input (token ids (b, T) or features (b, d)); asked only
                         by the rank that holds stage 0
        loss_fn(y, mb)   the micro-batch's loss Tensor (scalar) from the last stage's output
        x_shape          shape of one micro-batch input: fixes every message's shape
        t0               the clock value that counts as time 0 (default: now)
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
        clock = time.perf_counter
        t0 = clock() if t0 is None else t0
        record = RunRecord()
        self._inputs, self._loss_fn, self._x_shape, self._record = inputs, loss_fn, tuple(x_shape), record
        self._context = forward_context or (lambda mb: nullcontext())
        self._loss_scale = loss_scale
        self._t0, self._link = t0, Link(t0, self.a2a_delay, clock)  # exposed waits, delays, chunks
        with overlapping.running(self._link):  # (experts.exchange finds it there)
            self._run(record, around, xp, clock, t0)
        link = self._link
        record.exposed, record.exchanges, record.comm = dict(link.exposed), link.exchanges, link.events
        return record

    def _run(self, record: RunRecord, around, xp, clock, t0: float) -> None:
        self._inbox: dict[tuple, object] = {}  # (kind, stage, mb) -> array handed to that stage
        self._outbox: dict[tuple, object] = {}  # (kind, src stage, mb) -> array to send
        self._kept: dict[tuple, tuple] = {}  # (stage, mb) -> (x_in leaf or None, y or loss)
        self._work: dict[tuple, object] = {}  # (stage, mb) -> WeightGradWork of its I
        self._act_sends: dict[tuple, object] = {}  # (stage, mb) -> isend request of y
        self._grad_sends: list = []  # isend requests of input gradients, polled after every step
        for channel in self.channels.values():
            channel.pending = deque(channel.queue)
            self._post_head(channel, xp)

        self.switches = 0
        for step, recvs, sends, label, kind in self.program:
            for msg in recvs:
                self._take(msg, xp)
            start = clock()
            parts = [None] * len(step.parts)  # (label, begin, end) of each action
            ks = [0 if action.kind == "W" else self.exchanges[action.stage] for action in step.parts]
            chunked = self.costs is not None and any(ks)  # sleep-cost mode cut at the all-to-alls
            paced = [0.0, False]  # real computation of the chunked actions, whether one overran

            def run_action(i):
                action, begin = step.parts[i], clock()
                label = format_action(action, short=True)
                cost = float(getattr(self.costs, action.kind)) if chunked else None
                with self._link.action(label, cost, ks[i]) as pacing:
                    if around is None:
                        self._do(action)
                    else:
                        with around(action, action in self.last_backward):
                            self._do(action)
                paced[0] += pacing.compute
                paced[1] = paced[1] or pacing.overrun
                parts[i] = (label, begin - t0, clock() - t0)

            if self.overlap and kind == "F&B":  # F and B interleaved at their all-to-alls (overlap.py)
                interleaver = Interleaver()
                interleaver.run(lambda: run_action(0), lambda: run_action(1))
                self.switches += interleaver.switches
            else:
                for i in range(len(step.parts)):
                    run_action(i)
            compute = clock() - start
            if chunked:  # each chunk was padded; the step lasts what its chunks and waits made it
                compute = paced[0]
                record.overruns += int(paced[1])
            elif self.costs is not None:
                cost = float(self.costs.of(step))
                if compute > cost:
                    record.overruns += 1
                else:
                    time.sleep(cost - compute)
            end = clock()
            report_progress()  # a step of the schedule done (its sleep included)
            for msg in sends:
                self._send(msg)
            record.steps.append(StepTime(label, kind, start - t0, end - t0, compute,
                                         tuple(parts) if len(parts) > 1 else ()))
            self._grad_sends = [r for r in self._grad_sends if not r.test()]  # let MPI progress
        for request in list(self._act_sends.values()) + self._grad_sends:
            request.wait()
        leftovers = [c for c in self.channels.values() if c.request is not None or c.pending]
        assert not leftovers and not self._kept and not self._work and not self._inbox, \
            "the program left messages, activations or weight work behind"

    # --- messages ------------------------------------------------------------------------------
    def _shape_of(self, msg: Message) -> tuple:
        """An activation entering stage d, or the gradient of stage d's output; d is ours either way."""
        stage = self.stages[msg.dst_stage]
        return stage.input_shape(self._x_shape) if msg.kind == "act" else stage.output_shape(self._x_shape)

    def _post_head(self, channel: _Channel, xp) -> None:
        """Post the receive of the channel's next message (if any); link-delay mode: flat, + 1 element."""
        channel.request = None
        if channel.pending:
            msg = channel.pending[0]
            shape = self._shape_of(msg)
            if self.link_delay:
                shape = (math.prod(shape) + 1,)
            buf = xp.empty(shape, dtype=self.stages[msg.dst_stage].dtype)
            channel.request = self.comm.irecv(buf, msg.src, channel.tag)

    def _take(self, msg: Message, xp) -> None:
        channel = self._channel_of[msg]
        assert channel.pending and channel.pending[0] == msg, f"channel order broken at {msg}"
        label = f"{msg.kind} {msg.src_stage}->{msg.dst_stage} mb {msg.mb}"
        if self.link_delay:  # delivered P after the send time the message carries last
            def delivery(buf):
                sent = float(buf[-1])
                return sent, sent + self.link_delay

            buf = self._link.receive(channel.request, label, delivery)
            buf = buf[:-1].reshape(self._shape_of(msg))
        else:
            buf = self._link.receive(channel.request, label)
        channel.pending.popleft()
        self._post_head(channel, xp)  # keep one receive posted on this channel
        self._inbox[(msg.kind, msg.dst_stage, msg.mb)] = buf

    def _send(self, msg: Message) -> None:
        buf = self._outbox.pop((msg.kind, msg.src_stage, msg.mb))
        if self.link_delay:  # the send time travels with the message as its last element
            xp = backend.xp()
            sent = xp.asarray([time.perf_counter() - self._t0], dtype=buf.dtype)
            buf = xp.concatenate([buf.reshape(-1), sent])
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


__all__ = ["PipelineExecutor", "RunRecord", "StepTime", "channel_tag", "replay_peak", "stage_exchanges"]
