"""One BLAS/OpenMP thread budget per machine.

NumPy's BLAS (OpenBLAS, MKL) starts one thread per core by default. With R MPI ranks on a node of
C cores that is R*C busy threads on C cores; BLAS threads spin while they wait for work, and a
multi-rank run becomes one to two orders of magnitude slower. So, when the MPI world has more
than one rank, each rank limits its thread pools to

    threads = max(1, cores // ranks_on_this_node)

with threadpoolctl, unless the user chose a number by setting OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS or MKL_NUM_THREADS (then nothing is changed). `cores` is the number of CPUs
this process may run on (os.sched_getaffinity, which respects cpusets and `mpiexec -bind-to`);
`ranks_on_this_node` comes from an MPI shared-memory split (MPI_COMM_TYPE_SHARED), done by
comm.get_world(), which calls `apply` -- this module itself never touches MPI.

`current()` returns what was chosen, so a run can report it (train --json).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from threadpoolctl import threadpool_info, threadpool_limits

USER_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_current: ThreadBudget | None = None


@dataclass(frozen=True)
class ThreadBudget:
    """The BLAS/OpenMP thread decision of one rank."""

    threads: int | None  # the limit applied to every thread pool; None: left as it was
    cores: int  # CPUs this process may run on
    local_ranks: int  # ranks of the job on this node
    reason: str  # why, in words
    pools: tuple = field(default=())  # (library, threads) after the decision, from threadpoolctl

    def as_dict(self) -> dict:
        return asdict(self)


def available_cores() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def choose(cores: int, local_ranks: int, environ=os.environ) -> ThreadBudget:
    """The decision, without applying it (a pure function, for tests and reports)."""
    user_set = [f"{name}={environ[name]}" for name in USER_VARIABLES if environ.get(name)]
    if user_set:
        return ThreadBudget(None, cores, local_ranks, "set by the user: " + ", ".join(user_set))
    threads = max(1, cores // max(1, local_ranks))
    return ThreadBudget(threads, cores, local_ranks, f"max(1, {cores} cores // {local_ranks} ranks on this node)")


def apply(local_ranks: int, environ=os.environ) -> ThreadBudget:
    """Choose this rank's budget, limit the loaded thread pools to it, and remember it."""
    global _current

    budget = choose(available_cores(), local_ranks, environ)
    if budget.threads is not None:
        threadpool_limits(limits=budget.threads)  # stays in effect: not used as a context manager
    pools = tuple((info["internal_api"], info["num_threads"]) for info in threadpool_info())
    _current = ThreadBudget(budget.threads, budget.cores, budget.local_ranks, budget.reason, pools)
    return _current


def current() -> ThreadBudget | None:
    """The budget applied in this process, or None (one process: BLAS keeps its default)."""
    return _current
