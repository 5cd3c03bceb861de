"""Reference solutions to tutorial 01's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""

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
