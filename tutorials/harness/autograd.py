"""Checks for tutorial 01 (autograd from scratch): each compares the student's function with
refimpl's engine on small float64 inputs."""

from __future__ import annotations

import numpy as np

from refimpl.autograd import Function, Parameter, Tensor, engine, gradcheck
from refimpl.autograd.gradcheck import GradcheckError
from refimpl.nn import functional as F

from . import Wrong, expect_close


def check_sigmoid_backward(sigmoid_backward) -> None:
    """Check: sigmoid backward."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4))
    g = rng.standard_normal((3, 4))
    y = 1.0 / (1.0 + np.exp(-x))
    t = Tensor(x, requires_grad=True)
    (reference,) = engine.grad(1.0 / (1.0 + (-t).exp()), [t], g)  # refimpl's ops, composed
    expect_close(sigmoid_backward(y, g), reference, "sigmoid_backward(y, grad_out)")

    class Sigmoid(Function):  # the student's backward inside a real Function
        def forward(self, a):
            out = 1.0 / (1.0 + np.exp(-a))
            self.save_for_backward(out)
            return out

        def backward(self, grad, needs):
            (out,) = self.saved
            return (sigmoid_backward(out, grad),)

    try:
        gradcheck(lambda a: Sigmoid.apply(a), [Tensor(x, requires_grad=True)])
    except GradcheckError as exc:
        raise Wrong(f"as the backward of a Function it fails gradcheck: {exc}") from None


def check_linear_backward(linear_backward) -> None:
    """Check: linear backward."""
    rng = np.random.default_rng(2)
    for shape in [(5, 3), (2, 4, 3)]:  # (N, in) and (B, T, in): leading dimensions of any number
        x = Tensor(rng.standard_normal(shape), requires_grad=True)
        w = Parameter(rng.standard_normal((2, 3)))  # (out, in)
        b = Parameter(rng.standard_normal(2))  # (out,)
        g = rng.standard_normal(shape[:-1] + (2,))  # (…, out)
        dx, dw, db = engine.grad(F.linear(x, w, b), [x, w, b], g)
        result = linear_backward(x.data, w.data, g)
        if not isinstance(result, tuple) or len(result) != 3:
            raise Wrong(f"return a tuple (dx, dw, db); got {type(result).__name__}")
        where = f"x of shape {shape}"
        expect_close(result[0], dx, f"dx for {where}")
        expect_close(result[1], dw, f"dw for {where}")
        expect_close(result[2], db, f"db for {where}")


def _graph():
    """loss = sum((a + tanh(a))²) with a = x·w + w: shared subexpressions on several paths."""
    rng = np.random.default_rng(3)
    x = Tensor(rng.standard_normal((2, 3)))
    w = Parameter(rng.standard_normal((3, 3)))
    a = x @ w + w.sum(axis=0)
    c = a + a.tanh()
    return (c * c).sum()


def check_topological_order(topological_order) -> None:
    """Check: topological order."""
    loss = _graph()
    order = list(topological_order(loss))
    expected = engine._topological_order([loss.grad_fn])
    names = lambda nodes: [n.name for n in nodes]  # noqa: E731
    if not all(isinstance(n, Function) for n in order):
        raise Wrong(f"return the graph's Function objects (tensor.grad_fn); got {[type(n).__name__ for n in order]}")
    if len({id(n) for n in order}) != len(order):
        raise Wrong(f"a node appears twice: {names(order)}")
    if {id(n) for n in order} != {id(n) for n in expected}:
        raise Wrong(f"the graph has {len(expected)} nodes {sorted(names(expected))}; you returned "
                    f"{len(order)}: {sorted(names(order))}")
    position = {id(n): i for i, n in enumerate(order)}
    for node in order:
        for t in node.inputs:
            if isinstance(t, Tensor) and t.grad_fn is not None and position[id(t.grad_fn)] < position[id(node)]:
                raise Wrong(f"{t.grad_fn.name} produced an input of {node.name} but comes before it: "
                            f"a node's gradient is complete only after every node that uses it has run "
                            f"(your order: {names(order)})")
