"""The cluster model's context parallelism (refimpl/tools/cluster/context.py): its counts are accounting.py's.

What is checked: at cp 1 every configuration predicts exactly what it predicted before cp existed
(figures pinned); the bytes per layer are accounting.py's ring and Ulysses formulas; the attention
work is the balanced causal count, the same on every rank; the ring's time is the stated overlap
(each hop against its block's compute) and Ulysses' all-to-alls are waited for; activation memory
divides by C exactly; gradients reduce and ZeRO shards over dp · cp; plan finds a cp > 1 for a
sequence that fits nowhere at cp 1; bad input is one clear line.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from refimpl.memory import PRECISIONS, saved_elements_per_block
from refimpl.parallel.context_parallel.accounting import AttentionShape, ring_bytes, score_elements, ulysses_bytes
from refimpl.parallel.context_parallel.blockwise import EMPTY, pair_kind
from refimpl.parallel.context_parallel.layout import rank_chunks
from refimpl.parallel.context_parallel.ring_attention import chunks_sent
from refimpl.tools import cli
from refimpl.tools.cluster import context
from refimpl.tools.cluster.collectives import Group, Links
from refimpl.tools.cluster.hardware import PRESETS
from refimpl.tools.cluster.model import EFFICIENCY, Run, action_times, memory_breakdown, predict, rank_parameters
from refimpl.tools.cluster.plan import candidates, plan
from refimpl.tools.cluster.published import ROWS

A100 = PRESETS["a100-80gb"]


def long(**kw) -> Run:
    base = dict(n_layer=4, d_model=512, n_head=8, seq_len=4096, vocab_size=1000, batch_size=8, dtype="mixed")
    base.update(kw)
    return Run(**base)


# -- cp 1 is the model as it was --------------------------------------------------------------------

# Configurations beside the published rows: ZeRO 1-3, recomputation, sequence parallelism, dropout,
# DualPipe, ZB-H1, experts with and without a pipeline.
EXTRA = (
    Run(24, 2048, 16, 2048, 51200, 512, micro_batch_size=2, dp=8, zero=1),
    Run(24, 2048, 16, 2048, 51200, 512, micro_batch_size=2, dp=8, zero=2, checkpoint="selective"),
    Run(24, 2048, 16, 8192, 51200, 64, micro_batch_size=1, dp=4, tp=2, zero=3, checkpoint="full",
        sequence_parallel=True),
    Run(32, 4096, 32, 4096, 51200, 256, dp=4, tp=4, pp=4, schedule="dualpipe", dropout=True),
    Run(32, 4096, 32, 4096, 51200, 256, dp=4, tp=2, pp=4, schedule="zb1p", checkpoint="selective"),
    Run(16, 1024, 16, 1024, 51200, 128, dp=8, pp=2, experts=8, top_k=2, ep=4, schedule="dualpipe"),
    Run(16, 1024, 16, 1024, 51200, 128, dp=8, experts=8, top_k=2, ep=8, zero=3),
)
# (configuration: published.ROWS then EXTRA, cluster, step seconds, memory per GPU, bubble, dp communication)
# as the model predicted them before it had a cp axis.
BEFORE = (
    (0, "a100-80gb", 19.092730151148324, 52386308096, 0.7816512159635778, 0.0),
    (0, "h100-80gb", 8.16650979415565, 52386308096, 0.34228299255294736, 0.0),
    (1, "a100-80gb", 13.459698422148323, 59508355072, 0.48577495212088273, 0.0),
    (1, "h100-80gb", 5.5402135291556505, 59508355072, 0.20103619913180548, 0.0),
    (2, "a100-80gb", 53.361722419090874, 46102167552, 2.9146479501246247, 0.0),
    (2, "h100-80gb", 20.40789239286994, 46102167552, 1.2141121114130051, 0.0),
    (3, "a100-80gb", 39.03829191709087, 59645709312, 1.6237764008299465, 0.0),
    (3, "h100-80gb", 14.322372234869936, 59645709312, 0.6105413852412873, 0.0),
    (4, "a100-80gb", 102.03485863281756, 50180001792, 16.469201693580587, 0.0),
    (4, "h100-80gb", 38.67181095761194, 50180001792, 6.886444392094713, 0.0),
    (5, "a100-80gb", 70.88332244281756, 65667592192, 8.431983952245105, 0.0),
    (5, "h100-80gb", 25.578083837611942, 65667592192, 3.13978100315261, 0.0),
    (6, "a100-80gb", 39.36956225983325, 59695709312, 1.6237764008299465, 0.33127034274237566),
    (6, "h100-80gb", 14.492104036798466, 59695709312, 0.6105413852412873, 0.16973180192852866),
    (7, "a100-80gb", 30.2603304824915, 29275639936, 3.088775762173693, 0.15248715420585784),
    (7, "h100-80gb", 13.051802113150362, 29275639936, 1.3947676700009541, 0.08412752896485957),
    (8, "a100-80gb", 99.63353319588695, 38719136384, 9.244201300021501, 0.19341246118857033),
    (8, "h100-80gb", 36.86385599524993, 38719136384, 3.5978586047234913, 0.09994673396634812),
    (9, "a100-80gb", 48.204276977445886, 43300040832, 7.90586822809459, 0.2373621043550142),
    (9, "h100-80gb", 18.86052591573496, 43300040832, 3.3024503800993603, 0.13327180886502282),
    (10, "a100-80gb", 6.686474388305183, 23275694208, 0.0, 0.010498937654495591),
    (10, "h100-80gb", 2.70435924516772, 23275694208, 0.0, 0.007011060954495591),
    (11, "a100-80gb", 7.257279351225505, 14343847040, 0.0, 0.010498937654495591),
    (11, "h100-80gb", 2.9691265927382027, 14343847040, 0.0, 0.007011060954495591),
    (12, "a100-80gb", 8.21425107771692, 7736197120, 0.0, 0.0),
    (12, "h100-80gb", 3.6418207626313497, 7736197120, 0.0, 0.0),
    (13, "a100-80gb", 6.563850729973482, 58946809984, 0.18818417046112135, 0.0007295952281584889),
    (13, "h100-80gb", 3.0906711844046573, 58946809984, 0.09513878387162444, 0.0003823730059362667),
    (14, "a100-80gb", 10.164614910287197, 26915958912, 0.2975768840658972, 0.00015665442059534853),
    (14, "h100-80gb", 4.10518353116189, 26915958912, 0.134183531324656, 0.0001045710872620152),
    (15, "a100-80gb", 0.18795385268514464, 9918541952, 0.0010337171686229953, 0.00018953214412311325),
    (15, "h100-80gb", 0.10274367034691867, 9918541952, 0.0005618661752120335, 0.00012876825523422438),
    (16, "a100-80gb", 0.3778423456549186, 5188685824, 0.0, 0.0),
    (16, "h100-80gb", 0.22673006648571095, 5188685824, 0.0, 0.0),
)


@pytest.mark.parametrize("index,cluster,step,memory,bubble,dp", BEFORE)
def test_cp_1_predicts_exactly_what_the_model_predicted_before(index, cluster, step, memory, bubble, dp):
    run = ([row.run for row in ROWS] + list(EXTRA))[index]
    assert run.cp == 1
    impl = context.IMPLEMENTATIONS[index % 2]  # the implementation does not matter without a cp axis
    p = predict(replace(run, cp_impl=impl), PRESETS[cluster])
    assert p.step_seconds == step and p.memory_per_gpu_bytes == memory
    assert p.time["bubble"] == bubble and p.time["dp_communication"] == dp
    assert "cp_communication" not in p.time and p.context_parallel == {}


# -- what is sent and computed: accounting.py's formulas ---------------------------------------------

@pytest.mark.parametrize("C", [2, 3, 4, 8])
@pytest.mark.parametrize("tp", [1, 2])
def test_ring_bytes_per_layer_are_accountings_formulas(C, tp):
    run = long(cp=C, tp=tp, seq_len=96 * C, micro_batch_size=2)
    e = 2
    shape = AttentionShape(batch=2, heads=8 // tp, kv_heads=8 // tp, seq_len=96 * C, d_head=64, ranks=C, itemsize=e)
    per_rank = [ring_bytes(shape, r) for r in range(C)]
    assert context.bytes_per_layer(run, e) == {"forward": max(b["forward"] for b in per_rank),
                                               "backward": max(b["backward"] for b in per_rank)}
    # the model's picture of a hop: on every step some rank sends its whole block (two chunks), and
    # each rank's hops add up to the formula
    k = shape.chunk_kv_bytes
    for r in range(C):
        forward = sum(len(chunks_sent(C, r, t, "balanced", True, gradient=False)) for t in range(C - 1))
        gradient = sum(len(chunks_sent(C, r, t, "balanced", True, gradient=True)) for t in range(1, C))
        assert forward * k == per_rank[r]["forward"] and (forward + gradient) * k == per_rank[r]["backward"]
    for t in range(C - 1):
        assert max(len(chunks_sent(C, s, t, "balanced", True, gradient=False)) for s in range(C)) == 2
    for t in range(1, C):
        assert max(len(chunks_sent(C, s, t, "balanced", True, gradient=True)) for s in range(C)) == 2


@pytest.mark.parametrize("C", [2, 4])
def test_ulysses_bytes_per_layer_are_accountings_formula(C):
    run = long(cp=C, cp_impl="ulysses", seq_len=64 * C)
    shape = AttentionShape(batch=1, heads=8, kv_heads=8, seq_len=64 * C, d_head=64, ranks=C, itemsize=2)
    assert context.bytes_per_layer(run, 2) == ulysses_bytes(shape)
    buffer = 1 * 64 * 8 * 64 * 2  # b · T/C · H · D · e: q, k, v or y of the shard
    assert ulysses_bytes(shape)["forward"] == 4 * buffer * (C - 1) // C


@pytest.mark.parametrize("C", [2, 3, 4, 8, 16])
def test_attention_work_is_the_balanced_causal_count_on_every_rank(C):
    for r in range(C):  # context.ring_pairs counts rank 0's: every rank's steps are the same
        mine = rank_chunks(C, r, "balanced")
        pairs = tuple(sum(pair_kind(i, j) != EMPTY for i in mine for j in rank_chunks(C, (r - t) % C, "balanced"))
                      for t in range(C))
        assert pairs == context.ring_pairs(C)
    assert context.ring_pairs(C) == (3,) + (2,) * (C - 1)
    run = long(cp=C, seq_len=32 * C, micro_batch_size=2, tp=2)
    c, H, D = 16, 4, 64
    times = context.layer_times(run, A100, Links.of(A100, EFFICIENCY.network), 1e12, 2)
    assert times.scores == 2 * H * (2 * C + 1) * c * c
    assert times.scores == score_elements(context.shape(run, 2), 0)["computed"]
    assert times.flops == 4 * D * times.scores
    assert sum(context.ring_pairs(C)) * c * c * 2 * H == times.scores


# -- time: the ring's overlap, Ulysses' waits ---------------------------------------------------------

def _ring_expected(run, cluster, core_rate):
    """The module docstring's sums, written out: per layer, forward and backward exposed seconds."""
    links = Links.of(cluster, EFFICIENCY.network)
    one = context.shape(run, 2)
    across = Group.of(run.cp, run.tp, cluster).per_node < run.cp
    hop = links.send(2 * one.chunk_kv_bytes, across)
    u = [p * 4 * one.d_head * one.batch * one.heads * one.chunk ** 2 / core_rate for p in context.ring_pairs(run.cp)]
    forward = sum(max(0.0, hop - x) for x in u[:-1])
    backward = sum(max(0.0, hop - 2.5 * x) for x in u[:-1]) + (run.cp - 1) * hop
    return forward, backward, hop


@pytest.mark.parametrize("tp,C,inside", [(1, 4, True), (2, 4, True), (4, 4, False), (1, 16, False)])
def test_the_ring_hides_each_hop_behind_its_block_and_not_the_gradients_way_home(tp, C, inside):
    run = long(tp=tp, cp=C, seq_len=8192, d_model=1024, n_head=16)
    core_rate = A100.flops("mixed") * EFFICIENCY.attention
    forward, backward, hop = _ring_expected(run, A100, core_rate)
    assert (Group.of(C, tp, A100).per_node == C) == inside
    times = action_times(run, A100)
    assert times.F["cp"] == run.blocks_per_stage * forward
    assert times.I["cp"] == run.blocks_per_stage * backward
    assert backward >= (C - 1) * hop  # the dK/dV hops leave after their block: never hidden


def test_a_slow_network_exposes_the_ring_and_a_fast_one_hides_it():
    run = long(cp=4, seq_len=16384, d_model=1024, n_head=16)
    fast = replace(A100, intra_bandwidth=1e15, intra_latency=0.0)
    slow = replace(A100, intra_bandwidth=1e6)
    assert action_times(run, fast).F["cp"] == 0.0  # every forward hop under its block's compute
    core_rate = A100.flops("mixed") * EFFICIENCY.attention
    forward, backward, hop = _ring_expected(run, slow, core_rate)
    assert forward > 0 and action_times(run, slow).F["cp"] == run.blocks_per_stage * forward


def test_ulysses_waits_for_its_eight_all_to_alls():
    run = long(cp=4, cp_impl="ulysses", tp=2, seq_len=8192)
    links = Links.of(A100, EFFICIENCY.network)
    buffer = 1 * 2048 * 4 * 64 * 2  # b · T/C · H/tp · D · e
    exchanges = 4 * links.all_to_all(buffer, Group.of(4, 2, A100))
    times = action_times(run, A100)
    assert times.F["cp"] == run.blocks_per_stage * exchanges and times.I["cp"] == run.blocks_per_stage * exchanges
    full = action_times(replace(run, checkpoint="full"), A100)
    assert full.I["cp"] == 2 * run.blocks_per_stage * exchanges  # the recomputed forward exchanges again


def test_prediction_names_the_cp_axis(capsys):
    assert cli.main(["predict", "--n-layer", "4", "--d-model", "512", "--n-head", "8", "--seq-len", "8192",
                     "--batch-size", "8", "--gpus", "16", "--tp", "2", "--cp", "4", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp 2 × tp 2 × pp 1 × cp 4 (ring) = 16 GPUs" in out
    assert "context parallel: ring over 4 ranks inside a node, 2048 tokens each" in out
    assert "cp_communication" in out
    assert cli.main(["predict", "--json", "--n-layer", "4", "--d-model", "512", "--n-head", "8", "--seq-len", "8192",
                     "--batch-size", "8", "--gpus", "16", "--cp", "8", "--cp-impl", "ulysses"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"]["cp"] == 8 and out["run"]["dp"] == 2 and out["context_parallel"]["impl"] == "ulysses"
    shape = AttentionShape(batch=1, heads=8, kv_heads=8, seq_len=8192, d_head=64, ranks=8, itemsize=2)
    assert out["context_parallel"]["bytes_per_layer"] == ulysses_bytes(shape)


# -- memory -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint", ["none", "full"])
@pytest.mark.parametrize("pp,schedule", [(1, "1f1b"), (2, "1f1b")])
def test_activation_memory_divides_by_cp_exactly(checkpoint, pp, schedule):
    T, b, h, a, V, L = 4096, 2, 512, 8, 1000, 4
    held = []
    for C in (2, 4, 8):
        run = long(cp=C, pp=pp, schedule=schedule, checkpoint=checkpoint, seq_len=T, micro_batch_size=b, tp=2,
                   sequence_parallel=True, batch_size=16)
        held.append(predict(run, A100).memory["activations"] * C)
        last = memory_breakdown(run, A100, 1, first=pp == 1, last=True)  # 1F1B's last stage: one in flight
        if checkpoint == "none":  # the formula: blockwise blocks (no scores) + the log-sum-exp, and the logits
            per_block = sum(saved_elements_per_block(b, T // C, h, a, 2, True, recompute="selective").values())
            per_block += b * (a // 2) * (T // C)
            assert last["activations"] == 2 * (L // pp) * per_block + 4 * b * (T // C) * (V // 2)
    assert held[0] == held[1] == held[2]


@pytest.mark.parametrize("impl", context.IMPLEMENTATIONS)
def test_the_working_set_is_one_chunk_pair_and_the_buffers_the_blocks_in_flight(impl):
    T, C, b, a, tp = 8192, 4, 2, 8, 2
    run = long(cp=C, cp_impl=impl, seq_len=T, micro_batch_size=b, tp=tp, batch_size=16, vocab_size=8)
    memory = predict(run, A100).memory
    c, heads, D = T // (2 * C), a // tp, 64
    pair_heads = heads // C if impl == "ulysses" else heads
    assert memory["working"] == 2 * b * pair_heads * c * c * 2  # scores and probabilities of one pair, 16-bit
    dense, _ = rank_parameters(run, first=True, last=True)
    bucket = 2 * min(25 * 10**6, 2 * dense)  # dp · cp = 4 ranks reduce gradients in buckets
    in_flight = 4 * 2 * (2 * b * heads * c * D * 2) if impl == "ring" else 4 * b * (T // C) * heads * D * 2
    assert memory["buffers"] == bucket + in_flight


def test_gradients_reduce_and_zero_shards_over_dp_times_cp():
    run = long(dp=2, cp=4, zero=1, seq_len=8192, batch_size=8)
    p = predict(run, A100)
    dense, _ = rank_parameters(run, first=True, last=True)
    _, _, k_bytes = PRECISIONS["mixed"]
    assert p.memory["optimizer_states"] == int(k_bytes * (dense / 8))  # shards over dp · cp = 8 ranks
    assert predict(long(cp=4, seq_len=8192), A100).time["dp_communication"] > 0  # dp 1: cp's ranks still reduce
    assert predict(long(seq_len=8192), A100).time["dp_communication"] == 0


# -- plan ----------------------------------------------------------------------------------------------

def test_plan_finds_a_cp_for_a_sequence_that_fits_nowhere_at_cp_1():
    base = long(seq_len=65536, batch_size=4)
    cluster = replace(A100, memory_bytes=4 * 10**9)
    without = plan(base, 8, cluster, top=3, max_cp=1)
    assert not without.best and without.not_fitting_least.memory_per_gpu_bytes > cluster.memory_bytes
    found = plan(base, 8, cluster, top=3)
    assert found.best and all(p.run.cp > 1 and p.fits for p in found.best)
    best = found.best[0]
    assert predict(best.run, cluster).step_seconds == best.step_seconds  # the simulated figure


def test_every_cp_candidate_can_run():
    base = long(seq_len=32768, batch_size=8)
    runs = list(candidates(base, 16, A100))
    for run in runs:
        run.check()
        assert run.gpus == 16 and run.seq_len % (2 * run.cp) == 0
        if run.cp_impl == "ulysses" and run.cp > 1:
            assert run.n_head % (run.tp * run.cp) == 0
    pairs = {(r.tp, r.cp, r.cp_impl) for r in runs}
    assert (1, 16, "ring") in pairs and (1, 8, "ulysses") in pairs and (2, 8, "ulysses") not in pairs
    assert {r.cp for r in candidates(long(seq_len=2048), 16, A100)} == {1}  # short sequences: no cp search
    assert {r.cp for r in candidates(long(seq_len=2048), 16, A100, max_cp=4)} == {1, 2, 4}


def test_plan_reports_cp_in_its_table_and_json(capsys):
    argv = ["plan", "--n-layer", "4", "--d-model", "512", "--n-head", "8", "--seq-len", "65536", "--batch-size", "4",
            "--gpus", "8", "--vocab-size", "1000", "--top", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert " cp " in out.out.splitlines()[3] and "--cp " in out.err
    assert cli.main([*argv, "--json"]) == 0
    configurations = json.loads(capsys.readouterr().out)["configurations"]
    for c in configurations:
        assert c["dp"] * c["tp"] * c["cp"] * c["pp"] == 8 and c["cp"] > 1


# -- bad input -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["predict", "--gpus", "12", "--cp", "8"], "--gpus 12 is not divisible by tp × cp × pp = 1 × 8 × 1"),
    (["predict", "--gpus", "16", "--dp", "3", "--cp", "4"], "dp × tp × cp × pp = 3 × 1 × 4 × 1 = 12, not --gpus 16"),
    (["predict", "--seq-len", "1000", "--cp", "8", "--gpus", "8"], "cannot be cut into 2·8 = 16 equal chunks"),
    (["predict", "--n-head", "16", "--tp", "8", "--cp", "4", "--cp-impl", "ulysses", "--gpus", "32"],
     "the 2 query and 2 key/value heads per tensor-parallel rank must each divide by --cp 4"),
    (["predict", "--experts", "4", "--cp", "2", "--gpus", "2"], "--cp 2 with --experts is not supported"),
])
def test_bad_input_is_one_clear_line(args, message, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
