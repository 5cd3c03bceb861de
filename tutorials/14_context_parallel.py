# %% [markdown]
# # 14 · Context parallelism: ring attention and Ulysses
#
# **Launch:** `python tutorials/14_context_parallel.py` from the repository root, in the virtual
# environment with `mpiexec` (the `mpi` or `test` extra). Part 5 starts `mpiexec -n 4` through
# `subprocess`; parts 1 to 4 run inside this process.
#
# Data, tensor, pipeline and expert parallelism all give every rank whole sequences. A long
# sequence has one cost none of them divides: attention, whose every query needs every earlier key.
# **Context parallelism** cuts the sequence itself over C ranks: each rank holds T/C tokens of every
# activation, and the attention layers exchange what they must so that every query still sees every
# earlier key. Two algorithms are in use, and refimpl has both
# (`refimpl/parallel/context_parallel/`, `docs/context_parallel.md`):
#
# - **ring attention** (Liu, Zaharia and Abbeel 2023, arXiv 2310.01889; Megatron-LM's context
#   parallelism): queries stay, key/value blocks travel around a ring of ranks, and each rank merges
#   the partial results with the *online softmax*;
# - **DeepSpeed-Ulysses** (Jacobs et al. 2023, arXiv 2309.14509): an all-to-all turns sequence
#   shards into head shards, each rank attends over whole sequences of H/C heads, and another
#   all-to-all turns the output back.
#
# This tutorial shows
#
# 1. the sequence in 2C chunks, and which two each rank holds;
# 2. blockwise attention: the online softmax, which merges partial results exactly;
# 3. the ring, simulated rank by rank in this process, against one process's attention;
# 4. the causal work per rank, with and without load balancing;
# 5. ring attention and Ulysses on 4 processes: outputs, gradients and bytes against the formulas;
# 6. ring or Ulysses: bytes per rank, from the formulas.
#
# Legend for shapes: b batch rows, H query heads, Hkv key/value heads (grouped-query attention;
# Hkv = H without it), T tokens, D = d_head, C ranks, c = T/(2C) tokens per chunk, i the itemsize.

# %%
import math

import numpy as np
from harness import last_json, run_mpi

from refimpl.parallel.context_parallel import accounting, blockwise, layout
from refimpl.parallel.context_parallel.blockwise import EMPTY, forward_block, grouped, pair_kind

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. The sequence in 2C chunks (`refimpl/parallel/context_parallel/layout.py`)
#
# The T tokens are cut into 2C chunks of c = T/(2C) tokens; chunk k holds positions k·c … (k+1)·c − 1.
# Every rank holds two chunks, its *shard* of T/C tokens. The obvious split gives rank r chunks 2r
# and 2r + 1 (*contiguous*). Under a causal mask that is unfair: query chunk i attends to key chunks
# 0 … i, so the rank holding the end of the sequence does far more work than the one holding its
# start. The *balanced* layout (Megatron-LM; Llama 3, Dubey et al. 2024, §3.3.2) pairs an early
# chunk with a late one: rank r holds chunks r and 2C − 1 − r.

# %%
C, T = 4, 16
for name in layout.LAYOUTS:
    print(f"{name:10s}", "   ".join(f"rank {r}: chunks {layout.rank_chunks(C, r, name)}" for r in range(C)))
print("rank 1's positions, balanced:", layout.positions(T, C, 1).tolist())
x = np.arange(T) * 10.0
shards = [layout.shard(x, C, r, axis=0) for r in range(C)]
assert np.array_equal(layout.unshard(shards, axis=0), x)  # every rank's shard, back in global order

# %% [markdown] slideshow={"slide_type": "subslide"}
# `shard(x, C, r)` cuts rank r's tokens out of a global array and `unshard` puts every rank's back in
# global order: that is how refimpl's tests build each rank's input from one batch and compare each
# rank's output with one process's. Positions stay *global*: rank 1's tokens are 2, 3, 12 and 13 of
# the sequence, and the causal mask is decided by those numbers, not by where a token sits in the
# shard. Exercise 2 asks for `rank_chunks` in both layouts.
#
# ## 2. Blockwise attention and the online softmax (`refimpl/parallel/context_parallel/blockwise.py`)
#
# A query row's attention against T keys is y = Σⱼ pⱼ vⱼ with p = softmax(s), s = q kᵀ/√D. It does not
# need the whole row of scores at once. Cut the keys into blocks and keep, for each block and row,
# three summaries: the block's largest score m, the sum l = Σⱼ exp(sⱼ − m) and the *unnormalised*
# output o = Σⱼ exp(sⱼ − m)·vⱼ. Subtracting m keeps every exponential at most 1 (no overflow); a
# key the mask hides has s = −∞ and contributes exp(−∞) = 0; a row the mask empties in a block
# summarises as (m, l, o) = (−∞, 0, 0).

# %%
def block_summary(s, v):
    """(m, l, o) of rows of scores s (R, n), −inf where masked, against values v (n, D)."""
    m = s.max(axis=1)  # (R,)
    shift = np.where(np.isfinite(m), m, 0.0)  # a row the mask empties: exp(−∞ − 0) = 0, not NaN
    p = np.exp(s - shift[:, None])  # (R, n), each at most 1
    return m, p.sum(axis=1), p @ v  # (R,), (R,), (R, D)


rng = np.random.default_rng(0)
s, v = rng.normal(size=(3, 12)) * 4, rng.normal(size=(12, 2))
s[2, :4] = -np.inf  # row 2: the mask hides the first block's keys
blocks = [block_summary(s[:, j:j + 4], v[j:j + 4]) for j in (0, 4, 8)]
print("block maxima m per row:", np.round([b[0] for b in blocks], 3).T.tolist())

# %% [markdown] slideshow={"slide_type": "subslide"}
# Two summaries of the same rows merge exactly (Milakov and Gimelshein 2018; FlashAttention, Dao et
# al. 2022, §3.1) once both are rescaled to the larger maximum m = max(m₁, m₂): each sum was taken
# against its own maximum, and exp(sⱼ − m) = exp(sⱼ − mᵢ)·exp(mᵢ − m). After the last block,
# y = o / l, and L = m + log l is the row's log-sum-exp: all that backward needs of the softmax,
# since pⱼ = exp(sⱼ − L). refimpl's merge is `blockwise.merge`; exercise 1 asks you to write it.

# %%
state = None
for summary in blocks:
    state = blockwise.merge(state, summary)  # merge(None, x) is x: the first block
m, l, o = state
y = o / l[:, None]
p = np.exp(s - s.max(axis=1, keepdims=True))
y_whole = (p / p.sum(axis=1, keepdims=True)) @ v  # the softmax over the whole row
print("blockwise y:", np.round(y, 6).tolist())
print("whole row y:", np.round(y_whole, 6).tolist())
print("log-sum-exp:", np.round(m + np.log(l), 6).tolist(), "=", np.round(np.log(np.exp(s).sum(axis=1)), 6).tolist())
assert np.allclose(y, y_whole, rtol=1e-12, atol=0)

# %% [markdown] slideshow={"slide_type": "subslide"}
# Backward is FlashAttention's (Dao et al. 2022, Algorithm 4): save q, k, v, the output y and L, never
# a block's probabilities. Each block recomputes its scores and p = exp(s − L) and adds its share to
# dq, dk and dv (`blockwise.backward_block`). Attention's memory then grows with T, not T².
#
# With a causal mask, query chunk i against key chunk j (global chunk numbers) is **full** (j < i),
# a **diagonal** triangle (j = i: the c×c block is computed whole and the upper triangle masked) or
# **empty** (j > i: nothing survives the mask, so it is *skipped*, not computed): `pair_kind(i, j)`.
#
# ## 3. The ring, simulated rank by rank
#
# Ring attention over C ranks: rank r keeps its queries. At step t = 0 … C − 1 it holds the key/value
# block (two chunks) of rank (r − t) mod C, computes its two query chunks against the block's two key
# chunks (skipping empty pairs) and merges each into its running (m, l, o); then it passes the block
# to rank r + 1 and receives the next from r − 1 (refimpl posts that transfer *before* computing, so
# the two overlap). After C steps every rank has seen every block. Here are the C ranks, one after
# the other, in this process, counting the score elements each computes and the bytes each sends:

# %%
def ring_in_one_process(q, k, v, C, lay):
    """Each rank's output shard, score elements computed and bytes sent: causal ring attention, simulated."""
    b, H, T, D = q.shape
    c, scale = T // (2 * C), 1 / math.sqrt(D)
    shard = [[grouped(layout.shard(x, C, r, layout=lay), k.shape[1]) for x in (q, k, v)] for r in range(C)]
    outputs, scores, sent = [], [], []
    for r in range(C):
        mine, states, computed, nbytes = layout.rank_chunks(C, r, lay), [None, None], 0, 0
        for t in range(C):
            source = (r - t) % C  # whose K/V block rank r holds at step t
            _, k_held, v_held = shard[source]
            for a, i in enumerate(mine):
                for j_local, j in enumerate(layout.rank_chunks(C, source, lay)):
                    kind = pair_kind(i, j)
                    if kind == EMPTY:
                        continue  # the causal skip
                    keys = slice(j_local * c, (j_local + 1) * c)
                    qa = shard[r][0][..., a * c:(a + 1) * c, :]
                    states[a] = blockwise.merge(states[a], forward_block(qa, k_held[..., keys, :],
                                                                         v_held[..., keys, :], kind, scale))
                    computed += b * H * c * c
            if t < C - 1:
                nbytes += k_held.nbytes + v_held.nbytes  # the block goes on to rank r + 1
        y = np.concatenate([blockwise.finish(st)[0] for st in states], axis=-2).reshape(b, H, T // C, D)
        outputs.append(y)
        scores.append(computed)
        sent.append(nbytes)
    return outputs, scores, sent


def dense_causal_attention(q, k, v):
    """One process: softmax(q kᵀ/√D, causal) v, the T×T scores whole (grouped heads: G = H/Hkv)."""
    G, T = q.shape[1] // k.shape[1], q.shape[2]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    s[..., np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


b, H, Hkv, T, D, C = 1, 4, 2, 16, 3, 4
q, k, v = rng.normal(size=(b, H, T, D)), rng.normal(size=(b, Hkv, T, D)), rng.normal(size=(b, Hkv, T, D))
reference = dense_causal_attention(q, k, v)
results = {}
for lay in layout.LAYOUTS:
    outputs, scores, sent = results[lay] = ring_in_one_process(q, k, v, C, lay)
    error = np.abs(layout.unshard(outputs, layout=lay) - reference).max()
    print(f"{lay:10s} largest |ring − one process| {error:.1e}; bytes sent per rank {sent}")
    assert error < 1e-12

# %% [markdown] slideshow={"slide_type": "subslide"}
# Every rank sends C − 1 blocks of 2 chunks, keys and values: with k = 2·b·Hkv·c·D·i bytes for one
# chunk's K and V, 2(C − 1)·k per rank, whatever the layout. Backward sends the K/V blocks round
# again, and beside them their gradients dK and dV, accumulated by each rank they visit and delivered
# home after the last hop: twice the forward's bytes. Exercise 4 asks for both. refimpl's ring also
# sends *fewer* bytes: a chunk travels on only while a rank further along still attends to it, and a
# gradient chunk only once someone has added to it (exercise 5).
#
# ## 4. Causal work per rank, with and without balancing
#
# The score elements each rank computed above (per forward; backward recomputes as many), beside
# `accounting.score_elements` (`refimpl/parallel/context_parallel/accounting.py`):

# %%
shape = accounting.AttentionShape(b, H, Hkv, T, D, C)
for lay in layout.LAYOUTS:
    formula = [accounting.score_elements(shape, r, "ring", lay)["computed"] for r in range(C)]
    measured = results[lay][1]
    print(f"{lay:10s} score elements per rank {measured}  formula {formula}  "
          f"slowest / mean {max(measured) / np.mean(measured):.2f}")
    assert measured == formula

# %% [markdown] slideshow={"slide_type": "subslide"}
# Balanced, every rank does the same work; contiguous, rank C − 1 does most, and every ring step waits
# for the slowest rank. Which chunk pairs rank r computes, balanced (◣ diagonal, ■ full, · skipped):
#
# ```
# against its own block         against rank s < r's              against rank s > r's
#           key r   key 2C−1−r           key s   key 2C−1−s                key s   key 2C−1−s
# q r       ◣       ·            q r       ■       ·                 q r       ·       ·
# q 2C−1−r  ■       ◣            q 2C−1−r  ■       ·                 q 2C−1−r  ■       ■
# ```
#
# Exercise 3 asks you to count, per (batch row, head), the score elements rank r computes in each
# layout, and the question asks why the balanced layout makes them equal.
#
# ## 5. Ring attention and Ulysses on 4 processes
#
# The real thing: `ring_attention(q, k, v, comm)` (`refimpl/parallel/context_parallel/ring_attention.py`)
# and `ulysses_attention(q, k, v, comm)` (`ulysses.py`) are autograd Functions over a communicator.
# Each of 4 MPI processes takes its shard of the same global q, k, v, runs forward and backward, and
# reports the bytes it sent (the communicator's counters) and the score elements it computed; rank 0
# gathers the outputs and gradients and compares them with one process's.
# (Under a single process, `get_world()` is a world of one and the ring has nothing to send.)

# %%
PROGRAM = """
import json
import numpy as np
from refimpl.autograd.tensor import Tensor
from refimpl.parallel.comm import get_world
from refimpl.parallel.context_parallel import accounting, layout
from refimpl.parallel.context_parallel.blockwise import Work, causal_attention
from refimpl.parallel.context_parallel.ring_attention import ring_attention
from refimpl.parallel.context_parallel.ulysses import ulysses_attention

world = get_world()
C, r = world.size, world.rank
b, H, Hkv, T, D = 2, 8, 4, 24, 3                     # grouped-query attention: 2 query heads per K/V head
rng = np.random.default_rng(0)
q, k, v, g = (rng.normal(size=(b, h, T, D)) for h in (H, Hkv, Hkv, H))
whole = [Tensor(x, requires_grad=True) for x in (q, k, v)]
y_whole = causal_attention(*whole)                   # one process, for comparison
(y_whole * Tensor(g)).sum().backward()
wanted = [y_whole.data] + [x.grad for x in whole]
shape = accounting.AttentionShape(b, H, Hkv, T, D, C)
report = []
for impl, lay, skip in [("ring", "balanced", True), ("ring", "balanced", False), ("ring", "contiguous", True),
                        ("ulysses", "balanced", True)]:
    mine = [Tensor(layout.shard(x, C, r, layout=lay), requires_grad=True) for x in (q, k, v)]
    attention = ring_attention if impl == "ring" else ulysses_attention
    work, start = Work(), world.counters.total_bytes
    y = attention(*mine, world, layout=lay, causal_skip=skip, work=work)
    forward = world.counters.total_bytes - start
    (y * Tensor(layout.shard(g, C, r, layout=lay))).sum().backward()
    backward = world.counters.total_bytes - start - forward
    formula = accounting.ring_bytes(shape, r, lay, skip) if impl == "ring" else accounting.ulysses_bytes(shape)
    shards = world.allgather_object([y.data] + [x.grad for x in mine])
    error = max(float(np.abs(layout.unshard([s[n] for s in shards], layout=lay) - wanted[n]).max()) for n in range(4))
    report.append({"impl": f"{impl}, {lay}" + ("" if skip else ", no skip"), "bytes": [forward, backward],
                   "formula": [formula["forward"], formula["backward"]], "scores": work.forward_scores,
                   "error": error})
everyone = world.allgather_object(report)
if r == 0:
    print(json.dumps(everyone))
"""
done = run_mpi(4, "-c", PROGRAM, show=False)
ranks = last_json(done)
print("per rank 0, 1, 2, 3:  bytes sent forward | bytes sent backward | score elements computed")
for n, row in enumerate(ranks[0]):
    forward, backward, scores = ([rank[n][key] if i < 0 else rank[n][key][i] for rank in ranks]
                                 for key, i in (("bytes", 0), ("bytes", 1), ("scores", -1)))
    print(f"{row['impl']:24s} {forward} | {backward} | {scores}")
    for rank in ranks:
        assert rank[n]["bytes"] == rank[n]["formula"] and rank[n]["error"] < 1e-12, rank[n]
print("every output and gradient equals one process's (largest |difference|",
      f"{max(rank[n]['error'] for rank in ranks for n in range(4)):.1e}); every byte count equals accounting.py's")

# %% [markdown] slideshow={"slide_type": "subslide"}
# Without the causal skip every rank sends 2(C − 1)·k = 6 · 1,152 = 6,912 bytes forward and twice that
# backward (k = 2·b·Hkv·c·D·8 = 1,152 bytes here, c = 3). With the skip the balanced ring sends one
# chunk fewer forward on ranks 0 … C − 2 and fewer gradient chunks backward. Ulysses sends the same in
# both directions, (C − 1)/C·b·(T/C)·D·(2H + 2Hkv)·i bytes per rank: q, k, v there and y back.
#
# ## 6. Ring or Ulysses?
#
# Which sends fewer bytes depends on the heads. The ring moves only keys and values, Hkv heads of
# them, around C − 1 hops; Ulysses moves queries, keys, values and the output, but only (C − 1)/C of
# each, once. Forward bytes per rank at T = 8192, D = 128, 2-byte numbers, for multi-head attention
# and for grouped-query attention with 4 query heads per key/value head:

# %%
print(f"{'C':>3s} {'H':>4s} {'Hkv':>4s} {'ring (MB)':>10s} {'Ulysses (MB)':>13s}")
for heads, kv_heads in [(32, 32), (32, 8)]:
    for C in (2, 4, 8):
        shape = accounting.AttentionShape(1, heads, kv_heads, 8192, 128, C, 2)
        ring = accounting.ring_bytes(shape, 0, causal_skip=False)["forward"]
        ulysses = accounting.ulysses_bytes(shape)["forward"]
        print(f"{C:>3d} {heads:>4d} {kv_heads:>4d} {ring / 1e6:>10.1f} {ulysses / 1e6:>13.1f}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# **Question (measure and explain).** (a) From the formulas (`accounting.ring_bytes` without the
# skip, `accounting.ulysses_bytes`) and the table above, derive the ratio of the ring's forward bytes
# per rank to Ulysses' in terms of C, H and Hkv. Where does each send less, for multi-head attention
# and for grouped-query attention, in forward and per training step (forward and backward)? How do
# the two grow with C at a fixed T? (b) What limits Ulysses' degree C, and what would you do for a
# model with 32 query heads and 8 key/value heads at C = 16? (c) From part 4, explain why the
# balanced layout gives every rank the same number of score elements, for any C, and what the
# contiguous layout costs in step time. (d) Bytes are not time: the ring posts each transfer before
# computing the block it holds. How do a block's compute and its bytes grow with the chunk length
# c, and from which c (for given flop rate and bandwidth) is the transfer hidden? Where do Ulysses'
# all-to-alls sit?
#
# ## Exercises
#
# **Exercise 1.** `merge(a, b)`: the online softmax. `a = (m1, l1, o1)` and `b = (m2, l2, o2)` are
# the summaries of part 2 for the same R query rows against two blocks of keys: m and l of shape
# (R,), o of shape (R, D). Return the merged `(m, l, o)`, new arrays (leave the inputs unchanged),
# such that merging the blocks of a row in any order and dividing o by l gives the softmax over the
# whole row. A row the mask empties in a block has (−∞, 0, 0) there; in both blocks, the merged row
# must be (−∞, 0, 0) too, never NaN. The check draws new rows every run: it compares single merges
# with refimpl's on rows made to trip the usual mistakes (an empty block, scores near 1000 whose
# exponentials overflow), then merges the blocks of whole rows in two orders against the softmax.
#
# **Exercise 2.** `rank_chunks(C, r, layout)`: the two global chunk indices (of 0 … 2C − 1) rank r
# holds, in the order its shard holds them, for `layout` "balanced" and "contiguous" (part 1).
#
# **Exercise 3.** `causal_work(C, r, c, layout)`: the score elements (entries of q kᵀ) rank r
# computes in one forward of causal ring attention with the causal skip, per batch row and head,
# with chunks of c tokens: the count of part 4, for either layout. A diagonal pair is computed whole
# (c² elements) and masked; an empty one is skipped. The check compares with `accounting.py` for
# C from 1 to 8.
#
# **Exercise 4.** `ring_bytes(C, b, kv_heads, T, d_head, itemsize)`: the bytes one rank sends in one
# ring attention call without the causal skip, as the pair `(forward, backward)` (part 3: K/V blocks
# around the ring, then K/V again and dK/dV in backward). The check compares with
# `accounting.ring_bytes`, which the communicator's counters match byte for byte (part 5).
#
# **Exercise 5.** `ring_bytes_skipped(C, r, b, kv_heads, T, d_head, itemsize)`: the same with the
# causal skip, balanced layout, for rank r, as `(forward, backward)`. Derive it from two rules: at
# step t (t = 0 … C − 2) a rank passes on a chunk of the K/V block it holds only if some rank still
# to receive that block (r + 1, …, up to the block's owner, not included) attends to that chunk; and
# at step t (t = 1 … C − 1) a rank passes on a chunk's dK/dV (last step: home to its owner) only if
# some rank that has held the block since its owner (owner + 1, …, r) has attended to that chunk.
# Which chunks does each rule drop, on which ranks? The check compares with `accounting.ring_bytes`
# for every rank at C from 1 to 4.

# %%
from harness import Exercises  # noqa: E402 - the exercises start here, as in every tutorial
from harness.context_parallel import (  # noqa: E402
    check_causal_work,
    check_merge,
    check_rank_chunks,
    check_ring_bytes,
    check_ring_bytes_skipped,
)

ex = Exercises("14_context_parallel")


@ex.stub
def merge(a, b):
    raise NotImplementedError("exercise 1")


@ex.stub
def rank_chunks(C, r, layout):
    raise NotImplementedError("exercise 2")


@ex.stub
def causal_work(C, r, c, layout):
    raise NotImplementedError("exercise 3")


@ex.stub
def ring_bytes(C, b, kv_heads, T, d_head, itemsize):
    raise NotImplementedError("exercise 4")


@ex.stub
def ring_bytes_skipped(C, r, b, kv_heads, T, d_head, itemsize):
    raise NotImplementedError("exercise 5")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_merge, merge)
ex.check(2, check_rank_chunks, rank_chunks)
ex.check(3, check_causal_work, causal_work)
ex.check(4, check_ring_bytes, ring_bytes)
ex.check(5, check_ring_bytes_skipped, ring_bytes_skipped)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
