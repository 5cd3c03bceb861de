"""The memory ledger (bytes actually held, by category) and the ZeRO paper's estimator.

Two views of the same question -- how many bytes does each rank hold? -- kept apart on purpose:

  * MemoryLedger counts arrays that exist. A trainer registers an array when it allocates it and
    releases it when it frees it; the ledger sums their `nbytes`, per category, and keeps the
    peak of every category and of the total. Saved activations come from the autograd engine's
    own ledger (refimpl.autograd.saved_tensors), read when the ledger is asked. Nothing here is
    computed from a formula.
  * The estimator is the formula of the ZeRO paper (Rajbhandari et al., arXiv 1910.02054,
    section 5 and Table 1): for Ψ parameters, N data-parallel ranks, P and G bytes per parameter
    and gradient element and K bytes of optimizer state per parameter,

        DP      (P + G + K) Ψ                 mixed-precision Adam: P = 2, G = 2, K = 12
        ZeRO-1  (P + G) Ψ + K Ψ / N           (K = 4 fp32 master + 4 momentum + 4 variance)
        ZeRO-2  P Ψ + (G + K) Ψ / N           float32 Adam: P = 4, G = 4, K = 8
        ZeRO-3  (P + G + K) Ψ / N             float64 Adam: P = 8, G = 8, K = 16

    and communication per rank per optimizer step, in elements, on a ring (section 7), with g
    micro-batches per step (gradient accumulation; refimpl's rule for each stage):

        DP      2Ψ(N−1)/N                      one all-reduce after the last micro-batch
        ZeRO-1  2Ψ(N−1)/N                      reduce-scatter once + all-gather once
        ZeRO-2  (g + 1)Ψ(N−1)/N                reduce-scatter every micro-batch (only a shard of
                                               the gradient is kept) + all-gather once
        ZeRO-3  3gΨ(N−1)/N                     all-gather in forward and in backward and
                                               reduce-scatter, every micro-batch

The two views meet in the tests: for every stage and precision the ledger's model-state bytes
(parameters + gradients + master weights + optimizer states) equal the formula evaluated at the
padded Ψ' (each flat buffer is padded to a multiple of N: at most N−1 elements per buffer).

Categories of the ledger (the first four are model state, the paper's "model states"):

    parameters           the parameters a rank holds between steps (whole, or its shard)
    gradients            persistent gradients (whole for DP and ZeRO-1, a shard for ZeRO-2/3)
    master_weights       float32 copies of the shard (mixed precision only)
    optimizer_states     Adam's m and v (SGD's momentum) for the shard
    gathered_parameters  ZeRO-3: whole parameters of a module, gathered for its forward/backward
    gradient_buckets     transient gradient buffers: a bucket being filled or reduced, the output
                         of a reduce-scatter, float32 unscaled gradients during a mixed step
    activations          tensors saved for backward (the autograd engine's saved-tensor ledger)

A budget (bytes per rank) turns the ledger into a simulated device: an allocation that would take
the total above the budget raises OutOfMemoryBudget, naming the category that overflowed.

Also here: parse_count("7.5B"), parse_bytes("200MB") and format_gb (decimal GB, as the paper).
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal

from refimpl.autograd.saved import saved_tensors as _saved_tensors

CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states",
              "gathered_parameters", "gradient_buckets", "activations")
MODEL_STATE = CATEGORIES[:4]
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
STAGE_FORMULAS = {0: "(P+G+K)Ψ", 1: "(P+G)Ψ + KΨ/N", 2: "PΨ + (G+K)Ψ/N", 3: "(P+G+K)Ψ/N"}
COMM_FORMULAS = {0: "2Ψ(N-1)/N", 1: "2Ψ(N-1)/N", 2: "(g+1)Ψ(N-1)/N", 3: "3gΨ(N-1)/N"}
# Bytes per parameter (P, G, K) for Adam: parameters, gradients, optimizer state (+ fp32 master).
PRECISIONS = {"mixed": (2, 2, 12), "float32": (4, 4, 8), "float64": (8, 8, 16)}


class OutOfMemoryBudget(ValueError):
    """An allocation would exceed the per-rank memory budget (--mem-budget)."""


# ------------------------------------------------------------------------------------------------
# The ledger
# ------------------------------------------------------------------------------------------------


class MemoryLedger:
    """Bytes held by one rank, by category: current, peak, and an optional budget.

        ledger.register("optimizer_states", m)   # m was just allocated; returns m
        ledger.release(m)                         # m is about to be dropped
        ledger.current()  /  ledger.peak()        # {category: bytes}, activations included
    """

    def __init__(self, budget: int | None = None, rank: int = 0, activations=_saved_tensors) -> None:
        if budget is not None and budget <= 0:
            raise ValueError(f"--mem-budget must be positive, got {budget}")
        self.budget, self.rank = budget, rank
        self._activations = activations
        self._held: dict[int, tuple[str, object]] = {}  # id(array) -> (category, array)
        self._bytes = dict.fromkeys(CATEGORIES[:-1], 0)
        self._peak = dict.fromkeys(CATEGORIES, 0)
        self._peak_total = 0

    # -- allocation and release ---------------------------------------------------------------
    def register(self, category: str, array, what: str = ""):
        """Count `array` (just allocated) under `category`; raise OutOfMemoryBudget if it does not fit."""
        if category not in self._bytes:
            raise ValueError(f"unknown memory category {category!r}; choose one of {', '.join(CATEGORIES[:-1])}")
        if id(array) in self._held:
            raise ValueError(f"array already registered under {self._held[id(array)][0]}")
        if array.base is not None and any(array.base is held for _, held in self._held.values()):
            raise ValueError("a view of a registered array would be counted twice")
        self._check(category, array.nbytes, what)
        self._held[id(array)] = (category, array)
        self._bytes[category] += array.nbytes
        self._update_peaks()
        return array

    def release(self, array) -> None:
        """Stop counting `array` (the caller drops its last reference)."""
        self._update_peaks()  # the total just before the release may be a peak
        category, _ = self._held.pop(id(array))
        self._bytes[category] -= array.nbytes

    def holds(self, array) -> bool:
        return id(array) in self._held

    def check_activations(self) -> None:
        """Budget check after a forward pass, when saved activations are at their peak."""
        self._update_peaks()
        self._check("activations", 0, "saved for backward")

    # -- reading ------------------------------------------------------------------------------
    def current(self) -> dict:
        """{category: bytes held now}."""
        return {**self._bytes, "activations": self._activations.live_bytes}

    def peak(self) -> dict:
        """{category: largest bytes held at once} since construction or reset_peak()."""
        self._update_peaks()
        return dict(self._peak)

    @property
    def total(self) -> int:
        self._update_peaks()
        return sum(self.current().values())

    @property
    def peak_total(self) -> int:
        """The largest total seen when the ledger was touched: an allocation, a release, the check after a
        forward pass (when saved activations peak), a read. Each category's own peak is exact."""
        self._update_peaks()
        return self._peak_total

    def model_state(self) -> dict:
        """{category: bytes} of the four model-state categories, held now."""
        return {c: self._bytes[c] for c in MODEL_STATE}

    def reset_peak(self) -> None:
        now = self.current()
        self._peak = dict(now)
        self._peak_total = sum(now.values())

    def summary(self) -> dict:
        """JSON-ready: current and peak per category, totals, the budget."""
        return {"current": self.current(), "peak": self.peak(), "model_state": sum(self.model_state().values()),
                "peak_total": self.peak_total, "budget": self.budget}

    # -- internals ------------------------------------------------------------------------------
    def _update_peaks(self) -> None:
        now = self.current()
        for category, value in now.items():
            if value > self._peak[category]:
                self._peak[category] = value
        self._peak["activations"] = max(self._peak["activations"], self._activations.peak_bytes)
        self._peak_total = max(self._peak_total, sum(now.values()))

    def _check(self, category: str, nbytes: int, what: str) -> None:
        if self.budget is None:
            return
        now = self.current()
        total = sum(now.values()) + nbytes
        if total <= self.budget:
            return
        held = ", ".join(f"{c.replace('_', ' ')} {format_bytes(b)}" for c, b in now.items() if b)
        adding = f"allocating {format_bytes(nbytes)} of {category.replace('_', ' ')}" if nbytes else \
            f"{format_bytes(now[category])} of {category.replace('_', ' ')}"
        need, cap = format_bytes(total), format_bytes(self.budget)
        if need == cap:  # rounded alike: show the bytes
            need, cap = f"{total:,} B", f"{self.budget:,} B"
        raise OutOfMemoryBudget(
            f"out of memory on rank {self.rank}: {adding}{' (' + what + ')' if what else ''} needs "
            f"{need} in all, over the budget of {cap} (--mem-budget); held: {held or 'nothing'}")


def track_replicated(params, optimizer, budget: int | None = None, rank: int = 0, ledger=None) -> MemoryLedger:
    """A ledger for a trainer that keeps everything whole on every rank (single process or DDP).

    The caller checks the activations against the budget after each forward (ledger.check_activations).

    Registers each parameter's array, each gradient (allocating zeros where backward has not yet
    created one: accumulation then adds into it, the same numbers), and the optimizer's state
    arrays. A gradient that is a view into a flat bucket is counted through its bucket, once.
    """
    from refimpl import backend  # noqa: PLC0415

    ledger = MemoryLedger(budget, rank) if ledger is None else ledger  # (a ledger shared with another strategy)
    xp = backend.xp()
    seen: set[int] = set()

    def count(category, array, what):
        base = array if array.base is None else array.base
        if id(base) not in seen:
            seen.add(id(base))
            ledger.register(category, base, what)

    for p in params:
        count("parameters", p.data, "the whole model")
    for p in params:
        if p.grad is None:
            p.grad = xp.zeros_like(p.data)
        count("gradients", p.grad, "whole gradients")
    for state in optimizer.state:
        for value in state.values():
            if hasattr(value, "nbytes"):
                count("optimizer_states", value, "whole optimizer state")
    return ledger


def memory_by_rank(trainer, world=None) -> dict:
    """For train's --json: the trainer's ledger on every rank (collective when world is given).

    model_state_bytes: [{category: bytes held now}] per rank, the four model-state categories;
    memory_peak_bytes: [{category: peak bytes}] per rank, every category, and "total".
    """
    ledger = trainer.ledger  # every trainer has one (protocols.Checkpointable)
    mine = {"model_state": ledger.model_state(), "peak": {**ledger.peak(), "total": ledger.peak_total}}
    everyone = [mine] if world is None else world.allgather_object(mine)
    return {"model_state_bytes": [r["model_state"] for r in everyone],
            "memory_peak_bytes": [r["peak"] for r in everyone], "mem_budget": ledger.budget}


# ------------------------------------------------------------------------------------------------
# The paper's estimator
# ------------------------------------------------------------------------------------------------


def bytes_per_parameter(precision: str, optimizer: str = "adamw", momentum: bool = True) -> tuple[int, int, int]:
    """(P, G, K): bytes per parameter of parameters, gradients and optimizer state (incl. master)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    p, g, _ = PRECISIONS[precision]
    state = 4 if precision == "mixed" else p  # optimizer state is kept in float32 under mixed precision
    master = 4 if precision == "mixed" else 0
    if optimizer == "adamw":
        return p, g, master + 2 * state
    if optimizer == "sgd":
        return p, g, master + (state if momentum else 0)
    raise ValueError(f"unknown optimizer {optimizer!r}")


def model_state_bytes(stage: int, psi, n: int, p: int, g: int, k: int, psi_persistent=0):
    """The paper's model-state bytes per rank for `stage` (0 = DP), Ψ parameters, N ranks.

    psi_persistent (ZeRO-3 only): parameters kept whole on every rank (below the size threshold);
    they cost P bytes each in full, their gradients and optimizer states are still partitioned.
    Exact (an int) when N divides Ψ; a float otherwise.
    """
    check_stage(stage)

    def per(x):
        return x // n if x % n == 0 else x / n

    if stage == 0:
        return (p + g + k) * psi
    if stage == 1:
        return (p + g) * psi + per(k * psi)
    if stage == 2:
        return p * psi + per((g + k) * psi)
    return per((p + g + k) * psi) + p * psi_persistent + per((g + k) * psi_persistent)


def communication_elements(stage: int, psi, n: int, grad_accum: int = 1, psi_persistent=0):
    """Elements each rank sends per optimizer step on a ring (see the module docstring).

    ZeRO-3's persistent parameters (kept whole) travel like ZeRO-2's: (g + 1)Ψ_p(N−1)/N.
    """
    check_stage(stage)
    ring = (n - 1) / n
    if stage in (0, 1):
        return 2 * psi * ring
    if stage == 2:
        return (grad_accum + 1) * psi * ring
    return 3 * grad_accum * psi * ring + (grad_accum + 1) * psi_persistent * ring


def check_stage(stage) -> int:
    if stage not in STAGE_NAMES:
        raise ValueError(f"unknown ZeRO stage {stage!r}; choose 0 (data parallel), 1, 2 or 3")
    return stage


def paper_table(psi, worlds, precision: str = "mixed") -> list[dict]:
    """Rows {stage, name, formula, bytes: {N: bytes}} of the paper's Table 1 for one Ψ."""
    p, g, k = bytes_per_parameter(precision)
    return [{"stage": s, "name": STAGE_NAMES[s], "formula": STAGE_FORMULAS[s],
             "bytes": {n: model_state_bytes(s, psi, n, p, g, k) for n in worlds}} for s in STAGE_NAMES]


# ------------------------------------------------------------------------------------------------
# Units
# ------------------------------------------------------------------------------------------------

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_SUFFIX = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _parse(text, suffixes: dict, what: str, example: str, zero: bool = False) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in suffixes:
        raise ValueError(f"cannot read {what} {text!r}; write it like {example}")
    value = float(match.group(1)) * suffixes[match.group(2).upper()]
    if value == float("inf"):  # 1e400: a float overflow, not a size
        raise ValueError(f"{what} {text!r} is too large; write it like {example}")
    if value < 0 or (value == 0 and not zero) or value != value:
        raise ValueError(f"{what} must be positive, got {text!r}")
    if abs(value - round(value)) > 1e-9 * value:
        hint = "did you forget a suffix? " if not match.group(2) else ""
        raise ValueError(f"{what} {text!r} is not a whole number; {hint}write it like {example}")
    return int(round(value))


def parse_count(text) -> int:
    """A parameter count: 7.5e9, 7.5B, 1.5T, 350M, 125000 (decimal suffixes K, M, B or G, T)."""
    return _parse(text, _COUNT_SUFFIX, "parameter count", "7.5B, 7.5e9 or 350M")


def parse_bytes(text) -> int:
    """A size in bytes: 200MB, 1.5GB (decimal), 512MiB (binary), 4096."""
    return _parse(text, _BYTE_SUFFIX, "size", "200MB, 1.5GB, 512MiB or 4096", zero=True)


def format_gb(nbytes) -> str:
    """Decimal gigabytes with one decimal, as the paper's Table 1 (two below 1 GB: 0.47, 0.12)."""
    gb = Decimal(repr(nbytes / 1e9))
    places = Decimal("0.1") if gb >= Decimal("0.95") or gb == 0 else Decimal("0.01")
    return str(gb.quantize(places, rounding=ROUND_HALF_UP))  # 41.25 -> 41.3, as the paper rounds


def format_bytes(nbytes) -> str:
    """Human-readable decimal units: 812 B, 3.2 kB, 45.0 MB, 1.2 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"
