"""What every ZeRO stage holds besides its step: ledger, loss scaler, flat groups, optimizer, records.

A stage (stage0.py ... stage3.py; what each keeps is the table of __init__.py) is a gradient
strategy over the data-parallel group of N ranks. parallel/trainer.py hands it the pipeline stages
this rank holds (the whole model without a pipeline) and, in every optimizer step, calls

    around(action, last)     around each F, B, I or W of the micro-batch loop (a context manager;
                             last: the pipeline stage's last backward of the step)
    finish()                 after the loop: this rank's reduced gradient block of every group
    optimizer_step(blocks)   the sharded optimizer step (optimizer.py); returns its StepResult
    end_step(result)         zero the gradients; publish the updated parameters if the step was taken

Each stage states those, in the order they run, in its own file. ZeroStrategy, the class they
subclass, holds what does not depend on the stage -- the memory ledger and loss scaler it sets up,
the flat groups per pipeline stage, the sharded optimizer, and the records that verify, --json and
sharded checkpoints read -- and calls nothing a stage defines.

Legend: L a group's padded length (flat.py), N ranks, L/N one rank's block.
"""

from __future__ import annotations

from refimpl import backend
from refimpl.memory import MemoryLedger
from refimpl.optim.precision import LossScaler, storage_dtype

from .optimizer import ShardedOptimizer


class ZeroStrategy:
    """The part of a ZeRO stage that is not its step (see the module docstring).

    parts      the pipeline stages this rank holds ({index: stage}, each with named_parameters());
               one part, the whole model, without a pipeline
    comm       the data-parallel group over which the state is sharded
    norm_total / any_rank  how the global gradient norm and the overflow vote are combined over
               the ranks that do not share this rank's stages (the pipeline, the tensor-parallel
               group); None: nothing to add
    uncounted  names of parameters whose gradient norm another rank counts (optimizer.py)
    ledger     a memory ledger to share (expert parallelism's two strategies), else a new one
    """

    stage: int = -1

    def __init__(self, parts: dict, comm, precision: str = "float32", clip: float = 0.0, budget: int | None = None,
                 rank: int | None = None, norm_total=None, any_rank=None, uncounted=(), ledger=None) -> None:
        self.parts, self.comm, self.precision = parts, comm, precision
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
        self._optimizer_options = dict(clip=clip, scaler=self.scaler, norm_total=norm_total, any_rank=any_rank,
                                       uncounted=uncounted, masters=precision in ("mixed", "bf16"))
        self.groups, self.groups_of_stage = [], {}

    def _lay_out(self, make_groups) -> None:
        """self.groups: every pipeline stage's flat groups, make_groups(named, first_index) -> [FlatGroup]."""
        for s in sorted(self.parts):
            made = make_groups(self.parts[s].named_parameters(), len(self.groups))
            self.groups_of_stage[s] = [group.index for group in made]
            self.groups += made

    def _sharded_optimizer(self, optimizer, param_blocks: list, sharded: bool = True) -> ShardedOptimizer:
        """Master weights and optimizer state of this rank's block of every group (optimizer.py)."""
        return ShardedOptimizer(optimizer, self.groups, param_blocks, self.ledger, self.comm, sharded=sharded,
                                **self._optimizer_options)

    def squared_norm(self, blocks: list) -> float:
        return self.optimizer.squared_norm(blocks)

    # -- records ------------------------------------------------------------------------------------
    def gather_by_name(self, blocks: list) -> dict:
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

    def _arrays_by_name(self, flats: list) -> dict:
        """{name: NumPy array} of this rank's stages, in the model's order, from every group's whole buffer (L,).

        A stage's whole_parameters() returns this, or under mixed precision the float32 master weights
        (whole(optimizer.masters)): the parameters the optimizer holds, which verify compares.
        """
        arrays = {}
        for group, flat in zip(self.groups, flats):
            for name, view in zip(group.names, group.views(flat)):
                arrays[name] = backend.to_host(view).copy()
        return {name: arrays[name] for name, _ in self.named}

    def whole_optimizer_state(self) -> dict:
        """{"step", "arrays": {state key: {name: whole array}}, "loss_scaler"} (collective when sharded)."""
        keys = self.optimizer.state_arrays(0).keys() if self.groups else ()
        arrays = {key: self.gather_by_name([self.optimizer.state_arrays(g.index)[key] for g in self.groups])
                  for key in keys}
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

    # -- checkpoints (refimpl/tools/saved_runs/sharded.py) -------------------------------------------
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

    def _load_blocks(self, masters: dict, states: dict, step: int) -> None:
        """This rank's blocks of master weights, parameters and optimizer state from whole flattened arrays
        by name; a stage's load_full_state() then publishes the parameters as after a step."""
        xp = backend.xp()
        for group in self.groups:
            lo, hi = (0, group.length) if group.shards == 1 else (group.start, group.stop)
            master = self.optimizer.masters[group.index]
            block = group.flatten([masters[n] for n in group.names], dtype=master.dtype)[lo:hi]
            state = {key: group.flatten([states[key][n] for n in group.names], dtype=value.dtype)[lo:hi]
                     for key, value in self.optimizer.state_arrays(group.index).items()}
            self.optimizer.load_group(group.index, xp.asarray(block), state, step)
