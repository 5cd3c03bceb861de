"""tutorials/grade.py --build-copies: the student copy has no solutions, no hidden checks, no model
answers and no reference function that computes an answer, yet its public checks still grade."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRADER = REPO / "tutorials" / "grade.py"


def test_the_student_copy_ships_no_answers_and_still_grades_the_public_checks(tmp_path):
    done = subprocess.run([sys.executable, str(GRADER), "--build-copies", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    student, instructor = tmp_path / "out" / "student", tmp_path / "out" / "instructor"
    assert not (student / "tutorials" / "solutions").exists()
    assert not (student / "tutorials" / "grading" / "hidden.py").exists()
    assert (instructor / "tutorials" / "solutions").is_dir()
    assert (instructor / "tutorials" / "grading" / "hidden.py").is_file()
    assert "model_answer" not in (student / "tutorials" / "course.toml").read_text()
    stripped = 0
    for path in (student / "tutorials" / "harness").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith(("reference_", "measured_")):
                # one statement: a lookup in the table of the public cases' answers
                assert [ast.unparse(s) for s in node.body] == [
                    f"return _recorded({path.stem + '.' + node.name!r}, args, kwargs)"], (path.name, node.name)
                stripped += 1
    assert stripped == 9  # 2 in composition.py, 3 in tensor_parallel.py, 4 in experts.py
    table = json.loads((student / "tutorials" / "harness" / "recorded.json").read_text())
    assert set(table) == {"composition.reference_gradient_group", "composition.reference_stage_model_states",
                          "tensor_parallel.reference_swiglu_slices", "tensor_parallel.reference_qkv_slices",
                          "tensor_parallel.reference_tp_allreduce_bytes", "experts.reference_dispatch_indices",
                          "experts.reference_interleave", "experts.reference_exposed_time",
                          "experts.measured_alltoall_bytes"}
    # The student copy's own grader, on the solutions (from elsewhere), with its public checks only.
    answers = tmp_path / "answers"
    answers.mkdir()
    for name in ("10_tensor_parallel.py", "11_experts_and_overlap.py"):
        shutil.copy(REPO / "tutorials" / "solutions" / name, answers / name)
    done = subprocess.run([sys.executable, str(student / "tutorials" / "grade.py"), "--json",
                           *sorted(map(str, answers.iterdir()))], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["score"], report["total"], done.returncode) == (8, 8, 0), report


def test_the_students_process_starts_under_a_sandbox_command_and_a_missing_one_is_a_usage_error():
    solution = REPO / "tutorials" / "solutions" / "07_pipeline_schedules.py"
    done = subprocess.run([sys.executable, str(GRADER), str(solution), "--sandbox", "env", "--public-only", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert json.loads(done.stdout)["all_pass"] and done.returncode == 0
    done = subprocess.run([sys.executable, str(GRADER), str(solution), "--sandbox", "no-such-sandbox"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2 and done.stderr.startswith("grade.py: error: --sandbox")
    assert "Traceback" not in done.stderr
