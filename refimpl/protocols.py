"""The interfaces of the core: what every trainer provides, and what a gradient strategy provides.

A trainer is what train, verify, checkpoints and the memory ledger use; a gradient strategy is one
layer of the distributed trainer (parallel/trainer.py): data parallelism or a ZeRO stage.

Two classes implement all of it: local_trainer.LocalTrainer (one process, the reference every distributed
run is compared with; it imports nothing from refimpl.parallel) and parallel.trainer.Trainer
(every distributed configuration). A trainer of your own (`verify --trainer MODULE:FUNCTION`,
docs/verify_your_algorithm.md) needs only `Verifiable`'s members, and `MixedPrecisionVerifiable`'s
for `verify --dtype mixed`; `HoldsReplica`'s `local_records()` is optional (verify then checks
the copy every rank holds, not only the whole model rank 0 returns).

IMPLEMENTATION_FLAGS are the flags of `train` and `verify` that choose *how* a step is computed,
not *what* it computes: a trainer that ignores one of them still computes the same numbers, so
comparing numbers cannot tell whether it honoured it. A trainer therefore declares the ones it
implements (`implements`), and verify refuses the others. The other flags (the model, the data,
the optimizer, clipping, dropout, --dtype float32/float64, --collectives, which is verify's own
communicator) define the computation itself, and the comparison checks that a trainer honours them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

IMPLEMENTATION_FLAGS = (
    "--grad-accum", "--dp-mode", "--bucket-bytes",  # data parallelism: micro-batches, DDP's reduction
    "--zero", "--prefetch", "--param-threshold",  # ZeRO stages
    "--dtype",  # --dtype mixed or bf16: 16-bit storage, float32 master weights (float32/float64 need nothing)
    "--checkpoint",  # activation checkpointing (recomputation)
    "--pp", "--schedule", "--micro-batches", "--chunks", "--no-overlap",  # pipelines
    "--tp", "--sequence-parallel", "--partition-activations",  # tensor and sequence parallelism
    "--cp", "--cp-impl",  # context parallelism
    "--ep",  # expert parallelism
    "--mem-budget", "--action-costs", "--trace",  # the memory ledger, the pipeline's pacing and trace
)


@runtime_checkable
class Verifiable(Protocol):
    """What verify reads and sets."""

    world_size: int  # ranks taking part
    rank: int  # this rank, 0..world_size-1
    record_grads: bool  # set by verify: keep the next step's whole gradients in last_grads
    last_grads: dict  # {name: NumPy array}: the last step's gradients as the optimizer used
    # them: the whole model's on rank 0, on other ranks those it holds whole (as full_parameters)
    implements: frozenset  # the IMPLEMENTATION_FLAGS it honours, e.g. {"--grad-accum"}; verify refuses the others

    def step(self, x, y) -> float:
        """One optimizer step on the global batch (every rank passes the same x, y); the batch's loss."""

    def full_parameters(self) -> dict:
        """{name: NumPy array} of the whole model on rank 0 (collective); on every other rank the
        parameters it holds whole ({} if none): verify compares every rank's with the reference."""

    def report(self) -> dict:
        """Plain facts for --json, nested under "trainer_report" (local: no communication; verify
        calls it once, at the end). Nothing in it changes verify's verdict."""


@runtime_checkable
class HoldsReplica(Verifiable, Protocol):
    """Optional: what verify also reads where a trainer has it. full_parameters() and last_grads
    give rank 0 the whole model, gathered from one copy of each piece (refimpl's pipelines take
    data-parallel replica 0's stages), and the other ranks return what they hold whole, or nothing;
    local_records() gives every rank's own copy, so that a replica that steps wrongly cannot hide
    behind another one's."""

    def local_records(self) -> dict:
        """{"parameters": {name: array}, "gradients": {name: array}} (collective): this rank's own
        parameters and the last step's gradients (with record_grads), whole and by the whole model's
        names, of the part of the model it holds (slices or shards joined with those of the ranks it
        shares them with). verify checks each against rank 0's tensor of the same name (a hash), and
        one that differs against the reference."""


@runtime_checkable
class MixedPrecisionVerifiable(Verifiable, Protocol):
    """What `verify --dtype mixed` (or bf16) also reads: its comparison runs in lockstep (tools/compare_mixed.py)."""

    optimizer_steps: int  # optimizer steps taken: a step that does not advance it was skipped (overflow)

    def full_optimizer_state(self) -> dict:
        """{"step", "arrays": {state key: {name: array}}, "loss_scaler": LossScaler.state_dict()} on
        rank 0 (collective): the float32 optimizer state the reference takes before the next step."""


@runtime_checkable
class Checkpointable(Verifiable, Protocol):
    """What train, sharded checkpoints (saved_runs/sharded.py) and the memory report also need."""

    steps_done: int  # the global batch's number: dropout masks are keyed by it (nn/batch_rows.py)
    optimizer_steps: int  # optimizer steps taken (a skipped mixed-precision step is not one)
    scaler: Any  # mixed precision's LossScaler, or None
    ledger: Any  # the MemoryLedger of this rank's model state and activations (memory.py)

    def checkpoint_pieces(self) -> list:
        """[(name, start, stop, {"master": array, state key: array})]: this rank's share of a checkpoint."""

    def model_for_evaluation(self, model, build):
        """The model this rank evaluates after training (collective), or None: `model` itself when
        the rank holds all of it, else rank 0 loads the whole trained parameters into build()."""

    def load_full_state(self, masters: dict, states: dict, step: int) -> None:
        """Take master weights and optimizer state, whole and by name, as a checkpoint holds them."""


@runtime_checkable
class GradientStrategy(Protocol):
    """How the data-parallel group shares gradients, optimizer state and parameters: DDP
    (parallel/data_parallel.py) or a ZeRO stage (parallel/zero/). The trainer calls, in this order:

        around(action, last)      a context around every F, B, I or W of the micro-batch loop; it
                                  installs the hooks that gather parameters (ZeRO-3) and start a
                                  group's reduction when its last gradient is in; `last`: this B or W
                                  is its stage's last of the step
        finish()                  after the loop: the reduced gradient blocks (whole or this rank's shard)
        squared_norm(blocks)      their contribution to the global norm (for clipping)
        optimizer_step(blocks, total)   update (total: the global squared norm, or None)
        end_step(result)          publish the updated parameters (ZeRO-1/2's all-gather)

    and, for records and checkpoints: gather_by_name(blocks) and whole_parameters() (by name, collective),
    whole_optimizer_state(), steps_taken, report(), checkpoint_pieces(stages, writes_whole),
    load_full_state(masters, states, step), and its ledger.
    """

    ledger: Any  # the MemoryLedger of the state it holds (memory.py)

    def around(self, action, last: bool):
        """A context manager around one action of the micro-batch loop."""

    def finish(self) -> list:
        """The gradient blocks, reduced over the data-parallel group, once the loop is done."""

    def squared_norm(self, blocks: list) -> float:
        """This rank's share of the squared global gradient norm."""

    def optimizer_step(self, blocks: list, total: float | None = None):
        """Update this rank's parameters (or shard of them); returns a StepResult."""

    def end_step(self, result) -> None:
        """Make every rank's parameters current (an all-gather where they are sharded)."""

    def gather_by_name(self, blocks: list) -> dict:
        """{name: whole array} of gradient blocks (collective)."""

    def whole_parameters(self) -> dict:
        """{name: whole array} of the parameters (collective)."""

    def report(self) -> dict:
        """Plain facts for --json."""

    def checkpoint_pieces(self, stages, writes_whole: bool) -> list:
        """[(name, start, stop, arrays)]: this rank's share of a checkpoint of `stages`."""

    def load_full_state(self, masters: dict, states: dict, step: int) -> None:
        """Take master weights and optimizer state, whole and by name."""


def missing(trainer, protocol) -> list[str]:
    """The members of `protocol` that `trainer` lacks (for a clear error)."""
    members = [name for name in dir(protocol) if not name.startswith("_")]
    members += list(getattr(protocol, "__annotations__", {}))
    for base in protocol.__mro__[1:]:
        members += list(getattr(base, "__annotations__", {}))
    return sorted({name for name in members if not hasattr(trainer, name)})
