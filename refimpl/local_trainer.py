"""Single-process training: the reference that every distributed trainer is checked against.

One process holds the whole model and takes the whole global batch B per optimizer step, cut into
`grad_accum` micro-batches. The loss of each micro-batch is normalised by the number of targets of
the *global* batch (objective.py), so the micro-batches' gradients simply add up to the gradient of
the batch's mean loss, exactly as a distributed trainer's ranks' gradients add up over the ranks:

    for each micro-batch m:   backward( Σ_{targets t in m} CE_t / N_batch )      (accumulates .grad)
    clip by the global norm (optional), optimizer step, zero the gradients

`refimpl/parallel/trainer.py` is the distributed trainer; `verify` (refimpl/tools/verification.py)
runs both on the same batches from the same initial weights and compares them step by step.
"""

from __future__ import annotations

from refimpl import backend
from refimpl.memory import track_replicated
from refimpl.objective import count_targets, micro_batch_loss, split_batch
from refimpl.optim import clip_grad_norm_, scale_to_max_norm_, squared_norm
from refimpl.optim.precision import LossScaler
from refimpl.optim.whole_state import load_whole, whole_pieces


class LocalTrainer:
    """Single-process training on the whole global batch: the reference every distributed trainer
    is checked against (it imports nothing from refimpl.parallel).

    With float16 parameters (--dtype mixed) it follows mixed precision's recipe, as the ZeRO
    trainers do (optim/precision.py): backward of loss · S into float16 gradients, then in float32
    g = float32(g16) / S; any non-finite element skips the step and backs the scale off; otherwise
    clip, update the float32 master weights and copy them into the float16 parameters. With
    bfloat16 parameters (--dtype bf16) the same without the loss scale: each micro-batch's gradient
    arrives rounded to bfloat16 and is added into a float32 gradient, as the ZeRO trainers reduce it.
    """

    world_size, rank = 1, 0
    implements = frozenset({"--grad-accum", "--dtype", "--mem-budget"})  # protocols.IMPLEMENTATION_FLAGS it honours

    def __init__(self, model, optimizer, grad_accum: int = 1, clip: float = 0.0, budget: int | None = None) -> None:
        self.model, self.optimizer, self.grad_accum, self.clip = model, optimizer, grad_accum, clip
        self.record_grads = False
        self.last_grads: dict = {}
        self.steps_done = 0  # the global batch's number, for split-independent dropout masks
        self.params = model.parameters()
        self.scaler = LossScaler() if self.params[0].dtype == "float16" else None
        self.masters = None  # float32 master weights under float16 or bfloat16 storage (optim/precision.py)
        if self.params[0].dtype.name in ("float16", "bfloat16"):  # master weights and their optimizer state
            self.masters = [p.data.astype("float32") for p in self.params]
            self.states = [optimizer.init_state(m) for m in self.masters]
        if self.params[0].dtype.name == "bfloat16":  # each micro-batch's bfloat16 gradient is added in float32
            for p in self.params:
                p.grad = backend.xp().zeros(p.shape, "float32")
        if self.masters is not None:  # the optimizer updates the masters: its state is theirs (float32)
            optimizer.state = self.states
        self.ledger = track_replicated(self.params, optimizer, budget)  # memory by category (memory.py)
        for master in self.masters or ():
            self.ledger.register("master_weights", master, "float32 master weights")
        model.register_forward_hook(lambda module, args, output: self.ledger.check_activations())

    def step(self, x, y) -> float:
        """Forward and backward over grad_accum micro-batches, clip, step, zero grads; return the loss."""
        total = count_targets(y)
        loss_value = 0.0
        for i, (xm, ym) in enumerate(split_batch(x, y, self.grad_accum, "micro-batches (--grad-accum)")):
            loss = micro_batch_loss(self.model, xm, ym, total, rows=(i * len(xm), len(x), self.steps_done),
                                    loss_scale=1.0 if self.scaler is None else self.scaler.scale)
            (loss if self.scaler is None else loss * self.scaler.scale).backward()
            loss_value += float(loss.item())
        if self.masters is None:
            if self.clip > 0:
                clip_grad_norm_(self.params, self.clip)
            self._record([p.grad for p in self.params])
            self.optimizer.step()
        else:
            self._mixed_precision_step()
        self.optimizer.zero_grad()
        self.steps_done += 1
        return loss_value

    def _mixed_precision_step(self) -> None:
        xp = backend.xp()
        grads = [p.grad.astype("float32") if p.grad is not None else xp.zeros(p.shape, "float32") for p in self.params]
        if self.scaler is None:  # bfloat16: no loss scale, no skipped steps
            return self._master_weight_step(grads)
        for g in grads:
            g *= 1.0 / self.scaler.scale
        overflow = not all(bool(xp.isfinite(g).all()) for g in grads)
        if not overflow and self.clip > 0:
            scale_to_max_norm_(grads, squared_norm(grads), self.clip)
        self._record(grads)
        if not overflow:
            for p, master, g, state in zip(self.params, self.masters, grads, self.states):
                self.optimizer.update(master, g, state)
                p.data[...] = master
        self.scaler.update(overflow)

    def _master_weight_step(self, grads) -> None:
        """bfloat16: clip the float32 gradients, update the float32 master weights, round them into
        the bfloat16 parameters."""
        if self.clip > 0:
            scale_to_max_norm_(grads, squared_norm(grads), self.clip)
        self._record(grads)
        for p, master, g, state in zip(self.params, self.masters, grads, self.states):
            self.optimizer.update(master, g, state)
            p.data[...] = master

    def load_mixed_state(self, masters: dict, optimizer_state: dict) -> None:
        """Take another run's master weights, optimizer state and loss scale (the distributed
        Trainer's full_optimizer_state, parallel/trainer.py)."""
        load_whole(list(self.model.named_parameters()), self.masters, self.states, masters, optimizer_state["arrays"],
                   optimizer_state["step"])
        if self.scaler is not None:  # bfloat16 has no loss scale
            self.scaler.load_state_dict(optimizer_state["loss_scaler"])

    def _record(self, grads) -> None:
        if self.record_grads:
            names = [name for name, _ in self.model.named_parameters()]
            self.last_grads = {name: backend.to_host(g).copy() for name, g in zip(names, grads)}

    def full_parameters(self) -> dict:
        """{name: NumPy array} of the whole model (under mixed precision: the float32 master weights)."""
        if self.masters is None:
            return self.model.state_dict()
        return {name: backend.to_host(m).copy() for (name, _), m in zip(self.model.named_parameters(), self.masters)}

    def report(self) -> dict:
        if self.masters is not None and self.scaler is None:
            return {"precision": "bf16"}
        if self.scaler is None:
            return {}
        return {"precision": "mixed", "loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped}

    def model_for_evaluation(self, model, build):
        """The model to evaluate: one process holds all of it."""
        return model

    # -- sharded checkpoints (saved_runs/sharded.py): one process holds the whole state -----------
    def _whole_state(self) -> tuple[list, list]:
        """(masters, states): the arrays the optimizer updates and their states, one per parameter."""
        if self.masters is not None:
            return self.masters, self.states
        return [p.data for p in self.params], self.optimizer.state

    @property
    def optimizer_steps(self) -> int:
        states = self._whole_state()[1]
        return int(states[0]["step"]) if states else 0

    def checkpoint_pieces(self) -> list:
        """[(name, 0, numel, {"master": array, state key: array})] of every parameter."""
        return whole_pieces(list(self.model.named_parameters()), *self._whole_state())

    def load_full_state(self, masters: dict, states: dict, step: int) -> None:
        load_whole(list(self.model.named_parameters()), *self._whole_state(), masters, states, step)


__all__ = ["LocalTrainer"]
