"""The conjugate communication operators of tensor and sequence parallelism, as autograd Functions.

Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053, §3) splits a layer over the t ranks of a
tensor-parallel group with two operators that are each other's transpose:

    f  copy_to_tensor_parallel       forward: identity          backward: all-reduce (sum)
    g  reduce_from_tensor_parallel   forward: all-reduce (sum)  backward: identity

f stands before a column-parallel linear: every rank needs the whole input, and the gradient of
that input is the sum of each rank's partial gradient. g stands after a row-parallel linear: each
rank holds a partial sum of the output. Sequence parallelism (Korthikanti et al. 2022, arXiv
2205.05198, §4.2.2) keeps the activations between those regions cut along the sequence, and the
operators become

    f̄  gather_sequence               forward: all-gather        backward: reduce-scatter
    ḡ  reduce_scatter_sequence       forward: reduce-scatter    backward: all-gather

which move the same bytes as the all-reduces they replace (a ring all-reduce is a reduce-scatter
then an all-gather). Activations are (B, T, C) with the sequence on axis 1 (refimpl's layout;
Megatron keeps (T, B, C) so that its gathers are along the contiguous first axis): gathering
along axis 1 receives the t blocks (t, B, T/t, C) and interleaves them. Legend: B batch, T
sequence, C width, t the group's size; rank r of the group holds rows r·T/t .. (r+1)·T/t − 1.

The column-parallel linear under sequence parallelism is one Function of its own
(`gather_then_linear`): it saves only this rank's sequence shard (B, T/t, C) and all-gathers it
again in backward to form the weight gradient, as Megatron-LM does. That second all-gather is what
makes the stored activation 1/t of the gathered input (tensor_parallel/communication.py's bytes and
memory.py's saved elements per block count it).
"""

from __future__ import annotations

from refimpl import backend
from refimpl.autograd.function import Function


def _all_reduced(comm, x):
    y = x.copy()  # a new array: the input may be saved by another operation
    comm.allreduce(y)
    return y


def gather_along_sequence(comm, x):
    """(B, T/t, …) on each rank -> (B, T, …): the t shards in rank order along axis 1."""
    t = comm.size
    blocks = backend.xp().empty((t,) + x.shape, dtype=x.dtype)  # (t, B, T/t, …)
    comm.allgather(backend.xp().ascontiguousarray(x), blocks)
    whole = backend.xp().moveaxis(blocks, 0, 1)  # (B, t, T/t, …)
    return backend.xp().ascontiguousarray(whole).reshape((x.shape[0], t * x.shape[1]) + x.shape[2:])


def reduce_scatter_along_sequence(comm, x):
    """(B, T, …) partial sums on each rank -> (B, T/t, …): this rank's rows of the sum."""
    t = comm.size
    if x.shape[1] % t:
        raise ValueError(f"sequence parallelism: a sequence of {x.shape[1]} tokens cannot be cut into {t} equal "
                         f"shards; use a sequence length divisible by --tp {t}")
    blocks = x.reshape((x.shape[0], t, x.shape[1] // t) + x.shape[2:])  # (B, t, T/t, …)
    send = backend.xp().ascontiguousarray(backend.xp().moveaxis(blocks, 1, 0))  # (t, B, T/t, …)
    return comm.reduce_scatter(send).reshape(send.shape[1:])  # (B, T/t, …)


class CopyToTensorParallel(Function):
    """f: the identity forward; backward sums the input's gradient over the group."""

    def forward(self, x, comm):
        self.comm = comm
        return x

    def backward(self, g, needs):
        return _all_reduced(self.comm, g), None


class ReduceFromTensorParallel(Function):
    """g: forward sums the partial outputs over the group; the identity backward."""

    def forward(self, x, comm):
        return _all_reduced(comm, x)

    def backward(self, g, needs):
        return g, None


class GatherSequence(Function):
    """f̄: all-gather the sequence shards forward; reduce-scatter the gradient backward."""

    def forward(self, x, comm):
        self.comm = comm
        return gather_along_sequence(comm, x)

    def backward(self, g, needs):
        return reduce_scatter_along_sequence(self.comm, g), None


class ReduceScatterSequence(Function):
    """ḡ: reduce-scatter the partial sums forward (to sequence shards); all-gather the gradient backward."""

    def forward(self, x, comm):
        self.comm = comm
        return reduce_scatter_along_sequence(comm, x)

    def backward(self, g, needs):
        return gather_along_sequence(self.comm, g), None


class GatherThenLinear(Function):
    """y = gather(x) wᵀ + b, keeping only the shard x (B, T/t, C) for backward (Megatron's choice).

    Backward: dx = reduce_scatter(g w)  (B, T/t, C); dw = gᵀ gather(x) -- the shard is gathered a
    second time, in whichever pass asks for the weight gradient (B, or W of a split backward).
    """

    def forward(self, x, w, b, comm):
        self.comm = comm
        self.save_for_backward(x, w)
        y = gather_along_sequence(comm, x) @ w.T  # (B, T, C) @ (C, out/t) -> (B, T, out/t)
        if b is not None:
            y += b
        return y

    def backward(self, g, needs):
        x, w = self.saved
        dx = reduce_scatter_along_sequence(self.comm, g @ w) if needs[0] else None  # (B, T/t, C)
        dw = None
        if needs[1]:
            whole = gather_along_sequence(self.comm, x)  # (B, T, C), gathered again
            dw = g.reshape(-1, g.shape[-1]).T @ whole.reshape(-1, whole.shape[-1])  # (out/t, C)
        db = g.reshape(-1, g.shape[-1]).sum(axis=0) if needs[2] else None  # (out/t,)
        return dx, dw, db, None


def copy_to_tensor_parallel(x, comm):
    return CopyToTensorParallel.apply(x, comm)


def reduce_from_tensor_parallel(x, comm):
    return ReduceFromTensorParallel.apply(x, comm)


def gather_sequence(x, comm):
    return GatherSequence.apply(x, comm)


def reduce_scatter_sequence(x, comm):
    return ReduceScatterSequence.apply(x, comm)


def gather_then_linear(x, w, b, comm):
    return GatherThenLinear.apply(x, w, b, comm)


__all__ = ["copy_to_tensor_parallel", "reduce_from_tensor_parallel", "gather_sequence", "reduce_scatter_sequence",
           "gather_then_linear", "gather_along_sequence", "reduce_scatter_along_sequence"]
