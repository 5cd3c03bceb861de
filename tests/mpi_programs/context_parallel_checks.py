"""Context-parallel attention against one process's attention, and its accounting, in one MPI launch.

    mpiexec -n C python tests/mpi_programs/context_parallel_checks.py CONFIGS.json

CONFIGS.json: a list of {"batch", "heads", "kv_heads", "seq_len", "d_head", "impl" ("ring" or
"ulysses"), "layout" ("balanced" or "contiguous"), "causal_skip", "seed", and optionally "collectives"
("mpi" or "ring": MPI's all-to-all or ring.py's pairwise exchange, for Ulysses)}. For each, every rank
draws the same global float64 q (b, H, T, D), k, v (b, Hkv, T, D) and output gradient g from the
seed, takes its shard (layout.shard), runs the context-parallel attention forward and
backward (loss = Σ y ⊙ g), and measures, on this rank:

  * bytes sent, by comm kind, in the forward and in the backward (comm.Counters.since);
  * the saved-tensor ledger's growth over the forward (autograd/saved.py);
  * score elements computed forward and backward, and kept by the mask (blockwise.Work);
  * ring attention's forward as a sequence of events (Trace): at every step the next transfer is
    posted before the step's first chunk pair is computed;

beside accounting.py's formulas. The output and the gradients of q, k, v are gathered from every
rank, put back in global order (layout.unshard) and compared on rank 0 with one process's dense
causal attention (refimpl's autograd: causal_softmax(q kᵀ) v): worst |diff| / (1e-12 + 1e-10·|ref|).
Rank 0 prints one JSON list, one entry per configuration. The arrays live where the backend puts
them (REFIMPL_BACKEND=cupy: on the GPU, or in tests/cupy_standin's stand-in).
"""

import json
import math
import sys

import numpy as np

from refimpl import backend
from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Tensor
from refimpl.nn import functional as F
from refimpl.parallel.comm import get_world
from refimpl.parallel.context_parallel import accounting, layout
from refimpl.parallel.context_parallel import ring_attention as ring_module
from refimpl.parallel.context_parallel.blockwise import EMPTY, Work, pair_kind
from refimpl.parallel.context_parallel.ulysses import ulysses_attention
from refimpl.tools.console import emit_json
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)

RTOL, ATOL = 1e-10, 1e-12


def global_inputs(cfg: dict):
    rng = np.random.default_rng(cfg["seed"])
    b, H, Hkv, T, D = (cfg[key] for key in ("batch", "heads", "kv_heads", "seq_len", "d_head"))
    return (rng.normal(size=(b, H, T, D)), rng.normal(size=(b, Hkv, T, D)), rng.normal(size=(b, Hkv, T, D)),
            rng.normal(size=(b, H, T, D)))


def reference(q, k, v, g):
    """One process: y = causal_softmax(q kᵀ/√D) v with grouped heads; returns y, dq, dk, dv."""
    b, H, T, D = q.shape
    Hkv = k.shape[1]
    qt, kt, vt = (Tensor(backend.asarray(x), requires_grad=True) for x in (q, k, v))
    q5 = qt.reshape(b, Hkv, H // Hkv, T, D)
    k5 = kt.reshape(b, Hkv, 1, T, D).transpose(0, 1, 2, 4, 3)  # (b, Hkv, 1, D, T)
    v5 = vt.reshape(b, Hkv, 1, T, D)
    att = F.causal_softmax(q5 @ k5, np.triu(np.ones((T, T), dtype=bool), k=1), 1.0 / math.sqrt(D))
    y = (att @ v5).reshape(b, H, T, D)
    (y * Tensor(backend.asarray(g))).sum().backward()
    return [backend.to_host(x) for x in (y.data, qt.grad, kt.grad, vt.grad)]


def worst(measured, expected) -> float:
    return float(np.max(np.abs(measured - expected) / (ATOL + RTOL * np.abs(expected))))


class Trace:
    """The ring's forward as events: "R" an irecv posted, "S" an isend posted, "c" a chunk pair computed."""

    def __init__(self, world):
        self.events = []
        self.world, self.forward_block = world, ring_module.forward_block

    def __enter__(self):
        def traced(call, letter):
            def wrapper(*args, **kwargs):
                self.events.append(letter)
                return call(*args, **kwargs)
            return wrapper
        self.world.irecv, self.world.isend = traced(self.world.irecv, "R"), traced(self.world.isend, "S")
        ring_module.forward_block = traced(self.forward_block, "c")
        return self

    def __exit__(self, *exc):
        del self.world.irecv, self.world.isend  # the class's methods again
        ring_module.forward_block = self.forward_block


def expected_trace(C: int, r: int, lay: str, skip: bool) -> str:
    """Each step: the next transfer posted (receive, then send) before any of this step's chunk pairs."""
    events = ""
    for t in range(C):
        if t < C - 1:
            events += "R" * bool(ring_module.chunks_sent(C, (r - 1) % C, t, lay, skip, gradient=False))
            events += "S" * bool(ring_module.chunks_sent(C, r, t, lay, skip, gradient=False))
        queries, keys = layout.rank_chunks(C, r, lay), layout.rank_chunks(C, (r - t) % C, lay)
        events += "c" * sum(not (skip and pair_kind(i, j) == EMPTY) for i in queries for j in keys)
    return events


def run(world, cfg: dict) -> dict:
    world = world.with_collectives(cfg.get("collectives", "mpi"))
    C, r = world.size, world.rank
    q, k, v, g = global_inputs(cfg)
    lay, skip = cfg["layout"], cfg["causal_skip"]
    mine = [layout.shard(x, C, r, layout=lay) for x in (q, k, v, g)]
    qt, kt, vt = (Tensor(backend.asarray(x), requires_grad=True) for x in mine[:3])
    attention = ring_module.ring_attention if cfg["impl"] == "ring" else ulysses_attention
    work = Work()
    live, counted = saved_tensors.live_bytes, world.counters.snapshot()
    with Trace(world) as trace:
        y = attention(qt, kt, vt, world, layout=lay, causal_skip=skip, work=work)
    saved = saved_tensors.live_bytes - live
    forward, counted = world.counters.since(counted), world.counters.snapshot()
    (y * Tensor(backend.asarray(mine[3]))).sum().backward()
    backward = world.counters.since(counted)
    shape = accounting.AttentionShape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3], C, 8)
    if cfg["impl"] == "ring":
        kind, expected_bytes = "send", accounting.ring_bytes(shape, r, lay, skip)
    else:
        kind, expected_bytes = "alltoall", accounting.ulysses_bytes(shape)
    scores = accounting.score_elements(shape, r, cfg["impl"], lay, skip)
    ring = cfg["impl"] == "ring"
    mine_result = {
        "trace": "".join(trace.events) if ring else None,
        "trace_expected": expected_trace(C, r, lay, skip) if ring else None,
        "measured": {"forward_bytes": {kk: n["bytes"] for kk, n in forward.items() if n["bytes"]},
                     "backward_bytes": {kk: n["bytes"] for kk, n in backward.items() if n["bytes"]},
                     "saved_bytes": saved, "computed": work.forward_scores, "recomputed": work.backward_scores,
                     "unmasked": work.unmasked_scores},
        "expected": {"forward_bytes": {kind: expected_bytes["forward"]} if expected_bytes["forward"] else {},
                     "backward_bytes": {kind: expected_bytes["backward"]} if expected_bytes["backward"] else {},
                     "saved_bytes": accounting.saved_bytes(shape), "computed": scores["computed"],
                     "recomputed": scores["computed"], "unmasked": scores["unmasked"]},
    }
    shards = world.allgather_object([backend.to_host(x) for x in (y.data, qt.grad, kt.grad, vt.grad)])
    result = {"config": cfg, "ranks": world.allgather_object(mine_result), "backend": backend.name(),
              "on_device": world.allgather_object(all(backend.on_device(x) for x in (y.data, qt.grad, kt.grad)))}
    if r == 0:
        gathered = [layout.unshard([s[n] for s in shards], layout=lay) for n in range(4)]
        result["worst"] = {name: worst(got, want) for name, got, want in
                           zip(("y", "dq", "dk", "dv"), gathered, reference(q, k, v, g))}
        result["finite"] = bool(all(np.isfinite(x).all() for x in gathered))
    return result


def main() -> int:
    world = get_world()
    with open(sys.argv[1]) as f:
        configs = json.load(f)
    results = [run(world, cfg) for cfg in configs]
    if world.rank == 0:
        emit_json(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
