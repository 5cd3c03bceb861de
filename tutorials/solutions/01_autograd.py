"""Reference solutions to tutorial 01's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them), and a
model answer to its question (at the end)."""

import numpy as np

from refimpl.autograd import Tensor


def sigmoid_backward(y, grad_out):
    return grad_out * y * (1 - y)


def linear_backward(x, w, grad_out):
    g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (N, out), N = product of leading dims
    x2 = x.reshape(-1, x.shape[-1])  # (N, in)
    return grad_out @ w, g2.T @ x2, g2.sum(axis=0)


def topological_order(loss):
    order, seen = [], set()

    def visit(node):  # post-order: a node after the producers of its inputs
        if id(node) in seen:
            return
        seen.add(id(node))
        for t in node.inputs:
            if isinstance(t, Tensor) and t.grad_fn is not None:
                visit(t.grad_fn)
        order.append(node)

    visit(loss.grad_fn)
    return order[::-1]


def backward_once(loss):
    order, seen = [], set()

    def visit(v):  # depth-first: a Var is appended after everything it was computed from
        if id(v) not in seen:
            seen.add(id(v))
            for p in v.parents:
                visit(p)
            order.append(v)

    visit(loss)
    loss.grad = np.ones_like(loss.data)
    for v in reversed(order):  # every user of v comes before it here, so v.grad is complete
        if v.grad_fn is None:
            continue
        for parent, g in zip(v.parents, v.grad_fn(v.grad)):
            parent.grad = g if parent.grad is None else parent.grad + g  # sum over users


ANSWER = """
Model answer to the question (measure and explain).

Measured on t of shape (100, 10), float64 (8,000 bytes): the composed sigmoid
1 / (1 + (-t).exp()) leaves 16,008 bytes on the ledger after forward; exercise 1's fused Sigmoid
leaves 8,000. The composed graph has four operations. Neg and Add save nothing: their
derivatives are the constants −1 and 1. Exp saves its output e^(−x) (8,000 bytes), since
d e^u/du = e^u. Div saves both operands, because d(a/b)/db = −a/b² needs a and b: the
numerator 1.0 (a 0-d array, 8 bytes) and the denominator 1 + e^(−x) (8,000 bytes).

The fused Function needs only its output: dy/dx = e^(−x)/(1 + e^(−x))² = y·(1 − y), because
1 − y = e^(−x)/(1 + e^(−x)). So it saves y and nothing else, half the composed graph's bytes, and
its backward is one expression instead of four nodes. The same holds for tanh (1 − y²), exp,
relu and softmax (dx = y·(g − Σ g·y)), which is why refimpl's Tanh saves its output; GELU's
derivative is not a function of its output, so a fused GELU must keep its input.

For a network, saved activations are what tutorial 06 trades for recomputation and what
pipelines keep in flight: every composed activation function costs a multiple of the bytes a
fused one does, per layer and per micro-batch in flight. Fusing is a memory optimisation before
it is a speed one. After backward the ledger is back at 0 for both.
"""
