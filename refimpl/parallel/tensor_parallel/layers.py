"""Tensor-parallel layers: column- and row-parallel linears, and the vocabulary-parallel embedding.

Shoeybi et al. 2019 (arXiv 1909.08053, §3), on a group of t ranks (rank r):

    ColumnParallelLinear   w (out, in) cut by rows (output features): rank r holds w_r (out/t, in)
                           and b_r; y_r = f(x) w_rᵀ + b_r is its slice of the output. With
                           sequence parallelism f is an all-gather of the sequence shards.
    RowParallelLinear      w (out, in) cut by columns (input features): rank r holds w_r (out, in/t)
                           and the whole bias; y = g(x_r w_rᵀ) + b. With sequence parallelism g is
                           a reduce-scatter, so y is this rank's sequence shard.
    VocabParallelEmbedding rows v_r .. v_r + V'/t of the (padded) vocabulary: a token outside the
                           range gives a zero row, and g sums the ranks' rows (a reduce-scatter
                           with sequence parallelism).

A column-parallel linear followed by a row-parallel one (the MLP; attention's qkv and output
projection) needs no communication between them: the activation in the middle stays split.

Which parameters are whole on every rank (layer norms, the row-parallel bias, the position
embedding) and how the split ones are cut is recorded by tensor_parallel/gpt.py (`WeightSplit`).
Legend: B batch, T sequence (T/t a sequence shard), C width, V' padded vocabulary.
"""

from __future__ import annotations

from refimpl import backend
from refimpl.autograd.function import Function
from refimpl.autograd.tensor import Parameter, Tensor
from refimpl.nn import functional as F
from refimpl.nn.module import Module

from .operators import (
    copy_to_tensor_parallel,
    gather_sequence,
    gather_then_linear,
    reduce_from_tensor_parallel,
    reduce_scatter_sequence,
)


class ColumnParallelLinear(Module):
    """y_r = f(x) w_rᵀ + b_r: this rank's slice of the output features."""

    def __init__(self, weight: Parameter, bias: Parameter | None, comm, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias  # (out/t, in), (out/t,)
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def forward(self, x):
        return column_parallel_linear(x, self.weight, self.bias, self.comm, self.sequence_parallel)


def column_parallel_linear(x, weight, bias, comm, sequence_parallel: bool):
    """f then linear: x (B, T, C) whole, or (B, T/t, C) with sequence parallelism -> (B, T, out/t)."""
    if sequence_parallel:
        return gather_then_linear(x, weight, bias, comm)
    return F.linear(copy_to_tensor_parallel(x, comm), weight, bias)


def shared_input_column_parallel(comm, sequence_parallel: bool):
    """A runner (linears, x) -> [y_1, …]: several column-parallel linears that read the same x
    (Llama's wq, wk, wv; SwiGLU's w1 and w3) behind one f -- the gradients of x sum before its one
    all-reduce -- or, with sequence parallelism, one f̄: the whole (B, T, C) is gathered once and
    kept for the weight gradients (no second all-gather in backward, unlike GatherThenLinear). The
    linears are called as modules, so module hooks (ZeRO-3's gathers) see them."""
    def run(linears, x):
        x = gather_sequence(x, comm) if sequence_parallel else copy_to_tensor_parallel(x, comm)  # (B, T, C)
        return [linear(x) for linear in linears]  # (B, T, out_i/t) each
    return run


class RowParallelLinear(Module):
    """y = g(x_r w_rᵀ) + b: x_r (B, T, in/t) -> y (B, T, out), or (B, T/t, out) with sequence parallelism."""

    def __init__(self, weight: Parameter, bias: Parameter | None, comm, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias  # (out, in/t), (out,) whole
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def forward(self, x):
        partial = F.linear(x, self.weight)  # (B, T, out): this rank's part of the sum over inputs
        y = reduce_scatter_sequence(partial, self.comm) if self.sequence_parallel else \
            reduce_from_tensor_parallel(partial, self.comm)
        return y if self.bias is None else y + self.bias  # the bias once, after the sum


class VocabParallelEmbedding(Module):
    """Rows [start, start + V'/t) of the embedding table; summed over the group (g, or ḡ with sequence parallelism)."""

    def __init__(self, weight: Parameter, start: int, comm, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = weight  # (V'/t, C)
        self.start, self.comm, self.sequence_parallel = start, comm, sequence_parallel

    def forward(self, idx):
        idx = idx.data if isinstance(idx, Tensor) else backend.asarray(idx)
        partial = EmbeddingRows.apply(self.weight, idx, self.start)  # (B, T, C): zero rows outside the range
        return reduce_scatter_sequence(partial, self.comm) if self.sequence_parallel else \
            reduce_from_tensor_parallel(partial, self.comm)

    def attend(self, x):
        """The tied output layer: x (B, T, C) -> logits of this rank's vocabulary rows (B, T, V'/t)."""
        return column_parallel_linear(x, self.weight, None, self.comm, self.sequence_parallel)


class EmbeddingRows(Function):
    """w[idx − start] where start <= idx < start + rows, else a zero row; backward adds into those rows only."""

    def forward(self, w, idx, start):
        local = idx - start
        self.inside = (local >= 0) & (local < w.shape[0])  # (B, T)
        self.local, self.w_shape = backend.xp().where(self.inside, local, 0), w.shape
        y = w[self.local]  # (B, T, C)
        y *= self.inside[..., None]
        return y

    def backward(self, g, needs):
        dw = backend.xp().zeros(self.w_shape, g.dtype)
        rows = self.inside.reshape(-1)
        backend.scatter_add(dw, self.local.reshape(-1)[rows], g.reshape(-1, g.shape[-1])[rows])
        return dw, None, None


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "column_parallel_linear",
           "shared_input_column_parallel"]
