"""The CuPy backend on every machine, through a CPU stand-in for CuPy (tests/cupy_standin).

Most machines that run this suite have no GPU, so tests/test_gpu.py skips there. The stand-in is
a package named `cupy` whose arrays hold NumPy arrays but are as strict as CuPy's about the
host/device boundary (its docstring lists how), so the CuPy code paths run and fail where they
would fail on a GPU. With tests/cupy_standin first on PYTHONPATH, in subprocesses:

  * the stand-in's own strictness, so that a pass below means something;
  * tests/test_gpu.py and benchmarks/gpu_check.sh, unchanged, as a GPU machine runs them;
  * under mpiexec, device arrays staged through host memory (an MPI that is not CUDA-aware) and
    handed to MPI directly (a CUDA-aware one): the collectives program (every collective, blocking
    and non-blocking, ring and built-in, point-to-point, with its byte counts), and verify, which
    passes and sends exactly the bytes, with the same losses, as on the NumPy backend.

What the stand-in cannot show: speed, GPU memory, cuBLAS's rounding, the order of atomic adds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import PROGRAMS, REPO, check_ok, clean_env, last_json, run_local, run_mpi_json

STANDIN = Path(__file__).resolve().parent / "cupy_standin"
ON_STANDIN = {"PYTHONPATH": os.pathsep.join([str(STANDIN), str(REPO)])}
CUDA_AWARE = {**ON_STANDIN, "REFIMPL_CUDA_AWARE_MPI": "1", "CUPY_STANDIN_CUDA_AWARE": "1"}

STRICTNESS = r'''
import json, numpy as np, cupy
from mpi4py import MPI
from refimpl import backend

found = {}
def raises(name, fn, error):
    try:
        fn()
    except error as exc:
        found[name] = str(exc)
    else:
        found[name] = None

x = cupy.arange(4.0)
raises("np.asarray", lambda: np.asarray(x), TypeError)
raises("device + host", lambda: x + np.ones(4), TypeError)
raises("host + device", lambda: np.ones(4) + x, TypeError)
raises("concatenate with a host array", lambda: cupy.concatenate([x, np.ones(2)]), TypeError)
raises("device + list", lambda: x + [1.0, 2.0, 3.0, 4.0], TypeError)
raises("a host array into a slice", lambda: x.__setitem__(slice(None), np.ones(4)), ValueError)
raises("set of another shape", lambda: x.set(np.zeros(1)), ValueError)
raises("array(host, copy=False)", lambda: cupy.array(np.ones(2), copy=False), ValueError)
raises("frompyfunc", lambda: cupy.frompyfunc, AttributeError)
raises("numpy.linalg on a device array", lambda: np.linalg.norm(x), TypeError)
raises("a submodule (left out on purpose)", lambda: cupy.random, AttributeError)
raises("MPI without CUDA-awareness", lambda: MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, x), BufferError)
host = np.zeros(3)
device = cupy.asarray(host)
host[0] = 1.0
found["asarray copies"] = float(device[0]) == 0.0
found["sum is a 0-d device array"] = type(x.sum()) is cupy.ndarray and x.sum().ndim == 0
found["a view's base"] = x[1:].reshape(3, 1).base is x
found["on_device"] = backend.on_device(x) and not backend.on_device(host)
print(json.dumps(found))
'''


def test_the_standin_is_as_strict_as_cupy():
    found = last_json(check_ok(run_local(["-c", STRICTNESS], timeout=60, env=ON_STANDIN)))
    refused = [name for name, message in found.items() if not isinstance(message, bool)]
    assert len(refused) == 12
    for name in refused:
        assert found[name] is not None, f"the stand-in accepted {name}"
    assert "Implicit conversion to a NumPy array is not allowed" in found["np.asarray"]
    assert found["a host array into a slice"] == "non-scalar numpy.ndarray cannot be used for fill"
    assert "masked" in found["MPI without CUDA-awareness"]
    assert found["asarray copies"] and found["sum is a 0-d device array"] and found["a view's base"]
    assert found["on_device"]


def test_gpu_check_passes_on_the_standin(tmp_path):
    """benchmarks/gpu_check.sh as a GPU machine runs it: the gpu tests, verify DP and ZeRO-3, the benchmark."""
    env = clean_env({**ON_STANDIN, "OUT": tmp_path, "PYTHON": sys.executable,
                     "BENCH_ARGS": "--configs small --repeats 1"})
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=1800)  # 12 s alone, 70 s loaded; over the script's limits
    assert done.returncode == 0, f"gpu_check.sh exited {done.returncode}\n{done.stderr[-4000:]}"
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    assert figures["ok"] and all(step["exit"] == 0 for step in figures["steps"].values()), figures
    assert "passed" in figures["gpu_tests"] and "failed" not in figures["gpu_tests"]
    assert "skipped" not in figures["gpu_tests"], figures["gpu_tests"]  # REFIMPL_REQUIRE_GPU=1: none may skip
    for name, trainer in (("verify_dp", "DataParallel"), ("verify_zero3", "ZeroStage3")):
        assert figures[name]["ok"] and figures[name]["backend"] == "cupy" and figures[name]["strategy"] == trainer
    bench = figures["bench"]
    assert bench["machine"]["cupy"].endswith("cpu.stand.in") and "stand-in" in bench["machine"]["gpu"]
    assert bench["results"][0]["loss_rel_diff"] == 0.0  # the same NumPy arithmetic underneath


@pytest.mark.mpi
@pytest.mark.parametrize("n,route", [(2, "staged"), (3, "staged"), (3, "direct")])
def test_every_collective_on_device_arrays(n, route):
    """Values, in-place forms, non-blocking requests, point-to-point, ring steps and byte counters."""
    env = CUDA_AWARE if route == "direct" else ON_STANDIN
    result = run_mpi_json(n, [PROGRAMS / "collectives.py", "--device"], timeout=120, env=env)
    assert result["world_size"] == n and result["comm"] == "MPIComm"
    assert result["failure_count"] == 0, "\n".join(result["failures"])
    assert result["device_buffers"] >= result["cases"] > 0  # every case hands device buffers to the communicator
    if route == "staged":
        assert result["host_staging"] == "device" and result["host_staged_buffers"] > 0
    else:
        assert result["host_staging"] == "none" and result["host_staged_buffers"] == 0


VERIFY_FLAGS = {
    "ddp-bucketed": [],
    "ddp-ring": ["--collectives", "ring"],
    "zero3": ["--zero", "3"],
    "pipeline-1f1b": ["--pp", "2", "--schedule", "1f1b", "--micro-batches", "4"],
    "pipeline-dualpipe": ["--pp", "2", "--schedule", "dualpipe", "--micro-batches", "4"],
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(VERIFY_FLAGS))
def test_device_arrays_over_mpi_staged_and_direct(name):
    """Requirement 2 of the CuPy backend: device buffers cross MPI staged through host memory, or
    directly where MPI is CUDA-aware; either way verify passes and the byte counters are unchanged."""
    args = ["-m", "refimpl", "verify", *VERIFY_FLAGS[name], "--json"]
    on_numpy = run_mpi_json(2, args, timeout=120)
    staged = run_mpi_json(2, [*args, "--backend", "cupy"], timeout=120, env=ON_STANDIN)
    direct = run_mpi_json(2, [*args, "--backend", "cupy"], timeout=120, env=CUDA_AWARE)
    assert on_numpy["ok"] and staged["ok"] and direct["ok"]
    assert staged["backend"] == direct["backend"] == "cupy"
    assert staged["cuda_aware_mpi"] is False and staged["host_staging"] == "device"
    assert staged["host_staged_buffers"] > 0
    assert direct["cuda_aware_mpi"] is True and direct["host_staging"] == "none"
    assert direct["host_staged_buffers"] == 0
    assert staged["bytes_sent"] == direct["bytes_sent"] == on_numpy["bytes_sent"]
    losses = [[s["loss"] for s in run["per_step"]] for run in (on_numpy, staged, direct)]
    assert losses[0] == losses[1] == losses[2]  # the same NumPy arithmetic underneath, in the same order
