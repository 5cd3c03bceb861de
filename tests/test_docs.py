"""The docs site: generated parts are up to date, links out of docs/ resolve, and (when mkdocs is
installed: pip install -e '.[docs]') the site builds with --strict."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
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
    pages = ["index.md", "tutorials.md", "cluster.md", "verify_your_algorithm.md", "pipeline_parallel.md"]
    assert GENERATE["main"](["--check", "--only", *pages]) == 0, "run: python docs/generate.py"


def test_the_pages_with_rounding_level_figures_do_not_depend_on_the_blas_thread_count():
    """The pages that show verify runs, regenerated with another BLAS thread count, are unchanged.

    Under mpiexec each rank defaults to max(1, cores // ranks) BLAS threads; a user's setting wins.
    """
    if find_mpiexec() is None:
        pytest.skip("the pages show mpiexec runs (pip install mpich)")
    threads = "1" if os.environ.get("OPENBLAS_NUM_THREADS") == "2" else "2"
    env = clean_env({name: threads for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")})
    done = subprocess.run([sys.executable, "docs/generate.py", "--check", "--no-pictures", "--only",
                           "verify_your_algorithm.md", "pipeline_parallel.md"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # about 15 s
    assert done.returncode == 0, f"with {threads} BLAS thread(s): {done.stderr[-3000:]}"


def test_rounding_level_figures_are_shown_as_a_bound():
    bound = GENERATE["bound_rounding"]
    line = "step 0: largest |diff| in gradients 8.3e-17 (lm_head.weight), in parameters 3.9e-16; loss 2.4"
    assert bound(line, "1e-12") == ("step 0: largest |diff| in gradients < 1e-12, in parameters < 1e-12; loss 2.4", 2)
    line = "largest |diff| in gradients 5.4e-02 (blocks.0.attn.proj.bias), in parameters 0.00e+00"
    assert bound(line, "1e-12") == ("largest |diff| in gradients 5.4e-02 (blocks.0.attn.proj.bias), in parameters "
                                    "< 1e-12", 1)
    line = "step 0: ok, largest |diff| / tolerance 0.0002\nstep 1: FAIL, largest |diff| / tolerance 5.4e+07"
    assert bound(line, "0.1", "/ tolerance ") == ("step 0: ok, largest |diff| / tolerance < 0.1\n"
                                                   "step 1: FAIL, largest |diff| / tolerance 5.4e+07", 1)
    assert GENERATE["parse_options"]('exit 1; rounding < 1e-12; rounding after "/ tolerance " < 0.1') == {
        "code": 1, "rounding": [(None, "1e-12"), ("/ tolerance ", "0.1")]}
    assert GENERATE["parse_options"](None) == {"code": 0}
    with pytest.raises(ValueError, match="unknown option"):
        GENERATE["parse_options"]("rounding 1e-12")


def test_a_verify_block_shows_the_verdict_and_a_checked_bound(monkeypatch):
    verify_block = GENERATE["verify_block"]
    result = {"ok": True, "max_abs_diff": 5.9e-14, "tolerance_used": 0.04, "steps": 3, "world_size": 2}
    monkeypatch.setitem(verify_block.__globals__, "run", lambda command, code: f"log\n{json.dumps(result)}\n")
    command = "mpiexec -n 2 python -m refimpl verify --pp 2 --json"
    body = verify_block(command, {"code": 0, "relation": "<", "bound": "1e-11"})
    assert body.startswith(f"```console\n$ {command}\n```\n\n**PASS** on 2 processes, 3 steps")
    assert "below 1e-11" in body and "5.9" not in body and "0.04" not in body
    with pytest.raises(RuntimeError, match="breaks the page's bound"):
        verify_block(command, {"code": 0, "relation": "<", "bound": "1e-14"})
    with pytest.raises(ValueError, match="add --json"):
        verify_block("python -m refimpl verify", {"code": 0})
    result.update(ok=False, max_abs_diff=0.05)
    assert "**FAIL**" in verify_block(command, {"code": 1, "relation": ">", "bound": "1e-6"})


def test_no_generated_page_records_a_rounding_level_figure_or_a_timing():
    """Figures that vary by machine (differences below 1e-12, seconds) are never generated."""
    tiny = re.compile(r"\b\d\.\d+e-(1[2-9]|[2-9]\d)\b")
    timing = re.compile(r"\b\d+(\.\d+)? ?(s|ms|seconds)\b")
    for path in sorted((REPO / "docs").glob("*.md")):
        for match in GENERATE["BLOCK"].finditer(path.read_text()):
            if match.group("kind") == "file":
                continue  # a source file, not output
            body = match.group("body")
            if "quoted" not in GENERATE["parse_options"](match.group("options")):
                assert not tiny.search(body), f"{path.name}: {tiny.search(body).group(0)} in {match.group('arg')}"
            options = GENERATE["parse_options"](match.group("options"))
            if "predicted" in options or "quoted" in options:
                continue  # the cluster model's predicted seconds, or text quoted from files: not timings
            assert not timing.search(body), f"{path.name}: {timing.search(body).group(0)} in {match.group('arg')}"


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
    # no repo_url: the site's page of the file
    assert rewrite(text, "autograd.md", None) == ("[engine](source/refimpl/autograd/engine.py.md) "
                                                  "[page](data_parallel.md) [t](tutorials/01_autograd.md)")
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
    # The tutorial pages without their output: running all twelve takes about a minute
    # (test_a_tutorial_page_shows_its_output renders one with it).
    done = subprocess.run([*mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env=clean_env({"NO_MKDOCS_2_WARNING": "1", "REFIMPL_DOCS_TUTORIAL_OUTPUT": "0"}))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "tutorials" / "01_autograd" / "index.html").exists()
    assert (tmp_path / "site" / "images" / "dualpipe.svg").exists()
    # Links to source files resolve: to the site's page of the file (no repo_url is configured).
    autograd = (tmp_path / "site" / "autograd" / "index.html").read_text()
    assert 'href="../source/refimpl/autograd/engine.py/"' in autograd
    engine = (tmp_path / "site" / "source" / "refimpl" / "autograd" / "engine.py" / "index.html").read_text()
    assert "as it was when this site was built" in engine and "topological" in engine  # the file's text, highlighted


@pytest.mark.skipif(not HAS_MKDOCS, reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')")
def test_a_tutorial_page_shows_its_output():
    """The site's tutorial pages carry what each cell printed, run at build time as a notebook runs."""
    hooks = runpy.run_path(str(REPO / "docs" / "hooks.py"))
    path = REPO / "tutorials" / "01_autograd.py"
    outputs = hooks["run_tutorial"](path)
    assert not [o for o in outputs if "error" in o], outputs
    page = hooks["tutorial_markdown"](path, outputs)
    assert "with the output of a run made when this site was built" in page
    assert "```text\n" in page and re.search(r"01_autograd: 0 of \d+ exercises correct", page)
    assert not re.search(r"exercises correct[^`]*\n(True|False)\n```", page), "summary()'s bool is not echoed"


def test_every_picture_is_shown_on_a_page():
    pages = "\n".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    for name in GENERATE["PICTURES"]:
        assert f"images/{name}.svg" in pages, f"docs/images/{name}.svg is drawn but shown on no page"


def test_the_autograd_page_snippet_runs():
    text = (REPO / "docs" / "autograd.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(snippet, "docs/autograd.md", "exec"), namespace)  # noqa: S102 - the page's own example
    assert namespace["w"].grad is not None
