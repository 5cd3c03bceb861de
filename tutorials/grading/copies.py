"""The student copy and the instructor copy of the course.

    python tutorials/grade.py --build-copies OUT     # OUT/student and OUT/instructor

The instructor copy is the course as it is in this repository: tutorials (with solutions/, the
harness's reference answers, the hidden checks and the course's answer key) and refimpl. The student
copy is what students get and what a student's code runs against while it is graded:

    kept         the tutorials, refimpl/, the harness's checks (the public checks, fixed cases),
                 tutorials/grade.py and tutorials/grading/ (so a student can grade their own work)
    left out     tutorials/solutions/, tutorials/grading/hidden.py (the drawn cases),
                 tutorials/course.toml's model answers (the rubrics stay: students see how they are marked)
    replaced     every `reference_*` and `measured_*` function of the harness: its body is gone, and
                 it answers only the inputs the public checks give it, from a table recorded by
                 running those checks with the reference solutions (harness/recorded.json); any
                 other input is a clear error

So the student copy holds the expected outputs of the public checks' fixed cases -- what any public
test shows -- and no function that computes an answer for an input of the student's choosing.
The instructor's run adds drawn cases (hidden.py) that no table covers.
"""

from __future__ import annotations

import ast
import json
import shutil
import tomllib
from pathlib import Path

TUTORIALS = Path(__file__).resolve().parents[1]
REPO = TUTORIALS.parent
INSTRUCTOR_ONLY = ("solutions", "grading/hidden.py")
REFERENCE_PREFIXES = ("reference_", "measured_")
RECORDED = "recorded.json"


def _ignore(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n in ("__pycache__", ".pytest_cache") or n.endswith((".pyc", ".log"))]


def reference_functions(source: str) -> list[ast.FunctionDef]:
    return [node for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith(REFERENCE_PREFIXES)]


def strip_references(source: str, module: str) -> str:
    """`source` of a harness module with each reference function's lines replaced by a table lookup."""
    lines = source.splitlines()
    stubs = []
    for node in reference_functions(source):
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        for i in range(first - 1, node.end_lineno):
            lines[i] = ""
        lines[first - 1] = (f"def {node.name}(*args, **kwargs):  # the public cases' answers only "
                            f"(tutorials/grading/copies.py)\n    return _recorded({module + '.' + node.name!r}, "
                            "args, kwargs)")
        stubs.append(node.name)
    if stubs:
        lines.append("\nfrom harness.recorded import recorded as _recorded  # noqa: E402")
    return "\n".join(lines) + "\n"


def strip_answers(toml_text: str) -> str:
    """course.toml without its model answers (lines `model_answer = ...` and their multi-line strings)."""
    out, skipping = [], False
    for line in toml_text.splitlines():
        if skipping:
            skipping = '"""' not in line
            continue
        if line.strip().startswith("model_answer"):
            skipping = line.count('"""') == 1
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def build_student_copy(destination: Path, recorded: dict | None = None, strip: bool = True) -> Path:
    """Write the student copy at `destination` (created; must not exist or be empty). Returns it."""
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "refimpl", destination / "refimpl", ignore=_ignore, dirs_exist_ok=True)
    target = destination / "tutorials"
    shutil.copytree(TUTORIALS, target, ignore=_ignore, dirs_exist_ok=True)
    for name in INSTRUCTOR_ONLY:
        path = target / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for path in sorted((target / "harness").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        if strip and reference_functions(source):
            path.write_text(strip_references(source, path.stem), encoding="utf-8")
    if not (target / "harness" / "recorded.py").exists():
        (target / "harness" / "recorded.py").write_text(RECORDED_MODULE, encoding="utf-8")
    if recorded is not None or (TUTORIALS / "solutions").is_dir():  # else: a student copy's own table, kept
        (target / "harness" / RECORDED).write_text(json.dumps(recorded if recorded is not None else record()),
                                                    encoding="utf-8")
    course = target / "course.toml"
    if course.exists():
        course.write_text(strip_answers(course.read_text(encoding="utf-8")), encoding="utf-8")
    return destination


def build_instructor_copy(destination: Path) -> Path:
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "refimpl", destination / "refimpl", ignore=_ignore, dirs_exist_ok=True)
    shutil.copytree(TUTORIALS, destination / "tutorials", ignore=_ignore, dirs_exist_ok=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, destination / name)
    return destination


def record(only: set[str] | None = None) -> dict:
    """{"module.reference_x": [[encoded args, encoded result], ...]}: each reference function's calls
    while every public check runs on its reference solution (in this, the instructor's, process)."""
    import importlib  # noqa: PLC0415 - only when a student copy is built
    import runpy  # noqa: PLC0415

    from harness import run_check  # noqa: PLC0415

    from .wire import canonical  # noqa: PLC0415
    table: dict[str, list] = {}
    modules = {}
    for path in sorted((TUTORIALS / "harness").glob("*.py")):
        names = [n.name for n in reference_functions(path.read_text(encoding="utf-8"))]
        if names:
            modules[path.stem] = (importlib.import_module(f"harness.{path.stem}"), names)
    originals = {}
    for stem, (module, names) in modules.items():
        for name in names:
            original = getattr(module, name)
            originals[(module, name)] = original

            def recorder(*args, _original=original, _key=f"{stem}.{name}", **kwargs):
                result = _original(*args, **kwargs)
                table.setdefault(_key, []).append([canonical([list(args), kwargs]), canonical(result)])
                return result

            setattr(module, name, recorder)
    try:
        from grading.course import load_exercises  # noqa: PLC0415
        for exercise in load_exercises():
            if only is not None and exercise.key not in only:
                continue
            solutions = runpy.run_path(str(TUTORIALS / "solutions" / f"{exercise.tutorial}.py"))
            run_check(exercise.check, solutions[exercise.function])
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)
    return {key: [list(pair) for pair in {json.dumps(p): p for p in pairs}.values()] for key, pairs in table.items()}


RECORDED_MODULE = '''"""The answers of the harness's reference functions for the public checks' inputs, recorded
from the instructor copy (tutorials/grading/copies.py). Any other input has no answer here."""

import json
from pathlib import Path

from . import Wrong

_TABLE = json.loads((Path(__file__).parent / "recorded.json").read_text(encoding="utf-8"))


def _close(a, b) -> bool:
    """Equal plain data, floats to 1e-9 (BLAS may sum in another order on another machine)."""
    import numpy as np  # noqa: PLC0415

    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (np.ndarray, np.generic, float)) or isinstance(b, (np.ndarray, np.generic, float)):
        try:
            return np.shape(a) == np.shape(b) and bool(np.allclose(a, b, rtol=1e-9, atol=1e-12, equal_nan=True))
        except TypeError:
            return bool(np.array_equal(a, b))
    return type(a) is type(b) and a == b


def recorded(name, args, kwargs):
    import sys  # noqa: PLC0415
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grading"))
    from wire import canonical, from_canonical  # noqa: PLC0415
    key = canonical([list(args), dict(kwargs)])
    for given, answer in _TABLE.get(name, []):
        if given == key:
            return from_canonical(answer)
    wanted = from_canonical(key)
    for given, answer in _TABLE.get(name, []):
        if _close(from_canonical(given), wanted):
            return from_canonical(answer)
    raise Wrong(f"this copy of the course has the reference answers of the public checks' cases only, and the "
                f"check asked {name} about another input (probably one your answer produced): fix what the "
                f"check's message says first; the instructor's grader computes every case")
'''


def course_config() -> dict:
    with open(TUTORIALS / "course.toml", "rb") as handle:
        return tomllib.load(handle)
