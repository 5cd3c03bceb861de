"""What every ZeRO stage shares: flat groups per pipeline stage, gradient hooks, the sharded step.

A ZeRO stage is a *gradient and parameter sharding strategy* over the data-parallel group of N
ranks (parallel/trainer.py composes it with the mesh, the micro-batch loop and precision). It
is handed the stages this rank holds (the whole model when there is no pipeline) and keeps their
model state as its stage prescribes. During one optimizer step the trainer's executor runs the
micro-batches, wrapping every action in `around(action, last)`:

    F (forward)       ZeRO-3 gathers each module's parameters just before it runs (hooks)
    B, or I then W    backward of (loss · S)   (S = loss scale under mixed precision, else 1):
                      a parameter's gradient is accumulated, then its post-accumulate hook counts
                      it; when all gradients of a group (flat.py) are in and the group reduces in
                      this backward, the group's reduction starts (non-blocking; every hook polls
                      the reductions in flight), and the previous group's reduction is waited for
                      and finished: one reduction overlaps the next group's backward
    after B or W      reduce the groups that received no gradient; wait for every reduction

then `finish()` gives the reduced gradient blocks, `optimizer_step(blocks)` takes the sharded
optimizer step on this rank's block of every group (optimizer.py), and `end_step(result)`
publishes the updated parameters (all-gather; nothing under DP or for ZeRO-3's shards).

The stages differ only in what they keep and how they reduce (stage0.py ... stage3.py):

    stage  parameters held    gradients held             reduction                     publish
    0      whole              whole                      all-reduce, last backward     --
    1      whole              whole                      reduce-scatter, last backward all-gather
    2      whole              shard (+ transient bucket)  reduce-scatter, every backward all-gather
    3      shard (+ gathered) shard (+ transient bucket)  reduce-scatter, every backward --

"Last backward" is the last B (or W) of the pipeline stage in this step: with g micro-batches,
stages 0 and 1 accumulate whole gradients locally and reduce once; stages 2 and 3 keep only a
shard and reduce after each of the g backwards. Groups never span two pipeline stages, so a
stage's groups are complete when its backward is.

Every rank of the group runs the same actions on equally shaped data (the data-parallel replicas
of a pipeline rank run the same schedule), so the groups complete -- and their collectives
start -- in the same order on every rank, as MPI requires.

Each stage is one class in its own file, read top to bottom with this one: it subclasses
ZeroSharding directly and builds its methods from the building blocks below (whole buffers,
gradient shards filled through transient buckets, the all-gather that publishes parameters).

What a stage provides (the methods marked "stage" below):

    _make_groups(named, first_index) -> [FlatGroup]     one pipeline stage's parameters
    _hold_parameters() -> [param block per group]       registers "parameters"
    _hold_gradients()                                    registers persistent "gradients"
    _needs_reduction(group) -> bool                      after backward, for a group not started
    _start_reduction(group) -> Request
    _reduction_done(group)
    _gradient_blocks() -> [gradient block per group]
    _clear_gradients()
    _publish()
    _whole_parameters(group) -> whole flat buffer (L,)  (collective for ZeRO-3)

Legend: L a group's padded length, N ranks (L/N: one rank's block), g micro-batches per step.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

from refimpl import backend
from refimpl.memory import MemoryLedger
from refimpl.parallel.comm import wait_all
from refimpl.optim.precision import LossScaler, storage_dtype

from .optimizer import ShardedOptimizer


class ZeroSharding:
    """Base class of the ZeRO stages (see the module docstring).

    parts      the pipeline stages this rank holds ({index: stage}, each with named_parameters());
               one part, the whole model, without a pipeline
    optimizer  an optimizer built with no parameters (its hyper-parameters and update rule)
    comm       the data-parallel group over which the state is sharded
    norm_total / any_rank  how the global gradient norm and the overflow vote are combined over
               the ranks that do not share this rank's stages (the pipeline, the tensor-parallel
               group); None: nothing to add
    uncounted  names of parameters whose gradient norm another rank counts (optimizer.py)
    ledger     a memory ledger to share (expert parallelism's two strategies), else a new one
    """

    stage: int = -1
    sharded = False  # stages 1-3: the optimizer state is cut into N shards, one per rank
    reduce_every_micro_batch = False  # stages 2 and 3: gradients are kept only as a shard
    in_flight = 1  # reductions left running when the next one starts (double buffering, as DeepSpeed's overlap_comm)

    def __init__(self, model, parts: dict, optimizer, comm, precision: str = "float32", clip: float = 0.0,
                 bucket_bytes: int = 1 << 20, budget: int | None = None, rank: int | None = None,
                 norm_total=None, any_rank=None, uncounted=(), ledger=None) -> None:
        self.model, self.parts, self.comm, self.clip = model, parts, comm, clip
        self.precision, self.bucket_bytes = precision, bucket_bytes
        self.world_size, self.rank = comm.size, comm.rank
        self.ledger = MemoryLedger(budget, comm.rank if rank is None else rank) if ledger is None else ledger
        self.scaler = LossScaler() if precision == "mixed" else None
        self.named = [(name, p) for s in sorted(parts) for name, p in parts[s].named_parameters()]
        expected = storage_dtype(precision)
        wrong = [name for name, p in self.named if p.dtype != expected]
        if wrong:
            name = wrong[0]
            raise ValueError(f"--dtype {precision} stores parameters as {expected}, "
                             f"but {name} is {dict(self.named)[name].dtype}")
        self.groups, self.groups_of_stage = [], {}
        for s in sorted(parts):
            made = self._make_groups(parts[s].named_parameters(), len(self.groups))  # stage
            self.groups_of_stage[s] = [group.index for group in made]
            self.groups += made
        self.param_blocks = self._hold_parameters()  # stage: registers parameters, returns blocks
        self.optimizer = ShardedOptimizer(optimizer, self.groups, self.param_blocks, self.ledger, comm, clip,
                                          self.scaler, sharded=self.sharded, norm_total=norm_total,
                                          any_rank=any_rank, uncounted=uncounted)
        self._hold_gradients()  # stage
        self._group_of = {id(p): group.index for group in self.groups for p in group.params}
        self._pending = [len(group.params) for group in self.groups]
        self._started: dict[int, object] = {}  # group index -> request of its reduction in flight, oldest first
        self._reduced: set[int] = set()  # groups whose reduction started in this backward
        self._reducing = False
        for group in self.groups:
            for p in group.params:
                p.register_hook(partial(self._before_accumulate, p))
                p.register_post_accumulate_grad_hook(self._after_accumulate)

    # -- one step, action by action (parallel/trainer.py) ---------------------------------------
    @contextmanager
    def around(self, action, last: bool):
        """Around one action of the micro-batch loop: F, B, I or W of a pipeline stage."""
        if action.kind in ("B", "W"):  # the stage's parameter gradients accumulate in this action
            self._reducing = last or self.reduce_every_micro_batch
        self._begin_action(action)
        yield
        if action.kind == "F":
            self.ledger.check_activations()  # a budget check when saved activations peak
        if action.kind in ("B", "W"):
            self._finish_reductions(action.stage)
        self._end_action(action)

    def finish(self) -> list:
        """After the micro-batch loop: this rank's reduced gradient block of every group."""
        self._retire(0)
        return self._gradient_blocks()

    def squared_norm(self, blocks: list) -> float:
        return self.optimizer.squared_norm(blocks)

    def optimizer_step(self, blocks: list, total: float | None = None):
        """The sharded optimizer step on the blocks (optimizer.py); returns its StepResult."""
        return self.optimizer.step(blocks, total)

    def end_step(self, result) -> None:
        """Zero the gradients and, if the step was taken, publish the updated parameters."""
        self._clear_gradients()  # stage
        if result.applied:
            self._publish()  # stage

    # -- gradient hooks ---------------------------------------------------------------------------
    def _before_accumulate(self, param, grad):
        """Leaf hook, before backward adds this pass's gradient into param.grad (stage may override)."""
        return None

    def _after_accumulate(self, param) -> None:
        g = self._group_of[id(param)]
        if g in self._reduced:  # its reduction may already have read the buffer
            raise RuntimeError(f"ZeRO: a gradient was accumulated into flat group {g} after its reduction had started "
                               "(the group's count of pending gradients is wrong)")
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

    def _finish_reductions(self, stage: int) -> None:
        """After a backward of `stage`: start what did not start (groups that got no gradient), wait for all."""
        mine = self.groups_of_stage[stage]
        if self._reducing:
            for g in mine:
                if g not in self._reduced and self._needs_reduction(self.groups[g]):
                    self._start(self.groups[g])
        self._retire(0)
        for g in mine:
            self._reduced.discard(g)
            self._pending[g] = len(self.groups[g].params)

    def _begin_action(self, action) -> None:
        """Stage hook: before an action."""

    def _end_action(self, action) -> None:
        """Stage hook: after an action."""

    # -- building blocks the stages share -------------------------------------------------------------
    def _whole_parameter_buffers(self, groups, what: str = "whole parameters") -> tuple[list, list]:
        """(flats, blocks): every group's parameters in one whole flat buffer (L,), each parameter a
        view into it, and the block (L/N,) of it that this rank's optimizer updates (stages 0-2, and
        ZeRO-3's persistent small parameters)."""
        flats, blocks = [], []
        for group in groups:
            flat = self.ledger.register("parameters", group.flatten([p.data for p in group.params]),
                                        what)  # (L,)
            for p, view in zip(group.params, group.views(flat)):
                p.set_flat_views(view)
            flats.append(flat)
            blocks.append(flat[group.start:group.stop])  # (L/N,)
        return flats, blocks

    def _whole_gradient_buffers(self) -> list:
        """Every group's gradients in one whole flat buffer (L,), allocated once; each parameter's
        .grad is a view into it, so backward accumulates straight into it (stages 0 and 1)."""
        flats = []
        for group in self.groups:
            flat = self.ledger.register("gradients", group.empty(), "whole gradients")  # (L,)
            for p, view in zip(group.params, group.views(flat)):
                p.grad = view
            flats.append(flat)
        return flats

    def _all_gather_parameters(self, flats: list) -> None:
        """Publish: all-gather every rank's updated block into the whole parameter buffers, in place."""
        wait_all([self.comm.iallgather(None, flat) for flat in flats])

    def _hold_gradient_shards(self) -> None:
        """A persistent gradient shard (L/N,) per group, filled through transient buckets (stages 2, 3)."""
        self.grad_shards = [self.ledger.register("gradients", group.empty(whole=False), "gradient shard")
                            for group in self.groups]
        self.grad_buckets = [None] * len(self.groups)  # (L,) while being filled and reduced
        self.received = [None] * len(self.groups)  # (L/N,) reduce-scatter outputs in flight

    def _open_bucket(self, g: int) -> None:
        """The first gradient of group g in this backward: allocate its bucket, point the .grads into it."""
        if self.grad_buckets[g] is None:
            group = self.groups[g]
            bucket = self.ledger.register("gradient_buckets", group.empty(), "gradient bucket")  # (L,)
            for p, view in zip(group.params, group.views(bucket)):
                p.grad = view  # backward now adds (+=) into the bucket
            self.grad_buckets[g] = bucket

    def _reduce_scatter_bucket(self, group):
        """Start the reduce-scatter of group's bucket into a fresh block (L/N,); returns the request."""
        g = group.index
        self.received[g] = self.ledger.register("gradient_buckets", group.empty(whole=False), "reduce-scatter output")
        return self.comm.ireduce_scatter(self.grad_buckets[g], self.received[g])

    def _add_bucket_into_shard(self, group) -> None:
        """The reduce-scatter is done: add the summed block into the shard, free the bucket."""
        g = group.index
        self.grad_shards[g] += self.received[g]  # accumulate this backward's summed block
        for p in group.params:
            p.grad = None
        self.ledger.release(self.received[g])
        self.ledger.release(self.grad_buckets[g])
        self.received[g] = self.grad_buckets[g] = None

    # -- records ------------------------------------------------------------------------------------
    def whole(self, blocks: list) -> dict:
        """{name: whole array on the host} from every group's block on every rank (all-gather; collective)."""
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

    def whole_parameters(self) -> dict:
        """{name: NumPy array} of this rank's stages, in the model's order (collective when sharded).

        Under mixed precision these are the float32 master weights: the parameters the optimizer
        holds (the float16 copies are rounded from them), and what verify compares.
        """
        if self.scaler is not None:
            return self.whole(self.optimizer.masters)
        arrays = {}
        for group in self.groups:
            for name, view in zip(group.names, group.views(self._whole_parameters(group))):
                arrays[name] = backend.to_host(view).copy()
        return {name: arrays[name] for name, _ in self.named}

    def whole_optimizer_state(self) -> dict:
        """{"step", "arrays": {state key: {name: whole array}}, "loss_scaler"} (collective when sharded)."""
        keys = self.optimizer.state_arrays(0).keys() if self.groups else ()
        arrays = {key: self.whole([self.optimizer.state_arrays(g.index)[key] for g in self.groups]) for key in keys}
        return {"step": self.optimizer.steps_taken, "arrays": arrays,
                "loss_scaler": None if self.scaler is None else self.scaler.state_dict()}

    @property
    def steps_taken(self) -> int:
        return self.optimizer.steps_taken

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

    # -- checkpoints (refimpl/saved_runs/sharded.py) -----------------------------------------
    def checkpoint_pieces(self, stages, writes_whole: bool) -> list:
        """[(name, start, stop, {"master": array, state key: array})] of this rank's blocks of `stages`.

        start:stop indexes the flattened parameter; padding is left out. A group of one shard is
        whole on every rank of the group: only the rank with writes_whole contributes it.
        """
        pieces = []
        for group in (self.groups[g] for s in sorted(stages) for g in self.groups_of_stage[s]):
            if group.shards == 1 and not writes_whole:
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
