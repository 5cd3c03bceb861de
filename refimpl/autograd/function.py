"""Function: one differentiable operation, its forward and its backward.

A subclass implements

    forward(self, *arrays, **options) -> array | tuple of arrays
    backward(self, *grad_outputs, needs) -> tuple with one gradient (or None) per positional input

`needs[i]` says whether the gradient of positional input i is wanted. The engine uses it to split a
backward in two halves (see engine.py): the input-gradient pass asks only for the gradients of
activations, the deferred weight-gradient pass only for those of Parameters. Each gradient must be
computed by the same arithmetic whichever others are asked for, so that the two halves together
equal a full backward bit for bit.

Positional arguments that are Tensors are the differentiable inputs; other positional arguments
(Python scalars, index arrays) are constants; keyword arguments are options.

Saved parameters are not pinned: save_for_backward keeps a reference to the Parameter, and
`saved` reads its data when backward runs. ZeRO-3 relies on it (gather a module's weights for its
backward, free them after); it also means weights must not change between a forward and its
backward (optimizers step only after backward).

Mixed precision: float16 is a storage type. A float16 input is converted to float32 before forward,
so every operation computes (and outputs) float32; the engine casts a leaf's gradient back to the
leaf's dtype when it accumulates it (float16 parameters get float16 gradients). bfloat16 (ml_dtypes,
--dtype bf16) is a storage type the same way.
"""

from __future__ import annotations

from . import grad_mode, recording
from .saved import saved_tensors

STORAGE_DTYPES = ("float16", "bfloat16")  # bfloat16: ml_dtypes' (--dtype bf16, optim/precision.py)


def _compute_array(array):
    """float16 and bfloat16 are storage types: operations compute in float32 (NumPy has no fast
    float16 matmul, and ml_dtypes' bfloat16 arithmetic is meant to be done after a cast)."""
    return array.astype("float32") if array.dtype.name in STORAGE_DTYPES else array


class SavedRef:
    """Something saved for backward that is not an array: `data()` produces the array when backward
    reads it (a Parameter's current data; a recomputed activation, refimpl/checkpointing/auto.py)."""

    __slots__ = ()

    def data(self):  # pragma: no cover - abstract
        raise NotImplementedError


class _ParameterRef(SavedRef):
    """A saved Parameter: its data is looked up at backward time, so a sharded-parameter scheme
    (ZeRO-3) may free the array after forward and gather it again before backward."""

    __slots__ = ("param",)

    def __init__(self, param) -> None:
        self.param = param

    def data(self):
        return _compute_array(self.param.data)


class Function:
    """Base class of every operation recorded by the autograd engine."""

    def __init__(self) -> None:
        self.inputs: tuple = ()  # the positional arguments (Tensors and constants)
        self.needs_input_grad: tuple = ()  # which inputs require grad (forward may save less)
        self._saved: tuple | None = ()  # what forward saved for backward (see `saved`)
        self.output_meta: list = []  # (shape, dtype) of each output
        self.output_hooks: dict[int, list] = {}  # output index -> gradient hooks (Tensor.register_hook)
        self._recording = False
        self._param_of: dict = {}  # id(array given to forward) -> the Parameter it came from
        self._counted: list = []  # arrays this node added to the saved-tensor ledger; removed on release

    # --- called by subclasses -------------------------------------------------------------
    def save_for_backward(self, *arrays) -> None:
        """Keep `arrays` until backward; counted by the saved-tensor ledger unless parameters."""
        if not self._recording:
            return
        if recording.saves_deferred():  # an interceptor settles them after forward (recording.py)
            self._pending_saves = arrays
            return
        self.settle_saved(arrays)

    def settle_saved(self, entries) -> None:
        """Keep `entries` for backward: arrays (counted by the ledger unless a Parameter's) or SavedRefs."""
        kept = []
        for array in entries:
            if isinstance(array, SavedRef):
                kept.append(array)
                continue
            param = self._param_of.get(id(array)) if array is not None else None
            if param is not None:
                kept.append(_ParameterRef(param))  # not pinned: read again at backward time
            else:
                kept.append(array)
                if array is not None and hasattr(array, "nbytes"):
                    saved_tensors.add(array)
                    self._counted.append(array)
        self._saved = tuple(kept)

    @property
    def saved(self):
        """What forward saved; a saved Parameter is read (its current data) now, at backward time."""
        if self._saved is None:
            return None
        return tuple(x.data() if isinstance(x, SavedRef) else x for x in self._saved)

    @property
    def released(self) -> bool:
        """Whether the saved arrays were dropped (a second backward through this node needs them)."""
        return self._saved is None

    # --- called by the engine ---------------------------------------------------------------
    def release(self) -> None:
        """Drop the saved arrays (after backward has used them for the last time)."""
        for array in self._counted:
            saved_tensors.remove(array)
        self._counted = []
        self._saved = None

    def __del__(self) -> None:
        # A graph dropped without a backward must not leave its arrays counted (and held) by the ledger.
        if self._counted:
            self.release()

    @property
    def name(self) -> str:
        return type(self).__name__

    @classmethod
    def apply(cls, *args, **options):
        """Run forward on the arrays of `args`; record the operation if a gradient is needed."""
        interceptor = recording.current()
        if interceptor is not None:  # recording mode (recording.py): the interceptor runs it
            return interceptor.apply(cls, args, options)
        return cls._apply(*args, **options)

    @classmethod
    def _apply(cls, *args, **options):
        if recording._counters:
            recording.forward_ran(cls.__name__)
        fn = cls()
        fn.needs_input_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        fn._recording = grad_mode.is_enabled() and any(fn.needs_input_grad)
        arrays = [_compute_array(a.data) if isinstance(a, Tensor) else a for a in args]
        if fn._recording:
            fn._param_of = {id(x): a for a, x in zip(args, arrays) if isinstance(a, Parameter)}
        out = fn.forward(*arrays, **options)
        outs = out if isinstance(out, tuple) else (out,)
        if not fn._recording:
            results = tuple(Tensor(o) for o in outs)
        else:
            fn.inputs = args
            fn.output_meta = [(o.shape, o.dtype) for o in outs]
            results = tuple(Tensor._from_op(o, fn, i) for i, o in enumerate(outs))
        return results if isinstance(out, tuple) else results[0]

    def forward(self, *arrays, **options):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, *grad_outputs, needs):  # pragma: no cover - abstract
        raise NotImplementedError


# A real import cycle: apply() wraps its results in Tensors, and tensor.py imports ops.py, whose
# operations subclass Function. Imported here, once Function exists.
from .tensor import Parameter, Tensor  # noqa: E402 - the cycle above
