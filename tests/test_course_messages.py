"""The checks name the likely mistake, and test the general case before the degenerate one (whose
message, when it comes, says what it means). Each wrong answer below is a mistake the check names."""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tutorials") not in sys.path:
    sys.path.insert(0, str(REPO / "tutorials"))

from harness import run_check  # noqa: E402

SOLUTIONS = REPO / "tutorials" / "solutions"


def solution(tutorial: str, name: str):
    return runpy.run_path(str(SOLUTIONS / f"{tutorial}.py"))[name]


def message(module: str, check: str, answer) -> str:
    result = run_check(getattr(importlib.import_module(f"harness.{module}"), check), answer)
    assert result.status == "wrong", result
    return result.message


def _tp_2_per_block(n_layer, tokens, width, t, itemsize, first, last):
    elements = 2 * n_layer * tokens * width + (int(first) + int(last)) * tokens * width + (3 * tokens if last else 0)
    return 2 * elements * (t - 1) // t * itemsize


def _tp_no_embedding(n_layer, tokens, width, t, itemsize, first, last):
    elements = 4 * n_layer * tokens * width + int(last) * tokens * width + (3 * tokens if last else 0)
    return 2 * elements * (t - 1) // t * itemsize


def _selective_as_full(run, cluster):
    full = type(run)(**{**run.__dict__, "checkpoint": "full"}) if run.checkpoint == "selective" else run
    return solution("12_planning_a_run", "compute_seconds")(full, cluster)


def _no_ring_factor(h, t, cluster):
    from refimpl.tools.cluster.model import EFFICIENCY

    comm = 2 * 2 * h * 2 / (cluster.intra_bandwidth * EFFICIENCY.network)
    gemm = 24 * h * h / t / (cluster.flops("mixed") * EFFICIENCY.gemm)
    return comm / (comm + gemm)


CASES = [
    ("autograd", "check_sigmoid_backward", lambda y, g: y * (1 - y), "not multiplied by grad_out"),
    ("autograd", "check_sigmoid_backward", lambda y, g: g * (1 - y * y), "tanh's derivative"),
    ("autograd", "check_linear_backward", lambda x, w, g: (g @ w, (g.reshape(-1, 2).T @ x.reshape(-1, 3)).T,
                                                          g.reshape(-1, 2).sum(0)), "transposed"),
    ("autograd", "check_linear_backward", lambda x, w, g: (g @ w, g.reshape(-1, 2).T @ x.reshape(-1, 3), g),
     "db sums g over all leading dimensions"),
    ("gpt", "check_attention", lambda q, k, v: _softmax(q @ k.transpose(0, 1, 3, 2) / 2.0) @ v, "no causal mask"),
    ("gpt", "check_count_parameters", lambda V, T, L, d: V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d,
     "lm_head"),
    ("collectives", "check_allreduce_bytes", lambda L, N, r, item: int(2 * (N - 1) / N * L * item),
     "holds only when N divides L"),
    ("tensor_parallel", "check_tp_allreduce_bytes", _tp_2_per_block, "2 all-reduces per block"),
    ("tensor_parallel", "check_tp_allreduce_bytes", _tp_no_embedding, "the embedding's all-reduce is missing"),
    ("planning", "check_compute_seconds", _selective_as_full, "costed selective recomputation as full"),
    ("planning", "check_tp_share", _no_ring_factor, "sent the whole buffer twice"),
]


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("module, check, answer, names", CASES, ids=[f"{c[1]}-{c[3][:24]}" for c in CASES])
def test_the_message_names_the_likely_mistake(module, check, answer, names):
    assert names in message(module, check, answer)


def test_the_general_case_comes_before_the_degenerate_one():
    # a formula right only for one rank fails first on several ranks, not on N = 1
    assert " over 4 ranks" in message("collectives", "check_allreduce_bytes", lambda L, N, r, item: 0)
    assert " over 2 ranks" in message("collectives", "check_bottleneck_bytes", lambda L, N, item: 0)
    assert message("checkpointing", "check_sqrt_cost", lambda n: (0, 1)).startswith("n=10:")
    assert message("checkpointing", "check_every_k_schedule", lambda n, k: []).startswith("n=7, K=3:")
    assert "t = 8 " in message("planning", "check_tp_share", lambda h, t, cluster: 0.5)
    # and the degenerate case, reached by an answer right everywhere else, says what it means
    sqrt_cost = solution("06_checkpointing", "sqrt_cost")
    assert "one segment" in message("checkpointing", "check_sqrt_cost", lambda n: (1, 1) if n == 1 else sqrt_cost(n))
    ring = solution("03_collectives", "allreduce_bytes")
    assert "no neighbour" in message("collectives", "check_allreduce_bytes",
                                     lambda L, N, r, item: 8 if N == 1 else ring(L, N, r, item))
    share = solution("12_planning_a_run", "tp_share")
    assert "a group of one rank all-reduces nothing" in message(
        "planning", "check_tp_share", lambda h, t, cluster: 0.1 if t == 1 else share(h, t, cluster))
