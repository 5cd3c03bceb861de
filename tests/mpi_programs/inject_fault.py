"""Run a refimpl command with one fault injected on one rank: the job must end on every rank.

    mpiexec -n 4 python tests/mpi_programs/inject_fault.py --rank 2 --at comm:5 --kind raise -- \
        train --model mlp --steps 20 --timeout 3

--at   comm:K     in this rank's K-th call of a Comm method (a collective, a message, an object
                  exchange), before it reaches MPI
       action:K   in this rank's K-th step of a pipeline schedule (the executor's program)
       save:K     in the middle of this rank's K-th checkpoint file (after it is opened, before it
                  is complete)
--kind raise      RuntimeError (an exception: failure.py's handler aborts the job)
       exit0/exit1  sys.exit(0) / sys.exit(1) (a rank that leaves early: the CLI aborts the job)
       os_exit    os._exit(3) (no Python cleanup at all: the launcher sees it)
       kill       SIGKILL to itself (its keeper names it: "[rank R] killed by signal 9 ...")
       stop       SIGSTOP to itself (a frozen process: only the watchdog can see it)
       loop       a busy loop (the watchdog names where it runs)
       sleep      sleeps forever (a stall that still answers the watchdog)

Before the fault it prints one line to stderr, flushed:
    [fault] rank R KIND at AT time=<time.time()> steps=<complete checkpoint steps, comma-separated>
so that a test can bound the time from fault to the job's end and check that the checkpoint steps
that were complete then are still there afterwards (--save-dir is read from the command).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time

from refimpl.tools.runtime import keeper

if keeper.wanted():  # each rank runs as `python -m refimpl` runs it: the child of a keeper (keeper.py)
    sys.exit(keeper.run_kept([__file__, *sys.argv[1:]]))

from refimpl.parallel import comm as comm_module
from refimpl.tools.runtime import guards
from refimpl.tools.runtime.launcher import launcher_rank

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)

COMM_METHODS = ("allreduce", "iallreduce", "reduce_scatter", "ireduce_scatter", "allgather", "iallgather",
                "bcast", "ibcast", "barrier", "ibarrier", "send", "recv", "isend", "irecv", "sendrecv",
                "allgather_object", "bcast_object")


def complete_steps(save_dir: str | None) -> list[int]:
    """Step numbers whose directory under save_dir holds a manifest (a complete checkpoint)."""
    if not save_dir or not os.path.isdir(save_dir):
        return []
    steps = []
    for name in os.listdir(save_dir):
        if name.startswith("step_") and os.path.isfile(os.path.join(save_dir, name, "manifest.json")):
            steps.append(int(name[len("step_"):]))
    return sorted(steps)


def fault(kind: str, where: str, rank: int, save_dir: str | None) -> None:
    steps = ",".join(map(str, complete_steps(save_dir)))
    sys.stderr.write(f"[fault] rank {rank} {kind} at {where} time={time.time():.3f} steps={steps}\n")
    sys.stderr.flush()
    if kind == "raise":
        raise RuntimeError(f"injected fault at {where}")
    if kind in ("exit0", "exit1"):
        sys.exit(int(kind[-1]))
    if kind == "os_exit":
        os._exit(3)
    if kind in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        time.sleep(60)  # not reached by kill; a stopped process resumes only if someone sends SIGCONT
    if kind == "loop":
        while True:
            pass
    if kind == "sleep":
        while True:
            time.sleep(1)
    raise SystemExit(f"unknown --kind {kind}")


def counting(original, countdown: list, trigger):
    """original, wrapped: the countdown[0]-th call runs trigger() first."""
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        countdown[0] -= 1
        if countdown[0] == 0:
            trigger()
        return original(*args, **kwargs)
    return wrapper


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--at", required=True, help="comm:K, action:K or save:K")
    parser.add_argument("--kind", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    rank = launcher_rank()
    save_dir = command[command.index("--save-dir") + 1] if "--save-dir" in command else None
    moment, k = args.at.split(":")
    countdown = [int(k)]
    trigger = functools.partial(fault, args.kind, args.at, rank, save_dir)
    if rank == args.rank:
        if moment == "comm":
            for name in COMM_METHODS:
                setattr(comm_module.Comm, name, counting(getattr(comm_module.Comm, name), countdown, trigger))
        elif moment == "action":
            from refimpl.parallel.pipeline import executor  # noqa: PLC0415

            executor.PipelineExecutor._do = counting(executor.PipelineExecutor._do, countdown, trigger)
        elif moment == "save":
            from refimpl.tools.saved_runs import safe_files  # noqa: PLC0415

            def write_then_fault(write):  # the file is open and half written when the fault comes
                def half(f):
                    f.write(b"partial")
                    f.flush()
                    trigger()
                    return write(f)
                return half

            for name in ("create_new", "write_atomically"):
                original = getattr(safe_files, name)

                def wrapped(path, write, _original=original):
                    countdown[0] -= 1
                    return _original(path, write_then_fault(write) if countdown[0] == 0 else write)
                setattr(safe_files, name, wrapped)
        else:
            raise SystemExit(f"unknown --at {args.at}")
    from refimpl.tools.cli import main as refimpl_main  # noqa: PLC0415

    return refimpl_main(command)


if __name__ == "__main__":
    sys.exit(main())
