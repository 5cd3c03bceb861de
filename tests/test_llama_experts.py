"""Mixtral-style experts: --arch llama with --experts E makes each expert a SwiGLU MLP (w1, w3, w2,
no biases, width --ffn-size) behind the top-K router of nn/experts.py.

  * the layer's output and gradients (the balance loss's included) against a per-token reference
    written here in plain NumPy, gradients by complex-step differentiation (as tests/test_llama.py);
  * GPT-2's experts are still GeLU MLPs with biases, Llama's SwiGLU ones of --ffn-size;
  * the parameter formula (memory.llama_parameter_tensors with experts, moe_every and ep) lists the
    built model, and each expert-parallel rank's E/ep experts; the activation bound covers the ledger;
  * verify (float64, rtol 1e-10) against single-process training: one rank, data parallelism with
    ZeRO 0-3, expert parallelism over 2 and 4 ranks, pipelines (1F1B, ZB-H1, DualPipe) with and without
    expert parallelism, activation checkpointing, a capacity factor, dropout;
  * the sweep draws Llama's block with experts.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.autograd import Tensor, saved_tensors
from refimpl.memory import expert_elements_per_token, gpt_parameters, saved_bytes
from refimpl.nn import GPT, GPTConfig
from refimpl.nn.experts import MoE
from refimpl.nn.layers import MLP, Linear, SwiGLU
from refimpl.parallel.experts import ExpertParallel
from refimpl.tools.flags import config_from_flags
from refimpl.tools.run import build_model, build_task, make_trainer
from refimpl.tools.sweep import draw_flags, numpy_chooser


# --- the layer against a per-token reference -----------------------------------------------------
def reference(w: dict, x, E: int, K: int, alpha: float, capacity: int | None):
    """(y (B, T, C), L_aux) token by token: softmax router, the K largest probabilities (lower index on
    ties, compared on real parts), gates renormalised over them, Σ gate · W₂(silu(W₁x) ⊙ W₃x); with a
    capacity, each expert takes its first `capacity` tokens of each sequence. L_aux = α·E/B ·
    Σ_sequences Σ_e f_e·P_e (Switch Transformer, per sequence). Works on complex weights."""
    B, T, C = x.shape
    y = np.zeros((B, T, C), dtype=np.result_type(x, *w.values()))
    aux = 0.0
    for b in range(B):
        taken, counts, prob_sum = np.zeros(E, int), np.zeros(E), 0.0
        for t in range(T):
            logits = w["router.weight"] @ x[b, t]
            e_ = np.exp(logits - logits.real.max())
            p = e_ / e_.sum()
            prob_sum = prob_sum + p
            chosen = sorted(range(E), key=lambda e: (-p[e].real, e))[:K]
            gates = p[chosen] / p[chosen].sum()
            for e, g in zip(chosen, gates):
                counts[e] += 1
                taken[e] += 1
                if capacity is not None and taken[e] > capacity:
                    continue
                gate = w[f"experts.{e}.w1.weight"] @ x[b, t]
                up = w[f"experts.{e}.w3.weight"] @ x[b, t]
                y[b, t] = y[b, t] + g * (w[f"experts.{e}.w2.weight"] @ (gate / (1 + np.exp(-gate)) * up))
        aux = aux + E * np.sum(counts / (K * T) * prob_sum / T)
    return y, alpha * aux / B


@settings(max_examples=10, deadline=None)
@given(E=st.sampled_from([2, 4]), K=st.sampled_from([1, 2]), B=st.integers(1, 2), T=st.integers(1, 4),
       capacity=st.sampled_from([None, 1.0]), seed=st.integers(0, 1000))
def test_swiglu_experts_equal_a_per_token_reference_output_and_gradients(E, K, B, T, capacity, seed):
    C, F, alpha = 6, 5, 0.3
    moe = MoE(C, E, K, np.random.default_rng(seed), hidden=F, capacity_factor=capacity, aux_coef=alpha,
              dtype="float64", expert="swiglu")
    rng = np.random.default_rng(seed + 1)
    for p in moe.parameters():  # away from the small initialisation: gates and SwiGLU of order one
        p.data += rng.standard_normal(p.shape) * 0.5
    x = Tensor(rng.standard_normal((B, T, C)), requires_grad=True)
    r = rng.standard_normal((B, T, C))  # the objective Σ y·r; backward adds L_aux's gradient (seed 1)
    per_sequence = None if capacity is None else math.ceil(capacity * K * T / E)
    y = moe(x)
    (y * Tensor(r)).sum().backward()
    weights = {name: p.data.astype(np.complex128) for name, p in moe.named_parameters()}
    y_ref, aux_ref = reference(weights, x.data.astype(np.complex128), E, K, alpha, per_sequence)
    np.testing.assert_allclose(y.data, y_ref.real, rtol=1e-10, atol=1e-14)
    assert moe.take_stats()["aux_loss"] == pytest.approx(aux_ref.real, rel=1e-10, abs=0)

    def objective(w, inputs):
        out, aux = reference(w, inputs, E, K, alpha, per_sequence)
        return np.sum(out * r) + aux

    for name, p in [*moe.named_parameters(), ("x", x)]:  # each gradient along two random directions
        for _ in range(2):
            v = rng.standard_normal(p.shape)
            w, inputs = dict(weights), x.data.astype(np.complex128)
            if name == "x":
                inputs = inputs + 1e-30j * v
            else:
                w[name] = weights[name] + 1e-30j * v
            along = objective(w, inputs).imag / 1e-30
            assert float(np.sum(p.grad * v)) == pytest.approx(along, rel=1e-10, abs=1e-13), name


def test_llama_experts_are_swiglu_of_the_ffn_size_and_gpt2_experts_stay_gelu_mlps():
    llama = GPT(GPTConfig(11, 8, n_layer=2, n_head=4, d_model=16, arch="llama", kv_heads=2, ffn_size=24, n_experts=4,
                          moe_every=2, dtype="float64"))
    assert isinstance(llama.blocks[0].mlp, SwiGLU) and isinstance(llama.blocks[1].mlp, MoE)  # moe_every 2: block 1
    expert = llama.blocks[1].mlp.experts[3]
    assert isinstance(expert, SwiGLU)
    assert {n: p.shape for n, p in expert.named_parameters()} == {"w1.weight": (24, 16), "w3.weight": (24, 16),
                                                                  "w2.weight": (16, 24)}
    assert np.std(expert.w2.weight.data) < np.std(expert.w1.weight.data)  # the residual projection's 0.02/√(2L)
    gpt2 = GPT(GPTConfig(11, 8, n_layer=1, n_head=4, d_model=16, n_experts=2, dtype="float64"))
    assert isinstance(gpt2.blocks[0].mlp.experts[0], MLP)
    assert [n for n, _ in gpt2.blocks[0].mlp.experts[0].named_parameters()] == [
        "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
    with pytest.raises(ValueError, match="unknown expert MLP 'relu'; choose one of gelu, swiglu"):
        MoE(4, 2, 1, np.random.default_rng(0), expert="relu")


@pytest.mark.parametrize("expert", ["gelu", "swiglu"])
def test_experts_are_drawn_after_the_router_one_after_the_other(expert):
    """GPT-2's experts stay the weights they were (the router, then MLP [C, 4C, C] after MLP, from the
    same generator), bit for bit; SwiGLU experts are drawn in the same order."""
    moe = MoE(6, 3, 2, np.random.default_rng(7), last_std=0.01, dtype="float64", expert=expert)
    rng = np.random.default_rng(7)
    router = Linear(6, 3, rng, bias=False, std=0.02, dtype="float64")
    experts = [MLP([6, 24, 6], rng, "gelu", std=0.02, last_std=0.01, dtype="float64") if expert == "gelu" else
               SwiGLU(6, 24, rng, std=0.02, last_std=0.01, dtype="float64") for _ in range(3)]
    assert np.array_equal(moe.router.weight.data, router.weight.data)
    for e, built in enumerate(experts):
        assert [n for n, _ in moe.experts[e].named_parameters()] == [n for n, _ in built.named_parameters()]
        assert all(np.array_equal(p.data, q.data) for p, q in zip(moe.experts[e].parameters(), built.parameters()))


# --- the accounting --------------------------------------------------------------------------------
class GroupOf:
    """What ExpertParallel reads of an expert-parallel group while keeping its experts: size and rank."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank


@pytest.mark.parametrize("E,moe_every,ep,kv,ffn,layers", [(4, 1, 1, 2, 24, 2), (4, 2, 2, 1, 20, 3),
                                                         (8, 1, 4, 4, 12, 2), (2, 3, 2, 2, 24, 3)])
def test_parameter_formula_counts_swiglu_experts_exactly_per_expert_parallel_rank(E, moe_every, ep, kv, ffn, layers):
    """memory.gpt_parameters(arch "llama", experts, moe_every, ep) against what each rank holds after
    ExpertParallel keeps its E/ep experts: the router whole, 3·h·F per expert, the rest unchanged."""
    h = 16
    cfg = GPTConfig(11, 8, n_layer=layers, n_head=4, d_model=h, arch="llama", kv_heads=kv, ffn_size=ffn, n_experts=E,
                    moe_every=moe_every, dtype="float64")
    whole = sum(p.size for p in GPT(cfg).parameters())
    moe_blocks = layers // moe_every
    dense = gpt_parameters(11, 8, h, layers, arch="llama", kv_width=kv * 4, ffn=ffn)
    assert whole == sum(dense.values()) + moe_blocks * (E * h + (E - 1) * 3 * h * ffn)
    for rank in range(ep):
        model = GPT(cfg)
        for module in model.modules():
            if isinstance(module, MoE):
                module.experts_runner = ExpertParallel(module, GroupOf(ep, rank))
        held = gpt_parameters(11, 8, h, layers, arch="llama", kv_width=kv * 4, ffn=ffn, experts=E,
                              moe_every=moe_every, ep=ep)
        experts = sum(p.size for n, p in model.named_parameters() if ".mlp.experts." in n)
        assert experts == held["experts"] == moe_blocks * (E // ep) * 3 * h * ffn
        assert sum(p.size for p in model.parameters()) == sum(held.values())


def test_the_preflight_check_counts_llama_with_experts_from_its_flags():
    from refimpl.tools.runtime import preflight  # noqa: PLC0415 - only here

    cfg = config_from_flags(["--arch", "llama", "--kv-heads", "1", "--ffn-size", "40", "--n-layer", "3", "--experts",
                             "4", "--moe-every", "2"])
    task = build_task(cfg)
    built = sum(p.size for p in build_model(cfg, task).parameters())
    assert preflight.count(preflight.parameter_tensors(cfg, task.vocab_size, task.seq_len)) == built


@pytest.mark.parametrize("K", [1, 2])
def test_the_swiglu_expert_activation_bound_covers_the_ledger(K):
    """The ledger's saved bytes of a step lie between the dense Llama's formula (which the bound keeps
    counting) minus the dense SwiGLU's 3·N·F per block, plus K·(3F + 2h) per token and block (the
    experts' own activations), and the dense formula plus memory.expert_elements_per_token's bound."""
    cfg = config_from_flags(["--arch", "llama", "--kv-heads", "2", "--ffn-size", "48", "--experts", "4", "--top-k",
                             str(K), "--steps", "1", "--dtype", "float64"])
    task = build_task(cfg)
    trainer = make_trainer(cfg, build_model(cfg, task), None)
    saved_tensors.reset_peak()
    before = saved_tensors.live_bytes
    trainer.step(*task.batch(0, cfg.batch_size))
    measured = saved_tensors.peak_bytes - before
    h, F, L, N = cfg.d_model, cfg.ffn_size, cfg.n_layer, cfg.batch_size * cfg.seq_len
    dense = saved_bytes(cfg.batch_size, cfg.seq_len, h, cfg.n_head, task.vocab_size, L, 8, False, arch="llama",
                        kv_width=cfg.kv_heads * h // cfg.n_head, ffn=F)
    assert expert_elements_per_token(h, 4, K, F) == K * (3 * F + 6 * h) + 8
    assert dense - 8 * L * N * 3 * F + 8 * L * N * K * (3 * F + 2 * h) < measured
    assert measured <= dense + 8 * L * N * expert_elements_per_token(h, 4, K, F)


# --- through every parallelism that runs experts, against one process -------------------------------
LLAMA = ["--arch", "llama", "--kv-heads", "2", "--ffn-size", "24", "--d-model", "16", "--n-head", "4", "--seq-len", "8",
         "--steps", "2", "--n-layer", "2", "--experts", "4", "--clip", "0.05"]

ON_ONE = [LLAMA + ["--batch-size", "8"],
          LLAMA + ["--batch-size", "8", "--zero", "3", "--top-k", "1", "--dropout", "0.1"]]
ON_TWO = [LLAMA + ["--batch-size", "8", "--zero", "2"],
          LLAMA + ["--batch-size", "8", "--zero", "0", "--kv-heads", "1", "--grad-accum", "2", "--moe-every", "2"],
          LLAMA + ["--batch-size", "8", "--ep", "2", "--zero", "1", "--capacity-factor", "1.0"],
          LLAMA + ["--batch-size", "8", "--ep", "2", "--checkpoint", "every:1", "--dropout", "0.1"],
          LLAMA + ["--batch-size", "8", "--pp", "2", "--schedule", "1f1b", "--micro-batches", "4"],
          LLAMA + ["--batch-size", "8", "--pp", "2", "--schedule", "zb1p", "--micro-batches", "4", "--zero", "3"]]
ON_FOUR = [LLAMA + ["--batch-size", "8", "--ep", "2", "--zero", "2"],
           LLAMA + ["--batch-size", "8", "--ep", "4", "--zero", "3", "--top-k", "1"],
           LLAMA + ["--batch-size", "8", "--ep", "4", "--experts", "8", "--kv-heads", "4"],
           LLAMA + ["--batch-size", "16", "--pp", "2", "--schedule", "1f1b", "--micro-batches", "4", "--zero", "1"],
           LLAMA + ["--batch-size", "16", "--pp", "2", "--schedule", "1f1b", "--micro-batches", "4", "--ep", "2"],
           LLAMA + ["--batch-size", "16", "--pp", "2", "--schedule", "dualpipe", "--micro-batches", "4", "--ep", "2",
                    "--zero", "2"]]


@pytest.mark.mpi
@pytest.mark.parametrize("world,configs", [(1, ON_ONE), (2, ON_TWO), (4, ON_FOUR)])
def test_llama_with_experts_equals_single_process_training(world, configs, tmp_path_factory):
    from test_verify_drawn import verify_many  # noqa: PLC0415 - the drawn tests' launcher, only here

    results = verify_many(world, configs, tmp_path_factory)
    assert len(results) == len(configs) and all(r["ok"] and r["trainer"] == "Trainer" for r in results)
    if world == 4:
        assert {r["strategy"] for r in results} >= {"ZeroStage1", "ZeroStage2", "ZeroStage3"}


@pytest.mark.parametrize("world", [2, 4])
def test_the_sweep_draws_llama_with_experts(world):
    """draw_flags gives Llama's block to GPTs with experts too: valid, and across draws with expert
    parallelism, pipelines, K 1 and 2 and a capacity factor."""
    rng = np.random.default_rng(world + 10)
    seen = set()
    for _ in range(600):
        cfg = config_from_flags(draw_flags(world, numpy_chooser(rng)))
        cfg.check()
        if cfg.arch == "llama" and cfg.experts:
            seen |= {("ep", cfg.ep), ("pp", cfg.pp > 1), ("k", cfg.top_k), ("capacity", cfg.capacity_factor)}
    assert {("ep", 1), ("ep", 2), ("pp", True), ("pp", False), ("k", 1), ("k", 2), ("capacity", 1.0)} <= seen, seen
