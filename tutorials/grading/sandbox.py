"""The grader's side of a student's process: start it, grade one exercise in it, read its verdict.

The check runs here, in the grader's process, with the reference answers; the student's function
runs in the student's process (tutorials/grading/child.py), and the check calls it through the
pipe (tutorials/grading/wire.py): arguments go there as plain data or handles, results come back
as plain data. So a student's code can change nothing the check reads but the values it returns:
not the check's code, not the reference answer, not the verdict.

What fails an exercise besides a wrong answer, each with its reason (`Outcome.reason`):

    "timeout"    the exercise ran past its time: the process is killed (this interrupts NumPy, which an
                 in-process alarm cannot) and a fresh one grades the next exercise
    "exit"       the student's process ended during the exercise (os._exit, a crash, a signal)
    "output"     it printed more than OUTPUT_LIMIT bytes (the file it prints to is capped by
                 RLIMIT_FSIZE, so the flood stops there)
    "forbidden"  it called a function that answers the exercise directly (course.toml), or
                 loaded a solutions file
    "tampered"   a tripwire was no longer in place when the exercise ended

A generator (the ring exercises, 03.1 and 03.2) runs in the student's process one step at a time,
driven from here (`_drive`): the check's simulated ring delivers its messages into the grader's
copies of the receive buffers, which are copied to the student's arrays before the next step, and
the buffer the generator was called with takes its final value when it ends (wire.py, mirrored
arrays). Two exercises return live objects that cannot cross the pipe as plain data (04.2: a loss
Tensor to call backward on; 10.1: autograd Function classes). Their check sends inputs to the
student's process, where an evaluator of the harness (`harness.in_student_process`, `evaluate_*`)
runs the live object on them and sends back what it computed (loss values, gradients, outputs);
the check compares those with the reference answers here, like any other.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .wire import OutOfTime, Peer, PeerGone, Remote, RemoteError

OUTPUT_LIMIT = 1 << 20  # bytes a student's process may print in all
BEGIN_SECONDS = 60  # starting the process and defining the functions (imports of refimpl) may take this long


@dataclass
class Outcome:
    result: str  # "pass", "fail" or "not done"
    message: str
    reason: str = ""  # "", "wrong", "error", "timeout", "exit", "output", "forbidden", "tampered"


def _limits() -> None:  # runs in the child between fork and exec
    import resource  # noqa: PLC0415 - POSIX only, and only in the child

    resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_LIMIT, OUTPUT_LIMIT))
    os.setsid()  # its own process group: killing it kills whatever it started


class StudentProcess:
    """One student's process; restarted after an exercise that killed or timed it out."""

    def __init__(self, copy: Path, sandbox: str = "") -> None:
        self.copy, self.prefix = Path(copy), shlex.split(sandbox) if sandbox else []
        self.process: subprocess.Popen | None = None
        self.peer: Peer | None = None
        self.log = Path(tempfile.mkstemp(prefix="student-", suffix=".log")[1])

    def start(self) -> None:
        self.log.write_bytes(b"")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HOME": str(self.copy), "LANG": "C.UTF-8"}
        command = [*self.prefix, sys.executable, "-I", str(self.copy / "tutorials" / "grading" / "child.py"),
                   str(self.copy), str(self.log)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, env=env, cwd=self.copy,
                                        preexec_fn=_limits)  # noqa: PLW1509 - limits only, no threads yet
        self.peer = Peer(self.process.stdout, self.process.stdin, trusted=False)

    def stop(self) -> None:
        if self.process is not None:
            try:
                os.killpg(self.process.pid, 9)
            except (ProcessLookupError, PermissionError):
                self.process.kill()
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        self.process, self.peer = None, None

    def close(self) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)

    def printed(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def grade(self, text: str, filename: str, function: str, forbidden: list[str], check, timeout: float,
              run_check) -> Outcome:
        """Run `check` here on the student's `function`, defined in their process from `text`."""
        if self.process is None or self.process.poll() is not None or self.peer.gone:
            self.stop()
            self.start()
        peer = self.peer
        session = Remote(peer, 1, "session")
        peer.deadline = time.monotonic() + BEGIN_SECONDS
        outcome = None
        try:
            try:
                remote = session.begin(text, filename, function, list(forbidden))
            except RemoteError as exc:
                where = f" (at {exc.where})" if exc.where and not exc.where.startswith("child.py") else ""
                outcome = Outcome("fail", f"defining {function} raised {exc.kind}: {exc.text}{where}", "error")
            if outcome is None:
                peer.deadline = time.monotonic() + timeout
                result = run_check(check, _local(remote, function, session))
                verdict = {"correct": "pass", "not done": "not done", "wrong": "fail", "error": "fail"}[result.status]
                outcome = Outcome(verdict, result.message, "" if verdict == "pass" else result.status)
            peer.deadline = time.monotonic() + 30
            try:
                report = session.end()
            except RemoteError as exc:
                report = {"tampered": [f"the session's report ({exc.kind})"]}
            if not isinstance(report, dict):
                report = {"tampered": ["the session's report"]}
        except OutOfTime:
            self.stop()
            return Outcome("fail", f"{function} ran longer than {timeout:g} s (--timeout); the grader stopped its "
                                   "process", "timeout")
        except PeerGone:
            return self._ended(function)
        if self.printed() >= OUTPUT_LIMIT:
            self.stop()
            return Outcome("fail", f"{function} printed more than {OUTPUT_LIMIT:,} bytes; the grader stopped its "
                                   "process", "output")
        if peer.gone or self.process.poll() is not None:
            return self._ended(function)
        judged = _judge(outcome, report, function)
        if judged.reason in ("forbidden", "tampered"):
            self.stop()  # what it loaded or changed must not reach the next exercise: a fresh process
        return judged

    def _ended(self, function: str) -> Outcome:
        code = self.process.wait(timeout=10) if self.process is not None else None
        flooded = self.printed() >= OUTPUT_LIMIT
        self.stop()
        if flooded:
            return Outcome("fail", f"{function} printed more than {OUTPUT_LIMIT:,} bytes", "output")
        how = f"with status {code}" if code is not None and code >= 0 else f"by signal {-code}" if code else ""
        return Outcome("fail", f"the student's process ended {how} while grading {function} (os._exit, "
                               "sys.exit in a thread, or a crash): the exercise fails", "exit")


def _local(remote: Remote, function: str, session: Remote):
    """A plain local function that calls the student's through the pipe (a name for messages). Its
    `in_student_process(evaluator, *args)` runs a harness evaluator on the student's function in their
    process and returns the plain data it sends back (harness.in_student_process)."""
    def student(*args, **kwargs):
        try:
            value = remote(*args, **kwargs)
        except RemoteError as exc:
            raise _as_error(exc) from None
        return _drive(value) if isinstance(value, Remote) and value._kind == "generator" else value

    def in_student_process(evaluator, *args):
        try:
            return session.evaluate(evaluator.__module__, evaluator.__name__, remote, *args)
        except RemoteError as exc:
            raise _as_error(exc) from None

    student.__name__ = student.__qualname__ = function
    student.in_student_process = in_student_process
    return student


def _drive(remote: Remote):
    """A local generator that runs the student's generator in their process, one step per send: before
    each step the buffers the check filled since (a ring's receives) are copied to the student's arrays,
    and when it ends the arguments it was called with take their final values (wire.py, mirrored arrays)."""
    sent, peer = None, remote._peer
    while True:
        peer.push()
        try:
            item = remote.send(sent)
        except RemoteError as exc:
            if exc.kind == "StopIteration":
                if remote._origin is not None:
                    peer.arguments(remote._origin)
                return
            raise _as_error(exc) from None
        sent = yield item


def _as_error(exc: RemoteError) -> Exception:
    """The student's exception, as an Exception of the same name (never the student's class)."""
    kind = exc.kind if exc.kind.isidentifier() else "Error"
    error = type(kind, (RemoteError,), {})(exc.kind, exc.text, exc.where)
    error.args = (exc.text,)
    return error


def _judge(outcome: Outcome, report: dict, function: str) -> Outcome:
    calls, tampered, loaded = (list(map(str, v)) if isinstance(v, list) else [str(v)]
                               for v in (report.get("calls", []), report.get("tampered", []),
                                         report.get("solution_code", [])))
    if calls:
        names = ", ".join(_shown(n) for n in calls)
        return Outcome("fail", f"{function} called {names}, which answers this exercise directly: write it "
                               "yourself (the grader forbids calling it here)", "forbidden")
    if loaded:
        return Outcome("fail", f"{function} ran with a solution or a reference answer loaded "
                               f"({', '.join(loaded[:3])}): the exercise fails", "forbidden")
    if tampered:
        return Outcome("fail", f"the grader's tripwire on {', '.join(_shown(n) for n in tampered)} was removed "
                               "during the exercise: the exercise fails", "tampered")
    return outcome


def _shown(name: str) -> str:
    return name.replace(":", ".")
