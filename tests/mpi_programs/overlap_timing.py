"""Exposed communication in sleep-cost + link-delay mode: the fields are reported, the delays change
no number, and the all-to-alls counted are the simulator's.

    mpiexec -n N python tests/mpi_programs/overlap_timing.py CONFIGS.json TRACE_DIR

For each train flag list (with --action-costs ...,P=..,A=..), one trainer takes one step in that
mode (the i-th config writes TRACE_DIR/trace_i.json) and one in compute mode without delays, from
the same seed on the same batch. Rank 0 prints one JSON list of {"flags", "identical", "timing",
"simulated_exchanges", "trace"}: identical is whether the losses and parameters are equal bit for
bit (on every rank: a message that carries its send time, sleeps and delays change no number),
timing the report() of the delayed run's Timeline (tools/timeline.py), simulated_exchanges the
all-to-alls per rank of the simulator's chunk model, trace the (pid, cat) pairs of the trace's
complete events.
"""

import json
import os
import sys

import numpy as np

from refimpl.parallel.comm import get_world
from refimpl.tools import timeline as tl
from refimpl.tools.console import emit_json
from refimpl.tools.flags import config_from_flags
from refimpl.tools.run import build_model, build_task, make_trainer
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)


def run(world, flags: list):
    cfg = config_from_flags(flags)
    task = build_task(cfg)
    trainer = make_trainer(cfg, build_model(cfg, task), world, distributed=True)
    loss = trainer.step(*task.batch(0, cfg.batch_size))
    return trainer, loss, trainer.full_parameters()


def without_delays(flags: list) -> list:
    """The same flags in compute mode: --action-costs and --trace dropped."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in ("--action-costs", "--trace"):
            skip = True
        else:
            out.append(flag)
    return out


def main() -> None:
    world = get_world()
    with open(sys.argv[1]) as f:
        configs = json.load(f)
    results = []
    for i, flags in enumerate(configs):
        trace = os.path.join(sys.argv[2], f"trace_{i}.json")
        flags = [str(flag) for flag in flags] + ["--trace", trace]
        delayed, loss, params = run(world, flags)
        _, plain_loss, plain_params = run(world, without_delays(flags))
        identical = loss == plain_loss and params.keys() == plain_params.keys() and all(
            np.array_equal(params[k], plain_params[k]) for k in params)
        observer = delayed.executor.observer  # the Timeline make_trainer installed
        prediction = tl.simulate_configured(delayed.schedule, observer.costs, observer.stage_exchanges,
                                            delayed.executor.overlap)
        world.barrier()
        kinds = []
        if world.rank == 0:
            with open(trace) as f:
                events = json.load(f)["traceEvents"]
            kinds = sorted({(e["pid"], e["cat"]) for e in events if e["ph"] == "X"})
        results.append({"flags": flags, "identical": all(world.allgather_object(identical)),
                        "timing": observer.report(), "simulated_exchanges": prediction.all_to_all, "trace": kinds})
    if world.rank == 0:
        emit_json(results)


if __name__ == "__main__":
    main()
