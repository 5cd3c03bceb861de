"""Grade the tutorials' exercises: `python tutorials/grade.py [FILES or FOLDER ...] [--json]`.

    python tutorials/grade.py                               # the tutorials as they are: all "not done"
    python tutorials/grade.py my/02_gpt.py my/05_zero.py    # a student's edited copies
    python tutorials/grade.py tutorials/solutions/*.py      # the reference solutions: all pass
    python tutorials/grade.py submissions/                  # a folder of students: one line each
    python tutorials/grade.py submissions/ --gradebook OUT  # and the gradebook and written answers' sheet
    python tutorials/grade.py --build-copies OUT            # the student copy and the instructor copy
    python tutorials/grade.py --capstone FILE.py:FUNCTION   # a schedule capstone; --trainer for a trainer

What is graded. The exercises are read from the tutorials themselves (tutorials/grading/course.py:
every `ex.check(N, check_x, fn)` call), and tutorials/course.toml gives each its points and the
functions that answer it directly. Nothing is hard-coded here, so an exercise added to a tutorial
is graded the moment it exists; the checks are the harness's own, run through `harness.run_check`,
exactly as the tutorial runs them.

Which file answers which tutorial. A FILE named `NN_anything.py` answers tutorial NN. That is the
tutorial itself, a copy a student edited, or a file that defines only the exercise functions, as
tutorials/solutions/NN_name.py do. A file with another name answers the one tutorial whose exercise
functions it defines the most of (name it NN_....py when that is ambiguous). An exercise whose
function the file does not define is "not done"; a file that defines none of them is an error.

How an answer is taken out of a file, without running the file. The file is parsed (ast) and only
what the exercise needs is kept: the exercise function (its `@ex.stub` decorator removed) and,
transitively, every top-level statement that binds a global name it uses -- imports, helper
functions and classes, constants. The global names a function uses are found with `symtable`, the
compiler's own scope analysis, so a parameter or local that happens to share a name with a
tutorial variable pulls in nothing. The kept lines (the others blanked, so that line numbers stay
the student's) are sent to the student's process, which runs them in a fresh namespace under the
file's name. The tutorial's other cells (training runs, `mpiexec` launches, plots) never run. Each
exercise is extracted and executed on its own, so a broken helper of one exercise does not fail
the others.

Where it runs. The student's code runs in a process of its own (tutorials/grading/sandbox.py and
child.py), one per tutorial file and a fresh one after any exercise that killed it, started from a
student copy of the course; the check and the reference answers run here, on the plain data the
student's function returns (tutorials/grading/wire.py). docs/course.md, "What the grader
guarantees", states what that protects and what it does not.

Verdicts. "pass": the check passed (and, in the instructor's run, the hidden drawn cases of
tutorials/grading/hidden.py). "not done": the function is missing, is unchanged from the
tutorial's stub (its syntax tree is compared, so comments and blank lines do not count), or still
raises NotImplementedError. "fail", with its `reason`: "wrong" (the check's message says what was
expected), "error" (the student's code raised), "forbidden" (it called a function course.toml lists
for the exercise), "tampered", "timeout" (past --timeout, default course.toml's 30 s), "exit" (the
process ended: os._exit, a crash), "output" (it printed more than 1 MiB). Flags for the instructor
(code similar to a solution or to refimpl's, constructs an exercise never needs) never change a
verdict. What a student's code prints goes to a capped file, not the table.

Time. No check launches mpiexec: the checks that need several ranks run them as threads
(harness/tensor_parallel.run_ranks, harness/collectives.run_ring); only the tutorials'
demonstration cells launch mpiexec, and the grader never runs those. Grading the reference
solutions takes 5 to 10 s on a shared 2-core machine (about 4.5 s of CPU), mostly starting one
student's process per tutorial.

A folder of submissions. A FOLDER argument holds one subfolder per student (the subfolder's name is
the student's name) with that student's NN_name.py files; other files in FOLDER are ignored. Each
student is graded against every tutorial's exercises (a tutorial with no file counts as not done,
so every student has the same total), by a grader process of its own. One line per student: name,
score, and which exercises are not done or fail; --gradebook OUT writes the gradebook
(tutorials/grading/gradebook.py).

Exit status: 0 when every exercise graded passes (for every student), 1 when some fail, 3 when a
student's process timed out, ended or flooded its output, 2 for a usage error (a missing file, a
file with no exercise, two files for one tutorial, an empty folder) or an `ex.check` call in a
tutorial that the grader cannot read.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import symtable
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

TUTORIALS = Path(__file__).resolve().parent
if str(TUTORIALS) not in sys.path:
    sys.path.insert(0, str(TUTORIALS))  # `import harness`, as the tutorials do

from grading import gradebook, scan  # noqa: E402
from grading.capstone import grade_schedule, grade_trainer  # noqa: E402
from grading.copies import build_instructor_copy, build_student_copy  # noqa: E402
from grading.course import (  # noqa: E402
    Exercise,
    UsageError,
    all_exercises,
    config,
    exercises_of,
    strip_stub_decorator,
)
from grading.sandbox import StudentProcess  # noqa: E402
from harness import run_check  # noqa: E402

TUTORIAL_FILE = re.compile(r"^(\d\d)_\w+\.py$")
PROCESS_REASONS = ("timeout", "exit", "output")  # the student's process failed: exit status 3
__all__ = ["Exercise", "UsageError", "all_exercises", "exercises_of"]


# ------------------------------------------------------------------------------------------------
# Taking one exercise's function out of a student's file
# ------------------------------------------------------------------------------------------------

def _bound_names(node: ast.stmt) -> set[str]:
    """The module-level names a top-level statement binds (imports, defs, classes, assignments)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _globals_used(node: ast.stmt) -> set[str]:
    """The global names a top-level statement reads, by the compiler's scope analysis (symtable)."""
    names: set[str] = set()

    def walk(table) -> None:
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table.get_type() == "module" or symbol.is_global()):
                names.add(symbol.get_name())
        for child in table.get_children():
            walk(child)

    walk(symtable.symtable(ast.unparse(node), "<statement>", "exec"))
    return names


def extract(tree: ast.Module, function: str) -> ast.Module:
    """The statements of `tree` that define `function`: its def and, transitively, whatever
    top-level statement binds a global name it (or those statements) read; in file order."""
    body = [node for node in tree.body if _bound_names(node)]
    star = {i for i, node in enumerate(body) if "*" in _bound_names(node)}  # `from m import *`: kept, always
    keep: set[int] = set(star)
    wanted, seen = [function], set()
    while wanted:
        name = wanted.pop()
        if name in seen:
            continue
        seen.add(name)
        for i, node in enumerate(body):
            if name in _bound_names(node) and i not in keep:
                keep.add(i)
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    wanted.extend(_globals_used(node))
    future = [node for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "__future__"]
    kept = [body[i] for i in sorted(keep) if body[i] not in future]
    for node in kept:
        if isinstance(node, ast.FunctionDef):
            strip_stub_decorator(node)
    return ast.Module(body=future + kept, type_ignores=[])


def _last_def(tree: ast.Module, function: str) -> ast.FunctionDef | None:
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
    return defs[-1] if defs else None


def kept_text(text: str, module: ast.Module) -> str:
    """`text` with every line that `module` (an `extract`ion of it) does not keep left blank: the
    student's process compiles it under the file's name, so an error points at the student's line."""
    lines = text.splitlines()
    keep = [False] * len(lines)
    for node in module.body:
        for i in range(node.lineno - 1, node.end_lineno):
            keep[i] = True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            for i in range(first - 1, node.lineno - 1):
                keep[i] = True
    out = [line if k else "" for line, k in zip(lines, keep)]
    return "\n".join(out) + "\n"


def _stub_decorator_lines(tree: ast.Module, module: ast.Module) -> set[int]:
    """Line numbers of the `@ex.stub` decorators of the kept functions (removed before running)."""
    kept = {(n.lineno, n.name) for n in module.body if isinstance(n, ast.FunctionDef)}
    return {line for node in tree.body if isinstance(node, ast.FunctionDef) and (node.lineno, node.name) in kept
            for d in node.decorator_list if ast.unparse(d).endswith(".stub")
            for line in range(d.lineno, d.end_lineno + 1)}


# ------------------------------------------------------------------------------------------------
# Grading
# ------------------------------------------------------------------------------------------------

@dataclass
class Grade:
    tutorial: str
    exercise: int
    function: str
    title: str
    result: str  # "pass", "fail" or "not done"
    message: str
    file: str
    reason: str = ""  # why it failed: wrong, error, timeout, exit, output, forbidden, tampered
    points: float = 0
    max_points: float = 1
    flags: list = field(default_factory=list)  # for the instructor: similarity, suspicious constructs


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


class Grader:
    """Grades exercises with one student's process per tutorial file, against a student copy."""

    def __init__(self, timeout: float, copy: Path | None = None, sandbox: str = "", hidden: bool = True) -> None:
        self.timeout, self.sandbox, self.hidden = timeout, sandbox, hidden
        self._temporary = None
        if copy is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="student-copy-")
            # The grader's working copy keeps the harness's reference functions (each a tripwire of the
            # exercises it answers).
            instructor = (TUTORIALS / "solutions").is_dir()  # else this is a student copy: keep its table
            copy = build_student_copy(Path(self._temporary.name), recorded={} if instructor else None, strip=False)
        self.copy = Path(copy)
        self.settings = config()

    def close(self) -> None:
        if self._temporary is not None:
            self._temporary.cleanup()

    def grade_tutorial(self, exercises: list[Exercise], text: str | None, tree: ast.Module | None,
                       path: Path | None) -> list[Grade]:
        process = StudentProcess(self.copy, self.sandbox)
        try:
            return [self.grade_exercise(exercise, text, tree, path, process) for exercise in exercises]
        finally:
            process.close()

    def grade_exercise(self, exercise: Exercise, text: str | None, tree: ast.Module | None, path: Path | None,
                       process: StudentProcess) -> Grade:
        def grade(result: str, message: str = "", reason: str = "", flags=()) -> Grade:
            return Grade(exercise.tutorial, exercise.number, exercise.function, exercise.title, result, message,
                         str(path) if path else "", reason, exercise.points if result == "pass" else 0,
                         exercise.points, list(flags))

        if exercise.check is None:
            return grade("fail", f"the grader cannot find exercise {exercise.number}'s check in "
                                 f"{exercise.tutorial}.py (it reads `from harness... import check_x` and "
                                 "`ex.check(N, check_x, function)`)", "error")
        node = _last_def(tree, exercise.function) if tree is not None else None
        if node is None:
            where = (f"{path.name} does not define {exercise.function}" if tree is not None
                     else "no file for this tutorial")
            return grade("not done", where)
        if ast.dump(strip_stub_decorator(_copy(node))) == exercise.stub:
            return grade("not done", f"{exercise.function} is still the tutorial's stub")
        module = extract(_copy(tree), exercise.function)
        blank = _stub_decorator_lines(tree, module)
        source = "\n".join("" if i + 1 in blank else line
                           for i, line in enumerate(kept_text(text, module).splitlines())) + "\n"
        flags = scan.flags(module, exercise, self.settings)
        outcome = process.grade(source, str(path), exercise.function, exercise.forbidden, exercise.check,
                                self.timeout, run_check)
        drawn = hidden_check(exercise, self.settings) if outcome.result == "pass" and self.hidden else None
        if drawn is not None:
            second = process.grade(source, str(path), exercise.function, exercise.forbidden, drawn, self.timeout,
                                   run_check)
            if second.result != "pass":
                outcome = second
                if second.reason in ("wrong", "error"):
                    outcome.message = f"a hidden drawn case: {second.message}"
        return grade(outcome.result, outcome.message, outcome.reason, flags)


def hidden_check(exercise: Exercise, settings: dict):
    """The instructor's drawn-cases check of `exercise`, or None (none written, or a student copy)."""
    if not (TUTORIALS / "grading" / "hidden.py").is_file():
        return None
    from grading import hidden  # noqa: PLC0415 - the instructor copy only

    return hidden.check_for(exercise, settings.get("course", {}).get("hidden_cases", 6))


def _copy(node):
    return copy.deepcopy(node)  # keeps line numbers: errors point at the student's line


def assign(paths: list[Path], exercises: dict[str, list[Exercise]]) -> dict[str, Path]:
    """Which file answers which tutorial: {"02_gpt": path, ...}. Raises UsageError (one line)."""
    by_number = {name[:2]: name for name in exercises}
    chosen: dict[str, Path] = {}
    for path in paths:
        if not path.is_file():
            raise UsageError(f"{path}: no such file")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        except SyntaxError:
            tree = None  # graded below: every exercise of the file fails with the syntax error
        functions = (ast.FunctionDef, ast.AsyncFunctionDef)
        defined = {n.name for n in tree.body if isinstance(n, functions)} if tree else set()
        match = TUTORIAL_FILE.match(path.name)
        if match:
            if match.group(1) not in by_number:
                raise UsageError(f"{path}: there is no tutorial {match.group(1)} (tutorials: {', '.join(by_number)})")
            tutorial = by_number[match.group(1)]
        else:
            counts = {name: len(defined & {e.function for e in ex}) for name, ex in exercises.items()}
            best = max(counts.values(), default=0)
            winners = [name for name, n in counts.items() if n == best]
            if best == 0 or len(winners) > 1:
                raise UsageError(f"{path}: cannot tell which tutorial it answers; name it NN_name.py"
                                 + (f" (it could be {' or '.join(winners)})" if best else ""))
            tutorial = winners[0]
        if tree is not None and not defined & {e.function for e in exercises[tutorial]}:
            names = ", ".join(e.function for e in exercises[tutorial])
            raise UsageError(f"{path}: defines no exercise function of tutorial {tutorial} ({names})")
        if tutorial in chosen:
            raise UsageError(f"{path} and {chosen[tutorial]} both answer tutorial {tutorial}")
        chosen[tutorial] = path
    return chosen


def grade_files(paths: list[Path], grader: Grader | None = None, every_tutorial: bool = False, *,
                timeout: float = 30) -> list[Grade]:
    """Grade the files: every exercise of the tutorials they answer (of all tutorials with every_tutorial).
    Without a `grader`, one is made for this call (its own student copy, `timeout` per exercise)."""
    if grader is None:
        grader = Grader(timeout)
        try:
            return grade_files(paths, grader, every_tutorial)
        finally:
            grader.close()
    exercises = all_exercises()
    chosen = assign(paths, exercises)
    grades = []
    for tutorial, listed in exercises.items():
        path = chosen.get(tutorial)
        if path is None and not every_tutorial:
            continue
        text, tree, broken = None, None, ""
        if path is not None:
            text = path.read_text(encoding="utf-8")
            try:
                tree = ast.parse(text, str(path))
            except SyntaxError as exc:
                broken = f"{path.name} does not parse: {exc.msg} (line {exc.lineno})"
        if broken:
            grades += [Grade(tutorial, e.number, e.function, e.title, "fail", broken, str(path), "error", 0, e.points)
                       for e in listed]
        else:
            grades += grader.grade_tutorial(listed, text, tree, path)
    return grades


def summary(grades: list[Grade]) -> dict:
    passed = sum(g.result == "pass" for g in grades)
    return {"score": passed, "total": len(grades), "all_pass": bool(grades) and passed == len(grades),
            "points": sum(g.points for g in grades), "max_points": sum(g.max_points for g in grades),
            "flagged": sum(bool(g.flags) for g in grades), "results": [asdict(g) for g in grades]}


def print_table(grades: list[Grade]) -> None:
    rows = [(g.tutorial, str(g.exercise), g.function, g.result, _first_line(g.message)) for g in grades]
    header = ("tutorial", "#", "exercise", "result", "message")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    passed = sum(g.result == "pass" for g in grades)
    print(f"\nscore: {passed}/{len(grades)}")
    for g in grades:
        for flag in g.flags:
            print(f"flag for the instructor: {g.tutorial[:2]}.{g.exercise} {g.function}: {flag}")


# ------------------------------------------------------------------------------------------------
# A folder of submissions: one child process per student
# ------------------------------------------------------------------------------------------------

def grade_student(folder: Path, timeout: float, limit: float, copy_dir: Path, sandbox: str = "") -> dict:
    """{"student", "score", "total", "results"} or {"student", "error"}: one child grader run."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and TUTORIAL_FILE.match(p.name))  # not capstone.py
    command = [sys.executable, str(Path(__file__).resolve()), "--json", "--every-tutorial",
               "--timeout", str(timeout), "--student-copy", str(copy_dir), *map(str, files)]
    if sandbox:
        command += ["--sandbox", sandbox]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"student": folder.name, "error": f"grading took longer than {limit:g} s"}
    lines = done.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        report = {}
    if "error" in report or "score" not in report:
        error = report.get("error") or _first_line(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "")
        return {"student": folder.name, "error": error or f"the grader exited with status {done.returncode}"}
    return {"student": folder.name, **report}


def grade_folder(folder: Path, timeout: float, copy_dir: Path, sandbox: str = "") -> list[dict]:
    students = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    if not students:
        raise UsageError(f"{folder}: no submissions (one subfolder per student)")
    n_exercises = sum(len(listed) for listed in all_exercises().values())
    limit = 60 + 2 * timeout * n_exercises
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda s: grade_student(s, timeout, limit, copy_dir, sandbox), students))


def student_line(report: dict, width: int) -> str:
    name = report["student"].ljust(width)
    if "error" in report:
        return f"{name}  error: {report['error']}"
    line = f"{name}  {report['score']:>3}/{report['total']}"
    failed = [f"{r['tutorial'][:2]}.{r['exercise']}" for r in report["results"] if r["result"] == "fail"]
    missing = sum(r["result"] == "not done" for r in report["results"])
    if failed:
        line += f"  fail: {' '.join(failed)}"  # tutorial.exercise, as in 02.1
    if missing:
        line += f"  not done: {missing}"
    return line


# ------------------------------------------------------------------------------------------------

# ------------------------------------------------------------------------------------------------
# The capstones: a pipeline schedule or a trainer of the student's own (docs/capstone.md)
# ------------------------------------------------------------------------------------------------

def grade_capstone(spec: str, kind: str = "schedule", run_verify: bool = True, copy_dir: Path | None = None,
                   sandbox: str = "") -> list[Grade]:
    """The capstone's grades (tutorials/grading/capstone.py), targets and points from course.toml."""
    settings = config()
    if kind == "trainer":
        rows = grade_trainer(spec, settings, run_verify)
    else:
        temporary = None
        if copy_dir is None:
            temporary = tempfile.TemporaryDirectory(prefix="student-copy-")
            copy_dir = build_student_copy(Path(temporary.name), recorded={} if (TUTORIALS / "solutions").is_dir()
                                          else None, strip=False)
        try:
            rows = grade_schedule(spec, settings, Path(copy_dir), run_verify, sandbox)
        finally:
            if temporary is not None:
                temporary.cleanup()
    maxima = settings.get("capstone", {}).get(kind, {}).get("points", {})
    return [Grade(f"capstone {kind}", i, what, what, result, message, spec, "" if result == "pass" else "wrong",
                  points, float(maxima.get(what, 1)))
            for i, (what, result, message, points) in enumerate(rows, start=1)]


def grade_capstone_folder(folder: Path, kind: str, run_verify: bool, copy_dir: Path, sandbox: str) -> list[dict]:
    """One report per student subfolder, from its course.toml-named file (capstone.py:my_schedule)."""
    conf = config().get("capstone", {}).get(kind, {})
    name, function = conf.get("file", "capstone.py"), conf.get("function", "my_schedule")
    students = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    if not students:
        raise UsageError(f"{folder}: no submissions (one subfolder per student)")
    reports = []
    for student in students:
        if not (student / name).is_file():
            reports.append({"student": student.name, "error": f"no {name}"})
            continue
        report = summary(grade_capstone(f"{student / name}:{function}", kind, run_verify, copy_dir, sandbox))
        reports.append({"student": student.name, **report})
    return reports


def exit_status(grades: list[Grade]) -> int:
    """0: every exercise passes; 3: some student's process timed out, ended or flooded; else 1."""
    if any(g.reason in PROCESS_REASONS for g in grades):
        return 3
    return 0 if grades and all(g.result == "pass" for g in grades) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Grade the tutorials' exercises in a student's files, or in a folder of submissions "
                    "(one subfolder per student). Default: the tutorials themselves.")
    parser.add_argument("paths", nargs="*", metavar="FILE_OR_FOLDER",
                        help="NN_name.py files (an edited tutorial, or only the exercise functions), or folders "
                             "of submissions")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--timeout", type=float, help="seconds one exercise may run (default: course.toml's, 30)")
    parser.add_argument("--every-tutorial", action="store_true",
                        help="grade every tutorial's exercises; those with no file are not done")
    parser.add_argument("--student-copy", metavar="DIR", type=Path,
                        help="the student copy the student's code runs against (default: one built for this run)")
    parser.add_argument("--sandbox", metavar="COMMAND", default="",
                        help="a command to start the student's process under, e.g. 'sudo -u student --' or a "
                             "bubblewrap line (docs/course.md)")
    parser.add_argument("--public-only", action="store_true", help="skip the hidden drawn cases")
    parser.add_argument("--gradebook", metavar="OUT", type=Path,
                        help="with a folder of submissions: write OUT/gradebook.csv and .json, the written answers' "
                             "marking sheet OUT/written_answers.md and OUT/marks_template.csv")
    parser.add_argument("--gradebook-capstone", choices=["schedule", "trainer"],
                        help="with --gradebook: grade each student's capstone file too (course.toml names it) and "
                             "add its points (--no-verify skips its mpiexec runs)")
    parser.add_argument("--marks", metavar="MARKS.csv", type=Path,
                        help="the filled marks template: the written questions' points, added to the gradebook")
    parser.add_argument("--build-copies", metavar="OUT", type=Path,
                        help="write OUT/student (for students: no solutions, no reference answers) and "
                             "OUT/instructor, then exit")
    parser.add_argument("--capstone", metavar="FILE.py:FUNCTION_OR_FOLDER",
                        help="grade a pipeline schedule of the student's own (docs/capstone.md), or a folder of "
                             "submissions (course.toml names each one's file and function): valid, not a built-in, "
                             "bubble and memory targets of course.toml, verify at 2 and 4 ranks and a sweep")
    parser.add_argument("--trainer", metavar="FILE.py:FUNCTION_OR_FOLDER",
                        help="grade a trainer of the student's own (docs/verify_your_algorithm.md): verify --trainer "
                             "at the world sizes of course.toml and a sweep")
    parser.add_argument("--no-verify", action="store_true", help="capstone: skip the mpiexec runs")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        settings = config()
    except UsageError as exc:
        print(f"grade.py: error: {exc}", file=sys.stderr)
        return 2
    timeout = args.timeout if args.timeout is not None else settings.get("course", {}).get("timeout_seconds", 30)
    if args.sandbox and not shutil.which(shlex.split(args.sandbox)[0] if shlex.split(args.sandbox) else ""):
        print(f"grade.py: error: --sandbox {args.sandbox!r}: no such command (give the command that starts the "
              "student's process, e.g. 'sudo -u student --')", file=sys.stderr)
        return 2
    if args.build_copies:
        if args.build_copies.exists() and any(args.build_copies.iterdir()):
            print(f"grade.py: error: {args.build_copies} is not empty; give a new folder", file=sys.stderr)
            return 2
        student = build_student_copy(args.build_copies / "student")
        instructor = build_instructor_copy(args.build_copies / "instructor")
        print(f"student copy: {student}\ninstructor copy: {instructor}")
        return 0
    if args.capstone or args.trainer:
        if args.paths or (args.capstone and args.trainer):
            print("grade.py: error: give --capstone or --trainer alone, without files", file=sys.stderr)
            return 2
        kind, spec = ("schedule", args.capstone) if args.capstone else ("trainer", args.trainer)
        if Path(spec).is_dir():
            try:
                reports = grade_capstone_folder(Path(spec), kind, not args.no_verify, args.student_copy,
                                                args.sandbox) if args.student_copy else None
                if reports is None:
                    with tempfile.TemporaryDirectory(prefix="student-copy-") as folder:
                        copy_dir = build_student_copy(Path(folder), recorded={}, strip=False)
                        reports = grade_capstone_folder(Path(spec), kind, not args.no_verify, copy_dir, args.sandbox)
            except UsageError as exc:
                print(f"grade.py: error: {exc}", file=sys.stderr)
                return 2
            ok = all(r.get("all_pass") for r in reports)
            if args.json:
                print(json.dumps({"students": reports, "all_pass": ok,
                                  "seconds": round(time.perf_counter() - start, 2)}))
            else:
                width = max(len(r["student"]) for r in reports)
                for report in reports:
                    print(student_line(report, width))
            return 0 if ok else 1
        grades = grade_capstone(spec, kind, not args.no_verify, args.student_copy, args.sandbox)
        report = summary(grades)
        if args.json:
            print(json.dumps({**report, "seconds": round(time.perf_counter() - start, 2)}))
        else:
            print_table(grades)
        return 0 if report["all_pass"] else 1
    paths = [Path(p) for p in args.paths] or sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
    if (args.gradebook or args.marks) and not any(p.is_dir() for p in paths):
        print("grade.py: error: --gradebook and --marks need a folder of submissions", file=sys.stderr)
        return 2
    if args.student_copy is not None and not (args.student_copy / "tutorials" / "grading" / "child.py").is_file():
        print(f"grade.py: error: --student-copy {args.student_copy} is not a student copy (build one with "
              "--build-copies OUT)", file=sys.stderr)
        return 2
    grader = None
    try:
        folders = [p for p in paths if p.is_dir()]
        if folders and len(folders) < len(paths):
            raise UsageError("give either files or folders of submissions, not both")
        grader = Grader(timeout, args.student_copy, args.sandbox, hidden=not args.public_only)
        if folders:
            reports = [r for folder in folders for r in grade_folder(folder, timeout, grader.copy, args.sandbox)]
            ok = all(r.get("all_pass") for r in reports)
            if args.gradebook:
                if args.marks is not None and not args.marks.is_file():
                    raise UsageError(f"--marks {args.marks}: no such file")
                settings = config()
                marks = gradebook.read_marks(args.marks, settings) if args.marks else None
                students = {p.name: p for folder in folders for p in folder.iterdir() if p.is_dir()}
                if args.gradebook_capstone:
                    kind = args.gradebook_capstone
                    conf = settings.get("capstone", {}).get(kind, {})
                    for report in reports:
                        path = students[report["student"]] / conf.get("file", "capstone.py")
                        if path.is_file():
                            spec = f"{path}:{conf.get('function', 'my_schedule')}"
                            report["capstone"] = summary(grade_capstone(spec, kind, not args.no_verify, grader.copy,
                                                                        args.sandbox))
                written = gradebook.write(args.gradebook, reports, students, TUTORIALS, settings, marks)
                print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
            if args.json:
                seconds = round(time.perf_counter() - start, 2)
                print(json.dumps({"students": reports, "all_pass": ok, "seconds": seconds}))
            else:
                width = max(len(r["student"]) for r in reports)
                for report in reports:
                    print(student_line(report, width))
            if any(r.get("exit_status") == 3 for r in reports):
                return 3
            return 0 if ok else 1
        grades = grade_files(paths, grader, args.every_tutorial)
    except UsageError as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}))
        print(f"grade.py: {exc}", file=sys.stderr)
        return 2
    finally:
        if grader is not None:
            grader.close()
    report = summary(grades)
    status = exit_status(grades)
    if args.json:
        print(json.dumps({**report, "exit_status": status, "seconds": round(time.perf_counter() - start, 2)}))
    else:
        print_table(grades)
    return status


if __name__ == "__main__":
    sys.exit(main())
