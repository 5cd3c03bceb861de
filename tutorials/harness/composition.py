"""Checks for tutorial 09 (everything together): the pp x dp x tp grid, the split of the layers into
stages, and which ranks sum a stage's gradients."""

from __future__ import annotations

from itertools import permutations

from refimpl.parallel.mesh import Mesh
from refimpl.parallel.pipeline import build
from refimpl.parallel.pipeline.stage import stage_sizes

from . import Wrong, shown, plain


class _World:
    """Just enough of a communicator for Mesh to lay out its grid (no sub-communicators)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def split(self, color, key=None):
        return None


# (dp, pp, tp) shapes for exercise 1: tp = 1 first (where the old pp-fastest order is caught), then tp > 1
MESH_SHAPES = [(1, 1, 1), (2, 3, 1), (3, 2, 1), (1, 4, 1), (4, 1, 1), (1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 2),
               (3, 2, 2), (2, 3, 2), (2, 2, 3), (1, 3, 2), (3, 1, 2)]
_INDEX = {"pp": "p", "dp": "d", "tp": "t"}


def _numbering(order: tuple, dp: int, pp: int, tp: int) -> dict:
    """{rank: (d, p, t)} when the ranks are numbered with the axes in `order`, slowest first."""
    size = {"dp": dp, "pp": pp, "tp": tp}
    table = {}
    for rank in range(dp * pp * tp):
        index, rest = {}, rank
        for axis in reversed(order):  # fastest first
            rest, index[axis] = divmod(rest, size[axis])
        table[rank] = (index["dp"], index["pp"], index["tp"])
    return table


def _formula(order: tuple, dp: int, pp: int, tp: int) -> str:
    """'rank = (d·pp + p)·tp + t' for the axes in `order` (slowest first), leaving out axes of size 1."""
    size = {"dp": dp, "pp": pp, "tp": tp}
    text = ""
    for axis in (a for a in order if size[a] > 1):
        if not text:
            text = _INDEX[axis]
        else:
            outer = f"({text})" if "+" in text else text
            text = f"{outer}·{axis} + {_INDEX[axis]}"
    return "rank = " + (text or "0")


def _slowest_to_fastest(order: tuple, dp: int, pp: int, tp: int) -> str:
    size = {"dp": dp, "pp": pp, "tp": tp}
    return ", ".join(a for a in order if size[a] > 1)


def check_mesh_coordinates(mesh_coordinates) -> None:
    """Check: a rank's place in the pp x dp x tp grid."""
    megatron = ("pp", "dp", "tp")  # slowest to fastest: refimpl.parallel.mesh.AXES
    for dp, pp, tp in MESH_SHAPES:
        n = dp * pp * tp
        shape = f"dp={dp}, pp={pp}, tp={tp}"
        expected, got = {}, {}
        for rank in range(n):
            mesh = Mesh(_World(rank, n), dp=dp, pp=pp, tp=tp)
            expected[rank] = (mesh.dp_index, mesh.pp_index, mesh.tp_index)
            answer = mesh_coordinates(rank, dp, pp, tp)
            try:
                got[rank] = tuple(int(i) for i in answer)
            except TypeError:
                raise Wrong(f"{shape}: return the three indices (d, p, t) of rank {rank}; you returned "
                            f"{shown(answer)}") from None
            if len(got[rank]) != 3:
                raise Wrong(f"{shape}: return three indices (d, p, t) -- replica, stage, tensor-parallel shard -- "
                            f"not {len(got[rank])}; you said {plain(got[rank])} for rank {rank}")
        if got == expected:
            continue
        for order in permutations(megatron):  # a whole table in another order: name that order
            if order != megatron and got == _numbering(order, dp, pp, tp):
                old = " (the old dp x pp layout, stage fastest)" if tp == 1 and order.index("pp") > order.index("dp") else ""
                raise Wrong(f"{shape}: you numbered the ranks {_formula(order, dp, pp, tp)}, axes slowest to fastest "
                            f"{_slowest_to_fastest(order, dp, pp, tp)}{old}; refimpl uses Megatron-LM's order, "
                            f"tensor parallel fastest, then data parallel, pipeline slowest: "
                            f"{_formula(megatron, dp, pp, tp)}")
        rank = next(r for r in range(n) if got[r] != expected[r])
        d, p, t = expected[rank]
        raise Wrong(f"{shape}: rank {rank} is replica d={d}, stage p={p}, tensor-parallel shard t={t}, that is "
                    f"(d, p, t) = {expected[rank]}; you said {plain(got[rank])}")


def check_stage_layers(stage_layers) -> None:
    """Check: layers per pipeline stage."""
    for layers in (1, 4, 7, 8, 10):
        for stages in range(1, layers + 1):
            expected = stage_sizes(layers, stages)
            got = list(stage_layers(layers, stages))
            if got != expected:
                raise Wrong(f"{layers} layers over {stages} stages are split {expected}; you said {plain(got)}")


def reference_gradient_group(rank: int, dp: int, pp: int, schedule: str) -> list[int]:
    """The world ranks that sum their gradients with `rank` (as the trainer forms the group; tp = 1):
    the data-parallel group of every pipeline rank holding the same stages."""
    placement = build(schedule, pp, 2 * pp).placement
    primary = {s: min(placement.ranks_of(s)) for s in range(placement.num_stages)}  # pipeline rank
    mesh = Mesh(_World(0, dp * pp), dp=dp, pp=pp)

    def color(world_rank):
        _, p, _ = mesh.coords_of(world_rank)  # its pipeline rank
        return min(primary[s] for s in placement.stages_of(p))

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
                                f"them sorted, in increasing order: {expected}; you said {plain(got)}")
                if got != expected:
                    raise Wrong(f"{schedule}, dp={dp}, pp={pp}: rank {rank} sums its gradients with ranks {expected} "
                                f"(every rank that holds the same stages); you said {plain(got)}")
