"""Cheating attempts against tutorials/grade.py: each scores zero on the exercise it targets, with
the reason. The student's code runs in a process of its own; the checks and reference answers stay
in the grader's (docs/course.md, "What the grader guarantees")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GRADER = REPO / "tutorials" / "grade.py"
SOLUTIONS = REPO / "tutorials" / "solutions"

# (file name, function source, exercise number, expected reason)
ATTEMPTS = {
    "check replaced from the student's code": ("05_zero.py", '''
def zero3_bytes(module_sizes, n, P, G, K):
    import harness.zero as H
    H.check_zero3_bytes.__code__ = (lambda fn: None).__code__
    return None
''', 4, "wrong"),
    "04.2's check replaced, a local mean returned": ("04_data_parallel.py", '''
def local_loss(model, x, y, total):
    import harness.data_parallel as H
    from refimpl.nn import functional as F
    H.check_local_loss.__code__ = (lambda fn: None).__code__
    return F.cross_entropy(model(x), y)
''', 2, "wrong"),
    "10.1's check replaced, identities returned": ("10_tensor_parallel.py", '''
from refimpl.autograd import Function
def conjugate_operators():
    import harness.tensor_parallel as H
    H.check_conjugate_operators.__code__ = (lambda fn: None).__code__
    class Same(Function):
        def forward(self, x, comm):
            return x
        def backward(self, grad, needs):
            return grad, None
    return Same, Same
''', 1, "wrong"),
    "refimpl's f and g called from the student's classes": ("10_tensor_parallel.py", '''
from refimpl.autograd import Function
from refimpl.parallel.tensor_parallel.operators import CopyToTensorParallel as Copy
def conjugate_operators():
    class F(Function):
        def forward(self, x, comm):
            return Copy.forward(self, x, comm)
        def backward(self, grad, needs):
            return Copy.backward(self, grad, needs)
    class G(Function):
        def forward(self, x, comm):
            x = x.copy()
            comm.allreduce(x)
            return x
        def backward(self, grad, needs):
            return grad, None
    return F, G
''', 1, "forbidden"),
    "solutions imported by path": ("05_zero.py", f'''
import runpy
def shard_bounds(numel, n, rank):
    return runpy.run_path({str(SOLUTIONS / "05_zero.py")!r})["shard_bounds"](numel, n, rank)
''', 2, "forbidden"),
    "refimpl's memory.model_state_bytes wrapped": ("05_zero.py", '''
from refimpl import memory
def model_state_bytes(stage, psi, n, P, G, K):
    return memory.model_state_bytes(stage, psi, n, P, G, K)
''', 1, "forbidden"),
    "ring.bytes_sent wrapped": ("03_collectives.py", '''
from refimpl.parallel import ring
def allreduce_bytes(length, size, rank, itemsize):
    return ring.bytes_sent("allreduce", length, size, rank, itemsize)
''', 3, "forbidden"),
    "hard exit": ("03_collectives.py", '''
import os
def bottleneck_bytes(length, size, itemsize):
    os._exit(0)
''', 4, "exit"),
    "SCHEDULES['1f1b'] wrapped": ("07_pipeline_schedules.py", '''
from refimpl.parallel.pipeline import SCHEDULES
def one_f_one_b(pp, m):
    return [list(SCHEDULES["1f1b"](pp, m).actions(r)) for r in range(pp)]
''', 2, "forbidden"),
    "a timeout": ("07_pipeline_schedules.py", '''
def bubble_fraction(pp, m):
    while True:
        pass
''', 3, "timeout"),
    "flooding output": ("07_pipeline_schedules.py", '''
def interleaved_bubble(pp, m, v):
    while True:
        print("x" * 10000)
''', 4, "output"),
    "the harness's reference answer": ("10_tensor_parallel.py", '''
from harness.tensor_parallel import reference_swiglu_slices
def swiglu_slices(gate_up_weight, down_weight, r, t):
    return reference_swiglu_slices(gate_up_weight, down_weight, r, t)
''', 2, "forbidden"),
    "memory_breakdown wrapped": ("12_planning_a_run.py", '''
from refimpl.tools.cluster.model import memory_breakdown
from refimpl.tools.cluster.hardware import PRESETS
def model_state_bytes(run, first, last):
    parts = memory_breakdown(run, PRESETS["a100-80gb"], 1, first=first, last=last)
    return parts["parameters"] + parts["gradients"] + parts["optimizer_states"]
''', 1, "forbidden"),
    "predict(...).mfu wrapped": ("12_planning_a_run.py", '''
from refimpl.tools.cluster.model import predict
def mfu(run, cluster, step_seconds):
    return predict(run, cluster).mfu
''', 4, "forbidden"),
    "the tripwire removed by reloading the module": ("12_planning_a_run.py", '''
import importlib
from refimpl.tools.cluster import model as M
from refimpl.tools.cluster.hardware import PRESETS
def activation_bytes(run):
    fresh = importlib.reload(M)
    parts = fresh.memory_breakdown(run, PRESETS["a100-80gb"], min(run.pp, run.micro_batches), first=True,
                                   last=run.pp == 1)
    return parts["activations"]
''', 2, "tampered"),
    "an object whose == is always True": ("02_gpt.py", '''
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
def count_parameters(vocab_size, seq_len, n_layer, d_model):
    return Anything()
''', 2, "wrong"),
}


def grade(tmp_path: Path, files: dict[str, str]) -> tuple[dict, int]:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = subprocess.run([sys.executable, str(GRADER), "--json", "--public-only", "--timeout", "4",
                           *sorted(str(tmp_path / n) for n in files)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.returncode


def test_every_cheating_attempt_scores_zero_on_its_exercise(tmp_path):
    # one student per attempt (a folder of submissions): nothing one attempt does reaches another
    for i, (name, source, _, _) in enumerate(ATTEMPTS.values()):
        (tmp_path / f"student{i:02d}").mkdir()
        (tmp_path / f"student{i:02d}" / name).write_text(source)
    done = subprocess.run([sys.executable, str(GRADER), str(tmp_path), "--json", "--public-only", "--timeout", "4"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    students = json.loads(done.stdout)["students"]
    for i, (what, (name, _, number, reason)) in enumerate(ATTEMPTS.items()):
        report = students[i]
        assert report["student"] == f"student{i:02d}" and report["points"] == 0, (what, report)
        result = next(r for r in report["results"] if r["tutorial"][:2] == name[:2] and r["exercise"] == number)
        assert (result["result"], result["points"], result["reason"]) == ("fail", 0, reason), (what, result)
    assert done.returncode == 3  # a student's process timed out, exited or flooded: the exit status says so


def test_a_cheat_in_definitions_is_flagged_for_the_instructor(tmp_path):
    report, _ = grade(tmp_path, {"05_zero.py": ATTEMPTS["solutions imported by path"][1]})
    flagged = next(r for r in report["results"] if r["exercise"] == 2)
    assert any("runpy" in flag for flag in flagged["flags"]), flagged


@pytest.mark.parametrize("copied", ["06_checkpointing.py"])
def test_copied_solution_code_is_flagged_not_failed(tmp_path, copied):
    report, _ = grade(tmp_path, {copied: (SOLUTIONS / copied).read_text()})
    assert all(r["result"] == "pass" for r in report["results"])
    assert any(flag.startswith("similar to solutions/") for r in report["results"] for flag in r["flags"])


WRONG_RING = '''
from refimpl.parallel import ring


def ring_allgather(link, buf):
    n, r = link.size, link.rank
    counts = ring.block_counts(buf.size, n)
    offsets = ring.block_offsets(counts)
    block = lambda b: buf[offsets[b]:offsets[b] + counts[b]]
    for step in range(n - 1):
        yield link.exchange(send=block(r), recv=block((r - step - 1) % n))  # always sends its own block


def ring_reduce_scatter(link, buf):
    import harness.collectives as H
    H.check_ring_reduce_scatter.__code__ = (lambda fn: None).__code__  # changes nothing the grader runs
    yield from ()
'''


def test_the_ring_exercises_run_their_check_in_the_graders_process(tmp_path):
    # the generators run in the student's process; the simulated ring and its byte counts in the grader's
    report, status = grade(tmp_path, {"03_collectives.py": WRONG_RING})
    results = {r["exercise"]: r for r in report["results"]}
    assert results[1]["result"] == "fail" and "ranks and" in results[1]["message"]
    assert results[2]["result"] == "fail" and results[2]["reason"] == "wrong"
    assert not any("student's process" in flag for r in report["results"] for flag in r["flags"])


def test_the_live_answers_are_evaluated_there_and_judged_here(tmp_path):
    # 04.2 (a loss Tensor) and 10.1 (Function classes): evaluated in the student's process, checked here
    files = {name: (SOLUTIONS / name).read_text() for name in ("04_data_parallel.py", "10_tensor_parallel.py")}
    report, status = grade(tmp_path, files)
    live = [r for r in report["results"] if (r["tutorial"][:2], r["exercise"]) in (("04", 2), ("10", 1))]
    assert [r["result"] for r in live] == ["pass", "pass"], live
    assert not any("student's process" in flag for r in report["results"] for flag in r["flags"])
    solution = (REPO / "tutorials" / "solutions" / "03_collectives.py").read_text()
    report, status = grade(tmp_path, {"03_collectives.py": solution})
    assert report["all_pass"] and status == 0
