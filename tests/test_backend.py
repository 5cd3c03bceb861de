"""The array backend on any machine: choosing it, its errors, its helpers, and the backend-generic
cases of tests/backend_cases.py on the NumPy backend (tests/test_gpu.py runs them on CuPy).

Also an audit: refimpl calls NumPy itself only where the host is meant (docs/gpu.md, "How the
switch works"); everywhere else it asks backend.xp(), so that the CuPy backend is a switch, not a
fork.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from backend_cases import OP_CASES, assert_same, gpt_step, run_op_case
from mpi_util import run_local, run_local_json

from refimpl import backend
from refimpl.backend import BackendError

REPO = Path(__file__).resolve().parents[1]


# -- choosing a backend -------------------------------------------------------------------------


def test_numpy_is_the_default_and_using_restores_the_previous_backend():
    assert backend.name() == "numpy" and backend.xp() is np
    with pytest.raises(RuntimeError, match="inside"):
        with backend.using("numpy") as xp:
            assert xp is np
            raise RuntimeError("inside")
    assert backend.name() == "numpy"


def test_an_unknown_backend_is_a_clear_error():
    with pytest.raises(BackendError, match="unknown backend 'jax'; choose one of numpy, cupy"):
        backend.set_backend("jax")
    assert backend.name() == "numpy"


def test_cupy_that_cannot_be_imported_names_cupy_and_both_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(BackendError) as error:
        backend.set_backend("cupy")
    message = str(error.value)
    for fragment in ("backend 'cupy' needs CuPy", "refimpl[cuda]", "cupy-cuda12x", "refimpl[cuda13]", "cupy-cuda13x"):
        assert fragment in message
    assert backend.name() == "numpy"  # never a silent fallback, nor a half-switched state
    assert backend.cupy_unavailable() == message


def _fake_cupy(device_count):
    """A module that imports like CuPy and whose runtime reports `device_count` (or raises it)."""
    def count():
        if isinstance(device_count, Exception):
            raise device_count
        return device_count
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "99.0"
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))
    return cupy


@pytest.mark.parametrize("device_count,fragment", [
    (RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient"),
     "CuPy 99.0 is installed but cannot reach a GPU (cudaErrorInsufficientDriver"),
    (0, "CuPy 99.0 is installed but sees no GPU"),
])
def test_cupy_without_a_gpu_is_a_clear_error(monkeypatch, device_count, fragment):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(device_count))
    with pytest.raises(BackendError, match="backend 'cupy'") as error:
        backend.set_backend("cupy")
    assert fragment in str(error.value)
    assert backend.name() == "numpy"


@pytest.mark.parametrize("command,via", [(["train", "--steps", "1"], "flag"),
                                         (["train", "--steps", "1"], "environment"),
                                         (["verify", "--steps", "1"], "flag"), (["memory", "--model", "mlp"], "flag")])
def test_backend_cupy_where_it_cannot_run_is_a_one_line_error(command, via):
    if backend.cupy_unavailable() is None:
        pytest.skip("CuPy runs here: tests/test_gpu.py runs these commands on it")
    flag, env = (["--backend", "cupy"], None) if via == "flag" else ([], {"REFIMPL_BACKEND": "cupy"})
    done = run_local(["-m", "refimpl", *command, *flag], timeout=120, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: backend 'cupy'") and ("refimpl[cuda13]" in lines[0] or "GPU" in lines[0])


def test_train_and_verify_report_the_backend_and_that_no_mpi_ran():
    result = run_local_json(["-m", "refimpl", "verify", "--backend", "numpy", "--zero", "3", "--json"], timeout=120)
    assert result["ok"] and result["backend"] == "numpy"
    assert result["cuda_aware_mpi"] is None and result["host_staging"] is None and result["host_staged_buffers"] == 0
    summary = run_local_json(["-m", "refimpl", "train", "--model", "mlp", "--steps", "2", "--json"], timeout=120)
    assert summary["backend"] == "numpy" and summary["cuda_aware_mpi"] is None


# -- the helpers --------------------------------------------------------------------------------


def test_scatter_add_adds_repeated_indices():
    target = np.zeros((3, 2))
    backend.scatter_add(target, np.array([0, 2, 0, 0]), np.arange(8.0).reshape(4, 2))
    np.testing.assert_array_equal(target, [[0 + 4 + 6, 1 + 5 + 7], [0, 0], [2, 3]])
    target = np.zeros((2, 3))
    backend.scatter_add(target, (slice(None), np.array([1, 1])), np.ones((2, 2)))  # a tuple index
    np.testing.assert_array_equal(target, [[0, 2, 0], [0, 2, 0]])


def test_scatter_add_falls_back_to_cupyx_on_an_old_cupy(monkeypatch):
    calls = []
    old_cupy = types.SimpleNamespace(add=types.SimpleNamespace())  # a ufunc without .at
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(scatter_add=lambda *args: calls.append(args)))
    monkeypatch.setattr(backend, "_active_module", old_cupy)
    backend.scatter_add("target", "index", "values")
    assert calls == [("target", "index", "values")]


def test_host_copy_and_copy_from_host():
    a = np.arange(6.0)
    copy = backend.host_copy(a)
    assert copy is not a and not np.shares_memory(copy, a)
    copy[0] = 99.0
    assert a[0] == 0.0
    view = a[2:5]  # copies back land in the viewed memory
    backend.copy_from_host(view, np.array([7.0, 8.0, 9.0]))
    np.testing.assert_array_equal(a, [0, 1, 7, 8, 9, 5])
    assert not backend.on_device(a) and backend.array_module(a) is np
    assert backend.on_device(types.SimpleNamespace(__cuda_array_interface__={}))
    backend.synchronize()  # nothing to wait for on NumPy


def test_ranks_on_a_node_spread_over_its_gpus(monkeypatch):
    assert backend.use_local_gpu(3) is None  # nothing to choose on NumPy
    used = []
    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 4),
                                 Device=lambda i: types.SimpleNamespace(use=lambda: used.append(i)))
    monkeypatch.setattr(backend, "_active_name", "cupy")
    monkeypatch.setattr(backend, "_active_module", types.SimpleNamespace(cuda=cuda))
    assert [backend.use_local_gpu(rank) for rank in range(6)] == [0, 1, 2, 3, 0, 1] and used == [0, 1, 2, 3, 0, 1]


# -- the backend-generic cases, on NumPy --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_every_op_case_runs_on_the_numpy_backend(name):
    """The cases the GPU test compares: host results, a gradient for every input, deterministic."""
    first = run_op_case(name)
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float64 for v in first.values()), first
    assert_same(run_op_case(name), first, rtol=0, atol=0, what=name)


def test_gpt_step_case_with_dropout_and_checkpointing():
    """Host-drawn dropout masks are replayed by checkpointing's recomputation (nn/layers.py)."""
    plain = gpt_step(dropout=0.1)
    assert_same(gpt_step(dropout=0.1, checkpoint="sqrt"), plain, what="checkpointed vs plain")
    assert not np.allclose(gpt_step()["losses"], plain["losses"])  # the dropout acted


def test_dropout_generators_are_numpy_on_every_backend():
    from refimpl.nn import GPT, GPTConfig  # noqa: PLC0415

    model = GPT(GPTConfig(vocab_size=5, seq_len=4, n_layer=1, n_head=1, d_model=4, dropout=0.1))
    generators = [m.generator for m in model.modules() if hasattr(m, "generator")]
    assert generators and all(isinstance(g, np.random.Generator) for g in generators)


# -- the audit ----------------------------------------------------------------------------------

# Names that are types, not array work.
TYPES = {"ndarray", "dtype", "integer", "float64", "int64", "uint8", "random.Generator"}
# Where refimpl calls NumPy itself, and why the host is meant there. Anything else is a CuPy bug
# waiting to happen: ask backend.xp(), or add the use here with its reason.
HOST_BY_DESIGN = {
    "backend.py": ({"array", "asarray", "frompyfunc"}, "the backend itself (erf on the host: math.erf per element)"),
    "tools/cluster/calibrate.py": ({"add", "asarray", "float32", "full", "isfinite", "linalg.lstsq", "mean", "median",
                                    "ones", "random.default_rng", "stack", "sum", "unique", "zeros"},
                             "calibration measures this host's NumPy engine (its rates are the NumPy backend's), and "
                             "fits its timings on the host"),
    "data.py": ({"arange", "array", "concatenate", "cos", "full", "pi", "random.default_rng", "sin", "sort", "stack",
                 "asarray", "bincount", "cumsum", "empty", "flatnonzero", "frombuffer", "min_scalar_type", "take",
                 "zeros"},
                "data sets build NumPy batches on the host (a text file's tokens too); the models move them with "
                "backend.asarray"),
    "nn/layers.py": ({"ones", "zeros", "triu", "random.default_rng"},
                     "initial values, the causal mask and dropout masks are made on the host, then moved"),
    "nn/models.py": ({"random.default_rng"}, "weights are drawn on the host: the same model on every backend"),
    "nn/module.py": ({"asarray"}, "load_state_dict reads host arrays"),
    "tools/context_parallel_report.py": ({"abs", "isfinite", "max", "ones", "random.default_rng", "triu"},
                                         "the inputs and the causal mask are made on the host and moved with "
                                         "backend.asarray; the comparison reads host copies (backend.to_host)"),
    "tools/commands/tensor_parallel.py": ({"random.default_rng"},
                                          "the measured block's input is drawn on the host, then moved with "
                                          "backend.asarray"),
    "nn/experts.py": ({"add.at", "arange", "argsort", "bincount", "cumsum", "full", "ones", "repeat",
                       "take_along_axis", "zeros"},
                      "routing is bookkeeping on the host (top-K, the sort by expert, counts, capacity): small "
                      "integer arrays; the rows themselves stay on the device (indices moved with backend.asarray)"),
    "parallel/experts.py": ({"arange", "argsort", "asarray", "concatenate", "cumsum"},
                            "the row counts and the (source, expert) order are host bookkeeping; the indices are "
                            "moved with backend.asarray"),
    "parallel/tensor_parallel/gpt.py": ({"asarray", "concatenate", "moveaxis", "stack", "zeros"},
                                        "slices are cut from the host initialisation and put back together on "
                                        "the host (WeightSplit.shard / WeightSplit.join: construction and "
                                        "verification)"),
    "objective.py": ({"asarray"}, "counts the targets of a host batch"),
    "parallel/context_parallel/layout.py": ({"arange", "argsort", "concatenate"},
                                            "token positions are host bookkeeping (small integer arrays), "
                                            "moved to the arrays' memory where they index them"),
    "parallel/context_parallel/ulysses.py": ({"concatenate"}, "the global order of the tokens: host positions, "
                                             "moved with backend.asarray"),
    "tools/verification.py": ({"inf", "floating", "integer", "array", "ascontiguousarray"},
                              "an injected overflow; a trainer's loss checked to be a number; the records "
                              "(full_parameters, last_grads: NumPy arrays by the protocol) copied and hashed"),
    "tools/compare_mixed.py": ({"abs", "float64", "max", "sqrt", "square", "sum"},
                               "tolerances from host copies of the gradients"),
    "tools/compare.py": ({"abs", "asarray", "divide", "inf", "isfinite", "isinf", "isnan", "max", "maximum", "where"},
                   "compares host copies"),
    "tools/commands/verify.py": ({"random.SeedSequence", "random.default_rng"},
                                 "a sweep draws configurations on the host"),
    "autograd/gradcheck.py": ({"abs", "allclose", "argmax", "random.default_rng", "unravel_index", "zeros"},
                              "finite differences collected on the host"),
    "parallel/comm.py": ({"add", "maximum", "minimum", "array", "cumsum", "empty", "frombuffer", "zeros"},
                         "reduction names (run by the buffer's own module), pickled objects and MPI counts"),
    "parallel/ring.py": ({"cumsum", "full", "zeros"}, "block counts and offsets are host integers"),
    "tools/runtime/watchdog.py": ({"empty", "frombuffer", "uint8"}, "the watchdog's status messages are host bytes"),
    "parallel/zero/flat.py": ({"concatenate", "cumsum", "prod"}, "layout arithmetic on shapes"),
    "tools/saved_runs/sharded.py": ({"array", "load", "prod", "random", "random.Generator", "savez", "zeros"},
                                    "checkpoint files hold host copies; dropout generators live on the host"),
    "tools/timeline.py": ({"array", "zeros"}, "timing figures live on the host"),
    "tools/distance.py": ({"arange", "asarray", "concatenate", "dot", "float64", "linalg.norm", "ravel", "shape",
                           "zeros"},
                          "distances between host copies of gradients and parameters (full_parameters, last_grads)"),
    "tools/golden.py": ({"array", "asarray", "dtype", "float64", "isfinite", "linalg.norm", "load", "savez", "stack"},
                        "golden cases are host files (.npz) of host copies"),
    "checkpointing/measure.py": ({"ones_like", "random.default_rng", "sqrt"},
                                 "measurements for the docs; np.ones_like(a) returns a's own kind (NEP 18)"),
    "tools/checkpoint_tables.py": ({"ones_like", "random.default_rng"}, "as measure.py"),
}


def numpy_uses(path: Path) -> set[str]:
    """Dotted names used from numpy in a file: np.zeros -> "zeros", np.random.default_rng -> "random.default_rng"."""
    tree = ast.parse(path.read_text())
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts, value = [], node
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in ("np", "numpy"):
                found.add(".".join(reversed(parts)))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "numpy":
            found.update(alias.name for alias in node.names)
    return found


def test_numpy_is_called_only_where_the_host_is_meant():
    package = REPO / "refimpl"
    problems = []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        if name.startswith("tutorial/"):
            continue  # teaching code, on NumPy by design
        allowed = TYPES | HOST_BY_DESIGN.get(name, (set(), ""))[0]
        problems += [f"refimpl/{name}: np.{use}" for use in sorted(numpy_uses(path) - allowed)]
    assert not problems, ("NumPy called where the active backend's module (backend.xp()) belongs; use it, or "
                          "add the use to HOST_BY_DESIGN with its reason:\n  " + "\n  ".join(problems))
    assert all((package / name).is_file() for name in HOST_BY_DESIGN), "HOST_BY_DESIGN names a file that is gone"
