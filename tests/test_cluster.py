"""The cluster model (refimpl/tools/cluster/): its terms are refimpl's tested formulas and simulator.

No timing here: calibration and speed live in benchmarks/ (bench_cluster_calibration.py,
bench_plan.py). What is checked: the pipeline's extrapolation equals the full simulation; the
α–β collectives are the stated formulas; memory is the ZeRO paper's model states and the engine's
per-block activations; tensor parallelism's traffic is tensor_parallel/communication.py's; the
parameter count is the real model's; MFU is PaLM's; published runs are predicted within 15%;
plan finds what an exhaustive search finds; bad input is one clear line.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from refimpl.memory import PRECISIONS, model_state_bytes, paper_table, saved_bytes_per_block
from refimpl.parallel.pipeline import Costs
from refimpl.parallel.tensor_parallel.communication import StepShape, bytes_per_step
from refimpl.tools import cli
from refimpl.tools.cluster import hardware
from refimpl.tools.cluster.collectives import Group, Links
from refimpl.tools.cluster.hardware import PRESETS, Cluster
from refimpl.tools.cluster.model import (
    Efficiency,
    Run,
    action_times,
    matmul_parameters,
    memory_breakdown,
    parameters,
    predict,
    rank_parameters,
)
from refimpl.tools.cluster.pipeline import _makespan, estimate_step, extrapolated_makespan, simulate_step
from refimpl.tools.cluster.plan import candidates, plan, shape_for
from refimpl.tools.cluster.published import TOLERANCE, checks

A100 = PRESETS["a100-80gb"]


def small(**kw) -> Run:
    base = dict(n_layer=8, d_model=256, n_head=8, seq_len=128, vocab_size=1000, batch_size=32, dtype="mixed")
    base.update(kw)
    return Run(**base)


# -- the pipeline ---------------------------------------------------------------------------------

@given(schedule=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb1p", "zbh2", "zbv", "dualpipe", "dualpipev"]),
       pp=st.sampled_from([2, 4, 6]), periods=st.integers(13, 16), extra=st.integers(0, 5),
       F=st.integers(20, 200), I=st.integers(20, 300), W=st.integers(10, 200), P=st.integers(0, 100),
       A=st.sampled_from([0, 0, 15, 60]), k=st.integers(1, 3))
@example(schedule="gpipe", pp=4, periods=13, extra=1, F=50, I=60, W=40, P=5, A=0, k=1)  # the one peak that grows with m
@example(schedule="dualpipe", pp=4, periods=13, extra=2, F=50, I=60, W=40, P=5, A=60, k=2)  # F&B hides all-to-alls
@example(schedule="interleaved", pp=2, periods=13, extra=0, F=20, I=20, W=10, P=26, A=0, k=1)  # periods alternate
@example(schedule="zbh2", pp=2, periods=13, extra=0, F=20, I=20, W=10, P=31, A=0, k=1)  # a cycle of 3 periods
def test_the_extrapolated_makespan_equals_the_full_simulation(schedule, pp, periods, extra, F, I, W, P, A, k):
    unit = 2 if schedule == "dualpipe" else 1
    m = periods * pp * unit + (extra * unit % (pp * unit) if schedule not in ("interleaved",) else 0)
    costs = Costs(F=F, I=I, W=W, P=P, A=A)
    chunks = 2 if schedule == "interleaved" else None
    exchanges = k if A else 0  # experts' all-to-alls: the simulator's chunk model
    makespan, peaks, simulated, exposed = extrapolated_makespan(schedule, pp, m, chunks, costs, exchanges)
    assert simulated == (m,) or max(simulated) < m  # simulated whole (no cycle found), or extended
    full, full_peaks, full_exposed = _makespan(schedule, pp, m, chunks, costs, exchanges)
    assert makespan == full
    assert peaks == full_peaks
    assert exposed == full_exposed


@pytest.mark.parametrize("schedule,pp,P", [("1f1b", 4, 5), ("zb1p", 4, 0), ("dualpipe", 4, 5),
                                          ("interleaved", 2, 26), ("zbh2", 2, 31)])
def test_a_long_run_is_extended_from_its_cycle_not_simulated_whole(schedule, pp, P):
    """The probes find the cycle (of one period, or of 2 and 3 periods under long message delays) and
    the long run is extended from it, equal to the full simulation."""
    from refimpl.tools.cluster.pipeline import PROBES  # noqa: PLC0415

    costs = Costs(F=20, I=20, W=10, P=P)
    chunks = 2 if schedule == "interleaved" else None
    m = 40 * pp * (2 if schedule == "dualpipe" else 1)
    makespan, _, simulated, _ = extrapolated_makespan(schedule, pp, m, chunks, costs)
    assert len(simulated) == PROBES and max(simulated) < m
    assert makespan == _makespan(schedule, pp, m, chunks, costs)[0]


@pytest.mark.parametrize("schedule,chunks", [("gpipe", None), ("1f1b", None), ("interleaved", 2)])
def test_the_closed_form_estimate_equals_the_simulator_where_the_formulas_are_exact(schedule, chunks):
    # zero message delay: (p-1)(F+B) is exact for these schedules (pipeline/formulas.py)
    a = estimate_step(schedule, 4, 24, chunks, 3e-3, 4e-3, 2e-3, 0.0)
    b = simulate_step(schedule, 4, 24, chunks, 3e-3, 4e-3, 2e-3, 0.0)
    assert a.makespan == pytest.approx(b.makespan, rel=1e-12)
    assert a.peak_in_flight == b.peak_in_flight


# -- collectives ----------------------------------------------------------------------------------

def test_ring_and_hierarchical_collectives_are_the_stated_formulas():
    links = Links(alpha_in=1e-6, beta_in=100.0, alpha_out=1e-5, beta_out=10.0)
    n, g = 1200.0, 4
    inside, outside = Group(g, g), Group(g, 1)
    assert links.allreduce(n, inside) == pytest.approx(2 * (g - 1) * (1e-6 + n / (g * 100.0)), rel=1e-15)
    assert links.reduce_scatter(n, outside) == pytest.approx((g - 1) * (1e-5 + n / (g * 10.0)), rel=1e-15)
    assert links.allgather(n, outside) == links.reduce_scatter(n, outside)
    # 16 ranks, 4 per node: inside the node on the fast link, then across 4 nodes with n/k each
    k, g = 4, 16
    expected = 2 * ((k - 1) * (1e-6 + n / (k * 100.0)) + (g // k - 1) * (1e-5 + n / (g * 10.0)))
    assert links.allreduce(n, Group(g, k)) == pytest.approx(expected, rel=1e-15)
    assert links.allreduce(n, Group(1, 1)) == 0.0
    assert links.send(n, across_nodes=True) == pytest.approx(1e-5 + n / 10.0)


@pytest.mark.parametrize("size,stride,per_node", [(8, 1, 8), (4, 2, 4), (16, 4, 2), (32, 8, 1), (2, 16, 1), (3, 1, 3)])
def test_groups_lie_on_nodes_as_the_mesh_places_their_ranks(size, stride, per_node):
    assert Group.of(size, stride, A100).per_node == per_node


# -- memory ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["mixed", "float32"])
def test_model_states_are_the_zero_papers_formula_at_the_ranks_parameters(zero, dtype):
    run = small(dp=4, tp=2, pp=2, zero=zero, dtype=dtype, batch_size=64)
    memory = memory_breakdown(run, A100, in_flight=2, first=True, last=False)
    dense, experts = rank_parameters(run, first=True, last=False)
    assert experts == 0
    p, g, k = PRECISIONS[dtype]
    states = memory["parameters"] + memory["gradients"] + memory["optimizer_states"]
    assert abs(states - model_state_bytes(zero, dense, 4, p, g, k)) <= 3  # each part rounded down to whole bytes


def test_the_zero_papers_table_1_is_still_exact():
    # Rajbhandari et al., Table 1: 7.5B parameters, 64 ranks: DP 120 GB, ZeRO-1 31.4, ZeRO-2 16.6, ZeRO-3 1.9
    rows = paper_table(7.5e9, [64])
    assert [round(r["bytes"][64] / 1e9, 1) for r in rows] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("tp,sp,checkpoint", [(1, False, "none"), (2, False, "none"), (4, True, "none"),
                                              (2, False, "selective"), (2, True, "selective"), (2, False, "full")])
def test_activations_are_the_engines_per_block_formula_times_the_schedules_peak(tp, sp, checkpoint):
    run = small(tp=tp, pp=2, dp=1, sequence_parallel=sp, checkpoint=checkpoint, micro_batch_size=2, dropout=True)
    blocks = run.n_layer // 2
    memory = memory_breakdown(run, A100, in_flight=3, first=True, last=False)
    b, s, h = 2, run.seq_len, run.d_model
    per_block = saved_bytes_per_block(b, s, h, run.n_head, tp, sp, dropout=True, recompute=checkpoint, itemsize=2)
    assert memory["activations"] == 3 * blocks * per_block


def test_parameters_are_the_real_models():
    from refimpl.nn.models import GPT, GPTConfig
    for tied in (False, True):
        config = GPTConfig(vocab_size=50, seq_len=12, n_layer=3, n_head=2, d_model=16, tie_weights=tied)
        run = Run(n_layer=3, d_model=16, n_head=2, seq_len=12, vocab_size=50, batch_size=1, tie_weights=tied)
        assert parameters(run) == GPT(config).num_parameters()
        first, _ = rank_parameters(run, first=True, last=True)
        assert first == parameters(run)  # one GPU, one stage: the whole model
    config = GPTConfig(vocab_size=50, seq_len=12, n_layer=4, n_head=2, d_model=16, n_experts=4, moe_every=2)
    run = Run(n_layer=4, d_model=16, n_head=2, seq_len=12, vocab_size=50, batch_size=1, experts=4, moe_every=2)
    assert parameters(run) == GPT(config).num_parameters()
    dense, experts = rank_parameters(run, first=True, last=True)
    assert dense + experts == parameters(run)


# -- time -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("checkpoint", ["none", "full"])
def test_tensor_parallel_traffic_is_the_formulas_bytes_over_the_link(sp, checkpoint):
    """With α = 0 and an effective β of 1 byte/s, tp's seconds are its bytes: those of
    tensor_parallel/communication.py's count for the blocks (its sequence-parallel parameter sums aside)."""
    cluster = replace(A100, intra_latency=0.0, intra_bandwidth=1.0)
    eff = Efficiency(network=1.0)
    t, b = 4, 2
    run = small(tp=t, pp=1, dp=1, micro_batch_size=b, sequence_parallel=sp, checkpoint=checkpoint)
    times = action_times(run, cluster, eff, last=True)
    seconds = times.F.get("tp", 0.0) + times.I.get("tp", 0.0)
    shape = StepShape(tokens=b * run.seq_len, width=run.d_model, blocks=run.n_layer, micro_batches=1,
                      has_embedding=False, has_head=False,
                      recomputed_blocks=run.n_layer if checkpoint == "full" else 0)
    expected = bytes_per_step(shape, sp, t, itemsize=2)
    if sp:
        expected.pop("allreduce")  # parameters seen on shards: not modelled (a few C per block)
    assert seconds == pytest.approx(sum(expected.values()), rel=1e-12)


def test_mfu_is_palms_model_flops_over_the_peak():
    run = small(dp=8, micro_batch_size=2)
    p = predict(run, A100)
    tokens = run.batch_size * run.seq_len
    h, L = run.d_model, run.n_layer
    assert matmul_parameters(run) == 12 * L * h * h + run.vocab_size * h
    flops = tokens * (6 * matmul_parameters(run) + 12 * L * h * run.seq_len)
    assert p.mfu == pytest.approx(flops / (p.step_seconds * 8 * A100.peak_flops), rel=1e-12)
    assert p.tokens_per_second == pytest.approx(tokens / p.step_seconds, rel=1e-12)
    assert sum(p.memory.values()) == p.memory_per_gpu_bytes
    # recomputation costs time but is not model FLOPs: MFU falls
    assert predict(replace(run, checkpoint="full"), A100).mfu < p.mfu


def test_dualpipe_hides_the_experts_all_to_alls_and_1f1b_does_not():
    moe = dict(n_layer=8, d_model=256, n_head=8, seq_len=128, vocab_size=1000, batch_size=64, dp=4, pp=2,
               experts=8, top_k=2, ep=4, micro_batch_size=2, dtype="mixed")
    slow_links = replace(A100, inter_bandwidth=2e8, intra_bandwidth=2e8)  # all-to-alls as long as compute
    one_f = predict(Run(**moe, schedule="1f1b"), slow_links)
    dual = predict(Run(**moe, schedule="dualpipe"), slow_links)
    times = action_times(Run(**moe, schedule="1f1b"), slow_links)
    n = one_f.micro_batches
    # 1F1B waits for every all-to-all of its F and B steps: 2 per MoE block each way
    assert one_f.time["ep_communication"] == pytest.approx(n * 2 * times.exchanges * times.A, rel=1e-6)
    assert 0 < dual.time["ep_communication"] < 0.75 * one_f.time["ep_communication"]


def test_the_step_is_its_parts():
    run = small(dp=2, tp=2, pp=2, schedule="zb1p", batch_size=64, zero=1)
    p = predict(run, A100)
    assert p.step_seconds == pytest.approx(sum(p.time.values()), rel=1e-6)  # the simulator counts whole ns
    assert all(v >= 0 for v in p.time.values())


# -- published results ----------------------------------------------------------------------------

def test_published_runs_at_64_gpus_and_more_are_predicted_within_15_percent():
    results = checks()
    within = [c for c in results if c.row.run.gpus >= 64 and abs(c.error) <= TOLERANCE]
    sources = {c.row.source.split(",")[0] for c in within}
    assert len(within) >= 3 and len(sources) >= 3, [(c.row.source, c.error) for c in results]
    for c in results:
        assert math.isfinite(c.predicted) and c.predicted > 0


# -- plan -----------------------------------------------------------------------------------------

def test_every_candidate_is_a_configuration_that_can_run():
    base = small(n_layer=8, batch_size=64)
    runs = list(candidates(base, 16, A100))
    assert runs
    for run in runs:
        run.check()  # the generators' own rules agree with plan's
        assert run.gpus == 16
    assert {r.schedule for r in runs if r.pp > 1} == {"1f1b", "interleaved", "zb1p", "dualpipe"}
    assert {r.zero for r in runs} == {0, 1, 2, 3} and {r.checkpoint for r in runs} == {"none", "selective", "full"}


def test_plan_finds_what_an_exhaustive_search_finds():
    base = small(n_layer=4, d_model=128, n_head=4, batch_size=16)
    cluster = replace(A100, memory_bytes=12 * 10**6)  # tight enough that some configurations do not fit
    result = plan(base, 8, cluster, top=3, refine=10_000)
    every = [predict(r, cluster) for r in candidates(base, 8, cluster)]
    fitting = sorted((p for p in every if p.fits), key=lambda p: (p.step_seconds, p.memory_per_gpu_bytes))
    assert 0 < len(fitting) < len(every)
    assert [p.step_seconds for p in result.best] == [p.step_seconds for p in fitting[:3]]
    assert result.fitting == len(fitting) and result.searched == len(every)


def test_params_pick_the_nearest_published_shape():
    assert shape_for(175e9)[0] == "GPT-3 175B"
    assert shape_for(1e12)[0] == "Megatron 1T"
    assert shape_for(1.3e9)[0] == "GPT-3 XL 1.3B"


# -- the commands ---------------------------------------------------------------------------------

def test_predict_json_has_the_issues_fields(capsys):
    assert cli.main(["predict", "--json", "--n-layer", "4", "--d-model", "256", "--n-head", "8", "--pp", "2",
                     "--gpus", "8", "--tp", "2", "--schedule", "interleaved", "--batch-size", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_seconds", "tokens_per_second", "model_flops_per_gpu_per_second", "mfu", "memory_per_gpu_bytes",
                "memory", "time"):
        assert key in out
    assert out["run"]["dp"] == 2 and out["run"]["chunks"] == 2


def test_plan_json_lists_configurations_best_first(capsys):
    assert cli.main(["plan", "--params", "1.3B", "--gpus", "16", "--json", "--top", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    steps = [c["step_seconds"] for c in out["configurations"]]
    assert len(steps) == 4 and steps == sorted(steps)
    for c in out["configurations"]:
        assert c["dp"] * c["tp"] * c["pp"] == 16 and c["memory_per_gpu_bytes"] <= PRESETS["a100-80gb"].memory_bytes


@pytest.mark.parametrize("args,message", [
    (["predict", "--gpus", "12", "--tp", "8"], "not divisible by tp × pp"),
    (["predict", "--gpus", "16", "--dp", "3", "--tp", "2"], "must multiply to the GPU count"),
    (["predict", "--cluster", "tpu-v9"], "unknown cluster 'tpu-v9'"),
    (["predict", "--pp", "3", "--schedule", "dualpipe", "--gpus", "6"], "even --pp"),
    (["predict", "--tp", "3", "--gpus", "3"], "must divide --n-head"),
    (["plan", "--params", "1T", "--gpus", "8"], "fits nowhere on 8 GPUs"),
    (["plan", "--gpus", "8"], "say which model"),
    (["predict", "--cluster", "local"], "run `python -m refimpl calibrate` first"),
])
def test_bad_input_is_one_clear_line(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_fits_nowhere_says_by_how_much(capsys):
    assert cli.main(["plan", "--params", "1T", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "GB over the 85.9 GB" in err


def test_cluster_files_load_and_bad_ones_say_what_is_wrong(tmp_path):
    path = tmp_path / "c.json"
    hardware.save(PRESETS["h100-80gb"], str(path))
    assert hardware.load(str(path)) == PRESETS["h100-80gb"]
    values = PRESETS["a100-80gb"].as_dict()
    values.pop("peak_flops")
    values["colour"] = "green"
    path.write_text(json.dumps(values))
    with pytest.raises(ValueError, match="unknown field.*colour.*missing field.*peak_flops"):
        hardware.load(str(path))
    with pytest.raises(ValueError, match="must be a positive number"):
        Cluster(**{**PRESETS["a100-80gb"].as_dict(), "inter_bandwidth": -1.0})


def test_the_operations_per_block_are_the_engines():
    from refimpl.tools.cluster import model
    from refimpl.tools.cluster.calibrate import block_operations
    assert model.OPERATIONS_PER_BLOCK == block_operations()
    assert model.OPERATIONS_PER_DROPOUT_BLOCK == block_operations(dropout=0.1)


def test_mixed_precision_halves_float32s_activation_bytes():
    run = small(pp=1, dp=1)
    a = memory_breakdown(run, A100, 1, True, False)["activations"]
    b = memory_breakdown(replace(run, dtype="float32"), A100, 1, True, False)["activations"]
    assert 2 * a == b
    assert isinstance(a, int) and isinstance(b, int)  # whole bytes
