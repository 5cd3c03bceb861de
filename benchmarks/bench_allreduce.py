"""All-reduce bandwidth: refimpl's Comm wrapper and its ring algorithm against raw mpi4py.

    mpiexec -n 2 python benchmarks/bench_allreduce.py [--sizes 65536 1048576 8388608] [--seconds 0.3] [--json]

For each buffer size (bytes of float64) it times, on the same buffer and interleaved round by
round (raw, wrapper, ring; then wrapper, ring, raw; ...) so that drift and noise from other processes
hit all three alike:
  * raw      MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)           (mpi4py directly)
  * wrapper  get_world("mpi").allreduce(buf)        (argument checks + counters + the same call)
  * ring     get_world("ring").allreduce(buf)       (ring.py on Isend/Irecv, 2(N-1) steps)
A round's time is the slowest rank's; each variant's time is its best (minimum) round, the
estimate least disturbed by other processes on a shared machine (the medians are in the JSON
too). Reported as ratios measured in this one run: bandwidth(wrapper) / bandwidth(raw) = t_raw / t_wrapper (target
>= 0.95 for buffers of 1 MiB and more, where the wrapper's fixed cost -- the "+us" column, best
read on the 8-byte row -- is negligible) and the same for the ring. The last stdout line is one JSON object (rank 0);
the table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from refimpl.parallel.comm import get_world

TARGET = 0.95
TARGET_FROM_BYTES = 1 << 20


def timed(fn, buf, repeats: int, barrier) -> float:
    """Seconds per call of fn(buf), over `repeats` calls, after a barrier."""
    barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn(buf)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 1 << 16, 1 << 20, 1 << 23],
                        help="buffer sizes in bytes (float64)")
    parser.add_argument("--seconds", type=float, default=0.5, help="time per variant and size (approximate)")
    parser.add_argument("--rounds", type=int, default=25, help="interleaved rounds per size")
    parser.add_argument("--json", action="store_true", help="print only the JSON line on stdout")
    args = parser.parse_args()

    world = get_world("mpi")
    ring_world = get_world("ring")
    from mpi4py import MPI  # noqa: PLC0415 - the benchmark's baseline is raw mpi4py itself

    raw_comm = MPI.COMM_WORLD
    variants = {
        "raw": lambda b: raw_comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM),
        "wrapper": world.allreduce,
        "ring": ring_world.allreduce,
    }

    def slowest(seconds: float) -> float:
        return raw_comm.allreduce(seconds, op=MPI.MAX)  # outside the timed region

    # Sanity: the three give the same sums (integer-valued, so exactly).
    for fn in variants.values():
        check = np.full(1000, float(world.rank + 1))
        fn(check)
        assert np.all(check == world.size * (world.size + 1) / 2), "wrong all-reduce result"

    results = []
    for nbytes in args.sizes:
        buf = np.zeros(max(1, nbytes // 8))  # (L,) float64; zeros stay finite however often summed
        per_call = slowest(timed(variants["raw"], buf, 3, raw_comm.Barrier) / 3)  # warm-up and calibration
        repeats = max(3, int(args.seconds / args.rounds / max(per_call, 1e-7)))
        repeats = int(raw_comm.bcast(repeats, root=0))
        samples = {name: [] for name in variants}
        names = list(variants)
        for round_ in range(args.rounds):
            for name in names[round_ % 3 :] + names[: round_ % 3]:  # rotate who goes first
                samples[name].append(slowest(timed(variants[name], buf, repeats, raw_comm.Barrier)) / repeats)
        best = {name: float(np.min(times)) for name, times in samples.items()}  # the least disturbed round
        median = {name: float(np.median(times)) for name, times in samples.items()}
        results.append({
            "bytes": buf.nbytes, "repeats": repeats * args.rounds,
            "raw_s": best["raw"], "wrapper_s": best["wrapper"], "ring_s": best["ring"],
            "raw_GBps": buf.nbytes / best["raw"] / 1e9,
            "wrapper_extra_us": (best["wrapper"] - best["raw"]) * 1e6,
            "wrapper_ratio": best["raw"] / best["wrapper"], "ring_ratio": best["raw"] / best["ring"],
            "median_wrapper_ratio": median["raw"] / median["wrapper"],
            "median_ring_ratio": median["raw"] / median["ring"],
        })

    judged = [r["wrapper_ratio"] for r in results if r["bytes"] >= TARGET_FROM_BYTES]
    summary = {
        "benchmark": "allreduce", "world_size": world.size, "results": results, "target": TARGET,
        "ok": bool(judged) and min(judged) >= TARGET,
        "thread_budget": world.thread_budget and world.thread_budget.threads,
    }
    if world.rank == 0:
        if not args.json:
            print(f"all-reduce on {world.size} ranks (best of {args.rounds} interleaved rounds)", file=sys.stderr)
            print(f"{'bytes':>10} {'raw us':>10} {'raw GB/s':>9} {'wrapper/raw':>12} {'+us':>6} {'ring/raw':>9}"
                  f" {'(medians:':>10} {'wrapper':>7} {'ring)':>6}", file=sys.stderr)
            for r in results:
                print(f"{r['bytes']:>10} {r['raw_s'] * 1e6:>10.1f} {r['raw_GBps']:>9.2f} {r['wrapper_ratio']:>12.3f} "
                      f"{r['wrapper_extra_us']:>6.1f} {r['ring_ratio']:>9.3f} {'':>10} "
                      f"{r['median_wrapper_ratio']:>7.3f} {r['median_ring_ratio']:>6.3f}", file=sys.stderr)
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
