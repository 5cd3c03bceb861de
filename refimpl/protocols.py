"""What every trainer provides: the interface that train, verify, checkpoints and the memory ledger use.

Two classes implement all of it: local_trainer.LocalTrainer (one process, the reference every distributed
run is compared with; it imports nothing from refimpl.parallel) and parallel.trainer.Trainer
(every distributed configuration). A trainer of your own (`verify --trainer MODULE:FUNCTION`,
docs/verify_your_algorithm.md) needs only `Verifiable`'s members.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Verifiable(Protocol):
    """What verify reads and sets."""

    world_size: int  # ranks taking part
    rank: int  # this rank, 0..world_size-1
    record_grads: bool  # set by verify: keep the next step's whole gradients in last_grads
    last_grads: dict  # {name: NumPy array}: the last step's gradients as the optimizer used them (rank 0)

    def step(self, x, y) -> float:
        """One optimizer step on the global batch (every rank passes the same x, y); the batch's loss."""

    def full_parameters(self) -> dict:
        """{name: NumPy array} of the whole model, at least on rank 0 (collective)."""

    def report(self) -> dict:
        """Plain facts for --json (local: no communication)."""


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


def missing(trainer, protocol) -> list[str]:
    """The members of `protocol` that `trainer` lacks (for a clear error)."""
    members = [name for name in dir(protocol) if not name.startswith("_")]
    members += list(getattr(protocol, "__annotations__", {}))
    for base in protocol.__mro__[1:]:
        members += list(getattr(base, "__annotations__", {}))
    return sorted({name for name in members if not hasattr(trainer, name)})
