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

from . import Wrong, expect_close, in_student_process, plain_array, shown

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
# The MLP of tutorial 10, whole and cut as its section 2 shows, for the checks
# ------------------------------------------------------------------------------------------------


def mlp_rank_slices(fc_weight, fc_bias, proj_weight, proj_bias, r: int, t: int) -> tuple:
    """Rank r's slices of an MLP, cut as section 2 of tutorial 10 shows: fc by output features (rows of
    its (out, in) weight) and proj by input features (columns), both block r of the hidden features;
    proj's bias whole (g adds it once, after the sum)."""
    hidden = fc_weight.shape[0] // t  # 4C/t hidden features per rank
    mine = slice(r * hidden, (r + 1) * hidden)
    return (np.array(fc_weight[mine]), np.array(fc_bias[mine]), np.array(proj_weight[:, mine]),
            np.array(proj_bias, copy=True))


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


def tensor_parallel_mlp(case: dict, t: int, slices=None, f=None, g=None) -> list:
    """Run the MLP on t ranks; each rank's {"y", "x" (its dL/dx), its slices' gradients, "bytes"}.
    `slices` defaults to mlp_rank_slices."""
    slices = slices or mlp_rank_slices

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


def _observe_f(f, x0, partial) -> list:
    """Each rank's (f's forward output, its backward called directly, x's gradient, the gradient handed
    to backward afterwards) for input x0 and rank r's part partial[r] of dL/dx."""
    t = len(partial)

    def program(comm):
        x = Tensor(x0.copy(), requires_grad=True)
        y = f.apply(x, comm)
        out = np.array(y.data, copy=True)
        direct = _backward_returns(y.grad_fn, partial[comm.rank].copy(), "f", t) if y.grad_fn else None
        given = partial[comm.rank].copy()
        y.backward(given)
        return [out, _array_or_none(direct), _array_or_none(x.grad), given]

    return run_ranks(t, program)


def _observe_g(g, partial, dy) -> list:
    """Each rank's (g's forward output, its input after forward, its backward called directly, the
    input's gradient) for rank r's partial output partial[r] and dL/dy."""
    t = len(partial)

    def program(comm):
        p = Tensor(partial[comm.rank].copy(), requires_grad=True)
        y = g.apply(p, comm)
        out, after = np.array(y.data, copy=True), np.array(p.data, copy=True)
        direct = _backward_returns(y.grad_fn, dy.copy(), "g", t) if y.grad_fn else None
        y.backward(dy.copy())
        return [out, after, _array_or_none(direct), _array_or_none(p.grad)]

    return run_ranks(t, program)


def _array_or_none(value):
    return None if value is None else np.array(value, dtype=np.float64)


OWN_OPERATORS = (CopyToTensorParallel, ReduceFromTensorParallel, GatherSequence, ReduceScatterSequence)


def evaluate_conjugate_operators(conjugate_operators, f_cases: list, g_cases: list, mlp: dict) -> dict:
    """Runs where the student's code lives (harness.in_student_process): the student's f and g on the
    inputs the check sent, on simulated ranks. Returns plain data: {"f": per case, each rank's
    observations; "g": the same; "mlp": per t, each rank's output and gradients of the MLP built with
    f and g on the slices sent}, or {"wrong": why} when the classes cannot be run at all."""
    try:
        operators = conjugate_operators()
        if not isinstance(operators, (tuple, list)) or len(operators) != 2:
            raise Wrong(f"return the pair of classes (f, g); got {shown(operators)[:200]}")
        f, g = operators
        for name, cls in (("f", f), ("g", g)):
            if not (isinstance(cls, type) and issubclass(cls, Function)):
                raise Wrong(f"{name} must be a class derived from refimpl.autograd.Function (return the class "
                            f"itself, not an instance or a function); got {shown(cls)[:200]}")
            if issubclass(cls, OWN_OPERATORS):
                base = next(b for b in OWN_OPERATORS if issubclass(cls, b))
                raise Wrong(f"{name} is refimpl's {base.__name__}, or derives from it: write forward and backward "
                            f"yourself")
        seen = {"f": [_observe_f(f, case["x"], case["partial"]) for case in f_cases],
                "g": [_observe_g(g, case["partial"], case["dy"]) for case in g_cases], "mlp": []}
        for rank_slices in mlp["slices"]:
            def program(comm, rank_slices=rank_slices):
                got = _mlp_on_rank(comm, mlp["case"], rank_slices[comm.rank], f, g)
                return {key: _array_or_none(got[key]) for key in ("y", "x", *MLP_NAMES)}

            seen["mlp"].append(run_ranks(len(rank_slices), program))
        return seen
    except Wrong as exc:  # a form the check can name without running anything further
        return {"wrong": str(exc)}


def _judge_f(ranks, x0, partial) -> None:
    t, total = len(partial), np.sum(partial, axis=0)
    if not isinstance(ranks, list) or len(ranks) != t:
        raise Wrong(f"with t = {t} ranks: expected the observations of {t} ranks of f")
    for r, seen in enumerate(ranks):
        where = f"with t = {t} ranks, rank {r}"
        if not isinstance(seen, list) or len(seen) != 4:
            raise Wrong(f"{where}: no observations of f")
        out, direct, grad, given = seen
        out, given = plain_array(out, f"{where}: f's forward output"), plain_array(given, f"{where}: dL/dy")
        if _times(out, x0):
            raise Wrong(f"{where}: f's forward returned {_times(out, x0)} its input (t = {t}): f must be the identity "
                        f"in forward -- every rank already holds the whole x, and summing t equal copies multiplies "
                        f"it by t (the all-reduce belongs to f's backward, and to g's forward)")
        expect_close(out, x0, f"{where}: f's forward output (it must be the identity)")
        if grad is None:
            raise Wrong(f"{where}: x got no gradient through f: is its backward's first element None?")
        grad = plain_array(grad, f"{where}: the gradient of x")
        if np.allclose(grad, partial[r], rtol=1e-10, atol=1e-12):
            raise Wrong(f"{where}: f's backward returned the rank's own gradient unchanged; it must all-reduce "
                        f"(sum) it over the group: each rank's gradient of x flows only through its own slice of "
                        f"the column-parallel layer, and dL/dx is the sum of the t parts")
        if _times(grad, total):
            raise Wrong(f"{where}: f's backward returned {_times(grad, total)} the sum of the ranks' gradients: "
                        f"all-reduce once")
        expect_close(grad, total, f"{where}: the gradient of x through f (the sum over ranks of the gradient "
                                  f"each rank gives f's backward)")
        if direct is not None and not np.allclose(plain_array(direct, f"{where}: f's backward"), total,
                                                  rtol=1e-10, atol=1e-12):
            raise Wrong(f"{where}: f's backward gives different results when called twice with the same gradient")
        if not np.array_equal(given, partial[r]):
            raise Wrong(f"{where}: f's backward changed the gradient it was given in place (comm.allreduce sums "
                        f"into the array it is handed): that array is not f's to change -- the engine may have "
                        f"handed the same array to another operation (an addition, e.g. a residual connection, "
                        f"passes its output's gradient to both inputs unchanged); all-reduce a copy")


def _judge_g(ranks, partial, dy) -> None:
    t, total = len(partial), np.sum(partial, axis=0)
    if not isinstance(ranks, list) or len(ranks) != t:
        raise Wrong(f"with t = {t} ranks: expected the observations of {t} ranks of g")
    for r, seen in enumerate(ranks):
        where = f"with t = {t} ranks, rank {r}"
        if not isinstance(seen, list) or len(seen) != 4:
            raise Wrong(f"{where}: no observations of g")
        out, after, direct, grad = seen
        out, after = plain_array(out, f"{where}: g's forward output"), plain_array(after, f"{where}: g's input")
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
        grad = plain_array(grad, f"{where}: the gradient of g's input")
        if _times(grad, dy):
            raise Wrong(f"{where}: g's backward returned {_times(grad, dy)} the gradient it was given (t = {t}): g "
                        f"must be the identity in backward -- every rank already holds the same, whole dL/dy (all "
                        f"that follows g is replicated), and all-reducing it counts it t times")
        expect_close(grad, dy, f"{where}: the gradient of g's input (it must be the identity in backward)")
        if direct is not None and not np.allclose(plain_array(direct, f"{where}: g's backward"), dy,
                                                  rtol=1e-10, atol=1e-12):
            raise Wrong(f"{where}: g's backward gives different results when called twice with the same gradient")


def check_conjugate_operators(conjugate_operators) -> None:
    """Check: the conjugate operators f and g."""
    rng = np.random.default_rng(10)
    f_cases, g_cases = [], []
    for t in (2, 3):
        f_cases.append({"x": rng.standard_normal((2, 3, 4)),  # (B, T, C): the same on every rank (replicated)
                        "partial": [rng.standard_normal((2, 3, 4)) for _ in range(t)]})  # rank r's part of dL/dx
        g_cases.append({"partial": [rng.standard_normal((2, 3, 4)) for _ in range(t)],  # rank r's x_r w_rᵀ
                        "dy": rng.standard_normal((2, 3, 4))})  # dL/dy: the same on every rank
    case = mlp_case(6, seed=11)  # width 6, hidden 24: t = 2, 3 and 4 all divide it
    sizes = (2, 3, 4)
    slices = [[mlp_rank_slices(*(case[n] for n in MLP_NAMES), r, t) for r in range(t)] for t in sizes]
    seen = in_student_process(evaluate_conjugate_operators, conjugate_operators, _copied(f_cases),
                              _copied(g_cases), {"case": _copied(case), "slices": _copied(slices)})
    if not isinstance(seen, dict):
        raise Wrong(f"the evaluation of f and g returned {type(seen).__name__}, not their outputs and gradients")
    if "wrong" in seen:
        raise Wrong(str(seen["wrong"])[:2000])
    if not all(isinstance(seen.get(k), list) for k in ("f", "g", "mlp")) or (
            len(seen["f"]), len(seen["g"]), len(seen["mlp"])) != (2, 2, len(sizes)):
        raise Wrong("the evaluation of f and g did not return every case's outputs and gradients")
    for f_seen, g_seen, f_case, g_case in zip(seen["f"], seen["g"], f_cases, g_cases):
        _judge_f(f_seen, f_case["x"], f_case["partial"])
        _judge_g(g_seen, g_case["partial"], g_case["dy"])
    whole = mlp_whole(case)
    for t, ranks in zip(sizes, seen["mlp"]):
        if not isinstance(ranks, list) or len(ranks) != t:
            raise Wrong(f"the tensor-parallel MLP on t = {t} ranks: expected {t} ranks' results")
        for r, got in enumerate(ranks):
            mine = mlp_rank_slices(*(whole[n] for n in MLP_NAMES), r, t)  # this rank's slices of the gradients
            where = f"the tensor-parallel MLP (fc column-parallel after f, proj row-parallel before g) on t = {t} " \
                    f"ranks, rank {r}"
            if not isinstance(got, dict):
                raise Wrong(f"{where}: no results")
            for name, expected in (("y", whole["y"]), ("x", whole["x"]), *zip(MLP_NAMES, mine)):
                what = {"y": "the output y", "x": "dL/dx"}.get(name, f"the gradient of its slice of {name}")
                if got.get(name) is None:
                    raise Wrong(f"{where}: {what} is missing (no gradient reached it)")
                expect_close(plain_array(got[name], f"{where}: {what}"), expected, f"{where}: {what}", atol=1e-12,
                             rtol=0)


def _copied(value):
    """A deep copy of lists, tuples and dicts of arrays: what is sent to the student's process (its
    writes come back into what was sent, never into the check's own arrays)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value.copy() if isinstance(value, np.ndarray) else value


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


# Exercise 2: Llama's MLP, SwiGLU (Shazeer, arXiv 2002.05202), y = (SiLU(x W_gᵀ) ⊙ x W_uᵀ) W_dᵀ with
# hidden width H and no biases; W_g and W_u fused in one weight gate_up (2H, C): W_g's rows, then W_u's.


def reference_swiglu_slices(gate_up_weight, down_weight, r: int, t: int) -> tuple:
    """refimpl's cut of a fused SwiGLU MLP (exercise 2's answer): block r of the hidden features of the
    gate and of up (two blocks of the fused weight's rows), and the same features of down (its columns)."""
    return WeightSplit(0, parts=2).shard(gate_up_weight, r, t), WeightSplit(1).shard(down_weight, r, t)


def swiglu(x, gate_up_weight, down_weight):
    """The SwiGLU MLP on plain arrays, as every rank runs it on its slices: h = x gate_upᵀ, split in
    two halves (gate, up), SiLU(gate) ⊙ up, times downᵀ. On a rank, a partial output for g to sum."""
    h = x @ gate_up_weight.T  # (N, 2H') for the H' hidden features held
    gate, up = np.split(h, 2, axis=-1)  # (N, H') each
    return (gate / (1 + np.exp(-gate)) * up) @ down_weight.T  # SiLU(z) = z σ(z); (N, H') @ (H', C) -> (N, C)


def _features(rows, h: int) -> str:
    """Which hidden features of the gate and of up the given rows of a fused (2H, C) weight are."""
    parts = []
    for part, name in enumerate(("gate", "up")):
        mine = [i - part * h for i in rows if i // h == part]
        parts.append(f"{name} features {_ranges(mine)}" if mine else f"no {name} features")
    return ", ".join(parts)


def check_swiglu_slices(swiglu_slices) -> None:
    """Check: a fused SwiGLU MLP's slices on rank r."""
    rng = np.random.default_rng(12)
    for c, h, sizes in ((4, 8, (2, 4, 1)), (6, 12, (3, 2))):
        x = rng.standard_normal((5, c))  # (N, C)
        gate_up, down = rng.standard_normal((2 * h, c)), rng.standard_normal((c, h))  # (2H, C), (C, H)
        whole = swiglu(x, gate_up, down)  # (N, C): one process
        for t in sizes:
            partial = []
            for r in range(t):
                got = swiglu_slices(gate_up.copy(), down.copy(), r, t)
                if not isinstance(got, (tuple, list)) or len(got) != 2:
                    raise Wrong(f"return the 2 arrays (gate_up_weight_r, down_weight_r); got {shown(got)}")
                gw, dw = (None if a is None else np.asarray(a) for a in got)
                expected_gw, expected_dw = reference_swiglu_slices(gate_up, down, r, t)
                rows = _which(expected_gw, gate_up, 0)
                first = (f"C = {c}, H = {h}, t = {t}: rank {r} holds hidden features {_ranges(rows[:h // t])}, so "
                         f"gate_up's rows {_ranges(rows)} ({_features(rows, h)}; the gate is rows 0..{h - 1}, up "
                         f"{h}..{2 * h - 1})")
                if gw is None or gw.shape != expected_gw.shape:
                    hint = ""
                    if gw is not None and t > 1 and gw.shape == (2 * h, c // t):
                        hint = (": a cut of its columns (input features). gate and up are column-parallel in the "
                                "paper's sense, a cut of their output features, and refimpl's (out, in) layout "
                                "stores those as rows")
                    raise Wrong(f"{first}, a ({2 * h // t}, {c}) slice; yours has shape "
                                f"{None if gw is None else gw.shape}{hint}")
                if not np.array_equal(gw, expected_gw):
                    have = _which(gw, gate_up, 0)
                    if have is None:
                        raise Wrong(f"{first}; yours holds numbers that are not rows of gate_up")
                    hint = ""
                    gate = have[:len(have) // 2]
                    up = [i - h for i in have[len(have) // 2:]]
                    if have == list(range(r * len(rows), (r + 1) * len(rows))):
                        hint = (". That is a contiguous block of the fused weight: the rank's code splits its "
                                "output in two halves and multiplies them feature by feature, SiLU(gate_j) · up_j, "
                                "so the first half must be its features of the gate and the second the same "
                                "features of up")
                    elif all(i < h for i in gate) and all(0 <= i < h for i in up) and gate != up:
                        hint = (". The halves hold different hidden features: SiLU(gate_j) multiplies up_j, the "
                                "same feature j, so both halves need the same features, in the same order")
                    raise Wrong(f"{first}; yours holds rows {_ranges(have)}, i.e. {_features(have, h)}{hint}")
                if dw is not None and t > 1 and dw.shape == (c // t, h):
                    raise Wrong(f"down_weight on rank {r} of {t}: yours has shape {dw.shape}, a cut of its rows "
                                f"(output features). down is row-parallel: the rank holds only its hidden "
                                f"features, so it keeps down's INPUT features, the columns of w (out, in), and g "
                                f"sums the partial outputs")
                _expect_slice(dw, down, expected_dw, "down_weight", 1,
                              "its input features: the hidden features whose gate and up it holds", r, t)
                partial.append(swiglu(x, gw, dw))
            expect_close(sum(partial), whole, f"C = {c}, H = {h}, t = {t}: the sum over ranks of the partial "
                                              f"outputs with your slices (one process's output)")


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


__all__ = ["ThreadComm", "run_ranks", "mlp_rank_slices", "reference_swiglu_slices", "reference_qkv_slices", "swiglu",
           "mlp_case", "mlp_whole", "tensor_parallel_mlp", "evaluate_conjugate_operators", "check_conjugate_operators",
           "check_swiglu_slices", "check_qkv_slices"]


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
