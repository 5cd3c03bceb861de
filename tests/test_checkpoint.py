"""checkpoint(fn, *args): bitwise gradients, dropout replay, split backward, hooks, memory, errors."""

import numpy as np
import pytest

from refimpl.autograd import Parameter, Tensor, backward, grad, no_grad, saved_tensors
from refimpl.checkpointing import checkpoint
from refimpl.nn import Block, Linear


def _block(dtype, dropout=0.1):
    return Block(16, 4, 8, np.random.default_rng(0), dropout=dropout, n_layer=2, dtype=dtype, seed=5)


def _x(dtype, requires_grad=True):
    return Tensor(np.random.default_rng(1).standard_normal((2, 8, 16)).astype(dtype), requires_grad=requires_grad)


def _two_blocks(use_checkpoint, dtype, split=False, preserve_rng_state=True):
    """Two dropout blocks, the second one under checkpoint; gradients of x and every parameter."""
    b1, b2 = _block(dtype), _block(dtype)
    b2.train()
    x = _x(dtype)
    h = b1(x)
    y = checkpoint(b2, h, preserve_rng_state=preserve_rng_state) if use_checkpoint else b2(h)
    g = np.random.default_rng(2).standard_normal(y.shape).astype(dtype)
    if split:
        work = backward([y], [g], defer_weight_grads=True)
        assert all(p.grad is None for p in b1.parameters() + b2.parameters())  # W not yet run
        work.run()
    else:
        backward([y], [g])
    return [x.grad] + [p.grad for p in b1.parameters() + b2.parameters()], b2


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
def test_gradients_are_bitwise_equal_with_dropout(dtype, split):
    reference, _ = _two_blocks(False, dtype)
    got, _ = _two_blocks(True, dtype, split=split)
    assert len(got) == 25
    for a, b in zip(reference, got):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_random_state_after_the_step_is_as_without_checkpointing():
    _, plain = _two_blocks(False, "float64")
    _, ckpt = _two_blocks(True, "float64")
    for m1, m2 in zip(plain.modules(), ckpt.modules()):
        if hasattr(m1, "generator"):
            assert m1.generator.bit_generator.state == m2.generator.bit_generator.state


def test_without_preserved_rng_state_the_masks_differ():
    reference, _ = _two_blocks(False, "float64")
    got, _ = _two_blocks(True, "float64", preserve_rng_state=False)
    assert not all(np.array_equal(a, b) for a, b in zip(reference, got))


def test_only_the_inputs_are_saved():
    block, x = _block("float64"), _x("float64")
    base = saved_tensors.live_bytes
    y = checkpoint(block, x)
    assert saved_tensors.live_bytes - base == x.data.nbytes
    saved_tensors.reset_peak()
    y.sum().backward()
    assert saved_tensors.live_bytes == base
    # during backward, the block's own activations existed for a while
    assert saved_tensors.peak_bytes - base > 10 * x.data.nbytes


def test_forward_runs_once_and_backward_once_more():
    block, x = _block("float64"), _x("float64")
    calls = []
    block.register_forward_pre_hook(lambda m, args: calls.append(1))
    y = checkpoint(block, x)
    assert len(calls) == 1
    y.sum().backward()
    assert len(calls) == 2


def test_functional_grad_through_checkpoint_leaves_dot_grad_alone():
    x = _x("float64")  # each call gets a fresh block: the same weights and the same dropout masks
    (dx_plain,) = grad(_block("float64")(x).sum(), [x])
    block = _block("float64")
    (dx_ckpt,) = grad(checkpoint(block, x).sum(), [x])
    assert np.array_equal(dx_plain, dx_ckpt)
    assert all(p.grad is None for p in block.parameters())
    plain = _block("float64")
    dw_plain = grad(plain(x).sum(), [plain.ln1.weight])[0]
    dw_ckpt = grad(checkpoint(block := _block("float64"), x).sum(), [block.ln1.weight])[0]
    assert np.array_equal(dw_plain, dw_ckpt)


def test_leaf_hooks_fire_once_on_the_whole_gradient():
    def run(use_checkpoint):
        layer = Linear(3, 3, np.random.default_rng(0), dtype="float64")
        seen = []
        layer.weight.register_hook(lambda g: g * 2.0)  # must rescale once, not twice
        layer.weight.register_post_accumulate_grad_hook(lambda p: seen.append(1))
        x = Tensor(np.ones((2, 3)), requires_grad=True)
        y = checkpoint(layer, x) if use_checkpoint else layer(x)
        (y * y).sum().backward()
        return layer.weight.grad, len(seen)

    (g_plain, n_plain), (g_ckpt, n_ckpt) = run(False), run(True)
    assert np.array_equal(g_plain, g_ckpt) and n_plain == n_ckpt == 1


def test_several_arguments_outputs_and_constants():
    w = Parameter(np.random.default_rng(0).standard_normal((3, 3)))

    def fn(a, b, scale):  # w is captured by the closure: found as a parameter
        return (a @ w) * scale, (b @ w).tanh()

    def run(use_checkpoint):
        w.grad = None
        a = Tensor(np.ones((2, 3)), requires_grad=True)
        b = Tensor(np.full((2, 3), 0.5), requires_grad=True)
        u, v = checkpoint(fn, a, b, 3.0) if use_checkpoint else fn(a, b, 3.0)
        (u.sum() + (v * v).sum()).backward()
        return a.grad, b.grad, w.grad

    for p, c in zip(run(False), run(True)):
        assert np.array_equal(p, c)


def test_under_no_grad_nothing_is_recorded():
    block, x = _block("float64"), _x("float64")
    base = saved_tensors.live_bytes
    with no_grad():
        y = checkpoint(block, x)
    assert not y.requires_grad and saved_tensors.live_bytes == base


def test_a_second_backward_with_retain_graph_recomputes():
    layer = Linear(3, 3, np.random.default_rng(0), dtype="float64")
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    y = checkpoint(layer, x).sum()
    y.backward(retain_graph=True)
    first = layer.weight.grad.copy()
    y.backward()
    assert np.array_equal(layer.weight.grad, 2 * first)


def test_a_tensor_reached_another_way_is_an_error_not_a_lost_gradient():
    hidden = {"w": Parameter(np.ones((3, 3)))}

    def fn(x):  # reaches its weight through a dict: not found by the walk
        return x @ hidden["w"]

    y = checkpoint(fn, Tensor(np.ones((2, 3)), requires_grad=True))
    with pytest.raises(RuntimeError, match="neither arguments nor parameters"):
        y.sum().backward()


def test_fn_must_return_tensors():
    with pytest.raises(TypeError, match="must return a Tensor"):
        checkpoint(lambda x: 3, Tensor(np.ones(2), requires_grad=True))
