"""The guards every command runs under: a failure or a hang on one rank ends the whole job.

The core's communicators know nothing of these tools; they call a `comm.Guard` at three moments
(the world created, every blocking MPI call, every bit of progress). `install()` puts this one in
place, before the world is created:

    world created   the failure handler (failure.py: an uncaught exception on any rank aborts the
                    job with "[rank R] ErrorType: message"); with more than one rank the watchdog
                    (watchdog.py: a hang becomes an error naming who did not arrive) and the BLAS
                    thread budget of the node (threads.py)
    blocking call   the watchdog knows what this rank waits for
    progress        the watchdog knows this rank is alive

The command line installs it (cli.py); so do the test programs that run under mpiexec.
"""

from __future__ import annotations

import atexit

from refimpl.parallel import comm
from refimpl.tools.runtime import failure, threads, watchdog


class _Guards(comm.Guard):
    def world_created(self, MPI, world, local_ranks: int) -> None:
        failure.install(world.rank, MPI.COMM_WORLD.Abort)
        if world.size > 1:
            watch = watchdog.Watchdog(MPI.COMM_WORLD.Dup(), MPI, abort=lambda code: world.abort(code)).start()
            atexit.register(watch.stop)  # before mpi4py finalizes MPI
            threads.apply(local_ranks)

    def waiting(self, communicator, kind: str, peer: int | None = None):
        watch = watchdog.active()
        return comm.Guard.waiting(self, communicator, kind, peer) if watch is None else watch.waiting(
            communicator, kind, peer)

    def progress(self) -> None:
        watchdog.progress()


def install() -> None:
    """Guard every communicator of this process (call before the world is created)."""
    comm.install_guard(_Guards())
