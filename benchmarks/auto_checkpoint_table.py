"""The GPT under automatic and chain plans: forward calls per operation and peak saved bytes, measured.

    python benchmarks/auto_checkpoint_table.py            # prints the markdown table of docs/checkpointing.md

GPT: 16 blocks, d_model 64, 4 heads, context 32, batch 4, float32, dropout 0.1 and 0 (the model
of the chain-plan table in docs/checkpointing.md). For each plan, the second training step (the first
one records the auto plans' graph) is measured:

- forward calls: every operation's forward, counted by the engine (autograd/recording.py:
  counting_forwards), recomputations included. The embedding and the head run once under every
  plan, so the blocks' extra forwards are the step's count minus the plain step's; "per
  operation" divides by the number of operations in the blocks' graph (its recording);
- matmul re-runs: the same count restricted to matrix products (MatMul, LinearFunction), the
  expensive part of a recomputation;
- peak: the engine's saved-tensor ledger over the step, above what was saved before it.

Nothing here is timed; the numbers are exact and the same on every machine.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from refimpl.autograd import saved_tensors
from refimpl.autograd.recording import counting_forwards
from refimpl.checkpointing import apply_to_gpt, record
from refimpl.checkpointing.auto import EXPENSIVE_OPS, inner_articulation_points
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F

PLANS = ["none", "auto:memory", "auto:speed", "sqrt", "every:1", "selective"]
CONFIG = GPTConfig(vocab_size=64, seq_len=32, n_layer=16, n_head=4, d_model=64, dropout=0.1, dtype="float32")
BATCH = 4


def measure(plan: str, config: GPTConfig, batch: int = BATCH) -> dict:
    model = apply_to_gpt(GPT(config, seed=0), plan)
    rng = np.random.default_rng(0)
    for _ in range(2):
        idx, targets = (rng.integers(0, config.vocab_size, (batch, config.seq_len)) for _ in range(2))
        for p in model.parameters():
            p.grad = None
        base = saved_tensors.live_bytes
        saved_tensors.reset_peak()
        with counting_forwards() as calls:
            F.cross_entropy(model(idx), targets).backward()
        assert saved_tensors.live_bytes == base
    runner = model.blocks_runner
    checkpoints = None
    if plan.startswith("auto:"):
        checkpoints = len(next(iter(runner.runs.values())).plan.checkpoints)
    return {"plan": plan, "calls": sum(calls.values()),
            "matmuls": sum(n for op, n in calls.items() if op in EXPENSIVE_OPS),
            "peak": saved_tensors.peak_bytes - base, "checkpoints": checkpoints}


def blocks_graph(config: GPTConfig, batch: int = BATCH):
    model = GPT(config, seed=0)
    x = model.embed(np.zeros((batch, config.seq_len), dtype=np.int64))

    def blocks(h):
        for block in model.blocks:
            h = block(h)
        return h

    return record(blocks, x)


def markdown() -> str:
    c = CONFIG
    lines = [f"GPT: {c.n_layer} blocks, d_model {c.d_model}, {c.n_head} heads, context {c.seq_len}, batch {BATCH}, "
             "float32. Operations: in the blocks' graph (matrix products among them); articulation points: inside "
             "it.", "",
             "| dropout | operations | articulation points | plan | checkpoints | forward calls per operation | "
             "extra operation forwards | matmul re-runs | peak saved bytes | vs none |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for dropout in (0.1, 0.0):
        lines += _rows(replace(CONFIG, dropout=dropout))
    return "\n".join(lines)


def _rows(config: GPTConfig) -> list:
    graph = blocks_graph(config)
    ops = len(graph.nodes)
    matmuls = sum(node.op in EXPENSIVE_OPS for node in graph.nodes)
    cuts = len(inner_articulation_points(graph))
    rows = [measure(plan, config) for plan in PLANS]
    none = rows[0]
    lines = []
    for r in rows:
        extra = r["calls"] - none["calls"]
        chosen = "" if r["checkpoints"] is None else str(r["checkpoints"])
        lines.append(f"| {config.dropout} | {ops} ({matmuls}) | {cuts} | {r['plan']} | {chosen} | "
                     f"{(ops + extra) / ops:.3f} | {extra} | {r['matmuls'] - none['matmuls']} | {r['peak']:,} | "
                     f"{r['peak'] / none['peak']:.3f} |")
    return lines


if __name__ == "__main__":
    print(markdown())
