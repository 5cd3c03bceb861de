"""`python -m refimpl predict`: memory per GPU and time per step of one configuration on a cluster.

    python -m refimpl predict                                         # GPT-3 XL (1.3B) on one DGX A100
    python -m refimpl predict --n-layer 96 --d-model 12288 --n-head 96 --batch-size 1536 \\
        --tp 8 --pp 16 --gpus 1024 --checkpoint full --cluster a100-80gb
    python -m refimpl predict --cluster local-cluster.json --dtype float32 ...   # this machine, calibrated
    python -m refimpl predict --seq-len 131072 --batch-size 16 --gpus 64 --cp 8 --cp-impl ring   # context parallel
    python -m refimpl predict --arch llama --n-layer 126 --d-model 16384 --n-head 128 --kv-heads 8 \
        --ffn-size 53248 --vocab-size 128256 --seq-len 8192 --batch-size 2048 --dtype bf16 ...   # a Llama block

The cost model is refimpl/tools/cluster/model.py (its docstring states every term); the cluster a
preset (a100-80gb, h100-80gb) or a JSON file (`python -m refimpl calibrate` writes one for this
machine). Flags are train's where train has them; --batch-size is global, in sequences.
"""

from __future__ import annotations

import argparse

from refimpl.memory import format_bytes
from refimpl.parallel.pipeline.schedules import SCHEDULES
from refimpl.tools.cluster import hardware
from refimpl.tools.cluster.context import IMPLEMENTATIONS
from refimpl.tools.cluster.model import CHECKPOINTS, Prediction, Run, predict
from refimpl.tools.console import emit_json
from refimpl.tools.flags import add_max_work_argument, add_model_arguments, check_work, describe_run, positive_int

MAX_ACTIONS = 100_000  # pipeline actions simulated (the schedule command's cap)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--gpus", type=positive_int,
                   help="GPUs in all (default dp × tp × cp × pp); must equal dp × tp × cp × pp")
    p.add_argument("--dp", type=positive_int,
                   help="data-parallel degree (default gpus / (tp × pp), or 8 / (tp × pp))")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel degree (default 1)")
    p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel degree (default 1)")
    p.add_argument("--cp", type=positive_int, default=1,
                   help="context-parallel degree: each sequence split over this many ranks (default 1)")
    p.add_argument("--cp-impl", choices=IMPLEMENTATIONS, default="ring",
                   help="with --cp: ring attention (K/V blocks around a ring, overlapped with the blocks' attention) "
                        "or ulysses (all-to-alls between sequence and head shards) (default ring)")
    p.add_argument("--micro-batch-size", type=positive_int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (default 0)")
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default="none",
                   help="activation recomputation: none, selective (attention cores), full (every block) "
                        "(default none)")
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b", help="pipeline schedule (default 1f1b)")
    p.add_argument("--chunks", type=positive_int, help="model chunks per rank (interleaved; default 2)")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp: sequence parallelism")
    add_max_work_argument(p, MAX_ACTIONS, "pipeline actions simulated")


def actions_estimate(pp: int, micro_batches: int, chunks: int | None) -> int:
    """An upper bound on the actions the pipeline simulations take (cluster/pipeline.py simulates at most
    about 4 x 2pp micro-batches, twice, and extrapolates), before building any schedule."""
    if pp == 1:
        return 0
    return 2 * 3 * pp * max(chunks or 2, 2) * min(micro_batches, 8 * pp)


def degrees(gpus: int | None, dp: int | None, tp: int, pp: int, cp: int = 1) -> tuple[int, int]:
    """(gpus, dp), checking that the degrees multiply to the GPU count (dp × tp × cp × pp with --cp)."""
    for name, value in (("--gpus", gpus), ("--dp", dp), ("--tp", tp), ("--pp", pp), ("--cp", cp)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value}")
    names, values = ("tp × pp", f"{tp} × {pp}") if cp == 1 else ("tp × cp × pp", f"{tp} × {cp} × {pp}")
    model = tp * cp * pp  # the ranks of one data-parallel replica
    if dp is None:
        total = gpus if gpus is not None else max(8, model)
        if total % model:
            raise ValueError(f"--gpus {total} is not divisible by {names} = {values}; "
                             f"choose degrees whose product divides the GPU count")
        dp = total // model
    if gpus is not None and dp * model != gpus:
        raise ValueError(f"dp × {names} = {dp} × {values} = {dp * model}, not --gpus {gpus}; "
                         f"the degrees must multiply to the GPU count")
    return dp * model, dp


def run_from_args(args) -> Run:
    _, dp = degrees(args.gpus, args.dp, args.tp, args.pp, args.cp)
    if args.chunks is not None and args.schedule != "interleaved":
        raise ValueError(f"--chunks is for --schedule interleaved only; drop it for {args.schedule}")
    m = max(1, args.batch_size // (dp * args.micro_batch_size))
    check_work(actions_estimate(args.pp, m, args.chunks), args.max_work, "actions",
               f"simulating the pipeline of --pp {args.pp} with {m} micro-batches")
    return Run(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head, seq_len=args.seq_len,
               vocab_size=args.vocab_size, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
               dp=dp, tp=args.tp, pp=args.pp, zero=args.zero, dtype=args.dtype, checkpoint=args.checkpoint,
               schedule=args.schedule if args.pp > 1 else "1f1b",
               chunks=(args.chunks or 2) if args.schedule == "interleaved" and args.pp > 1 else None,
               sequence_parallel=args.sequence_parallel, dropout=args.dropout > 0, tie_weights=args.tie_weights,
               experts=args.experts, top_k=args.top_k, moe_every=args.moe_every, ep=args.ep, cp=args.cp,
               cp_impl=args.cp_impl, arch=args.arch, kv_heads=args.kv_heads, ffn_size=args.ffn_size,
               attention=args.attention).check()


def run(args) -> int:
    cluster = hardware.load(args.cluster)
    prediction = predict(run_from_args(args), cluster)
    if args.json:
        emit_json(prediction.as_dict())
    else:
        print(report(prediction, cluster))
    return 0


def report(p: Prediction, cluster: hardware.Cluster) -> str:
    lines = [describe_run(p.run),
             f"cluster {cluster.name}; model {p.parameters / 1e9:.2f}B parameters", ""]
    total = p.memory_per_gpu_bytes
    lines.append("memory per GPU (the rank that holds the most)")
    for part, value in p.memory.items():
        lines.append(f"  {part:<18} {format_bytes(value):>10}  {100 * value / total:5.1f}%")
    verdict = "fits" if p.fits else f"does NOT fit: {format_bytes(total - cluster.memory_bytes)} over"
    lines.append(f"  {'total':<18} {format_bytes(total):>10}  of {format_bytes(cluster.memory_bytes)}: {verdict}")
    lines.append("")
    lines.append("time per step (every stage timed as the slowest, the last with the head)")
    for part, value in p.time.items():
        if value or part in ("compute", "bubble"):
            lines.append(f"  {part:<18} {value:10.4g} s  {100 * value / p.step_seconds:5.1f}%")
    lines.append(f"  {'step':<18} {p.step_seconds:10.4g} s")
    lines.append("")
    rate = p.model_flops_per_gpu_per_second
    scale, prefix = (1e12, "T") if rate >= 1e12 else (1e9, "G")
    lines.append(f"tokens/s {p.tokens_per_second:.4g}; model FLOP/s per GPU {rate / scale:.1f} {prefix}; "
                 f"MFU {100 * p.mfu:.1f}% (PaLM's: no recomputation counted)")
    if p.context_parallel:
        cp, sent = p.context_parallel, p.context_parallel["bytes_per_layer"]
        where = "inside a node" if cp["inside_a_node"] else "across nodes"
        lines.append(f"context parallel: {cp['impl']} over {p.run.cp} ranks {where}, {cp['tokens_per_rank']} tokens "
                     f"each; per layer and micro-batch a rank sends at most {format_bytes(sent['forward'])} forward, "
                     f"{format_bytes(sent['backward'])} backward")
    return "\n".join(lines)
