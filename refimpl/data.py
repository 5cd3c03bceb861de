"""Synthetic tasks and character-level text, with global batches that are identical in every process.

A batch is a pure function of (seed, step): `task.batch(step, batch_size)` draws from
numpy.random.default_rng([seed, step]), so every rank of a distributed run builds the same global
batch and takes its own slice of it. `--batch-size` is always the global batch.

Tasks (x, y are NumPy arrays; ignored targets are IGNORE = -100):

    SortTask     the GPT reads L integers in [0, S), a separator, and writes them sorted:
                 tokens  a₁ … a_L | s₁ … s_L      (vocabulary S + 1, model sequence 2L)
                 targets are the sorted half; the prompt positions are ignored
    SpiralsTask  K interleaved 2-D spiral arms; the MLP classifies a point's arm
    TextTask     next-character prediction on a text file (random windows; last 10% held out)

Accuracy is the fraction of counted target positions where the model's most likely token (given
the true prefix) is right, on held-out examples drawn from a stream that training never uses.
"""

from __future__ import annotations

import os

import numpy as np

IGNORE = -100
_EVAL_STREAM = 2**31 - 1  # a step number training never reaches: the held-out stream


class SortTask:
    kind = "gpt"

    def __init__(self, length: int = 8, n_symbols: int = 10, seed: int = 0) -> None:
        if length < 1 or n_symbols < 2:
            raise ValueError(f"sort task needs length >= 1 and at least 2 symbols, got {length}, {n_symbols}")
        self.length, self.n_symbols, self.seed = length, n_symbols, seed
        self.vocab_size = n_symbols + 1
        self.seq_len = 2 * length

    def batch(self, step: int, batch_size: int):
        rng = np.random.default_rng([self.seed, step])
        a = rng.integers(0, self.n_symbols, (batch_size, self.length))
        sep = np.full((batch_size, 1), self.n_symbols)
        tokens = np.concatenate([a, sep, np.sort(a, axis=1)], axis=1)  # (B, 2L + 1)
        x, y = tokens[:, :-1], tokens[:, 1:].copy()  # (B, 2L) each
        y[:, : self.length] = IGNORE  # only the L sorted outputs are predicted (not the separator)
        return x, y

    def eval_batch(self, n: int = 256):
        return self.batch(_EVAL_STREAM, n)


class SpiralsTask:
    kind = "mlp"

    def __init__(self, n_classes: int = 3, noise: float = 0.1, seed: int = 0) -> None:
        if n_classes < 2:
            raise ValueError(f"spirals need at least 2 classes, got {n_classes}")
        self.n_classes, self.noise, self.seed = n_classes, noise, seed
        self.n_features = 2

    def batch(self, step: int, batch_size: int):
        rng = np.random.default_rng([self.seed, step])
        label = rng.integers(0, self.n_classes, batch_size)
        r = rng.random(batch_size)  # radius in [0, 1)
        angle = 4.0 * r + 2 * np.pi * label / self.n_classes + rng.standard_normal(batch_size) * self.noise
        x = np.stack([r * np.sin(angle), r * np.cos(angle)], axis=1)  # (B, 2)
        return x, label

    def eval_batch(self, n: int = 1024):
        return self.batch(_EVAL_STREAM, n)


class TextTask:
    kind = "gpt"

    def __init__(self, path: str, seq_len: int = 64, seed: int = 0) -> None:
        if os.path.isdir(path):
            raise ValueError(f"text file {path!r} is a directory; give --data a text file")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"text file {path!r} does not exist")
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if len(text) < seq_len + 2:
            raise ValueError(f"text file {path!r} has {len(text)} characters; it needs at least "
                             f"{seq_len + 2} for sequences of length {seq_len} (use a longer file or a smaller --seq-len)")
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        self.data = np.array([lookup[c] for c in text], dtype=np.int64)
        self.split = max(seq_len + 1, int(len(self.data) * 0.9))
        if len(self.data) - self.split < seq_len + 1:
            self.split = len(self.data)  # too short to hold out a tail: evaluate on the training text
        self.vocab_size, self.seq_len, self.seed = len(self.chars), seq_len, seed

    def _windows(self, rng, lo: int, hi: int, batch_size: int):
        start = rng.integers(lo, hi - self.seq_len, batch_size)  # (B,)
        idx = start[:, None] + np.arange(self.seq_len + 1)  # (B, T + 1)
        tokens = self.data[idx]
        return tokens[:, :-1], tokens[:, 1:]

    def batch(self, step: int, batch_size: int):
        return self._windows(np.random.default_rng([self.seed, step]), 0, self.split, batch_size)

    def eval_batch(self, n: int = 64):
        lo = self.split if self.split < len(self.data) else 0
        return self._windows(np.random.default_rng([self.seed, _EVAL_STREAM]), lo, len(self.data), n)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


def accuracy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Fraction of counted targets (not IGNORE) where argmax(logits) is the target."""
    counted = targets != IGNORE
    return float(((logits.argmax(axis=-1) == targets) & counted).sum() / max(1, counted.sum()))
