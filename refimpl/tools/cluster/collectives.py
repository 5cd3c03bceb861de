"""The α–β model of collectives: how long a message or a collective takes on a cluster.

A message of n bytes over one link costs α + n/β (Hockney). The collectives are the ring
algorithms refimpl runs (parallel/ring.py) and NCCL uses for large messages; over a group of g
ranks, each rank holding n bytes (Thakur, Rabenseifner and Gropp 2005; Patarasuk and Yuan 2009):

    all-reduce        2(g − 1)(α + n/(gβ))      reduce-scatter, then all-gather
    reduce-scatter    (g − 1)(α + n/(gβ))       n: the whole buffer, each rank keeps n/g
    all-gather        (g − 1)(α + n/(gβ))       n: the whole buffer, each rank brings n/g
    all-to-all        (g − 1)(α + n/(gβ))       each rank sends n/g to each other rank (pairwise)

Where a group lies matters. Ranks are laid out as in parallel/mesh.py, tp innermost: a group
whose members sit k to a node (k = g: inside one node; k = 1: one per node) runs
hierarchically (NCCL's tree-of-rings idea, Megatron-LM's and DeepSpeed's layouts): the k members
of a node reduce-scatter over NVLink, every GPU then all-reduces its 1/k share with its peers on
the other g/k nodes over its own network card, and the node all-gathers again:

    all-reduce        2(k − 1)(α_in + n/(kβ_in)) + 2(g/k − 1)(α_out + n/(gβ_out))
    reduce-scatter,
    all-gather        (k − 1)(α_in + n/(kβ_in)) + (g/k − 1)(α_out + n/(gβ_out))
    all-to-all        (k − 1)(α_in + n/(gβ_in)) + (g − k)(α_out + n/(gβ_out))

(with k = g the second terms vanish, with k = 1 the first). β is the link's bandwidth times the
efficiency the model states (a collective does not reach the link's peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Cluster


@dataclass(frozen=True)
class Group:
    """g ranks of a collective, k of them in each node."""

    size: int
    per_node: int

    @staticmethod
    def of(size: int, stride: int, cluster: Cluster) -> Group:
        """The group of `size` ranks whose global ranks are `stride` apart (mesh.py's layout)."""
        per_node = max(1, min(size, cluster.gpus_per_node // stride)) if stride <= cluster.gpus_per_node else 1
        return Group(size, per_node)


@dataclass(frozen=True)
class Links:
    """The two links' α and effective β (bandwidth × efficiency)."""

    alpha_in: float
    beta_in: float
    alpha_out: float
    beta_out: float

    @staticmethod
    def of(cluster: Cluster, efficiency: float) -> Links:
        return Links(cluster.intra_latency, cluster.intra_bandwidth * efficiency,
                     cluster.inter_latency, cluster.inter_bandwidth * efficiency)

    # -- one collective, n bytes per rank --------------------------------------------------------
    def _two_levels(self, n: float, group: Group, rounds: int) -> float:
        g, k = group.size, group.per_node
        if g <= 1 or n <= 0:
            return 0.0
        inside = (k - 1) * (self.alpha_in + n / (k * self.beta_in))
        across = (g // k - 1) * (self.alpha_out + n / (g * self.beta_out))
        return rounds * (inside + across)

    def allreduce(self, n: float, group: Group) -> float:
        return self._two_levels(n, group, 2)

    def reduce_scatter(self, n: float, group: Group) -> float:
        return self._two_levels(n, group, 1)

    def allgather(self, n: float, group: Group) -> float:
        return self._two_levels(n, group, 1)

    def all_to_all(self, n: float, group: Group) -> float:
        g, k = group.size, group.per_node
        if g <= 1 or n <= 0:
            return 0.0
        return (k - 1) * (self.alpha_in + n / (g * self.beta_in)) + (g - k) * (self.alpha_out + n / (g * self.beta_out))

    def send(self, n: float, across_nodes: bool) -> float:
        """One point-to-point message of n bytes."""
        if n <= 0:
            return 0.0
        return self.alpha_out + n / self.beta_out if across_nodes else self.alpha_in + n / self.beta_in
