"""Tensor parallelism's communication: the bytes a rank sends on its tp group per step.

The formula the counters (parallel/comm.py) must match, byte for byte (tests/test_tensor_parallel.py;
the tables of docs/tensor_parallel.md are printed by `python -m refimpl tensor-parallel`). What a tp
rank holds -- activations saved per block, parameters -- is the memory model's (refimpl/memory.py:
saved_elements_per_block, gpt_parameter_tensors), one formula with and without tensor parallelism.

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

Llama's block (arch "llama"; tensor_parallel/gpt.py) has the same two f and two g per block: wq,
wk, wv read their input behind one f (f̄), SwiGLU's w1 and w3 behind another, wo and w2 end in g
(ḡ). Without sequence parallelism its traffic is GPT-2's formula above. With it, two terms differ:

        the projections keep the gathered input (layers.shared_input_column_parallel): no re-gather
        in the blocks, only the head's                                   all-gather     (4L + 2 + 1)·N·C
        parameters seen on sequence shards: 2 RMSNorm gains per block
        (2C), ln_f's gain (C); no biases, no wpe                         all-reduce     (2L + 1)·C

(the "+ 2" and "+ 1" where the stage holds the head and the embedding, as above).

With fewer key/value heads than ranks (Hkv < t, R = t/Hkv ranks hold each key/value head) every
backward also sums wk's and wv's gradients, one head each, D·C elements, over the R replicas:
an all-reduce over R ranks per block, 2·(2·D·C)(R−1)/R elements sent per micro-batch.

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
    arch: str = "gpt2"  # the block: "gpt2" or "llama" (no biases, RMSNorm, no wpe, no re-gather in the blocks)
    kv_replicas: int = 1  # llama with fewer key/value heads than ranks: R = t/Hkv ranks hold each one
    head_width: int = 0  # D, the elements per head and input dimension (with kv_replicas > 1)


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
        if shape.arch == "llama":  # RMSNorm gains only; f̄ twice per block forward, ḡᵀ twice backward
            shards, block_gathers = (2 * L + head) * C, 4 * L
        else:  # LayerNorms, row-parallel biases, wpe; f̄, ḡᵀ and the re-gather, each twice per block
            shards, block_gathers = (6 * L + 2 * head + (shape.max_positions if embedding else 0)) * C, 6 * L
        per_micro_batch = {
            "allreduce": shards + loss,
            "allgather": (block_gathers + 2 * head + embedding + 2 * shape.recomputed_blocks) * N * C,
            "reduce_scatter": (4 * L + embedding + head + 2 * shape.recomputed_blocks) * N * C,
        }
    return {kind: shape.micro_batches * count for kind, count in per_micro_batch.items()}


def bytes_per_step(shape: StepShape, sequence_parallel: bool, tp: int, itemsize: int) -> dict:
    """Bytes one rank of the group sends in one step, by kind (ring counting; comm.Counters' kinds).
    Exact when t divides every buffer (N, C and T_max·C); otherwise the ring's blocks differ by one."""
    elements = elements_per_step(shape, sequence_parallel)
    factor = {"allreduce": 2, "allgather": 1, "reduce_scatter": 1}
    sent = {kind: factor[kind] * count * (tp - 1) // tp * itemsize for kind, count in elements.items()}
    R = shape.kv_replicas
    if R > 1:  # wk's and wv's gradients summed over the replicas of their head, in every backward
        replicated = shape.micro_batches * shape.blocks * 2 * shape.head_width * shape.width
        sent["allreduce"] += 2 * replicated * (R - 1) // R * itemsize
    return sent


__all__ = ["StepShape", "elements_per_step", "bytes_per_step"]
