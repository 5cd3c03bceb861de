"""The tutorials run to the end with the reference solutions, and every exercise's check fails on
its unfilled stub (and on typical wrong answers) with a clear message.

Each tutorial is run as a student would run it, `python tutorials/NN_name.py`, in a subprocess
with REFIMPL_TUTORIAL_SOLUTIONS pointing at tutorials/solutions/: the stubs are swapped for the
solutions and any check that does not pass raises. The stubs themselves are read from the
tutorial's source (the functions decorated with `@ex.stub`) and handed to their checks here.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_util import check_ok, find_mpiexec, run_local

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tutorials"))  # the exercise harness, tutorials/harness/, as the tutorials import it
from harness import run_check  # noqa: E402
from tutorial_util import solution  # noqa: E402

TUTORIALS = sorted((REPO / "tutorials").glob("[0-9][0-9]_*.py"))
SOLUTIONS = REPO / "tutorials" / "solutions"


def ids(paths):
    return [p.stem for p in paths]


def exercises_of(path: Path) -> tuple[dict, list, dict]:
    """(stub functions by name, [(number, check function, stub name)], the solutions) of a tutorial."""
    tree = ast.parse(path.read_text())
    stub_defs = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                 and any(ast.unparse(d) == "ex.stub" for d in node.decorator_list)]
    for node in stub_defs:
        node.decorator_list = []
    stubs: dict = {}
    exec(compile(ast.Module(body=stub_defs, type_ignores=[]), str(path), "exec"), stubs)  # noqa: S102
    namespace: dict = {}
    imports = [node for node in tree.body
               if isinstance(node, ast.ImportFrom) and node.module.startswith("harness")]
    exec(compile(ast.Module(body=imports, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    checks = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "ex.check":
            number, check, stub = node.args
            checks.append((number.value, namespace[check.id], stub.id))
    solutions: dict = {}
    exec(compile((SOLUTIONS / path.name).read_text(), str(SOLUTIONS / path.name), "exec"), solutions)  # noqa: S102
    return {n: stubs[n] for n in stubs if not n.startswith("__")}, checks, solutions


def test_there_are_tutorials():
    names = [p.stem for p in TUTORIALS]
    for expected in ("01_autograd", "02_gpt", "03_collectives", "04_data_parallel", "05_zero", "06_checkpointing",
                     "07_pipeline_schedules", "08_zero_bubble", "09_everything_together", "10_tensor_parallel",
                     "11_experts_and_overlap", "12_planning_a_run"):
        assert expected in names


@pytest.mark.parametrize("path", TUTORIALS, ids=ids(TUTORIALS))
def test_tutorial_structure(path):
    text = path.read_text()
    first_cell = text.split("\n# %%", 1)[0]
    assert text.startswith("# %% [markdown]\n# # "), "a tutorial opens with a Markdown cell holding its title"
    assert f"**Launch:** `python tutorials/{path.name}`" in first_cell, "the launch line is stated at the top"
    code = [line for line in text.splitlines() if not line.startswith("#")]
    assert not [line for line in code if line.lstrip().startswith(("!", "%"))], "no notebook magics"
    assert "get_ipython" not in text
    assert 'ex = Exercises("' + path.stem + '")' in text
    assert "ex.summary()" in text.rsplit("# %%", 1)[1], "the last cell runs the checks and the summary"
    stubs, checks, solutions = exercises_of(path)
    assert [n for n, _, _ in checks] == list(range(1, len(checks) + 1)), "exercises are numbered 1, 2, ..."
    assert sorted(name for _, _, name in checks) == sorted(stubs), "every stub is checked, once"
    for name in stubs:
        assert callable(solutions.get(name)), f"tutorials/solutions/{path.name} defines {name}"
        assert f"**Exercise {[n for n, _, s in checks if s == name][0]}.**" in text, "each exercise is explained"


@pytest.mark.parametrize("path", TUTORIALS, ids=ids(TUTORIALS))
def test_every_check_fails_on_its_stub(path):
    stubs, checks, _ = exercises_of(path)
    for number, check, name in checks:
        result = run_check(check, stubs[name])
        assert result.status == "not done", f"exercise {number}: {result}"
        assert name in result.message and "NotImplementedError" in result.message


@pytest.mark.parametrize("path", TUTORIALS, ids=ids(TUTORIALS))
def test_tutorial_runs_with_solutions(path):
    if "run_mpi(" in path.read_text() and find_mpiexec() is None:
        pytest.skip("this tutorial launches mpiexec (pip install mpich)")
    done = check_ok(run_local([path], timeout=300, env={"REFIMPL_TUTORIAL_SOLUTIONS": SOLUTIONS}))  # strict checks
    n = len(exercises_of(path)[1])
    assert f"{path.stem}: {n} of {n} exercises correct" in done.stdout


def test_a_student_run_reports_each_exercise_and_finishes():
    path = REPO / "tutorials" / "01_autograd.py"
    done = check_ok(run_local([path], timeout=120, env={"REFIMPL_TUTORIAL_SOLUTIONS": None}))
    numbers = [str(number) for number, _, _ in exercises_of(path)[1]]
    assert len(numbers) >= 4
    assert re.findall(r"^Exercise (\d) \(.+\): not done yet -- \w+ still raises NotImplementedError", done.stdout,
                      re.M) == numbers
    assert (f"01_autograd: 0 of {len(numbers)} exercises correct; not done yet: {', '.join(numbers)}"
            in done.stdout)


# ------------------------------------------------------------------------------------------------
# Wrong answers are caught, with a message that says what differs
# ------------------------------------------------------------------------------------------------


def _wrong_ring_allgather(link, buf):
    from refimpl.parallel import ring

    n, r = link.size, link.rank
    counts = ring.block_counts(buf.size, n)
    offsets = ring.block_offsets(counts)
    block = lambda b: buf[offsets[b]:offsets[b] + counts[b]]  # noqa: E731
    for step in range(n - 1):
        yield link.exchange(send=block(r), recv=block((r - step - 1) % n))  # always sends its own block


def _local_mean_loss(model, x, y, global_count):
    from refimpl.nn import functional as F

    return F.cross_entropy(model(x), y)  # a mean over this rank only


def _buckets_at_or_over(param_bytes, bucket_bytes):
    buckets, size = [], 0
    for i in reversed(range(len(param_bytes))):
        if not buckets or size + param_bytes[i] >= bucket_bytes:  # `>=`: a bucket that fits exactly is cut early
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += param_bytes[i]
    return buckets


def _every_k_without_x0_snapshot(n, k):
    from refimpl.checkpointing.actions import Free, Snapshot
    from refimpl.checkpointing.plans import segment_actions

    return [a for a in segment_actions(n, k) if a not in (Snapshot(0), Free(0))]  # k = n: x0 neither kept nor freed


def _gradient_group_descending(rank, dp, pp, schedule):
    from harness.composition import reference_gradient_group

    return sorted(reference_gradient_group(rank, dp, pp, schedule), reverse=True)


def _operators(f_forward_sums=False, f_backward_sums=True, f_backward_in_place=False, g_forward_sums=True,
               g_forward_in_place=False, g_backward_sums=False):
    """A conjugate_operators answer for tutorial 10, right by default, with the mistakes asked for."""
    from refimpl.autograd import Function

    def summed(comm, a, in_place=False):
        out = a if in_place else a.copy()
        comm.allreduce(out)
        return out

    class CopyToGroup(Function):  # f
        def forward(self, x, comm):
            self.comm = comm
            return summed(comm, x) if f_forward_sums else x

        def backward(self, grad, needs):
            return (summed(self.comm, grad, f_backward_in_place) if f_backward_sums else grad), None

    class ReduceFromGroup(Function):  # g
        def forward(self, x, comm):
            self.comm = comm
            return summed(comm, x, g_forward_in_place) if g_forward_sums else x

        def backward(self, grad, needs):
            return (summed(self.comm, grad) if g_backward_sums else grad), None

    return lambda: (CopyToGroup, ReduceFromGroup)


def _swiglu_contiguous(gate_up_weight, down_weight, r, t):
    n, m = gate_up_weight.shape[0] // t, down_weight.shape[1] // t
    return gate_up_weight[r * n:(r + 1) * n], down_weight[:, r * m:(r + 1) * m]  # gate and up mixed up


def _swiglu_up_of_another_block(gate_up_weight, down_weight, r, t):
    h = gate_up_weight.shape[0] // 2
    mine, other = np.arange(r * h // t, (r + 1) * h // t), np.arange((r + 1) % t * h // t, ((r + 1) % t + 1) * h // t)
    return gate_up_weight[np.concatenate([mine, h + other])], down_weight[:, mine]


def _swiglu_down_by_rows(gate_up_weight, down_weight, r, t):
    h, c = gate_up_weight.shape[0] // 2, down_weight.shape[0]
    mine = np.arange(r * h // t, (r + 1) * h // t)
    return gate_up_weight[np.concatenate([mine, h + mine])], down_weight[r * c // t:(r + 1) * c // t]


def _qkv_contiguous(qkv_weight, qkv_bias, n_head, r, t):
    n = qkv_weight.shape[0] // t
    return qkv_weight[r * n:(r + 1) * n], qkv_bias[r * n:(r + 1) * n]


def _dispatch(chosen, n_experts, unstable=False, inverse_is_order=False, counts_from_tokens=False):
    """A dispatch_indices answer for tutorial 11, right by default, with the mistakes asked for."""
    import numpy as np

    flat = chosen.reshape(-1)
    stable = np.argsort(flat, kind="stable")
    order = np.lexsort((-np.arange(len(flat)), flat)) if unstable else stable  # unstable: token order reversed
    counts = np.bincount(chosen[:, 0] if counts_from_tokens else flat, minlength=n_experts)
    inverse = order.copy() if inverse_is_order else np.argsort(order, kind="stable")
    return order, counts, inverse.reshape(chosen.shape)


def _interleave(forward, backward, switch_before=False):
    """An overlapped_order answer: the Interleaver's order, or one that switches before each all-to-all starts."""
    from harness.experts import is_alltoall

    tasks, pos, turn, order = {"F": forward, "B": backward}, {"F": 0, "B": 0}, "F", []
    while len(order) < len(forward) + len(backward):
        other = "B" if turn == "F" else "F"
        if pos[turn] == len(tasks[turn]):
            turn = other
            continue
        chunk = tasks[turn][pos[turn]]
        pos[turn] += 1
        order.append((turn, chunk))
        upcoming = tasks[turn][pos[turn]] if pos[turn] < len(tasks[turn]) else None
        switch = (upcoming is not None and is_alltoall(upcoming)) if switch_before else is_alltoall(chunk)
        if switch and pos[other] < len(tasks[other]):
            turn = other
    return order


def _interleave_b_in_forward_order(forward, backward):
    chunks = iter(reversed(backward))
    return [(t, c if t == "F" else next(chunks)) for t, c in _interleave(forward, backward)]


def _all_alltoalls_exposed(order, cost):
    from harness.experts import is_alltoall

    return sum(cost(t, c) for t, c in order if is_alltoall(c))


def _exposed_without_final_wait(order, cost):
    from harness.experts import is_alltoall

    clock = busy = 0
    arrives = {"F": 0, "B": 0}
    for task, chunk in order:
        start = max(clock, arrives[task])
        if is_alltoall(chunk):
            clock, arrives[task] = start, start + cost(task, chunk)
        else:
            clock, busy = start + cost(task, chunk), busy + cost(task, chunk)
    return clock - busy  # the end forgets an all-to-all still in flight


def _planning_solution(name):
    return solution("12_planning_a_run", name)


def _states_without_tp(run, first, last):
    from refimpl.memory import PRECISIONS

    h, t = run.d_model, run.tp
    psi = -(-run.n_layer // run.pp) * (12 * h * h + 13 * h)  # the blocks whole on every tp rank
    vocab = -(-run.vocab_size // t) * t
    psi += (vocab * h / t + run.seq_len * h if first else 0) + (vocab * h / t + 2 * h if last else 0)
    p, g, k = PRECISIONS[run.dtype]
    n = run.dp
    return psi * ((p / n if run.zero >= 3 else p) + (g / n if run.zero >= 2 else g) + (k / n if run.zero >= 1 else k))


def _states_embedding_everywhere(run, first, last):
    return _planning_solution("model_state_bytes")(run, True, True)


def _states_over_all_gpus(run, first, last):
    from dataclasses import replace

    return _planning_solution("model_state_bytes")(replace(run, dp=run.gpus), first, last)


def _activations_gpipe(run):
    right = _planning_solution("activation_bytes")
    return right(run) * run.micro_batches / min(run.pp, run.micro_batches) if run.pp > 1 else right(run) + 1


def _compute_without_bubble(run, cluster):
    right = _planning_solution("compute_seconds")(run, cluster)
    return right / (1 + (run.pp - 1) / run.micro_batches) if run.pp > 1 else right * 2


def _mfu_with_recompute(run, cluster, step_seconds):
    h, s, L = run.d_model, run.seq_len, run.n_layer
    extra = {"full": 24 * L * h * h + 4 * L * h * s, "selective": 4 * L * h * s, "none": 0}[run.checkpoint]
    return _planning_solution("mfu")(run, cluster, step_seconds) + (
        run.batch_size * s * extra / step_seconds / run.gpus / cluster.flops(run.dtype))


def _tp_share_one_allreduce(h, t, cluster):
    share = _planning_solution("tp_share")(h, t, cluster)
    x = share / (1 - share) / 2  # half the communication
    return x / (1 + x)


def _wrong_one_f_one_b(pp, m):
    return [[f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)] for _ in range(pp)]  # GPipe's order


WRONG = [
    ("autograd", "check_sigmoid_backward", lambda y, g: y * (1 - y), "differs"),
    ("autograd", "check_topological_order", lambda loss: [loss.grad_fn], "the graph has"),
    ("gpt", "check_count_parameters", lambda v, t, n, c: 12 * n * c * c, "parameters; you counted"),
    ("gpt", "check_cross_entropy", lambda logits, t, ignore_index=-100: 0.0, "differs"),
    ("collectives", "check_ring_allgather", _wrong_ring_allgather, "ranks and"),
    ("collectives", "check_allreduce_bytes", lambda n, size, rank, item: 2 * (size - 1) * n * item // size, "sends"),
    ("data_parallel", "check_local_loss", _local_mean_loss, "not by its own"),
    ("data_parallel", "check_assign_buckets", lambda sizes, b: [list(range(len(sizes)))], "buckets"),
    ("data_parallel", "check_assign_buckets", _buckets_at_or_over, "may hold exactly bucket_bytes"),
    ("schedules", "check_one_f_one_b", _wrong_one_f_one_b, "peak activations"),
    ("schedules", "check_bubble_fraction", lambda p, m: (p - 1) / m, "bubble fraction"),
    ("schedules", "check_zb_h1", lambda pp, m: [[f"F{k}" for k in range(m)] + [f"B{k}" for k in range(m)]
                                                for _ in range(pp)], "idle time"),
    ("checkpointing", "check_revolve_extra", lambda n, c: n - 1, "advances"),
    ("checkpointing", "check_sqrt_cost", lambda n: (n - 1, 2 * int(n**0.5)), "extra forwards"),
    ("checkpointing", "check_every_k_schedule", _every_k_without_x0_snapshot, "Snapshot(0) before its Record"),
    ("zero", "check_model_state_bytes", lambda stage, psi, n, p, g, k: (p + g + k) * psi / n, "bytes per rank"),
    ("zero", "check_sharded_update",  # only rank 0's block is updated
     lambda opt, params, grads, n, states: opt.update(params[:len(params) // n], grads[:len(params) // n], states[0]),
     "must update exactly its own block"),
    ("composition", "check_gradient_group", lambda rank, dp, pp, schedule: [rank], "sums its gradients with"),
    ("composition", "check_gradient_group", _gradient_group_descending, "in increasing order"),
    ("tensor_parallel", "check_conjugate_operators", _operators(f_forward_sums=True),
     "f's forward returned 2 times its input"),
    ("tensor_parallel", "check_conjugate_operators", _operators(f_backward_sums=False),
     "f's backward returned the rank's own gradient unchanged"),
    ("tensor_parallel", "check_conjugate_operators", _operators(f_backward_in_place=True),
     "f's backward changed the gradient it was given in place"),
    ("tensor_parallel", "check_conjugate_operators", _operators(g_forward_sums=False),
     "g's forward returned the rank's own partial output"),
    ("tensor_parallel", "check_conjugate_operators", _operators(g_forward_in_place=True),
     "g's forward changed its input in place"),
    ("tensor_parallel", "check_conjugate_operators", _operators(g_backward_sums=True),
     "g's backward returned 2 times the gradient"),
    ("tensor_parallel", "check_swiglu_slices", _swiglu_contiguous, "That is a contiguous block of the fused weight"),
    ("tensor_parallel", "check_swiglu_slices", _swiglu_up_of_another_block, "The halves hold different hidden"),
    ("tensor_parallel", "check_swiglu_slices", _swiglu_down_by_rows, "down is row-parallel"),
    ("tensor_parallel", "check_qkv_slices", _qkv_contiguous, "A contiguous block of the fused weight mixes"),
    ("experts", "check_dispatch_indices", lambda c, e: _dispatch(c, e, unstable=True), "the sort must be stable"),
    ("experts", "check_dispatch_indices", lambda c, e: _dispatch(c, e, inverse_is_order=True),
     "your inverse is the order itself"),
    ("experts", "check_dispatch_indices", lambda c, e: _dispatch(c, e, counts_from_tokens=True),
     "add up to N = 6, the tokens"),
    ("experts", "check_overlapped_order", lambda f, b: _interleave(f, b, switch_before=True),
     "switching before it starts leaves nothing in flight"),
    ("experts", "check_overlapped_order", _interleave_b_in_forward_order, "B's chunks run out of order"),
    ("experts", "check_overlapped_order", lambda f, b: [("F", c) for c in f] + [("B", c) for c in b],
     "your order never switches"),
    ("experts", "check_exposed_time", _all_alltoalls_exposed, "You counted every all-to-all as exposed"),
    ("experts", "check_exposed_time", _exposed_without_final_wait, "the step ends only when it has arrived"),
    ("planning", "check_model_state_bytes", _states_without_tp, "did not divide the blocks' matrices by tp"),
    ("planning", "check_model_state_bytes", _states_embedding_everywhere, "counted the embedding"),
    ("planning", "check_model_state_bytes", _states_over_all_gpus, "sharded over every GPU (dp·tp·pp = 1024)"),
    ("planning", "check_activation_bytes", _activations_gpipe, "that is GPipe, not 1F1B"),
    ("planning", "check_compute_seconds", _compute_without_bubble, "left out the bubble"),
    ("planning", "check_mfu", _mfu_with_recompute, "hardware FLOPs utilisation (HFU)"),
    ("planning", "check_tp_share", _tp_share_one_allreduce, "counted one all-reduce per block"),
]


@pytest.mark.parametrize("module, check, wrong, says", WRONG, ids=[w[1] for w in WRONG])
def test_checks_explain_wrong_answers(module, check, wrong, says):
    import importlib

    result = run_check(getattr(importlib.import_module(f"harness.{module}"), check), wrong)
    assert result.status in ("wrong", "error") and says in result.message, result


def test_an_error_in_the_students_code_is_reported_with_its_line():
    from harness.gpt import check_attention

    def attention(q, k, v):
        return q @ k  # shapes do not match

    result = run_check(check_attention, attention)
    assert result.status == "error" and "ValueError" in result.message and "in attention" in result.message


def test_solutions_mode_swaps_stubs_and_raises_on_a_failing_check(monkeypatch):
    from harness import Exercises
    from harness.gpt import check_count_parameters

    def attention(q, k, v):
        raise NotImplementedError

    monkeypatch.setenv("REFIMPL_TUTORIAL_SOLUTIONS", str(SOLUTIONS))
    ex = Exercises("02_gpt")
    assert ex.strict and ex.stub(attention) is not attention and ex.stub(attention).__name__ == "attention"
    with pytest.raises(AssertionError, match="reference solution fails its check"):
        ex.check(2, check_count_parameters, lambda *a: 0)
    monkeypatch.setenv("REFIMPL_TUTORIAL_SOLUTIONS", "")
    student = Exercises("02_gpt")
    assert student.stub(attention) is attention
    assert student.check(2, check_count_parameters, lambda *a: 0) is False  # printed, not raised


# ------------------------------------------------------------------------------------------------
# As notebooks (jupytext): opened in tutorials/ and run cell by cell in a Jupyter kernel
# ------------------------------------------------------------------------------------------------

NOTEBOOKS = [REPO / "tutorials" / "01_autograd.py", REPO / "tutorials" / "03_collectives.py"]


def test_a_notebook_does_not_echo_the_summary():
    for path in TUTORIALS:
        last_line = path.read_text().rstrip().splitlines()[-1]
        assert last_line.startswith("ex.summary();"), f"{path.name}: end with `ex.summary();` (no stray True/False)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_tutorial_runs_as_a_notebook(path, monkeypatch):
    """Two of the tutorials, converted by jupytext and executed in a kernel as a student opens them.

    Two, not all twelve: a kernel start plus these two take a few seconds, all twelve about a
    minute and a half (the site's build runs every tutorial cell by cell: docs/hooks.py).
    """
    jupytext = pytest.importorskip("jupytext", reason="pip install jupytext nbclient ipykernel")
    nbclient = pytest.importorskip("nbclient", reason="pip install jupytext nbclient ipykernel")
    pytest.importorskip("ipykernel", reason="pip install jupytext nbclient ipykernel")
    monkeypatch.delenv("REFIMPL_TUTORIAL_SOLUTIONS", raising=False)  # the student's view: exercises unfilled
    notebook = jupytext.read(path)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert len(code) == path.read_text().count("\n# %%\n") + (path.read_text().startswith("# %%\n"))
    last = code[-1].outputs
    printed = "".join(o.get("text", "") for o in last if o.output_type == "stream")
    n = len(exercises_of(path)[1])
    assert f"{path.stem}: 0 of {n} exercises correct" in printed
    assert not [o for o in last if o.output_type == "execute_result"], "the last cell echoes summary()'s bool"
