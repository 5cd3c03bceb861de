"""Mixed precision: float16 storage, float32 master weights, dynamic loss scaling; and bfloat16.

Mixed-precision training as the ZeRO paper assumes it (arXiv 1910.02054, section 3.1, after
Micikevicius et al., arXiv 1710.03740): parameters and gradients are stored in float16 (P = G = 2
bytes), the optimizer keeps float32 master weights, momentum and variance (K = 12 bytes), and
each step copies the updated master weights back into the float16 parameters.

NumPy has no fast float16 matrix product, so refimpl's engine treats float16 as a *storage* type:
every operation converts float16 inputs to float32, computes and outputs float32, and a float16
parameter's gradient is cast back to float16 when it is accumulated (autograd/function.py). The
memory the ledger counts is therefore the float16 storage the paper counts; the arithmetic is
float32's. (A GPU does the matrix products in float16 with float32 accumulation.)

Loss scaling. Small gradients underflow in float16 (below 6e-8) and large ones overflow (above
65504). The loss is multiplied by a scale S before backward, so the float16 gradients are S times
the true ones; the optimizer divides by S in float32. Dynamic scaling:

    overflow (any inf or NaN in any rank's gradient shard)  →  skip the step, S ← S · backoff
    `growth_interval` steps in a row without overflow        →  S ← S · growth

Each rank sees only its own shard of the gradients, so the overflow check is combined across
ranks with a max all-reduce of one flag: every rank skips the same step and keeps the same S
(otherwise the replicas of the parameters would diverge, and the next collective would mix steps).

Defaults follow PyTorch's GradScaler and DeepSpeed's fp16 section: S starts at 2^16, growth 2,
backoff 1/2; DeepSpeed's loss_scale_window of 1000 steps is the growth interval.

bfloat16 (--dtype bf16; Kalamkar et al. 2019, arXiv 1905.12322). bfloat16 keeps float32's 8
exponent bits and 7 of its 23 stored mantissa bits, so it spans float32's range (no underflow of
small gradients, hence no loss scaling) at a unit roundoff of u = 2⁻⁸ ≈ 3.9e−3 (float16: 2⁻¹¹,
but 5 exponent bits). NumPy has no bfloat16; ml_dtypes provides the dtype (rounding to nearest
even). The recipe, as refimpl runs it:

    bfloat16    parameters (P = 2 bytes); each micro-batch's gradient as backward produces it
                (the engine casts a leaf's gradient to the leaf's dtype)
    float32     the gradients accumulated over micro-batches and reduced over ranks (G = 4: MPI
                has no bfloat16 datatype, and Megatron-LM also accumulates bfloat16 gradients in
                float32); master weights, AdamW's m and v (K = 12); every operation's arithmetic
                and output, so the activations (autograd/function.py casts bfloat16 inputs)
    no loss scale: the loss's backward starts from 1

Each step updates the float32 master weights and copies them, rounded, into the bfloat16
parameters. Without the master weights an update smaller than half a bfloat16 spacing of the
weight (|Δw| < u·|w|) would be lost: with a small learning rate bfloat16-only weights stop moving.
One process (local_trainer.py) and the distributed trainer with ZeRO 0-3 (whose sharded optimizer
keeps the master weights, parallel/zero/optimizer.py) under every parallelism run it: pipeline
stages exchange float32 activations, tensor parallelism sums a bfloat16 gradient in float32;
docs/llama.md has the details.
"""

from __future__ import annotations

PRECISIONS = ("float32", "float64", "mixed", "bf16")
BFLOAT16_UNIT_ROUNDOFF = 2.0 ** -8  # u: bfloat16 rounds a real x to x(1 + δ), |δ| ≤ u (8-bit significand)


def storage_dtype(precision: str) -> str:
    """The dtype of parameters and gradients for a precision (float16 under mixed, bfloat16 under bf16)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return {"mixed": "float16", "bf16": "bfloat16"}.get(precision, precision)


class LossScaler:
    """Dynamic loss scale; update(overflow) after every step, all ranks with the same flag."""

    def __init__(self, scale: float = 2.0 ** 16, growth: float = 2.0, backoff: float = 0.5,
                 growth_interval: int = 1000, min_scale: float = 1.0) -> None:
        if scale <= 0 or growth < 1 or not 0 < backoff < 1 or growth_interval < 1:
            raise ValueError(f"LossScaler: bad settings scale={scale}, growth={growth}, backoff={backoff}, "
                             f"growth_interval={growth_interval}")
        self.scale, self.growth, self.backoff = float(scale), growth, backoff
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0  # consecutive steps without overflow
        self.skipped = 0  # steps skipped so far

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])
