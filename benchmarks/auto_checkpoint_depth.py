"""The gradient-checkpointing package's headline, reproduced: depth for memory, and its time.

Launch:  python benchmarks/auto_checkpoint_depth.py [--budget 256MiB] [--repeats 5] [--picture PATH]

Salimans and Bulatov's package reports that feed-forward models about 10× larger fit in the same
memory for about 20% more time, with memory growing as √depth instead of linearly on ResNet-like
networks. Two networks of tanh layers of width d (Linear then tanh):

    feed-forward   x_(i+1) = tanh(W_i x_i + b_i)                       a chain: every tensor is
                                                                       an articulation point
    residual       every two layers, the block's input is added back  only the sums are
                   (x = x + tanh(L2(tanh(L1 x)))), a ResNet without    articulation points
                   normalisation

1. Memory against depth. The peak of saved activations is measured by the engine's ledger, for one
   forward and backward, plain and under auto:memory, at depths 8 … 4096. Every saved array of
   these networks has the shape (batch, d), so the peak divided by one such array (A bytes) does
   not depend on batch or width: it is measured once, on a small batch, in units of A.
2. Deepest trainable under a budget. A training step holds the model state (float32 AdamW:
   parameter, gradient and two moments, 16 bytes per parameter) and the peak activations. With
   width d = 64 and batch 4096 (A = 1 MiB), the deepest n whose state + peak fits the budget,
   found by bisection over measured peaks. Checkpointing buys depth: the state grows linearly in
   n either way, so width (which grows the state as d²) is bounded by the state, not by the
   activations.
3. Step time. Forward, backward and AdamW step, plain and auto:memory, the steps interleaved
   round-robin in one process, medians of --repeats, one BLAS thread, glibc told to keep freed
   memory (as bench_checkpoint.py measures: MALLOC_MMAP_THRESHOLD_=32MiB,
   MALLOC_TRIM_THRESHOLD_=16GiB, MALLOC_TOP_PAD_=512MiB, set for a child process), at depth 64,
   width 256, batch 512. Beside it: the GEMM model, 1 + (matrix products re-run) / (3 × the
   plain step's forward products: a backward costs two), the operation forwards counted by the
   engine, and the one-extra-forward bound (a forward is about a third of forward+backward: +33%).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from refimpl.autograd import Tensor, ops, saved_tensors
from refimpl.autograd.recording import counting_forwards
from refimpl.checkpointing import AutoCheckpoint
from refimpl.nn.layers import Linear
from refimpl.nn.module import Module, ModuleList
from refimpl.optim import AdamW

DEPTHS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
KEEP_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "17179869184",
               "MALLOC_TOP_PAD_": "536870912"}


class Network(Module):
    """n tanh layers of width d; residual: every two layers the pair's input is added back."""

    def __init__(self, n: int, d: int, residual: bool, seed: int = 0) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.layers = ModuleList(Linear(d, d, rng, std=1.0 / math.sqrt(d), dtype="float32") for _ in range(n))
        self.residual = residual

    def forward(self, x):
        skip = x
        for i, layer in enumerate(self.layers):
            x = ops.tanh(layer(x))  # (N, d)
            if self.residual and i % 2 == 1:
                x = x + skip
                skip = x
        return x


def peak_in_arrays(n: int, residual: bool, plan: str, batch: int = 4, d: int = 8) -> float:
    """Peak saved bytes of one forward+backward (second step), in units of one (batch, d) array."""
    model = Network(n, d, residual)
    fn = model if plan == "none" else AutoCheckpoint(model, plan.split(":")[1])
    x0 = np.random.default_rng(1).standard_normal((batch, d)).astype("float32")
    for _ in range(2):
        base = saved_tensors.live_bytes
        saved_tensors.reset_peak()
        y = fn(Tensor(x0))
        (y * y).sum().backward()
        assert saved_tensors.live_bytes == base
    return (saved_tensors.peak_bytes - base) / x0.nbytes


def deepest(budget: int, residual: bool, plan: str, d: int = 64, batch: int = 4096) -> tuple[int, int, int]:
    """(deepest n that fits, its model-state bytes, its peak activation bytes), by bisection."""
    state_per_layer = 16 * (d * d + d)
    array = batch * d * 4
    cache: dict = {}

    def total(n):
        if n not in cache:
            cache[n] = (state_per_layer * n, round(peak_in_arrays(n, residual, plan) * array))
        return sum(cache[n])

    low, high = 2, 4
    while total(high) <= budget:
        low, high = high, high * 2
    while high - low > 1 + (low >= 64) * (low // 64):  # to within 1/64 (depths above 64 are even anyway)
        mid = (low + high) // 2 // 2 * 2
        low, high = (mid, high) if total(mid) <= budget else (low, mid)
    return low, *cache[low]


def step_times(repeats: int, n: int = 64, d: int = 256, batch: int = 512) -> dict:
    """Median step time per network and plan, and the operation forwards per step."""
    out = {}
    with threadpool_limits(1):
        for residual in (False, True):
            runs = {}
            for plan in ("none", "auto:memory"):
                model = Network(n, d, residual)
                fn = model if plan == "none" else AutoCheckpoint(model, "memory")
                runs[plan] = (model, fn, AdamW(model.parameters(), lr=1e-4))
            x = Tensor(np.random.default_rng(0).standard_normal((batch, d)).astype("float32"))
            times = {plan: [] for plan in runs}
            calls = {}
            for rep in range(repeats + 1):
                for plan, (model, fn, opt) in runs.items():
                    start = time.perf_counter()
                    with counting_forwards() as counted:
                        y = fn(x)
                        (y * y).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    if rep:  # the first round records the plan and warms up
                        times[plan].append(time.perf_counter() - start)
                    calls[plan] = (sum(counted.values()), counted["LinearFunction"])
            base = statistics.median(times["none"])
            out["residual" if residual else "feed-forward"] = {
                plan: {"ratio": statistics.median(t) / base, "seconds": statistics.median(t),
                       "forwards_ratio": calls[plan][0] / calls["none"][0],
                       # a step's products: n forward, 2n backward (input and weight gradients)
                       "gemm_model": 1 + (calls[plan][1] - calls["none"][1]) / (3 * calls["none"][1])}
                for plan, t in times.items()}
    return out


def parse_bytes(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30}
    for unit, scale in units.items():
        if text.lower().endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def draw(curves: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415 - optional dependency (pip install -e '.[viz]')
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional dependency

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, ("feed-forward", "residual")):
        for plan, style in (("none", "o-"), ("auto:memory", "s-")):
            ax.loglog(DEPTHS, curves[name][plan], style, label=plan)
        ax.loglog(DEPTHS, [2 * math.sqrt(2 * n) for n in DEPTHS], "k:", label="2√(2n)")
        ax.set_title(f"{name} network")
        ax.set_xlabel("depth n (layers)")
        ax.set_ylabel("peak saved activations (arrays of one layer)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="256MiB", help="memory budget for the depth search (default 256MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per plan (default 5)")
    parser.add_argument("--picture", default="docs/images/auto_checkpointing.png")
    parser.add_argument("--timing-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.timing_only:
        print(step_times(args.repeats))
        return

    curves = {name: {plan: [peak_in_arrays(n, name == "residual", plan) for n in DEPTHS]
                     for plan in ("none", "auto:memory")} for name in ("feed-forward", "residual")}
    print("Peak saved activations, in arrays of one layer (batch x width):\n")
    print("| network | plan | " + " | ".join(f"n={n}" for n in DEPTHS) + " |")
    print("|---|---|" + "---|" * len(DEPTHS))
    for name, by_plan in curves.items():
        for plan, values in by_plan.items():
            print(f"| {name} | {plan} | " + " | ".join(f"{v:g}" for v in values) + " |")
    draw(curves, args.picture)
    print(f"\n(picture: {args.picture})\n")

    budget = parse_bytes(args.budget)
    print(f"Deepest trainable under {args.budget} (width 64, batch 4096, float32 AdamW):\n")
    print("| network | plan | deepest n | model state | peak activations | depth × |")
    print("|---|---|---|---|---|---|")
    for name in ("feed-forward", "residual"):
        plain = deepest(budget, name == "residual", "none")
        auto = deepest(budget, name == "residual", "auto:memory")
        for plan, (n, state, peak) in (("none", plain), ("auto:memory", auto)):
            times = "" if plan == "none" else f"{n / plain[0]:.1f}"
            print(f"| {name} | {plan} | {n} | {state / 2**20:.1f} MiB | {peak / 2**20:.1f} MiB | {times} |")

    env = dict(os.environ, **KEEP_MEMORY)
    done = subprocess.run([sys.executable, __file__, "--timing-only", "--repeats", str(args.repeats)],
                          capture_output=True, text=True, env=env, check=True)
    timing = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's dict literal
    print("\nStep time, depth 64, width 256, batch 512 (allocator keeping its memory):\n")
    print("| network | plan | step time (measured) | GEMM model | operation forwards | one-extra-forward bound "
          "| package |")
    print("|---|---|---|---|---|---|---|")
    for name, by_plan in timing.items():
        for plan, t in by_plan.items():
            print(f"| {name} | {plan} | {t['ratio']:.3f} ({t['seconds'] * 1e3:.0f} ms) | {t['gemm_model']:.3f} | "
                  f"{t['forwards_ratio']:.3f} | {'' if plan == 'none' else '≤ 1.33'} | "
                  f"{'' if plan == 'none' else '≈ 1.2'} |")


if __name__ == "__main__":
    main()
