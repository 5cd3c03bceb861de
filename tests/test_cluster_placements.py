"""The cluster model's placement terms, each against its formula written out again here.

tests/test_cluster.py checks groups that lie inside one node or one member per node; these are the
terms that only show when a group spans nodes with several members in each, and the terms that only
show with experts or sequence parallelism: the all-to-all of a group that spans
nodes, the pipeline's message across nodes when dp·tp fills a node, the data-parallel group's stride
of tp, the experts' model states under ZeRO, and the pipeline message with sequence parallelism.

Where a rank lies is computed from mesh.py's numbering, rank = (p·dp + d)·tp + t, filled node by
node (node = rank // gpus_per_node), not from collectives.Group.of; the α–β formulas are the
docstrings' (refimpl/tools/cluster/collectives.py, model.py), with α and β chosen apart so that a
term taken at the wrong link or over the wrong count cannot give the same number.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from refimpl.tools.cluster.collectives import Group, Links
from refimpl.tools.cluster.hardware import PRESETS
from refimpl.tools.cluster.model import Efficiency, Run, action_times, memory_breakdown, predict, rank_parameters

A_IN, B_IN, A_OUT, B_OUT = 2e-6, 300e9, 11e-6, 25e9  # α, β inside a node and across nodes
CLUSTER = replace(PRESETS["a100-80gb"], intra_latency=A_IN, intra_bandwidth=B_IN, inter_latency=A_OUT,
                  inter_bandwidth=B_OUT)  # 8 GPUs per node
EFF = Efficiency(network=1.0)  # β is the link's bandwidth
LINKS = Links(alpha_in=A_IN, beta_in=B_IN, alpha_out=A_OUT, beta_out=B_OUT)


def small(**kw) -> Run:
    base = dict(n_layer=8, d_model=256, n_head=8, seq_len=128, vocab_size=1000, batch_size=64, dtype="mixed")
    base.update(kw)
    return Run(**base)


def rank(p: int, d: int, t: int, dp: int, tp: int) -> int:
    """mesh.py: tp fastest, then dp, pp slowest."""
    return (p * dp + d) * tp + t


def per_node(ranks, gpus_per_node: int = 8) -> int:
    """Members of a group in each node (every node it touches holds the same number here)."""
    counts = set(Counter(r // gpus_per_node for r in ranks).values())
    assert len(counts) == 1, counts
    return counts.pop()


# -- all-to-all over a group that spans nodes ---------------------------------------------------

@pytest.mark.parametrize("g,k", [(8, 4), (16, 8), (16, 2), (8, 8), (8, 1)])
def test_all_to_all_of_a_group_spanning_nodes(g, k):
    """(k − 1)(α_in + n/(gβ_in)) + (g − k)(α_out + n/(gβ_out)): every rank sends n/g to each of the
    other g − 1 ranks, k − 1 of them in its node, g − k in others (pairwise, one message each)."""
    n = 3e6
    expected = (k - 1) * (A_IN + n / g / B_IN) + (g - k) * (A_OUT + n / g / B_OUT)
    assert LINKS.all_to_all(n, Group(g, k)) == pytest.approx(expected, rel=1e-12)


def test_the_experts_all_to_all_is_over_neighbouring_replicas_on_their_nodes():
    """times.A = all-to-all of K·N·h·e bytes over the ep group: ep neighbouring replicas
    (d = e_d·ep + j, tp = 1), so 8 per node of 8 GPUs, 4 per node of 4 GPUs."""
    run = small(dp=16, ep=16, experts=16, top_k=2, micro_batch_size=2)
    n = 2 * (2 * 128) * 256 * 2  # K · N · h · e
    for gpus_per_node in (8, 4):
        cluster = replace(CLUSTER, gpus_per_node=gpus_per_node)
        k = per_node([rank(0, j, 0, run.dp, 1) for j in range(run.ep)], gpus_per_node)
        assert k == gpus_per_node
        g = run.ep
        expected = (k - 1) * (A_IN + n / g / B_IN) + (g - k) * (A_OUT + n / g / B_OUT)
        assert action_times(run, cluster, EFF).A == pytest.approx(expected, rel=1e-12)


# -- pipeline neighbours ------------------------------------------------------------------------

@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 2), (4, 2), (2, 4), (8, 1), (2, 8), (16, 1)])
def test_pipeline_neighbours_are_on_another_node_when_dp_tp_fills_one(dp, tp):
    """P = α + n/β of one message, n = b·s·h·e, between stage p's rank and stage p + 1's, which are
    dp·tp ranks apart: on the node's links while dp·tp < 8, across nodes from dp·tp = 8 on."""
    run = small(dp=dp, tp=tp, pp=2, micro_batch_size=2, batch_size=32 * dp)
    across = any(rank(0, d, t, dp, tp) // 8 != rank(1, d, t, dp, tp) // 8 for d in range(dp) for t in range(tp))
    assert across == (dp * tp >= 8)
    n = 2 * 128 * 256 * 2
    expected = A_OUT + n / B_OUT if across else A_IN + n / B_IN
    assert action_times(run, CLUSTER, EFF).P == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tp,across", [(2, False), (4, False), (8, True)])
def test_a_pipeline_message_with_sequence_parallelism_is_a_tp_ranks_share(tp, across):
    """With sequence parallelism each tp rank holds s/tp of the sequence: P's message is
    b·s·h·e / tp bytes (tp ranks send theirs side by side), without it b·s·h·e."""
    run = small(tp=tp, pp=2, micro_batch_size=2, sequence_parallel=True)
    n = 2 * 128 * 256 * 2 / tp
    expected = A_OUT + n / B_OUT if across else A_IN + n / B_IN
    assert action_times(run, CLUSTER, EFF).P == pytest.approx(expected, rel=1e-12)
    whole = 2 * 128 * 256 * 2
    plain = action_times(replace(run, sequence_parallel=False), CLUSTER, EFF).P
    assert plain == pytest.approx(A_OUT + whole / B_OUT if across else A_IN + whole / B_IN, rel=1e-12)


# -- the data-parallel group --------------------------------------------------------------------

@pytest.mark.parametrize("dp,tp", [(4, 4), (8, 2), (2, 8), (16, 1), (4, 1)])
def test_the_data_parallel_all_reduce_is_over_a_group_of_stride_tp(dp, tp):
    """The dp group (same p, t) is ranks d·tp + t: k = 8/tp of them per node (all dp if fewer).
    Its all-reduce of the G·Ψ gradient bytes, hierarchical:
    2(k − 1)(α_in + n/(kβ_in)) + 2(g/k − 1)(α_out + n/(gβ_out)); one bucket (n < 25 MB), so the
    whole of it is exposed after the last backward."""
    run = small(dp=dp, tp=tp, pp=1, zero=0, batch_size=16 * dp)
    k = per_node([rank(0, d, 0, dp, tp) for d in range(dp)])
    assert k == min(dp, 8 // tp)
    dense, _ = rank_parameters(run, first=True, last=True)
    n, g = 2 * dense, dp
    assert n < 25e6
    expected = 2 * (k - 1) * (A_IN + n / (k * B_IN)) + 2 * (g // k - 1) * (A_OUT + n / (g * B_OUT))
    assert predict(run, CLUSTER, EFF).time["dp_communication"] == pytest.approx(expected, rel=1e-12)


# -- experts' model states under ZeRO -----------------------------------------------------------

@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_model_states_are_partitioned_over_the_experts_replicas(zero):
    """ZeRO partitions each model state over the ranks that hold the same values: the dense
    parameters' over dp, the experts' over their own replicas, dp/ep. Mixed precision: P = G = 2,
    K = 12 bytes per parameter; optimizer states partitioned from stage 1, gradients from 2,
    parameters from 3. This rank's expert elements: E/ep experts of 8h² + 5h in every MoE block."""
    dp, ep, E, h, L = 8, 2, 8, 256, 8
    run = small(dp=dp, ep=ep, experts=E, top_k=2, zero=zero, n_layer=L, batch_size=64)
    dense, experts = rank_parameters(run, first=True, last=True)
    assert experts == L * (E // ep) * (8 * h * h + 5 * h)
    memory = memory_breakdown(run, CLUSTER, in_flight=1, first=True, last=True)
    for category, per_parameter, from_stage in (("parameters", 2, 3), ("gradients", 2, 2),
                                                ("optimizer_states", 12, 1)):
        held = dense / dp + experts / (dp // ep) if zero >= from_stage else dense + experts
        assert memory[category] == int(per_parameter * held), category


def test_the_optimizer_steps_the_experts_shard_of_their_replicas():
    """Adam is memory-bound: G + 2K + 2P bytes per parameter of the shard it steps (ZeRO:
    dense/dp + experts/(dp/ep)), at the memory bandwidth × the memory efficiency."""
    dp, ep = 8, 2
    run = small(dp=dp, ep=ep, experts=8, top_k=2, zero=1)
    dense, experts = rank_parameters(run, first=True, last=True)
    eff = Efficiency(network=1.0, memory=0.5)
    shard = dense / dp + experts / (dp // ep)
    expected = shard * (2 + 2 * 12 + 2 * 2) / (CLUSTER.memory_bandwidth * 0.5)
    assert predict(run, CLUSTER, eff).time["optimizer"] == pytest.approx(expected, rel=1e-12)
