"""Context parallelism: one sequence's attention split over C ranks.

    layout.py           the sequence in 2C chunks: which tokens each rank holds (balanced or
                        contiguous), and the inverse (each rank's shard back to the global order)
    blockwise.py        causal attention one block at a time: the online-softmax merge, the
                        FlashAttention-style backward that recomputes each block's scores
    ring_attention.py   ring attention: queries stay, key/value blocks travel around the ring
    ulysses.py          DeepSpeed-Ulysses: all-to-all from sequence shards to head shards and back
    accounting.py       score elements, bytes sent and saved bytes per rank, as formulas
    gpt.py              the GPT on this rank's tokens: global positions, attention over the group
                        (the trainer's --cp axis: mesh.py's cp_comm, gradients summed over dp x cp)

The attention functions are autograd Functions over a communicator (parallel/comm.py), usable
alone; the trainer installs them through gpt.py. Import each from its module:

    from refimpl.parallel.context_parallel.ring_attention import ring_attention
    from refimpl.parallel.context_parallel.ulysses import ulysses_attention
"""
