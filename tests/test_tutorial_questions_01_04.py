"""Tutorials 01-04: the exercise where the student derives rather than copies (exercise 4 of each)
rejects subtly wrong answers with a message that names the mistake and accepts the reference
solution, and each tutorial asks a written "measure and explain" question whose model answer is in
its solutions file."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tutorials"))  # the exercise harness, tutorials/harness/, as the tutorials import it
from harness import run_check  # noqa: E402
from tutorial_util import SOLUTIONS, solution  # noqa: E402

TUTORIALS = ["01_autograd", "02_gpt", "03_collectives", "04_data_parallel"]
NEW = [("01_autograd", "autograd", "check_backward_once", "backward_once"),
       ("02_gpt", "gpt", "check_cross_entropy_grad", "cross_entropy_grad"),
       ("03_collectives", "collectives", "check_bottleneck_bytes", "bottleneck_bytes"),
       ("04_data_parallel", "data_parallel", "check_bucketed_bytes", "bucketed_bytes")]


# --- 01: the reverse sweep of part 1's engine ---------------------------------------------------

def _by_paths(loss):  # part 1's backward: right sums, each operation once per path
    def push(v, g):
        v.grad = g if v.grad is None else v.grad + g
        if v.grad_fn is not None:
            for parent, gp in zip(v.parents, v.grad_fn(g)):
                push(parent, gp)
    push(loss, np.ones_like(loss.data))


def _sweep(loss, overwrite=False, breadth_first=False):
    """A once-per-operation sweep: right by default; overwriting instead of summing; or in breadth-first order."""
    order, seen = [], set()
    if breadth_first:
        queue = [loss]
        while queue:
            v = queue.pop(0)
            if id(v) not in seen:
                seen.add(id(v))
                order.append(v)
                queue.extend(v.parents)
    else:
        def visit(v):
            if id(v) not in seen:
                seen.add(id(v))
                for p in v.parents:
                    visit(p)
                order.append(v)
        visit(loss)
        order.reverse()
    loss.grad = np.ones_like(loss.data)
    for v in order:
        if v.grad_fn is not None:
            for parent, g in zip(v.parents, v.grad_fn(v.grad)):
                parent.grad = g if (parent.grad is None or overwrite) else parent.grad + g


# --- 02: the gradient of the cross-entropy --------------------------------------------------------

def _ce_grad(logits, targets, ignore_index=-100, per_position=False, keep_ignored=False, no_onehot=False):
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    counted = targets != ignore_index
    onehot = np.zeros_like(p)
    np.put_along_axis(onehot, np.where(counted, targets, 0)[..., None], 1.0, axis=-1)
    g = p if no_onehot else p - onehot
    if not keep_ignored:
        g = g * counted[..., None]
    return g / (targets.size if per_position else counted.sum())


# --- 03: the busiest rank -------------------------------------------------------------------------

def _bottleneck_largest_block(length, size, itemsize):
    return 0 if size == 1 else 2 * (size - 1) * -(-length // size) * itemsize


def _bottleneck_average(length, size, itemsize):
    return 2 * (size - 1) * length * itemsize // size


def _bottleneck_two_small(length, size, itemsize):
    return 0 if size == 1 else (2 * length - 2 * (length // size)) * itemsize  # always two small neighbours


# --- 04: the bytes of the bucketed all-reduces ----------------------------------------------------

def _bucketed_one_buffer(param_numels, itemsize, world_size, rank, bucket_bytes):
    from refimpl.parallel import ring

    return ring.bytes_sent("allreduce", sum(param_numels), world_size, rank, itemsize)


def _bucketed_average(param_numels, itemsize, world_size, rank, bucket_bytes):
    return 2 * (world_size - 1) * sum(param_numels) * itemsize // world_size


def _bucketed_model_order(param_numels, itemsize, world_size, rank, bucket_bytes):
    right = solution("04_data_parallel", "bucketed_bytes")
    return right(param_numels[::-1], itemsize, world_size, rank, bucket_bytes)  # buckets cut from the first parameter


WRONG = [
    ("autograd", "check_backward_once", _by_paths, "part 1's path-by-path backward"),
    ("autograd", "check_backward_once", lambda loss: _sweep(loss, overwrite=True), "sum them"),
    ("autograd", "check_backward_once", lambda loss: _sweep(loss, breadth_first=True),
     "a breadth-first order from the loss is not one"),
    ("gpt", "check_cross_entropy_grad", lambda z, t: _ce_grad(z, t, per_position=True),
     "you divided by all 12 positions"),
    ("gpt", "check_cross_entropy_grad", lambda z, t: _ce_grad(z, t, keep_ignored=True),
     "a position whose target is -100 does not enter the loss"),
    ("gpt", "check_cross_entropy_grad", lambda z, t: _ce_grad(z, t, no_onehot=True),
     "Did you forget to subtract the one-hot target"),
    ("gpt", "check_cross_entropy_grad", lambda z, t: -_ce_grad(z, t), "the wrong sign"),
    ("collectives", "check_bottleneck_bytes", _bottleneck_largest_block, "You charged every one of the 2(N − 1) steps"),
    ("collectives", "check_bottleneck_bytes", _bottleneck_average, "the average over ranks"),
    ("collectives", "check_bottleneck_bytes", _bottleneck_two_small, "only one block is small"),
    ("data_parallel", "check_bucketed_bytes", _bucketed_one_buffer, "one all-reduce of all the gradients"),
    ("data_parallel", "check_bucketed_bytes", _bucketed_average, "the average over ranks"),
    ("data_parallel", "check_bucketed_bytes", _bucketed_model_order, "the buckets cut in the model's order"),
]


@pytest.mark.parametrize("module, check, wrong, says", WRONG, ids=[f"{w[1]}-{i}" for i, w in enumerate(WRONG)])
def test_the_new_checks_explain_wrong_answers(module, check, wrong, says):
    result = run_check(getattr(importlib.import_module(f"harness.{module}"), check), wrong)
    assert result.status == "wrong" and says in result.message, result


@pytest.mark.parametrize("tutorial, module, check, name", NEW, ids=[n[0] for n in NEW])
def test_the_reference_solution_passes_and_the_stub_does_not(tutorial, module, check, name):
    check_fn = getattr(importlib.import_module(f"harness.{module}"), check)
    assert run_check(check_fn, solution(tutorial, name)).ok

    def stub(*args):
        raise NotImplementedError("exercise 4")

    assert run_check(check_fn, stub).status == "not done"


@pytest.mark.parametrize("tutorial", TUTORIALS)
def test_each_tutorial_asks_a_question_with_a_model_answer(tutorial):
    text = (REPO / "tutorials" / f"{tutorial}.py").read_text()
    assert text.count("# **Question (measure and explain).**") == 1
    assert text.index("# **Question (measure and explain).**") < text.index("# ## Exercises")
    tree = ast.parse((SOLUTIONS / f"{tutorial}.py").read_text())
    answers = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
               and any(getattr(t, "id", None) == "ANSWER" for t in node.targets)]
    assert len(answers) == 1 and answers[0].strip().startswith("Model answer")
    assert 8 <= len(answers[0].strip().splitlines()) <= 20 + 4, "a model answer of 8-20 lines (plus its heading)"
    assert "**Exercise 4.**" in text and "ex.check(4, " in text
