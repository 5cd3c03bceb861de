"""Neural-network operations as fused autograd Functions.

Each is one Function with a hand-written backward (faster and clearer than a chain of primitive
ops), checked against finite differences by the tests: the class `<Op>Function` (LinearFunction,
LayerNormFunction, ...), and the function `<op>(...)` below it that checks its arguments and
applies it. The Modules of nn/layers.py (Linear, LayerNorm, Embedding, Dropout) hold the
parameters and call these functions. Legend: N rows (any leading dims), C features, V classes /
vocabulary, (…) any leading dimensions.

    linear(x, w, b)            y = x wᵀ + b              w: (out, in), as in PyTorch
    embedding(w, idx)          y = w[idx]                backward scatters-adds into w's rows
    layer_norm(x, w, b, eps)   y = (x − μ)/√(σ² + eps) · w + b  over the last axis
    rms_norm(x, w, eps)        y = x/√(mean(x²) + eps) · w  over the last axis (Llama)
    rotary(x, positions, base) each adjacent pair (x₂ᵢ, x₂ᵢ₊₁) of the last axis rotated by pos·θᵢ (RoPE)
    gelu(x, approximate)       x·Φ(x) ("none") or its tanh approximation ("tanh", GPT-2's)
    swiglu(a, b)               silu(a) ⊙ b,  silu(a) = a·σ(a)  (the gated unit of Llama's MLP)
    softmax(x, axis)           stable: computed from x − max(x)
    causal_softmax(x, m, s)    softmax(s·x) with −∞ where the mask m is True (attention scores)
    cross_entropy(logits, t)   mean (or sum) of −log softmax(logits)[t] over targets ≠ ignore_index
    dropout(x, p, generator)   zero with probability p, scale the rest by 1/(1 − p)

Every backward obeys the `needs` contract of Function (see autograd/function.py): the split
backward asks for activation gradients (x) and weight gradients (w, b) separately.
"""

from __future__ import annotations

import math

from refimpl import backend
from refimpl.autograd.function import Function
from refimpl.autograd.tensor import Tensor


def xp():
    return backend.xp()


def _leading_sum(a, ndim_kept: int):
    """Sum `a` over all but its last `ndim_kept` axes."""
    return a.reshape((-1,) + a.shape[a.ndim - ndim_kept:]).sum(axis=0)


# --- linear and embedding ---------------------------------------------------------------------
class LinearFunction(Function):
    def forward(self, x, w, b):
        self.save_for_backward(x, w)
        y = x @ w.T  # (…, in) @ (in, out) -> (…, out)
        if b is not None:
            y += b
        return y

    def backward(self, g, needs):
        x, w = self.saved
        dx = g @ w if needs[0] else None  # (…, out) @ (out, in) -> (…, in)
        dw = g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1]) if needs[1] else None  # (out, in)
        db = _leading_sum(g, 1) if needs[2] else None  # (out,)
        return dx, dw, db


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features (shape {x.shape}) "
                         f"but the weight expects {w.shape[-1]} (weight shape {w.shape})")
    return LinearFunction.apply(x, w, b)


class EmbeddingFunction(Function):
    def forward(self, w, idx):
        self.idx, self.w_shape = idx, w.shape
        return w[idx]  # (…) -> (…, C)

    def backward(self, g, needs):
        dw = xp().zeros(self.w_shape, g.dtype)
        backend.scatter_add(dw, self.idx.reshape(-1), g.reshape(-1, g.shape[-1]))  # repeated tokens add up
        return dw, None


def embedding(w: Tensor, idx) -> Tensor:
    idx = idx.data if isinstance(idx, Tensor) else xp().asarray(idx)
    if idx.dtype.kind not in "iu":
        raise ValueError(f"embedding: indices must be integers, got dtype {idx.dtype}")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= w.shape[0]):
        raise ValueError(f"embedding: index out of range [0, {w.shape[0]}): min {int(idx.min())}, max {int(idx.max())}")
    return EmbeddingFunction.apply(w, idx)


# --- normalisation ----------------------------------------------------------------------------
class LayerNormFunction(Function):
    def forward(self, x, w, b, eps):
        xhat = x - x.mean(axis=-1, keepdims=True)  # (…, C), centred
        var = (xhat * xhat).mean(axis=-1, keepdims=True)  # (…, 1)
        rstd = 1.0 / xp().sqrt(var + eps)  # (…, 1)
        xhat *= rstd  # normalised in place
        self.save_for_backward(xhat, rstd, w)
        y = xhat * w
        y += b
        return y

    def backward(self, g, needs):
        xhat, rstd, w = self.saved
        dx = dw = db = None
        if needs[0]:
            # dx = rstd · (gw − mean(gw) − x̂ · mean(gw ⊙ x̂)),  gw = g ⊙ w
            gw = g * w  # (…, C)
            dx = gw - gw.mean(axis=-1, keepdims=True)
            dx -= xhat * (gw * xhat).mean(axis=-1, keepdims=True)
            dx *= rstd
        if needs[1]:
            dw = _leading_sum(g * xhat, 1)
        if needs[2]:
            db = _leading_sum(g, 1)
        return dx, dw, db, None


def layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float = 1e-5) -> Tensor:
    if w.shape != (x.shape[-1],) or b.shape != (x.shape[-1],):
        raise ValueError(f"layer_norm: weight {w.shape} and bias {b.shape} must both be ({x.shape[-1]},) "
                         f"for an input of shape {x.shape}")
    return LayerNormFunction.apply(x, w, b, eps)


class RMSNormFunction(Function):
    """Root-mean-square normalisation (Zhang & Sennrich 2019, arXiv 1910.07467), Llama's norm.

        r = 1/√(mean(x²) + eps)   (…, 1)        x̂ = x·r   (…, C)        y = x̂ ⊙ w

    LayerNorm without the centring and the bias. Backward, with gw = g ⊙ w:

        dx = r · (gw − x̂ · mean(gw ⊙ x̂))        dw = Σ_rows g ⊙ x̂
    """

    def forward(self, x, w, eps):
        rstd = 1.0 / xp().sqrt((x * x).mean(axis=-1, keepdims=True) + eps)  # (…, 1)
        xhat = x * rstd  # (…, C)
        self.save_for_backward(xhat, rstd, w)
        return xhat * w

    def backward(self, g, needs):
        xhat, rstd, w = self.saved
        dx = dw = None
        if needs[0]:
            gw = g * w  # (…, C)
            dx = gw - xhat * (gw * xhat).mean(axis=-1, keepdims=True)
            dx *= rstd
        if needs[1]:
            dw = _leading_sum(g * xhat, 1)
        return dx, dw, None


def rms_norm(x: Tensor, w: Tensor, eps: float = 1e-5) -> Tensor:
    if w.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight {w.shape} must be ({x.shape[-1]},) for an input of shape {x.shape}")
    return RMSNormFunction.apply(x, w, eps)


# --- rotary position embedding ----------------------------------------------------------------
def rotary_angles(positions, d_head: int, base: float = 10000.0):
    """(cos, sin) of the angles p·θᵢ, θᵢ = base^(−2i/D) for i < D/2: each (T, D/2) for positions (T,)."""
    theta = base ** (-xp().arange(0, d_head, 2, dtype="float64") / d_head)  # (D/2,)
    angles = xp().asarray(positions, dtype="float64")[:, None] * theta  # (T, D/2)
    return xp().cos(angles), xp().sin(angles)


class RotaryFunction(Function):
    """Rotary position embedding (Su et al. 2021, RoFormer, arXiv 2104.09864, eq. 34).

    The last axis (D, a head's width) is read as D/2 adjacent pairs (x₂ᵢ, x₂ᵢ₊₁), as in RoFormer
    and Meta's Llama code (not the "rotate_half" pairing of GPT-NeoX and Hugging Face, which pairs
    dimension i with i + D/2: the same up to a fixed permutation of the projection's rows). The
    pair at position p is rotated by the angle p·θᵢ, θᵢ = base^(−2i/D):

        y₂ᵢ   = x₂ᵢ cos(pθᵢ) − x₂ᵢ₊₁ sin(pθᵢ)
        y₂ᵢ₊₁ = x₂ᵢ sin(pθᵢ) + x₂ᵢ₊₁ cos(pθᵢ)

    so (R_m q)·(R_n k) = q·(R_{n−m} k): attention scores depend on positions only through n − m.
    A rotation's inverse is its transpose, so backward rotates g by −pθᵢ. No array is saved: cos and
    sin are (T, D/2) constants of the positions.
    """

    def forward(self, x, cos, sin):
        self.cos, self.sin = cos, sin  # (T, D/2) each, broadcast over the leading axes of x (…, T, D)
        return self._rotate(x, sin)

    def _rotate(self, x, sin):
        pairs = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))  # (…, T, D/2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]  # (…, T, D/2) each
        y = xp().empty(pairs.shape, dtype=x.dtype)
        y[..., 0] = even * self.cos - odd * sin
        y[..., 1] = even * sin + odd * self.cos
        return y.reshape(x.shape)  # (…, T, D)

    def backward(self, g, needs):
        return self._rotate(g, -self.sin), None, None


def rotary(x: Tensor, positions, base: float = 10000.0) -> Tensor:
    """RoPE on x of shape (…, T, D): the pairs at row t rotated by positions[t]·θᵢ (global positions)."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary: the head width must be even (RoPE rotates pairs of dimensions), got {d}")
    positions = positions.data if isinstance(positions, Tensor) else xp().asarray(positions)
    if positions.shape != (x.shape[-2],):
        raise ValueError(f"rotary: {positions.shape} positions for {x.shape[-2]} rows of an input of shape {x.shape}")
    cos, sin = rotary_angles(positions, d, base)
    return RotaryFunction.apply(x, cos.astype(x.dtype), sin.astype(x.dtype))


# --- activations ------------------------------------------------------------------------------
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def _tanh_inner(x):
    """tanh(√(2/π)·x·(1 + 0.044715x²)) in a single new array."""
    t = x * x
    t *= _GELU_C
    t += 1.0
    t *= x
    t *= _SQRT_2_OVER_PI
    return xp().tanh(t, out=t)


class GeluFunction(Function):
    def forward(self, x, approximate):
        self.approximate = approximate
        self.save_for_backward(x)
        if approximate == "tanh":
            y = _tanh_inner(x)  # tanh(√(2/π)(x + 0.044715x³)), computed in place (few temporaries)
            y += 1.0
            y *= x
            y *= 0.5
            return y
        return 0.5 * x * (1.0 + backend.erf(x * (1.0 / math.sqrt(2.0))))

    def backward(self, g, needs):
        (x,) = self.saved
        if self.approximate == "tanh":
            # slope = ½(1 + t) + ½x(1 − t²)·√(2/π)(1 + 3·0.044715x²),  t = tanh(√(2/π)(x + 0.044715x³))
            t = _tanh_inner(x)
            slope = t * t
            xp().subtract(1.0, slope, out=slope)
            slope *= x
            slope *= 0.5 * _SQRT_2_OVER_PI
            x2 = x * x
            x2 *= 3.0 * _GELU_C
            x2 += 1.0
            slope *= x2
            t += 1.0
            t *= 0.5
            slope += t
        else:
            cdf = 0.5 * (1.0 + backend.erf(x * (1.0 / math.sqrt(2.0))))
            pdf = xp().exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
            slope = cdf + x * pdf
        slope *= g
        return slope, None


def gelu(x: Tensor, approximate: str = "tanh") -> Tensor:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"gelu: approximate must be 'tanh' or 'none', got {approximate!r}")
    return GeluFunction.apply(x, approximate)


class SwiGLUFunction(Function):
    """The gated linear unit with a Swish gate (Shazeer 2020, arXiv 2002.05202, eq. 6), Llama's MLP core:

        y = silu(a) ⊙ b,   silu(a) = a·σ(a)        a = x W₁ᵀ (the gate), b = x W₃ᵀ (the up projection)

    Backward: da = g ⊙ b ⊙ σ(a)(1 + a(1 − σ(a))),  db = g ⊙ silu(a).
    """

    def forward(self, a, b):
        self.save_for_backward(a, b)
        return a * _sigmoid(a) * b  # (…, F)

    def backward(self, g, needs):
        a, b = self.saved
        s = _sigmoid(a)
        da = db = None
        if needs[0]:
            slope = 1.0 - s
            slope *= a
            slope += 1.0
            slope *= s  # d silu / da = σ(a)(1 + a(1 − σ(a)))
            da = g * b * slope
        if needs[1]:
            db = g * (a * s)
        return da, db


def _sigmoid(a):
    """σ(a) = 1/(1 + e^(−a)), computed without overflow for large |a| (as ½(1 + tanh(a/2)))."""
    s = xp().tanh(a * 0.5)
    s += 1.0
    s *= 0.5
    return s


def swiglu(a: Tensor, b: Tensor) -> Tensor:
    if a.shape != b.shape:
        raise ValueError(f"swiglu: gate {a.shape} and up projection {b.shape} must have the same shape")
    return SwiGLUFunction.apply(a, b)


# --- softmax family ---------------------------------------------------------------------------
class SoftmaxFunction(Function):
    def forward(self, x, axis):
        self.axis = axis
        y = x - x.max(axis=axis, keepdims=True)
        xp().exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
        self.save_for_backward(y)
        return y

    def backward(self, g, needs):
        (y,) = self.saved
        dx = g - (g * y).sum(axis=self.axis, keepdims=True)  # dx = y ⊙ (g − Σ g⊙y)
        dx *= y
        return dx, None


class CausalSoftmaxFunction(Function):
    """softmax(scale · x) over the last axis, with positions where mask is True set to −∞ first.

    The attention scores' scale, causal mask and softmax as one operation (fewer temporaries).
    Backward: dx = scale · y ⊙ (g − Σ g ⊙ y); masked positions have y = 0, so no gradient.
    """

    def forward(self, x, mask, scale):
        self.scale = scale
        y = x * x.dtype.type(scale)  # (…, T, T)
        xp().copyto(y, x.dtype.type(-xp().inf), where=mask)
        y -= y.max(axis=-1, keepdims=True)
        xp().exp(y, out=y)
        y /= y.sum(axis=-1, keepdims=True)
        self.save_for_backward(y)
        return y

    def backward(self, g, needs):
        (y,) = self.saved
        dx = g - (g * y).sum(axis=-1, keepdims=True)
        dx *= y
        dx *= dx.dtype.type(self.scale)
        return dx, None, None


def causal_softmax(x: Tensor, mask, scale: float) -> Tensor:
    """softmax(scale · x, masked with −∞ where mask) over the last axis; mask broadcasts against x."""
    mask = mask.data if isinstance(mask, Tensor) else xp().asarray(mask, dtype=bool)
    return CausalSoftmaxFunction.apply(x, mask, scale)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    return SoftmaxFunction.apply(x, axis)


class CrossEntropyFunction(Function):
    def forward(self, logits, targets, ignore_index, reduction):
        v = logits.shape[-1]
        z = logits.reshape(-1, v)  # (N, V)
        t = targets.reshape(-1)  # (N,)
        valid = t != ignore_index  # (N,)
        self.count = max(int(valid.sum()), 1) if reduction == "mean" else 1  # none counted: loss 0
        shifted = z - z.max(axis=1, keepdims=True)
        e = xp().exp(shifted)
        sum_e = e.sum(axis=1, keepdims=True)
        safe_t = xp().where(valid, t, 0)
        rows = xp().arange(z.shape[0])
        loss_per_row = xp().log(sum_e[:, 0]) - shifted[rows, safe_t]  # (N,)
        probs = e / sum_e  # (N, V)
        self.save_for_backward(probs)
        self.safe_t, self.valid, self.shape = safe_t, valid, logits.shape
        return xp().asarray((loss_per_row * valid).sum() / self.count, dtype=logits.dtype)

    def backward(self, g, needs):
        (probs,) = self.saved
        d = probs.copy()
        d[xp().arange(d.shape[0]), self.safe_t] -= 1
        d *= (self.valid[:, None] * (g / self.count)).astype(d.dtype)
        return d.reshape(self.shape), None, None, None


def cross_entropy(logits: Tensor, targets, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """Cross-entropy over targets that are not ignore_index: their mean (0 if there are none) or sum."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    targets = targets.data if isinstance(targets, Tensor) else xp().asarray(targets)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: targets of shape {targets.shape} do not match logits of shape "
                         f"{logits.shape} (expected {logits.shape[:-1]})")
    if targets.dtype.kind not in "iu":
        raise ValueError(f"cross_entropy: targets must be integers, got dtype {targets.dtype}")
    counted = targets[targets != ignore_index]
    if counted.size and (int(counted.min()) < 0 or int(counted.max()) >= logits.shape[-1]):
        raise ValueError(f"cross_entropy: target out of range [0, {logits.shape[-1]})")
    return CrossEntropyFunction.apply(logits, targets, ignore_index, reduction)


# --- dropout ----------------------------------------------------------------------------------
class DropoutFunction(Function):
    def forward(self, x, mask):
        self.save_for_backward(mask)
        return x * mask

    def backward(self, g, needs):
        return g * self.saved[0], None


def dropout(x: Tensor, p: float, generator, training: bool = True) -> Tensor:
    """Zero each element with probability p (drawn from `generator`) and scale the rest by 1/(1-p)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    keep = generator.random(x.shape) >= p  # a NumPy Generator: drawn on the host (nn/layers.py)
    mask = keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - p))
    return DropoutFunction.apply(x, Tensor(mask))  # Tensor(): to the active backend's memory
