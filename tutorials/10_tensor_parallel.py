# %% [markdown]
# # 10 · Tensor and sequence parallelism (Megatron-LM)
#
# **Launch:** `python tutorials/10_tensor_parallel.py` from the repository root, in the virtual
# environment with `mpiexec` (the `mpi` or `test` extra). Part 6 starts `mpiexec -n 4` through
# `subprocess`; parts 2 to 5 simulate their ranks inside this process.
#
# Data parallelism and ZeRO give every rank whole layers to run; a pipeline gives each rank whole
# layers of its own. **Tensor parallelism** (Shoeybi et al., Megatron-LM, arXiv 1909.08053) cuts
# *inside* each layer: t ranks each hold a slice of every weight matrix, compute a slice of every
# layer's output, and exchange activations twice per transformer block in forward and twice in
# backward. **Sequence parallelism** (Korthikanti et al., arXiv 2205.05198) then cuts what is left
# whole, the layer norms and dropouts, along the sequence. refimpl's version is
# `refimpl/parallel/tensor_parallel/`. This tutorial shows
#
# 1. why a linear layer can be cut by its output features or by its input features;
# 2. the two conjugate operators, f and g, that make the cut layers differentiable;
# 3. attention, cut by heads, and the fused qkv weight;
# 4. the vocabulary-parallel loss: 3N numbers cross the ranks instead of N·V logits;
# 5. sequence parallelism and what it costs in bytes, predicted and measured;
# 6. `verify` on 4 processes: tp = 2 × pp = 2 with sequence parallelism, against one process.
#
# Legend for shapes: B batch, T sequence, C width, H heads, N = B·T tokens, V vocabulary, t the
# tensor-parallel group's size, r a rank of it.

# %%
import numpy as np
from harness import last_json, run_mpi
from harness.tensor_parallel import run_ranks

from refimpl.autograd import Parameter, Tensor
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F
from refimpl.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    padded,
    shard_gpt,
    vocab_parallel_cross_entropy,
)
from refimpl.parallel.tensor_parallel.communication import StepShape, bytes_per_step


def gelu(z):  # refimpl's GeLU on a plain array
    return F.gelu(Tensor(z)).data


# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. Two ways to cut a matrix
#
# In the paper's notation a linear layer is Y = X A with A of shape (in, out). There are two ways
# to cut A over t ranks:
#
# * **by columns** (output features), A = [A_1, …, A_t]: Y = [X A_1, …, X A_t]. Each rank needs the
#   whole X and computes its own slice of Y's features, with no communication. A GeLU after it
#   acts feature by feature, so it stays on the slices too: GeLU(X A_r) is rank r's slice of GeLU(X A).
# * **by rows** (input features), A = [A_1; …; A_t], X = [X_1, …, X_t]: Y = X_1 A_1 + … + X_t A_t.
#   Each rank computes a partial sum of the *whole* output, and the t partial sums must be added
#   up: an all-reduce. A GeLU of the sum is not the sum of the GeLUs, so nothing nonlinear may come
#   before it.
#
# Megatron's MLP, Y = GeLU(X A) B, uses both, in that order: A by columns, then B by rows. The
# hidden activation GeLU(X A) (N, 4C) never needs to be whole: rank r's slice of it is exactly
# the input slice its part of B needs. Four "ranks" in one process, in NumPy:

# %%
rng = np.random.default_rng(0)
N, C, t = 6, 4, 4  # tokens, width, ranks; hidden 4C = 16
X = rng.standard_normal((N, C))  # (N, C)
A = rng.standard_normal((C, 4 * C))  # (C, 4C): the paper's A, X A
B = rng.standard_normal((4 * C, C))  # (4C, C)
Y = gelu(X @ A) @ B  # (N, C): one process

mine = np.split(np.arange(4 * C), t)  # rank r's hidden features: 4C/t of them
partial = [gelu(X @ A[:, f]) @ B[f, :] for f in mine]  # (N, 4C/t) @ (4C/t, C) -> (N, C), no communication
print(f"sum over {t} ranks of the partial outputs vs one process: {np.abs(sum(partial) - Y).max():.1e}")

cut_rows_first = sum(gelu(X[:, f] @ A[f, :]) for f in np.split(np.arange(C), t))  # A by rows: GeLU before the sum
print(f"A cut by rows instead, GeLU on each partial sum:       {np.abs(cut_rows_first - gelu(X @ A)).max():.1e}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# The first is rounding; the second is a different function, which is why the first layer is the
# column-parallel one. One all-reduce per MLP in forward, of an (N, C) activation, whatever t.
#
# refimpl's `Linear` stores w = Aᵀ, of shape (out, in), and computes x wᵀ + b (as PyTorch does).
# So in refimpl's arrays the column-parallel layer keeps *rows* of its weight and the row-parallel
# layer *columns*: the names come from the paper's A, not from the array you hold.
#
# ## 2. The conjugate operators f and g
#
# The MLP above is only the forward pass. For backward, Megatron marks the two edges of the
# parallel region with two operators (§3 of the paper), each the other's transpose:
#
# | operator | where | forward | backward |
# |---|---|---|---|
# | f | before the column-parallel layer | identity | all-reduce (sum) |
# | g | after the row-parallel layer | all-reduce (sum) | identity |
#
# g's forward is the all-reduce of section 1. f's forward is nothing: every rank already holds the
# whole X. In backward it is the other way round. The gradient that reaches g's output is the same
# on every rank (everything after g is computed identically everywhere), and each partial sum
# contributes to Y with weight one, so g passes it on unchanged. But rank r's backward through its
# columns A_r gives only the part of dL/dX that flows through *its* hidden features; dL/dX is the
# sum of the t parts: f's backward all-reduces.
#
# refimpl's operators are `refimpl.autograd.Function`s (`operators.py`), used by
# `ColumnParallelLinear` (f, then x w_rᵀ + b_r) and `RowParallelLinear` (x_r w_rᵀ, g, then the
# whole bias, once). Here is a tensor-parallel MLP on t = 2 ranks, against one process.
#
# *Simulated ranks.* `run_ranks(t, program)` runs `program(comm)` on t ranks, each a thread of
# this process with its own communicator: a refimpl `Comm` (`comm.rank`, `comm.size`,
# `comm.allreduce(buf)` in place, the byte counters of tutorial 03), whose collectives meet the
# other threads and add their contributions in rank order, so that every rank gets the same sum,
# bit for bit, as from MPI (`harness/tensor_parallel.py`). Rank r keeps block r of the 4C hidden
# features: in refimpl's (out, in) layout, those *rows* of fc's weight and bias (its output
# features) and those *columns* of proj's weight (its input features); proj's bias stays whole, since
# g sums the partial outputs and the bias is added once, after the sum.

# %%
rng = np.random.default_rng(1)
Bt, T, C = 2, 3, 4
x = rng.standard_normal((Bt, T, C))  # (B, T, C): the MLP's input
fc_w, fc_b = rng.standard_normal((4 * C, C)), rng.standard_normal(4 * C)  # (4C, C), (4C,)
proj_w, proj_b = rng.standard_normal((C, 4 * C)), rng.standard_normal(C)  # (C, 4C), (C,)
dy = rng.standard_normal((Bt, T, C))  # (B, T, C): the gradient that reaches the MLP's output

whole = [Parameter(a.copy()) for a in (fc_w, fc_b, proj_w, proj_b)]  # one process
x_whole = Tensor(x.copy(), requires_grad=True)
y_whole = F.linear(F.gelu(F.linear(x_whole, whole[0], whole[1])), whole[2], whole[3])  # (B, T, C)
y_whole.backward(dy)


def hidden_block(r, t):
    """Rank r's hidden features: block r of t equal contiguous blocks of the 4C."""
    n = fc_w.shape[0] // t  # 4C/t
    return slice(r * n, (r + 1) * n)


def mlp_rank(comm):
    """Rank comm.rank of comm.size: its slices, f -> fc -> GeLU -> proj -> g -> + bias."""
    h = hidden_block(comm.rank, comm.size)
    mine = [Parameter(fc_w[h].copy()), Parameter(fc_b[h].copy()),  # (4C/t, C), (4C/t,): fc's output features
            Parameter(proj_w[:, h].copy()), Parameter(proj_b.copy())]  # (C, 4C/t): proj's input features; (C,)
    fc = ColumnParallelLinear(mine[0], mine[1], comm, sequence_parallel=False)  # f, then x w_rᵀ + b_r
    proj = RowParallelLinear(mine[2], mine[3], comm, sequence_parallel=False)  # x_r w_rᵀ, g, then + b
    xr = Tensor(x.copy(), requires_grad=True)  # every rank holds the whole input
    yr = proj(F.gelu(fc(xr)))  # (B, T, C): whole, the same on every rank
    yr.backward(dy)
    return yr.data, xr.grad, [p.grad for p in mine], comm.counters.snapshot()["allreduce"]


grads_whole = [p.grad for p in whole]
for r, (y_r, dx_r, grads_r, sent) in enumerate(run_ranks(2, mlp_rank)):
    h = hidden_block(r, 2)  # rank r's slices of one process's gradients, against the rank's own
    expected = [grads_whole[0][h], grads_whole[1][h], grads_whole[2][:, h], grads_whole[3]]
    worst = max(np.abs(g - e).max() for g, e in zip(grads_r, expected))
    print(f"rank {r}: |y - y_one| {np.abs(y_r - y_whole.data).max():.1e}, |dx - dx_one| "
          f"{np.abs(dx_r - x_whole.grad).max():.1e}, its weight and bias gradients {worst:.1e}; "
          f"{sent['calls']} all-reduces, {sent['bytes']} bytes sent")
print(f"an all-reduce of N·C = {Bt * T * C} float64 over 2 ranks sends 2(t-1)/t · {Bt * T * C} · 8 = "
      f"{Bt * T * C * 8} bytes")

# %% [markdown] slideshow={"slide_type": "subslide"}
# Each rank holds and multiplies 1/t of the MLP's weights; every output and every gradient equals
# one process's. The price is what the counters show: two all-reduces of an (N, C) activation,
# g's in forward and f's in backward. Exercise 1 asks you to write f and g yourself.
#
# ## 3. Attention: cut by heads
#
# Attention's heads are independent: head h reads only its own D = C/H columns of q, k and v, and
# its output feeds only its own D input features of the output projection. So attention is cut by
# heads. Rank r computes the H/t heads r·H/t … (r+1)·H/t − 1: the qkv projection is
# column-parallel (f before it), the output projection row-parallel (g after it), and the heads'
# arithmetic in between needs no communication at all.
#
# One detail makes the qkv cut subtle. refimpl's q, k and v come from one fused `Linear(C, 3C)`:
# its weight (3C, C) stacks q's C rows, then k's, then v's, and `CausalSelfAttention.forward`
# splits the output into three equal thirds and reshapes each to (B, T, H, D). On rank r the same
# code runs with `n_head = H/t` on an output of 3C/t features, cut into three thirds again. Which
# head does each row of the fused weight belong to? C = 8, H = 4, t = 2:

# %%
C, H, t = 8, 4, 2
D = C // H  # features per head
label = [f"{'qkv'[i // C]}{(i % C) // D}" for i in range(3 * C)]  # row i of qkv.weight (3C, C): part and head
print("rows of qkv.weight:       ", " ".join(label))
rows = 3 * C // t  # rows per rank
for r in range(t):
    block = label[r * rows:(r + 1) * rows]  # a contiguous block of the fused weight
    thirds = [" ".join(block[i * rows // 3:(i + 1) * rows // 3]) for i in range(3)]
    print(f"contiguous rows for rank {r}: read as q [{thirds[0]}]  k [{thirds[1]}]  v [{thirds[2]}]")

# %% [markdown] slideshow={"slide_type": "subslide"}
# A contiguous block would give rank 0 all of q and half of k: its "k" would be q's heads 2 and 3
# and its "v" k's heads 0 and 1, and no head could be computed. Exercise 3 asks for the right rows.
# The output projection, by contrast, is cut into contiguous column blocks: attention's output
# (B, T, C) lists the heads' D features in head order, so rank r's heads are one block.
#
# ## 4. The vocabulary-parallel embedding and loss
#
# The embedding table wte (V, C) is the largest matrix of a GPT with a large vocabulary (GPT-2:
# 50257 × 768, nearly a third of its 124M parameters), and with tied embeddings it is also the
# output layer. Megatron cuts it by **vocabulary rows**: rank r holds tokens r·V'/t … (r+1)·V'/t − 1
# of the vocabulary padded to V', a multiple of t. Looking a token up gives a zero row on every
# rank but the one that holds it, and g sums the rows. As the output layer it is column-parallel:
# rank r computes the logits of its own V'/t tokens, (B, T, V'/t).
#
# Gathering those logits for the loss would move N·V' numbers. Instead (`cross_entropy.py`), with
# m = max_j z_j for a row z with target y,
#
#     loss = log Σ_j exp(z_j − m) − (z_y − m)
#
# and every term is a reduction over the group of numbers each rank computes on its own columns:
# m, an all-reduce (max) of the local row maxima (N numbers); Σ exp and z_y − m, one all-reduce
# (sum) of the local sums and of the target's logit, 0 on the ranks that do not hold y (2N
# numbers). The gradient, softmax − one-hot, is local to each rank's columns: no communication.
#
# A vocabulary of V = 11 on t = 2 ranks is padded to V' = 12. The padded column is masked
# (−∞ before the maximum): it takes no probability and gets no gradient. To show that the mask,
# not luck, keeps it out, give the padded column a large logit:

# %%
V, N, t = 11, 5, 2
Vp = padded(V, t)  # V' = 12
rng = np.random.default_rng(2)
logits = 3 * rng.standard_normal((N, V))  # (N, V)
targets = np.array([0, 10, 5, 6, 3])  # token 10, the last real one, lives on rank 1
z = Tensor(logits.copy(), requires_grad=True)
loss = F.cross_entropy(z, targets)  # one process, the whole vocabulary
loss.backward()

padded_logits = np.concatenate([logits, np.full((N, Vp - V), 50.0)], axis=1)  # (N, V'): column 11 is padding


def loss_rank(comm):
    width = Vp // comm.size  # V'/t columns
    start = comm.rank * width  # this rank's first token
    zr = Tensor(padded_logits[:, start:start + width].copy(), requires_grad=True)  # (N, V'/t)
    lr = vocab_parallel_cross_entropy(zr, targets, start, V, comm)
    lr.backward()
    return lr.item(), zr.grad, comm.counters.snapshot()["allreduce"]


results = run_ranks(t, loss_rank)
grad = np.concatenate([g for _, g, _ in results], axis=1)  # (N, V'): the ranks' columns side by side
for r, (loss_r, _, sent) in enumerate(results):
    print(f"rank {r}: loss {loss_r:.15f} (one process: {loss.item():.15f}); {sent['calls']} all-reduces, "
          f"{sent['bytes']} bytes sent")
print(f"gradients vs one process: {np.abs(grad[:, :V] - z.grad).max():.1e}; the padded column's: {grad[:, V:].ravel()}")
print(f"3N = {3 * N} numbers all-reduced: 2(t-1)/t · 3N · 8 = {3 * N * 8} bytes per rank. Per token, 3 numbers are "
      f"all-reduced, where gathering the logits would move V' of them: {Vp} here, about 50 000 for GPT-2")

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 5. Sequence parallelism
#
# With tensor parallelism alone, everything between the parallel regions -- the layer norms, the
# dropouts, the residual additions, the embedding's sum -- runs on the whole (B, T, C) activation,
# identically, on every rank: redundant arithmetic, and t copies of the activations that those
# operations save for backward. Korthikanti et al. (§4) count the activations a transformer layer
# saves as s·b·h·(34 + 5·a·s/h) bytes in 16-bit (s = T, b = B, h = C, a = H), and tensor
# parallelism divides all of it by t except 10·s·b·h: the layer norms' inputs, the dropout masks
# after attention and after the MLP, and the whole inputs that f hands to qkv and to fc.
#
# Sequence parallelism cuts those regions along the sequence: rank r holds tokens
# r·T/t … (r+1)·T/t − 1 of every sequence, (B, T/t, C). At the edges of the tensor-parallel
# regions f and g become (`operators.py`)
#
# | operator | forward | backward |
# |---|---|---|
# | f̄, before a column-parallel layer | all-gather the sequence shards | reduce-scatter |
# | ḡ, after a row-parallel layer | reduce-scatter to sequence shards | all-gather |
#
# A ring all-reduce *is* a reduce-scatter followed by an all-gather (tutorial 03), so these move
# the same bytes as f and g, with one exception: a column-parallel layer's weight gradient needs
# its whole, gathered input. Megatron saves only the shard (B, T/t, C) and gathers it again in
# backward, so each of the (2L + 1) column-parallel layers per micro-batch (qkv and fc in each of L
# blocks, and the output layer) costs one more all-gather of N·C. And the parameters that now see
# only a shard of the tokens -- layer norms, the row-parallel biases, the position embedding --
# get their gradients summed over the group, small all-reduces. `communication.py` counts it all; one
# micro-batch of B = 2 sequences of T = 8 through a 2-block GPT of width 16, t = 2, float64:

# %%
L, Bt, T, C, t = 2, 2, 8, 16, 2
shape = StepShape(tokens=Bt * T, width=C, blocks=L, micro_batches=1, max_positions=T)
plain, sp = (bytes_per_step(shape, s, tp=t, itemsize=8) for s in (False, True))
for name, counts in (("tp alone", plain), ("tp + sequence parallelism", sp)):
    print(f"{name:26s}: " + ", ".join(f"{kind} {count:,}" for kind, count in counts.items())
          + f" bytes; total {sum(counts.values()):,}")
regather = (2 * L + 1) * Bt * T * C * (t - 1) // t * 8  # (2L+1)·N·C(t−1)/t elements, 8 bytes each
shards = 2 * (6 * L + 2 + T) * C * (t - 1) // t * 8  # all-reduce of (6L + 2 + T)·C parameter gradients
print(f"difference {sum(sp.values()) - sum(plain.values()):,} = re-gathers {regather:,} + gradients of the "
      f"parameters seen on shards {shards:,}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# Now measure it. refimpl's `shard_gpt` cuts a whole GPT in place over a group (the trainer
# calls it on every rank); on 2 simulated ranks, one forward and backward of a batch, with and
# without sequence parallelism. The program also records, with a gradient hook registered before
# `shard_gpt`'s own, the gradient of the final layer norm's weight that each rank computes before
# any communication:

# %%
config = GPTConfig(vocab_size=11, seq_len=T, n_layer=L, n_head=2, d_model=C, dtype="float64")
rng = np.random.default_rng(3)
idx, targets = rng.integers(0, 11, (Bt, T)), rng.integers(0, 11, (Bt, T))  # (B, T) each
one = GPT(config, seed=0)
one_loss = F.cross_entropy(one(idx), targets)  # one process
one_loss.backward()


def gpt_rank(comm, sequence_parallel):
    model = GPT(config, seed=0)  # the whole model, as every rank builds it from the seed
    own = {}
    model.ln_f.weight.register_hook(lambda g: own.update(grad=g.copy()))  # this rank's own part, before any sum
    tp = shard_gpt(model, comm, sequence_parallel)  # keep this rank's slices
    loss = tp.cross_entropy(model(idx), targets)  # logits (B, T, V'/t): the vocabulary-parallel loss
    loss.backward()
    sent = {kind: c["bytes"] for kind, c in comm.counters.snapshot().items()}
    return loss.item(), sent, own["grad"], model.ln_f.weight.grad


for sequence_parallel in (False, True):
    results = run_ranks(t, gpt_rank, sequence_parallel)
    print(f"sequence parallel {sequence_parallel}: loss {results[0][0]:.15f} (one process {one_loss.item():.15f})")
    formula = bytes_per_step(shape, sequence_parallel, t, 8)
    print("  rank 0 sent " + ", ".join(f"{kind} {results[0][1].get(kind, 0):,}" for kind in formula)
          + " bytes; the formula: " + ", ".join(f"{kind} {count:,}" for kind, count in formula.items()))
    assert all(results[0][1].get(kind, 0) == count for kind, count in formula.items())
    for r, (_, _, own, final) in enumerate(results):
        reference = one.ln_f.weight.grad
        print(f"  rank {r}: ln_f.weight's gradient vs one process: its own part {np.abs(own - reference).max():.1e}, "
              f"after backward {np.abs(final - reference).max():.1e}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# The measured bytes equal the formula, kind by kind, and the loss is one process's.
#
# **Question (measure and explain).** Look at the layer norm's gradient in the last lines.
# Without sequence parallelism each rank's own part already equals one process's gradient, and
# nothing is summed; with it, each rank's part is off, and only the sum over the group is right.
# (a) Why, in each case? Say which tokens each rank's layer norm saw. (b) Why must the group's
# parts be summed, not averaged? And without sequence parallelism, what would an all-reduce of
# these gradients do to them, and would `verify` notice? (c) Every rank ends with the same whole
# `ln_f.weight` in both runs: what keeps the copies equal over thousands of steps, and what would
# make them drift apart? (d) The re-gathers cost (2L + 1)·N·C(t − 1)/t elements per micro-batch.
# What do they save, in bytes per block for the configuration above, and why is the trade good
# for large models?
#
# ## 6. Verify: tp 2 × pp 2 with sequence parallelism, 4 processes
#
# With `--tp 2 --pp 2` the 4 ranks form Megatron's grid (`refimpl/parallel/mesh.py`, tutorial 09):
# rank = (p · dp + d) · tp + t, the tensor-parallel index fastest. Ranks 0 and 1 hold the two
# halves of stage 0's layers, ranks 2 and 3 those of stage 1; ranks 0 and 2 form one pipeline,
# 1 and 3 the other. `verify` trains it, with sequence parallelism and dropout (every rank draws its
# shard of the one process's dropout masks), and compares the loss, every gradient and every
# parameter after each step with single-process training from the same weights and batches:

# %%
done = run_mpi(4, "-m", "refimpl", "verify", "--model", "gpt", "--tp", "2", "--pp", "2", "--sequence-parallel",
               "--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "8",
               "--micro-batches", "2", "--dropout", "0.1", "--steps", "2", "--json", show=False)
print(done.stderr.strip())  # verify's report; the JSON summary is stdout's last line
result = last_json(done)
assert result["ok"] and "verify PASS" in done.stderr
print(f"tolerance used {result['tolerance_used']:.3g}: the worst number used {100 * result['tolerance_used']:.2g}% "
      f"of what verify allows it; tensor parallel {result['trainer_report']['tensor_parallel']}")

# %% [markdown] slideshow={"slide_type": "subslide"}
# *Tolerance used* is the largest, over every number compared (the loss, each element of every
# gradient and parameter, after every step), of |distributed − reference| / (atol + rtol·|reference|),
# with rtol = 1e-10 and atol = 1e-12: verify passes when it is at most 1. A figure of 0.03 says
# that the worst number differed from one process's by 3% of its allowance -- the last bits of
# float64 sums taken in another order (the all-reduces add partial sums where one process adds
# terms), far from the 1 a wrong gradient would exceed by orders of magnitude.
#
# ## Exercises
#
# **Exercise 1.** `conjugate_operators()`: return the pair of classes `(f, g)`, two subclasses of
# `refimpl.autograd.Function` used as `f.apply(x, comm)` and `g.apply(x, comm)` (x a Tensor, comm
# the group's communicator). A Function's `forward(self, x, comm)` receives the input's array
# (the Tensor's own data) and returns the output's; `backward(self, grad, needs)` receives the
# output's gradient and returns **one gradient per positional input of forward**: here a tuple
# (gradient of x, None), since comm is not differentiable. Keep in `self` what backward needs.
# `comm.allreduce(buf)` sums `buf` over the group **in place**. The check runs f and g alone on
# 2 and 3 simulated ranks, then a tensor-parallel MLP built with them (fc column-parallel, proj
# row-parallel) on 2, 3 and 4 ranks, and compares its output and every gradient with one
# process's, to 1e-12. It also checks that neither operator changes an array it was handed.
#
# **Exercise 2.** `swiglu_slices(gate_up_weight, down_weight, r, t)`: Llama's MLP is not part 2's.
# It is SwiGLU (Shazeer, arXiv 2002.05202): y = (SiLU(x W_gᵀ) ⊙ x W_uᵀ) W_dᵀ, with SiLU(z) = z·σ(z),
# ⊙ the elementwise product, a hidden width H and no biases. Megatron-LM, for one, fuses the gate
# W_g and the up projection W_u into one `Linear(C, 2H)`: `gate_up_weight` (2H, C) holds W_g's H rows,
# then W_u's H rows; `down_weight` W_d is (C, H). Every rank runs the same code on its slices:
#
#     h = x @ gate_up_rᵀ;  gate, up = split h in two equal halves;  partial = (SiLU(gate) * up) @ down_rᵀ
#
# and g sums the t partial outputs (`harness.tensor_parallel.swiglu` is that code on plain arrays).
# Return `(gate_up_r, down_r)`, of shapes (2H/t, C) and (C, H/t), so that the sum over the ranks is
# one process's y, with rank r holding block r of t equal contiguous blocks of the hidden features,
# as in part 2. Which rows of the fused weight does rank r need, in which order, and why does a
# contiguous block of it fail? Parts 2 and 3 have what you need; the check names the usual mistakes.
#
# **Exercise 3.** `qkv_slices(qkv_weight, qkv_bias, n_head, r, t)`: the rows rank r keeps of the
# fused projection `qkv_weight` (3C, C) and `qkv_bias` (3C,) of attention with `n_head` heads,
# when rank r computes heads r·H/t … (r+1)·H/t − 1 and runs refimpl's attention code with
# H/t heads on its (B, T, 3C/t) output. Return `(qkv_weight_r, qkv_bias_r)`, of shapes
# (3C/t, C) and (3C/t,).
#
# **Exercise 4.** `tp_allreduce_bytes(n_layer, tokens, width, t, itemsize, first, last)`: the bytes
# one rank of a tensor-parallel group of t sends in all-reduces for one micro-batch of N = `tokens`
# tokens of width C through a pipeline stage of `n_layer` blocks, without sequence parallelism:
# forward, backward and the loss. `first` says the stage holds the embedding (vocabulary-parallel,
# part 4), `last` that it holds the final layer norm, the head (column-parallel) and the loss; a
# middle stage holds neither, and with pp = 1 both are true. Parts 2 and 4 count the all-reduces of
# one MLP and of the loss; derive the rest -- which operators of which layers all-reduce (N, C) in
# forward and which in backward, and which belong to a stage's ends -- and use tutorial 03's ring:
# an all-reduce of E elements sends 2E(t − 1)/t of them (t divides N and C here). The check compares
# with `refimpl/parallel/tensor_parallel/communication.py`, which the counters match byte for byte
# (part 5), on first, middle and last stages, t from 1 to 8, and names the usual mistakes.

# %%
from harness import Exercises
from harness.tensor_parallel import (
    check_conjugate_operators,
    check_qkv_slices,
    check_swiglu_slices,
    check_tp_allreduce_bytes,
)

ex = Exercises("10_tensor_parallel")


@ex.stub
def conjugate_operators():
    from refimpl.autograd import Function

    class CopyToGroup(Function):  # f
        def forward(self, x, comm):
            raise NotImplementedError("exercise 1: f's forward")

        def backward(self, grad, needs):
            raise NotImplementedError("exercise 1: f's backward")

    class ReduceFromGroup(Function):  # g
        def forward(self, x, comm):
            raise NotImplementedError("exercise 1: g's forward")

        def backward(self, grad, needs):
            raise NotImplementedError("exercise 1: g's backward")

    return CopyToGroup, ReduceFromGroup


@ex.stub
def swiglu_slices(gate_up_weight, down_weight, r, t):
    raise NotImplementedError("exercise 2")


@ex.stub
def qkv_slices(qkv_weight, qkv_bias, n_head, r, t):
    raise NotImplementedError("exercise 3")


@ex.stub
def tp_allreduce_bytes(n_layer, tokens, width, t, itemsize, first, last):
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_conjugate_operators, conjugate_operators)
ex.check(2, check_swiglu_slices, swiglu_slices)
ex.check(3, check_qkv_slices, qkv_slices)
ex.check(4, check_tp_allreduce_bytes, tp_allreduce_bytes)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
