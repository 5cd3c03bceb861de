"""tutorials/grade.py: the reference solutions pass, the unfilled tutorials are "not done", a subtly
wrong answer fails with the check's message, a folder of submissions gives one line per student,
and the exit status says which."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GRADER = REPO / "tutorials" / "grade.py"
SOLUTIONS = sorted((REPO / "tutorials" / "solutions").glob("[0-9][0-9]_*.py"))
TUTORIALS = sorted((REPO / "tutorials").glob("[0-9][0-9]_*.py"))

spec = importlib.util.spec_from_file_location("tutorials_grade", GRADER)
grade = sys.modules["tutorials_grade"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(grade)
N_EXERCISES = sum(len(listed) for listed in grade.all_exercises().values())


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GRADER), *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def by_exercise(report: dict) -> dict:
    return {(r["tutorial"], r["exercise"]): r for r in report["results"]}


def test_every_tutorial_has_exercises_and_their_solutions_pass():
    # How long it takes is the grader's --json "seconds" (about 6 s on an idle 2-core machine: a student's
    # process per tutorial); no test asserts a time: tests never depend on the machine's speed.
    assert N_EXERCISES >= 38 and all(grade.all_exercises().values())
    done = run(*SOLUTIONS, "--json")
    report = json.loads(done.stdout)
    failing = [r for r in report["results"] if r["result"] != "pass"]
    assert not failing, failing
    assert (report["score"], report["total"], done.returncode) == (N_EXERCISES, N_EXERCISES, 0)


def test_the_tutorials_themselves_are_not_done_and_the_table_says_so():
    done = run()  # no FILES: the tutorials as they are
    assert done.returncode == 1
    assert f"score: 0/{N_EXERCISES}" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line[:2].isdigit()]
    assert len(rows) == N_EXERCISES and all("  not done  " in row for row in rows)
    first = next(row for row in rows if row.startswith("01_autograd"))
    assert first.split()[:6] == ["01_autograd", "1", "sigmoid_backward", "not", "done", "sigmoid_backward"]
    assert first.endswith("sigmoid_backward is still the tutorial's stub")


def _filled(tutorial: str, function: str, body: str, prefix: str = "") -> str:
    """The tutorial's source with `function`'s stub replaced by `body` (a whole def), `prefix` on top."""
    source = (REPO / "tutorials" / f"{tutorial}.py").read_text()
    start = source.index(f"@ex.stub\ndef {function}(")
    end = source.index("\n\n\n", start)
    return prefix + source[:start] + "@ex.stub\n" + body.strip() + source[end:]


def test_a_subtly_wrong_answer_in_an_edited_tutorial_fails_with_the_checks_message(tmp_path):
    # tests/test_tutorials.py's WRONG: ("checkpointing", "check_revolve_extra", lambda n, c: n - 1, "advances")
    path = tmp_path / "06_checkpointing.py"
    path.write_text(_filled("06_checkpointing", "revolve_extra", "def revolve_extra(n, C):\n    return n - 1\n",
                            prefix='raise SystemExit("the tutorial itself must not run")\n'))
    report = grade.summary(grade.grade_files([path], timeout=30))
    results = by_exercise(report)
    wrong = results[("06_checkpointing", 2)]
    assert wrong["result"] == "fail" and "advances" in wrong["message"], wrong
    assert results[("06_checkpointing", 1)]["result"] == "not done"
    assert report["score"] == 0 and report["total"] == len(grade.all_exercises()["06_checkpointing"])


def test_helpers_and_imports_the_answer_needs_come_along_and_errors_point_at_the_students_line(tmp_path):
    path = tmp_path / "answers.py"  # not named NN_...: found by its exercise functions
    path.write_text(
        "import numpy as np\n"
        "from fractions import Fraction\n"
        "STEPS = 1\n"
        "def _idle(pp):\n    return (pp - 1) * STEPS\n"
        "def bubble_fraction(pp, m):\n    return Fraction(_idle(pp), m + _idle(pp))\n"
        "def gpipe(pp, m):\n    raise NotImplementedError('later')\n"
        "def one_f_one_b(pp, m):\n    return np.zeros(3)[pp + 10]\n"
        "print('top-level code is never run')\n"
        "raise SystemExit(1)\n")
    grades = {g.exercise: g for g in grade.grade_files([path], timeout=30)}
    assert grades[3].result == "pass" and grades[3].tutorial == "07_pipeline_schedules"
    assert grades[1].result == "not done" and "NotImplementedError" in grades[1].message
    assert grades[2].result == "fail" and "IndexError" in grades[2].message and "answers.py:11" in grades[2].message


def test_a_folder_of_two_submissions_gives_two_lines(tmp_path):
    shutil.copytree(REPO / "tutorials" / "solutions", tmp_path / "alice", ignore=shutil.ignore_patterns("__*"))
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "07_pipeline_schedules.py").write_text(  # WRONG: bubble_fraction = (p - 1) / m
        "def bubble_fraction(pp, m):\n    return (pp - 1) / m\n")
    (tmp_path / "notes.txt").write_text("ignored")
    done = run(tmp_path)
    lines = done.stdout.splitlines()
    assert done.returncode == 1 and len(lines) == 2, done.stdout + done.stderr
    assert lines[0].split() == ["alice", f"{N_EXERCISES}/{N_EXERCISES}"]
    assert lines[1].split()[:4] == ["bob", f"0/{N_EXERCISES}", "fail:", "07.3"]
    assert lines[1].endswith(f"not done: {N_EXERCISES - 1}")
    report = json.loads(run(tmp_path, "--json").stdout)
    assert [s["student"] for s in report["students"]] == ["alice", "bob"] and not report["all_pass"]
    assert "bubble fraction" in by_exercise(report["students"][1])[("07_pipeline_schedules", 3)]["message"]
    alice = [r for r in report["students"][0]["results"] if r["result"] != "pass"]
    assert report["students"][0]["all_pass"], alice  # alice: everything passes (else: what did not, and why)


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    ("x = 1\n", "defines no exercise function of tutorial 05_zero"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, content, says):
    path = tmp_path / "05_zero.py"
    if content is not None:
        path.write_text(content)
    done = run(path)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr
    assert says in json.loads(run(path, "--json").stdout)["error"]


def test_a_file_that_does_not_parse_fails_its_exercises(tmp_path):
    path = tmp_path / "01_autograd.py"
    path.write_text("def sigmoid_backward(y, g):\n    return y *\n")
    grades = grade.grade_files([path], timeout=30)
    assert len(grades) == len(grade.all_exercises()["01_autograd"])
    assert all(g.result == "fail" and "does not parse" in g.message for g in grades)


def test_the_wire_reads_a_message_that_arrives_in_pieces():
    """A message larger than a pipe's buffer reaches an unbuffered reader in pieces: each read returns
    what has arrived. The student's process reads its pipe so, and once took the first piece of a
    large array for the whole message (the process ended, "status 0", at random)."""
    import io  # noqa: PLC0415 - this test alone
    import struct  # noqa: PLC0415 - this test alone
    import threading  # noqa: PLC0415 - this test alone

    sys.path.insert(0, str(REPO / "tutorials"))
    from grading import wire  # noqa: PLC0415 - the grader's own package, found through tutorials/

    class ArrivesInPieces(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self.stream = io.BytesIO(data)

        def read(self, size: int = -1) -> bytes:
            return self.stream.read(min(size, 7))  # at most 7 bytes per read, as a slow pipe gives them

    payload = "x" * 100_000
    data = json.dumps({"op": "note", "payload": payload}).encode()
    got, done = [], threading.Event()
    peer = wire.Peer(ArrivesInPieces(struct.pack("<I", len(data)) + data), io.BytesIO(), trusted=True,
                     on_request=lambda message: (got.append(message), done.set()))
    peer.thread.join(timeout=30)
    assert done.is_set() and got[0]["payload"] == payload
