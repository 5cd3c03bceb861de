"""Does a trainer of your own honour the flags it declares? (verify's check of `implements`)

The flags in protocols.IMPLEMENTATION_FLAGS choose *how* a step is computed, not *what*: a trainer
that ignores one computes the same numbers, so no comparison of numbers can tell. What such a flag
changes is what a step *does*. So verify traces one step, on every rank:

    trace = (the operations' forwards and the communicator's calls, interleaved in the order they run,
             the bytes sent by each kind of call)

(the forwards through autograd/recording.py's counting_forwards, the calls through
parallel/comm.py's Counters.log), and compares two runs of one step from the same initial weights
on the same batch: with the flag as given, and with the flag at its default (the flags that only
mean something with it, too: --zero takes --prefetch and --param-threshold along; the batch grows
to a multiple of itself where the configuration without the flag splits it into other pieces).

A flag is *exercised* in a configuration when refimpl's own trainer, which honours every flag,
traces differently with it than without it. A trainer of yours that declares an exercised flag
must then trace differently too, on at least one rank; if it runs the same on every rank, it
ignores the flag, and verify fails in one line naming it. Where refimpl's own trainer does not
change either, the configuration does not exercise the flag (--bucket-bytes larger than the model,
--schedule 1f1b, which is the default, --trace and --mem-budget, which only watch): nothing is
claimed, and verify's configuration lists the flag under "not_exercised". A collective on one rank
counts as a call (refimpl's ZeRO makes them): a trainer of yours that skips its collectives on one
rank can fail there, and is verified on two or more.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from refimpl.autograd import recording
from refimpl.tools.run import TrainConfig, build_model, make_trainer

# The flags that mean something only with another one: reset along with it.
GOES_WITH = {"--zero": ("--prefetch", "--param-threshold"),
             "--pp": ("--schedule", "--micro-batches", "--chunks", "--no-overlap"),
             "--schedule": ("--chunks", "--no-overlap"),
             "--tp": ("--sequence-parallel", "--partition-activations"),
             "--cp": ("--cp-impl",),
             "--checkpoint": ("--partition-activations",)}


class _InOrder(Counter):
    """A forward counter that also appends each forward's operation name to `log`."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def __setitem__(self, name, count) -> None:
        self.log.append(("forward", name))
        super().__setitem__(name, count)


def traced_step(trainer, comm, x, y) -> tuple:
    """One step of `trainer` on (x, y): (forwards and calls in the order they ran, bytes by kind)."""
    log, before = [], comm.counters.snapshot()  # forwards as ("forward", name), calls as their kind
    comm.counters.log = log
    try:
        with recording.counting_forwards(_InOrder(log)):
            trainer.step(x, y)
    finally:
        comm.counters.log = None
    sent = {kind: change["bytes"] for kind, change in comm.counters.since(before).items()}
    return tuple(log), tuple(sorted(sent.items()))


def without(cfg, flag: str, world_size: int):
    """cfg with `flag` (and the flags that go with it) at their defaults, and the smallest multiple of
    its batch that the pieces of that configuration divide (dp replicas x micro-batches)."""
    default, changes = TrainConfig(), {}
    for each in (flag, *GOES_WITH.get(flag, ())):
        field = "overlap" if each == "--no-overlap" else "dtype" if each == "--dtype" else each[2:].replace("-", "_")
        changes[field] = "float64" if each == "--dtype" else getattr(default, field)
    base = dataclasses.replace(cfg, **changes)
    dp = max(1, world_size // (base.pp * base.tp * base.cp))
    pipelined = base.pp > 1 or base.schedule is not None
    pieces = dp * ((base.micro_batches or 2 * base.pp) if pipelined else base.grad_accum)
    return dataclasses.replace(base, batch_size=math.lcm(cfg.batch_size, pieces))


def _trace(cfg, task, comm, factory, x, y):
    """The trace of one fresh step of cfg: refimpl's trainer (factory None) or factory's; None when
    the trainer refuses cfg (a combination it cannot run: nothing to compare with)."""
    model = build_model(cfg, task)
    try:  # a refusal is the same on every rank (the same flags), before any message: no claim
        trainer = make_trainer(cfg, model, comm, distributed=True) if factory is None else factory(cfg, model, comm)
        trainer.record_grads = True
        return traced_step(trainer, comm, x, y)
    except ValueError:
        return None


def ignored_flags(cfg, task, comm, factory, flags) -> tuple[list[str], list[str]]:
    """(the declared `flags` that factory's trainer ignores, those this configuration does not
    exercise), each flag judged as the module docstring says (collective: every rank calls it)."""
    x, y = task.batch(0, cfg.batch_size)
    given = {None: _trace(cfg, task, comm, None, x, y), factory: _trace(cfg, task, comm, factory, x, y)}
    ignored, not_exercised = [], []
    for flag in flags:
        base = without(cfg, flag, comm.size)
        x, y = task.batch(0, base.batch_size)
        reference = _trace(base, task, comm, None, x, y)
        exercised = given[None] is not None and reference is not None and reference != given[None]
        if not comm.allreduce_value(float(exercised), "max"):
            not_exercised.append(flag)
            continue
        differs = given[factory] is None or _trace(base, task, comm, factory, x, y) != given[factory]
        if not comm.allreduce_value(float(differs), "max"):
            ignored.append(flag)
    return ignored, not_exercised


def value_of(cfg, flag: str) -> str:
    """How `flag` was given: '--zero 2', '--sequence-parallel', '--dtype mixed'."""
    if flag == "--no-overlap":
        return flag
    value = getattr(cfg, flag[2:].replace("-", "_"))
    return flag if value is True else f"{flag} {value}"
