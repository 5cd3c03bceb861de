"""A folder of five students (tests/course_fixture.py) graded into a gradebook: points from
course.toml, each failure with its reason, flags for the instructor, the written answers gathered
into a marking sheet beside their rubrics and model answers, and manual marks added back."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from course_fixture import make_five_students

REPO = Path(__file__).resolve().parents[1]
GRADER = REPO / "tutorials" / "grade.py"
COURSE = tomllib.loads((REPO / "tutorials" / "course.toml").read_text())


def test_five_students_give_a_gradebook_a_marking_sheet_and_reasons(tmp_path):
    folder = make_five_students(tmp_path / "submissions")
    criteria = [c["criterion"] for c in COURSE["question"]["01"]["rubric"]]
    marks = tmp_path / "marks.csv"
    with open(marks, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["student", "question", *criteria])
        writer.writeheader()
        writer.writerow({"student": "ada", "question": "01", criteria[0]: "1", criteria[1]: "5"})  # 5: capped at 1
    book = tmp_path / "book"
    done = subprocess.run([sys.executable, str(GRADER), str(folder), "--json", "--timeout", "3",
                           "--gradebook", str(book), "--marks", str(marks), "--gradebook-capstone", "schedule",
                           "--no-verify"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 3, done.stderr  # a student's process exited, timed out or flooded
    students = {s["student"]: s for s in json.loads(done.stdout)["students"]}
    reason = {name: {f"{r['tutorial'][:2]}.{r['exercise']}": r["reason"] for r in s["results"]}
              for name, s in students.items()}
    assert students["ada"]["all_pass"] and students["ada"]["points"] == students["ada"]["max_points"]
    assert (reason["bob"]["05.1"], reason["bob"]["07.3"]) == ("forbidden", "wrong")
    assert reason["cyd"]["03.3"] == "exit"
    assert reason["dee"]["02.2"] == "timeout"
    assert reason["eve"]["07.3"] == "output" and reason["eve"]["01.1"] == "error"
    rows = {row["student"]: row for row in csv.DictReader(open(book / "gradebook.csv"))}
    assert rows["ada"]["Q01"] == "2.0" and rows["bob"]["Q01"] == ""
    assert rows["ada"]["capstone"] == "6.0" and rows["bob"]["capstone"] == ""  # valid, its own, bubble, memory
    assert float(rows["ada"]["total"]) == float(rows["ada"]["exercises"]) + 2 + 6
    assert rows["bob"]["05.1"] == "0" and rows["bob"]["05.2"] == "1"
    assert "similar to solutions/06_checkpointing.py" in rows["dee"]["flags"]
    assert json.loads((book / "gradebook.json").read_text())["students"][0]["student"] == "ada"
    sheet = (book / "written_answers.md").read_text()
    assert "My answer to the question" in sheet and "ZeRO-3 pads every module's buffer" in sheet
    assert criteria[0] in sheet and "<summary>model answer</summary>" in sheet
    template = list(csv.DictReader(open(book / "marks_template.csv")))
    assert len(template) == 5 * len(COURSE["question"])
