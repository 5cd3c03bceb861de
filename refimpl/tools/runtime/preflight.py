"""Does the run fit? Each rank's peak memory, estimated before anything is allocated.

NumPy allocates as it goes: a run too large for its machine grows until the kernel's OOM killer
ends it, or until a MemoryError traceback appears on some rank, minutes later. So the train and
verify commands call `check` once, after the task is loaded (a --data file sets the vocabulary)
and before the model is built: it estimates every rank's peak, sums the estimates of the ranks
that share a host (they share its RAM), compares each host's sum with the memory it has available,
and refuses a run that cannot fit -- on every rank alike (failure.agree), in one line that gives
the estimate, its parts, the memory available and what to change. Everything is Python integer
arithmetic, so `--batch-size 1000000000000` is refused at once, not after a MemoryError or a
NumPy overflow.

The estimate, per rank (N ranks, dp data-parallel ranks = N/(pp·tp), g micro-batches per step, b the
micro-batch on this rank = ⌈B/(dp·g)⌉, or ⌈B/(dp·M)⌉ for a pipeline of M micro-batches):

  parameters+optimizer  the model states per rank of memory.py's ZeRO table (model_state_bytes)
                        for the stage, P/G/K bytes of the precision and optimizer
                        (memory.bytes_per_parameter), at the padded Ψ' = Ψ + (N−1)·(parameter
                        tensors) (each flat buffer is padded by at most N−1 elements, and there
                        are no more buffers than tensors). Ψ is counted from the flags
                        (memory.gpt_parameter_tensors), not from a model. A pipeline rank keeps the
                        whole model's parameters (stage.py builds the whole model on every rank)
                        and, for its own stages, ZeRO-1's row at any stage (a bound).
  buffers               transient gradient buckets and flat groups (2 groups in flight of at most
                        max(--bucket-bytes, the largest tensor)), reduce-scatter outputs (GΨ'/N),
                        ZeRO-3's gathered modules (+ --prefetch), mixed precision's float32
                        gradients, the optimizer's and clipping's temporaries (5 arrays of the largest update),
                        and the GPT's causal masks (L·s² bytes: one s×s bool array per layer).
  activations           the autograd graph of the micro-batches held at once, plus the working
                        set of the one operation running (below). Data parallel: 2 graphs when
                        g > 1 (a trainer's `loss` keeps the previous micro-batch's graph alive
                        while the next forward runs), else 1. Pipeline: 1 + the in-flight
                        (stage, micro-batch) pairs that the schedule simulator reports for this
                        rank (simulate.peak_in_flight, freed at W: the conservative convention),
                        each the graph of the largest stage. No activation checkpointing is
                        assumed: a --checkpoint plan only lowers the peak, so this is its bound.
  data                  the global batch, which every rank draws whole (6 int64 arrays of
                        B·(s+1), or 10 float64 arrays of B for the spirals), the data set's token
                        ids, and a pipeline schedule's action lists (SCHEDULE_ENTRY_BYTES per
                        stage and micro-batch, validation included).
  process               PROCESS_BYTES per rank: the interpreter, NumPy, refimpl (and mpi4py).

and the peak is the larger of that sum and the peak while the model is built: every rank builds
the whole model (P·Ψ), a flat copy (P·Ψ), float64 draws of its largest matrix (16 bytes per
element) and the causal masks with np.triu's temporaries. verify's rank 0 also holds the
single-process reference (the whole model at DP: (P+G+K)Ψ, its activations on the whole batch)
and every step's recorded parameters and gradients.

Activations: memory.py's saved elements (saved_elements_per_block and saved_elements_outside_blocks,
the one formula, exact against the engine's saved-tensor ledger) plus what the autograd graph
holds that backward does not need, at e bytes per element (8 in float64, 4 in float32 and in
mixed precision, whose float16 storage computes in float32), per token (h width, a heads,
V vocabulary, s sequence):

    per block        + 5h + as (+ 2h)      the attention scores, the heads' output before its
                                           reshape, proj's and fc2's outputs, the two residual
                                           sums (with dropout: its outputs after attention and MLP)
    embedding        + 2h (+ h)            wte's output and the sum with wpe (dropout's output)
    head             + V                   the logits, beside the probabilities the loss saves
    working set      3V + 2as + 16h        not held: cross-entropy's temporaries, softmax's
                                           backward, the MLP's gelu backward (+ 2as·8/e with
                                           dropout: its float64 draws)

plus the token ids (8 bytes per position) and GRAPH_OBJECT_BYTES of Python objects per block and
micro-batch. A mixture of experts counts its E expert MLPs and router in Ψ and the bound
memory.expert_elements_per_token in every block. The MLP classifier's graph holds, beside the
saved elements, each Linear's output and the logits; its working set is 5·max(width) + 3K.

What is estimated, and why it is an upper bound: every array the graph keeps alive (not only
the saved ones), as many graphs as the trainer can hold at once, the largest operation's
temporaries, rounded-up Python objects, the data and the process; nothing that only lowers the
peak is modelled (activation checkpointing, expert parallelism's E/ep experts per rank, tensor
parallelism: a tp rank is estimated as if it held the whole model and its activations). It is
a bound for refusing runs, not a formula to plan with. Where it differs from the cluster model
(tools/cluster/model.py), which evaluates the same formulas for a GPU: it counts a NumPy process
(the graph's outputs beyond the saved tensors, temporaries, Python objects, the data and the
interpreter) and refimpl's float32 arithmetic under mixed precision.

Available memory, per host: the REFIMPL_MEMORY_LIMIT environment variable if set (a size:
2GB, 512MiB; `off` skips the check), else the least of MemAvailable in /proc/meminfo and the
cgroup's memory.max − memory.current (Linux), else free physical pages (os.sysconf), else, on
macOS, the physical memory; when none is known the check is skipped. Ranks share a host when
they report the same host name. With the CuPy backend, parameters, buffers and activations live
on the GPU: they are compared with the free memory of the rank's GPU (summed over the ranks on
one host that share it), the rest with the host's.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from dataclasses import dataclass, field

from refimpl import backend
from refimpl.memory import (
    bytes_per_parameter,
    format_bytes,
    gpt_parameter_tensors,
    gpt_parameters,
    model_state_bytes,
    parse_bytes,
    saved_elements,
    saved_elements_outside_blocks,
    saved_elements_per_block,
)
from refimpl.parallel.pipeline.simulate import peak_in_flight
from refimpl.tools.plugin import build_schedule
from refimpl.tools.runtime.failure import AgreedError, agree

# Bounds with a margin over what tests/test_preflight.py measures:
PROCESS_BYTES = 64 * 10**6  # the interpreter with NumPy and refimpl imported
GRAPH_OBJECT_BYTES = 64_000  # Python objects of one block's graph per micro-batch
SCHEDULE_ENTRY_BYTES = 4096  # a schedule's actions per (stage, micro-batch), validated
BUILD_SCHEDULE_UP_TO = 20_000  # stages × micro-batches: beyond, in-flight micro-batches are bounded, not simulated
LIMIT_VARIABLE = "REFIMPL_MEMORY_LIMIT"
EVAL_BATCH = {"sort": 256, "text": 64, "mlp": 1024}  # data.py's eval_batch sizes
PARTS = ("parameters+optimizer", "activations", "buffers", "data")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------------
# Parameters, from the flags
# ------------------------------------------------------------------------------------------------


def parameter_tensors(cfg, vocab: int, seq: int) -> list[tuple[int, int]]:
    """The model's parameter tensors as (elements, how many). GPT (vocab V, sequence s): the whole
    model of memory.gpt_parameter_tensors. MLP (vocab = K classes): a weight and a bias per layer of
    widths 2 → h (L times) → K."""
    h, L = cfg.d_model, cfg.n_layer
    if cfg.model == "mlp":
        return [(2 * h, 1), (h, 1), (h * h, L - 1), (h, L - 1), (h * vocab, 1), (vocab, 1)]
    return [(n, k) for n, k, _ in gpt_parameter_tensors(vocab, seq, h, L, experts=cfg.experts, moe_every=cfg.moe_every,
                                                         **_arch(cfg))]


def _arch(cfg) -> dict:
    """The block's shape as gpt_parameter_tensors takes it (--arch llama: key/value width, SwiGLU width)."""
    arch = getattr(cfg, "arch", "gpt2")
    if arch != "llama":
        return {}
    kv = cfg.n_head if cfg.kv_heads is None else cfg.kv_heads
    return {"arch": arch, "kv_width": kv * cfg.d_model // cfg.n_head, "ffn": cfg.ffn_size or 4 * cfg.d_model}


def count(tensors) -> int:
    """Ψ: the elements of all tensors."""
    return sum(n * k for n, k in tensors if k > 0)


def _layer_parameters(cfg) -> int:
    """Parameters of the chain's largest layer: a GPT block (with experts, an MoE block) or an MLP hidden layer."""
    if cfg.model != "gpt":
        return cfg.d_model * cfg.d_model + cfg.d_model
    return sum(gpt_parameters(0, 0, cfg.d_model, 1, experts=cfg.experts, embedding=False, head=False,
                              **_arch(cfg)).values())


# ------------------------------------------------------------------------------------------------
# Activations: memory.py's saved elements, and what the graph holds beside them
# ------------------------------------------------------------------------------------------------


@dataclass
class Shape:
    """What an activation estimate needs: model kind, sizes, bytes per computed element."""

    model: str
    s: int  # sequence (GPT)
    h: int
    a: int
    vocab: int  # V (GPT) or classes (MLP)
    e: int  # bytes per computed element
    dropout: bool
    loss_scaled: bool = False  # mixed precision: loss · S saves one more scalar
    experts: int = 0  # a mixture of experts in every block (a bound), K per token
    top_k: int = 0
    block: dict = field(default_factory=dict)  # --arch llama: memory.py's arch, kv_width and ffn


def graph_bytes(shape: Shape, b: int, layers: int, embed: bool = True, head: bool = True) -> int:
    """Bytes the autograd graph of one micro-batch holds until it is dropped: the saved elements and
    the outputs backward does not need (module docstring), the token ids and the Python objects."""
    s, h, a, V, e, p = shape.s, shape.h, shape.a, shape.vocab, shape.e, int(shape.dropout)
    objects = GRAPH_OBJECT_BYTES * (layers + 2)
    if shape.model == "mlp":  # beside the saved elements: each Linear's output, the logits
        return e * (saved_elements(b, 0, h, 0, V, layers, model="mlp") + b * (layers * h + V)) + objects
    N = b * s
    block = sum(saved_elements_per_block(b, s, h, a, dropout=shape.dropout, experts=shape.experts,
                                         top_k=shape.top_k, **shape.block).values())
    elements = layers * (block + N * (5 * h + a * s + 2 * p * h))
    ends = saved_elements_outside_blocks(b, s, h, V, shape.dropout)
    if embed:
        elements += ends["embedding"] + N * (2 + p) * h
    if head:
        elements += ends["final_norm"] + 2 * ends["loss"]  # the logits beside the probabilities
    return e * elements + 8 * N * embed + objects


def working_bytes(shape: Shape, b: int) -> int:
    """Temporaries of the one operation running, forward or backward (not held by the graph)."""
    s, h, a, V, e = shape.s, shape.h, shape.a, shape.vocab, shape.e
    if shape.model == "mlp":
        return e * b * (5 * max(2, h, V) + 3 * V)  # tanh's backward: g, out², 1 − out², their product, dx
    draws = 2 * a * s * 8 // e if shape.dropout else 0
    return e * b * s * (3 * V + 2 * a * s + 16 * h + draws)


# ------------------------------------------------------------------------------------------------
# The estimate
# ------------------------------------------------------------------------------------------------


@dataclass
class Estimate:
    """Bytes at this rank's peak, by part (module docstring); `total` is what is compared."""

    parts: dict = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    build: int = 0  # the peak while the model is built
    step_activations: int = 0  # activations during a training step (parts["activations"]: also evaluate's)
    on_device: int = 0  # the part that lives on the GPU (CuPy backend), included in the total

    @property
    def running(self) -> int:
        return sum(self.parts.values()) + PROCESS_BYTES

    @property
    def total(self) -> int:
        return max(self.running, self.build + PROCESS_BYTES)

    def add(self, other: Estimate) -> None:
        for part in PARTS:
            self.parts[part] += other.parts[part]
        self.build += other.build
        self.on_device += other.on_device

    def describe(self) -> str:
        text = ", ".join(f"{part} {_size(self.parts[part])}" for part in PARTS) + f", process {_size(PROCESS_BYTES)}"
        if self.build > sum(self.parts.values()):
            text += f"; {_size(self.build)} while building the whole model"
        return text


def _task_kind(cfg) -> str:
    return "mlp" if cfg.model == "mlp" else ("text" if cfg.data is not None else "sort")


def _task_bytes(task) -> int:
    """The task's own arrays (a --data file's token ids)."""
    return sum(int(getattr(value, "nbytes", 0)) for value in vars(task).values() if hasattr(value, "dtype"))


def _shape(cfg, vocab: int, seq: int) -> Shape:
    e = 8 if cfg.dtype == "float64" else 4  # float16 storage computes in float32
    return Shape(cfg.model, seq, cfg.d_model, max(1, cfg.n_head), vocab, e, cfg.dropout > 0, cfg.dtype == "mixed",
                 cfg.experts, cfg.top_k, _arch(cfg))


def _batch_bytes(cfg, batch: int, seq: int) -> int:
    """The global batch as every rank draws it (data.py), and the targets' counted-mask."""
    if cfg.model == "mlp":
        return 10 * 8 * batch
    return 6 * 8 * batch * (seq + 1) + batch * seq


def _pipeline(cfg, rank: int, world_size: int) -> tuple[int, int, int]:
    """(stages S, stages this rank holds, (stage, micro-batch) pairs in flight at its peak).

    From the schedule itself (plugin.build_schedule, simulate.peak_in_flight) when it is small; else
    bounded: every micro-batch of every stage held (GPipe's count, the most any schedule holds),
    with the stages per rank of the schedule's kind (interleaved: --chunks, V-shapes and DualPipe: 2).
    """
    pp, M = cfg.pp, cfg.micro_batches or 2 * cfg.pp
    per_rank = {"interleaved": cfg.chunks or 2, "zbv": 2, "dualpipe": 2, "dualpipev": 2}.get(cfg.schedule or "1f1b", 1)
    stages = pp if cfg.schedule == "dualpipe" else pp * per_rank
    if stages * M <= BUILD_SCHEDULE_UP_TO:
        try:
            schedule = build_schedule(cfg.schedule or "1f1b", pp, M, cfg.chunks)
            if world_size % pp:
                raise ValueError("the world does not divide into pp stages")
        except ValueError:
            pass  # the trainer will say what is wrong; bound it meanwhile
        else:
            p = rank // (world_size // pp)  # mesh.py: rank = p·dp + d (tp = 1)
            return schedule.num_stages, len(schedule.placement.stages_of(p)), peak_in_flight(schedule, p)
    return stages, per_rank, M * per_rank


def _round_up(x: int, n: int) -> int:
    return _ceil_div(x, n) * n


def estimate(cfg, vocab: int, seq: int, world_size: int = 1, rank: int = 0, task_bytes: int = 0,
             verify: bool = False) -> Estimate:
    """This rank's peak memory for configuration cfg (train.TrainConfig) on world_size ranks.

    vocab: the GPT's vocabulary, or the MLP's classes; seq: the GPT's sequence; task_bytes: the data
    set's arrays. verify: the run is `python -m refimpl verify` (rank 0 also holds the reference).
    """
    shape = _shape(cfg, vocab, seq)
    tensors = [(n, k) for n, k in parameter_tensors(cfg, vocab, seq) if k > 0]
    psi, largest = count(tensors), max(n for n, _ in tensors)
    mixed = cfg.dtype in ("mixed", "bf16")  # 16-bit storage, float32 master weights
    p, g, k = bytes_per_parameter(cfg.dtype if cfg.dtype in ("mixed", "bf16", "float64") else "float32", cfg.optimizer)
    state = 4 if mixed else p  # bytes of an optimizer-state element
    pipeline = cfg.pp > 1 or cfg.schedule is not None
    dp = max(1, world_size // (cfg.pp * cfg.tp * cfg.cp))  # the data-parallel group: it splits the batch, ZeRO
    # shards over it (and over cp: a bound; each cp rank also holds only T/cp of the activations counted here)
    masks = cfg.n_layer * seq * seq if cfg.model == "gpt" else 0  # one (s, s) bool causal mask per block
    padded = psi + (world_size - 1) * sum(c for _, c in tensors)  # ≤ N−1 elements per flat buffer
    # a bucket or flat group (data_parallel.assign_buckets), and the most elements one optimizer update touches
    group = min(max(cfg.bucket_bytes, g * largest), g * padded)
    update = min(max(largest, cfg.bucket_bytes // p), padded)
    est = Estimate()
    parts = est.parts

    if pipeline:
        stages, held, in_flight = _pipeline(cfg, rank, world_size)
        if cfg.model == "gpt":  # the largest stage's blocks, with the embedding and the head
            layers = min(cfg.n_layer, _ceil_div(cfg.n_layer, stages))
            ends = psi - cfg.n_layer * _layer_parameters(cfg)
            psi_rank = min(psi, held * (layers * _layer_parameters(cfg) + ends))
        else:  # the MLP: bounded by the whole model
            layers, psi_rank = cfg.n_layer, psi
        if cfg.zero >= 1:  # memory.py's ZeRO-1 row, rounded up: a bound at every stage (ZeRO-2/3 hold less)
            states = (p + g) * psi_rank + _ceil_div(k * psi_rank, dp)
        elif mixed:  # ZeRO-0's flat buffers: parameters, gradients, float32 master weights and states, whole
            states = (p + g + k) * psi_rank
        else:
            states = (g + k) * psi_rank
        parts["parameters+optimizer"] = p * psi + states  # + the whole model every rank built
        micro_batches = cfg.micro_batches or 2 * cfg.pp
        b = _ceil_div(cfg.batch_size, dp * micro_batches)
        # a micro-batch holds at least one example (the trainer refuses empty ones)
        in_flight = min(in_flight, held * _ceil_div(cfg.batch_size, dp))
        est.step_activations = (in_flight + 1) * graph_bytes(shape, b, layers) + working_bytes(shape, b)
        parts["buffers"] = 2 * group + 5 * state * min(update, psi_rank) + masks
        parts["data"] = SCHEDULE_ENTRY_BYTES * stages * micro_batches
    else:
        stage, n = cfg.zero, dp
        if stage or mixed:  # a ZeRO strategy (mixed precision needs its master weights)
            persistent = count((m, c) for m, c in tensors if m < cfg.param_threshold) if stage == 3 else 0
            parts["parameters+optimizer"] = model_state_bytes(stage, _round_up(padded, n), n, p, g, k,
                                                              _round_up(persistent, n))
        else:  # LocalTrainer or DDP: everything whole
            parts["parameters+optimizer"] = (p + g + k) * psi
        shard = _ceil_div(padded, n) if stage else padded
        buffers = 2 * group + 5 * state * update + masks  # in flight; optimizer and clipping temporaries
        if stage >= 1:
            buffers += _ceil_div(g * padded, n)  # reduce-scatter outputs
        if stage == 3:
            buffers += 2 * min(max(cfg.bucket_bytes, p * largest), p * padded) + cfg.prefetch  # gathered modules
        if mixed:
            buffers += 4 * shard  # float32 unscaled gradients
        parts["buffers"] = buffers
        b = _ceil_div(cfg.batch_size, n * cfg.grad_accum)
        copies = min(cfg.grad_accum, 2)  # the previous micro-batch's graph lives until `loss` is reassigned
        est.step_activations = copies * graph_bytes(shape, b, cfg.n_layer) + working_bytes(shape, b)
    parts["data"] += _batch_bytes(cfg, cfg.batch_size, seq) + task_bytes

    # evaluate() after training: no graph kept, one operation at a time, on the held-out batch
    n_eval = EVAL_BATCH[_task_kind(cfg)]
    parts["activations"] = max(est.step_activations, working_bytes(shape, n_eval) +
                               graph_bytes(shape, n_eval, 0, embed=False))
    # building: the whole model, a flat copy of it, float64 draws (standard_normal · std) of the
    # largest matrix, the masks and np.triu's two temporaries of the last one
    est.build = 2 * p * psi + 16 * largest + masks + 2 * seq * seq * (cfg.model == "gpt") + task_bytes

    if verify:
        _add_verify(est, cfg, shape, psi, p, g, k, mixed, rank, task_bytes)
    if backend.name() == "cupy":
        est.on_device = parts["parameters+optimizer"] + parts["buffers"] + parts["activations"]
    return est


def _add_verify(est: Estimate, cfg, shape: Shape, psi: int, p: int, g: int, k: int, mixed: bool, rank: int,
                task_bytes: int) -> None:
    """verify builds a second task on every rank; rank 0 also runs the single-process reference
    (LocalTrainer: the whole model, the whole batch in --grad-accum micro-batches) and keeps every
    step's parameters and gradients (with mixed precision, the optimizer state too)."""
    est.parts["data"] += task_bytes
    if rank != 0:
        return
    b = _ceil_div(cfg.batch_size, cfg.grad_accum)
    reference = Estimate()
    reference.parts["parameters+optimizer"] = (p + g + k) * psi + 4 * psi * mixed  # + float32 gradients
    reference.parts["activations"] = min(cfg.grad_accum, 2) * graph_bytes(shape, b, cfg.n_layer) + \
        working_bytes(shape, b)
    recorded = (4 + 4 + 12 if mixed else p + g) * psi
    reference.parts["data"] = cfg.steps * recorded
    est.add(reference)


# ------------------------------------------------------------------------------------------------
# Available memory
# ------------------------------------------------------------------------------------------------


def available_memory(environ=os.environ) -> tuple[int | None, str]:
    """(bytes available on this host or None if unknown, where the figure comes from)."""
    limit = environ.get(LIMIT_VARIABLE, "").strip()
    if limit:
        if limit.lower() in ("off", "none"):
            return None, f"{LIMIT_VARIABLE}=off"
        try:
            return parse_bytes(limit), f"{LIMIT_VARIABLE}={limit}"
        except ValueError as exc:
            raise ValueError(f"{LIMIT_VARIABLE}={limit!r}: {exc} (or 'off' to skip the memory check)") from None
    found = []
    meminfo = _read("/proc/meminfo")
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    cgroup_max, cgroup_now = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if cgroup_max and cgroup_now and cgroup_max.strip().isdigit() and cgroup_now.strip().isdigit():
        found.append((int(cgroup_max) - int(cgroup_now), "the cgroup's memory.max - memory.current"))
    if found:
        return min(found)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages (sysconf)"
    except (ValueError, OSError, AttributeError):
        pass
    if sys.platform == "darwin":  # macOS compresses and swaps: free pages understate what a run can use
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory (sysconf)"
        except (ValueError, OSError, AttributeError):
            pass
    return None, "unknown"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _device_memory() -> tuple[str, int | None]:
    """(this rank's GPU, its free bytes or None) under the CuPy backend."""
    try:
        runtime = backend.xp().cuda.runtime
        return f"GPU {runtime.getDevice()}", int(runtime.memGetInfo()[0])
    except Exception:  # noqa: BLE001 - a CuPy without the call: skip the device check
        return "GPU", None


# ------------------------------------------------------------------------------------------------
# The check
# ------------------------------------------------------------------------------------------------


def check(cfg, task, world=None, verify: bool = False) -> Estimate:
    """Refuse, on every rank alike, a run whose ranks on some host need more memory than it has.

    Collective when world has more than one rank: every rank sends one record of fixed size (so
    the bytes counted for it are the same on any backend, with any figures), and every rank
    decides from all of them. Returns this rank's estimate.
    """
    size, rank = (1, 0) if world is None else (world.size, world.rank)
    vocab = getattr(task, "vocab_size", None) or getattr(task, "n_classes", 1)
    seq = getattr(task, "seq_len", 0) if cfg.model == "gpt" else 0
    est = estimate(cfg, vocab, seq, size, rank, _task_bytes(task), verify)
    try:
        available, source = available_memory()
        problem = None
    except ValueError as exc:  # a bad REFIMPL_MEMORY_LIMIT: refused with the others, never alone
        available, source, problem = None, "", str(exc)
    device, free = _device_memory() if est.on_device else ("", None)
    mine = _Record(rank, socket.gethostname(), device.ljust(16)[:16], _float(est.total - est.on_device),
                   _float(available), _float(est.on_device), _float(free),
                   *(_float(est.parts[part]) for part in PARTS), _float(est.build), _float(est.step_activations))
    everyone = [mine] if size == 1 else [_Record(*r) for r in world.allgather_object(tuple(mine))]
    pools = [("host", lambda r: r.host, lambda r: r.need_host, lambda r: r.available, source)]
    if device:
        pools.append((device, lambda r: (r.host, r.device), lambda r: r.need_device, lambda r: r.free_device,
                      f"free memory of {device}"))
    for kind, key, need_of, have_of, where in pools:
        if problem:
            break
        sharing = [r for r in everyone if key(r) == key(mine)]
        need = sum(need_of(r) for r in sharing)
        known = [have_of(r) for r in sharing if not math.isnan(have_of(r))]
        if known and need > min(known):
            several_hosts = len({r.host for r in everyone}) > 1
            problem = _message(cfg, est, kind, sharing, several_hosts, need, min(known), where, verify)
    if size == 1:
        if problem:
            raise AgreedError(problem)
    else:
        agree(world, problem)
    return est


@dataclass
class _Record:
    """What a rank tells the others: where it runs and its figures (floats: a fixed size)."""

    rank: int
    host: str
    device: str  # the GPU, padded to 16 characters; blank without CuPy
    need_host: float
    available: float  # NaN when unknown
    need_device: float
    free_device: float
    parameters: float
    activations: float
    buffers: float
    data: float
    build: float
    step_activations: float

    def __iter__(self):
        return iter(vars(self).values())

    def estimate(self) -> Estimate:
        return Estimate(dict(zip(PARTS, (self.parameters, self.activations, self.buffers, self.data))), self.build,
                        self.step_activations)


def _float(x) -> float:
    """A size as a float: NaN for None (unknown), inf beyond what a float holds."""
    if x is None:
        return math.nan
    return float(x) if x < 10**308 else math.inf


def _message(cfg, est: Estimate, kind: str, sharing: list, several_hosts: bool, need: float, have: float,
             where: str, verify: bool) -> str:
    """The one line: what this host's ranks need, the largest rank's parts, what is available, what to do."""
    host = f"host {sharing[0].host}" if several_hosts else "this host"
    who = f"{len(sharing)} ranks on {host}" if len(sharing) > 1 else host
    if kind != "host":
        who += f" ({kind.strip()})"
    largest = max(sharing, key=lambda r: r.need_device if kind != "host" else r.need_host)
    parts = largest.estimate().describe()
    parts = f"rank {largest.rank}: {parts}" if len(sharing) > 1 else parts
    return (f"this run needs about {_size(need)} of memory on {who} ({parts}; estimated before allocating, "
            f"refimpl/tools/runtime/preflight.py), more than the {_size(have)} available ({where}); "
            f"{_advice(cfg, est, verify, len(sharing))}")


def _advice(cfg, est: Estimate, verify: bool, ranks: int) -> str:
    """What to change, for the part of the estimate that is largest (of `ranks` ranks on one host)."""
    pipeline = cfg.pp > 1 or cfg.schedule is not None
    parts = dict(est.parts)
    parts["build"] = est.build if est.build > sum(est.parts.values()) else 0
    parts["process"] = PROCESS_BYTES if ranks > 1 else 0  # one process cannot do without itself
    biggest = max(parts, key=parts.get)
    if biggest == "process":
        fix = f"run fewer ranks on this host: each needs about {_size(PROCESS_BYTES)} before it allocates anything"
    elif biggest == "parameters+optimizer":
        fix = ("use a smaller --n-layer or --d-model" + (" or a smaller vocabulary (--data)" if cfg.data else "") +
               ", shard the model states with --zero 3 (or --zero 2) over more ranks on other hosts" +
               (", or --dtype mixed" if cfg.dtype == "float64" else ""))
    elif biggest == "build":
        fix = "use a smaller --n-layer or --d-model (every rank builds the whole model first), or fewer ranks per host"
    elif biggest == "activations" and est.parts["activations"] > est.step_activations:
        fix = (f"use a smaller --seq-len or --d-model (the held-out evaluation runs "
               f"{EVAL_BATCH[_task_kind(cfg)]} examples at once)")
    elif biggest == "activations":
        fix = "use a smaller --batch-size, --seq-len or --n-layer, " + (
            "a schedule that holds fewer micro-batches (1f1b rather than gpipe)" if pipeline else
            "more micro-batches (--grad-accum)") + ", more ranks on other hosts"
        fix += ", or --checkpoint sqrt" if cfg.model == "gpt" and not pipeline else ""
    elif biggest == "data":
        fix = "use a smaller --batch-size" + (" or fewer --micro-batches" if pipeline else "")
        fix += ", or a smaller --data file" if cfg.data else ""
        fix += ", or fewer --steps (verify keeps every step's parameters)" if verify else ""
    else:
        fix = "use a smaller --bucket-bytes, --prefetch or --seq-len (one causal mask of seq² bytes per layer)"
    fix += ", or fewer ranks on this host" if ranks > 1 and biggest != "process" else ""
    return fix + f"; {LIMIT_VARIABLE}=SIZE sets the memory available (off: no check)"


def _size(nbytes: int) -> str:
    """format_bytes, with TB and PB for the sizes a mistyped flag asks for, and a power of ten beyond
    (math.log10 takes a Python int of any size: no float overflow, no 4300-digit str limit)."""
    if nbytes == math.inf:
        return "10^308+ B"
    if nbytes >= 10**18:
        return f"10^{math.floor(math.log10(nbytes))} B"
    for unit, size in (("PB", 10**15), ("TB", 10**12)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return format_bytes(int(nbytes))
