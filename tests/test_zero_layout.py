"""ZeRO's building blocks in one process: flat groups, units, loss scaling, the ledger at N = 1."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.autograd import Parameter
from refimpl.memory import bytes_per_parameter, model_state_bytes
from refimpl.nn import GPT, GPTConfig, MLPClassifier
from refimpl.nn import functional as F
from refimpl.optim import AdamW
from refimpl.optim.precision import LossScaler
from refimpl.parallel.comm import LocalComm
from refimpl.parallel.trainer import Trainer
from refimpl.parallel.zero.flat import FlatGroup, bucket_groups, module_units, padded_length
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task


def named(*sizes):
    return [(f"p{i}", Parameter(np.arange(s, dtype=np.float64) + 100 * i)) for i, s in enumerate(sizes)]


def test_flat_group_pads_to_a_multiple_of_n_and_maps_shards_back_to_parameters():
    params = named(5, 1, 3)  # 9 elements over 4 ranks: L = 12, blocks of 3
    groups = [FlatGroup(0, params, shards=4, rank=r) for r in range(4)]
    g = groups[1]
    assert (g.numel, g.length, g.block, g.padding, g.start, g.stop) == (9, 12, 3, 3, 3, 6)
    flat = g.flatten([p.data for _, p in params])
    assert flat.tolist() == [0, 1, 2, 3, 4, 100, 200, 201, 202, 0, 0, 0]
    assert [v.tolist() for v in g.views(flat)] == [[0, 1, 2, 3, 4], [100], [200, 201, 202]]
    assert g.pieces() == [("p0", 3, 5, 0), ("p1", 0, 1, 2)]  # rank 1's block: p0[3:5], then p1
    assert groups[3].pieces() == []  # rank 3 holds only padding
    covered = sorted((name, a, b) for grp in groups for name, a, b, _ in grp.pieces())
    assert covered == [("p0", 0, 3), ("p0", 3, 5), ("p1", 0, 1), ("p2", 0, 3)]  # each element once
    assert [padded_length(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    with pytest.raises(ValueError, match="different dtypes"):
        FlatGroup(0, [("a", Parameter(np.zeros(2))), ("b", Parameter(np.zeros(2, np.float32)))], 2, 0)


def test_buckets_follow_backward_order_and_units_follow_modules():
    params = named(10, 10, 10, 30)  # float64: 80, 80, 80, 240 bytes
    buckets = bucket_groups(params, 200, shards=2, rank=0)
    assert [b.names for b in buckets] == [["p3"], ["p2", "p1"], ["p0"]]  # reversed, a big one alone
    model = MLPClassifier([2, 4, 3], seed=0)
    units, persistent = module_units(model)
    assert [(name, [n for n, _ in params]) for name, _, params in units] == [
        ("mlp.layers.0", ["mlp.layers.0.weight", "mlp.layers.0.bias"]),
        ("mlp.layers.1", ["mlp.layers.1.weight", "mlp.layers.1.bias"])]
    units, persistent = module_units(model, threshold=5)  # biases of 4 and 3 elements stay whole
    assert [n for n, _ in persistent] == ["mlp.layers.0.bias", "mlp.layers.1.bias"]
    assert [[n for n, _ in params] for _, _, params in units] == [["mlp.layers.0.weight"], ["mlp.layers.1.weight"]]


def test_gpt_head_is_a_module_call_so_zero3_can_gather_it():
    model = GPT(GPTConfig(vocab_size=7, seq_len=4, n_layer=1, n_head=1, d_model=4, dtype="float64"))
    calls = []
    model.lm_head.register_forward_hook(lambda m, args, out: calls.append(out.shape))
    idx = np.array([[1, 2, 3]])
    logits = model(idx)
    assert calls == [(1, 3, 7)]
    x = model.blocks[0](model.embed(idx))
    assert np.array_equal(logits.data, F.linear(model.ln_f(x), model.lm_head.weight).data)  # same arithmetic


def test_zero3_rejects_weights_used_outside_their_module():
    model = GPT(GPTConfig(vocab_size=7, seq_len=4, n_layer=1, n_head=1, d_model=4, tie_weights=True, dtype="float64"))
    with pytest.raises(ValueError, match="a tied embedding is also used by the head"):
        Trainer(model, lambda params: AdamW(params, lr=1e-3), LocalComm(), zero=3, precision="float64")

    class Outside(MLPClassifier):  # uses its last layer's weight directly, not through the layer's call
        def forward(self, x):
            hidden = self.mlp.layers[0](x).tanh()
            return F.linear(hidden, self.mlp.layers[1].weight)

    trainer = Trainer(Outside([2, 3, 2], dtype="float64"), lambda params: AdamW(params, lr=1e-3), LocalComm(), zero=3,
                      precision="float64")
    with pytest.raises(ValueError, match="parameters of mlp.layers.1 were never gathered"):
        trainer.step(np.ones((2, 2)), np.array([0, 1]))


def test_loss_scaler_backs_off_on_overflow_and_grows_after_a_window():
    scaler = LossScaler(scale=8.0, growth_interval=2, min_scale=2.0)
    for overflow in (False, True, False, False, True, True, True):
        scaler.update(overflow)
    assert (scaler.scale, scaler.good_steps, scaler.skipped) == (2.0, 0, 4)  # 8 -> 4 -> 8 -> 4 -> 2 -> 2 (floor)
    state = scaler.state_dict()
    other = LossScaler()
    other.load_state_dict(state)
    assert other.state_dict() == state


@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.integers(0, 3),
       st.sampled_from(["float64", "float32", "mixed"]), st.sampled_from(["adamw", "sgd"]))
@settings(max_examples=20, deadline=None)
def test_ledger_equals_the_formula_in_one_process(widths, stage, precision, optimizer):
    cfg = TrainConfig(model="mlp", n_layer=len(widths), d_model=widths[0], dtype=precision, optimizer=optimizer,
                      batch_size=4, zero=stage, bucket_bytes=48)
    task = build_task(cfg)
    model = build_model(cfg, task)
    psi = model.num_parameters()
    trainer = Trainer(model, lambda params: build_optimizer(cfg, params), LocalComm(), zero=stage, precision=precision,
                      bucket_bytes=48)
    p, g, k = bytes_per_parameter(precision, optimizer)
    trainer.step(*task.batch(0, 4))
    assert getattr(trainer.sharding, "padded_numel", psi) == psi  # one shard: no padding
    assert sum(trainer.ledger.model_state().values()) == model_state_bytes(stage, psi, 1, p, g, k)
    if stage == 3:  # freed parameters are NaN placeholders that hold no memory
        weight = model.parameters()[0].data
        assert weight.shape == model.parameters()[0].shape and np.isnan(weight).all()
        assert weight.strides == (0,) * weight.ndim and not weight.flags.writeable
