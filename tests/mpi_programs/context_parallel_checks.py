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

beside accounting.py's formulas (refimpl/tools/context_parallel_report.py measures them, as
`python -m refimpl context-parallel` does). The output and the gradients of q, k, v are gathered from every
rank, put back in global order (layout.unshard) and compared on rank 0 with one process's dense
causal attention (refimpl's autograd: causal_softmax(q kᵀ) v): worst |diff| / (1e-12 + 1e-10·|ref|).
Rank 0 prints one JSON list, one entry per configuration. The arrays live where the backend puts
them (REFIMPL_BACKEND=cupy: on the GPU, or in tests/cupy_standin's stand-in).
"""

import json
import sys

from refimpl import backend
from refimpl.parallel.comm import get_world
from refimpl.parallel.context_parallel import layout
from refimpl.parallel.context_parallel import ring_attention as ring_module
from refimpl.parallel.context_parallel.blockwise import EMPTY, pair_kind
from refimpl.tools import context_parallel_report as report
from refimpl.tools.console import emit_json
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)


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
    C, r, ring = world.size, world.rank, cfg["impl"] == "ring"
    trace = Trace(world)  # entered around the forward only
    figures, outputs = report.attention_call(world, cfg, forward_context=trace)
    mine = {"trace": "".join(trace.events) if ring else None,
            "trace_expected": expected_trace(C, r, cfg["layout"], cfg["causal_skip"]) if ring else None, **figures}
    result = {"config": cfg, "ranks": world.allgather_object(mine), "backend": backend.name(),
              "on_device": world.allgather_object(all(backend.on_device(x) for x in outputs[:3]))}
    compared = report.compare_with_one_process(world, cfg, outputs)
    if compared is not None:
        result.update(compared)
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
