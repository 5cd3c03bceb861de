"""checkpoint(fn, *args): keep only fn's inputs, run fn again during backward.

Activation checkpointing (Chen, Xu, Zhang and Guestrin, "Training Deep Nets with Sublinear Memory
Cost", arXiv 1604.06174, section 3) trades computation for memory. A function fn, run normally,
leaves behind every tensor its backward will need (its "activations"). Run under checkpoint, it
leaves behind only its inputs:

    forward:   y = fn(x) under no_grad            saved: x only (A bytes instead of fn's R)
    backward:  y' = fn(x') with grad, x' = x      recomputed: one more forward of fn
               (dx, dθ) = grad of y' wrt (x', θ), seeded with dy

so the memory of fn's activations, R, is held only for the duration of fn's own backward, at the
price of one extra forward of fn (about a third of fn's forward+backward arithmetic).

How it sits in the engine. `CheckpointFunction` is one autograd Function whose inputs are fn's
tensor arguments *and* the parameters fn uses (found by walking the Modules reachable from fn; see
state.py). Its backward recomputes fn with grad on detached copies of the saved inputs (same
arrays, new leaves) and differentiates the recomputed subgraph with `engine.grad`, which returns
the gradients without touching any `.grad`. The outer engine then accumulates the parameter
gradients exactly as it would for any other Function: leaf hooks, post-accumulate hooks (data
parallel buckets) and the summation order of a parameter used in several places are the same as
without checkpointing. That is why gradients are bitwise equal to an unchecked run.

Split backward (I then W, used by zero-bubble pipelines; see refimpl/autograd/engine.py). The
first time the engine visits the node, whatever `needs` asks for, the backward recomputes fn once
and computes every input gradient it can (activations and parameters) by the same arithmetic as a
full backward; it hands out the ones asked for and keeps the rest. In a split backward the I pass
asks for the activation gradient (the recomputation and the whole backward of fn happen here); the
W pass asks for the parameter gradients and gets the kept arrays, which the engine accumulates in
W's order. So I then W equals B bit for bit, and a checkpointed region's weight-gradient
*arithmetic* runs in I: W only accumulates. (A finer split would recompute in I, keep the
recomputed activations until W and run the inner W there; it would hold R bytes from I to W,
which is what checkpointing set out to avoid.) Between I and W the node holds one gradient array
per parameter.

Random state. With preserve_rng_state=True the states of the generators fn draws from are captured
before the forward and set again around the recomputation (then restored), so dropout masks are
the same. Module forward hooks fire again during the recomputation (ZeRO-3's parameter gathering
needs exactly that); refimpl has no layer with running statistics (batch norm), which would
otherwise be updated twice.

What production systems do differently. PyTorch's reentrant checkpoint (`use_reentrant=True`)
calls torch.autograd.backward inside the backward, accumulating straight into `.grad`; it does not
support torch.autograd.grad through it. The non-reentrant version uses saved-tensor hooks so that
recomputation happens lazily, when the engine unpacks a saved tensor, and can stop early.
Megatron-LM recomputes selectively (only attention's softmax and dropout) to keep most of the
savings at a few percent of extra arithmetic.
"""

from __future__ import annotations

from refimpl.autograd import engine
from refimpl.autograd.function import Function
from refimpl.autograd.grad_mode import enable_grad, no_grad
from refimpl.autograd.tensor import Parameter, Tensor
from refimpl.nn import batch_rows

from .state import RngReplay, capture_rng, check_all_declared, generators_of, parameters_of


class RecomputingFunction(Function):
    """A Function whose backward recomputes something and yields all its input gradients at once.

    Subclasses implement `input_gradients(grad_outputs)`: one gradient (or None) per positional
    input, all by the arithmetic of a full backward. This class serves them to the engine as
    `needs` asks: computed on the first request, handed out, the rest kept for a later request
    (the W pass of a split backward). A request for a gradient that was already handed out (a
    second backward with retain_graph=True) recomputes.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ready: dict = {}  # input index -> gradient computed but not yet handed out

    def backward(self, *grad_outputs, needs):
        ready = self._ready
        if any(n and i not in ready for i, n in enumerate(needs)):
            grads = self.input_gradients(grad_outputs)
            ready.clear()
            ready.update((i, g) for i, g in enumerate(grads) if self.needs_input_grad[i])
        return tuple(ready.pop(i, None) if n else None for i, n in enumerate(needs))

    def release(self) -> None:
        super().release()
        self._ready = {}

    def input_gradients(self, grad_outputs) -> tuple:  # pragma: no cover - abstract
        raise NotImplementedError


class CheckpointFunction(RecomputingFunction):
    """Positional inputs: fn's arguments (tensors and constants), then the parameters fn uses."""

    def forward(self, *arrays, fn, args, rng):
        self.fn, self.args, self.rng = fn, args, rng
        self.rows = batch_rows.current()  # which rows of which batch: restored for the recomputation
        self.save_for_backward(*(a for a, arg in zip(arrays, args) if isinstance(arg, Tensor)))
        with no_grad():
            out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        if not all(isinstance(o, Tensor) for o in outs):
            raise TypeError("checkpoint: fn must return a Tensor or a tuple of Tensors, got "
                            f"{', '.join(type(o).__name__ for o in outs)}")
        return tuple(o.data for o in outs) if isinstance(out, tuple) else out.data

    def input_gradients(self, grad_outputs) -> tuple:
        n_args = len(self.args)
        saved = iter(self.saved)
        args = []  # fn's arguments again: saved arrays as new leaves, parameters as themselves
        for arg, wants in zip(self.args, self.needs_input_grad):
            if isinstance(arg, Tensor):
                array = next(saved)
                args.append(arg if isinstance(arg, Parameter) else Tensor(array, requires_grad=wants))
            else:
                args.append(arg)
        generators, states = self.rng
        with enable_grad(), RngReplay(generators, states), batch_rows.restored(self.rows):
            out = self.fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        params = list(self.inputs[n_args:])
        targets = [a for a in args if isinstance(a, Tensor) and a.requires_grad] + params
        check_all_declared(outs, targets, "checkpoint")
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if o.requires_grad]
        if pairs:
            found = engine.grad([o for o, _ in pairs], targets, [g for _, g in pairs])
        else:
            found = [None] * len(targets)
        by_id = {id(t): g for t, g in zip(targets, found)}
        return tuple(by_id.get(id(a)) if isinstance(a, Tensor) else None for a in args + params)


def checkpoint(fn, *args, preserve_rng_state: bool = True):
    """fn(*args), keeping only the arguments for backward and recomputing fn there.

    fn returns a Tensor or a tuple of Tensors. Its parameters are found from the Modules reachable
    from fn (a Module, a bound method, a partial, a closure; see state.py); tensors it
    differentiates through otherwise must be passed as arguments. With preserve_rng_state the
    random generators of those Modules replay the same numbers in the recomputation.
    """
    params = [p for p in parameters_of(fn, *args) if not any(p is a for a in args)]
    rng = (generators_of(fn, *args), None)
    if preserve_rng_state and rng[0]:
        rng = (rng[0], capture_rng(rng[0]))
    return CheckpointFunction.apply(*args, *params, fn=fn, args=args, rng=rng)
