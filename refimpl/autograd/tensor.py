"""Tensor: an array of the active backend plus what reverse-mode autograd needs.

    data            the array (numpy.ndarray or cupy.ndarray)
    grad            accumulated gradient of a leaf (same shape), or None; always accumulated (+=)
    requires_grad   whether operations on this tensor are recorded for backward
    grad_fn         the Function that produced this tensor (None for a leaf)

A Parameter is a leaf tensor that belongs to a model. The engine treats gradients that flow into
Parameters as weight gradients: the split backward defers them (see engine.py). A Parameter's data
and grad may be views into a flat buffer (set_flat_views); gradients are then accumulated into
that buffer in place.
"""

from __future__ import annotations

from refimpl import backend


def _as_array(value, dtype=None):
    xp = backend.xp()
    if isinstance(value, Tensor):
        raise TypeError("Tensor(...) got a Tensor; use tensor.detach() or tensor.data")
    return xp.asarray(value, dtype=dtype)


class Tensor:
    __array_priority__ = 1000  # make `ndarray * Tensor` call Tensor.__rmul__

    def __init__(self, data, requires_grad: bool = False, dtype=None):
        self.data = _as_array(data, dtype)
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self.grad_fn = None
        self.output_index = 0
        self._hooks: list = []  # leaf: called on the gradient before it is accumulated
        self._post_accumulate_hooks: list = []  # leaf: called with the tensor after accumulation
        floating = self.data.dtype.kind == "f" or self.data.dtype.name == "bfloat16"  # ml_dtypes' has kind "V"
        if self.requires_grad and not floating:
            raise TypeError(f"only floating-point tensors can require gradients, got dtype {self.data.dtype}")

    @classmethod
    def _from_op(cls, data, fn, index: int) -> Tensor:
        t = cls.__new__(cls)
        t.data, t.grad, t.requires_grad = data, None, True
        t.grad_fn, t.output_index = fn, index
        t._hooks, t._post_accumulate_hooks = [], []
        return t

    # --- array facts ------------------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        extra = f", grad_fn={self.grad_fn.name}" if self.grad_fn is not None else ""
        extra += ", requires_grad=True" if self.requires_grad and self.grad_fn is None else ""
        return f"{type(self).__name__}({self.data!r}{extra})"

    def item(self) -> float:
        return self.data.item()

    def detach(self) -> Tensor:
        """A new leaf sharing this tensor's data, with no history."""
        return Tensor(self.data)

    # --- autograd ---------------------------------------------------------------------------
    def backward(self, grad=None, *, retain_graph: bool = False, defer_weight_grads: bool = False):
        """Accumulate d(self)/d(leaf) into every leaf's .grad. See engine.backward."""
        return engine.backward([self], None if grad is None else [grad], retain_graph=retain_graph,
                               defer_weight_grads=defer_weight_grads)

    def register_hook(self, hook):
        """Call hook(grad) -> new grad or None when this tensor's gradient is complete.

        On a leaf the hook sees the tensor's whole gradient of one backward pass, before it is
        accumulated into .grad; on a non-leaf it sees the gradient before it flows further back.
        Returns a handle whose remove() unregisters the hook.
        """
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that does not require grad")
        hooks = self._hooks if self.grad_fn is None else self.grad_fn.output_hooks.setdefault(self.output_index, [])
        hooks.append(hook)
        return HookHandle(hooks, hook)

    def register_post_accumulate_grad_hook(self, hook):
        """On a leaf: call hook(tensor) right after its .grad was accumulated (DDP buckets use it)."""
        if self.grad_fn is not None:
            raise RuntimeError("post-accumulate-grad hooks exist only on leaf tensors")
        self._post_accumulate_hooks.append(hook)
        return HookHandle(self._post_accumulate_hooks, hook)

    def zero_grad(self) -> None:
        if self.grad is not None:
            self.grad[...] = 0

    # --- operators (defined in ops.py) ------------------------------------------------------
    def __add__(self, other): return ops.add(self, other)
    def __radd__(self, other): return ops.add(other, self)
    def __sub__(self, other): return ops.sub(self, other)
    def __rsub__(self, other): return ops.sub(other, self)
    def __mul__(self, other): return ops.mul(self, other)
    def __rmul__(self, other): return ops.mul(other, self)
    def __truediv__(self, other): return ops.div(self, other)
    def __rtruediv__(self, other): return ops.div(other, self)
    def __neg__(self): return ops.neg(self)
    def __pow__(self, exponent): return ops.pow(self, exponent)
    def __rpow__(self, base): return ops.pow(base, self)
    def __matmul__(self, other): return ops.matmul(self, other)
    def __rmatmul__(self, other): return ops.matmul(other, self)
    def __getitem__(self, index): return ops.getitem(self, index)

    def exp(self): return ops.exp(self)
    def log(self): return ops.log(self)
    def sqrt(self): return ops.sqrt(self)
    def tanh(self): return ops.tanh(self)
    def relu(self): return ops.relu(self)
    def sum(self, axis=None, keepdims=False): return ops.sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return ops.mean(self, axis, keepdims)
    def max(self, axis=None, keepdims=False): return ops.max(self, axis, keepdims)
    def reshape(self, *shape): return ops.reshape(self, _one_sequence_or_all(shape))
    def transpose(self, *axes): return ops.transpose(self, _one_sequence_or_all(axes) if axes else None)
    def astype(self, dtype): return ops.astype(self, dtype)
    def split(self, sections, axis=-1): return ops.split(self, sections, axis)
    def masked_fill(self, mask, value): return ops.masked_fill(self, mask, value)

    @property
    def T(self):
        return ops.transpose(self, None)


def _one_sequence_or_all(args: tuple):
    """reshape(2, 3) and reshape((2, 3)) alike: a single tuple or list argument is the sequence itself."""
    return args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args


class Parameter(Tensor):
    """A model weight: a leaf tensor that requires grad. Its gradient is a weight gradient."""

    def __init__(self, data, requires_grad: bool = True, dtype=None):
        super().__init__(data, requires_grad=requires_grad, dtype=dtype)

    def set_flat_views(self, data_view, grad_view=None) -> None:
        """Make data (and grad) views into caller-given flat buffers; the values are copied in."""
        if data_view.shape != self.data.shape:
            raise ValueError(f"flat view has shape {data_view.shape}, parameter has shape {self.data.shape}")
        data_view[...] = self.data
        self.data = data_view
        if grad_view is not None:
            if grad_view.shape != self.data.shape:
                raise ValueError(f"grad view has shape {grad_view.shape}, parameter has shape {self.data.shape}")
            if self.grad is not None:
                grad_view[...] = self.grad
            self.grad = grad_view


class HookHandle:
    """Returned by every register_*hook; remove() unregisters the hook."""

    def __init__(self, hooks: list, hook) -> None:
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


# A real import cycle: Tensor's operators and backward() are ops.py's and engine.py's functions, and
# both modules need the Tensor class. They are imported here, once Tensor and Parameter exist.
from . import engine, ops  # noqa: E402 - the cycle above
