"""Checkpointed training steps equal plain ones, bit for bit: local, and data-parallel (one process)."""

import numpy as np
import pytest

from refimpl.checkpointing import apply_to_gpt, count_forward_calls, revolve
from refimpl.nn import GPT, GPTConfig
from refimpl.optim import AdamW
from refimpl.parallel.comm import LocalComm
from refimpl.parallel.trainer import Trainer


def _train(plan, mode):
    model = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=4, n_head=2, d_model=16, dropout=0.1), seed=2)
    apply_to_gpt(model, plan)
    trainer = Trainer(model, lambda params: AdamW(params, lr=1e-2), LocalComm(), grad_accum=2, dp_mode=mode,
                      bucket_bytes=2000)
    x = np.random.default_rng(0).integers(0, 11, (4, 8))
    with count_forward_calls(model.blocks) as counter:
        losses = [trainer.step(x, x) for _ in range(3)]
    return losses, [p.data.copy() for p in model.parameters()], counter.total


@pytest.mark.parametrize("mode", ["bucketed", "naive"])
def test_data_parallel_training_with_checkpointed_blocks_is_bitwise_unchanged(mode):
    """Bucketed DDP accumulates into flat buffers and starts reductions from post-accumulate hooks."""
    losses, params, calls = _train("none", mode)
    assert calls == 3 * 2 * 4  # steps x micro-batches x blocks
    for plan in ("sqrt", "revolve:2"):
        got_losses, got_params, got_calls = _train(plan, mode)
        assert got_losses == losses
        assert all(np.array_equal(a, b) for a, b in zip(params, got_params))
        extra = 2 if plan == "sqrt" else revolve.min_advances(4, 2)
        assert got_calls == 3 * 2 * (4 + extra)
