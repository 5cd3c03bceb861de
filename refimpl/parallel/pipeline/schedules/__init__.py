"""The schedule generators, one file each, by command-line name.

Every generator is a pure function `(pp, micro_batches, chunks=None) -> Schedule` that checks its
constraints and raises ValueError with a one-line message saying what is wrong and how to fix it.

    gpipe        GPipe                       pp stages
    1f1b         1F1B (PipeDream-flush)      pp stages
    interleaved  interleaved 1F1B            chunks * pp stages, stage s on rank s mod pp
    zb1p         ZB-H1                       pp stages, backward split into I and W
    zbh2         ZB-H2                       pp stages, I and W, more warm-up forwards
    zbv          ZB-V                        2 pp stages in a V, I and W
    dualpipe     DualPipe                    pp stages, each on two ranks, two directions
    dualpipev    DualPipeV                   2 pp stages in a V, DualPipe's program

A schedule of your own plugs in by name wherever a built-in one does (`build`, the `schedule`,
`train` and `verify` commands, `verify --sweep`): MODULE:FUNCTION or path/to/file.py:FUNCTION, a
generator with the built-ins' signature (the loader is refimpl/tools/plugin.py's, shared with
`verify --trainer`). Write it from the public API of refimpl.parallel.pipeline: Action, Overlapped,
Placement (or linear_placement, looped_placement, v_placement, dual_placement), make_schedule, and
check_counts / fixed_chunks for its constraints; docs/capstone.md works one example through. Unlike
a built-in, its result is checked as it is built: a ValueError it raises itself (its constraints)
passes through with the spec in front; any other exception, a result that is not a Schedule, a
Schedule for another pp or micro-batch count, or one that the validator rejects (validate.py:
a missing action, a wrong rank, a deadlock...) is a one-line ValueError that says which.
"""

from __future__ import annotations

from refimpl.tools.plugin import is_spec, load_function

from ..actions import (
    Action,
    Overlapped,
    Placement,
    Schedule,
    dual_placement,
    linear_placement,
    looped_placement,
    make_schedule,
    v_placement,
)
from .common import check_counts, fixed_chunks
from ..validate import ScheduleError, validate
from .dualpipe import dualpipe
from .dualpipev import dualpipev
from .gpipe import gpipe
from .interleaved import interleaved
from .one_f_one_b import one_f_one_b
from .zb1p import zb1p
from .zbh2 import zbh2
from .zbv import zbv

SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb1p": zb1p,
    "zbh2": zbh2,
    "zbv": zbv,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
}


EXAMPLE = "docs/examples/my_schedule.py:early_backward"


def is_plugin(name) -> bool:
    """Whether `name` is a schedule of your own (MODULE:FUNCTION) rather than a built-in name."""
    return is_spec(name)


def load_generator(spec: str):
    """The generator function that `spec` (MODULE:FUNCTION or FILE.py:FUNCTION) names."""
    return load_function(spec, "--schedule", EXAMPLE)


def build_plugin(spec: str, pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    """Call the generator `spec` names and check what it returns (see the module docstring)."""
    generator = load_generator(spec)
    function = spec.rpartition(":")[2]
    try:
        schedule = generator(pp, micro_batches, chunks)
    except ScheduleError as exc:  # it validated its own result: still the validator's message
        raise ScheduleError(f"--schedule {spec!r}: invalid schedule for pp={pp}, micro-batches={micro_batches}: "
                            f"{exc}") from None
    except ValueError as exc:  # its own constraints, as the built-ins raise them
        raise ValueError(f"--schedule {spec!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the student's bug, in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"--schedule {spec!r}: {function}(pp={pp}, micro_batches={micro_batches}, chunks={chunks}) "
                         f"raised {type(exc).__name__}: {first}") from None
    if not isinstance(schedule, Schedule):
        raise ValueError(f"--schedule {spec!r}: {function} returned a {type(schedule).__name__}, not a Schedule; "
                         f"build one with make_schedule(name, pp, micro_batches, placement, ranks) "
                         f"(refimpl.parallel.pipeline)")
    if schedule.pp != pp or schedule.micro_batches != micro_batches:
        raise ValueError(f"--schedule {spec!r}: asked for pp={pp}, micro-batches={micro_batches}, {function} returned "
                         f"a schedule for pp={schedule.pp}, micro-batches={schedule.micro_batches}")
    try:
        validate(schedule)
    except ScheduleError as exc:
        raise ScheduleError(f"--schedule {spec!r}: invalid schedule for pp={pp}, micro-batches={micro_batches}: "
                            f"{exc}") from None
    return schedule


def build_executable(spec: str, pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    """build_plugin, and also runnable by the MPI executor (parallel/executor.py): its lists must
    complete with one posted receive per (source, kind) channel (validate.py, per_channel)."""
    schedule = build_plugin(spec, pp, micro_batches, chunks)
    if not validate(schedule).per_channel_ok:
        raise ScheduleError(f"--schedule {spec!r}: valid for pp={pp}, micro-batches={micro_batches}, but its lists "
                            f"deadlock with one posted receive per (source, kind) channel, the executor's receive "
                            f"policy (validate.py, per_channel): on each channel, consume the messages in the order "
                            f"they are sent")
    return schedule


def build(name: str, pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    """The schedule `name` (a built-in, or MODULE:FUNCTION) for `pp` ranks and `micro_batches` micro-batches."""
    if is_plugin(name):
        return build_plugin(name, pp, micro_batches, chunks)
    try:
        generator = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}, or MODULE:FUNCTION "
                         f"for a schedule of your own") from None
    return generator(pp, micro_batches, chunks)


# the building blocks of a generator of your own, importable from here (docs/capstone.md)
__all__ = [
    "SCHEDULES", "build", "build_plugin", "build_executable", "is_plugin", "load_generator",
    "Action", "Overlapped", "Placement", "Schedule", "make_schedule",
    "linear_placement", "looped_placement", "v_placement", "dual_placement", "check_counts", "fixed_chunks",
]
