"""The mutation catalogue: deliberately broken algorithms, and the checks that catch them.

    python benchmarks/mutation.py                      # every mutant: CAUGHT or SURVIVED, by which check, seconds
    python benchmarks/mutation.py --baseline           # every check on the unmutated tree: all must pass
    python benchmarks/mutation.py --only zero3         # mutants whose name contains "zero3" (comma: several)
    python benchmarks/mutation.py --list               # the catalogue: area, checks in order
    python benchmarks/mutation.py --check-patches      # only: does every patch still apply? (seconds)
    python benchmarks/mutation.py --json               # one JSON summary line last on stdout

A mutant is a realistic bug stored as a patch, benchmarks/mutations/NN_name.patch: a unified diff
(made with `git diff`) preceded by `#` lines that say what the bug is, why it is realistic, and
which check catches it. benchmarks/mutations/catalogue.toml names every mutant's area and its
checks, cheapest first; a check is a command line (a `verify` run under mpiexec, or a pytest
selection), defined once under [checks].

For each mutant the runner copies the repository's files -- the working tree as it is, tracked
files and untracked files that git does not ignore, so uncommitted work is included -- into a
temporary directory, applies the patch there with `git apply`, and runs the checks in that copy
(cwd = the copy, PYTHONPATH = the copy, so the copy's refimpl is imported, never an editable
install). The mutant is CAUGHT by the first check that fails: a non-zero exit (verify's 1 is a
failed comparison; any other status is a crash, which also counts) or a time-out (a hang counts:
the runner kills the whole process group). If every check passes, the mutant SURVIVED. A patch
that no longer applies is an ERROR, never "caught". The exit status is 1 if any mutant survived
or errored, 0 otherwise.

A check that fails for a reason unrelated to the mutant (a broken tree, a missing option) would
catch everything; `--baseline` runs each check once on the unmutated copy and must show them all
passing. docs/mutation_testing.md has the table, what each kind of check can and cannot see, and
how long the catalogue takes (a few minutes on 2 cores). CI runs only the cheap test that every
patch still applies (tests/test_mutation_catalogue.py), not the catalogue.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from refimpl.tools.runtime.launcher import find_mpiexec, without_launcher  # noqa: E402 - the runner's, not a mutant's

CATALOGUE = REPO / "benchmarks" / "mutations"
MANIFEST = CATALOGUE / "catalogue.toml"
PYTEST = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]


@dataclass
class Check:
    name: str
    cmd: str  # the command line (see command_of)
    timeout: float | None = None  # seconds before it counts as a hang (default: --timeout)

    @classmethod
    def of(cls, name: str, value) -> Check:
        """A [checks] entry: a command line, or {cmd = "...", timeout = seconds}."""
        if isinstance(value, str):
            return cls(name, value)
        return cls(name, value["cmd"], float(value["timeout"]) if "timeout" in value else None)


@dataclass
class Mutant:
    name: str  # the patch's file name without .patch
    area: str
    checks: list[str]  # names of [checks] entries, in the order they are tried
    patch: Path
    summary: str = ""  # the bug in one line (the manifest's "bug"; the patch's header says more)


@dataclass
class Outcome:
    name: str
    area: str
    status: str  # CAUGHT, SURVIVED or ERROR
    check: str | None = None  # the catching check (CAUGHT), or what went wrong (ERROR)
    how: str = ""  # "verify FAIL (exit 1)", "exit 2", "timeout after 300 s", ...
    seconds: float = 0.0
    tried: list = field(default_factory=list)  # [(check, exit status or "timeout", seconds)]


# ------------------------------------------------------------------------------------------------
# The catalogue
# ------------------------------------------------------------------------------------------------


def load_catalogue(path: Path = MANIFEST) -> tuple[dict[str, Check], list[Mutant]]:
    """({check name: Check}, [Mutant]) from catalogue.toml; every name and patch must exist."""
    data = tomllib.loads(path.read_text())
    checks = {name: Check.of(name, value) for name, value in data["checks"].items()}
    mutants = []
    for entry in data["mutant"]:
        name = entry["name"]
        patch = path.parent / f"{name}.patch"
        if not patch.is_file():
            raise SystemExit(f"mutation: {path.name} names {name}, but {patch} does not exist")
        unknown = [c for c in entry["checks"] if c not in checks]
        if unknown:
            raise SystemExit(f"mutation: {name} uses checks {unknown} that [checks] does not define")
        mutants.append(Mutant(name, entry["area"], list(entry["checks"]), patch, entry.get("bug", "")))
    listed = {m.name for m in mutants}
    stray = sorted(p.stem for p in path.parent.glob("*.patch") if p.stem not in listed)
    if stray:
        raise SystemExit(f"mutation: patches not in {path.name}: {', '.join(stray)}")
    return checks, mutants


def header_of(patch: Path) -> list[str]:
    """The `#` lines before the diff (git apply ignores them): what, why, caught by."""
    lines = []
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git"):
            break
        lines.append(line.lstrip("#").strip())
    return [line for line in lines if line]


# ------------------------------------------------------------------------------------------------
# Copies of the repository
# ------------------------------------------------------------------------------------------------


def repository_files(repo: Path = REPO) -> list[str]:
    """Tracked files and untracked files git does not ignore, as they are in the working tree."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         check=True, capture_output=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (repo / f).is_file()})


def copy_tree(files: list[str], src: Path, dst: Path) -> None:
    for f in files:
        target = dst / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / f, target)


def git_env(root: Path) -> dict:
    """git outside any repository: the copy is not one, and no parent directory may be taken for one."""
    env = dict(os.environ)
    env["GIT_CEILING_DIRECTORIES"] = str(root.parent)
    return env


def apply_patch(patch: Path, tree: Path, check_only: bool = False) -> str | None:
    """Apply `patch` in `tree` (or only check that it applies); returns an error message or None."""
    args = ["git", "apply", "--check", str(patch)] if check_only else ["git", "apply", str(patch)]
    done = subprocess.run(args, cwd=tree, capture_output=True, text=True, env=git_env(tree))
    if done.returncode != 0:
        return (done.stderr.strip() or done.stdout.strip() or f"git apply exited {done.returncode}").splitlines()[0]
    return None


def patched_files(patch: Path) -> list[str]:
    return [line.split(" b/", 1)[1] for line in patch.read_text().splitlines() if line.startswith("diff --git ")]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------
# Running checks
# ------------------------------------------------------------------------------------------------


def mpiexec() -> str:
    found = find_mpiexec()
    if found is None:
        raise SystemExit("mutation: no mpiexec next to this Python or on PATH (pip install mpich)")
    return found


def command_of(line: str) -> list[str]:
    """A check's command line as argv: python -> this interpreter, pytest -> python -m pytest -q -x."""
    argv = shlex.split(line)
    if argv[0] == "pytest":
        argv = ["python", *PYTEST, *argv[1:]]
    out = []
    for word in argv:
        if word == "python":
            out.append(sys.executable)
        elif word == "mpiexec":
            out.append(mpiexec())
        else:
            out.append(word)
    return out


def check_env(tree: Path) -> dict:
    # a check that launches mpiexec starts a job of its own: no launcher variable is inherited
    env = {k: v for k, v in without_launcher().items() if k != "REFIMPL_MPI"}
    env["PYTHONPATH"] = str(tree)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_check(check: Check, tree: Path, timeout: float) -> tuple[int | str, float, str]:
    """(exit status or "timeout", seconds, the output's last lines) of one check in `tree`."""
    timeout = check.timeout if check.timeout is not None else timeout
    start = time.perf_counter()
    process = subprocess.Popen(command_of(check.cmd), cwd=tree, env=check_env(tree), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        status: int | str = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # mpiexec and every rank it started
        output, _ = process.communicate()
        status = "timeout"
    lines = (output or "").strip().splitlines()
    tail = "\n".join(lines[-3:] + [line for line in lines[:-3] if "watchdog: " in line])
    return status, time.perf_counter() - start, tail


def describe(check: Check, status, output: str = "") -> str:
    if status == "timeout":
        return "timeout: a hang counts as caught"
    if "watchdog: " in output:
        return f"a hang, named by the watchdog, exit {status}"
    if " verify" in f" {check.cmd}" and status == 1:
        return "verify FAIL, exit 1"
    if check.cmd.startswith("pytest") and status == 1:
        return "test failed"
    return f"exit {status}"


def check_imports_the_copy(tree: Path) -> None:
    """The copy's refimpl, not the editable install, is what the checks import."""
    done = subprocess.run([sys.executable, "-c", "import refimpl; print(refimpl.__file__)"], cwd=tree,
                          env=check_env(tree), capture_output=True, text=True)
    where = Path(done.stdout.strip() or "?").resolve()
    if done.returncode != 0 or tree.resolve() not in where.parents:
        raise SystemExit(f"mutation: the copy in {tree} imports refimpl from {where}, not from the copy")


def run_mutant(mutant: Mutant, checks: dict, files: list[str], workdir: Path, timeout: float) -> Outcome:
    start = time.perf_counter()
    tree = workdir / mutant.name
    copy_tree(files, REPO, tree)
    targets = patched_files(mutant.patch)
    before = {f: digest(tree / f) for f in targets if (tree / f).is_file()}
    error = apply_patch(mutant.patch, tree)
    if error is None and all(digest(tree / f) == before.get(f) for f in targets if (tree / f).is_file()):
        error = "git apply changed nothing"
    if error is not None:
        return Outcome(mutant.name, mutant.area, "ERROR", "patch does not apply", error,
                       time.perf_counter() - start)
    outcome = Outcome(mutant.name, mutant.area, "SURVIVED")
    for name in mutant.checks:
        status, seconds, tail = run_check(checks[name], tree, timeout)
        outcome.tried.append((name, status, round(seconds, 1)))
        if status != 0:
            outcome.status, outcome.check, outcome.how = "CAUGHT", name, describe(checks[name], status, tail)
            break
    outcome.seconds = time.perf_counter() - start
    return outcome


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def select(mutants: list[Mutant], only: str | None) -> list[Mutant]:
    if not only:
        return mutants
    words = [w for w in only.split(",") if w]
    chosen = [m for m in mutants if any(w in m.name for w in words)]
    if not chosen:
        raise SystemExit(f"mutation: no mutant name contains {only!r}; see --list")
    return chosen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="apply each catalogued bug to a copy of the repository and run "
                                            "the checks that should catch it")
    p.add_argument("--only", metavar="NAME", help="mutants whose name contains NAME (comma-separated: any of them)")
    p.add_argument("--list", action="store_true", help="print the catalogue and exit")
    p.add_argument("--baseline", action="store_true",
                   help="run every check (of the selected mutants) once on the unmutated copy: all must pass")
    p.add_argument("--check-patches", action="store_true", help="only check that every patch applies")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per check before it counts as a hang")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies (their path is printed)")
    p.add_argument("--json", action="store_true", help="one JSON summary line last on stdout (the table on stderr)")
    args = p.parse_args(argv)
    checks, mutants = load_catalogue()
    mutants = select(mutants, args.only)
    out = sys.stderr if args.json else sys.stdout

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    width = max(len(m.name) for m in mutants)
    if args.list:
        for m in mutants:
            say(f"{m.name:<{width}}  {m.area:<22}  {' -> '.join(m.checks)}")
            say(f"{'':<{width}}  {m.summary}")
        return 0

    files = repository_files()
    workdir = Path(tempfile.mkdtemp(prefix="refimpl-mutation-"))
    try:
        if args.check_patches:
            pristine = workdir / "pristine"
            copy_tree(files, REPO, pristine)
            failed = []
            for m in mutants:
                error = apply_patch(m.patch, pristine, check_only=True)
                say(f"{m.name:<{width}}  {'applies' if error is None else 'DOES NOT APPLY: ' + error}")
                if error is not None:
                    failed.append(m.name)
            if args.json:
                print(json.dumps({"ok": not failed, "patches": len(mutants), "not_applying": failed}))
            return 1 if failed else 0

        if args.baseline:
            pristine = workdir / "pristine"
            copy_tree(files, REPO, pristine)
            check_imports_the_copy(pristine)
            names = list(dict.fromkeys(c for m in mutants for c in m.checks))
            cwidth = max(len(n) for n in names)
            total, results = time.perf_counter(), {}
            for name in names:
                status, seconds, tail = run_check(checks[name], pristine, args.timeout)
                results[name] = {"status": status, "seconds": round(seconds, 1)}
                say(f"{name:<{cwidth}}  {'pass' if status == 0 else 'FAIL (' + describe(checks[name], status) + ')'}"
                    f"  {seconds:6.1f} s")
                if status != 0:
                    say("    " + tail.replace("\n", "\n    "))
            failed = [n for n, r in results.items() if r["status"] != 0]
            say(f"baseline: {len(names) - len(failed)} of {len(names)} checks pass on the unmutated tree "
                f"in {time.perf_counter() - total:.0f} s")
            if args.json:
                print(json.dumps({"ok": not failed, "checks": results, "failed": failed}))
            return 1 if failed else 0

        copy_tree(files, REPO, workdir / "pristine")
        check_imports_the_copy(workdir / "pristine")
        total = time.perf_counter()
        outcomes = []
        for m in mutants:
            o = run_mutant(m, checks, files, workdir, args.timeout)
            outcomes.append(o)
            by = f"by {o.check} ({o.how})" if o.status == "CAUGHT" else (o.how if o.status == "ERROR" else
                                                                         "every check passed: " + ", ".join(m.checks))
            say(f"{o.name:<{width}}  {o.status:<8}  {by}  {o.seconds:6.1f} s")
            if not args.keep:
                shutil.rmtree(workdir / m.name, ignore_errors=True)
        elapsed = time.perf_counter() - total
        counts = {s: sum(o.status == s for o in outcomes) for s in ("CAUGHT", "SURVIVED", "ERROR")}
        say(f"{counts['CAUGHT']} of {len(outcomes)} mutants caught, {counts['SURVIVED']} survived, "
            f"{counts['ERROR']} did not apply; total {elapsed:.0f} s")
        if args.keep:
            say(f"copies kept under {workdir}")
        if args.json:
            print(json.dumps({"ok": counts["CAUGHT"] == len(outcomes), "total_seconds": round(elapsed, 1), **counts,
                              "mutants": [{"name": o.name, "area": o.area, "status": o.status, "check": o.check,
                                           "how": o.how, "seconds": round(o.seconds, 1), "tried": o.tried}
                                          for o in outcomes]}))
        return 0 if counts["CAUGHT"] == len(outcomes) else 1
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)



if __name__ == "__main__":
    sys.exit(main())
