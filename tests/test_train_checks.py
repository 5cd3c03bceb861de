"""Non-finite or nonsensical hyperparameters are refused before training, in one line that says
what is wrong and how to fix it (exit status 2), never trained into "final loss nan"."""

import subprocess
import sys

import pytest

from refimpl.memory import parse_bytes
from refimpl.tools import cli
from refimpl.tools.run import TrainConfig

REFUSED = [
    (["--lr", "nan"], "--lr must be positive and finite, got nan; try 3e-3"),
    (["--lr", "inf"], "--lr must be positive and finite, got inf"),
    (["--lr=-inf"], "--lr must be positive and finite, got -inf"),
    (["--lr", "0"], "--lr must be positive and finite, got 0.0"),
    (["--lr", "1e999"], "--lr must be positive and finite, got inf"),  # float() overflows to inf
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan; use 0 (no decay)"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got inf"),
    (["--weight-decay", "-0.1", "--optimizer", "sgd"], "--weight-decay must be a finite number >= 0, got -0.1"),
    (["--clip", "nan"], "--clip must be a finite number >= 0 (the largest global gradient norm), got nan; "
                        "use e.g. 1.0, or 0 to turn clipping off"),
    (["--clip", "-1"], "--clip must be a finite number >= 0 (the largest global gradient norm), got -1.0"),
    (["--clip", "inf"], "--clip must be a finite number >= 0 (the largest global gradient norm), got inf"),
    (["--dropout", "1"], "--dropout must be in [0, 1) (the probability of zeroing an activation), got 1.0"),
    (["--dropout", "-0.5"], "--dropout must be in [0, 1) (the probability of zeroing an activation), got -0.5"),
    (["--dropout", "nan"], "--dropout must be in [0, 1) (the probability of zeroing an activation), got nan"),
    (["--dropout", "0.1", "--model", "mlp"], "--dropout applies to the GPT's blocks; the MLP has no dropout"),
    (["--steps", "-3"], "--steps must be positive, got -3"),
    (["--seed", "-1"], "--seed must be >= 0 (NumPy's generators take non-negative seeds), got -1; use e.g. --seed 1"),
    (["--bucket-bytes", "0"], "--bucket-bytes must be positive, got 0"),
    (["--bucket-bytes", "-4096", "--zero", "2"], "--bucket-bytes must be positive, got -4096"),
    (["--chunks", "0", "--pp", "2", "--schedule", "interleaved"], "--chunks must be positive"),
    (["--save-every", "-1"], "--save-every must be >= 0, got -1"),
    (["--mem-budget", "0"], "--mem-budget must be positive, got 0"),
]


@pytest.mark.parametrize("args,message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_bad_hyperparameter_is_a_one_line_error(capsys, args, message):
    code = cli.main(["train", "--steps", "1", *args])  # --steps 1: a check that let it through trains briefly
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


@pytest.mark.parametrize("args,message", [
    (["--lr", "nan"], "error: --lr must be positive and finite, got nan"),
    (["--clip", "-1"], "error: --clip must be a finite number >= 0"),
])
def test_the_command_exits_2_without_a_traceback(args, message):
    done = subprocess.run([sys.executable, "-m", "refimpl", "train", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


@pytest.mark.parametrize("args,message", [
    (["--rtol", "nan"], "--rtol must be a finite number >= 0, got nan; leave it out for the dtype's default"),
    (["--atol=-1e-12"], "--atol must be a finite number >= 0, got -1e-12"),
    (["--rtol", "inf"], "--rtol must be a finite number >= 0, got inf"),
    (["--sweep", "1", "--sweep-seed", "-5"], "--sweep-seed must be >= 0 (a seed that a sweep printed), got -5"),
])
def test_verify_refuses_nonsense_tolerances(capsys, args, message):
    code = cli.main(["verify", "--model", "mlp", "--steps", "1", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


def test_a_size_too_large_for_a_float_is_refused_not_a_traceback():
    with pytest.raises(ValueError, match="size '1e400' is too large"):
        parse_bytes("1e400")


def test_zero_still_means_off():
    """--clip 0 turns clipping off, --weight-decay 0 and --dropout 0 are none: all accepted."""
    TrainConfig(clip=0.0, weight_decay=0.0, dropout=0.0, seed=0).check()
    TrainConfig(model="mlp", clip=0.0, dropout=0.0, lr=1e-2).check()
    TrainConfig(dropout=0.999, clip=1e9, weight_decay=10.0, lr=1e3).check()  # odd, but finite and in range


@pytest.mark.parametrize("command", ["train", "verify"])
def test_a_pipeline_on_one_process_says_to_launch_more(command, capsys):
    # The memory check ran first and divided by world_size // pp = 0 (a traceback) before the mesh could say this.
    assert cli.main([command, "--pp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not divide the world size 1" in err and len(err.splitlines()) == 1, err
