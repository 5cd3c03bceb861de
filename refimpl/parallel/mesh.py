"""Ranks laid out as a pp x dp x cp x tp grid, with one sub-communicator per axis.

A job of N = pp · dp · cp · tp ranks runs dp data-parallel replicas of a pipeline of pp stages, each
stage split over tp tensor-parallel ranks, and each sequence over cp context-parallel ranks. Rank
numbering, Megatron-LM's order (tensor parallel fastest, then context, then data parallel, pipeline
slowest):

    rank = ((p · dp + d) · cp + c) · tp + t     t = rank % tp               (tensor-parallel index, 0..tp-1)
                                                c = (rank // tp) % cp       (context-parallel index, 0..cp-1)
                                                d = (rank // (tp·cp)) % dp  (data-parallel index,   0..dp-1)
                                                p = rank // (tp · cp · dp)  (pipeline stage,        0..pp-1)

    pp=2, dp=2, tp=2 (cp=1):   t=0 t=1            t=0 t=1
                    p=0  d=0 [ 0   1 ]  d=1   [ 2   3 ]     <- tp_comm of (p=0, d=0): ranks {0, 1}
                    p=1  d=0 [ 4   5 ]  d=1   [ 6   7 ]
                         dp_comm of (p=0, t=0): ranks {0, 2};  pp_comm of (d=0, t=0): ranks {0, 4}

  * tp_comm: the tp ranks that hold the shards of the same layers (same p, d, c). The model's
    own collectives run here, inside every forward and backward (tensor_parallel/): the heaviest
    and most frequent traffic, so these ranks are neighbours -- filled node by node, they share a
    node and its fastest links (NVLink), as in Megatron-LM.
  * cp_comm: the cp ranks that hold the shards of the same sequences (same p, d, t; its rank is
    c): the keys and values of attention travel here, every layer (context_parallel/). Next to
    tp, so that tp · cp ranks fill a node first.
  * dp_comm: the ranks holding the same shard of the same stage (same p, t): the dp replicas and,
    since parameters are replicated over cp, each replica's cp ranks too -- dp · cp ranks, ordered
    by d · cp + c. Gradients are all-reduced (or reduce-scattered and sharded, ZeRO) here, once per
    step: each cp rank's gradient is its shard of the sequence's contribution, and the sum over
    dp · cp is the whole batch's (Megatron-LM reduces over its data-and-context group likewise).
  * pp_comm: the pp ranks of one pipeline (same d, c, t); its rank is the stage p. Activations
    and their gradients travel here, point to point, every micro-batch.
  * mp_comm: the model-parallel group, the tp · pp ranks that together hold one replica of the
    model (same d, c): the global gradient norm and the mixed-precision overflow vote add up here.
  * ep_comm, edp_comm (expert parallelism, ep > 1, cp = 1): the data-parallel group is cut into
    dp/ep expert-parallel groups of ep neighbouring replicas, d = e_d · ep + j. ep_comm: the ep
    replicas of one group (same p, t, e_d; its rank is j): tokens travel to their experts here, by
    all-to-all (experts.py). edp_comm: the replicas holding the same experts (same p, t, j; its
    rank is e_d): the experts' gradients are summed here, the other parameters' over dp_comm.

With tp = cp = 1 this is Megatron-LM's dp x pp order too: replica d of stage p is rank p · dp + d,
so the ranks of one pipeline are dp apart. (Megatron-LM orders tp, cp, ep, dp, pp, with expert
parallelism as an axis of its own; refimpl's ep groups are neighbouring data-parallel replicas,
which gives the same ranks, and are not combined with cp.)
"""

from __future__ import annotations

AXES = ("pp", "dp", "cp", "tp")  # slowest to fastest


class Mesh:
    """The pp x dp x cp x tp grid over `world`. tp, cp and pp default to 1; dp, if left out, is what remains."""

    def __init__(self, world, dp: int | None = None, pp: int | None = None, tp: int | None = None, ep: int = 1,
                 cp: int = 1):
        size = world.size
        for name, value in (("dp", dp), ("pp", pp), ("tp", tp), ("ep", ep), ("cp", cp)):
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"mesh: {name} must be a positive integer, not {value!r}")
        tp = 1 if tp is None else tp
        if dp is None and pp is None:
            pp = 1
        model = (pp or 1) * tp * cp  # ranks per model replica, when pp is given
        if dp is None:
            if size % model:
                raise ValueError(f"mesh: {_product(pp=pp, tp=tp, cp=cp if cp > 1 else None)} does not divide the "
                                 f"world size {size}; launch a multiple of {model} ranks")
            dp = size // model
        elif pp is None:
            if size % (dp * tp * cp):
                raise ValueError(f"mesh: {_product(dp=dp, tp=tp, cp=cp if cp > 1 else None)} does not divide the world "
                                 f"size {size}; launch a multiple of {dp * tp * cp} ranks")
            pp = size // (dp * tp * cp)
        if dp * pp * tp * cp != size:
            axes = "dp x tp x pp" + (" x cp" if cp > 1 else "")
            raise ValueError(f"mesh: {_product(dp=dp, tp=tp, pp=pp, cp=cp if cp > 1 else None)} needs "
                             f"{dp * pp * tp * cp} ranks, but the world has {size}; launch mpiexec -n "
                             f"{dp * pp * tp * cp}, or choose {axes} = {size}")
        if dp % ep:
            raise ValueError(f"mesh: --ep {ep} does not divide the data-parallel degree {dp} (world size {size} / "
                             f"(pp x tp) = {dp}): expert parallelism splits the data-parallel group; choose an --ep "
                             f"that divides {dp}")
        if ep > 1 and cp > 1:
            raise ValueError("mesh: expert parallelism (--ep) and context parallelism (--cp) together are not "
                             "supported: refimpl's expert-parallel groups are data-parallel replicas; use one of them")
        self.world, self.dp, self.pp, self.tp, self.ep, self.cp = world, dp, pp, tp, ep, cp
        self.dp_index, self.pp_index, self.tp_index = self.coords_of(world.rank)  # this rank's (d, p, t)
        self.cp_index = (world.rank // tp) % cp  # c
        d, p, t, c = self.dp_index, self.pp_index, self.tp_index, self.cp_index
        # Every split is collective over the world: every rank makes them, in this order.
        self.dp_comm = world.split(color=p * tp + t, key=d * cp + c)  # same stage, same shard: dp x cp ranks
        self.pp_comm = world.split(color=(d * cp + c) * tp + t, key=p)  # same replica, same shard
        self.tp_comm = world.split(color=(p * dp + d) * cp + c, key=t)  # same stage, same replica, same tokens
        self.mp_comm = world.split(color=d * cp + c, key=p * tp + t)  # same replica and tokens: one whole model
        self.cp_comm = world.split(color=(p * dp + d) * tp + t, key=c) if cp > 1 else None  # same layers, same rows
        if ep > 1:
            group, j = divmod(d, ep)
            self.ep_comm = world.split(color=(p * tp + t) * (dp // ep) + group, key=j)  # tokens to their experts
            self.edp_comm = world.split(color=(p * tp + t) * ep + j, key=group)  # the same experts' replicas
        else:
            self.ep_comm, self.edp_comm = None, self.dp_comm

    def rank_of(self, d: int, p: int, t: int = 0, c: int = 0) -> int:
        """World rank of data-parallel replica d, pipeline stage p, tensor-parallel shard t, context shard c."""
        if not (0 <= d < self.dp and 0 <= p < self.pp and 0 <= t < self.tp and 0 <= c < self.cp):
            point, cp = (f", c={c}", f" x cp={self.cp}") if self.cp > 1 else ("", "")
            raise ValueError(f"mesh: (d={d}, p={p}, t={t}{point}) is outside the dp={self.dp} x pp={self.pp} x "
                             f"tp={self.tp}{cp} grid")
        return ((p * self.dp + d) * self.cp + c) * self.tp + t

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(d, p, t) of a world rank (its c: (rank // tp) % cp)."""
        if not 0 <= rank < self.dp * self.pp * self.tp * self.cp:
            raise ValueError(f"mesh: rank {rank} is outside a world of {self.dp * self.pp * self.tp * self.cp}")
        replica_row, t = divmod(rank, self.tp * self.cp)
        p, d = divmod(replica_row, self.dp)
        return d, p, t % self.tp

    @property
    def leads_replica(self) -> bool:
        """Whether this rank is context shard 0 of data-parallel replica 0 (writes whole groups, records)."""
        return self.dp_index == 0 and self.cp_index == 0

    def as_dict(self) -> dict:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "ep": self.ep, "cp": self.cp,
                "dp_index": self.dp_index, "pp_index": self.pp_index, "tp_index": self.tp_index,
                "cp_index": self.cp_index}

    def __repr__(self) -> str:
        return (f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}, cp={self.cp}, rank {self.world.rank} = "
                f"(d={self.dp_index}, p={self.pp_index}, t={self.tp_index}, c={self.cp_index}))")


def _product(**sizes) -> str:
    """'pp=2 x tp=2' of the axes given (None: left out)."""
    return " x ".join(f"{name}={value}" for name, value in sizes.items() if value is not None) or "1"
