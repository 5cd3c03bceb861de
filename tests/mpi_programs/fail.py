"""One rank fails while the others wait in a collective; the job must end, not hang.

    mpiexec -n 3 python tests/mpi_programs/fail.py --rank 1 --error runtime
    (--error: runtime | value | thread | abort)

Without the failure handler (refimpl/tools/runtime/failure.py) the other ranks would wait in the
all-reduce forever.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from refimpl.parallel.comm import get_world
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)


def fail(error: str, world) -> None:
    if error == "runtime":
        raise RuntimeError("injected failure")
    if error == "value":
        raise ValueError("global batch 10 cannot be split across 3 ranks")
    if error == "thread":
        def work():
            raise KeyError("lost in a thread")
        threading.Thread(target=work).start()
        return  # the main thread goes on into the all-reduce; the thread's error aborts the job
    if error == "abort":
        world.abort(2, "error: --steps differs between ranks")
    raise SystemExit(f"unknown --error {error}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--error", default="runtime")
    args = parser.parse_args()
    world = get_world()
    if world.rank == args.rank:
        time.sleep(0.2)  # let the others reach the all-reduce first
        fail(args.error, world)
    world.allreduce(np.ones(10))
    world.barrier()
    time.sleep(30)  # the failing rank's error must end us before this
    print("unreachable: the job should have been aborted", flush=True)


if __name__ == "__main__":
    main()
