"""How much of ring attention's transfer time the block computation hides, measured in sleep-cost plus
link-delay mode, beside the ring simulated step by step and the simple max-versus-sum model.

Launch:  mpiexec -n 4 python benchmarks/context_parallel_overlap.py [--block-cost 0.01
                                                                    --delays 0,1,2,3,4,6 --steps 3]

Ring attention (refimpl/parallel/context_parallel/ring_attention.py) posts step t's K/V transfer
(isend to r + 1, irecv from r − 1) before it computes step t's chunk pairs, and waits for it after
them; in the backward, each step's dK/dV travel on after that step's chunk pairs (they carry them)
and are waited for in the same wait. On one node MPI delivers a small message through shared memory
almost at once, so there would be nothing to hide. The two modes of refimpl/tools/pacing.py,
applied to the ring's messages (this script wraps the communicator's isend and irecv and the ring
module's block functions; ring_attention.py itself runs unchanged):

    sleep cost   each chunk pair (a c×c block of scores: forward_block, or backward_block's
                 recomputation and gradients) is padded by a sleep to F = --block-cost seconds,
                 so a step of n chunk pairs computes for n·F whatever the CPU (the real arithmetic
                 of the small blocks here is far below F)
    link delay   each ring message counts as delivered P after its send: the sender sends its send
                 time (seconds since its t0, the ranks leaving a barrier together) in a second,
                 8-byte message, and the receiver's wait ends no earlier than its t0 + send time + P
                 (pacing.py's pipeline-message mode). P = --delays × F

Per call (forward, then backward with loss Σ y ⊙ g) and rank: wall time, and the time blocked in
the ring's waits (exposed). Beside them, from the same F, P and the ring's message plan
(ring_attention.chunks_sent; the chunk pairs each rank computes at each step):

    simulated     every rank's steps in lockstep: a step starts when the previous one's wait ends,
                  its transfer is posted at its start (dK/dV: after its chunk pairs), and its wait
                  ends at max(its chunk pairs' end, each awaited message's send + P)
    max model     Σ over steps of max(compute, P) (a step with an incoming message), and the sum
                  Σ (compute + P) that sending without overlap would take

hidden = 1 − exposed / (P × steps that wait for a message; a step's messages travel at the same
time): the share of the delay the computation hid; not shown ("-") where ranks wait for a busier
sender even without a delay (the contiguous layout's backward), since the wait is then not all link
delay.
The table shows the mean over ranks and the median over --steps calls (after one warm-up call).
Timings vary with the machine's load (sleeps only overshoot); the simulated figures do not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from refimpl.autograd.tensor import Tensor
from refimpl.parallel import comm as comm_module
from refimpl.parallel.comm import get_world
from refimpl.parallel.context_parallel import layout as layout_module
from refimpl.parallel.context_parallel import ring_attention as ring_module
from refimpl.parallel.context_parallel.blockwise import EMPTY, pair_kind
from refimpl.tools.console import log
from refimpl.tools.context_parallel_report import global_inputs

TIME_TAG_OFFSET = 100  # the send time travels on the message's tag + 100


# ------------------------------------------------------------------------------------------------
# The ring's plan: chunk pairs per step and which messages travel (the same rules as ring_attention.py)
# ------------------------------------------------------------------------------------------------


def pairs(C: int, r: int, t: int, lay: str, skip: bool) -> int:
    """Chunk pairs rank r computes at step t (forward; backward recomputes the same)."""
    queries, keys = layout_module.rank_chunks(C, r, lay), layout_module.rank_chunks(C, (r - t) % C, lay)
    return sum(not (skip and pair_kind(i, j) == EMPTY) for i in queries for j in keys)


def kv_travels(C: int, sender: int, t: int, lay: str, skip: bool) -> bool:
    return t < C - 1 and bool(ring_module.chunks_sent(C, sender, t, lay, skip, gradient=False))


def grad_travels(C: int, sender: int, t: int, lay: str, skip: bool) -> bool:
    return t >= 1 and bool(ring_module.chunks_sent(C, sender, t, lay, skip, gradient=True))


def simulate(C: int, lay: str, skip: bool, F: float, P: float, backward: bool) -> dict:
    """The ring in lockstep: per rank the call's duration, exposed wait, messages received, steps
    that wait for a message, and the max model's Σ max(compute, P) and Σ (compute + P)."""
    start = [0.0] * C
    exposed, received, waited, overlapped, summed = [0.0] * C, [0] * C, [0] * C, [0.0] * C, [0.0] * C
    for t in range(C):
        compute_end = [start[r] + pairs(C, r, t, lay, skip) * F for r in range(C)]
        ends = []
        for r in range(C):
            left = (r - 1) % C
            arrivals = []
            if kv_travels(C, left, t, lay, skip):
                arrivals.append(start[left] + P)  # posted at the sender's step start
            if backward and grad_travels(C, left, t, lay, skip):
                arrivals.append(compute_end[left] + P)  # posted after the sender's chunk pairs
            compute = compute_end[r] - start[r]
            end = max([compute_end[r], *arrivals])
            exposed[r] += end - compute_end[r]
            received[r] += len(arrivals)
            waited[r] += bool(arrivals)
            overlapped[r] += max(compute, P) if arrivals else compute
            summed[r] += compute + P * bool(arrivals)  # a step's messages travel at the same time
            ends.append(end)
        start = ends
    return {"duration": start, "exposed": exposed, "received": received, "waited": waited, "max_model": overlapped,
            "sum_model": summed}


# ------------------------------------------------------------------------------------------------
# The modes: delayed links and padded blocks, around the unchanged ring attention
# ------------------------------------------------------------------------------------------------


class Clock:
    """This rank's t0 (set after a barrier), the phase measured, and the time blocked in waits by phase."""

    def __init__(self, delay: float):
        self.delay, self.t0, self.phase = delay, time.perf_counter(), "forward"
        self.exposed = {"forward": 0.0, "backward": 0.0}
        self.received = {"forward": 0, "backward": 0}

    def now(self) -> float:
        return time.perf_counter() - self.t0


class DelayedSend:
    """A send and the 8-byte message carrying its send time."""

    def __init__(self, clock: Clock, requests):
        self.clock, self.requests = clock, requests

    def test(self) -> bool:
        return comm_module.test_all(self.requests)

    def wait(self):
        begin = time.perf_counter()
        comm_module.wait_all(self.requests)
        self.clock.exposed[self.clock.phase] += time.perf_counter() - begin
        return self.requests[0].result


class DelayedReceive:
    """A receive that completes no earlier than its message's send time + P."""

    def __init__(self, clock: Clock, data, stamp, stamp_buffer):
        self.clock, self.data, self.stamp, self.stamp_buffer = clock, data, stamp, stamp_buffer
        self.counted = False

    def _deadline(self) -> float:
        return float(self.stamp_buffer[0]) + self.clock.delay

    def test(self) -> bool:
        arrived = comm_module.test_all([self.data, self.stamp])
        return arrived and self.clock.now() >= self._deadline()

    def wait(self):
        begin = time.perf_counter()
        comm_module.wait_all([self.data, self.stamp])
        remaining = self._deadline() - self.clock.now()
        if remaining > 0:
            time.sleep(remaining)
        self.clock.exposed[self.clock.phase] += time.perf_counter() - begin
        if not self.counted:
            self.clock.received[self.clock.phase] += 1
            self.counted = True
        return self.data.result


def delay_links(world, clock: Clock):
    """Replace world.isend and world.irecv (this instance only) by their link-delay versions."""
    isend, irecv = world.isend, world.irecv

    def delayed_isend(buf, dest, tag=0):
        stamp = np.array([clock.now()])
        return DelayedSend(clock, [isend(buf, dest, tag), isend(stamp, dest, tag + TIME_TAG_OFFSET)])

    def delayed_irecv(buf, source, tag=0):
        stamp = np.empty(1)
        return DelayedReceive(clock, irecv(buf, source, tag), irecv(stamp, source, tag + TIME_TAG_OFFSET), stamp)

    world.isend, world.irecv = delayed_isend, delayed_irecv


def pad_blocks(cost: float) -> None:
    """Each chunk pair of the ring, forward and backward, padded by a sleep to `cost` seconds."""
    def padded(call):
        def block(*args, **kwargs):
            begin = time.perf_counter()
            result = call(*args, **kwargs)
            remaining = cost - (time.perf_counter() - begin)
            if remaining > 0:
                time.sleep(remaining)
            return result
        return block
    ring_module.forward_block = padded(ring_module.forward_block)
    ring_module.backward_block = padded(ring_module.backward_block)


# ------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------


def one_call(world, clock: Clock, inputs, lay: str, skip: bool) -> dict:
    q, k, v, g = (layout_module.shard(x, world.size, world.rank, layout=lay) for x in inputs)
    qt, kt, vt = (Tensor(x, requires_grad=True) for x in (q, k, v))
    clock.exposed = {"forward": 0.0, "backward": 0.0}
    clock.received = {"forward": 0, "backward": 0}
    world.barrier()
    clock.t0 = time.perf_counter()
    clock.phase = "forward"
    y = ring_module.ring_attention(qt, kt, vt, world, layout=lay, causal_skip=skip)
    forward = clock.now()
    world.barrier()  # the backward starts together on every rank, as the simulation's does
    clock.t0 = time.perf_counter()
    clock.phase = "backward"
    (y * Tensor(g)).sum().backward()
    backward = clock.now()
    return {"forward": forward, "backward": backward, "exposed": dict(clock.exposed),
            "received": dict(clock.received)}


def measure(world, args, lay: str, skip: bool, multiple: float) -> dict:
    C, F = world.size, args.block_cost
    P = multiple * F
    clock = Clock(P)
    inputs = global_inputs({"seed": 0, "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
                            "seq_len": args.seq_len, "d_head": args.d_head})  # q, k, v and the output's gradient
    plain_isend, plain_irecv = world.isend, world.irecv
    delay_links(world, clock)
    try:
        calls = [one_call(world, clock, inputs, lay, skip) for _ in range(args.steps + 1)][1:]  # one warm-up
    finally:
        world.isend, world.irecv = plain_isend, plain_irecv
    row = {"layout": lay, "causal_skip": skip, "P_over_F": multiple, "P_s": P, "F_s": F}
    for phase in ("forward", "backward"):
        sim = simulate(C, lay, skip, F, P, phase == "backward")
        # where ranks wait for a busier sender even without a delay, the wait is not all link delay
        imbalanced = sum(simulate(C, lay, skip, F, 0.0, phase == "backward")["exposed"]) > 0
        measured = {"duration": statistics.median(call[phase] for call in calls),
                    "exposed": statistics.median(call["exposed"][phase] for call in calls),
                    "received": calls[-1]["received"][phase]}
        everyone = world.allgather_object(measured)
        received = sum(m["received"] for m in everyone)
        row[phase] = {
            "measured_s": statistics.fmean(m["duration"] for m in everyone),
            "measured_exposed_s": statistics.fmean(m["exposed"] for m in everyone),
            "simulated_s": statistics.fmean(sim["duration"]), "simulated_exposed_s": statistics.fmean(sim["exposed"]),
            "max_model_s": statistics.fmean(sim["max_model"]), "sum_model_s": statistics.fmean(sim["sum_model"]),
            "messages_received": received, "simulated_messages_received": sum(sim["received"]),
            "measured_hidden": None if imbalanced else hidden(sum(m["exposed"] for m in everyone), P,
                                                              sum(sim["waited"])),
            "simulated_hidden": None if imbalanced else hidden(sum(sim["exposed"]), P, sum(sim["waited"])),
        }
    return row


def hidden(exposed: float, P: float, messages: int) -> float | None:
    return None if not P or not messages else 1 - exposed / (P * messages)


def print_table(rows: list[dict], C: int, args) -> None:
    print(f"C = {C}; b = {args.batch}, H = {args.heads}, Hkv = {args.kv_heads}, T = {args.seq_len}, "
          f"D = {args.d_head}; every chunk pair padded to F = {args.block_cost * 1e3:g} ms; each ring message "
          f"delivered P after its send; mean over ranks (ms), median of {args.steps} calls")
    print("\n| layout | P / F | phase | measured | simulated | max model | no overlap (sum) "
          "| exposed: measured | simulated | hidden: measured | simulated |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        lay = row["layout"] + ("" if row["causal_skip"] else ", no skip")
        for phase in ("forward", "backward"):
            x = row[phase]
            shown = [f"{x[key] * 1e3:.1f}" for key in ("measured_s", "simulated_s", "max_model_s", "sum_model_s",
                                                        "measured_exposed_s", "simulated_exposed_s")]
            share = [("-" if x[key] is None else f"{x[key]:.0%}") for key in ("measured_hidden", "simulated_hidden")]
            print(f"| {lay} | {row['P_over_F']:g} | {phase} | {' | '.join(shown)} | {' | '.join(share)} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-cost", type=float, default=0.01, help="F: seconds per chunk pair (default 0.01)")
    p.add_argument("--delays", default="0,1,2,3,4,6", help="P as multiples of F, comma-separated")
    p.add_argument("--layouts", default="balanced,contiguous")
    p.add_argument("--steps", type=int, default=3, help="measured calls per configuration (after one warm-up)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=None, help="default 4C (chunks of 2 tokens)")
    p.add_argument("--d-head", type=int, default=4)
    p.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    args = p.parse_args()
    world = get_world()
    C = world.size
    if C < 2:
        print("error: the ring needs at least 2 ranks: mpiexec -n 4 python benchmarks/context_parallel_overlap.py",
              file=sys.stderr)
        return 2
    args.seq_len = args.seq_len or 4 * C
    layout_module.check_sequence(args.seq_len, C)
    pad_blocks(args.block_cost)
    rows = []
    for lay in args.layouts.split(","):
        for multiple in (float(x) for x in args.delays.split(",")):
            rows.append(measure(world, args, lay, True, multiple))
            if world.rank == 0:
                log(f"{lay}, P = {multiple:g} F: forward {rows[-1]['forward']['measured_s'] * 1e3:.1f} ms "
                    f"(simulated {rows[-1]['forward']['simulated_s'] * 1e3:.1f})")
    if world.rank == 0:
        print_table(rows, C, args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
