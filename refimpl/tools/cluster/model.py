"""The cost model: memory per GPU and time per step of a GPT on a cluster, from refimpl's own formulas.

A run is a GPT (L blocks of width h, a heads, sequence s, vocabulary V; optionally a mixture of E
experts, K per token) trained with a global batch of B sequences in micro-batches of b, on
dp × tp × cp × pp GPUs (Megatron-LM's layout, parallel/mesh.py: tp fastest, then cp, dp, pp), a
ZeRO stage, a precision, a checkpoint mode and a pipeline schedule. With context parallelism
(cp > 1, cluster/context.py) every rank runs every layer on T/cp tokens of each sequence, the
parameters are replicated over cp, and so gradients reduce (and ZeRO shards) over dp · cp ranks;
attention becomes the blockwise kernel's balanced causal count, and its transfers (the ring's,
overlapped with each block, or Ulysses' all-to-alls) are the cp communication. At cp = 1 every
term below is as it was. Every term is a formula refimpl's executed code is tested
against, or the schedule simulator itself; what is new here is only the hardware (α–β links,
FLOP/s, memory bandwidth) and one fixed set of efficiencies, `EFFICIENCY`.

Memory per GPU (bytes), on the pipeline rank that holds the most (the first or the last):

    model states      the ZeRO table of memory.py (memory.partitions): P Ψ, G Ψ, K Ψ, each
                      divided by dp where the stage partitions it (the experts' by dp/ep); Ψ: this
                      rank's parameters (memory.gpt_parameter_tensors: its blocks / tp, its E/ep
                      experts, the embedding or head / tp); mixed precision P = G = 2, K = 12;
                      bf16 P = 2, G = 4, K = 12
    activations       memory.saved_elements_per_block (the formula the engine's saved-tensor ledger
                      is tested against: tp, sequence parallelism, selective recomputation, full
                      recomputation's kept input N·h, and the experts' bound averaged over the
                      stage's blocks) × e bytes (2 for 16-bit, as the papers count) × blocks per
                      stage × the schedule's peak of in-flight (stage, micro-batch) activations (the
                      simulator's); the last rank adds the loss's probabilities, N·⌈V/tp⌉. Unlike
                      memory.saved_bytes (exact for refimpl's process) it leaves out the embedding's
                      mask and ln_f's N·(2h + 1) and keeps the probabilities in float32: the papers
                      count the blocks and the logits, and 16-bit training keeps the loss in float32.
    working           one block's activations while it is recomputed (full), and the larger of
                      the attention scores (2·b·(a/tp)·s²·e) and the float32 logits' gradient
    buffers           two gradient buckets (`BUCKET_BYTES`, ZeRO 0–2), ZeRO-3's gathered
                      parameters of two blocks (the one running and the one prefetched), the
                      pipeline's send and receive buffers

Time of one action (one stage of L/(pp·v) blocks, one micro-batch of N = b·s tokens):

    F   GEMMs 24·N·h²/tp per block (MoE: attention's 8·N·h²/tp + K experts' 16·N·h² + the
        router 2·N·h·E) at peak × EFFICIENCY.gemm; the attention core 4·N·s·h/tp at
        peak × EFFICIENCY.attention; memory-bound kernels (layer norms, residual adds, GeLU,
        softmax, dropout) at memory bandwidth × EFFICIENCY.memory; `operations` kernels at
        op_overhead each; tensor parallelism's collectives (the counts of tensor_parallel/
        formulas.py, not overlapped: refimpl runs them in line); ZeRO-3's all-gather where it
        exceeds the compute it is prefetched behind; the last stage adds the head and the loss
    I   the input gradients: the same GEMMs, twice the attention core and the memory-bound
        traffic, tp's backward collectives; plus the recomputed forward (full: F's compute and
        collectives; selective: the attention core)
    W   the weight gradients: the same GEMMs again (B = I + W, F&B = F + B)
    P   one pipeline message: b·s·h·e bytes (/tp with sequence parallelism), across nodes when
        dp·tp fills a node

Experts (ep > 1) add a dispatch and a combine all-to-all per MoE block to F and to I (α–β over
the ep group). Without a pipeline they are waited for in full; in a pipeline the simulator's chunk
model places them (parallel/pipeline/simulate.py): every step waits for its own, except an F&B
step, whose halves interleave at the all-to-alls as refimpl's executor does (DualPipe's overlap).

A step is the schedule's makespan from the simulator (cluster/pipeline.py; m·(F + B) without a
pipeline), plus the data-parallel reduction that the last backward does not hide (refimpl's
bucketed DDP and ZeRO-1/2 reduce during each stage's last backward: exposed max(T − B, one
bucket); ZeRO-1/2 all-gather the updated shards after the step, exposed), plus the optimizer
(Adam, memory-bound: G + 2K + 2P bytes per parameter of the shard).

Context parallelism changes, per rank: N = b·s/cp tokens in every term above; the attention core
is 4·D per score element that accounting.score_elements counts (not 4·N·s·h/tp), with its softmax
traffic per score, and the blockwise backward recomputes the scores (half the core, and the
softmax) whatever the checkpoint mode (selective then adds nothing); activations keep no scores
and add the log-sum-exp; the working set is one chunk pair; buffers add the blocks in flight.

The Llama block (arch "llama"; Touvron et al. 2023, Dubey et al. 2024): RMSNorm, rotary positions,
a SwiGLU MLP of width F and grouped-query attention with K key/value heads of width D = h/a
(kv_width = K·D). Per block, the terms above change as follows; every other term is GPT-2's.

    parameters  wq, wo: h² each; wk, wv: h·K·D each; w1, w3, w2: h·F each; two RMSNorm gains h:
                2h² + 2h·K·D + 3h·F + 2h, no biases and no position table (memory.llama_parameter_tensors)
    GEMMs       2·N·(2h² + 2h·K·D + 3h·F)/tp forward (two FLOPs per multiply-add of each matrix);
                with K = a and F = 4h that is 2·N·16h²/tp, against GPT-2's 2·N·12h²/tp
    core        4·N·s·h/tp as GPT-2's: the scores and the weighted sum run over the a query heads
                (each key/value head is shared, not copied), so grouped-query attention saves
                projections, bytes and memory, not attention FLOPs
    memory-     GPT-2's layer norms, residual adds and softmax; SwiGLU's silu (reads and writes F) and
    bound       product (reads 2F, writes F): 5F per token where GeLU moves 8h; RoPE reads and writes
                q and k: 2·(h + K·D) per token
    operations  OPERATIONS_PER_LLAMA_BLOCK, counted in refimpl's graph as for GPT-2
    activations memory.saved_elements_per_block(arch="llama"), Korthikanti et al.'s accounting in
                elements as refimpl saves them, per token: the two RMSNorms' x̂ and output (4h) and
                1/rms (2), q and the heads' output (2h), k and v (2·K·D: grouped-query attention
                keeps K key/value heads, a/K times fewer than GPT-2's 2h), SwiGLU's gate, up
                projection and product (3F), and the a·s probabilities per query head unless
                recomputed; RoPE keeps nothing (its cos and sin are constants of the positions).
                (6h + 2·K·D + 3F + 2)·N + b·a·s², against GPT-2's (16h + 2)·N + b·a·s² at K = a,
                F = 4h; tp and sequence parallelism divide it as the ledger does
    tp          the same all-reduces (all-gathers, reduce-scatters) of N·h per block: the column-
                parallel group's input and the row-parallel output have width h whatever K and F
    cp          the ring's K/V blocks and Ulysses' k and v all-to-alls carry K/tp key/value heads
                (context.shape), the queries and outputs a/tp

Attention "flash" (Dao et al. 2022, FlashAttention; the kernel every Llama-era trainer runs): at
cp = 1 the core is 4·D per score of the tiles on and below the diagonal (flash_scores: the causal
half, b·(a/tp)·T·(T + 128)/2, instead of the dense T×T), no score passes through memory (no softmax or
dropout traffic, no scores among the activations or the working set; the log-sum-exp b·(a/tp)·T is
kept), and its backward recomputes the scores (half the forward's products, whatever the checkpoint:
selective then adds nothing); with cp > 1 the blockwise attention drops its softmax traffic likewise.
"dense" (the default) is refimpl's attention, the one the other terms describe.

Precision "bf16" (memory.PRECISIONS): bfloat16 parameters (P = 2), gradients accumulated and reduced
in float32 (G = 4), float32 master weights and Adam moments (K = 12); activations and pipeline
messages 2 bytes; arithmetic at the 16-bit tensor-core rate, the same as mixed's on the A100 and
H100 (hardware.Cluster.flops).

Outputs: the memory and time breakdowns, tokens per second, and MFU as Chowdhery et al. 2022
(PaLM, appendix B) define it: model FLOPs 6·N_params·tokens + 12·L·h·s·tokens (N_params: the
matrix parameters, the head included; recomputation not counted) ÷ (step time × GPUs × peak).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from refimpl.memory import (
    PRECISIONS,
    STAGE_NAMES,
    expert_blocks,
    expert_elements_per_token,
    gpt_parameters,
    partitions,
    saved_elements_outside_blocks,
    saved_elements_per_block,
)
from refimpl.nn.layers import check_llama_shape
from refimpl.parallel.pipeline.schedules import SCHEDULES, build

from . import context
from .collectives import Group, Links
from .hardware import Cluster
from .pipeline import estimate_step, parameter_copies, simulate_step, visits

CHECKPOINTS = ("none", "selective", "full")
DTYPES = ("mixed", "float32", "float64", "bf16")
ARCHITECTURES = ("gpt2", "llama")
BUCKET_BYTES = 25 * 10**6  # PyTorch DDP's default bucket (bucket_cap_mb=25)
# Kernels of one block's forward, as refimpl's engine runs it: one autograd operation each (2 layer
# norms, 4 linears, the qkv split, 4 reshapes, 4 transposes, 2 batched products, the causal
# softmax, 2 residual adds, GeLU; 3 dropouts more with dropout), counted in the engine's graph by
# calibrate.block_operations (tests/test_cluster.py); the model charges them once in F, I and W.
OPERATIONS_PER_BLOCK = 21
OPERATIONS_PER_DROPOUT_BLOCK = 24
# The Llama block's (nn/layers.py's LlamaBlock: 2 RMSNorms, 7 linears, RoPE on q and k, SwiGLU's silu and
# product, ...), counted the same way (calibrate.block_operations(arch="llama")).
OPERATIONS_PER_LLAMA_BLOCK = 30
OPERATIONS_PER_DROPOUT_LLAMA_BLOCK = 33
ATTENTION_KERNELS = ("dense", "flash")
FLASH_TILE = 128  # the fused kernel's query and key tiles (FlashAttention-2's 128 × 128 for a head of 128)


@dataclass(frozen=True)
class Efficiency:
    """The share of peak each kind of kernel reaches: one set for every cluster and every row
    (docs/cluster_model.md shows the published rows it is checked on; none is fitted per row)."""

    gemm: float = 0.8  # large matrix products (FLOP/s): cuBLAS reaches about 250 of the A100's 312
    attention: float = 0.6  # the attention core's batched products (FLOP/s): smaller, less efficient
    memory: float = 0.7  # memory-bound kernels (memory bandwidth)
    network: float = 0.8  # collectives and messages (link bandwidth): NCCL's bus bandwidth vs the link
    optimizer: float | None = None  # the optimizer's element-wise update (memory bandwidth); None: as memory


EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class Run:
    """One training configuration (the flags of `predict`)."""

    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab_size: int
    batch_size: int  # global, sequences per optimizer step
    micro_batch_size: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    dtype: str = "mixed"
    checkpoint: str = "none"
    schedule: str = "1f1b"
    chunks: int | None = None
    sequence_parallel: bool = False
    dropout: bool = False
    tie_weights: bool = False
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    ep: int = 1
    cp: int = 1  # context-parallel ranks per sequence (cluster/context.py)
    cp_impl: str = "ring"  # ring or ulysses
    arch: str = "gpt2"  # the block: gpt2, or llama (RMSNorm, RoPE, SwiGLU, grouped-query attention)
    kv_heads: int | None = None  # llama: key/value heads K, a divisor of n_head (None: n_head)
    ffn_size: int | None = None  # llama: the SwiGLU MLP's width F (None: 4·d_model)
    attention: str = "dense"  # dense: the T×T scores through memory, as refimpl; flash: a fused kernel

    @property
    def key_value_heads(self) -> int:
        """K: the key/value heads (GPT-2 and multi-head attention: n_head)."""
        return self.n_head if self.arch != "llama" or self.kv_heads is None else self.kv_heads

    @property
    def kv_width(self) -> int:
        """K·D: the width of the keys (and of the values)."""
        return self.key_value_heads * (self.d_model // self.n_head)

    @property
    def ffn(self) -> int:
        """The MLP's hidden width: F (llama), 4h (GPT-2)."""
        return self.ffn_size if self.arch == "llama" and self.ffn_size is not None else 4 * self.d_model

    @property
    def shape(self) -> dict:
        """The block's shape as memory.py's formulas take it (nothing for GPT-2: their defaults)."""
        return {"arch": "llama", "kv_width": self.kv_width, "ffn": self.ffn} if self.arch == "llama" else {}

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def gradient_ranks(self) -> int:
        """The ranks that hold the same parameters and reduce (or, ZeRO, shard) them: dp · cp."""
        return self.dp * self.cp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step and pipeline (per data-parallel replica)."""
        return self.batch_size // (self.dp * self.micro_batch_size)

    @property
    def stages(self) -> int:
        return self.pp * visits(self.schedule, self.chunks) if self.pp > 1 else 1

    def check(self) -> Run:
        """Raise ValueError (one line: what is wrong and how to fix it) for a configuration that cannot run."""
        for name in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size", "batch_size", "micro_batch_size",
                     "dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer; got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --n-head {self.n_head}")
        if self.n_head % self.tp:
            raise ValueError(f"--tp {self.tp} must divide --n-head {self.n_head} (each tp rank takes whole heads)")
        check_architecture(self)
        if self.batch_size % (self.dp * self.micro_batch_size):
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by dp × micro-batch size = "
                             f"{self.dp} × {self.micro_batch_size}; each replica needs whole micro-batches")
        if self.zero not in STAGE_NAMES:
            raise ValueError(f"--zero must be 0, 1, 2 or 3; got {self.zero}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"--checkpoint must be one of {', '.join(CHECKPOINTS)}; got {self.checkpoint!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel needs --tp > 1")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"--attention must be one of {', '.join(ATTENTION_KERNELS)}; got {self.attention!r}")
        context.check(self)
        if self.experts:
            if self.experts % self.ep or self.dp % self.ep:
                raise ValueError(f"--ep {self.ep} must divide --experts {self.experts} and dp {self.dp}")
            if self.tp > 1:
                raise ValueError("experts with --tp > 1 are not modelled (refimpl refuses them too); use --ep")
        if self.pp > 1:
            if self.schedule not in SCHEDULES:
                raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
            build(self.schedule, self.pp, min(self.micro_batches, 4 * self.pp + self.micro_batches % (2 * self.pp)),
                  self.chunks)  # the generator's own checks (even pp, m >= 2pp, ...), on a short run
            if self.schedule == "interleaved" and self.micro_batches % self.pp:
                raise ValueError(f"interleaved needs micro-batches per replica ({self.micro_batches}) to be a multiple "
                                 f"of --pp {self.pp}")
        if self.n_layer < self.stages:
            raise ValueError(f"--n-layer {self.n_layer} is fewer than the {self.stages} stages of {self.schedule} "
                             f"(pp × chunks); every stage needs a block: lower --pp or --chunks")
        return self

    @property
    def blocks_per_stage(self) -> int:
        """Blocks of the largest stage (stage.py balances by count: they differ by at most one)."""
        return -(-self.n_layer // self.stages)


def check_architecture(run: Run) -> None:
    """One-line ValueErrors for the block's shape: refimpl's own rules (nn/layers.check_llama_shape), and
    Megatron-LM's for tensor parallelism (tp divides the key/value heads and the SwiGLU width)."""
    if run.arch not in ARCHITECTURES:
        raise ValueError(f"--arch must be one of {', '.join(ARCHITECTURES)}; got {run.arch!r}")
    if run.arch != "llama":
        if run.kv_heads is not None or run.ffn_size is not None:
            raise ValueError("--kv-heads and --ffn-size shape the Llama block; add --arch llama")
        return
    for name, value in (("kv_heads", run.kv_heads), ("ffn_size", run.ffn_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer; got {value!r}")
    check_llama_shape(run.d_model, run.n_head, run.key_value_heads, run.ffn_size)
    if run.key_value_heads % run.tp:
        raise ValueError(f"--tp {run.tp} must divide --kv-heads {run.key_value_heads} (each tp rank takes whole "
                         f"key/value heads, as Megatron-LM requires); use a --tp that divides it")
    if run.ffn % run.tp:
        raise ValueError(f"--tp {run.tp} must divide --ffn-size {run.ffn} (each tp rank takes ffn-size/tp of the "
                         f"SwiGLU MLP's hidden units); use --ffn-size {run.ffn + run.tp - run.ffn % run.tp}")
    if run.experts:
        raise ValueError("--arch llama with --experts is not modelled yet (the cluster model's Llama block has the "
                         "dense SwiGLU MLP); drop --experts, or use --arch gpt2")


# ------------------------------------------------------------------------------------------------
# Parameters
# ------------------------------------------------------------------------------------------------


def moe_blocks(run: Run, blocks: int) -> int:
    """Blocks with experts among `blocks` (memory.expert_blocks)."""
    return expert_blocks(blocks, run.experts, run.moe_every)


def parameters(run: Run) -> int:
    """Ψ of the whole model (memory.gpt_parameter_tensors: refimpl's GPT, untied head unless tie_weights)."""
    return sum(gpt_parameters(run.vocab_size, run.seq_len, run.d_model, run.n_layer, tied=run.tie_weights,
                              experts=run.experts, moe_every=run.moe_every, **run.shape).values())


def block_matrix_elements(run: Run) -> int:
    """The matrices of one dense block: GPT-2's 12h² (qkv 3h², proj h², the MLP 8h²); Llama's
    2h² + 2h·K·D + 3h·F (wq and wo; wk and wv; w1, w3 and w2)."""
    h = run.d_model
    if run.arch == "llama":
        return 2 * h * h + 2 * h * run.kv_width + 3 * h * run.ffn
    return 12 * h * h


def matmul_parameters(run: Run) -> int:
    """Parameters that multiply each token (PaLM's N for the model FLOPs): the blocks' matrices,
    K of E experts' MLPs, the router, and the head."""
    h = run.d_model
    if run.arch == "llama":
        return run.n_layer * block_matrix_elements(run) + run.vocab_size * h
    moe = moe_blocks(run, run.n_layer)
    per_dense, per_moe = 12 * h * h, 4 * h * h + run.top_k * 8 * h * h + run.experts * h
    return (run.n_layer - moe) * per_dense + moe * per_moe + run.vocab_size * h


def model_flops(run: Run) -> int:
    """FLOPs of one step as PaLM's MFU counts them (Chowdhery et al. 2022, appendix B): 6·N per token for
    the N = matmul_parameters, and 12·L·h·T per token for attention (the whole T×T, recomputation
    not counted), over the B·T tokens of the step."""
    tokens = run.batch_size * run.seq_len
    return tokens * (6 * matmul_parameters(run) + 12 * run.n_layer * run.d_model * run.seq_len)


def rank_parameters(run: Run, first: bool, last: bool) -> tuple[int, int]:
    """(dense, expert) parameter elements one GPU holds (memory.gpt_parameter_tensors): its blocks
    / tp (experts / ep), and the embedding (first stage) or head (last stage) / tp. DualPipe holds
    two stages."""
    blocks = -(-run.n_layer // run.pp) * parameter_copies(run.schedule) if run.pp > 1 else run.n_layer
    held = gpt_parameters(run.vocab_size, run.seq_len, run.d_model, blocks, run.tp, run.tie_weights, run.experts,
                          run.moe_every, run.ep, embedding=first, head=last, **run.shape)
    return held["split"] + held["whole"], held["experts"]


def flash_scores(run: Run) -> int:
    """Score elements a fused causal kernel computes per block, on one tp rank and micro-batch: the tiles
    on and below the diagonal, b·(a/tp)·T·(T + tile)/2 (exact when the tile divides T)."""
    return run.micro_batch_size * (run.n_head // run.tp) * run.seq_len * (run.seq_len + FLASH_TILE) // 2


# ------------------------------------------------------------------------------------------------
# One action's time
# ------------------------------------------------------------------------------------------------


@dataclass
class ActionTimes:
    """Seconds of one action, split by what they are (for the step's breakdown)."""

    F: dict = field(default_factory=dict)
    I: dict = field(default_factory=dict)
    W: dict = field(default_factory=dict)
    P: float = 0.0
    A: float = 0.0  # one all-to-all of the experts (pipelines: the simulator places them)
    exchanges: int = 0  # all-to-alls in one stage's forward (as many in its backward)

    def total(self, kind: str) -> float:
        return sum(getattr(self, kind).values())


def _add(d: dict, key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


def action_times(run: Run, cluster: Cluster, eff: Efficiency = EFFICIENCY, last: bool = True) -> ActionTimes:
    """F, I, W of one stage and micro-batch, and P, by part: compute, recompute, tp, zero3."""
    h, s, a, t, b, V = run.d_model, run.seq_len, run.n_head, run.tp, run.micro_batch_size, run.vocab_size
    N = b * s // run.cp  # this rank's tokens (context parallelism: T/cp of each sequence)
    e = _itemsize(run.dtype)
    flops = cluster.flops(run.dtype)
    links = Links.of(cluster, eff.network)
    blocks = run.blocks_per_stage
    moe = moe_blocks(run, blocks)
    sp = run.sequence_parallel
    gemm_rate, core_rate, bandwidth = flops * eff.gemm, flops * eff.attention, cluster.memory_bandwidth * eff.memory

    # Per block, forward: GEMMs, the attention core, memory-bound traffic (elements per token).
    dense_gemm = 24 * N * h * h / t if run.arch != "llama" else 2 * N * block_matrix_elements(run) / t
    pointwise = 8 * h if run.arch != "llama" else 5 * run.ffn + 2 * (h + run.kv_width)  # GeLU; SwiGLU and RoPE
    moe_gemm = 8 * N * h * h / t + run.top_k * 16 * N * h * h + 2 * N * h * run.experts
    gemm = (blocks - moe) * dense_gemm + moe * moe_gemm
    whole = (4 + 6) * h + (9 * h if run.dropout else 0)  # layer norms, residual adds, dropouts
    flash = run.attention == "flash"
    whole_here = whole / t if sp else whole  # sequence parallelism: these on 1/t of the tokens
    if run.cp == 1 and flash:  # a fused kernel: the causal half of the scores, none of them through memory
        core = blocks * 4 * (h // a) * flash_scores(run)
        traffic = blocks * N * e * (whole_here + pointwise / t)
    elif run.cp == 1:  # dense attention: every score of the T×T product
        core = blocks * 4 * N * s * h / t
        split = pointwise + 2 * a * s + (3 * a * s if run.dropout else 0)  # MLP; softmax (and dropout) per head
        traffic = blocks * N * e * (whole_here + split / t)
    else:  # blockwise attention on T/cp tokens: the score elements refimpl computes (cluster/context.py)
        attention = context.layer_times(run, cluster, links, core_rate, e)
        core = blocks * attention.flops
        softmax = blocks * e * (2 + (3 if run.dropout else 0)) * attention.scores  # softmax (and dropout) per score
        traffic = blocks * N * e * (whole_here + pointwise / t) + (0 if flash else softmax)
    if run.arch == "llama":
        operations = OPERATIONS_PER_DROPOUT_LLAMA_BLOCK if run.dropout else OPERATIONS_PER_LLAMA_BLOCK
    else:
        operations = OPERATIONS_PER_DROPOUT_BLOCK if run.dropout else OPERATIONS_PER_BLOCK
    overhead = blocks * operations * cluster.op_overhead
    blocks_forward = gemm / gemm_rate + core / core_rate + traffic / bandwidth + overhead
    times = ActionTimes()
    _add(times.F, "compute", blocks_forward)
    _add(times.I, "compute", gemm / gemm_rate + 2 * core / core_rate + 2 * traffic / bandwidth + overhead)
    _add(times.W, "compute", gemm / gemm_rate + overhead)
    if last:  # the head: a GEMM each way, the float32 softmax cross-entropy (3 passes forward, 2 back)
        head = 2 * N * h * V / t
        _add(times.F, "compute", head / gemm_rate + 3 * N * V / t * 4 / bandwidth)
        _add(times.I, "compute", head / gemm_rate + 2 * N * V / t * 4 / bandwidth)
        _add(times.W, "compute", head / gemm_rate)

    # Tensor parallelism: collectives of N·h elements per block (tensor_parallel/communication.py's counts).
    tp_group = Group.of(t, 1, cluster)
    nh = N * h * e
    if t > 1:
        if sp:
            forward = 2 * (links.allgather(nh, tp_group) + links.reduce_scatter(nh, tp_group))
            backward = 4 * links.allgather(nh, tp_group) + 2 * links.reduce_scatter(nh, tp_group)
        else:
            forward = backward = 2 * links.allreduce(nh, tp_group)
        _add(times.F, "tp", blocks * forward)
        _add(times.I, "tp", blocks * backward)
        if run.checkpoint == "full":
            _add(times.I, "tp", blocks * forward)

    # Context parallelism: what the ring's overlap or Ulysses' all-to-alls leave exposed.
    if run.cp > 1:
        _add(times.F, "cp", blocks * attention.forward_exposed)
        _add(times.I, "cp", blocks * attention.backward_exposed)
        if run.checkpoint == "full":
            _add(times.I, "cp", blocks * attention.forward_exposed)

    # Recomputation, charged to the backward that needs it.
    if run.checkpoint == "full":
        _add(times.I, "recompute", blocks_forward)  # the blocks again; the head is not checkpointed
    elif run.checkpoint == "selective" and run.cp == 1 and not flash:
        _add(times.I, "recompute", core / core_rate + blocks * N * e * (2 * a * s / t) / bandwidth)
    if run.cp > 1:  # blockwise backward recomputes every block's scores and softmax, whatever the checkpoint
        recomputed_softmax = 0 if flash else blocks * e * 2 * attention.scores  # exp(s − L) again, as selective's
        _add(times.I, "recompute", context.RECOMPUTED_PRODUCTS * core / core_rate + recomputed_softmax / bandwidth)
    elif flash:  # the fused kernel's backward recomputes the scores (half its forward products), on chip
        _add(times.I, "recompute", context.RECOMPUTED_PRODUCTS * core / core_rate)

    # ZeRO-3: the stage's parameters gathered for F and for B, gradients reduce-scattered in B,
    # prefetched behind the compute (exposed: what the compute does not cover, and the first block).
    if run.zero == 3 and run.gradient_ranks > 1:
        dp_group = Group.of(run.gradient_ranks, t, cluster)
        dense, experts = rank_parameters(run, first=False, last=last)
        stages_held = visits(run.schedule, run.chunks) * parameter_copies(run.schedule) if run.pp > 1 else 1
        psi_stage = (dense + experts) / stages_held  # the parameters of the stage this action runs
        p_bytes, g_bytes, _ = PRECISIONS[run.dtype]
        gather = links.allgather(psi_stage * p_bytes, dp_group)
        scatter = links.reduce_scatter(psi_stage * g_bytes, dp_group)
        first_block = gather / max(blocks, 1)
        _add(times.F, "zero3", first_block + max(0.0, gather - first_block - times.total("F")))
        backward = times.total("I") + times.total("W")
        _add(times.I, "zero3", first_block + max(0.0, gather + scatter - first_block - backward))

    # Experts' all-to-alls: a dispatch and a combine per MoE block, forward and backward. Without a
    # pipeline they are waited for in full; in one, the simulator's chunk model places them
    # (an F&B step hides them behind the other half's compute: DualPipe's overlap).
    if moe and run.ep > 1:
        ep_group = Group.of(run.ep, t, cluster)
        times.A = links.all_to_all(run.top_k * N * h * e, ep_group)
        times.exchanges = 2 * moe
        if run.pp == 1:
            _add(times.F, "ep", times.exchanges * times.A)
            _add(times.I, "ep", times.exchanges * times.A)

    # A pipeline message: the activation (or its gradient) of one micro-batch.
    if run.pp > 1:
        across = run.dp * run.tp * run.cp >= cluster.gpus_per_node
        times.P = links.send(nh / t if sp else nh, across)
    return times


def _itemsize(dtype: str) -> int:
    return {"mixed": 2, "bf16": 2, "float32": 4, "float64": 8}[dtype]


# ------------------------------------------------------------------------------------------------
# The prediction
# ------------------------------------------------------------------------------------------------


@dataclass
class Prediction:
    run: Run
    cluster: str
    step_seconds: float
    tokens_per_second: float
    model_flops_per_gpu_per_second: float
    mfu: float
    memory_per_gpu_bytes: int
    fits: bool
    memory: dict  # bytes by part, on the rank that holds the most
    time: dict  # seconds per step by part
    parameters: int
    micro_batches: int
    peak_in_flight: int
    simulated_micro_batches: tuple = ()
    context_parallel: dict = field(default_factory=dict)  # cp > 1: bytes per layer and rank, the cp group's links

    def as_dict(self) -> dict:
        out = asdict(self)
        out["run"] = asdict(self.run)
        return out


def efficiency_of(cluster: Cluster) -> Efficiency:
    """The cluster's own efficiencies (a calibrated machine's), else the one fixed set."""
    return Efficiency(**{**asdict(EFFICIENCY), **cluster.efficiency}) if cluster.efficiency else EFFICIENCY


def predict(run: Run, cluster: Cluster, eff: Efficiency | None = None, simulate: bool = True,
            check: bool = True) -> Prediction:
    """Memory and step time of `run` on `cluster`. simulate=False: the pipeline from the closed
    forms instead of the simulator (cluster/pipeline.py's estimate_step; what `plan` ranks with);
    check=False: `run` is known to be valid (plan's candidates are, by construction)."""
    if check:
        run.check()
    eff = eff or efficiency_of(cluster)
    m = run.micro_batches
    t_last = action_times(run, cluster, eff, last=True)  # every stage timed as the last (the head's)
    F, I, W = t_last.total("F"), t_last.total("I"), t_last.total("W")
    if run.pp > 1:
        pipe = (simulate_step if simulate else estimate_step)(run.schedule, run.pp, m, run.chunks, F, I, W, t_last.P,
                                                              t_last.A, t_last.exchanges)
        makespan, peaks, simulated = pipe.makespan, pipe.peak_in_flight, pipe.simulated_micro_batches
        exposed_a2a = pipe.exposed_all_to_all
    else:
        makespan = m * (F + I + W)
        peaks, simulated, exposed_a2a = (1,), (), 0.0
    n = m * visits(run.schedule, run.chunks) if run.pp > 1 else m  # actions of each kind per rank

    time = {"compute": 0.0, "recompute": 0.0, "tp_communication": 0.0, "zero3_communication": 0.0,
            "ep_communication": 0.0}
    names = {"compute": "compute", "recompute": "recompute", "tp": "tp_communication", "zero3": "zero3_communication",
             "ep": "ep_communication", "cp": "cp_communication"}
    if run.cp > 1:
        time["cp_communication"] = 0.0
    for kind in ("F", "I", "W"):
        for part, seconds in getattr(t_last, kind).items():
            time[names[part]] += n * seconds
    time["ep_communication"] += exposed_a2a  # a pipeline's all-to-all waits, from the simulator
    time["bubble"] = max(0.0, makespan - n * (F + I + W) - exposed_a2a)  # idle (the simulator counts whole ns)
    time["dp_communication"] = _dp_exposed(run, cluster, eff, I + W)
    time["optimizer"] = _optimizer_seconds(run, cluster, eff)
    step = makespan + time["dp_communication"] + time["optimizer"]

    tokens = run.batch_size * run.seq_len
    per_gpu = model_flops(run) / step / run.gpus
    memory = max((memory_breakdown(run, cluster, peaks[r], first=(r == 0), last=(r == len(peaks) - 1))
                  for r in {0, len(peaks) - 1}), key=lambda d: sum(d.values()))
    total = int(sum(memory.values()))
    return Prediction(run=run, cluster=cluster.name, step_seconds=step, tokens_per_second=tokens / step,
                      model_flops_per_gpu_per_second=per_gpu, mfu=per_gpu / cluster.flops(run.dtype),
                      memory_per_gpu_bytes=total, fits=total <= cluster.memory_bytes, memory=memory, time=time,
                      parameters=parameters(run), micro_batches=m, peak_in_flight=max(peaks),
                      simulated_micro_batches=simulated, context_parallel=_context_parallel(run, cluster))


def _context_parallel(run: Run, cluster: Cluster) -> dict:
    """What `predict` reports of the cp group (empty at cp 1)."""
    if run.cp == 1:
        return {}
    cp_group = context.group(run, cluster)
    per_layer = context.bytes_per_layer(run, _itemsize(run.dtype))
    return {"impl": run.cp_impl, "bytes_per_layer": per_layer, "inside_a_node": cp_group.per_node == run.cp,
            "tokens_per_rank": run.seq_len // run.cp}


def _dp_exposed(run: Run, cluster: Cluster, eff: Efficiency, backward: float) -> float:
    """The data-parallel reduction the last backward does not hide, and ZeRO-1/2's all-gather."""
    if run.gradient_ranks == 1 or run.zero == 3:
        return 0.0  # ZeRO-3's traffic is inside the actions
    links = Links.of(cluster, eff.network)
    group = Group.of(run.gradient_ranks, run.tp, cluster)  # dp · cp ranks, tp apart (mesh.py)
    dense, experts = rank_parameters(run, first=True, last=run.pp == 1)
    p_bytes, g_bytes, _ = PRECISIONS[run.dtype]
    grads = dense * g_bytes
    bucket_share = min(1.0, BUCKET_BYTES / max(grads, 1))
    if run.zero == 0:
        reduce = links.allreduce(grads, group)
        return max(reduce - backward, reduce * bucket_share)
    reduce = links.reduce_scatter(grads, group)
    exposed = max(reduce - backward, reduce * bucket_share)
    return exposed + links.allgather(dense * p_bytes, group)


def _optimizer_seconds(run: Run, cluster: Cluster, eff: Efficiency) -> float:
    dense, experts = rank_parameters(run, first=True, last=run.pp == 1)
    p_bytes, g_bytes, k_bytes = PRECISIONS[run.dtype]
    shard = dense / run.gradient_ranks if run.zero else dense
    shard += experts / (run.dp // run.ep) if run.zero else experts
    share = eff.memory if eff.optimizer is None else eff.optimizer
    return shard * (g_bytes + 2 * k_bytes + 2 * p_bytes) / (cluster.memory_bandwidth * share)


def memory_breakdown(run: Run, cluster: Cluster, in_flight: int, first: bool, last: bool) -> dict:
    """Bytes one GPU holds at its peak, by part (the module docstring)."""
    h, s, a, t, b, V = run.d_model, run.seq_len, run.n_head, run.tp, run.micro_batch_size, run.vocab_size
    e = _itemsize(run.dtype)
    p_bytes, g_bytes, k_bytes = PRECISIONS[run.dtype]
    dense, experts = rank_parameters(run, first, last)
    n, n_experts = run.gradient_ranks, run.dp // run.ep  # ZeRO partitions over dp · cp; the experts over dp / ep
    out = {}
    for category, per_parameter in (("parameters", p_bytes), ("gradients", g_bytes), ("optimizer_states", k_bytes)):
        held = dense / n + experts / n_experts if partitions(run.zero, category) else dense + experts
        out[category] = per_parameter * held  # memory.py's ZeRO table
    blocks, sp = run.blocks_per_stage, run.sequence_parallel
    tokens = s // run.cp  # of each sequence, on this rank
    flash = run.attention == "flash"  # cp or flash: blockwise, no scores kept
    recompute = "selective" if run.checkpoint == "selective" or run.cp > 1 or flash else "none"
    per_block = e * sum(saved_elements_per_block(b, tokens, h, a, t, sp, run.dropout, recompute,
                                                 **run.shape).values())
    if run.cp > 1 or flash:
        per_block += e * context.saved_elements(run)  # the log-sum-exp
    if run.experts:  # the stage's share of MoE blocks, averaged over its blocks
        per_block += e * moe_blocks(run, blocks) / blocks * b * s * expert_elements_per_token(h, run.experts, run.top_k)
    kept = per_block
    if run.checkpoint == "full":  # a checkpointed block keeps only its input
        kept = e * saved_elements_per_block(b, tokens, h, a, t, sp, recompute="full")["input"]
    activations = in_flight * blocks * kept
    logits = saved_elements_outside_blocks(b, tokens, h, V, tp=t)["loss"]  # N·⌈V/t⌉ on this tp rank
    if last:
        activations += 4 * logits  # the head's float32 logits, kept for the loss's backward
    out["activations"] = activations
    if run.cp > 1:
        scores = context.working_elements(run) * e  # one chunk pair
    else:
        scores = 0 if flash else 2 * b * (a / t) * s * s * e  # the fused kernel's tiles stay on chip
    working = max(scores, 2 * 4 * logits)
    out["working"] = working + (per_block if run.checkpoint == "full" else 0)  # the block being recomputed
    buffers = 2 * e * b * tokens * h if run.pp > 1 else 0
    if run.zero == 3:
        buffers += 2 * p_bytes * (block_matrix_elements(run) // t)
    elif run.gradient_ranks > 1:
        buffers += 2 * min(BUCKET_BYTES, g_bytes * dense)
    if run.cp > 1:
        buffers += context.buffer_bytes(run, e)
    out["buffers"] = buffers
    return {k: int(v) for k, v in out.items()}
