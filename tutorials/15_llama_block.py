# %% [markdown]
# # 15 · The Llama block: RMSNorm, rotary positions, SwiGLU and grouped-query attention
#
# **Launch:** `python tutorials/15_llama_block.py` from the repository root, in the virtual
# environment (or open it as a notebook with jupytext, see tutorial 01). A few seconds.
#
# Tutorial 02's GPT is GPT-2's block. What Llama, Mistral and most recent open models train is a
# variant with four changes, each small (`refimpl/nn/layers.py`, `refimpl/nn/functional.py`,
# `docs/llama.md`; `--arch llama` on the command line):
#
# - **RMSNorm** (Zhang and Sennrich 2019) instead of LayerNorm: no mean subtracted, no bias;
# - **rotary position embeddings**, RoPE (Su et al. 2021, RoFormer), instead of a learned table of
#   positions: queries and keys are *rotated* by an angle proportional to their position;
# - the **SwiGLU** MLP (Shazeer 2020): a gated unit of three matrices instead of GeLU's two;
# - **grouped-query attention**, GQA (Ainslie et al. 2023): fewer key/value heads than query heads.
#
# This tutorial takes them one by one:
#
# 1. the two blocks side by side, parameter by parameter;
# 2. RMSNorm;
# 3. rotary positions, and why attention scores then depend on positions only through their difference;
# 4. grouped-query attention: what it saves (bytes) and what it does not (arithmetic), measured;
# 5. SwiGLU, its width, and a Llama block's parameters.
#
# Legend for shapes: b batch rows, T tokens, d = `d_model`, H query heads, Hkv key/value heads,
# G = H/Hkv query heads per key/value head, D = d/H the head width, F the SwiGLU width.

# %%
import math

import numpy as np

from refimpl.autograd import Tensor, no_grad, saved_tensors
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F
from refimpl.nn.layers import GroupedQueryAttention

np.set_printoptions(linewidth=120, precision=4, suppress=True)

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. Two blocks side by side
#
# ```
# GPT-2 block                                 Llama block
# x = x + attn(LayerNorm(x))                  x = x + gqa(RMSNorm(x))        rotary q, k inside
# x = x + W₂ gelu(W₁ LayerNorm(x))            x = x + W₂(silu(W₁ h) ⊙ W₃ h),  h = RMSNorm(x)
# positions: wpe[0:T] added to the input      positions: none added; q and k rotated in every block
# ```
#
# The same GPT class builds both (`GPTConfig(arch="llama", kv_heads=..., ffn_size=...)`). Here are
# one block of each, with d = 32, H = 4 query heads, and for Llama Hkv = 2 key/value heads and a
# SwiGLU width of 64:

# %%
gpt2 = GPT(GPTConfig(vocab_size=11, seq_len=13, n_layer=1, n_head=4, d_model=32), seed=0)
llama = GPT(GPTConfig(vocab_size=11, seq_len=13, n_layer=1, n_head=4, d_model=32, arch="llama", kv_heads=2,
                      ffn_size=64), seed=0)
for name, model in (("GPT-2", gpt2), ("Llama", llama)):
    print(f"{name}: {model.num_parameters():,} parameters")
    for pname, p in model.named_parameters():
        print(f"   {pname:30s} {str(p.shape):10s} {p.size:6,d}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# Llama has no `wpe` (positions enter through the rotation), no biases anywhere, one weight per norm,
# `wk` and `wv` of Hkv·D = 16 rows instead of 32 (two key/value heads), and three MLP matrices.
#
# ## 2. RMSNorm (`functional.rms_norm`)
#
# LayerNorm centres each token's vector and scales it to unit variance, then applies a gain g and a
# bias b. RMSNorm only scales, by the root mean square: y = g ⊙ x / √(mean(x²) + ε). It is cheaper
# (one reduction instead of two) and works as well in practice; re-centring turned out not to be
# what makes normalisation help.

# %%
rng = np.random.default_rng(0)
x = rng.normal(size=(2, 3, 8)) + 1.5  # a batch with a mean far from 0
g = rng.normal(size=8)
by_hand = g * x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-5)
y = F.rms_norm(Tensor(x), Tensor(g)).data
print("largest |by hand − rms_norm|:", np.abs(by_hand - y).max())
print("mean of each token's x/rms (not 0: RMSNorm does not centre, LayerNorm would):",
      (x / np.sqrt((x * x).mean(-1, keepdims=True))).mean(-1)[0])
assert np.allclose(by_hand, y, rtol=1e-12, atol=0)

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 3. Rotary positions (`functional.rotary`)
#
# A head's D numbers are read as D/2 pairs, and each pair is a point in a plane. RoPE turns pair i of
# the token at position p by the angle p·θᵢ, with θᵢ = base^(−2i/D), base 10,000 (Llama 3: 500,000):
#
#     y₂ᵢ   = x₂ᵢ cos(pθᵢ) − x₂ᵢ₊₁ sin(pθᵢ)
#     y₂ᵢ₊₁ = x₂ᵢ sin(pθᵢ) + x₂ᵢ₊₁ cos(pθᵢ)
#
# refimpl pairs *adjacent* dimensions (x₂ᵢ, x₂ᵢ₊₁), as the RoFormer paper and Meta's Llama code do.
# GPT-NeoX and Hugging Face pair dimension i with i + D/2 ("rotate_half"): the same model up to a
# fixed permutation of the rows of W_q and W_k, but weights moved from one convention to the other
# must be permuted. Pair 0 turns one radian per token; the last pair almost not at all:

# %%
D = 8
theta = 10_000.0 ** (-np.arange(0, D, 2) / D)
print("θᵢ (radians per token):", theta, "| wavelengths 2π/θᵢ (tokens):", np.round(2 * np.pi / theta, 1))
unit = np.tile([1.0, 0.0], D // 2)[None, :]  # every pair at angle 0
print("each pair's angle after rotary, in (−π, π]:")
for p in (0, 1, 2, 100):
    turned = F.rotary(Tensor(unit), [p]).data[0]
    print(f"position {p:3d}: {np.round(np.arctan2(turned[1::2], turned[0::2]), 4)}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# Rotations keep lengths, so RoPE changes no norm. And the score between a query rotated at
# position m and a key rotated at position n is
#
#     (R_m q)·(R_n k) = qᵀ R_mᵀ R_n k,
#
# which exercise 2 asks you to simplify. Before deriving it, measure it: the same q and k placed at
# different positions with the same distance n − m give the same score, and a different distance a
# different one.

# %%
q, k = rng.normal(size=(1, 64)), rng.normal(size=(1, 64))


def score(m, n):
    """(R_m q)·(R_n k) with refimpl's rotary."""
    return float(F.rotary(Tensor(q), [m]).data[0] @ F.rotary(Tensor(k), [n]).data[0])


for m, n in ((3, 7), (103, 107), (5003, 5007), (3, 8), (0, 0)):
    print(f"q at {m:5d}, k at {n:5d} (n − m = {n - m}): score {score(m, n):+.12f}")
print(f"q·k without rotation:                    {float(q[0] @ k[0]):+.12f}")
assert abs(score(3, 7) - score(5003, 5007)) < 1e-10 and abs(score(3, 7) - score(3, 8)) > 1e-3

# %% [markdown] slideshow={"slide_type": "subslide"}
# Positions are *global*: refimpl rotates token t of a sequence by t, whichever rank or pipeline stage
# computes it, and a shard of a sequence (context parallelism, tutorial 14) by the global positions
# of its tokens. Nothing about positions travels between stages: the rotation is a function of the
# position alone, and it saves nothing for backward (its cos and sin are constants; backward rotates
# the gradient back by −pθᵢ). Exercise 1 asks you to write the rotation.
#
# ## 4. Grouped-query attention (`layers.GroupedQueryAttention`)
#
# H query heads, Hkv key/value heads: query head j·G + i (G = H/Hkv, i < G) attends with key/value
# head j, as Llama's code does. Hkv = H is ordinary multi-head attention, Hkv = 1 multi-query
# attention (Shazeer 2019). `wk` and `wv` shrink; `wq` and `wo` do not:

# %%
b, T, H, D = 2, 16, 8, 4
d = H * D
x = Tensor(rng.normal(size=(b, T, d)), requires_grad=True)
for kv_heads in (8, 4, 2, 1):
    layer = GroupedQueryAttention(d, H, kv_heads, T, np.random.default_rng(0))
    with no_grad():
        shapes = [tuple(w(x).shape) for w in (layer.wq, layer.wk, layer.wv)]
    print(f"Hkv = {kv_heads}: q {shapes[0]}, k {shapes[1]}, v {shapes[2]};  wk, wv weights {layer.wk.weight.shape}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# refimpl never copies a key/value head G times (the "repeat_kv" of some implementations): it views
# the queries as (b, Hkv, G, T, D) and the keys as (b, Hkv, 1, D, T), and the matrix product
# broadcasts over the group axis; its backward sums the G query heads' gradients into the shared
# head. So the tensors saved for backward shrink with Hkv. The saved-tensor ledger (tutorial 01)
# over one layer's forward:

# %%
ledger = {}
for kv_heads in (8, 4, 2, 1):
    layer = GroupedQueryAttention(d, H, kv_heads, T, np.random.default_rng(0))
    saved_tensors.reset_peak()
    before = saved_tensors.live_bytes
    y = layer(x)
    ledger[kv_heads] = saved_tensors.peak_bytes - before
    y.sum().backward()  # frees what the forward saved
    print(f"Hkv = {kv_heads}: {ledger[kv_heads]:,} bytes saved for backward")

# %% [markdown] slideshow={"slide_type": "subslide"}
# What does not shrink is the attention itself. Each of the H query heads still computes its T×T
# scores and its weighted sum of values: count the multiply-adds of the two products from their
# operands' shapes, as `GroupedQueryAttention.core` runs them:

# %%
for kv_heads in (8, 2, 1):
    G = H // kv_heads
    scores_flops = 2 * b * kv_heads * G * T * D * T  # (b, Hkv, G, T, D) @ (b, Hkv, 1, D, T)
    values_flops = 2 * b * kv_heads * G * T * T * D  # (b, Hkv, G, T, T) @ (b, Hkv, 1, T, D)
    print(f"Hkv = {kv_heads}: q kᵀ {scores_flops:,} flops, p v {values_flops:,} flops")

# %% [markdown] slideshow={"slide_type": "subslide"}
# At inference the same keys and values are the **KV cache**: a model generating text keeps every
# earlier token's keys and values, per layer, so that each new token computes only its own. Exercise
# 3 asks for those bytes per layer and GQA's saving; the question asks what they are for Llama 3 70B.
# One consequence for tensor parallelism (tutorial 10): ranks split the key/value heads, so t ranks
# need Hkv ≥ t to split them (Llama 3 has Hkv = 8); beyond that Megatron-LM replicates each key/value
# head on t/Hkv ranks (`docs/llama.md` says what refimpl does).
#
# ## 5. SwiGLU and the block's parameters (`functional.swiglu`, `layers.SwiGLU`)
#
# The MLP is y = W₂(silu(W₁h) ⊙ W₃h), silu(a) = a·σ(a): W₁h is a *gate* that scales W₃h element by
# element. It has three d×F matrices where GPT-2's has two d×4d; keeping the MLP's parameters (and
# flops) at GPT-2's 8d² gives F = (2/3)·4d. Llama 2 7B (d = 4096) takes (2/3)·4·4096 = 10,922.7,
# rounded up to a multiple of 256: F = 11,008. Here is the gate, by hand against refimpl's:

# %%
a, up = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
silu = a / (1 + np.exp(-a))
print("largest |by hand − swiglu|:", np.abs(silu * up - F.swiglu(Tensor(a), Tensor(up)).data).max())
assert np.allclose(silu * up, F.swiglu(Tensor(a), Tensor(up)).data, rtol=1e-12, atol=1e-15)

# %% [markdown] slideshow={"slide_type": "subslide"}
# A whole Llama model is GPT-2's embedding and head around these blocks, so everything in the earlier
# tutorials runs it unchanged: the trainers, ZeRO, checkpointing, pipelines and tensor parallelism
# (`docs/llama.md` lists what is verified against one process). A few steps of the sorting task
# of tutorial 02, to see it learn:

# %%
from refimpl.data import SortTask  # noqa: E402 - used from here on
from refimpl.local_trainer import LocalTrainer  # noqa: E402
from refimpl.optim import AdamW  # noqa: E402

task = SortTask(length=6, seed=0)
model = GPT(GPTConfig(task.vocab_size, task.seq_len, n_layer=2, n_head=4, d_model=32, arch="llama", kv_heads=2,
                      ffn_size=64), seed=0)
trainer = LocalTrainer(model, AdamW(model.parameters(), lr=3e-3, weight_decay=0.0), clip=1.0)
losses = [trainer.step(*task.batch(step, 32)) for step in range(60)]
print(f"loss at step 0: {losses[0]:.3f} (ln V = {math.log(task.vocab_size):.3f}); at step 59: {losses[-1]:.3f}")
assert losses[-1] < 0.6 * losses[0]

# %% [markdown] slideshow={"slide_type": "subslide"}
# **Question (measure and explain).** (a) From part 4's ledger and flop counts and your `kv_bytes`,
# say exactly which saved bytes grouped-query attention removes, why the attention's arithmetic does
# not shrink with Hkv, and where GQA then saves time (think of generating one token at a time with a
# KV cache). (b) Llama 3 70B has 80 layers, 64 query heads, 8 key/value heads and D = 128. With
# `kv_bytes`, how many bytes does its KV cache take per sequence of 8,192 tokens and of 128K (131,072)
# tokens in bfloat16, and how much with multi-head attention? How many 8K-token caches fit in 40 GB?
# (c) Exercise 2 shows that a score depends on positions only through n − m. What does that buy a
# model, and why does it not, by itself, let a model trained on 4,096 tokens work on 16K (compute the
# wavelengths 2π/θᵢ for D = 128 at base 10,000 and 500,000)? (d) Measure what breaks the property: cut
# a sequence of 8 tokens into two chunks of 4 and rotate each chunk's q and k with positions 0 … 3
# instead of their global positions. Which causal scores change, by how much, and why? Name two other
# ways to break it.
#
# ## Exercises
#
# **Exercise 1.** `rotary(x, positions, base)`: RoPE as refimpl computes it (part 3). `x` is a NumPy
# array of shape (…, T, D) with D even, `positions` an integer array of shape (T,) (row t of x is the
# token at global position positions[t]), `base` a float. Return a new array of x's shape: pair i of
# row t, (x₂ᵢ, x₂ᵢ₊₁), turned by positions[t]·θᵢ, θᵢ = base^(−2i/D). Leave x unchanged. The check
# compares with `functional.rotary` on inputs drawn anew every run (leading axes or none, positions
# that do not start at 0, bases 10,000, 500,000 and others).
#
# **Exercise 2.** `relative_score(q, k, delta, base)`: q and k are vectors of D numbers; return the
# score (R_m q)·(R_n k) of q rotated at position m and k rotated at position n, given only their
# offset delta = n − m. Derive first that this is possible: simplify R_mᵀ R_n (a rotation's inverse
# is its transpose; rotations of the same pairs add their angles). The check draws vectors, positions
# m and n and a shift s, computes the two scores at (m, n) and (m + s, n + s) with refimpl's rotary,
# and compares both with your function, which sees only n − m: it can pass only because the property
# holds.
#
# **Exercise 3.** `kv_bytes(b, T, n_head, kv_heads, d_head, itemsize)`: the bytes of the keys and
# values one attention layer computes for b sequences of T tokens with `kv_heads` key/value heads of
# width `d_head` (what backward keeps of them, and what a KV cache holds per layer), and the factor by
# which grouped-query attention shrinks them against multi-head attention with `n_head` heads, as the
# pair `(bytes, saving)`. The check builds refimpl's `GroupedQueryAttention` of each shape and
# measures the arrays its `wk` and `wv` produce.
#
# **Exercise 4.** `block_parameters(d_model, n_head, kv_heads, ffn_size)`: the parameters of one Llama
# block (two RMSNorms, grouped-query attention, SwiGLU of width `ffn_size`; part 1 lists one). The
# check builds refimpl's `LlamaBlock` for small shapes and compares the published shapes (Llama 2 7B:
# d 4096, 32 heads, 32 key/value heads, F 11,008; Llama 3 8B, 70B and 405B) with refimpl's memory
# model (`memory.llama_parameter_tensors`). Times 32 layers, plus two embeddings of 32,000 × 4,096
# and the final norm, Llama 2 7B's total should come to 6.74 billion (the "7B" of its name).

# %%
from harness import Exercises  # noqa: E402 - the exercises start here, as in every tutorial
from harness.llama import check_block_parameters, check_kv_bytes, check_relative_score, check_rotary  # noqa: E402

ex = Exercises("15_llama_block")


@ex.stub
def rotary(x, positions, base):
    raise NotImplementedError("exercise 1")


@ex.stub
def relative_score(q, k, delta, base):
    raise NotImplementedError("exercise 2")


@ex.stub
def kv_bytes(b, T, n_head, kv_heads, d_head, itemsize):
    raise NotImplementedError("exercise 3")


@ex.stub
def block_parameters(d_model, n_head, kv_heads, ffn_size):
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_rotary, rotary)
ex.check(2, check_relative_score, relative_score)
ex.check(3, check_kv_bytes, kv_bytes)
ex.check(4, check_block_parameters, block_parameters)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
