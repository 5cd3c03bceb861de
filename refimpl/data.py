"""Synthetic tasks and character-level text, with global batches that are identical in every process.

A batch is a pure function of (seed, step): `task.batch(step, batch_size)` draws from
numpy.random.default_rng([seed, step]), so every rank of a distributed run builds the same global
batch and takes its own slice of it. `--batch-size` is always the global batch.

Tasks (x, y are NumPy arrays; ignored targets are IGNORE = -100):

    SortTask     the GPT reads L integers in [0, S), a separator, and writes them sorted:
                 tokens  a₁ … a_L | s₁ … s_L      (vocabulary S + 1, model sequence 2L)
                 targets are the sorted half; the prompt positions are ignored
    SpiralsTask  K interleaved 2-D spiral arms; the MLP classifies a point's arm
    TextTask     next-character prediction on a UTF-8 text file (random windows; last 10% held out)

Accuracy is the fraction of counted target positions where the model's most likely token (given
the true prefix) is right, on held-out examples drawn from a stream that training never uses.
"""

from __future__ import annotations

import os
import stat

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
    """Next-character prediction on a UTF-8 text file: the vocabulary is the file's distinct
    characters sorted by code point (self.chars); self.data holds every character's index in it
    (the smallest unsigned dtype that fits; batches are int64)."""

    kind = "gpt"

    def __init__(self, path: str, seq_len: int = 64, seed: int = 0) -> None:
        codes = read_code_points(path)
        if len(codes) < seq_len + 2:
            raise ValueError(f"text file {path!r} has {len(codes)} characters; it needs at least "
                             f"{seq_len + 2} for sequences of length {seq_len} "
                             "(use a longer file or a smaller --seq-len)")
        self.chars, self.data = tokenize(codes)
        self.split = max(seq_len + 1, int(len(self.data) * 0.9))
        if len(self.data) - self.split < seq_len + 1:
            self.split = len(self.data)  # too short to hold out a tail: evaluate on the training text
        self.vocab_size, self.seq_len, self.seed = len(self.chars), seq_len, seed

    def _windows(self, rng, lo: int, hi: int, batch_size: int):
        start = rng.integers(lo, hi - self.seq_len, batch_size)  # (B,)
        idx = start[:, None] + np.arange(self.seq_len + 1)  # (B, T + 1)
        tokens = self.data[idx].astype(np.int64)
        return tokens[:, :-1], tokens[:, 1:]

    def batch(self, step: int, batch_size: int):
        return self._windows(np.random.default_rng([self.seed, step]), 0, self.split, batch_size)

    def eval_batch(self, n: int = 64):
        lo = self.split if self.split < len(self.data) else 0
        return self._windows(np.random.default_rng([self.seed, _EVAL_STREAM]), lo, len(self.data), n)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


# Not regular files, by what `stat` calls them: reading a FIFO or a socket waits for a writer,
# /dev/zero never ends.
_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_code_points(path: str) -> np.ndarray:
    """The characters of a UTF-8 text file as code points (n,): uint8 if the file is ASCII, else
    uint32. Newlines are translated as Python's text mode does ("\\r\\n" and "\\r" become "\\n").

    Decoding is strict: bytes that are not UTF-8 are an error naming the offset of the first bad
    one, never replacement characters. Anything but a regular file (a FIFO, a device, a socket) is
    refused by name before it is opened: reading it could wait forever, or never end.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        link = f" (a symbolic link to {os.readlink(path)!r}, which does not)" if os.path.islink(path) else ""
        raise FileNotFoundError(f"text file {path!r} does not exist{link}") from None
    except OSError as exc:
        raise ValueError(f"cannot read text file {path!r}: {exc.strerror}; give --data a readable text file") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"text file {path!r} is a directory; give --data a text file")
    for is_kind, kind in _NOT_REGULAR:
        if is_kind(mode):
            raise ValueError(f"text file {path!r} is {kind}, not a regular file; give --data a text file "
                             f"(save the stream to a file first)")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read text file {path!r}: {exc.strerror}; give --data a readable text file") from None
    if raw.isascii():  # ASCII is UTF-8 with one byte per character: the bytes are the code points
        if b"\r" in raw:
            raw = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        return np.frombuffer(raw, dtype=np.uint8)  # (n,)
    try:
        text = raw.decode("utf-8")  # strict
    except UnicodeDecodeError as exc:
        raise ValueError(f"text file {path!r} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                         f"({exc.reason}); convert it to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 FILE > FILE.txt) "
                         f"or give a UTF-8 text file") from None
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")  # (n,)


_BLOCK = 1 << 18  # characters per block of tokenize's histogram and gather


def tokenize(codes: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(vocabulary, token ids) of a text given as code points (n,): its distinct characters sorted
    by code point, and each character's index in that list. Vectorised, no loop over characters:

        present[c] = c occurs in the text       (max code + 1,)   a histogram's nonzero bins
        rank = cumsum(present) - 1              (max code + 1,)   a code's index among the present ones
        ids = rank[codes]                       (n,)

    ids are in the smallest unsigned dtype that holds the vocabulary's indices (uint8 up to 256
    characters): a 48 MB file is 48 MB of ids, not 384 MB of int64. The histogram and the gather
    run over blocks of _BLOCK characters: NumPy converts the indices to int64 first, and a block's
    copy stays in cache where the whole text's would not. tokenize_naive is the same result read
    directly off the definition.
    """
    codes = np.asarray(codes)
    if len(codes) == 0:
        return [], np.zeros(0, dtype=np.uint8)
    counts = np.zeros(int(codes.max()) + 1, dtype=np.int64)  # (max code + 1,)
    for i in range(0, len(codes), _BLOCK):
        block = np.bincount(codes[i:i + _BLOCK])
        counts[:len(block)] += block
    present = counts > 0
    dtype = np.min_scalar_type(int(present.sum()) - 1)  # uint8, uint16 or uint32
    rank = (np.cumsum(present) - 1).astype(dtype)  # (max code + 1,)
    ids = np.empty(len(codes), dtype=dtype)  # (n,)
    for i in range(0, len(codes), _BLOCK):
        np.take(rank, codes[i:i + _BLOCK], out=ids[i:i + _BLOCK])
    return [chr(c) for c in np.flatnonzero(present)], ids


def tokenize_naive(text: str) -> tuple[list[str], np.ndarray]:
    """tokenize with a dictionary and a loop over the characters of a string: the definition read
    directly, the reference that tokenize is tested and benchmarked against (int64 ids)."""
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    return chars, np.array([lookup[c] for c in text], dtype=np.int64)


def accuracy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Fraction of counted targets (not IGNORE) where argmax(logits) is the target."""
    counted = targets != IGNORE
    return float(((logits.argmax(axis=-1) == targets) & counted).sum() / max(1, counted.sum()))
