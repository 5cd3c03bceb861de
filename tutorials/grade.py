"""Grade the tutorials' exercises: `python tutorials/grade.py [FILES or FOLDER ...] [--json]`.

    python tutorials/grade.py                               # the tutorials as they are: all "not done"
    python tutorials/grade.py my/02_gpt.py my/05_zero.py    # a student's edited copies
    python tutorials/grade.py tutorials/solutions/*.py      # the reference solutions: all pass
    python tutorials/grade.py submissions/                  # a folder of students: one line each
    python tutorials/grade.py submissions/ --json           # the same, as one JSON object

What is graded. The exercises are read from the repository's own tutorials (tutorials/NN_*.py):
every `ex.check(N, check_x, fn)` call names exercise N, its check (imported from tutorials/harness/)
and the stub it grades, the function `fn` decorated with `@ex.stub`. Nothing is hard-coded here, so
an exercise added to a tutorial is graded the moment it exists; the checks are the harness's own,
run through `harness.run_check`, exactly as the tutorial runs them.

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
tutorial variable pulls in nothing. The kept statements run in a fresh namespace, in their order in
the file, compiled under the file's name so that an error points at the student's line; then the
check runs on the function. The tutorial's other cells (training runs, `mpiexec` launches, plots)
never run. Each exercise is extracted and executed on its own, so a broken helper of one exercise
does not fail the others.

Verdicts. "pass": the check passed. "not done": the function is missing, is unchanged from the
tutorial's stub (its syntax tree is compared, so comments and blank lines do not count), or still
raises NotImplementedError. "fail": the check found a wrong answer (its message says what was
expected), or the student's code raised, or ran longer than --timeout seconds (default 30). What a
student's code prints is swallowed so the table stays readable.

Time. No check launches mpiexec: the checks that need several ranks run them as threads in this
process (harness/tensor_parallel.run_ranks, harness/collectives.run_ring); only the tutorials'
demonstration cells launch mpiexec, and the grader never runs those. So every check runs, with no
--full switch: all exercises of tutorials 01-12 grade in about 2 s, imports included.

A folder of submissions. A FOLDER argument holds one subfolder per student (the subfolder's name is
the student's name) with that student's NN_name.py files; other files in FOLDER are ignored. Each
student is graded against every tutorial's exercises (a tutorial with no file counts as not done,
so every student has the same total), in a child process of its own: one student's code cannot
change what another's is graded with, and a crash or a hang (past --timeout per exercise) costs only
that student's line. One line per student: name, score, and which exercises are not done or fail.

Exit status: 0 when every exercise graded passes (for every student), 1 otherwise, 2 for a usage
error (a missing file, a file with no exercise, two files for one tutorial, an empty folder) or an
`ex.check` call in a tutorial that the grader cannot read.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib
import io
import json
import os
import re
import signal
import subprocess
import symtable
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

TUTORIALS = Path(__file__).resolve().parent
if str(TUTORIALS) not in sys.path:
    sys.path.insert(0, str(TUTORIALS))  # `import harness`, as the tutorials do

from harness import run_check, title  # noqa: E402

TUTORIAL_FILE = re.compile(r"^(\d\d)_\w+\.py$")


class UsageError(Exception):
    """A problem with the arguments, or a tutorial the grader cannot read (exit status 2), in one line."""


class _OutOfTime(BaseException):  # a BaseException: a student's `except Exception` cannot swallow it
    pass


# ------------------------------------------------------------------------------------------------
# The exercises, read from the repository's tutorials
# ------------------------------------------------------------------------------------------------

@dataclass
class Exercise:
    tutorial: str  # "02_gpt"
    number: int
    function: str  # the stub's name, which the student's function must have
    check: object  # the harness's check function
    stub: str  # ast.dump of the stub, decorators removed: an answer equal to it is not done

    @property
    def title(self) -> str:
        return title(self.check) if self.check else self.function


def _strip_stub_decorator(node: ast.FunctionDef) -> ast.FunctionDef:
    node.decorator_list = [d for d in node.decorator_list if not ast.unparse(d).endswith(".stub")]
    return node


def exercises_of(path: Path) -> list[Exercise]:
    """The exercises of one tutorial, in order: from its `ex.check(N, check, stub)` calls."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    checks = {}  # check name -> the harness module that defines it
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness"):
            checks.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
    stubs = {node.name: ast.dump(_strip_stub_decorator(node)) for node in tree.body
             if isinstance(node, ast.FunctionDef)
             and any(ast.unparse(d).endswith(".stub") for d in node.decorator_list)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "ex.check"):
            continue
        number, check, function = (node.args + [None] * 3)[:3]
        if not (isinstance(number, ast.Constant) and isinstance(function, ast.Name)):
            raise UsageError(f"{path.name}:{node.lineno}: cannot read `{ast.unparse(node)}` "
                             "(the grader expects ex.check(N, check_name, function_name))")
        resolved = None  # a check this grader cannot find fails loudly below, never drops the exercise
        if isinstance(check, ast.Name) and check.id in checks:
            module, name = checks[check.id]
            resolved = getattr(importlib.import_module(module), name, None)
        found.append(Exercise(path.stem, number.value, function.id, resolved, stubs.get(function.id, "")))
    return sorted(found, key=lambda e: e.number)


def all_exercises() -> dict[str, list[Exercise]]:
    """Every tutorial's exercises, by tutorial name ("01_autograd": [...]), tutorials in order."""
    return {path.stem: exercises_of(path) for path in sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))}


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
            _strip_stub_decorator(node)
    return ast.Module(body=future + kept, type_ignores=[])


def _last_def(tree: ast.Module, function: str) -> ast.FunctionDef | None:
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
    return defs[-1] if defs else None


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


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise _OutOfTime in the main thread after `seconds` (SIGALRM; no limit where there is none)."""
    usable = (seconds > 0 and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())  # where signals can be handled
    if usable:
        def ring(signum, frame):
            raise _OutOfTime

        previous = signal.signal(signal.SIGALRM, ring)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if usable:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def grade_exercise(exercise: Exercise, tree: ast.Module | None, path: Path, timeout: float) -> Grade:
    """Grade one exercise against the parsed file `tree` (None: no file for this tutorial)."""
    def grade(result: str, message: str = "") -> Grade:
        return Grade(exercise.tutorial, exercise.number, exercise.function, exercise.title, result, message,
                     str(path) if path else "")

    if exercise.check is None:
        return grade("fail", f"the grader cannot find exercise {exercise.number}'s check in {exercise.tutorial}.py "
                             "(it reads `from harness... import check_x` and `ex.check(N, check_x, function)`)")
    node = _last_def(tree, exercise.function) if tree is not None else None
    if node is None:
        where = f"{path.name} does not define {exercise.function}" if tree is not None else "no file for this tutorial"
        return grade("not done", where)
    if ast.dump(_strip_stub_decorator(_copy(node))) == exercise.stub:
        return grade("not done", f"{exercise.function} is still the tutorial's stub")
    module = extract(_copy(tree), exercise.function)
    namespace = {"__name__": f"graded_{exercise.tutorial}", "__file__": str(path)}
    quiet = io.StringIO()
    try:
        with _time_limit(timeout), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            try:
                exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - the student's definitions only
            except Exception as exc:  # noqa: BLE001 - reported as the student's error
                line = getattr(exc, "lineno", None) or _line_of(exc, path)
                return grade("fail", f"defining {exercise.function} raised {type(exc).__name__}: {exc}"
                             + (f" (at {path.name}:{line})" if line else ""))
            result = run_check(exercise.check, namespace[exercise.function])
    except _OutOfTime:
        return grade("fail", f"{exercise.function} ran longer than {timeout:g} s (--timeout)")
    except (SystemExit, GeneratorExit) as exc:  # a student's sys.exit() must not end the grading
        return grade("fail", f"{exercise.function} raised {type(exc).__name__}")
    verdict = {"correct": "pass", "not done": "not done", "wrong": "fail", "error": "fail"}[result.status]
    return grade(verdict, result.message)


def _copy(node):
    return copy.deepcopy(node)  # keeps line numbers: errors point at the student's line


def _line_of(exc: BaseException, path: Path) -> int | None:
    import traceback  # noqa: PLC0415

    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
    return lines[-1] if lines else None


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


def grade_files(paths: list[Path], timeout: float, every_tutorial: bool = False) -> list[Grade]:
    """Grade the files: every exercise of the tutorials they answer (of all tutorials with every_tutorial)."""
    exercises = all_exercises()
    chosen = assign(paths, exercises)
    grades = []
    for tutorial, listed in exercises.items():
        path = chosen.get(tutorial)
        if path is None and not every_tutorial:
            continue
        tree, broken = None, ""
        if path is not None:
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            except SyntaxError as exc:
                broken = f"{path.name} does not parse: {exc.msg} (line {exc.lineno})"
        for exercise in listed:
            if broken:
                grades.append(Grade(tutorial, exercise.number, exercise.function, exercise.title, "fail", broken,
                                    str(path)))
            else:
                grades.append(grade_exercise(exercise, tree, path, timeout))
    return grades


def summary(grades: list[Grade]) -> dict:
    passed = sum(g.result == "pass" for g in grades)
    return {"score": passed, "total": len(grades), "all_pass": bool(grades) and passed == len(grades),
            "results": [asdict(g) for g in grades]}


def print_table(grades: list[Grade]) -> None:
    rows = [(g.tutorial, str(g.exercise), g.function, g.result, _first_line(g.message)) for g in grades]
    header = ("tutorial", "#", "exercise", "result", "message")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    passed = sum(g.result == "pass" for g in grades)
    print(f"\nscore: {passed}/{len(grades)}")


# ------------------------------------------------------------------------------------------------
# A folder of submissions: one child process per student
# ------------------------------------------------------------------------------------------------

def grade_student(folder: Path, timeout: float, limit: float) -> dict:
    """{"student", "score", "total", "results"} or {"student", "error"}: one child grader run."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix == ".py")
    command = [sys.executable, str(Path(__file__).resolve()), "--json", "--every-tutorial",
               "--timeout", str(timeout), *map(str, files)]
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


def grade_folder(folder: Path, timeout: float) -> list[dict]:
    students = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    if not students:
        raise UsageError(f"{folder}: no submissions (one subfolder per student)")
    n_exercises = sum(len(listed) for listed in all_exercises().values())
    limit = 60 + timeout * n_exercises
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda s: grade_student(s, timeout, limit), students))


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
# The capstone: a pipeline schedule of the student's own (docs/capstone.md)
# ------------------------------------------------------------------------------------------------

VERIFY_FLAGS = ["--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "8",
                "--steps", "2"]


def grade_capstone(spec: str, pp: int, micro_batches: int, bubble_below: float | None,
                   run_verify: bool = True, timeout: float = 120) -> list[Grade]:
    """Three grades for the schedule generator `spec` (FILE.py:FUNCTION or MODULE:FUNCTION):

        valid        it builds for (pp, micro_batches) and refimpl's validator accepts it
                     (every action once, placement, local order, messages paired, no deadlock)
        target       its simulated bubble fraction at F = I = W = 1 is below `bubble_below`
                     (default: 1F1B's at the same pp and micro-batches: the schedule must beat it)
        equivalent   `mpiexec -n 2 python -m refimpl verify --pp 2 --schedule SPEC` passes: trained
                     over MPI it equals single-process training (float64, rtol 1e-10)
    """
    from fractions import Fraction  # noqa: PLC0415

    from refimpl.parallel.pipeline import Costs, build, simulate  # noqa: PLC0415
    from refimpl.tools.plugin import build_schedule  # noqa: PLC0415

    def grade(number, title, result, message):
        return Grade("capstone", number, title, title, result, message, spec)

    grades = []
    try:
        schedule = build_schedule(spec, pp, micro_batches)  # a plug-in: the core's build() has only the built-ins
    except Exception as exc:  # noqa: BLE001 - the student's schedule, reported in one line
        grades.append(grade(1, "valid", "fail", _first_line(str(exc)) or type(exc).__name__))
        return grades + [grade(2, "bubble target", "not done", "needs a valid schedule"),
                         grade(3, "equivalent to one process", "not done", "needs a valid schedule")]
    grades.append(grade(1, "valid", "pass", f"validated for pp={pp}, {micro_batches} micro-batches"))
    costs = Costs(F=1, I=1, W=1)
    bubble = simulate(schedule, costs, steady_state=False).bubble_fraction
    reference = simulate(build("1f1b", pp, micro_batches), costs, steady_state=False).bubble_fraction
    target = Fraction(str(bubble_below)) if bubble_below is not None else reference
    against = f"the target {float(target):.4f}" if bubble_below is not None else f"1F1B's {float(reference):.4f}"
    ok = bubble < target
    grades.append(grade(2, "bubble target", "pass" if ok else "fail",
                        f"bubble {float(bubble):.4f} {'<' if ok else '>='} {against} (F = I = W, pp={pp}, "
                        f"{micro_batches} micro-batches)"))
    if not run_verify:
        grades.append(grade(3, "equivalent to one process", "not done", "--no-verify"))
        return grades
    from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher  # noqa: PLC0415

    mpiexec = find_mpiexec()
    if mpiexec is None:
        grades.append(grade(3, "equivalent to one process", "fail", "no mpiexec found (pip install mpich)"))
        return grades
    command = [mpiexec, "-n", "2", sys.executable, "-m", "refimpl", "verify", "--pp", "2", "--schedule", spec,
               *VERIFY_FLAGS]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=without_launcher(),
                              cwd=Path.cwd())
        lines = (done.stdout + done.stderr).strip().splitlines()
        message = next((line for line in reversed(lines) if "PASS" in line or "FAIL" in line or "error" in line),
                       lines[-1] if lines else "")
        result = "pass" if done.returncode == 0 else "fail"
    except subprocess.TimeoutExpired:
        result, message = "fail", f"verify did not finish in {timeout:g} s"
    grades.append(grade(3, "equivalent to one process", result, f"verify --pp 2, 2 ranks: {message.strip()}"))
    return grades


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Grade the tutorials' exercises in a student's files, or in a folder of submissions "
                    "(one subfolder per student). Default: the tutorials themselves.")
    parser.add_argument("paths", nargs="*", metavar="FILE_OR_FOLDER",
                        help="NN_name.py files (an edited tutorial, or only the exercise functions), or folders "
                             "of submissions")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--timeout", type=float, default=30, help="seconds one exercise may run (default 30)")
    parser.add_argument("--every-tutorial", action="store_true",
                        help="grade every tutorial's exercises; those with no file are not done")
    parser.add_argument("--capstone", metavar="FILE.py:FUNCTION",
                        help="grade a pipeline schedule of the student's own (docs/capstone.md): valid, its bubble "
                             "below the target, equal to one process under verify")
    parser.add_argument("--pp", type=int, default=4,
                        help="capstone: pipeline ranks to validate and simulate (default 4)")
    parser.add_argument("--micro-batches", type=int, default=8, help="capstone: micro-batches (default 8)")
    parser.add_argument("--bubble-below", type=float,
                        help="capstone: the bubble fraction to beat (default: 1F1B's at the same pp and micro-batches)")
    parser.add_argument("--no-verify", action="store_true", help="capstone: skip the mpiexec verify run")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.capstone:
        if args.paths:
            print("grade.py: give either --capstone or files, not both", file=sys.stderr)
            return 2
        grades = grade_capstone(args.capstone, args.pp, args.micro_batches, args.bubble_below, not args.no_verify,
                                timeout=max(args.timeout, 120))
        report = summary(grades)
        if args.json:
            print(json.dumps({**report, "seconds": round(time.perf_counter() - start, 2)}))
        else:
            print_table(grades)
        return 0 if report["all_pass"] else 1
    paths = [Path(p) for p in args.paths] or sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
    try:
        folders = [p for p in paths if p.is_dir()]
        if folders and len(folders) < len(paths):
            raise UsageError("give either files or folders of submissions, not both")
        if folders:
            reports = [r for folder in folders for r in grade_folder(folder, args.timeout)]
            ok = all(r.get("all_pass") for r in reports)
            if args.json:
                seconds = round(time.perf_counter() - start, 2)
                print(json.dumps({"students": reports, "all_pass": ok, "seconds": seconds}))
            else:
                width = max(len(r["student"]) for r in reports)
                for report in reports:
                    print(student_line(report, width))
            return 0 if ok else 1
        grades = grade_files(paths, args.timeout, args.every_tutorial)
    except UsageError as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}))
        print(f"grade.py: {exc}", file=sys.stderr)
        return 2
    report = summary(grades)
    if args.json:
        print(json.dumps({**report, "seconds": round(time.perf_counter() - start, 2)}))
    else:
        print_table(grades)
    return 0 if report["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
