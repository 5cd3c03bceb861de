"""The bytes a trainer holds, measured from outside it: `mpiexec -n N python trainer_memory.py [SPEC] FLAGS`.

A trainer's own memory ledger is what the trainer registers, so a trainer of the student's own
could report anything. This program counts instead: after two training steps it walks every object
reachable from the trainer and the model (attributes, slots, lists, tuples, dicts, sets; not
modules, classes or functions' globals) and adds up the bytes of the distinct NumPy buffers it
finds: parameters, gradients, optimizer states and whatever else the trainer keeps between steps.
Each rank prints one JSON line {"rank", "held_bytes"}. SPEC is FILE.py:FUNCTION (a trainer factory, as for
`verify --trainer`), or "-" for refimpl's own data-parallel trainer.
"""

from __future__ import annotations

import argparse
import json
import sys
import types

import numpy as np

from refimpl.parallel.comm import get_world
from refimpl.tools.flags import add_run_arguments, config_from_args
from refimpl.tools.run import build_model, build_task
from refimpl.tools.verification import build_trainer, load_trainer_factory

SKIP = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, str, bytes)


def buffers(root) -> dict[int, int]:
    """{address of a distinct base buffer: its bytes} of the arrays reachable from `root`."""
    found, seen, todo = {}, set(), [root]
    while todo:
        value = todo.pop()
        if id(value) in seen or isinstance(value, SKIP):
            continue
        seen.add(id(value))
        if isinstance(value, np.ndarray):
            base = value
            while isinstance(base.base, np.ndarray):
                base = base.base
            found[base.__array_interface__["data"][0]] = base.nbytes
            continue
        if isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            todo.extend(value)
        else:
            todo.extend(getattr(value, "__dict__", {}).values())
            for cls in type(value).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(value, name):
                        todo.append(getattr(value, name))
    return found


def main() -> None:
    spec, flags = sys.argv[1], sys.argv[2:]
    parser = argparse.ArgumentParser(add_help=False)
    add_run_arguments(parser)
    args, _ = parser.parse_known_args(flags)
    cfg = config_from_args(args)
    world = get_world("mpi")
    task = build_task(cfg)
    model = build_model(cfg, task)
    trainer = build_trainer(cfg, world, None if spec == "-" else load_trainer_factory(spec), model)
    for step in range(2):
        x, y = task.batch(step, cfg.batch_size)
        trainer.step(x, y)
    held = sum(buffers([trainer, model]).values())
    print(json.dumps({"rank": world.rank, "held_bytes": int(held)}), flush=True)


if __name__ == "__main__":
    main()
