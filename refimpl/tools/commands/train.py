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

from dataclasses import asdict

from refimpl import backend
from refimpl.tools.console import emit_json, log
from refimpl.tools.flags import add_run_arguments, config_from_args
from refimpl.tools.run import TrainingDiverged, get_world, train

add_arguments = add_run_arguments


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
    if cfg.model == "gpt":
        speed = f"{summary['tokens_per_s']:.0f} tokens/s"
    else:
        speed = f"{summary['samples_per_s']:.0f} samples/s"
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
