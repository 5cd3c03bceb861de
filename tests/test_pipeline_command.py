"""`python -m refimpl schedule`: JSON contract, comparison table, pictures, errors.

matplotlib is not a test dependency: the PNG test only checks the clear error when it is
missing, and draws a PNG only where matplotlib happens to be installed."""

import argparse
import importlib.util
import json
import subprocess
import sys

import pytest

from refimpl.tools.commands import schedule as command


def run(argv, capsys):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(argv)
    code = command.run(args)
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out: str) -> dict:
    lines = out.strip().splitlines()
    assert len(lines) == 1, "with --json, stdout is exactly one line"
    return json.loads(lines[-1])


def test_json_has_the_documented_fields(capsys):
    code, out, err = run(["1f1b", "--pp", "4", "--micro-batches", "8", "--json"], capsys)
    assert code == 0
    info = last_json(out)
    assert info["schedule"] == "1f1b" and info["pp"] == 4 and info["micro_batches"] == 8
    assert info["makespan"] == 33 and info["idle_per_rank"] == [9, 9, 9, 9]
    assert info["peak_activations_per_rank"] == [4, 3, 2, 1]
    assert info["bubble_fraction"] == pytest.approx(9 / 33)
    assert info["closed_form"]["exact"] is True and info["closed_form"]["idle"] == 9
    assert info["actions"][3][:2] == [{"kind": "F", "stage": 3, "mb": 0}, {"kind": "B", "stage": 3, "mb": 0}]
    assert info["validation"]["valid"] is True
    assert "1f1b" in err  # the human summary goes to stderr


def test_json_of_dualpipe_has_directions_and_pairs(capsys):
    code, out, _ = run(["--schedule", "dualpipe", "--pp", "4", "--micro-batches", "8", "--json"], capsys)
    info = last_json(out)
    steps = [step for rank in info["actions"] for step in rank]
    pairs = [s for s in steps if s["kind"] == "F&B"]
    assert pairs
    assert all(set(p) == {"kind", "f", "b"} and p["f"]["kind"] == "F" and p["b"]["kind"] == "B" for p in pairs)
    assert all("dir" in s for s in steps if s["kind"] != "F&B")
    assert info["idle_per_rank"] == [2, 2, 2, 2] and info["peak_activations_per_rank"] == [5, 5, 5, 5]
    assert info["parameter_copies_per_rank"] == [2.0] * 4
    assert info["placement"] == [[0, 1, 2, 3], [3, 2, 1, 0]]


def test_costs_are_scaled_to_the_stage_size(capsys):
    _, out, _ = run(["zbv", "--pp", "2", "--micro-batches", "4", "--json"], capsys)
    assert last_json(out)["costs"] == {"F": 0.5, "B": 1, "I": 0.5, "W": 0.5, "FB": 1.5}
    _, out, _ = run(["zbv", "--pp", "2", "--micro-batches", "4", "--json", "--costs-per-action"], capsys)
    assert last_json(out)["costs"] == {"F": 1, "B": 2, "I": 1, "W": 1, "FB": 3}


def test_text_output_shows_timeline_table_and_formula(capsys):
    code, out, _ = run(["zb1p", "--pp", "3", "--micro-batches", "6", "--program"], capsys)
    assert code == 0
    assert "rank  0 | F0 F1 " in out
    assert "closed form (p-1)(F+I-W) = 2 per rank" in out
    assert "rank 2: F0s2 I0s2 F1s2 I1s2 " in out


def test_compare_lists_every_schedule(capsys):
    code, out, _ = run(["--compare", "--pp", "4", "--micro-batches", "8"], capsys)
    assert code == 0
    for name in ("gpipe", "1f1b", "interleaved", "zb1p", "zbh2", "zbv", "dualpipe", "dualpipev"):
        assert f"\n{name} " in "\n" + out
    code, out, _ = run(["--compare", "--pp", "3", "--micro-batches", "6", "--json"], capsys)
    info = last_json(out)
    by_name = {r["schedule"]: r for r in info["schedules"]}
    assert "even --pp" in by_name["dualpipe"]["error"]  # a constraint violation is one row, not a failure
    assert by_name["1f1b"]["idle_per_rank"] == [6, 6, 6]


def test_svg_and_chrome_trace_files(tmp_path, capsys):
    svg = tmp_path / "s.svg"
    run(["dualpipev", "--pp", "2", "--micro-batches", "4", "--render", "svg", "--out", str(svg)], capsys)
    text = svg.read_text()
    assert text.startswith("<svg") and text.rstrip().endswith("</svg>") and text.count("<rect") >= 2 * 4 * 3
    trace = tmp_path / "t.json"
    run(["1f1b", "--pp", "2", "--micro-batches", "2", "--render", "trace", "--out", str(trace)], capsys)
    events = json.loads(trace.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 8 and {e["tid"] for e in complete} == {0, 1}


def test_png_needs_matplotlib(tmp_path, capsys):
    png = tmp_path / "s.png"
    argv = ["1f1b", "--pp", "2", "--micro-batches", "2", "--png", str(png)]
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(ValueError, match="needs matplotlib"):
            run(argv, capsys)
    else:
        run(argv, capsys)
        assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["dualpipe", "--pp", "4", "--micro-batches", "6"], "dualpipe needs --micro-batches even and >= 2*pp = 8"),
        (["dualpipe", "--pp", "3", "--micro-batches", "12"], "dualpipe needs an even --pp"),
        (["dualpipev", "--pp", "3", "--micro-batches", "5"], "dualpipev needs --micro-batches >= 2*pp = 6"),
        (["interleaved", "--pp", "4", "--micro-batches", "6"], "multiple of --pp 4"),
        (["1f1b", "--pp", "2", "--micro-batches", "2", "--costs", "F=x"], "bad cost"),
        (["1f1b", "--pp", "2", "--micro-batches", "2", "--latency", "-1"], "--latency must be >= 0"),
        (["1f1b", "--pp", "2", "--micro-batches", "2", "--render", "svg"], "add --out FILE"),
        (["--pp", "2", "--micro-batches", "2"], "name a schedule"),
    ],
)
def test_bad_input_is_one_line_error_exit_2(argv, message, capsys):
    from refimpl.tools.cli import main

    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_module_entry_point_json_is_the_last_stdout_line():
    result = subprocess.run(
        [sys.executable, "-m", "refimpl", "schedule", "zbh2", "--pp", "3", "--micro-batches", "6", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["schedule"] == "zbh2" and info["steady_state_idle_per_rank"] == [0, 0, 0]
    assert "mpi4py" not in result.stderr


def test_schedules_need_no_mpi():
    code = "import sys, refimpl.tools.commands.schedule; assert 'mpi4py' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_svg_pictures_are_well_formed_xml():
    # overlapped steps are labelled "3&5": the ampersand must be escaped, or no viewer shows the file
    import pathlib
    import xml.etree.ElementTree as ET

    from refimpl.parallel.pipeline.schedules import build
    from refimpl.parallel.pipeline.simulate import Costs, simulate
    from refimpl.tools.render import render_svg

    ET.fromstring(render_svg(simulate(build("dualpipe", 4, 8), Costs())))
    for path in (pathlib.Path(__file__).resolve().parents[1] / "docs" / "images").glob("*.svg"):
        ET.parse(path)
