"""Backend-generic cases: every op, a GPT training step, the host/device helpers, run on whatever
backend is active and reported as NumPy arrays, so that two backends can be compared.

    from backend_cases import OP_CASES, run_op_case, gpt_step
    with backend.using("numpy"):
        want = run_op_case("matmul_batched")          # {"out": ..., "grad0": ..., ...} on the host
    with backend.using("cupy"):
        got = run_op_case("matmul_batched")

tests/test_gpu.py compares the CuPy backend against NumPy with these (float64, rtol 1e-10);
tests/test_backend.py runs the same functions on the NumPy backend, so this code is exercised on
every machine, GPU or not. Inputs are drawn on the host from fixed seeds and moved to the active
backend by Tensor(...) / backend.asarray, as user code does; integer indices are moved explicitly.
"""

from __future__ import annotations

import numpy as np

from refimpl import backend
from refimpl.autograd import Tensor, ops
from refimpl.local_trainer import LocalTrainer
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F
from refimpl.nn.layers import Block
from refimpl.optim import AdamW


def _floats(rng, *shape, positive=False):
    x = rng.standard_normal(shape)
    return np.abs(x) + 0.5 if positive else x


def _index(array):
    """An integer index array on the active backend."""
    return backend.asarray(np.asarray(array))


def _block(x):
    block = Block(d_model=8, n_head=2, seq_len=5, rng=np.random.default_rng(3), dtype="float64")
    return block(x)


# name -> (function of the input Tensors, input arrays drawn from a Generator)
OP_CASES = {
    "add_broadcast": (lambda a, b: a + b, lambda r: [_floats(r, 3, 1, 4), _floats(r, 2, 4)]),
    "sub_broadcast": (lambda a, b: a - b, lambda r: [_floats(r, 3, 4), _floats(r, 4)]),
    "mul_broadcast": (lambda a, b: a * b, lambda r: [_floats(r, 2, 3, 4), _floats(r, 3, 1)]),
    "div": (lambda a, b: a / b, lambda r: [_floats(r, 3, 4), _floats(r, 3, 4, positive=True)]),
    "pow": (lambda a, b: a ** b, lambda r: [_floats(r, 3, 4, positive=True), _floats(r, 3, 4)]),
    "scalar_arithmetic": (lambda a: 2.0 * a - 1.5 / (a * a + 1.0), lambda r: [_floats(r, 5)]),
    "neg_exp_log_sqrt": (lambda a: (-a).exp() + a.log() + a.sqrt(), lambda r: [_floats(r, 4, 3, positive=True)]),
    "tanh_relu": (lambda a: a.tanh() + a.relu(), lambda r: [_floats(r, 4, 6)]),
    "astype_float32": (lambda a: a.astype("float32").astype("float64") * a, lambda r: [_floats(r, 3, 4)]),
    "sum_mean_axes": (lambda a: a.sum(axis=1, keepdims=True) * a.mean(axis=(0, 2)).sum(),
                      lambda r: [_floats(r, 2, 3, 4)]),
    "max_axis": (lambda a: a.max(axis=-1), lambda r: [_floats(r, 3, 5)]),
    "matmul_batched": (lambda a, b: a @ b, lambda r: [_floats(r, 2, 3, 4), _floats(r, 4, 5)]),
    "matmul_vectors": (lambda a, b: a @ b, lambda r: [_floats(r, 4), _floats(r, 2, 4, 3)]),
    "reshape_transpose": (lambda a: a.reshape(4, 6).T.transpose(1, 0).reshape(2, 12), lambda r: [_floats(r, 2, 3, 4)]),
    "getitem_slices": (lambda a: a[1:, ::2], lambda r: [_floats(r, 4, 6)]),
    "getitem_repeated_indices": (lambda a: a[_index([0, 2, 2, 1, 0, 2])], lambda r: [_floats(r, 3, 4)]),
    "getitem_mask": (lambda a: a[_index(np.array([True, False, True, True]))], lambda r: [_floats(r, 4, 2)]),
    "concatenate": (lambda a, b: ops.concatenate([a, b, a], axis=1), lambda r: [_floats(r, 2, 3), _floats(r, 2, 1)]),
    "stack": (lambda a, b: ops.stack([a, b, a], axis=1), lambda r: [_floats(r, 2, 3), _floats(r, 2, 3)]),
    "split": (lambda a: sum(p * (i + 1) for i, p in enumerate(a.split(3, axis=-1))), lambda r: [_floats(r, 2, 6)]),
    "where": (lambda a, b: ops.where(backend.asarray(np.arange(12).reshape(3, 4) % 3 == 0), a, b),
              lambda r: [_floats(r, 3, 4), _floats(r, 4)]),
    "masked_fill": (lambda a: a.masked_fill(backend.asarray(np.eye(4, dtype=bool)), -2.0),
                    lambda r: [_floats(r, 4, 4)]),
    "linear": (lambda x, w, b: F.linear(x, w, b), lambda r: [_floats(r, 2, 3, 4), _floats(r, 5, 4), _floats(r, 5)]),
    "embedding_repeated_tokens": (lambda w: F.embedding(w, _index([[1, 3, 1], [0, 1, 3]])),
                                  lambda r: [_floats(r, 4, 5)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, w, b),
                   lambda r: [_floats(r, 2, 3, 6), _floats(r, 6), _floats(r, 6)]),
    "gelu_tanh": (lambda x: F.gelu(x, "tanh"), lambda r: [_floats(r, 3, 5)]),
    "gelu_erf": (lambda x: F.gelu(x, "none"), lambda r: [_floats(r, 3, 5)]),
    "softmax": (lambda x: F.softmax(x, axis=-1), lambda r: [_floats(r, 3, 5)]),
    "causal_softmax": (lambda x: F.causal_softmax(x, backend.asarray(np.triu(np.ones((4, 4), bool), 1)), 0.5),
                       lambda r: [_floats(r, 2, 4, 4)]),
    "cross_entropy_ignore": (lambda z: F.cross_entropy(z, _index([[1, -100, 4], [0, 2, 2]])),
                             lambda r: [_floats(r, 2, 3, 5)]),
    "cross_entropy_sum": (lambda z: F.cross_entropy(z, _index([3, 0, 1]), reduction="sum"),
                          lambda r: [_floats(r, 3, 4)]),
    "dropout": (lambda x: F.dropout(x, 0.3, np.random.default_rng(11)), lambda r: [_floats(r, 4, 6)]),
    "transformer_block": (_block, lambda r: [_floats(r, 2, 5, 8)]),
}


def run_op_case(name: str, seed: int = 0) -> dict:
    """Forward and backward of one case on the active backend: {"out", "grad0", ...} as NumPy arrays."""
    fn, draw = OP_CASES[name]
    rng = np.random.default_rng([seed, len(name)])
    inputs = [Tensor(a, requires_grad=True) for a in draw(rng)]  # float64, moved to the active backend
    out = fn(*inputs)
    assert type(out.data) is backend.xp().ndarray, f"{name}: output is {type(out.data).__name__}, not the backend's"
    upstream = rng.standard_normal(out.shape)  # a fixed gradient of the output, drawn on the host
    out.backward(upstream if out.ndim else None)
    result = {"out": backend.to_host(out.data)}
    for i, t in enumerate(inputs):
        result[f"grad{i}"] = None if t.grad is None else backend.to_host(t.grad)
    return result


def gpt_step(steps: int = 2, dropout: float = 0.0, checkpoint: str = "none", seed: int = 0) -> dict:
    """`steps` AdamW steps of a small float64 GPT on the active backend: losses, gradients and
    parameters after the last step, as NumPy arrays (the same batches and weights on any backend)."""
    from refimpl.checkpointing import apply_to_gpt  # noqa: PLC0415
    from refimpl.data import SortTask  # noqa: PLC0415

    task = SortTask(length=4, seed=seed)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=2, n_head=2, d_model=16,
                          dropout=dropout, dtype="float64"), seed=seed)
    if checkpoint != "none":
        apply_to_gpt(model, checkpoint)
    trainer = LocalTrainer(model, AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), grad_accum=2, clip=1.0)
    trainer.record_grads = True
    losses = [trainer.step(*task.batch(step, 8)) for step in range(steps)]
    grads = {f"grad/{name}": g for name, g in trainer.last_grads.items()}
    return {"losses": np.array(losses), **grads, **trainer.full_parameters()}


def assert_same(got: dict, want: dict, rtol: float = 1e-10, atol: float = 1e-12, what: str = "") -> None:
    """Every array of `got` equals `want`'s within float64 tolerances (docs/design.md, "Conventions")."""
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for key in want:
        if want[key] is None:
            assert got[key] is None, f"{what}: {key} is set on one backend only"
            continue
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=atol, err_msg=f"{what}: {key}")
