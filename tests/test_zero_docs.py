"""docs/zero.md: every generated table matches its command's output (exact counts only)."""

import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.mpi


def test_zero_docs_are_up_to_date():
    docs = runpy.run_path(str(ROOT / "benchmarks" / "zero_docs.py"))
    current = docs["DOC"].read_text()
    assert len(docs["doc_blocks"].BLOCK.findall(current)) == 6, "the document has its generated blocks"
    assert docs["render"](current) == current, "run: python benchmarks/zero_docs.py"
