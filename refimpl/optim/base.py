"""What every optimizer here shares: per-parameter state, step() over parameters, zero_grad().

A subclass defines `init_state(param_array) -> dict` and `update(param, grad, state)`, which works
on arrays of any shape: a whole parameter, or a flat shard of many (ZeRO steps its shard with the
same code).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ArrayOptimizer:
    def __init__(self, params) -> None:
        self.params = list(params)
        self.state = [self.init_state(p.data) for p in self.params]

    def init_state(self, param) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def update(self, param, grad, state: dict) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def update_error_bound(self, grad, grad_error, state_before: dict):  # pragma: no cover - abstract
        """Element-wise bound on how differently `update` moves a parameter, from `state_before`,
        when the gradient `grad` is off by at most `grad_error` per element (verify --dtype mixed)."""
        raise NotImplementedError

    def step(self) -> None:
        for p, state in zip(self.params, self.state):
            if p.grad is not None:
                self.update(p.data, p.grad, state)

    def zero_grad(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad[...] = 0


@dataclass
class StepResult:
    """What one optimizer step of a trainer did (parallel/trainer.py reads it)."""

    applied: bool  # False when mixed precision found an overflow and every rank skipped the step
    grads: list = field(default_factory=list)  # per group (or parameter), the gradient as used (unscaled, clipped)
    norm: float | None = None  # global gradient norm before clipping (None when not computed)
