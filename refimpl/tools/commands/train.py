"""`python -m refimpl train --model {gpt,mlp} ...`: train a model, in one process or under mpiexec.

    python -m refimpl train --model gpt                      # the demo: learns to sort 8 digits
    python -m refimpl train --model mlp                      # 2-D spirals
    mpiexec -n 4 python -m refimpl train --zero 3 --save-dir ck --save-every 10
    mpiexec -n 4 python -m refimpl train --pp 2 --schedule zb1p --resume ck

The defaults are the demo: `--model gpt` learns to sort sequences of 8 digits in a few seconds on
two cores; `--model mlp` classifies 2-D spirals. This module turns the flags into a TrainConfig
and prints the summary; the loop, the builders and the trainers are refimpl/tools/run.py's.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from refimpl import backend
from refimpl.tools.console import emit_json, log
from refimpl.memory import parse_bytes
from refimpl.optim import OPTIMIZERS
from refimpl.tools.commands.schedule import schedule_name
from refimpl.tools.run import DEFAULTS, TrainConfig, TrainingDiverged, get_world, train


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(DEFAULTS), default="gpt",
                   help="gpt: sorting task (or --data text); mlp: 2-D spirals (default gpt)")
    p.add_argument("--steps", type=int, help="optimizer steps (gpt 400, mlp 600)")
    p.add_argument("--batch-size", type=int, help="global batch size, split over ranks and micro-batches")
    p.add_argument("--lr", type=float, help="learning rate (gpt 3e-3, mlp 1e-2)")
    p.add_argument("--dtype", default="float32", help="float32, float64 or mixed (float16 storage, float32 master "
                   "weights, loss scaling; on ZeRO's sharded optimizer, --zero 0 included) (default float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    p.add_argument("--n-layer", type=int, help="transformer blocks, or MLP hidden layers (default 2)")
    p.add_argument("--d-model", type=int, help="model width (default 64)")
    p.add_argument("--n-head", type=int, help="attention heads (default 4)")
    p.add_argument("--seq-len", type=int, help="context length (sorting: 2 x sequence length, default 16; --data: default 64)")
    p.add_argument("--data", metavar="FILE", help="train a character-level GPT on this UTF-8 text file")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    p.add_argument("--weight-decay", type=float, default=None, help="weight decay, >= 0 (default 0: none)")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (0: off)")
    p.add_argument("--dropout", type=float, default=0.0, help="GPT dropout probability, in [0, 1) (default 0)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (per rank)")
    p.add_argument("--collectives", choices=("mpi", "ring"), default="mpi",
                   help="MPI's built-in collectives, or the textbook ring algorithms of ring.py")
    p.add_argument("--dp-mode", choices=("bucketed", "naive"), default="bucketed",
                   help="data parallelism: overlapped bucket all-reduces, or one all-reduce per gradient")
    p.add_argument("--bucket-bytes", type=int, default=1 << 20, help="gradient bucket size in bytes (default 1 MiB)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks; data parallel = world size / pp")
    p.add_argument("--schedule", type=schedule_name, metavar="NAME",
                   help="pipeline schedule: gpipe, 1f1b, interleaved, zb1p, zbh2, zbv, dualpipe, dualpipev, or one of "
                        "your own as MODULE:FUNCTION or FILE.py:FUNCTION (docs/capstone.md) (default 1f1b when --pp > 1)")
    p.add_argument("--micro-batches", type=int, help="pipeline micro-batches per step and replica (default 2 x pp)")
    p.add_argument("--chunks", type=int, help="model chunks per rank (interleaved only; default 2)")
    p.add_argument("--action-costs", metavar="F=0.02,I=0.02,W=0.02",
                   help="pipeline sleep-cost mode: pad every step to these seconds (B=I+W, FB=F+B unless given); "
                        "link-delay mode: P=s delivers each pipeline message s after its send, A=s completes each "
                        "all-to-all s after its start")
    p.add_argument("--trace", metavar="FILE", help="write the last step's measured pipeline timeline (Chrome trace)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per layer (a GPT; Megatron-LM); "
                   "data parallel = world size / (pp x tp)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: layer norms and dropouts on sequence shards (all-gather / reduce-scatter)")
    p.add_argument("--partition-activations", action="store_true",
                   help="with --tp and --checkpoint: keep 1/tp of each checkpointed block input per rank (ZeRO-R Pa)")
    p.add_argument("--experts", type=int, default=0, metavar="E",
                   help="mixture of experts: E expert MLPs per MoE block (default 0: the dense MLP)")
    p.add_argument("--top-k", type=int, default=2, metavar="K", help="experts chosen per token (default 2)")
    p.add_argument("--moe-every", type=int, default=1, metavar="N", help="every N-th block gets the experts (default 1)")
    p.add_argument("--capacity-factor", type=float, default=None, metavar="C",
                   help="at most ceil(C x K x T / E) tokens per expert and sequence, later ones dropped (default: dropless)")
    p.add_argument("--ep", type=int, default=1, metavar="P",
                   help="expert-parallel ranks: each holds experts/P of them, tokens travel by all-to-all; P divides "
                        "the data-parallel degree (default 1)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                   help="run DualPipe's F&B steps as F then B (default: interleaved at the experts' all-to-alls)")
    p.add_argument("--aux-coef", type=float, default=0.01, metavar="A",
                   help="weight of the load-balancing loss (Switch Transformer's alpha, default 0.01)")
    p.add_argument("--zero", type=int, default=0, metavar="STAGE",
                   help="ZeRO stage: 0 data parallel, 1 shard optimizer states, 2 + gradients, 3 + parameters")
    p.add_argument("--prefetch", type=parse_bytes, default=0, metavar="BYTES",
                   help="ZeRO-3: bytes of the next modules' parameters to gather ahead (default 0: on demand)")
    p.add_argument("--param-threshold", type=int, default=0, metavar="N",
                   help="ZeRO-3: parameters with fewer than N elements stay whole on every rank (default 0)")
    p.add_argument("--mem-budget", type=parse_bytes, default=None, metavar="SIZE",
                   help="per-rank memory budget, e.g. 200MB: exceeding it is an out-of-memory error")
    p.add_argument("--save-dir", metavar="DIR", help="write sharded checkpoints under DIR/step_NNNNNNNN/")
    p.add_argument("--save-every", type=int, default=0, metavar="K", help="checkpoint every K steps (default: at the end)")
    p.add_argument("--resume", metavar="PATH", help="continue the run saved in PATH: a step directory, or a "
                   "--save-dir (its newest intact step); only --steps, --save-every, world size, --zero and other "
                   "flags that do not change what is computed may differ (docs/zero.md)")
    p.add_argument("--overwrite-checkpoints", action="store_true", help="start over in a --save-dir that holds "
                   "another run's checkpoints: delete them before the first step")
    backend.add_argument(p)
    p.add_argument("--checkpoint", default="none", metavar="PLAN",
                   help="activation checkpointing of the GPT's blocks: none, sqrt, every:K, revolve:C, budget:BYTES; "
                        "selective (attention cores only), selective+PLAN")
    p.add_argument("--json", action="store_true", help="print one JSON summary line on stdout")


def config_from_args(args) -> TrainConfig:
    """The TrainConfig of parsed train (or verify) flags: a flag not given takes the model's default."""
    defaults = dict(DEFAULTS[args.model])
    if args.data is not None:
        defaults["seq_len"] = 64
    values = {}
    for field in TrainConfig.__dataclass_fields__:
        given = getattr(args, field, None)
        values[field] = given if given is not None else defaults.get(field, TrainConfig.__dataclass_fields__[field].default)
    return TrainConfig(**values)


def config_from_flags(flags) -> TrainConfig:
    """The checked TrainConfig of a list of train flags (["--experts", "4", ...]), as the command parses them."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args([str(flag) for flag in flags]))
    cfg.check()
    return cfg


def check(args) -> None:
    """The checks every rank makes at startup, before any communication (cli.main)."""
    config_from_args(args).check()


def run(args) -> int:
    if args.backend is not None:
        backend.set_backend(args.backend)
    cfg = config_from_args(args)
    cfg.check()
    world = get_world(cfg)
    try:
        summary = train(cfg, progress=True, world=world)
    except TrainingDiverged as exc:  # raised on every rank at once: all exit 1, the message once
        if world.rank == 0:
            log(f"error: {exc}")
            if args.json:
                emit_json({"ok": False, "error": str(exc), "diverged_at_step": exc.step, "final_loss": exc.loss,
                           "model": cfg.model, "steps": cfg.steps, "world_size": world.size, "config": asdict(cfg),
                           "backend": backend.name()})
        return 1
    summary.pop("_model")
    if world.rank != 0:
        return 0
    speed = f"{summary['tokens_per_s']:.0f} tokens/s" if cfg.model == "gpt" else f"{summary['samples_per_s']:.0f} samples/s"
    ran = cfg.steps - summary["start_step"]
    resumed = f" (steps {summary['start_step'] + 1}-{cfg.steps}, resumed)" if summary["start_step"] else ""
    log(f"done: {ran} steps{resumed} in {summary['seconds']:.1f}s ({speed}); final loss {summary['final_loss']:.4f}, "
        f"held-out accuracy {100 * summary['accuracy']:.1f}%, {summary['n_params']} parameters, "
        f"peak saved activations {summary['peak_activation_bytes'] / 1e6:.2f} MB"
        + (f", block forwards per layer {summary['forward_calls_per_layer']:g}"
           if summary.get("forward_calls_per_layer") is not None else ""))
    if args.json:
        emit_json(summary)
    return 0
