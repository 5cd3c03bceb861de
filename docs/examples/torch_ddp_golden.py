"""A PyTorch GPT trained with DistributedDataParallel on a refimpl golden case, writing a results file
that `python -m refimpl golden --check` compares with the case.

Launch: python -m refimpl golden --out case --optimizer sgd --lr 0.1
        python docs/examples/torch_ddp_golden.py case results.npz [--world-size 2] [--bug unscaled-loss]
        python -m refimpl golden --check case --against results.npz

This file imports no refimpl: it reads the case with NumPy and JSON (docs/golden_cases.md), as a
project in any framework would. It builds the GPT the manifest describes in PyTorch, with the
parameter names of the case (so load_state_dict takes initial.npz as it is), in float64, and trains
it with torch.nn.parallel.DistributedDataParallel on W CPU processes (the gloo backend, started by
torch.multiprocessing) on the case's global batches: rank r takes rows [r B/W, (r+1) B/W) of each.

The one thing to get right is the loss's normalisation. The case's loss is the global batch's
cross-entropy summed over the counted targets (y != -100) and divided by their number N in the
*whole* batch, and DDP *averages* the ranks' gradients (sum / W). So each rank back-propagates

    W · Σ_{its counted targets} CE / N

and the average over ranks is the gradient of the global loss, whatever the targets' split.
--bug unscaled-loss leaves out the factor W (a rank's share of the loss, averaged: every gradient
half as large on 2 ranks, before clipping); --bug no-allreduce runs forward and backward under DDP's
no_sync() (no gradients exchanged: each rank steps with its own rows' gradient; DDP decides in
forward whether the backward will all-reduce, so no_sync() around backward alone changes nothing).
Both make the check FAIL at step 0.

Then, as the case's manifest says: clip the global gradient norm (torch.nn.utils.clip_grad_norm_,
the same formula), record the gradients, take the optimizer's step (torch.optim.SGD or AdamW with the
case's hyper-parameters), record the parameters. Rank 0 writes the results .npz: loss (S,),
grads/SSS/NAME, params/SSS/NAME and case_id.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, seq_len: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)  # weight (3C, C): rows of q, then k, then v
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("mask", torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1))

    def forward(self, x):
        B, T, C = x.shape
        H, D = self.n_head, C // self.n_head
        q, k, v = self.qkv(x).split(C, dim=-1)  # (B, T, C) each
        q, k, v = (t.reshape(B, T, H, D).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))  # (B, H, T, T)
        att = torch.softmax(scores.masked_fill(self.mask[:T, :T], float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)])

    def forward(self, x):
        return self.layers[1](F.gelu(self.layers[0](x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, seq_len: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=1e-5)
        self.attn = CausalSelfAttention(d_model, n_head, seq_len)
        self.ln2 = nn.LayerNorm(d_model, eps=1e-5)
        self.mlp = FeedForward(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-LN GPT: learned token and position embeddings, blocks, final layer norm, untied head without bias."""

    def __init__(self, vocab_size: int, seq_len: int, n_layer: int, n_head: int, d_model: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_head, seq_len) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model, eps=1e-5)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def read_case(case_dir: str):
    """(manifest, initial weights, batches) of a golden case, with NumPy and JSON only."""
    with open(os.path.join(case_dir, "manifest.json")) as f:
        manifest = json.load(f)
    with np.load(os.path.join(case_dir, "initial.npz")) as data:
        initial = {name: data[name] for name in data.files}
    with np.load(os.path.join(case_dir, "batches.npz")) as data:
        batches = {name: data[name] for name in data.files}
    return manifest, initial, batches


def make_optimizer(spec: dict, params):
    if spec["name"] == "sgd":
        return torch.optim.SGD(params, lr=spec["lr"], momentum=spec["momentum"], weight_decay=spec["weight_decay"])
    return torch.optim.AdamW(params, lr=spec["lr"], betas=tuple(spec["betas"]), eps=spec["eps"],
                             weight_decay=spec["weight_decay"])


def train(rank: int, world_size: int, port: int, case_dir: str, out: str, bug: str | None) -> None:
    """One DDP process: train on the case's batches; rank 0 writes the results file."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    manifest, initial, batches = read_case(case_dir)
    m = manifest["model"]
    if m["name"] != "gpt" or m.get("arch", "gpt2") != "gpt2" or m["tie_weights"] \
            or manifest["config"]["dtype"] != "float64":
        raise SystemExit("this example builds an untied float64 GPT; write the case with --model gpt (float64)")
    model = GPT(m["vocab_size"], m["seq_len"], m["n_layer"], m["n_head"], m["d_model"]).double()
    model.load_state_dict({name: torch.from_numpy(array) for name, array in initial.items()}, strict=False)
    names = [p["name"] for p in manifest["parameters"]]
    if sorted(names) != sorted(name for name, _ in model.named_parameters()):
        raise SystemExit("the case's parameter names are not this model's")
    ddp = DistributedDataParallel(model)  # CPU, gloo: gradients averaged over the ranks after backward
    optimizer = make_optimizer(manifest["optimizer"], model.parameters())
    max_norm = manifest["clip"]["max_norm"]
    params = dict(model.named_parameters())
    results: dict = {"case_id": np.array(manifest["case_id"])}
    losses = []
    for step in range(manifest["steps"]):
        x, y = torch.from_numpy(batches["x"][step]), torch.from_numpy(batches["y"][step])  # the global batch
        rows = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)  # this rank's share
        counted = int((y != -100).sum())  # N: the whole batch's counted targets
        # DDP decides in forward whether the next backward all-reduces: no_sync() must hold both
        with ddp.no_sync() if bug == "no-allreduce" else contextlib.nullcontext():  # the bug: nothing exchanged
            logits = ddp(x[rows])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[rows].reshape(-1), ignore_index=-100,
                                   reduction="sum") / counted  # this rank's share of the global loss
            if bug == "unscaled-loss":
                loss.backward()  # the bug: DDP's average of the shares is the global gradient / W
            else:
                (loss * world_size).backward()  # DDP averages: (1/W) Σ_r W ∇share_r = ∇ global loss
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        grads = {name: params[name].grad.detach().numpy().copy() for name in names}
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # the shares add up to the global batch's loss
        losses.append(float(global_loss))
        for name in names:
            results[f"grads/{step:03d}/{name}"] = grads[name]
            results[f"params/{step:03d}/{name}"] = params[name].detach().numpy().copy()
    results["loss"] = np.asarray(losses)
    if rank == 0:
        np.savez(out, **results)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", help="a golden case directory (python -m refimpl golden --out DIR)")
    parser.add_argument("out", help="the results file to write (.npz)")
    parser.add_argument("--world-size", type=int, default=2, help="DDP processes (default 2)")
    parser.add_argument("--bug", choices=("unscaled-loss", "no-allreduce"), help="plant a bug (the check then fails)")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    # fork on Linux: the processes inherit the imported torch instead of importing it again (CPU only)
    method = "fork" if sys.platform == "linux" else "spawn"
    mp.start_processes(train, args=(args.world_size, free_port(), args.case, args.out, args.bug),
                       nprocs=args.world_size, start_method=method)
    print(f"wrote {args.out}: {args.world_size} DDP processes (gloo, CPU)"
          + (f", planted bug {args.bug}" if args.bug else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
