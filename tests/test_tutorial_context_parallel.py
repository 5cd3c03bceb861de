"""Tutorial 14 (context parallelism): each check passes the reference solution and rejects the
usual wrong answers with a message that names the mistake; the solutions equal accounting.py far
beyond the public cases (the hidden drawn cases compare students with the solutions); and the
grader scores an edited copy exercise by exercise, failing answers that call refimpl's own function.

tests/test_tutorials.py runs the tutorial with the solutions and every check on its stub;
tests/test_grade.py grades every solution file; tests/test_grading_hidden.py draws 14.2 to 14.5's
hidden cases."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tutorials"))  # the exercise harness, as the tutorials import it
from harness import context_parallel as checks  # noqa: E402
from harness import run_check  # noqa: E402
from tutorial_util import solution  # noqa: E402

from refimpl.parallel.context_parallel import accounting, blockwise  # noqa: E402

TUTORIAL = "14_context_parallel"
CHECKS = {"merge": checks.check_merge, "rank_chunks": checks.check_rank_chunks,
          "causal_work": checks.check_causal_work, "ring_bytes": checks.check_ring_bytes,
          "ring_bytes_skipped": checks.check_ring_bytes_skipped}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_solution_passes_its_check(name):
    result = run_check(CHECKS[name], solution(TUTORIAL, name))
    assert result.ok, result


# -- wrong answers to the merge ------------------------------------------------------------------------

def _unguarded(a, b):
    """The textbook merge without the guard for rows empty in both blocks: NaN there."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = np.maximum(m1, m2)
    with np.errstate(invalid="ignore"):
        w1, w2 = np.exp(m1 - m), np.exp(m2 - m)
    return m, l1 * w1 + l2 * w2, o1 * w1[:, None] + o2 * w2[:, None]


def _guarded_except_both_empty(a, b):
    """Right everywhere but where both blocks are empty: there (0, 0, 0) instead of (−∞, 0, 0)."""
    m, l, o = solution(TUTORIAL, "merge")(a, b)
    return np.where(np.isfinite(m), m, 0.0), l, o


def _exponentials_not_shifted(a, b):
    """Rescaled by e^(mᵢ) itself rather than e^(mᵢ − m): overflows for scores near 1000."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = np.maximum(m1, m2)
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        w1, w2, top = np.exp(m1), np.exp(m2), np.exp(safe)
        return m, (l1 * w1 + l2 * w2) / top, (o1 * w1[:, None] + o2 * w2[:, None]) / top[:, None]


def _l_not_rescaled(a, b):
    m, _, o = solution(TUTORIAL, "merge")(a, b)
    return m, a[1] + b[1], o


def _first_maximum_kept(a, b):
    """m is the first block's maximum: o / l is still right, but the state is not the merge's."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    shift = np.where(np.isfinite(m1), m1, 0.0)
    with np.errstate(over="ignore"):
        w2 = np.exp(np.where(np.isfinite(m2), m2 - shift, -np.inf))
    return m1, l1 + l2 * w2, o1 + o2 * w2[:, None]


def _in_place(a, b):
    m, l, o = solution(TUTORIAL, "merge")(a, b)
    a[1][...] = l
    return m, l, o


def _averaged(a, b):
    """The two blocks' outputs averaged: what merging normalised outputs y₁, y₂ naively gives."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    return np.maximum(m1, m2), (l1 + l2) / 2, (o1 + o2) / 2


WRONG_MERGES = [
    (_unguarded, "e^(−∞ + ∞) = NaN"),
    (_guarded_except_both_empty, "the merged maximum is the larger of the two"),
    (_l_not_rescaled, "rescale both by e^(mᵢ − m)"),
    (_first_maximum_kept, "the merged maximum is the larger of the two"),
    (_in_place, "changed its argument l₁ in place"),
    (_averaged, "rescale both by e^(mᵢ − m)"),
    (lambda a, b: (a[0], a[1]), "return the triple (m, l, o)"),
    (lambda a, b: (a[0], a[1], a[2].T), "o has shape"),
]


@pytest.mark.parametrize("wrong, says", WRONG_MERGES, ids=[w[1][:30] for w in WRONG_MERGES])
def test_the_merge_check_rejects_wrong_merges_with_the_reason(wrong, says):
    result = run_check(checks.check_merge, wrong)
    assert result.status in ("wrong", "error") and says in result.message, result


def test_an_overflowing_merge_is_a_failure_not_a_pass():
    # Guarded against the empty rows, but rescaled by e^(mᵢ): scores near 1000 overflow to inf and NaN.
    def overflowing(a, b):
        (m1, l1, o1), (m2, l2, o2) = a, b
        m = np.maximum(m1, m2)
        with np.errstate(over="ignore", invalid="ignore"):
            w1, w2 = np.exp(m1) * np.exp(-np.where(np.isfinite(m), m, 0.0)), np.exp(m2) * np.exp(
                -np.where(np.isfinite(m), m, 0.0))
        return m, l1 * w1 + l2 * w2, o1 * w1[:, None] + o2 * w2[:, None]

    result = run_check(checks.check_merge, overflowing)
    assert result.status == "wrong" and "near 1000" in result.message and "never e^(mᵢ) itself" in result.message


def test_refimpls_merge_passes_the_check_it_is_compared_with():
    assert run_check(checks.check_merge, blockwise.merge).ok  # (refimpl's takes the same triples)


def test_the_merge_check_draws_new_rows_every_run():
    seen = set()

    def recording(a, b):
        seen.add(float(np.nansum(np.where(np.isfinite(a[0]), a[0], 0.0))))
        return solution(TUTORIAL, "merge")(a, b)

    for _ in range(2):
        assert run_check(checks.check_merge, recording).ok
    assert len(seen) > 2  # different rows in the two runs, and within each


# -- wrong answers to the counts ------------------------------------------------------------------------

def _k(C, b, kv_heads, T, d_head, itemsize):
    return 2 * b * kv_heads * (T // (2 * C)) * d_head * itemsize


WRONG_COUNTS = [
    (checks.check_rank_chunks, lambda C, r, lay: (r, 2 * C - r), "numbered 0 … 2C − 1"),
    (checks.check_rank_chunks, lambda C, r, lay: (2 * C - 1 - r, r) if lay == "balanced" else (2 * r, 2 * r + 1),
     "the early chunk first"),
    (checks.check_rank_chunks, lambda C, r, lay: (2 * r, 2 * r + 1), "that is the contiguous layout"),
    (checks.check_causal_work, lambda C, r, c, lay: 4 * C * c * c, "without the causal skip"),
    (checks.check_causal_work, lambda C, r, c, lay: 2 * C * c * c + c if lay == "balanced" else
     (4 * r + 2) * c * c + c, "the scores the mask keeps"),
    (checks.check_causal_work, lambda C, r, c, lay: (2 * C + 1) * c * c, "the other layout's count"),
    (checks.check_ring_bytes, lambda C, *a: ((C - 1) * _k(C, *a), 2 * (C - 1) * _k(C, *a)), "two chunks"),
    (checks.check_ring_bytes, lambda C, *a: (2 * C * _k(C, *a), 4 * C * _k(C, *a)), "C − 1 hops"),
    (checks.check_ring_bytes, lambda C, *a: (2 * (C - 1) * _k(C, *a),) * 2, "twice the forward's bytes"),
    (checks.check_ring_bytes, lambda C, *a: (2 * (C - 1) * _k(C, *a) // a[-1], 4 * (C - 1) * _k(C, *a) // a[-1]),
     "multiply by the itemsize"),
    (checks.check_ring_bytes, lambda C, *a: 2 * (C - 1) * _k(C, *a), "return the pair"),
    (checks.check_ring_bytes_skipped, lambda C, r, *a: solution(TUTORIAL, "ring_bytes")(C, *a),
     "without the causal skip"),
    (checks.check_ring_bytes_skipped,
     lambda C, r, *a: (lambda f: (f, 2 * f))(solution(TUTORIAL, "ring_bytes_skipped")(C, r, *a)[0]),
     "the dK/dV chunks do not follow"),
    (checks.check_ring_bytes_skipped,  # every K/V chunk travels; the gradients right
     lambda C, r, *a: (lambda right: (2 * (C - 1) * _k(C, *a), right[1]))(
         solution(TUTORIAL, "ring_bytes_skipped")(C, r, *a)), "a K/V chunk is passed on only while"),
    (checks.check_ring_bytes_skipped,  # every gradient chunk travels from its first hop
     lambda C, r, *a: (lambda right: (right[0], right[0] + 2 * (C - 1) * _k(C, *a)))(
         solution(TUTORIAL, "ring_bytes_skipped")(C, r, *a)), "the dK/dV chunks do not follow"),
    (checks.check_ring_bytes_skipped,  # one gradient chunk too many
     lambda C, r, *a: (lambda right: (right[0], right[1] + _k(C, *a)))(
         solution(TUTORIAL, "ring_bytes_skipped")(C, r, *a)), "backward is"),
]


@pytest.mark.parametrize("check, wrong, says", WRONG_COUNTS, ids=[w[2][:30] for w in WRONG_COUNTS])
def test_the_count_checks_reject_wrong_answers_with_the_reason(check, wrong, says):
    result = run_check(check, wrong)
    assert result.status == "wrong" and says in result.message, result


def test_the_solutions_equal_accounting_far_beyond_the_public_cases():
    """The hidden cases (tutorials/grading/hidden.py) compare a student with the solutions, for C up to 16."""
    chunks, work = solution(TUTORIAL, "rank_chunks"), solution(TUTORIAL, "causal_work")
    plain, skipped = solution(TUTORIAL, "ring_bytes"), solution(TUTORIAL, "ring_bytes_skipped")
    for C in range(1, 17):
        for c in (1, 3, 64):
            for b, kv_heads, d_head, item in ((1, 1, 1, 8), (3, 8, 128, 2)):
                shape = accounting.AttentionShape(b, kv_heads, kv_heads, 2 * C * c, d_head, C, item)
                for r in range(C):
                    for lay in ("balanced", "contiguous"):
                        assert work(C, r, c, lay) * b * kv_heads == accounting.score_elements(
                            shape, r, "ring", lay)["computed"]
                        assert chunks(C, r, lay) == (r, 2 * C - 1 - r) if lay == "balanced" else (2 * r, 2 * r + 1)
                    want = accounting.ring_bytes(shape, r, "balanced", causal_skip=True)
                    assert skipped(C, r, b, kv_heads, 2 * C * c, d_head, item) == (want["forward"], want["backward"])
                    want = accounting.ring_bytes(shape, r, causal_skip=False)
                    assert plain(C, b, kv_heads, 2 * C * c, d_head, item) == (want["forward"], want["backward"])


# -- the grader, on an edited copy of the tutorial -------------------------------------------------------

def _grade_module():
    path = REPO / "tutorials" / "grade.py"
    spec = importlib.util.spec_from_file_location("tutorials_grade", path)
    module = sys.modules["tutorials_grade"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def _filled(source: str, function: str, body: str) -> str:
    start = source.index(f"@ex.stub\ndef {function}(")
    end = source.index("\n\n\n", start)
    return source[:start] + "@ex.stub\n" + body.strip() + source[end:]


def test_the_grader_scores_an_edited_copy_exercise_by_exercise(tmp_path):
    source = (REPO / "tutorials" / f"{TUTORIAL}.py").read_text()
    source = _filled(source, "merge", '''
def merge(a, b):
    from refimpl.parallel.context_parallel import blockwise
    return blockwise.merge(a, b)
''')
    source = _filled(source, "rank_chunks", '''
def rank_chunks(C, r, layout):
    return (r, 2 * C - 1 - r) if layout == "balanced" else (2 * r, 2 * r + 1)
''')
    source = _filled(source, "causal_work", '''
def causal_work(C, r, c, layout):
    return 4 * C * c * c
''')
    source = _filled(source, "ring_bytes", '''
def ring_bytes(C, b, kv_heads, T, d_head, itemsize):
    from refimpl.parallel.context_parallel import accounting
    shape = accounting.AttentionShape(b, kv_heads, kv_heads, T, d_head, C, itemsize)
    found = accounting.ring_bytes(shape, 0, causal_skip=False)
    return found["forward"], found["backward"]
''')
    path = tmp_path / f"{TUTORIAL}.py"
    path.write_text('raise SystemExit("the tutorial itself must not run")\n' + source)
    grade = _grade_module()
    report = grade.summary(grade.grade_files([path], timeout=30))
    results = {r["exercise"]: r for r in report["results"] if r["tutorial"] == TUTORIAL}
    assert [results[n]["result"] for n in range(1, 6)] == ["fail", "pass", "fail", "fail", "not done"], results
    assert results[1]["reason"] == "forbidden" and results[4]["reason"] == "forbidden", results
    assert results[3]["reason"] == "wrong" and "without the causal skip" in results[3]["message"]
    assert (results[1]["max_points"], results[5]["max_points"]) == (2, 2)
