"""Overlapped F&B (refimpl/parallel/pipeline/overlap.py): two tasks, one running at a time, switching
at their communication points, each with its own grad mode and batch rows; the numbers of a
DualPipe(V) run with experts are bitwise the same with the overlap on and off."""

import json

import pytest
from mpi_util import PROGRAMS, last_json, run_mpi

from refimpl.autograd import grad_mode
from refimpl.nn import batch_rows
from refimpl.parallel.pipeline.overlap import Interleaver
from refimpl.tools.sweep import SMALL


def test_tasks_alternate_at_pause_points_and_keep_their_own_state():
    trace = []
    interleaver = Interleaver()

    def forward():  # records operations, rows 0:2 of batch 5
        with batch_rows.batch_rows(0, 2, 4, 5):
            for part in ("attention", "experts", "combine"):
                trace.append(("F", part, grad_mode.is_enabled(), batch_rows.current().start))
                interleaver.pause()

    def backward():  # the engine runs backward without recording
        with grad_mode.no_grad():
            for part in ("combineᵀ", "expertsᵀ"):
                trace.append(("B", part, grad_mode.is_enabled(), batch_rows.current()))
                interleaver.pause()

    interleaver.run(forward, backward)
    assert trace == [("F", "attention", True, 0), ("B", "combineᵀ", False, None), ("F", "experts", True, 0),
                     ("B", "expertsᵀ", False, None), ("F", "combine", True, 0)]
    assert interleaver.switches == 5  # every pause while the other task has not finished is a switch
    assert grad_mode.is_enabled() and batch_rows.current() is None  # the caller's state is back


def test_an_error_in_one_task_is_raised_after_both_stopped():
    ran = []
    interleaver = Interleaver()

    def failing():
        interleaver.pause()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        interleaver.run(failing, lambda: ran.append("other"))
    assert ran == ["other"]


OVERLAP = [SMALL + f.split() for f in (
    "--model gpt --experts 4 --ep 2 --pp 2 --schedule dualpipe --micro-batches 4 --batch-size 16 --n-layer 2 "
    "--dropout 0.1",
    "--model gpt --experts 4 --ep 2 --pp 2 --schedule dualpipev --micro-batches 4 --batch-size 16 --n-layer 4 "
    "--checkpoint every:1 --zero 2",
    "--model gpt --experts 8 --ep 2 --top-k 1 --pp 2 --schedule dualpipe --micro-batches 4 --batch-size 16 --n-layer 2 "
    "--capacity-factor 1.0 --collectives ring --zero 1",
)]


@pytest.mark.mpi
def test_overlap_on_and_off_train_bitwise_the_same_and_it_really_interleaves(tmp_path):
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(OVERLAP))
    results = last_json(run_mpi(4, [PROGRAMS / "overlap_checks.py", path], timeout=300))
    assert len(results) == len(OVERLAP)
    for r in results:
        assert r["identical"], r["flags"]  # losses, gradients and parameters, bit for bit
        assert all(n > 0 for n in r["switches"]) and not any(r["switches_without"]), r
