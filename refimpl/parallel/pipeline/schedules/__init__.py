"""The schedule generators, one file each, by command-line name.

Every generator is a pure function `(pp, micro_batches, chunks=None) -> Schedule` that checks its
constraints and raises ValueError with a one-line message saying what is wrong and how to fix it.

    gpipe        GPipe                       pp stages
    1f1b         1F1B (PipeDream-flush)      pp stages
    interleaved  interleaved 1F1B            chunks * pp stages, stage s on rank s mod pp
    zb1p         ZB-H1                       pp stages, backward split into I and W
    zbh2         ZB-H2                       pp stages, I and W, more warm-up forwards
    zbv          ZB-V                        2 pp stages in a V, I and W
    dualpipe     DualPipe                    pp stages, each on two ranks, two directions
    dualpipev    DualPipeV                   2 pp stages in a V, DualPipe's program

A schedule of your own is a generator with the same signature, written from the public API of
refimpl.parallel.pipeline: Action, Overlapped, Placement (or linear_placement, looped_placement,
v_placement, dual_placement), make_schedule, and check_counts / fixed_chunks for its constraints
(docs/capstone.md works one example through). The commands load it by name, MODULE:FUNCTION, and
check what it returns (refimpl/tools/plugin.py); the Trainer takes the Schedule it built.
"""

from __future__ import annotations

from ..actions import (
    Action,
    Overlapped,
    Placement,
    Schedule,
    dual_placement,
    linear_placement,
    looped_placement,
    make_schedule,
    v_placement,
)
from .common import check_counts, fixed_chunks
from .dualpipe import dualpipe
from .dualpipev import dualpipev
from .gpipe import gpipe
from .interleaved import interleaved
from .one_f_one_b import one_f_one_b
from .zb1p import zb1p
from .zbh2 import zbh2
from .zbv import zbv

SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb1p": zb1p,
    "zbh2": zbh2,
    "zbv": zbv,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
}


def build(name: str, pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    """The built-in schedule `name` for `pp` ranks and `micro_batches` micro-batches."""
    try:
        generator = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}, or MODULE:FUNCTION "
                         f"for a schedule of your own (the commands load it: refimpl/tools/plugin.py)") from None
    return generator(pp, micro_batches, chunks)


# the building blocks of a generator of your own, importable from here (docs/capstone.md)
__all__ = [
    "SCHEDULES", "build",
    "Action", "Overlapped", "Placement", "Schedule", "make_schedule",
    "linear_placement", "looped_placement", "v_placement", "dual_placement", "check_counts", "fixed_chunks",
]
