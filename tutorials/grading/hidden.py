"""The hidden checks: drawn cases that only the instructor's run has (left out of the student copy).

A public check's fixed cases can be answered by a table; these draw new inputs each run (NumPy's
default generator, seeded from the operating system) and compare the student's answer with the
reference solution's, run here in the grader's process. One entry per exercise whose inputs are
plain numbers: a function of a random generator that returns the arguments of one call.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
from harness import Wrong, plain

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"


def _int(rng, low, high):
    return int(rng.integers(low, high + 1))


DRAWS = {
    "02.2": lambda rng: (_int(rng, 2, 300), _int(rng, 1, 64), _int(rng, 1, 6), 4 * _int(rng, 1, 40)),
    "03.3": lambda rng: (lambda n: (_int(rng, 0, 200), n, _int(rng, 0, n - 1), 4))(_int(rng, 2, 9)),
    "03.4": lambda rng: (_int(rng, 1, 200), _int(rng, 2, 9), 4),
    "05.1": lambda rng: (_int(rng, 0, 3), _int(rng, 1, 10**9), _int(rng, 1, 512), 2, 2, 12),
    "05.2": lambda rng: (lambda n: (_int(rng, 1, 500), n, _int(rng, 0, n - 1)))(_int(rng, 1, 9)),
    "06.1": lambda rng: (_int(rng, 2, 60),),
    "06.2": lambda rng: (_int(rng, 2, 40), _int(rng, 1, 6)),
    "07.3": lambda rng: (_int(rng, 2, 9), _int(rng, 1, 24)),
    "09.2": lambda rng: (lambda s: (_int(rng, s, 40), s))(_int(rng, 1, 8)),
    "04.3": lambda rng: ([_int(rng, 1, 100) for _ in range(_int(rng, 1, 20))], _int(rng, 1, 200)),
    "06.4": lambda rng: (lambda n: (n, _int(rng, 1, n + 1)))(_int(rng, 1, 40)),
    "08.1": lambda rng: (lambda w: (_int(rng, 2, 8), w + _int(rng, 0, 3), w + _int(rng, 0, 3), w))(_int(rng, 1, 3)),
    "08.4": lambda rng: (_int(rng, 2, 8), _int(rng, 1, 5), _int(rng, 1, 5), _int(rng, 1, 5)),
    "09.1": lambda rng: (lambda dp, pp, tp: (_int(rng, 0, dp * pp * tp - 1), dp, pp, tp))(
        _int(rng, 1, 4), _int(rng, 1, 4), _int(rng, 1, 4)),
    "10.4": lambda rng: (lambda t: (_int(rng, 1, 6), t * _int(rng, 1, 6), t * _int(rng, 1, 6), t,
                                    int(rng.choice([2, 4, 8])), bool(rng.integers(2)), bool(rng.integers(2))))(
        _int(rng, 1, 8)),
    "14.2": lambda rng: (lambda C: (C, _int(rng, 0, C - 1), str(rng.choice(["balanced", "contiguous"]))))(
        _int(rng, 1, 16)),
    "14.3": lambda rng: (lambda C: (C, _int(rng, 0, C - 1), _int(rng, 1, 64),
                                    str(rng.choice(["balanced", "contiguous"]))))(_int(rng, 1, 16)),
    "14.4": lambda rng: (lambda C: (C, _int(rng, 1, 4), _int(rng, 1, 16), 2 * C * _int(rng, 1, 64), _int(rng, 1, 128),
                                    int(rng.choice([2, 4, 8]))))(_int(rng, 1, 16)),
    "14.5": lambda rng: (lambda C: (C, _int(rng, 0, C - 1), _int(rng, 1, 4), _int(rng, 1, 16), 2 * C * _int(rng, 1, 64),
                                    _int(rng, 1, 128), int(rng.choice([2, 4, 8]))))(_int(rng, 1, 16)),
    "15.3": lambda rng: (lambda kv: (_int(rng, 1, 64), _int(rng, 1, 131072), kv * _int(rng, 1, 16), kv,
                                     2 * _int(rng, 1, 128), int(rng.choice([2, 4, 8]))))(_int(rng, 1, 16)),
    "15.4": lambda rng: (lambda kv, group, half: (2 * half * kv * group, kv * group, kv, _int(rng, 1, 60000)))(
        _int(rng, 1, 16), _int(rng, 1, 16), _int(rng, 1, 128)),
}


def check_for(exercise, cases: int, seed: int | None = None):
    """A check that runs `cases` drawn inputs through the student's function and the solution's."""
    draw = DRAWS.get(exercise.key)
    path = SOLUTIONS / f"{exercise.tutorial}.py"
    if draw is None or not path.is_file():
        return None
    reference = runpy.run_path(str(path), run_name="hidden_reference")[exercise.function]

    def check_drawn(student) -> None:
        """Check: drawn cases."""
        rng = np.random.default_rng(seed)
        for _ in range(cases):
            args = draw(rng)
            expected, got = reference(*args), student(*args)
            if not _equal(got, expected):
                raise Wrong(f"{exercise.function}{tuple(plain(a) for a in args)} should be {plain(expected)!r}; "
                            f"you said {plain(got)!r}")

    return check_drawn


def _equal(got, expected) -> bool:
    try:
        if isinstance(expected, (list, tuple)):
            return isinstance(got, (list, tuple)) and len(got) == len(expected) and all(
                _equal(a, b) for a, b in zip(got, expected))
        if isinstance(expected, (int, float, np.number)) and not isinstance(expected, bool):
            return isinstance(got, (int, float, np.number)) and abs(float(got) - float(expected)) <= 1e-9 * max(
                1.0, abs(float(expected)))
        return bool(got == expected)
    except Exception:  # noqa: BLE001 - an answer that cannot be compared is wrong
        return False
