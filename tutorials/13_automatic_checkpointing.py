# %% [markdown]
# # 13 · Automatic checkpointing on any graph
#
# **Launch:** `python tutorials/13_automatic_checkpointing.py` from the repository root, in the
# virtual environment.
#
# Tutorial 06 checkpointed a *chain* of layers: keep some layer inputs, recompute the rest. Real
# networks are not chains: a residual network adds a block's input back to its output, and a
# transformer block is a graph of some twenty operations with a residual stream through it.
# Salimans and Bulatov's gradient-checkpointing package (OpenAI, 2018), the package that made √n
# checkpointing popular, works on the graph itself: it records the forward graph, finds the
# tensors where a cut is safe, and keeps about √n of them. refimpl does the same inside its own
# engine (`refimpl/checkpointing/graph.py`, `auto.py`; `docs/checkpointing.md`).

# %%
import numpy as np
from harness.auto_checkpointing import Residual, measure

from refimpl.autograd import Tensor
from refimpl.checkpointing import AutoCheckpoint, articulation_points, record
from refimpl.checkpointing.auto import inner_articulation_points, memory_rule, speed_rule
from refimpl.nn import GPT, GPTConfig

# %% [markdown]
# ## 1. Recording a graph
#
# `record(fn, x)` runs `fn` once in *recording mode*: every operation the engine runs is noted
# down (the engine's hook, `refimpl/autograd/recording.py`), nothing is saved for backward. Every
# tensor that depends on the input gets a name `t0, t1, …` in the order it was computed, so a
# tensor's number is a topological position. Parameters and constants are not tensors of the
# graph. Here is a residual network of 6 tanh layers with a skip every 2 layers:

# %%
model = Residual(6, 4, k=2)
graph = record(model, Tensor(np.zeros((2, 4)), requires_grad=True))
for node in graph.nodes:
    ins = [f"t{a[1]}" for a in node.args if a[0] == "v"]
    print(f"{node.op:15s} {', '.join(ins):10s} -> {', '.join(f't{w}' for w in node.outputs)}")

# %% [markdown]
# ## 2. Articulation points
#
# Which tensors can be kept so that everything before them may be forgotten? Those that *every*
# path from the input to the loss passes through: the graph's **articulation points**. Inside a
# residual pair, the layer outputs are bypassed by the skip, so only the sums qualify:

# %%
print([graph.describe(v) for v in articulation_points(graph)])

# %% [markdown]
# The test is linear in the size of the graph: with tensors numbered topologically, v is an
# articulation point exactly when no edge (u, w) jumps over it, u < v < w (exercise 1 asks you
# to write it). In a pre-LN transformer block the residual stream bypasses everything but the
# two residual sums:

# %%
gpt = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=2, n_head=2, d_model=16, dtype="float64"), seed=0)


def blocks(h):
    for block in gpt.blocks:
        h = block(h)
    return h


gpt_graph = record(blocks, gpt.embed(np.zeros((2, 8), dtype=np.int64)))
cuts = inner_articulation_points(gpt_graph)
print(f"{len(gpt_graph.nodes)} operations, articulation points inside: {[gpt_graph.describe(v) for v in cuts]}")

# %% [markdown]
# ## 3. The rules, measured
#
# - `auto:memory`: k = ⌈√m⌉ of the m articulation points, spaced by the bytes they hold;
# - `auto:speed`: the outputs of the matrix products, so that only cheap elementwise operations
#   are recomputed (these are *not* articulation points: the graph is cut elsewhere too);
# - a list of tensors, or a function of the graph: your own rule.
#
# `AutoCheckpoint(fn, rule)` records on its first call and plans; then every call runs the
# user's Python as usual, but the operations that feed a checkpoint save *references* instead of
# arrays. When backward reads one, the segment it belongs to is recomputed from the stored tensors
# by running the recorded operations again. Gradients are the same bits as the plain run's.

# %%
net = Residual(24, 8, k=2)
x0 = np.random.default_rng(0).standard_normal((4, 8))
grads, peak, forwards = measure(net, net, x0)
print(f"plain       peak {peak:6d} bytes, {forwards} operation forwards")
for rule in ("memory", "speed"):
    runner = AutoCheckpoint(net, rule)
    grads_auto, peak_auto, forwards_auto = measure(net, runner, x0)
    same = all(np.array_equal(a, b) for a, b in zip(grads, grads_auto))
    print(f"auto:{rule:6s} peak {peak_auto:6d} bytes, {forwards_auto} operation forwards, "
          f"{len(runner.plan.checkpoints)} checkpoints, gradients equal: {same}")
    assert same

# %% [markdown]
# `auto:speed` holds *more* than the plain run here: the residual sums are not matrix products,
# so they are recomputed, and the sums chain the whole network into one segment that is
# recomputed at once. On a transformer it pays (`docs/checkpointing.md` measures both), and it
# keeps exactly what Korthikanti et al.'s selective recomputation drops: q kᵀ, b·h·T² numbers
# per block.

# %%
speed = speed_rule(gpt_graph)
print("auto:speed keeps:", sorted({gpt_graph.nodes[gpt_graph.values[v].producer].op for v in speed}),
      f"{len(speed)} tensors, of which q kᵀ:", [gpt_graph.describe(v) for v in speed
                                               if len(gpt_graph.values[v].shape) == 4][:1])
print("auto:memory keeps:", [gpt_graph.describe(v) for v in memory_rule(gpt_graph)])

# %% [markdown]
# **Question (measure and explain).** (a) Take an 8-block GPT (`GPTConfig(vocab_size=16,
# seq_len=16, n_layer=8, n_head=4, d_model=32, dtype="float64")`, batch 4) and measure the peak
# saved bytes and the extra operation forwards of `auto:memory` and `sqrt`, with dropout 0.1 and
# with dropout 0 (`apply_to_gpt`, the ledger and `counting_forwards`, on the second step). How
# many bytes does dropout add to each plan's peak? Explain the difference from what each plan does
# with a dropout mask. (b) On the 30-layer chain of exercise 2, keeping every other articulation
# point (`inner_articulation_points(graph)[1::2]`) recomputes nothing and saves nothing. Why?
#
# ## Exercises
#
# **Exercise 1.** `articulation_points_of(n, edges)`: values 0 … n−1, numbered topologically (the
# input is 0, the output n − 1), each edge (u, w) with u < w says "w is computed from u". Return
# the sorted list of values that every 0 → n−1 path passes through, 0 and n − 1 included. Only
# values on some path from 0 to n − 1 count (a dead end is never a cut). The check compares with
# refimpl's `articulation_points` on six hand-made graphs and forty drawn ones.
#
# **Exercise 2.** `my_rule(graph)`: your own selection rule, a function of a recorded graph that
# returns the checkpoints (tensor indices). `inner_articulation_points(graph)` gives you the
# candidates. The check runs it with `AutoCheckpoint` on three networks — 24 layers with a skip
# every 2, a 30-layer chain, 36 layers with a skip every 3 — and requires the gradients to be the
# plain run's bits, a peak of saved bytes at most 40% of the plain run's, and at most one extra
# forward per operation. (Try "all of them" first, and "every other one" on the chain.)
#
# **Exercise 3.** `speed_checkpoints(graph)`: the checkpoints of `auto:speed`: the outputs of the
# graph's matrix products (`node.op` is `MatMul` or `LinearFunction`), among the operations of
# the graph (`node.in_graph`). The check compares with refimpl's rule on residual networks, a
# chain and three GPTs.
#
# **Exercise 4.** `memory_checkpoints(graph)`: the checkpoints of `auto:memory`, which this
# tutorial describes but does not print: k = ⌈√m⌉ of the m inner articulation points, spaced by
# the bytes they hold: checkpoint j (j = 1 … k) is the first articulation point at which the
# articulation points' cumulative bytes (`graph.values[v].nbytes`, summed in index order up to and
# including it) reach j/(k + 1) of their total (if none does, the last one), each chosen tensor
# once. The check compares with refimpl's rule on the same graphs.

# %%
from harness import Exercises  # noqa: E402 - the exercises start here, as in every tutorial
from harness.auto_checkpointing import (  # noqa: E402
    check_articulation_points,
    check_memory_rule,
    check_selection_rule,
    check_speed_rule,
)

ex = Exercises("13_automatic_checkpointing")


@ex.stub
def articulation_points_of(n, edges):
    raise NotImplementedError("exercise 1")


@ex.stub
def my_rule(graph):
    raise NotImplementedError("exercise 2")


@ex.stub
def speed_checkpoints(graph):
    raise NotImplementedError("exercise 3")


@ex.stub
def memory_checkpoints(graph):
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_articulation_points, articulation_points_of)
ex.check(2, check_selection_rule, my_rule)
ex.check(3, check_speed_rule, speed_checkpoints)
ex.check(4, check_memory_rule, memory_checkpoints)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
