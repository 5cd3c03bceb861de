"""docs/pipeline_schedules.md: every generated table and picture matches its command's output."""

import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pipeline_docs_are_up_to_date():
    docs = runpy.run_path(str(ROOT / "benchmarks" / "pipeline_schedule_docs.py"))
    current = docs["DOC"].read_text()
    assert docs["doc_blocks"].BLOCK.findall(current), "the document has generated blocks"
    assert docs["render"](current) == current, "run: python benchmarks/pipeline_schedule_docs.py"
