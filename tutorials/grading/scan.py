"""Flags for the instructor, never a verdict: copied code and code that reaches around the grader.

Similarity. The exercise's code (its function and the helpers it uses, as the grader extracts
them) is compared token by token with the reference solution's function of the same name and with
every function the exercise forbids (course.toml): Python's tokenizer, comments and docstrings
dropped, every identifier the same token, so renaming variables does not hide a copy; difflib's
ratio (2·matches / total tokens) at or above `course.similarity_flag` (0.8) is flagged, with the
source. Short code (fewer than MIN_TOKENS tokens) is not compared: two correct one-liners look
alike however they were written.

Constructs. Names that a student's code needs to reach around the grader -- to read another
file, load code, or touch the interpreter's machinery (`open`, `exec`, `importlib`, `__code__`,
`sys.modules`, `gc`, `inspect`, `ctypes`, `setprofile`, ...) -- are flagged where they occur. An
exercise never needs them; a flag is a reason to read the submission, not proof.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import io
import textwrap
import tokenize
from pathlib import Path

TUTORIALS = Path(__file__).resolve().parents[1]
MIN_TOKENS = 40
SUSPICIOUS = {"open", "exec", "eval", "compile", "__import__", "importlib", "reload", "runpy", "gc", "inspect",
              "ctypes", "subprocess", "system", "_exit", "setprofile", "settrace", "modules", "__code__",
              "__globals__", "__builtins__", "__closure__", "__dict__", "__subclasses__", "getattr", "setattr",
              "globals", "locals", "vars", "signal", "pickle", "marshal", "solutions", "harness", "grading",
              "spec_from_file_location", "exec_module", "path_hooks", "meta_path"}


def tokens(source: str) -> list[str]:
    """The code's tokens, identifiers as one token 'N', comments, docstrings and layout dropped."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline):
            if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
                continue
            if tok.type == tokenize.STRING and out and out[-1] in (":", "N"):
                continue  # a docstring
            out.append("N" if tok.type == tokenize.NAME and tok.string not in KEYWORDS else tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return []
    return out


KEYWORDS = {"def", "return", "for", "in", "if", "else", "elif", "while", "and", "or", "not", "lambda", "None",
            "True", "False", "import", "from", "as", "with", "yield", "class", "try", "except", "raise", "is",
            "break", "continue", "pass", "global", "nonlocal", "assert", "del", "finally"}


def similarity(a: str, b: str) -> float:
    ta, tb = tokens(a), tokens(b)
    if min(len(ta), len(tb)) < MIN_TOKENS:
        return 0.0
    return difflib.SequenceMatcher(None, ta, tb, autojunk=False).ratio()


def _solution_source(exercise) -> str | None:
    path = TUTORIALS / "solutions" / f"{exercise.tutorial}.py"
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == exercise.function:
            return ast.get_source_segment(text, node)
    return None


def _forbidden_source(name: str) -> str | None:
    module, _, qualname = name.partition(":")
    try:
        value = importlib.import_module(module)
        for part in qualname.split("."):
            value = getattr(value, part)
        return inspect.getsource(value)
    except Exception:  # noqa: BLE001 - a name without source is not compared
        return None


def flags(module: ast.Module, exercise, settings: dict) -> list[str]:
    """The flags of one exercise's extracted code."""
    found = []
    source = ast.unparse(module)
    threshold = float(settings.get("course", {}).get("similarity_flag", 0.8))
    references = [(f"solutions/{exercise.tutorial}.py:{exercise.function}", _solution_source(exercise))]
    references += [(name.replace(":", "."), _forbidden_source(name)) for name in exercise.forbidden]
    for where, reference in references:
        if reference:
            ratio = similarity(source, reference)
            if ratio >= threshold:
                found.append(f"similar to {where} ({ratio:.2f})")
    names = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(part for alias in node.names for part in alias.name.split("."))
            names.update((node.module or "").split(".") if isinstance(node, ast.ImportFrom) else [])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(w for w in ("solutions", "harness", "grading") if w in node.value)
    suspicious = sorted(names & SUSPICIOUS)
    if suspicious:
        found.append(f"uses {', '.join(suspicious)}")
    return found
