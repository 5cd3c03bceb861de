"""The layers of docs/design.md, enforced: import-linter's contracts and ruff's rules (pyproject.toml).

A core module that imports a tool, a second module that imports mpi4py or CuPy, a command that
imports another, or code that breaks the style rules fails here, with the linters' own report.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[test]'"
    return found


def test_the_import_contracts_hold():
    done = subprocess.run([_tool("lint-imports")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    kept = re.search(r"Contracts: (\d+) kept, (\d+) broken", done.stdout)
    assert kept and int(kept.group(1)) >= 4 and kept.group(2) == "0", done.stdout[-2000:]


def test_ruff_finds_nothing():
    done = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
