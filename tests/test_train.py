"""Single-process training: the tasks are learned, the CLI keeps its promises, bad input is one line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from refimpl.data import IGNORE, SortTask, SpiralsTask, TextTask
from refimpl.tools.run import TrainConfig, train


def test_sort_task_is_learned_to_95_percent_in_400_steps():
    summary = train(TrainConfig(model="gpt", steps=400, batch_size=32, lr=3e-3, seed=0), progress=False)
    assert summary["accuracy"] >= 0.95, summary["accuracy"]
    assert summary["final_loss"] < 0.2
    assert summary["peak_activation_bytes"] > 0


def test_spirals_are_learned_to_95_percent_in_600_steps():
    summary = train(TrainConfig(model="mlp", steps=600, batch_size=128, lr=1e-2, n_layer=2, d_model=64,
                                n_head=1, seq_len=0), progress=False)
    assert summary["accuracy"] >= 0.95, summary["accuracy"]


def test_gradient_accumulation_gives_the_same_training():
    base = dict(model="gpt", steps=3, batch_size=8, dtype="float64", n_layer=1, d_model=16, n_head=2)
    one = train(TrainConfig(**base, grad_accum=1), progress=False)
    four = train(TrainConfig(**base, grad_accum=4), progress=False)
    for p, q in zip(one["_model"].parameters(), four["_model"].parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-10, atol=1e-12)


def test_batches_are_a_pure_function_of_seed_and_step():
    task = SortTask(length=8, seed=3)
    x1, y1 = task.batch(5, 4)
    x2, y2 = SortTask(length=8, seed=3).batch(5, 4)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert x1.shape == (4, 16) and (y1[:, :8] == IGNORE).all()
    assert np.array_equal(y1[:, 8:], np.sort(x1[:, :8], axis=1))  # the sorted half is the target
    assert len(np.unique(SortTask().batch(0, 512)[0][:, :8])) >= 10  # at least 10 distinct symbols
    xs, ys = SpiralsTask(seed=1).batch(0, 10)
    assert xs.shape == (10, 2) and ys.shape == (10,)


def test_text_task(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("hello world, " * 50)
    task = TextTask(str(path), seq_len=8)
    x, y = task.batch(0, 4)
    assert x.shape == y.shape == (4, 8) and np.array_equal(x[:, 1:], y[:, :-1])
    assert task.decode(x[0])  # characters round-trip


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "refimpl", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_json_is_one_line_last_on_stdout(tmp_path):
    result = run_cli("train", "--model", "mlp", "--steps", "3", "--json")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    for key in ("final_loss", "accuracy", "steps", "samples_per_s", "peak_activation_bytes", "n_params"):
        assert key in summary
    assert summary["steps"] == 3 and len(lines) == 1
    text = tmp_path / "t.txt"
    text.write_text("abcdefgh" * 40)
    result = run_cli("train", "--data", str(text), "--steps", "2", "--seq-len", "8", "--n-layer", "1", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["tokens_per_s"] > 0


@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "--steps must be positive"),
    (["--dtype", "int8"], "unsupported dtype 'int8'"),
    (["--data", "/nonexistent/file.txt"], "does not exist"),
    (["--data", "/"], "is a directory; give --data a text file"),
    (["--d-model", "30", "--n-head", "4"], "divisible by n_head"),
    (["--batch-size", "10", "--grad-accum", "3"], "not divisible by --grad-accum"),
    (["--lr", "-1"], "--lr must be positive"),
])
def test_bad_input_is_a_one_line_error(args, message):
    result = run_cli("train", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.mpi
def test_a_usage_error_under_mpiexec_is_printed_once():
    """Every rank parses the same bad flag and exits 2; only rank 0 prints the error, as one line."""
    from mpi_util import run_mpi  # noqa: PLC0415

    done = run_mpi(3, ["-m", "refimpl", "train", "--pp", "2", "--schedule", "1fb1"], timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: argument --schedule: invalid choice: '1fb1'"), done.stderr


def test_unknown_backend_is_a_clear_error():
    import os

    env = dict(os.environ, REFIMPL_BACKEND="tensorflow")
    result = subprocess.run([sys.executable, "-m", "refimpl", "train", "--steps", "1"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 2 and "unknown backend 'tensorflow'" in result.stderr


def test_empty_text_file_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = run_cli("train", "--data", str(empty))
    assert result.returncode == 2 and "has 0 characters" in result.stderr


def test_import_and_one_process_training_never_import_mpi4py():
    code = ("import sys, refimpl, refimpl.tools.run, refimpl.tools.cli; refimpl.tools.cli.build_parser();"
            "from refimpl.tools.run import TrainConfig, train;"
            "train(TrainConfig(model='mlp', steps=1), progress=False);"
            "assert 'mpi4py' not in sys.modules, 'mpi4py was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_dropout_masks_do_not_depend_on_how_the_batch_is_split():
    base = dict(model="gpt", steps=2, batch_size=8, dtype="float64", n_layer=1, d_model=16, n_head=2, dropout=0.2)
    whole = train(TrainConfig(**base, grad_accum=1), progress=False)
    split = train(TrainConfig(**base, grad_accum=4), progress=False)
    plain = train(TrainConfig(**dict(base, dropout=0.0)), progress=False)
    for p, q, r in zip(whole["_model"].parameters(), split["_model"].parameters(), plain["_model"].parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-10, atol=1e-12)
    assert not all(np.allclose(p.data, r.data) for p, r in zip(whole["_model"].parameters(),
                                                               plain["_model"].parameters()))  # dropout acted


def test_checkpoint_flag_reports_recomputation():
    base = dict(model="gpt", steps=2, batch_size=4, n_layer=4, d_model=16, n_head=2)
    none = train(TrainConfig(**base), progress=False)
    sqrt = train(TrainConfig(**base, checkpoint="sqrt"), progress=False)
    assert none["forward_calls_per_layer"] == 1.0
    assert sqrt["forward_calls_per_layer"] == 1.5  # n = 4: segments of 2, the first re-run: 2 extra of 4
    assert sqrt["peak_activation_bytes"] < none["peak_activation_bytes"]
    for p, q in zip(none["_model"].parameters(), sqrt["_model"].parameters()):
        assert np.array_equal(p.data, q.data)  # recomputation is the same arithmetic
