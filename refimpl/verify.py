"""verify: is the distributed algorithm right? `python -m refimpl verify [train flags]`.

Runs the distributed configuration (under mpiexec, or a world of one process) for K optimizer
steps, and, on rank 0, the single-process reference — train.LocalTrainer, plain training code that
imports nothing from refimpl.parallel — on the same global batches from the same initial weights.
After every step it compares the loss, every parameter's gradient (as used by the optimizer) and
every parameter, and reports the largest absolute and relative differences. It passes when every
element satisfies

    |distributed − reference| <= atol + rtol · |reference|

with rtol 1e-10, atol 1e-12 in float64 and rtol 1e-5, atol 1e-6 in float32 (DESIGN.md's
tolerances; --rtol and --atol override them).

verify runs in float64 unless --dtype says otherwise. A distributed run sums gradients in another
order than one process, so they differ by rounding (about 1e-16 relative in float64, 1e-7 in
float32). AdamW divides each gradient by its running magnitude: where a gradient is about as small
as eps (1e-8), the update's sensitivity to it is about lr/eps, 10⁵ times and more. In float32 that
turns harmless rounding into parameter differences above 1e-5 after one step (with SGD it does
not); in float64 the same amplification stays far below 1e-10. It exits 1 when the check fails, and every rank
exits with the same status. `--json` prints one object with ok, max_abs_diff, max_rel_diff, steps,
world_size, tolerance_used (the largest |diff| / (atol + rtol·|reference|): the check passes when
it is at most 1) and the per-step figures. max_rel_diff divides by max(|reference|, atol), so
elements that are nearly zero can show a large relative difference that is still within atol.
"""

from __future__ import annotations

import argparse

import numpy as np

from refimpl import backend
from refimpl.console import emit_json, log
from refimpl.train import LocalTrainer, add_arguments as add_train_arguments, build_model, build_optimizer, \
    build_task, check_same_config, config_from_args, get_world, make_trainer

TOLERANCES = {"float64": (1e-10, 1e-12), "float32": (1e-5, 1e-6)}
DEFAULT_STEPS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_train_arguments(p)
    p.set_defaults(dtype="float64")  # verification is done in float64 (see the module docstring)
    p.add_argument("--rtol", type=float, help="relative tolerance (float64 1e-10, float32 1e-5)")
    p.add_argument("--atol", type=float, help="absolute tolerance (float64 1e-12, float32 1e-6)")


def compare(ours: dict, reference: dict, rtol: float, atol: float) -> dict:
    """Largest absolute and relative differences over arrays with the same names, and whether all pass."""
    worst = {"max_abs_diff": 0.0, "max_rel_diff": 0.0, "tolerance_used": 0.0, "worst_name": None, "ok": True}
    if set(ours) != set(reference):
        raise ValueError(f"verify: the runs have different parameters: {sorted(set(ours) ^ set(reference))}")
    for name, ref in reference.items():
        a, b = np.asarray(ours[name], dtype=np.float64), np.asarray(ref, dtype=np.float64)
        diff = np.abs(a - b)
        abs_diff = float(diff.max()) if diff.size else 0.0
        rel_diff = float((diff / np.maximum(np.abs(b), atol)).max()) if diff.size else 0.0
        if abs_diff > worst["max_abs_diff"]:
            worst["max_abs_diff"], worst["worst_name"] = abs_diff, name
        worst["max_rel_diff"] = max(worst["max_rel_diff"], rel_diff)
        used = float((diff / (atol + rtol * np.abs(b))).max()) if diff.size else 0.0
        worst["tolerance_used"] = max(worst["tolerance_used"], used)  # <= 1 passes
    worst["ok"] = worst["tolerance_used"] <= 1.0
    return worst


def run(args) -> int:
    if args.steps is None:
        args.steps = DEFAULT_STEPS
    cfg = config_from_args(args)
    cfg.check()
    if cfg.dtype not in TOLERANCES:  # mixed precision has no single-process twin to compare with
        raise ValueError(f"verify compares float64 or float32 runs with single-process training, not --dtype "
                         f"{cfg.dtype}; mixed precision is tested in tests/test_zero.py (loss scaling, skipped steps)")
    rtol = args.rtol if args.rtol is not None else TOLERANCES[cfg.dtype][0]
    atol = args.atol if args.atol is not None else TOLERANCES[cfg.dtype][1]
    world = get_world(cfg)
    check_same_config(world, cfg)
    task = build_task(cfg)

    # 1. The distributed run, recording what rank 0 needs for the comparison.
    trainer = make_trainer(cfg, build_model(cfg, task), world, distributed=True)
    trainer.record_grads = True
    recorded = []
    for step in range(cfg.steps):
        x, y = task.batch(step, cfg.batch_size)
        loss = trainer.step(x, y)
        params = trainer.full_parameters()
        if world.rank == 0:
            recorded.append((loss, trainer.last_grads, params))
    counters = world.counters_by_rank()

    # 2. The single-process reference, on rank 0, on the same global batches.
    result = None
    if world.rank == 0:
        model = build_model(cfg, task)
        reference = LocalTrainer(model, build_optimizer(cfg, model.parameters()), cfg.grad_accum, cfg.clip)
        reference.record_grads = True
        per_step = []
        for step, (loss, grads, params) in enumerate(recorded):
            x, y = task.batch(step, cfg.batch_size)
            ref_loss = reference.step(x, y)
            g = compare(grads, reference.last_grads, rtol, atol)
            p = compare(params, reference.full_parameters(), rtol, atol)
            loss_diff = abs(loss - ref_loss)
            loss_ok = loss_diff <= atol + rtol * abs(ref_loss)
            per_step.append({"step": step, "loss": loss, "reference_loss": ref_loss, "loss_abs_diff": loss_diff,
                             "grad_max_abs_diff": g["max_abs_diff"], "grad_max_rel_diff": g["max_rel_diff"],
                             "param_max_abs_diff": p["max_abs_diff"], "param_max_rel_diff": p["max_rel_diff"],
                             "tolerance_used": max(g["tolerance_used"], p["tolerance_used"]),
                             "ok": bool(g["ok"] and p["ok"] and loss_ok)})
            log(f"step {step}: loss {loss:.12g} (reference {ref_loss:.12g}, |diff| {loss_diff:.2e}); "
                f"grads max |diff| {g['max_abs_diff']:.2e} (rel {g['max_rel_diff']:.2e}, worst {g['worst_name']}); "
                f"params max |diff| {p['max_abs_diff']:.2e} (rel {p['max_rel_diff']:.2e})"
                + ("" if per_step[-1]["ok"] else "  <-- beyond tolerance"))
        result = {
            "ok": all(s["ok"] for s in per_step),
            "max_abs_diff": max(max(s["grad_max_abs_diff"], s["param_max_abs_diff"], s["loss_abs_diff"]) for s in per_step),
            "max_rel_diff": max(max(s["grad_max_rel_diff"], s["param_max_rel_diff"]) for s in per_step),
            "tolerance_used": max(s["tolerance_used"] for s in per_step),
            "steps": cfg.steps,
            "world_size": world.size,
            "rtol": rtol,
            "atol": atol,
            "trainer": type(trainer).__name__,
            **trainer.report(),
            "per_step": per_step,
            "bytes_sent": counters,
            "backend": backend.name(),
            **world.transfer_report(),  # CUDA-aware MPI or host staging (parallel/staging.py)
        }
    ok = world.bcast_object(None if result is None else result["ok"])
    if world.rank == 0:
        verdict = "PASS" if ok else "FAIL"
        log(f"verify {verdict}: {type(trainer).__name__} on {world.size} process(es) vs single-process reference, "
            f"{cfg.steps} steps, max abs diff {result['max_abs_diff']:.3e}; "
            f"largest |diff| / (atol + rtol |reference|) = {result['tolerance_used']:.3g}, passes at <= 1 "
            f"(rtol {rtol:g}, atol {atol:g})")
        if args.json:
            emit_json(result)
    return 0 if ok else 1
