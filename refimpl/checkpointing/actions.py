"""A checkpointing schedule as data: the actions that reverse a chain, and their simulation.

A chain of n layers maps x_0 → x_1 → … → x_n; layer k computes x_k from x_(k-1). Its backward
needs, for every layer k, a *recorded* forward of layer k (run with grad, its saved tensors kept)
from x_(k-1). A schedule says when each state is computed, kept or dropped:

    Snapshot(i)        keep x_i (the state in hand) in a snapshot slot
    Free(i)            drop the snapshot of x_i
    Restore(i)         take the snapshot of x_i in hand
    Advance(i, j)      run layers i+1..j without grad (nothing saved); x_j in hand
    Record(i, j)       run layers i+1..j with grad (their saved tensors kept); x_j in hand
    Backprop(i, j)     pull the gradient of x_j back to x_i through the recorded layers i+1..j,
                       releasing their saved tensors

Every plan (plans.py, revolve.py) is a function from n to such a list, and one executor
(executor.py) runs any list inside the autograd engine: the actions before the first Backprop are
the forward pass (they end with layer n recorded, so its output is the chain's output), the rest
run during backward. `simulate_chain` checks a list and counts what it costs, from the actions alone:

    advances      layer forwards without grad: the recomputations (every layer is recorded
                  exactly once in every valid schedule, so total forwards = n + advances)
    peak_bytes    the largest sum of distinct saved arrays, for a layer model of
                  input_bytes (A, one state x_i), own_bytes (what a recorded layer saves besides
                  its input) and saves_input (whether it also saves its input array)

The executor measures the same quantities independently (a counter inside each layer, the
engine's saved-tensor ledger); the tests check that the two agree.

The vocabulary follows Griewank & Walther's revolve (ACM TOMS 2000: takeshot, restore, advance,
firsturn/youturn), with the adjoint step split in two, Record and Backprop, because an autograd
engine records a layer's graph in one call and differentiates it in another.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Snapshot:
    at: int


@dataclass(frozen=True)
class Free:
    at: int


@dataclass(frozen=True)
class Restore:
    at: int


@dataclass(frozen=True)
class Advance:
    start: int
    stop: int


@dataclass(frozen=True)
class Record:
    start: int
    stop: int


@dataclass(frozen=True)
class Backprop:
    start: int
    stop: int


def forward_part(actions: list) -> int:
    """Number of actions run in the forward pass: everything before the first Backprop."""
    for index, action in enumerate(actions):
        if isinstance(action, Backprop):
            return index
    raise ValueError("a schedule needs at least one Backprop")


@dataclass(frozen=True)
class Summary:
    n: int
    advances: int  # layer forwards without grad (recomputations)
    records: int  # layer forwards with grad (exactly n in a valid schedule)
    max_snapshots: int  # most snapshot slots held at once
    peak_bytes: int  # predicted peak of the chain's saved bytes (the layer model of simulate_chain)
    forward_actions: int  # actions run in the forward pass

    @property
    def forward_calls(self) -> int:
        return self.advances + self.records


def simulate_chain(actions: list, n: int, *, input_bytes: int = 1, own_bytes: int = 0,
                   saves_input: bool = True) -> Summary:
    """Check that `actions` reverse a chain of n layers; count advances and predict peak bytes.

    Arrays are tracked by identity, as the engine's ledger counts them: a restored snapshot is the
    same array as the snapshot; every Advance or Record makes new ones. The chain's input x_0 is
    held by the chain's node for the whole step. Raises ValueError on an invalid schedule.
    """
    if n < 1:
        raise ValueError(f"a chain needs at least one layer, got n={n}")
    fresh = iter(range(1, 10**12))
    hand = (0, 0)  # (position, array id); x_0 is array 0
    snapshots: dict[int, int] = {}  # position -> array id
    recorded: tuple | None = None  # (start, stop, ids of the recorded layers' input arrays)
    grad_at = n
    advances = records = max_snap = peak = 0
    backpropped: set[int] = set()
    n_forward = forward_part(actions)

    def fail(index, action, why):
        raise ValueError(f"invalid schedule at action {index} {action}: {why}")

    for index, a in enumerate(actions):
        if isinstance(a, Snapshot):
            if hand is None or hand[0] != a.at or a.at in snapshots:
                fail(index, a, f"the state in hand is not x_{a.at}, or it is already kept")
            snapshots[a.at] = hand[1]
        elif isinstance(a, Free):
            if a.at not in snapshots:
                fail(index, a, "no such snapshot")
            del snapshots[a.at]
        elif isinstance(a, Restore):
            if a.at not in snapshots:
                fail(index, a, "no such snapshot")
            hand = (a.at, snapshots[a.at])
        elif isinstance(a, (Advance, Record)):
            if hand is None or hand[0] != a.start or not a.start < a.stop <= n:
                fail(index, a, f"the state in hand is not x_{a.start}, or the range is empty")
            if isinstance(a, Record):
                if recorded is not None:
                    fail(index, a, "layers are already recorded and not yet backpropagated")
                inputs = [hand[1]] + [next(fresh) for _ in range(a.stop - a.start - 1)]
                recorded = (a.start, a.stop, inputs)
                records += a.stop - a.start
            else:
                advances += a.stop - a.start
            hand = (a.stop, next(fresh))
        elif isinstance(a, Backprop):
            if recorded is None or recorded[:2] != (a.start, a.stop) or grad_at != a.stop:
                fail(index, a, f"these layers are not recorded, or the gradient is not at x_{a.stop}")
            backpropped.update(range(a.start + 1, a.stop + 1))
            recorded, grad_at, hand = None, a.start, None
        else:
            fail(index, a, "unknown action")
        if index < n_forward and isinstance(a, Backprop):
            fail(index, a, "internal: forward part contains a Backprop")
        max_snap = max(max_snap, len(snapshots))
        held = {0} | set(snapshots.values())  # x_0 is saved by the chain's node
        n_recorded = 0
        if recorded is not None:
            n_recorded = recorded[1] - recorded[0]
            if saves_input:
                held |= set(recorded[2])
        peak = max(peak, len(held) * input_bytes + n_recorded * own_bytes)
        if index == n_forward - 1 and (hand is None or hand[0] != n or recorded is None or recorded[1] != n):
            fail(index, a, "the forward part must end with layer n recorded (its output is the chain's output)")
    if grad_at != 0 or snapshots or recorded is not None or backpropped != set(range(1, n + 1)):
        raise ValueError("invalid schedule: it must end with the gradient at x_0, every layer "
                         "backpropagated once and no snapshot left")
    if records != n:
        raise ValueError(f"invalid schedule: {records} layer recordings for {n} layers")
    return Summary(n, advances, records, max_snap, peak, n_forward)
