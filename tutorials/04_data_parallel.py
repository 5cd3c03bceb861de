# %% [markdown]
# # 04 · Data parallelism
#
# **Launch:** `python tutorials/04_data_parallel.py` from the repository root, in the virtual
# environment with `mpiexec` (the `mpi` or `test` extra). Parts 3 and 4 start `mpiexec` through
# `subprocess`.
#
# With data parallelism N ranks each hold the whole model, each runs forward and backward on its
# share of the global batch, and the ranks all-reduce (tutorial 03) their gradients so that every
# rank takes the same optimizer step. refimpl's version is `refimpl/parallel/data_parallel.py`;
# `docs/data_parallel.md` explains it in full. This tutorial shows
#
# 1. why the ranks **sum** their gradients and never average them;
# 2. that the split is invisible: N ranks compute the gradient of one process, to rounding;
# 3. `python -m refimpl verify`, which proves that for a real run, and the bytes it counts;
# 4. gradient buckets, which overlap the all-reduce with the backward pass.

# %%
import numpy as np
from harness import last_json, run_mpi

from refimpl.data import IGNORE, SortTask
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F
from refimpl.objective import count_targets, micro_batch_loss, split_batch

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. The loss that makes gradients add up
#
# The training loss is the mean over the **counted targets of the global batch**,
# L = (1/N_targets) Σ −log p(target). Each rank computes its own sum of −log p and divides it by
# the *global* count N_targets. Then the ranks' losses add up to L, and so do their gradients:
# the all-reduce is a plain sum. (`micro_batch_loss` in `refimpl/objective.py`
# does this; every rank can compute the global count because every rank builds the same global
# batch from the seed and the step.)
#
# Averaging each rank's own mean instead is right only when every rank has the same number of
# counted targets. Here rank 0's examples have fewer (some targets are ignored):

# %%
task = SortTask(length=4, seed=0)
x, y = task.batch(0, 8)
y[:2, 5:] = IGNORE  # the first two examples count fewer targets
config = GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=1, n_head=2, d_model=16, dtype="float64")
model = GPT(config, seed=0)


def gradients(model):
    grads = {name: p.grad.copy() for name, p in model.named_parameters()}
    model.zero_grad()
    return grads


F.cross_entropy(model(x), y).backward()  # one process, the whole batch
reference = gradients(model)

N, total = 2, count_targets(y)
for xs, ys in split_batch(x, y, N, "ranks"):  # two "ranks", one after the other
    micro_batch_loss(model, xs, ys, total).backward()  # .grad accumulates: the sum over ranks
summed = gradients(model)

for xs, ys in split_batch(x, y, N, "ranks"):
    (F.cross_entropy(model(xs), ys) / N).backward()  # the average of the ranks' own means
averaged = gradients(model)


def largest_difference(a, b):
    return max(np.abs(a[k] - b[k]).max() for k in a)


print("counted targets per rank:", [count_targets(ys) for _, ys in split_batch(x, y, N, "ranks")])
print(f"sum of ranks' gradients (global count) vs one process: {largest_difference(summed, reference):.1e}")
print(f"average of ranks' means                vs one process: {largest_difference(averaged, reference):.1e}")
assert largest_difference(summed, reference) < 1e-12 < 1e-6 < largest_difference(averaged, reference)

# %% [markdown] slideshow={"slide_type": "subslide"}
# The first difference is rounding (float64 has about 16 digits; sums in a different order differ
# in the last one); the second is a wrong gradient.
#
# ## 2. The trainer
#
# `DataParallelTrainer.step(x, y)` is, on every rank, the same global batch in and the same loss
# out: it takes its slice of B/N examples, runs `--grad-accum` micro-batches on it (gradients
# accumulate, communication only after the last), all-reduces the gradients, clips them (they are
# whole and identical on every rank now) and steps the optimizer. `LocalTrainer` (tutorial 02)
# is the same on one process: the reference.
#
# ## 3. Proving it: `verify`
#
# `python -m refimpl verify` runs the distributed configuration and, on rank 0, `LocalTrainer` on
# the same global batches from the same initial weights, and compares loss, every gradient and
# every parameter after each step (float64; passes when |diff| ≤ 1e-12 + 1e-10·|reference|). It
# also returns what the communication wrapper counted. Two ranks, a small GPT:

# %%
FLAGS = ["--model", "gpt", "--batch-size", "12", "--n-layer", "1", "--d-model", "16", "--seq-len", "8", "--steps", "2"]
result = last_json(run_mpi(2, "-m", "refimpl", "verify", *FLAGS, "--json"))
print("verify ok:", result["ok"], "| largest |diff|:", result["max_abs_diff"],
      "| buckets:", result["trainer_report"]["buckets"])
assert result["ok"]

# %% [markdown] slideshow={"slide_type": "subslide"}
# Reading verify's report. The JSON line shows `"max_rel_diff"` near 6e-04 beside `"rtol":1e-10`,
# and the verdict is still PASS: max_rel_diff is |diff| / max(|reference|, atol) of the worst
# element, and here that element is a gradient that is zero up to rounding (the key bias of
# attention: softmax ignores a constant added to every score, so its exact gradient is 0, and the
# computed one is rounding noise of order 1e-16). A difference of 6e-16 over an allowance of
# atol = 1e-12 is 6e-04 of that allowance. The verdict uses |diff| ≤ atol + rtol·|reference| for
# every number, and the stderr line reports the worst ratio, `largest |diff| / (atol + rtol
# |reference|)`, also called *tolerance used*: it passes at ≤ 1, and here it is under 0.001. A
# wrong gradient exceeds 1 by orders of magnitude. The same lines appear in tutorials 06, 07
# and 08.
#
# How many bytes should that be? The model has Ψ parameters. A ring all-reduce of Ψ float64
# gradients sends 2Ψ(N − 1)/N elements per rank per step; one more float64 per step is the loss
# (`allreduce_value`, which at N = 2 sends one element from each rank):

# %%
psi = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=1, n_head=4, d_model=16)).num_parameters()
steps, n = 2, 2
expected = steps * (2 * psi * (n - 1) // n + 1) * 8
for rank, counters in enumerate(result["bytes_sent"]):
    print(f"rank {rank}: all-reduce {counters['allreduce']['calls']} calls, {counters['allreduce']['bytes']} bytes "
          f"(formula {expected} for Ψ = {psi})")
    assert counters["allreduce"]["bytes"] == expected

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 4. Buckets: overlapping the all-reduce with backward
#
# The naive version (`--dp-mode naive`) waits for the whole backward and then all-reduces each
# parameter's gradient, one blocking call each. The bucketed version (the default) groups the
# parameters, in the order backward produces their gradients (the reverse of the model's order),
# into flat buffers of about `--bucket-bytes`. Each parameter's `.grad` is a view into its
# bucket; when a bucket's last gradient has been accumulated (a post-accumulate-grad hook, see
# tutorial 01's engine), its non-blocking all-reduce starts, while backward continues with earlier
# layers. The bytes are the same; the number of calls is not. Three ranks this time, with the
# textbook ring of tutorial 03 instead of MPI's built-in collectives:

# %%
for mode, extra in [("naive", []), ("bucketed", ["--bucket-bytes", "4096"])]:
    r = last_json(run_mpi(3, "-m", "refimpl", "verify", *FLAGS, "--collectives", "ring", "--dp-mode", mode, *extra,
                          "--json", show=False))
    counters = r["bytes_sent"][0]["allreduce"]
    print(f"{mode:8s}: ok {r['ok']}, rank 0 made {counters['calls']} all-reduce calls, sent {counters['bytes']} bytes")
    per_step = len(model.parameters()) if mode == "naive" else r["trainer_report"]["buckets"]
    assert r["ok"] and counters["calls"] == steps * (per_step + 1)

# %% [markdown] slideshow={"slide_type": "subslide"}
# The naive run makes one call per parameter per step plus one for the loss; the bucketed run one
# per bucket plus one for the loss. The bytes differ slightly because the ring's blocks differ:
# with N = 3, a buffer whose length is not a multiple of 3 has blocks of unequal size, and a rank
# sends every block but its own (and, in the all-gather, its right neighbour's). How much of the
# all-reduce time buckets hide is measured by `benchmarks/bench_ddp.py` (see
# `docs/data_parallel.md`).
#
# **Question (measure and explain).** Rerun part 4's two `verify` commands and read
# `bytes_sent` for all three ranks, then once more bucketed with `--grad-accum 2`. (a) Show that
# the bytes summed over the ranks are the same in both modes and derive that sum from Ψ, N and the
# steps. (b) Explain why the ranks' own bytes differ, which rank sends the most in each mode and
# why naive spreads them less evenly than bucketed. (c) Explain what `--grad-accum 2` changes in
# the counters and why, and what buckets change if not the bytes.
#
# ## Exercises
#
# **Exercise 1.** `rank_micro_batches(x, y, world_size, rank, grad_accum)`: the list of
# `(x_micro, y_micro)` that rank `rank` runs, in order. Rank r takes the r-th of `world_size`
# equal contiguous slices of the global batch and cuts it into `grad_accum` equal contiguous
# micro-batches.
#
# **Exercise 2.** `local_loss(model, x, y, global_count)`: the scalar loss Tensor a rank calls
# `backward()` on, such that the gradients summed over ranks equal the gradient of the global
# batch's mean loss. Use `F.cross_entropy(..., reduction="sum")`.
#
# **Exercise 3.** `assign_buckets(param_bytes, bucket_bytes)`: given each parameter's size in
# bytes, in the model's order, return the buckets as lists of parameter indices. Walk the
# parameters in backward order (last first); start a new bucket when adding the next parameter
# would take the current one past `bucket_bytes` (a bucket may fill it exactly; a parameter larger
# than that gets a bucket of its own). The check compares with `assign_buckets` in
# `refimpl/parallel/data_parallel.py` (the rule DDP's `_Buckets` and ZeRO's groups use), also at
# sizes that the model's last parameters fill exactly.
#
# **Exercise 4.** `bucketed_bytes(param_numels, itemsize, world_size, rank, bucket_bytes)`: the
# bytes that rank `rank` sends in one step's gradient all-reduces with bucketed data parallelism
# over the ring of tutorial 03 (the loss's all-reduce not included). `param_numels` are the
# parameters' element counts in the model's order and `itemsize` the gradients' bytes per element.
# Derive it from what the ring does with each buffer it is given; you may call your
# `assign_buckets`. The check compares with the bytes of every rank for several models, bucket
# sizes and 1 to 4 ranks.

# %%
from harness import Exercises
from harness.data_parallel import check_assign_buckets, check_bucketed_bytes, check_local_loss, check_rank_micro_batches

ex = Exercises("04_data_parallel")


@ex.stub
def rank_micro_batches(x, y, world_size, rank, grad_accum):
    raise NotImplementedError("exercise 1")


@ex.stub
def local_loss(model, x, y, global_count):
    raise NotImplementedError("exercise 2")


@ex.stub
def assign_buckets(param_bytes, bucket_bytes):
    raise NotImplementedError("exercise 3")


@ex.stub
def bucketed_bytes(param_numels, itemsize, world_size, rank, bucket_bytes):
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_rank_micro_batches, rank_micro_batches)
ex.check(2, check_local_loss, local_loss)
ex.check(3, check_assign_buckets, assign_buckets)
ex.check(4, check_bucketed_bytes, bucketed_bytes)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
