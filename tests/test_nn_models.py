"""The GPT against finite differences, and attention / layer norm against separately written NumPy."""

import math

import numpy as np

from refimpl.autograd import Tensor, gradcheck
from refimpl.nn import GPT, CausalSelfAttention, GPTConfig, MLPClassifier
from refimpl.nn import functional as F


def test_whole_gpt_gradients_match_finite_differences():
    cfg = GPTConfig(vocab_size=5, seq_len=4, n_layer=1, n_head=2, d_model=4, dtype="float64")
    model = GPT(cfg, seed=0)
    idx = np.array([[0, 3, 1, 4], [2, 2, 0, 1]])
    targets = np.array([[3, 1, 4, -100], [2, 0, 1, 3]])
    params = model.parameters()

    def loss_of(*tensors):
        # the tensors are the model's own parameters; gradcheck perturbs them in place
        return model.loss(idx, targets)

    assert gradcheck(loss_of, params, atol=1e-7, rtol=1e-5)


# --- separately written NumPy forward and backward ---------------------------------------------
def numpy_layer_norm(x, w, b, g, eps=1e-5):
    """Forward and backward of layer norm over the last axis, written from the definition."""
    n = x.shape[-1]
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    xhat = (x - mu) / np.sqrt(var + eps)
    y = xhat * w + b
    dxhat = g * w
    dvar = (dxhat * (x - mu) * -0.5 * (var + eps) ** -1.5).sum(-1, keepdims=True)
    dmu = (-dxhat / np.sqrt(var + eps)).sum(-1, keepdims=True) + dvar * (-2 * (x - mu)).mean(-1, keepdims=True)
    dx = dxhat / np.sqrt(var + eps) + dvar * 2 * (x - mu) / n + dmu / n
    return y, dx, (g * xhat).reshape(-1, n).sum(0), g.reshape(-1, n).sum(0)


def numpy_attention(x, wqkv, bqkv, wproj, bproj, n_head, g):
    """Causal self-attention forward and backward with explicit loops over heads."""
    B, T, C = x.shape
    D = C // n_head
    qkv = x @ wqkv.T + bqkv
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    mask = np.triu(np.ones((T, T), bool), 1)
    y = np.zeros((B, T, C))
    cache = []
    for h in range(n_head):
        s = slice(h * D, (h + 1) * D)
        scores = q[..., s] @ np.swapaxes(k[..., s], 1, 2) / math.sqrt(D)
        scores[:, mask] = -np.inf
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        y[..., s] = p @ v[..., s]
        cache.append(p)
    out = y @ wproj.T + bproj
    # backward
    dy = g @ wproj
    dwproj = g.reshape(-1, C).T @ y.reshape(-1, C)
    dbproj = g.reshape(-1, C).sum(0)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for h in range(n_head):
        s = slice(h * D, (h + 1) * D)
        p = cache[h]
        dp = dy[..., s] @ np.swapaxes(v[..., s], 1, 2)
        dv[..., s] = np.swapaxes(p, 1, 2) @ dy[..., s]
        dscores = p * (dp - (dp * p).sum(-1, keepdims=True)) / math.sqrt(D)
        dq[..., s] = dscores @ k[..., s]
        dk[..., s] = np.swapaxes(dscores, 1, 2) @ q[..., s]
    dqkv = np.concatenate([dq, dk, dv], -1)
    dx = dqkv @ wqkv
    dwqkv = dqkv.reshape(-1, 3 * C).T @ x.reshape(-1, C)
    return out, dx, dwqkv, dqkv.reshape(-1, 3 * C).sum(0), dwproj, dbproj


def test_layer_norm_matches_numpy_reference(rng):
    x, w, b = rng.standard_normal((3, 5, 8)), rng.standard_normal(8), rng.standard_normal(8)
    g = rng.standard_normal((3, 5, 8))
    xt = Tensor(x, requires_grad=True)
    wt, bt = Tensor(w, requires_grad=True), Tensor(b, requires_grad=True)
    y = F.layer_norm(xt, wt, bt)
    y.backward(g)
    ry, rdx, rdw, rdb = numpy_layer_norm(x, w, b, g)
    for ours, ref in ((y.data, ry), (xt.grad, rdx), (wt.grad, rdw), (bt.grad, rdb)):
        np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12)


def test_attention_matches_numpy_reference(rng):
    attn = CausalSelfAttention(8, 2, 6, rng, dtype="float64")
    x = rng.standard_normal((2, 6, 8))
    g = rng.standard_normal((2, 6, 8))
    xt = Tensor(x, requires_grad=True)
    out = attn(xt)
    out.backward(g)
    ref = numpy_attention(x, attn.qkv.weight.data, attn.qkv.bias.data, attn.proj.weight.data,
                          attn.proj.bias.data, 2, g)
    ours = (out.data, xt.grad, attn.qkv.weight.grad, attn.qkv.bias.grad, attn.proj.weight.grad, attn.proj.bias.grad)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_attention_is_causal(rng):
    attn = CausalSelfAttention(8, 2, 6, rng, dtype="float64")
    x = rng.standard_normal((1, 6, 8))
    y1 = attn(Tensor(x)).data
    x[:, 4:] += 1.0  # change the future
    y2 = attn(Tensor(x)).data
    np.testing.assert_array_equal(y1[:, :4], y2[:, :4])
    assert not np.allclose(y1[:, 4:], y2[:, 4:])


def test_mlp_classifier_gradients(rng):
    model = MLPClassifier([2, 5, 3], seed=0, dtype="float64")
    x, t = rng.standard_normal((7, 2)), rng.integers(0, 3, 7)
    assert gradcheck(lambda *ps: model.loss(x, t), model.parameters())
