"""The schedule capstone graded for real (tutorials/grading/capstone.py): a built-in, a copy of one's
action lists, or the worked example is refused; bubble and memory targets come from course.toml;
verify runs at 2 and 4 ranks and a sweep; a folder of submissions gives one line per student."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRADER = REPO / "tutorials" / "grade.py"
spec = importlib.util.spec_from_file_location("tutorials_grade", GRADER)
grade = sys.modules.setdefault("tutorials_grade", importlib.util.module_from_spec(spec))
if not hasattr(grade, "grade_capstone"):
    spec.loader.exec_module(grade)

from course_fixture import CAPSTONE  # noqa: E402 - after the grader is loaded

HEADER = "from refimpl.parallel.pipeline.schedules import Action, check_counts, linear_placement, make_schedule\n"
OWN = CAPSTONE  # the worked example with the cool-down's W's reversed: the student's own, and on target
BUILTIN = '''
from refimpl.parallel.pipeline import SCHEDULES

def my_schedule(pp, micro_batches, chunks=None):
    return SCHEDULES["zb1p"](pp, micro_batches, chunks)
'''
COPIED_1F1B = HEADER + '''
def my_schedule(pp, micro_batches, chunks=None):
    m, ranks = micro_batches, []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        steps = [Action("F", r, k) for k in range(warmup)]
        for k in range(m - warmup):
            steps += [Action("F", r, warmup + k), Action("B", r, k)]
        steps += [Action("B", r, k) for k in range(m - warmup, m)]
        ranks.append(steps)
    return make_schedule("renamed", pp, m, linear_placement(pp), ranks)
'''
WORKED = (REPO / "docs" / "examples" / "my_schedule.py").read_text().replace("def early_backward",
                                                                              "def my_schedule")


def results(grades) -> dict:
    return {g.function: g.result for g in grades}


def test_a_schedule_of_ones_own_passes_everything_verify_at_2_and_4_ranks_and_a_sweep(tmp_path):
    path = tmp_path / "capstone.py"
    path.write_text(OWN)
    grades = grade.grade_capstone(f"{path}:my_schedule")
    assert results(grades) == {"valid": "pass", "its own": "pass", "bubble": "pass", "memory": "pass",
                               "verify 2": "pass", "verify 4": "pass", "sweep": "pass"}, grades
    assert "0.2500 < 1F1B's 0.2727" in grades[2].message and "<= 1F1B's 4" in grades[3].message
    assert sum(g.points for g in grades) == sum(g.max_points for g in grades) == 10


def test_a_builtin_a_copy_of_ones_lists_and_the_worked_example_are_refused(tmp_path):
    for text, says in [(BUILTIN, "called the built-in"), (COPIED_1F1B, "those of 1F1B"),
                       (WORKED, "the worked example")]:
        path = tmp_path / "capstone.py"
        path.write_text(text)
        grades = grade.grade_capstone(f"{path}:my_schedule", run_verify=False)
        own = next(g for g in grades if g.function == "its own")
        assert own.result == "fail" and says in own.message and own.points == 0, (says, grades)
    # the copy of 1F1B also misses the bubble target: 1F1B does not beat itself
    path.write_text(COPIED_1F1B)
    assert results(grade.grade_capstone(f"{path}:my_schedule", run_verify=False))["bubble"] == "fail"


def test_a_folder_of_capstones_gives_one_line_per_student(tmp_path):
    for name, text in [("ada", OWN), ("bob", BUILTIN)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "capstone.py").write_text(text)
    (tmp_path / "cyd").mkdir()  # handed in nothing
    done = subprocess.run([sys.executable, str(GRADER), "--capstone", str(tmp_path), "--no-verify", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    report = {r["student"]: r for r in json.loads(done.stdout)["students"]}
    assert report["ada"]["points"] == 6 and report["bob"]["points"] < 6 and report["cyd"]["error"] == "no capstone.py"
    assert done.returncode == 1


BALLAST = f'''
import numpy as np
import runpy

_example = runpy.run_path({str(REPO / "docs" / "examples" / "flat_allreduce_trainer.py")!r})


def make_trainer(cfg, model, world):
    trainer = _example["make_trainer"](cfg, model, world)
    trainer.ballast = np.zeros(100_000)  # 800 kB held between steps that plain data parallelism does not hold
    return trainer
'''


def test_the_trainer_capstone_verifies_at_two_world_sizes_and_measures_what_the_trainer_holds(tmp_path):
    grades = grade.grade_capstone("docs/examples/flat_allreduce_trainer.py:make_trainer", "trainer")
    assert results(grades) == {"verify 2": "pass", "verify 4": "pass", "sweep": "pass", "memory": "pass"}, grades
    path = tmp_path / "trainer.py"
    path.write_text(BALLAST)
    heavy = {g.function: g for g in grade.grade_capstone(f"{path}:make_trainer", "trainer")}
    assert heavy["verify 2"].result == "pass" and heavy["memory"].result == "fail", heavy
    assert "> 1 x plain data parallelism's" in heavy["memory"].message
