"""`python -m refimpl verify [train flags]`: check a distributed run against single-process training.

    python -m refimpl verify --zero 3                          # a world of one process
    mpiexec -n 4 python -m refimpl verify --pp 2 --schedule zb1p --zero 2
    mpiexec -n 2 python -m refimpl verify --sweep 20           # 20 drawn configurations
    python -m refimpl verify --trainer docs/examples/flat_allreduce_trainer.py:make_trainer

verify takes train's flags (in float64 unless --dtype says otherwise), runs the configuration for
a few steps (3 by default) and compares every step with the single-process reference; what is
compared, and at which tolerance, is refimpl/tools/verification.py's (verify_config).

--sweep N draws N configurations valid for this world size (refimpl/tools/sweep.py) and verifies each;
--trainer module:function verifies a trainer of your own (docs/verify_your_algorithm.md).
--schedule module:function (or file.py:function) runs a pipeline schedule of your own, like a
built-in one (docs/capstone.md); with --sweep N, --schedule NAME (built-in or your own) makes every
drawn configuration a pipeline of that schedule (pp, micro-batches, ZeRO, tp... still drawn).

It exits 1 when the check fails, and every rank exits with the same status. `--json` prints one
object with ok, max_abs_diff, max_rel_diff, steps, world_size, tolerance_used (the largest
|diff| / (atol + rtol·|reference|): the check passes when it is at most 1), problems (non-finite
values, skipped steps that differ) and the per-step figures; with --sweep,
{"ok", "seed", "sweep": [{"flags", "ok", "tolerance_used", "problems"}, ...]}.
"""

from __future__ import annotations

import argparse
import shlex

import numpy as np

from refimpl import backend
from refimpl.parallel.comm import get_world as world_of
from refimpl.tools.console import emit_json, log
from refimpl.tools.flags import add_run_arguments, config_from_args
from refimpl.tools.plugin import is_spec as is_plugin
from refimpl.tools.plugin import load_schedule_generator
from refimpl.tools.run import get_world
from refimpl.tools.sweep import draw_flags, numpy_chooser, schedule_options
from refimpl.tools.verification import load_trainer_factory, verify_config

DEFAULT_STEPS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    p.set_defaults(dtype="float64")  # verification is done in float64 (see refimpl/tools/verification.py)
    p.add_argument("--rtol", type=float, help="relative tolerance (float64 1e-10, float32 1e-5)")
    p.add_argument("--atol", type=float, help="absolute tolerance (float64 1e-12, float32 1e-6)")
    p.add_argument("--sweep", type=int, metavar="N",
                   help="verify N configurations drawn for this world size (refimpl/tools/sweep.py)")
    p.add_argument("--sweep-seed", type=int, metavar="S",
                   help="seed of the sweep's draws (default: a new one, printed)")
    p.add_argument("--trainer", metavar="MODULE:FUNCTION",
                   help="verify your own trainer: FUNCTION(cfg, model, world) -> trainer, from a module or a .py file")
    p.add_argument("--inject-overflow", type=int, metavar="STEP",
                   help="--dtype mixed: put an inf into one gradient at STEP on both sides (both must skip it)")


def check(args) -> None:
    """The checks every rank makes at startup, before any communication (cli.main)."""
    if args.steps is None:
        args.steps = DEFAULT_STEPS
    if args.sweep is not None and args.sweep <= 0:
        raise ValueError(f"--sweep needs a positive number of configurations, got {args.sweep}")
    if args.trainer:
        load_trainer_factory(args.trainer)
    if args.sweep is not None and args.schedule is not None:
        if args.trainer:
            raise ValueError("--sweep --trainer draws data-parallel configurations only; drop --schedule, or --trainer")
        if is_plugin(args.schedule):
            load_schedule_generator(args.schedule)  # a missing module or function: one line, before the sweep starts
    if args.sweep is None:
        config_from_args(args).check()


def run(args) -> int:
    if args.steps is None:
        args.steps = DEFAULT_STEPS
    if args.sweep is not None:
        return run_sweep(args)
    factory = load_trainer_factory(args.trainer) if args.trainer else None
    cfg = config_from_args(args)
    cfg.check()
    world = get_world(cfg)
    result = verify_config(cfg, world, factory, args.rtol, args.atol, args.inject_overflow)
    counters = world.counters_by_rank()
    if world.rank == 0:
        result.update({"bytes_sent": counters, "backend": backend.name(), **world.transfer_report()})
        log(f"verify {'PASS' if result['ok'] else 'FAIL'}: {result['trainer']} on {world.size} process(es) vs "
            f"single-process reference, {cfg.steps} steps, {cfg.dtype}; largest |diff| / (atol + rtol |reference|) "
            f"= {result['tolerance_used']:.3g}, passes at <= 1 ("
            + ("mixed precision's float16 bounds, lockstep" if cfg.dtype == "mixed" else
               f"rtol {result['rtol']:g}, atol {result['atol']:g}") + ")"
            + (f"; {len(result['problems'])} problem(s), first: {result['problems'][0]}" if result["problems"] else ""))
        if args.json:
            emit_json(result)
    return 0 if result["ok"] else 1


def command_line(world_size: int, flags: list) -> str:
    """The command that reproduces one verification."""
    launcher = f"mpiexec -n {world_size} " if world_size > 1 else ""
    return launcher + "python -m refimpl verify " + " ".join(shlex.quote(str(f)) for f in flags)


# -- verify --sweep N (the configurations: refimpl/tools/sweep.py) --------------------------------------

def verify_flags(world, flags: list, factory=None) -> dict:
    """Verify one configuration given as verify flags (collective); the result as verify_config's."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    args = parser.parse_args([str(f) for f in flags])
    if args.steps is None:
        args.steps = 2
    cfg = config_from_args(args)
    cfg.check()
    return verify_config(cfg, world, factory, args.rtol, args.atol, args.inject_overflow, quiet=True)


def run_sweep(args) -> int:
    """verify --sweep N: draw, verify and report each configuration; exit 1 if any fails."""
    if args.sweep <= 0:
        raise ValueError(f"--sweep needs a positive number of configurations, got {args.sweep}")
    if args.sweep_seed is not None and args.sweep_seed < 0:
        raise ValueError(f"--sweep-seed must be >= 0 (a seed that a sweep printed), got {args.sweep_seed}")
    factory = load_trainer_factory(args.trainer) if args.trainer else None
    world = world_of("mpi")
    seed = args.sweep_seed if args.sweep_seed is not None else int(np.random.SeedSequence().entropy % 2 ** 32)
    seed = world.bcast_object(seed)  # one sweep: every rank draws the same configurations
    rng = np.random.default_rng(seed)
    if args.schedule is not None:  # every rank builds the same options: the same error everywhere, or none
        schedule_options(world.size, [args.schedule])
    if world.rank == 0:
        log(f"verify --sweep {args.sweep} on {world.size} process(es), seed {seed} (replay: --sweep-seed {seed})"
            + (f", pipelines of --schedule {args.schedule}" if args.schedule else ""))
    results = []
    for i in range(args.sweep):
        flags = draw_flags(world.size, numpy_chooser(rng), pipeline=factory is None,
                           schedules=[args.schedule] if args.schedule else None)
        result = verify_flags(world, flags, factory)
        if world.rank == 0:
            line = f"[{i + 1}/{args.sweep}] {'PASS' if result['ok'] else 'FAIL'} tolerance used " \
                   f"{result['tolerance_used']:.2g}: {' '.join(flags)}"
            log(line)
            if not result["ok"]:
                for problem in result["problems"][:5]:
                    log(f"    {problem}")
                trainer_flags = ["--trainer", args.trainer] if args.trainer else []
                log(f"    reproduce: {command_line(world.size, flags + trainer_flags)}")
            results.append({"flags": flags, "ok": result["ok"], "tolerance_used": result["tolerance_used"],
                            "problems": result["problems"]})
    ok = all(r["ok"] for r in results) if world.rank == 0 else True
    ok = bool(world.bcast_object(ok))
    if world.rank == 0:
        failed = sum(not r["ok"] for r in results)
        log(f"verify --sweep {'PASS' if ok else 'FAIL'}: {len(results) - failed} of {len(results)} configurations "
            f"equal single-process training on {world.size} process(es) (seed {seed})")
        if args.json:
            emit_json({"ok": ok, "seed": seed, "world_size": world.size, "sweep": results})
    return 0 if ok else 1
