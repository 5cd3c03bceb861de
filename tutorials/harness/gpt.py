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
