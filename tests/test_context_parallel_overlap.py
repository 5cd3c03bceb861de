"""benchmarks/context_parallel_overlap.py's ring simulation and link-delay wrapper, without timings:
the simulated waits follow from the ring's plan by hand, and the wrapped ring receives exactly the
messages the simulation counts (how close the times come is the benchmark's table)."""

import json
import runpy

import pytest
from mpi_util import REPO, run_mpi

BENCH = runpy.run_path(str(REPO / "benchmarks" / "context_parallel_overlap.py"), run_name="not_main")


def test_the_balanced_forward_hides_a_transfer_up_to_two_chunk_pairs():
    simulate, F = BENCH["simulate"], 1.0
    for P in (0.0, 1.0, 2.0):  # a step computes 3 chunk pairs (step 0), then 2: the transfer is behind them
        sim = simulate(4, "balanced", True, F, P, backward=False)
        assert sim["exposed"] == [0.0] * 4 and sim["duration"] == [9.0] * 4 and sim["waited"] == [3] * 4
    sim = simulate(4, "balanced", True, F, 4.0, backward=False)
    assert sim["exposed"] == [1.0 + 2.0 + 2.0] * 4 and sim["max_model"] == sim["duration"] == [14.0] * 4
    assert sim["sum_model"] == [9.0 + 3 * 4.0] * 4


def test_the_backward_waits_for_every_dk_dv_in_full():
    sim = BENCH["simulate"](4, "balanced", True, 1.0, 2.0, backward=True)
    assert sim["exposed"] == [3 * 2.0] * 4  # steps 1 … 3 receive dK/dV, sent after the sender's chunk pairs
    assert sim["max_model"] == [9.0] * 4  # the simple model misses it


def test_contiguous_backward_waits_for_busier_senders_even_without_delay():
    sim = BENCH["simulate"](4, "contiguous", True, 1.0, 0.0, backward=True)
    assert sum(sim["exposed"]) > 0 and sim["duration"][3] == max(sim["duration"])


@pytest.mark.mpi
def test_the_delayed_ring_receives_exactly_the_simulated_messages(tmp_path):
    out = tmp_path / "rows.json"
    done = run_mpi(2, [REPO / "benchmarks" / "context_parallel_overlap.py", "--block-cost", "0.001", "--delays",
                       "0,2", "--steps", "1", "--json", out], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(row["layout"], row["P_over_F"]) for row in rows] == [("balanced", 0), ("balanced", 2),
                                                                  ("contiguous", 0), ("contiguous", 2)]
    for row in rows:
        for phase in ("forward", "backward"):
            assert row[phase]["messages_received"] == row[phase]["simulated_messages_received"] > 0, row
