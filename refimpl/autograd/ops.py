"""Differentiable array operations, with full NumPy broadcasting.

Each operation is a Function (forward on arrays, backward returning one gradient per input) plus a
small wrapper that accepts Tensors, arrays or Python numbers. Conventions:

- broadcasting: a gradient is summed back to its input's shape by `unbroadcast`;
- every backward computes input i's gradient only if needs[i], by the same arithmetic whatever
  else is asked for (the split backward relies on it, see engine.py);
- shapes: shown in comments as (…) for any leading dimensions.
"""

from __future__ import annotations

import math

from refimpl import backend

from .function import Function
from .tensor import Tensor


def xp():
    return backend.xp()


def unbroadcast(grad, shape):
    """Sum `grad` over the axes along which an input of `shape` was broadcast."""
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(i + extra for i, n in enumerate(shape) if n == 1 and grad.shape[i + extra] != 1)
    summed = grad.sum(axis=axes, keepdims=True) if axes else grad
    return summed.reshape(shape)


def _operand(value, like: Tensor | None = None):
    """Tensors pass through; numbers become 0-d arrays of the other operand's dtype (no promotion)."""
    if isinstance(value, Tensor):
        return value
    dtype = like.dtype if like is not None and isinstance(value, (int, float)) else None
    return Tensor(xp().asarray(value, dtype=dtype))


def _binary(cls, a, b):
    like = a if isinstance(a, Tensor) else b if isinstance(b, Tensor) else None
    a, b = _operand(a, like), _operand(b, like)
    _check_broadcast(cls.__name__.lower(), a.shape, b.shape)
    return cls.apply(a, b)


def _check_broadcast(op: str, shape_a, shape_b) -> None:
    for x, y in zip(reversed(shape_a), reversed(shape_b)):
        if x != y and x != 1 and y != 1:
            raise ValueError(f"{op}: shapes {tuple(shape_a)} and {tuple(shape_b)} cannot be broadcast together")


# --- elementwise arithmetic -----------------------------------------------------------------
class Add(Function):
    def forward(self, a, b):
        self.shapes = (a.shape, b.shape)
        return a + b

    def backward(self, g, needs):
        return (unbroadcast(g, self.shapes[0]) if needs[0] else None,
                unbroadcast(g, self.shapes[1]) if needs[1] else None)


class Sub(Function):
    def forward(self, a, b):
        self.shapes = (a.shape, b.shape)
        return a - b

    def backward(self, g, needs):
        return (unbroadcast(g, self.shapes[0]) if needs[0] else None,
                unbroadcast(-g, self.shapes[1]) if needs[1] else None)


class Mul(Function):
    def forward(self, a, b):
        self.shapes = (a.shape, b.shape)
        need_a, need_b = self.needs_input_grad
        self.save_for_backward(a if need_b else None, b if need_a else None)  # only what backward uses
        return a * b

    def backward(self, g, needs):
        a, b = self.saved
        return (unbroadcast(g * b, self.shapes[0]) if needs[0] else None,
                unbroadcast(g * a, self.shapes[1]) if needs[1] else None)


class Div(Function):
    def forward(self, a, b):
        self.save_for_backward(a, b)
        return a / b

    def backward(self, g, needs):
        a, b = self.saved
        return (unbroadcast(g / b, a.shape) if needs[0] else None,
                unbroadcast(-g * a / (b * b), b.shape) if needs[1] else None)


class Pow(Function):
    """a ** b; the gradient with respect to b needs a > 0."""

    def forward(self, a, b):
        out = a ** b
        self.save_for_backward(a, b, out)
        return out

    def backward(self, g, needs):
        a, b, out = self.saved
        return (unbroadcast(g * b * a ** (b - 1), a.shape) if needs[0] else None,
                unbroadcast(g * out * xp().log(a), b.shape) if needs[1] else None)


def add(a, b): return _binary(Add, a, b)
def sub(a, b): return _binary(Sub, a, b)
def mul(a, b): return _binary(Mul, a, b)
def div(a, b): return _binary(Div, a, b)
def pow(a, b): return _binary(Pow, a, b)  # noqa: A001 - the op's name


class Neg(Function):
    def forward(self, a):
        return -a

    def backward(self, g, needs):
        return (-g,)


def neg(a): return Neg.apply(a)


# --- elementwise functions ------------------------------------------------------------------
class Exp(Function):
    def forward(self, a):
        out = xp().exp(a)
        self.save_for_backward(out)
        return out

    def backward(self, g, needs):
        return (g * self.saved[0],)


class Log(Function):
    def forward(self, a):
        self.save_for_backward(a)
        return xp().log(a)

    def backward(self, g, needs):
        return (g / self.saved[0],)


class Sqrt(Function):
    def forward(self, a):
        out = xp().sqrt(a)
        self.save_for_backward(out)
        return out

    def backward(self, g, needs):
        return (g / (2 * self.saved[0]),)


class Tanh(Function):
    def forward(self, a):
        out = xp().tanh(a)
        self.save_for_backward(out)
        return out

    def backward(self, g, needs):
        out = self.saved[0]
        return (g * (1 - out * out),)


class Relu(Function):
    def forward(self, a):
        out = xp().maximum(a, 0)
        self.save_for_backward(out)
        return out

    def backward(self, g, needs):
        return (g * (self.saved[0] > 0),)


def exp(a): return Exp.apply(a)
def log(a): return Log.apply(a)
def sqrt(a): return Sqrt.apply(a)
def tanh(a): return Tanh.apply(a)
def relu(a): return Relu.apply(a)


class AsType(Function):
    """Change the dtype; the gradient is cast back to the input's dtype."""

    def forward(self, a, dtype):
        self.in_dtype = a.dtype
        return a.astype(dtype)

    def backward(self, g, needs):
        return (g.astype(self.in_dtype), None)


def astype(a, dtype):
    dtype = backend.check_dtype(dtype)
    return a if a.dtype == dtype else AsType.apply(a, dtype)


# --- reductions -----------------------------------------------------------------------------
def _normalize_axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a tensor with {ndim} dimensions")
    return tuple(sorted(a % ndim for a in axes)) if ndim else ()


def _keepdims_shape(shape, axes):
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


class Sum(Function):
    def forward(self, a, axes, keepdims):
        self.in_shape, self.axes = a.shape, axes
        return a.sum(axis=axes, keepdims=keepdims)

    def backward(self, g, needs):
        g = g.reshape(_keepdims_shape(self.in_shape, self.axes))
        return (xp().broadcast_to(g, self.in_shape),)


class Mean(Function):
    def forward(self, a, axes, keepdims):
        self.in_shape, self.axes = a.shape, axes
        self.count = math.prod(a.shape[i] for i in axes)
        return a.mean(axis=axes, keepdims=keepdims)

    def backward(self, g, needs):
        g = g.reshape(_keepdims_shape(self.in_shape, self.axes)) / self.count
        return (xp().broadcast_to(g, self.in_shape),)


class Max(Function):
    """Maximum over axes; the gradient is shared equally among tied maxima."""

    def forward(self, a, axes, keepdims):
        out = a.max(axis=axes, keepdims=True)
        self.save_for_backward(a, out)
        self.axes = axes
        return out if keepdims else out.reshape([n for i, n in enumerate(out.shape) if i not in axes])

    def backward(self, g, needs):
        a, out = self.saved
        winners = (a == out)
        g = g.reshape(out.shape)
        return (winners * (g / winners.sum(axis=self.axes, keepdims=True)),)


def sum(a, axis=None, keepdims=False):  # noqa: A001 - the op's name
    return Sum.apply(a, _normalize_axes(axis, a.ndim), keepdims)


def mean(a, axis=None, keepdims=False):
    return Mean.apply(a, _normalize_axes(axis, a.ndim), keepdims)


def max(a, axis=None, keepdims=False):  # noqa: A001 - the op's name
    return Max.apply(a, _normalize_axes(axis, a.ndim), keepdims)


# --- matrix product -------------------------------------------------------------------------
class MatMul(Function):
    """a @ b with NumPy's rules: batched over leading dimensions, 1-D operands promoted."""

    def forward(self, a, b):
        self.save_for_backward(a, b)
        return a @ b

    def backward(self, g, needs):
        a, b = self.saved
        a2 = a[None, :] if a.ndim == 1 else a  # (…, n, k)
        b2 = b[:, None] if b.ndim == 1 else b  # (…, k, m)
        out_shape = xp().broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + (a2.shape[-2], b2.shape[-1])
        g = g.reshape(out_shape)  # (…, n, m), undoing the 1-D promotions
        da = unbroadcast(g @ xp().swapaxes(b2, -1, -2), a2.shape).reshape(a.shape) if needs[0] else None
        db = unbroadcast(xp().swapaxes(a2, -1, -2) @ g, b2.shape).reshape(b.shape) if needs[1] else None
        return da, db


def matmul(a, b):
    a, b = _operand(a), _operand(b)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: operands must have at least one dimension, got shapes {a.shape} and {b.shape}")
    k_a, k_b = a.shape[-1], b.shape[0] if b.ndim == 1 else b.shape[-2]
    if k_a != k_b:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not match ({k_a} != {k_b})")
    _check_broadcast("matmul", a.shape[:-2], b.shape[:-2])
    return MatMul.apply(a, b)


# --- shape operations -----------------------------------------------------------------------
class Reshape(Function):
    def forward(self, a, shape):
        self.in_shape = a.shape
        try:
            return a.reshape(shape)
        except ValueError:
            raise ValueError(f"reshape: cannot reshape a tensor of shape {a.shape} into {shape}") from None

    def backward(self, g, needs):
        return (g.reshape(self.in_shape), None)


def reshape(a, shape):
    return Reshape.apply(a, tuple(shape))


class Transpose(Function):
    def forward(self, a, axes):
        self.axes = axes
        return a.transpose(axes)

    def backward(self, g, needs):
        inverse = None if self.axes is None else tuple(sorted(range(len(self.axes)), key=self.axes.__getitem__))
        return (g.transpose(inverse), None)


def transpose(a, axes=None):
    if axes is not None:
        axes = tuple(int(x) % a.ndim for x in axes)
        if sorted(axes) != list(range(a.ndim)):
            raise ValueError(f"transpose: axes {axes} are not a permutation of a tensor with {a.ndim} dimensions")
    return Transpose.apply(a, axes)


class GetItem(Function):
    """Basic and advanced indexing (slices, integer arrays, masks); the embedding gather."""

    def forward(self, a, index):
        self.in_shape, self.in_dtype, self.index = a.shape, a.dtype, index
        return a[index]

    def backward(self, g, needs):
        grad = xp().zeros(self.in_shape, self.in_dtype)
        backend.scatter_add(grad, self.index, g)  # repeated indices add up
        return (grad, None)


def getitem(a, index):
    if isinstance(index, Tensor):
        index = index.data
    elif isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return GetItem.apply(a, index)


class Concatenate(Function):
    def forward(self, *arrays, axis):
        self.axis = axis
        self.sizes = [x.shape[axis] for x in arrays]
        return xp().concatenate(arrays, axis=axis)

    def backward(self, g, needs):
        bounds = xp().cumsum(xp().asarray(self.sizes[:-1])).tolist() if len(self.sizes) > 1 else []
        parts = xp().split(g, bounds, axis=self.axis)
        return tuple(p if n else None for p, n in zip(parts, needs))


def concatenate(tensors, axis=0):
    tensors = [_operand(t) for t in tensors]
    if not tensors:
        raise ValueError("concatenate: needs at least one tensor")
    return Concatenate.apply(*tensors, axis=axis)


class Stack(Function):
    def forward(self, *arrays, axis):
        self.axis = axis
        return xp().stack(arrays, axis=axis)

    def backward(self, g, needs):
        parts = xp().moveaxis(g, self.axis, 0)
        return tuple(parts[i] if n else None for i, n in enumerate(needs))


def stack(tensors, axis=0):
    tensors = [_operand(t) for t in tensors]
    if not tensors:
        raise ValueError("stack: needs at least one tensor")
    shapes = {t.shape for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"stack: all tensors must have the same shape, got {sorted(shapes)}")
    return Stack.apply(*tensors, axis=axis)


class Split(Function):
    """Split along an axis into equal sections or at given indices; one output per piece."""

    def forward(self, a, sections, axis):
        self.axis = axis
        return tuple(xp().split(a, sections, axis=axis))

    def backward(self, *grads, needs):
        return (xp().concatenate(grads, axis=self.axis), None, None)


def split(a, sections, axis=-1):
    n = a.shape[axis]
    if isinstance(sections, int) and (sections <= 0 or n % sections):
        raise ValueError(f"split: axis of length {n} cannot be split into {sections} equal sections")
    return list(Split.apply(a, sections, axis))


# --- selection ------------------------------------------------------------------------------
class Where(Function):
    def forward(self, a, b, condition):
        self.condition, self.shapes = condition, (a.shape, b.shape)
        return xp().where(condition, a, b)

    def backward(self, g, needs):
        zero = xp().zeros((), g.dtype)
        return (unbroadcast(xp().where(self.condition, g, zero), self.shapes[0]) if needs[0] else None,
                unbroadcast(xp().where(self.condition, zero, g), self.shapes[1]) if needs[1] else None,
                None)


def where(condition, a, b):
    """Elements of a where condition holds, else of b (condition is not differentiated)."""
    like = a if isinstance(a, Tensor) else b if isinstance(b, Tensor) else None
    a, b = _operand(a, like), _operand(b, like)
    condition = condition.data if isinstance(condition, Tensor) else xp().asarray(condition)
    _check_broadcast("where", a.shape, b.shape)
    return Where.apply(a, b, condition)


class MaskedFill(Function):
    def forward(self, a, mask, value):
        self.mask, self.in_shape = mask, a.shape
        return xp().where(mask, xp().asarray(value, dtype=a.dtype), a)

    def backward(self, g, needs):
        return (unbroadcast(xp().where(self.mask, xp().zeros((), g.dtype), g), self.in_shape), None, None)


def masked_fill(a, mask, value):
    """a with `value` wherever mask is True (mask broadcasts against a)."""
    mask = mask.data if isinstance(mask, Tensor) else xp().asarray(mask, dtype=bool)
    _check_broadcast("masked_fill", a.shape, mask.shape)
    return MaskedFill.apply(a, mask, value)
