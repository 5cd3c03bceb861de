"""`python -m refimpl tensor-parallel`: tensor parallelism's formulas beside what this run measures.

    mpiexec -n 4 python -m refimpl tensor-parallel                      # t = 4: every table
    mpiexec -n 2 python -m refimpl tensor-parallel --table activations --d-model 64 --seq-len 32
    mpiexec -n 2 python -m refimpl tensor-parallel --arch llama --kv-heads 2 --ffn-size 96   # Llama's block

The whole world is one tensor-parallel group of t ranks (t = the number of processes). Tables
(refimpl/memory.py derives the activations and parameters, refimpl/parallel/tensor_parallel/communication.py
the bytes):

  activations  bytes one rank saves per transformer block in the forward pass: the formula,
               the saved-tensor ledger's measurement on every rank (its largest), and Korthikanti
               et al.'s bytes for the same s, b, h, a, t (16-bit activations, 1-byte masks; GPT-2's block);
               modes: tensor parallel, + sequence parallel, selective recomputation, and full
               recomputation (what a checkpointed block keeps: its input), with partitioned
               activations (Pa) or sequence parallelism
  bytes        bytes a rank sends on the group in one training step (the second: the first also
               builds buffers), by kind, against formulas.bytes_per_step
  parameters   parameter elements per rank (split over t, and whole on every rank), against
               memory.gpt_parameters

Every "measured" figure is exact and the same on any machine (float64); --json prints them all.
"""

from __future__ import annotations

import argparse

import numpy as np

from refimpl import backend
from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Tensor
from refimpl.checkpointing import checkpoint_sequential, selective_recomputation
from refimpl.data import SortTask
from refimpl.memory import gpt_parameters, korthikanti_bytes_per_block, saved_bytes_per_block
from refimpl.nn.batch_rows import batch_rows
from refimpl.nn.layers import check_llama_shape
from refimpl.nn.models import ARCHITECTURES, GPT, GPTConfig
from refimpl.optim import AdamW
from refimpl.parallel.comm import get_world
from refimpl.parallel.tensor_parallel import PartitionedActivations, shard_gpt
from refimpl.parallel.tensor_parallel.communication import StepShape, bytes_per_step
from refimpl.parallel.trainer import Trainer
from refimpl.tools.console import emit_json, log
from refimpl.tools.flags import add_max_work_argument, check_work, positive_int, probability

TABLES = ("activations", "bytes", "parameters")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--table", choices=TABLES, action="append", help="print only this table (repeatable)")
    p.add_argument("--n-layer", type=positive_int, default=2)
    p.add_argument("--d-model", type=positive_int, default=64)
    p.add_argument("--n-head", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=32)
    p.add_argument("--batch-size", type=positive_int, default=2, help="examples per micro-batch (b)")
    p.add_argument("--dropout", type=probability, default=0.1, help="dropout probability, in [0, 1) (default 0.1)")
    p.add_argument("--arch", choices=ARCHITECTURES, default="gpt2",
                   help="the block: gpt2 or llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention; "
                        "docs/llama.md) (default gpt2)")
    p.add_argument("--kv-heads", type=int, metavar="N", help="--arch llama: key/value heads (default --n-head)")
    p.add_argument("--ffn-size", type=int, metavar="F", help="--arch llama: the SwiGLU width (default 4 x d-model)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_max_work_argument(p, MAX_ELEMENTS, "array elements (the model's parameters and activations)")


MAX_ELEMENTS = 20_000_000  # 160 MB of float64 per model; each table builds several


def elements_estimate(n_layer: int, d_model: int, n_head: int, seq_len: int, batch_size: int) -> int:
    """The array elements of one whole model and its activations, before building it: parameters
    (12 h^2 per block, the embeddings) and the saved tensors of every block (about 34 b s h + 5 a b s^2)."""
    per_block = 12 * d_model * d_model + batch_size * seq_len * (34 * d_model + 5 * n_head * seq_len)
    return n_layer * per_block + (11 + seq_len) * d_model


def check(args) -> None:
    for name in ("n_layer", "d_model", "n_head", "seq_len", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.d_model % args.n_head:
        raise ValueError(f"--d-model {args.d_model} must be divisible by --n-head {args.n_head}")
    if args.arch != "llama" and (args.kv_heads is not None or args.ffn_size is not None):
        raise ValueError("--kv-heads and --ffn-size shape the Llama block; add --arch llama")
    if args.arch == "llama":
        check_llama_shape(args.d_model, args.n_head, args.n_head if args.kv_heads is None else args.kv_heads,
                          args.ffn_size)
    if args.n_layer < 2:
        raise ValueError("--n-layer must be at least 2 "
                         "(full recomputation keeps the inputs of all blocks but the last)")
    check_work(elements_estimate(args.n_layer, args.d_model, args.n_head, args.seq_len, args.batch_size),
               args.max_work, "array elements",
               f"the model and activations of --n-layer {args.n_layer} --d-model {args.d_model} --n-head "
               f"{args.n_head} --seq-len {args.seq_len} --batch-size {args.batch_size}")


def _block(args) -> dict:
    """The block's shape as the formulas take it: {} for GPT-2; Llama's arch, key/value width and SwiGLU width."""
    if args.arch != "llama":
        return {}
    kv_heads = args.n_head if args.kv_heads is None else args.kv_heads
    return {"arch": "llama", "kv_width": kv_heads * (args.d_model // args.n_head), "kv_heads": kv_heads,
            "ffn": 4 * args.d_model if args.ffn_size is None else args.ffn_size}


def _gpt(args):
    """The whole GPT of these flags (float64, the sorting task's vocabulary of 11)."""
    llama = {} if args.arch != "llama" else {"arch": "llama", "kv_heads": args.kv_heads, "ffn_size": args.ffn_size}
    return GPT(GPTConfig(vocab_size=11, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                         d_model=args.d_model, dropout=args.dropout, dtype="float64", **llama), seed=0)


def _model(args, world, sequence_parallel: bool):
    """The GPT cut over the world as one tensor-parallel group: (model, its TensorParallelGPT)."""
    model = _gpt(args)
    return model, shard_gpt(model, world, sequence_parallel)


def measure_activations(args, world) -> list[dict]:
    """Each mode's saved bytes per block on this rank: the ledger after a forward, against the formula."""
    t, b, T, C, H, L = world.size, args.batch_size, args.seq_len, args.d_model, args.n_head, args.n_layer
    dropout = args.dropout > 0

    def saved(sequence_parallel: bool, selective: bool = False, plan: str = "none", partition: bool = False) -> int:
        model, _ = _model(args, world, sequence_parallel)
        selective_recomputation(model.blocks, selective)
        width = T // t if sequence_parallel else T
        x = Tensor(backend.asarray(np.random.default_rng(0).standard_normal((b, width, C))), requires_grad=True)
        before = saved_tensors.live_bytes
        with batch_rows(0, b, b, 0):
            store = PartitionedActivations(world) if partition else None
            y = checkpoint_sequential(list(model.blocks), x, plan, store=store) if plan != "none" else \
                model.blocks[0](x)
            kept = saved_tensors.live_bytes - before
        del y
        return kept

    rows = []
    modes = (("tensor parallel", False, "none"), ("+ sequence parallel", True, "none"),
             ("selective recomputation", False, "selective"), ("sequence parallel + selective", True, "selective"))
    for name, sp, recompute in modes:
        selective = recompute == "selective"
        rows.append({"mode": name, "formula": saved_bytes_per_block(b, T, C, H, t, sp, dropout, recompute,
                                                                    **_block(args)),
                     "measured": saved(sp, selective),
                     "korthikanti_16bit": korthikanti_bytes_per_block(T, b, C, H, t, sp, selective)})
    one_block = {sp: saved(sp) for sp in (False, True)}
    for name, sp, partition in (("full recomputation (every:1)", False, False),
                                ("full recomputation + Pa", False, True),
                                ("full recomputation + sequence parallel", True, False)):
        if partition and t == 1:
            continue
        chain = saved(sp, plan="every:1", partition=partition)  # L − 1 kept inputs + the last block recorded
        kept = saved_bytes_per_block(b, T, C, H, t, sp, recompute="full", partitioned=partition, **_block(args))
        rows.append({"mode": name, "formula": kept, "measured": (chain - one_block[sp]) // (L - 1),
                     "korthikanti_16bit": 2 * T * b * C / (t if sp or partition else 1)})
    for row in rows:  # the largest over the group's ranks (they are equal when the formula holds)
        if args.arch != "gpt2":  # the paper's formula counts GPT-2's block
            row["korthikanti_16bit"] = None
        row["measured"] = int(max(world.allgather_object(row["measured"])))
    return rows


def measure_bytes(args, world) -> list[dict]:
    """Bytes this rank sends on the group in the second training step, against the formula."""
    rows = []
    task = SortTask(length=args.seq_len // 2)  # vocabulary 11, sequences of seq_len tokens
    x, y = task.batch(0, args.batch_size)
    for sequence_parallel in (False, True):
        trainer = Trainer(_gpt(args), lambda params: AdamW(params, lr=1e-3), world, tp=world.size,
                          sequence_parallel=sequence_parallel)
        trainer.step(x, y)
        before = trainer.mesh.tp_comm.counters.snapshot()
        trainer.step(x, y)
        spent = trainer.mesh.tp_comm.counters.since(before)
        kv_heads = args.n_head if args.kv_heads is None else args.kv_heads
        shape = StepShape(tokens=x.size, width=args.d_model, blocks=args.n_layer, micro_batches=1,
                          max_positions=task.seq_len, arch=args.arch, head_width=args.d_model // args.n_head,
                          kv_replicas=max(1, world.size // kv_heads) if args.arch == "llama" else 1)
        expected = bytes_per_step(shape, sequence_parallel, world.size, 8)
        for kind, value in expected.items():
            rows.append({"mode": "+ sequence parallel" if sequence_parallel else "tensor parallel", "kind": kind,
                         "formula": value, "measured": spent.get(kind, {}).get("bytes", 0)})
    return rows


def parameters(args, world) -> list[dict]:
    model, tp = _model(args, world, False)
    named = dict(model.named_parameters())
    measured = {"split": sum(p.size for name, p in named.items() if name in tp.splits),
                "whole": sum(p.size for name, p in named.items() if name not in tp.splits)}
    formula = gpt_parameters(11, args.seq_len, args.d_model, args.n_layer, tp=world.size, **_block(args))
    return [{"kind": kind, "formula": formula[kind], "measured": measured[kind]} for kind in ("split", "whole")]


def run(args) -> int:
    check(args)
    world = get_world()
    if world.size < 2:
        raise ValueError("tensor-parallel measures a tensor-parallel group: launch it under mpiexec -n T with T >= 2, "
                         "e.g. mpiexec -n 2 python -m refimpl tensor-parallel")
    tables = args.table or list(TABLES)
    result = {"tp": world.size}
    if "activations" in tables:
        result["activations"] = measure_activations(args, world)
    if "bytes" in tables:
        result["bytes"] = measure_bytes(args, world)
    if "parameters" in tables:
        result["parameters"] = parameters(args, world)
    if world.rank == 0:
        _print(args, result)
        if args.json:
            emit_json(result)
    ok = all(row["formula"] == row["measured"] for table in tables for row in result[table])
    return 0 if ok else 1


def _print(args, result: dict) -> None:
    t = result["tp"]
    log(f"t = {t}; one block: b = {args.batch_size}, s = T = {args.seq_len}, h = C = {args.d_model}, "
        f"a = H = {args.n_head}, dropout {args.dropout:g}, float64 (8 bytes); the vocabulary 11 padded to a multiple "
        f"of t")
    if "activations" in result:
        print("\n| saved per block, one rank | formula (bytes) | measured (ledger) | Korthikanti et al. (16-bit) |")
        print("|---|---:|---:|---:|")
        for row in result["activations"]:
            paper = "GPT-2's block only" if row["korthikanti_16bit"] is None else f"{row['korthikanti_16bit']:,.0f}"
            print(f"| {row['mode']} | {row['formula']:,} | {row['measured']:,} | {paper} |")
    if "bytes" in result:
        print("\n| sent per step, one rank | collective | formula (bytes) | measured (counters) |")
        print("|---|---|---:|---:|")
        for row in result["bytes"]:
            print(f"| {row['mode']} | {row['kind']} | {row['formula']:,} | {row['measured']:,} |")
    if "parameters" in result:
        print("\n| parameters per rank | formula (elements) | measured |")
        print("|---|---:|---:|")
        for row in result["parameters"]:
            print(f"| {row['kind']} | {row['formula']:,} | {row['measured']:,} |")
