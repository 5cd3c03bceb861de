"""A failure on any rank ends every rank, with a message that names the rank and the error.

Why this is needed. When one rank of an MPI job raises and the others are waiting in a collective
(or a receive), the others wait forever: Python's normal exit runs MPI_Finalize, which does not
tell the other ranks anything. The cure is MPI_Abort, which asks the process manager (hydra, for
MPICH's `mpiexec`) to kill every rank of the job; `mpiexec` then exits with the abort code.

What `install` does, once, when the MPI world communicator is created (comm.get_world):
  * sys.excepthook and threading.excepthook print, to stderr,
        [rank R] ErrorType: message
    preceded by the traceback with every line prefixed "[rank R] " -- except for bad input
    (ValueError and its subclasses, such as the CLI's UsageError), which prints that one line
    only -- and then call MPI_Abort with exit code 2 for bad input, 130 for Ctrl-C, 1 otherwise.
  * MPICH then adds one line of its own, "Abort(2) on node 1 (rank 1 in comm 0): application
    called MPI_Abort(MPI_COMM_WORLD, 2) - process 1", and mpiexec exits with the same code.

Launch line that guarantees it (MPICH wheel, hydra process manager; no flag is needed, and
oversubscription -- more ranks than cores -- works as is):
    mpiexec -n 4 python -m refimpl train ...
Every rank that raises reports itself; the first one aborts the job within a fraction of a second.

Limits. An exception is reported only if nothing catches it. A rank that *exits* (sys.exit, or
returning an error code from main) while the others wait in a collective is not an exception:
call `comm.abort(code, message)` instead (or `existing_world()` from the CLI's error branch).
Bad input that all ranks check together (`agree`: the command line and environment at startup, a
sharded checkpoint to resume from, a --save-dir to write to) raises `AgreedError` on every rank at
once; nobody waits, so the CLI prints each distinct problem once, with the ranks that had it.
A rank killed by a signal is cleaned up by hydra itself ("BAD TERMINATION ...").
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable

BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError,)

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_ERROR = 1

_installed_rank: int | None = None


class AgreedError(ValueError):
    """Bad input that every rank found together (after exchanging what each rank saw), and raises
    alike: nobody is left waiting, so the CLI prints it once, from rank 0, and every rank exits 2
    without MPI_Abort. Raise it only from code that all ranks run collectively."""


def agree(comm, problem: str | None) -> None:
    """Collective: raise AgreedError on every rank if any rank has a problem; return on every rank
    otherwise. The error holds each distinct problem once (`problems_by_rank`)."""
    problems = problems_by_rank(comm.allgather_object(problem))
    if problems:
        raise AgreedError(problems)


def problems_by_rank(found: list) -> str | None:
    """Each distinct problem once, one per line, with the ranks that had it unless all did
    ("shard 2 is corrupt (on ranks 1, 2)"); None when no rank had one. found: by rank."""
    ranks_by_problem: dict[str, list[int]] = {}
    for rank, text in enumerate(found):
        if text:
            ranks_by_problem.setdefault(text, []).append(rank)
    return "\n".join(text + ("" if len(ranks) == len(found) else f" ({on_ranks(ranks)})")
                     for text, ranks in ranks_by_problem.items()) or None


def on_ranks(ranks) -> str:
    """'on rank 3', 'on ranks 0, 1'."""
    ranks = list(ranks)
    return f"on rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def format_error(rank: int, exc: BaseException) -> str:
    """The one line that names the rank and the error: `[rank R] ErrorType: message`."""
    message = str(exc).strip().replace("\n", " ")
    return f"[rank {rank}] {type(exc).__name__}: {message}" if message else f"[rank {rank}] {type(exc).__name__}"


def exit_code(exc: BaseException) -> int:
    """The job's exit status for an uncaught exception."""
    if isinstance(exc, BAD_INPUT_ERRORS):
        return EXIT_BAD_INPUT
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_ERROR


def report(rank: int, exc: BaseException, tb=None) -> str:
    """The text written to stderr for an uncaught exception on `rank`."""
    summary = format_error(rank, exc)
    if isinstance(exc, BAD_INPUT_ERRORS + (KeyboardInterrupt,)):
        return summary + "\n"
    text = "".join(traceback.format_exception(type(exc), exc, tb)).rstrip("\n").split("\n")
    lines = [f"[rank {rank}] {line}" for line in text]
    if lines[-1] == summary:  # the traceback already ends with our summary line
        lines.pop()
    return "\n".join(lines + [summary]) + "\n"


def install(rank: int, abort: Callable[[int], None], grace_s: float = 0.25) -> None:
    """Report uncaught exceptions (main and other threads) as `[rank R] ...`, then `abort(code)`.

    grace_s: a pause between the report and the abort, so that the launcher forwards the report
    before it kills every rank.
    """
    global _installed_rank

    def hook(exc_type, exc, tb):
        try:
            sys.stderr.write(report(rank, exc, tb))
            sys.stderr.flush()
            time.sleep(grace_s)
        finally:
            abort(exit_code(exc))

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = hook
    threading.excepthook = thread_hook
    _installed_rank = rank


def installed() -> bool:
    """Whether this process aborts the MPI job on an uncaught exception."""
    return _installed_rank is not None
