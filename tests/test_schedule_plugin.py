"""A pipeline schedule of your own plugs in without editing refimpl: --schedule MODULE:FUNCTION.

The worked example (docs/examples/my_schedule.py, docs/capstone.md) builds, validates and simulates
through the same `build` as the built-in schedules, meets the targets the page states, and runs
over MPI in `verify`; bad plug-ins are one clear line with exit status 2 before anything trains.
"""

from __future__ import annotations

import json
import textwrap
from fractions import Fraction

import pytest
from mpi_util import REPO, run_mpi_json

from refimpl.parallel.pipeline import Costs, Schedule, build, simulate, validate
from refimpl.tools.cli import main
from refimpl.tools.flags import schedule_name
from refimpl.tools.plugin import build_schedule
from refimpl.tools.plugin import is_spec as is_plugin

EXAMPLE = "docs/examples/my_schedule.py:early_backward"
SMALL = ["--d-model", "8", "--n-head", "2", "--seq-len", "8", "--n-layer", "2", "--steps", "2"]


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the example's path is relative to the repository


def test_the_example_builds_validates_and_meets_its_targets(in_repo):
    schedule = build_schedule(EXAMPLE, 4, 8)
    assert isinstance(schedule, Schedule) and schedule.name == "early_backward"
    report = validate(schedule)
    assert report.actions == 4 * 8 * 3 and report.per_channel_ok  # F, I, W of every (stage, micro-batch)
    costs = Costs.parse("F=1,I=1,W=1")
    ours, base = simulate(schedule, costs), simulate(build("1f1b", 4, 8), costs)
    # the targets docs/capstone.md states: less bubble than 1F1B at exactly 1F1B's activation memory
    assert ours.bubble_fraction < base.bubble_fraction
    assert ours.bubble_fraction == Fraction(1, 4) and base.bubble_fraction == Fraction(3, 11)
    assert ours.peak_activations == base.peak_activations == [4, 3, 2, 1]
    with pytest.raises(ValueError, match="early_backward holds 1 stage"):
        build_schedule(EXAMPLE, 4, 8, 2)  # its own constraint, passed through with the spec in front


def test_names_of_your_own_are_accepted_where_built_in_names_are():
    assert is_plugin(EXAMPLE) and not is_plugin("1f1b")
    assert schedule_name("zbv") == "zbv" and schedule_name(EXAMPLE) == EXAMPLE
    with pytest.raises(Exception, match="MODULE:FUNCTION"):
        schedule_name("pipedream")


def test_the_schedule_command_validates_simulates_compares_and_draws(in_repo, tmp_path, capsys):
    assert main(["schedule", EXAMPLE, "--pp", "4", "--micro-batches", "8", "--costs", "F=1,I=1,W=1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["schedule"] == "early_backward" and info["makespan"] == 32
    assert info["peak_activations_per_rank"] == [4, 3, 2, 1]
    assert info["closed_form"]["formula"] == "1F1B, simulated" and info["closed_form"]["idle"] == 9
    svg = tmp_path / "mine.svg"
    assert main(["schedule", "--schedule", EXAMPLE, "--pp", "4", "--micro-batches", "8", "--render", "svg",
                 "--out", str(svg)]) == 0
    assert svg.read_text().startswith("<svg")
    assert main(["schedule", "--compare", "--schedule", EXAMPLE, "--pp", "2", "--micro-batches", "4"]) == 0
    assert "my_schedule.py:early_backward" in capsys.readouterr().out


BAD = textwrap.dedent('''
    from refimpl.parallel.pipeline.schedules import Action, linear_placement, make_schedule

    NOT_A_FUNCTION = 3

    def returns_a_list(pp, micro_batches, chunks=None):
        return [[] for _ in range(pp)]

    def forgets_w(pp, micro_batches, chunks=None):
        ranks = [[Action("F", r, k) for k in range(micro_batches)] + [Action("I", r, k) for k in range(micro_batches)]
                 for r in range(pp)]
        return make_schedule("forgets_w", pp, micro_batches, linear_placement(pp), ranks)

    def deadlocks(pp, micro_batches, chunks=None):  # rank 0 runs B0 before F1; rank 1 needs F1 before B0
        ranks = [[a for k in range(micro_batches) for a in (Action("F", 0, k), Action("B", 0, k))]]
        ranks += [[Action("F", r, k) for k in range(micro_batches)] + [Action("B", r, k) for k in range(micro_batches)]
                  for r in range(1, pp)]
        return make_schedule("deadlocks", pp, micro_batches, linear_placement(pp), ranks)

    def crashes(pp, micro_batches, chunks=None):
        return {}["oops"]
''')


@pytest.mark.parametrize("function, message", [
    ("nope", "has no function 'nope'"),
    ("NOT_A_FUNCTION", "'NOT_A_FUNCTION' in bad.py is not a function: it is int 3"),
    ("returns_a_list", "returns_a_list returned a list, not a Schedule"),
    ("forgets_w", "invalid schedule for pp=2, micro-batches=4: forgets_w: stage 0 micro-batch 0 has B=0, I=1, W=0"),
    ("deadlocks", "invalid schedule for pp=2, micro-batches=4: deadlocks: rendezvous deadlock"),
    ("crashes", "crashes(pp=2, micro_batches=4, chunks=None) raised KeyError: 'oops'"),
])
@pytest.mark.parametrize("command", ["schedule", "train", "verify"])
def test_a_bad_plugin_is_one_line_and_exit_status_2(tmp_path, monkeypatch, capsys, command, function, message):
    (tmp_path / "bad.py").write_text(BAD)
    monkeypatch.chdir(tmp_path)
    spec = f"bad.py:{function}"
    args = {"schedule": ["schedule", spec, "--pp", "2", "--micro-batches", "4"],
            "train": ["train", "--pp", "2", "--schedule", spec, "--micro-batches", "4", *SMALL],
            "verify": ["verify", "--pp", "2", "--schedule", spec, "--micro-batches", "4", *SMALL]}[command]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --schedule '{spec}': ") and message in err[0], err


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_here:make", "cannot import no_such_module_here: ModuleNotFoundError"),
    ("no/such/file.py:make", "no file no/such/file.py"),
])
def test_a_missing_module_is_one_line(capsys, spec, message):
    assert main(["schedule", spec, "--pp", "2", "--micro-batches", "4"]) == 2
    assert main(["verify", "--sweep", "2", "--schedule", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(message in line for line in err), err


@pytest.mark.mpi
def test_verify_runs_the_example_over_mpi_and_a_sweep_draws_it():
    result = run_mpi_json(2, ["-m", "refimpl", "verify", "--pp", "2", "--schedule", EXAMPLE, *SMALL, "--json"],
                          timeout=120)
    assert result["ok"] and result["world_size"] == 2
    sweep = run_mpi_json(2, ["-m", "refimpl", "verify", "--sweep", "2", "--sweep-seed", "3", "--schedule", EXAMPLE,
                             "--json"], timeout=120)
    assert sweep["ok"] and all(EXAMPLE in entry["flags"] for entry in sweep["sweep"])
