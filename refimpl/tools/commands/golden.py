"""`python -m refimpl golden`: write a golden case, or check another framework's results against one.

    python -m refimpl golden --out case/                             # a 2-block GPT, 3 steps, float64
    python -m refimpl golden --out case/ --optimizer sgd --lr 0.1 --steps 5
    python -m refimpl golden --check case/ --against results.npz     # PASS (0), FAIL (1) or bad input (2)
    python docs/examples/torch_ddp_golden.py case/ results.npz      # PyTorch DDP writes results.npz

A case (refimpl/tools/golden.py; docs/golden_cases.md) holds the configuration, the initial
weights, the global batches and single-process training's loss, gradients and parameters after
every step, as .npz files with a JSON manifest of their SHA-256 checksums. A results file written
by any framework with the same keys is compared with it tensor by tensor: one line per tensor
beyond the tolerance, the first failing step and tensor, exit status 1 on a FAIL; a case or a
results file that cannot be compared (a checksum, a missing tensor, a shape or a configuration
that does not match) is one line, exit status 2.
"""

from __future__ import annotations

import argparse
import os

from refimpl.optim import OPTIMIZERS
from refimpl.parallel.comm import existing_world
from refimpl.tools.console import emit_json, log
from refimpl.tools.flags import config_from_args
from refimpl.tools.golden import FORMAT, check_results, load_case, write_case
from refimpl.tools.run import DEFAULTS

# A case small enough to read and to run anywhere: flags not given take these, then train's defaults.
CASE_DEFAULTS = {"steps": 3, "batch_size": 8, "n_layer": 2, "d_model": 16, "n_head": 4, "seq_len": 8}
SHOWN_FAILURES = 50


def add_arguments(p: argparse.ArgumentParser) -> None:
    action = p.add_mutually_exclusive_group(required=True)
    action.add_argument("--out", metavar="DIR", help="write a golden case into DIR (new, empty, or an earlier case)")
    action.add_argument("--check", metavar="DIR", help="check the golden case in DIR (its checksums and arrays), and "
                        "with --against a results file against it")
    p.add_argument("--against", metavar="RESULTS.npz",
                   help="with --check: a results file (loss, grads/SSS/NAME, params/SSS/NAME) from any framework")
    p.add_argument("--rtol", type=float, help="relative tolerance per tensor (float64 1e-10, float32 1e-5)")
    p.add_argument("--atol", type=float, help="absolute tolerance per tensor's norm (float64 1e-12, float32 1e-6)")
    p.add_argument("--model", choices=sorted(DEFAULTS), default="gpt",
                   help="gpt: sorting task (or --data text); mlp: 2-D spirals (default gpt)")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {CASE_DEFAULTS['steps']})")
    p.add_argument("--batch-size", type=int, help=f"global batch size (default {CASE_DEFAULTS['batch_size']})")
    p.add_argument("--lr", type=float, help="learning rate (gpt 3e-3, mlp 1e-2)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                   help="adamw, or sgd (momentum 0.9) (default adamw)")
    p.add_argument("--weight-decay", type=float, default=None, help="weight decay, >= 0 (default 0)")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (0: off; default 1)")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64", help="default float64")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    p.add_argument("--n-layer", type=int, help=f"transformer blocks, or MLP hidden layers "
                   f"(default {CASE_DEFAULTS['n_layer']})")
    p.add_argument("--d-model", type=int, help=f"model width (default {CASE_DEFAULTS['d_model']})")
    p.add_argument("--n-head", type=int, help=f"attention heads (default {CASE_DEFAULTS['n_head']})")
    p.add_argument("--seq-len", type=int, help=f"context length (default {CASE_DEFAULTS['seq_len']})")
    p.add_argument("--data", metavar="FILE", help="a character-level GPT on this UTF-8 text file")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _config(args):
    for name, value in CASE_DEFAULTS.items():
        own = not (name == "seq_len" and args.data is not None) and not (name in ("seq_len", "n_head")
                                                                          and args.model == "mlp")
        if getattr(args, name) is None and own:
            setattr(args, name, value)
    cfg = config_from_args(args)
    cfg.check()
    return cfg


def check(args) -> None:
    """The checks made before any work (cli.main)."""
    world = existing_world()
    if world is not None and world.size > 1:
        raise ValueError(f"golden runs in one process (a case is single-process training; its check reads files), "
                         f"not under mpiexec -n {world.size}: run python -m refimpl golden ...")
    if args.out is not None:
        if args.against is not None:
            raise ValueError("--against goes with --check DIR (compare results with a case), not with --out")
        _config(args)
        _check_out_dir(args.out)
    elif args.against is not None and not os.path.isfile(args.against):
        raise ValueError(f"--against {args.against}: no such file; give the results .npz your framework wrote")


def _check_out_dir(path: str) -> None:
    """DIR is new, empty, or holds an earlier case (its four files are replaced)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out {path} is a file; give a directory")
    if os.path.isdir(path):
        ours = {"manifest.json", "initial.npz", "batches.npz", "expected.npz"}
        others = sorted(set(os.listdir(path)) - ours)
        if others:
            raise ValueError(f"--out {path} holds other files ({', '.join(others[:3])}); give a new or empty "
                             f"directory, or one that holds only a golden case")
        if not os.access(path, os.W_OK):
            raise ValueError(f"--out {path} is not writable")
    elif not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"--out {path}: no such directory {os.path.dirname(os.path.abspath(path))}")


def run(args) -> int:
    check(args)
    if args.out is not None:
        cfg = _config(args)
        manifest = write_case(cfg, args.out)
        size = sum(entry["bytes"] for entry in manifest["files"].values())
        log(f"golden case written to {args.out}: {cfg.model}, {len(manifest['parameters'])} tensors, "
            f"{cfg.steps} steps, {cfg.dtype}, {manifest['optimizer']['name']}; {size / 1024:.0f} KiB "
            f"({FORMAT}, case_id {manifest['case_id'][:16]}...)")
        if args.json:
            emit_json({"ok": True, **manifest})
        return 0
    if args.against is None:
        manifest, *_ = load_case(args.check)
        log(f"golden case {args.check}: intact ({len(manifest['parameters'])} tensors, {manifest['steps']} steps, "
            f"checksums match)")
        if args.json:
            emit_json({"ok": True, "case": args.check, "case_id": manifest["case_id"]})
        return 0
    result = check_results(args.check, args.against, args.rtol, args.atol)  # CaseError: one line, exit 2
    for failure in result["failures"][:SHOWN_FAILURES]:
        log(failure["line"])
    if len(result["failures"]) > SHOWN_FAILURES:
        log(f"... and {len(result['failures']) - SHOWN_FAILURES} more")
    largest = result["largest"]
    what = (f"{result['steps']} steps x (loss + {result['tensors_per_step']} gradients + "
            f"{result['tensors_per_step']} parameters) = {result['checked']} comparisons")
    if result["ok"]:
        log(f"golden PASS: {args.against} matches {args.check}: {what}; largest relative error "
            f"{largest['relative_error']:.3g} ({largest['what']}), rtol {result['rtol']:g}")
    else:
        log(f"golden FAIL: {len(result['failures'])} of {result['checked']} comparisons beyond rtol "
            f"{result['rtol']:g}; first: {result['first_failure']}")
    if args.json:
        emit_json(result)
    return 0 if result["ok"] else 1
