"""A GPT cut over a tensor-parallel group: which rank keeps which slice of which weight.

Megatron-LM's transformer layer (Shoeybi et al. 2019, arXiv 1909.08053, §3, Figure 3) on t ranks,
rank r of the group (`comm`), with sequence parallelism (Korthikanti et al. 2022, arXiv
2205.05198, §4.2.2) as an option:

    embedding   wte: vocabulary rows [r·V'/t, (r+1)·V'/t) of the padded vocabulary V' (a multiple
                of t), summed by g (ḡ: reduce-scatter to sequence shards); wpe whole (its shard of
                positions under sequence parallelism); dropout
    attention   ln1 → qkv column-parallel: heads [r·H/t, (r+1)·H/t) of each of q, k and v (rows
                of each third of the fused weight) → attention on those heads → proj row-parallel
                (columns of those heads) → g (ḡ) → + bias → dropout → + residual
    MLP         ln2 → fc column-parallel (rows r·4C/t ..) → GeLU → proj row-parallel → g (ḡ) →
                + bias → dropout → + residual
    head        ln_f → lm_head column-parallel over the vocabulary (tied: wte's rows) → logits
                (B, T, V'/t) → the vocabulary-parallel cross-entropy (cross_entropy.py)

Llama's block (arch "llama", `_shard_llama_block`) is cut the same way, without biases:

    attention   rms1 → one f (f̄) → wq, wk, wv column-parallel: query heads [r·H/t, (r+1)·H/t),
                key/value heads [r·Hkv/t, (r+1)·Hkv/t) (t divides Hkv) → rotary positions and
                attention on those heads → wo row-parallel → g (ḡ) → dropout → + residual;
                with Hkv < t (Hkv divides t) key/value head ⌊r·Hkv/t⌋ replicated on t/Hkv ranks,
                its gradients summed over them (`_shard_llama_block`)
    MLP         rms2 → one f (f̄) → w1, w3 column-parallel (rows r·F/t ..) → SwiGLU → w2
                row-parallel → g (ḡ) → dropout → + residual

Everything else (layer norms, the row-parallel biases, wpe) is whole on every rank. Without
sequence parallelism those see the same activations and gradients on every rank and stay equal;
with it each rank sees only its sequence shard, so a gradient hook sums each such parameter's
gradient over the group in every backward, before it is accumulated (one all-reduce per
parameter and backward).

Construction: the caller builds the whole single-process GPT from the seed (as every rank does;
pipeline/stage.py) and `shard_gpt` keeps this rank's slice of every split weight, so the model
equals the single-process one by construction; the padded vocabulary rows are zero, never looked
up, masked out of the loss, and so never move. Parameters keep their single-process names.
`WeightSplit` records how each weight was cut; `TensorParallelGPT.whole` puts the pieces back
together (verify, checkpoints' consolidation, evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refimpl import backend
from refimpl.autograd.tensor import Parameter
from refimpl.checkpointing.plans import chain_plan
from refimpl.nn.models import GPT

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shared_input_column_parallel


@dataclass(frozen=True)
class WeightSplit:
    """A whole parameter cut along `axis` into t equal slices; `parts` > 1: the axis holds that many
    blocks (q, k, v) and each rank takes its slice of every block; `length`: the axis' real length
    when it was padded to a multiple of t (the vocabulary), else None; `replicas` > 1: cut into
    t/replicas slices only, slice ⌊r/replicas⌋ held by `replicas` neighbouring ranks (key/value heads
    fewer than the ranks)."""

    axis: int
    parts: int = 1
    length: int | None = None
    replicas: int = 1

    def shard(self, whole, r: int, t: int):
        """Rank r's slice of the whole array (zero-padded first if the axis is padded)."""
        r, t = r // self.replicas, t // self.replicas
        a = np.moveaxis(np.asarray(whole), self.axis, 0)
        if self.length is not None:
            a = np.concatenate([a, np.zeros((padded(len(a), t) - len(a),) + a.shape[1:], a.dtype)])
        blocks = a.reshape((self.parts, t, len(a) // (self.parts * t)) + a.shape[1:])  # (parts, t, n, …)
        return np.moveaxis(blocks[:, r].reshape((-1,) + a.shape[1:]), 0, self.axis).copy()

    def join(self, shards: list):
        """The whole array from every rank's slice, in rank order (the padding dropped; of replicated
        slices the first copy)."""
        s = [np.moveaxis(np.asarray(x), self.axis, 0) for x in shards[::self.replicas]]
        rest = s[0].shape[1:]
        blocks = np.stack([x.reshape((self.parts, -1) + rest) for x in s], axis=1)  # (parts, t, n, …)
        a = blocks.reshape((-1,) + rest)
        if self.length is not None:
            a = a[:self.length]
        return np.moveaxis(a, 0, self.axis).copy()


def padded(n: int, t: int) -> int:
    """n rounded up to a multiple of t (the padded vocabulary V')."""
    return -(-n // t) * t


class TensorParallelGPT:
    """The model's tensor-parallel side: its group, the splits, the loss, and whole() (see shard_gpt)."""

    def __init__(self, model: GPT, comm, sequence_parallel: bool) -> None:
        self.model, self.comm, self.sequence_parallel = model, comm, sequence_parallel
        self.size, self.rank = comm.size, comm.rank
        self.vocab_size = model.config.vocab_size
        self.padded_vocab = padded(self.vocab_size, self.size)
        self.vocab_start = self.rank * self.padded_vocab // self.size
        self.splits: dict[str, WeightSplit] = {}  # parameter name -> how it is cut; the rest is whole
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # whole, before any cut

    def cross_entropy(self, logits, targets, ignore_index: int = -100, reduction: str = "mean"):
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.vocab_size, self.comm,
                                            ignore_index, reduction)

    def whole_names(self, names) -> list:
        """The names among `names` of parameters held whole on every rank (counted once in a norm)."""
        return [name for name in names if name not in self.splits]

    def uncounted_names(self, names) -> list:
        """The names among `names` whose gradient norm another rank of the group counts: the whole
        parameters on ranks other than 0, replicated slices on all but their first replica."""
        names = list(names)
        whole = self.whole_names(names) if self.rank > 0 else []
        return whole + [name for name in names if name in self.splits and self.rank % self.splits[name].replicas]

    def gather_by_name(self, arrays: dict) -> dict:
        """{name: whole array} from this rank's {name: slice} (collective over the group; every rank
        gets the result). One all-gather of every split array, flattened in the dict's order."""
        split = [name for name in arrays if name in self.splits]
        if not split:
            return dict(arrays)
        host = {name: backend.to_host(arrays[name]) for name in split}
        flat = np.concatenate([host[name].reshape(-1) for name in split])  # (n,)
        gathered = backend.to_host(self.comm.allgather(backend.asarray(flat))).reshape(self.size, -1)  # (t, n)
        out, offset = dict(arrays), 0
        for name in split:
            size, shape = host[name].size, host[name].shape
            out[name] = self.splits[name].join([gathered[k, offset:offset + size].reshape(shape)
                                                 for k in range(self.size)])
            offset += size
        return out


def check_options(tp: int, sequence_parallel: bool = False, partition_activations: bool = False,
                  checkpoint="none", model: str = "gpt", n_head: int = 1, seq_len: int = 0,
                  kv_heads: int | None = None, ffn_size: int | None = None) -> None:
    """One clear ValueError for a tensor-parallel configuration that cannot run (the same on every rank)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be a positive integer (tensor-parallel ranks), got {tp}")
    if sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel cuts the sequence over the tensor-parallel group; it needs --tp 2 "
                         "or more")
    if partition_activations:
        if tp == 1:
            raise ValueError("--partition-activations divides activation checkpoints over the tensor-parallel "
                             "group; it needs --tp 2 or more")
        if sequence_parallel:
            raise ValueError("--partition-activations has nothing to divide with --sequence-parallel: each kept "
                             "block input is already this rank's 1/t sequence shard; drop one of the two")
        if str(chain_plan(checkpoint)).startswith("auto:"):
            raise ValueError(f"--partition-activations divides kept block inputs, and --checkpoint {checkpoint} keeps "
                             "tensors of the graph instead; use a chain plan (e.g. --checkpoint every:1) with it")
        if str(chain_plan(checkpoint)) == "none":
            raise ValueError(f"--partition-activations divides the kept block inputs of a checkpointing plan, and "
                             f"--checkpoint {checkpoint} keeps none; use e.g. --checkpoint every:1")
    if tp == 1:
        return
    if model != "gpt":
        raise ValueError(f"--tp {tp} splits a GPT's layers over ranks; use it with --model gpt, or --tp 1")
    if n_head % tp:
        raise ValueError(f"--tp {tp} does not divide the GPT's {n_head} attention heads: use a --tp that divides "
                         f"--n-head {n_head} ({', '.join(map(str, _divisors(n_head)))}), or --n-head "
                         f"{n_head + tp - n_head % tp} with --tp {tp}")
    if kv_heads is not None and kv_heads < tp and tp % kv_heads:  # replicas: each rank's queries in one group
        raise ValueError(f"--tp {tp} is more than --kv-heads {kv_heads} and not a multiple of it: each key/value "
                         f"head is replicated on tp/kv-heads ranks; use a --tp that --kv-heads divides or that divides "
                         f"it ({', '.join(map(str, _divisors(kv_heads)))})")
    if kv_heads is not None and kv_heads > tp and kv_heads % tp:
        raise ValueError(f"--tp {tp} does not divide --kv-heads {kv_heads}: each tensor-parallel rank holds "
                         f"kv-heads/tp key/value heads; use a --tp that divides --kv-heads "
                         f"({', '.join(map(str, _divisors(kv_heads)))})")
    if ffn_size is not None and ffn_size % tp:  # SwiGLU's hidden units, cut into t equal slices
        raise ValueError(f"--tp {tp} does not divide --ffn-size {ffn_size}: each tensor-parallel rank holds "
                         f"ffn-size/tp of the SwiGLU MLP's hidden units; use --ffn-size {ffn_size + tp - ffn_size % tp}"
                         f" or a --tp that divides {ffn_size}")
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"--sequence-parallel cuts each sequence into --tp {tp} shards, but --seq-len {seq_len} "
                         f"is not divisible by {tp}; use a multiple of {tp}")


def shard_gpt(model: GPT, comm, sequence_parallel: bool = False) -> TensorParallelGPT:
    """Cut `model` (built whole, from the single-process seed) in place over the group `comm`."""
    t, r = comm.size, comm.rank
    c = model.config
    llama = c.arch == "llama"  # its key/value heads and SwiGLU width are split too
    check_options(t, sequence_parallel, n_head=c.n_head, seq_len=c.seq_len,
                  kv_heads=c.n_kv_heads if llama else None, ffn_size=c.ffn_width if llama else None)
    tp = TensorParallelGPT(model, comm, sequence_parallel)
    kv_replicas = max(1, t // c.n_kv_heads) if llama else 1
    # with replicated key/value heads: the ranks that hold the same one (collective over the group)
    replicas_comm = comm.split(r // kv_replicas) if kv_replicas > 1 else None

    def cut(name: str, param: Parameter, split: WeightSplit) -> Parameter:
        tp.splits[name] = split
        return Parameter(backend.asarray(split.shard(backend.to_host(param.data), r, t), dtype=param.dtype))

    def whole_in_sequence_shards(param: Parameter) -> None:
        if sequence_parallel:  # each rank saw only its sequence shard: sum the group's gradients
            param.register_hook(_summed_over(comm))

    vocab = WeightSplit(0, length=c.vocab_size)
    wte = cut("wte.weight", model.wte.weight, vocab)
    model.wte = VocabParallelEmbedding(wte, tp.vocab_start, comm, sequence_parallel)
    if model.wpe is not None:  # Llama has none: its blocks rotate by position
        whole_in_sequence_shards(model.wpe.weight)
    if sequence_parallel:
        model.sequence_shard = (r, t)
        model.drop.shard = (1, r, t)
    for i, block in enumerate(model.blocks):
        prefix = f"blocks.{i}"
        if c.arch == "llama":
            _shard_llama_block(block, prefix, cut, whole_in_sequence_shards, comm, sequence_parallel, replicas_comm)
            continue
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear(cut(f"{prefix}.attn.qkv.weight", attn.qkv.weight, WeightSplit(0, parts=3)),
                                        cut(f"{prefix}.attn.qkv.bias", attn.qkv.bias, WeightSplit(0, parts=3)),
                                        comm, sequence_parallel)
        attn.proj = RowParallelLinear(cut(f"{prefix}.attn.proj.weight", attn.proj.weight, WeightSplit(1)),
                                      attn.proj.bias, comm, sequence_parallel)
        attn.n_head = c.n_head // t
        attn.attn_dropout.shard = (1, r, t)  # (B, H/t, T, T): this rank's heads of the whole mask
        fc, proj = mlp.layers
        setattr(mlp.layers, "0", ColumnParallelLinear(cut(f"{prefix}.mlp.layers.0.weight", fc.weight, WeightSplit(0)),
                                                      cut(f"{prefix}.mlp.layers.0.bias", fc.bias, WeightSplit(0)),
                                                      comm, sequence_parallel))
        setattr(mlp.layers, "1", RowParallelLinear(cut(f"{prefix}.mlp.layers.1.weight", proj.weight, WeightSplit(1)),
                                                   proj.bias, comm, sequence_parallel))
        for param in (block.ln1.weight, block.ln1.bias, block.ln2.weight, block.ln2.bias, attn.proj.bias, proj.bias):
            whole_in_sequence_shards(param)
        if sequence_parallel:
            attn.resid_dropout.shard = block.dropout.shard = (1, r, t)  # (B, T/t, C)
    for param in model.ln_f.parameters():  # LayerNorm's weight and bias, or RMSNorm's weight
        whole_in_sequence_shards(param)
    if not c.tie_weights:
        model.lm_head = ColumnParallelLinear(cut("lm_head.weight", model.lm_head.weight, vocab), None, comm,
                                             sequence_parallel)
    model.tensor_parallel = tp
    return tp


def _shard_llama_block(block, prefix: str, cut, whole_in_sequence_shards, comm, sequence_parallel: bool,
                       replicas_comm=None) -> None:
    """Llama's block on rank r of t: query heads [r·H/t, (r+1)·H/t) and key/value heads
    [r·Hkv/t, (r+1)·Hkv/t) -- the key/value heads of exactly those query groups, since query head
    j·G + i uses key/value head j -- when t divides Hkv (Megatron-LM's rule). wq, wk, wv are
    column-parallel (rows of those heads) behind one f (f̄), wo row-parallel; SwiGLU's w1 and w3
    column-parallel (rows [r·F/t, (r+1)·F/t)) behind one f (f̄), w2 row-parallel; the RMSNorms whole.
    None of them has a bias. Rotary positions need nothing: the projections' outputs hold whole
    sequences (f̄ gathers them), so positions are the sequence's 0 … T−1 (with context parallelism,
    the global positions of the rank's tokens: context_parallel/gpt.py).

    Fewer key/value heads than ranks (Hkv divides t, R = t/Hkv replicas): rank r's H/t query heads
    all lie in group j = ⌊r/R⌋ (G = H/Hkv is R·H/t), so it keeps key/value head j whole, as do the
    other R − 1 ranks of its replicas group (`replicas_comm`). Each computes j's keys and values
    for its own query heads only, so the gradient of W_k,j and W_v,j is the sum of the R replicas'
    (∂L/∂W_k,j = Σ_(query heads i of j) ∂L_i/∂W_k,j): a hook all-reduces it over the replicas in every
    backward. The input gradient needs nothing new: f's all-reduce over the group already sums each
    rank's dK_r W_k,j, whose sum over the replicas is dK_j W_k,j."""
    t, r = comm.size, comm.rank
    attn, mlp = block.attn, block.mlp
    rows = WeightSplit(0)  # heads, or SwiGLU's hidden units, are contiguous rows
    replicas = 1 if replicas_comm is None else replicas_comm.size
    kv_rows = WeightSplit(0, replicas=replicas)
    for name in ("wq", "wk", "wv"):
        linear = getattr(attn, name)
        linear.weight = cut(f"{prefix}.attn.{name}.weight", linear.weight, rows if name == "wq" else kv_rows)
        if name != "wq" and replicas > 1:
            linear.weight.register_hook(_summed_over(replicas_comm))
    attn.input_runner = shared_input_column_parallel(comm, sequence_parallel)
    attn.wo = RowParallelLinear(cut(f"{prefix}.attn.wo.weight", attn.wo.weight, WeightSplit(1)), None, comm,
                                sequence_parallel)
    if replicas == 1:
        attn.n_head, attn.kv_heads = attn.n_head // t, attn.kv_heads // t
        attn.attn_dropout.shard = (1, r, t)  # (B, Hkv/t, G, T, T): this rank's key/value heads of the whole mask
    else:  # (B, 1, H/t, T, T): key/value head ⌊r/R⌋ of Hkv, and block r mod R of its G query heads
        attn.n_head, attn.kv_heads = attn.n_head // t, 1
        attn.attn_dropout.shard = ((1, r // replicas, t // replicas), (2, r % replicas, replicas))
    for name in ("w1", "w3"):
        getattr(mlp, name).weight = cut(f"{prefix}.mlp.{name}.weight", getattr(mlp, name).weight, rows)
    mlp.input_runner = shared_input_column_parallel(comm, sequence_parallel)
    mlp.w2 = RowParallelLinear(cut(f"{prefix}.mlp.w2.weight", mlp.w2.weight, WeightSplit(1)), None, comm,
                               sequence_parallel)
    for param in (block.ln1.weight, block.ln2.weight):
        whole_in_sequence_shards(param)
    if sequence_parallel:
        attn.resid_dropout.shard = block.dropout.shard = (1, r, t)  # (B, T/t, C)


def _summed_over(comm):
    """A gradient hook: the gradient summed over the group. A bfloat16 gradient (MPI has no bfloat16
    datatype) is summed in float32 and rounded back to bfloat16 once."""
    def hook(grad):
        if grad.dtype.name == "bfloat16":
            summed = grad.astype("float32")
            comm.allreduce(summed)
            return summed.astype(grad.dtype)
        summed = grad.copy()
        comm.allreduce(summed)
        return summed
    return hook


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


__all__ = ["WeightSplit", "TensorParallelGPT", "shard_gpt", "padded", "check_options"]
