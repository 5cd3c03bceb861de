"""The Llama block (--arch llama): its operations gradchecked, the whole model against an independent
per-token reference, the command line, the memory formulas against the ledger.

The reference below is plain NumPy written token by token and head by head, sharing no code with
refimpl.nn. Its gradients come from complex-step differentiation (Squire & Trapp 1998): for a
real-analytic f, Im f(w + iεv)/ε = v·∇f(w) + O(ε²) with no subtraction, so ε = 1e-30 gives the
directional derivative to float64 precision, and rtol 1e-10 applies to gradients as to the loss.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_util import PROGRAMS, last_json, run_mpi

from refimpl.autograd import Tensor, gradcheck, saved_tensors
from refimpl.memory import gpt_parameter_tensors, saved_bytes, saved_elements_per_block
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F
from refimpl.nn.layers import GroupedQueryAttention
from refimpl.tools import cli
from refimpl.tools.flags import config_from_flags
from refimpl.tools.run import build_model, build_task, make_trainer

shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


def tensor(shape, seed):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


# --- every operation gradchecked -----------------------------------------------------------------
@given(shape=shapes, seed=st.integers(0, 10_000))
@settings(max_examples=15)
def test_rms_norm_gradcheck(shape, seed):
    assert gradcheck(F.rms_norm, [tensor(shape, seed), tensor(shape[-1:], seed + 1)])


@given(rows=st.integers(1, 5), pairs=st.integers(1, 3), lead=shapes, seed=st.integers(0, 10_000))
@settings(max_examples=15)
def test_rotary_gradcheck(rows, pairs, lead, seed):
    positions = np.random.default_rng(seed).integers(0, 50, rows)
    assert gradcheck(lambda x: F.rotary(x, positions), [tensor(lead + (rows, 2 * pairs), seed)])


@given(shape=shapes, seed=st.integers(0, 10_000))
@settings(max_examples=15)
def test_swiglu_gradcheck(shape, seed):
    a, b = tensor(shape, seed), tensor(shape, seed + 1)
    a.data *= 4  # reach the tails of the sigmoid too
    assert gradcheck(F.swiglu, [a, b])


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention_gradcheck(kv_heads):
    """The whole attention layer (projections, RoPE, the broadcast over the group axis, the core)."""
    attn = GroupedQueryAttention(8, 4, kv_heads, 5, np.random.default_rng(kv_heads), proj_std=0.3)
    params = attn.parameters()
    for p in params:
        p.data *= 10  # scores of order one, not a near-uniform softmax

    x = tensor((2, 5, 8), 7)
    assert gradcheck(lambda x: attn(x), [x])
    assert gradcheck(lambda *weights: attn(x), params)  # gradcheck nudges the parameters' own arrays


def test_swiglu_does_not_overflow_far_out():
    a = Tensor(np.array([-800.0, 800.0]), requires_grad=True)
    y = F.swiglu(a, Tensor(np.ones(2)))
    y.sum().backward()
    assert np.array_equal(y.data, [-0.0, 800.0]) and np.array_equal(a.grad, [0.0, 1.0])


def test_rotary_scores_depend_on_relative_position_only():
    """(R_m q)·(R_n k) = (R_{m+c} q)·(R_{n+c} k): RoPE's defining property (Su et al. 2021)."""
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((1, 8)), rng.standard_normal((1, 8))
    score = lambda m, n: float(np.sum(F.rotary(Tensor(q), [m]).data * F.rotary(Tensor(k), [n]).data))  # noqa: E731
    assert score(3, 7) == pytest.approx(score(10, 14), rel=1e-12)
    assert score(0, 5) == pytest.approx(score(20, 25), rel=1e-12)
    assert score(3, 7) != pytest.approx(score(3, 8), rel=1e-3)
    assert score(0, 0) == pytest.approx(float(np.sum(q * k)), rel=1e-14)  # position 0: no rotation


def test_rotary_uses_adjacent_pairs():
    """Pair (x₀, x₁) is rotated by p·θ₀ = p radians, pair (x₂, x₃) by p·10000^(−1/2)."""
    y = F.rotary(Tensor(np.array([[1.0, 0.0, 1.0, 0.0]])), [2]).data[0]
    assert np.allclose(y, [np.cos(2), np.sin(2), np.cos(0.02), np.sin(0.02)], rtol=1e-14, atol=0)


# --- the whole model against a per-token reference -----------------------------------------------
def reference_loss(w: dict, idx, cfg: GPTConfig):
    """Mean cross-entropy of next-token targets idx (as the model is asked: targets = idx), one token
    and one head at a time. Works on complex weights (for the complex step)."""
    B, T = idx.shape
    H, Hkv, C = cfg.n_head, cfg.n_kv_heads, cfg.d_model
    D, G = C // H, H // Hkv
    eps = 1e-5

    def rms(x, g):
        return g * x / np.sqrt(np.sum(x * x) / len(x) + eps)

    def rope(v, pos):
        out = v.copy()
        for i in range(D // 2):
            angle = pos * 10000.0 ** (-2 * i / D)
            c, s = np.cos(angle), np.sin(angle)
            out[2 * i] = v[2 * i] * c - v[2 * i + 1] * s
            out[2 * i + 1] = v[2 * i] * s + v[2 * i + 1] * c
        return out

    head = w["wte.weight"] if cfg.tie_weights else w["lm_head.weight"]
    total = 0.0
    for b in range(B):
        xs = [w["wte.weight"][idx[b, t]] for t in range(T)]
        for layer in range(cfg.n_layer):
            p = lambda name: w[f"blocks.{layer}.{name}"]  # noqa: E731, B023
            hs = [rms(x, p("ln1.weight")) for x in xs]
            qs = [p("attn.wq.weight") @ h for h in hs]
            ks = [p("attn.wk.weight") @ h for h in hs]
            vs = [p("attn.wv.weight") @ h for h in hs]
            new = []
            for t in range(T):
                heads = []
                for hd in range(H):
                    kv = hd // G  # query head hd uses key/value head hd // G
                    q = rope(qs[t][hd * D:(hd + 1) * D], t)
                    scores = np.array([q @ rope(ks[u][kv * D:(kv + 1) * D], u) / np.sqrt(D) for u in range(t + 1)])
                    e = np.exp(scores - scores.real.max())
                    att = e / e.sum()
                    heads.append(sum(att[u] * vs[u][kv * D:(kv + 1) * D] for u in range(t + 1)))
                x = xs[t] + p("attn.wo.weight") @ np.concatenate(heads)
                h2 = rms(x, p("ln2.weight"))
                gate, up = p("mlp.w1.weight") @ h2, p("mlp.w3.weight") @ h2
                new.append(x + p("mlp.w2.weight") @ (gate / (1 + np.exp(-gate)) * up))
            xs = new
        for t in range(T):
            logits = head @ rms(xs[t], w["ln_f.weight"])
            m = logits.real.max()
            total = total - (logits[idx[b, t]] - m - np.log(np.sum(np.exp(logits - m))))
    return total / (B * T)


@pytest.mark.parametrize("kv_heads,tied,n_layer", [(1, False, 2), (2, False, 1), (4, True, 1)])
def test_model_equals_the_per_token_reference(kv_heads, tied, n_layer):
    cfg = GPTConfig(vocab_size=7, seq_len=5, n_layer=n_layer, n_head=4, d_model=16, arch="llama", kv_heads=kv_heads,
                    ffn_size=12, tie_weights=tied, dtype="float64")
    model = GPT(cfg, seed=kv_heads)
    for p in model.parameters():  # away from the initialisation's near-uniform attention
        p.data += np.random.default_rng(p.size).standard_normal(p.shape) * 0.3
    idx = np.random.default_rng(5).integers(0, 7, (2, 5))
    loss = model.loss(idx, idx)
    loss.backward()
    weights = {name: p.data.astype(np.complex128) for name, p in model.named_parameters()}
    assert loss.item() == pytest.approx(reference_loss(weights, idx, cfg).real, rel=1e-10, abs=0)
    rng = np.random.default_rng(11)
    for name, p in model.named_parameters():  # each tensor's gradient along two random directions
        for _ in range(2):
            v = rng.standard_normal(p.shape)
            stepped = dict(weights)
            stepped[name] = weights[name] + 1e-30j * v
            along = reference_loss(stepped, idx, cfg).imag / 1e-30
            assert float(np.sum(p.grad * v)) == pytest.approx(along, rel=1e-10, abs=1e-14), name


def test_multi_head_llama_uses_one_key_value_head_per_query_head():
    """kv_heads = n_head: as many key/value heads as query heads; 1: one shared (multi-query)."""
    shapes = lambda kv: {n: p.shape for n, p in GPT(GPTConfig(11, 8, 1, 4, 16, arch="llama",  # noqa: E731
                                                             kv_heads=kv)).named_parameters()}
    assert shapes(4)["blocks.0.attn.wk.weight"] == (16, 16)
    assert shapes(1)["blocks.0.attn.wk.weight"] == (4, 16) and shapes(1)["blocks.0.attn.wv.weight"] == (4, 16)


def test_gpt2_is_unchanged_by_the_arch_option():
    a, b = GPT(GPTConfig(11, 8, dtype="float64"), seed=3), GPT(GPTConfig(11, 8, dtype="float64", arch="gpt2"), seed=3)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    assert all(np.array_equal(p.data, q.data) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="add --arch llama"):
        GPTConfig(11, 8, kv_heads=2)


# --- command line --------------------------------------------------------------------------------
def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "refimpl", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags,message", [
    (["--kv-heads", "3"], "error: --kv-heads 3 must divide --n-head 4"),
    (["--kv-heads", "0"], "error: --kv-heads 0 must divide --n-head 4"),
    (["--d-model", "12", "--n-head", "4"], "error: the head width d_model/n_head = 3 is odd"),
    (["--ffn-size", "0"], "error: --ffn-size must be positive"),
    (["--ffn-size", "-4"], "error: --ffn-size must be positive"),
])
def test_bad_llama_flags_are_one_line(flags, message, capsys):
    assert cli.main(["train", "--arch", "llama", "--steps", "1", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message) and err.count("\n") == 1, err


def test_llama_flags_without_the_arch_are_refused(capsys):
    assert cli.main(["train", "--kv-heads", "2", "--steps", "1"]) == 2
    assert capsys.readouterr().err == "error: --kv-heads and --ffn-size shape the Llama block; add --arch llama\n"


def test_train_on_text_with_llama(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    done = run_cli("train", "--arch", "llama", "--kv-heads", "2", "--ffn-size", "48", "--d-model", "32", "--data",
                   str(text), "--seq-len", "16", "--steps", "30", "--lr", "1e-2", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["ok"] and np.isfinite(summary["final_loss"]) and summary["final_loss"] < 2.5  # ln 30 = 3.4


def test_the_demo_learns_with_llama():
    cfg = config_from_flags(["--arch", "llama", "--kv-heads", "2", "--ffn-size", "48", "--d-model", "32", "--steps",
                             "100", "--lr", "1e-2"])
    task = build_task(cfg)
    trainer = make_trainer(cfg, build_model(cfg, task), None)
    losses = [float(trainer.step(*task.batch(step, cfg.batch_size))) for step in range(cfg.steps)]
    assert np.all(np.isfinite(losses)) and np.mean(losses[-10:]) < 0.4 * np.mean(losses[:10])


@pytest.mark.parametrize("plan", ["sqrt", "selective", "auto:memory"])
def test_activation_checkpointing_of_llama_is_bitwise(plan):
    def final(checkpoint):
        cfg = config_from_flags(["--arch", "llama", "--kv-heads", "2", "--ffn-size", "24", "--d-model", "16",
                                 "--n-layer", "3", "--steps", "2", "--dtype", "float64", "--checkpoint", checkpoint])
        task = build_task(cfg)
        model = build_model(cfg, task)
        trainer = make_trainer(cfg, model, None)
        for step in range(2):
            trainer.step(*task.batch(step, cfg.batch_size))
        return [p.data.copy() for p in model.parameters()]

    assert all(np.array_equal(a, b) for a, b in zip(final("none"), final(plan)))


# --- data parallelism and ZeRO against one process, on two ranks -----------------------------------
LLAMA = ["--arch", "llama", "--kv-heads", "2", "--ffn-size", "24", "--d-model", "16", "--n-head", "4", "--n-layer", "2",
         "--seq-len", "8", "--steps", "2", "--batch-size", "8"]


@pytest.mark.mpi
def test_data_parallel_and_zero_llama_equal_one_process(tmp_path):
    """verify (float64, rtol 1e-10): DDP (bucketed and naive), ZeRO 1-3, gradient accumulation,
    multi-query attention, dropout, activation checkpointing; and mixed precision (its own bounds)."""
    cases = [LLAMA + ["--zero", str(z)] for z in range(4)]
    cases += [LLAMA + ["--dp-mode", "naive", "--kv-heads", "1", "--grad-accum", "2"],
              LLAMA + ["--zero", "2", "--kv-heads", "4", "--dropout", "0.1", "--checkpoint", "selective"],
              LLAMA + ["--zero", "3", "--checkpoint", "every:1", "--optimizer", "sgd", "--collectives", "ring"],
              LLAMA + ["--zero", "2", "--dtype", "mixed", "--steps", "3"]]  # float16's lockstep bounds
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(cases))
    done = run_mpi(2, [PROGRAMS / "verify_many.py", path], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = last_json(done)
    assert len(results) == len(cases)
    for r in results:
        assert r["ok"], (r["flags"], r["problems"], r["tolerance_used"])


# --- memory formulas against the built model and the ledger --------------------------------------
@pytest.mark.parametrize("kv_heads,ffn,tied", [(1, 24, False), (2, 40, True), (4, 64, False)])
def test_parameter_formula_lists_the_built_model(kv_heads, ffn, tied):
    cfg = GPTConfig(13, 8, n_layer=3, n_head=4, d_model=16, arch="llama", kv_heads=kv_heads, ffn_size=ffn,
                    tie_weights=tied)
    built = sum(p.size for p in GPT(cfg).parameters())
    tensors = gpt_parameter_tensors(13, 8, 16, 3, tied=tied, arch="llama", kv_width=kv_heads * 4, ffn=ffn)
    assert built == sum(e * n for e, n, _ in tensors)
    assert built == 13 * 16 * (1 + (not tied)) + 16 + 3 * (2 * 16 * 16 + 2 * 16 * kv_heads * 4 + 3 * 16 * ffn + 2 * 16)


@pytest.mark.parametrize("flags", [[], ["--dropout", "0.1", "--kv-heads", "1"], ["--kv-heads", "4", "--n-layer", "3"],
                                   ["--ffn-size", "20", "--seq-len", "10", "--batch-size", "6"]])
def test_saved_activation_formula_equals_the_ledger(flags):
    cfg = config_from_flags(["--arch", "llama", "--kv-heads", "2", "--ffn-size", "48", "--steps", "1",
                             "--dtype", "float64", *flags])
    task = build_task(cfg)
    trainer = make_trainer(cfg, build_model(cfg, task), None)
    saved_tensors.reset_peak()
    before = saved_tensors.live_bytes
    trainer.step(*task.batch(0, cfg.batch_size))
    kv = cfg.kv_heads * cfg.d_model // cfg.n_head
    expected = saved_bytes(cfg.batch_size, cfg.seq_len, cfg.d_model, cfg.n_head, task.vocab_size, cfg.n_layer, 8,
                           cfg.dropout > 0, arch="llama", kv_width=kv, ffn=cfg.ffn_size)
    assert saved_tensors.peak_bytes - before == expected


def test_saved_elements_per_llama_block_formula():
    b, s, h, a, kv, f = 2, 8, 16, 4, 8, 24
    block = saved_elements_per_block(b, s, h, a, arch="llama", kv_width=kv, ffn=f)
    N = b * s
    assert sum(block.values()) == 6 * N * h + 2 * N * kv + 3 * N * f + 2 * N + b * a * s * s
    gpt_like = saved_elements_per_block(b, s, h, a, arch="llama", kv_width=h, ffn=4 * h)
    gpt2 = saved_elements_per_block(b, s, h, a)
    assert sum(gpt_like.values()) == sum(gpt2.values()) + 4 * N * h  # SwiGLU keeps 3 arrays of 4h, GeLU 2


def test_the_block_is_part_of_a_runs_fingerprint():
    """A checkpoint of a Llama run does not resume as another block's (saved_runs/fingerprint.py)."""
    from refimpl.tools.run import TrainConfig  # noqa: PLC0415 - only here
    from refimpl.tools.saved_runs import fingerprint  # noqa: PLC0415 - only here

    gpt2 = fingerprint.of(TrainConfig())
    assert "arch" not in gpt2["fields"]  # GPT-2's fingerprint does not name the defaults
    llama = fingerprint.of(TrainConfig(arch="llama", kv_heads=2))
    assert fingerprint.differences(gpt2, llama) == ["--arch: (not recorded) there, llama here",
                                                    "--kv-heads: (not recorded) there, 2 here"]


def test_the_preflight_check_counts_the_llama_model_from_its_flags():
    from refimpl.tools.runtime import preflight  # noqa: PLC0415 - only here

    cfg = config_from_flags(["--arch", "llama", "--kv-heads", "1", "--ffn-size", "40", "--n-layer", "3"])
    task = build_task(cfg)
    built = sum(p.size for p in build_model(cfg, task).parameters())
    assert preflight.count(preflight.parameter_tensors(cfg, task.vocab_size, task.seq_len)) == built


def test_llama_runs_on_the_cupy_backend_through_the_standin():
    """The CuPy code paths (tests/cupy_standin: CuPy's host/device strictness on the CPU) give the
    NumPy backend's numbers: RoPE's angles and the attention mask live on the device."""
    import os  # noqa: PLC0415 - only here
    from pathlib import Path  # noqa: PLC0415 - only here

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests / "cupy_standin"), str(tests.parent)])}
    flags = ["train", "--arch", "llama", "--kv-heads", "2", "--ffn-size", "24", "--d-model", "16", "--steps", "3",
             "--dtype", "float64", "--json"]
    losses = []
    for backend_name in ("cupy", "numpy"):
        done = subprocess.run([sys.executable, "-m", "refimpl", *flags, "--backend", backend_name], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        losses.append(json.loads(done.stdout.strip().splitlines()[-1])["final_loss"])
    assert losses[0] == losses[1]
