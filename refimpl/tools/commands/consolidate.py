"""`python -m refimpl consolidate CKPT --out model.npz`: a sharded checkpoint as one state dict.

    python -m refimpl consolidate ck/step_00000040 --out model.npz
    python -m refimpl consolidate ck --out model.npz --optimizer      # ck's newest intact step

Writes the whole model as one ordinary .npz state dict ({name: array}, loadable with
model.load_state_dict(dict(numpy.load(...)))); --optimizer adds the optimizer state as
"optimizer/<key>/<name>". The file is replaced only if every shard checks out. The reading,
checking and writing are refimpl/tools/saved_runs/sharded.py's (`consolidate`); this module parses and
prints.
"""

from __future__ import annotations

import argparse

from refimpl.parallel.comm import get_world
from refimpl.tools.console import emit_json, log
from refimpl.tools.saved_runs import sharded


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory (step_*), or a --save-dir (its newest intact checkpoint)")
    p.add_argument("--out", required=True, help="the .npz file to write (replaced only if everything checks out)")
    p.add_argument("--optimizer", action="store_true", help="also write optimizer state as optimizer/<key>/<name>")
    p.add_argument("--json", action="store_true", help="print one JSON summary line on stdout")


def run(args) -> int:
    """Under mpiexec rank 0 reads and writes; the other ranks wait for it and share its outcome (an
    error is printed once, every rank exits 2)."""

    world = get_world()
    result = sharded.on_rank0(world, lambda: sharded.consolidate(str(args.checkpoint), str(args.out), args.optimizer))
    if world.rank != 0:
        return 0
    log(f"consolidated {result['checkpoint']} (step {result['step']}, saved by {result['saved_world_size']} rank(s) "
        f"at ZeRO stage {result['saved_zero_stage']}) into {result['out']}: {result['parameters']} parameters, "
        f"{result['elements']} elements, {result['bytes']} bytes")
    if args.json:
        emit_json(result)
    return 0
