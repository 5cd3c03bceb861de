"""The tutorials' exercise harness: stubs, reference solutions and checks.

Every tutorial ends with exercises. An exercise is a function whose body the student writes (it
starts as a stub that raises NotImplementedError) and a check, in one of this package's modules,
that runs the student's function on small inputs and compares it with refimpl's own
implementation. In a tutorial:

    from harness import Exercises
    from harness.collectives import check_ring_allgather

    ex = Exercises("03_collectives")

    @ex.stub
    def ring_allgather(link, buf):
        raise NotImplementedError("exercise 1")

    ex.check(1, check_ring_allgather, ring_allgather)   # prints: not done yet / wrong: ... / correct
    ex.summary()                                       # prints: 0 of 1 correct; not done yet: 1

A check never stops the notebook: it prints one of

    Exercise 1 (ring all-gather): not done yet -- ring_allgather still raises NotImplementedError ...
    Exercise 1 (ring all-gather): wrong -- with 3 ranks, rank 1 holds [...] but every rank should hold [...]
    Exercise 1 (ring all-gather): correct

Reference solutions live in tutorials/solutions/<tutorial>.py, one function per stub, with the
same names. With the environment variable REFIMPL_TUTORIAL_SOLUTIONS set (to 1 for the
repository's tutorials/solutions/, or to a directory), `@ex.stub` returns the solution instead of
the stub and a check that does not pass raises AssertionError; the test suite runs every tutorial
that way (tests/test_tutorials.py), and also calls every check on its unfilled stub, where it must
fail.

Checks raise `Wrong` with a sentence that says what was expected; `run_check` turns that, a
NotImplementedError, or any other exception from the student's code, into a `Result`.

Where it lives. The harness sits beside the tutorials (tutorials/harness/), not in the refimpl
package: it exists only for them, and it reads the reference solutions from the source checkout
(tutorials/solutions/). `python tutorials/NN_name.py` puts tutorials/ first on sys.path, and a
notebook opened in tutorials/ runs there, so `import harness` finds it; tests/test_tutorials.py
and docs/generate.py add tutorials/ to sys.path themselves. The checks import refimpl like any
other user of the library.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import refimpl
from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher

ENV = "REFIMPL_TUTORIAL_SOLUTIONS"
TUTORIALS = Path(__file__).resolve().parents[1]


class Wrong(AssertionError):
    """Raised by a check when the student's answer differs from refimpl's; the message says how."""


def plain(value):
    """`value` with NumPy scalars as plain Python numbers, inside lists, tuples and dicts too.

    NumPy 2's repr of a scalar is `np.float64(0.25)` or `np.int64(3)`; a message to a student shows
    `0.25` and `3` instead: `f"{plain(x)!r}"`, or `shown(x)`.
    """
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(plain(v) for v in value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    return value


def shown(value) -> str:
    """repr(value) for a message, with NumPy scalars written as plain numbers (see `plain`)."""
    return repr(plain(value))


def expect_close(got, expected, what: str, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """Raise Wrong unless `got` has `expected`'s shape and values (float64 tolerances by default)."""
    import numpy as np  # noqa: PLC0415 - keep `import harness` light

    if got is None:
        raise Wrong(f"{what}: got None")
    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape:
        raise Wrong(f"{what} has shape {got.shape}, expected {expected.shape}")
    if not np.allclose(got, expected, rtol=rtol, atol=atol):
        diff = np.abs(got.astype(np.float64) - expected)
        at = np.unravel_index(np.argmax(diff), diff.shape) if diff.ndim else ()
        raise Wrong(f"{what} differs: at index {tuple(int(i) for i in at)} you have {shown(got[at])}, "
                    f"expected {shown(expected[at])} (largest |difference| {float(diff.max()):.3g})")


def in_student_process(evaluator, function, *args):
    """`evaluator(function, *args)`, run where the student's function lives.

    For the answers that are live objects (a loss Tensor to call backward on, autograd Function
    classes): a check cannot receive them as plain data, so it sends inputs instead, and the
    evaluator (a harness function named `evaluate_*`) runs the student's object on them and returns
    what it computed as plain data: values, gradients, outputs. In a tutorial that is a plain call.
    When tutorials/grade.py grades, `function` is the grader's stand-in for the student's function,
    and the evaluator runs in the student's process (tutorials/grading/child.py) while the check,
    with its reference answers and its verdict, stays in the grader's."""
    there = getattr(function, "in_student_process", None)
    return there(evaluator, *args) if there is not None else evaluator(function, *args)


def plain_array(value, what: str):
    """`value` if it is a NumPy array (what an evaluator returns), else Wrong saying what it is."""
    import numpy as np  # noqa: PLC0415 - keep `import harness` light

    if not isinstance(value, np.ndarray):
        raise Wrong(f"{what}: expected an array, got {type(value).__name__}")
    return value


@dataclass
class Result:
    status: str  # "correct", "not done", "wrong" or "error"
    message: str

    @property
    def ok(self) -> bool:
        return self.status == "correct"


def solutions_dir() -> Path | None:
    """The directory of reference solutions selected by REFIMPL_TUTORIAL_SOLUTIONS, or None."""
    value = os.environ.get(ENV, "")
    if value in ("", "0"):
        return None
    path = TUTORIALS / "solutions" if value == "1" else Path(value)
    if not path.is_dir():
        raise FileNotFoundError(f"{ENV}={value}: no solutions directory at {path}")
    return path


def _student_frame(exc: BaseException) -> str:
    """'file:line in function' of the innermost frame of the student's code: outside refimpl and the
    harness if there is one (the error surfaced in a library function the student called), else
    outside the checks."""
    frames = traceback.extract_tb(exc.__traceback__)
    package, checks = str(Path(refimpl.__file__).parent), str(Path(__file__).parent)
    frames = [f for f in frames if not f.filename.startswith((package, checks))] or [
        f for f in frames if not f.filename.startswith(checks)]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {Path(f.filename).name}:{f.lineno}, in {f.name}: {f.line})"


def run_check(check, fn) -> Result:
    """Run check(fn) and classify what happened."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        check(fn)
    except NotImplementedError:
        return Result("not done", f"{name} still raises NotImplementedError; fill in its body and run this again")
    except Wrong as exc:
        return Result("wrong", str(exc))
    except Exception as exc:  # noqa: BLE001 - any mistake in the student's code is reported, not raised
        where = getattr(exc, "where", "")  # an error raised in the student's process (tutorials/grading/)
        return Result("error", f"{name} raised {type(exc).__name__}: {exc}"
                               + (f" (at {where})" if where else _student_frame(exc)))
    return Result("correct", "")


def title(check) -> str:
    """A check's title: the first line of its docstring, without the 'Check: ' prefix."""
    doc = (check.__doc__ or check.__name__).strip().splitlines()[0]
    return doc.removeprefix("Check: ").rstrip(".")


class Exercises:
    """The exercises of one tutorial: swaps stubs for solutions when asked, runs and tallies checks."""

    def __init__(self, tutorial: str) -> None:
        self.tutorial = tutorial
        self.results: dict[int, Result] = {}
        folder = solutions_dir()
        self.solutions = None
        if folder is not None:
            path = folder / f"{tutorial}.py"
            if not path.is_file():
                raise FileNotFoundError(f"{ENV} is set but {path} does not exist")
            self.solutions = runpy.run_path(str(path), run_name=f"solutions_{tutorial}")

    @property
    def strict(self) -> bool:
        """True when running with the reference solutions: a check that does not pass raises."""
        return self.solutions is not None

    def stub(self, fn):
        """Decorator: the student's function, or the reference solution of the same name."""
        if self.solutions is None:
            return fn
        if fn.__name__ not in self.solutions:
            raise KeyError(f"tutorials/solutions/{self.tutorial}.py has no function {fn.__name__}")
        return self.solutions[fn.__name__]

    def check(self, number: int, check, fn) -> bool:
        """Run exercise `number`'s check on `fn`, print the verdict, return whether it passed."""
        result = run_check(check, fn)
        self.results[number] = result
        verdict = {"correct": "correct", "not done": "not done yet", "wrong": "wrong", "error": "error"}[result.status]
        line = f"Exercise {number} ({title(check)}): {verdict}" + (f" -- {result.message}" if result.message else "")
        print(line)
        if self.strict and not result.ok:
            raise AssertionError(f"{self.tutorial}: the reference solution fails its check: {line}")
        return result.ok

    def summary(self) -> bool:
        """Print how many exercises pass; return True if all do."""
        done = [n for n, r in sorted(self.results.items()) if r.ok]
        missing = [n for n, r in sorted(self.results.items()) if r.status == "not done"]
        failing = [n for n, r in sorted(self.results.items()) if r.status in ("wrong", "error")]
        text = f"{self.tutorial}: {len(done)} of {len(self.results)} exercises correct"
        if missing:
            text += "; not done yet: " + ", ".join(map(str, missing))
        if failing:
            text += "; to fix: " + ", ".join(map(str, failing))
        print(text)
        return len(done) == len(self.results)


# ------------------------------------------------------------------------------------------------
# Launching MPI programs from a tutorial (a notebook cannot be run under mpiexec itself)
# ------------------------------------------------------------------------------------------------

def run_mpi(n: int, *args, timeout: float = 300, show: bool = True, check: bool = True) -> subprocess.CompletedProcess:
    """Run `mpiexec -n n <this python> *args`; print the command and (with show) what the ranks printed.

    `args` are the Python arguments: ("-m", "refimpl", "verify", ...) or ("-c", PROGRAM). Returns
    the CompletedProcess (stdout and stderr as text); raises RuntimeError if the job fails and
    `check` is true.
    """
    mpiexec = find_mpiexec()  # the one next to this Python (the mpich wheel's), else on PATH
    if mpiexec is None:
        raise FileNotFoundError("no mpiexec next to this Python or on PATH: pip install mpich "
                                "(or pip install -e '.[mpi]' in the repository)")
    env = without_launcher()
    env.pop(ENV, None)  # the MPI programs are refimpl's own, never the exercises
    command = [mpiexec, "-n", str(n), sys.executable, *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    shown = [a if "\n" not in a else "PROGRAM" for a in map(str, args)]
    print(f"$ mpiexec -n {n} python {' '.join(shown)}" + ("" if show else "   (output parsed below)"))
    if show:
        for stream in (done.stdout, done.stderr):
            for line in stream.rstrip().splitlines():
                print(line if len(line) <= 400 else f"{line[:300]} ... ({len(line)} characters)")
    if check and done.returncode != 0:
        raise RuntimeError(f"mpiexec -n {n} exited with status {done.returncode}:\n{done.stderr[-2000:]}")
    return done


def last_json(done: subprocess.CompletedProcess) -> dict:
    """The JSON object that a `--json` command prints as its last line of stdout."""
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])


__all__ = ["Exercises", "Wrong", "plain", "shown", "expect_close", "in_student_process", "plain_array", "Result",
           "run_check", "title", "solutions_dir", "run_mpi", "last_json"]
