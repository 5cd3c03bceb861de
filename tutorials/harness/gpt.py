"""Checks for tutorial 02 (a GPT in NumPy): attention, the parameter count, the loss."""

from __future__ import annotations

import math

import numpy as np

from refimpl.autograd import Tensor
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F

from . import Wrong, expect_close, plain


def check_attention(attention) -> None:
    """Check: causal attention."""
    rng = np.random.default_rng(4)
    B, H, T, D = 2, 3, 5, 4
    q, k, v = (rng.standard_normal((B, H, T, D)) for _ in range(3))
    mask = np.triu(np.ones((T, T), dtype=bool), k=1)  # True above the diagonal: the future
    att = F.causal_softmax(Tensor(q) @ Tensor(k.transpose(0, 1, 3, 2)), mask, 1.0 / math.sqrt(D))  # (B, H, T, T)
    expected = (att @ Tensor(v)).data  # (B, H, T, D), as CausalSelfAttention computes it
    got = attention(q, k, v)
    expect_close(got, expected, "attention(q, k, v) for q, k, v of shape (2, 3, 5, 4)")
    if not np.allclose(got[..., 0, :], v[..., 0, :], rtol=1e-10, atol=1e-12):
        raise Wrong("position 0 may attend only to itself, so its output must equal v[..., 0, :]")


def check_count_parameters(count_parameters) -> None:
    """Check: GPT parameter count."""
    for vocab, seq_len, n_layer, d_model in [(11, 12, 2, 32), (50, 64, 4, 128), (7, 3, 1, 8)]:
        config = GPTConfig(vocab_size=vocab, seq_len=seq_len, n_layer=n_layer, n_head=4, d_model=d_model)
        expected = GPT(config).num_parameters()
        got = count_parameters(vocab, seq_len, n_layer, d_model)
        if got != expected:
            raise Wrong(f"for vocab_size={vocab}, seq_len={seq_len}, n_layer={n_layer}, d_model={d_model} "
                        f"the GPT has {expected} parameters; you counted {plain(got)}")


def check_cross_entropy(cross_entropy) -> None:
    """Check: cross-entropy with ignored targets."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 4, 6)) * 3  # (B, T, V)
    targets = rng.integers(0, 6, (3, 4))
    targets[:, :2] = -100  # the prompt positions are not predicted
    expected = F.cross_entropy(Tensor(logits), targets).item()
    expect_close(cross_entropy(logits, targets), expected, "cross_entropy(logits, targets) with ignored targets")
    large = logits + 1000.0  # softmax is unchanged by a constant shift; a naive exp overflows
    expect_close(cross_entropy(large, targets), expected, "cross_entropy(logits + 1000, targets) (is it stable?)",
                 rtol=1e-8)


def check_cross_entropy_grad(cross_entropy_grad) -> None:
    """Check: the gradient of the loss with respect to the logits."""
    from refimpl.autograd import engine  # noqa: PLC0415

    rng = np.random.default_rng(6)
    cases = []
    logits = rng.standard_normal((3, 4, 6)) * 3  # (B, T, V)
    targets = rng.integers(0, 6, (3, 4))
    targets[:, :2] = -100  # the prompt positions are not predicted
    cases.append((logits, targets, "logits (3, 4, 6) with 6 of 12 targets ignored"))
    targets = rng.integers(0, 6, (3, 4))
    targets[1, 3] = -100
    cases.append((rng.standard_normal((3, 4, 6)), targets, "logits (3, 4, 6) with 1 of 12 targets ignored"))
    cases.append((logits + 1000.0, cases[0][1], "logits + 1000 (is it stable?)"))
    for z, t, what in cases:
        zt = Tensor(z, requires_grad=True)
        (expected,) = engine.grad(F.cross_entropy(zt, t), [zt])
        got = cross_entropy_grad(z, t)
        if got is None or np.shape(got) != z.shape:
            raise Wrong(f"for {what} return an array of the logits' shape {z.shape}; got "
                        f"{None if got is None else np.shape(got)}")
        got = np.asarray(got, dtype=np.float64)
        ignored = t == -100
        counted, positions = int((~ignored).sum()), t.size
        if ignored.any() and not np.allclose(got[ignored], 0.0, atol=1e-12):
            raise Wrong(f"for {what}: a position whose target is -100 does not enter the loss, so the gradient of "
                        f"its logits is 0; yours is not (largest |value| {float(np.abs(got[ignored]).max()):.3g})")
        if counted != positions and np.allclose(got * positions / counted, expected, rtol=1e-8, atol=1e-12):
            raise Wrong(f"for {what}: you divided by all {positions} positions; the loss is the mean over the "
                        f"{counted} counted targets, so divide by {counted}")
        if np.allclose(-got, expected, rtol=1e-8, atol=1e-12):
            raise Wrong(f"for {what}: your gradient has the wrong sign: d(-log softmax(z)[t])/dz = "
                        f"softmax(z) - onehot(t), divided by the number of counted targets")
        sums = got.sum(axis=-1)
        if not np.allclose(sums, 0.0, atol=1e-10):
            raise Wrong(f"for {what}: the gradient of each position's logits must sum to 0 (softmax sums to 1 "
                        f"and so does the one-hot target); yours sum to up to {float(np.abs(sums).max()):.3g}. "
                        f"Did you forget to subtract the one-hot target, or take the softmax over the wrong axis?")
        expect_close(got, expected, f"cross_entropy_grad for {what}", rtol=1e-8)
