"""ZeRO at one world size, many cases in one launch: the numbers tests/test_zero.py checks.

    mpiexec -n N python tests/mpi_programs/zero_checks.py CASES.json
    python tests/mpi_programs/zero_checks.py CASES.json        # one process

CASES.json holds a list of cases: {"name", "family", "stage", "config": {TrainConfig fields},
"steps", "reference": bool, "inject": {"rank", "step"} or null}. For each case every rank builds
the model and the trainer (train.make_trainer, as the CLI does), runs `steps` steps and measures:

  * the ledger: model-state bytes by category after construction and after every step, peaks;
  * the communication of every step (this rank's counters, by kind of call);
  * the layout: Ψ, group lengths (padded), persistent group lengths, largest unit;
  * with "inject": on that rank and step, an inf in one gradient (every rank must skip);
  * with "reference" (rank 0): the single-process LocalTrainer on the same batches, and how far
    the losses, last gradients and parameters are from it, in units of the float64 tolerance
    (|diff| / (1e-12 + 1e-10 |reference|), passes at <= 1); cases of one "family" are also
    compared with the family's first case (DP, ZeRO-1, 2, 3 equal to each other).

Prints one JSON line on rank 0: {"world_size": N, "cases": {name: {...}}}.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from refimpl.local_trainer import LocalTrainer
from refimpl.parallel.comm import get_world
from refimpl.tools.compare import compare_arrays, compare_values
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task, make_trainer
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)


def tolerance_used(ours: dict, reference: dict, rtol: float = 1e-10, atol: float = 1e-12) -> float:
    """refimpl.tools.compare's figure: the largest |diff| / (atol + rtol |reference|); inf if anything is not finite."""
    return compare_arrays(ours, reference, rtol, atol).tolerance_used


def layout(trainer) -> dict:
    sharding = trainer.sharding  # DataParallel or a ZeRO stage (refimpl/parallel/trainer.py)
    if hasattr(sharding, "groups"):
        units = getattr(sharding, "unit_of", {})
        return {"groups": [g.length for g in sharding.groups if g.index in units or sharding.stage < 3],
                "persistent": [g.length for g in sharding.groups if sharding.stage == 3 and g.index not in units],
                "numel": [g.numel for g in sharding.groups],
                "largest_unit": max((units[i].group.nbytes for i in units), default=0)}
    return {"groups": [], "persistent": [], "numel": [], "largest_unit": 0,
            "ddp_buckets": [int(f.size) for b in sharding.buckets.values() for f in b.flats]
            if sharding.buckets else None}


def run_case(world, case: dict) -> dict:
    cfg = TrainConfig(**{**case["config"], "zero": case["stage"]})
    cfg.check()
    task = build_task(cfg)
    model = build_model(cfg, task)
    trainer = make_trainer(cfg, model, world, distributed=True)
    out = {"trainer": type(trainer.sharding).__name__, "psi": model.num_parameters(), **layout(trainer),
           "itemsize": model.parameters()[0].dtype.itemsize, "built": trainer.ledger.model_state(), "steps": []}
    losses, before_params = [], None
    for step in range(case["steps"]):
        x, y = task.batch(step, cfg.batch_size)
        handle = None
        if case.get("inject") and step == case["inject"]["step"]:
            before_params = trainer.full_parameters()
            if world.rank == case["inject"]["rank"]:
                handle = model.parameters()[-1].register_hook(lambda g: g * np.float32("inf"))
        trainer.record_grads = case.get("reference", False) and step == case["steps"] - 1
        trainer.ledger.reset_peak()
        snapshot = world.counters.snapshot()
        loss = trainer.step(x, y)
        comm = world.counters.since(snapshot)
        if handle is not None:
            handle.remove()
        report = trainer.report()
        out["steps"].append({"comm": comm, "model_state": trainer.ledger.model_state(), "peak": trainer.ledger.peak(),
                             "loss": loss, "skipped": report.get("skipped_steps", 0),
                             "loss_scale": report.get("loss_scale"), "optimizer_steps": report.get("optimizer_steps")})
        if before_params is not None and step == case["inject"]["step"]:
            after = trainer.full_parameters()
            out["unchanged_by_skipped_step"] = all(np.array_equal(before_params[k], after[k]) for k in after)
        losses.append(loss)
    params = trainer.full_parameters()
    grads = trainer.last_grads
    out["finite"] = all(bool(np.isfinite(v).all()) for v in params.values())
    per_rank = world.allgather_object(out)
    if world.rank != 0:
        return {}
    result = {"ranks": per_rank, "losses": losses}
    if case.get("reference"):
        ref_model = build_model(cfg, task)
        reference = LocalTrainer(ref_model, build_optimizer(cfg, ref_model.parameters()), cfg.grad_accum, cfg.clip)
        reference.record_grads = True
        ref_losses = [reference.step(*task.batch(step, cfg.batch_size)) for step in range(case["steps"])]
        result["vs_reference"] = {
            "loss": max(compare_values(a, b, 1e-10, 1e-12, "loss").tolerance_used for a, b in zip(losses, ref_losses)),
            "grads": tolerance_used(grads, reference.last_grads),
            "params": tolerance_used(params, reference.full_parameters()),
        }
        result["_params"] = params
    return result


def main() -> None:
    world = get_world()
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    results, firsts = {}, {}
    for case in cases:
        result = run_case(world, case)
        if world.rank != 0:
            continue
        params = result.pop("_params", None)
        family = case.get("family")
        if params is not None and family is not None:
            if family in firsts:
                result["vs_family"] = tolerance_used(params, firsts[family])
            else:
                firsts[family] = params
        results[case["name"]] = result
    if world.rank == 0:
        print(json.dumps({"world_size": world.size, "cases": results}))


if __name__ == "__main__":
    main()
