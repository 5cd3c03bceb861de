"""Calibration: measure this machine's rates so that the cost model (model.py) can predict it.

The cost model needs, per "GPU" (here: per MPI rank on a CPU), the rates of four kinds of work and
the two numbers of a link. This module measures each one the way refimpl itself runs it, and
returns a `hardware.Cluster` whose efficiencies are 1.0 (a measured rate is already sustained):

    peak_flops_fp32    GEMM rate of float32: numpy.matmul on the three products of one of refimpl's
                       linear layers of width h on N tokens (the forward (N, h) @ (h, 4h), the input
                       gradient (N, 4h) @ (4h, h), the weight gradient (h, N) @ (N, 4h)), each
                       2·N·h·4h FLOPs; rate = Σ FLOPs / Σ mean seconds
    peak_flops_fp64    the same in float64
    peak_flops         "mixed" trains with float16 storage and float32 arithmetic in refimpl
                       (NumPy has no 16-bit matrix unit), so the float32 rate
    attention          efficiency of the attention core: the batched products q kᵀ (b, a, s, d) @
                       (b, a, d, s) and p v, 2·N·s·h FLOPs each (N = b·s, h = a·d), at the float32
                       rate; stored as the ratio to the GEMM rate (model.Efficiency.attention)
    memory_bandwidth   bytes/s of elementwise kernels: numpy.add(x, y, out=z), counted as STREAM
                       does (two arrays read, one written: 3·n·itemsize bytes), on arrays of one
                       block's largest activation (N·4h elements) -- the size refimpl's memory-bound
                       kernels work on, which at these widths sits in the caches, not DRAM
    memory efficiency  the share of that bandwidth NumPy's real memory-bound kernels reach (layer norm,
                       softmax and tanh-GeLU make several passes and compute transcendentals): one
                       refimpl Block of width h on N tokens, forward and backward, is timed, and the
                       efficiency is what makes the model's time of that Block the measured one
                       (`memory_efficiency`); calibrate at the micro-batch you will predict (--tokens)
    optimizer          the same share for refimpl's AdamW update of one float32 parameter of 2²⁰
                       elements, priced at 28 bytes per element (`optimizer_efficiency`)
    op_overhead        what every autograd operation costs however small (Python, the engine's
                       bookkeeping, NumPy's call overhead): a GPT Block of width 8 on 4 tokens, its
                       forward and backward timed together, divided by 3·ops (ops: the autograd
                       operations of one Block forward, `block_operations`); 3 because the model
                       charges the overhead once in each of F, I and W
    links              α and β of the Hockney model t(n) = α + n/β, fitted by least squares to the
                       times of messages of several sizes n (`fit_alpha_beta`):
                         point-to-point: ping-pong of Send/Recv (Comm.send, Comm.recv) between rank
                           pairs (0, 1), (2, 3), ...: one-way time = median round trip / 2;
                         all-reduce: Comm.allreduce (MPI's built-in, through refimpl's wrapper) on g
                           ranks (the median call of the slowest rank), whose ring model (collectives.py)
                           is 2(g − 1)(α + n/(gβ)): the fitted line t = A + S·n gives α = A / (2(g − 1)),
                           β = 2(g − 1) / (g·S).
                       The cluster file stores the all-reduce's α and β (the collectives are most
                       of refimpl's traffic; the point-to-point fit is reported beside it), for both
                       the intra- and the inter-node link (one machine has only one kind).

Every compute rate is measured by all ranks at the same time, each with the BLAS thread budget
refimpl gives a rank (parallel/threads.py: max(1, cores // ranks on this node)), and averaged over
the ranks: with R ranks on C < R cores each rank gets C/R of the machine, and the file says so. So
calibrate with as many ranks as the runs you will predict (`mpiexec -n 4 python -m refimpl
calibrate` for 4-rank runs); gpus_per_node is that number of ranks.

One process cannot measure a link: there is nobody to talk to. Then the links are *estimated* as
a shared-memory copy: the same α–β fit on messages that the one-process communicator sends to
itself (Comm.isend + Comm.recv on LocalComm: one copy into a mailbox and one out of it), which is a
lower bound of what MPI's shared-memory transport costs; the `source` field says "links estimated
(one process)". Measure them for real with `mpiexec -n 2 python -m refimpl calibrate`.

The least-squares fit (weighted by 1/t², so that every size counts by its relative error, not the
largest message alone): minimise Σ_i ((t_i − α − x·n_i) / t_i)² over (α, x), x = 1/β; with exact
timings t_i = α + n_i/β it returns α and β exactly. A negative α (noise at tiny sizes) is set to
0 and x refitted through the origin. Timings that do not grow with n have no bandwidth: an error.

Production calibrations (NCCL's nccl-tests, Calculon's and llm-analysis's efficiency tables) do
the same with GPU kernels and bus bandwidth; what they measure per kernel class, this measures per
NumPy kernel class.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass, field

import numpy as np

from refimpl.autograd.tensor import Tensor
from refimpl.nn.layers import Block, LlamaBlock
from refimpl.optim.adamw import AdamW
from refimpl.parallel.comm import get_world
from refimpl.tools.cluster.model import Efficiency, Run, action_times
from refimpl.tools.runtime import threads

from .hardware import Cluster

DEFAULT_WIDTH = 256  # h of the layers whose GEMMs are timed (the benchmark's GPT)
DEFAULT_TOKENS = 512  # N = micro-batch × sequence
DEFAULT_SEQ = 64  # s of the attention core
MESSAGE_SIZES = tuple(2**k for k in (3, 10, 14, 16, 18, 20, 22))  # bytes
QUICK_SIZES = tuple(2**k for k in (3, 14, 18, 22))


# ------------------------------------------------------------------------------------------------
# The fit
# ------------------------------------------------------------------------------------------------


def fit_alpha_beta(sizes, seconds) -> tuple[float, float]:
    """(α seconds, β bytes/s) of t = α + n/β by least squares, weighted by 1/t² (module docstring).

    Pairs with a non-finite or non-positive time are left out; fewer than two sizes left, or
    times that do not grow with the size, raise ValueError."""
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if n.shape != t.shape:
        raise ValueError(f"fit: {n.size} sizes but {t.size} times")
    keep = np.isfinite(n) & np.isfinite(t) & (t > 0) & (n >= 0)
    n, t = n[keep], t[keep]
    if np.unique(n).size < 2:
        raise ValueError("fit: need timings of at least two different message sizes")
    w = 1.0 / t  # rows scaled by 1/t: residuals are relative errors
    A = np.stack([w, n * w], axis=1)  # (k, 2): [1, n] / t
    (alpha, x), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if alpha < 0:  # noise at the small sizes: the line through the origin instead
        alpha, x = 0.0, float(np.sum(n * w * w * t) / np.sum((n * w) ** 2))
    if not (x > 0 and math.isfinite(x)):
        raise ValueError("fit: the times do not grow with the message size; no bandwidth can be fitted "
                         "(a noisy machine? run again, or without --quick)")
    return float(alpha), float(1.0 / x)


def allreduce_link(intercept: float, slope: float, g: int) -> tuple[float, float]:
    """(α, β) of one ring step from an all-reduce's fitted t = intercept + slope·n on g ranks:
    2(g − 1)(α + n/(gβ)) gives α = intercept / (2(g − 1)), β = 2(g − 1) / (g·slope)."""
    return intercept / (2 * (g - 1)), 2 * (g - 1) / (g * slope)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


MIN_SECONDS = 0.15  # each timing runs at least this long, so that the ranks measure at the same time


def mean_seconds(fn, repeats: int, warmup: int = 1, min_seconds: float = MIN_SECONDS) -> float:
    """Mean wall time of fn() over at least `repeats` calls and at least `min_seconds`, after
    `warmup` untimed ones. The mean over a window, not the median of the calls: when ranks share
    cores, the scheduler's time slices (milliseconds) are longer than one short call, and the
    median would pick the calls that ran alone."""
    for _ in range(warmup):
        fn()
    calls = 0
    began = time.perf_counter()
    while calls < repeats or time.perf_counter() - began < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - began) / calls


def gemm_rate(dtype: str, tokens: int = DEFAULT_TOKENS, width: int = DEFAULT_WIDTH, repeats: int = 7,
              min_seconds: float = MIN_SECONDS) -> float:
    """FLOP/s of a linear layer's three products (forward, input gradient, weight gradient)."""
    rng = np.random.default_rng(0)
    N, h = tokens, width
    x = rng.standard_normal((N, h)).astype(dtype)  # (N, h)
    w = rng.standard_normal((h, 4 * h)).astype(dtype)  # (h, 4h)
    g = rng.standard_normal((N, 4 * h)).astype(dtype)  # (N, 4h)
    seconds = (mean_seconds(lambda: x @ w, repeats, min_seconds=min_seconds)  # (N, 4h)
               + mean_seconds(lambda: g @ w.T, repeats, min_seconds=min_seconds)  # (N, h)
               + mean_seconds(lambda: x.T @ g, repeats, min_seconds=min_seconds))  # (h, 4h)
    return 3 * 2 * N * h * 4 * h / seconds


def attention_rate(dtype: str = "float32", tokens: int = DEFAULT_TOKENS, width: int = DEFAULT_WIDTH,
                   seq: int = DEFAULT_SEQ, head_dim: int = 64, repeats: int = 7,
                   min_seconds: float = MIN_SECONDS) -> float:
    """FLOP/s of the attention core's batched products q kᵀ and p v (b = N/s sequences, a = h/d heads)."""
    rng = np.random.default_rng(1)
    b, a, s, d = max(1, tokens // seq), max(1, width // head_dim), seq, min(head_dim, width)
    q = rng.standard_normal((b, a, s, d)).astype(dtype)  # (b, a, s, d)
    k = rng.standard_normal((b, a, d, s)).astype(dtype)  # (b, a, d, s)
    p = rng.standard_normal((b, a, s, s)).astype(dtype)  # (b, a, s, s)
    seconds = (mean_seconds(lambda: q @ k, repeats, min_seconds=min_seconds)
               + mean_seconds(lambda: p @ q, repeats, min_seconds=min_seconds))
    return 2 * (2 * b * a * s * s * d) / seconds


def memory_bandwidth(elements: int = DEFAULT_TOKENS * 4 * DEFAULT_WIDTH, repeats: int = 15,
                     min_seconds: float = MIN_SECONDS) -> float:
    """Bytes/s of numpy.add(x, y, out=z) on float32 arrays of `elements`, counted as 3·n·4 bytes."""
    x, y, z = (np.full(elements, v, dtype=np.float32) for v in (1.0, 2.0, 0.0))
    return 3 * x.nbytes / mean_seconds(lambda: np.add(x, y, out=z), repeats, 2, min_seconds)


def _tiny_block():
    return Block(8, 2, 4, np.random.default_rng(0), dtype="float32")


def count_operations(output) -> int:
    """The autograd operations (Function nodes) the graph ending at `output` holds."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        stack.extend(getattr(x, "grad_fn", None) for x in fn.inputs)
    return len(seen)


def block_operations(width: int = 8, heads: int = 2, seq: int = 4, dropout: float = 0.0, arch: str = "gpt2") -> int:
    """Autograd operations of one block's forward, counted in its graph: GPT-2's Block (pre-LN, dense MLP),
    or arch="llama": the LlamaBlock (one key/value head shared by the `heads` query heads, SwiGLU of 3·width)."""
    if arch == "llama":
        block = LlamaBlock(width, heads, 1, 3 * width, seq, np.random.default_rng(0), dropout=dropout, dtype="float32")
    else:
        block = Block(width, heads, seq, np.random.default_rng(0), dropout=dropout, dtype="float32")
    x = Tensor(np.zeros((1, seq, width), dtype=np.float32), requires_grad=True)
    return count_operations(block(x))


def block_seconds(width: int, tokens: int, seq: int = DEFAULT_SEQ, dtype: str = "float32", repeats: int = 5,
                  min_seconds: float = MIN_SECONDS) -> float:
    """Seconds of one refimpl GPT Block's forward and backward on `tokens` tokens (sequences of `seq`)."""

    heads = max(1, width // 64)
    block = Block(width, heads, seq, np.random.default_rng(0), dtype=dtype)
    x = Tensor(np.random.default_rng(1).standard_normal((max(1, tokens // seq), seq, width)).astype(dtype),
               requires_grad=True)

    def step():
        block(x).sum().backward()

    return mean_seconds(step, repeats, 1, min_seconds)


def memory_efficiency(cluster: Cluster, measured: float, width: int, tokens: int, seq: int = DEFAULT_SEQ,
                      dtype: str = "float32") -> float:
    """The efficiency of memory-bound kernels that makes the model's Block time the measured one.

    The model times one block as A + B/e: GEMMs, attention core and per-operation overhead (A),
    and the memory-bound kernels' bytes at e times the bandwidth (B/e). NumPy's layer norm,
    softmax and tanh-GeLU make several passes and compute transcendentals, which numpy.add's
    bandwidth does not see; the real Block does. Two evaluations give A and B (T(1) = A + B,
    T(1/2) = A + 2B); e = B / (measured − A), kept within [0.02, 4]."""

    run = Run(n_layer=1, d_model=width, n_head=max(1, width // 64), seq_len=seq, vocab_size=2,
              batch_size=max(1, tokens // seq), micro_batch_size=max(1, tokens // seq), dtype=dtype)
    base = {**cluster.efficiency}

    def block(e: float) -> float:
        times = action_times(run, cluster, Efficiency(**{**base, "memory": e}), last=False)
        return times.total("F") + times.total("I") + times.total("W")

    b = block(0.5) - block(1.0)
    a = block(1.0) - b
    if measured <= a or b <= 0:
        return 4.0
    return min(4.0, max(0.02, b / (measured - a)))


def optimizer_efficiency(bandwidth: float, elements: int = 1 << 20, repeats: int = 5,
                         min_seconds: float = MIN_SECONDS) -> float:
    """refimpl's AdamW update on one float32 parameter of `elements`, as a share of `bandwidth`:
    the cost model prices an update at G + 2K + 2P bytes per parameter (model._optimizer_seconds;
    float32: 4 + 16 + 8 = 28)."""

    param = np.ones(elements, dtype=np.float32)
    grad = np.full(elements, 1e-3, dtype=np.float32)
    adam = AdamW(lr=1e-3)
    state = adam.init_state(param)
    seconds = mean_seconds(lambda: adam.update(param, grad, state), repeats, 1, min_seconds)
    return min(4.0, 28 * elements / seconds / bandwidth)


def operation_overhead(repeats: int = 60, min_seconds: float = MIN_SECONDS) -> float:
    """Seconds per autograd operation and per action (F, I, W): a width-8 Block's forward and
    backward, divided by 3 × its operations."""

    block = _tiny_block()
    x = Tensor(np.ones((1, 4, 8), dtype=np.float32), requires_grad=True)
    ops = block_operations()

    def step():
        block(x).sum().backward()

    return mean_seconds(step, repeats, 3, min_seconds) / (3 * ops)


# ------------------------------------------------------------------------------------------------
# Links
# ------------------------------------------------------------------------------------------------


def _p2p_times(world, sizes, repeats: int) -> list[float]:
    """One-way seconds per size: the median round trip / 2 of a ping-pong between rank pairs (0, 1),
    (2, 3), ...; a rank without a partner (odd world) waits. One process: a message to itself
    through the mailbox. Medians, not means: a link's α and β are what a message costs when both
    ends run, and one descheduled round trip would otherwise decide a small size's time."""
    r, n = world.rank, world.size
    peer = r ^ 1 if n > 1 else 0

    def round_trip(buf):
        if n == 1:
            world.isend(buf, 0).wait()
            world.recv(buf, 0)
        elif peer >= n:
            pass
        elif r % 2 == 0:
            world.send(buf, peer)
            world.recv(buf, peer)
        else:
            world.recv(buf, peer)
            world.send(buf, peer)

    return [median / (2 if n > 1 else 1) for median in _median_seconds(world, sizes, repeats, round_trip)]


def _allreduce_times(world, sizes, repeats: int) -> list[float]:
    """Seconds per all-reduce of each size: the median call, on the slowest rank."""
    medians = _median_seconds(world, sizes, repeats, world.allreduce)
    return [world.allreduce_value(median, op="max") for median in medians]


def _median_seconds(world, sizes, repeats: int, call) -> list[float]:
    """The median seconds of `repeats` calls of call(buf), per size in bytes, after a barrier."""
    out = []
    for size in sizes:
        buf = np.zeros(max(1, size // 4), dtype=np.float32)
        world.barrier()
        times = np.zeros(repeats)
        for i in range(repeats):
            start = time.perf_counter()
            call(buf)
            times[i] = time.perf_counter() - start
        out.append(float(np.median(times)))
    return out


@dataclass
class Calibration:
    """What was measured (for the table) and the Cluster it makes."""

    cluster: Cluster
    ranks: int
    threads: int | None
    links_measured: bool
    p2p: dict = field(default_factory=dict)  # {"sizes", "seconds", "alpha", "beta"}
    allreduce: dict = field(default_factory=dict)  # the same, plus the ring step's alpha and beta
    rates: dict = field(default_factory=dict)  # measured quantities by name
    block_operations: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"cluster": self.cluster.as_dict(), "ranks": self.ranks, "threads": self.threads,
                "links_measured": self.links_measured, "p2p": self.p2p, "allreduce": self.allreduce,
                "rates": self.rates, "block_operations": self.block_operations, "seconds": self.seconds}


def _mean_over_ranks(world, values: dict) -> dict:
    every = world.allgather_object(values)
    return {k: float(np.mean([v[k] for v in every])) for k in values}


def cpu_name() -> str:
    """The processor's model name (from /proc/cpuinfo), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(world=None, quick: bool = False, width: int = DEFAULT_WIDTH, tokens: int = DEFAULT_TOKENS,
              name: str = "local") -> Calibration:
    """Measure every rate (module docstring) on every rank of `world` at once; the Cluster they make."""

    world = world or get_world()
    began = time.perf_counter()
    window = MIN_SECONDS / 5 if quick else MIN_SECONDS
    reps = 3 if quick else 7
    world.barrier()
    rates = {
        "gemm_float32": gemm_rate("float32", tokens, width, reps, window),
        "gemm_float64": gemm_rate("float64", tokens, width, reps, window),
        "attention_float32": attention_rate("float32", tokens, width, repeats=reps, min_seconds=window),
        "memory_bandwidth": memory_bandwidth(tokens * 4 * width, 2 * reps, window),
        "op_overhead": operation_overhead(20 if quick else 60, window),
    }
    rates = _mean_over_ranks(world, rates)

    sizes = QUICK_SIZES if quick else MESSAGE_SIZES
    link_reps = 9 if quick else 25
    p2p_t = _p2p_times(world, sizes, link_reps)
    if world.size > 1:  # the pairs' mean (a rank without a partner measured nothing)
        pairs = world.allgather_object(p2p_t)[: world.size - world.size % 2]
        p2p_t = [float(np.mean(v)) for v in zip(*pairs)]
    p2p_alpha, p2p_beta = fit_alpha_beta(sizes, p2p_t)
    p2p = {"sizes": list(sizes), "seconds": p2p_t, "alpha": p2p_alpha, "beta": p2p_beta}
    if world.size > 1:
        ar_t = _allreduce_times(world, sizes, link_reps)
        intercept, inverse_slope = fit_alpha_beta(sizes, ar_t)
        alpha, beta = allreduce_link(intercept, 1.0 / inverse_slope, world.size)
        allreduce = {"sizes": list(sizes), "seconds": ar_t, "alpha": intercept, "beta": inverse_slope,
                     "ring_alpha": alpha, "ring_beta": beta}
    else:
        alpha, beta, allreduce = p2p_alpha, p2p_beta, {}

    budget = threads.current()
    local_ranks = world.node_size() if world.size > 1 else 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    ratio = rates["attention_float32"] / rates["gemm_float32"]
    how = "all-reduce fit" if world.size > 1 else "links estimated (one process: a copy through the mailbox)"
    # The memory-bound kernels' efficiency, from one real Block (every rank at once, like the rates).
    provisional = Cluster(
        name=name, peak_flops=rates["gemm_float32"], peak_flops_fp32=rates["gemm_float32"],
        memory_bandwidth=rates["memory_bandwidth"], memory_bytes=1, gpus_per_node=1, intra_bandwidth=1.0,
        intra_latency=0.0, inter_bandwidth=1.0, inter_latency=0.0, op_overhead=rates["op_overhead"],
        peak_flops_fp64=rates["gemm_float64"],
        efficiency={"gemm": 1.0, "memory": 1.0, "network": 1.0, "attention": ratio})
    world.barrier()
    rates["block_seconds"] = _mean_over_ranks(world, {"t": block_seconds(width, tokens, repeats=reps,
                                                                          min_seconds=window)})["t"]
    rates["memory_efficiency"] = memory_efficiency(provisional, rates["block_seconds"], width, tokens)
    rates["optimizer_efficiency"] = _mean_over_ranks(world, {"e": optimizer_efficiency(
        rates["memory_bandwidth"], repeats=reps, min_seconds=window)})["e"]
    cluster = Cluster(
        name=name, peak_flops=rates["gemm_float32"], peak_flops_fp32=rates["gemm_float32"],
        memory_bandwidth=rates["memory_bandwidth"], memory_bytes=int(memory // max(1, local_ranks)) or 1,
        gpus_per_node=local_ranks, intra_bandwidth=beta, intra_latency=alpha, inter_bandwidth=beta,
        inter_latency=alpha, op_overhead=rates["op_overhead"], peak_flops_fp64=rates["gemm_float64"],
        efficiency={"gemm": 1.0, "memory": rates["memory_efficiency"], "network": 1.0, "attention": ratio,
                    "optimizer": rates["optimizer_efficiency"]},
        source=(f"calibrated {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({cpu_name()}, "
                f"{os.cpu_count()} CPUs) with {world.size} rank(s), "
                f"{budget.threads if budget and budget.threads else 'default'} BLAS thread(s) each, "
                f"GEMMs of width {width} on {tokens} tokens; {how}"))
    return Calibration(cluster=cluster, ranks=world.size, threads=budget.threads if budget else None,
                       links_measured=world.size > 1, p2p=p2p, allreduce=allreduce, rates=rates,
                       block_operations=block_operations(), seconds=time.perf_counter() - began)
