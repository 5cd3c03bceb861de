"""Which rows of the global batch a forward pass is processing.

Dropout draws random masks. If each process (or each micro-batch) drew its own masks from a
sequential generator, the masks would depend on how the batch is split — across data-parallel
ranks, micro-batches and pipeline stages — and a distributed run could never equal the
single-process one. So trainers say which rows of which global batch they are running:

    with batch_rows(start, stop, global_size, batch_id):
        loss = model(x[start:stop]) ...

and a Dropout module draws its mask for the whole global batch from a generator seeded by
(its seed, batch_id), then uses rows start:stop. The mask of an example is then a function of
(seed, batch, row) alone, whatever the split, the order of micro-batches, or a checkpoint's
recomputation. Outside any batch_rows context, Dropout draws from its own sequential generator.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rows:
    start: int  # first row of the global batch in this forward
    stop: int  # one past the last row
    global_size: int  # rows in the global batch
    batch_id: int  # which global batch (the optimizer step): same number in every process
    loss_scale: float = 1.0  # what this forward's loss will be multiplied by before backward (mixed
    #                          precision's S): a loss added inside the model seeds its backward with it


_current: Rows | None = None


def current() -> Rows | None:
    return _current


def set_current(rows: Rows | None) -> None:
    """Make `rows` the current ones (what `restored` does on entry; the F&B Interleaver restores a
    task's own rows when it resumes: parallel/pipeline/overlap.py)."""
    global _current
    _current = rows


class restored:
    """Context manager: run with `rows` (a Rows captured earlier by current(), or None) as the context.

    Activation checkpointing recomputes a forward during backward, outside the trainer's context;
    it captures current() at the forward and restores it around the recomputation.
    """

    def __init__(self, rows: Rows | None) -> None:
        self.rows = rows

    def __enter__(self) -> Rows | None:
        global _current
        self._previous, _current = _current, self.rows
        return self.rows

    def __exit__(self, *exc) -> bool:
        global _current
        _current = self._previous
        return False


class batch_rows(restored):
    """Context manager: forwards inside it process rows start:stop of global batch batch_id."""

    def __init__(self, start: int, stop: int, global_size: int, batch_id: int, loss_scale: float = 1.0) -> None:
        if not 0 <= start <= stop <= global_size:
            raise ValueError(f"batch_rows: rows {start}:{stop} are not inside a batch of {global_size}")
        super().__init__(Rows(start, stop, global_size, batch_id, loss_scale))
