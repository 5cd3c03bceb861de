"""Grading the capstones (docs/capstone.md): a pipeline schedule of the student's own, or a trainer.

A schedule, `grade.py --capstone FILE.py:FUNCTION` (or a folder of submissions, each with
`capstone.py`). The generator runs in the student's process (tutorials/grading/child.py), once
for every (pp, micro-batches) the checks and verify's sweep can ask for; its Schedules come back
as plain data, and every built-in generator is a tripwire while it runs. Then, in the grader:

    valid          it builds at the course's (pp, micro-batches), refimpl's validator accepts it, and
                   the MPI executor can run it (one posted receive per channel)
    its own        its per-rank action lists and placement differ from every built-in's at the same
                   pp and micro-batches (a copy of one under another name is refused), and it called
                   no built-in generator
    bubble         its bubble fraction (F = I = W = 1, exact arithmetic) is below the target
    memory         its peak activations on every rank are at most the target
    verify N       `mpiexec -n N python -m refimpl verify --pp N` passes, for each N of `verify_ranks`
    sweep          `mpiexec -n 2 ... verify --sweep S` passes

The targets are course.toml's `[capstone.schedule]` (a number, or the name of a built-in whose
value at the same sizes is the target: "1f1b"), never a flag of the student's. verify trains with
tutorials/grading/replay.py, which replays the student's schedules from a file: refimpl's processes
run the student's action lists, not the student's code.

A trainer, `grade.py --trainer FILE.py:FUNCTION` (docs/verify_your_algorithm.md): `verify
--trainer` at each world size of `[capstone.trainer].world_sizes`, a sweep, and a memory target:
the bytes the trainer holds per rank after two steps, at most `memory_fraction_of_dp` times what
refimpl's plain data-parallel trainer holds on the same run. The bytes are counted from outside the
trainer (tutorials/grading/trainer_memory.py: the distinct NumPy buffers reachable from the trainer
and the model), not read from the trainer's own memory ledger, which holds what the trainer chose
to register. A trainer is code that trains, so it runs in refimpl's MPI processes and its verdict
comes from those processes (docs/course.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

from .sandbox import StudentProcess
from .wire import OutOfTime, PeerGone, Remote, RemoteError, canonical

REPLAY = Path(__file__).resolve().parent / "replay.py"
VERIFY_FLAGS = ["--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "8", "--steps", "2"]
WORKED = Path(__file__).resolve().parents[2] / "docs" / "examples" / "my_schedule.py"  # docs/capstone.md's example
SIZES = [(pp, m) for pp in range(1, 9) for m in range(1, 17)]  # every size a check or a sweep at 2-4 ranks asks


def builtin_generators() -> dict[str, str]:
    """{"1f1b": "refimpl.parallel.pipeline.schedules.one_f_one_b:one_f_one_b", ...}"""
    from refimpl.parallel.pipeline import SCHEDULES  # noqa: PLC0415 - refimpl is imported when grading

    return {name: f"{fn.__module__}:{fn.__qualname__}" for name, fn in SCHEDULES.items()}


def materialize(spec: str, copy: Path, sandbox: str = "", timeout: float = 120) -> tuple[dict, dict]:
    """({(pp, m): Schedule or error text}, the tripwire report) from the student's generator."""
    path, _, function = spec.rpartition(":")
    if not path.endswith(".py") or not Path(path).is_file():
        raise FileNotFoundError(f"{spec}: give FILE.py:FUNCTION, with FILE.py an existing file")
    process = StudentProcess(copy, sandbox)
    try:
        process.start()
        session = Remote(process.peer, 1, "session")
        process.peer.deadline = None
        import time  # noqa: PLC0415

        process.peer.deadline = time.monotonic() + timeout
        tables = session.capstone(str(Path(path).resolve()), function, [list(s) for s in SIZES],
                                  list(builtin_generators().values()))
        report = session.end()
    finally:
        process.close()
    schedules = {}
    for key, value in tables.items():
        pp, m = map(int, key.split(","))
        schedules[(pp, m)] = value
    return schedules, report


def same_builtin(schedule) -> str | None:
    """The built-in (or docs/capstone.md's worked example) whose action lists and placement `schedule`
    repeats, or None."""
    import runpy  # noqa: PLC0415 - the worked example is the course's own file

    from refimpl.parallel.pipeline import SCHEDULES, build  # noqa: PLC0415

    lists = [list(schedule.actions(r)) for r in range(schedule.pp)]
    if WORKED.is_file():
        example = runpy.run_path(str(WORKED), run_name="worked_example")["early_backward"]
        theirs = example(schedule.pp, schedule.micro_batches)
        if theirs.placement == schedule.placement and lists == [list(theirs.actions(r)) for r in range(theirs.pp)]:
            return "the worked example of docs/capstone.md (early_backward)"
    for name in SCHEDULES:
        for chunks in (None, 2, 3, 4):
            try:
                theirs = build(name, schedule.pp, schedule.micro_batches, chunks)
            except (ValueError, TypeError):
                continue
            if theirs.placement == schedule.placement and lists == [list(theirs.actions(r))
                                                                   for r in range(theirs.pp)]:
                return name
    return None


def target(value, measure, pp: int, m: int):
    """A target from course.toml: a number, or a built-in's name ("1f1b"): that schedule's value."""
    if isinstance(value, str):
        from refimpl.parallel.pipeline import build  # noqa: PLC0415

        return measure(build(value, pp, m)), f"{value.upper()}'s"
    return Fraction(str(value)), "the target"


def bubble(schedule):
    from refimpl.parallel.pipeline import Costs, simulate  # noqa: PLC0415

    return simulate(schedule, Costs(F=1, I=1, W=1), steady_state=False).bubble_fraction


def peak(schedule) -> int:
    from refimpl.parallel.pipeline.simulate import peak_in_flight  # noqa: PLC0415

    return max(peak_in_flight(schedule, r) for r in range(schedule.pp))


def run_verify(ranks: int, flags: list[str], env_table: Path | None, timeout: float) -> tuple[bool, str]:
    from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher  # noqa: PLC0415

    mpiexec = find_mpiexec()
    if mpiexec is None:
        return False, "no mpiexec found (pip install mpich)"
    env = without_launcher()
    if env_table is not None:
        env["REFIMPL_CAPSTONE_TABLE"] = str(env_table)
    command = [mpiexec, "-n", str(ranks), sys.executable, "-m", "refimpl", "verify", *flags]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=Path.cwd())
    except subprocess.TimeoutExpired:
        return False, f"verify did not finish in {timeout:g} s"
    lines = (done.stdout + done.stderr).strip().splitlines()
    message = next((line for line in reversed(lines) if "PASS" in line or "FAIL" in line or "error" in line),
                   lines[-1] if lines else "")
    return done.returncode == 0 and "PASS" in message, message.strip()


def grade_schedule(spec: str, settings: dict, copy: Path, run_mpi: bool = True, sandbox: str = "",
                   timeout: float = 300) -> list[tuple[str, str, str, float]]:
    """[(what, "pass"/"fail"/"not done", message, points)] for a schedule capstone."""
    conf = settings.get("capstone", {}).get("schedule", {})
    pp, m = int(conf.get("pp", 4)), int(conf.get("micro_batches", 8))
    points = conf.get("points", {})
    rows = []

    def row(what, result, message):
        rows.append((what, result, message, float(points.get(what, 1)) if result == "pass" else 0.0))

    try:
        schedules, report = materialize(spec, copy, sandbox)
    except FileNotFoundError as exc:
        row("valid", "fail", str(exc))
        return rows
    except (RemoteError, PeerGone, OutOfTime) as exc:
        row("valid", "fail", f"the generator could not be loaded or run: {exc or type(exc).__name__}")
        return rows
    from refimpl.parallel.pipeline import Schedule, validate  # noqa: PLC0415
    from refimpl.parallel.pipeline.validate import ScheduleError  # noqa: PLC0415

    schedule = schedules.get((pp, m))
    if not isinstance(schedule, Schedule):
        why = schedule if isinstance(schedule, str) else f"it returned {type(schedule).__name__}, not a Schedule"
        row("valid", "fail", f"pp={pp}, {m} micro-batches: {why}")
        return rows
    try:
        checked = validate(schedule)
        if schedule.pp != pp or schedule.micro_batches != m:
            raise ScheduleError(f"asked for pp={pp}, m={m}, got pp={schedule.pp}, m={schedule.micro_batches}")
        if not checked.per_channel_ok:
            raise ScheduleError("valid, but the MPI executor cannot run it (one posted receive per channel)")
    except ScheduleError as exc:
        row("valid", "fail", f"pp={pp}, {m} micro-batches: {str(exc).splitlines()[0]}")
        return rows
    row("valid", "pass", f"validated for pp={pp}, {m} micro-batches, runnable by the executor")
    called = report.get("calls", [])
    copied = same_builtin(schedule)
    if called:
        row("its own", "fail", f"it called the built-in {', '.join(c.replace(':', '.') for c in called)}: "
                               "a capstone schedule builds its own action lists")
    elif copied:
        row("its own", "fail", f"its action lists and placement at pp={pp}, {m} micro-batches are those of "
                               f"{copied if ' ' in copied else copied.upper()}: a capstone schedule must differ from "
                               "every built-in and from the worked example")
    else:
        row("its own", "pass", "differs from every built-in at these sizes")
    got, (goal, whose) = bubble(schedule), target(conf.get("bubble_below", "1f1b"), bubble, pp, m)
    row("bubble", "pass" if got < goal else "fail",
        f"bubble {float(got):.4f} {'<' if got < goal else '>='} {whose} {float(goal):.4f} (F = I = W, pp={pp}, "
        f"{m} micro-batches)")
    got, (goal, whose) = peak(schedule), target(conf.get("peak_activations_at_most", "1f1b"), peak, pp, m)
    row("memory", "pass" if got <= goal else "fail",
        f"peak activations {got} micro-batches on the busiest rank {'<=' if got <= goal else '>'} {whose} "
        f"{int(goal)}")
    if not run_mpi:
        for ranks in conf.get("verify_ranks", [2, 4]):
            row(f"verify {ranks}", "not done", "--no-verify")
        row("sweep", "not done", "--no-verify")
        return rows
    with tempfile.TemporaryDirectory(prefix="capstone-") as folder:
        table = Path(folder) / "schedules.json"
        table.write_text(json.dumps({f"{p},{k}": canonical(v) for (p, k), v in schedules.items()}),
                         encoding="utf-8")
        replay = f"{REPLAY}:replay"
        for ranks in conf.get("verify_ranks", [2, 4]):
            flags = ["--pp", str(ranks), "--n-layer", str(max(2, ranks)), "--schedule", replay, *VERIFY_FLAGS]
            ok, message = run_verify(ranks, flags, table, timeout)
            row(f"verify {ranks}", "pass" if ok else "fail", f"verify --pp {ranks} on {ranks} ranks: {message}")
        sweep = int(conf.get("sweep", 3))
        ok, message = run_verify(2, ["--sweep", str(sweep), "--schedule", replay], table, timeout)
        row("sweep", "pass" if ok else "fail", f"verify --sweep {sweep} on 2 ranks: {message}")
    return rows


def grade_trainer(spec: str, settings: dict, run_mpi: bool = True, timeout: float = 300) -> list[tuple]:
    """[(what, result, message, points)] for a trainer capstone: verify --trainer at each world size, a
    sweep, and the bytes it holds against plain data parallelism's."""
    conf = settings.get("capstone", {}).get("trainer", {})
    points = conf.get("points", {})
    rows = []

    def row(what, result, message):
        rows.append((what, result, message, float(points.get(what, 1)) if result == "pass" else 0.0))

    sizes = conf.get("world_sizes", [2, 4])
    if not run_mpi:
        return [(f"verify {n}", "not done", "--no-verify", 0.0) for n in sizes] + [
            ("sweep", "not done", "--no-verify", 0.0), ("memory", "not done", "--no-verify", 0.0)]
    for n in sizes:
        ok, message = run_verify(n, ["--trainer", spec, "--n-layer", "2", *VERIFY_FLAGS], None, timeout)
        row(f"verify {n}", "pass" if ok else "fail", f"verify --trainer on {n} ranks: {message}")
    sweep = int(conf.get("sweep", 3))
    ok, message = run_verify(2, ["--sweep", str(sweep), "--trainer", spec], None, timeout)
    row("sweep", "pass" if ok else "fail", f"verify --sweep {sweep} --trainer on 2 ranks: {message}")
    fraction, n = float(conf.get("memory_fraction_of_dp", 1.0)), max(sizes)
    mine, why = held_bytes(n, spec, timeout)
    plain, why_plain = held_bytes(n, "-", timeout)
    if mine is None or plain is None:
        row("memory", "fail", f"the bytes held could not be measured: {why or why_plain}")
    else:
        ok = mine <= fraction * plain
        row("memory", "pass" if ok else "fail",
            f"{mine:,} bytes held on the fullest of {n} ranks {'<=' if ok else '>'} {fraction:g} x plain data "
            f"parallelism's {plain:,} (tutorials/grading/trainer_memory.py)")
    return rows


def held_bytes(ranks: int, spec: str, timeout: float) -> tuple[int | None, str]:
    """The most bytes any rank's trainer holds after two steps (trainer_memory.py; spec "-": refimpl's own)."""
    import re  # noqa: PLC0415

    from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher  # noqa: PLC0415

    mpiexec = find_mpiexec()
    if mpiexec is None:
        return None, "no mpiexec found (pip install mpich)"
    command = [mpiexec, "-n", str(ranks), sys.executable, str(Path(__file__).resolve().parent / "trainer_memory.py"),
               spec, "--n-layer", "2", *VERIFY_FLAGS]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=without_launcher())
    except subprocess.TimeoutExpired:
        return None, f"the measurement did not finish in {timeout:g} s"
    found = [int(n) for n in re.findall(r'"held_bytes": (\d+)', done.stdout)]
    if done.returncode != 0 or len(found) != ranks:
        return None, (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return max(found), ""
