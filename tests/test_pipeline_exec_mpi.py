"""Pipeline parallelism over MPI: every schedule equals single-process training, dp x pp, peaks,
exact point-to-point traffic, clear errors, and the CLI (train / verify with --pp).

Many configurations run in one launch (tests/mpi_programs/pipeline_verify.py prints one JSON list);
the launches are module fixtures shared by several tests.
"""

import json

import pytest
from mpi_util import PROGRAMS, last_json, run_mpi, run_mpi_json

from refimpl.parallel.pipeline import build, step_messages

pytestmark = pytest.mark.mpi

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb1p", "zbh2", "zbv", "dualpipe", "dualpipev"]
SPLIT = {"zb1p", "zbh2", "zbv", "dualpipe", "dualpipev"}  # schedules with I and W steps

PP2 = [dict(schedule=s, pp=2, m=m) for s, ms in [("gpipe", (1, 3)), ("1f1b", (1, 4)), ("interleaved", (2, 4)),
                                                  ("zb1p", (2, 5)), ("zbh2", (3, 4)), ("zbv", (2, 5)),
                                                  ("dualpipe", (4, 6)), ("dualpipev", (4, 5))] for m in ms]
PP2 += [dict(schedule="interleaved", pp=2, m=2, chunks=3, n_layer=6),
        dict(schedule="1f1b", pp=2, m=3, model="mlp", n_layer=2),
        dict(schedule="zbv", pp=2, m=3, model="mlp", n_layer=3),
        dict(schedule="dualpipe", pp=2, m=4, model="mlp", n_layer=2, optimizer="sgd", clip=0.0)]

PP4 = [dict(schedule=s, pp=4, m=m, n_layer=8 if s in ("interleaved", "zbv", "dualpipev") else 4)
       for s, ms in [("gpipe", (4, 6)), ("1f1b", (2, 8)), ("interleaved", (4, 8)), ("zb1p", (4, 7)),
                     ("zbh2", (4, 8)), ("zbv", (4, 9)), ("dualpipe", (8, 10)), ("dualpipev", (8, 9))] for m in ms]
DP2 = [dict(schedule=s, pp=2, m=4, n_layer=4) for s in SCHEDULES]  # 4 processes: dp 2 x pp 2
DP4 = [dict(schedule="1f1b", pp=1, m=2), dict(schedule="zbv", pp=1, m=3, model="mlp")]  # dp 4 x pp 1
CHECKPOINTED = [dict(schedule="1f1b", pp=4, m=4, n_layer=8, checkpoint="sqrt"),
                dict(schedule="zb1p", pp=2, m=4, n_layer=6, checkpoint="revolve:1"),
                dict(schedule="dualpipe", pp=4, m=8, n_layer=8, checkpoint="every:2", collectives="ring"),
                dict(schedule="zbv", pp=2, m=4, n_layer=8, checkpoint="budget:20KiB"),
                dict(schedule="interleaved", pp=2, m=2, n_layer=16, checkpoint="sqrt", model="mlp")]
# Dropout masks are keyed by (seed, global batch, row), so every split reproduces them, DualPipe's copies too.
DROPOUT = [dict(schedule="dualpipe", pp=2, m=4, dropout=0.2), dict(schedule="zbv", pp=4, m=4, n_layer=8, dropout=0.1),
           dict(schedule="1f1b", pp=2, m=2, dropout=0.1, checkpoint="sqrt", n_layer=4)]


# ZeRO-1 over each stage's data-parallel group (G = dp; DualPipe's two copies of a stage are summed
# afterwards: parallel/trainer.py), several flat buckets, clipping, checkpointing.
ZERO1 = [dict(schedule="1f1b", pp=2, m=4, zero=1),
         dict(schedule="zbv", pp=2, m=4, zero=1, clip=0.05, bucket_bytes=3000),
         dict(schedule="dualpipe", pp=2, m=4, zero=1, bucket_bytes=2000), dict(schedule="dualpipe", pp=4, m=8, zero=1),
         dict(schedule="zb1p", pp=2, m=2, zero=1, checkpoint="sqrt", optimizer="sgd"),
         dict(schedule="interleaved", pp=1, m=2, zero=1, n_layer=4)]
# ZeRO-2 and -3 inside the schedule: gradients reduce-scattered after every backward of a stage (M
# per step), ZeRO-3's parameters sharded and gathered around every F and B (docs/pipeline_parallel.md §3).
ZERO23 = [dict(schedule="1f1b", pp=2, m=4, zero=2, bucket_bytes=3000), dict(schedule="zb1p", pp=2, m=2, zero=3),
          dict(schedule="dualpipe", pp=2, m=4, zero=3, clip=0.05), dict(schedule="zbv", pp=2, m=4, zero=2)]


def launch(n: int, specs: list, timeout: float = 240) -> list:
    done = run_mpi(n, [PROGRAMS / "pipeline_verify.py", json.dumps(specs)], timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return last_json(done)


@pytest.fixture(scope="module")
def on_two():
    return launch(2, PP2)


@pytest.fixture(scope="module")
def on_four():
    return launch(4, PP4 + DP2 + DP4 + CHECKPOINTED + DROPOUT + ZERO1 + ZERO23)


def _failures(results):
    return [(r["spec"], r["worst"]) for r in results if not r["ok"]]


def test_every_schedule_at_pp2_equals_single_process_training(on_two):
    assert {r["spec"]["schedule"] for r in on_two} == set(SCHEDULES)
    assert not _failures(on_two)
    assert all(r["dp"] == 1 for r in on_two)


def test_every_schedule_at_pp4_and_on_a_dp2_x_pp2_mesh_equals_single_process_training(on_four):
    assert not _failures(on_four)
    meshes = {(r["spec"]["schedule"], r["dp"], r["spec"]["pp"]) for r in on_four}
    assert {(s, 1, 4) for s in SCHEDULES} <= meshes and {(s, 2, 2) for s in SCHEDULES} <= meshes
    assert ("1f1b", 4, 1) in meshes


def test_checkpointing_inside_stages_equals_single_process_training(on_four):
    checkpointed = [r for r in on_four if r["spec"]["checkpoint"]]
    assert len(checkpointed) >= len(CHECKPOINTED) and all(r["ok"] for r in checkpointed)


def test_dropout_masks_equal_single_process_training_for_every_split(on_four):
    with_dropout = [r for r in on_four if r["spec"]["dropout"]]
    assert len(with_dropout) == len(DROPOUT) and all(r["ok"] for r in with_dropout)


def test_dualpipe_holds_two_copies_and_the_v_schedules_two_stages_per_rank(on_four):
    by = {(r["spec"]["schedule"], r["spec"]["pp"], r["spec"]["m"]): r for r in on_four}
    dual, v, one = by[("dualpipe", 4, 8)], by[("dualpipev", 4, 8)], by[("1f1b", 4, 8)]
    assert dual["report"]["stages_of_rank"] == [[0, 3], [1, 2], [1, 2], [0, 3]]
    assert v["report"]["stages_of_rank"] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert v["report"]["layers_per_stage"] == [1] * 8
    for single in (one, v):  # one copy of the model, cut into pieces
        assert sum(single["report"]["parameters_of_rank"]) == single["n_params"]
    assert sum(dual["report"]["parameters_of_rank"]) == 2 * dual["n_params"]  # two copies


def test_peak_saved_activation_bytes_follow_the_simulated_peak(on_two, on_four):
    for r in on_two + on_four:
        report, spec = r["report"], r["spec"]
        measured = report["peak_activation_bytes"]
        if spec["checkpoint"]:
            continue  # recomputation adds a transient inside a backward; covered by the checkpointing tests
        if spec["schedule"] in SPLIT:
            # I frees what only the input gradient needed, W the rest: between the two replays
            assert report["replayed_peak_bytes_freed_at_i"] <= measured <= report["replayed_peak_bytes_freed_at_w"]
        else:  # the engine's ledger peak is exactly the simulator's peak, weighted by each F's bytes
            assert measured == report["replayed_peak_bytes_freed_at_w"], spec
    by = {(r["spec"]["schedule"], r["spec"]["pp"], r["spec"]["m"]): r["report"] for r in on_four}
    # Same micro-batch size (2 examples) everywhere: A0 = bytes one micro-batch leaves on stage 0.
    a0 = by[("gpipe", 4, 4)]["peak_activation_bytes"][0] // 4
    assert by[("gpipe", 4, 6)]["peak_activation_bytes"][0] == 6 * a0  # GPipe holds all M
    assert by[("1f1b", 4, 8)]["peak_activation_bytes"][0] == 4 * a0  # 1F1B's first rank holds PP
    assert by[("1f1b", 4, 8)]["simulated_peak_activations"] == [4, 3, 2, 1]


def _messages(schedule, rank, side):
    """Messages rank receives (side 0) or sends (side 1) in one run of its program."""
    return sum(len(step_messages(schedule.placement, step)[side]) for step in schedule.ranks[rank])


def test_point_to_point_traffic_is_exactly_the_schedules_messages(on_two, on_four):
    for r in on_two + on_four:
        spec = r["spec"]
        if spec["model"] != "gpt":
            continue
        schedule = build(spec["schedule"], spec["pp"], spec["m"], spec["chunks"])
        b = 2  # examples per micro-batch: batch = dp * m * 2
        message_bytes = b * spec["seq_len"] * spec["d_model"] * 8  # (b, T, C) float64, activations and gradients
        for world_rank, counts in enumerate(r["counters"]):
            p = world_rank // (len(r["counters"]) // spec["pp"])  # mesh.py: rank = p·dp + d
            sends = _messages(schedule, p, 1) * spec["steps"]
            receives = _messages(schedule, p, 0) * spec["steps"]
            assert counts["send"] == {"calls": sends, "bytes": sends * message_bytes}, (spec, world_rank)
            assert counts["recv"]["calls"] == receives, (spec, world_rank)


ERRORS = [
    ({"pp": 3}, "mesh: pp=3 x tp=1 does not divide the world size 4"),
    ({"schedule": "dualpipe", "m": 6}, "dualpipe needs --micro-batches even and >= 2*pp = 8"),
    ({"schedule": "dualpipe", "pp": 1}, "dualpipe needs an even --pp"),
    ({"schedule": "interleaved", "m": 6}, "interleaved needs --micro-batches to be a multiple of --pp 4"),
    ({"n_layer": 2}, "the model has 2 transformer blocks, which cannot be split into 4 pipeline stages"),
    ({"schedule": "zbv", "pp": 2, "n_layer": 3}, "(zbv with --pp 2 cuts the model into 4 stages)"),
    ({"model": "mlp", "n_layer": 2}, "at least 4 (--n-layer 3)"),
    ({"batch": 6}, "a batch of 6 cannot be split into 1 data-parallel replicas x 8 micro-batches"),
    ({"pp": 2, "m": 4, "batch": 12}, "choose a --batch-size divisible by 8"),
    ({"grad_accum": 2}, "--grad-accum 2 does not apply to a pipeline"),
    ({"chunks": 2}, "1f1b holds 1 stage(s) per rank; drop --chunks 2"),
    ({"tie": True}, "tied embeddings"),
    ({"action_costs": "F=0"}, "--action-costs must all be positive"),
    ({"schedule": "nope"}, "unknown schedule 'nope'"),
]


def test_impossible_combinations_fail_fast_with_the_same_clear_error_on_every_rank():
    specs = [spec for spec, _ in ERRORS]
    done = run_mpi(4, [PROGRAMS / "pipeline_errors.py", json.dumps(specs)], timeout=120)
    results = last_json(done)
    for (spec, expected), messages in zip(ERRORS, results):
        assert len(messages) == 4 and len(set(messages)) == 1, (spec, messages)  # every rank, the same error
        assert expected in messages[0], (spec, messages[0])


def test_cli_error_ends_every_rank_with_exit_status_2():
    done = run_mpi(4, ["-m", "refimpl", "train", "--pp", "4", "--n-layer", "2", "--steps", "1"], timeout=300)
    assert done.returncode == 2
    assert "cannot be split into 4 pipeline stages" in done.stderr


def test_verify_command_with_a_pipeline_schedule():
    result = run_mpi_json(2, ["-m", "refimpl", "verify", "--pp", "2", "--schedule", "1f1b", "--micro-batches", "4",
                              "--n-layer", "2", "--d-model", "16", "--steps", "2", "--json"], timeout=120)
    assert result["ok"] is True and result["trainer"] == "Trainer"
    pipeline = result["trainer_report"]["pipeline"]  # the trainer's own report, beside verify's verdict
    assert pipeline["schedule"] == "1f1b" and pipeline["pp"] == 2


def test_train_in_sleep_cost_mode_writes_a_trace_and_reports_measured_beside_simulated(tmp_path):
    trace = tmp_path / "trace.json"
    summary = run_mpi_json(4, ["-m", "refimpl", "train", "--pp", "2", "--schedule", "zb1p", "--micro-batches", "4",
                               "--n-layer", "2", "--d-model", "16", "--steps", "2", "--batch-size", "16",
                               "--action-costs", "F=0.004,I=0.004,W=0.004", "--trace", str(trace), "--json"],
                           timeout=120)
    report = summary["pipeline"]
    assert report["timing"].startswith("sleep (F=0.004") and report["dp"] == 2
    assert len(report["measured_idle_fraction"]) == len(report["simulated_idle_fraction"]) == 2
    assert set(report["measured_costs_s"]) == {"F", "I", "W"}
    events = json.loads(trace.read_text())["traceEvents"]
    schedule = build("zb1p", 2, 4)
    for pid in (0, 1):  # measured, simulated
        for rank in range(2):
            assert sum(1 for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == rank
                       and e["cat"] != "part") == len(schedule.ranks[rank])
    assert summary["accuracy"] >= 0.0 and summary["world_size"] == 4


def test_zero1_inside_the_gradient_groups_equals_single_process_training_with_exact_bytes(on_four):
    zero = [r for r in on_four if r["spec"]["zero"] == 1]
    assert len(zero) == len(ZERO1) and all(r["ok"] for r in zero)
    for r in zero:
        spec, report = r["spec"], r["report"]
        G = r["dp"]
        assert report["sharding_group"] == G and report["stage_copies"] == (2 if spec["schedule"] == "dualpipe" else 1)
        for p in range(spec["pp"]):  # replica 0's pipeline ranks: world rank p·dp (mesh.py)
            counts = r["counters"][p * G]
            padded = counts["padded"]  # L of each flat group of this rank
            assert all(length % G == 0 for length in padded)
            assert sum(padded) - report["parameters_of_rank"][p] < G * len(padded)  # < G padding per group
            # optimizer state for 1/G of the (padded) buffers: AdamW m and v, SGD momentum; float64
            arrays = 2 if spec["optimizer"] == "adamw" else 1
            assert report["model_state_bytes"]["optimizer_states"][p] == arrays * sum(padded) // G * 8
            assert report["model_state_bytes"]["parameters"][p] == sum(padded) * 8
            # reduce-scatter: L(G-1)/G elements per group and step, the ring's count
            sent = counts["group"].get("reduce_scatter", {"bytes": 0})["bytes"]
            assert sent == spec["steps"] * sum(padded) * (G - 1) // G * 8


def test_zero2_and_zero3_inside_the_schedule_equal_single_process_training_with_exact_bytes(on_four):
    zero = [r for r in on_four if r["spec"]["zero"] in (2, 3)]
    assert len(zero) == len(ZERO23) and all(r["ok"] for r in zero)
    for r in zero:
        spec, report, G = r["spec"], r["report"], r["dp"]
        assert report["sharding_group"] == G
        for p in range(spec["pp"]):  # replica 0's pipeline ranks: world rank p·dp (mesh.py)
            counts = r["counters"][p * G]
            L = sum(counts["padded"])  # Σ padded flat lengths of this rank's stages, multiples of G
            assert L % G == 0 and L - report["parameters_of_rank"][p] < G * len(counts["padded"])
            state = {k: v[p] for k, v in report["model_state_bytes"].items()}
            arrays = 2 if spec["optimizer"] == "adamw" else 1
            assert state["gradients"] == L // G * 8 and state["optimizer_states"] == arrays * L // G * 8
            assert state["parameters"] == (L if spec["zero"] == 2 else L // G) * 8  # ZeRO-3: the shards only
            # one reduce-scatter of every flat group after each of its stage's backwards: M of them, or
            # M/2 for each of DualPipe's two copies (each copy runs half the micro-batches)
            M = spec["m"] // report["stage_copies"]
            assert counts["group"]["reduce_scatter"]["bytes"] == spec["steps"] * M * L * (G - 1) // G * 8


def test_a_failure_inside_one_ranks_step_ends_the_whole_job_instead_of_hanging(tmp_path):
    # Rank 2 of a 4-stage DualPipe raises in the middle of its program while the others wait for
    # its messages: the failure handler must abort every rank, naming rank 2.
    script = tmp_path / "broken_stage.py"
    script.write_text(
        "import sys\n"
        "from refimpl.parallel.pipeline import executor\n"
        "original = executor.PipelineExecutor._do\n"
        "def _do(self, action):\n"
        "    if self.rank == 2 and action.kind == 'F' and action.mb == 5:\n"
        "        raise RuntimeError('stage exploded on purpose')\n"
        "    return original(self, action)\n"
        "executor.PipelineExecutor._do = _do\n"
        "from refimpl.tools.cli import main\n"
        "sys.exit(main(['train', '--pp', '4', '--schedule', 'dualpipe', '--micro-batches', '8', '--n-layer', '4',\n"
        "               '--steps', '2', '--batch-size', '16']))\n")
    done = run_mpi(4, [script], timeout=300)
    assert done.returncode != 0
    assert "[rank 2] RuntimeError: stage exploded on purpose" in done.stderr
