"""Expert parallelism: each rank of an expert-parallel group holds E/P of the experts, and tokens
travel to their experts and back by all-to-all (GShard, Lepikhin et al., arXiv 2006.16668, §3;
DeepSpeed-MoE, Rajbhandari et al., arXiv 2201.05596; Megatron-LM).

The expert-parallel group is P ranks of the data-parallel group (mesh.py: ep_comm, neighbouring
data-parallel ranks), each with its own micro-batches. Rank j of it holds experts
[j·E/P, (j+1)·E/P). The layer (nn/experts.py) routes its tokens, sorts the (token, expert)
assignments by expert and gathers the tokens in that order, so the rows bound for rank j are one
contiguous block. Then, in `ExpertParallel.__call__`:

    1. counts    each rank tells each other how many rows it sends to each of their experts:
                 an all-to-all of E integers per rank (E/P to each rank)
    2. dispatch  all-to-all(v) of the rows: rank j receives, from every source s, the rows of s for
                 j's experts, grouped by expert                              (n_recv, C)
    3. experts   rows reordered to (expert, source) order, each local expert on its rows, and the
                 outputs put back in (source, expert) order
    4. combine   all-to-all(v) back: every row returns to the rank and position it came from

and the layer weights and sums the K outputs of each token as without parallelism. The two
all-to-alls are autograd Functions: the backward of a dispatch is a combine of the gradients and
vice versa, so backward sends the same rows again.

Bytes. A (token, chosen expert) assignment whose expert lives on another rank travels once in the
dispatch and once in the combine, forward and backward: 4·C elements; a token's K choices travel
separately (K times if its K experts live on other ranks, even on the same one: no deduplication,
as GShard's dispatch; DeepSeek-V3 sends a token at most once per node). Plus the counts: E
integers per rank and all-to-all, minus its own E/P. Assignments to the rank's own experts do not
leave it. With r_j the rows this rank sends to rank j ≠ self in one MoE layer forward:

    elements sent per layer and micro-batch = 2·C·Σ_j r_j (forward) + 2·C·Σ_j r_j (backward)

(dispatch + combine; the combine sends back what arrived: Σ_j r'_j, which over the group equals
Σ_j r_j; per rank they differ, and the tests count each from the routing histogram).

Gradients. Expert e's parameters exist on the ranks of the expert-data-parallel group (edp_comm:
the data-parallel ranks with the same position in their expert-parallel group), and their
gradients are summed there; every other parameter over the whole data-parallel group.
"""

from __future__ import annotations

import numpy as np

from refimpl import backend
from refimpl.autograd import grad_mode
from refimpl.autograd.function import Function
from refimpl.nn.experts import MoE
from refimpl.nn.module import Module


class AllToAll(Function):
    """Rows (n, C) in blocks of send_counts[j] rows for rank j -> rows from every rank, recv_counts[s] from s."""

    def forward(self, x, runner, send_counts, recv_counts):
        self.runner, self.send_counts, self.recv_counts = runner, send_counts, recv_counts
        return exchange(runner, x, send_counts, recv_counts)

    def backward(self, g, needs):
        return exchange(self.runner, g, self.recv_counts, self.send_counts), None, None, None


def exchange(runner, rows, send_counts, recv_counts):
    """all-to-all(v) of contiguous row blocks over runner.comm: (Σ send_counts, C) -> (Σ recv_counts, C).

    Non-blocking: `runner.all_to_all(start)` starts it and waits for it. Inside a pipeline that is
    the executor's (executor.py): a switch point of an overlapped F&B step (pipeline/overlap.py: the
    other micro-batch's task computes while these rows travel), which a tool's observer may time."""
    width = rows.shape[1]
    out = backend.xp().empty((int(sum(recv_counts)), width), dtype=rows.dtype)
    runner.all_to_all(lambda: runner.comm.ialltoallv(backend.xp().ascontiguousarray(rows),
                                                     [int(n) * width for n in send_counts], out,
                                                     [int(n) * width for n in recv_counts]))
    return out


def start_and_wait(start):
    """The all-to-all hook of a layer outside a pipeline executor: start the collective, wait for it."""
    return start().wait()


class LocalExperts(Module):
    """The experts this rank holds, registered under their single-process indices ("2", "3", ...)."""

    def __init__(self, experts: dict) -> None:
        super().__init__()
        for e, expert in experts.items():
            setattr(self, str(e), expert)

    def __getitem__(self, e: int):
        return getattr(self, str(e))


class ExpertParallel:
    """The runner of one MoE layer's experts over an expert-parallel group (MoE.experts_runner).

    all_to_all(start) is how its all-to-alls run: start() starts one and returns the request, the
    hook waits for it. Alone it starts and waits (start_and_wait); the trainer hands it its pipeline
    executor's (executor.py: the switch points of overlapped F&B steps), tutorial 11 an Interleaver's."""

    exchanges = 2  # all-to-alls of rows per forward (dispatch, combine); a backward sends both back

    def __init__(self, moe, comm) -> None:
        E, P = moe.n_experts, comm.size
        self.comm, self.per_rank = comm, E // P
        self.first = comm.rank * self.per_rank  # this rank's experts: first .. first + E/P − 1
        moe.experts = LocalExperts({e: moe.experts[e] for e in range(self.first, self.first + self.per_rank)})
        self.all_to_all = start_and_wait
        # this step's calls (the trainer clears it): (rows to each rank, rows from each rank, backward follows)
        self.traffic: list = []

    def __call__(self, moe, x_sorted, counts) -> object:
        P, k = self.comm.size, self.per_rank
        counts = np.asarray(counts, dtype=np.int64)  # (E,) rows per expert, this rank's assignments
        received = backend.xp().empty(len(counts), dtype=np.int64)  # rows from source s for its expert i: s·E/P + i
        self.comm.alltoall(backend.asarray(counts), received)  # 1. counts
        received = backend.to_host(received).reshape(P, k)  # (source, local expert)
        send = counts.reshape(P, k).sum(axis=1)  # rows to each rank
        recv = received.sum(axis=1)  # rows from each rank
        self.traffic.append((send, recv, grad_mode.is_enabled()))
        arrived = AllToAll.apply(x_sorted, self, send, recv)  # 2. dispatch (n_recv, C), (source, expert)
        order = _source_major_to_expert_major(received)
        y = moe.run_experts(arrived[backend.asarray(order)], received.sum(axis=0), self.first)  # 3. experts
        back = y[backend.asarray(np.argsort(order, kind="stable"))]  # (source, expert) order again
        return AllToAll.apply(back, self, recv, send)  # 4. combine: (n, C), this rank's order


def _source_major_to_expert_major(received) -> np.ndarray:
    """Row order that turns blocks (source s, expert i) of received[s, i] rows into (expert i, source s)."""
    starts = np.concatenate([[0], np.cumsum(received.reshape(-1))[:-1]]).reshape(received.shape)  # (P, k)
    return np.concatenate([np.arange(starts[s, i], starts[s, i] + received[s, i])
                           for i in range(received.shape[1]) for s in range(received.shape[0])]).astype(np.int64)


def stage_exchanges(stage) -> int:
    """All-to-alls in one forward of a pipeline stage (a backward has as many): those of its
    expert-parallel MoE layers (ExpertParallel.exchanges each: dispatch and combine)."""
    layers = getattr(stage, "layers", None)
    roots = list(layers) if layers is not None else [getattr(stage, "model", None)]
    return sum(getattr(getattr(module, "experts_runner", None), "exchanges", 0)
               for root in roots if hasattr(root, "modules") for module in root.modules())


def is_expert_parameter(name: str) -> bool:
    """Whether a parameter belongs to an expert (its gradient sums over the expert-data-parallel group)."""
    return ".mlp.experts." in name


class ParameterSubset:
    """A pipeline stage seen through a filter on its parameter names: what one gradient strategy holds."""

    def __init__(self, stage, keep) -> None:
        self.stage = stage
        self._named = [(name, p) for name, p in stage.named_parameters() if keep(name)]

    def named_parameters(self) -> list:
        return list(self._named)

    def parameters(self) -> list:
        return [p for _, p in self._named]

    def __getattr__(self, name):  # index, is_first, ... of the stage itself
        return getattr(self.stage, name)


def apply_expert_parallelism(model, comm) -> list:
    """Install an ExpertParallel runner in every MoE layer of `model` (each rank keeps E/P experts)."""
    runners = []
    for module in model.modules():
        if isinstance(module, MoE):
            if module.n_experts % comm.size:
                raise ValueError(f"--ep {comm.size} does not divide --experts {module.n_experts}: each rank of the "
                                 "expert-parallel group holds E/ep experts")
            module.experts_runner = ExpertParallel(module, comm)
            runners.append(module.experts_runner)
    return runners


__all__ = ["ExpertParallel", "AllToAll", "LocalExperts", "apply_expert_parallelism", "exchange", "is_expert_parameter",
           "ParameterSubset", "stage_exchanges", "start_and_wait"]
