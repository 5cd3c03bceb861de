"""The PyTorch bridge (docs/golden_cases.md): a GPT written in PyTorch, loaded from a golden case's
weights and trained with DistributedDataParallel (gloo, 2 CPU processes) on its batches, passes
`golden --check` in float64; the same script with a planted bug fails at step 0. Skipped where torch
is not installed (pip install -e '.[torch]')."""

from __future__ import annotations

import pytest
from mpi_util import REPO, run_local

from refimpl.tools.cli import main
from refimpl.tools.golden import check_results

pytest.importorskip("torch")

EXAMPLE = REPO / "docs" / "examples" / "torch_ddp_golden.py"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The command's default case: a 2-block GPT, 3 steps of AdamW with clipping, float64."""
    path = tmp_path_factory.mktemp("torch") / "case"
    assert main(["golden", "--out", str(path)]) == 0
    return path


def torch_results(case, out, *flags):
    done = run_local([EXAMPLE, case, out, *flags], timeout=120)
    assert done.returncode == 0, done.stderr
    return check_results(str(case), str(out))


def test_torch_ddp_on_two_processes_passes(case, tmp_path, capsys):
    result = torch_results(case, tmp_path / "results.npz")
    assert result["ok"], result["failures"][:3]
    assert result["checked"] == 3 * (1 + 2 * 29)
    assert 0 <= result["largest"]["relative_error"] < 1e-11  # rounding: another framework sums in other orders
    assert main(["golden", "--check", str(case), "--against", str(tmp_path / "results.npz")]) == 0
    captured = capsys.readouterr()
    assert "golden PASS: " in captured.out + captured.err


@pytest.mark.parametrize("bug", ["unscaled-loss", "no-allreduce"])
def test_a_planted_bug_fails_at_the_first_gradient(case, tmp_path, capsys, bug):
    result = torch_results(case, tmp_path / "results.npz", "--bug", bug)
    assert not result["ok"]
    first = result["failures"][0]
    assert (first["step"], first["kind"], first["name"]) == (0, "gradient", "wte.weight")
    assert first["relative_error"] > 0.1
    assert main(["golden", "--check", str(case), "--against", str(tmp_path / "results.npz")]) == 1
    captured = capsys.readouterr()
    assert "golden FAIL: " in captured.out + captured.err
