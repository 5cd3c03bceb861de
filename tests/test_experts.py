"""The mixture-of-experts layer (refimpl/nn/experts.py): routing, gates, capacity, the balance loss.

  * backward against finite differences (router, experts, gates and the load-balancing loss);
  * the output equals a per-token loop over the chosen experts, written independently here;
  * ties go to the lower expert index; a router that sends every token to one expert still
    computes the right output, and its load is reported;
  * the capacity rule drops, per sequence and expert, the assignments after the first
    ⌈c·K·T/E⌉ in token order;
  * outputs and the balance loss do not depend on how the batch is cut into pieces (what lets a
    distributed run equal one process with no communication for the statistics);
  * bad flags are one-line errors.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.autograd.gradcheck import gradcheck
from refimpl.autograd.tensor import Tensor
from refimpl.nn.batch_rows import batch_rows
from refimpl.nn.experts import MoE, keep_within_capacity
from refimpl.tools.run import TrainConfig


def make(E=4, K=2, C=6, capacity=None, seed=0, aux=0.01):
    return MoE(C, E, K, np.random.default_rng(seed), hidden=5, capacity_factor=capacity, aux_coef=aux,
               dtype="float64")


def reference_output(moe, x, capacity=None):
    """Per token: softmax router, the K largest (lower index on ties), renormalised gates, Σ gate·MLP_e.
    With a capacity: per sequence and expert, the first `capacity` tokens in token order."""
    B, T, C = x.shape
    w = moe.router.weight.data  # (E, C)
    out = np.zeros_like(x)
    for b in range(B):
        taken = np.zeros(moe.n_experts, int)
        for t in range(T):
            logits = w @ x[b, t]
            p = np.exp(logits - logits.max())
            p /= p.sum()
            chosen = sorted(range(moe.n_experts), key=lambda e: (-p[e], e))[:moe.top_k]
            gates = p[chosen] / p[chosen].sum()
            for e, g in zip(chosen, gates):
                taken[e] += 1
                if capacity is not None and taken[e] > capacity:
                    continue
                out[b, t] += g * moe.experts[e](Tensor(x[b, t][None])).data[0]
    return out


@settings(max_examples=25, deadline=None)
@given(E=st.sampled_from([2, 4, 8]), K=st.sampled_from([1, 2]), B=st.integers(1, 3), T=st.integers(1, 5),
       capacity=st.sampled_from([None, 0.5, 1.0, 2.0]), seed=st.integers(0, 1000))
def test_the_layer_equals_a_per_token_loop_over_the_chosen_experts(E, K, B, T, capacity, seed):
    moe = make(E, K, capacity=capacity, seed=seed)
    x = np.random.default_rng(seed + 1).standard_normal((B, T, 6))
    per_sequence = None if capacity is None else math.ceil(capacity * K * T / E)
    np.testing.assert_allclose(moe(Tensor(x)).data, reference_output(moe, x, per_sequence), rtol=1e-12, atol=1e-14)
    stats = moe.take_stats()
    assert stats["counts"].sum() == B * T * K  # routed assignments, before any drop
    assert stats["dropped"] == sum(max(0, c - per_sequence) for c in _per_sequence_counts(moe, x)) \
        if capacity is not None else stats["dropped"] == 0


def _per_sequence_counts(moe, x):
    """Assignments per (sequence, expert), flattened (for the drop count)."""
    B, T, C = x.shape
    logits = x.reshape(B * T, C) @ moe.router.weight.data.T
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :moe.top_k].reshape(B, T * moe.top_k)
    return [int((chosen[b] == e).sum()) for b in range(B) for e in range(moe.n_experts)]


def test_backward_matches_finite_differences():
    moe = make(E=4, K=2, aux=0.0)  # the balance loss's gradient is checked below, on its own
    x = Tensor(np.random.default_rng(3).standard_normal((2, 3, 6)), requires_grad=True)
    params = [moe.router.weight] + [p for e in moe.experts for p in e.parameters()]
    gradcheck(lambda x, *ps: moe(x), [x, *params])


def test_the_injected_balance_loss_gradient_matches_finite_differences_of_the_loss():
    """backward of y·0 leaves exactly ∂L_aux/∂W_router (AddAuxiliaryLoss seeds L_aux with 1)."""
    moe = make(E=4, K=2, aux=0.7)
    x = np.random.default_rng(4).standard_normal((2, 3, 6))
    with batch_rows(0, 2, 2, 0):
        (moe(Tensor(x)) * 0.0).sum().backward()
    moe.take_stats()
    w, eps = moe.router.weight.data, 1e-6
    numeric = np.zeros_like(w)
    for index in np.ndindex(w.shape):
        values = []
        for sign in (1, -1):
            w[index] += sign * eps
            with batch_rows(0, 2, 2, 0):
                moe(Tensor(x))
            values.append(moe.take_stats()["aux_loss"])
            w[index] -= sign * eps
        numeric[index] = (values[0] - values[1]) / (2 * eps)
    np.testing.assert_allclose(moe.router.weight.grad, numeric, rtol=1e-5, atol=1e-9)
    assert np.abs(numeric).max() > 1e-4  # the check can fail: the loss does move the router


def test_the_balance_loss_is_switch_transformers_per_sequence_and_reaches_the_router():
    E, K, B, T = 4, 2, 2, 3
    moe = make(E, K, aux=1.0)
    x = np.random.default_rng(5).standard_normal((B, T, 6))
    with batch_rows(0, B, B, 0):
        y = moe(Tensor(x))
    aux = moe.take_stats()["aux_loss"]
    logits = x.reshape(B * T, 6) @ moe.router.weight.data.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    chosen = np.argsort(-p, axis=1, kind="stable")[:, :K]
    expected = 0.0
    for b in range(B):
        f = np.bincount(chosen[b * T:(b + 1) * T].reshape(-1), minlength=E) / (K * T)
        expected += E * (f * p[b * T:(b + 1) * T].mean(0)).sum() / B
    assert aux == pytest.approx(expected, rel=1e-12)
    # backward of y·0: only the balance loss pulls on the router
    (y * 0.0).sum().backward()
    assert np.abs(moe.router.weight.grad).max() > 0


def test_ties_go_to_the_lower_expert_and_one_expert_taking_everything_is_still_right():
    moe = make(E=4, K=1)
    moe.router.weight.data[...] = 0.0  # every probability 1/4: a four-way tie for every token
    x = np.random.default_rng(0).standard_normal((2, 4, 6))
    np.testing.assert_allclose(moe(Tensor(x)).data, reference_output(moe, x), rtol=1e-12)
    assert moe.take_stats()["counts"].tolist() == [8, 0, 0, 0]  # all to expert 0, the lowest index
    moe.router.weight.data[2] = 50.0 * np.sign(x.reshape(-1, 6).mean(0))  # a router that prefers expert 2
    moe.router.weight.data[[0, 1, 3]] = 0.0
    big = np.abs(x) + 1.0  # inputs on which expert 2's logit is the largest
    y = moe(Tensor(big * np.sign(x.reshape(-1, 6).mean(0))))
    stats = moe.take_stats()
    assert stats["counts"].tolist() == [0, 0, 8, 0]
    np.testing.assert_allclose(y.data, reference_output(moe, big * np.sign(x.reshape(-1, 6).mean(0))), rtol=1e-12)


def test_capacity_keeps_each_experts_first_tokens_of_each_sequence():
    chosen = np.array([[0, 1], [0, 2], [0, 1], [3, 0]])  # 2 sequences of T = 2, K = 2
    keep = keep_within_capacity(chosen, T=2, n_experts=4, capacity=1)
    assert keep.tolist() == [[True, True], [False, True],  # sequence 0: expert 0's second token dropped
                             [True, True], [True, False]]  # sequence 1: the count starts again


@settings(max_examples=15, deadline=None)
@given(E=st.sampled_from([2, 4, 8]), K=st.sampled_from([1, 2]), capacity=st.sampled_from([None, 1.0]),
       cut=st.integers(1, 3), seed=st.integers(0, 1000))
def test_outputs_and_balance_loss_do_not_depend_on_how_the_batch_is_cut(E, K, capacity, cut, seed):
    moe = make(E, K, capacity=capacity, seed=seed)
    x = np.random.default_rng(seed).standard_normal((4, 3, 6))
    with batch_rows(0, 4, 4, 9):
        whole = moe(Tensor(x)).data
    aux_whole = moe.take_stats()["aux_loss"]
    parts = []
    for start, stop in ((0, cut), (cut, 4)):
        with batch_rows(start, stop, 4, 9):
            parts.append(moe(Tensor(x[start:stop])).data)
    aux_parts = moe.take_stats()["aux_loss"]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-12, atol=1e-15)
    assert aux_parts == pytest.approx(aux_whole, rel=1e-12)


@pytest.mark.parametrize("fields,message", [
    (dict(experts=4, top_k=5), "--top-k 5 must be between 1 and --experts 4"),
    (dict(experts=4, top_k=0), "--top-k 0 must be between 1 and --experts 4"),
    (dict(experts=2, model="mlp", n_head=1, seq_len=0), "use it with --model gpt"),
    (dict(experts=4, capacity_factor=0.0), "--capacity-factor must be a positive number"),
    (dict(experts=4, capacity_factor=float("nan")), "--capacity-factor must be a positive number"),
    (dict(experts=4, aux_coef=-1.0), "--aux-coef must be a finite number >= 0"),
    (dict(experts=-1), "--experts must be >= 0"),
    (dict(experts=4, moe_every=0), "--moe-every must be >= 1"),
])
def test_bad_expert_flags_are_one_line_errors(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**fields).check()


def _pinned_experts():
    from refimpl.tools.sweep import SMALL

    configs = []
    for i, (E, K) in enumerate((E, K) for E in (2, 4, 8) for K in (1, 2)):
        common = f"--model gpt --experts {E} --top-k {K} --dropout 0.1"
        configs.append(SMALL + f"{common} --n-layer 2 --batch-size 8 --zero {i % 4}".split())
        schedule = ("1f1b", "zb1p", "dualpipe", "dualpipev", "interleaved", "gpipe")[i]
        stages = 4 if schedule in ("dualpipev", "interleaved") else 2
        chunks = " --chunks 2" if schedule == "interleaved" else ""
        capacity = " --capacity-factor 1.0" if i % 2 else ""
        configs.append(SMALL + (f"{common} --pp 2 --schedule {schedule} --micro-batches 4 --batch-size 16 "
                                f"--n-layer {stages}{chunks}{capacity} --moe-every {1 + i % 2}").split())
    return configs


@pytest.mark.mpi
def test_every_expert_count_and_k_with_and_without_pipelines_equals_single_process_training(tmp_path_factory):
    """E in {2, 4, 8} x K in {1, 2}, data parallel (each ZeRO stage) and in a pipeline (six schedules),
    dropless and with a capacity factor, dropout on: verify's comparison at 4 ranks, float64."""
    from test_verify_drawn import verify_many

    results = verify_many(4, _pinned_experts(), tmp_path_factory)
    assert len(results) == 12 and all(r["ok"] for r in results)


def _expert_parallel_configs():
    """Every valid (E, K, P) at 4 ranks: without a pipeline (dp 4: P 1, 2, 4 where P divides E) and
    in a 2-stage pipeline (dp 2: P 1, 2), ZeRO stages and schedules varied along the list."""
    from refimpl.tools.sweep import SMALL

    configs, i = [], 0
    for E in (2, 4, 8):
        for K in (1, 2):
            for P in (1, 2, 4):
                if E % P:
                    continue
                common = f"--model gpt --experts {E} --top-k {K} --ep {P} --clip 0.05"
                configs.append(SMALL + f"{common} --n-layer 2 --batch-size 8 --zero {i % 4} --dropout 0.1".split())
                if P <= 2:
                    schedule = ("1f1b", "zb1p", "dualpipe", "gpipe")[i % 4]
                    configs.append(SMALL + (f"{common} --pp 2 --schedule {schedule} --micro-batches 4 --n-layer 2 "
                                            f"--batch-size 16 --zero {(i + 1) % 4}").split())
                i += 1
    return configs


@pytest.mark.mpi
def test_every_expert_parallel_combination_equals_single_process_training(tmp_path_factory):
    from test_verify_drawn import verify_many

    configs = _expert_parallel_configs()
    results = verify_many(4, configs, tmp_path_factory)
    assert len(results) == len(configs) == 28 and all(r["ok"] for r in results)


EP_BYTES = [["--model", "gpt", "--n-layer", "2", "--d-model", "8", "--n-head", "2", "--seq-len", "8",
             "--batch-size", "8", *f.split()] for f in (
    "--experts 4 --ep 2 --top-k 2 --dtype float64",
    "--experts 8 --ep 4 --top-k 1 --dtype float32 --grad-accum 2",
    "--experts 4 --ep 2 --top-k 2 --dtype float64 --n-layer 3 --checkpoint every:1 --capacity-factor 1.0",
    "--experts 4 --ep 2 --top-k 2 --dtype float64 --pp 2 --schedule zb1p --micro-batches 2 --collectives ring",
)]


@pytest.mark.mpi
def test_all_to_all_bytes_equal_the_routing_histograms_formula(tmp_path):
    """Counts (E − E/P int64) and 4·C elements per remote (token, expert) assignment, forward and
    backward (forward only for a checkpoint's first, gradient-free forward), exactly, on every rank."""
    from mpi_util import PROGRAMS, last_json, run_mpi

    path = tmp_path / "configs.json"
    path.write_text(__import__("json").dumps(EP_BYTES))
    results = last_json(run_mpi(4, [PROGRAMS / "expert_checks.py", path], timeout=300))
    assert len(results) == len(EP_BYTES)
    for r in results:
        assert r["measured"] == r["expected"], r
        assert all(m["alltoallv"] > 0 for m in r["measured"]) and all(c > 0 for c in r["calls"]), r


@pytest.mark.mpi
@pytest.mark.parametrize("ep", [2, 4])
def test_every_token_to_one_expert_still_equals_one_process_and_all_travel_to_its_rank(ep):
    from mpi_util import PROGRAMS, last_json, run_mpi

    r = last_json(run_mpi(4, [PROGRAMS / "expert_checks.py", "collapse", str(ep)], timeout=300))
    assert r["losses"][0] == pytest.approx(r["losses"][1], rel=1e-12)
    assert r["worst"] <= 1.0  # |diff| <= atol + rtol·|reference| (1e-12, 1e-10) for every gradient element
    for rank_layers in r["sent_per_rank"]:
        for sent in rank_layers:
            assert sent[0] == 16 and sum(sent) == 16  # 2 sequences of 8 tokens, K = 1: all to expert 0's rank


@pytest.mark.parametrize("fields,message", [
    (dict(ep=2), "--ep 2 splits the experts of a mixture of experts; add --experts E"),
    (dict(experts=6, ep=4), "--ep 4 does not divide --experts 6"),
    (dict(experts=4, ep=0), "--ep must be a positive integer"),
    (dict(experts=4, ep=2, save_dir="x"), "sharded checkpoints (--save-dir, --resume) of expert-parallel runs"),
    (dict(experts=4, ep=2, dtype="mixed"), "--ep with --dtype mixed is not supported yet"),
])
def test_bad_expert_parallel_flags_are_one_line_errors(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**fields).check()


@pytest.mark.mpi
def test_an_ep_that_does_not_divide_the_data_parallel_degree_is_refused_on_every_rank():
    from mpi_util import run_mpi

    done = run_mpi(4, ["-m", "refimpl", "train", "--experts", "4", "--ep", "4", "--pp", "2", "--steps", "1"],
                   timeout=120)
    assert done.returncode != 0 and "--ep 4 does not divide the data-parallel degree 2" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_balance_loss_gradient_follows_the_loss_scale():
    """Mixed precision starts backward from loss · S: the injected L_aux seed is S too (batch_rows carries it)."""
    grads = []
    for scale in (1.0, 8.0):
        moe = make(E=4, K=2, aux=0.3)
        with batch_rows(0, 2, 2, 0, loss_scale=scale):
            (moe(Tensor(np.random.default_rng(6).standard_normal((2, 3, 6)))) * 0.0).sum().backward()
        grads.append(moe.router.weight.grad.copy())
    np.testing.assert_allclose(grads[1], 8.0 * grads[0], rtol=1e-14)
    assert np.abs(grads[0]).max() > 0


def test_mixed_precision_with_experts_trains_and_verify_says_why_it_does_not_compare(capsys):
    from refimpl.tools import cli
    from refimpl.tools.run import train

    summary = train(TrainConfig(model="gpt", experts=4, top_k=2, dtype="mixed", steps=20, batch_size=8, n_layer=1,
                                d_model=16, n_head=2, seq_len=8), progress=False)
    assert math.isfinite(summary["final_loss"]) and sum(summary["experts"]["blocks.0.mlp"]["tokens_per_expert"]) > 0
    assert cli.main(["verify", "--experts", "4", "--dtype", "mixed", "--steps", "1"]) == 2
    assert "verify --dtype mixed bounds only float16 rounding of the same computation" in capsys.readouterr().err
