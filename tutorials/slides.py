"""Slides for each tutorial, from the tutorial itself: `python tutorials/slides.py OUT [--execute] [NN ...]`.

Each tutorials/NN_name.py (jupytext percent format) is read as a notebook and written as reveal.js
slides by nbconvert, OUT/NN_name.slides.html: one file per tutorial, opened in a browser (reveal.js
from its CDN). Where a slide starts is in the tutorials' cell metadata, as `slideshow` tags in the
cell headers: `# %% [markdown] slideshow={"slide_type": "slide"}` opens a section (a `## ` heading),
`"subslide"` every other Markdown cell, and a code cell continues the slide before it (the title
cell opens the first slide). A tutorial without tags gets the same rule here. Slides scroll where a
cell is long. `--execute` runs the tutorial first (as a notebook, in tutorials/; minutes) so that
the slides show its output; without it they show the code.

The documentation build (docs/hooks.py, after the site is built) writes them to site/slides/;
docs/course.md links them. Needs the `docs` extra: `pip install -e '.[docs]'` (jupytext, nbconvert).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def tag(notebook) -> None:
    """Give every untagged cell the rule's slide type (in place)."""
    for i, cell in enumerate(notebook.cells):
        if "slideshow" in cell.metadata:
            continue
        if i == 0:
            kind = "slide"
        elif cell.cell_type == "markdown":
            kind = "slide" if cell.source.lstrip().startswith("## ") else "subslide"
        else:
            kind = "-"
        cell.metadata["slideshow"] = {"slide_type": kind}


def build(out: Path, numbers: list[str] | None = None, execute: bool = False) -> list[Path]:
    import jupytext  # noqa: PLC0415 - the docs extra, only when slides are built
    from nbconvert import SlidesExporter  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    exporter = SlidesExporter(reveal_scroll=True)
    written = []
    for path in sorted(HERE.glob("[0-9][0-9]_*.py")):
        if numbers and path.name[:2] not in numbers:
            continue
        notebook = jupytext.read(path)
        tag(notebook)
        if execute:
            from nbclient import NotebookClient  # noqa: PLC0415

            NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(HERE)}}).execute()
        body, _ = exporter.from_notebook_node(notebook)
        target = out / f"{path.stem}.slides.html"
        target.write_text(body, encoding="utf-8")
        written.append(target)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write NN_name.slides.html into")
    parser.add_argument("numbers", nargs="*", help="only these tutorials (01 02 ...)")
    parser.add_argument("--execute", action="store_true", help="run each tutorial first: slides with output")
    args = parser.parse_args(argv)
    try:
        written = build(args.out, args.numbers, args.execute)
    except ModuleNotFoundError as exc:
        print(f"error: {exc.name} is not installed: pip install -e '.[docs]'", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
