"""cupy.cuda for the CPU stand-in: one "device" (CUPY_STANDIN_DEVICES to pretend more), no streams."""

from __future__ import annotations

import os
import types

_current = 0


def _count() -> int:
    return int(os.environ.get("CUPY_STANDIN_DEVICES", "1"))


def _properties(device: int) -> dict:
    if not 0 <= device < _count():
        raise ValueError(f"invalid device ordinal {device}")
    return {"name": b"CPU stand-in for CuPy (no GPU)", "totalGlobalMem": 0, "major": 0, "minor": 0}


runtime = types.SimpleNamespace(getDeviceCount=_count, getDeviceProperties=_properties)


class Device:
    def __init__(self, device: int | None = None):
        self.id = _current if device is None else int(device)
        _properties(self.id)  # an invalid ordinal fails as it would on a GPU

    def use(self) -> None:
        global _current
        _current = self.id

    def synchronize(self) -> None:
        pass


class _Stream:
    def synchronize(self) -> None:
        pass


def get_current_stream() -> _Stream:
    return _Stream()
