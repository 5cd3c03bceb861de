"""Cross-entropy over vocabulary shards, without gathering the logits (Megatron-LM's vocab-parallel loss).

The output layer is column-parallel over the vocabulary: rank r of t holds the logits z_r (N, V'/t)
of columns [v_r, v_r + V'/t) of the padded vocabulary V' (Shoeybi et al. 2019, arXiv 1909.08053,
§3: "fuse the output of the parallel GEMM with the cross-entropy loss"). For a row with target y:

    loss = log Σ_j exp(z_j) − z_y = log Σ_j exp(z_j − m) − (z_y − m),    m = max_j z_j

and each term is a reduction over the group of numbers every rank computes on its own columns:

    m      all-reduce (max) of the local row maxima            N numbers
    Σ, z_y all-reduce (sum) of [local Σ exp(z − m), z_y − m]   2N numbers (z_y − m: 0 on the ranks
                                                                 that do not hold column y)

so 3N numbers cross the group instead of the N·V' logits. The gradient needs no communication:
∂loss/∂z_j = softmax_j − [j = y] on the rank holding column j, with softmax_j = exp(z_j − m)/Σ.

Padding. V' = V rounded up to a multiple of t (Megatron-LM pads the same way, to a multiple of
t times a constant); the padded columns are masked (−∞ before the max), so they take no
probability and get no gradient, and the loss equals the unpadded model's exactly.
Legend: N rows (B·T), V vocabulary, V' padded, t tensor-parallel ranks.
"""

from __future__ import annotations

from refimpl import backend
from refimpl.autograd.function import Function
from refimpl.autograd.tensor import Tensor


class VocabParallelCrossEntropy(Function):
    def forward(self, logits, targets, start, vocab_size, comm, ignore_index, reduction):
        xp = backend.xp()
        width = logits.shape[-1]  # V'/t
        z = logits.reshape(-1, width).copy()  # (N, V'/t)
        real = min(max(vocab_size - start, 0), width)  # columns of this shard inside the real vocabulary
        z[:, real:] = -xp.inf  # padded columns take no probability
        t = targets.reshape(-1)  # (N,)
        valid = t != ignore_index  # (N,)
        self.count = max(int(valid.sum()), 1) if reduction == "mean" else 1
        m = z.max(axis=1)  # (N,)
        comm.allreduce(m, "max")
        z -= m[:, None]
        e = xp.exp(z, out=z)  # (N, V'/t); exp(−∞) = 0 on the padding
        local = t - start
        mine = valid & (local >= 0) & (local < width)  # rows whose target column this rank holds
        rows = xp.arange(len(t))
        safe = xp.where(mine, local, 0)
        sums = xp.stack([e.sum(axis=1), xp.where(mine, logits.reshape(-1, width)[rows, safe] - m, 0.0)])  # (2, N)
        comm.allreduce(sums)
        total, target_shifted = sums  # (N,), (N,)
        e /= total[:, None]  # softmax over the whole vocabulary, this rank's columns
        self.save_for_backward(e)
        self.mine, self.safe, self.valid, self.shape = mine, safe, valid, logits.shape
        loss_per_row = xp.log(total) - target_shifted  # (N,)
        return xp.asarray((loss_per_row * valid).sum() / self.count, dtype=logits.dtype)

    def backward(self, g, needs):
        (probs,) = self.saved
        d = probs.copy()  # (N, V'/t)
        rows = backend.xp().arange(d.shape[0])
        d[rows[self.mine], self.safe[self.mine]] -= 1
        d *= (self.valid[:, None] * (g / self.count)).astype(d.dtype)
        return (d.reshape(self.shape),) + (None,) * 6


def vocab_parallel_cross_entropy(logits: Tensor, targets, start: int, vocab_size: int, comm,
                                 ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """Cross-entropy of logits (…, V'/t) holding columns [start, start + V'/t) of a vocabulary of
    vocab_size (the rest padding); the same value on every rank of comm, equal to
    F.cross_entropy of the gathered, unpadded logits."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    targets = targets.data if isinstance(targets, Tensor) else backend.xp().asarray(targets)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: targets of shape {targets.shape} do not match logits of shape "
                         f"{logits.shape} (expected {logits.shape[:-1]})")
    counted = targets[targets != ignore_index]
    if counted.size and (int(counted.min()) < 0 or int(counted.max()) >= vocab_size):
        raise ValueError(f"cross_entropy: target out of range [0, {vocab_size})")
    return VocabParallelCrossEntropy.apply(logits, targets, start, vocab_size, comm, ignore_index, reduction)


__all__ = ["vocab_parallel_cross_entropy", "VocabParallelCrossEntropy"]
