"""`python -m refimpl plan`: the fastest configurations of a model on G GPUs of a cluster.

    python -m refimpl plan --params 70B --gpus 1024 --cluster h100-80gb
    python -m refimpl plan --n-layer 96 --d-model 12288 --n-head 96 --gpus 1024 --batch-size 1536
    python -m refimpl plan --params 1T --gpus 4096 --cluster h100-80gb --json --plot search.png
    python -m refimpl plan --params 7B --gpus 64 --seq-len 131072 --batch-size 16      # searches cp too
    python -m refimpl plan --arch llama --params 70B --vocab-size 32000 --seq-len 4096 --gpus 512 --dtype bf16 \
        --cluster h100-80gb                                                           # a Llama shape

The search and its space are refimpl/tools/cluster/plan.py's; every number is the cost model's
(refimpl/tools/cluster/model.py). --params picks the nearest published GPT shape (plan.PARAMETER_SHAPES),
or with --arch llama the nearest Llama shape (plan.LLAMA_SHAPES).
"""

from __future__ import annotations

import argparse
import time

from refimpl.memory import format_bytes, parse_count
from refimpl.tools.cluster import hardware
from refimpl.tools.cluster.model import Run, check_architecture
from refimpl.tools.cluster.plan import (
    LONG_SEQUENCE,
    candidates_estimate,
    llama_shape_for,
    plan,
    shape_for,
    why_slower,
)
from refimpl.tools.console import emit_json, log
from refimpl.tools.flags import (
    add_max_work_argument,
    add_model_arguments,
    check_work,
    check_writable,
    describe_run,
    positive_int,
)

MAX_CANDIDATES = 100_000  # each costs about a millisecond of the cost model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", metavar="PSI", help="model size (70B, 1T, 350M): the nearest published GPT shape "
                   "(with --arch llama: Llama shape); or give --n-layer, --d-model and --n-head")
    add_model_arguments(p, defaults=False)
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs to plan for")
    p.add_argument("--top", type=positive_int, default=5, help="configurations to show (default 5)")
    p.add_argument("--refine", type=positive_int, default=20,
                   help="best candidates (by the closed forms) to predict with the schedule simulator (default 20)")
    p.add_argument("--max-cp", type=positive_int, metavar="C",
                   help=f"search context-parallel degrees up to C (default: all for sequences of {LONG_SEQUENCE} "
                        f"tokens or more, none below; 1: none)")
    p.add_argument("--plot", metavar="FILE", help="draw the search, memory against step time (matplotlib: .png, .svg)")
    add_max_work_argument(p, MAX_CANDIDATES, "candidate configurations (an upper bound, counted before the search)")


def base_run(args) -> tuple[Run, str]:
    dims = (args.n_layer, args.d_model, args.n_head)
    kv_heads, ffn_size = args.kv_heads, args.ffn_size
    if args.params is not None:
        if any(d is not None for d in dims):
            raise ValueError("give either --params or --n-layer/--d-model/--n-head, not both")
        if args.arch == "llama":
            if kv_heads is not None or ffn_size is not None:
                raise ValueError("--params picks a Llama shape with its own --kv-heads and --ffn-size; give either "
                                 "--params or all of --n-layer, --d-model, --n-head (and --kv-heads, --ffn-size)")
            name, L, h, a, kv_heads, ffn_size = llama_shape_for(parse_count(args.params), args.seq_len,
                                                                args.vocab_size)
        else:
            name, L, h, a = shape_for(parse_count(args.params), args.seq_len, args.vocab_size)
    elif all(d is not None for d in dims):
        name, (L, h, a) = "given", dims
    else:
        raise ValueError("say which model: --params 70B, or all of --n-layer, --d-model and --n-head")
    run = Run(n_layer=L, d_model=h, n_head=a, seq_len=args.seq_len, vocab_size=args.vocab_size,
              batch_size=args.batch_size, dtype=args.dtype, dropout=args.dropout > 0, tie_weights=args.tie_weights,
              experts=args.experts, top_k=args.top_k, moe_every=args.moe_every, arch=args.arch, kv_heads=kv_heads,
              ffn_size=ffn_size, attention=args.attention)
    for flag, value in (("--gpus", args.gpus), ("--top", args.top), ("--refine", args.refine)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer; got {value}")
    check_architecture(run)
    return run, name


def run(args) -> int:
    cluster = hardware.load(args.cluster)
    base, shape = base_run(args)
    if args.plot:
        check_writable(args.plot, "--plot")
    check_work(candidates_estimate(base, args.gpus, cluster, args.max_cp), args.max_work, "candidate configurations",
               f"the search of L={base.n_layer} a={base.n_head} on {args.gpus} GPUs")
    started = time.perf_counter()
    result = plan(base, args.gpus, cluster, top=args.top, refine=args.refine, max_cp=args.max_cp)
    seconds = time.perf_counter() - started
    if not result.best:
        least = result.not_fitting_least
        described = describe_run(least.run)
        raise ValueError(f"the model fits nowhere on {args.gpus} GPUs of {cluster.name}: the smallest of "
                         f"{result.searched} configurations needs {format_bytes(least.memory_per_gpu_bytes)} per GPU, "
                         f"{format_bytes(least.memory_per_gpu_bytes - cluster.memory_bytes)} over the "
                         f"{format_bytes(cluster.memory_bytes)} there is ({described}); add GPUs")
    if args.plot:
        draw(result, cluster, args.plot)
    if args.json:
        emit_json({"model": shape, "parameters": result.best[0].parameters, "gpus": args.gpus, "cluster": cluster.name,
                   "searched": result.searched, "fitting": result.fitting, "seconds": seconds,
                   "configurations": [_row(p) for p in result.best]})
        return 0
    best = result.best[0]
    llama = f" llama K={base.key_value_heads} F={base.ffn}" if base.arch == "llama" else ""
    print(f"model: {shape}, {best.parameters / 1e9:.1f}B parameters (L={base.n_layer} h={base.d_model} "
          f"a={base.n_head}{llama} s={base.seq_len} V={base.vocab_size}), batch {base.batch_size}, {base.dtype}; "
          f"{args.gpus} GPUs of {cluster.name}")
    print(f"searched {result.searched} configurations: {result.fitting} fit in "
          f"{format_bytes(cluster.memory_bytes)}; the best {len(result.best)} by simulated step time:")
    print()
    header = f"{'#':>2} {'dp':>4} {'tp':>3} {'cp':>10} {'pp':>3} {'ZeRO':>4} {'recompute':<9} {'schedule':<11} " \
             f"{'mbs':>3} {'SP':>3} {'memory':>9} {'step s':>8} {'MFU':>6}"
    print(header)
    for i, p in enumerate(result.best, 1):
        r = p.run
        cp = f"{r.cp} {r.cp_impl}" if r.cp > 1 else "1"
        print(f"{i:>2} {r.dp:>4} {r.tp:>3} {cp:>10} {r.pp:>3} {r.zero:>4} {r.checkpoint:<9} "
              f"{(r.schedule if r.pp > 1 else '-'):<11} {r.micro_batch_size:>3} "
              f"{('yes' if r.sequence_parallel else '-'):>3} "
              f"{format_bytes(p.memory_per_gpu_bytes):>9} {p.step_seconds:8.3f} {100 * p.mfu:5.1f}%")
    print()
    for i, p in enumerate(result.best[1:], 2):
        print(f"#{i} loses to #1 by {why_slower(p, best)}")
    if args.plot:
        print(f"wrote {args.plot}")
    log(f"predict the best one: python -m refimpl predict {_flags(best.run)} --cluster {args.cluster}")
    return 0


def _row(p) -> dict:
    r = p.run
    return {"dp": r.dp, "tp": r.tp, "cp": r.cp, "cp_impl": r.cp_impl, "pp": r.pp, "zero": r.zero,
            "checkpoint": r.checkpoint,
            "schedule": r.schedule if r.pp > 1 else None, "chunks": r.chunks, "micro_batch_size": r.micro_batch_size,
            "sequence_parallel": r.sequence_parallel, "memory_per_gpu_bytes": p.memory_per_gpu_bytes,
            "step_seconds": p.step_seconds, "tokens_per_second": p.tokens_per_second, "mfu": p.mfu,
            "model_flops_per_gpu_per_second": p.model_flops_per_gpu_per_second, "memory": p.memory, "time": p.time}


def _flags(r: Run) -> str:
    flags = (f"--n-layer {r.n_layer} --d-model {r.d_model} --n-head {r.n_head} --seq-len {r.seq_len} "
             f"--vocab-size {r.vocab_size} --batch-size {r.batch_size} --dtype {r.dtype} --dp {r.dp} --tp {r.tp} "
             f"--pp {r.pp} --zero {r.zero} --checkpoint {r.checkpoint} --micro-batch-size {r.micro_batch_size}")
    if r.pp > 1:
        flags += f" --schedule {r.schedule}" + (f" --chunks {r.chunks}" if r.chunks else "")
    if r.sequence_parallel:
        flags += " --sequence-parallel"
    if r.cp > 1:
        flags += f" --cp {r.cp} --cp-impl {r.cp_impl}"
    if r.attention == "flash":
        flags += " --attention flash"
    if r.arch == "llama":
        flags += f" --arch llama --kv-heads {r.key_value_heads} --ffn-size {r.ffn}"
    if r.tie_weights:
        flags += " --tie-weights"
    if r.dropout:
        flags += " --dropout 0.1"  # predict only asks whether masks are kept
    if r.experts:
        flags += f" --experts {r.experts} --top-k {r.top_k} --moe-every {r.moe_every}"
    return flags


def draw(result, cluster, path: str) -> None:
    """Every candidate searched: memory per GPU against estimated step time; the limit; the best."""
    try:
        import matplotlib  # noqa: PLC0415 - matplotlib is optional (--plot only)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib is optional
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fits, colour, label in ((False, "#bbbbbb", "does not fit"), (True, "#4477aa", "fits")):
        pts = [(s, m / 1e9) for m, s, f in result.all_points if f == fits]
        if pts:
            ax.scatter(*zip(*pts), s=6, c=colour, label=label, alpha=0.6)
    ax.scatter([p.step_seconds for p in result.best], [p.memory_per_gpu_bytes / 1e9 for p in result.best],
               marker="*", s=90, c="#cc3311", label="best (simulated)")
    ax.axhline(cluster.memory_bytes / 1e9, color="k", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("step time, s (closed-form estimate; the best: simulated)")
    ax.set_ylabel("memory per GPU, GB")
    ax.set_title(f"{result.searched} configurations on {cluster.name}")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as error:
        raise ValueError(f"cannot write --plot {path}: {error}") from None
    finally:
        plt.close(fig)
