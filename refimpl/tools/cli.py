"""Command line:
`python -m refimpl {train, verify, distance, golden, schedule, memory, consolidate, tensor-parallel, context-parallel,
predict, plan, calibrate} ...`.

Each command lives in its own module in refimpl/tools/commands/, which provides `add_arguments(parser)`
and `run(args) -> int`; this file only dispatches. Errors that come from bad input are printed as one
line (`error: ...`) with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from refimpl.backend import BackendError, set_backend
from refimpl.backend import name as backend_name
from refimpl.parallel.comm import get_world, under_mpiexec  # importing comm imports no MPI
from refimpl.tools.runtime import failure, guards, watchdog
from refimpl.tools.runtime.failure import AgreedError
from refimpl.tools.runtime.launcher import launcher_rank

COMMANDS = {
    "train": ("refimpl.tools.commands.train", "train a model (one process, or data/pipeline parallel under mpiexec)"),
    "verify": ("refimpl.tools.commands.verify", "check a distributed run against single-process training"),
    "distance": ("refimpl.tools.commands.distance",
                 "measure how far an algorithm not meant to be equal is from single-process training"),
    "golden": ("refimpl.tools.commands.golden",
               "write a golden case of single-process training, or check another framework's results against it"),
    "schedule": ("refimpl.tools.commands.schedule", "generate, validate, simulate and draw a pipeline schedule"),
    "memory": ("refimpl.tools.commands.memory", "ZeRO memory per rank: the paper's estimator and the measured ledger"),
    "consolidate": ("refimpl.tools.commands.consolidate", "merge a sharded checkpoint into one state dict (.npz)"),
    "tensor-parallel": ("refimpl.tools.commands.tensor_parallel",
                        "tensor parallelism's activation, byte and parameter formulas beside the measurement"),
    "context-parallel": ("refimpl.tools.commands.context_parallel",
                         "context parallelism's byte, saved-activation and attention-work formulas beside the "
                         "measurement"),
    "predict": ("refimpl.tools.commands.predict", "memory per GPU and step time of one configuration on a cluster"),
    "plan": ("refimpl.tools.commands.plan",
             "search the parallel configurations of a model on a cluster for the fastest"),
    "calibrate": ("refimpl.tools.commands.calibrate",
                  "measure this machine's links, GEMM rate and overheads for the cluster model"),
}


class UsageError(ValueError):
    """Bad input from the user: reported as one line, exit status 2."""




class Parser(argparse.ArgumentParser):
    """argparse, except that a bad argument is one line, `error: argument --steps: invalid int value:
    'abc' (see python -m refimpl train --help)`, exit status 2, instead of the usage text and then the
    error; under mpiexec only rank 0 prints help, and, once the MPI world of several ranks exists
    (`raise_errors`), a bad argument raises UsageError instead of exiting: the ranks then compare their
    problems before they stop (see `main`)."""

    raise_errors = False

    def _print_message(self, message, file=None):
        if launcher_rank() == 0:
            super()._print_message(message, file)

    def error(self, message):
        text = f"{message} (see {self.prog} --help)"
        if self.raise_errors:
            raise UsageError(text)
        self.exit(2, f"error: {text}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m refimpl")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        command_parser.add_argument(
            "--timeout", type=float, default=watchdog.DEFAULT_TIMEOUT_S, metavar="SECONDS",
            help="under mpiexec: abort the job, naming the ranks that did not arrive, when a rank has "
                 f"waited this long and no rank made progress (default {watchdog.DEFAULT_TIMEOUT_S:g}; 0: never)")
        command_parser.set_defaults(_run=module.run, _check=getattr(module, "check", None))
    parser.description = description(sub.choices)
    return parser


def description(commands) -> str:
    """The help's description line, from the commands that are there: it cannot forget one."""
    return f"Commands: {', '.join(commands)}."


STARTUP_ERRORS = (UsageError, ValueError, FileNotFoundError, BackendError)


def main(argv: list[str] | None = None) -> int:
    """Parse, check and run one command; its exit status.

    Under an MPI launcher the world is joined first, before any argument or environment is looked
    at, so that a problem on some ranks only (a bad flag in an MPMD launch, CuPy missing on one
    node) cannot leave the others waiting: the ranks exchange their startup problems, print each
    distinct one once with the ranks that had it, and exit 2 together. After startup, an error on
    one rank aborts the job (failure.py), a hang is ended by the watchdog (watchdog.py), and a rank
    that leaves early (sys.exit included) aborts the job too; every rank ends with one barrier.
    """
    world = _join_world()
    many = world is not None and world.size > 1
    Parser.raise_errors = many
    args, problem, help_shown = None, None, False
    try:
        args = build_parser().parse_args(argv)
        _start(args)
    except SystemExit as exc:  # --help (every rank), or an exit during startup
        if not many:
            raise
        help_shown = exc.code in (0, None)
        problem = None if help_shown else f"exited with status {exc.code} during startup"
    except STARTUP_ERRORS as exc:
        if not many:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        problem = str(exc)
    try:
        if many:
            code = _agree_on_startup(world, problem, help_shown)
            if code is not None:
                return code
        code = int(args._run(args) or 0)
    except SystemExit as exc:
        if many:  # the others would wait for this rank in their next collective
            world.abort(1, f"left the run early (SystemExit: {exc.code!r}); the job is aborted")
        raise
    except STARTUP_ERRORS as exc:
        if isinstance(exc, AgreedError):  # every rank raised it together: one message, nobody waits
            if not many or world.rank == 0:
                for line in str(exc).splitlines():
                    print(f"error: {line}", file=sys.stderr)
            return 2
        if many:
            everywhere = watchdog.active().errors_everywhere(str(exc)) if watchdog.active() else None
            if everywhere is None:  # a rank that stops alone would leave the others waiting
                world.abort(2, f"error: {exc}")
            if world.rank == 0:  # every rank met it: one message, and nobody needs MPI_Abort
                for line in failure.problems_by_rank(everywhere).splitlines():
                    print(f"error: {line}", file=sys.stderr)
            return 2
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if many:
        world.barrier(label="the end of the run")  # a rank that ended early waits here, named by the watchdog
    return code


def _join_world():
    """The MPI world when launched by mpiexec (created now, guarded, before anything can fail), else None."""
    if not under_mpiexec():
        return None
    guards.install()
    return get_world()


def _start(args) -> None:
    """Checks of the environment and the flags that every rank makes before the command runs."""
    if hasattr(args, "backend"):  # a command that computes on arrays: --backend, or $REFIMPL_BACKEND
        if args.backend is not None:
            set_backend(args.backend)
        backend_name()
    watchdog.check_timeout(args.timeout)
    if watchdog.active() is not None:
        watchdog.active().set_timeout(args.timeout)
        if not args.timeout:  # --timeout 0: no watchdog at all (its thread stops, no call is watched)
            watchdog.active().stop()
    if args._check is not None:
        args._check(args)


def _agree_on_startup(world, problem, help_shown) -> int | None:
    """Collective: exit status 2 on every rank if any rank had a startup problem (rank 0 prints
    each distinct one once, with the ranks that had it), 0 if help was shown, None to go on."""
    found = world.allgather_object((problem, help_shown))
    if any(p for p, _ in found):
        if world.rank == 0:
            for line in failure.problems_by_rank([p for p, _ in found]).splitlines():
                print(f"error: {line}", file=sys.stderr)
        return 2
    return 0 if any(h for _, h in found) else None
