"""The syllabus (docs/course.md, tutorials/syllabus.py) covers every tutorial, by one rule."""

from __future__ import annotations

import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYLLABUS = runpy.run_path(str(REPO / "tutorials" / "syllabus.py"))


def test_every_tutorial_has_a_syllabus_entry_and_a_row():
    names = [p.stem for p in SYLLABUS["tutorials"]()]
    assert len(names) >= 12
    table = SYLLABUS["table"]()
    for name in names:
        assert name[:2] in SYLLABUS["SYLLABUS"], f"add {name} to SYLLABUS in tutorials/syllabus.py"
        assert f"[{name}](tutorials/{name}.md)" in table


def test_study_time_follows_the_stated_rule():
    path = REPO / "tutorials" / "12_planning_a_run.py"
    m = SYLLABUS["measure"](path)
    assert m["exercises"] == 5 and m["questions"] == 1 and m["words"] > 1000
    t = SYLLABUS["minutes"]("12", m, path)
    assert t["exercises"] == sum(t["each"]) + SYLLABUS["QUESTION_MINUTES"]
    assert t["total"] == t["reading"] + t["run"] + t["exercises"]


def test_a_one_liner_and_a_modelling_task_get_different_study_times():
    sizes = SYLLABUS["solution_statements"]("12_planning_a_run")
    assert sizes["mfu"] < sizes["compute_seconds"]  # one line of arithmetic against modelling a step
    functions = SYLLABUS["exercise_functions"](REPO / "tutorials" / "12_planning_a_run.py")
    each = dict(zip(functions, SYLLABUS["exercise_minutes"]("12_planning_a_run", functions)))
    assert each["mfu"] == 5 * -(-(SYLLABUS["EXERCISE_BASE_MINUTES"] + 2 * sizes["mfu"]) // 5) < each["compute_seconds"]
    # a closed form to derive (course.toml: derivation = true) counts more than its short code
    zb = SYLLABUS["exercise_minutes"]("08_zero_bubble", ["zb1p_idle"])[0]
    assert zb == 5 * -(-(SYLLABUS["EXERCISE_BASE_MINUTES"] + 2 * 1 + SYLLABUS["DERIVATION_MINUTES"]) // 5)


def test_the_counts_are_computed_not_typed():
    text = SYLLABUS["counts"]()
    n = len(SYLLABUS["tutorials"]())
    exercises = sum(len(SYLLABUS["exercise_functions"](p)) for p in SYLLABUS["tutorials"]())
    assert text.startswith(f"{n} tutorials, {exercises} exercises (")
    for page in ("docs/course.md", "tutorials/README.md"):
        body = (REPO / page).read_text()
        stale = f"{exercises - 2}/{exercises - 2}"  # a typed "N/N exercises" left from an older count
        assert stale not in body and " 38 " not in body and "38/38" not in body, page


def test_the_model_answers_come_from_the_solutions():
    answers = SYLLABUS["answers"]()
    assert "### 12_planning_a_run" in answers and "MFU" in answers


def test_every_tutorial_has_a_written_question_a_model_answer_and_an_exercise_beyond_the_first_three():
    """Issue 19, part 3: in every tutorial a written "measure and explain" question whose model
    answer is in its solution (docs/course.md gathers them), and a fourth exercise: the one that
    asks the student to derive what the text does not print (tests/test_tutorial_questions_*.py
    check that each rejects its subtly wrong answers)."""
    answers = SYLLABUS["answers"]()
    for path in SYLLABUS["tutorials"]():
        m = SYLLABUS["measure"](path)
        assert m["questions"] >= 1, f"{path.name}: no **Question (measure and explain).**"
        assert m["exercises"] >= 4, f"{path.name}: {m['exercises']} exercises"
        assert f"### {path.stem}\n" in answers, f"{path.stem}: no ANSWER in tutorials/solutions/{path.name}"
