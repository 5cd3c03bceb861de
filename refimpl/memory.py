"""The memory of one rank: the ledger (bytes actually held) and the memory model (bytes by formula).

Two views of the same question -- how many bytes does each rank hold? -- kept apart on purpose:

  * MemoryLedger counts arrays that exist. A trainer registers an array when it allocates it and
    releases it when it frees it; the ledger sums their `nbytes`, per category, and keeps the
    peak of every category and of the total. Saved activations come from the autograd engine's
    own ledger (refimpl.autograd.saved_tensors), read when the ledger is asked. Nothing here is
    computed from a formula.
  * The memory model is formulas, one per quantity: parameters per rank (gpt_parameter_tensors),
    model states per ZeRO stage (model_state_bytes) and activations saved per block and per
    micro-batch (saved_elements_per_block, saved_bytes). The pre-flight check
    (tools/runtime/preflight.py), the cluster model (tools/cluster/model.py), the tensor-parallel
    command and the tests all evaluate these; a new feature (context parallelism, a new block)
    extends them rather than adding formulas of its own.

ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054, section 5 and Table 1; section 7 for the
communication). Stage s partitions the first s of (optimizer states, gradients, parameters) over
the N data-parallel ranks. For Ψ parameters, P and G bytes per parameter and gradient element and
K bytes of optimizer state per parameter (mixed-precision Adam: P = 2, G = 2, K = 12, with
K = 4 fp32 master + 4 momentum + 4 variance; bfloat16 Adam 2, 4, 12, its gradients kept in float32;
float32 Adam 4, 4, 8; float64 Adam 8, 8, 16), model
states per rank and elements each rank sends per optimizer step on a ring, with g micro-batches
per step (gradient accumulation; refimpl's rule for each stage):

    stage   partitions         model states per rank   elements sent per step on a ring
    DP      nothing            (P + G + K) Ψ           2Ψ(N−1)/N        all-reduce after the last micro-batch
    ZeRO-1  optimizer states   (P + G) Ψ + K Ψ / N     2Ψ(N−1)/N        reduce-scatter + all-gather, once
    ZeRO-2  + gradients        P Ψ + (G + K) Ψ / N     (g + 1)Ψ(N−1)/N  reduce-scatter every micro-batch (only
                                                                        a gradient shard is kept), all-gather once
    ZeRO-3  + parameters       (P + G + K) Ψ / N       3gΨ(N−1)/N       all-gather in forward and in backward and
                                                                        reduce-scatter, every micro-batch

This table is the one source: the ZeRO trainers (parallel/zero/), the memory command and the
cluster model refer to it.

Activations (Korthikanti et al. 2022, arXiv 2205.05198, section 4). refimpl's Block (nn/layers.py)
in the forward pass of one micro-batch of N = b·s tokens, width h, a heads, every array counted
once however many operations save it (autograd/saved.py); [p] = 1 with dropout, else 0. Elements
per block, on one process:

    ln1, ln2         x̂ (N·h) and 1/σ (N) each                           2·N·h + 2N
    qkv, fc inputs   the layer-norm outputs                               2·N·h
    q, k, v          the core's inputs (split of the qkv output)          3·N·h
    core             softmax output; with dropout its mask and the
                     dropped probabilities (att @ v saves those)          (1 + 2[p])·b·a·s²
    proj input       the heads' outputs                                   N·h
    GeLU             its input, and the MLP proj's input (its output)     8·N·h
    dropout masks    after attention and after the MLP                    2[p]·N·h
                                                                  = (16 + 2[p])·N·h + 2N + (1 + 2[p])·b·a·s²

The paper counts bytes with 2-byte activations and 1-byte masks and gets sbh(34 + 5as/h)
(korthikanti_bytes_per_block); refimpl stores every array, masks too, at the model's itemsize.
Which terms divide by the t ranks of a tensor-parallel group (tensor_parallel/gpt.py's splits):

  tensor parallel        q, k, v, proj input, GeLU (12·N·h) and the core (b·a·s² terms) are split;
                         ln1, ln2, the qkv/fc inputs and the masks ((4 + 2[p])·N·h + 2N) are whole
                         on every rank -- the paper's sbh(10 + 24/t + 5as/(ht))
  + sequence parallel    everything /t: the layer norms and masks run on sequence shards, and the
                         column-parallel linears keep their sequence shard, not the gathered input
  selective recompute    the core keeps only q, k, v: the b·a·s² terms vanish
  full recompute         a checkpointed block keeps its input, N·h (N·h/t with sequence
                         parallelism, or with partitioned activations, tensor_parallel/partition.py)

Outside the blocks a micro-batch saves the embedding's dropout mask ([p]·N·h), ln_f's x̂, 1/σ and
output (the head's input: N·(2h + 1)) and the cross-entropy's probabilities (N·V), plus the loss
(one scalar; two with mixed precision's loss scale). On one process the ledger's peak for one
micro-batch through L blocks is, in elements,

    L·[(16 + 2[p])·N·h + 2N + (1 + 2[p])·b·a·s²] + [p]·N·h + N·(2h + 1) + N·V + 1 (+ 1)

The two views meet in the tests: the ledger's model-state bytes equal model_state_bytes at the
padded Ψ' (each flat buffer is padded to a multiple of N: at most N−1 elements per buffer;
tests/test_zero.py), the saved-tensor peak equals saved_bytes (tests/test_preflight.py), a tp
rank's saved bytes per block equal saved_bytes_per_block (tests/test_tensor_parallel.py), and
gpt_parameter_tensors lists the built model's tensors (tests/test_preflight.py, test_cluster.py).

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

from refimpl import backend
from refimpl.autograd.saved import saved_tensors as _saved_tensors

CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states",
              "gathered_parameters", "gradient_buckets", "activations")
MODEL_STATE = CATEGORIES[:4]
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
STAGE_FORMULAS = {0: "(P+G+K)Ψ", 1: "(P+G)Ψ + KΨ/N", 2: "PΨ + (G+K)Ψ/N", 3: "(P+G+K)Ψ/N"}
COMM_FORMULAS = {0: "2Ψ(N-1)/N", 1: "2Ψ(N-1)/N", 2: "(g+1)Ψ(N-1)/N", 3: "3gΨ(N-1)/N"}
# Bytes per parameter (P, G, K) for Adam: parameters, gradients, optimizer state (+ fp32 master).
# bf16 (optim/precision.py): bfloat16 parameters, gradients accumulated and reduced in float32 (G = 4, as
# Megatron-LM accumulates bfloat16 gradients in float32), float32 master weights and Adam states.
PRECISIONS = {"mixed": (2, 2, 12), "bf16": (2, 4, 12), "float32": (4, 4, 8), "float64": (8, 8, 16)}


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
# The memory model: parameters
# ------------------------------------------------------------------------------------------------


def expert_blocks(blocks: int, experts: int, moe_every: int) -> int:
    """Blocks with a mixture of experts among the first `blocks`: block i has them when
    i % moe_every == moe_every − 1 (GPTConfig.has_experts), so ⌊blocks / moe_every⌋ of them."""
    return blocks // moe_every if experts else 0


def gpt_parameter_tensors(vocab: int, seq: int, h: int, blocks: int, tp: int = 1, tied: bool = False,
                          experts: int = 0, moe_every: int = 1, ep: int = 1, embedding: bool = True,
                          head: bool = True, arch: str = "gpt2", kv_width: int | None = None,
                          ffn: int | None = None, kv_heads: int | None = None) -> list[tuple[int, int, str]]:
    """refimpl's GPT (nn/models.py) as one rank holds it, tensor by tensor: (elements, how many, kind).

    Vocabulary V, positions s, width h, `blocks` blocks; a pipeline stage passes its own blocks and
    whether it holds the embedding and the head. kind "split": divided over the t tensor-parallel
    ranks (tensor_parallel/gpt.py: qkv and fc with their biases, the proj weights, the vocabulary rows
    of wte and lm_head over V' = V rounded up to a multiple of t); "whole": on every rank (layer
    norms, the row-parallel biases, wpe, the router); "experts": this rank's E/ep expert MLPs. Per
    dense block 12h² + 13h: 12h² + 7h split, 6h whole. A tied head is wte itself: a second copy
    only on a stage without the embedding. t divides h (it divides the heads), so every split is exact.
    """
    if arch == "llama":
        return llama_parameter_tensors(vocab, h, blocks, kv_width or h, ffn or 4 * h, tied, embedding, head, tp,
                                       experts, moe_every, ep, kv_heads)
    t, V = tp, -(-vocab // tp) * tp
    moe = expert_blocks(blocks, experts, moe_every)
    dense, mine = blocks - moe, moe * (experts // ep)  # blocks with the dense MLP; this rank's expert MLPs
    return [
        (V * h // t, int(embedding), "split"),  # wte (V', h)
        (seq * h, int(embedding), "whole"),  # wpe (s, h)
        (h, 4 * blocks, "whole"),  # ln1, ln2: weight and bias
        (3 * h * h // t, blocks, "split"), (3 * h // t, blocks, "split"),  # qkv, column-parallel
        (h * h // t, blocks, "split"), (h, blocks, "whole"),  # proj, row-parallel: its bias whole
        (4 * h * h // t, dense, "split"), (4 * h // t, dense, "split"),  # fc1, column-parallel
        (4 * h * h // t, dense, "split"), (h, dense, "whole"),  # fc2, row-parallel
        (experts * h, moe, "whole"),  # the router (E, h)
        (4 * h * h, mine, "experts"), (4 * h, mine, "experts"), (4 * h * h, mine, "experts"), (h, mine, "experts"),
        (h, 2 * int(head), "whole"),  # ln_f
        (V * h // t, int(head and not (tied and embedding)), "split"),  # lm_head (V', h)
    ]


def llama_parameter_tensors(vocab: int, h: int, blocks: int, kv_width: int, ffn: int, tied: bool = False,
                            embedding: bool = True, head: bool = True, tp: int = 1, experts: int = 0,
                            moe_every: int = 1, ep: int = 1, kv_heads: int | None = None) -> list[tuple[int, int, str]]:
    """The GPT with --arch llama (nn/layers.py's LlamaBlock) as one rank holds it, tensor by tensor, as
    gpt_parameter_tensors: width h, key/value width kv_width = kv_heads·h/n_head, SwiGLU width F.
    No biases and no position table; per block 2h² + 2h·kv_width + 3h·F + 2h (wq, wo; wk, wv;
    w1, w3, w2; two RMSNorm gains). Multi-head attention (kv_width = h) with F = 4h gives 16h² + 2h.
    Over t tensor-parallel ranks (tensor_parallel/gpt.py) every matrix is "split": wq, wk, wv, w1, w3
    by rows, wo, w2 by columns, wte and lm_head by vocabulary rows of V' = V rounded up to a multiple
    of t; the RMSNorm gains are "whole". t divides the heads, the key/value heads and F (refused
    otherwise), so every split is exact.

    With E experts (Mixtral's layer: nn/experts.py with SwiGLU experts) the blocks that have them
    (expert_blocks) hold, instead of the SwiGLU MLP, the router (E, h) "whole" and this rank's E/ep
    SwiGLU experts, 3h·F each without biases, "experts" (experts are not split over tp: refused).

    kv_heads (None: at least t): with fewer key/value heads than ranks each rank holds one whole
    key/value head, h·kv_width/kv_heads elements of wk and of wv, replicated on t/kv_heads ranks."""
    t, V = tp, -(-vocab // tp) * tp
    moe = expert_blocks(blocks, experts, moe_every)
    dense, mine = blocks - moe, moe * (experts // ep)  # blocks with the dense SwiGLU; this rank's experts
    return [
        (V * h // t, int(embedding), "split"),  # wte (V', h)
        (h, 2 * blocks, "whole"),  # the two RMSNorm gains of each block
        (h * h // t, 2 * blocks, "split"),  # wq (rows), wo (columns)
        (h * kv_width // min(t, kv_heads or t), 2 * blocks, "split"),  # wk, wv (rows; or one replicated head)
        (h * ffn // t, 3 * dense, "split"),  # w1 (gate), w3 (up) by rows, w2 (down) by columns
        (experts * h, moe, "whole"),  # the router (E, h)
        (h * ffn, 3 * mine, "experts"),  # each expert's w1, w3 (F, h) and w2 (h, F)
        (h, int(head), "whole"),  # ln_f (RMSNorm)
        (V * h // t, int(head and not (tied and embedding)), "split"),  # lm_head (V', h)
    ]


def gpt_parameters(*args, **kwargs) -> dict:
    """{"split", "whole", "experts"}: gpt_parameter_tensors' elements by kind (Ψ of the rank is their sum)."""
    by_kind = dict.fromkeys(("split", "whole", "experts"), 0)
    for elements, count, kind in gpt_parameter_tensors(*args, **kwargs):
        by_kind[kind] += elements * count
    return by_kind


# ------------------------------------------------------------------------------------------------
# The memory model: model states (ZeRO; the table of the module docstring)
# ------------------------------------------------------------------------------------------------

# The stage from which ZeRO partitions each model state over the N data-parallel ranks.
PARTITIONED_FROM = {"parameters": 3, "gradients": 2, "optimizer_states": 1}


def partitions(stage: int, category: str) -> bool:
    """Whether ZeRO `stage` holds 1/N of `category` ("parameters", "gradients" or "optimizer_states")."""
    return stage >= PARTITIONED_FROM[category]


def bytes_per_parameter(precision: str, optimizer: str = "adamw", momentum: bool = True) -> tuple[int, int, int]:
    """(P, G, K): bytes per parameter of parameters, gradients and optimizer state (incl. master)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    p, g, _ = PRECISIONS[precision]
    sixteen_bit = precision in ("mixed", "bf16")  # optimizer state and master weights kept in float32
    state = 4 if sixteen_bit else p
    master = 4 if sixteen_bit else 0
    if optimizer == "adamw":
        return p, g, master + 2 * state
    if optimizer == "sgd":
        return p, g, master + (state if momentum else 0)
    raise ValueError(f"unknown optimizer {optimizer!r}")


def model_state_bytes(stage: int, psi, n: int, p: int, g: int, k: int, psi_persistent=0):
    """Model-state bytes per rank for `stage` (0 = DP), Ψ parameters, N ranks (Rajbhandari et al.
    2020, Table 1): (bytes kept whole) Ψ + (bytes partitioned) Ψ / N, the row of the module's table.

    psi_persistent (ZeRO-3 only): parameters kept whole on every rank (below the size threshold);
    they cost P bytes each in full, their gradients and optimizer states are still partitioned.
    Exact (an int) when N divides Ψ; a float otherwise.
    """
    check_stage(stage)

    def per(x):
        return x // n if x % n == 0 else x / n

    per_parameter = {"parameters": p, "gradients": g, "optimizer_states": k}
    whole = sum(b for category, b in per_parameter.items() if not partitions(stage, category))
    split = sum(b for category, b in per_parameter.items() if partitions(stage, category))
    total = whole * psi + per(split * psi)
    if stage == 3:
        total = total + p * psi_persistent + per((g + k) * psi_persistent)
    return total


def communication_elements(stage: int, psi, n: int, grad_accum: int = 1, psi_persistent=0):
    """Elements each rank sends per optimizer step on a ring (the module docstring's table).

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
# The memory model: activations (Korthikanti et al.; the module docstring's tables)
# ------------------------------------------------------------------------------------------------

RECOMPUTE = ("none", "selective", "full")


def expert_elements_per_token(h: int, experts: int, top_k: int, ffn: int | None = None) -> int:
    """What a mixture-of-experts block adds per token: K tokens' worth of the MLP's activations (10h
    for GeLU experts of width 4h; 3F + 2h for SwiGLU experts of width F = ffn: gate, up, their
    product, the gathered input and the output) and of the dispatch and combine copies (4h), and the
    router's logits and probabilities (2E). An upper bound, not the ledger's count: the dense MLP
    that the experts replace stays counted."""
    mlp = 10 * h if ffn is None else 3 * ffn + 2 * h
    return top_k * (mlp + 4 * h) + 2 * experts


def saved_elements_per_block(b: int, s: int, h: int, a: int, tp: int = 1, sequence_parallel: bool = False,
                             dropout: bool = False, recompute: str = "none", partitioned: bool = False,
                             experts: int = 0, top_k: int = 0, arch: str = "gpt2", kv_width: int | None = None,
                             ffn: int | None = None, kv_heads: int | None = None) -> dict:
    """Elements one rank saves in one block's forward, by how they scale; sum them for the total:
    (16 + 2[p])·N·h + 2N + (1 + 2[p])·b·a·s² on one process (Korthikanti et al. 2022, §4.1, counted
    as refimpl saves: the module docstring's table), N = b·s tokens.

    {"whole", "split", "attention"}: whole on every tp rank, split over tp, the core's b·a·s² terms
    (none with selective recomputation); with experts (E, K per token) also "experts", the bound of
    expert_elements_per_token. recompute="full": {"input"}, the kept block input, N·h (/t with
    sequence parallelism or partitioned activations). Exact, as the saved-tensor ledger counts.

    arch="llama" (LlamaBlock, on one process): the norms save x̂, 1/rms and their outputs as
    LayerNorm does, RoPE saves nothing (its cos/sin are constants of the positions), and the
    block saves q (N·h), k and v (N·kv_width each, not copied per query head), the heads' output
    (N·h) and SwiGLU's gate, up projection and output (N·F each):
    (4 + 2[p])·N·h + 2N + 2·N·h + 2·N·kv_width + 3·N·F + (1 + 2[p])·b·a·s².
    Over t tensor-parallel ranks (tensor_parallel/gpt.py) the terms divide as GPT-2's do, except
    under sequence parallelism: the two projection groups (wq, wk, wv; w1, w3) keep the whole
    gathered input, 2·N·h on every rank ("whole"), where GPT-2's GatherThenLinear keeps its 1/t shard.
    With fewer key/value heads than ranks (kv_heads < t, kv_heads dividing t) every rank keeps the
    keys and values of its one replicated head, 2·N·kv_width/kv_heads, counted as t/kv_heads times
    the whole model's 2·N·kv_width in "split".
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    N, p = b * s, int(dropout)
    if recompute == "full":
        return {"input": N * h // (tp if sequence_parallel or partitioned else 1)}
    whole = (4 + 2 * p) * N * h + 2 * N  # layer norms, qkv/fc inputs, masks
    split = 12 * N * h  # q, k, v, proj input, GeLU input and output
    if arch == "llama":  # q and wo's input, k and v (kv_width each), SwiGLU's gate, up and w2's input (F each)
        replicas = max(1, tp // kv_heads) if kv_heads else 1  # ranks that keep the same key/value head
        split = 2 * N * h + 2 * N * (kv_width or h) * replicas + 3 * N * (ffn or 4 * h)
    attention = 0 if recompute == "selective" else (1 + 2 * p) * b * a * s * s
    out = {"whole": 0, "split": (whole + split) // tp} if sequence_parallel else {"whole": whole, "split": split // tp}
    if arch == "llama" and sequence_parallel and tp > 1:  # the gathered projection inputs, whole
        out = {"whole": 2 * N * h, "split": (whole - 2 * N * h + split) // tp}
    out["attention"] = attention // tp
    if experts:
        out["experts"] = N * expert_elements_per_token(h, experts, top_k, (ffn or 4 * h) if arch == "llama" else None)
    return out


def saved_bytes_per_block(b: int, s: int, h: int, a: int, tp: int = 1, sequence_parallel: bool = False,
                          dropout: bool = False, recompute: str = "none", partitioned: bool = False,
                          itemsize: int = 8, arch: str = "gpt2", kv_width: int | None = None,
                          ffn: int | None = None, kv_heads: int | None = None) -> int:
    """saved_elements_per_block's total, at `itemsize` bytes per element."""
    return itemsize * sum(saved_elements_per_block(b, s, h, a, tp, sequence_parallel, dropout, recompute,
                                                   partitioned, arch=arch, kv_width=kv_width, ffn=ffn,
                                                   kv_heads=kv_heads).values())


def saved_elements_outside_blocks(b: int, s: int, h: int, vocab: int, dropout: bool = False, tp: int = 1) -> dict:
    """{"embedding", "final_norm", "loss"}: elements a micro-batch saves outside the blocks (module
    docstring): the embedding's dropout mask, ln_f's x̂, 1/σ and output, the cross-entropy's
    probabilities. tp: the vocabulary-parallel loss keeps its ⌈V/t⌉ columns (cross_entropy.py); the
    embedding and ln_f are whole on every rank (without sequence parallelism)."""
    N = b * s
    return {"embedding": int(dropout) * N * h, "final_norm": N * (2 * h + 1), "loss": N * -(-vocab // tp)}


def saved_elements(b: int, s: int, h: int, a: int, vocab: int, layers: int, dropout: bool = False,
                   model: str = "gpt", arch: str = "gpt2", kv_width: int | None = None, ffn: int | None = None) -> int:
    """Elements the saved-tensor ledger holds at its peak for one micro-batch on one process, the
    loss aside. GPT: `layers` blocks, the embedding and the head (the module docstring's sum). MLP
    classifier (widths 2 → h, `layers` times, → vocab classes; s and a unused): each layer's input,
    which is the previous tanh's output (saved once), and the probabilities, b·(2 + layers·h + vocab)."""
    if model == "mlp":
        return b * (2 + layers * h + vocab)
    block = sum(saved_elements_per_block(b, s, h, a, dropout=dropout, arch=arch, kv_width=kv_width,
                                         ffn=ffn).values())
    return layers * block + sum(saved_elements_outside_blocks(b, s, h, vocab, dropout).values())


def saved_bytes(b: int, s: int, h: int, a: int, vocab: int, layers: int, itemsize: int, dropout: bool = False,
                loss_scaled: bool = False, model: str = "gpt", arch: str = "gpt2", kv_width: int | None = None,
                ffn: int | None = None) -> int:
    """saved_elements at `itemsize` bytes, and the loss: one scalar (two with mixed precision's loss
    scale). The ledger's peak for one micro-batch, to the byte (tests/test_preflight.py, tests/test_llama.py)."""
    return itemsize * (saved_elements(b, s, h, a, vocab, layers, dropout, model, arch, kv_width, ffn) + 1 + loss_scaled)


def korthikanti_bytes_per_block(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                                selective: bool = False) -> float:
    """Korthikanti et al. 2022's activation bytes per layer (16-bit activations, 1-byte masks; Table 2):
    sbh(10 + 24/t + 5as/(ht)), with sequence parallelism sbh(34/t + 5as/(ht)); selective
    recomputation drops the 5as/(ht) term."""
    core = 0.0 if selective else 5 * a * s / (h * t)
    return s * b * h * ((34 / t if sequence_parallel else 10 + 24 / t) + core)


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
