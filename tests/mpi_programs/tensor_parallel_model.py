"""A GPT cut over the whole world as one tensor-parallel group: loss and gradients equal one process's.

    mpiexec -n N python tests/mpi_programs/tensor_parallel_model.py

For tied and untied embeddings, with and without sequence parallelism, with dropout: one forward
and backward of the cut model (the vocabulary-parallel loss) against the whole model on the same
batch (inside the same batch_rows context, so dropout masks are one process's). Rank 0 prints one
JSON list of {"tied", "sequence_parallel", "loss", "reference_loss", "worst", "parameters_equal"},
worst the largest |gradient difference| / max |reference gradient| over every parameter.
"""

import numpy as np

from refimpl.nn.batch_rows import batch_rows
from refimpl.nn.models import GPT, GPTConfig
from refimpl.parallel.comm import get_world
from refimpl.parallel.tensor_parallel import shard_gpt
from refimpl.tools.console import emit_json
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)


def compare(world, tied: bool, sequence_parallel: bool) -> dict:
    config = GPTConfig(vocab_size=11, seq_len=8, n_layer=2, n_head=4, d_model=16, dropout=0.1, tie_weights=tied,
                       dtype="float64")
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 11, (4, 8)), rng.integers(0, 11, (4, 8))
    reference = GPT(config, seed=3)
    with batch_rows(0, 4, 4, 0):
        reference_loss = reference.loss(x, y)
        reference_loss.backward()
    model = GPT(config, seed=3)
    tp = shard_gpt(model, world, sequence_parallel)
    with batch_rows(0, 4, 4, 0):
        loss = tp.cross_entropy(model(x), y)
        loss.backward()
    grads = tp.gather_by_name({name: p.grad for name, p in model.named_parameters()})
    params = tp.gather_by_name({name: p.data for name, p in model.named_parameters()})
    whole = reference.state_dict()
    worst = max(float(np.max(np.abs(grads[name] - p.grad)) / np.max(np.abs(p.grad)))
                for name, p in reference.named_parameters())
    return {"tied": tied, "sequence_parallel": sequence_parallel, "loss": float(loss.data),
            "reference_loss": float(reference_loss.data), "worst": worst,
            "parameters_equal": sorted(params) == sorted(whole) and
            all(np.array_equal(params[name], whole[name]) for name in whole)}


def main() -> None:
    world = get_world()
    results = [compare(world, tied, sp) for tied in (False, True) for sp in (False, True)]
    if world.rank == 0:
        emit_json(results)


if __name__ == "__main__":
    main()
