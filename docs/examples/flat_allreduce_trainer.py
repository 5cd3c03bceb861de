"""A new data-parallel trainer, checked against single-process training the way `verify` does it.

Launch: mpiexec -n 2 python docs/examples/flat_allreduce_trainer.py [--average] [--steps 3]
   or:  mpiexec -n 2 python -m refimpl verify --trainer docs/examples/flat_allreduce_trainer.py:make_trainer

FlatAllReduceTrainer packs every gradient into one flat buffer and all-reduces it in one call. It
has the interface every trainer in refimpl has (train.LocalTrainer, parallel.trainer.Trainer;
protocols.Verifiable): step(x, y) on the global batch, returning the global loss;
full_parameters(); record_grads and last_grads; world_size, rank, implements and report().

Two ways to check it. `make_trainer(cfg, model, world)` is what `verify --trainer` calls: verify
and `verify --sweep N` then check this trainer exactly as they check refimpl's own. main() does by
hand what verify does: it trains the trainer and, on rank 0, train.LocalTrainer on the same
global batches from the same initial weights, and compares every step with refimpl.tools.compare at
verify's tolerances. --average (or make_averaging_trainer) introduces a classic bug (dividing the
summed gradients by the number of ranks, although refimpl's loss is already normalised by the
global batch): the check fails. Exits 0 when the runs agree, 1 otherwise, on every rank. See
docs/verify_your_algorithm.md.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from refimpl.local_trainer import LocalTrainer
from refimpl.objective import count_targets, micro_batch_loss, split_batch
from refimpl.optim import clip_grad_norm_
from refimpl.parallel.comm import get_world
from refimpl.tools.compare import TOLERANCES, Comparison, compare_step
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task


class FlatAllReduceTrainer:
    """Data parallelism with a single all-reduce of all gradients, packed into one flat buffer."""

    implements = frozenset()  # none of --grad-accum, --zero, --pp...: verify refuses them (protocols.py)

    def __init__(self, model, optimizer, comm, clip: float = 1.0, average: bool = False) -> None:
        self.model, self.optimizer, self.comm, self.clip, self.average = model, optimizer, comm, clip, average
        self.world_size, self.rank = comm.size, comm.rank
        self.record_grads = False  # verify sets it: then last_grads holds the gradients the optimizer used
        self.last_grads: dict = {}
        self.steps_done = 0  # the global batch's number (dropout masks depend on it, not on the split)

    def step(self, x, y) -> float:
        """One optimizer step on the global batch (x, y), the same on every rank; the global loss."""
        total = count_targets(y)  # of the whole batch: the ranks' losses and gradients then simply add up
        x_local, y_local = split_batch(x, y, self.world_size, "ranks")[self.rank]
        rows = (self.rank * len(x_local), len(x), self.steps_done)  # which rows of which global batch
        loss = micro_batch_loss(self.model, x_local, y_local, total, rows=rows)
        loss.backward()
        params = self.model.parameters()
        flat = np.concatenate([(p.grad if p.grad is not None else np.zeros_like(p.data)).ravel() for p in params])
        self.comm.allreduce(flat)  # (Ψ,) the sum over ranks, in place
        if self.average:
            flat /= self.world_size  # the bug: the sum already is the gradient of the global mean loss
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.size].reshape(p.shape).copy()
            offset += p.size
        if self.clip > 0:
            clip_grad_norm_(params, self.clip)
        if self.record_grads:
            self.last_grads = {name: p.grad.copy() for name, p in self.model.named_parameters()}
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps_done += 1
        return self.comm.allreduce_value(float(loss.item()))

    def full_parameters(self) -> dict:
        """{name: NumPy array} of the whole model (replicated here; a sharded trainer gathers)."""
        return self.model.state_dict()

    def report(self) -> dict:
        return {"trainer": "FlatAllReduceTrainer", "average": self.average}


def make_trainer(cfg, model, world):
    """What `verify --trainer FILE:make_trainer` calls: the trainer for this configuration."""
    return FlatAllReduceTrainer(model, build_optimizer(cfg, model.parameters()), world, cfg.clip)


def make_averaging_trainer(cfg, model, world):
    """The same trainer with the averaging bug: `verify --trainer FILE:make_averaging_trainer` fails."""
    return FlatAllReduceTrainer(model, build_optimizer(cfg, model.parameters()), world, cfg.clip, average=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--average", action="store_true", help="divide the summed gradients by the ranks (a bug)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    cfg = TrainConfig(model="gpt", dtype="float64", batch_size=8, n_layer=1, d_model=16, n_head=4, seq_len=8,
                      steps=args.steps)
    rtol, atol = TOLERANCES[cfg.dtype]
    world = get_world()
    task = build_task(cfg)
    model = build_model(cfg, task)  # the same seed on every rank: the same initial weights
    trainer = FlatAllReduceTrainer(model, build_optimizer(cfg, model.parameters()), world, cfg.clip, args.average)
    trainer.record_grads = True
    if world.rank == 0:
        ref_model = build_model(cfg, task)
        reference = LocalTrainer(ref_model, build_optimizer(cfg, ref_model.parameters()), cfg.grad_accum, cfg.clip)
        reference.record_grads = True
    total = Comparison()
    for step in range(cfg.steps):
        x, y = task.batch(step, cfg.batch_size)  # every rank builds the same global batch
        loss = trainer.step(x, y)
        params = trainer.full_parameters()  # every rank calls it (a sharded trainer communicates here)
        if world.rank == 0:
            ref_loss = reference.step(x, y)
            ours = {"loss": loss, "grads": trainer.last_grads, "params": params}
            ref = {"loss": ref_loss, "grads": reference.last_grads, "params": reference.full_parameters()}
            one = compare_step(step, ours, ref, rtol, atol)  # NaN or inf anywhere fails
            total = total.merge(one)
            print(f"step {step}: {'ok' if one.ok else 'FAIL'}, largest |diff| / tolerance {one.tolerance_used:.1g}"
                  + "".join(f"\n  {problem}" for problem in one.problems))
    ok = world.bcast_object(total.ok)
    if world.rank == 0:
        print(f"{'PASS' if ok else 'FAIL'}: FlatAllReduceTrainer on {world.size} process(es) vs one process, "
              f"{cfg.steps} steps (float64, rtol {rtol:g}, atol {atol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
