"""Every op's backward against central finite differences (gradcheck), float64, hypothesis shapes."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.autograd import GradcheckError, Parameter, Tensor, gradcheck, ops
from refimpl.nn import functional as F

shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


@st.composite
def broadcast_pair(draw):
    """Two shapes that broadcast: drop leading dims and set some dims to 1 in the second."""
    shape = draw(shapes)
    keep = draw(st.integers(0, len(shape)))
    other = list(shape[len(shape) - keep:])
    for i in range(len(other)):
        if draw(st.booleans()):
            other[i] = 1
    if draw(st.booleans()):
        return shape, tuple(other)
    return tuple(other), shape


def tensor(shape, seed, positive=False, requires_grad=True):
    r = np.random.default_rng(seed)
    data = r.uniform(0.5, 2.0, shape) if positive else r.standard_normal(shape)
    return Tensor(data, requires_grad=requires_grad)


BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a ** b,
}


@pytest.mark.parametrize("name", sorted(BINARY))
@given(pair=broadcast_pair(), seed=st.integers(0, 10_000))
@settings(max_examples=15)
def test_binary_ops_broadcast(name, pair, seed):
    positive = name in ("div", "pow")
    a, b = tensor(pair[0], seed, positive), tensor(pair[1], seed + 1, positive)
    assert gradcheck(BINARY[name], [a, b])


UNARY = {
    "neg": (lambda a: -a, False),
    "exp": (lambda a: a.exp(), False),
    "log": (lambda a: a.log(), True),
    "sqrt": (lambda a: a.sqrt(), True),
    "tanh": (lambda a: a.tanh(), False),
    "relu": (lambda a: a.relu(), False),
    "gelu_tanh": (lambda a: F.gelu(a, "tanh"), False),
    "gelu_exact": (lambda a: F.gelu(a, "none"), False),
    "softmax": (lambda a: F.softmax(a, -1), False),
    "pow_scalar": (lambda a: a ** 3, False),
    "scalar_arith": (lambda a: (2.0 - a) / 3.0 + 1.5 * a, False),
}


@pytest.mark.parametrize("name", sorted(UNARY))
@given(shape=shapes, seed=st.integers(0, 10_000))
@settings(max_examples=10)
def test_unary_ops(name, shape, seed):
    fn, positive = UNARY[name]
    a = tensor(shape, seed, positive)
    if name == "relu":  # keep away from the kink, where finite differences are undefined
        a.data[np.abs(a.data) < 1e-3] = 0.5
    assert gradcheck(fn, [a])


@given(shape=shapes, data=st.data(), seed=st.integers(0, 10_000))
@settings(max_examples=20)
def test_reductions(shape, data, seed):
    axis = data.draw(st.one_of(st.none(), st.integers(-len(shape), len(shape) - 1)))
    keepdims = data.draw(st.booleans())
    a = tensor(shape, seed)
    assert gradcheck(lambda x: x.sum(axis, keepdims), [a])
    assert gradcheck(lambda x: x.mean(axis, keepdims), [a])
    assert gradcheck(lambda x: x.max(axis, keepdims), [a])


def test_max_shares_gradient_among_ties():
    a = Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]]), requires_grad=True)
    a.max(axis=1).sum().backward()
    assert np.array_equal(a.grad, [[0, 0.5, 0.5], [1, 0, 0]])


@pytest.mark.parametrize("shape_a,shape_b", [((3, 4), (4, 2)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)),
                                             ((4,), (4, 3)), ((3, 4), (4,)), ((4,), (4,)), ((2, 3, 4), (2, 4, 2))])
def test_matmul_batched_and_vectors(shape_a, shape_b):
    assert gradcheck(lambda a, b: a @ b, [tensor(shape_a, 1), tensor(shape_b, 2)])


def test_shape_ops():
    a = tensor((2, 3, 4), 3)
    assert gradcheck(lambda x: x.reshape(4, 6), [a])
    assert gradcheck(lambda x: x.reshape(-1), [a])
    assert gradcheck(lambda x: x.transpose(2, 0, 1), [a])
    assert gradcheck(lambda x: x.T, [a])


def test_indexing():
    a = tensor((5, 3), 4)
    assert gradcheck(lambda x: x[1:4, ::2], [a])
    assert gradcheck(lambda x: x[np.array([0, 2, 2, 4])], [a])  # repeated rows add up
    assert gradcheck(lambda x: x[np.array([[1, 1], [0, 3]])], [a])  # the embedding gather
    assert gradcheck(lambda x: x[a.data > 0], [a])
    assert gradcheck(lambda x: x[:, 1], [a])


def test_concatenate_split_stack():
    a, b = tensor((2, 3), 5), tensor((2, 4), 6)
    assert gradcheck(lambda x, y: ops.concatenate([x, y], axis=1), [a, b])
    assert gradcheck(lambda x: ops.stack(x.split(3, axis=1), axis=0), [tensor((2, 6), 7)])
    assert gradcheck(lambda x, y: ops.stack([x, y], axis=2), [a, tensor((2, 3), 8)])
    pieces = tensor((2, 6), 9).split(3, axis=1)
    assert [p.shape for p in pieces] == [(2, 2)] * 3
    # an unused output of a multi-output op gets a zero gradient
    assert gradcheck(lambda x: x.split(2, axis=0)[1] * 2, [tensor((4, 3), 10)])


def test_where_and_masked_fill():
    a, b = tensor((3, 4), 11), tensor((1, 4), 12)
    cond = np.random.default_rng(0).random((3, 4)) > 0.5
    assert gradcheck(lambda x, y: ops.where(cond, x, y), [a, b])
    assert gradcheck(lambda x: x.masked_fill(cond, 7.0), [a])
    assert gradcheck(lambda x: F.softmax(x.masked_fill(np.triu(np.ones((4, 4), bool), 1), -np.inf)),
                     [tensor((2, 4, 4), 13)])


def test_nn_functionals():
    x, w, b = tensor((2, 3, 5), 14), tensor((4, 5), 15), tensor((4,), 16)
    assert gradcheck(F.linear, [x, w, b])
    assert gradcheck(lambda x, w: F.linear(x, w), [x, w])
    lw, lb = tensor((5,), 17), tensor((5,), 18)
    assert gradcheck(F.layer_norm, [x, lw, lb])
    emb = tensor((6, 3), 19)
    idx = np.array([[0, 5, 5], [2, 0, 1]])
    assert gradcheck(lambda e: F.embedding(e, idx), [emb])
    targets = np.array([[1, -100, 3], [0, 3, -100]])
    logits = tensor((2, 3, 4), 20)
    assert gradcheck(lambda z: F.cross_entropy(z, targets), [logits])
    assert gradcheck(lambda z: F.cross_entropy(z, targets, reduction="sum"), [logits])
    assert gradcheck(lambda x: x.astype("float32").astype("float64") * 1.0, [tensor((3,), 21)], eps=1e-2, atol=1e-4)


def test_cross_entropy_values_and_ignore_index():
    z = np.array([[2.0, 1.0, 0.1], [0.5, 0.5, 3.0]])
    t = np.array([0, -100])
    expected = -(z[0, 0] - np.log(np.exp(z[0]).sum()))
    assert np.isclose(F.cross_entropy(Tensor(z), t).item(), expected, rtol=1e-14)
    assert F.cross_entropy(Tensor(z), np.array([-100, -100])).item() == 0.0


def test_dropout_is_seeded_and_scaled():
    x = Tensor(np.ones((1000,)), requires_grad=True)
    y1 = F.dropout(x, 0.25, np.random.default_rng(3))
    y2 = F.dropout(x, 0.25, np.random.default_rng(3))
    assert np.array_equal(y1.data, y2.data)
    assert set(np.unique(y1.data)) <= {0.0, 1 / 0.75}
    y1.sum().backward()
    assert np.array_equal(x.grad, y1.data)  # d(x * mask)/dx = mask
    assert F.dropout(x, 0.25, np.random.default_rng(3), training=False) is x


def test_gradcheck_catches_a_wrong_backward():
    class WrongSquare(ops.Function):
        def forward(self, a):
            self.save_for_backward(a)
            return a * a

        def backward(self, g, needs):
            return (g * self.saved[0],)  # should be 2 * a * g

    with pytest.raises(GradcheckError, match="differs from finite differences"):
        gradcheck(lambda a: WrongSquare.apply(a), [tensor((3,), 22)])


def test_gradients_accumulate_and_functional_grad_does_not_touch_grad():
    from refimpl.autograd import grad

    w = Parameter(np.array([1.0, 2.0]))
    (w * w).sum().backward()
    (w * w).sum().backward()
    assert np.array_equal(w.grad, [4.0, 8.0])  # 2w, twice
    (g,) = grad((w * 3.0).sum(), [w])
    assert np.array_equal(g, [3.0, 3.0]) and np.array_equal(w.grad, [4.0, 8.0])


def test_no_grad_and_detach():
    from refimpl.autograd import no_grad

    w = Parameter(np.ones(3))
    with no_grad():
        y = w * 2
    assert not y.requires_grad and y.grad_fn is None
    d = (w * 2).detach()
    assert not d.requires_grad and d.grad_fn is None


def test_backward_twice_without_retain_graph_is_an_error():
    w = Parameter(np.ones(3))
    y = (w.exp()).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()
    z = (w.exp()).sum()
    z.backward(retain_graph=True)
    z.backward()
    assert np.allclose(w.grad, np.e * 3)


def test_shape_mismatch_names_op_and_shapes():
    a, b = tensor((2, 3), 1), tensor((4, 3), 2)
    with pytest.raises(ValueError, match=r"add: shapes \(2, 3\) and \(4, 3\)"):
        a + b
    with pytest.raises(ValueError, match=r"matmul: shapes \(2, 3\) and \(4, 3\)"):
        a @ b
    with pytest.raises(ValueError, match=r"linear: input has 3 features"):
        F.linear(a, tensor((5, 4), 3))
    with pytest.raises(ValueError, match="reshape: cannot reshape"):
        a.reshape(5)


def test_causal_softmax_equals_its_composition():
    x = tensor((2, 3, 4, 4), 23)
    mask = np.triu(np.ones((4, 4), bool), 1)
    fused = F.causal_softmax(x, mask, 0.5)
    composed = F.softmax((x * 0.5).masked_fill(mask, -np.inf))
    np.testing.assert_allclose(fused.data, composed.data, rtol=1e-14, atol=0)
    assert gradcheck(lambda z: F.causal_softmax(z, mask, 0.5), [x])


# -- every op with an axis argument, along every axis it supports ------------------------------
# A backward that ignores its axis (sums over −1 whatever it was given) is right along the axis the
# models use and wrong elsewhere; the lengths 2, 3, 4 make every axis distinguishable.
CUBE = (2, 3, 4)
AXES = list(range(-len(CUBE), len(CUBE)))  # −3 … 2
AXIS_SETS = [None] + [axes for r in (1, 2, 3) for axes in itertools.combinations(range(3), r)]


@pytest.mark.parametrize("axis", AXES)
def test_softmax_along_every_axis(axis):
    assert gradcheck(lambda x: F.softmax(x, axis), [tensor(CUBE, 30 + axis)])


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES + AXIS_SETS)
@pytest.mark.parametrize("name", ["sum", "mean", "max"])
def test_reductions_along_every_axis_and_set_of_axes(name, axis, keepdims):
    a = tensor(CUBE, 40)
    assert gradcheck(lambda x: getattr(x, name)(axis, keepdims), [a])


@pytest.mark.parametrize("axis", AXES)
def test_concatenate_and_split_along_every_axis(axis):
    other = list(CUBE)
    other[axis] = 1
    a, b = tensor(CUBE, 50), tensor(tuple(other), 51)
    assert gradcheck(lambda x, y: ops.concatenate([x, y], axis=axis), [a, b])
    weighted = lambda x: ops.concatenate([p * (i + 1.0) for i, p in enumerate(x.split([1], axis=axis))],  # noqa: E731
                                         axis=axis)
    assert gradcheck(weighted, [a])
    n = CUBE[axis]
    assert gradcheck(lambda x: ops.stack(x.split(n, axis=axis), axis=0) * np.arange(1.0, n + 1).reshape(
        (n,) + (1,) * len(CUBE)), [a])


@pytest.mark.parametrize("axis", list(range(-len(CUBE) - 1, len(CUBE) + 1)))  # a new axis: −4 … 3
def test_stack_along_every_axis(axis):
    a, b = tensor(CUBE, 60), tensor(CUBE, 61)
    assert gradcheck(lambda x, y: ops.stack([x, y], axis=axis), [a, b])


@pytest.mark.parametrize("axes", list(itertools.permutations(range(3))) + [(-1, 0, -2)])
def test_transpose_along_every_permutation(axes):
    assert gradcheck(lambda x: x.transpose(axes), [tensor(CUBE, 70)])


def test_engine_refuses_a_contribution_a_leaf_does_not_expect():
    """Each leaf's contributions are counted before the pass; one more is an internal error, not a
    silently dropped gradient (a weight gradient computed in both halves of a split backward)."""
    from refimpl.autograd.engine import _LeafAccumulator

    w = Parameter(np.ones(3))
    leaves = _LeafAccumulator({id(w): 1}, None)
    leaves.add(w, np.ones(3))
    assert np.array_equal(w.grad, np.ones(3))
    with pytest.raises(RuntimeError, match="expected no more"):
        leaves.add(w, np.ones(3))
    with pytest.raises(RuntimeError, match="expected no more"):
        _LeafAccumulator({}, None).add(Parameter(np.ones(2)), None)
    assert np.array_equal(w.grad, np.ones(3))
