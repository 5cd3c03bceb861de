"""SGD with momentum (PyTorch's convention) and optional weight decay.

    g ← g + λ θ                       (weight decay, coupled)
    b ← μ b + g   (b = g at the first step)
    θ ← θ − lr · b

`update` works on any arrays of equal shape, a whole parameter or a flat shard of many (ZeRO).
"""

from __future__ import annotations

from refimpl import backend

from .base import ArrayOptimizer


class SGD(ArrayOptimizer):
    def __init__(self, params=(), lr: float = 0.1, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"SGD: bad hyper-parameters lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        super().__init__(params)

    def init_state(self, param) -> dict:
        return {"step": 0, "momentum": backend.xp().zeros_like(param) if self.momentum else None}

    def update(self, param, grad, state: dict) -> None:
        if self.weight_decay:
            grad = grad + self.weight_decay * param
        state["step"] += 1
        if self.momentum:
            buf = state["momentum"]
            if state["step"] == 1:
                buf[...] = grad
            else:
                buf *= self.momentum
                buf += grad
            grad = buf
        param -= self.lr * grad

    def update_error_bound(self, grad, grad_error, state_before: dict):
        """θ moves by lr·(μ b + g + λθ): a gradient off by δ moves it by lr·δ more or less."""
        return self.lr * grad_error
