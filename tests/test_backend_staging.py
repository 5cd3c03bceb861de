"""Device arrays and MPI (refimpl/parallel/staging.py): the CUDA-aware rule, host copies, and the
whole communication layer with staging forced on NumPy arrays, so the staging path runs in CI.

REFIMPL_FORCE_HOST_STAGING=1 sends every buffer, NumPy ones too, through a host copy: the copy
before the call, the copy back when it completes. The collectives program then checks every
collective's values and byte counters, and verify checks DDP, ZeRO-3 and a pipeline end to end.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from mpi_util import PROGRAMS, run_mpi, run_mpi_json
from refimpl.parallel import staging
from refimpl.parallel.staging import HostCopies, StagedRequest, StagingRule, cuda_aware_mpi

FORCE = {"REFIMPL_FORCE_HOST_STAGING": "1"}


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


@pytest.mark.parametrize("variable", ["REFIMPL_CUDA_AWARE_MPI", "REFIMPL_FORCE_HOST_STAGING"])
def test_bad_settings_are_clear_errors(variable):
    with pytest.raises(ValueError, match=f"{variable} must be 0 or 1, got 'yes'"):
        StagingRule.from_environment(fake_mpi("mpi"), {variable: "yes"})


def test_which_arrays_are_staged():
    host, device = np.zeros(3), types.SimpleNamespace(__cuda_array_interface__={})
    assert StagingRule(cuda_aware=False).mode == "device"
    assert not StagingRule(cuda_aware=False).stages(host) and StagingRule(cuda_aware=False).stages(device)
    assert not StagingRule(cuda_aware=True).stages(device) and StagingRule(cuda_aware=True).mode == "none"
    forced = StagingRule.from_environment(fake_mpi("mpi"), FORCE)
    assert forced.stages(host) and forced.mode == "all"
    assert forced.report() == {"cuda_aware_mpi": False, "cuda_aware_mpi_reason": "mpi_memory_alloc_kinds = mpi",
                               "host_staging": "all", "host_staged_buffers": 0}


# -- one call's host copies ---------------------------------------------------------------------


def test_host_copies_go_to_mpi_and_received_data_comes_back():
    rule = StagingRule(force=True)
    send, recv = np.arange(4.0), np.zeros(6)
    copies = HostCopies(rule)
    to_mpi_send, to_mpi_recv = copies.read(send), copies.write(recv[1:5])  # a view receives
    assert to_mpi_send is not send and np.array_equal(to_mpi_send, send)
    to_mpi_recv[...] = 7.0  # what MPI would write
    to_mpi_send[...] = -1.0  # a send buffer is never copied back
    assert recv.sum() == 0.0  # nothing lands before the call completes
    copies.complete()
    np.testing.assert_array_equal(recv, [0, 7, 7, 7, 7, 0])
    np.testing.assert_array_equal(send, np.arange(4.0))
    recv[...] = 0.0
    copies.complete()  # completing twice copies nothing again
    assert recv.sum() == 0.0 and rule.staged_buffers == 2


def test_arrays_that_need_no_staging_go_to_mpi_themselves():
    copies = HostCopies(StagingRule(cuda_aware=False))
    a = np.ones(3)
    assert copies.read(a) is a and copies.write(a) is a and copies.held == []
    assert staging.issued("raw request", copies, blocking=False) == "raw request"


def test_issued_requests_finish_their_copies_when_seen_complete():
    buf = np.zeros(2)
    copies = HostCopies(StagingRule(force=True))
    copies.write(buf)[...] = 5.0
    handle = staging.issued("raw request", copies, blocking=False)
    assert isinstance(handle, StagedRequest) and staging.mpi_requests([handle, "plain"]) == ["raw request", "plain"]
    assert buf.sum() == 0.0
    staging.completed([handle, "plain"])
    np.testing.assert_array_equal(buf, [5.0, 5.0])
    blocking = HostCopies(StagingRule(force=True))
    blocking.write(buf)[...] = 1.0
    assert staging.issued(None, blocking, blocking=True) is None and buf.sum() == 2.0  # back at once


# -- the communication layer with staging forced, under mpiexec ---------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_every_collective_with_staging_forced(n):
    """Values, in-place forms, non-blocking requests, point-to-point, ring steps and byte counters."""
    result = run_mpi_json(n, [PROGRAMS / "collectives.py"], timeout=90, env=FORCE)
    assert result["world_size"] == n and result["comm"] == "MPIComm"
    assert result["failure_count"] == 0, "\n".join(result["failures"])


@pytest.mark.mpi
@pytest.mark.parametrize("flags", [["--model", "mlp", "--collectives", "ring"], ["--zero", "3"],
                                   ["--pp", "2", "--schedule", "zb1p", "--micro-batches", "4", "--n-layer", "2"]],
                         ids=["ddp-ring", "zero3", "pipeline-zb1p"])
def test_verify_with_staging_forced_sends_the_same_bytes(flags):
    """DDP, ZeRO-3 and a pipeline pass verify with every buffer staged; the counters do not change."""
    staged = run_mpi_json(2, ["-m", "refimpl", "verify", *flags, "--json"], timeout=120, env=FORCE)
    direct = run_mpi_json(2, ["-m", "refimpl", "verify", *flags, "--json"], timeout=120)
    assert staged["ok"] and direct["ok"]
    assert staged["host_staging"] == "all" and staged["host_staged_buffers"] > 0
    assert direct["host_staging"] == "device" and direct["host_staged_buffers"] == 0  # NumPy arrays go directly
    assert staged["cuda_aware_mpi"] is False and "mpi_memory_alloc_kinds" in staged["cuda_aware_mpi_reason"]
    assert staged["bytes_sent"] == direct["bytes_sent"]
    assert [s["loss"] for s in staged["per_step"]] == [s["loss"] for s in direct["per_step"]]


@pytest.mark.mpi
def test_the_cuda_aware_override_is_reported_and_checked():
    summary = run_mpi_json(2, ["-m", "refimpl", "train", "--model", "mlp", "--steps", "1", "--json"], timeout=120,
                           env={"REFIMPL_CUDA_AWARE_MPI": "1"})
    assert summary["cuda_aware_mpi"] is True and summary["cuda_aware_mpi_reason"] == "REFIMPL_CUDA_AWARE_MPI=1"
    assert summary["host_staging"] == "none"
    done = run_mpi(2, ["-m", "refimpl", "train", "--model", "mlp", "--steps", "1"], timeout=120,
                   env={"REFIMPL_CUDA_AWARE_MPI": "maybe"})
    assert done.returncode == 2 and "REFIMPL_CUDA_AWARE_MPI must be 0 or 1, got 'maybe'" in done.stderr
