"""The one wrapper over MPI: collectives, point-to-point messages, and what they cost.

This is the only module of refimpl that imports mpi4py, and it does so only when a program runs
under `mpiexec` (mpi4py's wheel cannot even be imported without an MPI library). Everything else
receives a `Comm` object and calls its methods:

    from refimpl.parallel.comm import get_world
    world = get_world(collectives="mpi")     # or "ring": the textbook algorithms of ring.py
    world.allreduce(grad)                     # in place, sum over ranks
    shard = world.reduce_scatter(flat)        # (count_r,) this rank's block of the sum
    world.allgather(shard, flat)              # every rank's block into flat (L,)
    world.alltoall(counts, counts_in)         # (N,) each: entry j to rank j, entry i from rank i
    world.alltoallv(tokens, counts, arrived, counts_in)  # blocks of those lengths, both ways
    request = world.iallreduce(bucket)        # non-blocking; request.test() polls, .wait() blocks
    world.counters.snapshot()                 # {"allreduce": {"calls": 1, "bytes": 4096}, ...}

Two implementations share one interface (the `Comm` base class holds every public method, the
argument checks and the counting; subclasses only move bytes):
  * MPIComm wraps an mpi4py communicator (COMM_WORLD or a split of it) and uses mpi4py's
    upper-case buffer API on contiguous arrays -- never pickled Python objects in a hot path;
  * LocalComm is a world of one process: no mpiexec, no MPI library, the same methods; collectives
    copy or do nothing, point-to-point messages to oneself go through a mailbox, and the
    counters count calls with zero bytes.

Shapes: (L,) a flat buffer of L elements; (count_r,) rank r's block of it; N = size.

Buffers. Every array must be a C-contiguous numeric array of the active backend (refimpl.backend);
collectives see it as flat, of L elements, whatever its shape. Lengths not divisible by N use
*counts*, not padding (see ring.py): block b has L // N + (b < L % N) elements, the layout of
numpy.array_split; blocks may be empty when L < N. reduce_scatter(sendbuf (L,)) returns this rank's
block (count_r,); allgather(sendbuf (count_r,), recvbuf (L,)) fills recvbuf, or sendbuf=None when
the block is already in place; with recvbuf=None the blocks are taken to be equal, L = N * count.
All-to-all is the one collective whose blocks are given by the caller: alltoallv(sendbuf (S,),
sendcounts (N,), recvbuf (R,), recvcounts (N,)) sends block j of sendbuf (sendcounts[j] elements)
to rank j and receives rank i's block for us into block i of recvbuf (recvcounts[i] elements),
blocks laid end to end (displacements = exclusive prefix sums of the counts); rank i's
sendcounts[r] must equal rank r's recvcounts[i], which MPI does not check either (exchange the
counts first, with alltoall on one int64 per rank). alltoall(sendbuf (L,), recvbuf (L,)) is the case
of equal blocks, L // N each.

Counters: the ground truth of every communication figure. Each Comm counts, per kind of call, the
calls made and the bytes *sent* by this rank; a sub-communicator's counts are also added to its
parent's, so the world's counters are the rank's totals. Rules (L elements of `itemsize` bytes,
N ranks, count_b as above; see ring.py for the derivations):

    kind             bytes sent by rank r                              = when N divides L
    allreduce        (2L - count_r - count_{r+1}) * itemsize           2(N-1)/N * L * itemsize
    reduce_scatter   (L - count_r) * itemsize                           (N-1)/N * L * itemsize
    allgather        (L - count_{r+1}) * itemsize                       (N-1)/N * L * itemsize
    bcast            L * itemsize, except 0 on rank (root - 1) mod N    (a chain along the ring)
    alltoall         (L - L/N) * itemsize: every block but its own      (N-1)/N * L * itemsize
    alltoallv        (sum_j sendcounts_j - sendcounts_r) * itemsize     (the own block is not sent)
    send, sendrecv   the message's bytes (also isend)
    recv, barrier    0 (a call only; also irecv, ibarrier)
    *_object         the pickled bytes under the same rules (sizes exchanged first, 8 bytes each)

With collectives="mpi", MPI's built-in collectives run and the counter records what the ring
algorithm (for all-to-all, ring.py's pairwise exchange) would send, by the formulas. With
collectives="ring", ring.py runs and the bytes are counted one message at a time, at the send;
tests check that both give the same numbers.
Non-blocking calls are counted when they are posted (a ring step's bytes when that step is posted).

Non-blocking calls and progress. iallreduce, ireduce_scatter, iallgather, ibcast, ialltoall,
ialltoallv, ibarrier, isend and irecv return a `Request`; `test()` makes progress and says whether it is complete,
`wait()` blocks until it is and returns the result array. MPI advances an outstanding operation
only while some MPI call runs in the process, so code that overlaps communication with computation
(DDP buckets, expert parallelism's token exchange) must call `test()` now and then. A ring
request advances one step per successful test (an all-to-all's: one pairwise exchange). As in
MPI, every rank must start collectives on a communicator in the same order, and a buffer must not
be touched until its request completes.

The world. `get_world()` returns the world communicator, created once: a LocalComm unless the
process runs under mpiexec (one of LAUNCHER_VARIABLES, e.g. PMI_RANK or
OMPI_COMM_WORLD_SIZE, in the environment; REFIMPL_MPI=1 forces MPI, 0 forbids it). Creating the
MPI world tells the installed `Guard` (below), through which the tools make a failure on any rank
end the job instead of hanging it. Launch: `mpiexec -n 4 python -m refimpl ...`.

CuPy. Arrays reach MPI only through staging.HostCopies, in MPIComm: a device array goes to MPI
directly when the MPI library is CUDA-aware, else through a host copy (copied back into the device
array when the operation completes, also for non-blocking requests); see staging.py for the rule
that detects a CUDA-aware MPI (REFIMPL_CUDA_AWARE_MPI=0/1 overrides it). The counters count the
logical buffer either way. `transfer_report()` says which route this run takes (train and verify
--json print it).
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import itertools
import os
import pickle
import sys
import time
from collections import deque

import numpy as np

from refimpl import backend
from refimpl.parallel import ring, staging
from refimpl.parallel.launched import LAUNCHER_VARIABLES, under_mpiexec

COLLECTIVES = ("mpi", "ring")
OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}
_NOT_WATCHED = contextlib.nullcontext()  # the context of a call no guard needs to know about
INIT_TIMEOUT_S = 60.0  # default of REFIMPL_INIT_TIMEOUT: how long MPI_Init may wait for the others
ABORT_GRACE_S = 0.25  # seconds between printing an abort's message and killing the job
MAX_TAG = 32767  # the largest tag every MPI library must accept


# ------------------------------------------------------------------------------------------------
# Guards: how a tool watches the communicators without this module knowing the tool
# ------------------------------------------------------------------------------------------------


class Guard:
    """What a tool may install around every communicator (the default does nothing).

    MPI has no timeouts and no error propagation: a rank that waits for a peer that died waits
    forever. The core only says *when* something happens; the tools decide what to do about it
    (refimpl/tools/runtime/guards.py installs a failure handler, a watchdog and a thread budget):

        mpi_started(MPI)                         once, right after MPI_Init, before anything can fail
        world_created(world, local_ranks)        once, when the world communicator exists
        waiting(comm, kind, peer)                a context around every blocking MPI call
        progress()                               this rank has done something (an operation completed,
                                                 a pipeline action ran)
    """

    def mpi_started(self, MPI) -> None:
        pass

    def world_created(self, world: MPIComm, local_ranks: int) -> None:
        pass

    def waiting(self, comm: Comm, kind: str, peer: int | None = None):
        return _NOT_WATCHED

    def progress(self) -> None:
        pass


_guard = Guard()


def install_guard(guard: Guard) -> None:
    """Watch every communicator with `guard` (before the world is created, to see its creation)."""
    global _guard
    _guard = guard


def progress() -> None:
    """Tell the installed guard that this rank has made progress."""
    _guard.progress()


# ------------------------------------------------------------------------------------------------
# Counters and requests
# ------------------------------------------------------------------------------------------------


class Counters:
    """Calls made and bytes sent, by kind of call, for one communicator (and its parents)."""

    def __init__(self, parent: Counters | None = None):
        self.parent = parent
        self._calls: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self.log: list | None = None  # while a list: each call's kind appended in order (verify's flag check)

    def record(self, kind: str, nbytes: int = 0, calls: int = 1) -> None:
        counters = self
        while counters is not None:  # a sub-communicator's traffic is also its parent's
            counters._calls[kind] = counters._calls.get(kind, 0) + calls
            counters._bytes[kind] = counters._bytes.get(kind, 0) + nbytes
            if calls and counters.log is not None:
                counters.log.append(kind)
            counters = counters.parent

    def calls(self, kind: str) -> int:
        return self._calls.get(kind, 0)

    def bytes(self, kind: str) -> int:
        return self._bytes.get(kind, 0)

    @property
    def total_bytes(self) -> int:
        return sum(self._bytes.values())

    def snapshot(self) -> dict:
        """{kind: {"calls": int, "bytes": int}}, a copy (plain ints, JSON-ready)."""
        return {k: {"calls": self._calls[k], "bytes": self._bytes[k]} for k in sorted(self._calls)}

    def since(self, snapshot: dict) -> dict:
        """What was counted after `snapshot` was taken, in the same form (kinds with no change left out)."""
        delta = {}
        for kind, now in self.snapshot().items():
            before = snapshot.get(kind, {"calls": 0, "bytes": 0})
            change = {key: now[key] - before[key] for key in ("calls", "bytes")}
            if change["calls"] or change["bytes"]:
                delta[kind] = change
        return delta

    def reset(self) -> None:
        """Zero this communicator's counters (its parents keep theirs)."""
        self._calls.clear()
        self._bytes.clear()

    def __repr__(self) -> str:
        return f"Counters({self.snapshot()})"


class Request:
    """A non-blocking operation in flight.

    It runs as a sequence of steps; each step is a list of low-level message handles of the
    communicator (one step for an MPI built-in, N - 1 or 2(N - 1) steps for a ring collective).
    """

    def __init__(self, comm: Comm, steps, result=None, kind: str = "wait", peer: int | None = None):
        self._comm = comm
        self.kind = kind  # what a wait on it waits for, as the watchdog reports it
        self.peer = peer  # a point-to-point request's peer, by its rank in `comm` (the guard names it)
        self._steps = iter(steps)
        self._pending = None
        self.done = False
        self.result = result  # the array that holds the outcome once done
        self._advance()  # post the first step now

    def _advance(self) -> None:
        try:
            self._pending = next(self._steps)
        except StopIteration:
            self._pending, self.done = None, True

    def test(self) -> bool:
        """Make progress; True once the operation is complete."""
        while not self.done and self._comm._test_all(self._pending):
            self._advance()
        return self.done

    def wait(self):
        """Block until complete; returns `result` (the output buffer, or None)."""
        while not self.done:
            self._comm._wait_all(self._pending, self.kind, self.peer)
            self._advance()
        return self.result


def wait_all(requests) -> None:
    """Wait for every request, in order."""
    for request in requests:
        request.wait()


def test_all(requests) -> bool:
    """Progress every request; True when all are complete."""
    return all([request.test() for request in requests])  # a list: test each, no short-circuit


class _RingLink:
    """One ring collective's view of the communicator: neighbours, a tag, what to count under."""

    def __init__(self, comm: Comm, kind: str, tag: int, module=np):
        self.comm, self.kind, self.tag = comm, kind, tag
        self.module = module  # the buffers' array module: temporaries live in the same memory
        self.rank, self.size = comm.rank, comm.size
        self.right, self.left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def send(self, buf, dest: int | None = None) -> list:
        """Send to rank dest (default: the right neighbour)."""
        self.comm.counters.record(self.kind, buf.nbytes, calls=0)  # bytes counted at the send
        return [self.comm._post_send(buf, self.right if dest is None else dest, self.tag, internal=True)]

    def receive(self, buf, source: int | None = None) -> list:
        """Receive from rank source (default: the left neighbour)."""
        return [self.comm._post_recv(buf, self.left if source is None else source, self.tag, internal=True)]

    def exchange(self, send, recv, dest: int | None = None, source: int | None = None) -> list:
        """Send to the right (or dest) and receive from the left (or source), both at once (a Sendrecv)."""
        return self.receive(recv, source) + self.send(send, dest)

    def empty(self, n: int, dtype):
        return self.module.empty(n, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# The interface
# ------------------------------------------------------------------------------------------------


def _reduce_op(op: str, like):
    """The ufunc for op in the array module of `like` (numpy.add for a NumPy buffer, cupy.add for a CuPy one)."""
    if op not in OPS:
        raise ValueError(f"unknown reduction {op!r}; choose one of {', '.join(OPS)}")
    return getattr(backend.array_module(like), OPS[op].__name__)


def _check_collectives(collectives: str) -> str:
    if collectives not in COLLECTIVES:
        raise ValueError(f"unknown collectives {collectives!r}; choose one of {', '.join(COLLECTIVES)}")
    return collectives


class Comm:
    """A communicator: `rank` in 0..`size`-1, collectives of kind `collectives`, and `counters`."""

    def __init__(self, rank: int, size: int, collectives: str, counters: Counters):
        self.rank, self.size = rank, size
        self.collectives = _check_collectives(collectives)
        self.counters = counters
        self._tags = itertools.count()  # ring collectives number their messages (shared by copies)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, collectives={self.collectives!r})"

    # -- checks -----------------------------------------------------------------------------------

    def _flat(self, array, name: str, writable: bool, copied: bool = False):
        """The flat view (L,) of a contiguous numeric array, or one clear ValueError.

        copied: the collective only copies values (all-gather, broadcast, send and receive), so a
        bfloat16 array (ml_dtypes; MPI has no such datatype) travels as its bits, a uint16 view. A
        reduction never does: summing the bits would be wrong, so it is refused."""
        if type(array) is not np.ndarray and not isinstance(array, (np.ndarray, backend.xp().ndarray)):
            raise ValueError(f"{name} must be a {backend.xp().__name__} array, not {type(array).__name__}")
        flags = array.flags
        if not flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (MPI sends raw memory); pass ascontiguousarray(...)")
        if array.dtype.name == "bfloat16":
            if not copied:
                raise ValueError(f"{name} is bfloat16, which MPI cannot reduce: reduce its float32 copy")
            array = array.view("uint16")
        if array.dtype.kind not in "fiu":
            raise ValueError(f"{name} has dtype {array.dtype}; collectives need a float or integer dtype")
        if writable and not getattr(flags, "writeable", True):
            raise ValueError(f"{name} is read-only, but it receives data")
        return array if array.ndim == 1 else array.reshape(-1)

    def _check_rank(self, rank: int, name: str) -> None:
        if not (isinstance(rank, (int, np.integer)) and 0 <= rank < self.size):
            shown = int(rank) if isinstance(rank, np.integer) else rank  # not NumPy 2's np.int64(...)
            raise ValueError(f"{name}={shown!r} is not a rank of this communicator (size {self.size})")

    @staticmethod
    def _check_tag(tag: int) -> None:
        if not (isinstance(tag, (int, np.integer)) and 0 <= tag <= MAX_TAG):
            shown = int(tag) if isinstance(tag, np.integer) else tag  # not NumPy 2's np.int64(...)
            raise ValueError(f"tag={shown!r} must be an integer in 0..{MAX_TAG}")

    @staticmethod
    def _check_pair(send, recv, what: str) -> None:
        if send.dtype != recv.dtype:
            raise ValueError(f"{what}: sendbuf is {send.dtype} but recvbuf is {recv.dtype}")
        if backend.array_module(send) is not backend.array_module(recv):
            raise ValueError(f"{what}: sendbuf is a {type(send).__module__} array but recvbuf is a "
                             f"{type(recv).__module__} array; both must live in the same memory")
        if send.size and recv.size and backend.array_module(send).may_share_memory(send, recv):
            raise ValueError(f"{what}: sendbuf and recvbuf overlap" + (
                "; pass sendbuf=None for an in-place all-gather" if what == "allgather" else ""))

    # -- how collectives run: MPI's built-in, or ring.py ------------------------------------------

    def _builtin(self, kind: str, flat, start, args, blocking: bool, result, root: int = 0,
                 nbytes: int | None = None):
        """Count a built-in collective by the ring formula (or as nbytes), then start it: start(*args, blocking)."""
        if nbytes is None:
            nbytes = ring.bytes_sent(kind, flat.size, self.size, self.rank, flat.itemsize, root)
        self.counters.record(kind, nbytes)
        raw = start(*args, blocking)
        if blocking:
            return None
        return Request(self, [] if raw is None else [[raw]], result, f"wait for {kind}")

    def _ring(self, kind: str, algorithm, args, blocking: bool, result):
        """Run a ring algorithm; its bytes are counted message by message."""
        self.counters.record(kind)  # the call; bytes follow at each send
        link = _RingLink(self, kind, next(self._tags) % (MAX_TAG + 1), backend.array_module(args[0]))
        steps = algorithm(link, *args)
        if blocking:
            ring.run(steps, lambda handles: self._wait_all(handles, f"ring {kind}"))
            return None
        return Request(self, steps, result, f"wait for ring {kind}")

    # -- collectives --------------------------------------------------------------------------------

    def allreduce(self, buf, op: str = "sum"):
        """Reduce buf over all ranks, in place; returns buf. Any shape, contiguous."""
        self._allreduce(buf, op, blocking=True)
        return buf

    def iallreduce(self, buf, op: str = "sum") -> Request:
        """Non-blocking allreduce; the request's result is buf."""
        return self._allreduce(buf, op, blocking=False)

    def _allreduce(self, buf, op, blocking):
        flat = self._flat(buf, "buf", writable=True)
        reduce = _reduce_op(op, flat)
        if self.collectives == "ring":
            return self._ring("allreduce", ring.allreduce, (flat, reduce), blocking, buf)
        return self._builtin("allreduce", flat, self._mpi_allreduce, (flat, op), blocking, buf)

    def reduce_scatter(self, sendbuf, recvbuf=None, op: str = "sum"):
        """recvbuf (count_r,) = this rank's block of sendbuf (L,) reduced over all ranks."""
        return self._reduce_scatter(sendbuf, recvbuf, op, blocking=True)

    def ireduce_scatter(self, sendbuf, recvbuf=None, op: str = "sum") -> Request:
        """Non-blocking reduce_scatter; the request's result is recvbuf."""
        return self._reduce_scatter(sendbuf, recvbuf, op, blocking=False)

    def _reduce_scatter(self, sendbuf, recvbuf, op, blocking):
        send = self._flat(sendbuf, "sendbuf", writable=False)
        reduce = _reduce_op(op, send)
        count = ring.block_count(send.size, self.size, self.rank)
        if recvbuf is None:  # in the memory of sendbuf (host or device)
            recvbuf = backend.array_module(send).empty(count, dtype=send.dtype)
        recv = self._flat(recvbuf, "recvbuf", writable=True)
        if recv.size != count:
            raise ValueError(f"reduce_scatter: recvbuf has {recv.size} elements, but rank {self.rank}'s "
                             f"block of {send.size} over {self.size} ranks has {count}")
        self._check_pair(send, recv, "reduce_scatter")
        if self.collectives == "ring":
            request = self._ring("reduce_scatter", ring.reduce_scatter, (send, recv, reduce), blocking, recvbuf)
        else:
            request = self._builtin("reduce_scatter", send, self._mpi_reduce_scatter, (send, recv, op),
                                    blocking, recvbuf)
        return recvbuf if blocking else request

    def allgather(self, sendbuf, recvbuf=None):
        """Every rank's block into recvbuf (L,); sendbuf (count_r,) is ours, or None if already in place."""
        return self._allgather(sendbuf, recvbuf, blocking=True)

    def iallgather(self, sendbuf, recvbuf=None) -> Request:
        """Non-blocking allgather; the request's result is recvbuf."""
        return self._allgather(sendbuf, recvbuf, blocking=False)

    def _allgather(self, sendbuf, recvbuf, blocking):
        if recvbuf is None:
            if sendbuf is None:
                raise ValueError("allgather: give sendbuf, recvbuf or both")
            send = self._flat(sendbuf, "sendbuf", writable=False, copied=True)
            recvbuf = backend.array_module(send).empty(send.size * self.size, dtype=sendbuf.dtype)  # equal blocks
        recv = self._flat(recvbuf, "recvbuf", writable=True, copied=True)
        count = ring.block_count(recv.size, self.size, self.rank)
        send = None
        if sendbuf is not None:
            send = self._flat(sendbuf, "sendbuf", writable=False, copied=True)
            if send.size != count:
                raise ValueError(f"allgather: sendbuf has {send.size} elements, but rank {self.rank}'s block "
                                 f"of {recv.size} over {self.size} ranks has {count}")
            self._check_pair(send, recv, "allgather")
        if self.collectives == "ring":
            if send is not None:
                offset = ring.block_offset(recv.size, self.size, self.rank)
                recv[offset : offset + count] = send  # our block in place, then the ring
            request = self._ring("allgather", ring.allgather, (recv,), blocking, recvbuf)
        else:
            request = self._builtin("allgather", recv, self._mpi_allgather, (send, recv), blocking, recvbuf)
        return recvbuf if blocking else request

    def bcast(self, buf, root: int = 0):
        """Copy root's buf to every rank, in place; returns buf."""
        self._bcast(buf, root, blocking=True)
        return buf

    def ibcast(self, buf, root: int = 0) -> Request:
        """Non-blocking bcast; the request's result is buf."""
        return self._bcast(buf, root, blocking=False)

    def _bcast(self, buf, root, blocking):
        flat = self._flat(buf, "buf", writable=True, copied=True)
        self._check_rank(root, "root")
        if self.collectives == "ring":
            return self._ring("bcast", ring.bcast, (flat, root), blocking, buf)
        return self._builtin("bcast", flat, self._mpi_bcast, (flat, root), blocking, buf, root)

    def alltoall(self, sendbuf, recvbuf=None):
        """Equal blocks, L // N each: block j of sendbuf (L,) to rank j; rank i's block for us into
        block i of recvbuf (L,) (a new array shaped like sendbuf when None). Returns recvbuf."""
        return self._alltoall(sendbuf, recvbuf, blocking=True)

    def ialltoall(self, sendbuf, recvbuf=None) -> Request:
        """Non-blocking alltoall; the request's result is recvbuf."""
        return self._alltoall(sendbuf, recvbuf, blocking=False)

    def _alltoall(self, sendbuf, recvbuf, blocking):
        send = self._flat(sendbuf, "sendbuf", writable=False)
        if send.size % self.size:
            raise ValueError(f"alltoall: sendbuf has {send.size} elements, not a multiple of the {self.size} "
                             "ranks (equal blocks); use alltoallv for blocks of different lengths")
        if recvbuf is None:  # in the memory of sendbuf (host or device)
            recvbuf = backend.array_module(send).empty(sendbuf.shape, dtype=send.dtype)
        recv = self._flat(recvbuf, "recvbuf", writable=True)
        if recv.size != send.size:
            raise ValueError(f"alltoall: recvbuf has {recv.size} elements, but sendbuf has {send.size}; "
                             "with equal blocks both hold N blocks of the same length")
        self._check_pair(send, recv, "alltoall")
        counts = ring.block_counts(send.size, self.size)  # (N,) all L // N
        return self._exchange_blocks("alltoall", send, counts, recv, counts, recvbuf, blocking)

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        """Blocks of any length: block j of sendbuf (S,), sendcounts[j] elements, to rank j; rank i's
        block for us into block i of recvbuf (R,), recvcounts[i] elements. Blocks lie end to end
        (displacements: exclusive prefix sums of the counts), so sum(sendcounts) = S and
        sum(recvcounts) = R; counts (N,) are integers in elements (a list, or a host or device
        array). recvcounts[i] must equal rank i's sendcounts[r] (exchange the counts with alltoall
        first). Returns recvbuf."""
        return self._alltoallv(sendbuf, sendcounts, recvbuf, recvcounts, blocking=True)

    def ialltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts) -> Request:
        """Non-blocking alltoallv; the request's result is recvbuf."""
        return self._alltoallv(sendbuf, sendcounts, recvbuf, recvcounts, blocking=False)

    def _alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts, blocking):
        send = self._flat(sendbuf, "sendbuf", writable=False)
        recv = self._flat(recvbuf, "recvbuf", writable=True)
        sendcounts = self._counts(sendcounts, "sendcounts", send, "sendbuf")
        recvcounts = self._counts(recvcounts, "recvcounts", recv, "recvbuf")
        self._check_pair(send, recv, "alltoallv")
        return self._exchange_blocks("alltoallv", send, sendcounts, recv, recvcounts, recvbuf, blocking)

    def _counts(self, counts, name: str, flat, buffer: str) -> np.ndarray:
        """An all-to-all's counts as an int64 NumPy array (N,), or one clear ValueError."""
        if backend.on_device(counts):
            counts = backend.to_host(counts)
        array = np.array(counts)  # a host copy (N,)
        if array.shape != (self.size,):
            raise ValueError(f"alltoallv: {name} must hold {self.size} counts, one per rank, "
                             f"but has shape {array.shape}")
        if array.dtype.kind not in "iu":
            raise ValueError(f"alltoallv: {name} must be integers (counts of elements), not {array.dtype}")
        if (array < 0).any():
            rank = int((array < 0).argmax())
            raise ValueError(f"alltoallv: {name}[{rank}] = {int(array[rank])} is negative")
        if int(array.sum()) != flat.size:
            raise ValueError(f"alltoallv: {name} sum to {int(array.sum())} elements, but {buffer} has "
                             f"{flat.size} (blocks lie end to end, so the counts must add up to its size)")
        return array.astype(np.int64, copy=False)

    def _exchange_blocks(self, kind, send, sendcounts, recv, recvcounts, result, blocking):
        """Run an all-to-all: the pairwise exchange of ring.py, or MPI's Alltoall(v)."""
        if self.collectives == "ring":
            request = self._ring(kind, ring.alltoallv, (send, sendcounts, recv, recvcounts), blocking, result)
        else:
            nbytes = ring.alltoall_bytes_sent(sendcounts, self.rank, send.itemsize)
            if kind == "alltoall":
                start, args = self._mpi_alltoall, (send, recv)
            else:
                start, args = self._mpi_alltoallv, (send, sendcounts, recv, recvcounts)
            request = self._builtin(kind, send, start, args, blocking, result, nbytes=nbytes)
        return result if blocking else request

    def barrier(self, label: str = "barrier") -> None:
        """Wait until every rank has reached this call (`label`: what the watchdog calls the wait)."""
        self.counters.record("barrier")
        self._mpi_barrier(True, label)

    def ibarrier(self) -> Request:
        self.counters.record("barrier")
        raw = self._mpi_barrier(False)
        return Request(self, [] if raw is None else [[raw]], None, "wait for ibarrier")

    def allreduce_value(self, value: float, op: str = "sum") -> float:
        """A Python number reduced over all ranks (a one-element float64 allreduce)."""
        buf = backend.xp().asarray([value], dtype=np.float64)
        self.allreduce(buf, op)
        return float(buf[0])

    # -- point to point -------------------------------------------------------------------------------

    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send buf to rank dest; returns when buf may be reused, which (as for MPI_Send) may be only
        once the receiver has posted its receive -- so a send to oneself needs isend."""
        flat = self._p2p(buf, dest, tag, "dest", writable=False)
        self.counters.record("send", flat.nbytes)
        self._send(flat, dest, tag)

    def recv(self, buf, source: int, tag: int = 0):
        """Receive into buf from rank source; returns buf."""
        flat = self._p2p(buf, source, tag, "source", writable=True)
        self.counters.record("recv")
        self._recv(flat, source, tag)
        return buf

    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        flat = self._p2p(buf, dest, tag, "dest", writable=False)
        self.counters.record("send", flat.nbytes)
        return Request(self, [[self._post_send(flat, dest, tag)]], buf, "wait for isend", peer=dest)

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        flat = self._p2p(buf, source, tag, "source", writable=True)
        self.counters.record("recv")
        return Request(self, [[self._post_recv(flat, source, tag)]], buf, "wait for irecv", peer=source)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, sendtag: int = 0, recvtag: int | None = None):
        """Send to dest and receive from source at once (no deadlock in a shift); returns recvbuf."""
        send = self._p2p(sendbuf, dest, sendtag, "dest", writable=False)
        recvtag = sendtag if recvtag is None else recvtag
        recv = self._p2p(recvbuf, source, recvtag, "source", writable=True)
        self.counters.record("sendrecv", send.nbytes)
        self._wait_all([self._post_recv(recv, source, recvtag), self._post_send(send, dest, sendtag)],
                       f"sendrecv with ranks {dest} and {source}")
        return recvbuf

    def _p2p(self, buf, peer, tag, name, writable):
        flat = self._flat(buf, "buf", writable, copied=True)
        self._check_rank(peer, name)
        self._check_tag(tag)
        return flat

    # -- small Python objects (never in a hot path) -----------------------------------------------

    def allgather_object(self, obj) -> list:
        """Every rank's picklable obj, as a list indexed by rank."""
        return [pickle.loads(p) for p in self._allgather_bytes(pickle.dumps(obj))]

    def bcast_object(self, obj, root: int = 0):
        """Root's picklable obj, on every rank."""
        self._check_rank(root, "root")
        return pickle.loads(self._bcast_bytes(pickle.dumps(obj) if self.rank == root else b"", root))

    def counters_by_rank(self) -> list[dict]:
        """Every rank's counter snapshot (taken before this exchange), as a list indexed by rank."""
        return self.allgather_object(self.counters.snapshot())

    # -- structure --------------------------------------------------------------------------------

    def with_collectives(self, collectives: str) -> Comm:
        """The same communicator and counters, running collectives of another kind."""
        other = copy.copy(self)
        other.collectives = _check_collectives(collectives)
        return other

    def transfer_report(self) -> dict:
        """How arrays reach MPI, for --json: cuda_aware_mpi (null: no MPI), its reason, host_staging
        ("device", "none" or null) and host_staged_buffers (host copies so far); staging.py."""
        return dict(staging.NO_MPI_REPORT)

    # -- what a subclass provides ------------------------------------------------------------------
    # _mpi_allreduce / _mpi_reduce_scatter / _mpi_allgather / _mpi_bcast / _mpi_barrier(blocking):
    #     run MPI's built-in; return None when blocking, else one low-level handle (or None: done)
    # _mpi_alltoall(send, recv, blocking) / _mpi_alltoallv(send, sendcounts, recv, recvcounts, blocking):
    #     the same for all-to-all (counts: int64 NumPy arrays (N,), checked); needed only by a Comm
    #     on which alltoall / alltoallv are called
    # _post_send / _post_recv(flat, peer, tag, internal=False): start a message, return a handle
    # _send / _recv(flat, peer, tag): blocking point-to-point
    # _test_all(handles) -> bool, _wait_all(handles, what="wait", peer=None)
    # _allgather_bytes(payload) -> list[bytes], _bcast_bytes(payload, root) -> bytes
    # split(color, key=None) -> Comm | None, abort(code, message), world_rank, node_size()


# ------------------------------------------------------------------------------------------------
# MPI
# ------------------------------------------------------------------------------------------------


class MPIComm(Comm):
    """A Comm over an mpi4py communicator.

    Arrays reach MPI only through `HostCopies` (staging.py): each `_mpi_*` and point-to-point method
    routes its buffers with `copies.read(send)` / `copies.write(recv)` -- the array itself, or a host
    copy when `staging_rule` says so (a device array and an MPI library that is not CUDA-aware) --
    and hands its result to `staging.issued`, which copies received data back to the device
    after a blocking call, or wraps a non-blocking request so that `_test_all` / `_wait_all` do it
    when they see the request complete.
    """

    def __init__(self, mpi_comm, MPI, collectives: str = "mpi", counters: Counters | None = None,
                 staging_rule: staging.StagingRule | None = None):
        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size(), collectives, counters or Counters())
        self._MPI = MPI
        self._comm = mpi_comm
        with self._waits("communicator creation"):
            self._ring_comm = mpi_comm.Dup()  # ring messages never match the user's point-to-point
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        # this communicator's ranks as world ranks, for the watchdog's reports
        self.world_ranks = tuple(MPI.Group.Translate_ranks(mpi_comm.Get_group(), list(range(self.size)),
                                                           MPI.COMM_WORLD.Get_group()))
        self.staging_rule = staging_rule or staging.StagingRule.from_environment(MPI)

    def _waits(self, kind: str, peer: int | None = None):
        """The context of a blocking MPI call: the installed guard knows what this rank waits for."""
        return _guard.waiting(self, kind, peer)

    def transfer_report(self) -> dict:
        return self.staging_rule.report()

    def _copies(self) -> staging.HostCopies:
        """The buffers of one MPI call, routed directly or through host memory."""
        return staging.HostCopies(self.staging_rule)

    def _mpi_allreduce(self, flat, op, blocking):
        copies = self._copies()
        call = self._comm.Allreduce if blocking else self._comm.Iallreduce
        with self._waits("allreduce") if blocking else _NOT_WATCHED:
            return staging.issued(call(self._MPI.IN_PLACE, copies.write(flat), self._ops[op]), copies, blocking)

    def _mpi_reduce_scatter(self, send, recv, op, blocking):
        copies = self._copies()
        source, target = copies.read(send), copies.write(recv)
        if send.size % self.size == 0:  # equal blocks
            call = self._comm.Reduce_scatter_block if blocking else self._comm.Ireduce_scatter_block
            with self._waits("reduce_scatter") if blocking else _NOT_WATCHED:
                return staging.issued(call(source, target, self._ops[op]), copies, blocking)
        call = self._comm.Reduce_scatter if blocking else self._comm.Ireduce_scatter
        counts = ring.block_counts(send.size, self.size).tolist()
        with self._waits("reduce_scatter") if blocking else _NOT_WATCHED:
            return staging.issued(call(source, target, counts, self._ops[op]), copies, blocking)

    def _mpi_allgather(self, send, recv, blocking):
        copies = self._copies()
        source = self._MPI.IN_PLACE if send is None else copies.read(send)
        target = copies.write(recv)  # in place: holds our block, which is sent
        if recv.size % self.size == 0:
            call = self._comm.Allgather if blocking else self._comm.Iallgather
            with self._waits("allgather") if blocking else _NOT_WATCHED:
                return staging.issued(call(source, target), copies, blocking)
        call = self._comm.Allgatherv if blocking else self._comm.Iallgatherv
        counts = ring.block_counts(recv.size, self.size)  # target cut into this communicator's blocks
        vector = [target, (counts.tolist(), ring.block_offsets(counts).tolist())]
        with self._waits("allgather") if blocking else _NOT_WATCHED:
            return staging.issued(call(source, vector), copies, blocking)

    def _mpi_bcast(self, flat, root, blocking):
        copies = self._copies()
        call = self._comm.Bcast if blocking else self._comm.Ibcast
        with self._waits("bcast") if blocking else _NOT_WATCHED:
            return staging.issued(call(copies.write(flat), root), copies, blocking)

    def _mpi_alltoall(self, send, recv, blocking):
        copies = self._copies()
        call = self._comm.Alltoall if blocking else self._comm.Ialltoall
        with self._waits("alltoall") if blocking else _NOT_WATCHED:
            return staging.issued(call(copies.read(send), copies.write(recv)), copies, blocking)

    def _mpi_alltoallv(self, send, sendcounts, recv, recvcounts, blocking):
        copies = self._copies()
        source = [copies.read(send), (sendcounts.tolist(), ring.block_offsets(sendcounts).tolist())]
        target = [copies.write(recv), (recvcounts.tolist(), ring.block_offsets(recvcounts).tolist())]
        call = self._comm.Alltoallv if blocking else self._comm.Ialltoallv
        with self._waits("alltoallv") if blocking else _NOT_WATCHED:
            return staging.issued(call(source, target), copies, blocking)

    def _mpi_barrier(self, blocking, label="barrier"):
        if not blocking:
            return self._comm.Ibarrier()
        with self._waits(label):
            return self._comm.Barrier()

    def _post_send(self, flat, dest, tag, internal=False):
        copies = self._copies()
        comm = self._ring_comm if internal else self._comm
        return staging.issued(comm.Isend(copies.read(flat), dest, tag), copies, blocking=False)

    def _post_recv(self, flat, source, tag, internal=False):
        copies = self._copies()
        comm = self._ring_comm if internal else self._comm
        return staging.issued(comm.Irecv(copies.write(flat), source, tag), copies, blocking=False)

    def _send(self, flat, dest, tag):
        copies = self._copies()
        with self._waits("send", dest):
            staging.issued(self._comm.Send(copies.read(flat), dest, tag), copies, blocking=True)

    def _recv(self, flat, source, tag):
        copies = self._copies()
        with self._waits("recv", source):
            staging.issued(self._comm.Recv(copies.write(flat), source, tag), copies, blocking=True)

    def _test_all(self, handles) -> bool:
        if not self._MPI.Request.Testall(staging.mpi_requests(handles)):
            return False
        staging.completed(handles)  # received data back into device arrays, before anyone reads it
        _guard.progress()
        return True

    def _wait_all(self, handles, what: str = "wait", peer: int | None = None) -> None:
        with self._waits(what, peer):
            self._MPI.Request.Waitall(staging.mpi_requests(handles))
        staging.completed(handles)

    def _allgather_bytes(self, payload: bytes) -> list[bytes]:
        data = np.frombuffer(payload, dtype=np.uint8)
        sizes = np.empty(self.size, dtype=np.int64)  # (N,) every rank's payload length
        with self._waits("allgather_object"):
            self._comm.Allgather(np.array([data.size], dtype=np.int64), sizes)
        offsets = np.zeros(self.size, dtype=np.int64)  # (N,) where each payload starts
        np.cumsum(sizes[:-1], out=offsets[1:])
        gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
        with self._waits("allgather_object"):
            self._comm.Allgatherv(data, [gathered, (sizes.tolist(), offsets.tolist())])
        # The ring rule: every block but the right neighbour's, payload and its 8-byte size.
        right = (self.rank + 1) % self.size
        self.counters.record("allgather_object", int(sizes.sum() - sizes[right]) + 8 * (self.size - 1))
        return [gathered[o : o + s].tobytes() for o, s in zip(offsets.tolist(), sizes.tolist())]

    def _bcast_bytes(self, payload: bytes, root: int) -> bytes:
        size = np.array([len(payload)], dtype=np.int64)
        with self._waits("bcast_object"):
            self._comm.Bcast(size, root)
        data = np.frombuffer(payload, dtype=np.uint8).copy() if self.rank == root else np.empty(int(size[0]), np.uint8)
        with self._waits("bcast_object"):
            self._comm.Bcast(data, root)
        self.counters.record("bcast_object", 0 if self.rank == (root - 1) % self.size else 8 + data.size)
        return data.tobytes()

    def split(self, color: int | None, key: int | None = None) -> MPIComm | None:
        """Sub-communicators of the ranks with equal color, ordered by key (default: this rank).

        Collective: every rank calls it; a rank with color None gets None. Counters add up into ours.
        """
        if color is not None and not (isinstance(color, (int, np.integer)) and color >= 0):
            raise ValueError(f"split: color must be a non-negative integer or None, not {color!r}")
        with self._waits("split"):
            sub = self._comm.Split(self._MPI.UNDEFINED if color is None else int(color),
                                   self.rank if key is None else int(key))
        if sub == self._MPI.COMM_NULL:
            return None
        return MPIComm(sub, self._MPI, self.collectives, Counters(parent=self.counters), self.staging_rule)

    def node_size(self) -> int:
        """Ranks of this communicator on this node (an MPI_COMM_TYPE_SHARED split)."""
        with self._waits("split by node"):
            node = self._comm.Split_type(self._MPI.COMM_TYPE_SHARED, key=self.rank)
        size = node.Get_size()
        node.Free()
        return size

    def abort(self, code: int = 1, message: str | None = None):
        """End every rank of the job now, with exit status `code`; print `[rank R] message` first."""
        if message:
            sys.stderr.write(f"[rank {self.world_rank}] {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # Give the launcher a moment to forward what was just written: MPI_Abort has the process
        # manager kill every rank at once, and under load a line still in flight could be lost.
        time.sleep(ABORT_GRACE_S)
        self._MPI.COMM_WORLD.Abort(code)
        os._exit(code)  # not reached: MPI_Abort does not return


# ------------------------------------------------------------------------------------------------
# One process, no MPI
# ------------------------------------------------------------------------------------------------


class _LocalReceive:
    """A receive from oneself: complete once a matching message is in the mailbox."""

    def __init__(self, mailbox: deque, flat):
        self.mailbox, self.flat, self.done = mailbox, flat, False

    def test(self) -> bool:
        if not self.done and self.mailbox:
            message = self.mailbox.popleft()
            if message.size != self.flat.size:
                raise ValueError(f"recv: buffer has {self.flat.size} elements, the message has {message.size}")
            self.flat[...] = message
            self.done = True
        return self.done


class LocalComm(Comm):
    """A world of one process: the Comm interface with no MPI library and zero traffic."""

    def __init__(self, collectives: str = "mpi", counters: Counters | None = None):
        super().__init__(0, 1, collectives, counters or Counters())
        self._mailboxes: dict[tuple[bool, int], deque] = {}  # (internal, tag) -> messages to self
        self.world_rank = 0

    def _mpi_allreduce(self, flat, op, blocking):
        return None  # the sum over one rank is the buffer itself

    def _mpi_reduce_scatter(self, send, recv, op, blocking):
        recv[...] = send

    def _mpi_allgather(self, send, recv, blocking):
        if send is not None:
            recv[...] = send

    def _mpi_bcast(self, flat, root, blocking):
        return None

    def _mpi_alltoall(self, send, recv, blocking):
        recv[...] = send  # our one block, to ourselves

    def _mpi_alltoallv(self, send, sendcounts, recv, recvcounts, blocking):
        recv[...] = send

    def _mpi_barrier(self, blocking, label="barrier"):
        return None

    def _mailbox(self, internal, tag) -> deque:
        return self._mailboxes.setdefault((internal, tag), deque())

    def _post_send(self, flat, dest, tag, internal=False):
        self._mailbox(internal, tag).append(flat.copy())
        return None  # buffered: complete at once

    def _post_recv(self, flat, source, tag, internal=False):
        return _LocalReceive(self._mailbox(internal, tag), flat)

    def _send(self, flat, dest, tag):
        self._post_send(flat, dest, tag)  # buffered in the mailbox

    def _recv(self, flat, source, tag):
        self._wait_all([self._post_recv(flat, source, tag)])

    def _test_all(self, handles) -> bool:
        return all([h is None or h.test() for h in handles])

    def _wait_all(self, handles, what: str = "wait", peer: int | None = None) -> None:
        if not self._test_all(handles):
            raise RuntimeError("deadlock: a one-process world waits for a message to itself that was never sent")

    def _allgather_bytes(self, payload: bytes) -> list[bytes]:
        self.counters.record("allgather_object")
        return [payload]

    def _bcast_bytes(self, payload: bytes, root: int) -> bytes:
        self.counters.record("bcast_object")
        return payload

    def split(self, color: int | None, key: int | None = None) -> LocalComm | None:
        if color is not None and not (isinstance(color, (int, np.integer)) and color >= 0):
            raise ValueError(f"split: color must be a non-negative integer or None, not {color!r}")
        return None if color is None else LocalComm(self.collectives, Counters(parent=self.counters))

    def node_size(self) -> int:
        return 1

    def abort(self, code: int = 1, message: str | None = None):
        if message:
            sys.stderr.write(f"[rank 0] {message}\n")
        raise SystemExit(code)


# ------------------------------------------------------------------------------------------------
# The world
# ------------------------------------------------------------------------------------------------

_world: Comm | None = None  # the one global: created lazily, on the first get_world()


def get_world(collectives: str = "mpi") -> Comm:
    """The world communicator (created on the first call), running `collectives` ("mpi" or "ring")."""
    global _world
    _check_collectives(collectives)
    if _world is None:
        _world = _create_mpi_world() if under_mpiexec() else LocalComm()
    return _world if _world.collectives == collectives else _world.with_collectives(collectives)


def existing_world() -> Comm | None:
    """The world communicator if one was created, else None (never creates one, never imports MPI)."""
    return _world


def _create_mpi_world() -> MPIComm:
    MPI = _start_mpi()
    _guard.mpi_started(MPI)
    world = MPIComm(MPI.COMM_WORLD, MPI)
    with world._waits("split by node"):
        node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    _guard.world_created(world, node.Get_size())
    backend.set_local_rank(node.Get_rank())  # the CuPy backend takes GPU (local rank mod GPUs)
    node.Free()
    return world


def _start_mpi():
    """Import mpi4py, which initialises MPI, within REFIMPL_INIT_TIMEOUT seconds (default 60).

    MPI_Init waits for every process of the job. If one of them dies before it gets there (Python
    cannot import numpy on one node, a wrapper script fails), MPICH's launcher does not end the job
    and the others would wait forever. MPI_Init holds Python's GIL, so no Python thread can time it
    out; faulthandler's watchdog is a C thread: it prints where this process waits ("Timeout ...
    in _start_mpi") and exits with status 1, which ends the job.
    """
    limit = float(os.environ.get("REFIMPL_INIT_TIMEOUT", INIT_TIMEOUT_S))
    faulthandler.dump_traceback_later(limit, exit=True)
    try:
        # If this import times out, a process of the job exited before it joined MPI (see its output).
        from mpi4py import MPI  # noqa: PLC0415 - the only import of mpi4py in refimpl
    except Exception as exc:  # ImportError, or RuntimeError when no MPI library can be loaded
        found = [name for name in LAUNCHER_VARIABLES if name in os.environ] or ["REFIMPL_MPI=1"]
        raise RuntimeError(f"running under mpiexec ({found[0]} is set) but mpi4py cannot start MPI: {exc}; "
                           "install an MPI library, e.g. pip install mpich") from exc
    finally:
        faulthandler.cancel_dump_traceback_later()
    return MPI
