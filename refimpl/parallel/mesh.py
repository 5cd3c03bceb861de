"""Ranks laid out as a dp x pp grid, with one sub-communicator per axis.

A job of N = dp * pp ranks runs dp data-parallel replicas of a pipeline of pp stages. Rank
numbering (refimpl's choice; the stage index varies fastest, so each pipeline is a contiguous
range of ranks):

    rank = d * pp + p          d = rank // pp  (data-parallel index, 0..dp-1)
                               p = rank %  pp  (pipeline stage,      0..pp-1)

    dp=2, pp=3:     stage p=0  p=1  p=2
                    d=0   [ 0    1    2 ]   <- pp_comm of replica 0 (one pipeline)
                    d=1   [ 3    4    5 ]
                            ^ dp_comm of stage 0: ranks {0, 3}

  * pp_comm: the pp ranks of one pipeline (same d); its rank is the stage p. Activations and their
    gradients travel here, point to point, every micro-batch.
  * dp_comm: the dp ranks holding the same stage (same p); its rank is the replica d. Gradients
    are all-reduced (or reduce-scattered, ZeRO) here, once per step.

Why contiguous pipelines: with ranks filled node by node, a pipeline's many small, latency-bound
messages stay inside a node as long as pp fits in one. Megatron-LM orders the other way (tensor
and data parallel fastest, pipeline slowest) because its tensor-parallel all-reduces are the
heaviest traffic and must stay inside a node; refimpl has no tensor parallelism.
"""

from __future__ import annotations


class Mesh:
    """The dp x pp grid over `world`. Leave out one of dp, pp and it is inferred; leave out both: dp = N, pp = 1."""

    def __init__(self, world, dp: int | None = None, pp: int | None = None):
        size = world.size
        for name, value in (("dp", dp), ("pp", pp)):
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"mesh: {name} must be a positive integer, not {value!r}")
        if dp is None and pp is None:
            dp, pp = size, 1
        elif dp is None:
            if size % pp:
                raise ValueError(f"mesh: pp={pp} does not divide the world size {size}; "
                                 f"launch a multiple of {pp} ranks")
            dp = size // pp
        elif pp is None:
            if size % dp:
                raise ValueError(f"mesh: dp={dp} does not divide the world size {size}; "
                                 f"launch a multiple of {dp} ranks")
            pp = size // dp
        if dp * pp != size:
            raise ValueError(f"mesh: dp={dp} x pp={pp} needs {dp * pp} ranks, but the world has {size}; "
                             f"launch mpiexec -n {dp * pp}, or choose dp * pp = {size}")
        self.world, self.dp, self.pp = world, dp, pp
        self.dp_index, self.pp_index = self.coords_of(world.rank)  # this rank's (d, p)
        # Both splits are collective over the world: every rank makes them, in this order.
        self.dp_comm = world.split(color=self.pp_index, key=self.dp_index)  # same stage
        self.pp_comm = world.split(color=self.dp_index, key=self.pp_index)  # same replica

    def rank_of(self, d: int, p: int) -> int:
        """World rank of data-parallel replica d, pipeline stage p."""
        if not (0 <= d < self.dp and 0 <= p < self.pp):
            raise ValueError(f"mesh: (d={d}, p={p}) is outside the {self.dp} x {self.pp} grid")
        return d * self.pp + p

    def coords_of(self, rank: int) -> tuple[int, int]:
        """(d, p) of a world rank."""
        if not 0 <= rank < self.dp * self.pp:
            raise ValueError(f"mesh: rank {rank} is outside a world of {self.dp * self.pp}")
        return divmod(rank, self.pp)

    def as_dict(self) -> dict:
        return {"dp": self.dp, "pp": self.pp, "dp_index": self.dp_index, "pp_index": self.pp_index}

    def __repr__(self) -> str:
        return f"Mesh(dp={self.dp}, pp={self.pp}, rank {self.world.rank} = (d={self.dp_index}, p={self.pp_index}))"
