"""docs/design.md is the map of the package: every module appears in it, and the map is current."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def test_every_module_of_the_package_appears_in_the_design_map():
    text = DESIGN.read_text()
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "refimpl").rglob("*.py"))
    missing = [m for m in modules if f"`{m}`" not in text]
    assert modules and not missing, f"docs/design.md does not name {missing}: run python docs/generate.py"


def test_the_map_names_no_module_that_is_gone():
    text = DESIGN.read_text()
    named = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `refimpl/")}
    gone = sorted(m for m in named if not (ROOT / m).is_file())
    assert named and not gone, f"docs/design.md names modules that do not exist: {gone}"


def test_the_generated_map_and_reading_path_are_current():
    done = subprocess.run([sys.executable, "docs/generate.py", "--check", "--only", "design.md", "--no-pictures"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
