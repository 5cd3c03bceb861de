"""The one array module.

Every piece of refimpl asks this module for `xp` (NumPy by default, CuPy when asked for) instead
of importing numpy in a hot path, so the GPU backend is a switch, not a fork.

    from refimpl import backend
    xp = backend.xp()                 # the active array module
    backend.set_backend("cupy")       # or --backend cupy, or REFIMPL_BACKEND=cupy in the environment
    with backend.using("cupy"): ...   # the same for a block, then the previous backend again
    backend.to_host(array)            # a NumPy array, whatever the backend

Nothing imports cupy unless it is asked for, and asking for it where it cannot run is an error
that says why (never a silent fallback to NumPy); `cupy_unavailable()` gives that reason without
raising (the GPU tests skip on it). Under mpiexec each rank takes one GPU of its node
(`use_local_gpu`, with the node-local rank recorded when the MPI world is created).

The few operations that NumPy and CuPy spell differently, or that cross between host and device
memory, have one helper each here, so the rest of the code reads the same on both:

    scatter_add(target, index, values)   target[index] += values, repeated indices adding up
    on_device(array)                     whether the array lives in GPU memory
    array_module(array)                  numpy or cupy: where to allocate arrays that go with it
    synchronize()                        wait until the GPU has finished the work queued so far
    host_copy(array)                     a new NumPy array with the array's values
    copy_from_host(target, host)         target[...] = host, across the host/device boundary

What stays on the host by design: weight initialisation and dropout masks are drawn from NumPy
Generators (so a seed gives the same model and the same masks on both backends, and checkpointing
can save and replay a generator's state), and the data sets build NumPy batches; each is moved to
the device with `asarray` where it is used. See docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np

BACKENDS = ("numpy", "cupy")
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
INSTALL_CUPY = ("pip install 'refimpl[cuda]' (cupy-cuda12x, for CUDA 12) or "
                "pip install 'refimpl[cuda13]' (cupy-cuda13x, for CUDA 13)")

_active_name: str | None = None
_active_module = None
_local_rank: int | None = None  # rank among the ranks of this node, once an MPI world exists


class BackendError(RuntimeError):
    """The requested backend is unknown or cannot be loaded."""


def set_backend(name: str) -> None:
    """Make `name` ("numpy" or "cupy") the array module returned by `xp()`."""
    global _active_name, _active_module
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module = np if name == "numpy" else _load_cupy()
    _active_name, _active_module = name, module
    if name == "cupy" and _local_rank is not None:
        use_local_gpu(_local_rank)


def set_local_rank(local_rank: int) -> None:
    """This process's rank among the ranks of its node (comm.py, when it creates the MPI world):
    the CuPy backend, now or when it is chosen later, uses GPU (local_rank mod the GPUs visible)."""
    global _local_rank
    _local_rank = local_rank
    if _active_name == "cupy":
        use_local_gpu(local_rank)


def add_argument(parser) -> None:
    """The --backend flag of every command that computes on arrays (tools/cli.py applies it)."""
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="array module: numpy, or cupy for a GPU (default $REFIMPL_BACKEND, else numpy)")


def _load_cupy():
    """The cupy module, once it is known to reach a GPU; a BackendError that says why otherwise."""
    try:
        import cupy  # noqa: PLC0415 - imported only when asked for
    except ImportError as exc:
        raise BackendError(f"backend 'cupy' needs CuPy, which cannot be imported ({exc}): {INSTALL_CUPY}") from exc
    try:  # importing CuPy needs no GPU; using one needs a driver and a visible device
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: no driver, a driver too old, ...
        raise BackendError(f"backend 'cupy': CuPy {cupy.__version__} is installed but cannot reach a GPU "
                           f"({exc})") from exc
    if devices == 0:
        raise BackendError(f"backend 'cupy': CuPy {cupy.__version__} is installed but sees no GPU "
                           "(is CUDA_VISIBLE_DEVICES empty?)")
    return cupy


def use_local_gpu(local_rank: int) -> int | None:
    """On the CuPy backend, make GPU (local_rank mod the GPUs visible) current; return its number.

    Called with the node-local rank that comm.py records when it creates the MPI world, so that the
    ranks on a node spread over its GPUs (a launcher that gives each rank one GPU through
    CUDA_VISIBLE_DEVICES leaves GPU 0).
    """
    if name() != "cupy":
        return None
    device = local_rank % xp().cuda.runtime.getDeviceCount()
    xp().cuda.Device(device).use()
    return device


def cupy_unavailable() -> str | None:
    """None when the cupy backend can run here, else the one-line reason (for skipping GPU tests)."""
    try:
        _load_cupy()
    except BackendError as exc:
        return str(exc)
    return None


def name() -> str:
    """The active backend's name."""
    if _active_name is None:
        set_backend(os.environ.get("REFIMPL_BACKEND", "numpy"))
    return _active_name


def xp():
    """The active array module (numpy or cupy)."""
    if _active_module is None:
        set_backend(os.environ.get("REFIMPL_BACKEND", "numpy"))
    return _active_module


@contextlib.contextmanager
def using(backend_name: str):
    """Run a block with another backend active, then restore the previous one."""
    previous = name()
    set_backend(backend_name)
    try:
        yield xp()
    finally:
        set_backend(previous)


def to_host(array) -> np.ndarray:
    """A NumPy copy (or the array itself, on the NumPy backend)."""
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "get"):  # cupy.ndarray
        return array.get()
    return np.asarray(array)


def asarray(data, dtype=None):
    """An array of the active backend holding `data` ("bfloat16": ml_dtypes' dtype)."""
    return xp().asarray(data, dtype=bfloat16() if str(dtype) == "bfloat16" else dtype)


INSTALL_ML_DTYPES = "pip install ml_dtypes"


def bfloat16() -> np.dtype:
    """NumPy's dtype of bfloat16, from ml_dtypes (NumPy has none): a ValueError with the install
    command when ml_dtypes is missing, and on the CuPy backend, which has no bfloat16 arrays."""
    if name() == "cupy":
        raise ValueError("--dtype bf16 runs on the numpy backend only (CuPy has no bfloat16 arrays); "
                         "use --backend numpy, or --dtype mixed on the GPU")
    try:
        import ml_dtypes  # noqa: PLC0415 - optional: only bfloat16 storage needs it
    except ImportError as exc:
        raise ValueError(f"--dtype bf16 stores arrays in bfloat16 from ml_dtypes, which cannot be imported "
                         f"({exc}): {INSTALL_ML_DTYPES}") from exc
    return np.dtype(ml_dtypes.bfloat16)


def check_dtype(dtype) -> np.dtype:
    """Return `dtype` as a NumPy dtype, or raise a clear error if refimpl does not support it."""
    if str(dtype) == "bfloat16":
        return bfloat16()
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(SUPPORTED_DTYPES)}") from exc
    if dt.name not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dt.name!r}; choose one of {', '.join(SUPPORTED_DTYPES)}")
    return dt


# ------------------------------------------------------------------------------------------------
# The operations NumPy and CuPy spell differently, and the host/device boundary
# ------------------------------------------------------------------------------------------------


def erf(x):
    """The error function, elementwise (an exact GELU's CDF). NumPy has none: on the host, math.erf
    per element (exact, and slow: the tanh GELU is the fast one); on a GPU, CuPy's."""
    if name() == "cupy":
        from cupyx.scipy.special import erf as cupy_erf  # noqa: PLC0415 - an optional dependency: CuPy

        return cupy_erf(x)
    return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64).astype(x.dtype, copy=False)


def scatter_add(target, index, values) -> None:
    """target[index] += values, where repeated indices add up (an embedding's backward).

    `target[index] += values` would add only one of the repeats. NumPy spells the scatter-add
    numpy.add.at; CuPy spells it cupy.add.at where its ufuncs have .at (recent versions: CuPy 14
    has it, and deprecates the older spelling), and cupyx.scatter_add before. On a GPU the repeats
    are added with atomic operations, in no fixed order: the sum agrees with NumPy's to rounding,
    not bit for bit.
    """
    module = xp()
    if hasattr(module.add, "at"):
        module.add.at(target, index, values)
    else:  # an older CuPy
        import cupyx  # noqa: PLC0415 - an optional dependency: CuPy

        cupyx.scatter_add(target, index, values)


def on_device(array) -> bool:
    """Whether `array` lives in GPU memory (a CuPy array; anything with __cuda_array_interface__)."""
    return not isinstance(array, np.ndarray) and hasattr(array, "__cuda_array_interface__")


def array_module(array):
    """numpy for a NumPy array, else the active module (a device array's: cupy)."""
    return np if isinstance(array, np.ndarray) else xp()


def synchronize() -> None:
    """Wait until the GPU has finished the work queued on the current stream (nothing on NumPy)."""
    if name() == "cupy":
        xp().cuda.get_current_stream().synchronize()


def host_copy(array) -> np.ndarray:
    """A new NumPy array holding `array`'s values (a device-to-host copy for a device array)."""
    if on_device(array):
        return array.get()  # waits for the work that writes `array`, then copies
    return np.array(array, copy=True)


def copy_from_host(target, host: np.ndarray) -> None:
    """target[...] = host, where target may be a device array (a host-to-device copy)."""
    target[...] = xp().asarray(host) if on_device(target) else host
