"""The training objective, shared by single-process and distributed training.

For a global batch whose counted targets number N (targets equal to IGNORE are not counted):

    L = (1/N) Σ_(counted targets) −log p(target)

A micro-batch, on any rank, contributes  Σ_(its counted targets) −log p(target) / N.  Because N is
the whole batch's count, the gradients of all micro-batches on all ranks simply add up to ∇L:
data parallelism sums (never averages) gradients across ranks, and gradient accumulation sums
across micro-batches, whatever the split.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np

from refimpl import backend
from refimpl.autograd import Tensor
from refimpl.data import IGNORE
from refimpl.nn import functional as F
from refimpl.nn.batch_rows import batch_rows


def count_targets(y) -> int:
    """Number of counted targets (not IGNORE) in a batch of targets."""
    return int((np.asarray(y) != IGNORE).sum())


def to_input(model, x):
    """Token ids stay integer arrays; features become a Tensor of the model's dtype."""
    if x.dtype.kind in "iu":
        return backend.asarray(x)
    return Tensor(backend.asarray(x, dtype=model.parameters()[0].dtype))


def micro_batch_loss(model, x, y, total_count: int, rows: tuple | None = None, loss_scale: float = 1.0) -> Tensor:
    """Σ cross-entropy over this micro-batch's counted targets, divided by the global batch's count.

    rows = (start, global_size, batch_id) says which rows of which global batch x holds, so that
    dropout masks do not depend on the split (refimpl/nn/batch_rows.py); loss_scale: what the
    caller multiplies the loss by before backward (mixed precision), for losses added inside the model.
    """
    context = nullcontext() if rows is None else batch_rows(rows[0], rows[0] + len(x), rows[1], rows[2], loss_scale)
    with context:
        logits = model(to_input(model, x))
    return F.cross_entropy(logits, backend.asarray(y), reduction="sum") * (1.0 / max(1, total_count))


def split_batch(x, y, parts: int, what: str):
    """Split a batch into `parts` equal pieces along the first axis, or raise a clear error."""
    if len(x) % parts:
        raise ValueError(f"a batch of {len(x)} cannot be split into {parts} equal {what}; "
                         f"choose a --batch-size divisible by {parts}")
    n = len(x) // parts
    return [(x[i * n:(i + 1) * n], y[i * n:(i + 1) * n]) for i in range(parts)]
