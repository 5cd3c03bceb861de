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
    if got is not None and np.shape(got) == expected.shape and not np.allclose(got, expected, rtol=1e-10, atol=1e-12):
        for mistake, variant in _attention_variants(q, k, v).items():
            if np.allclose(got, variant, rtol=1e-8, atol=1e-12):
                raise Wrong(f"attention(q, k, v) for q, k, v of shape (2, 3, 5, 4) differs from refimpl's: {mistake}")
    expect_close(got, expected, "attention(q, k, v) for q, k, v of shape (2, 3, 5, 4)")
    if not np.allclose(got[..., 0, :], v[..., 0, :], rtol=1e-10, atol=1e-12):
        raise Wrong("position 0 may attend only to itself, so its output must equal v[..., 0, :]")


def _attention_variants(q, k, v) -> dict:
    """{the mistake: what attention computes with it}, for the message."""
    def attend(mask_k=1, scale=True, axis=-1):
        scores = q @ k.transpose(0, 1, 3, 2) / (math.sqrt(q.shape[-1]) if scale else 1.0)
        if mask_k is not None:
            scores = np.where(np.triu(np.ones(scores.shape[-2:], dtype=bool), k=mask_k), -np.inf, scores)
        scores = scores - scores.max(axis=axis, keepdims=True)
        weights = np.exp(scores)
        return (weights / weights.sum(axis=axis, keepdims=True)) @ v

    return {"no causal mask: each position may attend only to itself and the positions before it "
            "(−∞ above the diagonal, np.triu(..., k=1))": attend(mask_k=None),
            "the scores are not scaled by 1/√D": attend(scale=False),
            "the softmax runs over the wrong axis: each query's weights (a row, the last axis) sum to 1":
                attend(axis=-2)}


def check_count_parameters(count_parameters) -> None:
    """Check: GPT parameter count."""
    for vocab, seq_len, n_layer, d_model in [(11, 12, 2, 32), (50, 64, 4, 128), (7, 3, 1, 8)]:
        config = GPTConfig(vocab_size=vocab, seq_len=seq_len, n_layer=n_layer, n_head=4, d_model=d_model)
        expected = GPT(config).num_parameters()
        got = count_parameters(vocab, seq_len, n_layer, d_model)
        if got != expected:
            V, T, L, d = vocab, seq_len, n_layer, d_model
            likely = {
                expected - V * d: "the head: refimpl's GPT has its own lm_head of V·d weights, not tied to the token "
                                  "embedding",
                expected - T * d: "the position embedding, seq_len·d_model",
                expected - L * 13 * d: "each block's 13·d small parameters: the biases (3d + d + 4d + d) and the "
                                       "two layer norms' weights and biases (4d); a block is 12d² + 13d",
                expected - L * 9 * d - d: "the biases: qkv 3d, attention proj d, fc 4d, MLP proj d per block",
                expected - L * 4 * d - 2 * d: "the layer norms' weights and biases: 2 per block and the final one",
                expected - 2 * d: "the final layer norm (ln_f), 2d",
            }
            hint = likely.get(plain(got)) if isinstance(plain(got), int) else None
            raise Wrong(f"for vocab_size={vocab}, seq_len={seq_len}, n_layer={n_layer}, d_model={d_model} "
                        f"the GPT has {expected} parameters; you counted {plain(got)}"
                        + (f". Your count leaves out {hint}" if hint else ""))


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
