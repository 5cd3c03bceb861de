"""Terminal output shared by every command.

Progress and logs go to stderr; `--json` prints exactly one JSON object, on one line, last, on
stdout. A progress bar is drawn only when stderr is a terminal; otherwise plain lines are printed.
"""

from __future__ import annotations

import json
import math
import sys
import time


def log(message: str) -> None:
    """One line of progress or diagnostics, on stderr."""
    print(message, file=sys.stderr, flush=True)


def _plain(value):
    """Convert NumPy scalars and arrays (and non-finite floats) into plain JSON values."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


def emit_json(obj: dict) -> None:
    """Print `obj` as one JSON line on stdout (booleans stay JSON booleans)."""
    sys.stdout.write(json.dumps(_plain(obj), separators=(",", ":")) + "\n")
    sys.stdout.flush()


class Progress:
    """A progress bar on a terminal, plain lines every `every` steps elsewhere."""

    def __init__(self, total: int, label: str = "", every: int | None = None, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.tty = sys.stderr.isatty()
        self.every = every or max(1, total // 10)
        self.start = time.perf_counter()

    def update(self, step: int, **fields) -> None:
        if not self.enabled:
            return
        text = " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        if self.tty:
            width = 30
            filled = int(width * step / max(1, self.total))
            bar = "#" * filled + "-" * (width - filled)
            elapsed = time.perf_counter() - self.start
            sys.stderr.write(f"\r{self.label} [{bar}] {step}/{self.total} {text} {elapsed:.1f}s ")
            sys.stderr.flush()
            if step >= self.total:
                sys.stderr.write("\n")
        elif step % self.every == 0 or step == self.total or step == 1:
            log(f"{self.label} step {step}/{self.total} {text}")
