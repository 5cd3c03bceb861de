"""Is a run the same as its single-process reference? The one comparison every check uses.

`verify`, `verify --sweep`, the test programs and docs/examples all compare a distributed run with
single-process training on the same global batches through this module, so that there is exactly
one definition of "the same":

    an element passes  ⇔  both values are finite  and  |ours − reference| ≤ atol + rtol · |reference|

A NaN or an inf on either side fails, with a message that names the step, the tensor and the side
(two NaNs are not equal, and `max(0.0, nan)` is 0.0 in Python: a fold with `max` would let NaN
pass, so the non-finite check is explicit). The figure reported is `tolerance_used`, the largest
|ours − reference| / (atol + rtol·|reference|) over all elements: the check passes when it is at
most 1, and it is inf when anything is not finite.

The only exception is mixed precision's skipped step (optim/precision.py): when the loss
scale makes a gradient overflow, both runs must skip that step (their gradients then hold infs on
purpose); a step that one side skips and the other does not is a failure.

Default tolerances (docs/design.md, "Conventions"): float64 rtol 1e-10, atol 1e-12; float32 rtol 1e-5, atol 1e-6.
Mixed precision's tolerance has its own formula (compare_mixed.mixed_tolerance, docs/verify_your_algorithm.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TOLERANCES = {"float64": (1e-10, 1e-12), "float32": (1e-5, 1e-6)}


@dataclass
class Comparison:
    """The outcome of comparing named arrays (or one step: loss, gradients, parameters)."""

    ok: bool = True
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0  # |diff| / max(|reference|, atol): large for near-zero elements within atol
    tolerance_used: float = 0.0  # largest |diff| / (atol + rtol |reference|); passes at <= 1; inf if non-finite
    worst_name: str | None = None  # the tensor with the largest tolerance_used
    worst_what: str | None = None  # what worst_name is: "gradient", "parameter", "master weight" or "loss"
    problems: list = field(default_factory=list)  # one line each: non-finite values, missing names, shapes

    def merge(self, other: Comparison) -> Comparison:
        """Both comparisons together (the worse figures, all problems)."""
        worst = other if other.tolerance_used > self.tolerance_used else self
        return Comparison(self.ok and other.ok, max(self.max_abs_diff, other.max_abs_diff),
                          max(self.max_rel_diff, other.max_rel_diff), worst.tolerance_used, worst.worst_name,
                          worst.worst_what, self.problems + other.problems)


def _nonfinite(values: np.ndarray, name: str, side: str, where: str) -> str | None:
    bad = ~np.isfinite(values)
    if not bad.any():
        return None
    kinds = [k for k, mask in (("NaN", np.isnan(values)), ("inf", np.isinf(values))) if mask.any()]
    return f"{where}{name} has {int(bad.sum())} non-finite element(s) ({' and '.join(kinds)}) " \
           f"of {values.size} on the {side} side"


def compare_arrays(ours: dict, reference: dict, rtol: float, atol: float, *, what: str = "",
                   step: int | None = None) -> Comparison:
    """Compare {name: array} with {name: array}: same names, same shapes, every element within tolerance.

    `what` ("gradient", "parameter") and `step` only make the messages precise. `atol` may also be
    {name: array or number}: an element-wise absolute tolerance (mixed precision's, verify.py).
    """
    where = (f"step {step}: " if step is not None else "") + (f"{what} " if what else "")
    result = Comparison()
    missing = sorted(set(ours) ^ set(reference))
    if missing:
        result.ok, result.tolerance_used = False, float("inf")
        result.problems.append(f"{where}names differ between the runs: {missing}")
    for name in sorted(set(ours) & set(reference)):
        a, b = np.asarray(ours[name], dtype=np.float64), np.asarray(reference[name], dtype=np.float64)
        if a.shape != b.shape:
            result.ok, result.tolerance_used = False, float("inf")
            result.problems.append(f"{where}{name} has shape {a.shape} on the distributed side, "
                                   f"{b.shape} in the reference")
            continue
        bad = [m for m in (_nonfinite(a, name, "distributed", where), _nonfinite(b, name, "reference", where)) if m]
        if bad:
            result.ok, result.tolerance_used = False, float("inf")
            result.worst_name, result.worst_what = name, what or None
            result.problems.extend(bad)
            continue
        if not a.size:
            continue
        tol = atol[name] if isinstance(atol, dict) else atol
        diff = np.abs(a - b)
        allowed = tol + rtol * np.abs(b)
        used = float(np.max(np.divide(diff, allowed, out=np.where(diff > 0, np.inf, 0.0), where=allowed > 0)))
        result.max_abs_diff = max(result.max_abs_diff, float(diff.max()))
        relative = diff / np.maximum(np.abs(b), max(float(np.max(tol)), 1e-300))
        result.max_rel_diff = max(result.max_rel_diff, float(relative.max()))
        if used > result.tolerance_used:  # two identical runs have no worst tensor (None)
            result.tolerance_used = used
            result.worst_name, result.worst_what = name, what or None
    result.ok = result.ok and result.tolerance_used <= 1.0
    return result


def compare_values(ours: float, reference: float, rtol: float, atol: float, name: str,
                   step: int | None = None) -> Comparison:
    """Compare two numbers (a step's loss) by the same rule."""
    result = compare_arrays({name: np.float64(ours)}, {name: np.float64(reference)}, rtol, atol, step=step)
    result.worst_what = name if result.worst_name is not None else None
    return result


def compare_step(step: int, ours: dict, reference: dict, rtol: float, atol: float, grad_tolerance=None) -> Comparison:
    """One optimizer step: {"loss", "grads", "params", "skipped"} of each run.

    grad_tolerance=(rtol, atol) compares gradients at another tolerance than loss and parameters
    (mixed precision). A step that both runs skipped (mixed precision's overflow rule) compares
    only the parameters, which must be unchanged and equal; a step skipped by one run only fails.
    """
    skipped, ref_skipped = bool(ours.get("skipped")), bool(reference.get("skipped"))
    if skipped != ref_skipped:
        who = "distributed run" if skipped else "reference"
        return Comparison(False, tolerance_used=float("inf"),
                          problems=[f"step {step}: only the {who} skipped the step (loss-scale overflow)"])
    result = compare_arrays(ours["params"], reference["params"], rtol, atol, what="parameter", step=step)
    if skipped:
        return result
    result = result.merge(compare_values(ours["loss"], reference["loss"], rtol, atol, "loss", step))
    g_rtol, g_atol = grad_tolerance or (rtol, atol)
    return result.merge(compare_arrays(ours["grads"], reference["grads"], g_rtol, g_atol, what="gradient", step=step))
