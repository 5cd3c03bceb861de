"""Context parallelism in the cost model: one attention layer on C ranks, its time, bytes and memory.

With `cp` = C > 1 every sequence is cut over C ranks (parallel/context_parallel/layout.py: 2C
chunks of c = T/(2C) tokens, rank r holding chunks r and 2C − 1 − r, the balanced layout). Each rank
runs every layer on its T/C tokens; only attention needs the other ranks' keys and values. The
counts below are refimpl's own, imported, never restated: the score elements a rank computes
(accounting.score_elements, with the causal skip: b·H·(2C + 1)·c² per layer, the same on every rank)
and the bytes it sends (accounting.ring_bytes, accounting.ulysses_bytes), for the H = a/tp query
heads and Hkv = K/tp key/value heads of one tensor-parallel rank and its micro-batch of b sequences
(GPT-2's block and multi-head attention: Hkv = H; the Llama block's grouped-query attention:
K = --kv-heads, so its K/V blocks and their all-to-alls are a/K times smaller).

Where the cp group lies (parallel/mesh.py, Megatron-LM's order: tp fastest, then cp, then dp,
then pp): the cp ranks of a sequence are tp apart, so with tp · cp ≤ GPUs per node the whole group
sits inside one node and talks over NVLink; otherwise it spans nodes (collectives.Group.of(cp, tp)),
the ring crosses the network and is paced by its slowest hop, the one between nodes.

Ring attention (ring_attention.py), per layer. At step t = 0 … C − 1 a rank computes its queries
against the block it holds, after first posting the transfer of that block to the next rank. On
every hop some rank sends its whole block (two chunks' K and V, 2·k bytes, k = 2·b·Hkv·c·D·e; with
the causal skip only some ranks send less: tests check this against ring_attention.chunks_sent),
and the ring moves as fast as its slowest rank, so a hop takes h = send(2k). With u_t the attention
products of step t (3 chunk pairs of c² scores against the rank's own block at t = 0, 2 against
every other block; blockwise.pair_kind) at the attention rate:

    forward    Σ_{t < C−1} max(u_t, h) + u_{C−1}          the first transfer is posted before the
                                                           first block; the last step sends nothing
    backward   Σ_{t < C−1} max(2.5·u_t, h) + 2.5·u_{C−1} + (C − 1)·h

Backward recomputes each block's scores (0.5·u_t, FlashAttention's backward; counted as
recomputation) and computes the four gradient products (2·u_t); the K/V transfer is posted before
the block as in forward, but each dK/dV transfer leaves only after the block's contribution is added,
so nothing hides it: C − 1 exposed hops. What is not hidden is reported as cp communication.

Ulysses (ulysses.py), per layer: all-to-alls of q, k, v before attention and of the output after
(four: q and the output of b·(T/C)·H·D·e bytes per rank, k and v of b·(T/C)·Hkv·D·e, (C − 1)/C of
which leave it), and four in backward, on the network and not overlapped: 2 · all_to_all(q) +
2 · all_to_all(k) each way (4 · all_to_all(q) when Hkv = H). Attention itself runs on H/C heads of whole
sequences, in 2C chunks with the causal skip: the same score count as the ring's.

Memory per rank: the blocks save what saved_elements_per_block counts for T/C tokens without the
attention scores (the blockwise attention never keeps probabilities: its saved q, k, v and output
are already in that count), plus the log-sum-exp, b·H·(T/C): linear in T/C, so C ranks hold 1/C
each. The working set is one chunk pair's scores and probabilities (2·b·H'·c²·e, H' = H for the
ring, H/C for Ulysses) instead of the T×T scores; buffers add the ring's four blocks in flight (the
arriving K/V, the travelling, arriving and owner's dK/dV: 4 · 2k) or Ulysses' four head-sharded
arrays.

At cp = 1 nothing here is used: refimpl's attention is then the dense one (every score of the T×T
product computed and masked, the model's 4·N·T·h/tp), so the step from cp 1 to cp 2 also drops the
masked half of the scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from refimpl.parallel.context_parallel.accounting import AttentionShape, ring_bytes, score_elements, ulysses_bytes
from refimpl.parallel.context_parallel.blockwise import EMPTY, pair_kind
from refimpl.parallel.context_parallel.gpt import IMPLEMENTATIONS, check_options
from refimpl.parallel.context_parallel.layout import rank_chunks

from .collectives import Group, Links
from .hardware import Cluster

LAYOUT = "balanced"
BACKWARD_PRODUCTS = 2.0  # dv, dp, dq, dk: twice the forward's two products
RECOMPUTED_PRODUCTS = 0.5  # the scores q kᵀ again: half the forward's products
RING_BUFFER_BLOCKS = 4  # the arriving K/V, the travelling, arriving and owner's dK/dV


def check(run) -> None:
    """One-line ValueErrors for a context-parallel configuration the model cannot run: refimpl's own
    rules (context_parallel/gpt.py), except dropout, which the model prices (systems such as
    Megatron-LM run it with cp; refimpl refuses it because its masks follow global positions)."""
    check_options(run.cp, run.cp_impl, run.seq_len, run.n_head, run.key_value_heads, run.tp, experts=run.experts)


def shape(run, itemsize: int) -> AttentionShape:
    """One attention call of one tensor-parallel rank: its a/tp query heads and K/tp key/value heads, one
    micro-batch."""
    heads = run.n_head // run.tp
    return AttentionShape(batch=run.micro_batch_size, heads=heads, kv_heads=run.key_value_heads // run.tp,
                          seq_len=run.seq_len,
                          d_head=run.d_model // run.n_head, ranks=run.cp, itemsize=itemsize)


@lru_cache(maxsize=64)
def ring_pairs(C: int) -> tuple[int, ...]:
    """Chunk pairs rank 0 computes at each step t = 0 … C − 1 (balanced: every rank the same)."""
    mine = rank_chunks(C, 0, LAYOUT)
    return tuple(sum(pair_kind(i, j) != EMPTY for i in mine for j in rank_chunks(C, (-t) % C, LAYOUT))
                 for t in range(C))


def group(run, cluster: Cluster) -> Group:
    """The cp ranks of a sequence: cp of them, tp apart (mesh.py)."""
    return Group.of(run.cp, run.tp, cluster)


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of one layer's attention on one rank and micro-batch (cp > 1)."""

    scores: int  # score elements computed in forward (accounting.score_elements)
    flops: float  # the forward's attention products: 4·D per score element
    forward_exposed: float  # cp communication the forward waits for
    backward_exposed: float  # and the backward


def layer_times(run, cluster: Cluster, links: Links, core_rate: float, itemsize: int) -> LayerTimes:
    """The attention of one layer (module docstring)."""
    one = shape(run, itemsize)
    scores = score_elements(one, 0, run.cp_impl, LAYOUT, causal_skip=True)["computed"]
    flops = 4 * one.d_head * scores
    C, cp_group = run.cp, group(run, cluster)
    if run.cp_impl == "ulysses":
        buffer = one.batch * (one.seq_len // C) * one.heads * one.d_head * itemsize  # q or y of the shard
        kv_buffer = one.batch * (one.seq_len // C) * one.kv_heads * one.d_head * itemsize  # k or v (Hkv heads)
        exchanges = 2 * links.all_to_all(buffer, cp_group) + 2 * links.all_to_all(kv_buffer, cp_group)
        return LayerTimes(scores, flops, exchanges, exchanges)
    hop = links.send(2 * one.chunk_kv_bytes, across_nodes=cp_group.per_node < C)
    pair = 4 * one.d_head * one.batch * one.heads * one.chunk ** 2 / core_rate  # one chunk pair's products
    steps = [p * pair for p in ring_pairs(C)]
    backward = BACKWARD_PRODUCTS + RECOMPUTED_PRODUCTS
    forward_exposed = sum(max(0.0, hop - u) for u in steps[:-1])
    backward_exposed = sum(max(0.0, hop - backward * u) for u in steps[:-1]) + (C - 1) * hop
    return LayerTimes(scores, flops, forward_exposed, backward_exposed)


def bytes_per_layer(run, itemsize: int) -> dict:
    """{"forward", "backward"}: the most bytes any cp rank sends in one layer's attention (accounting.py)."""
    one = shape(run, itemsize)
    if run.cp_impl == "ulysses":
        return ulysses_bytes(one)
    per_rank = [ring_bytes(one, r, LAYOUT, causal_skip=True) for r in range(run.cp)]
    return {kind: max(b[kind] for b in per_rank) for kind in ("forward", "backward")}


def saved_elements(run) -> int:
    """Elements of one layer's attention that blockwise attention saves beyond the block's q, k, v and
    output: the log-sum-exp, b·H·(T/C)."""
    return run.micro_batch_size * (run.n_head // run.tp) * (run.seq_len // run.cp)


def working_elements(run) -> int:
    """One chunk pair's scores and probabilities: 2·b·H'·c² (H' = H for the ring, H/C for Ulysses)."""
    heads = run.n_head // run.tp // (run.cp if run.cp_impl == "ulysses" else 1)
    c = run.seq_len // (2 * run.cp)
    return 2 * run.micro_batch_size * heads * c * c


def buffer_bytes(run, itemsize: int) -> int:
    """The ring's blocks in flight, or Ulysses' head-sharded q, k, v and output."""
    one = shape(run, itemsize)
    if run.cp_impl == "ulysses":
        return 2 * (one.heads + one.kv_heads) * one.batch * (one.seq_len // run.cp) * one.d_head * itemsize
    return RING_BUFFER_BLOCKS * 2 * one.chunk_kv_bytes


__all__ = ["IMPLEMENTATIONS", "LAYOUT", "check", "shape", "ring_pairs", "group", "LayerTimes", "layer_times",
           "bytes_per_layer", "saved_elements", "working_elements", "buffer_bytes"]
