"""MPI launchers seen from the environment: the variables `mpiexec` sets for its ranks, and where
`mpiexec` is.

An MPI launcher (mpiexec, mpirun, srun) tells each process it starts that it is one rank of a job
through environment variables, and each MPI library uses its own names:

    MPICH (Hydra), Intel MPI     PMI_RANK, PMI_SIZE, MPI_LOCALNRANKS, HYDRA_*, I_MPI_*
    Open MPI                     OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_*
    Open MPI 5, Slurm with PMIx  PMIX_RANK, PMIX_*
    MVAPICH                      MV2_COMM_WORLD_RANK, MV2_COMM_WORLD_SIZE, MV2_*

This module is the one place that lists them. comm.py reads them to decide whether to start MPI
(`under_mpiexec`); the command line reads this rank's number from them before MPI is started
(`launcher_rank`: only rank 0 prints usage); and whatever starts a new `mpiexec` from a process
that may itself be a rank (tests, the docs generator, the tutorials, the benchmarks) first removes
them (`without_launcher`), since the new job's ranks would otherwise read the outer job's.
Nothing here imports MPI.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from refimpl.parallel.launched import LAUNCHER_VARIABLES, RANK_VARIABLES, launcher_rank

# Every variable a launcher sets for its ranks starts with one of these.
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_", "MV2_", "I_MPI_")


def without_launcher(environ=os.environ) -> dict:
    """A copy of `environ` without the variables a launcher sets: the environment for a new `mpiexec`
    (or a one-process run) started from a process that may itself be a rank."""
    return {k: v for k, v in environ.items() if not k.startswith(LAUNCHER_PREFIXES)}


def find_mpiexec() -> str | None:
    """The `mpiexec` next to this Python (the mpich wheel installs it in the virtual environment's
    bin/), else the one on PATH, else None."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


__all__ = ["LAUNCHER_VARIABLES", "RANK_VARIABLES", "LAUNCHER_PREFIXES", "launcher_rank", "without_launcher",
           "find_mpiexec"]
