"""Checkpointing plans for a chain of n layers: none, every:K, sqrt, revolve:C, budget:BYTES.

A plan is written as a string (on the command line, in a config) and turned into a schedule of
actions (actions.py) for a given n. Costs below are for n equal layers whose recorded forward saves
R bytes and whose input (one state x_i) is A bytes; "extra forwards" are the layer forwards
beyond the n that any backward needs (see actions.py: every layer is recorded exactly once).

    none         no checkpointing: every layer recorded in the forward pass.
                 extra 0, peak n·R.
    every:K      segments of K layers, counted from the end of the chain (the first segment takes
                 the remainder, m = ⌈n/K⌉ segments). The forward pass keeps each segment's input
                 and runs the last segment recorded; backward re-runs each earlier segment,
                 recorded, from its kept input, and backpropagates through it.
                 extra n − K (each layer outside the last segment runs once more), peak
                 (m − 1)·A + K·R (the kept inputs plus one recorded segment).
    sqrt         every:K with K = ⌈√n⌉ (Chen et al., arXiv 1604.06174, section 4.1: the n/K + K
                 stored states are fewest at K = √n). The variant implemented is "re-run each
                 segment whole, except the last, which the forward pass keeps recorded":
                 exactly n − ⌈√n⌉ extra forwards (fewer than one per layer) and, for a layer that
                 saves only its input (R = A), a peak of ⌈n/K⌉ − 1 + K ≈ 2√n states. (Re-running
                 every segment, the last included, as Chen et al.'s Algorithm 1 and PyTorch's
                 reentrant checkpoint do, would cost n extra forwards; recomputing only the
                 missing inputs, n − n/K, needs a backward that runs without its layer's recorded
                 graph, which an autograd engine does not have.)
    revolve:C    Griewank's binomial schedule with C snapshot slots (revolve.py):
                 extra t(n, C) = r·n − β(C + 1, r − 1), the minimum; peak C·A + R at most.
    budget:B     the plan with the fewest extra forwards whose predicted peak of the chain's saved
                 bytes is at most B (ties: the smaller peak). Candidates: none, every:K for all K,
                 revolve:C for all useful C. B accepts a suffix: 64MiB, 2GB, 512KiB...

Selective recomputation (Korthikanti et al. 2022, arXiv 2205.05198, §5) works inside a layer, not
on the chain: `selective` recomputes only each transformer block's attention core (scores,
softmax, its dropout, the product with V: the tensors that grow with T²), keeping everything
else; `selective+PLAN` (e.g. selective+every:2) combines it with a chain plan: the chain plan
decides which blocks are recomputed whole, and every block that is recorded (in the forward pass,
or when a segment is re-recorded in backward) keeps only its core's inputs q, k, v. The chain
functions below (actions_for, predicted_cost, ...) see the chain plan; gpt_blocks.py installs both.

Automatic selection (Salimans and Bulatov's gradient-checkpointing package) works on the graph of
the blocks' operations, not on the chain: `auto:memory` keeps about √m of the graph's m
articulation points, `auto:speed` the outputs of matrix products (auto.py, graph.py).

The peak of a plan is predicted by simulating its actions (actions.simulate_chain) with the layer's
measured A, R and whether it saves its input array (LayerCost); the tests check the prediction
against the engine's ledger.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from . import revolve
from .actions import Advance, Backprop, Free, Record, Restore, Snapshot, simulate_chain

PLAN_FORMS = "none, sqrt, every:K, revolve:C, budget:BYTES, selective, selective+PLAN, auto:memory, auto:speed"
AUTO_RULES = ("memory", "speed")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclass(frozen=True)
class NoCheckpoint:
    def __str__(self) -> str:
        return "none"


@dataclass(frozen=True)
class Every:
    k: int

    def __str__(self) -> str:
        return f"every:{self.k}"


@dataclass(frozen=True)
class SqrtSegments:
    def __str__(self) -> str:
        return "sqrt"


@dataclass(frozen=True)
class Revolve:
    slots: int

    def __str__(self) -> str:
        return f"revolve:{self.slots}"


@dataclass(frozen=True)
class Budget:
    bytes: int

    def __str__(self) -> str:
        return f"budget:{self.bytes}"


@dataclass(frozen=True)
class Selective:
    """Attention cores recomputed in every recorded block; `blocks`: the chain plan beside it."""

    blocks: object = NoCheckpoint()

    def __str__(self) -> str:
        return "selective" if isinstance(self.blocks, NoCheckpoint) else f"selective+{self.blocks}"


@dataclass(frozen=True)
class Auto:
    """Automatic selection on the graph of the blocks' operations (auto.py): rule memory or speed."""

    rule: str

    def __str__(self) -> str:
        return f"auto:{self.rule}"


def chain_plan(plan):
    """The plan of the chain of blocks (a Selective plan's `blocks`; any other plan itself)."""
    plan = parse_plan(plan)
    return plan.blocks if isinstance(plan, Selective) else plan


@dataclass(frozen=True)
class LayerCost:
    """The memory model of one layer: A = input_bytes, R = own_bytes + (A if saves_input)."""

    input_bytes: int  # one state x_i
    own_bytes: int  # what a recorded forward saves besides its input array
    saves_input: bool  # whether the recorded forward also saves the input array itself

    @property
    def recorded_bytes(self) -> int:
        return self.own_bytes + (self.input_bytes if self.saves_input else 0)


def parse_plan(text) -> object:
    """'none' | 'sqrt' | 'every:K' | 'revolve:C' | 'budget:BYTES' -> a plan object (plans pass through)."""
    if isinstance(text, (NoCheckpoint, Every, SqrtSegments, Revolve, Budget, Selective, Auto)):
        return text
    if not isinstance(text, str):
        raise TypeError(f"a checkpointing plan is a string ({PLAN_FORMS}), got {type(text).__name__}")
    head, plus, rest = text.strip().partition("+")
    if head.lower() == "selective":
        if plus and not rest.strip():
            raise ValueError(f"checkpointing plan {text!r}: name the chain plan after '+', as in selective+every:2")
        blocks = parse_plan(rest) if plus else NoCheckpoint()
        if isinstance(blocks, Selective):
            raise ValueError(f"checkpointing plan {text!r}: selective appears twice")
        if isinstance(blocks, Auto):
            raise ValueError(f"checkpointing plan {text!r}: an auto plan chooses its own checkpoints; use it alone")
        return Selective(blocks)
    name, _, arg = text.strip().partition(":")
    name = name.lower()
    if name == "auto":
        rule = arg.strip().lower()
        if rule not in AUTO_RULES:
            raise ValueError(f"checkpointing plan {text!r}: unknown rule {arg.strip()!r}; choose auto:memory (about √n "
                             "articulation points) or auto:speed (outputs of matrix products)")
        if head.lower() != text.strip().lower():
            raise ValueError(f"checkpointing plan {text!r}: an auto plan chooses its own checkpoints; use it alone")
        return Auto(rule)
    if name in ("none", "sqrt"):
        if arg:
            raise ValueError(f"checkpointing plan {name!r} takes no argument, got {text!r}")
        return NoCheckpoint() if name == "none" else SqrtSegments()
    if name in ("every", "revolve"):
        what = "K (layers per segment)" if name == "every" else "C (snapshot slots)"
        try:
            value = int(arg)
        except ValueError:
            raise ValueError(f"checkpointing plan {text!r}: {what} must be an integer, as in {name}:4") from None
        if value < 1:
            raise ValueError(f"checkpointing plan {text!r}: {what} must be at least 1, got {value}")
        return Every(value) if name == "every" else Revolve(value)
    if name == "budget":
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", arg)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"checkpointing plan {text!r}: the budget must be a number of bytes, "
                             "optionally with a unit (B, KB, MB, GB, KiB, MiB, GiB), as in budget:64MiB")
        value = int(float(match.group(1)) * _UNITS[unit])
        if value < 1:
            raise ValueError(f"checkpointing plan {text!r}: the budget must be positive")
        return Budget(value)
    raise ValueError(f"unknown checkpointing plan {text!r}; choose one of {PLAN_FORMS}")


def sqrt_segment(n: int) -> int:
    """K = ⌈√n⌉, the segment length of the sqrt plan."""
    return math.isqrt(n - 1) + 1 if n > 1 else 1


def segment_actions(n: int, k: int) -> list:
    """The every:K schedule (see the module docstring)."""
    k = min(k, n)
    m = math.ceil(n / k)
    first = n - (m - 1) * k  # the first segment takes the remainder: 1 <= first <= k
    bounds = [0] + [first + i * k for i in range(m)]  # 0 < first < first + k < ... < n
    segments = list(zip(bounds[:-1], bounds[1:]))
    actions = []
    for a, b in segments[:-1]:
        actions += [Snapshot(a), Advance(a, b)]
    a, b = segments[-1]
    if a == 0:
        actions.append(Snapshot(0))
    actions += [Record(a, b), Backprop(a, b)]
    for a, b in reversed(segments[:-1]):
        actions += [Restore(a), Record(a, b), Backprop(a, b), Free(a)]
    if segments[-1][0] == 0:
        actions.append(Free(0))
    return actions


def actions_for(plan, n: int) -> list | None:
    """The schedule of a concrete plan for n layers; None for `none` (no checkpointing at all)."""
    plan = chain_plan(plan)
    if isinstance(plan, NoCheckpoint):
        return None
    if isinstance(plan, Every):
        return segment_actions(n, plan.k)
    if isinstance(plan, SqrtSegments):
        return segment_actions(n, sqrt_segment(n))
    if isinstance(plan, Revolve):
        return revolve.plan(n, plan.slots)
    if isinstance(plan, Auto):
        raise ValueError(f"{plan} chooses checkpoints on the graph of operations (auto.py), not as a chain schedule")
    raise ValueError(f"{plan} must be resolved with resolve_budget before it has a schedule")


def predicted_cost(plan, n: int, cost: LayerCost) -> tuple[int, int]:
    """(extra forwards, peak saved bytes of the chain) of a concrete plan, from its schedule."""
    actions = actions_for(plan, n)
    if actions is None:
        return 0, n * cost.recorded_bytes
    s = simulate_chain(actions, n, input_bytes=cost.input_bytes, own_bytes=cost.own_bytes, saves_input=cost.saves_input)
    return s.advances, s.peak_bytes


def resolve_budget(budget: int, n: int, cost: LayerCost):
    """The concrete plan with the fewest extra forwards whose predicted peak fits in `budget` bytes."""
    fits = []  # (extra forwards, peak bytes, preference, plan)
    for rank, plan in enumerate([NoCheckpoint()] + [Every(k) for k in range(1, n + 1)]):
        extra, peak = predicted_cost(plan, n, cost)
        if peak <= budget:
            fits.append((extra, peak, rank, plan))
    # revolve: more slots, fewer advances, more memory. The largest fitting C is found by
    # bisection (its peak grows with C; the tests check that on small chains).
    low, high = 1, max(1, n - 1)  # C >= n - 1 already reaches t = n - 1
    if predicted_cost(Revolve(1), n, cost)[1] <= budget:
        while low < high:
            mid = (low + high + 1) // 2
            if predicted_cost(Revolve(mid), n, cost)[1] <= budget:
                low = mid
            else:
                high = mid - 1
        extra, peak = predicted_cost(Revolve(low), n, cost)
        fits.append((extra, peak, n + 1, Revolve(low)))
    if not fits:
        smallest = min((predicted_cost(p, n, cost)[1], str(p)) for p in (Revolve(1), Every(1)))
        raise ValueError(f"checkpointing budget of {budget} bytes: no plan fits a chain of {n} layers "
                         f"(input {cost.input_bytes} B, recorded layer {cost.recorded_bytes} B); "
                         f"the smallest, {smallest[1]}, needs {smallest[0]} bytes")
    return min(fits, key=lambda f: f[:3])[3]
