"""t ranks simulated in one process, and the checks of tutorial 10 (tensor and sequence parallelism).

Tensor parallelism communicates *inside* forward and backward: an operator's backward all-reduces
while the engine is in the middle of a graph. A rank cannot be a generator that yields at each
message (tutorial 03's ring), so here each rank is a thread of this process, with its own
communicator:

    def program(comm):                        # comm.rank, comm.size, comm.allreduce(buf), ...
        ...
        return something
    results = run_ranks(2, program)           # [program(comm of rank 0), program(comm of rank 1)]

`ThreadComm` is a refimpl `Comm` (refimpl/parallel/comm.py): the same argument checks, the same
counters (bytes by the ring formulas, as with MPI's built-in collectives), and the collectives
refimpl's tensor-parallel code calls (allreduce with sum or max, reduce_scatter, allgather,
bcast, barrier). A collective waits until every rank has called it, then each rank reduces the
contributions in rank order, so every rank gets bit-for-bit the same sum, as from MPI. Ranks
that call different collectives, or a collective after another rank has returned, fail with a
message that says so, never a hang.

The threads take turns: exactly one runs at a time, and they switch only inside collectives.
refimpl's autograd keeps one process-wide switch, "is grad recording on" (backward turns it off),
so each rank's value of it is saved when the rank pauses and restored when it resumes: one rank's
backward never turns recording off for another rank's forward. (That, and the turns, are the
only differences from separate processes.)
"""

from __future__ import annotations

import threading

import numpy as np

from refimpl.autograd import Function, Parameter, Tensor, grad_mode
from refimpl.nn import functional as F
from refimpl.parallel import ring
from refimpl.parallel.comm import OPS, Comm, Counters
from refimpl.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, WeightSplit
from refimpl.parallel.tensor_parallel.operators import (
    CopyToTensorParallel,
    GatherSequence,
    ReduceFromTensorParallel,
    ReduceScatterSequence,
)

from . import Wrong, expect_close, shown

TIMEOUT_S = 60.0  # a rank waits this long in a collective before the simulation gives up


class _Broken(RuntimeError):
    """A rank's collective could not complete because another rank stopped (it returned or raised)."""


class _Group:
    """What t threads share: the turn (one runs at a time) and the collectives' meeting point."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.turn = threading.Lock()  # held by the one rank that runs
        self.cv = threading.Condition()  # guards everything below
        self.arrived: dict[int, tuple] = {}  # rank -> (what it called, its contribution), this round
        self.rounds: dict[int, dict] = {}  # round number -> every rank's (what, contribution)
        self.round = 0
        self.readers: dict[int, int] = {}  # round number -> ranks that have read it
        self.stopped: dict[int, str] = {}  # rank -> "returned" or "raised ...", once it has stopped
        self.recording = [grad_mode.is_enabled()] * size  # each rank's grad-recording switch while paused

    def pause(self, rank: int) -> None:
        self.recording[rank] = grad_mode.is_enabled()
        self.turn.release()

    def resume(self, rank: int) -> None:
        self.turn.acquire()
        grad_mode._enabled = self.recording[rank]  # noqa: SLF001 - this rank's own switch (see the docstring)

    def exchange(self, rank: int, what: tuple, contribution) -> list:
        """Every rank's contribution to this collective, in rank order (waits for all of them)."""
        self.pause(rank)
        try:
            with self.cv:
                if self.stopped:
                    raise _Broken(self._stopped_message(rank, what))
                self.arrived[rank] = (what, contribution)
                mine = self.round
                if len(self.arrived) == self.size:
                    self.rounds[mine] = self.arrived
                    self.arrived, self.round = {}, self.round + 1
                    self.cv.notify_all()
                elif not self.cv.wait_for(lambda: self.round != mine or self.stopped, timeout=TIMEOUT_S):
                    raise _Broken(f"rank {rank} waited {TIMEOUT_S:.0f} s in {_describe(what)} for ranks "
                                  f"{sorted(set(range(self.size)) - set(self.arrived))}")
                if self.round == mine:
                    raise _Broken(self._stopped_message(rank, what))
                calls = self.rounds[mine]
                self.readers[mine] = self.readers.get(mine, 0) + 1
                if self.readers[mine] == self.size:  # every rank has its copy: forget the round
                    del self.rounds[mine], self.readers[mine]
        finally:
            self.resume(rank)
        kinds = [calls[r][0] for r in range(self.size)]
        if any(k != kinds[0] for k in kinds):
            raise Wrong("the ranks called different collectives at the same point: "
                        + "; ".join(f"rank {r} {_describe(k)}" for r, k in enumerate(kinds))
                        + ". Every rank must make the same collective calls, in the same order")
        return [calls[r][1] for r in range(self.size)]

    def stop(self, rank: int, how: str) -> None:
        with self.cv:
            self.stopped[rank] = how
            self.cv.notify_all()

    def _stopped_message(self, rank: int, what: tuple) -> str:
        others = "; ".join(f"rank {r} had {how}" for r, how in sorted(self.stopped.items()))
        return (f"rank {rank} called {_describe(what)}, but {others}: every rank must make the same collective "
                f"calls, in the same order")


def _describe(what: tuple) -> str:
    kind, size, dtype = what
    return f"{kind}" + ("" if size is None else f" of {size} {dtype} elements")


class ThreadComm(Comm):
    """Rank `rank` of a group of threads: refimpl's Comm interface, counted like MPI's built-ins."""

    def __init__(self, group: _Group, rank: int) -> None:
        super().__init__(rank, group.size, "mpi", Counters())
        self._group = group
        self.world_rank = rank

    def _exchange(self, kind: str, flat, contribution) -> list:
        what = (kind, None if flat is None else int(flat.size), None if flat is None else str(flat.dtype))
        return self._group.exchange(self.rank, what, contribution)

    def _mpi_allreduce(self, flat, op, blocking):
        parts = self._exchange(f"allreduce({op})", flat, flat.copy())
        total = parts[0].copy()
        for part in parts[1:]:  # in rank order: the same sum, bit for bit, on every rank
            OPS[op](total, part, out=total)
        flat[...] = total

    def _mpi_reduce_scatter(self, send, recv, op, blocking):
        parts = self._exchange(f"reduce_scatter({op})", send, send.copy())
        start = ring.block_offset(send.size, self.size, self.rank)
        total = parts[0][start:start + recv.size].copy()
        for part in parts[1:]:
            OPS[op](total, part[start:start + recv.size], out=total)
        recv[...] = total

    def _mpi_allgather(self, send, recv, blocking):
        start = ring.block_offset(recv.size, self.size, self.rank)
        count = ring.block_count(recv.size, self.size, self.rank)
        mine = (recv[start:start + count] if send is None else send).copy()
        recv[...] = np.concatenate(self._exchange("allgather", recv, mine))

    def _mpi_bcast(self, flat, root, blocking):
        flat[...] = self._exchange(f"bcast(root {root})", flat, flat.copy())[root]

    def _mpi_barrier(self, blocking, label="barrier"):
        self._exchange("barrier", None, None)

    def _allgather_bytes(self, payload: bytes) -> list[bytes]:
        self.counters.record("allgather_object")
        return self._exchange("allgather_object", None, payload)

    def _bcast_bytes(self, payload: bytes, root: int) -> bytes:
        self.counters.record("bcast_object")
        return self._exchange(f"bcast_object(root {root})", None, payload)[root]

    def _test_all(self, handles) -> bool:
        return True  # every collective here completes when it is called

    def _wait_all(self, handles, what: str = "wait", peer: int | None = None) -> None:
        return None

    def _unsupported(self, *args, **kwargs):
        raise RuntimeError("ThreadComm simulates collectives only (no point-to-point messages, no split)")

    _post_send = _post_recv = _send = _recv = split = _unsupported

    def node_size(self) -> int:
        return self.size

    def abort(self, code: int = 1, message: str | None = None):
        raise RuntimeError(message or f"abort({code})")


def run_ranks(size: int, program, *args, comm_class=None) -> list:
    """[program(comm, *args) on rank r for r in range(size)], each rank a thread with a ThreadComm
    (or a subclass of it: comm_class).

    If a rank raises, the first exception raised by a rank's own code is raised here (a rank that
    only failed because another had stopped is not the cause)."""
    group = _Group(size)
    comms = [(comm_class or ThreadComm)(group, r) for r in range(size)]
    results: list = [None] * size
    errors: list = [None] * size
    recording = grad_mode.is_enabled()

    def body(r: int) -> None:
        group.resume(r)
        how = "returned"
        try:
            results[r] = program(comms[r], *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[r] = exc
            how = f"raised {type(exc).__name__}"
        finally:
            group.stop(r, how)
            group.pause(r)

    threads = [threading.Thread(target=body, args=(r,), name=f"rank {r}", daemon=True) for r in range(size)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        grad_mode._enabled = recording  # noqa: SLF001 - as it was before the ranks ran
    causes = [e for e in errors if e is not None and not isinstance(e, _Broken)]
    if causes:
        raise causes[0]
    broken = [e for e in errors if e is not None]
    if broken:
        raise Wrong(str(broken[0]))
    return results


# ------------------------------------------------------------------------------------------------
# The MLP of tutorial 10, whole and cut: refimpl's answers, used by the tutorial and the checks
# ------------------------------------------------------------------------------------------------


def reference_mlp_slices(fc_weight, fc_bias, proj_weight, proj_bias, r: int, t: int) -> tuple:
    """refimpl's cut of an MLP (exercise 2's answer): fc by output features, proj by input features."""
    return (WeightSplit(0).shard(fc_weight, r, t), WeightSplit(0).shard(fc_bias, r, t),
            WeightSplit(1).shard(proj_weight, r, t), np.array(proj_bias, copy=True))


def reference_qkv_slices(qkv_weight, qkv_bias, n_head: int, r: int, t: int) -> tuple:
    """refimpl's cut of the fused qkv projection (exercise 3's answer): rank r's heads of q, of k and of v."""
    return WeightSplit(0, parts=3).shard(qkv_weight, r, t), WeightSplit(0, parts=3).shard(qkv_bias, r, t)


def mlp_case(c: int, seed: int) -> dict:
    """An MLP of width c (hidden 4c) with distinct random weights and biases, an input and dL/dy."""
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((2, 3, c)),  # (B, T, C)
            "fc_weight": rng.standard_normal((4 * c, c)), "fc_bias": rng.standard_normal(4 * c),  # (4C, C), (4C,)
            "proj_weight": rng.standard_normal((c, 4 * c)), "proj_bias": rng.standard_normal(c),  # (C, 4C), (C,)
            "dy": rng.standard_normal((2, 3, c))}  # (B, T, C)


MLP_NAMES = ("fc_weight", "fc_bias", "proj_weight", "proj_bias")


def mlp_whole(case: dict) -> dict:
    """One process: y = gelu(x fcᵀ + b) projᵀ + b, and every gradient for dL/dy = case["dy"]."""
    x = Tensor(case["x"].copy(), requires_grad=True)
    params = [Parameter(case[name].copy()) for name in MLP_NAMES]
    y = F.linear(F.gelu(F.linear(x, params[0], params[1])), params[2], params[3])
    y.backward(case["dy"])
    return {"y": y.data, "x": x.grad, **{name: p.grad for name, p in zip(MLP_NAMES, params)}}


def _mlp_on_rank(comm, case, slices, f=None, g=None) -> dict:
    """Rank comm.rank's MLP: column-parallel fc, GeLU, row-parallel proj (refimpl's layers, or f and g given)."""
    params = [Parameter(np.array(a, dtype=np.float64)) for a in slices]
    x = Tensor(case["x"].copy(), requires_grad=True)  # every rank holds the whole input
    if f is None:
        fc = ColumnParallelLinear(params[0], params[1], comm, sequence_parallel=False)  # f, then x w_rᵀ + b_r
        proj = RowParallelLinear(params[2], params[3], comm, sequence_parallel=False)  # x_r w_rᵀ, then g, then + b
        y = proj(F.gelu(fc(x)))
    else:
        hidden = F.gelu(F.linear(f.apply(x, comm), params[0], params[1]))  # (B, T, 4C/t)
        y = g.apply(F.linear(hidden, params[2]), comm) + params[3]  # (B, T, C): the bias once, after the sum
    y.backward(case["dy"])
    return {"y": y.data, "x": x.grad, **{name: p.grad for name, p in zip(MLP_NAMES, params)},
            "bytes": comm.counters.snapshot()}


def _library_mlp_slices(fc_weight, fc_bias, proj_weight, proj_bias, r: int, t: int) -> tuple:
    """Rank r's MLP slices, cut by refimpl's own WeightSplit (the tensor-parallel GPT's)."""
    from refimpl.parallel.tensor_parallel.gpt import WeightSplit  # noqa: PLC0415

    rows, columns = WeightSplit(axis=0), WeightSplit(axis=1)
    return (rows.shard(fc_weight, r, t), rows.shard(fc_bias, r, t), columns.shard(proj_weight, r, t),
            np.array(proj_bias, copy=True))


def mlp_layers(fc_weight, fc_bias, proj_weight, proj_bias, comm) -> tuple:
    """Rank comm.rank's (fc, proj) of a whole MLP: fc column-parallel, proj row-parallel, each holding
    this rank's slices as Parameters. Which slices those are is exercise 2 of tutorial 10, so this
    helper keeps them to itself (and a call to it during that exercise fails it)."""
    mine = [Parameter(a) for a in _library_mlp_slices(fc_weight, fc_bias, proj_weight, proj_bias, comm.rank,
                                                      comm.size)]
    return (ColumnParallelLinear(mine[0], mine[1], comm, sequence_parallel=False),
            RowParallelLinear(mine[2], mine[3], comm, sequence_parallel=False))


def slice_difference(rank_grads: list, whole_grads: list, r: int, t: int) -> float:
    """The largest |difference| between rank r's gradients of its MLP slices and the same slices of one
    process's gradients (fc_weight, fc_bias, proj_weight, proj_bias)."""
    expected = _library_mlp_slices(*whole_grads, r, t)
    return float(max(np.abs(np.asarray(g) - e).max() for g, e in zip(rank_grads, expected)))


def tensor_parallel_mlp(case: dict, t: int, slices=None, f=None, g=None) -> list:
    """Run the MLP on t ranks; each rank's {"y", "x" (its dL/dx), its slices' gradients, "bytes"}.
    `slices` defaults to reference_mlp_slices, looked up when called (so a recorder sees the calls)."""
    slices = slices or reference_mlp_slices

    def program(comm):
        return _mlp_on_rank(comm, case, slices(*(case[n] for n in MLP_NAMES), comm.rank, t), f, g)

    return run_ranks(t, program)


# ------------------------------------------------------------------------------------------------
# Check of exercise 1: the conjugate operators f and g
# ------------------------------------------------------------------------------------------------


def _times(got, base) -> str | None:
    """'t times' when got = k · base for a whole k > 1 (the usual sign of one all-reduce too many)."""
    got, base = np.asarray(got, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if got.shape != base.shape or not np.any(base):
        return None
    k = float(np.vdot(got, base) / np.vdot(base, base))
    if round(k) > 1 and abs(k - round(k)) < 1e-9 and np.allclose(got, round(k) * base, rtol=1e-10, atol=1e-12):
        return f"{round(k)} times"
    return None


def _backward_returns(node, grad, name: str, t: int):
    """Call a Function's backward directly and check the form of what it returns."""
    out = node.backward(grad, needs=(True, False))
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        kind = f"a {type(out).__name__}" + (f" of shape {out.shape}" if hasattr(out, "shape") else "") + \
            (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise Wrong(f"{name}'s backward must return one gradient per positional input of forward(x, comm): the "
                    f"tuple (gradient of x, None) -- comm is not differentiable; it returned {kind}")
    if out[1] is not None:
        raise Wrong(f"{name}'s backward returned {type(out[1]).__name__} as the gradient of comm; return None there")
    return out[0]


def _check_f(f, t: int, rng) -> None:
    x0 = rng.standard_normal((2, 3, 4))  # (B, T, C): the same on every rank (f's input is replicated)
    partial = [rng.standard_normal((2, 3, 4)) for _ in range(t)]  # rank r's part of dL/dx
    total = np.sum(partial, axis=0)

    def program(comm):
        x = Tensor(x0.copy(), requires_grad=True)
        y = f.apply(x, comm)
        out = np.array(y.data, copy=True)
        direct = _backward_returns(y.grad_fn, partial[comm.rank].copy(), "f", t) if y.grad_fn else None
        given = partial[comm.rank].copy()
        y.backward(given)
        return out, direct, x.grad, given

    for r, (out, direct, grad, given) in enumerate(run_ranks(t, program)):
        where = f"with t = {t} ranks, rank {r}"
        if _times(out, x0):
            raise Wrong(f"{where}: f's forward returned {_times(out, x0)} its input (t = {t}): f must be the identity "
                        f"in forward -- every rank already holds the whole x, and summing t equal copies multiplies "
                        f"it by t (the all-reduce belongs to f's backward, and to g's forward)")
        expect_close(out, x0, f"{where}: f's forward output (it must be the identity)")
        if grad is None:
            raise Wrong(f"{where}: x got no gradient through f: is its backward's first element None?")
        if np.allclose(grad, partial[r], rtol=1e-10, atol=1e-12):
            raise Wrong(f"{where}: f's backward returned the rank's own gradient unchanged; it must all-reduce "
                        f"(sum) it over the group: each rank's gradient of x flows only through its own slice of "
                        f"the column-parallel layer, and dL/dx is the sum of the t parts")
        if _times(grad, total):
            raise Wrong(f"{where}: f's backward returned {_times(grad, total)} the sum of the ranks' gradients: "
                        f"all-reduce once")
        expect_close(grad, total, f"{where}: the gradient of x through f (the sum over ranks of the gradient "
                                  f"each rank gives f's backward)")
        if direct is not None and not np.allclose(direct, total, rtol=1e-10, atol=1e-12):
            raise Wrong(f"{where}: f's backward gives different results when called twice with the same gradient")
        if not np.array_equal(given, partial[r]):
            raise Wrong(f"{where}: f's backward changed the gradient it was given in place (comm.allreduce sums "
                        f"into the array it is handed): that array is not f's to change -- the engine may have "
                        f"handed the same array to another operation (an addition, e.g. a residual connection, "
                        f"passes its output's gradient to both inputs unchanged); all-reduce a copy")


def _check_g(g, t: int, rng) -> None:
    partial = [rng.standard_normal((2, 3, 4)) for _ in range(t)]  # rank r's partial output x_r w_rᵀ
    total = np.sum(partial, axis=0)
    dy = rng.standard_normal((2, 3, 4))  # dL/dy: the same on every rank (what follows g is replicated)

    def program(comm):
        p = Tensor(partial[comm.rank].copy(), requires_grad=True)
        y = g.apply(p, comm)
        out, after = np.array(y.data, copy=True), np.array(p.data, copy=True)
        direct = _backward_returns(y.grad_fn, dy.copy(), "g", t) if y.grad_fn else None
        y.backward(dy.copy())
        return out, after, direct, p.grad

    for r, (out, after, direct, grad) in enumerate(run_ranks(t, program)):
        where = f"with t = {t} ranks, rank {r}"
        if np.allclose(out, partial[r], rtol=1e-10, atol=1e-12):
            raise Wrong(f"{where}: g's forward returned the rank's own partial output; it must all-reduce (sum) the "
                        f"t partial outputs x_r w_rᵀ of the row-parallel layer into the whole output")
        expect_close(out, total, f"{where}: g's forward output (the sum over ranks of their inputs)")
        if not np.array_equal(after, partial[r]):
            raise Wrong(f"{where}: g's forward changed its input in place (comm.allreduce sums into the array it is "
                        f"handed, and forward receives the input Tensor's own array): another operation may have "
                        f"saved that array for its backward, which would then compute with the sum; all-reduce a "
                        f"copy")
        if grad is None:
            raise Wrong(f"{where}: the input of g got no gradient: is its backward's first element None?")
        if _times(grad, dy):
            raise Wrong(f"{where}: g's backward returned {_times(grad, dy)} the gradient it was given (t = {t}): g "
                        f"must be the identity in backward -- every rank already holds the same, whole dL/dy (all "
                        f"that follows g is replicated), and all-reducing it counts it t times")
        expect_close(grad, dy, f"{where}: the gradient of g's input (it must be the identity in backward)")
        if direct is not None and not np.allclose(direct, dy, rtol=1e-10, atol=1e-12):
            raise Wrong(f"{where}: g's backward gives different results when called twice with the same gradient")


def check_conjugate_operators(conjugate_operators) -> None:
    """Check: the conjugate operators f and g."""
    operators = conjugate_operators()
    if not isinstance(operators, (tuple, list)) or len(operators) != 2:
        raise Wrong(f"return the pair of classes (f, g); got {shown(operators)}")
    f, g = operators
    for name, cls in (("f", f), ("g", g)):
        if not (isinstance(cls, type) and issubclass(cls, Function)):
            raise Wrong(f"{name} must be a class derived from refimpl.autograd.Function (return the class itself, "
                        f"not an instance or a function); got {shown(cls)}")
        own = (CopyToTensorParallel, ReduceFromTensorParallel, GatherSequence, ReduceScatterSequence)
        if issubclass(cls, own):
            base = next(b for b in own if issubclass(cls, b))
            raise Wrong(f"{name} is refimpl's {base.__name__}, or derives from it: write forward and backward "
                        f"yourself")
    rng = np.random.default_rng(10)
    for t in (2, 3):
        _check_f(f, t, rng)
        _check_g(g, t, rng)
    case = mlp_case(6, seed=11)  # width 6, hidden 24: t = 2, 3 and 4 all divide it
    whole = mlp_whole(case)
    for t in (2, 3, 4):
        for r, got in enumerate(tensor_parallel_mlp(case, t, f=f, g=g)):
            mine = reference_mlp_slices(*(whole[n] for n in MLP_NAMES), r, t)  # this rank's slices of the gradients
            where = f"the tensor-parallel MLP (fc column-parallel after f, proj row-parallel before g) on t = {t} " \
                    f"ranks, rank {r}"
            expect_close(got["y"], whole["y"], f"{where}: the output y", atol=1e-12, rtol=0)
            expect_close(got["x"], whole["x"], f"{where}: dL/dx", atol=1e-12, rtol=0)
            for name, expected in zip(MLP_NAMES, mine):
                expect_close(got[name], expected, f"{where}: the gradient of its slice of {name}", atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------------------------
# Checks of exercises 2 and 3: which slices each rank keeps
# ------------------------------------------------------------------------------------------------


def _ranges(indices) -> str:
    """[0, 1, 2, 5, 6] -> '0..2, 5..6'."""
    indices = [int(i) for i in indices]
    if not indices:
        return "none"
    parts, start = [], indices[0]
    for a, b in zip(indices, indices[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}..{a}")
            start = b
    return ", ".join(parts)


def _which(got, whole, axis: int) -> list | None:
    """The indices along `axis` of `whole` that `got`'s slices are (None if some slice is not one of them)."""
    a, b = np.moveaxis(np.asarray(got), axis, 0), np.moveaxis(np.asarray(whole), axis, 0)
    found = []
    for row in a:
        match = np.flatnonzero(np.all(b.reshape(len(b), -1) == row.reshape(1, -1), axis=1))
        if not len(match):
            return None
        found.append(int(match[0]))
    return found


def _expect_slice(got, whole, expected, name: str, axis: int, what: str, r: int, t: int) -> None:
    """got must be `expected` (whole's slice along axis); say which slice got is if not."""
    if got is None:
        raise Wrong(f"{name} on rank {r} of {t}: got None")
    got = np.asarray(got)
    if got.shape == expected.shape and np.array_equal(got, expected):
        return
    want = _which(expected, whole, axis)
    lines = "rows" if axis == 0 else "columns"
    head = f"rank {r} of {t} holds {lines} {_ranges(want)} of the whole {name} {tuple(whole.shape)} ({what})"
    if got.shape != expected.shape:
        raise Wrong(f"{head}, shape {expected.shape}; yours has shape {got.shape}")
    have = _which(got, whole, axis)
    if have is None:
        raise Wrong(f"{head}; yours holds numbers that are not {lines} of it")
    hint = ""
    if len(set(have)) == len(want):
        hint = (f": as many features, but not block {r} of {t} equal contiguous blocks. refimpl and Megatron-LM "
                f"give rank r the r-th block, so that the ranks' slices side by side are the whole weight (verify, "
                f"checkpoints and the vocabulary's ranges rely on it)")
    raise Wrong(f"{head}; yours holds {lines} {_ranges(have)}{hint}")


def check_mlp_slices(mlp_slices) -> None:
    """Check: an MLP's slices on rank r."""
    case = mlp_case(4, seed=12)  # C = 4, hidden 16
    for t in (1, 2, 4):
        for r in range(t):
            got = mlp_slices(*(case[n].copy() for n in MLP_NAMES), r, t)
            if not isinstance(got, (tuple, list)) or len(got) != 4:
                raise Wrong("return the 4 arrays (fc_weight_r, fc_bias_r, proj_weight_r, proj_bias_r); "
                            f"got {shown(got)}")
            expected = reference_mlp_slices(*(case[n] for n in MLP_NAMES), r, t)
            fc_w, fc_b, proj_w, proj_b = (np.asarray(a) if a is not None else None for a in got)
            by_input = (case["fc_weight"].shape[0], case["fc_weight"].shape[1] // t)  # (4C, C/t)
            if fc_w is not None and t > 1 and fc_w.shape == by_input:
                raise Wrong(f"fc_weight on rank {r} of {t}: yours has shape {fc_w.shape}, a cut of its columns (input "
                            f"features). fc is column-parallel in the paper's Y = X A, A of shape (in, out): it keeps "
                            f"columns of A, output features. refimpl's Linear stores w = Aᵀ, shape (out, in), and "
                            f"computes x wᵀ + b: the output features are the ROWS of w")
            _expect_slice(fc_w, case["fc_weight"], expected[0], "fc_weight", 0, "its output features", r, t)
            _expect_slice(fc_b, case["fc_bias"], expected[1], "fc_bias", 0,
                          "the biases of its output features, like fc_weight's rows", r, t)
            if proj_w is not None and t > 1 and proj_w.shape == (case["proj_weight"].shape[0] // t,
                                                                  case["proj_weight"].shape[1]):
                raise Wrong(f"proj_weight on rank {r} of {t}: yours has shape {proj_w.shape}, a cut of its rows "
                            f"(output features). proj is row-parallel: rank r holds the hidden features fc gave it, "
                            f"so it keeps proj's INPUT features, the columns of w (out, in)")
            _expect_slice(proj_w, case["proj_weight"], expected[2], "proj_weight", 1,
                          "its input features: the hidden features fc's rows give this rank", r, t)
            if proj_b is None or proj_b.shape != case["proj_bias"].shape:
                raise Wrong(f"proj_bias on rank {r} of {t} has shape {None if proj_b is None else proj_b.shape}: it "
                            f"stays whole, {case['proj_bias'].shape}, on every rank. g sums the partial outputs "
                            f"x_r w_rᵀ, and the bias is added once, after the sum (a slice of it would not even "
                            f"match the output's width)")
            if t > 1 and np.allclose(proj_b, case["proj_bias"] / t, rtol=1e-12, atol=0):
                raise Wrong(f"proj_bias on rank {r} of {t} is the bias divided by t: the row-parallel layer adds the "
                            f"whole bias once, after g's sum (RowParallelLinear: y = g(x_r w_rᵀ) + b), not a t-th of "
                            f"it before the sum")
            expect_close(proj_b, case["proj_bias"], f"proj_bias on rank {r} of {t} (whole, as given)", rtol=0, atol=0)
    whole = mlp_whole(case)
    for t in (2, 4):
        for r, got in enumerate(tensor_parallel_mlp(case, t, slices=mlp_slices)):
            expect_close(got["y"], whole["y"], f"the MLP's output on rank {r} of {t} with your slices")


def _heads(rows, c: int, d: int) -> str:
    """Which heads of q, k and v the given rows of a fused (3C, C) weight belong to."""
    parts = []
    for part, name in enumerate("qkv"):
        heads = sorted({(i % c) // d for i in rows if i // c == part})
        whole = [h for h in heads if all(part * c + h * d + j in rows for j in range(d))]
        text = ("heads " + ", ".join(str(h) for h in heads)) if heads else "no heads"
        if heads and whole != heads:
            text += " (some partly)"
        parts.append(f"{name}: {text}")
    return "; ".join(parts)


def check_qkv_slices(qkv_slices) -> None:
    """Check: the fused qkv projection's slices on rank r."""
    rng = np.random.default_rng(13)
    for c, n_head in ((8, 4), (12, 6), (12, 2)):
        d = c // n_head
        weight, bias = rng.standard_normal((3 * c, c)), rng.standard_normal(3 * c)  # (3C, C), (3C,)
        for t in (t for t in (1, 2, 3, 4) if n_head % t == 0):
            for r in range(t):
                got = qkv_slices(weight.copy(), bias.copy(), n_head, r, t)
                if not isinstance(got, (tuple, list)) or len(got) != 2:
                    raise Wrong(f"return the 2 arrays (qkv_weight_r, qkv_bias_r); got {shown(got)}")
                w, b = (np.asarray(a) if a is not None else None for a in got)
                expected_w, expected_b = reference_qkv_slices(weight, bias, n_head, r, t)
                rows = _which(expected_w, weight, 0)
                first = f"C = {c}, {n_head} heads of {d}, t = {t}: rank {r} computes heads " \
                        f"{_ranges(range(r * n_head // t, (r + 1) * n_head // t))}, so it needs those heads of q, k " \
                        f"and v: rows {_ranges(rows)} of the fused weight (q is rows 0..{c - 1}, k {c}..{2 * c - 1}, " \
                        f"v {2 * c}..{3 * c - 1})"
                if w is None or w.shape != expected_w.shape:
                    raise Wrong(f"{first}, a ({len(rows)}, {c}) slice; yours has shape "
                                f"{None if w is None else w.shape}")
                if not np.array_equal(w, expected_w):
                    have = _which(w, weight, 0)
                    if have is None:
                        raise Wrong(f"{first}; yours holds numbers that are not rows of the weight")
                    hint = ""
                    if have == list(range(r * len(rows), (r + 1) * len(rows))):
                        hint = (". A contiguous block of the fused weight mixes the three: the attention code cuts "
                                "the rank's qkv output in three equal thirds and reads them as q, k and v, so each "
                                "third must be this rank's heads of one of them")
                    raise Wrong(f"{first}; yours holds rows {_ranges(have)}, i.e. {_heads(have, c, d)}{hint}")
                if b is None or b.shape != expected_b.shape or not np.array_equal(b, expected_b):
                    have = None if b is None or b.ndim != 1 else _which(b[:, None], bias[:, None], 0)
                    raise Wrong(f"{first}; the bias follows the weight's rows: {_ranges(rows)}; yours holds "
                                + (f"shape {None if b is None else b.shape}" if have is None else _ranges(have)))


__all__ = ["ThreadComm", "run_ranks", "mlp_layers", "slice_difference", "reference_mlp_slices", "reference_qkv_slices",
           "mlp_case", "mlp_whole", "tensor_parallel_mlp", "check_conjugate_operators", "check_mlp_slices",
           "check_qkv_slices"]


# ------------------------------------------------------------------------------------------------
# Exercise 4: the all-reduce bytes of one micro-batch through a pipeline stage
# ------------------------------------------------------------------------------------------------

# (blocks, tokens N, width C, t, itemsize, first stage, last stage): t divides N and C
ALLREDUCE_CASES = [(2, 16, 16, 2, 8, True, True), (3, 12, 24, 3, 4, True, True), (4, 8, 32, 4, 2, True, False),
                   (2, 24, 12, 2, 8, False, True), (5, 12, 12, 4, 4, False, False), (1, 6, 6, 2, 8, True, False),
                   (2, 16, 16, 1, 8, True, True), (3, 30, 60, 6, 2, False, True), (2, 8, 8, 8, 4, False, False)]


def reference_tp_allreduce_bytes(n_layer, tokens, width, t, itemsize, first, last) -> int:
    """communication.py's count: the bytes one rank of t sends in the all-reduces of one micro-batch's forward,
    backward and loss through `n_layer` blocks, without sequence parallelism."""
    from refimpl.parallel.tensor_parallel.communication import StepShape, bytes_per_step  # noqa: PLC0415

    shape = StepShape(tokens=tokens, width=width, blocks=n_layer, micro_batches=1, has_embedding=first, has_head=last)
    return bytes_per_step(shape, False, t, itemsize)["allreduce"]


def _allreduce_mistakes(L, N, C, t, item, first, last) -> dict:
    """{description: bytes} for the usual wrong derivations (ring counting 2E(t − 1)/t elements)."""
    ring_bytes = lambda elements: 2 * elements * (t - 1) // t * item  # noqa: E731
    ends, loss = int(first) + int(last), (3 * N if last else 0)
    right = (4 * L + ends) * N * C + loss
    return {
        "the loss's all-reduces are missing: the head's stage all-reduces 3N numbers (the row maxima, Σexp and "
        "the target logits)": ring_bytes(right - loss),
        "the loss all-reduces N numbers, not 3N: besides the row maxima, Σexp and the target logit (2N) are "
        "summed": ring_bytes(right - loss + (N if last else 0)),
        "a stage without the head computes no loss: only the last stage all-reduces its 3N numbers":
            ring_bytes(right - loss + 3 * N),
        "the ends are missing: the first stage's embedding (vocabulary-parallel: g in forward) and the last "
        "stage's head (column-parallel: f in backward) each all-reduce N·C once more":
            ring_bytes(right - ends * N * C),
        "every stage counted the embedding's and the head's all-reduces: only the first stage holds the embedding "
        "and only the last the head": ring_bytes(right + (2 - ends) * N * C),
        "the embedding's all-reduce is missing: the first stage's vocabulary-parallel embedding sums its partial "
        "lookups (g in forward), N·C once": ring_bytes(right - (N * C if first else 0)) if first else -1,
        "the head's all-reduce is missing: the last stage's column-parallel head all-reduces dL/dx in backward "
        "(f), N·C once": ring_bytes(right - (N * C if last else 0)) if last else -1,
        "2 all-reduces per block; a block has 4: g after attention and after the MLP in forward, and f before "
        "each in backward": ring_bytes(2 * L * N * C + ends * N * C + loss),
        "only the forward's all-reduces: f's backward all-reduces as many as g's forward":
            ring_bytes((2 * L + int(first)) * N * C + loss),
        "a ring all-reduce of E elements sends 2E(t − 1)/t, not E(t − 1)/t (that is a reduce-scatter or an "
        "all-gather alone)": right * (t - 1) // t * item,
        "a ring all-reduce of E elements sends 2E(t − 1)/t elements, not 2E: each rank sends t − 1 of its t "
        "blocks twice": 2 * right * item,
        "bytes, not elements: multiply by itemsize": ring_bytes(right) // item,
    }


def check_tp_allreduce_bytes(tp_allreduce_bytes) -> None:
    """Check: tensor parallelism's all-reduce bytes per micro-batch, for a pipeline stage."""
    for L, N, C, t, item, first, last in ALLREDUCE_CASES:
        expected = reference_tp_allreduce_bytes(L, N, C, t, item, first, last)
        got = tp_allreduce_bytes(L, N, C, t, item, first, last)
        if got == expected:
            continue
        where = (f"{L} blocks, N = {N} tokens, C = {C}, t = {t}, itemsize {item}, "
                 f"{'first' if first else 'not the first'} and {'last' if last else 'not the last'} stage")
        if t == 1:
            raise Wrong(f"{where}: one rank sends nothing (a group of 1 has no one to send to); you said {shown(got)}")
        hint = next((why for why, wrong in _allreduce_mistakes(L, N, C, t, item, first, last).items()
                     if wrong == got and wrong != expected), None)
        raise Wrong(f"{where}: one rank sends {expected:,} bytes in all-reduces; you said {shown(got)}"
                    + (f": {hint}" if hint else ""))
