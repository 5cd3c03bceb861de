"""Reference solutions to tutorial 10's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""

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


def mlp_slices(fc_weight, fc_bias, proj_weight, proj_bias, r, t):
    hidden = fc_weight.shape[0] // t  # 4C/t hidden features per rank
    mine = slice(r * hidden, (r + 1) * hidden)
    return fc_weight[mine].copy(), fc_bias[mine].copy(), proj_weight[:, mine].copy(), proj_bias.copy()


def qkv_slices(qkv_weight, qkv_bias, n_head, r, t):
    c = qkv_weight.shape[0] // 3  # rows of each of q, k and v
    per_rank = c // t  # (n_head / t) heads of c / n_head rows
    rows = np.concatenate([np.arange(part * c + r * per_rank, part * c + (r + 1) * per_rank) for part in range(3)])
    return qkv_weight[rows], qkv_bias[rows]
