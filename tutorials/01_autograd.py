# %% [markdown]
# # 01 · Autograd from scratch
#
# **Launch:** `python tutorials/01_autograd.py` from the repository root, in the virtual
# environment (`. .venv/bin/activate`). It is also a notebook: with `pip install jupytext notebook`,
# `jupyter notebook tutorials/` opens this `.py` file as one.
#
# Every algorithm in refimpl (data parallelism, ZeRO, checkpointing, pipelines) is built on a
# reverse-mode automatic-differentiation engine. In this tutorial you
#
# 1. build a tiny one in about forty lines, check it against finite differences and measure its
#    flaw (exercise 4 removes it);
# 2. meet refimpl's engine (`refimpl/autograd/`): `Tensor`, `Function`, the saved-tensor ledger;
# 3. split a backward pass into its input-gradient half **I** and weight-gradient half **W**, the
#    trick that zero-bubble pipelines (tutorial 08) are built on.
#
# Then you write four pieces of an engine yourself, the last one the reverse sweep of part 1's
# engine, and checks compare them with refimpl's.

# %%
import numpy as np

np.set_printoptions(precision=4, suppress=True)

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. An engine in forty lines
#
# Reverse mode rests on the chain rule read backwards. If the loss L depends on x only through
# y = f(x), then ∂L/∂x = (∂L/∂y)·(∂y/∂x). So each operation needs only one thing from the rest
# of the program: the gradient of the loss with respect to its **output**. From that it computes
# the gradients with respect to its **inputs** and passes them on. An engine therefore needs
#
# - to **record**, during the forward pass, which operation made each value and from what;
# - to **visit** the recorded operations in an order where an operation comes after every
#   operation that used its output (so the gradient of its output is complete), and
# - to **sum** the gradients that reach a value along several paths.
#
# `Var` below is an array that remembers its parents and a function from its own gradient to its
# parents' gradients. The `backward` below does the first and the third, and skips the second: it
# pushes each path's contribution down to the leaves as soon as it has it, so an operation runs
# once per *path* from the loss to it rather than once. The sums are right (the chain rule is
# linear in g), and part 1 ends by counting what that costs; exercise 4 is the engine that visits
# each operation once.

# %%
class Var:
    """An array that remembers how it was computed."""

    def __init__(self, data, parents=(), grad_fn=None):
        self.data = np.asarray(data, dtype=np.float64)
        self.parents = parents  # the Vars this one was computed from
        self.grad_fn = grad_fn  # gradient of this Var -> gradients of its parents
        self.grad = None


def add(a, b):
    return Var(a.data + b.data, (a, b), lambda g: (g, g))


def mul(a, b):
    return Var(a.data * b.data, (a, b), lambda g: (g * b.data, g * a.data))


def matmul(a, b):  # (N, K) @ (K, M)
    return Var(a.data @ b.data, (a, b), lambda g: (g @ b.data.T, a.data.T @ g))


def tanh(a):
    y = np.tanh(a.data)  # the backward reuses the output: d tanh(x)/dx = 1 - tanh(x)^2
    return Var(y, (a,), lambda g: (g * (1 - y * y),))


def total(a):
    return Var(a.data.sum(), (a,), lambda g: (np.full(a.data.shape, g),))


def backward(loss):
    """Fill .grad of every Var that loss depends on, path by path."""

    def push(v, g):  # g: one path's contribution to dL/dv
        v.grad = g if v.grad is None else v.grad + g  # sum over paths
        if v.grad_fn is not None:
            for parent, gp in zip(v.parents, v.grad_fn(g)):
                push(parent, gp)

    push(loss, np.ones_like(loss.data))


# %% [markdown] slideshow={"slide_type": "subslide"}
# A two-layer network's loss, L = Σ h·h with h = tanh(x W₁) W₂, uses `h` twice, so its gradient
# arrives along two paths and must be summed.

# %%
rng = np.random.default_rng(0)
x_data, w1_data, w2_data = rng.standard_normal((4, 3)), rng.standard_normal((3, 5)), rng.standard_normal((5, 2))


def tiny_loss(x, w1, w2):
    h = matmul(tanh(matmul(x, w1)), w2)  # (4, 2)
    return total(mul(h, h))


x, w1, w2 = Var(x_data), Var(w1_data), Var(w2_data)
loss = tiny_loss(x, w1, w2)
backward(loss)
print("loss", loss.data)
print("dL/dW2 =\n", w2.grad)

# %% [markdown] slideshow={"slide_type": "subslide"}
# Is it right? Central finite differences, (L(w + ε) − L(w − ε)) / 2ε, approximate each
# derivative with an error of order ε²: slow (two forward passes per weight) but independent of
# the engine.

# %%
def finite_differences(f, array, eps=1e-6):
    grad = np.zeros_like(array)
    for i in np.ndindex(array.shape):
        saved = array[i]
        array[i] = saved + eps
        plus = f()
        array[i] = saved - eps
        minus = f()
        array[i] = saved
        grad[i] = (plus - minus) / (2 * eps)
    return grad


numeric = finite_differences(lambda: tiny_loss(Var(x_data), Var(w1_data), Var(w2_data)).data, w1_data)
print("largest |engine - finite differences| for W1:", np.abs(w1.grad - numeric).max())
assert np.allclose(w1.grad, numeric, rtol=1e-6, atol=1e-7)

# %% [markdown] slideshow={"slide_type": "subslide"}
# The price of going path by path. Each `add(a, a)` below doubles the number of paths from the
# loss to `x`, so for a chain of k of them this `backward` runs the additions' gradient functions
# 1 + 2 + … + 2^(k−1) = 2^k − 1 times, where the forward ran each addition once:

# %%
calls = {"n": 0}


def counted_add(a, b):  # add, counting how often its gradient function runs
    def grad_fn(g):
        calls["n"] += 1
        return g, g
    return Var(a.data + b.data, (a, b), grad_fn)


for k in (4, 8, 12):
    calls["n"] = 0
    v = xk = Var(np.ones(3))
    for _ in range(k):
        v = counted_add(v, v)
    backward(total(v))
    print(f"k = {k:2d}: {k} additions, their gradient functions ran {calls['n']} times; dL/dx = {xk.grad[0]:.0f}")

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 2. refimpl's engine
#
# refimpl's engine (`refimpl/autograd/`, explained in `docs/autograd.md`) is the same idea with
# what training needs on top:
#
# - a `Tensor` holds an array (`data`), its gradient (`grad`) and the `Function` that made it
#   (`grad_fn`); a `Parameter` is a Tensor that belongs to a model;
# - each operation is a `Function` subclass with `forward` and `backward` on plain arrays; what
#   backward needs is kept with `save_for_backward`, so the engine can count it;
# - gradients are **accumulated** (`+=`) into a leaf's `.grad`, never overwritten: two backward
#   passes over two micro-batches add up, which gradient accumulation and data parallelism rely on.
#
# The same loss, in refimpl:

# %%
from refimpl.autograd import Function, Parameter, Tensor, gradcheck, saved_tensors

X = Tensor(x_data)
W1, W2 = Parameter(w1_data.copy()), Parameter(w2_data.copy())
h = (X @ W1).tanh() @ W2
L = (h * h).sum()
print("loss", L.item(), "recorded by", L.grad_fn.name)
print("live saved activations after forward:", saved_tensors.live_bytes, "bytes")
assert saved_tensors.live_bytes == 96 + 160 + 64
L.backward()
print("after backward:", saved_tensors.live_bytes, "bytes (released as each node finishes)")
print("same gradient as our engine:", np.allclose(W1.grad, w1.grad, rtol=1e-12, atol=1e-14))
assert np.allclose(W1.grad, w1.grad, rtol=1e-12, atol=1e-14)

# %% [markdown] slideshow={"slide_type": "subslide"}
# The ledger counted the arrays that the operations saved for their backward: `X` (4×3 float64, 96
# bytes; the first matmul needs it for dW₁), the tanh's output (4×5, 160 bytes; tanh's backward and
# the second matmul both use it, and it is counted once) and `h` (4×2, 64 bytes, for the square).
# `W1` and `W2` are parameters, model state rather than activations, and are not counted. Those
# activation bytes are what activation checkpointing (tutorial 06) trades for recomputation and what
# pipeline schedules (tutorials 07-08) keep in flight; refimpl measures them here, exactly, rather
# than estimating them.
#
# A new operation is a `Function` with a forward and a backward. `backward` receives the output's
# gradient and `needs`, which inputs' gradients are wanted, and returns one gradient (or `None`)
# per input. `gradcheck` compares it with finite differences.

# %%
class Cube(Function):
    """y = x³, dy/dx = 3x²."""

    def forward(self, x):
        self.save_for_backward(x)
        return x**3

    def backward(self, grad, needs):
        (x,) = self.saved
        return (grad * 3 * x**2 if needs[0] else None,)


print("Cube passes gradcheck:", gradcheck(lambda t: Cube.apply(t), [Tensor(x_data, requires_grad=True)]))

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 3. Backward in two halves: I and W
#
# For a linear layer y = x Wᵀ, backward computes two products: dx = g W, which the layer below
# is waiting for, and dW = gᵀ x, which nobody needs until the optimizer step. A pipeline stage
# can send dx to the previous stage at once and compute dW later, in time it would otherwise
# spend idle. refimpl's engine offers exactly that split:
# `backward(defer_weight_grads=True)` is the **I** pass (gradients of everything that is not a
# Parameter) and returns the deferred **W** work; `work.run()` computes the weight gradients. I
# then W gives the same bits as the full backward B, because each gradient is computed by the
# same arithmetic and summed in the same order.

# %%
def fresh():
    x = Tensor(x_data, requires_grad=True)
    w1, w2 = Parameter(w1_data.copy()), Parameter(w2_data.copy())
    h = (x @ w1).tanh() @ w2
    return x, w1, w2, (h * h).sum()


x_b, w1_b, w2_b, loss_b = fresh()
loss_b.backward()  # B: the full backward

x_i, w1_i, w2_i, loss_i = fresh()
work = loss_i.backward(defer_weight_grads=True)  # I: input gradients only
print("after I: x.grad is set:", x_i.grad is not None, "| W1.grad is", w1_i.grad, "| deferred closures:", len(work))
work.run()  # W
print("I then W equals B bit for bit:",
      all(np.array_equal(a.grad, b.grad) for a, b in [(x_i, x_b), (w1_i, w1_b), (w2_i, w2_b)]))
assert all(np.array_equal(a.grad, b.grad) for a, b in [(x_i, x_b), (w1_i, w1_b), (w2_i, w2_b)])

# %% [markdown] slideshow={"slide_type": "subslide"}
# **Question (measure and explain).** Exercise 1's sigmoid could also be composed from refimpl's
# operations, `1 / (1 + (-t).exp())`. For `t` of shape (100, 10), float64, read
# `saved_tensors.live_bytes` after the forward of the composed sigmoid and after the forward of a
# `Function` that computes it in one step with exercise 1's backward (as exercise 1's check does).
# Account for every array in the composed count (which operation saved it, and why its backward
# needs it), derive why the fused one can save its output and nothing else, name one activation
# function for which that is impossible, and say what this means for the activation memory of a
# deep network.
#
# ## Exercises
#
# Fill in each function's body, then run the cell after it: the check compares your function with
# refimpl's engine on small random inputs and says what differs.
#
# **Exercise 1.** `sigmoid_backward(y, grad_out)`: the sigmoid y = 1/(1 + e⁻ˣ) has
# dy/dx = y(1 − y). Given the output `y` saved by forward and the gradient `grad_out` of the loss
# with respect to `y`, return the gradient with respect to `x`.
#
# **Exercise 2.** `linear_backward(x, w, grad_out)`: the backward of `y = x @ w.T + b` for `x` of
# shape `(…, in)` (any number of leading dimensions), `w` of shape `(out, in)` and `b` of shape
# `(out,)`: return `(dx, dw, db)` given `grad_out` of shape `(…, out)`. Hint: flatten the leading
# dimensions.
#
# **Exercise 3.** `topological_order(loss)`: the order the engine visits nodes in. Given a loss
# Tensor, return the list of every `Function` in its graph (start at `loss.grad_fn`; a node's inputs
# are `node.inputs`, and an input Tensor `t` was produced by `t.grad_fn`, `None` for leaves and
# constants), each node once, and each node before the nodes that produced its inputs.
#
# **Exercise 4.** `backward_once(loss)`: part 1's engine without its flaw. Given the loss `Var` of
# part 1's engine (attributes `data`, `parents`, `grad_fn`, `grad`), fill the `.grad` of every Var
# it depends on, as part 1's `backward` does, but run each operation's `grad_fn` exactly once.
# Work out when a Var's gradient is complete and in which order that lets you visit them; the
# check runs your function on four expressions built with part 1's operations (a Var that is both
# inputs of one operation, two paths of different lengths to one Var, part 1's two-layer loss, a
# chain of doublings), compares the leaves' gradients with refimpl's engine and counts the
# `grad_fn` calls.

# %%
from harness import Exercises
from harness.autograd import check_backward_once, check_linear_backward, check_sigmoid_backward, check_topological_order

ex = Exercises("01_autograd")


@ex.stub
def sigmoid_backward(y, grad_out):
    raise NotImplementedError("exercise 1")


@ex.stub
def linear_backward(x, w, grad_out):
    raise NotImplementedError("exercise 2")


@ex.stub
def topological_order(loss):
    raise NotImplementedError("exercise 3")


@ex.stub
def backward_once(loss):
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_sigmoid_backward, sigmoid_backward)
ex.check(2, check_linear_backward, linear_backward)
ex.check(3, check_topological_order, topological_order)
ex.check(4, check_backward_once, backward_once)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
