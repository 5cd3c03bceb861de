"""`python -m refimpl context-parallel` under mpiexec: every rank's bytes sent, saved bytes and score
elements equal accounting.py's formulas and the command says so (exit 0); a formula or a result
made wrong on purpose makes it exit 1 and mark the row; bad input is one line, exit 2."""

import pytest
from mpi_util import last_json, run_local, run_mpi

pytestmark = pytest.mark.mpi

SMALL = ["--batch", "1", "--heads", "4", "--kv-heads", "2", "--seq-len", "8", "--d-head", "2"]
CONFIGURATIONS = 6  # ring: balanced and contiguous, with and without the causal skip; Ulysses with and without
QUANTITIES = 7


def command(*flags):
    return ["-m", "refimpl", "context-parallel", *SMALL, "--json", *flags]


def check_result(done, C: int) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    result = last_json(done)
    assert result["ok"] and result["ranks"] == C
    assert len(result["rows"]) == CONFIGURATIONS * C * QUANTITIES
    for row in result["rows"]:
        assert row["measured"] == row["formula"], row
    assert {row["rank"] for row in result["rows"]} == set(range(C))
    assert len(result["correct"]) == CONFIGURATIONS and all(row["ok"] for row in result["correct"])
    assert all(max(row["worst"].values()) <= 1.0 and row["finite"] for row in result["correct"])
    assert not [line for line in done.stdout.splitlines() if line.startswith("|") and "✗" in line]
    return result


def figure(result: dict, impl: str, lay: str, skip: bool, rank: int, quantity: str) -> int:
    (row,) = [row for row in result["rows"] if (row["impl"], row["layout"], row["causal_skip"], row["rank"],
                                                row["quantity"]) == (impl, lay, skip, rank, quantity)]
    return row["measured"]


def test_at_2_ranks_every_measurement_equals_its_formula():
    result = check_result(run_mpi(2, command("--compare-lengths"), timeout=120), 2)
    k = 2 * 1 * 2 * 2 * 2 * 8  # one chunk's K and V: 2·b·Hkv·c·D·8 with c = T/(2C) = 2
    assert [figure(result, "ring", "balanced", True, r, "forward_bytes") for r in (0, 1)] == [k, 2 * k]
    assert [figure(result, "ring", "balanced", True, r, "backward_bytes") for r in (0, 1)] == [3 * k, 3 * k]
    assert [figure(result, "ring", "contiguous", True, r, "forward_bytes") for r in (0, 1)] == [2 * k, 0]
    assert figure(result, "ulysses", "balanced", True, 0, "forward_bytes") == 1 * 4 * 2 * (8 + 4) * 8 // 2
    assert figure(result, "ring", "balanced", True, 1, "computed") == 1 * 4 * 5 * 2 * 2  # b·H·(2C + 1)·c²
    assert figure(result, "ring", "balanced", False, 1, "computed") == 1 * 4 * 8 * 8 // 2  # b·H·T²/C
    saved = (2 * 4 + 2 * 2) * 4 * 2 * 8 + 4 * 4 * 8  # q, y, k, v of T/C = 4 tokens; the log-sum-exp
    assert {figure(result, impl, "balanced", True, r, "saved_bytes") for impl in ("ring", "ulysses")
            for r in (0, 1)} == {saved}
    here = [row for row in result["compare"] if (row["C"], row["T"]) == (2, 8)]
    assert here == [{"C": 2, "T": 8, "ring": 5 * k, "ring_no_skip": 6 * k, "ulysses": 2 * 384,
                     "scores_per_hop_byte": 1 * 4 * 5 * 4 / 2 / (2 * k)}]


def test_at_4_ranks_every_measurement_equals_its_formula():
    small_4 = ["--seq-len", "16", "--heads", "8", "--kv-heads", "4"]  # 2C = 8 chunks; heads divisible by 4
    result = check_result(run_mpi(4, command(*small_4), timeout=120), 4)
    computed = [figure(result, "ring", "contiguous", True, r, "computed") for r in range(4)]
    assert computed == [1 * 8 * (4 * r + 3) * 4 for r in range(4)]  # b·H·(4r + 3)·c², c = 2
    assert {figure(result, "ring", "balanced", True, r, "computed") for r in range(4)} == {1 * 8 * 9 * 4}


def test_one_process_is_one_rank_that_sends_nothing():
    done = run_local(command(), timeout=120)
    result = check_result(done, 1)
    assert all(row["measured"] == 0 for row in result["rows"] if row["quantity"].endswith("_bytes")
               and row["quantity"] != "saved_bytes")
    assert "launch C ranks with mpiexec -n C" in done.stderr


PLANTED_FORMULA = """
import sys
from refimpl.parallel.context_parallel import accounting
from refimpl.tools import context_parallel_report
right = accounting.ring_bytes
def wrong(shape, rank, layout="balanced", causal_skip=True):
    sent = right(shape, rank, layout, causal_skip)
    return {**sent, "backward": sent["backward"] + (rank == 1 and layout == "contiguous")}
context_parallel_report.accounting.ring_bytes = wrong
from refimpl.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""

PLANTED_RESULT = """
import sys
from refimpl.parallel.context_parallel import ring_attention
right = ring_attention.finish
def wrong(state):
    y, lse = right(state)
    return y * (1 + 1e-8), lse
ring_attention.finish = wrong
from refimpl.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_wrong_formula_exits_1_and_marks_its_row():
    done = run_mpi(2, ["-c", PLANTED_FORMULA, "context-parallel", *SMALL, "--json"], timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    result = last_json(done)
    wrong = [row for row in result["rows"] if row["measured"] != row["formula"]]
    assert [(row["impl"], row["layout"], row["causal_skip"], row["rank"], row["quantity"]) for row in wrong] == [
        ("ring", "contiguous", True, 1, "backward_bytes"), ("ring", "contiguous", False, 1, "backward_bytes")]
    assert not result["ok"] and all(row["ok"] for row in result["correct"])
    marked = [line for line in done.stdout.splitlines() if "✗" in line and line.startswith("| ring, contiguous")]
    assert len(marked) == 2 and all("| 1 |" in line for line in marked)


def test_a_wrong_output_exits_1_and_says_which_configurations():
    done = run_mpi(2, ["-c", PLANTED_RESULT, "context-parallel", *SMALL, "--json"], timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    result = last_json(done)
    assert all(row["measured"] == row["formula"] for row in result["rows"])
    assert [row["ok"] for row in result["correct"]] == [False] * 4 + [True] * 2  # the ring's four, not Ulysses
    assert done.stdout.count("| NO ✗") == 4


@pytest.mark.parametrize(("ranks", "flags", "message"), [
    (2, ["--seq-len", "6"], "error: --seq-len 6 cannot be cut into 2·2 = 4 equal chunks over 2 ranks; use a sequence "
                            "length divisible by 4"),
    (4, ["--heads", "6", "--kv-heads", "2"], "error: Ulysses splits the heads over 4 ranks, but --heads is 6 and "
                                             "--kv-heads 2; use head counts divisible by 4, or measure ring "
                                             "attention only (--impl ring)"),
    (2, ["--heads", "6", "--kv-heads", "4"], "error: 6 query heads cannot share 4 key/value heads equally"),
    (2, ["--seq-len", "4096"], "error: one process's attention of --batch 2 --heads 8 --seq-len 4096 --d-head 4 "
                               "(the reference) is about 1,076,887,552 array elements, 53.8x the cap of 20,000,000"),
])
def test_bad_input_is_one_line_and_exit_2(ranks, flags, message):
    done = run_mpi(ranks, ["-m", "refimpl", "context-parallel", *flags], timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
