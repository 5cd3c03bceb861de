"""Device arrays and MPI: CUDA-aware MPI, or staging through host memory.

MPI reads and writes raw memory. A CuPy array lives in GPU memory. An MPI library built with CUDA
support ("CUDA-aware") accepts its device address as a buffer (mpi4py hands it on through the
array's __cuda_array_interface__); any other MPI library would treat that address as host memory
and crash or corrupt data. So comm.py hands every array to MPI by one of two routes, chosen per
array by a `StagingRule`:

    direct   the array itself; a device array only after the GPU has finished the work queued on
             it (a stream synchronisation), since MPI reads the memory outside CUDA's streams
    staged   a host copy, made before the call. For a buffer that MPI writes (a receive buffer,
             or an in-place buffer that is sent and received), the host copy is copied back into
             the array when the call completes: right after a blocking call; for a non-blocking
             one, by the test() or wait() that first sees it complete (before a ring collective
             uses the received block, so its reductions see the data).

    which arrays                                   route
    NumPy arrays                                   direct: they are host memory
    device arrays, MPI CUDA-aware                  direct
    device arrays, MPI not CUDA-aware              staged

Both routes run in CI without a GPU, on the CPU stand-in for CuPy (tests/test_cupy_standin.py).

Is MPI CUDA-aware? (`cuda_aware_mpi`; the rule, in order)
    1. REFIMPL_CUDA_AWARE_MPI=1 or =0, if set, decides.
    2. Otherwise the MPI 4.1 info key "mpi_memory_alloc_kinds" of MPI_COMM_WORLD decides: CUDA-aware
       when it lists "cuda:device" (or plain "cuda": every CUDA memory kind). MPICH 4.2+ and Open MPI
       6+ report it; a kind may have to be requested at launch (Open MPI:
       `mpiexec --memory-allocation-kinds system,mpi,cuda:device ...`).
    3. Otherwise: not CUDA-aware. Staging is always correct, only slower. mpi4py does not wrap the
       non-standard MPIX_Query_cuda_support (its maintainers point to the info key instead), and
       libraries older than MPI 4.1 report nothing: set REFIMPL_CUDA_AWARE_MPI=1 for a CUDA-aware
       Open MPI 4 or 5, MVAPICH or Cray MPICH.

The byte counters are the same on both routes: comm.py counts the logical buffer (its elements
times its itemsize) before the buffer reaches this module.

Cost of staging, per buffer: a device-to-host copy and, for received data, a host-to-device copy,
each waiting for the GPU. Production GPU training avoids both: NCCL (or a CUDA-aware MPI) moves
device memory directly, between GPUs over NVLink or the network, on CUDA streams.
"""

from __future__ import annotations

import os

from refimpl import backend

CUDA_KINDS = ("cuda", "cuda:device")  # memory kinds (MPI 4.1) that mean device buffers are accepted


def memory_alloc_kinds(MPI) -> list[str] | None:
    """The memory kinds MPI_COMM_WORLD supports (MPI 4.1 info key), or None if the library does not say."""
    try:
        info = MPI.COMM_WORLD.Get_info()
        try:
            value = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
    except Exception:  # noqa: BLE001 - an MPI library without the call or the key
        return None
    if value is None:
        return None
    return [kind.strip() for kind in value.split(",") if kind.strip()]


def cuda_aware_mpi(MPI, environ=os.environ) -> tuple[bool, str]:
    """(whether MPI accepts device buffers, the reason), by the rule in the module docstring."""
    forced = environ.get("REFIMPL_CUDA_AWARE_MPI", "")
    if forced in ("0", "1"):
        return forced == "1", f"REFIMPL_CUDA_AWARE_MPI={forced}"
    if forced:
        raise ValueError(f"REFIMPL_CUDA_AWARE_MPI must be 0 or 1, got {forced!r}")
    kinds = memory_alloc_kinds(MPI)
    if kinds is None:
        return False, ("the MPI library does not report its memory kinds (mpi_memory_alloc_kinds, MPI 4.1); "
                       "set REFIMPL_CUDA_AWARE_MPI=1 if it is CUDA-aware")
    return any(kind in CUDA_KINDS for kind in kinds), f"mpi_memory_alloc_kinds = {','.join(kinds)}"


class StagingRule:
    """Which arrays reach MPI through a host copy, and how many did so far."""

    def __init__(self, cuda_aware: bool = False, reason: str = "") -> None:
        self.cuda_aware, self.reason = cuda_aware, reason
        self.staged_buffers = 0  # host copies made so far (this process, every communicator)

    @classmethod
    def from_environment(cls, MPI, environ=os.environ) -> StagingRule:
        """The rule for this MPI library and environment."""
        return cls(*cuda_aware_mpi(MPI, environ))

    def stages(self, array) -> bool:
        return backend.on_device(array) and not self.cuda_aware

    @property
    def mode(self) -> str:
        """'device' (device arrays are staged) or 'none' (CUDA-aware MPI: nothing is)."""
        return "none" if self.cuda_aware else "device"

    def report(self) -> dict:
        return {"cuda_aware_mpi": self.cuda_aware, "cuda_aware_mpi_reason": self.reason,
                "host_staging": self.mode, "host_staged_buffers": self.staged_buffers}


NO_MPI_REPORT = {"cuda_aware_mpi": None, "cuda_aware_mpi_reason": "no MPI (a one-process world)",
                 "host_staging": None, "host_staged_buffers": 0}


class HostCopies:
    """One MPI call's buffers as MPI sees them: each array itself, or a host copy of it.

        copies = HostCopies(rule)
        request = comm.Iallreduce(IN_PLACE, copies.write(buf), SUM)   # buf, or its host copy
        ...                                                            # when the call completes:
        copies.complete()                                              # host copy -> buf
    """

    def __init__(self, rule: StagingRule) -> None:
        self.rule = rule
        self.written: list[tuple] = []  # (array, its host copy) to copy back when the call completes
        self.held: list = []  # every host copy, kept alive until the call completes

    def read(self, array):
        """A buffer that MPI only reads (a send buffer)."""
        return self._route(array, written=False)

    def write(self, array):
        """A buffer that MPI writes (a receive buffer, or an in-place one that is also sent)."""
        return self._route(array, written=True)

    def _route(self, array, written: bool):
        if not self.rule.stages(array):
            if backend.on_device(array):
                backend.synchronize()  # direct: MPI may read device memory once the GPU has written it
            return array
        host = backend.host_copy(array)  # the current values: an in-place collective sends them
        self.rule.staged_buffers += 1
        self.held.append(host)
        if written:
            self.written.append((array, host))
        return host

    def complete(self) -> None:
        """The call has completed: copy what MPI wrote into the host copies back (once)."""
        for array, host in self.written:
            backend.copy_from_host(array, host)
        self.written, self.held = [], []


class StagedRequest:
    """A non-blocking MPI request together with the host copies it reads and writes."""

    def __init__(self, request, copies: HostCopies) -> None:
        self.request, self.copies = request, copies


def issued(request, copies: HostCopies, blocking: bool):
    """What an MPI call hands back to comm.py: None after a blocking call (its copies are back
    already), else its request -- wrapped with its host copies if it has any."""
    if blocking:
        copies.complete()
        return None
    return StagedRequest(request, copies) if copies.held else request


def mpi_requests(handles) -> list:
    """The MPI requests behind a list of handles (plain requests or StagedRequests)."""
    return [h.request if isinstance(h, StagedRequest) else h for h in handles]


def completed(handles) -> None:
    """Handles whose MPI requests have completed: finish their host copies."""
    for h in handles:
        if isinstance(h, StagedRequest):
            h.copies.complete()
