# %% [markdown]
# # 02 · A GPT in NumPy
#
# **Launch:** `python tutorials/02_gpt.py` from the repository root, in the virtual environment
# (or open it as a notebook with jupytext, see tutorial 01). About ten seconds on a laptop.
#
# refimpl's GPT (`refimpl/nn/models.py`, `refimpl/nn/layers.py`) is a decoder-only transformer
# in the style of GPT-2, written on the autograd engine of tutorial 01. Here you
#
# 1. look at the sorting task it learns and at the model's parameters, layer by layer;
# 2. follow one batch through it, and see that attention is causal;
# 3. train it for a few seconds and use it to sort digits;
# 4. measure how the memory of saved activations grows with the batch.

# %%
import time

import numpy as np

from refimpl.autograd import no_grad, saved_tensors
from refimpl.data import SortTask
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F

np.set_printoptions(linewidth=120)

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 1. The task
#
# The model reads six digits, a separator (token 10) and the same digits sorted, and is trained to
# predict each next token. Only the sorted half is scored: the first six targets are
# `-100`, which the loss ignores, because the input digits are random and cannot be predicted.
# A batch is a pure function of the seed and the step, so every process of a distributed run can
# build the same global batch (tutorial 04 relies on that).

# %%
task = SortTask(length=6, seed=0)
x, y = task.batch(step=0, batch_size=3)
print("vocabulary", task.vocab_size, "| sequence length", task.seq_len)
print("inputs x:\n", x)
print("targets y (-100 = not scored):\n", y)

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 2. The model
#
# ```
# x = wte[idx] + wpe[0:T]                      (B, T, C)  token and position embeddings
# x = x + attn(ln1(x)); x = x + mlp(ln2(x))    (B, T, C)  n_layer pre-LN blocks
# logits = ln_f(x) @ lm_headᵀ                  (B, T, V)  one score per vocabulary entry
# ```
#
# Legend: B batch, T sequence length, C model width (`d_model`), V vocabulary.

# %%
config = GPTConfig(vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=2, n_head=4, d_model=32, dtype="float32")
model = GPT(config, seed=0)
for name, p in model.named_parameters():
    print(f"{name:28s} {str(p.shape):12s} {p.size:6d}")
print("total", model.num_parameters(), "parameters")

# %% [markdown] slideshow={"slide_type": "subslide"}
# A forward pass, part by part (the model exposes `embed`, `blocks` and `head` separately so that
# pipeline stages and checkpointing can cut it between blocks):

# %%
with no_grad():
    h = model.embed(x)
    print("embed  ", h.shape)
    for i, block in enumerate(model.blocks):
        h = block(h)
        print(f"block {i}", h.shape)
    logits = model.head(h)
    print("logits ", logits.shape)
    assert np.array_equal(logits.data, model(x).data)

# %% [markdown] slideshow={"slide_type": "subslide"}
# **Causal attention.** In each head, position t mixes the values of positions 0..t with weights
# softmax(q_t · k_s / √D). The mask below is `True` where attention is forbidden (the future):

# %%
print(model.blocks[0].attn.mask[:6, :6].astype(int))

# %% [markdown] slideshow={"slide_type": "subslide"}
# So changing a token can only change the logits at its own position and later ones. Check it:
# change the token at position 8 and compare.

# %%
with no_grad():
    x2 = x.copy()
    x2[:, 8] = (x2[:, 8] + 1) % 10
    before, after = model(x).data, model(x2).data
changed = np.abs(after - before).max(axis=(0, 2)) > 0  # per position
print("positions whose logits changed:", np.flatnonzero(changed))
assert not changed[:8].any() and changed[8:].all()

# %% [markdown] slideshow={"slide_type": "subslide"}
# **The loss.** Cross-entropy, averaged over the scored targets. At initialisation the weights
# are small, the predicted distribution is close to uniform and the loss close to ln V:

# %%
with no_grad():
    initial = F.cross_entropy(model(x), y).item()
print(f"initial loss {initial:.3f}; ln V = ln {task.vocab_size} = {np.log(task.vocab_size):.3f}")

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 3. Training
#
# `LocalTrainer` (in `refimpl/tools/run.py`) is the single-process training step: forward and
# backward on the batch, gradient clipping, an AdamW step, gradients zeroed. Every distributed
# trainer in refimpl is verified against it (tutorial 04).

# %%
from refimpl.local_trainer import LocalTrainer
from refimpl.optim import AdamW
from refimpl.tools.run import evaluate

trainer = LocalTrainer(model, AdamW(model.parameters(), lr=3e-3, weight_decay=0.0), clip=1.0)
start = time.perf_counter()
for step in range(150):
    xb, yb = task.batch(step, 32)
    loss = trainer.step(xb, yb)
    if step % 25 == 0 or step == 149:
        print(f"step {step:3d}  loss {loss:.4f}")
eval_loss, accuracy = evaluate(model, task)
print(f"{time.perf_counter() - start:.1f} s; held-out loss {eval_loss:.3f}, accuracy {accuracy:.1%} "
      "(the share of sorted positions predicted right, given the true prefix)")
assert accuracy > 0.8

# %% [markdown] slideshow={"slide_type": "subslide"}
# Using it: give the model six digits and the separator, and let it write one token at a time,
# each time taking its most likely next token (greedy decoding).

# %%
def sort_with_model(model, digits):
    tokens = list(digits) + [10]
    with no_grad():
        for _ in range(len(digits)):
            logits = model(np.array([tokens]))  # (1, t, V)
            tokens.append(int(logits.data[0, -1].argmax()))
    return tokens[len(digits) + 1:]


model.eval()
for digits in ([3, 1, 4, 1, 5, 9], [9, 8, 7, 2, 2, 0]):
    print(digits, "->", sort_with_model(model, digits), "| expected", sorted(digits))

# %% [markdown] slideshow={"slide_type": "slide"}
# ## 4. Memory of saved activations
#
# Training memory has two parts: model state (parameters, gradients, optimizer state; tutorial 05
# shards it) and the activations that backward needs, which grow with the batch (tutorial 06
# recomputes them instead). The ledger of tutorial 01 measures the second exactly, and since
# every saved array has the batch as its first dimension, doubling the batch doubles it:

# %%
model.train()
peaks = {}
for batch in (8, 16):
    xb, yb = task.batch(0, batch)
    saved_tensors.reset_peak()
    loss = F.cross_entropy(model(xb), yb)
    peaks[batch] = saved_tensors.peak_bytes
    loss.backward()
    model.zero_grad()
print({b: f"{v:,} bytes" for b, v in peaks.items()}, "ratio", peaks[16] / peaks[8])
assert peaks[16] == 2 * peaks[8]

# %% [markdown] slideshow={"slide_type": "subslide"}
# **Question (measure and explain).** Doubling the batch doubles the saved activations. Does
# doubling the sequence length? Build part 2's model (2 blocks, 4 heads, `d_model` 32, float32)
# with `seq_len` 8, 16, 32, 64 and 128, measure the ledger's peak over the forward at batch 4, and
# fit the bytes per token as a + b·T. Explain b (which saved arrays grow with T², and why backward
# needs them) and a (measure with 1, 2 and 4 blocks to separate what each block saves), say how a
# and b scale with `n_layer`, `d_model` and `n_head`, and find the T at which a block's T² part
# equals the rest. What does that predict for a model with `d_model` 4096 and 32 heads?
#
# ## Exercises
#
# **Exercise 1.** `attention(q, k, v)`: causal attention for arrays of shape (B, H, T, D): scores
# `q @ kᵀ / √D`, −∞ above the diagonal (use `np.triu(..., k=1)`), a softmax over the last axis
# (subtract the row maximum first), then the weighted sum of `v`. Return shape (B, H, T, D).
#
# **Exercise 2.** `count_parameters(vocab_size, seq_len, n_layer, d_model)`: the number of
# parameters of a GPT with untied embeddings (refimpl's default): the two embeddings, per block two
# layer norms (weight and bias), the q/k/v projection and the output projection (with biases), the
# MLP C → 4C → C (with biases), then the final layer norm and the head (no bias). Compare with the
# table printed above.
#
# **Exercise 3.** `cross_entropy(logits, targets)`: for logits (B, T, V) and integer targets
# (B, T), the mean over the targets that are not −100 of −log softmax(logits)[target]. Make it
# stable: subtract each row's maximum before `exp`.
#
# **Exercise 4.** `cross_entropy_grad(logits, targets)`: the gradient of exercise 3's loss with
# respect to the logits, an array of shape (B, T, V), computed without the autograd engine.
# Derive it on paper first, from −log softmax(z)[t] = −z_t + log Σ_v e^(z_v); mind the positions
# whose target is −100 and what the mean divides by. The check compares with the gradient
# refimpl's engine computes through `F.cross_entropy`.

# %%
from harness import Exercises
from harness.gpt import check_attention, check_count_parameters, check_cross_entropy, check_cross_entropy_grad

ex = Exercises("02_gpt")


@ex.stub
def attention(q, k, v):
    raise NotImplementedError("exercise 1")


@ex.stub
def count_parameters(vocab_size, seq_len, n_layer, d_model):
    raise NotImplementedError("exercise 2")


@ex.stub
def cross_entropy(logits, targets, ignore_index=-100):
    raise NotImplementedError("exercise 3")


@ex.stub
def cross_entropy_grad(logits, targets, ignore_index=-100):
    raise NotImplementedError("exercise 4")


# %%
# Your answer to this tutorial's question (measure and explain): the grader reads this string
# without running the file (tutorials/grade.py FOLDER --gradebook OUT).
ANSWER = """
(your answer)
"""

ex.check(1, check_attention, attention)
ex.check(2, check_count_parameters, count_parameters)
ex.check(3, check_cross_entropy, cross_entropy)
ex.check(4, check_cross_entropy_grad, cross_entropy_grad)
ex.summary();  # noqa: E703 - the `;` keeps a notebook from echoing the returned True/False
