"""Plan a run: search the parallel configurations of a model on G GPUs for the fastest that fits.

The search space (what Megatron-LM's and DeepSpeed's users choose by hand):

    tp          powers of two up to a node's GPUs, dividing the heads (Llama: the key/value heads
                and the SwiGLU width too)
    cp          for long sequences (seq_len ≥ LONG_SEQUENCE, or up to max_cp when given): the
                divisors C of G / tp with the sequence divisible by 2C (layout.py's chunks), each
                with ring attention, and with Ulysses where tp · C divides the heads (and the
                key/value heads)
    pp          divisors of the layer count (every stage gets whole blocks), with tp · cp · pp dividing G
    dp          G / (tp · cp · pp), dividing the global batch into whole micro-batches
    ZeRO        0, 1, 2, 3
    recompute   none, selective, full (with cp > 1 or flash attention selective is the same as none, and
                not searched)
    schedule    1f1b, interleaved (2 chunks), zb1p, dualpipe  (pp > 1; the generators' own rules)
    micro-batch 1 … 8 sequences
    sequence parallelism on and off (tp > 1)

Each candidate is first checked for memory and ranked with the cost model's cheap pipeline
estimate (the closed forms; model.predict(simulate=False)); the best `refine` candidates that fit
are then predicted with the schedule simulator, and the result is ranked by simulated step time
(ties: less memory). Candidates that do not fit are counted, with the smallest overshoot, so that
"fits nowhere" says by how much.

`--params 70B` picks the model shape: the published GPT shape (GPT-3's family, Brown et al.
2020, Table 2.1; Megatron-LM's weak-scaling models, Narayanan et al. 2021, Table 1) whose
parameter count is nearest in log scale (PARAMETER_SHAPES below; `plan` prints the one it took).
With `--arch llama` it picks among the Llama shapes instead (LLAMA_SHAPES: Llama 2, Touvron et al.
2023, and Llama 3, Dubey et al. 2024, Table 3; the layer counts, widths, heads, key/value heads and
SwiGLU widths of the released models' configurations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .hardware import Cluster
from .model import CHECKPOINTS, Prediction, Run, parameters, predict

# (name, layers, width, heads): GPT-3 (Brown et al. 2020, Table 2.1) and Megatron-LM's
# weak-scaling models (Narayanan et al. 2021, Table 1), sequence 2048.
PARAMETER_SHAPES = (
    ("GPT-3 Small 125M", 12, 768, 12),
    ("GPT-3 Medium 350M", 24, 1024, 16),
    ("GPT-3 Large 760M", 24, 1536, 16),
    ("GPT-3 XL 1.3B", 24, 2048, 16),
    ("GPT-3 2.7B", 32, 2560, 32),
    ("GPT-3 6.7B", 32, 4096, 32),
    ("GPT-3 13B", 40, 5120, 40),
    ("Megatron 18.4B", 40, 6144, 48),
    ("Megatron 39.1B", 48, 8192, 64),
    ("Megatron 76.1B", 60, 10240, 80),
    ("GPT-3 175B", 96, 12288, 96),
    ("Megatron 310.1B", 96, 16384, 128),
    ("Megatron 529.6B", 105, 20480, 128),
    ("Megatron 1T", 128, 25600, 160),
)
# (name, layers, width, heads, key/value heads, SwiGLU width): Llama 2 (Touvron et al. 2023) and Llama 3
# (Dubey et al. 2024, Table 3); Llama 2 70B and Llama 3 70B share their block's shape.
LLAMA_SHAPES = (
    ("Llama 2 7B", 32, 4096, 32, 32, 11008),
    ("Llama 2 13B", 40, 5120, 40, 40, 13824),
    ("Llama 2 / Llama 3 70B", 80, 8192, 64, 8, 28672),
    ("Llama 3 405B", 126, 16384, 128, 8, 53248),
)
PLAN_SCHEDULES = ("1f1b", "interleaved", "zb1p", "dualpipe")
MICRO_BATCH_SIZES = tuple(range(1, 9))
# Sequences this long get context parallelism searched: Llama 3 trained its 8K-token phase at cp 1 and
# its 128K phase at cp 16 (Dubey et al. 2024, §3.3.2, Table 4); shorter sequences keep the search
# (and its cost) as without cp unless `max_cp` asks for it.
LONG_SEQUENCE = 16384
CONTEXT_PARALLEL_CHECKPOINTS = ("none", "full")  # with cp > 1 selective is none: blockwise attention keeps no scores


def shape_for(params: int, seq_len: int = 2048, vocab_size: int = 51200) -> tuple[str, int, int, int]:
    """The published shape whose Ψ (refimpl's count, tied embeddings) is nearest `params` in log scale."""
    def psi(shape):
        _, L, h, a = shape
        return parameters(Run(L, h, a, seq_len, vocab_size, 1, tie_weights=True))
    return min(PARAMETER_SHAPES, key=lambda shape: abs(math.log(psi(shape) / params)))


def llama_shape_for(params: int, seq_len: int = 2048, vocab_size: int = 51200) -> tuple[str, int, int, int, int, int]:
    """The Llama shape (LLAMA_SHAPES) whose Ψ (refimpl's count, untied head) is nearest `params` in log scale."""
    def psi(shape):
        _, L, h, a, kv, ffn = shape
        return parameters(Run(L, h, a, seq_len, vocab_size, 1, arch="llama", kv_heads=kv, ffn_size=ffn))
    return min(LLAMA_SHAPES, key=lambda shape: abs(math.log(psi(shape) / params)))


@dataclass
class Plan:
    best: list[Prediction]  # fastest first (simulated)
    searched: int  # candidates that can run (degrees, batch, schedule rules)
    fitting: int  # of which fit in memory
    not_fitting_least: Prediction | None  # the one that misses by the least, when none fits
    all_points: list[tuple[float, float, bool]] = field(default_factory=list)  # (memory, estimated step, fits)


def _tps(base: Run, gpus: int, cluster: Cluster) -> list[int]:
    return [t for t in (2 ** i for i in range(int(math.log2(cluster.gpus_per_node)) + 1))
            if t <= cluster.gpus_per_node and base.n_head % t == 0 and gpus % t == 0
            and base.key_value_heads % t == 0 and base.ffn % t == 0]


DIVISOR_SEARCH_LIMIT = 10**12  # trial division up to 10^6


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending (trial division up to sqrt(n))."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def _cps(base: Run, gpus: int, tp: int, max_cp: int | None) -> list[tuple[int, str]]:
    """(cp, implementation) pairs to search at this tp: cp 1, and for long sequences (or up to max_cp) every
    divisor C of gpus / tp that cuts the sequence into 2C chunks, ring always, Ulysses where tp · C divides
    the heads. Experts are not combined with cp."""
    limit = max_cp if max_cp is not None else (gpus if base.seq_len >= LONG_SEQUENCE else 1)
    if base.experts or limit <= 1 or gpus // tp > DIVISOR_SEARCH_LIMIT:
        return [(1, "ring")]
    pairs = [(1, "ring")]
    for C in _divisors(gpus // tp)[1:]:
        if C > limit or base.seq_len % (2 * C):
            continue
        pairs.append((C, "ring"))
        if base.n_head % (tp * C) == 0 and base.key_value_heads % (tp * C) == 0:
            pairs.append((C, "ulysses"))
    return pairs


def candidates_estimate(base: Run, gpus: int, cluster: Cluster, max_cp: int | None = None) -> int:
    """An upper bound on the candidates the search makes (`candidates`), before making any: the pipeline
    degrees (the common divisors of the layers and gpus / tp) times the cp choices times every other choice."""
    others = len(MICRO_BATCH_SIZES) * len(PLAN_SCHEDULES) * 2 * 4 * len(CHECKPOINTS)
    total = 0
    for tp in _tps(base, gpus, cluster):
        for cp, _ in _cps(base, gpus, tp, max_cp):
            g = math.gcd(base.n_layer, gpus // (tp * cp))
            total += len(_divisors(g)) if g <= DIVISOR_SEARCH_LIMIT else 2 * math.isqrt(g)
    return total * others


def candidates(base: Run, gpus: int, cluster: Cluster, max_cp: int | None = None):
    """Every Run of the search space for `base`'s model on `gpus` GPUs (module docstring)."""
    for tp in _tps(base, gpus, cluster):
        for cp, cp_impl in _cps(base, gpus, tp, max_cp):
            yield from _candidates_at(replace(base, cp=cp, cp_impl=cp_impl), gpus, tp)


def _candidates_at(base: Run, gpus: int, tp: int):
    """The candidates at one tp and one cp (base.cp, base.cp_impl)."""
    L, B, cp = base.n_layer, base.batch_size, base.cp
    for pp in _divisors(math.gcd(L, gpus // (tp * cp))):  # pp divides the layers, and tp · cp · pp the GPUs
        dp = gpus // (tp * cp * pp)
        schedules = ([("1f1b", None)] if pp == 1
                     else [(s, 2 if s == "interleaved" else None) for s in PLAN_SCHEDULES])
        for mbs in MICRO_BATCH_SIZES:
            if B % (dp * mbs):
                continue
            m = B // (dp * mbs)
            for schedule, chunks in schedules:
                if not _schedule_allows(schedule, pp, m, L, chunks):
                    continue
                for sp in ((False, True) if tp > 1 else (False,)):
                    for zero in range(4):
                        if zero and dp * cp == 1:
                            continue  # nothing to shard over (parameters are replicated over dp · cp)
                        blockwise = cp > 1 or base.attention == "flash"  # selective is none: no scores kept
                        for checkpoint in CONTEXT_PARALLEL_CHECKPOINTS if blockwise else CHECKPOINTS:
                            yield replace(base, dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, schedule=schedule,
                                          chunks=chunks, sequence_parallel=sp, zero=zero, checkpoint=checkpoint)


def _schedule_allows(schedule: str, pp: int, m: int, L: int, chunks) -> bool:
    """The generators' rules (parallel/pipeline/schedules/), without building the lists."""
    if pp == 1:
        return True
    if schedule == "interleaved":
        return m % pp == 0 and L % (pp * chunks) == 0
    if schedule == "dualpipe":
        return pp % 2 == 0 and m % 2 == 0 and m >= 2 * pp
    return True


def plan(base: Run, gpus: int, cluster: Cluster, top: int = 5, refine: int = 20, max_cp: int | None = None) -> Plan:
    """Search (module docstring); `base` gives the model, the batch and the precision; max_cp caps the
    context-parallel degrees searched (None: every one for long sequences, none for short ones)."""
    estimates, searched, least = [], 0, None
    points = []
    for run in candidates(base, gpus, cluster, max_cp):
        searched += 1
        estimate = predict(run, cluster, simulate=False, check=False)
        points.append((estimate.memory_per_gpu_bytes, estimate.step_seconds, estimate.fits))
        if estimate.fits:
            estimates.append(estimate)
        elif least is None or estimate.memory_per_gpu_bytes < least.memory_per_gpu_bytes:
            least = estimate
    if not searched:
        raise ValueError(f"no configuration of {base.n_layer} layers and {base.n_head} heads divides over {gpus} "
                         f"GPUs with batch {base.batch_size}: choose a GPU count that is a multiple of a power of "
                         f"two dividing the heads, and a batch divisible by the data-parallel degree")
    estimates.sort(key=lambda p: (p.step_seconds, p.memory_per_gpu_bytes))
    refined = [predict(p.run, cluster, check=False) for p in estimates[:max(refine, top)]]
    refined.sort(key=lambda p: (p.step_seconds, p.memory_per_gpu_bytes))
    return Plan(refined[:top], searched, len(estimates), least if not estimates else None, points)


def why_slower(p: Prediction, best: Prediction) -> str:
    """The parts of the step in which `p` loses most to `best`."""
    gaps = {part: p.time.get(part, 0.0) - best.time.get(part, 0.0) for part in set(p.time) | set(best.time)}
    worst = sorted((g, part) for part, g in gaps.items() if g > 0)[::-1][:2]
    if not worst:
        return "the same time"
    total = p.step_seconds - best.step_seconds
    return f"+{total:.3g} s: " + ", ".join(f"{part.replace('_', ' ')} +{g:.3g} s" for g, part in worst)
