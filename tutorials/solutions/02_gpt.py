"""Reference solutions to tutorial 02's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them), and a
model answer to its question (at the end)."""

import numpy as np


def attention(q, k, v):
    T, D = q.shape[-2], q.shape[-1]
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(D)  # (B, H, T, T)
    scores = np.where(np.triu(np.ones((T, T), dtype=bool), k=1), -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ v  # (B, H, T, D)


def count_parameters(vocab_size, seq_len, n_layer, d_model):
    C = d_model
    block = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C)
    return vocab_size * C + seq_len * C + n_layer * block + 2 * C + vocab_size * C


def cross_entropy(logits, targets, ignore_index=-100):
    z = logits.reshape(-1, logits.shape[-1])  # (N, V)
    t = targets.reshape(-1)  # (N,)
    counted = t != ignore_index
    z = z - z.max(axis=1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    picked = log_probs[np.arange(len(t)), np.where(counted, t, 0)]
    return -(picked * counted).sum() / max(1, counted.sum())


def cross_entropy_grad(logits, targets, ignore_index=-100):
    # L = (1/n) Σ_counted −log softmax(z)[t], so dL/dz = (softmax(z) − onehot(t)) / n on counted
    # positions and 0 on ignored ones, with n the number of counted targets.
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    counted = targets != ignore_index
    onehot = np.zeros_like(p)
    np.put_along_axis(onehot, np.where(counted, targets, 0)[..., None], 1.0, axis=-1)
    return (p - onehot) * counted[..., None] / max(1, counted.sum())


ANSWER = """
Model answer to the question (measure and explain).

Measured peaks of part 4's model (2 blocks, 4 heads, C = 32, V = 11, float32) at B = 4:
T = 8: 149,504 bytes; 16: 315,392; 32: 696,320; 64: 1,654,784; 128: 4,358,144. Doubling T
multiplies them by 2.11, 2.21, 2.38, 2.63: more than 2, tending to 4. Per token the bytes are
exactly 4416 + 32·T, so peak = B·T·(4416 + 32·T).

The T² term is attention: each block saves the attention probabilities, B·H·T·T float32 numbers,
for the backward of `att @ v` and of the softmax: 4 bytes · H = 4 heads · 2 blocks = 32 bytes per
token per unit of T. The linear term is everything saved per token: measured per block (peak with
1, 2 and 4 blocks) 2056 bytes = 4·(16·C + 2) per token, the layer norms' inputs and statistics,
q, k, v, the attention output, the MLP's 4C-wide input and GELU input, the projections' inputs;
the remaining 304 bytes per token are the embedding, the final layer norm, the head and the loss's
softmax over V. So the linear term grows with n_layer·C, the quadratic one with n_layer·H·T.

Per block, attention's T² part equals the rest when 4·H·T = 4·(16C + 2), T = (16C + 2)/H ≈ 128
here. For d_model 4096 and 32 heads, T = (16·4096 + 2)/32 ≈ 2048 (T ≈ 16·C/H in general): at
sequence lengths of several thousand the attention probabilities dominate activation memory. That is why selective
recomputation (Korthikanti et al.) recomputes exactly this part, and why memory-efficient
attention never stores the T×T matrix at all.
"""
