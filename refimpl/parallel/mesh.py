"""Ranks laid out as a pp x dp x tp grid, with one sub-communicator per axis.

A job of N = pp · dp · tp ranks runs dp data-parallel replicas of a pipeline of pp stages, each
stage split over tp tensor-parallel ranks. Rank numbering, Megatron-LM's order (tensor parallel
fastest, then data parallel, pipeline slowest):

    rank = (p · dp + d) · tp + t       t = rank % tp                (tensor-parallel index, 0..tp-1)
                                       d = (rank // tp) % dp        (data-parallel index,   0..dp-1)
                                       p = rank // (tp · dp)        (pipeline stage,        0..pp-1)

    pp=2, dp=2, tp=2:        t=0 t=1            t=0 t=1
                    p=0  d=0 [ 0   1 ]  d=1   [ 2   3 ]     <- tp_comm of (p=0, d=0): ranks {0, 1}
                    p=1  d=0 [ 4   5 ]  d=1   [ 6   7 ]
                         dp_comm of (p=0, t=0): ranks {0, 2};  pp_comm of (d=0, t=0): ranks {0, 4}

  * tp_comm: the tp ranks that hold the shards of the same layers (same p, same d). The model's
    own collectives run here, inside every forward and backward (tensor_parallel/): the heaviest
    and most frequent traffic, so these ranks are neighbours -- filled node by node, they share a
    node and its fastest links (NVLink), as in Megatron-LM.
  * dp_comm: the dp ranks holding the same shard of the same stage (same p, same t); its rank is
    the replica d. Gradients are all-reduced (or reduce-scattered, ZeRO) here, once per step.
  * pp_comm: the pp ranks of one pipeline (same d, same t); its rank is the stage p. Activations
    and their gradients travel here, point to point, every micro-batch.
  * mp_comm: the model-parallel group, the tp · pp ranks that together hold one replica of the
    model (same d): the global gradient norm and the mixed-precision overflow vote add up here.
  * ep_comm, edp_comm (expert parallelism, ep > 1): the data-parallel group is cut into dp/ep
    expert-parallel groups of ep neighbouring replicas, d = e_d · ep + j. ep_comm: the ep replicas
    of one group (same p, t, e_d; its rank is j): tokens travel to their experts here, by
    all-to-all (experts.py). edp_comm: the replicas holding the same experts (same p, t, j; its
    rank is e_d): the experts' gradients are summed here, the other parameters' over dp_comm.

With tp = 1 this is Megatron-LM's dp x pp order too: replica d of stage p is rank p · dp + d, so
the ranks of one pipeline are dp apart. (Later Megatron versions order tp, cp, ep, dp, pp, with
context parallelism, which refimpl does not have, and expert parallelism as an axis of its own;
refimpl's ep groups are neighbouring data-parallel replicas, which gives the same ranks.)
"""

from __future__ import annotations

AXES = ("pp", "dp", "tp")  # slowest to fastest


class Mesh:
    """The pp x dp x tp grid over `world`. tp and pp default to 1; dp, if left out, is what remains."""

    def __init__(self, world, dp: int | None = None, pp: int | None = None, tp: int | None = None, ep: int = 1):
        size = world.size
        for name, value in (("dp", dp), ("pp", pp), ("tp", tp), ("ep", ep)):
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"mesh: {name} must be a positive integer, not {value!r}")
        tp = 1 if tp is None else tp
        if dp is None and pp is None:
            pp = 1
        model = (pp or 1) * tp  # ranks per model replica, when pp is given
        if dp is None:
            if size % model:
                raise ValueError(f"mesh: {_product(pp=pp, tp=tp)} does not divide the world size {size}; "
                                 f"launch a multiple of {model} ranks")
            dp = size // model
        elif pp is None:
            if size % (dp * tp):
                raise ValueError(f"mesh: {_product(dp=dp, tp=tp)} does not divide the world size {size}; "
                                 f"launch a multiple of {dp * tp} ranks")
            pp = size // (dp * tp)
        if dp * pp * tp != size:
            raise ValueError(f"mesh: {_product(dp=dp, tp=tp, pp=pp)} needs {dp * pp * tp} ranks, but the world has "
                             f"{size}; launch mpiexec -n {dp * pp * tp}, or choose dp x tp x pp = {size}")
        if dp % ep:
            raise ValueError(f"mesh: --ep {ep} does not divide the data-parallel degree {dp} (world size {size} / "
                             f"(pp x tp) = {dp}): expert parallelism splits the data-parallel group; choose an --ep "
                             f"that divides {dp}")
        self.world, self.dp, self.pp, self.tp, self.ep = world, dp, pp, tp, ep
        self.dp_index, self.pp_index, self.tp_index = self.coords_of(world.rank)  # this rank's (d, p, t)
        d, p, t = self.dp_index, self.pp_index, self.tp_index
        # Every split is collective over the world: every rank makes them, in this order.
        self.dp_comm = world.split(color=p * tp + t, key=d)  # same stage, same shard
        self.pp_comm = world.split(color=d * tp + t, key=p)  # same replica, same shard
        self.tp_comm = world.split(color=p * dp + d, key=t)  # same stage, same replica
        self.mp_comm = world.split(color=d, key=p * tp + t)  # same replica: one whole model
        if ep > 1:
            group, j = divmod(d, ep)
            self.ep_comm = world.split(color=(p * tp + t) * (dp // ep) + group, key=j)  # tokens to their experts
            self.edp_comm = world.split(color=(p * tp + t) * ep + j, key=group)  # the same experts' replicas
        else:
            self.ep_comm, self.edp_comm = None, self.dp_comm

    def rank_of(self, d: int, p: int, t: int = 0) -> int:
        """World rank of data-parallel replica d, pipeline stage p, tensor-parallel shard t."""
        if not (0 <= d < self.dp and 0 <= p < self.pp and 0 <= t < self.tp):
            raise ValueError(f"mesh: (d={d}, p={p}, t={t}) is outside the dp={self.dp} x pp={self.pp} x "
                             f"tp={self.tp} grid")
        return (p * self.dp + d) * self.tp + t

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(d, p, t) of a world rank."""
        if not 0 <= rank < self.dp * self.pp * self.tp:
            raise ValueError(f"mesh: rank {rank} is outside a world of {self.dp * self.pp * self.tp}")
        replica_row, t = divmod(rank, self.tp)
        p, d = divmod(replica_row, self.dp)
        return d, p, t

    def as_dict(self) -> dict:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "ep": self.ep,
                "dp_index": self.dp_index, "pp_index": self.pp_index, "tp_index": self.tp_index}

    def __repr__(self) -> str:
        return (f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}, rank {self.world.rank} = "
                f"(d={self.dp_index}, p={self.pp_index}, t={self.tp_index}))")


def _product(**sizes) -> str:
    """'pp=2 x tp=2' of the axes given (None: left out)."""
    return " x ".join(f"{name}={value}" for name, value in sizes.items() if value is not None) or "1"
