# %% [markdown]
# # 06 · Activation checkpointing
#
# **Launch:** `python tutorials/06_checkpointing.py` from the repository root, in the virtual
# environment (part 5 starts `mpiexec -n 2` through `subprocess`).
#
# Backward needs what forward computed: every layer leaves its *activations* behind until its
# backward has run, so their memory grows with depth (and with the batch, tutorial 02).
# **Activation checkpointing** keeps only some layer inputs and recomputes the rest during
# backward: memory for arithmetic. refimpl (`refimpl/checkpointing/`, `docs/checkpointing.md`)
# implements the two classic schedules, uniform segments (Chen et al., arXiv 1604.06174) and
# Griewank's binomial *revolve*, and measures both exactly: forward calls with a counter inside
# each layer, memory with the engine's saved-tensor ledger (tutorial 01).

# %%
import numpy as np

from refimpl.autograd import Tensor, saved_tensors
from refimpl.checkpointing import (
    actions_for,
    apply_to_gpt,
    checkpoint,
    count_forward_calls,
    measure_chain,
    revolve,
    simulate_chain,
)
from refimpl.checkpointing.measure import tanh_chain
from refimpl.data import SortTask
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. One function: `checkpoint`
#
# `checkpoint(fn, x)` runs `fn` without recording anything and keeps only `x`. In backward it runs
# `fn` again, this time recording, and differentiates that. Take one transformer block of a small
# GPT: how many bytes stay saved after the forward, and how often does the block run?

# %%
task = SortTask(length=8, seed=0)
config = GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=1, n_head=4, d_model=32, dropout=0.1,
                   dtype="float64")
x_data = np.random.default_rng(0).standard_normal((4, task.seq_len, 32))

results = {}
for name, run in [("plain", lambda x: block(x)), ("checkpoint", lambda x: checkpoint(block, x))]:
    block = GPT(config, seed=0).blocks[0]  # a fresh block each time: the same weights and dropout seeds
    x = Tensor(x_data, requires_grad=True)
    with count_forward_calls([block]) as counter:
        y = run(x)
        saved = saved_tensors.live_bytes
        (y * y).sum().backward()
    results[name] = (x.grad, [p.grad.copy() for p in block.parameters()], saved)
    print(f"{name:10s}: {saved:7,d} bytes saved after forward, block ran {counter.calls[0]} time(s)")
same = np.array_equal(results["plain"][0], results["checkpoint"][0]) and all(
    np.array_equal(a, b) for a, b in zip(results["plain"][1], results["checkpoint"][1]))
print("gradients bit for bit equal:", same)
print(f"what the plain block saves / its input: {results['plain'][2] / x_data.nbytes:.1f}")
assert same and results["checkpoint"][2] == x_data.nbytes

# %% [markdown] slideshow={"slide_type": "subslide"}
# The checkpointed block keeps only its input x: (4, 16, 32) float64 numbers, 16,384 bytes, where
# the plain block kept over 20 times as much (layer-norm outputs, attention probabilities, the
# MLP's hidden activations, dropout masks). The recomputation draws the same dropout masks (the
# generators' state is replayed), so the gradients are the same bits.
#
# ## 2. A chain of layers: which inputs to keep?
#
# For a chain of n layers, the question is which layer inputs x₀ … xₙ₋₁ to keep. refimpl's test
# chain (`refimpl/checkpointing/measure.py`) is made of `TanhLayer`s, y = tanh(x W), each of which
# saves exactly its input, so memory can be counted in layer inputs (A). The plans:
#
# - `none`: keep everything, n inputs, no recomputation;
# - `every:K`: keep the input of every segment of K layers and recompute each segment in backward;
#   `sqrt` is `every:⌈√n⌉`, about 2√n inputs for n − √n extra forwards (fewer than one per layer);
# - `revolve:C`: Griewank's binomial schedule with C snapshot slots, the fewest recomputations
#   possible with C snapshots *in revolve's own model*, where memory means snapshots and a
#   recorded layer's saved state is transient (see the caveat below the table).
#
# Measured on 16 layers (forward calls counted inside the layers, the peak read off the ledger):

# %%
n = 16
print("plan         extra forwards   peak (layer inputs)")
for plan in ("none", "sqrt", "every:2", "every:8", "revolve:2", "revolve:4", "revolve:8"):
    m = measure_chain(tanh_chain(n), plan)
    print(f"{plan:12s} {m.extra_forwards:14d}   {m.peak_states:19.0f}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# A caveat: revolve is not the fewest recomputations for a given *peak* in this chain. `revolve:8`
# and `every:8` both peak at 9 layer inputs, but revolve needs 22 extra forwards where `every:8`
# needs 8 (and at sqrt's peak of 7, `revolve:6` needs 24 where `sqrt` needs 12). Revolve is optimal
# in its own model, where a recorded layer is transient and memory means snapshots; here a
# recorded layer costs exactly one input, so `every:K` can keep a whole recorded segment for the
# price of K snapshots, which revolve's model does not allow. When a layer saves far more than
# its input (a transformer block, part 4) the trade-off turns around; `docs/checkpointing.md`
# measures both cases.

# %% [markdown] slideshow={"slide_type": "subslide"}
# A plan is data: a list of actions (`Snapshot`, `Advance` without grad, `Record` with grad,
# `Backprop`, `Restore`, `Free`), executed inside the engine. Here is `sqrt` for 9 layers; the
# actions before the first `Backprop` run in the forward pass:

# %%
for action in actions_for("sqrt", 9):
    print(action)
print(simulate_chain(actions_for("sqrt", 9), 9))

# %% [markdown] slideshow={"slide_type": "subslide"}
# `simulate_chain` predicts advances and peak from the actions alone; the tests check the prediction
# against the counters and the ledger. Its `peak_bytes` is in layer inputs: it counts each kept
# state as `input_bytes`, which defaults to 1. So `peak_bytes=5` is 5 layer inputs: the snapshots
# of x₀ and x₃ and the 3 inputs of the segment being recorded (for 16 layers the table's `sqrt`
# row says 7).
#
# ## 3. Revolve: the fewest recomputations
#
# With C snapshot slots and r recomputations per layer, at most β(C, r) = C(C + r, C) layers can be
# reversed (Griewank, 1992). The minimum number of advances for n layers is
# t(n, C) = r·n − β(C + 1, r − 1), with r the smallest integer such that β(C, r) ≥ n. The engine
# counts exactly that:

# %%
for C in (1, 2, 4):
    t = revolve.min_advances(n, C)
    m = measure_chain(tanh_chain(n), f"revolve:{C}")
    print(f"C={C}: t(16, {C}) = {t:3d}, measured extra forwards {m.extra_forwards:3d}, peak {m.peak_states:.0f} inputs")
    assert t == m.extra_forwards

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 4. The GPT
#
# `apply_to_gpt(model, plan)` makes the model run its blocks under a plan. A transformer block
# saves far more than its input (part 1), so keeping block inputs and recomputing blocks pays
# off. An 8-block GPT, one training step per plan:

# %%
config8 = GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=8, n_head=4, d_model=32, dropout=0.1,
                    dtype="float64")
x, y = task.batch(0, 8)
reference = None
for plan in ("none", "sqrt", "every:1", "revolve:2"):
    gpt = apply_to_gpt(GPT(config8, seed=0), plan)
    saved_tensors.reset_peak()
    with count_forward_calls(gpt.blocks) as counter:
        F.cross_entropy(gpt(x), y).backward()
    grads = [p.grad for p in gpt.parameters()]
    reference = reference or grads
    same = all(np.array_equal(a, b) for a, b in zip(grads, reference))
    print(f"{plan:10s} peak saved {saved_tensors.peak_bytes:9,d} bytes, block forwards {counter.total:2d}, "
          f"gradients equal to none's: {same}")
    assert same

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 5. With data parallelism, verified
#
# `--checkpoint PLAN` works on `train` and `verify`; here two data-parallel ranks, each
# checkpointing its blocks with `sqrt`, against one process without checkpointing:

# %%
from harness import last_json, run_mpi

FLAGS = ["--model", "gpt", "--n-layer", "4", "--d-model", "16", "--seq-len", "8", "--batch-size", "8", "--steps", "2"]
result = last_json(run_mpi(2, "-m", "refimpl", "verify", *FLAGS, "--checkpoint", "sqrt", "--json"))
print("verify ok:", result["ok"], "| largest |diff|:", result["max_abs_diff"])
assert result["ok"]

# %% [markdown] slideshow={"slide_type": "subslide"}
# verify's report reads as in tutorial 04: the JSON's `max_rel_diff` (near 1e-03 beside
# `"rtol":1e-10`) is the worst |diff| / max(|reference|, atol), large only for gradients that are
# zero up to rounding; the verdict compares every |diff| with atol + rtol·|reference|, and the
# PASS line's ratio (*tolerance used*) is far below the 1 it may reach.
#
# **Question (measure and explain).** (a) Derive the lowest peak, in layer inputs, that any
# `every:K` plan reaches on a chain of n TanhLayers, as a closed form in n, and check it with
# `measure_chain` for n up to 40. Does `sqrt`'s K always reach it? Is it always the cheapest K that
# does? Give an n where it is not, with both plans' measured costs. (b) Part 4's GPT: measure the
# peak saved bytes of `every:1`, `every:2`, `sqrt`, `every:4` and `every:8`, estimate from them how
# many layer inputs' worth a recorded block saves, and explain with a formula for the peak why the
# best K here is not near √n.
#
# ## Exercises
#
# **Exercise 1.** `sqrt_cost(n)`: the pair (extra forwards, peak in layer inputs) of the `sqrt`
# plan on a chain of n TanhLayers. With K = ⌈√n⌉ (in integers: `math.isqrt(n - 1) + 1` for n > 1)
# and m = ⌈n/K⌉ segments, counted from the end (the first takes the remainder): the forward pass
# keeps the inputs of the first m − 1 segments and records the last one, and backward recomputes
# every segment but the last. The check compares with measurements for several n.
#
# **Exercise 2.** `revolve_extra(n, C)`: t(n, C) from the formula above (`math.comb` gives
# binomial coefficients). The check compares with `revolve.min_advances` and with the engine.
#
# **Exercise 3.** `every_k_schedule(n, k)`: the `every:K` plan as a list of actions from
# `refimpl.checkpointing.actions`, for `k <= n`. Segment boundaries: `first = n - (m - 1) * k`,
# then every k layers. Forward part: for each segment but the last, `Snapshot(start)` and
# `Advance(start, stop)`; then `Record` and `Backprop` of the last segment (if the last segment
# starts at 0, snapshot x₀ first, and free it at the very end). Backward part, segments from last
# to first: `Restore`, `Record`, `Backprop`, `Free`. The check validates it with `simulate_chain`,
# compares its cost with refimpl's, then its actions, one by one, with refimpl's `every:K`
# schedule, and runs it in the engine, where the gradients must equal a plain backward bit for
# bit.
#
# **Exercise 4.** `cheapest_every_k(n, budget)`: with at most `budget` layer inputs of memory, the
# `every:K` plan on a chain of n TanhLayers that recomputes the fewest layer forwards, as
# `(K, extra forwards, peak)`, or `None` when no K fits. Derive the cost of `every:K` for any K
# first, K that does not divide n and K = n included; the table of part 2 has a few to test
# against. Then watch out: the peak is not monotone in K. The check measures every K of nine chains
# with the counters and the ledger and tries every budget from 0 to n + 1.

# %%
from harness import Exercises
from harness.checkpointing import check_cheapest_every_k, check_every_k_schedule, check_revolve_extra, check_sqrt_cost

from refimpl.checkpointing.actions import Advance, Backprop, Free, Record, Restore, Snapshot  # noqa: F401 - exercise 3

ex = Exercises("06_checkpointing")


@ex.stub
def sqrt_cost(n):
    raise NotImplementedError("exercise 1")


@ex.stub
def revolve_extra(n, C):
    raise NotImplementedError("exercise 2")


@ex.stub
def every_k_schedule(n, k):
    raise NotImplementedError("exercise 3")


@ex.stub
def cheapest_every_k(n, budget):
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_sqrt_cost, sqrt_cost)
ex.check(2, check_revolve_extra, revolve_extra)
ex.check(3, check_every_k_schedule, every_k_schedule)
ex.check(4, check_cheapest_every_k, cheapest_every_k)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
