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
    t = SYLLABUS["minutes"]("12", m)
    assert t["exercises"] == 5 * SYLLABUS["EXERCISE_MINUTES"] + SYLLABUS["QUESTION_MINUTES"]
    assert t["total"] == t["reading"] + t["run"] + t["exercises"]


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
