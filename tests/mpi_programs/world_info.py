"""What the world looks like from rank 0: size, communicator class, thread budget.

    mpiexec -n 2 python tests/mpi_programs/world_info.py
    python tests/mpi_programs/world_info.py          # one process, no MPI

Prints one JSON line (rank 0).
"""

from __future__ import annotations

import json
import sys

from refimpl.parallel.comm import get_world
from refimpl.tools.runtime import failure, guards, threads

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)


def main() -> None:
    world = get_world()
    budget = threads.current()
    info = {"world_size": world.size, "comm": type(world).__name__, "node_size": world.node_size(),
            "mpi4py_imported": "mpi4py" in sys.modules, "failure_handler": failure.installed(),
            "thread_budget": budget and budget.as_dict(),
            "budgets": world.allgather_object(budget and budget.threads)}
    if world.rank == 0:
        print(json.dumps(info))


if __name__ == "__main__":
    main()
