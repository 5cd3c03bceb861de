"""Whether this process is a rank of an MPI job, read from the environment its launcher set.

An MPI launcher (mpiexec, mpirun, srun) tells each process it starts that it is one rank of a job
through environment variables, and each MPI library uses its own names:

    MPICH (Hydra), Intel MPI     PMI_RANK, PMI_SIZE, MPI_LOCALNRANKS
    Open MPI                     OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE
    Open MPI 5, Slurm with PMIx  PMIX_RANK
    MVAPICH                      MV2_COMM_WORLD_RANK, MV2_COMM_WORLD_SIZE

Reading them needs no MPI and no NumPy: comm.py asks `under_mpiexec()` before it starts MPI, and the
command line asks `launcher_rank()` before anything else (only rank 0 prints usage).
"""

from __future__ import annotations

import os

# Any one of these set: this process was started by a launcher.
LAUNCHER_VARIABLES = (
    "PMI_RANK",  # MPICH (hydra), Intel MPI
    "PMI_SIZE",
    "PMIX_RANK",  # Open MPI 5, Slurm with PMIx
    "OMPI_COMM_WORLD_SIZE",  # Open MPI
    "MPI_LOCALNRANKS",  # MPICH (hydra)
    "MV2_COMM_WORLD_SIZE",  # MVAPICH
)
# This process's rank, in the first of these that is set.
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def under_mpiexec(environ=os.environ) -> bool:
    """Whether this process was started by an MPI launcher (REFIMPL_MPI=1/0 overrides)."""
    forced = environ.get("REFIMPL_MPI", "")
    if forced in ("0", "1"):
        return forced == "1"
    return any(name in environ for name in LAUNCHER_VARIABLES)


def launcher_rank(environ=os.environ) -> int:
    """This process's rank as its launcher numbered it (0 when no launcher started it)."""
    return int(next((environ[name] for name in RANK_VARIABLES if name in environ), "0"))
