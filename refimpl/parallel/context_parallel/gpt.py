"""The GPT over C context-parallel ranks: every layer on this rank's shard of each sequence.

Context parallelism (Megatron-LM's; Liu et al. 2023 for the ring, Jacobs et al. 2023 for Ulysses)
cuts each sequence of T tokens into 2C chunks, rank c of the group holding two of them (layout.py,
balanced: chunks c and 2C − 1 − c). Everything but attention works token by token, so every rank
runs the embedding, the layer norms, the MLPs and the head on its T/C tokens alone:

    x_c     = wte[idx_c] + wpe[positions_c]       (b, T/C, C)   positions: the tokens' global indices
    block:  x_c + attention(x_c | every rank's keys and values), then x_c + mlp(x_c)
    loss_c  = Σ over this rank's targets of −log p / (the global batch's target count)

Attention needs every earlier token's keys and values: `attention` runs ring attention
(ring_attention.py: the key/value blocks travel around the group) or Ulysses (ulysses.py: all-to-all
from sequence shards to head shards and back). Llama's rotary embeddings rotate by the same global
positions. The parameters are whole on every rank; each rank's gradient is the contribution of its
tokens, and the sum over the group is the whole sequence's: the trainer reduces gradients over the
data-parallel and context-parallel ranks together (mesh.py's dp_comm), as data parallelism sums
over replicas. The loss of each rank is its share; their sum is the batch's loss.

With tensor parallelism each rank's tokens are split again by sequence parallelism's shards (the
embedding takes its share of the rank's positions). Not modelled: dropout (its masks would have to
follow global positions; refused) and mixtures of experts (their load-balancing loss averages over
each rank's own tokens; refused).
"""

from __future__ import annotations

from refimpl import backend
from refimpl.parallel.context_parallel.layout import check_sequence, positions, shard
from refimpl.parallel.context_parallel.ring_attention import ring_attention
from refimpl.parallel.context_parallel.ulysses import ulysses_attention

IMPLEMENTATIONS = ("ring", "ulysses")


def check_options(cp: int, impl: str, seq_len: int, n_head: int, kv_heads: int, tp: int = 1, model: str = "gpt",
                  dropout: float = 0.0, experts: int = 0) -> None:
    """One-line ValueErrors for a context-parallel run that cannot work, each saying how to fix it."""
    if not (isinstance(cp, int) and cp >= 1):
        raise ValueError(f"--cp must be a positive integer (context-parallel ranks per sequence), got {cp!r}")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown --cp-impl {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    if cp == 1:
        return
    if model != "gpt":
        raise ValueError(f"--cp {cp} splits a GPT's sequences; the MLP has none: use it with --model gpt")
    check_sequence(seq_len, cp)
    if dropout:
        raise ValueError(f"--cp {cp} with --dropout {dropout} is not supported: the dropout masks would have to follow "
                         "each token's global position across ranks; use --dropout 0")
    if experts:
        raise ValueError(f"--cp {cp} with --experts is not supported: the load-balancing loss averages over each "
                         "rank's own tokens, not the sequence's; use --cp 1 with experts")
    if impl == "ulysses" and ((n_head // tp) % cp or (kv_heads // tp) % cp):
        raise ValueError(f"--cp-impl ulysses gives each of the {cp} ranks a share of the heads: the {n_head // tp} "
                         f"query and {kv_heads // tp} key/value heads per tensor-parallel rank must each divide by "
                         f"--cp {cp}; use --cp-impl ring, or a --cp that divides them")


class ContextParallel:
    """This rank's place in the context-parallel group: its tokens' positions and attention over the group."""

    def __init__(self, comm, impl: str = "ring", layout: str = "balanced") -> None:
        self.comm, self.impl, self.layout = comm, impl, layout
        self.ranks, self.rank = comm.size, comm.rank

    def positions(self, tokens: int):
        """(tokens,) the global positions of this rank's `tokens` = T/C tokens, in its shard's order."""
        return backend.asarray(positions(tokens * self.ranks, self.ranks, self.rank, self.layout))

    def shard(self, x):
        """This rank's tokens of a global (b, T) array of token ids or targets: (b, T/C)."""
        return shard(x, self.ranks, self.rank, axis=1, layout=self.layout)

    def attention(self, q, k, v):
        """q (b, H, T/C, D), k, v (b, Hkv, T/C, D) of this rank's tokens -> its output (b, H, T/C, D)."""
        run = ring_attention if self.impl == "ring" else ulysses_attention
        return run(q, k, v, self.comm, layout=self.layout)


def apply_context_parallelism(model, comm, impl: str = "ring", tp: int = 1) -> ContextParallel:
    """Make `model` (a GPT, whole on every rank, its tp tensor-parallel slices already cut) run on
    this rank's shard of each sequence: its embedding's positions and every block's attention."""
    c = model.config
    check_options(comm.size, impl, c.seq_len, c.n_head, c.n_kv_heads, tp=tp, dropout=c.dropout, experts=c.n_experts)
    context = ContextParallel(comm, impl)
    model.context = context
    for block in model.blocks:
        block.attn.context = context
    return context


__all__ = ["IMPLEMENTATIONS", "ContextParallel", "apply_context_parallelism", "check_options"]
