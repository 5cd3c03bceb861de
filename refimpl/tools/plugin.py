"""Plug-ins: a function of your own, named on the command line as MODULE:FUNCTION.

    --trainer docs/examples/flat_allreduce_trainer.py:make_trainer     (verify: refimpl/tools/verification.py)
    --schedule docs/examples/my_schedule.py:early_backward             (train, verify, schedule:
                                                                        refimpl/parallel/pipeline/schedules)
    --schedule my_package.schedules:my_schedule

MODULE is either a path to a .py file (loaded from that file, whatever the working directory's
packages; its folder goes first on sys.path, as under `python FILE.py`, so that it can import the
modules beside it) or a dotted module name, imported as `python -m` would: from the working directory
first, then PYTHONPATH and the installed packages. Every failure is one ValueError line that names
the flag and the spec: a malformed spec, a missing file, an import that fails (with its exception),
a missing or non-callable attribute. A schedule of your own is checked as it is built
(`build_plugin_schedule`); a trainer of your own by verify (verification.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from refimpl.parallel.pipeline.actions import Action, Overlapped, Schedule
from refimpl.parallel.pipeline.schedules import build
from refimpl.parallel.pipeline.validate import ScheduleError, validate

_FILES: dict = {}  # (resolved path, mtime_ns) -> module: a file is executed once, not per lookup


def is_spec(text) -> bool:
    """Whether `text` names a plug-in (MODULE:FUNCTION) rather than a built-in name."""
    return isinstance(text, str) and ":" in text


def _module_from_file(path: Path, flag: str, spec: str):
    key = (str(path.resolve()), path.stat().st_mtime_ns)
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # its sibling modules import, as they would under `python FILE.py`
        sys.path.insert(0, folder)
    if key not in _FILES:
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"{flag} {spec!r}: cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        _FILES[key] = module
    return _FILES[key]


def load_function(spec: str, flag: str, example: str):
    """FUNCTION from 'package.module:FUNCTION' or 'path/to/file.py:FUNCTION' (one clear line otherwise).

    `flag` ('--trainer', '--schedule') starts every message; `example` is a spec that works, shown
    when `spec` is malformed.
    """
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function:
        raise ValueError(f"{flag} {spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION, e.g. {example}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ValueError(f"{flag} {spec!r}: no file {module_name}")
            module = _module_from_file(path, flag, spec)
        else:
            if "" not in sys.path and "." not in sys.path:
                sys.path.insert(0, ".")  # a module in the working directory, as `python -m` would find it
            module = importlib.import_module(module_name)
    except ValueError:
        raise
    except SystemExit as exc:  # sys.exit() at import: the plug-in's failure, not the end of the run
        raise ValueError(f"{flag} {spec!r}: importing {module_name} called sys.exit({exc.code!r}); a plug-in "
                         "module defines functions and must not exit") from None
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see, in one line
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"{flag} {spec!r}: cannot import {module_name}: {type(exc).__name__}: {message}") from None
    if not hasattr(module, function):
        raise ValueError(f"{flag} {spec!r}: {module_name} has no function {function!r}")
    found = getattr(module, function)
    if not callable(found):
        shown = repr(found) if len(repr(found)) <= 40 else repr(found)[:37] + "..."
        raise ValueError(f"{flag} {spec!r}: {function!r} in {module_name} is not a function: it is "
                         f"{type(found).__name__} {shown}")
    return found


SCHEDULE_EXAMPLE = "docs/examples/my_schedule.py:early_backward"


def load_schedule_generator(spec: str):
    """The generator function that `spec` (MODULE:FUNCTION or FILE.py:FUNCTION) names."""
    return load_function(spec, "--schedule", SCHEDULE_EXAMPLE)


def build_plugin_schedule(spec: str, pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    """Call the generator `spec` names and check what it returns.

    Unlike a built-in, its result is checked as it is built: a ValueError it raises itself (its
    constraints) passes through with the spec in front; any other exception, a result that is not a
    Schedule, a Schedule for another pp or micro-batch count, or one that the validator rejects (a
    missing action, a wrong rank, a deadlock...) is a one-line ValueError that says which.
    """
    generator = load_schedule_generator(spec)
    function = spec.rpartition(":")[2]
    try:
        schedule = generator(pp, micro_batches, chunks)
    except ScheduleError as exc:  # it validated its own result: still the validator's message
        raise ScheduleError(f"--schedule {spec!r}: invalid schedule for pp={pp}, micro-batches={micro_batches}: "
                            f"{exc}") from None
    except ValueError as exc:  # its own constraints, as the built-ins raise them
        raise ValueError(f"--schedule {spec!r}: {exc}") from None
    except SystemExit as exc:  # sys.exit(0) must not pass for --help or a finished run
        raise ValueError(f"--schedule {spec!r}: {function}(pp={pp}, micro_batches={micro_batches}, chunks={chunks}) "
                         f"called sys.exit({exc.code!r}); a schedule generator returns a Schedule") from None
    except Exception as exc:  # noqa: BLE001 - the student's bug, in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"--schedule {spec!r}: {function}(pp={pp}, micro_batches={micro_batches}, chunks={chunks}) "
                         f"raised {type(exc).__name__}: {first}") from None
    if not isinstance(schedule, Schedule):
        raise ValueError(f"--schedule {spec!r}: {function} returned a {type(schedule).__name__}, not a Schedule; "
                         f"build one with make_schedule(name, pp, micro_batches, placement, ranks) "
                         f"(refimpl.parallel.pipeline)")
    _check_steps(spec, function, schedule)
    if schedule.pp != pp or schedule.micro_batches != micro_batches:
        raise ValueError(f"--schedule {spec!r}: asked for pp={pp}, micro-batches={micro_batches}, {function} returned "
                         f"a schedule for pp={schedule.pp}, micro-batches={schedule.micro_batches}")
    try:
        validate(schedule)
    except ScheduleError as exc:
        raise ScheduleError(f"--schedule {spec!r}: invalid schedule for pp={pp}, micro-batches={micro_batches}: "
                            f"{exc}") from None
    return schedule


def _check_steps(spec: str, function: str, schedule: Schedule) -> None:
    """Every rank's list holds Actions and Overlapped pairs: else one line naming the first bad step."""
    try:
        lists = [list(steps) for steps in schedule.ranks]
    except TypeError:
        raise ValueError(f"--schedule {spec!r}: {function} returned a Schedule whose ranks are "
                         f"{type(schedule.ranks).__name__}, not one list of steps per rank") from None
    for rank, steps in enumerate(lists):
        for position, step in enumerate(steps):
            if not isinstance(step, (Action, Overlapped)) or (
                    isinstance(step, Overlapped) and not all(isinstance(a, Action) for a in (step.f, step.b))):
                shown = repr(step) if len(repr(step)) <= 40 else repr(step)[:37] + "..."
                raise ValueError(f"--schedule {spec!r}: rank {rank}'s step {position} is {type(step).__name__} "
                                 f"{shown}, not an Action or an Overlapped pair of Actions (refimpl.parallel.pipeline)")


def build_executable_schedule(spec: str, pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    """build_plugin_schedule, and also runnable by the MPI executor (parallel/executor.py): its lists must
    complete with one posted receive per (source, kind) channel (validate.py, per_channel)."""
    schedule = build_plugin_schedule(spec, pp, micro_batches, chunks)
    if not validate(schedule).per_channel_ok:
        raise ScheduleError(f"--schedule {spec!r}: valid for pp={pp}, micro-batches={micro_batches}, but its lists "
                            f"deadlock with one posted receive per (source, kind) channel, the executor's receive "
                            f"policy (validate.py, per_channel): on each channel, consume the messages in the order "
                            f"they are sent")
    return schedule


def build_schedule(name: str, pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    """A built-in schedule by name, or a schedule of your own (MODULE:FUNCTION), checked."""
    if is_spec(name):
        return build_plugin_schedule(name, pp, micro_batches, chunks)
    return build(name, pp, micro_batches, chunks)


__all__ = ["is_spec", "load_function", "build_schedule", "build_plugin_schedule", "build_executable_schedule",
           "load_schedule_generator", "SCHEDULE_EXAMPLE"]
