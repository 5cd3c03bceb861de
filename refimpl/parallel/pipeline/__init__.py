"""Pipeline parallelism: schedules as data, and the tools that read them.

    actions.py     Action (F, B, I, W), Overlapped (F&B), Schedule, Placement (stage -> rank),
                   Message and messages_of (the point-to-point traffic an action implies),
                   the compact text form (F3s2, B0s5d1, F5s1&B1s6) and its parser
    schedules/     one generator per schedule: gpipe, 1f1b, interleaved, zb1p, zbh2, zbv,
                   dualpipe, dualpipev; `build(name, pp, micro_batches, chunks)`
    validate.py    completeness, placement, local order, message pairing, rendezvous dry run
    simulate.py    timeline per rank, makespan, idle, bubble fraction, peak activations,
                   steady-state idle; exact arithmetic (fractions)
    formulas.py    the published closed forms, and where they are exact
    render.py      text grid, SVG, PNG (matplotlib, optional), Chrome trace
                   (the `python -m refimpl schedule ...` command is refimpl/tools/commands/schedule.py)

    stage.py       the model cut into contiguous stages (GPT, MLP), balanced by layer count
    executor.py    runs one rank's list over a communicator: one posted receive per channel,
                   isend, F / B / I / W through the engine's two-half backward
                   (the trainer that runs it with data parallelism and ZeRO: parallel/trainer.py)
    overlap.py     DualPipe's overlapped F&B: two cooperative threads that switch at all-to-alls
                   (timing, pacing and tracing a run are tools, through the executor's Observer:
                   refimpl/tools/pacing.py, refimpl/tools/timeline.py)

Nothing here imports MPI: the executor runs these lists with a `comm.py` communicator that it is
given. For every action it needs: `schedule.ranks[rank]` (its program), and
`messages_of(schedule.placement, action)` (what to receive before and send after it); see
docs/pipeline_schedules.md, "For executors", and docs/pipeline_parallel.md.
"""

from .actions import (
    Action,
    Message,
    Overlapped,
    Placement,
    Schedule,
    format_action,
    format_rank,
    messages_of,
    parse_action,
    parse_rank,
    step_messages,
)
from .formulas import ClosedForm, closed_form
from .schedules import SCHEDULES, build
from .simulate import Costs, Deadlock, Timeline, simulate
from .validate import Report, ScheduleError, validate

__all__ = [
    "Action",
    "Overlapped",
    "Message",
    "Placement",
    "Schedule",
    "format_action",
    "format_rank",
    "parse_action",
    "parse_rank",
    "messages_of",
    "step_messages",
    "SCHEDULES",
    "build",
    "validate",
    "Report",
    "ScheduleError",
    "Costs",
    "Deadlock",
    "Timeline",
    "simulate",
    "ClosedForm",
    "closed_form",
]
