"""Step-time overhead of activation checkpointing on a 16-block GPT, beside its arithmetic count.

Launch:  python benchmarks/bench_checkpoint.py [--repeats 7] [--layers 16] [--json]

It measures twice, each time all plans in one process: with the default allocator settings, and in
a child process where glibc's malloc is told to keep freed memory (MALLOC_MMAP_THRESHOLD_=32MiB,
MALLOC_TRIM_THRESHOLD_=16GiB, MALLOC_TOP_PAD_=512MiB). By default glibc hands large freed arrays
back to the kernel, and the next step's fresh activations page-fault their memory in again (the
kernel zeroes every page); a plan that holds less memory pays less of that. The second run takes
that effect out, so its ratios show the recomputation's cost alone.

Model: 16 blocks, d_model 256, 4 heads, context 64, batch 4, float32, dropout 0.1, one BLAS thread
(threadpoolctl), AdamW. One training step = forward, backward, optimizer step. For each plan:

  measured      median step time / median step time without checkpointing, the plans' steps
                interleaved round-robin in one run (shared machines drift; ratios within one run
                are what can be compared);
  extra fwd     extra block forwards per step, counted by a forward pre-hook on every block;
  GEMM model    1 + extra · (one block's forward GEMM FLOPs) / (the step's GEMM FLOPs), where the
                step's GEMMs are forward + 2 × forward (input and weight gradients) for every block
                and the head: the arithmetic count of the recomputation;
  time model    1 + extra · (measured time of one block forward without grad) / (step without
                checkpointing): the same count in seconds, elementwise work included;
  peak          the step's peak saved bytes (engine ledger) / the same without checkpointing;
  page faults   minor page faults per step (getrusage), the cost the allocator settings change.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from refimpl.autograd import Tensor, no_grad, saved_tensors
from refimpl.checkpointing.gpt_blocks import gpt_forward
from refimpl.checkpointing.measure import count_forward_calls
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F
from refimpl.optim import AdamW

CONFIG = dict(vocab_size=64, seq_len=64, n_layer=16, n_head=4, d_model=256, dropout=0.1, dtype="float32")
BATCH = 4
PLANS = ["none", "sqrt", "every:1", "revolve:4"]


def gemm_flops(cfg: GPTConfig, batch: int) -> tuple[int, int]:
    """(one block's forward GEMM FLOPs, the whole step's GEMM FLOPs without checkpointing)."""
    N, C, T, H = batch * cfg.seq_len, cfg.d_model, cfg.seq_len, cfg.n_head
    block = 2 * N * C * (3 * C + C + 4 * C + 4 * C)  # qkv, proj, mlp up, mlp down
    block += 2 * 2 * batch * H * T * T * (C // H)  # q kᵀ and att v
    head = 2 * N * C * cfg.vocab_size
    return block, 3 * (cfg.n_layer * block + head)


KEEP_MEMORY = dict(MALLOC_MMAP_THRESHOLD_=str(32 * 2**20), MALLOC_TRIM_THRESHOLD_=str(16 * 2**30),
                   MALLOC_TOP_PAD_=str(512 * 2**20))


def measure(args) -> dict:
    """All plans, interleaved, in this process."""
    cfg = GPTConfig(**dict(CONFIG, n_layer=args.layers))
    idx = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, cfg.seq_len))
    results = {}
    with threadpool_limits(limits=1):
        runs = {}
        for plan in PLANS:
            model = GPT(cfg, seed=0)
            runs[plan] = (model, AdamW(model.parameters(), lr=1e-4, weight_decay=0.0))

        def step(plan):
            model, opt = runs[plan]
            base = saved_tensors.live_bytes
            saved_tensors.reset_peak()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            with count_forward_calls(model.blocks) as counter:
                start = time.perf_counter()
                F.cross_entropy(gpt_forward(model, idx, plan), idx).backward()
                opt.step()
                opt.zero_grad()
                seconds = time.perf_counter() - start
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            return seconds, counter.total - cfg.n_layer, saved_tensors.peak_bytes - base, faults

        times = {plan: [] for plan in PLANS}
        faults = {plan: [] for plan in PLANS}
        for plan in PLANS:
            step(plan)  # warm-up
        for _ in range(args.repeats):
            for plan in PLANS:
                seconds, extra, peak, n_faults = step(plan)
                times[plan].append(seconds)
                faults[plan].append(n_faults)
                results[plan] = dict(extra_block_forwards=extra, peak_bytes=peak)
        model = runs["none"][0]
        x = model.embed(idx).data
        block_times = []
        with no_grad():
            for _ in range(args.repeats):
                start = time.perf_counter()
                model.blocks[0](Tensor(x))
                block_times.append(time.perf_counter() - start)
    block_flops, step_flops = gemm_flops(cfg, BATCH)
    t_none = statistics.median(times["none"])
    t_block = statistics.median(block_times)
    for plan in PLANS:
        r = results[plan]
        r["step_seconds"] = statistics.median(times[plan])
        r["measured"] = r["step_seconds"] / t_none
        r["gemm_model"] = 1 + r["extra_block_forwards"] * block_flops / step_flops
        r["time_model"] = 1 + r["extra_block_forwards"] * t_block / t_none
        r["peak_vs_none"] = r["peak_bytes"] / results["none"]["peak_bytes"]
        r["page_faults_per_step"] = statistics.median(faults[plan])
    return dict(config=dict(CONFIG, n_layer=cfg.n_layer), batch=BATCH, repeats=args.repeats,
                step_seconds_none=t_none, block_forward_seconds=t_block, block_forward_flops=block_flops,
                step_flops=step_flops, plans=results)


def table(title: str, m: dict) -> str:
    c = m["config"]
    lines = [f"{title}: GPT {c['n_layer']} blocks, d_model {c['d_model']}, context {c['seq_len']}, batch {m['batch']}, "
             f"{c['dtype']}, dropout {c['dropout']}, 1 BLAS thread; step without checkpointing "
             f"{m['step_seconds_none'] * 1e3:.0f} ms, one block forward {m['block_forward_seconds'] * 1e3:.1f} ms",
             "", "| plan | extra block forwards | measured step time | GEMM model | time model | peak saved bytes "
             "| page faults per step |", "|---|---|---|---|---|---|---|"]
    for plan, r in m["plans"].items():
        lines.append(f"| {plan} | {r['extra_block_forwards']} | {r['measured']:.3f} | {r['gemm_model']:.3f} "
                     f"| {r['time_model']:.3f} | {r['peak_vs_none']:.3f} | {r['page_faults_per_step']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=CONFIG["n_layer"])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # the run with the allocator keeping its memory
        print(json.dumps(measure(args)))
        return
    default = measure(args)
    command = [sys.executable, __file__, "--child", "--repeats", str(args.repeats), "--layers", str(args.layers)]
    child = subprocess.run(command, env=dict(os.environ, **KEEP_MEMORY), capture_output=True, text=True, check=True)
    kept = json.loads(child.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(dict(default_allocator=default, allocator_keeps_memory=kept)))
        return
    print(table("Default allocator", default))
    print()
    print(table("Allocator keeps freed memory (" + " ".join(f"{k}={v}" for k, v in KEEP_MEMORY.items()) + ")", kept))


if __name__ == "__main__":
    main()
