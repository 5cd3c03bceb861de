"""The instructor's hidden checks (tutorials/grading/hidden.py): drawn cases that a table of the
public cases' answers cannot pass, and that every reference solution passes, whatever is drawn."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tutorials") not in sys.path:
    sys.path.insert(0, str(REPO / "tutorials"))

from grading import hidden  # noqa: E402
from grading.course import load_exercises  # noqa: E402
from harness import run_check  # noqa: E402

EXERCISES = {e.key: e for e in load_exercises() if e.key in hidden.DRAWS}


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_every_solution_passes_its_drawn_cases(key):
    exercise = EXERCISES[key]
    reference = runpy.run_path(str(REPO / "tutorials" / "solutions" / f"{exercise.tutorial}.py"))[exercise.function]
    result = run_check(hidden.check_for(exercise, 60), reference)  # new draws every run
    assert result.ok, result


def test_a_table_of_the_public_answers_fails_the_drawn_cases():
    exercise = EXERCISES["05.1"]
    solution = runpy.run_path(str(REPO / "tutorials" / "solutions" / "05_zero.py"))["model_state_bytes"]
    public = {(stage, psi, n, p, g, k): solution(stage, psi, n, p, g, k)
              for p, g, k in [(2, 2, 12), (4, 4, 8)] for stage in range(4)
              for psi, n in [(7_500_000_000, 64), (1024, 4), (96, 1), (120, 8)]}
    table = lambda *args: public.get(args, 0)  # noqa: E731 - passes every public case, computes nothing
    assert run_check(exercise.check, table).ok
    result = run_check(hidden.check_for(exercise, 6, seed=1), table)
    assert result.status == "wrong" and "model_state_bytes(" in result.message
