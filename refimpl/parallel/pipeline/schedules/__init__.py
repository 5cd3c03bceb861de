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
"""

from __future__ import annotations

from ..actions import Schedule
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
    """The schedule `name` for `pp` ranks and `micro_batches` micro-batches."""
    try:
        generator = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None
    return generator(pp, micro_batches, chunks)
