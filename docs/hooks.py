"""MkDocs build hooks for refimpl's site (mkdocs.yml: `hooks: [docs/hooks.py]`).

1. Tutorial pages. Each tutorials/NN_name.py (jupytext percent format) becomes the page
   tutorials/NN_name.md at build time: its Markdown cells as prose, its code cells as Python
   blocks. Nothing is copied into docs/, so a page can never be older than its tutorial.

2. Links out of docs/. The pages link to source files (`../refimpl/autograd/engine.py`) so that
   they work when read on a code host. On the site those files do not exist; a link to a
   repository file becomes a link to it under `repo_url` (mkdocs.yml) when one is configured, and
   plain text otherwise, and a link to a tutorial's `.py` file becomes a link to its page. A link
   to a path that exists nowhere in the repository is reported as a warning, so that
   `mkdocs build --strict` fails on it as it does on a broken link between pages.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
log = logging.getLogger("mkdocs.hooks.refimpl")

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]+)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


# ------------------------------------------------------------------------------------------------
# Tutorials
# ------------------------------------------------------------------------------------------------


def tutorial_markdown(path: Path) -> str:
    """A jupytext percent-format script as Markdown: prose cells as text, code cells fenced."""
    cells: list[tuple[str, list[str]]] = []
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            cells[-1][1].append(line)
    out = []
    for kind, lines in cells:
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if not lines:
            continue
        if kind == "markdown":
            out.append("\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines))
        else:
            out.append("```python\n" + "\n".join(lines) + "\n```")
    note = (f"*This page is `tutorials/{path.name}` shown without its output: run it, or open it as a notebook, "
            f"to see the results and do the exercises.*")
    title, _, rest = "\n\n".join(out).partition("\n")
    return f"{title}\n\n{note}\n{rest}\n"


def on_files(files, config):
    for path in sorted(TUTORIALS.glob("[0-9][0-9]_*.py")):
        files.append(File.generated(config, f"tutorials/{path.stem}.md", content=tutorial_markdown(path)))
    return files


# ------------------------------------------------------------------------------------------------
# Links to files outside docs/
# ------------------------------------------------------------------------------------------------


def _rewrite(markdown: str, page_uri: str, repo_url: str | None) -> str:
    page_dir = posixpath.dirname(page_uri)  # relative to docs/

    def replace(match: re.Match) -> str:
        text, target = match.group("text"), match.group("target")
        if re.match(r"^[a-z]+:|^#|^/", target):
            return match.group(0)  # a URL, an anchor, or site-absolute
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join("docs", page_dir, path))
        if repo_path.startswith("docs/") and not repo_path.endswith(".py"):
            return match.group(0)  # a page or picture of the site: MkDocs checks it (.py files are not on it)
        if repo_path.startswith(".."):
            log.warning(f"{page_uri}: link to {target!r} leaves the repository")
            return text
        if not (ROOT / repo_path).exists():
            log.warning(f"{page_uri}: link to {target!r}, but {repo_path} does not exist in the repository")
            return text
        if repo_path.startswith("tutorials/") and re.match(r"tutorials/\d\d_\w+\.py$", repo_path):
            page = posixpath.relpath(f"tutorials/{Path(repo_path).stem}.md", page_dir or ".")
            return f"[{text}]({page})"
        if repo_url:
            kind = "tree" if (ROOT / repo_path).is_dir() else "blob"
            return f"[{text}]({repo_url.rstrip('/')}/{kind}/main/{repo_path}{'#' + anchor if anchor else ''})"
        return text  # no repository URL configured: keep the text (it names the file)

    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        out.append(line if fenced else LINK.sub(replace, line))
    return "".join(out)


def on_page_markdown(markdown, page, config, files):
    return _rewrite(markdown, page.file.src_uri, config.get("repo_url"))
