"""Recording mode: one object sees every operation as it runs, and may decide what it saves.

Automatic checkpoint selection (refimpl/checkpointing/auto.py, after Salimans and Bulatov's
gradient-checkpointing package, 2018) needs the forward graph of an arbitrary function of
tensors: which operation ran, on which tensors, in what order. An eager engine has no graph
before it runs, so the engine offers three small hooks instead, all inactive unless installed:

    intercepting(obj)   Function.apply hands every call to obj.apply(cls, args, options); obj
                        runs it (usually through `run`, the ordinary path) and notes it down.
                        Module calls are reported too (obj.enter_module / obj.leave_module), so
                        a recomputation can fire the modules' forward pre-hooks again.
    deferring_saves()   while true, save_for_backward keeps its arrays aside, uncounted; the
                        interceptor decides afterwards which ones are kept (and counted by the
                        saved-tensor ledger) and which become references recomputed later
                        (Function.settle_saved).
    counting_forwards() counts every operation's forward (one per apply, plus the re-runs a
                        recomputation reports through `forward_ran`), by operation name.

Without an interceptor, apply costs one extra global read; nothing else changes.
"""

from __future__ import annotations

from collections import Counter

_interceptor = None  # the object that sees every Function.apply, or None
_defer_saves = False  # save_for_backward keeps its arrays aside for the interceptor to settle
_counters: list[Counter] = []  # active forward counters


def current():
    """The installed interceptor, or None."""
    return _interceptor


def run(cls, args: tuple, options: dict):
    """The ordinary path of Function.apply (what an interceptor calls to run the operation)."""
    return cls._apply(*args, **options)


class intercepting:
    """Context manager: `interceptor` sees every operation (and module call) inside it."""

    def __init__(self, interceptor) -> None:
        self.interceptor = interceptor

    def __enter__(self):
        global _interceptor
        self._previous, _interceptor = _interceptor, self.interceptor
        return self.interceptor

    def __exit__(self, *exc):
        global _interceptor
        _interceptor = self._previous
        return False


def state() -> tuple:
    """(interceptor, deferring saves): what a cooperative task switch must put back (pipeline/overlap.py)."""
    return _interceptor, _defer_saves


def set_state(saved: tuple) -> None:
    global _interceptor, _defer_saves
    _interceptor, _defer_saves = saved


def module_entered(module) -> None:
    if _interceptor is not None and hasattr(_interceptor, "enter_module"):
        _interceptor.enter_module(module)


def module_left(module) -> None:
    if _interceptor is not None and hasattr(_interceptor, "leave_module"):
        _interceptor.leave_module(module)


def saves_deferred() -> bool:
    return _defer_saves


class deferring_saves:
    """Context manager: save_for_backward keeps its arrays aside (Function._pending_saves), uncounted."""

    def __init__(self, on: bool = True) -> None:
        self.on = on

    def __enter__(self):
        global _defer_saves
        self._previous, _defer_saves = _defer_saves, self.on
        return self

    def __exit__(self, *exc):
        global _defer_saves
        _defer_saves = self._previous
        return False


def forward_ran(name: str) -> None:
    """Count one forward of the operation `name` in every active counter."""
    for counter in _counters:
        counter[name] += 1


class counting_forwards:
    """Context manager: `with counting_forwards() as calls:` -- calls[op name] = forwards run inside
    (into `counter`, a Counter or a subclass of it, when one is given)."""

    def __init__(self, counter: Counter | None = None) -> None:
        self.counter = counter

    def __enter__(self) -> Counter:
        self.calls = Counter() if self.counter is None else self.counter
        _counters.append(self.calls)
        return self.calls

    def __exit__(self, *exc):
        _counters[:] = [c for c in _counters if c is not self.calls]  # by identity: equal counts are not it
        return False
