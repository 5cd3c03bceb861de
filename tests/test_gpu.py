"""The CuPy backend against NumPy, on a GPU; every test here is skipped without CuPy or a GPU.

    python -m pytest -q -m gpu tests/test_gpu.py            (benchmarks/gpu_check.sh runs it)

What is compared, in float64 with the tolerances of docs/design.md (rtol 1e-10, atol 1e-12):
  * every op of tests/backend_cases.py, forward and backward, with its output on the device;
  * AdamW steps of a small GPT, plain and with dropout plus checkpointing: losses, gradients and
    parameters (the same weights and dropout masks: both are drawn on the host);
  * the scatter-add of embeddings and indexing (atomic adds on the GPU, in float16/32/64);
  * host staging of device buffers (staging.py) and a one-process communicator on device arrays;
  * `python -m refimpl verify --backend cupy` at one process: data parallel, ZeRO-3, a pipeline
    schedule with checkpointing and dropout; training with ZeRO-2 in mixed precision; the memory
    ledger of a model on the device.
Results agree to rounding, not bit for bit: cuBLAS and OpenBLAS sum in different orders, and the
GPU adds repeated indices with atomics in no fixed order.

The same cases run on the NumPy backend on every machine (tests/test_backend.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from backend_cases import OP_CASES, assert_same, gpt_step, run_op_case
from mpi_util import run_local_json

from refimpl import backend

UNAVAILABLE = backend.cupy_unavailable()
if UNAVAILABLE is not None and os.environ.get("REFIMPL_REQUIRE_GPU") == "1":  # gpu_check.sh: no silent skips
    raise RuntimeError(f"REFIMPL_REQUIRE_GPU=1 but {UNAVAILABLE}")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(UNAVAILABLE is not None, reason=f"needs CuPy and a GPU: {UNAVAILABLE}")]


def on_both(fn, *args, **kwargs) -> tuple:
    """(fn on CuPy, fn on NumPy), each returning host arrays."""
    with backend.using("numpy"):
        want = fn(*args, **kwargs)
    with backend.using("cupy"):
        got = fn(*args, **kwargs)
    return got, want


@pytest.fixture
def cp():
    with backend.using("cupy") as cupy:
        yield cupy


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_op_matches_numpy(name):
    got, want = on_both(run_op_case, name)  # run_op_case checks that the output is a device array
    assert_same(got, want, what=name)


@pytest.mark.parametrize("options", [{}, {"dropout": 0.1, "checkpoint": "sqrt"}], ids=["plain", "dropout-checkpoint"])
def test_gpt_training_steps_match_numpy(options):
    got, want = on_both(gpt_step, **options)
    assert_same(got, want, what=f"GPT steps {options}")


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_scatter_add_on_the_device(cp, dtype):
    """Atomic adds of many repeats; integer values, so every order of addition gives the same sums."""
    rng = np.random.default_rng(0)
    index = rng.integers(0, 4, 64)  # 64 rows added into 4
    values = rng.integers(-4, 5, (64, 3)).astype(dtype)  # sums stay small integers: exact in float16
    want = np.zeros((4, 3), dtype)
    np.add.at(want, index, values)
    target = cp.zeros((4, 3), dtype)
    backend.scatter_add(target, cp.asarray(index), cp.asarray(values))
    np.testing.assert_array_equal(backend.to_host(target), want)


def test_device_buffers_are_staged_through_host_memory(cp):
    from refimpl.parallel.staging import HostCopies, StagingRule  # noqa: PLC0415

    send, recv = cp.arange(4.0), cp.zeros(6)
    copies = HostCopies(StagingRule(cuda_aware=False))
    to_mpi_send, to_mpi_recv = copies.read(send), copies.write(recv[1:5])
    assert isinstance(to_mpi_send, np.ndarray) and isinstance(to_mpi_recv, np.ndarray)
    assert to_mpi_send.tolist() == [0.0, 1.0, 2.0, 3.0]
    to_mpi_recv[...] = 7.0  # what MPI would write
    copies.complete()
    assert backend.to_host(recv).tolist() == [0.0, 7.0, 7.0, 7.0, 7.0, 0.0]
    direct = HostCopies(StagingRule(cuda_aware=True))
    assert direct.read(send) is send and direct.held == []  # a CUDA-aware MPI takes the device array


@pytest.mark.parametrize("collectives", ["mpi", "ring"])
def test_one_process_communicator_on_device_arrays(cp, collectives):
    from refimpl.parallel.comm import LocalComm  # noqa: PLC0415

    comm = LocalComm(collectives)
    buf = cp.arange(5.0)
    assert comm.allreduce(buf) is buf and backend.to_host(buf).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    block = comm.reduce_scatter(cp.arange(4.0))
    assert isinstance(block, cp.ndarray) and backend.to_host(block).tolist() == [0.0, 1.0, 2.0, 3.0]
    whole = comm.iallgather(cp.ones(3)).wait()
    assert isinstance(whole, cp.ndarray) and backend.to_host(whole).tolist() == [1.0, 1.0, 1.0]
    comm.isend(cp.full(3, 2.0), 0, tag=1)
    assert comm.irecv(cp.zeros(3), 0, tag=1).wait().tolist() == [2.0, 2.0, 2.0]
    assert comm.allreduce_value(2.5) == 2.5
    stats = comm.allgather(np.arange(3.0))  # a host buffer stays on the host (pipeline timing)
    assert isinstance(stats, np.ndarray)


@pytest.mark.parametrize("command", [
    ["verify"],
    ["verify", "--zero", "3"],
    ["verify", "--schedule", "1f1b", "--micro-batches", "2", "--checkpoint", "sqrt", "--dropout", "0.1"],
    ["train", "--zero", "2", "--dtype", "mixed", "--steps", "3"],
    ["memory", "--model", "gpt", "--n-layer", "1"],
], ids=["verify-dp", "verify-zero3", "verify-pipeline", "train-zero2-mixed", "memory-ledger"])
def test_commands_on_the_gpu_at_one_process(command):
    result = run_local_json(["-m", "refimpl", *command, "--backend", "cupy", "--json"], timeout=300)
    if command[0] == "verify":
        assert result["ok"], result
        assert result["backend"] == "cupy" and result["world_size"] == 1 and result["cuda_aware_mpi"] is None
    elif command[0] == "train":
        assert result["backend"] == "cupy" and np.isfinite(result["final_loss"])
    else:  # the ledger of every ZeRO stage, measured on the device, equals the formula
        assert result["world_size"] == 1 and result["ledger_equals_formula"], result
