"""Backward in two halves: I (input gradients, weight work deferred) then W equals B, bit for bit."""

import numpy as np
import pytest

from refimpl.autograd import Parameter, Tensor, backward, ops, saved_tensors
from refimpl.nn import GPT, Block, GPTConfig
from refimpl.nn import functional as F

# Each case: op(activation, parameter...) for activations and parameters of the given shapes.
CASES = {
    "add": (lambda x, w: x + w, [(3, 4)], [(4,)]),
    "sub": (lambda x, w: w - x, [(3, 4)], [(3, 4)]),
    "mul": (lambda x, w: x * w, [(3, 4)], [(1, 4)]),
    "div": (lambda x, w: x / (w * w + 1.0), [(3, 4)], [(4,)]),
    "pow": (lambda x, w: (x * x + 1.0) ** w, [(3, 4)], [(4,)]),
    "matmul": (lambda x, w: x @ w, [(2, 3, 4)], [(4, 5)]),
    "linear": (lambda x, w, b: F.linear(x, w, b), [(2, 3, 4)], [(5, 4), (5,)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, w, b), [(2, 3, 4)], [(4,), (4,)]),
    "embedding+add": (lambda x, w: F.embedding(w, np.array([[0, 2, 2]])) + x, [(1, 3, 4)], [(3, 4)]),
    "concatenate": (lambda x, w: ops.concatenate([x, w], axis=0).tanh(), [(2, 4)], [(3, 4)]),
    "stack": (lambda x, w: ops.stack([x, w]).exp(), [(2, 4)], [(2, 4)]),
    "where": (lambda x, w: ops.where(x.data > 0, x, w), [(3, 4)], [(4,)]),
    "max+sum": (lambda x, w: (x * w).max(axis=1).sum(), [(3, 4)], [(4,)]),
    "softmax": (lambda x, w: F.softmax(x * w), [(3, 4)], [(4,)]),
    "gelu": (lambda x, w: F.gelu(x + w), [(3, 4)], [(4,)]),
    "getitem": (lambda x, w: w[np.array([1, 1, 0])] * x, [(3, 4)], [(2, 4)]),
    "transposed weight": (lambda x, w: x @ w.T, [(3, 4)], [(5, 4)]),
    # unary and shape ops, each fed by an activation that also depends on a weight
    "neg": (lambda x, w: -(x * w), [(3, 4)], [(4,)]),
    "exp": (lambda x, w: (x * w).exp(), [(3, 4)], [(4,)]),
    "log": (lambda x, w: (x * x + w * w + 1.0).log(), [(3, 4)], [(4,)]),
    "sqrt": (lambda x, w: (x * x + w * w + 1.0).sqrt(), [(3, 4)], [(4,)]),
    "tanh": (lambda x, w: (x * w).tanh(), [(3, 4)], [(4,)]),
    "relu": (lambda x, w: (x * w).relu(), [(3, 4)], [(4,)]),
    "mean": (lambda x, w: (x * w).mean(axis=0), [(3, 4)], [(4,)]),
    "reshape+transpose": (lambda x, w: (x * w).reshape(2, 6).transpose(1, 0), [(3, 4)], [(4,)]),
    "split": (lambda x, w: (x * w).split(2, axis=1)[1] * 3.0, [(3, 4)], [(4,)]),
    "masked_fill": (lambda x, w: (x * w).masked_fill(np.eye(3, 4, dtype=bool), 0.0), [(3, 4)], [(4,)]),
    "causal_softmax": (lambda x, w: F.causal_softmax(x * w, np.triu(np.ones((4, 4), bool), 1), 0.5),
                       [(2, 4, 4)], [(4,)]),
    "cross_entropy": (lambda x, w: F.cross_entropy(x * w, np.array([1, -100, 3])), [(3, 4)], [(4,)]),
    "dropout": (lambda x, w: F.dropout(x * w, 0.5, np.random.default_rng(0)), [(3, 4)], [(4,)]),
    "astype": (lambda x, w: (x * w).astype("float32").astype("float64"), [(3, 4)], [(4,)]),
}


def _run(case, split, seed=0):
    fn, act_shapes, param_shapes = CASES[case]
    r = np.random.default_rng(seed)
    acts = [Tensor(r.standard_normal(s), requires_grad=True) for s in act_shapes]
    params = [Parameter(r.standard_normal(s)) for s in param_shapes]
    out = fn(*acts, *params)
    g = np.random.default_rng(seed + 1).standard_normal(out.shape)
    if split:
        work = backward([out], [g], defer_weight_grads=True)
        # after I: activation gradients are there, no weight gradient yet
        assert all(a.grad is not None for a in acts) and all(p.grad is None for p in params)
        work.run()
    else:
        backward([out], [g])
    return [a.grad for a in acts], [p.grad for p in params]


@pytest.mark.parametrize("case", sorted(CASES))
def test_i_then_w_equals_b_bitwise(case):
    acts_b, params_b = _run(case, split=False)
    acts_s, params_s = _run(case, split=True)
    for x, y in zip(acts_b + params_b, acts_s + params_s):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def _block_grads(split: bool, dtype):
    block = Block(16, 4, 8, np.random.default_rng(0), dropout=0.1, n_layer=2, dtype=dtype, seed=5)
    x = Tensor(np.random.default_rng(1).standard_normal((2, 8, 16)).astype(dtype), requires_grad=True)
    out = block(x)
    g = np.random.default_rng(2).standard_normal(out.shape).astype(dtype)
    if split:
        work = backward([out], [g], defer_weight_grads=True)
        assert x.grad is not None and all(p.grad is None for p in block.parameters())
        assert len(work) > 0
        work.run()
    else:
        backward([out], [g])
    return x.grad, [p.grad for p in block.parameters()]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpt_block_split_backward_is_bitwise(dtype):
    xb, pb = _block_grads(False, dtype)
    xs, ps = _block_grads(True, dtype)
    assert np.array_equal(xb, xs)
    assert len(pb) == len(ps) == 12
    for a, b in zip(pb, ps):
        assert np.array_equal(a, b)


def test_whole_gpt_split_backward_with_tied_weights_is_bitwise():
    cfg = GPTConfig(vocab_size=11, seq_len=8, n_layer=2, n_head=2, d_model=16, tie_weights=True, dtype="float64")
    idx = np.random.default_rng(0).integers(0, 11, (3, 8))
    results = []
    for split in (False, True):
        model = GPT(cfg, seed=3)
        loss = model.loss(idx, idx)
        work = loss.backward(defer_weight_grads=split)
        if split:
            work.run()
        results.append([p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_saved_tensors_are_freed_at_w_not_at_i():
    w = Parameter(np.ones((4, 4)))
    x = Tensor(np.ones((2, 4)), requires_grad=True)
    out = F.linear(x, w).tanh()
    live = saved_tensors.live_bytes
    work = out.sum().backward(defer_weight_grads=True)
    # tanh released its output after I; linear keeps its input x until W computes x^T g
    assert saved_tensors.live_bytes == live - out.data.nbytes
    work.run()
    assert saved_tensors.live_bytes == live - out.data.nbytes - x.data.nbytes
    with pytest.raises(RuntimeError, match="already run"):
        work.run()


def test_weight_work_runs_post_accumulate_hooks_in_w():
    w = Parameter(np.ones(3))
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.copy()))
    x = Tensor(np.arange(3.0), requires_grad=True)
    work = (x * w).sum().backward(defer_weight_grads=True)
    assert seen == []
    work.run()
    assert len(seen) == 1 and np.array_equal(seen[0], [0.0, 1.0, 2.0])


def test_split_backward_on_copies_of_parameters_is_independent():
    # the deferred closure keeps the gradient it was given, even if later passes run first
    w = Parameter(np.array([2.0]))
    works = []
    for k in (1.0, 10.0):
        x = Tensor(np.array([k]), requires_grad=True)
        works.append((x * w).sum().backward(defer_weight_grads=True))
    works[1].run()
    works[0].run()
    assert np.array_equal(w.grad, [11.0])
