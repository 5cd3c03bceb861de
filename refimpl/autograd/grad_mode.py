"""Whether operations are recorded for backward (`no_grad()` turns recording off)."""

from __future__ import annotations

import functools

_enabled = True


def is_enabled() -> bool:
    return _enabled


def set_enabled(enabled: bool) -> None:
    """Turn recording on or off (what no_grad does on entry; the F&B Interleaver restores a task's
    own setting when it resumes: parallel/pipeline/overlap.py)."""
    global _enabled
    _enabled = enabled


class no_grad:
    """Context manager (and decorator) in which no operation is recorded for backward."""

    def __enter__(self):
        global _enabled
        self._previous, _enabled = _enabled, False
        return self

    def __exit__(self, *exc):
        global _enabled
        _enabled = self._previous
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with no_grad():
                return fn(*args, **kwargs)

        return wrapper


class enable_grad(no_grad):
    """Context manager in which operations are recorded again (used by checkpoint recomputation)."""

    def __enter__(self):
        global _enabled
        self._previous, _enabled = _enabled, True
        return self
