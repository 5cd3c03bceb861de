"""cupyx.scipy.special.erf for the CPU stand-in of CuPy: math.erf per element, on device arrays only."""

import math

import cupy as _cupy
import numpy as _np


def erf(x):
    if not isinstance(x, _cupy.ndarray):
        raise TypeError(f"Unsupported type {type(x)}: cupyx.scipy.special.erf takes a cupy.ndarray")
    values = _np.frompyfunc(math.erf, 1, 1)(x._array).astype(x.dtype)
    return _cupy.ndarray._of(values)
