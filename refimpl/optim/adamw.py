"""AdamW (Loshchilov & Hutter, arXiv 1711.05101): Adam with decoupled weight decay.

For parameter θ, gradient g, step t (from 1):

    m ← β₁ m + (1 − β₁) g              v ← β₂ v + (1 − β₂) g²
    m̂ = m / (1 − β₁ᵗ)                  v̂ = v / (1 − β₂ᵗ)
    θ ← θ − lr·λ·θ − lr · m̂ / (√v̂ + ε)

`update` works on any arrays of equal shape — a whole parameter or a flat slice of many — so ZeRO
steps only its shard of the master weights with the same code (optimizer state K = 2 arrays of
θ's size: 8 bytes per float32 parameter). Weight decay applies uniformly to every element given.
"""

from __future__ import annotations

import math

from refimpl import backend

from .base import ArrayOptimizer


class AdamW(ArrayOptimizer):
    def __init__(self, params=(), lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"AdamW: bad hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        super().__init__(params)

    def init_state(self, param) -> dict:
        xp = backend.xp()
        return {"step": 0, "m": xp.zeros_like(param), "v": xp.zeros_like(param)}

    def update(self, param, grad, state: dict) -> None:
        """One AdamW step on arrays `param` (in place) given `grad`."""
        b1, b2 = self.betas
        state["step"] += 1
        t = state["step"]
        m, v = state["m"], state["v"]
        m *= b1
        m += (1 - b1) * grad
        v *= b2
        v += (1 - b2) * (grad * grad)
        step_size = self.lr / (1 - b1 ** t)
        denom = backend.xp().sqrt(v / (1 - b2 ** t))
        denom += self.eps
        if self.weight_decay:
            param *= 1 - self.lr * self.weight_decay
        param -= step_size * (m / denom)

    def update_error_bound(self, grad, grad_error, state_before: dict):
        """How far AdamW's step can move when g is off by at most δ (element-wise), from the same state.

        With a = (1−β₁)/(1−β₁ᵗ), b = (1−β₂)/(1−β₂ᵗ) and v̂₀ = β₂ v_before/(1−β₂ᵗ) (the part of v̂
        that does not depend on this step's g), m̂ moves by at most a·δ and √v̂ by at most √b·δ,
        and √v̂ ≥ D − ε on both sides, D = √(v̂₀ + b·max(|g| − δ, 0)²) + ε. So

            |Δθ| ≤ lr · min(2·Cₜ, (a + Cₜ·√b) · δ / D),

        where Cₜ = (a/√b)·√(Σ_{j<t} (β₁²/β₂)ʲ) (infinite for β₂ = 0 after the first step) bounds
        |m̂|/√v̂ (Cauchy–Schwarz over the history): one step moves θ by at most lr·Cₜ whatever g is.
        A gradient within δ of zero may change sign (at t = 1, where v̂₀ = 0, θ may then differ by up
        to 2·lr); a larger one moves θ by ≈ 2·lr·δ/|g|.
        """
        xp = backend.xp()
        b1, b2 = self.betas
        t = state_before["step"] + 1
        a, b = (1 - b1) / (1 - b1 ** t), (1 - b2) / (1 - b2 ** t)
        c_t = (a / b ** 0.5) * _geometric_sum(b1 * b1, b2, t) ** 0.5
        smallest = xp.maximum(xp.abs(grad) - grad_error, 0)  # the least |g| either side can have
        d = xp.sqrt(b2 * state_before["v"] / (1 - b2 ** t) + b * smallest * smallest) + self.eps
        if c_t == float("inf"):  # β₂ = 0: |m̂|/√v̂ has no bound, nor has the step, wherever g may move
            return xp.where(grad_error > 0, xp.inf, 0.0)
        return self.lr * xp.minimum(2 * c_t, (a + c_t * b ** 0.5) * grad_error / d)


def _geometric_sum(numerator: float, denominator: float, t: int) -> float:
    """Σ_{j<t} rʲ for r = numerator/denominator ≥ 0, as expm1(t·ln r)/expm1(ln r): exact to rounding
    near r = 1 (where it tends to t), inf when it overflows or r = ∞ (β₂ = 0) and t > 1."""
    if t == 1 or numerator == 0:
        return 1.0
    if denominator == 0:
        return float("inf")
    log_ratio = math.log(numerator) - math.log(denominator)
    if log_ratio == 0:
        return float(t)
    try:
        return math.expm1(t * log_ratio) / math.expm1(log_ratio)
    except OverflowError:
        return float("inf")
