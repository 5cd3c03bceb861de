"""gradcheck: compare backward against central finite differences (float64).

For a function f of tensors x₁…x_k with output y, pick a random cotangent v (same shape as y) and
compare, for every element j of every input that requires grad,

    analytic   ∂(v·y)/∂x_ij  from the engine's backward (engine.grad)
    numeric    (v·f(x + ε e_ij) − v·f(x − ε e_ij)) / (2ε)

Central differences have error O(ε²): with ε = 1e-6 in float64 the two agree to about 1e-8 for
smooth functions. Use it on small inputs (it costs two forward calls per input element).
"""

from __future__ import annotations

import numpy as np

from refimpl import backend

from .engine import grad
from .grad_mode import no_grad
from .tensor import Tensor


class GradcheckError(AssertionError):
    """Backward disagrees with finite differences."""


def gradcheck(fn, inputs, *, eps: float = 1e-6, atol: float = 1e-6, rtol: float = 1e-5, seed: int = 0) -> bool:
    """Raise GradcheckError if fn's backward disagrees with finite differences; return True."""
    inputs = list(inputs)
    for t in inputs:
        if isinstance(t, Tensor) and t.requires_grad and t.dtype != np.float64:
            raise ValueError(f"gradcheck needs float64 inputs, got {t.dtype}")
    out = fn(*inputs)
    rng = np.random.default_rng(seed)
    v = backend.asarray(rng.standard_normal(out.shape), dtype=out.dtype)
    checked = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    analytic = grad(out, checked, v)

    def projected(*args):
        with no_grad():
            return float((fn(*args).data * v).sum())

    for position, (t, a) in enumerate(zip(checked, analytic)):
        a = np.zeros(t.shape) if a is None else backend.to_host(a)
        numeric = np.zeros(t.shape)
        flat = t.data.reshape(-1)  # a view: perturb in place, restore after
        for j in range(flat.size):
            original = flat[j].item()
            flat[j] = original + eps
            plus = projected(*inputs)
            flat[j] = original - eps
            minus = projected(*inputs)
            flat[j] = original
            numeric.reshape(-1)[j] = (plus - minus) / (2 * eps)
        if not np.allclose(a, numeric, atol=atol, rtol=rtol):
            worst = tuple(int(i) for i in np.unravel_index(np.argmax(np.abs(a - numeric)), a.shape)) if a.size else ()
            raise GradcheckError(  # plain Python numbers: NumPy 2's repr would print np.float64(...)
                f"gradient of input {position} (shape {t.shape}) differs from finite differences: "
                f"at {worst} analytic {float(a[worst])!r} vs numeric {float(numeric[worst])!r}")
    return True
