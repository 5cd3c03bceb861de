"""The communication layer under mpiexec at 1, 2, 3 and 4 processes, and without MPI at all.

Each launch runs tests/mpi_programs/collectives.py, which performs every check (values against
NumPy, the ring's summation order, all-to-all blocks and counts, a mixture-of-experts dispatch and
combine, byte counters against the formulas, non-blocking requests, point-to-point,
sub-communicators, the mesh, bad input) and reports them in one JSON line.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_util import PROGRAMS, run_local_json, run_mpi_json

COLLECTIVES = PROGRAMS / "collectives.py"
USER_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def assert_clean(result: dict, world_size: int) -> None:
    assert result["world_size"] == world_size
    assert result["failure_count"] == 0, "\n".join(result["failures"])
    assert result["checks"] > 0


def test_collectives_one_process_without_mpi():
    """No mpiexec: the local world runs every check and never imports mpi4py."""
    result = run_local_json([COLLECTIVES], timeout=60)
    assert_clean(result, 1)
    assert result["comm"] == "LocalComm" and result["mpi4py_imported"] is False
    assert result["thread_budget"] is None


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives_under_mpiexec(n):
    """Every collective, both implementations, against NumPy and the byte formulas (4 ranks oversubscribe 2 cores)."""
    result = run_mpi_json(n, [COLLECTIVES], timeout=300)
    assert_clean(result, n)
    assert result["comm"] == "MPIComm"
    assert result["cases"] >= 288


CASE = st.fixed_dictionaries({
    "kind": st.sampled_from(["allreduce", "reduce_scatter", "allgather", "bcast", "alltoall", "alltoallv"]),
    "length": st.integers(0, 40),
    "variant": st.sampled_from([("float64", False, "sum"), ("float64", True, "sum"), ("float32", False, "sum"),
                                ("float16", True, "sum"), ("int32", True, "max"), ("float64", False, "min")]),
    "root": st.integers(0, 3),
    "mode": st.sampled_from(["mpi", "ring"]),
    "style": st.sampled_from(["blocking", "wait", "poll"]),
    "seed": st.integers(0, 2**31 - 1),
})


@pytest.mark.mpi
@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 4), drawn=st.lists(CASE, min_size=1, max_size=16))
def test_drawn_collectives(n, drawn):
    """Hypothesis draws the world size and a batch of calls here, in pytest; one launch runs the batch."""
    cases = []
    for case in drawn:
        dtype, integer, op = case.pop("variant")
        cases.append(dict(case, dtype=dtype, integer=integer, op=op, root=case["root"] % n))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cases, f)
    try:
        result = run_mpi_json(n, [COLLECTIVES, "--cases", f.name], timeout=300)
    finally:
        os.unlink(f.name)
    assert_clean(result, n)
    assert result["cases"] == len(cases)


@pytest.mark.mpi
def test_thread_budget_under_mpiexec():
    """Two ranks on this node share its cores; the failure handler is installed."""
    from refimpl.tools.runtime.threads import available_cores

    info = run_mpi_json(2, [PROGRAMS / "world_info.py"], timeout=60, env={name: None for name in USER_THREADS})
    expected = max(1, available_cores() // 2)
    assert info["node_size"] == 2 and info["failure_handler"] is True
    assert info["thread_budget"]["threads"] == expected and info["budgets"] == [expected, expected]
    assert all(threads == expected for _, threads in info["thread_budget"]["pools"])


@pytest.mark.mpi
def test_thread_budget_leaves_a_user_setting_alone():
    info = run_mpi_json(2, [PROGRAMS / "world_info.py"], timeout=60, env={"OMP_NUM_THREADS": "1"})
    assert info["thread_budget"]["threads"] is None and "OMP_NUM_THREADS=1" in info["thread_budget"]["reason"]


def test_world_info_without_mpi():
    info = run_local_json([PROGRAMS / "world_info.py"], timeout=60)
    assert info == {"world_size": 1, "comm": "LocalComm", "node_size": 1, "mpi4py_imported": False,
                    "failure_handler": False, "thread_budget": None, "budgets": [None]}
