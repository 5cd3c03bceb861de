"""cupyx for the CPU stand-in of CuPy: scatter_add and scipy.special.erf (see ../cupy/__init__.py)."""

import cupy as _cupy


def scatter_add(a, slices, value) -> None:
    """a[slices] += value with repeated indices adding up (CuPy's older spelling of cupy.add.at)."""
    _cupy.add.at(a, slices, value)

