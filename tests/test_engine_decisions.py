"""The engine decisions of docs/design.md ("Decisions later features depend on"): saved-tensor
accounting, hooks and their order, flat views."""

import numpy as np
import pytest

from refimpl.autograd import Parameter, Tensor, engine, saved_tensors
from refimpl.nn import GPT, GPTConfig, Linear, Module
from refimpl.nn import functional as F
from refimpl.optim import AdamW


def test_saved_bytes_are_exact_for_a_known_graph():
    saved_tensors.reset_peak()
    base = saved_tensors.live_bytes
    w = Parameter(np.ones((8, 4)))  # 8x4 float64: parameters are never counted
    x = Tensor(np.ones((16, 4)), requires_grad=True)  # 512 bytes
    h = F.linear(x, w)  # saves x (512 B) and w (parameter, not counted)
    y = h.tanh()  # saves its output (16x8 float64: 1024 B)
    z = F.linear(y, Parameter(np.ones((2, 8))))  # saves y: the same array as tanh's output, counted once
    loss = (z * z).sum()  # saves z twice (one array: 16x2 = 256 B)
    assert saved_tensors.live_bytes - base == 512 + 1024 + 256
    loss.backward()
    assert saved_tensors.live_bytes == base
    assert saved_tensors.peak_bytes - base == 512 + 1024 + 256


def test_nothing_is_saved_under_no_grad_or_without_requires_grad():
    from refimpl.autograd import no_grad

    base = saved_tensors.live_bytes
    x = Tensor(np.ones((100, 100)))
    _ = (x * x).tanh()
    with no_grad():
        _ = (Parameter(np.ones(5)) * 2).exp()
    assert saved_tensors.live_bytes == base


def test_gpt_saved_bytes_grow_linearly_with_batch_and_are_released():
    cfg = GPTConfig(vocab_size=10, seq_len=8, n_layer=2, n_head=2, d_model=16, dtype="float32")
    model = GPT(cfg)
    base = saved_tensors.live_bytes
    held = []
    for batch in (2, 4, 6):
        idx = np.zeros((batch, 8), dtype=np.int64)
        loss = model.loss(idx, idx)
        held.append(saved_tensors.live_bytes - base)
        loss.backward()
        assert saved_tensors.live_bytes == base
    # every saved array is per-example: bytes are exactly proportional to the batch
    assert held[0] > 0 and held[1] == 2 * held[0] and held[2] == 3 * held[0]


def test_hooks_fire_in_the_documented_order():
    events = []

    class Net(Module):
        def __init__(self):
            super().__init__()
            self.fc = Linear(3, 2, np.random.default_rng(0), dtype="float64")

        def forward(self, x):
            return self.fc(x)

    net = Net()
    fc = net.fc
    fc.register_forward_pre_hook(lambda m, args: events.append("forward_pre"))
    fc.register_forward_hook(lambda m, args, out: events.append("forward"))
    fc.register_full_backward_pre_hook(lambda m, gout: events.append(("backward_pre", gout[0].shape)))
    fc.register_full_backward_hook(lambda m, gin, gout: events.append(("backward", gin[0].shape, gout[0].shape)))
    fc.weight.register_hook(lambda g: events.append("weight_grad_hook"))
    fc.weight.register_post_accumulate_grad_hook(lambda p: events.append("weight_accumulated"))
    x = Tensor(np.ones((4, 3)), requires_grad=True)
    x.register_hook(lambda g: events.append("input_grad_hook"))
    out = net(x)
    out.register_hook(lambda g: events.append("output_grad_hook"))
    assert events == ["forward_pre", "forward"]
    out.sum().backward()
    assert events == ["forward_pre", "forward", "output_grad_hook", ("backward_pre", (4, 2)),
                      "weight_grad_hook", "weight_accumulated", ("backward", (4, 3), (4, 2)), "input_grad_hook"]


def test_hooks_can_replace_values_and_be_removed():
    w = Parameter(np.ones(2))
    handle = w.register_hook(lambda g: g * 10)
    (w * 1.0).sum().backward()
    assert np.array_equal(w.grad, [10.0, 10.0])
    handle.remove()
    (w * 1.0).sum().backward()
    assert np.array_equal(w.grad, [11.0, 11.0])
    fc = Linear(2, 2, np.random.default_rng(0), dtype="float64")
    fc.register_forward_pre_hook(lambda m, args: (args[0] * 0.0,))
    assert np.array_equal(fc(Tensor(np.ones((1, 2)))).data, fc.bias.data[None, :])


def test_backward_hook_fires_when_no_input_requires_grad():
    fc = Linear(2, 2, np.random.default_rng(0), dtype="float64")
    seen = []
    fc.register_full_backward_hook(lambda m, gin, gout: seen.append(gin))
    fc(Tensor(np.ones((1, 2)))).sum().backward()
    assert seen == [(None,)]


def _flat_model(model):
    """Put every parameter's data and grad into two flat buffers (as DDP and ZeRO do)."""
    params = model.parameters()
    n = sum(p.size for p in params)
    data, grads = np.zeros(n + 3, params[0].dtype), np.zeros(n + 3, params[0].dtype)  # + padding
    offset = 0
    for p in params:
        p.set_flat_views(data[offset:offset + p.size].reshape(p.shape), grads[offset:offset + p.size].reshape(p.shape))
        offset += p.size
    return data, grads


def test_parameters_as_views_into_a_flat_buffer_train_identically():
    cfg = GPTConfig(vocab_size=10, seq_len=8, n_layer=2, n_head=2, d_model=16, dtype="float64")
    plain, flat = GPT(cfg, seed=1), GPT(cfg, seed=1)
    data, grads = _flat_model(flat)
    opt_plain, opt_flat = AdamW(plain.parameters(), lr=1e-2), AdamW(flat.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    for _ in range(3):
        idx = rng.integers(0, 10, (4, 8))
        for model, opt in ((plain, opt_plain), (flat, opt_flat)):
            for half in (idx[:2], idx[2:]):  # two micro-batches: gradients accumulate
                model.loss(half, half).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(plain.named_parameters(), flat.parameters()):
        assert np.array_equal(p.data, q.data), name
        assert np.shares_memory(q.data, data) and np.shares_memory(q.grad, grads)
    assert np.all(data[-3:] == 0) and np.all(grads[-3:] == 0)  # padding untouched


def test_flat_view_shape_mismatch_is_an_error():
    p = Parameter(np.ones((2, 3)))
    with pytest.raises(ValueError, match="flat view has shape"):
        p.set_flat_views(np.zeros(6))


def test_state_dict_round_trip_and_errors():
    cfg = GPTConfig(vocab_size=10, seq_len=8, n_layer=1, n_head=2, d_model=8, dtype="float64")
    a, b = GPT(cfg, seed=1), GPT(cfg, seed=2)
    b.load_state_dict(a.state_dict())
    for p, q in zip(a.parameters(), b.parameters()):
        assert np.array_equal(p.data, q.data)
    bad = a.state_dict()
    bad["wte.weight"] = np.zeros((3, 3))
    with pytest.raises(ValueError, match=r"wte.weight has shape \(3, 3\)"):
        b.load_state_dict(bad)
    del bad["wte.weight"]
    with pytest.raises(ValueError, match="missing keys"):
        b.load_state_dict(bad)


def test_seeded_initialisation_is_identical_and_tied_weights_listed_once():
    cfg = GPTConfig(vocab_size=10, seq_len=8, n_layer=2, n_head=2, d_model=16)
    a, b = GPT(cfg, seed=7), GPT(cfg, seed=7)
    assert all(np.array_equal(p.data, q.data) for p, q in zip(a.parameters(), b.parameters()))
    tied = GPT(GPTConfig(vocab_size=10, seq_len=8, n_layer=2, n_head=2, d_model=16, tie_weights=True))
    assert tied.num_parameters() == a.num_parameters() - 10 * 16


def test_float16_is_storage_ops_compute_in_float32():
    rng = np.random.default_rng(0)
    w16 = Parameter(rng.standard_normal((4, 3)).astype(np.float16))
    x = Tensor(rng.standard_normal((2, 3)).astype(np.float32), requires_grad=True)
    base = saved_tensors.live_bytes
    y = F.linear(x, w16).tanh()
    assert y.dtype == np.float32
    # the float32 copy of the float16 weight is parameter data, not an activation
    assert saved_tensors.live_bytes - base == x.data.nbytes + y.data.nbytes
    g = rng.standard_normal(y.shape).astype(np.float32)
    y.backward(g)
    w32 = Parameter(w16.data.astype(np.float32))
    x32 = Tensor(x.data, requires_grad=True)
    F.linear(x32, w32).tanh().backward(g)
    assert w16.grad.dtype == np.float16
    assert np.array_equal(w16.grad, w32.grad.astype(np.float16))
    assert np.array_equal(x.grad, x32.grad)


def test_saved_parameters_are_read_at_backward_time():
    # ZeRO-3 frees a module's gathered weights after forward and gathers them again for backward
    w = Parameter(np.full((2, 3), 2.0))
    x = Tensor(np.ones((1, 3)), requires_grad=True)
    out = F.linear(x, w)
    gathered = w.data
    w.data = np.zeros(0)  # "freed": nothing saved pins the gathered array
    w.data = gathered * 5.0  # "gathered again" (deliberately different, to prove it is read now)
    out.sum().backward()
    assert np.array_equal(x.grad, np.full((1, 3), 20.0))


def test_a_graph_dropped_without_backward_releases_its_saved_arrays():
    import gc

    base = saved_tensors.live_bytes
    x = Tensor(np.ones((10, 10)), requires_grad=True)
    y = (x * x).tanh()
    assert saved_tensors.live_bytes > base
    del y
    gc.collect()
    assert saved_tensors.live_bytes == base


def test_functional_grad_runs_no_leaf_hook():
    from refimpl.autograd import grad

    w = Parameter(np.ones(2))
    calls = []
    w.register_hook(lambda g: calls.append(1))
    grad((w * 2.0).sum(), [w])
    assert calls == []
    (w * 2.0).sum().backward()
    assert calls == [1]


# -- nodes that no gradient reaches, and leaves among the roots ---------------------------------------


def _shared_weight_graph(ignore):
    """out = f(w·x, c) + w·x, where f ignores its first argument: the first w·x node is reached by
    the backward but receives no gradient, while w also gets one through the second w·x."""
    w = Parameter(np.array([1.0, -2.0]))
    x, c = Tensor(np.array([3.0, 5.0])), Tensor(np.array([2.0, 4.0]), requires_grad=True)
    return w, c, ignore(w * x, c) + w * x


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
def test_a_leaf_shared_with_a_node_that_gets_no_gradient_still_gets_its_gradient(split):
    from refimpl.checkpointing import checkpoint  # noqa: PLC0415

    w, c, out = _shared_weight_graph(lambda h, c: checkpoint(lambda a, b: b * 1.0, h, c))
    work = engine.backward([out.sum()], defer_weight_grads=split)
    if split:
        work.run()
    np.testing.assert_array_equal(w.grad, [3.0, 5.0])  # x, from the second product only
    np.testing.assert_array_equal(c.grad, [1.0, 1.0])


def test_backward_from_a_leaf_and_a_computed_tensor_at_once():
    a = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    b = Parameter(np.array([3.0]))
    d = b * 2.0
    engine.backward([a, d], [np.array([0.5, 0.25]), np.array([1.0])])
    np.testing.assert_array_equal(a.grad, [0.5, 0.25])  # a leaf root: its gradient is the one given
    np.testing.assert_array_equal(b.grad, [2.0])
    work = engine.backward([a, b * 2.0], [np.array([1.0, 1.0]), np.array([1.0])], defer_weight_grads=True)
    assert isinstance(work, engine.WeightGradWork) and len(work) == 1
    work.run()
    np.testing.assert_array_equal(a.grad, [1.5, 1.25])
    np.testing.assert_array_equal(b.grad, [4.0])
