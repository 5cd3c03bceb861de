"""Reference solutions to tutorial 12's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them), and a
model answer to its question (at the end)."""

from refimpl.memory import PRECISIONS
from refimpl.tools.cluster.model import EFFICIENCY


def model_state_bytes(run, first, last):
    h, t = run.d_model, run.tp
    blocks = -(-run.n_layer // run.pp)  # the largest stage: ⌈L/pp⌉ (L when pp = 1)
    psi = blocks * ((12 * h * h + 7 * h) / t + 6 * h)  # split over tp, and kept whole on every tp rank
    vocab = -(-run.vocab_size // t) * t  # V' = ⌈V/tp⌉·tp
    if first:
        psi += vocab * h / t + run.seq_len * h  # the token embedding's rows, the position embedding
    if last:
        psi += vocab * h / t + 2 * h  # the head's rows, the final layer norm
    p, g, k = PRECISIONS[run.dtype]
    n = run.dp  # the ranks that hold copies of these same parameters
    return psi * ((p / n if run.zero >= 3 else p) + (g / n if run.zero >= 2 else g) + (k / n if run.zero >= 1 else k))


def activation_bytes(run):
    b, s, h, a, t, V = run.micro_batch_size, run.seq_len, run.d_model, run.n_head, run.tp, run.vocab_size
    e = {"mixed": 2, "float32": 4, "float64": 8}[run.dtype]
    n = b * s  # tokens of a micro-batch
    if run.checkpoint == "full":
        per_block = n * h  # only the block's input
    else:
        core = 0 if run.checkpoint == "selective" else b * a * s * s  # the attention probabilities
        per_block = 4 * n * h + 2 * n + (12 * n * h + core) / t
    blocks = -(-run.n_layer // run.pp)
    in_flight = min(run.pp, run.micro_batches)  # 1F1B: pp forwards before the first backward
    held = e * per_block * blocks * in_flight
    if run.pp == 1:  # the first rank is also the last: the head's float32 logits
        held += n * V / t * 4
    return held


def compute_seconds(run, cluster):
    h, s, L = run.d_model, run.seq_len, run.n_layer
    n_matmul = 12 * L * h * h + run.vocab_size * h  # the parameters that multiply each token
    flops = 6 * n_matmul + 12 * L * h * s  # per token, forward and backward
    if run.checkpoint == "full":
        flops += 2 * 12 * L * h * h + 4 * L * h * s  # the blocks' forward, once more
    elif run.checkpoint == "selective":
        flops += 4 * L * h * s  # the attention cores' forward, once more
    tokens = run.batch_size * s
    seconds = tokens * flops / run.gpus / (cluster.flops(run.dtype) * EFFICIENCY.gemm)
    if run.pp > 1:
        seconds *= 1 + (run.pp - 1) / run.micro_batches  # 1F1B: m + pp − 1 slots for m micro-batches
    return seconds


def mfu(run, cluster, step_seconds):
    h, s, L = run.d_model, run.seq_len, run.n_layer
    n_matmul = 12 * L * h * h + run.vocab_size * h
    model_flops = run.batch_size * s * (6 * n_matmul + 12 * L * h * s)  # no recomputation
    return model_flops / step_seconds / run.gpus / cluster.flops(run.dtype)


def tp_share(h, t, cluster):
    if t == 1:
        return 0.0
    # Per token: two all-reduces of h 16-bit numbers, a ring sending 2(t − 1)/t of each, against the
    # GEMMs' 24h²/t FLOPs. The tokens cancel: the share does not depend on the batch or the sequence.
    comm = 2 * 2 * (t - 1) / t * h * 2 / (cluster.intra_bandwidth * EFFICIENCY.network)
    gemm = 24 * h * h / t / (cluster.flops("mixed") * EFFICIENCY.gemm)
    return comm / (comm + gemm)


ANSWER = """
Model answer to the question (measure and explain).

(a) Compute x = comm/GEMM = 2·2(t−1)/t·h·e/β ÷ (24h²/(t·R)) = (t − 1)·e·R / (6·h·β), with R the
sustained GEMM rate (0.8 × peak) and β the sustained NVLink bandwidth (0.8 × 300 or 450 GB/s).
The tokens cancel: communication and GEMMs both scale with N, so no batch or sequence length
changes the share. The share is x/(1 + x). With h = 12288 on A100s x ≈ 0.028·(t − 1): 8% at
t = 4, 16% at t = 8. On H100s R/β is 989/450 instead of 312/300, twice as large, so the share is
about twice that: a faster GPU on a not-much-faster link makes tensor parallelism more expensive.
Doubling t always costs throughput: the GPU-time per token is (GEMMs)·(1 + x(t)), and x grows
with t. tp pays only through what its memory saving buys: a smaller pp (a smaller bubble,
(pp − 1)/m), no or selective recomputation instead of full (a third less compute), or a larger
micro-batch. It stops paying when x(2t) − x(t) ≈ e·R/(6hβ)·t exceeds what that saves; and beyond
a node (t = 16 on 8-GPU nodes) β drops by 12 (InfiniBand 25 GB/s against NVLink's 300), x by as
much, and tp never pays: part 3's table shows tp 16 losing to tp 8 at the same GPU count.

(b) MFU counts the FLOPs the model needs (6N + 12Lhs per token), not the ones the hardware ran.
Recomputation is work done again to save memory; counting it (HFU, hardware FLOPs utilisation)
would make a configuration that recomputes more look better even when it trains fewer tokens per
second. With MFU, full recomputation shows what it is: on part 1's run MFU is 38% with full
recomputation (HFU 51%) and 51% without any, which fits here (44.6 GB of 85.9 GB on the first
rank): the recomputation bought memory this run did not need. HFU would call the two configurations
about equally efficient although one trains a third more tokens per second. Choose on MFU (tokens
per second in units of the peak); HFU says only how busy the GPUs were.

(c) On this machine the prediction for the tiny GPT is typically far below the measured step: the
model charges op_overhead per kernel and GEMMs at the measured sustained rate, but refimpl's NumPy
engine spends its time in Python (autograd bookkeeping, many small operations: 22 per block in
forward, more in backward, the optimizer's per-parameter loop, the loss) and, on a shared machine,
waiting for BLAS threads that other processes hold. The step is dominated by fixed costs, which
scale with the number of operations, not with FLOPs; at h = 64 a block's GEMMs take microseconds.
A model 100× wider would spend most of its time in GEMMs and the prediction would be much closer;
`python -m refimpl calibrate` measures these rates more carefully than part 4 does.
"""
