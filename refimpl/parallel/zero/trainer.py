"""What every ZeRO stage shares: the training step, gradient hooks, records, checkpoint pieces.

A ZeRO trainer has the interface of train.LocalTrainer and DataParallelTrainer (world_size, rank,
step(x, y) -> global loss, record_grads / last_grads, full_parameters(), report()) plus a memory
ledger (`ledger`, refimpl/memory.py) in which it registers every array of model state it
allocates. One optimizer step on a global batch of B examples, on each of N ranks:

    x_r = rank r's B/N examples, cut into g micro-batches (--grad-accum g)
    for each micro-batch:
        loss = Σ −log p(target) / (targets in the global batch)      (objective.py)
        backward(loss · S)          S = loss scale (mixed precision), else no scaling
            a parameter's gradient is accumulated, then its post-accumulate hook counts it;
            when all gradients of a group (flat.py) are in, the group's reduction starts
            (non-blocking; every hook polls the reductions in flight), and the previous group's
            reduction is waited for and finished: one reduction overlaps the next group's backward
        wait for the reductions; reduce groups that received no gradient
    sharded optimizer step on this rank's block of every group (optimizer.py)
    publish the updated parameters (all-gather; nothing under DP or for ZeRO-3's shards)

The stages differ only in what they keep and how they reduce (stage0.py ... stage3.py):

    stage  parameters held    gradients held             reduction                     publish
    0      whole              whole                      all-reduce, last micro-batch  --
    1      whole              whole                      reduce-scatter, last m.-b.    all-gather
    2      whole              shard (+ transient bucket)  reduce-scatter, every m.-b.   all-gather
    3      shard (+ gathered) shard (+ transient bucket)  reduce-scatter, every m.-b.   --

Every rank runs the same graph on equally shaped data, so the groups complete -- and their
collectives start -- in the same order on every rank, as MPI requires.

Legend: L a group's padded length, N ranks (L/N: one rank's block), g micro-batches per step.
"""

from __future__ import annotations

from functools import partial

from refimpl import backend
from refimpl.memory import MemoryLedger
from refimpl.objective import count_targets, micro_batch_loss, split_batch

from .optimizer import ShardedOptimizer
from refimpl.optim.precision import LossScaler, storage_dtype


class ZeroTrainer:
    """Base class; a stage implements the methods marked "stage" below."""

    stage: int = -1
    sharded = False  # stages 1-3: the optimizer state is cut into N shards, one per rank
    reduce_every_micro_batch = False  # stages 2 and 3: gradients are kept only as a shard
    in_flight = 1  # reductions left running when the next one starts (double buffering, as DeepSpeed's overlap_comm)

    def __init__(self, model, optimizer, comm, precision: str = "float32", grad_accum: int = 1, clip: float = 0.0,
                 bucket_bytes: int = 1 << 20, budget: int | None = None) -> None:
        if grad_accum <= 0:
            raise ValueError(f"--grad-accum must be positive, got {grad_accum}")
        self.model, self.comm, self.grad_accum, self.clip = model, comm, grad_accum, clip
        self.precision, self.bucket_bytes = precision, bucket_bytes
        self.world_size, self.rank = comm.size, comm.rank
        self.record_grads = False
        self.last_grads: dict = {}
        self.ledger = MemoryLedger(budget, comm.rank)
        self.scaler = LossScaler() if precision == "mixed" else None
        self.named = list(model.named_parameters())
        expected = storage_dtype(precision)
        wrong = [name for name, p in self.named if p.dtype != expected]
        if wrong:
            name = wrong[0]
            raise ValueError(f"--dtype {precision} stores parameters as {expected}, "
                             f"but {name} is {dict(self.named)[name].dtype}")
        self.groups = self._make_groups()  # stage
        self.param_blocks = self._hold_parameters()  # stage: registers parameters, returns blocks
        self.optimizer = ShardedOptimizer(optimizer, self.groups, self.param_blocks, self.ledger, comm, clip,
                                          self.scaler, sharded=self.sharded)
        self._hold_gradients()  # stage
        self._group_of = {id(p): group.index for group in self.groups for p in group.params}
        self._pending = [len(group.params) for group in self.groups]
        self._started: dict[int, object] = {}  # group index -> request of its reduction in flight, oldest first
        self._reduced: set[int] = set()  # groups whose reduction started in this backward pass
        self._reducing = False
        for group in self.groups:
            for p in group.params:
                p.register_hook(partial(self._before_accumulate, p))
                p.register_post_accumulate_grad_hook(self._after_accumulate)
        model.register_forward_hook(lambda module, args, output: self.ledger.check_activations())
        self.steps_done = 0  # the global batch's number, for split-independent dropout masks

    # -- the step -------------------------------------------------------------------------------
    def step(self, x, y) -> float:
        """One optimizer step on the global batch (x, y); returns the global batch's loss."""
        total = count_targets(y)  # of the whole global batch: every rank builds the same batch
        x_local, y_local = split_batch(x, y, self.world_size, "data-parallel ranks")[self.rank]
        micro = split_batch(x_local, y_local, self.grad_accum, "micro-batches per rank (--grad-accum)")
        first_row = self.rank * len(x_local)  # this rank's rows of the global batch
        loss_value = 0.0
        for i, (xm, ym) in enumerate(micro):
            last = i == len(micro) - 1
            self._reducing = last or self.reduce_every_micro_batch
            self._begin_micro_batch()
            rows = (first_row + i * len(xm), len(x), self.steps_done)  # dropout masks as in one process
            loss = micro_batch_loss(self.model, xm, ym, total, rows=rows)
            (loss if self.scaler is None else loss * self.scaler.scale).backward()
            self._finish_reductions()
            self._end_micro_batch()
            loss_value += float(loss.item())
        result = self.optimizer.step(self._gradient_blocks())
        if self.record_grads:
            self.last_grads = self._gather_blocks(result.grads)
        self._clear_gradients()  # stage
        if result.applied:
            self._publish()  # stage
        self.steps_done += 1
        return self.comm.allreduce_value(loss_value)

    # -- gradient hooks ---------------------------------------------------------------------------
    def _before_accumulate(self, param, grad):
        """Leaf hook, before backward adds this pass's gradient into param.grad (stage may override)."""
        return None

    def _after_accumulate(self, param) -> None:
        g = self._group_of[id(param)]
        self._pending[g] -= 1
        if self._pending[g] == 0 and self._reducing:
            self._start(self.groups[g])
        self._poll()

    def _start(self, group) -> None:
        self._started[group.index] = self._start_reduction(group)
        self._reduced.add(group.index)
        self._retire(self.in_flight)

    def _retire(self, keep: int) -> None:
        """Wait for the oldest reductions until at most `keep` are in flight, and finish them.

        Buckets are freed here, at the same point of backward on every rank (not whenever MPI happens
        to complete them), so every rank holds the same bytes at every allocation: one bucket being
        reduced while the next one fills.
        """
        while len(self._started) > keep:
            g = next(iter(self._started))
            self._started.pop(g).wait()
            self._reduction_done(self.groups[g])

    def _poll(self) -> None:
        """MPI advances non-blocking collectives only inside MPI calls: test the ones in flight."""
        for request in self._started.values():
            request.test()

    def _finish_reductions(self) -> None:
        """After backward: start what did not start (groups with missing gradients), wait for all."""
        if self._reducing:
            for group in self.groups:
                if group.index not in self._reduced and self._needs_reduction(group):
                    self._start(group)
        self._retire(0)
        self._reduced = set()
        self._pending = [len(group.params) for group in self.groups]

    def _begin_micro_batch(self) -> None:
        """Stage hook: before a micro-batch's forward."""

    def _end_micro_batch(self) -> None:
        """Stage hook: after a micro-batch's backward and reductions."""

    # -- what a stage provides --------------------------------------------------------------------
    # _make_groups() -> [FlatGroup]
    # _hold_parameters() -> [param block per group]       (registers "parameters")
    # _hold_gradients()                                    (registers persistent "gradients")
    # _needs_reduction(group) -> bool                      (after backward, for a group not started)
    # _start_reduction(group) -> Request
    # _reduction_done(group)
    # _gradient_blocks() -> [gradient block per group]
    # _clear_gradients()
    # _publish()
    # _whole_parameters(group) -> whole flat buffer (L,) of the group's parameters (collective for ZeRO-3)

    # -- records and the trainer interface --------------------------------------------------------
    def _gather_blocks(self, blocks: list) -> dict:
        """{name: whole array} from every group's block on every rank (all-gather; collective)."""
        whole = {}
        for group, block in zip(self.groups, blocks):
            if group.shards == 1:
                flat = block
            else:
                flat = backend.xp().empty(group.length, dtype=block.dtype)
                self.comm.allgather(backend.xp().ascontiguousarray(block), flat)
            for name, view in zip(group.names, group.views(flat)):
                whole[name] = backend.to_host(view).copy()
        return whole

    def full_parameters(self) -> dict:
        """{name: NumPy array} of the whole model, in the model's order (collective when sharded).

        Under mixed precision these are the float32 master weights: the parameters the optimizer
        holds (the float16 copies are rounded from them), and what verify compares.
        """
        if self.scaler is not None:
            return self._gather_blocks(self.optimizer.masters)
        arrays = {}
        for group in self.groups:
            for name, view in zip(group.names, group.views(self._whole_parameters(group))):
                arrays[name] = backend.to_host(view).copy()
        return {name: arrays[name] for name, _ in self.named}

    def full_optimizer_state(self) -> dict:
        """{"step", "arrays": {state key: {name: whole array}}, "loss_scaler"} (collective when sharded).

        verify --dtype mixed hands it to the single-process reference before each step, so that
        each step is compared from the same state (compare_mixed.py, "lockstep").
        """
        keys = self.optimizer.state_arrays(0).keys() if self.groups else ()
        arrays = {key: self._gather_blocks([self.optimizer.state_arrays(g.index)[key] for g in self.groups])
                  for key in keys}
        return {"step": self.optimizer.steps_taken, "arrays": arrays,
                "loss_scaler": None if self.scaler is None else self.scaler.state_dict()}

    @property
    def padding_elements(self) -> int:
        return sum(group.padding for group in self.groups)

    @property
    def padded_numel(self) -> int:
        """Ψ' = Σ padded group lengths: the Ψ that the paper's formulas see here."""
        return sum(group.length for group in self.groups)

    def report(self) -> dict:
        """Plain facts for --json (no communication: verify calls it on rank 0 only)."""
        return {"zero_stage": self.stage, "precision": self.precision, "flat_groups": len(self.groups),
                "padded_numel": self.padded_numel, "padding_elements": self.padding_elements,
                "loss_scale": None if self.scaler is None else self.scaler.scale,
                "skipped_steps": 0 if self.scaler is None else self.scaler.skipped,
                "optimizer_steps": self.optimizer.steps_taken}

    # -- checkpoints (checkpoint.py) ---------------------------------------------------------------
    def checkpoint_pieces(self) -> list:
        """[(name, start, stop, {"master": array, state key: array})] of this rank's blocks.

        start:stop indexes the flattened parameter; padding is left out. Under DP (one shard) only
        rank 0 contributes: every rank holds the same whole state.
        """
        pieces = []
        for group in self.groups:
            if group.shards == 1 and self.rank != 0:
                continue
            lo, hi = (0, group.length) if group.shards == 1 else (group.start, group.stop)
            arrays = {"master": self.optimizer.masters[group.index], **self.optimizer.state_arrays(group.index)}
            for name, start, stop, pos in group.pieces(lo, hi):
                values = {k: backend.to_host(a[pos:pos + stop - start]) for k, a in arrays.items()}
                pieces.append((name, start, stop, values))
        return pieces

    def load_full_state(self, masters: dict, states: dict, step: int) -> None:
        """Set master weights, parameters and optimizer state from whole flattened arrays by name."""
        xp = backend.xp()
        for group in self.groups:
            lo, hi = (0, group.length) if group.shards == 1 else (group.start, group.stop)
            master = self.optimizer.masters[group.index]
            block = group.flatten([masters[n] for n in group.names], dtype=master.dtype)[lo:hi]
            state = {key: group.flatten([states[key][n] for n in group.names], dtype=value.dtype)[lo:hi]
                     for key, value in self.optimizer.state_arrays(group.index).items()}
            self.optimizer.load_group(group.index, xp.asarray(block), state, step)
        self._publish()
