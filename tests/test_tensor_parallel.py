"""Tensor and sequence parallelism (refimpl/parallel/tensor_parallel/) train exactly like one process.

  * WeightSplit: cutting a weight into t slices and putting them back is the identity (drawn shapes,
    interleaved q/k/v blocks, a padded vocabulary);
  * the pinned list of the issue, each against single-process training (verify's comparison,
    float64, rtol 1e-10), many configurations per MPI launch: tp 2 and 4, dp x tp, tp x pp with
    every schedule, 8 ranks dp2 x tp2 x pp2, every ZeRO stage, checkpointing, dropout, tied
    embeddings, sequence parallelism (drawn ones: tests/test_verify_drawn.py, refimpl/tools/sweep.py);
  * bytes sent by the tp group in a step equal communication.bytes_per_step exactly, by kind, and the
    parameters every tp rank holds whole stay bit-for-bit equal across the group;
  * bad input: one clear line, the same on every rank.
"""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_util import PROGRAMS, last_json, run_mpi
from test_verify_drawn import verify_many

from refimpl.parallel.tensor_parallel import WeightSplit, padded
from refimpl.tools.sweep import SMALL


@settings(max_examples=60, deadline=None)
@given(t=st.sampled_from([1, 2, 3, 4]), parts=st.sampled_from([1, 3]), axis=st.sampled_from([0, 1]),
       per_rank=st.integers(1, 3), other=st.integers(1, 4), pad=st.integers(0, 3), seed=st.integers(0, 2**31))
def test_split_shards_put_back_together_are_the_whole(t, parts, axis, per_rank, other, pad, seed):
    n = parts * t * per_rank
    length = None
    if pad and parts == 1:  # a vocabulary: V' = padded(V, t) >= V
        length = max(1, n - min(pad, t - 1))
        n = length
    shape = [other, other]
    shape[axis] = n
    whole = np.random.default_rng(seed).standard_normal(shape)
    split = WeightSplit(axis, parts, length)
    shards = [split.shard(whole, r, t) for r in range(t)]
    assert all(s.shape[axis] == padded(n, t) // t for s in shards)
    np.testing.assert_array_equal(split.join(shards), whole)
    if parts == 3:  # rank r holds its heads of q, of k and of v
        third = n // 3
        rows = np.concatenate([np.arange(j * third + 1 * third // t, j * third + 2 * third // t) for j in range(3)])
        np.testing.assert_array_equal(shards[1] if t > 1 else shards[0],
                                      np.take(whole, rows if t > 1 else np.arange(n), axis=axis))


def pinned(*flag_strings):
    return [SMALL + f.split() for f in flag_strings]


GPT = "--model gpt --dropout 0.1"
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "zbh2", "zbv", "dualpipe", "dualpipev")


def tp_pp(schedule: str, extra: str = "") -> str:
    """tp 2 x pp 2 with `schedule`: enough blocks and micro-batches for it."""
    stages = 4 if schedule in ("interleaved", "zbv", "dualpipev") else 2
    chunks = " --chunks 2" if schedule == "interleaved" else ""
    return (f"{GPT} --tp 2 --pp 2 --schedule {schedule} --micro-batches 4 --batch-size 8 --n-layer {stages}"
            f"{chunks} {extra}")


PINNED = {
    2: pinned(f"{GPT} --tp 2 --n-layer 2 --batch-size 4",
              f"{GPT} --tp 2 --n-layer 2 --batch-size 4 --sequence-parallel --clip 0.05",
              f"{GPT} --tp 2 --n-layer 4 --batch-size 4 --checkpoint every:1 --sequence-parallel",
              "--model gpt --tp 2 --n-layer 2 --batch-size 4 --optimizer sgd --collectives ring"),
    4: pinned(f"{GPT} --tp 4 --n-head 4 --n-layer 2 --batch-size 4",
              f"{GPT} --tp 4 --n-head 4 --n-layer 2 --batch-size 4 --sequence-parallel --zero 3 --clip 0",
              f"{GPT} --tp 2 --n-layer 2 --batch-size 8 --zero 0 --grad-accum 2",
              f"{GPT} --tp 2 --n-layer 2 --batch-size 8 --zero 1 --sequence-parallel",
              f"{GPT} --tp 2 --n-layer 2 --batch-size 8 --zero 2 --bucket-bytes 1000",
              f"{GPT} --tp 2 --n-layer 2 --batch-size 8 --zero 3 --clip 0 --sequence-parallel",
              f"{GPT} --tp 2 --n-layer 4 --batch-size 8 --checkpoint revolve:1 --zero 3 --prefetch 500",
              f"{GPT} --tp 2 --n-layer 4 --batch-size 8 --checkpoint sqrt --sequence-parallel --zero 2",
              *[tp_pp(name, "--sequence-parallel" if i % 2 else "") for i, name in enumerate(SCHEDULES)],
              tp_pp("1f1b", "--zero 3 --clip 0"), tp_pp("zb1p", "--zero 2"), tp_pp("dualpipev", "--zero 1")),
    8: pinned(f"{GPT} --tp 2 --pp 2 --schedule 1f1b --micro-batches 2 --batch-size 8 --n-layer 2",
              f"{GPT} --tp 2 --pp 2 --schedule zb1p --micro-batches 2 --batch-size 8 --n-layer 2 "
              "--sequence-parallel --zero 2 --checkpoint every:1"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("world", sorted(PINNED))
def test_pinned_tensor_parallel_configurations_equal_single_process_training(world, tmp_path_factory):
    results = verify_many(world, PINNED[world], tmp_path_factory)
    assert all(r["trainer"] == "Trainer" for r in results)


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 4])
def test_the_cut_gpt_has_the_whole_models_loss_and_gradients_tied_or_not(world):
    """The vocabulary (11) padded to 12 and masked; tied embeddings: wte's slice is also the output layer's."""
    results = last_json(run_mpi(world, [PROGRAMS / "tensor_parallel_model.py"], timeout=300))
    assert len(results) == 4
    for r in results:
        assert r["parameters_equal"], r  # the slices put back together are the single-process weights
        assert abs(r["loss"] - r["reference_loss"]) <= 1e-12 * abs(r["reference_loss"]), r
        assert r["worst"] <= 1e-10, r  # NaN fails: a comparison with NaN is False


BYTES = [SMALL + ["--model", "gpt", "--batch-size", "4"] + f.split() for f in (
    "--tp 2 --n-layer 2",
    "--tp 2 --n-layer 2 --sequence-parallel",
    "--tp 2 --n-layer 3 --sequence-parallel --checkpoint every:1 --dropout 0.1",
    "--tp 2 --n-layer 3 --checkpoint sqrt --grad-accum 2",
    "--tp 2 --pp 2 --n-layer 2 --sequence-parallel --zero 2",
    "--tp 2 --pp 2 --n-layer 3 --micro-batches 4",
    "--tp 4 --n-head 4 --n-layer 2 --dtype float32 --sequence-parallel --zero 3",
    "--tp 4 --n-head 4 --n-layer 2 --dtype float32 --zero 1",
    "--tp 2 --n-layer 4 --checkpoint every:1 --partition-activations --dropout 0.1",
    "--tp 4 --n-head 4 --n-layer 4 --checkpoint selective+revolve:1 --partition-activations --zero 2",
)]


@pytest.mark.mpi
def test_tp_bytes_per_step_equal_the_formula_and_whole_parameters_stay_equal(tmp_path):
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(BYTES))
    results = last_json(run_mpi(4, [PROGRAMS / "tensor_parallel_checks.py", path], timeout=600))
    assert len(results) == len(BYTES)
    for r in results:
        assert r["measured"] == r["expected"], r
        assert r["whole_equal"], r["flags"]
        assert all(ok in (None, True) for ok in r["ledger_equals_formula"]), r
        assert ("--zero" in r["flags"] or "--pp" in r["flags"]) or all(r["ledger_equals_formula"]), r
        assert all(sum(m.values()) > 0 for m in r["measured"]), r  # every rank communicated


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 4])
def test_the_tensor_parallel_command_measures_what_its_formulas_say(world):
    """Saved bytes per block (tp, + sequence parallel, selective, full recomputation, + Pa), bytes per step
    and parameters per rank: every row's measurement equals its formula (the command exits 1 otherwise)."""
    done = run_mpi(world, ["-m", "refimpl", "tensor-parallel", "--d-model", "16", "--n-head", "4", "--seq-len", "8",
                           "--json"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = last_json(done)
    rows = result["activations"] + result["bytes"] + result["parameters"]
    assert len(result["activations"]) == 7 and len(result["bytes"]) == 6
    assert all(row["formula"] == row["measured"] > 0 or row["formula"] == row["measured"] == 0 for row in rows), rows
    by_mode = {row["mode"]: row["measured"] for row in result["activations"]}
    # sequence parallelism divides every term; selective recomputation removes the T² ones; Pa divides the kept input
    assert by_mode["+ sequence parallel"] < by_mode["tensor parallel"]
    assert by_mode["selective recomputation"] < by_mode["tensor parallel"]
    assert by_mode["full recomputation + Pa"] * world == by_mode["full recomputation (every:1)"]


def test_selective_recomputation_gives_bitwise_the_same_gradients_with_less_saved():
    """The attention core recomputed by checkpoint() is the same arithmetic: gradients bit for bit."""
    from refimpl.autograd.saved import saved_tensors
    from refimpl.checkpointing import apply_to_gpt, current_plan
    from refimpl.nn.batch_rows import batch_rows
    from refimpl.nn.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=11, seq_len=8, n_layer=3, n_head=2, d_model=8, dropout=0.1, dtype="float64")
    x = np.random.default_rng(0).integers(0, 11, (2, 8))
    grads, peaks = {}, {}
    for plan in ("none", "selective", "selective+every:1"):
        model = apply_to_gpt(GPT(config, seed=1), plan)
        assert str(current_plan(model)) == plan
        saved_tensors.reset_peak()
        start = saved_tensors.live_bytes
        with batch_rows(0, 2, 2, 7):
            model.loss(x, x).backward()
        peaks[plan] = saved_tensors.peak_bytes - start
        grads[plan] = {name: p.grad.copy() for name, p in model.named_parameters()}
    for plan in ("selective", "selective+every:1"):
        for name, g in grads["none"].items():
            np.testing.assert_array_equal(grads[plan][name], g, err_msg=f"{plan}: {name}")
    assert peaks["selective+every:1"] < peaks["selective"] < peaks["none"]


def test_verify_refuses_mixed_precision_with_tensor_parallelism_saying_why(capsys):
    from refimpl.tools import cli

    assert cli.main(["verify", "--tp", "2", "--dtype", "mixed", "--steps", "1"]) == 2
    assert "verify --dtype mixed bounds only float16 rounding" in capsys.readouterr().err


ERRORS = [
    (["--tp", "3", "--n-head", "3", "--d-model", "12"],
     "mesh: pp=1 x tp=3 does not divide the world size 4; launch a multiple of 3 ranks"),
    (["--tp", "2", "--n-head", "3", "--d-model", "6"],
     "--tp 2 does not divide the GPT's 3 attention heads: use a --tp that divides --n-head 3 (1, 3), "
     "or --n-head 4 with --tp 2"),
    (["--sequence-parallel"], "--sequence-parallel cuts the sequence over the tensor-parallel group; it needs --tp 2"),
    (["--tp", "4", "--n-head", "4", "--sequence-parallel", "--seq-len", "6"],
     "--sequence-parallel cuts each sequence into --tp 4 shards, but --seq-len 6 is not divisible by 4"),
    (["--tp", "2", "--model", "mlp"], "--tp 2 splits a GPT's layers over ranks; use it with --model gpt, or --tp 1"),
    (["--tp", "2", "--save-dir", "x"], "sharded checkpoints (--save-dir, --resume) of tensor-parallel runs"),
    (["--tp", "0"], "--tp must be a positive integer"),
    (["--tp", "2", "--partition-activations"], "--partition-activations divides the kept block inputs of a "
                                               "checkpointing plan, and --checkpoint none keeps none"),
    (["--tp", "2", "--partition-activations", "--sequence-parallel", "--checkpoint", "every:1"],
     "--partition-activations has nothing to divide with --sequence-parallel"),
    (["--partition-activations", "--checkpoint", "sqrt"], "--partition-activations divides activation checkpoints "
                                                          "over the tensor-parallel group; it needs --tp 2"),
    (["--checkpoint", "selective+"], "name the chain plan after '+'"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("args,message", ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_bad_tensor_parallel_input_is_one_clear_line_on_every_rank(args, message):
    done = run_mpi(4, ["-m", "refimpl", "train", "--steps", "1", *args], timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if message in line]
    assert lines, done.stderr[-2000:]
    assert not any("Traceback" in line for line in done.stderr.splitlines()), done.stderr[-3000:]
