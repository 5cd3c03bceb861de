"""A mixture-of-experts feed-forward layer: a router, E expert MLPs, a load-balancing loss.

The experts are GPT-2's MLP (expert="gelu": [C, H, C] with biases and GeLU) or Llama's SwiGLU
(expert="swiglu": W₂(silu(W₁x) ⊙ W₃x), widths C -> H -> C, no biases), as Mixtral's experts are
(Jiang et al., arXiv 2401.04088, §2.1); the router, the gates and the dispatch are the same.

For each token x (C,) of a (B, T, C) input, with E experts and K of them chosen per token:

    p       = softmax(x W_rᵀ)                      (E,)   router probabilities, W_r (E, C)
    chosen  = the K largest p_e, ties to the lower expert index
    gate_e  = p_e / Σ_(chosen) p                   (K,)   renormalised over the chosen experts
    y       = Σ_(e chosen) gate_e · MLP_e(x)       (C,)

This is the top-K recipe of GShard (Lepikhin et al., arXiv 2006.16668) with the gates
renormalised as in Mixtral (Jiang et al., arXiv 2401.04088: a softmax over the chosen logits,
which is the same number). With K = 1 the gate is 1: the router then learns only from the
load-balancing loss (Switch Transformer, which does not renormalise, keeps gate = p).

Load balancing (Switch Transformer, Fedus et al., arXiv 2101.03961, eq. 4), applied per sequence
as DeepSeek-V3's sequence-wise balance loss does (arXiv 2412.19437, §2.1.2):

    L_aux = α · (1/B) Σ_sequences E · Σ_e f_e · P_e
            f_e = (tokens of the sequence that chose e) / (K·T)     routed, before any drop
            P_e = mean over the sequence's tokens of p_e

Why per sequence: a sequence's statistics do not depend on how the global batch is cut into
ranks and micro-batches, so every distributed run computes the same loss as one process with no
communication (a per-batch loss would need the counts and probability sums of the whole global
batch, 2E numbers reduced over the data-parallel group, before any backward could start -- which a
pipeline cannot wait for). B is the global batch (the batch_rows context's size). The loss
reaches the gradients without touching the training loss: `AddAuxiliaryLoss` passes y through
unchanged and, in backward, seeds L_aux's own backward with 1 (with mixed precision, the loss scale
S that the batch_rows context carries, as the training loss's backward starts from loss · S), so
pipelines and gradient accumulation need no change. The reported training loss is the cross-entropy alone.

Capacity (optional, --capacity-factor c): each expert takes at most ⌈c·K·T/E⌉ tokens of each
sequence; the (token, expert) assignments beyond that, in token order, are dropped (the token
keeps its other experts' outputs, gates not renormalised again). Per sequence again, so a
distributed run drops exactly what one process drops. Dropless (no capacity) by default.

Dispatch, as the code does it: the N·K (token, choice) assignments are sorted by expert (a stable
sort: token order within an expert), the tokens gathered in that order, cut into E groups of
count_e rows, each group through its expert, and the outputs put back in (token, choice) order by
the inverse permutation, weighted by the gates and summed over the K choices. Expert parallelism
(refimpl/parallel/experts.py) sends the groups of other ranks' experts by all-to-all between the
gather and the experts, and back before the inverse permutation.

Legend: B batch, T sequence, C width, E experts, K chosen per token, N = B·T tokens, H expert
hidden width (GeLU experts: 4C unless given; SwiGLU experts: --ffn-size).
"""

from __future__ import annotations

import math

import numpy as np

from refimpl import backend
from refimpl.autograd import ops
from refimpl.autograd.function import Function
from refimpl.autograd.tensor import Tensor

from . import batch_rows
from . import functional as F
from .layers import MLP, Linear, SwiGLU
from .module import Module, ModuleList


class AddAuxiliaryLoss(Function):
    """y unchanged forward; backward: y's gradient, and the auxiliary loss's own backward seed: 1,
    or mixed precision's loss scale S (the training loss's backward starts from loss · S)."""

    def forward(self, y, aux, seed):
        self.seed = seed
        return y

    def backward(self, g, needs):
        return g, backend.xp().full((), self.seed, g.dtype) if needs[1] else None, None


def route(probs, top_k: int):
    """(indices (N, K), sorted order of the N·K assignments by expert, counts (E,)) from router
    probabilities (N, E), on the host: top-K with ties to the lower index, stable sort by expert."""
    p = backend.to_host(probs)
    chosen = np.argsort(-p, axis=1, kind="stable")[:, :top_k]  # (N, K): equal p keep index order
    flat = chosen.reshape(-1)  # (N·K,) assignment a = token·K + choice
    order = np.argsort(flat, kind="stable")  # assignments grouped by expert, token order inside
    counts = np.bincount(flat, minlength=p.shape[1])  # (E,)
    return chosen, order, counts


def keep_within_capacity(chosen, T: int, n_experts: int, capacity: int):
    """(N, K) bool: which assignments fit, at most `capacity` per expert and sequence, in token order."""
    N, K = chosen.shape
    by_sequence = chosen.reshape(N // T, T * K)  # (B, T·K), token-major within each sequence
    onehot = by_sequence[..., None] == np.arange(n_experts)  # (B, T·K, E)
    rank_in_expert = np.cumsum(onehot, axis=1) - 1  # position of each assignment in its expert's queue
    return (np.take_along_axis(rank_in_expert, by_sequence[..., None], 2)[..., 0] < capacity).reshape(N, K)


EXPERT_KINDS = ("gelu", "swiglu")  # GPT-2's MLP, Llama's SwiGLU (Mixtral's experts)


class MoE(Module):
    """E expert MLPs [C, H, C] (GeLU, or SwiGLU) behind a top-K router; see the module docstring."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, rng: np.random.Generator, hidden: int | None = None,
                 capacity_factor: float | None = None, aux_coef: float = 0.01, last_std: float | None = None,
                 dtype="float64", expert: str = "gelu") -> None:
        super().__init__()
        if n_experts < 1 or not 1 <= top_k <= n_experts:
            raise ValueError(f"a mixture of experts needs 1 <= top-k <= experts, got --top-k {top_k} of "
                             f"--experts {n_experts}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"--capacity-factor must be positive, got {capacity_factor}")
        if expert not in EXPERT_KINDS:
            raise ValueError(f"unknown expert MLP {expert!r}; choose one of {', '.join(EXPERT_KINDS)}")
        self.n_experts, self.top_k, self.capacity_factor, self.aux_coef = n_experts, top_k, capacity_factor, aux_coef
        hidden = 4 * d_model if hidden is None else hidden
        self.router = Linear(d_model, n_experts, rng, bias=False, std=0.02, dtype=dtype)
        self.experts = ModuleList(_expert(expert, d_model, hidden, rng, last_std, dtype) for _ in range(n_experts))
        # How the expert groups run: None, here; or a callable (moe, x_sorted, counts) -> y_sorted,
        # which expert parallelism installs (refimpl/parallel/experts.py).
        self.experts_runner = None
        self.stats: dict = {}  # (batch id, first row) -> (counts (E,), dropped, L_aux): one entry per micro-batch

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        E, K = self.n_experts, self.top_k
        tokens = x.reshape(B * T, C)  # (N, C)
        probs = F.softmax(self.router(tokens), axis=-1)  # (N, E)
        chosen, order, counts = route(probs.data, K)
        keep = np.ones(chosen.shape, bool)
        if self.capacity_factor is not None:
            keep = keep_within_capacity(chosen, T, E, math.ceil(self.capacity_factor * K * T / E))
        rows = np.arange(B * T)
        gates = probs[backend.asarray(rows[:, None]), backend.asarray(chosen)]  # (N, K)
        gates = gates / gates.sum(axis=-1, keepdims=True)
        kept = order[keep.reshape(-1)[order]]  # assignments that fit, grouped by expert
        kept_counts = np.bincount(chosen.reshape(-1)[kept], minlength=E)  # (E,)
        x_sorted = tokens[backend.asarray(kept // K)]  # (n, C): the tokens of expert 0, then of expert 1, ...
        if self.experts_runner is None:
            y_sorted = self.run_experts(x_sorted, kept_counts)
        else:
            y_sorted = self.experts_runner(self, x_sorted, kept_counts)  # (n, C)
        slot = np.full(B * T * K, len(kept), dtype=np.int64)  # assignment -> its row of y_sorted; dropped: a zero row
        slot[kept] = np.arange(len(kept))
        zero = Tensor(backend.xp().zeros((1, C), dtype=y_sorted.dtype))
        y_all = ops.concatenate([y_sorted, zero], axis=0)[backend.asarray(slot)].reshape(B * T, K, C)
        y = (y_all * gates.reshape(B * T, K, 1)).sum(axis=1)  # (N, C)
        aux = self.balance_loss(probs, chosen, B, T)
        if self.training:  # (evaluation is not training's load)
            self._record(counts, int(chosen.size - len(kept)), aux)
        rows = batch_rows.current()  # (a recomputation restores the forward's rows, and so its loss scale)
        return AddAuxiliaryLoss.apply(y.reshape(B, T, C), aux, 1.0 if rows is None else rows.loss_scale)

    def run_experts(self, x_sorted: Tensor, counts, first: int = 0) -> Tensor:
        """Expert first + i on rows counts[0] + ... + counts[i-1] onwards of x_sorted (n, C) -> (n, C)
        (expert parallelism runs its E/P experts, from `first`, on the rows that arrived).

        Every expert runs, an expert that got no token on zero rows: its parameters then get a
        (zero) gradient in every backward, on every rank. Data parallelism's buckets and ZeRO's flat
        groups start a reduction when all their gradients have arrived; an expert used on one rank
        and not on another would make the ranks start their reductions in different orders."""
        outputs, start = [], 0
        for i, n in enumerate(counts):
            outputs.append(self.experts[first + i](x_sorted[start:start + int(n)]))  # (count_e, C)
            start += int(n)
        return ops.concatenate(outputs, axis=0)

    def balance_loss(self, probs: Tensor, chosen, B: int, T: int) -> Tensor:
        """α · (1/B_global) Σ_sequences E Σ_e f_e P_e (the module docstring), a scalar Tensor."""
        E, K = self.n_experts, self.top_k
        rows = batch_rows.current()
        global_batch = B if rows is None else rows.global_size
        per_sequence = np.zeros((B, E))
        np.add.at(per_sequence, (np.repeat(np.arange(B), T * K), chosen.reshape(-1)), 1.0)
        f = backend.asarray(per_sequence / (K * T), dtype=probs.dtype)  # (B, E), no gradient
        P = probs.reshape(B, T, E).mean(axis=1)  # (B, E)
        return (P * f).sum() * (self.aux_coef * E / global_batch)

    def _record(self, counts, dropped: int, aux: Tensor) -> None:
        rows = batch_rows.current()
        key = (rows.batch_id, rows.start) if rows is not None else (None, len(self.stats))
        self.stats[key] = (counts, dropped, float(aux.item()))  # a recomputation overwrites its own entry

    def take_stats(self) -> dict:
        """{"counts": (E,) assignments per expert, "dropped", "aux_loss"} since the last call, then reset."""
        values = list(self.stats.values())
        self.stats = {}
        return {"counts": sum((c for c, _, _ in values), np.zeros(self.n_experts, np.int64)),
                "dropped": sum(d for _, d, _ in values), "aux_loss": sum(a for _, _, a in values)}


def _expert(kind: str, d_model: int, hidden: int, rng: np.random.Generator, last_std: float | None, dtype):
    """One expert, its weights drawn from rng: GPT-2's MLP [C, H, C] (fc weight, bias, then proj's),
    or SwiGLU (w1, w3, w2), the down projection initialised with last_std (else 0.02)."""
    if kind == "swiglu":
        return SwiGLU(d_model, hidden, rng, std=0.02, last_std=0.02 if last_std is None else last_std, dtype=dtype)
    return MLP([d_model, hidden, d_model], rng, "gelu", std=0.02, last_std=last_std, dtype=dtype)


def take_load(model) -> dict:
    """{MoE module name: take_stats()} of every mixture-of-experts layer in `model` (resets them)."""
    return {name: module.take_stats() for name, module in model.named_modules() if isinstance(module, MoE)}


def add_load(total: dict, more: dict) -> dict:
    """{name: stats} summed layer by layer (steps of one rank, or the ranks' totals)."""
    out = dict(total)
    for name, s in more.items():
        t = out.get(name)
        out[name] = s if t is None else {"counts": t["counts"] + s["counts"], "dropped": t["dropped"] + s["dropped"],
                                         "aux_loss": t["aux_loss"] + s["aux_loss"]}
    return out


def describe_load(total: dict, steps: int) -> dict:
    """What train --json reports per MoE layer: tokens per expert over the run (assignments, before
    drops), their fractions, the assignments dropped, and the balance loss per step."""
    return {name: {"tokens_per_expert": [int(c) for c in s["counts"]],
                   "load": [float(c) / max(1, int(s["counts"].sum())) for c in s["counts"]],
                   "dropped": int(s["dropped"]), "aux_loss_per_step": s["aux_loss"] / max(1, steps)}
            for name, s in sorted(total.items())}


__all__ = ["MoE", "EXPERT_KINDS", "AddAuxiliaryLoss", "route", "keep_within_capacity", "take_load", "add_load",
           "describe_load"]
