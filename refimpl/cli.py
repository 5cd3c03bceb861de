"""Command line: `python -m refimpl {train, verify, schedule, memory, consolidate} ...`.

Each command lives in its own module, which provides `add_arguments(parser)` and
`run(args) -> int`; this file only dispatches. Errors that come from bad input are printed as one
line (`error: ...`) with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from refimpl.backend import BackendError, set_backend

COMMANDS = {
    "train": ("refimpl.train", "train a model (one process, or data/pipeline parallel under mpiexec)"),
    "verify": ("refimpl.verify", "check a distributed run against single-process training"),
    "schedule": ("refimpl.parallel.pipeline.command", "generate, validate, simulate and draw a pipeline schedule"),
    "memory": ("refimpl.memory_command", "ZeRO memory per rank: the paper's estimator and the measured ledger"),
    "consolidate": ("refimpl.parallel.zero.checkpoint", "merge a sharded checkpoint into one state dict (.npz)"),
}


class UsageError(ValueError):
    """Bad input from the user: reported as one line, exit status 2."""


RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")  # set by mpiexec


class Parser(argparse.ArgumentParser):
    """argparse, except that under mpiexec only rank 0 prints usage, help and argument errors.

    Every rank parses the same command line, so every rank fails (exit status 2) or prints help
    alike; one copy of the message is enough. No MPI is involved: the rank is read from the
    launcher's environment, before any communicator exists.
    """

    def _print_message(self, message, file=None):
        rank = next((os.environ[name] for name in RANK_VARIABLES if name in os.environ), "0")
        if rank == "0":
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m refimpl")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            found = importlib.util.find_spec(module_name) is not None
        except ModuleNotFoundError:  # its parent package is not there either
            found = False
        if not found:
            continue  # a capability that has not landed yet
        module = importlib.import_module(module_name)
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    parser.description = description(sub.choices)
    return parser


def description(commands) -> str:
    """The help's description line, from the commands that are there: it cannot forget one."""
    return f"Commands: {', '.join(commands)}."


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "backend", None) is not None:  # --backend, for every command that has it
            set_backend(args.backend)
        return int(args._run(args) or 0)
    except (UsageError, ValueError, FileNotFoundError, BackendError) as exc:
        from refimpl.parallel.comm import existing_world  # noqa: PLC0415 - never creates a world
        from refimpl.parallel.failure import AgreedError  # noqa: PLC0415

        world = existing_world()
        if isinstance(exc, AgreedError):  # every rank raised it together: one message, nobody waits
            if world is None or world.rank == 0:
                print(f"error: {exc}", file=sys.stderr)
            return 2
        if world is not None and world.size > 1:
            world.abort(2, f"error: {exc}")  # a rank that stops alone would leave the others waiting
        print(f"error: {exc}", file=sys.stderr)
        return 2
