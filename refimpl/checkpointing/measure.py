"""Measuring checkpointing exactly: a chain of equal layers that counts its forwards, and counters.

The figures of docs/checkpointing.md come from here, never from a plan's own arithmetic:

- forward calls: a counter inside each layer's forward (TanhLayer.calls), or, for any Module
  (GPT blocks), a forward pre-hook that counts calls (count_forward_calls);
- memory: the engine's saved-tensor ledger (refimpl.autograd.saved_tensors), whose peak is read
  around one forward and backward.

TanhLayer is the layer of the textbook analysis: y = tanh(x W), one autograd Function that saves
only its input x and recomputes x W and the tanh in its backward, so a recorded layer holds
exactly one state (R = A) and the peak is counted in units of one layer input.

Legend: N rows (batch), D width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refimpl import backend
from refimpl.autograd.function import Function
from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Parameter, Tensor
from refimpl.nn.module import Module

from .sequential import checkpoint_sequential


class TanhMatmul(Function):
    """y = tanh(x W); saves x only (W is a parameter, never counted as an activation)."""

    def forward(self, x, w):
        self.save_for_backward(x, w)
        return backend.xp().tanh(x @ w)  # (N, D) @ (D, D) -> (N, D)

    def backward(self, g, needs):
        x, w = self.saved
        y = backend.xp().tanh(x @ w)  # recomputed: (N, D)
        gz = g * (1.0 - y * y)  # d loss / d (x W): (N, D)
        dx = gz @ w.T if needs[0] else None  # (N, D)
        dw = x.T @ gz if needs[1] else None  # (D, D)
        return dx, dw


class TanhLayer(Module):
    """One layer of the test chain; `calls` counts its forwards (with or without grad)."""

    def __init__(self, width: int, rng: np.random.Generator, dtype="float64") -> None:
        super().__init__()
        self.weight = Parameter(backend.asarray(rng.standard_normal((width, width)) / np.sqrt(width), dtype=dtype))
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return TanhMatmul.apply(x, self.weight)


def tanh_chain(n: int, width: int = 8, seed: int = 0, dtype="float64") -> list[TanhLayer]:
    rng = np.random.default_rng(seed)
    return [TanhLayer(width, rng, dtype) for _ in range(n)]


class count_forward_calls:
    """Context manager counting the calls of each Module in `modules` (forward pre-hooks).

        with count_forward_calls(model.blocks) as counter:
            ...
        counter.calls  # one count per module, recomputations included
    """

    def __init__(self, modules) -> None:
        self.modules = list(modules)
        self.calls = [0] * len(self.modules)

    def __enter__(self):
        def counter(i):
            def hook(module, args):
                self.calls[i] += 1
            return hook

        self.handles = [m.register_forward_pre_hook(counter(i)) for i, m in enumerate(self.modules)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False

    @property
    def total(self) -> int:
        return sum(self.calls)


@dataclass(frozen=True)
class Measured:
    forward_calls: int  # layer forwards in one forward + backward
    extra_forwards: int  # forward_calls − n
    peak_bytes: int  # peak of the chain's saved bytes above what was saved before it
    input_bytes: int  # one layer input A

    @property
    def peak_states(self) -> float:
        return self.peak_bytes / self.input_bytes


def measure_chain(layers: list[TanhLayer], plan, batch: int = 4, seed: int = 1) -> Measured:
    """One forward and backward of the chain under `plan`, measured by the counters and the ledger."""
    width = layers[0].weight.shape[0]
    x = Tensor(np.random.default_rng(seed).standard_normal((batch, width)).astype(layers[0].weight.dtype),
               requires_grad=True)
    for layer in layers:
        layer.calls = 0
    base = saved_tensors.live_bytes
    saved_tensors.reset_peak()
    y = checkpoint_sequential(layers, x, plan)
    y.backward(np.ones_like(y.data))
    assert saved_tensors.live_bytes == base, "saved tensors leaked"
    calls = sum(layer.calls for layer in layers)
    return Measured(calls, calls - len(layers), saved_tensors.peak_bytes - base, x.data.nbytes)
