"""Slides from the tutorials themselves (tutorials/slides.py): each section opens a slide, by the
tags written in the cells' metadata; nbconvert writes reveal.js slides."""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLIDES = runpy.run_path(str(REPO / "tutorials" / "slides.py"))
TAGGED = sorted(p for p in (REPO / "tutorials").glob("[0-9][0-9]_*.py") if p.name[:2] <= "12")


@pytest.mark.parametrize("path", TAGGED, ids=[p.stem for p in TAGGED])
def test_every_section_opens_a_slide_by_its_cell_metadata(path):
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines[1:], start=1):
        if line.startswith("# %% [markdown]"):
            kind = "slide" if lines[i + 1].startswith("# ## ") else "subslide"
            assert line == f'# %% [markdown] slideshow={{"slide_type": "{kind}"}}', (path.name, i + 1, line)
    assert lines[0] == "# %% [markdown]"  # the title cell: the first slide


@pytest.mark.skipif(importlib.util.find_spec("nbconvert") is None or importlib.util.find_spec("jupytext") is None,
                    reason="the slides need the docs extra: pip install -e '.[docs]'")
def test_the_slides_are_reveal_js_with_one_section_per_tagged_cell(tmp_path):
    import jupytext

    (written,) = SLIDES["build"](tmp_path, ["07"])
    html = written.read_text()
    assert written.name == "07_pipeline_schedules.slides.html" and "reveal" in html.lower()
    notebook = jupytext.read(REPO / "tutorials" / "07_pipeline_schedules.py")
    slides = sum(c.metadata.get("slideshow", {}).get("slide_type") == "slide" for c in notebook.cells)
    assert slides >= 3 and html.count("<section") >= slides + 1
