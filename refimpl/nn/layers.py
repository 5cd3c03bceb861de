"""Layers: Linear, LayerNorm, Embedding, Dropout, MLP, causal self-attention, a pre-LN Block; and
Llama's: RMSNorm, the SwiGLU MLP, grouped-query attention with rotary positions, LlamaBlock.

Initialisation is seeded: each layer draws its weights from a NumPy Generator that the caller
passes in, in a fixed order, so every process builds identical weights from the same seed.
Legend: B batch, T sequence length, C model width, H heads, D = C / H head width; Llama's layers
also Hkv key/value heads, G = H / Hkv query heads per key/value head, F the SwiGLU width.
"""

from __future__ import annotations

import math

import numpy as np

from refimpl import backend
from refimpl.autograd import ops
from refimpl.autograd.tensor import Parameter, Tensor

from . import batch_rows
from . import functional as F
from .module import Module, ModuleList


def _param(values: np.ndarray, dtype) -> Parameter:
    return Parameter(backend.asarray(values, dtype=dtype))


class Linear(Module):
    """y = x wᵀ + b with w of shape (out, in), initialised N(0, std²) (GPT-2 uses std 0.02)."""

    def __init__(self, d_in: int, d_out: int, rng: np.random.Generator, bias: bool = True,
                 std: float | None = None, dtype="float64") -> None:
        super().__init__()
        std = 1.0 / math.sqrt(d_in) if std is None else std
        self.weight = _param(rng.standard_normal((d_out, d_in)) * std, dtype)
        self.bias = _param(np.zeros(d_out), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNorm(Module):
    def __init__(self, d: int, eps: float = 1e-5, dtype="float64") -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(np.ones(d), dtype)
        self.bias = _param(np.zeros(d), dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(Module):
    """y = x/√(mean(x²) + eps) ⊙ g over the last axis, g initialised to ones (functional.rms_norm)."""

    def __init__(self, d: int, eps: float = 1e-5, dtype="float64") -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(np.ones(d), dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight, self.eps)


class Embedding(Module):
    def __init__(self, n: int, d: int, rng: np.random.Generator, std: float = 0.02, dtype="float64") -> None:
        super().__init__()
        self.weight = _param(rng.standard_normal((n, d)) * std, dtype)

    def forward(self, idx) -> Tensor:
        return F.embedding(self.weight, idx)

    def attend(self, x: Tensor) -> Tensor:
        """x Wᵀ: scores of x against every row (a tied output layer, GPT-2): (…, C) -> (…, n)."""
        return F.linear(x, self.weight)


class Dropout(Module):
    """Dropout with seeded masks.

    Inside a batch_rows context (trainers set one), the mask of global batch b is drawn for the
    whole global batch from a generator seeded by (seed, b) and sliced to the rows being run, so it
    does not depend on how the batch is split (see batch_rows.py). Elsewhere the module draws from
    its own sequential generator.

    `shard` = (axis, index, count): this process holds block `index` of `count` equal blocks of
    the input along `axis` (tensor parallelism: attention heads; sequence parallelism: the
    sequence). The mask is drawn for the whole axis and sliced the same way, so it equals one
    process's mask. A tuple of such triples cuts several axes at once (tensor parallelism with
    replicated key/value heads: this rank's key/value head, then its block of that head's queries).
    """

    def __init__(self, p: float, seed: int = 0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.seed = p, seed
        self.generator = _generator(seed)
        self.shard: tuple | None = None  # (axis, index, count), or a tuple of them

    def forward(self, x: Tensor) -> Tensor:
        rows = batch_rows.current()
        if rows is None or not self.training or self.p == 0.0:
            if self.shard is not None and self.training and self.p > 0.0:
                raise RuntimeError("dropout on a tensor-parallel shard needs a batch_rows context (the trainer's), "
                                   "or its mask would differ from one process's")
            return F.dropout(x, self.p, self.generator, self.training)
        return F.dropout(x, self.p, _RowsOfGlobalMask(self.seed, rows, self.shard), self.training)


class _RowsOfGlobalMask:
    """A stand-in generator whose random((rows, ...)) returns rows start:stop of the global batch's
    draw (and, with a shard (axis, index, count), block index of count along axis; with a tuple of
    shards, each axis cut so)."""

    def __init__(self, seed: int, rows, shard=None) -> None:
        self.seed, self.rows = seed, rows
        self.shards = [] if shard is None else [shard] if isinstance(shard[0], int) else list(shard)

    def random(self, shape):
        r = self.rows
        if shape[0] != r.stop - r.start:
            raise ValueError(f"dropout: input has {shape[0]} rows but the batch context says {r.stop - r.start}")
        whole = [r.global_size] + list(shape[1:])
        for axis, index, count in self.shards:
            whole[axis] *= count
        full = _generator([self.seed, r.batch_id]).random(tuple(whole))[r.start:r.stop]
        for axis, index, count in self.shards:
            n = shape[axis]
            full = full[(slice(None),) * axis + (slice(index * n, (index + 1) * n),)]
        return full


def _generator(seed):
    """A NumPy Generator on every backend: masks are drawn on the host and moved to the device, so a
    seed gives the same masks on CPU and GPU, and checkpointing can save and replay its state
    (CuPy's generators expose no state to save)."""
    return np.random.default_rng(seed)


ACTIVATIONS = {"gelu": F.gelu, "relu": ops.relu, "tanh": ops.tanh}


class MLP(Module):
    """Linear layers of the given sizes with an activation between them (none after the last)."""

    def __init__(self, sizes: list[int], rng: np.random.Generator, activation: str = "gelu",
                 std: float | None = None, last_std: float | None = None, dtype="float64") -> None:
        super().__init__()
        if len(sizes) < 2 or min(sizes) <= 0:
            raise ValueError(f"MLP needs at least two positive sizes, got {sizes}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        self.activation = ACTIVATIONS[activation]
        n = len(sizes) - 1
        self.layers = ModuleList(
            Linear(a, b, rng, std=last_std if (i == n - 1 and last_std is not None) else std, dtype=dtype)
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.activation(x)
        return x


class CausalSelfAttention(Module):
    """Multi-head attention where position t attends to positions <= t.

        q, k, v = split(x W_qkv)                       (B, T, C) each
        att     = softmax(q kᵀ / √D + causal mask)     (B, H, T, T)
        y       = (att v) W_proj                       (B, T, C)
    """

    def __init__(self, d_model: int, n_head: int, seq_len: int, rng: np.random.Generator,
                 dropout: float = 0.0, proj_std: float = 0.02, dtype="float64", seed: int = 0) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not divisible by n_head {n_head}")
        self.n_head = n_head
        self.qkv = Linear(d_model, 3 * d_model, rng, std=0.02, dtype=dtype)
        self.proj = Linear(d_model, d_model, rng, std=proj_std, dtype=dtype)
        self.attn_dropout = Dropout(dropout, seed)
        self.resid_dropout = Dropout(dropout, seed + 1)
        self.mask = backend.asarray(np.triu(np.ones((seq_len, seq_len), dtype=bool), k=1))  # True above the diagonal
        # How the attention core runs: None, plainly; or a callable (core, q, k, v) -> y, which
        # selective activation recomputation installs (refimpl.checkpointing.apply_to_gpt).
        self.core_runner = None
        # None, or a context-parallel group (parallel/context_parallel/gpt.py): x holds this rank's
        # tokens, and context.attention(q, k, v) attends over every rank's keys and values
        self.context = None

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).split(3, axis=-1)  # (B, T, C) each (tensor parallel: (B, T, C/t), H/t heads)
        B, T, C = q.shape
        H, D = self.n_head, C // self.n_head
        q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
        v = v.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
        if self.context is not None:  # context parallel: T is this rank's tokens
            y = self.context.attention(q, k.reshape(B, T, H, D).transpose(0, 2, 1, 3), v)  # (B, H, T, D)
        else:
            k = k.reshape(B, T, H, D).transpose(0, 2, 3, 1)  # (B, H, D, T)
            y = self.core(q, k, v) if self.core_runner is None else self.core_runner(self.core, q, k, v)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.proj(y))

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The attention core: softmax(q kᵀ/√D + mask), its dropout, times v -> (B, H, T, D). Its
        saved tensors are the only ones that grow with T² (Korthikanti et al.'s "5as/h" term)."""
        T, D = q.shape[2], q.shape[3]
        att = F.causal_softmax(q @ k, self.mask[:T, :T], 1.0 / math.sqrt(D))  # (B, H, T, T)
        return self.attn_dropout(att) @ v  # (B, H, T, D)


class Block(Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)).

    mlp is the dense MLP [C, 4C, C], or what make_mlp(rng, last_std) returns: the GPT passes a
    builder of its mixture of experts (nn/experts.py, nn/models.py). Either is built from `rng`
    after attention's weights, with last_std the init of its residual projection.
    """

    def __init__(self, d_model: int, n_head: int, seq_len: int, rng: np.random.Generator,
                 dropout: float = 0.0, n_layer: int = 1, dtype="float64", seed: int = 0, make_mlp=None) -> None:
        super().__init__()
        proj_std = 0.02 / math.sqrt(2 * n_layer)  # GPT-2's scaled init of residual projections
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, n_head, seq_len, rng, dropout, proj_std, dtype, seed)
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        if make_mlp is None:
            self.mlp = MLP([d_model, 4 * d_model, d_model], rng, "gelu", std=0.02, last_std=proj_std, dtype=dtype)
        else:
            self.mlp = make_mlp(rng, last_std=proj_std)
        self.dropout = Dropout(dropout, seed + 2)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.dropout(self.mlp(self.ln2(x)))


# --- the Llama block ---------------------------------------------------------------------------
class SwiGLU(Module):
    """Llama's MLP (Shazeer 2020): y = W₂(silu(W₁x) ⊙ W₃x), widths C -> F -> C, no biases."""

    def __init__(self, d_model: int, ffn_size: int, rng: np.random.Generator, std: float = 0.02,
                 last_std: float = 0.02, dtype="float64") -> None:
        super().__init__()
        if ffn_size <= 0:
            raise ValueError(f"the SwiGLU width must be positive, got {ffn_size}")
        self.w1 = Linear(d_model, ffn_size, rng, bias=False, std=std, dtype=dtype)  # the gate
        self.w3 = Linear(d_model, ffn_size, rng, bias=False, std=std, dtype=dtype)  # the up projection
        self.w2 = Linear(ffn_size, d_model, rng, bias=False, std=last_std, dtype=dtype)  # the down projection
        # How the two projections that read x run: None, each on x; or a callable (linears, x) -> outputs,
        # which tensor parallelism installs (one f for both; refimpl/parallel/tensor_parallel/gpt.py)
        self.input_runner = None

    def forward(self, x: Tensor) -> Tensor:
        gate, up = run_projections(self.input_runner, [self.w1, self.w3], x)  # (B, T, F) each
        return self.w2(F.swiglu(gate, up))  # (B, T, F) -> (B, T, C)


class GroupedQueryAttention(Module):
    """Causal attention with Hkv key/value heads shared by groups of G = H/Hkv query heads (Ainslie et
    al. 2023, arXiv 2305.13245; Hkv = 1 is multi-query attention, Hkv = H multi-head), with rotary
    positions (functional.rotary) on queries and keys, and no biases (Llama):

        q = rope(x W_qᵀ)  (B, H, T, D)      k = rope(x W_kᵀ), v = x W_vᵀ  (B, Hkv, T, D)
        query head j·G + i attends with key/value head j:
        y = softmax(q kᵀ/√D + causal mask) v,  then (B, T, H·D) W_oᵀ

    The key/value heads are not copied G times: q is viewed as (B, Hkv, G, T, D) and k, v as
    (B, Hkv, 1, ·, ·), and the matrix products broadcast over the group axis (their backward sums
    the group's gradients into the shared head). Positions are global: 0 … T−1 of the sequence.
    """

    def __init__(self, d_model: int, n_head: int, kv_heads: int, seq_len: int, rng: np.random.Generator,
                 dropout: float = 0.0, proj_std: float = 0.02, dtype="float64", seed: int = 0,
                 rope_base: float = 10000.0) -> None:
        super().__init__()
        check_llama_shape(d_model, n_head, kv_heads)
        self.n_head, self.kv_heads, self.rope_base = n_head, kv_heads, rope_base  # tensor parallel: H/t, Hkv/t
        self.d_head = d_head = d_model // n_head
        self.wq = Linear(d_model, d_model, rng, bias=False, std=0.02, dtype=dtype)
        self.wk = Linear(d_model, kv_heads * d_head, rng, bias=False, std=0.02, dtype=dtype)
        self.wv = Linear(d_model, kv_heads * d_head, rng, bias=False, std=0.02, dtype=dtype)
        self.wo = Linear(d_model, d_model, rng, bias=False, std=proj_std, dtype=dtype)
        self.attn_dropout = Dropout(dropout, seed)
        self.resid_dropout = Dropout(dropout, seed + 1)
        self.mask = backend.asarray(np.triu(np.ones((seq_len, seq_len), dtype=bool), k=1))  # True above the diagonal
        self.core_runner = None  # as CausalSelfAttention's: selective recomputation may install one
        self.input_runner = None  # as SwiGLU's: tensor parallelism runs wq, wk, wv after one f
        self.context = None  # as CausalSelfAttention's: a context-parallel group, or None

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = run_projections(self.input_runner, [self.wq, self.wk, self.wv], x)  # (B, T, H·D), (B, T, Hkv·D) x 2
        B, T = q.shape[0], q.shape[1]  # T: the whole sequence (sequence parallelism gathers it in the projections)
        H, Hkv, D = self.n_head, self.kv_heads, self.d_head
        G = H // Hkv
        # (T,): global positions of the whole sequence, or (context parallel) of this rank's tokens
        positions = backend.xp().arange(T) if self.context is None else self.context.positions(T)
        q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
        k = k.reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)
        v = v.reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)
        q = F.rotary(q, positions, self.rope_base)  # (B, H, T, D)
        k = F.rotary(k, positions, self.rope_base)  # (B, Hkv, T, D)
        if self.context is not None:  # context parallel: over every rank's keys and values
            y = self.context.attention(q, k, v)  # (B, H, T, D)
        else:
            q = q.reshape(B, Hkv, G, T, D)  # (B, Hkv, G, T, D)
            k = k.transpose(0, 1, 3, 2).reshape(B, Hkv, 1, D, T)  # (B, Hkv, 1, D, T)
            v = v.reshape(B, Hkv, 1, T, D)  # (B, Hkv, 1, T, D)
            y = self.core(q, k, v) if self.core_runner is None else self.core_runner(self.core, q, k, v)
        y = y.reshape(B, H, T, D).transpose(0, 2, 1, 3).reshape(B, T, H * D)  # (B, T, C): head j·G + i at j·G + i
        return self.resid_dropout(self.wo(y))

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """softmax(q kᵀ/√D + mask), its dropout, times v -> (B, Hkv, G, T, D)."""
        T, D = q.shape[-2], q.shape[-1]
        att = F.causal_softmax(q @ k, self.mask[:T, :T], 1.0 / math.sqrt(D))  # (B, Hkv, G, T, T)
        return self.attn_dropout(att) @ v  # (B, Hkv, G, T, D)


def run_projections(runner, linears: list, x: Tensor) -> list:
    """The linears that read the same input x: each called on x, or as `runner` (linears, x) runs them."""
    return [linear(x) for linear in linears] if runner is None else runner(linears, x)


def check_llama_shape(d_model: int, n_head: int, kv_heads: int, ffn_size: int | None = None) -> None:
    """The Llama block's shape rules, each a one-line ValueError that says how to fix it."""
    if d_model % n_head:
        raise ValueError(f"--d-model {d_model} is not divisible by --n-head {n_head}")
    if kv_heads <= 0 or n_head % kv_heads:
        raise ValueError(f"--kv-heads {kv_heads} must divide --n-head {n_head} (each key/value head serves "
                         f"n_head/kv_heads query heads); use 1 (multi-query), {n_head} (multi-head) or a divisor")
    if (d_model // n_head) % 2:
        raise ValueError(f"the head width d_model/n_head = {d_model // n_head} is odd; rotary positions rotate pairs "
                         f"of dimensions: choose --d-model and --n-head with an even quotient")
    if ffn_size is not None and ffn_size <= 0:
        raise ValueError(f"--ffn-size must be positive (the SwiGLU MLP's hidden width), got {ffn_size}")


class LlamaBlock(Module):
    """Llama's pre-norm block: x + attn(rms1(x)), then x + mlp(rms2(x)), with RMSNorm, grouped-query
    attention with rotary positions, and the SwiGLU MLP of width ffn_size (or what make_mlp builds).
    Residual projections (W_o, W₂) get GPT-2's scaled init 0.02/√(2L)."""

    def __init__(self, d_model: int, n_head: int, kv_heads: int, ffn_size: int, seq_len: int,
                 rng: np.random.Generator, dropout: float = 0.0, n_layer: int = 1, dtype="float64", seed: int = 0,
                 rope_base: float = 10000.0, make_mlp=None) -> None:
        super().__init__()
        proj_std = 0.02 / math.sqrt(2 * n_layer)
        self.ln1 = RMSNorm(d_model, dtype=dtype)
        self.attn = GroupedQueryAttention(d_model, n_head, kv_heads, seq_len, rng, dropout, proj_std, dtype, seed,
                                          rope_base)
        self.ln2 = RMSNorm(d_model, dtype=dtype)
        if make_mlp is None:
            self.mlp = SwiGLU(d_model, ffn_size, rng, std=0.02, last_std=proj_std, dtype=dtype)
        else:
            self.mlp = make_mlp(rng, last_std=proj_std)
        self.dropout = Dropout(dropout, seed + 2)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.dropout(self.mlp(self.ln2(x)))
