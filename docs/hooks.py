"""MkDocs build hooks for refimpl's site (mkdocs.yml: `hooks: [docs/hooks.py]`).

1. Tutorial pages. Each tutorials/NN_name.py (jupytext percent format) becomes the page
   tutorials/NN_name.md at build time: its Markdown cells as prose, its code cells as Python
   blocks, each followed by what it printed. The output comes from running the tutorial at build
   time, as a notebook would (cells one after another in one namespace, in tutorials/, the
   exercises unfilled, a cell's last expression echoed unless it ends with `;`), in a subprocess
   per tutorial (about a minute for all twelve on 2 cores). Nothing is copied into docs/ or
   committed, so a page can never be older than its tutorial, and figures that vary by machine
   (timings, the last digits of rounding) never fail a check. A tutorial whose cell raises is a
   warning, so `mkdocs build --strict` fails on it. REFIMPL_DOCS_TUTORIAL_OUTPUT=0 in the
   environment builds the pages without output (quick, for `mkdocs serve` while writing;
   tests/test_docs.py builds the site that way and renders one page with output on its own).

2. Links out of docs/. The pages link to source files (`../refimpl/autograd/engine.py`) so that
   they work when read on a code host. On the site: a link to a tutorial's `.py` file becomes a
   link to its page; a link to any other repository file becomes a link to it under `repo_url`
   (mkdocs.yml) when one is configured, and otherwise (no public repository is named anywhere in
   the project, so none is configured) a link to a page of the site that shows the file,
   source/PATH.md (its text in a code block), generated here for every file a page links to. A
   link to a folder stays plain text without `repo_url`. A link to a path that exists nowhere in
   the repository is reported as a warning, so that `mkdocs build --strict` fails on it as it does
   on a broken link between pages.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
log = logging.getLogger("mkdocs.hooks.refimpl")

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]+)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


# ------------------------------------------------------------------------------------------------
# Tutorials
# ------------------------------------------------------------------------------------------------


OUTPUT_ENV = "REFIMPL_DOCS_TUTORIAL_OUTPUT"
MAX_OUTPUT = 20_000  # characters shown per cell; the rest is cut with a note

# Runs one tutorial as a notebook kernel would: cell by cell in one namespace, in tutorials/, with
# a cell's last expression echoed (repr) unless the cell ends with `;`. Writes a JSON list, one
# entry per code cell: {"output": text} or {"output": text, "error": traceback} (then it stops).
RUNNER = r"""
import ast, contextlib, io, json, sys, tokenize, traceback
source_path, out_path = sys.argv[1], sys.argv[2]
sys.argv = [source_path]
sys.path.insert(0, "")
cells, kind = [], None
for line in open(source_path, encoding="utf-8").read().splitlines():
    if line.startswith("# %%"):
        kind = "markdown" if "[markdown]" in line else "code"
        cells.append((kind, []))
    elif cells:
        cells[-1][1].append(line)
namespace = {"__name__": "__main__"}
results = []
def quiet(code):
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(code).readline)
              if t.type not in (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT,
                                tokenize.INDENT, tokenize.DEDENT)]
    return bool(tokens) and tokens[-1].string == ";"
for kind, lines in cells:
    if kind != "code":
        continue
    code = "\n".join(lines)
    buffer = io.StringIO()
    entry = {}
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            tree = ast.parse(code)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, source_path, "exec"), namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), source_path, "eval"), namespace)
                if value is not None and not quiet(code):
                    print(repr(value))
        except BaseException:
            entry["error"] = traceback.format_exc()
    entry["output"] = buffer.getvalue()
    results.append(entry)
    if "error" in entry:
        break
with open(out_path, "w", encoding="utf-8") as f:
    json.dump(results, f)
"""


def _cells(path: Path) -> list[tuple[str, list[str]]]:
    cells: list[tuple[str, list[str]]] = []
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            cells[-1][1].append(line)
    return cells


def run_tutorial(path: Path, timeout: float = 600) -> list[dict]:
    """What each code cell of a tutorial prints when run as a notebook (the exercises unfilled).

    One dict per code cell that ran: {"output": text}, plus "error" (a traceback) on the cell that
    raised, the last one. Raises RuntimeError if the run itself fails.
    """
    env = {k: v for k, v in os.environ.items() if k != "REFIMPL_TUTORIAL_SOLUTIONS"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cells.json"
        path = path.resolve()
        done = subprocess.run([sys.executable, "-c", RUNNER, str(path), str(out)], cwd=path.parent, env=env,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{path.name}: the run failed (exit status {done.returncode}): {done.stderr[-2000:]}")
        return json.loads(out.read_text())


def _fenced(text: str, language: str = "") -> str:
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return f"{fence}{language}\n{text}\n{fence}"


def tutorial_markdown(path: Path, outputs: list[dict] | None = None) -> str:
    """A jupytext percent-format script as Markdown: prose cells as text, code cells fenced, each
    followed by its output when `outputs` (from run_tutorial) is given."""
    out = []
    code_index = 0
    for kind, lines in _cells(path):
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if kind == "markdown":
            if lines:
                out.append("\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines))
            continue
        if lines:
            out.append(_fenced("\n".join(lines), "python"))
        if outputs is not None and code_index < len(outputs):
            result = outputs[code_index]
            text = result["output"].rstrip()
            if len(text) > MAX_OUTPUT:
                text = text[:MAX_OUTPUT] + f"\n... ({len(result['output'])} characters in all)"
            if "error" in result:
                text = (text + "\n" if text else "") + result["error"].rstrip()
            if text:
                out.append(_fenced(text, "text"))
        code_index += 1
    if outputs is None:
        note = (f"*This page is `tutorials/{path.name}` shown without its output: run it, or open it as a notebook, "
                f"to see the results and do the exercises.*")
    else:
        note = (f"*This page is `tutorials/{path.name}` with the output of a run made when this site was built, "
                f"the exercises not yet done; timings and the last digits of rounding differ from machine to "
                f"machine. Run it, or open it as a notebook, to do the exercises.*")
    title, _, rest = "\n\n".join(out).partition("\n")
    return f"{title}\n\n{note}\n{rest}\n"


def _with_output() -> bool:
    return os.environ.get(OUTPUT_ENV, "1") not in ("0", "", "no", "false")


def _tutorial_page(path: Path) -> str:
    if not _with_output():
        return tutorial_markdown(path)
    try:
        outputs = run_tutorial(path)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        log.warning(f"tutorials/{path.name}: could not be run for its page: {exc}")
        return tutorial_markdown(path)
    failed = [o for o in outputs if "error" in o]
    if failed:
        log.warning(f"tutorials/{path.name}: a cell raised when run for its page:\n{failed[0]['error'][-2000:]}")
    return tutorial_markdown(path, outputs)


def on_files(files, config):
    paths = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
    workers = max(1, min(len(paths), (os.cpu_count() or 2) // 2)) if _with_output() else 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pages = list(pool.map(_tutorial_page, paths))
    for path, page in zip(paths, pages):
        files.append(File.generated(config, f"tutorials/{path.stem}.md", content=page))
    if not config.get("repo_url"):
        for repo_path in sorted(_linked_files(files)):
            files.append(File.generated(config, _source_page(repo_path), content=_source_markdown(repo_path),
                                        inclusion=InclusionLevel.NOT_IN_NAV))  # linked from pages, not the nav
    return files


# ------------------------------------------------------------------------------------------------
# Links to files outside docs/
# ------------------------------------------------------------------------------------------------


LANGUAGES = {".py": "python", ".toml": "toml", ".yml": "yaml", ".yaml": "yaml", ".json": "json", ".sh": "bash",
             ".md": "markdown", ".cfg": "ini", ".txt": "text"}


def _repo_path(target: str, page_uri: str) -> str | None:
    """The repository path a link points to when it leaves the site's pages, else None."""
    if re.match(r"^[a-z]+:|^#|^/", target):
        return None  # a URL, an anchor, or site-absolute
    path = target.partition("#")[0]
    repo_path = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), path))
    if repo_path.startswith("docs/") and not repo_path.endswith(".py"):
        return None  # a page or picture of the site: MkDocs checks it (.py files are not on it)
    return repo_path


def _is_tutorial(repo_path: str) -> bool:
    return re.match(r"tutorials/\d\d_\w+\.py$", repo_path) is not None


def _source_page(repo_path: str) -> str:
    """The site page (relative to docs/) that shows a repository file: source/PATH.md."""
    return f"source/{repo_path}.md"


def _source_markdown(repo_path: str) -> str:
    text = (ROOT / repo_path).read_text(encoding="utf-8", errors="replace").rstrip("\n")
    language = LANGUAGES.get(Path(repo_path).suffix, "text")
    return (f"# {repo_path}\n\n*The file `{repo_path}` of the repository, as it was when this site was built.*\n\n"
            + _fenced(text, language) + "\n")


def _links_outside_fences(markdown: str):
    fenced = False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        if not fenced:
            yield from LINK.finditer(line)


def _linked_files(files) -> set[str]:
    """The repository files (not tutorials, not folders) that the site's pages link to."""
    found = set()
    for file in files.documentation_pages():
        if file.src_uri.startswith("source/"):
            continue
        for match in _links_outside_fences(file.content_string):
            repo_path = _repo_path(match.group("target"), file.src_uri)
            if (repo_path and not repo_path.startswith("..") and not _is_tutorial(repo_path)
                    and (ROOT / repo_path).is_file()):
                found.add(repo_path)
    return found


def _rewrite(markdown: str, page_uri: str, repo_url: str | None) -> str:
    page_dir = posixpath.dirname(page_uri)  # relative to docs/

    def replace(match: re.Match) -> str:
        text, target = match.group("text"), match.group("target")
        repo_path = _repo_path(target, page_uri)
        if repo_path is None:
            return match.group(0)
        anchor = target.partition("#")[2]
        if repo_path.startswith(".."):
            log.warning(f"{page_uri}: link to {target!r} leaves the repository")
            return text
        if not (ROOT / repo_path).exists():
            log.warning(f"{page_uri}: link to {target!r}, but {repo_path} does not exist in the repository")
            return text
        if _is_tutorial(repo_path):
            page = posixpath.relpath(f"tutorials/{Path(repo_path).stem}.md", page_dir or ".")
            return f"[{text}]({page})"
        if repo_url:
            kind = "tree" if (ROOT / repo_path).is_dir() else "blob"
            return f"[{text}]({repo_url.rstrip('/')}/{kind}/main/{repo_path}{'#' + anchor if anchor else ''})"
        if (ROOT / repo_path).is_file():  # no repository URL configured: the site's page of the file
            return f"[{text}]({posixpath.relpath(_source_page(repo_path), page_dir or '.')})"
        return text  # a folder, without a repository URL: keep the text (it names the folder)

    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        out.append(line if fenced else LINK.sub(replace, line))
    return "".join(out)


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("source/"):
        return markdown  # a repository file shown as it is
    return _rewrite(markdown, page.file.src_uri, config.get("repo_url"))


# ------------------------------------------------------------------------------------------------
# Slides
# ------------------------------------------------------------------------------------------------


def on_post_build(config):
    """Each tutorial's reveal.js slides, site/slides/NN_name.slides.html (tutorials/slides.py: nbconvert
    from the jupytext notebook, slide tags in the cells' metadata); skipped, as the tutorials' output
    is, with REFIMPL_DOCS_TUTORIAL_OUTPUT=0. A failure is a warning: `mkdocs build --strict` fails."""
    if os.environ.get(OUTPUT_ENV) == "0":
        return
    out = Path(config["site_dir"]) / "slides"
    done = subprocess.run([sys.executable, str(TUTORIALS / "slides.py"), str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        log.warning("slides were not built: %s", lines[-1] if lines else f"exit status {done.returncode}")
