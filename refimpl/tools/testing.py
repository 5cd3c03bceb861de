"""Checking a trainer of your own from your project's tests: verify, launched and read for you.

    from refimpl.tools.testing import assert_trains_like_reference, run_verify

    def test_my_trainer_matches_one_process():
        assert_trains_like_reference("my_trainer.py:make_trainer", ranks=2, flags=["--grad-accum", "2"])

    def test_my_trainer_in_ten_drawn_configurations():
        assert_trains_like_reference("my_trainer.py:make_trainer", ranks=3, sweep=10)

Each call launches `mpiexec -n RANKS python -m refimpl verify --trainer SPEC --json FLAGS` (or
`python -m refimpl verify ...` for ranks=1, no MPI) in a process group of its own, the way
refimpl's own tests do, and reads the JSON object it prints last on stdout. `run_verify` returns
that object (verify's exit status 1, a failed check, is a result too); a launch that cannot give
one -- a bad flag or plug-in (exit 2, verify's `error:` line), no mpiexec, a crash, a timeout --
raises VerifyError with verify's own message and the command. `assert_trains_like_reference`
raises AssertionError unless verify passed, with what verify checked, the problems, the largest
difference (gradient, parameter or loss, and on which rank) and the command that reproduces it.

The child processes import the same refimpl as the caller (its folder goes first on PYTHONPATH)
and inherit the environment except an MPI launcher's variables (a test run under mpiexec must
not make its children join its world).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds refimpl/


class VerifyError(RuntimeError):
    """verify could not give a verdict: bad input, no mpiexec, a crash or a timeout."""


def verify_command(trainer: str | None, ranks: int = 2, flags=(), sweep: int | None = None) -> list[str]:
    """The command run_verify launches (a list for subprocess)."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
    if sweep is not None and (not isinstance(sweep, int) or isinstance(sweep, bool) or sweep < 1):
        raise ValueError(f"sweep must be a positive number of configurations, got {sweep!r}")
    if isinstance(flags, str):
        raise ValueError(f"flags is a list of command-line words, e.g. ['--grad-accum', '2'], not the string {flags!r}")
    command = [sys.executable, "-m", "refimpl", "verify", *map(str, flags), "--json"]
    if trainer is not None:
        command += ["--trainer", _absolute(trainer)]
    if sweep is not None:
        command += ["--sweep", str(sweep)]
    if ranks == 1:
        return command
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise VerifyError(f"no mpiexec found for {ranks} ranks (pip install mpich, or ranks=1)")
    return [mpiexec, "-n", str(ranks), *command]


def _absolute(spec: str) -> str:
    """A FILE.py:FUNCTION spec with FILE made absolute (the children may run elsewhere); a module spec as it is."""
    module, sep, function = spec.rpartition(":")
    if sep and module.endswith(".py"):
        return f"{Path(module).resolve()}:{function}"
    return spec


def run_verify(trainer: str | None = None, ranks: int = 2, flags=(), sweep: int | None = None,
               timeout: float = 600, cwd=None, env: dict | None = None) -> dict:
    """verify's JSON object for `trainer` (MODULE:FUNCTION or FILE.py:FUNCTION; None: refimpl's own)
    on `ranks` processes with verify's `flags` (and --sweep `sweep`); VerifyError if there is none."""
    command = verify_command(trainer, ranks, flags, sweep)
    environment = {k: v for k, v in without_launcher().items() if k != "REFIMPL_MPI"}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), environment.get("PYTHONPATH")]))
    environment.update(env or {})
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                               cwd=cwd, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # mpiexec and every rank it started
        process.communicate()
        raise VerifyError(f"verify did not finish in {timeout:g} s: {shlex.join(command)}") from None
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1]) if process.returncode in (0, 1) else None
    except (IndexError, json.JSONDecodeError):
        result = None
    if not isinstance(result, dict):
        errors = [line for line in stderr.splitlines() if "error:" in line]
        said = errors[0] if errors else (stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise VerifyError(f"verify exited {process.returncode} without a result: {said}\n  command: "
                          f"{shlex.join(command)}")
    result["command"] = shlex.join(command)
    return result


def assert_trains_like_reference(trainer: str | None = None, ranks: int = 2, flags=(), sweep: int | None = None,
                                 timeout: float = 600, cwd=None, env: dict | None = None) -> dict:
    """run_verify, and AssertionError unless verify passed (every configuration, with `sweep`);
    the result otherwise."""
    result = run_verify(trainer, ranks, flags, sweep, timeout, cwd, env)
    if result.get("ok") is True:
        return result
    if sweep is not None:
        failed = [entry for entry in result.get("sweep", []) if not entry.get("ok")]
        lines = [f"verify --sweep {sweep}: {len(failed)} of {len(result.get('sweep', []))} configurations differ "
                 f"from single-process training (seed {result.get('seed')}; replay with --sweep-seed)"]
        lines += [f"  {' '.join(entry['flags'])}: "
                  + ("; ".join(entry["problems"][:2]) or f"tolerance used {entry['tolerance_used']:.3g}")
                  for entry in failed[:5]]
    else:
        what, name, rank = result.get("worst_what"), result.get("worst_name"), result.get("worst_rank")
        lines = [f"verify FAIL: {result.get('trainer')}, checked {result.get('checked')}: largest |diff| / tolerance "
                 f"{result.get('tolerance_used', float('nan')):.3g} in {what or ''} {name}"
                 + (f" on rank {rank}" if rank else "")]
        lines += [f"  {problem}" for problem in result.get("problems", [])[:5]]
        if result.get("hint"):
            lines.append(f"  hint: {result['hint']}")
    lines.append(f"  reproduce: {result['command']}")
    raise AssertionError("\n".join(lines))


__all__ = ["VerifyError", "assert_trains_like_reference", "run_verify", "verify_command"]
