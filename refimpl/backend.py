"""The one array module.

Every piece of refimpl asks this module for `xp` (NumPy by default, CuPy when asked for) instead
of importing numpy in a hot path, so the GPU backend is a switch, not a fork.

    from refimpl import backend
    xp = backend.xp()                 # the active array module
    backend.set_backend("cupy")       # or REFIMPL_BACKEND=cupy in the environment
    backend.to_host(array)            # a NumPy array, whatever the backend

Nothing imports cupy unless it is asked for, and asking for it where it is missing is an error
(never a silent fallback to NumPy).
"""

from __future__ import annotations

import os

import numpy as np

BACKENDS = ("numpy", "cupy")
SUPPORTED_DTYPES = ("float16", "float32", "float64")

_active_name: str | None = None
_active_module = None


class BackendError(RuntimeError):
    """The requested backend is unknown or cannot be loaded."""


def set_backend(name: str) -> None:
    """Make `name` ("numpy" or "cupy") the array module returned by `xp()`."""
    global _active_name, _active_module
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "numpy":
        module = np
    else:
        try:
            import cupy  # noqa: PLC0415 - imported only when asked for
        except ImportError as exc:
            raise BackendError(
                "backend 'cupy' needs CuPy, which is not installed: "
                "pip install 'refimpl[cuda]' (cupy-cuda12x) or pip install cupy-cuda13x"
            ) from exc
        module = cupy
    _active_name, _active_module = name, module


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


def to_host(array) -> np.ndarray:
    """A NumPy copy (or the array itself, on the NumPy backend)."""
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "get"):  # cupy.ndarray
        return array.get()
    return np.asarray(array)


def asarray(data, dtype=None):
    """An array of the active backend holding `data`."""
    return xp().asarray(data, dtype=dtype)


def check_dtype(dtype) -> np.dtype:
    """Return `dtype` as a NumPy dtype, or raise a clear error if refimpl does not support it."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(SUPPORTED_DTYPES)}") from exc
    if dt.name not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dt.name!r}; choose one of {', '.join(SUPPORTED_DTYPES)}")
    return dt
