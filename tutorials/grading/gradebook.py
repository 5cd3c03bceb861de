"""The gradebook of a folder of submissions, the written answers' marking sheet, and manual marks.

    python tutorials/grade.py submissions/ --gradebook OUT [--marks marks.csv]

Written answers. Each tutorial ends with one written question ("measure and explain") and a marked
place for its answer, a top-level string in the student's file:

    ANSWER = \"\"\"
    ...the student's answer...
    \"\"\"

The grader reads it with the parser (the file is never run) and writes OUT/written_answers.md:
per question, its rubric (course.toml, `[question."NN"]`: criteria with points) and model answer
(the solution's ANSWER, in the instructor copy), then every student's answer; and
OUT/marks_template.csv, one row per student and question with an empty column per criterion.
Fill it in and pass it back with `--marks`: the points of a row are the sum of its criteria's
columns, each capped at that criterion's points.

The gradebook. OUT/gradebook.csv and OUT/gradebook.json: one row per student, with the points of
every exercise ("01.1" ...), of every written question ("Q01" ..., from --marks; empty until
marked), the exercises' and questions' totals, the capstone's points (with --gradebook-capstone:
each student's course.toml-named capstone file, graded as `--capstone` does; empty without), the
total and the maximum, and the flags the grader raised for the instructor.
"""

from __future__ import annotations

import ast
import csv
import json
from pathlib import Path

PLACEHOLDER = "(your answer)"


def written_answer(path: Path) -> str | None:
    """The ANSWER string of a student's file (None: none, or still the tutorial's placeholder)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ANSWER" for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            text = node.value.value.strip()
            return None if not text or text == PLACEHOLDER else text
    return None


def model_answer(tutorials: Path, tutorial: str) -> str | None:
    path = tutorials / "solutions" / f"{tutorial}.py"
    return written_answer(path) if path.is_file() else None


def questions(settings: dict) -> dict[str, dict]:
    """{"01": {"points": 4, "rubric": [{"criterion", "points"}, ...]}, ...} from course.toml."""
    return {key: value for key, value in sorted(settings.get("question", {}).items())}


def read_marks(path: Path, settings: dict) -> dict[tuple[str, str], float]:
    """{(student, "01"): points} from a filled marks file (the template's columns)."""
    rubric = questions(settings)
    marks = {}
    with open(path, newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            student, question = row.get("student", "").strip(), row.get("question", "").strip()
            if not student or question not in rubric:
                continue
            total = 0.0
            for criterion in rubric[question].get("rubric", []):
                cell = (row.get(criterion["criterion"]) or "").strip()
                if cell:
                    total += min(float(cell), float(criterion["points"]))
            marks[(student, question)] = total
    return marks


def write(out: Path, reports: list[dict], folders: dict[str, Path], tutorials: Path, settings: dict,
          marks: dict | None = None) -> list[Path]:
    """Write the gradebook (CSV, JSON), the written answers' sheet and the marks template; the paths."""
    out.mkdir(parents=True, exist_ok=True)
    marks = marks or {}
    rubric = questions(settings)
    tutorial_names = {path.stem[:2]: path.stem for path in sorted(tutorials.glob("[0-9][0-9]_*.py"))}
    keys = sorted({f"{r['tutorial'][:2]}.{r['exercise']}" for report in reports for r in report.get("results", [])},
                  key=lambda k: (k[:2], int(k[3:])))
    rows = []
    for report in reports:
        student = report["student"]
        by_key = {f"{r['tutorial'][:2]}.{r['exercise']}": r for r in report.get("results", [])}
        row = {"student": student}
        for key in keys:
            row[key] = by_key[key]["points"] if key in by_key else 0
        exercises = sum(row[k] for k in keys)
        written = {f"Q{q}": marks.get((student, q), "") for q in rubric}
        row.update(written)
        row["exercises"] = exercises
        row["questions"] = sum(v for v in written.values() if v != "")
        capstone = report.get("capstone") or {}
        row["capstone"] = capstone.get("points", "")
        row["total"] = row["exercises"] + row["questions"] + (capstone.get("points") or 0)
        row["max"] = (report.get("max_points", 0) + sum(float(q.get("points", 0)) for q in rubric.values())
                      + capstone.get("max_points", 0))
        row["flags"] = "; ".join(f"{key}: {flag}" for key in keys for flag in by_key.get(key, {}).get("flags", []))
        if "error" in report:
            row["flags"] = f"grading error: {report['error']}"
        rows.append(row)
    columns = ["student", *keys, *[f"Q{q}" for q in rubric], "exercises", "questions", "capstone", "total", "max",
               "flags"]
    written_paths = [out / "gradebook.csv", out / "gradebook.json", out / "written_answers.md",
                     out / "marks_template.csv"]
    with open(written_paths[0], "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    written_paths[1].write_text(json.dumps({"columns": columns, "students": rows}, indent=1), encoding="utf-8")
    sheet = ["# Written answers, for marking", "",
             "One section per question: its rubric and model answer, then each student's answer. Mark in "
             "marks_template.csv (one column per criterion, at most its points) and pass it back with --marks.", ""]
    template = []
    for question, entry in rubric.items():
        tutorial = tutorial_names.get(question, question)
        sheet += [f"## {tutorial}", "", f"Points: {entry.get('points', 0)}", "", "| criterion | points |",
                  "|---|---:|"]
        sheet += [f"| {c['criterion']} | {c['points']} |" for c in entry.get("rubric", [])]
        answer = model_answer(tutorials, tutorial)
        if answer:
            sheet += ["", "<details><summary>model answer</summary>", "", answer, "", "</details>"]
        for report in reports:
            student = report["student"]
            files = sorted(folders[student].glob(f"{question}_*.py")) if student in folders else []
            text = written_answer(files[0]) if files else None
            sheet += ["", f"### {student}", "", text if text else "*(no answer)*"]
            template.append({"student": student, "question": question,
                             **{c["criterion"]: "" for c in entry.get("rubric", [])}})
        sheet.append("")
    written_paths[2].write_text("\n".join(sheet) + "\n", encoding="utf-8")
    criteria = [c["criterion"] for entry in rubric.values() for c in entry.get("rubric", [])]
    with open(written_paths[3], "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["student", "question", *dict.fromkeys(criteria)])
        writer.writeheader()
        writer.writerows(template)
    return written_paths
