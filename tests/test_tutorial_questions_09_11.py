"""Tutorials 09-11's derived exercises: each check passes the reference solution
and rejects subtly wrong answers with a message that names the mistake; the rule exercise 09.4 is
checked against agrees with the memory ledger of real runs; every tutorial has its question and
the solution its model answer."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_util import run_mpi_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tutorials"))  # the exercise harness, as the tutorials import it
from harness import run_check  # noqa: E402
from harness.composition import check_stage_model_states, reference_stage_model_states  # noqa: E402
from harness.experts import check_alltoall_bytes  # noqa: E402
from harness.tensor_parallel import check_tp_allreduce_bytes  # noqa: E402
from tutorial_util import solution  # noqa: E402

TUTORIALS = {"09": "09_everything_together", "10": "10_tensor_parallel", "11": "11_experts_and_overlap"}


# -- 09.4: model states per pipeline rank ---------------------------------------------------------

def _states(n_layer, d_model, seq_len, vocab_size, dp, pp, zero, *, pad=True, whole_padded=True, ends="right",
            first_heavy=True, wpe=True, zero_as=None):
    """A configurable derivation: the right one with the defaults, each usual mistake by one switch."""
    zero = zero if zero_as is None else zero_as
    C = d_model
    sizes = [n_layer // pp + (1 if s < n_layer % pp else 0) for s in range(pp)]
    if not first_heavy:
        sizes = sizes[::-1]
    result = []
    for s, blocks in enumerate(sizes):
        psi = blocks * (12 * C * C + 13 * C)
        first, last = (s == 0, s == pp - 1) if ends == "right" else (s == pp - 1, s == 0)
        psi += (vocab_size * C + (seq_len * C if wpe else 0)) if first else 0
        psi += (2 * C + vocab_size * C) if last else 0
        padded = -(-psi // dp) * dp if zero and pad else psi
        shard = padded // dp if pad else psi / dp
        whole = padded if whole_padded else psi
        result.append({"parameters": 4 * whole, "gradients": 4 * (shard if zero >= 2 else whole),
                       "optimizer_states": 8 * (shard if zero >= 1 else whole)})
    return result


WRONG_MODEL_STATES = [
    (lambda *a: _states(*a, pad=False), "padded to a multiple of dp"),
    (lambda *a: _states(*a, whole_padded=False), "the whole buffers are padded too"),
    (lambda *a: _states(*a, first_heavy=False), "the first L mod pp stages get one layer more"),
    (lambda *a: _states(*a, ends="swapped"), "the embeddings (token and position) are on the first stage"),
    (lambda *a: _states(*a, wpe=False), "the position embedding"),
    (lambda L, C, T, V, dp, pp, zero: _states(L, C, T, V, dp, pp, zero, zero_as=min(zero, 1)), "ZeRO-1's split"),
]


def test_09_solution_passes():
    assert run_check(check_stage_model_states, solution(TUTORIALS["09"], "stage_model_states")).ok


@pytest.mark.parametrize("wrong, says", WRONG_MODEL_STATES, ids=[w[1][:30] for w in WRONG_MODEL_STATES])
def test_09_wrong_answers_are_named(wrong, says):
    assert _states(3, 20, 6, 11, 3, 2, 2) == reference_stage_model_states(3, 20, 6, 11, 3, 2, 2)  # the switchboard
    result = run_check(check_stage_model_states, wrong)
    assert result.status == "wrong" and says in result.message, result


@pytest.mark.mpi
@pytest.mark.parametrize("n_layer, d_model, seq_len, dp, zero", [(3, 20, 6, 3, 1), (3, 20, 6, 3, 2), (4, 32, 8, 2, 2)])
def test_09_rule_is_the_ledgers(n_layer, d_model, seq_len, dp, zero):
    """The check's reference equals what train --json's memory ledger reports, with ZeRO's padding."""
    report = run_mpi_json(2 * dp, ["-m", "refimpl", "train", "--model", "gpt", "--n-layer", n_layer, "--d-model",
                                   d_model, "--n-head", 2, "--seq-len", seq_len, "--batch-size", 4 * dp, "--steps", 1,
                                   "--pp", 2, "--schedule", "1f1b", "--micro-batches", 2, "--zero", zero, "--json"],
                          timeout=180)
    measured = report["pipeline"]["model_state_bytes"]
    vocab = 11  # the sorting task's vocabulary at these sequence lengths
    expected = reference_stage_model_states(n_layer, d_model, seq_len, vocab, dp, 2, zero)
    for kind in ("parameters", "gradients", "optimizer_states"):
        assert measured[kind] == [rank[kind] for rank in expected], (kind, measured, expected)


# -- 10.4: tensor parallelism's all-reduce bytes ---------------------------------------------------

def _tp_bytes(L, N, C, t, item, first, last, *, loss=3, ends=True, every_end=False, factor=2, ring=True,
              backward=True):
    right_ends = (2 if every_end else int(first) + int(last)) if ends else 0
    elements = (2 * L if backward else 0) + 2 * L + right_ends
    if not backward:
        elements = 2 * L + int(first)
    elements = elements * N * C + (loss * N if last else 0)
    return (factor * elements * (t - 1) // t if ring else factor * elements) * item


WRONG_TP = [
    (lambda *a: _tp_bytes(*a, loss=0), "the loss's all-reduces are missing"),
    (lambda *a: _tp_bytes(*a, loss=1), "the loss all-reduces N numbers, not 3N"),
    (lambda *a: _tp_bytes(*a, ends=False), "the ends are missing"),
    (lambda *a: _tp_bytes(*a, every_end=True), "every stage counted the embedding's and the head's"),
    (lambda *a: _tp_bytes(*a, factor=1), "not E(t − 1)/t"),
    (lambda *a: _tp_bytes(*a, ring=False), "not 2E"),
    (lambda *a: _tp_bytes(*a, backward=False), "only the forward's all-reduces"),
]


def test_10_solution_passes():
    assert run_check(check_tp_allreduce_bytes, solution(TUTORIALS["10"], "tp_allreduce_bytes")).ok
    assert run_check(check_tp_allreduce_bytes, _tp_bytes).ok  # the switchboard's defaults are right


@pytest.mark.parametrize("wrong, says", WRONG_TP, ids=[w[1][:30] for w in WRONG_TP])
def test_10_wrong_answers_are_named(wrong, says):
    result = run_check(check_tp_allreduce_bytes, wrong)
    assert result.status == "wrong" and says in result.message, result


def test_10_a_group_of_one_sends_nothing():
    result = run_check(check_tp_allreduce_bytes, lambda L, N, C, t, item, first, last:
                       _tp_bytes(L, N, C, max(t, 2), item, first, last))
    assert result.status == "wrong" and "a group of 1 has no one to send to" in result.message, result


# -- 11.4: all-to-all bytes for a given routing ----------------------------------------------------

def _a2a(chosen, E, C, item, *, counts_item=8, counts_all=False, counts_twice=False, symmetric=False,
         local=False, forward_only=False, dedup=False):
    P = len(chosen)
    per = E // P
    result = []
    for r in range(P):
        def to_ranks(c):
            homes = np.asarray(c).reshape(len(c), -1) // per
            return [set(row.tolist()) for row in homes] if dedup else [row.tolist() for row in homes]
        away = sum(sum(1 for h in row if h != r) for row in to_ranks(chosen[r]))
        back = sum(sum(1 for h in row if h == r) for s in range(P) if s != r for row in to_ranks(chosen[s]))
        mine = sum(sum(1 for h in row if h == r) for row in to_ranks(chosen[r]))
        counts = counts_item * (E if counts_all else E - per) * (2 if counts_twice else 1)
        rows = 2 * away if symmetric else away + back + (2 * mine if local else 0)
        result.append({"alltoall": counts, "alltoallv": (1 if forward_only else 2) * rows * C * item})
    return result


WRONG_A2A = [
    (lambda ch, E, C, item: _a2a(ch, E, C, item, counts_item=item), "the counts are int64"),
    (lambda ch, E, C, item: _a2a(ch, E, C, item, counts_all=True), "E − E/P in all"),
    (lambda ch, E, C, item: _a2a(ch, E, C, item, counts_twice=True), "the counts are exchanged once"),
    (lambda ch, E, C, item: _a2a(ch, E, C, item, symmetric=True), "depend on the other ranks' routing"),
    (lambda ch, E, C, item: _a2a(ch, E, C, item, local=True), "own experts never leave it"),
    (lambda ch, E, C, item: _a2a(ch, E, C, item, forward_only=True), "the backward sends as much"),
    (lambda ch, E, C, item: _a2a(ch, E, C, item, dedup=True), "no de-duplication"),
]


def test_11_solution_passes():
    assert run_check(check_alltoall_bytes, solution(TUTORIALS["11"], "alltoall_bytes")).ok
    assert run_check(check_alltoall_bytes, _a2a).ok  # the switchboard's defaults are right


@pytest.mark.parametrize("wrong, says", WRONG_A2A, ids=[w[1][:30] for w in WRONG_A2A])
def test_11_wrong_answers_are_named(wrong, says):
    result = run_check(check_alltoall_bytes, wrong)
    assert result.status == "wrong" and says in result.message, result


def test_11_a_wrong_shape_is_explained():
    result = run_check(check_alltoall_bytes, lambda ch, E, C, item: [0] * len(ch))
    assert result.status == "wrong" and "should be a dict" in result.message, result


# -- the questions and their model answers ---------------------------------------------------------

@pytest.mark.parametrize("number", sorted(TUTORIALS))
def test_question_and_model_answer(number):
    text = (REPO / "tutorials" / f"{TUTORIALS[number]}.py").read_text()
    assert len(re.findall(r"^# \*\*Question \(measure and explain\)\.\*\*", text, re.M)) == 1
    assert text.index("**Question (measure and explain).**") < text.index("# ## Exercises")
    tree = ast.parse((REPO / "tutorials" / "solutions" / f"{TUTORIALS[number]}.py").read_text())
    answers = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and any(getattr(t, "id", None) == "ANSWER" for t in node.targets)]
    assert len(answers) == 1 and answers[0].strip().startswith("Model answer")
    assert 8 <= len(answers[0].strip().splitlines()) <= 20
