"""Data parallelism and verify: equal to single-process training, exact byte counts, clear errors."""

import json

import pytest
from mpi_util import last_json, run_mpi, run_mpi_json

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("collectives", ["mpi", "ring"])
def test_allreduce_bytes_equal_the_ring_formula(collectives):
    # N = 2: every all-reduce of L elements sends exactly L elements per rank, 2L(N-1)/N,
    # whatever L is. MLP 2 -> 8 -> 3: Ψ = 2*8 + 8 + 8*3 + 3 = 51 parameters, float64.
    steps, psi = 3, 51
    flags = ["-m", "refimpl", "train", "--model", "mlp", "--d-model", "8", "--n-layer", "1", "--dtype", "float64",
             "--steps", str(steps), "--batch-size", "8", "--collectives", collectives, "--json"]
    for mode, grad_accum in (("naive", 1), ("bucketed", 1), ("bucketed", 4)):
        summary = run_mpi_json(2, flags + ["--dp-mode", mode, "--grad-accum", str(grad_accum)])
        assert summary["n_params"] == psi
        for rank_counts in summary["bytes_sent"]:
            # gradients once per step whatever the accumulation, plus one float64 for the step's loss
            assert rank_counts["allreduce"]["bytes"] == steps * (psi + 1) * 8
            calls = steps * ((4 if mode == "naive" else 1) + 1)  # 4 parameters, or one bucket; + the loss
            assert rank_counts["allreduce"]["calls"] == calls


def test_allreduce_bytes_at_four_ranks_divisible_case():
    # N = 4, a GPT whose Ψ = 3792 parameters is divisible by 4, one bucket: 2Ψ(N-1)/N = 5688 elements
    # per step, plus the step's loss: one float64, whose ring all-reduce sends 2·1 − count_r − count_(r+1)
    # elements (block 0 holds it: count_0 = 1, the others 0).
    flags = ["-m", "refimpl", "train", "--model", "gpt", "--d-model", "16", "--n-layer", "1", "--n-head", "2",
             "--seq-len", "8", "--dtype", "float64", "--steps", "2", "--batch-size", "8", "--json"]
    summary = run_mpi_json(4, flags)
    psi = summary["n_params"]
    assert psi == 3792
    loss_elements = [2 - (r == 0) - ((r + 1) % 4 == 0) for r in range(4)]
    for r, counts in enumerate(summary["bytes_sent"]):
        assert counts["allreduce"]["bytes"] == 2 * (2 * psi * 3 // 4 + loss_elements[r]) * 8


def test_train_under_mpiexec_learns_and_reports_world_size():
    summary = run_mpi_json(2, ["-m", "refimpl", "train", "--model", "mlp", "--steps", "300", "--json"])
    assert summary["world_size"] == 2 and summary["accuracy"] > 0.9
    assert len(summary["bytes_sent"]) == 2


def test_a_batch_that_cannot_be_split_is_a_clear_error_on_every_rank():
    done = run_mpi(3, ["-m", "refimpl", "train", "--model", "mlp", "--batch-size", "10", "--steps", "2"], timeout=300)
    assert done.returncode != 0
    assert "cannot be split into 3 equal data-parallel ranks" in done.stderr


def test_mismatched_flags_between_ranks_are_a_clear_error(tmp_path):
    # rank-dependent flags: a wrapper script passes a different --lr on rank 1
    script = tmp_path / "mismatch.py"
    script.write_text(
        "import os, sys\n"
        "from refimpl.tools.cli import main\n"
        "rank = int(os.environ.get('PMI_RANK', '0'))\n"
        "sys.exit(main(['train', '--model', 'mlp', '--steps', '2', '--lr', str(0.01 * (rank + 1))]))\n")
    done = run_mpi(2, [script], timeout=300)
    assert done.returncode != 0
    assert "ranks were launched with different flags: --lr: 0.01 on rank 0 vs 0.02 on rank 1" in done.stderr


def test_verify_fails_loudly_when_the_distributed_run_is_wrong(tmp_path):
    # Break data parallelism on purpose (average instead of sum): verify must exit 1 and say FAIL.
    script = tmp_path / "broken.py"
    script.write_text(
        "import sys\n"
        "from refimpl.parallel import data_parallel\n"
        "original = data_parallel.DataParallel.end_step\n"
        "def end_step(self, result):\n"
        "    original(self, result)\n"
        "    for p in self.params:\n"
        "        p.data *= 1.0 + 1e-6  # a tiny, systematic error\n"
        "data_parallel.DataParallel.end_step = end_step\n"
        "from refimpl.tools.cli import main\n"
        "sys.exit(main(['verify', '--model', 'mlp', '--dtype', 'float64', '--json']))\n")
    done = run_mpi(2, [script], timeout=300)
    assert done.returncode == 1
    assert last_json(done)["ok"] is False and "verify FAIL" in done.stderr
    json.dumps(last_json(done))  # the summary is plain JSON


def test_bad_input_on_one_rank_only_ends_every_rank(tmp_path):
    # rank 1 fails its argument check while rank 0 waits in a collective: the job must still end
    script = tmp_path / "one_rank_fails.py"
    script.write_text(
        "import os, sys\n"
        "from refimpl.tools.cli import main\n"
        "from refimpl.parallel.comm import get_world\n"
        "get_world()\n"
        "rank = int(os.environ.get('PMI_RANK', '0'))\n"
        "sys.exit(main(['train', '--model', 'mlp', '--steps', '0' if rank == 1 else '2']))\n")
    done = run_mpi(2, [script], timeout=300)
    assert done.returncode != 0
    # the startup agreement (cli._agree_on_startup) prints a problem once, naming the ranks that have it
    assert done.returncode == 2 and "error: --steps must be positive, got 0 (on rank 1)\n" == done.stderr
