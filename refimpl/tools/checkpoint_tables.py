"""The checkpointing tables of docs/checkpointing.md, measured.

Launch:  python -m refimpl.tools.checkpoint_tables [--json]

Table 1: chains of n = 16, 64, 100, 256 TanhLayers (measure.py: one Function that saves only its
input, so memory is counted in layer inputs A). Forward calls come from the counter inside each
layer, peaks from the engine's saved-tensor ledger; the "expected" columns are the closed forms
(plans.py, revolve.py), printed beside the measurements, not instead of them.

Table 2: a GPT's blocks (16 layers, dropout 0.1) under the same plans, in bytes: forward calls
per block and the peak saved bytes of the blocks' chain (above what embed() saved) and of a
whole training step (embed, blocks, head, loss), all from the ledger.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from refimpl.autograd.grad_mode import no_grad
from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Tensor
from refimpl.checkpointing import revolve
from refimpl.checkpointing.gpt_blocks import gpt_forward
from refimpl.checkpointing.measure import count_forward_calls, measure_chain, tanh_chain
from refimpl.checkpointing.plans import predicted_cost, sqrt_segment
from refimpl.checkpointing.sequential import checkpoint_sequential, measure_layer_cost, resolve_plan
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F

CHAIN_LENGTHS = (16, 64, 100, 256)
GPT_CONFIG = dict(vocab_size=64, seq_len=32, n_layer=16, n_head=4, d_model=64, dropout=0.1, dtype="float32")
GPT_BATCH = 4


def expected(plan: str, n: int) -> tuple[int, int]:
    """(extra forwards, peak in layer inputs) of a plan on the tanh chain, by the closed forms."""
    name, _, arg = plan.partition(":")
    if name == "none":
        return 0, n
    if name in ("every", "sqrt"):
        k = min(int(arg), n) if name == "every" else sqrt_segment(n)
        return n - k, math.ceil(n / k) - 1 + k
    c = int(arg)
    return revolve.min_advances(n, c), min(c + 1, n)


def chain_rows() -> list[dict]:
    rows = []
    for n in CHAIN_LENGTHS:
        k = sqrt_segment(n)
        same_memory = math.ceil(n / k) - 1 + k - 1  # revolve with sqrt's peak: C + 1 states
        plans = ["none", "sqrt", "every:1", "revolve:1", "revolve:2", "revolve:4", f"revolve:{same_memory}"]
        for plan in plans:
            m = measure_chain(tanh_chain(n), plan)
            extra, peak = expected(plan, n)
            rows.append(dict(n=n, plan=plan if plan != "sqrt" else f"sqrt (every:{k})",
                             forward_calls=m.forward_calls, extra_forwards=m.extra_forwards,
                             expected_extra=extra, peak_inputs=m.peak_states, expected_peak=peak))
    return rows


def gpt_rows() -> tuple[dict, list[dict]]:
    cfg = GPTConfig(**GPT_CONFIG)
    n = cfg.n_layer
    idx = np.random.default_rng(0).integers(0, cfg.vocab_size, (GPT_BATCH, cfg.seq_len))
    probe_model = GPT(cfg, seed=1)
    with no_grad():  # (a graph that is never backpropagated would stay in the ledger)
        x = probe_model.embed(idx)
    cost = measure_layer_cost(probe_model.blocks[0], Tensor(x.data))
    info = dict(config=GPT_CONFIG, batch=GPT_BATCH, input_bytes=cost.input_bytes, block_bytes=cost.recorded_bytes)
    none_peak = n * cost.recorded_bytes
    plans = ["none", "sqrt", "every:1", "every:2", "revolve:1", "revolve:2", "revolve:4",
             f"budget:{none_peak // 4}", f"budget:{none_peak // 10}"]
    rows = []
    for plan in plans:
        model = GPT(cfg, seed=1)
        blocks = list(model.blocks)
        concrete = resolve_plan(plan, blocks, x, cost)
        base = saved_tensors.live_bytes
        # the blocks' chain alone
        with no_grad():
            h = Tensor(model.embed(idx).data, requires_grad=True)
        saved_tensors.reset_peak()
        with count_forward_calls(blocks) as chain_counter:
            y = checkpoint_sequential(blocks, h, concrete)
            y.backward(np.ones_like(y.data))
        chain_peak = saved_tensors.peak_bytes - base
        # a whole training step
        saved_tensors.reset_peak()
        with count_forward_calls(blocks) as step_counter:
            F.cross_entropy(gpt_forward(model, idx, concrete), idx).backward()
        step_peak = saved_tensors.peak_bytes - base
        assert saved_tensors.live_bytes == base
        extra, predicted = predicted_cost(concrete, n, cost)
        rows.append(dict(plan=plan if plan == str(concrete) else f"{plan} → {concrete}",
                         forward_calls_per_block=step_counter.total / n, extra_block_forwards=step_counter.total - n,
                         chain_peak_bytes=chain_peak, predicted_chain_peak=predicted,
                         step_peak_bytes=step_peak, chain_vs_none=chain_peak / none_peak,
                         counts_agree=chain_counter.total == step_counter.total == n + extra))
    return info, rows


def markdown(chain: list[dict], info: dict, gpt: list[dict]) -> str:
    out = ["| n | plan | forward calls | extra (measured) | extra (formula) | peak, layer inputs (measured) "
           "| peak (formula) |", "|---|---|---|---|---|---|---|"]
    for r in chain:
        out.append(f"| {r['n']} | {r['plan']} | {r['forward_calls']} | {r['extra_forwards']} | {r['expected_extra']} "
                   f"| {r['peak_inputs']:g} | {r['expected_peak']} |")
    c = info["config"]
    out += ["", f"GPT: {c['n_layer']} blocks, d_model {c['d_model']}, {c['n_head']} heads, context {c['seq_len']}, "
                f"batch {info['batch']}, {c['dtype']}, dropout {c['dropout']}; one block input A = "
                f"{info['input_bytes']} B, one recorded block R = {info['block_bytes']} B "
                f"(R/A = {info['block_bytes'] / info['input_bytes']:.1f}).", "",
            "| plan | forward calls per block | extra block forwards | blocks' peak (B, measured) "
            "| predicted | vs none | training step peak (B) |", "|---|---|---|---|---|---|---|"]
    for r in gpt:
        out.append(f"| {r['plan']} | {r['forward_calls_per_block']:.4g} | {r['extra_block_forwards']} "
                   f"| {r['chain_peak_bytes']:,} | {r['predicted_chain_peak']:,} | {r['chain_vs_none']:.3f} "
                   f"| {r['step_peak_bytes']:,} |")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args(argv)
    chain = chain_rows()
    info, gpt = gpt_rows()
    if args.json:
        print(json.dumps(dict(chain=chain, gpt=dict(info, rows=gpt))))
    else:
        print(markdown(chain, info, gpt))


if __name__ == "__main__":
    main()
