"""Shared checks for the schedule generators: each raises ValueError with a one-line fix."""

from __future__ import annotations


def check_counts(name: str, pp: int, micro_batches: int) -> None:
    """pp ranks and micro-batches are positive integers."""
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"{name}: --pp must be a positive integer (number of pipeline ranks); got {pp!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"{name}: --micro-batches must be a positive integer; got {micro_batches!r}")


def fixed_chunks(name: str, chunks: int | None, own: int) -> None:
    """Schedules with a fixed number of stages per rank accept only that --chunks (or none)."""
    if chunks is not None and chunks != own:
        raise ValueError(
            f"{name} holds {own} stage(s) per rank; drop --chunks {chunks} (only 'interleaved' takes --chunks V)"
        )
