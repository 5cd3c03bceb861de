"""Tensor parallelism (Megatron-LM, arXiv 1909.08053) and sequence parallelism (arXiv 2205.05198).

    operators.py      the conjugate operators f / g and their sequence-parallel forms, as autograd
                      Functions; the column-parallel linear that re-gathers its input in backward
    layers.py         column- and row-parallel linears, the vocabulary-parallel embedding
    cross_entropy.py  the loss on vocabulary shards (3N numbers cross the group, not N·V logits)
    gpt.py            a GPT cut over a group: `shard_gpt`, `WeightSplit`, `TensorParallelGPT.whole`
    partition.py      ZeRO-R's partitioned activation checkpoints (Pa): 1/t of each kept input
    communication.py  bytes the group sends per step (what a rank holds: refimpl/memory.py)

The trainer (parallel/trainer.py) cuts the model over the mesh's tp group before it cuts it into
pipeline stages; everything above the model (data parallelism, ZeRO, pipelines) then sees a
model whose parameters are this rank's slices.
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .gpt import TensorParallelGPT, WeightSplit, check_options, padded, shard_gpt
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .operators import copy_to_tensor_parallel, gather_sequence, reduce_from_tensor_parallel, reduce_scatter_sequence
from .partition import PartitionedActivations

__all__ = ["shard_gpt", "check_options", "WeightSplit", "TensorParallelGPT", "padded", "vocab_parallel_cross_entropy",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "copy_to_tensor_parallel",
           "reduce_from_tensor_parallel", "gather_sequence", "reduce_scatter_sequence", "PartitionedActivations"]
