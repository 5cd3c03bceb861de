"""Tensor parallelism's exact accounting: bytes sent per step, activations saved per block, parameters per rank.

The formulas the counters (parallel/comm.py), the saved-tensor ledger (autograd/saved.py) and the
memory ledger must match, byte for byte (tests/test_tensor_parallel.py; the tables of
docs/tensor_parallel.md are printed by `python -m refimpl tensor-parallel`).

1. Communication.

One rank of a group of t, ring counting (parallel/comm.py): an all-reduce of E elements sends
2E(t−1)/t of them, a reduce-scatter or all-gather of E elements (the whole buffer) E(t−1)/t.
For one micro-batch of N = b·T tokens of width C through L transformer blocks (a whole model; a
pipeline stage counts its own blocks, and the embedding or head only where it holds them):

    without sequence parallelism (Shoeybi et al. 2019, §3: "2 all-reduces in forward, 2 in backward")
        forward    g: embedding, and 2 per block (attention, MLP)          all-reduce (2L + 1)·N·C
        backward   f: 2 per block (qkv, MLP fc), and the head's input      all-reduce (2L + 1)·N·C
        loss       row max (N), Σexp and the target logit (2N)             all-reduce 3N

    with sequence parallelism (Korthikanti et al. 2022, §4.2.2; f̄ all-gather, ḡ reduce-scatter)
        forward    ḡ: embedding + 2 per block                              reduce-scatter (2L + 1)·N·C
                   f̄: 2 per block + the head                               all-gather     (2L + 1)·N·C
        backward   f̄ᵀ: 2 per block + the head (dx)                         reduce-scatter (2L + 1)·N·C
                   ḡᵀ: embedding + 2 per block                             all-gather     (2L + 1)·N·C
                   the weight gradient's re-gather: 2 per block + head     all-gather     (2L + 1)·N·C
                   parameters seen on sequence shards: per block 2 layer
                   norms (4C) + 2 row-parallel biases (2C); ln_f (2C);
                   wpe (T_max·C)                                           all-reduce (6L + 2 + T_max)·C
        loss       as above                                                all-reduce 3N

    recomputation (activation checkpointing): every recomputed block forward repeats its forward
    communication: 2 all-reduces of N·C, or 2 all-gathers + 2 reduce-scatters of N·C; with
    partitioned activations (partition.py) every restored block input is all-gathered: N·C.

The re-gather is Megatron-LM's choice (operators.GatherThenLinear): backward all-gathers the
sequence shard again instead of keeping the gathered input, so sequence parallelism sends
(2L + 1)·N·C(t−1)/t elements more per micro-batch than plain tensor parallelism, and stores 1/t
of each gathered input. Without the re-gather both would move the same bytes (Korthikanti et al.:
"the same communication volume").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """What the tp group's traffic depends on, for the blocks one rank holds."""

    tokens: int  # N = b·T of one micro-batch
    width: int  # C
    blocks: int  # L: transformer blocks this rank holds (its stages')
    micro_batches: int  # forwards and backwards per step
    has_embedding: bool = True  # the first stage
    has_head: bool = True  # the last stage (and the loss)
    max_positions: int = 0  # T_max: rows of wpe (sequence parallelism's gradient sum)
    recomputed_blocks: int = 0  # block forwards recomputed per micro-batch (activation checkpointing)
    restored_inputs: int = 0  # kept block inputs restored per micro-batch, with partitioned activations


def elements_per_step(shape: StepShape, sequence_parallel: bool) -> dict:
    """{"allreduce", "allgather", "reduce_scatter"}: elements in the collectives of one step (whole
    buffers, before the (t−1)/t of the ring)."""
    N, C, L = shape.tokens, shape.width, shape.blocks
    ends = int(shape.has_embedding) + int(shape.has_head)  # the embedding's g, the head's f
    loss = 3 * N if shape.has_head else 0
    if not sequence_parallel:
        per_micro_batch = {"allreduce": (4 * L + ends + 2 * shape.recomputed_blocks) * N * C + loss,
                           "allgather": shape.restored_inputs * N * C, "reduce_scatter": 0}
    else:
        head, embedding = int(shape.has_head), int(shape.has_embedding)
        shards = (6 * L + 2 * head + (shape.max_positions if embedding else 0)) * C  # parameters on shards
        per_micro_batch = {
            "allreduce": shards + loss,
            "allgather": (6 * L + 2 * head + embedding + 2 * shape.recomputed_blocks) * N * C,
            "reduce_scatter": (4 * L + embedding + head + 2 * shape.recomputed_blocks) * N * C,
        }
    return {kind: shape.micro_batches * count for kind, count in per_micro_batch.items()}


def bytes_per_step(shape: StepShape, sequence_parallel: bool, tp: int, itemsize: int) -> dict:
    """Bytes one rank of the group sends in one step, by kind (ring counting; comm.Counters' kinds).
    Exact when t divides every buffer (N, C and T_max·C); otherwise the ring's blocks differ by one."""
    elements = elements_per_step(shape, sequence_parallel)
    factor = {"allreduce": 2, "allgather": 1, "reduce_scatter": 1}
    return {kind: factor[kind] * count * (tp - 1) // tp * itemsize for kind, count in elements.items()}


# -- 2. activations saved by one transformer block -------------------------------------------------
#
# refimpl's Block (nn/layers.py) in the forward pass of one micro-batch, N = b·T tokens, width C,
# H heads, every array counted once however many operations save it (autograd/saved.py); [p] = 1
# with dropout, else 0. Elements per block, on one process:
#
#     ln1, ln2         x̂ (N·C) and 1/σ (N) each                           2·N·C + 2N
#     qkv, fc inputs   the layer-norm outputs                               2·N·C
#     q, k, v          the core's inputs (split of the qkv output)          3·N·C
#     core             softmax output; with dropout its mask and the
#                      dropped probabilities (att @ v saves those)          (1 + 2[p])·b·H·T²
#     proj input       the heads' outputs                                   N·C
#     GeLU             its input, and the MLP proj's input (its output)     8·N·C
#     dropout masks    after attention and after the MLP                    2[p]·N·C
#                                                                   = (16 + 2[p])·N·C + 2N + (1 + 2[p])·b·H·T²
#
# Korthikanti et al. 2022 (arXiv 2205.05198, §4.1) count bytes with 2-byte activations and 1-byte
# masks and get sbh(34 + 5as/h); refimpl stores every array, masks too, at the model's itemsize.
# Which terms divide by t (tensor_parallel/gpt.py's splits):
#
#   tensor parallel        q, k, v, proj input, GeLU (12·N·C) and the core (b·H·T² terms) are split;
#                          ln1, ln2, the qkv/fc inputs and the masks ((4 + 2[p])·N·C + 2N) are whole
#                          on every rank -- the paper's sbh(10 + 24/t + 5as/(ht))
#   + sequence parallel    everything /t: the layer norms and masks run on sequence shards, and the
#                          column-parallel linears keep their sequence shard, not the gathered input
#   selective recompute    the core keeps only q, k, v: the b·H·T² terms vanish
#   full recompute         a checkpointed block keeps its input, N·C (N·C/t with sequence
#                          parallelism, or with partitioned activations, partition.py)


def saved_elements_per_block(b: int, T: int, C: int, H: int, tp: int = 1, sequence_parallel: bool = False,
                             dropout: bool = False, selective: bool = False) -> dict:
    """{"whole", "split", "attention"}: elements one rank saves in one block's forward, by how they
    scale (whole on every rank, split over tp, the core's T² terms); sum them for the total."""
    N, p = b * T, int(dropout)
    whole = (4 + 2 * p) * N * C + 2 * N  # layer norms, qkv/fc inputs, masks
    split = 12 * N * C  # q, k, v, proj input, GeLU input and output
    attention = 0 if selective else (1 + 2 * p) * b * H * T * T
    if sequence_parallel:
        return {"whole": 0, "split": (whole + split) // tp, "attention": attention // tp}
    return {"whole": whole, "split": split // tp, "attention": attention // tp}


def saved_bytes_per_block(b: int, T: int, C: int, H: int, tp: int = 1, sequence_parallel: bool = False,
                          dropout: bool = False, selective: bool = False, itemsize: int = 8) -> int:
    return itemsize * sum(saved_elements_per_block(b, T, C, H, tp, sequence_parallel, dropout, selective).values())


def korthikanti_bytes_per_block(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                                selective: bool = False) -> float:
    """The paper's activation bytes per layer (16-bit activations, 1-byte masks; Table 2):
    sbh(10 + 24/t + 5as/(ht)), with sequence parallelism sbh(34/t + 5as/(ht)); selective
    recomputation drops the 5as/(ht) term."""
    core = 0.0 if selective else 5 * a * s / (h * t)
    return s * b * h * ((34 / t if sequence_parallel else 10 + 24 / t) + core)


# -- 3. parameters per rank --------------------------------------------------------------------------

def parameters_per_rank(vocab: int, seq_len: int, C: int, layers: int, tp: int = 1, tied: bool = False) -> dict:
    """{"split", "whole"}: parameter elements a tp rank holds (the whole GPT; a pipeline stage holds
    its part), with the vocabulary padded to a multiple of tp. Per block 12C² + 7C split, 6C whole."""
    V = -(-vocab // tp) * tp
    split = layers * (12 * C * C + 7 * C) // tp + V * C // tp * (1 if tied else 2)
    whole = layers * 6 * C + seq_len * C + 2 * C  # per block: proj biases, ln1, ln2; wpe; ln_f
    return {"split": split, "whole": whole}


__all__ = ["StepShape", "elements_per_step", "bytes_per_step", "saved_elements_per_block", "saved_bytes_per_block",
           "korthikanti_bytes_per_block", "parameters_per_rank"]
