"""A job never hangs: every fault ends every rank, soon, with a message that names a rank.

The fault-injection test draws (world size, rank, moment, kind of fault) and runs a real command
under mpiexec with tests/mpi_programs/inject_fault.py; the bounds are those of docs/cluster.md:
an error, an exit or a death ends the job within BOUND_S of the fault, a stall within
--timeout + BOUND_S. Complete checkpoint steps written before a fault survive it.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi_util import PROGRAMS, run_local, run_mpi

from refimpl.tools.runtime.watchdog import verdict

INJECT = PROGRAMS / "inject_fault.py"
TIMEOUT = 3  # the watchdog's --timeout in these tests
BOUND_S = 10  # the bound: every rank has ended this long after the fault
STALLS = ("stop", "loop", "sleep")  # faults that only the watchdog can see
KINDS = ("raise", "exit0", "exit1", "os_exit", "kill") + STALLS
COMMANDS = {  # (moment, world size) -> the command the fault is injected into
    "comm": ["train", "--model", "mlp", "--steps", "20", "--batch-size", "120"],
    "action": ["train", "--model", "mlp", "--pp", "2", "--steps", "8", "--batch-size", "64"],
    "save": ["train", "--model", "mlp", "--steps", "6", "--batch-size", "120", "--save-every", "1"],
}
FAULT_LINE = re.compile(r"^\[fault\] rank (\d+) (\S+) at (\S+) time=([\d.]+) steps=([\d,]*)$", re.M)


def run_with_fault(world: int, rank: int, at: str, kind: str, tmp_path: Path):
    command = COMMANDS[at.split(":")[0]] + ["--timeout", str(TIMEOUT)]
    save_dir = tmp_path / "ckpt"
    if at.startswith("save"):
        command += ["--save-dir", str(save_dir)]
    done = run_mpi(world, [INJECT, "--rank", rank, "--at", at, "--kind", kind, "--", *command], timeout=120)
    return done, time.time(), save_dir


def draw_fault(data):
    moment = data.draw(st.sampled_from(["comm", "comm", "action", "save"]), label="moment")
    world = data.draw(st.sampled_from([2, 4]) if moment == "action" else st.integers(2, 4), label="world")
    rank = data.draw(st.integers(0, world - 1), label="rank")
    k = data.draw(st.integers(1, {"comm": 40, "action": 30, "save": 8}[moment]), label="k")
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    return world, rank, f"{moment}:{k}", kind


PINNED = [  # every kind once, every moment, the first communication (the startup agreement)
    (4, 2, "comm:12", "raise"),
    (2, 1, "comm:1", "exit0"),
    (3, 0, "comm:9", "exit1"),
    (3, 2, "comm:15", "os_exit"),
    (2, 1, "save:2", "kill"),
    (4, 3, "action:5", "stop"),
    (3, 1, "save:3", "loop"),
    (2, 0, "action:4", "sleep"),
]


@pytest.mark.parametrize("world,rank,at,kind", PINNED)
def test_a_pinned_fault_ends_every_rank_soon_naming_the_rank(world, rank, at, kind, tmp_path):
    check_fault(world, rank, at, kind, tmp_path)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_drawn_fault_ends_every_rank_soon_naming_the_rank(data, tmp_path_factory):
    world, rank, at, kind = draw_fault(data)
    check_fault(world, rank, at, kind, tmp_path_factory.mktemp("fault"))


def check_fault(world: int, rank: int, at: str, kind: str, tmp_path: Path) -> None:
    done, ended, save_dir = run_with_fault(world, rank, at, kind, tmp_path)
    what = f"{kind} at {at} on rank {rank} of {world}:\n{done.stderr[-3000:]}"
    fault = FAULT_LINE.search(done.stderr)
    if fault is None:  # the run made fewer calls than drawn: no fault, a clean run
        assert done.returncode == 0, what
        return
    assert done.returncode != 0, what
    bound = BOUND_S + (TIMEOUT if kind in STALLS else 0)
    after = ended - float(fault.group(4))
    assert after <= bound, f"ended {after:.1f} s after the fault; " + what
    if kind == "kill":  # no Python runs on that rank: its keeper names it by its world rank, whatever
        # process the launcher's report names
        assert re.search(rf"^\[rank {rank}\] killed by signal 9 \(SIGKILL", done.stderr, re.M), what
        assert "killed by signal" not in done.stderr.replace(f"[rank {rank}] killed by signal", ""), what
    elif kind == "os_exit":  # no Python runs after os._exit: the launcher ends the job with its exit status
        # (3) and, if it has time to, a "BAD TERMINATION" report naming its PID
        assert done.returncode == 3 or "BAD TERMINATION" in done.stdout + done.stderr, what
    elif kind in STALLS:
        assert re.search(rf"watchdog: .*Did not arrive: rank {rank} ", done.stderr), what
    else:
        assert f"[rank {rank}]" in done.stderr, what
    complete = [int(s) for s in fault.group(5).split(",") if s]
    if complete:  # the steps that were complete before the fault are intact, and resume finds one
        from refimpl.tools.saved_runs import sharded  # noqa: PLC0415

        for step in complete:
            sharded.read_step(sharded.step_directory(str(save_dir), step))
        newest, _ = sharded.open_newest(str(save_dir))
        assert newest.manifest["step"] >= max(complete), what


# -- startup: problems on some ranks only -----------------------------------------------------------


def mpmd(n_good: int, good: list, n_bad: int, bad: list, env_bad: dict | None = None, timeout=120):
    """`mpiexec -n A python -m refimpl GOOD : -n B [env ...] python -m refimpl BAD`."""
    from mpi_util import _run, find_mpiexec  # noqa: PLC0415

    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found (pip install mpich)")
    env = [] if not env_bad else ["env", *[f"{k}={v}" for k, v in env_bad.items()]]
    cmd = [mpiexec, "-n", str(n_good), sys.executable, "-m", "refimpl", *good,
           ":", "-n", str(n_bad), *env, sys.executable, "-m", "refimpl", *bad]
    start = time.time()
    done = _run(cmd, timeout, None, None)
    return done, time.time() - start


@pytest.mark.parametrize("bad,env,message", [
    (["--model", "resnet"], None, "argument --model: invalid choice: 'resnet'"),
    (["--steps", "-3"], None, "--steps must be positive, got -3"),
    ([], {"REFIMPL_BACKEND": "cupy"}, "backend 'cupy'"),
])
def test_a_startup_problem_on_some_ranks_ends_every_rank_with_one_message(bad, env, message):
    good = ["train", "--steps", "100000"]
    done, seconds = mpmd(2, good, 2, good + bad, env)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and lines[0].endswith("(on ranks 2, 3)"), done.stderr
    assert "MPI_Abort" not in done.stderr  # the ranks agreed: nobody was killed


def test_help_under_mpiexec_is_printed_once_and_exits_0():
    done = run_mpi(2, ["-m", "refimpl", "train", "--help"], timeout=120)
    assert done.returncode == 0 and done.stdout.count("show this help message and exit") == 1, done.stdout + done.stderr


def test_a_process_that_dies_before_it_joins_mpi_ends_the_job():
    """MPI_Init waits for every process; faulthandler's timer ends the ones that joined."""
    from mpi_util import _run, find_mpiexec  # noqa: PLC0415

    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found (pip install mpich)")
    cmd = [mpiexec, "-n", "2", "env", "REFIMPL_INIT_TIMEOUT=3", sys.executable, "-m", "refimpl", "train",
           ":", "-n", "1", sys.executable, "-c", "import sys; sys.exit(3)"]
    start = time.time()
    done = _run(cmd, 120, None, None)
    assert done.returncode != 0 and time.time() - start < 3 + BOUND_S + 5, done.stderr
    assert "Timeout (0:00:03)!" in done.stderr and "_start_mpi" in done.stderr, done.stderr


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_a_bad_timeout_is_refused(value):
    done = run_local(["-m", "refimpl", "train", "--timeout", value], timeout=120)
    assert done.returncode == 2 and "--timeout must be a finite number of seconds >= 0" in done.stderr


# -- ranks agree on what they train ----------------------------------------------------------------


def per_rank_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "per_rank.py"
    script.write_text("import os, sys\nfrom refimpl.tools.runtime.launcher import launcher_rank\n"
                      "rank = launcher_rank()\n" + body)
    return script


def test_ranks_reading_different_files_under_one_path_are_refused(tmp_path):
    for rank, text in enumerate(["abcdefgh" * 40, "abcdefgh" * 39 + "ijklmnop"]):
        (tmp_path / f"node{rank}").mkdir()
        (tmp_path / f"node{rank}" / "input.txt").write_text(text)
    script = per_rank_script(tmp_path, (
        f"os.chdir({str(tmp_path)!r} + f'/node{{rank}}')  # a per-node working directory\n"
        "from refimpl.tools.cli import main\n"
        "sys.exit(main(['train', '--data', 'input.txt', '--seq-len', '8', '--steps', '2', '--batch-size', '4']))\n"))
    done = run_mpi(2, [script], timeout=300)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: ranks would train on different data: --data input.txt "
                                                   "with SHA-256"), done.stderr
    assert "and 8 characters on rank 0 vs" in lines[0] and "and 16 characters on rank 1" in lines[0], done.stderr


def test_ranks_running_different_code_are_refused(tmp_path):
    script = per_rank_script(tmp_path, (
        "import refimpl\n"
        "if rank == 1:\n    refimpl.__version__ = '0.0.1'  # another install on another node\n"
        "from refimpl.tools.cli import main\n"
        "sys.exit(main(['train', '--model', 'mlp', '--steps', '2']))\n"))
    done = run_mpi(2, [script], timeout=300)
    assert done.returncode == 2, done.stderr
    assert "error: ranks would train on different model: " in done.stderr and "refimpl 0.0.1) on rank 1" in done.stderr


# -- no false alarms ---------------------------------------------------------------------------------

QUIET_TIMEOUT = 1  # the watchdog's --timeout in the no-false-alarm tests, in seconds


@pytest.mark.parametrize("n,args", [
    # rank 0 computes the single-process reference while the other waits: 40 small steps, each a few
    # hundredths of a second (a few tenths on a busy machine), the wait a few seconds in all
    (2, ["verify", "--steps", "40", "--n-layer", "2", "--d-model", "32", "--batch-size", "32"]),
    # the sleep-cost mode: every pipeline action padded to 0.3 s (a sleep: no slower on a busy machine)
    (2, ["train", "--model", "mlp", "--pp", "2", "--steps", "4", "--batch-size", "16",
         "--action-costs", "F=0.3,I=0.3,W=0.3"]),
    # checkpoints written every step
    (2, ["train", "--model", "mlp", "--steps", "6", "--save-every", "1", "--save-dir", "{tmp}/ckpt"]),
    # eight ranks on however few cores
    (8, ["train", "--model", "mlp", "--steps", "10", "--batch-size", "64"]),
])
def test_the_watchdog_does_not_fire_on_legitimate_long_waits(n, args, tmp_path):
    """A rank may wait longer than --timeout while another computes, sleeps or writes: the watchdog
    asks, finds a rank that made progress within the timeout, and lets the job run. Only the outcome
    is checked (exit status 0, no report), not how long anything took. The margin lies in the cases,
    not in the machine's speed: the rank waited for makes progress far more often than once a
    timeout -- a reference step of a small model (hundredths of a second idle, a few tenths on a
    busy machine) while the other waits for all 40 of them; an action padded by a sleep to at most
    0.6 s (a sleep is no longer on a busy machine); a file; a step of a small MLP."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = run_mpi(n, ["-m", "refimpl", *args, "--timeout", str(QUIET_TIMEOUT)], timeout=600)
    assert done.returncode == 0 and "watchdog:" not in done.stderr, done.stderr[-3000:]


# -- the verdict, without MPI --------------------------------------------------------------------------


def waiting(waited, call="allreduce over ranks 0-3"):
    return {"progress_age": waited, "waiting": call, "waited": waited}


def running(age, where="refimpl/tools/run.py:12 in train"):
    return {"progress_age": age, "where": where}


def test_the_verdict_names_the_ranks_that_did_not_arrive_and_where_the_others_wait():
    report = verdict({0: waiting(301), 1: running(305), 3: waiting(300)}, 4, 300)
    assert report.startswith("watchdog: no progress for 300 s. "
                             "Did not arrive: rank 1 (running refimpl/tools/run.py:12 in train, "
                             "no progress for 305 s); rank 2 (no answer: stopped, exited, or its node is lost). "
                             "Waiting: ranks 0, 3 in allreduce over ranks 0-3 (for 301 s). ")


def test_the_verdict_waits_while_a_rank_makes_progress_or_has_only_just_arrived():
    assert verdict({0: waiting(400), 1: running(2)}, 2, 300) is None  # rank 1 computes (verify's reference)
    assert verdict({0: waiting(400), 1: waiting(5)}, 2, 300) is None  # rank 1 arrived 5 s ago
    deadlock = verdict({0: waiting(400), 1: waiting(300, "barrier over ranks 0, 1")}, 2, 300)
    assert deadlock.startswith("watchdog: no progress for 300 s. Every rank waits: a deadlock. Waiting: rank 0 in "
                               "allreduce over ranks 0-3 (for 400 s); rank 1 in barrier over ranks 0, 1 (for 300 s).")


@pytest.mark.parametrize("world,rank,at,command", [
    (4, 2, "action:7", ["train", "--model", "gpt", "--n-layer", "8", "--pp", "4", "--schedule", "dualpipe",
                        "--steps", "5"]),
    (2, 1, "comm:6", ["train", "--model", "gpt", "--tp", "2", "--sequence-parallel", "--steps", "5"]),
])
def test_a_killed_rank_is_named_by_its_world_rank_whatever_the_launcher_reports(world, rank, at, command):
    """The launcher's report names a PID, often of a rank it killed itself; the keeper of the rank that
    died names it (keeper.py), and no other rank is reported killed."""
    done = run_mpi(world, [INJECT, "--rank", rank, "--at", at, "--kind", "kill", "--", *command,
                           "--timeout", str(TIMEOUT)], timeout=120)
    what = done.stderr[-3000:]
    assert FAULT_LINE.search(done.stderr), what
    assert done.returncode != 0, what
    named = re.findall(r"^\[rank (\d+)\] killed by signal (\d+) \((\w+): .*\(PID (\d+) on ", done.stderr, re.M)
    assert [(int(r), int(s), name) for r, s, name, _ in named] == [(rank, 9, "SIGKILL")], what


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="keepers run on Linux only")
def test_python_m_refimpl_runs_each_rank_under_a_keeper_that_names_it_when_killed():
    """`mpiexec -n 3 python -m refimpl train ...`: each rank is the child of its keeper; kill -9 one rank
    from outside (as the out-of-memory killer would) and its keeper names it by world rank."""
    import os
    import signal
    import subprocess

    from mpi_util import REPO, clean_env, find_mpiexec  # noqa: PLC0415

    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found (pip install mpich)")
    tag = f"{os.getpid()}-{time.time()}"  # marks this job's processes
    command = [mpiexec, "-n", "3", sys.executable, "-m", "refimpl", "train", "--steps", "100000", "--batch-size", "30",
               "--timeout", "60"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=clean_env({"REFIMPL_TEST_JOB": tag}), cwd=REPO, start_new_session=True)
    try:
        ranks = {}  # world rank -> PID of the kept rank (its environment says REFIMPL_KEEPER=child)
        deadline = time.monotonic() + 60
        while len(ranks) < 3 and time.monotonic() < deadline:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    environ = dict(item.split("=", 1) for item in
                                   open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
                                   if "=" in item)
                    parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError):
                    continue
                if environ.get("REFIMPL_KEEPER") == "child" and environ.get("REFIMPL_TEST_JOB") == tag:
                    ranks[int(environ["PMI_RANK"])] = (int(pid), parent)
            time.sleep(0.2)
        assert len(ranks) == 3, ranks
        keepers = {parent for _, parent in ranks.values()}
        assert len(keepers) == 3 and not keepers & {pid for pid, _ in ranks.values()}  # one keeper per rank
        time.sleep(2)  # training
        os.kill(ranks[1][0], signal.SIGKILL)
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0, stderr
    named = re.findall(r"^\[rank (\d+)\] killed by signal 9 \(SIGKILL.*\(PID (\d+) on ", stderr, re.M)
    assert named == [("1", str(ranks[1][0]))], stderr
