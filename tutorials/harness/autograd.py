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
    got = sigmoid_backward(y, g)
    s_of_y = 1.0 / (1.0 + np.exp(-y))
    likely = {"the local derivative y(1 − y) is not multiplied by grad_out (the chain rule: the input's gradient is "
              "grad_out times it)": y * (1 - y),
              "y here is the sigmoid's output, not its input: σ'(x) = y(1 − y) needs no second sigmoid":
                  g * s_of_y * (1 - s_of_y),
              "that is tanh's derivative, 1 − y²; the sigmoid's is y(1 − y)": g * (1 - y * y),
              "the sign: σ'(x) = y(1 − y) is positive": -g * y * (1 - y)}
    if got is not None and np.shape(got) == y.shape:
        for mistake, value in likely.items():
            if np.allclose(got, value, rtol=1e-10, atol=1e-12):
                raise Wrong(f"sigmoid_backward(y, grad_out) differs from refimpl's gradient: {mistake}")
    expect_close(got, reference, "sigmoid_backward(y, grad_out)")

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
        shapes = [np.shape(r) for r in result]
        if shapes[1] == (3, 2):
            raise Wrong(f"dw for {where} has shape (3, 2): transposed. w is (out, in) = (2, 3) and y = x wᵀ + b, so "
                        "dw = gᵀ x, summed over the leading dimensions")
        if len(shape) > 2 and shapes[1] != (2, 3):
            raise Wrong(f"dw for {where} has shape {shapes[1]}: every leading position (batch, time) contributes "
                        "to the one weight, so sum g_iᵀ x_i over all of them (reshape to 2-D first)")
        if shapes[2] != (2,):
            raise Wrong(f"db for {where} has shape {shapes[2]}; the bias is added at every leading position, so db "
                        "sums g over all leading dimensions, shape (out,) = (2,)")
        if shapes[0] != shape:
            raise Wrong(f"dx for {where} has shape {shapes[0]}, expected {shape}: dx = g w, (…, out) @ (out, in)")
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


# ------------------------------------------------------------------------------------------------
# Exercise 4: the reverse sweep of part 1's engine, each operation once
# ------------------------------------------------------------------------------------------------

class _Var:
    """Part 1's Var: data, parents, grad_fn (own gradient -> parents' gradients), grad."""

    def __init__(self, data, parents=(), grad_fn=None, name=""):
        self.data = np.asarray(data, dtype=np.float64)
        self.parents = parents
        self.grad_fn = grad_fn
        self.grad = None
        self.name = name


class _TinyOps:
    """Part 1's operations on _Var, each counting how often its gradient function runs."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def _make(self, name, data, parents, grad):
        self.calls[name] = 0

        def grad_fn(g):
            self.calls[name] += 1
            return grad(g)
        return _Var(data, parents, grad_fn, name)

    def add(self, a, b, name):
        return self._make(name, a.data + b.data, (a, b), lambda g: (g, g))

    def mul(self, a, b, name):
        return self._make(name, a.data * b.data, (a, b), lambda g: (g * b.data, g * a.data))

    def matmul(self, a, b, name):
        return self._make(name, a.data @ b.data, (a, b), lambda g: (g @ b.data.T, a.data.T @ g))

    def tanh(self, a, name):
        y = np.tanh(a.data)
        return self._make(name, y, (a,), lambda g: (g * (1 - y * y),))

    def total(self, a, name):
        return self._make(name, a.data.sum(), (a,), lambda g: (np.full(a.data.shape, g),))


class _RefOps:
    """The same operations on refimpl's Tensors."""

    add = staticmethod(lambda a, b, name: a + b)
    mul = staticmethod(lambda a, b, name: a * b)
    matmul = staticmethod(lambda a, b, name: a @ b)
    tanh = staticmethod(lambda a, name: a.tanh())
    total = staticmethod(lambda a, name: a.sum())


def _square(o, x):
    """L = Σ tanh(x)·tanh(x): one Var is both parents of one operation."""
    t = o.tanh(x["x"], "t = tanh(x)")
    return o.total(o.mul(t, t, "t * t"), "sum")


def _long_and_short(o, x):
    """L = Σ (tanh(tanh(tanh(a))) + a), a = tanh(x): two paths of different lengths reach a."""
    a = o.tanh(x["x"], "a = tanh(x)")
    b = o.tanh(o.tanh(o.tanh(a, "tanh(a)"), "tanh(tanh(a))"), "tanh(tanh(tanh(a)))")
    return o.total(o.add(b, a, "tanh(tanh(tanh(a))) + a"), "sum")


def _two_layer(o, x):
    """Part 1's loss: Σ h·h, h = tanh(x W1) W2."""
    h = o.matmul(o.tanh(o.matmul(x["x"], x["w1"], "x @ w1"), "tanh(x @ w1)"), x["w2"], "h")
    return o.total(o.mul(h, h, "h * h"), "sum")


def _doublings(o, x, k=10):
    """L = Σ v_k, v_{i+1} = v_i + v_i, v_0 = x·w: 2^k paths from the loss to x."""
    v = o.mul(x["x"], x["w"], "x * w")
    for i in range(k):
        v = o.add(v, v, f"addition {i + 1} of {k}")
    return o.total(v, "sum")


_EXPRESSIONS = [
    (_square, {"x": (3, 4)}, "a Var that is both parents of one operation receives both gradients: sum them"),
    (_long_and_short, {"x": (2, 3)},
     "a Var's gradient function may run only after every operation that used the Var has passed its "
     "gradient on, i.e. in reverse topological order (a breadth-first order from the loss is not one: here "
     "`a` is reached from the loss in one step and in four)"),
    (_two_layer, {"x": (4, 3), "w1": (3, 5), "w2": (5, 2)}, "h is used twice by h * h: sum the two contributions"),
    (_doublings, {"x": (3,), "w": (3,)}, "each addition passes its gradient to its input twice: sum them"),
]


def check_backward_once(backward_once) -> None:
    """Check: part 1's engine, each operation once."""
    rng = np.random.default_rng(7)
    for build, shapes, hint in _EXPRESSIONS:
        data = {k: rng.standard_normal(s) for k, s in shapes.items()}
        what = (build.__doc__ or build.__name__).split(":")[0]
        tiny = _TinyOps()
        leaves = {k: _Var(v.copy(), name=k) for k, v in data.items()}
        loss = build(tiny, leaves)
        backward_once(loss)
        ref_leaves = {k: Parameter(v.copy()) for k, v in data.items()}
        build(_RefOps, ref_leaves).backward()
        for k, leaf in leaves.items():
            if leaf.grad is None:
                raise Wrong(f"for {what}, {k}.grad is still None: every Var that the loss depends on "
                            f"gets a gradient (start from the loss, whose gradient is 1)")
            try:
                expect_close(leaf.grad, ref_leaves[k].grad, f"for {what}, d loss/d {k}", rtol=1e-9, atol=1e-12)
            except Wrong as exc:
                raise Wrong(f"{exc} (refimpl's engine computed the expected value). Likely: {hint}") from None
        for name, n in tiny.calls.items():
            if n != 1:
                total = sum(tiny.calls.values())
                extra = (f"; {total} gradient-function calls in all for {len(tiny.calls)} operations. Running an "
                         f"operation once per path to it is part 1's path-by-path backward")
                raise Wrong(f"for {what}, the gradient function of `{name}` ran {n} times; an engine runs each "
                            f"once, when the gradient of its output is complete (after all of the operation's "
                            f"users){extra}")
