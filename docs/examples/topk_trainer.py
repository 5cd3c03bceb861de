"""Top-k gradient sparsification, with and without error feedback. Not meant to equal single-process
training: `python -m refimpl distance` measures how far each is.

Launch: mpiexec -n 2 python -m refimpl distance --trainer docs/examples/topk_trainer.py:make_trainer \
            --trainer docs/examples/topk_trainer.py:make_error_feedback_trainer \
            --optimizer sgd --lr 0.1 --clip 0 --steps 100 --plot topk.png

Each rank sends only the k largest-magnitude entries of its gradient (Aji & Heafield, "Sparse
Communication for Distributed Gradient Descent", EMNLP 2017), k = ⌈ratio · Ψ⌉ of the Ψ entries of the
whole model, flattened. Rank r's gradient g_r is normalised by the global batch's targets
(objective.py), so Σ_r g_r is the global batch's gradient g. Without error feedback

    ĝ = Σ_r top_k(g_r)

and what top_k drops is lost for good. With error feedback (Seide et al., "1-Bit Stochastic Gradient
Descent", Interspeech 2014; Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018;
Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019) each rank keeps what it dropped and
adds it to its next gradient:

    a_r = e_r + g_r,     c_r = top_k(a_r),     e_r ← a_r − c_r,     ĝ = Σ_r c_r

Summed over steps, the gradients the optimizer received then differ from the true ones by exactly
what the memories hold now: Σ_{s≤t} ĝ_s = Σ_{s≤t} g_s − Σ_r e_r. Top-k keeps at least the fraction
k/Ψ of a vector's squared norm, so ‖e_r‖ ≤ q ‖e_r + g_r‖ with q = √(1 − k/Ψ) < 1 and the memory stays
below q/(1 − q) · max_s ‖g_{r,s}‖: the accumulated error is bounded. Without the memory the dropped
parts add up, and the accumulated error grows with the number of steps.

The ranks exchange (index, value) pairs with two all-gathers of k entries each (2kW numbers, against
Ψ for a dense all-reduce). It has the interface of every trainer in refimpl (protocols.Verifiable);
last_grads on rank 0 is ĝ, the sparse sum every rank hands its optimizer.
"""

from __future__ import annotations

import math

import numpy as np

from refimpl.objective import count_targets, micro_batch_loss, split_batch
from refimpl.optim import clip_grad_norm_
from refimpl.tools.run import build_optimizer


def top_k(vector: np.ndarray, k: int) -> np.ndarray:
    """The indices (k,) of the k largest |entries| of vector (Ψ,), in increasing order."""
    if k >= vector.size:
        return np.arange(vector.size)
    return np.sort(np.argpartition(np.abs(vector), vector.size - k)[vector.size - k:])


class TopKTrainer:
    """Data parallelism that exchanges each rank's k largest gradient entries, optionally with error feedback."""

    implements = frozenset()  # no flag that chooses how a step is computed (refimpl/protocols.py)

    def __init__(self, model, optimizer, comm, clip: float = 0.0, ratio: float = 0.1,
                 error_feedback: bool = False) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k keeps a fraction in (0, 1] of the gradient's entries, got {ratio}")
        self.model, self.optimizer, self.comm, self.clip = model, optimizer, comm, clip
        self.ratio, self.error_feedback = ratio, error_feedback
        self.world_size, self.rank = comm.size, comm.rank
        self.record_grads = False
        self.last_grads: dict = {}
        self.steps_done = 0
        self.params = model.parameters()
        size = sum(p.size for p in self.params)  # Ψ
        self.k = max(1, math.ceil(ratio * size))
        self.memory = np.zeros(size, dtype=self.params[0].data.dtype)  # e_r (Ψ,): what top-k dropped so far

    def step(self, x, y) -> float:
        """One optimizer step on the global batch (x, y) with the sparse sum ĝ; the global batch's loss."""
        total = count_targets(y)
        x_local, y_local = split_batch(x, y, self.world_size, "ranks")[self.rank]
        rows = (self.rank * len(x_local), len(x), self.steps_done)
        loss = micro_batch_loss(self.model, x_local, y_local, total, rows=rows)
        loss.backward()
        grad = np.concatenate([(p.grad if p.grad is not None else np.zeros_like(p.data)).ravel()
                               for p in self.params])  # g_r (Ψ,)
        wanted = grad + self.memory if self.error_feedback else grad  # a_r
        keep = top_k(wanted, self.k)  # (k,)
        values = wanted[keep]  # (k,)
        if self.error_feedback:
            self.memory = wanted.copy()
            self.memory[keep] = 0.0  # e_r = a_r − top_k(a_r)
        all_values = self.comm.allgather(values)  # (W·k,)
        all_keep = self.comm.allgather(keep.astype(np.int64))  # (W·k,)
        sparse_sum = np.zeros_like(grad)  # ĝ (Ψ,)
        np.add.at(sparse_sum, all_keep, all_values)  # in rank order: the same sum on every rank
        offset = 0
        for p in self.params:
            p.grad = sparse_sum[offset:offset + p.size].reshape(p.shape).copy()
            offset += p.size
        if self.clip > 0:
            clip_grad_norm_(self.params, self.clip)
        if self.record_grads:
            self.last_grads = {name: p.grad.copy() for name, p in self.model.named_parameters()}
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps_done += 1
        return self.comm.allreduce_value(float(loss.item()))

    def full_parameters(self) -> dict:
        return self.model.state_dict()

    def report(self) -> dict:
        return {"trainer": "TopKTrainer", "ratio": self.ratio, "k": self.k, "error_feedback": self.error_feedback,
                "memory_norm": float(np.linalg.norm(self.memory))}


def make_trainer(cfg, model, world):
    """Top-10% sparsification without error feedback: the dropped entries are lost."""
    return TopKTrainer(model, build_optimizer(cfg, model.parameters()), world, cfg.clip, ratio=0.1)


def make_error_feedback_trainer(cfg, model, world):
    """Top-10% sparsification with error feedback: the dropped entries are sent later."""
    return TopKTrainer(model, build_optimizer(cfg, model.parameters()), world, cfg.clip, ratio=0.1,
                       error_feedback=True)
