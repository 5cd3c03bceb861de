"""The docs site: generated parts are up to date, links out of docs/ resolve, and (when mkdocs is
installed: pip install -e '.[docs]') the site builds with --strict."""

from __future__ import annotations

import importlib.util
import logging
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import clean_env, find_mpiexec

REPO = Path(__file__).resolve().parents[1]
GENERATE = runpy.run_path(str(REPO / "docs" / "generate.py"))
HAS_MKDOCS = importlib.util.find_spec("mkdocs") is not None and importlib.util.find_spec("material") is not None


def test_generated_parts_of_the_guides_are_up_to_date():
    if find_mpiexec() is None:
        pytest.skip("the pages show mpiexec runs (pip install mpich)")
    pages = ["index.md", "tutorials.md", "cluster.md", "verify_your_algorithm.md"]
    assert GENERATE["main"](["--check", "--only", *pages]) == 0, "run: python docs/generate.py"


def test_the_pictures_exist_and_the_readme_picture_is_one_of_them():
    for name in GENERATE["PICTURES"]:
        svg = (REPO / "docs" / "images" / f"{name}.svg").read_text()
        assert svg.startswith("<svg") and name in svg


def test_a_command_that_exits_unexpectedly_is_an_error():
    with pytest.raises(RuntimeError, match="exited with status 2"):
        GENERATE["run"]("python -m refimpl schedule nonsense --pp 2 --micro-batches 2")
    with pytest.raises(ValueError, match="starts with python or mpiexec"):
        GENERATE["argv_of"]("ls docs")


def test_every_page_is_in_the_nav():
    config = (REPO / "mkdocs.yml").read_text()
    nav = re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", config, re.M)
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    missing = [p for p in pages if p not in nav]
    assert not missing, f"add {missing} to the nav in mkdocs.yml"
    tutorials = sorted(f"tutorials/{p.stem}.md" for p in (REPO / "tutorials").glob("[0-9][0-9]_*.py"))
    assert [t for t in tutorials if t not in nav] == [], "every tutorial has a page in the nav"


@pytest.mark.skipif(not HAS_MKDOCS, reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')")
def test_link_rewriting(caplog):
    hooks = runpy.run_path(str(REPO / "docs" / "hooks.py"))
    rewrite = hooks["_rewrite"]
    text = "[engine](../refimpl/autograd/engine.py) [page](data_parallel.md) [t](../tutorials/01_autograd.py)"
    assert rewrite(text, "autograd.md", None) == "engine [page](data_parallel.md) [t](tutorials/01_autograd.md)"
    url = "https://example.org/refimpl"
    assert rewrite(text, "autograd.md", url).startswith(f"[engine]({url}/blob/main/refimpl/autograd/engine.py)")
    assert rewrite("```\n[x](../nowhere.py)\n```\n", "a.md", None) == "```\n[x](../nowhere.py)\n```\n"
    with caplog.at_level(logging.WARNING):
        assert rewrite("see [x](../refimpl/nowhere.py)", "autograd.md", None) == "see x"
    assert "does not exist in the repository" in caplog.text


@pytest.mark.skipif(not HAS_MKDOCS, reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')")
def test_the_tutorial_pages_show_prose_and_code():
    hooks = runpy.run_path(str(REPO / "docs" / "hooks.py"))
    page = hooks["tutorial_markdown"](REPO / "tutorials" / "03_collectives.py")
    assert page.startswith("# 03 · Collectives by hand")
    assert "```python\nimport numpy as np" in page and "# %%" not in page


@pytest.mark.skipif(not HAS_MKDOCS, reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')")
def test_the_site_builds_strictly(tmp_path):
    mkdocs = [sys.executable, "-m", "mkdocs"] if shutil.which(sys.executable) else ["mkdocs"]
    done = subprocess.run([*mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=clean_env({"NO_MKDOCS_2_WARNING": "1"}))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "tutorials" / "01_autograd" / "index.html").exists()
    assert (tmp_path / "site" / "images" / "dualpipe.svg").exists()
