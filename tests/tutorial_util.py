"""What the tutorial tests share: the reference solutions, loaded as the grader loads an answer."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = REPO / "tutorials" / "solutions"
if str(REPO / "tutorials") not in sys.path:
    sys.path.insert(0, str(REPO / "tutorials"))  # the solutions import the harness


def solution(tutorial: str, name: str):
    """Function `name` of tutorials/solutions/`tutorial`.py (tutorial: "09_everything_together")."""
    return runpy.run_path(str(SOLUTIONS / f"{tutorial}.py"))[name]
