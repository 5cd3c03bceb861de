"""A keeper for each rank: when a rank's process is killed, its keeper names it by its world rank.

Why. A process killed by a signal (SIGKILL from the out-of-memory killer or `kill -9`) runs no
code: it cannot report itself, and the ranks that were waiting for it are killed by the launcher
before they can say which peer stopped answering (MPICH's hydra ends them within milliseconds).
The launcher knows processes, not ranks: hydra prints "BAD TERMINATION ... PID <pid> ... EXIT
CODE: 9" for the first process it finds ended, which is often a rank it killed itself, not the
one that died. (Open MPI's `mpirun` names the rank: "process rank 2 with PID ... exited on signal 9".)

How. Under a launcher, `python -m refimpl ...` does not run the command itself: it starts it as a
child process, with the same arguments, environment and open files (MPI's launcher protocol
travels through both), and waits. The child is the rank; this process, the keeper, only waits,
passes on the signals it receives (Ctrl-C, SIGTERM), and returns the child's exit status. When the
child is killed by a signal, the keeper prints

    [rank 2] killed by signal 9 (SIGKILL: the out-of-memory killer, or kill -9): this rank's process
    (PID 14198 on node7) ended without reporting anything

and ends itself with the same signal, so the launcher sees what it saw before. The child asks the
kernel to kill it when its keeper dies (Linux's PR_SET_PDEATHSIG), so a launcher that kills the
keepers ends the ranks too. Cost: one sleeping Python process per rank, which imports nothing but
the standard library.

Not kept: one-process runs, platforms other than Linux, and REFIMPL_KEEPER=0. A child that exits
with a status (os._exit(3), MPI_Abort) is not reported by the keeper: it either printed its own
error first, or, for os._exit, the launcher's "EXIT CODE" says the status.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

from refimpl.parallel.launched import launcher_rank, under_mpiexec

KEEPER_VARIABLE = "REFIMPL_KEEPER"  # "0": no keeper; "child": this process is the kept rank
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
WHY_KILLED = {signal.SIGKILL: "the out-of-memory killer, or kill -9", signal.SIGSEGV: "a crash in native code",
              signal.SIGBUS: "a crash in native code", signal.SIGABRT: "abort() in native code"}


def wanted(environ=os.environ) -> bool:
    """Whether this process should start the rank as a kept child (see the module docstring)."""
    return (sys.platform.startswith("linux") and under_mpiexec(environ)
            and environ.get(KEEPER_VARIABLE, "1") not in ("0", "child"))


def run_kept(argv: list[str]) -> int:
    """Run `python argv...` as this rank's child and wait; the child's exit status, or, when a
    signal killed it, a report on stderr and the same signal to this process."""
    libc = ctypes.CDLL(None, use_errno=True)

    def die_with_keeper():  # runs in the child, before Python starts there
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    child = subprocess.Popen([sys.executable, *argv], env=dict(os.environ, **{KEEPER_VARIABLE: "child"}),
                             close_fds=False, preexec_fn=die_with_keeper)
    for number in FORWARDED_SIGNALS:
        signal.signal(number, lambda received, frame: child.send_signal(received))
    status = child.wait()
    if status >= 0:
        return status
    number = signal.Signals(-status)
    why = WHY_KILLED.get(number, "sent by another process")
    sys.stderr.write(f"[rank {launcher_rank()}] killed by signal {int(number)} ({number.name}: {why}): this rank's "
                     f"process (PID {child.pid} on {socket.gethostname()}) ended without reporting anything\n")
    sys.stderr.flush()
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)
    return 128 + int(number)  # not reached for a signal that ends a process
