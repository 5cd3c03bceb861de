"""Models: a GPT (decoder-only transformer, as in GPT-2, or with Llama's block) and an MLP classifier.

GPT forward, for token ids idx of shape (B, T):

    x = wte[idx] + wpe[0:T]                 (B, T, C)   embed()
    x = block_n(... block_1(x))             (B, T, C)   blocks
    logits = ln_f(x) W_headᵀ                (B, T, V)   head()

arch "llama" (Touvron et al. 2023, arXiv 2302.13971) changes the block and the positions, not the
shape of the model: no wpe (positions enter as rotary embeddings of every block's queries and
keys), LlamaBlock (RMSNorm, grouped-query attention with kv_heads key/value heads, the SwiGLU MLP
of width ffn_size; with experts, a mixture of SwiGLU experts of that width, as Mixtral's) and an
RMSNorm for ln_f; nn/layers.py. Embedding, head and the cuts between
blocks are the same, so data parallelism and ZeRO run it unchanged.

The three parts are separate methods so that pipeline stages and checkpointing can cut the model
between blocks. With tie_weights the head reuses the token embedding matrix (GPT-2); by default it
has its own (a pipeline then needs no cross-stage sum of a shared weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refimpl import backend
from refimpl.autograd.tensor import Tensor

from . import functional as F
from .experts import MoE
from .layers import MLP, Block, Dropout, Embedding, LayerNorm, Linear, LlamaBlock, RMSNorm, check_llama_shape
from .module import Module, ModuleList

ARCHITECTURES = ("gpt2", "llama")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    tie_weights: bool = False
    dtype: str = "float32"
    # mixture of experts (nn/experts.py): 0 experts is the dense MLP in every block
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 1  # blocks i with i % moe_every == moe_every - 1 get the experts
    capacity_factor: float | None = None  # None: dropless
    aux_coef: float = 0.01
    # the block: "gpt2" (LayerNorm, learned positions, GeLU MLP of 4C) or "llama" (RMSNorm, rotary
    # positions with base rope_base, SwiGLU MLP of ffn_size, kv_heads key/value heads)
    arch: str = "gpt2"
    kv_heads: int | None = None  # llama: None means n_head (multi-head attention)
    ffn_size: int | None = None  # llama: None means 4·d_model
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "moe_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPT {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_head {self.n_head}")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown --arch {self.arch!r}; choose one of {', '.join(ARCHITECTURES)}")
        if self.arch == "llama":
            check_llama_shape(self.d_model, self.n_head, self.n_kv_heads, self.ffn_width)
        elif self.kv_heads is not None or self.ffn_size is not None:
            raise ValueError("--kv-heads and --ffn-size shape the Llama block; add --arch llama")
        backend.check_dtype(self.dtype)

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads: kv_heads, or n_head (multi-head attention; GPT-2 always)."""
        return self.n_head if self.kv_heads is None else self.kv_heads

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden width: ffn_size, or 4·d_model."""
        return 4 * self.d_model if self.ffn_size is None else self.ffn_size

    def has_experts(self, block: int) -> bool:
        return self.n_experts > 0 and block % self.moe_every == self.moe_every - 1


class GPT(Module):
    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config, self.seed = config, seed
        rng = np.random.default_rng(seed)
        c, dt = config, config.dtype
        self.wte = Embedding(c.vocab_size, c.d_model, rng, dtype=dt)
        self.wpe = Embedding(c.seq_len, c.d_model, rng, dtype=dt) if c.arch == "gpt2" else None  # llama: RoPE
        self.drop = Dropout(c.dropout, seed=seed * 1000 + 1)
        self.blocks = ModuleList(self._block(i, rng) for i in range(c.n_layer))
        self.ln_f = LayerNorm(c.d_model, dtype=dt) if c.arch == "gpt2" else RMSNorm(c.d_model, dtype=dt)
        if not c.tie_weights:
            self.lm_head = Linear(c.d_model, c.vocab_size, rng, bias=False, std=0.02, dtype=dt)
        # How the blocks run: None, one after the other; or a callable (blocks, x) -> x, which
        # activation checkpointing installs (refimpl.checkpointing.apply_to_gpt).
        self.blocks_runner = None
        # (index, count): this process embeds shard `index` of `count` of every sequence
        # (sequence parallelism sets it; refimpl/parallel/tensor_parallel/gpt.py)
        self.sequence_shard = (0, 1)
        # None, or this rank's place in a context-parallel group: idx holds its shard of each sequence,
        # whose global positions context.positions(T) gives (refimpl/parallel/context_parallel/gpt.py)
        self.context = None

    def _block(self, i: int, rng: np.random.Generator):
        """Block i, its weights drawn from rng after those of the blocks before it."""
        c, seed = self.config, self.seed * 1000 + 10 * (i + 1)
        make_mlp = self._mixture_of_experts if c.has_experts(i) else None
        if c.arch == "llama":
            return LlamaBlock(c.d_model, c.n_head, c.n_kv_heads, c.ffn_width, c.seq_len, rng, c.dropout, c.n_layer,
                              c.dtype, seed=seed, rope_base=c.rope_base, make_mlp=make_mlp)
        return Block(c.d_model, c.n_head, c.seq_len, rng, c.dropout, c.n_layer, c.dtype, seed=seed, make_mlp=make_mlp)

    def _mixture_of_experts(self, rng: np.random.Generator, last_std: float) -> MoE:
        """A block's mixture of experts in place of its dense MLP (Block's make_mlp)."""
        c = self.config
        if c.arch == "llama":  # Mixtral: SwiGLU experts of the block's --ffn-size
            return MoE(c.d_model, c.n_experts, c.top_k, rng, hidden=c.ffn_width, capacity_factor=c.capacity_factor,
                       aux_coef=c.aux_coef, last_std=last_std, dtype=c.dtype, expert="swiglu")
        return MoE(c.d_model, c.n_experts, c.top_k, rng, capacity_factor=c.capacity_factor, aux_coef=c.aux_coef,
                   last_std=last_std, dtype=c.dtype)

    def embed(self, idx) -> Tensor:
        idx = idx.data if isinstance(idx, Tensor) else backend.asarray(idx)
        T = idx.shape[-1]
        if T > self.config.seq_len:
            raise ValueError(f"sequence of length {T} is longer than the model's seq_len {self.config.seq_len}")
        index, count = self.sequence_shard
        if self.wpe is None:  # llama: positions enter as rotary embeddings inside the blocks
            return self.drop(self.wte(idx))  # (B, T, C)
        if self.context is None:
            positions = backend.xp().arange(index * T // count, (index + 1) * T // count)  # (T,), or this shard's
        else:  # context parallel: T is this rank's tokens, at their global positions (or sequence parallel's share)
            positions = self.context.positions(T)[index * T // count:(index + 1) * T // count]  # (T,) or (T/t,)
        return self.drop(self.wte(idx) + self.wpe(positions))  # (B, T, C); sequence parallel: (B, T/t, C)

    def head(self, x: Tensor) -> Tensor:
        x = self.ln_f(x)
        if self.config.tie_weights:
            return self.wte.attend(x)  # (B, T, V): x wteᵀ
        return self.lm_head(x)  # (B, T, V); a module call, so module hooks (ZeRO-3's gathers) see it

    def forward(self, idx) -> Tensor:
        x = self.embed(idx)
        if self.blocks_runner is not None:
            x = self.blocks_runner(list(self.blocks), x)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(x)

    def loss(self, idx, targets, ignore_index: int = -100) -> Tensor:
        return F.cross_entropy(self(idx), targets, ignore_index)


class MLPClassifier(Module):
    """An MLP that maps (B, d_in) features to (B, n_classes) logits (the spirals model)."""

    def __init__(self, sizes: list[int], seed: int = 0, activation: str = "tanh", dtype: str = "float32") -> None:
        super().__init__()
        backend.check_dtype(dtype)
        self.mlp = MLP(sizes, np.random.default_rng(seed), activation, dtype=dtype)

    def forward(self, x) -> Tensor:
        x = x if isinstance(x, Tensor) else Tensor(backend.asarray(x, dtype=self.mlp.layers[0].weight.dtype))
        return self.mlp(x)

    def loss(self, x, targets) -> Tensor:
        return F.cross_entropy(self(x), targets)
