"""The guards every command runs under: a failure or a hang on one rank ends the whole job.

The core's communicators know nothing of these tools; they call a `comm.Guard` at three moments
(the world created, every blocking MPI call, every bit of progress). `install()` puts this one in
place, before the world is created:

    MPI started     the failure handler (failure.py: an uncaught exception on any rank aborts the
                    job with "[rank R] ErrorType: message"); with more than one rank the watchdog
                    (watchdog.py: a hang becomes an error naming who did not arrive)
    world created   with more than one rank, the BLAS thread budget of the node (threads.py)
    blocking call   the watchdog knows what this rank waits for
    progress        the watchdog knows this rank is alive

The command line installs it (cli.py); so do the test programs that run under mpiexec.
"""

from __future__ import annotations

import atexit
import sys
import time

from refimpl.parallel import comm
from refimpl.tools.runtime import failure, threads, watchdog


class _Guards(comm.Guard):
    def mpi_started(self, MPI) -> None:
        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        failure.install(rank, MPI.COMM_WORLD.Abort)
        if size > 1:  # from here on, a hang is an error naming the ranks that did not arrive
            watch = watchdog.Watchdog(MPI.COMM_WORLD.Dup(), MPI, abort=lambda code: _abort(MPI, code)).start()
            atexit.register(watch.stop)  # before mpi4py finalizes MPI

    def world_created(self, world, local_ranks: int) -> None:
        if world.size > 1:
            threads.apply(local_ranks)

    def waiting(self, communicator, kind: str, peer: int | None = None):
        watch = watchdog.active()
        return comm.Guard.waiting(self, communicator, kind, peer) if watch is None else watch.waiting(
            communicator, kind, peer)

    def progress(self) -> None:
        watchdog.progress()


def _abort(MPI, code: int) -> None:
    """MPI_Abort, after a moment for the launcher to forward what was just printed."""
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(comm.ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(code)


def install() -> None:
    """Guard every communicator of this process (call before the world is created)."""
    comm.install_guard(_Guards())
