"""Reference solutions to tutorial 10's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them), and a
model answer to its question (at the end)."""

import numpy as np

from refimpl.autograd import Function


def conjugate_operators():
    class CopyToGroup(Function):  # f
        def forward(self, x, comm):
            self.comm = comm  # backward needs the group
            return x  # every rank already holds the whole x

        def backward(self, grad, needs):
            total = grad.copy()  # the engine's array is not ours to change
            self.comm.allreduce(total)  # dL/dx = sum of the ranks' parts
            return total, None  # one gradient per positional input: x, comm

    class ReduceFromGroup(Function):  # g
        def forward(self, x, comm):
            total = x.copy()  # x is the input Tensor's own array
            comm.allreduce(total)  # the whole output: the sum of the partial outputs
            return total

        def backward(self, grad, needs):
            return grad, None  # dL/dy is already whole, and the same, on every rank

    return CopyToGroup, ReduceFromGroup


def swiglu_slices(gate_up_weight, down_weight, r, t):
    hidden = gate_up_weight.shape[0] // 2  # H: the gate's rows, then up's
    mine = np.arange(r * hidden // t, (r + 1) * hidden // t)  # rank r's hidden features: block r of H/t
    rows = np.concatenate([mine, hidden + mine])  # the same features of the gate and of up: SiLU(gate_j) · up_j
    return gate_up_weight[rows], down_weight[:, mine]  # down: row-parallel, its input features (columns)


def qkv_slices(qkv_weight, qkv_bias, n_head, r, t):
    c = qkv_weight.shape[0] // 3  # rows of each of q, k and v
    per_rank = c // t  # (n_head / t) heads of c / n_head rows
    rows = np.concatenate([np.arange(part * c + r * per_rank, part * c + (r + 1) * per_rank) for part in range(3)])
    return qkv_weight[rows], qkv_bias[rows]


def tp_allreduce_bytes(n_layer, tokens, width, t, itemsize, first, last):
    # Forward: g after each block's attention proj and MLP proj (row-parallel), and after the
    # vocabulary-parallel embedding lookup. Backward: f before each block's qkv and fc
    # (column-parallel), and before the head. The loss: row max, Σexp and target logit, N each.
    per_direction = 2 * n_layer * tokens * width
    elements = 2 * per_direction + (int(first) + int(last)) * tokens * width + (3 * tokens if last else 0)
    return 2 * elements * (t - 1) // t * itemsize  # the ring: 2E(t − 1)/t elements per rank


ANSWER = """
Model answer to the question (measure and explain).

(a) A parameter's gradient is a sum over the tokens that used it. Without sequence parallelism ln_f runs on the whole
(B, T, C) activation on every rank: each rank sums over all N tokens and holds one process's gradient (differences at
rounding level, below 10⁻¹⁷, before and after backward). With it, rank r's ln_f sees only tokens r·T/t ...
(r+1)·T/t − 1 of each sequence: its part is off (7.8e-3, 7.0e-3) and only the group's sum, which shard_gpt's hook
all-reduces, covers every token (again at rounding level). (b) The ranks' tokens are disjoint and make up the batch,
so the parts add up; an average would be t times too small. Without sequence parallelism an all-reduce (sum) would
multiply the already whole gradient by t. verify (rtol 1e-10 against one process) reports both at once.
(c) Nothing re-synchronises the copies: they stay equal because every rank starts from the same seed and
applies the same deterministic update to bit-identical gradients (an all-reduce hands every rank the same
bits; without it every rank computes them from the same inputs in the same order). They would drift with
anything rank-dependent: a reduction whose summation order differs between ranks, non-deterministic GPU
kernels, per-rank dropout masks in the replicated regions, a rank-local gradient clip; slowly, so verify
over a few steps might not see it. (d) Keeping the gathered input of each column-parallel layer would cost
N·C(t − 1)/t elements more per layer, two per block (qkv, fc): 2 · 16 · 16 / 2 = 256 float64 = 2,048 bytes
per block and micro-batch here, for 5,120 bytes more sent per micro-batch. The saving counts for every block
and every micro-batch in flight, and the all-gather can overlap the input-gradient GEMM of backward. In
Korthikanti's counts the gathered inputs are 4sbh of the 34sbh of a layer: 30sbh/t + 4sbh instead of 34sbh/t
is nearly twice as much at t = 8, for one all-gather more per column-parallel layer (+25% of tp traffic).
"""
