"""GPipe: all forwards, then all backwards (Huang et al., "GPipe", arXiv 1811.06965).

Rank r holds stage r of a pp-stage model. It runs F(r, 0), ..., F(r, m-1), then B(r, 0), ...,
B(r, m-1). The micro-batches fill the pipeline like a wave and then drain it backwards.

Formulas (F, B = time of one stage's forward / full backward, m micro-batches, p = pp):

    makespan         (m + p - 1)(F + B)
    idle per rank    (p - 1)(F + B)           exact for any F, B with zero latency
    bubble fraction  (p - 1) / (m + p - 1)
    activations      m micro-batches per rank (every forward's activations wait for the backward)

Production systems rarely use GPipe for training large models because of that activation
memory; it survives as the simplest correct schedule and as a baseline.
"""

from __future__ import annotations

from ..actions import Action, Schedule, linear_placement, make_schedule
from .common import check_counts, fixed_chunks


def gpipe(pp: int, micro_batches: int, chunks: int | None = None) -> Schedule:
    check_counts("gpipe", pp, micro_batches)
    fixed_chunks("gpipe", chunks, 1)
    ranks = []
    for r in range(pp):
        forwards = [Action("F", r, m) for m in range(micro_batches)]
        backwards = [Action("B", r, m) for m in range(micro_batches)]
        ranks.append(forwards + backwards)
    return make_schedule("gpipe", pp, micro_batches, linear_placement(pp), ranks)
