"""Trainers that try to get a PASS they have not earned, for `verify --trainer tests/trainers/dishonest.py:FUNCTION`
(tests/test_verify_instrument.py).

claims_ok                 averages the summed gradients (wrong at every step) and reports {"ok": True,
                          "tolerance_used": 0, ...}: the report must not change the verdict
honest                    the same trainer without the bug (and with the same report)
drops_on_other_ranks      ranks other than 0 step with their own unreduced gradient: rank 0 is right
declares_pp_ignores_it    declares --pp, --schedule and --micro-batches and runs plain data parallelism
declares_everything_ignores_it  declares every flag but --dtype and runs plain data parallelism
refimpls_own              refimpl's own trainer, which honours every flag it declares (all of them)
declares_grad_accum       implements --grad-accum (micro-batches summed on each rank) and declares it
declares_a_string         implements = "--pp": not a set of flags
declares_unknown_flag     implements = {"--turbo"}: not a flag that chooses how a step is computed
mixed_without_state       declares --dtype (mixed) but lacks optimizer_steps and full_optimizer_state
report_not_a_dict         report() returns a list
local_records_not_a_dict  local_records() (optional) returns a list
counts_reports            report() says how often it was called and after how many steps
"""

import numpy as np

from refimpl.objective import count_targets, micro_batch_loss, split_batch
from refimpl.optim import clip_grad_norm_
from refimpl.protocols import IMPLEMENTATION_FLAGS
from refimpl.tools.run import build_optimizer, make_trainer


class DataParallel:
    """Plain data parallelism: each rank's share of the batch in `accum` micro-batches, one
    all-reduce of every gradient (sum), clipping, the update."""

    implements = frozenset()

    def __init__(self, cfg, model, comm, accum: int = 1) -> None:
        self.model, self.comm, self.clip, self.accum = model, comm, cfg.clip, accum
        self.optimizer = build_optimizer(cfg, model.parameters())
        self.world_size, self.rank = comm.size, comm.rank
        self.record_grads, self.last_grads, self.steps_done = False, {}, 0

    def reduce(self, grad):
        self.comm.allreduce(grad)  # the sum over ranks, in place
        return grad

    def step(self, x, y) -> float:
        total = count_targets(y)
        x_local, y_local = split_batch(x, y, self.world_size, "ranks")[self.rank]
        loss_value = 0.0
        for i, (xm, ym) in enumerate(split_batch(x_local, y_local, self.accum, "micro-batches")):
            rows = (self.rank * len(x_local) + i * len(xm), len(x), self.steps_done)
            loss = micro_batch_loss(self.model, xm, ym, total, rows=rows)
            loss.backward()
            loss_value += float(loss.item())
        params = self.model.parameters()
        for p in params:
            p.grad = self.reduce(p.grad.copy() if p.grad is not None else np.zeros_like(p.data))
        if self.clip > 0:
            clip_grad_norm_(params, self.clip)
        if self.record_grads:
            self.last_grads = {name: p.grad.copy() for name, p in self.model.named_parameters()}
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps_done += 1
        return self.comm.allreduce_value(loss_value)

    def full_parameters(self) -> dict:
        return self.model.state_dict()

    def report(self) -> dict:
        return {"ok": True, "tolerance_used": 0, "max_abs_diff": 0.0, "problems": [], "worst_name": None}


class Averaging(DataParallel):
    def reduce(self, grad):
        return super().reduce(grad) / self.world_size  # the bug: the sum already is the global mean's gradient


class DropsOnOtherRanks(DataParallel):
    def reduce(self, grad):
        reduced = super().reduce(grad.copy())
        return reduced if self.rank == 0 else grad  # the bug: ranks other than 0 keep their own gradient


def claims_ok(cfg, model, world):
    return Averaging(cfg, model, world)


def honest(cfg, model, world):
    return DataParallel(cfg, model, world)


def drops_on_other_ranks(cfg, model, world):
    return DropsOnOtherRanks(cfg, model, world)


def declares_pp_ignores_it(cfg, model, world):
    trainer = DataParallel(cfg, model, world)
    trainer.implements = frozenset({"--pp", "--schedule", "--micro-batches"})
    return trainer


def declares_grad_accum(cfg, model, world):
    trainer = DataParallel(cfg, model, world, accum=cfg.grad_accum)
    trainer.implements = frozenset({"--grad-accum"})
    return trainer


def declares_a_string(cfg, model, world):
    trainer = DataParallel(cfg, model, world)
    trainer.implements = "--pp"
    return trainer


def declares_unknown_flag(cfg, model, world):
    trainer = DataParallel(cfg, model, world)
    trainer.implements = frozenset({"--turbo"})
    return trainer


def mixed_without_state(cfg, model, world):
    trainer = DataParallel(cfg, model, world)
    trainer.implements = frozenset({"--dtype"})
    return trainer


def report_not_a_dict(cfg, model, world):
    trainer = DataParallel(cfg, model, world)
    trainer.report = lambda: ["ok"]
    return trainer


def local_records_not_a_dict(cfg, model, world):
    trainer = DataParallel(cfg, model, world)
    trainer.local_records = lambda: [trainer.full_parameters()]
    return trainer


def counts_reports(cfg, model, world):
    trainer, calls = DataParallel(cfg, model, world), []

    def report():
        calls.append(trainer.steps_done)
        return {"calls": len(calls), "steps_done_at_each_call": list(calls)}

    trainer.report = report
    return trainer


def declares_everything_ignores_it(cfg, model, world):
    trainer = DataParallel(cfg, model, world)
    trainer.implements = frozenset(flag for flag in IMPLEMENTATION_FLAGS if flag != "--dtype")
    return trainer


def refimpls_own(cfg, model, world):
    return make_trainer(cfg, model, world, distributed=True)
