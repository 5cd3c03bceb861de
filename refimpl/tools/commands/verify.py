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

The report is printed on stdout (errors on stderr): a line per step and the verdict, PASS or FAIL,
with the configuration it checked. It exits 1 when the check fails, and every rank exits with the
same status. `--json` prints one object on stdout (the human lines then go to stderr) with ok,
max_abs_diff, max_rel_diff, steps, world_size, tolerance_used (the largest
|diff| / (atol + rtol·|reference|): the check passes when it is at most 1), worst_name, worst_what
(gradient, parameter, master weight or loss) and worst_rank, problems (non-finite values, skipped
steps that differ, ranks whose records differ), configuration and checked (what was exercised), the
per-step figures and the trainer's own report under trainer_report; with --sweep,
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
from refimpl.tools.sweep import SMALL, draw_flags, numpy_chooser, schedule_options
from refimpl.tools.verification import (
    build_trainer,
    declared_flags,
    labelled_worst,
    load_trainer_factory,
    verify_config,
)

DEFAULT_STEPS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    p.set_defaults(dtype="float64")  # verification is done in float64 (see refimpl/tools/verification.py)
    for action in p._actions:  # verify's own defaults in --help, not train's
        if "--steps" in action.option_strings:
            action.help = f"optimizer steps compared (default {DEFAULT_STEPS}; 2 in each --sweep configuration)"
        if "--dtype" in action.option_strings:
            action.help = "float64, float32, mixed (float16 storage, float32 master weights, loss scaling) or bf16 " \
                          "(bfloat16 storage, float32 master weights); the last two compared in lockstep " \
                          "(default float64)"
    p.add_argument("--rtol", type=float, help="relative tolerance (float64 1e-10, float32 1e-5)")
    p.add_argument("--atol", type=float, help="absolute tolerance (float64 1e-12, float32 1e-6)")
    p.add_argument("--sweep", type=int, metavar="N",
                   help="verify N configurations drawn for this world size (refimpl/tools/sweep.py)")
    p.add_argument("--sweep-seed", type=int, metavar="S",
                   help="seed of the sweep's draws (default: a new one, printed)")
    p.add_argument("--trainer", metavar="MODULE:FUNCTION",
                   help="verify your own trainer: FUNCTION(cfg, model, world) -> trainer, from a module or a .py file "
                        "(default: refimpl's own)")
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
            raise ValueError("--sweep --schedule draws pipelines of refimpl's own trainer; --sweep --trainer draws "
                             "what your trainer declares (its implements): drop --schedule, or --trainer")
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
    say = log if args.json else human  # with --json, stdout holds the JSON object alone
    result = verify_config(cfg, world, factory, args.rtol, args.atol, args.inject_overflow, say=say)
    counters = world.counters_by_rank()
    if world.rank == 0:
        result.update({"bytes_sent": counters, "backend": backend.name(), **world.transfer_report()})
        say(f"verify {'PASS' if result['ok'] else 'FAIL'}: {result['trainer']} on {world.size} process(es) vs "
            f"single-process reference, {cfg.steps} steps, checked {result['checked']}; largest |diff| / (atol + "
            f"rtol |reference|) = {result['tolerance_used']:.3g}"
            + (f" in {labelled_worst(result)}" if result["worst_name"] else "") + ", passes at <= 1 ("
            + ("mixed precision's float16 bounds, lockstep" if cfg.dtype == "mixed" else
               "bfloat16's bounds (u = 2^-8), lockstep" if cfg.dtype == "bf16" else
               f"rtol {result['rtol']:g}, atol {result['atol']:g}") + ")"
            + (f"; {len(result['problems'])} problem(s), first: {result['problems'][0]}" if result["problems"] else "")
            + (f"; declared flags in use: {' '.join(result['declared_flags_in_use'])} (verify without them to see "
               "whether one is the cause)" if result.get("declared_flags_in_use") else "")
            + (f"; hint: {result['hint']}" if result.get("hint") else ""))
        if args.json:
            emit_json(result)
    return 0 if result["ok"] else 1


def human(line: str) -> None:
    """One line of verify's report, on stdout."""
    print(line, flush=True)


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


def declared_by(world, factory) -> frozenset:
    """The flags a trainer of your own declares it implements (collective: one is built, on a small
    configuration, and its `implements` read), so that a sweep draws only those."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args([*SMALL, "--batch-size", str(world.size)]))
    return declared_flags(build_trainer(cfg, world, factory))


def run_sweep(args) -> int:
    """verify --sweep N: draw, verify and report each configuration; exit 1 if any fails."""
    if args.sweep <= 0:
        raise ValueError(f"--sweep needs a positive number of configurations, got {args.sweep}")
    if args.sweep_seed is not None and args.sweep_seed < 0:
        raise ValueError(f"--sweep-seed must be >= 0 (a seed that a sweep printed), got {args.sweep_seed}")
    factory = load_trainer_factory(args.trainer) if args.trainer else None
    world = world_of("mpi")
    implements = declared_by(world, factory) if factory is not None else None
    say = log if args.json else human
    seed = args.sweep_seed if args.sweep_seed is not None else int(np.random.SeedSequence().entropy % 2 ** 32)
    seed = world.bcast_object(seed)  # one sweep: every rank draws the same configurations
    rng = np.random.default_rng(seed)
    if args.schedule is not None:  # every rank builds the same options: the same error everywhere, or none
        schedule_options(world.size, [args.schedule])
    if world.rank == 0:
        say(f"verify --sweep {args.sweep} on {world.size} process(es), seed {seed} (replay: --sweep-seed {seed})"
            + (f", pipelines of --schedule {args.schedule}" if args.schedule else "")
            + ("" if implements is None else f"; {args.trainer} declares "
               f"{' '.join(sorted(implements)) or 'none of the flags that choose how a step is computed'}, "
               "the others keep their defaults"))
    results = []
    for i in range(args.sweep):
        flags = draw_flags(world.size, numpy_chooser(rng), schedules=[args.schedule] if args.schedule else None,
                           implements=implements)
        result = verify_flags(world, flags, factory)
        if world.rank == 0:
            line = f"[{i + 1}/{args.sweep}] {'PASS' if result['ok'] else 'FAIL'} tolerance used " \
                   f"{result['tolerance_used']:.2g}: {' '.join(flags)}"
            say(line)
            if not result["ok"]:
                for problem in result["problems"][:5]:
                    say(f"    {problem}")
                trainer_flags = ["--trainer", args.trainer] if args.trainer else []
                say(f"    reproduce: {command_line(world.size, flags + trainer_flags)}")
            results.append({"flags": flags, "ok": result["ok"], "tolerance_used": result["tolerance_used"],
                            "checked": result["checked"], "problems": result["problems"]})
    ok = all(r["ok"] for r in results) if world.rank == 0 else True
    ok = bool(world.bcast_object(ok))
    if world.rank == 0:
        failed = sum(not r["ok"] for r in results)
        say(f"verify --sweep {'PASS' if ok else 'FAIL'}: {len(results) - failed} of {len(results)} configurations "
            f"equal single-process training on {world.size} process(es) (seed {seed})")
        if args.json:
            emit_json({"ok": ok, "seed": seed, "world_size": world.size, "sweep": results})
    return 0 if ok else 1
