"""Reference solutions to tutorial 15's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""

import numpy as np


def rotary(x, positions, base):
    # Pair i = (x₂ᵢ, x₂ᵢ₊₁) of row t turns by positions[t]·θᵢ, θᵢ = base^(−2i/D).
    D = x.shape[-1]
    theta = base ** (-np.arange(0, D, 2) / D)  # (D/2,)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * theta  # (T, D/2)
    cos, sin = np.cos(angles), np.sin(angles)
    even, odd = x[..., 0::2], x[..., 1::2]  # (…, T, D/2) each
    y = np.empty_like(x)
    y[..., 0::2] = even * cos - odd * sin
    y[..., 1::2] = even * sin + odd * cos
    return y


def relative_score(q, k, delta, base):
    # (R_m q)·(R_n k) = qᵀ R_mᵀ R_n k = qᵀ R_(n−m) k: a rotation's transpose is the rotation back, and two
    # rotations of the same pairs add their angles. So rotate k alone, by delta = n − m.
    k_rotated = rotary(np.asarray(k, dtype=np.float64)[None, :], [delta], base)[0]
    return float(np.dot(q, k_rotated))


def kv_bytes(b, T, n_head, kv_heads, d_head, itemsize):
    # wk and wv each produce (b, T, kv_heads·d_head): keys and values of the kv_heads heads, never copied
    # per query head. Multi-head attention has n_head of them: the saving is n_head / kv_heads.
    nbytes = 2 * b * T * kv_heads * d_head * itemsize
    return nbytes, n_head / kv_heads


def block_parameters(d_model, n_head, kv_heads, ffn_size):
    # wq, wo: d×d; wk, wv: d×(kv_heads·d_head); SwiGLU's w1, w3, w2: d×F each; two RMSNorm gains; no biases.
    kv_width = kv_heads * (d_model // n_head)
    return 2 * d_model * d_model + 2 * d_model * kv_width + 3 * d_model * ffn_size + 2 * d_model


ANSWER = """
Model answer to the question (measure and explain).

(a) Measured in part 4 (b = 2, T = 16, H = 8, D = 4, float64, one GroupedQueryAttention layer's forward): the
saved-tensor ledger holds 73,728 bytes at Hkv = 8, 65,536 at Hkv = 4, 61,440 at 2 and 59,392 at 1. The differences,
8,192, 4,096 and 2,048 bytes, are exactly the keys and values that no longer exist (kv_bytes: 16,384 bytes of K
and V at Hkv = 8, 8,192 at 4, 4,096 at 2, 2,048 at 1), and nothing else changes: q, the probabilities and the
heads' output stay. The attention's arithmetic does not shrink: every one of the H query heads still computes its
T×T scores q·kᵀ and its weighted sum of values, 2·b·H·T²·D flops each (32,768 and 32,768 in part 4, at every
Hkv). Grouped-query attention shares one key/value head among G query heads; it removes no query head. Only wk
and wv shrink (their weights from 2·d² to 2·d·Hkv·D, their flops in proportion), a small share of the block.
Where it pays is memory and memory traffic: the K/V saved for backward, the KV cache at inference, and above
all decoding, where each new token reads the layer's whole cache for little arithmetic (memory-bandwidth
bound), so the attention's time per generated token falls with the cache, by up to H/Hkv, and larger batches
fit beside the weights.

(b) Llama 3 70B: 80 layers, 64 query heads, 8 key/value heads, D = 128, 2-byte (bf16) cache. With kv_bytes,
per layer and sequence of T = 8,192 tokens 2·8,192·8·128·2 = 33.6 MB, times 80 layers: 2.68 GB per sequence
(21.5 GB with 64 key/value heads: the saving 8x). At T = 128K (131,072): 42.9 GB per sequence with GQA,
344 GB without. So 40 GB of spare memory holds 14 caches of 8K tokens with GQA, one without. A 128K context's
cache alone is more than half of an 80 GB GPU, beside 140 GB of bf16 weights that need several GPUs anyway; it
is split with the key/value heads over the tensor-parallel ranks (8 heads over t = 8: one head, 5.4 GB, per
rank). Tensor parallelism cannot split 8 key/value heads over more than 8 ranks: beyond that each head is
replicated on t/8 ranks (Megatron-LM), and its cache with it.

(c) The relative property (exercise 2): (R_m q)·(R_n k) = q·(R_(n−m) k), so a score depends on the two tokens and
their distance only, never on where the pair sits. What that buys: the same phrase gets the same attention
pattern at position 10 or 10,000; a token's rotated key is computed once and cached (its position never changes);
a shard of a sequence (context parallelism, pipeline stages) is rotated by its global positions and nothing
else needs to travel. What it does not buy is extrapolation. Pair i turns by θᵢ = base^(−2i/D) per token, a
wavelength 2π/θᵢ from 6.3 tokens (i = 0) to 2π·base^((D−2)/D): 54,410 tokens at base 10,000 and D = 128
(2.56 million at 500,000). Trained on 4,096 tokens, the slowest pair has turned at most 0.47 radians (4,096·θ₆₃),
less than a tenth of a turn: the model has never seen those pairs at the angles that distances of 16K tokens
produce, and its attention there is untrained (perplexity rises past the training length). Remedies keep the
property and change the angles: a larger base (Llama 3: 500,000, so long distances stay within angles seen
during a long-context phase of training), or interpolating positions (p divided by the stretch factor), each
with some training on long sequences.

(d) Measured (T = 8, D = 16, random q and k): with each chunk of 4 rotated by positions 0 … 3 instead of its
global positions, the 20 causal scores within a chunk are unchanged (their offsets n − m are the same), and all
16 scores between a query of the second chunk and a key of the first change, by up to 3.4 here (scores of order
4): each is computed at the offset n − m + 4, as if the key were 4 tokens closer. A position error common to q and
k cancels; one that differs between them shifts the score's offset by the difference. That is why refimpl's
context parallelism passes each shard its global positions. Two other ways to break the property: rotating q and
k by different rules (different bases, or "rotate_half" pairs on one side and adjacent pairs on the other, e.g.
weights converted from Hugging Face without permuting the rows of W_q and W_k), or computing the angles p·θᵢ in low
precision: in bfloat16 (8 significant bits) p·θ₀ = 3,000 is rounded by up to 8 radians, so the rotation is
garbage; the angles are computed in float32 or float64, and only the rotated values are stored in low precision.
Adding a learned absolute position embedding to the input as well would also make scores depend on m and n.
"""
