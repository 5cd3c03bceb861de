"""Checks for tutorial 09 (everything together): the dp x pp grid, the split of the layers into
stages, and which ranks sum a stage's gradients."""

from __future__ import annotations

from refimpl.parallel.mesh import Mesh
from refimpl.parallel.pipeline import build
from refimpl.parallel.pipeline.stage import stage_sizes

from . import Wrong


class _World:
    """Just enough of a communicator for Mesh to lay out its grid (no sub-communicators)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def split(self, color, key=None):
        return None


def check_mesh_coordinates(mesh_coordinates) -> None:
    """Check: a rank's place in the dp x pp grid."""
    for dp, pp in [(1, 1), (2, 2), (2, 3), (3, 2), (1, 4), (4, 1)]:
        for rank in range(dp * pp):
            mesh = Mesh(_World(rank, dp * pp), dp=dp, pp=pp)
            expected = (mesh.dp_index, mesh.pp_index)
            got = tuple(mesh_coordinates(rank, dp, pp))
            if got != expected:
                raise Wrong(f"dp={dp}, pp={pp}: rank {rank} is replica d={expected[0]}, stage p={expected[1]} "
                            f"(rank = d * pp + p); you said {got}")


def check_stage_layers(stage_layers) -> None:
    """Check: layers per pipeline stage."""
    for layers in (1, 4, 7, 8, 10):
        for stages in range(1, layers + 1):
            expected = stage_sizes(layers, stages)
            got = list(stage_layers(layers, stages))
            if got != expected:
                raise Wrong(f"{layers} layers over {stages} stages are split {expected}; you said {got}")


def reference_gradient_group(rank: int, dp: int, pp: int, schedule: str) -> list[int]:
    """The world ranks that sum their gradients with `rank` (as PipelineTrainer forms the group)."""
    placement = build(schedule, pp, 2 * pp).placement
    primary = {s: min(placement.ranks_of(s)) for s in range(placement.num_stages)}  # pipeline rank

    def color(world_rank):
        return min(primary[s] for s in placement.stages_of(world_rank % pp))

    return [r for r in range(dp * pp) if color(r) == color(rank)]


def check_gradient_group(gradient_group) -> None:
    """Check: the ranks that sum a stage's gradients."""
    for schedule in ("1f1b", "zbv", "dualpipe"):
        for dp, pp in [(1, 2), (2, 2), (2, 4), (3, 4)]:
            for rank in range(dp * pp):
                expected = reference_gradient_group(rank, dp, pp, schedule)
                got = list(gradient_group(rank, dp, pp, schedule))
                if sorted(got) == expected and got != expected:
                    raise Wrong(f"{schedule}, dp={dp}, pp={pp}: rank {rank}'s group is the right ranks, but return "
                                f"them sorted, in increasing order: {expected}; you said {got}")
                if got != expected:
                    raise Wrong(f"{schedule}, dp={dp}, pp={pp}: rank {rank} sums its gradients with ranks {expected} "
                                f"(every rank that holds the same stages); you said {got}")
