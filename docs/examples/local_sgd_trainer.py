"""Local SGD: every rank trains its own replica on its share of the batch and the replicas are averaged
every H steps. Not meant to equal single-process training: `python -m refimpl distance` measures how far it is.

Launch: mpiexec -n 2 python -m refimpl distance --trainer docs/examples/local_sgd_trainer.py:make_trainer \
            --optimizer sgd --lr 0.1 --clip 0 --steps 100 --plot local_sgd.png

Local SGD (Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019; Lin et al., "Don't
Use Large Mini-Batches, Use Local SGD", ICLR 2020) replaces the all-reduce of the gradients at every
step by an average of the parameters every H steps. With W ranks, rank r's replica θ_r takes

    θ_r ← θ_r − lr · u(g_r),   g_r = ∇ (Σ_{targets t of rank r's rows} CE_t / N_r)
    every H-th step:   θ_r ← (1/W) Σ_q θ_q                       (one all-reduce of all parameters)

where u is the optimizer's update (SGD with momentum, AdamW, each rank with its own state) and N_r the
counted targets of rank r's share: g_r is an unbiased but noisy estimate of the global batch's
gradient, computed at θ_r, which drifts away from the other replicas between averages. With H = 1 and
SGD (with or without momentum, whose update is linear in g) the average of the replicas' steps is the
step of the average gradient: the parameters are data parallelism's up to rounding, though each
rank's gradient is still its own share's.

It has the interface of every trainer in refimpl (protocols.Verifiable): step(x, y) on the global
batch, returning the global batch's loss (each rank's rows at its own replica); full_parameters()
(rank 0's replica: the one compared); record_grads and last_grads (rank 0's gradient, as its
optimizer used it); world_size, rank and report().
"""

from __future__ import annotations

import numpy as np

from refimpl.objective import count_targets, micro_batch_loss, split_batch
from refimpl.optim import clip_grad_norm_
from refimpl.tools.run import build_optimizer


class LocalSGDTrainer:
    """Each rank steps its own replica on its rows; the replicas are averaged every `sync_every` steps."""

    implements = frozenset()  # no flag that chooses how a step is computed (refimpl/protocols.py)

    def __init__(self, model, optimizer, comm, clip: float = 0.0, sync_every: int = 4) -> None:
        if sync_every < 1:
            raise ValueError(f"local SGD averages every H >= 1 steps, got H = {sync_every}")
        self.model, self.optimizer, self.comm, self.clip, self.sync_every = model, optimizer, comm, clip, sync_every
        self.world_size, self.rank = comm.size, comm.rank
        self.record_grads = False
        self.last_grads: dict = {}
        self.steps_done = 0
        self.averages = 0

    def step(self, x, y) -> float:
        """One local step on this rank's rows of the global batch (x, y); every H-th step, the average."""
        total = count_targets(y)
        x_local, y_local = split_batch(x, y, self.world_size, "ranks")[self.rank]
        local_total = count_targets(y_local)  # this rank's own mean loss: its gradient estimates the global one
        rows = (self.rank * len(x_local), len(x), self.steps_done)
        loss = micro_batch_loss(self.model, x_local, y_local, local_total, rows=rows)
        loss.backward()
        params = self.model.parameters()
        if self.clip > 0:
            clip_grad_norm_(params, self.clip)
        if self.record_grads:
            self.last_grads = {name: p.grad.copy() for name, p in self.model.named_parameters()}
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps_done += 1
        if self.steps_done % self.sync_every == 0:
            self._average(params)
        # the global batch's loss: each rank's rows, at its replica before the step, weighted by its targets
        return self.comm.allreduce_value(float(loss.item()) * local_total / max(1, total))

    def _average(self, params) -> None:
        """θ_r ← (1/W) Σ_q θ_q: one all-reduce of every parameter, packed into one flat buffer."""
        flat = np.concatenate([p.data.ravel() for p in params])  # (Ψ,)
        self.comm.allreduce(flat)
        flat /= self.world_size
        offset = 0
        for p in params:
            p.data[...] = flat[offset:offset + p.size].reshape(p.shape)
            offset += p.size
        self.averages += 1

    def full_parameters(self) -> dict:
        """{name: array} of this rank's replica (rank 0's is the one compared)."""
        return self.model.state_dict()

    def report(self) -> dict:
        return {"trainer": "LocalSGDTrainer", "sync_every": self.sync_every, "averages": self.averages}


def make_trainer(cfg, model, world):
    """Local SGD averaging every 4 steps (what `--trainer FILE:make_trainer` calls)."""
    return LocalSGDTrainer(model, build_optimizer(cfg, model.parameters()), world, cfg.clip, sync_every=4)


def make_every_step_trainer(cfg, model, world):
    """Local SGD averaging after every step: with SGD, data parallelism's parameters up to rounding."""
    return LocalSGDTrainer(model, build_optimizer(cfg, model.parameters()), world, cfg.clip, sync_every=1)
