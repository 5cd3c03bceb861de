"""Ranks agree on what they train: the same flags, the same data, the same model.

An MPI job is one program run N times, but nothing makes the N copies see the same inputs: an MPMD
launch (`mpiexec -n 2 ... : -n 2 ...`) can give ranks different flags, per-node working directories
or scratch disks can hold different files under one `--data` path, and nodes can run different
versions of the code. Each of these trains a wrong model without any error: DDP averages gradients
of different vocabularies, ZeRO shards parameters that do not line up.

So, before step 1, every rank describes its run and the descriptions are compared (one
allgather of a few hundred bytes):

    flags   every TrainConfig field
    data    what this rank read: --data FILE by its SHA-256 (each rank hashes its own copy) and
            vocabulary size; a synthetic task by its name and vocabulary
    model   the whole model's specification -- every parameter's name, shape and dtype, and
            refimpl's version -- hashed (not the rank's part: pipeline and tensor-parallel ranks
            hold different parts by design, built from the same whole)

A difference is an AgreedError on every rank (refimpl.tools.runtime.failure): each rank prints nothing,
rank 0 prints what differs on which ranks, and every rank exits 2 -- nobody is left waiting.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import refimpl
from refimpl.tools.runtime.failure import AgreedError, on_ranks
from refimpl.tools.saved_runs.fingerprint import file_sha256


def describe_run(cfg, task, model) -> dict[str, object]:
    """What this rank is about to train (see the module docstring)."""
    if cfg.data is not None:

        data = f"--data {cfg.data} with SHA-256 {file_sha256(cfg.data)[:16]}… and {task.vocab_size} characters"
    else:
        data = f"the {type(task).__name__} with vocabulary {getattr(task, 'vocab_size', None)}"
    spec = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    digest = hashlib.sha256(json.dumps([refimpl.__version__, spec]).encode()).hexdigest()
    n = sum(int(p.size) for _, p in model.named_parameters())
    model_text = f"{len(spec)} tensors, {n:,} parameters (specification {digest[:12]}, refimpl {refimpl.__version__})"
    return {"flags": asdict(cfg), "data": data, "model": model_text}


def check_same_run(world, cfg, task, model) -> None:
    """Collective: AgreedError on every rank unless every rank trains the same run."""
    if world.size == 1:
        return
    runs = world.allgather_object(describe_run(cfg, task, model))
    problems = []
    flags = runs[0]["flags"]
    for field in flags:
        values = [run["flags"][field] for run in runs]
        if any(v != values[0] for v in values):
            problems.append(f"--{field.replace('_', '-')}: {_by_value(values)}")
    if problems:
        raise AgreedError("ranks were launched with different flags: " + "; ".join(problems)
                          + " (every rank must get the same command line)")
    for what, advice in (("data", "give every rank the same file (per-node working directories or scratch "
                                  "disks can hold different files under one path)"),
                         ("model", "install the same refimpl on every node")):
        values = [run[what] for run in runs]
        if any(v != values[0] for v in values):
            raise AgreedError(f"ranks would train on different {what}: {_by_value(values)}; {advice}")


def _by_value(values: list) -> str:
    """'0.01 on ranks 0, 1 vs 0.02 on rank 2': each distinct value with the ranks that have it."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(repr(value) if not isinstance(value, str) else value, []).append(rank)
    return " vs ".join(f"{value} {on_ranks(r)}" for value, r in ranks.items())
