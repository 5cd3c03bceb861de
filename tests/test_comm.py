"""The communication layer in one process: block layout, byte formulas, the ring algorithms and
the pairwise all-to-all on a simulated network (N up to 8, no MPI), non-blocking ring requests of
N Comm objects sharing mailboxes, the local world, counters, mesh, thread budget, failure
messages, and that none of it imports mpi4py.
"""

from __future__ import annotations

import re
import sys
import textwrap
from collections import defaultdict, deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_util import clean_env, find_mpiexec, run_local, run_local_json

from refimpl.parallel import comm as commlib
from refimpl.parallel import ring
from refimpl.parallel.mesh import Mesh
from refimpl.tools.runtime import failure, launcher, threads

# -- block layout and the byte formulas ---------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(length=st.integers(0, 300), size=st.integers(1, 9))
def test_block_layout_is_array_split(length, size):
    parts = np.array_split(np.arange(length), size)
    counts = ring.block_counts(length, size)
    assert counts.tolist() == [len(p) for p in parts]
    assert [ring.block_count(length, size, b) for b in range(size)] == counts.tolist()
    starts = [int(p[0]) if len(p) else None for p in parts]
    offsets = ring.block_offsets(counts).tolist()
    assert [ring.block_offset(length, size, b) for b in range(size)] == offsets
    assert all(s is None or s == o for s, o in zip(starts, offsets))
    assert counts.max() - counts.min() <= 1


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(0, 50), size=st.integers(1, 9), itemsize=st.sampled_from([2, 4, 8]))
def test_byte_formulas_when_n_divides_length(blocks, size, itemsize):
    length = blocks * size
    for rank in range(size):
        one_phase = (size - 1) * length // size * itemsize  # (N-1)/N of the buffer
        assert ring.bytes_sent("reduce_scatter", length, size, rank, itemsize) == one_phase
        assert ring.bytes_sent("allgather", length, size, rank, itemsize) == one_phase
        assert ring.bytes_sent("allreduce", length, size, rank, itemsize) == 2 * one_phase


@settings(max_examples=60, deadline=None)
@given(length=st.integers(0, 300), size=st.integers(1, 9), root=st.integers(0, 8))
def test_byte_formulas_sum_to_n_minus_1_buffers(length, size, root):
    root %= size
    for kind, phases in [("reduce_scatter", 1), ("allgather", 1), ("allreduce", 2), ("bcast", 1)]:
        total = sum(ring.bytes_sent(kind, length, size, r, 1, root) for r in range(size))
        assert total == phases * (size - 1) * length


def test_unknown_kind_has_no_formula():
    with pytest.raises(ValueError, match="no ring byte formula"):
        ring.bytes_sent("gather", 10, 2, 0, 8)
    with pytest.raises(ValueError, match="use alltoall_bytes_sent"):
        ring.bytes_sent("alltoallv", 10, 2, 0, 8)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 9), block=st.integers(0, 20), seed=st.integers(0, 2**32 - 1),
       itemsize=st.sampled_from([2, 4, 8]))
def test_alltoall_byte_formula(size, block, seed, itemsize):
    counts = np.random.default_rng(seed).integers(0, 6, size=(size, size))  # counts[i, j]: i sends to j
    sent = [ring.alltoall_bytes_sent(counts[r], r, itemsize) for r in range(size)]
    assert sent == [sum(int(counts[r, j]) for j in range(size) if j != r) * itemsize for r in range(size)]
    assert sum(sent) == (counts.sum() - np.trace(counts)) * itemsize  # everything off the diagonal
    equal = [ring.alltoall_bytes_sent([block] * size, r, itemsize) for r in range(size)]
    assert equal == [(size - 1) * block * itemsize] * size  # (N-1)/N of L = N * block


# -- the ring algorithms on a simulated network -----------------------------------------------------------


class SimulatedRing:
    """N ranks in one process: sends are buffered, a receive completes when its message has arrived."""

    def __init__(self, size):
        self.size = size
        self.wires = defaultdict(deque)  # (source, dest) -> messages travelling from source to dest
        self.sent = [0] * size  # bytes sent by each rank
        self.peers = [[] for _ in range(size)]  # (dest, source) of each rank's exchanges, in order

    def link(self, rank):
        net = self

        class Link:
            def __init__(self):
                self.rank, self.size = rank, net.size

            def send(self, buf, dest=None):
                net.wires[(rank, (rank + 1) % net.size if dest is None else dest)].append(buf.copy())
                net.sent[rank] += buf.nbytes
                return []

            def receive(self, buf, source=None):
                return [("recv", ((rank - 1) % net.size if source is None else source, rank), buf)]

            def exchange(self, send, recv, dest=None, source=None):
                net.peers[rank].append((dest, source))
                return self.receive(recv, source) + self.send(send, dest)

            @staticmethod
            def empty(n, dtype):
                return np.empty(n, dtype=dtype)

        return Link()

    def run(self, generators):
        """Advance every rank whose pending receives can complete, until all are finished."""
        pending = [None] * self.size
        live = set(range(self.size))
        for r in list(live):
            pending[r] = self._next(generators[r], r, live)
        while live:
            progressed = False
            for r in sorted(live):
                if all(self._complete(h) for h in pending[r]):
                    pending[r] = self._next(generators[r], r, live)
                    progressed = True
            assert progressed, "the simulated ring deadlocked"

    def _next(self, generator, rank, live):
        try:
            return [[h, False] for h in next(generator)]
        except StopIteration:
            live.discard(rank)
            return []

    def _complete(self, handle):
        (_, wire, buf), done = handle
        if not done and self.wires[wire]:
            message = self.wires[wire].popleft()
            assert message.size == buf.size, "a receive matched a message of another length"
            buf[...] = message
            handle[1] = True
        return handle[1]


def ring_order(x, reduce):
    """Block b folded over ranks b+1, ..., b (the documented order)."""
    n, length = x.shape
    out = np.empty(length, dtype=x.dtype)
    counts = ring.block_counts(length, n)
    for b, (o, c) in enumerate(zip(ring.block_offsets(counts), counts)):
        acc = x[(b + 1) % n, o : o + c].copy()
        for k in range(2, n + 1):
            reduce(acc, x[(b + k) % n, o : o + c], out=acc)
        out[o : o + c] = acc
    return out


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 8), length=st.integers(0, 60), seed=st.integers(0, 2**32 - 1),
       reduce=st.sampled_from([np.add, np.maximum]))
def test_simulated_ring_collectives(size, length, seed, reduce):
    x = np.random.default_rng(seed).standard_normal((size, length))  # (N, L): row r is rank r's
    want = ring_order(x, reduce)
    counts, offsets = ring.block_counts(length, size), ring.block_offsets(ring.block_counts(length, size))

    net = SimulatedRing(size)  # all-reduce
    bufs = x.copy()
    net.run([ring.allreduce(net.link(r), bufs[r], reduce) for r in range(size)])
    assert all(np.array_equal(bufs[r], want) for r in range(size))
    assert np.allclose(want, reduce.reduce(x, axis=0), rtol=1e-12, atol=1e-12)
    assert net.sent == [ring.bytes_sent("allreduce", length, size, r, 8) for r in range(size)]

    net = SimulatedRing(size)  # reduce-scatter, sendbuf untouched
    sends, outs = x.copy(), [np.empty(c) for c in counts]
    net.run([ring.reduce_scatter(net.link(r), sends[r], outs[r], reduce) for r in range(size)])
    assert np.array_equal(sends, x)
    assert all(np.array_equal(outs[r], want[offsets[r] : offsets[r] + counts[r]]) for r in range(size))
    assert net.sent == [ring.bytes_sent("reduce_scatter", length, size, r, 8) for r in range(size)]

    net = SimulatedRing(size)  # all-gather in place, bcast
    bufs = np.full((size, length), np.nan)
    for r in range(size):
        bufs[r, offsets[r] : offsets[r] + counts[r]] = x[r, offsets[r] : offsets[r] + counts[r]]
    net.run([ring.allgather(net.link(r), bufs[r]) for r in range(size)])
    gathered = np.concatenate([x[b, offsets[b] : offsets[b] + counts[b]] for b in range(size)])
    assert all(np.array_equal(bufs[r], gathered) for r in range(size))
    assert net.sent == [ring.bytes_sent("allgather", length, size, r, 8) for r in range(size)]

    root = seed % size
    net = SimulatedRing(size)
    bufs = x.copy()
    net.run([ring.bcast(net.link(r), bufs[r], root) for r in range(size)])
    assert all(np.array_equal(bufs[r], x[root]) for r in range(size))
    assert net.sent == [ring.bytes_sent("bcast", length, size, r, 8, root) for r in range(size)]


def alltoall_counts(rng, size, most):
    """counts[i, j]: elements rank i sends rank j (N, N), with zeros and one rank that neither sends nor receives."""
    counts = rng.integers(0, most + 1, size=(size, size))
    counts[rng.random((size, size)) < 0.3] = 0
    if size > 1:
        empty = rng.integers(size)
        counts[empty, :] = counts[:, empty] = 0
    return counts


def alltoall_expected(sends, counts, r):
    """What rank r receives: block r of every rank's sendbuf, in rank order."""
    offsets = np.concatenate([np.zeros((len(counts), 1), int), np.cumsum(counts, axis=1)], axis=1)
    return np.concatenate([sends[i][offsets[i, r] : offsets[i, r + 1]] for i in range(len(counts))])


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 8), most=st.integers(0, 6), seed=st.integers(0, 2**32 - 1))
def test_simulated_pairwise_alltoall(size, most, seed):
    rng = np.random.default_rng(seed)
    counts = alltoall_counts(rng, size, most)
    sends = [rng.standard_normal(int(counts[i].sum())) for i in range(size)]  # rank i's sendbuf
    recvs = [np.full(int(counts[:, r].sum()), np.nan) for r in range(size)]
    net = SimulatedRing(size)
    net.run([ring.alltoallv(net.link(r), sends[r].copy(), counts[r], recvs[r], counts[:, r]) for r in range(size)])
    assert all(np.array_equal(recvs[r], alltoall_expected(sends, counts, r)) for r in range(size))
    assert net.sent == [ring.alltoall_bytes_sent(counts[r], r, 8) for r in range(size)]  # own block not sent
    # N - 1 steps; step s sends to r + s and receives from r - s
    assert net.peers == [[((r + s) % size, (r - s) % size) for s in range(1, size)] for r in range(size)]


class MailboxComm(commlib.Comm):
    """Rank `rank` of N Comm objects in one process, point-to-point through shared mailboxes: the
    ring collectives and their non-blocking requests, exactly as MPIComm runs them, without MPI.
    Only non-blocking calls work (a blocking one would wait for ranks that have not run yet)."""

    def __init__(self, rank, size, mailboxes):
        super().__init__(rank, size, "ring", commlib.Counters())
        self.mailboxes = mailboxes  # (source, dest, tag, internal) -> messages

    def _post_send(self, flat, dest, tag, internal=False):
        self.mailboxes[(self.rank, dest, tag, internal)].append(flat.copy())
        return None  # buffered

    def _post_recv(self, flat, source, tag, internal=False):
        return commlib._LocalReceive(self.mailboxes[(source, self.rank, tag, internal)], flat)

    def _test_all(self, handles):
        return all([h is None or h.test() for h in handles])

    def _wait_all(self, handles, what="wait", peer=None):
        if not self._test_all(handles):
            raise RuntimeError(f"{what}: a message from a rank that has not sent it yet")


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("kind", ["alltoall", "alltoallv"])
def test_ring_alltoall_requests_advance_one_step_per_test(size, kind):
    rng = np.random.default_rng(size)
    counts = np.full((size, size), 4) if kind == "alltoall" else alltoall_counts(rng, size, 6)
    sends = [rng.integers(-99, 99, int(counts[i].sum())).astype(np.float32) for i in range(size)]
    mailboxes = defaultdict(deque)
    comms = [MailboxComm(r, size, mailboxes) for r in range(size)]
    recvs = [np.zeros(int(counts[:, r].sum()), np.float32) for r in range(size)]
    if kind == "alltoall":
        requests = [comms[r].ialltoall(sends[r], recvs[r]) for r in range(size)]
    else:
        requests = [comms[r].ialltoallv(sends[r], counts[r], recvs[r], counts[:, r].tolist()) for r in range(size)]
    # posting sends step 1 (to rank r + 1), counted then
    assert [c.counters.bytes(kind) for c in comms] == [4 * int(counts[r, (r + 1) % size]) for r, c in enumerate(comms)]
    if size > 2:  # rank 0 alone: step 1 completes, step 2 is posted, and its message is not there yet
        assert not requests[0].test() and not requests[0].test()
        assert comms[0].counters.bytes(kind) == 4 * int(counts[0, 1] + counts[0, 2])
    rounds = 0
    while not all([request.test() for request in requests]):
        rounds += 1
        assert rounds < size
    for r in range(size):
        assert requests[r].result is recvs[r] and np.array_equal(recvs[r], alltoall_expected(sends, counts, r))
        assert comms[r].counters.snapshot() == {kind: {"calls": 1, "bytes": ring.alltoall_bytes_sent(counts[r], r, 4)}}
    assert not any(mailboxes.values())  # every message received


# -- the local world -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["mpi", "ring"])
def test_local_world_collectives(mode):
    world = commlib.LocalComm(mode)
    x = np.arange(7.0)
    assert world.allreduce(x) is x and np.array_equal(x, np.arange(7.0))
    assert np.array_equal(world.reduce_scatter(x), x)
    assert np.array_equal(world.allgather(np.ones(3)), np.ones(3))
    assert world.bcast(x) is x
    request = world.iallreduce(x)
    assert request.test() and request.done and request.wait() is x
    assert world.ireduce_scatter(x).wait().shape == (7,)
    assert world.allreduce_value(2.5) == 2.5
    world.barrier()
    snapshot = world.counters.snapshot()
    assert world.counters.total_bytes == 0
    assert snapshot["allreduce"] == {"calls": 3, "bytes": 0}  # allreduce, iallreduce, allreduce_value
    assert world.allgather_object("a") == ["a"] and world.bcast_object({"k": 1}) == {"k": 1}


@pytest.mark.parametrize("mode", ["mpi", "ring"])
def test_local_world_alltoall(mode):
    world = commlib.LocalComm(mode)
    counts = np.array([3], dtype=np.int64)
    got = world.alltoall(counts)  # recvbuf=None: a new array like sendbuf
    assert got is not counts and got.dtype == np.int64 and np.array_equal(got, counts)
    grid, out = np.arange(6.0).reshape(2, 3), np.zeros((2, 3))
    assert world.alltoall(grid, out) is out and np.array_equal(out, grid)
    tokens, arrived = np.arange(12, dtype=np.float32).reshape(4, 3), np.zeros((4, 3), np.float32)
    assert world.alltoallv(tokens, [12], arrived, counts * 4) is arrived and np.array_equal(arrived, tokens)
    empty = np.zeros(0)
    assert world.alltoallv(np.zeros(0), [0], empty, [0]) is empty
    request = world.ialltoallv(np.ones(2), (2,), np.zeros(2), np.array([2], dtype=np.uint32))
    assert request.test() and np.array_equal(request.wait(), np.ones(2))
    assert np.array_equal(world.ialltoall(np.arange(3)).wait(), np.arange(3))
    assert world.counters.snapshot() == {"alltoall": {"calls": 3, "bytes": 0}, "alltoallv": {"calls": 3, "bytes": 0}}


def test_local_messages_to_oneself():
    world = commlib.LocalComm()
    inbox = np.zeros(3)
    receive = world.irecv(inbox, 0, tag=4)
    assert not receive.test()
    world.send(np.arange(3.0), 0, tag=4)  # buffered in the mailbox
    assert receive.test() and np.array_equal(inbox, np.arange(3.0))
    world.isend(np.ones(2), 0, tag=1)
    assert np.array_equal(world.recv(np.zeros(2), 0, tag=1), np.ones(2))
    assert np.array_equal(world.sendrecv(np.full(2, 5.0), 0, np.zeros(2), 0), np.full(2, 5.0))
    with pytest.raises(RuntimeError, match="deadlock"):
        world.recv(np.zeros(2), 0, tag=7)
    assert world.counters.bytes("send") == 24 + 16 and world.counters.calls("recv") == 3


def test_counters_add_up_into_parents_and_siblings_share():
    world = commlib.LocalComm()
    sub = world.split(color=0)
    assert sub.counters.parent is world.counters
    before = world.counters.snapshot()
    sub.allreduce(np.ones(4))
    world.barrier()
    assert sub.counters.snapshot() == {"allreduce": {"calls": 1, "bytes": 0}}
    assert world.counters.since(before) == {"allreduce": {"calls": 1, "bytes": 0}, "barrier": {"calls": 1, "bytes": 0}}
    ring_world = world.with_collectives("ring")
    assert ring_world.counters is world.counters and ring_world.collectives == "ring"
    sub.counters.reset()
    assert sub.counters.snapshot() == {} and world.counters.calls("allreduce") == 1
    assert world.split(color=None) is None
    with pytest.raises(ValueError, match="color"):
        world.split(color=-1)


def test_local_abort_exits_with_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        commlib.LocalComm().abort(2, "error: bad flag")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "[rank 0] error: bad flag\n"


def test_bad_input_is_one_clear_error():
    world = commlib.LocalComm()
    with pytest.raises(ValueError, match="C-contiguous"):
        world.allreduce(np.ones((4, 4)).T)
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        world.allreduce(np.ones(2), op="avg")
    with pytest.raises(ValueError, match="unknown collectives 'tree'"):
        commlib.LocalComm("tree")
    with pytest.raises(ValueError, match="give sendbuf, recvbuf or both"):
        world.allgather(None)
    with pytest.raises(ValueError, match="overlap"):
        x = np.ones(4)
        world.allgather(x[:4], x)


@pytest.mark.parametrize("call, message", [
    (lambda w: w.alltoall(np.ones(4), np.zeros(3)), "alltoall: recvbuf has 3 elements, but sendbuf has 4"),
    (lambda w: w.alltoall(np.ones(4), np.zeros(4, np.float32)), "alltoall: sendbuf is float64 but recvbuf is float32"),
    (lambda w: w.alltoall(np.ones((4, 4)).T), "C-contiguous"),
    (lambda w: w.alltoallv(np.ones(4), [3], np.zeros(4), [4]),
     "alltoallv: sendcounts sum to 3 elements, but sendbuf has 4"),
    (lambda w: w.alltoallv(np.ones(4), [4], np.zeros(5), [4]),
     "alltoallv: recvcounts sum to 4 elements, but recvbuf has 5"),
    (lambda w: w.alltoallv(np.ones(4), [2, 2], np.zeros(4), [4]),
     "alltoallv: sendcounts must hold 1 counts, one per rank, but has shape (2,)"),
    (lambda w: w.alltoallv(np.ones(4), 4, np.zeros(4), [4]),
     "sendcounts must hold 1 counts, one per rank, but has shape ()"),
    (lambda w: w.alltoallv(np.ones(4), [4], np.zeros(4), [[4]]), "recvcounts must hold 1 counts"),
    (lambda w: w.alltoallv(np.ones(4), [4.0], np.zeros(4), [4]),
     "alltoallv: sendcounts must be integers (counts of elements), not float64"),
    (lambda w: w.alltoallv(np.ones(0), [0], np.zeros(0), [-1]), "alltoallv: recvcounts[0] = -1 is negative"),
    (lambda w: w.alltoallv(np.ones(4, np.int32), [4], np.zeros(4, np.int64), [4]),
     "alltoallv: sendbuf is int32 but recvbuf is int64"),
    (lambda w: w.alltoallv(np.ones(4), [4], None, [4]), "recvbuf must be a numpy array, not NoneType"),
])
def test_alltoall_argument_errors(call, message):
    for mode in ["mpi", "ring"]:
        world = commlib.LocalComm(mode)
        pattern = f"^{re.escape(message)}" if message.startswith("alltoall") else re.escape(message)
        with pytest.raises(ValueError, match=pattern):
            call(world)
        assert world.counters.snapshot() == {}  # nothing counted for a call refused
    shared = np.ones(4)
    with pytest.raises(ValueError, match="alltoallv: sendbuf and recvbuf overlap"):
        commlib.LocalComm().alltoallv(shared[:2], [2], shared[1:3], [2])


# -- the world, MPI detection, and never importing mpi4py ------------------------------------------------


@pytest.mark.parametrize("environ, expected", [
    ({}, False), ({"PMI_RANK": "0"}, True), ({"OMPI_COMM_WORLD_SIZE": "2"}, True), ({"PMIX_RANK": "1"}, True),
    ({"MPI_LOCALNRANKS": "2"}, True), ({"PMI_SIZE": "2", "REFIMPL_MPI": "0"}, False), ({"REFIMPL_MPI": "1"}, True),
])
def test_under_mpiexec(environ, expected):
    assert commlib.under_mpiexec(environ) is expected


def test_one_process_never_imports_mpi4py():
    program = textwrap.dedent("""
        import json, sys
        import numpy as np
        import refimpl, refimpl.parallel, refimpl.parallel.comm, refimpl.parallel.ring, refimpl.parallel.mesh
        from refimpl.parallel.comm import get_world, existing_world
        assert existing_world() is None
        world = get_world("ring")
        world.allreduce(np.ones(3)); world.barrier()
        print(json.dumps({"comm": type(world).__name__, "size": world.size, "mpi4py": "mpi4py" in sys.modules}))
    """)
    assert run_local_json(["-c", program], timeout=60) == {"comm": "LocalComm", "size": 1, "mpi4py": False}


def test_missing_mpi_library_is_a_clear_error(tmp_path):
    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('cannot load MPI library')\n")
    done = run_local(["-c", "from refimpl.parallel.comm import get_world; get_world()"], timeout=60,
                     env={"REFIMPL_MPI": "1", "PYTHONPATH": f"{tmp_path}:{clean_env()['PYTHONPATH']}"})
    assert done.returncode != 0
    assert "running under mpiexec (REFIMPL_MPI=1 is set) but mpi4py cannot start MPI" in done.stderr
    assert "pip install mpich" in done.stderr


# -- mesh -----------------------------------------------------------------------------------------------


class StubWorld:
    """Enough of a Comm for Mesh's arithmetic: a rank in a world of `size` (split returns a marker)."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def split(self, color, key=None):
        return ("split", color, key)


def megatron_coords(rank, dp, pp, tp):
    """(d, p, t) of a rank in Megatron-LM's order, written out independently of mesh.py."""
    return rank // tp % dp, rank // (tp * dp), rank % tp


def test_mesh_layout_is_megatron_order():
    mesh = Mesh(StubWorld(rank=4, size=6), dp=2, pp=3)  # tp = 1: rank = p * dp + d
    assert (mesh.dp_index, mesh.pp_index, mesh.tp_index) == (0, 2, 0) and mesh.tp == 1
    assert [mesh.rank_of(1, p) for p in range(3)] == [1, 3, 5]  # one pipeline: stride dp
    assert [mesh.rank_of(d, 1) for d in range(2)] == [2, 3]  # one stage's replicas: neighbours
    assert mesh.dp_comm == ("split", 2, 0) and mesh.pp_comm == ("split", 0, 2)
    assert mesh.tp_comm == ("split", 4, 0) and mesh.mp_comm == ("split", 0, 2)
    assert all(mesh.rank_of(*mesh.coords_of(r)) == r for r in range(6))
    assert Mesh(StubWorld(0, 6), pp=2).dp == 3 and Mesh(StubWorld(0, 6), dp=2).pp == 3
    assert (Mesh(StubWorld(0, 6), dp=None, pp=None).dp, Mesh(StubWorld(0, 6)).pp) == (6, 1)
    assert (Mesh(StubWorld(0, 12), pp=3, tp=2).dp, Mesh(StubWorld(0, 12), dp=3, tp=2).pp) == (2, 2)
    assert (Mesh(StubWorld(0, 12), tp=4).dp, Mesh(StubWorld(0, 12), tp=4).pp) == (3, 1)


def split_groups(meshes, comm):
    """The groups a world.split of every rank's mesh makes: [world ranks ordered by key], sorted."""
    groups = {}
    for rank, mesh in enumerate(meshes):
        _, color, key = getattr(mesh, comm)
        groups.setdefault(color, []).append((key, rank))
    return sorted([rank for _, rank in sorted(members)] for members in groups.values())


@pytest.mark.parametrize("dp, pp, tp", [(2, 2, 2), (3, 2, 2), (2, 3, 2), (1, 2, 4), (2, 1, 3), (1, 1, 8)])
def test_mesh_with_tensor_parallelism(dp, pp, tp):
    n = dp * pp * tp
    meshes = [Mesh(StubWorld(rank, n), dp=dp, pp=pp, tp=tp) for rank in range(n)]
    for rank, mesh in enumerate(meshes):
        coords = megatron_coords(rank, dp, pp, tp)
        assert (mesh.dp_index, mesh.pp_index, mesh.tp_index) == coords == mesh.coords_of(rank)
        assert mesh.rank_of(*coords) == rank
        assert mesh.as_dict() == {"dp": dp, "pp": pp, "tp": tp, "ep": 1, "cp": 1, "dp_index": coords[0],
                                  "pp_index": coords[1], "tp_index": coords[2], "cp_index": 0}
    rank = lambda d, p, t: (p * dp + d) * tp + t  # noqa: E731
    assert split_groups(meshes, "tp_comm") == sorted([rank(d, p, t) for t in range(tp)]
                                                     for d in range(dp) for p in range(pp))
    assert split_groups(meshes, "dp_comm") == sorted([rank(d, p, t) for d in range(dp)]
                                                     for p in range(pp) for t in range(tp))
    assert split_groups(meshes, "pp_comm") == sorted([rank(d, p, t) for p in range(pp)]
                                                     for d in range(dp) for t in range(tp))
    assert split_groups(meshes, "mp_comm") == sorted([rank(d, p, t) for p in range(pp) for t in range(tp)]
                                                     for d in range(dp))


def test_mesh_2x2x2_grid():
    """mesh.py's picture: pp = dp = tp = 2 over 8 ranks."""
    meshes = [Mesh(StubWorld(rank, 8), dp=2, pp=2, tp=2) for rank in range(8)]
    assert [m.coords_of(r) for r, m in enumerate(meshes)] == [
        (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]
    assert all(meshes[0].rank_of(*meshes[0].coords_of(r)) == r for r in range(8))
    assert split_groups(meshes, "tp_comm") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_groups(meshes, "dp_comm") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert split_groups(meshes, "pp_comm") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert split_groups(meshes, "mp_comm") == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("dp, pp, tp, message", [
    (2, 2, None, "mesh: dp=2 x tp=1 x pp=2 needs 4 ranks, but the world has 6; launch mpiexec -n 4, "
                 "or choose dp x tp x pp = 6"),
    (None, 4, None, "mesh: pp=4 x tp=1 does not divide the world size 6; launch a multiple of 4 ranks"),
    (4, None, None, "mesh: dp=4 x tp=1 does not divide the world size 6; launch a multiple of 4 ranks"),
    (None, None, 4, "mesh: pp=1 x tp=4 does not divide the world size 6; launch a multiple of 4 ranks"),
    (None, 2, 2, "mesh: pp=2 x tp=2 does not divide the world size 6; launch a multiple of 4 ranks"),
    (2, None, 4, "mesh: dp=2 x tp=4 does not divide the world size 6; launch a multiple of 8 ranks"),
    (3, 1, 4, "mesh: dp=3 x tp=4 x pp=1 needs 12 ranks, but the world has 6; launch mpiexec -n 12, "
              "or choose dp x tp x pp = 6"),
    (0, 1, None, "mesh: dp must be a positive integer, not 0"),
    (2, 1.5, None, "mesh: pp must be a positive integer, not 1.5"),
    (None, None, 0, "mesh: tp must be a positive integer, not 0"),
])
def test_mesh_errors(dp, pp, tp, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Mesh(StubWorld(0, 6), dp=dp, pp=pp, tp=tp)


def test_mesh_coordinates_out_of_range():
    mesh = Mesh(commlib.LocalComm())
    with pytest.raises(ValueError, match=re.escape("mesh: (d=1, p=0, t=0) is outside the dp=1 x pp=1 x tp=1 grid")):
        mesh.rank_of(1, 0)
    grid = Mesh(StubWorld(0, 8), dp=2, pp=2, tp=2)
    with pytest.raises(ValueError, match=re.escape("(d=0, p=0, t=2) is outside the dp=2 x pp=2 x tp=2 grid")):
        grid.rank_of(0, 0, 2)
    with pytest.raises(ValueError, match="mesh: rank 8 is outside a world of 8"):
        grid.coords_of(8)


# -- thread budget and failure messages ------------------------------------------------------------------


@pytest.mark.parametrize("cores, ranks, threads_", [(2, 2, 1), (2, 4, 1), (16, 4, 4), (16, 3, 5), (8, 1, 8)])
def test_thread_budget_divides_cores_between_ranks(cores, ranks, threads_):
    budget = threads.choose(cores, ranks, environ={})
    assert budget.threads == threads_ and budget.local_ranks == ranks


def test_thread_budget_respects_the_user():
    budget = threads.choose(16, 4, environ={"OPENBLAS_NUM_THREADS": "3"})
    assert budget.threads is None and "OPENBLAS_NUM_THREADS=3" in budget.reason


def test_failure_messages():
    try:
        raise RuntimeError("disk\nfull")
    except RuntimeError as exc:
        text = failure.report(2, exc, exc.__traceback__)
    lines = text.splitlines()
    assert lines[0] == "[rank 2] Traceback (most recent call last):"
    assert lines[-1] == "[rank 2] RuntimeError: disk full" and all(line.startswith("[rank 2] ") for line in lines)
    assert failure.report(0, ValueError("batch 10 over 3 ranks")) == "[rank 0] ValueError: batch 10 over 3 ranks\n"
    assert failure.exit_code(ValueError()) == 2 and failure.exit_code(KeyError()) == 1
    assert failure.exit_code(KeyboardInterrupt()) == 130


def test_mpi_util_finds_the_environment_mpiexec():
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec")
    assert mpiexec.endswith("mpiexec")
    env = clean_env({"PMI_RANK": None, "EXTRA": 1})
    assert env["EXTRA"] == "1" and not any(k.startswith("PMI_") for k in env)
    assert sys.executable  # the helper launches this same interpreter


def test_launcher_variables_give_the_rank_and_are_left_out_of_a_new_launch():
    assert launcher.launcher_rank({}) == 0
    assert launcher.launcher_rank({"OMPI_COMM_WORLD_RANK": "3", "HOME": "/h"}) == 3
    assert launcher.launcher_rank({"PMI_RANK": "2", "PMIX_RANK": "5"}) == 2  # the first of RANK_VARIABLES
    environ = {"PMI_RANK": "1", "HYDRA_HOST": "n0", "OMPI_COMM_WORLD_SIZE": "2", "I_MPI_PIN": "0", "HOME": "/h"}
    assert launcher.without_launcher(environ) == {"HOME": "/h"}
    names = launcher.LAUNCHER_VARIABLES + launcher.RANK_VARIABLES
    assert all(name.startswith(launcher.LAUNCHER_PREFIXES) for name in names)
