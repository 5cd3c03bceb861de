"""ZeRO stages 0-3: equal to single-process training, and exactly the paper's bytes.

One launch per world size N = 1..4 (tests/mpi_programs/zero_checks.py) runs many cases; this file
checks what each rank reports against the ZeRO table of refimpl/memory.py:

  memory per rank       model_state_bytes at the padded Ψ′ (every flat group a multiple of N, at most
                        N−1 padding each), category by category, after construction and after every step
  communication/step    the table's collectives, per bucket (DP's all-reduce with counts 2L − c_r − c_(r+1)),
                        plus one-element all-reduces (loss, clipping norm, overflow flag)
  equivalence           float64, rtol 1e-10 / atol 1e-12 against LocalTrainer, and stages against DP
                        (with dropout: masks are keyed by batch and row, nn/batch_rows.py)
  gathered parameters   ZeRO-3: at most the largest module plus --prefetch
  gradient buckets      ZeRO-3: at most two modules' buckets at once (double buffering)
  overflow              an inf on one rank: every rank skips the step and halves the loss scale

Models: a GPT with Ψ = 702 (not a multiple of 4; units of 12 elements) and an MLP 2 → 1 → 3 with
Ψ = 9 (a bias of 1 element, a layer of 3 elements: fewer than N).
"""

import json

import pytest
from mpi_util import PROGRAMS, run_local, run_local_json, run_mpi, run_mpi_json

from refimpl.memory import bytes_per_parameter, model_state_bytes

pytestmark = pytest.mark.mpi

GPT = dict(model="gpt", n_layer=1, d_model=6, n_head=2, seq_len=8, lr=1e-2, weight_decay=0.01, clip=1.0)
MLP = dict(model="mlp", n_layer=1, d_model=1, n_head=1, seq_len=0, lr=1e-2, clip=0.5)


def cases_for(n: int) -> list[dict]:
    cases = []
    for s in range(4):  # float64, accumulation 2, several buckets: equal to single process and to each other
        cases.append(dict(name=f"gpt64_z{s}", family="gpt64", stage=s, steps=3, reference=True,
                          config=dict(GPT, dtype="float64", grad_accum=2, batch_size=4 * n, bucket_bytes=600,
                                      dropout=0.1, prefetch=1000 if s == 3 else 0)))
    cases.append(dict(name="gpt64_z3_threshold", family="gpt64", stage=3, steps=3, reference=True,
                      config=dict(GPT, dtype="float64", grad_accum=2, batch_size=4 * n, bucket_bytes=600,
                                  dropout=0.1, param_threshold=20)))  # layer norms (12 elements) stay whole
    cases.append(dict(name="gpt64_z2_sgd", stage=2, steps=2, reference=True,
                      config=dict(GPT, dtype="float64", optimizer="sgd", batch_size=2 * n)))
    for s in range(4):
        cases.append(dict(name=f"mlp64_z{s}", family="mlp64", stage=s, steps=2, reference=True,
                          config=dict(MLP, dtype="float64", batch_size=2 * n)))
    for s in range(4):  # mixed precision: an inf on the last rank at step 1
        cases.append(dict(name=f"mixed_z{s}", stage=s, steps=3, inject=dict(rank=n - 1, step=1),
                          config=dict(GPT, dtype="mixed", grad_accum=2, batch_size=2 * n)))
    for s in range(1, 4):
        cases.append(dict(name=f"f32_z{s}", stage=s, steps=2,
                          config=dict(GPT, dtype="float32", grad_accum=3, batch_size=3 * n, prefetch=700)))
    return cases


def block_counts(length: int, n: int) -> list[int]:
    return [length // n + (b < length % n) for b in range(n)]


def allreduce_bytes(length: int, n: int, rank: int, itemsize: int) -> int:
    """Ring all-reduce of `length` elements with counts (comm.py): 2L − c_r − c_(r+1) elements."""
    c = block_counts(length, n)
    return (2 * length - c[rank] - c[(rank + 1) % n]) * itemsize


def expected_model_state(case: dict, out: dict, n: int) -> dict:
    """Bytes per category, from the layout: DESIGN.md's table, category by category."""
    stage, precision = case["stage"], case["config"]["dtype"]
    optimizer = case["config"].get("optimizer", "adamw")
    p, g, _ = bytes_per_parameter(precision)
    state = 4 if precision == "mixed" else p  # bytes of one optimizer-state element
    states = 2 if optimizer == "adamw" else 1  # AdamW m and v; SGD momentum
    master = 4 if precision == "mixed" else 0
    sharded, persistent = sum(out["groups"]), sum(out["persistent"])
    total = sharded + persistent if out["trainer"] != "DataParallel" else out["psi"]
    per = n if stage > 0 else 1  # over how many ranks optimizer state is split
    return {"parameters": p * (total if stage < 3 else sharded // n + persistent),
            "gradients": g * (total if stage < 2 else total // n),
            "master_weights": master * total // per,
            "optimizer_states": states * state * total // per}


def expected_comm(case: dict, out: dict, n: int, rank: int, skipped: bool) -> dict:
    """Bytes sent by `rank` in one step without recording, by kind of call."""
    stage, cfg = case["stage"], case["config"]
    accum, item = cfg.get("grad_accum", 1), out["itemsize"]
    mixed = cfg["dtype"] == "mixed"
    sharded, persistent = sum(out["groups"]), sum(out["persistent"])
    total = sharded + persistent

    def ring(elements):  # every group is a multiple of N: (N−1)/N exactly
        assert elements % n == 0
        return elements * (n - 1) // n * item

    scalars = 1  # the step's loss
    if stage > 0:
        scalars += int(mixed) + int(cfg.get("clip", 0) > 0 and not skipped)  # overflow vote, clipping norm
    expected = {"allreduce": scalars * allreduce_bytes(1, n, rank, 8)}
    if stage == 0:
        buckets = out["ddp_buckets"] if out["trainer"] == "DataParallel" else out["groups"]
        expected["allreduce"] += sum(allreduce_bytes(length, n, rank, item) for length in buckets)
    elif stage == 1:
        expected.update(reduce_scatter=ring(total), allgather=0 if skipped else ring(total))
    elif stage == 2:
        expected.update(reduce_scatter=accum * ring(total), allgather=0 if skipped else ring(total))
    else:
        expected.update(reduce_scatter=accum * ring(total),
                        allgather=2 * accum * ring(sharded) + (0 if skipped else ring(persistent)))
    return expected


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_zero_stages_match_the_formulas_and_single_process_training(n, tmp_path):
    cases = cases_for(n)
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    args = [PROGRAMS / "zero_checks.py", path]
    result = run_mpi_json(n, args, timeout=240) if n > 1 else run_local_json(args, timeout=240)
    assert result["world_size"] == n
    for case in cases:
        name, stage = case["name"], case["stage"]
        got = result["cases"][name]
        ranks = got["ranks"]
        assert len(ranks) == n
        first = ranks[0]
        p, g, k = bytes_per_parameter(case["config"]["dtype"], case["config"].get("optimizer", "adamw"))
        for r, out in enumerate(ranks):
            assert out["groups"] == first["groups"] and out["psi"] == first["psi"], name
            # padding: every group a multiple of N (stages 1-3), at most N − 1 elements each
            if stage > 0:
                assert all(length % n == 0 for length in out["groups"] + out["persistent"]), name
            assert all(0 <= length - numel < max(n, 1) for length, numel in zip(out["groups"] + out["persistent"],
                                                                                  out["numel"])), name
            # memory: category by category, and in total DESIGN.md's formula at the padded Ψ′
            expected = expected_model_state(case, out, n)
            sharded, persistent = sum(out["groups"]), sum(out["persistent"])
            if out["trainer"] == "DataParallel":
                sharded = out["psi"]
            formula = model_state_bytes(stage, sharded, n, p, g, k, persistent)
            assert sum(expected.values()) == formula, name
            assert out["built"] == expected, (name, r)
            for step in out["steps"]:
                assert step["model_state"] == expected, (name, r)
            # communication: every step that did not record gradients for the comparison
            for i, step in enumerate(out["steps"]):
                if case.get("reference") and i == case["steps"] - 1:
                    continue  # the recording step all-gathers the gradients for verify
                skipped = bool(case.get("inject")) and i == case["inject"]["step"] and stage > 0
                sent = {kind: c["bytes"] for kind, c in step["comm"].items()}
                want = expected_comm(case, out, n, r, skipped)
                assert {kk: sent.get(kk, 0) for kk in want} == want, (name, r, i)
                assert set(sent) <= set(want), (name, r, i, sent)
            # ZeRO-3: a module's gradients fill its bucket in one go, so at most two buckets (one reducing,
            # one filling) and their L/N outputs exist; ZeRO-2's buckets (and ZeRO-3's for small parameters)
            # may overlap a little at their edges, but never add up to the whole gradient
            if stage >= 2 and case["config"]["dtype"] != "mixed":  # (mixed adds float32 temporaries in the step)
                lengths = out["groups"] + out["persistent"]
                biggest, whole = max(lengths), sum(lengths)
                for step in out["steps"]:
                    peak = step["peak"]["gradient_buckets"] // out["itemsize"]
                    if stage == 3 and not out["persistent"]:
                        assert peak <= 2 * (biggest + biggest // n), name
                    elif len(lengths) >= 4:
                        assert peak < whole, name
            # ZeRO-3: whole parameters of the largest module plus the prefetch, never more
            if stage == 3:
                for step in out["steps"]:
                    gathered = step["peak"]["gathered_parameters"]
                    assert out["largest_unit"] <= gathered <= out["largest_unit"] + case["config"].get("prefetch", 0)
            assert out["finite"], name
        if case.get("reference"):
            assert max(got["vs_reference"].values()) <= 1.0, (name, got["vs_reference"])
        if "vs_family" in got:
            assert got["vs_family"] <= 1.0, (name, got["vs_family"])
        if case.get("inject"):
            at = case["inject"]["step"]
            after = [int(i >= at) for i in range(len(ranks[0]["steps"]))]  # 1 from the injected step on
            for out in ranks:  # every rank skipped the same step and halved the same scale
                scales = [s["loss_scale"] for s in out["steps"]]
                assert [s["skipped"] for s in out["steps"]] == after, name
                assert scales == [2.0 ** (16 - a) for a in after], name
                assert [s["optimizer_steps"] for s in out["steps"]] == [i + 1 - a for i, a in enumerate(after)], name
                assert out["unchanged_by_skipped_step"] is True, name
    names = {case["name"] for case in cases}
    assert {f"gpt64_z{s}" for s in range(4)} <= names and result["cases"]["gpt64_z0"]["ranks"][0]["psi"] == 702
    assert result["cases"]["mlp64_z0"]["ranks"][0]["psi"] == 9


def test_train_json_reports_model_state_bytes_per_rank_and_budget_demo():
    # The budget demo of docs/zero.md: the same GPT on the same 4 ranks, 1.2 MB per rank.
    # DP needs (4+4+8)Ψ = 1.64 MB of model state and runs out while allocating optimizer state;
    # ZeRO-3 holds 16Ψ/4 = 410 kB and trains.
    flags = ["-m", "refimpl", "train", "--model", "gpt", "--steps", "2", "--batch-size", "8", "--mem-budget", "1.2MB"]
    dp = run_mpi_error(4, flags + ["--zero", "0"], timeout=120)
    assert dp.returncode == 2
    assert_one_line_errors(dp, "optimizer states")
    assert "over the budget of 1,200,000 B" in dp.stderr  # needs 1,233,408 B: both are "1.2 MB" rounded
    summary = run_mpi_json(4, flags + ["--zero", "3", "--json"], timeout=120)
    psi = summary["n_params"]
    assert psi == 102528 and summary["world_size"] == 4 and summary["mem_budget"] == 1_200_000
    for rank_bytes, peaks in zip(summary["model_state_bytes"], summary["memory_peak_bytes"]):
        assert rank_bytes == {"parameters": 4 * psi // 4, "gradients": 4 * psi // 4, "master_weights": 0,
                              "optimizer_states": 8 * psi // 4}
        assert sum(rank_bytes.values()) == model_state_bytes(3, psi, 4, 4, 4, 8) == 410112
        assert peaks["total"] <= 1_200_000 and peaks["gathered_parameters"] <= summary["largest_unit_bytes"]


def test_memory_command_reproduces_the_papers_line():
    result = run_local_json(["-m", "refimpl", "memory", "--params", "7.5B", "--world", "64", "--json"])
    rows = result["tables"][0]["rows"]
    assert [row["gb"]["64"] for row in rows] == [120.0, 31.4, 16.6, 1.9]
    assert [row["bytes"]["64"] for row in rows] == [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    assert (result["P"], result["G"], result["K"]) == (2, 2, 12)
    done = run_local(["-m", "refimpl", "memory", "--params", "7.5e9", "--world", "1,4,16,64,256,1024"])
    assert done.returncode == 0
    line = next(line for line in done.stdout.splitlines() if line.startswith("ZeRO-2"))
    assert line.split()[-6:] == ["120.0", "41.3", "21.6", "16.6", "15.4", "15.1"]  # Table 1, 7.5B column


def test_memory_command_measures_the_ledger_beside_the_formula():
    # N = 3, a GPT of Ψ = 1128 (d_model 8): its modules of 88 and 16 elements are padded to multiples
    # of 3, and the ledger equals the formula at the padded Ψ′.
    result = run_mpi_json(3, ["-m", "refimpl", "memory", "--model", "gpt", "--n-layer", "1", "--d-model", "8",
                              "--n-head", "2", "--seq-len", "8", "--precision", "float32", "--bucket-bytes", "500",
                              "--json"], timeout=120)
    assert result["ledger_equals_formula"] is True and result["world_size"] == 3
    # ZeRO's padded groups send exactly the formula; DDP's unpadded buckets send counts-sized blocks
    assert [row["comm_equal"] for row in result["rows"]] == [False, True, True, True]
    rows = {row["stage"]: row for row in result["rows"]}
    assert rows[0]["trainer"] == "DataParallel" and rows[3]["trainer"] == "ZeroStage3"
    for row in rows.values():
        assert row["params"] == 1128 and row["measured"] == [row["estimate_padded"]] * 3
        assert 0 <= row["padded_params"] - row["params"] <= 2 * row["flat_buffers"]  # at most N − 1 each
    assert rows[3]["padded_params"] > rows[3]["params"] and rows[3]["flat_buffers"] == 10
    assert rows[3]["peak"]["gathered_parameters"] > 0 and rows[0]["peak"]["gathered_parameters"] == 0


def run_mpi_error(n: int, args, timeout: float = 300):
    """run_mpi for a command that must fail, launched again (up to twice) if no rank's message came back.

    The CLI aborts the whole job on the first rank's error (cli.py, MPI_Abort); on a loaded machine
    MPICH's process manager can end the job before it forwards what that rank wrote, so stderr comes
    back empty while the exit status is right. That race is not what these tests are about.
    """
    for _ in range(3):
        done = run_mpi(n, args, timeout=timeout)
        if done.returncode == 0 or "error:" in done.stderr:
            break
    return done


def assert_one_line_errors(done, message: str) -> None:
    """Exit status 2; every rank that got to print said `message` in one line (the CLI aborts the job on the
    first rank's error, so the others may be stopped before they print); no traceback, no hang."""
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert lines and all(message in line for line in lines), done.stderr
    assert "Traceback" not in done.stderr


def test_bad_zero_input_is_one_clear_line_and_stops_every_rank():
    unknown = run_mpi_error(2, ["-m", "refimpl", "train", "--zero", "5", "--steps", "1"])
    assert_one_line_errors(unknown, "unknown ZeRO stage 5; choose --zero 0 (data parallel), 1, 2 or 3")
    tiny = run_mpi_error(2, ["-m", "refimpl", "train", "--zero", "3", "--mem-budget", "1kB", "--steps", "1"])
    assert_one_line_errors(tiny, "out of memory on rank")
    assert "(parameter shard)" in tiny.stderr and "over the budget of 1.0 kB" in tiny.stderr
    mixed = run_local(["-m", "refimpl", "verify", "--dtype", "mixed", "--zero", "2", "--rtol", "1e-3"])
    assert mixed.returncode == 2 and "mixed precision's follow from float16 rounding" in mixed.stderr
