"""Pipeline execution without MPI: stages, channels, the executor at pp = 1, timelines.

The multi-process checks (every schedule at pp = 2 and 4, dp x pp, peaks, errors, the CLI) are in
test_pipeline_exec_mpi.py; here is what one process can prove exactly.
"""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl import backend
from refimpl.autograd import no_grad
from refimpl.autograd.saved import saved_tensors
from refimpl.local_trainer import LocalTrainer
from refimpl.nn import functional as F
from refimpl.parallel.comm import LocalComm
from refimpl.parallel.pipeline import Costs, build, simulate, step_messages
from refimpl.parallel.pipeline.actions import step_label
from refimpl.parallel.pipeline.executor import channel_tag
from refimpl.parallel.pipeline.stage import split_model, stage_sizes
from refimpl.parallel.trainer import Trainer
from refimpl.tools import timeline as tl
from refimpl.tools.compare import compare_arrays
from refimpl.tools.pacing import Pacing, StepTime
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb1p", "zbh2", "zbv", "dualpipe", "dualpipev"]


def small(model="gpt", n_layer=4, **kw):
    cfg = TrainConfig(model=model, dtype="float64", n_layer=n_layer, d_model=8, n_head=2, seq_len=8, **kw)
    task = build_task(cfg)
    return cfg, task, build_model(cfg, task)


# --- stages ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers, stages, sizes", [(4, 4, [1, 1, 1, 1]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]),
                                                   (8, 8, [1] * 8), (3, 1, [3])])
def test_stage_sizes_differ_by_at_most_one_and_the_first_stages_take_the_extra(layers, stages, sizes):
    assert stage_sizes(layers, stages) == sizes


@pytest.mark.parametrize("model, n_layer", [("gpt", 5), ("mlp", 4)])
def test_stages_partition_the_parameters_under_single_process_names(model, n_layer):
    _, _, m = small(model, n_layer)
    names = [name for name, _ in m.named_parameters()]
    L = n_layer if model == "gpt" else n_layer + 1
    for S in range(1, L + 1):
        stages = split_model(m, S)
        listed = [name for s in range(S) for name, _ in stages[s].named_parameters()]
        assert listed == names  # every parameter once, in the model's order, stage after stage
        if model == "gpt":
            assert {n.split(".")[0] for n, _ in stages[0].named_parameters()} >= {"wte", "wpe"}
            assert {n.split(".")[0] for n, _ in stages[S - 1].named_parameters()} >= {"ln_f", "lm_head"}


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_stages_in_sequence_compute_the_model_bitwise(model):
    _, task, m = small(model, 5)
    x, _ = task.batch(0, 4)
    with no_grad():  # (nothing is saved for a backward that never comes)
        whole = m(x if model == "gpt" else x.astype(np.float64)).data
    for S in (1, 2, 3, 5):
        h = x
        with no_grad():
            for s, stage in sorted(split_model(m, S).items()):
                h = stage(h)
        assert np.array_equal(h.data, whole)


def test_a_model_with_too_few_layers_is_one_clear_error():
    _, _, m = small("gpt", 3)
    with pytest.raises(ValueError, match=r"3 transformer blocks, which cannot be split into 4 pipeline stages"
                                         r" \(zbv with --pp 2 cuts the model into 4 stages\).*--n-layer 4"):
        split_model(m, 4, why=" (zbv with --pp 2 cuts the model into 4 stages)")
    _, _, mlp = small("mlp", 2)
    with pytest.raises(ValueError, match=r"3 Linear layers .* at least 4 \(--n-layer 3\)"):
        split_model(mlp, 4)


# --- channels: the property the executor's one posted receive per channel relies on -------------


@given(st.sampled_from(SCHEDULES), st.sampled_from([2, 4, 6]), st.integers(1, 20))
@settings(max_examples=60)
def test_every_channel_carries_its_messages_in_the_order_the_receiver_takes_them(name, pp, m):
    try:
        schedule = build(name, pp, m)
    except ValueError:
        return  # outside the schedule's constraints
    sent, taken = {}, {}
    for rank, steps in enumerate(schedule.ranks):
        for step in steps:
            recvs, sends = step_messages(schedule.placement, step)
            for msg in sends:
                sent.setdefault((msg.src, msg.dst, channel_tag(msg, schedule.num_stages)), []).append(msg.key)
            for msg in recvs:
                taken.setdefault((msg.src, msg.dst, channel_tag(msg, schedule.num_stages)), []).append(msg.key)
    assert sent == taken  # same channels, same messages, same order (MPI's non-overtaking rule does the rest)
    assert max((tag for (_, _, tag) in sent), default=0) <= 32767


# --- the executor in one process (pp = 1: every hand-over is local) -----------------------------


@pytest.mark.parametrize("name, m", [("gpipe", 3), ("1f1b", 3), ("interleaved", 2), ("zb1p", 3), ("zbh2", 2),
                                     ("zbv", 3), ("dualpipev", 2)])
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_one_process_pipeline_equals_local_training(name, m, model):
    cfg, task, net = small(model, 4, batch_size=2 * m, clip=0.5)
    trainer = Trainer(net, lambda ps: build_optimizer(cfg, ps), LocalComm(), schedule=name, micro_batches=m,
                      clip=cfg.clip)
    tl.install(trainer)  # the report's peaks (tools/timeline.py)
    ref_model = build_model(cfg, task)
    reference = LocalTrainer(ref_model, build_optimizer(cfg, ref_model.parameters()), 1, cfg.clip)
    trainer.record_grads = reference.record_grads = True
    live_before = saved_tensors.live_bytes
    for step in range(2):
        x, y = task.batch(step, cfg.batch_size)
        loss, ref_loss = trainer.step(x, y), reference.step(x, y)
        assert abs(loss - ref_loss) <= 1e-12 + 1e-10 * abs(ref_loss)
        assert compare_arrays(trainer.last_grads, reference.last_grads, 1e-10, 1e-12).ok
        assert compare_arrays(trainer.full_parameters(), reference.full_parameters(), 1e-10, 1e-12).ok
    report = trainer.report()["pipeline"]
    assert saved_tensors.live_bytes == live_before  # every activation was released by its backward
    if name in ("gpipe", "1f1b", "interleaved"):  # full backwards: the ledger's peak is the replay's, exactly
        assert report["peak_activation_bytes"] == report["replayed_peak_bytes_freed_at_w"]
    else:  # split backwards free part of an activation at I and the rest at W
        assert report["replayed_peak_bytes_freed_at_i"] <= report["peak_activation_bytes"]
        assert report["peak_activation_bytes"] <= report["replayed_peak_bytes_freed_at_w"]


def test_the_model_for_evaluation_holds_every_stage():
    cfg, task, net = small("gpt", 4, batch_size=4)
    trainer = Trainer(net, lambda ps: build_optimizer(cfg, ps), LocalComm(), schedule="zbv", micro_batches=2)
    trainer.step(*task.batch(0, 4))
    other = trainer.model_for_evaluation(net, lambda: build_model(cfg, task))
    assert other is not net
    mine, theirs = other.state_dict(), net.state_dict()
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)


# --- peaks and timelines ---------------------------------------------------------------------------


@given(st.sampled_from(SCHEDULES), st.sampled_from([2, 4]), st.integers(1, 12), st.integers(1, 1000))
@settings(max_examples=40)
def test_replayed_peak_with_equal_bytes_is_the_simulated_peak_times_the_bytes(name, pp, m, nbytes):
    try:
        schedule = build(name, pp, m)
    except ValueError:
        return
    sim = simulate(schedule, steady_state=False)
    sizes = {(a.stage, a.mb): nbytes for r in range(pp) for a in schedule.actions(r)}
    for r in range(pp):
        assert tl.replay_peak(schedule, r, sizes, "W") == sim.peak_activations[r] * nbytes
        assert tl.replay_peak(schedule, r, sizes, "I") == sim.peak_freed_at_i[r] * nbytes


def _records_from_simulation(schedule, costs):
    """Runs (Pacing) whose steps are exactly the simulated intervals (seconds = simulated units)."""
    sim = simulate(schedule, costs, steady_state=False)
    records = []
    for intervals in sim.intervals:
        record = Pacing()
        for start, end, step in intervals:
            kind = "F&B" if step.kind == "F&B" else step.kind
            record.steps.append(StepTime(step_label(schedule, step), kind, float(start), float(end), 0.0))
        records.append(record)
    return sim, records


@pytest.mark.parametrize("name, pp, m", [("1f1b", 4, 8), ("zb1p", 4, 8), ("dualpipe", 4, 8), ("zbv", 2, 5),
                                         ("interleaved", 2, 4)])
def test_a_timeline_that_runs_like_the_simulator_measures_the_simulated_idle(name, pp, m):
    schedule = build(name, pp, m)
    costs = Costs(F=Fraction(1, 50), I=Fraction(1, 50), W=Fraction(1, 50))
    sim, records = _records_from_simulation(schedule, costs)
    stats = np.stack([tl.rank_stats(r, 0, 0, 0) for r in records])  # (pp, fields)
    summary = tl.summarize(schedule, stats, "synthetic")
    assert summary["measured_idle_fraction"] == pytest.approx(summary["simulated_idle_fraction"], abs=1e-9)
    assert summary["simulated_idle_fraction"] == pytest.approx([float(i / sim.makespan) for i in sim.idle])
    assert summary["measured_bubble"] == pytest.approx(float(sim.bubble_fraction), abs=1e-9)
    assert summary["bubble_ratio"] == pytest.approx(1.0, abs=1e-6) or sim.bubble_fraction == 0


def test_chrome_trace_has_one_event_per_step_per_rank_for_both_timelines():
    schedule = build("dualpipe", 4, 8)
    _, records = _records_from_simulation(schedule, Costs(F=1, I=1, W=1))
    trace = tl.chrome_trace(schedule, [r.steps for r in records], "synthetic")
    for pid in (0, 1):
        events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid and e["cat"] != "part"]
        for rank in range(4):
            mine = sorted((e for e in events if e["tid"] == rank), key=lambda e: e["ts"])
            assert len(mine) == len(schedule.ranks[rank])
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-6 for a, b in zip(mine, mine[1:]))


def test_action_costs_parse_and_refuse_bad_values():
    costs = tl.parse_costs("F=0.02,I=0.02,W=0.01")
    assert (costs.B, costs.FB) == (Fraction(3, 100), Fraction(5, 100))
    assert tl.parse_costs(None) is None
    assert tl.describe_costs(costs).startswith("sleep (F=0.02,B=0.03,I=0.02,W=0.01,FB=0.05")
    for bad in ("F=0", "F=-1", "X=1", "F=120"):
        with pytest.raises(ValueError):
            tl.parse_costs(bad)


def test_an_overlapped_step_records_its_two_actions_inside_it():
    cfg, task, net = small("gpt", 4, batch_size=8)
    trainer = Trainer(net, lambda ps: build_optimizer(cfg, ps), LocalComm(), schedule="dualpipev", micro_batches=4)
    x, y = task.batch(0, 8)
    micro = [(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]) for i in range(4)]

    def loss_fn(logits, mb):
        return F.cross_entropy(logits, backend.asarray(micro[mb][1]), reduction="sum") * (1.0 / y.size)

    record = trainer.executor.observer = Pacing()  # what the tools install to time the steps
    trainer.executor.run(lambda mb: micro[mb][0], loss_fn, micro[0][0].shape)
    pairs = [s for s in record.steps if s.kind == "F&B"]
    assert pairs and all(len(s.parts) == 2 for s in pairs)
    for s in pairs:
        (f, f0, f1), (b, b0, b1) = s.parts
        assert f.startswith("F") and b.startswith("B") and s.start <= f0 <= f1 <= b0 <= b1 <= s.end
    assert all(s.parts == () for s in record.steps if s.kind != "F&B")
