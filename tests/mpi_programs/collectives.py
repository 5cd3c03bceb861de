"""Every check of the communication layer for one world size, in one launch.

    mpiexec -n 4 python tests/mpi_programs/collectives.py                    # the full suite
    mpiexec -n 3 python tests/mpi_programs/collectives.py --cases cases.json # drawn cases only
    python tests/mpi_programs/collectives.py                                 # one process, no MPI
    mpiexec -n 2 python tests/mpi_programs/collectives.py --device           # on CuPy arrays

Rank 0 prints one JSON line, last: {"world_size", "checks", "failures", "mpi4py_imported",
"thread_budget", ...}. A check never raises: it records a failure message (prefixed with the rank)
and the program carries on, so one launch reports everything that is wrong.

With --device every buffer handed to the communicator is a CuPy array (tests/test_cupy_standin.py
runs it on the CPU stand-in for CuPy): staged through host memory, or handed to MPI directly when
it is CUDA-aware (parallel/staging.py); the values and the byte counts must not change.

Expected values are computed on every rank from every rank's data (all drawn from one seed):
  * values: NumPy's sum over ranks (tolerance for random floats, exact for integer-valued data);
    in ring mode, also bit for bit the ring's documented order (ring.py: block b summed from rank
    b+1 around to b);
  * bytes: the ring formulas, written here independently with numpy.array_split, and their sum
    over ranks, (N-1)*L per phase;
  * all-to-all: a matrix counts[i, j] of the elements rank i sends rank j, drawn from the seed
    (zeros, and at N > 1 one rank that neither sends nor receives); received blocks exactly, bytes
    as the sum of row r off the diagonal, and the summed bytes as the matrix off its diagonal.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pickle
import sys

import numpy as np

from refimpl import backend
from refimpl.parallel import comm as commlib
from refimpl.parallel.mesh import Mesh
from refimpl.tools.runtime import guards, threads

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)

TOLERANCE = {"float64": (1e-10, 1e-12), "float32": (1e-5, 1e-6), "float16": (1e-2, 1e-2)}
REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}
DEVICE = False  # --device: buffers on the CuPy backend
device_buffers = 0  # how many dev() made


def dev(array: np.ndarray):
    """A buffer for the communicator: `array` itself, or a device copy of it under --device."""
    global device_buffers
    if not DEVICE:
        return array
    device_buffers += 1
    return backend.asarray(array)


def host(array) -> np.ndarray:
    """A received buffer as a NumPy array, to compare with what is expected."""
    return backend.to_host(array)


class Checker:
    def __init__(self, rank: int):
        self.rank, self.count, self.failures = rank, 0, []

    def __call__(self, ok, message: str) -> bool:
        self.count += 1
        if not ok:
            self.failures.append(f"[rank {self.rank}] {message}")
        return bool(ok)

    def raises(self, fn, error, fragment: str, what: str) -> None:
        try:
            fn()
        except error as exc:
            self(fragment in str(exc), f"{what}: message {str(exc)!r} lacks {fragment!r}")
        except Exception as exc:  # noqa: BLE001 - recorded, not raised
            self(False, f"{what}: raised {type(exc).__name__}: {exc}, expected {error.__name__}")
        else:
            self(False, f"{what}: did not raise {error.__name__}")


# -- data and expectations ---------------------------------------------------------------------------


def contributions(seed: int, n: int, length: int, dtype: str, integer: bool) -> np.ndarray:
    """Every rank's input, shape (n, length): row r is rank r's."""
    rng = np.random.default_rng(seed)
    data = rng.integers(-8, 9, size=(n, length)) if integer else rng.standard_normal((n, length))
    return data.astype(dtype)


def blocks(length: int, n: int) -> list[slice]:
    """Block b of a buffer of `length` elements, as numpy.array_split cuts it."""
    edges = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(length), n)])
    return [slice(int(edges[b]), int(edges[b + 1])) for b in range(n)]


def ring_order(x: np.ndarray, op: str) -> np.ndarray:
    """What the ring computes, in its order: block b folded over ranks b+1, b+2, ..., b."""
    n, length = x.shape
    out = np.empty(length, dtype=x.dtype)
    for b, cut in enumerate(blocks(length, n)):
        acc = x[(b + 1) % n, cut].copy()
        for k in range(2, n + 1):
            REDUCE[op](acc, x[(b + k) % n, cut], out=acc)
        out[cut] = acc
    return out


def formula_bytes(kind: str, length: int, n: int, rank: int, itemsize: int, root: int = 0) -> int:
    sizes = [s.stop - s.start for s in blocks(length, n)]
    if n == 1:
        return 0
    rs, ag = length - sizes[rank], length - sizes[(rank + 1) % n]
    elements = {"reduce_scatter": rs, "allgather": ag, "allreduce": rs + ag,
                "bcast": 0 if rank == (root - 1) % n else length}[kind]
    return elements * itemsize


def alltoall_counts(seed: int, n: int, most: int, equal: bool) -> np.ndarray:
    """counts[i, j]: elements rank i sends rank j, (n, n) int64: all `most` (equal blocks), or drawn
    in 0..most with extra zeros and one rank (at n > 1) that neither sends nor receives."""
    if equal:
        return np.full((n, n), most, dtype=np.int64)
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, most + 1, size=(n, n))
    counts[rng.random((n, n)) < 0.25] = 0
    if n > 1:
        empty = int(rng.integers(n))
        counts[empty, :] = counts[:, empty] = 0
    return counts.astype(np.int64)


def alltoall_received(sends: list, counts: np.ndarray, r: int) -> np.ndarray:
    """What rank r receives: block r of every rank's sendbuf, in rank order."""
    parts = []
    for i, send in enumerate(sends):
        start = int(counts[i, :r].sum())
        parts.append(send[start : start + int(counts[i, r])])
    return np.concatenate(parts)


def close(got, want, dtype, exact):
    if exact:
        return np.array_equal(got, want)
    rtol, atol = TOLERANCE[dtype]
    return np.allclose(got, want, rtol=rtol, atol=atol)


# -- one collective call, checked ----------------------------------------------------------------------


def run_case(chk: Checker, world, case: dict) -> None:
    """case: kind, length, dtype, integer, op, root, mode ("mpi" | "ring"), style, seed."""
    comm = world.with_collectives(case["mode"])
    n, r = comm.size, comm.rank
    kind, length, dtype, op, root, style = (case[k] for k in ("kind", "length", "dtype", "op", "root", "style"))
    x = contributions(case["seed"], n, length, dtype, case["integer"])  # (n, L)
    cuts = blocks(length, n)
    exact = case["integer"] or op != "sum"
    label = json.dumps(case, sort_keys=True)

    def finish(request):
        if style == "poll":
            while not request.test():
                pass
            return request.result
        return request.wait()

    if kind in ("alltoall", "alltoallv"):
        return run_alltoall_case(chk, comm, case, label, finish)
    before = comm.counters.snapshot()
    if kind == "allreduce":
        buf = dev(x[r].copy())
        out = comm.allreduce(buf, op) if style == "blocking" else finish(comm.iallreduce(buf, op))
        chk(out is buf, f"{label}: allreduce did not return its buffer")
        got = host(buf)
        want = REDUCE[op].reduce(x, axis=0)
        if case["mode"] == "ring" and not exact:
            chk(np.array_equal(got, ring_order(x, op)), f"{label}: ring allreduce differs from its documented order")
    elif kind == "reduce_scatter":
        send = dev(x[r].copy())
        got = comm.reduce_scatter(send, op=op) if style == "blocking" else finish(comm.ireduce_scatter(send, op=op))
        chk(type(got) is type(send), f"{label}: reduce_scatter returned a {type(got).__name__}")
        got = host(got)
        want = REDUCE[op].reduce(x, axis=0)[cuts[r]]
        chk(np.array_equal(host(send), x[r]), f"{label}: reduce_scatter modified sendbuf")
        if case["mode"] == "ring" and not exact:
            chk(np.array_equal(got, ring_order(x, op)[cuts[r]]), f"{label}: ring reduce_scatter order")
    elif kind == "allgather":
        recv = dev(np.full(length, np.nan if dtype.startswith("float") else 0, dtype=dtype))
        mine = dev(x[r, cuts[r]].copy())
        out = comm.allgather(mine, recv) if style == "blocking" else finish(comm.iallgather(mine, recv))
        chk(out is recv, f"{label}: allgather did not return its recvbuf")
        got = host(recv)
        want = np.concatenate([x[b, cuts[b]] for b in range(n)]) if length else x[0, :0]
        exact = True
    else:  # bcast
        buf = dev(x[r].copy())
        got = host(comm.bcast(buf, root) if style == "blocking" else finish(comm.ibcast(buf, root)))
        want, exact = x[root], True
    chk(got.shape == want.shape and close(got, want, dtype, exact), f"{label}: wrong values")

    delta = comm.counters.since(before)
    expect = formula_bytes(kind, length, n, r, np.dtype(dtype).itemsize, root)
    chk(delta == {kind: {"calls": 1, "bytes": expect}}, f"{label}: counted {delta}, formula {expect} bytes")


def run_alltoall_case(chk: Checker, comm, case: dict, label: str, finish) -> None:
    """alltoall: blocks of `length` elements; alltoallv: counts drawn in 0..length (alltoall_counts)."""
    n, r = comm.size, comm.rank
    kind, dtype, style = case["kind"], case["dtype"], case["style"]
    counts = alltoall_counts(case["seed"], n, case["length"], equal=kind == "alltoall")  # (n, n)
    sends = [contributions(case["seed"] + 1 + i, 1, int(counts[i].sum()), dtype, case["integer"])[0]
             for i in range(n)]  # every rank's sendbuf
    send = dev(sends[r].copy())
    recv = dev(np.full(int(counts[:, r].sum()), np.nan if dtype.startswith("float") else -1, dtype=dtype))
    before = comm.counters.snapshot()
    if kind == "alltoall":
        out = comm.alltoall(send, recv) if style == "blocking" else finish(comm.ialltoall(send, recv))
    else:  # sendcounts a list, recvcounts an array: both are accepted
        sendcounts, recvcounts = counts[r].tolist(), counts[:, r].copy()
        out = (comm.alltoallv(send, sendcounts, recv, recvcounts) if style == "blocking"
               else finish(comm.ialltoallv(send, sendcounts, recv, recvcounts)))
    chk(out is recv, f"{label}: {kind} did not return its recvbuf")
    want = alltoall_received(sends, counts, r)
    chk(np.array_equal(host(recv), want), f"{label}: wrong blocks received")
    chk(np.array_equal(host(send), sends[r]), f"{label}: {kind} modified sendbuf")
    delta = comm.counters.since(before)
    expect = sum(int(counts[r, j]) for j in range(n) if j != r) * np.dtype(dtype).itemsize  # own block not sent
    chk(delta == {kind: {"calls": 1, "bytes": expect}}, f"{label}: counted {delta}, formula {expect} bytes")


def default_cases(n: int) -> list[dict]:
    """Lengths around N (empty blocks, remainders), a few dtypes, all roots, three waiting styles."""
    lengths = sorted({0, 1, max(n - 1, 0), n, n + 1, 2 * n + 3, 1000, 4099})
    variants = [("float64", False, "sum"), ("float64", True, "sum"), ("float32", False, "sum"),
                ("float16", True, "sum"), ("int64", True, "sum"), ("float64", False, "max"),
                ("float32", False, "min")]
    styles = itertools.cycle(["blocking", "wait", "poll"])
    cases = []
    for mode, kind in itertools.product(["mpi", "ring"], ["allreduce", "reduce_scatter", "allgather", "bcast"]):
        for i, (length, (dtype, integer, op)) in enumerate(itertools.product(lengths, variants)):
            if kind in ("allgather", "bcast") and op != "sum":
                continue  # no reduction: one op is enough
            root = i % n
            cases.append(dict(kind=kind, length=length, dtype=dtype, integer=integer, op=op, root=root,
                              mode=mode, style=next(styles), seed=1000 * i + n))
    # all-to-all: `length` is the block length (alltoall) or the largest count (alltoallv)
    moved = [("float64", False), ("float32", False), ("float16", True), ("int64", True), ("int32", True)]
    for mode, kind in itertools.product(["mpi", "ring"], ["alltoall", "alltoallv"]):
        for i, (length, (dtype, integer)) in enumerate(itertools.product([0, 1, 3, 300], moved)):
            cases.append(dict(kind=kind, length=length, dtype=dtype, integer=integer, op="sum", root=0,
                              mode=mode, style=next(styles), seed=7000 * i + n))
    return cases


# -- everything else -------------------------------------------------------------------------------------


def check_totals(chk, world) -> None:
    """Summed over ranks, each ring phase sends (N-1) * L elements, whatever L is."""
    n, r = world.size, world.rank
    for mode, length in itertools.product(["mpi", "ring"], [0, 1, n + 1, 1001]):
        comm = world.with_collectives(mode)
        before = comm.counters.snapshot()
        comm.allreduce(dev(np.ones(length)))
        comm.reduce_scatter(dev(np.ones(length)))
        comm.allgather(None, dev(np.ones(length)))
        comm.bcast(dev(np.ones(length)), root=n - 1)
        mine = comm.counters.since(before)
        everyone = world.allgather_object(mine)
        for kind, phases in [("allreduce", 2), ("reduce_scatter", 1), ("allgather", 1), ("bcast", 1)]:
            total = sum(d.get(kind, {"bytes": 0})["bytes"] for d in everyone)
            chk(total == phases * (n - 1) * length * 8, f"{mode} {kind} L={length}: ranks sent {total} bytes in all")
        # all-to-all: every element of every sendbuf but the diagonal blocks (int32: 4 bytes each)
        counts = alltoall_counts(length, n, max(length, 1), equal=False)
        before = comm.counters.snapshot()
        comm.alltoallv(dev(np.ones(int(counts[r].sum()), np.int32)), counts[r],
                       dev(np.zeros(int(counts[:, r].sum()), np.int32)), counts[:, r])
        comm.alltoall(dev(np.ones(n * length, np.int32)))
        everyone = world.allgather_object(comm.counters.since(before))
        for kind, want in [("alltoallv", counts.sum() - np.trace(counts)), ("alltoall", (n - 1) * length * n)]:
            total = sum(d.get(kind, {"bytes": 0})["bytes"] for d in everyone)
            chk(total == want * 4, f"{mode} {kind} L={length}: ranks sent {total} bytes in all, not {want * 4}")


def check_shapes_and_in_place(chk, world) -> None:
    n, r = world.size, world.rank
    for mode in ["mpi", "ring"]:
        comm = world.with_collectives(mode)
        grid = dev(np.arange(15.0).reshape(3, 5) * (r + 1))  # (3, 5): any shape, seen as flat
        out = comm.allreduce(grid)
        chk(out is grid and np.array_equal(host(grid), np.arange(15.0).reshape(3, 5) * n * (n + 1) / 2),
            f"{mode}: 2-D allreduce")
        shard = dev(np.full(3, float(r)))  # equal blocks, recvbuf allocated: (3N,)
        full = comm.allgather(shard)
        chk(type(full) is type(shard) and np.array_equal(host(full), np.repeat(np.arange(n, dtype=float), 3)),
            f"{mode}: allgather with recvbuf=None")
        flat = dev(np.zeros(2 * n + 1))  # in place: our block already there
        cut = blocks(flat.size, n)[r]
        flat[cut] = r + 1
        comm.allgather(None, flat)
        want = np.concatenate([np.full(c.stop - c.start, b + 1.0) for b, c in enumerate(blocks(flat.size, n))])
        chk(np.array_equal(host(flat), want), f"{mode}: in-place allgather")
        chk(comm.allreduce_value(r + 1.0) == n * (n + 1) / 2, f"{mode}: allreduce_value")
        chk(comm.allreduce_value(float(r), op="max") == n - 1, f"{mode}: allreduce_value max")


def check_many_in_flight(chk, world) -> None:
    """Several non-blocking collectives at once, progressed in a different order on each rank."""
    n, r = world.size, world.rank
    for mode in ["mpi", "ring"]:
        comm = world.with_collectives(mode)
        buffers = [dev(np.full(1000 + 7 * k, float(r + k))) for k in range(3)]
        requests = [comm.iallreduce(b) for b in buffers]
        shard = comm.ireduce_scatter(dev(np.arange(50.0) * (r + 1)))
        gathered = comm.iallgather(dev(np.full(2, float(r))))
        cast = comm.ibcast(dev(np.full(9, float(r))), root=n - 1)
        exchanged = comm.ialltoall(dev(np.arange(n * 3.0) + 100 * r))  # (3N,): block j, 3 elements, to rank j
        counts = np.add.outer(np.arange(n), 2 * np.arange(n))  # rank i sends i + 2j elements to rank j
        scattered = comm.ialltoallv(dev(np.full(int(counts[r].sum()), float(r))), counts[r],
                                    dev(np.zeros(int(counts[:, r].sum()))), counts[:, r])
        everything = requests + [shard, gathered, cast, exchanged, scattered]
        order = everything if r % 2 == 0 else everything[::-1]
        while not commlib.test_all(order):
            pass
        for k, b in enumerate(buffers):
            chk(np.array_equal(host(b), np.full(b.size, n * k + n * (n - 1) / 2)), f"{mode}: in-flight allreduce {k}")
        total = np.arange(50.0) * n * (n + 1) / 2
        chk(np.array_equal(host(shard.result), total[blocks(50, n)[r]]), f"{mode}: in-flight reduce_scatter")
        chk(np.array_equal(host(gathered.result), np.repeat(np.arange(n, dtype=float), 2)),
            f"{mode}: in-flight allgather")
        chk(np.array_equal(host(cast.result), np.full(9, n - 1.0)), f"{mode}: in-flight bcast")
        chk(np.array_equal(host(exchanged.result), np.concatenate([np.arange(3.0 * r, 3.0 * r + 3) + 100 * i
                                                                   for i in range(n)])), f"{mode}: in-flight alltoall")
        chk(np.array_equal(host(scattered.result), np.repeat(np.arange(n, dtype=float), counts[:, r])),
            f"{mode}: in-flight alltoallv")


def check_expert_exchange(chk, world) -> None:
    """Mixture-of-experts dispatch and combine: counts first (alltoall, one int64 per rank), then
    token rows (alltoallv, counts in elements), and back again; the round trip gives every token back."""
    n, r = world.size, world.rank
    hidden = 5

    def draw(i):  # rank i's tokens (T_i, hidden) and the rank holding each one's expert (T_i,), grouped
        rng = np.random.default_rng(17 + i)
        tokens = int(rng.integers(0, 12)) if i != n - 1 else 0  # the last rank has no tokens
        owner = np.sort(rng.integers(0, n, tokens))
        return np.arange(tokens * hidden, dtype=np.float32).reshape(tokens, hidden) + 1000 * i, owner

    rows, owner = draw(r)
    for mode in ["mpi", "ring"]:
        comm = world.with_collectives(mode)
        send_rows = np.bincount(owner, minlength=n).astype(np.int64)  # (N,) tokens for each rank
        recv_rows = host(comm.alltoall(dev(send_rows)))  # (N,) tokens from each rank
        want_rows = [int(np.sum(draw(i)[1] == r)) for i in range(n)]
        chk(recv_rows.tolist() == want_rows, f"{mode}: expert counts exchanged: {recv_rows.tolist()}, not {want_rows}")
        arrived = dev(np.zeros((int(recv_rows.sum()), hidden), np.float32))  # (T_in, hidden)
        request = comm.ialltoallv(dev(rows), send_rows * hidden, arrived, dev(recv_rows * hidden))  # device counts
        while not request.test():
            pass
        want = np.concatenate([draw(i)[0][draw(i)[1] == r] for i in range(n)])
        chk(np.array_equal(host(arrived), want), f"{mode}: tokens dispatched to their experts' ranks")
        back = dev(np.zeros_like(rows))
        comm.alltoallv(arrived, recv_rows * hidden, back, send_rows * hidden)  # combine: the reverse exchange
        chk(np.array_equal(host(back), rows), f"{mode}: tokens combined back")


def check_point_to_point(chk, world) -> None:
    n, r = world.size, world.rank
    right, left = (r + 1) % n, (r - 1) % n
    before = world.counters.snapshot()
    got = world.sendrecv(dev(np.full(4, float(r))), right, dev(np.zeros(4)), left, sendtag=3)
    chk(np.array_equal(host(got), np.full(4, float(left))), "sendrecv shift")
    inbox = dev(np.zeros(6))
    receive = world.irecv(inbox, left, tag=9)
    send = world.isend(dev(np.arange(6.0) + r), right, tag=9)
    commlib.wait_all([send, receive])
    chk(np.array_equal(host(inbox), np.arange(6.0) + left), "isend/irecv shift")
    if n > 1:  # blocking send/recv in pairs: even ranks send first
        partner = r ^ 1
        if partner < n:
            box = dev(np.zeros(3, dtype=np.float32))
            if r % 2 == 0:
                world.send(dev(np.full(3, r, dtype=np.float32)), partner, tag=1)
                world.recv(box, partner, tag=1)
            else:
                world.recv(box, partner, tag=1)
                world.send(dev(np.full(3, r, dtype=np.float32)), partner, tag=1)
            chk(np.array_equal(host(box), np.full(3, partner, dtype=np.float32)), "send/recv pair")
    else:  # one process: a message to oneself (a blocking send to oneself may wait forever, as MPI_Send)
        box = dev(np.zeros(3, dtype=np.float32))
        request = world.isend(dev(np.ones(3, dtype=np.float32)), 0, tag=1)
        world.recv(box, 0, tag=1)
        request.wait()
        chk(np.array_equal(host(box), np.ones(3)), "isend/recv to self")
    paired = n == 1 or (r ^ 1) < n
    delta = world.counters.since(before)
    want = {"sendrecv": {"calls": 1, "bytes": 32}, "send": {"calls": 1 + paired, "bytes": 48 + 12 * paired},
            "recv": {"calls": 1 + paired, "bytes": 0}}
    chk(delta == want, f"point-to-point counted {delta}, expected {want}")


def check_split_and_mesh(chk, world) -> None:
    n, r = world.size, world.rank
    before_world = world.counters.snapshot()
    half = world.split(color=r % 2)
    members = [k for k in range(n) if k % 2 == r % 2]
    chk(half.size == len(members) and half.rank == members.index(r), "split: size and rank")
    buf = dev(np.full(10, float(r)))
    half.allreduce(buf)
    chk(np.array_equal(host(buf), np.full(10, float(sum(members)))), "split: allreduce within the half")
    sub_bytes = half.counters.bytes("allreduce")
    chk(sub_bytes == formula_bytes("allreduce", 10, half.size, half.rank, 8), "split: its own counters")
    chk(world.counters.since(before_world).get("allreduce", {}).get("bytes") == sub_bytes,
        "split: counted into the world's counters too")
    only_zero = world.split(color=0 if r == 0 else None)
    chk((only_zero is not None) == (r == 0), "split: color None gives None")

    # The mesh in Megatron-LM's order, rank = (p * dp + d) * tp + t, for every dp x pp x tp = n
    shapes = [(dp, pp, n // (dp * pp)) for dp in range(1, n + 1) for pp in range(1, n + 1) if n % (dp * pp) == 0]
    for dp, pp, tp in shapes:
        name = f"mesh dp={dp} x pp={pp} x tp={tp}"
        mesh = Mesh(world, dp=dp, pp=pp, tp=tp)
        t, d, p = r % tp, r // tp % dp, r // (tp * dp)
        rank = lambda d, p, t, dp=dp, tp=tp: (p * dp + d) * tp + t  # noqa: E731
        chk((mesh.dp_index, mesh.pp_index, mesh.tp_index) == (d, p, t) == mesh.coords_of(r), f"{name}: coordinates")
        chk(all(mesh.rank_of(*mesh.coords_of(k)) == k for k in range(n)), f"{name}: rank_of(coords_of(k)) == k")
        chk((mesh.dp_comm.rank, mesh.pp_comm.rank, mesh.tp_comm.rank, mesh.mp_comm.rank) == (d, p, t, p * tp + t),
            f"{name}: sub-communicator ranks")
        chk(mesh.dp_comm.allgather_object(r) == [rank(k, p, t) for k in range(dp)], f"{name}: dp group")
        chk(mesh.pp_comm.allgather_object(r) == [rank(d, k, t) for k in range(pp)], f"{name}: pp group")
        chk(mesh.tp_comm.allgather_object(r) == [rank(d, p, k) for k in range(tp)], f"{name}: tp group")
        chk(mesh.mp_comm.allgather_object(r) == [rank(d, q, k) for q in range(pp) for k in range(tp)],
            f"{name}: mp group (one replica's tp x pp ranks)")
        inferred, other = Mesh(world, pp=pp, tp=tp), Mesh(world, dp=dp, tp=tp)
        chk((inferred.dp, inferred.pp, inferred.tp, other.pp) == (dp, pp, tp, pp), f"{name}: dp and pp inferred")
    chk.raises(lambda: Mesh(world, dp=n + 1, pp=1), ValueError, f"needs {n + 1} ranks, but the world has {n}",
               "mesh too big")
    chk.raises(lambda: Mesh(world, dp=2, pp=n), ValueError, f"needs {2 * n} ranks", "mesh dp x pp != N")
    chk.raises(lambda: Mesh(world, pp=n + 1), ValueError, f"pp={n + 1} x tp=1 does not divide the world size {n}",
               "pp not dividing N")
    chk.raises(lambda: Mesh(world, tp=n + 1), ValueError,
               f"mesh: pp=1 x tp={n + 1} does not divide the world size {n}; launch a multiple of {n + 1} ranks",
               "tp not dividing N")
    chk.raises(lambda: Mesh(world, dp=1, tp=n + 1), ValueError,
               f"mesh: dp=1 x tp={n + 1} does not divide the world size {n}; launch a multiple of {n + 1} ranks",
               "dp x tp not dividing N")
    chk.raises(lambda: Mesh(world, pp=1, tp=2 * n), ValueError,
               f"mesh: pp=1 x tp={2 * n} does not divide the world size {n}", "pp x tp not dividing N")
    chk.raises(lambda: Mesh(world, dp=1, pp=1, tp=n + 1), ValueError,
               f"mesh: dp=1 x tp={n + 1} x pp=1 needs {n + 1} ranks, but the world has {n}; launch mpiexec -n {n + 1}, "
               f"or choose dp x tp x pp = {n}", "dp x tp x pp != N")
    chk.raises(lambda: Mesh(world, dp=0), ValueError, "positive integer", "dp = 0")
    chk.raises(lambda: Mesh(world, tp=0), ValueError, "mesh: tp must be a positive integer, not 0", "tp = 0")


def check_bad_input(chk, world) -> None:
    n = world.size
    chk.raises(lambda: world.allreduce(np.ones((4, 4))[:, 0]), ValueError, "C-contiguous", "strided buffer")
    chk.raises(lambda: world.allreduce([1.0, 2.0]), ValueError, f"must be a {backend.xp().__name__} array", "a list")
    chk.raises(lambda: world.allreduce(np.ones(3), op="mean"), ValueError, "unknown reduction", "bad op")
    chk.raises(lambda: world.allreduce(np.array(["a"])), ValueError, "float or integer", "string dtype")
    frozen = np.ones(3)
    frozen.flags.writeable = False
    chk.raises(lambda: world.allreduce(frozen), ValueError, "read-only", "read-only buffer")
    chk.raises(lambda: world.reduce_scatter(np.ones(2 * n), np.zeros(5)), ValueError, "recvbuf has 5", "recv size")
    chk.raises(lambda: world.reduce_scatter(np.ones(2 * n), np.zeros(2, np.float32)), ValueError, "float32",
               "dtype mismatch")
    shared = np.ones(2 * n)
    chk.raises(lambda: world.reduce_scatter(shared, shared[:2]), ValueError, "overlap", "overlapping buffers")
    chk.raises(lambda: world.allgather(np.ones(5), np.zeros(2 * n)), ValueError, "sendbuf has 5", "send size")
    chk.raises(lambda: world.bcast(np.ones(2), root=n), ValueError, f"root={n}", "bad root")
    if n > 1:
        chk.raises(lambda: world.alltoall(np.ones(n + 1)), ValueError,
                   f"alltoall: sendbuf has {n + 1} elements, not a multiple of the {n} ranks", "alltoall unequal")
    ones = [1] * n
    chk.raises(lambda: world.alltoallv(np.ones(n), ones + [0], np.zeros(n), ones), ValueError,
               f"alltoallv: sendcounts must hold {n} counts, one per rank, but has shape ({n + 1},)", "counts length")
    chk.raises(lambda: world.alltoallv(np.ones(n), ones, np.zeros(n), [-1] + [1] * (n - 1)), ValueError,
               "alltoallv: recvcounts[0] = -1 is negative", "negative count")
    chk.raises(lambda: world.alltoallv(np.ones(n), [2] + [1] * (n - 1), np.zeros(n), ones), ValueError,
               f"alltoallv: sendcounts sum to {n + 1} elements, but sendbuf has {n}", "counts vs sendbuf")
    chk.raises(lambda: world.alltoallv(np.ones(n), ones, np.zeros(n), np.full(n, 1.0)), ValueError,
               "recvcounts must be integers", "float counts")
    chk.raises(lambda: world.alltoallv(np.ones(n), ones, np.zeros(n, np.float32), ones), ValueError,
               "alltoallv: sendbuf is float64 but recvbuf is float32", "alltoallv dtype mismatch")
    chk.raises(lambda: world.send(np.ones(2), dest=-1), ValueError, "dest=-1", "bad dest")
    chk.raises(lambda: world.isend(np.ones(2), dest=0, tag=10**6), ValueError, "tag=", "bad tag")
    chk.raises(lambda: commlib.get_world("tree"), ValueError, "unknown collectives", "bad collectives")


def check_objects(chk, world) -> None:
    n, r = world.size, world.rank
    before = world.counters.snapshot()
    objects = world.allgather_object({"rank": r, "pad": "x" * r})
    chk(objects == [{"rank": k, "pad": "x" * k} for k in range(n)], "allgather_object")
    sizes = [len(pickle.dumps(o)) for o in objects]
    want = 0 if n == 1 else sum(sizes) - sizes[(r + 1) % n] + 8 * (n - 1)
    chk(world.counters.since(before) == {"allgather_object": {"calls": 1, "bytes": want}}, "allgather_object bytes")
    chk(world.bcast_object(["root", r], root=n - 1) == ["root", n - 1], "bcast_object")
    snapshot = world.counters.snapshot()
    by_rank = world.counters_by_rank()
    chk(len(by_rank) == n and by_rank[r] == snapshot, "counters_by_rank")


# -- main ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", help="a JSON file holding a list of cases (run only those)")
    parser.add_argument("--device", action="store_true", help="every buffer a CuPy array (--backend cupy)")
    args = parser.parse_args()
    if args.device:
        global DEVICE
        DEVICE = True
        backend.set_backend("cupy")
    world = commlib.get_world()
    chk = Checker(world.rank)
    if args.cases:
        with open(args.cases) as f:
            cases = json.load(f)
        for case in cases:
            run_case(chk, world, case)
    else:
        cases = default_cases(world.size)
        for case in cases:
            run_case(chk, world, case)
        check_totals(chk, world)
        check_shapes_and_in_place(chk, world)
        check_many_in_flight(chk, world)
        check_expert_exchange(chk, world)
        check_point_to_point(chk, world)
        check_split_and_mesh(chk, world)
        check_bad_input(chk, world)
        check_objects(chk, world)
    failures = [f for per_rank in world.allgather_object(chk.failures) for f in per_rank]
    checks = sum(world.allgather_object(chk.count))
    budget = threads.current()
    if world.rank == 0:
        print(json.dumps({"world_size": world.size, "cases": len(cases), "checks": checks, "failures": failures[:50],
                          "failure_count": len(failures), "mpi4py_imported": "mpi4py" in sys.modules,
                          "comm": type(world).__name__, "thread_budget": budget and budget.as_dict(),
                          "device_buffers": device_buffers,
                          **world.transfer_report()}))


if __name__ == "__main__":
    main()
