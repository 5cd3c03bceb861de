"""Gradient clipping by global norm.

    ‖g‖ = √(Σ_i ‖g_i‖²)  over all gradients;   g ← g · min(1, max_norm / (‖g‖ + 1e-6))

Sharded training (ZeRO) computes Σ‖g_i‖² over its own shard, all-reduces that one number, and
applies the same coefficient: `clip_coefficient` takes the squared norm so it can be combined.
"""

from __future__ import annotations


def squared_norm(arrays) -> float:
    """Σ‖a‖² over the arrays (float64 accumulation; on a GPU, one device-to-host read at the end)."""
    return float(sum((a.astype("float64") ** 2).sum() for a in arrays if a is not None))


def clip_coefficient(total_squared_norm: float, max_norm: float) -> float:
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    return min(1.0, max_norm / (total_squared_norm ** 0.5 + 1e-6))


def clip_grad_norm_(params, max_norm: float) -> float:
    """Scale the gradients of `params` in place so their global norm is at most max_norm; return the norm before."""
    grads = [p.grad for p in params if p.grad is not None]
    total = squared_norm(grads)
    scale_to_max_norm_(grads, total, max_norm)
    return total ** 0.5


def scale_to_max_norm_(grads, total_squared_norm: float, max_norm: float) -> None:
    """Scale `grads` in place by clip_coefficient(total_squared_norm, max_norm). The squared norm is
    given so that a sharded or pipelined trainer can first sum it over the ranks that hold the rest."""
    coefficient = clip_coefficient(total_squared_norm, max_norm)
    if coefficient < 1.0:
        for g in grads:
            g *= coefficient
