"""The course's registry: its exercises, read from the tutorials, and what course.toml says of them.

The exercises are read from the tutorials themselves (tutorials/NN_*.py): every `ex.check(N,
check_x, fn)` call names exercise N of that tutorial, its check (imported from tutorials/harness/)
and the stub it grades, the function `fn` decorated with `@ex.stub`. Nothing is listed here, so
a tutorial added as tutorials/NN_name.py, with its checks in tutorials/harness/ and its solutions in
tutorials/solutions/NN_name.py, is graded the moment it exists. tutorials/course.toml then gives
each exercise ("NN.k") its points (default `course.default_points`) and the functions that answer it
directly (`forbidden`, default none), and tutorials/syllabus.py needs one SYLLABUS entry for it.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

TUTORIALS = Path(__file__).resolve().parents[1]
CONFIG = TUTORIALS / "course.toml"


class UsageError(Exception):
    """A problem with the arguments, or a tutorial the grader cannot read (exit status 2), in one line."""


@dataclass
class Exercise:
    tutorial: str  # "02_gpt"
    number: int
    function: str  # the stub's name, which the student's function must have
    check: object  # the harness's check function
    stub: str  # ast.dump of the stub, decorators removed: an answer equal to it is not done
    points: float = 1
    forbidden: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.tutorial[:2]}.{self.number}"

    @property
    def title(self) -> str:
        from harness import title  # noqa: PLC0415 - the harness imports refimpl; keep this module light

        return title(self.check) if self.check else self.function


def config() -> dict:
    """tutorials/course.toml, parsed ({} where there is none)."""
    if not CONFIG.is_file():
        return {}
    try:
        with open(CONFIG, "rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{CONFIG}: {exc} (fix the course configuration)") from None


def strip_stub_decorator(node: ast.FunctionDef) -> ast.FunctionDef:
    node.decorator_list = [d for d in node.decorator_list if not ast.unparse(d).endswith(".stub")]
    return node


def exercises_of(path: Path, settings: dict | None = None) -> list[Exercise]:
    """The exercises of one tutorial, in order: from its `ex.check(N, check, stub)` calls."""
    settings = config() if settings is None else settings
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    checks = {}  # check name -> the harness module that defines it
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness"):
            checks.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
    stubs = {node.name: ast.dump(strip_stub_decorator(node)) for node in tree.body
             if isinstance(node, ast.FunctionDef)
             and any(ast.unparse(d).endswith(".stub") for d in node.decorator_list)}
    default = settings.get("course", {}).get("default_points", 1)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "ex.check"):
            continue
        number, check, function = (node.args + [None] * 3)[:3]
        if not (isinstance(number, ast.Constant) and isinstance(function, ast.Name)):
            raise UsageError(f"{path.name}:{node.lineno}: cannot read `{ast.unparse(node)}` "
                             "(the grader expects ex.check(N, check_name, function_name))")
        resolved = None  # a check this grader cannot find fails loudly, never drops the exercise
        if isinstance(check, ast.Name) and check.id in checks:
            module, name = checks[check.id]
            resolved = getattr(importlib.import_module(module), name, None)
        entry = settings.get("exercise", {}).get(f"{path.name[:2]}.{number.value}", {})
        found.append(Exercise(path.stem, number.value, function.id, resolved, stubs.get(function.id, ""),
                              entry.get("points", default), list(entry.get("forbidden", []))))
    return sorted(found, key=lambda e: e.number)


def all_exercises() -> dict[str, list[Exercise]]:
    """Every tutorial's exercises, by tutorial name ("01_autograd": [...]), tutorials in order."""
    settings = config()
    return {path.stem: exercises_of(path, settings) for path in sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))}


def load_exercises() -> list[Exercise]:
    return [e for listed in all_exercises().values() for e in listed]
