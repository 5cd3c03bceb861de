"""The student's process: runs a student's exercise code and nothing else, for tutorials/grade.py.

    python -I tutorials/grading/child.py COPY LOG        (started by the grader, never by hand)

COPY is the student copy of the course (tutorials/ without solutions or reference answers, and
refimpl/); LOG is the file that receives whatever the student's code prints. The grader talks to
this process through stdin and stdout (tutorials/grading/wire.py: plain data and handles); before
any student code runs, this process moves that pipe to other descriptors and points descriptors
0, 1 and 2 at /dev/null and LOG, so a print cannot corrupt the pipe.

Import path. The student's code sees the student copy only: COPY/tutorials (for `import harness`)
and COPY (for `import refimpl`) come first on sys.path, any editable-install finder that would
resolve refimpl to the instructor's checkout is removed, and the environment is the grader's
minimal one. This keeps the answers out of the student's imports; it does not stop a process from
opening a file by its path -- that takes the operating system (docs/course.md: a separate user or
a container, `grade.py --sandbox`).

Tripwires. For each exercise the grader names the functions that answer it directly (course.toml:
refimpl's own implementation, the harness's reference answers, the solutions); `Session.begin`
replaces each one's code with a tripwire that records the call and then does what the function
did. `Session.end` reports the calls recorded, any tripwire no longer in place (a student's code
that put the original back or reloaded the module), and any function loaded from a solutions
file. The grader, not this process, turns a report into a verdict. Everything here runs in the
student's process and a student's code can tamper with it; docs/course.md states what that leaves
(a tampering is reported when it is not undone before the exercise ends, and the static scan of
the submission flags the constructs it needs).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import threading
import types
from pathlib import Path

TRIPWIRE_NAME = "__grading_tripwire__"


def _template(*args, **kwargs):
    return __grading_tripwire__("KEY", args, kwargs)  # noqa: F821 - a global of the tripwired function's module


class Tripwires:
    """The functions of one exercise that answer it, each replaced by a recording copy."""

    def __init__(self, names: list[str]) -> None:
        self.calls: list[str] = []
        self.graded = ""
        self.installed: dict[str, tuple] = {}  # name -> (function, its original code, the tripwire code)
        self.unknown: list[str] = []
        self.wrapped: dict[str, tuple] = {}  # name -> (the original callable, the tripwire in its place)
        for name in names:
            function = _resolve(name)
            if not isinstance(function, types.FunctionType) or function.__closure__:
                self._wrap(name, function)
                continue
            original = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                          function.__defaults__, function.__closure__)
            original.__kwdefaults__ = function.__kwdefaults__
            code = _template.__code__.replace(
                co_consts=tuple(name if c == "KEY" else c for c in _template.__code__.co_consts),
                co_name=function.__code__.co_name, co_qualname=function.__code__.co_qualname)
            function.__globals__.setdefault(TRIPWIRE_NAME, _dispatch)
            _ORIGINALS[name] = (original, self)
            self.installed[name] = (function, function.__code__, code)
            function.__code__ = code

    def _wrap(self, name: str, value) -> None:
        """A callable that is not a plain function (a cached or wrapped one): replaced in its module."""
        module, _, qualname = name.partition(":")
        if value is None or not callable(value) or "." in qualname:
            self.unknown.append(name)
            return

        def tripwire(*args, **kwargs):
            self.calls.append(name)
            return value(*args, **kwargs)

        setattr(sys.modules[module], qualname, tripwire)
        self.wrapped[name] = (value, tripwire)

    def report(self) -> dict:
        tampered = [name for name, (_, tripwire) in self.wrapped.items() if _resolve(name) is not tripwire]
        for name, (function, _, code) in self.installed.items():
            now = _resolve(name)
            if function.__code__ is not code or now is not function:
                tampered.append(name)
        return {"calls": sorted(set(self.calls)), "tampered": tampered, "unknown": self.unknown,
                "solution_code": _solution_code(self.graded)}

    def remove(self) -> None:
        for name, (function, code, _) in self.installed.items():
            function.__code__ = code
            _ORIGINALS.pop(name, None)
        for name, (value, _) in self.wrapped.items():
            module, _, qualname = name.partition(":")
            setattr(sys.modules[module], qualname, value)


_ORIGINALS: dict[str, tuple] = {}


def _dispatch(name, args, kwargs):
    original, wires = _ORIGINALS[name]
    wires.calls.append(name)
    return original(*args, **kwargs)


def _resolve(name: str):
    """'refimpl.memory:model_state_bytes' or 'pkg.mod:Class.method' -> the object, or None."""
    module, _, qualname = name.partition(":")
    try:
        value = importlib.import_module(module)
        for part in qualname.split("."):
            value = getattr(value, part)
    except Exception:  # noqa: BLE001 - a name that does not resolve is reported as unknown
        return None
    return value


def _solution_code(graded: str = "") -> list[str]:
    """Functions in this process loaded from a solutions file (other than the file being graded). The
    harness's reference answers are not in the student copy; a call to what stands in their place
    is a tripwire of the exercises they answer."""
    found = set()
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType):
            filename = obj.__code__.co_filename.replace("\\", "/")
            if filename == graded:
                continue
            if "/solutions/" in filename:
                found.add(f"{Path(filename).name}:{obj.__name__}")
    return sorted(found)


class Session:
    """What the grader calls in this process: begin an exercise, end it."""

    def __init__(self, peer) -> None:
        self.peer = peer
        self.wires: Tripwires | None = None

    def begin(self, text: str, filename: str, function: str, forbidden: list):
        """Install the exercise's tripwires, run the kept definitions, return the student's function."""
        self.wires = Tripwires(list(forbidden))
        self.wires.graded = filename.replace("\\", "/")
        namespace = {"__name__": "graded", "__file__": filename, "__builtins__": __builtins__}
        exec(compile(text, filename, "exec"), namespace)  # noqa: S102 - the student's definitions, in the student's process
        if function not in namespace:
            raise NameError(f"{function} is not defined")
        return namespace[function]

    def evaluate(self, module: str, evaluator: str, function, *args):
        """`module.evaluator(function, *args)`: run the student's live answer (a loss Tensor, autograd
        Function classes) on the inputs the grader sent, and return what it computed as plain data.
        The check that judges it runs in the grader (harness.in_student_process)."""
        if not (module.startswith("harness.") and evaluator.startswith("evaluate_")):
            raise ValueError(f"{module}.{evaluator} is not an evaluator of the harness")
        return getattr(importlib.import_module(module), evaluator)(function, *args)

    def capstone(self, path: str, function: str, sizes: list, forbidden: list) -> dict:
        """The student's schedule generator at every (pp, micro-batches) of `sizes`: {"pp,m": its
        Schedule (sent by value) or the one-line error it raised}; its tripwires are the built-ins."""
        import runpy  # noqa: PLC0415

        self.wires = Tripwires(list(forbidden))
        self.wires.graded = str(Path(path).resolve())
        generator = runpy.run_path(path, run_name="capstone")[function]
        tables = {}
        for pp, m in sizes:
            try:
                tables[f"{pp},{m}"] = generator(pp, m, None)
            except Exception as exc:  # noqa: BLE001 - the student's refusal or bug, in one line
                text = str(exc).splitlines()[0] if str(exc) else ""
                tables[f"{pp},{m}"] = f"{type(exc).__name__}: {text}"
        return tables

    def end(self) -> dict:
        report = self.wires.report() if self.wires else {"calls": [], "tampered": [], "unknown": [],
                                                          "solution_code": _solution_code()}
        if self.wires:
            self.wires.remove()
        self.wires = None
        self.peer.forget(keep=1)
        return report


def _isolate_imports(copy: Path) -> None:
    """sys.path: the student copy first; no finder that resolves refimpl to another checkout."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                        and "editable" not in getattr(f, "__name__", "").lower()]
    sys.path[:] = [str(copy / "tutorials"), str(copy)] + [p for p in sys.path if p and "site-packages" in p
                                                          or p.endswith((".zip", "lib-dynload"))
                                                          or Path(p).name.startswith("python3")]
    for name in [m for m in sys.modules if m == "refimpl" or m.startswith("refimpl.")]:
        del sys.modules[name]


def main() -> None:
    copy, log = Path(sys.argv[1]).resolve(), sys.argv[2]
    reader = os.fdopen(os.dup(0), "rb", buffering=0)
    writer = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    _isolate_imports(copy)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import wire  # noqa: PLC0415 - after the import path is the student copy's

    done = threading.Event()
    session = Session(None)
    peer = wire.Peer(reader, writer, trusted=True, first=session)  # handle 1: the session
    session.peer = peer
    peer.thread.join()
    done.set()
    os._exit(0)


if __name__ == "__main__":
    main()
