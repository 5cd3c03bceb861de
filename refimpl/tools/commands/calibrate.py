"""`python -m refimpl calibrate`: measure this machine for the cluster model, write local-cluster.json.

    python -m refimpl calibrate                      # one process: compute rates; links estimated
    mpiexec -n 2 python -m refimpl calibrate         # and the links, measured between 2 ranks
    mpiexec -n 4 python -m refimpl calibrate --output four-ranks.json   # 4 ranks sharing the cores
    python -m refimpl predict --cluster local --dtype float32 ...       # then predict this machine

What is measured and which formula is fitted: refimpl/tools/cluster/calibrate.py's docstring. The table
lists each measured quantity and the α–β fits; the file (written by rank 0) holds a
hardware.Cluster that `--cluster FILE` (or `--cluster local` for the default file) reads.
"""

from __future__ import annotations

import argparse
import os

from refimpl.parallel.comm import get_world
from refimpl.tools.cluster import hardware
from refimpl.tools.cluster.calibrate import DEFAULT_TOKENS, DEFAULT_WIDTH, calibrate
from refimpl.tools.console import emit_json, log
from refimpl.tools.flags import add_max_work_argument, check_work, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default=hardware.LOCAL_FILE, metavar="FILE",
                   help=f"where to write the cluster file (default {hardware.LOCAL_FILE})")
    p.add_argument("--width", type=positive_int, default=DEFAULT_WIDTH,
                   help=f"h of the layers whose GEMMs are timed (default {DEFAULT_WIDTH})")
    p.add_argument("--tokens", type=positive_int, default=DEFAULT_TOKENS,
                   help=f"tokens per micro-batch of those GEMMs (default {DEFAULT_TOKENS})")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and message sizes (about a second)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_max_work_argument(p, MAX_ELEMENTS, "array elements (the timed layer's activations and weights)")


MAX_ELEMENTS = 1 << 25  # 128 MiB of float32: the timed GEMMs then take seconds, not minutes


def elements_estimate(width: int, tokens: int) -> int:
    """The elements of the timed layer (tokens x 4 width activations, 4 width^2 weights), before allocating them."""
    return 4 * tokens * width + 4 * width * width


def check(args) -> None:
    """Refuse, on every rank and before measuring, what cannot work."""
    for name in ("width", "tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be a positive integer; got {getattr(args, name)}")
    check_work(elements_estimate(args.width, args.tokens), args.max_work, "array elements",
               f"calibrating at --width {args.width} --tokens {args.tokens}")
    folder = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output):
        raise ValueError(f"--output {args.output} is a directory; give a file name, e.g. {hardware.LOCAL_FILE}")
    if not os.path.isdir(folder):
        raise ValueError(f"--output {args.output}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--output {args.output}: directory {folder} is not writable")


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} µs"


def table(cal) -> str:
    """The measurements, one per line, with how each was measured."""
    c, r = cal.cluster, cal.rates
    rows = [
        ("ranks (gpus_per_node)", str(cal.ranks), f"BLAS threads per rank: {cal.threads or 'default'}"),
        ("GEMM float32", _si(c.peak_flops_fp32, "FLOP/s"), "matmul, a linear layer's 3 products"),
        ("GEMM float64", _si(c.peak_flops_fp64, "FLOP/s"), "the same in float64"),
        ("attention core", _si(r["attention_float32"], "FLOP/s"),
         f"batched q kᵀ and p v; efficiency {c.efficiency['attention']:.2f} of GEMM"),
        ("memory bandwidth", _si(c.memory_bandwidth, "B/s"), "numpy.add, 3 n·itemsize bytes"),
        ("op overhead", _us(c.op_overhead), f"tiny Block F+B / (3 × {cal.block_operations} ops)"),
        ("memory-bound kernels", f"efficiency {c.efficiency['memory']:.3f}",
         f"a Block F+B took {cal.rates['block_seconds'] * 1e3:.1f} ms: the share of numpy.add's bandwidth that makes "
         f"the model say so"),
        ("optimizer", f"efficiency {c.efficiency['optimizer']:.3f}", "AdamW on 2^20 float32 elements, 28 bytes each"),
    ]
    p = cal.p2p
    rows.append(("point-to-point α, β", f"{_us(p['alpha'])}, {_si(p['beta'], 'B/s')}",
                 "ping-pong Send/Recv, least squares" if cal.links_measured
                 else "ESTIMATED: one process, a copy through the mailbox"))
    if cal.allreduce:
        a = cal.allreduce
        rows.append(("all-reduce line", f"{_us(a['alpha'])} + n / {_si(a['beta'], 'B/s')}",
                     f"Comm.allreduce on {cal.ranks} ranks, least squares"))
        rows.append(("link α, β (stored)", f"{_us(a['ring_alpha'])}, {_si(a['ring_beta'], 'B/s')}",
                     "α = A/(2(g−1)), β = 2(g−1)/(g·S)"))
    else:
        rows.append(("link α, β (stored)", f"{_us(c.intra_latency)}, {_si(c.intra_bandwidth, 'B/s')}",
                     "not measurable with one process; run under mpiexec -n 2"))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{name:<{widths[0]}}  {value:<{widths[1]}}  {how}" for name, value, how in rows]
    return "\n".join(lines)


def run(args) -> int:
    world = get_world()
    cal = calibrate(world, quick=args.quick, width=args.width, tokens=args.tokens)
    if world.rank != 0:
        return 0
    try:
        hardware.save(cal.cluster, args.output)
    except OSError as error:
        raise ValueError(f"cannot write --output {args.output}: {error.strerror or error}") from None
    log(table(cal))
    log(f"wrote {args.output} ({cal.seconds:.1f} s of measurement); use it with --cluster {args.output}")
    if args.json:
        emit_json({**cal.as_dict(), "output": args.output})
    return 0
