"""A failure on one rank ends the whole job within seconds, with a message naming the rank."""

from __future__ import annotations

import time

import pytest
from mpi_util import PROGRAMS, run_mpi

FAIL = PROGRAMS / "fail.py"
pytestmark = pytest.mark.mpi


def launch(error: str, n: int = 3, rank: int = 1):
    start = time.monotonic()
    done = run_mpi(n, [FAIL, "--rank", rank, "--error", error], timeout=120)  # a hang raises TimeoutExpired
    return done, time.monotonic() - start


def our_lines(stderr: str) -> list[str]:
    """stderr without MPICH's own "Abort(...) on node ..." line."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("Abort(")]


def test_exception_on_one_rank_aborts_every_rank():
    done, seconds = launch("runtime")
    assert done.returncode == 1
    assert "[rank 1] RuntimeError: injected failure" in done.stderr
    assert "[rank 1] Traceback (most recent call last):" in done.stderr
    assert all(line.startswith("[rank 1] ") for line in our_lines(done.stderr)), done.stderr
    assert "unreachable" not in done.stdout
    assert seconds < 20


def test_bad_input_is_one_line_and_exit_status_2():
    done, _ = launch("value", n=4, rank=3)
    assert done.returncode == 2
    assert our_lines(done.stderr) == ["[rank 3] ValueError: global batch 10 cannot be split across 3 ranks"]


def test_exception_in_a_thread_aborts_too():
    done, _ = launch("thread", n=2, rank=0)
    assert done.returncode == 1
    assert "[rank 0] KeyError: 'lost in a thread'" in done.stderr


def test_explicit_abort_with_message():
    done, _ = launch("abort", n=2, rank=1)
    assert done.returncode == 2
    assert our_lines(done.stderr) == ["[rank 1] error: --steps differs between ranks"]


def test_agree_raises_every_distinct_problem_on_every_rank_and_names_the_ranks_that_had_it():
    from refimpl.tools.runtime.failure import AgreedError, agree  # noqa: PLC0415

    class Gathered:  # what allgather_object returns on every rank
        def __init__(self, problems):
            self.problems, self.size = problems, len(problems)

        def allgather_object(self, mine):
            return self.problems

    agree(Gathered([None, None, None]), None)  # nobody had one: every rank goes on
    with pytest.raises(AgreedError, match=r"^shard 2 is corrupt \(on ranks 1, 3\)\nshard 5 is missing \(on rank 2\)$"):
        agree(Gathered([None, "shard 2 is corrupt", "shard 5 is missing", "shard 2 is corrupt"]), None)
    with pytest.raises(AgreedError, match=r"^bad directory$"):  # every rank had it: no list of ranks
        agree(Gathered(["bad directory", "bad directory"]), "bad directory")
    assert issubclass(AgreedError, ValueError)  # bad input: exit status 2
