"""checkpoint_sequential and the plans: bitwise GPT gradients, exact counts and bytes, budgets, errors.

Counts come from a counter inside each layer (TanhLayer.calls, or a forward pre-hook on GPT
blocks) and bytes from the engine's saved-tensor ledger; the expected values are the closed forms
of plans.py, written out here again.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.autograd import Tensor, backward, grad, saved_tensors
from refimpl.checkpointing import (
    LayerCost,
    actions_for,
    checkpoint_sequential,
    measure_layer_cost,
    parse_plan,
    predicted_cost,
    resolve_budget,
    revolve,
    simulate_chain,
)
from refimpl.checkpointing.gpt_blocks import apply_to_gpt, current_plan, gpt_forward
from refimpl.checkpointing.measure import count_forward_calls, measure_chain, tanh_chain
from refimpl.checkpointing.plans import Every, NoCheckpoint, Revolve, sqrt_segment
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F

PLANS = ["sqrt", "every:1", "every:2", "every:5", "every:9", "revolve:1", "revolve:2", "revolve:3", "budget:100000"]


def _gpt(dtype, n_layer=5, tie=False):
    cfg = GPTConfig(vocab_size=11, seq_len=8, n_layer=n_layer, n_head=2, d_model=16, dropout=0.1,
                    tie_weights=tie, dtype=dtype)
    return GPT(cfg, seed=3)


def _gpt_step(plan, dtype, split=False, tie=False, steps=2):
    """Two training steps' gradients (accumulated) of a GPT with dropout 0.1, blocks under `plan`."""
    model = _gpt(dtype, tie=tie)
    idx = np.random.default_rng(0).integers(0, 11, (2, 8))
    base = saved_tensors.live_bytes
    with count_forward_calls(model.blocks) as counter:
        for step in range(steps):
            loss = F.cross_entropy(gpt_forward(model, idx, plan), idx)
            if split:
                work = backward([loss], defer_weight_grads=True)
                if step == 0:  # after I, before W: no weight gradient yet, the blocks' included
                    assert all(p.grad is None for p in model.parameters())
                work.run()
            else:
                loss.backward()
    assert saved_tensors.live_bytes == base
    gens = [m.generator.bit_generator.state for m in model.modules() if hasattr(m, "generator")]
    return [p.grad for p in model.parameters()], counter.calls, gens


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("plan", PLANS)
def test_gpt_gradients_are_bitwise_equal_to_no_checkpointing(plan, dtype):
    reference, calls, gens = _gpt_step("none", dtype)
    assert calls == [2] * 5
    for split in (False, True):
        got, calls, gens_after = _gpt_step(plan, dtype, split=split)
        assert len(got) == len(reference)
        for a, b in zip(reference, got):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        assert gens_after == gens  # the next step draws the same masks as without checkpointing
        if not plan.startswith("budget"):  # (a budget probes block 0 once per forward)
            assert sum(calls) == 2 * (5 + simulate_chain(actions_for(plan, 5), 5).advances)


def test_tied_embeddings_and_functional_grad():
    reference, _, _ = _gpt_step("none", "float64", tie=True)
    got, _, _ = _gpt_step("revolve:2", "float64", tie=True)
    assert all(np.array_equal(a, b) for a, b in zip(reference, got))
    model, idx = _gpt("float64"), np.zeros((1, 8), dtype=np.int64)
    x = model.embed(idx)
    plain = grad(F.cross_entropy(model.head(checkpoint_sequential(list(model.blocks), x, "none")), idx), [x])
    model2 = _gpt("float64")
    x2 = model2.embed(idx)
    ckpt = grad(F.cross_entropy(model2.head(checkpoint_sequential(list(model2.blocks), x2, "sqrt")), idx), [x2])
    assert np.array_equal(plain[0], ckpt[0])
    assert all(p.grad is None for p in model2.parameters())


def _expected(plan: str, n: int) -> tuple[int, int]:
    """(layer forwards, peak states) for the tanh chain, whose recorded layer saves only its input."""
    name, _, arg = plan.partition(":")
    if name == "none":
        return n, n
    if name in ("every", "sqrt"):
        k = min(int(arg), n) if name == "every" else math.ceil(math.sqrt(n))
        return 2 * n - k, math.ceil(n / k) - 1 + k
    c = int(arg)
    return n + revolve.min_advances(n, c), min(c + 1, n)


@pytest.mark.parametrize("n", [16, 64, 100, 256])
def test_the_documented_numbers(n):
    """none stores n inputs; sqrt about 2√n with under one extra forward per layer; revolve the minimum."""
    for plan in ["none", "sqrt", "every:4", "revolve:2", "revolve:4", "revolve:8"]:
        m = measure_chain(tanh_chain(n), plan)
        assert (m.forward_calls, m.peak_states) == _expected(plan, n), plan
    sqrt = measure_chain(tanh_chain(n), "sqrt")
    assert sqrt.extra_forwards < n and sqrt.peak_states <= 2 * math.sqrt(n)
    assert sqrt_segment(n) == math.isqrt(n)  # 16, 64, 100, 256 are perfect squares: K = √n


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 48), k=st.integers(1, 50), c=st.integers(1, 7))
def test_exact_counts_and_peaks_for_drawn_chains(n, k, c):
    for plan in ["none", "sqrt", f"every:{k}", f"revolve:{c}"]:
        m = measure_chain(tanh_chain(n, width=4), plan)
        assert (m.forward_calls, m.peak_states) == _expected(plan, n), plan
        actions = actions_for(plan, n)
        if actions is not None:  # the simulation of the schedule predicts the same
            s = simulate_chain(actions, n, input_bytes=m.input_bytes)
            assert (s.forward_calls, s.peak_bytes) == (m.forward_calls, m.peak_bytes)


@pytest.mark.parametrize("plan", ["none", "sqrt", "every:1", "every:3", "revolve:1", "revolve:3"])
def test_gpt_block_bytes_match_the_prediction(plan):
    """For transformer blocks (which do not save their input), the ledger peak is predicted exactly."""
    model = _gpt("float32", n_layer=7)
    blocks = list(model.blocks)
    x = Tensor(np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32), requires_grad=True)
    cost = measure_layer_cost(blocks[0], x)
    assert not cost.saves_input and cost.own_bytes > 10 * cost.input_bytes
    base = saved_tensors.live_bytes
    saved_tensors.reset_peak()
    with count_forward_calls(blocks) as counter:
        y = checkpoint_sequential(blocks, x, plan)
        y.backward(np.ones_like(y.data))
    extra, peak = predicted_cost(parse_plan(plan), 7, cost)
    assert saved_tensors.peak_bytes - base == peak
    assert counter.total == 7 + extra


def test_budget_picks_the_fewest_recomputations_that_fit():
    n, cost = 16, LayerCost(input_bytes=100, own_bytes=0, saves_input=True)
    candidates = [NoCheckpoint()] + [Every(k) for k in range(1, n + 1)] + [Revolve(c) for c in range(1, n + 1)]
    for budget in (200, 300, 450, 700, 1000, 1600, 5000):
        chosen = resolve_budget(budget, n, cost)
        extra, peak = predicted_cost(chosen, n, cost)
        assert peak <= budget
        best = min(e for e, p in (predicted_cost(c, n, cost) for c in candidates) if p <= budget)
        assert extra == best, (budget, chosen)
        layers = tanh_chain(n)  # the measured peak of the chosen plan respects the budget
        A = layers[0].weight.shape[0] * 4 * 8
        m = measure_chain(layers, resolve_budget(budget * A // 100, n, LayerCost(A, 0, True)))
        assert m.peak_bytes <= budget * A // 100
    assert isinstance(resolve_budget(10**9, n, cost), NoCheckpoint)


def test_budget_measures_the_layer_itself():
    layers = tanh_chain(16)
    m = measure_chain(layers, f"budget:{7 * 256}")  # 7 states of 4x8 float64: sqrt's peak
    assert m.peak_bytes <= 7 * 256 and m.forward_calls == 28 + 1  # +1: the probe of layer 1


def test_apply_to_gpt_checkpoints_model_calls():
    model, idx = _gpt("float64"), np.random.default_rng(0).integers(0, 11, (2, 8))
    reference, _, _ = _gpt_step("none", "float64", steps=1)
    apply_to_gpt(model, "revolve:2")
    assert str(current_plan(model)) == "revolve:2"
    with count_forward_calls(model.blocks) as counter:
        model.loss(idx, idx).backward()
    assert counter.total == 5 + revolve.min_advances(5, 2)
    assert all(np.array_equal(a, b.grad) for a, b in zip(reference, model.parameters()))
    apply_to_gpt(model, "none")
    assert model.blocks_runner is None and isinstance(current_plan(model), NoCheckpoint)
    apply_to_gpt(model, "budget:1MiB")
    model.loss(idx, idx).backward()  # resolves (and caches) the budget on the first call


@pytest.mark.parametrize("text,message", [
    ("sqrtt", "unknown checkpointing plan"), ("every:0", "at least 1"), ("every:-3", "at least 1"),
    ("every:x", "must be an integer"), ("revolve:0", "at least 1"), ("revolve:", "must be an integer"),
    ("budget:lots", "number of bytes"), ("budget:0", "positive"), ("budget:12XB", "number of bytes"),
    ("sqrt:4", "takes no argument"), ("none:1", "takes no argument"),
])
def test_bad_plans_are_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_plan(text)


def test_plan_strings():
    assert parse_plan("budget:64MiB").bytes == 64 * 2**20 and parse_plan("budget:2kb").bytes == 2000
    assert parse_plan(" Revolve:3 ") == Revolve(3) and str(parse_plan("every:4")) == "every:4"
    with pytest.raises(TypeError):
        parse_plan(4)


def test_a_budget_no_plan_fits():
    with pytest.raises(ValueError, match="no plan fits.*needs 200 bytes"):
        resolve_budget(199, 16, LayerCost(100, 0, True))
    with pytest.raises(ValueError, match="no plan fits"):
        measure_chain(tanh_chain(8), "budget:100")


def test_other_bad_input():
    with pytest.raises(ValueError, match="at least one layer"):
        checkpoint_sequential([], Tensor(np.ones(3)), "sqrt")
    layers = tanh_chain(4)
    y = checkpoint_sequential(layers, Tensor(np.ones((2, 8)), requires_grad=True), "sqrt")
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated once"):
        y.sum().backward()
