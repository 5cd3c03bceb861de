"""Device arrays and MPI (refimpl/parallel/staging.py): the CUDA-aware rule and one call's host
copies, on a minimal stand-in for a device array.

Whole runs with device arrays under mpiexec -- the collectives program and verify, staged and
direct -- are in tests/test_cupy_standin.py, on the CPU stand-in for CuPy.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from mpi_util import run_mpi, run_mpi_json

from refimpl.parallel import staging
from refimpl.parallel.staging import HostCopies, StagedRequest, StagingRule, cuda_aware_mpi


class DeviceArray:
    """What staging.py sees of a CuPy array: __cuda_array_interface__, get(), slicing, assignment.
    Its NumPy array `values` stands for the device memory."""

    __cuda_array_interface__: dict = {}

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def get(self) -> np.ndarray:  # device -> host
        return self.values.copy()

    def __getitem__(self, key) -> DeviceArray:  # a view
        return DeviceArray(self.values[key])

    def __setitem__(self, key, value) -> None:  # host -> device
        self.values[key] = value


# -- is MPI CUDA-aware? -------------------------------------------------------------------------


def fake_mpi(kinds: str | None = None, fails: bool = False):
    """An object shaped like mpi4py's MPI whose COMM_WORLD info holds mpi_memory_alloc_kinds = kinds."""
    class Info:
        def Get(self, key):
            assert key == "mpi_memory_alloc_kinds"
            return kinds

        def Free(self):
            pass

    def get_info():
        if fails:
            raise NotImplementedError("MPI_Comm_get_info")
        return Info()
    return types.SimpleNamespace(COMM_WORLD=types.SimpleNamespace(Get_info=get_info))


@pytest.mark.parametrize("kinds,environ,aware,reason", [
    ("mpi,system", {}, False, "mpi_memory_alloc_kinds = mpi,system"),
    ("mpi, system, cuda:device", {}, True, "mpi_memory_alloc_kinds = mpi,system,cuda:device"),
    ("system,cuda", {}, True, "mpi_memory_alloc_kinds = system,cuda"),
    ("system,cuda:host", {}, False, "cuda:host"),  # pinned host memory only: device buffers are not accepted
    (None, {}, False, "set REFIMPL_CUDA_AWARE_MPI=1 if it is CUDA-aware"),  # a library older than MPI 4.1
    ("mpi,system", {"REFIMPL_CUDA_AWARE_MPI": "1"}, True, "REFIMPL_CUDA_AWARE_MPI=1"),
    ("cuda:device", {"REFIMPL_CUDA_AWARE_MPI": "0"}, False, "REFIMPL_CUDA_AWARE_MPI=0"),
])
def test_the_cuda_aware_rule(kinds, environ, aware, reason):
    got, why = cuda_aware_mpi(fake_mpi(kinds), environ)
    assert got is aware and reason in why


def test_a_library_without_the_query_is_not_cuda_aware():
    assert cuda_aware_mpi(fake_mpi(fails=True), {})[0] is False


def test_a_bad_setting_is_a_clear_error():
    with pytest.raises(ValueError, match="REFIMPL_CUDA_AWARE_MPI must be 0 or 1, got 'yes'"):
        StagingRule.from_environment(fake_mpi("mpi"), {"REFIMPL_CUDA_AWARE_MPI": "yes"})


def test_which_arrays_are_staged():
    host, device = np.zeros(3), DeviceArray(np.zeros(3))
    assert StagingRule(cuda_aware=False).mode == "device"
    assert not StagingRule(cuda_aware=False).stages(host) and StagingRule(cuda_aware=False).stages(device)
    assert not StagingRule(cuda_aware=True).stages(device) and StagingRule(cuda_aware=True).mode == "none"
    rule = StagingRule.from_environment(fake_mpi("mpi"), {})
    assert rule.report() == {"cuda_aware_mpi": False, "cuda_aware_mpi_reason": "mpi_memory_alloc_kinds = mpi",
                             "host_staging": "device", "host_staged_buffers": 0}


# -- one call's host copies ---------------------------------------------------------------------


def test_host_copies_go_to_mpi_and_received_data_comes_back():
    rule = StagingRule(cuda_aware=False)
    send, recv = DeviceArray(np.arange(4.0)), DeviceArray(np.zeros(6))
    copies = HostCopies(rule)
    to_mpi_send, to_mpi_recv = copies.read(send), copies.write(recv[1:5])  # a view receives
    assert isinstance(to_mpi_send, np.ndarray) and np.array_equal(to_mpi_send, send.values)
    to_mpi_recv[...] = 7.0  # what MPI would write
    to_mpi_send[...] = -1.0  # a send buffer is never copied back
    assert recv.values.sum() == 0.0  # nothing lands before the call completes
    copies.complete()
    np.testing.assert_array_equal(recv.values, [0, 7, 7, 7, 7, 0])
    np.testing.assert_array_equal(send.values, np.arange(4.0))
    recv.values[...] = 0.0
    copies.complete()  # completing twice copies nothing again
    assert recv.values.sum() == 0.0 and rule.staged_buffers == 2


def test_arrays_that_need_no_staging_go_to_mpi_themselves():
    copies = HostCopies(StagingRule(cuda_aware=False))
    a = np.ones(3)
    assert copies.read(a) is a and copies.write(a) is a and copies.held == []
    assert staging.issued("raw request", copies, blocking=False) == "raw request"


def test_issued_requests_finish_their_copies_when_seen_complete():
    buf = DeviceArray(np.zeros(2))
    copies = HostCopies(StagingRule(cuda_aware=False))
    copies.write(buf)[...] = 5.0
    handle = staging.issued("raw request", copies, blocking=False)
    assert isinstance(handle, StagedRequest) and staging.mpi_requests([handle, "plain"]) == ["raw request", "plain"]
    assert buf.values.sum() == 0.0
    staging.completed([handle, "plain"])
    np.testing.assert_array_equal(buf.values, [5.0, 5.0])
    blocking = HostCopies(StagingRule(cuda_aware=False))
    blocking.write(buf)[...] = 1.0
    assert staging.issued(None, blocking, blocking=True) is None and buf.values.sum() == 2.0  # back at once


# -- under mpiexec ------------------------------------------------------------------------------


@pytest.mark.mpi
def test_the_cuda_aware_override_is_reported_and_checked():
    summary = run_mpi_json(2, ["-m", "refimpl", "train", "--model", "mlp", "--steps", "1", "--json"], timeout=120,
                           env={"REFIMPL_CUDA_AWARE_MPI": "1"})
    assert summary["cuda_aware_mpi"] is True and summary["cuda_aware_mpi_reason"] == "REFIMPL_CUDA_AWARE_MPI=1"
    assert summary["host_staging"] == "none"
    done = run_mpi(2, ["-m", "refimpl", "train", "--model", "mlp", "--steps", "1"], timeout=120,
                   env={"REFIMPL_CUDA_AWARE_MPI": "maybe"})
    assert done.returncode == 2 and "REFIMPL_CUDA_AWARE_MPI must be 0 or 1, got 'maybe'" in done.stderr
