"""Launch MPI programs from pytest (and one-process programs without MPI).

    from mpi_util import run_mpi, run_mpi_json, run_local, PROGRAMS

    done = run_mpi(4, [PROGRAMS / "collectives.py"], timeout=60)       # mpiexec -n 4 python ...
    result = run_mpi_json(2, ["-m", "refimpl", "verify", "--json"])    # exit 0 + last stdout line
    done = run_local(["-m", "refimpl", "train"])                      # python ..., no mpiexec

Conventions, so that every MPI test behaves the same:
  * hypothesis draws examples in the pytest process only; pass each example to the program as
    arguments (or a JSON file) and launch once per example -- never call hypothesis inside ranks.
  * put many checks into one launch (one launch costs about a second on 2 cores); the program
    prints one JSON object, on one line, last, on stdout (rank 0 only).
  * every launch has a timeout; on timeout the whole process group (mpiexec and its ranks) is
    killed and subprocess.TimeoutExpired is raised with what the job printed so far.

mpiexec is looked for next to the running Python first (the mpich wheel puts it in the virtual
environment's bin/), then on PATH; without one, the calling test is skipped. Oversubscription
(4 ranks on 2 cores) needs no flag with the mpich wheel's hydra mpiexec.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).resolve().parent / "mpi_programs"


def clean_env(extra: dict | None = None) -> dict:
    """This environment without launcher variables, with the repository importable, plus `extra`.

    A value of None in `extra` removes that variable.
    """
    env = {k: v for k, v in without_launcher().items() if k != "REFIMPL_MPI"}  # never inherited into a new launch
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


def _run(cmd: list[str], timeout: float, env: dict | None, cwd) -> subprocess.CompletedProcess:
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=clean_env(env), cwd=cwd or REPO, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # mpiexec and every rank it started
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def run_mpi(n: int, args, timeout: float = 120, env: dict | None = None, cwd=None,
            mpiexec_args=()) -> subprocess.CompletedProcess:
    """`mpiexec -n n <mpiexec_args> python <args>`; returns the CompletedProcess (text output)."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found (pip install mpich)")
    return _run([mpiexec, "-n", str(n), *map(str, mpiexec_args), sys.executable, *map(str, args)], timeout, env, cwd)


def run_local(args, timeout: float = 120, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """`python <args>` with no MPI launcher: the one-process world."""
    return _run([sys.executable, *map(str, args)], timeout, env, cwd)


def last_json(done: subprocess.CompletedProcess) -> dict:
    """The JSON object on the last non-empty stdout line (AssertionError with the output otherwise)."""
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise AssertionError(f"no JSON on the last stdout line of {' '.join(done.args)} (exit {done.returncode})\n"
                             f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}") from None


def check_ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """AssertionError with the job's output unless it exited 0."""
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(done.args)} exited {done.returncode}\n"
                             f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}")
    return done


def run_mpi_json(n: int, args, timeout: float = 120, env: dict | None = None, **kwargs) -> dict:
    """run_mpi, check exit status 0, return the last stdout line as JSON."""
    return last_json(check_ok(run_mpi(n, args, timeout=timeout, env=env, **kwargs)))


def run_local_json(args, timeout: float = 120, env: dict | None = None, **kwargs) -> dict:
    """run_local, check exit status 0, return the last stdout line as JSON."""
    return last_json(check_ok(run_local(args, timeout=timeout, env=env, **kwargs)))
