"""Hostile input to the non-training commands: every bad number, every run too large
to finish and every unreadable file ends in one line `error: ...` and exit status 2, quickly, before any
work, never a traceback or a hang.

Most cases run `refimpl.tools.cli.main` in this process (fast); the ones that could block (a FIFO, a
device) run `python -m refimpl` in a subprocess under a timeout, so that a regression fails instead of
hanging the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from refimpl.tools.cli import main
from refimpl.tools.cluster.hardware import PRESETS
from refimpl.tools.flags import check_work, finite_float, non_negative_int, positive_int, probability

ROOT = Path(__file__).resolve().parents[1]
SAFETY_NET_S = 20  # every refusal comes before the work: well under a second in practice


def refused(argv: list[str], capsys, pattern: str = "") -> str:
    """Run one command in-process; assert it is refused with one error line, quickly. The line."""
    started = time.monotonic()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse's refusal of a flag's value
        code = exit_.code
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    last = lines[-1]
    assert len(lines) == 1 and last.startswith("error: "), err  # one line and nothing else, flags' types too
    assert elapsed < SAFETY_NET_S
    if pattern:
        assert re.search(pattern, last), last
    return last


def refused_subprocess(argv: list[str], pattern: str = "") -> str:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "refimpl", *map(str, argv)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert time.monotonic() - started < 60
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    if pattern:
        assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------------
# The argparse types: one set of rules
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("parse, text", [
    (positive_int, "0"), (positive_int, "-3"), (positive_int, "1.5"), (positive_int, "x"), (positive_int, ""),
    (positive_int, "9" * 5000), (non_negative_int, "-1"), (probability, "nan"), (probability, "inf"),
    (probability, "-inf"), (probability, "1"), (probability, "1.5"), (probability, "-1"), (probability, "x"),
    (finite_float(0.0, lo_open=True), "0"), (finite_float(0.0, lo_open=True), "1e400"),
])
def test_flag_types_refuse(parse, text):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse(text)
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


@pytest.mark.parametrize("parse, text, value", [
    (positive_int, "1", 1), (positive_int, " 12 ", 12), (non_negative_int, "0", 0), (probability, "0", 0.0),
    (probability, "0.999", 0.999), (finite_float(0.0, lo_open=True), "1e-9", 1e-9),
])
def test_flag_types_accept(parse, text, value):
    assert parse(text) == value


def test_check_work_says_by_how_much_and_how_to_override():
    check_work(10, 10, "actions", "the schedule")
    with pytest.raises(ValueError, match=r"about 30 actions, 3x the cap of 10: .* --max-work 30"):
        check_work(30, 10, "actions", "the schedule")


# ------------------------------------------------------------------------------------------------
# schedule
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, pattern", [
    (["1f1b", "--pp", 4, "--micro-batches", 10**9], r"24,000,000,000 actions.*--max-work 24000000000"),
    (["gpipe", "--pp", 10**6, "--micro-batches", 1], r"actions, 60x the cap.*--max-work"),
    (["interleaved", "--pp", 4, "--micro-batches", 8, "--chunks", 10**6], r"actions.*--max-work"),
    (["--compare", "--pp", 8, "--micro-batches", 10**5], r"--compare .* actions.*--max-work"),
    (["1f1b", "--pp", 4, "--micro-batches", 8, "--max-work", 10], r"192 actions, 19.2x the cap of 10"),
    (["1f1b", "--pp", 0, "--micro-batches", 8], r"--pp: must be a positive integer"),
    (["1f1b", "--pp", -4, "--micro-batches", 8], r"--pp"),
    (["1f1b", "--pp", "4.5", "--micro-batches", 8], r"--pp: '4.5' is not a whole number"),
    (["1f1b", "--pp", 4, "--micro-batches", 0], r"--micro-batches"),
    (["1f1b", "--pp", 4, "--micro-batches", "nan"], r"--micro-batches"),
    (["interleaved", "--pp", 4, "--micro-batches", 8, "--chunks", 0], r"--chunks: must be a positive integer"),
    (["1f1b", "--pp", 4, "--micro-batches", 8, "--max-work", 0], r"--max-work"),
    (["1f1b", "--pp", 4, "--micro-batches", 8, "--latency", "nan"], r"--latency"),
    (["1f1b", "--pp", 4, "--micro-batches", 8, "--latency", "-1"], r"--latency"),
    (["1f1b", "--pp", 4, "--micro-batches", 8, "--latency", "1e100000000"], r"--latency .*exponents"),
    (["1f1b", "--pp", 4, "--micro-batches", 8, "--costs", "F=1e-100000000"], r"--costs .*exponents"),
    (["1f1b", "--pp", 4, "--micro-batches", 8, "--costs", "F=inf"], r"bad cost"),
])
def test_schedule_refuses(argv, pattern, capsys):
    refused(["schedule", *argv], capsys, pattern)


def test_schedule_out_directory_refused_before_work(tmp_path, capsys):
    refused(["schedule", "1f1b", "--pp", 4, "--micro-batches", 8, "--render", "svg", "--out", tmp_path], capsys,
            r"--out .* is a directory")
    refused(["schedule", "1f1b", "--pp", 4, "--micro-batches", 8, "--png", tmp_path], capsys, r"--png .* directory")
    refused(["schedule", "1f1b", "--pp", 4, "--micro-batches", 8, "--render", "trace", "--out",
             tmp_path / "missing" / "t.json"], capsys, r"no such directory")
    refused(["plan", "--params", "1B", "--gpus", 8, "--plot", tmp_path], capsys, r"--plot .* is a directory")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_schedule_out_unwritable_refused(tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        refused(["schedule", "1f1b", "--pp", 4, "--micro-batches", 8, "--render", "svg", "--out",
                 folder / "s.svg"], capsys, r"not writable")
    finally:
        folder.chmod(0o700)


def test_schedule_max_work_overrides_the_cap(capsys):
    assert main(["schedule", "1f1b", "--pp", "2", "--micro-batches", "4", "--render", "none", "--max-work", "48"]) == 0
    refused(["schedule", "1f1b", "--pp", 2, "--micro-batches", 4, "--max-work", 47], capsys, r"48 actions")


# ------------------------------------------------------------------------------------------------
# tensor-parallel (refused before MPI is needed)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, pattern", [
    (["--n-layer", 10**6], r"array elements.*--max-work"),
    (["--batch-size", 10**12], r"array elements.*--max-work"),
    (["--d-model", 2**20, "--n-head", 1], r"array elements"),
    (["--seq-len", 10**6], r"array elements"),
    (["--n-layer", 0], r"--n-layer: must be a positive integer"),
    (["--d-model", -64], r"--d-model"),
    (["--batch-size", "2.5"], r"--batch-size"),
    (["--dropout", "nan"], r"--dropout: must be a finite number"),
    (["--dropout", "inf"], r"--dropout"),
    (["--dropout", "1.0"], r"--dropout: must be in \[0, 1\)"),
    (["--dropout", "-0.5"], r"--dropout"),
    (["--max-work", "-1"], r"--max-work"),
])
def test_tensor_parallel_refuses(argv, pattern, capsys):
    refused(["tensor-parallel", *argv], capsys, pattern)


# ------------------------------------------------------------------------------------------------
# calibrate (refused before measuring or writing)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, pattern", [
    (["--width", 10**6], r"--width 1000000 .* array elements.*--max-work"),
    (["--tokens", 10**9], r"array elements.*--max-work"),
    (["--width", 0], r"--width: must be a positive integer"),
    (["--tokens", "-5"], r"--tokens"),
    (["--width", "1e3"], r"--width: '1e3' is not a whole number"),
    (["--width", 256, "--max-work", 1000], r"the cap of 1,000"),
])
def test_calibrate_refuses(argv, pattern, tmp_path, capsys):
    refused(["calibrate", "--output", tmp_path / "c.json", *argv], capsys, pattern)
    assert not (tmp_path / "c.json").exists()


# ------------------------------------------------------------------------------------------------
# predict and plan: flags
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, pattern", [
    (["--dropout", "nan"], r"--dropout: must be a finite number"),
    (["--dropout", "inf"], r"--dropout"),
    (["--dropout", "1.5"], r"--dropout: must be in \[0, 1\)"),
    (["--dropout", "-1"], r"--dropout"),
    (["--pp", 4, "--schedule", "interleaved", "--chunks", 0], r"--chunks: must be a positive integer"),
    (["--n-layer", 0], r"--n-layer"),
    (["--batch-size", "-512"], r"--batch-size"),
    (["--seq-len", "2048.5"], r"--seq-len"),
    (["--vocab-size", 0], r"--vocab-size"),
    (["--experts", -1], r"--experts: must be an integer >= 0"),
    (["--top-k", 0], r"--top-k"),
    (["--gpus", 0], r"--gpus"),
    (["--tp", "nan"], r"--tp"),
    (["--micro-batch-size", 0], r"--micro-batch-size"),
    (["--pp", 1000, "--n-layer", 1000, "--gpus", 8000, "--batch-size", 10**6], r"actions.*--max-work"),
])
def test_predict_refuses(argv, pattern, capsys):
    refused(["predict", *argv], capsys, pattern)


@pytest.mark.parametrize("argv, pattern", [
    (["--params", "70B", "--gpus", 0], r"--gpus: must be a positive integer"),
    (["--params", "70B", "--gpus", 8, "--top", 0], r"--top"),
    (["--params", "70B", "--gpus", 8, "--refine", "-1"], r"--refine"),
    (["--params", "70B", "--gpus", 8, "--dropout", "nan"], r"--dropout"),
    (["--params", "0", "--gpus", 8], r"parameter count"),
    (["--params", "1e400", "--gpus", 8], r"parameter count"),
    (["--n-layer", 10**12, "--d-model", 64, "--n-head", 8, "--gpus", 10**12], r"candidate configurations.*--max-work"),
    (["--n-layer", 720720, "--d-model", 64, "--n-head", 8, "--gpus", 720720, "--batch-size", 720720],
     r"candidate configurations.*--max-work"),
    (["--params", "1T", "--gpus", 4096, "--cluster", "h100-80gb", "--max-work", 100], r"the cap of 100"),
])
def test_plan_refuses(argv, pattern, capsys):
    refused(["plan", *argv], capsys, pattern)


# ------------------------------------------------------------------------------------------------
# Cluster files
# ------------------------------------------------------------------------------------------------


def _cluster_text(**changes) -> str:
    values = PRESETS["a100-80gb"].as_dict()
    raw = {}
    for key, value in changes.items():
        if isinstance(value, Raw):
            raw[key] = value.text
            values[key] = f"@@{key}@@"
        else:
            values[key] = value
    text = json.dumps(values)
    for key, value in raw.items():
        text = text.replace(f'"@@{key}@@"', value)
    return text


class Raw:
    """A JSON literal that json.dumps does not write (Infinity, NaN, 10**400)."""

    def __init__(self, text: str):
        self.text = text


@pytest.mark.parametrize("text, pattern", [
    (_cluster_text(peak_flops=Raw("Infinity")), r"Infinity is not a finite number"),
    (_cluster_text(peak_flops=Raw("NaN")), r"NaN is not a finite number"),
    (_cluster_text(memory_bandwidth=Raw("-Infinity")), r"finite"),
    (_cluster_text(memory_bytes=Raw("1" + "0" * 400)), r"memory_bytes must be a positive number \(finite\)"),
    (_cluster_text(memory_bytes=Raw("1" + "0" * 5000)), r"cannot read cluster file"),
    (_cluster_text(gpus_per_node=True), r"gpus_per_node must be a positive number \(finite\); got True"),
    (_cluster_text(gpus_per_node=2.5), r"gpus_per_node must be a whole number"),
    (_cluster_text(peak_flops="312e12"), r"peak_flops must be"),
    (_cluster_text(peak_flops=0), r"peak_flops must be"),
    (_cluster_text(inter_latency=-1e-6), r"inter_latency must be a number >= 0 \(finite\)"),
    (_cluster_text(efficiency="fast"), r"efficiency must be an object"),
    (_cluster_text(efficiency=[0.5]), r"efficiency must be an object"),
    (_cluster_text(efficiency={"gemm": "high"}), r"efficiency 'gemm' must be a positive number"),
    (_cluster_text(efficiency={"gemm": True}), r"efficiency 'gemm'"),
    (_cluster_text(efficiency={"turbo": 0.5}), r"unknown efficiency 'turbo'"),
    (_cluster_text(name=5), r"name must be a string"),
    ("[1, 2, 3]", r"top level must be a JSON object.*list"),
    ("42", r"top level must be a JSON object"),
    ("null", r"top level must be a JSON object"),
    ("{", r"cannot read cluster file"),
    ("", r"cannot read cluster file"),
    ("[" * 100_000 + "]" * 100_000, r"cannot read cluster file"),
    ('{"peak_flops": 1}', r"missing field"),
])
def test_cluster_file_refused(text, pattern, tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(text)
    refused(["predict", "--cluster", path], capsys, pattern)


def test_cluster_file_not_utf8(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_bytes(b"\xff\xfe{\x00")
    refused(["predict", "--cluster", path], capsys, r"not UTF-8")


def test_cluster_file_too_large(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(" " * (2 << 20) + "{}")
    refused(["plan", "--params", "1B", "--gpus", 8, "--cluster", path], capsys, r"over the limit")


def test_cluster_directory_refused(tmp_path, capsys):
    refused(["predict", "--cluster", tmp_path], capsys, r"not a regular file")


def test_the_valid_cluster_file_still_loads(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(_cluster_text(efficiency={"gemm": 0.7, "optimizer": None}))
    assert main(["predict", "--cluster", str(path)]) == 0
    assert "MFU" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["predict", "--cluster", "/dev/zero"],
    ["plan", "--params", "1B", "--gpus", "8", "--cluster", "/dev/urandom"],
])
def test_devices_refused_before_open(argv):
    if not os.path.exists(argv[argv.index("--cluster") + 1]):
        pytest.skip("no such device here")
    refused_subprocess(argv, r"not a regular file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_refused_before_open(tmp_path):
    fifo = tmp_path / "cluster.json"
    os.mkfifo(fifo)
    refused_subprocess(["predict", "--cluster", fifo], r"not a regular file")  # opening it would block
