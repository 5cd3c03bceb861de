"""Golden cases (refimpl/tools/golden.py, `python -m refimpl golden`): a case holds what single-process
training computed, results from any implementation are checked against it tensor by tensor, and
bad input is one line with exit status 2.

Results here come from refimpl itself, computed from the case's own files (its initial weights and
batches, not refimpl's seed): LocalTrainer (bitwise equal), the distributed trainer on 2 MPI ranks
(DDP and ZeRO-2, equal to rounding), and deliberately wrong copies of the expected arrays.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi_util import REPO, run_mpi

from refimpl.local_trainer import LocalTrainer
from refimpl.tools.cli import main
from refimpl.tools.golden import check_results, key, load_case, results_from_trainer
from refimpl.tools.run import build_optimizer

SMALL = ["--n-layer", "1", "--d-model", "8", "--n-head", "2", "--seq-len", "6", "--batch-size", "4", "--steps", "2"]


def cli(argv, capsys) -> tuple[int, list[str]]:
    """Run the command in this process: (exit status, the non-empty lines it printed, stdout and stderr)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, [line for line in (captured.out + captured.err).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A small float64 case (a 1-block GPT, 2 steps, SGD) written by the command, and its expected arrays."""
    path = tmp_path_factory.mktemp("golden") / "case"
    assert main(["golden", "--out", str(path), *SMALL, "--optimizer", "sgd", "--lr", "0.1"]) == 0
    with np.load(path / "expected.npz") as data:
        expected = {name: data[name] for name in data.files}
    return Case(path, expected)


class Case(tuple):
    """(path, expected arrays), shown by its path (hypothesis prints the arguments of a failing example)."""

    def __new__(cls, path, expected):
        return super().__new__(cls, (path, expected))

    def __repr__(self) -> str:
        return f"Case({str(self[0])!r})"


def write_results(path, arrays: dict):
    np.savez(path, **arrays)
    return path


def local_trainer(cfg, model):
    return LocalTrainer(model, build_optimizer(cfg, model.parameters()), 1, cfg.clip)


def test_the_case_holds_what_its_manifest_says(case):
    path, expected = case
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "refimpl-golden/1"
    assert manifest["steps"] == 2 and manifest["config"]["optimizer"] == "sgd"
    names = [p["name"] for p in manifest["parameters"]]
    assert names[0] == "wte.weight" and names[-1] == "lm_head.weight" and len(names) == 17
    assert expected["loss"].shape == (2,) and np.isfinite(expected["loss"]).all()
    assert set(expected) == {"loss"} | {key(kind, s, n) for kind in ("grads", "params") for s in (0, 1) for n in names}
    _, initial, batches, _ = load_case(str(path))
    assert batches["x"].shape == (2, 4, 6) and batches["y"].shape == (2, 4, 6)
    assert (batches["y"][:, :, :3] == -100).all()  # the sorting task's prompt is not counted
    assert sorted(initial) == sorted(names)


def test_a_case_written_twice_has_the_same_id_and_arrays(case, tmp_path):
    path, expected = case
    again = tmp_path / "again"
    assert main(["golden", "--out", str(again), *SMALL, "--optimizer", "sgd", "--lr", "0.1"]) == 0
    first, second = (json.loads((p / "manifest.json").read_text()) for p in (path, again))
    assert first["case_id"] == second["case_id"]
    with np.load(again / "expected.npz") as data:
        assert all(np.array_equal(data[name], expected[name]) for name in expected)


def test_local_trainer_from_the_case_files_passes_bitwise(case, tmp_path, capsys):
    path, _ = case
    results = write_results(tmp_path / "results.npz", results_from_trainer(str(path), local_trainer))
    result = check_results(str(path), str(results))
    assert result["ok"] and result["failures"] == []
    assert result["largest"]["relative_error"] == 0.0  # the same arithmetic: bitwise equal
    assert result["checked"] == 2 * (1 + 2 * 17)
    code, lines = cli(["golden", "--check", path, "--against", results], capsys)
    assert code == 0 and lines[-1].startswith("golden PASS: ") and "70 comparisons" in lines[-1]


@pytest.mark.mpi
@pytest.mark.parametrize("zero", [0, 2])
def test_the_distributed_trainer_on_two_ranks_passes(case, tmp_path, zero, capsys):
    path, _ = case
    program = tmp_path / "distributed_results.py"
    program.write_text(
        "import sys\n"
        "import numpy as np\n"
        "from refimpl.tools.runtime import guards\n"
        "guards.install()\n"
        "from refimpl.parallel.comm import get_world\n"
        "from refimpl.tools.golden import results_from_trainer\n"
        "from refimpl.tools.run import make_trainer\n"
        "world = get_world()\n"
        "assert world.size == 2, world.size\n"
        f"def build(cfg, model):\n    cfg.zero = {zero}\n"
        "    return make_trainer(cfg, model, world, distributed=True)\n"
        "results = results_from_trainer(sys.argv[1], build)\n"
        "if world.rank == 0:\n    np.savez(sys.argv[2], **results)\n")
    done = run_mpi(2, [program, path, tmp_path / "results.npz"], timeout=120)
    assert done.returncode == 0, done.stderr
    code, lines = cli(["golden", "--check", path, "--against", tmp_path / "results.npz"], capsys)
    assert code == 0, lines
    result = check_results(str(path), str(tmp_path / "results.npz"))
    assert result["ok"] and 0 <= result["largest"]["relative_error"] < 1e-12


def test_one_wrong_gradient_is_one_failure_line_and_exit_1(case, tmp_path, capsys):
    path, expected = case
    wrong = dict(expected)
    name = key("grads", 1, "blocks.0.attn.proj.weight")
    wrong[name] = expected[name] * 1.5  # relative error 0.5
    results = write_results(tmp_path / "results.npz", wrong)
    code, lines = cli(["golden", "--check", path, "--against", results], capsys)
    assert code == 1
    failures = [line for line in lines if line.startswith("step ")]
    assert failures == ["step 1 gradient blocks.0.attn.proj.weight: relative error 0.5 > rtol 1e-10"]
    assert lines[-1].startswith("golden FAIL: 1 of 70 comparisons") and "first: step 1 gradient" in lines[-1]


def test_a_wrong_loss_and_a_nan_fail_naming_the_first_step(case, tmp_path):
    path, expected = case
    wrong = dict(expected)
    wrong["loss"] = expected["loss"] * np.array([1.0, 1.0 + 1e-6])
    name = key("params", 0, "ln_f.bias")
    wrong[name] = expected[name].copy()
    wrong[name][0] = np.nan
    result = check_results(str(path), str(write_results(tmp_path / "results.npz", wrong)))
    assert not result["ok"]
    assert [(f["step"], f["kind"], f["name"]) for f in result["failures"]] == [(0, "parameter", "ln_f.bias"),
                                                                               (1, "loss", "loss")]
    assert result["first_failure"] == "step 0 parameter ln_f.bias: relative error nan (not finite)"
    assert result["failures"][1]["relative_error"] == pytest.approx(1e-6, rel=1e-6)


@given(step=st.integers(0, 1), kind=st.sampled_from(["grads", "params"]), tensor=st.integers(0, 16),
       exponent=st.floats(-14.0, -1.0), sign=st.sampled_from([-1.0, 1.0]))
def test_a_tensor_fails_exactly_when_its_relative_error_exceeds_rtol(case, tmp_path_factory, step, kind, tensor,
                                                                     exponent, sign):
    path, expected = case
    names = [p["name"] for p in json.loads((path / "manifest.json").read_text())["parameters"]]
    name = key(kind, step, names[tensor])
    wrong = dict(expected)
    direction = np.ones_like(expected[name]) * sign
    scale = np.linalg.norm(expected[name]) / np.linalg.norm(direction)
    wrong[name] = expected[name] + (10.0 ** exponent) * scale * direction  # relative error 10^exponent
    results = write_results(tmp_path_factory.mktemp("r") / "results.npz", wrong)
    result = check_results(str(path), str(results))
    relative = 10.0 ** exponent
    bound = 1e-10 + 1e-12 / np.linalg.norm(expected[name])  # ‖diff‖ <= atol + rtol ‖expected‖, relative
    if relative > 1.01 * bound:
        assert [f"{f['kind']} {f['step']}" for f in result["failures"]] == \
            [f"{'gradient' if kind == 'grads' else 'parameter'} {step}"]
        assert result["failures"][0]["relative_error"] == pytest.approx(relative, rel=1e-6)
    elif relative < 0.99 * bound:
        assert result["ok"], result["failures"]


# -- bad input: one line, exit status 2 ---------------------------------------------------------------

def refused(argv, capsys, pattern: str) -> str:
    code, lines = cli(argv, capsys)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert pattern in lines[0], lines[0]
    return lines[0]


def copy_case(case, tmp_path):
    path, _ = case
    target = tmp_path / "case"
    shutil.copytree(path, target)
    return target


def test_a_changed_file_is_a_checksum_error(case, tmp_path, capsys):
    target = copy_case(case, tmp_path)
    with np.load(target / "initial.npz") as data:
        initial = {name: data[name] for name in data.files}
    initial["wte.weight"] = initial["wte.weight"] + 1e-3
    np.savez(target / "initial.npz", **initial)
    refused(["golden", "--check", target], capsys, "initial.npz's SHA-256 is")


def test_a_hand_edited_configuration_is_refused(case, tmp_path, capsys):
    target = copy_case(case, tmp_path)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["config"]["lr"] = 0.2
    (target / "manifest.json").write_text(json.dumps(manifest))
    refused(["golden", "--check", target, "--against", case[0] / "expected.npz"], capsys, "does not match its case_id")


def test_results_of_another_case_are_refused(case, tmp_path, capsys):
    path, expected = case
    results = write_results(tmp_path / "results.npz", {**expected, "case_id": np.array("0" * 64)})
    refused(["golden", "--check", path, "--against", results], capsys, "was produced from case 0000000000000000")


def test_missing_tensors_are_refused_naming_them(case, tmp_path, capsys):
    path, expected = case
    partial = {name: array for name, array in expected.items() if not name.startswith("grads/001/")}
    results = write_results(tmp_path / "results.npz", partial)
    refused(["golden", "--check", path, "--against", results], capsys,
            "lacks 17 of the 69 tensors: grads/001/wte.weight")


def test_a_wrong_shape_is_refused(case, tmp_path, capsys):
    path, expected = case
    name = key("params", 0, "lm_head.weight")
    results = write_results(tmp_path / "results.npz", {**expected, name: expected[name].T})
    refused(["golden", "--check", path, "--against", results], capsys,
            "params/000/lm_head.weight has shape (8, 11), the case's is (11, 8)")


@pytest.mark.parametrize("argv, pattern", [
    (["--check", "{tmp}/nowhere"], "is not a directory"),
    (["--check", "{tmp}", "--against", "{tmp}/missing.npz"], "no such file"),
    (["--check", "{case}", "--against", "{tmp}/not_npz.npz"], "is not a readable .npz"),
    (["--check", "{tmp}"], "has no manifest.json"),
    (["--out", "{tmp}", "--against", "{tmp}/not_npz.npz"], "--against goes with --check"),
    (["--out", "{tmp}"], "holds other files (not_npz.npz)"),
    (["--out", "{tmp}/new", "--dtype", "float32", "--dropout", "0.1"], "unrecognized arguments: --dropout"),
    (["--check", "{case}", "--against", "{case}/expected.npz", "--rtol", "nan"], "--rtol must be a finite number"),
])
def test_bad_input_is_one_line(case, tmp_path, capsys, argv, pattern):
    (tmp_path / "not_npz.npz").write_text("not a zip")
    argv = [a.format(tmp=tmp_path, case=case[0]) for a in argv]
    code, lines = cli(["golden", *argv], capsys)
    assert code == 2, lines
    assert pattern in lines[-1], lines
    assert "Traceback" not in "\n".join(lines)


def test_the_example_reads_the_case_without_refimpl():
    source = (REPO / "docs" / "examples" / "torch_ddp_golden.py").read_text()
    assert "refimpl" not in "".join(line for line in source.splitlines() if line.startswith(("import", "from")))
