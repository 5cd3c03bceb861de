"""Saved-tensor accounting: the one place every tensor saved for backward goes through.

An autograd engine keeps, for each recorded operation, the arrays its backward needs (the input
of a matmul, the output of a tanh, a dropout mask). Those saved activations are what activation
checkpointing trades for recomputation and what pipeline schedules keep in flight, so refimpl
counts them exactly here instead of estimating them from process RSS:

    live_bytes  = sum of nbytes over distinct arrays currently saved for a pending backward
    peak_bytes  = max of live_bytes since the last reset_peak()

Rules (each one tested):
- an array is counted once however many operations save it (keyed by object identity), and is
  released when the last operation that saved it has run its backward (or was freed);
- parameters are model state, not activations: arrays belonging to Parameters are never counted
  here (the memory ledger counts them under "parameters");
- a view saved separately from its base counts its own nbytes (operations avoid saving views).
"""

from __future__ import annotations


class SavedTensorLedger:
    """Live and peak bytes of the distinct arrays saved for backward."""

    def __init__(self) -> None:
        self._held: dict[int, list] = {}  # id(array) -> [array, number of savers]
        self.live_bytes = 0
        self.peak_bytes = 0

    def add(self, array) -> None:
        entry = self._held.get(id(array))
        if entry is not None:
            entry[1] += 1
            return
        self._held[id(array)] = [array, 1]
        self.live_bytes += array.nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def remove(self, array) -> None:
        entry = self._held[id(array)]
        entry[1] -= 1
        if entry[1] == 0:
            del self._held[id(array)]
            self.live_bytes -= array.nbytes

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current live bytes."""
        self.peak_bytes = self.live_bytes


#: The process-wide ledger of saved activations (read it, or reset its peak, around a step).
saved_tensors = SavedTensorLedger()
