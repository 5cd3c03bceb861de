"""Ring attention and Ulysses at C = 2 and 4 ranks equal one process's causal attention (float64,
rtol 1e-10: the output and the gradients of q, k, v, gathered back to the global order), and every
rank's bytes sent, saved bytes and score elements equal accounting.py's formulas exactly.

hypothesis draws shapes (b, heads, key/value heads, T divisible by 2C, d_head), the implementation,
the layout, the causal skip and the collectives (MPI's all-to-all or ring.py's pairwise exchange);
one launch per world size checks the drawn list and the pinned examples (every implementation ×
layout × skip; grouped-query, multi-query and multi-head attention)
(tests/mpi_programs/context_parallel_checks.py).
"""

import json
import os

import pytest
from conftest import launches
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from mpi_util import PROGRAMS, REPO, last_json, run_mpi

pytestmark = pytest.mark.mpi

DRAWN = 6  # configurations per launch, besides the pinned ones


def config(C: int, impl: str, lay: str, skip: bool, b: int, kv: int, group: int, m: int, D: int, seed: int = 0,
           collectives: str = "mpi"):
    return {"batch": b, "heads": kv * group, "kv_heads": kv, "seq_len": 2 * C * m, "d_head": D, "impl": impl,
            "layout": lay, "causal_skip": skip, "seed": seed, "collectives": collectives}


def pinned(C: int) -> list:
    combinations = [(impl, lay, skip) for impl in ("ring", "ulysses") for lay in ("balanced", "contiguous")
                    for skip in (True, False)]
    every = [config(C, impl, lay, skip, 2, C, 2, 2, 3, seed=n) for n, (impl, lay, skip) in enumerate(combinations)]
    return every + [config(C, "ring", "balanced", True, 1, 1, 4, 1, 2, seed=9),  # multi-query, one token per chunk
                    config(C, "ulysses", "balanced", True, 1, C, 1, 3, 4, seed=10),  # multi-head
                    config(C, "ulysses", "contiguous", True, 2, C, 3, 1, 2, seed=11, collectives="ring")]


def configurations(C: int):
    @st.composite
    def one(draw):
        impl = draw(st.sampled_from(["ring", "ulysses"]))
        kv = draw(st.sampled_from([C, 2 * C]) if impl == "ulysses" else st.integers(1, 3))
        return config(C, impl, draw(st.sampled_from(["balanced", "contiguous"])), draw(st.booleans()),
                      draw(st.integers(1, 2)), kv, draw(st.integers(1, 2)), draw(st.integers(1, 3)),
                      draw(st.integers(1, 4)), draw(st.integers(0, 2 ** 31)), draw(st.sampled_from(["mpi", "ring"])))
    return st.lists(one(), min_size=DRAWN, max_size=DRAWN)


def check(C: int, configs: list, tmp_path_factory, env: dict | None = None) -> list:
    path = tmp_path_factory.mktemp("cp") / "configs.json"
    path.write_text(json.dumps(configs))
    results = last_json(run_mpi(C, [PROGRAMS / "context_parallel_checks.py", path], timeout=300, env=env))
    assert len(results) == len(configs)
    for result in results:
        cfg = result["config"]
        assert result["finite"], cfg
        assert max(result["worst"].values()) <= 1.0, (cfg, result["worst"])  # |diff| ≤ 1e-12 + 1e-10·|ref|
        assert len(result["ranks"]) == C
        for r, rank in enumerate(result["ranks"]):
            assert rank["measured"] == rank["expected"], (cfg, r, rank)
            assert rank["trace"] == rank["trace_expected"], (cfg, r, rank)  # transfer posted before compute
        computed = [rank["measured"]["computed"] for rank in result["ranks"]]
        balanced = cfg["impl"] == "ulysses" or cfg["layout"] == "balanced" or not cfg["causal_skip"]
        assert (len(set(computed)) == 1) == balanced, (cfg, computed)  # contiguous: rank r computes (4r + 3)c²
    return results


def drawn_test(C: int):
    @settings(max_examples=launches(1), deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @example(configs=pinned(C))
    @given(configs=configurations(C))
    def test(configs, tmp_path_factory):
        check(C, configs, tmp_path_factory)
    return test


test_ring_and_ulysses_at_2_ranks_equal_one_process_and_their_accounting = drawn_test(2)
test_ring_and_ulysses_at_4_ranks_equal_one_process_and_their_accounting = drawn_test(4)


def test_pinned_byte_and_score_figures_at_4_ranks(tmp_path_factory):
    """The figures of docs/context_parallel.md's table: b 2, H 8, Hkv 4, T 24 (c 3), D 3, float64."""
    configs = [config(4, impl, lay, skip, 2, 4, 2, 3, 3) for impl, lay, skip in
               [("ring", "balanced", True), ("ring", "balanced", False), ("ring", "contiguous", True),
                ("ulysses", "balanced", True)]]
    results = check(4, configs, tmp_path_factory)
    figures = [[(rank["measured"]["forward_bytes"], rank["measured"]["backward_bytes"], rank["measured"]["computed"])
                for rank in result["ranks"]] for result in results]
    send, alltoall = "send", "alltoall"
    k = 2 * 2 * 4 * 3 * 3 * 8  # one chunk's K and V: 1152 bytes
    assert figures[0] == [({send: 5 * k}, {send: 11 * k}, 16 * 81), ({send: 5 * k}, {send: 10 * k}, 16 * 81),
                          ({send: 5 * k}, {send: 9 * k}, 16 * 81), ({send: 6 * k}, {send: 9 * k}, 16 * 81)]
    assert figures[1] == [({send: 6 * k}, {send: 12 * k}, 16 * 144)] * 4
    assert figures[2] == [({send: 2 * k}, {send: 6 * k}, 16 * 27), ({send: 4 * k}, {send: 8 * k}, 16 * 63),
                          ({send: 6 * k}, {send: 10 * k}, 16 * 99), ({}, {send: 6 * k}, 16 * 135)]
    assert figures[3] == [({alltoall: 5184}, {alltoall: 5184}, 16 * 81)] * 4
    saved = (2 * 2 * 8 + 2 * 2 * 4) * 6 * 3 * 8 + 2 * 8 * 6 * 8  # q, y; k, v (T/C = 6); the log-sum-exp
    assert all(rank["measured"]["saved_bytes"] == saved for result in results for rank in result["ranks"])


@pytest.mark.parametrize("cuda_aware", ["0", "1"])
def test_on_the_cupy_backend_device_arrays_give_the_same_results_and_bytes(cuda_aware, tmp_path_factory):
    """Through tests/cupy_standin (CuPy's host/device strictness on a CPU): K/V blocks and gradients
    cross MPI staged through host memory, or directly (a CUDA-aware MPI); everything as above."""
    standin = REPO / "tests" / "cupy_standin"
    env = {"PYTHONPATH": os.pathsep.join([str(standin), str(REPO)]), "REFIMPL_BACKEND": "cupy",
           "REFIMPL_CUDA_AWARE_MPI": cuda_aware, "CUPY_STANDIN_CUDA_AWARE": cuda_aware}
    results = check(2, pinned(2), tmp_path_factory, env=env)
    assert all(result["backend"] == "cupy" and all(result["on_device"]) for result in results)
