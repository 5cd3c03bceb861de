"""A CPU stand-in for CuPy, as strict as CuPy about the host/device boundary (for tests only).

It is not a GPU and does not simulate one: a "device" array is a NumPy array wrapped in this
module's `ndarray`, and every operation is NumPy's. What it reproduces is what breaks code that
was written for NumPy and is then handed CuPy arrays, so that refimpl's CuPy backend runs, and
fails where it would fail on a GPU, on machines without one:

  * np.asarray(device_array) raises TypeError, as CuPy's arrays do ("use .get()");
  * a NumPy array or a list mixed into an operation on device arrays raises TypeError, as in CuPy
    ("Unsupported type"); move it with cupy.asarray. Index arrays may be NumPy (CuPy copies them);
    assigning a host array to a slice raises CuPy's ValueError (to an index array, it is copied);
  * only the top-level names CuPy 14.2 has exist (_names.py): a NumPy function CuPy lacks is
    missing. Submodules (cupy.random, linalg, fft, ...) are left out on purpose: refimpl uses none
    of them (its dropout masks come from NumPy Generators), so any use of one is flagged;
  * cupy.array(host, copy=False) raises as CuPy 14 does, ndarray.set() demands the same shape and
    dtype, and ndarray.data / .flat (device pointers and iterators in CuPy) are refused;
  * reductions and integer indexing give 0-d device arrays, not NumPy scalars (float() them);
  * cupy.asarray(host_array) copies, so a device array never shares memory with the host's;
  * a device array has __cuda_array_interface__ and no buffer protocol, so mpi4py treats it as
    it treats a CuPy array: as device memory. With CUPY_STANDIN_CUDA_AWARE=1 the interface points
    at the host memory behind it, so an MPI library on the host reads it as a CUDA-aware MPI
    would read GPU memory; otherwise the interface carries a mask, which mpi4py refuses
    ("cannot handle masked arrays"): a device buffer handed to an MPI that is not CUDA-aware
    fails loudly here, where on a GPU it would crash or corrupt memory.

What it cannot show: speed, GPU memory, cuBLAS's summation order, the order of atomic adds,
streams. Use it by putting tests/cupy_standin first on PYTHONPATH; tests/test_cupy_standin.py
runs tests/test_gpu.py, benchmarks/gpu_check.sh and MPI runs of the CuPy backend that way.
"""

from __future__ import annotations

import copy as _copy
import os as _os

import numpy as _np

from . import cuda  # noqa: F401 - cupy.cuda: runtime, Device, get_current_stream
from ._names import MODULE_NAMES, NDARRAY_METHODS

__version__ = "14.2.0+cpu.stand.in"
IS_STANDIN = True  # so that a report can say the numbers came from no GPU

_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
             "Please use `.get()` to construct a NumPy array explicitly.")


def _unwrap(value, where: str):
    """The NumPy array behind each device array in value (lists and tuples walked through), for
    NumPy to compute on; a host NumPy array there is an error, as it is in CuPy."""
    if isinstance(value, ndarray):
        return value._array
    if isinstance(value, _np.ndarray):
        raise TypeError(f"Unsupported type {type(value)} in {where}: a NumPy (host) array mixed with "
                        "device arrays; move it to the device with cupy.asarray")
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, where) for v in value)
    return value


def _check_operands(values, where: str) -> None:
    """The operands of an elementwise operation are device arrays or scalars, never lists (a host
    array is refused when they are unwrapped)."""
    for v in values:
        if isinstance(v, (list, tuple)):
            raise TypeError(f"Unsupported type {type(v)} in {where}: a list is not an array in CuPy; "
                            "use cupy.asarray")


def _index(key):
    """An index: device arrays unwrapped, NumPy index arrays accepted (CuPy copies them over)."""
    if isinstance(key, ndarray):
        return key._array
    if isinstance(key, tuple):
        return tuple(_index(k) for k in key)
    return key


def _advanced(key) -> bool:
    """Whether an index holds an array or a list (advanced indexing), not only ints and slices."""
    parts = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (ndarray, _np.ndarray, list)) for k in parts)


def _devices_in(values) -> list:
    found = []
    for v in values:
        if isinstance(v, ndarray):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(_devices_in(v))
    return found


def _wrap(result, inputs: list):
    """NumPy results as device arrays: an input returned as is stays that very object; a view of
    an input gets the input's base (as CuPy's .base); a NumPy scalar becomes a 0-d array."""
    if isinstance(result, _np.ndarray):
        for x in inputs:
            if result is x._array:
                return x
        parent = next((x for x in inputs if result.base is not None and _np.may_share_memory(result, x._array)), None)
        return ndarray._of(result, parent)
    if isinstance(result, _np.generic):
        return ndarray._of(_np.asarray(result))
    if isinstance(result, (list, tuple)):
        return type(result)(_wrap(r, inputs) for r in result)
    return result


def _call(function, args, kwargs, where: str, owner: ndarray | None = None):
    inputs = ([owner] if owner is not None else []) + _devices_in(list(args) + list(kwargs.values()))
    raw = function(*_unwrap(args, where), **{k: _unwrap(v, where) for k, v in kwargs.items()})
    out = kwargs.get("out")
    if out is not None:
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out
    return _wrap(raw, inputs)


class ndarray:  # noqa: N801 - CuPy's name
    """A device array: a NumPy array that refuses to be taken for one."""

    __slots__ = ("_array", "_base", "__weakref__")

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        self._array, self._base = _np.empty(shape, dtype, order=order), None

    @classmethod
    def _of(cls, array: _np.ndarray, parent: ndarray | None = None) -> ndarray:
        self = object.__new__(cls)
        self._array = array
        self._base = None if parent is None else (parent._base if parent._base is not None else parent)
        return self

    # -- attributes ------------------------------------------------------------------------------
    shape = property(lambda self: self._array.shape)
    dtype = property(lambda self: self._array.dtype)
    ndim = property(lambda self: self._array.ndim)
    size = property(lambda self: self._array.size)
    nbytes = property(lambda self: self._array.nbytes)
    itemsize = property(lambda self: self._array.itemsize)
    strides = property(lambda self: self._array.strides)
    flags = property(lambda self: _Flags(self._array.flags))
    base = property(lambda self: self._base)
    T = property(lambda self: ndarray._of(self._array.T, self))
    mT = property(lambda self: ndarray._of(self._array.mT, self))

    @property
    def data(self):
        raise NotImplementedError("ndarray.data is a device pointer (cupy.cuda.MemoryPointer); "
                                  "the stand-in has none")

    @property
    def flat(self):
        raise NotImplementedError("ndarray.flat iterates over device memory; the stand-in does not")

    @property
    def __cuda_array_interface__(self) -> dict:
        interface = {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                     "data": (self._array.ctypes.data, False),
                     "strides": None if self._array.flags.c_contiguous else self.strides}
        if _os.environ.get("CUPY_STANDIN_CUDA_AWARE") != "1":
            interface["mask"] = "device memory: this MPI is not CUDA-aware"  # mpi4py refuses it
        return interface

    def __getattr__(self, name):
        if name not in NDARRAY_METHODS or not hasattr(self._array, name):
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")
        attribute = getattr(self._array, name)
        if not callable(attribute):
            return _wrap(attribute, [self])
        return lambda *args, **kwargs: _call(attribute, args, kwargs, f"ndarray.{name}", self)

    # -- the host/device boundary ----------------------------------------------------------------
    def __array__(self, *args, **kwargs):
        raise TypeError(_IMPLICIT)

    def get(self, stream=None, order="C", out=None, blocking=True) -> _np.ndarray:
        """A NumPy copy (the device-to-host copy)."""
        if out is not None:
            out[...] = self._array
            return out
        return _np.array(self._array, order=order, copy=True)

    def set(self, array, stream=None) -> None:
        """Copy a NumPy array of the same shape and dtype in (the host-to-device copy)."""
        if not isinstance(array, _np.ndarray):
            raise TypeError(f"ndarray.set takes a numpy.ndarray, not {type(array)}")
        if array.shape != self.shape:
            raise ValueError(f"shape mismatch: {array.shape} into {self.shape}")
        if array.dtype != self.dtype:
            raise TypeError(f"dtype mismatch: {array.dtype} into {self.dtype}")
        self._array[...] = array

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc.__name__ not in MODULE_NAMES:
            return NotImplemented
        _check_operands(inputs, f"numpy.{ufunc.__name__}")
        return _call(getattr(ufunc, method), inputs, kwargs, f"numpy.{ufunc.__name__}")

    def __array_function__(self, function, types, args, kwargs):
        if function.__module__ != "numpy" or function.__name__ not in MODULE_NAMES:
            return NotImplemented  # numpy.linalg.* and the like: the stand-in has no submodules
        return _call(function, args, kwargs, f"numpy.{function.__name__}")

    # -- Python protocols ------------------------------------------------------------------------
    def __getitem__(self, key):
        return _wrap(self._array[_index(key)], [self])

    def __setitem__(self, key, value):
        if isinstance(value, _np.ndarray):  # a host array
            if value.ndim and not _advanced(key):  # CuPy's message for one assigned to a slice
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            self._array[_index(key)] = value  # a 0-d one is a scalar; to an index array CuPy copies it
            return
        self._array[_index(key)] = _unwrap(value, "ndarray.__setitem__")

    def __len__(self):
        return len(self._array)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __bool__(self):
        return bool(self._array)

    def __float__(self):
        return float(self._array)

    def __int__(self):
        return int(self._array)

    def __complex__(self):
        return complex(self._array)

    def __format__(self, spec):
        return format(self.get(), spec)

    def __repr__(self):
        return repr(self._array)

    def __str__(self):
        return str(self._array)

    def __copy__(self):
        return ndarray._of(self._array.copy())

    def __deepcopy__(self, memo):
        return ndarray._of(_copy.deepcopy(self._array, memo))

    def __reduce__(self):
        return _from_host, (self.get(),)

    __hash__ = None


def _operator(name: str, in_place: bool = False):
    def method(self, *other):
        _check_operands(other, f"ndarray.{name}")
        raw = getattr(self._array, name)(*_unwrap(other, f"ndarray.{name}"))
        if raw is NotImplemented:
            return NotImplemented
        return self if in_place else _wrap(raw, [self, *_devices_in(other)])
    method.__name__ = name
    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
              "lshift", "rshift", "divmod"):
    setattr(ndarray, f"__{_name}__", _operator(f"__{_name}__"))
    setattr(ndarray, f"__r{_name}__", _operator(f"__r{_name}__"))
    if _name not in ("matmul", "divmod"):  # CuPy has no in-place matmul
        setattr(ndarray, f"__i{_name}__", _operator(f"__i{_name}__", in_place=True))
for _name in ("lt", "le", "gt", "ge", "eq", "ne", "neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_name}__", _operator(f"__{_name}__"))


def _from_host(array: _np.ndarray) -> ndarray:
    return ndarray._of(_np.array(array, copy=True))


class _Flags:
    """CuPy's flags: c_contiguous, f_contiguous and owndata only (no writeable)."""

    def __init__(self, flags) -> None:
        self.c_contiguous, self.f_contiguous, self.owndata = flags.c_contiguous, flags.f_contiguous, flags.owndata


class ufunc:  # noqa: N801 - CuPy's name
    """A NumPy ufunc that takes device arrays only (and indices from either side, for .at)."""

    def __init__(self, numpy_ufunc):
        self._ufunc = numpy_ufunc
        self.__name__ = numpy_ufunc.__name__

    def __call__(self, *args, **kwargs):
        _check_operands(args, f"cupy.{self.__name__}")
        return _call(self._ufunc, args, kwargs, f"cupy.{self.__name__}")

    def at(self, a, indices, b=None):
        if not isinstance(a, ndarray):
            raise TypeError(f"cupy.{self.__name__}.at needs a cupy.ndarray to add into, not {type(a)}")
        where = f"cupy.{self.__name__}.at"
        self._ufunc.at(a._array, _index(indices), *(() if b is None else (_unwrap(b, where),)))

    def reduce(self, *args, **kwargs):
        return _call(self._ufunc.reduce, args, kwargs, f"cupy.{self.__name__}.reduce")

    def accumulate(self, *args, **kwargs):
        return _call(self._ufunc.accumulate, args, kwargs, f"cupy.{self.__name__}.accumulate")

    def outer(self, *args, **kwargs):
        return _call(self._ufunc.outer, args, kwargs, f"cupy.{self.__name__}.outer")

    def reduceat(self, *args, **kwargs):
        return _call(self._ufunc.reduceat, args, kwargs, f"cupy.{self.__name__}.reduceat")

    def __getattr__(self, name):  # nin, nout, identity, ...
        return getattr(self._ufunc, name)


# -- module functions with CuPy's own semantics ----------------------------------------------------
def _loose(value):
    """Device arrays inside a nested list replaced by their NumPy arrays (cupy.array accepts them)."""
    if isinstance(value, ndarray):
        return value._array
    if isinstance(value, (list, tuple)):
        return type(value)(_loose(v) for v in value)
    return value


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False) -> ndarray:
    """A device array holding obj (a host array is copied to the device). copy=None copies only
    when needed; copy=False raises when a copy is needed, as in CuPy 14 (and NumPy 2)."""
    reusable = (isinstance(obj, ndarray) and (dtype is None or _np.dtype(dtype) == obj.dtype)
                and ndmin <= obj.ndim)
    if reusable and not copy:
        return obj
    if copy is False:
        raise ValueError("Unable to avoid copy while creating an array as requested.")
    result = _np.array(_loose(obj), dtype=dtype, copy=True, order=order, ndmin=ndmin)
    return ndarray._of(result)


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False) -> ndarray:
    """a itself when it is a device array of that dtype, else a device copy."""
    return array(a, dtype=dtype, copy=copy, order=order or "K")


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True) -> _np.ndarray:
    """A NumPy array holding a (a device-to-host copy for a device array)."""
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return _np.asarray(a, order=order)


def get_array_module(*args):
    import sys  # noqa: PLC0415

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


def __getattr__(name: str):
    """The other CuPy names, from NumPy: ufuncs and functions made device-only, types and constants as they are."""
    if name not in MODULE_NAMES or not hasattr(_np, name):
        raise AttributeError(f"module 'cupy' has no attribute {name!r}")
    numpy_object = getattr(_np, name)
    if isinstance(numpy_object, _np.ufunc):
        value = ufunc(numpy_object)
    elif isinstance(numpy_object, type) or not callable(numpy_object):
        value = numpy_object  # float32, dtype, finfo, pi, newaxis, ...
    else:
        def value(*args, _function=numpy_object, **kwargs):
            return _call(_function, args, kwargs, f"cupy.{name}")
        value.__name__ = name
    globals()[name] = value
    return value
