"""Mixed precision and bfloat16 against their single-process reference: the tolerance, from rounding.

`verify --dtype mixed` (verify.py) compares a distributed mixed-precision run (float16 parameters
and gradients, float32 master weights, dynamic loss scaling; optim/precision.py,
parallel/zero/optimizer.py) with local_trainer.LocalTrainer running the same recipe, in lockstep: before
each step the reference takes the distributed run's master weights, optimizer state and loss
scale. This module holds what that comparison needs beyond refimpl/tools/compare.py: the tolerances
(mixed_tolerance states the formulas), the measured magnitudes of the partial gradients they are
built on, and the comparison of one step.

`verify --dtype bf16` runs the same lockstep comparison (bfloat16 parameters, float32 master
weights, no loss scale: optim/precision.py) with bfloat16's unit roundoff in the same formulas.
"""

from __future__ import annotations

import numpy as np

from refimpl import backend
from refimpl.objective import count_targets, micro_batch_loss, split_batch
from refimpl.tools.compare import Comparison, compare_arrays, compare_step, compare_values

FLOAT16_UNIT_ROUNDOFF = 2.0 ** -11  # u: float16 rounds a real x to x(1 + δ), |δ| ≤ u (11-bit significand)
FLOAT16_SUBNORMAL_HALF_SPACING = 2.0 ** -25  # η: below 2⁻¹⁴ float16 rounds to a multiple of 2⁻²⁴
BFLOAT16_UNIT_ROUNDOFF = 2.0 ** -8  # u: 8-bit significand (7 stored bits)
# η for bfloat16: not underflow (bfloat16 has float32's exponent range) but a floor for float32's own
# noise where the exact gradient is zero (mixed_tolerance's docstring); float16's η, at S = 1.
BFLOAT16_ABSOLUTE_FLOOR = 2.0 ** -25
ROUNDING = {"mixed": (FLOAT16_UNIT_ROUNDOFF, FLOAT16_SUBNORMAL_HALF_SPACING),
            "bf16": (BFLOAT16_UNIT_ROUNDOFF, BFLOAT16_ABSOLUTE_FLOOR)}


def mixed_tolerance(world_size: int, grad_accum: int, dtype: str = "mixed") -> dict:
    """Mixed precision's (or bfloat16's) tolerances, from 16-bit rounding of the summed gradients.

    A gradient element that reaches the optimizer is the sum of K = N·g partial gradients p_k
    (N ranks, g micro-batches per rank; p_k is the gradient of the k-th B/K rows of the global
    batch): each p_k·S is computed in float32 and rounded to float16, and every addition of the
    reduction rounds to float16 again. One process rounds its g micro-batch gradients and their
    sum the same way. Recursive summation of K terms is within (K−1)·u·Σ|terms| of the exact sum
    and each term is within u·|term| of its float32 value (Higham, Accuracy and Stability of
    Numerical Algorithms, §4.2), u = 2⁻¹¹ (float16's unit roundoff). So with A_i = Σ_k |p_k,i|,
    which verify measures on rank 0 by running the K pieces of the batch through the reference's
    model, both sides are within (2K − 1)·u·A_i of the exact gradient, and, per element,

        |g_i − g_ref,i| ≤ δ_i = 4K·u·(A_i + c·|g_ref,i|·‖A‖/‖g_ref‖) + 4K·η/S

    where the second term (c = 1 with clipping, 0 without) covers the clipping coefficient, which
    each side computes from its own gradient norm, and the third float16's underflow: below 2⁻¹⁴
    the spacing of float16 is fixed (subnormals), so a rounding errs by up to η = 2⁻²⁵ absolutely,
    η/S once the loss scale S is divided out. A_i is much larger than |g_i| where the ranks'
    partial gradients cancel (an output bias, whose per-example gradients sum to nearly zero).

    The master weights are compared *in lockstep*: before each step the reference takes the
    distributed run's master weights, optimizer state and loss scale (Trainer.full_optimizer_state,
    parallel/trainer.py), so each step's difference comes from that step's gradients alone and does
    not compound (AdamW turns a sign flip of a near-zero gradient into a 2·lr difference, which an
    independent run would then carry and amplify). From the same state, an update differs by at most the
    optimizer's update_error_bound(δ) (SGD: lr·δ; AdamW: optim/adamw.py), so

        |w_i − w_ref,i| ≤ 4·u₃₂·|w_ref,i| + update_error_bound(δ)_i,      u₃₂ = 2⁻²⁴

    and the loss, a float32 forward of the same float16 weights on differently split batches, is
    held to rtol 4K·u. A loss scale that is never divided out makes every gradient S = 2¹⁶ times
    too large, thousands of times δ (with SGD, or AdamW without clipping; clipping to a norm the
    gradient exceeds, then AdamW, gives the same update either way).

    bfloat16 (dtype "bf16"): the same formulas with u = 2⁻⁸ and S = 1 (no loss scale). Each
    micro-batch's gradient is rounded to bfloat16 once (the engine's cast to the parameter's dtype)
    and then summed in float32 -- over micro-batches and over ranks, since MPI has no bfloat16 --
    which is within the float16 analysis's (2K − 1)·u·A_i, so δ_i holds. bfloat16 has float32's
    exponent range, so nothing underflows; η keeps float16's value 2⁻²⁵ (S = 1) as a floor for what
    A_i does not bound: where the exact gradient is zero (the key bias's: softmax ignores a constant
    added to every score), each side's gradient is float32 rounding noise of its own batch split,
    about 1e-12 here, and A_i, a sum of such noise, can be smaller than the difference. 4K·η is
    far below the gradients' own rounding (u·|g| ≈ 1e-5 for |g| ≈ 1e-3). The weights are the float32
    master weights, held to 4·u₃₂·|w| + update_error_bound(δ) as above. Keeping the weights in
    bfloat16 only (no master weights) rounds every update to within u·|w|, which no such bound
    allows (tests/test_bf16.py measures how far beyond it).
    """
    if dtype not in ROUNDING:
        raise ValueError(f"mixed_tolerance: dtype must be one of {', '.join(ROUNDING)}, got {dtype!r}")
    u, eta = ROUNDING[dtype]
    k = world_size * grad_accum
    return {"k": k, "grad_rtol": 4 * k * u, "weight_rtol": 4 * 2.0 ** -24, "loss_rtol": 4 * k * u, "u": u,
            "eta": eta}


def partial_gradient_magnitudes(reference, x, y, pieces: int) -> dict:
    """A = Σ_k |p_k| over the K = `pieces` row blocks of the global batch, at the reference's weights.

    The blocks are those the distributed run sums (rank r's micro-batch i is block r·g + i), with
    the same dropout masks (rows keyed by batch) and the same loss scaling; the reference's
    gradients are zeroed afterwards, so its own step is untouched.
    """
    model, scale = reference.model, (reference.scaler.scale if reference.scaler is not None else 1.0)
    total = count_targets(y)
    magnitudes = {name: 0.0 for name, _ in model.named_parameters()}
    for k, (xb, yb) in enumerate(split_batch(x, y, pieces, "pieces of the global batch")):
        loss = micro_batch_loss(model, xb, yb, total, rows=(k * len(xb), len(x), reference.steps_done))
        (loss * scale).backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                magnitudes[name] = magnitudes[name] + np.abs(backend.to_host(p.grad).astype(np.float64)) / scale
        reference.optimizer.zero_grad()
    return magnitudes


def compare_mixed_step(step, ours, ref, state_before, optimizer, tol, magnitudes, clipping, scale) -> Comparison:
    """One lockstep step of mixed precision at mixed_tolerance's bounds."""
    if ours["skipped"] or ref["skipped"]:  # both skipped: parameters unchanged and equal; one: a failure
        return compare_step(step, ours, ref, tol["weight_rtol"], 0.0)
    norm = lambda arrays: float(np.sqrt(sum(float(np.sum(np.square(a))) for a in arrays)))  # noqa: E731
    ratio = norm(magnitudes.values()) / max(norm(ref["grads"].values()), 1e-300) if clipping else 0.0
    underflow = tol["k"] * 4 * tol.get("eta", FLOAT16_SUBNORMAL_HALF_SPACING) / scale
    delta = {name: tol["grad_rtol"] * (magnitudes[name] + ratio * np.abs(g)) + underflow
             for name, g in ref["grads"].items()}
    grads = compare_arrays(ours["grads"], ref["grads"], 0.0, delta, what="gradient", step=step)
    bound = {name: backend.to_host(optimizer.update_error_bound(backend.asarray(ref["grads"][name]),
                                                            backend.asarray(delta[name]), state_before[name]))
             for name in state_before}
    weights = compare_arrays(ours["params"], ref["params"], tol["weight_rtol"], bound, what="master weight", step=step)
    loss = compare_values(ours["loss"], ref["loss"], tol["loss_rtol"], 0.0, "loss", step)
    return grads.merge(weights).merge(loss)


def state_by_name(reference) -> dict:
    """{name: copy of the reference's optimizer state for that parameter} (mixed precision)."""
    return {name: {k: v.copy() if hasattr(v, "copy") else v for k, v in state.items()}
            for (name, _), state in zip(reference.model.named_parameters(), reference.states)}
