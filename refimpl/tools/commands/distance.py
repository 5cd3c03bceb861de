"""`python -m refimpl distance --trainer FILE.py:FUNCTION [flags]`: how far is an algorithm from
single-process training, when it is not meant to be equal?

    mpiexec -n 2 python -m refimpl distance --trainer docs/examples/local_sgd_trainer.py:make_trainer \\
        --optimizer sgd --lr 0.1 --clip 0 --steps 100 --plot distance.png --json
    mpiexec -n 2 python -m refimpl distance --trainer docs/examples/topk_trainer.py:make_trainer \\
        --trainer docs/examples/topk_trainer.py:make_error_feedback_trainer --optimizer sgd --lr 0.1 --clip 0

Each --trainer (FUNCTION(cfg, model, world) -> trainer, as verify --trainer takes) is trained on
the same global batches from the same initial weights as single-process training, and compared with
it in lockstep (per step and tensor: the gradient's relative error and cosine, the update's error,
the accumulated gradient error) and free-running (the parameters' drift, the loss and held-out loss
curves side by side); what each figure is: refimpl/tools/distance.py and docs/distance.md. The
exit status is 0 whatever the distance (a measure, not a verdict), 2 for bad input.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from refimpl.optim import OPTIMIZERS
from refimpl.tools.console import emit_json, log
from refimpl.tools.distance import distance_run, draw, require_matplotlib, summary_line
from refimpl.tools.flags import check_writable, config_from_args
from refimpl.tools.run import DEFAULTS, get_world
from refimpl.tools.verification import load_trainer_factory

DEFAULT_STEPS = 100
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trainer", action="append", required=True, metavar="MODULE:FUNCTION",
                   help="the algorithm: FUNCTION(cfg, model, world) -> trainer, from a module or a .py file; "
                        "repeat it to compare several in one run")
    p.add_argument("--model", choices=sorted(DEFAULTS), default="gpt",
                   help="gpt: sorting task (or --data text); mlp: 2-D spirals (default gpt)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default {DEFAULT_STEPS})")
    p.add_argument("--batch-size", type=int, help="global batch size (gpt 32, mlp 128)")
    p.add_argument("--lr", type=float, help="learning rate (gpt 3e-3, mlp 1e-2)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                   help="adamw, or sgd (momentum 0.9) (default adamw)")
    p.add_argument("--weight-decay", type=float, default=None, help="weight decay, >= 0 (default 0)")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (0: off; default 1)")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64", help="default float64")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    p.add_argument("--n-layer", type=int, help="transformer blocks, or MLP hidden layers (default 2)")
    p.add_argument("--d-model", type=int, help="model width (default 64)")
    p.add_argument("--n-head", type=int, help="attention heads (default 4)")
    p.add_argument("--seq-len", type=int, help="context length (sorting: 2 x sequence length, default 16)")
    p.add_argument("--data", metavar="FILE", help="train a character-level GPT on this UTF-8 text file")
    p.add_argument("--eval-every", type=int, metavar="K",
                   help="held-out loss every K steps, and after the last (default: steps / 10)")
    p.add_argument("--plot", metavar="FILE", help="draw the curves (matplotlib: .png, .svg or .pdf)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout: every figure per step and tensor")


def _config(args):
    cfg = config_from_args(args)
    cfg.check()
    return cfg


def check(args) -> None:
    """The checks every rank makes at startup, before any communication (cli.main)."""
    for spec in args.trainer:
        load_trainer_factory(spec)
    _config(args)
    if args.eval_every is not None and args.eval_every < 1:
        raise ValueError(f"--eval-every must be a positive number of steps, got {args.eval_every}")
    if args.plot is not None:
        if not args.plot.endswith(PLOT_SUFFIXES):
            raise ValueError(f"--plot {args.plot}: give a file name ending in {', '.join(PLOT_SUFFIXES)}")
        check_writable(args.plot, "--plot")
        require_matplotlib()


def run(args) -> int:
    check(args)
    cfg = _config(args)
    factories = [(spec, load_trainer_factory(spec)) for spec in args.trainer]
    world = get_world(cfg)
    eval_every = args.eval_every or max(1, cfg.steps // 10)
    result = distance_run(cfg, world, factories, eval_every)
    if world.rank != 0:
        return 0
    steps = sorted({0, min(9, cfg.steps - 1), min(49, cfg.steps - 1), cfg.steps - 1})
    log(f"distance from single-process training: {world.size} process(es), {cfg.steps} steps, {cfg.dtype}, "
        f"{cfg.optimizer} lr {cfg.lr:g}; whole-model figures at steps {', '.join(map(str, steps))} (0: the first)")
    for measured in result["trainers"]:
        log(summary_line(measured, steps))
        for problem in measured["problems"][:5]:
            log(f"  {problem}")
    if args.plot:
        draw(result, args.plot)
        log(f"wrote {args.plot}")
    if args.json:
        emit_json({"ok": True, "config": asdict(cfg), "eval_every": eval_every, **result})
    return 0
