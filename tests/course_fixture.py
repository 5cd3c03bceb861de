"""A folder of five students' submissions, for the grader's tests and its timing:

    python tests/course_fixture.py OUT        # writes OUT/<student>/NN_name.py for five students
    python tutorials/grade.py OUT --gradebook OUT/gradebook --gradebook-capstone schedule --timeout 5

    ada   every exercise from the reference solutions, two written answers, and a capstone schedule
    bob   tutorials 05 and 07: one wrong answer, one call to refimpl's own model_state_bytes
    cyd   tutorial 03 only, one exercise that exits the process with os._exit
    dee   tutorial 06 copied from the solutions (flagged as similar), one endless loop in 02
    eve   a file that does not parse (01) and one that floods its output (07)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = REPO / "tutorials" / "solutions"
STUDENTS = ("ada", "bob", "cyd", "dee", "eve")
# A schedule of one's own: the worked example of docs/capstone.md with the cool-down's W's reversed.
CAPSTONE = '''
from refimpl.parallel.pipeline.schedules import Action, check_counts, linear_placement, make_schedule


def my_schedule(pp, micro_batches, chunks=None):
    check_counts("mine", pp, micro_batches)
    m, ranks = micro_batches, []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        steps = [Action("F", r, k) for k in range(warmup)]
        for k in range(m - warmup):
            steps += [Action("F", r, warmup + k), Action("I", r, k), Action("W", r, k)]
        steps += [Action("I", r, k) for k in range(m - warmup, m)]
        steps += [Action("W", r, k) for k in reversed(range(m - warmup, m))]
        ranks.append(steps)
    return make_schedule("mine", pp, m, linear_placement(pp), ranks)
'''


def make_five_students(out: Path) -> Path:
    out = Path(out)
    for name in STUDENTS:
        (out / name).mkdir(parents=True, exist_ok=True)
    for path in sorted(SOLUTIONS.glob("[0-9][0-9]_*.py")):
        text = path.read_text().replace("Model answer to the question", "My answer to the question")
        (out / "ada" / path.name).write_text(text if path.stem[:2] in ("01", "12") else
                                              text.split('ANSWER = """')[0])
    (out / "ada" / "capstone.py").write_text(CAPSTONE)
    (out / "bob" / "05_zero.py").write_text('''
from refimpl import memory


def model_state_bytes(stage, psi, n, P, G, K):
    return memory.model_state_bytes(stage, psi, n, P, G, K)


def shard_bounds(numel, n, rank):
    block = -(-numel // n)
    return block * n, rank * block, (rank + 1) * block


ANSWER = """
ZeRO-3 pads every module's buffer to a multiple of N, so it pads more.
"""
''')
    (out / "bob" / "07_pipeline_schedules.py").write_text('''
def bubble_fraction(pp, m):
    return (pp - 1) / m  # the idle over the busy time, not over the whole step
''')
    (out / "cyd" / "03_collectives.py").write_text('''
import os


def allreduce_bytes(length, size, rank, itemsize):
    os._exit(0)
''')
    shutil.copy(SOLUTIONS / "06_checkpointing.py", out / "dee" / "06_checkpointing.py")
    (out / "dee" / "02_gpt.py").write_text('''
def count_parameters(vocab_size, seq_len, n_layer, d_model):
    while True:
        pass
''')
    (out / "eve" / "01_autograd.py").write_text("def sigmoid_backward(y, grad_out):\n    return y * (1 - y) *\n")
    (out / "eve" / "07_pipeline_schedules.py").write_text('''
def bubble_fraction(pp, m):
    while True:
        print("still thinking " * 100)
''')
    return out


if __name__ == "__main__":
    make_five_students(Path(sys.argv[1]))
