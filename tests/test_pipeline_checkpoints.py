"""Sharded checkpoints of pipeline runs (docs/pipeline_parallel.md §3): a pipeline run with ZeRO
saves, and resumes bit for bit at the same mesh, and to float64 rounding at another layout (another
dp degree, no pipeline at all): every stage's blocks are saved under their single-process names."""

import pytest
from mpi_util import run_mpi_json

pytestmark = pytest.mark.mpi

RUN = ["-m", "refimpl", "train", "--model", "gpt", "--n-layer", "4", "--d-model", "16", "--n-head", "2",
       "--seq-len", "8", "--batch-size", "16", "--dtype", "float64", "--dropout", "0.1", "--json"]
PIPE = ["--pp", "2", "--schedule", "zb1p", "--micro-batches", "4"]


def test_a_pipeline_with_zero3_resumes_bitwise_and_at_other_layouts(tmp_path):
    whole = run_mpi_json(4, RUN + PIPE + ["--zero", "3", "--steps", "4", "--save-dir", str(tmp_path / "a"),
                                          "--save-every", "2"], timeout=300)
    step2 = str(tmp_path / "a" / "step_00000002")
    same = run_mpi_json(4, RUN + PIPE + ["--zero", "3", "--steps", "4", "--resume", step2], timeout=300)
    assert same["start_step"] == 2 and same["final_loss"] == whole["final_loss"]  # bit for bit
    assert same["eval_loss"] == whole["eval_loss"]
    for ranks, layout in ((2, PIPE + ["--zero", "1"]), (2, ["--zero", "2"]), (1, [])):
        other = run_mpi_json(ranks, RUN + layout + ["--steps", "4", "--resume", step2], timeout=300)
        assert other["start_step"] == 2
        assert other["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-10, abs=1e-12), (ranks, layout)
        assert other["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-10, abs=1e-12), (ranks, layout)


def test_a_mixed_precision_pipeline_saves_and_resumes_bitwise(tmp_path):
    flags = RUN + PIPE + ["--dtype", "mixed", "--zero", "2", "--steps", "4"]
    whole = run_mpi_json(4, flags + ["--save-dir", str(tmp_path / "m"), "--save-every", "2"], timeout=300)
    resumed = run_mpi_json(4, flags + ["--resume", str(tmp_path / "m" / "step_00000002")], timeout=300)
    assert resumed["start_step"] == 2 and resumed["final_loss"] == whole["final_loss"]
    assert resumed["loss_scale"] == whole["loss_scale"]
