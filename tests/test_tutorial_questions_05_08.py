"""Tutorials 05-08's exercises that need derivation (ZeRO-3's padded bytes, the cheapest every:K
under a budget, interleaved 1F1B's bubble, ZB-H1's idle at any costs) and their written questions:
each check passes the reference solution and rejects subtly wrong answers with a message naming
the likely mistake; each tutorial asks a question and its solution file holds a model answer."""

from __future__ import annotations

import ast
import math
import sys
from fractions import Fraction
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tutorials"))  # the exercise harness, as the tutorials import it
from harness import run_check  # noqa: E402
from harness.checkpointing import check_cheapest_every_k  # noqa: E402
from harness.schedules import check_interleaved_bubble, check_zb1p_idle_any  # noqa: E402
from harness.zero import check_zero3_bytes  # noqa: E402
from tutorial_util import SOLUTIONS, solution  # noqa: E402

TUTORIALS = ["05_zero", "06_checkpointing", "07_pipeline_schedules", "08_zero_bubble"]


# -- wrong answers -----------------------------------------------------------------------------------

def _every_k_peak(n, k, minus_one=True):
    return -(-n // k) - (1 if minus_one else 0) + k


def _smallest_k_that_fits(n, budget):  # the most recomputation of all that fit
    for k in range(1, n + 1):
        if _every_k_peak(n, k) <= budget:
            return k, n - k, _every_k_peak(n, k)
    return None


def _upwards_until_it_no_longer_fits(n, budget):  # assumes the peak grows with K
    best = None
    for k in range(1, n + 1):
        if _every_k_peak(n, k) > budget:
            break
        best = (k, n - k, _every_k_peak(n, k))
    return best


def _peak_without_minus_one(n, budget):  # n/K segments counted as snapshots, the recorded one too
    for k in range(n, 0, -1):
        if _every_k_peak(n, k, minus_one=False) <= budget:
            return k, n - k, _every_k_peak(n, k, minus_one=False)
    return None


def _sqrt_k_always(n, budget):
    k = math.isqrt(n - 1) + 1 if n > 1 else 1
    return (k, n - k, _every_k_peak(n, k)) if _every_k_peak(n, k) <= budget else None


WRONG = [
    # 05: ZeRO-3's bytes per rank with padding
    (check_zero3_bytes, lambda sizes, n, p, g, k: (p + g + k) * sum(sizes) / n, "That is the formula at Ψ"),
    (check_zero3_bytes, lambda sizes, n, p, g, k: (p + g + k) * -(-sum(sizes) // n),
     "pads the model as one buffer"),
    (check_zero3_bytes, lambda sizes, n, p, g, k: (p + g + k) * sum(s // n for s in sizes), "rounds"),
    # 06: the cheapest every:K under a budget
    (check_cheapest_every_k, _smallest_k_that_fits, "the largest K that fits recomputes least"),
    (check_cheapest_every_k, _upwards_until_it_no_longer_fits, "not monotone in K"),
    (check_cheapest_every_k, _sqrt_k_always, "also fits"),
    (check_cheapest_every_k, _peak_without_minus_one, ""),
    # 07: interleaved 1F1B's bubble fraction
    (check_interleaved_bubble, lambda pp, m, v: Fraction(pp - 1, m + pp - 1), "1F1B's, as if the chunks"),
    (check_interleaved_bubble, lambda pp, m, v: Fraction(pp - 1, v * (m + pp - 1)), "makespan"),
    (check_interleaved_bubble, lambda pp, m, v: Fraction(pp - 1, v * m), "idle ÷ (work + idle)"),
    # 08: ZB-H1's idle at any costs
    (check_zb1p_idle_any, lambda pp, F, I, W: (pp - 1) * (F + I - W), "holds only while W ≤ F and W ≤ I"),
    (check_zb1p_idle_any, lambda pp, F, I, W: (pp - 1) * max(F + I - W, 0), "holds only while W ≤ F"),
    (check_zb1p_idle_any, lambda pp, F, I, W: (pp - 1) * (F + I - min(I, W)), "bounded by F as well"),
]


@pytest.mark.parametrize("check, wrong, says", WRONG, ids=[f"{w[0].__name__}-{i}" for i, w in enumerate(WRONG)])
def test_checks_reject_subtly_wrong_answers(check, wrong, says):
    result = run_check(check, wrong)
    assert result.status == "wrong" and says in result.message, result


def test_the_peak_without_minus_one_is_caught_by_a_named_rule():
    result = run_check(check_cheapest_every_k, _peak_without_minus_one)
    assert result.status == "wrong" and "every:" in result.message, result


@pytest.mark.parametrize("check, tutorial, name", [
    (check_zero3_bytes, "05_zero", "zero3_bytes"),
    (check_cheapest_every_k, "06_checkpointing", "cheapest_every_k"),
    (check_interleaved_bubble, "07_pipeline_schedules", "interleaved_bubble"),
    (check_zb1p_idle_any, "08_zero_bubble", "zb1p_idle_any"),
])
def test_the_reference_solution_passes(check, tutorial, name):
    result = run_check(check, solution(tutorial, name))
    assert result.status == "correct", result


@pytest.mark.parametrize("tutorial", TUTORIALS)
def test_each_tutorial_asks_a_question_before_its_exercises_and_the_solution_answers_it(tutorial):
    text = (REPO / "tutorials" / f"{tutorial}.py").read_text()
    question = text.index("# **Question (measure and explain).**")
    assert question < text.index("# ## Exercises"), "the question comes just before the exercises"
    tree = ast.parse((SOLUTIONS / f"{tutorial}.py").read_text())
    answers = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and any(getattr(t, "id", None) == "ANSWER" for t in node.targets)]
    assert len(answers) == 1 and answers[0].strip().startswith("Model answer")
    assert 8 <= len(answers[0].strip().splitlines()) <= 21  # the header line and 8-20 lines of answer
