"""Pipeline schedules as plain data: actions, where stages live, and the messages they imply.

A pipeline cuts a model into `num_stages` stages that run in data-flow order 0, 1, ..., S-1 (the
loss is computed at the end of stage S-1). A *schedule* assigns the work of training on
`micro_batches` micro-batches to `pp` ranks: one ordered list of *steps* per rank. Everything
else in this package (the validator, the timing simulator, the renderer, and the MPI executor)
reads these lists and nothing else.

The unit of work is an `Action`:

    kind       F  forward of one stage for one micro-batch
               B  full backward (input gradient and weight gradient together)
               I  input-gradient half of the backward (on the critical path: the previous stage
                  waits for it)
               W  weight-gradient half (nobody waits for it; can be deferred to fill idle time)
    stage      global stage index in data-flow order (not a rank's local chunk number)
    mb         micro-batch index, 0..micro_batches-1 over the whole schedule
    direction  DualPipe only: 0 or 1, which of the two pipelines the micro-batch travels through

A step is an `Action` or an `Overlapped` pair F&B: a forward and a backward of different
micro-batches run together on one rank, so that one's communication hides behind the other's
computation (DeepSeek-V3, arXiv 2412.19437, section 3.2.1). `step.parts` gives the actions of a
step in the order they logically start (the F, then the B).

Compact text form (`format_action`, `parse_action`): kind, micro-batch, then optional stage and
direction; a pair joins two actions with `&`:

    F3         forward of micro-batch 3 (stage left to context, as in the pictures)
    F3s2       forward of micro-batch 3 at stage 2
    B0s5d1     full backward of micro-batch 0 at stage 5, DualPipe direction 1
    F5s1d0&B1s6d1

Where stages live is a `Placement`: a table rank = table[direction][stage]. Every schedule except
DualPipe has one direction; in DualPipe each stage lives on two ranks, one per direction.

Messages: a forward at stage s receives the activation from stage s-1 and sends its output to
stage s+1; a backward (B or I) at stage s receives the gradient from stage s+1 and sends the
gradient of its input to stage s-1; W communicates nothing. A transfer between two stages on
the same rank (the turn of a V) is local and is not a message. `messages_of(schedule, action)`
lists both sides for one action.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

KINDS = ("F", "B", "I", "W")
BACKWARD_KINDS = ("B", "I")  # the backward halves that carry a gradient to the previous stage


@dataclass(frozen=True)
class Action:
    """One unit of work: `kind` of `stage` for micro-batch `mb` (see the module docstring)."""

    kind: str
    stage: int
    mb: int
    direction: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"action kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"stage and micro-batch must be >= 0; got stage {self.stage}, mb {self.mb}")
        if self.direction not in (None, 0, 1):
            raise ValueError(f"direction must be None, 0 or 1; got {self.direction!r}")

    @property
    def parts(self) -> tuple[Action, ...]:
        return (self,)

    def __str__(self) -> str:
        return format_action(self)


@dataclass(frozen=True)
class Overlapped:
    """An F&B step: forward `f` and full backward `b` of different micro-batches, run together."""

    f: Action
    b: Action
    kind: str = field(default="F&B", init=False)

    def __post_init__(self):
        if self.f.kind != "F" or self.b.kind != "B":
            raise ValueError(f"an overlapped pair is a forward and a full backward; got {self.f.kind}&{self.b.kind}")

    @property
    def parts(self) -> tuple[Action, Action]:
        return (self.f, self.b)

    def __str__(self) -> str:
        return format_action(self)


Step = Action | Overlapped


# --------------------------------------------------------------------------------------------
# Text form
# --------------------------------------------------------------------------------------------

_ACTION_RE = re.compile(r"^([FBIW])(\d+)(?:s(\d+))?(?:d([01]))?$")


def format_action(step: Step, short: bool = False) -> str:
    """`F3s2` (or `F3` with short=True); a pair is `F5s1&B1s6`; a direction adds `d0`/`d1`."""
    if isinstance(step, Overlapped):
        return format_action(step.f, short) + "&" + format_action(step.b, short)
    text = f"{step.kind}{step.mb}"
    if not short:
        text += f"s{step.stage}"
        if step.direction is not None:
            text += f"d{step.direction}"
    return text


def action_label(schedule: Schedule, action: Action) -> str:
    """Short label: kind and micro-batch, marked for a rank's second (or c-th) stage."""
    placement = schedule.placement
    rank = placement.rank_of(action.stage, action.direction)
    own = placement.stages_of(rank)
    label = f"{action.kind}{action.mb}"
    if action.direction is not None:  # DualPipe: the direction tells the two copies apart
        return label.lower() if action.direction == 1 else label
    if len(own) == 2 and schedule.chunks == 2:
        return label.lower() if action.stage == own[1] else label
    if len(own) > 1:
        return f"{label}.{own.index(action.stage)}"
    return label


def step_label(schedule: Schedule, step: Step) -> str:
    return "&".join(action_label(schedule, a) for a in step.parts)


def parse_action(text: str, stage: int | None = None, direction: int | None = None) -> Step:
    """Inverse of `format_action`. `stage`/`direction` fill in what a short form leaves out."""
    text = text.strip()
    if "&" in text:
        f_text, _, b_text = text.partition("&")
        f, b = parse_action(f_text, stage, direction), parse_action(b_text, stage, direction)
        if not isinstance(f, Action) or not isinstance(b, Action):
            raise ValueError(f"cannot parse {text!r}: a pair joins exactly two actions")
        return Overlapped(f, b)
    match = _ACTION_RE.match(text)
    if match is None:
        raise ValueError(f"cannot parse action {text!r}: expected e.g. F3, F3s2, B0s5d1 or F5s1&B1s6")
    kind, mb, stage_text, dir_text = match.groups()
    if stage_text is None and stage is None:
        raise ValueError(f"action {text!r} names no stage: write it as {text}s<stage> or pass stage=")
    return Action(
        kind,
        int(stage_text) if stage_text is not None else stage,
        int(mb),
        int(dir_text) if dir_text is not None else direction,
    )


def format_rank(steps, short: bool = False) -> str:
    """One rank's program as space-separated steps."""
    return " ".join(format_action(step, short) for step in steps)


def parse_rank(text: str) -> list[Step]:
    return [parse_action(token) for token in text.split()]


# --------------------------------------------------------------------------------------------
# Placement: which rank runs which stage
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """rank = table[direction][stage]. One direction except for DualPipe, which has two."""

    table: tuple[tuple[int, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.table[0])

    @property
    def num_directions(self) -> int:
        return len(self.table)

    def rank_of(self, stage: int, direction: int | None = None) -> int:
        """The rank that runs `stage` (for DualPipe: in pipeline `direction`)."""
        return self.table[direction or 0][stage]

    def ranks_of(self, stage: int) -> tuple[int, ...]:
        """Every rank that holds a copy of `stage` (two for DualPipe, one otherwise)."""
        return tuple(sorted({row[stage] for row in self.table}))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages whose parameters `rank` holds, in data-flow order."""
        return tuple(sorted({s for row in self.table for s, r in enumerate(row) if r == rank}))

    def neighbours(self, stage: int, direction: int | None = None) -> tuple[int | None, int | None]:
        """(rank of stage-1, rank of stage+1) in the same direction; None past either end."""
        prev_rank = self.rank_of(stage - 1, direction) if stage > 0 else None
        next_rank = self.rank_of(stage + 1, direction) if stage + 1 < self.num_stages else None
        return prev_rank, next_rank


def linear_placement(pp: int) -> Placement:
    """Stage s on rank s (GPipe, 1F1B, ZB-H1, ZB-H2)."""
    return Placement((tuple(range(pp)),))


def looped_placement(pp: int, chunks: int) -> Placement:
    """Stage s on rank s mod pp: chunk c of rank r is stage c*pp + r (interleaved 1F1B)."""
    return Placement((tuple(s % pp for s in range(pp * chunks)),))


def v_placement(pp: int) -> Placement:
    """2*pp stages in a V: stage s on rank s for s < pp, else on rank 2*pp-1-s (ZB-V, DualPipeV)."""
    return Placement((tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)),))


def dual_placement(pp: int) -> Placement:
    """DualPipe: direction 0 runs stage s on rank s, direction 1 runs stage s on rank pp-1-s."""
    return Placement((tuple(range(pp)), tuple(pp - 1 - s for s in range(pp))))


# --------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """One ordered list of steps per rank, and where every stage lives."""

    name: str
    pp: int
    micro_batches: int
    placement: Placement
    ranks: tuple[tuple[Step, ...], ...]
    chunks: int = 1  # stages per rank per direction (interleaved: v; V shapes: 2)

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def actions(self, rank: int) -> Iterator[Action]:
        """Every action of `rank` in order, a pair contributing its F then its B."""
        for step in self.ranks[rank]:
            yield from step.parts

    def parameter_share(self, rank: int) -> float:
        """Parameters held by `rank`, in units of 1/pp of the model (1.0 = one 1F1B rank)."""
        return len(self.placement.stages_of(rank)) * self.pp / self.num_stages

    def text(self, short: bool = False) -> list[str]:
        return [format_rank(steps, short) for steps in self.ranks]


def make_schedule(name: str, pp: int, micro_batches: int, placement: Placement, ranks, chunks: int = 1) -> Schedule:
    return Schedule(name, pp, micro_batches, placement, tuple(tuple(r) for r in ranks), chunks)


# --------------------------------------------------------------------------------------------
# Point-to-point messages implied by an action
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One point-to-point transfer: `kind` 'act' (forward activation) or 'grad' (its gradient)."""

    kind: str
    src: int
    dst: int
    src_stage: int
    dst_stage: int
    mb: int
    direction: int | None = None

    @property
    def key(self) -> tuple:
        """What identifies a message on both sides (an MPI executor can derive a tag from it)."""
        return (self.kind, self.src_stage, self.dst_stage, self.mb, self.direction)


def messages_of(placement: Placement, action: Action) -> tuple[list[Message], list[Message]]:
    """(receives before `action` runs, sends after it) for one action; local transfers omitted."""
    recvs: list[Message] = []
    sends: list[Message] = []
    if action.kind == "W":
        return recvs, sends
    here = placement.rank_of(action.stage, action.direction)
    prev_rank, next_rank = placement.neighbours(action.stage, action.direction)
    s, m, d = action.stage, action.mb, action.direction
    if action.kind == "F":
        if prev_rank is not None and prev_rank != here:
            recvs.append(Message("act", prev_rank, here, s - 1, s, m, d))
        if next_rank is not None and next_rank != here:
            sends.append(Message("act", here, next_rank, s, s + 1, m, d))
    else:  # B or I: gradient flows from stage s+1 back to stage s-1
        if next_rank is not None and next_rank != here:
            recvs.append(Message("grad", next_rank, here, s + 1, s, m, d))
        if prev_rank is not None and prev_rank != here:
            sends.append(Message("grad", here, prev_rank, s, s - 1, m, d))
    return recvs, sends


def step_messages(placement: Placement, step: Step) -> tuple[list[Message], list[Message]]:
    """Receives and sends of a whole step (a pair receives both inputs before it runs)."""
    recvs: list[Message] = []
    sends: list[Message] = []
    for action in step.parts:
        r, s = messages_of(placement, action)
        recvs += r
        sends += s
    return recvs, sends
