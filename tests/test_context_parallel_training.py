"""Context parallelism in the trainer (--cp, refimpl/parallel/context_parallel/gpt.py): the mesh's
cp axis, pinned configurations that must train exactly like one process (float64, rtol 1e-10;
ring attention and Ulysses at cp 2 and 4, with tp, pipelines, ZeRO and checkpointing, and 8 ranks
over three axes), resuming at another cp, and the refusals (one line each). The drawn property
tests (tests/test_verify_drawn.py) draw cp too, through refimpl/tools/sweep.py."""

from collections import defaultdict

import pytest
from mpi_util import last_json, run_local, run_mpi
from test_verify_drawn import verify_many

from refimpl.parallel.mesh import Mesh
from refimpl.tools.sweep import SMALL


class _Recording:
    """A world of `size` ranks seen from `rank`: each split's (color, key) is noted, nothing is made."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.splits = rank, size, []

    def split(self, color: int, key: int):
        self.splits.append((color, key))
        return None


def _groups(size: int, **axes) -> list[list[list[int]]]:
    """For each sub-communicator the mesh makes, its groups of world ranks, each ordered by key."""
    worlds = [_Recording(rank, size) for rank in range(size)]
    for world in worlds:
        Mesh(world, **axes)
    out = []
    for i in range(len(worlds[0].splits)):
        by_color = defaultdict(list)
        for world in worlds:
            color, key = world.splits[i]
            by_color[color].append((key, world.rank))
        out.append(sorted([rank for _, rank in sorted(members)] for members in by_color.values()))
    return out


def test_the_mesh_orders_tp_then_cp_then_dp_then_pp_and_reduces_gradients_over_dp_x_cp():
    dp_comm, pp_comm, tp_comm, mp_comm, cp_comm = _groups(16, pp=2, tp=2, cp=2)  # dp = 2
    assert tp_comm == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert cp_comm == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert dp_comm == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]  # d · cp + c order
    assert pp_comm == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert mp_comm == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    mesh = Mesh(_Recording(13, 16), pp=2, tp=2, cp=2)
    assert (mesh.dp_index, mesh.pp_index, mesh.tp_index, mesh.cp_index) == (1, 1, 1, 0)
    assert mesh.rank_of(1, 1, 1, 0) == 13 and not mesh.leads_replica
    dp_comm, pp_comm, tp_comm, mp_comm = _groups(8, pp=2, tp=2)  # cp 1 (no cp_comm): the docstring's picture
    assert tp_comm[0] == [0, 1] and dp_comm[0] == [0, 2] and pp_comm[0] == [0, 4] and mp_comm[0] == [0, 1, 4, 5]


def test_the_mesh_refuses_cp_that_does_not_divide_and_cp_with_expert_parallelism():
    with pytest.raises(ValueError, match=r"pp=1 x tp=1 x cp=3 does not divide the world size 4"):
        Mesh(_Recording(0, 4), cp=3)
    with pytest.raises(ValueError, match=r"--ep\) and context parallelism \(--cp\) together are not supported"):
        Mesh(_Recording(0, 8), cp=2, ep=2)


def pinned(*flag_strings):
    return [SMALL + f.split() for f in flag_strings]


LLAMA = "--arch llama --n-head 4 --kv-heads 2 --d-model 16"
PINNED = {
    2: pinned("--cp 2",
              "--cp 2 --cp-impl ulysses",
              f"--cp 2 {LLAMA}",
              f"--cp 2 {LLAMA} --cp-impl ulysses",
              "--cp 2 --n-layer 4 --zero 3 --checkpoint sqrt --clip 0",
              "--cp 2 --n-layer 3 --checkpoint auto:memory --optimizer sgd",
              "--cp 2 --grad-accum 2 --zero 2 --collectives ring"),
    4: pinned("--cp 4",
              "--cp 4 --cp-impl ulysses --n-head 4",
              "--cp 2 --tp 2",
              f"--cp 2 --tp 2 --sequence-parallel {LLAMA}",
              "--cp 2 --tp 2 --cp-impl ulysses --n-head 4 --zero 1",
              "--cp 2 --pp 2 --n-layer 2 --schedule 1f1b",
              "--cp 2 --pp 2 --n-layer 2 --schedule zb1p --zero 2",
              "--cp 2 --pp 2 --n-layer 4 --schedule dualpipe --micro-batches 4",
              "--cp 2 --n-layer 4 --zero 3 --checkpoint sqrt --batch-size 8",
              "--cp 2 --cp-impl ulysses --n-layer 4 --zero 3 --checkpoint every:2 --batch-size 8"),
    8: pinned("--cp 2 --tp 2 --zero 1 --batch-size 8",
              "--cp 2 --tp 2 --pp 2 --n-layer 2 --schedule 1f1b",
              "--cp 2 --pp 2 --n-layer 2 --zero 3 --batch-size 8"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("world", sorted(PINNED))
def test_pinned_context_parallel_configurations_equal_single_process_training(world, tmp_path_factory):
    results = verify_many(world, PINNED[world], tmp_path_factory)  # counted in the suite's summary line
    assert all(0 <= r["tolerance_used"] <= 1 for r in results)


@pytest.mark.mpi
def test_a_run_saved_at_cp_2_resumes_at_cp_1_and_cp_4_as_if_uninterrupted(tmp_path):
    common = ["--zero", "1", "--batch-size", "4", "--n-layer", "2", "--dtype", "float64", "--json"]
    saved = run_mpi(2, ["-m", "refimpl", "train", "--cp", "2", "--steps", "4", "--save-dir", tmp_path / "run",
                        "--save-every", "2", *common], timeout=300)
    assert saved.returncode == 0, saved.stderr
    whole = last_json(run_mpi(2, ["-m", "refimpl", "train", "--steps", "6", *common], timeout=300))
    for ranks, cp in ((2, "1"), (4, "4")):
        resumed = last_json(run_mpi(ranks, ["-m", "refimpl", "train", "--cp", cp, "--steps", "6", "--resume",
                                            tmp_path / "run", *common], timeout=300))
        assert resumed["start_step"] == 4
        assert resumed["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-12, abs=0)


@pytest.mark.parametrize("args, expected", [
    (["--cp", "2", "--seq-len", "6"], "a sequence of 6 tokens cannot be cut into 2·2 = 4 equal chunks"),
    (["--cp", "2", "--cp-impl", "ulysses", "--n-head", "3", "--d-model", "24"],
     "the 3 query and 3 key/value heads per tensor-parallel rank must each divide by --cp 2"),
    (["--cp", "2", "--model", "mlp"], "--cp 2 splits a GPT's sequences; the MLP has none"),
    (["--cp", "2", "--dropout", "0.1"], "--cp 2 with --dropout 0.1 is not supported"),
    (["--cp", "2", "--experts", "2"], "--cp 2 with --experts is not supported"),
    (["--cp", "0"], "--cp must be a positive integer"),
    (["--cp", "2"], "mesh: pp=1 x tp=1 x cp=2 does not divide the world size 1"),
])
def test_context_parallel_bad_input_is_one_line(args, expected):
    done = run_local(["-m", "refimpl", "verify", "--steps", "1", *args], timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]


@pytest.mark.mpi
def test_verify_refuses_mixed_precision_with_cp_on_every_rank_in_one_line():
    done = run_mpi(2, ["-m", "refimpl", "verify", "--steps", "1", "--cp", "2", "--dtype", "mixed"], timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "verify --dtype mixed bounds only 16-bit rounding" in lines[0] and "verify --cp in float64" in lines[0]
