"""The cluster model's Llama block, bfloat16 and fused attention (refimpl/tools/cluster/model.py).

What is checked: the parameter counts of the released Llama 2 and Llama 3 shapes, to the parameter;
grouped-query attention removes exactly 2·h·(a − K)·D parameters per block, 2·N·(a − K)·D/tp saved
elements per block and (a/K)× the ring's and Ulysses' key/value bytes; the GEMM and memory-bound
terms grow with the SwiGLU width as stated; the model FLOPs are PaLM's count on the Llama matrices;
bf16 holds P = 2, G = 4, K = 12 bytes per parameter and computes at the 16-bit rate; fused attention
keeps no scores and computes the causal tiles; GPT-2 predicts exactly what it predicted before the
block had a choice (figures pinned); Llama 3 405B's published run (Dubey et al. 2024, Table 4) is
predicted within 15%; plan searches Llama shapes; bad input is one line.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from refimpl.memory import PRECISIONS, saved_elements_per_block
from refimpl.parallel.context_parallel.accounting import AttentionShape, ring_bytes, ulysses_bytes
from refimpl.tools import cli
from refimpl.tools.cluster import context
from refimpl.tools.cluster.calibrate import block_operations
from refimpl.tools.cluster.hardware import PRESETS
from refimpl.tools.cluster.model import (
    EFFICIENCY,
    FLASH_TILE,
    OPERATIONS_PER_DROPOUT_LLAMA_BLOCK,
    OPERATIONS_PER_LLAMA_BLOCK,
    Run,
    action_times,
    flash_scores,
    matmul_parameters,
    memory_breakdown,
    model_flops,
    parameters,
    predict,
    rank_parameters,
)
from refimpl.tools.cluster.plan import LLAMA_SHAPES, candidates, llama_shape_for
from refimpl.tools.cluster.published import LLAMA_ROWS, ROWS, TOLERANCE, Check, seconds_from_tflops

A100, H100 = PRESETS["a100-80gb"], PRESETS["h100-80gb"]


def llama(**kw) -> Run:
    base = dict(n_layer=4, d_model=512, n_head=8, seq_len=1024, vocab_size=1000, batch_size=8, arch="llama",
                kv_heads=2, ffn_size=1536)
    base.update(kw)
    return Run(**base)


# -- parameters ----------------------------------------------------------------------------------------

# (name, layers, width, heads, key/value heads, SwiGLU width, vocabulary, the released model's parameters)
RELEASED = (
    ("Llama 2 7B", 32, 4096, 32, 32, 11008, 32000, 6_738_415_616),
    ("Llama 2 13B", 40, 5120, 40, 40, 13824, 32000, 13_015_864_320),
    ("Llama 2 70B", 80, 8192, 64, 8, 28672, 32000, 68_976_648_192),
    ("Llama 3 8B", 32, 4096, 32, 8, 14336, 128256, 8_030_261_248),
    ("Llama 3 405B", 126, 16384, 128, 8, 53248, 128256, 405_853_388_800),
)


@pytest.mark.parametrize("name,L,h,a,K,F,V,count", RELEASED)
def test_parameters_of_the_released_llama_shapes_to_the_parameter(name, L, h, a, K, F, V, count):
    run = Run(L, h, a, 4096, V, 1, arch="llama", kv_heads=K, ffn_size=F)
    assert parameters(run) == count
    D = h // a
    block = 2 * h * h + 2 * h * K * D + 3 * h * F + 2 * h  # wq, wo; wk, wv; w1, w3, w2; two RMSNorm gains
    assert count == L * block + 2 * V * h + h  # untied embedding and head, the final RMSNorm; no biases, no positions
    assert matmul_parameters(run) == L * (block - 2 * h) + V * h


@pytest.mark.parametrize("K", [1, 2, 4])
def test_grouped_query_attention_removes_exactly_its_key_value_projections(K):
    mha, gqa = llama(kv_heads=8), llama(kv_heads=K)
    h, a, L = 512, 8, 4
    D = h // a
    assert parameters(mha) - parameters(gqa) == L * 2 * h * (a - K) * D
    assert matmul_parameters(mha) - matmul_parameters(gqa) == L * 2 * h * (a - K) * D
    # over tp ranks: each holds 1/tp of wk and wv
    t = 2
    mha_rank = rank_parameters(replace(mha, tp=t), first=True, last=True)[0]
    gqa_rank = rank_parameters(replace(gqa, tp=t, kv_heads=max(K, t)), first=True, last=True)[0]
    assert mha_rank - gqa_rank == L * 2 * h * (a - max(K, t)) * D // t


def test_multi_head_llama_with_four_h_swiglu_has_sixteen_h_squared_per_block():
    run = llama(kv_heads=None, ffn_size=None)
    h = run.d_model
    assert run.key_value_heads == run.n_head and run.ffn == 4 * h
    one, two = replace(run, n_layer=1), replace(run, n_layer=2)
    assert parameters(two) - parameters(one) == 16 * h * h + 2 * h


# -- activations ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_grouped_query_attention_saves_two_fewer_key_value_widths_per_token(tp, recompute):
    h, a, K, b, s = 512, 8, 2, 2, 1024
    D, N = h // a, b * s
    mha = llama(kv_heads=8, tp=tp, micro_batch_size=b, checkpoint=recompute, dtype="bf16")
    gqa = replace(mha, kv_heads=K)
    kept = {r: memory_breakdown(r, A100, in_flight=1, first=True, last=False)["activations"] for r in (mha, gqa)}
    e, blocks = 2, mha.blocks_per_stage
    assert kept[mha] - kept[gqa] == e * blocks * 2 * N * (a - K) * D // tp
    # and the whole block is the stated sum: (6h + 2·K·D + 3F + 2)·N + b·a·s² elements (one process)
    per_block = saved_elements_per_block(b, s, h, a, recompute=recompute, arch="llama", kv_width=K * D, ffn=1536)
    scores = 0 if recompute == "selective" else b * a * s * s
    assert sum(per_block.values()) == (6 * h + 2 * K * D + 3 * 1536 + 2) * N + scores


def test_gpt2_activations_are_those_of_a_llama_block_with_its_shape_counted_its_way():
    """The block's shape reaches the activations: a Llama block of the same width with multi-head attention and
    F = 4h keeps (6h + 2h + 12h + 2)·N = (20h + 2)·N where GPT-2 keeps (16h + 2)·N."""
    h, b, s = 512, 1, 1024
    gpt2 = Run(4, h, 8, s, 1000, 8, checkpoint="selective")
    mha = replace(gpt2, arch="llama")
    kept = {r: memory_breakdown(r, A100, 1, first=True, last=False)["activations"] for r in (gpt2, mha)}
    assert kept[mha] - kept[gpt2] == 2 * 4 * 4 * h * b * s  # e · blocks · 4h·N


# -- time ----------------------------------------------------------------------------------------------

def test_the_swiglu_width_costs_its_gemms_and_its_memory_bound_traffic():
    small, wide = llama(tp=2, ffn_size=1536), llama(tp=2, ffn_size=2048)
    t, N, h, e, blocks = 2, 1024, 512, 2, 4
    eff = EFFICIENCY
    gemm = blocks * 2 * N * 3 * h * (2048 - 1536) / t / (A100.peak_flops * eff.gemm)
    traffic = blocks * N * e * 5 * (2048 - 1536) / t / (A100.memory_bandwidth * eff.memory)
    F = {r: action_times(r, A100, eff, last=False).F["compute"] for r in (small, wide)}
    W = {r: action_times(r, A100, eff, last=False).W["compute"] for r in (small, wide)}
    assert F[wide] - F[small] == pytest.approx(gemm + traffic, rel=1e-12)
    assert W[wide] - W[small] == pytest.approx(gemm, rel=1e-12)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_collectives_are_gpt2s_whatever_the_key_value_heads_and_width(sp):
    gpt2 = Run(4, 512, 8, 1024, 1000, 8, tp=4, sequence_parallel=sp, checkpoint="full")
    for shape in (dict(kv_heads=None, ffn_size=None), dict(kv_heads=4, ffn_size=1536)):
        run = replace(gpt2, arch="llama", **shape)
        mine, theirs = action_times(run, A100), action_times(gpt2, A100)
        assert (mine.F["tp"], mine.I["tp"], mine.P) == (theirs.F["tp"], theirs.I["tp"], theirs.P)


def test_model_flops_are_palms_count_on_the_llama_matrices():
    run = llama()
    h, K, D, F, L, V, s = 512, 2, 64, 1536, 4, 1000, 1024
    N = L * (2 * h * h + 2 * h * K * D + 3 * h * F) + V * h
    assert model_flops(run) == 8 * s * (6 * N + 12 * L * h * s)
    p = predict(run, A100)
    assert p.model_flops_per_gpu_per_second == model_flops(run) / p.step_seconds / run.gpus


def test_the_llama_blocks_operations_are_counted_in_its_graph():
    assert OPERATIONS_PER_LLAMA_BLOCK == block_operations(arch="llama")
    assert OPERATIONS_PER_DROPOUT_LLAMA_BLOCK == block_operations(arch="llama", dropout=0.1)


# -- context parallelism: key/value heads ---------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("C", [2, 4])
def test_the_ring_carries_the_key_value_heads_only(tp, C):
    run = llama(cp=C, tp=tp, seq_len=128 * C, micro_batch_size=2, dtype="bf16")
    shape = AttentionShape(batch=2, heads=8 // tp, kv_heads=2 // tp, seq_len=128 * C, d_head=64, ranks=C, itemsize=2)
    per_rank = [ring_bytes(shape, r) for r in range(C)]
    assert context.bytes_per_layer(run, 2) == {"forward": max(b["forward"] for b in per_rank),
                                               "backward": max(b["backward"] for b in per_rank)}
    mha = context.bytes_per_layer(replace(run, kv_heads=8), 2)
    assert {k: 4 * v for k, v in context.bytes_per_layer(run, 2).items()} == mha  # a/K = 4 times fewer
    assert context.buffer_bytes(run, 2) * 4 == context.buffer_bytes(replace(run, kv_heads=8), 2)


def test_ulysses_moves_query_and_output_heads_and_fewer_key_value_heads():
    run = llama(cp=2, seq_len=1024, kv_heads=2, cp_impl="ulysses", micro_batch_size=2)
    shape = AttentionShape(batch=2, heads=8, kv_heads=2, seq_len=1024, d_head=64, ranks=2, itemsize=2)
    assert context.bytes_per_layer(run, 2) == ulysses_bytes(shape)
    assert context.buffer_bytes(run, 2) == 2 * (8 + 2) * 2 * 512 * 64 * 2


# -- bf16 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bf16_holds_two_four_and_twelve_bytes_per_parameter(zero):
    run = llama(dp=4, zero=zero, dtype="bf16", batch_size=8)
    dense, _ = rank_parameters(run, first=True, last=True)
    memory = memory_breakdown(run, A100, 1, first=True, last=True)
    assert PRECISIONS["bf16"] == (2, 4, 12)
    expected = {"parameters": 2 * dense / (4 if zero >= 3 else 1), "gradients": 4 * dense / (4 if zero >= 2 else 1),
                "optimizer_states": 12 * dense / (4 if zero >= 1 else 1)}
    assert {k: memory[k] for k in expected} == {k: int(v) for k, v in expected.items()}
    mixed = memory_breakdown(replace(run, dtype="mixed"), A100, 1, first=True, last=True)
    assert memory["activations"] == mixed["activations"]  # 2-byte activations either way


def test_bf16_computes_at_the_sixteen_bit_rate():
    for cluster in (A100, H100):
        assert cluster.flops("bf16") == cluster.flops("mixed") == cluster.peak_flops
    run = llama(dtype="bf16")
    times = action_times(run, A100)
    assert times.F == action_times(replace(run, dtype="mixed"), A100).F
    p = predict(run, A100)
    assert p.mfu == p.model_flops_per_gpu_per_second / A100.peak_flops


# -- fused attention -------------------------------------------------------------------------------------

def test_flash_attention_computes_the_causal_tiles_and_keeps_no_scores():
    dense = llama(micro_batch_size=2, tp=2)
    flash = replace(dense, attention="flash")
    assert flash_scores(flash) == 2 * 4 * 1024 * (1024 + FLASH_TILE) // 2
    assert flash_scores(flash) == 2 * 4 * (1024 // FLASH_TILE) * (1024 // FLASH_TILE + 1) // 2 * FLASH_TILE ** 2
    selective = memory_breakdown(replace(dense, checkpoint="selective"), A100, 1, first=True, last=False)
    fused = memory_breakdown(flash, A100, 1, first=True, last=False)
    assert fused["activations"] == selective["activations"] + 2 * 4 * (2 * 4 * 1024)  # e · blocks · the lse
    assert fused["working"] < memory_breakdown(dense, A100, 1, first=True, last=False)["working"]
    # selective recomputation adds nothing the fused kernel's backward does not already do
    assert predict(replace(flash, checkpoint="selective"), A100).step_seconds == predict(flash, A100).step_seconds


# -- GPT-2 unchanged -------------------------------------------------------------------------------------

PINNED_RUNS = (
    ROWS[1].run, ROWS[8].run,
    Run(24, 2048, 16, 2048, 51200, 512, micro_batch_size=2, dp=8, zero=3, checkpoint="selective"),
    Run(32, 4096, 32, 4096, 51200, 256, dp=4, tp=4, pp=4, schedule="interleaved", chunks=2, sequence_parallel=True,
        zero=1),
    Run(32, 4096, 32, 131072, 51200, 16, dp=8, cp=8, zero=3),
    Run(32, 4096, 32, 131072, 51200, 16, dp=4, tp=2, cp=8, cp_impl="ulysses", zero=2, checkpoint="full"),
    Run(16, 1024, 16, 1024, 51200, 128, dp=8, pp=2, experts=8, top_k=2, ep=4, schedule="dualpipe"),
)
# (configuration, cluster, step seconds, memory per GPU, parameters, MFU) before the model had a block to choose
BEFORE = (
    (0, "a100-80gb", 13.459698422148323, 59508355072, 174615846912, 0.5249658457794472),
    (0, "h100-80gb", 5.5402135291556505, 59508355072, 174615846912, 0.40234460038068187),
    (1, "a100-80gb", 99.63353319588695, 38719136384, 176276602880, 0.3802094569530313),
    (1, "h100-80gb", 36.86385599524993, 38719136384, 176276602880, 0.32417982831058106),
    (2, "a100-80gb", 7.2724132512598985, 12005777408, 1422512128, 0.5248015870088711),
    (2, "h100-80gb", 2.9792352013540775, 12005777408, 1422512128, 0.40413568562912494),
    (3, "a100-80gb", 5.519720051378967, 21675692160, 6880370688, 0.4410106468940909),
    (3, "h100-80gb", 2.356262882971118, 21675692160, 6880370688, 0.32591225146813296),
    (4, "a100-80gb", 54.68726411899743, 84429670400, 7400464384, 0.4725745524606226),
    (4, "h100-80gb", 25.229266777315388, 84429670400, 7400464384, 0.3231544957319225),
    (5, "a100-80gb", 72.5531755720274, 20663930496, 7400464384, 0.356205075278539),
    (5, "h100-80gb", 33.50014314493589, 20663930496, 7400464384, 0.24337063121898797),
    (6, "a100-80gb", 0.18795385268514464, 9918541952, 1247676416, 0.35342425797816523),
    (6, "h100-80gb", 0.10274367034691867, 9918541952, 1247676416, 0.2039627286921655),
)


@pytest.mark.parametrize("index,cluster,step,memory,params,mfu", BEFORE)
def test_gpt2_predicts_exactly_what_it_predicted_before(index, cluster, step, memory, params, mfu):
    run = PINNED_RUNS[index]
    assert run.arch == "gpt2" and run.attention == "dense"
    p = predict(run, PRESETS[cluster])
    assert (p.step_seconds, p.memory_per_gpu_bytes, p.parameters, p.mfu) == (step, memory, params, mfu)


# -- the published Llama run -------------------------------------------------------------------------------

def test_llama_3_405b_on_8192_gpus_is_table_4s_row_and_predicted_within_15_percent():
    row = LLAMA_ROWS[0]
    r = row.run
    assert (r.gpus, r.tp, r.cp, r.pp, r.dp, r.seq_len, r.batch_size // r.dp) == (8192, 8, 1, 16, 64, 8192, 32)
    assert (r.n_layer, r.d_model, r.n_head, r.key_value_heads, r.ffn, r.vocab_size) == (126, 16384, 128, 8, 53248,
                                                                                        128256)
    assert r.dtype == "bf16" and r.checkpoint == "none" and row.cluster == "h100-80gb"
    assert row.seconds == seconds_from_tflops(r, 430)
    check = Check(row, predict(r, H100).step_seconds)  # what published.checks() computes for this row
    assert abs(check.error) <= TOLERANCE, check.error
    # the same statement in the paper's own terms: TFLOP/s per GPU (PaLM's count, the paper's MFU)
    p = predict(r, H100)
    assert p.model_flops_per_gpu_per_second / 430e12 == pytest.approx(row.seconds / check.predicted, rel=1e-12)
    assert row in LLAMA_ROWS and row not in ROWS and LLAMA_ROWS[1].run.gpus == 16384


def test_predict_prints_the_llama_shape_flash_attention_and_bf16(capsys):
    args = ["predict", "--arch", "llama", "--n-layer", "4", "--d-model", "512", "--n-head", "8", "--kv-heads", "2",
            "--ffn-size", "1536", "--dtype", "bf16", "--attention", "flash", "--batch-size", "8"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "llama (K=2 key/value heads, F=1536)" in out and "bf16" in out and "flash attention" in out
    assert cli.main([*args, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert (run["arch"], run["kv_heads"], run["ffn_size"], run["dtype"], run["attention"]) == ("llama", 2, 1536,
                                                                                                "bf16", "flash")


# -- plan ------------------------------------------------------------------------------------------------

def test_plan_searches_only_degrees_that_split_the_key_value_heads():
    base = llama(n_layer=4, kv_heads=2, batch_size=16, seq_len=256)
    runs = list(candidates(base, 8, A100))
    assert runs and {r.tp for r in runs} == {1, 2}  # 4 and 8 do not divide 2 key/value heads
    for run in runs[::7]:
        run.check()


def test_params_pick_the_nearest_llama_shape():
    assert llama_shape_for(70e9, vocab_size=32000)[0] == "Llama 2 / Llama 3 70B"
    assert llama_shape_for(7e9, vocab_size=32000)[0] == "Llama 2 7B"
    assert llama_shape_for(400e9, vocab_size=128256)[0] == "Llama 3 405B"
    assert len(LLAMA_SHAPES) == 4


def test_plan_with_a_llama_shape(capsys):
    assert cli.main(["plan", "--arch", "llama", "--params", "7B", "--vocab-size", "32000", "--gpus", "8",
                     "--batch-size", "16", "--dtype", "bf16", "--top", "2", "--refine", "2"]) == 0
    captured = capsys.readouterr()
    assert "Llama 2 7B, 6.7B parameters" in captured.out and "llama K=32 F=11008" in captured.out
    assert "--arch llama --kv-heads 32 --ffn-size 11008" in captured.err


# -- bad input -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["predict", "--arch", "llama", "--kv-heads", "5"], "--kv-heads 5 must divide --n-head 16"),
    (["predict", "--kv-heads", "4"], "--kv-heads and --ffn-size shape the Llama block; add --arch llama"),
    (["predict", "--ffn-size", "4096"], "--kv-heads and --ffn-size shape the Llama block; add --arch llama"),
    (["predict", "--arch", "llama", "--kv-heads", "4", "--tp", "8"], "--tp 8 must divide --kv-heads 4"),
    (["predict", "--arch", "llama", "--ffn-size", "1001", "--tp", "2"], "--tp 2 must divide --ffn-size 1001"),
    (["predict", "--arch", "llama", "--d-model", "48", "--n-head", "16"], "the head width d_model/n_head = 3 is odd"),
    (["predict", "--arch", "llama", "--kv-heads", "4", "--tp", "4", "--cp", "2", "--cp-impl", "ulysses",
      "--seq-len", "4096", "--gpus", "8"], "the 4 query and 1 key/value heads per tensor-parallel rank"),
    (["predict", "--arch", "llama", "--experts", "4"], "--arch llama with --experts is not modelled"),
    (["plan", "--arch", "llama", "--params", "7B", "--kv-heads", "8", "--gpus", "8"],
     "--params picks a Llama shape with its own --kv-heads and --ffn-size"),
    (["plan", "--n-layer", "4", "--d-model", "512", "--n-head", "8", "--kv-heads", "3", "--arch", "llama",
      "--gpus", "8"], "--kv-heads 3 must divide --n-head 8"),
])
def test_bad_input_is_one_clear_line(args, message, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("flag,value", [("--ffn-size", "0"), ("--ffn-size", "-4"), ("--kv-heads", "0")])
def test_a_width_or_head_count_below_one_is_one_line(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["predict", "--arch", "llama", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert f"argument {flag}: must be a positive integer" in err and len(err.splitlines()) == 1, err


def test_a_run_built_in_code_refuses_a_non_positive_width():
    with pytest.raises(ValueError, match="--ffn-size must be positive"):
        llama(ffn_size=0).check()
    with pytest.raises(ValueError, match="--kv-heads 0 must divide --n-head 8"):
        llama(kv_heads=0).check()
